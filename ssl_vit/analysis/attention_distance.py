"""Mean attention distance (ViT paper Fig. 7 right, §4.5; Appendix D.7 "Attention distance").

For each layer and head, the distance in image space that information travels through
attention, Σⱼ aᵢⱼ·d(i, j), averaged over query patches i and over images (the paper used 128
images). It is the analogue of a CNN's receptive field size: some heads of the first layers are
already global. Attention is between patches, so distances are measured between patch centres.

Definition choices:
    - d(i, j) is the Euclidean distance between the centres of patches i and j, in input pixels:
      ``patch_size`` (pixels per token; a hybrid's stride) × grid distance.
    - The [CLS] token has no position, so the [CLS] query row and the [CLS] key column are
      dropped. With ``renormalize=True`` (default) each query's remaining weights are rescaled to
      sum to 1 over the patch keys, so the number is "the mean distance of the attended *patches*"
      and does not shrink when a head parks mass on [CLS]. ``renormalize=False`` keeps the raw
      weights, which counts attention to [CLS] as distance 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from ssl_vit.analysis.inputs import batch_images, image_grid
from ssl_vit.backbones import eval_mode

PAPER_NUM_IMAGES = 128  # ViT paper Appendix D.7: the distance is computed over 128 example images
CHUNK_SIZE = 32  # images per forward pass: bounds the memory held by one pass's attention maps


def patch_distances(grid_size: tuple[int, int], patch_size: float) -> Tensor:
    """``[N, N]`` pixel distances between patch centres of an ``(h, w)`` grid (row-major)."""
    h, w = grid_size
    rows, cols = torch.meshgrid(
        torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij"
    )
    centres = torch.stack([rows.flatten(), cols.flatten()], dim=1) * patch_size  # [N, 2]
    return torch.cdist(centres, centres)  # [N, N]


def attention_distance_per_image(
    attn: Tensor,
    grid_size: tuple[int, int],
    patch_size: float,
    num_prefix_tokens: int = 1,
    renormalize: bool = True,
) -> Tensor:
    """One layer's mean attention distance per image and head.

    Args:
        attn: ``[B, heads, prefix + N, prefix + N]`` attention weights (rows are queries).
        grid_size: ``(h, w)`` with ``h * w = N``.
        patch_size: pixels per token.
        num_prefix_tokens: leading tokens without a position ([CLS]).
        renormalize: rescale each query's patch weights to sum to 1 (see the module docstring).

    Returns:
        ``[B, heads]`` float64: Σⱼ aᵢⱼ·d(i, j) averaged over the query patches i.
    """
    if attn.ndim != 4 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"expected attention [B, heads, T, T], got shape {tuple(attn.shape)}")
    n = grid_size[0] * grid_size[1]
    if attn.shape[-1] != num_prefix_tokens + n:
        raise ValueError(
            f"attention has {attn.shape[-1]} tokens, expected {num_prefix_tokens} prefix + "
            f"{grid_size[0]}x{grid_size[1]} grid = {num_prefix_tokens + n}"
        )
    a = attn[..., num_prefix_tokens:, num_prefix_tokens:].to(torch.float64)  # [B, H, N, N]
    if renormalize:
        a = a / a.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    dist = patch_distances(grid_size, patch_size).to(a.device)  # [N, N]
    per_query = torch.einsum("bhij,ij->bhi", a, dist)  # [B, H, N]
    return per_query.mean(dim=-1)  # [B, H]


def mean_attention_distance(
    attentions: Sequence[Tensor],
    grid_size: tuple[int, int],
    patch_size: float,
    num_prefix_tokens: int = 1,
    renormalize: bool = True,
) -> Tensor:
    """Mean attention distance of every layer and head, averaged over the images of one batch.

    Args:
        attentions: one ``[B, heads, 1+N, 1+N]`` tensor per layer (``get_attention_maps``).

    Returns:
        ``[depth, heads]`` float32 on the CPU, in pixels.
    """
    if len(attentions) == 0:
        raise ValueError("no attention maps given")
    per_layer = [
        attention_distance_per_image(a, grid_size, patch_size, num_prefix_tokens, renormalize).mean(dim=0)
        for a in attentions
    ]
    return torch.stack(per_layer).float().cpu()  # [depth, heads]


@torch.no_grad()
def compute_attention_distance(
    backbone: nn.Module,
    batches: Tensor | Iterable[object],
    num_images: int = PAPER_NUM_IMAGES,
    chunk_size: int = CHUNK_SIZE,
    renormalize: bool = True,
) -> Tensor:
    """Mean attention distance of a ViT over up to ``num_images`` images, streamed.

    Only a running sum per (layer, head) is kept, and each forward pass sees at most
    ``chunk_size`` images, so memory is bounded by one chunk's attention maps however many
    images are averaged.

    Args:
        backbone: a ViT or hybrid (``get_attention_maps``, ``patch_size``, ``num_prefix_tokens``).
        batches: an image tensor ``[B, C, H, W]`` or an iterable of batches (a DataLoader): each
            an image tensor or a tuple/list/dict holding one (e.g. ``(images, labels)``).
        num_images: how many images to average over (the paper: 128); fewer if the data ends.
        chunk_size: images per forward pass (they are moved to the backbone's device).

    Returns:
        ``[depth, heads]`` float32 on the CPU, in pixels. The backbone is run in eval mode
        (no dropout or drop path) and its training mode is restored afterwards.
    """
    if num_images < 1 or chunk_size < 1:
        raise ValueError(f"num_images and chunk_size must be >= 1, got {num_images} and {chunk_size}")
    if isinstance(batches, Tensor):
        batches = [batches]
    prefix = getattr(backbone, "num_prefix_tokens", 1)
    total: Tensor | None = None  # [depth, heads], sum over images
    seen = 0
    with eval_mode(backbone) as dev:
        for batch in batches:
            images = batch_images(batch)
            for chunk in images[: num_images - seen].split(chunk_size):
                chunk = chunk.to(dev)
                grid = image_grid(backbone, chunk)
                attns = backbone.get_attention_maps(chunk)
                sums = torch.stack(
                    [
                        attention_distance_per_image(a, grid, backbone.patch_size, prefix, renormalize).sum(0)
                        for a in attns
                    ]
                ).cpu()  # [depth, heads]
                total = sums if total is None else total + sums
                seen += chunk.shape[0]
            if seen >= num_images:
                break
    if total is None:
        raise ValueError("no images to compute the attention distance on (empty data)")
    return (total / seen).float()
