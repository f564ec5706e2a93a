"""What every analysis needs from its inputs: images out of a batch, the token grid of an image,
and images back in [0, 1] for display (a backbone in eval mode: ``ssl_vit.backbones.eval_mode``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn


def has_tokens(backbone: nn.Module) -> bool:
    """True for backbones with attention maps and a position embedding (ViT, hybrid); duck-typed
    so that any model following the backbone contract qualifies."""
    return hasattr(backbone, "get_attention_maps") and hasattr(backbone, "pos_embed")


def require_vit(backbone: nn.Module, what: str) -> None:
    """Attention and position-embedding figures need a token sequence (ViT or hybrid)."""
    if not has_tokens(backbone):
        raise ValueError(
            f"{what} needs a ViT or hybrid backbone (attention maps and a position embedding); "
            f"got {type(backbone).__name__}. For a ResNet only the filter figure applies."
        )


def batch_images(batch: object) -> Tensor:
    """The image tensor ``[B, C, H, W]`` of a batch: the tensor itself, or the first 4-D tensor
    found depth-first in a tuple/list/dict (``(images, labels)``; a list of views gives the first
    view, which is a global crop in multi-crop pipelines)."""
    found = _first_images(batch)
    if found is None:
        raise ValueError(
            f"cannot find images [B, C, H, W] in a batch of type {type(batch).__name__}: "
            "pass image tensors or (images, labels) batches"
        )
    return found


def _first_images(batch: object) -> Tensor | None:
    if isinstance(batch, Tensor):
        return batch if batch.ndim == 4 else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        for item in batch:
            found = _first_images(item)
            if found is not None:
                return found
    return None


def image_grid(backbone: nn.Module, images: Tensor) -> tuple[int, int]:
    """Token grid ``(h, w)`` of ``images`` [B, C, H, W]: ``patch_size`` is pixels per token."""
    if images.ndim != 4:
        raise ValueError(f"expected images [B, C, H, W], got shape {tuple(images.shape)}")
    p = backbone.patch_size
    h, w = images.shape[-2:]
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not divisible by the backbone's patch size {p}")
    return h // p, w // p


def denormalize(
    images: Tensor, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> Tensor:
    """Normalised images ``[B, C, H, W]`` -> ``[B, C, H, W]`` in [0, 1] on the CPU, for display.

    With ``mean``/``std`` (one value per channel, or one for all) the normalisation is undone;
    without them each image is min-max scaled to [0, 1]."""
    x = images.detach().float().cpu()
    if (mean is None) != (std is None):
        raise ValueError("give both mean and std, or neither")
    if mean is None or std is None:
        lo = x.amin(dim=(1, 2, 3), keepdim=True)
        hi = x.amax(dim=(1, 2, 3), keepdim=True)
        return (x - lo) / (hi - lo).clamp_min(1e-12)
    c = x.shape[1]
    m = torch.as_tensor(mean, dtype=torch.float32).flatten()
    s = torch.as_tensor(std, dtype=torch.float32).flatten()
    if m.numel() not in (1, c) or s.numel() not in (1, c):
        raise ValueError(f"mean/std need 1 or {c} values for {c}-channel images, got {m.numel()} and {s.numel()}")
    return (x * s.view(1, -1, 1, 1) + m.view(1, -1, 1, 1)).clamp(0.0, 1.0)
