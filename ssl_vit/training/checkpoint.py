"""Checkpoints of a run: written atomically, every N optimiser steps and at the end, in one folder
that a rerun of the same recipe finds again: ``<default_root_dir>/checkpoints``, where Lightning's
``ModelCheckpoint`` would use the first logger's new ``version_N`` folder (a rerun would then never
see the previous run's files: ``ckpt_path="last"`` finds nothing, ``last.ckpt`` gets a ``last-v1.ckpt``).
"""

from __future__ import annotations

import os
import sys
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ssl_vit.io import atomic_torch_save, stale_temporaries


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O through :func:`ssl_vit.io.atomic_torch_save`: a job killed mid-write
    leaves the previous checkpoint whole, not a truncated file that ``--resume`` fails on."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:  # refused, as TorchCheckpointIO does, rather than dropped
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        atomic_torch_save(checkpoint, path)


def default_checkpoint_dir(trainer: L.Trainer) -> str:
    """``<default_root_dir>/checkpoints``, absolute (as Lightning resolves a ``dirpath``): a run
    resumed from another working directory is the same run."""
    return os.path.realpath(os.path.join(os.path.expanduser(str(trainer.default_root_dir)), "checkpoints"))


class StepCheckpoint(ModelCheckpoint):
    """Checkpoint every ``every_n_train_steps`` optimiser steps and at the end into ``dirpath``
    (default :func:`default_checkpoint_dir`), keep the newest ``keep_last`` step files, and refresh
    ``last.ckpt`` in place (the newest state of the run)."""

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = 500, keep_last: int = 3) -> None:
        super().__init__(dirpath=dirpath, filename="step{step:08d}", monitor="step", mode="max", save_top_k=keep_last, save_last=True,
                         every_n_train_steps=every_n_train_steps, auto_insert_metric_name=False, enable_version_counter=False)

    def resolve_dirpath(self, trainer: L.Trainer) -> str:
        """Fix the folder now: it must be known before a checkpoint is restored (before ``setup``)."""
        if self.dirpath is None:
            self.dirpath = default_checkpoint_dir(trainer)
        return str(self.dirpath)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        folder = self.resolve_dirpath(trainer)
        # A job killed while writing a checkpoint left its temporary file, of full checkpoint size.
        if trainer.is_global_zero and os.path.isdir(folder) and (stale := stale_temporaries(folder, ".ckpt")):
            for tmp in stale:
                tmp.unlink(missing_ok=True)
            print(f"removed {len(stale)} unfinished checkpoint write(s) of an interrupted job: {', '.join(p.name for p in stale)}", file=sys.stderr)
        self._trainer = weakref.ref(trainer)  # load_state_dict (after setup) asks it what is resumed
        super().setup(trainer, pl_module, stage)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the bookkeeping (which step files exist, where ``last.ckpt`` is) also when the run's
        folder is reached by another path than when it was written (a relative ``default_root_dir``,
        a moved or copied run): the paths are re-based on this folder, keeping those whose file
        exists, so that ``last.ckpt`` is overwritten and ``keep_last`` prunes. A checkpoint from
        another folder (continuing someone else's run) starts the bookkeeping afresh."""
        saved = state_dict.get("dirpath")
        if saved is not None and self.dirpath is not None and saved != self.dirpath:
            resumed = getattr(self._trainer() if getattr(self, "_trainer", None) else None, "ckpt_path", None)
            if resumed is not None and os.path.realpath(os.path.dirname(str(resumed))) == os.path.realpath(str(self.dirpath)):
                state_dict = _rebased(state_dict, str(self.dirpath))
            else:
                state_dict = {"dirpath": self.dirpath, "best_model_score": None, "best_model_path": ""}
        super().load_state_dict(state_dict)

    def save_last_checkpoint(self, trainer: L.Trainer) -> Path:
        """Write ``last.ckpt`` now (the run's end, a preemption), recorded as this step's save."""
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        return Path(self.last_model_path)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        # The final weights whatever the interval, saved at the last batch's end as every periodic
        # checkpoint is: one written after the loop ended records its last batch twice, and a run
        # continued from it (a larger max_steps) would skip a batch. A smoke test saves nothing.
        max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
        ends = (trainer.should_stop or 0 <= max_steps <= trainer.global_step
                or (max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch + 1 and trainer.is_last_batch))
        if ends and not trainer.fast_dev_run and self._last_global_step_saved != trainer.global_step:
            self.save_last_checkpoint(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A stop decided after this callback's batch end (another callback's): better a checkpoint
        # that may skip a batch when continued than none. (Lightning's own would save on fast_dev_run.)
        if trainer.fast_dev_run:
            return
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            self.save_last_checkpoint(trainer)
        super().on_train_end(trainer, pl_module)


def _rebased(state_dict: dict[str, Any], dirpath: str) -> dict[str, Any]:
    def here(path: str) -> str:
        moved = os.path.join(dirpath, os.path.basename(path))
        return moved if path and os.path.exists(moved) else ""

    state = dict(state_dict, dirpath=dirpath, best_k_models={here(p): v for p, v in state_dict.get("best_k_models", {}).items() if here(p)})
    return state | {key: here(state_dict[key]) for key in ("best_model_path", "kth_best_model_path", "last_model_path") if key in state_dict}


def newest_checkpoint(dirpath: str | Path, root_dir: str | Path | None = None) -> Path | None:
    """The furthest-trained ``*.ckpt`` in ``dirpath``, or a SLURM requeue checkpoint (Lightning's
    ``<root_dir>/hpc_ckpt_<n>.ckpt``) if that is further; None when there is none.

    Furthest by the optimiser step each file records, then by modification time (a checkpoint is
    renamed into place when complete): times alone mislead in a copied run folder (``cp -r`` stamps
    the copy time) and on file systems of whole seconds, where a step file ties with ``last.ckpt``."""
    files = [p for p in [*Path(dirpath).glob("*.ckpt"), *(hpc_checkpoints(root_dir) if root_dir is not None else [])] if p.is_file()]
    return max(files, key=lambda p: (recorded_step(p), p.stat().st_mtime_ns, p.name == "last.ckpt", p.name)) if files else None


def load_record(path: str | Path) -> Any:
    """A checkpoint's content with its tensors memory-mapped, not read (the run info and the keys
    are what is wanted); raises what ``torch.load`` raises for a file that is not one."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except RuntimeError:  # a file system without mmap, or an old serialisation format
        return torch.load(path, map_location="cpu", weights_only=False)


def recorded_step(path: str | Path) -> int:
    """The ``global_step`` a Lightning checkpoint records; -1 for a file that is not one."""
    try:
        step = load_record(path).get("global_step")
    except Exception:  # not a checkpoint (or not a mapping, or not of this torch): ordered by time alone
        return -1
    return step if isinstance(step, int) else -1


def hpc_checkpoints(root_dir: str | Path) -> list[Path]:
    """Lightning's SLURM requeue checkpoints of a run: ``<default_root_dir>/hpc_ckpt_<n>.ckpt``."""
    return list(Path(root_dir).glob("hpc_ckpt_*.ckpt"))
