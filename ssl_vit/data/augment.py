"""Augmentation operations on 8-bit PIL images for ``views.py``: the torchvision PIL ops of DINO's and
MoCo v3's code, drawn from Python's ``random`` (seeded per sample), with the hue shift a cached lookup
table and solarisation folded into the conversion to float; checked against torchvision by the tests."""

from __future__ import annotations

import functools
import math
import random
from typing import Literal

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image, ImageEnhance, ImageFilter

# The random resized crop's aspect-ratio range: torchvision's default, used by timm, DINO and MoCo v3.
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
LUMA = (0.299, 0.587, 0.114)  # ITU-R 601-2 luma weights: Pillow's convert("L")

ImageLike = Image.Image | torch.Tensor | np.ndarray
Interpolation = Literal["nearest", "bilinear", "bicubic"]

RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


def to_pil(image: ImageLike) -> Image.Image:
    """An 8-bit "L" or "RGB" PIL image of a PIL image of any mode, a tensor ``[C, H, W]`` / ``[H, W]``
    or an array ``[H, W(, C)]`` (as torchvision's ``to_pil_image`` reads them)."""
    if not isinstance(image, Image.Image):
        image = TF.to_pil_image(image)
    if image.mode in ("L", "RGB"):
        return image
    if image.mode == "I" or image.mode.startswith("I;16"):
        # 16-bit grey (PNG / TIFF: "I;16", PGM: "I") scaled to 8 bits: convert("L") would clip at 255.
        array = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
        return Image.fromarray((array >> 8).astype(np.uint8), mode="L")
    # Modes without colour become grey ("F": values on the 0-255 scale), the others (P, RGBA, CMYK, ...) RGB.
    return image.convert("L" if image.mode in ("1", "F", "LA", "La") else "RGB")


def random_resized_crop_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float] = CROP_RATIO) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of an Inception-style crop, torchvision's ``RandomResizedCrop.get_params``
    drawn from ``random``: area ~ U(scale), log aspect ~ U(log ratio); after 10 misses the central crop."""
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


def resize_center_crop(img: Image.Image, size: int, crop_pct: float, interpolation: Interpolation) -> Image.Image:
    """timm's / DeiT's evaluation geometry: short side to ``size / crop_pct``, then the centre crop
    (the Resize and CenterCrop of ``timm.data.create_transform``)."""
    img = TF.resize(img, int(size / crop_pct), interpolation=TF.InterpolationMode(interpolation))
    return TF.center_crop(img, [size, size])


@functools.cache  # one table per 1/255-turn level and process
def _hue_lut(level: int, points: int = 17) -> ImageFilter.Color3DLUT:
    # The exact float rotation of torchvision's tensor adjust_hue at the table's grid points.
    axis = torch.linspace(0.0, 1.0, points)
    b, g, r = torch.meshgrid(axis, axis, axis, indexing="ij")  # Color3DLUT wants R varying fastest
    grid = torch.stack([r, g, b]).reshape(3, -1, 1)  # [3, points^3, 1]: an RGB image
    table = TF.adjust_hue(grid, (level / 255 + 0.5) % 1.0 - 0.5)  # (a shift of 128/255 turns is -127/255)
    return ImageFilter.Color3DLUT(points, table.reshape(3, -1).T.flatten().tolist(), channels=3)


def adjust_hue(img: Image.Image, shift: float) -> Image.Image:
    """Rotate the HSV hue by ``shift`` turns (in [-0.5, 0.5]); a no-op on grey images. As torchvision's
    PIL adjust_hue, the shift is in 1/255-turn steps; the exact rotation is a 17^3 colour lookup table
    (exact away from the hue-sector boundaries, the rotation being piecewise linear in RGB)."""
    level = int(round(shift * 255))
    if img.mode == "L" or level == 0:
        return img
    return img.filter(_hue_lut(level))


def draw_jitter(brightness: float, contrast: float, saturation: float, hue: float) -> list[tuple[int, float]]:
    """torchvision ColorJitter's draws from ``random``: the ops with a strength (0 brightness, 1 contrast,
    2 saturation, 3 hue) in a random order, factors ~ U(1 - s, 1 + s) (the hue shift ~ U(-hue, hue))."""
    order, strengths = [0, 1, 2, 3], (brightness, contrast, saturation, hue)
    random.shuffle(order)
    return [(op, random.uniform(-s, s) if op == 3 else random.uniform(max(0.0, 1 - s), 1 + s)) for op in order if (s := strengths[op]) > 0]


def apply_jitter(img: Image.Image, ops: list[tuple[int, float]]) -> Image.Image:
    """The ops :func:`draw_jitter` drew, in their order: brightness, contrast and saturation by Pillow's
    ImageEnhance (as torchvision's PIL backend), the hue by :func:`adjust_hue`."""
    for op, factor in ops:
        if op == 3:
            img = adjust_hue(img, factor)
        elif op < 2 or img.mode != "L":  # (a grey image has no saturation)
            img = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)[op](img).enhance(factor)
    return img


def gaussian_blur(img: Image.Image, sigma: float) -> Image.Image:
    # Pillow's "radius" is the standard deviation, as DINO's and MoCo v3's GaussianBlur call it.
    return img.filter(ImageFilter.GaussianBlur(radius=sigma))


def to_float_tensor(img: Image.Image, solarize: bool = False) -> torch.Tensor:
    """An 8-bit image -> a float tensor ``[C, H, W]`` in [0, 1], solarised if asked (ImageOps.solarize: v >= 128 -> 255 - v)."""
    x = TF.pil_to_tensor(img)  # [C, H, W] uint8
    if solarize:
        x = torch.where(x >= 128, 255 - x, x)
    return x.float().div_(255)
