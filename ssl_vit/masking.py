"""Masked patch prediction's corruption and targets (ViT paper, Dosovitskiy et al. 2021, §4.6 and
Appendix B.1.2). Pure torch.

50 % of the patch embeddings are corrupted after the projection E and before the position
embedding: of those, 80 % become a shared learnable [mask] embedding, 10 % the embedding of a random
other patch, 10 % stay unchanged (BERT's rule). A corrupted patch's target comes from its raw pixels
in [0, 1]: its 3-bit mean colour (``mean_color``, 8**C classes: 512 for RGB, the paper's default),
the 3-bit colours of the patch downsized to 4x4 (``downsized``, 16 predictions), or its pixels for
an L2 regression (``pixels``, "slightly worse")::

    plan = make_corruption_plan(B, N, ratio=0.5)
    tokens = backbone.forward_features(x, patch_hook=lambda t: plan.apply(t, mask_token))
    target = mpp_targets(raw_images, patch_size, "mean_color")  # [B, N]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from einops import rearrange
from torch import Tensor

TargetKind = Literal["mean_color", "downsized", "pixels"]
LEVELS = 8  # "3-bit" colour: 8 levels per channel
GRID = 4  # the downsized target is a 4x4 version of the patch


@dataclass
class CorruptionPlan:
    """Which patch embeddings to corrupt and how; masks ``[B, N]`` in the ViT's row-major patch
    order. ``use_mask`` and ``use_random`` are disjoint parts of ``corrupted``, whose rest is kept
    as is (but predicted, as in BERT)."""

    corrupted: Tensor  # [B, N] bool
    use_mask: Tensor  # [B, N] bool
    use_random: Tensor  # [B, N] bool
    random_source: Tensor  # [B, N] long: the source patch of each, an index into the batch's B*N patches
    corrupted_idx: Tensor  # [B, k] long: the corrupted positions of each image, ascending

    def apply(self, tokens: Tensor, mask_token: Tensor) -> Tensor:
        """Corrupt patch embeddings ``tokens [B, N, D]`` (fits the backbone's ``patch_hook``);
        differentiable in both ``tokens`` and ``mask_token [D]``."""
        b, n, d = tokens.shape
        assert (b, n) == tuple(self.corrupted.shape) and mask_token.numel() == d, (tokens.shape, mask_token.shape)
        # Sources are read from the uncorrupted embeddings, as BERT draws from the vocabulary.
        random_tokens = tokens.reshape(b * n, d)[self.random_source.reshape(-1)].reshape(b, n, d)
        mask = mask_token.reshape(1, 1, d).to(tokens.dtype)  # (autocast's half-precision tokens stay half)
        out = torch.where(self.use_mask.unsqueeze(-1), mask, tokens)
        return torch.where(self.use_random.unsqueeze(-1), random_tokens, out)  # [B, N, D]


def num_corrupted(num_patches: int, ratio: float) -> int:
    """Patches corrupted per image: ``round(ratio * N)`` (Python's round, half to even)."""
    return int(round(ratio * num_patches))


def make_corruption_plan(
    batch_size: int,
    num_patches: int,
    ratio: float = 0.5,
    mask_prob: float = 0.8,
    random_prob: float = 0.1,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> CorruptionPlan:
    """Draw which ``round(ratio * N)`` patches of each image are corrupted (the smallest of uniform
    noise, as MAE's ``random_masking``), and for each whether it becomes the [mask] embedding
    (``mask_prob``), another patch's (``random_prob``) or stays. The other patch is drawn from the
    other ``B * N - 1`` patches of the batch, so a random replacement is never the patch itself.
    ``generator`` (on ``device``) makes the draw reproducible."""
    b, n, k = batch_size, num_patches, num_corrupted(num_patches, ratio)
    assert k >= 1 and b * n >= 2, (b, n, ratio)
    device = generator.device if generator is not None else device
    noise = torch.rand(b, n, generator=generator, device=device)  # [B, N]
    corrupted_idx = noise.argsort(dim=1)[:, :k].sort(dim=1).values  # [B, k]
    corrupted = torch.zeros(b, n, dtype=torch.bool, device=device).scatter_(1, corrupted_idx, True)
    u = torch.rand(b, n, generator=generator, device=device)  # one uniform per patch splits 80/10/10
    use_mask = corrupted & (u < mask_prob)
    use_random = corrupted & (u >= mask_prob) & (u < mask_prob + random_prob)
    own = torch.arange(b * n, device=device).reshape(b, n)
    source = torch.randint(0, b * n - 1, (b, n), generator=generator, device=device)
    return CorruptionPlan(corrupted, use_mask, use_random, source + (source >= own).long(), corrupted_idx)


def target_shape(kind: TargetKind, in_chans: int, patch_size: int) -> tuple[int, ...]:
    """The head's prediction per patch: ``(8**C,)`` logits, ``(16, 8**C)`` logits, ``(P*P*C,)`` values."""
    if kind == "pixels":
        return (patch_size * patch_size * in_chans,)
    if kind == "downsized" and patch_size % GRID:
        raise ValueError(f"the 4x4 downsized MPP target needs a patch size divisible by {GRID}, got patch_size={patch_size}")
    return (GRID * GRID, LEVELS**in_chans) if kind == "downsized" else (LEVELS**in_chans,)


def mpp_targets(images: Tensor, patch_size: int, kind: TargetKind) -> Tensor:
    """The target of every patch of raw ``images [B, C, H, W]`` in [0, 1] (see below)."""
    return {"mean_color": mean_color_targets, "downsized": downsized_color_targets, "pixels": pixel_targets}[kind](images, patch_size)


def mean_color_targets(images: Tensor, patch_size: int) -> Tensor:
    """``[B, N]`` class ids: per patch and channel the mean ``m`` is the level ``min(floor(8 m), 7)``,
    the id reads the levels as base-8 digits, first channel most significant (``r * 64 + g * 8 + b``)."""
    patches = rearrange(images.float(), "b c (h p) (w q) -> b (h w) (p q) c", p=patch_size, q=patch_size)
    return _color_ids(patches.mean(dim=2))  # [B, N, C] -> [B, N]


def downsized_color_targets(images: Tensor, patch_size: int) -> Tensor:
    """``[B, N, 16]`` class ids: each patch average-pooled to 4x4 cells (row-major within the
    patch), each cell's colour as in :func:`mean_color_targets`."""
    s = patch_size // GRID
    assert s * GRID == patch_size, patch_size
    cells = rearrange(images.float(), "b c (h i s) (w j t) -> b (h w) (i j) (s t) c", i=GRID, j=GRID, s=s, t=s)
    return _color_ids(cells.mean(dim=3))  # [B, N, 16, C] -> [B, N, 16]


def pixel_targets(images: Tensor, patch_size: int) -> Tensor:
    """``[B, N, P*P*C]`` pixels in (row, column, channel) order, channel fastest (MAE's ``patchify``)."""
    return rearrange(images.float(), "b c (h p) (w q) -> b (h w) (p q c)", p=patch_size, q=patch_size)


def _color_ids(values: Tensor) -> Tensor:
    """Channel values ``[..., C]`` in [0, 1] -> 3-bit colour ids ``[...]`` (computed in float32:
    half-precision means would blur the level boundaries)."""
    levels = torch.floor(values * LEVELS).clamp_(0, LEVELS - 1).long()
    weights = LEVELS ** torch.arange(values.shape[-1] - 1, -1, -1, device=values.device)  # [C]
    return (levels * weights).sum(dim=-1)
