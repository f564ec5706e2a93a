"""Atomic file writes: a reader, or a job killed mid-write, sees the old file or the new one,
never half of one. Checkpoints, exports and result records all go through here.

The data goes to a temporary file in the target's directory (same filesystem), is fsynced, and
is renamed over the target with ``os.replace``, which POSIX makes atomic.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
        with writing(path):
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        _default_permissions(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself survives a power loss
    return path


@contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[None]:
    """Name ``path`` in an ``OSError`` of a write that names no file (a full disk, a quota: the
    write to an open file fails), as ``[Errno 28] cannot write PATH: No space left on device``."""
    try:
        yield
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        raise OSError(err.errno, f"cannot write {path}: {err.strerror}") from err


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def stale_temporaries(folder: str | os.PathLike[str], suffix: str = "") -> list[Path]:
    """Temporary files :func:`atomic_write` left in ``folder`` when its process was killed
    mid-write (``.<name>.<random>.tmp``; with ``suffix``, only those of ``*<suffix>`` targets).
    Never a complete file: the rename did not happen."""
    return sorted(p for p in Path(folder).glob(f".*{suffix}.*.tmp") if p.is_file())


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
    """``torch.save`` through :func:`atomic_write`.

    Written through a Python file: a write that fails (a full disk, a quota) then raises the
    ``OSError`` that says so, naming ``path``; ``torch.save`` to a file name reports only its C++
    stream's ``basic_ios::clear: iostream error``."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            try:
                torch.save(obj, f)
            except RuntimeError as err:
                cause = _os_error_behind(err)
                if cause is None:
                    raise
                raise OSError(cause.errno, cause.strerror) from err  # (atomic_write names the file)

    return atomic_write(path, write)


def _os_error_behind(err: BaseException) -> OSError | None:
    """The ``OSError`` of a failed ``write`` that torch's serializer turned into a RuntimeError."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None
