"""Masked patch prediction: the BERT-style corruption plan and the pixel targets.

ViT paper (Dosovitskiy et al., 2021), §4.6 and Appendix B.1.2: corrupt 50 % of the patch embeddings
(after the projection E, before the position embedding); of those, 80 % become a shared learnable
[mask] embedding, 10 % the embedding of a random other patch, 10 % stay unchanged. The target of a
corrupted patch is computed from its raw pixels in [0, 1]:

- ``"mean_color"`` (the paper's default): the 3-bit mean colour, one of 8**C classes (512 for RGB);
- ``"downsized"``: the patch average-pooled to 4x4, each cell a 3-bit colour (16 predictions);
- ``"pixels"``: the full patch's pixels for L2 regression ("slightly worse" in the paper).

Pure torch: usable without Lightning. Typical use::

    plan = make_corruption_plan(B, N, ratio=0.5)
    tokens = backbone.forward_features(x, patch_hook=lambda t: plan.apply(t, mask_token))
    target = mpp_targets(raw_images, patch_size, "mean_color")  # [B, N]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

TargetKind = Literal["mean_color", "downsized", "pixels"]
TARGET_KINDS: tuple[str, ...] = ("mean_color", "downsized", "pixels")

# ViT paper B.1.2: "3-bit" colour, i.e. 8 levels per channel.
COLOR_BITS = 3
COLOR_LEVELS = 2**COLOR_BITS
# ViT paper B.1.2: the downsized target is a 4x4 version of the patch (16 cells).
DOWNSIZED_GRID = 4


@dataclass
class CorruptionPlan:
    """Which patch embeddings to corrupt, and how (BERT's 80/10/10 rule).

    All masks are ``[B, N]`` booleans in the ViT's row-major patch order. ``use_mask`` and
    ``use_random`` are disjoint subsets of ``corrupted``; the rest of ``corrupted`` is kept as is
    (but still predicted, as in BERT). ``random_source`` ``[B, N]`` holds, for every patch, an index
    into the batch's flattened ``B * N`` patch embeddings; it is only read where ``use_random``.
    ``corrupted_idx`` ``[B, k]`` lists the positions of the k corrupted patches of each image (the
    ones ``corrupted`` marks) in ascending order, so the predictions can be gathered without
    searching the mask.
    """

    corrupted: Tensor  # [B, N] bool
    use_mask: Tensor  # [B, N] bool
    use_random: Tensor  # [B, N] bool
    random_source: Tensor  # [B, N] long, indices into the flattened [B * N] patches
    corrupted_idx: Tensor  # [B, k] long, positions in [0, N)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.corrupted.shape[0], self.corrupted.shape[1])

    def to(self, device: torch.device | str) -> CorruptionPlan:
        return CorruptionPlan(
            corrupted=self.corrupted.to(device),
            use_mask=self.use_mask.to(device),
            use_random=self.use_random.to(device),
            random_source=self.random_source.to(device),
            corrupted_idx=self.corrupted_idx.to(device),
        )

    def apply(self, tokens: Tensor, mask_token: Tensor) -> Tensor:
        """Corrupt patch embeddings ``tokens [B, N, D]`` with the shared ``mask_token [D]``.

        Differentiable with respect to both: the [mask] embedding gets the gradient of every
        position it fills, and the kept (and randomly copied) embeddings pass their gradient back
        to E. Fits the backbone's ``patch_hook``.
        """
        if tokens.ndim != 3 or tuple(tokens.shape[:2]) != self.shape:
            raise ValueError(
                f"tokens must be [B, N, D] with (B, N) = {self.shape} as in the corruption plan, "
                f"got shape {tuple(tokens.shape)}"
            )
        dim = tokens.shape[-1]
        if mask_token.numel() != dim:
            raise ValueError(
                f"mask_token must hold D = {dim} values (the embedding width), "
                f"got shape {tuple(mask_token.shape)}"
            )
        plan = self if self.corrupted.device == tokens.device else self.to(tokens.device)
        b, n = self.shape
        # Sources are read from the uncorrupted embeddings, as BERT draws from the vocabulary.
        random_tokens = tokens.reshape(b * n, dim)[plan.random_source.reshape(-1)]  # [B*N, D]
        random_tokens = random_tokens.reshape(b, n, dim)  # [B, N, D]
        # Cast so that autocast's half-precision tokens are not promoted by the fp32 parameter.
        mask = mask_token.reshape(1, 1, dim).to(tokens.dtype)  # [1, 1, D]
        out = torch.where(plan.use_mask.unsqueeze(-1), mask, tokens)  # [B, N, D]
        return torch.where(plan.use_random.unsqueeze(-1), random_tokens, out)  # [B, N, D]


def check_corruption(ratio: float, mask_prob: float, random_prob: float, num_patches: int | None = None) -> None:
    """The corruption settings are usable: a ratio in (0, 1], probabilities that sum to at most
    1, and (given the patches per image) at least one patch corrupted per image."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"corruption ratio must be in (0, 1], got {ratio}")
    if mask_prob < 0.0 or random_prob < 0.0:
        raise ValueError(
            f"mask_prob and random_prob must be >= 0, got {mask_prob} and {random_prob}"
        )
    if mask_prob + random_prob > 1.0 + 1e-9:
        raise ValueError(
            f"mask_prob + random_prob must be <= 1 (the rest is kept unchanged), "
            f"got {mask_prob} + {random_prob} = {mask_prob + random_prob}"
        )
    if num_patches is not None and num_corrupted(num_patches, ratio) < 1:
        raise ValueError(
            f"ratio {ratio} corrupts round({ratio} * {num_patches}) = 0 patches per image; "
            "raise the ratio or use more patches"
        )


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
    """Draw a BERT-style corruption plan for ``batch_size`` images of ``num_patches`` patches.

    Args:
        ratio: fraction of patches corrupted per image; exactly ``round(ratio * N)`` are, at
            positions drawn uniformly (argsort of uniform noise, as MAE's ``random_masking``).
            ViT paper B.1.2 uses 0.5; BERT's 0.15 was "slightly worse" on few-shot.
        mask_prob: probability that a corrupted patch becomes the [mask] embedding (BERT: 0.8).
        random_prob: probability that it becomes another patch's embedding (BERT: 0.1); the
            remaining ``1 - mask_prob - random_prob`` are left unchanged.
        generator: makes the draw reproducible; the draw happens on its device and the plan is
            then moved to ``device``.
        device: where the plan's tensors live (default: the generator's device, else CPU).

    The random source is drawn uniformly from the *other* ``B * N - 1`` patches of the batch
    (the spec's "random other patch"), so a random replacement never degenerates into "unchanged".
    """
    if batch_size < 1 or num_patches < 1:
        raise ValueError(
            f"batch_size and num_patches must be >= 1, got {batch_size} and {num_patches}"
        )
    check_corruption(ratio, mask_prob, random_prob, num_patches)
    k = num_corrupted(num_patches, ratio)
    total = batch_size * num_patches
    if random_prob > 0.0 and total < 2:
        raise ValueError("random replacement needs at least two patches in the batch")

    draw_device = generator.device if generator is not None else (device or "cpu")
    b, n = batch_size, num_patches

    # Exactly k positions per image: the k smallest of uniform noise (MAE's random_masking).
    noise = torch.rand(b, n, generator=generator, device=draw_device)  # [B, N]
    corrupted_idx = torch.argsort(noise, dim=1)[:, :k].sort(dim=1).values  # [B, k], row-major order
    corrupted = torch.zeros(b, n, dtype=torch.bool, device=draw_device)
    corrupted.scatter_(1, corrupted_idx, True)

    # One uniform per patch splits the corrupted ones 80/10/10 independently.
    u = torch.rand(b, n, generator=generator, device=draw_device)  # [B, N]
    use_mask = corrupted & (u < mask_prob)
    use_random = corrupted & (u >= mask_prob) & (u < mask_prob + random_prob)

    # Another patch of the batch: draw from B*N - 1 and skip the patch itself.
    own = torch.arange(total, device=draw_device).reshape(b, n)  # [B, N]
    source = torch.randint(0, max(total - 1, 1), (b, n), generator=generator, device=draw_device)
    source = source + (source >= own).long() if total > 1 else own

    plan = CorruptionPlan(corrupted, use_mask, use_random, source, corrupted_idx)
    out_device = torch.device(device) if device is not None else torch.device(draw_device)
    return plan if out_device == torch.device(draw_device) else plan.to(out_device)


# --------------------------------------------------------------------------------------------
# Targets (ViT paper B.1.2), from un-normalised pixels in [0, 1]


def num_target_classes(kind: TargetKind, in_chans: int) -> int:
    """Classes of one colour prediction: ``8 ** C`` (512 for RGB, 8 for grey).

    Only the classification targets have classes; ``"pixels"`` is a regression.
    """
    _check_kind(kind)
    if in_chans < 1:
        raise ValueError(f"in_chans must be >= 1, got {in_chans}")
    if kind == "pixels":
        raise ValueError("target 'pixels' is an L2 regression and has no classes")
    return COLOR_LEVELS**in_chans


def target_shape(kind: TargetKind, in_chans: int, patch_size: int) -> tuple[int, ...]:
    """Per-patch shape of the head's prediction for a target kind.

    ``"mean_color"``: ``(8**C,)`` logits; ``"downsized"``: ``(16, 8**C)`` logits;
    ``"pixels"``: ``(P * P * C,)`` values.
    """
    _check_kind(kind)
    if kind == "pixels":
        return (patch_size * patch_size * in_chans,)
    classes = num_target_classes(kind, in_chans)
    if kind == "downsized":
        _check_downsizable(patch_size)
        return (DOWNSIZED_GRID * DOWNSIZED_GRID, classes)
    return (classes,)


def mpp_targets(images: Tensor, patch_size: int, kind: TargetKind, *, check_range: bool = True) -> Tensor:
    """Targets of every patch for ``kind`` (see the three functions below).

    ``check_range`` verifies that the pixels lie in [0, 1] (normalised images would give targets
    that are silently wrong): two reductions over the images and, on a GPU, a wait for the device
    every call. A caller whose pixels are in range by construction (MPP clamps them) skips it.
    """
    _check_kind(kind)
    if kind == "mean_color":
        return mean_color_targets(images, patch_size, check_range=check_range)
    if kind == "downsized":
        return downsized_color_targets(images, patch_size, check_range=check_range)
    return pixel_targets(images, patch_size, check_range=check_range)


def mean_color_targets(images: Tensor, patch_size: int, *, check_range: bool = True) -> Tensor:
    """Images ``[B, C, H, W]`` in [0, 1] -> 3-bit mean-colour class ids ``[B, N]`` (long).

    Per patch and channel the mean value ``m`` becomes the level ``min(floor(8 m), 7)``; the class
    id reads the levels as base-8 digits, first channel most significant: ``r * 64 + g * 8 + b``.
    """
    patches = _patch_grid(images, patch_size, check_range)  # [B, C, h, P, w, P]
    means = patches.mean(dim=(3, 5))  # [B, C, h, w]
    return _color_ids(means.flatten(2).transpose(1, 2))  # [B, N]


def downsized_color_targets(images: Tensor, patch_size: int, *, check_range: bool = True) -> Tensor:
    """Images ``[B, C, H, W]`` in [0, 1] -> 4x4 downsized 3-bit colours ``[B, N, 16]`` (long).

    Each patch is average-pooled to a 4x4 grid (``P`` must be divisible by 4); the 16 cells are in
    row-major order within the patch, each a class id as in :func:`mean_color_targets`.
    """
    _check_downsizable(patch_size)
    x = _checked_images(images, patch_size, check_range)
    b, c, height, width = x.shape
    g, s = DOWNSIZED_GRID, patch_size // DOWNSIZED_GRID
    h, w = height // patch_size, width // patch_size
    cells = x.reshape(b, c, h, g, s, w, g, s).mean(dim=(4, 7))  # [B, C, h, 4, w, 4]
    cells = cells.permute(0, 2, 4, 3, 5, 1).reshape(b, h * w, g * g, c)  # [B, N, 16, C]
    return _color_ids(cells)  # [B, N, 16]


def pixel_targets(images: Tensor, patch_size: int, *, check_range: bool = True) -> Tensor:
    """Images ``[B, C, H, W]`` in [0, 1] -> patch pixels ``[B, N, P * P * C]`` (float).

    Each patch is flattened in ``(row, column, channel)`` order, channel fastest (MAE's
    ``patchify``), so ``target[b, n].reshape(P, P, C)`` is the patch as an HWC image.
    """
    patches = _patch_grid(images, patch_size, check_range)  # [B, C, h, P, w, P]
    b, c, h, p, w, _ = patches.shape
    patches = patches.permute(0, 2, 4, 3, 5, 1)  # [B, h, w, P, P, C]
    return patches.reshape(b, h * w, p * p * c)  # [B, N, P*P*C]


# --------------------------------------------------------------------------------------------
# helpers


def _check_kind(kind: str) -> None:
    if kind not in TARGET_KINDS:
        raise ValueError(f"unknown MPP target kind {kind!r}; expected one of {TARGET_KINDS}")


def _check_downsizable(patch_size: int) -> None:
    if patch_size % DOWNSIZED_GRID != 0:
        raise ValueError(
            f"the 4x4 downsized target needs a patch size divisible by {DOWNSIZED_GRID}, "
            f"got patch_size={patch_size}"
        )


def _checked_images(images: Tensor, patch_size: int, check_range: bool = True) -> Tensor:
    if images.ndim != 4:
        raise ValueError(f"images must be [B, C, H, W], got shape {tuple(images.shape)}")
    if patch_size < 1:
        raise ValueError(f"patch_size must be >= 1, got {patch_size}")
    height, width = images.shape[-2:]
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"image size {height}x{width} is not divisible by the patch size {patch_size}"
        )
    if not images.is_floating_point():
        raise ValueError(f"images must be floating point in [0, 1], got dtype {images.dtype}")
    # Targets are defined on raw pixels; normalised inputs (mean/std) would silently give garbage.
    tol = 1e-3
    if check_range and images.numel() and (images.min() < -tol or images.max() > 1 + tol):
        raise ValueError(
            "MPP targets need un-normalised pixels in [0, 1]; got values in "
            f"[{images.min().item():.3f}, {images.max().item():.3f}] (normalised images?)"
        )
    # Means in float32: half-precision sums would blur the level boundaries.
    return images.float()


def _patch_grid(images: Tensor, patch_size: int, check_range: bool = True) -> Tensor:
    """``[B, C, H, W]`` -> ``[B, C, h, P, w, P]`` (patch rows h, patch columns w)."""
    x = _checked_images(images, patch_size, check_range)
    b, c, height, width = x.shape
    p = patch_size
    return x.reshape(b, c, height // p, p, width // p, p)


def _color_ids(values: Tensor) -> Tensor:
    """Channel means ``[..., C]`` in [0, 1] -> class ids ``[...]``: base-8 digits, first channel
    most significant."""
    levels = torch.floor(values.float() * COLOR_LEVELS).clamp_(0, COLOR_LEVELS - 1).long()
    c = values.shape[-1]
    weights = COLOR_LEVELS ** torch.arange(c - 1, -1, -1, device=values.device)  # [C]
    return (levels * weights).sum(dim=-1)
