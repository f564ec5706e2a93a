"""Checkpoints that are never half-written.

``torch.save`` straight to the final path leaves a truncated file when a job is killed mid-write,
and the next ``--resume`` then fails or silently loads garbage. We write to a temporary file in the
same directory, fsync it, and ``os.replace`` it over the target (atomic on POSIX), so a checkpoint
path always holds either the previous complete file or the new complete file.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from ssl_vit.io import atomic_torch_save


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint I/O plugin writing every checkpoint with :func:`atomic_torch_save`."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        atomic_torch_save(checkpoint, path)
