"""Backbone registry: ``create_backbone(name, **kwargs)``, ``list_backbones()`` and the
registered architectures.

A name fixes the architecture (width, depth, heads, ResNet depth); the keyword arguments set what
may vary between runs of it (resolution, patch size, channels, regularisation). Both are recorded
on the model (``backbone_name``, ``backbone_kwargs``), so that an exported backbone can be rebuilt
without a recipe. A plug-in module registers its own architectures with ``register_backbone``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ssl_vit.backbones.hybrid import hybrid_vit
from ssl_vit.backbones.resnet import ResNetBackbone
from ssl_vit.backbones.vit import VisionTransformer
from ssl_vit.errors import check_argument_types, did_you_mean


@dataclass(frozen=True)
class BackboneSpec:
    """A registered architecture: ``build(**fixed, **kwargs)``. ``required``: the kwargs a user
    must give (`vit`'s width, depth and heads: it has no shape of its own)."""

    name: str
    build: Callable[..., nn.Module]
    fixed: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    required: tuple[str, ...] = ()

    def allowed_kwargs(self) -> list[str]:
        """The builder's named arguments that ``fixed`` leaves to the user (a module argument,
        the ViT's ``patch_embed``, is no setting a recipe can carry)."""
        params = inspect.signature(self.build).parameters
        return [n for n, p in params.items() if n not in self.fixed and n != "patch_embed" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def takes_any_kwargs(self) -> bool:
        """Whether the builder also takes ``**kwargs`` (then passed on unchecked)."""
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(self.build).parameters.values())


_REGISTRY: dict[str, BackboneSpec] = {}


def register_backbone(spec: BackboneSpec) -> BackboneSpec:
    """Add an architecture under ``spec.name``. The same module registering it again (a reloaded
    module, a notebook cell run twice) replaces it; another builder under a taken name is an error."""
    old, origin = _REGISTRY.get(spec.name), lambda b: f"{getattr(b, '__module__', '?')}.{getattr(b, '__qualname__', repr(b))}"
    if old is not None and origin(old.build) != origin(spec.build):
        raise ValueError(f"backbone {spec.name!r} is registered twice: by {origin(old.build)} and by {origin(spec.build)}")
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


def create_backbone(name: str, **kwargs: Any) -> nn.Module:
    """Build a registered backbone; the one place its kwargs (from a recipe, a command line or a
    checkpoint's record) are checked.

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
    lacking = [a for a in ("embed_dim", "in_chans", "img_size", "forward_features") if not hasattr(model, a)]
    if lacking:  # what evaluation, export and the recipe checks read from every backbone
        raise TypeError(f"backbone {name!r} ({type(model).__name__}) lacks {', '.join(lacking)}, which every backbone has (see README, Backbones)")
    model.backbone_name, model.backbone_kwargs = name, dict(kwargs)
    return model


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


# ----------------------------------------------------------------------------- the architectures
# ViT Ti/S/B/L/H: (width D, depth, heads), MLP 4·D (ViT paper Table 1; Ti from DeiT, Touvron et al. 2021).
VIT_SIZES = {"tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12), "large": (1024, 24, 16), "huge": (1280, 32, 16)}
for _size, (_dim, _depth, _heads) in VIT_SIZES.items():
    register_backbone(BackboneSpec(f"vit_{_size}", VisionTransformer, {"embed_dim": _dim, "depth": _depth, "num_heads": _heads, "mlp_ratio": 4.0},
                                   f"ViT-{_size[0].upper()}: D={_dim}, {_depth} layers, {_heads} heads"))
# MoCo v3's ViT-S has 12 heads (reference vits.py vit_small; its README: "Our ViT-Small is with
# heads=12"), so its recipe and its official weights compute what the paper's do.
register_backbone(BackboneSpec("vit_small_mocov3", VisionTransformer, {"embed_dim": 384, "depth": 12, "num_heads": 12, "mlp_ratio": 4.0},
                               "MoCo v3's ViT-S: D=384, 12 layers, 12 heads"))
# Any other shape (small ViTs for 2-core CPU runs and tests), timm's layout kept.
register_backbone(BackboneSpec("vit", VisionTransformer, description="ViT of any width/depth/heads (set embed_dim, depth, num_heads)",
                               required=("embed_dim", "depth", "num_heads")))

# Hybrids (ViT paper §3.1): R50+ViT (stride-16 map from the extended stage 3), and ResNet-18
# hybrids for 28-32 px images (small_input=True, num_stages=2 or 3).
for _resnet, _size in (("resnet50", "small"), ("resnet50", "base"), ("resnet50", "large"), ("resnet18", "tiny"), ("resnet18", "small")):
    _dim, _depth, _heads = VIT_SIZES[_size]
    register_backbone(BackboneSpec(f"hybrid_r{_resnet[6:]}_vit_{_size}", hybrid_vit, {"resnet": _resnet, "embed_dim": _dim, "depth": _depth, "num_heads": _heads},
                                   f"{_resnet} stages feeding ViT-{_size[0].upper()}"))
# Any other hybrid (small ones beside small ViTs and ResNets at equal compute).
register_backbone(BackboneSpec("hybrid", hybrid_vit, description="resnet18/resnet50 stages feeding a ViT of any width/depth/heads "
                               "(set resnet, embed_dim, depth, num_heads)", required=("resnet", "embed_dim", "depth", "num_heads")))

for _arch in ("resnet18", "resnet34", "resnet50", "resnet101"):
    register_backbone(BackboneSpec(_arch, ResNetBackbone, {"arch": _arch}, f"torchvision {_arch}, no classifier"))
