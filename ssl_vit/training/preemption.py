"""Preemption: SIGTERM (what schedulers send before killing a job) or SIGUSR1 (SLURM's warning
signal when ``--signal=USR1@90`` is set) writes ``last.ckpt`` before the process exits, so
``--resume`` loses at most the current step.

On SIGTERM Lightning's own handler flags the trainer and ends the run with ``SIGTERMException``
after the current batch; we save in ``on_exception``. SIGUSR1 is ours unless Lightning's SLURM
auto-requeue already handles it (then Lightning saves an ``hpc_ckpt`` and requeues the job).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException


class PreemptionCheckpoint(Callback):
    """Save ``<checkpoint dir>/last.ckpt`` when the job is told to stop.

    Args:
        signals: signal names that trigger a checkpoint and a clean stop (besides SIGTERM,
            which Lightning turns into ``SIGTERMException``).
    """

    def __init__(self, signals: tuple[str, ...] = ("SIGUSR1",)) -> None:
        self.signals = signals
        self._requested: str | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self._requested = signal.Signals(signum).name

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for name in self.signals:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            current = signal.getsignal(sig)
            if current not in (signal.SIG_DFL, signal.SIG_IGN, None):
                continue  # e.g. SLURM auto-requeue's handler: leave it in charge
            self._previous[sig] = current
            signal.signal(sig, self._handler)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @staticmethod
    def last_path(trainer: L.Trainer) -> Path:
        cb = trainer.checkpoint_callback
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
        return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"

    def _save(self, trainer: L.Trainer, why: str) -> None:
        path = self.last_path(trainer)
        trainer.save_checkpoint(path)
        rank_zero_info(f"[ssl_vit] {why}: checkpoint written to {path} at step {trainer.global_step}; resume with --resume")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._requested is not None:
            self._save(trainer, f"received {self._requested}")
            self._requested = None
            trainer.should_stop = True

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Only on a preemption: after a NaN loss the last good checkpoint must stay as it is.
        if isinstance(exception, SIGTERMException):
            self._save(trainer, "received SIGTERM")
