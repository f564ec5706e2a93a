"""The online linear probe: a label-based accuracy of every run at almost no cost. It learns from
the *detached* representation, so it never changes what the backbone learns (as lightly's
``OnlineLinearClassifier`` and solo-learn); rows labelled -1 (unlabelled data) are ignored."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ssl_vit.heads import LinearProbeHead
from ssl_vit.runtime import world_info


def labelled_accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    """Top-1 accuracy of ``logits [B, C]`` over the rows with a label; 0 when there are none."""
    keep = labels >= 0  # [B]
    return (((logits.argmax(dim=1) == labels) & keep).sum() / keep.sum().clamp(min=1)).float()


class OnlineLinearProbe(nn.Module):
    def __init__(self, in_dim: int, num_classes: int) -> None:
        super().__init__()
        self.head = LinearProbeHead(in_dim, num_classes)  # BatchNorm without affine + linear

    def training_loss(self, features: Tensor, labels: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Cross-entropy and accuracy over the labelled rows of ``features [B, D]``. The head sees
        every row, so its BatchNorm statistics (synchronised over processes) and the collectives
        behind them do not depend on which rows carry labels. ``(None, None)`` when the global batch
        has one row (BatchNorm needs two), or, on one process, no labelled row (with several, every
        process takes part, with a zero loss if need be)."""
        keep = labels >= 0  # [B]
        _, world = world_info()
        if features.shape[0] * world < 2 or (world == 1 and not keep.any()):
            return None, None
        logits = self.head(features)  # [B, C]
        loss = F.cross_entropy(logits, labels.clamp(min=0), reduction="none").mul(keep).sum() / keep.sum().clamp(min=1)
        return loss, labelled_accuracy(logits.detach(), labels)
