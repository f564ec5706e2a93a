"""gelu_linear: fc2(gelu(h)) with GELU's backward written in place, against the two modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.backbones.gelu_linear import gelu_linear


def _pair(dtype=torch.float32, tokens=(2, 5), hidden=16, out=6, seed=0):
    torch.manual_seed(seed)
    fc2 = nn.Linear(hidden, out).to(dtype)
    h = torch.randn(*tokens, hidden, dtype=dtype, requires_grad=True)
    return h, fc2


def _grads(h, fc2, fn, grad_y):
    for t in (h, fc2.weight, fc2.bias):
        t.grad = None
    y = fn(h, fc2)
    y.backward(grad_y)
    return y.detach(), [t.grad.clone() for t in (h, fc2.weight, fc2.bias)]


def test_same_values_and_gradients_as_the_modules_bit_for_bit_in_fp32():
    h, fc2 = _pair(tokens=(4, 33), hidden=64, out=24)
    grad_y = torch.randn(4, 33, 24)
    y0, g0 = _grads(h, fc2, lambda h, m: m(F.gelu(h)), grad_y)
    y1, g1 = _grads(h, fc2, gelu_linear, grad_y)
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)


def test_gradcheck_in_fp64_against_finite_differences():
    h, fc2 = _pair(dtype=torch.float64, tokens=(3,), hidden=5, out=4)
    w = fc2.weight.detach().clone().requires_grad_(True)
    b = fc2.bias.detach().clone().requires_grad_(True)
    from ssl_vit.backbones.gelu_linear import _GELULinear

    assert torch.autograd.gradcheck(_GELULinear.apply, (h, w, b))
    assert torch.autograd.gradcheck(lambda h: _GELULinear.apply(h, w, None), (h,))


def test_autocast_bf16_matches_the_modules_and_gives_fp32_parameter_gradients():
    h, fc2 = _pair(tokens=(8, 10), hidden=32, out=12)
    grad_y = torch.randn(8, 10, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y0, g0 = _grads(h, fc2, lambda h, m: m(F.gelu(h)), grad_y)
        y1, g1 = _grads(h, fc2, gelu_linear, grad_y)
    assert y1.dtype == y0.dtype == torch.bfloat16
    assert torch.allclose(y0.float(), y1.float(), atol=1e-2, rtol=1e-2)
    for a, b in zip(g0, g1):
        assert b.dtype == a.dtype == torch.float32
        assert torch.allclose(a, b, atol=2e-2 * a.abs().max().item(), rtol=0)


def test_falls_back_to_the_modules_where_the_shortcut_would_bypass_something():
    h, fc2 = _pair()
    with torch.no_grad():  # nothing to differentiate: plain modules (what exports trace)
        assert gelu_linear(h, fc2).grad_fn is None
    assert type(gelu_linear(h, fc2).grad_fn).__name__ == "_GELULinearBackward"
    seen = []
    fc2.register_forward_hook(lambda m, i, o: seen.append(o.shape))  # a hook must still fire
    y = gelu_linear(h, fc2)
    assert seen == [y.shape] and type(y.grad_fn).__name__ != "_GELULinearBackward"
