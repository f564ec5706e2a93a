"""Rebuild a backbone from anything that holds one: an export directory, a pretraining
checkpoint, a bare state dict (ours, timm's, the official DINO / MoCo v3 ones), or nothing at all
(``random:<name>``, the random-initialisation baseline every SSL result is compared with)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ssl_vit.backbones import create_backbone
from ssl_vit.eval.results import pretraining_data
from ssl_vit.export.config import resolve_normalization, source_origin
from ssl_vit.export.foreign import filter_foreign_state_dict, fit_state_dict, load_weights
from ssl_vit.export.sources import BackboneSource, normalize_which, read_source

RANDOM_PREFIX = "random:"


def _merged_kwargs(source: BackboneSource, backbone: str | None, backbone_kwargs: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The architecture to build: recorded by the source, or named by the caller. Caller kwargs
    override recorded ones (another resolution, drop path for fine-tuning)."""
    name = source.backbone
    if name is None:
        if backbone is None:
            raise ValueError(
                f"{source.path}: a state dict without a record of its architecture; name it: "
                "--arch NAME --backbone-kwargs JSON on the command line, backbone= and backbone_kwargs= "
                "in Python (NAME: see `ssl-vit backbones`)"
            )
        name = backbone
    elif backbone is not None and backbone != name:
        raise ValueError(f"{source.path}: holds a {name!r} backbone, not {backbone!r}")
    return name, {**source.backbone_kwargs, **(backbone_kwargs or {})}


def build_from_source(
    source: BackboneSource,
    backbone: str | None = None,
    backbone_kwargs: dict[str, Any] | None = None,
    map_location: Any = "cpu",
) -> nn.Module:
    """Create the backbone and load the source's weights (strict; one-line errors). Updates
    ``source.backbone`` / ``backbone_kwargs`` to what was built."""
    name, kwargs = _merged_kwargs(source, backbone, backbone_kwargs)
    grid = _recorded_grid(source)
    model = instantiate(name, kwargs, source.path, lambda m: _state_for(source, m, grid))
    source.backbone, source.backbone_kwargs = name, dict(kwargs)
    return model.to(map_location).eval()


def _recorded_grid(source: BackboneSource) -> tuple[int, int] | None:
    """The patch grid of the architecture the source records (its position embedding's grid,
    which need not be square); None when it records none."""
    if source.backbone is None or source.kind == "random":
        return None
    try:
        with torch.device("meta"):
            recorded = create_backbone(source.backbone, **source.backbone_kwargs)
    except (TypeError, ValueError):
        return None  # the load reports what is wrong with it
    grid = getattr(recorded, "grid_size", None)
    return (int(grid[0]), int(grid[1])) if grid is not None else None


def _state_for(source: BackboneSource, model: nn.Module, grid: tuple[int, int] | None = None) -> dict[str, Tensor]:
    try:
        if source.kind == "state_dict":
            return filter_foreign_state_dict(source.weights, model, which=source.which)
        return fit_state_dict(source.weights, model, grid)
    except ValueError as err:
        raise ValueError(f"{source.path}: {err}") from None


def instantiate(
    name: str, kwargs: dict[str, Any], where: str, state_for: Callable[[nn.Module], Mapping[str, Tensor]]
) -> nn.Module:
    """``create_backbone(name, **kwargs)`` holding the weights ``state_for(model)``.

    The model is built on the meta device and the weights are assigned, because the random
    initialisation they replace costs seconds for ViT-B on a CPU (truncated normals). A backbone
    with state that no state dict carries (a non-persistent buffer) is built normally instead."""
    with torch.device("meta"):
        model = create_backbone(name, **kwargs)
    load_weights(model, state_for(model), where, assign=True)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model = create_backbone(name, **kwargs)
        load_weights(model, state_for(model), where)
    return model


def random_source(backbone: str, backbone_kwargs: dict[str, Any] | None = None) -> BackboneSource:
    return BackboneSource({}, backbone, dict(backbone_kwargs or {}), "random", "random", method="random")


def resolve(
    spec: str | Path,
    map_location: Any = "cpu",
    which: str | None = None,
    backbone: str | None = None,
    backbone_kwargs: dict[str, Any] | None = None,
    seed: int | None = 0,
    weights_only: bool | None = None,
) -> tuple[nn.Module, BackboneSource]:
    """The backbone of ``spec`` and its :class:`BackboneSource` (see :func:`load_any_backbone`)."""
    text = str(spec)
    if text == "random" or text.startswith(RANDOM_PREFIX):
        name = text[len(RANDOM_PREFIX) :] if text.startswith(RANDOM_PREFIX) else ""
        name = name or backbone
        if not name:
            raise ValueError("random init needs a backbone: use 'random:<name>' (see `ssl-vit backbones`)")
        source = random_source(name, backbone_kwargs)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            model = create_backbone(name, **source.backbone_kwargs)
        return model.to(map_location).eval(), source
    source = read_source(spec, which=which, map_location="cpu", weights_only=weights_only)
    if source.kind == "export" and which is not None and normalize_which(which) != source.which:
        raise ValueError(f"{spec}: this export holds the {source.which or 'only'} backbone; which={which!r} is not in it")
    return build_from_source(source, backbone, backbone_kwargs, map_location), source


def source_info(source: BackboneSource, model: nn.Module) -> dict[str, Any]:
    """What evaluators and figures need to know about a loaded backbone."""
    norm = resolve_normalization(source.normalization, int(model.in_chans))
    training = source.training
    pretrain = {
        "steps": training.get("global_step"),
        "epochs": training.get("epochs"),  # (older checkpoints recorded only the index of the epoch in progress)
        "flops": training.get("pretrain_flops", training.get("flops")),
        "wall_time_s": training.get("wall_time_s"),
        "global_batch_size": training.get("global_batch_size"),
        "data": pretraining_data(source.data),
        "checkpoint": source_origin(source),  # (one pretraining, whether its checkpoint or an export of it is evaluated)
    }
    return {
        "name": source.backbone,
        "kwargs": dict(source.backbone_kwargs),
        "mean": norm["mean"],
        "std": norm["std"],
        "normalization_source": norm["source"],
        "method": source.method,
        "which": source.which,
        "default_which": source.default_which,
        # (absolute: records of one checkpoint agree however its path was typed)
        "source": source.path if source.kind == "random" else str(Path(source.path).resolve()),
        "kind": source.kind,
        "data": source.data,
        "recipe": source.recipe,
        "pretrain": {k: v for k, v in pretrain.items() if v is not None},
    }


def load_any_backbone(
    spec: str | Path,
    map_location: Any = "cpu",
    *,
    which: str | None = None,
    backbone: str | None = None,
    backbone_kwargs: dict[str, Any] | None = None,
    seed: int | None = 0,
    weights_only: bool | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """A backbone (eval mode) and an info dict, from any of:

    * an export directory (``config.json`` + ``model.safetensors``);
    * a pretraining checkpoint (``.ckpt``; ``which`` = ``teacher`` / ``student`` / ``momentum``,
      default: DINO's teacher, otherwise the online backbone);
    * a bare state dict (``.safetensors`` / ``.pt`` / ``.pth``; ours, timm's, or an official DINO /
      MoCo v3 checkpoint) with ``backbone`` and ``backbone_kwargs`` naming the architecture;
    * ``random:<name>`` with ``backbone_kwargs``: a random initialisation (``seed``; ``None`` uses
      the global RNG), the lower bound of every comparison.

    ``backbone_kwargs`` also override recorded kwargs (e.g. another ``img_size``: the position
    embedding is resampled). The info dict has ``name``, ``kwargs``, ``mean``, ``std``,
    ``normalization_source``, ``method``, ``which``, ``source``, ``kind``, ``data``, ``recipe`` and
    ``pretrain`` (``steps``, ``epochs``, ``flops``, ... as ``EvalResult.pretrain`` takes them).

    Example::

        vit, info = load_any_backbone("runs/dino/checkpoints/last.ckpt")
        base, _ = load_any_backbone("random:vit_tiny", backbone_kwargs={"img_size": 28, "patch_size": 4, "in_chans": 1})
    """
    model, source = resolve(spec, map_location, which, backbone, backbone_kwargs, seed, weights_only)
    return model, source_info(source, model)


def load_backbone(
    path: str | Path,
    map_location: Any = "cpu",
    *,
    which: str | None = None,
    backbone: str | None = None,
    backbone_kwargs: dict[str, Any] | None = None,
    weights_only: bool | None = None,
) -> nn.Module:
    """The backbone stored at ``path`` (an export directory, a pretraining checkpoint, or a bare
    state dict with ``backbone``/``backbone_kwargs``), in eval mode. See :func:`load_any_backbone`.

    Example::

        vit = ssl_vit.load_backbone("exports/dino_vit_tiny")  # no recipe needed
        feats = vit(images)  # [B, D]
    """
    if str(path) == "random" or str(path).startswith(RANDOM_PREFIX):
        raise ValueError(f"load_backbone reads weights from a path; for {str(path)!r} use load_any_backbone")
    model, _ = resolve(path, map_location, which, backbone, backbone_kwargs, None, weights_only)
    return model
