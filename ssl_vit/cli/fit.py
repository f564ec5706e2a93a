"""``ssl-vit fit``: pretraining (or the supervised baseline) from YAML recipes via LightningCLI.

A recipe maps onto typed constructors (``model: {class_path, init_args}``, ``data: ...``,
``trainer: {...}``); ``--config`` files merge left to right, and a later file or the command line
may set a class's arguments without ``init_args`` (``--model.base_lr 1e-3``); ``--print_config`` prints
the result. A resumed run continues exactly where its checkpoint was written (weights, EMA/teacher,
optimiser, schedules, the position in the data order, the per-step seeds). SIGTERM, SIGUSR1 or
Ctrl-C writes ``last.ckpt`` after the current step and exits with status 128 + the signal's number.
``--trainer.enable_checkpointing false`` trains without checkpoints.
"""

from __future__ import annotations

import contextvars
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import ArgumentError
from jsonargparse.typing import PositiveInt
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

import ssl_vit.data  # noqa: F401  (registers the datamodules and views: short class names in recipes)
from ssl_vit.cli import recipe_checks as checks
from ssl_vit.errors import ConfigError, one_line
from ssl_vit.eval.evaluate import Evaluation
from ssl_vit.eval.train_run import EvalRunInterrupted
from ssl_vit.methods.base import BaseMethod
from ssl_vit.runtime import release_process_group
from ssl_vit.training import checkpoint
from ssl_vit.training.callbacks import CollapseMonitor, PretrainFlopsCounter
from ssl_vit.training.preemption import PreemptionCheckpoint
from ssl_vit.training.progress import ProgressLog


class SSLViTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(checkpoint.StepCheckpoint, "checkpoint")
        parser.add_class_arguments(Evaluation, "evaluate", help="evaluations of the final backbone: fine-tuning and frozen-feature protocols (none by default)")
        parser.add_argument("--global_batch_size", type=PositiveInt | None, default=None, help="total batch over all devices, nodes and accumulation steps (the papers' batch size)")
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume from; 'last' resumes the newest in the run's folder; 'auto' does that when there is one and starts a new run otherwise (job scripts)")
        parser.add_argument("--resume", action="store_true", help="resume the newest checkpoint in the run's folder (--ckpt_path last)")
        # The online probe and the supervised head follow the data's class count: a recipe states it once.
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        for action in parser._actions:
            # Lightning's Union[float, int, None] batch limits: the parser takes the first type that fits,
            # and `limit_train_batches: 1` (one batch) became 1.0 (all). With int first, 1 stays one batch.
            if action.dest in {f"trainer.limit_{stage}_batches" for stage in ("train", "val", "test", "predict")}:
                action._typehint = int | float | None
            elif action.dest == "trainer.accumulate_grad_batches":  # (0 would divide by zero in Lightning)
                action._typehint = PositiveInt

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except (ArgumentError, ValueError, TypeError) as err:  # a line with where the key belongs, or the known classes
            message = str(err)
            raise ConfigError(one_line(message) + (checks.key_hint(message, list(parser.get_defaults().keys())) or checks.known_classes(message))) from None

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> L.Trainer:
        # Checkpoints are written atomically, unless the recipe chose a CheckpointIO itself (as a
        # plugin, or on its strategy, where Lightning refuses a second one).
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins) and getattr(config.get("strategy"), "_checkpoint_io", None) is None:
            config["plugins"] = [*plugins, checkpoint.AtomicCheckpointIO()]
        if config.get("enable_checkpointing") is False:  # (Lightning refuses a checkpoint callback then)
            callbacks = [c for c in callbacks if not isinstance(c, checkpoint.StepCheckpoint)]
        # Without a progress bar, a line of progress every minute rather than silence.
        if config.get("enable_progress_bar") is False and not any(isinstance(c, ProgressLog) for c in [*callbacks, *(config.get("callbacks") or [])]):
            callbacks = [*callbacks, ProgressLog()]
        return super()._instantiate_trainer(config, callbacks)


def main(argv: list[str] | None = None) -> int:
    """``ssl-vit fit``, in a copy of the caller's context: LightningCLI leaves itself (trainer, model,
    data) in a context variable, which would keep every earlier run of a process (a notebook, a sweep) in memory."""
    return contextvars.copy_context().run(_fit, list(sys.argv[1:] if argv is None else argv))


def _fit(argv: list[str]) -> int:
    checks.check_yaml_files(argv)
    # (The dispatcher strips "fit"; the checkpoint folder's files are this run's, or refused in _checkpoint_to_resume.)
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter is intended.*")
    warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
    warnings.filterwarnings("ignore", message="Total length of `list` across ranks is zero")  # data without a test split: no validation
    try:
        cli = SSLViTCLI(BaseMethod, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, auto_configure_optimizers=False,
                        run=False, args=argv, save_config_kwargs={"overwrite": True},
                        # The FLOP counter first: a signal's checkpoint at the same batch end then counts the batch.
                        trainer_defaults={"callbacks": [PretrainFlopsCounter(), CollapseMonitor(), PreemptionCheckpoint()]},
                        parser_kwargs={"exit_on_error": False, "allow_abbrev": False, "description": __doc__, "prog": "ssl-vit fit"})
    except MisconfigurationException as err:  # Lightning's: an accelerator this machine lacks ...
        gpu = " (the recipe's trainer asks for GPUs; on a machine without one add --config recipes/trainer/cpu.yaml)" if "gpu" in str(err).lower() else ""
        raise ConfigError(one_line(str(err)) + gpu) from None
    cfg, model, data, trainer = cli.config, cli.model, cli.datamodule, cli.trainer
    evaluation: Evaluation = cli.config_init["evaluate"]
    if evaluation.data is not None:  # what the recipe sets of evaluate.data: its img_size, in_chans, mean and std otherwise follow the backbone
        given = cli.parser.parse_args(argv, defaults=False).get("evaluate.data.init_args")
        evaluation.data_args = given.as_dict() if given else {}
    model.recipe = cli.parser.dump(cfg, skip_none=False, skip_validation=True)  # travels inside every checkpoint
    checks.validate_run(model, data, trainer, cfg.global_batch_size)
    evaluation.check_model(model)
    evaluation.check_data(data)
    # The checkpoint folder is fixed before anything is restored: the restored bookkeeping must match
    # it (else last.ckpt would get a last-v1.ckpt sibling and keep_last would not prune).
    saver = next((cb for cb in trainer.callbacks if isinstance(cb, checkpoint.StepCheckpoint)), None)
    if saver is None and evaluation.protocols:
        raise ConfigError("evaluate: the evaluations read the run's last checkpoint, which --trainer.enable_checkpointing false does not write; "
                          "keep checkpoints on, or leave evaluate.protocols empty")
    ckpt_dir = Path(saver.resolve_dirpath(trainer) if saver else checkpoint.default_checkpoint_dir(trainer))
    # A SLURM job that Lightning requeued resumes from its hpc_ckpt_<n>.ckpt by itself.
    requeued = SLURMEnvironment.detect() and bool(checkpoint.hpc_checkpoints(trainer.default_root_dir))
    ckpt_path = _checkpoint_to_resume(cfg.ckpt_path, cfg.resume, ckpt_dir, trainer.default_root_dir, requeued or saver is None)
    if ckpt_path is not None:
        checks.check_continuable(model, ckpt_path)
    resuming = ckpt_path is not None or requeued
    evaluation.check_run_dirs(trainer.default_root_dir, resuming)
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    except SIGTERMException:
        pass  # a stop request, saved by PreemptionCheckpoint (which names its signal)
    # Every process ended at the same step (the end, or an agreed signal): the process group goes before
    # process 0's evaluation. Not after an exception: another process may wait in a collective and hang.
    release_process_group()
    stopped_by = next(cb for cb in trainer.callbacks if isinstance(cb, PreemptionCheckpoint)).stopped_by
    if stopped_by is not None:
        if rank_zero_only.rank == 0:
            print(f"ssl-vit fit: stopped by {stopped_by} at step {trainer.global_step}; continue with --resume", file=sys.stderr)
        return 128 + int(getattr(signal, stopped_by))
    return _evaluate(evaluation, ckpt_dir, data, trainer, resuming) if evaluation.protocols else 0


def _checkpoint_to_resume(ckpt_path: str | None, resume: bool, ckpt_dir: Path, root_dir: str, new_run_ok: bool) -> str | None:
    """The checkpoint ``--ckpt_path`` / ``--resume`` name (None: a new run). A new run that saves
    checkpoints is refused where an earlier run's are: it would overwrite them from its first save on."""
    if resume:
        if ckpt_path is not None:
            raise ConfigError("--resume and --ckpt_path both say where to continue from: give one (--resume is --ckpt_path last)")
        ckpt_path = "last"
    if ckpt_path in ("last", "auto"):
        newest = checkpoint.newest_checkpoint(ckpt_dir, root_dir)
        if newest is None and ckpt_path == "last":
            raise ConfigError(f"--resume: no checkpoint to resume from in {ckpt_dir} (--ckpt_path auto starts a new run then)")
        if rank_zero_only.rank == 0:
            print(f"ssl-vit fit: resuming from {newest}" if newest else f"ssl-vit fit: no checkpoint in {ckpt_dir}; starting a new run", file=sys.stderr)
        return str(newest) if newest is not None else None
    if ckpt_path is None and not new_run_ok and (earlier := checkpoint.newest_checkpoint(ckpt_dir)) is not None:
        raise ConfigError(f"{ckpt_dir} already holds a run's checkpoints (newest: {earlier.name}): continue it with --resume, or start anew "
                          "in another --trainer.default_root_dir (or --checkpoint.dirpath), or remove that folder first")
    return ckpt_path


def _evaluate(evaluation: Evaluation, ckpt_dir: Path, data: L.LightningDataModule, trainer: L.Trainer, resuming: bool) -> int:
    """The recipe's ``evaluate`` section, as ``ssl-vit eval`` would run it: the protocols that train
    on images on every process of the run, then those on extracted features in process 0 alone."""
    if (last := checkpoint.newest_checkpoint(ckpt_dir)) is None:  # (a fast_dev_run)
        raise ConfigError(f"evaluate: the run left no checkpoint in {ckpt_dir} to evaluate")
    try:
        results = evaluation.after_fit(last, data, trainer, resuming)
    except EvalRunInterrupted as stop:
        if stop.rank == 0:
            print(f"ssl-vit fit: the pretraining is done; evaluate's {stop}; continue with --resume", file=sys.stderr)
        return 128 + int(getattr(signal, stop.signal_name))
    except (ValueError, RuntimeError, OSError) as err:
        if rank_zero_only.rank != 0:
            raise
        # The training is done and kept: say how to evaluate it without training again.
        raise ValueError(f"evaluate: {one_line(str(err)).removeprefix('evaluate: ')} (the trained backbone is kept in {last}: fix the evaluate "
                         f"section and run the same command with --resume, which evaluates without training further, or use "
                         f"`ssl-vit eval ... --backbone {last}`)") from None
    for result in results:
        print(result.summary_line())
    return 0
