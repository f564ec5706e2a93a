"""Checkpoints that are never half-written.

``torch.save`` straight to the final path leaves a truncated file when a job is killed mid-write,
and the next ``--resume`` then fails or silently loads garbage. We write to a temporary file in the
same directory, fsync it, and ``os.replace`` it over the target (atomic on POSIX), so a checkpoint
path always holds either the previous complete file or the new complete file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to ``path`` via a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint I/O plugin writing every checkpoint with :func:`atomic_torch_save`."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        atomic_torch_save(checkpoint, path)
