"""Where backbone weights come from, and what is known about them.

A pretraining checkpoint (Lightning ``.ckpt`` written by ``ssl-vit fit``) holds the weights of
every module of its method under the module's attribute name: ``backbone.*`` (the online
backbone: DINO's student, MoCo v3's base encoder, the MPP / supervised backbone),
``teacher_backbone.*`` (DINO), ``momentum_backbone.*`` (MoCo v3), heads, probe. Its ``ssl_vit``
record names the method, the backbone and its kwargs, the data normalisation and the recipe.
An export directory holds one backbone (``model.safetensors``) and a ``config.json``. Anything
else is a bare state dict whose architecture the caller names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from ssl_vit.export.files import (
    EXPECTED,
    check_exists,
    read_json,
    read_safetensors,
    read_torch_file,
    sniff,
)
from ssl_vit.export.foreign import default_encoder

# Which encoder of a checkpoint: its state-dict prefix. "student" is the online backbone of any
# method (DINO student, MoCo v3 base encoder, MPP / supervised backbone).
ENCODER_PREFIXES: dict[str, str] = {
    "student": "backbone.",
    "teacher": "teacher_backbone.",
    "momentum": "momentum_backbone.",
}
WHICH_ALIASES: dict[str, str] = {"online": "student", "base": "student"}
# DINO is evaluated with its teacher (Caron et al. 2021 §3.1: "the teacher has better performance
# than the student"; reference eval_linear.py / eval_knn.py default --checkpoint_key teacher).
# MoCo v3 keeps the base encoder (reference convert_to_deit.py takes module.base_encoder).
DEFAULT_WHICH: dict[str, str] = {"dino": "teacher"}
_METHOD_MARKERS: tuple[tuple[str, str], ...] = (
    ("teacher_backbone.", "dino"),
    ("momentum_backbone.", "mocov3"),
    ("mask_token", "mpp"),
    ("classifier.", "supervised"),
)
# Fields of the checkpoint's ``ssl_vit`` record that have their own place in config.json; every
# other field (``global_step``, ``pretrain_flops`` ...) describes the training run.
RECORD_FIELDS = ("method", "backbone", "backbone_kwargs", "data", "recipe", "default_encoder")


def normalize_which(which: str | None) -> str | None:
    """An encoder's name (``student``, ``teacher``, ``momentum``, or ``NAME`` for a method's own
    ``NAME_backbone``), its aliases resolved."""
    if which is None:
        return None
    key = WHICH_ALIASES.get(which, which)
    if key not in ENCODER_PREFIXES and not re.fullmatch(r"[a-z][a-z0-9_]*", key):
        raise ValueError(f"which must be one of {', '.join(ENCODER_PREFIXES)} or the NAME of a method's NAME_backbone, got {which!r}")
    return key


def encoder_prefix(which: str) -> str:
    """The state-dict prefix of an encoder: ``backbone.`` (the student), ``teacher_backbone.`` ...;
    a method of one's own keeps another encoder as ``NAME_backbone`` (``--which NAME``)."""
    return ENCODER_PREFIXES.get(which, f"{which}_backbone.")


def encoders_in(keys: list[str]) -> list[str]:
    """The encoders a checkpoint's state-dict keys hold (``student``, ``teacher``, ``target`` ...)."""
    names = {w for w, prefix in ENCODER_PREFIXES.items() if any(k.startswith(prefix) for k in keys)}
    names |= {m.group(1) for k in keys if (m := re.match(r"([a-z][a-z0-9_]*)_backbone\.", k))}
    return sorted(names, key=lambda n: (list(ENCODER_PREFIXES).index(n) if n in ENCODER_PREFIXES else len(ENCODER_PREFIXES), n))


def method_key(name: str | None) -> str | None:
    """The method's recipe key (``DINO`` -> ``dino``, ``MoCoV3`` -> ``mocov3``), as result records use."""
    return name.lower() if isinstance(name, str) and name else None


@dataclass
class BackboneSource:
    """One backbone's weights and what is known about them.

    Attributes:
        weights: the backbone's state dict without prefix (``lightning`` and ``export``), or the
            raw object of a foreign file (for :func:`filter_foreign_state_dict` to unwrap).
        backbone, backbone_kwargs: the registry name and kwargs; ``None`` when the file does not say.
        path: where the weights came from (``"random"`` for a random initialisation).
        kind: ``lightning``, ``export``, ``state_dict`` or ``random``.
        method: the pretext method key (``dino``, ``mocov3``, ``mpp``, ``supervised``, ``random``).
        which: the encoder taken (``student``, ``teacher``, ``momentum``).
        default_which: the encoder the method is evaluated with by default, when recorded.
        origin: the absolute path of the file the weights were first read from (an export keeps
            its checkpoint's): one pretraining, whichever copy is evaluated.
        normalization: ``{"mean", "std", "source"}`` when the file records it.
        training: the run's record (``global_step``, ``epoch``, ``global_batch_size``,
            ``pretrain_flops`` ...), ``data`` the data record, ``recipe`` the resolved YAML.
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


def is_lightning_checkpoint(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("state_dict"), Mapping) and ("pytorch-lightning_version" in obj or "ssl_vit" in obj)


def read_source(path: str | Path, which: str | None = None, map_location: Any = "cpu", weights_only: bool | None = None) -> BackboneSource:
    """Read any weight file or export directory (see the module docstring)."""
    path = Path(path)
    check_exists(path)
    which = normalize_which(which)
    if path.is_dir():
        return _from_export_dir(path)
    kind = sniff(path)
    if kind == "safetensors":
        config = path.parent / "config.json"
        if path.name == "model.safetensors" and config.is_file():
            recorded = read_json(config)
            if isinstance(recorded, dict) and "ssl_vit" in recorded:
                return _from_export_dir(path.parent)
        weights = read_safetensors(path)
        return BackboneSource(weights, None, {}, str(path), "state_dict", which=which or default_encoder(weights))
    obj = read_torch_file(path, map_location, weights_only)
    if is_lightning_checkpoint(obj):
        return _from_lightning(obj, path, which)
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not a checkpoint or state dict; expected {EXPECTED}")
    if not _has_tensors(obj):
        raise ValueError(f"{path}: a dict without any weights (keys {sorted(map(str, obj))[:8]}); expected {EXPECTED}")
    return BackboneSource(obj, None, {}, str(path), "state_dict", which=which or default_encoder(obj))


def _has_tensors(obj: Mapping[str, Any], depth: int = 2) -> bool:
    for v in obj.values():
        if isinstance(v, Tensor) or (depth > 0 and isinstance(v, Mapping) and _has_tensors(v, depth - 1)):
            return True
    return False


def _infer_method(keys: list[str]) -> str | None:
    for marker, method in _METHOD_MARKERS:
        if any(k.startswith(marker) for k in keys):
            return method
    return None


def _from_lightning(ckpt: dict[str, Any], path: Path, which: str | None) -> BackboneSource:
    record = ckpt.get("ssl_vit") if isinstance(ckpt.get("ssl_vit"), dict) else {}
    hparams = ckpt.get("hyper_parameters") if isinstance(ckpt.get("hyper_parameters"), Mapping) else {}
    state = ckpt["state_dict"]
    keys = list(state)
    present = encoders_in(keys)
    if not record and not present:
        raise ValueError(
            f"{path}: a Lightning checkpoint, but not of an ssl_vit pretext module (no 'ssl_vit' record, "
            "no 'backbone.*' weights); expected a checkpoint written by `ssl-vit fit`"
        )
    method = method_key(record.get("method")) or _infer_method(keys)
    # The method's own default (recorded; a subclass of DINO keeps the teacher), else by its name.
    default = record.get("default_encoder") or DEFAULT_WHICH.get(method or "", "student")
    which = which or default
    prefix = encoder_prefix(which)
    weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not weights:
        raise ValueError(
            f"{path}: this {method or 'ssl_vit'} checkpoint has no {which} backbone ({prefix}* weights); "
            f"it holds: {', '.join(present) or 'none'} (choose with which= / --which)"
        )
    name = record.get("backbone") or hparams.get("backbone")
    kwargs = record.get("backbone_kwargs") if "backbone_kwargs" in record else hparams.get("backbone_kwargs")
    data = record.get("data") if isinstance(record.get("data"), dict) else None
    training = {k: v for k, v in record.items() if k not in RECORD_FIELDS}
    training.setdefault("global_step", ckpt.get("global_step"))
    training.setdefault("epoch", ckpt.get("epoch"))
    if training.get("pretrain_flops") is None:  # PretrainFlopsCounter writes it at the top level too
        training["pretrain_flops"] = ckpt.get("pretrain_flops")
    return BackboneSource(
        weights,
        name,
        dict(kwargs or {}),
        str(path),
        "lightning",
        method=method,
        which=which,
        default_which=default,
        normalization=recorded_normalization(data, state),
        training={k: v for k, v in training.items() if v is not None},
        data=data,
        recipe=record.get("recipe"),
    )


def recorded_normalization(data: dict[str, Any] | None, state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The input normalisation the backbone was trained with: the datamodule's statistics, else
    MPP's ``norm_mean``/``norm_std`` buffers (set from its ``mean``/``std`` arguments)."""
    if data and data.get("mean") is not None and data.get("std") is not None:
        return {"mean": list(data["mean"]), "std": list(data["std"]), "source": f"training data ({data.get('name', 'unnamed')})"}
    mean, std = state.get("norm_mean"), state.get("norm_std")
    if isinstance(mean, Tensor) and isinstance(std, Tensor) and mean.numel() and std.numel():
        return {"mean": mean.tolist(), "std": std.tolist(), "source": "MPP mean/std arguments"}
    return None


def _from_export_dir(folder: Path) -> BackboneSource:
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    for f in (config_path, weights_path):
        if not f.is_file():
            raise FileNotFoundError(f"{folder}: not an export directory, {f.name} is missing; expected {EXPECTED}")
    config = read_json(config_path)
    info = config.get("ssl_vit") if isinstance(config, dict) else None
    if not isinstance(info, dict) or not isinstance(info.get("backbone"), str):
        raise ValueError(
            f"{config_path}: no 'ssl_vit' section naming the backbone; expected a config.json written by "
            "`ssl-vit export` (to load other weights, pass the weights file and backbone=)"
        )
    return BackboneSource(
        read_safetensors(weights_path),
        info["backbone"],
        dict(info.get("backbone_kwargs") or {}),
        str(folder),
        "export",
        method=info.get("method"),
        which=info.get("which"),
        default_which=info.get("default_which"),
        origin=info.get("origin"),
        normalization=info.get("normalization"),
        training=dict(info.get("training") or {}),
        data=info.get("data"),
        recipe=info.get("recipe"),
        results=list(info.get("results") or []),
    )
