"""Evaluation protocols for frozen and fine-tuned backbones, and their comparison.

    Evaluation(protocols=["linear", "knn"]).run(backbone, info, datamodule, out="results")  # the entry point
    features = extract_features(backbone, dataset, mode="cls")   # [N, F], [N]
    KNNClassifier().evaluate(*train, *test)                       # DINO's weighted kNN
    LinearProbe().evaluate(*train, *test)                         # MAE's linear probe
    FewShotEvaluator().evaluate(*train, *test)                    # the ViT paper's few-shot ridge
    FineTuneSettings().run(backbone, train_ds, test_ds, num_classes)   # BEiT/MAE fine-tuning
    LinearAugSettings().run(backbone, train_ds, test_ds, num_classes)  # the papers' linear evaluation
    build_comparison(load_results(["results/"]))                  # ssl-vit compare

Names are imported when first used: ``ssl-vit compare`` does not load Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "evaluate": ["Evaluation"], "features": ["extract_features", "feature_dim", "FEATURE_MODES"], "knn": ["KNNClassifier"],
    "linear": ["LinearProbe", "LARS"], "fewshot": ["FewShotEvaluator", "ridge_solve"], "linear_augmented": ["LinearAugSettings", "AugmentedLinearProbe"],
    "finetune": ["FineTuneSettings", "FineTuneModule", "param_groups_layer_decay", "set_drop_path"], "train_run": ["ImageRun", "EvalRunInterrupted"],
    "results": ["EvalResult", "backbone_info", "topk_accuracy"], "compare": ["build_comparison", "load_results"], "report": ["write_report"],
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"ssl_vit.eval.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'ssl_vit.eval' has no attribute {name!r}")
