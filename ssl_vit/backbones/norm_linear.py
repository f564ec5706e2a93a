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

from ssl_vit.backbones.gelu_linear import lean_path_applies


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
        if x.dtype != torch.float32 and torch.is_autocast_enabled(x.device.type):
            # LayerNorm in fp32, as CUDA's autocast runs it. (CPU's autocast keeps a bf16 input in
            # bf16: there the plain modules sum the LayerNorm's gradients in bf16, this in fp32.)
            x = x.float()
        shape = (x.shape[-1],)
        y, mean, rstd = torch.native_layer_norm(x, shape, norm_weight, norm_bias, eps)  # [.., D]
        out = F.linear(y, weight, bias)  # [.., D_out]; under autocast, cast as in the plain module
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, weight)
        ctx.compute_dtype = out.dtype  # the linear layer's (autocast's) dtype
        ctx.eps = eps
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        x, mean, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        d = x.shape[-1]
        dtype = ctx.compute_dtype
        if weight.dtype != dtype:
            weight = weight.to(dtype)  # autocast's cast, again (not kept as a second copy)
        y = torch.native_layer_norm(x, (d,), norm_weight, norm_bias, ctx.eps)[0]  # recomputed, [.., D]
        if y.dtype != dtype:
            y = y.to(dtype)
        if grad_out.dtype != dtype:
            grad_out = grad_out.to(dtype)
        g = grad_out.reshape(-1, grad_out.shape[-1])  # [T, D_out]
        grad_w = g.t() @ y.view(-1, d)  # [D_out, D]
        grad_b = g.sum(0) if ctx.has_bias else None
        del y
        grad_y = (g @ weight).view(x.shape)  # [.., D]
        if grad_y.dtype != x.dtype:
            grad_y = grad_y.to(x.dtype)
        mask = [True, norm_weight is not None, norm_bias is not None]
        grad_x, grad_nw, grad_nb = _LN_BACKWARD(grad_y, x, (d,), mean, rstd, norm_weight, norm_bias, mask)
        return grad_x, grad_nw, grad_nb, grad_w, grad_b, None


_LN_BACKWARD = torch.ops.aten.native_layer_norm_backward.default


def norm_linear(x: Tensor, norm: nn.LayerNorm, linear: nn.Linear) -> Tensor:
    """``linear(norm(x))`` over the last dimension, saving only ``x`` for the backward pass.
    Falls back to the two modules where :func:`~ssl_vit.backbones.gelu_linear.lean_path_applies`
    says no, and for a LayerNorm over more than the last dimension."""
    modules = ((norm, nn.LayerNorm), (linear, nn.Linear))
    if len(norm.normalized_shape) != 1 or not lean_path_applies(x, linear.weight, *modules):
        return linear(norm(x))
    return _NormLinear.apply(x, norm.weight, norm.bias, linear.weight, linear.bias, norm.eps)
