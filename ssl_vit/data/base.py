"""``ImageDataModule``, the base of the image datamodules: a subclass says where its images come from
(``_load_split``), their native statistics (``dataset_mean`` / ``dataset_std``; None: measured) and,
for labelled data, ``num_classes``. Batches are normalised: training ``(views, labels)`` (a list of
``[B, C, H, W]``, int64 labels ``[B]``, -1: none), evaluation ``(images [B, C, H, W], labels [B])``."""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from ssl_vit.data.augment import LUMA, to_pil
from ssl_vit.data.datasets import EvenShares, TransformedDataset
from ssl_vit.data.device_views import make_views
from ssl_vit.data.sampler import ResumableLoader, ResumableSampler
from ssl_vit.data.views import EvalTransform, SingleView, ViewTransform
from ssl_vit.io import atomic_write_json
from ssl_vit.runtime import global_seed

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def ignore_sigint(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the terminal's Ctrl-C is the main process's to handle (``training.preemption``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def option_hint(key: str, value: str) -> str:
    """A datamodule argument as users give it, for error messages."""
    return f"{key}={value} (`--data-arg {key}={value}` to ssl-vit eval, `data.init_args.{key}` in a recipe)"


def download_advice(download: bool) -> str:
    """``"internet access"``, and turning ``download`` on when it was off, for error messages."""
    return "internet access" + ("" if download else f" and {option_hint('download', 'true')}")


def data_root(root: str | None) -> Path:
    """A dataset's ``root`` argument as a path; None: ``$XDG_CACHE_HOME/ssl_vit`` or ``~/.cache/ssl_vit``."""
    if root is None:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser()) / "ssl_vit"
    return Path(root).expanduser()


def _channel_stats(name: str, values: Sequence[float] | None, native: Sequence[float] | None, in_chans: int) -> tuple[float, ...] | None:
    """``values`` (None: the dataset's ``native`` statistics; both None: measured later) for ``in_chans`` channels."""
    if values is None and native is None:
        return None
    if values is None and len(native) == 3 and in_chans == 1:
        # RGB to grey: the luma of the means (exact) and of the stds (exact for fully correlated channels).
        values = (sum(w * v for w, v in zip(LUMA, native)),)
    values = tuple(float(v) for v in (native if values is None else values))
    values = values * in_chans if len(values) == 1 else values  # grey statistics: the same in every channel
    if len(values) != in_chans:
        raise ValueError(f"{name} has {len(values)} values but in_chans={in_chans}; give 1 or {in_chans}")
    if name == "std" and min(values) <= 0:
        raise ValueError(f"std values must be positive, got {values}")
    return values


def _for_evaluation(split: Any) -> Any:
    """The split with unreadable files labelled -1 (dropped), not replaced (``ImageFiles``)."""
    return split.for_evaluation() if hasattr(split, "for_evaluation") else split


class ImageDataModule(L.LightningDataModule):
    """Base class: the common arguments, loaders, channel conversion and normalisation.

    Args:
        views: the view transform of training batches (SingleView / TwoViews / MultiCrop); sizes
            left unset are ``img_size``. None: ``SingleView()``.
        batch_size: per device.
        num_workers: DataLoader worker processes (persistent between epochs when > 0).
        img_size: side of the (square) training and evaluation images; the backbone's img_size.
        in_chans: 1 or 3: grey data is repeated to 3 channels, RGB data converted to grey (ITU-R 601-2 luma).
        mean, std: per-channel normalisation (1 value or ``in_chans``); None: the dataset's own (measured for folders).
        subset: train (and evaluate) on a fixed random subset of this many training images; None: all.
        seed: of the subset draw and of generated data; also of the training order and augmentations
            when the run sets no global seed (``seed_everything``).
        pin_memory: pin batches in page-locked memory (only when CUDA is available).
        drop_last: drop the last incomplete training batch.
        eval_batch_size: batch size of the validation / test loaders (None: batch_size).
        eval_crop_pct: the evaluation transform's centre-crop fraction (``EvalTransform``); None: 1
            for images already ``img_size`` squares, else timm's 0.875.
    """

    #: statistics of the dataset's native channels (1 for grey data, 3 for RGB)
    dataset_mean: tuple[float, ...] | None = IMAGENET_MEAN
    dataset_std: tuple[float, ...] | None = IMAGENET_STD
    #: how many training images :meth:`measure_statistics` reads
    stats_images: int = 1000
    num_classes: int | None = None
    class_names: list[str] | None = None

    def __init__(self, views: ViewTransform | None = None, batch_size: int = 256, num_workers: int = 4, img_size: int = 224,
                 in_chans: Literal[1, 3] = 3, mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
                 subset: int | None = None, seed: int = 0, pin_memory: bool = True, drop_last: bool = True,
                 eval_batch_size: int | None = None, eval_crop_pct: float | None = None) -> None:
        super().__init__()
        self.views = (SingleView() if views is None else views).with_img_size(img_size)
        self.batch_size, self.num_workers, self.img_size, self.in_chans = batch_size, num_workers, img_size, in_chans
        self.mean = _channel_stats("mean", mean, self.dataset_mean, in_chans)
        self.std = _channel_stats("std", std, self.dataset_std, in_chans)
        self.stats_source = "given" if mean is not None or std is not None else "dataset" if self.mean is not None else None
        self.subset, self.seed, self.pin_memory, self.drop_last = subset, seed, pin_memory, drop_last
        self.eval_batch_size = eval_batch_size  # None: follow batch_size (which a CLI may reset)
        self.eval_crop_pct = eval_crop_pct
        self.eval_transform = EvalTransform(img_size, crop_pct=eval_crop_pct)
        self._train_source: Any = None
        self._test_source: Any = None

    def _load_split(self, train: bool) -> Dataset | None:
        """The raw split: a dataset of ``(PIL image, label)`` with ``subset(indices)``; None: no such split."""
        raise NotImplementedError

    def has_labelled_test_split(self) -> bool:
        """Whether evaluation will find a labelled test split, known without reading the images."""
        return True

    def setup(self, stage: str | None = None) -> None:
        if self._train_source is not None:
            return
        train = self._load_split(train=True)
        if self.eval_crop_pct is None and len(train):  # (for the record: timm's crop_pct of an export)
            self.eval_crop_pct = self.eval_transform.crop_for(to_pil(train[0][0]))
        if self.mean is None or self.std is None:  # (of the whole split: a subset is normalised as the dataset is)
            self.measure_statistics(train)
        if self.subset is not None:
            if not 0 < self.subset <= len(train):
                raise ValueError(f"subset={self.subset}: give a number of images from 1 to the {len(train)} training images")
            indices = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed))[: self.subset]
            train = train.subset(indices.sort().values)
        self._test_source = self._load_split(train=False)
        self._train_source = train

    def measure_statistics(self, train: Any) -> None:
        """Set ``mean`` / ``std`` left unset to the per-channel statistics of up to ``stats_images`` training
        images (a seeded sample, through the evaluation transform), kept in ``<default_root_dir>/data_stats.json``."""
        cache = Path(self.trainer.default_root_dir) / "data_stats.json" if self.trainer is not None else None
        key = {"train_dir": str(getattr(self, "train_dir", "")), "img_size": self.img_size, "in_chans": self.in_chans}
        cached = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
        if cached.get("key") != key:
            source = _for_evaluation(train)
            n = min(self.stats_images, len(source))
            picked = torch.randperm(len(source), generator=torch.Generator().manual_seed(0))[:n]
            sample = TransformedDataset(source, self.eval_transform, (0.0,) * self.in_chans, (1.0,) * self.in_chans, self.in_chans, False)
            sums = torch.zeros(3, self.in_chans, dtype=torch.float64)  # pixels, sum, sum of squares per channel
            for i in picked.tolist():
                x, label = sample[i]
                if label == -1 and getattr(source, "labels", None) is not None and source.labels[i] != -1:
                    continue  # an unreadable file
                x = x.double().flatten(1)  # [C, H*W]
                sums += torch.stack([torch.full((self.in_chans,), float(x.shape[1])), x.sum(1), x.pow(2).sum(1)])
            mean = sums[1] / sums[0]
            std = (sums[2] / sums[0] - mean**2).clamp(min=1e-12).sqrt()
            cached = {"key": key, "images": n, "mean": mean.tolist(), "std": std.clamp(min=1e-3).tolist()}
            if cache is not None and (self.trainer.global_rank == 0):
                atomic_write_json(cache, cached)
        self.mean = self.mean or tuple(cached["mean"])
        self.std = self.std or tuple(cached["std"])
        self.stats_source = f"measured on {cached['images']} training images"
        log.info("normalisation %s: mean %s, std %s", self.stats_source, [round(m, 4) for m in self.mean], [round(s, 4) for s in self.std])

    def _ensure_setup(self) -> None:
        if self._train_source is None:  # outside a Trainer (evaluators, notebooks)
            self.prepare_data()
            self.setup()

    def _wrap(self, source: Any, transform: Any, multi_view: bool) -> TransformedDataset:
        return TransformedDataset(source, transform, self.mean, self.std, self.in_chans, multi_view)

    @property
    def train_dataset(self) -> TransformedDataset:
        """The training split through ``views``: items ``(list of [C, H, W] views, label)``."""
        self._ensure_setup()
        return self._wrap(self._train_source, self.views, multi_view=True)

    def _labelled_train_source(self) -> Any:
        """The training split the evaluations read (STL-10: its labelled images)."""
        return self._train_source

    def eval_datasets(
        self, replace_unreadable: bool = False, train_views: ViewTransform | None = None
    ) -> tuple[TransformedDataset, TransformedDataset | None]:
        """(train, test) through the evaluation transform, items ``([C, H, W], label)``; test None: no
        test split. An unreadable image file comes labelled -1, to be dropped (``replace_unreadable``:
        replaced by another image). ``train_views``: a one-view transform of the training split instead."""
        self._ensure_setup()
        train, test = self._labelled_train_source(), self._test_source
        if not replace_unreadable:
            train, test = _for_evaluation(train), _for_evaluation(test)
        transform = self.eval_transform
        if train_views is not None:
            transform = train_views.with_img_size(self.img_size)
            if transform.num_views != 1:
                raise ValueError(f"train_views must make one view, {type(train_views).__name__} makes {transform.num_views}")
        return self._wrap(train, transform, False), None if test is None else self._wrap(test, self.eval_transform, False)

    @property
    def unlabelled_train_images(self) -> int:
        """How many training images have no label (-1); the supervised baseline refuses to train on them."""
        self._ensure_setup()
        labels = getattr(self._train_source, "labels", None)  # (a split of one's own may not list them)
        return 0 if labels is None else int((torch.as_tensor(labels) < 0).sum())

    @property
    def skipped_paths(self) -> list[str]:
        """The unreadable image files skipped so far (train and test)."""
        return [p for s in (self._train_source, self._test_source) for p in getattr(s, "skipped_paths", [])]

    def _loader_args(self, persistent: bool) -> dict[str, Any]:
        workers = self.num_workers > 0
        return dict(num_workers=self.num_workers, pin_memory=self.pin_memory and torch.cuda.is_available(),
                    persistent_workers=persistent and workers, worker_init_fn=ignore_sigint if workers else None)

    def train_dataloader(self) -> ResumableLoader:
        dataset = self.train_dataset
        # Each process reads its share of the shuffled order (outside a Trainer: torch.distributed's layout).
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (None, None)
        sampler = ResumableSampler(dataset, num_replicas=world, rank=rank, seed=global_seed(self.seed))
        if self.drop_last and sampler.num_samples < self.batch_size:
            share = f" ({sampler.num_samples} for each of {sampler.num_replicas} processes)" if sampler.num_replicas > 1 else ""
            raise ValueError(f"the training set has {len(dataset)} images{share}, fewer than batch_size={self.batch_size} per "
                             "process, so drop_last=True leaves no batch; lower batch_size or set drop_last=False")
        return ResumableLoader(dataset, sampler=sampler, batch_size=self.batch_size, drop_last=self.drop_last, **self._loader_args(True))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A training batch of views made on the device (``on_device``): canvases and draws -> normalised views."""
        if isinstance(batch, list | tuple) and len(batch) == 2 and isinstance(batch[0], dict) and "canvas" in batch[0]:
            return make_views(batch[0], self.views.augmentations(), self.mean, self.std), batch[1]
        return batch

    def val_dataloader(self) -> DataLoader | list:
        """The test split (the online probe's accuracy); none: an empty list, which Lightning skips."""
        return self._eval_loader(persistent=True)

    def test_dataloader(self) -> DataLoader | list:
        return self._eval_loader(persistent=False)

    def _eval_loader(self, persistent: bool) -> DataLoader | list:
        _, test = self.eval_datasets()
        if test is None:
            return []
        world = self.trainer.world_size if self.trainer is not None else 1
        dataset = EvenShares(test, world) if world > 1 else test  # every image counted once over the processes
        return DataLoader(dataset, batch_size=self.eval_batch_size or self.batch_size, **self._loader_args(persistent))

    def teardown(self, stage: str) -> None:
        # The run's summary of bad input: every unreadable file, once, with its path.
        if stage != "fit":
            return
        paths = self.skipped_paths
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Each process read its own share of the files: one summary, of all of them.
            shares: list[list[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(shares, paths)
            if dist.get_rank() != 0:
                return
            paths = sorted({p for share in shares for p in share or []})
        if paths:
            log.warning("skipped %d unreadable files: %s", len(paths), ", ".join(paths))
