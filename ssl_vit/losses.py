"""The methods' losses and collapse monitors. Pure torch (and lightly's DINO loss).

- :class:`MoCoV3Loss`: MoCo v3's symmetric contrastive loss, keys gathered across processes.
- :class:`DINOLoss`: lightly's DINO loss, the teacher temperature given per call
  (:func:`teacher_temperature`: DINO's warm-up of it), or DINOv2's Sinkhorn-Knopp targets.
- :func:`mpp_loss`: masked patch prediction.
- :func:`embedding_std`, :func:`teacher_entropy`, :func:`teacher_student_kl`: collapse monitors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightly.loss import DINOLoss as _LightlyDINOLoss
from lightly.loss.swav_loss import sinkhorn
from lightly.models.modules.center import center_mean
from torch import Tensor, nn

from ssl_vit.runtime import world_info


@torch.no_grad()
def concat_all_gather(x: Tensor) -> Tensor:
    """``x [B, ...]`` of every process, concatenated: ``[W*B, ...]``, without gradient (MoCo v3
    ``concat_all_gather``: the keys are targets). Every process must pass the same B."""
    _, world = world_info()
    if world == 1:
        return x.detach()
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.detach().contiguous())
    return torch.cat(gathered)


def contrastive_loss(q: Tensor, k_all: Tensor, temperature: float, rank: int = 0) -> Tensor:
    """MoCo v3's ``ctr(q, k)`` (Chen, Xie, He 2021, §3, Alg. 1; reference ``contrastive_loss``)::

        ctr(q, k) = 2τ · 1/B Σ_i -log( exp(q̂_i·k̂_{rB+i} / τ) / Σ_j exp(q̂_i·k̂_j / τ) )

    with q̂, k̂ L2-normalised; ``q [B, C]`` this process's queries, ``k_all [W*B, C]`` the keys of
    all W processes (this one's block at ``rank``): every other image of the global batch is a
    negative. The 2τ makes the gradient's scale independent of τ (the reference's choice)."""
    b = q.shape[0]
    assert k_all.shape[0] >= (rank + 1) * b and q.shape[1] == k_all.shape[1], (q.shape, k_all.shape, rank)
    q = F.normalize(q.float(), dim=1)  # [B, C]
    k = F.normalize(k_all.detach().float(), dim=1)  # [W*B, C]
    logits = q @ k.T / temperature  # [B, W*B]
    labels = torch.arange(b, device=q.device) + rank * b  # query i's positive: its own image's key
    return F.cross_entropy(logits, labels) * (2.0 * temperature)


class MoCoV3Loss(nn.Module):
    """``ctr(q1, k2) + ctr(q2, k1)`` (§3, Alg. 1): ``q1, q2 [B, C]`` the predictor outputs of the
    two views, ``k1, k2 [B, C]`` the momentum encoder's of the same views, gathered from every
    process. τ = 0.2 for ViTs (§4; 1.0 for ResNets)."""

    def __init__(self, temperature: float = 0.2) -> None:
        super().__init__()
        self.temperature = temperature

    def forward(self, q1: Tensor, q2: Tensor, k1: Tensor, k2: Tensor) -> Tensor:
        assert q1.shape == q2.shape == k1.shape == k2.shape, "one key per query image: the gather adds the other processes'"
        rank, _ = world_info()
        k1_all, k2_all = concat_all_gather(k1), concat_all_gather(k2)  # [W*B, C]
        return contrastive_loss(q1, k2_all, self.temperature, rank) + contrastive_loss(q2, k1_all, self.temperature, rank)


Centering = Literal["center", "sinkhorn_knopp"]


class DINOLoss(_LightlyDINOLoss):
    """DINO's loss (Caron et al. 2021, §3.1, Alg. 1), lightly's implementation::

        L = 1/|P| Σ_{(t, s) ∈ P} 1/B Σ_b H(P_t, P_s),  P_t = softmax((g_t - c) / τ_t),  P_s = softmax(g_s / τ_s)

    over the pairs P of a teacher global view t and a student view s ≠ t, then the centre
    ``c <- m c + (1 - m) mean(teacher outputs)`` over the views and the global batch (all-reduced).
    ``teacher_out``: ``[B, K]`` per global view; ``student_out``: per view, the global ones first.

    Around lightly's: the teacher temperature comes with each call (:func:`teacher_temperature`),
    the teacher outputs are detached, both sides run in float32 (the sharp τ_t = 0.04 softmax is
    fragile in half precision), and with ``defer_center`` (gradient accumulation) the micro-batches
    only collect their means and :meth:`step_center` moves the centre once per optimiser step by
    the whole batch's mean, as the reference's undivided batch does. The collected means are
    buffers, so a skipped step's are put back with the other buffers (``BaseMethod``).

    ``centering="sinkhorn_knopp"``: the teacher's targets are DINOv2's instead (Oquab et al. 2023,
    §4; reference ``dinov2/loss/dino_clstoken_loss.py``, ``sinkhorn_knopp_teacher``): three
    Sinkhorn-Knopp iterations on ``exp(g_t / τ_t)`` over the global batch of global views (lightly's
    ``sinkhorn``), which give every prototype the same mass, so that the teacher can neither settle
    on a few prototypes nor spread uniformly (per micro-batch under gradient accumulation). The centre
    still moves (the collapse monitors use it)."""

    def __init__(self, output_dim: int = 65536, student_temp: float = 0.1, center_momentum: float = 0.9, centering: Centering = "center") -> None:
        super().__init__(output_dim=output_dim, student_temp=student_temp, center_momentum=center_momentum)
        self.centering = centering
        self.defer_center = False
        self.register_buffer("pending", torch.zeros(1, 1, output_dim), persistent=False)  # sum of the micro-batches' means
        self.register_buffer("pending_count", torch.zeros(()), persistent=False)

    @torch.no_grad()
    def update_center(self, teacher_out: Tensor) -> None:
        if not self.defer_center:
            return super().update_center(teacher_out)
        self.pending += center_mean(teacher_out, dim=(0, 1))  # [1, 1, K], all-reduced: lightly's mean, without the move
        self.pending_count += 1

    @torch.no_grad()
    def step_center(self) -> None:
        """Move the centre by the mean of the collected micro-batch means (once per optimiser step)."""
        if self.pending_count > 0:
            self.center.mul_(self.center_momentum).add_(self.pending / self.pending_count, alpha=1 - self.center_momentum)
        self.pending.zero_()
        self.pending_count.zero_()

    def forward(self, teacher_out: Sequence[Tensor], student_out: Sequence[Tensor], teacher_temp: float) -> Tensor:  # type: ignore[override]
        teacher, student = [t.detach().float() for t in teacher_out], [s.float() for s in student_out]
        if self.centering == "center":
            return super().forward(teacher, student, teacher_temp=teacher_temp)
        t = torch.stack(teacher)  # [G, B, K]
        g, b, k = t.shape
        targets = sinkhorn(t.reshape(g * b, k), iterations=3, epsilon=teacher_temp, gather_distributed=True).reshape(g, b, k)
        log_p = torch.stack(student).div(self.student_temp).log_softmax(dim=-1)  # [V, B, K]
        loss = -torch.einsum("tbk,sbk->ts", targets, log_p)  # [G, V]: summed over the batch
        loss.fill_diagonal_(0)  # a view is not its own target
        self.update_center(t)
        return loss.sum() / ((loss.numel() - g) * b)


def teacher_temperature(epoch: float, warmup_temp: float = 0.04, final_temp: float = 0.07, warmup_epochs: int = 30) -> float:
    """DINO's teacher temperature τ_t at ``epoch`` (§4, reference ``main_dino.py``): at integer
    epochs ``np.linspace(warmup_temp, final_temp, warmup_epochs)[epoch]``, then ``final_temp``;
    fractional epochs interpolate."""
    if epoch >= warmup_epochs:
        return final_temp
    return warmup_temp + (final_temp - warmup_temp) * (epoch / (warmup_epochs - 1) if warmup_epochs > 1 else 0.0)


def mpp_loss(pred: Tensor, target: Tensor) -> Tensor:
    """Masked patch prediction's loss over the corrupted patches given (ViT paper B.1.2):
    cross-entropy for class targets (``pred [..., K]`` over long ``target [...]``: one colour per
    patch, or 16 per downsized patch, each counted alike), mean squared error for pixel targets
    (``pred`` and float ``target`` of one shape)."""
    if target.is_floating_point():
        return F.mse_loss(pred.float(), target.float())
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]).float(), target.reshape(-1))


@torch.no_grad()
def embedding_std(z: Tensor) -> Tensor:
    """Mean over dimensions of the per-dimension std over the batch of L2-normalised ``z [B, d]``:
    about 1/sqrt(d) when spread out, 0 when collapsed (SimSiam §4.1). lightly's
    ``std_of_l2_normalized``, whose module imports plotting libraries."""
    return F.normalize(z.float(), dim=1).std(dim=0).mean()


def _teacher_probs(teacher_out: Tensor, teacher_temp: float, center: Tensor | None) -> Tensor:
    t = teacher_out.float() - (0 if center is None else center.reshape(1, -1).float())  # [B, K]
    return F.softmax(t / teacher_temp, dim=-1)


@torch.no_grad()
def teacher_entropy(teacher_out: Tensor, teacher_temp: float, center: Tensor | None = None) -> Tensor:
    """Mean of H(P_t) over the batch, ``P_t = softmax((t - c) / τ_t)`` of ``teacher_out [B, K]``
    (DINO §5.3, Fig. 7): 0 when one dimension dominates, ln K when uniform."""
    p = _teacher_probs(teacher_out, teacher_temp, center)  # [B, K]
    return -torch.xlogy(p, p).sum(dim=-1).mean()  # xlogy: 0 log 0 = 0


@torch.no_grad()
def teacher_student_kl(teacher_out: Tensor, student_out: Tensor, teacher_temp: float, student_temp: float,
                       center: Tensor | None = None) -> Tensor:
    """Mean of KL(P_t || P_s) over the batch for ``[B, K]`` outputs of the same view (DINO §5.3,
    Fig. 7: H(P_t, P_s) = H(P_t) + KL): 0 when the student copies the teacher."""
    p_t = _teacher_probs(teacher_out, teacher_temp, center)  # [B, K]
    log_p_s = F.log_softmax(student_out.float() / student_temp, dim=-1)  # [B, K]
    return (torch.xlogy(p_t, p_t) - p_t * log_p_s).sum(dim=-1).mean()
