"""Transforms of one image to one tensor: evaluation's deterministic resize and centre crop
(``EvalTransform``), and a one-view training transform as fine-tuning's (``OneView``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ssl_vit.data.augment import (
    RESAMPLE,
    ImageLike,
    Interpolation,
    resize_center_crop,
    to_float_tensors,
    to_pil,
)

if TYPE_CHECKING:
    from ssl_vit.data.views import ViewTransform


class OneView:
    """A one-view :class:`ViewTransform` (e.g. ``SingleView``) as a transform of one image to one
    tensor ``[C, size, size]``: the training split of fine-tuning, whose items are single images."""

    def __init__(self, views: ViewTransform) -> None:
        if views.num_views != 1:
            raise ValueError(f"OneView needs a transform of one view, {type(views).__name__} makes {views.num_views}")
        self.views = views

    def __call__(self, image: ImageLike) -> torch.Tensor:
        return self.views(image)[0]

    def __repr__(self) -> str:
        return f"OneView({self.views!r})"


class EvalTransform:
    """Deterministic evaluation transform: one image -> one float tensor ``[C, size, size]`` in
    [0, 1]. Images already ``size`` × ``size`` are kept (e.g. 28-px Fashion-MNIST at img_size 28);
    every other one is resized to short side ``size / crop_pct`` and centre-cropped (the
    224-from-256 protocol of DINO's and timm's eval).
    """

    def __init__(self, size: int, crop_pct: float = 0.875, interpolation: Interpolation = "bicubic") -> None:
        if not 0.0 < crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
        self.size = size
        self.crop_pct = crop_pct
        self.interpolation = interpolation

    def __call__(self, image: ImageLike) -> torch.Tensor:
        img = resize_center_crop(to_pil(image), self.size, self.crop_pct, RESAMPLE[self.interpolation])
        return to_float_tensors([img], [False])[0]

    def __repr__(self) -> str:
        return f"EvalTransform(size={self.size}, crop_pct={self.crop_pct}, interpolation={self.interpolation!r})"
