"""A method's optimiser as plain functions: the weight-decay groups, the optimiser (a fused kernel
where it runs), Adam's state ahead of a first gradient."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from lightly.utils.lars import LARS
from torch import Tensor

from ssl_vit.methods.distributed import unwrapped_name

WeightDecayExempt = Literal["bias_norm_tokens", "bias_norm", "none"]
OptimizerName = Literal["adamw", "sgd", "lars"]


def param_groups(named_parameters: Iterable[tuple[str, Tensor]], rule: WeightDecayExempt, tokens: set[str], weight_decay: float,
                 probe_ids: set[int], probe_lr: float, shape_of: Callable[[Tensor], torch.Size]) -> list[dict[str, Any]]:
    """The trainable parameters in groups: decayed (``scheduled_wd``: the weight-decay schedule
    sets it); not decayed (by ``rule``: the 1-D ones, with ``bias_norm_tokens`` also the named
    ``tokens`` and any ``*.mask_token``); the online probe's (``probe_ids``: never decayed, at the
    constant ``fixed_lr``). ``shape_of``: a parameter's shape as built (FSDP's shards are 1-D)."""
    decay, no_decay, probe = [], [], []
    for name, p in named_parameters:
        name = unwrapped_name(name)
        if not p.requires_grad:
            continue
        if id(p) in probe_ids:
            probe.append(p)
        elif rule != "none" and (len(shape_of(p)) <= 1 or (rule == "bias_norm_tokens" and (name in tokens or name.endswith(".mask_token")))):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "scheduled_wd": True},
              {"params": no_decay, "weight_decay": 0.0},
              {"params": probe, "weight_decay": 0.0, "fixed_lr": probe_lr}]
    return [g for g in groups if g["params"]]


def build_optimizer(groups: list[dict[str, Any]], name: OptimizerName, lr: float, betas: tuple[float, float], sgd_momentum: float,
                    fused: bool) -> torch.optim.Optimizer:
    """AdamW, SGD or lightly's LARS over ``groups``, each at its ``fixed_lr`` or ``lr``; ``fused``:
    torch's fused kernel where it runs (the same update to float rounding; a resumed run keeps its
    checkpoint's choice, as torch restores every group setting)."""
    for g in groups:
        g["lr"] = g.get("fixed_lr", lr)
    if name == "lars":
        return LARS(groups, lr=lr, momentum=sgd_momentum)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=sgd_momentum, **fused_kwargs(groups, fused))
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), **fused_kwargs(groups, fused))
    materialize_adam_state(optimizer)  # long-lived memory before the activations': a smaller C heap on a CPU
    return optimizer


def fused_kwargs(groups: Iterable[dict[str, Any]], enabled: bool = True) -> dict[str, bool]:
    """``{"fused": True}`` when ``enabled`` and torch's fused AdamW / SGD kernels can update the
    groups' parameters (floating point, on one device type that has them: CPU, CUDA), else ``{}``."""
    params = [p for g in groups for p in g["params"]]
    devices = {p.device.type for p in params}
    return {"fused": True} if enabled and devices in ({"cpu"}, {"cuda"}) and all(p.is_floating_point() for p in params) else {}


def materialize_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of an Adam / AdamW the state Adam makes lazily at its first gradient (as
    ``torch.optim.Adam._init_group``: the numbers do not change). Without it a parameter that had no
    gradient yet (DINO's frozen last layer) has none, and FSDP cannot gather a checkpoint's state."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        for p in (p for p in group["params"] if not optimizer.state[p]):
            fused, on_device = group.get("fused"), group.get("fused") or group.get("capturable")  # else the step counter is on the CPU
            state = {"step": torch.zeros((), dtype=torch.float32 if fused else scalar, device=p.device if on_device else "cpu")}
            for key in ("exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if group.get("amsgrad") else [])):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state

