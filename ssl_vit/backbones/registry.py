"""Backbone registry: ``create_backbone(name, **kwargs)`` and ``list_backbones()``.

A name fixes the architecture (width, depth, heads, ResNet depth); the keyword arguments set what
may vary between runs of the same architecture (resolution, patch size, channels, regularisation).
The name and kwargs are recorded on the model (``backbone_name``, ``backbone_kwargs``) so that an
exported backbone can be rebuilt without a recipe.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ssl_vit.errors import check_argument_types, did_you_mean


@dataclass(frozen=True)
class BackboneSpec:
    """A registered architecture: ``build(**fixed, **kwargs)``. ``required``: the kwargs a user
    must give (`vit`'s width, depth and heads: it has no shape of its own, though
    ``VisionTransformer`` alone would default to ViT-B's)."""

    name: str
    build: Callable[..., nn.Module]
    fixed: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    required: tuple[str, ...] = ()

    def allowed_kwargs(self) -> list[str]:
        """The builder's named arguments (those ``fixed`` leaves to the user)."""
        params = inspect.signature(self.build).parameters
        return [name for name, p in params.items() if name not in self.fixed and name != "patch_embed"
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def takes_any_kwargs(self) -> bool:
        """Whether the builder also takes ``**kwargs`` (then passed on unchecked)."""
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(self.build).parameters.values())


_REGISTRY: dict[str, BackboneSpec] = {}


def _origin(build: Callable[..., nn.Module]) -> str:
    return f"{getattr(build, '__module__', '?')}.{getattr(build, '__qualname__', repr(build))}"


def register_backbone(spec: BackboneSpec) -> BackboneSpec:
    """Add an architecture under ``spec.name``. The same module registering it again (a reloaded
    module, a notebook cell run twice) replaces it; another builder under a taken name is an error."""
    old = _REGISTRY.get(spec.name)
    if old is not None and _origin(old.build) != _origin(spec.build):
        raise ValueError(f"backbone {spec.name!r} is registered twice: by {_origin(old.build)} and by {_origin(spec.build)}")
    _REGISTRY[spec.name] = spec
    return spec


def list_backbones() -> list[str]:
    """Names accepted by ``create_backbone``, sorted."""
    return sorted(_REGISTRY)


def get_spec(name: str) -> BackboneSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backbone {name!r}{did_you_mean(name, _REGISTRY)}; known backbones: {', '.join(list_backbones())} "
                         "(one of your own: name the module that registers it in SSL_VIT_PLUGINS)")
    return _REGISTRY[name]


def as_plain(value: Any) -> Any:
    """Tuples as lists, recursively: kwargs as a checkpoint records them compare equal to the
    backbone's own."""
    if isinstance(value, Mapping):
        return {k: as_plain(v) for k, v in value.items()}
    return [as_plain(v) for v in value] if isinstance(value, list | tuple) else value


def kwargs_differences(there: Mapping[str, Any], here: Mapping[str, Any], ignore: Collection[str] = ()) -> list[str]:
    """``["embed_dim: 32 there, 64 here", ...]``: the backbone arguments a recorded run (there)
    and this one (here) disagree on, those in ``ignore`` aside."""
    there, here = as_plain(dict(there)), as_plain(dict(here))
    keys = sorted((set(there) | set(here)) - set(ignore), key=str)
    return [f"{k}: {there.get(k)!r} there, {here.get(k)!r} here" for k in keys if there.get(k) != here.get(k)]


def create_backbone(name: str, **kwargs: Any) -> nn.Module:
    """Build a registered backbone.

    Example::

        vit = create_backbone("vit_tiny", img_size=28, patch_size=4, in_chans=1)
        vit(torch.randn(2, 1, 28, 28)).shape  # [2, 192]
    """
    spec = get_spec(name)
    allowed = spec.allowed_kwargs()
    unknown = [] if spec.takes_any_kwargs() else sorted(set(kwargs) - set(allowed))
    if unknown:
        hint = did_you_mean(unknown[0], allowed) if len(unknown) == 1 else ""
        raise TypeError(f"backbone {name!r} got unknown argument(s) {unknown}{hint}; it accepts: {', '.join(allowed)}")
    missing = [k for k in spec.required if k not in kwargs]
    if missing:
        raise TypeError(f"backbone {name!r} needs {', '.join(missing)} (it has no shape of its own; or pick a sized one, e.g. vit_small)")
    check_argument_types(spec.build, kwargs, f"backbone {name!r}: ")
    model = spec.build(**spec.fixed, **kwargs)
    _check_interface(name, model)
    model.backbone_name = name
    model.backbone_kwargs = dict(kwargs)
    return model


def _check_interface(name: str, model: nn.Module) -> None:
    """What evaluation, export, FLOP counting and the recipe checks read from every backbone:
    ``embed_dim`` (the width of ``forward``'s ``[B, D]``), ``in_chans`` and ``img_size`` as
    ``(height, width)``; said when the backbone is built rather than as a traceback later."""
    problems = []
    for attr in ("embed_dim", "in_chans"):
        value = getattr(model, attr, None)
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{attr} (an int) is {'missing' if value is None else repr(value)}")
    size = getattr(model, "img_size", None)
    if not (isinstance(size, tuple | list) and len(size) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in size)):
        problems.append(f"img_size (a (height, width) pair of ints) is {'missing' if size is None else repr(size)}")
    if not callable(getattr(model, "forward_features", None)):
        problems.append("forward_features(x) is missing")
    if problems:
        raise TypeError(f"backbone {name!r} ({type(model).__name__}) does not have the attributes every backbone has: "
                        f"{'; '.join(problems)} (see README, Backbones)")
