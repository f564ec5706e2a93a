"""A backbone from anything that holds one. A pretraining checkpoint (``ssl-vit fit``'s ``.ckpt``)
holds each module of its method under its attribute name: ``backbone.*`` (the online backbone),
``teacher_backbone.*`` (DINO), ``momentum_backbone.*`` (MoCo v3), heads, probe, and its run info
(``ssl_vit``). An export folder holds one backbone and ``config.json``. Anything else is a bare
state dict whose architecture the caller names, or ``random:<name>``, the random initialisation."""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor, nn

from ssl_vit.backbones import create_backbone
from ssl_vit.errors import one_line
from ssl_vit.export import foreign
from ssl_vit.io import read_json

EXPECTED = ("a pretraining checkpoint (.ckpt written by `ssl-vit fit`), an export directory "
            "(config.json + model.safetensors) or a state dict (.safetensors / .pt / .pth)")
# DINO is evaluated with its teacher (Caron et al. 2021 §3.1: "the teacher has better performance
# than the student"; reference eval_linear.py / eval_knn.py default --checkpoint_key teacher).
# MoCo v3 keeps the base encoder (reference convert_to_deit.py takes module.base_encoder).
DEFAULT_WHICH = {"dino": "teacher"}
# What tells the method of a checkpoint without run info.
_METHOD_MARKERS = {"teacher_backbone.": "dino", "momentum_backbone.": "mocov3", "mask_token": "mpp", "classifier.": "supervised"}
# Run-info fields with a place of their own in config.json; the others describe the training run.
RECORD_FIELDS = ("method", "backbone", "backbone_kwargs", "data", "recipe", "default_encoder")
RANDOM_PREFIX = "random:"


def normalize_which(which: str | None) -> str | None:
    """An encoder: ``student`` (the online backbone of any method; ``online`` and ``base`` say the
    same), ``teacher``, ``momentum`` or a method's own ``NAME``, as :func:`encoder_prefix` finds it."""
    which = {"online": "student", "base": "student"}.get(which or "", which)
    if which is not None and not re.fullmatch(r"[a-z][a-z0-9_]*", which):
        raise ValueError(f"which must be one of student, teacher, momentum or the NAME of a method's NAME_backbone, got {which!r}")
    return which


def encoder_prefix(which: str) -> str:
    """An encoder's prefix in a checkpoint's state dict: the module's attribute name."""
    return "backbone." if which == "student" else f"{which}_backbone."


def encoders_in(keys: list[str]) -> list[str]:
    """The encoders state-dict keys hold: ``student`` first, then each ``NAME`` of ``NAME_backbone.*``."""
    names = {m.group(1) for k in keys if (m := re.match(r"([a-z][a-z0-9_]*)_backbone\.", k))}
    return ["student"] * any(k.startswith("backbone.") for k in keys) + sorted(names)


def chosen_encoder(info: Mapping[str, Any]) -> str | None:
    """The encoder a source gave (``which``) when it is not the one its method is evaluated with
    by default (DINO's student, MoCo v3's momentum encoder), else None."""
    which, default = info.get("which"), info.get("default_which") or DEFAULT_WHICH.get(info.get("method") or "", "student")
    return which if which and which != default else None


@dataclass
class BackboneSource:
    """One backbone's weights and what is known about them."""

    weights: Mapping[str, Any]  # the state dict; a foreign file's whole object (kind state_dict), for filter_foreign_state_dict
    backbone: str | None  # the registry name and kwargs (None: the file does not say)
    backbone_kwargs: dict[str, Any]
    path: str  # where the weights came from ("random" for a random initialisation)
    kind: str  # lightning, export, state_dict or random
    method: str | None = None  # dino, mocov3, mpp, supervised, random
    which: str | None = None  # the encoder taken
    default_which: str | None = None  # the encoder the method is evaluated with
    origin: str | None = None  # the file first read (an export keeps its checkpoint's): one pretraining, whichever copy
    normalization: dict[str, Any] | None = None  # {"mean", "std", "source"} when recorded
    training: dict[str, Any] = field(default_factory=dict)  # the run info's other fields (global_step, epochs, pretrain_flops ...)
    data: dict[str, Any] | None = None  # the data record
    recipe: str | None = None  # the resolved YAML
    results: list[dict[str, Any]] = field(default_factory=list)  # those an export carries


def _kind(path: Path) -> str:
    """``torch`` (a zip archive, or a legacy pickle), else what the first bytes say the file is."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    # safetensors: a little-endian u64 header length below the file size, then its JSON header
    if len(head) > 8 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size:
        return "a safetensors file"
    if not head:
        return "an empty file"
    text = head.decode("utf-8", errors="replace")
    return "a text file" if "\x00" not in text and "\ufffd" not in text else "not a PyTorch file"


def read_torch_file(path: Path, weights_only: bool | None = None) -> Any:
    """``torch.load`` with one-line errors. ``weights_only=None`` tries the safe loader first and
    unpickles fully (warning) only a file holding Python objects besides tensors, as some official
    checkpoints do (argparse namespaces); ``True`` refuses such a file."""
    if (kind := _kind(path)) != "torch":
        raise ValueError(f"{path}: {kind}; expected {EXPECTED}")
    try:
        if weights_only is not False:
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a cut file fails anywhere in the loader (EOFError, struct.error ...)
        if not (isinstance(err, pickle.UnpicklingError) and "weights only" in str(err).lower()):
            raise ValueError(f"{path}: cannot be read as a PyTorch file, probably truncated or corrupt ({one_line(str(err))}); "
                             f"expected {EXPECTED}") from None
        if weights_only:
            raise ValueError(f"{path}: holds Python objects besides tensors, which weights_only=True refuses to unpickle "
                             "(load it with weights_only=False if you trust the file)") from None
        warnings.warn(f"{path} holds Python objects besides tensors; loading it with full unpickling "
                      "(weights_only=False). Only do this with files you trust.", stacklevel=3)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # missing modules, corrupt data ...
        raise ValueError(f"{path}: cannot be unpickled ({one_line(str(err))}); expected {EXPECTED}") from None


def read_safetensors(path: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable safetensors file, probably truncated or corrupt ({one_line(str(err))})") from None


def _has_tensors(obj: Mapping[str, Any], depth: int = 2) -> bool:
    return any(isinstance(v, Tensor) or (depth and isinstance(v, Mapping) and _has_tensors(v, depth - 1)) for v in obj.values())


def read_source(path: str | Path, which: str | None = None, weights_only: bool | None = None) -> BackboneSource:
    """Read any weight file or export folder (see the module docstring)."""
    path, which = Path(path), normalize_which(which)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory; expected {EXPECTED}")
    config = path.parent / "config.json"  # model.safetensors of an export, given as a file
    if path.is_dir() or (path.name == "model.safetensors" and config.is_file() and isinstance(c := read_json(config), dict) and "ssl_vit" in c):
        return _from_export_dir(path if path.is_dir() else path.parent)
    if _kind(path) == "a safetensors file":
        obj: Any = read_safetensors(path)
    else:
        obj = read_torch_file(path, weights_only)
        if isinstance(obj, dict) and isinstance(obj.get("state_dict"), Mapping) and ("pytorch-lightning_version" in obj or "ssl_vit" in obj):
            return _from_lightning(obj, path, which)
        if not isinstance(obj, Mapping):
            raise ValueError(f"{path}: holds a {type(obj).__name__}, not a checkpoint or state dict; expected {EXPECTED}")
        if not _has_tensors(obj):
            raise ValueError(f"{path}: a dict without any weights (keys {sorted(map(str, obj))[:8]}); expected {EXPECTED}")
    return BackboneSource(obj, None, {}, str(path), "state_dict", which=which or foreign.default_encoder(obj), origin=str(path.resolve()))


def _from_lightning(ckpt: dict[str, Any], path: Path, which: str | None) -> BackboneSource:
    record = ckpt.get("ssl_vit") if isinstance(ckpt.get("ssl_vit"), dict) else {}
    hparams = ckpt.get("hyper_parameters") if isinstance(ckpt.get("hyper_parameters"), Mapping) else {}
    state = ckpt["state_dict"]
    present = encoders_in(list(state))
    if not record and not present:
        raise ValueError(f"{path}: a Lightning checkpoint, but not of an ssl_vit pretext module (no 'ssl_vit' record, "
                         "no 'backbone.*' weights); expected a checkpoint written by `ssl-vit fit`")
    method = record.get("method")
    method = method.lower() if isinstance(method, str) and method else next(
        (m for marker, m in _METHOD_MARKERS.items() if any(k.startswith(marker) for k in state)), None)
    # the method's own default encoder (recorded: a subclass of DINO keeps the teacher), else by its name
    default = record.get("default_encoder") or DEFAULT_WHICH.get(method or "", "student")
    which = which or default
    prefix = encoder_prefix(which)
    weights = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not weights:
        raise ValueError(f"{path}: this {method or 'ssl_vit'} checkpoint has no {which} backbone ({prefix}* weights); "
                         f"it holds: {', '.join(present) or 'none'} (choose with which= / --which)")
    data = record.get("data") if isinstance(record.get("data"), dict) else None
    training = {k: v for k, v in record.items() if k not in RECORD_FIELDS}
    for key in ("global_step", "epoch", "pretrain_flops"):  # Lightning's, and PretrainFlopsCounter's at the top level too
        if training.get(key) is None:
            training[key] = ckpt.get(key)
    kwargs = record["backbone_kwargs"] if "backbone_kwargs" in record else hparams.get("backbone_kwargs")
    return BackboneSource(weights, record.get("backbone") or hparams.get("backbone"), dict(kwargs or {}), str(path), "lightning",
                          method=method, which=which, default_which=default, origin=str(path.resolve()), normalization=recorded_normalization(data, state),
                          training={k: v for k, v in training.items() if v is not None}, data=data, recipe=record.get("recipe"))


def recorded_normalization(data: dict[str, Any] | None, state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The input normalisation the backbone was trained with: the datamodule's statistics, else
    MPP's ``norm_mean`` / ``norm_std`` buffers (its ``mean`` / ``std`` arguments)."""
    if data and data.get("mean") is not None and data.get("std") is not None:
        how = f": {data['stats_source']}" if data.get("stats_source") else ""
        return {"mean": list(data["mean"]), "std": list(data["std"]), "source": f"training data ({data.get('name', 'unnamed')}){how}"}
    mean, std = state.get("norm_mean"), state.get("norm_std")
    if isinstance(mean, Tensor) and isinstance(std, Tensor) and mean.numel() and std.numel():
        return {"mean": mean.tolist(), "std": std.tolist(), "source": "MPP mean/std arguments"}
    return None


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


def _from_export_dir(folder: Path) -> BackboneSource:
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}: not an export directory, {name} is missing; expected {EXPECTED}")
    config = read_json(folder / "config.json")
    info = config.get("ssl_vit") if isinstance(config, dict) else None
    if not isinstance(info, dict) or not isinstance(info.get("backbone"), str):
        raise ValueError(f"{folder / 'config.json'}: no 'ssl_vit' section naming the backbone; expected a config.json written by "
                         "`ssl-vit export` (to load other weights, pass the weights file and backbone=)")
    recorded = {k: info.get(k) for k in ("method", "which", "default_which", "normalization", "data", "recipe")}
    return BackboneSource(read_safetensors(folder / "model.safetensors"), info["backbone"], dict(info.get("backbone_kwargs") or {}),
                          str(folder), "export", origin=info.get("origin") or str(folder.resolve()),
                          training=dict(info.get("training") or {}), results=list(info.get("results") or []), **recorded)


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
    # caller kwargs override recorded ones (another resolution: the position table is resampled from the recorded grid)
    name, recorded = source.backbone, source.backbone_kwargs
    source.backbone, source.backbone_kwargs = name or backbone, {**recorded, **(backbone_kwargs or {})}
    with torch.device("meta"):  # no random initialisation to replace
        model = create_backbone(source.backbone, **source.backbone_kwargs)
        grid = getattr(create_backbone(name, **recorded), "grid_size", None) if name else None  # (need not be square)
    try:
        state = (foreign.filter_foreign_state_dict(source.weights, model, which=source.which) if source.kind == "state_dict"
                 else foreign.fit_state_dict(source.weights, model, grid))
    except ValueError as err:
        raise ValueError(f"{source.path}: {err}") from None
    foreign.load_weights(model, state, source.path, assign=True)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):  # (a non-persistent buffer, an old file's BatchNorm counters)
        model = foreign.load_weights(create_backbone(source.backbone, **source.backbone_kwargs), state, source.path)
    return model.to(map_location).eval(), source


def source_info(source: BackboneSource, model: nn.Module) -> dict[str, Any]:
    """What evaluations and figures need to know about a loaded backbone; ``pretrain`` is what
    ``EvalResult.pretrain`` records (``checkpoint``: one pretraining, whichever copy is evaluated)."""
    norm = resolve_normalization(source.normalization, int(model.in_chans))
    t = source.training
    pretrain = {"steps": t.get("global_step"), "epochs": t.get("epochs"), "flops": t.get("pretrain_flops"),
                "wall_time_s": t.get("wall_time_s"), "global_batch_size": t.get("global_batch_size"),
                "data": source.data, "checkpoint": source.origin}
    return {"name": source.backbone, "kwargs": dict(source.backbone_kwargs), "mean": norm["mean"], "std": norm["std"],
            "normalization_source": norm["source"], "method": source.method, "which": source.which, "default_which": source.default_which,
            "source": source.path if source.kind == "random" else str(Path(source.path).resolve()),  # (one checkpoint however typed)
            "kind": source.kind, "data": source.data, "recipe": source.recipe, "pretrain": {k: v for k, v in pretrain.items() if v is not None}}


def load_any_backbone(spec: str | Path, map_location: Any = "cpu", *, which: str | None = None, backbone: str | None = None,
                      backbone_kwargs: dict[str, Any] | None = None, seed: int | None = 0, weights_only: bool | None = None,
                      ) -> tuple[nn.Module, dict[str, Any]]:
    """A backbone (eval mode) and an info dict from an export folder, a pretraining checkpoint
    (``which``: ``teacher`` / ``student`` / ``momentum`` / a method's own ``NAME``; by default DINO's
    teacher, else the online backbone), a bare state dict (ours, timm's, an official DINO / MoCo v3
    one) with ``backbone`` and ``backbone_kwargs`` naming the architecture, or ``random:<name>``
    (``seed``; None: the global generator). ``backbone_kwargs`` override recorded ones (another
    ``img_size``: the position table is resampled); ``weights_only``: :func:`read_torch_file`'s.
    The info dict: :func:`source_info`.

    Example::

        vit, info = load_any_backbone("runs/dino/checkpoints/last.ckpt")
        base, _ = load_any_backbone("random:vit_tiny", backbone_kwargs={"img_size": 28, "patch_size": 4, "in_chans": 1})
    """
    model, source = resolve(spec, map_location, which, backbone, backbone_kwargs, seed, weights_only)
    return model, source_info(source, model)


def load_backbone(path: str | Path, map_location: Any = "cpu", *, which: str | None = None, backbone: str | None = None,
                  backbone_kwargs: dict[str, Any] | None = None, weights_only: bool | None = None) -> nn.Module:
    """The backbone stored at ``path`` in eval mode (:func:`load_any_backbone`, no ``random:``):
    ``ssl_vit.load_backbone("exports/dino_vit_tiny")(images)`` gives features ``[B, D]``."""
    if str(path) == "random" or str(path).startswith(RANDOM_PREFIX):
        raise ValueError(f"load_backbone reads weights from a path; for {str(path)!r} use load_any_backbone")
    return resolve(path, map_location, which, backbone, backbone_kwargs, None, weights_only)[0]
