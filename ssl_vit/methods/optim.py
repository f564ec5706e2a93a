"""The optimiser of a pretext task and its per-step schedules, as plain functions of their inputs:
which parameters are weight-decayed, the optimiser built over those groups, and the LR and weight
decay at an optimiser step (linear warm-up, then a cosine to the end of training)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from lightly.utils.lars import LARS
from lightly.utils.scheduler import cosine_schedule, cosine_warmup_schedule
from torch import Tensor

from ssl_vit.methods.fused import fused_kwargs
from ssl_vit.methods.optimizer_state import materialize_adam_state
from ssl_vit.methods.sharding import unwrapped_name

# Which parameters get no weight decay (see BaseMethod's ``weight_decay_exempt``).
WeightDecayExempt = Literal["bias_norm_tokens", "bias_norm", "none"]
OptimizerName = Literal["adamw", "sgd", "lars"]


def param_groups(
    named_parameters: Iterable[tuple[str, Tensor]],
    rule: WeightDecayExempt,
    tokens: set[str],
    weight_decay: float,
    probe_ids: set[int],
    probe_lr: float,
    shape_of: Callable[[Tensor], torch.Size],
) -> list[dict[str, Any]]:
    """The optimiser's groups: decayed, not decayed (by ``rule``: 1-D parameters, and with
    ``bias_norm_tokens`` also the named ``tokens`` and any ``*.mask_token``) and the online probe's
    (``probe_ids``: never decayed, at its own constant ``probe_lr``). Frozen parameters are left
    out. ``shape_of`` gives a parameter's shape as built (under FSDP each is a 1-D shard by now).
    Each group says whether the weight-decay schedule applies to it (``scheduled_wd``)."""
    decay, no_decay, probe = [], [], []
    for wrapped, p in named_parameters:
        if not p.requires_grad:
            continue
        name = unwrapped_name(wrapped)
        ndim = len(shape_of(p))
        if id(p) in probe_ids:
            probe.append(p)
        elif rule != "none" and (ndim <= 1 or (rule == "bias_norm_tokens" and (name in tokens or name.endswith(".mask_token")))):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "scheduled_wd": True},
        {"params": no_decay, "weight_decay": 0.0, "scheduled_wd": False},
    ]
    if probe:
        groups.append({"params": probe, "weight_decay": 0.0, "scheduled_wd": False, "fixed_lr": probe_lr})
    return [g for g in groups if g["params"]]


def build_optimizer(
    groups: list[dict[str, Any]],
    name: OptimizerName,
    base_lr: float,
    betas: tuple[float, float],
    sgd_momentum: float,
    fused: bool,
) -> torch.optim.Optimizer:
    """AdamW, SGD or LARS (lightly's) over ``groups``; each group starts at its ``fixed_lr`` or
    ``base_lr`` (the schedule sets the LR at every step). ``fused``: torch's fused kernel where
    the parameters allow it (LARS has none)."""
    for g in groups:
        g["lr"] = g.get("fixed_lr", base_lr)
    kernel = fused_kwargs(groups, fused)
    if name == "adamw":
        opt = torch.optim.AdamW(groups, lr=base_lr, betas=tuple(betas), **kernel)
        # The moments now rather than at the first step (Adam's own zeros, the same numbers):
        # long-lived memory is allocated before the first step's activations, not in the
        # holes they leave, which on a CPU keeps the C heap a few per cent smaller (benchmarks/RESULTS.md).
        materialize_adam_state(opt)
        return opt
    if name == "sgd":
        return torch.optim.SGD(groups, lr=base_lr, momentum=sgd_momentum, **kernel)
    return LARS(groups, lr=base_lr, momentum=sgd_momentum)


def lr_and_weight_decay(
    step: int,
    total: int,
    warmup: int,
    peak_lr: float,
    min_lr: float,
    weight_decay: float,
    weight_decay_end: float | None,
) -> dict[str, float]:
    """LR and weight decay at optimiser step ``step`` of ``total``: a linear LR warm-up over
    ``warmup`` steps, then a cosine from ``peak_lr`` to ``min_lr`` (DINO
    ``utils.cosine_scheduler``; MoCo v3 ``adjust_learning_rate``); the weight decay follows a
    cosine from ``weight_decay`` to ``weight_decay_end`` over the whole run (``None``: constant).

    The warm-up is lightly's ``cosine_warmup_schedule``: step t < W runs at peak·(t + 1)/W, so the
    first step already learns and step W − 1 reaches the peak. The references start one step
    earlier, at 0 (MoCo v3 peak·t/W; DINO ``np.linspace(0, peak, W)``): at most peak/W apart during
    the warm-up, identical after it. A warm-up longer than the run is cut to it (W = ``total``:
    the last step runs at the peak; the run says so when it starts)."""
    warmup = min(int(warmup), total)
    step = min(step, total)
    # lightly's schedules reach their end value at max_steps - 1; the references' cosine is
    # cos(pi * i / N) over the N = total - warmup steps after the warm-up (DINO
    # cosine_scheduler: np.arange(N) / N), so the last step is just above the end value:
    # max_steps = total + 1 gives exactly that.
    lr = (cosine_warmup_schedule(step, total + 1, peak_lr, min_lr, warmup, 0.0) if warmup
          else cosine_schedule(step, total + 1, peak_lr, min_lr))
    wd_end = weight_decay if weight_decay_end is None else weight_decay_end
    wd = cosine_schedule(step, total + 1, weight_decay, wd_end)
    return {"lr": lr, "weight_decay": wd}
