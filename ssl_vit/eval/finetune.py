"""End-to-end fine-tuning of a pretrained backbone with a linear head: the BEiT/MAE recipe (MAE
Appendix A.1, ``main_finetune.py``; DeiT's regularisers). Layer-wise LR decay (BEiT §2.5, MAE
``util/lr_decay.py``): the LR of layer id i (0: the embeddings, b + 1: block b, depth + 1: the
final norm and head; ResNets: one id per stage) is scaled by ``layer_decay ** (depth + 1 - i)``,
so the most general layers move least. AdamW, warm-up then cosine decay per step; drop path,
label smoothing, optional RandAugment, random erasing and MixUp/CutMix; optionally another
resolution (ViT paper §3.2). Every weight trains: a fixed sin-cos table (MoCo v3) becomes a
learned position embedding, as timm's ViT loads it in MAE's and MoCo v3's code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import Dataset
from torchvision.ops import StochasticDepth
from torchvision.transforms import v2

from ssl_vit.backbones import is_vit
from ssl_vit.backbones.compile import compile_backbone
from ssl_vit.data import SingleView
from ssl_vit.eval.linear import warmup_cosine
from ssl_vit.eval.train_run import ImageClassifier, ImageRun, train_and_test
from ssl_vit.methods.optim import fused_kwargs
from ssl_vit.runtime import seed_training_step


def num_layer_ids(backbone: nn.Module) -> int:
    """The id of the last layer (final norm and head): depth + 1, or ``num_stages + 1`` (ResNets)."""
    return backbone.depth + 1 if is_vit(backbone) else backbone.num_stages + 1


def layer_id(name: str, backbone: nn.Module) -> int:
    """The layer id of backbone parameter ``name`` (MAE ``get_layer_id_for_vit``; per stage for
    ResNets, a hybrid's trunk in ``patch_embed``); anything else (the final norm) is the last."""
    if is_vit(backbone):
        if name in ("cls_token", "pos_embed") or name.startswith("patch_embed."):
            return 0
        return int(name.split(".")[1]) + 1 if name.startswith("blocks.") else num_layer_ids(backbone)
    if name.startswith(("conv1.", "bn1.")):
        return 0
    return int(name.split(".")[0].removeprefix("layer")) if name.startswith("layer") else num_layer_ids(backbone)


def param_groups_layer_decay(backbone: nn.Module, head: nn.Module | None, lr: float, weight_decay: float, layer_decay: float) -> list[dict[str, Any]]:
    """AdamW groups, one per (layer id, decayed or not), with ``lr = lr · layer_decay ** (last - id)``
    and, for inspection, ``names``, ``layer_id`` and ``lr_scale``. Frozen parameters are left out;
    1-D ones (biases, norms) and ``backbone.no_weight_decay()`` get no weight decay."""
    last = num_layer_ids(backbone)
    skip = set(backbone.no_weight_decay()) if hasattr(backbone, "no_weight_decay") else set()
    named = [(n, p, layer_id(n, backbone)) for n, p in backbone.named_parameters()]
    named += [(f"head.{n}", p, last) for n, p in (head.named_parameters() if head is not None else [])]
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, p, lid in named:
        if p.requires_grad:
            decay = p.ndim > 1 and name not in skip
            scale = layer_decay ** (last - lid)
            group = groups.setdefault((lid, decay), {"params": [], "names": [], "layer_id": lid, "lr_scale": scale, "lr": lr * scale,
                                                     "weight_decay": weight_decay if decay else 0.0})
            group["params"].append(p)
            group["names"].append(name)
    return [groups[k] for k in sorted(groups)]


def set_drop_path(backbone: nn.Module, rate: float) -> None:
    """Stochastic depth on a ViT's blocks, rising linearly from 0 at the first to ``rate`` at the
    last (DeiT / timm ``torch.linspace(0, rate, depth)``), a whole sample's residual at a time."""
    depth = len(backbone.blocks)
    for i, block in enumerate(backbone.blocks):
        p = rate * i / (depth - 1) if depth > 1 else 0.0
        block.drop_path = StochasticDepth(p, "row") if p > 0 else nn.Identity()


def new_head(in_dim: int, num_classes: int, seed: int | None = None) -> nn.Linear:
    """A classifier of near-uniform first predictions: weights trunc-normal(std 2e-5) (MAE ``main_finetune.py``)."""
    head = nn.Linear(in_dim, num_classes)
    nn.init.trunc_normal_(head.weight, std=2e-5, generator=torch.Generator().manual_seed(seed) if seed is not None else None)
    nn.init.zeros_(head.bias)
    return head


def finetuned_architecture(backbone: nn.Module) -> tuple[str | None, dict[str, Any]]:
    """The registry name and kwargs that rebuild ``backbone`` as fine-tuned (at its new resolution)."""
    kwargs = dict(getattr(backbone, "backbone_kwargs", {}))
    if hasattr(backbone, "img_size"):
        kwargs["img_size"] = tuple(int(s) for s in backbone.img_size)
    return getattr(backbone, "backbone_name", None), kwargs


def default_crop_scale(img_size: int) -> tuple[float, float]:
    """The crop's area range: (0.08, 1) (DeiT/MAE/MoCo v3/DINO) from 96 px on, (0.5, 1) for small images."""
    return (0.08, 1.0) if img_size >= 96 else (0.5, 1.0)


@dataclass
class FineTuneSettings:
    """``ssl-vit eval finetune``, a recipe's ``evaluate.finetune``: MAE's ViT-B recipe (``FINETUNE.md``;
    ViT-L: ``base_lr`` 1e-3, ``layer_decay`` 0.75) but 10 epochs; ``batch_size`` per process, the LR
    ``base_lr · global batch / 256``; MixUp / CutMix (MAE: 0.8 / 1.0; both: one per batch),
    RandAugment (MAE: 2, 9), ``random_erasing`` (Zhong et al. 2020; MAE: 0.25); ``augment``: a random
    resized crop (+ flip) of ``crop_scale``, else the evaluation transform; ``max_steps``: -1: no cap."""

    epochs: int = 10
    batch_size: int = 256
    base_lr: float = 5e-4
    layer_decay: float = 0.65
    drop_path_rate: float = 0.1
    label_smoothing: float = 0.1
    weight_decay: float = 0.05
    warmup_epochs: float = 5.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    rand_augment: tuple[int, int] | None = None
    random_erasing: float = 0.0
    augment: bool = True
    crop_scale: tuple[float, float] | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    max_steps: int = -1
    checkpoint_every: int = 500
    compile_backbone: bool = False
    compile_backend: str = "inductor"

    def train_views(self, img_size: int) -> SingleView | None:
        """The training images' transform (None: the evaluation transform)."""
        return SingleView(scale=tuple(self.crop_scale or default_crop_scale(img_size)), rand_augment=self.rand_augment) if self.augment else None

    def run(self, backbone: nn.Module, train_ds: Dataset, test_ds: Dataset, num_classes: int, run: ImageRun | None = None, *,
            head: nn.Linear | None = None, run_info: Mapping[str, Any] | None = None, origin: Mapping[str, Any] | None = None,
            img_size: int | None = None) -> dict[str, float] | None:
        """Fine-tune ``backbone`` (in place) and return its test ``{"top1", "top5"}`` (None off process 0)."""
        run = run or ImageRun()
        return train_and_test(lambda total, per_epoch, world: FineTuneModule(
            backbone, num_classes, self, world_size=world, seed=run.seed, total_steps=total, steps_per_epoch=per_epoch, head=head,
            run_info=run_info, img_size=img_size), train_ds, test_ds, self, run, "fine-tuning", origin)


class FineTuneModule(ImageClassifier):
    """Backbone + linear head trained end to end on ``world_size`` processes; each batch's draws
    (drop path, MixUp, erasing) follow from ``seed`` and its position, so a resumed run draws the
    same. ``run_info`` (``method``, ``data`` with ``mean``/``std``) goes into its checkpoints as
    a pretraining's, so that ``ssl-vit export`` and ``ssl-vit eval`` read the fine-tuned backbone."""

    def __init__(self, backbone: nn.Module, num_classes: int, settings: FineTuneSettings | None = None, *, world_size: int = 1, seed: int = 0,
                 total_steps: int | None = None, steps_per_epoch: int | None = None, head: nn.Linear | None = None,
                 run_info: Mapping[str, Any] | None = None, img_size: int | None = None) -> None:
        super().__init__(num_classes)
        s = self.settings = settings or FineTuneSettings()
        recorded = {k: v for k, v in asdict(s).items() if k != "checkpoint_every"}
        self.save_hyperparameters({**recorded, "num_classes": num_classes, "world_size": world_size, "seed": seed, "total_steps": total_steps,
                                   "steps_per_epoch": steps_per_epoch, "img_size": img_size})
        self.run_info = dict(run_info or {})
        self.backbone = backbone
        if is_vit(backbone):
            if img_size is not None and tuple(backbone.img_size) != (img_size, img_size):
                backbone.set_img_size((img_size, img_size))
            backbone.make_pos_embed_learnable()  # all weights train (a MoCo v3 sin-cos table too)
            set_drop_path(backbone, s.drop_path_rate)
        elif s.drop_path_rate > 0:
            rank_zero_warn(f"drop_path_rate={s.drop_path_rate} ignored: {type(backbone).__name__} has no blocks")
        self.head = head if head is not None else new_head(backbone.embed_dim, num_classes)
        self.lr = s.base_lr * s.batch_size * world_size / 256
        mixes = [op(alpha=a, num_classes=num_classes) for op, a in ((v2.MixUp, s.mixup_alpha), (v2.CutMix, s.cutmix_alpha)) if a > 0]
        self.mix = v2.RandomChoice(mixes) if len(mixes) == 2 else (mixes[0] if mixes else None)
        # value "random": N(0, 1) noise per pixel, drawn per image (a batch given whole would share one box)
        self.erase = v2.RandomErasing(p=s.random_erasing, value="random") if s.random_erasing > 0 else None

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))  # [B, num_classes]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        name, kwargs = finetuned_architecture(self.backbone)
        if name is not None:  # (a backbone not built by create_backbone: nothing to rebuild it from)
            checkpoint["ssl_vit"] = {"method": "finetune", **self.run_info, "backbone": name, "backbone_kwargs": kwargs,
                                     "global_step": self.global_step, "epoch": self.current_epoch}

    def setup(self, stage: str) -> None:
        # After __init__ changed the backbone (resolution, drop path); before a strategy wraps it.
        if self.settings.compile_backbone and not getattr(self, "_compiled", False):
            compile_backbone(self.backbone, self.settings.compile_backend)
            self._compiled = True

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        seed_training_step(self.hparams.seed, self.current_epoch, batch_idx, self.global_rank)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        x, y = batch
        if len(y) == 0:
            return self.nothing_to_learn()  # a batch of unreadable files only
        if self.erase is not None:
            x = torch.stack([self.erase(image) for image in x])  # [B, C, H, W], normalised
        if self.mix is not None:
            x, y = self.mix(x, y)  # y: soft labels [B, K]
        loss = F.cross_entropy(self(x), y, label_smoothing=self.settings.label_smoothing)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        s, hp = self.settings, self.hparams
        groups = param_groups_layer_decay(self.backbone, self.head, self.lr, s.weight_decay, s.layer_decay)
        opt = torch.optim.AdamW(groups, lr=self.lr, betas=tuple(s.betas), **fused_kwargs(groups))
        if hp.total_steps is not None and hp.steps_per_epoch is not None:
            total, per_epoch = hp.total_steps, hp.steps_per_epoch
        else:  # (the trainer's estimate builds the training loader: not before a resume restores its position)
            total = int(self.trainer.estimated_stepping_batches)
            per_epoch = max(1, self.trainer.num_training_batches // self.trainer.accumulate_grad_batches)
        # lightly's LambdaLR scales every group's own LR: the layer-wise ratios are kept.
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup_cosine(opt, s.warmup_epochs, per_epoch, total), "interval": "step"}}
