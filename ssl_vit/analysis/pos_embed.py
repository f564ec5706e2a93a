"""Position-embedding similarity (ViT paper Fig. 7 centre, §4.5): the cosine similarity of each
patch position's embedding with every other's. A learned 1-D embedding shows 2-D structure: close
patches, and patches in the same row or column, have similar embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.no_grad()
def position_similarity(
    pos_embed: Tensor, grid_size: tuple[int, int], num_prefix_tokens: int = 1
) -> Tensor:
    """Cosine similarity between the position embeddings of all pairs of patch positions.

    Args:
        pos_embed: ``[1, prefix + h*w, D]`` (timm layout) or ``[prefix + h*w, D]``; the
            ``num_prefix_tokens`` leading rows ([CLS]) have no position in the grid and are dropped.
        grid_size: ``(h, w)``; the patch rows are in row-major order like the patch sequence.

    Returns:
        ``[h, w, h, w]`` float32 on the CPU: entry ``[r, c, r', c']`` is the similarity between
        positions ``(r, c)`` and ``(r', c')``, in [−1, 1].
    """
    if pos_embed.ndim == 3:
        if pos_embed.shape[0] != 1:
            raise ValueError(f"expected a position embedding [1, T, D], got shape {tuple(pos_embed.shape)}")
        pos_embed = pos_embed[0]
    if pos_embed.ndim != 2:
        raise ValueError(f"expected a position embedding [1, T, D] or [T, D], got shape {tuple(pos_embed.shape)}")
    h, w = grid_size
    if pos_embed.shape[0] != num_prefix_tokens + h * w:
        raise ValueError(
            f"position embedding has {pos_embed.shape[0]} tokens, expected {num_prefix_tokens} prefix + "
            f"{h}x{w} grid = {num_prefix_tokens + h * w}"
        )
    pe = F.normalize(pos_embed[num_prefix_tokens:].detach().float(), dim=-1)  # [N, D], unit rows
    sim = (pe @ pe.T).clamp(-1.0, 1.0)  # [N, N]
    return sim.reshape(h, w, h, w).cpu()
