"""Linear probe on features extracted once (MAE §4 / Appendix A.3, ``main_linprobe.py``): a
BatchNorm without affine parameters and one Linear layer (:class:`~ssl_vit.heads.LinearProbeHead`:
the BN re-normalises features whose scale differs wildly between methods, the pair stays linear).
SGD (momentum 0.9, base LR 0.01) or MAE's LARS (0.1), weight decay 0, ``lr = base_lr · batch /
256``, warm-up then cosine decay to 0 per step (MAE ``util/lr_sched.py``). Several base LRs sweep
it as the papers tune their probes (MoCo v3 §4, DINO; DINOv2 trains one head per setting on the
same batches): picked on a held-out ``select_fraction`` of the training features, never the test split.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightly.utils.scheduler import CosineWarmupScheduler
from torch import Tensor, nn

from ssl_vit.eval.results import held_out, topk_accuracy
from ssl_vit.heads import LinearProbeHead
from ssl_vit.training.progress import CountProgress

# A probe's base LR per optimiser when none is given: LARS's trust ratio (about 0.001 x |w| / |g|)
# makes SGD's LR barely move it, so MAE's linear probe runs LARS at 0.1.
PROBE_BASE_LR: dict[str, float] = {"sgd": 0.01, "lars": 0.1}
SMALL_PROBE = 2**23  # batch x features x classes of a probe step that trains on one CPU thread


class LARS(torch.optim.Optimizer):
    """SGD with layer-wise adaptive rate scaling (You et al. 2017) as MAE's ``util/lars.py``:
    matrices get weight decay and the trust ratio η·‖w‖/‖update‖, vectors plain SGD. Not lightly's
    LARS, which skips the trust ratio at weight decay 0 (MAE's probe setting)."""

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9, weight_decay: float = 0.0, trust_coefficient: float = 0.001) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        with torch.enable_grad():  # (Lightning's automatic optimisation runs forward + backward in the closure)
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                update = p.grad
                if p.ndim > 1:
                    update = update.add(p, alpha=group["weight_decay"])
                    p_norm, u_norm = torch.norm(p), torch.norm(update)
                    ratio = group["trust_coefficient"] * p_norm / u_norm
                    update = update * torch.where((p_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
                buf = self.state[p].get("mu")
                self.state[p]["mu"] = buf = update.clone() if buf is None else buf.mul_(group["momentum"]).add_(update)
                p.add_(buf, alpha=-group["lr"])
        return loss


def probe_optimizer(params: Iterable[nn.Parameter], optimizer: str, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """SGD with momentum, or :class:`LARS` (MAE's linear probe)."""
    return (torch.optim.SGD if optimizer == "sgd" else LARS)(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def warmup_cosine(opt: torch.optim.Optimizer, warmup_epochs: float, steps_per_epoch: int, total_steps: int) -> CosineWarmupScheduler:
    """Per step, each group at its own LR: a linear warm-up, then cosine decay to 0 (MAE ``util/lr_sched.py``);
    lightly's scheduler reaches 0 at ``max_epochs - 1``, hence ``total_steps + 1``: the last step still trains."""
    warmup = min(int(warmup_epochs * steps_per_epoch), total_steps)
    return CosineWarmupScheduler(opt, warmup_epochs=warmup, max_epochs=total_steps + 1, end_value=0.0)


@torch.no_grad()
def predict_logits(head: nn.Module, features: Tensor, chunk_size: int = 4096) -> Tensor:
    """Logits ``[N, C]`` of a trained head, in chunks, in eval mode (BN on running statistics)."""
    head.eval()
    device = next(head.parameters()).device
    return torch.cat([head(features[i : i + chunk_size].to(device).float()) for i in range(0, features.shape[0], chunk_size)])


@dataclass
class LinearProbe:
    """The linear-probe protocol (module docstring): ``base_lr`` per 256 examples (several: a sweep);
    ``seed`` of the head, the batch order and the held-out draw; on ``device`` (default: the features')."""

    epochs: int = 100
    batch_size: int = 256
    base_lr: float | list[float] | None = None
    optimizer: Literal["sgd", "lars"] = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_epochs: int = 10
    seed: int | None = None
    device: str | None = None
    select_fraction: float = 0.1
    progress_every_n_seconds: float = 60.0
    picked: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)  # a sweep's choice, for the result

    def __post_init__(self) -> None:
        if self.base_lr is None:  # (the LR that runs is the one recorded)
            self.base_lr = PROBE_BASE_LR[self.optimizer]

    @property
    def base_lrs(self) -> list[float]:
        return list(self.base_lr) if isinstance(self.base_lr, list | tuple) else [self.base_lr]

    def fit(self, features: Tensor, labels: Tensor, num_classes: int, base_lr: float | None = None) -> LinearProbeHead:
        """A head trained at ``base_lr`` (default: the first), each epoch in full batches of a seeded permutation (MAE's ``drop_last``)."""
        return self.fit_heads(features, labels, num_classes, [base_lr or self.base_lrs[0]])[0]

    def fit_heads(self, features: Tensor, labels: Tensor, num_classes: int, base_lrs: Sequence[float]) -> list[LinearProbeHead]:
        """One head per base LR on the same batches, each the one ``fit`` trains (own gradient, own parameter group)."""
        assert features.ndim == 2 and labels.shape == features.shape[:1]
        device = torch.device(self.device) if self.device is not None else features.device
        x, y = features.to(device).float(), labels.to(device).long()  # [N, F], [N]
        bs = min(self.batch_size, x.shape[0])
        steps_per_epoch = x.shape[0] // bs
        heads = []
        for _ in base_lrs:  # each from the same seeded draw
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed or 0)
                heads.append(LinearProbeHead(x.shape[1], num_classes).to(device).train())
        opt = probe_optimizer([{"params": h.parameters(), "lr": lr * bs / 256} for h, lr in zip(heads, base_lrs)], self.optimizer,
                              base_lrs[0] * bs / 256, self.momentum, self.weight_decay)
        sched = warmup_cosine(opt, self.warmup_epochs, steps_per_epoch, self.epochs * steps_per_epoch)
        gen = torch.Generator().manual_seed(self.seed or 0)
        progress = CountProgress(f"linear probe, {len(heads)} LRs" if len(heads) > 1 else "linear probe", total=self.epochs, unit="epochs",
                                 every_n_seconds=self.progress_every_n_seconds)
        # A small probe's step is a few tiny ops: on a CPU one thread runs it several times faster than
        # a pool whose threads sleep between ops (the CLI's passive OpenMP waits) and wake for each.
        threads = torch.get_num_threads()
        if device.type == "cpu" and bs * x.shape[1] * num_classes <= SMALL_PROBE:
            torch.set_num_threads(1)
        progress.start()
        try:
            for _ in range(self.epochs):
                perm = torch.randperm(x.shape[0], generator=gen).to(device)
                for i in range(steps_per_epoch):
                    idx = perm[i * bs : (i + 1) * bs]  # [bs]
                    loss = sum(F.cross_entropy(head(x[idx]), y[idx]) for head in heads)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
                progress.update(1)
        finally:
            torch.set_num_threads(threads)
        progress.finish()
        return [head.eval() for head in heads]

    def evaluate(self, train_features: Tensor, train_labels: Tensor, test_features: Tensor, test_labels: Tensor,
                 num_classes: int | None = None) -> dict[str, float]:
        """``{"top1", "top5"}`` on the test features of a head trained on the training features."""
        num_classes = num_classes or int(max(train_labels.max(), test_labels.max())) + 1
        best = self.base_lrs[0]
        if len(self.base_lrs) > 1:
            val, fit = held_out(len(train_features), self.select_fraction, self.seed)
            if len(fit) < 2:
                raise ValueError(f"an LR sweep holds out {len(val)} of {len(train_features)} training examples and needs 2 more to train on")
            labels = train_labels.to(train_features.device)
            heads = self.fit_heads(train_features[fit], labels[fit], num_classes, self.base_lrs)
            select = {lr: topk_accuracy(predict_logits(h, train_features[val]), labels[val], ks=(1,))["top1"] for lr, h in zip(self.base_lrs, heads)}
            best = max(self.base_lrs, key=select.__getitem__)  # ties: the first listed
            self.picked = {"selected_base_lr": best, "select_top1": {f"{lr:g}": a for lr, a in select.items()}, "select_fraction": self.select_fraction}
        return topk_accuracy(predict_logits(self.fit(train_features, train_labels, num_classes, best), test_features), test_labels)
