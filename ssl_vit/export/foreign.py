"""Weights from elsewhere into our backbones: one filter, as timm's ``checkpoint_filter_fn``, and a
strict loader whose errors fit on one line. :func:`filter_foreign_state_dict` reads timm's ViTs (our
names are timm's; a table without the class token's position, ``no_embed_class``, gets a zero one),
torchvision's ResNets, the official DINO checkpoints (``{"teacher", "student"}``; the teacher by
default, as its ``--checkpoint_key``), MoCo v3 ones (``module.base_encoder.`` /
``module.momentum_encoder.``; the projector dropped, as ``convert_to_deit.py`` does), ``{"model": ...}``
wrappers (DeiT, MAE), ``module.`` (DDP) prefixes and our own state dicts. The position table is
resampled (bicubic, ViT paper §3.2) to the model's grid, the first convolution adapted to its channels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ssl_vit.backbones.pos_embed import resample_pos_embed, sincos_2d_pos_embed

# Classifier and projector parameters no backbone has (timm's head and fc_norm, torchvision's fc).
_DROP_PREFIXES = ("head.", "fc_norm.", "fc.", "pre_logits.")
_MOCO_BASE = ("module.base_encoder.", "base_encoder.")


def _select(sd: Mapping[str, Any], prefixes: tuple[str, ...]) -> dict[str, Any] | None:
    """The keys under the first of ``prefixes`` that has any, the prefix stripped."""
    for prefix in prefixes:
        if sub := {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}:
            return sub
    return None


def _inner(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The state dict inside a MoCo v3 / Lightning / DeiT / MAE wrapper (else ``obj``)."""
    return next((obj[k] for k in ("state_dict", "model") if isinstance(obj.get(k), Mapping)), obj)


def default_encoder(obj: Mapping[str, Any]) -> str | None:
    """``teacher`` for DINO's weights (official or ours), the encoder DINO evaluates; None for
    anything else (one encoder, or MoCo v3's base encoder, the default's own name)."""
    official = "teacher" in obj or "student" in obj  # main_dino.py's save_dict
    return "teacher" if official or _select(_inner(obj), ("teacher_backbone.", "module.teacher_backbone.")) else None


def _unwrap(obj: Mapping[str, Any], which: str | None) -> dict[str, Any]:
    """Container and prefixes -> the keys of the encoder ``which`` (see the module docstring)."""
    which = which or default_encoder(obj)
    if "teacher" in obj or "student" in obj:  # official DINO (which: teacher by default): its entry holds the encoder as backbone.*
        if which not in ("student", "teacher"):
            raise ValueError(f"which={which!r} but this DINO checkpoint holds a teacher and a student")
        if which not in obj:
            raise ValueError(f"DINO checkpoint has no {which!r} entry (it has {', '.join(map(str, obj))})")
        obj, which = obj[which], None
    sd = {k: v for k, v in _inner(obj).items() if isinstance(v, Tensor)}
    if which not in (None, "student"):  # teacher_backbone.*, momentum_backbone.* (official: momentum_encoder.*), NAME_backbone.*
        prefixes = (f"{which}_backbone.", f"module.{which}_backbone.") + (("momentum_encoder.", "module.momentum_encoder.") if which == "momentum" else ())
        if (picked := _select(sd, prefixes)) is None:
            moco = which == "teacher" and _select(sd, _MOCO_BASE)
            hint = "; this is a MoCo v3 checkpoint: choose student (its base encoder) or momentum" if moco else ""
            raise ValueError(f"which={which!r} but the state dict has no {' / '.join(p + '*' for p in prefixes[::2])} weights{hint}")
        return picked
    if (picked := _select(sd, _MOCO_BASE)) is not None:
        return picked
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return _select(sd, ("backbone.",)) or sd  # DINO's heads and our probe live beside backbone.*


def _square(tokens: int) -> tuple[int, int] | None:
    side = math.isqrt(tokens)
    return (side, side) if side and side * side == tokens else None


def _fit_pos_embed(pos: Tensor, model: nn.Module, source_grid: tuple[int, int] | None) -> Tensor:
    """A ``[1, T, D]`` position table brought to the model's grid from ``source_grid`` (the grid
    it was trained at when recorded, e.g. a non-square one; else a square grid is inferred)."""
    target, prefix = model.pos_embed, int(getattr(model, "num_prefix_tokens", 1))
    if pos.shape == target.shape or pos.ndim != 3 or pos.shape[-1] != target.shape[-1]:
        return pos  # (another width: the strict load names it with every other mismatch)
    if getattr(model, "pos_embed_type", "learn") == "sincos":  # a fixed function of the grid (MoCo v3 §4.2): recomputed
        return sincos_2d_pos_embed(target.shape[-1], tuple(model.grid_size), prefix).to(pos.dtype)
    if source_grid is None or prefix + source_grid[0] * source_grid[1] != pos.shape[1]:
        if _square(pos.shape[1] - prefix) is None and _square(pos.shape[1]) is not None:  # timm no_embed_class
            pos = torch.cat([pos.new_zeros(1, prefix, pos.shape[-1]), pos], dim=1)
        if (source_grid := _square(pos.shape[1] - prefix)) is None:
            raise ValueError(f"position embedding with {pos.shape[1]} tokens is not {prefix} prefix + a square grid")
    return resample_pos_embed(pos, tuple(model.grid_size), tuple(source_grid), prefix)


def filter_foreign_state_dict(state_dict: Mapping[str, Any], model: nn.Module, which: str | None = None) -> dict[str, Tensor]:
    """A checkpoint of another layout (a flat state dict or one of the containers of the module
    docstring) mapped onto ``model``'s names and shapes, for ``load_state_dict(strict=True)``.
    ``which``: of two encoders, ``teacher`` (default for DINO's) / ``student``, or ``momentum``
    (MoCo v3's; the base encoder by default)."""
    return fit_state_dict(_unwrap(state_dict, which), model)


def fit_state_dict(state_dict: Mapping[str, Tensor], model: nn.Module, source_grid: tuple[int, int] | None = None) -> dict[str, Tensor]:
    """The shape fixes of :func:`filter_foreign_state_dict` for a prefix-free state dict: drop the
    classifier keys the model lacks, fit the position table and the first convolution's channels."""
    own = model.state_dict()
    sd = {k: v for k, v in state_dict.items() if k in own or not k.startswith(_DROP_PREFIXES)}
    if "pos_embed" in sd and "pos_embed" in own:
        sd["pos_embed"] = _fit_pos_embed(sd["pos_embed"], model, source_grid)
    for key in ("patch_embed.proj.weight", "conv1.weight"):
        if key in sd and key in own and sd[key].ndim == 4 and sd[key].shape[1] != own[key].shape[1]:
            from timm.models import adapt_input_conv  # sums (to grey) or repeats and rescales

            sd[key] = adapt_input_conv(own[key].shape[1], sd[key], base_chans=sd[key].shape[1])
    return sd


def load_weights(model: nn.Module, state_dict: Mapping[str, Tensor], source: str, assign: bool = False) -> nn.Module:
    """``load_state_dict(strict=True)`` with a one-line error naming the source and the mismatch;
    ``assign=True`` makes the tensors the module's own (in its dtypes), for a model on the meta device."""
    own = model.state_dict()
    # (BatchNorm's counters are absent from older checkpoints and do not change the function)
    missing = [k for k in own if k not in state_dict and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state_dict if k not in own]
    shapes = [f"{k} {tuple(state_dict[k].shape)} vs {tuple(v.shape)}" for k, v in own.items() if k in state_dict and state_dict[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = [f"{what} {', '.join(keys[:n])}" + (f" (+{len(keys) - n} more)" if len(keys) > n else "")
                 for what, keys, n in (("missing", missing, 4), ("unexpected", unexpected, 4), ("shape mismatch", shapes, 2)) if keys]
        name = getattr(model, "backbone_name", type(model).__name__)
        raise ValueError(f"{source}: weights do not fit backbone {name!r} {getattr(model, 'backbone_kwargs', {})}: {'; '.join(parts)}")
    if assign:
        state_dict = {k: v.to(own[k].dtype) if v.is_floating_point() and own[k].is_floating_point() else v for k, v in state_dict.items()}
    model.load_state_dict(state_dict, strict=False, assign=assign)
    return model
