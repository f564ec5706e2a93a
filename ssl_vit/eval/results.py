"""The record every evaluation writes: one JSON per (backbone, protocol) run, which ``ssl-vit
compare`` tabulates.

Metrics are fractions in [0, 1] (``top1``, ``top5``, ``5shot`` ...); summaries print them as
percentages. Example::

    EvalResult(method="dino", backbone={"name": "vit_tiny", "kwargs": {"patch_size": 4}},
               data={"name": "fashion_mnist"}, protocol="knn", metrics={"top1": 0.8123}).summary_line()
    # 'knn       dino  vit_tiny/4  fashion_mnist  top1=81.23%'
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from torch import nn

from ssl_vit import __version__
from ssl_vit.io import atomic_write_text

# linear_aug: the linear probe trained on augmented images (the papers' protocol, ``--augment``).
PROTOCOLS: tuple[str, ...] = ("linear", "linear_aug", "knn", "fewshot", "finetune")
# The number each protocol is compared by: top-1, and 5-shot for few-shot (ViT paper Fig. 5/6).
MAIN_METRIC: dict[str, str] = {"linear": "top1", "linear_aug": "top1", "knn": "top1", "fewshot": "5shot", "finetune": "top1"}


def method_order(method: str) -> tuple[int, str]:
    """How rows and legends sort methods: the pretext tasks by name, then the ``supervised`` and
    ``random`` baselines."""
    return ({"supervised": 1, "random": 2}.get(method, 0), method)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def backbone_info(model: nn.Module, encoder: str | None = None) -> dict[str, Any]:
    """``{"name", "kwargs"}`` of a backbone made by ``create_backbone`` (or the class name), and
    ``"encoder"`` when given: a checkpoint's encoder other than the method's default one (DINO's
    student, MoCo v3's momentum encoder), whose results are rows of their own."""
    name = getattr(model, "backbone_name", type(model).__name__)
    info = {"name": name, "kwargs": dict(getattr(model, "backbone_kwargs", {}))}
    return info if encoder is None else {**info, "encoder": encoder}


# The arguments that size a backbone of free shape (``vit``, ``hybrid``, a ResNet cut after a
# stage), with their tags in labels: two backbones of one name and another size are rows of their
# own in ``compare``, each compared only with a baseline of its own size.
SHAPE_TAGS: tuple[tuple[str, str], ...] = (
    ("resnet", "r{}"), ("num_stages", "S{}"), ("layers", "B{}"), ("embed_dim", "D{}"), ("depth", "L{}"), ("num_heads", "H{}"), ("mlp_ratio", "M{}"),
)


def shape_tags(kwargs: Mapping[str, Any]) -> list[str]:
    """The tags of the size arguments among a backbone's ``kwargs`` (:data:`SHAPE_TAGS`), in that
    order: ``{"resnet": "resnet18", "num_stages": 1, "embed_dim": 64}`` -> ``["r18", "S1", "D64"]``."""
    def text(value: Any) -> str:
        if isinstance(value, list | tuple):
            return ".".join(map(text, value))
        if isinstance(value, float):
            return f"{value:g}"
        return str(value).removeprefix("resnet")

    return [fmt.format(text(kwargs[key])) for key, fmt in SHAPE_TAGS if kwargs.get(key) is not None]


def data_label(data: Mapping[str, Any]) -> str:
    """A dataset record's name, with the (last two parts of the) folder an image-folder dataset
    was read from (``imagefolder:flowers/train``), since every such dataset has the one name."""
    folders = [data[k] for k in ("train_dir", "val_dir") if isinstance(data.get(k), str)]
    if not folders:
        return str(data["name"])
    return f"{data['name']}:" + "/".join(Path(folders[0]).parts[-2:])


def pretraining_data(record: Mapping[str, Any] | None) -> str | None:
    """The data a checkpoint was pretrained on, named as evaluation records name datasets
    (``fashion_mnist``, ``imagefolder:flowers/train``), from the checkpoint's data record (the
    datamodule's class name, an image folder's ``train_dir``); None when it records none."""
    if not record or not isinstance(record.get("name"), str):
        return None
    from ssl_vit.eval.data_args import dataset_name

    return data_label({**record, "name": dataset_name(record["name"], record.get("class"))})


def read_json(path: str | os.PathLike) -> Any:
    """The parsed content of a result file; a missing file or invalid JSON is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no result file at {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def chosen_encoder(info: Mapping[str, Any]) -> str | None:
    """The encoder a loaded checkpoint gave (``load_any_backbone``'s info) when it is not the one
    its method is evaluated with by default, else None."""
    from ssl_vit.export.sources import DEFAULT_WHICH

    which, method = info.get("which"), info.get("method")
    default = info.get("default_which") or DEFAULT_WHICH.get(method or "", "student")
    return which if which and which != default else None


@dataclass
class EvalResult:
    """One evaluation of one backbone by one protocol.

    Attributes:
        method: the pretext method (``"mpp"``, ``"mocov3"``, ``"dino"`` ...), ``"supervised"``
            or ``"random"`` (untrained weights: the lower bound).
        backbone: ``{"name": registry name, "kwargs": create_backbone kwargs}``.
        data: ``{"name": dataset, ...}`` plus e.g. ``train_split``, ``test_split``, ``train_size``,
            ``test_size``.
        protocol: ``"linear"``, ``"linear_aug"`` (the probe trained on augmented images),
            ``"knn"``, ``"fewshot"`` or ``"finetune"``.
        metrics: name -> value, accuracies as fractions in [0, 1].
        protocol_args: the protocol's settings (k, T, epochs, feature mode ...).
        pretrain: what the backbone cost and what it was pretrained on: ``steps``, ``epochs``,
            ``flops``, ``wall_time_s``, ``global_batch_size``, ``data``, ``checkpoint`` (the
            absolute path of the checkpoint, also for an export of it) (any subset).
        source: checkpoint or export path the backbone came from, or ``"random"``.
        created: ISO-8601 time of the evaluation (UTC).
        ssl_vit_version: the package version that wrote the record.
    """

    method: str
    backbone: dict[str, Any]
    data: dict[str, Any]
    protocol: str
    metrics: dict[str, float]
    protocol_args: dict[str, Any] = field(default_factory=dict)
    pretrain: dict[str, Any] = field(default_factory=dict)
    source: str = "random"
    created: str = field(default_factory=_now)
    ssl_vit_version: str = __version__

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"EvalResult.method must be a non-empty string, got {self.method!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"EvalResult.protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        for name in ("backbone", "data", "metrics", "protocol_args", "pretrain"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"EvalResult.{name} must be a dict, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"EvalResult.source must be a non-empty string (a path or 'random'), got {self.source!r}")
        for name in ("backbone", "data"):
            if not isinstance(getattr(self, name).get("name"), str):
                raise ValueError(f"EvalResult.{name} needs a string 'name' entry, got {getattr(self, name)!r}")
        self.backbone.setdefault("kwargs", {})
        metrics = {}
        for k, v in self.metrics.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"metric {k!r} must be a finite number, got {v!r}")
            metrics[str(k)] = float(v)
        self.metrics = metrics

    # --------------------------------------------------------------------- labels
    @property
    def backbone_label(self) -> str:
        """``name/patch`` (``vit_tiny/4``) when a patch size was given, else the name; with the
        arguments that set the size of a backbone of free shape (:func:`shape_tags`):
        ``vit-D128-L4-H4/7``, ``hybrid-r18-S1-D64-L4-H2``, ``resnet50-S3``."""
        kwargs = self.backbone.get("kwargs", {})
        name = "-".join([self.backbone["name"], *shape_tags(kwargs)])
        patch = kwargs.get("patch_size")
        return f"{name}/{patch}" if patch is not None else name

    @property
    def features(self) -> str | None:
        """The representation evaluated when it is not the default [CLS] token (``last4``,
        ``avg``), else None: results on different representations are different rows."""
        mode = self.protocol_args.get("features")
        return None if mode in (None, "cls") else str(mode)

    @property
    def encoder(self) -> str | None:
        """A checkpoint's encoder other than the method's default one (``student`` of DINO), else None."""
        return self.backbone.get("encoder")

    @property
    def comparable_label(self) -> str:
        """The backbone label with the representation when not [CLS]: ``vit_tiny/4 [last4]``; a
        baseline row with this label is what a row is compared against."""
        return self.backbone_label + (f" [{self.features}]" if self.features else "")

    @property
    def label(self) -> str:
        """``comparable_label`` with the encoder when not the default: ``vit_tiny/4 [student]``."""
        if self.encoder is None:
            return self.comparable_label
        tags = [self.encoder, *([self.features] if self.features else [])]
        return f"{self.backbone_label} [{', '.join(tags)}]"

    @property
    def data_label(self) -> str:
        """The dataset evaluated on (:func:`data_label`)."""
        return data_label(self.data)

    @property
    def pretraining(self) -> tuple[str, Any]:
        """Which pretraining the backbone came from: its checkpoint (``pretrain.checkpoint``, the
        same for an export of it; else ``source``; ``random``) and the step it was saved at. Records of one method, backbone
        and dataset from different pretrainings (another run, or the same run's ``last.ckpt``
        further on) are rows of their own in ``compare`` and files of their own in a results
        folder."""
        return (os.path.normpath(self.pretrain.get("checkpoint") or self.source), self.pretrain.get("steps"))

    @property
    def main_metric(self) -> float | None:
        """The protocol's headline number (``MAIN_METRIC``), or ``None`` when absent."""
        return self.metrics.get(MAIN_METRIC[self.protocol])

    def summary_line(self) -> str:
        """e.g. ``knn       dino  vit_tiny/4  fashion_mnist  top1=81.23% top5=99.10%``."""
        shown = [f"{k}={100 * v:.2f}%" for k, v in self.metrics.items() if not k.endswith("_std")]
        picked = self.protocol_args.get("selected_base_lr")
        if picked is not None:  # a linear probe's LR sweep
            swept = self.protocol_args.get("base_lr")
            shown.append(f"(base_lr {picked:g}, picked of {' '.join(f'{lr:g}' for lr in swept) if isinstance(swept, list) else swept})")
        picked_k = self.protocol_args.get("selected_k")
        if picked_k is not None:  # a kNN's k sweep
            shown.append(f"(k {picked_k}, picked of {' '.join(map(str, self.protocol_args.get('k', [])))})")
        return f"{self.protocol:<9} {self.method}  {self.label}  {self.data_label}  {' '.join(shown)}"

    # ------------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "result") -> EvalResult:
        """Build from a parsed JSON object; unknown or missing fields are errors."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; an EvalResult has {', '.join(fields)}")
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in d]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        try:
            return cls(**d)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write atomically: a temporary file in the same folder, then ``os.replace``, so a
        reader (or a crash) never sees half a record."""
        # default=str: settings such as torch dtypes are recorded by name
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2, default=str) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> EvalResult:
        path = Path(path)
        return cls.from_dict(read_json(path), where=str(path))
