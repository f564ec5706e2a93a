"""Fashion-MNIST (Xiao et al., 2017): 60k/10k grey 28x28 images of 10 clothing classes (MIT).

Read from the IDX files of the Debian/Ubuntu package ``dataset-fashion-mnist`` when it is
installed; otherwise from torchvision's download into the user cache directory (or ``root``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ssl_vit.data.base import ImageDataModule, default_root, download_advice, option_hint
from ssl_vit.data.datasets import InMemoryImages
from ssl_vit.data.idx import read_idx_images_labels

# Where `apt-get install dataset-fashion-mnist` puts the IDX files.
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")

_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _find_split(directory: Path, train: bool) -> tuple[Path, Path] | None:
    found = []
    for name in _FILES[train]:
        for candidate in (directory / f"{name}.gz", directory / name):
            if candidate.is_file():
                found.append(candidate)
                break
        else:
            return None
    return found[0], found[1]


class FashionMNISTDataModule(ImageDataModule):
    """Fashion-MNIST as one in-memory uint8 tensor (47 MB).

    Args:
        root: a directory holding the four ``*-ubyte(.gz)`` files (directly or in torchvision's
            ``FashionMNIST/raw`` layout); downloads go there too. None: the Debian package's files
            if installed, else ``$XDG_CACHE_HOME/ssl_vit`` (``~/.cache/ssl_vit``).
        download: fetch the files with torchvision when they are not found (needs internet).
        img_size: 28 (native) unless the backbone wants another size.
        in_chans: 1 (native); 3 repeats the grey channel.
        **kwargs: the common arguments of ``ImageDataModule`` (views, batch_size, ...).
    """

    num_classes = 10
    class_names = [
        "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
        "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
    ]
    # Pixel mean/std of the 60k training images in [0, 1], computed once from the IDX files
    # (0.28604, 0.35302).
    dataset_mean = (0.2860,)
    dataset_std = (0.3530,)

    def __init__(
        self,
        root: str | None = None,
        download: bool = True,
        img_size: int = 28,
        in_chans: int = 1,
        **kwargs,
    ) -> None:
        super().__init__(img_size=img_size, in_chans=in_chans, **kwargs)
        self.root = root
        self.download = download

    def _search_dirs(self) -> list[Path]:
        if self.root is not None:
            root = Path(self.root).expanduser()
            return [root, root / "FashionMNIST" / "raw"]
        return [DEBIAN_DIR, default_root() / "FashionMNIST" / "raw"]

    def _download_root(self) -> Path:
        return Path(self.root).expanduser() if self.root is not None else default_root()

    def _locate(self, train: bool) -> tuple[Path, Path] | None:
        for directory in self._search_dirs():
            files = _find_split(directory, train)
            if files is not None:
                return files
        return None

    def prepare_data(self) -> None:
        if self._locate(True) is not None and self._locate(False) is not None:
            return
        looked = ", ".join(str(d) for d in self._search_dirs())
        help_ = (
            f"Fashion-MNIST not found (looked in: {looked}). Get it by one of: "
            "`sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu, no download at run time); "
            f"running once with {download_advice(self.download)} (saves to {self._download_root()}); "
            f"or {option_hint('root', '<dir>')} holding train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
            "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz."
        )
        if not self.download:
            raise FileNotFoundError(help_ + " (download=False)")
        from torchvision.datasets import FashionMNIST

        try:
            for train in (True, False):
                FashionMNIST(str(self._download_root()), train=train, download=True)
        except Exception as err:  # network errors come in many types (URLError, HTTPError, OSError)
            raise FileNotFoundError(f"{help_} The download failed: {type(err).__name__}: {err}") from err

    def _load_split(self, train: bool) -> InMemoryImages:
        files = self._locate(train)
        if files is None:
            self.prepare_data()  # raises the explanatory error, or downloads
            files = self._locate(train)
            assert files is not None
        images, labels = read_idx_images_labels(*files)
        if images.shape[1:] != (28, 28):
            raise ValueError(f"{files[0]}: expected 28x28 images, got shape {images.shape}")
        if labels.min() < 0 or labels.max() >= self.num_classes:
            raise ValueError(f"{files[1]}: labels outside 0..9")
        return InMemoryImages(torch.from_numpy(images.copy()), torch.from_numpy(labels))
