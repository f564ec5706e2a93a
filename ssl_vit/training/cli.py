"""``ssl-vit fit``: pretraining (or the supervised baseline) from YAML recipes via LightningCLI.

The recipe maps straight onto typed constructors (``model: {class_path, init_args}``,
``data: {class_path, init_args}``, ``trainer: {...}``); several ``--config`` files merge left to
right; ``--print_config`` prints the resolved recipe. Everything is checked before training starts:
unknown keys and wrong types (jsonargparse), unknown methods or backbones, a global batch that does
not split over the devices, images whose size the patch size does not divide, a channel mismatch
between the data and the backbone.

Extra top-level options:
    --global_batch_size N   the paper's batch size; split evenly over devices x nodes x accumulation
    --ckpt_path PATH|last   resume from a checkpoint (``last``: the newest in the run's directory)
    --resume                shorthand for ``--ckpt_path last``

A resumed run continues exactly where the checkpoint was written: weights, EMA/teacher, DINO's
centre, optimiser state, the schedules (functions of the global step), the loop counters, the
position in the epoch's data order (``ResumableLoader``) and the per-step seeds. SIGTERM or SIGUSR1
writes ``last.ckpt`` after the current step and exits with status 128 + the signal's number.
"""

from __future__ import annotations

import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import ArgumentError
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ssl_vit.flops import PretrainFlopsCounter
from ssl_vit.pretext.base import PretextModule
from ssl_vit.training.checkpoint_io import AtomicCheckpointIO
from ssl_vit.training.preemption import PreemptionCheckpoint


class ConfigError(ValueError):
    """A recipe that cannot run; raised before training starts."""


class StepCheckpoint(ModelCheckpoint):
    """Checkpoint every ``every_n_train_steps`` optimiser steps and at the end, keep the newest
    ``keep_last``, and always refresh ``last.ckpt`` (what ``--resume`` loads).

    Args:
        dirpath: where checkpoints go; default ``<trainer.default_root_dir>/checkpoints`` so that a
            rerun of the same recipe finds them (Lightning's default is inside a new logger version).
        every_n_train_steps: checkpoint interval in optimiser steps.
        keep_last: how many step checkpoints to keep besides ``last.ckpt``.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = 500, keep_last: int = 3) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="step{step:08d}",
            monitor="step",
            mode="max",
            save_top_k=keep_last,
            save_last=True,
            every_n_train_steps=every_n_train_steps,
            auto_insert_metric_name=False,
        )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
        super().setup(trainer, pl_module, stage)

    def save_last_checkpoint(self, trainer: L.Trainer) -> Path:
        """Write ``last.ckpt`` now (a preemption), recorded as this step's save."""
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        return Path(self.last_model_path)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The final weights, whatever the interval: the run's result lives in last.ckpt.
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)


class SSLViTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(StepCheckpoint, "checkpoint")
        parser.add_argument("--global_batch_size", type=int | None, default=None, help="total batch over all devices, nodes and accumulation steps (the papers' batch size)")
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume from; 'last' resumes the newest in the run directory")
        # The datamodule knows whether labels exist (and how many classes): the online probe and
        # the supervised head follow it, so a recipe never states the class count twice.
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> L.Trainer:
        # Checkpoints are always written atomically, whatever plugins a recipe lists (SLURM ...).
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        config["plugins"] = plugins
        return super()._instantiate_trainer(config, callbacks)


def _normalise_argv(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        if arg == "--resume":
            out += ["--ckpt_path", "last"]
        else:
            out.append(arg)
    return out


def _resolved_devices(trainer: L.Trainer) -> int:
    return int(trainer.num_devices) * int(trainer.num_nodes)


def validate_run(model: PretextModule, datamodule: L.LightningDataModule, trainer: L.Trainer, global_batch_size: int | None) -> None:
    """Checks that need the instantiated objects; each failure is one clear line."""
    devices = _resolved_devices(trainer)
    accum = int(trainer.accumulate_grad_batches)
    if global_batch_size is not None:
        split = devices * accum
        if global_batch_size % split:
            raise ConfigError(
                f"global_batch_size {global_batch_size} is not divisible by devices x nodes x accumulate_grad_batches = {split}"
            )
        datamodule.batch_size = global_batch_size // split
    backbone = model.backbone
    stride = getattr(backbone, "patch_size", None)
    img = getattr(datamodule, "img_size", None)
    if stride and img is not None:
        sizes = (img, img) if isinstance(img, int) else tuple(img)
        if sizes[0] % stride or sizes[1] % stride:
            raise ConfigError(f"data.img_size {img} is not divisible by the backbone's patch size {stride}")
    chans = getattr(datamodule, "in_chans", None)
    if chans is not None and chans != backbone.in_chans:
        raise ConfigError(
            f"the data gives {chans}-channel images but the backbone was built with in_chans={backbone.in_chans}; "
            "set data in_chans or model backbone_kwargs.in_chans to match"
        )


def main(argv: list[str] | None = None) -> int:
    argv = _normalise_argv(list(sys.argv[1:] if argv is None else argv))
    # We pass argv explicitly (the dispatcher strips "fit"); Lightning warns when it differs from sys.argv.
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter is intended.*")
    try:
        cli = SSLViTCLI(
            PretextModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            run=False,
            args=argv,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"callbacks": [PreemptionCheckpoint(), PretrainFlopsCounter()]},
            parser_kwargs={"exit_on_error": False, "allow_abbrev": False, "description": __doc__},
        )
    except (ArgumentError, ValueError, TypeError) as err:
        raise ConfigError(_one_line(str(err))) from None
    cfg = cli.config
    # The resolved recipe travels inside every checkpoint (export writes it into config.json).
    cli.model.recipe = cli.parser.dump(cfg, skip_none=False, skip_validation=True)
    validate_run(cli.model, cli.datamodule, cli.trainer, cfg.get("global_batch_size"))
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path == "last" and not _has_last_checkpoint(cli.trainer):
        raise ConfigError(f"--resume: no checkpoint to resume from in {_checkpoint_dir(cli.trainer)}")
    stopped_by = None
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    except SIGTERMException:
        stopped_by = "SIGTERM"  # Lightning stopped after the current step; PreemptionCheckpoint saved it
    stopped_by = next((cb.stopped_by for cb in cli.trainer.callbacks if isinstance(cb, PreemptionCheckpoint) and cb.stopped_by), stopped_by)
    if stopped_by is not None:
        print(f"ssl-vit fit: stopped by {stopped_by} at step {cli.trainer.global_step}; continue with --resume", file=sys.stderr)
        return 128 + int(getattr(signal, stopped_by, signal.SIGTERM))
    return 0


def _checkpoint_dir(trainer: L.Trainer) -> Path:
    cb = trainer.checkpoint_callback
    return Path(cb.dirpath) if isinstance(cb, ModelCheckpoint) and cb.dirpath else Path(trainer.default_root_dir) / "checkpoints"


def _has_last_checkpoint(trainer: L.Trainer) -> bool:
    return any(_checkpoint_dir(trainer).glob("*.ckpt"))


_NOISE = (
    "Does not validate against any of the Union subtypes",
    "Expected a <class 'NoneType'>",
    "Subtypes:",
    "Errors:",
    "Given value type:",
    "Given value:",
)


def _one_line(message: str) -> str:
    """jsonargparse's nested explanation folded to the lines that name the problem."""
    lines = [ln.strip(" -") for ln in message.splitlines() if ln.strip(" -")]
    useful = [ln for ln in lines if not ln.startswith(_NOISE)]
    return "; ".join(dict.fromkeys(useful or lines)).replace(":; ", ": ")[:1000]
