"""Evaluation protocols for frozen and fine-tuned backbones (specs §4, §5).

    features = extract_features(backbone, dataset, mode="cls")      # [N, F], [N]
    KNNClassifier().evaluate(*train, *test)                          # DINO weighted kNN
    LinearProbe().evaluate(*train, *test)                            # MAE linear probe
    FewShotEvaluator().evaluate(*train, *test)                       # ViT few-shot ridge
    run_finetune(backbone, train_ds, test_ds, num_classes, epochs)   # BEiT/MAE fine-tuning
    run_linear_augmented(backbone, train_ds, test_ds, num_classes, epochs)  # the papers' linear eval
    EvalResult(...).to_json(path); ssl_vit.eval.compare.main([...])

Names are imported lazily, so ``ssl-vit compare`` does not pay for Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "extract_features": "features",
    "FEATURE_MODES": "features",
    "feature_dim": "features",
    "KNNClassifier": "knn",
    "LinearProbe": "linear",
    "FewShotEvaluator": "fewshot",
    "ridge_solve": "fewshot",
    "FineTuneModule": "finetune",
    "run_finetune": "finetune",
    "param_groups_layer_decay": "finetune",
    "set_drop_path": "finetune",
    "AugmentedLinearProbe": "linear_augmented",
    "run_linear_augmented": "linear_augmented",
    "FineTuneSettings": "image_runs",
    "LinearAugSettings": "image_runs",
    "finetune_and_record": "image_runs",
    "linear_aug_and_record": "image_runs",
    "EvalResult": "results",
    "backbone_info": "results",
    "topk_accuracy": "metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"ssl_vit.eval.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'ssl_vit.eval' has no attribute {name!r}")
