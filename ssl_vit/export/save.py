"""Write an export folder: ``model.safetensors`` (always), the traced copies asked for, and
``config.json`` last (a folder with one is a complete export). Every file is written atomically and
checked against the eager backbone before it appears; a refused export leaves no file behind, and
no folder of its own."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

from ssl_vit.backbones.compile import eager
from ssl_vit.export.config import build_config, classifier_name, collect_results
from ssl_vit.export.foreign import fit_state_dict
from ssl_vit.export.load import instantiate, resolve
from ssl_vit.export.sources import BackboneSource, read_safetensors
from ssl_vit.export.traced import (
    FILES,
    ExportParityError,
    check_parity,
    example_input,
    write_traced,
)
from ssl_vit.io import atomic_write, atomic_write_json, staging_dir

FORMATS = ("safetensors", *FILES)
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"


@dataclass
class ExportResult:
    """What :func:`save_backbone` wrote: the folder, the files, each file's max abs difference from
    the eager backbone's outputs, and the config."""

    out_dir: Path
    files: list[Path]
    parity: dict[str, float]
    config: dict[str, Any] = field(repr=False)


def save_backbone(model: nn.Module, out_dir: str | Path, source: BackboneSource | None = None, formats: Sequence[str] = ("safetensors",),
                  results: Sequence[str | Path] = (), tolerance: float = 1e-4, opset: int | None = None, head: nn.Linear | None = None,
                  ) -> ExportResult:
    """Export an in-memory backbone.

    Args:
        model: a backbone made by ``create_backbone``; its train/eval mode is kept, a CPU copy of it
            exported from another device, and one compiled by ``compile_backbone`` traced through its
            eager modules (TorchScript and ONNX refuse a dynamo-compiled function).
        out_dir: the export folder (created; an earlier export there is replaced).
        source: where the weights came from (method, normalisation, run info ...); None records
            only the architecture.
        formats: ``safetensors`` is always written; ``torchscript`` (``model.torchscript.pt``),
            ``export`` (``torch.export``'s ``model.pt2``) and ``onnx`` (``model.onnx``) on request.
        results: evaluation result JSONs (files or folders) to record in ``config.json``.
        tolerance: the max abs difference from the eager outputs each file may show.
        opset: the ONNX opset (None: the exporter's default).
        head: a classifier on the features (a fine-tuned one), stored in ``model.safetensors``
            under timm's name for it (``head.*`` for ViTs and hybrids, ``fc.*`` for ResNets) with
            ``num_classes`` in ``config.json``: timm then builds the whole classifier. The backbone
            loaders leave it out; the traced files are the backbone's.
    """
    if unknown := sorted(set(formats) - set(FORMATS)):
        raise ValueError(f"unknown export format(s) {unknown}; choose from {', '.join(FORMATS)}")
    if "onnx" in formats and (missing := [m for m in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]):
        raise ValueError(f"ONNX export needs {', '.join(missing)}: pip install 'ssl_vit[onnx]'")
    if head is not None and head.in_features != int(model.embed_dim):
        raise ValueError(f"the head takes {head.in_features} features; the backbone gives {int(model.embed_dim)}")
    source = source or BackboneSource({}, model.backbone_name, dict(model.backbone_kwargs), "memory", "memory")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: exists and is not a directory; --out must name a folder")
    created = [p for p in (out_dir, *out_dir.parents) if not p.exists()]  # innermost first
    was_training = model.training
    try:
        with eager(model):
            on_cpu = all(t.device.type == "cpu" for t in model.state_dict().values())  # (onnxruntime checks on the CPU)
            return _write((model if on_cpu else copy.deepcopy(model).cpu()).eval(), out_dir, source, formats, results, tolerance, opset, head)
    except BaseException:
        if created:  # the export's own folder, then each parent it made while empty (another process may write there)
            shutil.rmtree(created[0], ignore_errors=True)
            for folder in created[1:]:
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise
    finally:
        model.train(was_training)


def _write(model: nn.Module, out_dir: Path, source: BackboneSource, formats: Sequence[str], results: Sequence[str | Path],
           tolerance: float, opset: int | None, head: nn.Linear | None) -> ExportResult:
    # An earlier export's config.json goes first: until the new one is written, the folder is no
    # complete export (load_backbone refuses it rather than mixing old and new files).
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).unlink(missing_ok=True)

    # 1. the weights, and proof that they rebuild the same function from name and kwargs alone
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if head is not None:  # timm's and torchvision's classifiers have a bias: a head without one stores zeros
        bias = head.bias if head.bias is not None else torch.zeros(head.out_features, dtype=head.weight.dtype)
        state |= {f"{classifier_name(model)}.weight": head.weight.detach().cpu(), f"{classifier_name(model)}.bias": bias.detach().cpu()}
    data = safetensors_bytes(state, metadata={"format": "pt"})  # (the metadata timm's and Hugging Face's loaders expect)
    weights = atomic_write(out_dir / WEIGHTS_FILE, lambda tmp: tmp.write_bytes(data))
    # (fit_state_dict leaves the classifier out, as the backbone loaders do)
    rebuilt = instantiate(source.backbone, source.backbone_kwargs, str(weights), lambda m: fit_state_dict(read_safetensors(weights), m))
    parity: dict[str, float] = {}
    try:
        parity[WEIGHTS_FILE] = check_parity(rebuilt.eval(), model, example_input(model, 2), f"weights {WEIGHTS_FILE}", tolerance)
    except ExportParityError:
        weights.unlink()
        raise
    written = [weights]

    # 2. traced copies, checked in a staging folder before they are moved in; an earlier export's
    # would no longer match the weights
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
