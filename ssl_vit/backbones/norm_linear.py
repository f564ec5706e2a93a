"""``linear(layer_norm(x))``, the entry of each half of a pre-norm block, saving less for backward.

Autograd keeps two tensors of ``[T, D]`` for the pair: LayerNorm's input ``x`` (for its own
backward) and its output (the linear layer's input, for the weight gradient). Here only ``x`` and
the per-row mean and 1/std are kept, and the normalised output is recomputed in the backward pass
(one LayerNorm forward, a few per cent of the pair's time). In a ViT block that is two of the
sixteen ``[T, D]``-sized slices of saved activations (QKV's and fc1's inputs): an eighth less
activation memory, the same forward values and the same gradients (tested bit for bit in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ssl_vit.backbones.gelu_linear import autocast_dtype


class _NormLinear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: Tensor,
        norm_weight: Tensor | None,
        norm_bias: Tensor | None,
        weight: Tensor,
        bias: Tensor | None,
        eps: float,
    ) -> Tensor:
        dtype = autocast_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            if dtype is not None:  # as autocast: LayerNorm in fp32, the linear layer in its dtype
                x = x.float()
            shape = (x.shape[-1],)
            y, mean, rstd = torch.native_layer_norm(x, shape, norm_weight, norm_bias, eps)  # [.., D]
            if dtype is not None:
                y, weight = y.to(dtype), weight.to(dtype)
                bias = bias.to(dtype) if bias is not None else None
            out = F.linear(y, weight, bias)  # [.., D_out]
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, weight)
        ctx.eps = eps
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        x, mean, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        shape = (x.shape[-1],)
        y, _, _ = torch.native_layer_norm(x, shape, norm_weight, norm_bias, ctx.eps)  # recomputed
        y = y.to(weight.dtype).reshape(-1, shape[0])  # [T, D]
        g = grad_out.to(weight.dtype).reshape(-1, grad_out.shape[-1])  # [T, D_out]
        grad_w = g.t() @ y  # [D_out, D]
        grad_b = g.sum(0) if ctx.has_bias else None
        del y
        grad_y = (g @ weight).reshape(x.shape).to(x.dtype)  # [.., D]
        mask = [True, norm_weight is not None, norm_bias is not None]
        grad_x, grad_nw, grad_nb = torch.ops.aten.native_layer_norm_backward(
            grad_y, x, shape, mean, rstd, norm_weight, norm_bias, mask
        )
        return grad_x, grad_nw, grad_nb, grad_w, grad_b, None


def norm_linear(x: Tensor, norm: nn.LayerNorm, linear: nn.Linear) -> Tensor:
    """``linear(norm(x))`` over the last dimension, saving only ``x`` for the backward pass.

    Falls back to the two modules where the shortcut would bypass something (see
    :func:`ssl_vit.backbones.gelu_linear.gelu_linear`: no gradient, TorchScript / tracing, a
    ``meta`` device, modules that are not bare or carry hooks) and for a LayerNorm over more than
    the last dimension."""
    bare = all(
        type(m) is t and not (m._forward_hooks or m._forward_pre_hooks) for m, t in ((norm, nn.LayerNorm), (linear, nn.Linear))
    )
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or linear.weight.requires_grad)
    real = torch.amp.is_autocast_available(x.device.type)
    if not (bare and needs_grad and real and len(norm.normalized_shape) == 1) or torch.jit.is_scripting() or torch.jit.is_tracing():
        return linear(norm(x))
    return _NormLinear.apply(x, norm.weight, norm.bias, linear.weight, linear.bias, norm.eps)
