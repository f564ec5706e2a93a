"""CIFAR-10 and CIFAR-100 (Krizhevsky, 2009): 50k/10k RGB 32x32 images, via torchvision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ssl_vit.data.base import ImageDataModule, default_root, torchvision_fetch_advice
from ssl_vit.data.datasets import InMemoryImages


class _TorchvisionCIFAR(ImageDataModule):
    """Shared loading of torchvision's CIFAR classes into one in-memory uint8 tensor."""

    _name = ""
    _folder = ""  # torchvision's extracted folder name

    def __init__(
        self,
        root: str | None = None,
        download: bool = True,
        img_size: int = 32,
        in_chans: int = 3,
        **kwargs,
    ) -> None:
        super().__init__(img_size=img_size, in_chans=in_chans, **kwargs)
        self.root = root
        self.download = download

    @property
    def data_root(self) -> Path:
        return Path(self.root).expanduser() if self.root is not None else default_root()

    def _dataset_class(self) -> Any:
        raise NotImplementedError

    def _not_found(self, detail: str) -> FileNotFoundError:
        return FileNotFoundError(
            f"{self._name} not found under {self.data_root} (expected {self._folder}/ there): "
            f"{detail}. {torchvision_fetch_advice(self.download, self._folder)}"
        )

    def prepare_data(self) -> None:
        if not self.download:
            return  # _load_split reports missing files
        cls = self._dataset_class()
        try:
            for train in (True, False):
                cls(str(self.data_root), train=train, download=True)
        except Exception as err:  # network errors come in many types (URLError, HTTPError, OSError)
            raise self._not_found(f"the download failed ({type(err).__name__}: {err})") from err

    def _load_split(self, train: bool) -> InMemoryImages:
        cls = self._dataset_class()
        try:
            ds = cls(str(self.data_root), train=train, download=False)
        except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
            raise self._not_found(f"torchvision says: {err}" + ("" if self.download else " (download=False)")) from err
        self.class_names = list(ds.classes)
        images = torch.from_numpy(ds.data)  # [N, 32, 32, 3] uint8
        return InMemoryImages(images, torch.as_tensor(ds.targets, dtype=torch.long))


class CIFAR10DataModule(_TorchvisionCIFAR):
    """CIFAR-10: 10 classes.

    Args:
        root: directory of torchvision's ``cifar-10-batches-py`` (downloads go there).
            None: ``$XDG_CACHE_HOME/ssl_vit`` (``~/.cache/ssl_vit``).
        download: download with torchvision when missing (needs internet).
        img_size: 32 (native) unless the backbone wants another size.
        in_chans: 3 (native); 1 converts to grey.
        **kwargs: the common arguments of ``ImageDataModule`` (views, batch_size, ...).
    """

    num_classes = 10
    # Commonly used per-channel pixel mean/std of the 50k training images.
    dataset_mean = (0.4914, 0.4822, 0.4465)
    dataset_std = (0.2470, 0.2435, 0.2616)
    _name = "CIFAR-10"
    _folder = "cifar-10-batches-py"

    def _dataset_class(self) -> Any:
        from torchvision.datasets import CIFAR10

        return CIFAR10


class CIFAR100DataModule(_TorchvisionCIFAR):
    """CIFAR-100: 100 fine-grained classes. Arguments as ``CIFAR10DataModule``
    (torchvision folder ``cifar-100-python``)."""

    num_classes = 100
    dataset_mean = (0.5071, 0.4865, 0.4409)
    dataset_std = (0.2673, 0.2564, 0.2762)
    _name = "CIFAR-100"
    _folder = "cifar-100-python"

    def _dataset_class(self) -> Any:
        from torchvision.datasets import CIFAR100

        return CIFAR100
