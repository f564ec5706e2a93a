"""The ViT's lean backward pass: ``gelu_linear`` (fc2(gelu(h)), GELU's backward written in
place) and ``norm_linear`` (linear(layer_norm(x)) keeping only x), each against its two modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_vit.backbones.lean import _GELULinear, _NormLinear, gelu_linear, norm_linear
from ssl_vit.bench import saved_activation_bytes


@dataclass
class Case:
    """One lean function with its plain twin: ``lean()`` and ``plain()`` compute the same output
    from ``x``; ``tensors`` are everything that gets a gradient; ``hooked`` is a module whose hook
    must force the plain path."""

    lean: Callable[[], Tensor]
    plain: Callable[[], Tensor]
    x: Tensor
    tensors: tuple[Tensor, ...]
    hooked: nn.Module
    backward_name: str
    out_atol: float  # bf16 output tolerance under autocast


def _gelu_case(tokens=(2, 5), hidden=16, out=6, seed=0) -> Case:
    torch.manual_seed(seed)
    fc2 = nn.Linear(hidden, out)
    h = torch.randn(*tokens, hidden, requires_grad=True)
    return Case(
        lambda: gelu_linear(h, fc2), lambda: fc2(F.gelu(h)), h, (h, fc2.weight, fc2.bias), fc2, "_GELULinearBackward", 1e-2
    )


def _norm_case(tokens=(2, 5), dim=16, out=24, seed=0) -> Case:
    torch.manual_seed(seed)
    norm, linear = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, out)
    with torch.no_grad():  # not the identity init, so the affine gradients are exercised
        norm.weight.normal_(1.0, 0.3)
        norm.bias.normal_(0.0, 0.3)
    x = torch.randn(*tokens, dim, requires_grad=True)
    tensors = (x, norm.weight, norm.bias, linear.weight, linear.bias)
    return Case(lambda: norm_linear(x, norm, linear), lambda: linear(norm(x)), x, tensors, norm, "_NormLinearBackward", 2e-2)


# (case builder, kwargs of the fp32 shapes, kwargs of the autocast shapes)
CASES = {
    "gelu_linear": (_gelu_case, {"tokens": (4, 33), "hidden": 64, "out": 24}, {"tokens": (8, 10), "hidden": 32, "out": 12}),
    "norm_linear": (_norm_case, {"tokens": (4, 33), "dim": 64, "out": 96}, {"tokens": (8, 10), "dim": 32, "out": 48}),
}


def _run(case: Case, fn: Callable[[], Tensor], grad_out: Tensor) -> tuple[Tensor, list[Tensor]]:
    for t in case.tensors:
        t.grad = None
    y = fn()
    y.backward(grad_out)
    return y.detach(), [t.grad.clone() for t in case.tensors]


@pytest.mark.parametrize("name", CASES)
def test_same_values_and_gradients_as_the_modules_bit_for_bit_in_fp32(name):
    build, shapes, _ = CASES[name]
    case = build(**shapes)
    g = torch.randn_like(case.plain())
    y0, g0 = _run(case, case.plain, g)
    y1, g1 = _run(case, case.lean, g)
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", CASES)
def test_autocast_bf16_matches_the_modules_and_gives_fp32_gradients(name):
    build, _, shapes = CASES[name]
    case = build(**shapes)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = torch.randn(case.plain().shape)
        y0, g0 = _run(case, case.plain, g)
        y1, g1 = _run(case, case.lean, g)
    assert y1.dtype == y0.dtype == torch.bfloat16
    assert torch.allclose(y0.float(), y1.float(), atol=case.out_atol, rtol=case.out_atol)
    for a, b in zip(g0, g1):
        assert b.dtype == a.dtype == torch.float32
        assert torch.allclose(a, b, atol=2e-2 * a.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_falls_back_to_the_modules_where_the_shortcut_would_bypass_something(name):
    case = CASES[name][0]()
    with torch.no_grad():  # nothing to differentiate: plain modules (what exports trace)
        assert case.lean().grad_fn is None
    assert type(case.lean().grad_fn).__name__ == case.backward_name
    seen = []
    case.hooked.register_forward_hook(lambda m, i, o: seen.append(o.shape))  # a hook must still fire
    y = case.lean()
    assert len(seen) == 1 and type(y.grad_fn).__name__ != case.backward_name
    assert seen[0] == (y.shape if isinstance(case.hooked, nn.Linear) else case.x.shape)


def test_gelu_linear_gradcheck_in_fp64_against_finite_differences():
    torch.manual_seed(0)
    h = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_GELULinear.apply, (h, w, b))
    assert torch.autograd.gradcheck(lambda h: _GELULinear.apply(h, w, None), (h,))


def test_norm_linear_gradcheck_in_fp64_against_finite_differences():
    torch.manual_seed(0)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    nw = (1.0 + 0.3 * torch.randn(5, dtype=torch.float64)).requires_grad_(True)
    nb = (0.3 * torch.randn(5, dtype=torch.float64)).requires_grad_(True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_NormLinear.apply, (x, nw, nb, w, b, 1e-6))
    assert torch.autograd.gradcheck(_NormLinear.apply, (x, None, None, w, None, 1e-6))


def test_norm_linear_keeps_only_the_input_and_row_statistics_for_backward():
    case = _norm_case(tokens=(8, 50), dim=64, out=96)
    params = list(case.tensors[1:])
    plain = saved_activation_bytes(case.plain, params)
    ours = saved_activation_bytes(case.lean, params)
    row_stats = 2 * 8 * 50 * 4  # mean and 1/std, fp32
    assert ours == case.x.numel() * 4 + row_stats
    assert plain == 2 * case.x.numel() * 4 + row_stats  # + LayerNorm's output, the linear layer's input


def _lean_grads(fn, tensors, grad_out):
    for t in tensors:
        t.grad = None
    y = fn()
    y.backward(grad_out)
    return y.detach(), [t.grad.clone() for t in tensors]


def _shifted_norm(dim_or_shape, seed=0):
    torch.manual_seed(seed)
    norm = nn.LayerNorm(dim_or_shape, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
        norm.bias.normal_(0.0, 0.3)
    return norm


def test_norm_linear_over_two_dimensions_is_the_two_modules():
    # A LayerNorm over the last two dimensions is not the fused (last-dimension) one: the plain modules run.
    norm = _shifted_norm((5, 16))
    linear = nn.Linear(16, 8)
    x = torch.randn(2, 5, 16, requires_grad=True)
    tensors = (x, norm.weight, norm.bias, linear.weight, linear.bias)
    g = torch.randn(2, 5, 8)
    y0, g0 = _lean_grads(lambda: linear(norm(x)), tensors, g)
    y1, g1 = _lean_grads(lambda: norm_linear(x, norm, linear), tensors, g)
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)


def test_norm_linear_on_a_bf16_input_under_autocast_normalises_in_fp32():
    # The fused function runs LayerNorm in fp32 under autocast whatever its input's dtype (as CUDA's
    # autocast does: layer_norm is on its fp32 list; CPU's keeps a bf16 input in bf16, so there
    # the plain modules' LayerNorm gradients are bf16 sums): the forward is the modules', and the
    # LayerNorm's gradients are the fp32 LayerNorm backward (torch's autograd on x.float()) of the
    # bf16 gradient the linear layer hands back.
    norm, linear = _shifted_norm(32), nn.Linear(32, 48)
    x = (3.0 * torch.randn(8, 10, 32)).to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(8, 10, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y0 = linear(norm(x)).detach()
        y1, (gx, gnw, gnb, gw, gb) = _lean_grads(lambda: norm_linear(x, norm, linear), (x, norm.weight, norm.bias, linear.weight, linear.bias), g)
    assert torch.equal(y0, y1)
    grad_y = (g.to(torch.bfloat16) @ linear.weight.to(torch.bfloat16)).float()  # the linear layer's input gradient, bf16
    x32 = x.detach().float().requires_grad_(True)
    nw, nb = norm.weight.detach().clone().requires_grad_(True), norm.bias.detach().clone().requires_grad_(True)
    F.layer_norm(x32, (32,), nw, nb, norm.eps).backward(grad_y)
    assert gx.dtype == torch.bfloat16 and torch.equal(gx, x32.grad.to(torch.bfloat16))
    assert torch.equal(gnw, nw.grad) and torch.equal(gnb, nb.grad)


def test_gelu_linear_under_autocast_keeps_the_bf16_input_of_the_linear_layer_and_its_gradients():
    # fp32 h under autocast: GELU runs in fp32, the linear layer in bf16. Autograd keeps the
    # linear layer's bf16 input; the lean function must keep that, not a fp32 copy, and give the
    # same gradients as torch's autograd on fc2(gelu(h)).
    torch.manual_seed(0)
    fc2 = nn.Linear(32, 12)
    h = torch.randn(8, 10, 32, requires_grad=True)
    tensors = (h, fc2.weight, fc2.bias)
    g = torch.randn(8, 10, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y0, g0 = _lean_grads(lambda: fc2(F.gelu(h)), tensors, g)
        y1, g1 = _lean_grads(lambda: gelu_linear(h, fc2), tensors, g)
        plain = saved_activation_bytes(lambda: fc2(F.gelu(h)), [fc2.weight, fc2.bias])
        ours = saved_activation_bytes(lambda: gelu_linear(h, fc2), [fc2.weight, fc2.bias])
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)
    assert ours <= plain


class _ScaledLinear(nn.Linear):
    """A Linear subclass with its own forward (as a LoRA or quantised layer has)."""

    def forward(self, x):
        return 2.0 * super().forward(x) + 1.0


class _ShiftedLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) + 0.5


def test_a_subclass_with_its_own_forward_is_not_bypassed():
    torch.manual_seed(0)
    fc2 = _ScaledLinear(16, 6)
    h = torch.randn(2, 5, 16, requires_grad=True)
    assert torch.equal(gelu_linear(h, fc2), fc2(F.gelu(h)))
    norm, linear = _ShiftedLayerNorm(16), _ScaledLinear(16, 6)
    assert torch.equal(norm_linear(h, norm, linear), linear(norm(h)))
