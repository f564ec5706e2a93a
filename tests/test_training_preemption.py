"""The preemption callback's signal handling against hand-written expectations from its
docstrings (which signal handlers it takes and gives back, when a signal is acted on and what it
saves) and Lightning's own SLURM environment and accumulation rule. The end-to-end stops and
resumes of ``ssl-vit fit`` are in test_faults.py."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import lightning as L
import pytest
from helpers import TINY_BACKBONE, RepeatBatch, fixed_views
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from ssl_vit.methods import Supervised
from ssl_vit.training.preemption import PreemptionCheckpoint


class _Saver:
    def __init__(self) -> None:
        self.saved_at: list[int] = []

    def save_last_checkpoint(self, trainer):
        self.saved_at.append(trainer.global_step)
        return "last.ckpt"


def _trainer(step: int = 0, **kw) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, checkpoint_callback=_Saver(), world_size=1, accumulate_grad_batches=1,
                           is_last_batch=False, should_stop=False, sanity_checking=False,
                           state=SimpleNamespace(fn="fit"), _accelerator_connector=SimpleNamespace(), **kw)


@pytest.fixture
def usr1_default():
    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGUSR1, before)


def _other_handler(signum, frame):  # someone else's (a user's) handler
    pass


def test_the_callback_takes_free_signals_for_fit_only_and_gives_them_back(usr1_default):
    # preemption.py setup: the signal is taken when nobody handles it, only for fit; teardown
    # restores what was there.
    cb, trainer = PreemptionCheckpoint(), _trainer()
    cb.setup(trainer, None, "validate")
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    cb.setup(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) == cb._handler
    cb.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    # SIGTERM is taken at the first hook after Lightning registers its own (sanity check or train
    # start, whichever comes first) and given back as it was found then, not as our own handler.
    sigterm = signal.getsignal(signal.SIGTERM)
    cb.on_sanity_check_start(trainer, None)
    cb.on_train_start(trainer, None)
    assert signal.getsignal(signal.SIGTERM) == cb._handler
    cb.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGTERM) == sigterm


def test_a_handler_of_someone_else_stays_and_one_left_by_an_earlier_run_is_replaced(usr1_default):
    # preemption.py: "A handler left by an earlier run of this callback ... is replaced; anyone
    # else's stays in charge"; the stale one is not restored at teardown (SIG_DFL is).
    trainer = _trainer()
    signal.signal(signal.SIGUSR1, _other_handler)
    cb = PreemptionCheckpoint()
    cb.setup(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) is _other_handler
    cb.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) is _other_handler

    earlier = PreemptionCheckpoint()
    signal.signal(signal.SIGUSR1, earlier._handler)  # left installed (a run that ended in an exception)
    cb.setup(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) == cb._handler
    cb.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_a_signal_is_acted_on_once_and_not_during_the_sanity_check():
    # One signal: one checkpoint and a stop; the sanity check (before training) saves nothing; a
    # SIGTERMException after the validation stop has saved is not saved a second time.
    cb, trainer = PreemptionCheckpoint(), _trainer(0)
    cb.on_train_start(trainer, None)
    try:
        trainer.global_step = 3
        cb._handler(signal.SIGUSR1, None)
        trainer.sanity_checking = True
        cb.on_validation_batch_end(trainer, None)  # no raise, nothing saved
        trainer.sanity_checking = False
        trainer.state.fn = "validate"  # trainer.validate(...) on the same trainer: not a training run to stop
        cb.on_validation_batch_end(trainer, None)
        trainer.state.fn = "fit"
        assert trainer.checkpoint_callback.saved_at == []
        cb.on_train_batch_end(trainer, None, None, None, 0)
        assert trainer.checkpoint_callback.saved_at == [3] and trainer.should_stop and cb.stopped_by == "SIGUSR1"
        trainer.should_stop = False
        cb.on_train_batch_end(trainer, None, None, None, 1)  # the same signal, already acted on
        assert trainer.checkpoint_callback.saved_at == [3] and not trainer.should_stop

        trainer.global_step = 4
        cb._handler(signal.SIGTERM, None)
        with pytest.raises(SIGTERMException):
            cb.on_validation_batch_end(trainer, None)
        cb.on_exception(trainer, None, SIGTERMException())  # Lightning's hook for that exception
        assert trainer.checkpoint_callback.saved_at == [3, 4] and cb.stopped_by == "SIGTERM"
        cb.on_exception(trainer, None, RuntimeError("non-finite loss"))
        assert trainer.checkpoint_callback.saved_at == [3, 4]
    finally:
        cb.teardown(trainer, None, "fit")


def test_without_slurm_auto_requeue_its_signal_is_a_plain_stop():
    # Reference: Lightning's SLURMEnvironment(auto_requeue=False) has a requeue_signal but does not
    # requeue; the callback then saves last.ckpt as for any signal (no hpc checkpoint, no requeue).
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    env = SLURMEnvironment(auto_requeue=False)
    assert env.requeue_signal == signal.SIGUSR1
    trainer = _trainer(2, _signal_connector=None)
    trainer._accelerator_connector = SimpleNamespace(cluster_environment=env)
    cb = PreemptionCheckpoint()
    cb._start_step = 0
    cb._handler(signal.SIGUSR1, None)
    cb.on_train_batch_end(trainer, None, None, None, 0)
    assert trainer.checkpoint_callback.saved_at == [2] and cb.stopped_by == "SIGUSR1"


def test_with_accumulation_a_signal_waits_for_the_optimiser_step_which_the_epochs_last_batch_takes():
    # Reference: Lightning steps the optimiser every accumulate_grad_batches batches and at the
    # last batch of an epoch; the callback acts there only (preemption.py on_train_batch_end).
    cb, trainer = PreemptionCheckpoint(), _trainer(0)
    trainer.accumulate_grad_batches = 2
    cb.on_train_start(trainer, None)
    try:
        trainer.global_step = 1
        cb._handler(signal.SIGUSR1, None)
        cb.on_train_batch_end(trainer, None, None, None, 2)  # 3rd batch of 5: between micro-batches
        assert trainer.checkpoint_callback.saved_at == [] and not trainer.should_stop
        trainer.is_last_batch = True  # ... unless it ends the epoch: Lightning steps there
        cb.on_train_batch_end(trainer, None, None, None, 2)
        assert trainer.checkpoint_callback.saved_at == [1] and trainer.should_stop
    finally:
        cb.teardown(trainer, None, "fit")


@pytest.mark.parametrize("start_step", [0, 7])  # a new run; a run resumed from step 7
def test_a_signal_before_the_first_step_writes_nothing_and_one_after_it_saves_last(start_step):
    # preemption.py _save: no step since the run's start, nothing to write (the checkpoint on disk is
    # as new); the condition is global_step <= the step the run started at (on_train_start), not 0.
    sigterm = signal.getsignal(signal.SIGTERM)
    trainer = _trainer(start_step)
    cb = PreemptionCheckpoint()
    try:
        cb.on_train_start(trainer, None)
        cb._handler(signal.SIGUSR1, None)  # the signal arrives (validation before any step)
        with pytest.raises(SIGTERMException):
            cb.on_validation_batch_end(trainer, None)
        assert trainer.checkpoint_callback.saved_at == [] and cb.stopped_by == "SIGUSR1"

        fresh = PreemptionCheckpoint()  # SIGTERM as Lightning raises it, at the start step
        fresh.on_train_start(trainer, None)
        fresh.on_exception(trainer, None, SIGTERMException())
        assert trainer.checkpoint_callback.saved_at == [] and fresh.stopped_by == "SIGTERM"
        fresh.teardown(trainer, None, "fit")

        trainer.global_step = start_step + 1  # one optimiser step later: last.ckpt of that step
        cb._handler(signal.SIGUSR1, None)
        cb.on_train_batch_end(trainer, None, None, None, 0)
        assert trainer.checkpoint_callback.saved_at == [start_step + 1] and trainer.should_stop
    finally:
        cb.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGTERM) == sigterm


def test_a_second_ctrl_c_stops_at_once_and_an_ignored_sigint_stays_ignored(capsys):
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        cb = PreemptionCheckpoint()
        cb.setup(trainer, None, "fit")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # taken when training starts
        cb.on_train_start(trainer, None)
        os.kill(os.getpid(), signal.SIGINT)  # the first: noted, acted on at the step's end
        assert cb._requested == "SIGINT" and "Ctrl-C again stops at once" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # (the handler runs at the next bytecode)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own again
        # A SIGINT the shell had the process ignore (a background job) is left ignored.
        cb.teardown(trainer, None, "fit")  # (SIGTERM back too)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cb = PreemptionCheckpoint()
        cb.setup(trainer, None, "fit")
        cb.on_train_start(trainer, None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        cb.teardown(trainer, None, "fit")
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_fit_with_the_callback_leaves_the_signal_handlers_as_it_found_them():
    # Lightning restores the handlers it found at the end of a fit; our teardown must not put
    # Lightning's SIGTERM handler back after that (the process would then only log a SIGTERM and
    # go on: an evaluation after the fit, the demo's next fit, could no longer be stopped).
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    model = Supervised(**TINY_BACKBONE, num_classes=4, warmup_epochs=0.0, base_lr=0.1, weight_decay=0.0)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[PreemptionCheckpoint()])
    views, labels = fixed_views([16], batch=4)
    trainer.fit(model, DataLoader(RepeatBatch(views, labels, 2), batch_size=None))
    assert {sig: signal.getsignal(sig) for sig in before} == before
