"""What every pretext task shares: the backbone from the registry, the optimiser and its per-step
LR / weight-decay schedules, EMA updates of declared (online, target) pairs, gradient clipping,
the online linear probe, logging and the non-finite-loss guard (its checkpoint record: ``record.py``).

A method subclasses ``BaseMethod`` (or a method, to change a part of it), builds its heads and
loss from typed ``__init__`` arguments, and implements ``step(views, labels) -> dict`` returning
at least ``loss`` (and ``features``, the detached representation the online probe learns from);
the other scalars it returns are logged as ``train/<key>``. A momentum encoder or teacher is
declared by assigning ``self.ema = EMAPairs([(online, target), ...], start, end)``: the base
updates it after every optimiser step.

Distributed training (DDP / FSDP through Lightning) gives the same step as one process with the
whole batch: losses are means over the local batch and DDP averages gradients; what a method
computes across the batch (MoCo v3's gathered keys, DINO's centre, synchronised BatchNorm) spans
all processes; logged values are averaged over processes; the non-finite-loss decision is taken
by all processes together. Each step's randomness comes from a seed of (run seed, epoch, batch,
rank), so a resumed run continues with the randomness of an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from ssl_vit.backbones import create_backbone, get_spec
from ssl_vit.backbones.compile import check_backend, compile_backbone
from ssl_vit.backbones.registry import as_plain
from ssl_vit.methods.ema import EMAPairs
from ssl_vit.methods.grad_clip import ClipMode, clip_gradients
from ssl_vit.methods.nonfinite import NonFiniteGuard, NonFinitePolicy
from ssl_vit.methods.optim import (
    OptimizerName,
    WeightDecayExempt,
    build_optimizer,
    lr_and_weight_decay,
    param_groups,
)
from ssl_vit.methods.optimizer_state import materialize_adam_state
from ssl_vit.methods.probe import OnlineLinearProbe
from ssl_vit.methods.record import checkpoint_record, data_info, restore_record
from ssl_vit.methods.sharding import gradient_shard_group, unwrapped_name
from ssl_vit.methods.start_notes import start_notes
from ssl_vit.methods.sync_batchnorm import convert_sync_batchnorm
from ssl_vit.runtime import global_seed, seed_training_step

Batch = tuple[list[Tensor], Tensor]


# The schedules (LR, weight decay, EMA momentum, DINO's teacher temperature) are functions of the
# position in training, so a run needs a length.
NO_LENGTH = (
    "the schedules need the length of training: set trainer.max_steps or trainer.max_epochs "
    "(max_time alone can stop a run but cannot size its schedules)"
)


class BaseMethod(L.LightningModule):
    """Base of every method. Arguments shared by all methods:

    Args:
        backbone: a registered backbone name (``ssl-vit backbones`` lists them).
        backbone_kwargs: its arguments (img_size, patch_size, in_chans, drop_path_rate, ...).
        optimizer: ``adamw`` (ViT methods), ``sgd`` or ``lars`` (large-batch ResNets).
        base_lr: learning rate for a global batch of 256; the peak LR is
            ``base_lr * global_batch / 256`` (Goyal et al. 2017 linear scaling, as MoCo v3 and DINO).
        min_lr: LR at the end of the cosine decay.
        warmup_epochs: linear LR warm-up (step t at peak·(t + 1)/W; fractions allowed).
        warmup_steps: the warm-up in optimiser steps instead (the ViT paper counts 10k steps);
            overrides ``warmup_epochs`` when set.
        weight_decay: weight decay at the start (of the parameters ``weight_decay_exempt`` leaves).
        weight_decay_end: weight decay at the end, reached by a cosine (DINO: 0.04 -> 0.4);
            ``None`` keeps it constant.
        weight_decay_exempt: which parameters get no weight decay: ``bias_norm_tokens`` biases,
            norm weights, [CLS], position and mask embeddings (big_vision's decay of kernels only,
            timm, MAE: the ViT paper's methods); ``bias_norm`` biases and the other 1-D
            parameters (DINO ``utils.get_params_groups``); ``none`` every parameter is decayed
            (MoCo v3 ``main_moco.py``: ``AdamW(model.parameters(), ...)``). Judged on the shapes
            before any FSDP wrapping. The online probe is never decayed.
        betas: AdamW betas.
        sgd_momentum: the momentum of SGD / LARS (not the EMA momentum of MoCo v3's momentum
            encoder or DINO's teacher, which those methods call ``momentum``).
        grad_clip: clip gradients to this norm; ``None`` disables clipping. The online probe's
            gradients are left out (they would shrink the model's update otherwise).
        grad_clip_mode: ``global`` (one norm over the model's parameters) or ``per_param`` (DINO's
            ``clip_gradients``: each tensor's norm separately); under FSDP the norms are those of
            the whole (unsharded) gradients.
        num_classes: when the data has labels (of at least two classes), an online linear probe
            (BN without affine + linear) is trained on the detached representation and reports
            ``probe/val_acc``.
        probe_lr: AdamW learning rate of the online probe (constant; it never touches the backbone).
        nonfinite_policy: on a NaN/Inf loss, ``raise`` stops training with a message naming the step
            and the last good checkpoint; ``skip`` drops the batch (the optimiser step it belongs
            to, its EMA update and what its forward changed in buffers: BatchNorm statistics,
            DINO's centre) and continues, at most ``max_skipped_batches`` times.
        max_skipped_batches: how many non-finite batches ``skip`` tolerates before it raises.
        fused_optimizer: AdamW and SGD run torch's fused kernel (one pass over each parameter and
            its moments; CPU and CUDA) where the parameters allow it; the same update to float
            rounding, several times faster than the per-tensor loop. False: torch's default. A
            resumed run keeps the implementation its checkpoint was written with (torch restores
            every param-group setting, ``fused`` included).
        compile_backbone: ``torch.compile`` the backbone and any momentum encoder / teacher
            before training, one block at a time (``ssl_vit.backbones.compile``: a ViT's blocks
            share one compiled graph; parameter names, checkpoints and exports stay the same). The
            first steps then take longer (compiling: about half a minute for a ViT-S on 2 CPU
            cores), the others run fused elementwise kernels: meant for GPUs, where a step is
            launch-bound; on a 2-core CPU no faster (``benchmarks/RESULTS.md``). The heads and the
            online probe run eagerly.
        compile_backend: the ``torch.compile`` backend: ``inductor`` (generated kernels; needs a
            C++ compiler on a CPU) or e.g. ``aot_eager`` (the same tracing, torch's kernels: a
            check that a model compiles).
    """

    # The encoder ``ssl-vit eval`` / ``export`` / ``visualize`` take from a checkpoint when not
    # told (``--which``): ``student`` is ``backbone``; a method whose paper evaluates another
    # (DINO: ``teacher``) says so here, and its checkpoints record it.
    default_encoder: str = "student"

    def __init__(
        self,
        backbone: str = "vit_small",
        backbone_kwargs: dict[str, Any] | None = None,
        optimizer: OptimizerName = "adamw",
        base_lr: float = 1.5e-4,
        min_lr: float = 0.0,
        warmup_epochs: float = 10.0,
        warmup_steps: int | None = None,
        weight_decay: float = 0.05,
        weight_decay_end: float | None = None,
        weight_decay_exempt: WeightDecayExempt = "bias_norm_tokens",
        betas: tuple[float, float] = (0.9, 0.999),
        sgd_momentum: float = 0.9,
        grad_clip: float | None = None,
        grad_clip_mode: ClipMode = "global",
        num_classes: int | None = None,
        probe_lr: float = 1e-3,
        nonfinite_policy: NonFinitePolicy = "raise",
        max_skipped_batches: int = 10,
        fused_optimizer: bool = True,
        compile_backbone: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        received = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        self.save_hyperparameters()
        _check_not_shadowed(type(self), received, self.hparams)
        if optimizer not in ("adamw", "sgd", "lars"):
            raise ValueError(f"optimizer must be 'adamw', 'sgd' or 'lars', got {optimizer!r}")
        if base_lr <= 0 or warmup_epochs < 0 or weight_decay < 0:
            raise ValueError("base_lr must be > 0, warmup_epochs >= 0 and weight_decay >= 0")
        if weight_decay_exempt not in ("bias_norm_tokens", "bias_norm", "none"):
            raise ValueError(f"weight_decay_exempt must be 'bias_norm_tokens', 'bias_norm' or 'none', got {weight_decay_exempt!r}")
        if compile_backbone:
            check_backend(compile_backend)
        self.backbone_name = backbone
        self.backbone_kwargs = dict(backbone_kwargs or {})
        self.backbone = create_backbone(backbone, **self.backbone_kwargs)
        self.probe = OnlineLinearProbe(self.backbone.embed_dim, num_classes) if num_classes and num_classes > 1 else None  # one class: nothing to tell apart
        # Set by methods with a momentum encoder / teacher.
        self.ema: EMAPairs | None = None
        self._total_steps = 1
        self._steps_per_epoch = 1
        self.nonfinite = NonFiniteGuard(nonfinite_policy, max_skipped_batches)
        self.step_skipped = False  # the last optimiser step was skipped
        self._seed: int | None = None  # base of the per-step seeds; kept in checkpoints
        self.peak_lr = base_lr
        self.global_batch_size: int | None = None
        # Parameter shapes before any FSDP wrapping, by unwrapped name (recorded in ``setup``).
        self._shapes_before_wrapping: dict[str, torch.Size] = {}

    # ------------------------------------------------------------------ what a method implements
    def step(self, views: list[Tensor], labels: Tensor) -> dict[str, Tensor]:
        """One training step's forward: returns ``loss``, ``features`` (``[B, D]``, the
        representation the online probe learns from; needed when there is a probe) and scalars
        to log."""
        raise NotImplementedError

    def step_flops(self, views_shapes: list[tuple[int, ...]], world_size: int) -> float | None:
        """FLOPs per image of one training step on views of these shapes (``[B, C, H, W]`` each),
        the online probe aside: the x-axis of the accuracy-vs-compute plot. The built-in methods
        have theirs in ``ssl_vit.flops.method_step_flops``; a new method may count its own (the
        helpers there: ``backbone_train_flops``, ``backbone_forward_flops``, ``linear_flops``).
        None: no FLOP model, and the run records no pretraining FLOPs."""
        return None

    def check_views(self, num_views: int) -> None:
        """Raise ``ValueError`` for a number of views per image the method cannot train on: the
        recipe checks call it with the data's view transform before training; ``step`` may too."""

    def cancel_gradients(self) -> None:
        """Hook between backward and the optimiser step (DINO freezes its last layer here)."""

    # ------------------------------------------------------------------ helpers for methods
    def build_target_backbone(self) -> nn.Module:
        """A frozen copy of the backbone for a momentum encoder / teacher, rebuilt without
        stochastic depth or dropout (the DINO teacher and the MoCo v3 momentum encoder are built
        without them in the reference code) and loaded with the online weights."""
        kwargs = dict(self.backbone_kwargs)
        spec = get_spec(self.backbone_name)
        allowed = spec.allowed_kwargs()
        for key in ("drop_path_rate", "drop_rate", "attn_drop_rate"):
            if key in allowed or (key in kwargs and spec.takes_any_kwargs()):
                kwargs[key] = 0.0
        target = create_backbone(self.backbone_name, **kwargs)
        target.load_state_dict(self.backbone.state_dict())
        for p in target.parameters():
            p.requires_grad_(False)
        return target

    def _per_device_batch(self, batch: Any) -> int:
        """The per-device batch size: the datamodule's ``batch_size``, else the loader's, else the
        first batch's."""
        trainer = self.trainer
        per_device = getattr(trainer.datamodule, "batch_size", None) if trainer.datamodule is not None else None
        if per_device is None and trainer.train_dataloader is not None:
            per_device = getattr(trainer.train_dataloader, "batch_size", None)
        if per_device is None:
            per_device = int(batch[1].shape[0])
        return int(per_device)

    def sync_batchnorm(self, *names: str) -> None:
        """Normalise the BatchNorm layers of these submodules over the global batch when training
        on several processes (call from ``setup``, before the optimiser is built)."""
        if self._trainer is None or self.trainer.world_size <= 1:
            return
        device_type = self.trainer.strategy.root_device.type
        for name in names:
            setattr(self, name, convert_sync_batchnorm(getattr(self, name), device_type))

    def compile_backbones(self, backend: str) -> list[str]:
        """``torch.compile`` the backbone and every ``NAME_backbone`` (a momentum encoder, a
        teacher) in place, one block at a time (``ssl_vit.backbones.compile``); returns their
        names. ``setup`` calls it when ``compile_backbone`` is set."""
        names = [name for name, _ in self.named_children() if name == "backbone" or name.endswith("_backbone")]
        for name in names:
            compile_backbone(getattr(self, name), backend)
        return names

    # ------------------------------------------------------------------ optimisation
    def shape_before_wrapping(self, p: Tensor) -> torch.Size:
        """A parameter's shape as built: under FSDP each parameter is a flat 1-D shard of it
        (the shapes are recorded in ``setup``, before a strategy wraps the model)."""
        if not self._shapes_before_wrapping:
            return p.shape
        names = getattr(self, "_wrapped_names", None)
        if names is None or id(p) not in names:
            names = self._wrapped_names = {id(q): unwrapped_name(n) for n, q in self.named_parameters()}
        return self._shapes_before_wrapping.get(names.get(id(p), ""), p.shape)

    def _probe_param_ids(self) -> set[int]:
        """The online probe's parameters (by identity: FSDP renames them, never replaces them)."""
        return {id(p) for p in self.probe.parameters()} if self.probe is not None else set()

    def _param_groups(self) -> list[dict[str, Any]]:
        tokens = {"mask_token"}
        for prefix, module in self.named_children():
            if hasattr(module, "no_weight_decay"):
                tokens |= {f"{prefix}.{n}" for n in module.no_weight_decay()}
        hp = self.hparams
        return param_groups(self.named_parameters(), hp.weight_decay_exempt, tokens, hp.weight_decay,
                            self._probe_param_ids(), hp.probe_lr, self.shape_before_wrapping)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp.optimizer == "lars" and self._trainer is not None and gradient_shard_group(self.trainer.strategy) is not None:
            # lightly's LARS scales each tensor by |w| / |g|: under FSDP it would see each
            # process's flat shard, not the tensor (and take every parameter for a 1-D one).
            raise ValueError("optimizer 'lars' does not run under FSDP (its trust ratio needs whole tensors); use DDP, or adamw / sgd")
        return build_optimizer(self._param_groups(), hp.optimizer, hp.base_lr, hp.betas, hp.sgd_momentum, hp.fused_optimizer)

    def on_train_start(self) -> None:
        trainer = self.trainer
        if not math.isfinite(trainer.estimated_stepping_batches):
            raise ValueError(NO_LENGTH)
        self._total_steps = max(1, int(trainer.estimated_stepping_batches))
        batches = trainer.num_training_batches
        if not math.isfinite(batches) or batches <= 0:
            batches = self._total_steps
        self._steps_per_epoch = max(1, math.ceil(batches / trainer.accumulate_grad_batches))
        self._lr_announced = False

    def _scale_lr(self, batch: Any) -> None:
        trainer = self.trainer
        per_device = self._per_device_batch(batch)
        global_batch = per_device * trainer.world_size * trainer.accumulate_grad_batches
        self.global_batch_size = global_batch
        self.peak_lr = self.hparams.base_lr * global_batch / 256  # the one place the LR is scaled
        warmup = self._warmup_steps()
        hp = self.hparams
        label = f"warmup_steps {hp.warmup_steps}" if hp.warmup_steps is not None else f"warmup_epochs {hp.warmup_epochs:g} = {warmup} steps"
        for line in start_notes(type(self).__name__, self.backbone_name, per_device, trainer.world_size, trainer.accumulate_grad_batches,
                                hp.base_lr, self.peak_lr, self._total_steps, self._steps_per_epoch, warmup, label, self.global_step,
                                getattr(self, "_resumed_total_steps", None), getattr(self, "_resumed_global_batch", None)):
            rank_zero_info(line)
        self._lr_announced = True

    def schedule_values(self, step: int) -> dict[str, float]:
        """LR and weight decay at an optimiser step (``optim.lr_and_weight_decay``)."""
        hp = self.hparams
        return lr_and_weight_decay(step, self._total_steps, self._warmup_steps(), self.peak_lr, hp.min_lr, hp.weight_decay, hp.weight_decay_end)

    def _warmup_steps(self) -> int:
        hp = self.hparams
        return hp.warmup_steps if hp.warmup_steps is not None else round(hp.warmup_epochs * self._steps_per_epoch)

    def _seed_step(self, batch_idx: int) -> None:
        """Seed torch's generators for this batch (drop path, masking) from (run seed, epoch,
        batch, rank): the randomness is a function of the position in training, so a resumed run
        draws what the uninterrupted run drew, and each process draws its own."""
        if self._seed is None:  # seed_everything's seed, else torch's (the same on every process)
            self._seed = global_seed(torch.initial_seed())
        seed_training_step(self._seed, self.current_epoch, batch_idx, self.global_rank)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._seed_step(batch_idx)
        if not getattr(self, "_lr_announced", False):
            self._scale_lr(batch)
        values = self.schedule_values(self.global_step)
        optimizer = self.optimizers()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # unwrap LightningOptimizer
        for group in optimizer.param_groups:
            if "fixed_lr" not in group:
                group["lr"] = values["lr"]
            if group.get("scheduled_wd"):
                group["weight_decay"] = values["weight_decay"]
        self._schedule_now = values

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None) -> None:
        # Our own clipping (per-parameter for DINO) of the model's gradients: the online probe
        # learns from detached features, and its gradient must not shrink the model's update.
        # A Trainer-level clip (Lightning's, over every parameter) still works on top, except with
        # fp16 loss scaling and a fused optimiser, which Lightning refuses (grad_clip is not).
        clip = self.hparams.grad_clip
        if clip:
            probe_ids = self._probe_param_ids()
            # Every parameter, with or without a gradient, in the optimiser's order: under FSDP
            # each process must sum the same list.
            params = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in probe_ids]
            shard_group = gradient_shard_group(self.trainer.strategy) if self._trainer is not None else None
            clip_gradients(params, clip, self.hparams.grad_clip_mode, shard_group)
        if gradient_clip_val:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # fp16 with a loss scaler: Lightning unscales the gradients before this hook only for
        # optimisers that do not unscale inside their step, as the fused ones do; ours (the
        # default) would otherwise be clipped at 65536x their size, and a skipped batch would
        # leave the scaler without the inf check its update needs. GradScaler.step takes an
        # optimiser unscaled here as it takes any other.
        scaler = getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer is not None else None
        if scaler is not None and scaler.is_enabled() and getattr(optimizer, "_step_supports_amp_scaling", False):
            scaler.unscale_(optimizer)
        if self.nonfinite.skipping:
            # A skipped batch: without gradients the optimiser leaves every parameter, its moments
            # and its weight decay alone.
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            self.cancel_gradients()
        # Parameters without a gradient this step get Adam's initial state now rather than at
        # their first gradient: numerically the same, and FSDP can then gather the optimizer
        # state for a checkpoint (see ssl_vit.methods.optimizer_state).
        materialize_adam_state(optimizer)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        # Read after the step: Lightning runs the last micro-batch's training_step inside it, so a
        # non-finite loss there is only known now. ``step_skipped`` tells a method's own
        # optimizer_step (DINO's centre) what happened.
        self.step_skipped = self.nonfinite.step_done()
        if self.step_skipped:
            return
        # EMA after each optimiser step (MoCo v3 Alg. 1; DINO main loop "EMA update for the teacher").
        if self.ema is not None:
            m = self.ema.update(self.global_step, self._total_steps)
            self.log("train/ema_momentum", m, on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor | None:
        if not (isinstance(batch, list | tuple) and len(batch) == 2 and isinstance(batch[0], list | tuple)):
            raise TypeError("a training batch must be (views, labels) with views a list of [B, C, H, W] tensors, one per "
                            "view (the datamodules' view transforms make it: SingleView, TwoViews, MultiCrop); got "
                            f"{type(batch).__name__} of {', '.join(type(b).__name__ for b in batch) if isinstance(batch, list | tuple) else '?'}")
        views, labels = batch
        buffers = self.nonfinite.snapshot(self)  # what to put back if this batch is skipped
        out = self.step(views, labels)
        loss = out.pop("loss")
        features = out.pop("features", None)
        finite = bool(torch.isfinite(loss))
        if self.trainer.world_size > 1:
            # One decision for all processes: a process that skipped DDP's backward would hang the rest.
            finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            return self._handle_nonfinite(loss, buffers)
        # Other scalars under train/ (a key that names its own group, "probe/x", keeps it).
        logs = {(k if "/" in k else f"train/{k}"): v.detach().float() if isinstance(v, Tensor) else v for k, v in out.items()}
        logs["train/loss"] = loss.detach()
        if self.probe is not None and features is None:
            raise ValueError(f"{type(self).__name__}.step returned no 'features', but the run has an online probe (the data has "
                             "labels): return the representation [B, D] it should learn from as 'features'")
        if self.probe is not None:
            probe_loss, acc = self.probe.training_loss(features.detach(), labels)
            if probe_loss is not None:
                loss = loss + probe_loss
                logs["probe/train_loss"] = probe_loss.detach()
                logs["probe/train_acc"] = acc
        values = getattr(self, "_schedule_now", None)
        if values is not None:
            logs["train/lr"] = values["lr"]
            logs["train/weight_decay"] = values["weight_decay"]
        if self.trainer.world_size > 1:
            logs = self._mean_over_processes(logs)
        self.log_dict(logs, on_step=True, on_epoch=False, prog_bar=False, batch_size=labels.shape[0], sync_dist=False)
        self.log("loss", logs["train/loss"], prog_bar=True, on_step=True, on_epoch=False, logger=False, batch_size=labels.shape[0])
        return loss

    def _mean_over_processes(self, logs: dict[str, Any]) -> dict[str, Any]:
        """The logged tensors averaged over processes in one all-reduce: the loss of the global
        batch (each process's loss is the mean over its equal share), not rank 0's share."""
        keys = [k for k, v in logs.items() if isinstance(v, Tensor)]
        if not keys:
            return logs
        stacked = torch.stack([logs[k].detach().float().reshape(()) for k in keys])  # [K]
        mean = self.trainer.strategy.reduce(stacked, reduce_op="mean")  # [K]
        return {**logs, **dict(zip(keys, mean.unbind()))}

    def _handle_nonfinite(self, loss: Tensor, buffers: list[tuple[Tensor, Tensor]]) -> Tensor:
        ckpt_cb = getattr(self.trainer, "checkpoint_callback", None)
        last = (getattr(ckpt_cb, "last_model_path", None) or getattr(ckpt_cb, "best_model_path", None)) if ckpt_cb is not None else None
        return self.nonfinite.handle(self, loss, buffers, self.global_step, self.current_epoch, self.global_rank, last)

    def on_validation_epoch_start(self) -> None:
        self._val_totals: dict[str, Tensor] = {}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        if self.probe is None and type(self).validation_metrics is BaseMethod.validation_metrics:
            return  # nothing to measure: skip the backbone pass
        with torch.no_grad():
            feats = self.backbone(images)  # [B, D]
        # Each metric is a mean over the batch's labelled images (an unreadable file of the test
        # split, or the padding of a process's share, comes labelled -1): summed here with their
        # number, and divided once the sums of every process are in (on_validation_epoch_end).
        labelled = (labels >= 0).sum().float()
        for name, value in self.validation_metrics(feats, labels).items():
            total = self._val_totals.setdefault(name, torch.zeros(2, device=feats.device))  # [value sum, images]
            total += torch.stack([value.detach().float() * labelled, labelled])

    def on_validation_epoch_end(self) -> None:
        # Lightning's own weighted mean (self.log with batch_size and sync_dist) divides the
        # summed weights by the process count in integers: 7 images over 2 processes count as 3.
        totals = getattr(self, "_val_totals", {})
        names = sorted(totals)
        if not names:
            return
        stacked = torch.stack([totals[n] for n in names])  # [K, 2]
        if self.trainer.world_size > 1:  # every process has batches (EvenShares), so the same names
            stacked = self.trainer.strategy.reduce(stacked, reduce_op="sum")
        for name, (value, count) in zip(names, stacked.unbind()):
            if count > 0:  # a split without labels measures nothing
                # The same value on every process: sync_dist averages it to itself (and spares
                # Lightning's warning about epoch-level values logged without it).
                self.log(name, value / count, prog_bar=True, sync_dist=True)

    def validation_metrics(self, features: Tensor, labels: Tensor) -> dict[str, Tensor]:
        """Metrics of one validation batch from the backbone's representation ``[B, D]``: means
        over the images with a label (any value where there are none: it is weighted by 0)."""
        if self.probe is None:
            return {}
        return {"probe/val_acc": self.probe.accuracy(features, labels)}

    # ------------------------------------------------------------------ checkpoints
    def setup(self, stage: str) -> None:
        # Lightning calls this before a strategy wraps the model (FSDP flattens the parameters).
        if not self._shapes_before_wrapping:
            self._shapes_before_wrapping = {unwrapped_name(n): p.shape for n, p in self.named_parameters()}
        # What the data looked like, for export (normalisation) and result records.
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is not None:
            self.data_info = data_info(dm)
        # The online probe's BN (specs §5: BN without affine + linear) over the global batch, so
        # it learns the same whatever the split over devices.
        if self.probe is not None:
            self.sync_batchnorm("probe")
        if self.hparams.compile_backbone and not getattr(self, "_backbones_compiled", False):
            # In place, before a strategy wraps the model: names and state dicts do not change.
            rank_zero_info(f"[ssl_vit] compiling the backbone with torch.compile ({self.hparams.compile_backend}, one block "
                           "at a time): the first steps take longer")
            self.compile_backbones(self.hparams.compile_backend)
            self._backbones_compiled = True

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ssl_vit"] = checkpoint_record(self)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        restore_record(self, checkpoint.get("ssl_vit") or {})


def _check_not_shadowed(cls: type, received: dict[str, Any], hparams: Mapping[str, Any]) -> None:
    """``save_hyperparameters`` records a method's own argument over a base argument of the same
    name, so the base would then read the method's value from ``hparams`` (a momentum encoder's
    0.99 as the SGD momentum, say). A method that forwards the argument (to change its default)
    is fine: the recorded value is then the one the base received."""
    shadowed = []
    for name, value in received.items():
        recorded = hparams.get(name, value)
        try:  # a recipe gives lists where the signature says tuple
            same = recorded is value or bool(as_plain(recorded) == as_plain(value))
        except Exception:  # values without a plain ==
            same = False
        if not same:
            shadowed.append(name)
    if shadowed:
        raise TypeError(
            f"{cls.__name__}.__init__ has its own argument(s) {', '.join(shadowed)} with the name of a BaseMethod "
            "argument it does not pass on; rename it (or pass it to super().__init__)"
        )


