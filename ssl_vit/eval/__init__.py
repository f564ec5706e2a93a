"""Evaluation of frozen and fine-tuned backbones, and the comparison of the results.

    evaluate.Evaluation      the entry point: protocols on one backbone and one dataset, results written
    features.extract_features, knn.KNNClassifier (DINO), linear.LinearProbe (MAE), fewshot.FewShotEvaluator (ViT)
    finetune.FineTuneSettings (BEiT/MAE), linear_augmented.LinearAugSettings (the papers' linear evaluation)
    results.EvalResult       one result; compare.build_comparison / report.write_report: ``ssl-vit compare``

Nothing is imported here: ``ssl-vit compare`` does not load Lightning.
"""
