"""Frozen features of a backbone over a labelled dataset: the input of the kNN, few-shot and
linear-probe protocols (DINO ``eval_linear.py`` / ``eval_knn.py``; specs §4, §5).

Four read-outs of a ViT:
    ``"cls"``     the [CLS] token after the final LayerNorm, i.e. ``backbone(x)`` (ViT paper §3.1;
                  a ViT built with ``global_pool="avg"`` returns the patch mean there, as timm);
    ``"last4"``   the [CLS] tokens of the last 4 blocks (each through the final LayerNorm),
                  concatenated: DINO's linear protocol for ViT-S (DINO §4 / ``eval_linear.py``);
    ``"avg"``     the mean of the patch tokens after the final LayerNorm (timm's ``global_pool="avg"``);
    ``"cls_avg"`` the [CLS] token and the mean of the patch tokens after the final LayerNorm,
                  concatenated: DINO's linear protocol for ViT-B (``eval_linear.py`` with
                  ``--n_last_blocks 1 --avgpool_patchtokens true``).
ResNets have one read-out, the globally pooled feature map (``"cls"`` = ``backbone(x)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ssl_vit.backbones import eval_mode, is_vit
from ssl_vit.runtime import world_info

if TYPE_CHECKING:
    from ssl_vit.training.progress import CountProgress

FeatureMode = Literal["cls", "last4", "avg", "cls_avg"]
FEATURE_MODES: tuple[str, ...] = ("cls", "last4", "avg", "cls_avg")

Gather = Callable[[Tensor], Tensor]
"""Maps a per-process tensor ``[n_local, ...]`` to the concatenation over processes
``[n_total, ...]`` (e.g. :func:`gather_in_sampler_order`); ``None`` on a single process."""


def gather_in_sampler_order(num_samples: int) -> Gather:
    """The ``gather`` for :func:`extract_features` when each process reads its share of a dataset
    of ``num_samples`` items through ``DistributedSampler(shuffle=False)``: every process gets
    ``[num_samples, ...]`` in dataset order, exactly what one process reading everything gets
    (DINO ``eval_knn.py`` gathers its feature bank the same way).

    That sampler gives process r the items r, r + W, r + 2W, ... of the dataset padded with its
    first items to a multiple of W, so all shares have one length; the all-gathered shares are
    interleaved back into dataset order and the padding is cut off.
    """

    def gather(x: Tensor) -> Tensor:  # [n_local, ...] -> [num_samples, ...]
        _, world = world_info()
        if world == 1:
            return x[:num_samples]
        # NCCL moves only CUDA tensors; other backends (gloo) take them where they are.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else x.device
        local = x.to(device).contiguous()
        shares = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shares, local)
        ordered = torch.stack(shares, dim=1).flatten(0, 1)  # [n_local * W, ...]: item i at row i
        return ordered[:num_samples].to(x.device)

    return gather


def feature_dim(backbone: nn.Module, mode: FeatureMode = "cls", n_last_blocks: int = 4) -> int:
    """Width of the features ``extract_features`` returns for ``mode``."""
    _check_mode(backbone, mode, n_last_blocks)
    return backbone.embed_dim * {"last4": n_last_blocks, "cls_avg": 2}.get(mode, 1)


def _check_mode(backbone: nn.Module, mode: str, n_last_blocks: int) -> None:
    if mode not in FEATURE_MODES:
        raise ValueError(f"unknown feature mode {mode!r}; choose one of {', '.join(FEATURE_MODES)}")
    if mode != "cls" and not is_vit(backbone):
        name = getattr(backbone, "backbone_name", type(backbone).__name__)
        raise ValueError(
            f"feature mode {mode!r} needs a token sequence (ViT or hybrid); {name} has no tokens, "
            "use mode='cls' (--features cls: its globally pooled feature map)"
        )
    if mode in ("last4", "cls_avg") and getattr(backbone, "num_prefix_tokens", 1) < 1:
        raise ValueError(f"feature mode {mode!r} reads the [CLS] token, and this backbone has none (num_prefix_tokens=0); "
                         "use mode 'cls' (its own pooled output) or 'avg'")
    if mode == "last4" and not 1 <= n_last_blocks <= backbone.depth:
        others = ", ".join(m for m in FEATURE_MODES if m != "last4")
        raise ValueError(f"feature mode 'last4' reads the [CLS] of the last {n_last_blocks} blocks (DINO's linear protocol), "
                         f"but this backbone has {backbone.depth}; choose another mode ({others})")


def embed(backbone: nn.Module, x: Tensor, mode: FeatureMode = "cls", n_last_blocks: int = 4) -> Tensor:
    """One batch of images ``[B, C, H, W]`` -> features ``[B, F]`` (no grad handling here)."""
    if mode == "cls":
        return backbone(x)  # [B, D]
    if mode == "last4":
        # DINO eval_linear.py: torch.cat([x[:, 0] for x in get_intermediate_layers(inp, n)], -1)
        layers = backbone.get_intermediate_layers(x, n_last_blocks)  # n x [B, 1+N, D]
        return torch.cat([t[:, 0] for t in layers], dim=-1)  # [B, n*D]
    tokens = backbone.forward_features(x)  # [B, 1+N, D]
    avg = tokens[:, backbone.num_prefix_tokens :].mean(dim=1)  # [B, D]
    if mode == "avg":
        return avg
    # DINO interleaves the two ([B, D, 2] reshaped); a linear read-out does not depend on the order.
    return torch.cat([tokens[:, 0], avg], dim=-1)  # [B, 2D]


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def extract_features(
    backbone: nn.Module,
    data: Dataset | DataLoader | Iterable[tuple[Tensor, Tensor]],
    mode: FeatureMode = "cls",
    batch_size: int = 256,
    num_workers: int = 0,
    n_last_blocks: int = 4,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    out_device: torch.device | str = "cpu",
    gather: Gather | None = None,
    progress: CountProgress | None = None,
) -> tuple[Tensor, Tensor]:
    """Features of a frozen backbone over a labelled dataset, in batches, in ``eval()`` mode.

    Args:
        backbone: any registered backbone (see ``ssl_vit.backbones``).
        data: a dataset of ``(image [C, H, W], label)`` pairs (batched here, in order), or a
            ready ``DataLoader`` / iterable of ``(images [B, C, H, W], labels [B])`` batches.
        mode: ``"cls"``, ``"last4"``, ``"avg"`` or ``"cls_avg"`` (module docstring); ResNets only ``"cls"``.
        batch_size, num_workers: for the DataLoader built when ``data`` is a dataset.
        n_last_blocks: how many blocks ``"last4"`` concatenates (DINO: 4 for ViT-S).
        device: where the backbone runs; default: where its parameters are.
        autocast_dtype: e.g. ``torch.bfloat16`` to run under autocast; features come back float32.
        out_device: where the features are collected (CPU keeps accelerator memory free for
            large banks).
        gather: applied once to the collected features and labels so every process gets the
            whole set; with a ``DistributedSampler(shuffle=False)`` loader use
            ``gather_in_sampler_order(len(dataset))``, which also drops the sampler's padding.
        progress: told of every batch's images, to print a line of progress now and then
            (``ssl_vit.training.progress.CountProgress``); None: silent.

    Returns:
        features ``[N, F]`` float32 and labels ``[N]`` int64, in dataset order.
    """
    _check_mode(backbone, mode, n_last_blocks)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device(device) if device is not None else _device_of(backbone)
    if isinstance(data, Dataset) and not isinstance(data, DataLoader):
        data = DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=num_workers)

    amp = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    feats: list[Tensor] = []
    labels: list[Tensor] = []
    # Dropout / drop path off, BatchNorm (ResNet) on running statistics; each submodule's own
    # mode comes back after.
    if progress is not None:
        progress.start()
    with eval_mode(backbone):
        for batch in data:
            if not isinstance(batch, (tuple, list)) or len(batch) < 2:
                raise ValueError("extract_features expects batches of (images, labels)")
            x, y = batch[0], batch[1]
            with amp:
                f = embed(backbone, x.to(device, non_blocking=True), mode, n_last_blocks)  # [B, F]
            feats.append(f.float().to(out_device))
            labels.append(torch.as_tensor(y).long().reshape(-1).to(out_device))
            if progress is not None:
                progress.update(len(labels[-1]))
    if progress is not None:
        progress.finish()
    if not feats:
        raise ValueError("extract_features got an empty dataset")
    features, targets = torch.cat(feats), torch.cat(labels)  # [N, F], [N]
    if gather is not None:
        features, targets = gather(features), gather(targets)
    return features, targets
