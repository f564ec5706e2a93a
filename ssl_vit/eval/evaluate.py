"""The ``evaluate`` section of a recipe: evaluations of the backbone a run ends with, so that one
``ssl-vit fit`` runs a whole experiment (pretraining, then the fine-tuning / linear probe / kNN /
few-shot records that ``ssl-vit compare`` tabulates).

It evaluates exactly what ``ssl-vit eval`` would: the backbone is loaded from the run's final
``last.ckpt`` (DINO: its teacher, as ``ssl-vit eval`` defaults to), the splits are the run's
datamodule's ``eval_datasets()``, and each protocol writes its own result record::

    evaluate:
      protocols: [finetune, linear_aug, knn]
      finetune: {epochs: 100, batch_size: 32, base_lr: 5.0e-4, layer_decay: 0.65}
      linear_aug: {epochs: 100, batch_size: 128, base_lr: 0.01}
      knn: {k: 20, temperature: 0.07}

The protocols that train on images (``finetune``; ``linear_aug``, the papers' linear probe on
augmented images) run on the run's devices and nodes (every process of the run takes part, as in
``ssl-vit eval finetune --devices N``), at the run's precision, each checkpointed into
``<default_root_dir>/<protocol>`` so that ``--resume`` continues it after an interruption; the
frozen-feature protocols (``linear``, ``knn``, ``fewshot``) then run in process 0.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

import lightning as L

from ssl_vit.errors import unexpected_keyword_hint

Protocol = Literal["finetune", "linear_aug", "linear", "knn", "fewshot"]
ON_IMAGES = ("finetune", "linear_aug")  # the protocols that train on images, on every process of the run


class RecipeEvaluation:
    """Evaluations run after a finished fit (none by default).

    Args:
        protocols: which protocols to run: ``finetune`` (every weight trained, with a new
            classifier), ``linear_aug`` (the papers' linear probe, on augmented images through the
            frozen backbone), and on features extracted once ``linear``, ``knn``, ``fewshot``.
        features: the representation of the linear probes and kNN: ``cls``, ``last4`` (DINO's
            linear protocol for ViT-S), ``avg`` or ``cls_avg`` (DINO's for ViT-B).
        which: the checkpoint's encoder to evaluate (``teacher``, ``student``, ``momentum``, or
            ``NAME`` for a method's ``NAME_backbone``); None: the method's default (DINO's
            teacher, otherwise the online backbone).
        linear: arguments of ``LinearProbe`` (its defaults where not given).
        knn: arguments of ``KNNClassifier``.
        fewshot: arguments of ``FewShotEvaluator``.
        finetune: arguments of ``ssl_vit.eval.image_runs.FineTuneSettings`` (epochs,
            batch_size per process, base_lr, layer_decay, drop_path_rate, label_smoothing,
            weight_decay, warmup_epochs, mixup_alpha, cutmix_alpha, rand_augment, random_erasing, augment, crop_scale, max_steps,
            checkpoint_every); it fine-tunes at the run's resolution (another one:
            ``ssl-vit eval finetune --img-size``).
        linear_aug: arguments of ``ssl_vit.eval.image_runs.LinearAugSettings`` (epochs,
            batch_size per process, base_lr, optimizer, warmup_epochs, crop_scale, features: its
            own representation, e.g. DINO's ``last4`` beside kNN's ``cls``, max_steps,
            checkpoint_every).
        out: folder of the result records; None: ``<default_root_dir>/results``.
        batch_size: images per forward pass of the feature extraction.
        train_subset: fit the probe / fill the kNN bank with a fixed random subset of this many
            training images (None: all), drawn from the run's training split (``data.subset``
            when the run trained on a subset).
        test_subset: evaluate on a fixed random subset of this many test images (None: all).
        seed: of those subsets, of the linear probe and few-shot draws, of the held-out part that
            picks a sweep's LR or k, and of the fine-tuning.
    """

    def __init__(
        self,
        protocols: list[Protocol] | None = None,
        features: Literal["cls", "last4", "avg", "cls_avg"] = "cls",
        which: str | None = None,
        linear: dict[str, Any] | None = None,
        knn: dict[str, Any] | None = None,
        fewshot: dict[str, Any] | None = None,
        finetune: dict[str, Any] | None = None,
        linear_aug: dict[str, Any] | None = None,
        out: str | None = None,
        batch_size: int = 256,
        train_subset: int | None = None,
        test_subset: int | None = None,
        seed: int = 0,
    ) -> None:
        self.protocols = list(protocols or [])
        self.features = features
        self.which = which
        self.kwargs = {"finetune": dict(finetune or {}), "linear_aug": dict(linear_aug or {}), "linear": dict(linear or {}), "knn": dict(knn or {}),
                       "fewshot": dict(fewshot or {})}
        self.out = out
        self.batch_size = batch_size
        self.train_subset = train_subset
        self.test_subset = test_subset
        self.seed = seed
        # Build each evaluator now: a misspelt or invalid argument fails before the training,
        # not after it.
        given = [p for p, kwargs in self.kwargs.items() if kwargs]  # settings of protocols not run are checked too
        for protocol in dict.fromkeys([*self.protocols, *given]):
            evaluator = _evaluator(protocol)
            try:
                built = evaluator(**self.protocol_kwargs(protocol))
            except (TypeError, ValueError) as err:
                hint = unexpected_keyword_hint(err, evaluator) if isinstance(err, TypeError) else ""
                raise ValueError(f"evaluate.{protocol}: {err}{hint}") from None
            # select_fraction only serves a sweep: without one it would be silently unused
            swept = {"linear": ("base_lr", "base_lrs"), "knn": ("k", "ks")}.get(protocol)
            if swept and "select_fraction" in self.kwargs[protocol] and len(getattr(built, swept[1])) == 1:
                raise ValueError(f"evaluate.{protocol}.select_fraction: holds out training features to pick the {swept[0]} of a sweep; "
                                 f"give {swept[0]} a list of several values, or leave select_fraction out")
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
        reads = [("evaluate.features", self.features)] if self.frozen_protocols else []
        if "linear_aug" in self.protocols:
            own = self.kwargs["linear_aug"].get("features")
            reads.append(("evaluate.linear_aug.features", own) if own else ("evaluate.features", self.features))
        for where, mode in dict.fromkeys(reads):
            try:
                feature_dim(model.backbone, mode)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None

    def check_data(self, datamodule: L.LightningDataModule) -> None:
        """What the evaluators need of a training split whose size the recipe fixes (the run's
        ``data.subset``, from which ``evaluate.train_subset`` draws), checked before the training
        rather than after it: kNN's ``k`` neighbours and few-shot's largest number of shots of
        every class (without a fixed size, checking would mean reading the data first); and that
        the data has a labelled test split to score on."""
        if not self.protocols:
            return
        has_test = getattr(datamodule, "has_labelled_test_split", None)
        if callable(has_test) and not has_test():
            fix = "set data val_dir to a labelled folder, or " if hasattr(datamodule, "val_dir") else ""
            raise ValueError(f"evaluate: {type(datamodule).__name__} has no labelled test split to evaluate on; "
                             f"{fix}set evaluate.protocols: [] to pretrain without evaluating")
        if not getattr(datamodule, "num_classes", None):
            raise ValueError(f"evaluate: {type(datamodule).__name__} does not say how many classes its labels have (num_classes "
                             "is unset): a datamodule of labelled data sets num_classes (a class attribute, or in __init__), which "
                             "the evaluations and the online probe need; or set evaluate.protocols: [] to pretrain without evaluating")
        sizes = [n for n in (getattr(datamodule, "subset", None), self.train_subset) if n is not None]
        if not sizes:
            return
        n = min(sizes)
        whence = "data.subset" if n == getattr(datamodule, "subset", None) else "evaluate.train_subset"
        from ssl_vit.eval.run import FEATURE_PROTOCOLS

        if "knn" in self.protocols:
            knn = FEATURE_PROTOCOLS["knn"](**self.protocol_kwargs("knn"))
            short = knn.bank_shortfall(n)
            if short is not None:
                if len(knn.ks) == 1:
                    short = f"k={knn.k} neighbours, but the kNN bank holds the {n} training images of {whence}"
                fix = f"set evaluate.knn {{k: {n}}} or fewer" if len(knn.ks) == 1 else "sweep smaller k"
                raise ValueError(f"evaluate.knn: {short}; {fix}, or a larger {whence}")
        num_classes = getattr(datamodule, "num_classes", None)
        if "fewshot" in self.protocols and num_classes:
            shots = max(FEATURE_PROTOCOLS["fewshot"](**self.protocol_kwargs("fewshot")).shots)
            if shots * int(num_classes) > n:
                most = n // int(num_classes)
                fix = f"set evaluate.fewshot shots to at most {most}, or a larger {whence}" if most else f"a larger {whence}"
                raise ValueError(f"evaluate.fewshot: {shots}-shot needs {shots} training images of each of the {num_classes} classes, "
                                 f"more than the {n} of {whence}; {fix}")

    @property
    def frozen_protocols(self) -> list[str]:
        """The protocols on features extracted once (run in process 0 alone)."""
        return [p for p in self.protocols if p not in ON_IMAGES]

    @property
    def image_protocols(self) -> list[str]:
        """The protocols that train on images (every process of the run takes part)."""
        return [p for p in self.protocols if p in ON_IMAGES]

    def run_dir(self, protocol: str, trainer: L.Trainer) -> Path:
        """Where protocol ``protocol``'s training on the run's backbone keeps its checkpoints."""
        return Path(trainer.default_root_dir) / protocol

    def check_run_dirs(self, trainer: L.Trainer, resuming: bool) -> None:
        """A new run must not meet an earlier run's evaluation checkpoints (they would be refused
        after the pretraining, not before it)."""
        if resuming:
            return
        from ssl_vit.training.step_checkpoint import newest_checkpoint

        for protocol in self.image_protocols:
            held = newest_checkpoint(self.run_dir(protocol, trainer) / "checkpoints")
            if held is not None:
                raise ValueError(f"evaluate.{protocol}: {held.parent} already holds the {protocol} run of an earlier pretraining "
                                 f"({held.name}): continue that run with --resume, or remove that folder first")

    def train_on_images(self, protocol: str, checkpoint: str | Path, datamodule: L.LightningDataModule, trainer: L.Trainer,
                        resuming: bool) -> tuple[Any, Path] | None:
        """Run ``protocol`` (``finetune`` or ``linear_aug``) on the backbone of ``checkpoint`` on the
        run's processes (every one calls this) and write its record; process 0 returns ``(record,
        path)``, the others None. ``resuming``: the run was resumed, so a protocol's run it had
        begun continues from its checkpoint."""
        from ssl_vit.eval.image_runs import finetune_and_record, linear_aug_and_record
        from ssl_vit.eval.results import backbone_info, chosen_encoder
        from ssl_vit.export import load_any_backbone
        from ssl_vit.training.step_checkpoint import newest_checkpoint

        settings = _evaluator(protocol)(**self.protocol_kwargs(protocol))
        train_ds, test_ds, num_classes = self._splits(datamodule, settings.train_views(datamodule.img_size))
        backbone, info = load_any_backbone(checkpoint, which=self.which)
        run_dir = self.run_dir(protocol, trainer)
        root = trainer.strategy.root_device
        data = {**self._data_record(datamodule), "train_size": len(train_ds), "test_size": len(test_ds)}
        common = dict(
            img_size=datamodule.img_size, method=info.get("method") or "unknown", data_record=data, source=str(Path(checkpoint).resolve()),
            pretrain=info.get("pretrain") or {}, backbone_record=backbone_info(backbone, chosen_encoder(info)), out=self._out(trainer),
            accelerator="gpu" if root.type == "cuda" else "cpu", devices=trainer.num_devices, num_nodes=trainer.num_nodes,
            precision=str(trainer.precision), seed=self.seed, num_workers=int(getattr(datamodule, "num_workers", 0)), run_dir=run_dir,
            resume=resuming and newest_checkpoint(run_dir / "checkpoints") is not None,
        )
        if protocol == "linear_aug":
            return linear_aug_and_record(backbone, train_ds, test_ds, num_classes, settings, features=self.features, **common)
        normalization = {"name": data["name"], "mean": list(datamodule.mean), "std": list(datamodule.std)}
        return finetune_and_record(backbone, train_ds, test_ds, num_classes, settings, new_img_size=None, normalization=normalization, **common)

    def _splits(self, datamodule: L.LightningDataModule, train_views: Any = None) -> tuple[Any, Any, int]:
        eval_datasets = getattr(datamodule, "eval_datasets", None)
        if eval_datasets is None:
            raise ValueError(f"evaluate: {type(datamodule).__name__} has no eval_datasets() to evaluate on")
        train_ds, test_ds = eval_datasets(train_views=train_views) if train_views is not None else eval_datasets()
        num_classes = getattr(datamodule, "num_classes", None)
        if test_ds is None or not num_classes:
            raise ValueError(f"evaluate: {type(datamodule).__name__} has no labelled test split to evaluate on")
        from ssl_vit.eval.run import subsample

        return subsample(train_ds, self.train_subset, self.seed), subsample(test_ds, self.test_subset, self.seed), int(num_classes)

    def _data_record(self, datamodule: L.LightningDataModule) -> dict[str, Any]:
        from ssl_vit.eval.data_args import datamodule_name

        data = {"name": datamodule_name(datamodule), "subset": getattr(datamodule, "subset", None)}
        for key in ("train_dir", "val_dir"):  # an image folder's folders, as `ssl-vit eval --data-arg` records them
            if getattr(datamodule, key, None) is not None:
                data[key] = str(getattr(datamodule, key))
        return {k: v for k, v in data.items() if v is not None}

    def _out(self, trainer: L.Trainer) -> Path:
        return Path(self.out) if self.out is not None else Path(trainer.default_root_dir) / "results"

    def run(self, checkpoint: str | Path, datamodule: L.LightningDataModule, trainer: L.Trainer) -> list[Any]:
        """Evaluate the backbone of ``checkpoint`` on ``datamodule``'s splits by the frozen-feature
        protocols; returns the records."""
        if not self.frozen_protocols:
            return []
        from ssl_vit.eval.results import backbone_info, chosen_encoder
        from ssl_vit.eval.run import evaluate_features
        from ssl_vit.export import load_any_backbone

        train_ds, test_ds, num_classes = self._splits(datamodule)
        backbone, info = load_any_backbone(checkpoint, which=self.which)
        return evaluate_features(
            backbone, train_ds, test_ds, {p: self.protocol_kwargs(p) for p in self.frozen_protocols},
            method=info.get("method") or "unknown", data=self._data_record(datamodule), num_classes=num_classes, feature_mode=self.features, batch_size=self.batch_size,
            num_workers=int(getattr(datamodule, "num_workers", 0)), device=str(trainer.strategy.root_device),
            source=str(Path(checkpoint).resolve()), pretrain=info.get("pretrain") or {}, backbone_record=backbone_info(backbone, chosen_encoder(info)),
            out_dir=self._out(trainer),
        )

    def protocol_kwargs(self, protocol: str) -> dict[str, Any]:
        """The evaluator's arguments: the recipe's, with this section's seed where it takes one."""
        seeded = {"seed": self.seed} if protocol in ("linear", "knn", "fewshot") else {}
        return {**seeded, **self.kwargs[protocol]}


def _evaluator(protocol: str) -> Any:
    """The class a protocol's settings construct (and are checked by)."""
    if protocol in ON_IMAGES:
        from ssl_vit.eval.image_runs import FineTuneSettings, LinearAugSettings

        return FineTuneSettings if protocol == "finetune" else LinearAugSettings
    from ssl_vit.eval.run import FEATURE_PROTOCOLS

    return FEATURE_PROTOCOLS[protocol]
