"""Augmentation operations on 8-bit PIL images, the building blocks of ``views.py``: the torchvision
PIL backend that DINO's and MoCo v3's code use (RandomResizedCrop, ColorJitter, RandomGrayscale, PIL
GaussianBlur, ImageOps.solarize), written for speed: parameters are drawn with Python's ``random``
(seeded per sample), without per-transform objects, the hue shift is a cached colour lookup table
instead of Pillow's HSV round trip, and solarisation is folded into the conversion to float.
``tests/test_data_augment_reference.py`` checks each against torchvision."""

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

ImageLike = Image.Image | torch.Tensor | np.ndarray
Interpolation = Literal["nearest", "bilinear", "bicubic"]

RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


def to_pil(image: ImageLike) -> Image.Image:
    """An 8-bit "L" or "RGB" PIL image of a PIL image of any mode, a tensor ``[C, H, W]`` /
    ``[H, W]`` or an array ``[H, W(, C)]`` (read as torchvision's ``to_pil_image`` reads them).
    16-bit grey images are scaled to 8 bits, not clipped."""
    if not isinstance(image, Image.Image):
        image = TF.to_pil_image(image)
    if image.mode in ("L", "RGB"):
        return image
    if image.mode == "I" or image.mode.startswith("I;16"):
        # Pillow opens 16-bit PNG / TIFF files as "I;16" and 16-bit PGM / PPM files as "I";
        # its convert("L") would clip every value above 255.
        array = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
        return Image.fromarray((array >> 8).astype(np.uint8), mode="L")
    # Modes without colour become grey ("F": values on the 0-255 scale), the others (P, RGBA, CMYK, ...) RGB.
    return image.convert("L" if image.mode in ("1", "F", "LA", "La") else "RGB")


def random_resized_crop_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float] = CROP_RATIO) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of an Inception-style crop: area fraction ~ U(scale), log aspect
    ratio ~ U(log ratio); 10 tries, then the central crop clipped to the ratio range. The sampling
    of torchvision's ``RandomResizedCrop.get_params``, drawn from ``random``."""
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
    """timm's / DeiT's evaluation geometry (224 from 256): short side to ``size / crop_pct``, then
    the centre crop (torchvision's Resize and CenterCrop, exactly what ``timm.data.create_transform``
    builds for evaluation)."""
    img = TF.resize(img, int(size / crop_pct), interpolation=TF.InterpolationMode(interpolation))
    return TF.center_crop(img, [size, size])


# Brightness, contrast and saturation: Pillow's ImageEnhance, which torchvision's PIL backend calls.
def adjust_brightness(img: Image.Image, factor: float) -> Image.Image:
    return ImageEnhance.Brightness(img).enhance(factor)


def adjust_contrast(img: Image.Image, factor: float) -> Image.Image:
    return ImageEnhance.Contrast(img).enhance(factor)


def adjust_saturation(img: Image.Image, factor: float) -> Image.Image:
    return img if img.mode == "L" else ImageEnhance.Color(img).enhance(factor)  # (a grey image has none)


@functools.cache  # one table per 1/255-turn level and process
def _hue_lut(level: int, points: int = 17) -> ImageFilter.Color3DLUT:
    # The exact float rotation of torchvision's tensor adjust_hue at the table's grid points.
    axis = torch.linspace(0.0, 1.0, points)
    b, g, r = torch.meshgrid(axis, axis, axis, indexing="ij")  # Color3DLUT wants R varying fastest
    grid = torch.stack([r, g, b]).reshape(3, -1, 1)  # [3, points^3, 1]: an RGB image
    table = TF.adjust_hue(grid, (level / 255 + 0.5) % 1.0 - 0.5)  # (a shift of 128/255 turns is -127/255)
    return ImageFilter.Color3DLUT(points, table.reshape(3, -1).T.flatten().tolist(), channels=3)


def adjust_hue(img: Image.Image, shift: float) -> Image.Image:
    """Rotate the HSV hue by ``shift`` turns (in [-0.5, 0.5]); a no-op on grey images.

    torchvision's adjust_hue on PIL images (the path of DINO's and MoCo v3's code) shifts Pillow's
    8-bit H channel by int(shift * 255). Here the shift is rounded to the same 1/255-turn steps and
    the exact rotation is applied through a 17^3 colour lookup table, interpolated trilinearly by
    Pillow (the rotation is piecewise linear in RGB, so the table is exact away from the hue-sector
    boundaries). Grey pixels stay grey within one level.
    """
    level = int(round(shift * 255))
    if img.mode == "L" or level == 0:
        return img
    return img.filter(_hue_lut(level))


def draw_jitter(brightness: float, contrast: float, saturation: float, hue: float) -> list[tuple[int, float]]:
    """torchvision ColorJitter's draws from ``random``: the ops with a strength (0 brightness, 1 contrast,
    2 saturation, 3 hue) in a random order, each with its factor, uniform in [1 - s, 1 + s] (the hue
    shift in [-hue, hue])."""
    order, strengths = [0, 1, 2, 3], (brightness, contrast, saturation, hue)
    random.shuffle(order)
    return [(op, random.uniform(-s, s) if op == 3 else random.uniform(max(0.0, 1 - s), 1 + s)) for op in order if (s := strengths[op]) > 0]


def apply_jitter(img: Image.Image, ops: list[tuple[int, float]]) -> Image.Image:
    """The ops :func:`draw_jitter` drew, in their order."""
    for op, factor in ops:
        if op == 0:
            img = adjust_brightness(img, factor)
        elif op == 1:
            img = adjust_contrast(img, factor)
        elif op == 2:
            img = adjust_saturation(img, factor)
        else:
            img = adjust_hue(img, factor)
    return img


def color_jitter(img: Image.Image, brightness: float, contrast: float, saturation: float, hue: float) -> Image.Image:
    """torchvision ColorJitter(brightness, contrast, saturation, hue): factors drawn uniformly
    from [1 - s, 1 + s] (hue shift from [-hue, hue]) and applied in a random order."""
    return apply_jitter(img, draw_jitter(brightness, contrast, saturation, hue))


def gaussian_blur(img: Image.Image, sigma: float) -> Image.Image:
    # Pillow's GaussianBlur takes the standard deviation as "radius"; DINO's and MoCo v3's
    # GaussianBlur classes call it exactly like this.
    return img.filter(ImageFilter.GaussianBlur(radius=sigma))


def to_float_tensor(img: Image.Image, solarize: bool = False) -> torch.Tensor:
    """An 8-bit image -> a float tensor ``[C, H, W]`` in [0, 1], solarised (ImageOps.solarize:
    v >= 128 becomes 255 - v) if asked."""
    x = TF.pil_to_tensor(img)  # [C, H, W] uint8
    if solarize:
        x = torch.where(x >= 128, 255 - x, x)
    return x.float().div_(255)
