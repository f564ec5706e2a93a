"""Views made on the training device (``TwoViews`` / ``MultiCrop`` with ``on_device: true``): a worker
only fits the image into a ``canvas`` square and draws the views' parameters with the CPU path's
seeded sampler (``pack``); after the transfer ``make_views`` crops and resizes every view of the
batch with one ``roi_align`` per resolution and applies BYOL's colour augmentations (Table 6)
batched, with per-sample parameters and jitter order.

The pixels differ from the CPU path's by design (``tests/test_device_views.py`` bounds it): a bilinear,
box-averaging resize, float values between the operations, an exact hue shift and Gaussian blur, and
an image larger than the canvas downscaled first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from torchvision.ops import roi_align

from ssl_vit.data.augment import LUMA

if TYPE_CHECKING:
    from ssl_vit.data.views import Augmentation


def pack(img: Image.Image, augmentations: Sequence[Augmentation], canvas: int) -> dict[str, Tensor]:
    """The worker's half for one image (``L`` or ``RGB``): the image in the top-left corner of a zeroed
    uint8 ``[canvas, canvas, C]`` (downscaled to fit if larger) and each of the V views' parameters,
    drawn for the original image, the boxes mapped onto the canvas."""
    params = [a.draw(img.width, img.height, img.mode) for a in augmentations]
    width, height = img.size
    if (scale := canvas / max(width, height)) < 1:
        img = img.resize((max(1, round(width * scale)), max(1, round(height * scale))), Image.Resampling.BILINEAR, reducing_gap=2.0)
    pixels = np.asarray(img).reshape(img.height, img.width, -1)  # [h, w, C] uint8
    out = np.zeros((canvas, canvas, pixels.shape[2]), dtype=np.uint8)
    out[: img.height, : img.width] = pixels
    sx, sy = img.width / width, img.height / height
    order = torch.full((len(params), 4), -1, dtype=torch.int8)  # [V, 4]: the jitter op at each position; -1: none
    factors = torch.tensor([[1.0, 1.0, 1.0, 0.0]]).repeat(len(params), 1)  # [V, 4]: brightness, contrast, saturation, hue
    for v, p in enumerate(params):
        for k, (op, factor) in enumerate(p.jitter or []):
            order[v, k], factors[v, op] = op, factor
    boxes = torch.tensor([[x0 * sx, y0 * sy, x1 * sx, y1 * sy] for x0, y0, x1, y1 in (p.box for p in params)])  # [V, 4] on the canvas
    return {"canvas": torch.from_numpy(out), "boxes": boxes, "order": order, "factors": factors,
            **{k: torch.tensor([getattr(p, k) for p in params]) for k in ("flip", "grey", "sigma", "solarize")}}


def make_views(packed: dict[str, Tensor], augmentations: Sequence[Augmentation], mean: Sequence[float], std: Sequence[float]) -> list[Tensor]:
    """The device's half: a collated batch of :func:`pack` outputs (``canvas [B, S, S, C]``, the
    rest ``[B, V, ...]``) -> the V normalised views ``[B, C, size, size]`` in the augmentations' order."""
    canvas = packed["canvas"].permute(0, 3, 1, 2).float().div_(255)  # [B, S, S, C] -> [B, C, S, S]
    b, c = canvas.shape[:2]
    mean_, std_ = (torch.tensor(m, device=canvas.device, dtype=canvas.dtype).view(1, -1, 1, 1) for m in (mean, std))
    views: dict[int, Tensor] = {}
    for size in sorted({a.size for a in augmentations}):  # one roi_align per resolution
        idx = [v for v, a in enumerate(augmentations) if a.size == size]
        # The group's parameters, view-major: row v * B + i is view idx[v] of image i.
        take = {k: packed[k][:, idx].transpose(0, 1).flatten(0, 1) for k in ("boxes", "flip", "order", "factors", "grey", "sigma", "solarize")}
        image = torch.arange(b, device=canvas.device, dtype=canvas.dtype).repeat(len(idx))[:, None]  # [N, 1]
        # aligned: a box (left, top, right, bottom) covers pixels left..right-1, as PIL's crop; the
        # adaptive sampling (ceil(box / size) points a bin) averages over the box when shrinking.
        x = roi_align(canvas, torch.cat([image, take["boxes"].to(canvas.dtype)], 1), size, sampling_ratio=-1, aligned=True)  # [N, C, s, s]
        x = torch.where(take["flip"].view(-1, 1, 1, 1), x.flip(-1), x)
        x = color_jitter(x, take["order"], take["factors"])
        if c == 3:
            x = torch.where(take["grey"].view(-1, 1, 1, 1), _luma(x).expand_as(x), x)
        if (blurred := take["sigma"] > 0).any():
            radius = int(torch.ceil(3 * take["sigma"].max()))  # (truncated at 3 sigma: Pillow's three box blurs reach as far)
            x[blurred] = gaussian_blur(x[blurred], take["sigma"][blurred], radius)
        x = torch.where(take["solarize"].view(-1, 1, 1, 1) & (x >= 127.5 / 255), 1 - x, x)  # Pillow's solarize: v >= 128 -> 255 - v
        for v, view in zip(idx, ((x - mean_) / std_).chunk(len(idx))):
            views[v] = view
    return [views[v] for v in range(len(augmentations))]


def _luma(x: Tensor) -> Tensor:
    """``[N, C, H, W]`` -> its grey ``[N, 1, H, W]``."""
    return x if x.shape[1] == 1 else sum(w * x[:, i : i + 1] for i, w in enumerate(LUMA))


def _blend(x: Tensor, other: Tensor | float, factor: Tensor) -> Tensor:
    f = factor.view(-1, 1, 1, 1)
    return (f * x + (1 - f) * other).clamp_(0, 1)


def shift_hue(x: Tensor, shift: Tensor) -> Tensor:
    """Rotate the HSV hue of ``x [N, 3, H, W]`` in [0, 1] by ``shift [N]`` turns (torchvision's
    tensor ``adjust_hue``, one shift per sample): RGB -> hue, then V - V S clamp(min(k, 4 - k), 0, 1)
    with k = (n + 6 H) mod 6, n = 5, 3, 1 for R, G, B."""
    top, low = x.amax(1), x.amin(1)  # [N, H, W]: V, and V (1 - S)
    delta = top - low
    r, g, b = ((top - x[:, i]) / delta.clamp_min(1e-12) for i in range(3))
    hue = torch.where(top == x[:, 0], b - g, torch.where(top == x[:, 1], 2 + r - b, 4 + g - r)) / 6  # [N, H, W] in turns
    k = ((hue + shift.view(-1, 1, 1)).unsqueeze(1) * 6 + torch.tensor([5.0, 3.0, 1.0], device=x.device).view(1, 3, 1, 1)) % 6
    return top.unsqueeze(1) - delta.unsqueeze(1) * torch.minimum(k, 4 - k).clamp(0, 1)


def color_jitter(x: Tensor, order: Tensor, factors: Tensor) -> Tensor:
    """torchvision's ColorJitter per sample on ``x [N, C, H, W]``: at each of the 4 positions of
    ``order [N, 4]`` (-1: none), the op it names with its factor from ``factors [N, 4]``, as Pillow's
    ImageEnhance (the CPU path) blends: with black, the grey mean, the grey image; then the hue."""
    for k in range(4):
        for op in range(4 if x.shape[1] == 3 else 2):  # (a grey image has no saturation or hue)
            if not (rows := order[:, k] == op).any():
                continue
            y, f = x[rows], factors[rows, op]
            if op == 0:
                y = _blend(y, 0.0, f)
            elif op == 1:
                y = _blend(y, _luma(y).mean((1, 2, 3), keepdim=True), f)
            elif op == 2:
                y = _blend(y, _luma(y), f)
            else:
                y = shift_hue(y, f)
            x[rows] = y
    return x


def gaussian_blur(x: Tensor, sigma: Tensor, radius: int) -> Tensor:
    """``x [N, C, H, W]`` blurred with a Gaussian of ``sigma [N]`` pixels per sample: one separable
    depthwise convolution with N x C kernels of 2 radius + 1 taps, edges replicated (as Pillow's)."""
    n, c, h, w = x.shape
    taps = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (taps / sigma.view(-1, 1)) ** 2)  # [N, K]
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(c, 0)  # [N*C, K]
    y = F.pad(x.reshape(1, n * c, h, w), (radius,) * 4, mode="replicate")
    y = F.conv2d(y, kernel.view(n * c, 1, 1, -1), groups=n * c)  # along rows: [1, N*C, H + 2r, W]
    return F.conv2d(y, kernel.view(n * c, 1, -1, 1), groups=n * c).view(n, c, h, w)
