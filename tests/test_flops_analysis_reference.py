"""FLOP counts and analysis measures against references written independently here: torch's
FlopCounterMode (attention on the math backend) on backbones, convolutions and training steps the
other tests do not reach (non-square images, an MLP ratio other than 4, grouped and dilated
convolutions, three global crops, several devices); the attention figures against attention
computed by hand from the blocks' weights, the mean attention distance written out from its
definition with loops, the [CLS] row upsampled by the bilinear formula written out; the drawings
by the arrays their figures hold. Each test fails on a plausible one-line change to the code it
pins."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import torch_flops
from torch import Tensor, nn

import ssl_vit.analysis.callback as callback_module
from ssl_vit.analysis import (
    compute_all,
    dino_attention,
    embedding_filters,
    mean_attention_distance,
    rollout_map,
)
from ssl_vit.analysis.attention_maps import DinoAttention
from ssl_vit.analysis.callback import AnalysisCallback
from ssl_vit.analysis.draw import (
    plot_attention_distance,
    plot_dino_attention,
    plot_filters,
    plot_position_similarity,
    plot_rollout,
)
from ssl_vit.backbones import create_backbone
from ssl_vit.backbones.vit import VisionTransformer
from ssl_vit.flops import (
    PretrainFlops,
    backbone_forward_flops,
    backbone_train_flops,
    conv2d_flops,
    method_step_flops,
    pretrain_flops_from_checkpoint,
)
from ssl_vit.methods import DINO, MPP, Supervised


# ----------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize(
    "name, kwargs, size",
    [
        # a 4x6 grid: the width must not be taken for the height (nor the other way round)
        ("vit", {"img_size": [16, 24], "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}, (16, 24)),
        # an MLP of 2·D, not the usual 4·D
        ("vit", {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2, "mlp_ratio": 2.0}, (16, 16)),
        # a hybrid and a ResNet on a non-square image (the stem's output is 8x12, not 8x8)
        ("hybrid_r18_vit_tiny", {"img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 2}, (16, 24)),
        ("resnet18", {"in_chans": 1}, (32, 48)),
    ],
)
def test_backbone_counts_on_non_square_images_and_other_mlp_ratios(name: str, kwargs: dict, size: tuple[int, int]) -> None:
    """Forward and training FLOPs per image against FlopCounterMode counting the same passes."""
    torch.manual_seed(0)
    model = create_backbone(name, **kwargs)
    x = torch.randn(2, 1, *size)  # [B, C, H, W]
    with torch.no_grad():
        forward = torch_flops(lambda: model(x)) / 2
    train = torch_flops(lambda: model(x).sum().backward()) / 2
    assert backbone_forward_flops(model, size) == pytest.approx(forward, rel=1e-9)
    assert backbone_train_flops(model, size) == pytest.approx(train, rel=1e-9)


def test_a_width_the_patches_do_not_divide_is_refused() -> None:
    """A 16x18 image has no whole number of 4-pixel patches across: no count, an error."""
    model = create_backbone("vit", img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2)
    with pytest.raises(ValueError, match="not divisible"):
        backbone_forward_flops(model, (16, 18))


@pytest.mark.parametrize(
    "conv, size",
    [
        (nn.Conv2d(4, 6, kernel_size=(3, 5), stride=(2, 1), padding=(1, 2), groups=2), (9, 11)),
        (nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=(0, 3), dilation=(1, 3)), (13, 10)),
        (nn.Conv2d(2, 4, kernel_size=(1, 3), padding="same"), (5, 7)),
    ],
)
def test_conv2d_flops_of_grouped_rectangular_and_dilated_convolutions(conv: nn.Conv2d, size: tuple[int, int]) -> None:
    """conv2d_flops against FlopCounterMode on one image: output size, kernel area, groups."""
    x = torch.randn(1, conv.in_channels, *size)
    with torch.no_grad():
        counted = torch_flops(lambda: conv(x))
    assert conv2d_flops(conv, size) == counted


def test_dino_with_three_global_crops_counts_three_teacher_passes() -> None:
    """DINO's step with n_global_crops=3 (teacher on 3 views, loss over 3 x 5 pairs) against
    FlopCounterMode counting the step and its backward."""
    torch.manual_seed(0)
    vit = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}
    module = DINO(out_dim=64, hidden_dim=32, bottleneck_dim=8, n_global_crops=3, backbone="vit", backbone_kwargs=vit)
    views = [torch.randn(4, 1, 16, 16) for _ in range(3)] + [torch.randn(4, 1, 8, 8) for _ in range(2)]
    labels = torch.zeros(4, dtype=torch.long)
    counted = torch_flops(lambda: module.step(views, labels)["loss"].backward())
    analytic = method_step_flops(module, [v.shape for v in views], include_probe=False) * 4
    assert analytic == pytest.approx(counted, rel=1e-9)


def test_mpp_on_non_square_views() -> None:
    """MPP on 16x24 views (a 4x6 grid, 12 corrupted patches) against FlopCounterMode."""
    torch.manual_seed(0)
    vit = {"img_size": [16, 24], "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}
    module = MPP(mean=[0.5], std=[0.25], backbone="vit", backbone_kwargs=vit)
    views = [torch.randn(4, 1, 16, 24)]
    counted = torch_flops(lambda: module.step(views, torch.zeros(4, dtype=torch.long))["loss"].backward())
    analytic = method_step_flops(module, [v.shape for v in views], include_probe=False) * 4
    assert analytic == pytest.approx(counted, rel=1e-9)


def test_the_running_total_counts_every_device() -> None:
    """PretrainFlops.add on a batch of 4 per device on 2 devices: 2 x what FlopCounterMode counts
    for one device's step (supervised: the per-device work does not depend on the device count)."""
    torch.manual_seed(0)
    vit = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}
    module = Supervised(num_classes=4, backbone="vit", backbone_kwargs=vit)
    views, labels = [torch.randn(4, 1, 16, 16)], torch.arange(4)

    def step() -> None:
        out = module.step(views, labels)
        probe_loss, _ = module.probe.training_loss(out["features"].detach(), labels)
        (out["loss"] + probe_loss).backward()

    one_device = torch_flops(step)
    flops = PretrainFlops()
    assert flops.add(module, views, world_size=2) == pytest.approx(2 * one_device, rel=1e-9)
    assert flops.add(module, views, world_size=2) == pytest.approx(4 * one_device, rel=1e-9)
    # The same counter on another model of the same method (twice as deep) counts that one.
    module = Supervised(num_classes=4, backbone="vit", backbone_kwargs={**vit, "depth": 2})
    deeper = torch_flops(step)
    assert deeper > 1.5 * one_device
    assert flops.add(module, views, world_size=2) == pytest.approx(4 * one_device + 2 * deeper, rel=1e-9)


def test_a_checkpoint_with_only_the_ssl_vit_record_has_its_flops_read() -> None:
    """The total lives under ``["ssl_vit"]["pretrain_flops"]`` (the documented record); a
    checkpoint holding only that record still gives its total back."""
    assert pretrain_flops_from_checkpoint({"ssl_vit": {"pretrain_flops": 3e12}}) == 3e12


# ------------------------------------------------------------------ attention, by hand
def cells(h: int, w: int) -> list[tuple[int, int]]:
    return [(r, c) for r in range(h) for c in range(w)]  # row-major, like the token sequence


def distance_by_loops(attn: Tensor, h: int, w: int, p: float, renormalize: bool = True) -> list[float]:
    """ViT paper Fig. 7 / D.7 written out: for each head, the mean over images and query patches
    i of the attention-weighted distance Σ_j a_ij·|centre_i − centre_j| between patch centres (in
    pixels), over the patch keys j; [CLS] (token 0) dropped, each query's patch weights rescaled
    to sum to 1 when ``renormalize``. ``attn`` [B, heads, 1+N, 1+N] -> one value per head."""
    a = attn.double()
    out = []
    for head in range(a.shape[1]):
        total = 0.0
        for b in range(a.shape[0]):
            for i, (r, c) in enumerate(cells(h, w)):
                weights = a[b, head, 1 + i, 1:]
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


def sharp_vit(img_size: tuple[int, int] | int, in_chans: int = 1) -> VisionTransformer:
    """A tiny ViT (4 px patches, D=16, 2 blocks, 2 heads) with large QKV weights: its layers
    attend very differently, unlike a freshly initialised ViT's near-uniform attention."""
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=img_size, patch_size=4, in_chans=in_chans, embed_dim=16, depth=2, num_heads=2)
    for blk in vit.blocks:
        nn.init.normal_(blk.attn.qkv.weight, std=0.25)
    return vit.eval()


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


# ------------------------------------------------------------------ mean attention distance
def test_each_query_is_renormalised_by_its_own_patch_mass() -> None:
    """Queries putting different shares on [CLS]: each query's patch weights are rescaled on their
    own before averaging (checked against the definition written out with loops)."""
    torch.manual_seed(0)
    h, w, p = 2, 3, 5
    attn = torch.softmax(3 * torch.randn(2, 2, 1 + h * w, 1 + h * w), dim=-1)  # [B, heads, 1+N, 1+N]
    attn[:, :, 1:, 0] *= torch.linspace(0.5, 20.0, h * w)  # a [CLS] share that differs from query to query
    attn = attn / attn.sum(-1, keepdim=True)
    got = mean_attention_distance([attn], (h, w), patch_size=p)  # [depth=1, heads]
    np.testing.assert_allclose(got[0].numpy(), distance_by_loops(attn, h, w, p), rtol=1e-5)
    raw = mean_attention_distance([attn], (h, w), patch_size=p, renormalize=False)
    np.testing.assert_allclose(raw[0].numpy(), distance_by_loops(attn, h, w, p, renormalize=False), rtol=1e-5)


# ------------------------------------------------------------------ rollout and DINO maps
def test_rollout_and_dino_maps_skip_every_prefix_token() -> None:
    """Two prefix tokens (no position): the maps are the [CLS] row over the 6 patch keys after
    both, for the rollout (written-out product) and for DINO's last-layer map."""
    torch.manual_seed(0)
    h, w, t = 2, 3, 2 + 6
    layers = [torch.softmax(torch.randn(2, 3, t, t), dim=-1) for _ in range(2)]  # [B, heads, T, T]
    want = rollout_by_hand(layers)[:, 0, 2:].reshape(2, h, w)
    np.testing.assert_allclose(rollout_map(layers, (h, w), num_prefix_tokens=2).numpy(), want, rtol=1e-5, atol=1e-6)
    dino = dino_attention(layers[-1], (h, w), num_prefix_tokens=2)
    torch.testing.assert_close(dino.maps, layers[-1][:, :, 0, 2:].reshape(2, 3, h, w))


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


# ------------------------------------------------------------------ compute_all and the callback
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

    attn = attention_by_hand(vit, distance_images[:2])
    want = [distance_by_loops(a, h, w, p) for a in attn]  # [depth][heads]
    np.testing.assert_allclose(out.attention_distance.numpy(), want, rtol=1e-4)


def test_the_callback_draws_the_validation_images_with_the_datamodules_normalisation(monkeypatch) -> None:
    """The callback's figures come from the first ``num_images`` of the first validation batch
    (not the training batch), undone with the datamodule's mean/std, all of them in the rollout
    figure and in the attention distance (the definition over hand-computed attention)."""
    computed = []  # what the callback's compute_all returns, recorded on the way
    real_compute_all = callback_module.compute_all

    def recording(*args, **kwargs):
        computed.append(real_compute_all(*args, **kwargs))
        return computed[-1]

    monkeypatch.setattr(callback_module, "compute_all", recording)
    module = nn.Module()
    module.backbone = sharp_vit(16).train()
    gen = torch.Generator().manual_seed(0)
    train_images, val_images = torch.randn(4, 1, 16, 16, generator=gen), torch.randn(5, 1, 16, 16, generator=gen)
    cb = AnalysisCallback(every_n_epochs=1, num_images=3, figures=("attention_distance", "attention_rollout"))
    cb.on_train_batch_start(None, module, [train_images, torch.zeros(4)], 0)
    cb.on_validation_batch_end(None, module, None, (val_images, torch.zeros(5)), 0)
    trainer = SimpleNamespace(current_epoch=0, global_step=1, is_global_zero=True, loggers=[],
                              datamodule=SimpleNamespace(mean=(0.5,), std=(0.25,)))
    cb.on_train_epoch_end(trainer, module)

    (arrays,) = computed
    torch.testing.assert_close(arrays.images, (val_images[:3] * 0.25 + 0.5).clamp(0, 1))
    assert arrays.rollout.shape == (3, 16, 16)
    want = [distance_by_loops(a, 4, 4, 4) for a in attention_by_hand(module.backbone, val_images[:3])]
    np.testing.assert_allclose(arrays.attention_distance.numpy(), want, rtol=1e-4)


# ------------------------------------------------------------------ what the drawings show
def test_position_similarity_figure_puts_each_positions_map_in_its_tile() -> None:
    """ViT paper Fig. 7 centre: tile (r, c) of the mosaic (h x w tiles, a blank line between) is
    the h x w map of position (r, c)'s similarities, on a fixed -1...1 colour scale."""
    h, w = 2, 3
    sim = torch.rand(h, w, h, w, generator=torch.Generator().manual_seed(0)) * 2 - 1  # [h, w, h, w]
    image = plot_position_similarity(sim).axes[0].images[0]
    mosaic = np.ma.filled(image.get_array(), np.nan)
    for r in range(h):
        for c in range(w):
            np.testing.assert_allclose(mosaic[r * (h + 1) : r * (h + 1) + h, c * (w + 1) : c * (w + 1) + w], sim[r, c].numpy(), rtol=1e-6)
    assert image.get_clim() == (-1.0, 1.0)


def test_attention_distance_figure_plots_each_head_against_its_layer() -> None:
    """ViT paper Fig. 7 right: head h's dots are at x = layer (1-based), y = its distance."""
    dist = torch.tensor([[1.0, 8.0], [2.5, 9.0], [4.0, 12.5]])  # [depth, heads]
    ax = plot_attention_distance(dist).axes[0]
    for head in range(2):
        want = np.column_stack([[1, 2, 3], dist[:, head].numpy()])
        np.testing.assert_allclose(np.asarray(ax.collections[head].get_offsets()), want)


def test_attention_distance_figure_gives_neighbouring_heads_distinct_hues() -> None:
    # 16 heads (ViT-B): the first ten in ten different hues, and no two consecutive heads in two
    # shades of one hue (tab20 pairs a dark and a light shade per hue: indices 2i, 2i + 1).
    from matplotlib import colormaps

    ax = plot_attention_distance(torch.rand(2, 16)).axes[0]
    tab20 = [colormaps["tab20"](i) for i in range(20)]
    hue = [tab20.index(tuple(c.get_facecolors()[0])) // 2 for c in ax.collections]
    assert len(set(hue[:10])) == 10 and all(a != b for a, b in zip(hue, hue[1:]))


def test_rollout_figure_shows_the_image_and_the_image_weighted_by_its_unit_scaled_map() -> None:
    """ViT paper Fig. 6: top the RGB image [H, W, 3], bottom the image x the map rescaled to
    [0, 1] (its min to 0, its max to 1), on a non-square image."""
    gen = torch.Generator().manual_seed(0)
    images, maps = torch.rand(1, 3, 4, 6, generator=gen), 0.2 + 0.1 * torch.rand(1, 4, 6, generator=gen)  # [B, C, H, W], [B, H, W]
    fig = plot_rollout(images, maps)
    top, bottom = (np.asarray(ax.images[0].get_array()) for ax in fig.axes)
    unit = (maps[0] - maps[0].min()) / (maps[0].max() - maps[0].min())
    np.testing.assert_allclose(top, images[0].permute(1, 2, 0).numpy(), rtol=1e-6)
    np.testing.assert_allclose(bottom, (images[0] * unit).permute(1, 2, 0).numpy(), rtol=1e-5, atol=1e-6)


def test_filter_tiles_are_each_scaled_to_their_own_range() -> None:
    """ViT paper Fig. 7 left: each component tile shown with its min at 0 and its max at 1."""
    pca = embedding_filters(torch.randn(8, 1, 2, 2, generator=torch.Generator().manual_seed(0)), k=3)
    fig = plot_filters(pca)
    for i in range(3):
        tile = pca.components[i, 0].numpy()  # [P, P] (grey)
        np.testing.assert_allclose(np.asarray(fig.axes[i].images[0].get_array()), (tile - tile.min()) / (tile.max() - tile.min()), rtol=1e-5, atol=1e-6)


def test_dino_figure_outlines_the_kept_patch_where_it_is() -> None:
    """DINO Fig. 3: with only the top-left 4x4-pixel patch kept (of a 2x3 grid on an 8x12 image),
    the outline lies in the top-left patch, and the map covers the image exactly."""
    maps = torch.rand(1, 1, 2, 3, generator=torch.Generator().manual_seed(0))  # [B, heads, h, w]
    masks = torch.zeros(1, 1, 2, 3, dtype=torch.bool)
    masks[0, 0, 0, 0] = True
    ax = plot_dino_attention(torch.rand(1, 3, 8, 12), DinoAttention(maps, masks, 0.6)).axes[1]
    outline = np.concatenate(ax.collections[0].allsegs[0])  # (x, y) in pixels
    assert outline.min() >= 0.0 and outline[:, 0].max() < 4 and outline[:, 1].max() < 4
    assert ax.images[1].get_extent() == [-0.5, 11.5, 7.5, -0.5]
