"""The checks a recipe passes before ``ssl-vit fit`` trains, each failure one line that names the
problem and its fix: a file that is not YAML, a key misspelt or at the wrong level, a class the
parser cannot find, a batch that does not split over the devices, images the patch size does not
divide, a checkpoint of another run."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import jsonargparse
import lightning as L
import yaml
from lightning.pytorch.utilities import rank_zero_only

import ssl_vit.data
from ssl_vit.backbones import get_spec, is_vit, list_backbones
from ssl_vit.backbones.registry import kwargs_differences
from ssl_vit.data.views import ViewTransform
from ssl_vit.errors import ConfigError, closest, did_you_mean, one_line
from ssl_vit.methods import METHODS, BaseMethod
from ssl_vit.training.checkpoint import load_record

# What a recipe may name at each class-valued key: the base class and how messages call its kind.
_KINDS = {"model": (BaseMethod, "methods"), "data": (L.LightningDataModule, "datamodules"), "views": (ViewTransform, "views")}
_SPEC_KEYS = {"class_path", "init_args", "dict_kwargs"}  # (jsonargparse's keys of a class's mapping)
_SHAPE_NEUTRAL = {"drop_path_rate", "drop_rate", "attn_drop_rate", "lean_backward"}  # a run may continue with others


def check_yaml_files(argv: list[str]) -> None:
    """Name the line of a file that is not YAML and a key beside a ``class_path`` (the parser says
    "<unicode string>" and "Not a valid subclass"); say what a later file drops where it replaces a
    method's dict-valued argument whole (``backbone_kwargs``: files merge key by key, not inside a dict)."""
    paths = [b for a, b in zip(argv, argv[1:]) if a in ("--config", "-c")] + [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    earlier: dict[str, tuple[Path, dict]] = {}
    for path in (Path(p) for p in paths if Path(p).is_file()):  # (a missing file: the parser says so)
        try:
            cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise ConfigError(f"{path}: not valid YAML{where}: {one_line(str(getattr(err, 'problem', None) or err))}") from None
        if not isinstance(cfg, dict):
            what = "is empty" if cfg is None else f"holds a {type(cfg).__name__}"
            raise ConfigError(f"{path}: {what}; a recipe is a mapping of settings (model:, data:, trainer: ...)")
        _check_class_mappings(path, cfg, "")
        init = cfg["model"].get("init_args") if isinstance(cfg.get("model"), dict) else None
        for name, value in init.items() if isinstance(init, dict) else ():
            if isinstance(value, dict) and "class_path" not in value:
                key = f"model.init_args.{name}"
                if key in earlier and (dropped := sorted(set(earlier[key][1]) - set(value))):
                    print(f"ssl-vit fit: note: {path} sets {key} again and replaces the whole value from {earlier[key][0]}: "
                          f"{', '.join(dropped)} no longer set (change one entry with --{key}.{dropped[0]} VALUE)", file=sys.stderr)
                earlier[key] = (path, value)


def _check_class_mappings(path: Path, value: Any, key: str) -> None:
    if isinstance(value, dict) and "class_path" in value and (stray := sorted(set(value) - _SPEC_KEYS)):
        raise ConfigError(f"{path}: {key}.{stray[0]} sits beside class_path; a class's arguments go under init_args ({key}.init_args.{stray[0]})")
    for name, item in value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ():
        _check_class_mappings(path, item, f"{key}.{name}" if key else str(name))


def key_hint(message: str, keys: list[str]) -> str:
    """Where a key the parser refused belongs, or ``""``: the likely spelling among the arguments
    of the class the recipe names (else a backbone argument, or the classes that take it), or
    among the parser's own ``keys`` (``trainer.max_epochs`` ...; a top-level key: the group's)."""
    if found := re.search(r"class_path '([\w.]+)'\W+Option '(\w+)' is not accepted", message):
        return _argument_hint(found.group(1), found.group(2))
    flag = re.search(r"unrecognized arguments: --([\w.]+)", message)
    group = re.search(r"Group '([\w.]+)' does not accept option '([\w.]+)'", message)
    option = re.search(r"Option '([\w.]+)' is not accepted", message)
    key = flag.group(1) if flag else f"{group.group(1)}.{group.group(2)}" if group else option.group(1) if option else None
    # One part corrected, against its siblings' names (whole paths would look alike by their shared
    # group: `evaluate.max_epochs` is not `evaluate.protocols`), then as much of the rest as exists
    # there: `evaluat.knn.k` -> 'evaluate.knn'.
    close, fixed = [], False
    for part in key.split(".") if key else ():
        siblings = {k.split(".")[len(close)] for k in keys if k.startswith(".".join([*close, ""]))}
        if part not in siblings:
            if fixed or (part := closest(part, siblings)) is None:
                break
            fixed = True
        close.append(part)
    if not fixed:  # a group's key at the top level: `max_steps` -> 'trainer.max_steps'
        grouped = [k for k in keys if k.endswith(f".{key}")] if key and not close else []
        if len(grouped) != 1:
            return ""
        close = grouped
    shown = ".".join(close)
    return f" (did you mean {f'--{shown}' if flag else shown!r}?)"


def _argument_hint(class_path: str, name: str) -> str:
    module, _, attr = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
        if hint := did_you_mean(name, class_arguments(cls)):
            return hint
    except (ImportError, AttributeError, ValueError):
        return ""
    base = next((b for b, _ in _KINDS.values() if inspect.isclass(cls) and issubclass(cls, b)), None)
    if base is BaseMethod and any(name in get_spec(b).allowed_kwargs() for b in list_backbones()):
        return f" (a backbone argument: model.init_args.backbone_kwargs.{name})"
    takers = [k.__name__ for k in _known(base) if name in class_arguments(k)] if base else []
    return f" ({name} is an argument of {' and '.join(takers)}, not of {attr})" if takers else ""


def class_arguments(cls: type) -> set[str]:
    """The arguments a recipe may give ``cls``, as the parser reads its signature (and its bases')."""
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, fail_untyped=False)
    return {key.split(".")[0] for key in parser.get_defaults().keys()}


def _known(base: type) -> list[type]:
    """The classes of ours a recipe may name where a ``base`` is expected."""
    ours = [*METHODS.values(), *(getattr(ssl_vit.data, n) for n in ssl_vit.data.__all__ if n not in ("ImageDataModule", "ViewTransform"))]
    return [c for c in ours if inspect.isclass(c) and issubclass(c, base)]


def known_classes(message: str) -> str:
    """What a recipe may name where the parser could not import a class (``model: Dino``)."""
    found = re.search(r'key "(\w+)"\W+Expected a path but (\S+) either not accessible or invalid', message)
    if found is None or found.group(1) not in _KINDS:  # (a class found: its options may not be)
        return ""
    base, kind = _KINDS[found.group(1)]
    names = [c.__name__ for c in _known(base)]
    return f"{did_you_mean(found.group(2), names)} ({kind}: {', '.join(names)}, or the dotted path of a {base.__name__} of your own)"


def _hw(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def validate_run(model: BaseMethod, datamodule: L.LightningDataModule, trainer: L.Trainer, global_batch_size: int | None) -> None:
    """The checks that need the built objects; sets the per-device batch of ``global_batch_size``."""
    for which in ("max_steps", "max_epochs"):
        if getattr(trainer, which) == 0:
            raise ConfigError(f"trainer.{which} 0 trains nothing: give a positive length (or -1 for no limit, with the other set)")
    if global_batch_size is not None:
        split = trainer.num_devices * trainer.num_nodes * trainer.accumulate_grad_batches
        if global_batch_size % split:
            raise ConfigError(f"global_batch_size {global_batch_size} is not divisible by devices x nodes x accumulate_grad_batches = {split}")
        datamodule.batch_size = global_batch_size // split
    backbone, img, views = model.backbone, getattr(datamodule, "img_size", None), getattr(datamodule, "views", None)
    patch = getattr(backbone, "patch_size", None)  # (a ResNet has none)
    if patch and img is not None and any(side % patch for side in _hw(img)):
        raise ConfigError(f"data.img_size {img} is not divisible by the backbone's patch size {patch}; set model backbone_kwargs "
                          "img_size and patch_size to fit the data")
    crops = [_hw(aug.size) for aug in views.augmentations()] if isinstance(views, ViewTransform) else []  # (fitted to data.img_size)
    if crops:
        try:
            model.check_views(len(crops))
        except ValueError as err:
            raise ConfigError(f"data.views {type(views).__name__}: {err}") from None
        if patch and (odd := [c for c in crops if c[0] % patch or c[1] % patch]):
            raise ConfigError(f"data.views {type(views).__name__} makes {odd[0][0]}x{odd[0][1]} crops, which the backbone's patch size {patch} does not divide")
    built = getattr(backbone, "img_size", None)
    if built is not None and img is not None and is_vit(backbone):  # (a ResNet takes any size)
        # Larger crops than the backbone was built for are a mistake; smaller ones resample its
        # position embedding at every step, which a recipe may mean (training below the evaluation size).
        fed = max(crops, default=_hw(img))
        if tuple(built) != fed:
            what = (f"the backbone was built for {built[0]}x{built[1]} images (model backbone_kwargs.img_size) but the data gives "
                    f"{fed[0]}x{fed[1]} crops (data img_size / views)")
            if fed[0] > built[0] or fed[1] > built[1]:
                raise ConfigError(f"{what}; set them to match")
            if rank_zero_only.rank == 0:
                print(f"ssl-vit fit: note: {what}: its position embedding is resampled for them at every step", file=sys.stderr)
    if (chans := getattr(datamodule, "in_chans", None)) is not None and chans != backbone.in_chans:
        raise ConfigError(f"the data gives {chans}-channel images but the backbone was built with in_chans={backbone.in_chans}; "
                          "set data in_chans or model backbone_kwargs.in_chans to match")


def check_continuable(model: BaseMethod, ckpt_path: str) -> None:
    """A checkpoint continues only a run of the same method and backbone: said in one line, before
    Lightning's wall of missing and unexpected state-dict keys."""
    if not Path(ckpt_path).is_file():
        raise ConfigError(f"--ckpt_path {ckpt_path}: no such file")
    try:
        checkpoint = load_record(ckpt_path)
    except Exception as err:  # not a checkpoint at all
        raise ConfigError(f"--ckpt_path {ckpt_path}: not a readable checkpoint ({type(err).__name__}: {one_line(str(err))})") from None
    info = (checkpoint.get("ssl_vit") if isinstance(checkpoint, dict) else None) or {}
    if info.get("method") not in (None, type(model).__name__):
        raise ConfigError(f"--ckpt_path {ckpt_path} is a {info['method']} checkpoint; this recipe trains {type(model).__name__}. "
                          "--ckpt_path and --resume continue a run of the checkpoint's own method")
    if info.get("backbone") not in (None, model.backbone_name):
        raise ConfigError(f"--ckpt_path {ckpt_path} holds a {info['backbone']} backbone; this recipe builds {model.backbone_name}")
    if "backbone_kwargs" in info and (differ := kwargs_differences(info["backbone_kwargs"] or {}, model.backbone_kwargs, ignore=_SHAPE_NEUTRAL)):
        raise ConfigError(f"--ckpt_path {ckpt_path} was trained with other backbone arguments ({', '.join(differ)})")
