"""The supervised baseline every SSL result is compared against: the same backbone and schedules,
a classifier head and cross-entropy."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from ssl_vit.losses import embedding_std
from ssl_vit.methods.base import BaseMethod
from ssl_vit.methods.probe import labelled_accuracy


class Supervised(BaseMethod):
    """Supervised training of the backbone.

    Args:
        label_smoothing: cross-entropy label smoothing (none in the ViT paper's Table 3 setting;
            DeiT-style recipes use 0.1).
        head_hidden_dim: the ViT paper's pre-training head, "a MLP with one hidden layer" (§3.1): a
            hidden layer of this width with tanh (the reference's ``representation_size``); None: a
            single linear layer (its fine-tuning head). The classifier starts at zero.
        base_lr, weight_decay, grad_clip: the ViT paper's ImageNet setting (Table 3, ViT-B/16: LR
            3e-3 at batch 4096, i.e. 1.875e-4 per 256; weight decay 0.3; global-norm clipping at 1).
        **kwargs: the other arguments of :class:`BaseMethod`; ``num_classes`` (2 or more) is required.
    """

    def __init__(
        self,
        label_smoothing: float = 0.0,
        head_hidden_dim: int | None = None,
        base_lr: float = 3e-3 * 256 / 4096,
        weight_decay: float = 0.3,
        grad_clip: float | None = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(base_lr=base_lr, weight_decay=weight_decay, grad_clip=grad_clip, **kwargs)
        num_classes, dim = self.hparams.num_classes, self.backbone.embed_dim
        if (num_classes or 0) < 2:
            raise ValueError(f"the supervised baseline needs at least 2 classes; the data has {num_classes or 'none (num_classes unset)'} "
                             "(an image folder: one subfolder per class)")
        last = nn.Linear(head_hidden_dim or dim, num_classes)
        nn.init.zeros_(last.weight)  # the ViT paper's zero-initialised head
        nn.init.zeros_(last.bias)
        # [B, D] -> ([B, H] -> tanh ->) [B, classes]
        self.classifier = last if head_hidden_dim is None else nn.Sequential(nn.Linear(dim, head_hidden_dim), nn.Tanh(), last)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        unlabelled = getattr(self.trainer.datamodule, "unlabelled_train_images", 0) if stage == "fit" else 0
        if unlabelled:
            raise ValueError(f"the supervised baseline needs labels, but {unlabelled} training images of "
                             f"{type(self.trainer.datamodule).__name__} have none (label -1): train it on a labelled split")

    def step(self, views: list[Tensor], labels: Tensor) -> dict[str, Tensor]:
        # Other data: checked per batch where it costs no device synchronisation.
        if labels.device.type == "cpu" and bool((labels < 0).any()):
            raise ValueError("the supervised baseline got unlabelled samples (label -1): train it on a labelled split")
        features = self.backbone(views[0])  # [B, D]
        logits = self.classifier(features)  # [B, classes]
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        return {"loss": loss, "features": features.detach(), "acc": (logits.argmax(1) == labels).float().mean(),
                "embedding_std": embedding_std(features)}

    def validation_metrics(self, features: Tensor, labels: Tensor) -> dict[str, Tensor]:
        return {**super().validation_metrics(features, labels), "val/acc": labelled_accuracy(self.classifier(features), labels)}
