"""The online linear probe: a label-based accuracy for every run, at almost no cost.

It learns from the *detached* representation, so it never changes what the backbone learns
(lightly's ``OnlineLinearClassifier`` and solo-learn do the same); rows labelled -1 (unlabelled
data) are ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_vit.heads import LinearProbeHead


class OnlineLinearProbe(nn.Module):
    def __init__(self, in_dim: int, num_classes: int) -> None:
        super().__init__()
        self.head = LinearProbeHead(in_dim, num_classes)  # BN without affine + linear (specs §5)

    def training_loss(self, features: Tensor, labels: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Cross-entropy and accuracy on the labelled rows of ``features [B, D]``; ``(None, None)``
        when fewer than two rows are labelled (BatchNorm needs two)."""
        keep = labels >= 0
        if int(keep.sum()) < 2:
            return None, None
        logits = self.head(features[keep])  # [B', C]
        loss = F.cross_entropy(logits, labels[keep])
        acc = (logits.argmax(dim=1) == labels[keep]).float().mean()
        return loss, acc.detach()

    @torch.no_grad()
    def accuracy(self, features: Tensor, labels: Tensor) -> Tensor | None:
        keep = labels >= 0
        if not keep.any():
            return None
        was_training = self.head.training
        self.head.eval()
        logits = self.head(features[keep])
        self.head.train(was_training)
        return (logits.argmax(dim=1) == labels[keep]).float().mean()
