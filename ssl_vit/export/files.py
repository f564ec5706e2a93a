"""Reading weight files with one-line errors, and writing files atomically.

Every reader names the file and what was expected when it fails, because "KeyError: '101'" (what
``torch.load`` says about a text file) or a 20-line pickling explanation helps nobody. Every writer
goes through a temporary file in the target's folder, ``fsync`` and ``os.replace``, so an export
folder never holds half a file, even when the job is killed mid-write.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ssl_vit.io import _default_permissions, atomic_write, atomic_write_bytes, atomic_write_json  # noqa: F401  (re-exported)

EXPECTED = (
    "a pretraining checkpoint (.ckpt written by `ssl-vit fit`), an export directory "
    "(config.json + model.safetensors) or a state dict (.safetensors / .pt / .pth)"
)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def first_line(err: BaseException | str, limit: int = 200) -> str:
    """The first line of an error message, without terminal colour codes."""
    text = _ANSI.sub("", str(err)).strip()
    first = text.splitlines()[0].strip() if text else type(err).__name__
    return first if len(first) <= limit else first[: limit - 3] + "..."


# ------------------------------------------------------------------------------------ reading
def sniff(path: Path) -> str:
    """What a file holds, judged from its first bytes: ``zip`` (``torch.save``), ``pickle``
    (legacy ``torch.save``), ``safetensors``, ``empty``, ``text`` or ``unknown``."""
    with open(path, "rb") as f:
        head = f.read(512)
    size = path.stat().st_size
    if not head:
        return "empty"
    if head[:4] == b"PK\x03\x04":
        return "zip"
    if head[0] == 0x80:  # pickle protocol marker
        return "pickle"
    # safetensors: little-endian u64 header length, then the JSON header (safetensors format spec)
    if len(head) > 8 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size:
        return "safetensors"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return "unknown"
    return "unknown" if "\x00" in text else "text"


def check_exists(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory; expected {EXPECTED}")


def read_torch_file(path: Path, map_location: Any = "cpu", weights_only: bool | None = None) -> Any:
    """``torch.load`` with clear errors.

    ``weights_only=None`` tries the safe loader first and falls back to full unpickling (with a
    warning) only for files that hold Python objects besides tensors, as some Lightning and
    official research checkpoints do (argparse namespaces). ``True`` never unpickles code.
    """
    kind = sniff(path)
    if kind in ("empty", "text", "unknown", "safetensors"):
        what = {"empty": "an empty file", "text": "a text file", "unknown": "not a PyTorch file"}.get(kind, "a safetensors file")
        raise ValueError(f"{path}: {what}; expected {EXPECTED}")
    try:
        if weights_only is not False:
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only" not in str(err).lower():
            raise ValueError(f"{path}: corrupt PyTorch file ({first_line(err)}); expected {EXPECTED}") from None
        if weights_only:
            raise ValueError(
                f"{path}: holds Python objects besides tensors, which weights_only=True refuses to unpickle "
                "(load it with weights_only=False if you trust the file)"
            ) from None
    except Exception as err:  # a cut file fails anywhere in the loader (EOFError, struct.error, RuntimeError ...)
        raise ValueError(
            f"{path}: cannot be read as a PyTorch file, it is probably truncated or corrupt ({first_line(err)}); "
            f"expected {EXPECTED}"
        ) from None
    if weights_only is None:
        warnings.warn(
            f"{path} holds Python objects besides tensors; loading it with full unpickling "
            "(weights_only=False). Only do this with files you trust.",
            stacklevel=3,
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:  # unpickling can fail in any way (missing modules, corrupt data)
        raise ValueError(f"{path}: cannot be unpickled ({first_line(err)}); expected {EXPECTED}") from None


def read_safetensors(path: Path, device: str = "cpu") -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable safetensors file, probably truncated or corrupt ({first_line(err)})") from None


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({first_line(err)})") from None


# ------------------------------------------------------------------------------------ writing
def save_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Tensors to ``path`` in safetensors format (contiguous CPU copies; ``format: pt`` metadata,
    which timm and Hugging Face loaders expect)."""
    from safetensors.torch import save

    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return atomic_write_bytes(path, save(flat, metadata={"format": "pt", **(metadata or {})}))


@contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """A temporary folder inside ``out_dir`` for writers that need a real path (TorchScript,
    ONNX): files are checked there and then moved into place with :func:`publish`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir))
    try:
        yield tmp
    except OSError as err:
        # "cannot write <out_dir>/model.onnx", not the staging folder's name, gone right after
        staged, final = str(tmp), str(out_dir)
        if staged not in f"{err.strerror} {err.filename}":
            raise

        def moved(name: Any) -> Any:
            return None if name is None else str(name).replace(staged, final)

        raise OSError(err.errno, str(err.strerror).replace(staged, final), moved(err.filename), None, moved(err.filename2)) from err
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def publish(staged: Path, out_dir: Path) -> list[Path]:
    """fsync every file of a staging folder and rename it into ``out_dir`` (one ``os.replace``
    per file; the ONNX weights file, if any, keeps its relative name)."""
    moved = []
    for f in sorted(staged.iterdir()):
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
        _default_permissions(f)
        os.replace(f, out_dir / f.name)
        moved.append(out_dir / f.name)
    return moved
