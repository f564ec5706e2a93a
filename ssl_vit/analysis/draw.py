"""Drawing the analysis figures (matplotlib, no screen needed).

Every ``plot_*`` takes computed arrays and returns a ``matplotlib.figure.Figure`` built without
``pyplot``, so nothing depends on the global backend or leaks figures in long training runs;
``save_figure`` writes a PNG and ``figure_to_array`` gives the pixels (for TensorBoard).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from ssl_vit.analysis.attention_maps import DinoAttention
from ssl_vit.analysis.filters import FilterPCA

SHOWN_IMAGES = 8  # images in the rollout figure (input and map side by side)
SHOWN_DINO_IMAGES = 4  # rows of the per-head DINO figure (1 + heads panels each)


def _np(x: Tensor | np.ndarray) -> np.ndarray:
    return x.detach().float().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x, dtype=np.float32)


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)  # attach an Agg canvas: draws off-screen whatever the pyplot backend
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG (parent folders are created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


def figure_to_array(fig: Figure) -> np.ndarray:
    """The rendered figure as ``[H, W, 3]`` uint8 (``add_image(..., dataformats="HWC")``)."""
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _image_hwc(img: np.ndarray) -> np.ndarray:
    """``[C, H, W]`` in [0, 1] -> something ``imshow`` shows: ``[H, W]`` grey or ``[H, W, 3]``."""
    if img.shape[0] == 1:
        return img[0]
    if img.shape[0] == 3:
        return np.clip(img.transpose(1, 2, 0), 0.0, 1.0)
    return img.mean(axis=0)  # other channel counts: shown as their mean, in grey


def _show_image(ax: Axes, img: np.ndarray) -> None:
    shown = _image_hwc(img)
    ax.imshow(shown, cmap="gray" if shown.ndim == 2 else None, vmin=0.0, vmax=1.0)
    ax.set_axis_off()


# ------------------------------------------------------------------------------ filters
def plot_filters(pca: FilterPCA, ncols: int = 7) -> Figure:
    """ViT paper Fig. 7 left: the principal components as tiles, each scaled to its own range
    (RGB for 3 channels, grey otherwise: other channel counts show their mean)."""
    comps = _np(pca.components)  # [k, C, P, P]
    k = comps.shape[0]
    ncols = max(1, min(ncols, k))
    nrows = -(-k // ncols)
    fig = _new_figure(0.9 * ncols, 0.9 * nrows + 0.6)
    for i in range(nrows * ncols):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.set_axis_off()
        if i >= k:
            continue
        tile = comps[i]
        lo, hi = tile.min(), tile.max()
        _show_image(ax, (tile - lo) / max(hi - lo, 1e-12))
    shown = float(_np(pca.explained_variance_ratio).sum())
    fig.suptitle(
        f"Top {k} principal components of the embedding filters\n"
        f"{pca.source}; {100 * shown:.1f}% of the variance",
        fontsize=8,
    )
    return fig


# ---------------------------------------------------------------------- position embedding
def plot_position_similarity(sim: Tensor | np.ndarray) -> Figure:
    """ViT paper Fig. 7 centre: an h×w grid of h×w maps, tile (r, c) being the cosine
    similarity of position (r, c) with every position; one shared colour scale −1…1."""
    s = _np(sim)
    if s.ndim != 4:
        raise ValueError(f"expected similarities [h, w, h, w], got shape {s.shape}")
    h, w = s.shape[:2]
    # One mosaic image (tiles separated by a blank line) instead of h·w axes: fast at 14×14.
    mosaic = np.full((h * (h + 1) - 1, w * (w + 1) - 1), np.nan, dtype=np.float32)
    for r in range(h):
        for c in range(w):
            mosaic[r * (h + 1) : r * (h + 1) + h, c * (w + 1) : c * (w + 1) + w] = s[r, c]
    size = min(9.0, 2.0 + 0.35 * max(h, w))
    fig = _new_figure(size + 1.0, size)
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["viridis"].with_extremes(bad="white")
    im = ax.imshow(mosaic, cmap=cmap, vmin=-1.0, vmax=1.0, interpolation="nearest")
    ax.set_xticks([c * (w + 1) + (w - 1) / 2 for c in range(w)], [str(c + 1) for c in range(w)], fontsize=7)
    ax.set_yticks([r * (h + 1) + (h - 1) / 2 for r in range(h)], [str(r + 1) for r in range(h)], fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    ax.set_title("Position embedding similarity")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="Cosine similarity")
    return fig


# ---------------------------------------------------------------------- attention distance
def plot_attention_distance(dist: Tensor | np.ndarray, title: str = "Mean attention distance") -> Figure:
    """ViT paper Fig. 7 right: x = network depth (layer, 1-based), one dot per head."""
    d = _np(dist)
    if d.ndim != 2:
        raise ValueError(f"expected distances [depth, heads], got shape {d.shape}")
    depth, heads = d.shape
    fig = _new_figure(max(4.0, 0.25 * depth + 2.5), 3.5)
    ax = fig.add_subplot(1, 1, 1)
    # Ten distinct hues for the first ten heads (tab20's dark shades), their light shades after:
    # neighbouring heads never get two shades of one hue.
    cmap = colormaps["tab20"]
    layers = np.arange(1, depth + 1)
    for h in range(heads):
        ax.scatter(layers, d[:, h], s=14, color=cmap((2 * h + (h // 10) % 2) % 20), label=f"Head {h + 1}")
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_xlim(0.5, depth + 0.5)
    ax.set_ylim(0.0, max(float(np.nanmax(d)) * 1.1, 1.0))
    ax.set_title(title)
    if heads <= 16:
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    return fig


def write_attention_distance_csv(dist: Tensor | np.ndarray, path: str | Path) -> Path:
    """Rows ``layer,head,mean_attention_distance_px`` (layer and head 1-based, as in the plot)."""
    d = _np(dist)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["layer", "head", "mean_attention_distance_px"])
        for layer in range(d.shape[0]):
            for head in range(d.shape[1]):
                writer.writerow([layer + 1, head + 1, f"{d[layer, head]:.6g}"])
    return path


# ---------------------------------------------------------------------- attention maps
def _unit(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(), x.max()
    return (x - lo) / max(hi - lo, 1e-12)


def plot_rollout(images: Tensor | np.ndarray, rollout: Tensor | np.ndarray, max_images: int = SHOWN_IMAGES) -> Figure:
    """ViT paper Fig. 6: each image (top) and the image weighted by its rollout map (bottom).

    Args:
        images: ``[B, C, H, W]`` in [0, 1] (see ``denormalize``).
        rollout: ``[B, H, W]`` maps at image resolution (each rescaled to [0, 1] here).
    """
    imgs, maps = _np(images), _np(rollout)
    if imgs.ndim != 4 or maps.ndim != 3 or imgs.shape[0] != maps.shape[0] or imgs.shape[-2:] != maps.shape[-2:]:
        raise ValueError(
            f"expected images [B, C, H, W] and maps [B, H, W] of the same size, got {imgs.shape} and {maps.shape}"
        )
    n = min(max_images, imgs.shape[0])
    fig = _new_figure(1.6 * n, 3.5)
    for i in range(n):
        _show_image(fig.add_subplot(2, n, i + 1), imgs[i])
        # The paper shows the input scaled by the (normalised) map: attended regions stay visible.
        weighted = imgs[i] * _unit(maps[i])[None]
        _show_image(fig.add_subplot(2, n, n + i + 1), weighted)
    fig.suptitle("Attention rollout: input (top), input × [CLS] rollout map (bottom)", fontsize=8)
    return fig


def plot_dino_attention(images: Tensor | np.ndarray, dino: DinoAttention, max_images: int = SHOWN_DINO_IMAGES) -> Figure:
    """DINO Fig. 3 style: per image a row of the image and, per head, the last layer's [CLS]
    attention over it, with the outline of the patches holding ``threshold`` of the mass."""
    imgs, maps, masks = _np(images), _np(dino.maps), _np(dino.masks) > 0.5
    if maps.ndim != 4 or imgs.shape[0] != maps.shape[0]:
        raise ValueError(f"expected images [B, C, H, W] and maps [B, heads, h, w], got {imgs.shape} and {maps.shape}")
    n, heads = min(max_images, imgs.shape[0]), maps.shape[1]
    H, W = imgs.shape[-2:]
    h, w = maps.shape[-2:]
    if H % h or W % w:
        raise ValueError(f"image size {H}x{W} is not a multiple of the attention grid {h}x{w}")
    extent = (-0.5, W - 0.5, H - 0.5, -0.5)  # the grid map covers the image exactly
    fig = _new_figure(1.5 * (heads + 1), 1.6 * n + 0.4)
    for i in range(n):
        _show_image(fig.add_subplot(n, heads + 1, i * (heads + 1) + 1), imgs[i])
        for j in range(heads):
            ax = fig.add_subplot(n, heads + 1, i * (heads + 1) + j + 2)
            _show_image(ax, imgs[i])
            ax.imshow(_unit(maps[i, j]), cmap="inferno", alpha=0.6, extent=extent, interpolation="nearest")
            mask = np.kron(masks[i, j], np.ones((H // h, W // w))).astype(np.float32)  # nearest upsampling
            if 0.0 < mask.mean() < 1.0:  # an outline exists only if some patches are left out
                ax.contour(mask, levels=[0.5], colors="white", linewidths=0.8)
            if i == 0:
                ax.set_title(f"head {j + 1}", fontsize=7)
    fig.suptitle(
        f"Last-layer [CLS] attention per head; outline: the patches holding {100 * dino.threshold:.0f}% of it",
        fontsize=8,
    )
    return fig
