"""Stop requests between steps: SIGTERM (what schedulers send before killing a job), SIGUSR1
(SLURM's warning with ``--signal=USR1@90``) and Ctrl-C write ``last.ckpt`` after the current
optimiser step and stop the run, so that ``--resume`` loses nothing; a second Ctrl-C stops at once.

The handler only notes the signal; at the end of each optimiser step (and validation batch) the
processes agree on it with one all-reduce, and all save and stop at the same step. Lightning's own
handlers act wherever each process was interrupted (its SIGTERM handler broadcasts mid-step, which
mismatches the step's collectives; its SLURM requeue handler saves mid-step), so they are replaced
once training starts; with SLURM auto-requeue, Lightning's requeue runs at the agreed batch end.
``stopped_by`` names the signal: ``ssl-vit fit`` exits with 128 + its number, as a shell would.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ssl_vit.training.checkpoint import default_checkpoint_dir


class PreemptionCheckpoint(Callback):
    """Save ``<checkpoint dir>/last.ckpt`` and stop on SIGTERM and the other ``signals``."""

    def __init__(self, signals: tuple[str, ...] = ("SIGUSR1", "SIGINT")) -> None:
        self.signals = signals
        self._requested: str | None = None
        self._previous: dict[int, Any] = {}
        self._start_step = 0
        self._interrupted = False
        self.stopped_by: str | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            if self._interrupted:  # the second Ctrl-C: stop now, as Python would have at the first
                signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))
                raise KeyboardInterrupt
            self._interrupted = True
            if rank_zero_only.rank == 0:
                print("\n[ssl_vit] Ctrl-C: finishing this step and writing a checkpoint (Ctrl-C again stops at once, without it)",
                      file=sys.stderr, flush=True)
        self._requested = signal.Signals(signum).name

    @staticmethod
    def _requeue_signal(trainer: L.Trainer) -> int | None:
        env = getattr(trainer._accelerator_connector, "cluster_environment", None)
        return env.requeue_signal if isinstance(env, SLURMEnvironment) and env.auto_requeue else None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.stopped_by, self._interrupted = None, False
        # SIGINT waits for training to start (with SIGTERM, in _take_sigterm): Lightning restores the
        # handlers it finds after this hook when a run ends in an exception, and one of ours left on
        # SIGINT would turn the process's next Ctrl-C into a mere stop request.
        wanted = [getattr(signal, name, None) for name in self.signals if name != "SIGINT"] + [self._requeue_signal(trainer)]
        for sig in dict.fromkeys(s for s in wanted if s is not None):
            self._install(sig)

    def _install(self, sig: int) -> None:
        current = signal.getsignal(sig)
        # A handler left by an earlier run of this callback is replaced; anyone else's stays in
        # charge. Python's KeyboardInterrupt is replaceable; an ignored SIGINT (a job started in the
        # background by a shell) stays ignored.
        stale = isinstance(getattr(current, "__self__", None), PreemptionCheckpoint)
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        if stale or current in (signal.SIG_DFL, None, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_IGN):
            self._previous[sig] = default if stale else current
            signal.signal(sig, self._handler)

    def _take_sigterm(self) -> None:
        """Replace the SIGTERM handler Lightning registered at the run's start (the first hook after
        it calls this), and take SIGINT."""
        if signal.SIGTERM not in self._previous:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handler)
            if "SIGINT" in self.signals:
                self._install(signal.SIGINT)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_sigterm()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_sigterm()
        self._start_step = trainer.global_step  # after a resume: the checkpoint's step

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        # Only where ours is still in place: Lightning may have restored the handlers it found, and
        # its SIGTERM handler put back after that would leave the process deaf to SIGTERM for the
        # rest of its life (an evaluation after the fit, the next fit of a demo).
        for sig, handler in self._previous.items():
            if getattr(signal.getsignal(sig), "__self__", None) is self:
                signal.signal(sig, handler)
        self._previous.clear()

    @staticmethod
    def last_path(trainer: L.Trainer) -> Path:
        cb = trainer.checkpoint_callback
        return Path(cb.dirpath if isinstance(cb, ModelCheckpoint) and cb.dirpath else default_checkpoint_dir(trainer)) / "last.ckpt"

    def _agreed_signal(self, trainer: L.Trainer) -> int:
        """The number of the signal any process got (0: none): signals may reach processes a step apart."""
        signum = int(signal.Signals[self._requested]) if self._requested is not None else 0
        if trainer.world_size > 1:
            signum = int(trainer.strategy.reduce(torch.tensor(signum, device=trainer.strategy.root_device), reduce_op="max"))
        return signum

    def _act(self, trainer: L.Trainer, signum: int) -> None:
        self.stopped_by, self._requested = signal.Signals(signum).name, None
        if signum == self._requeue_signal(trainer):
            # Lightning's SLURM requeue (save hpc_ckpt_<n>.ckpt, `scontrol requeue` from rank 0),
            # here at a batch end in every process instead of inside its signal handler.
            trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)
            rank_zero_info(f"[ssl_vit] received {self.stopped_by}: SLURM requeue checkpoint written at step {trainer.global_step}; "
                           "the requeued job resumes from it")
        else:
            self._save(trainer, self.stopped_by)

    def _save(self, trainer: L.Trainer, signal_name: str) -> None:
        self.stopped_by = signal_name
        if trainer.global_step <= self._start_step:  # no step since the run's start: the checkpoint on disk is as new
            rank_zero_info(f"[ssl_vit] received {signal_name} before the first step: nothing new to save")
            return
        save_last = getattr(trainer.checkpoint_callback, "save_last_checkpoint", None)
        if callable(save_last):
            path = save_last(trainer)  # StepCheckpoint: its bookkeeping knows this step is saved
        else:
            trainer.save_checkpoint(path := self.last_path(trainer))
        rank_zero_info(f"[ssl_vit] received {signal_name}: checkpoint written to {path} at step {trainer.global_step}; resume with --resume")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # With gradient accumulation, only where the optimiser stepped: the gradient gathered between
        # micro-batches is not in the checkpoint.
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or trainer.is_last_batch:
            if signum := self._agreed_signal(trainer):
                self._act(trainer, signum)
                trainer.should_stop = True

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # A validation pass can outlast a scheduler's grace period: stop inside it. Validation changes
        # no weights, so the checkpoint is the one a stop after the last training step would write.
        if not trainer.sanity_checking and trainer.state.fn == "fit" and (signum := self._agreed_signal(trainer)):
            self._act(trainer, signum)
            raise SIGTERMException  # leaves the validation loop; the CLI exits with 128 + signum

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # A SIGTERMException Lightning raised itself, not yet saved. Only then: after a non-finite
        # loss the last good checkpoint must stay as it is.
        if isinstance(exception, SIGTERMException) and self.stopped_by is None:
            self._save(trainer, "SIGTERM")
        # A run ended by an exception gets no teardown: the process gets its own handlers back here.
        self._restore_handlers()
