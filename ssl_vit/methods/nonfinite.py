"""The non-finite-loss guard of a training run: on a NaN / Inf loss either stop with a message
naming the step and the last good checkpoint, or skip the batch (its optimiser step, its EMA
update and what its forward changed in buffers) a bounded number of times.

``BaseMethod`` composes one; the decision is taken by all processes together before it is
handed here (``reduce_boolean_decision``), so every process skips or raises at the same step.
"""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

NonFinitePolicy = Literal["raise", "skip"]


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/Inf loss and no skip policy was configured."""


class NonFiniteGuard:
    """Args:
        policy: ``raise`` stops at the first non-finite loss; ``skip`` drops the batch.
        max_skipped: how many batches ``skip`` drops (over the whole run, resumes included)
            before it raises.
    """

    def __init__(self, policy: NonFinitePolicy, max_skipped: int) -> None:
        if policy not in ("raise", "skip"):
            raise ValueError(f"nonfinite_policy must be 'raise' or 'skip', got {policy!r}")
        if max_skipped < 0:
            raise ValueError(f"max_skipped_batches must be >= 0, got {max_skipped}")
        self.policy = policy
        self.max_skipped = max_skipped
        self.skipped = 0  # batches skipped so far (kept in checkpoints)
        self.skipping = False  # the batch in progress is being skipped

    def snapshot(self, module: nn.Module) -> list[tuple[Tensor, Tensor]]:
        """What a forward changes besides the parameters (BatchNorm statistics, DINO's centre),
        to put back if the batch is skipped: small tensors, copied only under ``skip``."""
        return [(b, b.clone()) for b in module.buffers()] if self.policy == "skip" else []

    def handle(self, module: nn.Module, loss: Tensor, buffers: list[tuple[Tensor, Tensor]], step: int, epoch: int,
               rank: int, last_checkpoint: str | None) -> Tensor:
        """A non-finite ``loss`` at ``step``: returns the loss to back-propagate in its place (a
        zero) when the batch is skipped, else raises ``NonFiniteLossError``."""
        if self.policy == "skip" and self.skipped < self.max_skipped:
            self.skipped += 1
            self.skipping = True
            for buffer, before in buffers:  # a NaN centre or BN mean would poison every later step
                buffer.copy_(before)
            rank_zero_info(f"[ssl_vit] non-finite loss (on rank 0: {loss.item()}) at step {step}: batch skipped ({self.skipped}/{self.max_skipped})")
            # Not `None`, which Lightning refuses under DDP: a zero that reaches every trainable
            # parameter, so the backward (and DDP's gradient reduction, which every process must
            # join) runs with zero gradients; they are dropped before the update.
            trainable = [p.sum() for p in module.parameters() if p.requires_grad]
            return torch.stack(trainable).sum() * 0.0
        where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written yet"
        spent = f" ({self.skipped} batch(es) already skipped, the limit)" if self.policy == "skip" else ""
        raise NonFiniteLossError(
            f"non-finite loss ({loss.item()} on rank {rank}) at step {step} (epoch {epoch}){spent}; {where}. "
            "Lower the learning rate, raise warm-up, or set nonfinite_policy: skip."
        )

    def step_done(self) -> bool:
        """After the optimiser step: whether the step just taken was skipped (and reset)."""
        skipped, self.skipping = self.skipping, False
        return skipped
