"""Options the commands share: the data (``--data NAME`` or a datamodule's dotted path, with
``--data-arg KEY=VALUE`` read as a recipe's ``data.init_args``), JSON objects, and output folders
that must take a file before any work starts. No torch at module level: ``--help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from ssl_vit.errors import did_you_mean, one_line
from ssl_vit.eval.results import DATASETS


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object such as ``'{"img_size": 28}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not a JSON object: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object such as '{\"img_size\": 28}'")
    return value


def key_value(text: str) -> tuple[str, str]:
    """An argparse type: ``KEY=VALUE``, split at the first ``=``."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), value


def datamodule_class(name: str, option: str = "--data") -> type:
    """The datamodule of a name (:data:`~ssl_vit.eval.results.DATASETS`) or of a dotted path
    (``mypkg.data.Flowers``: an ``ImageDataModule`` subclass, with ``eval_datasets()``)."""
    import ssl_vit.data as data

    if name in DATASETS:
        return getattr(data, DATASETS[name])
    module, _, attr = name.rpartition(".")
    known = f"{', '.join(sorted(DATASETS))}, or the dotted path of a datamodule class"
    if not module:
        raise ValueError(f"{option} {name}: not a dataset name{did_you_mean(name, DATASETS)} ({known})")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{option} {name}: cannot import it ({type(err).__name__}: {err}); {option} takes {known}") from None
    if not isinstance(cls, type) or not hasattr(cls, "eval_datasets"):
        raise ValueError(f"{option} {name}: not a datamodule class with eval_datasets() (an ImageDataModule subclass)")
    return cls


def parse_data_args(name: str, given: dict[str, str], option: str = "--data") -> dict[str, Any]:
    """The ``--data-arg`` values of datamodule ``name``, typed as jsonargparse reads a recipe's
    ``data.init_args``: YAML (``64`` a number, ``null`` or nothing None, ``[0.5]`` a list) where
    the datamodule takes no text (``train_dir=2024`` stays a folder's name)."""
    from jsonargparse import ArgumentError, ArgumentParser

    cls, parser = datamodule_class(name, option), ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, skip={"views"})
    params = list(parser.get_defaults().keys())
    if unknown := sorted(set(given) - set(params)):
        hint = did_you_mean(unknown[0], params) if len(unknown) == 1 else ""
        raise ValueError(f"{option} {name} takes no argument {', '.join(unknown)}{hint}; its arguments: {', '.join(params)}")
    if missing := [n for n, p in inspect.signature(cls).parameters.items() if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   and n not in given]:
        raise ValueError(f"{option} {name} needs " + " ".join(f"--data-arg {m}=..." for m in missing))
    try:
        return parser.parse_args([f"--{k}={v if v.strip() else 'null'}" for k, v in given.items()], defaults=False).as_dict()
    except ArgumentError as err:
        raise ValueError(re.sub(r'^Parser key "(\w+)":', r"--data-arg \1:", one_line(str(err)))) from None


def build_datamodule(name: str, backbone: Any, info: dict[str, Any], given: dict[str, Any], img_size: int | None = None,
                     option: str = "--data") -> Any:
    """The named datamodule feeding ``backbone`` what it was trained on (``backbone_data_args``),
    at ``img_size`` when given; ``given``: the ``--data-arg`` values (:func:`parse_data_args`), which win."""
    from ssl_vit.eval.evaluate import backbone_data_args

    return datamodule_class(name, option)(**{**backbone_data_args(backbone, info), **({"img_size": img_size} if img_size else {}), **given})


def note_channel_conversion(dataset: Any, in_chans: int, prog: str, what: str) -> None:
    """One note when colour images go to a 1-channel backbone, read from the split's first image
    (an unreadable file's 1x1 stand-in says nothing)."""
    source = getattr(dataset, "source", None)
    if in_chans == 1 and source is not None and len(source):
        image, _ = source[0]
        if getattr(image, "mode", "L") != "L" and getattr(image, "size", None) != (1, 1):
            print(f"{prog}: note: {what} holds {image.mode} images: they are converted to grey, the backbone's 1 input channel", file=sys.stderr)


def check_output_folder(folder: str | Path, what: str, create: bool = False) -> None:
    """``folder`` (``what`` names its option) can take the output, found before any work rather
    than after it: its nearest existing folder takes a file (a write is tried); ``create``: made."""
    path = Path(folder).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what}: {folder} exists and is not a folder")
    if not (existing := next(p for p in [path, *path.parents] if p.exists())).is_dir():
        raise ValueError(f"{what}: cannot create the folder {folder}: {existing} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".ssl-vit-write-check-"):
            pass
        if create:
            path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"{what}: cannot write into the folder {existing} ({err.strerror or err})") from None


def check_out(out: str, create: bool = False) -> None:
    """``--out``: a folder of results, or a result file (``*.json``) in one, that can be written."""
    path, is_file = Path(out).expanduser(), Path(out).suffix.lower() == ".json"
    if is_file and path.is_dir():
        raise ValueError(f"--out {out}: is a folder; a name ending in .json names the result file itself")
    if not is_file and path.exists() and not path.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder; name a folder for the results, or a result file ending in .json")
    check_output_folder(path.parent if is_file else path, f"--out {out}", create)


def check_export(export: str, backbone: str, create: bool = False) -> None:
    """``--export DIR``: a folder in a folder that can be written, and not the export ``--backbone``
    reads (the fine-tuned model would replace the pretrained one)."""
    path, source = Path(export).expanduser(), Path(backbone).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--export {export}: exists and is not a directory; name a folder")
    source = source if source.is_dir() else source.parent
    if path.is_dir() and source.resolve() == path.resolve() and (source / "config.json").is_file():
        raise ValueError(f"--export {export}: is the export --backbone reads; the fine-tuned model would replace the pretrained one: name another folder")
    check_output_folder(path if path.is_dir() else path.parent, f"--export {export}", create)
