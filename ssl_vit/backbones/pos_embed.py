"""Position embeddings: the fixed 2-D sin-cos table and resampling to another grid.

Both act on the timm layout ``[1, num_prefix_tokens + H*W, D]`` (the [CLS] position first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sincos_2d_pos_embed(
    embed_dim: int, grid_size: tuple[int, int], num_prefix_tokens: int = 1, temperature: float = 10000.0
) -> Tensor:
    """Fixed 2-D sin-cos position embedding, as in MoCo v3 (Chen et al. 2021, §4.2; reference
    ``vits.py: build_2d_sincos_position_embedding``).

    For the patch in row r and column c, a quarter of the channels each hold sin(r·ω), cos(r·ω),
    sin(c·ω), cos(c·ω) with ω_k = 1 / temperature^(k / (D/4)); prefix tokens ([CLS]) get zeros.
    On the square grids MoCo v3 trains on this is the reference's table to the last bit: its
    ``meshgrid(grid_w, grid_h)`` puts the row index in the first half (the half it calls w), so
    weights trained there see the same positions here at any resolution.

    Returns:
        ``[1, num_prefix_tokens + H*W, embed_dim]`` in float32.
    """
    if embed_dim % 4 != 0:
        raise ValueError(f"2-D sin-cos position embedding needs embed_dim divisible by 4, got {embed_dim}")
    h, w = grid_size
    rows, cols = torch.meshgrid(
        torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
    )  # each [H, W], row-major like the patch sequence
    pos_dim = embed_dim // 4
    omega = 1.0 / temperature ** (torch.arange(pos_dim, dtype=torch.float32) / pos_dim)  # [D/4]
    out_r = rows.flatten()[:, None] * omega[None]  # [H*W, D/4]
    out_c = cols.flatten()[:, None] * omega[None]  # [H*W, D/4]
    pe = torch.cat([out_r.sin(), out_r.cos(), out_c.sin(), out_c.cos()], dim=1)  # [H*W, D]
    prefix = torch.zeros(num_prefix_tokens, embed_dim)
    return torch.cat([prefix, pe], dim=0)[None]


def resample_pos_embed(
    pos_embed: Tensor,
    new_size: tuple[int, int],
    old_size: tuple[int, int],
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
) -> Tensor:
    """Resample the patch part of a position embedding to another grid (ViT paper §3.2: "2D
    interpolation of the pre-trained position embeddings, according to their location in the
    original image"). Prefix tokens are kept as they are.

    Args:
        pos_embed: ``[1, num_prefix_tokens + old_h*old_w, D]``.
        new_size: target grid ``(h, w)``.
        old_size: grid ``(h, w)`` that ``pos_embed`` was made for.

    Returns:
        ``[1, num_prefix_tokens + h*w, D]`` with the dtype of the input.
    """
    if tuple(new_size) == tuple(old_size):
        return pos_embed
    n_old = old_size[0] * old_size[1]
    if pos_embed.shape[1] != num_prefix_tokens + n_old:
        raise ValueError(
            f"position embedding has {pos_embed.shape[1]} tokens, expected {num_prefix_tokens} prefix "
            f"+ {old_size[0]}x{old_size[1]} grid = {num_prefix_tokens + n_old}"
        )
    dim = pos_embed.shape[-1]
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    orig_dtype = grid.dtype
    grid = grid.float().reshape(1, old_size[0], old_size[1], dim).permute(0, 3, 1, 2)  # [1, D, h, w]
    grid = F.interpolate(grid, size=tuple(new_size), mode=mode, antialias=antialias, align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_size[0] * new_size[1], dim).to(orig_dtype)
    return torch.cat([prefix, grid], dim=1)
