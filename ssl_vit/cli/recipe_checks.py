"""The checks a recipe passes before ``ssl-vit fit`` trains, each failure one line naming the
problem: a file that is not YAML, a misspelt key with its likely spelling, a class the parser
cannot find with the known ones, a batch that does not split over the devices, images the patch
size does not divide, a checkpoint of another run."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import lightning as L
import yaml
from lightning.pytorch.utilities import rank_zero_only

from ssl_vit.backbones import is_vit
from ssl_vit.backbones.registry import kwargs_differences
from ssl_vit.data.views import ViewTransform
from ssl_vit.errors import ConfigError, closest, did_you_mean, init_parameters, one_line
from ssl_vit.methods.base import BaseMethod
from ssl_vit.training.checkpoint import load_record


def check_yaml_files(argv: list[str]) -> None:
    """Name the file, line and column of a recipe that is not YAML (the parser's own message names
    only "<unicode string>"), and say what a later file drops where it replaces a dict-valued
    argument of the method whole (``backbone_kwargs``: jsonargparse merges recipes key by key, and
    classes' arguments too, but not the keys inside a dict's value)."""
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
        model = cfg.get("model")
        init = model.get("init_args") if isinstance(model, dict) else None
        for name, value in init.items() if isinstance(init, dict) else ():
            if isinstance(value, dict) and "class_path" not in value:
                key = f"model.init_args.{name}"
                if key in earlier and (dropped := sorted(set(earlier[key][1]) - set(value))):
                    print(f"ssl-vit fit: note: {path} sets {key} again and replaces the whole value from {earlier[key][0]}: "
                          f"{', '.join(dropped)} no longer set (change one entry with --{key}.{dropped[0]} VALUE)", file=sys.stderr)
                earlier[key] = (path, value)


def key_hint(message: str, keys: list[str]) -> str:
    """The likely spelling of a key the parser refused: an ``init_args`` entry of the class the
    recipe names, or one of the parser's own ``keys`` (``trainer.max_epochs`` ...); else ``""``."""
    if found := re.search(r"class_path '([\w.]+)'\W+Option '(\w+)' is not accepted", message):
        module, _, name = found.group(1).rpartition(".")
        try:
            return did_you_mean(found.group(2), init_parameters(getattr(importlib.import_module(module), name)))
        except (ImportError, AttributeError, ValueError):
            return ""
    flag = re.search(r"unrecognized arguments: --([\w.]+)", message)
    group = re.search(r"Group '([\w.]+)' does not accept option '([\w.]+)'", message)
    option = re.search(r"Option '([\w.]+)' is not accepted", message)
    key = flag.group(1) if flag else f"{group.group(1)}.{group.group(2)}" if group else option.group(1) if option else None
    if key is None:
        return ""

    def exists(prefix: str) -> bool:
        return any(k == prefix or k.startswith(prefix + ".") for k in keys)

    # The first part of the key that names nothing, against its siblings' names (whole paths would
    # look alike by their shared group: `evaluate.max_epochs` is not `evaluate.protocols`), then as
    # much of the rest as exists there: `evaluat.knn.k` -> 'evaluate.knn'.
    parts = key.split(".")
    depth = next((d for d in range(len(parts)) if not exists(".".join(parts[: d + 1]))), None)
    if depth is None:
        return ""
    parent = ".".join(parts[:depth])
    name = closest(parts[depth], {k.split(".")[depth] for k in keys if depth == 0 or k.startswith(parent + ".")})
    if name is None:
        return ""
    close = ".".join([*parts[:depth], name])
    for end in range(len(parts), depth + 1, -1):
        if exists(longer := ".".join([close, *parts[depth + 1 : end]])):
            close = longer
            break
    shown = f"--{close}" if flag else close
    return f" (did you mean {shown!r}?)"


def known_classes(message: str) -> str:
    """What a recipe may name where the parser could not import a class (``model: Dino``)."""
    found = re.search(r"Expected a path but (\S+) either not accessible or invalid", message)
    if found is None or not re.search(r'key "(model|data)"', message):  # the class was found (its options may not be)
        return ""
    if 'key "model"' in message:
        from ssl_vit.methods import METHODS

        names, what = [cls.__name__ for cls in METHODS.values()], "methods: {}, or the dotted path of a BaseMethod of your own"
    else:
        import ssl_vit.data

        names = sorted(n for n in ssl_vit.data.__all__ if n.endswith("DataModule") and n != "ImageDataModule")
        what = "datamodules: {}, or the dotted path of a LightningDataModule of your own"
    return f"{did_you_mean(found.group(1), names)} ({what.format(', '.join(names))})"


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
    backbone, img = model.backbone, getattr(datamodule, "img_size", None)
    patch = getattr(backbone, "patch_size", None)  # (a ResNet has none)
    if patch and img is not None and any(side % patch for side in _hw(img)):
        raise ConfigError(f"data.img_size {img} is not divisible by the backbone's patch size {patch}")
    views, crops = getattr(datamodule, "views", None), []
    if isinstance(views, ViewTransform):  # (already fitted to the data's img_size by the datamodule)
        crops = [_hw(aug.size) for aug in views.augmentations()]
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
    chans = getattr(datamodule, "in_chans", None)
    if chans is not None and chans != backbone.in_chans:
        raise ConfigError(f"the data gives {chans}-channel images but the backbone was built with in_chans={backbone.in_chans}; "
                          "set data in_chans or model backbone_kwargs.in_chans to match")


# Backbone arguments that change no parameter's shape: a run may continue with others.
_SHAPE_NEUTRAL = {"drop_path_rate", "drop_rate", "attn_drop_rate", "lean_backward"}


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
