"""Plain lines of progress, for runs whose output goes to a file (a SLURM job's log, ``nohup``),
where a progress bar fills the file with carriage returns and none leaves it silent for hours: one
line every ``every_n_seconds`` (the first one interval after the start), in process 0::

    [ssl_vit] mocov3: step 1170/4680 (25 %), epoch 2.50, loss 2.137, 7.9 min, about 23.7 min left
    [ssl_vit] features (train): 51200/1281167 images (4 %), 3.2 min, about 75.1 min left

``clock`` is seconds as a float (``time.monotonic``; tests give their own).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class _Lines:
    """A line is due one interval after :meth:`restart`, then every interval."""

    def __init__(self, name: str, every_n_seconds: float, clock: Callable[[], float]) -> None:
        self.name, self.every_n_seconds, self.clock = name, every_n_seconds, clock
        self._start = self._last = 0.0

    def restart(self) -> None:
        self._start = self._last = self.clock()

    def due(self) -> float | None:
        """The time now when a line is due, else None."""
        if (now := self.clock()) - self._last < self.every_n_seconds:
            return None
        self._last = now
        return now

    def _line(self, parts: list[str], now: float, done: float, left: float) -> str:
        """``[ssl_vit] name: parts, M min, about N min left`` (the estimate once something is done)."""
        elapsed = now - self._start
        estimate = [f"about {elapsed / done * left / 60:.1f} min left"] if done > 0 and left > 0 else []
        return f"[ssl_vit] {self.name}: " + ", ".join([*parts, f"{elapsed / 60:.1f} min", *estimate])


class CountProgress(_Lines):
    """Lines for work counted in items outside a Trainer (an evaluation's feature pass: an hour over
    ImageNet on a small GPU). Short work prints nothing: :meth:`finish` prints a last line
    (``(done)``) only when a line came before it. ``total`` None: no share or time left."""

    def __init__(self, name: str, total: int | None, unit: str = "images", every_n_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name, every_n_seconds, clock)
        self.total, self.unit = total, unit
        self.done = self.lines = 0

    def start(self) -> None:
        self.done = self.lines = 0
        self.restart()

    def line(self, now: float) -> str:
        count = f"{self.done}/{self.total} {self.unit} ({100 * self.done / self.total:.0f} %)" if self.total else f"{self.done} {self.unit}"
        return self._line([count], now, self.done, (self.total or 0) - self.done)

    def update(self, n: int) -> None:
        """``n`` more items are done."""
        self.done += n
        if (now := self.due()) is not None:
            self.lines += 1
            rank_zero_info(self.line(now))

    def finish(self) -> None:
        if self.lines:
            rank_zero_info(self.line(self.clock()) + " (done)")


class ProgressLog(_Lines, L.Callback):
    """Lines of a training run (``name``: ``mocov3``, ``fine-tuning``) and one when it ends, with the
    latest value of ``metric`` when the module logs it."""

    def __init__(self, name: str = "training", every_n_seconds: float = 60.0, metric: str = "train/loss",
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name, every_n_seconds, clock)
        self.metric, self._first_step = metric, 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.restart()
        self._first_step = trainer.global_step  # a resumed run's rate counts its own steps only

    def line(self, trainer: L.Trainer, now: float) -> str:
        step, total, batches = trainer.global_step, trainer.estimated_stepping_batches, trainer.num_training_batches
        known = math.isfinite(total)
        parts = [f"step {step}/{total}" + (f" ({100 * step / total:.0f} %)" if total > 0 else "") if known else f"step {step}"]
        if math.isfinite(batches) and batches > 0:  # epochs in optimiser steps, as the schedules count them
            parts.append(f"epoch {step / max(1, math.ceil(batches / trainer.accumulate_grad_batches)):.2f}")
        if (value := trainer.callback_metrics.get(self.metric)) is not None:
            parts.append(f"{self.metric.rsplit('/', 1)[-1]} {float(value):.4g}")
        return self._line(parts, now, step - self._first_step, total - step if known else 0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (now := self.due()) is not None:
            rank_zero_info(self.line(trainer, now))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        finished = math.isfinite(total := trainer.estimated_stepping_batches) and trainer.global_step >= total
        rank_zero_info(self.line(trainer, self.clock()) + (" (done)" if finished else " (stopped)"))
