"""Evaluate one backbone by several protocols: the entry point of ``ssl-vit eval``, of the demo and
of a recipe's ``evaluate`` section, which ``ssl-vit fit`` runs after the pretraining::

    evaluate:
      protocols: [finetune, linear_aug, knn]
      finetune: {epochs: 100, batch_size: 32, base_lr: 5.0e-4, layer_decay: 0.65}
      linear_aug: {epochs: 100, batch_size: 128, features: last4}
      knn: {k: 20, temperature: 0.07}
      data:                       # optional: labelled data of its own (default: the run's data)
        class_path: ImageFolderDataModule
        init_args: {train_dir: labelled/train, val_dir: labelled/val}

The protocols that train on images run first, on every process of a run; then process 0 extracts
the features once for the frozen-feature protocols. Each writes an ``EvalResult`` (``result_path``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor, nn
from torch.utils.data import Dataset, Subset

from ssl_vit.backbones import is_vit
from ssl_vit.data import ImageDataModule, ImageFolderDataModule, scan_image_dir
from ssl_vit.eval import results
from ssl_vit.eval.features import FeatureMode, extract_features, feature_dim
from ssl_vit.eval.fewshot import FewShotEvaluator
from ssl_vit.eval.finetune import FineTuneSettings
from ssl_vit.eval.knn import KNNClassifier
from ssl_vit.eval.linear import LinearProbe
from ssl_vit.eval.linear_augmented import LinearAugSettings
from ssl_vit.eval.train_run import ImageRun
from ssl_vit.export import chosen_encoder
from ssl_vit.training.checkpoint import newest_checkpoint
from ssl_vit.training.progress import CountProgress

Protocol = Literal["finetune", "linear_aug", "linear", "knn", "fewshot"]
SETTINGS = {"finetune": FineTuneSettings, "linear_aug": LinearAugSettings, "linear": LinearProbe, "knn": KNNClassifier, "fewshot": FewShotEvaluator}
ON_IMAGES = ("finetune", "linear_aug")  # trained on images, on every process of a run
PRECISIONS: dict[str, torch.dtype | None] = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
# Settings that change no result, left out of it.
NOT_RECORDED = ("picked", "device", "chunk_size", "bank_chunk_size", "progress_every_n_seconds", "checkpoint_every", "compile_backend")


def draw(n: int, size: int | None, seed: int) -> Tensor | None:
    """A fixed random draw of ``size`` of ``n`` indices, in order (None: all), as ``ImageDataModule``'s ``subset``."""
    return None if size is None or size >= n else torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:size].sort().values


def subsample(dataset: Dataset, size: int | None, seed: int = 0) -> Dataset:
    """A fixed random subset of ``size`` items in dataset order (all of them when None or more)."""
    return dataset if (i := draw(len(dataset), size, seed)) is None else Subset(dataset, i.tolist())


def labelled_classes(dataset: Any) -> int | None:
    """The classes of an evaluation split's (or its ``Subset``'s) labelled images; None when unlisted."""
    indices, dataset = (dataset.indices, dataset.dataset) if isinstance(dataset, Subset) else (None, dataset)
    if (labels := getattr(getattr(dataset, "source", None), "labels", None)) is None:
        return None
    labels = torch.as_tensor(labels)[torch.as_tensor(list(indices), dtype=torch.long) if indices is not None else slice(None)]
    return int(labels[labels >= 0].unique().numel())


def labelled_features(features: Tensor, labels: Tensor, split: str) -> tuple[Tensor, Tensor]:
    """The rows with a label (an unreadable file comes labelled -1); non-finite features (a diverged
    checkpoint) are an error rather than a meaningless score."""
    if bad := int((~torch.isfinite(features).all(dim=1)).sum()):
        raise ValueError(f"the backbone gives non-finite (NaN/Inf) features for {bad} of {len(features)} {split} images: "
                         "its weights are broken (a diverged run?); evaluate an earlier checkpoint")
    if not (keep := labels >= 0).any():  # [N]
        raise ValueError(f"no {split} image could be read or has a label")
    if not keep.all():
        logging.getLogger(__name__).warning("evaluating without %d unreadable or unlabelled %s images", int((~keep).sum()), split)
    return features[keep], labels[keep]


def backbone_data_args(backbone: nn.Module, info: Mapping[str, Any]) -> dict[str, Any]:
    """The datamodule arguments that feed a backbone what it was trained on: its resolution, channels
    and recorded statistics (ImageNet's for foreign weights, as timm's; the dataset's for a random init)."""
    args: dict[str, Any] = {"img_size": backbone.img_size[0], "in_chans": backbone.in_chans}
    source = str(info.get("normalization_source") or "")
    if info.get("mean") is not None and (not source.startswith("default") or (source.startswith("default (ImageNet") and info.get("kind") != "random")):
        args["mean"], args["std"] = tuple(info["mean"]), tuple(info["std"])
    return args


def missing_labels(datamodule: Any) -> str | None:
    """What a datamodule lacks of the labelled splits, known without reading an image; None when nothing."""
    if isinstance(datamodule, ImageFolderDataModule):
        unlabelled = "has no class folders (<class>/<image>): its images have no labels"
        if datamodule.val_dir is None:
            return "has no val_dir (the labelled test split)"
        if datamodule.num_classes is None:
            return f"train_dir {datamodule.train_dir} {unlabelled}"
        if scan_image_dir(datamodule.val_dir, {c: i for i, c in enumerate(datamodule.class_names)})[1] is None:
            return f"val_dir {datamodule.val_dir} {unlabelled}"
        return None
    if not datamodule.has_labelled_test_split():
        return "has no labelled test split to evaluate on"
    if not datamodule.num_classes:
        return ("does not say how many classes its labels have (num_classes is unset): a datamodule of labelled data sets num_classes, "
                "which the evaluations and the online probe need")
    return None


class Evaluation:
    """Evaluations of one backbone (none by default): the ``protocols`` with their settings; ``data``:
    labelled splits of its own (None: the run's), fed as the backbone was trained; ``which``: a
    checkpoint's encoder; ``out``: the results' folder (after a fit: ``<default_root_dir>/results``);
    ``seed``: of the subsets, the runs on images and the protocols whose own is None; ``few_labels``: the
    linear probe also trained on this many labelled images, ``draws`` draws seeded ``seed``, ``seed + 1``
    ... (as a datamodule's ``subset``), against a supervised baseline trained on them."""

    def __init__(self, protocols: list[Protocol] | None = None, data: ImageDataModule | None = None, features: FeatureMode = "cls",
                 which: str | None = None, linear: LinearProbe | None = None, knn: KNNClassifier | None = None,
                 fewshot: FewShotEvaluator | None = None, finetune: FineTuneSettings | None = None, linear_aug: LinearAugSettings | None = None,
                 out: str | None = None, batch_size: int = 256, train_subset: int | None = None, test_subset: int | None = None,
                 seed: int = 0, few_labels: list[int] | None = None, draws: int = 1) -> None:
        self.protocols, self.data, self.features, self.which, self.out = list(dict.fromkeys(protocols or [])), data, features, which, out
        self.image_protocols = [p for p in self.protocols if p in ON_IMAGES]
        self.frozen_protocols = [p for p in self.protocols if p not in ON_IMAGES]
        self.batch_size, self.train_subset, self.test_subset, self.seed = batch_size, train_subset, test_subset, seed
        self.few_labels, self.draws = sorted(few_labels or []), draws
        if self.few_labels and "linear" not in self.protocols:
            raise ValueError("evaluate.few_labels trains the linear probe on few labels: add linear to evaluate.protocols")
        self.data_args: dict[str, Any] = {}  # those of ``data``'s arguments the recipe sets (ssl-vit fit tells)
        given = {"linear": linear, "knn": knn, "fewshot": fewshot, "finetune": finetune, "linear_aug": linear_aug}
        if unused := [p for p, s in given.items() if s is not None and p not in self.protocols]:
            print(f"ssl-vit: note: evaluate has settings for {', '.join(unused)}, which evaluate.protocols ({', '.join(self.protocols) or 'none'}) "
                  "does not run", file=sys.stderr)
        self.settings: dict[str, Any] = {p: s or SETTINGS[p]() for p, s in given.items()}
        for p in ("linear", "knn", "fewshot"):  # the evaluation's seed, where the protocol names none
            self.settings[p] = replace(self.settings[p], seed=seed) if self.settings[p].seed is None else self.settings[p]

    def check_model(self, model: Any) -> None:
        """Before a pretraining: the model has the encoder ``which`` names and the read-outs the protocols use."""
        from ssl_vit.export.load import encoder_prefix, encoders_in, normalize_which

        if (which := normalize_which(self.which)) is not None and self.protocols and not hasattr(model, encoder_prefix(which)[:-1]):
            raise ValueError(f"evaluate.which: a {type(model).__name__} checkpoint has no {which} backbone ({encoder_prefix(which)}*); "
                             f"it holds {', '.join(encoders_in([f'{name}.' for name, _ in model.named_children()]))}")
        own = "linear_aug" in self.protocols and self.settings["linear_aug"].features
        reads = {**({"evaluate.features": self.features} if self.frozen_protocols or ("linear_aug" in self.protocols and not own) else {}),
                 **({"evaluate.linear_aug.features": own} if own else {})}
        for where, mode in reads.items():
            try:
                feature_dim(model.backbone, mode)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None

    def check_data(self, datamodule: Any) -> None:
        """Before a pretraining: labelled splits (``data``, else the run's) and, where the recipe fixes
        the training split's size, room in it for kNN's neighbours and few-shot's shots."""
        if not self.protocols:
            return
        datamodule, where = (self.data, "evaluate.data") if self.data is not None else (datamodule, "data")
        if (missing := missing_labels(datamodule)) is not None:
            raise ValueError(f"{'evaluate' if where == 'data' else where}: {type(datamodule).__name__} {missing}; set evaluate.protocols: [] to "
                             f"pretrain without evaluating{', or evaluate on labelled data of its own (evaluate.data)' if where == 'data' else ''}")
        sizes = {"evaluate.train_subset": self.train_subset, f"{where}.subset": getattr(datamodule, "subset", None)}
        if known := sorted((n, name) for name, n in sizes.items() if n is not None):
            self._check_sizes(*known[0], datamodule.num_classes)

    def _check_sizes(self, n: int, where: str | None, num_classes: int) -> None:
        """kNN's largest k and few-shot's shots fit in ``n`` training images (of the recipe's ``where``)."""
        prefix, of, larger = ("evaluate.", f" (of {where})", f", or a larger {where}") if where else ("", "", "")
        knn, shots = self.settings["knn"], max(self.settings["fewshot"].shots)
        if "knn" in self.protocols and (short := knn.bank_shortfall(n)) is not None:
            fix = f"; set evaluate.knn {{k: {n}}} or fewer{larger}" if len(knn.ks) == 1 else f"; sweep smaller k{larger}"
            raise ValueError(f"{prefix}knn: {short}{of}" + (fix if where else ""))
        if "fewshot" in self.protocols and shots * num_classes > n:
            fix = f"; set evaluate.fewshot shots to at most {n // num_classes}{larger}" if n >= num_classes else f"; a larger {where}"
            raise ValueError(f"{prefix}fewshot: {shots}-shot needs {shots} training images of each of the {num_classes} classes, more than the {n}{of}"
                             + (fix if where else ""))

    def check_run_dirs(self, root: str | Path, resuming: bool) -> None:
        """A new run meets no earlier run's evaluation checkpoints (refused after it otherwise)."""
        for protocol in [] if resuming else self.image_protocols:
            if (held := newest_checkpoint(Path(root) / protocol / "checkpoints")) is not None:
                raise ValueError(f"evaluate.{protocol}: {held.parent} already holds the {protocol} run of an earlier pretraining ({held.name}): "
                                 "continue that run with --resume, or remove that folder first")

    def after_fit(self, checkpoint: str | Path, datamodule: Any, trainer: Any, resuming: bool) -> list[results.EvalResult]:
        """The recipe's evaluation of a fit's backbone, on its processes; runs on images checkpoint into ``<root>/<protocol>``."""
        from ssl_vit.export import load_any_backbone

        backbone, info = load_any_backbone(checkpoint, which=self.which)
        if self.data is not None:  # unset, its loader workers are the run's (its training views have no use here)
            datamodule = type(self.data)(**{**backbone_data_args(backbone, info), "num_workers": datamodule.num_workers,
                                            **{k: v for k, v in self.data_args.items() if k != "views"}})
        root, device = Path(trainer.default_root_dir), trainer.strategy.root_device
        image_run = ImageRun("gpu" if device.type == "cuda" else "cpu", trainer.num_devices, trainer.num_nodes, str(trainer.precision),
                             datamodule.num_workers, self.seed, resume=resuming)
        return [r for r, _ in self.run(backbone, info, datamodule, self.out or root / "results", device=str(device), image_run=image_run,
                                       run_dirs={p: root / p for p in ON_IMAGES})]

    def run(self, backbone: nn.Module, info: Mapping[str, Any], datamodule: Any, out: str | Path, *, device: str | None = None,
            image_run: ImageRun | None = None, run_dirs: Mapping[str, Any] | None = None, head: nn.Linear | None = None,
            ) -> list[tuple[results.EvalResult, Path]]:
        """Run the protocols and write their results into ``out``; every process of a run calls this,
        process 0 returns the results and their files. ``image_run``: how the runs on images train
        (its precision is the extraction's too), into ``run_dirs``; ``head``: fine-tuning's classifier."""
        image_run, done = image_run or ImageRun(seed=self.seed), []
        if len(self.protocols) > 1 and results.names_a_file(out):
            raise ValueError(f"{len(self.protocols)} protocols write {len(self.protocols)} results: the output (--out) must be a folder, not the file {out}")
        data = {"name": results.datamodule_name(datamodule), **{k: str(v) for k in ("train_dir", "val_dir") if (v := getattr(datamodule, k, None))},
                **({"subset": datamodule.subset} if getattr(datamodule, "subset", None) else {})}
        pretrain = {**(info.get("pretrain") or {}), "data": results.pretraining_data((info.get("pretrain") or {}).get("data"))}
        common = dict(method=str(info.get("method") or "unknown"), backbone=results.backbone_info(backbone, chosen_encoder(info)),
                      pretrain={k: v for k, v in pretrain.items() if v is not None}, source=str(info.get("source") or "random"))

        def write(protocol: str, settings: Any, metrics: dict[str, float], train_size: int, test_size: int, **args: Any) -> None:
            result = results.EvalResult(**common, data={**data, "train_size": train_size, "test_size": test_size}, protocol=protocol, metrics=metrics,
                                        protocol_args={**{k: v for k, v in asdict(settings).items() if k not in NOT_RECORDED}, **args})
            done.append((result, result.to_json(results.result_path(out, result))))

        for protocol in self.image_protocols:
            s, size = self.settings[protocol], datamodule.img_size
            train_ds, test_ds, num_classes = self._splits(datamodule, views := s.train_views(size))
            run_dir = Path(run_dirs[protocol]) if run_dirs and run_dirs.get(protocol) else None
            place = replace(image_run, run_dir=run_dir, resume=image_run.resume and run_dir is not None and newest_checkpoint(run_dir / "checkpoints") is not None)
            kwargs: dict[str, Any] = {"origin": {"pretrain_steps": common["pretrain"].get("steps")}}
            if protocol == "finetune":  # (its checkpoints and export say what the fine-tuning fed the backbone)
                extra = {"img_size": size if is_vit(backbone) and tuple(backbone.img_size) != (size, size) else None}
                kwargs.update(head=head, img_size=extra["img_size"], run_info={"method": f"{common['method']}+finetune", "data": {
                    "name": data["name"], "mean": list(datamodule.mean), "std": list(datamodule.std)}})
            else:
                extra, kwargs["features"] = {"features": s.features or self.features}, self.features
            if (metrics := s.run(backbone, train_ds, test_ds, num_classes, place, **kwargs)) is None:
                return []  # another process of a distributed run: process 0 tests and writes the result
            write(protocol, s, metrics, len(train_ds), len(test_ds), crop_scale=views and list(views.scale), **extra,
                  max_steps=None if s.max_steps == -1 else s.max_steps, seed=place.seed, precision=place.precision,
                  devices=place.devices if isinstance(place.devices, int) else len(place.devices), num_nodes=place.num_nodes)
        if not self.frozen_protocols or rank_zero_only.rank != 0:
            return done
        train_ds, test_ds, num_classes = self._splits(datamodule, whole_train=bool(self.few_labels))
        backbone = backbone.to(device) if device is not None else backbone
        (all_f, all_l), (test_f, test_l) = (  # [N, F], [N]; [M, F], [M]; a line of progress a minute
            labelled_features(*extract_features(backbone, dataset, mode=self.features, batch_size=self.batch_size, device=device,
                                                num_workers=datamodule.num_workers, autocast_dtype=PRECISIONS[image_run.precision],
                                                progress=CountProgress(f"features ({split})", total=len(dataset))), split)
            for split, dataset in (("train", train_ds), ("test", test_ds)))
        # (protocol, settings, training images drawn, the draw's seed, what the result adds)
        runs = [(p, self.settings[p], self.train_subset, self.seed, {}) for p in self.frozen_protocols]
        runs += [("linear", replace(self.settings["linear"], seed=seed), n, seed, {"few_labels": True})
                 for n in self.few_labels for seed in range(self.seed, self.seed + self.draws)]
        for protocol, s, size, seed, extra in runs:
            f, y = (all_f, all_l) if (i := draw(len(all_l), size, seed)) is None else (all_f[i], all_l[i])
            metrics = s.evaluate(f, y, test_f, test_l, num_classes=num_classes)
            write(protocol, s, metrics, len(y), len(test_l), **getattr(s, "picked", {}), features=self.features,
                  precision=image_run.precision, **extra)
        return done

    def _splits(self, datamodule: Any, train_views: Any = None, whole_train: bool = False) -> tuple[Dataset, Dataset, int]:
        """The (train, test) splits, subsampled (not the training split ``whole_train``), and the class
        count; splits without labels, of one class or too small are refused before any work."""
        train_ds, test_ds = datamodule.eval_datasets(train_views=train_views)
        name, num_classes = results.datamodule_name(datamodule), datamodule.num_classes
        if test_ds is None or not num_classes:
            raise ValueError(f"{name} {isinstance(datamodule, ImageDataModule) and missing_labels(datamodule) or 'has no labelled test split to evaluate on'}")
        train_ds, test_ds = subsample(train_ds, None if whole_train else self.train_subset, self.seed), subsample(test_ds, self.test_subset, self.seed)
        for split, dataset, folder in (("training", train_ds, "train_dir"), ("test", test_ds, "val_dir")):
            if (held := classes if (classes := labelled_classes(dataset)) is not None else num_classes) < 2:
                where = getattr(datamodule, folder, None)
                raise ValueError(f"{name}: the {split} images{f' ({where})' if where else ''} are of {held} class{'' if held == 1 else 'es'}; "
                                 "evaluation needs at least 2 classes")
        self._check_sizes(len(train_ds), None, num_classes)
        return train_ds, test_ds, int(num_classes)
