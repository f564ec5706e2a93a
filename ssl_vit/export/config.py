"""``config.json`` of an export: how to rebuild the backbone (ours and timm's way), how to feed
it, and where it came from.

Top level, timm's Hugging Face layout (``architecture``, ``model_args``, ``num_classes``,
``num_features``, ``pretrained_cfg``), so ``timm.create_model("local-dir:<dir>", pretrained=True)``
rebuilds plain ViTs and the standard ResNets; also flat ``mean``, ``std``, ``input_size`` for
anyone reading it by hand. Under ``ssl_vit``: the registry name and kwargs
(``ssl_vit.load_backbone(dir)`` needs nothing else), the weight layout, normalisation, method,
encoder, recipe, training record and evaluation results.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from ssl_vit.backbones import ResNetBackbone, VisionTransformer
from ssl_vit.backbones.vit import PatchEmbed
from ssl_vit.export.files import read_json
from ssl_vit.export.sources import BackboneSource

FORMAT_VERSION = 1
# Normalisation when the checkpoint does not record its data: ImageNet statistics for RGB
# (timm IMAGENET_DEFAULT_MEAN/STD), 0.5 / 0.5 for any other channel count ([0, 1] -> [-1, 1]).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# (width, depth, heads) -> the ViT size whose timm entry points build that shape.
TIMM_VIT_SIZES: dict[tuple[int, int, int], str] = {
    (192, 12, 3): "tiny",
    (384, 12, 6): "small",
    (768, 12, 12): "base",
    (1024, 24, 16): "large",
    (1280, 32, 16): "huge",
}
# timm's plain ViT entry points (class token, token pooling, no fc_norm) per size, as
# ``vit_<size>_patch<P>_<image size>`` (timm 1.0's registry; a test checks each against it).
# A shape among them is named exactly; any other rebuilds from its size's first entry (or
# ViT-B/16) with overrides, since the shape arguments are always written to model_args.
TIMM_VIT_ENTRY_POINTS: dict[str, tuple[tuple[int, int], ...]] = {
    "tiny": ((16, 224), (16, 384)),
    "small": ((16, 224), (8, 224), (16, 384), (32, 224), (32, 384)),
    "base": ((16, 224), (8, 224), (16, 384), (32, 224), (32, 384)),
    "large": ((16, 224), (14, 224), (16, 384), (32, 224), (32, 384)),
    "huge": ((14, 224),),
}


def timm_vit_name(embed_dim: int, depth: int, num_heads: int, patch_size: int, img_size: tuple[int, int]) -> str:
    """The timm entry point that names a plain ViT of this shape: the exact one when timm has it
    (``vit_small_patch8_224``), else its size's first (``vit_huge_patch14_224`` for ViT-H/16)."""
    size = TIMM_VIT_SIZES.get((embed_dim, depth, num_heads))
    if size is None:
        return "vit_base_patch16_224"
    points = TIMM_VIT_ENTRY_POINTS[size]
    exact = img_size[0] == img_size[1] and (patch_size, img_size[0]) in points
    patch, img = (patch_size, img_size[0]) if exact else points[0]
    return f"vit_{size}_patch{patch}_{img}"


def resolve_normalization(recorded: dict[str, Any] | None, in_chans: int) -> dict[str, Any]:
    """``{"mean", "std", "source"}`` with one value per input channel."""
    if recorded and recorded.get("mean") is not None and recorded.get("std") is not None:
        mean, std, source = list(recorded["mean"]), list(recorded["std"]), recorded.get("source", "recorded")
    elif in_chans == 3:
        mean, std, source = list(IMAGENET_MEAN), list(IMAGENET_STD), "default (ImageNet statistics)"
    else:
        mean, std, source = [0.5] * in_chans, [0.5] * in_chans, "default (0.5 / 0.5)"
    if len(mean) == 1 and in_chans > 1:  # grey statistics for every channel
        mean, std = mean * in_chans, std * in_chans
    return {"mean": [float(v) for v in mean], "std": [float(v) for v in std], "source": source}


def is_plain_vit(model: nn.Module) -> bool:
    """Our ViT itself (not a subclass, which may add layers timm's does not have) with a plain
    patch embedding: the network timm builds from the same arguments."""
    return type(model) is VisionTransformer and isinstance(model.patch_embed, PatchEmbed)


def weights_format(model: nn.Module) -> str:
    """Whose parameter names the exported weights use: ``timm`` (plain ViT), ``torchvision``
    (ResNet baselines) or ``ssl_vit`` (hybrids: a torchvision ResNet trunk under
    ``patch_embed.backbone.*`` and a 1x1 projection ``patch_embed.proj``, which no library shares)."""
    if is_plain_vit(model):
        return "timm"
    if isinstance(model, ResNetBackbone):
        return "torchvision"
    return "ssl_vit"


def source_origin(source: Any) -> str | None:
    """The absolute path of the file a :class:`BackboneSource`'s weights were first read from: its
    own path, or the checkpoint an export recorded (None for a random initialisation)."""
    if source.origin:
        return source.origin
    return None if source.kind == "random" else str(Path(source.path).resolve())


def timm_architecture(model: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """``(timm model name, model_args)`` that build the same network in timm, or ``None``."""
    if is_plain_vit(model):
        block = model.blocks[0]
        args: dict[str, Any] = {
            "img_size": list(model.img_size),
            "patch_size": model.patch_size,
            "in_chans": model.in_chans,
            "embed_dim": model.embed_dim,
            "depth": model.depth,
            "num_heads": model.num_heads,
            "mlp_ratio": _mlp_ratio(block.mlp.fc1.out_features, model.embed_dim),
            "qkv_bias": block.attn.qkv.bias is not None,
            "class_token": True,
            "global_pool": model.global_pool,
        }
        if model.global_pool == "avg":
            # Ours averages tokens after the final LayerNorm; timm's default for "avg" normalises
            # after pooling (fc_norm). fc_norm=False keeps timm's `norm` on the tokens, as ours.
            args["fc_norm"] = False
        return timm_vit_name(model.embed_dim, model.depth, model.num_heads, model.patch_size, tuple(model.img_size)), args
    kwargs = getattr(model, "backbone_kwargs", {})
    if isinstance(model, ResNetBackbone) and not model.small_input and model.num_stages == 4 and kwargs.get("layers") is None:
        return model.arch, {"in_chans": model.in_chans}  # timm's ResNets share torchvision's names
    return None


def _mlp_ratio(hidden: int, dim: int) -> float:
    """The ``mlp_ratio`` from which timm (and our ViT) build an MLP ``hidden`` wide:
    ``int(dim * ratio)``, which ``hidden / dim`` can miss by one in float rounding (176 x
    (469 / 176) = 468.99...); half a unit above it cannot."""
    ratio = hidden / dim
    return ratio if int(dim * ratio) == hidden else (hidden + 0.5) / dim


def file_record(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"sha256": digest.hexdigest(), "bytes": path.stat().st_size}


def run_directory(checkpoint: Path) -> Path | None:
    """``<run>/checkpoints/last.ckpt`` (where ``ssl-vit fit`` writes) -> ``<run>``; ``None`` for a
    checkpoint elsewhere, whose folder may hold anything."""
    folder = checkpoint.resolve().parent
    return folder.parent if folder.name == "checkpoints" else None


def read_result(path: Path, strict: bool = True) -> dict[str, Any] | None:
    """One evaluation record: an ``EvalResult`` JSON (validated), or any JSON object with a
    ``metrics`` mapping (copied). ``strict=False`` returns ``None`` for files that are neither."""
    try:
        d = read_json(path)
    except ValueError:
        if strict:
            raise
        return None
    if not isinstance(d, dict) or not isinstance(d.get("metrics"), dict):
        if strict:
            raise ValueError(f"{path}: not an evaluation result (expected a JSON object with 'metrics')")
        return None
    if "protocol" in d:
        try:
            from ssl_vit.eval.results import EvalResult
        except ImportError:
            EvalResult = None  # noqa: N806  (records are copied unvalidated)
        if EvalResult is not None:
            try:
                d = EvalResult.from_dict(d, where=str(path)).to_dict()
            except ValueError as err:
                if strict:
                    raise
                warnings.warn(f"skipping malformed result record: {err}", stacklevel=2)
                return None
        return {**d, "file": str(path)}
    return {"metrics": d["metrics"], "file": str(path)}


def _visible_json(folder: Path) -> list[Path]:
    """The ``*.json`` files under ``folder``, less those in hidden folders or hidden themselves
    below it (an export's staging folder, ``.ipynb_checkpoints``); the folder itself may be hidden."""
    return [p for p in sorted(folder.rglob("*.json")) if not any(part.startswith(".") for part in p.relative_to(folder).parts)]


def collect_results(source: BackboneSource, extra: list[str | Path] = ()) -> list[dict[str, Any]]:
    """Results already recorded with the source (an export), those in a checkpoint's run
    directory that evaluated these weights, and those passed explicitly (files or folders).

    A run directory also holds the records of its earlier checkpoints: a run resumed after it was
    evaluated overwrites ``last.ckpt``, and the old records name that file still. Those whose
    ``pretrain.steps`` is not the checkpoint's step were of other weights, and are left out; so are
    those of another encoder of the checkpoint (a record names its encoder, ``backbone.encoder``,
    when it is not the method's default: MoCo v3's momentum encoder, DINO's student), and a
    result file given explicitly of another encoder is refused."""
    from ssl_vit.eval.results import chosen_encoder

    exported = chosen_encoder({"which": source.which, "method": source.method, "default_which": source.default_which})
    results = list(source.results)
    found: list[tuple[Path, bool]] = []
    run_dir = run_directory(Path(source.path)) if source.kind == "lightning" else None
    if run_dir is not None:
        found += [(p, False) for p in _visible_json(run_dir) if "checkpoints" not in p.relative_to(run_dir).parts]
    step = source.training.get("global_step")
    own_run = {p for p, _ in found}
    for item in map(Path, extra):
        if item.is_dir():
            found += [(p, False) for p in _visible_json(item)]
        elif item.is_file():
            found.append((item, True))
        else:
            raise FileNotFoundError(f"{item}: no such result file or folder")
    seen = {r.get("file") for r in results}
    for path, strict in found:
        if str(path) in seen:
            continue
        record = read_result(path, strict=strict)
        steps = ((record or {}).get("pretrain") or {}).get("steps")
        if path in own_run and step is not None and steps is not None and steps != step:
            continue  # a record of an earlier checkpoint of the run (see above)
        backbone = (record or {}).get("backbone")
        encoder = backbone.get("encoder") if isinstance(backbone, dict) else exported  # a bare {"metrics"} file: unknown, kept
        if record is not None and encoder != exported:
            if strict:
                raise ValueError(f"{path}: a result of the {encoder or 'default'} encoder of its checkpoint; this export is of the "
                                 f"{exported or 'default'} one ({source.which})")
            continue
        if record is not None:
            results.append(record)
            seen.add(str(path))
    return results


def classifier_name(model: nn.Module) -> str:
    """timm's name of the classifier on a backbone: ``head`` (ViTs, hybrids), ``fc`` (ResNets)."""
    return "head" if isinstance(model, VisionTransformer) else "fc"


def build_config(
    model: nn.Module,
    source: BackboneSource,
    normalization: dict[str, Any],
    results: list[dict[str, Any]],
    files: dict[str, dict[str, Any]],
    num_classes: int = 0,
) -> dict[str, Any]:
    """The whole ``config.json`` (see the module docstring); ``num_classes`` > 0 when
    ``model.safetensors`` also holds a classifier (a fine-tuned model)."""
    from ssl_vit import __version__

    in_chans = int(model.in_chans)
    img_size = [int(s) for s in model.img_size]
    input_size = [in_chans, *img_size]
    is_vit = isinstance(model, VisionTransformer)
    pretrained_cfg: dict[str, Any] = {
        "input_size": input_size,
        "mean": normalization["mean"],
        "std": normalization["std"],
        "num_classes": num_classes,
        "first_conv": "patch_embed.proj" if is_plain_vit(model) else "conv1" if isinstance(model, ResNetBackbone) else None,
        "classifier": classifier_name(model),
        "fixed_input_size": is_vit,
    }
    config: dict[str, Any] = {}
    arch = timm_architecture(model)
    if arch is not None:
        config["architecture"], config["model_args"] = arch[0], arch[1]
    config.update(
        {
            "num_classes": num_classes,
            "num_features": int(model.embed_dim),
            "global_pool": getattr(model, "global_pool", "avg"),
            "pretrained_cfg": {k: v for k, v in pretrained_cfg.items() if v is not None},
            "mean": normalization["mean"],
            "std": normalization["std"],
            "input_size": input_size,
        }
    )
    config["ssl_vit"] = {
        "format_version": FORMAT_VERSION,
        "backbone": source.backbone,
        "backbone_kwargs": source.backbone_kwargs,
        "weights_format": weights_format(model),
        "img_size": img_size,
        "in_chans": in_chans,
        "patch_size": getattr(model, "patch_size", None),
        "embed_dim": int(model.embed_dim),
        "normalization": normalization,
        "method": source.method,
        "which": source.which,
        "default_which": source.default_which,
        "source": source.path,
        "origin": source_origin(source),
        "training": source.training,
        "data": source.data,
        "recipe": source.recipe,
        "results": results,
        "files": files,
        "ssl_vit_version": __version__,
    }
    return config
