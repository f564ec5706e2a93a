"""Any folder of images: an ImageFolder tree (one subfolder per class) or a flat folder of unlabelled images."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Literal

from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from ssl_vit.data.base import ImageDataModule
from ssl_vit.data.datasets import ImageFiles

log = logging.getLogger(__name__)


def scan_image_dir(directory: str | Path, class_to_idx: dict[str, int] | None = None) -> tuple[list[str], list[int] | None, dict[str, int] | None]:
    """The images under ``directory``: ``(paths, labels, class_to_idx)``. Class subfolders (searched
    recursively; hidden folders are none) give labels; without any, the images directly in ``directory``
    come unlabelled (labels and class_to_idx None). ``class_to_idx`` (the training folder's) labels a
    validation folder alike. Extensions match in any case."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"image directory {root} does not exist or is not a directory")
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    subdirs = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    top_files = [e.path for e in entries if e.is_file() and e.name.lower().endswith(IMG_EXTENSIONS)]
    if subdirs:
        if class_to_idx is None:
            class_to_idx = {name: i for i, name in enumerate(subdirs)}
        elif unknown := sorted(set(subdirs) - set(class_to_idx)):
            raise ValueError(f"{root} has class folders not in the training folder: {unknown[:10]}")
        samples = make_dataset(str(root), {c: i for c, i in class_to_idx.items() if c in subdirs}, extensions=IMG_EXTENSIONS, allow_empty=True)
        if samples:
            if top_files:
                log.warning("%s: ignoring %d images outside the class folders", root, len(top_files))
            return [p for p, _ in samples], [y for _, y in samples], class_to_idx
    if top_files:
        return top_files, None, None
    raise FileNotFoundError(f"no images found in {root} (neither directly nor in class subfolders; extensions: {', '.join(IMG_EXTENSIONS)})")


class FolderLike(ImageDataModule):
    """A ``train_dir`` (and a ``val_dir`` or None) of one's own images, image folders or shards: their
    classes are the training split's ``class_names`` (None: unlabelled), their statistics measured."""

    dataset_mean = dataset_std = None  # measured on the data (ImageDataModule.measure_statistics)

    @property
    def num_classes(self) -> int | None:  # type: ignore[override]
        return None if self.class_names is None else len(self.class_names)

    def has_labelled_test_split(self) -> bool:
        return self.val_dir is not None and self.num_classes is not None


class ImageFolderDataModule(FolderLike):
    """Images decoded from files on the fly; unreadable files are skipped, logged and counted.

    Args:
        train_dir: an ImageFolder tree (``train_dir/<class>/<image>``), or a flat folder of images
            for label-free pretraining (labels -1, ``num_classes`` None).
        val_dir: the evaluation split in the same layout (classes matched by folder name); None: none.
        img_size, in_chans, **kwargs: ``ImageDataModule``'s (mean / std: measured unless given).
    """

    def __init__(self, train_dir: str, val_dir: str | None = None, img_size: int = 224, in_chans: Literal[1, 3] = 3, **kwargs) -> None:
        super().__init__(img_size=img_size, in_chans=in_chans, **kwargs)
        self.train_dir, self.val_dir = train_dir, val_dir

    @functools.cached_property
    def _train_files(self) -> tuple[list[str], list[int] | None, dict[str, int] | None]:
        return scan_image_dir(self.train_dir)

    @property
    def class_names(self) -> list[str] | None:  # type: ignore[override]
        classes = self._train_files[2]
        return None if classes is None else list(classes)  # (in index order)

    def _load_split(self, train: bool) -> ImageFiles | None:
        classes = self._train_files[2]
        if train:
            return ImageFiles(*self._train_files[:2])
        if self.val_dir is None:
            return None
        paths, labels, _ = scan_image_dir(self.val_dir, classes)
        if classes is not None and labels is None:
            raise ValueError(f"{self.train_dir} has class folders but {self.val_dir} does not")
        return ImageFiles(paths, labels)
