"""Callbacks of every pretraining run: the pretraining FLOP counter and the collapse monitor."""

from __future__ import annotations

import math
import sys
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
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


class CollapseMonitor(L.Callback):
    """One console warning when a run's representation collapses (DINO §5.3 and Fig. 7: the two
    collapses that centring and sharpening balance), read from what the method logs:

    * ``train/teacher_entropy`` at ln K (uniform collapse: every image gets the same flat output,
      the loss sits at ln K) or near 0 (one prototype for every image);
    * ``train/embedding_std``, the per-dimension std of the L2-normalised representation, near 0
      (every image maps to the same direction; about 1/sqrt(D) when healthy).

    A state counts once it has held for ``window`` consecutive steps; each kind is said once.
    """

    HINT = ("try: normalise with the data's own statistics (mean/std unset for an image folder), a longer LR warm-up, "
            "a lower teacher temperature, BatchNorm in the head (use_bn_in_head), or more images per batch; see README, Your own images")

    def __init__(self, window: int = 50) -> None:
        super().__init__()
        self.window = window
        self.streaks: dict[str, int] = {}
        self.said: set[str] = set()

    def _states(self, metrics: dict[str, Any], pl_module: L.LightningModule) -> dict[str, str]:
        """Collapse kind -> what the figure is, for the kinds the logged values show now."""
        states = {}
        entropy, out_dim = metrics.get("train/teacher_entropy"), pl_module.hparams.get("out_dim")
        if entropy is not None and out_dim:
            ln_k = math.log(out_dim)
            if float(entropy) > 0.98 * ln_k:
                states["uniform"] = f"the teacher's entropy is {float(entropy):.3f}, at ln K = {ln_k:.3f} (uniform collapse: one flat output for every image)"
            elif float(entropy) < 0.02 * ln_k:
                states["one-prototype"] = f"the teacher's entropy is {float(entropy):.3f}, near 0 (collapse onto one prototype for every image)"
        std, dim = metrics.get("train/embedding_std"), getattr(pl_module.backbone, "embed_dim", None)
        if std is not None and dim and float(std) < 0.1 / math.sqrt(dim):
            states["embedding"] = (f"the embedding std is {float(std):.4f}, near 0 (healthy: about 1/sqrt({dim}) = "
                                   f"{1 / math.sqrt(dim):.3f}; every image maps to the same direction)")
        return states

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        states = self._states(trainer.callback_metrics, pl_module)
        self.streaks = {kind: self.streaks.get(kind, 0) + 1 for kind in states}
        for kind, figure in states.items():
            if self.streaks[kind] >= self.window and kind not in self.said:
                self.said.add(kind)
                if rank_zero_only.rank == 0:
                    print(f"[ssl_vit] warning: {type(pl_module).__name__} looks collapsed at step {trainer.global_step}: "
                          f"{figure} for the last {self.window} steps; {self.HINT}", file=sys.stderr, flush=True)
