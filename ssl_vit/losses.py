"""Pretext-task losses and collapse monitors. Pure torch (plus lightly's DINO loss): usable
without Lightning.

- :class:`MoCoV3Loss` — MoCo v3's symmetric contrastive loss with keys gathered across processes.
- :class:`DINOLoss` — lightly's DINO loss with the teacher temperature given per call, and
  :func:`teacher_temperature`, DINO's linear warm-up of that temperature.
- :func:`mpp_loss` — masked patch prediction, on corrupted patches only.
- :func:`embedding_std`, :func:`teacher_entropy`, :func:`teacher_student_kl` — collapse monitors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightly.loss import DINOLoss as _LightlyDINOLoss
from torch import Tensor, nn

from ssl_vit.runtime import world_info

# --------------------------------------------------------------------------------------------
# distributed helpers


@torch.no_grad()
def concat_all_gather(x: Tensor) -> Tensor:
    """Concatenate ``x [B, ...]`` from every process along dim 0 -> ``[world * B, ...]``.

    No gradient flows through the result (MoCo v3 reference ``concat_all_gather``: the keys are
    targets). Every process must pass the same ``B`` (use ``drop_last`` in the data loader). Outside
    a process group, or with one process, it returns ``x`` detached.
    """
    _, world = world_info()
    x = x.detach()
    if world == 1:
        return x
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.contiguous())
    return torch.cat(gathered, dim=0)


# --------------------------------------------------------------------------------------------
# MoCo v3


def contrastive_loss(q: Tensor, k_all: Tensor, temperature: float, rank: int = 0) -> Tensor:
    """MoCo v3 ``ctr(q, k)`` (Chen, Xie, He 2021, §3, Alg. 1; reference ``contrastive_loss``).

    .. math::
        \\mathrm{ctr}(q, k) = 2\\tau \\cdot \\frac{1}{B} \\sum_i
            -\\log \\frac{\\exp(\\hat q_i \\cdot \\hat k_{rB+i} / \\tau)}
                        {\\sum_j \\exp(\\hat q_i \\cdot \\hat k_j / \\tau)}

    with ``q̂, k̂`` L2-normalised. ``q [B, C]`` are this process's queries; ``k_all [W*B, C]`` the
    keys of all ``W`` processes (already gathered, this process's block at ``rank``), so every
    other image in the global batch is a negative. The ``2τ`` factor makes the gradient scale
    independent of ``τ`` (the reference's choice).
    """
    if q.ndim != 2 or k_all.ndim != 2 or q.shape[1] != k_all.shape[1]:
        raise ValueError(
            f"q must be [B, C] and k_all [W*B, C] with the same C, "
            f"got {tuple(q.shape)} and {tuple(k_all.shape)}"
        )
    b = q.shape[0]
    if k_all.shape[0] < (rank + 1) * b:
        raise ValueError(
            f"k_all has {k_all.shape[0]} keys, too few for rank {rank} with local batch {b}"
        )
    q = F.normalize(q.float(), dim=1)  # [B, C]
    k = F.normalize(k_all.detach().float(), dim=1)  # [W*B, C]
    logits = q @ k.T / temperature  # [B, W*B]
    # The positive of query i is its own image's key, in this process's block of the gather.
    labels = torch.arange(b, device=q.device) + rank * b  # [B]
    return F.cross_entropy(logits, labels) * (2.0 * temperature)


class MoCoV3Loss(nn.Module):
    """Symmetric MoCo v3 loss ``ctr(q1, k2) + ctr(q2, k1)`` (§3, Alg. 1).

    ``q1, q2 [B, C]``: predictor outputs of the two views (query encoder); ``k1, k2 [B, C]``:
    momentum-encoder projector outputs of the same views (no gradient). Keys are all-gathered
    across processes when ``torch.distributed`` is initialised with more than one process.
    τ = 0.2 for ViT (§4; 1.0 for ResNet).
    """

    def __init__(self, temperature: float = 0.2) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature

    def forward(self, q1: Tensor, q2: Tensor, k1: Tensor, k2: Tensor) -> Tensor:
        if not q1.shape == q2.shape == k1.shape == k2.shape:
            # The keys are this process's own, one per query image (the gather adds the others').
            raise ValueError(f"q1, q2, k1, k2 must all be [B, C] of one batch, got {', '.join(str(tuple(t.shape)) for t in (q1, q2, k1, k2))}")
        rank, _ = world_info()
        k1_all = concat_all_gather(k1)  # [W*B, C]
        k2_all = concat_all_gather(k2)  # [W*B, C]
        return contrastive_loss(q1, k2_all, self.temperature, rank) + contrastive_loss(
            q2, k1_all, self.temperature, rank
        )


# --------------------------------------------------------------------------------------------
# DINO


class DINOLoss(_LightlyDINOLoss):
    """DINO loss (Caron et al. 2021, §3.1, Alg. 1), lightly's implementation.

    .. math::
        L = \\frac{1}{|P|} \\sum_{(t, s) \\in P} \\frac{1}{B} \\sum_b
            -\\sum_k P_t^{(b)}[k] \\log P_s^{(b)}[k], \\quad
        P_t = \\mathrm{softmax}((g_t - c) / \\tau_t), \\quad P_s = \\mathrm{softmax}(g_s / \\tau_s)

    over the pairs P of (teacher global view t, student view s) with t != s; then the centre
    ``c <- m c + (1 - m) mean(teacher outputs)``, the mean taken over the views and the global
    batch (all-reduced across processes). lightly's ``DINOLoss`` is this function (checked against
    the reference ``main_dino.py: DINOLoss`` and tested numerically); we only fix the interface:
    the teacher temperature is passed on every call (see :func:`teacher_temperature`) instead of
    lightly's deprecated epoch-indexed schedule, teacher outputs are detached (lightly leaves that
    to the caller), and both sides are computed in float32 (the sharp teacher softmax at
    τ_t = 0.04 is fragile in half precision).

    Call with lists of ``[B, K]`` tensors: ``teacher_out`` for the global views, ``student_out``
    for all views with the global views first and in the same order.

    With ``defer_center`` (gradient accumulation: one optimiser step over several micro-batches)
    the centre is not moved by each micro-batch: :meth:`step_center` moves it once per optimiser
    step by the mean of the micro-batches' means, the mean over the step's whole batch, as the
    reference does with the batch undivided.
    """

    def __init__(
        self,
        output_dim: int = 65536,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
    ) -> None:
        super().__init__(
            output_dim=output_dim, student_temp=student_temp, center_momentum=center_momentum
        )
        self.defer_center = False
        self._pending: list[Tensor] = []  # the batch means of this step's micro-batches, [1, 1, K] each

    @torch.no_grad()
    def update_center(self, teacher_out: Tensor) -> None:
        if not self.defer_center:
            super().update_center(teacher_out)
            return
        # lightly's update without the move: the mean over views and the global batch [1, 1, K]
        batch_center = teacher_out.mean(dim=(0, 1), keepdim=True)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(batch_center)
            batch_center = batch_center / dist.get_world_size()
        self._pending.append(batch_center)

    @torch.no_grad()
    def step_center(self) -> None:
        """Move the centre by the deferred micro-batches' mean (once per optimiser step)."""
        if self._pending:
            batch_center = torch.stack(self._pending).mean(dim=0)  # [1, 1, K]
            self.center.mul_(self.center_momentum).add_(batch_center, alpha=1 - self.center_momentum)
        self._pending.clear()

    def discard_pending_center(self) -> None:
        """Forget the deferred micro-batches of a step that was skipped."""
        self._pending.clear()

    def forward(  # type: ignore[override]
        self, teacher_out: Sequence[Tensor], student_out: Sequence[Tensor], teacher_temp: float
    ) -> Tensor:
        if not teacher_out or not student_out:
            raise ValueError("DINOLoss needs at least one teacher view and one student view")
        if len(teacher_out) > len(student_out):
            raise ValueError(
                f"got {len(teacher_out)} teacher views but only {len(student_out)} student views; "
                "the student sees every view, global views first"
            )
        dim = self.center.shape[-1]
        for t in [*teacher_out, *student_out]:
            if t.ndim != 2 or t.shape[-1] != dim or t.shape[0] != teacher_out[0].shape[0]:
                raise ValueError(
                    f"every view's output must be [B, {dim}] with the same B, got {tuple(t.shape)}"
                )
        if teacher_temp <= 0:
            raise ValueError(f"teacher_temp must be > 0, got {teacher_temp}")
        teacher = [t.detach().float() for t in teacher_out]
        student = [s.float() for s in student_out]
        return super().forward(teacher, student, teacher_temp=teacher_temp)


def teacher_temperature(
    epoch: float,
    warmup_temp: float = 0.04,
    final_temp: float = 0.07,
    warmup_epochs: int = 30,
) -> float:
    """DINO teacher temperature τ_t at ``epoch`` (§4 / reference ``main_dino.py``).

    Linear from ``warmup_temp`` to ``final_temp`` over the first ``warmup_epochs`` epochs, then
    constant. At integer epochs it equals the reference's
    ``np.linspace(warmup_temp, final_temp, warmup_epochs)[epoch]`` (so ``final_temp`` is reached
    at epoch ``warmup_epochs - 1``); fractional epochs interpolate for per-step updates.
    """
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if warmup_epochs < 0:
        raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}")
    if epoch >= warmup_epochs:
        return final_temp
    if warmup_epochs == 1:
        return warmup_temp
    frac = min(epoch / (warmup_epochs - 1), 1.0)
    return warmup_temp + (final_temp - warmup_temp) * frac


# --------------------------------------------------------------------------------------------
# Masked patch prediction


def mpp_loss(pred: Tensor, target: Tensor, corrupted: Tensor) -> Tensor:
    """Masked patch prediction loss over the corrupted patches only (ViT paper B.1.2).

    Classification targets (long): ``pred [B, N, K]`` with ``target [B, N]`` (mean colour) or
    ``pred [B, N, 16, K]`` with ``target [B, N, 16]`` (4x4 downsized)::

        L = 1/|M| Σ_{(b,n) ∈ M} mean_cells CE(pred[b, n], target[b, n])

    Regression targets (float): ``pred`` and ``target [B, N, P*P*C]``::

        L = 1/|M| Σ_{(b,n) ∈ M} mean_j (pred[b, n, j] - target[b, n, j])²

    ``M`` = the positions where ``corrupted [B, N]`` is true. Written as a masked mean rather
    than boolean indexing, so it needs no host-device synchronisation.
    """
    if corrupted.ndim != 2 or corrupted.dtype != torch.bool:
        raise ValueError(
            f"corrupted must be a [B, N] bool mask, got {tuple(corrupted.shape)} {corrupted.dtype}"
        )
    if tuple(target.shape[:2]) != tuple(corrupted.shape):
        raise ValueError(
            f"target {tuple(target.shape)} and corrupted {tuple(corrupted.shape)} disagree on [B, N]"
        )
    if target.is_floating_point():
        if pred.shape != target.shape:
            raise ValueError(
                f"regression needs pred and target of one shape, got {tuple(pred.shape)} "
                f"and {tuple(target.shape)}"
            )
        per_patch = (pred.float() - target.float()).pow(2).flatten(2).mean(dim=-1)  # [B, N]
    else:
        if tuple(pred.shape[:-1]) != tuple(target.shape):
            raise ValueError(
                f"classification needs pred [..., K] over target [...], got {tuple(pred.shape)} "
                f"and {tuple(target.shape)}"
            )
        per_cell = F.cross_entropy(
            pred.reshape(-1, pred.shape[-1]).float(), target.reshape(-1), reduction="none"
        ).reshape(target.shape)  # [B, N] or [B, N, 16]
        per_patch = per_cell.flatten(2).mean(dim=-1) if per_cell.ndim > 2 else per_cell  # [B, N]
    weight = corrupted.to(per_patch.dtype)  # [B, N]
    return (per_patch * weight).sum() / weight.sum().clamp(min=1.0)


# --------------------------------------------------------------------------------------------
# Collapse monitors (DINO §5.3 / Fig. 7; SimSiam §4.1)


@torch.no_grad()
def embedding_std(z: Tensor) -> Tensor:
    """Mean over dimensions of the per-dimension std (over the batch) of L2-normalised ``z [B, d]``.

    ≈ 1/sqrt(d) for healthy, spread-out embeddings, → 0 when they collapse to one point
    (SimSiam §4.1). Same as lightly's ``std_of_l2_normalized``, which lives in a debug module that
    imports plotting libraries, hence this copy.
    """
    if z.ndim != 2:
        raise ValueError(f"z must be [B, d], got shape {tuple(z.shape)}")
    return F.normalize(z.float(), dim=1).std(dim=0).mean()


def _teacher_probs(teacher_out: Tensor, teacher_temp: float, center: Tensor | None) -> Tensor:
    t = teacher_out.float()  # [B, K]
    if center is not None:
        t = t - center.reshape(1, -1).float()
    return F.softmax(t / teacher_temp, dim=-1)  # [B, K]


@torch.no_grad()
def teacher_entropy(
    teacher_out: Tensor, teacher_temp: float, center: Tensor | None = None
) -> Tensor:
    """Mean over samples of H(P_t) = -Σ_k P_t[k] log P_t[k], ``P_t = softmax((t - c) / τ_t)``.

    DINO's collapse monitor (§5.3, Fig. 7): → 0 when one dimension dominates, → ln K when the
    output is uniform. ``teacher_out [B, K]``; ``center`` any shape with K values.
    """
    p = _teacher_probs(teacher_out, teacher_temp, center)  # [B, K]
    return -torch.xlogy(p, p).sum(dim=-1).mean()  # xlogy: 0 log 0 = 0


@torch.no_grad()
def teacher_student_kl(
    teacher_out: Tensor,
    student_out: Tensor,
    teacher_temp: float,
    student_temp: float,
    center: Tensor | None = None,
) -> Tensor:
    """Mean over samples of KL(P_t || P_s) = Σ_k P_t[k] (log P_t[k] - log P_s[k]).

    DINO §5.3, Fig. 7: the loss H(P_t, P_s) = H(P_t) + KL(P_t || P_s); KL → 0 means the student
    copies the teacher, which with a collapsed teacher is collapse. ``[B, K]`` outputs of the
    same view(s); ``P_s = softmax(s / τ_s)``.
    """
    if teacher_out.shape != student_out.shape:
        raise ValueError(
            f"teacher and student outputs must match, got {tuple(teacher_out.shape)} "
            f"and {tuple(student_out.shape)}"
        )
    p_t = _teacher_probs(teacher_out, teacher_temp, center)  # [B, K]
    log_p_s = F.log_softmax(student_out.float() / student_temp, dim=-1)  # [B, K]
    return (torch.xlogy(p_t, p_t) - p_t * log_p_s).sum(dim=-1).mean()  # xlogy: 0 log 0 = 0
