"""FLOPs, measured by torch's ``FlopCounterMode`` rather than written as formulas: a backbone's
per image (``ssl-vit backbones``: the ViT paper compares architectures at equal compute, its
Figure 5 and Table 6) and any call's (the pretraining total of a run,
``ssl_vit.training.callbacks.PretrainFlopsCounter``).

Convention (torch's table, fvcore's, timm's): matrix products only (linear layers, convolutions,
attention's QKᵀ and AV), 2 FLOPs per multiply-add, so half the count is the usual GMAC figure:
ViT-S/16 at 224 px is 4.60 GMACs (timm: 4.61). Normalisations, activations, softmaxes and the
optimiser are left out, a few per cent of a ViT's work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

# Attention counts its math path's products whatever kernel runs, so that a count does not depend
# on the device: QKᵀ and AV forward, twice that backward (no recomputation of QKᵀ, which torch's
# table adds for the fused CUDA kernels). Its table lacks the CPU kernels, which it would count as zero.
_aten = torch.ops.aten
_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(q, k, v),
    **{op: lambda g, q, k, v, *_, **__: 2 * sdpa_flop_count(q, k, v) for op in (
        _aten._scaled_dot_product_flash_attention_for_cpu_backward, _aten._scaled_dot_product_flash_attention_backward,
        _aten._scaled_dot_product_efficient_attention_backward, _aten._scaled_dot_product_cudnn_attention_backward)},
}


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that counts attention as above."""
    return FlopCounterMode(display=False, custom_mapping=_ATTENTION)


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """FLOPs of ``fn(*args, **kwargs)``: its forward and, if it calls it, its backward pass."""
    with flop_counter() as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


def backbone_flops(backbone: nn.Module, img_size: int | tuple[int, int]) -> tuple[float, float]:
    """Forward and training (forward + backward) FLOPs per image of ``backbone`` at ``img_size``.

    Measured on the meta device (shapes only: no memory, no arithmetic, so ViT-H takes seconds),
    on a copy of the parameters that keeps which ones train. The backward computes what autograd
    computes: no gradient for the image nor for a frozen layer (MoCo v3's fixed patch projection),
    so training is a little under 3x the forward.
    """
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    state = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad) for n, p in backbone.named_parameters()}
    state |= {n: torch.empty_like(b, device="meta") for n, b in backbone.named_buffers()}
    images = torch.empty(2, backbone.in_chans, h, w, device="meta")  # two: BatchNorm in training mode needs more than one value
    with flop_counter() as counter:
        out = torch.func.functional_call(backbone, state, (images,))
        forward = counter.get_total_flops()
        if out.requires_grad:
            out.sum().backward()
    return forward / 2, counter.get_total_flops() / 2
