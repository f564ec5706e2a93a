"""Log the analysis figures to TensorBoard while training, to watch filters, position embeddings
and attention take shape."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from torch import Tensor

from ssl_vit.analysis.attention_maps import DINO_THRESHOLD
from ssl_vit.analysis.draw import SHOWN_DINO_IMAGES, SHOWN_IMAGES, figure_to_array
from ssl_vit.analysis.filters import PAPER_NUM_FILTERS
from ssl_vit.analysis.inputs import batch_images
from ssl_vit.analysis.render import (
    FIGURES,
    applicable_figures,
    check_figures,
    compute_all,
    plot_all,
    save_all,
)


class AnalysisCallback(pl.Callback):
    """Every ``every_n_epochs`` epochs, draw the analysis figures of ``pl_module.<backbone_attr>``
    and log them as images (tag ``analysis/<figure>``) to every logger whose ``experiment`` has
    ``add_image`` (TensorBoard).

    The images are kept once and reused, so successive figures are comparable: the first
    ``num_images`` of the first validation batch, else of the first training batch (for
    multi-view training batches the first view), unless ``images`` is given. All figures are
    computed from them (the mean attention distance too: a small-sample version of the paper's
    128-image average). Only the global-zero process draws; the backbone runs in eval mode and its
    training mode is restored.

    Args:
        every_n_epochs: log after epochs n, 2n, ... (1-based count of finished epochs).
        num_images: images kept for the figures.
        figures: a subset of ``FIGURES``; for a backbone without tokens (ResNet) only
            ``"filters"`` is drawn.
        mean, std: the normalisation of the images, undone for display; when not given, the
            datamodule's ``mean``/``std`` attributes are used if it has them, else each image
            is min-max scaled.
        backbone_attr: attribute of the LightningModule holding the backbone.
        num_filters: principal components of E to show.
        threshold: share of attention mass kept by the DINO masks.
        dino_max_images: rows of the per-head DINO figure.
        save_dir: if set, also write the PNGs and CSV to ``save_dir/epoch_XXXX/``.
        images: a fixed normalised batch ``[B, C, H, W]`` to use instead of a captured one.
    """

    def __init__(
        self,
        every_n_epochs: int = 10,
        num_images: int = SHOWN_IMAGES,
        figures: Sequence[str] = FIGURES,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        backbone_attr: str = "backbone",
        num_filters: int = PAPER_NUM_FILTERS,
        threshold: float = DINO_THRESHOLD,
        dino_max_images: int = SHOWN_DINO_IMAGES,
        save_dir: str | Path | None = None,
        images: Tensor | None = None,
    ) -> None:
        super().__init__()
        if every_n_epochs < 1 or num_images < 1:
            raise ValueError(f"every_n_epochs and num_images must be >= 1, got {every_n_epochs} and {num_images}")
        self.every_n_epochs = every_n_epochs
        self.num_images = num_images
        self.figures = tuple(sorted(check_figures(figures), key=FIGURES.index))
        self.mean, self.std = mean, std
        self.backbone_attr = backbone_attr
        self.num_filters = num_filters
        self.threshold = threshold
        self.dino_max_images = dino_max_images
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self._fixed = self._keep(images) if images is not None else None
        self._val_images: Tensor | None = None
        self._train_images: Tensor | None = None
        self._warned = False
        self._warned_sharded = False

    def _keep(self, images: Tensor) -> Tensor:
        return images[: self.num_images].detach().cpu().clone()

    # ------------------------------------------------------------------ capture
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._val_images is None and batch_idx == 0 and dataloader_idx == 0:
            self._val_images = self._keep(batch_images(batch))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._train_images is None:
            self._train_images = self._keep(batch_images(batch))

    # ------------------------------------------------------------------ log
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning 2 runs the epoch-end validation before this hook, so a validation batch
        # has been seen by now whenever there is one.
        if (trainer.current_epoch + 1) % self.every_n_epochs != 0:
            return
        if _sharded(trainer):
            # Under FSDP the backbone's parameters are shards and its forward pass is a collective
            # of every process: one process drawing alone would read shards and wait forever.
            if not self._warned_sharded:
                warnings.warn(
                    f"AnalysisCallback: no figures under {type(trainer.strategy).__name__} (the backbone is sharded); "
                    "draw them from the checkpoint with `ssl-vit visualize`",
                    stacklevel=2,
                )
                self._warned_sharded = True
            return
        if trainer.is_global_zero:
            self.log_figures(trainer, pl_module)

    def kept_images(self) -> Tensor | None:
        """The batch the figures are drawn from (fixed, else validation, else training)."""
        for imgs in (self._fixed, self._val_images, self._train_images):
            if imgs is not None:
                return imgs
        return None

    def log_figures(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, np.ndarray]:
        """Compute, draw and log the figures now; returns them as ``[H, W, 3]`` uint8 arrays."""
        images = self.kept_images()
        if images is None:
            if not self._warned:
                warnings.warn("AnalysisCallback: no batch seen yet, nothing to draw", stacklevel=2)
                self._warned = True
            return {}
        backbone = getattr(pl_module, self.backbone_attr, None)
        if backbone is None:
            raise AttributeError(
                f"AnalysisCallback: {type(pl_module).__name__} has no attribute {self.backbone_attr!r}"
            )
        figures = applicable_figures(backbone, self.figures)
        if not figures:
            return {}
        datamodule = getattr(trainer, "datamodule", None)
        mean = self.mean if self.mean is not None else getattr(datamodule, "mean", None)
        std = self.std if self.std is not None else getattr(datamodule, "std", None)
        if mean is None or std is None:
            mean = std = None
        arrays = compute_all(
            backbone,
            images,
            mean=mean,
            std=std,
            figures=figures,
            num_filters=self.num_filters,
            max_images=self.num_images,
            threshold=self.threshold,
            num_distance_images=images.shape[0],
        )
        figs = plot_all(arrays, self.num_images, self.dino_max_images)
        if self.save_dir is not None:
            save_all(arrays, figs, self.save_dir / f"epoch_{trainer.current_epoch:04d}")
        logged = {name: figure_to_array(fig) for name, fig in figs.items()}
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                for name, pixels in logged.items():
                    experiment.add_image(
                        f"analysis/{name}", pixels, global_step=trainer.global_step, dataformats="HWC"
                    )
        return logged


def _sharded(trainer: pl.Trainer) -> bool:
    """Whether the strategy shards the parameters over the processes (FSDP, DeepSpeed, model
    parallelism)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    return isinstance(getattr(trainer, "strategy", None), FSDPStrategy | DeepSpeedStrategy | ModelParallelStrategy)
