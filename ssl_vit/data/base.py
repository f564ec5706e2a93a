"""The shared base of the image datamodules.

Batches (the contract the pretext modules and evaluators rely on):

* training: ``(views, labels)``, ``views`` a list of float tensors ``[B, C, H, W]`` normalised with
  ``mean``/``std`` in the view transform's order (DINO: the global crops first), ``labels`` a
  LongTensor ``[B]``, -1 where the data has no labels;
* validation / test / ``eval_datasets()``: ``(images [B, C, H, W], labels [B])`` through the
  deterministic evaluation transform, normalised the same way.

The training loader is a :class:`~ssl_vit.data.sampler.ResumableLoader`: its order and
augmentations follow from the run's seed, the epoch and the sample, and a mid-epoch checkpoint
resumes at the next batch (see ``sampler.py``).

A subclass only says where its images come from (``_load_split``), its default statistics
(``dataset_mean`` / ``dataset_std``) and, for labelled data, its number of classes
(``num_classes``: a class attribute, or set in ``__init__``), which the online probe and the
evaluations need; a split whose labelled test data depends on its arguments says so in
``has_labelled_test_split`` (checked before a recipe trains).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from ssl_vit.data.datasets import EvenShares, TransformedDataset
from ssl_vit.data.sampler import ResumableLoader, ResumableSampler
from ssl_vit.data.single_image import EvalTransform, OneView
from ssl_vit.data.views import SingleView, ViewTransform
from ssl_vit.runtime import global_seed

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# ITU-R 601-2 luma weights: Pillow's convert("L"), used to turn RGB statistics into grey ones.
_LUMA = (0.299, 0.587, 0.114)


def ignore_sigint(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the worker ignores Ctrl-C, which a terminal sends to the
    whole process group. The main process decides what it means (a fit finishes its step and
    checkpoints: ``ssl_vit.training.preemption``) and shuts its workers down itself; a worker
    killed by it would instead fail the step still to finish."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def option_hint(key: str, value: str) -> str:
    """How a datamodule argument is given where users give it, for error messages."""
    return f"{key}={value} (`--data-arg {key}={value}` to ssl-vit eval, `data.init_args.{key}` in a recipe)"


def download_advice(download: bool) -> str:
    """``"internet access"``, and turning ``download`` on when it was off, for error messages."""
    return "internet access" + ("" if download else f" and {option_hint('download', 'true')}")


def torchvision_fetch_advice(download: bool, folder: str) -> str:
    """How to get a torchvision dataset that is not on disk (``folder``: its extracted folder),
    for error messages: turning ``download`` on is advised only when it was off."""
    return f"Run once with {download_advice(download)}, or pass {option_hint('root', '<dir>')} containing torchvision's {folder}/ folder."


def default_root() -> Path:
    """Where downloaded datasets go: ``$XDG_CACHE_HOME/ssl_vit`` or ``~/.cache/ssl_vit``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "ssl_vit"


def _default_stats(
    native_mean: Sequence[float], native_std: Sequence[float], in_chans: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if len(native_mean) == in_chans:
        return tuple(native_mean), tuple(native_std)
    if len(native_mean) == 1:  # grey data shown as RGB: the same statistics in every channel
        return tuple(native_mean) * in_chans, tuple(native_std) * in_chans
    # RGB data converted to grey: luma is linear, so its mean is exact; its std is taken as the
    # luma-weighted std, exact when the channels are fully correlated (nearly so in photos).
    mean = sum(w * m for w, m in zip(_LUMA, native_mean))
    std = sum(w * s for w, s in zip(_LUMA, native_std))
    return (mean,), (std,)


def _fit_channels(name: str, values: Sequence[float], in_chans: int) -> tuple[float, ...]:
    values = tuple(float(v) for v in values)
    if len(values) == 1:
        values = values * in_chans
    if len(values) != in_chans:
        raise ValueError(f"{name} has {len(values)} values but in_chans={in_chans}; give 1 or {in_chans}")
    if name == "std" and any(v <= 0 for v in values):
        raise ValueError(f"std values must be positive, got {values}")
    return values


def _for_evaluation(source: Any) -> Any:
    """The evaluation form of a split: files that cannot be read come back labelled -1 (dropped by
    the evaluators) instead of replaced by another image (see ``ImageFiles.for_evaluation``)."""
    return source.for_evaluation() if hasattr(source, "for_evaluation") else source


class ImageDataModule(L.LightningDataModule):
    """Base class: typed common arguments, loaders, channel handling and normalisation.

    Args:
        views: the view transform of training batches (SingleView / TwoViews / MultiCrop); sizes
            left unset are taken from ``img_size``. None: ``SingleView()`` (random resized crop +
            flip, the supervised recipe).
        batch_size: per device.
        num_workers: DataLoader worker processes (persistent between epochs when > 0).
        img_size: side of the (square) training and evaluation images; the backbone's img_size.
        in_chans: 1 or 3. Grey data is repeated to 3 channels when 3 are asked for; RGB data is
            converted to grey (ITU-R 601-2 luma) when 1 is.
        mean, std: per-channel normalisation (1 value or ``in_chans``); None: the dataset's own.
        subset: train on a fixed random subset of this many training images (drawn with ``seed``;
            also the train split of ``eval_datasets``). None: all.
        seed: seed of the subset draw (and of generated data); also of the training order and
            augmentations when the run sets no global seed (``seed_everything``).
        pin_memory: pin batches in page-locked memory (only when CUDA is available).
        drop_last: drop the last incomplete training batch.
        eval_batch_size: batch size of the validation / test loaders (None: batch_size).
        eval_crop_pct: evaluation transform's centre-crop fraction for images not already at
            ``img_size`` (resize to img_size / crop_pct, then centre crop).
    """

    #: statistics of the dataset's native channels (1 for grey data, 3 for RGB)
    dataset_mean: tuple[float, ...] = IMAGENET_MEAN
    dataset_std: tuple[float, ...] = IMAGENET_STD

    def __init__(
        self,
        views: ViewTransform | None = None,
        batch_size: int = 256,
        num_workers: int = 4,
        img_size: int = 224,
        in_chans: int = 3,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        subset: int | None = None,
        seed: int = 0,
        pin_memory: bool = True,
        drop_last: bool = True,
        eval_batch_size: int | None = None,
        eval_crop_pct: float = 0.875,
    ) -> None:
        super().__init__()
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 or 3, got {in_chans}")
        if img_size < 1 or batch_size < 1 or num_workers < 0:
            raise ValueError(
                f"need img_size >= 1, batch_size >= 1, num_workers >= 0; got {img_size}, {batch_size}, {num_workers}"
            )
        if subset is not None and subset < 1:
            raise ValueError(f"subset must be a positive number of images or None, got {subset}")
        views = SingleView() if views is None else views
        # Fill the view sizes from img_size (and check explicit ones agree); plain callables pass.
        self.views = views.with_img_size(img_size) if hasattr(views, "with_img_size") else views
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.img_size = img_size
        self.in_chans = in_chans
        default_mean, default_std = _default_stats(self.dataset_mean, self.dataset_std, in_chans)
        self.mean = _fit_channels("mean", default_mean if mean is None else mean, in_chans)
        self.std = _fit_channels("std", default_std if std is None else std, in_chans)
        self.subset = subset
        self.seed = seed
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.eval_batch_size = eval_batch_size  # None: follow batch_size (which a CLI may reset)
        self.eval_transform = EvalTransform(img_size, crop_pct=eval_crop_pct)
        self._train_source: Any = None
        self._test_source: Any = None
        self._loaded = False

    # -- what subclasses provide ------------------------------------------------------------
    num_classes: int | None = None
    class_names: list[str] | None = None

    def _load_split(self, train: bool) -> Dataset | None:
        """The raw split: a dataset of ``(PIL image, label)`` with ``subset(indices)``
        (``InMemoryImages`` or ``ImageFiles``); None when the split does not exist."""
        raise NotImplementedError

    def has_labelled_test_split(self) -> bool:
        """Whether evaluation will find a labelled test split, known without reading the images
        (a recipe's evaluation is checked before its training): datasets with fixed splits have
        one; an image folder needs ``val_dir`` and class folders."""
        return True

    # -- Lightning hooks ----------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self._loaded:
            return
        train = self._load_split(train=True)
        if train is None:
            raise ValueError(f"{type(self).__name__} has no training split")
        if self.subset is not None:
            if self.subset > len(train):
                raise ValueError(f"subset={self.subset} exceeds the {len(train)} training images")
            gen = torch.Generator().manual_seed(self.seed)
            indices = torch.randperm(len(train), generator=gen)[: self.subset].sort().values
            train = train.subset(indices)
        self._train_source = train
        self._test_source = self._load_split(train=False)
        self._loaded = True

    def _ensure_setup(self) -> None:
        # Outside a Trainer (evaluators, notebooks) nobody calls prepare_data/setup for us.
        if not self._loaded:
            self.prepare_data()
            self.setup()

    # -- datasets -----------------------------------------------------------------------------
    def _wrap(self, source: Any, transform: Any, multi_view: bool) -> TransformedDataset:
        return TransformedDataset(source, transform, self.mean, self.std, self.in_chans, multi_view)

    @property
    def train_dataset(self) -> TransformedDataset:
        """Training split through ``views``: items ``(list of [C, H, W] views, label)``."""
        self._ensure_setup()
        return self._wrap(self._train_source, self.views, multi_view=True)

    def eval_datasets(
        self, replace_unreadable: bool = False, train_views: ViewTransform | None = None
    ) -> tuple[TransformedDataset, TransformedDataset | None]:
        """(train, test) with the evaluation transform, items ``([C, H, W], label)``; the
        evaluators' feature extraction reads these. test is None when there is no test split.
        An unreadable image file comes back labelled -1, to be dropped (``replace_unreadable``:
        replaced by another image, as in training, for uses that need no labels).
        ``train_views``: a one-view transform (``SingleView``: random resized crop + flip) for
        the training split instead, as fine-tuning trains on augmented images."""
        self._ensure_setup()
        train, test = self._train_source, self._test_source
        if not replace_unreadable:
            train, test = _for_evaluation(train), _for_evaluation(test)
        return (
            self._wrap(train, self._train_eval_transform(train_views), multi_view=False),
            None if test is None else self._wrap(test, self.eval_transform, multi_view=False),
        )

    def _train_eval_transform(self, train_views: ViewTransform | None) -> Any:
        if train_views is None:
            return self.eval_transform
        return OneView(train_views.with_img_size(self.img_size))

    @property
    def unlabelled_train_images(self) -> int:
        """How many training images have no label (-1): all of a flat image folder, STL-10's
        'unlabeled' split; the supervised baseline refuses to train on them."""
        self._ensure_setup()
        labels = getattr(self._train_source, "labels", None)
        return 0 if labels is None else int((torch.as_tensor(labels) < 0).sum())

    @property
    def num_skipped(self) -> int:
        """Number of unreadable image files skipped so far (train and test)."""
        return sum(getattr(s, "num_skipped", 0) for s in (self._train_source, self._test_source) if s is not None)

    @property
    def skipped_paths(self) -> list[str]:
        return [p for s in (self._train_source, self._test_source) if s is not None for p in getattr(s, "skipped_paths", [])]

    # -- loaders ------------------------------------------------------------------------------
    def _loader(self, dataset: Dataset, batch_size: int, train: bool, persistent: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=train,
            drop_last=train and self.drop_last,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=persistent and self.num_workers > 0,
            worker_init_fn=ignore_sigint if self.num_workers > 0 else None,
        )

    def train_dataloader(self) -> ResumableLoader:
        dataset = self.train_dataset
        # Each process reads its own share of the shuffled order (Lightning keeps this sampler
        # rather than injecting its own); outside a Trainer, torch.distributed says the layout.
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (None, None)
        sampler = ResumableSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=global_seed(self.seed))
        if self.drop_last and sampler.num_samples < self.batch_size:
            share = f" ({sampler.num_samples} for each of {sampler.num_replicas} processes)" if sampler.num_replicas > 1 else ""
            raise ValueError(
                f"the training set has {len(dataset)} images{share}, fewer than batch_size={self.batch_size} "
                "per process, so drop_last=True leaves no batch; lower batch_size or set drop_last=False"
            )
        return ResumableLoader(
            dataset,
            sampler=sampler,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            worker_init_fn=ignore_sigint if self.num_workers > 0 else None,
        )

    def val_dataloader(self) -> DataLoader | list:
        """The test split through the evaluation transform (the online probe's accuracy);
        an empty list (Lightning then skips validation) when there is no test split."""
        return self._eval_loader(persistent=True)

    def test_dataloader(self) -> DataLoader | list:
        return self._eval_loader(persistent=False)

    def _eval_loader(self, persistent: bool) -> DataLoader | list:
        _, test = self.eval_datasets()
        if test is None:
            return []
        world = self.trainer.world_size if self.trainer is not None else 1
        if world > 1:  # every image counted once over the processes (EvenShares)
            test = EvenShares(test, world)
        return self._loader(test, self.eval_batch_size or self.batch_size, train=False, persistent=persistent)

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

    def describe(self) -> str:
        """One line for run summaries."""
        self._ensure_setup()
        test = "none" if self._test_source is None else str(len(self._test_source))
        skipped = f", {self.num_skipped} unreadable files skipped" if self.num_skipped else ""
        return (
            f"{type(self).__name__}: {len(self._train_source)} train / {test} test images, "
            f"{self.in_chans}x{self.img_size}x{self.img_size}, classes={self.num_classes}, "
            f"views={self.views!r}{skipped}"
        )

