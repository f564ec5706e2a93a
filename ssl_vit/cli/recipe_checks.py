"""The checks a recipe passes before ``ssl-vit fit`` trains: each failure is one line naming the
problem (a misspelt key with its likely spelling, a file that is not YAML, a batch that does not
split over the devices, images the patch size does not divide, a checkpoint of another run)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from ssl_vit.backbones import is_vit
from ssl_vit.backbones.registry import kwargs_differences
from ssl_vit.errors import closest, did_you_mean, init_parameters
from ssl_vit.methods.base import NO_LENGTH, BaseMethod
from ssl_vit.training.step_checkpoint import load_record


class ConfigError(ValueError):
    """A recipe that cannot run; raised before training starts."""


def normalise_argv(argv: list[str]) -> list[str]:
    """``--resume`` spelt as the ``--ckpt_path last`` it stands for; both at once refused."""
    if "--resume" in argv and any(a == "--ckpt_path" or a.startswith("--ckpt_path=") for a in argv):
        raise ConfigError("--resume and --ckpt_path both say where to continue from: give one (--resume is --ckpt_path last)")
    out = []
    for arg in argv:
        if arg == "--resume":
            out += ["--ckpt_path", "last"]
        else:
            out.append(arg)
    return out


def known_classes(message: str) -> str:
    """What a recipe may name where the parser could not import a class (``model: Dino``)."""
    found = re.search(r"Expected a path but (\S+) either not accessible or invalid", message)
    if found is None:  # the class was found (its options may not be)
        return ""
    if 'key "model"' in message:
        from ssl_vit.methods import METHODS

        names = [cls.__name__ for cls in METHODS.values()]
        return f"{did_you_mean(found.group(1), names)} (methods: {', '.join(names)}, or the dotted path of a BaseMethod of your own)"
    if 'key "data"' in message:
        import ssl_vit.data

        names = sorted(n for n in ssl_vit.data.__all__ if n.endswith("DataModule") and n != "ImageDataModule")
        return f"{did_you_mean(found.group(1), names)} (datamodules: {', '.join(names)}, or the dotted path of a LightningDataModule of your own)"
    return ""


def key_hint(message: str, keys: list[str]) -> str:
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
    # The first part of the dotted key that names nothing, against its siblings' names (not the
    # whole paths, whose shared group would make any two look alike: `evaluate.max_epochs` is
    # not `evaluate.protocols`): `evaluat.knn.k` -> 'evaluate.knn', `trainer.max_epoch` ->
    # 'trainer.max_epochs'.
    parts = key.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if any(k == prefix or k.startswith(prefix + ".") for k in keys):
            continue
        parent = ".".join(parts[: depth - 1])
        siblings = {k.split(".")[depth - 1] for k in keys if depth == 1 or k.startswith(parent + ".")}
        name = closest(parts[depth - 1], siblings)
        if name is None:
            return ""
        close = ".".join([*parts[: depth - 1], name])
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


def validate_run(model: BaseMethod, datamodule: L.LightningDataModule, trainer: L.Trainer, global_batch_size: int | None) -> None:
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
    num_views, check_views = _num_views(views, img), getattr(model, "check_views", None)
    if num_views is not None and callable(check_views):
        try:
            check_views(num_views)
        except ValueError as err:
            raise ConfigError(f"data.views {type(views).__name__}: {err}") from None
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


def _resolved(views: Any, img: Any) -> Any:
    """The view transform as the datamodule will use it (a multi-crop's global size from the
    data's when not set)."""
    if getattr(views, "global_size", 0) is None and isinstance(img, int) and hasattr(views, "with_img_size"):
        return views.with_img_size(img)
    return views


def _num_views(views: Any, img: Any) -> int | None:
    """Views per image of a view transform (None: not known before the data is read)."""
    try:
        n = getattr(_resolved(views, img), "num_views", None)
    except ValueError:  # its sizes are not resolved yet
        return None
    return n if isinstance(n, int) else None


def _view_sizes(views: Any, img: Any) -> dict[str, int]:
    """The crop sizes a view transform makes (a multi-crop's local size as it resolves it, its
    global size from the data's when not set)."""
    views = _resolved(views, img)
    sizes = {n: v for n in ("size", "global_size") if isinstance(v := getattr(views, n, None), int)}
    if "global_size" in sizes and hasattr(views, "resolved_local_size"):
        sizes["local_size"] = int(views.resolved_local_size)
    return sizes


def check_yaml_files(argv: list[str]) -> None:
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
            raise ConfigError(f"{path}: not valid YAML{where}: {one_line(str(problem))}") from None
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


# Backbone arguments that do not change the parameters' shapes: a run may continue with others.
_SHAPE_NEUTRAL = {"drop_path_rate", "drop_rate", "attn_drop_rate", "lean_backward"}


def check_continuable(model: BaseMethod, ckpt_path: str) -> None:
    """A checkpoint continues only a run of the same method and backbone: say so in one line,
    before Lightning's wall of missing and unexpected state-dict keys."""
    if not Path(ckpt_path).is_file():
        raise ConfigError(f"--ckpt_path {ckpt_path}: no such file")
    try:
        checkpoint = load_record(ckpt_path)  # memory-mapped: only the small record is read
    except Exception as err:  # not a checkpoint at all
        raise ConfigError(f"--ckpt_path {ckpt_path}: not a readable checkpoint ({type(err).__name__}: {one_line(str(err))})") from None
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


_NOISE = (
    "Does not validate against any of the Union subtypes",
    "Expected a <class 'NoneType'>",
    "Subtypes:",
    "Errors:",
    "Given value type:",
    "Given value:",
)


def one_line(message: str) -> str:
    """jsonargparse's nested explanation folded to the lines that name the problem."""
    lines = [ln.strip(" -") for ln in message.splitlines() if ln.strip(" -")]
    useful = [ln for ln in lines if not ln.startswith(_NOISE)]
    return "; ".join(dict.fromkeys(useful or lines)).replace(":; ", ": ")[:1000]
