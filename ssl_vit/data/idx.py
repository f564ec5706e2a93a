"""A small reader for the IDX format of (Fashion-)MNIST.

Layout (LeCun's MNIST page): a 4-byte magic number ``00 00 TT DD`` (TT: element type, 0x08 =
unsigned byte; DD: number of dimensions), then DD big-endian uint32 sizes, then the elements in
C order. Image files are 0x00000803 ([N, rows, cols]), label files 0x00000801 ([N]). Files may be
gzip-compressed (``.gz``).
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from os import PathLike
from pathlib import Path

import numpy as np

# element type byte -> numpy dtype (big-endian for multi-byte types)
_IDX_DTYPES: dict[int, str] = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | PathLike[str], expected_ndim: int | None = None) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into a numpy array of native byte order.

    Raises ValueError naming the file when the magic number, the number of dimensions or the
    size of the payload is wrong, and when the gzip stream is corrupt or truncated.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
        if data[:2] == b"\x1f\x8b" or path.suffix.lower() == ".gz":  # gzip's magic, whatever the name
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(f"{path}: cannot read IDX file ({err}); the file is corrupt or truncated") from err

    if len(data) < 4:
        raise ValueError(f"{path}: too short to be an IDX file ({len(data)} bytes)")
    magic = int.from_bytes(data[:4], "big")
    type_code, ndim = data[2], data[3]
    if data[:2] != b"\x00\x00" or type_code not in _IDX_DTYPES or ndim == 0:
        raise ValueError(
            f"{path}: bad magic number 0x{magic:08x}, not an IDX file "
            "(expected 0x00000803 for images or 0x00000801 for labels)"
        )
    if expected_ndim is not None and ndim != expected_ndim:
        raise ValueError(
            f"{path}: magic number 0x{magic:08x} says {ndim} dimensions, expected {expected_ndim} "
            f"(magic 0x{0x0800 | expected_ndim:08x})"
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = math.prod(shape) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(
            f"{path}: header says shape {shape} ({expected} bytes of data) but the file holds "
            f"{len(data) - header} bytes; the file is truncated or not what it claims"
        )
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return array.astype(dtype.newbyteorder("="), copy=False)


def read_idx_images_labels(
    images_path: str | PathLike[str], labels_path: str | PathLike[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Read a pair of IDX files: uint8 images ``[N, H, W]`` and int64 labels ``[N]``."""
    images = read_idx(images_path, expected_ndim=3)
    labels = read_idx(labels_path, expected_ndim=1)
    if images.dtype != np.uint8 or labels.dtype != np.uint8:
        raise ValueError(
            f"{images_path}, {labels_path}: expected unsigned-byte IDX files, got {images.dtype} / {labels.dtype}"
        )
    if len(images) != len(labels):
        raise ValueError(
            f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels"
        )
    if len(images) == 0:
        raise ValueError(f"{images_path}: holds no images")
    return images, labels.astype(np.int64)
