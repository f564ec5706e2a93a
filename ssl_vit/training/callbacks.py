"""Callbacks of every pretraining run: the pretraining FLOP counter."""

from __future__ import annotations

from typing import Any

import lightning as L
from torch import Tensor
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.flops import flop_counter


class PretrainFlopsCounter(L.Callback):
    """The cumulative pretraining FLOPs of a run, the x-axis of the ViT paper's accuracy-vs-compute
    plot (Figure 5): logged as ``train/pretrain_flops`` after every training batch, kept as
    ``pl_module.pretrain_flops`` (which the checkpoint's run info records) and at the checkpoint's
    top level, and carried on when the run resumes.

    The first training step of each batch shape (multi-crop and variable-resolution loaders have
    a handful) runs under ``FlopCounterMode``: the step as the method computes it, forward, loss,
    backward and online probe, whatever the method (one of your own too). Every step then adds
    its shape's count times the number of devices, each of which runs that step on its own batch;
    gradient-accumulation micro-batches count each.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0
        self.per_step: dict[tuple[tuple[int, ...], ...], int] = {}  # batch shapes -> FLOPs of a step on one device
        self._counting: FlopCounterMode | None = None

    @staticmethod
    def _shapes(batch: Any) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t.shape) for t in tree_leaves(batch) if isinstance(t, Tensor))

    def _stop(self) -> int:
        counter, self._counting = self._counting, None
        counter.__exit__(None, None, None)
        return counter.get_total_flops()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.per_step.clear()  # measured for this model (a counter may serve another run: its total goes on)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._shapes(batch) not in self.per_step:
            self._counting = flop_counter().__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        shapes = self._shapes(batch)
        if self._counting is not None:
            self.per_step[shapes] = self._stop()
        self.total += self.per_step[shapes] * trainer.world_size
        pl_module.pretrain_flops = self.total
        pl_module.log("train/pretrain_flops", self.total, on_step=True, on_epoch=False)  # the same global total on every rank

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._counting is not None:
            self._stop()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["pretrain_flops"] = self.total  # for readers of a checkpoint without its run info

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.total = pl_module.pretrain_flops = float(checkpoint.get("pretrain_flops") or 0.0)
