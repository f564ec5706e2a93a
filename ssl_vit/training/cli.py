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
import importlib
import re
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
from ssl_vit.arguments import closest, did_you_mean, init_parameters
from ssl_vit.backbones import is_vit
from ssl_vit.backbones.registry import kwargs_differences
from ssl_vit.eval.train_run import EvalRunInterrupted
from ssl_vit.flops import PretrainFlopsCounter
from ssl_vit.io import stale_temporaries
from ssl_vit.pretext.base import NO_LENGTH, PretextModule
from ssl_vit.runtime import release_process_group
from ssl_vit.training.checkpoint_io import AtomicCheckpointIO
from ssl_vit.training.evaluate import RecipeEvaluation
from ssl_vit.training.preemption import PreemptionCheckpoint
from ssl_vit.training.progress import ProgressLog
from ssl_vit.training.step_checkpoint import (
    StepCheckpoint,
    default_checkpoint_dir,
    hpc_checkpoints,
    load_record,
    newest_checkpoint,
)

BATCH_LIMITS = tuple(f"trainer.limit_{stage}_batches" for stage in ("train", "val", "test", "predict"))


class ConfigError(ValueError):
    """A recipe that cannot run; raised before training starts."""


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
            hint = _key_hint(str(err), keys)
            if not hint:
                raise
            raise ConfigError(_one_line(str(err)) + hint) from None

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


def _normalise_argv(argv: list[str]) -> list[str]:
    if "--resume" in argv and any(a == "--ckpt_path" or a.startswith("--ckpt_path=") for a in argv):
        raise ConfigError("--resume and --ckpt_path both say where to continue from: give one (--resume is --ckpt_path last)")
    out = []
    for arg in argv:
        if arg == "--resume":
            out += ["--ckpt_path", "last"]
        else:
            out.append(arg)
    return out


def _known_classes(message: str) -> str:
    """What a recipe may name where the parser could not import a class (``model: Dino``)."""
    found = re.search(r"Expected a path but (\S+) either not accessible or invalid", message)
    if found is None:  # the class was found (its options may not be)
        return ""
    if 'key "model"' in message:
        from ssl_vit.pretext import METHODS

        names = [cls.__name__ for cls in METHODS.values()]
        return f"{did_you_mean(found.group(1), names)} (methods: {', '.join(names)}, or the dotted path of a PretextModule of your own)"
    if 'key "data"' in message:
        import ssl_vit.data

        names = sorted(n for n in ssl_vit.data.__all__ if n.endswith("DataModule") and n != "ImageDataModule")
        return f"{did_you_mean(found.group(1), names)} (datamodules: {', '.join(names)}, or the dotted path of a LightningDataModule of your own)"
    return ""


def _key_hint(message: str, keys: list[str]) -> str:
    """The likely spelling of a recipe key or option the parser refused: an ``init_args`` entry
    of the class a recipe names, or a key among the parser's own (``keys``: ``trainer.max_epochs``
    ...). ``""`` when nothing is close."""
    found = re.search(r"class_path '([\w.]+)'\W+Option '(\w+)' is not accepted", message)
    if found:
        module, _, name = found.group(1).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return ""
        return did_you_mean(found.group(2), init_parameters(cls))
    flag = re.search(r"unrecognized arguments: --([\w.]+)", message)
    group = re.search(r"Group '([\w.]+)' does not accept option '([\w.]+)'", message)
    option = re.search(r"Option '([\w.]+)' is not accepted", message)
    if flag:
        key = flag.group(1)
    elif group:
        key = f"{group.group(1)}.{group.group(2)}"
    elif option:
        key = option.group(1)
    else:
        return ""
    # The first part of the dotted key that names nothing, against its siblings:
    # `evaluat.knn.k` -> 'evaluate.knn', `trainer.max_epoch` -> 'trainer.max_epochs'.
    parts = key.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if any(k == prefix or k.startswith(prefix + ".") for k in keys):
            continue
        parent = ".".join(parts[: depth - 1])
        siblings = {".".join(k.split(".")[:depth]) for k in keys if depth == 1 or k.startswith(parent + ".")}
        close = closest(prefix, siblings)
        if close is None:
            return ""
        for end in range(len(parts), depth, -1):  # as much of the rest of the key as exists there
            longer = ".".join([close, *parts[depth:end]])
            if any(k == longer or k.startswith(longer + ".") for k in keys):
                close = longer
                break
        shown = f"--{close}" if flag else close
        return f" (did you mean {shown!r}?)"
    return ""


def _resolved_devices(trainer: L.Trainer) -> int:
    return int(trainer.num_devices) * int(trainer.num_nodes)


def validate_run(model: PretextModule, datamodule: L.LightningDataModule, trainer: L.Trainer, global_batch_size: int | None) -> None:
    """Checks that need the instantiated objects; each failure is one clear line."""
    if trainer.max_steps == -1 and trainer.max_epochs == -1:
        raise ConfigError(NO_LENGTH)
    if trainer.max_steps == 0 or trainer.max_epochs == 0:
        which = "max_steps" if trainer.max_steps == 0 else "max_epochs"
        raise ConfigError(f"trainer.{which} 0 trains nothing: give a positive length (or -1 for no limit, with the other set)")
    devices = _resolved_devices(trainer)
    accum = int(trainer.accumulate_grad_batches)
    if accum < 1:
        raise ConfigError(f"trainer.accumulate_grad_batches must be >= 1, got {accum}")
    if global_batch_size is not None:
        split = devices * accum
        if global_batch_size <= 0:
            raise ConfigError(f"global_batch_size must be a positive number of images, got {global_batch_size}")
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
    views = getattr(datamodule, "views", None)
    crops = _view_sizes(views, img) if views is not None else {}
    if stride:
        for name, size in crops.items():
            if size % stride:
                raise ConfigError(f"data.views {type(views).__name__}.{name} {size} is not divisible by the backbone's patch size {stride}")
    built = getattr(backbone, "img_size", None)
    if built is not None and img is not None and is_vit(backbone):  # (a ResNet takes any size)
        # The backbone's size is the largest crop it sees (DINO's global crops; one view's size):
        # larger crops than it was built for are a mistake; smaller ones resample its position
        # embedding at every step, which a recipe may mean (training below the evaluation size).
        fed = max(crops.get("size", 0), crops.get("global_size", 0)) or img
        fed = (fed, fed) if isinstance(fed, int) else tuple(fed)
        if tuple(built) != fed:
            what = (f"the backbone was built for {built[0]}x{built[1]} images (model backbone_kwargs.img_size) but the data gives "
                    f"{fed[0]}x{fed[1]} crops (data img_size / views)")
            if fed[0] > built[0] or fed[1] > built[1]:
                raise ConfigError(f"{what}; set them to match")
            if rank_zero_only.rank == 0:
                print(f"ssl-vit fit: note: {what}: its position embedding is resampled for them at every step", file=sys.stderr)
    chans = getattr(datamodule, "in_chans", None)
    if chans is not None and chans != backbone.in_chans:
        raise ConfigError(
            f"the data gives {chans}-channel images but the backbone was built with in_chans={backbone.in_chans}; "
            "set data in_chans or model backbone_kwargs.in_chans to match"
        )


def _view_sizes(views: Any, img: Any) -> dict[str, int]:
    """The crop sizes a view transform makes (a multi-crop's local size as it resolves it, its
    global size from the data's when not set)."""
    if getattr(views, "global_size", 0) is None and isinstance(img, int) and hasattr(views, "with_img_size"):
        views = views.with_img_size(img)
    sizes = {n: v for n in ("size", "global_size") if isinstance(v := getattr(views, n, None), int)}
    if "global_size" in sizes and hasattr(views, "resolved_local_size"):
        sizes["local_size"] = int(views.resolved_local_size)
    return sizes


def _check_yaml_files(argv: list[str]) -> None:
    """A recipe file that is not valid YAML: one line naming the file, line and column (the
    parser's own message names only "<unicode string>")."""
    import yaml

    paths = [b for a, b in zip(argv, argv[1:]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    dict_settings: dict[str, list[tuple[Path, dict]]] = {}
    for path in map(Path, paths):
        if not path.is_file():
            continue  # the parser says so
        try:
            cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err)
            raise ConfigError(f"{path}: not valid YAML{where}: {_one_line(str(problem))}") from None
        if not isinstance(cfg, dict):
            what = "is empty" if cfg is None else f"holds a {type(cfg).__name__}"
            raise ConfigError(f"{path}: {what}; a recipe is a mapping of settings (model:, data:, trainer: ...)")
        for key, value in _dict_valued_settings(cfg):
            dict_settings.setdefault(key, []).append((path, value))
    # Settings whose value is a dict are replaced whole by a later file, not merged: say what a
    # later file drops (MoCo v3's pos_embed: sincos under a drop-path overlay, say).
    for key, found in dict_settings.items():
        for (first, old), (later, new) in zip(found, found[1:]):
            dropped = sorted(set(old) - set(new))
            if dropped:
                print(f"ssl-vit fit: note: {later} sets {key} again and replaces the whole value from {first}: "
                      f"{', '.join(dropped)} no longer set (change one entry with --{key}.{dropped[0]} VALUE)", file=sys.stderr)


def _dict_valued_settings(cfg: Any) -> list[tuple[str, dict]]:
    """The recipe settings whose values are plain dicts (a backbone's kwargs, a protocol's
    settings under ``evaluate``), as (dotted key, value)."""
    found: list[tuple[str, dict]] = []
    model = cfg.get("model") if isinstance(cfg, dict) else None
    init = model.get("init_args") if isinstance(model, dict) else None
    if isinstance(init, dict):
        found += [(f"model.init_args.{k}", v) for k, v in init.items() if isinstance(v, dict) and "class_path" not in v]
    evaluate = cfg.get("evaluate") if isinstance(cfg, dict) else None
    if isinstance(evaluate, dict):
        found += [(f"evaluate.{k}", v) for k, v in evaluate.items() if isinstance(v, dict)]
    return found


def main(argv: list[str] | None = None) -> int:
    """``ssl-vit fit``. It runs in a copy of the caller's context: LightningCLI leaves itself
    (and through it the trainer, the model and its data) in a context variable, where no
    collection reaches it until the interpreter exits. Run this way, the run's objects go when it
    returns: a caller that fits several times in one process (a notebook, a sweep script, the
    tests) does not keep every earlier run in memory."""
    return contextvars.copy_context().run(_fit, argv)  # (its cycles then go at the next collection)


def _fit(argv: list[str] | None) -> int:
    argv = _normalise_argv(list(sys.argv[1:] if argv is None else argv))
    _check_yaml_files(argv)
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
            # The FLOP counter first: a signal's checkpoint, written at the same batch end, then
            # counts the batch it follows (Lightning runs callbacks in this order).
            trainer_defaults={"callbacks": [PretrainFlopsCounter(), PreemptionCheckpoint()]},
            parser_kwargs={"exit_on_error": False, "allow_abbrev": False, "description": __doc__, "prog": "ssl-vit fit"},
        )
    except (ArgumentError, ValueError, TypeError, MisconfigurationException) as err:
        # (MisconfigurationException: Lightning's, e.g. an accelerator this machine lacks)
        message = _one_line(str(err)) + _known_classes(str(err))
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
            raise ConfigError(_one_line(str(err))) from None
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
            raise ConfigError(_one_line(str(err))) from None
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
            raise ValueError(f"evaluate: {_one_line(str(err))} (the trained backbone is kept in {last}: fix the evaluate section "
                              f"and run the same command with --resume, which evaluates without training further, "
                              f"or use `ssl-vit eval ... --backbone {last}`)") from None
        for result in results:
            print(result.summary_line())
    return 0


# Backbone arguments that do not change the parameters' shapes: a run may continue with others.
_SHAPE_NEUTRAL = {"drop_path_rate", "drop_rate", "attn_drop_rate", "lean_backward"}


def check_continuable(model: PretextModule, ckpt_path: str) -> None:
    """A checkpoint continues only a run of the same method and backbone: say so in one line,
    before Lightning's wall of missing and unexpected state-dict keys."""
    if not Path(ckpt_path).is_file():
        raise ConfigError(f"--ckpt_path {ckpt_path}: no such file")
    try:
        checkpoint = load_record(ckpt_path)  # memory-mapped: only the small record is read
    except Exception as err:  # not a checkpoint at all
        raise ConfigError(f"--ckpt_path {ckpt_path}: not a readable checkpoint ({type(err).__name__}: {_one_line(str(err))})") from None
    meta = (checkpoint.get("ssl_vit") if isinstance(checkpoint, dict) else None) or {}
    method, backbone = meta.get("method"), meta.get("backbone")
    if method is not None and method != type(model).__name__:
        raise ConfigError(
            f"--ckpt_path {ckpt_path} is a {method} checkpoint; this recipe trains {type(model).__name__}. "
            "--ckpt_path and --resume continue a run of the checkpoint's own method"
        )
    if backbone is not None and backbone != model.backbone_name:
        raise ConfigError(f"--ckpt_path {ckpt_path} holds a {backbone} backbone; this recipe builds {model.backbone_name}")
    differ = kwargs_differences(meta.get("backbone_kwargs") or {}, model.backbone_kwargs, ignore=_SHAPE_NEUTRAL)
    if "backbone_kwargs" in meta and differ:
        raise ConfigError(f"--ckpt_path {ckpt_path} was trained with other backbone arguments ({', '.join(differ)})")


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
