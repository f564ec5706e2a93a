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


def _classes(n: int, seed: int, num_classes: int = 4, dim: int = 8):
    # overlapping Gaussian classes: the LR matters within a few epochs
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % num_classes
    centres = torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(99))
    return centres[y] + 1.5 * torch.randn(n, dim, generator=g), y


SWEEP = [0.001, 0.03, 1.0]


def test_the_heads_of_a_sweep_are_the_heads_of_separate_runs():
    # One head per LR on the same batches: each is bit for bit the head a run at that LR alone
    # trains (no cross-talk through the summed loss, the shared batches or the parameter groups).
    x, y = _classes(300, 0)
    probe = LinearProbe(epochs=3, batch_size=32, base_lr=SWEEP, warmup_epochs=1)
    heads = probe.fit_heads(x, y, 4, SWEEP)
    for lr, head in zip(SWEEP, heads, strict=True):
        alone = LinearProbe(epochs=3, batch_size=32, base_lr=lr, warmup_epochs=1).fit(x, y, 4)
        for a, b in zip(alone.state_dict().values(), head.state_dict().values(), strict=True):
            assert torch.equal(a, b)


def test_a_sweep_picks_on_held_out_training_features_and_trains_again_on_all():
    # Written out: hold out a seeded 20 % of the training set, train a probe per LR on the rest,
    # keep the LR of the best held-out top-1 (ties: the first), train on everything at it.
    xtr, ytr = _classes(400, 1)
    xte, yte = _classes(200, 2)
    settings = {"epochs": 4, "batch_size": 32, "warmup_epochs": 1, "seed": 3}
    probe = LinearProbe(**settings, base_lr=SWEEP, select_fraction=0.2)
    metrics = probe.evaluate(xtr, ytr, xte, yte, num_classes=4)

    perm = torch.randperm(400, generator=torch.Generator().manual_seed(3))
    held, rest = perm[:80], perm[80:]
    scores = {}
    for lr in SWEEP:
        head = LinearProbe(**settings, base_lr=lr).fit(xtr[rest], ytr[rest], 4)
        with torch.no_grad():
            scores[lr] = (head(xtr[held]).argmax(1) == ytr[held]).float().mean().item()
    best = max(SWEEP, key=lambda lr: scores[lr])
    assert len(set(scores.values())) > 1  # the LRs do differ here: the choice is a real one
    assert probe.picked == {"selected_base_lr": best, "select_top1": {f"{lr:g}": pytest.approx(s) for lr, s in scores.items()},
                                 "select_fraction": 0.2}
    assert metrics == LinearProbe(**settings, base_lr=best).evaluate(xtr, ytr, xte, yte, num_classes=4)


def test_a_sweep_breaks_ties_to_the_first_lr_listed_and_trains_the_last_probe_on_every_feature(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x = torch.cat([c + 0.05 * torch.randn(30, 3, generator=g) for c in torch.eye(3) * 5])  # separable: every LR scores 100 %
    y = torch.arange(3).repeat_interleave(30)
    fitted = []
    fit = LinearProbe.fit
    monkeypatch.setattr(LinearProbe, "fit", lambda self, f, *a, **k: fitted.append(len(f)) or fit(self, f, *a, **k))
    for order in ([0.05, 0.2, 0.1], [0.2, 0.1, 0.05]):
        probe = LinearProbe(epochs=3, batch_size=16, base_lr=order, warmup_epochs=0)
        assert probe.evaluate(x, y, x, y)["top1"] == 1.0
        assert set(probe.picked["select_top1"].values()) == {1.0} and probe.picked["selected_base_lr"] == order[0]
        assert fitted[-1] == 90  # the picked LR's probe trains on all 90 training features, the held-out ones too


def test_the_test_split_chooses_nothing():
    xtr, ytr = _classes(300, 4)
    xte, yte = _classes(100, 5)
    picked = []
    for labels in (yte, (yte + 1) % 4):  # a test set the probe gets right, and one it gets wrong
        probe = LinearProbe(epochs=3, batch_size=32, base_lr=SWEEP, warmup_epochs=1)
        probe.evaluate(xtr, ytr, xte, labels, num_classes=4)
        picked.append(probe.picked)
    assert picked[0] == picked[1]


def test_a_sweep_needs_examples_left_to_train_on():
    x, y = _classes(3, 0)
    with pytest.raises(ValueError, match="holds out 2 of 3 training examples"):
        LinearProbe(epochs=1, base_lr=[0.1, 1.0], select_fraction=0.5).evaluate(x, y, x, y, num_classes=4)


@pytest.mark.parametrize("small, want", [(True, 1), (False, 2)])
def test_a_small_probe_trains_on_one_cpu_thread_and_gives_the_pool_back(monkeypatch, small, want):
    import ssl_vit.eval.linear as linear

    monkeypatch.setattr(linear, "SMALL_PROBE", 2**23 if small else 0)
    seen, threads = set(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
        head = LinearProbe(epochs=1, batch_size=16, progress_every_n_seconds=1e9)
        loss = linear.F.cross_entropy
        monkeypatch.setattr(linear.F, "cross_entropy", lambda *a, **k: (seen.add(torch.get_num_threads()), loss(*a, **k))[1])
        head.fit(x, y, 3)
        assert seen == {want} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
