"""Where backbone weights come from, and what is known about them.

A pretraining checkpoint (``ssl-vit fit``'s ``.ckpt``) holds every module of its method under its
attribute name: ``backbone.*`` (the online backbone: DINO's student, MoCo v3's base encoder, MPP's
and the supervised one), ``teacher_backbone.*`` (DINO), ``momentum_backbone.*`` (MoCo v3), heads,
probe; its ``ssl_vit`` entry, the run info, names the method, the backbone and its kwargs, the data
and the recipe. An export folder holds one backbone (``model.safetensors``) and ``config.json``.
Anything else is a bare state dict whose architecture the caller names.
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ssl_vit.errors import one_line
from ssl_vit.export.foreign import default_encoder
from ssl_vit.io import read_json

EXPECTED = ("a pretraining checkpoint (.ckpt written by `ssl-vit fit`), an export directory "
            "(config.json + model.safetensors) or a state dict (.safetensors / .pt / .pth)")
# An encoder of a checkpoint -> its state-dict prefix; a method of one's own keeps another as NAME_backbone.
ENCODER_PREFIXES = {"student": "backbone.", "teacher": "teacher_backbone.", "momentum": "momentum_backbone."}
WHICH_ALIASES = {"online": "student", "base": "student"}
# DINO is evaluated with its teacher (Caron et al. 2021 §3.1: "the teacher has better performance
# than the student"; reference eval_linear.py / eval_knn.py default --checkpoint_key teacher).
# MoCo v3 keeps the base encoder (reference convert_to_deit.py takes module.base_encoder).
DEFAULT_WHICH = {"dino": "teacher"}
# What tells the method of a checkpoint without run info.
_METHOD_MARKERS = {"teacher_backbone.": "dino", "momentum_backbone.": "mocov3", "mask_token": "mpp", "classifier.": "supervised"}
# Run-info fields with a place of their own in config.json; the others describe the training run.
RECORD_FIELDS = ("method", "backbone", "backbone_kwargs", "data", "recipe", "default_encoder")


def normalize_which(which: str | None) -> str | None:
    """An encoder's name (``student``, ``teacher``, ``momentum`` or a method's own ``NAME``), aliases resolved."""
    key = WHICH_ALIASES.get(which, which) if which is not None else None
    if key is not None and key not in ENCODER_PREFIXES and not re.fullmatch(r"[a-z][a-z0-9_]*", key):
        raise ValueError(f"which must be one of {', '.join(ENCODER_PREFIXES)} or the NAME of a method's NAME_backbone, got {which!r}")
    return key


def encoder_prefix(which: str) -> str:
    return ENCODER_PREFIXES.get(which, f"{which}_backbone.")


def encoders_in(keys: list[str]) -> list[str]:
    """The encoders a checkpoint's state-dict keys hold: the three known ones first, then ``NAME``s."""
    names = {w for w, prefix in ENCODER_PREFIXES.items() if any(k.startswith(prefix) for k in keys)}
    names |= {m.group(1) for k in keys if (m := re.match(r"([a-z][a-z0-9_]*)_backbone\.", k))}
    order = list(ENCODER_PREFIXES)
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def chosen_encoder(info: Mapping[str, Any]) -> str | None:
    """The encoder a source gave (``which``) when it is not the one its method is evaluated with
    by default (DINO's student, MoCo v3's momentum encoder), else None."""
    which, method = info.get("which"), info.get("method")
    default = info.get("default_which") or DEFAULT_WHICH.get(method or "", "student")
    return which if which and which != default else None


@dataclass
class BackboneSource:
    """One backbone's weights and what is known about them.

    Attributes:
        weights: the backbone's state dict (``lightning``, ``export``), or a foreign file's raw
            object (``state_dict``) for :func:`filter_foreign_state_dict` to unwrap.
        backbone, backbone_kwargs: the registry name and kwargs (``None`` when the file does not say).
        path: where the weights came from (``"random"`` for a random initialisation).
        kind: ``lightning``, ``export``, ``state_dict`` or ``random``.
        method: the method's key (``dino``, ``mocov3``, ``mpp``, ``supervised``, ``random``).
        which: the encoder taken; ``default_which`` the one the method is evaluated with.
        origin: the absolute path of the file the weights were first read from (an export keeps
            its checkpoint's): one pretraining, whichever copy is evaluated (None: random, in memory).
        normalization: ``{"mean", "std", "source"}`` when recorded; ``training`` the run info's
            other fields (``global_step``, ``epochs``, ``pretrain_flops`` ...), ``data`` the data
            record, ``recipe`` the resolved YAML, ``results`` those an export carries.
    """

    weights: Mapping[str, Any]
    backbone: str | None
    backbone_kwargs: dict[str, Any]
    path: str
    kind: str
    method: str | None = None
    which: str | None = None
    default_which: str | None = None
    origin: str | None = None
    normalization: dict[str, Any] | None = None
    training: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] | None = None
    recipe: str | None = None
    results: list[dict[str, Any]] = field(default_factory=list)


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
    try:
        return "not a PyTorch file" if "\x00" in head.decode("utf-8") else "a text file"
    except UnicodeDecodeError:
        return "not a PyTorch file"


def read_torch_file(path: Path, weights_only: bool | None = None) -> Any:
    """``torch.load`` with one-line errors. ``weights_only=None`` tries the safe loader first and
    unpickles fully (warning) only a file holding Python objects besides tensors, as some official
    checkpoints do (argparse namespaces); ``True`` refuses such a file."""
    kind = _kind(path)
    if kind != "torch":
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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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
    return BackboneSource(obj, None, {}, str(path), "state_dict", which=which or default_encoder(obj), origin=str(path.resolve()))


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
    training.setdefault("global_step", ckpt.get("global_step"))
    training.setdefault("epoch", ckpt.get("epoch"))
    if training.get("pretrain_flops") is None:  # PretrainFlopsCounter writes it at the top level too
        training["pretrain_flops"] = ckpt.get("pretrain_flops")
    kwargs = record["backbone_kwargs"] if "backbone_kwargs" in record else hparams.get("backbone_kwargs")
    return BackboneSource(weights, record.get("backbone") or hparams.get("backbone"), dict(kwargs or {}), str(path), "lightning",
                          method=method, which=which, default_which=default, origin=str(path.resolve()), normalization=recorded_normalization(data, state),
                          training={k: v for k, v in training.items() if v is not None}, data=data, recipe=record.get("recipe"))


def recorded_normalization(data: dict[str, Any] | None, state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The input normalisation the backbone was trained with: the datamodule's statistics, else
    MPP's ``norm_mean`` / ``norm_std`` buffers (its ``mean`` / ``std`` arguments)."""
    if data and data.get("mean") is not None and data.get("std") is not None:
        return {"mean": list(data["mean"]), "std": list(data["std"]), "source": f"training data ({data.get('name', 'unnamed')})"}
    mean, std = state.get("norm_mean"), state.get("norm_std")
    if isinstance(mean, Tensor) and isinstance(std, Tensor) and mean.numel() and std.numel():
        return {"mean": mean.tolist(), "std": std.tolist(), "source": "MPP mean/std arguments"}
    return None


def _from_export_dir(folder: Path) -> BackboneSource:
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}: not an export directory, {name} is missing; expected {EXPECTED}")
    config = read_json(folder / "config.json")
    info = config.get("ssl_vit") if isinstance(config, dict) else None
    if not isinstance(info, dict) or not isinstance(info.get("backbone"), str):
        raise ValueError(f"{folder / 'config.json'}: no 'ssl_vit' section naming the backbone; expected a config.json written by "
                         "`ssl-vit export` (to load other weights, pass the weights file and backbone=)")
    return BackboneSource(read_safetensors(folder / "model.safetensors"), info["backbone"], dict(info.get("backbone_kwargs") or {}),
                          str(folder), "export", method=info.get("method"), which=info.get("which"),
                          default_which=info.get("default_which"), origin=info.get("origin"), normalization=info.get("normalization"),
                          training=dict(info.get("training") or {}), data=info.get("data"), recipe=info.get("recipe"),
                          results=list(info.get("results") or []))
