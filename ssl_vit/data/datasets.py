"""Dataset building blocks shared by the datamodules.

* ``InMemoryImages`` — a whole dataset as one uint8 tensor (cheap to hand to workers).
* ``ImageFiles``     — images decoded from files; unreadable ones are skipped, logged and counted.
* ``TransformedDataset`` — applies a view transform (training) or the evaluation transform,
  converts channels and normalises; what the dataloaders and evaluators iterate over. Indexed with
  a ``SeededIndex`` (the training sampler's items), an item's random augmentations are drawn from
  its own seed.
"""

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

# A file that fails to decode is replaced by another sample; give up (it is not a few bad files
# but a broken dataset) after this many failures in a row.
_MAX_CONSECUTIVE_FAILURES = 100


class InMemoryImages(Dataset):
    """uint8 images ``[N, H, W]`` (grey) or ``[N, H, W, 3]`` (RGB) with int64 labels ``[N]``
    (-1 where unlabelled). Items are ``(PIL image, label)``.

    One contiguous tensor pickles to DataLoader workers as a single buffer (or is shared by fork)
    instead of N Python objects.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        if images.dtype != torch.uint8:
            raise TypeError(f"images must be a uint8 tensor, got {images.dtype}")
        if images.ndim == 4 and images.shape[-1] == 1:
            images = images[..., 0]
        if not (images.ndim == 3 or (images.ndim == 4 and images.shape[-1] == 3)):
            raise ValueError(f"images must be [N, H, W] or [N, H, W, 3], got {tuple(images.shape)}")
        if labels is None:
            labels = torch.full((len(images),), -1, dtype=torch.long)
        labels = torch.as_tensor(labels, dtype=torch.long)
        if labels.shape != (len(images),):
            raise ValueError(f"{len(images)} images but labels of shape {tuple(labels.shape)}")
        self.images = images.contiguous()
        self.labels = labels
        self.mode = "L" if images.ndim == 3 else "RGB"

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[index].numpy(), self.mode), int(self.labels[index])

    def subset(self, indices: torch.Tensor) -> InMemoryImages:
        # A compact copy, so workers receive only the subset.
        return InMemoryImages(self.images[indices], self.labels[indices])

    @property
    def num_skipped(self) -> int:
        return 0

    @property
    def skipped_paths(self) -> list[str]:
        return []


class ImageFiles(Dataset):
    """Images read from files, items ``(PIL image, label)`` (label -1 when unlabelled).

    A file that cannot be decoded (corrupt, truncated, not an image) is logged once with its path,
    marked, and replaced by a random other sample, so a few bad files never stop a run. The marks
    live in a shared-memory tensor, so ``num_skipped`` / ``skipped_paths`` read in the main
    process include what the DataLoader workers found.

    For evaluation a stand-in would count some image twice (and shift the accuracy), so
    :meth:`for_evaluation` returns the same files with ``replace_unreadable=False``: an unreadable
    file is then a 1x1 black image labelled -1, which the evaluators and the online probe drop.
    """

    def __init__(self, paths: Sequence[str], labels: Sequence[int] | None = None, replace_unreadable: bool = True) -> None:
        if len(paths) == 0:
            raise ValueError("ImageFiles needs at least one file")
        self.paths = list(paths)
        if labels is None:
            self.labels = torch.full((len(self.paths),), -1, dtype=torch.long)
        else:
            if len(labels) != len(self.paths):
                raise ValueError(f"{len(self.paths)} files but {len(labels)} labels")
            self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.replace_unreadable = replace_unreadable
        self._bad = torch.zeros(len(self.paths), dtype=torch.uint8).share_memory_()

    def __len__(self) -> int:
        return len(self.paths)

    def _decode(self, path: str) -> Image.Image:
        # load() raises OSError on truncated data (unless PIL.ImageFile.LOAD_TRUNCATED_IMAGES was
        # switched on, in which case the missing part comes back grey, as the user asked).
        with Image.open(path) as img:
            img.load()
            return to_pil(img)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        for _ in range(_MAX_CONSECUTIVE_FAILURES):
            if not self._bad[index]:
                path = self.paths[index]
                try:
                    return self._decode(path), int(self.labels[index])
                except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
                    self._bad[index] = 1
                    log.warning("skipping unreadable image %s (%s: %s)", path, type(err).__name__, err)
            if not self.replace_unreadable:
                return Image.new("RGB", (1, 1)), -1
            index = random.randrange(len(self.paths))
        raise RuntimeError(
            f"{_MAX_CONSECUTIVE_FAILURES} unreadable images in a row ({self.num_skipped} of "
            f"{len(self)} marked so far, e.g. {self.skipped_paths[:3]}); the dataset looks broken"
        )

    def subset(self, indices: torch.Tensor) -> ImageFiles:
        idx = indices.tolist()
        return ImageFiles([self.paths[i] for i in idx], self.labels[indices].tolist(), self.replace_unreadable)

    def for_evaluation(self) -> ImageFiles:
        """These files (sharing the marks of unreadable ones) with ``replace_unreadable=False``."""
        twin = copy.copy(self)
        twin.replace_unreadable = False
        return twin

    @property
    def num_skipped(self) -> int:
        """Number of files found unreadable so far (in this process and its workers)."""
        return int(self._bad.sum())

    @property
    def skipped_paths(self) -> list[str]:
        return [self.paths[i] for i in self._bad.nonzero().flatten().tolist()]


class TransformedDataset(Dataset):
    """``source`` items ``(PIL image, label)`` -> ``(views, label)`` or ``(image, label)``.

    ``transform`` returns un-normalised float tensors in [0, 1]: a list of views (``multi_view``)
    or one tensor. Here the image is converted to ``in_chans`` (RGB -> grey by luma before the
    transform; grey -> RGB by repeating the channel after it, which is the same result at a third
    of the cost since colour jitter does nothing to grey pixels) and normalised with mean/std.
    """

    def __init__(
        self,
        source: Any,
        transform: Callable[[Image.Image], Any],
        mean: Sequence[float],
        std: Sequence[float],
        in_chans: int,
        multi_view: bool,
    ) -> None:
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 or 3, got {in_chans}")
        if len(mean) != in_chans or len(std) != in_chans:
            raise ValueError(f"mean/std need {in_chans} values, got {list(mean)} / {list(std)}")
        self.source = source
        self.transform = transform
        self.in_chans = in_chans
        self.multi_view = multi_view
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)  # [C, 1, 1]
        self.inv_std = 1.0 / torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)  # [C, 1, 1]

    def __len__(self) -> int:
        return len(self.source)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        # x: [c, H, W] in [0, 1] with c = 1 or in_chans
        if x.shape[0] != self.in_chans:
            x = x.expand(self.in_chans, -1, -1)
        return (x - self.mean) * self.inv_std  # [C, H, W]

    def __getitem__(self, index: int | SeededIndex) -> tuple[Any, int]:
        if not isinstance(index, SeededIndex):
            return self._item(index)
        # The augmentations (and the stand-in for an unreadable file) draw from Python's `random`:
        # seed it for this sample, and leave the caller's stream as it was.
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
        if self.multi_view:
            return [self._normalise(v) for v in out], label
        return self._normalise(out), label


class EvenShares(Dataset):
    """An evaluation split padded to a multiple of ``num_processes`` with unlabelled (label -1)
    copies of its items from the first on (round again when the split is smaller than the padding).

    ``DistributedSampler(shuffle=False)``, which Lightning puts under a validation loader, pads
    each process's share with repeats of the first images, which the metrics would then count
    twice. Padded here instead, every process still runs the same number of batches (an FSDP
    forward and the stop-signal check are collectives of all processes), and the padding,
    labelled -1, counts nowhere: the metrics are means over labelled images, summed with their
    number over processes and divided once (``BaseMethod.on_validation_epoch_end``).
    """

    def __init__(self, source: Dataset, num_processes: int) -> None:
        if num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        self.source = source
        self.size = len(source)  # type: ignore[arg-type]
        self.padded = -(-self.size // num_processes) * num_processes if self.size else 0

    def __len__(self) -> int:
        return self.padded

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if index < self.size:
            return self.source[index]
        image, _ = self.source[(index - self.size) % self.size]
        return image, -1
