"""The analysis figures: each computed quantity against a hand computation or a reference written
out here (the definitions with loops, attention from the blocks' weights, DINO's mask recipe, the
bilinear formula, numpy's covariance); the drawings by the arrays their figures hold; the callback
by what it logs."""

from __future__ import annotations

import itertools
import math
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from matplotlib import colormaps
from torch import Tensor, nn

import ssl_vit.analysis.render as render
from ssl_vit.analysis import FIGURES, AnalysisCallback, compute_all, render_all
from ssl_vit.analysis.attention import (
    DinoAttention,
    attention_rollout,
    batch_images,
    compute_attention_distance,
    dino_attention,
    image_grid,
    keep_top_mass,
    mean_attention_distance,
    rollout_map,
)
from ssl_vit.analysis.draw import (
    figure_to_array,
    plot_attention_distance,
    plot_dino_attention,
    plot_filters,
    plot_position_similarity,
    plot_rollout,
)
from ssl_vit.analysis.embedding import embedding_filters, filter_weight, position_similarity
from ssl_vit.analysis.render import AnalysisArrays, applicable_figures, denormalize, save_all
from ssl_vit.backbones import create_backbone
from ssl_vit.backbones.pos_embed import sincos_2d_pos_embed
from ssl_vit.backbones.vit import VisionTransformer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_vit(img_size: int = 16, in_chans: int = 3) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=img_size, patch_size=4, in_chans=in_chans, embed_dim=32, depth=2, num_heads=2)


def sharp_vit(img_size: tuple[int, int] | int, in_chans: int = 1) -> VisionTransformer:
    """A tiny ViT (4 px patches, D=16, 2 blocks, 2 heads) with large QKV weights: its layers
    attend very differently, unlike a freshly initialised ViT's near-uniform attention."""
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=img_size, patch_size=4, in_chans=in_chans, embed_dim=16, depth=2, num_heads=2)
    for blk in vit.blocks:
        nn.init.normal_(blk.attn.qkv.weight, std=0.25)
    return vit.eval()


def cells(h: int, w: int) -> list[tuple[int, int]]:
    return [(r, c) for r in range(h) for c in range(w)]  # row-major, like the token sequence


def attention_from_targets(h: int, w: int, target, cls_mass: float = 0.0, prefix: int = 1) -> Tensor:
    """[1, 1, T, T]: each patch query puts ``cls_mass`` on the first prefix token and the rest on
    the patch ``target(r, c)``; the prefix queries attend uniformly (they must be ignored)."""
    t = prefix + h * w
    a = torch.zeros(1, 1, t, t, dtype=torch.float64)
    a[0, 0, :prefix, :] = 1.0 / t
    for i, (r, c) in enumerate(cells(h, w)):
        tr, tc = target(r, c)
        a[0, 0, prefix + i, 0] = cls_mass
        a[0, 0, prefix + i, prefix + tr * w + tc] += 1.0 - cls_mass
    return a


def distance_by_loops(attn: Tensor, h: int, w: int, p: float, renormalize: bool = True, prefix: int = 1) -> list[float]:
    """ViT paper Fig. 7 / D.7 written out: per head, the mean over images and query patches i of
    Σ_j a_ij·|centre_i − centre_j| over the patch keys j (pixels); the prefix tokens dropped, each
    query's patch weights rescaled to sum to 1 when ``renormalize``. [B, heads, T, T] -> per head."""
    a = attn.double()
    out = []
    for head in range(a.shape[1]):
        total = 0.0
        for b in range(a.shape[0]):
            for i, (r, c) in enumerate(cells(h, w)):
                weights = a[b, head, prefix + i, prefix:]
                mass = float(weights.sum()) if renormalize else 1.0
                total += sum(float(weights[j]) * math.dist((r * p, c * p), (r2 * p, c2 * p)) for j, (r2, c2) in enumerate(cells(h, w))) / mass
        out.append(total / (a.shape[0] * h * w))
    return out


def attention_by_hand(vit: VisionTransformer, x: Tensor) -> list[Tensor]:
    """Every block's softmax(q·kᵀ/√d) per head, from the block's input (caught by a hook) and its
    LayerNorm and QKV weights: timm's layout, qkv [B, T, 3, heads, d]. -> depth × [B, heads, T, T]."""
    inputs: list[Tensor] = []
    hooks = [blk.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach())) for blk in vit.blocks]
    try:
        with torch.no_grad():
            vit.eval()(x)
    finally:
        for hook in hooks:
            hook.remove()
    maps = []
    for blk, tokens in zip(vit.blocks, inputs, strict=True):
        b, t, d = tokens.shape
        heads = vit.num_heads
        y = F.layer_norm(tokens, (d,), blk.norm1.weight, blk.norm1.bias, eps=1e-6)
        qkv = (y @ blk.attn.qkv.weight.T + blk.attn.qkv.bias).reshape(b, t, 3, heads, d // heads)
        q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)  # [B, heads, T, d/heads]
        maps.append(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // heads), dim=-1).detach())
    return maps


def rollout_by_hand(layers: list[Tensor]) -> np.ndarray:
    """Abnar & Zuidema's rollout: per layer (mean over heads + I) / 2 (rows sum to 1), composed
    as Ã_L ··· Ã_1. ``layers`` depth × [B, heads, T, T] -> [B, T, T]."""
    out = []
    for b in range(layers[0].shape[0]):
        t = layers[0].shape[-1]
        r = np.eye(t)
        for layer in layers:
            r = (0.5 * layer[b].double().numpy().mean(axis=0) + 0.5 * np.eye(t)) @ r
        out.append(r)
    return np.stack(out)


def dino_mask_reference(w: Tensor, threshold: float) -> Tensor:
    """DINO visualize_attention.py: sort ascending, normalise, keep where the running sum exceeds
    1 − threshold, undo the sort. ``w`` [N] -> bool [N]."""
    val, idx = torch.sort(w.double())
    keep = torch.cumsum(val / val.sum(), 0) > 1 - threshold
    return keep[torch.argsort(idx)]


def bilinear_half_pixel(grid: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Bilinear upsampling with pixel centres at half-integers (align_corners=False), edges
    clamped, written out: output pixel y samples the input at (y + ½)·h/H − ½."""
    h, w = grid.shape
    out = np.zeros((out_h, out_w))

    def source(o: int, n_in: int, n_out: int) -> tuple[int, int, float]:
        s = max((o + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = min(int(s), n_in - 1)
        return i0, min(i0 + 1, n_in - 1), s - i0

    for y in range(out_h):
        y0, y1, fy = source(y, h, out_h)
        for x in range(out_w):
            x0, x1, fx = source(x, w, out_w)
            top = (1 - fx) * grid[y0, x0] + fx * grid[y0, x1]
            bottom = (1 - fx) * grid[y1, x0] + fx * grid[y1, x1]
            out[y, x] = (1 - fy) * top + fy * bottom
    return out


def unit(x) -> np.ndarray:  # a map rescaled to [0, 1] for display
    x = np.asarray(x, dtype=np.float64)
    return (x - x.min()) / (x.max() - x.min())


# ------------------------------------------------------------------ mean attention distance
def right(w: int):  # the right neighbour, or the left one in the last column: one patch away
    return lambda r, c: (r, c + 1) if c + 1 < w else (r, c - 1)


@pytest.mark.parametrize(
    "grid, target, cls_mass, renormalize, expected",
    [
        ((3, 3), lambda r, c: (r, c), 0.0, True, 0.0),  # attention on itself: distance 0
        ((3, 4), right(4), 0.0, True, 16.0),  # always one patch (16 px) away
        ((3, 4), right(4), 0.5, True, 16.0),  # half on [CLS]: renormalised over patches, still one patch
        ((3, 4), right(4), 0.5, False, 8.0),  # ... raw weights: the [CLS] half counts as distance 0
        ((2, 2), lambda r, c: (1 - r, 1 - c), 0.0, True, 16.0 * math.sqrt(2)),  # the diagonal neighbour
    ],
)
def test_crafted_heads_have_the_distance_of_their_target(grid, target, cls_mass, renormalize, expected) -> None:
    attn = attention_from_targets(*grid, target, cls_mass)
    got = mean_attention_distance([attn, attn], grid, patch_size=16, renormalize=renormalize)
    assert got.shape == (2, 1)
    torch.testing.assert_close(got, torch.full((2, 1), expected), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grid,p", [((2, 2), 8), ((3, 3), 5), ((2, 3), 7)])
def test_uniform_attention_gives_mean_pairwise_distance(grid: tuple[int, int], p: int) -> None:
    h, w = grid
    pts = cells(h, w)
    n = len(pts)
    # Mean over queries i of the mean over keys j (self included) of |centre_i - centre_j|.
    expected = sum(math.dist((a[0] * p, a[1] * p), (b[0] * p, b[1] * p)) for a in pts for b in pts) / n**2
    if grid == (2, 2):  # by hand: each query sees 0, p, p, p·√2
        assert expected == pytest.approx((2 * p + p * math.sqrt(2)) / 4)
    uniform = torch.full((1, 2, 1 + n, 1 + n), 1.0 / (1 + n))  # [CLS] gets a share too
    torch.testing.assert_close(mean_attention_distance([uniform], grid, patch_size=p), torch.full((1, 2), expected), rtol=1e-6, atol=1e-5)
    raw = mean_attention_distance([uniform], grid, patch_size=p, renormalize=False)
    torch.testing.assert_close(raw, torch.full((1, 2), expected * n / (n + 1)), rtol=1e-6, atol=1e-5)


def test_distance_averages_over_images_and_keeps_layers_and_heads_apart() -> None:
    h, w, p = 2, 3, 4
    self_attn = attention_from_targets(h, w, lambda r, c: (r, c))
    down = attention_from_targets(h, w, lambda r, c: (1 - r, c))  # one row away: p
    far = attention_from_targets(h, w, lambda r, c: (1 - r, 2 - c))  # corner-to-corner mirror
    per_query_far = [math.dist((r * p, c * p), ((1 - r) * p, (2 - c) * p)) for r, c in cells(h, w)]
    layer0 = torch.cat([torch.cat([self_attn, down], 1), torch.cat([down, down], 1)])  # [B=2, heads=2]
    layer1 = torch.cat([torch.cat([far, self_attn], 1), torch.cat([far, far], 1)])
    got = mean_attention_distance([layer0, layer1], (h, w), patch_size=p)
    expected = torch.tensor([[p / 2, p], [sum(per_query_far) / 6, sum(per_query_far) / 12]])
    torch.testing.assert_close(got, expected.float())


@pytest.mark.parametrize("prefix", [0, 1, 2])
@pytest.mark.parametrize("renormalize", [True, False])
def test_distance_is_its_definition_with_each_query_renormalised_on_its_own(prefix: int, renormalize: bool) -> None:
    """Random attention whose queries put different shares on the prefix tokens, against the
    definition written out with loops: the prefix rows and columns dropped, each query's patch
    weights rescaled by their own mass."""
    torch.manual_seed(0)
    h, w, p = 2, 3, 5
    t = prefix + h * w
    attn = torch.softmax(3 * torch.randn(2, 2, t, t), dim=-1)  # [B, heads, T, T]
    attn[:, :, prefix:, :prefix] *= torch.linspace(0.5, 20.0, h * w)[:, None]  # a prefix share that differs per query
    attn = attn / attn.sum(-1, keepdim=True)
    got = mean_attention_distance([attn], (h, w), patch_size=p, num_prefix_tokens=prefix, renormalize=renormalize)  # [1, heads]
    np.testing.assert_allclose(got[0].numpy(), distance_by_loops(attn, h, w, p, renormalize, prefix), rtol=1e-5)


class PatternBackbone(nn.Module):
    """Duck-typed backbone with two prefix tokens: every patch query puts half its mass on the
    first one and half on itself, or on its right neighbour for images whose first pixel is not 0;
    counts the images each forward pass sees."""

    patch_size = 8
    num_prefix_tokens = 2

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Linear(1, 1)
        self.calls: list[int] = []

    def get_attention_maps(self, x: Tensor) -> list[Tensor]:
        assert not self.training
        h, w = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        self.calls.append(x.shape[0])
        moved = attention_from_targets(h, w, right(w), cls_mass=0.5, prefix=2)
        same = attention_from_targets(h, w, lambda r, c: (r, c), cls_mass=0.5, prefix=2)
        return [torch.cat([moved if x[b, 0, 0, 0] > 0 else same for b in range(x.shape[0])]).float()] * 3  # 3 layers, 1 head


@pytest.mark.parametrize("renormalize, per_moved_image", [(True, 8.0), (False, 4.0)])
def test_streamed_distance_truncates_chunks_reads_the_prefix_count_and_restores_mode(renormalize: bool, per_moved_image: float) -> None:
    model = PatternBackbone().train()
    flags = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    images = flags.view(-1, 1, 1, 1).expand(-1, 1, 16, 24).contiguous()  # grid 2×3
    loader = [(images[i : i + 3], torch.zeros(3)) for i in range(0, 7, 3)]  # (images, labels)
    got = compute_attention_distance(model, loader, num_images=5, chunk_size=2, renormalize=renormalize)
    # first 5 images: flags 1, 0, 1, 1, 0 -> one patch (8 px; 4 px counting the prefix half as 0) for 3 of 5
    torch.testing.assert_close(got, torch.full((3, 1), per_moved_image * 3 / 5))
    assert sum(model.calls) == 5 and max(model.calls) <= 2
    assert model.training


def test_compute_all_streams_the_distance_in_its_chunks() -> None:
    vit = tiny_vit()
    seen: list[int] = []
    maps = vit.get_attention_maps
    vit.get_attention_maps = lambda x: seen.append(x.shape[0]) or maps(x)
    compute_all(vit, torch.randn(5, 3, 16, 16), figures=["attention_distance"], chunk_size=2)
    assert seen == [2, 2, 1]


def test_streamed_distance_on_a_real_vit_matches_one_batch() -> None:
    vit = tiny_vit()
    x = torch.randn(5, 3, 16, 16)
    whole = mean_attention_distance(vit.eval().get_attention_maps(x), (4, 4), patch_size=4)
    streamed = compute_attention_distance(vit.train(), [x[:2], x[2:]], num_images=128, chunk_size=2)
    assert streamed.shape == (2, 2)
    torch.testing.assert_close(streamed, whole, rtol=1e-5, atol=1e-5)
    assert vit.training


# ------------------------------------------------------------------------------ rollout
def test_rollout_of_identity_attention_is_identity() -> None:
    t = 1 + 6
    eye = torch.eye(t).expand(2, 3, t, t)
    torch.testing.assert_close(attention_rollout([eye, eye, eye]), torch.eye(t).expand(2, t, t))
    maps = rollout_map([eye, eye], (2, 3), out_size=(8, 12))
    assert maps.shape == (2, 8, 12)
    assert torch.count_nonzero(maps) == 0  # [CLS] only ever looked at itself


@pytest.mark.parametrize("prefix", [1, 2])
def test_rollout_and_dino_maps_are_the_written_out_product_over_the_patches(prefix: int) -> None:
    """The rollout against the written-out product (rows summing to 1), and the [CLS] maps of the
    rollout and of DINO's last layer over the 6 patch keys after every prefix token."""
    torch.manual_seed(1)
    h, w, t = 2, 3, prefix + 6
    layers = [torch.softmax(torch.randn(2, 3, t, t), dim=-1) for _ in range(3)]  # [B, heads, T, T]
    want = rollout_by_hand(layers)
    got = attention_rollout(layers)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(-1).numpy(), 1.0, rtol=1e-5)
    grid = rollout_map(layers, (h, w), num_prefix_tokens=prefix)  # no upsampling
    np.testing.assert_allclose(grid.numpy(), want[:, 0, prefix:].reshape(2, h, w), rtol=1e-5, atol=1e-6)
    dino = dino_attention(layers[-1], (h, w), num_prefix_tokens=prefix)
    torch.testing.assert_close(dino.maps, layers[-1][:, :, 0, prefix:].reshape(2, 3, h, w))


def test_rollout_map_is_upsampled_bilinearly_with_half_pixel_centres() -> None:
    """The rollout's [CLS] map on a 2x3 grid, upsampled to 8x12 pixels, against the bilinear
    formula written out (torch's and PIL's convention for images)."""
    torch.manual_seed(1)
    h, w, t = 2, 3, 1 + 6
    layers = [torch.softmax(2 * torch.randn(1, 2, t, t), dim=-1) for _ in range(3)]
    grid = rollout_by_hand(layers)[0, 0, 1:].reshape(h, w)
    got = rollout_map(layers, (h, w), out_size=(8, 12))  # [B, H, W]
    assert got.shape == (1, 8, 12)
    np.testing.assert_allclose(got[0].numpy(), bilinear_half_pixel(grid, 8, 12), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------ DINO masks
@pytest.mark.parametrize(
    "weights, threshold, kept",
    [
        ([0.05, 0.4, 0.1, 0.25, 0.2], 0.6, [1, 3]),  # 0.4 + 0.25 = 0.65
        ([0.05, 0.4, 0.1, 0.25, 0.2], 0.66, [1, 3, 4]),  # 0.65 is not enough
        ([0.35, 2.8, 0.7, 1.75, 1.4], 0.6, [1, 3]),  # scale-free (×7)
        ([0.05, 0.4, 0.1, 0.25, 0.2], 1.0, [0, 1, 2, 3, 4]),
        ([0.05, 0.4, 0.1, 0.25, 0.2], 0.3, [1]),
        ([0.125, 0.5, 0.375], 0.5, [1]),  # reaching the threshold exactly is enough (binary-exact masses)
    ],
)
def test_keep_top_mass_on_crafted_distributions(weights: list[float], threshold: float, kept: list[int]) -> None:
    mask = keep_top_mass(torch.tensor(weights), threshold)
    assert mask.nonzero().flatten().tolist() == kept


def test_keep_top_mass_is_the_minimal_set_and_agrees_with_dino() -> None:
    tie = keep_top_mass(torch.tensor([0.25, 0.5, 0.25]), 0.75)
    assert int(tie.sum()) == 2 and bool(tie[1])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        w = torch.rand(7, generator=gen, dtype=torch.float64) ** 3
        p = w / w.sum()
        mask = keep_top_mass(w, 0.6)
        assert p[mask].sum() >= 0.6
        smallest = min(len(s) for k in range(1, 8) for s in itertools.combinations(range(7), k) if p[list(s)].sum() >= 0.6)
        assert int(mask.sum()) == smallest
        assert torch.equal(mask, dino_mask_reference(w, 0.6))


def test_dino_attention_maps_and_masks() -> None:
    h, w = 2, 3
    attn = torch.zeros(1, 2, 7, 7)
    attn[0, 0, 0] = torch.tensor([0.4, 0.3, 0.1, 0.05, 0.05, 0.05, 0.05])  # [CLS] keeps 0.4 itself
    attn[0, 1, 0] = torch.full((7,), 1 / 7)
    out = dino_attention(attn, (h, w), threshold=0.6)
    assert out.maps.shape == (1, 2, h, w) and out.masks.shape == (1, 2, h, w)
    torch.testing.assert_close(out.maps[0, 0], torch.tensor([[0.3, 0.1, 0.05], [0.05, 0.05, 0.05]]))
    # head 0 over patches: 0.5, 1/6, 1/12 ×4 -> 0.5 + 1/6 ≥ 0.6 keeps the first two
    assert out.masks[0, 0].tolist() == [[True, True, False], [False, False, False]]
    # head 1 uniform over 6 patches: 4 of them are needed for 60 %
    assert int(out.masks[0, 1].sum()) == 4


# ----------------------------------------------------------------- position embedding
def test_position_similarity_of_sincos_table() -> None:
    d, (h, w) = 64, (4, 5)
    sim = position_similarity(sincos_2d_pos_embed(d, (h, w)), (h, w))
    assert sim.shape == (h, w, h, w)
    # Closed form of the table: pe·pe' = Σ_k cos(Δc·ω_k) + Σ_k cos(Δr·ω_k), |pe|² = D/2.
    omega = [1.0 / 10000 ** (k / (d // 4)) for k in range(d // 4)]
    for (r, c), (r2, c2) in itertools.product(cells(h, w), repeat=2):
        expected = (sum(math.cos((c - c2) * o) for o in omega) + sum(math.cos((r - r2) * o) for o in omega)) / (d / 2)
        assert sim[r, c, r2, c2].item() == pytest.approx(expected, abs=1e-5)
    flat = sim.reshape(h * w, h * w)
    torch.testing.assert_close(flat.diagonal(), torch.ones(h * w))
    torch.testing.assert_close(flat, flat.T)
    assert sim[0, 0, 0, 1] > sim[0, 0, 0, 3]
    assert sim[0, 0, 1, 0] > sim[0, 0, 3, 0]
    assert torch.all(sim[2, 2, 2, 2:].diff() < 0) and torch.all(sim[2, 2, :, 2][:3].diff() > 0)


@pytest.mark.parametrize("prefix", [0, 1, 2])
def test_position_similarity_is_the_cosine_of_each_pair_of_patch_rows(prefix: int) -> None:
    """The layout [r, c, r', c'] against explicit cosines of the rows after the prefix tokens,
    and within [-1, 1] (rounding puts a wide table's self-similarity a little above 1)."""
    torch.manual_seed(0)
    h, w = 3, 4
    pe = torch.randn(1, prefix + h * w, 8)
    sim = position_similarity(pe, (h, w), num_prefix_tokens=prefix)
    v = pe[0].double().numpy()
    for (r, c), (r2, c2) in itertools.product(cells(h, w), repeat=2):
        a, b = v[prefix + r * w + c], v[prefix + r2 * w + c2]
        assert sim[r, c, r2, c2].item() == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), abs=1e-5)
    wide = position_similarity(torch.randn(1, prefix + 400, 384), (20, 20), num_prefix_tokens=prefix)
    assert wide.max() <= 1.0 and wide.min() >= -1.0


# ------------------------------------------------------------------------------ filters
def test_pca_recovers_a_known_basis_in_order() -> None:
    torch.manual_seed(0)
    d, c, p = 300, 3, 4
    dim = c * p * p
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, dtype=torch.float64))  # orthonormal columns
    sigmas = torch.tensor([9.0, 5.0, 3.0, 1.5, 0.5], dtype=torch.float64)
    # Coefficients with centred, orthonormal columns: the sample covariance is exactly diagonal.
    z = torch.randn(d, 5, dtype=torch.float64)
    z, _ = torch.linalg.qr(z - z.mean(0))  # combinations of centred columns stay centred
    rows = math.sqrt(d - 1) * z * sigmas @ basis[:, :5].T + torch.randn(dim, dtype=torch.float64)  # + an offset
    pca = embedding_filters(rows.reshape(d, c, p, p), k=5)
    assert pca.components.shape == (5, c, p, p)
    comps = pca.components.reshape(5, dim)
    for i in range(5):
        assert abs(float(comps[i] @ basis[:, i])) == pytest.approx(1.0, abs=1e-8)
    # an SVD's signs are arbitrary; ours: each component's largest-magnitude entry is positive
    assert (comps.gather(1, comps.abs().argmax(1, keepdim=True)) > 0).all()
    torch.testing.assert_close(pca.explained_variance, sigmas**2)
    torch.testing.assert_close(pca.explained_variance_ratio, sigmas**2 / (sigmas**2).sum())


def test_pca_variances_match_the_covariance_eigenvalues() -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 1, 3, 3)
    pca = embedding_filters(weight, k=28)
    assert pca.components.shape == (9, 1, 3, 3)  # capped at the 9 dimensions of a filter
    eig = np.sort(np.linalg.eigvalsh(np.cov(weight.reshape(40, 9).double().numpy(), rowvar=False)))[::-1]
    np.testing.assert_allclose(pca.explained_variance.numpy(), eig, rtol=1e-4)
    flat = pca.components.reshape(9, 9)
    torch.testing.assert_close(flat @ flat.T, torch.eye(9), atol=1e-5, rtol=0)
    # sklearn's explained_variance_ratio_: eigenvalue / trace of the covariance, also for k < rank
    np.testing.assert_allclose(embedding_filters(weight, k=2).explained_variance_ratio.numpy(), eig[:2] / eig.sum(), rtol=1e-4)
    # 4 filters span 3 directions once centred: a 4th component would be noise of no variance
    few = embedding_filters(torch.randn(4, 1, 3, 3), k=28)
    assert few.components.shape == (3, 1, 3, 3) and bool((few.explained_variance > 1e-3).all())


def test_filter_weight_picks_e_or_the_resnet_stem() -> None:
    vit = tiny_vit()
    weight, source = filter_weight(vit)
    assert weight is vit.patch_embed.proj.weight and "patch_embed.proj" in source
    hybrid = create_backbone("hybrid_r18_vit_tiny", img_size=16, in_chans=1, small_input=True, num_stages=2)
    weight, source = filter_weight(hybrid)
    assert weight is hybrid.patch_embed.backbone.conv1.weight and "hybrid" in source
    resnet = create_backbone("resnet18", in_chans=1, small_input=True)
    assert filter_weight(resnet)[0] is resnet.conv1.weight
    assert filter_weight(nn.Linear(2, 2)) is None


# ------------------------------------------------------------------------------ drawing
def assert_png(path: Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_drawings_write_pngs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    grey = torch.rand(2, 1, 8, 8)
    rgb = torch.rand(2, 3, 8, 8)
    attn = torch.softmax(torch.randn(2, 2, 5, 5), -1)
    figs = {
        "filters_rgb": plot_filters(embedding_filters(torch.randn(8, 3, 2, 2), k=4)),
        "filters_grey": plot_filters(embedding_filters(torch.randn(8, 1, 2, 2), k=4)),
        "pos": plot_position_similarity(torch.rand(2, 2, 2, 2) * 2 - 1),
        "dist": plot_attention_distance(torch.rand(3, 2) * 10),
        "rollout_grey": plot_rollout(grey, rollout_map([attn], (2, 2), out_size=(8, 8))),
        "dino_rgb": plot_dino_attention(rgb, dino_attention(attn, (2, 2))),
    }
    paths = save_all(AnalysisArrays(), figs, tmp_path / "sub")
    for name in figs:
        assert_png(paths[name])
    pixels = figure_to_array(figs["dist"])
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[-1] == 3


def test_filter_tiles_are_each_scaled_to_their_own_range_and_the_title_counts_them_all() -> None:
    """ViT paper Fig. 7 left: each component tile shown with its min at 0 and its max at 1; the
    title's share of the variance is that of all k components, not the first."""
    pca = embedding_filters(torch.randn(12, 1, 2, 2, generator=torch.Generator().manual_seed(0)), k=3)
    fig = plot_filters(pca)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(fig.axes[i].images[0].get_array()), unit(pca.components[i, 0].numpy()), rtol=1e-5, atol=1e-6)
    assert fig.get_suptitle().endswith(f"{100 * float(pca.explained_variance_ratio.sum()):.1f}% of the variance")


def test_position_similarity_figure_puts_each_positions_map_in_its_tile() -> None:
    """ViT paper Fig. 7 centre: tile (r, c) of the mosaic (h x w tiles, a blank line between) is
    the h x w map of position (r, c)'s similarities, on a fixed -1...1 colour scale."""
    h, w = 2, 3
    sim = torch.rand(h, w, h, w, generator=torch.Generator().manual_seed(0)) * 2 - 1  # [h, w, h, w]
    image = plot_position_similarity(sim).axes[0].images[0]
    mosaic = np.ma.filled(image.get_array(), np.nan)
    assert mosaic.shape == (h * (h + 1) - 1, w * (w + 1) - 1)
    for r in range(h):
        for c in range(w):
            np.testing.assert_allclose(mosaic[r * (h + 1) : r * (h + 1) + h, c * (w + 1) : c * (w + 1) + w], sim[r, c].numpy(), rtol=1e-6)
    assert image.get_clim() == (-1.0, 1.0)


def test_attention_distance_figure_plots_each_head_against_its_layer_in_distinct_hues() -> None:
    """ViT paper Fig. 7 right: head h's dots are at x = layer (1-based), y = its distance. With 16
    heads (ViT-B) the first ten get ten hues and no two neighbouring heads two shades of one hue
    (tab20 pairs a dark and a light shade per hue: indices 2i, 2i + 1)."""
    dist = torch.tensor([[1.0, 8.0], [2.5, 9.0], [4.0, 12.5]])  # [depth, heads]
    ax = plot_attention_distance(dist).axes[0]
    for head in range(2):
        np.testing.assert_allclose(np.asarray(ax.collections[head].get_offsets()), np.column_stack([[1, 2, 3], dist[:, head].numpy()]))
    ax = plot_attention_distance(torch.rand(2, 16)).axes[0]
    tab20 = [colormaps["tab20"](i) for i in range(20)]
    hue = [tab20.index(tuple(c.get_facecolors()[0])) // 2 for c in ax.collections]
    assert len(set(hue[:10])) == 10 and all(a != b for a, b in zip(hue, hue[1:]))


def test_distance_csv(tmp_path: Path) -> None:
    path = save_all(AnalysisArrays(attention_distance=torch.tensor([[1.0, 2.0], [3.0, 4.5]])), {}, tmp_path)["attention_distance_csv"]
    assert path.read_text().splitlines() == ["layer,head,mean_attention_distance_px", "1,1,1", "1,2,2", "2,1,3", "2,2,4.5"]


@pytest.mark.parametrize("channels", [1, 3])
def test_rollout_figure_shows_the_image_and_the_image_weighted_by_its_unit_scaled_map(channels: int) -> None:
    """ViT paper Fig. 6: under each image (grey, or RGB [H, W, 3]), the image x its map rescaled to
    [0, 1] (its min to 0, its max to 1), on a non-square image."""
    gen = torch.Generator().manual_seed(0)
    images, maps = torch.rand(2, channels, 4, 6, generator=gen), 0.2 + 0.1 * torch.rand(2, 4, 6, generator=gen)  # [B, C, H, W], [B, H, W]
    fig = plot_rollout(images, maps)
    for i in range(2):
        top, bottom = (np.asarray(fig.axes[j].images[0].get_array()) for j in (2 * i, 2 * i + 1))  # axes made in pairs
        img = images[i].numpy()  # [C, H, W]
        for shown, want in ((top, img), (bottom, img * unit(maps[i].numpy()))):
            np.testing.assert_allclose(shown, want[0] if channels == 1 else want.transpose(1, 2, 0), rtol=1e-5, atol=1e-6)


def test_dino_figure_overlays_each_heads_map_and_outlines_the_kept_patch_where_it_is() -> None:
    """DINO Fig. 3: in row i, the panel of head j overlays that image's map of head j, covering the
    image exactly; with only the top-left 4x4-pixel patch kept (of a 2x3 grid on an 8x12 image),
    the outline lies in the top-left patch."""
    images = torch.rand(2, 1, 8, 8)
    dino = dino_attention(torch.softmax(torch.randn(2, 3, 5, 5), -1), (2, 2))
    panels = plot_dino_attention(images, dino).axes
    for i, j in itertools.product(range(2), range(3)):
        np.testing.assert_allclose(panels[i * 4 + j + 1].get_images()[1].get_array(), unit(dino.maps[i, j].numpy()), rtol=1e-6)
    maps = torch.rand(1, 1, 2, 3, generator=torch.Generator().manual_seed(0))  # [B, heads, h, w]
    masks = torch.zeros(1, 1, 2, 3, dtype=torch.bool)
    masks[0, 0, 0, 0] = True
    ax = plot_dino_attention(torch.rand(1, 3, 8, 12), DinoAttention(maps, masks, 0.6)).axes[1]
    outline = np.concatenate(ax.collections[0].allsegs[0])  # (x, y) in pixels
    assert outline.min() >= 0.0 and outline[:, 0].max() < 4 and outline[:, 1].max() < 4
    assert ax.images[1].get_extent() == [-0.5, 11.5, 7.5, -0.5]


# ------------------------------------------------------------------------------ inputs
def test_denormalize_undoes_normalisation() -> None:
    x = torch.rand(2, 3, 4, 4)
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    normed = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(denormalize(normed, mean, std), x)
    scaled = denormalize(normed)
    assert scaled.amin().item() == pytest.approx(0.0) and scaled.amax().item() == pytest.approx(1.0)
    # without the statistics, each image is scaled by its own range
    two = denormalize(torch.stack([torch.linspace(0, 1, 16).view(1, 4, 4), torch.linspace(5, 6, 16).view(1, 4, 4)]))
    assert two.amin(dim=(1, 2, 3)).tolist() == [0.0, 0.0] and two.amax(dim=(1, 2, 3)).tolist() == [1.0, 1.0]


def test_the_images_of_a_batch_and_their_token_grid() -> None:
    x = torch.zeros(2, 3, 16, 16)
    assert batch_images({"label": torch.zeros(2), "image": x}) is x  # labels are no images
    assert batch_images((torch.zeros(2), [x, torch.ones(2, 3, 8, 8)])) is x  # the first view
    with pytest.raises(ValueError, match="no images"):
        batch_images((torch.zeros(2), "text"))
    assert image_grid(tiny_vit(), torch.zeros(1, 3, 16, 8)) == (4, 2)


# ------------------------------------------------------------------------------ every figure
def test_compute_all_on_a_non_square_vit_against_hand_computed_attention() -> None:
    """A ViT on 8x12 images (a 2x3 grid): position similarities (torch's cosine_similarity), the
    DINO maps and masks of the *last* layer with the threshold asked for, the shown images and
    their denormalisation, and the distance over the first ``num_distance_images`` of the
    ``distance_images`` (the definition written out over hand-computed attention)."""
    vit = sharp_vit((8, 12))
    h, w, p = 2, 3, 4
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(3, 1, 8, 12, generator=gen)  # [B, C, H, W], normalised
    distance_images = torch.randn(4, 1, 8, 12, generator=gen)
    out = compute_all(vit, images, mean=[0.5], std=[0.25], figures=["pos_embed", "attention_distance", "attention_dino"],
                      max_images=2, threshold=0.3, distance_images=distance_images, num_distance_images=2)

    pe = vit.pos_embed[0, 1:].detach()  # [N, D], row-major patches
    for i, (r, c) in enumerate(cells(h, w)):
        for j, (r2, c2) in enumerate(cells(h, w)):
            assert out.pos_similarity[r, c, r2, c2].item() == pytest.approx(F.cosine_similarity(pe[i], pe[j], dim=0).item(), abs=1e-6)

    last = attention_by_hand(vit, images[:2])[-1]  # [2, heads, 1+N, 1+N]
    torch.testing.assert_close(out.dino.maps, last[:, :, 0, 1:].reshape(2, 2, h, w), rtol=1e-4, atol=1e-6)
    for b in range(2):
        for head in range(2):
            assert out.dino.masks[b, head].flatten().tolist() == dino_mask_reference(last[b, head, 0, 1:], 0.3).tolist()
    torch.testing.assert_close(out.images, (images[:2] * 0.25 + 0.5).clamp(0, 1))

    want = [distance_by_loops(a, h, w, p) for a in attention_by_hand(vit, distance_images[:2])]  # [depth][heads]
    np.testing.assert_allclose(out.attention_distance.numpy(), want, rtol=1e-4)


def test_render_all_on_a_tiny_vit(tmp_path: Path) -> None:
    vit = tiny_vit().train()
    images = torch.randn(3, 3, 16, 16)
    a = compute_all(vit, images, num_filters=28)
    assert a.filters.components.shape == (28, 3, 4, 4)
    assert a.pos_similarity.shape == (4, 4, 4, 4)
    assert a.attention_distance.shape == (2, 2)
    assert a.rollout.shape == (3, 16, 16)
    assert a.dino.maps.shape == (3, 2, 4, 4) and a.dino.masks.dtype == torch.bool
    assert a.images.shape == (3, 3, 16, 16)
    paths = render_all(vit, images, tmp_path, mean=(0.5,) * 3, std=(0.2,) * 3)
    assert set(paths) == set(FIGURES) | {"attention_distance_csv"}
    for name in FIGURES:
        assert paths[name] == tmp_path / f"{name}.png"
        assert_png(paths[name])
    assert len(paths["attention_distance_csv"].read_text().splitlines()) == 1 + 2 * 2
    assert vit.training  # eval mode only while computing


def _cls_less_vit() -> VisionTransformer:
    vit = tiny_vit()
    vit.num_prefix_tokens = 0  # as a token backbone without an output token: no [CLS] row to draw
    return vit


@pytest.mark.parametrize(
    "make, applicable, missing",
    [
        (lambda: create_backbone("resnet18", in_chans=3, small_input=True), ("filters",), "no attention or position embedding"),
        (_cls_less_vit, ("filters", "pos_embed", "attention_distance"), "no output token ([CLS])"),
        (lambda: nn.Linear(2, 2), (), "no first convolution the filters figure knows"),
    ],
    ids=["resnet", "no-cls", "nothing"],
)
def test_only_the_figures_a_backbone_has_are_drawn_and_others_refused_by_name(tmp_path: Path, make, applicable, missing) -> None:
    backbone = make()
    assert applicable_figures(backbone) == applicable
    with pytest.raises(ValueError, match=re.escape(f"has {missing}")):
        render_all(backbone, torch.randn(1, 3, 16, 16), tmp_path)
    if applicable:
        assert set(render_all(backbone, torch.randn(1, 3, 16, 16), tmp_path, figures=["filters"], num_filters=4)) == {"filters"}


# ------------------------------------------------------------------------------ callback
class FakeExperiment:
    def __init__(self) -> None:
        self.images: dict[str, tuple[np.ndarray, int]] = {}

    def add_image(self, tag: str, img: np.ndarray, global_step: int, dataformats: str) -> None:
        assert dataformats == "HWC"
        self.images[tag] = (img, global_step)


def fake_trainer(epoch: int, datamodule=None) -> SimpleNamespace:
    return SimpleNamespace(current_epoch=epoch, global_step=10 * (epoch + 1), is_global_zero=True,
                           loggers=[SimpleNamespace(experiment=FakeExperiment())], datamodule=datamodule)


def module_with(backbone: nn.Module) -> nn.Module:
    module = nn.Module()
    module.backbone = backbone
    return module


def test_callback_logs_figures_at_its_interval(tmp_path: Path) -> None:
    module = module_with(tiny_vit(in_chans=1).train())
    cb = AnalysisCallback(every_n_epochs=2, num_images=2, save_dir=tmp_path)
    cb.on_train_batch_start(None, module, [torch.randn(4, 1, 16, 16), torch.randn(4, 1, 8, 8)], 0)
    val = torch.randn(5, 1, 16, 16)
    cb.on_validation_batch_end(None, module, None, (val, torch.zeros(5)), 0)
    assert torch.equal(cb.kept_images(), val[:2])  # the validation batch wins
    skipped = fake_trainer(epoch=0)
    cb.on_train_epoch_end(skipped, module)
    assert skipped.loggers[0].experiment.images == {}
    trainer = fake_trainer(epoch=1)
    cb.on_train_epoch_end(trainer, module)
    logged = trainer.loggers[0].experiment.images
    assert set(logged) == {f"analysis/{name}" for name in FIGURES}
    for img, step in logged.values():
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[-1] == 3 and step == 20
    assert module.backbone.training
    assert_png(tmp_path / "epoch_0001" / "filters.png")
    assert (tmp_path / "epoch_0001" / "attention_distance.csv").exists()


def test_callback_keeps_its_first_training_batch_warns_once_and_takes_a_lone_mean_as_none() -> None:
    module = module_with(tiny_vit(in_chans=1))
    cb = AnalysisCallback(num_images=2, mean=(0.5,), figures=("attention_rollout",))  # a mean without a std: neither used
    trainer = fake_trainer(epoch=0)
    with pytest.warns(UserWarning, match="no batch seen yet"):
        assert cb.log_figures(trainer, module) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        cb.log_figures(trainer, module)
    first = torch.randn(4, 1, 16, 16)
    cb.on_train_batch_start(None, module, [first], 0)
    cb.on_train_batch_start(None, module, [torch.randn(4, 1, 16, 16)], 1)
    assert torch.equal(cb.kept_images(), first[:2])  # the same images every epoch: comparable figures
    assert set(cb.log_figures(trainer, module)) == {"attention_rollout"}


def test_callback_draws_from_the_first_loaders_batch_with_its_sizes(monkeypatch) -> None:
    module = module_with(tiny_vit(in_chans=1))
    cb = AnalysisCallback(num_images=2, dino_max_images=1, figures=("attention_dino",))
    other, first = torch.randn(3, 1, 16, 16), torch.randn(3, 1, 16, 16)
    cb.on_validation_batch_end(None, module, None, (other, torch.zeros(3)), 0, dataloader_idx=1)  # a second loader's batch: not kept
    cb.on_validation_batch_end(None, module, None, (first, torch.zeros(3)), 0, dataloader_idx=0)
    assert torch.equal(cb.kept_images(), first[:2])
    calls = []
    monkeypatch.setattr(render, "plot_all", lambda arrays, n, dino_n: calls.append((n, dino_n)) or {})
    cb.log_figures(fake_trainer(epoch=0), module)
    assert calls == [(2, 1)]


def test_the_callback_draws_the_validation_images_with_the_datamodules_normalisation(monkeypatch) -> None:
    """The callback's figures come from the first ``num_images`` of the first validation batch
    (not the training batch), undone with the datamodule's mean/std, all of them in the rollout
    figure and in the attention distance (the definition over hand-computed attention)."""
    computed = []  # what the callback's compute_all returns, recorded on the way
    real_compute_all = render.compute_all
    monkeypatch.setattr(render, "compute_all", lambda *args, **kwargs: computed.append(real_compute_all(*args, **kwargs)) or computed[-1])
    module = module_with(sharp_vit(16).train())
    gen = torch.Generator().manual_seed(0)
    train_images, val_images = torch.randn(4, 1, 16, 16, generator=gen), torch.randn(5, 1, 16, 16, generator=gen)
    cb = AnalysisCallback(every_n_epochs=1, num_images=3, figures=("attention_distance", "attention_rollout"))
    cb.on_train_batch_start(None, module, [train_images, torch.zeros(4)], 0)
    cb.on_validation_batch_end(None, module, None, (val_images, torch.zeros(5)), 0)
    cb.on_train_epoch_end(fake_trainer(0, datamodule=SimpleNamespace(mean=(0.5,), std=(0.25,))), module)

    (arrays,) = computed
    torch.testing.assert_close(arrays.images, (val_images[:3] * 0.25 + 0.5).clamp(0, 1))
    assert arrays.rollout.shape == (3, 16, 16)
    want = [distance_by_loops(a, 4, 4, 4) for a in attention_by_hand(module.backbone, val_images[:3])]
    np.testing.assert_allclose(arrays.attention_distance.numpy(), want, rtol=1e-4)


def test_callback_draws_nothing_under_a_sharding_strategy() -> None:
    # Under FSDP one process drawing alone would read parameter shards and wait in the forward
    # pass's collectives for processes that never join: warn once and draw nothing.
    from lightning.pytorch.strategies import FSDPStrategy

    module = module_with(tiny_vit(in_chans=1))
    cb = AnalysisCallback(every_n_epochs=1, num_images=2)
    cb.on_train_batch_start(None, module, [torch.randn(4, 1, 16, 16)], 0)
    trainer = fake_trainer(epoch=0)
    trainer.strategy = FSDPStrategy()
    with pytest.warns(UserWarning, match="no figures under FSDPStrategy"):
        cb.on_train_epoch_end(trainer, module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        cb.on_train_epoch_end(trainer, module)
    assert trainer.loggers[0].experiment.images == {}


def test_callback_in_a_lightning_run_writes_tensorboard_images(tmp_path: Path) -> None:
    import lightning.pytorch as lightning
    from tensorboard.backend.event_processing import event_accumulator
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = tiny_vit(in_chans=1)

        def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
            return self.backbone(batch[0]).pow(2).mean()

        def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
            self.backbone(batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(4, 1, 16, 16), torch.zeros(4))
    logger = lightning.loggers.TensorBoardLogger(str(tmp_path), name="run")
    trainer = lightning.Trainer(
        max_epochs=1, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=0, log_every_n_steps=1, logger=logger,
        callbacks=[AnalysisCallback(every_n_epochs=1, num_images=2, figures=("pos_embed", "attention_rollout"))],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=2), DataLoader(data, batch_size=2))
    (events,) = Path(logger.log_dir).glob("events.out.tfevents.*")
    acc = event_accumulator.EventAccumulator(str(events), size_guidance={"images": 0})
    acc.Reload()
    assert {"analysis/pos_embed", "analysis/attention_rollout"} <= set(acc.Tags()["images"])
