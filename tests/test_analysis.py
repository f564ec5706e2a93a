"""The analysis figures: each computed quantity against a hand computation or an independent
formula written out here; the drawings and the callback only for producing their files."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from ssl_vit.analysis import (
    FIGURES,
    attention_rollout,
    compute_attention_distance,
    denormalize,
    dino_attention,
    embedding_filters,
    filter_weight,
    keep_top_mass,
    mean_attention_distance,
    position_similarity,
    render_all,
    rollout_map,
)
from ssl_vit.analysis.callback import AnalysisCallback
from ssl_vit.analysis.draw import (
    figure_to_array,
    plot_attention_distance,
    plot_dino_attention,
    plot_filters,
    plot_position_similarity,
    plot_rollout,
    save_figure,
    write_attention_distance_csv,
)
from ssl_vit.backbones import create_backbone
from ssl_vit.backbones.pos_embed import sincos_2d_pos_embed
from ssl_vit.backbones.vit import VisionTransformer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_vit(img_size: int = 16, patch_size: int = 4, in_chans: int = 3) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(
        img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=32, depth=2, num_heads=2
    )


def centre(r: int, c: int, p: float) -> tuple[float, float]:
    return (r * p, c * p)


def cells(h: int, w: int) -> list[tuple[int, int]]:
    return [(r, c) for r in range(h) for c in range(w)]  # row-major, like the token sequence


def attention_from_targets(h: int, w: int, target, cls_mass: float = 0.0) -> Tensor:
    """[1, 1, 1+N, 1+N]: each patch query puts ``cls_mass`` on [CLS] and the rest on the patch
    ``target(r, c)``; the [CLS] query attends uniformly (it must be ignored)."""
    n = h * w
    a = torch.zeros(1, 1, 1 + n, 1 + n, dtype=torch.float64)
    a[0, 0, 0, :] = 1.0 / (1 + n)
    for i, (r, c) in enumerate(cells(h, w)):
        tr, tc = target(r, c)
        a[0, 0, 1 + i, 0] = cls_mass
        a[0, 0, 1 + i, 1 + tr * w + tc] += 1.0 - cls_mass
    return a


# ------------------------------------------------------------------ mean attention distance
def test_attention_on_self_has_distance_zero() -> None:
    n = 9
    attn = torch.eye(1 + n).expand(2, 3, -1, -1)  # [B, heads, T, T]
    dist = mean_attention_distance([attn, attn], (3, 3), patch_size=16)
    assert dist.shape == (2, 3)
    assert torch.equal(dist, torch.zeros(2, 3))


@pytest.mark.parametrize("grid,p", [((2, 2), 8), ((3, 3), 5), ((2, 3), 7)])
def test_uniform_attention_gives_mean_pairwise_distance(grid: tuple[int, int], p: int) -> None:
    h, w = grid
    pts = cells(h, w)
    n = len(pts)
    # Mean over queries i of the mean over keys j (self included) of |centre_i - centre_j|.
    expected = sum(math.dist(centre(*a, p), centre(*b, p)) for a in pts for b in pts) / n**2
    if grid == (2, 2):  # by hand: each query sees 0, p, p, p·√2
        assert expected == pytest.approx((2 * p + p * math.sqrt(2)) / 4)
    uniform = torch.full((1, 2, 1 + n, 1 + n), 1.0 / (1 + n))  # [CLS] gets a share too
    got = mean_attention_distance([uniform], grid, patch_size=p)
    assert got.shape == (1, 2)
    torch.testing.assert_close(got, torch.full((1, 2), expected), rtol=1e-6, atol=1e-5)
    # Without renormalisation the [CLS] share counts as distance 0.
    raw = mean_attention_distance([uniform], grid, patch_size=p, renormalize=False)
    torch.testing.assert_close(raw, torch.full((1, 2), expected * n / (n + 1)), rtol=1e-6, atol=1e-5)


def test_right_neighbour_head_is_exactly_one_patch() -> None:
    h, w, p = 3, 4, 16
    # the right neighbour, or the left one in the last column: always one patch away
    attn = attention_from_targets(h, w, lambda r, c: (r, c + 1) if c + 1 < w else (r, c - 1))
    assert mean_attention_distance([attn], (h, w), patch_size=p).item() == pytest.approx(p)
    # Half the mass on [CLS]: renormalising over patches still gives p; the raw weights p/2.
    half = attention_from_targets(h, w, lambda r, c: (r, c + 1) if c + 1 < w else (r, c - 1), cls_mass=0.5)
    assert mean_attention_distance([half], (h, w), patch_size=p).item() == pytest.approx(p)
    assert mean_attention_distance([half], (h, w), p, renormalize=False).item() == pytest.approx(p / 2)
    # The diagonal neighbour below-right (or wrap to the start of the row/column) on a 2×2 grid.
    diag = attention_from_targets(2, 2, lambda r, c: (1 - r, 1 - c))
    assert mean_attention_distance([diag], (2, 2), patch_size=p).item() == pytest.approx(p * math.sqrt(2))


def test_distance_averages_over_images_and_keeps_layers_and_heads_apart() -> None:
    h, w, p = 2, 3, 4
    self_attn = attention_from_targets(h, w, lambda r, c: (r, c))
    down = attention_from_targets(h, w, lambda r, c: (1 - r, c))  # one row away: p
    far = attention_from_targets(h, w, lambda r, c: (1 - r, 2 - c))  # corner-to-corner mirror
    per_query_far = [math.dist(centre(r, c, p), centre(1 - r, 2 - c, p)) for r, c in cells(h, w)]
    layer0 = torch.cat([torch.cat([self_attn, down], 1), torch.cat([down, down], 1)])  # [B=2, heads=2]
    layer1 = torch.cat([torch.cat([far, self_attn], 1), torch.cat([far, far], 1)])
    got = mean_attention_distance([layer0, layer1], (h, w), patch_size=p)
    expected = torch.tensor([[p / 2, p], [sum(per_query_far) / 6, sum(per_query_far) / 12]])
    torch.testing.assert_close(got, expected.float())


class PatternBackbone(nn.Module):
    """Duck-typed backbone whose attention is 'self' for images whose first pixel is 0 and
    'right neighbour' otherwise; counts the images each forward pass sees."""

    patch_size = 8
    num_prefix_tokens = 1

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Linear(1, 1)
        self.calls: list[int] = []

    def get_attention_maps(self, x: Tensor) -> list[Tensor]:
        assert not self.training
        h, w = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        self.calls.append(x.shape[0])
        right = attention_from_targets(h, w, lambda r, c: (r, c + 1) if c + 1 < w else (r, c - 1))
        same = attention_from_targets(h, w, lambda r, c: (r, c))
        per_image = [right if x[b, 0, 0, 0] > 0 else same for b in range(x.shape[0])]
        return [torch.cat(per_image).float()] * 3  # 3 identical layers, 1 head


def test_streamed_distance_truncates_chunks_and_restores_mode() -> None:
    model = PatternBackbone().train()
    flags = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    images = flags.view(-1, 1, 1, 1).expand(-1, 1, 16, 24).contiguous()  # grid 2×3
    loader = [(images[i : i + 3], torch.zeros(3)) for i in range(0, 7, 3)]  # (images, labels)
    got = compute_attention_distance(model, loader, num_images=5, chunk_size=2)
    # first 5 images: flags 1, 0, 1, 1, 0 -> distances 8, 0, 8, 8, 0
    torch.testing.assert_close(got, torch.full((3, 1), 8.0 * 3 / 5))
    assert sum(model.calls) == 5 and max(model.calls) <= 2
    assert model.training


def test_compute_all_streams_the_distance_in_its_chunks() -> None:
    from ssl_vit.analysis.render import compute_all

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
    r = attention_rollout([eye, eye, eye])
    torch.testing.assert_close(r, torch.eye(t).expand(2, t, t))
    maps = rollout_map([eye, eye], (2, 3), out_size=(8, 12))
    assert maps.shape == (2, 8, 12)
    assert torch.count_nonzero(maps) == 0  # [CLS] only ever looked at itself


def test_rollout_matches_the_written_out_product() -> None:
    torch.manual_seed(1)
    layers = [torch.softmax(torch.randn(2, 4, 5, 5), dim=-1) for _ in range(3)]
    eye = np.eye(5)
    expected = []
    for b in range(2):
        mats = [0.5 * layer[b].double().numpy().mean(axis=0) + 0.5 * eye for layer in layers]  # (Ā + I)/2
        expected.append(mats[2] @ mats[1] @ mats[0])
    got = attention_rollout(layers)
    np.testing.assert_allclose(got.numpy(), np.stack(expected), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(-1).numpy(), 1.0, rtol=1e-5)
    # the [CLS] map on the 2×2 grid (no upsampling): row 0, patch columns, row-major
    grid = rollout_map(layers, (2, 2))
    np.testing.assert_allclose(grid.numpy(), np.stack(expected)[:, 0, 1:].reshape(2, 2, 2), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ DINO masks
def dino_reference_mask(w: Tensor, threshold: float) -> Tensor:
    """DINO visualize_attention.py's recipe: sort ascending, normalise, keep where the running
    sum exceeds 1 - threshold, then undo the sort."""
    val, idx = torch.sort(w)
    val = val / val.sum()
    keep_sorted = torch.cumsum(val, 0) > (1 - threshold)
    return keep_sorted[torch.argsort(idx)]


def test_keep_top_mass_on_a_crafted_distribution() -> None:
    w = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2])
    assert keep_top_mass(w, 0.6).tolist() == [False, True, False, True, False]  # 0.4 + 0.25 = 0.65
    assert keep_top_mass(w, 0.66).tolist() == [False, True, False, True, True]  # 0.65 is not enough
    assert keep_top_mass(w * 7, 0.6).tolist() == [False, True, False, True, False]  # scale-free
    assert keep_top_mass(w, 1.0).all()
    assert keep_top_mass(w, 0.3).tolist() == [False, True, False, False, False]
    # reaching the threshold exactly is enough (binary-exact masses, no rounding involved)
    assert keep_top_mass(torch.tensor([0.125, 0.5, 0.375]), 0.5).tolist() == [False, True, False]
    tie = keep_top_mass(torch.tensor([0.25, 0.5, 0.25]), 0.75)
    assert int(tie.sum()) == 2 and bool(tie[1])
    with pytest.raises(ValueError, match="threshold"):
        keep_top_mass(w, 0.0)


def test_keep_top_mass_is_the_minimal_set_and_agrees_with_dino() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        w = torch.rand(7, generator=gen, dtype=torch.float64) ** 3
        p = w / w.sum()
        mask = keep_top_mass(w, 0.6)
        assert p[mask].sum() >= 0.6
        smallest = min(
            len(s) for k in range(1, 8) for s in itertools.combinations(range(7), k) if p[list(s)].sum() >= 0.6
        )
        assert int(mask.sum()) == smallest
        assert torch.equal(mask, dino_reference_mask(w, 0.6))


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


def test_position_similarity_layout_against_explicit_cosines() -> None:
    torch.manual_seed(0)
    h, w = 3, 4
    pe = torch.randn(1, 1 + h * w, 8)
    sim = position_similarity(pe, (h, w))
    v = pe[0].double().numpy()
    for (r, c), (r2, c2) in itertools.product(cells(h, w), repeat=2):
        a, b = v[1 + r * w + c], v[1 + r2 * w + c2]
        assert sim[r, c, r2, c2].item() == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), abs=1e-5)
    with pytest.raises(ValueError, match="expected 1 prefix"):
        position_similarity(pe, (4, 4))


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
    with pytest.raises(ValueError, match="pixel-level projection"):
        filter_weight(nn.Linear(2, 2))


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
    for name, fig in figs.items():
        assert_png(save_figure(fig, tmp_path / "sub" / f"{name}.png"))
    pixels = figure_to_array(figs["dist"])
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[-1] == 3


def test_drawings_show_what_they_are_given() -> None:
    def unit(x):  # each map rescaled to [0, 1] for display
        x = np.asarray(x, dtype=np.float64)
        return (x - x.min()) / (x.max() - x.min())

    torch.manual_seed(0)
    pca = embedding_filters(torch.randn(12, 1, 2, 2), k=3)
    title = plot_filters(pca).get_suptitle()
    assert title.endswith(f"{100 * float(pca.explained_variance_ratio.sum()):.1f}% of the variance")  # all k shown, not the first
    # DINO Fig. 3: in row i, the panel of head j overlays that image's map of head j
    images = torch.rand(2, 1, 8, 8)
    dino = dino_attention(torch.softmax(torch.randn(2, 3, 5, 5), -1), (2, 2))
    fig = plot_dino_attention(images, dino)
    panels = fig.axes
    for i in range(2):
        for j in range(3):
            shown = panels[i * 4 + j + 1].get_images()
            np.testing.assert_allclose(shown[1].get_array(), unit(dino.maps[i, j].numpy()), rtol=1e-6)
    # ViT Fig. 6: under each image (axes made in pairs), the image weighted by its normalised rollout map
    maps = torch.rand(2, 8, 8)
    fig = plot_rollout(images, maps)
    for i in range(2):
        np.testing.assert_allclose(fig.axes[2 * i + 1].get_images()[0].get_array(), images[i, 0].numpy() * unit(maps[i].numpy()), rtol=1e-6)
    # the similarity mosaic: tile (r, c) is position (r, c)'s similarity with every position
    sim = torch.rand(2, 3, 2, 3)
    mosaic = plot_position_similarity(sim).axes[0].get_images()[0].get_array()
    for r in range(2):
        for c in range(3):
            np.testing.assert_allclose(mosaic[r * 3 : r * 3 + 2, c * 4 : c * 4 + 3], sim[r, c].numpy())


def test_distance_csv(tmp_path: Path) -> None:
    path = write_attention_distance_csv(torch.tensor([[1.0, 2.0], [3.0, 4.5]]), tmp_path / "d.csv")
    lines = path.read_text().splitlines()
    assert lines == ["layer,head,mean_attention_distance_px", "1,1,1", "1,2,2", "2,1,3", "2,2,4.5"]


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
    from ssl_vit.analysis.inputs import batch_images, image_grid

    x = torch.zeros(2, 3, 16, 16)
    assert batch_images({"label": torch.zeros(2), "image": x}) is x  # labels are no images
    assert batch_images((torch.zeros(2), [x, torch.ones(2, 3, 8, 8)])) is x
    assert image_grid(tiny_vit(), torch.zeros(1, 3, 16, 8)) == (4, 2)
    for shape in ((1, 3, 16, 18), (1, 3, 18, 16)):
        with pytest.raises(ValueError, match="not divisible by the backbone's patch size 4"):
            image_grid(tiny_vit(), torch.zeros(shape))


# ------------------------------------------------------------------------------ render_all
def test_render_all_on_a_tiny_vit(tmp_path: Path) -> None:
    vit = tiny_vit(in_chans=3).train()
    images = torch.randn(3, 3, 16, 16)
    result = render_all(vit, images, tmp_path, mean=(0.5,) * 3, std=(0.2,) * 3, num_filters=28)
    assert set(result.paths) == set(FIGURES) | {"attention_distance_csv"}
    for name in FIGURES:
        assert result.paths[name] == tmp_path / f"{name}.png"
        assert_png(result.paths[name])
    assert len(result.paths["attention_distance_csv"].read_text().splitlines()) == 1 + 2 * 2
    a = result.arrays
    assert a.filters.components.shape == (28, 3, 4, 4)
    assert a.pos_similarity.shape == (4, 4, 4, 4)
    assert a.attention_distance.shape == (2, 2)
    assert a.rollout.shape == (3, 16, 16)
    assert a.dino.maps.shape == (3, 2, 4, 4) and a.dino.masks.dtype == torch.bool
    assert a.images.shape == (3, 3, 16, 16)
    assert vit.training  # eval mode only while computing


def test_render_all_rejects_what_it_cannot_draw(tmp_path: Path) -> None:
    resnet = create_backbone("resnet18", in_chans=1, small_input=True)
    images = torch.randn(1, 1, 8, 8)
    with pytest.raises(ValueError, match="ViT or hybrid"):
        render_all(resnet, images, tmp_path)
    only = render_all(resnet, images, tmp_path, figures=["filters"], num_filters=4)
    assert set(only.paths) == {"filters"}
    with pytest.raises(ValueError, match="unknown figure"):
        render_all(tiny_vit(), torch.randn(1, 3, 16, 16), tmp_path, figures=["nope"])


# ------------------------------------------------------------------------------ callback
class FakeExperiment:
    def __init__(self) -> None:
        self.images: dict[str, tuple[np.ndarray, int]] = {}

    def add_image(self, tag: str, img: np.ndarray, global_step: int, dataformats: str) -> None:
        assert dataformats == "HWC"
        self.images[tag] = (img, global_step)


class FakeLogger:
    def __init__(self) -> None:
        self.experiment = FakeExperiment()


class FakeTrainer:
    def __init__(self, epoch: int) -> None:
        self.current_epoch = epoch
        self.global_step = 10 * (epoch + 1)
        self.is_global_zero = True
        self.loggers = [FakeLogger()]
        self.datamodule = None


def test_callback_logs_figures_at_its_interval(tmp_path: Path) -> None:
    module = nn.Module()
    module.backbone = tiny_vit(in_chans=1).train()
    cb = AnalysisCallback(every_n_epochs=2, num_images=2, save_dir=tmp_path)
    cb.on_train_batch_start(None, module, [torch.randn(4, 1, 16, 16), torch.randn(4, 1, 8, 8)], 0)
    val = torch.randn(5, 1, 16, 16)
    cb.on_validation_batch_end(None, module, None, (val, torch.zeros(5)), 0)
    assert torch.equal(cb.kept_images(), val[:2])  # the validation batch wins
    skipped = FakeTrainer(epoch=0)
    cb.on_train_epoch_end(skipped, module)
    assert skipped.loggers[0].experiment.images == {}
    trainer = FakeTrainer(epoch=1)
    cb.on_train_epoch_end(trainer, module)
    logged = trainer.loggers[0].experiment.images
    assert set(logged) == {f"analysis/{name}" for name in FIGURES}
    for img, step in logged.values():
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[-1] == 3 and step == 20
    assert module.backbone.training
    assert_png(tmp_path / "epoch_0001" / "filters.png")
    assert (tmp_path / "epoch_0001" / "attention_distance.csv").exists()


def test_callback_keeps_its_first_training_batch_warns_once_and_takes_a_lone_mean_as_none(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_images must be >= 1"):
        AnalysisCallback(num_images=0)
    module = nn.Module()
    module.backbone = tiny_vit(in_chans=1)
    cb = AnalysisCallback(num_images=2, mean=(0.5,), figures=("attention_rollout",))  # a mean without a std: neither used
    trainer = FakeTrainer(epoch=0)
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



def test_callback_figures_in_the_papers_order_from_the_first_loaders_batch(monkeypatch) -> None:
    import ssl_vit.analysis.callback as callback_module

    assert AnalysisCallback(figures=tuple(reversed(FIGURES))).figures == tuple(FIGURES)
    module = nn.Module()
    module.backbone = tiny_vit(in_chans=1)
    cb = AnalysisCallback(num_images=2, dino_max_images=1, figures=("attention_dino",))
    other, first = torch.randn(3, 1, 16, 16), torch.randn(3, 1, 16, 16)
    cb.on_validation_batch_end(None, module, None, (other, torch.zeros(3)), 0, dataloader_idx=1)  # a second loader's batch: not kept
    cb.on_validation_batch_end(None, module, None, (first, torch.zeros(3)), 0, dataloader_idx=0)
    assert torch.equal(cb.kept_images(), first[:2])
    calls = []
    monkeypatch.setattr(callback_module, "plot_all", lambda arrays, n, dino_n: calls.append((n, dino_n)) or {})
    cb.log_figures(FakeTrainer(epoch=0), module)
    assert calls == [(2, 1)]


def test_callback_draws_nothing_under_a_sharding_strategy() -> None:
    # Under FSDP one process drawing alone would read parameter shards and wait in the forward
    # pass's collectives for processes that never join: warn once and draw nothing.
    from lightning.pytorch.strategies import FSDPStrategy

    module = nn.Module()
    module.backbone = tiny_vit(in_chans=1)
    cb = AnalysisCallback(every_n_epochs=1, num_images=2)
    cb.on_train_batch_start(None, module, [torch.randn(4, 1, 16, 16)], 0)
    trainer = FakeTrainer(epoch=0)
    trainer.strategy = FSDPStrategy()
    with pytest.warns(UserWarning, match="no figures under FSDPStrategy"):
        cb.on_train_epoch_end(trainer, module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        cb.on_train_epoch_end(trainer, module)
    assert trainer.loggers[0].experiment.images == {}


def test_callback_in_a_lightning_run_writes_tensorboard_images(tmp_path: Path) -> None:
    lightning = pytest.importorskip("lightning.pytorch")
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
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
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[AnalysisCallback(every_n_epochs=1, num_images=2, figures=("pos_embed", "attention_rollout"))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=2), DataLoader(data, batch_size=2))
    events = list(Path(logger.log_dir).glob("events.out.tfevents.*"))
    assert events
    acc = event_accumulator.EventAccumulator(str(events[0]), size_guidance={"images": 0})
    acc.Reload()
    assert {"analysis/pos_embed", "analysis/attention_rollout"} <= set(acc.Tags()["images"])
