"""Exponential moving averages of declared (online, target) module pairs.

A method declares its pairs (MoCo v3: base encoder -> momentum encoder; DINO: student -> teacher) and
the base module updates them after every optimiser step, with a momentum that follows a cosine from
``start`` to ``end`` over training (MoCo v3 §4 "momentum ... cosine 0.99 -> 1"; DINO §3.1 "cosine
schedule from 0.996 to 1"). solo-learn's idea: the method says *what* to average, the framework
does it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from lightly.models.utils import update_momentum
from lightly.utils.scheduler import cosine_schedule
from torch import nn


class EMAPairs:
    """Holds (online, target) pairs without registering them as submodules (the method owns them).

    Args:
        pairs: modules whose parameters are averaged, target <- m·target + (1 - m)·online.
        start: momentum at step 0.
        end: momentum at the last step.
    """

    def __init__(self, pairs: Sequence[tuple[nn.Module, nn.Module]], start: float, end: float = 1.0) -> None:
        if not 0.0 <= start <= end <= 1.0:
            raise ValueError(f"EMA momentum must satisfy 0 <= start <= end <= 1, got start={start}, end={end}")
        for online, target in pairs:
            n_online = sum(1 for _ in online.parameters())
            n_target = sum(1 for _ in target.parameters())
            if n_online != n_target:
                raise ValueError(f"EMA pair has {n_online} online but {n_target} target parameter tensors")
        self.pairs = list(pairs)
        self.start = start
        self.end = end

    def momentum(self, step: int, total_steps: int) -> float:
        # cos(pi * step / total_steps), as DINO's momentum_schedule (i / N) and MoCo v3's
        # adjust_moco_momentum (epoch / epochs): lightly's schedule ends one step early (at
        # max_steps - 1), hence total_steps + 1; the last update still moves the target a little.
        return cosine_schedule(min(step, total_steps), total_steps + 1, self.start, self.end)

    def update(self, step: int, total_steps: int) -> float:
        """Average every pair with the momentum of ``step``; returns that momentum."""
        m = self.momentum(step, total_steps)
        for online, target in self.pairs:
            _check_same_layout(online, target)
            update_momentum(online, target, m)
        return m


def _check_same_layout(online: nn.Module, target: nn.Module) -> None:
    """The average is taken tensor by tensor over what this process holds: under FSDP the
    online module and its target must be sharded alike (each its own FSDP unit), or a process
    holds a piece of one and another piece, or nothing, of the other."""
    for (name, p), q in zip(online.named_parameters(), target.parameters()):
        if p.shape != q.shape:
            raise RuntimeError(
                f"EMA: {name} is {tuple(p.shape)} here in the online module but {tuple(q.shape)} in its target: FSDP "
                "sharded the two differently. Wrap each module of an EMA pair as its own FSDP unit (the auto_wrap_policy "
                "of recipes/trainer/fsdp.yaml: the ViT class and the heads besides the blocks)"
            )


def make_target(online: nn.Module) -> nn.Module:
    """A frozen copy of ``online`` that only the EMA updates (no gradients)."""
    target = copy.deepcopy(online)
    for p in target.parameters():
        p.requires_grad_(False)
    return target
