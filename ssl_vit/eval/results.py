"""The result every evaluation writes, one JSON per (backbone, protocol), which ``ssl-vit compare``
tabulates; and the names results give backbones and datasets. Metrics are fractions in [0, 1]::

    EvalResult("dino", {"name": "vit_tiny", "kwargs": {"patch_size": 4}}, {"name": "fashion_mnist"}, "knn", {"top1": 0.8123}).summary_line()
    # 'knn       dino  vit_tiny/4  fashion_mnist  top1=81.23%'
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ssl_vit import __version__
from ssl_vit.io import atomic_write_text, read_json

if TYPE_CHECKING:
    from torch import Tensor, nn

# The number each protocol is compared by: top-1, and 5-shot for few-shot (ViT paper Fig. 5/6).
MAIN_METRIC: dict[str, str] = {"linear": "top1", "linear_aug": "top1", "knn": "top1", "fewshot": "5shot", "finetune": "top1"}
PROTOCOLS: tuple[str, ...] = tuple(MAIN_METRIC)
# A datamodule as ``--data`` and results name it.
DATASETS: dict[str, str] = {"fashion_mnist": "FashionMNISTDataModule", "cifar10": "CIFAR10DataModule", "cifar100": "CIFAR100DataModule",
                            "stl10": "STL10DataModule", "imagefolder": "ImageFolderDataModule", "synthetic": "SyntheticDataModule"}
# The arguments that size a backbone of free shape, and their tags in its label (``vit-D128-L4``).
SHAPE_TAGS = {"resnet": "r{}", "num_stages": "S{}", "layers": "B{}", "embed_dim": "D{}", "depth": "L{}", "num_heads": "H{}", "mlp_ratio": "M{}"}


def topk_accuracy(scores: Tensor, labels: Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[str, float]:
    """``{"top{k}": the share of rows of scores [Q, C] whose label is among their k highest}``, for
    the k up to the class count (top-5 of 3 classes means nothing)."""
    ranked = scores.topk(min(max(ks), scores.shape[1]), dim=1).indices  # [Q, k], best first
    hits = ranked == labels.to(scores.device).long()[:, None]  # [Q, k]
    return {f"top{k}": hits[:, :k].any(dim=1).float().mean().item() for k in ks if k <= scores.shape[1]}


def held_out(n: int, fraction: float, seed: int | None) -> tuple[Tensor, Tensor]:
    """A sweep's seeded split of ``range(n)``: the ``fraction`` (at least one) held out, and the rest."""
    import torch

    perm, held = torch.randperm(n, generator=torch.Generator().manual_seed(seed or 0)), max(1, round(fraction * n))
    return perm[:held], perm[held:]


def method_order(method: str) -> tuple[int, str]:
    """Rows and legends list the pretext methods by name, then ``supervised`` and ``random``."""
    return ({"supervised": 1, "random": 2}.get(method, 0), method)


def backbone_info(model: nn.Module, encoder: str | None = None) -> dict[str, Any]:
    """``{"name", "kwargs"[, "encoder": one other than the method's default]}`` of a backbone."""
    info = {"name": getattr(model, "backbone_name", type(model).__name__), "kwargs": dict(getattr(model, "backbone_kwargs", {}))}
    return info if encoder is None else {**info, "encoder": encoder}


def dataset_name(class_name: str, path: str | None = None) -> str:
    """``FashionMNISTDataModule`` -> ``fashion_mnist``; one's own (even named like a built-in) by its import path."""
    builtin = path is None or path.startswith("ssl_vit.data.")
    return next((name for name, cls in DATASETS.items() if cls == class_name and builtin), path or class_name)


def datamodule_name(datamodule: Any) -> str:
    return dataset_name(type(datamodule).__name__, f"{type(datamodule).__module__}.{type(datamodule).__qualname__}")


def data_label(data: Mapping[str, Any]) -> str:
    """A dataset's name, with the last two parts of an image folder's folder (``imagefolder:flowers/train``)."""
    folders = [data[k] for k in ("train_dir", "val_dir") if isinstance(data.get(k), str)]
    return str(data["name"]) + (":" + "/".join(Path(folders[0]).parts[-2:]) if folders else "")


def pretraining_data(data: Mapping[str, Any] | None) -> str | None:
    """The data a checkpoint's data record names, as results name datasets; None when it names none."""
    return data_label({**data, "name": dataset_name(data["name"], data.get("class"))}) if data and isinstance(data.get("name"), str) else None


@dataclasses.dataclass
class EvalResult:
    """One evaluation of one backbone by one protocol: the ``method`` (``dino`` ..., ``supervised`` or
    ``random``), ``backbone`` (``{"name", "kwargs"[, "encoder"]}``), ``data``, the ``protocol``'s
    ``metrics`` and settings (with what a sweep picked), what the backbone cost and was pretrained
    on (``pretrain``), its ``source`` (a checkpoint, an export or ``"random"``)."""

    method: str
    backbone: dict[str, Any]
    data: dict[str, Any]
    protocol: str
    metrics: dict[str, float]
    protocol_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    pretrain: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = "random"
    created: str = dataclasses.field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    ssl_vit_version: str = __version__

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"EvalResult.protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"EvalResult.source must be a non-empty string (a path or 'random'), got {self.source!r}")
        for name in ("backbone", "data"):
            if not isinstance(getattr(self, name).get("name"), str):
                raise ValueError(f"EvalResult.{name} needs a string 'name' entry, got {getattr(self, name)!r}")
        for k, v in self.metrics.items():  # (a NaN would sort and plot as a number)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"metric {k!r} must be a finite number, got {v!r}")
        self.backbone.setdefault("kwargs", {})
        self.metrics = {str(k): float(v) for k, v in self.metrics.items()}

    @property
    def backbone_label(self) -> str:
        """``vit_tiny/4`` (name/patch), with the size of a backbone of free shape: ``vit-D128-L4-H4/7``."""
        def text(v: Any) -> str:
            return ".".join(map(text, v)) if isinstance(v, list | tuple) else f"{v:g}" if isinstance(v, float) else str(v).removeprefix("resnet")

        kwargs = self.backbone["kwargs"]
        name = "-".join([self.backbone["name"], *(tag.format(text(kwargs[k])) for k, tag in SHAPE_TAGS.items() if kwargs.get(k) is not None)])
        return name if kwargs.get("patch_size") is None else f"{name}/{kwargs['patch_size']}"

    @property
    def features(self) -> str | None:
        """The representation when not [CLS] (``last4``, ``avg``): results on it are rows of their own."""
        return None if self.protocol_args.get("features") in (None, "cls") else str(self.protocol_args["features"])

    @property
    def encoder(self) -> str | None:
        return self.backbone.get("encoder")

    @property
    def comparable_label(self) -> str:
        """``vit_tiny/4 [last4]``: a row is compared with the baseline's row of this label."""
        return self.backbone_label + (f" [{self.features}]" if self.features else "")

    @property
    def label(self) -> str:
        """``vit_tiny/4 [student, last4]``: the comparable label with the encoder when not the default."""
        tags = [t for t in (self.encoder, self.features) if t]
        return f"{self.backbone_label} [{', '.join(tags)}]" if self.encoder else self.comparable_label

    @property
    def data_label(self) -> str:
        return data_label(self.data)

    @property
    def pretraining(self) -> tuple[str, Any]:
        """The backbone's pretraining (checkpoint, step): results of others are rows and files of their own."""
        return (os.path.normpath(self.pretrain.get("checkpoint") or self.source), self.pretrain.get("steps"))

    @property
    def main_metric(self) -> float | None:
        return self.metrics.get(MAIN_METRIC[self.protocol])

    def summary_line(self) -> str:
        """``knn       dino  vit_tiny/4  fashion_mnist  top1=81.23% top5=99.10%`` (and a sweep's pick)."""
        shown, args = [f"{k}={100 * v:.2f}%" for k, v in self.metrics.items() if not k.endswith("_std")], self.protocol_args
        if args.get("selected_base_lr") is not None:
            swept = " ".join(f"{lr:g}" for lr in args["base_lr"]) if isinstance(args.get("base_lr"), list) else args.get("base_lr")
            shown.append(f"(base_lr {args['selected_base_lr']:g}, picked of {swept})")
        if args.get("selected_k") is not None:
            shown.append(f"(k {args['selected_k']}, picked of {' '.join(map(str, args.get('k', [])))})")
        return f"{self.protocol:<9} {self.method}  {self.label}  {self.data_label}  {' '.join(shown)}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "result") -> EvalResult:
        """From a parsed JSON object; unknown or missing fields are errors naming ``where``."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if unknown := sorted(set(d) - set(fields)):
            raise ValueError(f"{where}: unknown field(s) {unknown}; an EvalResult has {', '.join(fields)}")
        if missing := [n for n, f in fields.items() if f.default is f.default_factory is dataclasses.MISSING and n not in d]:
            raise ValueError(f"{where}: missing field(s) {missing}")
        try:
            return cls(**d)
        except (ValueError, AttributeError) as err:  # (AttributeError: a field that is no object)
            raise ValueError(f"{where}: {err}") from None

    def to_json(self, path: str | os.PathLike) -> Path:
        """Written atomically: a reader (or a crash) never sees half a result."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2, default=str) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> EvalResult:
        return cls.from_dict(read_json(path), where=str(path))


def names_a_file(out: str | Path) -> bool:
    """Whether ``out`` names one result file (``*.json``) rather than a folder of them."""
    return Path(out).suffix.lower() == ".json"


def result_path(out: str | Path, result: EvalResult) -> Path:
    """``out`` itself when it names a ``.json`` file, else the first free ``out/<method>_<backbone>_<data>_<protocol>.json``,
    ``..._2.json`` ... or the one of this pretraining (evaluating a run again replaces its result)."""
    if names_a_file(out):
        return Path(out)
    label = result.backbone_label.replace("/", "-") + (f"-{result.encoder}" if result.encoder else "")
    stem = f"{result.method}_{label}_{result.data_label.replace(':', '-').replace('/', '-')}_{result.protocol}"
    stem += f"-{result.features}" if result.features else ""
    if result.protocol_args.get("few_labels"):  # (Evaluation.few_labels: one result per number of labels and draw)
        stem += f"_{result.data['train_size']}-labels-draw{result.protocol_args['seed']}"
    for n in itertools.count(1):
        path = Path(out) / (f"{stem}.json" if n == 1 else f"{stem}_{n}.json")
        try:
            if not path.exists() or EvalResult.from_json(path).pretraining == result.pretraining:
                return path
        except (OSError, ValueError):  # not a result: not ours to replace
            continue
    raise AssertionError("unreachable")
