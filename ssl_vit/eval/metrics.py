"""Top-k accuracy, shared by the kNN, linear-probe and fine-tune protocols."""

from __future__ import annotations

from torch import Tensor


def topk_accuracy(scores: Tensor, labels: Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[str, float]:
    """Fraction of rows of ``scores [Q, C]`` whose label is among the ``k`` highest scores, as
    ``{"top{k}": acc}``; a ``k`` is skipped when there are fewer than ``k`` classes (top-5 of 3
    classes is meaningless)."""
    if scores.ndim != 2 or scores.shape[0] != labels.shape[0]:
        raise ValueError(f"scores must be [Q, C] with one label per row; got {tuple(scores.shape)} and {tuple(labels.shape)}")
    labels = labels.to(scores.device).long()
    ks = tuple(k for k in ks if k <= scores.shape[1])
    if not ks:
        return {}
    ranked = scores.topk(max(ks), dim=1).indices  # [Q, max k], best first
    return {f"top{k}": (ranked[:, :k] == labels[:, None]).any(dim=1).float().mean().item() for k in ks}
