"""``ssl-vit fit``: pretraining (or the supervised baseline) from YAML recipes via LightningCLI.

The recipe maps straight onto typed constructors (``model: {class_path, init_args}``,
``data: {class_path, init_args}``, ``trainer: {...}``); several ``--config`` files merge left to
right (a dict-valued setting, such as ``backbone_kwargs``, is replaced whole: what that drops is
named); ``--print_config`` prints the resolved recipe. Everything is checked before training starts:
unknown keys and wrong types (jsonargparse), unknown methods or backbones, a global batch that does
not split over the devices, images whose size the patch size does not divide, a channel mismatch
between the data and the backbone.

Extra top-level options:
    --global_batch_size N   the paper's batch size; split evenly over devices x nodes x accumulation
    --ckpt_path PATH|last|auto  resume from a checkpoint (``last``: the newest in the run's
                            directory; ``auto``: that if there is one, else start a new run)
    --resume                shorthand for ``--ckpt_path last``

A resumed run continues exactly where the checkpoint was written: weights, EMA/teacher, DINO's
centre, optimiser state, the schedules (functions of the global step), the loop counters, the
position in the epoch's data order (``ResumableLoader``) and the per-step seeds. SIGTERM or SIGUSR1
writes ``last.ckpt`` after the current step and exits with status 128 + the signal's number.
"""

from __future__ import annotations

import contextvars
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Union

import lightning as L
from jsonargparse import ArgumentError
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

import ssl_vit.data  # noqa: F401  (registers the datamodules and views: short class names in recipes)
from ssl_vit.cli.recipe_checks import (
    ConfigError,
    check_continuable,
    check_yaml_files,
    key_hint,
    known_classes,
    normalise_argv,
    one_line,
    validate_run,
)
from ssl_vit.eval.evaluate import RecipeEvaluation
from ssl_vit.eval.train_run import EvalRunInterrupted
from ssl_vit.flops import PretrainFlopsCounter
from ssl_vit.io import stale_temporaries
from ssl_vit.methods.base import BaseMethod
from ssl_vit.runtime import release_process_group
from ssl_vit.training.checkpoint_io import AtomicCheckpointIO
from ssl_vit.training.preemption import PreemptionCheckpoint
from ssl_vit.training.progress import ProgressLog
from ssl_vit.training.step_checkpoint import (
    StepCheckpoint,
    default_checkpoint_dir,
    hpc_checkpoints,
    newest_checkpoint,
)

BATCH_LIMITS = tuple(f"trainer.limit_{stage}_batches" for stage in ("train", "val", "test", "predict"))


class SSLViTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(StepCheckpoint, "checkpoint")
        parser.add_class_arguments(RecipeEvaluation, "evaluate", help="evaluations of the final backbone: fine-tuning and frozen-feature protocols (none by default)")
        parser.add_argument("--global_batch_size", type=int | None, default=None, help="total batch over all devices, nodes and accumulation steps (the papers' batch size)")
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume from; 'last' (--resume) resumes the newest in the run directory; 'auto' does that when there is one and starts a new run otherwise (job scripts)")
        # The datamodule knows whether labels exist (and how many classes): the online probe and
        # the supervised head follow it, so a recipe never states the class count twice.
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        # Lightning annotates the batch limits Union[float, int, None], and the parser takes the
        # first type that fits: `limit_train_batches: 1` (one batch) became 1.0 (every batch).
        # With int first, 1 stays one batch and 1.0 all of them, as Lightning documents.
        for action in parser._actions:
            if action.dest in BATCH_LIMITS and hasattr(action, "_typehint"):
                action._typehint = Union[int, float, None]  # noqa: UP007 (the parser reads typing's form)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except (ArgumentError, ValueError, TypeError) as err:
            try:
                keys = list(parser.get_defaults().keys())
            except Exception:  # the parser's defaults themselves do not resolve: no suggestion
                keys = []
            hint = key_hint(str(err), keys)
            if not hint:
                raise
            raise ConfigError(one_line(str(err)) + hint) from None

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> L.Trainer:
        # Checkpoints are always written atomically, whatever plugins a recipe lists (SLURM ...).
        # (Unless the recipe chose a CheckpointIO itself: as a plugin, or on its strategy, where
        # Lightning refuses a second one.)
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        strategy_io = getattr(config.get("strategy"), "_checkpoint_io", None)
        if not any(isinstance(p, CheckpointIO) for p in plugins) and strategy_io is None:
            plugins.append(AtomicCheckpointIO())
        config["plugins"] = plugins
        # Without a progress bar, a line of progress every minute rather than silence.
        if config.get("enable_progress_bar") is False and not any(isinstance(c, ProgressLog) for c in [*callbacks, *(config.get("callbacks") or [])]):
            callbacks = [*callbacks, ProgressLog()]
        return super()._instantiate_trainer(config, callbacks)


def main(argv: list[str] | None = None) -> int:
    """``ssl-vit fit``. It runs in a copy of the caller's context: LightningCLI leaves itself
    (and through it the trainer, the model and its data) in a context variable, where no
    collection reaches it until the interpreter exits. Run this way, the run's objects go when it
    returns: a caller that fits several times in one process (a notebook, a sweep script, the
    tests) does not keep every earlier run in memory."""
    return contextvars.copy_context().run(_fit, argv)  # (its cycles then go at the next collection)


def _fit(argv: list[str] | None) -> int:
    argv = normalise_argv(list(sys.argv[1:] if argv is None else argv))
    check_yaml_files(argv)
    # We pass argv explicitly (the dispatcher strips "fit"); Lightning warns when it differs from sys.argv.
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter is intended.*")
    try:
        cli = SSLViTCLI(
            BaseMethod,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            run=False,
            args=argv,
            save_config_kwargs={"overwrite": True},
            # The FLOP counter first: a signal's checkpoint, written at the same batch end, then
            # counts the batch it follows (Lightning runs callbacks in this order).
            trainer_defaults={"callbacks": [PretrainFlopsCounter(), PreemptionCheckpoint()]},
            parser_kwargs={"exit_on_error": False, "allow_abbrev": False, "description": __doc__, "prog": "ssl-vit fit"},
        )
    except (ArgumentError, ValueError, TypeError, MisconfigurationException) as err:
        # (MisconfigurationException: Lightning's, e.g. an accelerator this machine lacks)
        message = one_line(str(err)) + known_classes(str(err))
        if isinstance(err, MisconfigurationException) and "gpu" in message.lower():
            message += " (the recipe's trainer asks for GPUs; on a machine without one add --config recipes/trainer/cpu.yaml)"
        raise ConfigError(message) from None
    cfg = cli.config
    # The resolved recipe travels inside every checkpoint (export writes it into config.json).
    cli.model.recipe = cli.parser.dump(cfg, skip_none=False, skip_validation=True)
    validate_run(cli.model, cli.datamodule, cli.trainer, cfg.get("global_batch_size"))
    evaluation = cli.config_init.get("evaluate")
    if isinstance(evaluation, RecipeEvaluation):
        try:
            evaluation.check_model(cli.model)
            evaluation.check_data(cli.datamodule)
        except ValueError as err:
            raise ConfigError(one_line(str(err))) from None
    # The checkpoint directory is fixed before anything is restored: the restored bookkeeping must
    # match it (else last.ckpt would get a last-v1.ckpt sibling and keep_last would not prune).
    ckpt_dir = _checkpoint_dir(cli.trainer)
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path in ("last", "auto"):
        newest = newest_checkpoint(ckpt_dir, cli.trainer.default_root_dir)
        if newest is None and ckpt_path == "last":
            raise ConfigError(f"--resume: no checkpoint to resume from in {ckpt_dir} (--ckpt_path auto starts a new run then)")
        ckpt_path = str(newest) if newest is not None else None
        if rank_zero_only.rank == 0:
            print(f"ssl-vit fit: resuming from {ckpt_path}" if ckpt_path else f"ssl-vit fit: no checkpoint in {ckpt_dir}; starting a new run", file=sys.stderr)
    elif ckpt_path is None and not _slurm_requeued(cli.trainer):
        # A rerun without --resume would overwrite the run's checkpoints from its first save on.
        earlier = newest_checkpoint(ckpt_dir)
        if earlier is not None:
            raise ConfigError(
                f"{ckpt_dir} already holds a run's checkpoints (newest: {earlier.name}): continue it with --resume, "
                "or start anew in another --trainer.default_root_dir (or --checkpoint.dirpath), or remove that folder first"
            )
    if ckpt_path is not None:
        check_continuable(cli.model, ckpt_path)
    resuming = ckpt_path is not None or _slurm_requeued(cli.trainer)
    if isinstance(evaluation, RecipeEvaluation):
        try:
            evaluation.check_run_dirs(cli.trainer, resuming)
        except ValueError as err:
            raise ConfigError(one_line(str(err))) from None
    if rank_zero_only.rank == 0 and ckpt_dir.is_dir():
        # A job killed while writing a checkpoint leaves its temporary file (the old checkpoint
        # is whole); one of full checkpoint size each time, so they go.
        stale = stale_temporaries(ckpt_dir, ".ckpt")
        for tmp in stale:
            tmp.unlink(missing_ok=True)
        if stale:
            print(f"ssl-vit fit: removed {len(stale)} unfinished checkpoint write(s) of an interrupted job: "
                  f"{', '.join(p.name for p in stale)}", file=sys.stderr)
    stopped_by = None
    try:
        with warnings.catch_warnings():
            if ckpt_path is not None:  # resuming: the checkpoint directory holds this run's own files
                warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    except SIGTERMException:
        stopped_by = "SIGTERM"  # Lightning stopped after the current step; PreemptionCheckpoint saved it
    # Every process ended the run at the same step (a finished run, or a signal all agreed on):
    # the process group can go. Not after an exception: another process may still be waiting in a
    # collective, and tearing the group down under it can hang both.
    # (Before process 0's evaluation, which the others do not wait for.)
    release_process_group()
    stopped_by = next((cb.stopped_by for cb in cli.trainer.callbacks if isinstance(cb, PreemptionCheckpoint) and cb.stopped_by), stopped_by)
    if stopped_by is not None:
        if rank_zero_only.rank == 0:
            print(f"ssl-vit fit: stopped by {stopped_by} at step {cli.trainer.global_step}; continue with --resume", file=sys.stderr)
        return 128 + int(getattr(signal, stopped_by, signal.SIGTERM))
    evaluation = cli.config_init.get("evaluate")
    if isinstance(evaluation, RecipeEvaluation) and evaluation.protocols:
        # The run's result, evaluated as `ssl-vit eval` would: the protocols that train on images
        # on every process of the run, then those on extracted features in process 0 alone.
        first = rank_zero_only.rank == 0
        last = newest_checkpoint(ckpt_dir)
        if last is None:
            if not first:
                return 1
            raise ConfigError(f"evaluate: the run left no checkpoint in {ckpt_dir} to evaluate")
        results = []
        try:
            for protocol in evaluation.image_protocols:
                done = evaluation.train_on_images(protocol, last, cli.datamodule, cli.trainer, resuming=resuming)
                results += [done[0]] if done is not None else []
            if first:
                results += evaluation.run(last, cli.datamodule, cli.trainer)
        except EvalRunInterrupted as stop:
            if stop.rank == 0:
                print(f"ssl-vit fit: the pretraining is done; evaluate's {stop}; continue with --resume", file=sys.stderr)
            return 128 + int(getattr(signal, stop.signal_name, signal.SIGTERM))
        except (ValueError, RuntimeError, OSError) as err:
            if not first:
                raise
            # The training is done and kept: say how to evaluate it without training again.
            raise ValueError(f"evaluate: {one_line(str(err)).removeprefix('evaluate: ')} (the trained backbone is kept in {last}: fix the evaluate section "
                              f"and run the same command with --resume, which evaluates without training further, "
                              f"or use `ssl-vit eval ... --backbone {last}`)") from None
        for result in results:
            print(result.summary_line())
    return 0


def _slurm_requeued(trainer: L.Trainer) -> bool:
    """A SLURM job requeued by Lightning: it resumes from its ``hpc_ckpt_<n>.ckpt`` by itself."""
    return SLURMEnvironment.detect() and bool(hpc_checkpoints(trainer.default_root_dir))


def _checkpoint_dir(trainer: L.Trainer) -> Path:
    """Where this run's checkpoints go (and ``--resume`` looks), fixed on the run's callback."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, StepCheckpoint):
            return Path(cb.resolve_dirpath(trainer))
    cb = trainer.checkpoint_callback
    return Path(cb.dirpath) if isinstance(cb, ModelCheckpoint) and cb.dirpath else Path(default_checkpoint_dir(trainer))

