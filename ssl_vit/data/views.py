"""View transforms: one image -> the list of augmented views a pretext task trains on.

Every transform maps one image (PIL, or a uint8 tensor ``[C, H, W]``) to a list of float tensors
``[C, H, W]`` in [0, 1]. They know nothing of mean/std: the datamodule normalises afterwards.

* ``SingleView`` — supervised baseline and masked patch prediction (one view).
* ``TwoViews``   — MoCo v3 (BYOL's asymmetric augmentations, two views).
* ``MultiCrop``  — DINO (2 global + N local crops).

Sizes left as ``None`` are filled in by the datamodule from its ``img_size`` (``with_img_size``),
so a recipe states the resolution once. For 28–32 px images the Gaussian-blur sigma range is
scaled with the image (see ``blur_sigma``). Random parameters come from Python's ``random``
module, which PyTorch's DataLoader seeds separately in each worker, so workers never repeat each
other's augmentations (a per-object generator would be copied into every worker).
"""

from __future__ import annotations

import copy
import random

import torch
from PIL import Image
from torchvision.transforms import RandAugment

from ssl_vit.data.augment import (
    RESAMPLE,
    ImageLike,
    Interpolation,
    color_jitter,
    gaussian_blur,
    random_resized_crop_box,
    to_float_tensors,
    to_pil,
)
from ssl_vit.data.single_image import EvalTransform

# DINO and MoCo v3 draw the blur sigma from U(0.1, 2.0) pixels on 224-px images.
_REF_SIZE = 224
_REF_SIGMA = (0.1, 2.0)


def _blur_sigma(sigma: tuple[float, float] | None, size: int) -> tuple[float, float]:
    # Scale the reference range with the resolution, so a 28-px image is blurred as much as the
    # same picture at 224 px would be (sigma <= 0.25 px: almost none, as SimCLR did on CIFAR).
    if sigma is not None:
        return (float(sigma[0]), float(sigma[1]))
    return (_REF_SIGMA[0] * size / _REF_SIZE, _REF_SIGMA[1] * size / _REF_SIZE)


def _check_prob(name: str, p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {p}")


def _check_scale(name: str, scale: tuple[float, float]) -> None:
    if not (0.0 < scale[0] <= scale[1] <= 1.0):
        raise ValueError(f"{name} must satisfy 0 < min <= max <= 1, got {scale}")


class ViewRecipe:
    """The augmentation chain of one view: random resized crop -> flip -> (RandAugment) -> colour
    jitter -> grayscale -> Gaussian blur -> solarise (DINO's order; MoCo v3 flips last, which gives
    the same distribution since flipping commutes with the per-pixel and isotropic operations).
    ``rand_augment``: ``(ops, magnitude)`` of torchvision's RandAugment after the flip, as DeiT /
    MAE fine-tune (their timm transform's order), its geometric ops filling with mid-grey."""

    def __init__(
        self,
        size: int,
        scale: tuple[float, float],
        interpolation: Interpolation,
        flip_p: float,
        jitter_p: float = 0.0,
        jitter: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0),
        grayscale_p: float = 0.0,
        blur_p: float = 0.0,
        blur_sigma: tuple[float, float] = _REF_SIGMA,
        solarize_p: float = 0.0,
        rand_augment: tuple[int, int] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"crop size must be positive, got {size}")
        _check_scale("crop scale", scale)
        for name, p in (("flip_p", flip_p), ("jitter_p", jitter_p), ("grayscale_p", grayscale_p),
                        ("blur_p", blur_p), ("solarize_p", solarize_p)):
            _check_prob(name, p)
        self.size = size
        self.scale = scale
        self.resample = RESAMPLE[interpolation]
        self.flip_p, self.jitter_p, self.jitter = flip_p, jitter_p, jitter
        self.grayscale_p, self.blur_p, self.blur_sigma = grayscale_p, blur_p, blur_sigma
        self.solarize_p = solarize_p
        ops = None if rand_augment is None else check_rand_augment(rand_augment)
        self.rand_augment = None if ops is None else RandAugment(num_ops=ops[0], magnitude=ops[1], fill=128)

    def __call__(self, img: Image.Image) -> tuple[Image.Image, bool]:
        box = random_resized_crop_box(img.width, img.height, self.scale)
        # Cropped, then resized, as torchvision's resized_crop: a resize of a box of the whole
        # image would filter the pixels just outside it into the crop's border.
        img = img.crop(box).resize((self.size, self.size), self.resample)
        if random.random() < self.flip_p:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if self.rand_augment is not None:  # (its draws come from torch's generator)
            img = self.rand_augment(img)
        if self.jitter_p > 0 and random.random() < self.jitter_p:
            img = color_jitter(img, *self.jitter)
        if self.grayscale_p > 0 and img.mode == "RGB" and random.random() < self.grayscale_p:
            img = img.convert("L").convert("RGB")
        if self.blur_p > 0 and random.random() < self.blur_p:
            img = gaussian_blur(img, random.uniform(*self.blur_sigma))
        solarize = self.solarize_p > 0 and random.random() < self.solarize_p
        return img, solarize


class ViewTransform:
    """Base class (and the type datamodules accept) of the view transforms.

    A transform of one's own subclasses it: ``build_views()`` returns one :class:`ViewRecipe` per
    view (global crops first, ``n_global`` of them), ``with_img_size(img_size)`` returns a copy
    with any unset crop size filled in for the data's images. Calling the transform gives the
    views as float tensors ``[C, H, W]`` in [0, 1], which the datamodule normalises::

        class ThreeCrops(ViewTransform):
            n_global = 3

            def __init__(self, size: int = 224) -> None:
                super().__init__()
                self.size = size

            def with_img_size(self, img_size: int) -> ThreeCrops:
                return self

            def build_views(self) -> list[ViewRecipe]:
                return [ViewRecipe(self.size, (0.2, 1.0), "bicubic", flip_p=0.5) for _ in range(3)]
    """

    #: number of leading views that are full-size ("global") crops
    n_global: int = 1

    def __init__(self) -> None:
        self._recipes: list[ViewRecipe] | None = None

    @property
    def num_views(self) -> int:
        return len(self.recipes())

    def with_img_size(self, img_size: int) -> ViewTransform:
        """A copy with the sizes left as None set for ``img_size`` images; an explicit size that
        disagrees with ``img_size`` is an error (the backbone is built for ``img_size``)."""
        raise NotImplementedError

    def build_views(self) -> list[ViewRecipe]:
        """One recipe per view, the global crops first."""
        raise NotImplementedError

    def recipes(self) -> list[ViewRecipe]:
        """The views' recipes (built once)."""
        if self._recipes is None:
            self._recipes = self.build_views()
        return self._recipes

    def __call__(self, image: ImageLike) -> list[torch.Tensor]:
        img = to_pil(image)
        views = [recipe(img) for recipe in self.recipes()]
        return to_float_tensors([v[0] for v in views], [v[1] for v in views])

    def _resolved(self, attr: str, img_size: int, default: int | None = None) -> ViewTransform:
        current = getattr(self, attr)
        if current is not None and current != img_size:
            raise ValueError(
                f"{type(self).__name__}.{attr}={current} differs from the datamodule's "
                f"img_size={img_size}; leave {attr} unset (None) or make them equal"
            )
        new = copy.copy(self)
        setattr(new, attr, img_size)
        new._recipes = None
        new.recipes()  # validate now, not later inside a DataLoader worker
        return new

    @staticmethod
    def _require(name: str, value: int | None) -> int:
        if value is None:
            raise ValueError(
                f"{name} is not set: pass it explicitly, or let a datamodule fill it from its img_size"
            )
        return value

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class SingleView(ViewTransform):
    """One view for the supervised baseline and masked patch prediction.

    Random resized crop (Inception crop, as in DeiT/timm training) + horizontal flip. The default
    scale (0.08, 1) is the standard for 224-px natural images; on 28–32 px images it is harsh
    (8 % of a 28-px image is 8x8 pixels), so small-image recipes use e.g. (0.35, 1).
    ``augment=False`` gives the deterministic evaluation geometry (resize + centre crop) instead.

    Args:
        size: output size in pixels (None: the datamodule's img_size).
        scale: range of the crop's area as a fraction of the image.
        flip_p: probability of a horizontal flip.
        augment: False turns all augmentation off.
        interpolation: resampling filter of the crop resize.
        rand_augment: ``(ops, magnitude)``: RandAugment (Cubuk et al. 2020; :class:`ViewRecipe`)
            after the crop and flip, as DeiT / MAE fine-tune (timm's ``rand-m9-mstd0.5-inc1``: 2
            ops at magnitude 9 of 30, which timm also jitters with std 0.5); None: off.
    """

    def __init__(
        self,
        size: int | None = None,
        scale: tuple[float, float] = (0.08, 1.0),
        flip_p: float = 0.5,
        augment: bool = True,
        interpolation: Interpolation = "bilinear",
        rand_augment: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.size = size
        self.scale = scale
        self.flip_p = flip_p
        self.augment = augment
        self.interpolation = interpolation
        _check_scale("scale", scale)
        _check_prob("flip_p", flip_p)
        self.rand_augment = None if rand_augment is None else check_rand_augment(rand_augment)

    def with_img_size(self, img_size: int) -> SingleView:
        return self._resolved("size", img_size)  # type: ignore[return-value]

    def build_views(self) -> list[ViewRecipe]:
        size = self._require("SingleView.size", self.size)
        return [ViewRecipe(size, self.scale, self.interpolation, self.flip_p, rand_augment=self.rand_augment)]

    def __call__(self, image: ImageLike) -> list[torch.Tensor]:
        if self.augment:
            return super().__call__(image)
        size = self._require("SingleView.size", self.size)
        return [EvalTransform(size, interpolation=self.interpolation)(image)]


def check_rand_augment(value: tuple[int, int]) -> tuple[int, int]:
    values = list(value)  # (a recipe gives a list)
    if len(values) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in values) or values[0] < 1 or not 0 <= values[1] <= 30:
        raise ValueError(f"rand_augment must be (ops, magnitude), integers with ops >= 1 and magnitude in 0..30, got {values}")
    return values[0], values[1]


class TwoViews(ViewTransform):
    """MoCo v3's two asymmetric views (BYOL's augmentations; specs §3, MoCo v3 main_moco.py).

    Both views: random resized crop scale (0.08, 1), flip, colour jitter (0.4, 0.4, 0.2, 0.1)
    with p 0.8, grayscale p 0.2; Gaussian blur p 1.0 on the first view and 0.1 on the second;
    solarisation p 0 on the first and 0.2 on the second.

    Args:
        size: output size in pixels (None: the datamodule's img_size).
        scale: range of the crop's area as a fraction of the image.
        flip_p: probability of a horizontal flip.
        jitter_p: probability of applying colour jitter.
        brightness, contrast, saturation, hue: colour-jitter strengths (torchvision's meaning).
        grayscale_p: probability of converting to grey.
        blur_p: blur probability of (view 1, view 2).
        blur_sigma: range of the blur's sigma in pixels (None: (0.1, 2.0) scaled by size / 224).
        solarize_p: solarisation probability of (view 1, view 2).
        interpolation: resampling filter of the crop resize (MoCo v3 uses torchvision's default).
    """

    n_global = 2

    def __init__(
        self,
        size: int | None = None,
        scale: tuple[float, float] = (0.08, 1.0),
        flip_p: float = 0.5,
        jitter_p: float = 0.8,
        brightness: float = 0.4,
        contrast: float = 0.4,
        saturation: float = 0.2,
        hue: float = 0.1,
        grayscale_p: float = 0.2,
        blur_p: tuple[float, float] = (1.0, 0.1),
        blur_sigma: tuple[float, float] | None = None,
        solarize_p: tuple[float, float] = (0.0, 0.2),
        interpolation: Interpolation = "bilinear",
    ) -> None:
        super().__init__()
        self.size = size
        self.scale = scale
        self.flip_p = flip_p
        self.jitter_p = jitter_p
        self.brightness, self.contrast, self.saturation, self.hue = brightness, contrast, saturation, hue
        self.grayscale_p = grayscale_p
        self.blur_p = blur_p
        self.blur_sigma = blur_sigma
        self.solarize_p = solarize_p
        self.interpolation = interpolation
        if size is not None:
            self.build_views()  # validate now rather than in a worker

    def with_img_size(self, img_size: int) -> TwoViews:
        return self._resolved("size", img_size)  # type: ignore[return-value]

    def build_views(self) -> list[ViewRecipe]:
        size = self._require("TwoViews.size", self.size)
        if len(self.blur_p) != 2 or len(self.solarize_p) != 2:
            raise ValueError(f"blur_p and solarize_p need one value per view (2), got {self.blur_p}, {self.solarize_p}")
        sigma = _blur_sigma(self.blur_sigma, size)
        jitter = (self.brightness, self.contrast, self.saturation, self.hue)
        return [
            ViewRecipe(size, self.scale, self.interpolation, self.flip_p, self.jitter_p, jitter,
                        self.grayscale_p, self.blur_p[i], sigma, self.solarize_p[i])
            for i in range(2)
        ]


class MultiCrop(ViewTransform):
    """DINO's multi-crop (specs §4; DINO main_dino.py DataAugmentationDINO).

    Views: 2 global crops (scale (0.4, 1), ``global_size``) followed by ``n_local`` local crops
    (scale (0.05, 0.4), ``local_size``). All get flip, colour jitter (0.4, 0.4, 0.2, 0.1) with
    p 0.8 and grayscale p 0.2; Gaussian blur p 1.0 (first global), 0.1 (second global), 0.5
    (locals); solarisation p 0.2 on the second global crop only. Bicubic resizing as in DINO.

    Args:
        global_size: size of the global crops (None: the datamodule's img_size).
        local_size: size of the local crops (None: global_size * 96 / 224 rounded to a multiple
            of 4: 224 -> 96, 28 -> 12, 32 -> 12, 96 -> 40).
        n_local: number of local crops (DINO: 8 by default, 10 in its best setting).
        global_scale, local_scale: crop area ranges.
        flip_p, jitter_p, brightness, contrast, saturation, hue, grayscale_p: as in TwoViews.
        blur_p: blur probability of (global 1, global 2, locals).
        blur_sigma: range of the blur's sigma in pixels (None: (0.1, 2.0) scaled by
            global_size / 224, the same range for global and local crops as in DINO).
        solarize_p: solarisation probability of the second global crop.
        interpolation: resampling filter of the crop resize.
    """

    n_global = 2

    def __init__(
        self,
        global_size: int | None = None,
        local_size: int | None = None,
        n_local: int = 8,
        global_scale: tuple[float, float] = (0.4, 1.0),
        local_scale: tuple[float, float] = (0.05, 0.4),
        flip_p: float = 0.5,
        jitter_p: float = 0.8,
        brightness: float = 0.4,
        contrast: float = 0.4,
        saturation: float = 0.2,
        hue: float = 0.1,
        grayscale_p: float = 0.2,
        blur_p: tuple[float, float, float] = (1.0, 0.1, 0.5),
        blur_sigma: tuple[float, float] | None = None,
        solarize_p: float = 0.2,
        interpolation: Interpolation = "bicubic",
    ) -> None:
        super().__init__()
        if n_local < 0:
            raise ValueError(f"n_local must be >= 0, got {n_local}")
        self.global_size = global_size
        self.local_size = local_size
        self.n_local = n_local
        self.global_scale = global_scale
        self.local_scale = local_scale
        self.flip_p = flip_p
        self.jitter_p = jitter_p
        self.brightness, self.contrast, self.saturation, self.hue = brightness, contrast, saturation, hue
        self.grayscale_p = grayscale_p
        self.blur_p = blur_p
        self.blur_sigma = blur_sigma
        self.solarize_p = solarize_p
        self.interpolation = interpolation
        if global_size is not None:
            self.build_views()

    @property
    def resolved_local_size(self) -> int:
        if self.local_size is not None:
            return self.local_size
        global_size = self._require("MultiCrop.global_size", self.global_size)
        return max(8, 4 * round(global_size * 96 / 224 / 4))

    def with_img_size(self, img_size: int) -> MultiCrop:
        return self._resolved("global_size", img_size)  # type: ignore[return-value]

    def build_views(self) -> list[ViewRecipe]:
        global_size = self._require("MultiCrop.global_size", self.global_size)
        local_size = self.resolved_local_size
        if len(self.blur_p) != 3:
            raise ValueError(f"blur_p needs 3 values (global 1, global 2, locals), got {self.blur_p}")
        if local_size > global_size:
            raise ValueError(f"local_size ({local_size}) must not exceed global_size ({global_size})")
        sigma = _blur_sigma(self.blur_sigma, global_size)
        jitter = (self.brightness, self.contrast, self.saturation, self.hue)
        common = dict(interpolation=self.interpolation, flip_p=self.flip_p, jitter_p=self.jitter_p,
                      jitter=jitter, grayscale_p=self.grayscale_p, blur_sigma=sigma)
        global_1 = ViewRecipe(global_size, self.global_scale, blur_p=self.blur_p[0], **common)
        global_2 = ViewRecipe(global_size, self.global_scale, blur_p=self.blur_p[1],
                               solarize_p=self.solarize_p, **common)
        local = ViewRecipe(local_size, self.local_scale, blur_p=self.blur_p[2], **common)
        return [global_1, global_2] + [local] * self.n_local
