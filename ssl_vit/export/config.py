"""``config.json`` of an export: how to rebuild the backbone (ours and timm's way), how to feed it,
and where it came from.

At the top, timm's Hugging Face layout (``architecture``, ``model_args``, ``num_classes``,
``num_features``, ``pretrained_cfg``), so that ``timm.create_model("local-dir:DIR", pretrained=True)``
rebuilds plain ViTs and the standard ResNets, and flat ``mean`` / ``std`` / ``input_size`` for a
reader. Under ``ssl_vit``: the registry name and kwargs (all ``load_backbone(DIR)`` needs), the
weight layout, normalisation, method, encoder, recipe, run info and evaluation results.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import timm
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn

from ssl_vit.backbones import ResNetBackbone, VisionTransformer
from ssl_vit.backbones.vit import PatchEmbed
from ssl_vit.export.sources import BackboneSource, chosen_encoder
from ssl_vit.io import read_json

# (width, depth, heads) -> the ViT size of timm's entry points of that shape (ViT paper Table 1, DeiT-Ti).
TIMM_VIT_SIZES = {(192, 12, 3): "tiny", (384, 12, 6): "small", (768, 12, 12): "base", (1024, 24, 16): "large", (1280, 32, 16): "huge"}


def timm_vit_name(embed_dim: int, depth: int, num_heads: int, patch_size: int, img_size: tuple[int, int]) -> str:
    """timm's entry point of a plain ViT of this shape, ``vit_<size>_patch<P>_<image size>`` when
    timm registers it, else its size's first (``vit_huge_patch14_224`` for a ViT-H/16) or ViT-B/16's:
    ``model_args`` carry the shape, timm builds any from there."""
    size = TIMM_VIT_SIZES.get((embed_dim, depth, num_heads))
    exact = f"vit_{size}_patch{patch_size}_{img_size[0]}"
    if size is not None and img_size[0] == img_size[1] and timm.is_model(exact):
        return exact
    return "vit_huge_patch14_224" if size == "huge" else f"vit_{size or 'base'}_patch16_224"


def resolve_normalization(recorded: dict[str, Any] | None, in_chans: int) -> dict[str, Any]:
    """``{"mean", "std", "source"}``, one value per input channel: recorded, else timm's ImageNet
    statistics for RGB and 0.5 / 0.5 ([0, 1] -> [-1, 1]) for any other channel count."""
    if recorded and recorded.get("mean") is not None and recorded.get("std") is not None:
        mean, std, source = list(recorded["mean"]), list(recorded["std"]), recorded.get("source", "recorded")
    elif in_chans == 3:
        mean, std, source = list(IMAGENET_DEFAULT_MEAN), list(IMAGENET_DEFAULT_STD), "default (ImageNet statistics)"
    else:
        mean, std, source = [0.5], [0.5], "default (0.5 / 0.5)"
    if len(mean) == 1:  # grey statistics: every channel holds the grey image
        mean, std = mean * in_chans, std * in_chans
    return {"mean": [float(v) for v in mean], "std": [float(v) for v in std], "source": source}


def is_plain_vit(model: nn.Module) -> bool:
    """Our ViT itself (a subclass may add layers) with a plain patch embedding: what timm builds."""
    return type(model) is VisionTransformer and isinstance(model.patch_embed, PatchEmbed)


def weights_format(model: nn.Module) -> str:
    """Whose parameter names the weights use: ``timm`` (plain ViTs), ``torchvision`` (ResNets) or
    ``ssl_vit`` (hybrids: a torchvision trunk under ``patch_embed.backbone.*`` and a 1x1
    ``patch_embed.proj``, which no library shares; a ViT subclass's own layers)."""
    return "timm" if is_plain_vit(model) else "torchvision" if isinstance(model, ResNetBackbone) else "ssl_vit"


def timm_architecture(model: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """``(timm model name, model_args)`` that build the same network in timm, or None."""
    if is_plain_vit(model):
        hidden, dim = model.blocks[0].mlp.fc1.out_features, model.embed_dim
        args: dict[str, Any] = {
            "img_size": list(model.img_size), "patch_size": model.patch_size, "in_chans": model.in_chans, "embed_dim": dim,
            "depth": model.depth, "num_heads": model.num_heads,
            # timm builds int(dim * ratio) hidden units, which hidden / dim can miss by one in float
            # rounding (176 x (469 / 176) = 468.99...); half a unit above cannot
            "mlp_ratio": hidden / dim if int(dim * (hidden / dim)) == hidden else (hidden + 0.5) / dim,
            "qkv_bias": model.blocks[0].attn.qkv.bias is not None, "class_token": True, "global_pool": model.global_pool,
        }
        if model.global_pool == "avg":  # ours averages after the final norm; timm's fc_norm would normalise after pooling
            args["fc_norm"] = False
        return timm_vit_name(dim, model.depth, model.num_heads, model.patch_size, tuple(model.img_size)), args
    if isinstance(model, ResNetBackbone) and not model.small_input and model.num_stages == 4 and not getattr(model, "backbone_kwargs", {}).get("layers"):
        return model.arch, {"in_chans": model.in_chans}  # timm's ResNets share torchvision's names
    return None


def classifier_name(model: nn.Module) -> str:
    """timm's name of a classifier on the backbone: ``head`` (ViTs, hybrids), ``fc`` (ResNets)."""
    return "head" if isinstance(model, VisionTransformer) else "fc"


def _results_in(folder: Path) -> list[Path]:
    """The JSON files below ``folder``, less those hidden or in hidden folders below it (the
    staging folder, ``.ipynb_checkpoints``); ``folder`` itself may be hidden."""
    return [p for p in sorted(folder.rglob("*.json")) if not any(part.startswith(".") for part in p.relative_to(folder).parts)]


def collect_results(source: BackboneSource, extra: list[str | Path] = ()) -> list[dict[str, Any]]:
    """Evaluation results of these weights: those the source carries (an export), those of the run
    folder of a checkpoint at ``<run>/checkpoints/`` (not below ``checkpoints/``; a checkpoint
    elsewhere lies among anything), and ``extra`` files or folders.

    A result is a JSON object with ``metrics``; a file named in ``extra`` that is not is refused, one
    found in a folder skipped. A run folder also holds the results of its earlier checkpoints (a
    resumed run overwrites ``last.ckpt``): those whose ``pretrain.steps`` is not this checkpoint's
    are left out. So are those of another encoder of the checkpoint (a result names its
    ``backbone.encoder`` when not the method's default); a file named in ``extra`` of another
    encoder is refused."""
    exported = chosen_encoder({"which": source.which, "method": source.method, "default_which": source.default_which})
    results, seen = list(source.results), {r.get("file") for r in source.results}
    found: list[tuple[Path, bool]] = []  # (file, named by the user)
    run = Path(source.path).resolve().parent
    if source.kind == "lightning" and run.name == "checkpoints":
        found += [(p, False) for p in _results_in(run.parent) if "checkpoints" not in p.relative_to(run.parent).parts]
    own_run = {p for p, _ in found}
    for item in map(Path, extra):
        if not item.exists():
            raise FileNotFoundError(f"{item}: no such result file or folder")
        found += [(p, False) for p in _results_in(item)] if item.is_dir() else [(item, True)]
    step = source.training.get("global_step")
    for path, named in found:
        if str(path) in seen:
            continue
        try:
            result = read_json(path)
            if not isinstance(result, dict) or not isinstance(result.get("metrics"), dict):
                raise ValueError(f"{path}: not an evaluation result (expected a JSON object with 'metrics')")
        except ValueError:
            if named:
                raise
            continue
        steps = (result.get("pretrain") or {}).get("steps")
        if path in own_run and None not in (step, steps) and steps != step:
            continue  # a result of an earlier checkpoint of the run
        backbone = result.get("backbone")
        encoder = backbone.get("encoder") if isinstance(backbone, dict) else exported  # a bare {"metrics"} file: kept
        if encoder != exported:
            if named:
                raise ValueError(f"{path}: a result of the {encoder or 'default'} encoder of its checkpoint; this export is of the "
                                 f"{exported or 'default'} one ({source.which})")
            continue
        results.append({**result, "file": str(path)})
        seen.add(str(path))
    return results


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def build_config(model: nn.Module, source: BackboneSource, results: list[dict[str, Any]], files: list[Path],
                 parity: dict[str, float], num_classes: int = 0) -> dict[str, Any]:
    """The whole ``config.json`` (module docstring); ``num_classes`` > 0 when ``model.safetensors``
    also holds a classifier (a fine-tuned model)."""
    from ssl_vit import __version__

    norm = resolve_normalization(source.normalization, int(model.in_chans))
    img_size = [int(s) for s in model.img_size]
    input_size = [int(model.in_chans), *img_size]
    first_conv = "patch_embed.proj" if is_plain_vit(model) else "conv1" if isinstance(model, ResNetBackbone) else None
    arch = timm_architecture(model)
    return {
        **({"architecture": arch[0], "model_args": arch[1]} if arch else {}),
        "num_classes": num_classes,
        "num_features": int(model.embed_dim),
        "global_pool": getattr(model, "global_pool", "avg"),
        "pretrained_cfg": {"input_size": input_size, "mean": norm["mean"], "std": norm["std"], "num_classes": num_classes,
                           **({"first_conv": first_conv} if first_conv else {}), "classifier": classifier_name(model),
                           "fixed_input_size": isinstance(model, VisionTransformer)},
        "mean": norm["mean"],
        "std": norm["std"],
        "input_size": input_size,
        "ssl_vit": {
            "format_version": 1, "backbone": source.backbone, "backbone_kwargs": source.backbone_kwargs,
            "weights_format": weights_format(model), "img_size": img_size, "in_chans": int(model.in_chans),
            "patch_size": getattr(model, "patch_size", None), "embed_dim": int(model.embed_dim), "normalization": norm,
            "method": source.method, "which": source.which, "default_which": source.default_which, "source": source.path,
            "origin": source.origin,
            "training": source.training, "data": source.data, "recipe": source.recipe, "results": results,
            "files": {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size, **({"max_abs_diff": parity[p.name]} if p.name in parity else {})}
                      for p in files},
            "ssl_vit_version": __version__,
        },
    }
