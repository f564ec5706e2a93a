"""Adam state made ahead of a parameter's first gradient changes nothing: the same updates, the
same moments, as an optimizer that made it lazily (compared step by step)."""

from __future__ import annotations

import pytest
import torch

from ssl_vit.methods.optim import materialize_adam_state


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.05),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.05, amsgrad=True),
    lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.05, fused=True),
], ids=["adamw", "adamw-amsgrad", "adam-for-loop", "adamw-fused"])
def test_state_made_ahead_gives_the_same_steps(make) -> None:
    _same_steps(make)


@pytest.mark.parametrize("fused", [False, True])
def test_state_made_ahead_under_a_double_default_dtype(fused: bool) -> None:
    # torch keeps the step counter in the default dtype, except a fused (or capturable) Adam's: float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _same_steps(lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.05, fused=fused))
    finally:
        torch.set_default_dtype(previous)


def _same_steps(make) -> None:
    lazy_params, eager_params = _params(), _params()
    lazy, eager = make(lazy_params), make(eager_params)
    g = torch.Generator().manual_seed(1)
    # The second parameter has no gradient in the first two steps (a frozen layer), then has one.
    for step in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in lazy_params]
        for params in (lazy_params, eager_params):
            for p, grad in zip(params, grads):
                p.grad = None if (p is params[1] and step < 2) else grad.clone()
        materialize_adam_state(eager)  # (a second call leaves the state alone: the steps agree below)
        assert all(eager.state[p] for p in eager_params)
        lazy.step()
        eager.step()
        for a, b in zip(lazy_params, eager_params):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(lazy_params, eager_params):
        sa, sb = lazy.state[a], eager.state[b]
        assert set(sa) == set(sb)
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0)
            assert sa[key].dtype == sb[key].dtype and sa[key].device == sb[key].device


def test_a_parameter_without_gradients_is_left_alone_but_has_state() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.5)
    materialize_adam_state(opt)
    opt.step()  # no gradient: no update, weight decay included
    assert torch.equal(p, torch.ones(3)) and float(opt.state[p]["step"]) == 0.0


def test_an_empty_state_entry_is_filled() -> None:
    # optimizer.state is a defaultdict: merely reading state[p] (a logger, a user's code) leaves {}
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    assert opt.state[p] == {}
    materialize_adam_state(opt)
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


def test_other_optimizers_are_not_touched() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    materialize_adam_state(opt)
    assert len(opt.state) == 0


def test_methods_adamw_has_its_state_before_the_first_step() -> None:
    from helpers import TINY_BACKBONE

    from ssl_vit.methods import MoCoV3

    model = MoCoV3(**TINY_BACKBONE, proj_hidden_dim=32, pred_hidden_dim=32, proj_output_dim=16)
    opt = model.configure_optimizers()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(opt.state) == len(trainable) > 0
    for p in trainable:
        assert float(opt.state[p]["step"]) == 0.0 and not opt.state[p]["exp_avg_sq"].any()
