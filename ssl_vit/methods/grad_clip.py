"""Gradient clipping by norm: one norm over all given parameters (timm / the ViT paper's global
clipping), or each parameter's own norm (DINO ``utils.clip_gradients``), also when FSDP shards
the gradients over processes.

Both scale a gradient by ``min(1, max_norm / (norm + 1e-6))``, the coefficient of
``torch.nn.utils.clip_grad_norm_`` and of DINO's ``clip_gradients``. Sharded, each norm is the
square root of the sum over the group of each process's sum of squares, so every process applies
the coefficient of the whole gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

ClipMode = Literal["global", "per_param"]


def clip_gradients(
    params: Sequence[nn.Parameter],
    max_norm: float,
    mode: ClipMode = "global",
    shard_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Clip the gradients of ``params`` in place; returns the norm(s) before clipping (a scalar
    for ``global``, ``[len(params)]`` for ``per_param``, 0 where a parameter has no gradient).

    ``shard_group``: the group over which FSDP splits each gradient (see
    :func:`ssl_vit.methods.sharding.gradient_shard_group`); every process of it must call this
    with the same parameters in the same order (a parameter whose shard is empty here, or which
    has no gradient, counts 0)."""
    if mode not in ("global", "per_param"):
        raise ValueError(f"mode must be 'global' or 'per_param', got {mode!r}")
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    grads = [p.grad for p in params]
    present = [g for g in grads if g is not None]
    if shard_group is None and mode == "global":
        return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    if not present and shard_group is None:
        return torch.zeros(len(params))
    # Where the norms are summed: the gradients' device; with none here (a skipped batch, whose
    # gradients were dropped) the parameters'; for NCCL a GPU whatever they are on (it reduces
    # CUDA tensors only; CPU-offloaded gradients live on the CPU).
    device = present[0].device if present else (params[0].device if params else torch.device("cpu"))
    if shard_group is not None and dist.get_backend(shard_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    zero = torch.zeros((), device=device)
    squares = torch.stack([g.detach().float().pow(2).sum().to(device) if g is not None else zero for g in grads])  # [P]
    if shard_group is not None:
        dist.all_reduce(squares, group=shard_group)
    if mode == "global":
        norm = squares.sum().sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in present:
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
        return norm
    norms = squares.sqrt()  # [P]
    coefs = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    for g, c in zip(grads, coefs.unbind()):
        if g is not None:
            g.mul_(c.to(device=g.device, dtype=g.dtype))
    return norms
