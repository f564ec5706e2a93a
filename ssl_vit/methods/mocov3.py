"""MoCo v3 (Chen, Xie, He 2021, "An Empirical Study of Training Self-Supervised Vision Transformers").

query encoder = backbone -> 3-layer projector -> 2-layer predictor; momentum encoder = EMA copy of
backbone + projector (cosine momentum 0.99 -> 1). Loss: ctr(q1, k2) + ctr(q2, k1), InfoNCE scaled by
2τ with keys gathered from all devices. For ViTs the patch projection is frozen at its random init
(§4 "A Trick for Improving Stability": random patch projection), its linear layers are initialised
as the reference ``vits.py`` does, and a fixed 2-D sin-cos position embedding is the reference's
choice (pass ``backbone_kwargs: {pos_embed: sincos}``). MoCo v3's ViT-S has 12 heads (``vits.py``;
the backbone ``vit_small_mocov3``), not DeiT's 6.
Recipe (reference README / CONFIG.md): AdamW, base LR 1.5e-4 per 256, wd 0.1, 40 warm-up epochs,
300 epochs, batch 4096.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from ssl_vit.backbones import is_vit
from ssl_vit.heads import MoCoV3PredictionHead, MoCoV3ProjectionHead
from ssl_vit.losses import MoCoV3Loss, embedding_std
from ssl_vit.methods.base import BaseMethod
from ssl_vit.methods.ema import EMAPairs, make_target
from ssl_vit.methods.optim import WeightDecayExempt


def xavier_init_linears(vit: nn.Module) -> None:
    """The reference ``vits.py`` initialisation of a ViT's linear layers: Xavier-uniform, with
    the fused QKV projection ``[3D, D]`` treated as three ``[D, D]`` matrices
    (bound sqrt(6 / (D + D))), and zero biases."""
    for name, m in vit.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if name.endswith("qkv"):
            bound = math.sqrt(6.0 / (m.weight.shape[0] // 3 + m.weight.shape[1]))
            nn.init.uniform_(m.weight, -bound, bound)
        else:
            nn.init.xavier_uniform_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


class MoCoV3(BaseMethod):
    """MoCo v3.

    Args:
        temperature: τ of the contrastive loss. None: the paper's value for the backbone, 0.2
            for a ViT or hybrid, 1.0 for a ResNet (§4; reference ``main_moco.py``: ``--moco-t``
            1.0, 0.2 in its ViT commands).
        proj_hidden_dim, proj_output_dim, pred_hidden_dim: head widths (4096 / 256 / 4096).
        momentum, momentum_end: cosine schedule of the momentum encoder (0.99 -> 1).
        freeze_patch_embed: random patch projection (§4): the projection is re-initialised as
            in the reference (Xavier-uniform over the flattened filter) and receives no gradient.
            On by default for ViTs; ignored for ResNets.
        reference_init: initialise the ViT's linear layers as the reference ``vits.py``:
            Xavier-uniform, the Q, K and V matrices each as its own layer, zero biases (timm's
            truncated normal(0.02) otherwise). Ignored for ResNets.
        weight_decay, warmup_epochs, weight_decay_exempt: the :class:`BaseMethod` arguments
            with MoCo v3's defaults (its ViT recipe: weight decay 0.1 on every parameter, as
            ``main_moco.py`` builds ``AdamW(model.parameters(), ...)``; 40 warm-up epochs).
        **kwargs: the other shared arguments of :class:`BaseMethod` (base LR 1.5e-4 per 256).
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
        if reference_init and is_vit(self.backbone):
            xavier_init_linears(self.backbone)
        self.freeze_patch_embed = freeze_patch_embed and is_vit(self.backbone) and hasattr(self.backbone.patch_embed, "proj") and not hasattr(self.backbone.patch_embed, "backbone")
        if self.freeze_patch_embed:
            proj = self.backbone.patch_embed.proj
            # reference vits.py: val = sqrt(6 / (3·P·P + D)); uniform(-val, val) (Xavier over [D, C·P·P]).
            fan = proj.weight[0].numel() + proj.weight.shape[0]
            val = math.sqrt(6.0 / fan)
            nn.init.uniform_(proj.weight, -val, val)
            nn.init.zeros_(proj.bias)
            proj.weight.requires_grad_(False)
            proj.bias.requires_grad_(False)
        dim = self.backbone.embed_dim
        self.projector = MoCoV3ProjectionHead(dim, proj_hidden_dim, proj_output_dim)
        self.predictor = MoCoV3PredictionHead(proj_output_dim, pred_hidden_dim, proj_output_dim)
        self.momentum_backbone = self.build_target_backbone()
        self.momentum_projector = make_target(self.projector)
        self.ema = EMAPairs(
            [(self.backbone, self.momentum_backbone), (self.projector, self.momentum_projector)], momentum, momentum_end
        )
        if temperature is None:
            temperature = 0.2 if is_vit(self.backbone) else 1.0
        self.criterion = MoCoV3Loss(temperature)
        # Views can share one backbone pass only if nothing in it normalises across the batch.
        self._concat_views = not has_batchnorm(self.backbone)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # SyncBN over all devices, as the reference ("apply SyncBN": main_moco.py converts the whole
        # model): the heads' BN, and the backbone's for a ResNet. Queries and keys are then
        # normalised with the global batch's statistics, whatever the split over devices.
        self.sync_batchnorm("backbone", "momentum_backbone", "projector", "predictor", "momentum_projector")
        # The EMA must average the converted modules (the converter returns a new module only when
        # given a bare BN layer, but the pairs are rebuilt rather than assumed).
        self.ema.pairs = [(self.backbone, self.momentum_backbone), (self.projector, self.momentum_projector)]

    def on_train_start(self) -> None:
        super().on_train_start()
        accumulate = self.trainer.accumulate_grad_batches
        if accumulate > 1:
            # The contrast is within what one forward pass sees: accumulation enlarges the batch
            # of the gradient, not the set of negatives (nor the heads' BN batch).
            rank_zero_info(
                f"[ssl_vit] note: MoCo v3 with accumulate_grad_batches={accumulate}: each query is contrasted "
                f"with the keys of its micro-batch over all devices, 1/{accumulate} of the effective batch; "
                "the paper's large batches are all in one pass"
            )

    def _encode(self, encoder: nn.Module, projector: nn.Module, x1: Tensor, x2: Tensor, concat: bool) -> tuple[Tensor, Tensor, Tensor]:
        b = x1.shape[0]
        if concat and self._concat_views:
            h1, h2 = encoder(torch.cat([x1, x2])).split(b)  # one pass for both views, [B, D] each
        else:
            h1, h2 = encoder(x1), encoder(x2)
        # The heads see each view separately: their BN statistics are per view, as in the reference.
        return projector(h1), projector(h2), h1

    def check_views(self, num_views: int) -> None:
        if num_views != 2:
            raise ValueError(f"MoCo v3 needs two views per image, got {num_views} (use TwoViews)")

    def step(self, views: list[Tensor], labels: Tensor) -> dict[str, Tensor]:
        self.check_views(len(views))
        x1, x2 = views
        z1, z2, h1 = self._encode(self.backbone, self.projector, x1, x2, concat=True)
        q1, q2 = self.predictor(z1), self.predictor(z2)  # [B, C]
        with torch.no_grad():
            # One view at a time, as the reference does: without a graph to keep, a pass over
            # both views at once only doubles the transient activations at the memory peak.
            k1, k2, _ = self._encode(self.momentum_backbone, self.momentum_projector, x1, x2, concat=False)  # [B, C]
        loss = self.criterion(q1, q2, k1, k2)
        return {
            "loss": loss,
            "features": h1.detach(),
            "embedding_std": embedding_std(h1.detach()),
            "q_std": embedding_std(q1.detach()),
        }
