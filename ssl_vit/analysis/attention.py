"""Where attention goes: mean attention distance (ViT paper §4.5, Fig. 7 right, Appendix D.7),
attention rollout (Abnar & Zuidema 2020; ViT paper Fig. 6, Appendix D.8) and DINO's last-layer
per-head [CLS] attention with its 60 % masks (Caron et al. 2021, Fig. 3; ``visualize_attention.py``).
Attention maps are ``[B, heads, T, T]``, rows are queries, ``T = prefix + h·w``: the
``num_prefix_tokens`` leading tokens ([CLS]) have no position, the patches are row-major."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from ssl_vit.backbones import eval_mode

PAPER_NUM_IMAGES = 128  # ViT paper Appendix D.7: the distance is averaged over 128 example images
CHUNK_SIZE = 32  # images per forward pass: bounds the memory one pass's attention maps take
DINO_THRESHOLD = 0.6  # DINO visualize_attention.py "--threshold 0.6": the share of mass kept


def batch_images(batch: object) -> Tensor:
    """The images ``[B, C, H, W]`` of a batch: the first 4-D tensor, depth first, of ``images``,
    ``(images, labels)``, a dict, or a list of views (the first: a global crop)."""
    todo = [batch]
    while todo:
        item = todo.pop()
        if isinstance(item, Tensor) and item.ndim == 4:
            return item
        if isinstance(item, Mapping | list | tuple):
            todo.extend(reversed(list(item.values()) if isinstance(item, Mapping) else item))
    raise ValueError(f"no images [B, C, H, W] in a batch of type {type(batch).__name__}: pass image tensors or (images, labels) batches")


def image_grid(backbone: nn.Module, images: Tensor) -> tuple[int, int]:
    """The token grid ``(h, w)`` of ``images [B, C, H, W]``."""
    return images.shape[-2] // backbone.patch_size, images.shape[-1] // backbone.patch_size


def mean_attention_distance(attentions: Sequence[Tensor], grid_size: tuple[int, int], patch_size: float, num_prefix_tokens: int = 1,
                            renormalize: bool = True) -> Tensor:
    """Per layer and head, Σⱼ aᵢⱼ·d(i, j) averaged over query patches i and images, d(i, j) the
    distance between patch centres in pixels: the analogue of a CNN's receptive field (ViT paper
    Appendix D.7). ``attentions``: ``depth × [B, heads, T, T]``; returns ``[depth, heads]`` float32
    on the CPU. [CLS] has no position: its row and column are dropped; ``renormalize`` rescales each
    query's patch weights to sum to 1, so that a head parking mass on [CLS] does not look local."""
    rows, cols = torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in grid_size), indexing="ij")
    centres = torch.stack([rows.flatten(), cols.flatten()], dim=1) * patch_size  # [N, 2] in pixels
    dist = torch.cdist(centres, centres)  # [N, N]
    per_layer = []
    for attn in attentions:
        a = attn[..., num_prefix_tokens:, num_prefix_tokens:].double()  # [B, heads, N, N]
        assert a.shape[-2:] == dist.shape, f"attention over {a.shape[-1]} patches, a grid of {grid_size}"
        if renormalize:
            a = a / a.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        per_layer.append(torch.einsum("bhij,ij->h", a, dist.to(a.device)) / (a.shape[0] * a.shape[2]))  # [heads]
    return torch.stack(per_layer).float().cpu()


@torch.no_grad()
def compute_attention_distance(backbone: nn.Module, batches: Tensor | Iterable[object], num_images: int = PAPER_NUM_IMAGES,
                               chunk_size: int = CHUNK_SIZE, renormalize: bool = True) -> Tensor:
    """:func:`mean_attention_distance` of a ViT over the first ``num_images`` images of an image
    tensor or of batches (a DataLoader), ``chunk_size`` per forward pass in eval mode."""
    prefix = getattr(backbone, "num_prefix_tokens", 1)
    total, seen = 0.0, 0
    with eval_mode(backbone) as device:
        for batch in [batches] if isinstance(batches, Tensor) else batches:
            for chunk in batch_images(batch)[: num_images - seen].split(chunk_size):
                attns = backbone.get_attention_maps(chunk.to(device))  # depth × [b, heads, T, T]
                total += len(chunk) * mean_attention_distance(attns, image_grid(backbone, chunk), backbone.patch_size, prefix, renormalize)
                seen += len(chunk)
            if seen >= num_images:
                break
    assert seen, "no images to compute the attention distance on"
    return total / seen


def attention_rollout(attentions: Sequence[Tensor]) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers") of
    ``depth × [B, heads, T, T]``, first layer first: ``[B, T, T]`` float32, rows summing to 1.
    R = Ã_L ··· Ã_1 with Ãₗ = ½ meanₕ Aₗₕ + ½I (I: the residual connection): row i of R is how
    much output token i draws from each input token."""
    rollout = None
    for attn in attentions:
        a = attn.detach().double().mean(dim=1)  # [B, T, T]
        a = a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout  # later layers act on the left
    return rollout.float()


def cls_attention(attn: Tensor, grid_size: tuple[int, int], num_prefix_tokens: int = 1) -> Tensor:
    """The [CLS] query's row over the patch keys as an image: ``[..., T, T]`` -> ``[..., h, w]``."""
    return rearrange(attn[..., 0, num_prefix_tokens:].float(), "... (h w) -> ... h w", h=grid_size[0], w=grid_size[1])


def rollout_map(attentions: Sequence[Tensor], grid_size: tuple[int, int], out_size: tuple[int, int] | None = None,
                num_prefix_tokens: int = 1) -> Tensor:
    """ViT paper Fig. 6: the rollout's [CLS] row ``[B, h, w]``, upsampled bilinearly (half-pixel centres) to ``out_size`` if given."""
    maps = cls_attention(attention_rollout(attentions), grid_size, num_prefix_tokens)  # [B, h, w]
    return maps if out_size is None else F.interpolate(maps[:, None], size=tuple(out_size), mode="bilinear", align_corners=False)[:, 0]


def keep_top_mass(weights: Tensor, threshold: float = DINO_THRESHOLD) -> Tensor:
    """Bool mask of the fewest entries along the last dimension holding ``threshold`` of its mass (DINO's masks)."""
    w = weights.detach().double()
    val, idx = torch.sort(w / w.sum(dim=-1, keepdim=True), dim=-1, descending=True)
    needed = val.cumsum(dim=-1) - val < threshold  # the larger entries fall short: this one is needed
    return torch.zeros_like(needed).scatter(-1, idx, needed)


class DinoAttention(NamedTuple):
    """Last-layer [CLS] attention per head (DINO Fig. 3): ``maps [B, heads, h, w]`` and ``masks``
    (bool, same shape) of the fewest patches holding ``threshold`` of each head's patch mass."""

    maps: Tensor
    masks: Tensor
    threshold: float = DINO_THRESHOLD


def dino_attention(last_attn: Tensor, grid_size: tuple[int, int], threshold: float = DINO_THRESHOLD,
                   num_prefix_tokens: int = 1) -> DinoAttention:
    """DINO's attention figure from the last layer's attention ``[B, heads, T, T]``."""
    maps = cls_attention(last_attn.detach(), grid_size, num_prefix_tokens)  # [B, heads, h, w]
    masks = keep_top_mass(maps.flatten(-2), threshold).reshape(maps.shape)
    return DinoAttention(maps.cpu(), masks.cpu(), threshold)
