"""What every method shares: the backbone, the optimiser and its LR / weight-decay schedules,
gradient clipping, the online linear probe, logging, the non-finite-loss guard, the run info.

A method builds its heads and loss from typed ``__init__`` arguments and implements ``step(views,
labels) -> {"loss", "features", ...}``; around the optimiser step it may edit gradients
(``before_optimizer_step``) and update what no gradient moves (``after_optimizer_step``: EMA
targets). On several processes a step is the one-process step on the whole batch (keys, centres
and BatchNorm statistics span the processes); its randomness comes from (seed, epoch, batch, rank).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning as L
import torch
from lightly.models.utils import update_momentum
from lightly.utils.scheduler import cosine_schedule, cosine_warmup_schedule
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from ssl_vit.backbones import create_backbone, get_spec
from ssl_vit.backbones.compile import check_backend, compile_backbone
from ssl_vit.methods import distributed, optim
from ssl_vit.methods.distributed import ClipMode
from ssl_vit.methods.optim import OptimizerName, WeightDecayExempt
from ssl_vit.methods.probe import OnlineLinearProbe, labelled_accuracy
from ssl_vit.runtime import global_seed, seed_training_step

SHORT_WARMUP = 20  # optimiser steps: a warm-up made from epochs that is shorter gets a note


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/Inf loss, and the skip policy did not (or no longer) apply."""


def ema_update(online: nn.Module, target: nn.Module, momentum: float) -> None:
    """``target <- m·target + (1 - m)·online``, parameter by parameter (lightly's ``update_momentum``)."""
    for (name, p), q in zip(online.named_parameters(), target.parameters()):
        if p.shape != q.shape:  # averaged shard by shard: FSDP must split the two alike
            raise RuntimeError(f"EMA: {name} is {tuple(p.shape)} here in the online module but {tuple(q.shape)} in its target: FSDP sharded the "
                               "two differently; wrap each module of an EMA pair as an FSDP unit (as recipes/trainer/fsdp.yaml does)")
    update_momentum(online, target, momentum)


class BaseMethod(L.LightningModule):
    """The arguments every method shares.

    Args:
        backbone, backbone_kwargs: a registered backbone (``ssl-vit backbones``) and its arguments.
        optimizer: ``adamw`` (ViT methods), ``sgd`` or ``lars`` (large-batch ResNets).
        base_lr: LR per 256 images: the peak is ``base_lr * global_batch / 256`` (Goyal et al.'s
            linear scaling, as MoCo v3 and DINO), after a linear warm-up, then a cosine to ``min_lr``.
        warmup_epochs, warmup_steps: the warm-up's length; ``warmup_steps`` (the ViT paper counts
            steps), when set, replaces ``warmup_epochs``. The start-up line says the steps and which
            one set them; a note names a warm-up as long as the run, or under 20 steps from epochs.
        weight_decay, weight_decay_end: a cosine from one to the other (DINO: 0.04 -> 0.4); None: constant.
        weight_decay_exempt: no weight decay for ``bias_norm_tokens`` biases, norm weights, [CLS],
            position and mask embeddings (big_vision, timm, MAE); ``bias_norm`` biases and other 1-D
            parameters (DINO ``utils.get_params_groups``); ``none`` (MoCo v3 ``main_moco.py``).
        betas: AdamW's. sgd_momentum: SGD's / LARS's (not MoCo v3's or DINO's EMA ``momentum``).
        grad_clip, grad_clip_mode: clip the model's gradients (not the probe's) to this norm, one over
            all (``global``) or each parameter's (``per_param``, DINO); of the whole gradients under
            FSDP. None or 0: no clipping.
        num_classes: with two classes or more, an online linear probe (BatchNorm without affine +
            linear, AdamW at ``probe_lr``) learns from the detached representation: ``probe/val_acc``.
        nonfinite_policy: on a NaN/Inf loss, ``raise`` names the step and the last good checkpoint;
            ``skip`` drops the optimiser step, its EMA update and what it changed in buffers
            (BatchNorm statistics, DINO's centre), at most ``max_skipped_batches`` times in the run.
        fused_optimizer: torch's fused AdamW / SGD kernels (the same update in one kernel).
        compile_backbone, compile_backend: ``torch.compile`` the backbone and any momentum encoder
            or teacher one block at a time (``ssl_vit.backbones.compile``; for GPUs, see
            ``benchmarks/RESULTS.md``); ``inductor`` needs a C++ compiler on a CPU.
    """

    # The encoder evaluation and export take from a checkpoint by default: "student" is ``backbone``.
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
        nonfinite_policy: Literal["raise", "skip"] = "raise",
        max_skipped_batches: int = 10,
        fused_optimizer: bool = True,
        compile_backbone: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if compile_backbone:
            check_backend(compile_backend)
        self.backbone_name, self.backbone_kwargs = backbone, dict(backbone_kwargs or {})
        self.backbone = create_backbone(backbone, **self.backbone_kwargs)
        self.probe = OnlineLinearProbe(self.backbone.embed_dim, num_classes) if num_classes and num_classes > 1 else None
        self.total_steps = self.steps_per_epoch = 1  # the run's length, known when training starts
        self.peak_lr, self.global_batch_size = base_lr, None
        self.seed: int | None = None  # the base of the per-step seeds
        self.skipped_batches = 0  # non-finite batches skipped so far
        self.recipe: str | None = None  # the resolved recipe (`ssl-vit fit`)
        self.data_info: dict[str, Any] | None = None
        self._skipping, self._compiled, self._resumed = False, False, {}
        self._buffers_at_step_start: list[tuple[Tensor, Tensor]] | None = None
        self._shapes_before_wrapping: dict[str, torch.Size] = {}
        self._val_totals: dict[str, Tensor] = {}  # validation: [sum of a metric x images, labelled images] by name

    # ------------------------------------------------------------------ what a method implements
    def step(self, views: list[Tensor], labels: Tensor) -> dict[str, Tensor]:
        """One training forward: ``loss``, ``features`` (the ``[B, D]`` representation the probe learns from), scalars to log."""
        raise NotImplementedError

    def check_views(self, num_views: int) -> None:
        """Raise ``ValueError`` for a number of views per image the method cannot train on (asked before training)."""

    def before_optimizer_step(self) -> None:
        """Edit the gradients between backward and the optimiser step (DINO's frozen last layer)."""

    def after_optimizer_step(self) -> dict[str, float]:
        """Update what follows an optimiser step that was taken (EMA targets, DINO's centre); returns scalars to log."""
        return {}

    # ------------------------------------------------------------------ helpers for methods
    def target_backbone(self) -> nn.Module:
        """A frozen copy of the backbone for a momentum encoder / teacher, built without stochastic
        depth or dropout (as the references build theirs)."""
        kwargs, allowed = dict(self.backbone_kwargs), get_spec(self.backbone_name).allowed_kwargs()
        kwargs |= {k: 0.0 for k in ("drop_path_rate", "drop_rate", "attn_drop_rate") if k in allowed or k in kwargs}  # (given: accepted)
        target = create_backbone(self.backbone_name, **kwargs)
        target.load_state_dict(self.backbone.state_dict())
        return target.requires_grad_(False)

    def cosine(self, start: float, end: float) -> float:
        """From ``start`` at the first optimiser step towards ``end`` by cos(π t / T), as DINO's
        ``momentum_schedule`` and MoCo v3's ``adjust_moco_momentum`` (lightly's ends at T - 1)."""
        return cosine_schedule(min(self.global_step, self.total_steps), self.total_steps + 1, start, end)

    def sync_batchnorm(self, *names: str) -> None:
        """BatchNorm over the global batch in these submodules, on several processes (from ``setup``)."""
        if self._trainer is not None and self.trainer.world_size > 1:
            for name in (n for n in names if getattr(self, n) is not None):
                setattr(self, name, distributed.convert_sync_batchnorm(getattr(self, name), self.trainer.strategy.root_device.type))

    # ------------------------------------------------------------------ the run
    def setup(self, stage: str) -> None:
        if not self._shapes_before_wrapping:  # (before a strategy wraps the model: FSDP flattens the parameters)
            self._shapes_before_wrapping = {distributed.unwrapped_name(n): p.shape for n, p in self.named_parameters()}
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is not None:  # what export reads the normalisation from, and results the dataset
            self.data_info = {"name": type(dm).__name__, "class": f"{type(dm).__module__}.{type(dm).__qualname__}"}
            for key in ("mean", "std", "stats_source", "eval_crop_pct", "img_size", "in_chans", "num_classes", "train_dir"):
                if (value := getattr(dm, key, None)) is not None:
                    self.data_info[key] = list(value) if isinstance(value, tuple | list) else str(value) if key == "train_dir" else value
        self.sync_batchnorm("probe")  # it then learns the same whatever the split over devices
        if self.hparams.compile_backbone and not self._compiled:  # the backbone, any momentum encoder or teacher (*_backbone)
            rank_zero_info(f"[ssl_vit] compiling the backbone with torch.compile ({self.hparams.compile_backend}, one block at a time)")
            for name, module in self.named_children():
                if name == "backbone" or name.endswith("_backbone"):
                    compile_backbone(module, self.hparams.compile_backend)
            self._compiled = True

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp.optimizer == "lars" and self._trainer is not None and distributed.gradient_shard_group(self.trainer.strategy) is not None:
            raise ValueError("optimizer 'lars' does not run under FSDP (its trust ratio needs whole tensors); use DDP, or adamw / sgd")
        return optim.build_optimizer(self._param_groups(), hp.optimizer, hp.base_lr, hp.betas, hp.sgd_momentum, hp.fused_optimizer)

    def _param_groups(self) -> list[dict[str, Any]]:
        hp, names = self.hparams, {id(p): distributed.unwrapped_name(n) for n, p in self.named_parameters()}
        tokens = {"mask_token"} | {f"{prefix}.{n}" for prefix, m in self.named_children() if hasattr(m, "no_weight_decay") for n in m.no_weight_decay()}
        return optim.param_groups(self.named_parameters(), hp.weight_decay_exempt, tokens, hp.weight_decay, self._probe_ids(), hp.probe_lr,
                                  lambda p: self._shapes_before_wrapping.get(names[id(p)], p.shape))  # (FSDP's shards are 1-D)

    def _probe_ids(self) -> set[int]:
        return {id(p) for p in self.probe.parameters()} if self.probe is not None else set()

    def on_train_start(self) -> None:
        trainer = self.trainer
        if not math.isfinite(trainer.estimated_stepping_batches):
            raise ValueError("the schedules need the length of training: set trainer.max_steps or trainer.max_epochs "
                             "(max_time alone can stop a run but cannot size its schedules)")
        self.total_steps = max(1, int(trainer.estimated_stepping_batches))
        batches = trainer.num_training_batches if 0 < trainer.num_training_batches < math.inf else self.total_steps
        self.steps_per_epoch = max(1, math.ceil(batches / trainer.accumulate_grad_batches))  # a last partial accumulation steps too
        self.global_batch_size = None  # (the first batch tells)

    def warmup_steps(self) -> int:
        hp = self.hparams
        return hp.warmup_steps if hp.warmup_steps is not None else round(hp.warmup_epochs * self.steps_per_epoch)

    def schedule_values(self, step: int) -> dict[str, float]:
        """LR and weight decay at optimiser step ``step``: a linear warm-up (lightly's: step t at
        peak·(t + 1)/W; the references start at 0; one longer than the run is cut to it), then DINO's
        ``cosine_scheduler`` to ``min_lr`` (cos(πi/N) over the N steps left: lightly's ends at
        ``max_steps - 1``, hence ``total + 1``); the weight decay a cosine to ``weight_decay_end``
        (None: constant). Past the end both stay at their ends."""
        hp, total = self.hparams, self.total_steps
        warmup, step, wd_end = min(self.warmup_steps(), total), min(step, total), hp.weight_decay_end
        lr = (cosine_warmup_schedule(step, total + 1, self.peak_lr, hp.min_lr, warmup, 0.0) if warmup
              else cosine_schedule(step, total + 1, self.peak_lr, hp.min_lr))
        return {"lr": lr, "weight_decay": cosine_schedule(step, total + 1, hp.weight_decay, hp.weight_decay if wd_end is None else wd_end)}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._seed_step(batch_idx)
        if self.global_batch_size is None:  # the first batch: the LR scales with the global batch
            trainer = self.trainer
            per_device = getattr(trainer.datamodule, "batch_size", None) or getattr(trainer.train_dataloader, "batch_size", None) or len(batch[1])
            self.global_batch_size = per_device * trainer.world_size * trainer.accumulate_grad_batches
            self.peak_lr = self.hparams.base_lr * self.global_batch_size / 256
            for line in self._start_notes(per_device):
                rank_zero_info(line)
        self._schedule_now = self.schedule_values(self.global_step)
        for group in self.optimizers().optimizer.param_groups:
            if "fixed_lr" not in group:
                group["lr"] = self._schedule_now["lr"]
            if group.get("scheduled_wd"):
                group["weight_decay"] = self._schedule_now["weight_decay"]

    def _seed_step(self, batch_idx: int) -> None:
        if self.seed is None:  # seed_everything's, else torch's (the same on every process)
            self.seed = global_seed(torch.initial_seed())
        seed_training_step(self.seed, self.current_epoch, batch_idx, self.global_rank)

    def _start_notes(self, per_device: int) -> list[str]:
        """The batch, the LR it scales to, the length and the warm-up; settings that do not do what one may think."""
        hp, warmup, total, batch, step, per_epoch = (self.hparams, self.warmup_steps(), self.total_steps, self.global_batch_size,
                                                     self.global_step, self.steps_per_epoch)
        line = (f"[ssl_vit] {type(self).__name__} on {self.backbone_name}: effective batch size {batch} = {per_device} per device x "
                f"{self.trainer.world_size} device(s) x {self.trainer.accumulate_grad_batches} accumulation; lr = base_lr {hp.base_lr:g} x "
                f"{batch}/256 = {self.peak_lr:.4g}; {total} optimiser steps ({per_epoch} per epoch)")
        from_epochs = hp.warmup_steps is None
        if not from_epochs:
            line += f", LR warm-up {warmup} steps (warmup_steps; warmup_epochs is then not used)"
        elif warmup:
            line += f", LR warm-up {warmup} steps (warmup_epochs {hp.warmup_epochs:g} x {per_epoch})"
        lines = [line]
        if warmup >= total:
            label = f"warmup_epochs {hp.warmup_epochs:g} = {warmup} steps" if from_epochs else f"warmup_steps {warmup}"
            cut = f", is longer than the run of {total} steps and is cut to it" if warmup > total else f", spans the whole run of {total} steps"
            lines.append(f"[ssl_vit] note: the LR warm-up, {label}{cut}: its LR rises to the peak at the last step and the cosine never "
                         "starts (set a shorter warm-up)")
        elif from_epochs and hp.warmup_epochs > 0 and warmup < SHORT_WARMUP:  # few steps per epoch: a small folder, a large batch
            peak = f"reaches its peak after {warmup} step(s)" if warmup else "starts at its peak"
            lines.append(f"[ssl_vit] note: the LR warm-up, warmup_epochs {hp.warmup_epochs:g} = {warmup} steps at {per_epoch} per epoch, is "
                         f"short: the LR {peak}, too soon to keep the first steps from diverging (set warmup_steps: {SHORT_WARMUP} or more, "
                         "which replaces warmup_epochs)")
        if self._resumed.get("total_steps") not in (None, total):
            lines.append(f"[ssl_vit] note: resumed a run planned for {self._resumed['total_steps']} optimiser steps as one of {total}: from "
                         f"step {step} on, the LR, weight-decay and momentum schedules follow the new length (the run is not the one a "
                         f"{total}-step run would have been)")
        if self._resumed.get("global_batch_size") not in (None, batch):
            lines.append(f"[ssl_vit] note: resumed a run trained at an effective batch size of {self._resumed['global_batch_size']} with "
                         f"{batch}: from step {step} on, a step takes {batch} images at lr {self.peak_lr:.4g} (set global_batch_size to keep "
                         "the run's batch over another number of devices)")
        return lines

    # ------------------------------------------------------------------ a training step
    def training_step(self, batch: tuple[list[Tensor], Tensor], batch_idx: int) -> Tensor:
        if not (isinstance(batch, list | tuple) and len(batch) == 2 and isinstance(batch[0], list | tuple)):
            raise TypeError("a training batch must be (views, labels) with views a list of [B, C, H, W] tensors (a datamodule's view "
                            f"transform makes it: SingleView, TwoViews, MultiCrop); got {type(batch).__name__} of "
                            f"{', '.join(type(b).__name__ for b in batch) if isinstance(batch, list | tuple) else '?'}")
        views, labels = batch
        if self.hparams.nonfinite_policy == "skip" and self._buffers_at_step_start is None:
            self._buffers_at_step_start = [(b, b.clone()) for b in self.buffers()]  # what a skipped step puts back
        out = self.step(views, labels)
        loss, features = out.pop("loss"), out.pop("features", None)
        finite = bool(torch.isfinite(loss))
        if self.trainer.world_size > 1:  # one decision: a process that skipped DDP's backward would hang the others
            finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            return self._skip_or_raise(loss)
        logs = {(k if "/" in k else f"train/{k}"): v.detach().float() if isinstance(v, Tensor) else v for k, v in out.items()}
        logs["train/loss"] = loss.detach()
        if self.probe is not None:
            if features is None:
                raise ValueError(f"{type(self).__name__}.step returned no 'features', but the run has an online probe (the data has "
                                 "labels): return the representation [B, D] it should learn from as 'features'")
            probe_loss, acc = self.probe.training_loss(features.detach(), labels)
            if probe_loss is not None:
                loss = loss + probe_loss
                logs["probe/train_loss"], logs["probe/train_acc"] = probe_loss.detach(), acc
        logs["train/lr"], logs["train/weight_decay"] = self._schedule_now["lr"], self._schedule_now["weight_decay"]
        if self.trainer.world_size > 1:  # the global batch's values (each process's are means over equal shares), in one all-reduce
            keys = [k for k, v in logs.items() if isinstance(v, Tensor)]
            logs.update(zip(keys, self.trainer.strategy.reduce(torch.stack([logs[k].float().reshape(()) for k in keys]), reduce_op="mean")))
        self.log_dict(logs, on_step=True, on_epoch=False, batch_size=labels.shape[0])
        self.log("loss", logs["train/loss"], prog_bar=True, on_step=True, on_epoch=False, logger=False, batch_size=labels.shape[0])
        return loss

    def _skip_or_raise(self, loss: Tensor) -> Tensor:
        hp = self.hparams
        if hp.nonfinite_policy == "skip" and self.skipped_batches < hp.max_skipped_batches:
            self.skipped_batches += 1
            self._skipping = True
            rank_zero_info(f"[ssl_vit] non-finite loss (on rank 0: {loss.item()}) at step {self.global_step}: batch skipped "
                           f"({self.skipped_batches}/{hp.max_skipped_batches})")
            # Not None, which Lightning refuses under DDP: a zero reaching every trainable parameter, so the
            # backward and DDP's reduction (which every process joins) run; the gradients are then dropped.
            return torch.stack([p.sum() for p in self.parameters() if p.requires_grad]).sum() * 0.0
        ckpt = getattr(self.trainer, "checkpoint_callback", None)
        last = getattr(ckpt, "last_model_path", None) or getattr(ckpt, "best_model_path", None)
        spent = f" ({self.skipped_batches} batch(es) already skipped, the limit)" if hp.nonfinite_policy == "skip" else ""
        raise NonFiniteLossError(f"non-finite loss ({loss.item()} on rank {self.global_rank}) at step {self.global_step} (epoch "
                                 f"{self.current_epoch}){spent}; {f'the last good checkpoint is {last}' if last else 'no checkpoint was written yet'}. "
                                 "Lower the learning rate, raise warm-up, or set nonfinite_policy: skip.")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # fp16 loss scaling: Lightning unscales here only optimisers that do not unscale in their step,
        # as the fused ones do; unscaled now, they are clipped at their size, and a skipped batch leaves
        # the scaler its inf check (GradScaler.step takes an optimiser unscaled here as any other).
        scaler = getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer is not None else None
        if scaler is not None and scaler.is_enabled() and getattr(optimizer, "_step_supports_amp_scaling", False):
            scaler.unscale_(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self._skipping:  # without gradients the optimiser leaves every parameter and its moments alone
            for p in params:
                p.grad = None
        else:
            self.before_optimizer_step()
        if (self.hparams.grad_clip or 0) > 0:  # every parameter but the probe's, in the optimiser's order (FSDP: the same list everywhere)
            group, probe = distributed.gradient_shard_group(self.trainer.strategy) if self._trainer is not None else None, self._probe_ids()
            distributed.clip_gradients([p for p in params if id(p) not in probe], self.hparams.grad_clip, self.hparams.grad_clip_mode, group)
        optim.materialize_adam_state(optimizer)  # (for the parameters without a gradient yet: FSDP gathers it for checkpoints)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)  # (Lightning runs the last micro-batch's training_step inside it)
        skipped, self._skipping = self._skipping, False
        saved, self._buffers_at_step_start = self._buffers_at_step_start, None
        if skipped:
            for buffer, before in saved or []:  # a NaN centre or BN mean would poison every later step
                buffer.copy_(before)
        elif logs := self.after_optimizer_step():
            self.log_dict({f"train/{k}": v for k, v in logs.items()}, on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        if self.probe is None and type(self).validation_metrics is BaseMethod.validation_metrics:
            return  # nothing to measure
        with torch.no_grad():
            features = self.backbone(images)  # [B, D]
        # Means over the labelled images (an unreadable test file, or a process's padding, is labelled
        # -1): summed with their number here, divided once every process's sums are in.
        labelled = (labels >= 0).sum().float()
        for name, value in self.validation_metrics(features, labels).items():
            total = self._val_totals.setdefault(name, torch.zeros(2, device=features.device))  # [value sum, images]
            total += torch.stack([value.detach().float() * labelled, labelled])

    def on_validation_epoch_end(self) -> None:
        # (Lightning's weighted mean divides the summed weights by the process count in integers.)
        sums, self._val_totals = self._val_totals, {}
        if not (names := sorted(sums)):
            return
        totals = torch.stack([sums[n] for n in names])  # [K, 2]
        if self.trainer.world_size > 1:  # every process has batches, so the same names
            totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        for name, (value, count) in zip(names, totals.unbind()):
            if count > 0:  # a split without labels measures nothing
                self.log(name, value / count, prog_bar=True, sync_dist=True)  # (the same on every process)

    def validation_metrics(self, features: Tensor, labels: Tensor) -> dict[str, Tensor]:
        """Metrics of a validation batch (in eval mode) from the representation ``[B, D]``: means over the labelled images."""
        return {"probe/val_acc": labelled_accuracy(self.probe.head(features), labels)} if self.probe is not None else {}

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The run info: enough to rebuild the backbone and say how it was trained (``ssl-vit eval`` /
        ``export`` / ``compare`` read it), and what a resumed run needs."""
        checkpoint["ssl_vit"] = {
            "method": type(self).__name__, "backbone": self.backbone_name, "backbone_kwargs": self.backbone_kwargs,
            "global_step": self.global_step, "epoch": self.current_epoch, "epochs": self.epochs_done(), "data": self.data_info,
            "recipe": self.recipe, "global_batch_size": self.global_batch_size, "total_steps": self.total_steps,
            "default_encoder": self.default_encoder, "seed": self.seed, "skipped_batches": self.skipped_batches,
            "pretrain_flops": getattr(self, "pretrain_flops", None),  # (set by the PretrainFlopsCounter callback)
        }

    def epochs_done(self) -> float | None:
        """Epochs trained: the loader's position (right across a resume with another batch size), else steps / steps per epoch."""
        if self._trainer is None:
            return None
        done = getattr(self.trainer.train_dataloader, "epochs_done", None)
        return round(done() if callable(done) else self.global_step / self.steps_per_epoch, 4)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The recipe of this invocation (a resumed run's new length or batch) wins when the CLI gave one.
        info = checkpoint.get("ssl_vit") or {}
        self.data_info, self.recipe = info.get("data") or self.data_info, self.recipe or info.get("recipe")
        self.seed = info["seed"] if info.get("seed") is not None else self.seed
        self.skipped_batches = int(info.get("skipped_batches", 0))
        self._resumed = {"total_steps": info.get("total_steps"), "global_batch_size": info.get("global_batch_size")}
