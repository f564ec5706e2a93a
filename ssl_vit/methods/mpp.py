"""Masked patch prediction, exactly as the ViT paper describes it (§4.6, Appendix B.1.2).

50 % of the patch embeddings are corrupted after the projection E and before the position
embedding (80 % -> a shared learnable [mask] embedding, 10 % -> a random other patch's embedding,
10 % unchanged); a linear head on each corrupted patch's output token predicts the patch's 3-bit
mean colour (512 classes; or the 4×4 downsized colours, or L2 on the pixels). Targets come from the
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
from ssl_vit.masking import TargetKind, check_corruption, make_corruption_plan, mpp_targets
from ssl_vit.methods.base import BaseMethod


class MPP(BaseMethod):
    """Masked patch prediction.

    Args:
        target: ``mean_color`` (paper default, best few-shot), ``downsized`` (4×4 cells, 16
            predictions) or ``pixels`` (L2 regression, "slightly worse").
        corruption_ratio: fraction of patches corrupted per image (paper 0.5; BERT 0.15).
        mask_prob, random_prob: BERT's 80/10/10 split among corrupted patches.
        mean, std: the normalisation of the input views, to recover raw pixels for the targets;
            ``None`` takes them from the datamodule (its ``mean``/``std``) when training starts.
        base_lr: LR per 256 images; Appendix B.1.2's 2e-4 at batch 4096 (Adam, cosine decay).
        weight_decay: Appendix B.1.2 gives none for MPP; 0.1 is Table 3's JFT pre-training value.
        **kwargs: the shared arguments of :class:`BaseMethod` (backbone, optimiser, schedule).
            The paper warms up for 10k of its 1M steps: ``warmup_steps=10000`` in the recipe
            (``recipes/imagenet/mpp_vit_base16.yaml``); the default is the shared 10 epochs.
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
            rank_zero_info(
                "[ssl_vit] note: MPP on a hybrid corrupts the stem's feature vectors, but the stem's receptive field spans "
                "neighbouring patches: the uncorrupted tokens already saw the corrupted patches' pixels, an easier task "
                "than on a ViT (the ViT paper ran MPP on ViT-B/16 only)"
            )
        grid = getattr(self.backbone.patch_embed, "grid_size", None)  # (the patches of the built image size)
        check_corruption(corruption_ratio, mask_prob, random_prob, grid[0] * grid[1] if grid else None)
        self.target = target
        self.corruption_ratio = corruption_ratio
        self.mask_prob = mask_prob
        self.random_prob = random_prob
        dim = self.backbone.embed_dim
        # BERT's [mask] embedding, shared by all positions; initialised like the [CLS] token's scale.
        self.mask_token = nn.Parameter(torch.zeros(dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.head = MPPHead(dim, self.backbone.in_chans, self.backbone.patch_size, target)
        self.register_buffer("norm_mean", self._stats(mean), persistent=True)
        self.register_buffer("norm_std", self._stats(std), persistent=True)

    @staticmethod
    def _stats(values: Sequence[float] | None) -> Tensor:
        return torch.tensor(list(values), dtype=torch.float32) if values is not None else torch.empty(0)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        dm = self.trainer.datamodule if self.trainer is not None else None
        for name, attr in (("norm_mean", "mean"), ("norm_std", "std")):
            if getattr(self, name).numel() == 0:
                values = getattr(dm, attr, None)
                if values is None:
                    raise ValueError(
                        f"MPP needs the input normalisation to compute colour targets: pass {attr}= "
                        "to the model or use a datamodule that has a .mean/.std"
                    )
                setattr(self, name, self._stats(values).to(self.device))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # A model built without mean/std takes them from its datamodule at setup; one restored
        # from such a run (load_from_checkpoint, the weights ddp_spawn hands back) takes them
        # from the checkpoint instead of refusing the shapes.
        for name in ("norm_mean", "norm_std"):
            incoming = state_dict.get(prefix + name)
            if incoming is not None and getattr(self, name).numel() == 0:
                setattr(self, name, torch.empty_like(incoming, device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def raw_pixels(self, x: Tensor) -> Tensor:
        """Undo the view normalisation: ``[B, C, H, W]`` back to [0, 1]."""
        c = x.shape[1]
        mean = self.norm_mean.expand(c) if self.norm_mean.numel() == 1 else self.norm_mean
        std = self.norm_std.expand(c) if self.norm_std.numel() == 1 else self.norm_std
        return (x.float() * std.view(1, c, 1, 1) + mean.view(1, c, 1, 1)).clamp_(0.0, 1.0)

    def step(self, views: list[Tensor], labels: Tensor) -> dict[str, Tensor]:
        x = views[0]  # [B, C, H, W], normalised
        b = x.shape[0]
        grid = (x.shape[-2] // self.backbone.patch_size, x.shape[-1] // self.backbone.patch_size)
        n = grid[0] * grid[1]
        plan = make_corruption_plan(
            b, n, self.corruption_ratio, self.mask_prob, self.random_prob, device=x.device
        )
        tokens = self.backbone.forward_features(x, patch_hook=lambda t: plan.apply(t, self.mask_token))  # [B, 1+N, D]
        # Only the corrupted patches are predicted (ViT paper B.1.2), so only their tokens go
        # through the head: every image has exactly k of them, gathered without a host sync.
        idx = plan.corrupted_idx  # [B, k]
        k = idx.shape[1]
        patches = tokens[:, self.backbone.num_prefix_tokens :]  # [B, N, D]
        pred = self.head(torch.gather(patches, 1, idx[..., None].expand(-1, -1, patches.shape[-1])))  # [B, k, ...]
        with torch.no_grad():
            # raw_pixels clamps to [0, 1]: no range check (it would wait for a GPU every step)
            target = mpp_targets(self.raw_pixels(x), self.backbone.patch_size, self.target, check_range=False)  # [B, N, ...]
            target = torch.gather(target, 1, idx.view(b, k, *[1] * (target.ndim - 2)).expand(b, k, *target.shape[2:]))  # [B, k, ...]
        loss = mpp_loss(pred, target, torch.ones(b, k, dtype=torch.bool, device=x.device))
        # The online probe learns from the pooled representation of the corrupted images (a second,
        # clean pass would cost a forward); it is validated on clean ones, pooled the same way
        # (the backbone's global_pool: [CLS] or the patch mean).
        feats = self.backbone.pool(tokens).detach()  # [B, D]
        out: dict[str, Tensor] = {"loss": loss, "features": feats, "embedding_std": embedding_std(feats)}
        if self.target != "pixels":
            with torch.no_grad():
                hit = (pred.argmax(-1) == target).float()
                hit = hit.flatten(2).mean(-1) if hit.ndim > 2 else hit  # [B, k]
                out["masked_acc"] = hit.mean()
        return out
