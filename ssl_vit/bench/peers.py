"""The peers: each method's training step composed the way lightly's examples compose it, around
timm's ``VisionTransformer`` of the same shape.

- Supervised: timm's ViT with its classifier, cross-entropy with label smoothing 0.1.
- MPP: lightly has no masked patch prediction; the nearest is its SimMIM example
  (``examples/pytorch/simmim.py``): ``MaskedVisionTransformerTIMM`` replaces masked tokens by a
  [mask] token, a linear head reads the masked tokens only. Our MPP's 3-bit mean-colour target
  and 50 % mask ratio are plugged in; BERT's 10 % random / 10 % kept split is left out (it is
  elementwise work, and lightly's masking has no such option).
- MoCo v3: lightly has no MoCo v3 head or loss; composed as its BYOL/MoCo examples do (one
  forward per view, momentum copies by ``copy.deepcopy``, ``update_momentum``): the MoCo v3
  MLPs built from lightly's generic ``ProjectionHead`` blocks (Linear without bias -> BN ->
  ReLU, final BN without affine), the patch projection frozen as the method requires, and
  ``ctr`` written in lightly's style (normalise, ``q kᵀ / τ``, cross-entropy, x 2τ).
- DINO: lightly's ``DINOProjectionHead``, ``DINOLoss`` and ``update_momentum`` as in
  ``examples/pytorch/dino.py`` (one forward per view). The teacher head is built fresh and loaded
  with the student's state dict: ``copy.deepcopy`` of lightly's head fails on current torch
  (``nn.utils.weight_norm`` keeps a non-leaf tensor).
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from lightly.loss import DINOLoss
from lightly.models import utils as lightly_utils
from lightly.models.modules.heads import DINOProjectionHead, ProjectionHead
from lightly.models.modules.masked_vision_transformer_timm import MaskedVisionTransformerTIMM
from lightly.models.utils import deactivate_requires_grad, update_momentum
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import Tensor, nn

from ssl_vit.bench.config import ModelSpec

# The view normalisation assumed by the MPP rows (ours gets the same mean/std).
NORM_MEAN = (0.5, 0.5, 0.5)
NORM_STD = (0.25, 0.25, 0.25)


def timm_vit(spec: ModelSpec, img_size: int, num_classes: int = 0, dynamic_img_size: bool = False) -> TimmViT:
    """timm's ViT of the same shape as ours (pre-norm, LayerNorm eps 1e-6, [CLS] pooling)."""
    return TimmViT(
        img_size=img_size,
        patch_size=spec.patch_size,
        in_chans=spec.in_chans,
        num_classes=num_classes,
        embed_dim=spec.embed_dim,
        depth=spec.depth,
        num_heads=spec.num_heads,
        mlp_ratio=spec.mlp_ratio,
        qkv_bias=True,
        dynamic_img_size=dynamic_img_size,
    )


class PeerModel(nn.Module):
    """What a peer composition provides to the timing loop."""

    def loss(self, views: list[Tensor], labels: Tensor) -> Tensor:
        raise NotImplementedError

    def update_momentum(self, m: float) -> None:
        """EMA of the momentum/teacher copies, after the optimiser step (none by default)."""


class PeerBackbone(PeerModel):
    """timm's ViT alone, forward + backward of a scalar (the backbone row)."""

    def __init__(self, spec: ModelSpec, img_size: int) -> None:
        super().__init__()
        self.vit = timm_vit(spec, img_size)

    def loss(self, views: list[Tensor], labels: Tensor) -> Tensor:
        return self.vit(views[0]).float().mean()


class PeerSupervised(PeerModel):
    def __init__(self, spec: ModelSpec, img_size: int, num_classes: int) -> None:
        super().__init__()
        self.vit = timm_vit(spec, img_size, num_classes=num_classes)

    def loss(self, views: list[Tensor], labels: Tensor) -> Tensor:
        return F.cross_entropy(self.vit(views[0]), labels, label_smoothing=0.1)


class PeerMPP(PeerModel):
    def __init__(self, spec: ModelSpec, img_size: int, mask_ratio: float = 0.5) -> None:
        super().__init__()
        self.backbone = MaskedVisionTransformerTIMM(vit=timm_vit(spec, img_size), pos_embed_initialization="learn")
        self.head = nn.Linear(spec.embed_dim, 8**spec.in_chans)  # 3-bit colour per channel
        self.patch_size = spec.patch_size
        self.mask_ratio = mask_ratio

    def loss(self, views: list[Tensor], labels: Tensor) -> Tensor:
        images = views[0]
        b = images.shape[0]
        idx_keep, idx_mask = lightly_utils.random_token_mask(
            size=(b, self.backbone.sequence_length), mask_ratio=self.mask_ratio, device=images.device
        )
        tokens = self.backbone.encode(images=images, idx_mask=idx_mask)  # [B, 1+N, D]
        pred = self.head(lightly_utils.get_at_index(tokens, idx_mask))  # [B, M, 512]
        with torch.no_grad():
            mean = torch.tensor(NORM_MEAN, device=images.device).view(1, -1, 1, 1)
            std = torch.tensor(NORM_STD, device=images.device).view(1, -1, 1, 1)
            raw = (images.float() * std + mean).clamp(0, 1)
            patches = lightly_utils.patchify(raw, self.patch_size)  # [B, N, P*P*C], channel last
            colour = patches.reshape(b, patches.shape[1], -1, raw.shape[1]).mean(dim=2)  # [B, N, C]
            levels = (colour * 8).floor().clamp(0, 7).long()
            weights = 8 ** torch.arange(raw.shape[1] - 1, -1, -1, device=images.device)
            target = (levels * weights).sum(-1)  # [B, N]
            target = torch.gather(target, 1, idx_mask - 1)  # [B, M]; the sequence has [CLS] first
        return F.cross_entropy(pred.flatten(0, 1).float(), target.flatten())


def _ctr(q: Tensor, k: Tensor, temperature: float) -> Tensor:
    q = F.normalize(q.float(), dim=1)
    k = F.normalize(k.float(), dim=1)
    logits = q @ k.T / temperature
    labels = torch.arange(q.shape[0], device=q.device)
    return F.cross_entropy(logits, labels) * (2 * temperature)


class PeerMoCoV3(PeerModel):
    def __init__(self, spec: ModelSpec, img_size: int, hidden_dim: int, out_dim: int, temperature: float = 0.2) -> None:
        super().__init__()
        d = spec.embed_dim
        self.backbone = timm_vit(spec, img_size)
        self.backbone.patch_embed.proj.requires_grad_(False)  # random patch projection (MoCo v3 §4)
        self.projection_head = ProjectionHead([
            (d, hidden_dim, nn.BatchNorm1d(hidden_dim), nn.ReLU()),
            (hidden_dim, hidden_dim, nn.BatchNorm1d(hidden_dim), nn.ReLU()),
            (hidden_dim, out_dim, nn.BatchNorm1d(out_dim, affine=False), None),
        ])
        self.prediction_head = ProjectionHead([
            (out_dim, hidden_dim, nn.BatchNorm1d(hidden_dim), nn.ReLU()),
            (hidden_dim, out_dim, nn.BatchNorm1d(out_dim, affine=False), None),
        ])
        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)
        self.temperature = temperature

    def forward(self, x: Tensor) -> Tensor:
        return self.prediction_head(self.projection_head(self.backbone(x)))

    def forward_momentum(self, x: Tensor) -> Tensor:
        return self.projection_head_momentum(self.backbone_momentum(x)).detach()

    def loss(self, views: list[Tensor], labels: Tensor) -> Tensor:
        x0, x1 = views
        p0, p1 = self(x0), self(x1)
        z0, z1 = self.forward_momentum(x0), self.forward_momentum(x1)
        return _ctr(p0, z1, self.temperature) + _ctr(p1, z0, self.temperature)

    def update_momentum(self, m: float) -> None:
        update_momentum(self.backbone, self.backbone_momentum, m)
        update_momentum(self.projection_head, self.projection_head_momentum, m)


class PeerDINO(PeerModel):
    def __init__(self, spec: ModelSpec, img_size: int, hidden_dim: int, bottleneck_dim: int, out_dim: int, n_global: int = 2) -> None:
        super().__init__()
        d = spec.embed_dim
        self.student_backbone = timm_vit(spec, img_size, dynamic_img_size=True)  # local crops: other sizes
        with warnings.catch_warnings():  # lightly's head still uses the deprecated nn.utils.weight_norm
            warnings.simplefilter("ignore", FutureWarning)
            self.student_head = DINOProjectionHead(d, hidden_dim, bottleneck_dim, out_dim, batch_norm=False)
            # copy.deepcopy(DINOProjectionHead) raises on current torch (weight_norm's non-leaf weight).
            self.teacher_head = DINOProjectionHead(d, hidden_dim, bottleneck_dim, out_dim, batch_norm=False)
        self.teacher_backbone = copy.deepcopy(self.student_backbone)
        self.teacher_head.load_state_dict(self.student_head.state_dict())
        deactivate_requires_grad(self.teacher_backbone)
        deactivate_requires_grad(self.teacher_head)
        self.criterion = DINOLoss(output_dim=out_dim, warmup_teacher_temp=0.04, teacher_temp=0.04)
        self.n_global = n_global

    def forward(self, x: Tensor) -> Tensor:
        return self.student_head(self.student_backbone(x))

    def forward_teacher(self, x: Tensor) -> Tensor:
        return self.teacher_head(self.teacher_backbone(x))

    def loss(self, views: list[Tensor], labels: Tensor) -> Tensor:
        teacher_out = [self.forward_teacher(v) for v in views[: self.n_global]]
        student_out = [self.forward(v) for v in views]
        return self.criterion(teacher_out, student_out, teacher_temp=0.04)

    def update_momentum(self, m: float) -> None:
        update_momentum(self.student_backbone, self.teacher_backbone, m)
        update_momentum(self.student_head, self.teacher_head, m)
