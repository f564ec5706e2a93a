"""Datamodules: batch contract, normalisation, channels, subsets, data sources and their errors."""

from __future__ import annotations

import pickle
import random
import re
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import write_fake_fashion_mnist
from PIL import Image

from ssl_vit import create_backbone
from ssl_vit.data import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    FashionMNISTDataModule,
    ImageFolderDataModule,
    MultiCrop,
    SingleView,
    STL10DataModule,
    SyntheticDataModule,
    TwoViews,
)
from ssl_vit.data.fashion_mnist import DEBIAN_DIR

FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530


def _synthetic(**kwargs) -> SyntheticDataModule:
    args = dict(num_samples=32, num_test_samples=16, num_classes=4, img_size=16, in_chans=1,
                batch_size=8, num_workers=0)
    args.update(kwargs)
    return SyntheticDataModule(**args)


def _write_pngs(directory: Path, values: list[int | tuple[int, int, int]], size: int = 20) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, value in enumerate(values):
        mode = "L" if isinstance(value, int) else "RGB"
        Image.new(mode, (size, size), value).save(directory / f"img{i}.png")


# -- batch structure ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "views, sizes",
    [
        (SingleView(), [16]),
        (TwoViews(), [16, 16]),
        (MultiCrop(local_size=8, n_local_crops=3), [16, 16, 8, 8, 8]),
    ],
)
def test_training_batch_structure(views, sizes):
    dm = _synthetic(views=views)
    views_b, labels = next(iter(dm.train_dataloader()))
    assert isinstance(views_b, list) and [v.shape[-1] for v in views_b] == sizes
    assert all(tuple(v.shape[:2]) == (8, 1) and v.dtype == torch.float32 for v in views_b)
    assert labels.dtype == torch.long and labels.shape == (8,)
    images, labels = next(iter(dm.val_dataloader()))
    assert tuple(images.shape) == (8, 1, 16, 16) and labels.dtype == torch.long


def test_normalisation_is_applied_to_every_view(tmp_path):
    # Constant images c: every view (crops, flips, blur and grey jitter-free ops keep it constant)
    # and the evaluation images must equal (c / 255 - mean) / std.
    _write_pngs(tmp_path / "flat", [100] * 4)
    views = MultiCrop(local_size=8, n_local_crops=2, jitter_p=0.0, solarize_p=0.0)
    dm = ImageFolderDataModule(str(tmp_path / "flat"), views=views, img_size=16, in_chans=1,
                               mean=(0.3,), std=(0.2,), batch_size=4, num_workers=0)
    expected = (100 / 255 - 0.3) / 0.2
    views_b, labels = next(iter(dm.train_dataloader()))
    for v in views_b:
        torch.testing.assert_close(v, torch.full_like(v, expected), atol=1e-5, rtol=0)
    assert labels.tolist() == [-1] * 4
    train_eval, _ = dm.eval_datasets()
    image, _ = train_eval[0]
    torch.testing.assert_close(image, torch.full((1, 16, 16), expected), atol=1e-5, rtol=0)


def test_statistics_and_crop_that_cannot_normalise_are_refused():
    for std in ((0.0,), (-0.2,), (0.2, 0.0, 0.2)):
        with pytest.raises(ValueError, match="std values must be positive"):
            SyntheticDataModule(in_chans=len(std), std=std)
    with pytest.raises(ValueError, match="mean has 2 values but in_chans=3; give 1 or 3"):
        SyntheticDataModule(mean=(0.5, 0.5))
    for crop_pct in (0.0, 1.5):  # above 1 the resize would be smaller than the crop (black borders)
        with pytest.raises(ValueError, match=r"crop_pct must be in \(0, 1\]"):
            SyntheticDataModule(eval_crop_pct=crop_pct)


def test_channel_conversion_both_ways(tmp_path):
    # Grey -> 3 channels: the grey value repeated, normalised per channel.
    _write_pngs(tmp_path / "grey", [60, 60])
    dm = ImageFolderDataModule(str(tmp_path / "grey"), views=SingleView(augment=False), img_size=20,
                               in_chans=3, mean=(0.1, 0.2, 0.3), std=(0.5, 0.5, 0.5), num_workers=0)
    image, _ = dm.eval_datasets()[0][0]
    assert image.shape == (3, 20, 20)
    for c, m in enumerate((0.1, 0.2, 0.3)):
        assert image[c].allclose(torch.tensor((60 / 255 - m) / 0.5))
    # ... also for augmented training views (grey Fashion-MNIST-like data, 3 channels asked for).
    write_fake_fashion_mnist(tmp_path / "fmnist")
    dm = FashionMNISTDataModule(root=str(tmp_path / "fmnist"), download=False, views=TwoViews(), in_chans=3,
                                num_workers=0)
    views, _ = dm.train_dataset[0]
    assert [tuple(v.shape) for v in views] == [(3, 28, 28)] * 2
    assert all(torch.equal(v[0], v[1]) and torch.equal(v[0], v[2]) for v in views)
    # RGB -> 1 channel: ITU-R 601-2 luma, L = (299 R + 587 G + 114 B) / 1000.
    rgb = (200, 100, 30)
    _write_pngs(tmp_path / "rgb", [rgb, rgb])
    dm = ImageFolderDataModule(str(tmp_path / "rgb"), img_size=20, in_chans=1, mean=(0.0,), std=(1.0,),
                               num_workers=0)
    luma = (299 * rgb[0] + 587 * rgb[1] + 114 * rgb[2]) / 1000
    image, _ = dm.eval_datasets()[0][0]
    assert image.shape == (1, 20, 20)
    assert abs(float(image.mean()) * 255 - luma) <= 0.5 + 1e-4
    views, _ = dm.train_dataset[0]
    assert views[0].shape == (1, 20, 20)
    # Default statistics follow the channel choice.
    assert FashionMNISTDataModule(in_chans=3).mean == (FMNIST_MEAN,) * 3
    assert CIFAR10DataModule(in_chans=1).mean == pytest.approx((0.299 * 0.4914 + 0.587 * 0.4822 + 0.114 * 0.4465,))


def test_subset_size_and_determinism(tmp_path):
    train = torch.from_numpy(write_fake_fashion_mnist(tmp_path, n_train=40))

    def subset_images(seed: int, size: int = 10) -> torch.Tensor:
        dm = FashionMNISTDataModule(root=str(tmp_path), download=False, subset=size, seed=seed, num_workers=0)
        assert len(dm.train_dataset) == size and len(dm.eval_datasets()[0]) == size
        return dm._train_source.images

    a, b, c = subset_images(1), subset_images(1), subset_images(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # Every subset image is a distinct training image.
    matches = [(train.flatten(1) == img.flatten()).all(1).nonzero().flatten().tolist() for img in a]
    assert all(len(m) == 1 for m in matches) and len({m[0] for m in matches}) == 10


def test_synthetic_is_deterministic_and_learnable():
    a, b = _synthetic(seed=3), _synthetic(seed=3)
    a.setup(), b.setup()
    assert torch.equal(a._train_source.images, b._train_source.images)
    assert torch.equal(a._train_source.labels, b._train_source.labels)
    other = _synthetic(seed=4)
    other.setup()
    assert not torch.equal(a._train_source.images, other._train_source.images)
    assert not torch.equal(a._train_source.images[:16], a._test_source.images)
    # Classes are visually distinct: nearest class mean on raw pixels separates them.
    dm = _synthetic(num_samples=200, num_test_samples=100, in_chans=3)
    dm.setup()
    x_tr, y_tr = dm._train_source.images.flatten(1).float(), dm._train_source.labels
    x_te, y_te = dm._test_source.images.flatten(1).float(), dm._test_source.labels
    means = torch.stack([x_tr[y_tr == k].mean(0) for k in range(4)])
    accuracy = (torch.cdist(x_te, means).argmin(1) == y_te).float().mean()
    assert accuracy > 0.9


def test_drop_last_and_persistent_workers():
    with pytest.raises(ValueError, match="fewer than batch_size"):
        _synthetic(batch_size=64).train_dataloader()
    # Each of 2 processes reads half: 32 images per process at batch 40 leave no batch either.
    two = _synthetic(num_samples=64, batch_size=40)
    two.trainer = type("Trainer", (), {"world_size": 2, "global_rank": 0})()
    assert len(_synthetic(num_samples=64, batch_size=40).train_dataloader()) == 1  # one process: 64 images
    with pytest.raises(ValueError, match=r"\(32 for each of 2 processes\), fewer than batch_size=40 per process"):
        two.train_dataloader()
    dm = _synthetic(num_workers=1)
    assert dm.train_dataloader().persistent_workers
    assert not _synthetic().train_dataloader().persistent_workers  # needs workers


# -- ImageFolder ----------------------------------------------------------------------------------


def test_image_folder_with_classes_and_flat(tmp_path):
    _write_pngs(tmp_path / "train" / "cat", [10, 20, 30])
    _write_pngs(tmp_path / "train" / "dog", [200, 210])
    _write_pngs(tmp_path / "val" / "dog", [220])
    dm = ImageFolderDataModule(str(tmp_path / "train"), val_dir=str(tmp_path / "val"), img_size=16,
                               in_chans=1, batch_size=5, num_workers=0)
    assert dm.num_classes == 2 and dm.class_names == ["cat", "dog"]
    assert dm.has_labelled_test_split()  # (a recipe's evaluation is checked on it before training)
    _, labels = next(iter(dm.train_dataloader()))
    assert sorted(labels.tolist()) == [0, 0, 0, 1, 1]
    images, labels = next(iter(dm.val_dataloader()))
    assert labels.tolist() == [1] and images.shape == (1, 1, 16, 16)

    flat = ImageFolderDataModule(str(tmp_path / "train" / "cat"), img_size=16, in_chans=1, batch_size=3,
                                 num_workers=0)
    assert flat.num_classes is None and not flat.has_labelled_test_split()
    no_val = ImageFolderDataModule(str(tmp_path / "train"), img_size=16, in_chans=1, batch_size=5, num_workers=0)
    assert not no_val.has_labelled_test_split()
    # a recipe evaluating on it is refused before training
    from ssl_vit.eval.evaluate import Evaluation

    with pytest.raises(ValueError, match=r"ImageFolderDataModule has no val_dir \(the labelled test split\); "
                                         r"set evaluate.protocols: \[\] to pretrain without evaluating"):
        Evaluation(protocols=["knn"]).check_data(no_val)
    Evaluation(protocols=["knn"]).check_data(dm)
    _, labels = next(iter(flat.train_dataloader()))
    assert labels.tolist() == [-1, -1, -1]
    assert flat.val_dataloader() == [] and flat.eval_datasets()[1] is None


@pytest.mark.parametrize("num_workers", [0, 1])
def test_corrupt_files_are_skipped_and_counted(tmp_path, num_workers, caplog):
    _write_pngs(tmp_path / "imgs", [50, 60, 70, 80])
    bad = tmp_path / "imgs" / "garbage.png"
    bad.write_bytes(b"this is not a png" * 10)
    good = (tmp_path / "imgs" / "img0.png").read_bytes()
    truncated = tmp_path / "imgs" / "truncated.png"
    truncated.write_bytes(good[: len(good) // 2])
    dm = ImageFolderDataModule(str(tmp_path / "imgs"), img_size=16, in_chans=1, batch_size=6,
                               drop_last=False, num_workers=num_workers)
    loader = dm.train_dataloader()
    for _ in range(2):  # the second epoch does not retry (or log) the marked files
        (views,), labels = next(iter(loader))
        assert views.shape == (6, 1, 16, 16)
    assert sorted(dm.skipped_paths) == sorted([str(bad), str(truncated)])
    if num_workers == 0:  # (worker processes log to their own stderr)
        logged = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
        assert len(logged) == 2 and any(str(bad) in m for m in logged)


def test_unreadable_files_are_left_out_of_evaluation(tmp_path):
    # Evaluated with a garbage file in each split, a backbone scores exactly as on the folders
    # without them: no stand-in image is counted twice, and the record's sizes count readable files.
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 6), ("val", 3)):
        for c, name in enumerate(("ant", "bee", "cow")):
            for i in range(per_class):
                pixels = np.clip(rng.normal(60 + 60 * c, 40, (20, 20)), 0, 255).astype(np.uint8)
                for root in ("clean", "dirty"):
                    (tmp_path / root / split / name).mkdir(parents=True, exist_ok=True)
                    Image.fromarray(pixels).save(tmp_path / root / split / name / f"{i}.png")
        (tmp_path / "dirty" / split / "bee" / "garbage.png").write_bytes(b"not a png" * 8)

    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.knn import KNNClassifier

    def knn(root: str):
        dm = ImageFolderDataModule(str(tmp_path / root / "train"), val_dir=str(tmp_path / root / "val"), img_size=16,
                                   in_chans=1, batch_size=4, num_workers=0, mean=(0.5,), std=(0.25,))
        backbone = create_backbone("vit", img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2)
        ((result, _),) = Evaluation(["knn"], knn=KNNClassifier(k=3), batch_size=5).run(backbone, {"method": "random"}, dm, tmp_path / f"{root}.json")
        return dm, result

    clean, dirty = knn("clean")[1], knn("dirty")
    dm, dirty = dirty
    assert dirty.data["train_size"] == clean.data["train_size"] == 18 and dirty.data["test_size"] == 9
    assert dirty.metrics == clean.metrics
    assert len(dm.skipped_paths) == 2
    train, test = dm.eval_datasets()
    bad = next(i for i, p in enumerate(test.source.paths) if p.endswith("garbage.png"))
    assert test[bad][1] == -1  # the evaluation form: labelled -1, to be dropped
    assert dm.eval_datasets(replace_unreadable=True)[1][bad][1] >= 0  # a stand-in, as in training


def test_fine_tuning_trains_on_augmented_single_images():
    dm = SyntheticDataModule(num_samples=8, num_test_samples=4, img_size=16, in_chans=3, batch_size=4, num_workers=0)
    plain_train, plain_test = dm.eval_datasets()
    train, test = dm.eval_datasets(train_views=SingleView(scale=(0.2, 1.0)))
    x, y = train[0]
    assert x.shape == (3, 16, 16) and y == plain_train[0][1]
    assert not torch.equal(train[0][0], train[0][0])  # a new random crop / flip each time
    assert torch.equal(test[0][0], plain_test[0][0])  # the test split keeps the evaluation transform
    with pytest.raises(ValueError, match="train_views must make one view, TwoViews makes 2"):
        dm.eval_datasets(train_views=TwoViews())


def test_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolderDataModule(str(tmp_path / "missing"), num_workers=0).setup()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no images found"):
        ImageFolderDataModule(str(tmp_path / "empty"), num_workers=0).setup()
    (tmp_path / "empty_classes" / "a").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no images found"):
        ImageFolderDataModule(str(tmp_path / "empty_classes"), num_workers=0).setup()


# -- Fashion-MNIST ----------------------------------------------------------------------------


def test_fashion_mnist_from_root(tmp_path):
    train = write_fake_fashion_mnist(tmp_path / "FashionMNIST" / "raw")  # torchvision's layout
    dm = FashionMNISTDataModule(root=str(tmp_path), download=False, views=SingleView(augment=False),
                                batch_size=4, num_workers=0)
    train_eval, test = dm.eval_datasets()
    assert len(train_eval) == 12 and len(test) == 6
    image, label = train_eval[5]
    expected = (torch.from_numpy(train[5]).float() / 255 - FMNIST_MEAN) / FMNIST_STD
    torch.testing.assert_close(image[0], expected)
    assert label == 5
    assert (dm.img_size, dm.in_chans, dm.num_classes) == (28, 1, 10)


def test_fashion_mnist_missing_data_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"dataset-fashion-mnist.*internet access and download=true \(`--data-arg download=true`"):
        FashionMNISTDataModule(root=str(tmp_path), download=False, num_workers=0).setup()

    # A failed download (no internet) gives the same advice plus the cause, without advising a
    # download that was on already.
    import torchvision.datasets

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", offline)
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist.*download failed.*no network") as err:
        FashionMNISTDataModule(root=str(tmp_path), download=True, num_workers=0).prepare_data()
    assert "download=true" not in str(err.value)
    assert f"running once with internet access (saves to {tmp_path});" in str(err.value)
    # the training files alone (the t10k pair lost): the same advice, not a failure at the test split
    write_fake_fashion_mnist(tmp_path / "half")
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (tmp_path / "half" / name).unlink()
    with pytest.raises(FileNotFoundError, match=rf"Fashion-MNIST not found \(looked in: {re.escape(str(tmp_path / 'half'))}, .*dataset-fashion-mnist"):
        FashionMNISTDataModule(root=str(tmp_path / "half"), download=False, num_workers=0).prepare_data()


@pytest.mark.skipif(not (DEBIAN_DIR / "train-images-idx3-ubyte.gz").is_file(),
                    reason="Debian package dataset-fashion-mnist not installed")
def test_fashion_mnist_debian_files():
    dm = FashionMNISTDataModule(download=False, num_workers=0)
    dm.setup()
    train, test = dm._train_source, dm._test_source
    assert tuple(train.images.shape) == (60000, 28, 28) and tuple(test.images.shape) == (10000, 28, 28)
    assert set(train.labels.unique().tolist()) == set(range(10))
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    # The hard-coded statistics are the training pixels' (to the 4 digits written).
    pixels = train.images.double() / 255
    assert abs(float(pixels.mean()) - FMNIST_MEAN) < 1e-4
    assert abs(float(pixels.std()) - FMNIST_STD) < 1e-4


# -- torchvision-backed datasets --------------------------------------------------------------


def test_cifar_and_stl_missing_data_errors(tmp_path):
    # the hint names the argument as each entry point takes it
    with pytest.raises(FileNotFoundError, match=r"CIFAR-10 not found.*download=true \(`--data-arg download=true` to ssl-vit eval, "
                                                r"`data.init_args.download` in a recipe\), or pass root=<dir> \(`--data-arg root=<dir>`"):
        CIFAR10DataModule(root=str(tmp_path), download=False, num_workers=0).setup()
    with pytest.raises(FileNotFoundError, match="STL-10 not found.*`--data-arg root=<dir>`"):
        STL10DataModule(root=str(tmp_path), download=False, num_workers=0).setup()



def test_a_failed_download_says_so_without_asking_to_turn_download_on(tmp_path, monkeypatch):
    import torchvision.datasets

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    with pytest.raises(FileNotFoundError, match=r"the download failed \(URLError: <urlopen error no network>\)\. "
                                                r"Run once with internet access, or pass root=<dir>") as err:
        CIFAR10DataModule(root=str(tmp_path), num_workers=0).prepare_data()
    assert "download=true" not in str(err.value)


def test_cifar10_from_fake_batches(tmp_path, monkeypatch):
    # torchvision's on-disk format: pickled dicts with 'data' [n, 3072] (R plane, G plane, B plane)
    # and 'labels'; md5 checks are bypassed for the fake files.
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *args, **kwargs: True)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    red = np.concatenate([np.full(1024, 255), np.zeros(2048)]).astype(np.uint8)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({"data": np.stack([red, red]), "labels": [3, 7]}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    dm = CIFAR10DataModule(root=str(tmp_path), download=False, mean=(0.0,), std=(1.0,), num_workers=0,
                           batch_size=2)
    train_eval, test = dm.eval_datasets()
    assert len(train_eval) == 10 and len(test) == 2
    image, label = test[1]
    assert image.shape == (3, 32, 32) and label == 7
    assert image[0].min() == 1.0 and image[1:].max() == 0.0  # red stays in channel 0
    views, labels = next(iter(dm.train_dataloader()))
    assert views[0].shape == (2, 3, 32, 32) and set(labels.tolist()) <= {3, 7}


def test_datamodule_is_configurable_by_class_path():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(FashionMNISTDataModule, "data")
    cfg = parser.parse_object({
        "data": {
            "class_path": "ssl_vit.data.FashionMNISTDataModule",
            "init_args": {"batch_size": 16, "views": {"class_path": "ssl_vit.data.MultiCrop",
                                                      "init_args": {"n_local_crops": 10}}},
        }
    })
    dm = parser.instantiate(cfg).data
    assert isinstance(dm.views, MultiCrop) and dm.views.n_local_crops == 10 and dm.views.global_size == 28
    assert dm.batch_size == 16 and dm.img_size == 28


# -- what each datamodule reads, pinned -------------------------------------------------------


class _FakeSTL10:
    """torchvision's STL10 on its splits: data ``[N, 3, H, W]`` uint8 (H != W, so a transposed
    read shows), labels -1 on 'unlabeled'; every split asked for is recorded."""

    asked: list[str] = []
    sizes = {"train": 4, "test": 3, "unlabeled": 5}

    def __init__(self, root, split, download=False, **kwargs):
        type(self).asked.append(split)
        parts = split.split("+")
        n = sum(self.sizes[p] for p in parts)
        self.data = np.arange(n * 3 * 6 * 4, dtype=np.int64).reshape(n, 3, 6, 4).astype(np.uint8)
        self.labels = np.concatenate([np.full(self.sizes[p], -1) if p == "unlabeled" else np.arange(self.sizes[p]) % 2 for p in parts])
        self.classes = ["a", "b"]


def test_stl10_reads_its_splits_channels_last_and_evaluates_on_labelled_images(monkeypatch):
    import torchvision.datasets

    monkeypatch.setattr(torchvision.datasets, "STL10", _FakeSTL10)
    _FakeSTL10.asked = []
    dm = STL10DataModule(train_split="train+unlabeled", download=False, num_workers=0, img_size=4)
    test = dm._load_split(False)
    assert _FakeSTL10.asked == ["test"] and len(test.labels) == 3
    raw = _FakeSTL10("", "test").data
    assert tuple(test.images.shape) == (3, 6, 4, 3)
    assert torch.equal(test.images, torch.from_numpy(raw).permute(0, 2, 3, 1))  # images[n, h, w, c] = data[n, c, h, w]
    dm.setup()
    assert dm.unlabelled_train_images == 5
    train_eval, _ = dm.eval_datasets()
    assert len(train_eval) == 4 and all(train_eval[i][1] >= 0 for i in range(4))  # the labelled 'train' split only
    labelled = STL10DataModule(train_split="train", download=False, num_workers=0, img_size=4)
    labelled.setup()
    assert labelled.unlabelled_train_images == 0  # label 0 is a label


def test_fashion_mnist_without_download_never_downloads_and_finds_plain_idx_files(tmp_path, monkeypatch):
    import gzip

    import torchvision.datasets

    called = []
    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", lambda *a, **k: called.append(a))
    with pytest.raises(FileNotFoundError, match=r"\(download=False\)"):
        FashionMNISTDataModule(root=str(tmp_path / "none"), download=False, num_workers=0).prepare_data()
    assert called == []
    # the four files uncompressed, as some mirrors ship them
    write_fake_fashion_mnist(tmp_path / "gz")
    for path in (tmp_path / "gz").iterdir():
        (tmp_path / "plain").mkdir(exist_ok=True)
        (tmp_path / "plain" / path.name.removesuffix(".gz")).write_bytes(gzip.decompress(path.read_bytes()))
    plain = FashionMNISTDataModule(root=str(tmp_path / "plain"), download=False, num_workers=0)
    zipped = FashionMNISTDataModule(root=str(tmp_path / "gz"), download=False, num_workers=0)
    assert torch.equal(plain._load_split(True).images, zipped._load_split(True).images)
    assert called == []


def test_image_folder_splits_must_agree_on_labels(tmp_path):
    _write_pngs(tmp_path / "classes" / "a", [10, 20])
    _write_pngs(tmp_path / "classes" / "b", [30])
    _write_pngs(tmp_path / "flat", [40, 50])
    # a flat training folder has no classes, so a validation folder gives no labelled test split
    assert not ImageFolderDataModule(str(tmp_path / "flat"), val_dir=str(tmp_path / "classes"), num_workers=0).has_labelled_test_split()
    with pytest.raises(ValueError, match="has class folders but .*flat does not"):
        ImageFolderDataModule(str(tmp_path / "classes"), val_dir=str(tmp_path / "flat"), img_size=16, num_workers=0).setup()
    with pytest.raises(FileNotFoundError, match="not a directory"):
        ImageFolderDataModule(str(tmp_path / "flat" / "img0.png"), num_workers=0).setup()


def test_synthetic_splits_differ_and_labels_are_shuffled_and_balanced():
    from ssl_vit.data.synthetic import make_synthetic_images

    dm = _synthetic(num_samples=16, num_test_samples=16)
    train, test = dm._load_split(True), dm._load_split(False)
    assert not torch.equal(train.images, test.images)  # another stream of the seed: no leak
    # ... nor another seed's: seed 1's training images are not seed 0's test images
    assert not torch.equal(_synthetic(num_samples=16, seed=1)._load_split(True).images, test.images)
    _, labels = make_synthetic_images(60, 8, 1, 6, seed=0)
    assert not torch.equal(labels, torch.arange(60) % 6)
    assert torch.bincount(labels).tolist() == [10] * 6
    # class k's stripes: 2 + k % 3 cycles per image, at angle pi k / K (near vertical for K = 30)
    images, labels = make_synthetic_images(90, 64, 1, 30, seed=0)
    peaks = []
    for k in (0, 1, 2):
        profile = images[labels == k].double().mean(dim=(0, 1))  # [64]: the classes' mean row
        peaks.append(int(torch.fft.rfft(profile - profile.mean()).abs().argmax()))
    assert peaks == [2, 3, 4]


def _random_rgb(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def test_subset_is_the_sorted_randperm_draw_of_its_seed_and_may_take_every_image():
    kw = dict(num_samples=12, num_test_samples=4, num_classes=3, img_size=8, seed=3, num_workers=0)
    full = SyntheticDataModule(**kw)
    full.setup()
    sub = SyntheticDataModule(subset=5, **kw)
    sub.setup()
    idx = torch.randperm(12, generator=torch.Generator().manual_seed(3))[:5].sort().values
    assert torch.equal(sub._train_source.images, full._train_source.images[idx])
    assert torch.equal(sub._train_source.labels, full._train_source.labels[idx])
    every = SyntheticDataModule(subset=12, **kw)  # subset == number of images: all of them
    every.setup()
    assert torch.equal(every._train_source.images, full._train_source.images)


def test_dataset_statistics_are_the_published_ones():
    # CIFAR-10 / CIFAR-100 / STL-10 per-channel mean and std of the training pixels (commonly
    # used values; CIFAR-10's std is NOT the often-copied (0.2023, 0.1994, 0.2010)).
    assert CIFAR10DataModule.dataset_mean == (0.4914, 0.4822, 0.4465)
    assert CIFAR10DataModule.dataset_std == (0.2470, 0.2435, 0.2616)
    assert CIFAR100DataModule.dataset_mean == (0.5071, 0.4865, 0.4409)
    assert CIFAR100DataModule.dataset_std == (0.2673, 0.2564, 0.2762)
    assert STL10DataModule.dataset_mean == (0.4467, 0.4398, 0.4066)
    assert STL10DataModule.dataset_std == (0.2603, 0.2566, 0.2713)
    dm = CIFAR10DataModule(download=False, num_workers=0)
    assert dm.mean == (0.4914, 0.4822, 0.4465) and dm.std == (0.2470, 0.2435, 0.2616)


def test_cifar100_from_fake_files_has_100_classes(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *args, **kwargs: True)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    data = np.zeros((2, 3072), dtype=np.uint8)
    for name in ("train", "test"):
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "fine_labels": [0, 99], "coarse_labels": [0, 19]}, f)
    with open(folder / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"c{i}" for i in range(100)]}, f)
    dm = CIFAR100DataModule(root=str(tmp_path), download=False, num_workers=0)
    _, test = dm.eval_datasets()
    assert test[1][1] == 99
    assert dm.num_classes == 100 == len(dm.class_names)  # label 99 needs 100 classes in a probe


class _FakeSTL10Splits:
    sizes = {"train": 4, "test": 3, "unlabeled": 5}

    def __init__(self, root, split, download=False, **kwargs):
        parts = split.split("+")
        n = sum(self.sizes[p] for p in parts)
        self.data = np.random.default_rng(n).integers(0, 256, (n, 3, 12, 12), dtype=np.uint8)
        self.labels = np.concatenate([np.full(self.sizes[p], -1) if p == "unlabeled" else np.arange(self.sizes[p]) % 2 for p in parts])
        self.classes = ["a", "b"]


def test_stl10_fine_tuning_views_apply_whatever_the_pretraining_split(monkeypatch):
    # eval_datasets(train_views=...) trains fine-tuning on augmented labelled 'train' images; with
    # train_split='unlabeled' it must give exactly what train_split='train' gives.
    import torchvision.datasets

    monkeypatch.setattr(torchvision.datasets, "STL10", _FakeSTL10Splits)
    views = SingleView(scale=(0.2, 0.5))
    kw = dict(download=False, num_workers=0, img_size=8, mean=(0.0,), std=(1.0,))
    ref_train, _ = STL10DataModule(train_split="train", **kw).eval_datasets(train_views=views)
    got_train, _ = STL10DataModule(train_split="unlabeled", **kw).eval_datasets(train_views=views)
    plain, _ = STL10DataModule(train_split="train", **kw).eval_datasets()
    augmented = 0
    for seed in range(4):
        random.seed(seed)
        want, wl = ref_train[seed % 4]
        random.seed(seed)
        got, gl = got_train[seed % 4]
        assert gl == wl >= 0
        torch.testing.assert_close(got, want)
        augmented += not torch.equal(got, plain[seed % 4][0])
    assert augmented >= 1


@pytest.mark.parametrize("subset", [0, 33])
def test_a_subset_of_no_image_or_more_than_the_split_is_refused(subset):
    with pytest.raises(ValueError, match=f"subset={subset}: give a number of images from 1 to the 32 training images"):
        _synthetic(subset=subset).setup()


def test_eval_loader_uses_eval_batch_size():
    dm = SyntheticDataModule(num_samples=8, num_test_samples=7, img_size=8, batch_size=4, eval_batch_size=3, num_workers=0)
    assert [len(labels) for _, labels in dm.val_dataloader()] == [3, 3, 1]
    assert [len(labels) for _, labels in SyntheticDataModule(num_samples=8, num_test_samples=7, img_size=8, batch_size=4,
                                                              num_workers=0).test_dataloader()] == [4, 3]


def test_synthetic_without_test_images_says_it_has_no_labelled_test_split():
    dm = SyntheticDataModule(num_samples=8, num_test_samples=0, img_size=8, num_workers=0)
    assert dm.has_labelled_test_split() is False
    assert dm.eval_datasets()[1] is None
    assert SyntheticDataModule(num_samples=8, num_test_samples=1, img_size=8, num_workers=0).has_labelled_test_split()
