"""Fashion-MNIST (Xiao et al., 2017): 60k/10k grey 28x28 images of 10 clothing classes (MIT), read from
IDX files: the Debian/Ubuntu package ``dataset-fashion-mnist``'s, else torchvision's download."""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from os import PathLike
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ssl_vit.data.base import ImageDataModule, data_root, download_advice, option_hint
from ssl_vit.data.datasets import InMemoryImages

# Where `apt-get install dataset-fashion-mnist` puts the IDX files.
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")

# IDX element type byte -> numpy dtype (big-endian for multi-byte types)
_IDX_DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | PathLike[str]) -> np.ndarray:
    """An IDX file (optionally gzipped) as a numpy array of native byte order. The format (LeCun's MNIST
    page): ``00 00 TT DD`` (TT: element type; DD: number of dimensions), DD big-endian uint32 sizes,
    then the elements in C order. A corrupt, truncated or non-IDX file is a ValueError naming it."""
    path = Path(path)
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b" or path.suffix.lower() == ".gz":  # gzip's magic, whatever the name
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            raise ValueError(f"{path}: cannot read IDX file ({err}); the file is corrupt or truncated") from err
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] not in _IDX_DTYPES or data[3] == 0:
        raise ValueError(f"{path}: bad magic number 0x{int.from_bytes(data[:4], 'big'):08x}, not an IDX file "
                         "(expected 0x00000803 for images or 0x00000801 for labels)")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = struct.unpack(f">{ndim}I", data[4:header]) if len(data) >= header else ()
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    expected = math.prod(shape) * dtype.itemsize
    if len(data) < header or len(data) - header != expected:
        raise ValueError(f"{path}: header says shape {shape} ({expected} bytes of data) but the file holds {len(data) - header} bytes; "
                         "the file is truncated or not what it claims")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="), copy=False)


def read_idx_images_labels(images_path: str | PathLike[str], labels_path: str | PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """A pair of IDX files: uint8 images ``[N, H, W]`` and int64 labels ``[N]``."""
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or labels.dtype != np.uint8 or images.ndim != 3 or labels.ndim != 1:
        raise ValueError(f"{images_path}, {labels_path}: expected unsigned-byte images [N, H, W] and labels [N], "
                         f"got {images.dtype} {list(images.shape)} / {labels.dtype} {list(labels.shape)}")
    if len(images) != len(labels):
        raise ValueError(f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels")
    return images, labels.astype(np.int64)


class FashionMNISTDataModule(ImageDataModule):
    """Fashion-MNIST as one in-memory uint8 tensor (47 MB).

    Args:
        root: a directory holding the four ``*-ubyte(.gz)`` files (directly or in torchvision's
            ``FashionMNIST/raw``); downloads go there too. None: the Debian package's, else the user cache (``~/.cache/ssl_vit``).
        download: fetch the files with torchvision when they are not found (needs internet).
        img_size, in_chans, **kwargs: ``ImageDataModule``'s (native: 28 px, 1 channel).
    """

    num_classes = 10
    class_names = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
    # Pixel mean / std of the 60k training images in [0, 1].
    dataset_mean = (0.2860,)
    dataset_std = (0.3530,)

    def __init__(self, root: str | None = None, download: bool = True, img_size: int = 28, in_chans: Literal[1, 3] = 1, **kwargs) -> None:
        super().__init__(img_size=img_size, in_chans=in_chans, **kwargs)
        self.root = root
        self.download = download

    def _search_dirs(self) -> list[Path]:
        root = data_root(self.root)
        return [DEBIAN_DIR if self.root is None else root, root / "FashionMNIST" / "raw"]

    def _locate(self, train: bool) -> tuple[Path, Path] | None:
        names = [f"{'train' if train else 't10k'}-{kind}-ubyte" for kind in ("images-idx3", "labels-idx1")]
        for directory in self._search_dirs():
            found = [next((p for p in (directory / f"{name}.gz", directory / name) if p.is_file()), None) for name in names]
            if None not in found:
                return found[0], found[1]
        return None

    def prepare_data(self) -> None:
        if self._locate(True) is not None and self._locate(False) is not None:
            return
        advice = (
            f"Fashion-MNIST not found (looked in: {', '.join(map(str, self._search_dirs()))}). Get it by one of: "
            "`sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu, no download at run time); "
            f"running once with {download_advice(self.download)} (saves to {data_root(self.root)}); "
            f"or {option_hint('root', '<dir>')} holding train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
            "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz."
        )
        if not self.download:
            raise FileNotFoundError(f"{advice} (download=False)")
        from torchvision.datasets import FashionMNIST

        try:  # (either split downloads all four files)
            FashionMNIST(str(data_root(self.root)), train=False, download=True)
        except Exception as err:  # network errors come in many types (URLError, HTTPError, OSError)
            raise FileNotFoundError(f"{advice} The download failed: {type(err).__name__}: {err}") from err

    def _load_split(self, train: bool) -> InMemoryImages:
        files = self._locate(train)
        if files is None:
            self.prepare_data()  # raises the explanatory error, or downloads
            files = self._locate(train)
        images, labels = read_idx_images_labels(*files)
        if images.shape[1:] != (28, 28):
            raise ValueError(f"{files[0]}: expected 28x28 images, got shape {images.shape}")
        if labels.max() >= self.num_classes:
            raise ValueError(f"{files[1]}: labels outside 0..9")
        return InMemoryImages(torch.from_numpy(images.copy()), torch.from_numpy(labels))
