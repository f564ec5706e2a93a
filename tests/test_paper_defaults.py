"""Every default a paper (or its reference code) fixes, pinned with its source: a changed default
silently changes what a recipe that leaves it out computes."""

from __future__ import annotations

import inspect

import pytest

from ssl_vit.analysis import attention, embedding, render
from ssl_vit.data import MultiCrop, SingleView, TwoViews
from ssl_vit.eval.fewshot import FewShotEvaluator
from ssl_vit.eval.finetune import FineTuneSettings
from ssl_vit.eval.knn import KNNClassifier
from ssl_vit.losses import MoCoV3Loss
from ssl_vit.masking import make_corruption_plan
from ssl_vit.methods import DINO, MPP, MoCoV3


def defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        # DINO §3.1, §4 and main_dino.py: τ_s 0.1, τ_t 0.04 -> 0.07 over 30 epochs, centre momentum 0.9,
        # teacher momentum cosine 0.996 -> 1, head 3 layers 2048 / bottleneck 256 / K 65536 with a
        # weight-normalised last layer frozen in the first epoch; AdamW 5e-4 -> 1e-6, wd 0.04 -> 0.4, clip 3.0.
        (DINO, {"student_temp": 0.1, "teacher_temp": 0.07, "warmup_teacher_temp": 0.04, "warmup_teacher_temp_epochs": 30,
                "center_momentum": 0.9, "momentum": 0.996, "momentum_end": 1.0, "out_dim": 65536, "hidden_dim": 2048,
                "bottleneck_dim": 256, "head_layers": 3, "norm_last_layer": True, "freeze_last_layer_epochs": 1,
                "n_global_crops": 2, "base_lr": 5e-4, "min_lr": 1e-6, "weight_decay": 0.04, "weight_decay_end": 0.4,
                "grad_clip": 3.0}),
        # MoCo v3 §4 / main_moco.py (ViT): momentum cosine 0.99 -> 1, projector 4096 -> 256, predictor 4096,
        # weight decay 0.1 on every parameter, 40 warm-up epochs, frozen random patch projection.
        (MoCoV3, {"momentum": 0.99, "momentum_end": 1.0, "proj_hidden_dim": 4096, "proj_output_dim": 256, "pred_hidden_dim": 4096,
                  "weight_decay": 0.1, "weight_decay_exempt": "none", "warmup_epochs": 40.0, "freeze_patch_embed": True}),
        # ViT paper §4.6 / B.1.2: 50 % of the patch embeddings corrupted, 80 % [mask] / 10 % another
        # patch / 10 % kept; target the 3-bit mean colour.
        (MPP, {"corruption_ratio": 0.5, "mask_prob": 0.8, "random_prob": 0.1, "target": "mean_color"}),
        (make_corruption_plan, {"ratio": 0.5, "mask_prob": 0.8, "random_prob": 0.1}),
        # MoCo v3 §4: τ = 0.2 for ViTs (the method picks 1.0 for a ResNet).
        (MoCoV3Loss, {"temperature": 0.2}),
        # BYOL's augmentations (MoCo v3 §4 uses them): crop (0.08, 1), flip 0.5, colour jitter
        # 0.4/0.4/0.2/0.1 with p 0.8, grey 0.2, blur p 1.0 / 0.1, solarise p 0 / 0.2.
        (TwoViews, {"scale": (0.08, 1.0), "flip_p": 0.5, "jitter_p": 0.8, "brightness": 0.4, "contrast": 0.4, "saturation": 0.2,
                    "hue": 0.1, "grayscale_p": 0.2, "blur_p": (1.0, 0.1), "solarize_p": (0.0, 0.2)}),
        # DINO main_dino.py DataAugmentationDINO: global crops (0.4, 1), 8 local crops (0.05, 0.4),
        # the same jitter, blur p 1.0 / 0.1 / 0.5 (global 1, global 2, local), solarise 0.2, bicubic.
        (MultiCrop, {"n_local_crops": 8, "global_scale": (0.4, 1.0), "local_scale": (0.05, 0.4), "flip_p": 0.5, "jitter_p": 0.8,
                     "brightness": 0.4, "contrast": 0.4, "saturation": 0.2, "hue": 0.1, "grayscale_p": 0.2,
                     "blur_p": (1.0, 0.1, 0.5), "solarize_p": 0.2, "interpolation": "bicubic"}),
        # Inception-style crop (0.08, 1) and flip for the supervised and MPP runs.
        (SingleView, {"scale": (0.08, 1.0), "flip_p": 0.5}),
        # DINO §4 weighted kNN: k 20, T 0.07.
        (KNNClassifier, {"k": 20, "temperature": 0.07}),
        # ViT paper §4.1 few-shot: 1/5/10/25 shots; big_vision fewshot_lsr: λ = 2^10.
        (FewShotEvaluator, {"shots": (1, 5, 10, 25), "l2_reg": 2.0**10}),
        # MAE FINETUNE.md (ViT-B): base LR 5e-4 with layer decay 0.65, drop path 0.1; main_finetune.py:
        # label smoothing 0.1, weight decay 0.05, 5 warm-up epochs, AdamW betas (0.9, 0.999).
        (FineTuneSettings, {"base_lr": 5e-4, "layer_decay": 0.65, "drop_path_rate": 0.1, "label_smoothing": 0.1,
                          "weight_decay": 0.05, "warmup_epochs": 5.0, "betas": (0.9, 0.999)}),
        # ViT paper Fig. 7: 28 principal components of E; Appendix D.7: attention distance over 128
        # images (renormalised over the patches: mean_attention_distance says why).
        (embedding.embedding_filters, {"k": 28}),
        (attention.compute_attention_distance, {"num_images": 128, "renormalize": True}),
        # DINO visualize_attention.py --threshold 0.6 (Fig. 3): the masks keep 60 % of the mass.
        (attention.dino_attention, {"threshold": 0.6}),
        (attention.keep_top_mass, {"threshold": 0.6}),
        (render.compute_all, {"num_filters": 28, "num_distance_images": 128, "threshold": 0.6}),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_defaults_are_the_papers(fn, expected):
    got = defaults(fn)
    assert {k: got.get(k) for k in expected} == expected


def test_imagenet_normalisation_is_torchvisions():
    # the statistics every ImageNet-pretrained reference normalises with (torchvision's weights)
    import torchvision

    from ssl_vit.data.base import IMAGENET_MEAN, IMAGENET_STD

    preset = torchvision.models.ResNet50_Weights.IMAGENET1K_V1.transforms()
    assert (IMAGENET_MEAN, IMAGENET_STD) == (tuple(preset.mean), tuple(preset.std))
