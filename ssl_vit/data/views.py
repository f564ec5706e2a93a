"""View transforms: one image -> a method's augmented views, float tensors ``[C, H, W]`` in [0, 1]:
``SingleView`` (supervised, MPP, fine-tuning), ``TwoViews`` (MoCo v3), ``MultiCrop`` (DINO); and
``EvalTransform``, evaluation's one image -> one tensor. A size left None is the datamodule's ``img_size``."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import NamedTuple

import torch
from PIL import Image
from torchvision.transforms import RandAugment

from ssl_vit.data.augment import (
    RESAMPLE,
    ImageLike,
    Interpolation,
    apply_jitter,
    draw_jitter,
    gaussian_blur,
    random_resized_crop_box,
    resize_center_crop,
    to_float_tensor,
    to_pil,
)
from ssl_vit.data.device_views import pack

# DINO and MoCo v3 draw the blur sigma from U(0.1, 2.0) pixels on 224-px images.
_REF_SIZE, _REF_SIGMA = 224, (0.1, 2.0)


def _blur_sigma(sigma: tuple[float, float] | None, size: int) -> tuple[float, float]:
    # The reference range scaled with the resolution: a 28-px image is blurred as the same picture at 224 px.
    return tuple(sigma) if sigma is not None else (_REF_SIGMA[0] * size / _REF_SIZE, _REF_SIGMA[1] * size / _REF_SIZE)


class ViewParams(NamedTuple):
    """One view's random draws, applied on the CPU or shipped with the image to the device (``device_views.py``)."""

    box: tuple[int, int, int, int]  # the crop: left, top, right, bottom in the image's pixels
    flip: bool
    jitter: list[tuple[int, float]] | None  # (op, factor) in the order applied (augment.draw_jitter); None: none
    grey: bool
    sigma: float  # the blur's sigma in pixels of the view; 0: no blur
    solarize: bool


@dataclass
class Augmentation:
    """One view's chain in DINO's order (MoCo v3 flips last: the same distribution): random resized crop ->
    flip -> (RandAugment, filling with mid-grey as timm's) -> colour jitter -> grayscale -> Gaussian blur
    -> solarise; a PIL image -> ``(view, solarize)``."""

    size: int
    scale: tuple[float, float]
    interpolation: Interpolation
    flip_p: float
    jitter_p: float = 0.0
    jitter: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # brightness, contrast, saturation, hue
    grayscale_p: float = 0.0
    blur_p: float = 0.0
    blur_sigma: tuple[float, float] = _REF_SIGMA
    solarize_p: float = 0.0
    rand_augment: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.scale[0] <= self.scale[1] <= 1.0:
            raise ValueError(f"crop scale must satisfy 0 < min <= max <= 1, got {tuple(self.scale)}")
        names = ("flip_p", "jitter_p", "grayscale_p", "blur_p", "solarize_p")
        if bad := [f"{n}={getattr(self, n)}" for n in names if not 0.0 <= getattr(self, n) <= 1.0]:
            raise ValueError(f"{', '.join(bad)}: a probability must be in [0, 1]")
        self._rand_augment = None
        if self.rand_augment is not None:  # (magnitude on torchvision's and timm's 0..30 scale)
            if len(self.rand_augment) != 2 or self.rand_augment[0] < 1 or not 0 <= self.rand_augment[1] <= 30:
                raise ValueError(f"rand_augment must be (ops, magnitude) with ops >= 1 and magnitude in 0..30, got {list(self.rand_augment)}")
            self._rand_augment = RandAugment(num_ops=self.rand_augment[0], magnitude=self.rand_augment[1], fill=128)

    def draw(self, width: int, height: int, mode: str) -> ViewParams:
        """The view's random parameters for a ``width`` x ``height`` image of PIL ``mode``, drawn from ``random``."""
        box = random_resized_crop_box(width, height, self.scale)
        flip = random.random() < self.flip_p
        jitter = draw_jitter(*self.jitter) if self.jitter_p > 0 and random.random() < self.jitter_p else None
        grey = self.grayscale_p > 0 and mode == "RGB" and random.random() < self.grayscale_p
        sigma = random.uniform(*self.blur_sigma) if self.blur_p > 0 and random.random() < self.blur_p else 0.0
        return ViewParams(box, flip, jitter, grey, sigma, self.solarize_p > 0 and random.random() < self.solarize_p)

    def __call__(self, img: Image.Image) -> tuple[Image.Image, bool]:
        p = self.draw(img.width, img.height, img.mode)
        # Cropped, then resized, as torchvision's resized_crop (no pixels from outside the box).
        img = img.crop(p.box).resize((self.size, self.size), RESAMPLE[self.interpolation])
        if p.flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if self._rand_augment is not None:  # (its draws come from torch's generator)
            img = self._rand_augment(img)
        if p.jitter is not None:
            img = apply_jitter(img, p.jitter)
        if p.grey:
            img = img.convert("L").convert("RGB")
        if p.sigma > 0:
            img = gaussian_blur(img, p.sigma)
        return img, p.solarize


class ViewTransform:
    """Base class of the training view transforms. A transform of one's own implements ``augmentations()``:
    one :class:`Augmentation` per view, the ``n_global_crops`` full-size ones first. ``size_arg`` names
    the argument that ``with_img_size`` sets to the datamodule's ``img_size`` when it is None::

        class ThreeCrops(ViewTransform):
            n_global_crops = 3

            def __init__(self, size: int = 224) -> None:
                self.size = size

            def augmentations(self) -> list[Augmentation]:
                return [Augmentation(self.size, (0.2, 1.0), "bicubic", flip_p=0.5) for _ in range(3)]
    """

    #: number of leading views that are full-size ("global") crops
    n_global_crops: int = 1
    size_arg: str | None = None

    def __post_init__(self) -> None:
        if self.size_arg is not None and getattr(self, self.size_arg) is not None:
            self.augmentations()  # checked now, not later inside a DataLoader worker

    def augmentations(self) -> list[Augmentation]:
        raise NotImplementedError

    @property
    def num_views(self) -> int:
        return len(self.augmentations())

    def with_img_size(self, img_size: int) -> ViewTransform:
        """A copy whose size argument, if None, is ``img_size``; another size is an error."""
        if self.size_arg is None:
            return self
        if (current := getattr(self, self.size_arg)) not in (None, img_size):
            raise ValueError(f"{type(self).__name__}.{self.size_arg}={current} differs from the datamodule's img_size={img_size}; "
                             f"leave {self.size_arg} unset (None) or make them equal")
        new = copy.copy(self)
        setattr(new, self.size_arg, img_size)
        new.augmentations()  # checked now, not later inside a DataLoader worker
        return new

    def _size(self) -> int:
        if (size := getattr(self, self.size_arg or "size")) is None:
            raise ValueError(f"{type(self).__name__}.{self.size_arg} is not set: pass it, or let a datamodule fill it from its img_size")
        return size

    def __call__(self, image: ImageLike) -> list[torch.Tensor] | dict[str, torch.Tensor]:
        img = to_pil(image)
        if getattr(self, "on_device", False):  # the worker's half: the image and the draws (device_views.py)
            return pack(img, self.augmentations(), self.canvas or self._size() * 16 // 7)
        return [to_float_tensor(*augment(img)) for augment in self.augmentations()]


@dataclass(eq=False)
class SingleView(ViewTransform):
    """One view: random resized crop (the Inception crop of DeiT / timm training) + horizontal flip.

    Args:
        size: output size in pixels (None: the datamodule's img_size).
        scale: the crop's area range as a fraction of the image (small images want a larger minimum).
        flip_p: probability of a horizontal flip.
        augment: False: the evaluation geometry (resize + centre crop) instead.
        interpolation: resampling filter of the resize.
        rand_augment: ``(ops, magnitude)`` of RandAugment (Cubuk et al. 2020) after the flip, as DeiT /
            MAE fine-tune (timm's ``rand-m9-mstd0.5-inc1``: 2 ops, magnitude 9 of 30); None: off.
    """

    size_arg = "size"
    size: int | None = None
    scale: tuple[float, float] = (0.08, 1.0)
    flip_p: float = 0.5
    augment: bool = True
    interpolation: Interpolation = "bilinear"
    rand_augment: tuple[int, int] | None = None

    def augmentations(self) -> list[Augmentation]:
        return [Augmentation(self._size(), self.scale, self.interpolation, self.flip_p, rand_augment=self.rand_augment)]

    def __call__(self, image: ImageLike) -> list[torch.Tensor]:
        if self.augment:
            return super().__call__(image)
        return [EvalTransform(self._size(), interpolation=self.interpolation)(image)]


@dataclass(eq=False)
class TwoViews(ViewTransform):
    """MoCo v3's two asymmetric views with BYOL's augmentations (BYOL Table 6; MoCo v3 main_moco.py):
    crop, flip, colour jitter, grayscale, then mostly blur on view 1 and sometimes solarisation on view 2.

    Args:
        size, scale, flip_p: as in SingleView.
        jitter_p, brightness, contrast, saturation, hue: the colour jitter's probability and strengths (torchvision's).
        grayscale_p: probability of turning grey.
        blur_p, solarize_p: the blur's and the solarisation's probability in (view 1, view 2).
        blur_sigma: range of the blur's sigma in pixels (None: (0.1, 2.0) scaled by size / 224).
        interpolation: resampling filter of the crop (MoCo v3: torchvision's default).
        on_device, canvas: make the views on the training device (``device_views.py``), workers fitting the image
            into a ``canvas``-px square (None: size * 16 / 7, 512 at 224 px: ImageNet's images whole).
    """

    n_global_crops = 2
    size_arg = "size"
    size: int | None = None
    scale: tuple[float, float] = (0.08, 1.0)
    flip_p: float = 0.5
    jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.2
    hue: float = 0.1
    grayscale_p: float = 0.2
    blur_p: tuple[float, float] = (1.0, 0.1)
    blur_sigma: tuple[float, float] | None = None
    solarize_p: tuple[float, float] = (0.0, 0.2)
    interpolation: Interpolation = "bilinear"
    on_device: bool = False
    canvas: int | None = None

    def augmentations(self) -> list[Augmentation]:
        size, jitter = self._size(), (self.brightness, self.contrast, self.saturation, self.hue)
        return [Augmentation(size, self.scale, self.interpolation, self.flip_p, self.jitter_p, jitter, self.grayscale_p,
                             self.blur_p[i], _blur_sigma(self.blur_sigma, size), self.solarize_p[i]) for i in range(2)]


@dataclass(eq=False)
class MultiCrop(ViewTransform):
    """DINO's multi-crop (DINO §3.1; main_dino.py DataAugmentationDINO): 2 global crops, then
    ``n_local_crops`` smaller local crops, all with TwoViews' colour augmentations at DINO's rates.

    Args:
        global_size: size of the global crops (None: the datamodule's img_size).
        local_size: size of the local crops (None: global_size * 96 / 224 to a multiple of 4).
        n_local_crops: number of local crops (DINO: 8 by default, 10 in its best setting).
        global_scale, local_scale: the crops' area ranges.
        flip_p, jitter_p, brightness, contrast, saturation, hue, grayscale_p: as in TwoViews.
        blur_p: blur probability of (global 1, global 2, locals).
        blur_sigma: as in TwoViews, scaled by global_size (the same range for every crop, as DINO's).
        solarize_p: solarisation probability of the second global crop.
        interpolation: resampling filter of the crops.
        on_device, canvas: as in TwoViews (the canvas from global_size).
    """

    n_global_crops = 2
    size_arg = "global_size"
    global_size: int | None = None
    local_size: int | None = None
    n_local_crops: int = 8
    global_scale: tuple[float, float] = (0.4, 1.0)
    local_scale: tuple[float, float] = (0.05, 0.4)
    flip_p: float = 0.5
    jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.2
    hue: float = 0.1
    grayscale_p: float = 0.2
    blur_p: tuple[float, float, float] = (1.0, 0.1, 0.5)
    blur_sigma: tuple[float, float] | None = None
    solarize_p: float = 0.2
    interpolation: Interpolation = "bicubic"
    on_device: bool = False
    canvas: int | None = None

    @property
    def resolved_local_size(self) -> int:
        return self.local_size if self.local_size is not None else max(8, 4 * round(self._size() * 96 / 224 / 4))

    def augmentations(self) -> list[Augmentation]:
        global_size, local_size = self._size(), self.resolved_local_size
        if local_size > global_size:
            raise ValueError(f"MultiCrop.local_size ({local_size}) must not exceed global_size ({global_size})")
        common = dict(interpolation=self.interpolation, flip_p=self.flip_p, jitter_p=self.jitter_p, grayscale_p=self.grayscale_p,
                      jitter=(self.brightness, self.contrast, self.saturation, self.hue), blur_sigma=_blur_sigma(self.blur_sigma, global_size))
        global_1 = Augmentation(global_size, self.global_scale, blur_p=self.blur_p[0], **common)
        global_2 = Augmentation(global_size, self.global_scale, blur_p=self.blur_p[1], solarize_p=self.solarize_p, **common)
        local = Augmentation(local_size, self.local_scale, blur_p=self.blur_p[2], **common)
        return [global_1, global_2] + [local] * self.n_local_crops


class EvalTransform:
    """Evaluation's transform: one image -> one float tensor ``[C, size, size]`` in [0, 1] (resize and
    centre crop). ``crop_pct`` None: 1 for an image already ``size`` x ``size``, else timm's 0.875."""

    def __init__(self, size: int, crop_pct: float | None = None, interpolation: Interpolation = "bicubic") -> None:
        if crop_pct is not None and not 0.0 < crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
        self.size, self.crop_pct, self.interpolation = size, crop_pct, interpolation

    def crop_for(self, image: Image.Image) -> float:
        """The crop fraction ``image`` is evaluated with."""
        return self.crop_pct or (1.0 if image.size == (self.size, self.size) else 0.875)

    def __call__(self, image: ImageLike) -> torch.Tensor:
        img = to_pil(image)
        return to_float_tensor(resize_center_crop(img, self.size, self.crop_for(img), self.interpolation))
