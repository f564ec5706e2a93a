"""The analysis figures, drawn with matplotlib from computed arrays on an Agg canvas without
``pyplot``: nothing depends on the global backend or a screen, no figure leaks in a long run."""

from __future__ import annotations

import numpy as np
from einops import rearrange
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from ssl_vit.analysis.attention import DinoAttention
from ssl_vit.analysis.embedding import FilterPCA

SHOWN_IMAGES = 8  # images in the rollout figure (input and map one above the other)
SHOWN_DINO_IMAGES = 4  # rows of the per-head DINO figure (1 + heads panels each)


def _np(x: Tensor | np.ndarray) -> np.ndarray:
    return x.detach().float().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x, dtype=np.float32)


def _unit(x: np.ndarray) -> np.ndarray:
    """``x`` rescaled to [0, 1]: its minimum to 0, its maximum to 1."""
    return (x - x.min()) / max(x.max() - x.min(), 1e-12)


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)  # draws off-screen whatever the pyplot backend
    return fig


def _show_image(ax: Axes, img: np.ndarray) -> None:
    """``[C, H, W]`` in [0, 1]: RGB for 3 channels, else grey (the channels' mean)."""
    shown = np.clip(img.transpose(1, 2, 0), 0.0, 1.0) if img.shape[0] == 3 else img.mean(axis=0)
    ax.imshow(shown, cmap="gray" if shown.ndim == 2 else None, vmin=0.0, vmax=1.0)
    ax.set_axis_off()


def figure_to_array(fig: Figure) -> np.ndarray:
    """The rendered figure as ``[H, W, 3]`` uint8 (TensorBoard's ``add_image(..., dataformats="HWC")``)."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def plot_filters(pca: FilterPCA, ncols: int = 7) -> Figure:
    """ViT paper Fig. 7 left: the principal components as tiles, each scaled to its own range."""
    comps = _np(pca.components)  # [k, C, P, P]
    ncols = min(ncols, len(comps))
    nrows = -(-len(comps) // ncols)
    fig = _new_figure(0.9 * ncols, 0.9 * nrows + 0.6)
    for i, tile in enumerate(comps):
        _show_image(fig.add_subplot(nrows, ncols, i + 1), _unit(tile))
    shown = 100 * float(_np(pca.explained_variance_ratio).sum())
    fig.suptitle(f"Top {len(comps)} principal components of the embedding filters\n{pca.source}; {shown:.1f}% of the variance", fontsize=8)
    return fig


def plot_position_similarity(sim: Tensor | np.ndarray) -> Figure:
    """ViT paper Fig. 7 centre: an h×w grid of h×w tiles, tile (r, c) the cosine similarity of
    position (r, c) with every position, on one colour scale −1…1."""
    s = _np(sim)  # [h, w, h, w]
    h, w = s.shape[:2]
    # One mosaic image, a blank line after each tile (NaN: drawn white), instead of h·w axes.
    tiles = np.pad(s, ((0, 0), (0, 0), (0, 1), (0, 1)), constant_values=np.nan)  # [h, w, h+1, w+1]
    mosaic = rearrange(tiles, "r c y x -> (r y) (c x)")[:-1, :-1]
    size = min(9.0, 2.0 + 0.35 * max(h, w))
    fig = _new_figure(size + 1.0, size)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(mosaic, cmap=colormaps["viridis"].with_extremes(bad="white"), vmin=-1.0, vmax=1.0, interpolation="nearest")
    ax.set_xticks([c * (w + 1) + (w - 1) / 2 for c in range(w)], [str(c + 1) for c in range(w)], fontsize=7)
    ax.set_yticks([r * (h + 1) + (h - 1) / 2 for r in range(h)], [str(r + 1) for r in range(h)], fontsize=7)
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)
    ax.set(xlabel="Input patch column", ylabel="Input patch row", title="Position embedding similarity")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="Cosine similarity")
    return fig


def plot_attention_distance(dist: Tensor | np.ndarray, title: str = "Mean attention distance") -> Figure:
    """ViT paper Fig. 7 right: one dot per head at x = its layer (1-based), y = its distance."""
    d = _np(dist)  # [depth, heads]
    depth, heads = d.shape
    fig = _new_figure(max(4.0, 0.25 * depth + 2.5), 3.5)
    ax = fig.add_subplot(1, 1, 1)
    # tab20's dark shades for heads 1-10, its light ones for 11-20: neighbouring heads never share a hue
    for h in range(heads):
        color = colormaps["tab20"]((2 * h + (h // 10) % 2) % 20)
        ax.scatter(np.arange(1, depth + 1), d[:, h], s=14, color=color, label=f"Head {h + 1}")
    ax.set(xlabel="Network depth (layer)", ylabel="Mean attention distance (pixels)", title=title,
           xlim=(0.5, depth + 0.5), ylim=(0.0, max(float(np.nanmax(d)) * 1.1, 1.0)))
    if heads <= 16:
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    return fig


def plot_rollout(images: Tensor | np.ndarray, rollout: Tensor | np.ndarray, max_images: int = SHOWN_IMAGES) -> Figure:
    """ViT paper Fig. 6: each image ``[C, H, W]`` in [0, 1] (top) and the image weighted by its
    rollout map ``[H, W]`` rescaled to [0, 1] (bottom), which keeps attended regions visible."""
    imgs, maps = _np(images), _np(rollout)
    n = min(max_images, len(imgs))
    fig = _new_figure(1.6 * n, 3.5)
    for i in range(n):
        _show_image(fig.add_subplot(2, n, i + 1), imgs[i])
        _show_image(fig.add_subplot(2, n, n + i + 1), imgs[i] * _unit(maps[i])[None])
    fig.suptitle("Attention rollout: input (top), input × [CLS] rollout map (bottom)", fontsize=8)
    return fig


def plot_dino_attention(images: Tensor | np.ndarray, dino: DinoAttention, max_images: int = SHOWN_DINO_IMAGES) -> Figure:
    """DINO Fig. 3: per image a row of the image and, per head, the last layer's [CLS] attention
    over it, outlining the patches that hold ``threshold`` of the mass."""
    imgs, maps, masks = _np(images), _np(dino.maps), _np(dino.masks) > 0.5  # [B, C, H, W], [B, heads, h, w] ×2
    n, heads = min(max_images, len(imgs)), maps.shape[1]
    (H, W), (h, w) = imgs.shape[-2:], maps.shape[-2:]
    extent = (-0.5, W - 0.5, H - 0.5, -0.5)  # the grid map covers the image exactly
    fig = _new_figure(1.5 * (heads + 1), 1.6 * n + 0.4)
    for i in range(n):
        _show_image(fig.add_subplot(n, heads + 1, i * (heads + 1) + 1), imgs[i])
        for j in range(heads):
            ax = fig.add_subplot(n, heads + 1, i * (heads + 1) + j + 2)
            _show_image(ax, imgs[i])
            ax.imshow(_unit(maps[i, j]), cmap="inferno", alpha=0.6, extent=extent, interpolation="nearest")
            mask = np.kron(masks[i, j], np.ones((H // h, W // w)))  # [H, W], nearest upsampling
            if 0.0 < mask.mean() < 1.0:  # an outline only when some patches are left out
                ax.contour(mask, levels=[0.5], colors="white", linewidths=0.8)
            if i == 0:
                ax.set_title(f"head {j + 1}", fontsize=7)
    fig.suptitle(f"Last-layer [CLS] attention per head; outline: the patches holding {100 * dino.threshold:.0f}% of it", fontsize=8)
    return fig
