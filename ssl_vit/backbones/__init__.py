"""Backbones that every method, evaluation and export shares. The contract (ViT, hybrid and
ResNet alike): ``embed_dim``, ``in_chans``, ``img_size``; ``forward(x) -> [B, D]``;
``forward_features(x)`` (tokens ``[B, 1+N, D]`` after the final LayerNorm for ViT/hybrid, the
feature map for ResNet); ``get_intermediate_layers(x, n)``; ``get_attention_maps(x)``;
``no_weight_decay()``; ``backbone_name`` and ``backbone_kwargs`` (set by ``create_backbone``).
ViTs also take a ``patch_hook`` in ``forward_features`` to replace patch embeddings before the
position embedding is added.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ssl_vit.backbones.compile import compile_backbone
from ssl_vit.backbones.hybrid import HybridEmbed
from ssl_vit.backbones.registry import (
    BackboneSpec,
    create_backbone,
    get_spec,
    list_backbones,
    register_backbone,
)
from ssl_vit.backbones.resnet import ResNetBackbone
from ssl_vit.backbones.vit import PatchHook, VisionTransformer

__all__ = ["BackboneSpec", "HybridEmbed", "PatchHook", "ResNetBackbone", "VisionTransformer", "compile_backbone", "create_backbone",
           "eval_mode", "get_spec", "is_vit", "list_backbones", "register_backbone"]


def is_vit(model: object) -> bool:
    """True for backbones with a token sequence (plain ViT and hybrid)."""
    return isinstance(model, VisionTransformer)


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[torch.device]:
    """Run ``module`` in eval mode (no dropout / drop path, BN running stats) and restore every
    submodule's own training flag afterwards; yields the module's device."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield next((p.device for p in module.parameters()), torch.device("cpu"))
    finally:
        for m, training in modes.items():
            m.training = training
