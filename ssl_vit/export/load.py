"""A backbone from anything that holds one: an export folder, a pretraining checkpoint, a bare
state dict (ours, timm's, the official DINO / MoCo v3 ones), or nothing (``random:<name>``, the
random initialisation every self-supervised result is compared with)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ssl_vit.backbones import create_backbone
from ssl_vit.export.config import resolve_normalization
from ssl_vit.export.foreign import filter_foreign_state_dict, fit_state_dict, load_weights
from ssl_vit.export.sources import BackboneSource, normalize_which, read_source

RANDOM_PREFIX = "random:"


def instantiate(name: str, kwargs: dict[str, Any], where: str, state_for: Callable[[nn.Module], Mapping[str, Tensor]]) -> nn.Module:
    """``create_backbone(name, **kwargs)`` holding the weights ``state_for(model)``, built on the
    meta device (the random initialisation they replace costs seconds for a ViT-B on a CPU); a
    backbone with state no state dict carries (a non-persistent buffer) is built normally."""
    with torch.device("meta"):
        model = create_backbone(name, **kwargs)
    load_weights(model, state_for(model), where, assign=True)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model = create_backbone(name, **kwargs)
        load_weights(model, state_for(model), where)
    return model


def _recorded_grid(source: BackboneSource) -> tuple[int, int] | None:
    """The patch grid of the architecture the source records (need not be square), or None."""
    try:
        with torch.device("meta"):
            grid = getattr(create_backbone(source.backbone, **source.backbone_kwargs), "grid_size", None)
    except (TypeError, ValueError):
        return None  # the load reports what is wrong with it
    return (int(grid[0]), int(grid[1])) if grid is not None else None


def resolve(spec: str | Path, map_location: Any = "cpu", which: str | None = None, backbone: str | None = None,
            backbone_kwargs: dict[str, Any] | None = None, seed: int | None = 0, weights_only: bool | None = None,
            ) -> tuple[nn.Module, BackboneSource]:
    """The backbone of ``spec`` (eval mode) and its :class:`BackboneSource` (see :func:`load_any_backbone`)."""
    text = str(spec)
    if text == "random" or text.startswith(RANDOM_PREFIX):
        name = text.removeprefix("random").removeprefix(":") or backbone
        if not name:
            raise ValueError("random init needs a backbone: use 'random:<name>' (see `ssl-vit backbones`)")
        source = BackboneSource({}, name, dict(backbone_kwargs or {}), "random", "random", method="random")
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            return create_backbone(name, **source.backbone_kwargs).to(map_location).eval(), source
    source = read_source(spec, which=which, weights_only=weights_only)
    if source.kind == "export" and which is not None and normalize_which(which) != source.which:
        raise ValueError(f"{spec}: this export holds the {source.which or 'only'} backbone; which={which!r} is not in it")
    if source.backbone is None and backbone is None:
        raise ValueError(f"{source.path}: a state dict without a record of its architecture; name it: --arch NAME --backbone-kwargs "
                         "JSON on the command line, backbone= and backbone_kwargs= in Python (NAME: see `ssl-vit backbones`)")
    if None not in (source.backbone, backbone) and backbone != source.backbone:
        raise ValueError(f"{source.path}: holds a {source.backbone!r} backbone, not {backbone!r}")
    grid = _recorded_grid(source) if source.backbone is not None else None

    def state_for(model: nn.Module) -> dict[str, Tensor]:
        try:
            if source.kind == "state_dict":
                return filter_foreign_state_dict(source.weights, model, which=source.which)
            return fit_state_dict(source.weights, model, grid)
        except ValueError as err:
            raise ValueError(f"{source.path}: {err}") from None

    # caller kwargs override recorded ones (another resolution: the position table is resampled)
    source.backbone, source.backbone_kwargs = source.backbone or backbone, {**source.backbone_kwargs, **(backbone_kwargs or {})}
    return instantiate(source.backbone, source.backbone_kwargs, source.path, state_for).to(map_location).eval(), source


def source_info(source: BackboneSource, model: nn.Module) -> dict[str, Any]:
    """What evaluations and figures need to know about a loaded backbone (:func:`load_any_backbone`)."""
    norm = resolve_normalization(source.normalization, int(model.in_chans))
    training = source.training
    pretrain = {
        "steps": training.get("global_step"),
        "epochs": training.get("epochs"),  # (older checkpoints recorded only the index of the epoch in progress)
        "flops": training.get("pretrain_flops", training.get("flops")),
        "wall_time_s": training.get("wall_time_s"),
        "global_batch_size": training.get("global_batch_size"),
        "data": source.data,  # the data record; EvalResult names it as evaluation data are named
        "checkpoint": source.origin,  # one pretraining, whether its checkpoint or an export of it is evaluated
    }
    return {
        "name": source.backbone, "kwargs": dict(source.backbone_kwargs), "mean": norm["mean"], "std": norm["std"],
        "normalization_source": norm["source"], "method": source.method, "which": source.which, "default_which": source.default_which,
        # (absolute: results of one checkpoint agree however its path was typed)
        "source": source.path if source.kind == "random" else str(Path(source.path).resolve()),
        "kind": source.kind, "data": source.data, "recipe": source.recipe,
        "pretrain": {k: v for k, v in pretrain.items() if v is not None},
    }


def load_any_backbone(spec: str | Path, map_location: Any = "cpu", *, which: str | None = None, backbone: str | None = None,
                      backbone_kwargs: dict[str, Any] | None = None, seed: int | None = 0, weights_only: bool | None = None,
                      ) -> tuple[nn.Module, dict[str, Any]]:
    """A backbone (eval mode) and an info dict, from any of:

    * an export folder (``config.json`` + ``model.safetensors``);
    * a pretraining checkpoint (``.ckpt``; ``which``: ``teacher`` / ``student`` / ``momentum`` /
      a method's own ``NAME``; by default DINO's teacher, otherwise the online backbone);
    * a bare state dict (``.safetensors`` / ``.pt`` / ``.pth``: ours, timm's, an official DINO /
      MoCo v3 checkpoint) with ``backbone`` and ``backbone_kwargs`` naming the architecture;
    * ``random:<name>`` with ``backbone_kwargs``: a random initialisation (``seed``; None: the
      global generator), the lower bound of every comparison.

    ``backbone_kwargs`` also override recorded ones (another ``img_size``: the position table is
    resampled). ``weights_only``: see :func:`~ssl_vit.export.sources.read_torch_file`. The info dict
    has ``name``, ``kwargs``, ``mean``, ``std``, ``normalization_source``, ``method``, ``which``,
    ``source``, ``kind``, ``data``, ``recipe`` and ``pretrain`` (``steps``, ``epochs``, ``flops``
    ... as ``EvalResult.pretrain`` takes them).

    Example::

        vit, info = load_any_backbone("runs/dino/checkpoints/last.ckpt")
        base, _ = load_any_backbone("random:vit_tiny", backbone_kwargs={"img_size": 28, "patch_size": 4, "in_chans": 1})
    """
    model, source = resolve(spec, map_location, which, backbone, backbone_kwargs, seed, weights_only)
    return model, source_info(source, model)


def load_backbone(path: str | Path, map_location: Any = "cpu", *, which: str | None = None, backbone: str | None = None,
                  backbone_kwargs: dict[str, Any] | None = None, weights_only: bool | None = None) -> nn.Module:
    """The backbone stored at ``path``, in eval mode (:func:`load_any_backbone`, without ``random:``).

    Example::

        vit = ssl_vit.load_backbone("exports/dino_vit_tiny")  # no recipe needed
        feats = vit(images)  # [B, D]
    """
    if str(path) == "random" or str(path).startswith(RANDOM_PREFIX):
        raise ValueError(f"load_backbone reads weights from a path; for {str(path)!r} use load_any_backbone")
    return resolve(path, map_location, which, backbone, backbone_kwargs, None, weights_only)[0]
