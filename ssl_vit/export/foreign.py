"""Weights from elsewhere into our backbones: one filter function, as timm's
``checkpoint_filter_fn``, and a strict loader whose errors fit on one line.

Layouts understood by :func:`filter_foreign_state_dict`:

* timm ViT state dicts (our parameter names are timm's): ``head.*`` and ``fc_norm.*`` dropped;
  a position embedding without the class-token position (timm ``no_embed_class=True``) gets a
  zero entry for it, which is the same model (the [CLS] token then carries no position).
* the official DINO checkpoints: ``{"teacher": ..., "student": ...}`` with ``backbone.`` /
  ``module.backbone.`` prefixes (``--checkpoint_key teacher`` by default), and the released
  backbone-only files (plain timm layout).
* the official MoCo v3 checkpoints: ``state_dict`` with ``module.base_encoder.`` /
  ``module.momentum_encoder.`` prefixes; their ``head.*`` is the projector and is dropped
  (reference ``convert_to_deit.py``).
* ``{"model": ...}`` wrappers (DeiT, MAE), ``module.`` (DistributedDataParallel) prefixes,
  torchvision ResNets (``fc.*`` dropped), and our own Lightning / export state dicts (a DINO
  state dict gives its ``teacher_backbone.*`` unless the student is asked for, as its checkpoint).

Then, whatever the source: the position embedding is resampled (bicubic, ViT paper §3.2) when its
grid differs from the model's, and the patch projection is adapted (timm's ``adapt_input_conv``)
when the channel count differs, e.g. RGB weights for grey images.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ssl_vit.backbones.pos_embed import resample_pos_embed, sincos_2d_pos_embed

# Classifier / projector parameters that a backbone never has (timm head and fc_norm,
# torchvision fc, DINO / MoCo v3 heads).
_DROP_PREFIXES = ("head.", "fc_norm.", "fc.", "pre_logits.")


def _select_prefix(sd: Mapping[str, Any], prefixes: tuple[str, ...]) -> dict[str, Any] | None:
    for prefix in prefixes:
        sub = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        if sub:
            return sub
    return None


_TEACHER_PREFIXES = ("teacher_backbone.", "module.teacher_backbone.")


def _is_official_dino(obj: Mapping[str, Any]) -> bool:
    return "teacher" in obj or "student" in obj  # main_dino.py's save_dict


def _inner(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The state dict inside a MoCo v3 / Lightning / DeiT / MAE wrapper (else ``obj``)."""
    for key in ("state_dict", "model"):
        if isinstance(obj.get(key), Mapping):
            return obj[key]
    return obj


def default_encoder(obj: Mapping[str, Any]) -> str | None:
    """The encoder :func:`filter_foreign_state_dict` gives when none is asked for, where the
    weights hold two: DINO's teacher (the official checkpoints' ``teacher`` entry, our
    ``teacher_backbone.*``), as DINO evaluates it and as our checkpoints default to; None
    otherwise (one encoder, or MoCo v3's base encoder, the default's own name)."""
    if _is_official_dino(obj) or any(str(k).startswith(_TEACHER_PREFIXES) for k in _inner(obj)):
        return "teacher"
    return None


def _unwrap(obj: Mapping[str, Any], which: str | None) -> dict[str, Any]:
    """Container and prefixes -> the encoder's own keys."""
    which = which or default_encoder(obj)
    official_dino = _is_official_dino(obj)
    if official_dino:
        key = "student" if which == "student" else "teacher"
        if key not in obj:
            raise ValueError(f"DINO checkpoint has no {key!r} entry (it has {', '.join(map(str, obj))})")
        obj = obj[key]
    sd = {k: v for k, v in _inner(obj).items() if isinstance(v, Tensor)}
    if which == "momentum":
        picked = _select_prefix(sd, ("module.momentum_encoder.", "momentum_encoder.", "momentum_backbone."))
        if picked is None:
            raise ValueError("which='momentum' but the state dict has no momentum encoder (momentum_encoder.* keys)")
        return picked
    moco_base = ("module.base_encoder.", "base_encoder.")  # official MoCo v3
    if which == "teacher":
        picked = _select_prefix(sd, _TEACHER_PREFIXES)
        if picked is not None:
            return picked
        # Only an official DINO checkpoint's "teacher" entry (chosen above) holds the teacher as
        # backbone.*; anywhere else backbone.* is the online encoder, not what was asked for.
        if not official_dino:
            if _select_prefix(sd, moco_base) is not None:
                raise ValueError("which='teacher' but this is a MoCo v3 checkpoint; choose student (base encoder) or momentum")
            raise ValueError("which='teacher' but the state dict has no teacher backbone (teacher_backbone.* keys; "
                             "only DINO's checkpoints hold one); choose student")
    elif which not in (None, "student"):  # a method's own NAME_backbone
        picked = _select_prefix(sd, (f"{which}_backbone.", f"module.{which}_backbone."))
        if picked is None:
            raise ValueError(f"which={which!r} but the state dict has no {which}_backbone.* weights")
        return picked
    picked = _select_prefix(sd, moco_base)
    if picked is not None:
        return picked
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    return _select_prefix(sd, ("backbone.",)) or sd  # DINO heads / our probe live beside backbone.*


def _grid_of(tokens: int) -> tuple[int, int] | None:
    side = math.isqrt(tokens)
    return (side, side) if side * side == tokens and side > 0 else None


def _fit_pos_embed(pos: Tensor, model: nn.Module, source_grid: tuple[int, int] | None = None) -> Tensor:
    """Bring a ``[1, T, D]`` position embedding to the model's prefix count and grid;
    ``source_grid``: the grid it was made for when known (else a square one is inferred)."""
    target = model.pos_embed
    if pos.shape == target.shape:
        return pos
    if pos.ndim != 3 or pos.shape[-1] != target.shape[-1]:
        return pos  # another width: the strict load reports it with every other mismatch
    prefix = int(getattr(model, "num_prefix_tokens", 1))
    if getattr(model, "pos_embed_type", "learn") == "sincos":  # a fixed table: recompute it for the grid
        return sincos_2d_pos_embed(target.shape[-1], tuple(model.grid_size), prefix).to(pos.dtype)
    if source_grid is not None and prefix + source_grid[0] * source_grid[1] == pos.shape[1]:
        return resample_pos_embed(pos, tuple(model.grid_size), tuple(source_grid), prefix)
    if _grid_of(pos.shape[1] - prefix) is None and _grid_of(pos.shape[1]) is not None:
        # No class-token position (timm no_embed_class): [CLS] got no position, i.e. zeros.
        pos = torch.cat([pos.new_zeros(1, prefix, pos.shape[-1]), pos], dim=1)
    old_grid = _grid_of(pos.shape[1] - prefix)
    if old_grid is None:
        raise ValueError(f"position embedding with {pos.shape[1]} tokens is not {prefix} prefix + a square grid")
    return resample_pos_embed(pos, tuple(model.grid_size), old_grid, prefix)


def filter_foreign_state_dict(state_dict: Mapping[str, Any], model: nn.Module, which: str | None = None) -> dict[str, Tensor]:
    """Map a checkpoint of another layout onto ``model``'s parameter names and shapes (see the
    module docstring for the layouts).

    Args:
        state_dict: the loaded object: a flat state dict or one of the checkpoint containers.
        model: the backbone the weights are for (only its names, grid and channels are read).
        which: for checkpoints with two encoders: ``teacher`` (the default for DINO's, official
            or ours) / ``student``, or ``momentum`` (MoCo v3; the base encoder by default).

    Returns:
        a state dict for ``model.load_state_dict(..., strict=True)``.
    """
    return fit_state_dict(_unwrap(state_dict, which), model)


def fit_state_dict(state_dict: Mapping[str, Tensor], model: nn.Module, source_grid: tuple[int, int] | None = None) -> dict[str, Tensor]:
    """The shape fixes of :func:`filter_foreign_state_dict` for an already prefix-free state dict:
    drop classifier keys the model lacks, fit the position embedding (from ``source_grid``, the
    patch grid the weights were trained at when it is recorded, e.g. a non-square one) and the
    input channels."""
    own = model.state_dict()
    sd = {k: v for k, v in state_dict.items() if k in own or not k.startswith(_DROP_PREFIXES)}
    if "pos_embed" in sd and "pos_embed" in own:
        sd["pos_embed"] = _fit_pos_embed(sd["pos_embed"], model, source_grid)
    for key in ("patch_embed.proj.weight", "conv1.weight"):
        if key in sd and key in own and sd[key].ndim == 4 and sd[key].shape[1] != own[key].shape[1]:
            from timm.models import adapt_input_conv  # sums (to grey) or repeats and rescales

            sd[key] = adapt_input_conv(own[key].shape[1], sd[key], base_chans=sd[key].shape[1])
    return sd


def _listed(keys: list[str], limit: int = 4) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def load_weights(model: nn.Module, state_dict: Mapping[str, Tensor], source: str, assign: bool = False) -> nn.Module:
    """``load_state_dict(strict=True)`` with a one-line error naming the source and the mismatch.

    ``assign=True`` makes the loaded tensors the module's own (cast to its dtypes): how a model
    built on the meta device gets its weights without a wasted random initialisation."""
    own = model.state_dict()
    # BatchNorm counters are absent from older checkpoints and do not change the function.
    missing = [k for k in own if k not in state_dict and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state_dict if k not in own]
    shapes = [f"{k} {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}" for k in own if k in state_dict and state_dict[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        name = getattr(model, "backbone_name", type(model).__name__)
        kwargs = getattr(model, "backbone_kwargs", {})
        parts = [f"missing {_listed(missing)}" if missing else "", f"unexpected {_listed(unexpected)}" if unexpected else "", f"shape mismatch {_listed(shapes, 2)}" if shapes else ""]
        raise ValueError(f"{source}: weights do not fit backbone {name!r} {kwargs}: {'; '.join(p for p in parts if p)}")
    state = dict(state_dict)
    if assign:
        for k, v in own.items():
            if k not in state:  # a BatchNorm counter (see above)
                state[k] = torch.zeros(v.shape, dtype=v.dtype)
            elif state[k].is_floating_point() and v.is_floating_point():
                state[k] = state[k].to(v.dtype)
    model.load_state_dict(state, strict=False, assign=assign)
    return model
