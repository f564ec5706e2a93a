"""Throughput of view transforms, in views per second for one DataLoader worker.

A DataLoader worker runs one transform call at a time on one thread (PyTorch sets
``torch.set_num_threads(1)`` in workers), so that is how it is measured here.

For reference, ``MultiCrop`` (2 global + 8 local crops) against lightly 1.6's ``DINOTransform``
with the same settings, one thread of a Xeon server CPU: 28-px grey (local 12) ~8x as many views
per second, 32-px RGB (local 16) ~3-4x, 224-px RGB (local 96) ~1.7x; a torchvision.transforms.v2
pipeline on uint8 tensors was 0.5x lightly at 32 and 224 px and 1.2x at 28 px.

    >>> from ssl_vit.data.bench import views_per_second, lightly_dino_transform
    >>> ours = MultiCrop(global_size=224, local_size=96, n_local=8)
    >>> theirs = lightly_dino_transform(ours)
    >>> views_per_second(ours, images, 5.0), views_per_second(theirs, images, 5.0)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from ssl_vit.data.views import MultiCrop


def views_per_second(
    transform: Callable[[Any], Sequence[Any]],
    images: Sequence[Any],
    seconds_or_iters: float | int = 2.0,
    warmup: int = 3,
    clock: Literal["wall", "cpu"] = "wall",
) -> float:
    """Views produced per second by ``transform`` on one thread.

    ``seconds_or_iters``: a float is a time budget in seconds (at least one call is made); an int
    is the number of calls. Images are used round-robin. ``warmup`` untimed calls come first.
    ``clock="cpu"`` counts this process's CPU time instead of wall time: steadier on a machine
    shared with other jobs.
    """
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    now = time.perf_counter if clock == "wall" else time.process_time
    if not images:
        raise ValueError("views_per_second needs at least one image")
    if isinstance(seconds_or_iters, bool) or seconds_or_iters <= 0:
        raise ValueError(f"seconds_or_iters must be a positive number, got {seconds_or_iters!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(warmup):
            transform(images[i % len(images)])
        n_views, calls = 0, 0
        start = now()
        while True:
            n_views += len(transform(images[calls % len(images)]))
            calls += 1
            elapsed = now() - start
            if isinstance(seconds_or_iters, int):
                if calls >= seconds_or_iters:
                    break
            elif elapsed >= seconds_or_iters:
                break
    finally:
        torch.set_num_threads(threads)
    return n_views / elapsed


def lightly_dino_transform(multicrop: MultiCrop, normalize: dict[str, list[float]] | None = None) -> Any:
    """lightly's ``DINOTransform`` with the same settings as ``multicrop`` (for the comparison).

    lightly scales the jitter strengths by ``cj_strength`` but does not pass ``cj_strength`` to its
    second global view (which then uses its default 0.5), so we keep cj_strength at 0.5 and double
    the strengths: every view then gets exactly ours. ``normalize=None`` by default because our
    views are not normalised either (the datamodule does that afterwards).
    """
    from lightly.transforms.dino_transform import DINOTransform

    if multicrop.global_size is None:
        raise ValueError("set multicrop.global_size (or call with_img_size) before comparing")
    recipes = multicrop.recipes()
    return DINOTransform(
        global_crop_size=multicrop.global_size,
        global_crop_scale=multicrop.global_scale,
        local_crop_size=multicrop.resolved_local_size,
        local_crop_scale=multicrop.local_scale,
        n_local_views=multicrop.n_local,
        hf_prob=multicrop.flip_p,
        cj_prob=multicrop.jitter_p,
        cj_strength=0.5,
        cj_bright=2 * multicrop.brightness,
        cj_contrast=2 * multicrop.contrast,
        cj_sat=2 * multicrop.saturation,
        cj_hue=2 * multicrop.hue,
        random_gray_scale=multicrop.grayscale_p,
        gaussian_blur=multicrop.blur_p,
        sigmas=recipes[0].blur_sigma,
        solarization_prob=multicrop.solarize_p,
        normalize=normalize,
    )
