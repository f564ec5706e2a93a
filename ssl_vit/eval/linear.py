"""Linear probe on frozen features (MAE §4 / Appendix A.3 ``main_linprobe.py``; specs §5).

The head is a BatchNorm without affine parameters followed by one Linear layer: the BN only
re-normalises the frozen features (their scale differs wildly between pretext methods), so one
recipe fits all, and the pair is still a linear classifier. Features are extracted once
(``extract_features``), so an epoch is a few small matrix products (100 epochs over 60k
784-d vectors: about a minute on one CPU core).

Recipe defaults: SGD, momentum 0.9, weight decay 0, linear warm-up then cosine decay to 0 per
step (MAE ``util/lr_sched.py``), ``lr = base_lr · batch_size / 256`` (the linear scaling rule),
head weights ~ trunc-normal(std 0.01) and zero bias (MAE ``main_linprobe.py``). The base LR
0.01 is our choice for SGD on BN-standardised features: on raw Fashion-MNIST pixels it gives
84.3 % top-1 in 100 epochs, the linear-classifier figure (specs §8); 0.1 reached 83.7 % (30 epochs).
MAE's own recipe is LARS (``optimizer="lars"``) with base LR 0.1 at batch 16384 for 90 epochs
(84.4 % on the same pixels at batch 1024).

Several base LRs sweep it, as the papers tune their probes (MoCo v3 §4 and DINO sweep the LR;
DINOv2 trains one classifier per setting on the same batches): one head per LR is trained on the
same batches of the training features less a held-out ``select_fraction``, the LR whose head is
most accurate on the held-out part wins (ties: the first listed), and the probe is trained again
on every training feature at that LR. The test split chooses nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightly.utils.scheduler import CosineWarmupScheduler
from torch import Tensor, nn

from ssl_vit.eval.metrics import topk_accuracy
from ssl_vit.heads import LinearProbeHead
from ssl_vit.training.progress import CountProgress


class LARS(torch.optim.Optimizer):
    """SGD with layer-wise adaptive rate scaling (You et al. 2017) as MAE's ``util/lars.py``:
    matrices (ndim > 1) get weight decay and the trust ratio η·‖w‖/‖update‖; vectors are plain
    SGD. Not ``lightly.utils.lars.LARS``: that one skips the trust ratio whenever weight decay is
    0, which is exactly MAE's linear-probe setting, so it would silently run plain SGD."""

    def __init__(
        self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, trust_coefficient: float = 0.001
    ) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:  # Lightning's automatic optimisation runs forward + backward here
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if p.ndim > 1:
                    update = update.add(p, alpha=group["weight_decay"])
                    p_norm, u_norm = torch.norm(p), torch.norm(update)
                    ratio = group["trust_coefficient"] * p_norm / u_norm
                    update = update * torch.where((p_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
                buf = self.state[p].get("mu")
                buf = update.clone() if buf is None else buf.mul_(group["momentum"]).add_(update)
                self.state[p]["mu"] = buf
                p.add_(buf, alpha=-group["lr"])
        return loss


# A linear probe's base LR (per 256 examples) when none is given, by optimiser. LARS scales each
# step by the trust ratio (about 0.001 x |w| / |g|), so SGD's LR barely moves it: MAE's linear
# probe (main_linprobe.py) runs LARS at base LR 0.1.
PROBE_BASE_LR: dict[str, float] = {"sgd": 0.01, "lars": 0.1}


def check_probe_settings(optimizer: str, base_lr: float | None, warmup_epochs: float) -> float:
    """Refuses the settings a linear probe cannot run (on fixed features or on images); returns
    the base LR, :data:`PROBE_BASE_LR` of the optimiser when ``base_lr`` is None."""
    if optimizer not in ("sgd", "lars"):
        raise ValueError(f"optimizer must be 'sgd' or 'lars', got {optimizer!r}")
    lr = PROBE_BASE_LR[optimizer] if base_lr is None else base_lr
    if warmup_epochs < 0 or lr <= 0:
        raise ValueError(f"need warmup_epochs >= 0 and base_lr > 0, got {warmup_epochs} and {lr}")
    return lr


def probe_optimizer(params: Iterable[nn.Parameter], optimizer: str, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """SGD with momentum, or :class:`LARS` (MAE's linear probe), over a probe's head."""
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return LARS(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def warmup_cosine(opt: torch.optim.Optimizer, warmup_epochs: float, steps_per_epoch: int, total_steps: int) -> CosineWarmupScheduler:
    """Per-step linear warm-up over ``warmup_epochs`` (at most the whole run), then cosine decay
    towards 0 (MAE ``util/lr_sched.py``: step t of T after W warm-up steps has
    ``cos(pi * (t - W) / (T - W))``, so the last step, and a one-step run, still trains; lightly's
    scheduler reaches its end value at ``max_epochs - 1``, hence ``total_steps + 1``); each
    parameter group keeps its own LR ratio."""
    warmup = min(int(warmup_epochs * steps_per_epoch), total_steps)
    return CosineWarmupScheduler(opt, warmup_epochs=warmup, max_epochs=total_steps + 1, end_value=0.0)


def _check(features: Tensor, labels: Tensor, what: str) -> None:
    if features.ndim != 2 or labels.shape != (features.shape[0],):
        raise ValueError(f"{what}: need features [N, F] and labels [N]; got {tuple(features.shape)} and {tuple(labels.shape)}")


class LinearProbe:
    """The linear-probe protocol; the constructor is its configuration (module docstring).

    Args:
        epochs, batch_size: passes over the training features and examples per step.
        base_lr: the LR is ``base_lr · batch_size / 256`` (linear scaling rule, as MAE/DINO);
            None: 0.01 for SGD, 0.1 for LARS (:data:`PROBE_BASE_LR`); several: a sweep that
            picks one on held-out training features (module docstring).
        select_fraction: the share of the training features held out to pick the LR of a sweep
            (unused with one LR).
        optimizer: ``"sgd"`` (momentum) or ``"lars"`` (MAE's linear-probe optimiser).
        momentum, weight_decay: SGD/LARS settings (MAE linear probe: weight decay 0).
        warmup_epochs: linear warm-up before the per-step cosine decay to 0.
        seed: head initialisation and batch order; the same seed gives the same head.
        device: where to train (default: where the features are).
        progress_every_n_seconds: a line of progress this often while the heads train (a
            probe over ImageNet's features can take an hour on a CPU); short runs print none.
    """

    def __init__(
        self,
        epochs: int = 100,
        batch_size: int = 256,
        base_lr: float | Sequence[float] | None = None,
        optimizer: Literal["sgd", "lars"] = "sgd",
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        warmup_epochs: int = 10,
        seed: int = 0,
        device: torch.device | str | None = None,
        select_fraction: float = 0.1,
        progress_every_n_seconds: float = 60.0,
    ) -> None:
        given = list(base_lr) if isinstance(base_lr, Sequence) else [base_lr]
        if not given or len(set(given)) != len(given):
            raise ValueError(f"base_lr: give one LR, or several distinct ones to sweep, got {base_lr}")
        lrs = [check_probe_settings(optimizer, lr, warmup_epochs) for lr in given]
        if epochs < 1 or batch_size < 2:
            raise ValueError(f"need epochs >= 1 and batch_size >= 2 (BatchNorm), got {epochs} and {batch_size}")
        if len(lrs) > 1 and not 0 < select_fraction < 1:
            raise ValueError(f"select_fraction must be in (0, 1) to hold out features for the LR sweep, got {select_fraction}")
        self.epochs = epochs
        self.batch_size = batch_size
        self.base_lrs = lrs
        self.base_lr = lrs[0]  # the LR of a single run; after a sweep's evaluate(), the one it picked
        self.select_fraction = select_fraction
        # What a sweep picked, for the result record (empty without a sweep).
        self.record_args: dict[str, Any] = {}
        self.optimizer = optimizer
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.warmup_epochs = warmup_epochs
        self.seed = seed
        self.device = device
        self.progress_every_n_seconds = progress_every_n_seconds

    def fit(self, features: Tensor, labels: Tensor, num_classes: int) -> LinearProbeHead:
        """Train a ``LinearProbeHead`` on pre-extracted features ``[N, F]`` at ``base_lr``.

        Every epoch visits a fresh seeded permutation in ``N // batch_size`` full batches (the
        remainder is dropped, as MAE's ``drop_last``; a set smaller than one batch is one
        batch)."""
        return self.fit_heads(features, labels, num_classes, [self.base_lr])[0]

    def fit_heads(self, features: Tensor, labels: Tensor, num_classes: int, base_lrs: Sequence[float]) -> list[LinearProbeHead]:
        """One head per base LR, trained together on the same batches: head ``i`` is the head
        ``fit`` trains at ``base_lrs[i]`` (same initialisation and batch order; the summed loss
        gives each head its own gradient, each head is its own parameter group)."""
        _check(features, labels, "linear probe")
        if features.shape[0] < 2:
            raise ValueError("the linear probe needs at least 2 training examples")
        if int(labels.min()) < 0 or int(labels.max()) >= num_classes:
            raise ValueError(f"labels must lie in 0..{num_classes - 1}")
        device = torch.device(self.device) if self.device is not None else features.device
        x, y = features.to(device).float(), labels.to(device).long()  # [N, F], [N]
        n = x.shape[0]
        bs = min(self.batch_size, n)
        steps_per_epoch = n // bs
        total = self.epochs * steps_per_epoch

        heads = []
        for _ in base_lrs:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                heads.append(LinearProbeHead(x.shape[1], num_classes).to(device))
        opt = probe_optimizer(heads[0].parameters(), self.optimizer, base_lrs[0] * bs / 256, self.momentum, self.weight_decay)
        for head, lr in zip(heads[1:], base_lrs[1:], strict=True):
            opt.add_param_group({"params": list(head.parameters()), "lr": lr * bs / 256})
        sched = warmup_cosine(opt, self.warmup_epochs, steps_per_epoch, total)
        gen = torch.Generator().manual_seed(self.seed)
        for head in heads:
            head.train()
        what = f"linear probe, {len(heads)} LRs" if len(heads) > 1 else "linear probe"
        progress = CountProgress(what, total=self.epochs, unit="epochs", every_n_seconds=self.progress_every_n_seconds)
        progress.start()
        for _ in range(self.epochs):
            perm = torch.randperm(n, generator=gen).to(device)
            for i in range(steps_per_epoch):
                idx = perm[i * bs : (i + 1) * bs]  # [bs]
                xb, yb = x[idx], y[idx]
                loss = sum(F.cross_entropy(head(xb), yb) for head in heads)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            progress.update(1)
        progress.finish()
        return [head.eval() for head in heads]

    def select_base_lr(self, features: Tensor, labels: Tensor, num_classes: int) -> tuple[float, dict[float, float]]:
        """The sweep's LR: heads trained on the training features less a seeded random
        ``select_fraction`` of them, scored (top-1) on that held-out part; ``(best, scores)``."""
        n = features.shape[0]
        held = max(1, round(self.select_fraction * n))
        if n - held < 2:
            raise ValueError(f"an LR sweep holds out {held} of {n} training examples and needs 2 more to train on")
        labels = labels.to(features.device)  # (indexed by the permutation, on the features' device)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).to(features.device)
        val, fit = perm[:held], perm[held:]
        heads = self.fit_heads(features[fit], labels[fit], num_classes, self.base_lrs)
        scores = {lr: topk_accuracy(predict_logits(head, features[val]), labels[val], ks=(1,))["top1"]
                  for lr, head in zip(self.base_lrs, heads, strict=True)}
        best = max(self.base_lrs, key=lambda lr: scores[lr])  # ties: the first listed
        return best, scores

    def evaluate(
        self,
        train_features: Tensor,
        train_labels: Tensor,
        test_features: Tensor,
        test_labels: Tensor,
        num_classes: int | None = None,
    ) -> dict[str, float]:
        """Train on the training features, report ``{"top1", "top5"}`` (fractions in [0, 1]) on
        the test features; top-5 only with >= 5 classes."""
        _check(test_features, test_labels, "linear probe (test set)")
        if train_features.shape[1] != test_features.shape[1]:
            raise ValueError(
                f"train and test features differ in width: {train_features.shape[1]} vs {test_features.shape[1]}"
            )
        if num_classes is None:
            num_classes = int(max(train_labels.max(), test_labels.max())) + 1
        if len(self.base_lrs) > 1:
            self.base_lr, scores = self.select_base_lr(train_features, train_labels, num_classes)
            self.record_args = {"selected_base_lr": self.base_lr, "select_top1": {f"{lr:g}": acc for lr, acc in scores.items()},
                                "select_fraction": self.select_fraction}
        head = self.fit(train_features, train_labels, num_classes)
        return topk_accuracy(predict_logits(head, test_features), test_labels)


@torch.no_grad()
def predict_logits(head: nn.Module, features: Tensor, chunk_size: int = 4096) -> Tensor:
    """Logits ``[N, C]`` of a trained head, in chunks, in eval mode (BN on running statistics)."""
    head.eval()
    device = next(head.parameters()).device
    return torch.cat([head(features[i : i + chunk_size].to(device).float()) for i in range(0, features.shape[0], chunk_size)])
