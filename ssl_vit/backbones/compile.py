"""``torch.compile`` for backbones, one repeated piece at a time (regional compilation).

A ViT is ``depth`` copies of one block: compiling each block in place (``nn.Module.compile``)
gives one graph that every block of that shape reuses (torch inlines the modules and passes their
parameters as inputs), compiled once rather than once per block or for the whole model, with
fused kernels for the LayerNorm / GELU / residual work around the matmuls. Around the blocks
nothing changes: parameter names and state dicts stay as they are (checkpoints, EMA pairs,
exports and evaluations do not see a difference), and what the pretext tasks do between the
patch embedding and the first block (MPP's ``patch_hook``) keeps running eagerly.

Regions: a ViT's or hybrid's Transformer blocks (``blocks``); a ResNet's stages (``layer1`` ...);
any other backbone (a plug-in of your own) whole. Tracing for export (TorchScript, ONNX) cannot
go through a compiled region: :func:`eager` sets the regions aside meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ssl_vit.backbones.resnet import ResNetBackbone

# torch.compile's backends: "inductor" generates fused kernels (the speed-up); "aot_eager"
# traces forward and backward but runs torch's own kernels (a check of the tracing, fast to
# compile); "eager" only captures the graph.
DEFAULT_BACKEND = "inductor"


def compile_regions(backbone: nn.Module) -> list[tuple[str, nn.Module]]:
    """The pieces of ``backbone`` that :func:`compile_backbone` compiles, with their names."""
    blocks = getattr(backbone, "blocks", None)
    if isinstance(blocks, nn.ModuleList | nn.Sequential) and len(blocks) > 0:
        return [(f"blocks.{i}", block) for i, block in enumerate(blocks)]
    if isinstance(backbone, ResNetBackbone):
        return [(f"layer{i + 1}", stage) for i, stage in enumerate(backbone._stages())]
    return [("", backbone)]


def check_backend(backend: str) -> None:
    """A backend torch.compile knows, or a ``ValueError`` naming the ones it does."""
    import torch._dynamo

    if backend not in torch._dynamo.list_backends(exclude_tags=()):  # debugging backends (aot_eager) included
        raise ValueError(
            f"compile backend {backend!r} is not one torch.compile knows; choose from {', '.join(torch._dynamo.list_backends())} "
            "(or a debugging backend: aot_eager, eager)"
        )


def compile_backbone(backbone: nn.Module, backend: str = DEFAULT_BACKEND) -> list[str]:
    """Compile ``backbone``'s regions in place (see the module docstring); returns their names
    (``""``: the whole backbone)."""
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
