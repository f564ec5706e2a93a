"""The evaluations that train on images, from their settings to their result records: fine-tuning
and the papers' linear probe on augmented images (protocol ``linear_aug``). What ``ssl-vit eval
finetune`` / ``ssl-vit eval linear --augment`` run, and what a recipe's ``evaluate`` section runs
after the pretraining (``protocols: [finetune, linear_aug]``, their settings under
``evaluate.finetune`` / ``evaluate.linear_aug``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from torch import nn
from torch.utils.data import Dataset

from ssl_vit.data import SingleView
from ssl_vit.data.views import check_rand_augment
from ssl_vit.eval.features import FEATURE_MODES, FeatureMode
from ssl_vit.eval.finetune import check_finetune_settings, new_head, run_finetune
from ssl_vit.eval.linear import check_probe_settings
from ssl_vit.eval.linear_augmented import run_linear_augmented
from ssl_vit.eval.results import EvalResult
from ssl_vit.eval.run import result_path


def default_crop_scale(img_size: int) -> tuple[float, float]:
    """The training crop's area range when none is given: (0.08, 1) (DeiT/MAE/MoCo v3/DINO) for
    images of 96 px or more, (0.5, 1) for smaller ones (the small-image recipes')."""
    return (0.08, 1.0) if img_size >= 96 else (0.5, 1.0)


def _check_crop_scale(crop_scale: tuple[float, float] | None) -> tuple[float, float] | None:
    if crop_scale is None:
        return None
    crop_scale = (float(crop_scale[0]), float(crop_scale[1]))
    if not 0 < crop_scale[0] <= crop_scale[1] <= 1:
        raise ValueError(f"crop_scale must be (lo, hi) with 0 < lo <= hi <= 1, got {list(crop_scale)}")
    return crop_scale


def _check_run(epochs: int, batch_size: int, max_steps: int, checkpoint_every: int) -> None:
    if epochs < 1 or batch_size < 1 or checkpoint_every < 1 or not (max_steps == -1 or max_steps >= 1):
        raise ValueError(f"need epochs >= 1, batch_size >= 1, checkpoint_every >= 1 and max_steps -1 (no cap) or >= 1; "
                         f"got {epochs}, {batch_size}, {checkpoint_every} and {max_steps}")


class FineTuneSettings:
    """The fine-tuning protocol's settings (specs §5; the defaults are MAE's ViT-B recipe,
    ``FINETUNE.md``, but for the number of epochs: MAE's 100 is a long run, 10 a first look).

    Args:
        epochs: passes over the training split.
        batch_size: images per process and step; the LR scales with the global batch
            (x processes, MAE's rule).
        base_lr: LR per 256 images (MAE ViT-B: 5e-4).
        layer_decay: layer-wise LR decay (MAE ViT-B: 0.65 with base_lr 5e-4; ViT-L: 0.75 with 1e-3).
        drop_path_rate: stochastic depth at the last block (MAE ViT-B: 0.1).
        label_smoothing: DeiT/MAE: 0.1.
        weight_decay: AdamW weight decay (MAE: 0.05).
        warmup_epochs: linear LR warm-up before the cosine decay (MAE: 5 of 100 epochs).
        mixup_alpha, cutmix_alpha: MixUp / CutMix (MAE: 0.8 / 1.0; 0: off).
        rand_augment: ``(ops, magnitude)`` of RandAugment on the training crops (MAE: 2 ops at
            magnitude 9; None: off; ``SingleView``).
        random_erasing: random erasing probability (MAE: 0.25; 0: off; ``FineTuneModule``).
        augment: train on a random resized crop + flip of each image (False: on the evaluation
            transform, resize + centre crop).
        crop_scale: that crop's area range; None: :func:`default_crop_scale`.
        max_steps: stop after this many optimiser steps (-1: no cap; the LR schedule follows).
        checkpoint_every: steps between the run's checkpoints.
        compile_backbone: ``torch.compile`` (inductor) the backbone one block at a time
            (``FineTuneModule``): the same training, for GPUs (no faster on a 2-core CPU).
    """

    def __init__(
        self,
        epochs: int = 10,
        batch_size: int = 256,
        base_lr: float = 5e-4,
        layer_decay: float = 0.65,
        drop_path_rate: float = 0.1,
        label_smoothing: float = 0.1,
        weight_decay: float = 0.05,
        warmup_epochs: float = 5.0,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        rand_augment: tuple[int, int] | None = None,
        random_erasing: float = 0.0,
        augment: bool = True,
        crop_scale: tuple[float, float] | None = None,
        max_steps: int = -1,
        checkpoint_every: int = 500,
        compile_backbone: bool = False,
    ) -> None:
        check_finetune_settings(base_lr, batch_size, weight_decay, layer_decay, drop_path_rate, label_smoothing, warmup_epochs,
                                mixup_alpha, cutmix_alpha, random_erasing)
        if rand_augment is not None:
            rand_augment = check_rand_augment(rand_augment)
            if not augment:
                raise ValueError("rand_augment applies to the training crops, and augment is off (the evaluation transform)")
        _check_run(epochs, batch_size, max_steps, checkpoint_every)
        crop_scale = _check_crop_scale(crop_scale)
        if crop_scale is not None and not augment:
            raise ValueError("crop_scale applies to the training crops, and augment is off (the evaluation transform)")
        self.epochs = epochs
        self.batch_size = batch_size
        self.base_lr = base_lr
        self.layer_decay = layer_decay
        self.drop_path_rate = drop_path_rate
        self.label_smoothing = label_smoothing
        self.weight_decay = weight_decay
        self.warmup_epochs = warmup_epochs
        self.mixup_alpha = mixup_alpha
        self.cutmix_alpha = cutmix_alpha
        self.rand_augment = rand_augment
        self.random_erasing = random_erasing
        self.augment = augment
        self.crop_scale = crop_scale
        self.max_steps = max_steps
        self.checkpoint_every = checkpoint_every
        self.compile_backbone = compile_backbone

    def scale_for(self, img_size: int) -> tuple[float, float] | None:
        """The crop's area range at this resolution (None: no augmentation)."""
        if not self.augment:
            return None
        return self.crop_scale or default_crop_scale(img_size)

    def train_views(self, img_size: int) -> SingleView | None:
        """The training images' transform (None: the evaluation transform)."""
        scale = self.scale_for(img_size)
        return None if scale is None else SingleView(scale=scale, rand_augment=self.rand_augment)

    def protocol_args(self, img_size: int, new_img_size: int | None, precision: str, devices: int, num_nodes: int, seed: int) -> dict[str, Any]:
        """The record's ``protocol_args`` (the names of ``ssl-vit eval finetune``'s options)."""
        scale = self.scale_for(img_size)
        return {"epochs": self.epochs, "max_steps": None if self.max_steps == -1 else self.max_steps, "seed": seed,
                "lr": self.base_lr, "layer_decay": self.layer_decay, "drop_path": self.drop_path_rate,
                "label_smoothing": self.label_smoothing, "weight_decay": self.weight_decay, "img_size": new_img_size,
                "batch_size": self.batch_size, "mixup": self.mixup_alpha, "cutmix": self.cutmix_alpha,
                "rand_augment": None if self.rand_augment is None else list(self.rand_augment),
                "random_erasing": self.random_erasing, "precision": precision,
                "devices": devices, "num_nodes": num_nodes, "warmup_epochs": self.warmup_epochs,
                "crop_scale": None if scale is None else list(scale)}


def _origin(pretrain: Mapping[str, Any]) -> dict[str, Any]:
    """The backbone's pretraining step, kept with an evaluation run so that it is not resumed on
    the weights of another step (a pretraining extended after it)."""
    return {"pretrain_steps": pretrain.get("steps")}


def finetune_and_record(
    backbone: nn.Module,
    train_ds: Dataset,
    test_ds: Dataset,
    num_classes: int,
    settings: FineTuneSettings,
    *,
    img_size: int,
    new_img_size: int | None,
    method: str,
    data_record: dict[str, Any],
    normalization: dict[str, Any],
    source: str,
    pretrain: dict[str, Any],
    backbone_record: dict[str, Any],
    out: str | Path,
    accelerator: str,
    devices: int | list[int],
    num_nodes: int,
    precision: str,
    seed: int,
    num_workers: int,
    run_dir: str | Path | None,
    resume: bool,
    head: nn.Linear | None = None,
) -> tuple[EvalResult, Path] | None:
    """Fine-tune ``backbone`` (in place, with ``head`` or a new one) on ``train_ds`` (built with
    ``settings.train_views(img_size)``), test it on ``test_ds`` and write its record into ``out``.

    ``img_size``: the data's resolution; ``new_img_size``: the fine-tuning's when it differs from
    the backbone's (the position embedding interpolated). ``normalization``: the data's ``name``,
    ``mean`` and ``std``, recorded in the run's checkpoints with ``method`` + ``"+finetune"`` so
    that ``ssl-vit export`` / ``ssl-vit eval`` read the fine-tuned backbone from them.

    With several processes every one calls this; process 0 returns ``(record, its path)``, the
    others None. A signal raises :class:`~ssl_vit.eval.train_run.EvalRunInterrupted` (continue
    with ``resume``)."""
    if head is None:
        head = new_head(backbone.embed_dim, num_classes, seed=seed)
    count = devices if isinstance(devices, int) else len(devices)
    finetuned = {"method": f"{method}+finetune", "data": dict(normalization)}
    metrics = run_finetune(
        backbone, train_ds, test_ds, num_classes, epochs=settings.epochs, batch_size=settings.batch_size, max_steps=settings.max_steps,
        num_workers=num_workers, accelerator=accelerator, devices=devices, num_nodes=num_nodes, precision=precision, seed=seed,
        run_dir=run_dir, resume=resume, checkpoint_every=settings.checkpoint_every, head=head, base_lr=settings.base_lr,
        layer_decay=settings.layer_decay, drop_path_rate=settings.drop_path_rate, label_smoothing=settings.label_smoothing,
        weight_decay=settings.weight_decay, img_size=new_img_size, mixup_alpha=settings.mixup_alpha, cutmix_alpha=settings.cutmix_alpha,
        random_erasing=settings.random_erasing, compile_backbone=settings.compile_backbone,
        warmup_epochs=settings.warmup_epochs, record=finetuned, origin=_origin(pretrain),
    )
    if metrics is None:
        return None  # another process of a distributed run: process 0 tests and writes the record
    result = EvalResult(
        method=method, backbone=backbone_record, data=data_record, protocol="finetune", metrics=metrics,
        protocol_args=settings.protocol_args(img_size, new_img_size, precision, count, num_nodes, seed), pretrain=pretrain, source=source,
    )
    return result, result.to_json(result_path(out, result))


class LinearAugSettings:
    """The papers' linear evaluation's settings (MoCo v3 ``main_lincls.py``, DINO
    ``eval_linear.py``, MAE ``main_linprobe.py``; ``ssl-vit eval linear --augment``'s options; a
    recipe's ``evaluate.linear_aug``): a BN + linear head on the frozen backbone's ``features`` of
    a random resized crop + flip of every image, each epoch.

    Args:
        epochs: passes over the training split (MAE: 90, DINO: 100).
        batch_size: images per process and step; the LR scales with the global batch.
        base_lr: LR per 256 images; None: 0.01 with SGD, 0.1 with LARS (MAE's probe).
        optimizer: ``sgd`` (momentum 0.9) or ``lars`` (MAE).
        warmup_epochs: linear LR warm-up before the cosine decay (MAE: 10 of 90).
        crop_scale: the crop's area range; None: :func:`default_crop_scale`.
        features: the representation (``cls``, ``last4``: DINO's for ViT-S, ``avg``, ``cls_avg``);
            None: the caller's (a recipe's ``evaluate.features``, which kNN reads too).
        max_steps: stop after this many optimiser steps (-1: no cap; the LR schedule follows).
        checkpoint_every: steps between the run's checkpoints.
    """

    def __init__(
        self,
        epochs: int = 100,
        batch_size: int = 256,
        base_lr: float | None = None,
        optimizer: Literal["sgd", "lars"] = "sgd",
        warmup_epochs: float = 10.0,
        crop_scale: tuple[float, float] | None = None,
        features: FeatureMode | None = None,
        max_steps: int = -1,
        checkpoint_every: int = 500,
    ) -> None:
        if features is not None and features not in FEATURE_MODES:
            raise ValueError(f"features must be {', '.join(FEATURE_MODES[:-1])} or {FEATURE_MODES[-1]}, got {features!r}")
        self.features = features
        self.base_lr = check_probe_settings(optimizer, base_lr, warmup_epochs)  # (the LR that runs is the one recorded)
        _check_run(epochs, batch_size, max_steps, checkpoint_every)
        self.crop_scale = _check_crop_scale(crop_scale)
        self.epochs = epochs
        self.batch_size = batch_size
        self.optimizer = optimizer
        self.warmup_epochs = warmup_epochs
        self.max_steps = max_steps
        self.checkpoint_every = checkpoint_every

    def scale_for(self, img_size: int) -> tuple[float, float]:
        return self.crop_scale or default_crop_scale(img_size)

    def train_views(self, img_size: int) -> SingleView:
        return SingleView(scale=self.scale_for(img_size))

    def protocol_args(self, img_size: int, features: str, precision: str, devices: int, num_nodes: int, seed: int) -> dict[str, Any]:
        """The record's ``protocol_args``."""
        return {"epochs": self.epochs, "max_steps": None if self.max_steps == -1 else self.max_steps, "base_lr": self.base_lr,
                "optimizer": self.optimizer, "batch_size": self.batch_size,
                "warmup_epochs": self.warmup_epochs, "crop_scale": list(self.scale_for(img_size)), "features": features,
                "precision": precision, "devices": devices, "num_nodes": num_nodes, "seed": seed}


def linear_aug_and_record(
    backbone: nn.Module,
    train_ds: Dataset,
    test_ds: Dataset,
    num_classes: int,
    settings: LinearAugSettings,
    *,
    img_size: int,
    features: FeatureMode,
    method: str,
    data_record: dict[str, Any],
    source: str,
    pretrain: dict[str, Any],
    backbone_record: dict[str, Any],
    out: str | Path,
    accelerator: str,
    devices: int | list[int],
    num_nodes: int,
    precision: str,
    seed: int,
    num_workers: int,
    run_dir: str | Path | None,
    resume: bool,
) -> tuple[EvalResult, Path] | None:
    """Train the augmented linear probe on ``train_ds`` (built with ``settings.train_views(img_size)``)
    through the frozen ``backbone``, test it on ``test_ds`` and write its record (protocol
    ``linear_aug``) into ``out``; processes, signals and resume as :func:`finetune_and_record`.
    ``features``: the representation where ``settings`` names none."""
    features = settings.features or features
    count = devices if isinstance(devices, int) else len(devices)
    metrics = run_linear_augmented(
        backbone, train_ds, test_ds, num_classes, epochs=settings.epochs, batch_size=settings.batch_size, max_steps=settings.max_steps,
        num_workers=num_workers, accelerator=accelerator, devices=devices, num_nodes=num_nodes, precision=precision, seed=seed,
        run_dir=run_dir, resume=resume, checkpoint_every=settings.checkpoint_every, features=features, base_lr=settings.base_lr,
        optimizer=settings.optimizer, warmup_epochs=settings.warmup_epochs, origin=_origin(pretrain),
    )
    if metrics is None:
        return None  # another process of a distributed run: process 0 tests and writes the record
    result = EvalResult(
        method=method, backbone=backbone_record, data=data_record, protocol="linear_aug", metrics=metrics,
        protocol_args=settings.protocol_args(img_size, features, precision, count, num_nodes, seed), pretrain=pretrain, source=source,
    )
    return result, result.to_json(result_path(out, result))
