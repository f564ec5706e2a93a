from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightly.loss import DINOLoss as LightlyDINOLoss
from lightly.utils.debug import std_of_l2_normalized

from ssl_vit.losses import (
    DINOLoss,
    MoCoV3Loss,
    concat_all_gather,
    contrastive_loss,
    embedding_std,
    mpp_loss,
    teacher_entropy,
    teacher_student_kl,
    teacher_temperature,
)

# ------------------------------------------------------------------------------------------
# MoCo v3


def _ref_ctr(q: torch.Tensor, k_all: torch.Tensor, tau: float, rank: int) -> float:
    """ctr(q, k) written out from MoCo v3 §3 with explicit loops and log-sum-exp."""
    b = q.shape[0]
    total = 0.0
    for i in range(b):
        qi = q[i].double() / q[i].double().norm()
        logits = []
        for j in range(k_all.shape[0]):
            kj = k_all[j].double() / k_all[j].double().norm()
            logits.append(float(qi @ kj) / tau)
        m = max(logits)
        log_z = m + math.log(sum(math.exp(v - m) for v in logits))
        total += -(logits[rank * b + i] - log_z)
    return total / b * 2 * tau


@pytest.mark.parametrize("tau", [0.2, 1.0, 0.07])
def test_contrastive_loss_matches_formula(tau: float) -> None:
    torch.manual_seed(0)
    q, k = torch.randn(5, 8), torch.randn(5, 8)
    got = contrastive_loss(q, k, tau)
    assert got.item() == pytest.approx(_ref_ctr(q, k, tau, 0), rel=1e-5)


def test_mocov3_loss_is_symmetric_sum() -> None:
    torch.manual_seed(1)
    q1, q2, k1, k2 = (torch.randn(6, 4) for _ in range(4))
    loss = MoCoV3Loss(temperature=0.2)
    got = loss(q1, q2, k1, k2)
    want = _ref_ctr(q1, k2, 0.2, 0) + _ref_ctr(q2, k1, 0.2, 0)
    assert got.item() == pytest.approx(want, rel=1e-5)
    # Swapping the views gives the same loss; pairing q1 with k1 does not.
    assert loss(q2, q1, k2, k1).item() == pytest.approx(got.item(), rel=1e-6)
    assert loss(q1, q2, k2, k1).item() != pytest.approx(got.item(), rel=1e-3)


def test_mocov3_loss_refuses_keys_of_another_batch() -> None:
    # One process: 8 keys for 4 queries would make the 4 others silent negatives of another batch.
    q = torch.randn(4, 8)
    with pytest.raises(AssertionError, match="one key per query image"):
        MoCoV3Loss()(q, q, torch.randn(8, 8), torch.randn(8, 8))


def test_contrastive_label_offset_with_fake_gather() -> None:
    torch.manual_seed(2)
    world, b, tau = 3, 4, 0.2
    k_all = torch.randn(world * b, 8)  # what all_gather would return
    q = torch.randn(b, 8)
    values = []
    for rank in range(world):
        got = contrastive_loss(q, k_all, tau, rank=rank).item()
        assert got == pytest.approx(_ref_ctr(q, k_all, tau, rank), rel=1e-5)
        values.append(got)
    assert len({round(v, 5) for v in values}) == world  # the positives move with the rank
    # A query that equals its positive key is the rank's block, not the first block.
    q_match = k_all[b : 2 * b] * 10
    assert contrastive_loss(q_match, k_all, tau, rank=1) < contrastive_loss(
        q_match, k_all, tau, rank=0
    )
    with pytest.raises(AssertionError):  # no block of keys for rank 3
        contrastive_loss(q, k_all, tau, rank=3)


def test_the_keys_get_no_gradient() -> None:
    # MoCo: keys come from the momentum encoder, without gradient, also when a caller passes keys
    # that require one: through the loss, ctr alone, and the gather (one process: the keys themselves)
    q1, q2, k1, k2 = (torch.randn(4, 8, requires_grad=True) for _ in range(4))
    MoCoV3Loss()(q1, q2, k1, k2).backward()
    assert q1.grad is not None and q2.grad is not None and k1.grad is None and k2.grad is None
    q1.grad = None
    contrastive_loss(q1, k1, 0.2).backward()
    assert q1.grad is not None and k1.grad is None
    out = concat_all_gather(k1)
    assert torch.equal(out, k1) and not out.requires_grad


def test_mocov3_loss_wiring_with_simulated_process_group(monkeypatch) -> None:  # noqa: ANN001
    # In-process stand-in for a 2-process group: rank 1 sees rank 0's keys come back first.
    import ssl_vit.losses as losses

    torch.manual_seed(4)
    world, b, rank = 2, 3, 1
    q1, q2, k1, k2 = (torch.randn(world * b, 5) for _ in range(4))
    sl = slice(rank * b, (rank + 1) * b)

    def fake_all_gather(out: list[torch.Tensor], x: torch.Tensor) -> None:
        full = k1 if torch.equal(x, k1[sl]) else k2
        for r in range(world):
            out[r].copy_(full[r * b : (r + 1) * b])

    monkeypatch.setattr(losses, "world_info", lambda: (rank, world))
    monkeypatch.setattr(losses.dist, "all_gather", fake_all_gather)
    assert torch.equal(concat_all_gather(k1[sl]), k1)
    got = MoCoV3Loss(0.2)(q1[sl], q2[sl], k1[sl], k2[sl]).item()
    want = _ref_ctr(q1[sl], k2, 0.2, rank) + _ref_ctr(q2[sl], k1, 0.2, rank)
    assert got == pytest.approx(want, rel=1e-5)


def _dist_worker(rank: int, world: int, tmp: str, q1, q2, k1, k2) -> None:  # noqa: ANN001
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        b = q1.shape[0] // world
        sl = slice(rank * b, (rank + 1) * b)
        gathered = concat_all_gather(k1[sl])
        loss = MoCoV3Loss(0.2)(q1[sl], q2[sl], k1[sl], k2[sl])
        torch.save((gathered, loss.detach()), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns two interpreters (each imports torch and lightly)
def test_mocov3_loss_distributed_matches_global_batch(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(3)
    world, b = 2, 3
    q1, q2, k1, k2 = (torch.randn(world * b, 5) for _ in range(4))
    mp.spawn(_dist_worker, args=(world, str(tmp_path), q1, q2, k1, k2), nprocs=world, join=True)
    losses = []
    for rank in range(world):
        gathered, loss = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert torch.equal(gathered, k1)
        sl = slice(rank * b, (rank + 1) * b)
        want = _ref_ctr(q1[sl], k2, 0.2, rank) + _ref_ctr(q2[sl], k1, 0.2, rank)
        assert loss.item() == pytest.approx(want, rel=1e-5)
        losses.append(loss.item())
    # The mean over ranks is the single-process loss on the global batch.
    assert sum(losses) / world == pytest.approx(MoCoV3Loss(0.2)(q1, q2, k1, k2).item(), rel=1e-5)


# ------------------------------------------------------------------------------------------
# DINO


def _ref_dino(teacher, student, center, t_temp, s_temp) -> float:  # noqa: ANN001
    """DINO §3.1 / Alg. 1: mean over pairs (global view t, view s), t != s, of the batch mean of
    H(P_t, P_s), with P_t = softmax((g_t - c) / τ_t), P_s = softmax(g_s / τ_s)."""
    total, pairs = 0.0, 0
    for it, t in enumerate(teacher):
        pt = np.exp((t.double().numpy() - center) / t_temp)
        pt /= pt.sum(axis=1, keepdims=True)
        for js, s in enumerate(student):
            if js == it:
                continue
            z = s.double().numpy() / s_temp
            log_ps = z - z.max(axis=1, keepdims=True)
            log_ps -= np.log(np.exp(log_ps).sum(axis=1, keepdims=True))
            total += float((-(pt * log_ps).sum(axis=1)).mean())
            pairs += 1
    return total / pairs


def _views(n_global: int, n_local: int, b: int, k: int, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    teacher = [torch.randn(b, k, generator=g) for _ in range(n_global)]
    student = [torch.randn(b, k, generator=g) for _ in range(n_global + n_local)]
    return teacher, student


@pytest.mark.parametrize("n_global,n_local", [(2, 0), (2, 4), (1, 2)])
def test_dino_loss_matches_formula(n_global: int, n_local: int) -> None:
    b, k, t_temp = 5, 11, 0.05
    teacher, student = _views(n_global, n_local, b, k)
    loss_fn = DINOLoss(output_dim=k)
    assert loss_fn.student_temp == 0.1 and loss_fn.center_momentum == 0.9
    center = torch.randn(k) * 0.3
    loss_fn.center.copy_(center.reshape(loss_fn.center.shape))
    got = loss_fn(teacher, student, teacher_temp=t_temp)
    want = _ref_dino(teacher, student, center.double().numpy(), t_temp, 0.1)
    assert got.item() == pytest.approx(want, rel=1e-5)


def _ref_sinkhorn_knopp_targets(teacher, t_temp: float, iterations: int = 3) -> list[np.ndarray]:  # noqa: ANN001
    """DINOv2 §4 (Oquab et al. 2023): Q = exp(g / τ_t) over the N samples of every global view and
    the K prototypes, scaled to sum 1, then alternately each prototype's mass set to 1/K and each
    sample's to 1/N; times N, each sample's target is a distribution."""
    q = np.exp(np.concatenate([t.double().numpy() for t in teacher]) / t_temp)  # [N, K]
    q /= q.sum()
    n, k = q.shape
    for _ in range(iterations):
        q /= q.sum(axis=0, keepdims=True) * k
        q /= q.sum(axis=1, keepdims=True) * n
    return np.split(q * n, len(teacher))


@pytest.mark.parametrize("n_global,n_local", [(2, 0), (2, 4)])
def test_dino_loss_with_sinkhorn_knopp_targets_matches_dinov2s_formula(n_global: int, n_local: int) -> None:
    b, k, t_temp, s_temp = 6, 13, 0.05, 0.1
    teacher, student = _views(n_global, n_local, b, k, seed=3)
    teacher[0][:, 0] += 2.0  # one prototype favoured: the centre would need steps to undo it, the targets do not
    loss_fn = DINOLoss(output_dim=k, centering="sinkhorn_knopp")
    targets = _ref_sinkhorn_knopp_targets(teacher, t_temp)
    pairs = [(it, js) for it in range(n_global) for js in range(len(student)) if it != js]
    log_ps = [F.log_softmax(s.double() / s_temp, dim=1).numpy() for s in student]
    want = sum(float(-(targets[it] * log_ps[js]).sum(axis=1).mean()) for it, js in pairs) / len(pairs)
    assert loss_fn(teacher, student, teacher_temp=t_temp).item() == pytest.approx(want, rel=1e-5)
    mass = np.concatenate(targets).sum(axis=0)  # per prototype: near N / K, where the softmax gives prototype 0 most
    softmax_mass = F.softmax(torch.cat(teacher) / t_temp, dim=1).sum(dim=0).numpy()
    even = n_global * b / k
    assert mass[0] < 1.5 * even < softmax_mass[0] and np.abs(mass - even).max() < 0.5 * np.abs(softmax_mass - even).max()
    student = [s.requires_grad_() for s in student]
    DINOLoss(output_dim=k, centering="sinkhorn_knopp")(teacher, student, teacher_temp=t_temp).backward()
    assert all(s.grad is not None for s in student)


def test_dino_center_update() -> None:
    b, k, m = 4, 7, 0.9
    teacher, student = _views(2, 2, b, k, seed=1)
    loss_fn = DINOLoss(output_dim=k, center_momentum=m)
    c0 = torch.randn(k)
    loss_fn.center.copy_(c0.reshape(loss_fn.center.shape))
    loss_fn(teacher, student, teacher_temp=0.04)
    batch_mean = torch.cat(teacher).mean(dim=0)  # over views and samples
    assert torch.allclose(loss_fn.center.reshape(-1), m * c0 + (1 - m) * batch_mean, atol=1e-6)
    # Centring uses the centre *before* this batch's update: a second call with the updated
    # centre gives a different loss.
    first = _ref_dino(teacher, student, c0.numpy(), 0.04, 0.1)
    second = loss_fn(teacher, student, teacher_temp=0.04).item()
    assert second != pytest.approx(first, rel=1e-4)


def test_dino_loss_agrees_with_lightly() -> None:
    b, k = 6, 9
    teacher, student = _views(2, 3, b, k, seed=2)
    ours = DINOLoss(output_dim=k)
    theirs = LightlyDINOLoss(output_dim=k, student_temp=0.1, center_momentum=0.9)
    for t_temp in (0.04, 0.055, 0.07):  # three steps, the centres evolve together
        a = ours(teacher, student, teacher_temp=t_temp)
        c = theirs(teacher, student, teacher_temp=t_temp)
        assert a.item() == pytest.approx(c.item(), rel=1e-6)
        assert torch.allclose(ours.center, theirs.center)


def test_dino_loss_gradient_only_to_student() -> None:
    teacher, student = _views(2, 2, 3, 5)
    teacher = [t.requires_grad_() for t in teacher]
    student = [s.requires_grad_() for s in student]
    DINOLoss(output_dim=5)(teacher, student, teacher_temp=0.04).backward()
    assert all(t.grad is None for t in teacher)
    assert all(s.grad is not None for s in student)


def test_teacher_temperature_schedule_matches_reference() -> None:
    epochs, warm = 100, 30
    # main_dino.py: linspace over the warm-up epochs, then constant.
    ref = np.concatenate((np.linspace(0.04, 0.07, warm), np.ones(epochs - warm) * 0.07))
    got = [teacher_temperature(e) for e in range(epochs)]
    assert np.allclose(got, ref)
    assert teacher_temperature(0.5) == pytest.approx(0.04 + 0.03 * 0.5 / 29)
    assert teacher_temperature(3, warmup_epochs=0) == 0.07
    assert teacher_temperature(0, warmup_epochs=0) == 0.07  # no warm-up: the final value from the start
    assert teacher_temperature(1, warmup_epochs=1) == 0.07  # linspace(0.04, 0.07, 1) = [0.04], then 0.07
    assert teacher_temperature(0, warmup_epochs=1) == 0.04
    assert teacher_temperature(5, 0.04, 0.04) == 0.04


# ------------------------------------------------------------------------------------------
# collapse monitors


def test_embedding_std() -> None:
    torch.manual_seed(0)
    z = torch.randn(512, 64)
    assert embedding_std(z).item() == pytest.approx(std_of_l2_normalized(z).item(), rel=1e-6)
    assert embedding_std(z).item() == pytest.approx(1 / math.sqrt(64), rel=0.05)
    collapsed = torch.randn(1, 64).repeat(512, 1) + 1e-6 * torch.randn(512, 64)
    assert embedding_std(collapsed).item() < 1e-4


def test_teacher_entropy() -> None:
    k = 16
    uniform = torch.zeros(4, k)
    assert teacher_entropy(uniform, 0.04).item() == pytest.approx(math.log(k), rel=1e-6)
    peaked = torch.zeros(4, k)
    peaked[:, 3] = 10.0
    assert teacher_entropy(peaked, 0.04).item() < 1e-6
    # Centring removes a shared peak again.
    assert teacher_entropy(peaked, 0.04, center=peaked[0]).item() == pytest.approx(math.log(k))
    torch.manual_seed(0)
    t = torch.randn(5, k)
    p = np.exp(t.double().numpy() / 0.1)
    p /= p.sum(axis=1, keepdims=True)
    want = float((-(p * np.log(p)).sum(axis=1)).mean())
    assert teacher_entropy(t, 0.1).item() == pytest.approx(want, rel=1e-5)


def test_teacher_student_kl() -> None:
    torch.manual_seed(0)
    t, s, c = torch.randn(6, 10), torch.randn(6, 10), torch.randn(10) * 0.1
    pt = F.softmax((t - c) / 0.05, dim=-1).double()
    ps = F.softmax(s / 0.1, dim=-1).double()
    want = (pt * (pt.log() - ps.log())).sum(-1).mean().item()
    assert teacher_student_kl(t, s, 0.05, 0.1, center=c).item() == pytest.approx(want, rel=1e-4)
    # KL = H(P_t, P_s) - H(P_t), the DINO loss of a single pair decomposed.
    ce = -(pt * ps.log()).sum(-1).mean().item()
    ent = teacher_entropy(t, 0.05, center=c).item()
    assert teacher_student_kl(t, s, 0.05, 0.1, center=c).item() == pytest.approx(ce - ent, rel=1e-4)
    assert teacher_student_kl(t, t, 0.1, 0.1).item() == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------------------------------
# masked patch prediction (ViT paper B.1.2), over the corrupted patches the caller gathers


def test_mpp_loss_mean_color_is_the_mean_cross_entropy_of_the_corrupted_patches() -> None:
    torch.manual_seed(0)
    b, n, k = 3, 6, 512
    pred = torch.randn(b, n, k)
    target = torch.randint(0, k, (b, n))
    corrupted = torch.rand(b, n) < 0.5
    corrupted[0, 0] = True
    terms = [-F.log_softmax(pred[i, j], dim=-1)[target[i, j]].item() for i in range(b) for j in range(n) if corrupted[i, j]]
    assert mpp_loss(pred[corrupted], target[corrupted]).item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)


def test_mpp_loss_downsized_counts_each_cell() -> None:
    torch.manual_seed(1)
    b, n, k = 2, 4, 8
    pred = torch.randn(b, n, 16, k)
    target = torch.randint(0, k, (b, n, 16))
    corrupted = torch.tensor([[True, False, True, False], [False, False, False, True]])
    cells = [-F.log_softmax(pred[i, j, c], dim=-1)[target[i, j, c]].item() for i in range(b) for j in range(n) if corrupted[i, j] for c in range(16)]
    assert mpp_loss(pred[corrupted], target[corrupted]).item() == pytest.approx(sum(cells) / len(cells), rel=1e-5)


def test_mpp_loss_pixels_is_the_mean_squared_error() -> None:
    torch.manual_seed(2)
    pred, target = torch.randn(2, 5, 48, requires_grad=True), torch.rand(2, 5, 48)
    want = ((pred.detach() - target) ** 2).mean()
    loss = mpp_loss(pred, target)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    loss.backward()
    torch.testing.assert_close(pred.grad, 2 * (pred.detach() - target) / pred.numel())


def test_dino_centre_deferred_over_micro_batches_moves_by_the_whole_batch_mean():
    # DINO: c <- m c + (1 - m) mean(teacher outputs over the views and the whole batch), once per
    # optimiser step; here the batch comes in two micro-batches of 4.
    torch.manual_seed(0)
    k, m = 8, 0.9
    loss = DINOLoss(output_dim=k, center_momentum=m)
    loss.defer_center = True
    c0 = torch.randn(1, 1, k)
    loss.center.copy_(c0)
    teachers = [[torch.randn(4, k) for _ in range(2)] for _ in range(2)]
    for t in teachers:
        loss(t, [v.clone() for v in t] + [torch.randn(4, k)], teacher_temp=0.04)
    assert torch.equal(loss.center, c0)  # not moved by the micro-batches
    loss.step_center()
    whole = torch.cat([torch.stack(t) for t in teachers], dim=1)  # [views, 8, K]
    expected = m * c0 + (1 - m) * whole.mean(dim=(0, 1), keepdim=True)
    assert torch.allclose(loss.center, expected, atol=1e-6)
    loss.step_center()  # nothing pending: no move
    assert torch.allclose(loss.center, expected, atol=1e-6)

