"""All the "looking inside" figures at once: compute the arrays, then draw them.

``compute_all`` -> :class:`AnalysisArrays` (tensors only), ``plot_all`` -> figures,
``render_all`` -> PNGs + CSV in a folder. The CLI and the training callback share these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from ssl_vit.analysis.attention_distance import (
    CHUNK_SIZE,
    PAPER_NUM_IMAGES,
    compute_attention_distance,
)
from ssl_vit.analysis.attention_maps import (
    DINO_THRESHOLD,
    DinoAttention,
    dino_attention,
    rollout_map,
)
from ssl_vit.analysis.draw import (
    SHOWN_DINO_IMAGES,
    SHOWN_IMAGES,
    plot_attention_distance,
    plot_dino_attention,
    plot_filters,
    plot_position_similarity,
    plot_rollout,
    save_figure,
    write_attention_distance_csv,
)
from ssl_vit.analysis.filters import PAPER_NUM_FILTERS, FilterPCA, backbone_filters, filter_weight
from ssl_vit.analysis.inputs import denormalize, has_tokens, image_grid, require_vit
from ssl_vit.analysis.pos_embed import position_similarity
from ssl_vit.backbones import eval_mode

FIGURES: tuple[str, ...] = ("filters", "pos_embed", "attention_distance", "attention_rollout", "attention_dino")
"""Names of the figures (``figures=`` selects a subset); also the PNG file stems."""
TOKEN_FIGURES: tuple[str, ...] = ("pos_embed", "attention_distance", "attention_rollout", "attention_dino")
"""The figures that need a token sequence (ViT, hybrid); a ResNet has the filters only."""
OUTPUT_TOKEN_FIGURES: tuple[str, ...] = ("attention_rollout", "attention_dino")
"""The figures drawn from the output token's ([CLS]) attention row: not for a backbone without one."""


def applicable_figures(backbone: nn.Module, figures: Sequence[str] = FIGURES) -> tuple[str, ...]:
    """The ``figures`` this backbone can be drawn in: all of them for a ViT or hybrid, the
    filters only for a backbone without tokens (ResNet), no [CLS] attention maps for a token
    backbone of one's own without an output token (``num_prefix_tokens = 0``), none for one with
    neither tokens nor a first convolution the filters figure knows."""
    return tuple(f for f in figures if not missing_for(backbone, f))


def missing_for(backbone: nn.Module, figure: str) -> str:
    """What ``backbone`` lacks for ``figure`` ("" when it can be drawn), in words for a message."""
    if figure == "filters":
        try:
            filter_weight(backbone)
        except ValueError:
            return "no first convolution the filters figure knows (patch_embed.proj, patch_embed.backbone.conv1 or conv1)"
        return ""
    if not has_tokens(backbone):
        return "no attention or position embedding (a ViT's or hybrid's)"
    if figure in OUTPUT_TOKEN_FIGURES and getattr(backbone, "num_prefix_tokens", 1) < 1:
        return "no output token ([CLS]) whose attention the maps show"
    return ""


@dataclass
class AnalysisArrays:
    """What ``compute_all`` computed (``None`` for figures not asked for).

    Attributes:
        filters: principal components of the embedding filters, ``components`` [k, C, P, P].
        pos_similarity: ``[h, w, h, w]`` cosine similarities of the position embeddings.
        attention_distance: ``[depth, heads]`` mean attention distance in pixels.
        rollout: ``[B', H, W]`` rollout [CLS] maps at image resolution (B' = shown images).
        dino: last-layer per-head [CLS] maps and masks, ``[B', heads, h, w]``.
        images: ``[B', C, H, W]`` the shown images in [0, 1].
    """

    filters: FilterPCA | None = None
    pos_similarity: Tensor | None = None
    attention_distance: Tensor | None = None
    rollout: Tensor | None = None
    dino: DinoAttention | None = None
    images: Tensor | None = None


@dataclass
class RenderResult:
    """Files written by ``render_all`` (figure name -> path; the CSV is
    ``"attention_distance_csv"``) and the arrays they were drawn from."""

    paths: dict[str, Path] = field(default_factory=dict)
    arrays: AnalysisArrays = field(default_factory=AnalysisArrays)


def check_figures(figures: Sequence[str]) -> set[str]:
    """The selected figure names as a set; a clear error for unknown names or none."""
    if isinstance(figures, str):
        figures = [figures]
    unknown = set(figures) - set(FIGURES)
    if unknown:
        raise ValueError(f"unknown figure(s) {sorted(unknown)}; known: {', '.join(FIGURES)}")
    if not figures:
        raise ValueError(f"no figures selected; choose from {', '.join(FIGURES)}")
    return set(figures)


@torch.no_grad()
def compute_all(
    backbone: nn.Module,
    images: Tensor,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    figures: Sequence[str] = FIGURES,
    num_filters: int = PAPER_NUM_FILTERS,
    max_images: int = SHOWN_IMAGES,
    threshold: float = DINO_THRESHOLD,
    distance_images: Tensor | Iterable[object] | None = None,
    num_distance_images: int = PAPER_NUM_IMAGES,
    chunk_size: int = CHUNK_SIZE,
) -> AnalysisArrays:
    """Compute the arrays behind the figures.

    Args:
        backbone: a ViT or hybrid (a ResNet supports only ``"filters"``).
        images: normalised images ``[B, C, H, W]``; the first ``max_images`` are shown in the
            attention-map figures, and all of them (up to ``num_distance_images``) feed the
            mean attention distance unless ``distance_images`` is given.
        mean, std: the normalisation of ``images``, undone for display (per-image min-max
            scaling without them).
        figures: which of :data:`FIGURES` to compute.
        num_filters: principal components of E to show (ViT paper: 28).
        max_images: images in the attention-map figures.
        threshold: share of attention mass the DINO masks keep (DINO: 0.6).
        distance_images: a DataLoader/iterable of batches for the mean attention distance
            (streamed; the paper averages 128 images).
        num_distance_images: how many images the mean attention distance averages.
        chunk_size: images per forward pass for the attention distance.
    """
    wanted = check_figures(figures)
    if images.ndim != 4:
        raise ValueError(f"expected images [B, C, H, W], got shape {tuple(images.shape)}")
    out = AnalysisArrays()
    if "filters" in wanted:
        out.filters = backbone_filters(backbone, k=num_filters)
    if wanted == {"filters"}:
        return out
    require_vit(backbone, "figures " + ", ".join(sorted(wanted - {"filters"})))
    prefix = getattr(backbone, "num_prefix_tokens", 1)
    if "pos_embed" in wanted:
        out.pos_similarity = position_similarity(backbone.pos_embed, backbone.grid_size, prefix)
    if "attention_distance" in wanted:
        source = distance_images if distance_images is not None else images
        out.attention_distance = compute_attention_distance(
            backbone, source, num_images=num_distance_images, chunk_size=chunk_size
        )
    if wanted & {"attention_rollout", "attention_dino"}:
        shown = images[:max_images]
        out.images = denormalize(shown, mean, std)
        with eval_mode(backbone) as device:
            shown = shown.to(device)
            grid = image_grid(backbone, shown)
            attns = backbone.get_attention_maps(shown)  # depth × [B', heads, 1+N, 1+N]
        if "attention_rollout" in wanted:
            out.rollout = rollout_map(attns, grid, tuple(shown.shape[-2:]), prefix).cpu()
        if "attention_dino" in wanted:
            out.dino = dino_attention(attns[-1], grid, threshold, prefix)
    return out


def plot_all(arrays: AnalysisArrays, max_images: int = SHOWN_IMAGES, dino_max_images: int = SHOWN_DINO_IMAGES) -> dict[str, Figure]:
    """Figures for whatever ``arrays`` holds, keyed by the names in :data:`FIGURES`."""
    figs: dict[str, Figure] = {}
    if arrays.filters is not None:
        figs["filters"] = plot_filters(arrays.filters)
    if arrays.pos_similarity is not None:
        figs["pos_embed"] = plot_position_similarity(arrays.pos_similarity)
    if arrays.attention_distance is not None:
        figs["attention_distance"] = plot_attention_distance(arrays.attention_distance)
    if arrays.rollout is not None and arrays.images is not None:
        figs["attention_rollout"] = plot_rollout(arrays.images, arrays.rollout, max_images)
    if arrays.dino is not None and arrays.images is not None:
        figs["attention_dino"] = plot_dino_attention(arrays.images, arrays.dino, dino_max_images)
    return figs


def render_all(
    backbone: nn.Module,
    images: Tensor,
    out_dir: str | Path,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    figures: Sequence[str] = FIGURES,
    num_filters: int = PAPER_NUM_FILTERS,
    max_images: int = SHOWN_IMAGES,
    dino_max_images: int = SHOWN_DINO_IMAGES,
    threshold: float = DINO_THRESHOLD,
    distance_images: Tensor | Iterable[object] | None = None,
    num_distance_images: int = PAPER_NUM_IMAGES,
    chunk_size: int = CHUNK_SIZE,
) -> RenderResult:
    """Compute and draw the figures into ``out_dir``: ``<name>.png`` for each name in
    ``figures`` plus ``attention_distance.csv``. Arguments as in :func:`compute_all`;
    ``dino_max_images`` bounds the rows of the per-head DINO figure."""
    arrays = compute_all(
        backbone,
        images,
        mean=mean,
        std=std,
        figures=figures,
        num_filters=num_filters,
        max_images=max_images,
        threshold=threshold,
        distance_images=distance_images,
        num_distance_images=num_distance_images,
        chunk_size=chunk_size,
    )
    paths = save_all(arrays, plot_all(arrays, max_images, dino_max_images), out_dir)
    return RenderResult(paths=paths, arrays=arrays)


def save_all(arrays: AnalysisArrays, figs: dict[str, Figure], out_dir: str | Path) -> dict[str, Path]:
    """Write ``figs`` as ``out_dir/<name>.png`` and the attention distances (if computed) as
    ``out_dir/attention_distance.csv``; returns name -> path (the CSV as ``"attention_distance_csv"``)."""
    out_dir = Path(out_dir)
    paths = {name: save_figure(fig, out_dir / f"{name}.png") for name, fig in figs.items()}
    if arrays.attention_distance is not None:
        paths["attention_distance_csv"] = write_attention_distance_csv(
            arrays.attention_distance, out_dir / "attention_distance.csv"
        )
    return paths
