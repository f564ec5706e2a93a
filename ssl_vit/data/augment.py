"""Fast per-image augmentation primitives on 8-bit PIL images.

The view transforms in ``views.py`` are built from these. They reproduce the operations of the
torchvision PIL backend that DINO's and MoCo v3's reference code use (RandomResizedCrop,
ColorJitter, RandomGrayscale, PIL GaussianBlur, ImageOps.solarize), with two changes made for speed:

* no per-transform wrapper objects: parameters are drawn with the ``random`` module (which
  PyTorch's DataLoader seeds differently in every worker) and each operation is one call into
  Pillow's C code;
* the hue shift goes through a cached 3-D colour lookup table instead of Pillow's HSV round trip,
  which alone was the largest cost of a 224-px view; solarisation is folded into the final
  conversion to float.

Throughput against lightly's DINOTransform and torchvision.transforms.v2: see ``bench.py``.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from PIL import Image, ImageFilter, ImageStat

# Aspect-ratio range of the Inception-style random resized crop, the same in timm, DINO
# (main_dino.py DataAugmentationDINO) and MoCo v3 (main_moco.py): torchvision's default.
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)

ImageLike = Image.Image | torch.Tensor | np.ndarray
Interpolation = Literal["nearest", "bilinear", "bicubic"]

RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
}


def to_pil(image: ImageLike) -> Image.Image:
    """Return an 8-bit "L" or "RGB" PIL image.

    Accepts a PIL image of any mode, a uint8 tensor ``[C, H, W]`` or ``[H, W]`` (C in {1, 3}),
    or a uint8 numpy array ``[H, W]`` / ``[H, W, C]``.  16-bit grey images (modes ``I;16*`` and ``I``) are
    scaled to 8 bits, not clipped.
    """
    if isinstance(image, Image.Image):
        if image.mode in ("L", "RGB"):
            return image
        if image.mode == "I" or image.mode.startswith("I;16"):
            # 16-bit grey: scaled to 8 bits (PIL's convert("L") clips every value above 255).
            # Pillow opens 16-bit PNG and TIFF files as "I;16", 16-bit PGM / PPM files as "I"
            # (32-bit integers holding 16-bit values); "I" is read as 16-bit too.
            array = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
            return Image.fromarray((array >> 8).astype(np.uint8), mode="L")
        # Modes without colour become grey ("F": values taken on the 0-255 scale), everything
        # else (P, RGBA, CMYK, YCbCr, ...) RGB.
        grey = image.mode in ("1", "F", "LA", "La")
        return image.convert("L" if grey else "RGB")
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8:
            raise TypeError(
                f"image tensors must be uint8 in [0, 255], got dtype {image.dtype}; "
                "convert with (x * 255).round().to(torch.uint8)"
            )
        if image.ndim == 3:
            if image.shape[0] not in (1, 3):
                raise ValueError(f"image tensor must be [C, H, W] with C in (1, 3), got {tuple(image.shape)}")
            image = image.permute(1, 2, 0)  # [H, W, C]
        array = image.numpy()
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise TypeError(f"image arrays must be uint8, got dtype {image.dtype}")
        array = image
    else:
        raise TypeError(f"expected a PIL image, uint8 tensor or uint8 array, got {type(image).__name__}")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2:
        return Image.fromarray(np.ascontiguousarray(array), "L")
    if array.ndim == 3 and array.shape[2] == 3:
        return Image.fromarray(np.ascontiguousarray(array), "RGB")
    raise ValueError(f"image array must be [H, W] or [H, W, 3], got shape {array.shape}")


def random_resized_crop_box(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float] = CROP_RATIO
) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of an Inception-style crop: area fraction ~ U(scale), log aspect
    ratio ~ U(log ratio); 10 tries, then the central crop clipped to the ratio range.

    The same sampling as torchvision's ``RandomResizedCrop.get_params``, drawn from ``random``.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * random.uniform(scale[0], scale[1])
        aspect = math.exp(random.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = random.randint(0, height - h)
            left = random.randint(0, width - w)
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


def resize_center_crop(img: Image.Image, size: int, crop_pct: float, resample: int) -> Image.Image:
    """Deterministic evaluation geometry: images already ``size`` × ``size`` are kept as they are
    (a dataset evaluated at its own resolution, e.g. 28-px Fashion-MNIST); every other image is
    resized so the short side is ``size / crop_pct`` and centre-cropped to ``size`` (timm/DeiT's
    224-from-256 protocol), a non-square one with short side ``size`` included, so the zoom
    does not jump between short sides ``size`` and ``size + 1``."""
    w, h = img.size
    if (w, h) != (size, size):
        short = int(math.floor(size / crop_pct))
        # torchvision's Resize(int): the long side truncated, int(short * long / short side).
        w, h = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
        img = img.resize((w, h), resample)
    if (w, h) == (size, size):
        return img
    # Offsets rounded as torchvision's CenterCrop does, so both give the same pixels.
    left, top = int(round((w - size) / 2.0)), int(round((h - size) / 2.0))
    return img.crop((left, top, left + size, top + size))


def adjust_brightness(img: Image.Image, factor: float) -> Image.Image:
    # Pillow's ImageEnhance.Brightness (what torchvision's PIL backend calls): blend with black.
    return Image.blend(Image.new(img.mode, img.size, 0), img, factor)


def adjust_contrast(img: Image.Image, factor: float) -> Image.Image:
    # ImageEnhance.Contrast: blend with a flat image at the mean grey level rounded half up, as
    # Pillow rounds it (a box reduction to one pixel rounds otherwise: up to a level apart).
    grey = img if img.mode == "L" else img.convert("L")
    mean = int(ImageStat.Stat(grey).mean[0] + 0.5)
    fill = mean if img.mode == "L" else (mean, mean, mean)
    return Image.blend(Image.new(img.mode, img.size, fill), img, factor)


def adjust_saturation(img: Image.Image, factor: float) -> Image.Image:
    # ImageEnhance.Color: blend with the grey version. A no-op on grey images.
    if img.mode == "L":
        return img
    return Image.blend(img.convert("L").convert("RGB"), img, factor)


# Grid points per axis of the 3-D colour lookup table used for the hue shift (see adjust_hue).
_HUE_LUT_SIZE = 17


def _hsv_hue_shift(rgb: np.ndarray, shift: float) -> np.ndarray:
    """Exact HSV hue rotation of float RGB values ``[..., 3]`` in [0, 1] by ``shift`` turns.

    Closed-form HSV -> RGB: f(n) = V - C * clip(min(k, 4 - k), 0, 1), k = (n + 6 H) mod 6 with
    n = 5, 3, 1 for R, G, B; value V = max and chroma C = max - min are kept.
    """
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    v = np.maximum(np.maximum(r, g), b)
    c = v - np.minimum(np.minimum(r, g), b)
    inv = np.divide(1.0, c, out=np.zeros_like(c), where=c > 0)
    # Hue in sextants [-1, 5): the formula depends on which channel is the maximum.
    h = np.where(v == r, (g - b) * inv, np.where(v == g, (b - r) * inv + 2.0, (r - g) * inv + 4.0))
    h = h + 6.0 * shift
    out = []
    for n in (5.0, 3.0, 1.0):
        k = np.mod(h + n, 6.0)
        out.append(v - c * np.clip(np.minimum(k, 4.0 - k), 0.0, 1.0))
    return np.stack(out, axis=-1)


@functools.cache
def _hue_lut(level: int) -> ImageFilter.Color3DLUT:
    # Cached per process (a worker builds at most 2 * 255 * hue + 1 tables of 59 kB, ~1 ms each).
    axis = np.linspace(0.0, 1.0, _HUE_LUT_SIZE, dtype=np.float32)
    b, g, r = np.meshgrid(axis, axis, axis, indexing="ij")  # Color3DLUT wants R varying fastest
    grid = np.stack([r, g, b], axis=-1).reshape(-1, 3)
    table = _hsv_hue_shift(grid, level / 255.0).astype(np.float32).reshape(-1)
    return ImageFilter.Color3DLUT(_HUE_LUT_SIZE, table, channels=3)


def adjust_hue(img: Image.Image, shift: float) -> Image.Image:
    """Rotate the HSV hue by ``shift`` turns (in [-0.5, 0.5]); a no-op on grey images.

    The operation of torchvision's adjust_hue, which on PIL images (the path DINO's and MoCo v3's
    code take) shifts Pillow's 8-bit H channel by int(shift * 255) and converts back. Here the
    shift is rounded to the same 1/255-turn steps and the exact HSV rotation is applied through a
    17^3 colour lookup table with trilinear interpolation in Pillow's C code (the rotation is
    piecewise linear in RGB, so the table is exact away from the hue-sector boundaries). That is
    2-2.5x faster than Pillow's HSV round trip and closer to the exact result than it (max error
    ~4 vs ~11 grey levels, mean ~0.4 vs ~0.7). Grey pixels stay grey within one level (the
    interpolation weights are symmetric, only the fixed-point rounding differs per channel).
    """
    level = int(round(shift * 255))
    if img.mode == "L" or level == 0:
        return img
    return img.filter(_hue_lut(level))


def color_jitter(
    img: Image.Image, brightness: float, contrast: float, saturation: float, hue: float
) -> Image.Image:
    """torchvision ColorJitter(brightness, contrast, saturation, hue): factors drawn uniformly
    from [1 - s, 1 + s] (hue shift from [-hue, hue]) and applied in a random order."""
    order = [0, 1, 2, 3]
    random.shuffle(order)
    for op in order:
        if op == 0 and brightness > 0:
            img = adjust_brightness(img, random.uniform(max(0.0, 1 - brightness), 1 + brightness))
        elif op == 1 and contrast > 0:
            img = adjust_contrast(img, random.uniform(max(0.0, 1 - contrast), 1 + contrast))
        elif op == 2 and saturation > 0:
            img = adjust_saturation(img, random.uniform(max(0.0, 1 - saturation), 1 + saturation))
        elif op == 3 and hue > 0:
            img = adjust_hue(img, random.uniform(-hue, hue))
    return img


def gaussian_blur(img: Image.Image, sigma: float) -> Image.Image:
    # Pillow's GaussianBlur takes the standard deviation as "radius"; DINO's and MoCo v3's
    # GaussianBlur classes call it exactly like this with sigma ~ U(0.1, 2.0).
    return img.filter(ImageFilter.GaussianBlur(radius=sigma))


def to_float_tensors(images: Sequence[Image.Image], solarize: Sequence[bool]) -> list[torch.Tensor]:
    """Convert 8-bit images to float tensors ``[C, H, W]`` in [0, 1], solarising the flagged ones.

    Solarisation is ImageOps.solarize's: values >= 128 are inverted (v -> 255 - v), done here in
    float as 1 - v / 255. Images of equal size are converted as one stacked array to save
    per-call overhead (DINO's local crops).
    """
    out: list[torch.Tensor | None] = [None] * len(images)
    groups: dict[tuple[str, tuple[int, int]], list[int]] = {}
    for i, img in enumerate(images):
        groups.setdefault((img.mode, img.size), []).append(i)
    for (mode, _), idx in groups.items():
        arr = np.stack([np.asarray(images[i]) for i in idx])  # [K, H, W] or [K, H, W, 3] uint8
        arr = arr[:, None] if mode == "L" else arr.transpose(0, 3, 1, 2)  # [K, C, H, W]
        x = arr.astype(np.float32, order="C")
        x *= 1.0 / 255.0
        for j, i in enumerate(idx):
            if solarize[i]:
                x[j] = np.where(arr[j] >= 128, 1.0 - x[j], x[j])
        tensors = torch.from_numpy(x)  # contiguous [K, C, H, W]
        for j, i in enumerate(idx):
            out[i] = tensors[j]
    return out  # type: ignore[return-value]
