"""Few-shot linear evaluation of the ViT paper (§4.1): "a regularized least-squares regression
problem that maps the (frozen) representation of a subset of training images to {−1, 1}^K target
vectors", in closed form as big_vision's ``evaluators/fewshot_lsr.py``: support features
standardised by their own mean and std, a bias column of 100 (which the penalty barely touches),
W = argmin ‖XW − Y‖² + λ‖W‖² with Y = 2·onehot − 1 and λ = 2¹⁰ (keeps n ≈ d off the
double-descent peak). Each seed orders every class at random; its first k are the k-shot support.
Optional ``l2_grid``: λ picked on a half/half split of each class's support (k ≥ 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def ridge_solve(x: Tensor, y: Tensor, l2_reg: float) -> Tensor:
    """W ``[d, K]`` minimising ‖xW − y‖² + λ‖W‖² for x ``[n, d]``, y ``[n, K]`` (float64): the primal
    (XᵀX + λI)⁻¹XᵀY when n ≥ d, else the dual Xᵀ(XXᵀ + λI)⁻¹Y (the same W, a smaller system)."""
    x, y = x.double(), y.double()
    n, d = x.shape
    if n >= d:
        return torch.linalg.solve(x.T @ x + l2_reg * torch.eye(d, dtype=x.dtype, device=x.device), x.T @ y)  # [d, K]
    return x.T @ torch.linalg.solve(x @ x.T + l2_reg * torch.eye(n, dtype=x.dtype, device=x.device), y)  # [d, K]


def fewshot_fit_predict(support_x: Tensor, support_y: Tensor, query_x: Tensor, num_classes: int, l2_reg: float) -> Tensor:
    """Fit the least-squares classifier on a support ``[n, F]`` and predict the queries' labels ``[Q]``."""
    mean = support_x.double().mean(dim=0, keepdim=True)  # [1, F]
    std = support_x.double().std(dim=0, correction=0, keepdim=True) + 1e-5  # population std, as jnp.std (+ big_vision's 1e-5)

    def design(x: Tensor) -> Tensor:  # [n, F] -> [n, F + 1]: standardised, with the bias column
        return F.pad((x.double() - mean) / std, (0, 1), value=100.0)

    targets = 2.0 * F.one_hot(support_y.long(), num_classes).double() - 1.0  # [n, K] in {-1, 1}
    return (design(query_x) @ ridge_solve(design(support_x), targets, l2_reg)).argmax(dim=1)


def _pick_l2(x: Tensor, y: Tensor, per_class: list[Tensor], num_classes: int, l2_grid: Sequence[float]) -> float:
    """The best λ of the grid by a half/half split of every class's support (ties: the largest)."""
    fit = torch.cat([idx[: (idx.numel() + 1) // 2] for idx in per_class])
    val = torch.cat([idx[(idx.numel() + 1) // 2 :] for idx in per_class])
    accs = {l2: (fewshot_fit_predict(x[fit], y[fit], x[val], num_classes, l2) == y[val]).double().mean().item()
            for l2 in sorted(l2_grid, reverse=True)}
    return float(max(accs, key=accs.__getitem__))  # (the first of equals: the largest)


@dataclass
class FewShotEvaluator:
    """The few-shot protocol (module docstring): ``shots`` per class, averaged over ``num_seeds`` support
    draws (big_vision: 3) seeded ``seed``, ``seed + 1`` ...; the ridge ``l2_reg`` or the best of ``l2_grid``."""

    shots: list[int] | tuple[int, ...] = (1, 5, 10, 25)
    num_seeds: int = 5
    l2_reg: float = 2.0**10
    l2_grid: list[float] | None = None
    seed: int | None = None

    def evaluate(self, train_features: Tensor, train_labels: Tensor, test_features: Tensor, test_labels: Tensor,
                 num_classes: int | None = None) -> dict[str, float]:
        """Test accuracy of k-shot classifiers: ``{"{k}shot": mean, "{k}shot_std": std over seeds}``."""
        assert train_features.ndim == test_features.ndim == 2 and train_features.shape[1] == test_features.shape[1]
        train_features, train_labels = train_features.cpu(), train_labels.long().cpu()
        test_features, test_labels = test_features.cpu(), test_labels.long().cpu()
        num_classes = num_classes or int(max(train_labels.max(), test_labels.max())) + 1
        most, counts = max(self.shots), torch.bincount(train_labels, minlength=num_classes)
        if short := [(c, int(n)) for c, n in enumerate(counts) if n < most]:
            fewest = int(counts.min())
            fitting = " ".join(map(str, sorted(k for k in self.shots if k <= fewest) or [fewest]))
            raise ValueError(f"{most}-shot evaluation needs >= {most} training examples of every class; "
                             + ", ".join(f"class {c} has {n}" for c, n in short[:10]) + (" ..." if len(short) > 10 else "")
                             + (f"; ask for at most {fewest} shots (e.g. shots {fitting})" if fewest else ""))
        accs: dict[int, list[float]] = {k: [] for k in self.shots}
        classes = [(train_labels == c).nonzero().flatten() for c in range(num_classes)]
        for s in range(self.num_seeds):
            g = torch.Generator().manual_seed((self.seed or 0) + s)
            orders = [idx[torch.randperm(idx.numel(), generator=g)] for idx in classes]  # a random order of each class
            for k in self.shots:
                idx = torch.cat([order[:k] for order in orders])  # [k * C], class-major
                sx, sy = train_features[idx], train_labels[idx]
                l2 = self.l2_reg
                if self.l2_grid is not None and k >= 2:
                    l2 = _pick_l2(sx, sy, list(torch.arange(k * num_classes).reshape(num_classes, k)), num_classes, self.l2_grid)
                accs[k].append((fewshot_fit_predict(sx, sy, test_features, num_classes, l2) == test_labels).double().mean().item())
        per_k = {k: torch.tensor(a, dtype=torch.float64) for k, a in accs.items()}
        return {f"{k}shot{stat}": value.item() for k, a in per_k.items() for stat, value in (("", a.mean()), ("_std", a.std(correction=0)))}
