"""The papers' linear evaluation: a linear classifier trained on augmented images through the
frozen backbone (MoCo v3 ``main_lincls.py``, DINO ``eval_linear.py``, MAE ``main_linprobe.py``).

Unlike :class:`~ssl_vit.eval.linear.LinearProbe`, which fits the head on features extracted once
from the evaluation transform (fast: the features are computed one time), every step here draws
a random resized crop and flip of each training image and runs it through the backbone, as the
papers' ImageNet numbers are measured. It costs a forward pass of the backbone per image and
epoch, and usually scores a little higher than the fixed-feature probe.

- the backbone is frozen and kept in eval mode (BatchNorm of a ResNet on its running statistics,
  no dropout or drop path: MoCo v3 ``main_lincls.py`` "model.eval()"; DINO ``model.eval()``);
- the head is :class:`~ssl_vit.heads.LinearProbeHead` (BatchNorm without affine, then Linear;
  MAE), on the representation ``features`` (``cls``, DINO's ``last4``, ``avg``);
- SGD with momentum 0.9 or LARS (MAE), weight decay 0, ``lr = base_lr · batch / 256``, linear
  warm-up then cosine decay to 0 per step (MAE ``util/lr_sched.py``);
- test: the evaluation transform (resize + centre crop), top-1 / top-5.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from ssl_vit.eval.features import FeatureMode, embed, feature_dim
from ssl_vit.eval.linear import check_probe_settings, probe_optimizer, warmup_cosine
from ssl_vit.eval.train_run import (
    accuracy_metrics,
    drop_unlabelled_batch,
    log_accuracy,
    nothing_to_learn,
    train_and_test,
)
from ssl_vit.heads import LinearProbeHead


class AugmentedLinearProbe(L.LightningModule):
    """A linear head on a frozen backbone, trained on images (module docstring).

    Args:
        backbone: a registered backbone; frozen (no gradients) and kept in eval mode.
        num_classes: outputs of the head.
        features: the representation the head reads (``ssl_vit.eval.features``).
        base_lr: the LR is ``base_lr · batch_size / 256``; None: 0.01 for SGD, 0.1 for LARS
            (``PROBE_BASE_LR``).
        batch_size: the global batch size, used only for that scaling.
        optimizer: ``"sgd"`` (momentum) or ``"lars"`` (MAE's linear probe).
        momentum, weight_decay: SGD / LARS settings (the papers: weight decay 0).
        warmup_epochs: linear warm-up (MAE: 10 of 90 epochs), capped at the run's length.
        total_steps, steps_per_epoch: the length of the LR schedule in optimiser steps.
    """

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int,
        features: FeatureMode = "cls",
        base_lr: float | None = None,
        batch_size: int = 256,
        optimizer: Literal["sgd", "lars"] = "sgd",
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        warmup_epochs: float = 10.0,
        total_steps: int = 1,
        steps_per_epoch: int = 1,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        base_lr = check_probe_settings(optimizer, base_lr, warmup_epochs)
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone.requires_grad_(False)
        self.head = LinearProbeHead(feature_dim(backbone, features), num_classes)
        self.lr = base_lr * batch_size / 256
        self.test_acc = accuracy_metrics(num_classes)
        self.strict_loading = False  # checkpoints leave the frozen backbone out (on_save_checkpoint)

    def train(self, mode: bool = True) -> AugmentedLinearProbe:
        super().train(mode)
        self.backbone.eval()  # frozen: BatchNorm on running statistics, no dropout / drop path
        return self

    def on_fit_start(self) -> None:
        self.train()  # the head trains, the backbone stays in eval mode whatever it was handed in

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            f = embed(self.backbone, x, self.hparams.features)  # [B, F]
        return self.head(f)  # [B, num_classes]

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return drop_unlabelled_batch(batch)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        x, y = batch
        if len(y) < 2:
            return nothing_to_learn(self)  # BatchNorm needs two examples (a batch of unreadable files: skipped)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        if len(y) == 0:
            return
        log_accuracy(self, self.test_acc, self(x), y, "test")

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        opt = probe_optimizer(self.head.parameters(), hp.optimizer, self.lr, hp.momentum, hp.weight_decay)
        sched = warmup_cosine(opt, hp.warmup_epochs, hp.steps_per_epoch, hp.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The run's checkpoints hold the head: the frozen backbone is rebuilt from its source on
        # resume (a ViT-L need not be copied into every checkpoint).
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("backbone.")}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        missing = sorted(k for k in self.state_dict() if not k.startswith("backbone.") and k not in checkpoint["state_dict"])
        if missing:
            raise ValueError(f"not a checkpoint of this linear probe: it lacks {', '.join(missing)}")


def run_linear_augmented(
    backbone: nn.Module,
    train_ds: Dataset,
    test_ds: Dataset,
    num_classes: int,
    epochs: int,
    batch_size: int = 256,
    max_steps: int = -1,
    num_workers: int = 0,
    accelerator: str = "auto",
    devices: int | str = 1,
    num_nodes: int = 1,
    precision: str = "32-true",
    seed: int = 0,
    run_dir: str | Path | None = None,
    resume: bool = False,
    checkpoint_every: int = 500,
    origin: Mapping[str, Any] | None = None,
    **module_kwargs: Any,
) -> dict[str, float] | None:
    """Train an :class:`AugmentedLinearProbe` on ``train_ds`` (a dataset whose transform
    augments) and return its test accuracies ``{"top1", "top5"}`` (fractions). ``module_kwargs``
    go to the module (``features``, ``base_lr``, ``optimizer`` ...); ``batch_size`` is per process
    (the LR scales with the global batch); checkpoints, signals, resume (``origin`` included) and several processes (the
    metrics come back in process 0, None in the others) as
    :func:`~ssl_vit.eval.train_run.train_and_test`."""

    def make_module(total_steps: int, steps_per_epoch: int, world_size: int) -> AugmentedLinearProbe:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the head's initialisation
            return AugmentedLinearProbe(backbone, num_classes, batch_size=batch_size * world_size, total_steps=total_steps,
                                        steps_per_epoch=steps_per_epoch, **module_kwargs)

    trainable = [p for p in backbone.parameters() if p.requires_grad]  # the module freezes them; given back after
    with warnings.catch_warnings():
        # The frozen backbone is in eval mode on purpose.
        warnings.filterwarnings("ignore", message="Found .* module\\(s\\) in eval mode at the start of training")
        try:
            return train_and_test(
                make_module, train_ds, test_ds, what="linear probe", epochs=epochs, batch_size=batch_size, max_steps=max_steps,
                num_workers=num_workers, accelerator=accelerator, devices=devices, num_nodes=num_nodes, precision=precision, seed=seed,
                run_dir=run_dir, resume=resume, checkpoint_every=checkpoint_every, origin=origin,
            )
        finally:
            for p in trainable:
                p.requires_grad_(True)
