"""What the embedding learned (ViT paper §4.5, Fig. 7 left and centre): the principal components
of the patch projection E, and the cosine similarity of the position embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PAPER_NUM_FILTERS = 28  # ViT paper Fig. 7 left shows the top 28 components
# The first layer that sees pixels, in the order looked for: a hybrid's patch_embed.proj is a 1×1
# convolution on a ResNet feature map, whose rows are no images: its stem plays E's role.
FIRST_LAYERS = {
    "patch_embed.backbone.conv1": "hybrid: first convolution of the ResNet stem (conv1)",
    "patch_embed.proj": "patch embedding E (patch_embed.proj)",
    "conv1": "ResNet first convolution (conv1)",
}


@dataclass(frozen=True)
class FilterPCA:
    """Principal components of a set of filters, largest variance first."""

    components: Tensor  # [k, C, P, P] unit norm, each signed so that its largest-magnitude entry is positive (stable figures)
    explained_variance: Tensor  # [k] the filters' variance along each direction (÷ (D − 1))
    explained_variance_ratio: Tensor  # [k] the same as a share of the total variance
    source: str  # which weight the filters came from (the figure's title says it)


def filter_weight(backbone: nn.Module) -> tuple[Tensor, str] | None:
    """The first layer that sees pixels (:data:`FIRST_LAYERS`), ``([D, C, kh, kw], description)``, or None."""
    modules = dict(backbone.named_modules())
    return next(((modules[name].weight, what) for name, what in FIRST_LAYERS.items() if isinstance(modules.get(name), nn.Conv2d)), None)


@torch.no_grad()
def embedding_filters(weight: Tensor, k: int = PAPER_NUM_FILTERS, source: str = "patch embedding E") -> FilterPCA:
    """Top-``k`` principal components of the D filters of a convolution ``[D, C, P, P]``, at most
    as many as the centred filters have dimensions, min(D − 1, C·P·P)."""
    d, c, ph, pw = weight.shape
    rows = weight.detach().reshape(d, -1).double()  # [D, C·P·P]
    rows = rows - rows.mean(dim=0, keepdim=True)  # PCA centres the rows first
    _, s, vh = torch.linalg.svd(rows, full_matrices=False)  # rows of vh: the directions, s descending
    k = min(k, s.numel(), d - 1)  # centring takes a dimension: D rows span D - 1 at most
    comps = vh[:k]  # [k, C·P·P]
    comps = comps * comps.gather(1, comps.abs().argmax(dim=1, keepdim=True)).sign()
    var = s.square() / (d - 1)  # [r]
    dtype = weight.dtype if weight.is_floating_point() else torch.float32
    return FilterPCA(comps.reshape(k, c, ph, pw).to(dtype).cpu(), var[:k].to(dtype).cpu(), (var[:k] / var.sum()).to(dtype).cpu(), source)


@torch.no_grad()
def position_similarity(pos_embed: Tensor, grid_size: tuple[int, int], num_prefix_tokens: int = 1) -> Tensor:
    """Cosine similarity ``[h, w, h, w]`` (float32, CPU) between the embeddings of every two patch
    positions: a learned 1-D embedding shows 2-D structure. ``pos_embed``: ``[1, prefix + h·w, D]``
    or ``[prefix + h·w, D]``, patches row-major; the prefix rows ([CLS]) have no position."""
    pe = F.normalize(pos_embed.detach().float().reshape(-1, pos_embed.shape[-1])[num_prefix_tokens:], dim=-1)  # [N, D]
    sim = (pe @ pe.T).clamp(-1.0, 1.0)  # [N, N]; rounding can put a self-similarity just above 1
    return sim.reshape(*grid_size, *grid_size).cpu()
