"""The preemption callback's signal handling against hand-written expectations from its
docstrings (which signal handlers it takes and gives back, when a signal is acted on) and
Lightning's own SLURM environment and accumulation rule."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

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
    from lightning.pytorch.utilities.exceptions import SIGTERMException

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
