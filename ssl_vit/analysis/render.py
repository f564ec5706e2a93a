"""Every figure at once, for ``ssl-vit visualize`` and the training callback: ``compute_all`` gives
the arrays (tensors only), ``plot_all`` the figures, ``save_all`` the PNGs and the CSV."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from ssl_vit.analysis import attention, draw, embedding
from ssl_vit.backbones import eval_mode

FigureName = Literal["filters", "pos_embed", "attention_distance", "attention_rollout", "attention_dino"]
FIGURES: tuple[FigureName, ...] = get_args(FigureName)  # in the paper's order; also the PNG names


def missing_for(backbone: nn.Module, figure: str) -> str:
    """What ``backbone`` lacks for ``figure``, in words ("" if nothing): a ResNet has only the
    filters, a token backbone without an output token (``num_prefix_tokens = 0``) no [CLS] maps."""
    if figure == "filters":
        return "" if embedding.filter_weight(backbone) else "no first convolution the filters figure knows (patch_embed.proj, patch_embed.backbone.conv1 or conv1)"
    if not (hasattr(backbone, "get_attention_maps") and hasattr(backbone, "pos_embed")):
        return "no attention or position embedding (a ViT's or hybrid's)"
    if figure in ("attention_rollout", "attention_dino") and getattr(backbone, "num_prefix_tokens", 1) < 1:
        return "no output token ([CLS]) whose attention the maps show"
    return ""


def applicable_figures(backbone: nn.Module, figures: Sequence[str] = FIGURES) -> tuple[str, ...]:
    """The ``figures`` this backbone can be drawn in (see :func:`missing_for`)."""
    return tuple(f for f in figures if not missing_for(backbone, f))


def denormalize(images: Tensor, mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> Tensor:
    """Normalised images ``[B, C, H, W]`` back in [0, 1] on the CPU, for display: the normalisation
    undone with ``mean`` and ``std`` (per channel, or one for all), else each image min-max scaled."""
    x = images.detach().float().cpu()
    if mean is None or std is None:
        lo, hi = x.amin(dim=(1, 2, 3), keepdim=True), x.amax(dim=(1, 2, 3), keepdim=True)
        return (x - lo) / (hi - lo).clamp_min(1e-12)
    m, s = (torch.as_tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1) for v in (mean, std))
    return (x * s + m).clamp(0.0, 1.0)


@dataclass
class AnalysisArrays:
    """What :func:`compute_all` computed (None for figures not asked for)."""

    filters: embedding.FilterPCA | None = None
    pos_similarity: Tensor | None = None  # [h, w, h, w] cosine similarities
    attention_distance: Tensor | None = None  # [depth, heads] in pixels
    rollout: Tensor | None = None  # [B', H, W] rollout [CLS] maps of the shown images
    dino: attention.DinoAttention | None = None  # [B', heads, h, w] maps and masks
    images: Tensor | None = None  # [B', C, H, W] the shown images in [0, 1]


@torch.no_grad()
def compute_all(
    backbone: nn.Module,
    images: Tensor,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    figures: Sequence[FigureName] = FIGURES,
    num_filters: int = embedding.PAPER_NUM_FILTERS,
    max_images: int = draw.SHOWN_IMAGES,
    threshold: float = attention.DINO_THRESHOLD,
    distance_images: Tensor | Iterable[object] | None = None,
    num_distance_images: int = attention.PAPER_NUM_IMAGES,
    chunk_size: int = attention.CHUNK_SIZE,
) -> AnalysisArrays:
    """The arrays behind ``figures`` of a ViT or hybrid (a ResNet has the filters only). ``images``:
    normalised ``[B, C, H, W]`` (``mean``, ``std`` undo it for display), the first ``max_images``
    shown in the attention maps; the mean attention distance reads the first ``num_distance_images``
    of ``distance_images`` (an image tensor or batches), else of ``images``, ``chunk_size`` at a time."""
    for figure in figures:
        if missing := missing_for(backbone, figure):
            raise ValueError(f"{type(backbone).__name__} has {missing}, which the {figure} figure needs")
    out = AnalysisArrays()
    prefix = getattr(backbone, "num_prefix_tokens", 1)
    if "filters" in figures:
        weight, source = embedding.filter_weight(backbone)
        out.filters = embedding.embedding_filters(weight, num_filters, source)
    if "pos_embed" in figures:
        out.pos_similarity = embedding.position_similarity(backbone.pos_embed, backbone.grid_size, prefix)
    if "attention_distance" in figures:
        source = images if distance_images is None else distance_images
        out.attention_distance = attention.compute_attention_distance(backbone, source, num_distance_images, chunk_size)
    if "attention_rollout" in figures or "attention_dino" in figures:
        shown = images[:max_images]
        out.images = denormalize(shown, mean, std)
        with eval_mode(backbone) as device:
            attns = backbone.get_attention_maps(shown.to(device))  # depth × [B', heads, T, T]
        grid = attention.image_grid(backbone, shown)
        if "attention_rollout" in figures:
            out.rollout = attention.rollout_map(attns, grid, shown.shape[-2:], prefix).cpu()
        if "attention_dino" in figures:
            out.dino = attention.dino_attention(attns[-1], grid, threshold, prefix)
    return out


def plot_all(arrays: AnalysisArrays, max_images: int = draw.SHOWN_IMAGES, dino_max_images: int = draw.SHOWN_DINO_IMAGES) -> dict[str, Figure]:
    """The figures of whatever ``arrays`` holds, by their names in :data:`FIGURES`."""
    figs: dict[str, Figure] = {}
    if arrays.filters is not None:
        figs["filters"] = draw.plot_filters(arrays.filters)
    if arrays.pos_similarity is not None:
        figs["pos_embed"] = draw.plot_position_similarity(arrays.pos_similarity)
    if arrays.attention_distance is not None:
        figs["attention_distance"] = draw.plot_attention_distance(arrays.attention_distance)
    if arrays.rollout is not None:
        figs["attention_rollout"] = draw.plot_rollout(arrays.images, arrays.rollout, max_images)
    if arrays.dino is not None:
        figs["attention_dino"] = draw.plot_dino_attention(arrays.images, arrays.dino, dino_max_images)
    return figs


def save_all(arrays: AnalysisArrays, figs: dict[str, Figure], out_dir: str | Path) -> dict[str, Path]:
    """``out_dir/<name>.png`` per figure and, when computed, ``attention_distance.csv`` (key
    ``attention_distance_csv``): rows ``layer,head,mean_attention_distance_px``, 1-based as in the figure."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / f"{name}.png" for name in figs}
    for name, fig in figs.items():
        fig.savefig(paths[name], format="png", bbox_inches="tight")
    if (dist := arrays.attention_distance) is not None:
        paths["attention_distance_csv"] = out_dir / "attention_distance.csv"
        rows = [(layer + 1, head + 1, f"{d:.6g}") for layer, row in enumerate(dist.tolist()) for head, d in enumerate(row)]
        with paths["attention_distance_csv"].open("w", newline="") as f:
            csv.writer(f).writerows([("layer", "head", "mean_attention_distance_px"), *rows])
    return paths


def render_all(backbone: nn.Module, images: Tensor, out_dir: str | Path, dino_max_images: int = draw.SHOWN_DINO_IMAGES,
               **compute: Any) -> dict[str, Path]:
    """:func:`compute_all` (``compute``: its arguments), :func:`plot_all` and :func:`save_all`."""
    arrays = compute_all(backbone, images, **compute)
    return save_all(arrays, plot_all(arrays, compute.get("max_images", draw.SHOWN_IMAGES), dino_max_images), out_dir)
