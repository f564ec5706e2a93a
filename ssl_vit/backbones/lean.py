"""Two pieces of the pre-norm Transformer block with leaner backward passes: the same forward
values and gradients as the plain modules (tested bit for bit in fp32), less memory.

``norm_linear(x, norm, linear)``: autograd keeps LayerNorm's input and output (the linear layer's
input); this keeps the input and the per-row mean and 1/std, and recomputes the output in the
backward pass. In a ViT block (QKV's and fc1's inputs) that is an eighth less saved activation.

``gelu_linear(h, fc2)``: autograd allocates ``∂L/∂a`` ``[T, 4D]`` and then GELU's ``∂L/∂h`` beside
it; here GELU's backward writes into the buffer it reads, so one ``[T, 4D]`` buffer serves both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable


class _NormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None, weight: Tensor,  # type: ignore[override]
                bias: Tensor | None, eps: float) -> Tensor:
        if x.dtype != torch.float32 and torch.is_autocast_enabled(x.device.type):
            # LayerNorm in fp32, as CUDA's autocast runs it. (CPU's autocast keeps a bf16 input in
            # bf16: there the plain modules sum the LayerNorm's gradients in bf16, this in fp32.)
            x = x.float()
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), norm_weight, norm_bias, eps)  # [.., D]
        out = F.linear(y, weight, bias)  # [.., D_out]; under autocast, cast as in the plain module
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, weight)
        ctx.compute_dtype, ctx.eps, ctx.has_bias = out.dtype, eps, bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        x, mean, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        d, dtype = x.shape[-1], ctx.compute_dtype
        weight = weight.to(dtype)  # autocast's cast, again (not kept as a second copy)
        y = torch.native_layer_norm(x, (d,), norm_weight, norm_bias, ctx.eps)[0].to(dtype)  # recomputed, [.., D]
        g = grad_out.to(dtype).reshape(-1, grad_out.shape[-1])  # [T, D_out]
        grad_w = g.t() @ y.view(-1, d)  # [D_out, D]
        grad_b = g.sum(0) if ctx.has_bias else None
        del y
        grad_y = (g @ weight).view(x.shape).to(x.dtype)  # [.., D]
        mask = [True, norm_weight is not None, norm_bias is not None]
        grad_x, grad_nw, grad_nb = torch.ops.aten.native_layer_norm_backward(grad_y, x, (d,), mean, rstd, norm_weight, norm_bias, mask)
        return grad_x, grad_nw, grad_nb, grad_w, grad_b, None


class _GELULinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        # Under autocast these run exactly as in the plain modules (the same ops, the same casts).
        a = F.gelu(h)  # [T, 4D]
        y = F.linear(a, weight, bias)  # [T, D]
        # The linear layer's input in its compute dtype, as autograd keeps it; the weight itself
        # (cast again in backward, rather than kept as a second copy).
        ctx.save_for_backward(h, a.to(y.dtype), weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:  # type: ignore[override]
        h, a, weight = ctx.saved_tensors
        gy = grad_y.to(a.dtype).reshape(-1, grad_y.shape[-1])  # [T, D]
        grad_w = gy.t() @ a.reshape(-1, a.shape[-1])  # [D, 4D]
        grad_b = gy.sum(0) if ctx.has_bias else None  # [D]
        grad = (gy @ weight.to(a.dtype)).view(h.shape).to(h.dtype)  # ∂L/∂a, [.., 4D]
        # ∂L/∂h = gelu'(h) ⊙ ∂L/∂a, written over ∂L/∂a (a buffer made just above, so no one else holds it)
        torch.ops.aten.gelu_backward.grad_input(grad, h, grad_input=grad)
        return grad, grad_w, grad_b


def _applies(x: Tensor, weight: Tensor, *modules: tuple[nn.Module, type[nn.Module]]) -> bool:
    """Whether a lean function may stand in for ``modules`` (``(module, its bare type)`` pairs): a
    gradient is needed, no TorchScript or tracing (exports see plain modules), a device with autocast
    (not ``meta``), and modules of exactly their bare type without hooks (no FSDP unit, LoRA layer)."""
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return False
    if torch.jit.is_scripting() or torch.jit.is_tracing() or not torch.amp.is_autocast_available(x.device.type):
        return False
    return all(type(m) is t and not (m._forward_hooks or m._forward_pre_hooks) for m, t in modules)


def norm_linear(x: Tensor, norm: nn.LayerNorm, linear: nn.Linear) -> Tensor:
    """``linear(norm(x))`` over the last dimension, saving only ``x`` for the backward pass."""
    if len(norm.normalized_shape) != 1 or not _applies(x, linear.weight, (norm, nn.LayerNorm), (linear, nn.Linear)):
        return linear(norm(x))
    return _NormLinear.apply(x, norm.weight, norm.bias, linear.weight, linear.bias, norm.eps)


def gelu_linear(h: Tensor, linear: nn.Linear) -> Tensor:
    """``linear(gelu(h))`` (exact, erf GELU) with one ``[.., 4D]`` gradient buffer."""
    if not _applies(h, linear.weight, (linear, nn.Linear)):
        return linear(F.gelu(h))
    return _GELULinear.apply(h, linear.weight, linear.bias)
