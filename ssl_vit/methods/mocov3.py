"""MoCo v3 (Chen, Xie, He 2021, "An Empirical Study of Training Self-Supervised Vision Transformers";
reference ``moco/builder.py``, ``vits.py``, ``main_moco.py``).

Query encoder: backbone -> 3-layer projector -> 2-layer predictor; momentum encoder: an EMA copy of
backbone and projector. Loss: ctr(q1, k2) + ctr(q2, k1), InfoNCE scaled by 2τ against the keys of
every process. The reference's fixed sin-cos position embedding is ``backbone_kwargs: {pos_embed:
sincos}``, its 12-head ViT-S the backbone ``vit_small_mocov3``.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from ssl_vit.backbones import is_vit
from ssl_vit.heads import MoCoV3MLP
from ssl_vit.losses import MoCoV3Loss, embedding_std
from ssl_vit.methods.base import BaseMethod, ema_update
from ssl_vit.methods.optim import WeightDecayExempt


class MoCoV3(BaseMethod):
    """MoCo v3.

    Args:
        temperature: τ; None: the paper's, 0.2 for a ViT or hybrid, 1.0 for a ResNet (§4).
        proj_hidden_dim, proj_output_dim, pred_hidden_dim: the heads' widths (4096 / 256 / 4096).
        momentum, momentum_end: the momentum encoder's cosine schedule (0.99 -> 1).
        freeze_patch_embed: §4's random patch projection: a ViT's drawn as ``vits.py`` draws it
            (Xavier-uniform over the flattened filter) and given no gradient.
        reference_init: a ViT's linear layers initialised as ``vits.py`` (Xavier-uniform, the
            fused QKV as three matrices; else timm's truncated normal).
        weight_decay, warmup_epochs, weight_decay_exempt: the reference's ViT recipe (CONFIG.md:
            AdamW, 1.5e-4 per 256, weight decay 0.1 on every parameter, 40 warm-up epochs of 300).
        **kwargs: the other arguments of :class:`BaseMethod`.
    """

    def __init__(
        self,
        temperature: float | None = None,
        proj_hidden_dim: int = 4096,
        proj_output_dim: int = 256,
        pred_hidden_dim: int = 4096,
        momentum: float = 0.99,
        momentum_end: float = 1.0,
        freeze_patch_embed: bool = True,
        reference_init: bool = True,
        weight_decay: float = 0.1,
        warmup_epochs: float = 40.0,
        weight_decay_exempt: WeightDecayExempt = "none",
        **kwargs: Any,
    ) -> None:
        super().__init__(weight_decay=weight_decay, warmup_epochs=warmup_epochs, weight_decay_exempt=weight_decay_exempt, **kwargs)
        vit = is_vit(self.backbone)
        if vit and reference_init:
            xavier_init_linears(self.backbone)
        if vit and freeze_patch_embed and not hasattr(self.backbone.patch_embed, "backbone"):  # (a hybrid's tokens come from its ResNet stem)
            proj = self.backbone.patch_embed.proj
            bound = math.sqrt(6.0 / (proj.weight[0].numel() + proj.weight.shape[0]))  # vits.py: sqrt(6 / (3·P·P + D))
            nn.init.uniform_(proj.weight, -bound, bound)
            nn.init.zeros_(proj.bias)
            proj.requires_grad_(False)
        # moco/builder.py MoCo_ViT: _build_mlp(3, D, mlp_dim, dim) projects, _build_mlp(2, dim, mlp_dim, dim) predicts.
        self.projector = MoCoV3MLP(self.backbone.embed_dim, proj_hidden_dim, proj_output_dim, num_layers=3)
        self.predictor = MoCoV3MLP(proj_output_dim, pred_hidden_dim, proj_output_dim, num_layers=2)
        self.momentum_backbone = self.target_backbone()
        self.momentum_projector = copy.deepcopy(self.projector).requires_grad_(False)
        self.criterion = MoCoV3Loss(temperature if temperature is not None else 0.2 if vit else 1.0)
        # Both views share a backbone pass unless it normalises over the batch (the reference's
        # MoCo_ResNet encodes each view with its own BatchNorm statistics).
        self.one_pass = not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.backbone.modules())

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # main_moco.py "apply SyncBN" to the whole model: the heads' BatchNorm (and a ResNet's)
        # normalise with the global batch, whatever the split over devices.
        self.sync_batchnorm("backbone", "momentum_backbone", "projector", "predictor", "momentum_projector")
        if self._trainer is not None and (n := self.trainer.accumulate_grad_batches) > 1:
            rank_zero_info(f"[ssl_vit] note: MoCo v3 with accumulate_grad_batches={n}: each query is contrasted with the keys of its "
                           f"micro-batch over all devices, 1/{n} of the effective batch; the paper's large batches are all in one pass")

    def check_views(self, num_views: int) -> None:
        if num_views != 2:
            raise ValueError(f"MoCo v3 needs two views per image, got {num_views} (use TwoViews)")

    def step(self, views: list[Tensor], labels: Tensor) -> dict[str, Tensor]:
        x1, x2 = views  # [B, C, H, W] each
        h1, h2 = self.backbone(torch.cat(views)).chunk(2) if self.one_pass else (self.backbone(x1), self.backbone(x2))  # [B, D]
        # The heads see each view on its own: their BatchNorm statistics are per view, as in the reference.
        q1, q2 = self.predictor(self.projector(h1)), self.predictor(self.projector(h2))  # [B, C]
        with torch.no_grad():  # one view at a time: without a graph, a joint pass only raises the memory peak
            k1, k2 = (self.momentum_projector(self.momentum_backbone(x)) for x in (x1, x2))  # [B, C]
        return {"loss": self.criterion(q1, q2, k1, k2), "features": h1.detach(), "embedding_std": embedding_std(h1),
                "q_std": embedding_std(q1)}

    def after_optimizer_step(self) -> dict[str, float]:
        # Algorithm 1: the momentum encoder follows the query encoder after each update, with a
        # momentum increased from 0.99 to 1 by a half cosine (main_moco.py adjust_moco_momentum).
        m = self.cosine(self.hparams.momentum, self.hparams.momentum_end)
        ema_update(self.backbone, self.momentum_backbone, m)
        ema_update(self.projector, self.momentum_projector, m)
        return {"ema_momentum": m}


def xavier_init_linears(vit: nn.Module) -> None:
    """``vits.py``'s init of a ViT's linear layers: Xavier-uniform, the fused QKV ``[3D, D]`` as
    three ``[D, D]`` matrices (bound sqrt(6 / (D + D))), zero biases."""
    for name, m in vit.named_modules():
        if isinstance(m, nn.Linear):
            fan_out = m.weight.shape[0] // 3 if name.endswith("qkv") else m.weight.shape[0]
            bound = math.sqrt(6.0 / (fan_out + m.weight.shape[1]))
            nn.init.uniform_(m.weight, -bound, bound)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
