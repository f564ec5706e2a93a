"""Where the [CLS] token looks: attention rollout (ViT paper Fig. 6, after Abnar & Zuidema 2020)
and DINO's per-head last-layer attention with its 60 %-mass masks (Caron et al. 2021, Fig. 3;
reference ``visualize_attention.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

DINO_THRESHOLD = 0.6  # DINO visualize_attention.py: "--threshold 0.6", the share of mass kept


def attention_rollout(attentions: Sequence[Tensor], add_residual: bool = True) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers"),
    as the ViT paper uses it for its attention maps (Appendix D.8, Figs. 6 and 14).

    Per layer l the heads are averaged, Āₗ = meanₕ Aₗₕ; the residual connection is accounted for
    by adding the identity and renormalising the rows, Ãₗ = (Āₗ + I) / rowsum (= ½Āₗ + ½I since
    attention rows sum to 1); the layers compose by matrix product, R = Ã_L ··· Ã_2 Ã_1, so row
    i of R is how much output token i draws from each input token.

    Args:
        attentions: one ``[B, heads, T, T]`` tensor per layer, first layer first.
        add_residual: add the identity before renormalising (the rollout's definition; ``False``
            gives the plain product of head-averaged attentions).

    Returns:
        ``[B, T, T]`` float32, rows summing to 1.
    """
    if len(attentions) == 0:
        raise ValueError("no attention maps given")
    rollout: Tensor | None = None
    for attn in attentions:
        if attn.ndim != 4 or attn.shape[-1] != attn.shape[-2]:
            raise ValueError(f"expected attention [B, heads, T, T], got shape {tuple(attn.shape)}")
        a = attn.detach().to(torch.float64).mean(dim=1)  # [B, T, T]
        if add_residual:
            a = a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout  # later layers act on the left
    assert rollout is not None
    return rollout.float()


def cls_map(
    attn_rows: Tensor,
    grid_size: tuple[int, int],
    num_prefix_tokens: int = 1,
    out_size: tuple[int, int] | None = None,
    mode: str = "bilinear",
) -> Tensor:
    """The [CLS] row of ``[B, (heads,) T, T]`` over the patch tokens, as a grid image.

    Returns:
        ``[B, (heads,) h, w]``, or upsampled to ``out_size`` (the image size) with ``mode``.
    """
    h, w = grid_size
    if num_prefix_tokens < 1:
        raise ValueError("the [CLS] maps read the output token's attention row, and this backbone has no prefix token "
                         "(num_prefix_tokens=0)")
    if attn_rows.shape[-1] != num_prefix_tokens + h * w:
        raise ValueError(
            f"attention has {attn_rows.shape[-1]} tokens, expected {num_prefix_tokens} prefix + {h}x{w} grid"
        )
    rows = attn_rows[..., 0, num_prefix_tokens:].float()  # [B, (heads,) N]
    lead = rows.shape[:-1]
    grid = rows.reshape(-1, 1, h, w)  # [B·heads, 1, h, w]
    if out_size is not None and tuple(out_size) != (h, w):
        align = False if mode in ("bilinear", "bicubic") else None
        grid = F.interpolate(grid, size=tuple(out_size), mode=mode, align_corners=align)
    return grid.reshape(*lead, *grid.shape[-2:])


def rollout_map(
    attentions: Sequence[Tensor],
    grid_size: tuple[int, int],
    out_size: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
) -> Tensor:
    """ViT paper Fig. 6: the rollout's [CLS] row over patches, upsampled (bilinear) to the image.

    Returns:
        ``[B, H, W]`` (``[B, h, w]`` without ``out_size``); not rescaled (the drawing does that).
    """
    return cls_map(attention_rollout(attentions), grid_size, num_prefix_tokens, out_size, mode="bilinear")


def keep_top_mass(weights: Tensor, threshold: float = DINO_THRESHOLD) -> Tensor:
    """The smallest set of entries holding at least ``threshold`` of the mass, along the last dim.

    The entries are normalised to sum to 1 and taken from the largest down until their total
    reaches ``threshold`` (DINO ``visualize_attention.py``: drop the smallest entries whose
    cumulative share stays at or below 1 − threshold — the same set).

    Args:
        weights: ``[..., N]`` non-negative.
        threshold: share of the mass to keep, in (0, 1].

    Returns:
        bool ``[..., N]`` mask of the kept entries.
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    w = weights.detach().to(torch.float64)
    if (w < 0).any():
        raise ValueError("attention weights must be non-negative")
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    val, idx = torch.sort(w, dim=-1, descending=True)
    mass_before = val.cumsum(dim=-1) - val  # share held by the strictly larger-ranked entries
    keep_sorted = mass_before < threshold  # still short of the threshold -> this one is needed
    return torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)


class DinoAttention(NamedTuple):
    """Last-layer [CLS] attention per head (DINO Fig. 3).

    Attributes:
        maps: ``[B, heads, h, w]`` the raw [CLS] attention over the patches.
        masks: bool ``[B, heads, h, w]`` the smallest set of patches holding ``threshold`` of
            each head's patch mass.
        threshold: that share.
    """

    maps: Tensor
    masks: Tensor
    threshold: float = DINO_THRESHOLD


def dino_attention(
    last_attn: Tensor, grid_size: tuple[int, int], threshold: float = DINO_THRESHOLD, num_prefix_tokens: int = 1
) -> DinoAttention:
    """DINO's attention figure from the last layer's attention ``[B, heads, T, T]``."""
    if last_attn.ndim != 4:
        raise ValueError(f"expected attention [B, heads, T, T], got shape {tuple(last_attn.shape)}")
    maps = cls_map(last_attn.detach(), grid_size, num_prefix_tokens)  # [B, heads, h, w]
    masks = keep_top_mass(maps.flatten(-2), threshold).reshape(maps.shape)
    return DinoAttention(maps=maps.cpu(), masks=masks.cpu(), threshold=threshold)
