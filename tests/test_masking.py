from __future__ import annotations

import pytest
import torch
from einops import EinopsError

from ssl_vit.backbones import VisionTransformer
from ssl_vit.masking import (
    CorruptionPlan,
    downsized_color_targets,
    make_corruption_plan,
    mean_color_targets,
    mpp_targets,
    num_corrupted,
    pixel_targets,
    target_shape,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _paint(colors: list[list[tuple[float, ...]]], p: int) -> torch.Tensor:
    """Image [1, C, rows*p, cols*p] whose patch (r, c) is the constant colour colors[r][c]."""
    t = torch.tensor(colors, dtype=torch.float32)  # [rows, cols, C]
    img = t.permute(2, 0, 1).repeat_interleave(p, dim=1).repeat_interleave(p, dim=2)
    return img.unsqueeze(0)


# ------------------------------------------------------------------------------------------
# corruption plan


@pytest.mark.parametrize("ratio,n", [(0.5, 16), (0.15, 196), (0.5, 49), (1.0, 9), (0.3, 10), (0.15, 64)])
def test_exact_number_corrupted_per_image(ratio: float, n: int) -> None:
    plan = make_corruption_plan(7, n, ratio=ratio, generator=_gen())
    expected = round(ratio * n)
    assert num_corrupted(n, ratio) == expected
    assert num_corrupted(64, 0.15) == 10  # round(9.6): rounded, not floored
    assert plan.corrupted.shape == (7, n)
    assert plan.corrupted.sum(dim=1).tolist() == [expected] * 7
    # The listed positions are exactly the marked ones, each once, in ascending order.
    assert plan.corrupted_idx.shape == (7, expected)
    for row, idx in zip(plan.corrupted, plan.corrupted_idx):
        assert idx.tolist() == row.nonzero().flatten().tolist()


def test_positions_are_random_and_cover_all_patches() -> None:
    b, n = 64, 16
    counts = torch.zeros(n)
    rows = set()
    for seed in range(10):
        plan = make_corruption_plan(b, n, ratio=0.5, generator=_gen(seed))
        counts += plan.corrupted.float().sum(dim=0)
        rows.update(tuple(r.tolist()) for r in plan.corrupted)
    freq = counts / (10 * b)
    # Each position is corrupted with probability 0.5; 640 draws -> std 0.02.
    assert torch.all((freq - 0.5).abs() < 0.1), freq
    assert len(rows) > 500  # the per-image patterns differ


@pytest.mark.parametrize("mask_prob,random_prob", [(0.8, 0.1), (0.5, 0.3)])
def test_replacement_split_statistics(mask_prob: float, random_prob: float) -> None:
    n_mask = n_rand = n_keep = 0
    for seed in range(20):
        plan = make_corruption_plan(
            32, 64, ratio=0.5, mask_prob=mask_prob, random_prob=random_prob, generator=_gen(seed)
        )
        c = plan.corrupted
        # Subsets of corrupted and disjoint.
        assert not (plan.use_mask & ~c).any()
        assert not (plan.use_random & ~c).any()
        assert not (plan.use_mask & plan.use_random).any()
        n_mask += int(plan.use_mask.sum())
        n_rand += int(plan.use_random.sum())
        n_keep += int((c & ~plan.use_mask & ~plan.use_random).sum())
    total = n_mask + n_rand + n_keep
    assert total == 20 * 32 * 32
    keep_prob = 1 - mask_prob - random_prob
    # 20480 Bernoulli draws: the std of a frequency is <= 0.0035; allow 5 sigma.
    for got, want in [(n_mask, mask_prob), (n_rand, random_prob), (n_keep, keep_prob)]:
        assert abs(got / total - want) < 0.018, (got / total, want)


def test_random_source_is_another_patch_from_the_whole_batch() -> None:
    b, n = 4, 8
    plan = make_corruption_plan(b, n, generator=_gen(1))
    own = torch.arange(b * n).reshape(b, n)
    assert plan.random_source.dtype == torch.long
    assert torch.all(plan.random_source != own)
    assert plan.random_source.min() >= 0 and plan.random_source.max() < b * n
    # Sources come from other images too (BERT draws from the whole vocabulary).
    srcs = torch.cat(
        [make_corruption_plan(b, n, generator=_gen(s)).random_source for s in range(20)]
    )
    assert torch.unique(srcs).numel() == b * n
    assert (srcs // n != own.repeat(20, 1) // n).any()


def test_generator_reproducibility() -> None:
    p1 = make_corruption_plan(5, 20, generator=_gen(3))
    p2 = make_corruption_plan(5, 20, generator=_gen(3))
    p3 = make_corruption_plan(5, 20, generator=_gen(4))
    for f in ("corrupted", "use_mask", "use_random", "random_source"):
        assert torch.equal(getattr(p1, f), getattr(p2, f))
    assert not torch.equal(p1.corrupted, p3.corrupted)


def test_apply_places_mask_random_and_original_embeddings() -> None:
    b, n, d = 3, 10, 5
    tokens = torch.randn(b, n, d)
    mask_token = torch.randn(d)
    plan = make_corruption_plan(b, n, ratio=0.6, mask_prob=0.4, random_prob=0.4, generator=_gen(2))
    assert plan.use_mask.any() and plan.use_random.any()
    out = plan.apply(tokens, mask_token)
    flat = tokens.reshape(b * n, d)
    for i in range(b):
        for j in range(n):
            if plan.use_mask[i, j]:
                expected = mask_token
            elif plan.use_random[i, j]:
                expected = flat[plan.random_source[i, j]]
            else:  # not corrupted, or corrupted but kept
                expected = tokens[i, j]
            assert torch.equal(out[i, j], expected), (i, j)


def test_apply_gradients_reach_mask_token_and_embeddings() -> None:
    b, n, d = 2, 12, 4
    tokens = torch.randn(b, n, d, requires_grad=True)
    mask_token = torch.zeros(d, requires_grad=True)
    plan = make_corruption_plan(b, n, ratio=0.5, mask_prob=0.5, random_prob=0.25, generator=_gen(5))
    plan.apply(tokens, mask_token).sum().backward()
    n_mask = int(plan.use_mask.sum())
    assert n_mask > 0
    assert torch.allclose(mask_token.grad, torch.full((d,), float(n_mask)))
    # Each embedding's gradient counts the places it appears in the output:
    # once where it is not replaced, plus once per use as a random source.
    kept = (~plan.use_mask & ~plan.use_random).float().reshape(-1)
    used = torch.bincount(plan.random_source[plan.use_random], minlength=b * n).float()
    expected = (kept + used).reshape(b, n, 1).expand(b, n, d)
    assert torch.equal(tokens.grad, expected)


def test_apply_as_patch_hook_of_a_vit() -> None:
    torch.manual_seed(0)
    vit = VisionTransformer(
        img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=1, num_heads=2
    )
    mask_token = torch.nn.Parameter(torch.zeros(32))
    x = torch.rand(2, 3, 16, 16)
    plan = make_corruption_plan(2, 16, generator=_gen(0))
    out = vit.forward_features(x, patch_hook=lambda t: plan.apply(t, mask_token))
    assert out.shape == (2, 17, 32)
    out[:, 1:][plan.corrupted].sum().backward()
    assert mask_token.grad is not None and mask_token.grad.abs().sum() > 0
    assert vit.patch_embed.proj.weight.grad is not None
    # The hook changed the corrupted outputs.
    clean = vit.forward_features(x)
    assert not torch.allclose(clean, out.detach())


def test_apply_casts_mask_token_to_token_dtype() -> None:
    plan = make_corruption_plan(2, 4, generator=_gen(0))
    out = plan.apply(torch.randn(2, 4, 3, dtype=torch.bfloat16), torch.randn(3))
    assert out.dtype == torch.bfloat16


def test_a_plan_that_corrupts_nothing_or_tokens_of_another_shape_are_refused() -> None:
    with pytest.raises(AssertionError):
        make_corruption_plan(2, 3, ratio=0.1)  # round(0.3) = 0 patches
    plan = make_corruption_plan(2, 16)
    assert isinstance(plan, CorruptionPlan)
    with pytest.raises(AssertionError):
        plan.apply(torch.randn(2, 15, 8), torch.zeros(8))
    with pytest.raises(AssertionError):
        plan.apply(torch.randn(2, 16, 8), torch.zeros(7))


# ------------------------------------------------------------------------------------------
# targets


def test_mean_color_targets_on_crafted_patches() -> None:
    p = 4
    colors = [
        [(1.0, 0.5, 0.0), (0.0, 0.0, 0.0), (0.99, 0.126, 0.25)],
        [(0.125, 0.124, 0.874), (1.0, 1.0, 1.0), (0.3, 0.6, 0.9)],
    ]
    img = _paint(colors, p)  # [1, 3, 8, 12]
    ids = mean_color_targets(img, p)
    assert ids.dtype == torch.long and ids.shape == (1, 6)
    # Hand-computed levels min(floor(8 m), 7): 1.0->7, 0.5->4, 0.99->7, 0.126->1, 0.25->2,
    # 0.125->1, 0.124->0, 0.874->6, 0.3->2, 0.6->4, 0.9->7; row-major patch order.
    expected = [
        7 * 64 + 4 * 8 + 0,
        0,
        7 * 64 + 1 * 8 + 2,
        1 * 64 + 0 * 8 + 6,
        511,
        2 * 64 + 4 * 8 + 7,
    ]
    assert ids[0].tolist() == expected


def test_mean_color_uses_the_mean_of_the_patch() -> None:
    p = 4
    img = torch.zeros(1, 3, 4, 4)
    img[:, 0, :2] = 1.0  # red: half the patch at 1 -> mean 0.5 -> level 4
    img[:, 1, :, :1] = 1.0  # green: a quarter at 1 -> mean 0.25 -> level 2
    img[:, 2, 0, 0] = 1.0  # blue: 1/16 -> mean 0.0625 -> level 0
    assert mean_color_targets(img, p).tolist() == [[4 * 64 + 2 * 8 + 0]]


def test_mean_color_grey_has_eight_classes() -> None:
    # Four 2x2 grey patches in a row.
    img = torch.cat([torch.full((1, 1, 2, 2), v) for v in (0.0, 0.3, 0.7, 1.0)], dim=3)
    assert mean_color_targets(img, 2).tolist() == [[0, 2, 5, 7]]
    assert target_shape("mean_color", 1, 2) == (8,) and target_shape("mean_color", 3, 2) == (512,)
    assert target_shape("downsized", 3, 4) == (16, 512)


def test_downsized_targets_on_crafted_patch() -> None:
    p = 8  # each of the 4x4 cells is 2x2 pixels
    torch.manual_seed(0)
    levels = torch.randint(0, 8, (4, 4, 3))  # [cell row, cell col, C]
    cell_vals = (levels.float() + 0.5) / 8  # centre of each level
    patch = cell_vals.permute(2, 0, 1).repeat_interleave(2, 1).repeat_interleave(2, 2)  # [3, 8, 8]
    other = torch.ones(3, 8, 8)
    img = torch.cat([other, patch], dim=2).unsqueeze(0)  # [1, 3, 8, 16]: patches (white, crafted)
    ids = downsized_color_targets(img, p)
    assert ids.shape == (1, 2, 16) and ids.dtype == torch.long
    assert ids[0, 0].tolist() == [511] * 16
    expected = [
        int(levels[r, c, 0] * 64 + levels[r, c, 1] * 8 + levels[r, c, 2])
        for r in range(4)
        for c in range(4)
    ]
    assert ids[0, 1].tolist() == expected


def test_downsized_targets_follow_the_patches_in_row_major_order() -> None:
    # A 2x3 grid of patches, each one flat level: patch n of the targets is grid cell (n // 3, n % 3)
    # (as the tokens of the ViT, row-major), also when the grid is not square.
    levels = torch.tensor([[0, 1, 2], [3, 4, 5]])
    img = ((levels.float() + 0.5) / 8).repeat_interleave(4, 0).repeat_interleave(4, 1)[None, None]  # [1, 1, 8, 12]
    ids = downsized_color_targets(img, 4)
    assert ids.shape == (1, 6, 16)
    assert ids[0].tolist() == [[v] * 16 for v in levels.flatten().tolist()]
    square = ((levels[:, :2].float() + 0.5) / 8).repeat_interleave(4, 0).repeat_interleave(4, 1)[None, None]  # 2x2
    assert downsized_color_targets(square, 4)[0, :, 0].tolist() == [0, 1, 3, 4]


def test_downsized_averages_inside_cells() -> None:
    img = torch.zeros(1, 1, 4, 4)
    img[0, 0, 0, 0] = 1.0  # P = 4: each cell is a single pixel
    assert downsized_color_targets(img, 4)[0, 0].tolist() == [7] + [0] * 15
    img = torch.zeros(1, 1, 8, 8)
    img[0, 0, 0, 0] = 1.0  # P = 8: the first cell's mean is 1/4 -> level 2
    assert downsized_color_targets(img, 8)[0, 0].tolist() == [2] + [0] * 15


def test_pixel_targets_order() -> None:
    torch.manual_seed(0)
    b, c, p = 2, 3, 4
    img = torch.rand(b, c, 8, 12)
    t = pixel_targets(img, p)
    assert t.shape == (b, 6, p * p * c) and t.dtype == torch.float32
    for i in range(b):
        for n in range(6):
            r, col = divmod(n, 3)
            patch = img[i, :, r * p : (r + 1) * p, col * p : (col + 1) * p]  # [C, P, P]
            assert torch.equal(t[i, n].reshape(p, p, c), patch.permute(1, 2, 0))
    # (row, column, channel), channel fastest: the first three values are pixel (0, 0)'s RGB.
    assert torch.equal(t[0, 0, :3], img[0, :, 0, 0])


def test_mpp_targets_dispatch_and_shapes() -> None:
    img = torch.rand(2, 3, 16, 16)
    assert mpp_targets(img, 8, "mean_color").shape == (2, 4)
    assert mpp_targets(img, 8, "downsized").shape == (2, 4, 16)
    assert mpp_targets(img, 8, "pixels").shape == (2, 4, 192)
    assert target_shape("mean_color", 3, 8) == (512,)
    assert target_shape("downsized", 3, 8) == (16, 512)
    assert target_shape("pixels", 3, 8) == (192,)
    assert target_shape("mean_color", 1, 7) == (8,)


def test_targets_of_half_precision_images_are_those_of_their_float32_values() -> None:
    # bf16 / fp16 images (a half-precision loader, autocast) are averaged in float32: summed in
    # their own precision, the means cross the 3-bit level boundaries.
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.rand(8, 3, 32, 32, generator=g).to(dtype)
        assert torch.equal(mean_color_targets(x, 16), mean_color_targets(x.float(), 16))
        assert torch.equal(downsized_color_targets(x, 16), downsized_color_targets(x.float(), 16))
        pixels = pixel_targets(x, 16)
        assert pixels.dtype == torch.float32 and torch.equal(pixels, pixel_targets(x.float(), 16))


def test_targets_need_patches_that_tile_the_image() -> None:
    img = torch.rand(1, 3, 12, 12)
    with pytest.raises(EinopsError):
        mean_color_targets(img, 5)
    with pytest.raises(AssertionError):
        downsized_color_targets(img, 6)
    with pytest.raises(ValueError, match="divisible by 4"):
        target_shape("downsized", 3, 7)
