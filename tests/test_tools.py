"""The scripts in tools/: each one run as a user runs it, on tiny inputs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import (
    SMALL_HEADS,
    TINY_BACKBONE,
    TINY_VIT,
    VIEW_SIZES,
    RepeatBatch,
    fixed_views,
    subprocess_env,
    write_fake_fashion_mnist,
)
from torch.utils.data import DataLoader

from ssl_vit.data import ImageFolderDataModule
from ssl_vit.export import load_any_backbone
from ssl_vit.methods import DINO, MoCoV3

TOOLS = Path(__file__).resolve().parents[1] / "tools"
BIN = Path(sys.executable).parent


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_image_folder_writes_a_folder_ssl_vit_reads_back(tmp_path, capsys):
    write_fake_fashion_mnist(tmp_path / "fmnist", n_train=20, n_test=10)
    out = tmp_path / "folder"
    assert _tool("make_image_folder").main(["fashion_mnist", str(out), "--root", str(tmp_path / "fmnist"), "--unlabelled-fraction", "0.5"]) == 0
    assert "10 labelled training images in train/, 10 in unlabelled/, 10 test images in val/ (10 classes)" in capsys.readouterr().out
    dm = ImageFolderDataModule(str(out / "train"), val_dir=str(out / "val"), img_size=28, in_chans=1, num_workers=0)
    train, test = dm.eval_datasets()
    assert dm.num_classes == 10 and len(train) == 10 and len(test) == 10 and len(list((out / "unlabelled").glob("*.png"))) == 10
    assert "T-shirt-top" in dm.class_names  # (the dataset's class names, as folder names)


@pytest.mark.parametrize("method", [DINO, MoCoV3])
def test_a_checkpoint_in_its_reference_layout_loads_back_as_the_same_encoders(method, tmp_path):
    # Reference: the loaders of official DINO / MoCo v3 checkpoints (ssl_vit.export.foreign, tested
    # against the reference layouts), which must find the same teacher / momentum and student weights.
    name = method.__name__.lower()
    model = method(**TINY_BACKBONE, **SMALL_HEADS[name])
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, DataLoader(RepeatBatch(*fixed_views(VIEW_SIZES[name], batch=8), 1), batch_size=None))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert _tool("to_reference_checkpoint").main([str(tmp_path / "run.ckpt"), str(tmp_path / "ref.pth")]) == 0
    ref = torch.load(tmp_path / "ref.pth")
    assert set(ref) == ({"student", "teacher", "epoch"} if method is DINO else {"state_dict", "epoch"})
    target = model.teacher_backbone if method is DINO else model.momentum_backbone
    for which, expected in (("student", model.backbone), ("teacher" if method is DINO else "momentum", target)):
        loaded, _ = load_any_backbone(tmp_path / "ref.pth", which=which, backbone="vit", backbone_kwargs=TINY_VIT)
        for key, value in expected.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[key], value)


RECIPE = """
trainer: {accelerator: cpu, max_steps: 1, logger: false, enable_progress_bar: false, enable_model_summary: false, limit_val_batches: 0}
checkpoint: {every_n_train_steps: 1}
model:
  class_path: Supervised
  init_args: {backbone: vit, backbone_kwargs: {img_size: 16, patch_size: 4, in_chans: 1, embed_dim: 32, depth: 1, num_heads: 2}}
data:
  class_path: SyntheticDataModule
  init_args: {num_samples: 32, num_test_samples: 0, num_classes: 2, img_size: 16, in_chans: 1, batch_size: 8, num_workers: 0}
"""


def _launch(script: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    environment = subprocess_env(PATH=f"{tmp_path / 'bin'}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}", **env)
    return subprocess.run(["bash", *script, "--trainer.default_root_dir", str(tmp_path / "run")], cwd=TOOLS.parent,
                          env=environment, capture_output=True, text=True, timeout=300)


def test_the_torchrun_launcher_trains_a_recipe(tmp_path):
    done = _launch([str(TOOLS / "torchrun_fit.sh"), str(tmp_path / "recipe.yaml")], tmp_path, NPROC="1", RDZV="localhost:29517")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def test_the_slurm_script_trains_a_recipe_under_srun(tmp_path):
    # srun stands in as a script that runs its command once, in a one-task job's environment.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text('#!/bin/bash\nexec "$@"\n')
    (tmp_path / "bin" / "srun").chmod(0o755)
    slurm = {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NAME": "pretrain", "SLURM_JOB_ID": "42",
             "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}
    done = _launch([str(TOOLS / "slurm_fit.sbatch"), "--trainer.accelerator", "cpu"], tmp_path, RECIPE=str(tmp_path / "recipe.yaml"), **slurm)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
