"""CIFAR-10 / CIFAR-100 (Krizhevsky, 2009: 50k/10k RGB 32x32 images) and STL-10 (Coates et al., 2011: 96x96
RGB, 5k/8k labelled images and 100k unlabelled ones), read with torchvision and held in memory as uint8."""

from __future__ import annotations

from typing import Any, Literal

import torch

from ssl_vit.data.base import ImageDataModule, data_root, download_advice, option_hint
from ssl_vit.data.datasets import InMemoryImages


class _TorchvisionDataModule(ImageDataModule):
    """A dataset of ``torchvision.datasets``: its ``root`` and ``download``, its missing files explained.

    Args:
        root: directory of torchvision's extracted folder (downloads go there); None: the user cache (``~/.cache/ssl_vit``).
        download: download with torchvision when missing (needs internet).
        img_size, in_chans, **kwargs: ``ImageDataModule``'s (native: the dataset's size, 3 channels).
    """

    _name = _class = _folder = ""  # the dataset's name in messages, its torchvision.datasets class and extracted folder
    _download_split: dict[str, Any] = {"train": False}  # (any split downloads the whole archive)

    def __init__(self, root: str | None = None, download: bool = True, img_size: int = 32, in_chans: Literal[1, 3] = 3, **kwargs) -> None:
        super().__init__(img_size=img_size, in_chans=in_chans, **kwargs)
        self.root = root
        self.download = download

    def _not_found(self, detail: str) -> FileNotFoundError:
        return FileNotFoundError(
            f"{self._name} not found under {data_root(self.root)} (expected {self._folder}/ there): {detail}. "
            f"Run once with {download_advice(self.download)}, or pass {option_hint('root', '<dir>')} containing torchvision's {self._folder}/ folder."
        )

    def prepare_data(self) -> None:
        if not self.download:
            return  # _read explains missing files
        try:
            self._read(download=True, **self._download_split)
        except Exception as err:  # network errors come in many types (URLError, HTTPError, OSError)
            raise self._not_found(f"the download failed ({type(err).__name__}: {err})") from err

    def _read(self, download: bool = False, **split: Any) -> Any:
        import torchvision.datasets

        try:
            ds = getattr(torchvision.datasets, self._class)(str(data_root(self.root)), download=download, **split)
        except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
            if download:
                raise  # (prepare_data: the download failed)
            raise self._not_found(f"torchvision says: {err}" + ("" if self.download else " (download=False)")) from err
        if getattr(ds, "classes", None):  # (STL-10's only when its class_names.txt is there)
            self.class_names = list(ds.classes)
        return ds

    def _load_split(self, train: bool) -> InMemoryImages:  # CIFAR's layout
        ds = self._read(train=train)
        return InMemoryImages(torch.from_numpy(ds.data), torch.as_tensor(ds.targets))  # [N, 32, 32, 3]


class CIFAR10DataModule(_TorchvisionDataModule):
    """CIFAR-10: 10 classes. Arguments: see ``_TorchvisionDataModule``."""

    num_classes = 10
    # The commonly used per-channel pixel mean / std of the training images (CIFAR-100's and STL-10's alike).
    dataset_mean = (0.4914, 0.4822, 0.4465)
    dataset_std = (0.2470, 0.2435, 0.2616)
    _name, _class, _folder = "CIFAR-10", "CIFAR10", "cifar-10-batches-py"


class CIFAR100DataModule(_TorchvisionDataModule):
    """CIFAR-100: 100 fine-grained classes."""

    num_classes = 100
    dataset_mean = (0.5071, 0.4865, 0.4409)
    dataset_std = (0.2673, 0.2564, 0.2762)
    _name, _class, _folder = "CIFAR-100", "CIFAR100", "cifar-100-python"


class STL10DataModule(_TorchvisionDataModule):
    """STL-10 (the unlabelled split is 2.8 GB in memory; the download 2.6 GB).

    Args:
        train_split: images to pretrain on: 'train' (5k labelled), 'unlabeled' (100k, labels -1) or
            'train+unlabeled'; the evaluations read the labelled 'train' and 'test' splits.
        img_size: 96 (native) unless the backbone wants another size.
        root, download, in_chans, **kwargs: as ``CIFAR10DataModule``.
    """

    num_classes = 10
    dataset_mean = (0.4467, 0.4398, 0.4066)
    dataset_std = (0.2603, 0.2566, 0.2713)
    _name, _class, _folder = "STL-10", "STL10", "stl10_binary"
    _download_split = {"split": "test"}

    def __init__(self, root: str | None = None, download: bool = True, train_split: Literal["train", "unlabeled", "train+unlabeled"] = "train",
                 img_size: int = 96, in_chans: Literal[1, 3] = 3, **kwargs) -> None:
        super().__init__(root=root, download=download, img_size=img_size, in_chans=in_chans, **kwargs)
        self.train_split = train_split
        self._labelled_train: InMemoryImages | None = None

    def _load_split(self, train: bool, split: str | None = None) -> InMemoryImages:
        ds = self._read(split=split or (self.train_split if train else "test"))
        images = torch.from_numpy(ds.data).permute(0, 2, 3, 1)  # [N, 3, 96, 96] -> [N, 96, 96, 3]
        return InMemoryImages(images, torch.as_tensor(ds.labels))

    def _labelled_train_source(self) -> InMemoryImages:
        # Probes need labels: they read the labelled 'train' split, not the pretraining images.
        if self.train_split == "train":
            return self._train_source
        if self._labelled_train is None:
            self._labelled_train = self._load_split(True, split="train")
        return self._labelled_train
