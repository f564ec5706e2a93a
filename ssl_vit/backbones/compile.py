"""``torch.compile`` for backbones, one repeated piece at a time (regional compilation).

Each Transformer block (a ResNet's stage; a plug-in backbone whole) is compiled in place
(``nn.Module.compile``): blocks of one shape share one graph, compiled once, with fused kernels
for the LayerNorm / GELU / residual work around the matmuls. Parameter names and state dicts stay
as they are, and what a method does before the first block (MPP's ``patch_hook``) runs eagerly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ssl_vit.backbones.resnet import ResNetBackbone

# "inductor" generates fused kernels; "aot_eager" traces as inductor does but runs torch's own kernels.
DEFAULT_BACKEND = "inductor"


def compile_regions(backbone: nn.Module) -> list[tuple[str, nn.Module]]:
    """The pieces of ``backbone`` that :func:`compile_backbone` compiles, with their names."""
    blocks = getattr(backbone, "blocks", None)
    if isinstance(blocks, nn.ModuleList | nn.Sequential) and len(blocks) > 0:
        return [(f"blocks.{i}", block) for i, block in enumerate(blocks)]
    if isinstance(backbone, ResNetBackbone):
        return [(f"layer{i + 1}", stage) for i, stage in enumerate(backbone.stages())]
    return [("", backbone)]


def check_backend(backend: str) -> None:
    """A backend torch.compile knows (debugging ones such as aot_eager included), or a ``ValueError``."""
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"compile backend {backend!r} is not one torch.compile knows; choose from "
                         f"{', '.join(torch._dynamo.list_backends())} (or a debugging backend: aot_eager, eager)")


def compile_backbone(backbone: nn.Module, backend: str = DEFAULT_BACKEND) -> list[str]:
    """Compile ``backbone``'s regions in place; returns their names (``""``: the whole backbone)."""
    check_backend(backend)
    regions = compile_regions(backbone)
    for _, module in regions:
        module.compile(backend=backend)
    return [name for name, _ in regions]


@contextmanager
def eager(module: nn.Module) -> Iterator[nn.Module]:
    """Run ``module`` without its compiled regions inside the block (TorchScript and ONNX refuse
    to trace a dynamo-compiled function), and compiled again after it."""
    compiled = [(m, m._compiled_call_impl) for m in module.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    for m, _ in compiled:
        m._compiled_call_impl = None
    try:
        yield module
    finally:
        for m, impl in compiled:
            m._compiled_call_impl = impl
