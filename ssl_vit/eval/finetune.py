"""End-to-end fine-tuning of a pretrained backbone with a linear head (specs §5): the BEiT/MAE
recipe (MAE Appendix A.1, ``main_finetune.py``; DeiT for the regularisers).

- layer-wise LR decay (BEiT §2.5 / MAE ``util/lr_decay.py``): parameters get a layer id, 0 for
  ``patch_embed``/``cls_token``/``pos_embed``, i + 1 for block i, depth + 1 for the final norm
  and the head; the LR is multiplied by ``layer_decay ** (depth + 1 - id)``, so the layers
  nearest the input, which hold the most general features, move least;
- AdamW, linear warm-up then cosine decay per step; weight decay 0.05 except biases, norms and
  ``backbone.no_weight_decay()`` (``pos_embed``, ``cls_token``) as in MAE ``param_groups_lrd``;
- drop path increasing linearly with depth, label smoothing 0.1, optional mixup/cutmix
  (torchvision ``transforms.v2`` MixUp/CutMix; off by default);
- optionally a new resolution: the position embedding is interpolated (``set_img_size``, bicubic,
  ViT paper §3.2);
- every weight trains: a fixed sin-cos position embedding (MoCo v3) becomes a learned one that
  starts from the table, as MAE's and MoCo v3's fine-tuning (timm's ViT) load it.

ResNets get one layer id per stage (stem 0, ``layer{i}`` i, head ``num_stages + 1``), so the decay
acts as in ViTs at coarser grain (``layer_decay=1`` switches it off). Hybrids are ViTs whose
``patch_embed`` holds the ResNet trunk, which therefore shares id 0 with the patch embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import Dataset
from torchvision.ops import StochasticDepth
from torchvision.transforms import v2

from ssl_vit.backbones import is_vit
from ssl_vit.backbones.compile import check_backend, compile_backbone
from ssl_vit.eval.linear import warmup_cosine
from ssl_vit.eval.train_run import (
    accuracy_metrics,
    drop_unlabelled_batch,
    log_accuracy,
    nothing_to_learn,
    train_and_test,
)
from ssl_vit.methods.fused import fused_kwargs
from ssl_vit.runtime import seed_training_step


# ----------------------------------------------------------------------------- layer-wise decay
def num_layer_ids(backbone: nn.Module) -> int:
    """The id of the last layer (final norm and head): depth + 1 for ViTs and hybrids,
    ``num_stages + 1`` for ResNets."""
    if is_vit(backbone):
        return backbone.depth + 1
    if hasattr(backbone, "num_stages"):
        return backbone.num_stages + 1
    raise ValueError(f"no layer-wise decay rule for {type(backbone).__name__}; expected a ViT, hybrid or ResNet backbone")


def layer_id(name: str, backbone: nn.Module) -> int:
    """Layer id of the backbone parameter ``name`` (MAE ``get_layer_id_for_vit``; our per-stage
    rule for ResNets). Names outside the backbone (the head) take ``num_layer_ids(backbone)``."""
    last = num_layer_ids(backbone)
    if is_vit(backbone):
        if name in ("cls_token", "pos_embed") or name.startswith("patch_embed."):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return last  # final norm
    if name.startswith(("conv1.", "bn1.")):
        return 0
    if name.startswith("layer"):
        return int(name.split(".")[0].removeprefix("layer"))
    return last


def param_groups_layer_decay(
    backbone: nn.Module,
    head: nn.Module | None,
    lr: float,
    weight_decay: float,
    layer_decay: float,
) -> list[dict[str, Any]]:
    """AdamW parameter groups: one per (layer id, decay or not), each with ``lr = lr · scale``,
    ``scale = layer_decay ** (last - id)``, and the keys ``layer_id`` and ``lr_scale`` for
    inspection. Frozen parameters (e.g. a fixed sin-cos position embedding) are left out; 1-D
    parameters (biases, norms) and ``backbone.no_weight_decay()`` get no weight decay."""
    if not 0 < layer_decay <= 1:
        raise ValueError(f"layer_decay must be in (0, 1], got {layer_decay}")
    last = num_layer_ids(backbone)
    skip = set(backbone.no_weight_decay()) if hasattr(backbone, "no_weight_decay") else set()
    named = [(n, p, layer_id(n, backbone)) for n, p in backbone.named_parameters()]
    if head is not None:
        named += [(f"head.{n}", p, last) for n, p in head.named_parameters()]
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, p, lid in named:
        if not p.requires_grad:
            continue
        decay = not (p.ndim <= 1 or name in skip)
        key = (lid, decay)
        if key not in groups:
            scale = layer_decay ** (last - lid)
            groups[key] = {
                "params": [],
                "names": [],
                "layer_id": lid,
                "lr_scale": scale,
                "lr": lr * scale,
                "weight_decay": weight_decay if decay else 0.0,
            }
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
    return [groups[k] for k in sorted(groups)]


def set_drop_path(backbone: nn.Module, rate: float) -> None:
    """Stochastic depth on the blocks of a ViT/hybrid, increasing linearly from 0 at the first
    block to ``rate`` at the last (DeiT/timm ``torch.linspace(0, rate, depth)``)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"drop path rate must be in [0, 1), got {rate}")
    if not is_vit(backbone):
        raise ValueError(f"drop path needs Transformer blocks; {type(backbone).__name__} has none (use rate 0)")
    depth = len(backbone.blocks)
    for i, blk in enumerate(backbone.blocks):
        p = rate * i / (depth - 1) if depth > 1 else 0.0
        # "row": drop the residual branch per sample, as the backbone builds it
        blk.drop_path = StochasticDepth(p, "row") if p > 0 else nn.Identity()


# ----------------------------------------------------------------------------- the module
def finetuned_architecture(backbone: nn.Module) -> tuple[str | None, dict[str, Any]]:
    """The registry name and kwargs that rebuild ``backbone`` as fine-tuned: at the resolution it
    was fine-tuned at (``img_size`` may have changed; the name is None for a backbone not made by
    ``create_backbone``)."""
    kwargs = dict(getattr(backbone, "backbone_kwargs", {}))
    if hasattr(backbone, "img_size"):
        kwargs["img_size"] = tuple(int(s) for s in backbone.img_size)
    return getattr(backbone, "backbone_name", None), kwargs


def new_head(in_dim: int, num_classes: int, seed: int | None = None) -> nn.Linear:
    """The classifier a fine-tuning starts with: MAE ``main_finetune.py`` initialises its weights
    trunc-normal(std 2e-5), so training starts from near-uniform predictions and the pretrained
    features are not hit by large gradients. ``seed``: drawn from its own generator (None: from
    torch's global one)."""
    head = nn.Linear(in_dim, num_classes)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    nn.init.trunc_normal_(head.weight, std=2e-5, generator=generator)
    nn.init.zeros_(head.bias)
    return head


def check_finetune_settings(
    base_lr: float, batch_size: int, weight_decay: float, layer_decay: float, drop_path_rate: float, label_smoothing: float,
    warmup_epochs: float, mixup_alpha: float, cutmix_alpha: float, random_erasing: float = 0.0,
) -> None:
    """Refuse settings a fine-tuning cannot run, naming them (before any backbone is loaded)."""
    if not 0 < layer_decay <= 1:
        raise ValueError(f"layer_decay must be in (0, 1], got {layer_decay}")
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if not 0 <= drop_path_rate < 1:
        raise ValueError(f"drop_path_rate must be in [0, 1), got {drop_path_rate}")
    if not (base_lr > 0 and batch_size >= 1 and weight_decay >= 0 and warmup_epochs >= 0):
        raise ValueError(f"need base_lr > 0, batch_size >= 1, weight_decay >= 0 and warmup_epochs >= 0; "
                         f"got {base_lr}, {batch_size}, {weight_decay} and {warmup_epochs}")
    if mixup_alpha < 0 or cutmix_alpha < 0:
        raise ValueError(f"mixup_alpha and cutmix_alpha must be >= 0 (0: off), got {mixup_alpha} and {cutmix_alpha}")
    if not 0 <= random_erasing <= 1:
        raise ValueError(f"random_erasing must be a probability in [0, 1] (0: off), got {random_erasing}")


class FineTuneModule(L.LightningModule):
    """Backbone + linear head trained end to end (module docstring for the recipe).

    Args:
        backbone: a registered backbone (ViT, hybrid or ResNet); its weights are trained.
        num_classes: outputs of the linear head.
        base_lr: LR at batch 256; the peak LR is ``base_lr · batch_size / 256`` (MAE: 5e-4 for
            ViT-B, 1e-3 for ViT-L).
        batch_size: the global batch size, used only for that scaling.
        weight_decay: AdamW weight decay (MAE fine-tune: 0.05).
        layer_decay: layer-wise LR decay; 1 turns it off. The default is MAE's ViT-B recipe
            (FINETUNE.md: ``--blr 5e-4 --layer_decay 0.65``, the pair of ``base_lr``'s default);
            its ViT-L/H recipes pair 0.75 with 1e-3.
        drop_path_rate: stochastic depth at the last block (MAE ViT-B: 0.1); ViTs only, ignored
            with a warning for ResNets.
        label_smoothing: on the (possibly mixed) targets (DeiT/MAE: 0.1).
        warmup_epochs: linear warm-up (MAE: 5 of 100 epochs), then cosine decay to 0 per step.
        mixup_alpha, cutmix_alpha: Beta parameters of MixUp / CutMix (MAE: 0.8 / 1.0); 0 turns
            each off; with both on, one of the two is chosen per batch (timm's switch prob 0.5).
        random_erasing: the probability that one random box of an image (2-33 % of its area,
            aspect 0.3-3.3) is replaced by normal noise in the normalised pixel space, before
            MixUp / CutMix (Zhong et al. 2020; MAE: 0.25, timm's ``--reprob`` in ``pixel`` mode);
            0: off.
        img_size: fine-tune at this resolution (ViTs interpolate the position embedding).
        betas: AdamW betas (torch's fused AdamW kernel where the parameters allow it:
            ``ssl_vit.methods.fused``).
        seed: base of each training batch's random draws (drop path, MixUp/CutMix), which
            depend only on the batch's position in training, so a resumed run draws the same.
        total_steps, steps_per_epoch: the length of the LR schedule in optimiser steps (None:
            the trainer's estimate, which needs the training loader before a resumed run has
            restored its position; ``run_finetune`` passes both).
        head: the classifier to train (``embed_dim -> num_classes``), trained in place like the
            backbone; None: a new one (:func:`new_head`).
        record: what the run's checkpoints say of the backbone's origin besides its architecture
            (``method``, ``data`` with its normalisation ``mean``/``std``), as pretraining
            checkpoints do: ``ssl-vit export`` and ``ssl-vit eval`` then read the fine-tuned
            backbone from them.
        compile_backbone: ``torch.compile`` the backbone one block at a time before training
            (``ssl_vit.backbones.compile``; the pretext modules' option of that name).
        compile_backend: its ``torch.compile`` backend (``inductor``; ``aot_eager`` to check tracing).
    """

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int,
        base_lr: float = 5e-4,
        batch_size: int = 256,
        weight_decay: float = 0.05,
        layer_decay: float = 0.65,
        drop_path_rate: float = 0.1,
        label_smoothing: float = 0.1,
        warmup_epochs: float = 5.0,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        random_erasing: float = 0.0,
        img_size: int | tuple[int, int] | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        seed: int = 0,
        total_steps: int | None = None,
        steps_per_epoch: int | None = None,
        head: nn.Linear | None = None,
        record: dict[str, Any] | None = None,
        compile_backbone: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        if compile_backbone:
            check_backend(compile_backend)
        check_finetune_settings(base_lr, batch_size, weight_decay, layer_decay, drop_path_rate, label_smoothing, warmup_epochs,
                                mixup_alpha, cutmix_alpha, random_erasing)
        self.save_hyperparameters(ignore=["backbone", "head", "record"])
        self.record = dict(record or {})
        self.backbone = backbone
        if img_size is not None and is_vit(backbone):
            size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
            if tuple(backbone.img_size) != size:
                backbone.set_img_size(size)
        if is_vit(backbone):
            backbone.make_pos_embed_learnable()  # all weights train (a MoCo v3 sin-cos table too)
            set_drop_path(backbone, drop_path_rate)
        elif drop_path_rate > 0:
            rank_zero_warn(f"drop_path_rate={drop_path_rate} ignored: {type(backbone).__name__} has no blocks")
        if head is not None and (head.in_features, head.out_features) != (backbone.embed_dim, num_classes):
            raise ValueError(f"head maps {head.in_features} -> {head.out_features}; this fine-tuning needs {backbone.embed_dim} -> {num_classes}")
        self.head = head if head is not None else new_head(backbone.embed_dim, num_classes)
        self.lr = base_lr * batch_size / 256
        ops = [op(alpha=a, num_classes=num_classes) for op, a in ((v2.MixUp, mixup_alpha), (v2.CutMix, cutmix_alpha)) if a > 0]
        self.mix = v2.RandomChoice(ops) if len(ops) == 2 else (ops[0] if ops else None)
        # value "random": per-pixel N(0, 1) noise, drawn per image (a batch given whole would share one box)
        self.erase = v2.RandomErasing(p=random_erasing, value="random") if random_erasing > 0 else None
        self.test_acc = accuracy_metrics(num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))  # [B, num_classes]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        name, kwargs = finetuned_architecture(self.backbone)
        if name is None:  # not built by create_backbone: nothing to rebuild it from
            return
        checkpoint["ssl_vit"] = {"method": "finetune", **self.record, "backbone": name, "backbone_kwargs": kwargs,
                                 "global_step": self.global_step, "epoch": self.current_epoch}

    def setup(self, stage: str) -> None:
        # After __init__ changed the backbone (resolution, drop path); before a strategy wraps it.
        if self.hparams.compile_backbone and not getattr(self, "_backbone_compiled", False):
            compile_backbone(self.backbone, self.hparams.compile_backend)
            self._backbone_compiled = True

    def on_fit_start(self) -> None:
        # Lightning keeps each module's train/eval mode: a backbone handed in eval mode (as loaded
        # for evaluation) would train without drop path and with frozen BatchNorm statistics.
        self.train()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return drop_unlabelled_batch(batch)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Drop path and MixUp draw from the batch's position: a resumed run draws the same.
        seed_training_step(self.hparams.seed, self.current_epoch, batch_idx, self.global_rank)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        x, y = batch
        if len(y) == 0:
            return nothing_to_learn(self)  # a batch of unreadable files only: skip the step
        if self.erase is not None:
            x = torch.stack([self.erase(image) for image in x])  # [B, C, H, W], normalised
        if self.mix is not None:
            x, y = self.mix(x, y)  # y: soft labels [B, K]
        loss = F.cross_entropy(self(x), y, label_smoothing=self.hparams.label_smoothing)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _eval_step(self, batch: tuple[Tensor, Tensor], prefix: str) -> None:
        x, y = batch
        if len(y) == 0:
            return
        logits = self(x)
        self.log(f"{prefix}_loss", F.cross_entropy(logits, y), sync_dist=True)
        log_accuracy(self, self.test_acc, logits, y, prefix)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = param_groups_layer_decay(self.backbone, self.head, self.lr, hp.weight_decay, hp.layer_decay)
        opt = torch.optim.AdamW(groups, lr=self.lr, betas=tuple(hp.betas), **fused_kwargs(groups))
        if hp.total_steps is not None and hp.steps_per_epoch is not None:
            total, per_epoch = hp.total_steps, hp.steps_per_epoch
        else:  # (asking the trainer here builds the training loader before a checkpoint's loader state is restored)
            total = int(self.trainer.estimated_stepping_batches)
            per_epoch = max(1, self.trainer.num_training_batches // self.trainer.accumulate_grad_batches)
        # lightly's LambdaLR scales every group's own LR, so the layer-wise ratios are kept.
        sched = warmup_cosine(opt, hp.warmup_epochs, per_epoch, total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def run_finetune(
    backbone: nn.Module,
    train_ds: Dataset,
    test_ds: Dataset,
    num_classes: int,
    epochs: int,
    batch_size: int = 64,
    max_steps: int = -1,
    num_workers: int = 0,
    accelerator: str = "auto",
    devices: int | str = 1,
    num_nodes: int = 1,
    precision: str = "32-true",
    seed: int = 0,
    default_root_dir: str | None = None,
    enable_progress_bar: bool = False,
    run_dir: str | Path | None = None,
    resume: bool = False,
    checkpoint_every: int = 500,
    origin: Mapping[str, Any] | None = None,
    **module_kwargs: Any,
) -> dict[str, float] | None:
    """Fine-tune ``backbone`` (in place) on ``train_ds`` with a Lightning Trainer and return the
    test accuracies ``{"top1", "top5"}`` (fractions; top-5 only with >= 5 classes).

    ``module_kwargs`` go to ``FineTuneModule`` (``base_lr``, ``layer_decay``, ``drop_path_rate``,
    ``label_smoothing``, ``mixup_alpha``, ``img_size`` ...); ``batch_size`` is per process, the
    LR scales with the global batch (x ``devices`` x ``num_nodes``, MAE's rule).
    ``max_steps`` caps the run (smoke tests); the LR schedule follows the shorter of the two.

    ``run_dir``, ``resume``, ``checkpoint_every`` and ``origin``: checkpoints, signals and exact resume, and
    several processes (the metrics come back in process 0, None in the others), as
    ``ssl_vit.eval.train_run.train_and_test`` describes (a signal raises
    :class:`~ssl_vit.eval.train_run.EvalRunInterrupted`)."""
    def make_module(total_steps: int, steps_per_epoch: int, world_size: int) -> FineTuneModule:
        return FineTuneModule(backbone, num_classes, batch_size=batch_size * world_size, seed=seed, total_steps=total_steps,
                              steps_per_epoch=steps_per_epoch, **module_kwargs)

    return train_and_test(
        make_module, train_ds, test_ds, what="fine-tuning", epochs=epochs, batch_size=batch_size, max_steps=max_steps,
        num_workers=num_workers, accelerator=accelerator, devices=devices, num_nodes=num_nodes, precision=precision, seed=seed,
        default_root_dir=default_root_dir, enable_progress_bar=enable_progress_bar, run_dir=run_dir, resume=resume,
        checkpoint_every=checkpoint_every, origin=origin,
    )
