"""The data code against independent references: statistics measured on converted pixels,
torchvision's resize + centre crop, DistributedSampler's permutation and SplitMix64 written out
here, IDX bytes packed by hand with ``struct``."""

from __future__ import annotations

import gzip
import inspect
import logging
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import Dataset

from ssl_vit import create_backbone
from ssl_vit.data import (
    CIFAR10DataModule,
    FashionMNISTDataModule,
    ImageDataModule,
    ImageFiles,
    ImageFolderDataModule,
    InMemoryImages,
    SingleView,
    read_idx,
    scan_image_dir,
)
from ssl_vit.data.sampler import ResumableLoader, ResumableSampler, SeededIndex, sample_seeds

# -- references written out ---------------------------------------------------------------------

_MASK64 = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    # SplitMix64's output function (Steele, Lea & Flood 2014), in Python integers.
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _reference_seed(seed: int, epoch: int, index: int) -> int:
    # The documented derivation: a hash of (seed, epoch, index), chained one key at a time.
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ epoch) ^ index)


def _reference_order(n: int, seed: int, epoch: int) -> list[int]:
    # torch.utils.data.DistributedSampler (shuffle=True): randperm from a generator seeded seed + epoch.
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


class _Memory(ImageDataModule):
    """A datamodule over given in-memory splits, with given native statistics."""

    def __init__(self, train: InMemoryImages, test: InMemoryImages | None = None,
                 dataset_mean: tuple[float, ...] = (0.5,), dataset_std: tuple[float, ...] = (0.25,),
                 **kwargs) -> None:
        self.dataset_mean, self.dataset_std = dataset_mean, dataset_std  # read by the base __init__
        super().__init__(**kwargs)
        self._splits = {True: train, False: test}

    def prepare_data(self) -> None:
        pass

    def _load_split(self, train: bool) -> InMemoryImages | None:
        return self._splits[train]


def _indexed_images(n: int, size: int = 8) -> InMemoryImages:
    # Image i is the constant grey level i and carries label i: a batch tells its dataset indices.
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1).expand(n, size, size)
    return InMemoryImages(images.contiguous(), torch.arange(n))


class _Positions(Dataset):
    """Items ``(index, seed)`` of the SeededIndex the sampler hands out."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, item: SeededIndex) -> tuple[int, int]:
        return item.index, item.seed % 2**62  # (fits an int64 tensor)


def _order(sampler: ResumableSampler) -> list[int]:
    return [item.index for item in sampler]


# -- base.py: statistics under channel conversion -------------------------------------------


def test_grey_statistics_shown_as_rgb_are_repeated_mean_and_std():
    # Grey data repeated to 3 channels has, in each channel, the grey pixels' own mean and std.
    dm = FashionMNISTDataModule(in_chans=3, download=False, num_workers=0)
    assert dm.mean == (0.2860,) * 3 and dm.std == (0.3530,) * 3
    native = FashionMNISTDataModule(in_chans=1, download=False, num_workers=0)
    assert native.mean == (0.2860,) and native.std == (0.3530,)

    # Measured: grey images given their own statistics come out of the 3-channel evaluation
    # transform with mean 0 and std 1 in every channel.
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (16, 8, 8), dtype=np.uint8)
    pixels = grey / 255.0
    dm = _Memory(InMemoryImages(torch.from_numpy(grey)), dataset_mean=(pixels.mean(),),
                 dataset_std=(pixels.std(),), img_size=8, in_chans=3, num_workers=0)
    x = torch.stack([dm.eval_datasets()[0][i][0] for i in range(16)]).double()  # [16, 3, 8, 8]
    torch.testing.assert_close(x.mean((0, 2, 3)), torch.zeros(3, dtype=torch.double), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.std((0, 2, 3), unbiased=False), torch.ones(3, dtype=torch.double), atol=1e-5, rtol=0)


def test_rgb_statistics_converted_to_grey_follow_itu_r_601_luma():
    # ITU-R 601-2 luma, L = 0.299 R + 0.587 G + 0.114 B: the mean is the weighted mean, and the
    # std the weighted std (exact for fully correlated channels), on CIFAR-10's statistics.
    dm = CIFAR10DataModule(in_chans=1, download=False, num_workers=0)
    assert dm.mean == pytest.approx((0.299 * 0.4914 + 0.587 * 0.4822 + 0.114 * 0.4465,), abs=1e-9)
    assert dm.std == pytest.approx((0.299 * 0.2470 + 0.587 * 0.2435 + 0.114 * 0.2616,), abs=1e-9)

    # Measured: RGB images whose channels move together (c = a_c + b_c z), converted by Pillow's
    # convert("L"), have the mean and std the module derives from the per-channel statistics.
    rng = np.random.default_rng(1)
    z = rng.random((32, 8, 8))
    rgb = np.stack([20 + 200 * z, 40 + 150 * z, 10 + 100 * z], axis=-1).round().astype(np.uint8)
    channels = rgb.reshape(-1, 3) / 255.0
    luma = np.stack([np.asarray(Image.fromarray(img, "RGB").convert("L")) for img in rgb]) / 255.0
    dm = _Memory(InMemoryImages(torch.from_numpy(rgb)), dataset_mean=tuple(channels.mean(0)),
                 dataset_std=tuple(channels.std(0)), img_size=8, in_chans=1, num_workers=0)
    assert dm.mean[0] == pytest.approx(luma.mean(), abs=2e-3)
    assert dm.std[0] == pytest.approx(luma.std(), abs=2e-3)
    # (Treating the channels as independent, sqrt(sum w^2 s^2), would be ~30 % too small here.)
    assert luma.std() > 1.3 * math.sqrt(sum((w * s) ** 2 for w, s in zip((0.299, 0.587, 0.114), channels.std(0))))
    x = torch.stack([dm.eval_datasets()[0][i][0] for i in range(32)]).double()  # [32, 1, 8, 8]
    assert abs(float(x.mean())) < 0.02 and abs(float(x.std(unbiased=False)) - 1) < 0.02


# -- base.py: evaluation crop and loader order ------------------------------------------------------


def test_eval_crop_pct_defaults_to_0875_and_is_applied(tmp_path):
    # Reference: torchvision Resize(short side floor(size / crop_pct), bicubic) + CenterCrop(size).
    # (A 36 x 24 image: the long side 27 or 48 is whole, so rounding and torchvision's truncation agree.)
    # The default (None) is 0.875 for images of another size, 1 (used whole) for images at the size.
    assert inspect.signature(ImageDataModule.__init__).parameters["eval_crop_pct"].default is None
    (tmp_path / "small").mkdir()
    Image.fromarray(np.arange(256, dtype=np.uint8).reshape(16, 16), "L").save(tmp_path / "small" / "a.png")
    dm = ImageFolderDataModule(str(tmp_path / "small"), img_size=16, in_chans=1, mean=(0.0,), std=(1.0,), num_workers=0)
    assert torch.equal(dm.eval_datasets()[0][0][0] * 255, torch.arange(256.0).view(1, 16, 16)) and dm.eval_crop_pct == 1.0
    rng = np.random.default_rng(2)
    (tmp_path / "imgs").mkdir()
    Image.fromarray(rng.integers(0, 256, (24, 36, 3), dtype=np.uint8), "RGB").save(tmp_path / "imgs" / "a.png")
    img = Image.open(tmp_path / "imgs" / "a.png").convert("RGB")

    def reference(short: int) -> torch.Tensor:
        ref = TF.center_crop(TF.resize(img, short, interpolation=TF.InterpolationMode.BICUBIC), [16, 16])
        return torch.from_numpy(np.asarray(ref).transpose(2, 0, 1).copy()).float() / 255

    for kwargs, short in (({}, 18), ({"eval_crop_pct": 0.5}, 32)):  # floor(16 / 0.875) = 18; 16 / 0.5 = 32
        dm = ImageFolderDataModule(str(tmp_path / "imgs"), val_dir=str(tmp_path / "imgs"), img_size=16,
                                   mean=(0.0,), std=(1.0,), batch_size=1, num_workers=0, **kwargs)
        torch.testing.assert_close(dm.eval_datasets()[0][0][0], reference(short))
        images, _ = next(iter(dm.val_dataloader()))
        torch.testing.assert_close(images[0], reference(short))


def test_training_loader_shuffles_and_evaluation_loader_keeps_dataset_order(monkeypatch):
    # Reference for the training order: DistributedSampler's randperm(seed + epoch); the evaluation
    # loaders read the split in dataset order.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    torch.manual_seed(0)
    n = 24
    dm = _Memory(_indexed_images(n), _indexed_images(n), img_size=8, in_chans=1, batch_size=8,
                 views=SingleView(augment=False), num_workers=0, seed=3)
    train_order = [i for _, labels in dm.train_dataloader() for i in labels.tolist()]
    assert sorted(train_order) == list(range(n)) and train_order != list(range(n))
    assert train_order == _reference_order(n, seed=3, epoch=0)
    for loader in (dm.val_dataloader(), dm.test_dataloader()):
        assert [i for _, labels in loader for i in labels.tolist()] == list(range(n))


def test_the_run_seed_sets_the_training_order(monkeypatch):
    # Different seeds, different permutations, each DistributedSampler's randperm(seed + epoch);
    # a global seed (seed_everything's PL_GLOBAL_SEED) takes precedence over the datamodule's.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    n = 24

    def order(seed: int) -> list[int]:
        dm = _Memory(_indexed_images(n), img_size=8, in_chans=1, batch_size=n,
                     views=SingleView(augment=False), num_workers=0, seed=seed)
        return next(iter(dm.train_dataloader()))[1].tolist()

    assert order(1) != order(2)
    assert order(1) == _reference_order(n, 1, 0) and order(2) == _reference_order(n, 2, 0)
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert order(1) == order(2) == _reference_order(n, 7, 0)
    # The sampler itself: its seed and epoch give the permutation.
    for seed, epoch in ((0, 0), (1, 0), (1, 5)):
        sampler = ResumableSampler(_Positions(n), num_replicas=1, rank=0, seed=seed)
        sampler.set_epoch(epoch)
        assert _order(sampler) == _reference_order(n, seed, epoch)


# -- sampler.py: per-sample augmentation seeds ------------------------------------------------------


def test_sample_seeds_are_splitmix64_of_seed_epoch_and_index():
    # The written-out SplitMix64 reproduces its published output stream (seed 1234567, Rosetta
    # Code's "Pseudo-random numbers/Splitmix64" task) before it is used as the reference.
    stream = [_splitmix64((1234567 + k * _GOLDEN) & _MASK64) for k in range(3)]
    assert stream == [6457827717110365317, 3203168211198807973, 9817491932198370423]
    indices = [0, 1, 2, 7, 1000]
    for seed, epoch in ((0, 0), (3, 2), (-1, 9)):
        assert sample_seeds(seed, epoch, indices) == [_reference_seed(seed, epoch, i) for i in indices]
    # Changing any one of seed, epoch and index changes every seed.
    base = sample_seeds(3, 2, indices)
    for other in (sample_seeds(4, 2, indices), sample_seeds(3, 3, indices), sample_seeds(3, 2, [i + 1 for i in indices])):
        assert all(a != b for a, b in zip(base, other))
    assert len(set(base)) == len(base)


def test_the_sampler_hands_out_each_samples_own_seed():
    # Each item's seed is the reference hash of (run seed, the epoch iterated, the index).
    sampler = ResumableSampler(_Positions(10), num_replicas=1, rank=0, seed=5)
    for epoch in (0, 3):
        sampler.set_epoch(epoch)
        items = list(sampler)
        assert [it.seed for it in items] == [_reference_seed(5, epoch, it.index) for it in items]


# -- sampler.py: resuming -------------------------------------------------------------------------


def test_a_skip_applies_only_to_its_own_epoch():
    # skip(epoch 8, 3 batches of 2 samples), then set_epoch(4): epoch 4 is read whole.
    n = 20
    sampler = ResumableSampler(_Positions(n), num_replicas=1, rank=0, seed=3)
    sampler.skip(8, 6)
    assert sampler.resume_offset() == 6
    sampler.set_epoch(4)
    assert sampler.resume_offset() == 0
    assert _order(sampler) == _reference_order(n, 3, 4)
    # In its own epoch it skips, once: the next pass over that epoch starts at its beginning.
    sampler.skip(8, 6)
    assert _order(sampler) == _reference_order(n, 3, 8)[6:]
    sampler.set_epoch(8)
    assert _order(sampler) == _reference_order(n, 3, 8)


def test_resuming_on_more_processes_skips_the_ceiling_of_each_share(caplog):
    # One process, batch 3, one batch done: 3 images seen. On two processes each skips
    # ceil(3 / 2) = 2 of its share (positions p, p + 2, ...), so positions 0-3 are skipped and
    # one unseen image (position 3) is left out, with a warning.
    n, seed = 20, 5
    perm = _reference_order(n, seed, 0)
    state = {"seed": seed, "epoch": 0, "batches": 1, "samples": 3}
    for rank in (0, 1):
        sampler = ResumableSampler(_Positions(n), num_replicas=2, rank=rank, seed=0)
        loader = ResumableLoader(_Positions(n), sampler=sampler, batch_size=3, num_workers=0)
        with caplog.at_level(logging.WARNING, logger="ssl_vit.data.sampler"):
            loader.load_state_dict(state)
        assert sampler.resume_offset() == 2
        assert loader.state_dict()["samples"] == 4  # 2 per process, before the first batch
        indices = [i for batch, _ in loader for i in batch.tolist()]
        assert indices == perm[rank::2][2:]
    assert any("1 images of the epoch are left out" in r.getMessage() for r in caplog.records)


def test_the_seed_restored_from_a_checkpoint_is_used():
    # A loader built with seed 0 that loads a state of seed 11 continues seed 11's order, with
    # seed 11's augmentation seeds.
    n = 12
    sampler = ResumableSampler(_Positions(n), num_replicas=1, rank=0, seed=0)
    loader = ResumableLoader(_Positions(n), sampler=sampler, batch_size=4, num_workers=0)
    loader.load_state_dict({"seed": 11, "epoch": 2, "batches": 1, "samples": 4})
    batches = list(loader)
    indices = [i for batch, _ in batches for i in batch.tolist()]
    seeds = [s for _, batch in batches for s in batch.tolist()]
    assert indices == _reference_order(n, 11, 2)[4:]
    assert seeds == [_reference_seed(11, 2, i) % 2**62 for i in indices]
    assert loader.state_dict() == {"seed": 11, "epoch": 2, "batches": 3, "samples": 12}


@pytest.mark.parametrize(("drop_last", "want"), [(False, [0.0, 0.4, 0.8, 1.0]), (True, [0.0, 0.4, 1.0])])
def test_epochs_done_counts_the_images_handed_out_and_a_finished_epoch_whole(drop_last, want):
    # 10 images in batches of 4: 4 / 10, 8 / 10, then the last batch of 2, or (drop_last) its
    # remainder dropped, which ends the epoch as well; a resume at another batch size keeps the count.
    sampler = ResumableSampler(_Positions(10), num_replicas=1, rank=0, seed=0)
    loader = ResumableLoader(_Positions(10), sampler=sampler, batch_size=4, num_workers=0, drop_last=drop_last)
    seen = [loader.epochs_done()]
    for _ in loader:
        seen.append(loader.epochs_done())
    assert seen == pytest.approx(want)
    resumed = ResumableLoader(_Positions(10), sampler=ResumableSampler(_Positions(10), num_replicas=1, rank=0, seed=0), batch_size=2, num_workers=0)
    resumed.load_state_dict({"seed": 0, "epoch": 3, "batches": 1, "samples": 4})
    assert resumed.epochs_done() == pytest.approx(3.4)
    next(iter(resumed))
    assert resumed.epochs_done() == pytest.approx(3.6)


# -- datasets.py, idx.py, fashion_mnist.py, image_folder.py ---------------------------------------


def test_subsets_keep_each_chosen_items_label(tmp_path):
    # The labels of a subset are those of the chosen items (labels[indices]), not the first ones.
    labels = torch.tensor([7, 3, 9, 1, 0, 4, 8, 2, 6, 5])
    images = torch.arange(10, dtype=torch.uint8).view(10, 1, 1).expand(10, 4, 4).contiguous()
    chosen = torch.tensor([8, 2, 5])
    sub = InMemoryImages(images, labels).subset(chosen)
    assert sub.labels.tolist() == [6, 9, 4]
    assert [int(np.asarray(sub[i][0])[0, 0]) for i in range(3)] == [8, 2, 5]
    paths = [str(tmp_path / f"{i}.png") for i in range(10)]
    sub_files = ImageFiles(paths, labels.tolist()).subset(chosen)
    assert sub_files.labels.tolist() == [6, 9, 4] and sub_files.paths == [paths[8], paths[2], paths[5]]
    # Through a datamodule's subset draw: every kept image keeps its own label.
    dm = _Memory(InMemoryImages(images, labels), img_size=4, in_chans=1, subset=4, seed=1, num_workers=0)
    source = dm.train_dataset.source
    kept = source.images[:, 0, 0].long()
    assert source.labels.tolist() == labels[kept].tolist()
    assert kept.tolist() != [0, 1, 2, 3]  # a draw that is not the first images


@pytest.mark.parametrize(
    "type_code, fmt, values, dtype",
    [
        (0x0B, ">h", [[0, 1, -1], [258, -32768, 32767]], np.int16),
        (0x0C, ">i", [[0, -2], [65536, 2**31 - 1]], np.int32),
        (0x0D, ">f", [[1.5, -0.25], [3.0e5, 0.0]], np.float32),
        (0x09, ">b", [[-128, 127, 1]], np.int8),
        (0x08, ">B", [[1, 2, 3]], np.uint8),
    ],
)
def test_idx_multi_byte_types_read_big_endian(tmp_path, type_code, fmt, values, dtype):
    # IDX (LeCun's MNIST page): 00 00 <type> <ndim>, big-endian uint32 sizes, big-endian elements.
    shape = (len(values), len(values[0]))
    payload = b"".join(struct.pack(fmt, v) for row in values for v in row)
    data = bytes([0, 0, type_code, 2]) + struct.pack(">II", *shape) + payload
    (tmp_path / "x").write_bytes(data)
    got = read_idx(tmp_path / "x")
    assert got.dtype == np.dtype(dtype) and got.shape == shape
    np.testing.assert_array_equal(got, np.array(values, dtype=dtype))
    # Bytes beyond what the header says: rejected, as a truncated file is.
    (tmp_path / "long").write_bytes(data + b"\x00\x00")
    expected = shape[0] * shape[1] * np.dtype(dtype).itemsize
    with pytest.raises(ValueError, match=rf"\({expected} bytes of data\) but the file holds {expected + 2} bytes"):
        read_idx(tmp_path / "long")


def _write_fmnist(root: Path, train_labels: list[int], side: int = 28) -> None:
    def idx(type_ndim: bytes, shape: tuple[int, ...], payload: bytes) -> bytes:
        return b"\x00\x00" + type_ndim + struct.pack(f">{len(shape)}I", *shape) + payload

    root.mkdir(parents=True, exist_ok=True)
    for prefix, labels in (("train", train_labels), ("t10k", [0, 1])):
        n = len(labels)
        (root / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx(b"\x08\x03", (n, side, side), bytes(n * side * side))))
        (root / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx(b"\x08\x01", (n,), bytes(labels))))


def test_fashion_mnist_rejects_a_label_outside_its_ten_classes(tmp_path):
    # Fashion-MNIST's classes are 0..9: 9 is valid, 10 is not.
    _write_fmnist(tmp_path / "ok", [0, 9, 3])
    dm = FashionMNISTDataModule(root=str(tmp_path / "ok"), download=False, num_workers=0)
    assert dm.eval_datasets()[0].source.labels.tolist() == [0, 9, 3]
    _write_fmnist(tmp_path / "bad", [0, 10, 3])
    with pytest.raises(ValueError, match="labels outside 0..9"):
        FashionMNISTDataModule(root=str(tmp_path / "bad"), download=False, num_workers=0).setup()
    # IDX files of another image size (MNIST-like files of 32x32, say) are not Fashion-MNIST's
    _write_fmnist(tmp_path / "wide", [0, 1, 2], side=32)
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: expected 28x28 images, got shape \(3, 32, 32\)"):
        FashionMNISTDataModule(root=str(tmp_path / "wide"), download=False, num_workers=0).setup()
    # downloading when the files are missing is the default (torchvision's path for users elsewhere)
    assert FashionMNISTDataModule().download is True
    import torchvision

    assert FashionMNISTDataModule.class_names == torchvision.datasets.FashionMNIST.classes  # label i's name


def test_hidden_folders_are_not_classes(tmp_path):
    # Folders such as '.git' or '.ipynb_checkpoints' hold no class (torchvision's own find_classes
    # would count them).
    for folder, value in (("cat", 10), ("dog", 200), (".cache", 50)):
        (tmp_path / "tree" / folder).mkdir(parents=True)
        Image.new("L", (8, 8), value).save(tmp_path / "tree" / folder / "a.png")
    paths, labels, class_to_idx = scan_image_dir(tmp_path / "tree")
    assert class_to_idx == {"cat": 0, "dog": 1}
    assert labels == [0, 1] and [Path(p).parent.name for p in paths] == ["cat", "dog"]
    dm = ImageFolderDataModule(str(tmp_path / "tree"), img_size=8, in_chans=1, num_workers=0)
    assert dm.num_classes == 2 and dm.class_names == ["cat", "dog"]
    # A flat folder beside a hidden one stays a flat, unlabelled folder.
    (tmp_path / "flat" / ".thumbnails").mkdir(parents=True)
    Image.new("L", (8, 8), 1).save(tmp_path / "flat" / "x.png")
    Image.new("L", (8, 8), 2).save(tmp_path / "flat" / ".thumbnails" / "x.png")
    paths, labels, class_to_idx = scan_image_dir(tmp_path / "flat")
    assert labels is None and class_to_idx is None and paths == [str(tmp_path / "flat" / "x.png")]


def test_upper_case_extensions_are_images_and_a_validation_class_the_training_lacks_is_refused(tmp_path):
    # image_folder.py: extensions match in any case (a camera's IMG_0001.JPG), in class folders
    # (torchvision's make_dataset) and directly in a flat folder; a validation folder labelled by
    # the training folder's classes may lack some but not add one (its images would be dropped).
    for folder in ("train/cat", "train/dog", "val/cat", "val/fox"):
        (tmp_path / folder).mkdir(parents=True)
        Image.new("L", (8, 8), 1).save(tmp_path / folder / "IMG_0001.JPG", format="JPEG")
    (tmp_path / "flat").mkdir()
    Image.new("L", (8, 8), 1).save(tmp_path / "flat" / "a.PNG", format="PNG")
    assert scan_image_dir(tmp_path / "flat") == ([str(tmp_path / "flat" / "a.PNG")], None, None)
    paths, labels, class_to_idx = scan_image_dir(tmp_path / "train")
    assert labels == [0, 1] and class_to_idx == {"cat": 0, "dog": 1}
    with pytest.raises(ValueError, match=r"val has class folders not in the training folder: \['fox'\]"):
        scan_image_dir(tmp_path / "val", class_to_idx)
    (tmp_path / "val" / "fox" / "IMG_0001.JPG").unlink()
    (tmp_path / "val" / "fox").rmdir()
    assert scan_image_dir(tmp_path / "val", class_to_idx)[1] == [0]
    (tmp_path / "val" / "dog").mkdir()
    Image.new("L", (8, 8), 2).save(tmp_path / "val" / "dog" / "IMG_0002.JPG", format="JPEG")
    # a recipe's evaluation records name both folders, as `ssl-vit eval --data-arg` records them
    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.knn import KNNClassifier

    dm = ImageFolderDataModule(str(tmp_path / "train"), val_dir=str(tmp_path / "val"), img_size=8, in_chans=1, num_workers=0)
    backbone = create_backbone("vit", img_size=8, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2)
    ((result, _),) = Evaluation(["knn"], knn=KNNClassifier(k=1)).run(backbone, {"method": "random"}, dm, tmp_path / "knn.json")
    assert (result.data["train_dir"], result.data["val_dir"]) == (str(tmp_path / "train"), str(tmp_path / "val"))


@pytest.mark.parametrize("size, processes", [(7, 2), (2, 8), (1, 3), (4, 4)])
def test_even_shares_pad_to_a_multiple_of_the_processes_with_unlabelled_copies(size, processes):
    from ssl_vit.data.datasets import EvenShares

    source = [(f"img{i}", i) for i in range(size)]
    shares = EvenShares(source, processes)
    padded = -(-size // processes) * processes  # the next multiple of the process count
    assert len(shares) == padded
    items = [shares[i] for i in range(padded)]
    assert items[:size] == source
    # the padding: the images again from the first on (round again if the split is small), unlabelled
    assert items[size:] == [(f"img{i % size}", -1) for i in range(padded - size)]
