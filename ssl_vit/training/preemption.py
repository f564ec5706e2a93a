"""Preemption: SIGTERM (what schedulers send before killing a job) or SIGUSR1 (SLURM's warning
signal when ``--signal=USR1@90`` is set) writes ``last.ckpt`` before the process exits, so
``--resume`` loses at most the current step.

The signals are ours: the handler only notes the signal, and at the end of each optimiser step
(and of each validation batch, so that a long validation pass is not waited for) the processes
agree on it with one small all-reduce, at the same point in every process, so all save and stop
at the same step. Lightning's own handlers act inside the signal handler, at whatever point each
process was interrupted: its SIGTERM handler broadcasts (with several processes the step's
collectives then mismatch: gloo aborts or the run hangs, seen with DDP on 2 CPU processes), its
SLURM requeue handler saves a checkpoint (a collective, and possibly mid-step) and lets the run go
on. So its SIGTERM handler is replaced once training starts, and with SLURM auto-requeue the
requeue signal is ours as well: at the agreed batch end Lightning's requeue runs (it saves an
``hpc_ckpt_<n>.ckpt`` and requeues the job; the requeued run resumes from it) and the run stops.
A ``SIGTERMException`` that Lightning still raises is saved in ``on_exception``.

Ctrl-C (SIGINT) is a stop request too: the step in progress finishes, ``last.ckpt`` is written and
the run exits with 130, so an interactive run loses nothing; a second Ctrl-C stops at once
(Python's KeyboardInterrupt, losing the steps since the last checkpoint), for a run stuck where no
step ends. DataLoader workers ignore SIGINT (``ssl_vit.data.base.ignore_sigint``): the terminal
sends it to them as well, and a worker that died of it would fail the steps still to finish.

A signal that arrives before the run has taken a step writes nothing: the checkpoint already on
disk (the one a resumed run started from) is as new, and stays untouched. ``stopped_by`` names the
signal, so the CLI can exit with status 128 + its number, as a shell reports a process killed by
it: wrapper scripts and schedulers see that the run did not finish.
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

from ssl_vit.training.step_checkpoint import default_checkpoint_dir


class PreemptionCheckpoint(Callback):
    """Save ``<checkpoint dir>/last.ckpt`` when the job is told to stop.

    Args:
        signals: signal names that trigger a checkpoint and a clean stop (besides SIGTERM,
            which Lightning turns into ``SIGTERMException``).
    """

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
                print("\n[ssl_vit] Ctrl-C: finishing this step and writing a checkpoint "
                      "(Ctrl-C again stops at once, without it)", file=sys.stderr, flush=True)
        self._requested = signal.Signals(signum).name

    @staticmethod
    def _requeue_signal(trainer: L.Trainer) -> int | None:
        env = getattr(trainer._accelerator_connector, "cluster_environment", None)
        return env.requeue_signal if isinstance(env, SLURMEnvironment) and env.auto_requeue else None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.stopped_by = None
        self._interrupted = False
        # SLURM auto-requeue: its signal is ours too (Lightning then installs no handler of its
        # own for it); at the agreed batch end we let Lightning save the hpc checkpoint and requeue.
        requeue = self._requeue_signal(trainer)
        # SIGINT is taken once training starts (with SIGTERM, below): Lightning records the handlers
        # it finds after this hook and puts them back when a run ends in an exception, and one of
        # ours left on SIGINT would turn the process's next Ctrl-C into a mere stop request.
        wanted = [getattr(signal, name, None) for name in self.signals if name != "SIGINT"] + [requeue]
        for sig in dict.fromkeys(s for s in wanted if s is not None):
            self._install(sig)

    def _install(self, sig: int) -> None:
        current = signal.getsignal(sig)
        # A handler left by an earlier run of this callback (Lightning re-installs the handlers
        # it found when a run ends in an exception) is replaced; anyone else's stays in charge.
        stale = isinstance(getattr(current, "__self__", None), PreemptionCheckpoint)
        # Python's own KeyboardInterrupt is replaceable; an ignored SIGINT (a job started in the
        # background by a shell) stays ignored.
        replaceable = (signal.SIG_DFL, None) + ((signal.default_int_handler,) if sig == signal.SIGINT else (signal.SIG_IGN,))
        if current not in replaceable and not stale:
            return
        self._previous[sig] = (signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL) if stale else current
        signal.signal(sig, self._handler)

    def _take_sigterm(self) -> None:
        """Replace the SIGTERM handler Lightning registered when the run started (see the module
        docstring), and take SIGINT; the first hook after that registration calls this."""
        if signal.SIGTERM in self._previous:
            return
        self._previous[signal.SIGTERM] = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handler)
        if "SIGINT" in self.signals:
            self._install(signal.SIGINT)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_sigterm()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        # Only where our handler is still in place: Lightning may have restored the handlers it
        # found before this hook runs, and putting its SIGTERM handler back after that would leave
        # the process deaf to SIGTERM for the rest of its life (an evaluation after the fit, the
        # next fit of a demo).
        for sig, handler in self._previous.items():
            if getattr(signal.getsignal(sig), "__self__", None) is self:
                signal.signal(sig, handler)
        self._previous.clear()

    @staticmethod
    def last_path(trainer: L.Trainer) -> Path:
        cb = trainer.checkpoint_callback
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
        return Path(default_checkpoint_dir(trainer)) / "last.ckpt"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_sigterm()
        self._start_step = trainer.global_step  # after a resume: the checkpoint's step

    def _save(self, trainer: L.Trainer, signal_name: str) -> None:
        self.stopped_by = signal_name
        if trainer.global_step <= self._start_step:
            rank_zero_info(f"[ssl_vit] received {signal_name} before the first step: nothing new to save")
            return
        cb = trainer.checkpoint_callback
        save_last = getattr(cb, "save_last_checkpoint", None)
        if callable(save_last):
            path = save_last(trainer)  # StepCheckpoint: its bookkeeping knows this step is saved
        else:
            path = self.last_path(trainer)
            trainer.save_checkpoint(path)
        rank_zero_info(f"[ssl_vit] received {signal_name}: checkpoint written to {path} at step {trainer.global_step}; resume with --resume")

    def _agreed_signal(self, trainer: L.Trainer) -> int:
        """The signal any process got (its number; 0 for none): the same answer in every process."""
        signum = int(signal.Signals[self._requested]) if self._requested is not None else 0
        if trainer.world_size > 1:  # stop together: a signal may reach the processes a step apart
            code = torch.tensor(signum, device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(code, reduce_op="max"))
        return signum

    def _act(self, trainer: L.Trainer, signum: int) -> None:
        if signum == self._requeue_signal(trainer):
            self._requeue(trainer, signal.Signals(signum).name)
        else:
            self._save(trainer, signal.Signals(signum).name)
        self._requested = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # With gradient accumulation, only where the optimiser stepped: a stop between micro-batches
        # would lose the gradient gathered so far (it is not in the checkpoint).
        if (batch_idx + 1) % trainer.accumulate_grad_batches and not trainer.is_last_batch:
            return
        signum = self._agreed_signal(trainer)
        if signum:
            self._act(trainer, signum)
            trainer.should_stop = True

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # A validation pass can outlast a scheduler's grace period: stop inside it. The training
        # state is that of the last training step (validation changes no weights), so the
        # checkpoint is the one a stop after that step would have written.
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        signum = self._agreed_signal(trainer)
        if signum:
            self._act(trainer, signum)
            raise SIGTERMException  # leaves the validation loop; the CLI exits with 128 + signum

    def _requeue(self, trainer: L.Trainer, signal_name: str) -> None:
        """Lightning's SLURM requeue (save ``hpc_ckpt_<n>.ckpt``, ``scontrol requeue`` from rank 0),
        run here at a batch end in every process instead of inside its signal handler."""
        self.stopped_by = signal_name
        trainer._signal_connector._slurm_sigusr_handler_fn(signal.Signals[signal_name], None)
        rank_zero_info(f"[ssl_vit] received {signal_name}: SLURM requeue checkpoint written at step {trainer.global_step}; the requeued job resumes from it")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Only on a preemption: after a NaN loss the last good checkpoint must stay as it is.
        if isinstance(exception, SIGTERMException) and self.stopped_by is None:  # not saved yet
            self._save(trainer, "SIGTERM")
        # A run ended by an exception gets no teardown hook: the process (a notebook, the next
        # run) gets its own handlers back here, or its next Ctrl-C would only note a stop request.
        self._restore_handlers()
