"""DINO (Caron et al. 2021, "Emerging Properties in Self-Supervised Vision Transformers", §3.1,
Appendix; reference ``main_dino.py``).

Student and teacher: backbone -> DINO head (3-layer MLP, bottleneck 256, L2 normalisation,
weight-normalised layer to K = 65536). The teacher sees the 2 global crops, the student every crop
(one backbone pass per resolution; the local crops' position embeddings resampled as timm does,
antialiased when shrinking). Loss: the cross-entropy between the centred, sharpened teacher softmax
and the student's over pairs of different views; the centre an EMA of the teacher's all-reduced
batch mean. The paper's drop path 0.1 is the backbone's ``drop_path_rate``.
"""

from __future__ import annotations

import copy
import math
from itertools import groupby
from typing import Any

import torch
from lightly.utils.scheduler import cosine_schedule
from torch import Tensor

from ssl_vit import losses
from ssl_vit.heads import DINOHead
from ssl_vit.methods.base import BaseMethod, ema_update
from ssl_vit.methods.distributed import ClipMode
from ssl_vit.methods.optim import WeightDecayExempt


class DINO(BaseMethod):
    """DINO.

    Args:
        out_dim, hidden_dim, bottleneck_dim, head_layers: the head: K = 65536, MLP 2048 / 256, 3 layers.
        use_bn_in_head: BatchNorm in the head's MLP (off for ViTs).
        norm_last_layer: the last layer's weight norm fixed at 1 (more stable, §3.1).
        n_global_crops: how many of the views, first, are global (teacher) crops; the rest are local.
        student_temp: τ_s = 0.1.
        teacher_temp, warmup_teacher_temp, warmup_teacher_temp_epochs: τ_t rises linearly from
            ``warmup_teacher_temp`` to ``teacher_temp`` over that many epochs.
        center_momentum: the centre's EMA momentum (0.9).
        centering: the teacher's targets: ``center``, DINO's centred softmax, or ``sinkhorn_knopp``,
            DINOv2's (§4), which uses every prototype: on small data the centred teacher can settle
            on a few prototypes that tell images apart by their colour alone.
        momentum, momentum_end: the teacher's cosine schedule (0.996 -> 1).
        freeze_last_layer_epochs: the head's last layer gets no update in these first epochs.
        base_lr ... grad_clip_mode: ``main_dino.py``'s (LR 5e-4 per 256 to 1e-6, weight decay 0.04
            -> 0.4 on all but biases and 1-D parameters, per-parameter clipping at 3.0).
        **kwargs: the other arguments of :class:`BaseMethod`.
    """

    default_encoder = "teacher"  # the paper evaluates the teacher (§3.1, Fig. 6)

    def __init__(
        self,
        out_dim: int = 65536,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        head_layers: int = 3,
        use_bn_in_head: bool = False,
        norm_last_layer: bool = True,
        n_global_crops: int = 2,
        student_temp: float = 0.1,
        teacher_temp: float = 0.07,
        warmup_teacher_temp: float = 0.04,
        warmup_teacher_temp_epochs: int = 30,
        center_momentum: float = 0.9,
        centering: losses.Centering = "center",
        momentum: float = 0.996,
        momentum_end: float = 1.0,
        freeze_last_layer_epochs: int = 1,
        base_lr: float = 5e-4,
        min_lr: float = 1e-6,
        weight_decay: float = 0.04,
        weight_decay_end: float | None = 0.4,
        weight_decay_exempt: WeightDecayExempt = "bias_norm",
        grad_clip: float | None = 3.0,
        grad_clip_mode: ClipMode = "per_param",
        **kwargs: Any,
    ) -> None:
        super().__init__(base_lr=base_lr, min_lr=min_lr, weight_decay=weight_decay, weight_decay_end=weight_decay_end,
                         weight_decay_exempt=weight_decay_exempt, grad_clip=grad_clip, grad_clip_mode=grad_clip_mode, **kwargs)
        self.head = DINOHead(self.backbone.embed_dim, out_dim, use_bn_in_head, norm_last_layer, head_layers, hidden_dim, bottleneck_dim)
        self.teacher_backbone = self.target_backbone()
        self.teacher_head = copy.deepcopy(self.head).requires_grad_(False)
        self.criterion = losses.DINOLoss(out_dim, student_temp, center_momentum, centering)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # main_dino.py: a model with BatchNorm (a ResNet, BN in the head) synchronises it.
        self.sync_batchnorm("backbone", "head", "teacher_backbone", "teacher_head")
        # Gradient accumulation: the centre moves once per optimiser step, by the whole batch's mean.
        self.criterion.defer_center = self._trainer is not None and self.trainer.accumulate_grad_batches > 1

    def check_views(self, num_views: int) -> None:
        if (g := self.hparams.n_global_crops) < 1 or num_views < max(g, 2):
            raise ValueError(f"DINO needs at least {max(g, 2)} views with {g} global crops first, got {num_views}; use MultiCrop"
                             + (" (and n_global_crops >= 1)" if g < 1 else ""))

    def step(self, views: list[Tensor], labels: Tensor) -> dict[str, Tensor]:
        hp, b = self.hparams, views[0].shape[0]
        teacher_temp = losses.teacher_temperature(self.current_epoch, hp.warmup_teacher_temp, hp.teacher_temp, hp.warmup_teacher_temp_epochs)
        with torch.no_grad():
            t_out = self.teacher_head(self.teacher_backbone(torch.cat(views[: hp.n_global_crops]))).chunk(hp.n_global_crops)  # g x [B, K]
        # The student: one backbone pass per run of views of one resolution (reference MultiCropWrapper), one head pass.
        feats = torch.cat([self.backbone(torch.cat(list(run))) for _, run in groupby(views, key=lambda v: v.shape[-2:])])  # [V*B, D]
        s_out = self.head(feats).chunk(len(views))  # V x [B, K]
        center = self.criterion.center.clone()  # the centre this batch is centred with (the loss then moves it)
        loss = self.criterion(t_out, s_out, teacher_temp=teacher_temp)
        # Collapse monitors (§5.3, Fig. 7) on the first global crop.
        return {"loss": loss, "features": feats[:b].detach(), "embedding_std": losses.embedding_std(feats[:b]),
                "teacher_entropy": losses.teacher_entropy(t_out[0], teacher_temp, center),
                "teacher_student_kl": losses.teacher_student_kl(t_out[0], s_out[0], teacher_temp, hp.student_temp, center),
                "teacher_temp": torch.tensor(teacher_temp)}

    def _start_notes(self, per_device: int) -> list[str]:
        # The teacher is the network evaluated. After T steps its initial weights still weigh prod(m_t)
        # in it: on a run short for its momentum, what is evaluated is largely the random initialisation.
        hp, total = self.hparams, self.total_steps
        kept = math.prod(cosine_schedule(t, total + 1, hp.momentum, hp.momentum_end) for t in range(total))
        lines = super()._start_notes(per_device)
        # prod(m_t) <= exp(-T (1 - mean m)), the cosine's mean its midpoint: 1 % at most (none for a smoke run of a few steps)
        enough = math.floor(100 * (1 - 2 * math.log(100) / total)) / 100
        if kept > 0.05 and enough > 0:
            lines.append(f"[ssl_vit] note: DINO's teacher, the network evaluated, keeps about {100 * kept:.0f} % of its random initialisation after "
                         f"{total} steps of momentum {hp.momentum:g} -> {hp.momentum_end:g}: set momentum to {enough:g} or less, or train longer")
        return lines

    def before_optimizer_step(self) -> None:
        # main_dino.py: utils.cancel_gradients_last_layer(epoch, student, freeze_last_layer)
        if self.current_epoch < self.hparams.freeze_last_layer_epochs:
            self.head.cancel_last_layer_gradients()

    def after_optimizer_step(self) -> dict[str, float]:
        # main_dino.py "EMA update for the teacher": a momentum from 0.996 to 1 along a half cosine.
        m = self.cosine(self.hparams.momentum, self.hparams.momentum_end)
        ema_update(self.backbone, self.teacher_backbone, m)
        ema_update(self.head, self.teacher_head, m)
        self.criterion.step_center()  # (when deferred)
        return {"ema_momentum": m}
