"""What FSDP's sharding changes for code that reads parameters by name, shape or norm.

Lightning's ``FSDPStrategy`` wraps the model before ``configure_optimizers`` runs, and with
``use_orig_params=True`` (Lightning's default) every parameter is then a flat 1-D view of this
process's shard (``[numel / world]``, possibly empty), its name carrying the wrappers
(``blocks.0._fsdp_wrapped_module.attn.qkv.weight``). Rules that read ``p.ndim`` (which parameters
get weight decay) must therefore read the shapes recorded before wrapping, under the unwrapped
names; and a gradient norm is a sum over the shards of all processes in the sharding group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

# Name parts that wrappers insert: FSDP, activation checkpointing, torch.compile.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped_name(name: str) -> str:
    """A parameter's name as it was before FSDP / activation checkpointing / ``torch.compile``
    wrapped its module: ``backbone.blocks.0._fsdp_wrapped_module.norm1.weight`` ->
    ``backbone.blocks.0.norm1.weight``."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def unwrap_module(module: nn.Module) -> nn.Module:
    """The module inside FSDP / activation-checkpointing / ``torch.compile`` wrappers (each keeps
    the module it wraps; attribute access passes through them, ``isinstance`` does not)."""
    while True:
        inner = getattr(module, "_fsdp_wrapped_module", None) or getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def gradient_shard_group(strategy: Any) -> dist.ProcessGroup | None:
    """The process group over which each gradient is split when ``strategy`` is Lightning's
    ``FSDPStrategy`` with a sharding strategy other than ``NO_SHARD`` (for ``HYBRID_SHARD`` the
    group within a node, where the shards are; the nodes hold replicas); ``None`` when every
    process holds whole gradients (one process, DDP, ``NO_SHARD``)."""
    from lightning.pytorch.strategies import FSDPStrategy

    if not isinstance(strategy, FSDPStrategy) or strategy.world_size <= 1:
        return None
    if getattr(strategy.sharding_strategy, "name", "") == "NO_SHARD":
        return None
    group = getattr(strategy.model, "process_group", None)  # the root FSDP module's sharding group
    return group if group is not None else dist.group.WORLD
