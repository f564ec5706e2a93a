"""Embedding filters: principal components of the patch projection E (ViT paper §4.5, Fig. 7
left: the top principal components of the learned embedding filters of ViT-L/32).

Each row of E (the ``patch_embed.proj`` conv weight ``[D, C, P, P]``) is a P×P×C filter; the
principal directions of the D rows, drawn as small images, are the basis functions the ViT uses
to describe a patch (Gabor-like after training).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

PAPER_NUM_FILTERS = 28  # ViT paper Fig. 7 left shows the top 28 components


@dataclass(frozen=True)
class FilterPCA:
    """Principal components of a set of filters.

    Attributes:
        components: ``[k, C, P, P]`` unit-norm principal directions, largest variance first; the
            sign of each is fixed so that its largest-magnitude entry is positive (PCA signs are
            arbitrary; this keeps figures stable across runs).
        explained_variance: ``[k]`` variance of the rows along each direction (unbiased, ÷(D−1)).
        explained_variance_ratio: ``[k]`` the same as a fraction of the total variance.
        source: which weight the filters came from (shown in the figure title).
    """

    components: Tensor
    explained_variance: Tensor
    explained_variance_ratio: Tensor
    source: str


def filter_weight(backbone: nn.Module) -> tuple[Tensor, str]:
    """The first layer that sees pixels, as ``([D, C, kh, kw], description)``.

    - ViT: ``patch_embed.proj`` (E itself).
    - Hybrid: its ``patch_embed.proj`` is a 1×1 convolution on a ResNet feature map, whose rows
      are not images, so we use the ResNet's first convolution ``conv1`` instead: it plays E's
      role (the linear map from raw pixels to features). The figure says so in its title.
    - ResNet backbone: ``conv1`` for the same reason.
    """
    patch_embed = getattr(backbone, "patch_embed", None)
    if patch_embed is not None:
        trunk = getattr(patch_embed, "backbone", None)
        if trunk is not None and isinstance(getattr(trunk, "conv1", None), nn.Conv2d):
            return trunk.conv1.weight, "hybrid: first convolution of the ResNet stem (conv1)"
        proj = getattr(patch_embed, "proj", None)
        if isinstance(proj, nn.Conv2d):
            return proj.weight, "patch embedding E (patch_embed.proj)"
    conv1 = getattr(backbone, "conv1", None)
    if isinstance(conv1, nn.Conv2d):
        return conv1.weight, "ResNet first convolution (conv1)"
    raise ValueError(
        f"cannot find a pixel-level projection in {type(backbone).__name__}: expected "
        "patch_embed.proj (ViT), patch_embed.backbone.conv1 (hybrid) or conv1 (ResNet)"
    )


@torch.no_grad()
def embedding_filters(weight: Tensor, k: int = PAPER_NUM_FILTERS, source: str = "patch embedding E") -> FilterPCA:
    """Top-``k`` principal components of the rows of a projection (ViT paper §4.5, Fig. 7 left).

    Args:
        weight: ``[D, C, P, P]`` (a conv weight; each of the D rows is one filter).
        k: how many components (the paper shows 28). Capped at the rank of the centred rows,
            at most min(D - 1, C·P·P): components beyond it carry no variance.
        source: a description carried into the result.

    Returns:
        A :class:`FilterPCA` with ``components`` ``[k', C, P, P]`` (``k' = min(k, D - 1, C·P·P)``).
    """
    if weight.ndim != 4:
        raise ValueError(f"expected a conv weight [D, C, P, P], got shape {tuple(weight.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    d, c, ph, pw = weight.shape
    if d < 2:
        raise ValueError(f"need at least 2 filters for a PCA, got {d}")
    rows = weight.detach().reshape(d, c * ph * pw).to(torch.float64)  # [D, C·P·P]
    rows = rows - rows.mean(dim=0, keepdim=True)  # PCA centres the rows first
    # Rows of Vh are the principal directions, singular values sorted descending.
    _, s, vh = torch.linalg.svd(rows, full_matrices=False)  # s [r], vh [r, C·P·P]
    k = min(k, s.numel(), d - 1)  # centring takes a dimension: D rows span D - 1 at most
    comps = vh[:k]  # [k, C·P·P]
    # Deterministic sign: the largest-magnitude entry of each component is positive.
    pivot = comps.gather(1, comps.abs().argmax(dim=1, keepdim=True))  # [k, 1]
    comps = comps * torch.where(pivot < 0, -1.0, 1.0)
    var = s.square() / (d - 1)  # [r]
    total = var.sum().clamp_min(torch.finfo(var.dtype).tiny)
    dtype = weight.dtype if weight.is_floating_point() else torch.float32
    return FilterPCA(
        components=comps.reshape(k, c, ph, pw).to(dtype).cpu(),
        explained_variance=var[:k].to(dtype).cpu(),
        explained_variance_ratio=(var[:k] / total).to(dtype).cpu(),
        source=source,
    )


def backbone_filters(backbone: nn.Module, k: int = PAPER_NUM_FILTERS) -> FilterPCA:
    """:func:`embedding_filters` of the backbone's pixel-level projection (see :func:`filter_weight`)."""
    weight, source = filter_weight(backbone)
    return embedding_filters(weight, k=k, source=source)
