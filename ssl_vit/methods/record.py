"""What a pretraining checkpoint records besides weights, optimiser and loops (its ``"ssl_vit"``
entry): enough to rebuild the backbone and to say how it was trained without the recipe
(``ssl-vit eval`` / ``export`` / ``compare`` read it), and what a resumed run needs to continue as
an uninterrupted one would (the per-step seed base, the spent non-finite skip budget)."""

from __future__ import annotations

from typing import Any


# The attributes of a datamodule worth recording: export takes the normalisation from them, the
# result records the dataset.
_DATA_KEYS = ("mean", "std", "img_size", "in_chans", "num_classes")


def data_info(datamodule: Any) -> dict[str, Any]:
    """What the data looked like: its class (by import path, as every record names it) and the
    attributes of ``_DATA_KEYS`` it has; an image folder's training directory too (result records
    tell datasets of the same class apart by it)."""
    info: dict[str, Any] = {"name": type(datamodule).__name__, "class": f"{type(datamodule).__module__}.{type(datamodule).__qualname__}"}
    for key in _DATA_KEYS:
        value = getattr(datamodule, key, None)
        if value is not None:
            info[key] = list(value) if isinstance(value, tuple | list) else value
    if getattr(datamodule, "train_dir", None) is not None:
        info["train_dir"] = str(datamodule.train_dir)
    return info


def epochs_done(trainer: Any, global_step: int, steps_per_epoch: int | None) -> float | None:
    """Epochs trained: from the data loader's position (``ResumableLoader.epochs_done``: right
    across a resume with another batch size), else optimiser steps over steps per epoch."""
    if trainer is None:
        return None
    done = getattr(trainer.train_dataloader, "epochs_done", None)
    if callable(done):
        return round(done(), 4)
    return round(global_step / steps_per_epoch, 4) if steps_per_epoch else None


def checkpoint_record(module: Any) -> dict[str, Any]:
    """The ``"ssl_vit"`` entry of a ``BaseMethod``'s checkpoint."""
    return {
        "method": type(module).__name__,
        "backbone": module.backbone_name,
        "backbone_kwargs": module.backbone_kwargs,
        "global_step": module.global_step,
        "epoch": module.current_epoch,  # Lightning's index of the epoch in progress
        # The epochs trained (a float; None when unknown).
        "epochs": epochs_done(module._trainer, module.global_step, getattr(module, "_steps_per_epoch", None)),
        "data": getattr(module, "data_info", None),
        "recipe": getattr(module, "recipe", None),
        "global_batch_size": module.global_batch_size,
        "total_steps": module._total_steps,  # the length the schedules were planned for
        # The encoder that evaluation and export take by default (DINO: the teacher).
        "default_encoder": module.default_encoder,
        "seed": module._seed,
        "skipped_batches": module.nonfinite.skipped,
        # Set by the PretrainFlopsCounter callback (None without it): the x-axis of the ViT
        # paper's accuracy-vs-compute plot (Figure 5).
        "pretrain_flops": getattr(module, "pretrain_flops", None),
    }


def restore_record(module: Any, record: dict[str, Any]) -> None:
    """Take back from a checkpoint's ``"ssl_vit"`` entry what the module keeps outside its state
    dict. The recipe of this invocation (a resumed run's, with its new length or batch) wins when
    the CLI gave one; the checkpoint's is taken otherwise (a checkpoint loaded from Python). The
    checkpoint's batch and length are kept apart (``_resumed_*``) for the start-up notes."""
    if record.get("data"):
        module.data_info = record["data"]
    if record.get("recipe") and getattr(module, "recipe", None) is None:
        module.recipe = record["recipe"]
    if record.get("seed") is not None:
        module._seed = int(record["seed"])
    module.nonfinite.skipped = int(record.get("skipped_batches", 0))
    module._resumed_global_batch = record.get("global_batch_size")
    module._resumed_total_steps = record.get("total_steps")
