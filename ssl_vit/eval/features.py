"""Frozen features of a backbone over a labelled dataset, the input of the kNN, few-shot and
linear-probe protocols (DINO ``eval_linear.py`` / ``eval_knn.py``). A ViT's read-outs:

    ``cls``      ``backbone(x)``: the normed [CLS] token (ViT paper §3.1; with ``global_pool="avg"`` the patch mean);
    ``last4``    the normed [CLS] of the last 4 blocks, concatenated: DINO's linear protocol for ViT-S;
    ``avg``      the mean of the normed patch tokens (timm's ``global_pool="avg"``);
    ``cls_avg``  [CLS] and the patch mean concatenated: DINO's for ViT-B (``--avgpool_patchtokens``).

ResNets have one, the globally pooled feature map (``cls``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ssl_vit.backbones import eval_mode, is_vit
from ssl_vit.training.progress import CountProgress

FeatureMode = Literal["cls", "last4", "avg", "cls_avg"]  # (the CLI's choices and the recipe's type check a name)


def feature_dim(backbone: nn.Module, mode: FeatureMode = "cls", n_last_blocks: int = 4) -> int:
    """The width of ``mode``'s features; a read-out the backbone lacks is an error saying why."""
    if mode != "cls" and not is_vit(backbone):
        raise ValueError(f"feature mode {mode!r} needs a token sequence (ViT or hybrid); {getattr(backbone, 'backbone_name', type(backbone).__name__)} "
                         "has no tokens, use mode='cls' (--features cls: its globally pooled feature map)")
    if mode in ("last4", "cls_avg") and backbone.num_prefix_tokens < 1:
        raise ValueError(f"feature mode {mode!r} reads the [CLS] token, and this backbone has none (num_prefix_tokens=0); use mode 'cls' (its own "
                         "pooled output) or 'avg'")
    if mode == "last4" and n_last_blocks > backbone.depth:
        raise ValueError(f"feature mode 'last4' reads the [CLS] of the last {n_last_blocks} blocks (DINO's linear protocol), but this backbone has "
                         f"{backbone.depth}; choose another mode (cls, avg, cls_avg)")
    return backbone.embed_dim * {"last4": n_last_blocks, "cls_avg": 2}.get(mode, 1)


def embed(backbone: nn.Module, x: Tensor, mode: FeatureMode = "cls", n_last_blocks: int = 4) -> Tensor:
    """Images ``[B, C, H, W]`` -> features ``[B, F]``."""
    if mode == "cls":
        return backbone(x)  # [B, D]
    if mode == "last4":  # DINO: torch.cat([x[:, 0] for x in get_intermediate_layers(inp, n)], -1)
        return torch.cat([t[:, 0] for t in backbone.get_intermediate_layers(x, n_last_blocks)], dim=-1)  # [B, n*D]
    tokens = backbone.forward_features(x)  # [B, 1+N, D]
    avg = tokens[:, backbone.num_prefix_tokens :].mean(dim=1)  # [B, D]
    return avg if mode == "avg" else torch.cat([tokens[:, 0], avg], dim=-1)  # [B, 2D] (DINO interleaves them: no matter to a linear read-out)


@torch.no_grad()
def extract_features(backbone: nn.Module, data: Dataset | Iterable[tuple[Tensor, Tensor]], mode: FeatureMode = "cls", batch_size: int = 256,
                     num_workers: int = 0, n_last_blocks: int = 4, device: torch.device | str | None = None, autocast_dtype: torch.dtype | None = None,
                     progress: CountProgress | None = None) -> tuple[Tensor, Tensor]:
    """Features ``[N, F]`` (float32, on the CPU) and labels ``[N]`` of a backbone in ``eval()`` mode
    (each submodule's own mode restored after), in the order of ``data``: a dataset or batches."""
    device = torch.device(device) if device is not None else next(backbone.parameters()).device
    if isinstance(data, Dataset):
        data = DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    feats, labels, progress = [], [], progress or CountProgress("features", None, every_n_seconds=float("inf"))
    progress.start()
    with eval_mode(backbone):
        for x, y, *_ in data:
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                feats.append(embed(backbone, x.to(device, non_blocking=True), mode, n_last_blocks).float().cpu())  # [B, F]
            labels.append(torch.as_tensor(y).long().reshape(-1).cpu())
            progress.update(len(labels[-1]))
    progress.finish()
    return torch.cat(feats), torch.cat(labels)  # [N, F], [N]
