"""What the running job is, as code outside Lightning's hooks sees it: its process layout
(``torch.distributed``'s default group) and its seed (``seed_everything``'s)."""

from __future__ import annotations

import os

import torch.distributed as dist


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_seed(default: int = 0) -> int:
    """The run's seed: what ``seed_everything`` set (``PL_GLOBAL_SEED``, the seed Lightning's own
    distributed sampler uses), else ``default``."""
    return int(os.environ.get("PL_GLOBAL_SEED", default))
