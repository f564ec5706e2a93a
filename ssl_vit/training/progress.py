"""Plain lines of training progress, for runs without a progress bar.

A run whose output goes to a file (a SLURM job's log, ``make demo > demo.log``, ``nohup``) either
has no progress bar (the demo hides it off a terminal, ``ssl-vit eval finetune`` and a recipe with
``trainer.enable_progress_bar: false`` have none) and prints nothing for the whole run, or has a
bar that fills the file with carriage returns. :class:`ProgressLog` prints one line every
``every_n_seconds`` instead, in process 0, and one at the end::

    [ssl_vit] mocov3: step 1170/4680 (25 %), epoch 2.50, loss 2.137, 7.9 min, about 23.7 min left

Work outside a Trainer that is counted in items (the feature pass of ``ssl-vit eval`` and of a
recipe's evaluation: an hour over ImageNet on a small GPU) reports the same way through
:class:`CountProgress`::

    [ssl_vit] features (train): 51200/1281167 images (4 %), 3.2 min, about 75.1 min left
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _check_interval(every_n_seconds: float) -> None:
    if not every_n_seconds >= 0:
        raise ValueError(f"every_n_seconds must be >= 0, got {every_n_seconds}")


class CountProgress:
    """One line every ``every_n_seconds`` while counted work goes on, in process 0 (module docstring).

    Short work prints nothing: the first line comes one interval after :meth:`start`, and
    :meth:`finish` prints a last one (``(done)``) only when a line came before it.

    Args:
        name: what the line calls the work (``features (train)``).
        total: how many items there are, or None when unknown (no percentage or time left then).
        unit: what an item is (``images``).
        every_n_seconds: the interval between lines.
        clock: seconds as a float (``time.monotonic``; tests give their own).
    """

    def __init__(
        self,
        name: str,
        total: int | None,
        unit: str = "images",
        every_n_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_interval(every_n_seconds)
        self.name = name
        self.total = total
        self.unit = unit
        self.every_n_seconds = every_n_seconds
        self.clock = clock
        self.done = 0
        self.lines = 0
        self._start = self._last = 0.0

    def start(self) -> None:
        self.done, self.lines = 0, 0
        self._start = self._last = self.clock()

    def line(self, now: float) -> str:
        elapsed = now - self._start
        parts = [f"{self.done}/{self.total} {self.unit}" if self.total else f"{self.done} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.done / self.total:.0f} %)"
        parts.append(_minutes(elapsed))
        if self.total and 0 < self.done < self.total:
            parts.append(f"about {_minutes(elapsed / self.done * (self.total - self.done))} left")
        return f"[ssl_vit] {self.name}: " + ", ".join(parts)

    def update(self, n: int) -> None:
        """``n`` more items are done."""
        self.done += n
        now = self.clock()
        if now - self._last >= self.every_n_seconds:
            self._last = now
            self.lines += 1
            rank_zero_info(self.line(now))

    def finish(self) -> None:
        if self.lines:
            rank_zero_info(self.line(self.clock()) + " (done)")


class ProgressLog(L.Callback):
    """One line of progress every ``every_n_seconds`` of training and one when it ends.

    Args:
        name: what the line calls the run (``mocov3``, ``fine-tuning``).
        every_n_seconds: the interval between lines (the first comes one interval after the start).
        metric: the logged metric shown with each line, when the module logs it (its latest value).
        clock: seconds as a float (``time.monotonic``; tests give their own).
    """

    def __init__(
        self,
        name: str = "training",
        every_n_seconds: float = 60.0,
        metric: str = "train/loss",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_interval(every_n_seconds)
        self.name = name
        self.every_n_seconds = every_n_seconds
        self.metric = metric
        self.clock = clock
        self._start = self._last = 0.0
        self._first_step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = self._last = self.clock()
        self._first_step = trainer.global_step  # a resumed run's rate counts its own steps only

    def line(self, trainer: L.Trainer, now: float) -> str:
        """The progress line at time ``now`` (module docstring)."""
        step, total = trainer.global_step, trainer.estimated_stepping_batches
        elapsed = now - self._start
        parts = [f"step {step}/{total}" if math.isfinite(total) else f"step {step}"]
        if math.isfinite(total) and total > 0:
            parts[0] += f" ({100 * step / total:.0f} %)"
        batches = trainer.num_training_batches
        if math.isfinite(batches) and batches > 0:  # epochs in optimiser steps, as the schedules count them
            per_epoch = max(1, math.ceil(batches / trainer.accumulate_grad_batches))
            parts.append(f"epoch {step / per_epoch:.2f}")
        value = trainer.callback_metrics.get(self.metric)
        if value is not None:
            parts.append(f"{self.metric.rsplit('/', 1)[-1]} {float(value):.4g}")
        parts.append(_minutes(elapsed))
        done = step - self._first_step
        if math.isfinite(total) and 0 < done and step < total:
            parts.append(f"about {_minutes(elapsed / done * (total - step))} left")
        return f"[ssl_vit] {self.name}: " + ", ".join(parts)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = self.clock()
        if now - self._last >= self.every_n_seconds:
            self._last = now
            rank_zero_info(self.line(trainer, now))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = trainer.estimated_stepping_batches
        finished = math.isfinite(total) and trainer.global_step >= total
        rank_zero_info(self.line(trainer, self.clock()) + (" (done)" if finished else " (stopped)"))
