"""STL-10 (Coates et al., 2011): 96x96 RGB, 5k labelled train / 8k test images of 10 classes and
100k unlabelled images for self-supervised pretraining, via torchvision."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from ssl_vit.data.base import ImageDataModule, default_root, torchvision_fetch_advice
from ssl_vit.data.datasets import InMemoryImages


class STL10DataModule(ImageDataModule):
    """STL-10 held in memory as uint8 (the unlabelled split is 2.8 GB).

    Args:
        root: directory of torchvision's ``stl10_binary`` (downloads go there).
            None: ``$XDG_CACHE_HOME/ssl_vit`` (``~/.cache/ssl_vit``).
        download: download with torchvision when missing (needs internet; 2.6 GB).
        train_split: images to pretrain on: 'train' (5k labelled), 'unlabeled' (100k, labels -1)
            or 'train+unlabeled'. ``eval_datasets()`` always uses the labelled 'train' and 'test'
            splits, so probes never see label -1.
        img_size: 96 (native) unless the backbone wants another size.
        in_chans: 3 (native); 1 converts to grey.
        **kwargs: the common arguments of ``ImageDataModule`` (views, batch_size, ...).
    """

    num_classes = 10
    # Commonly used per-channel pixel mean/std of STL-10.
    dataset_mean = (0.4467, 0.4398, 0.4066)
    dataset_std = (0.2603, 0.2566, 0.2713)

    def __init__(
        self,
        root: str | None = None,
        download: bool = True,
        train_split: Literal["train", "unlabeled", "train+unlabeled"] = "train",
        img_size: int = 96,
        in_chans: int = 3,
        **kwargs,
    ) -> None:
        if train_split not in ("train", "unlabeled", "train+unlabeled"):
            raise ValueError(f"train_split must be 'train', 'unlabeled' or 'train+unlabeled', got {train_split!r}")
        super().__init__(img_size=img_size, in_chans=in_chans, **kwargs)
        self.root = root
        self.download = download
        self.train_split = train_split
        self._labelled_train: InMemoryImages | None = None

    @property
    def data_root(self) -> Path:
        return Path(self.root).expanduser() if self.root is not None else default_root()

    def _not_found(self, detail: str) -> FileNotFoundError:
        return FileNotFoundError(
            f"STL-10 not found under {self.data_root} (expected stl10_binary/ there): {detail}. "
            f"{torchvision_fetch_advice(self.download, 'stl10_binary')}"
        )

    def prepare_data(self) -> None:
        if not self.download:
            return
        from torchvision.datasets import STL10

        try:
            STL10(str(self.data_root), split="test", download=True)  # downloads the whole archive
        except Exception as err:  # network errors come in many types
            raise self._not_found(f"the download failed ({type(err).__name__}: {err})") from err

    def _read(self, split: str) -> InMemoryImages:
        from torchvision.datasets import STL10

        try:
            ds = STL10(str(self.data_root), split=split, download=False)
        except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
            raise self._not_found(f"torchvision says: {err}" + ("" if self.download else " (download=False)")) from err
        if getattr(ds, "classes", None):
            self.class_names = list(ds.classes)
        images = torch.from_numpy(ds.data).permute(0, 2, 3, 1)  # [N, 3, 96, 96] -> [N, 96, 96, 3]
        return InMemoryImages(images.contiguous(), torch.as_tensor(ds.labels, dtype=torch.long))

    def _load_split(self, train: bool) -> InMemoryImages:
        return self._read(self.train_split if train else "test")

    def eval_datasets(self, replace_unreadable: bool = False, train_views=None):
        if self.train_split == "train":
            return super().eval_datasets(replace_unreadable, train_views)
        # Probes need labels: evaluate on the labelled train split, not the pretraining images.
        _, test = super().eval_datasets(replace_unreadable)
        if self._labelled_train is None:
            self._labelled_train = self._read("train")
        return self._wrap(self._labelled_train, self._train_eval_transform(train_views), multi_view=False), test
