"""Evaluation of frozen and fine-tuned backbones (``evaluate.Evaluation`` runs the protocols of
``features``/``knn``/``linear``/``fewshot`` and of ``finetune``/``linear_augmented`` and writes
``results.EvalResult``), and their comparison (``compare``, ``report``). Nothing is imported here:
``ssl-vit compare`` does not load Lightning."""
