"""Masked patch prediction, as the ViT paper describes it (§4.6, Appendix B.1.2).

50 % of the patch embeddings are corrupted after the projection E and before the position
embedding (80 % -> a shared learnable [mask] embedding, 10 % -> a random other patch's embedding,
10 % unchanged); a linear head on each corrupted patch's output token predicts the patch's 3-bit
mean colour (512 classes; or the 4x4 downsized colours, or L2 on the pixels), computed from the
un-normalised pixels. Paper recipe: Adam, base LR 2e-4 at batch 4096, 10k warm-up steps, cosine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from ssl_vit.backbones import is_vit
from ssl_vit.heads import MPPHead
from ssl_vit.losses import embedding_std, mpp_loss
from ssl_vit.masking import TargetKind, make_corruption_plan, mpp_targets, num_corrupted
from ssl_vit.methods.base import BaseMethod


class MPP(BaseMethod):
    """Masked patch prediction.

    Args:
        target: ``mean_color`` (the paper's, best few-shot), ``downsized`` (4x4 cells, 16
            predictions) or ``pixels`` (L2 regression, "slightly worse").
        corruption_ratio: the fraction of each image's patches corrupted (the paper's 0.5; BERT 0.15).
        mask_prob, random_prob: BERT's 80/10/10 split of the corrupted patches.
        mean, std: the normalisation of the views, undone for the targets; None: the datamodule's
            (its ``mean`` / ``std``) when training starts.
        base_lr: LR per 256 images: Appendix B.1.2's 2e-4 at batch 4096 (Adam, cosine decay).
        weight_decay: B.1.2 gives none for MPP; 0.1 is Table 3's pre-training value.
        **kwargs: the other arguments of :class:`BaseMethod`. The paper warms up for 10k of its 1M
            steps: ``warmup_steps: 10000`` in ``recipes/imagenet/mpp_vit_base16.yaml``.
    """

    def __init__(
        self,
        target: TargetKind = "mean_color",
        corruption_ratio: float = 0.5,
        mask_prob: float = 0.8,
        random_prob: float = 0.1,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        base_lr: float = 2e-4 * 256 / 4096,
        weight_decay: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(base_lr=base_lr, weight_decay=weight_decay, **kwargs)
        if not is_vit(self.backbone):
            raise ValueError(f"masked patch prediction needs a ViT or hybrid backbone, got {self.backbone_name!r}")
        if hasattr(self.backbone.patch_embed, "backbone"):  # a hybrid's ResNet stem makes the tokens
            rank_zero_info("[ssl_vit] note: MPP on a hybrid corrupts the stem's feature vectors, but the stem's receptive field spans "
                           "neighbouring patches: the uncorrupted tokens already saw the corrupted patches' pixels, an easier task "
                           "than on a ViT (the ViT paper ran MPP on ViT-B/16 only)")
        n = self.backbone.grid_size[0] * self.backbone.grid_size[1]
        if not 0 < corruption_ratio <= 1 or num_corrupted(n, corruption_ratio) < 1:
            raise ValueError(f"corruption ratio must be in (0, 1], got {corruption_ratio}, and corrupt at least one patch of an image: "
                             f"round({corruption_ratio} x {n}) = {num_corrupted(n, corruption_ratio)}")
        if mask_prob + random_prob > 1:
            raise ValueError(f"mask_prob + random_prob must be <= 1 (the rest is kept unchanged), got {mask_prob} + {random_prob}")
        # BERT's [mask] embedding, shared by all positions, at the [CLS] token's scale.
        self.mask_token = nn.Parameter(nn.init.trunc_normal_(torch.zeros(self.backbone.embed_dim), std=0.02))
        self.head = MPPHead(self.backbone.embed_dim, self.backbone.in_chans, self.backbone.patch_size, target)
        chans = self.backbone.in_chans  # per channel; NaN until the datamodule's are known (setup); buffers: checkpoints keep them
        for name, value in (("norm_mean", mean), ("norm_std", std)):
            self.register_buffer(name, torch.tensor(value).float().expand(chans).clone() if value else torch.full((chans,), torch.nan))

    def setup(self, stage: str) -> None:
        super().setup(stage)
        dm = self.trainer.datamodule if self._trainer is not None else None
        for buffer, attr in ((self.norm_mean, "mean"), (self.norm_std, "std")):
            if buffer.isnan().any():
                if getattr(dm, attr, None) is None:
                    raise ValueError(f"MPP needs the input normalisation to compute colour targets: pass {attr}= to the model or use "
                                     "a datamodule that has a .mean/.std")
                buffer.copy_(torch.tensor(getattr(dm, attr)).expand(buffer.shape[0]))

    def raw_pixels(self, x: Tensor) -> Tensor:
        """Undo the view normalisation: ``[B, C, H, W]`` back to [0, 1]."""
        return (x.float() * self.norm_std.view(1, -1, 1, 1) + self.norm_mean.view(1, -1, 1, 1)).clamp_(0.0, 1.0)

    def step(self, views: list[Tensor], labels: Tensor) -> dict[str, Tensor]:
        hp, x, p = self.hparams, views[0], self.backbone.patch_size  # x: [B, C, H, W], normalised
        b, n = x.shape[0], (x.shape[-2] // p) * (x.shape[-1] // p)
        plan = make_corruption_plan(b, n, hp.corruption_ratio, hp.mask_prob, hp.random_prob, device=x.device)
        tokens = self.backbone.forward_features(x, patch_hook=lambda t: plan.apply(t, self.mask_token))  # [B, 1+N, D]
        # Only the corrupted patches are predicted (B.1.2), from their own output tokens: each
        # image has exactly k, picked by index (no host sync).
        rows, idx = torch.arange(b, device=x.device)[:, None], plan.corrupted_idx  # [B, 1], [B, k]
        pred = self.head(tokens[:, self.backbone.num_prefix_tokens :][rows, idx])  # [B, k, *target_shape]
        with torch.no_grad():
            target = mpp_targets(self.raw_pixels(x), p, hp.target)[rows, idx]  # [B, k, ...]
        # The online probe learns from the pooled tokens of the corrupted images (a clean pass would
        # cost a forward) and is validated on clean ones, pooled alike (the backbone's global_pool).
        features = self.backbone.pool(tokens).detach()  # [B, D]
        out = {"loss": mpp_loss(pred, target), "features": features, "embedding_std": embedding_std(features)}
        if hp.target != "pixels":
            with torch.no_grad():  # per patch: the hits of its one colour or its 16 cells
                out["masked_acc"] = (pred.argmax(-1) == target).float().mean()
        return out
