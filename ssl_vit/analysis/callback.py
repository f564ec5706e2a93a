"""The analysis figures in TensorBoard while training: filters, position embeddings and attention
taking shape."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch import Tensor

from ssl_vit.analysis import attention, draw, embedding, render


class AnalysisCallback(pl.Callback):
    """Every ``every_n_epochs`` epochs, draw the ``figures`` that apply to ``pl_module.<backbone_attr>``
    and log them (tag ``analysis/<figure>``) to every logger whose ``experiment`` has ``add_image``,
    and into ``save_dir/epoch_XXXX/`` if given. The images are kept once, so that figures compare:
    ``images``, else the first ``num_images`` of the first validation batch, else of the first
    training batch; ``mean``/``std`` (by default the datamodule's) undo their normalisation for
    display. Only the global-zero process draws, and none under a strategy that shards the
    parameters (FSDP, DeepSpeed, model parallelism), where the forward pass is a collective.
    """

    def __init__(
        self,
        every_n_epochs: int = 10,
        num_images: int = draw.SHOWN_IMAGES,
        figures: Sequence[render.FigureName] = render.FIGURES,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        backbone_attr: str = "backbone",
        num_filters: int = embedding.PAPER_NUM_FILTERS,
        threshold: float = attention.DINO_THRESHOLD,
        dino_max_images: int = draw.SHOWN_DINO_IMAGES,
        save_dir: str | Path | None = None,
        images: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.every_n_epochs, self.num_images, self.figures = every_n_epochs, num_images, tuple(figures)
        self.mean, self.std, self.backbone_attr = mean, std, backbone_attr
        self.num_filters, self.threshold, self.dino_max_images = num_filters, threshold, dino_max_images
        self.save_dir = Path(save_dir) if save_dir is not None else None
        # the images drawn: given, else the first validation batch, else the first training batch
        self._val_images = self._keep(images) if images is not None else None
        self._train_images: Tensor | None = None
        self._warned: set[str] = set()

    def _keep(self, images: Tensor) -> Tensor:
        return images[: self.num_images].detach().cpu().clone()

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(f"AnalysisCallback: {message}", stacklevel=3)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._val_images is None and batch_idx == 0 and dataloader_idx == 0:
            self._val_images = self._keep(attention.batch_images(batch))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._train_images is None:
            self._train_images = self._keep(attention.batch_images(batch))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # (Lightning runs the epoch's validation before this hook: a validation batch is kept by now)
        if (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        if isinstance(getattr(trainer, "strategy", None), FSDPStrategy | DeepSpeedStrategy | ModelParallelStrategy):
            self._warn_once(f"no figures under {type(trainer.strategy).__name__} (the backbone is sharded); "
                            "draw them from the checkpoint with `ssl-vit visualize`")
        elif trainer.is_global_zero:
            self.log_figures(trainer, pl_module)

    def kept_images(self) -> Tensor | None:
        """The batch the figures are drawn from."""
        return self._val_images if self._val_images is not None else self._train_images

    def log_figures(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, np.ndarray]:
        """Compute, draw and log the figures now; returns them as ``[H, W, 3]`` uint8 arrays."""
        images = self.kept_images()
        if images is None:
            self._warn_once("no batch seen yet, nothing to draw")
            return {}
        backbone = getattr(pl_module, self.backbone_attr)
        datamodule = getattr(trainer, "datamodule", None)
        mean = self.mean if self.mean is not None else getattr(datamodule, "mean", None)
        std = self.std if self.std is not None else getattr(datamodule, "std", None)
        arrays = render.compute_all(backbone, images, mean, std, render.applicable_figures(backbone, self.figures),
                                    self.num_filters, self.num_images, self.threshold, num_distance_images=len(images))
        figs = render.plot_all(arrays, self.num_images, self.dino_max_images)
        if self.save_dir is not None:
            render.save_all(arrays, figs, self.save_dir / f"epoch_{trainer.current_epoch:04d}")
        logged = {name: draw.figure_to_array(fig) for name, fig in figs.items()}
        for logger in trainer.loggers:
            if hasattr(experiment := getattr(logger, "experiment", None), "add_image"):
                for name, pixels in logged.items():
                    experiment.add_image(f"analysis/{name}", pixels, global_step=trainer.global_step, dataformats="HWC")
        return logged
