"""Few-shot linear evaluation of the ViT paper (§4.1 "Metrics"; specs §5).

"Few-shot accuracies are obtained by solving a regularized least-squares regression problem that
maps the (frozen) representation of a subset of training images to {−1, 1}^K target vectors",
solved in closed form. The details follow the authors' evaluator (big_vision
``evaluators/fewshot_lsr.py``):

- the support features are standardised with their own per-dimension mean and std (the test
  features with the same statistics);
- a constant column of 100 is appended: the bias, so large that the ridge penalty barely
  touches it;
- W = argmin ‖XW − Y‖² + λ‖W‖², Y = 2·onehot − 1, in the primal form (XᵀX + λI)⁻¹XᵀY when
  n ≥ d, or the dual form Xᵀ(XXᵀ + λI)⁻¹Y when n < d (the same solution, a smaller system);
- λ = 2¹⁰ (big_vision's ``config.l2_reg``). Ridge needs a large λ here: with n ≈ d (25 shots ×
  10 classes vs a 192-d feature) a near-interpolating solution sits on the double-descent peak;
- shots 1/5/10/25 per class; each seed draws one random order of every class's training
  examples and the k-shot support is the first k of it (nested supports, as big_vision). We
  average over 5 seeds (big_vision: 3) and also report the std over seeds.

Optional λ selection (``l2_grid``): for k ≥ 2 shots, each class's support is split in half, every
λ of the grid is fitted on one half and scored on the other, and the best λ (the largest on ties)
is refitted on the whole support. A 1-shot support cannot be split and uses ``l2_reg``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

BIAS_CONSTANT = 100.0
DEFAULT_SHOTS: tuple[int, ...] = (1, 5, 10, 25)


def ridge_solve(x: Tensor, y: Tensor, l2_reg: float) -> Tensor:
    """W ``[d, K]`` minimising ‖xW − y‖² + λ‖W‖² for x ``[n, d]``, y ``[n, K]`` (float64).

    Primal (XᵀX + λI)W = XᵀY when n ≥ d, dual W = Xᵀ(XXᵀ + λI)⁻¹Y when n < d; both are the
    ridge solution (push-through identity), the dual only solves an n×n system."""
    if l2_reg <= 0:
        raise ValueError(f"l2_reg must be > 0 (the closed form needs a regularised system), got {l2_reg}")
    x, y = x.double(), y.double()
    n, d = x.shape
    if n >= d:
        gram = x.T @ x + l2_reg * torch.eye(d, dtype=x.dtype, device=x.device)  # [d, d]
        return torch.linalg.solve(gram, x.T @ y)  # [d, K]
    gram = x @ x.T + l2_reg * torch.eye(n, dtype=x.dtype, device=x.device)  # [n, n]
    return x.T @ torch.linalg.solve(gram, y)  # [d, K]


def _design(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Standardise and append the bias column: ``[n, F]`` -> ``[n, F + 1]`` (float64)."""
    x = (x.double() - mean) / std
    return F.pad(x, (0, 1), value=BIAS_CONSTANT)


def fewshot_fit_predict(
    support_x: Tensor, support_y: Tensor, query_x: Tensor, num_classes: int, l2_reg: float
) -> Tensor:
    """Fit the regularised least-squares classifier on a support set and predict query labels."""
    mean = support_x.double().mean(dim=0, keepdim=True)  # [1, F]
    # population std as jnp.std; + 1e-5 as big_vision so constant features do not divide by 0
    std = support_x.double().std(dim=0, correction=0, keepdim=True) + 1e-5
    targets = 2.0 * F.one_hot(support_y.long(), num_classes).double() - 1.0  # [n, K] in {-1, 1}
    w = ridge_solve(_design(support_x, mean, std), targets, l2_reg)  # [F + 1, K]
    return (_design(query_x, mean, std) @ w).argmax(dim=1)  # [Q]


def _class_orders(labels: Tensor, num_classes: int, generator: torch.Generator) -> list[Tensor]:
    """A random permutation of each class's example indices."""
    orders = []
    for c in range(num_classes):
        idx = (labels == c).nonzero().flatten()
        orders.append(idx[torch.randperm(idx.numel(), generator=generator)])
    return orders


def _pick_l2(
    x: Tensor, y: Tensor, per_class: list[Tensor], num_classes: int, l2_grid: Sequence[float]
) -> float:
    """Best λ of the grid by a half/half split of every class's support (ties: the largest λ)."""
    fit = torch.cat([idx[: (idx.numel() + 1) // 2] for idx in per_class])
    val = torch.cat([idx[(idx.numel() + 1) // 2 :] for idx in per_class])
    best_acc, best_l2 = -1.0, float(l2_grid[0])
    for l2 in sorted(l2_grid, reverse=True):
        pred = fewshot_fit_predict(x[fit], y[fit], x[val], num_classes, l2)
        acc = (pred == y[val]).double().mean().item()
        if acc > best_acc:
            best_acc, best_l2 = acc, float(l2)
    return best_l2


def _fewer_shots_hint(shots: Sequence[int], fewest: int) -> str:
    if fewest == 0:
        return ""  # a class without training examples: no shot count helps
    fitting = sorted(k for k in shots if k <= fewest) or [fewest]
    return f"; ask for at most {fewest} shots (e.g. shots {' '.join(map(str, fitting))})"


class FewShotEvaluator:
    """The few-shot protocol; the constructor is its configuration (module docstring).

    Args:
        shots: examples per class in the support set (ViT paper: 1, 5, 10, 25).
        num_seeds: random support draws averaged per shot count.
        l2_reg: the ridge λ on standardised features (big_vision: 2¹⁰).
        l2_grid: optional λ candidates chosen per support by a half/half split (k >= 2 shots).
        seed: first seed; draws use ``seed, seed + 1, ...``.
    """

    def __init__(
        self,
        shots: Sequence[int] = DEFAULT_SHOTS,
        num_seeds: int = 5,
        l2_reg: float = 2.0**10,
        l2_grid: Sequence[float] | None = None,
        seed: int = 0,
    ) -> None:
        if not shots or any(int(k) < 1 for k in shots):
            raise ValueError(f"shots must be positive integers, got {list(shots)}")
        if num_seeds < 1:
            raise ValueError(f"num_seeds must be >= 1, got {num_seeds}")
        if l2_reg <= 0:
            raise ValueError(f"l2_reg must be > 0, got {l2_reg}")
        if l2_grid is not None and (not l2_grid or any(v <= 0 for v in l2_grid)):
            raise ValueError(f"l2_grid must be a non-empty list of positive values, got {l2_grid}")
        self.shots = tuple(int(k) for k in shots)
        self.num_seeds = num_seeds
        self.l2_reg = l2_reg
        self.l2_grid = None if l2_grid is None else tuple(float(v) for v in l2_grid)
        self.seed = seed

    def evaluate(
        self,
        train_features: Tensor,
        train_labels: Tensor,
        test_features: Tensor,
        test_labels: Tensor,
        num_classes: int | None = None,
    ) -> dict[str, float]:
        """Accuracy on the test features of classifiers fitted to k-shot supports drawn from the
        training features. Returns ``{"{k}shot": mean, "{k}shot_std": std over seeds}`` for every
        k, fractions in [0, 1]."""
        if (
            train_features.ndim != 2
            or test_features.ndim != 2
            or train_features.shape[1] != test_features.shape[1]
        ):
            raise ValueError(
                "features must be [N, F] of equal width; "
                f"got {tuple(train_features.shape)} and {tuple(test_features.shape)}"
            )
        train_labels, test_labels = train_labels.long().cpu(), test_labels.long().cpu()
        train_features, test_features = train_features.cpu(), test_features.cpu()
        if num_classes is None:
            num_classes = int(max(train_labels.max(), test_labels.max())) + 1
        most = max(self.shots)
        counts = torch.bincount(train_labels, minlength=num_classes)
        short = [(c, int(counts[c])) for c in range(num_classes) if counts[c] < most]
        if short:
            listing = ", ".join(f"class {c} has {n}" for c, n in short[:10])
            raise ValueError(
                f"{most}-shot evaluation needs >= {most} training examples of every class; "
                f"{listing}{' ...' if len(short) > 10 else ''}{_fewer_shots_hint(self.shots, int(counts.min()))}"
            )

        accs: dict[int, list[float]] = {k: [] for k in self.shots}
        for s in range(self.num_seeds):
            orders = _class_orders(train_labels, num_classes, torch.Generator().manual_seed(self.seed + s))
            for k in self.shots:
                idx = torch.cat([order[:k] for order in orders])  # [k * C], class-major
                sx, sy = train_features[idx], train_labels[idx]
                l2 = self.l2_reg
                if self.l2_grid is not None and k >= 2:
                    per_class = list(torch.arange(k * num_classes).reshape(num_classes, k))
                    l2 = _pick_l2(sx, sy, per_class, num_classes, self.l2_grid)
                pred = fewshot_fit_predict(sx, sy, test_features, num_classes, l2)
                accs[k].append((pred == test_labels).double().mean().item())

        out: dict[str, float] = {}
        for k, values in accs.items():
            v = torch.tensor(values, dtype=torch.float64)
            out[f"{k}shot"] = v.mean().item()
            out[f"{k}shot_std"] = v.std(correction=0).item()
        return out
