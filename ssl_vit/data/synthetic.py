"""Deterministic synthetic images for tests and smoke runs: no files, no downloads."""

from __future__ import annotations

import math
from typing import Literal

import torch

from ssl_vit.data.base import ImageDataModule
from ssl_vit.data.datasets import InMemoryImages


def make_synthetic_images(num_samples: int, img_size: int, in_chans: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-dependent oriented stripes plus noise: uint8 ``[N, S, S]`` (grey) or ``[N, S, S, 3]`` and
    labels ``[N]`` (balanced, shuffled). Class k: stripes at angle pi * k / K with 2 + k % 3 cycles per
    image and (RGB) a class tint; the phase jitters a little, so raw pixels already separate the classes."""
    gen = torch.Generator().manual_seed(seed)
    labels = (torch.arange(num_samples) % num_classes)[torch.randperm(num_samples, generator=gen)]
    k = labels.double()
    theta = math.pi * k / num_classes  # [N]
    freq = 2.0 + (labels % 3).double()  # [N] cycles per image
    phase = (torch.rand(num_samples, generator=gen, dtype=torch.float64) - 0.5) * 1.2  # [N]
    amp = 0.25 + 0.1 * torch.rand(num_samples, generator=gen, dtype=torch.float64)  # [N]
    grid = torch.linspace(0.0, 1.0, img_size, dtype=torch.float64)
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")  # [S, S]
    proj = xx * torch.cos(theta)[:, None, None] + yy * torch.sin(theta)[:, None, None]  # [N, S, S]
    stripes = amp[:, None, None] * torch.cos(2 * math.pi * freq[:, None, None] * proj + phase[:, None, None])
    if in_chans == 1:
        img = 0.5 + stripes  # [N, S, S]
    else:
        # A hue per class: tint_c = 0.5 + 0.2 cos(2 pi (k / K + c / 3)).
        c = torch.arange(3, dtype=torch.float64)
        tint = 0.5 + 0.2 * torch.cos(2 * math.pi * (k[:, None] / num_classes + c[None, :] / 3))  # [N, 3]
        img = tint[:, None, None, :] + stripes[..., None]  # [N, S, S, 3]
    img = img + 0.08 * torch.randn(img.shape, generator=gen, dtype=torch.float64)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8), labels


class SyntheticDataModule(ImageDataModule):
    """Generated, labelled images (``make_synthetic_images``), reproducible from ``seed``.

    Args:
        num_samples: training images.
        num_test_samples: test images (drawn with another stream of the same seed; 0: no test split).
        num_classes: number of classes.
        img_size, in_chans, **kwargs: ``ImageDataModule``'s (the images are generated at img_size).
    """

    # Approximate pixel statistics of the generator.
    dataset_mean = (0.5,)
    dataset_std = (0.25,)

    def __init__(self, num_samples: int = 1024, num_test_samples: int = 256, num_classes: int = 10, img_size: int = 32,
                 in_chans: Literal[1, 3] = 3, **kwargs) -> None:
        super().__init__(img_size=img_size, in_chans=in_chans, **kwargs)
        self.num_samples = num_samples
        self.num_test_samples = num_test_samples
        self.num_classes = num_classes

    def has_labelled_test_split(self) -> bool:
        return self.num_test_samples > 0

    def _load_split(self, train: bool) -> InMemoryImages | None:
        n = self.num_samples if train else self.num_test_samples
        if n == 0 and not train:
            return None
        # seeds 2s and 2s + 1: seed s's splits never share a stream with another seed's
        images, labels = make_synthetic_images(n, self.img_size, self.in_chans, self.num_classes, seed=2 * self.seed + (0 if train else 1))
        return InMemoryImages(images, labels)
