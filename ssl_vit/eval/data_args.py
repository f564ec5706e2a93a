"""The dataset an evaluation or a figure reads, as the command line names it: ``--data NAME``
(or a datamodule's dotted path) and ``--data-arg KEY=VALUE``, read by the datamodule's own
arguments, and what is said about the data before any feature is extracted.

Nothing here imports torch at module level: ``ssl-vit eval --help`` stays fast."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from ssl_vit.errors import did_you_mean, init_parameters

DATASETS = {
    "fashion_mnist": "FashionMNISTDataModule",
    "cifar10": "CIFAR10DataModule",
    "cifar100": "CIFAR100DataModule",
    "stl10": "STL10DataModule",
    "imagefolder": "ImageFolderDataModule",
    "synthetic": "SyntheticDataModule",
}


def dataset_name(class_name: str, path: str | None = None) -> str:
    """``FashionMNISTDataModule`` -> ``fashion_mnist``: a datamodule as ``--data`` names it (and
    result records do); one of the user's by its import path (``mypkg.data.Flowers``, as
    ``--data`` takes it) when known, else its class name. A class of the user's named like a
    built-in one (``mypkg.CIFAR10DataModule``) keeps its import path: its records are not CIFAR-10's."""
    builtin = path is None or path.startswith("ssl_vit.data.")
    return next((name for name, cls in DATASETS.items() if cls == class_name and builtin), path or class_name)


def class_path(cls: type) -> str:
    """``mypkg.data.Flowers``: where a class is imported from."""
    return f"{cls.__module__}.{cls.__qualname__}"


def datamodule_name(datamodule: Any) -> str:
    """A datamodule's name in result records: ``fashion_mnist`` (as ``ssl-vit eval --data`` names
    it), or a datamodule of one's own by its import path, so that ``compare`` puts a recipe's
    records beside those of ``ssl-vit eval``."""
    return dataset_name(type(datamodule).__name__, class_path(type(datamodule)))


def key_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), ArgText(value)  # (read by parse_data_args, which knows the datamodule)


def datamodule_class(name: str, option: str = "--data") -> type:
    """The datamodule class of a name (``fashion_mnist``: ``DATASETS``) or of a dotted path
    (``mypkg.data.Flowers``, any ``ImageDataModule``-like class with ``eval_datasets()``)."""
    import importlib

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


class ArgText(str):
    """A ``--data-arg`` value as typed: read as YAML (``64`` a number, ``true`` a flag, ``null``)
    unless the datamodule takes text there (``train_dir=2024`` stays the folder name)."""


def parse_data_args(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``--data-arg`` values of datamodule ``name`` as its ``__init__`` takes them, each
    checked against a plain annotation (int, float, bool, str or an Optional of one)."""
    from ssl_vit.errors import annotations_of, check_argument_types, plain_type

    cls = datamodule_class(name)
    hints = annotations_of(cls)
    values: dict[str, Any] = {}
    for key, value in extra.items():
        if isinstance(value, ArgText):
            kind, optional = plain_type(hints.get(key)) or (None, False)
            if optional and value.strip() in ("null", "~", "None", ""):
                value = None
            elif kind is str:
                value = str(value)  # text stays text (train_dir=2024)
            else:
                parsed = yaml.safe_load(value)
                if kind is float and isinstance(parsed, str):  # YAML 1.1 reads 1e-3 as text
                    try:
                        parsed = float(parsed)
                    except ValueError:
                        pass
                value = parsed
        values[key] = value
    try:
        check_argument_types(cls, values, "--data-arg ")
    except TypeError as err:
        raise ValueError(str(err)) from None
    return values


def build_datamodule(name: str, backbone: Any, info: dict[str, Any], extra: dict[str, Any], train_subset: int | None, img_size: int | None = None,
                     option: str = "--data") -> Any:
    """The named datamodule at the backbone's resolution and channels, normalised as in pretraining.
    ``extra`` holds the ``--data-arg`` values as :func:`parse_data_args` reads them, checked
    against the datamodule's arguments; ``option`` is the command's option that names the data
    (in its messages)."""
    cls = datamodule_class(name)
    kwargs: dict[str, Any] = {"img_size": img_size or backbone.img_size[0], "in_chans": backbone.in_chans, "subset": train_subset}
    # The statistics the backbone was trained with when it records them, ImageNet's for foreign
    # 3-channel weights that record none (what timm's expect); else (a random initialisation,
    # nothing known) the dataset's own, as the pretrained backbones of that dataset recorded.
    source = str(info.get("normalization_source") or "")
    recorded = not source.startswith("default")
    foreign_imagenet = source.startswith("default (ImageNet") and info.get("kind") != "random"
    if info.get("mean") is not None and (recorded or foreign_imagenet):
        kwargs["mean"], kwargs["std"] = tuple(info["mean"]), tuple(info["std"])
    kwargs.update(extra)
    params = init_parameters(cls)
    unknown = sorted(set(extra) - set(params))
    if unknown:
        hint = did_you_mean(unknown[0], [p for p in params if p != "views"]) if len(unknown) == 1 else ""
        raise ValueError(f"{option} {name} takes no argument {', '.join(unknown)}{hint}; its arguments: {', '.join(p for p in params if p != 'views')}")
    missing = [n for n, p in params.items() if p.default is p.empty and n not in kwargs]
    if missing:
        raise ValueError(f"{option} {name} needs " + " ".join(f"--data-arg {m}=..." for m in missing))
    return cls(**kwargs)


def labelled_classes(dataset: Any) -> int | None:
    """How many classes the labelled images of an evaluation split (``eval_datasets``, or a
    ``Subset`` of one: ``--test-subset``) hold; None when its images do not list their labels."""
    import torch
    from torch.utils.data import Subset

    indices = None
    if isinstance(dataset, Subset):
        indices, dataset = dataset.indices, dataset.dataset
    labels = getattr(getattr(dataset, "source", None), "labels", None)
    if labels is None:
        return None
    labels = torch.as_tensor(labels)
    if indices is not None:
        labels = labels[torch.as_tensor(list(indices), dtype=torch.long)]
    return int(labels[labels >= 0].unique().numel())


def note_channel_conversion(dataset: Any, in_chans: int, prog: str, what: str) -> None:
    """One note on stderr when colour images go to a 1-channel backbone (converted to grey), read
    from the split's first image."""
    source = getattr(dataset, "source", None)
    if in_chans != 1 or source is None or len(source) == 0:
        return
    image, _ = source[0]
    if getattr(image, "mode", "L") != "L" and getattr(image, "size", None) != (1, 1):  # (1x1: an unreadable file's stand-in)
        print(f"{prog}: note: {what} holds {image.mode} images: they are converted to grey, the backbone's 1 input channel", file=sys.stderr)
