"""What a run says when its first batch arrives: the effective batch and the LR it scales to, the
schedule's length, and notes on settings that do not do what a user may think (a warm-up longer
than the run; a resume with another length or batch size)."""

from __future__ import annotations


def start_notes(
    method: str,
    backbone: str,
    per_device: int,
    world_size: int,
    accumulation: int,
    base_lr: float,
    peak_lr: float,
    total_steps: int,
    steps_per_epoch: int,
    warmup_steps: int,
    warmup_label: str,
    global_step: int,
    resumed_total_steps: int | None,
    resumed_global_batch: int | None,
) -> list[str]:
    """The lines to print (on rank 0). ``warmup_label`` names the warm-up setting as the user
    gave it (``warmup_epochs 10 = 40 steps``); the ``resumed_*`` values are the checkpoint's
    (None for a fresh run)."""
    global_batch = per_device * world_size * accumulation
    lines = [
        f"[ssl_vit] {method} on {backbone}: effective batch size {global_batch} = {per_device} per device x {world_size} "
        f"device(s) x {accumulation} accumulation; lr = base_lr {base_lr:g} x {global_batch}/256 = {peak_lr:.4g}; "
        f"{total_steps} optimiser steps ({steps_per_epoch} per epoch)"
    ]
    if warmup_steps >= total_steps:
        cut = f", is longer than the run of {total_steps} steps and is cut to it" if warmup_steps > total_steps else \
            f", spans the whole run of {total_steps} steps"
        lines.append(f"[ssl_vit] note: the LR warm-up, {warmup_label}{cut}: its LR rises to the peak at the last step and the "
                     "cosine never starts (set a shorter warm-up)")
    if resumed_total_steps and resumed_total_steps != total_steps:
        lines.append(
            f"[ssl_vit] note: resumed a run planned for {resumed_total_steps} optimiser steps as one of {total_steps}: from "
            f"step {global_step} on, the LR, weight-decay and momentum schedules follow the new length (the run is not "
            f"the one a {total_steps}-step run would have been)"
        )
    if resumed_global_batch and resumed_global_batch != global_batch:
        lines.append(
            f"[ssl_vit] note: resumed a run trained at an effective batch size of {resumed_global_batch} with {global_batch}: "
            f"from step {global_step} on, a step takes {global_batch} images at lr {peak_lr:.4g} "
            "(set global_batch_size to keep the run's batch over another number of devices)"
        )
    return lines
