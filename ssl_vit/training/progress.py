"""Plain lines of progress for runs without a progress bar.

A run whose output goes to a file (a SLURM job's log, ``nohup``) either has no progress bar and is
silent for hours, or has one that fills the file with carriage returns. :class:`ProgressLog` prints
one line every ``every_n_seconds`` instead, in process 0, and one at the end::

    [ssl_vit] mocov3: step 1170/4680 (25 %), epoch 2.50, loss 2.137, 7.9 min, about 23.7 min left

Work outside a Trainer counted in items (the feature pass of an evaluation: an hour over ImageNet
on a small GPU) reports the same way through :class:`CountProgress`::

    [ssl_vit] features (train): 51200/1281167 images (4 %), 3.2 min, about 75.1 min left
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def _line(name: str, parts: list[str], elapsed: float, done: float, left: float) -> str:
    """``[ssl_vit] name: parts, M min, about N min left`` (the estimate once something is done)."""
    parts = [*parts, f"{elapsed / 60:.1f} min"]
    if done > 0 and left > 0:
        parts.append(f"about {elapsed / done * left / 60:.1f} min left")
    return f"[ssl_vit] {name}: " + ", ".join(parts)


class _Interval:
    """Says when a line is due: one interval after the start, then every interval."""

    def __init__(self, every_n_seconds: float, clock: Callable[[], float]) -> None:
        self.every_n_seconds, self.clock = every_n_seconds, clock
        self._start = self._last = 0.0

    def restart(self) -> None:
        self._start = self._last = self.clock()

    def due(self) -> float | None:
        """The time now when a line is due, else None."""
        now = self.clock()
        if now - self._last < self.every_n_seconds:
            return None
        self._last = now
        return now


class CountProgress(_Interval):
    """One line every ``every_n_seconds`` while counted work goes on, in process 0. Short work
    prints nothing: the first line comes one interval after :meth:`start`, and :meth:`finish`
    prints a last one (``(done)``) only when a line came before it.

    Args:
        name: what the line calls the work (``features (train)``).
        total: how many items there are, or None when unknown (no share or time left then).
        unit: what an item is (``images``).
        every_n_seconds: the interval between lines.
        clock: seconds as a float (``time.monotonic``; tests give their own).
    """

    def __init__(self, name: str, total: int | None, unit: str = "images", every_n_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(every_n_seconds, clock)
        self.name, self.total, self.unit = name, total, unit
        self.done = self.lines = 0

    def start(self) -> None:
        self.done = self.lines = 0
        self.restart()

    def line(self, now: float) -> str:
        count = f"{self.done}/{self.total} {self.unit} ({100 * self.done / self.total:.0f} %)" if self.total else f"{self.done} {self.unit}"
        return _line(self.name, [count], now - self._start, self.done, (self.total or 0) - self.done)

    def update(self, n: int) -> None:
        """``n`` more items are done."""
        self.done += n
        if (now := self.due()) is not None:
            self.lines += 1
            rank_zero_info(self.line(now))

    def finish(self) -> None:
        if self.lines:
            rank_zero_info(self.line(self.clock()) + " (done)")


class ProgressLog(_Interval, L.Callback):
    """One line of progress every ``every_n_seconds`` of training and one when it ends.

    Args:
        name: what the line calls the run (``mocov3``, ``fine-tuning``).
        every_n_seconds: the interval between lines (the first comes one interval after the start).
        metric: the logged metric shown with each line, when the module logs it (its latest value).
        clock: seconds as a float (``time.monotonic``; tests give their own).
    """

    def __init__(self, name: str = "training", every_n_seconds: float = 60.0, metric: str = "train/loss",
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(every_n_seconds, clock)
        self.name, self.metric = name, metric
        self._first_step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.restart()
        self._first_step = trainer.global_step  # a resumed run's rate counts its own steps only

    def line(self, trainer: L.Trainer, now: float) -> str:
        """The progress line at time ``now`` (module docstring)."""
        step, total = trainer.global_step, trainer.estimated_stepping_batches
        known = math.isfinite(total)
        parts = [f"step {step}/{total}" if known else f"step {step}"]
        if known and total > 0:
            parts[0] += f" ({100 * step / total:.0f} %)"
        batches = trainer.num_training_batches
        if math.isfinite(batches) and batches > 0:  # epochs in optimiser steps, as the schedules count them
            parts.append(f"epoch {step / max(1, math.ceil(batches / trainer.accumulate_grad_batches)):.2f}")
        if (value := trainer.callback_metrics.get(self.metric)) is not None:
            parts.append(f"{self.metric.rsplit('/', 1)[-1]} {float(value):.4g}")
        return _line(self.name, parts, now - self._start, step - self._first_step, total - step if known else 0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (now := self.due()) is not None:
            rank_zero_info(self.line(trainer, now))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = trainer.estimated_stepping_batches
        finished = math.isfinite(total) and trainer.global_step >= total
        rank_zero_info(self.line(trainer, self.clock()) + (" (done)" if finished else " (stopped)"))
