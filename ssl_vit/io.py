"""Atomic writes and one-line reads. A reader, or a job killed mid-write, sees the old file or the
new one, never half of one: the data goes to a temporary file in the target's folder (the same
filesystem), is fsynced and renamed over the target with ``os.replace``, which POSIX makes atomic."""

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ssl_vit.errors import one_line


@contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[None]:
    """Name ``path`` in the error of a failed write, ``[Errno 28] cannot write PATH: No space left on
    device`` (the error of a full disk names no file; torch's C++ writers wrap it in a RuntimeError)."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        cause = err if isinstance(err, OSError) else err.__cause__ or err.__context__
        if not isinstance(cause, OSError) or cause.filename is not None or cause.errno is None:
            raise
        raise OSError(cause.errno, f"cannot write {path}: {cause.strerror}") from err


def _settle(path: Path) -> None:
    """fsync ``path`` and give it the permissions a plain ``open()`` would (mkstemp makes 0600)."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a temporary path beside ``path``, fsync it, rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with writing(path):
            write(Path(tmp))
            _settle(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)  # the rename itself survives a power loss
    os.fsync(folder)
    os.close(folder)
    return path


def stale_temporaries(folder: str | os.PathLike[str], suffix: str = "") -> list[Path]:
    """What writes killed mid-way left in ``folder`` (``suffix``: of ``*<suffix>`` targets only)."""
    return sorted(p for p in Path(folder).glob(f".*{suffix}.*.tmp") if p.is_file())


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Tensors as lists, sets sorted (a stable file), anything else by name (paths, dtypes)."""
    default = lambda v: v.tolist() if isinstance(v, torch.Tensor) else sorted(v) if isinstance(v, set | frozenset) else str(v)  # noqa: E731
    return atomic_write_text(path, json.dumps(obj, indent=2, default=default) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` into a Python file, whose failed write :func:`writing` names."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    return atomic_write(path, write)


@contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """A hidden folder in ``out_dir`` for writers that need a path (TorchScript, ONNX and its side
    file): what they wrote is fsynced and renamed into ``out_dir`` when the block ends without an
    error, and the folder removed. An ``OSError`` names the file where it would have been."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".staging-", dir=out_dir, ignore_cleanup_errors=True) as tmp:
        try:
            yield Path(tmp)
            for f in sorted(Path(tmp).iterdir()):
                _settle(f)
                os.replace(f, out_dir / f.name)
        except OSError as err:
            if tmp not in f"{err.strerror} {err.filename}":
                raise
            text, name, name2 = (None if s is None else str(s).replace(tmp, str(out_dir)) for s in (err.strerror, err.filename, err.filename2))
            raise OSError(err.errno, text, name, None, name2) from err


def read_json(path: str | os.PathLike[str]) -> Any:
    """The parsed file; invalid JSON is a one-line error naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({one_line(str(err))})") from None
