"""The data pipeline rows: views per second of one DataLoader worker for each method's
augmentation, against lightly's transform with the same settings where lightly has one
(``DINOTransform`` for multi-crop, ``BYOLTransform`` for MoCo v3's two views, which are BYOL's
augmentations)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PIL import Image

from ssl_vit.bench.config import BenchConfig

# row: (our transform, the methods that use it, lightly's counterpart or None)
DATA_ROWS: dict[str, tuple[str, str, str | None]] = {
    "single": ("SingleView", "supervised, mpp", None),
    "two": ("TwoViews", "mocov3", "BYOLTransform"),
    "multicrop": ("MultiCrop", "dino", "DINOTransform"),
}


def data_rows(cfg: BenchConfig) -> list[str]:
    """The augmentation rows the configured methods need."""
    wanted = {"supervised": "single", "mpp": "single", "mocov3": "two", "dino": "multicrop"}
    rows = {wanted[m] for m in cfg.methods}
    return [r for r in DATA_ROWS if r in rows]


def our_transform(row: str, cfg: BenchConfig) -> Any:
    from ssl_vit.data.views import MultiCrop, SingleView, TwoViews

    size = cfg.data_global_size
    if row == "single":
        return SingleView(size=size)
    if row == "two":
        return TwoViews(size=size)
    if row == "multicrop":
        return MultiCrop(global_size=size, local_size=cfg.data_local_size, n_local=cfg.data_n_local)
    raise ValueError(f"unknown data row {row!r}; rows: {', '.join(DATA_ROWS)}")


def peer_transform(row: str, cfg: BenchConfig) -> Callable[[Any], Any]:
    """lightly's transform with our settings, without normalisation (ours leaves that to the
    datamodule)."""
    ours = our_transform(row, cfg)
    if row == "multicrop":
        from ssl_vit.data.bench import lightly_dino_transform

        return lightly_dino_transform(ours)
    if row == "two":
        from lightly.transforms.byol_transform import (
            BYOLTransform,
            BYOLView1Transform,
            BYOLView2Transform,
        )

        sigma = tuple(ours.recipes()[0].blur_sigma)  # ours scales the sigma range with the size
        common = dict(
            input_size=ours.size, cj_prob=ours.jitter_p, cj_bright=ours.brightness, cj_contrast=ours.contrast,
            cj_sat=ours.saturation, cj_hue=ours.hue, min_scale=ours.scale[0], random_gray_scale=ours.grayscale_p,
            hf_prob=ours.flip_p, sigmas=sigma, normalize=None,
        )
        return BYOLTransform(
            BYOLView1Transform(gaussian_blur=ours.blur_p[0], solarization_prob=ours.solarize_p[0], **common),
            BYOLView2Transform(gaussian_blur=ours.blur_p[1], solarization_prob=ours.solarize_p[1], **common),
        )
    raise ValueError(f"lightly has no counterpart for data row {row!r}")


def source_images(cfg: BenchConfig) -> list[Image.Image]:
    """Decoded RGB images of ``data_source_size`` px (synthetic, so no dataset is needed; the
    decode itself is not part of the augmentation and is not timed)."""
    from ssl_vit.data.synthetic import make_synthetic_images

    arrays, _ = make_synthetic_images(cfg.data_images, cfg.data_source_size, 3, num_classes=4, seed=cfg.seed)
    return [Image.fromarray(a.numpy()) for a in arrays]


def views_job(row: str, impl: str, cfg: BenchConfig) -> dict[str, Any]:
    from ssl_vit.data.bench import views_per_second

    transform = our_transform(row, cfg) if impl == "ours" else peer_transform(row, cfg)
    images = source_images(cfg)
    n_views = len(transform(images[0]))
    # CPU clock: a worker's throughput when it has a core to itself, steady under other load.
    rate = views_per_second(transform, images, float(cfg.data_seconds), warmup=2, clock="cpu")
    return {"views_per_s": rate, "views_per_image": n_views}
