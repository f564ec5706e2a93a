"""Write an export folder: ``model.safetensors``, the traced copies asked for and ``config.json``
last (a folder with one is a complete export), each file written atomically and checked against the
eager backbone; a refused export leaves no file, and no folder of its own. ``config.json`` has timm's
Hugging Face layout at the top (``timm.create_model("local-dir:DIR", pretrained=True)`` rebuilds
plain ViTs and the standard ResNets) and under ``ssl_vit`` what ``load_backbone(DIR)`` needs, with
the normalisation, method, encoder, recipe, run info and evaluation results."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

from ssl_vit.backbones import ResNetBackbone, VisionTransformer, eval_mode
from ssl_vit.backbones.compile import eager
from ssl_vit.backbones.vit import PatchEmbed
from ssl_vit.export.load import BackboneSource, chosen_encoder, resolve, resolve_normalization
from ssl_vit.export.traced import FILES, check_parity, write_traced
from ssl_vit.io import atomic_write, atomic_write_json, read_json, staging_dir

FORMATS = ("safetensors", *FILES)
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"
# (width, depth, heads) -> the ViT size of timm's entry points of that shape (ViT paper Table 1, DeiT-Ti).
TIMM_VIT_SIZES = {(192, 12, 3): "tiny", (384, 12, 6): "small", (768, 12, 12): "base", (1024, 24, 16): "large", (1280, 32, 16): "huge"}


def is_plain_vit(model: nn.Module) -> bool:
    """Our ViT itself (a subclass may add layers) with a plain patch embedding: what timm builds."""
    return type(model) is VisionTransformer and isinstance(model.patch_embed, PatchEmbed)


def timm_architecture(model: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """``(timm model name, model_args)`` that build the same network in timm, or None. A plain ViT is
    named after timm's entry point of its shape, ``vit_<size>_patch<P>_<image size>``, when timm
    registers it, else its size's first (``vit_huge_patch14_224`` for a ViT-H/16) or ViT-B/16's:
    ``model_args`` carry the shape, timm builds any from there."""
    if is_plain_vit(model):
        hidden, dim, (h, w) = model.blocks[0].mlp.fc1.out_features, model.embed_dim, model.img_size
        args: dict[str, Any] = {
            "img_size": list(model.img_size), "patch_size": model.patch_size, "in_chans": model.in_chans, "embed_dim": dim,
            "depth": model.depth, "num_heads": model.num_heads,
            # timm builds int(dim * ratio) hidden units, which hidden / dim can miss by one; half a unit above cannot
            "mlp_ratio": hidden / dim if int(dim * (hidden / dim)) == hidden else (hidden + 0.5) / dim,
            "qkv_bias": model.blocks[0].attn.qkv.bias is not None, "class_token": True, "global_pool": model.global_pool,
        }
        if model.global_pool == "avg":  # ours averages after the final norm; timm's fc_norm would normalise after pooling
            args["fc_norm"] = False
        size = TIMM_VIT_SIZES.get((dim, model.depth, model.num_heads))
        name = f"vit_{size}_patch{model.patch_size}_{h}"
        if size is None or h != w or not timm.is_model(name):
            name = "vit_huge_patch14_224" if size == "huge" else f"vit_{size or 'base'}_patch16_224"
        return name, args
    if isinstance(model, ResNetBackbone) and not model.small_input and model.num_stages == 4 and not getattr(model, "backbone_kwargs", {}).get("layers"):
        return model.arch, {"in_chans": model.in_chans}  # timm's ResNets share torchvision's names
    return None


def _results_in(folder: Path) -> list[Path]:
    """The JSON files below ``folder``, less those hidden below it (``.ipynb_checkpoints``)."""
    return [p for p in sorted(folder.rglob("*.json")) if not any(part.startswith(".") for part in p.relative_to(folder).parts)]


def collect_results(source: BackboneSource, extra: list[str | Path] = ()) -> list[dict[str, Any]]:
    """Evaluation results (JSON objects with ``metrics``) of these weights: those the source carries
    (an export), those of the run folder of a checkpoint in ``<run>/checkpoints/`` and ``extra``
    files or folders. Left out: what is no result, results of the run's earlier checkpoints (other
    ``pretrain.steps``) and of another encoder; a file named in ``extra`` is refused instead."""
    exported = chosen_encoder(vars(source))
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
            backbone = result.get("backbone")
            encoder = backbone.get("encoder") if isinstance(backbone, dict) else exported  # (a bare {"metrics"} file: kept)
            if encoder != exported:
                raise ValueError(f"{path}: a result of the {encoder or 'default'} encoder of its checkpoint; this export is of the "
                                 f"{exported or 'default'} one ({source.which})")
        except ValueError:
            if named:
                raise
            continue
        steps = (result.get("pretrain") or {}).get("steps")
        if path not in own_run or None in (step, steps) or steps == step:  # (else: of an earlier checkpoint of the run)
            results.append({**result, "file": str(path)})
            seen.add(str(path))
    return results


def _classifier(model: nn.Module) -> str:
    return "head" if isinstance(model, VisionTransformer) else "fc"  # timm's name; torchvision's for ResNets


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def build_config(model: nn.Module, source: BackboneSource, results: list[dict[str, Any]], files: list[Path],
                 parity: dict[str, float], num_classes: int = 0) -> dict[str, Any]:
    """``config.json`` (module docstring); ``num_classes`` > 0: ``model.safetensors`` holds a classifier."""
    from ssl_vit import __version__

    norm = resolve_normalization(source.normalization, int(model.in_chans))
    img_size = [int(s) for s in model.img_size]
    input_size = [int(model.in_chans), *img_size]
    first_conv = "patch_embed.proj" if is_plain_vit(model) else "conv1" if isinstance(model, ResNetBackbone) else None
    # whose parameter names the weights use (a hybrid's and a ViT subclass's are no library's)
    weights_format = "timm" if is_plain_vit(model) else "torchvision" if isinstance(model, ResNetBackbone) else "ssl_vit"
    arch = timm_architecture(model)
    return {
        **({"architecture": arch[0], "model_args": arch[1]} if arch else {}),
        "num_classes": num_classes, "num_features": int(model.embed_dim), "global_pool": getattr(model, "global_pool", "avg"),
        # timm's preprocessing keys: resolve_data_config + create_transform then evaluate as ssl_vit does
        "pretrained_cfg": {"input_size": input_size, "mean": norm["mean"], "std": norm["std"], "num_classes": num_classes,
                           "crop_pct": float((source.data or {}).get("eval_crop_pct") or 0.875), "crop_mode": "center",
                           "interpolation": "bicubic",
                           **({"first_conv": first_conv} if first_conv else {}), "classifier": _classifier(model),
                           "fixed_input_size": isinstance(model, VisionTransformer)},
        "mean": norm["mean"], "std": norm["std"], "input_size": input_size,  # (for a reader)
        "ssl_vit": {
            "format_version": 1, "backbone": source.backbone, "backbone_kwargs": source.backbone_kwargs,
            "weights_format": weights_format, "img_size": img_size, "in_chans": int(model.in_chans),
            "patch_size": getattr(model, "patch_size", None), "embed_dim": int(model.embed_dim), "normalization": norm,
            "method": source.method, "which": source.which, "default_which": source.default_which, "source": source.path, "origin": source.origin,
            "training": source.training, "data": source.data, "recipe": source.recipe, "results": results,
            "files": {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size, **({"max_abs_diff": parity[p.name]} if p.name in parity else {})}
                      for p in files},
            "ssl_vit_version": __version__,
        },
    }


@dataclass
class ExportResult:
    """What :func:`save_backbone` wrote; ``parity``: each file's max abs difference from the eager outputs."""

    out_dir: Path
    files: list[Path]
    parity: dict[str, float]
    config: dict[str, Any] = field(repr=False)


def save_backbone(model: nn.Module, out_dir: str | Path, source: BackboneSource | None = None, formats: Sequence[str] = ("safetensors",),
                  results: Sequence[str | Path] = (), tolerance: float = 1e-4, opset: int | None = None, head: nn.Linear | None = None,
                  ) -> ExportResult:
    """Export a backbone made by ``create_backbone`` into ``out_dir`` (created; an earlier export
    there is replaced), keeping its train/eval mode: one on another device is exported as a CPU copy,
    one compiled by ``compile_backbone`` traced through its eager modules.

    ``source``: where the weights came from (None: the architecture alone). ``formats``: of
    :data:`FORMATS`; ``results``: result JSONs (files, folders) for ``config.json``; ``tolerance``:
    the max abs difference from the eager outputs a file may show. ``head``: a (fine-tuned)
    classifier stored under timm's name for it (``head.*``; ResNets ``fc.*``) so that timm builds the
    classifier whole; the backbone loaders leave it out, the traced copies are the backbone's.
    """
    if unknown := sorted(set(formats) - set(FORMATS)):
        raise ValueError(f"formats: no format {', '.join(map(repr, unknown))}; the formats: {', '.join(FORMATS)}")
    if "onnx" in formats and (missing := [m for m in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]):
        raise ValueError(f"ONNX export needs {', '.join(missing)}: pip install 'ssl_vit[onnx]'")
    if head is not None and head.in_features != int(model.embed_dim):
        raise ValueError(f"the head takes {head.in_features} features; the backbone gives {int(model.embed_dim)}")
    source = source or BackboneSource({}, model.backbone_name, dict(model.backbone_kwargs), "memory", "memory")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: exists and is not a directory; --out must name a folder")
    created = [p for p in (out_dir, *out_dir.parents) if not p.exists()]  # innermost first
    try:
        with eager(model), eval_mode(model) as device:
            cpu_model = model if device.type == "cpu" else copy.deepcopy(model).cpu()  # (onnxruntime checks on the CPU)
            return _write(cpu_model, out_dir, source, formats, results, tolerance, opset, head)
    except BaseException:
        if created:  # the export's own folder, then each parent it made while empty (another process may write there)
            shutil.rmtree(created[0], ignore_errors=True)
            for folder in created[1:]:
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise


def _write(model: nn.Module, out_dir: Path, source: BackboneSource, formats: Sequence[str], results: Sequence[str | Path],
           tolerance: float, opset: int | None, head: nn.Linear | None) -> ExportResult:
    # An earlier export's config.json goes first: until the new one is written, load_backbone refuses the folder.
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).unlink(missing_ok=True)

    # 1. the weights, and proof that they rebuild the same function from name and kwargs alone
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if head is not None:  # timm's and torchvision's classifiers have a bias: a head without one stores zeros
        bias = head.bias if head.bias is not None else torch.zeros(head.out_features, dtype=head.weight.dtype)
        state |= {f"{_classifier(model)}.weight": head.weight.detach().cpu(), f"{_classifier(model)}.bias": bias.detach().cpu()}
    data = safetensors_bytes(state, metadata={"format": "pt"})  # (the metadata timm's and Hugging Face's loaders expect)
    weights = atomic_write(out_dir / WEIGHTS_FILE, lambda tmp: tmp.write_bytes(data))
    parity: dict[str, float] = {}
    try:  # (the loader leaves the classifier out; config.json is gone: the file is read as a bare state dict)
        rebuilt, _ = resolve(weights, backbone=source.backbone, backbone_kwargs=source.backbone_kwargs)
        parity[WEIGHTS_FILE] = check_parity(rebuilt, model, f"weights {WEIGHTS_FILE}", tolerance)
    except BaseException:
        weights.unlink()
        raise
    written = [weights]

    # 2. traced copies, checked in a staging folder before they are moved in (an earlier export's are stale)
    for name in (*FILES.values(), FILES["onnx"] + ".data"):
        (out_dir / name).unlink(missing_ok=True)
    if traced := [f for f in FILES if f in formats]:
        with staging_dir(out_dir) as stage:
            for fmt in traced:
                parity[FILES[fmt]] = write_traced(fmt, model, stage, tolerance, opset)
            written += [out_dir / f.name for f in sorted(stage.iterdir())]  # (with ONNX's side file, if any)

    # 3. config.json last
    config = build_config(model, source, collect_results(source, list(results)), written, parity, head.out_features if head else 0)
    written.append(atomic_write_json(out_dir / CONFIG_FILE, config))
    return ExportResult(out_dir, written, parity, config)


def export_backbone(spec: str | Path, out_dir: str | Path, *, which: str | None = None, formats: Sequence[str] = ("safetensors",),
                    results: Sequence[str | Path] = (), backbone: str | None = None, backbone_kwargs: dict[str, Any] | None = None,
                    tolerance: float = 1e-4, opset: int | None = None, weights_only: bool | None = None) -> ExportResult:
    """The backbone of a checkpoint (or of anything :func:`load_any_backbone` reads) as an export
    folder; heads, probe and the other encoder are left behind.

    Example::

        export_backbone("runs/dino/checkpoints/last.ckpt", "exports/dino", formats=["onnx"])  # the teacher
        export_backbone("runs/dino/checkpoints/last.ckpt", "exports/dino_student", which="student")
    """
    model, source = resolve(spec, "cpu", which, backbone, backbone_kwargs, 0, weights_only)
    return save_backbone(model, out_dir, source, formats, results, tolerance, opset)
