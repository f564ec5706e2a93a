"""Write an export folder: ``model.safetensors`` (always), ``config.json`` (always, last), and
optionally ``model.torchscript.pt`` / ``model.onnx``. Every file is written atomically and checked
against the eager backbone before it appears."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssl_vit.backbones.compile import eager
from ssl_vit.export.config import (
    build_config,
    classifier_name,
    collect_results,
    file_record,
    resolve_normalization,
)
from ssl_vit.export.files import (
    atomic_write_json,
    publish,
    read_safetensors,
    save_safetensors,
    staging_dir,
)
from ssl_vit.export.foreign import fit_state_dict
from ssl_vit.export.load import instantiate, resolve
from ssl_vit.export.sources import BackboneSource
from ssl_vit.export.traced import (
    EXPORTED_FILE,
    ONNX_FILE,
    TORCHSCRIPT_FILE,
    ExportParityError,
    check_parity,
    example_input,
    write_exported_program,
    write_onnx,
    write_torchscript,
)

FORMATS: tuple[str, ...] = ("safetensors", "torchscript", "export", "onnx")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Files an earlier export may have left that would no longer match the new weights.
_ARTIFACTS = (TORCHSCRIPT_FILE, EXPORTED_FILE, ONNX_FILE, ONNX_FILE + ".data")


@dataclass
class ExportResult:
    """What :func:`save_backbone` wrote: the folder, the files, the max abs difference of each
    file's outputs from the eager backbone's, and the config."""

    out_dir: Path
    files: list[Path]
    parity: dict[str, float]
    config: dict[str, Any] = field(repr=False)


def _source_of(model: nn.Module) -> BackboneSource:
    name = getattr(model, "backbone_name", None)
    if name is None:
        raise ValueError("save_backbone needs a backbone built by create_backbone (it records backbone_name and backbone_kwargs)")
    return BackboneSource({}, name, dict(getattr(model, "backbone_kwargs", {})), "memory", "memory")


def save_backbone(
    model: nn.Module,
    out_dir: str | Path,
    source: BackboneSource | None = None,
    formats: Sequence[str] = ("safetensors",),
    results: Sequence[str | Path] = (),
    tolerance: float = 1e-4,
    opset: int | None = None,
    head: nn.Linear | None = None,
) -> ExportResult:
    """Export an in-memory backbone.

    Args:
        model: a backbone made by ``create_backbone`` (its train/eval mode is restored; a CPU
            copy is exported when it lives on another device).
        out_dir: the export folder (created; files of an earlier export are replaced).
        source: where the weights came from (method, normalisation, training record ...);
            ``None`` records only the architecture.
        formats: ``safetensors`` is always written; add ``torchscript`` (``model.torchscript.pt``),
            ``export`` (``torch.export``'s ``model.pt2``) and/or ``onnx``.
        results: evaluation result JSONs (files or folders) to record in ``config.json``.
        tolerance: max abs difference from the eager outputs each written file may show.
        opset: ONNX opset (``None``: the exporter's default).
        head: a classifier on the backbone's features (a fine-tuned one), stored in
            ``model.safetensors`` under timm's name for it (``head.*`` for ViTs and hybrids,
            ``fc.*`` for ResNets) with ``num_classes`` in ``config.json``: timm then builds the
            whole classifier. The backbone loaders leave it out; the traced files are the
            backbone's.
    """
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ValueError(f"unknown export format(s) {unknown}; choose from {', '.join(FORMATS)}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if "onnx" in formats:  # before anything is written
        import importlib.util

        missing = [m for m in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"ONNX export needs {', '.join(missing)}: pip install 'ssl_vit[onnx]'")
    if head is not None and head.in_features != int(model.embed_dim):  # before an earlier export is touched
        raise ValueError(f"the head takes {head.in_features} features; the backbone gives {int(model.embed_dim)}")
    source = source or _source_of(model)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: exists and is not a directory; --out must name a folder")
    created = _missing_folders(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    on_cpu = all(t.device.type == "cpu" for t in model.state_dict().values())
    was_training = model.training
    try:
        with eager(model):  # a backbone trained with compile_backbone: traced through its eager modules
            exported = model if on_cpu else copy.deepcopy(model).cpu()  # onnxruntime checks run on CPU
            return _write(exported.eval(), out_dir, source, formats, results, tolerance, opset, head)
    except BaseException:
        _remove_created(created)  # a refused export leaves no folder of its own behind
        raise
    finally:
        model.train(was_training)  # the caller's module keeps its mode


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, innermost first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_created(created: list[Path]) -> None:
    """Remove the folders an export created (innermost first), the export's own with what it
    wrote, each parent only while it is empty (another process may have written there since)."""
    if not created:
        return
    shutil.rmtree(created[0], ignore_errors=True)
    for folder in created[1:]:
        try:
            folder.rmdir()
        except OSError:
            return


def _write(
    model: nn.Module,
    out_dir: Path,
    source: BackboneSource,
    formats: Sequence[str],
    results: Sequence[str | Path],
    tolerance: float,
    opset: int | None,
    head: nn.Linear | None = None,
) -> ExportResult:
    parity: dict[str, float] = {}
    # An earlier export's config.json goes first: until the new one is written, the folder does
    # not claim to be a complete export (load_backbone refuses it rather than mixing old and new).
    (out_dir / CONFIG_FILE).unlink(missing_ok=True)

    # 1. weights, then proof that they rebuild the same function from name + kwargs alone
    state = dict(model.state_dict())
    if head is not None:
        name = classifier_name(model)
        # timm's and torchvision's classifiers have a bias: a head without one stores zeros
        bias = head.bias.detach().cpu() if head.bias is not None else torch.zeros(head.out_features, dtype=head.weight.dtype)
        state.update({f"{name}.weight": head.weight.detach().cpu(), f"{name}.bias": bias})
    weights = save_safetensors(out_dir / WEIGHTS_FILE, state)
    # (fit_state_dict leaves the classifier out, as the backbone loaders do)
    rebuilt = instantiate(source.backbone, source.backbone_kwargs, str(weights), lambda m: fit_state_dict(read_safetensors(weights), m)).eval()
    try:
        parity[WEIGHTS_FILE] = check_parity(rebuilt, model, example_input(model, 2), f"weights {WEIGHTS_FILE}", tolerance)
    except ExportParityError:
        weights.unlink(missing_ok=True)  # the folder holds no weights that rebuild something else
        raise
    written = [weights]

    # 2. traced copies, checked in a staging folder before they are moved in
    for stale in _ARTIFACTS:
        (out_dir / stale).unlink(missing_ok=True)
    if {"torchscript", "export", "onnx"} & set(formats):
        with staging_dir(out_dir) as stage:
            if "torchscript" in formats:
                _, parity[TORCHSCRIPT_FILE] = write_torchscript(model, stage, tolerance)
            if "export" in formats:
                _, parity[EXPORTED_FILE] = write_exported_program(model, stage, tolerance)
            if "onnx" in formats:
                _, parity[ONNX_FILE] = write_onnx(model, stage, tolerance, opset)
            written += publish(stage, out_dir)

    # 3. config.json last: a folder with a config.json is a complete export
    files = {p.name: {**file_record(p), **({"max_abs_diff": parity[p.name]} if p.name in parity else {})} for p in written}
    normalization = resolve_normalization(source.normalization, int(model.in_chans))
    config = build_config(model, source, normalization, collect_results(source, list(results)), files,
                          num_classes=head.out_features if head is not None else 0)
    written.append(atomic_write_json(out_dir / CONFIG_FILE, config))
    return ExportResult(out_dir, written, parity, config)


def export_backbone(
    spec: str | Path,
    out_dir: str | Path,
    *,
    which: str | None = None,
    formats: Sequence[str] = ("safetensors",),
    results: Sequence[str | Path] = (),
    backbone: str | None = None,
    backbone_kwargs: dict[str, Any] | None = None,
    tolerance: float = 1e-4,
    opset: int | None = None,
    weights_only: bool | None = None,
) -> ExportResult:
    """Extract the backbone of a checkpoint (or anything :func:`load_any_backbone` reads) into
    an export folder; heads, probe and the other encoder are left behind.

    Example::

        export_backbone("runs/dino/checkpoints/last.ckpt", "exports/dino", formats=["onnx"])  # teacher
        export_backbone("runs/dino/checkpoints/last.ckpt", "exports/dino_student", which="student")
    """
    model, source = resolve(spec, "cpu", which, backbone, backbone_kwargs, 0, weights_only)
    return save_backbone(model, out_dir, source, formats, results, tolerance, opset)
