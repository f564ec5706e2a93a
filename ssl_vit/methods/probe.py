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
from ssl_vit.runtime import world_info


def labelled_accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    """Top-1 accuracy of ``logits [B, C]`` over the rows with a label (``labels >= 0``); 0 when
    there are none (weighted by their number, such a batch then counts for nothing)."""
    keep = labels >= 0  # [B]
    return (((logits.argmax(dim=1) == labels) & keep).sum() / keep.sum().clamp(min=1)).float()


class OnlineLinearProbe(nn.Module):
    def __init__(self, in_dim: int, num_classes: int) -> None:
        super().__init__()
        self.head = LinearProbeHead(in_dim, num_classes)  # BN without affine + linear (specs §5)

    def training_loss(self, features: Tensor, labels: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Cross-entropy and accuracy over the labelled rows of ``features [B, D]``.

        The head sees every row, so that its BatchNorm statistics (synchronised over processes in
        distributed training) and the collectives behind them do not depend on which rows carry
        labels; unlabelled rows add nothing to the loss. ``(None, None)`` when the global batch has
        a single row (BatchNorm needs two), or, on a single process, no labelled row (with several
        processes every one must take part, with a zero loss if need be)."""
        _, world = world_info()
        keep = labels >= 0  # [B]
        if features.shape[0] * world < 2 or (world == 1 and not keep.any()):
            return None, None
        logits = self.head(features)  # [B, C]
        n = keep.sum().clamp(min=1)
        # Mean over the labelled rows; 0 (with a graph, for DDP) when there are none.
        loss = F.cross_entropy(logits, labels.clamp(min=0), reduction="none").mul(keep).sum() / n
        return loss, labelled_accuracy(logits.detach(), labels)

    @torch.no_grad()
    def accuracy(self, features: Tensor, labels: Tensor) -> Tensor:
        """Accuracy over the labelled rows of ``features [B, D]`` (the head in eval mode, so each
        row's prediction is its own); 0 when there are none (see :func:`labelled_accuracy`)."""
        was_training = self.head.training
        self.head.eval()
        logits = self.head(features)  # [B, C]
        self.head.train(was_training)
        return labelled_accuracy(logits, labels)
