"""Training that survives faults and bad input.

* checkpoints every N steps and at the end, the newest K kept, written atomically;
* a run interrupted at step k (a crash, SIGTERM, SIGUSR1) and resumed ends with exactly the weights
  and optimiser state of the run that was never interrupted (DINO: teacher EMA, centre, last-layer
  freeze, teacher-temperature and weight-decay schedules, drop path, multi-crop augmentations,
  online probe), also when the resumed run reads its data with worker processes;
* a real SIGTERM to an ``ssl-vit fit`` subprocess writes ``last.ckpt``, exits with 143, and the
  run resumes from it;
* a non-finite loss stops the run with one line naming the step and the last good checkpoint,
  whose bytes stay as they were;
* unreadable images are skipped and listed in the run's summary; a missing or empty image folder
  fails before training with one line, a traceback only with ``--debug`` (the other bad recipes:
  test_training_cli.py).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from helpers import TINY_VIT, under_file_size_limit
from PIL import Image

from ssl_vit.cli import main as ssl_vit_main
from ssl_vit.data import SyntheticDataModule, TwoViews
from ssl_vit.data.sampler import ResumableLoader, ResumableSampler
from ssl_vit.methods import DINO
from ssl_vit.training.checkpoint import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH = 3  # 24 images / batch 8
SNAPSHOT: dict[str, Any] = {}  # what the callbacks below saw, for the assertions


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models on a shared 2-core machine: a second intra-op thread only waits for the first.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def recipe(tmp_path: Path, *, data: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
           callbacks: list[dict[str, Any]] | None = None, **trainer: Any) -> Path:
    """A tiny DINO recipe that uses every piece a resume must restore."""
    cfg = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 3, "default_root_dir": str(tmp_path / "run"),
                    "enable_progress_bar": False, "enable_model_summary": False, "logger": False,
                    "limit_val_batches": 0, "num_sanity_val_steps": 0, "callbacks": callbacks or [], **trainer},
        "checkpoint": {"every_n_train_steps": 2, "keep_last": 2},
        "model": {"class_path": "ssl_vit.methods.DINO", "init_args": {
            "backbone": "vit", "backbone_kwargs": {**TINY_VIT, "drop_path_rate": 0.1},
            "out_dim": 64, "hidden_dim": 32, "bottleneck_dim": 16, "momentum": 0.9,
            "warmup_teacher_temp_epochs": 2, "freeze_last_layer_epochs": 1, "warmup_epochs": 1.0,
            "base_lr": 0.05, "weight_decay": 0.04, "weight_decay_end": 0.4, "grad_clip": 3.0, "grad_clip_mode": "per_param",
            **(model or {})}},
        "data": {"class_path": "ssl_vit.data.SyntheticDataModule", "init_args": {
            "num_samples": 8 * STEPS_PER_EPOCH, "num_test_samples": 0, "num_classes": 4, "img_size": 16, "in_chans": 1,
            "batch_size": 8, "num_workers": 0,
            "views": {"class_path": "ssl_vit.data.MultiCrop", "init_args": {"local_size": 8, "n_local_crops": 2}}, **(data or {})}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def fit(*args: str) -> int:
    return ssl_vit_main(["fit", *args])


def ckpt_dir(tmp_path: Path) -> Path:
    return tmp_path / "run" / "checkpoints"


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


class Crash(Exception):
    """A job killed mid-run: nothing more is saved."""


class Interrupt(L.Callback):
    """At the end of step ``step`` (or, with ``mid_step``, between its backward pass and its
    optimiser step): raise (a crash) or send this process a real signal."""

    def __init__(self, step: int, how: str = "crash", mid_step: bool = False) -> None:
        self.step, self.how, self.mid_step = step, how, mid_step

    def _fire(self, trainer: L.Trainer, global_step: int) -> None:
        if global_step != self.step:
            return
        if self.how == "crash":
            raise Crash
        os.kill(os.getpid(), getattr(signal, self.how))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self.mid_step:
            self._fire(trainer, trainer.global_step)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mid_step:
            self._fire(trainer, trainer.global_step + 1)  # the step being taken


class SignalAtBatch(L.Callback):
    """Send this process ``how`` at the end of batch ``batch_idx`` of epoch ``epoch``."""

    def __init__(self, epoch: int, batch_idx: int, how: str = "SIGTERM") -> None:
        self.epoch, self.batch_idx, self.how = epoch, batch_idx, how

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch_idx:
            os.kill(os.getpid(), getattr(signal, self.how))


class StopAt(L.Callback):
    """Ask the run to stop at the end of step ``step``, as an early-stopping or timer callback does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


class SignalDuringValidation(L.Callback):
    """Send this process ``how`` at the first validation batch of epoch ``epoch``."""

    def __init__(self, epoch: int, how: str = "SIGTERM") -> None:
        self.epoch, self.how = epoch, how

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, *args: Any) -> None:
        if not trainer.sanity_checking and trainer.current_epoch == self.epoch and batch_idx == 0:
            os.kill(os.getpid(), getattr(signal, self.how))


class SignalWhileOthersWait(L.Callback):
    """Process ``rank`` sends itself ``how`` at the start of step ``step``, a second after the other
    processes went on into that step's first collective (where they wait for it)."""

    def __init__(self, step: int, how: str = "SIGTERM", rank: int = 0) -> None:
        self.step, self.how, self.rank = step, how, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            time.sleep(1.0)
            os.kill(os.getpid(), getattr(signal, self.how))


class NaNAtStep(DINO):
    """DINO whose loss turns NaN at one step; it notes the bytes of the last checkpoint then."""

    def __init__(self, nan_step: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nan_step = nan_step

    def step(self, views: list[torch.Tensor], labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().step(views, labels)
        if self.global_step == self.nan_step:
            last = Path(self.trainer.checkpoint_callback.last_model_path)
            SNAPSHOT["last"] = (last, last.read_bytes())
            out["loss"] = out["loss"] * float("inf") * 0.0  # NaN
        return out


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoints_every_n_steps_keep_the_newest_k_and_the_end(tmp_path):
    assert fit("--config", str(recipe(tmp_path, max_epochs=1, max_steps=7, data={"num_samples": 56}))) == 0
    assert sorted(p.name for p in ckpt_dir(tmp_path).iterdir()) == ["last.ckpt", "step00000004.ckpt", "step00000006.ckpt"]
    assert load(ckpt_dir(tmp_path) / "last.ckpt")["global_step"] == 7  # the end, off the interval


def test_a_checkpoint_write_that_dies_leaves_the_previous_file(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)
    before = path.read_bytes()

    class Dies:
        def __reduce__(self):
            raise KeyboardInterrupt("killed mid-write")

    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": 2, "blob": torch.zeros(1000), "dies": Dies()}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # as Lightning's TorchCheckpointIO: storage options are refused, not silently dropped
    with pytest.raises(TypeError, match=r"AtomicCheckpointIO takes no storage_options, got \{'compress': True\}"):
        io.save_checkpoint({"step": 3}, path, storage_options={"compress": True})
    assert path.read_bytes() == before


def test_a_checkpoint_write_that_runs_out_of_space_leaves_the_previous_file(tmp_path):
    """A disk that fills up mid-write, here a file-size limit (writes past 64 KiB fail with EFBIG):
    writing the new file in place would leave its first 64 KiB instead of the old checkpoint."""
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, path)
    before = path.read_bytes()
    run = under_file_size_limit(65536, "import torch\nfrom ssl_vit.training.checkpoint import AtomicCheckpointIO",
                                "AtomicCheckpointIO().save_checkpoint({'step': 2, 'blob': torch.zeros(100_000)}, sys.argv[1])", str(path))
    assert f"refused {errno.EFBIG}" in run.stdout, run.stderr  # the disk's error, not torch's "iostream error"
    assert f"cannot write {path}: File too large" in run.stdout
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


# ----------------------------------------------------------------------------- exact resume


def test_the_training_loader_resumes_its_epoch_at_the_next_batch():
    def loader():
        dm = SyntheticDataModule(num_samples=20, num_test_samples=0, img_size=16, in_chans=1, batch_size=4, num_workers=0, views=TwoViews())
        return dm.train_dataloader()

    def same(a, b):
        return all(torch.equal(x, y) for (va, la), (vb, lb) in zip(a, b, strict=True) for x, y in zip([*va, la], [*vb, lb]))

    reference = loader()
    reference.sampler.set_epoch(1)
    epoch1 = list(reference)
    reference.sampler.set_epoch(2)
    epoch2 = list(reference)
    interrupted = loader()
    interrupted.sampler.set_epoch(1)
    it = iter(interrupted)
    next(it), next(it)
    state = interrupted.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 2
    resumed = loader()
    resumed.load_state_dict(state)
    assert same(list(resumed), epoch1[2:])  # the same images, augmented the same way
    assert resumed.state_dict()["batches"] == 5
    at_end = loader()
    at_end.load_state_dict(resumed.state_dict())  # saved after the epoch's last batch
    assert same(list(at_end), epoch2)
    assert not same(list(at_end), epoch2)  # iterated again without set_epoch: the next epoch, not a repeat


class Ids(torch.utils.data.Dataset):
    """``length`` images whose item is the dataset index the sampler drew."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        return i.index


@pytest.mark.parametrize("batch, world, new_batch, new_world", [(4, 1, 2, 1), (2, 1, 4, 2), (4, 2, 4, 1), (2, 2, 3, 1)])
def test_a_resumed_epoch_continues_after_the_images_seen_whatever_the_new_layout(batch, world, new_batch, new_world):
    # Every process shards the same permutation of the epoch (position p, p + R, ...): after k
    # images per process on R processes, the first k * R positions are seen. A run resumed with
    # another batch size or number of processes starts each process after them.
    dataset = Ids(24)

    def loader(batch_size: int, replicas: int, rank: int) -> ResumableLoader:
        sampler = ResumableSampler(dataset, num_replicas=replicas, rank=rank, seed=3)
        return ResumableLoader(dataset, sampler=sampler, batch_size=batch_size, drop_last=True, collate_fn=list)

    order = [i.index for i in ResumableSampler(dataset, num_replicas=1, rank=0, seed=3)]  # the epoch's permutation
    states = []
    for rank in range(world):
        interrupted = loader(batch, world, rank)
        it = iter(interrupted)
        next(it), next(it)
        states.append(interrupted.state_dict())
    seen = 2 * batch * world
    assert all(s["samples"] == seen for s in states)
    for rank in range(new_world):
        resumed = loader(new_batch, new_world, rank)
        resumed.load_state_dict(states[0])
        got = [i for b in resumed for i in b]
        want = order[seen + rank :: new_world]
        assert got == want[: len(got)] and len(want) - len(got) < new_batch



@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_checkpoint_written_before_the_first_resumed_batch_keeps_the_position(num_workers):
    # Lightning reruns an interrupted validation pass before the next training batch, and a
    # requeue signal can save there: that checkpoint must hold the resumed position, not 0.
    dataset = Ids(40)
    sampler = ResumableSampler(dataset, num_replicas=2, rank=0, seed=1)
    loader = ResumableLoader(dataset, sampler=sampler, batch_size=4, drop_last=True, num_workers=num_workers)
    it = iter(loader)
    for _ in range(3):
        next(it)
    saved = loader.state_dict()
    assert saved["samples"] == 24 and saved["batches"] == 3
    resumed = ResumableLoader(dataset, sampler=ResumableSampler(dataset, num_replicas=2, rank=0, seed=1), batch_size=4, drop_last=True,
                              num_workers=num_workers)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved  # loaded
    resumed.sampler.set_epoch(saved["epoch"])
    assert resumed.state_dict() == saved  # the epoch set again, as Lightning does
    it = iter(resumed)
    assert resumed.state_dict() == saved  # the pass begun (workers draw ahead), no batch yet
    next(it)
    assert resumed.state_dict()["samples"] == 32 and resumed.state_dict()["batches"] == 4
    del it


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    assert fit("--config", str(recipe(tmp_path))) == 0
    return load(ckpt_dir(tmp_path) / "last.ckpt")


def assert_same_run(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["global_step"] == want["global_step"] == 3 * STEPS_PER_EPOCH
    assert got["state_dict"].keys() == want["state_dict"].keys()
    for key, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key  # online, teacher, centre, probe
    for g, w in zip(got["optimizer_states"][0]["state"].values(), want["optimizer_states"][0]["state"].values(), strict=True):
        assert all(torch.equal(g[k], w[k]) for k in w)  # AdamW moments and step counts
    assert got["ssl_vit"]["pretrain_flops"] == want["ssl_vit"]["pretrain_flops"] > 0  # every step counted once


@pytest.mark.parametrize(
    "how,step,resumed_from",
    [
        ("crash", 7, 6),  # killed: the periodic checkpoint of step 6, at an epoch's end
        ("SIGTERM", 4, 4),  # preempted one batch into the second epoch: last.ckpt of that step
        ("SIGUSR1", 5, 5),  # SLURM's warning signal: the stop happens after the signalled step
        ("SIGINT", 4, 4),  # Ctrl-C: as SIGTERM, the step finishes and last.ckpt is written
    ],
)
def test_an_interrupted_run_resumes_to_the_uninterrupted_weights(tmp_path, uninterrupted, how, step, resumed_from, caplog):
    interrupt = [{"class_path": "test_faults.Interrupt", "init_args": {"step": step, "how": how}}]
    if how == "crash":
        before = signal.getsignal(signal.SIGINT)
        with pytest.raises(Crash):
            fit("--config", str(recipe(tmp_path, callbacks=interrupt)))
        assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C is the process's own again
    else:
        assert fit("--config", str(recipe(tmp_path, callbacks=interrupt))) == 128 + getattr(signal, how)
    last = load(ckpt_dir(tmp_path) / "last.ckpt")
    assert last["global_step"] == resumed_from
    # The run resumes with worker processes reading the data: the result cannot depend on them.
    resumed = recipe(tmp_path, data={"num_workers": 1} if how == "SIGTERM" else None)
    with caplog.at_level(logging.INFO):
        assert fit("--config", str(resumed), "--resume") == 0
    assert "effective batch size" in caplog.text  # (the log is captured)
    assert "planned for" not in caplog.text and "resumed a run trained at" not in caplog.text  # same settings: no note
    assert_same_run(load(ckpt_dir(tmp_path) / "last.ckpt"), uninterrupted)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGUSR1"])
def test_a_signal_during_validation_stops_it_and_the_run_resumes_exactly(tmp_path, uninterrupted, how):
    with_validation = {"data": {"num_test_samples": 16}, "limit_val_batches": 2}
    signal_it = [{"class_path": "test_faults.SignalDuringValidation", "init_args": {"epoch": 1, "how": how}}]
    assert fit("--config", str(recipe(tmp_path, callbacks=signal_it, **with_validation))) == 128 + getattr(signal, how)
    assert load(ckpt_dir(tmp_path) / "last.ckpt")["global_step"] == 2 * STEPS_PER_EPOCH  # the step before validation
    assert fit("--config", str(recipe(tmp_path, **with_validation)), "--resume") == 0
    assert_same_run(load(ckpt_dir(tmp_path) / "last.ckpt"), uninterrupted)  # validation changes no weights


def test_a_finished_run_continued_with_a_larger_budget_takes_every_remaining_batch(tmp_path):
    assert fit("--config", str(recipe(tmp_path, max_steps=5))) == 0  # ends in epoch 2, off the checkpoint interval
    assert load(ckpt_dir(tmp_path) / "last.ckpt")["global_step"] == 5
    assert fit("--config", str(recipe(tmp_path)), "--resume") == 0  # on to the end of epoch 3
    assert load(ckpt_dir(tmp_path) / "last.ckpt")["global_step"] == 3 * STEPS_PER_EPOCH  # no batch skipped


def test_a_run_finished_by_its_epochs_continued_with_more_takes_every_remaining_batch(tmp_path):
    assert fit("--config", str(recipe(tmp_path, max_epochs=1))) == 0  # step 3: off the checkpoint interval
    assert load(ckpt_dir(tmp_path) / "last.ckpt")["global_step"] == STEPS_PER_EPOCH
    assert fit("--config", str(recipe(tmp_path)), "--resume") == 0
    assert load(ckpt_dir(tmp_path) / "last.ckpt")["global_step"] == 3 * STEPS_PER_EPOCH  # no batch skipped


def test_checkpoints_go_where_checkpoint_dirpath_says_and_the_run_resumes_from_there(tmp_path):
    mine = tmp_path / "mine"
    assert fit("--config", str(recipe(tmp_path, max_steps=2)), "--checkpoint.dirpath", str(mine)) == 0
    assert load(mine / "last.ckpt")["global_step"] == 2 and not ckpt_dir(tmp_path).exists()
    assert fit("--config", str(recipe(tmp_path, max_steps=4)), "--checkpoint.dirpath", str(mine), "--resume") == 0
    assert load(mine / "last.ckpt")["global_step"] == 4 and not ckpt_dir(tmp_path).exists()


def test_a_run_another_callback_stopped_continues_with_every_remaining_batch(tmp_path, uninterrupted):
    stop = [{"class_path": "test_faults.StopAt", "init_args": {"step": 5}}]  # mid-epoch, off the checkpoint interval
    assert fit("--config", str(recipe(tmp_path, callbacks=stop))) == 0
    assert load(ckpt_dir(tmp_path) / "last.ckpt")["global_step"] == 5  # saved at that batch's end, not after the loop
    assert fit("--config", str(recipe(tmp_path)), "--resume") == 0
    assert_same_run(load(ckpt_dir(tmp_path) / "last.ckpt"), uninterrupted)


def test_a_signal_between_accumulated_batches_waits_for_the_optimiser_step(tmp_path):
    """With gradient accumulation a stop between two micro-batches would lose the gradient gathered
    so far: the signal is acted on at the next optimiser step, and the run resumes exactly."""
    accumulate = {"accumulate_grad_batches": 2}
    whole = tmp_path / "whole"
    whole.mkdir()
    assert fit("--config", str(recipe(whole, **accumulate))) == 0
    signal_it = [{"class_path": "test_faults.SignalAtBatch", "init_args": {"epoch": 1, "batch_idx": 0}}]  # mid-accumulation
    assert fit("--config", str(recipe(tmp_path, callbacks=signal_it, **accumulate))) == 128 + signal.SIGTERM
    last = load(ckpt_dir(tmp_path) / "last.ckpt")
    assert last["global_step"] == 3  # epoch 0: steps after batches 1 and 2; epoch 1: after batch 1
    assert fit("--config", str(recipe(tmp_path, **accumulate)), "--resume") == 0
    want, got = load(ckpt_dir(whole) / "last.ckpt"), load(ckpt_dir(tmp_path) / "last.ckpt")
    assert got["global_step"] == want["global_step"] == 6
    for key, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key


def test_ckpt_path_last_in_the_recipe_resumes_too(tmp_path, uninterrupted):
    interrupt = [{"class_path": "test_faults.Interrupt", "init_args": {"step": 3, "how": "crash"}}]  # after step 2's save
    with pytest.raises(Crash):
        fit("--config", str(recipe(tmp_path, callbacks=interrupt)))
    cfg = yaml.safe_load(recipe(tmp_path).read_text())
    cfg["ckpt_path"] = "last"
    (tmp_path / "resume.yaml").write_text(yaml.safe_dump(cfg))
    assert fit("--config", str(tmp_path / "resume.yaml")) == 0
    assert_same_run(load(ckpt_dir(tmp_path) / "last.ckpt"), uninterrupted)


def test_slurm_requeue_signal_mid_step_requeues_after_it_and_the_requeued_job_resumes_exactly(tmp_path, uninterrupted, monkeypatch, capsys):
    """``recipes/trainer/slurm.yaml`` in a SLURM job (its environment and ``scontrol`` faked): the
    requeue signal, arriving between a step's backward pass and its optimiser step, saves the hpc
    checkpoint after that step, requeues the job and stops; the requeued job (the same command)
    resumes from it to the uninterrupted run's weights. (Lightning's own handler saved inside the
    signal handler, mid-step, and let the run go on.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "pretrain", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}
    for name in [k for k in os.environ if k.startswith("SLURM_")]:  # (a test run inside a SLURM job: only the fake job's)
        monkeypatch.delenv(name)
    for name, value in {**slurm, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}.items():
        monkeypatch.setenv(name, value)

    def job(callbacks: list[dict[str, Any]] | None = None) -> int:
        # the job line README.md gives: the first run starts, the requeued one resumes
        return fit("--config", str(recipe(tmp_path, callbacks=callbacks)), "--config", str(ROOT / "recipes/trainer/slurm.yaml"), "--ckpt_path", "auto")

    interrupt = [{"class_path": "test_faults.Interrupt", "init_args": {"step": 5, "how": "SIGUSR1", "mid_step": True}}]
    assert job(interrupt) == 128 + signal.SIGUSR1
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert load(tmp_path / "run" / "hpc_ckpt_1.ckpt")["global_step"] == 5  # after the signalled step, whole
    capsys.readouterr()
    assert job() == 0
    assert "ssl-vit fit: resuming from" in capsys.readouterr().err  # hpc_ckpt_1.ckpt or last.ckpt: both hold step 5
    assert_same_run(load(ckpt_dir(tmp_path) / "last.ckpt"), uninterrupted)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_a_training_process_checkpoints_and_the_run_resumes(tmp_path, how):
    # SIGINT goes to the whole process group, as a terminal's Ctrl-C does: the data worker gets
    # it too (and ignores it: see the test below).
    steps = 120  # far more than the process gets through before the signal
    cfg = recipe(tmp_path, max_epochs=-1, max_steps=steps, log_every_n_steps=1, data={"num_workers": 1} if how == "SIGINT" else None)
    cmd = [sys.executable, "-m", "ssl_vit.cli", "fit", "--config", str(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    first = ckpt_dir(tmp_path) / "step00000002.ckpt"
    deadline = time.monotonic() + 120
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.exists(), "the subprocess never reached step 2"
    os.killpg(proc.pid, getattr(signal, how))  # the process and its data worker
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + getattr(signal, how), output[-3000:]
    assert f"received {how}: checkpoint written to" in output and "continue with --resume" in output, output[-3000:]
    if how == "SIGINT":
        assert "Ctrl-C again stops at once" in output
    last = load(ckpt_dir(tmp_path) / "last.ckpt")  # complete and loadable
    assert 2 <= last["global_step"] < steps
    assert not [p for p in ckpt_dir(tmp_path).iterdir() if p.suffix == ".tmp"]  # no half-written files
    end = last["global_step"] + 2  # (the run goes on from there: two steps show it, the rest would only take time)
    assert fit("--config", str(cfg), "--resume", "--trainer.max_steps", str(end)) == 0
    assert load(ckpt_dir(tmp_path) / "last.ckpt")["global_step"] == end


def test_data_workers_ignore_ctrl_c_and_leave_the_decision_to_the_training_process():
    # A worker killed by the terminal's SIGINT while the process waits on its batch would fail
    # the step that is to finish and be saved; forked workers inherit the training process's
    # handler, but spawned ones (macOS, Windows) start with Python's KeyboardInterrupt.
    from ssl_vit.data.base import ignore_sigint

    dm = SyntheticDataModule(num_samples=16, num_test_samples=8, num_classes=4, img_size=16, in_chans=1, batch_size=8,
                             num_workers=1, views=TwoViews(size=16))
    dm.setup("fit")
    assert dm.train_dataloader().worker_init_fn is ignore_sigint and dm.val_dataloader().worker_init_fn is ignore_sigint
    before = signal.getsignal(signal.SIGINT)
    try:
        ignore_sigint(0)  # what a worker process runs first
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


# ----------------------------------------------------------------------------- non-finite loss


def test_a_nonfinite_loss_names_the_step_and_leaves_the_last_good_checkpoint(tmp_path, capsys):
    model = {"class_path": "test_faults.NaNAtStep", "init_args": {"nan_step": 5}}
    cfg = yaml.safe_load(recipe(tmp_path).read_text())
    cfg["model"] = {**model, "init_args": {**cfg["model"]["init_args"], **model["init_args"]}}
    (tmp_path / "nan.yaml").write_text(yaml.safe_dump(cfg))
    SNAPSHOT.clear()
    assert fit("--config", str(tmp_path / "nan.yaml")) == 1
    err = capsys.readouterr().err
    last, before = SNAPSHOT["last"]
    assert last.name == "last.ckpt" and last.read_bytes() == before  # intact
    assert load(last)["global_step"] == 4
    message = err.strip().splitlines()[-1]
    assert message.startswith("ssl-vit fit: error: non-finite loss") and "at step 5" in message
    assert f"the last good checkpoint is {last}" in message and "Traceback" not in err
    # --debug shows where it came from
    with pytest.raises(RuntimeError, match="non-finite loss"):
        ssl_vit_main(["fit", "--config", str(tmp_path / "nan.yaml"), "--resume", "--debug"])


# ----------------------------------------------------------------------------- bad input


def _pngs(folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"img{i}.png"
        noise = torch.randint(0, 256, (20, 20), generator=torch.Generator().manual_seed(i), dtype=torch.uint8)
        Image.fromarray(noise.numpy(), "L").save(path)
        paths.append(path)
    return paths


def test_unreadable_images_are_skipped_and_listed_in_the_summary(tmp_path, caplog):
    good = _pngs(tmp_path / "images" / "a", 8) + _pngs(tmp_path / "images" / "b", 8)
    bad = [tmp_path / "images" / "a" / "garbage.png", tmp_path / "images" / "b" / "truncated.png",
           tmp_path / "images" / "b" / "empty.jpg"]
    bad[0].write_bytes(b"not an image at all" * 20)
    bad[1].write_bytes(good[0].read_bytes()[:250])  # of ~460
    bad[2].write_bytes(b"")
    data = {"class_path": "ssl_vit.data.ImageFolderDataModule", "init_args": {
        "train_dir": str(tmp_path / "images"), "img_size": 16, "in_chans": 1, "batch_size": 19, "drop_last": False,
        "num_workers": 1, "views": {"class_path": "ssl_vit.data.MultiCrop", "init_args": {"local_size": 8, "n_local_crops": 2}}}}
    cfg = yaml.safe_load(recipe(tmp_path, max_epochs=2).read_text())
    cfg["data"] = data
    (tmp_path / "folder.yaml").write_text(yaml.safe_dump(cfg))
    with caplog.at_level(logging.WARNING, logger="ssl_vit"):
        assert fit("--config", str(tmp_path / "folder.yaml")) == 0
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped ")]
    assert len(summary) == 1 and summary[0].startswith("skipped 3 unreadable files: ")
    assert all(str(p) in summary[0] for p in bad)
    assert load(ckpt_dir(tmp_path) / "last.ckpt")["global_step"] == 2  # one batch of 19 per epoch


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_a_missing_or_empty_image_folder_is_one_clear_error(tmp_path, capsys, folder):
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    cfg = yaml.safe_load(recipe(tmp_path).read_text())
    cfg["data"] = {"class_path": "ssl_vit.data.ImageFolderDataModule", "init_args": {
        "train_dir": str(tmp_path / folder), "img_size": 16, "in_chans": 1, "batch_size": 8, "num_workers": 0,
        "views": {"class_path": "ssl_vit.data.MultiCrop", "init_args": {"local_size": 8, "n_local_crops": 2}}}}
    (tmp_path / "folder.yaml").write_text(yaml.safe_dump(cfg))
    assert fit("--config", str(tmp_path / "folder.yaml")) == 1
    err = capsys.readouterr().err
    expected = "does not exist or is not a directory" if folder == "missing" else "no images found in"
    assert err.strip().splitlines()[-1].startswith("ssl-vit fit: error: ") and expected in err
    assert str(tmp_path / folder) in err and "Traceback" not in err
    assert not ckpt_dir(tmp_path).exists()


def test_debug_shows_the_traceback_of_a_bad_recipe(tmp_path):
    with pytest.raises(ValueError, match="not divisible by the patch size 5"):
        ssl_vit_main(["fit", "--config", str(recipe(tmp_path)), "--model.init_args.backbone_kwargs.patch_size", "5", "--debug"])


class CrashOnRank(L.Callback):
    """Process ``rank`` raises at the start of step ``step``; the others go on into that step."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            raise Crash(f"rank {self.rank} crashed at step {self.step}")
