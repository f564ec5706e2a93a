"""The ``evaluate`` section of a recipe: frozen-feature evaluations of the backbone a run ends
with, so that one ``ssl-vit fit`` runs a whole experiment (pretraining, then the linear probe /
kNN / few-shot records that ``ssl-vit compare`` tabulates).

It evaluates exactly what ``ssl-vit eval`` would: the backbone is loaded from the run's final
``last.ckpt`` (DINO: its teacher, as ``ssl-vit eval`` defaults to), the splits are the run's
datamodule's ``eval_datasets()``, and each protocol writes its own result record::

    evaluate:
      protocols: [linear, knn]
      linear: {epochs: 100, base_lr: 0.01}
      knn: {k: 20, temperature: 0.07}
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

import lightning as L

Protocol = Literal["linear", "knn", "fewshot"]


class RecipeEvaluation:
    """Evaluations run after a finished fit (none by default).

    Args:
        protocols: which frozen-feature protocols to run: ``linear``, ``knn``, ``fewshot``.
        features: the representation: ``cls``, ``last4`` (DINO's linear protocol for ViT-S),
            ``avg`` or ``cls_avg`` (DINO's for ViT-B).
        which: the checkpoint's encoder to evaluate (``teacher``, ``student``, ``momentum``, or
            ``NAME`` for a method's ``NAME_backbone``); None: the method's default (DINO's
            teacher, otherwise the online backbone).
        linear: arguments of ``LinearProbe`` (its defaults where not given).
        knn: arguments of ``KNNClassifier``.
        fewshot: arguments of ``FewShotEvaluator``.
        out: folder of the result records; None: ``<default_root_dir>/results``.
        batch_size: images per forward pass of the feature extraction.
        train_subset: fit the probe / fill the kNN bank with a fixed random subset of this many
            training images (None: all), drawn from the run's training split (``data.subset``
            when the run trained on a subset).
        test_subset: evaluate on a fixed random subset of this many test images (None: all).
        seed: of those subsets and of the linear probe and few-shot draws.
    """

    def __init__(
        self,
        protocols: list[Protocol] | None = None,
        features: Literal["cls", "last4", "avg", "cls_avg"] = "cls",
        which: str | None = None,
        linear: dict[str, Any] | None = None,
        knn: dict[str, Any] | None = None,
        fewshot: dict[str, Any] | None = None,
        out: str | None = None,
        batch_size: int = 256,
        train_subset: int | None = None,
        test_subset: int | None = None,
        seed: int = 0,
    ) -> None:
        self.protocols = list(protocols or [])
        self.features = features
        self.which = which
        self.kwargs = {"linear": dict(linear or {}), "knn": dict(knn or {}), "fewshot": dict(fewshot or {})}
        self.out = out
        self.batch_size = batch_size
        self.train_subset = train_subset
        self.test_subset = test_subset
        self.seed = seed
        # Build each evaluator now: a misspelt or invalid argument fails before the training,
        # not after it.
        from ssl_vit.eval.run import FEATURE_PROTOCOLS

        given = [p for p, kwargs in self.kwargs.items() if kwargs]  # settings of protocols not run are checked too
        for protocol in dict.fromkeys([*self.protocols, *given]):
            try:
                FEATURE_PROTOCOLS[protocol](**self.protocol_kwargs(protocol))
            except (TypeError, ValueError) as err:
                raise ValueError(f"evaluate.{protocol}: {err}") from None
        unused = [p for p in given if p not in self.protocols]
        if unused:
            print(f"ssl-vit fit: note: evaluate has settings for {', '.join(unused)}, which evaluate.protocols "
                  f"({', '.join(self.protocols) or 'none'}) does not run", file=sys.stderr)

    def check_model(self, model: Any) -> None:
        """What can be checked against the model before training (not after hours of it): the
        encoder ``which`` names exists in this method's checkpoints, and the backbone has the
        representation ``features`` reads."""
        if not self.protocols:
            return
        from ssl_vit.eval.features import feature_dim
        from ssl_vit.export.sources import encoder_prefix, encoders_in, normalize_which

        which = normalize_which(self.which)
        if which is not None and not hasattr(model, encoder_prefix(which).rstrip(".")):
            held = encoders_in([f"{name}." for name, _ in model.named_children()])
            raise ValueError(f"evaluate.which: a {type(model).__name__} checkpoint has no {which} backbone "
                             f"({encoder_prefix(which)}*); it holds {', '.join(held)}")
        try:
            feature_dim(model.backbone, self.features)
        except ValueError as err:
            raise ValueError(f"evaluate.features: {err}") from None

    def check_data(self, datamodule: L.LightningDataModule) -> None:
        """What the evaluators need of a training split whose size the recipe fixes (the run's
        ``data.subset``, from which ``evaluate.train_subset`` draws), checked before the training
        rather than after it: kNN's ``k`` neighbours and few-shot's largest number of shots of
        every class. (Without a fixed size, checking would mean reading the data first.)"""
        sizes = [n for n in (getattr(datamodule, "subset", None), self.train_subset) if n is not None]
        if not sizes or not self.protocols:
            return
        n = min(sizes)
        whence = "data.subset" if n == getattr(datamodule, "subset", None) else "evaluate.train_subset"
        from ssl_vit.eval.run import FEATURE_PROTOCOLS

        if "knn" in self.protocols:
            k = FEATURE_PROTOCOLS["knn"](**self.protocol_kwargs("knn")).k
            if k > n:
                raise ValueError(f"evaluate.knn: k={k} neighbours, but the kNN bank holds the {n} training images of {whence}; "
                                 f"set evaluate.knn {{k: {n}}} or fewer, or a larger {whence}")
        num_classes = getattr(datamodule, "num_classes", None)
        if "fewshot" in self.protocols and num_classes:
            shots = max(FEATURE_PROTOCOLS["fewshot"](**self.protocol_kwargs("fewshot")).shots)
            if shots * int(num_classes) > n:
                most = n // int(num_classes)
                fix = f"set evaluate.fewshot shots to at most {most}, or a larger {whence}" if most else f"a larger {whence}"
                raise ValueError(f"evaluate.fewshot: {shots}-shot needs {shots} training images of each of the {num_classes} classes, "
                                 f"more than the {n} of {whence}; {fix}")

    def run(self, checkpoint: str | Path, datamodule: L.LightningDataModule, trainer: L.Trainer) -> list[Any]:
        """Evaluate the backbone of ``checkpoint`` on ``datamodule``'s splits; returns the records."""
        if not self.protocols:
            return []
        from ssl_vit.eval.results import backbone_info, chosen_encoder
        from ssl_vit.eval.run import evaluate_features, subsample
        from ssl_vit.export import load_any_backbone

        eval_datasets = getattr(datamodule, "eval_datasets", None)
        if eval_datasets is None:
            raise ValueError(f"evaluate: {type(datamodule).__name__} has no eval_datasets() to evaluate on")
        train_ds, test_ds = eval_datasets()
        num_classes = getattr(datamodule, "num_classes", None)
        if test_ds is None or not num_classes:
            raise ValueError(f"evaluate: {type(datamodule).__name__} has no labelled test split to evaluate on")
        train_ds, test_ds = subsample(train_ds, self.train_subset, self.seed), subsample(test_ds, self.test_subset, self.seed)
        backbone, info = load_any_backbone(checkpoint, which=self.which)
        data = {"name": datamodule_name(datamodule), "subset": getattr(datamodule, "subset", None)}
        for key in ("train_dir", "val_dir"):  # an image folder's folders, as `ssl-vit eval --data-arg` records them
            if getattr(datamodule, key, None) is not None:
                data[key] = str(getattr(datamodule, key))
        out = Path(self.out) if self.out is not None else Path(trainer.default_root_dir) / "results"
        return evaluate_features(
            backbone, train_ds, test_ds, {p: self.protocol_kwargs(p) for p in self.protocols},
            method=info.get("method") or "unknown", data={k: v for k, v in data.items() if v is not None},
            num_classes=int(num_classes), feature_mode=self.features, batch_size=self.batch_size,
            num_workers=int(getattr(datamodule, "num_workers", 0)), device=str(trainer.strategy.root_device),
            source=str(Path(checkpoint).resolve()), pretrain=info.get("pretrain") or {}, backbone_record=backbone_info(backbone, chosen_encoder(info)), out_dir=out,
        )

    def protocol_kwargs(self, protocol: str) -> dict[str, Any]:
        """The evaluator's arguments: the recipe's, with this section's seed where it takes one."""
        seeded = {"seed": self.seed} if protocol in ("linear", "fewshot") else {}
        return {**seeded, **self.kwargs[protocol]}


def datamodule_name(datamodule: L.LightningDataModule) -> str:
    """``FashionMNISTDataModule`` -> ``fashion_mnist``: the names ``ssl-vit eval --data`` uses, so
    that ``compare`` puts a recipe's records beside those of ``ssl-vit eval``."""
    from ssl_vit.eval.data_args import dataset_name

    return dataset_name(type(datamodule).__name__)
