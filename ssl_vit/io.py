"""Atomic file writes: a reader, or a job killed mid-write, sees the old file or the new one,
never half of one. Checkpoints, exports and result records all go through here.

The data goes to a temporary file in the target's directory (same filesystem), is fsynced, and
is renamed over the target with ``os.replace``, which POSIX makes atomic.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def _default_permissions(path: Path) -> None:
    # mkstemp creates 0600 files; give them what a plain open() would (0666 minus the umask).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a temporary path beside ``path``, fsync it, rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        _default_permissions(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _jsonable(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | frozenset):
        return sorted(value)
    return str(value)  # dtypes, enums, namespaces: recorded by name


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, default=_jsonable) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` through :func:`atomic_write`."""
    return atomic_write(path, lambda tmp: torch.save(obj, tmp))
