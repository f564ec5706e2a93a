"""`ssl-vit fit`: recipes run end to end, bad recipes fail before training with one clear line,
checkpoints land where --resume finds them."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
import weakref
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from ssl_vit.cli import main as cli_main

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").rglob("*.yaml"))
METHOD_RECIPES = [p for p in RECIPES if "class_path" in (yaml.safe_load(p.read_text()).get("model") or {})]
# Backbone swaps merged after recipes/fashion_mnist/supervised.yaml (ViT vs ResNet vs hybrid)
COMPUTE_RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes", "fashion_mnist", "compute").glob("*.yaml"))

TINY_BACKBONE = {"img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2}
SMALL_HEADS = {
    "ssl_vit.methods.DINO": {"out_dim": 64, "hidden_dim": 32, "bottleneck_dim": 16},
    "ssl_vit.methods.MoCoV3": {"proj_hidden_dim": 32, "pred_hidden_dim": 32, "proj_output_dim": 16},
    "ssl_vit.methods.MPP": {},
    "ssl_vit.methods.Supervised": {},
    "helpers.Reconstruct": {},
}
VIEW_SIZE_KEYS = {
    "ssl_vit.data.MultiCrop": {"global_size": 16, "local_size": 8, "n_local_crops": 2},
    "ssl_vit.data.TwoViews": {"size": 16},
    "ssl_vit.data.SingleView": {"size": 16},
}


def tiny_config(tmp_path: Path, method: str = "ssl_vit.methods.DINO", views: str = "ssl_vit.data.MultiCrop", **trainer) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 3, "max_epochs": 1, "default_root_dir": str(tmp_path / "run"),
                    "enable_progress_bar": False, "enable_model_summary": False, "logger": False, **trainer},
        "checkpoint": {"every_n_train_steps": 2},
        "model": {"class_path": method, "init_args": {"backbone": "vit", "backbone_kwargs": {**TINY_BACKBONE, "in_chans": 3}, "warmup_epochs": 0.0, **SMALL_HEADS[method]}},
        "data": {"class_path": "ssl_vit.data.SyntheticDataModule", "init_args": {"num_samples": 32, "num_test_samples": 8, "img_size": 16, "batch_size": 8, "num_workers": 0,
                 "views": {"class_path": views, "init_args": VIEW_SIZE_KEYS[views]}}},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_fit_writes_step_and_last_checkpoints_with_the_recipe(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path)
    lines: list[str] = []
    monkeypatch.setattr("ssl_vit.training.progress.rank_zero_info", lines.append)
    assert cli_main(["fit", "--config", str(cfg)]) == 0
    # the recipe turns the progress bar off: a line of progress instead (here only the last)
    assert [line for line in lines if line.startswith("[ssl_vit] training:")] == [
        next(line for line in lines if line.startswith("[ssl_vit] training: step 3/3 (100 %), epoch 0.75, loss ") and line.endswith(" (done)"))]
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert ckpts == ["last.ckpt", "step00000002.ckpt"]
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    meta = ckpt["ssl_vit"]
    assert meta["method"] == "DINO" and meta["global_step"] == 3 and meta["backbone"] == "vit"
    assert "class_path: ssl_vit.methods.DINO" in meta["recipe"]
    assert meta["data"]["num_classes"] == 10 and meta["global_batch_size"] == 8
    # Cumulative pretraining compute (ViT paper Fig. 5's x-axis) grows by the same amount each
    # step (fixed view shapes), so step 3 holds 1.5x step 2's total.
    at_2 = torch.load(tmp_path / "run" / "checkpoints" / "step00000002.ckpt", weights_only=False)["ssl_vit"]["pretrain_flops"]
    assert at_2 > 0 and meta["pretrain_flops"] == pytest.approx(1.5 * at_2)


def test_a_fast_dev_run_or_one_without_checkpointing_saves_nothing_and_leaves_the_folder_to_the_real_run(tmp_path):
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg), "--trainer.fast_dev_run", "true"]) == 0
    # the recipe's checkpoint section is set aside, not handed to a Trainer that refuses it
    assert cli_main(["fit", "--config", str(cfg), "--trainer.enable_checkpointing", "false"]) == 0
    assert not list((tmp_path / "run").rglob("*.ckpt"))
    assert cli_main(["fit", "--config", str(cfg)]) == 0  # no "already holds checkpoints" refusal


def test_resume_continues_from_the_last_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg)]) == 0
    assert cli_main(["fit", "--config", str(cfg), "--trainer.max_steps", "5", "--trainer.max_epochs", "3", "--resume"]) == 0
    first = torch.load(tmp_path / "run" / "checkpoints" / "step00000002.ckpt", weights_only=False)
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 5
    # The FLOPs total resumes too: 5 steps' worth, not the 2 after the resume.
    assert ckpt["ssl_vit"]["pretrain_flops"] == pytest.approx(2.5 * first["ssl_vit"]["pretrain_flops"])


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))


def test_a_resumed_run_removes_the_unfinished_writes_of_a_killed_job(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg)]) == 0
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / ".last.ckpt.k1ll3d.tmp").write_bytes(b"half a checkpoint")  # atomic_write's name, the rename never came
    (ckpts / ".notes.txt.k1ll3d.tmp").write_bytes(b"not a checkpoint's")
    capsys.readouterr()
    assert cli_main(["fit", "--config", str(cfg), "--trainer.max_steps", "4", "--resume"]) == 0
    assert "removed 1 unfinished checkpoint write(s) of an interrupted job: .last.ckpt.k1ll3d.tmp" in capsys.readouterr().err
    assert not (ckpts / ".last.ckpt.k1ll3d.tmp").exists() and (ckpts / ".notes.txt.k1ll3d.tmp").exists()


def test_a_strategy_with_its_own_checkpoint_io_keeps_it(tmp_path, monkeypatch):
    # Checkpoints are written atomically (AtomicCheckpointIO) ...
    import ssl_vit.training.checkpoint as checkpoint

    atomic, real = [], checkpoint.atomic_torch_save
    monkeypatch.setattr(checkpoint, "atomic_torch_save", lambda obj, path: atomic.append(Path(path).name) or real(obj, path))
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg), "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path / "plain")]) == 0
    assert atomic == ["last.ckpt"]
    atomic.clear()
    # ... but Lightning refuses a CheckpointIO on both the strategy and the plugins: ours stays out then.
    overlay = tmp_path / "strategy.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"strategy": {
        "class_path": "lightning.pytorch.strategies.SingleDeviceStrategy",
        "init_args": {"device": "cpu", "checkpoint_io": {"class_path": "lightning.pytorch.plugins.io.TorchCheckpointIO"}}}}}))
    assert cli_main(["fit", "--config", str(cfg), "--config", str(overlay), "--trainer.max_steps", "1"]) == 0
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    # nor beside one the recipe lists as a plugin
    overlay.write_text(yaml.safe_dump({"trainer": {"default_root_dir": str(tmp_path / "plugin"),
                                                   "plugins": [{"class_path": "lightning.pytorch.plugins.io.TorchCheckpointIO"}]}}))
    assert cli_main(["fit", "--config", str(cfg), "--config", str(overlay), "--trainer.max_steps", "1"]) == 0
    assert (tmp_path / "plugin" / "checkpoints" / "last.ckpt").is_file()
    assert atomic == []


def test_resume_with_a_logger_and_a_relative_run_directory(tmp_path, monkeypatch):
    """A recipe as users write it: the default TensorBoard logger on (Lightning would look for
    checkpoints in its new version directory) and a run directory relative to the working one."""
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config(tmp_path, logger=True)
    common = ["fit", "--config", str(cfg), "--trainer.default_root_dir", "run", "--checkpoint.keep_last", "1"]
    assert cli_main(common) == 0
    assert checkpoint_names(tmp_path / "run") == ["last.ckpt", "step00000002.ckpt"]
    assert cli_main([*common, "--trainer.max_steps", "5", "--trainer.max_epochs", "3", "--resume"]) == 0
    # Resumed (not restarted), last.ckpt refreshed in place (no last-v1.ckpt), keep_last pruned step 2.
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 5
    assert checkpoint_names(tmp_path / "run") == ["last.ckpt", "step00000004.ckpt"]


def test_resume_after_the_run_directory_moved(tmp_path):
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg), "--checkpoint.keep_last", "1"]) == 0
    (tmp_path / "run").rename(tmp_path / "moved")
    resume = ["fit", "--config", str(cfg), "--trainer.default_root_dir", str(tmp_path / "moved"), "--checkpoint.keep_last", "1"]
    assert cli_main([*resume, "--trainer.max_steps", "5", "--trainer.max_epochs", "3", "--resume"]) == 0
    # The recorded checkpoint paths follow the directory: step 2 (in the new place) is pruned.
    assert torch.load(tmp_path / "moved" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 5
    assert checkpoint_names(tmp_path / "moved") == ["last.ckpt", "step00000004.ckpt"]


def test_a_step_file_deleted_from_a_moved_run_no_longer_counts_towards_keep_last(tmp_path):
    cfg = tiny_config(tmp_path)
    keep = ["--checkpoint.keep_last", "2"]
    assert cli_main(["fit", "--config", str(cfg), *keep, "--trainer.max_steps", "4"]) == 0
    (tmp_path / "run").rename(tmp_path / "moved")
    (tmp_path / "moved" / "checkpoints" / "step00000004.ckpt").unlink()  # (last.ckpt holds step 4 too)
    resume = ["fit", "--config", str(cfg), "--trainer.default_root_dir", str(tmp_path / "moved"), *keep]
    assert cli_main([*resume, "--trainer.max_steps", "6", "--trainer.max_epochs", "2", "--resume"]) == 0
    # two files kept: step 2 and the new step 6 (the missing step 4 took no place of step 2's)
    assert checkpoint_names(tmp_path / "moved") == ["last.ckpt", "step00000002.ckpt", "step00000006.ckpt"]


def test_continuing_from_another_runs_checkpoint_leaves_this_directory_s_files_alone(tmp_path):
    """--ckpt_path of a checkpoint in another run's folder: that run's bookkeeping is not applied to
    this folder (whose files of the same names are not its own)."""
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg), "--checkpoint.keep_last", "1"]) == 0  # the other run: steps 2, 3
    other = tmp_path / "run" / "checkpoints" / "last.ckpt"
    mine = ["fit", "--config", str(cfg), "--trainer.default_root_dir", str(tmp_path / "mine"), "--checkpoint.keep_last", "1"]
    assert cli_main(mine) == 0  # this folder's own run
    before = (tmp_path / "mine" / "checkpoints" / "step00000002.ckpt").read_bytes()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cli_main([*mine, "--trainer.max_steps", "5", "--trainer.max_epochs", "3", "--ckpt_path", str(other)]) == 0
    assert not [w for w in seen if "dirpath has changed" in str(w.message)]  # (Lightning's, for bookkeeping it drops)
    assert torch.load(tmp_path / "mine" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 5
    assert checkpoint_names(tmp_path / "mine") == ["last.ckpt", "step00000002.ckpt", "step00000004.ckpt"]
    assert (tmp_path / "mine" / "checkpoints" / "step00000002.ckpt").read_bytes() == before
    assert checkpoint_names(tmp_path / "run") == ["last.ckpt", "step00000002.ckpt"]  # the other run untouched


def test_a_rerun_without_resume_does_not_overwrite_the_run(tmp_path, capsys, monkeypatch):
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg)]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "run" / "checkpoints").iterdir()}
    capsys.readouterr()
    assert cli_main(["fit", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "already holds a run's checkpoints (newest: last.ckpt): continue it with --resume" in err[-1]  # one line
    assert {p.name: p.read_bytes() for p in (tmp_path / "run" / "checkpoints").iterdir()} == before
    # a SLURM requeue file outside a SLURM job (a copied folder) does not lift the guard
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    shutil.copy(tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "run" / "hpc_ckpt_1.ckpt")
    assert cli_main(["fit", "--config", str(cfg)]) == 1
    assert "already holds a run's checkpoints" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "run" / "checkpoints").iterdir()} == before


def test_ckpt_path_auto_starts_a_run_then_resumes_it(tmp_path):
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg), "--ckpt_path", "auto"]) == 0  # nothing yet: a new run
    assert cli_main(["fit", "--config", str(cfg), "--trainer.max_steps", "5", "--trainer.max_epochs", "3", "--ckpt_path", "auto"]) == 0
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 5


def test_resume_takes_a_slurm_requeue_checkpoint_that_is_further_and_warns_of_nothing(tmp_path, capsys):
    """Lightning's requeue checkpoint (<default_root_dir>/hpc_ckpt_<n>.ckpt) counts for --resume
    when it is further than the run's own; a resumed run's checkpoint folder is expected to hold files."""
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg)]) == 0  # steps 2 and 3 (last.ckpt)
    run = tmp_path / "run"
    (run / "checkpoints" / "last.ckpt").rename(run / "hpc_ckpt_1.ckpt")  # step 3; step00000002.ckpt stays
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cli_main(["fit", "--config", str(cfg), "--trainer.max_steps", "4", "--resume"]) == 0
    assert f"resuming from {run / 'hpc_ckpt_1.ckpt'}" in capsys.readouterr().err
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    assert not [w for w in seen if "exists and is not empty" in str(w.message)]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--model.init_args.bogus", "1"], "Option 'bogus' is not accepted"),
        (["--model.init_args.out_dim", "abc"], "Expected a <class 'int'>"),
        (["--model.init_args.backbone", "vit_gigantic"], "unknown backbone 'vit_gigantic'; known backbones:"),
        (["--model", "ssl_vit.methods.NoSuchMethod"], "has no attribute 'NoSuchMethod'"),
        (["--model.init_args.backbone_kwargs.patch_size", "5"], "image size 16x16 is not divisible by the patch size 5"),
        (["--data.init_args.img_size", "18", "--data.init_args.views.init_args.global_size", "18"], "data.img_size 18 is not divisible by the backbone's patch size 4; set model backbone_kwargs img_size and patch_size"),
        (["--data.init_args.in_chans", "1"], "the data gives 1-channel images but the backbone was built with in_chans=3"),
        (["--data.init_args.views.init_args.local_size", "10"], "data.views MultiCrop makes 10x10 crops, which the backbone's patch size 4 does not divide"),
        (["--global_batch_size", "7", "--trainer.accumulate_grad_batches", "2"], "global_batch_size 7 is not divisible by devices x nodes x accumulate_grad_batches = 2"),
        (["--global_batch_size", "9", "--trainer.devices", "2", "--trainer.strategy", "ddp"], "global_batch_size 9 is not divisible by devices x nodes x accumulate_grad_batches = 2"),
        (["--global_batch_size", "0"], 'Parser key "global_batch_size": Not of type PositiveInt'),
        (["--trainer.max_step", "3"], "unrecognized arguments: --trainer.max_step"),
        (["--trainer.max_steps", "-1", "--trainer.max_epochs", "-1", "--trainer.max_time", "00:00:01:00"],
         "the schedules need the length of training: set trainer.max_steps or trainer.max_epochs"),
        (["--evaluate.protocols", "[linear]", "--evaluate.linear", "{epoch: 3}"], "Option 'epoch' is not accepted"),
        (["--evaluate.protocols", "[knn]", "--evaluate.linear", "{epochz: 3}"], "Option 'epochz' is not accepted"),
        (["--evaluate.protocols", "[knn]", "--evaluate.which", "momentum"], "evaluate.which: a DINO checkpoint has no momentum backbone (momentum_backbone.*); it holds student, teacher"),
        (["--evaluate.protocols", "[knn]", "--evaluate.features", "last4"], "evaluate.features: feature mode 'last4' reads the [CLS] of the last 4 blocks (DINO's linear protocol), but this backbone has 1; choose another mode (cls, avg, cls_avg)"),
        pytest.param(["--trainer.accelerator", "mps"], "`MPSAccelerator` can not run on your system",
                     marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")),
        (["--model.init_args.backbone_kwargs.embed_dim", "abc"], "backbone 'vit': embed_dim must be an integer, got 'abc'"),
        (["--model.init_args.backbone_kwargs.img_size", "8"], "the backbone was built for 8x8 images (model backbone_kwargs.img_size) but the data gives 16x16 crops"),
        (["--model", "Dino"], "(methods: MPP, MoCoV3, DINO, Supervised, or the dotted path of a BaseMethod of your own)"),
        (["--data", "FashionMnistDataModule"], "(datamodules: CIFAR10DataModule, CIFAR100DataModule, FashionMNISTDataModule, ImageFolderDataModule, ImageShardsDataModule, "
                                               "STL10DataModule, SyntheticDataModule, or the dotted path of a LightningDataModule of your own)"),
        (["--trainer.accumulate_grad_batches", "0"], 'Parser key "trainer.accumulate_grad_batches": Not of type PositiveInt: 0 does not conform'),
        (["--trainer.max_steps", "0"], "trainer.max_steps 0 trains nothing"),
        (["--resume", "--ckpt_path=x.ckpt"], "--resume and --ckpt_path both say where to continue from"),
        (["--model", "MPP", "--data.init_args.views", "SingleView", "--data.init_args.views.init_args.size", "16", "--model.init_args.corruption_ratio", "1.5"],
         "corruption ratio must be in (0, 1], got 1.5"),
        (["--data.init_args.views", "SingleView", "--data.init_args.views.init_args.size", "16"],
         "data.views SingleView: DINO needs at least 2 views with 2 global crops first, got 1; use MultiCrop"),
        (["--model", "MoCoV3", "--data.init_args.views", "SingleView", "--data.init_args.views.init_args.size", "16"],
         "data.views SingleView: MoCo v3 needs two views per image, got 1 (use TwoViews)"),
        (["--model", "Supervised", "--data.init_args.views", "SingleView", "--data.init_args.views.init_args.size", "16", "--data.init_args.num_classes", "1"],
         "the supervised baseline needs at least 2 classes; the data has 1"),
        (["--resume"], "--resume: no checkpoint to resume from in "),
        pytest.param(["--trainer.accelerator", "gpu"], "(the recipe's trainer asks for GPUs; on a machine without one add --config recipes/trainer/cpu.yaml)",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
        (["--trainer.enable_checkpointing", "false", "--evaluate.protocols", "[knn]"],
         "evaluate: the evaluations read the run's last checkpoint, which --trainer.enable_checkpointing false does not write"),
    ],
    ids=["unknown-key", "wrong-type", "unknown-backbone", "unknown-method", "patch-size", "data-size", "channels", "local-crop-size", "global-batch",
         "global-batch-over-devices", "global-batch-zero", "abbreviation",
         "no-length", "evaluate-argument", "evaluate-unused-argument", "evaluate-which", "evaluate-features", "missing-accelerator", "backbone-argument-type",
         "backbone-size", "method-name", "datamodule-name", "accumulate-zero", "no-steps", "resume-and-ckpt-path", "mpp-corruption",
         "dino-views", "mocov3-views", "supervised-one-class", "resume-without-checkpoints", "gpu-on-a-cpu-machine", "evaluate-without-checkpoints"],
)
def test_bad_recipes_fail_before_training_with_one_line(tmp_path, capsys, extra, message):
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg), *extra]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("ssl-vit fit: error: ") and message in err.strip().splitlines()[-1]
    assert "Traceback" not in err and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "extra,yaml_text,suggestion",
    [
        (["--trainer.max_step", "3"], None, "unrecognized arguments: --trainer.max_step 3 (did you mean '--trainer.max_steps'?)"),
        (["--checkpoint.every_n_step", "3"], None, "(did you mean '--checkpoint.every_n_train_steps'?)"),
        (["--global_batch", "8"], None, "(did you mean '--global_batch_size'?)"),
        (["--evaluat.knn", "{k: 3}"], None, "(did you mean '--evaluate.knn'?)"),
        (["--model.init_args.teacher_tmp", "0.04"], None, "Option 'teacher_tmp' is not accepted (did you mean 'teacher_temp'?)"),
        (["--data.init_args.batchsize", "4"], None, "Option 'batchsize' is not accepted (did you mean 'batch_size'?)"),
        (["--model", "Dino"], None, "(did you mean 'DINO'?) (methods:"),
        (["--model.init_args.backbone", "vit_smal"], None, "unknown backbone 'vit_smal' (did you mean 'vit_small'?); known backbones:"),
        (["--model.init_args.backbone_kwargs.embed_dims", "32"], None, "got unknown argument(s) ['embed_dims'] (did you mean 'embed_dim'?); it accepts:"),
        (["--evaluate.protocols", "[knn]", "--evaluate.knn", "{temprature: 0.1}"], None, "Option 'temprature' is not accepted (did you mean 'temperature'?)"),
        ([], "trainer:\n  max_epoch: 1\n", "Group 'trainer' does not accept option 'max_epoch' (did you mean 'trainer.max_epochs'?)"),
        ([], "evaluat:\n  knn: {k: 3}\n", "Option 'evaluat.knn.k' is not accepted (did you mean 'evaluate.knn'?)"),
        ([], "model:\n  init_args:\n    warmup_epoch: 1\n", "Option 'warmup_epoch' is not accepted (did you mean 'warmup_epochs'?)"),
        ([], "chekpoint:\n  keep_last: 1\n", "Option 'chekpoint.keep_last' is not accepted (did you mean 'checkpoint.keep_last'?)"),
        (["--data.init_args.views", "Twoviews"], None, "(did you mean 'TwoViews'?) (views: MultiCrop, SingleView, TwoViews, or the dotted path of a ViewTransform of your own)"),
        # keys at the wrong level: where they belong
        ([], "model:\n  class_path: ssl_vit.methods.DINO\n  warmup_epochs: 1\n",
         "typo.yaml: model.warmup_epochs sits beside class_path; a class's arguments go under init_args (model.init_args.warmup_epochs)"),
        ([], "trainer:\n  callbacks:\n  - {class_path: lightning.pytorch.callbacks.LearningRateMonitor, logging_interval: step}\n",
         "trainer.callbacks.0.logging_interval sits beside class_path; a class's arguments go under init_args (trainer.callbacks.0.init_args.logging_interval)"),
        (["--max_steps", "3"], None, "unrecognized arguments: --max_steps 3 (did you mean '--trainer.max_steps'?)"),
        ([], "max_steps: 3\n", "Option 'max_steps' is not accepted (did you mean 'trainer.max_steps'?)"),
        (["--model.init_args.img_size", "16"], None, "Option 'img_size' is not accepted (a backbone argument: model.init_args.backbone_kwargs.img_size)"),
        ([], "data:\n  init_args:\n    train_dir: images/\n",
         "Option 'train_dir' is not accepted (train_dir is an argument of ImageFolderDataModule and ImageShardsDataModule, not of SyntheticDataModule)"),
        ([], "data:\n  init_args:\n    views: {class_path: TwoViews, init_args: {size: 16, n_local_crops: 2}}\n",
         "Option 'n_local_crops' is not accepted (n_local_crops is an argument of MultiCrop, not of TwoViews)"),
    ],
    ids=["flag", "flag-group", "flag-top", "flag-rest", "method-option", "data-option", "method-name", "backbone-name", "backbone-argument",
         "evaluate-argument", "yaml-group", "yaml-top", "yaml-method-option", "yaml-top-group", "views-name", "beside-class-path",
         "beside-a-callbacks-class-path", "flag-trainer-key-at-the-top", "yaml-trainer-key-at-the-top", "backbone-argument-of-the-method",
         "argument-of-another-datamodule", "argument-of-other-views"],
)
def test_a_misspelt_or_misplaced_key_is_answered_with_where_it_belongs(tmp_path, capsys, extra, yaml_text, suggestion):
    cfg = tiny_config(tmp_path)
    configs = ["--config", str(cfg)]
    if yaml_text is not None:
        (tmp_path / "typo.yaml").write_text(yaml_text)
        configs += ["--config", str(tmp_path / "typo.yaml")]
    assert cli_main(["fit", *configs, *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ssl-vit fit: error: ") and suggestion in err[-1]


def test_a_suggestion_is_a_sibling_of_the_misspelt_key_alike_by_its_own_name():
    # recipe_checks.key_hint: the part that names nothing is compared with its siblings' names,
    # not the whole dotted paths (their shared group alone made `evaluate.max_epochs` look like
    # `evaluate.protocols`), and never with another group's keys.
    from ssl_vit.cli.recipe_checks import key_hint

    keys = ["trainer.max_epochs", "trainer.max_steps", "evaluate.protocols", "evaluate.seed", "evaluate.knn", "model.class_path"]
    assert key_hint("unrecognized arguments: --evaluate.max_epochs 3", keys) == ""
    assert key_hint("unrecognized arguments: --evaluate.max_steps 3", keys) == ""
    assert key_hint("unrecognized arguments: --model.max_epochs", keys) == ""
    assert key_hint("unrecognized arguments: --trainer.max_step 3", keys) == " (did you mean '--trainer.max_steps'?)"
    assert key_hint("unrecognized arguments: --evaluat.knn.k 3", keys) == " (did you mean '--evaluate.knn'?)"
    assert key_hint("Group 'trainer' does not accept option 'max_epoch'", keys) == " (did you mean 'trainer.max_epochs'?)"


@pytest.mark.parametrize("extra", [["--model.init_args.bogus", "1"], ["--trainer.zzz", "1"], ["--data.init_args.batch_size", "4", "--model.init_args.qqq", "2"]])
def test_a_key_like_no_other_gets_no_suggestion_and_a_found_class_no_class_list(tmp_path, capsys, extra):
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg), *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("ssl-vit fit: error: ") and "did you mean" not in err
    assert "(methods:" not in err and "(datamodules:" not in err  # the class was found: its name is not the problem


def test_crops_smaller_than_the_backbone_are_a_note_and_a_resnet_takes_any_size(tmp_path, capsys):
    cfg = tiny_config(tmp_path, method="ssl_vit.methods.Supervised", views="ssl_vit.data.SingleView")
    assert cli_main(["fit", "--config", str(cfg), "--data.init_args.img_size", "8", "--data.init_args.views.init_args.size", "8", "--trainer.max_steps", "1"]) == 0
    assert "note: the backbone was built for 16x16 images (model backbone_kwargs.img_size) but the data gives 8x8 crops" in capsys.readouterr().err
    (tmp_path / "resnet").mkdir()
    cfg = tiny_config(tmp_path / "resnet", method="ssl_vit.methods.Supervised", views="ssl_vit.data.SingleView")
    resnet = ["--model.init_args.backbone", "resnet18", "--model.init_args.backbone_kwargs", "{in_chans: 3, small_input: true}"]
    assert cli_main(["fit", "--config", str(cfg), *resnet, "--trainer.max_steps", "1"]) == 0  # (its img_size is nominal)
    assert "note:" not in capsys.readouterr().err


def test_a_batch_limit_of_1_is_one_batch(tmp_path):
    # Lightning's Union[float, int] annotation made the parser read 1 as the fraction 1.0 (all).
    cfg = tiny_config(tmp_path)  # 32 images in batches of 8: 4 per epoch
    assert cli_main(["fit", "--config", str(cfg), "--trainer.max_steps", "-1", "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "1"]) == 0
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["ssl_vit"]["global_step"] == 2


@pytest.mark.parametrize("text, flag, what", [
    ("", "--config", "is empty; a recipe is a mapping of settings"),
    ("- a\n- b\n", "--config", "holds a list; a recipe is a mapping of settings"),
    ("just a string\n", "--config", "holds a str; a recipe is a mapping of settings"),
    ("model:\n  class_path: DINO\n  init_args: {backbone: vit\n", "--config", "not valid YAML (line 4, column 1)"),
    ("model: {a: 1\n", "--config=", "not valid YAML (line 2, column 1)"),
    ("model: {a: 1\n", "-c", "not valid YAML (line 2, column 1)"),
])
def test_a_recipe_file_that_is_no_yaml_mapping_is_one_line_naming_it(tmp_path, capsys, text, flag, what):
    odd = tmp_path / "odd.yaml"
    odd.write_text(text)
    named = [f"--config={odd}"] if flag == "--config=" else [flag, str(odd)]
    assert cli_main(["fit", "--config", str(tiny_config(tmp_path)), *named]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{odd}: {what}" in err[0]


def test_overfit_batches_runs(tmp_path, caplog):
    # Lightning rebuilds the training loader with a SequentialSampler to stop shuffling.
    with caplog.at_level(logging.INFO):
        assert cli_main(["fit", "--config", str(tiny_config(tmp_path)), "--trainer.overfit_batches", "2"]) == 0
    assert "2 optimiser steps (2 per epoch)" in caplog.text


def test_a_later_config_that_replaces_a_dict_setting_says_what_it_drops(tmp_path, capsys):
    # jsonargparse merges namespaces but replaces a dict-valued argument whole.
    cfg = tiny_config(tmp_path)
    overlay = tmp_path / "drop_path.yaml"
    overlay.write_text(yaml.safe_dump({"model": {"init_args": {"backbone_kwargs": {"drop_path_rate": 0.1}}}}))
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(cfg), "--config", str(overlay), "--print_config"])
    err = capsys.readouterr().err
    assert f"{overlay} sets model.init_args.backbone_kwargs again and replaces the whole value from {cfg}" in err
    assert "depth, embed_dim, img_size, in_chans, num_heads, patch_size no longer set" in err
    assert "--model.init_args.backbone_kwargs.depth VALUE" in err
    # each file against the one before it: a third file's drop is said too
    third = tmp_path / "depth.yaml"
    third.write_text(yaml.safe_dump({"model": {"init_args": {"backbone_kwargs": {"depth": 2}}}}))
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(cfg), "--config", str(overlay), "--config", str(third), "--print_config"])
    assert f"{third} sets model.init_args.backbone_kwargs again and replaces the whole value from {overlay}: drop_path_rate no longer set" in capsys.readouterr().err
    # a protocol's settings are a class's arguments, merged key by key: no note, nothing dropped
    (tmp_path / "knn.yaml").write_text(yaml.safe_dump({"evaluate": {"protocols": ["knn"], "knn": {"k": 3, "temperature": 0.1}}}))
    (tmp_path / "k5.yaml").write_text(yaml.safe_dump({"evaluate": {"knn": {"k": 5}}}))
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(cfg), "--config", str(tmp_path / "knn.yaml"), "--config", str(tmp_path / "k5.yaml"), "--print_config"])
    out, err = capsys.readouterr()
    knn = yaml.safe_load(out)["evaluate"]["knn"]
    assert (knn["k"], knn["temperature"]) == (5, 0.1) and "note" not in err


def test_print_config_resolves_the_recipe(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    # a later file may give a class's arguments without init_args: they go to the class named before
    (tmp_path / "later.yaml").write_text("model:\n  warmup_epochs: 2\n")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["fit", "--config", str(cfg), "--config", str(tmp_path / "later.yaml"), "--print_config"])
    assert exit_.value.code == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["model"]["class_path"] == "ssl_vit.methods.DINO" and out["model"]["init_args"]["warmup_epochs"] == 2
    assert out["model"]["init_args"]["teacher_temp"] == 0.07  # defaults appear resolved


def test_recipes_may_name_classes_by_their_short_names(tmp_path):
    # In a fresh process (this one has every module imported already): "DINO",
    # "SyntheticDataModule", "MultiCrop" resolve like their full class paths.
    cfg = tiny_config(tmp_path)
    text = cfg.read_text().replace("ssl_vit.methods.DINO", "DINO").replace("ssl_vit.data.", "")
    assert "ssl_vit.data" not in text
    cfg.write_text(text)
    code = "import sys; from ssl_vit.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "fit", "--config", str(cfg), "--print_config"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["data"]["class_path"] == "ssl_vit.data.SyntheticDataModule"
    assert resolved["data"]["init_args"]["views"]["class_path"] == "ssl_vit.data.MultiCrop"


def test_global_batch_size_sets_the_per_device_batch(tmp_path, caplog):
    cfg = tiny_config(tmp_path, max_steps=1)
    with caplog.at_level(logging.INFO):
        assert cli_main(["fit", "--config", str(cfg), "--global_batch_size", "16", "--trainer.accumulate_grad_batches", "2"]) == 0
    assert "effective batch size 16 = 8 per device x 1 device(s) x 2 accumulation" in caplog.text
    assert "MoCo v3 with accumulate_grad_batches" not in caplog.text
    assert "warm-up" not in caplog.text  # warmup_epochs 0
    caplog.clear()
    with caplog.at_level(logging.INFO):  # 1 step of 4 per epoch: half an epoch of warm-up covers it
        assert cli_main(["fit", "--config", str(cfg), "--model.init_args.warmup_epochs", "0.5", "--trainer.default_root_dir", str(tmp_path / "w")]) == 0
    assert ("the LR warm-up, warmup_epochs 0.5 = 2 steps, is longer than the run of 1 steps and is cut to it: its LR rises to "
            "the peak at the last step and the cosine never starts (set a shorter warm-up)") in caplog.text
    caplog.clear()
    cfg = tiny_config(tmp_path, method="ssl_vit.methods.MoCoV3", views="ssl_vit.data.TwoViews", max_steps=1, default_root_dir=str(tmp_path / "moco"))
    with caplog.at_level(logging.INFO):
        assert cli_main(["fit", "--config", str(cfg), "--global_batch_size", "16", "--trainer.accumulate_grad_batches", "2"]) == 0
    assert "MoCo v3 with accumulate_grad_batches=2: each query is contrasted with the keys of its micro-batch" in caplog.text



def test_continuing_another_method_or_backbone_is_one_line(tmp_path, capsys):
    cfg = tiny_config(tmp_path, max_steps=2)
    assert cli_main(["fit", "--config", str(cfg)]) == 0
    last = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    (tmp_path / "other").mkdir()
    other = tiny_config(tmp_path / "other", method="ssl_vit.methods.MoCoV3", views="ssl_vit.data.TwoViews")
    assert cli_main(["fit", "--config", str(other), "--ckpt_path", last]) == 1
    assert f"--ckpt_path {last} is a DINO checkpoint; this recipe trains MoCoV3" in capsys.readouterr().err
    assert cli_main(["fit", "--config", str(cfg), "--resume", "--model.init_args.backbone_kwargs.embed_dim", "64"]) == 1
    assert "was trained with other backbone arguments (embed_dim: 32 there, 64 here)" in capsys.readouterr().err
    # drop path is no shape: a run may continue with another rate
    assert cli_main(["fit", "--config", str(cfg), "--resume", "--trainer.max_steps", "3", "--model.init_args.backbone_kwargs.drop_path_rate", "0.1"]) == 0
    assert cli_main(["fit", "--config", str(cfg), "--ckpt_path", str(tmp_path / "nope.ckpt")]) == 1
    assert "nope.ckpt: no such file" in capsys.readouterr().err
    (tmp_path / "bad.ckpt").write_text("not a checkpoint")
    assert cli_main(["fit", "--config", str(cfg), "--ckpt_path", str(tmp_path / "bad.ckpt")]) == 1
    assert "bad.ckpt: not a readable checkpoint" in capsys.readouterr().err


def test_a_method_of_ones_own_trains_resumes_and_has_its_flops_counted(tmp_path):
    cfg = tiny_config(tmp_path, method="helpers.Reconstruct", views="ssl_vit.data.SingleView")
    assert cli_main(["fit", "--config", str(cfg), "--trainer.max_steps", "2"]) == 0
    assert cli_main(["fit", "--config", str(cfg), "--resume"]) == 0
    at_2 = torch.load(tmp_path / "run" / "checkpoints" / "step00000002.ckpt", weights_only=False)["ssl_vit"]
    meta = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["ssl_vit"]
    assert meta["method"] == "Reconstruct" and meta["global_step"] == 3
    assert at_2["pretrain_flops"] > 0 and meta["pretrain_flops"] == pytest.approx(1.5 * at_2["pretrain_flops"])  # measured, whatever the method


def test_evaluation_settings_the_data_cannot_meet_are_refused_before_training(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    args = ["fit", "--config", str(cfg), "--evaluate.train_subset", "16"]
    assert cli_main([*args, "--evaluate.protocols", "[knn]", "--evaluate.knn", "{k: 20}"]) == 1
    assert ("evaluate.knn: k=20 neighbours, but the kNN bank holds 16 training examples (of evaluate.train_subset); set evaluate.knn {k: 16} "
            "or fewer, or a larger evaluate.train_subset") in capsys.readouterr().err
    # a k sweep holds out a tenth (2 of 16) to pick k: k=15 is then one too many
    assert cli_main([*args, "--evaluate.protocols", "[knn]", "--evaluate.knn", "{k: [5, 15]}"]) == 1
    assert ("evaluate.knn: k=15 neighbours, but the k sweep holds out 2 of the 16 training examples (select_fraction 0.1) "
            "and leaves 14 to vote (of evaluate.train_subset); sweep smaller k, or a larger evaluate.train_subset") in capsys.readouterr().err
    assert cli_main([*args, "--evaluate.protocols", "[fewshot]"]) == 1  # 25-shot (the default's largest) of 10 classes
    assert "evaluate.fewshot: 25-shot needs 25 training images of each of the 10 classes, more than the 16" in capsys.readouterr().err
    assert cli_main(["fit", "--config", str(cfg), "--data.init_args.num_test_samples", "0", "--evaluate.protocols", "[knn]"]) == 1
    assert ("evaluate: SyntheticDataModule has no labelled test split to evaluate on; "
            "set evaluate.protocols: [] to pretrain without evaluating") in capsys.readouterr().err
    # a datamodule of one's own that forgot num_classes: named as the cause, not as a missing split
    (tmp_path / "uncounted.py").write_text("from ssl_vit.data import SyntheticDataModule\n\n\nclass Uncounted(SyntheticDataModule):\n"
                                           "    def __init__(self, **kwargs):\n        super().__init__(**kwargs)\n        self.num_classes = None\n")
    recipe = yaml.safe_load(cfg.read_text())
    recipe["data"]["class_path"] = "uncounted.Uncounted"
    cfg.write_text(yaml.safe_dump(recipe))
    sys.path.insert(0, str(tmp_path))
    try:
        assert cli_main(["fit", "--config", str(cfg), "--evaluate.protocols", "[knn]"]) == 1
    finally:
        sys.path.remove(str(tmp_path))
    assert "evaluate: Uncounted does not say how many classes its labels have (num_classes is unset)" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


def test_an_evaluation_that_fails_after_training_says_how_to_evaluate_the_kept_backbone(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg), "--evaluate.protocols", "[knn]", "--evaluate.knn", "{k: 40}"]) == 1  # 32 images
    err = capsys.readouterr().err
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert f"evaluate: knn: k=40 neighbours, but the kNN bank holds 32 training examples (the trained backbone is kept in {last}" in err
    assert "--resume" in err
    assert cli_main(["fit", "--config", str(cfg), "--resume", "--evaluate.protocols", "[knn]", "--evaluate.knn", "{k: 3}",
                     "--evaluate.out", str(tmp_path / "records"), "--evaluate.test_subset", "4"]) == 0
    assert "knn       dino  vit-D32-L1-H2/4  synthetic" in capsys.readouterr().out
    assert torch.load(last, weights_only=False)["ssl_vit"]["global_step"] == 3  # evaluated, not trained further
    (record,) = (tmp_path / "records").glob("*.json")  # evaluate.out, not <run>/results
    assert json.loads(record.read_text())["data"]["test_size"] == 4 and not (tmp_path / "run" / "results").exists()


def test_a_recipe_evaluates_its_final_backbone(tmp_path, capsys):
    # The `evaluate` section: after the fit, the records `ssl-vit eval` would write.
    cfg = tiny_config(tmp_path)
    args = ["fit", "--config", str(cfg), "--evaluate.protocols", "[knn, fewshot]", "--evaluate.knn", "{k: 3}",
            "--evaluate.fewshot", "{shots: [1, 2], num_seeds: 2}"]
    assert cli_main(args) == 0
    assert "knn       dino  vit-D32-L1-H2/4  synthetic" in capsys.readouterr().out
    records = {p.name: json.loads(p.read_text()) for p in (tmp_path / "run" / "results").glob("*.json")}
    assert set(records) == {"dino_vit-D32-L1-H2-4_synthetic_knn.json", "dino_vit-D32-L1-H2-4_synthetic_fewshot.json"}
    knn = records["dino_vit-D32-L1-H2-4_synthetic_knn.json"]
    assert knn["protocol_args"]["k"] == 3 and knn["pretrain"]["steps"] == 3 and knn["pretrain"]["flops"] > 0
    assert knn["pretrain"]["data"] == "synthetic"  # what it was pretrained on, named as evaluation data
    assert knn["source"].endswith("last.ckpt") and knn["data"]["test_size"] == 8
    # without the section nothing is evaluated
    (tmp_path / "plain").mkdir()
    assert cli_main(["fit", "--config", str(tiny_config(tmp_path / "plain"))]) == 0
    assert not (tmp_path / "plain" / "run" / "results").exists()


def test_a_finished_run_resumed_to_fine_tune_starts_the_fine_tuning_it_never_began(tmp_path, capsys):
    # pretrained without an evaluation, then --resume with one: the fine-tuning has no checkpoint
    # to continue, so it starts (not "resume a run that is not there")
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg)]) == 0
    assert cli_main(["fit", "--config", str(cfg), "--resume", "--evaluate.protocols", "[finetune]",
                     "--evaluate.finetune", "{epochs: 1, batch_size: 16}"]) == 0
    assert "finetune  dino  vit-D32-L1-H2/4  synthetic" in capsys.readouterr().out
    assert torch.load(tmp_path / "run" / "finetune" / "checkpoints" / "last.ckpt", weights_only=False)["ssl_vit"]["global_step"] == 2


def test_a_recipe_fine_tunes_and_probes_its_final_backbone_on_images_and_resumes_them(tmp_path, capsys, monkeypatch):
    # protocols: [finetune, linear_aug]: every weight trained with a new classifier, and the papers'
    # linear probe on augmented images, after the pretraining, on the run's processes, each
    # checkpointed into <default_root_dir>/<protocol>; then the frozen-feature protocols.
    cfg = tiny_config(tmp_path)
    args = ["fit", "--config", str(cfg), "--evaluate.protocols", "[finetune, linear_aug, knn]", "--evaluate.knn", "{k: 3}",
            "--evaluate.finetune", "{epochs: 2, batch_size: 8, warmup_epochs: 0.5, layer_decay: 0.75, checkpoint_every: 2}",
            "--evaluate.linear_aug", "{epochs: 1, batch_size: 16, optimizer: lars, crop_scale: [0.6, 1.0]}", "--evaluate.features", "avg"]
    from ssl_vit.eval.evaluate import Evaluation

    scales, splits = [], Evaluation._splits
    monkeypatch.setattr(Evaluation, "_splits", lambda self, dm, views=None, **kw: scales.append(getattr(views, "scale", None)) or splits(self, dm, views, **kw))
    assert cli_main(args) == 0
    # each image protocol trains on its own augmented crops (fine-tuning MAE's default scale, the
    # probe the recipe's); the frozen protocols read the evaluation images
    assert [tuple(s) if s is not None else None for s in scales] == [(0.5, 1.0), (0.6, 1.0), None]
    out = capsys.readouterr().out
    assert "finetune  dino  vit-D32-L1-H2/4  synthetic" in out and "knn       dino  vit-D32-L1-H2/4 [avg]  synthetic" in out
    assert "linear_aug dino  vit-D32-L1-H2/4 [avg]  synthetic" in out
    records = {p.name: json.loads(p.read_text()) for p in (tmp_path / "run" / "results").glob("*.json")}
    assert set(records) == {"dino_vit-D32-L1-H2-4_synthetic_finetune.json", "dino_vit-D32-L1-H2-4_synthetic_linear_aug-avg.json", "dino_vit-D32-L1-H2-4_synthetic_knn-avg.json"}
    probe = records["dino_vit-D32-L1-H2-4_synthetic_linear_aug-avg.json"]
    assert {k: probe["protocol_args"][k] for k in ("epochs", "base_lr", "optimizer", "batch_size", "crop_scale", "features", "devices")} == {
        "epochs": 1, "base_lr": 0.1, "optimizer": "lars", "batch_size": 16, "crop_scale": [0.6, 1.0], "features": "avg", "devices": 1}
    assert torch.load(tmp_path / "run" / "linear_aug" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    ft = records["dino_vit-D32-L1-H2-4_synthetic_finetune.json"]
    assert ft["protocol"] == "finetune" and ft["pretrain"]["steps"] == 3 and ft["source"].endswith("last.ckpt")
    assert {k: ft["protocol_args"][k] for k in ("epochs", "base_lr", "layer_decay", "batch_size", "devices", "precision", "crop_scale")} == {
        "epochs": 2, "base_lr": 5e-4, "layer_decay": 0.75, "batch_size": 8, "devices": 1, "precision": "32-true", "crop_scale": [0.5, 1.0]}
    assert ft["data"] == {"name": "synthetic", "train_size": 32, "test_size": 8} and 0 <= ft["metrics"]["top1"] <= 1
    # The fine-tuning's own checkpoint (32 images at batch 8: 4 steps an epoch) says what it holds.
    tuned = torch.load(tmp_path / "run" / "finetune" / "checkpoints" / "last.ckpt", weights_only=False)
    assert tuned["ssl_vit"]["method"] == "dino+finetune" and tuned["ssl_vit"]["global_step"] == 8
    # --resume on the finished run: nothing trains again, the records are rewritten in place.
    assert cli_main([*args, "--resume"]) == 0
    assert torch.load(tmp_path / "run" / "finetune" / "checkpoints" / "last.ckpt", weights_only=False)["ssl_vit"]["global_step"] == 8
    again = json.loads((tmp_path / "run" / "results" / "dino_vit-D32-L1-H2-4_synthetic_finetune.json").read_text())
    assert again["metrics"] == ft["metrics"] and len(list((tmp_path / "run" / "results").glob("*.json"))) == 3


def test_a_new_run_beside_an_earlier_fine_tuning_and_bad_settings_of_image_protocols_stop_before_training(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    args = ["fit", "--config", str(cfg), "--evaluate.protocols", "[finetune]"]
    assert cli_main([*args, "--evaluate.finetune", "{epoch: 2}"]) == 1
    assert "evaluate.finetune" in (err := capsys.readouterr().err) and "Option 'epoch' is not accepted (did you mean 'epochs'?)" in err
    assert cli_main(["fit", "--config", str(cfg), "--evaluate.protocols", "[linear_aug, knn]", "--evaluate.linear_aug", "{features: last4}"]) == 1
    assert "evaluate.linear_aug.features: feature mode 'last4' reads the [CLS] of the last 4 blocks" in capsys.readouterr().err
    assert cli_main(["fit", "--config", str(cfg), "--evaluate.protocols", "[linear_aug]", "--evaluate.linear_aug", "{optimizer: adam}"]) == 1
    assert "evaluate.linear_aug" in (err := capsys.readouterr().err) and "Expected a typing.Literal['sgd', 'lars']. Got value: adam" in err
    held = tmp_path / "run" / "finetune" / "checkpoints"
    held.mkdir(parents=True)
    torch.save({"state_dict": {}}, held / "last.ckpt")
    assert cli_main(args) == 1
    assert f"evaluate.finetune: {held} already holds the finetune run of an earlier pretraining (last.ckpt)" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


def test_a_slurm_requeued_run_counts_as_resuming_for_its_evaluation_folders(tmp_path, capsys, monkeypatch):
    # cli/fit.py: a job Lightning requeued resumes from <default_root_dir>/hpc_ckpt_<n>.ckpt
    # by itself, without --resume; its recipe's evaluation folders are then its own runs, not an
    # earlier pretraining's (check_run_dirs is told it resumes). The check stops the run here.
    from ssl_vit.eval.evaluate import Evaluation

    told = []

    def stop_at_the_check(self, root, resuming):
        told.append(resuming)
        raise ValueError("stopped at the check")

    monkeypatch.setattr(Evaluation, "check_run_dirs", stop_at_the_check)
    args = ["fit", "--config", str(tiny_config(tmp_path)), "--evaluate.protocols", "[finetune]"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "hpc_ckpt_1.ckpt").write_bytes(b"")
    assert cli_main(args) == 1  # outside SLURM a requeue checkpoint is not this job's
    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "pretrain", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
                       "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(key, value)
    assert cli_main(args) == 1
    (tmp_path / "run" / "hpc_ckpt_1.ckpt").unlink()
    assert cli_main(args) == 1  # a SLURM job without one starts anew
    assert told == [False, True, False]
    assert capsys.readouterr().err.count("stopped at the check") == 3


def test_a_signal_during_the_recipes_fine_tuning_says_how_to_continue(tmp_path, capsys, monkeypatch):
    import signal

    from ssl_vit.eval.finetune import FineTuneSettings
    from ssl_vit.eval.train_run import EvalRunInterrupted

    def stopped(*args, **kwargs):
        raise EvalRunInterrupted("fine-tuning", "SIGTERM", 5, tmp_path / "run" / "finetune" / "checkpoints" / "last.ckpt")

    monkeypatch.setattr(FineTuneSettings, "run", stopped)
    cfg = tiny_config(tmp_path)
    assert cli_main(["fit", "--config", str(cfg), "--evaluate.protocols", "[finetune, knn]", "--evaluate.knn", "{k: 3}"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "the pretraining is done; evaluate's fine-tuning stopped by SIGTERM at step 5" in err and "continue with --resume" in err
    assert not (tmp_path / "run" / "results").exists()  # the frozen protocols did not run either


def test_resuming_with_another_batch_size_says_so(tmp_path, caplog):
    cfg = tiny_config(tmp_path, max_steps=2)
    assert cli_main(["fit", "--config", str(cfg)]) == 0
    with caplog.at_level(logging.INFO):
        assert cli_main(["fit", "--config", str(cfg), "--resume", "--trainer.max_steps", "3", "--global_batch_size", "4"]) == 0
    assert "resumed a run trained at an effective batch size of 8 with 4: from step 2 on" in caplog.text
    assert "resumed a run planned for 2 optimiser steps as one of 3: from step 2 on, the LR, weight-decay and momentum" in caplog.text
    # The epochs trained, as records report them: 2 x 8 + 1 x 4 of the 32 images, not 3 steps of
    # the 8 a 4-image batch takes per epoch (0.375).
    from ssl_vit.export.load import load_any_backbone

    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    meta = torch.load(ckpt, weights_only=False)["ssl_vit"]
    assert meta["epochs"] == 0.625
    assert "max_steps: 3" in meta["recipe"] and "global_batch_size: 4" in meta["recipe"]  # this invocation's recipe
    assert load_any_backbone(ckpt)[1]["pretrain"]["epochs"] == 0.625


# ----------------------------------------------------------------------------- shipped recipes


def _overrides(recipe: Path, tmp_path: Path) -> list[str]:
    """Shrink a shipped recipe to one CPU step on synthetic data, keeping its method and views."""
    cfg = yaml.safe_load(recipe.read_text())
    method = cfg["model"]["class_path"]
    views = cfg["data"]["init_args"]["views"]["class_path"]
    args = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1", "--trainer.strategy", "auto", "--trainer.precision", "32-true",
            "--trainer.max_steps", "1", "--trainer.max_epochs", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(tmp_path / "run"), "--global_batch_size", "4",
            "--model.init_args.backbone", "vit", "--model.init_args.backbone_kwargs", yaml.safe_dump({**cfg["model"]["init_args"].get("backbone_kwargs", {}), **TINY_BACKBONE, "in_chans": cfg["data"]["init_args"].get("in_chans", 3)}, default_flow_style=True).strip()]
    for key, value in SMALL_HEADS[method].items():
        args += [f"--model.init_args.{key}", str(value)]
    args += ["--data", "ssl_vit.data.SyntheticDataModule", "--data.init_args.num_samples", "8", "--data.init_args.num_test_samples", "4", "--data.init_args.img_size", "16",
             "--data.init_args.num_workers", "0", "--data.init_args.in_chans", str(cfg["data"]["init_args"].get("in_chans", 3)),
             "--data.init_args.views", views]
    for key, value in VIEW_SIZE_KEYS[views].items():
        args += [f"--data.init_args.views.init_args.{key}", str(value)]
    if "evaluate" in cfg:  # the recipe's evaluation too, sized for 8 images
        args += ["--evaluate.knn", "{k: 3}", "--evaluate.linear", "{epochs: 2}", "--evaluate.fewshot", "{shots: [1], num_seeds: 1}"]
        for protocol in ("finetune", "linear_aug"):  # the recipe's settings, one step
            settings = {**(cfg["evaluate"].get(protocol) or {}), "epochs": 1, "batch_size": 4, "max_steps": 1}
            if settings.get("features") == "last4":
                settings["features"] = "cls"  # (the tiny backbone has 2 blocks)
            args += [f"--evaluate.{protocol}", yaml.safe_dump(settings, default_flow_style=True).strip()]
    return args


def test_every_recipe_is_shipped_and_parsed():
    names = {p.relative_to(p.parents[1]).as_posix() for p in METHOD_RECIPES}
    assert {"imagenet/dino_vit_small16.yaml", "imagenet/mocov3_vit_small16.yaml", "imagenet/mocov3_vit_base16.yaml",
            "imagenet/mpp_vit_base16.yaml", "imagenet/supervised_vit_base16.yaml"} <= names
    assert {f"fashion_mnist/{m}.yaml" for m in ("mpp", "mocov3", "dino", "supervised")} <= names


@pytest.mark.parametrize("recipe", METHOD_RECIPES, ids=[p.stem if p.parent.name == "imagenet" else f"fmnist-{p.stem}" for p in METHOD_RECIPES])
def test_shipped_recipe_runs_one_step_with_a_tiny_override(recipe, tmp_path):
    assert cli_main(["fit", "--config", str(recipe), *_overrides(recipe, tmp_path)]) == 0


@pytest.mark.parametrize("override", COMPUTE_RECIPES, ids=[p.stem for p in COMPUTE_RECIPES])
def test_equal_compute_backbones_train_from_the_supervised_recipe_at_the_flops_they_state(override, tmp_path):
    """Each backbone swap of ``recipes/fashion_mnist/compute`` merges after the supervised recipe
    and trains a step of it on 28-px grey images, and the training GFLOPs per image its comment
    states (what picks the equal-compute pairs) are ``ssl-vit backbones``'s for that backbone."""
    from ssl_vit.cli.backbones import backbone_size

    cfg = yaml.safe_load(override.read_text())["model"]["init_args"]
    stated = re.search(r"([0-9.]+) GFLOPs per image for a training pass at 28 px", override.read_text())
    assert stated, f"{override.name} states no training GFLOPs"
    assert backbone_size(cfg["backbone"], 28, cfg["backbone_kwargs"]).train_flops / 1e9 == pytest.approx(float(stated.group(1)), abs=0.005)
    root = Path(__file__).resolve().parents[1]
    assert cli_main(["fit", "--config", str(root / "recipes/fashion_mnist/supervised.yaml"), "--config", str(override),
                     "--trainer.accelerator", "cpu", "--trainer.max_steps", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                     "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(tmp_path / "run"),
                     "--data", "ssl_vit.data.SyntheticDataModule", "--data.init_args.num_samples", "8", "--data.init_args.num_test_samples", "4",
                     "--data.init_args.img_size", "28", "--data.init_args.in_chans", "1", "--data.init_args.batch_size", "4", "--data.init_args.num_workers", "0",
                     "--data.init_args.views", "ssl_vit.data.SingleView", "--evaluate.protocols", "[knn]", "--evaluate.knn", "{k: 3}"]) == 0
    record = json.loads(next((tmp_path / "run" / "results").glob("*.json")).read_text())
    assert record["backbone"]["name"] == cfg["backbone"] and record["backbone"]["kwargs"] == {**cfg["backbone_kwargs"]}
    assert record["pretrain"]["flops"] > 0


class RememberTrainer(L.Callback):
    """Keeps a weak reference to each trainer it is set up with (a recipe callback of the test below)."""

    seen: list[weakref.ref] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        RememberTrainer.seen.append(weakref.ref(trainer))


def test_a_finished_fit_leaves_no_trainer_behind(tmp_path):
    # LightningCLI keeps itself (with the trainer and model) in a context variable; `ssl-vit fit`
    # runs in a copied context so that a process fitting several times holds none of the earlier
    # runs once each returns.
    RememberTrainer.seen.clear()
    cfg = tiny_config(tmp_path, callbacks=[{"class_path": "test_training_cli.RememberTrainer"}])
    assert cli_main(["fit", "--config", str(cfg)]) == 0
    assert len(RememberTrainer.seen) == 1
    gc.collect()  # (a trainer and its parts are reference cycles)
    assert RememberTrainer.seen[0]() is None


def test_the_evaluate_sections_checks_read_the_smaller_subset_and_its_own_settings(capsys):
    from types import SimpleNamespace

    from ssl_vit.backbones import create_backbone
    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.fewshot import FewShotEvaluator
    from ssl_vit.eval.knn import KNNClassifier
    from ssl_vit.eval.linear import LinearProbe

    def data(subset):
        return SimpleNamespace(has_labelled_test_split=lambda: True, num_classes=10, subset=subset)

    # the run trained on 16 images: the bank holds 16 whatever train_subset says
    with pytest.raises(ValueError, match=r"the kNN bank holds 16 training examples \(of data.subset\); set evaluate.knn {k: 16} or fewer, or a larger data.subset"):
        Evaluation(protocols=["knn"], knn=KNNClassifier(k=20), train_subset=100).check_data(data(16))
    Evaluation(protocols=["fewshot"], fewshot=FewShotEvaluator(shots=[2]), train_subset=20).check_data(data(None))  # 2 x 10 = 20: enough
    with pytest.raises(ValueError, match=r"more than the 5 \(of evaluate.train_subset\); a larger evaluate.train_subset$"):  # not "at most 0 shots"
        Evaluation(protocols=["fewshot"], fewshot=FewShotEvaluator(shots=[1]), train_subset=5).check_data(data(None))
    # a protocol's own seed wins over the section's, which seeds the others (the few-shot draws too)
    assert Evaluation(linear=LinearProbe(seed=5), seed=1).settings["linear"].seed == 5
    assert Evaluation(seed=1).settings["knn"].seed == 1 and Evaluation(seed=1).settings["fewshot"].seed == 1
    # a datamodule with a test split but no class count (its API used directly, past check_data)
    unlabelled = SimpleNamespace(eval_datasets=lambda train_views=None: ([0], [0]), num_classes=None)
    with pytest.raises(ValueError, match="no labelled test split to evaluate on"):
        Evaluation(protocols=["knn"])._splits(unlabelled)
    # settings of a protocol not run: a note; of one that runs: none
    Evaluation(protocols=["knn"], linear=LinearProbe(epochs=3))
    assert "evaluate has settings for linear, which evaluate.protocols (knn) does not run" in capsys.readouterr().err
    Evaluation(protocols=["linear"], linear=LinearProbe(epochs=3))
    assert "note" not in capsys.readouterr().err
    # fine-tuning alone reads no frozen features: a one-block backbone with features last4 is fine
    model = SimpleNamespace(backbone=create_backbone("vit", img_size=8, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2))
    Evaluation(protocols=["finetune"], features="last4").check_model(model)
    with pytest.raises(ValueError, match="evaluate.features: feature mode 'last4'"):
        Evaluation(protocols=["knn"], features="last4").check_model(model)


@pytest.mark.parametrize("recipe", [p for p in METHOD_RECIPES if "From litdata shards" in p.read_text()], ids=lambda p: p.stem)
def test_an_imagenet_recipe_reads_shards_with_the_data_class_swapped(recipe, capsys):
    # The swap each ImageNet recipe's header shows keeps the recipe's data settings and views.
    with pytest.raises(SystemExit) as done:
        cli_main(["fit", "--config", str(recipe), "--data.class_path", "ImageShardsDataModule",
                  "--data.init_args.train_dir", "s3://bucket/train", "--print_config"])
    assert done.value.code in (0, None)
    data = yaml.safe_load(capsys.readouterr().out)["data"]
    folder = yaml.safe_load(recipe.read_text())["data"]["init_args"]
    assert data["class_path"] == "ssl_vit.data.ImageShardsDataModule" and data["init_args"]["train_dir"] == "s3://bucket/train"
    assert data["init_args"]["views"]["class_path"] == folder["views"]["class_path"]
    assert {k: data["init_args"][k] for k in ("img_size", "num_workers")} == {k: folder[k] for k in ("img_size", "num_workers")}
