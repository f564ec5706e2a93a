"""The datasets under the datamodules: raw splits (``InMemoryImages``, ``ImageFiles``), a split through
a transform, normalised (``TransformedDataset``), an evaluation split padded for processes (``EvenShares``)."""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from ssl_vit.data.augment import to_pil
from ssl_vit.data.sampler import SeededIndex

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILURES = 100  # unreadable files in a row: not a few bad files but a broken dataset


def open_image(file: Any, name: str) -> Image.Image | None:
    """``file`` (a path or a file object) decoded in full; None, logged with its ``name``, when unreadable."""
    try:
        with Image.open(file) as img:
            img.load()  # (raises on truncated data)
            return to_pil(img)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        log.warning("skipping unreadable image %s (%s: %s)", name, type(err).__name__, err)
        return None


def _labels(n: int, labels: Sequence[int] | torch.Tensor | None) -> torch.Tensor:
    return torch.full((n,), -1, dtype=torch.long) if labels is None else torch.as_tensor(labels, dtype=torch.long)


class InMemoryImages(Dataset):
    """uint8 images ``[N, H, W]`` (grey; ``[N, H, W, 1]`` too) or ``[N, H, W, 3]`` (RGB) with labels
    ``[N]`` (None: all -1), items ``(PIL image, label)``: one buffer for the workers, not N objects."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        if images.ndim == 4 and images.shape[-1] == 1:
            images = images[..., 0]
        self.images = images.contiguous()
        self.labels = _labels(len(images), labels)
        self.mode = "L" if images.ndim == 3 else "RGB"

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[index].numpy(), self.mode), int(self.labels[index])

    def subset(self, indices: torch.Tensor) -> InMemoryImages:
        return InMemoryImages(self.images[indices], self.labels[indices])  # a compact copy for the workers


class ImageFiles(Dataset):
    """Images read from files, items ``(PIL image, label)`` (label -1 when unlabelled). An unreadable file
    is logged once, marked (in shared memory, so ``skipped_paths`` includes the workers' finds) and
    replaced by a random other sample; without ``replace_unreadable`` (:meth:`for_evaluation`: a
    stand-in would count some image twice) it is a 1x1 black image labelled -1, to be dropped."""

    def __init__(self, paths: Sequence[str], labels: Sequence[int] | None = None, replace_unreadable: bool = True) -> None:
        self.paths = list(paths)
        self.labels = _labels(len(self.paths), labels)
        self.replace_unreadable = replace_unreadable
        self._bad = torch.zeros(len(self.paths), dtype=torch.uint8).share_memory_()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        for _ in range(MAX_CONSECUTIVE_FAILURES):
            if not self._bad[index]:
                if (image := open_image(self.paths[index], self.paths[index])) is not None:
                    return image, int(self.labels[index])
                self._bad[index] = 1
            if not self.replace_unreadable:
                return Image.new("RGB", (1, 1)), -1
            index = random.randrange(len(self.paths))
        raise RuntimeError(f"{MAX_CONSECUTIVE_FAILURES} unreadable images in a row ({len(self.skipped_paths)} of {len(self)} "
                           f"marked so far, e.g. {self.skipped_paths[:3]}); the dataset looks broken")

    def subset(self, indices: torch.Tensor) -> ImageFiles:
        return ImageFiles([self.paths[i] for i in indices.tolist()], self.labels[indices], self.replace_unreadable)

    def for_evaluation(self) -> ImageFiles:
        """These files (sharing the marks of unreadable ones) with ``replace_unreadable=False``."""
        twin = copy.copy(self)
        twin.replace_unreadable = False
        return twin

    @property
    def skipped_paths(self) -> list[str]:
        """The files found unreadable so far (in this process and its workers)."""
        return [self.paths[i] for i in self._bad.nonzero().flatten().tolist()]


class TransformedDataset(Dataset):
    """``source`` items ``(PIL image, label)`` -> ``(views, label)`` (``multi_view``: a list of ``[C, H, W]``)
    or ``(image [C, H, W], label)`` through ``transform``, converted to ``in_chans`` (grey -> RGB after the
    transform: the same, at a third of the cost) and normalised; a ``SeededIndex`` seeds the draws."""

    def __init__(self, source: Any, transform: Callable[[Image.Image], Any], mean: Sequence[float], std: Sequence[float],
                 in_chans: int, multi_view: bool) -> None:
        self.source = source
        self.transform = transform
        self.in_chans = in_chans
        self.multi_view = multi_view
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)  # [C, 1, 1]
        self.inv_std = 1.0 / torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)  # [C, 1, 1]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int | SeededIndex) -> tuple[Any, int]:
        if not isinstance(index, SeededIndex):
            return self._item(index)
        # Python's `random` (augmentations, stand-ins) seeded for this sample, the caller's stream kept.
        state = random.getstate()
        random.seed(index.seed)
        try:
            return self._item(index.index)
        finally:
            random.setstate(state)

    def _item(self, index: int) -> tuple[Any, int]:
        img, label = self.source[index]
        if self.in_chans == 1 and img.mode != "L":
            img = img.convert("L")
        out = self.transform(img)
        if isinstance(out, dict):  # views made on the training device (device_views.py): normalised there
            out["canvas"] = out["canvas"].expand(-1, -1, self.in_chans)  # [S, S, C]
            return out, label
        views = [(x.expand(self.in_chans, -1, -1) - self.mean) * self.inv_std for x in (out if isinstance(out, list) else [out])]
        if self.multi_view:
            return views, label
        (image,) = views
        return image, label


class EvenShares(Dataset):
    """An evaluation split padded to a multiple of ``num_processes`` with copies of its first items
    labelled -1: every process runs as many batches (collectives), and no image counts twice as
    under the padding of Lightning's ``DistributedSampler``."""

    def __init__(self, source: Dataset, num_processes: int) -> None:
        self.source = source
        self.size = len(source)  # type: ignore[arg-type]
        self.padded = -(-self.size // num_processes) * num_processes

    def __len__(self) -> int:
        return self.padded

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if index < self.size:
            return self.source[index]
        image, _ = self.source[(index - self.size) % self.size]
        return image, -1
