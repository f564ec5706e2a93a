"""Shards (ssl_vit/data/shards.py, tools/folder_to_shards.py): a generated image folder converted
by the tool as a user runs it, read once an epoch over 2 processes x 2 workers, a corrupt image
skipped and counted, and a 2-process DDP run from the shards interrupted and resumed with the
batches the uninterrupted order has."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from helpers import subprocess_env
from PIL import Image

from ssl_vit.data import ImageShardsDataModule
from ssl_vit.data.shards import ShardLoader, ShardStream

ROOT = Path(__file__).resolve().parents[1]
N_IMAGES, BAD = 32, "c0/broken.png"  # 31 images in 4 classes and one file that is no image
DATA = {"img_size": 16, "in_chans": 1, "batch_size": 4, "num_workers": 2, "mean": [0.5], "std": [0.25]}


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _folder(root: Path, n: int, classes: int | None) -> dict[str, np.ndarray]:
    """``n`` random 16-px RGB PNGs in ``classes`` class folders (None: flat); their pixels by relative path."""
    rng, images = np.random.default_rng(0), {}
    for i in range(n):
        name = f"{i:03d}.png" if classes is None else f"c{i % classes}/{i:03d}.png"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        images[name] = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
        Image.fromarray(images[name]).save(root / name)
    return images


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("folder")
    _folder(folder, N_IMAGES - 1, classes=4)
    (folder / BAD).write_bytes(b"not a png")
    out = tmp_path_factory.mktemp("shards") / "train"
    # Chunks of 4 images: each of 2 processes x 2 workers streams chunks of its own.
    assert _tool("folder_to_shards").main([str(folder), str(out), "--chunk-size", "4", "--num-workers", "2"]) == 0
    return out


def test_the_tool_writes_each_image_its_label_and_its_name_labelled_or_not(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        _tool("folder_to_shards").main(["--help"])
    assert done.value.code == 0 and "--chunk-bytes" in capsys.readouterr().out
    for classes in (3, None):
        images = _folder(tmp_path / f"in{classes}", 9, classes)
        out = tmp_path / f"out{classes}"
        assert _tool("folder_to_shards").main([str(tmp_path / f"in{classes}"), str(out), "--chunk-size", "2", "--num-workers", "1"]) == 0
        assert f"9 images ({'3 classes' if classes else 'unlabelled'})" in capsys.readouterr().out
        dm = ImageShardsDataModule(str(out), img_size=16, num_workers=0)
        dm.setup()
        source = dm._train_source
        assert len(source) == 9 and dm.num_classes == classes and dm.unlabelled_train_images == (0 if classes else 9)
        for i in range(9):
            image, label = source[i]
            name = bytes(source.reader[i]["name"]).decode()
            np.testing.assert_array_equal(np.asarray(image), images[name])  # the file's pixels
            assert label == (int(name[1]) if classes else -1)
        order = [bytes(source.reader[i]["name"]).decode() for i in range(9)]
        assert order != sorted(order)  # written shuffled: a chunk mixes classes
    # A validation split takes the training split's class indices.
    _folder(tmp_path / "val", 5, 2)
    assert _tool("folder_to_shards").main([str(tmp_path / "val"), str(tmp_path / "val3"), "--classes-from", str(tmp_path / "out3")]) == 0
    _, test = ImageShardsDataModule(str(tmp_path / "out3"), val_dir=str(tmp_path / "val3"), img_size=16, num_workers=0).eval_datasets()
    assert sorted(test[i][1] for i in range(len(test))) == [0, 0, 0, 1, 1]
    assert _tool("folder_to_shards").main([str(tmp_path / "val"), str(tmp_path / "val2")]) == 0  # its own: c0, c1
    with pytest.raises(ValueError, match="--classes-from"):
        ImageShardsDataModule(str(tmp_path / "out3"), val_dir=str(tmp_path / "val2"), img_size=16, num_workers=0).setup()


def test_each_conversion_stages_in_folders_of_its_own(tmp_path, monkeypatch):
    # litdata's optimize empties its one staging folder per machine when it starts: two conversions
    # at once (train and val side by side) would garble each other's index
    from ssl_vit.data import shards as module

    seen, optimize = [], module.optimize
    names = ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")
    monkeypatch.setattr(module, "optimize", lambda **kw: seen.append(tuple(os.environ[n] for n in names)) or optimize(**kw))
    before = {n: os.environ.get(n) for n in names}
    _folder(tmp_path / "in", 4, None)
    for out in ("a", "b"):
        module.write_shards(tmp_path / "in", tmp_path / out, chunk_size=2)
        assert len(module.ShardImages(str(tmp_path / out))) == 4
    assert len({folder for call in seen for folder in call}) == 4 and not any(os.path.exists(f) for call in seen for f in call)
    assert {n: os.environ.get(n) for n in names} == before


class Indices(ShardStream):
    """The stream's sample indices instead of images."""

    def __getitem__(self, index):
        return index.index


def test_two_processes_of_two_workers_read_each_image_once_an_epoch(shards):
    dm = ImageShardsDataModule(str(shards), **DATA)
    dm.setup()
    epochs = [[], []]
    for rank in range(2):
        stream = Indices(dm._train_source, dm.views, dm.mean, dm.std, 1, seed=0, drop_last=True, world_size=2, rank=rank, num_nodes=1)
        loader = ShardLoader(stream, batch_size=4, num_workers=2)
        for epoch in epochs:
            epoch += [i for batch in loader for i in batch.tolist()]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(N_IMAGES))
    assert epochs[0] != epochs[1]  # shuffled anew each epoch


def test_a_corrupt_image_is_replaced_and_counted(shards):
    dm = ImageShardsDataModule(str(shards), **DATA)
    batches = list(dm.train_dataloader())  # one process: every image
    assert len(batches) == N_IMAGES // 4 and all(len(labels) == 4 and labels.min() >= 0 for _, labels in batches)
    assert dm.skipped_paths == [BAD]
    train, _ = dm.eval_datasets()  # evaluation: not replaced but labelled -1, to be dropped
    assert sum(train[i][1] == -1 for i in range(len(train))) == 1


@pytest.mark.parametrize("taken", [3, 8], ids=["mid-epoch", "epoch-end"])
def test_a_loader_restored_from_its_state_continues_the_uninterrupted_order(shards, taken):
    def loader() -> ShardLoader:
        dm = ImageShardsDataModule(str(shards), **DATA)
        return dm.train_dataloader()

    def same(a, b) -> bool:  # the same images, augmented alike
        return torch.equal(a[1], b[1]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))

    uninterrupted = loader()
    want = [batch for _ in range(2) for batch in uninterrupted]  # two epochs of 8 batches
    first = loader()
    batches = iter(first)
    got = [next(batches) for _ in range(taken)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    got += list(resumed)  # the rest of the epoch (none after its end) ...
    got += list(resumed) if taken < 8 else []  # ... and the next
    assert len(got) == 16 and all(same(g, w) for g, w in zip(got, want))
    assert resumed.epochs_done() == 2.0


class RecordBatches(L.Callback):
    """Saves each batch a process trains on: ``<out>/rank<r>_step<s>.pt``."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.save(batch, self.out / f"rank{trainer.global_rank}_step{trainer.global_step}.pt")


def test_a_two_process_run_from_shards_resumes_with_the_uninterrupted_batches(shards, tmp_path):
    """``ssl-vit fit`` on 2 CPU processes (DDP) with 2 workers each: a crash at step 3 and
    ``--resume`` from the checkpoint of step 2 train on the batches of the uninterrupted order (the
    same images, augmented alike) into the second epoch; the corrupt image is reported once."""
    seen = tmp_path / "seen"
    seen.mkdir()
    record = {"class_path": "test_shards.RecordBatches", "init_args": {"out": str(seen)}}
    crash = {"class_path": "test_faults.Interrupt", "init_args": {"step": 3, "how": "crash"}}

    def fit(callbacks: list[dict], *extra: str) -> subprocess.CompletedProcess[str]:
        recipe = {
            "seed_everything": 0,
            "trainer": {"accelerator": "cpu", "max_steps": 8, "default_root_dir": str(tmp_path / "run"), "logger": False,
                        "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0, "num_sanity_val_steps": 0,
                        "callbacks": callbacks},
            "checkpoint": {"every_n_train_steps": 2},
            "model": {"class_path": "ssl_vit.methods.Supervised", "init_args": {"backbone": "vit", "backbone_kwargs": {
                "img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}}},
            "data": {"class_path": "ssl_vit.data.ImageShardsDataModule", "init_args": {"train_dir": str(shards), **DATA}},
        }
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        cmd = [sys.executable, "-m", "ssl_vit.cli", "fit", "--config", str(tmp_path / "recipe.yaml"),
               "--config", str(ROOT / "recipes/trainer/ddp_cpu2.yaml"), *extra]
        return subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)

    first = fit([record, crash])
    assert first.returncode != 0, first.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 2
    resumed = fit([record], "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(ckpt, weights_only=False)["ssl_vit"]["epochs"] == 2.0
    assert (resumed.stdout + resumed.stderr).count(f"skipped 1 unreadable files: {BAD}") == 1

    # The uninterrupted order: each process's loader over two epochs, built here.
    dm = ImageShardsDataModule(str(shards), **DATA)
    dm.setup()
    for rank in range(2):
        stream = ShardStream(dm._train_source, dm.views, dm.mean, dm.std, 1, seed=0, drop_last=True, world_size=2, rank=rank, num_nodes=1)
        loader = ShardLoader(stream, batch_size=4, num_workers=2)
        expected = [batch for _ in range(2) for batch in loader]
        for step, (views, labels) in enumerate(expected):  # steps 0-2 of the first run, then 2-7 resumed
            got_views, got_labels = torch.load(seen / f"rank{rank}_step{step}.pt")
            assert torch.equal(got_labels, labels) and all(torch.equal(g, v) for g, v in zip(got_views, views)), (rank, step)
