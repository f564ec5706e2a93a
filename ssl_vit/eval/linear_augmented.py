"""The papers' linear evaluation (MoCo v3 ``main_lincls.py``, DINO ``eval_linear.py``, MAE
``main_linprobe.py``): :mod:`~ssl_vit.eval.linear`'s probe trained on a random resized crop and flip
of every image through the frozen backbone in eval mode, as the papers' ImageNet numbers are measured.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from ssl_vit.data import SingleView
from ssl_vit.eval.features import FeatureMode, embed, feature_dim
from ssl_vit.eval.finetune import default_crop_scale
from ssl_vit.eval.linear import PROBE_BASE_LR, probe_optimizer, warmup_cosine
from ssl_vit.eval.train_run import ImageClassifier, ImageRun, train_and_test
from ssl_vit.heads import LinearProbeHead


@dataclass
class LinearAugSettings:
    """``ssl-vit eval linear --augment``, a recipe's ``evaluate.linear_aug``: ``epochs`` (MAE: 90, DINO:
    100) of ``batch_size`` images per process; ``features`` (None: the evaluation's); ``max_steps``: -1: no cap."""

    epochs: int = 100
    batch_size: int = 256
    base_lr: float | None = None
    optimizer: Literal["sgd", "lars"] = "sgd"
    warmup_epochs: float = 10.0
    crop_scale: tuple[float, float] | None = None
    features: FeatureMode | None = None
    max_steps: int = -1
    checkpoint_every: int = 500

    def __post_init__(self) -> None:
        if self.base_lr is None:  # (the LR that runs is the one recorded)
            self.base_lr = PROBE_BASE_LR[self.optimizer]

    def train_views(self, img_size: int) -> SingleView:
        return SingleView(scale=tuple(self.crop_scale or default_crop_scale(img_size)))

    def run(self, backbone: nn.Module, train_ds: Dataset, test_ds: Dataset, num_classes: int, run: ImageRun | None = None,
            features: FeatureMode = "cls", origin: Mapping[str, Any] | None = None) -> dict[str, float] | None:
        """Train the probe and return its test ``{"top1", "top5"}`` (None off process 0); the backbone's
        parameters are given back trainable as they were."""
        run = run or ImageRun()

        def make_module(total: int, per_epoch: int, world: int) -> AugmentedLinearProbe:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(run.seed)  # the head's initialisation
                return AugmentedLinearProbe(backbone, num_classes, self, features=self.features or features, world_size=world,
                                            total_steps=total, steps_per_epoch=per_epoch)

        trainable = [p for p in backbone.parameters() if p.requires_grad]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Found .* module\\(s\\) in eval mode at the start of training")  # (on purpose)
            try:
                return train_and_test(make_module, train_ds, test_ds, self, run, "linear probe", origin)
            finally:
                for p in trainable:
                    p.requires_grad_(True)


class AugmentedLinearProbe(ImageClassifier):
    """A linear head on a frozen backbone, trained on images; its checkpoints hold the head alone."""

    def __init__(self, backbone: nn.Module, num_classes: int, settings: LinearAugSettings | None = None, *, features: FeatureMode = "cls",
                 world_size: int = 1, total_steps: int = 1, steps_per_epoch: int = 1) -> None:
        super().__init__(num_classes)
        s = self.settings = settings or LinearAugSettings()
        self.save_hyperparameters({**{k: v for k, v in vars(s).items() if k != "checkpoint_every"}, "features": features, "num_classes": num_classes,
                                   "world_size": world_size, "total_steps": total_steps, "steps_per_epoch": steps_per_epoch})
        self.backbone = backbone.requires_grad_(False)
        self.features = features
        self.head = LinearProbeHead(feature_dim(backbone, features), num_classes)
        self.lr = s.base_lr * s.batch_size * world_size / 256
        self.strict_loading = False  # (the checkpoints leave the frozen backbone out)

    def train(self, mode: bool = True) -> AugmentedLinearProbe:
        super().train(mode)
        self.backbone.eval()  # frozen: BatchNorm on running statistics, no dropout / drop path
        return self

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            f = embed(self.backbone, x, self.features)  # [B, F]
        return self.head(f)  # [B, num_classes]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        x, y = batch
        if len(y) < 2:
            return self.nothing_to_learn()  # BatchNorm needs two examples (a batch of unreadable files: skipped)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        s, hp = self.settings, self.hparams
        opt = probe_optimizer(self.head.parameters(), s.optimizer, self.lr, 0.9, 0.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup_cosine(opt, s.warmup_epochs, hp.steps_per_epoch, hp.total_steps),
                                                   "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("backbone.")}
