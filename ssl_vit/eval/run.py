"""Evaluate one backbone by several protocols, extracting its features once.

This is what ``ssl-vit eval`` and the demo call: frozen features of the (train, test) splits,
then each feature-based protocol (linear, kNN, few-shot) on them, or fine-tuning, each written as
an :class:`~ssl_vit.eval.results.EvalResult`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, Subset

from ssl_vit.eval.features import FeatureMode, extract_features
from ssl_vit.eval.fewshot import FewShotEvaluator
from ssl_vit.eval.knn import KNNClassifier
from ssl_vit.eval.linear import LinearProbe
from ssl_vit.eval.results import EvalResult, backbone_info
from ssl_vit.training.progress import CountProgress

log = logging.getLogger(__name__)

FEATURE_PROTOCOLS = {"linear": LinearProbe, "knn": KNNClassifier, "fewshot": FewShotEvaluator}


def subsample(dataset: Dataset, size: int | None, seed: int = 0) -> Dataset:
    """A fixed random subset of ``size`` items (all of them when ``size`` is None or too large)."""
    if size is None or size >= len(dataset):
        return dataset
    if size < 1:
        raise ValueError(f"a subset needs at least one item, got {size}")
    idx = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:size].sort().values
    return Subset(dataset, idx.tolist())


def check_finite(features: Tensor, split: str) -> None:
    """Non-finite features (a diverged checkpoint) are an error rather than a meaningless score."""
    bad = int((~torch.isfinite(features).all(dim=1)).sum())
    if bad:
        raise ValueError(f"the backbone gives non-finite (NaN/Inf) features for {bad} of {len(features)} {split} images: "
                         "its weights are broken (a diverged run?); evaluate an earlier checkpoint")


def drop_unlabelled(features: Tensor, labels: Tensor, split: str) -> tuple[Tensor, Tensor]:
    """The rows with a label: an evaluation split's unreadable files come back labelled -1
    (``ImageFiles.for_evaluation``) and count neither in the training nor in the test set."""
    keep = labels >= 0  # [N]
    dropped = int((~keep).sum())
    if dropped == 0:
        return features, labels
    if dropped == len(labels):
        raise ValueError(f"no {split} image could be read or has a label")
    log.warning("evaluating without %d unreadable or unlabelled %s images", dropped, split)
    return features[keep], labels[keep]


PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a Lightning precision name (None: full float32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def names_a_record(out: str | Path) -> bool:
    """Whether ``out`` names one record file (``*.json``) rather than a folder of records."""
    return Path(out).suffix.lower() == ".json"


def result_path(out: str | Path, result: EvalResult) -> Path:
    """Where a result record goes: ``out`` itself when it names a ``.json`` file, else a file in
    the folder ``out`` named after the method, backbone, data (with an image folder's own
    folder) and protocol (and the representation when it is not [CLS]:
    ``..._linear-last4.json``; the encoder when it is not the method's default:
    ``dino_vit_small-16-student_...``).

    A file of that name holding another pretraining's record (``EvalResult.pretraining``: another
    checkpoint, or the same ``last.ckpt`` at another step) is kept: the record goes to the first
    of ``..._2.json``, ``..._3.json`` ... that is free or holds this pretraining's record, so
    evaluating a run again replaces its record and evaluating another run adds one."""
    if names_a_record(out):
        return Path(out)
    label = result.backbone_label.replace("/", "-") + (f"-{result.encoder}" if result.encoder else "")
    protocol = result.protocol + (f"-{result.features}" if result.features else "")
    data = result.data_label.replace(":", "-").replace("/", "-")
    stem = f"{result.method}_{label}_{data}_{protocol}"
    for n in itertools.count(1):
        path = Path(out) / (f"{stem}.json" if n == 1 else f"{stem}_{n}.json")
        if not path.exists() or _holds_pretraining(path, result.pretraining):
            return path
    raise AssertionError("unreachable")


def _holds_pretraining(path: Path, pretraining: tuple[Any, ...]) -> bool:
    try:
        return EvalResult.from_json(path).pretraining == pretraining
    except (OSError, ValueError):  # not a record (or not readable): not ours to replace
        return False


def evaluate_features(
    backbone: nn.Module,
    train_ds: Dataset,
    test_ds: Dataset,
    protocols: Mapping[str, Mapping[str, Any]],
    *,
    method: str,
    data: dict[str, Any],
    num_classes: int,
    feature_mode: FeatureMode = "cls",
    batch_size: int = 256,
    num_workers: int = 0,
    device: str | torch.device | None = None,
    precision: str = "32-true",
    source: str = "random",
    pretrain: dict[str, Any] | None = None,
    backbone_record: dict[str, Any] | None = None,
    out_dir: str | Path | None = None,
    progress_every_n_seconds: float = 60.0,
) -> list[EvalResult]:
    """Run the feature-based ``protocols`` (name -> constructor kwargs) on one backbone.

    Features of both splits are extracted once and shared by every protocol; ``precision``
    (Lightning's names: ``32-true``, ``bf16-mixed``, ``16-mixed``) is that of the extraction, which
    prints a line of progress every ``progress_every_n_seconds`` while it runs.
    """
    unknown = sorted(set(protocols) - set(FEATURE_PROTOCOLS))
    if unknown:
        raise ValueError(f"unknown feature protocol(s) {unknown}; known: {', '.join(FEATURE_PROTOCOLS)}")
    if out_dir is not None and len(protocols) > 1 and names_a_record(out_dir):
        raise ValueError(f"{len(protocols)} protocols write {len(protocols)} records: the output (--out) must be a folder, not the file {out_dir}")
    if device is not None:
        backbone = backbone.to(device)
    common = {"mode": feature_mode, "batch_size": batch_size, "num_workers": num_workers, "device": device,
              "autocast_dtype": autocast_dtype(precision)}

    def features_of(dataset: Dataset, split: str) -> tuple[Tensor, Tensor]:
        # A line a minute while it runs (an hour over ImageNet on a small GPU); silent when short.
        progress = CountProgress(f"features ({split})", total=len(dataset), every_n_seconds=progress_every_n_seconds)
        feats, labels = extract_features(backbone, dataset, progress=progress, **common)
        check_finite(feats, split)
        return drop_unlabelled(feats, labels, split)

    train_f, train_l = features_of(train_ds, "train")  # [N, F], [N]
    test_f, test_l = features_of(test_ds, "test")  # [M, F], [M]
    data = {**data, "train_size": len(train_l), "test_size": len(test_l)}
    results = []
    for name, kwargs in protocols.items():
        evaluator = FEATURE_PROTOCOLS[name](**kwargs)
        metrics = evaluator.evaluate(train_f, train_l, test_f, test_l, num_classes=num_classes)
        result = EvalResult(
            method=method,
            backbone=backbone_record or backbone_info(backbone),
            data=data,
            protocol=name,
            metrics=metrics,
            # (+ what the evaluation chose itself: a linear probe's LR from a sweep)
            protocol_args={**dict(kwargs), **getattr(evaluator, "record_args", {}), "features": feature_mode, "precision": precision},
            pretrain=dict(pretrain or {}),
            source=source,
        )
        if out_dir is not None:
            result.to_json(result_path(out_dir, result))
        results.append(result)
    return results
