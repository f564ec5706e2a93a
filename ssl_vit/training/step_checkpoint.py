"""Periodic checkpoints of a run, in one directory that a rerun of the same recipe finds again.

Lightning's ``ModelCheckpoint`` puts its files under the first logger's version directory
(``lightning_logs/version_N/checkpoints``), a new one per process, so a rerun never sees the
previous run's files: ``ckpt_path="last"`` finds nothing, and a ``last.ckpt`` that exists already
gets a sibling ``last-v1.ckpt``. :class:`StepCheckpoint` keeps every run of a recipe in
``<default_root_dir>/checkpoints``, and :func:`newest_checkpoint` is what ``--resume`` loads.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


def default_checkpoint_dir(trainer: L.Trainer) -> str:
    """``<default_root_dir>/checkpoints`` as an absolute path (Lightning resolves a given
    ``dirpath`` the same way), so that a run resumed from another working directory is the same run."""
    return os.path.realpath(os.path.join(os.path.expanduser(str(trainer.default_root_dir)), "checkpoints"))


class StepCheckpoint(ModelCheckpoint):
    """Checkpoint every ``every_n_train_steps`` optimiser steps and at the end, keep the newest
    ``keep_last``, and always refresh ``last.ckpt`` (in place: the newest state of the run).

    Args:
        dirpath: where checkpoints go; default ``<trainer.default_root_dir>/checkpoints`` so that a
            rerun of the same recipe finds them (Lightning's default is inside a new logger version).
        every_n_train_steps: checkpoint interval in optimiser steps.
        keep_last: how many step checkpoints to keep besides ``last.ckpt``.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = 500, keep_last: int = 3) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="step{step:08d}",
            monitor="step",
            mode="max",
            save_top_k=keep_last,
            save_last=True,
            every_n_train_steps=every_n_train_steps,
            auto_insert_metric_name=False,
            # The directory is the recipe's run: last.ckpt is its newest state, never last-v1.ckpt.
            enable_version_counter=False,
        )

    def resolve_dirpath(self, trainer: L.Trainer) -> str:
        """Fix the directory now (it must be known before a checkpoint is restored, which happens
        before ``setup`` would choose it)."""
        if self.dirpath is None:
            self.dirpath = default_checkpoint_dir(trainer)
        return str(self.dirpath)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.resolve_dirpath(trainer)
        self._trainer = weakref.ref(trainer)  # load_state_dict (after setup) asks it what is resumed
        super().setup(trainer, pl_module, stage)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the bookkeeping (which step checkpoints exist, where ``last.ckpt`` is) also when
        the run's directory is reached by another path than when it was written: a relative
        ``default_root_dir`` from another working directory, or the run directory moved or copied.
        The recorded paths are re-based on this directory, keeping those whose file exists here, so
        that ``last.ckpt`` is overwritten (not versioned) and ``keep_last`` prunes the old files.
        A checkpoint from another directory (training continued from someone else's run) starts
        the bookkeeping afresh: the files here are not that run's."""
        saved = state_dict.get("dirpath")
        if saved is not None and self.dirpath is not None and saved != self.dirpath:
            if self._resumed_from_here():
                state_dict = _rebased(state_dict, str(self.dirpath))
            else:
                state_dict = {"dirpath": self.dirpath, "best_model_score": None, "best_model_path": ""}
        super().load_state_dict(state_dict)

    def _resumed_from_here(self) -> bool:
        ref = getattr(self, "_trainer", None)
        path = getattr(ref() if ref is not None else None, "ckpt_path", None)
        return path is not None and os.path.realpath(os.path.dirname(str(path))) == os.path.realpath(str(self.dirpath))

    def save_last_checkpoint(self, trainer: L.Trainer) -> Path:
        """Write ``last.ckpt`` now (the run's end, a preemption), recorded as this step's save."""
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        return Path(self.last_model_path)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        # The final weights, whatever the interval: the run's result lives in last.ckpt. Saved at
        # the last batch's end, where every periodic checkpoint is saved: a checkpoint written
        # after the loop ended records its last batch twice, and a run continued from it (a larger
        # max_steps / max_epochs) would skip a batch.
        if trainer.fast_dev_run:  # a smoke test saves nothing (Lightning's rule for checkpoints)
            return
        if self._last_global_step_saved != trainer.global_step and _ends_after_this_batch(trainer):
            self.save_last_checkpoint(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A stop decided after this callback's batch end (another callback's): better a checkpoint
        # that may skip a batch when continued than none.
        if trainer.fast_dev_run:  # (Lightning 2.6's own on_train_end would save last.ckpt)
            return
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            self.save_last_checkpoint(trainer)
        super().on_train_end(trainer, pl_module)


def _ends_after_this_batch(trainer: L.Trainer) -> bool:
    """Whether the fit loop stops after the batch that just ended (max_steps, the last batch of
    the last epoch, or a stop requested)."""
    if trainer.should_stop:
        return True
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return True
    last_epoch = trainer.max_epochs is not None and trainer.max_epochs >= 0 and trainer.current_epoch + 1 >= trainer.max_epochs
    return bool(last_epoch and trainer.is_last_batch)


def _rebased(state_dict: dict[str, Any], dirpath: str) -> dict[str, Any]:
    def here(path: str) -> str:
        if not path:
            return path
        moved = os.path.join(dirpath, os.path.basename(path))
        return moved if os.path.exists(moved) else ""

    state = dict(state_dict, dirpath=dirpath)
    state["best_k_models"] = {here(p): v for p, v in state_dict.get("best_k_models", {}).items() if here(p)}
    for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
        if key in state_dict:
            state[key] = here(state_dict[key])
    return state


def newest_checkpoint(dirpath: str | Path, root_dir: str | Path | None = None) -> Path | None:
    """The furthest-trained ``*.ckpt`` in ``dirpath``, or a SLURM requeue checkpoint
    (``<root_dir>/hpc_ckpt_<n>.ckpt``, Lightning's) if that is further; None when there is none.

    Furthest by the optimiser step each file records, then by modification time (checkpoints
    are written to a temporary file and renamed, so that is when each was completed): the
    times alone mislead in a copied run folder (``cp -r`` stamps the copy time) and on file
    systems that keep whole seconds, where a step file can tie with ``last.ckpt``."""
    files = list(Path(dirpath).glob("*.ckpt")) + (hpc_checkpoints(root_dir) if root_dir is not None else [])
    files = [p for p in files if p.is_file()]
    return max(files, key=lambda p: (recorded_step(p), p.stat().st_mtime_ns, p.name == "last.ckpt", p.name)) if files else None


def load_record(path: str | Path) -> Any:
    """A checkpoint's content with its tensors memory-mapped, not read (the record and the keys
    are what is wanted); raises what ``torch.load`` raises for a file that is not one."""
    import torch

    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except RuntimeError:  # a file system without mmap, or an old serialisation format
        return torch.load(path, map_location="cpu", weights_only=False)


def recorded_step(path: str | Path) -> int:
    """The ``global_step`` a Lightning checkpoint records (its tensors memory-mapped, not read);
    -1 for a file that is not one."""
    try:
        checkpoint = load_record(path)
    except Exception:  # not a checkpoint (or not of this torch): ordered by time alone
        return -1
    step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
    return int(step) if isinstance(step, int) else -1


def hpc_checkpoints(root_dir: str | Path) -> list[Path]:
    """Lightning's SLURM requeue checkpoints of a run: ``<default_root_dir>/hpc_ckpt_<n>.ckpt``."""
    return list(Path(root_dir).glob("hpc_ckpt_*.ckpt"))
