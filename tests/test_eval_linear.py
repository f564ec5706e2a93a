import math

import pytest
import torch

from ssl_vit.eval.linear import LARS, LinearProbe


def _blobs(n: int, seed: int):
    # two unit-variance Gaussian blobs at x = -3 and x = +3: the Bayes error is Phi(-3) = 0.13 %
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = torch.randn(n, 2, generator=g)
    x[:, 0] += 6.0 * y - 3.0
    return x, y


def test_two_gaussian_blobs():
    xtr, ytr = _blobs(512, 0)
    xte, yte = _blobs(400, 1)
    m = LinearProbe(epochs=20, batch_size=64, base_lr=0.1).evaluate(xtr, ytr, xte, yte)
    assert set(m) == {"top1"}  # top-5 is not reported for 2 classes
    assert m["top1"] >= 0.985


def test_separable_features_reach_100_percent_and_are_deterministic():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(10, 64, generator=g) * 3
    ytr, yte = torch.arange(300) % 10, torch.arange(100) % 10
    xtr = centres[ytr] + torch.randn(300, 64, generator=g)
    xte = centres[yte] + torch.randn(100, 64, generator=g)
    probe = LinearProbe(epochs=15, batch_size=32)
    assert probe.evaluate(xtr, ytr, xte, yte) == {"top1": 1.0, "top5": 1.0}
    a, b = probe.fit(xtr, ytr, 10), probe.fit(xtr, ytr, 10)
    assert torch.equal(a.linear.weight, b.linear.weight)
    c = LinearProbe(epochs=15, batch_size=32, seed=1).fit(xtr, ytr, 10)
    assert not torch.equal(a.linear.weight, c.linear.weight)
    # LARS steps are relative (lr * 0.001 * |w|): a few dozen steps need a large LR
    lars = LinearProbe(epochs=15, batch_size=32, optimizer="lars", base_lr=400.0)
    assert lars.evaluate(xtr, ytr, xte, yte)["top1"] == 1.0


def test_lars_step_by_hand():
    # MAE util/lars.py: matrices get the trust ratio eta * |w| / |g| (wd 0), vectors plain SGD
    w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))  # |w| = 5
    b = torch.nn.Parameter(torch.tensor([1.0]))
    w.grad, b.grad = torch.tensor([[0.6, 0.8]]), torch.tensor([0.5])  # |g| = 1
    LARS([w, b], lr=1.0, momentum=0.9, trust_coefficient=0.001).step()
    torch.testing.assert_close(w.data, torch.tensor([[3.0 - 0.6 * 0.005, 4.0 - 0.8 * 0.005]]))
    torch.testing.assert_close(b.data, torch.tensor([0.5]))
    assert math.isclose(0.001 * 5 / 1, 0.005)


def test_lars_gets_maes_base_lr_when_none_is_given():
    # LARS moves a weight by about lr * 0.001 * |w| a step: with SGD's base LR 0.01 the probe
    # stays at chance; MAE's main_linprobe runs LARS at base LR 0.1.
    assert LinearProbe().base_lr == 0.01 and LinearProbe(optimizer="lars").base_lr == 0.1
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(10, 64, generator=g) * 3
    ytr, yte = torch.arange(4000) % 10, torch.arange(500) % 10
    xtr = centres[ytr] + torch.randn(4000, 64, generator=g)
    xte = centres[yte] + torch.randn(500, 64, generator=g)
    default = LinearProbe(epochs=30, batch_size=128, optimizer="lars").evaluate(xtr, ytr, xte, yte)["top1"]
    sgd_lr = LinearProbe(epochs=30, batch_size=128, optimizer="lars", base_lr=0.01).evaluate(xtr, ytr, xte, yte)["top1"]
    assert default > 0.5 > 0.3 > sgd_lr


def test_the_probe_lr_is_scaled_by_the_batch_and_warms_up_then_decays(monkeypatch):
    # MAE main_linprobe.py: lr = base_lr x batch / 256; per step a linear warm-up, then cosine to 0
    import ssl_vit.eval.linear as linear

    lrs, real = [], linear.warmup_cosine

    def spy(opt, *args):
        sched = real(opt, *args)
        step = sched.step  # called after each optimiser step: the LR that step used
        sched.step = lambda: (lrs.append(opt.param_groups[0]["lr"]), step())
        return sched

    monkeypatch.setattr(linear, "warmup_cosine", spy)
    x, y = torch.randn(128, 4), torch.arange(128) % 2
    LinearProbe(epochs=4, batch_size=64, base_lr=0.1, warmup_epochs=1).fit(x, y, 2)  # 2 steps an epoch, 8 in all
    peak = 0.1 * 64 / 256
    assert lrs[:2] == pytest.approx([peak / 2, peak])  # warm-up over the first 2 steps
    # then MAE util/lr_sched.py: peak * 0.5 * (1 + cos(pi * (t - W) / (T - W))), W = 2, T = 8; the
    # last step still trains.
    assert lrs[2:] == pytest.approx([peak * 0.5 * (1 + math.cos(math.pi * (t - 2) / 6)) for t in range(2, 8)])
    assert lrs[-1] > 0
