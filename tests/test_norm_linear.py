"""norm_linear: linear(layer_norm(x)) keeping only x for backward, against the two modules."""

from __future__ import annotations

import torch
from torch import nn

from ssl_vit.backbones.norm_linear import _NormLinear, norm_linear


def _setup(dtype=torch.float32, tokens=(2, 5), dim=16, out=24, seed=0):
    torch.manual_seed(seed)
    norm, linear = nn.LayerNorm(dim, eps=1e-6).to(dtype), nn.Linear(dim, out).to(dtype)
    with torch.no_grad():  # not the identity init, so the affine gradients are exercised
        norm.weight.normal_(1.0, 0.3)
        norm.bias.normal_(0.0, 0.3)
    x = torch.randn(*tokens, dim, dtype=dtype, requires_grad=True)
    return x, norm, linear


def _run(x, norm, linear, fn, grad_out):
    params = (x, norm.weight, norm.bias, linear.weight, linear.bias)
    for t in params:
        t.grad = None
    y = fn(x, norm, linear)
    y.backward(grad_out)
    return y.detach(), [t.grad.clone() for t in params]


def _saved_bytes(fn, params) -> int:
    """Bytes of the activations autograd keeps (tensors that are not views of a parameter)."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    total = 0

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in param_storages:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_same_values_and_gradients_as_the_modules_bit_for_bit_in_fp32():
    x, norm, linear = _setup(tokens=(4, 33), dim=64, out=96)
    g = torch.randn(4, 33, 96)
    y0, g0 = _run(x, norm, linear, lambda x, n, m: m(n(x)), g)
    y1, g1 = _run(x, norm, linear, norm_linear, g)
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)


def test_keeps_only_the_input_and_row_statistics_for_backward():
    x, norm, linear = _setup(tokens=(8, 50), dim=64, out=96)
    params = [*norm.parameters(), *linear.parameters()]
    plain = _saved_bytes(lambda: linear(norm(x)), params)
    ours = _saved_bytes(lambda: norm_linear(x, norm, linear), params)
    row_stats = 2 * 8 * 50 * 4  # mean and 1/std, fp32
    assert ours == x.numel() * 4 + row_stats
    assert plain == 2 * x.numel() * 4 + row_stats  # + LayerNorm's output, the linear layer's input


def test_gradcheck_in_fp64_against_finite_differences():
    x, norm, linear = _setup(dtype=torch.float64, tokens=(3,), dim=5, out=4)
    args = (x, norm.weight, norm.bias, linear.weight, linear.bias, 1e-6)
    assert torch.autograd.gradcheck(_NormLinear.apply, args)
    assert torch.autograd.gradcheck(_NormLinear.apply, (x, None, None, linear.weight, None, 1e-6))


def test_autocast_bf16_matches_the_modules_and_gives_fp32_gradients():
    x, norm, linear = _setup(tokens=(8, 10), dim=32, out=48)
    g = torch.randn(8, 10, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y0, g0 = _run(x, norm, linear, lambda x, n, m: m(n(x)), g)
        y1, g1 = _run(x, norm, linear, norm_linear, g)
    assert y1.dtype == y0.dtype == torch.bfloat16
    assert torch.allclose(y0.float(), y1.float(), atol=2e-2, rtol=2e-2)
    for a, b in zip(g0, g1):
        assert b.dtype == a.dtype == torch.float32
        assert torch.allclose(a, b, atol=2e-2 * a.abs().max().item(), rtol=0)


def test_falls_back_to_the_modules_where_the_shortcut_would_bypass_something():
    x, norm, linear = _setup()
    with torch.no_grad():
        assert norm_linear(x, norm, linear).grad_fn is None
    assert type(norm_linear(x, norm, linear).grad_fn).__name__ == "_NormLinearBackward"
    seen = []
    norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    y = norm_linear(x, norm, linear)
    assert seen == [x.shape] and type(y.grad_fn).__name__ != "_NormLinearBackward"
