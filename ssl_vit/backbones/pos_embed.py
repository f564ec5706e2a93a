"""Position embeddings in timm's layout ``[1, num_prefix_tokens + H*W, D]`` (the [CLS] position
first): the fixed 2-D sin-cos table and resampling to another grid."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor


def sincos_2d_pos_embed(embed_dim: int, grid_size: tuple[int, int], num_prefix_tokens: int = 1, temperature: float = 10000.0) -> Tensor:
    """Fixed 2-D sin-cos position embedding of MoCo v3 (Chen et al. 2021, §4.2; reference
    ``vits.py: build_2d_sincos_position_embedding``), float32, prefix tokens zero.

    For the patch in row r and column c, a quarter of the channels each hold sin(r·ω), cos(r·ω),
    sin(c·ω), cos(c·ω) with ω_k = 1 / temperature^(k / (D/4)). On the square grids MoCo v3 trains
    on this is the reference's table to the last bit (its ``meshgrid(grid_w, grid_h)`` puts the
    row index in the half it calls w), so its weights see the same positions at any resolution.
    """
    if embed_dim % 4:
        raise ValueError(f"2-D sin-cos position embedding needs embed_dim divisible by 4, got {embed_dim}")
    rows, cols = torch.meshgrid(torch.arange(grid_size[0], dtype=torch.float32), torch.arange(grid_size[1], dtype=torch.float32), indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(embed_dim // 4, dtype=torch.float32) / (embed_dim // 4))  # [D/4]
    r, c = torch.outer(rows.flatten(), omega), torch.outer(cols.flatten(), omega)  # [H*W, D/4], row-major like the patches
    table = torch.cat([r.sin(), r.cos(), c.sin(), c.cos()], dim=1)  # [H*W, D]
    return torch.cat([torch.zeros(num_prefix_tokens, embed_dim), table])[None]


def resample_pos_embed(pos_embed: Tensor, new_size: tuple[int, int], old_size: tuple[int, int], num_prefix_tokens: int = 1,
                       mode: str = "bicubic", antialias: bool = True) -> Tensor:
    """The patch part of ``pos_embed`` (made for grid ``old_size``) interpolated to ``new_size``,
    prefix tokens kept, in the input's dtype (ViT paper §3.2: "2D interpolation of the pre-trained
    position embeddings, according to their location in the original image"; as timm's
    ``resample_abs_pos_embed``)."""
    if tuple(new_size) == tuple(old_size):
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    grid = rearrange(grid.float(), "1 (h w) d -> 1 d h w", h=old_size[0], w=old_size[1])
    grid = F.interpolate(grid, size=tuple(new_size), mode=mode, antialias=antialias, align_corners=False)
    return torch.cat([prefix, rearrange(grid, "1 d h w -> 1 (h w) d").to(pos_embed.dtype)], dim=1)
