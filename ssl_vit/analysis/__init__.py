"""The ViT paper's "looking inside" figures (Dosovitskiy et al. 2021, §4.5, Figs. 6-7, Appendix
D.7-D.8) and DINO's attention maps: each computed by a pure function returning tensors, drawn
separately with matplotlib.

    filters             principal components of the patch embedding E
    pos_embed           cosine similarity of position embeddings
    attention_distance  mean attention distance per layer and head
    attention_maps      attention rollout and DINO's per-head [CLS] maps with 60 % masks
    draw                the figures (no screen needed)
    render              everything at once: ``compute_all``, ``plot_all``, ``render_all``
    callback            ``AnalysisCallback``: the figures in TensorBoard during training
"""

from __future__ import annotations

from typing import Any

from ssl_vit.analysis.attention_distance import (
    compute_attention_distance,
    mean_attention_distance,
    patch_distances,
)
from ssl_vit.analysis.attention_maps import (
    DinoAttention,
    attention_rollout,
    dino_attention,
    keep_top_mass,
    rollout_map,
)
from ssl_vit.analysis.filters import FilterPCA, backbone_filters, embedding_filters, filter_weight
from ssl_vit.analysis.inputs import denormalize
from ssl_vit.analysis.pos_embed import position_similarity
from ssl_vit.analysis.render import (
    FIGURES,
    AnalysisArrays,
    RenderResult,
    compute_all,
    plot_all,
    render_all,
    save_all,
)

__all__ = [
    "FIGURES",
    "AnalysisArrays",
    "AnalysisCallback",
    "DinoAttention",
    "FilterPCA",
    "RenderResult",
    "attention_rollout",
    "backbone_filters",
    "compute_all",
    "compute_attention_distance",
    "denormalize",
    "dino_attention",
    "embedding_filters",
    "filter_weight",
    "keep_top_mass",
    "mean_attention_distance",
    "patch_distances",
    "plot_all",
    "position_similarity",
    "render_all",
    "rollout_map",
    "save_all",
]


def __getattr__(name: str) -> Any:
    # The callback imports Lightning; load it only when asked for, so the pure functions stay light.
    if name == "AnalysisCallback":
        from ssl_vit.analysis.callback import AnalysisCallback

        return AnalysisCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
