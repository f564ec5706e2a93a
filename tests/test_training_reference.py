"""Training mechanics against expectations written out by hand: the global batch split over
devices x nodes x accumulation, the choice of the checkpoint to resume, the online probe's fixed
learning rate, its masked loss and the world-size rule of its batch check."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_BACKBONE, fit_steps, fixed_views
from lightning.pytorch.callbacks import Callback

import ssl_vit.methods.probe as probe_module
from ssl_vit.cli.recipe_checks import validate_run
from ssl_vit.errors import ConfigError
from ssl_vit.methods import Supervised
from ssl_vit.methods.probe import OnlineLinearProbe
from ssl_vit.training.checkpoint import newest_checkpoint

# ---------------------------------------------------------------- global batch over devices x nodes


def _trainer(devices: int, num_nodes: int, accumulate: int = 1) -> L.Trainer:
    # Built, never fitted: Lightning launches no process before ``fit``.
    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="ddp", max_steps=10,
                     accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


@pytest.mark.parametrize(("devices", "nodes", "accumulate", "global_batch", "per_process"), [
    (2, 2, 1, 256, 64),   # 256 / (2 x 2)
    (4, 3, 2, 240, 10),   # 240 / (4 x 3 x 2)
    (1, 1, 1, 32, 32),    # one process takes the whole batch
])
def test_the_global_batch_is_split_over_devices_times_nodes_times_accumulation(devices, nodes, accumulate, global_batch, per_process):
    # cli.py docstring: "--global_batch_size N ... split evenly over devices x nodes x accumulation".
    model = SimpleNamespace(backbone=SimpleNamespace(in_chans=1))
    datamodule = SimpleNamespace(batch_size=None)
    validate_run(model, datamodule, _trainer(devices, nodes, accumulate), global_batch)
    assert datamodule.batch_size == per_process


def test_a_global_batch_that_does_not_split_over_the_nodes_is_refused():
    # 250 splits over 2 devices (125 each) but not over 2 devices x 2 nodes = 4.
    model = SimpleNamespace(backbone=SimpleNamespace(in_chans=1))
    datamodule = SimpleNamespace(batch_size=None)
    with pytest.raises(ConfigError, match=r"^global_batch_size 250 is not divisible by devices x nodes x accumulate_grad_batches = 4$"):
        validate_run(model, datamodule, _trainer(2, 2), 250)
    assert datamodule.batch_size is None


# ---------------------------------------------------------------- the checkpoint a resume takes


def _checkpoint(path: Path, step: int, mtime_s: int) -> None:
    torch.save({"global_step": step, "state_dict": {"w": torch.zeros(1)}}, path)
    os.utime(path, ns=(mtime_s * 10**9,) * 2)


def test_newest_checkpoint_is_the_furthest_trained_then_the_latest_written(tmp_path):
    # checkpoint.newest_checkpoint: "Furthest by the optimiser step each file records, then by
    # modification time" (a copied run folder gets new times; whole-second file systems tie them).
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    assert newest_checkpoint(ckpts, tmp_path) is None
    (ckpts / "notes.txt").write_text("")  # not a *.ckpt
    assert newest_checkpoint(ckpts) is None
    _checkpoint(ckpts / "z_far.ckpt", step=9, mtime_s=1_000)          # furthest step, oldest time
    _checkpoint(ckpts / "a_near.ckpt", step=4, mtime_s=3_000)         # nearer step, newer time
    (ckpts / "b_broken.ckpt").write_bytes(b"not a checkpoint")        # no step: -1, newest time
    os.utime(ckpts / "b_broken.ckpt", ns=(5_000 * 10**9,) * 2)
    torch.save({"state_dict": {}}, ckpts / "c_weights.ckpt")         # a torch file without a step: -1 too
    os.utime(ckpts / "c_weights.ckpt", ns=(6_000 * 10**9,) * 2)
    torch.save([1, 2], ckpts / "d_list.ckpt")                         # not even a mapping
    os.utime(ckpts / "d_list.ckpt", ns=(7_000 * 10**9,) * 2)
    _checkpoint(tmp_path / "hpc_ckpt_1.ckpt", step=7, mtime_s=4_000)  # SLURM requeue file, newer but behind
    assert newest_checkpoint(ckpts) == ckpts / "z_far.ckpt"
    assert newest_checkpoint(ckpts, tmp_path) == ckpts / "z_far.ckpt"
    _checkpoint(tmp_path / "hpc_ckpt_1.ckpt", step=11, mtime_s=500)   # now the furthest, and the oldest
    assert newest_checkpoint(ckpts, tmp_path) == tmp_path / "hpc_ckpt_1.ckpt"
    # The same step: the later written wins (not the name: "a" sorts before "z").
    _checkpoint(ckpts / "a_same.ckpt", step=9, mtime_s=2_000)
    assert newest_checkpoint(ckpts) == ckpts / "a_same.ckpt"
    # The same step and time (a file system of whole seconds): last.ckpt, the run's own newest state.
    _checkpoint(ckpts / "last.ckpt", step=9, mtime_s=2_000)
    assert newest_checkpoint(ckpts) == ckpts / "last.ckpt"
    # a folder named like a checkpoint is none
    (tmp_path / "only_a_folder" / "x.ckpt").mkdir(parents=True)
    assert newest_checkpoint(tmp_path / "only_a_folder") is None


# ---------------------------------------------------------------- the online probe's learning rate


class _GroupLRs(Callback):
    def __init__(self, probe_ids: set[int]) -> None:
        self.probe: list[float] = []
        self.model: list[list[float]] = []
        self.probe_ids = probe_ids

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        groups = trainer.optimizers[0].param_groups
        probe = [g for g in groups if {id(p) for p in g["params"]} == self.probe_ids]
        assert len(probe) == 1  # the probe's parameters are one group of their own
        self.probe.append(probe[0]["lr"])
        self.model.append([g["lr"] for g in groups if g is not probe[0]])


def test_the_online_probe_keeps_its_fixed_lr_while_the_model_follows_the_schedule():
    # base.py: "probe_lr: AdamW learning rate of the online probe (constant ...)". The model's LR:
    # peak = base_lr x 16/256 = 0.00625, a linear warm-up over 2 steps ((s + 1) / 2 x peak), then a
    # cosine over the 3 remaining steps towards 0 (DINO's cosine_scheduler: cos(pi i / 3)).
    torch.manual_seed(0)
    model = Supervised(**TINY_BACKBONE, num_classes=4, base_lr=0.1, warmup_steps=2, weight_decay=0.0, probe_lr=0.0123)
    recorder = _GroupLRs({id(p) for p in model.probe.parameters()})
    views, labels = fixed_views([16], batch=16)
    fit_steps(model, views, labels, steps=5, callbacks_extra=[recorder])
    peak = 0.1 * 16 / 256
    expected = [peak / 2, peak, *(peak * (math.cos(math.pi * i / 3) + 1) / 2 for i in range(3))]
    assert recorder.probe == [0.0123] * 5
    assert len(recorder.model) == 5 and all(len(lrs) >= 1 for lrs in recorder.model)
    for lrs, want in zip(recorder.model, expected):
        assert lrs == pytest.approx([want] * len(lrs), abs=1e-12)


# ---------------------------------------------------------------- the online probe's loss


def _probe(in_dim: int = 6, classes: int = 3) -> OnlineLinearProbe:
    torch.manual_seed(0)
    probe = OnlineLinearProbe(in_dim, classes)
    with torch.no_grad():  # weights far from the std-0.01 init: logits that tell rows apart
        probe.head.linear.weight.normal_(0, 1.0)
        probe.head.linear.bias.normal_(0, 0.5)
    return probe


def test_the_probe_loss_is_the_cross_entropy_of_the_labelled_rows_only():
    # probe.py: "Cross-entropy ... over the labelled rows"; "rows labelled -1 ... are ignored". The
    # reference written out: BatchNorm without affine over the whole batch (every row, eps 1e-6,
    # biased variance), the linear layer, then F.cross_entropy on the labelled subset.
    probe = _probe()
    g = torch.Generator().manual_seed(1)
    features = torch.randn(8, 6, generator=g) * 2 + 1
    labels = torch.tensor([0, -1, 2, 1, -1, 0, 2, -1])
    w, b = probe.head.linear.weight.detach(), probe.head.linear.bias.detach()
    z = (features - features.mean(0)) / torch.sqrt(features.var(0, unbiased=False) + 1e-6)
    logits = z @ w.T + b
    keep = torch.tensor([True, False, True, True, False, True, True, False])
    want = F.cross_entropy(logits[keep], labels[keep])
    want_acc = (logits[keep].argmax(1) == labels[keep]).float().mean()

    loss, acc = probe.training_loss(features, labels)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc, want_acc)
    # (not the mean over all 8 rows, unlabelled ones counted as class 0)
    assert float(F.cross_entropy(logits, labels.clamp(min=0))) != pytest.approx(float(want), rel=1e-3)
    # Every row labelled: plain cross-entropy.
    full = torch.tensor([0, 1, 2, 1, 0, 0, 2, 1])
    torch.testing.assert_close(probe.training_loss(features, full)[0], F.cross_entropy(logits, full), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the probe's batch check x world size


def test_the_probe_batch_check_counts_the_rows_of_every_process(monkeypatch):
    # probe.py: "(None, None) when the global batch has a single row (BatchNorm needs two), or, on a
    # single process, no labelled row (with several processes every one must take part, with a zero
    # loss if need be)": the global batch is rows x world size. The head in eval mode stands in for
    # BatchNorm synchronised over the processes (a plain one refuses a single row in training).
    probe = _probe()
    probe.head.eval()
    features = torch.randn(1, 6, generator=torch.Generator().manual_seed(2))
    label = torch.tensor([2])
    w, b = probe.head.linear.weight.detach(), probe.head.linear.bias.detach()
    logits = (features / math.sqrt(1 + 1e-6)) @ w.T + b  # running mean 0, running variance 1

    monkeypatch.setattr(probe_module, "world_info", lambda: (0, 1))
    assert probe.training_loss(features, label) == (None, None)  # one row in all: nothing to normalise
    assert probe.training_loss(torch.cat([features, features]), torch.tensor([-1, -1])) == (None, None)

    monkeypatch.setattr(probe_module, "world_info", lambda: (1, 2))  # one row here, one on the other process
    loss, acc = probe.training_loss(features, label)
    torch.testing.assert_close(loss, F.cross_entropy(logits, label), rtol=1e-5, atol=1e-6)
    assert float(acc) == float(logits.argmax(1) == label)
    loss, acc = probe.training_loss(features, torch.tensor([-1]))  # unlabelled here: a zero loss, still taking part
    assert loss is not None and float(loss.detach()) == 0.0 and loss.requires_grad and float(acc) == 0.0
