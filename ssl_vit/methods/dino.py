"""DINO (Caron et al. 2021, "Emerging Properties in Self-Supervised Vision Transformers").

Student and teacher: backbone -> DINO head (3-layer MLP, bottleneck 256, L2 norm, weight-normalised
layer to K = 65536). Multi-crop: the teacher sees the 2 global crops, the student all crops; one
backbone pass per resolution. Loss: cross-entropy between the centred, sharpened teacher softmax and
the student softmax over pairs of different views; centre EMA with the all-reduced batch mean.
Teacher momentum cosine 0.996 -> 1, teacher temperature warm-up 0.04 -> 0.07 over 30 epochs,
weight decay cosine 0.04 -> 0.4, gradient clipping 3.0 (per parameter), last layer frozen in the
first epoch (§3.1, Appendix; reference main_dino.py); the paper's drop path 0.1 is the backbone's
``drop_path_rate``, set with the backbone's arguments (``recipes/imagenet/dino_vit_small16.yaml``).
The local crops' position embeddings are resampled as timm resamples them (bicubic, antialiased
when shrinking); the reference's ``interpolate_pos_encoding`` interpolates without antialiasing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ssl_vit.heads import DINOHead
from ssl_vit.losses import (
    DINOLoss,
    embedding_std,
    teacher_entropy,
    teacher_student_kl,
    teacher_temperature,
)
from ssl_vit.methods.base import BaseMethod
from ssl_vit.methods.ema import EMAPairs, make_target
from ssl_vit.methods.grad_clip import ClipMode
from ssl_vit.methods.optim import WeightDecayExempt


class DINO(BaseMethod):
    """DINO.

    Args:
        out_dim: K, the head's output dimension (65536).
        hidden_dim, bottleneck_dim, head_layers: head MLP (2048 / 256 / 3).
        use_bn_in_head: BN in the head MLP (off for ViT).
        norm_last_layer: fix the last layer's weight norm to 1 (on: more stable, §3.1).
        n_global_crops: how many of the views are global (teacher) crops; the rest are local.
        student_temp: τ_s = 0.1.
        teacher_temp, warmup_teacher_temp, warmup_teacher_temp_epochs: τ_t goes linearly from
            ``warmup_teacher_temp`` to ``teacher_temp`` over that many epochs.
        center_momentum: m of the centre EMA (0.9).
        momentum, momentum_end: cosine schedule of the teacher EMA (0.996 -> 1).
        freeze_last_layer_epochs: the head's last layer gets no update in these first epochs.
        base_lr, min_lr, weight_decay, weight_decay_end, weight_decay_exempt, grad_clip,
            grad_clip_mode: the :class:`BaseMethod` arguments with DINO's defaults (reference
            ``main_dino.py``: LR 5e-4 per 256 cosine to 1e-6, weight decay cosine 0.04 -> 0.4 on
            all but biases and 1-D parameters, each parameter's gradient clipped to norm 3.0).
        **kwargs: the other shared arguments of :class:`BaseMethod`.
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
        super().__init__(
            base_lr=base_lr, min_lr=min_lr, weight_decay=weight_decay, weight_decay_end=weight_decay_end,
            weight_decay_exempt=weight_decay_exempt, grad_clip=grad_clip, grad_clip_mode=grad_clip_mode, **kwargs,
        )
        if n_global_crops < 1:
            raise ValueError(f"n_global_crops must be >= 1, got {n_global_crops}")
        dim = self.backbone.embed_dim
        self.head = DINOHead(dim, out_dim, use_bn_in_head, norm_last_layer, head_layers, hidden_dim, bottleneck_dim)
        self.teacher_backbone = self.build_target_backbone()
        self.teacher_head = make_target(self.head)
        self.ema = EMAPairs([(self.backbone, self.teacher_backbone), (self.head, self.teacher_head)], momentum, momentum_end)
        self.criterion = DINOLoss(out_dim, student_temp, center_momentum)
        self.n_global_crops = n_global_crops
        self.student_temp = student_temp
        self.teacher_temp = teacher_temp
        self.warmup_teacher_temp = warmup_teacher_temp
        self.warmup_teacher_temp_epochs = warmup_teacher_temp_epochs
        self.freeze_last_layer_epochs = freeze_last_layer_epochs

    def current_teacher_temp(self) -> float:
        return teacher_temperature(self.current_epoch, self.warmup_teacher_temp, self.teacher_temp, self.warmup_teacher_temp_epochs)

    @staticmethod
    def _by_resolution(views: list[Tensor]) -> list[list[Tensor]]:
        """Consecutive views of the same size, so each resolution takes one backbone pass."""
        groups: list[list[Tensor]] = []
        for v in views:
            if groups and groups[-1][0].shape[-2:] == v.shape[-2:]:
                groups[-1].append(v)
            else:
                groups.append([v])
        return groups

    def check_views(self, num_views: int) -> None:
        g = self.n_global_crops
        if num_views < max(g, 2):
            raise ValueError(f"DINO needs at least {max(g, 2)} views with {g} global crops first, got {num_views}; use MultiCrop")

    def step(self, views: list[Tensor], labels: Tensor) -> dict[str, Tensor]:
        self.check_views(len(views))
        g = self.n_global_crops
        b = views[0].shape[0]
        teacher_temp = self.current_teacher_temp()
        with torch.no_grad():
            t_out = self.teacher_head(self.teacher_backbone(torch.cat(views[:g]))).chunk(g)  # g x [B, K]
        # Student: one backbone pass per resolution (reference MultiCropWrapper), one head pass.
        feats = torch.cat([self.backbone(torch.cat(group)) for group in self._by_resolution(views)])  # [V*B, D]
        s_out = self.head(feats).chunk(len(views))  # V x [B, K]
        center = self.criterion.center.clone()
        loss = self.criterion(list(t_out), list(s_out), teacher_temp=teacher_temp)
        t0 = t_out[0].detach()
        return {
            "loss": loss,
            "features": feats[:b].detach(),
            "embedding_std": embedding_std(feats[:b].detach()),
            "teacher_entropy": teacher_entropy(t0, teacher_temp, center),
            "teacher_student_kl": teacher_student_kl(t0, s_out[0].detach(), teacher_temp, self.student_temp, center),
            "teacher_temp": torch.tensor(teacher_temp),
        }

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # Reference main_dino.py: a student with BatchNorm (ResNet backbone, or BN in the head) and
        # its teacher use SyncBN; a ViT with the default head has none, and this changes nothing.
        self.sync_batchnorm("backbone", "head", "teacher_backbone", "teacher_head")
        self.ema.pairs = [(self.backbone, self.teacher_backbone), (self.head, self.teacher_head)]

    def cancel_gradients(self) -> None:
        # Reference main_dino.py: utils.cancel_gradients_last_layer(epoch, student, freeze_last_layer).
        if self.current_epoch < self.freeze_last_layer_epochs:
            self.head.cancel_last_layer_gradients()

    def on_train_start(self) -> None:
        super().on_train_start()
        # Gradient accumulation: the centre moves once per optimiser step, by the whole batch's
        # mean, as the reference's undivided batch moves it (see DINOLoss).
        self.criterion.defer_center = self.trainer.accumulate_grad_batches > 1

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.step_skipped:  # (known only after the step: its last micro-batch runs inside it)
            self.criterion.discard_pending_center()
        else:
            self.criterion.step_center()
