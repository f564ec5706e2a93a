"""Pretext modules: each method learns on a fixed batch, and the mechanics each paper specifies
(frozen patch projection, EMA, teacher inputs, last-layer freeze, schedules, online probe) hold."""

from __future__ import annotations

import copy
import math
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import SMALL_HEADS, TINY_BACKBONE, VIEW_SIZES, fit_steps, fixed_views
from lightly.utils.scheduler import cosine_schedule
from PIL import Image
from torch.utils.data import DataLoader

from ssl_vit.data import ImageFolderDataModule, SingleView, SyntheticDataModule
from ssl_vit.methods import (
    DINO,
    METHODS,
    MPP,
    BaseMethod,
    MoCoV3,
    NonFiniteLossError,
    Supervised,
)


def make(method: str, **overrides) -> BaseMethod:
    kwargs = {**TINY_BACKBONE, "num_classes": 4, "warmup_epochs": 0.0, "base_lr": 0.02, "weight_decay": 0.0, **SMALL_HEADS[method], **overrides}
    return METHODS[method](**kwargs)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_lowers_its_loss_on_a_fixed_batch(method):
    torch.manual_seed(0)
    # DINO's centre chases the teacher mean, which on one fixed batch flattens the teacher's
    # targets and raises the loss by design; freeze the centre here (it is tested on its own below).
    model = make(method, **({"center_momentum": 1.0} if method == "dino" else {}))
    views, labels = fixed_views(VIEW_SIZES[method])
    if method == "mpp":
        views = [v.clamp(-1, 1) for v in views]  # raw pixels = v * 0.5 + 0.5 must lie in [0, 1]
    losses = fit_steps(model, views, labels, steps=12)
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first * 0.97, f"{method}: loss did not decrease ({first:.4f} -> {last:.4f})"


def test_a_fourth_method_is_one_subclass():
    from helpers import Reconstruct  # (run by `ssl-vit fit` in test_training_cli)

    views, labels = fixed_views([16])
    losses = fit_steps(Reconstruct(pixels=16 * 16, **TINY_BACKBONE, warmup_epochs=0.0, base_lr=0.02), views, labels, steps=6)
    assert losses[-1] < losses[0]


def test_a_method_with_a_probe_must_return_its_features():
    from helpers import Reconstruct

    class NoFeatures(Reconstruct):
        def step(self, views, labels):
            return {"loss": super().step(views, labels)["loss"]}

    views, labels = fixed_views([16])
    with pytest.raises(ValueError, match="NoFeatures.step returned no 'features', but the run has an online probe"):
        fit_steps(NoFeatures(pixels=16 * 16, num_classes=4, **TINY_BACKBONE, warmup_epochs=0.0), views, labels, steps=1)
    assert fit_steps(NoFeatures(pixels=16 * 16, **TINY_BACKBONE, warmup_epochs=0.0), views, labels, steps=1)  # no probe: fine


@pytest.mark.parametrize("method,optimizer", [("mocov3", "lars"), ("dino", "sgd")])
def test_sgd_momentum_is_not_the_ema_momentum(method, optimizer):
    model = make(method, optimizer=optimizer, momentum=0.99, fused_optimizer=False)
    assert model.hparams.momentum == 0.99
    assert all(g["momentum"] == 0.9 for g in model.configure_optimizers().param_groups)
    model = make(method, optimizer=optimizer, sgd_momentum=0.8)
    assert all(g["momentum"] == 0.8 for g in model.configure_optimizers().param_groups)


# ----------------------------------------------------------------------------- MoCo v3


def test_mocov3_initialises_the_vit_as_the_reference_does():
    # vits.py: Xavier-uniform linears, QKV as three [D, D] matrices, zero biases; the momentum
    # encoder starts from the same weights.
    torch.manual_seed(0)
    model = make("mocov3")
    d = model.backbone.embed_dim
    qkv, fc1 = model.backbone.blocks[0].attn.qkv, model.backbone.blocks[0].mlp.fc1
    for layer, bound in ((qkv, math.sqrt(6.0 / (d + d))), (fc1, math.sqrt(6.0 / (fc1.in_features + fc1.out_features)))):
        assert layer.weight.abs().max() <= bound and layer.weight.abs().max() > 0.95 * bound
        assert float(layer.weight.std()) == pytest.approx(bound / math.sqrt(3), rel=0.1)  # uniform(-b, b)
        assert not layer.bias.any()
    assert torch.equal(model.momentum_backbone.blocks[0].attn.qkv.weight, qkv.weight)
    timm_like = make("mocov3", reference_init=False).backbone.blocks[0].attn.qkv.weight
    assert float(timm_like.std()) == pytest.approx(0.02, rel=0.1)  # timm's truncated normal kept on request


def test_mocov3_vit_small_has_the_reference_twelve_heads():
    from ssl_vit import create_backbone

    assert create_backbone("vit_small_mocov3").blocks[0].attn.num_heads == 12
    assert create_backbone("vit_small").blocks[0].attn.num_heads == 6  # DeiT's ViT-S


def test_the_supervised_pre_training_head_has_one_tanh_hidden_layer():
    model = make("supervised", head_hidden_dim=48)
    hidden, act, last = model.classifier
    assert (hidden.in_features, hidden.out_features, last.out_features) == (32, 48, 4) and isinstance(act, torch.nn.Tanh)
    assert not last.weight.any() and not last.bias.any()  # zero-initialised, as the single linear head
    assert isinstance(make("supervised").classifier, torch.nn.Linear) and make("supervised").hparams.label_smoothing == 0.0
    views, labels = fixed_views(VIEW_SIZES["supervised"])
    losses = fit_steps(model, views, labels, steps=6)
    assert losses[-1] < losses[0]


def test_mocov3_random_patch_projection_stays_frozen_and_momentum_follows_ema():
    torch.manual_seed(0)
    model = make("mocov3", momentum=0.9, momentum_end=0.9)
    proj = model.backbone.patch_embed.proj
    assert not proj.weight.requires_grad and not proj.bias.requires_grad
    # reference init: U(-v, v), v = sqrt(6 / (C*P*P + D))
    bound = math.sqrt(6.0 / (1 * 4 * 4 + 32))
    assert proj.weight.abs().max() <= bound and proj.weight.abs().max() > 0.9 * bound
    frozen = proj.weight.detach().clone()
    online_before = copy.deepcopy(model.backbone.state_dict())
    target_before = copy.deepcopy(model.momentum_backbone.state_dict())
    snapshots = []

    class Snapshot(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            snapshots.append(copy.deepcopy(pl_module.backbone.state_dict()))

    views, labels = fixed_views([16, 16])
    fit_steps(model, views, labels, steps=2, callbacks_extra=[Snapshot()])
    assert torch.equal(model.backbone.patch_embed.proj.weight, frozen)
    o1, o2 = snapshots
    for name, value in model.momentum_backbone.state_dict().items():
        # T1 = 0.9 T0 + 0.1 O1 ; T2 = 0.9 T1 + 0.1 O2 (the online weights after each step)
        expected = 0.9 * (0.9 * target_before[name] + 0.1 * o1[name]) + 0.1 * o2[name]
        assert torch.allclose(value, expected, atol=1e-6), name
    changed = [n for n in o2 if not torch.equal(o2[n], online_before[n])]
    assert "blocks.0.attn.qkv.weight" in changed and "patch_embed.proj.weight" not in changed


def test_mocov3_momentum_follows_a_cosine_from_0_99_to_1():
    model = make("mocov3")
    model.total_steps = 100

    def momentum(step):
        model._trainer = SimpleNamespace(global_step=step)
        return model.cosine(model.hparams.momentum, model.hparams.momentum_end)

    # MoCo v3 adjust_moco_momentum: 1 - 0.5 * (1 + cos(pi * t / T)) * (1 - m0), t = 0..T-1
    assert momentum(0) == pytest.approx(0.99)
    for t in (50, 99):
        assert momentum(t) == pytest.approx(1 - 0.5 * (1 + math.cos(math.pi * t / 100)) * (1 - 0.99))
    assert momentum(99) < 1.0  # the last update still moves the momentum encoder
    assert momentum(100) == momentum(130) == pytest.approx(1.0)  # (past the end: stays there)


def test_mocov3_momentum_encoder_has_no_stochastic_depth_and_no_grad():
    model = make("mocov3", backbone_kwargs={**TINY_BACKBONE["backbone_kwargs"], "drop_path_rate": 0.1})
    assert model.backbone.blocks[-1].drop_path.p == pytest.approx(0.1)
    assert all(isinstance(b.drop_path, torch.nn.Identity) for b in model.momentum_backbone.blocks)
    assert not any(p.requires_grad for p in model.momentum_backbone.parameters())
    assert not any(p.requires_grad for p in model.momentum_projector.parameters())


def test_mocov3_one_backbone_pass_for_both_views_on_a_vit():
    model = make("mocov3")
    calls = []
    model.backbone.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    views, labels = fixed_views([16, 16], batch=8)
    model.step(views, labels)
    assert calls == [16]


# ----------------------------------------------------------------------------- DINO


def test_dino_teacher_sees_only_global_crops_and_student_one_pass_per_resolution():
    model = make("dino")
    teacher_inputs, student_inputs = [], []
    model.teacher_backbone.register_forward_hook(lambda m, i, o: teacher_inputs.append(tuple(i[0].shape)))
    model.backbone.register_forward_hook(lambda m, i, o: student_inputs.append(tuple(i[0].shape)))
    views, labels = fixed_views([16, 16, 8, 8, 8], batch=4)
    out = model.step(views, labels)
    assert teacher_inputs == [(8, 1, 16, 16)]
    assert student_inputs == [(8, 1, 16, 16), (12, 1, 8, 8)]
    assert torch.isfinite(out["loss"])
    for key in ("teacher_entropy", "teacher_student_kl", "embedding_std"):
        assert key in out


def test_dino_center_is_updated_with_the_teacher_batch_mean():
    torch.manual_seed(0)
    model = make("dino")
    model.criterion.center.normal_()
    before = model.criterion.center.clone()
    views, labels = fixed_views([16, 16, 8, 8], batch=4)
    with torch.no_grad():
        teacher = model.teacher_head(model.teacher_backbone(torch.cat(views[:2])))  # [8, K]
    model.step(views, labels)
    expected = 0.9 * before + 0.1 * teacher.mean(0)
    assert torch.allclose(model.criterion.center, expected, atol=1e-6)


def test_dino_centre_moves_once_per_step_under_gradient_accumulation():
    # Two micro-batches of 8 accumulated into one step move the centre as the batch of 16 in
    # one step does (the reference has no accumulation: its batch is undivided).
    views, labels = fixed_views(VIEW_SIZES["dino"], batch=16)
    halves = [([v[:8] for v in views], labels[:8]), ([v[8:] for v in views], labels[8:])]
    centres = []
    for accumulate, batches in ((1, [(views, labels)] * 3), (2, halves * 3)):
        torch.manual_seed(0)
        model = make("dino", num_classes=None)
        trainer = L.Trainer(max_steps=3, accumulate_grad_batches=accumulate, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(model, DataLoader(RepeatList(batches), batch_size=None))
        centres.append(model.criterion.center.clone())
    assert centres[0].abs().sum() > 0
    torch.testing.assert_close(centres[1], centres[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bad", [0, 1])  # the first micro-batch of step 2, or its last (run inside the optimiser step)
def test_a_skipped_accumulated_step_leaves_dinos_centre_where_it_was(bad):
    # Expectation by hand: step 2 is skipped, so the centre after it is the centre after step 1,
    # and stays finite; without the skip both micro-batches' teacher means would move it.
    views, labels = fixed_views(VIEW_SIZES["dino"], batch=16)
    halves = [([v[:8] for v in views], labels[:8]), ([v[8:] for v in views], labels[8:])]
    poisoned = [[v.clone() for v in halves[bad][0]], halves[bad][1]]
    poisoned[0][0][0] = float("nan")  # one corrupt image
    step2 = [poisoned, halves[1]] if bad == 0 else [halves[0], poisoned]
    seen = []

    class Centre(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx % 2:  # the end of an optimiser step
                seen.append(pl_module.criterion.center.clone())

    torch.manual_seed(0)
    model = make("dino", num_classes=None, nonfinite_policy="skip")
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Centre()])
    trainer.fit(model, DataLoader(RepeatList(halves + step2 + halves), batch_size=None))
    assert model.skipped_batches == 1 and all(torch.isfinite(c).all() for c in seen)
    assert torch.equal(seen[1], seen[0]) and not torch.equal(seen[2], seen[1])


def test_dino_last_layer_frozen_in_first_epoch_only():
    torch.manual_seed(0)
    model = make("dino", freeze_last_layer_epochs=1)
    views, labels = fixed_views([16, 16, 8, 8])
    v0 = model.head.last_layer.weight_v.detach().clone()
    mlp0 = model.head.mlp[0].weight.detach().clone()
    fit_steps(model, views, labels, steps=3, epochs=1)
    assert torch.equal(model.head.last_layer.weight_v, v0)
    assert not torch.equal(model.head.mlp[0].weight, mlp0)
    fit_steps(model, views, labels, steps=3, epochs=2)  # a fresh trainer: epochs 0 and 1
    assert not torch.equal(model.head.last_layer.weight_v, v0)


def test_dino_head_has_weight_normalised_last_layer_fixed_to_norm_one():
    model = make("dino")
    w = model.head.last_layer.weight
    assert torch.allclose(w.norm(dim=1), torch.ones(w.shape[0]), atol=1e-5)
    assert not model.head.last_layer.weight_g.requires_grad


# ----------------------------------------------------------------------------- MPP


def test_mpp_corrupts_half_the_patches_and_predicts_512_colours_for_rgb():
    model = MPP(backbone="vit", backbone_kwargs={**TINY_BACKBONE["backbone_kwargs"], "in_chans": 3}, mean=[0.5] * 3, std=[0.25] * 3)
    assert model.head.out_shape == (512,)
    seen = {}
    original = model.backbone.forward_features

    def spy(x, patch_hook=None):
        tokens, _ = model.backbone.patch_embed(x)
        replaced = patch_hook(tokens)
        seen["changed"] = (replaced != tokens).any(-1)  # [B, N]
        return original(x, patch_hook=patch_hook)

    model.backbone.forward_features = spy
    x = torch.rand(8, 3, 16, 16) * 2 - 1  # normalised with mean .5 / std .25 -> raw in [0.25, 0.75]
    out = model.step([x], torch.zeros(8, dtype=torch.long))
    # 8 of 16 patches corrupted per image; the unchanged 10 % leave some of them equal
    assert (seen["changed"].sum(1) <= 8).all() and seen["changed"].sum() > 0.6 * 64
    assert torch.isfinite(out["loss"]) and 0 <= out["masked_acc"] <= 1


def test_mpp_refuses_a_corruption_it_cannot_draw():
    # ViT paper B.1.2 / BERT: at least one corrupted patch per image, and a split of them that sums to at most 1
    with pytest.raises(ValueError, match=r"corrupt at least one patch of an image: round\(0.01 x 16\) = 0"):
        make("mpp", corruption_ratio=0.01)
    with pytest.raises(ValueError, match=r"corruption ratio must be in \(0, 1\], got 1.5"):
        make("mpp", corruption_ratio=1.5)
    with pytest.raises(ValueError, match=r"mask_prob \+ random_prob must be <= 1 \(the rest is kept unchanged\), got 0.8 \+ 0.3"):
        make("mpp", random_prob=0.3)
    make("mpp", corruption_ratio=1 / 16, mask_prob=0.5, random_prob=0.5)


def test_mpp_recovers_raw_pixels_from_normalised_views():
    model = make("mpp", mean=[0.3], std=[0.2])
    raw = torch.rand(2, 1, 16, 16)
    assert torch.allclose(model.raw_pixels((raw - 0.3) / 0.2), raw, atol=1e-6)


def test_mocov3_temperature_defaults_to_the_papers_value_for_the_backbone():
    # §4: τ = 0.2 for ViTs, 1.0 for ResNets; an explicit value wins.
    resnet = {"backbone": "resnet18", "backbone_kwargs": {"in_chans": 1, "small_input": True}}
    assert make("mocov3").criterion.temperature == 0.2
    assert make("mocov3", **resnet).criterion.temperature == 1.0
    assert make("mocov3", **resnet, temperature=0.5).criterion.temperature == 0.5


def test_mpp_normalisation_taken_from_the_datamodule_is_restored_from_its_checkpoint(tmp_path):
    # Built without mean/std, MPP takes them from the datamodule at setup; load_from_checkpoint
    # (and the weights ddp_spawn hands back to the main process) must accept them.
    dm = SyntheticDataModule(num_samples=8, num_test_samples=0, img_size=16, in_chans=1, batch_size=4, num_workers=0,
                             mean=(0.3,), std=(0.2,))
    model = MPP(**TINY_BACKBONE, warmup_epochs=0.0)
    assert model.norm_mean.isnan().all()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    trainer.save_checkpoint(tmp_path / "mpp.ckpt")
    restored = MPP.load_from_checkpoint(tmp_path / "mpp.ckpt")
    assert restored.norm_mean.tolist() == pytest.approx([0.3]) and restored.norm_std.tolist() == pytest.approx([0.2])
    fresh = MPP(**TINY_BACKBONE)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.norm_mean, model.norm_mean)


def test_mpp_rejects_resnet_and_says_what_a_hybrid_changes(caplog):
    with pytest.raises(ValueError, match="needs a ViT"):
        MPP(backbone="resnet18", mean=[0.5], std=[0.5])
    import logging

    with caplog.at_level(logging.INFO):
        MPP(backbone="hybrid_r18_vit_tiny", backbone_kwargs={"img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 2},
            mean=[0.5], std=[0.5])
    assert any("MPP on a hybrid" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        make("mpp")
    assert not any("MPP on a hybrid" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- shared machinery


def test_a_run_without_a_length_is_refused():
    views, labels = fixed_views([16])
    with pytest.raises(ValueError, match="the schedules need the length of training"):
        fit_steps(Supervised(**TINY_BACKBONE, num_classes=4), views, labels, steps=2, epochs=-1, max_time="00:00:01:00")


def test_lr_warmup_cosine_and_weight_decay_schedule():
    model = make("supervised", base_lr=0.1, min_lr=0.001, warmup_epochs=2, weight_decay=0.04, weight_decay_end=0.4)
    model.total_steps, model.steps_per_epoch = 100, 10
    model.peak_lr = 0.1 * 512 / 256  # global batch 512
    values = [model.schedule_values(s) for s in range(100)]
    lrs = [v["lr"] for v in values]
    assert lrs[0] == pytest.approx(0.2 / 20) and lrs[19] == pytest.approx(0.2)  # linear warm-up over 20 steps
    assert all(a >= b for a, b in zip(lrs[19:], lrs[20:]))  # then monotone cosine decay
    # DINO cosine_scheduler over the N = 80 post-warm-up steps: min + (peak - min)(1 + cos(pi i / N)) / 2
    for step in (20, 60, 99):
        assert lrs[step] == pytest.approx(0.001 + (0.2 - 0.001) * (1 + math.cos(math.pi * (step - 20) / 80)) / 2)
    assert lrs[-1] > 0.001
    wds = [v["weight_decay"] for v in values]
    assert wds[0] == pytest.approx(0.04)
    assert wds[-1] == pytest.approx(0.4 + (0.04 - 0.4) * (1 + math.cos(math.pi * 99 / 100)) / 2)
    # past the planned end (a run continued beyond it) both stay at their end values, quietly
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (lightly's schedules warn past their max_steps)
        assert model.schedule_values(130) == model.schedule_values(100) == pytest.approx({"lr": 0.001, "weight_decay": 0.4})
    # a weight decay that decays to 0 does (0 is an end value, not "none")
    to_zero = make("supervised", base_lr=0.1, warmup_epochs=0.0, weight_decay=0.04, weight_decay_end=0.0)
    to_zero.total_steps, to_zero.steps_per_epoch = 100, 10
    assert to_zero.schedule_values(100)["weight_decay"] == 0.0
    assert to_zero.schedule_values(50)["weight_decay"] == pytest.approx(0.04 * (1 + math.cos(math.pi * 50 / 100)) / 2)
    # no end value: the weight decay stays where it started for the whole run (MoCo v3's 0.1)
    constant = make("supervised", base_lr=0.1, warmup_epochs=0.0, weight_decay=0.1, weight_decay_end=None)
    constant.total_steps, constant.steps_per_epoch = 100, 10
    assert [constant.schedule_values(s)["weight_decay"] for s in (0, 50, 99, 100, 130)] == pytest.approx([0.1] * 5)


def test_without_warmup_the_cosine_starts_at_the_peak_and_ends_above_min_lr():
    model = make("supervised", base_lr=0.1, min_lr=0.001, warmup_epochs=0.0)
    model.total_steps, model.steps_per_epoch = 50, 10
    model.peak_lr = 0.1
    lrs = [model.schedule_values(s)["lr"] for s in range(50)]
    for step in (0, 17, 49):  # DINO cosine_scheduler with no warm-up: cos(pi i / N), N = 50
        assert lrs[step] == pytest.approx(0.001 + (0.1 - 0.001) * (1 + math.cos(math.pi * step / 50)) / 2)
    assert lrs[-1] > 0.001
    model.total_steps = 1
    assert model.schedule_values(0)["lr"] == pytest.approx(0.1)  # a one-step run learns, at the peak


def test_lr_is_scaled_by_global_batch_over_256_and_set_on_the_optimiser():
    seen = []

    class OptimiserLR(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append([g["lr"] for g in optimizer.param_groups if "fixed_lr" not in g])

    model = make("supervised", base_lr=0.1, warmup_epochs=0.0)
    views, labels = fixed_views([16], batch=16)
    fit_steps(model, views, labels, steps=2, callbacks_extra=[OptimiserLR()])
    peak = 0.1 * 16 / 256
    assert model.peak_lr == pytest.approx(peak)
    # Two steps of the cosine to min_lr 0: the peak, then half of it (cos(pi / 2)).
    assert len(seen) == 2 and all(len(lrs) >= 2 for lrs in seen)  # the decayed and the exempt group
    assert seen == [pytest.approx([peak] * len(seen[0])), pytest.approx([peak / 2] * len(seen[1]))]


def test_warmup_epochs_count_optimiser_steps_under_gradient_accumulation():
    model = make("supervised", warmup_epochs=1.0)
    views, labels = fixed_views([16])
    fit_steps(model, views, labels, steps=8, accumulate_grad_batches=2)  # 8 batches: 4 optimiser steps per epoch
    assert model.global_step == 4 and model.warmup_steps() == 4


def test_optimizer_lars_is_lightlys_lars_with_the_trust_ratio_of_you_et_al():
    from lightly.utils.lars import LARS

    model = make("supervised", optimizer="lars", weight_decay=1e-4, sgd_momentum=0.9)
    opt = model.configure_optimizers()
    assert isinstance(opt, LARS)
    group = next(g for g in opt.param_groups if g["weight_decay"] > 0 and "fixed_lr" not in g)
    p = group["params"][0]
    w, g = p.detach().clone(), torch.randn_like(p)
    for q in model.parameters():
        q.grad = None
    p.grad = g.clone()
    group["lr"] = 0.1
    opt.step()
    # You et al. 2017: local LR eta ||w|| / (||g|| + wd ||w||), eta = 0.001, on g + wd w (first step: no momentum yet)
    local = 0.001 * w.norm() / (g.norm() + 1e-4 * w.norm() + 1e-8)
    torch.testing.assert_close(p.detach(), w - 0.1 * local * (g + 1e-4 * w))


def test_weight_decay_groups_exclude_norms_biases_and_embeddings():
    model = make("mpp", weight_decay=0.05)
    groups = model._param_groups()
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for g in groups if g["weight_decay"] == 0.0 and "fixed_lr" not in g for p in g["params"]}
    decay = {names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert {"backbone.pos_embed", "backbone.cls_token", "mask_token", "backbone.norm.weight", "backbone.blocks.0.attn.qkv.bias"} <= no_decay
    assert "backbone.blocks.0.attn.qkv.weight" in decay and not any(n.startswith("probe.") for n in decay | no_decay)


def test_a_mask_token_of_any_shape_is_a_token_the_rule_exempts():
    from ssl_vit.methods.optim import param_groups

    params = {"head.mask_token": torch.nn.Parameter(torch.zeros(1, 1, 8)), "head.proj.weight": torch.nn.Parameter(torch.zeros(8, 8)),
              "backbone.cls_token": torch.nn.Parameter(torch.zeros(1, 1, 8))}
    for rule, exempt in (("bias_norm_tokens", {"head.mask_token", "backbone.cls_token"}), ("bias_norm", set())):
        groups = param_groups(params.items(), rule, {"backbone.cls_token"}, 0.05, set(), 1e-3, lambda p: p.shape)
        undecayed = {n for g in groups if g["weight_decay"] == 0.0 for p in g["params"] for n, q in params.items() if q is p}
        assert undecayed == exempt, rule


def test_each_method_decays_the_parameters_its_reference_decays():
    def groups(model):
        names = {id(p): n for n, p in model.named_parameters()}
        decay = {names[id(p)] for g in model._param_groups() if g["weight_decay"] > 0 for p in g["params"]}
        return decay, {n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("probe.")} - decay

    # DINO utils.get_params_groups: all but biases and 1-D parameters; [CLS] and positions decayed.
    decay, no_decay = groups(make("dino", weight_decay=0.04))
    assert {"backbone.pos_embed", "backbone.cls_token", "backbone.blocks.0.attn.qkv.weight"} <= decay
    assert {"backbone.norm.weight", "backbone.blocks.0.attn.qkv.bias"} <= no_decay
    # MoCo v3 main_moco.py: AdamW(model.parameters(), weight_decay=0.1): every parameter.
    decay, no_decay = groups(make("mocov3", weight_decay=0.1))
    assert not no_decay and {"backbone.norm.weight", "backbone.pos_embed", "predictor.layers.0.weight"} & decay
    # The rule is an argument like any other.
    decay, no_decay = groups(make("mocov3", weight_decay=0.1, weight_decay_exempt="bias_norm_tokens"))
    assert {"backbone.pos_embed", "backbone.norm.weight"} <= no_decay


@pytest.mark.parametrize("method, expected", [
    # main_dino.py's defaults
    ("dino", {"base_lr": 5e-4, "min_lr": 1e-6, "weight_decay": 0.04, "weight_decay_end": 0.4, "grad_clip": 3.0, "grad_clip_mode": "per_param",
              "warmup_epochs": 10.0}),
    # MoCo v3's ViT recipe (its CONFIG.md)
    ("mocov3", {"base_lr": 1.5e-4, "weight_decay": 0.1, "warmup_epochs": 40.0, "weight_decay_exempt": "none"}),
    # The ViT paper's LRs are at batch 4096, ours per 256 images (the linear scaling rule). MPP, Appendix B.1.2: Adam,
    # base LR 2e-4 (its weight decay is Table 3's JFT value, 0.1); supervised ViT-B/16 on ImageNet, Table 3: LR 3e-3,
    # weight decay 0.3, global-norm clipping at 1.
    ("mpp", {"base_lr": 2e-4 * 256 / 4096, "weight_decay": 0.1}),
    ("supervised", {"base_lr": 3e-3 * 256 / 4096, "weight_decay": 0.3, "grad_clip": 1.0, "grad_clip_mode": "global"}),
])
def test_each_method_defaults_to_its_papers_optimisation(method, expected):
    hp = METHODS[method](**TINY_BACKBONE, num_classes=4, **SMALL_HEADS[method]).hparams
    assert {k: hp[k] for k in expected} == expected


@pytest.mark.parametrize("mode", ["global", "per_param"])
def test_gradient_clipping_leaves_the_online_probe_out(mode):
    torch.manual_seed(0)
    model = make("supervised", grad_clip=0.05, grad_clip_mode=mode)
    with torch.no_grad():
        model.classifier.weight.normal_()
    views, labels = fixed_views([16])
    out = model.step(views, labels)
    probe_loss, _ = model.probe.training_loss(out["features"], labels)
    (out["loss"] + probe_loss * 100).backward()  # a probe gradient far larger than the model's
    own = [p for n, p in model.named_parameters() if p.grad is not None and not n.startswith("probe.")]
    probe = [p.grad.clone() for p in model.probe.parameters() if p.grad is not None]
    expected = [p.grad.clone() for p in own]
    torch.nn.utils.clip_grad_norm_(own, 0.05) if mode == "global" else [torch.nn.utils.clip_grad_norm_([p], 0.05) for p in own]
    clipped = [p.grad.clone() for p in own]
    for p, g in zip(own, expected):
        p.grad.copy_(g)
    optimizer = torch.optim.AdamW(model._param_groups())
    model.on_before_optimizer_step(optimizer)
    for p, g in zip(own, clipped):
        torch.testing.assert_close(p.grad, g)
    for p, g in zip([p for p in model.probe.parameters() if p.grad is not None], probe):
        torch.testing.assert_close(p.grad, g)


def test_lars_is_refused_under_fsdp(monkeypatch):
    from ssl_vit.methods import distributed

    model = make("supervised", optimizer="lars")
    model.trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert isinstance(model.configure_optimizers(), torch.optim.Optimizer)  # one process: fine
    monkeypatch.setattr(distributed, "gradient_shard_group", lambda strategy: object())  # as under FSDP
    with pytest.raises(ValueError, match="'lars' does not run under FSDP"):
        model.configure_optimizers()


def test_online_probe_reports_accuracy_without_touching_the_backbone():
    torch.manual_seed(0)
    model = make("mocov3")
    views, labels = fixed_views([16, 16])
    out = model.step(views, labels)
    loss, acc = model.probe.training_loss(out["features"], labels)
    model.zero_grad()
    loss.backward()
    assert all(p.grad is None for p in model.backbone.parameters())
    assert 0.0 <= float(acc) <= 1.0
    unlabelled = torch.full_like(labels, -1)
    assert model.probe.training_loss(out["features"], unlabelled) == (None, None)


def test_nonfinite_loss_stops_with_the_step_or_skips():
    class Exploding(Supervised):
        def step(self, views, labels):
            out = super().step(views, labels)
            if self.global_step == 2:
                out["loss"] = out["loss"] * float("nan")
            return out

    views, labels = fixed_views([16])
    with pytest.raises(NonFiniteLossError, match="non-finite loss .* at step 2.*no checkpoint was written yet"):
        fit_steps(Exploding(**TINY_BACKBONE, num_classes=4, warmup_epochs=0.0), views, labels, steps=5)
    model = Exploding(**TINY_BACKBONE, num_classes=4, warmup_epochs=0.0, nonfinite_policy="skip")
    losses = fit_steps(model, views, labels, steps=5)
    assert model.skipped_batches == 1 and len(losses) == 5 and all(math.isfinite(v) for v in losses)


def test_the_skip_policy_raises_once_its_budget_is_spent():
    class AlwaysNaN(Supervised):
        def step(self, views, labels):
            out = super().step(views, labels)
            if self.global_step >= 1:
                out["loss"] = out["loss"] * float("nan")
            return out

    views, labels = fixed_views([16])
    model = AlwaysNaN(**TINY_BACKBONE, num_classes=4, warmup_epochs=0.0, nonfinite_policy="skip", max_skipped_batches=2)
    with pytest.raises(NonFiniteLossError, match=r"at step 3 .*\(2 batch\(es\) already skipped, the limit\)"):
        fit_steps(model, views, labels, steps=6)
    assert model.skipped_batches == 2
    # a budget of 0 is a valid one: skip nothing, stop at the first non-finite loss
    none = AlwaysNaN(**TINY_BACKBONE, num_classes=4, warmup_epochs=0.0, nonfinite_policy="skip", max_skipped_batches=0)
    with pytest.raises(NonFiniteLossError, match=r"at step 1 .*\(0 batch\(es\) already skipped, the limit\)"):
        fit_steps(none, views, labels, steps=6)
    assert none.skipped_batches == 0


@pytest.mark.parametrize("warmup, line, note", [
    ({"warmup_epochs": 9.9}, ", LR warm-up 99 steps (warmup_epochs 9.9 x 10)", None),
    ({"warmup_epochs": 0}, "", None),
    ({"warmup_epochs": 10}, ", LR warm-up 100 steps (warmup_epochs 10 x 10)",
     "the LR warm-up, warmup_epochs 10 = 100 steps, spans the whole run of 100 steps: its LR rises to the peak at the last step and "
     "the cosine never starts (set a shorter warm-up)"),
    ({"warmup_epochs": 10.1}, ", LR warm-up 101 steps (warmup_epochs 10.1 x 10)",
     "the LR warm-up, warmup_epochs 10.1 = 101 steps, is longer than the run of 100 steps and is cut to it: its LR rises to the peak "
     "at the last step and the cosine never starts (set a shorter warm-up)"),
    # Issue 31: epochs on a small folder make few steps: a warm-up under 20 steps is named, with what to set instead.
    ({"warmup_epochs": 1.9}, ", LR warm-up 19 steps (warmup_epochs 1.9 x 10)",
     "the LR warm-up, warmup_epochs 1.9 = 19 steps at 10 per epoch, is short: the LR reaches its peak after 19 step(s), too soon to "
     "keep the first steps from diverging (set warmup_steps: 20 or more, which replaces warmup_epochs)"),
    ({"warmup_epochs": 2}, ", LR warm-up 20 steps (warmup_epochs 2 x 10)", None),
    ({"warmup_epochs": 0.04}, "",
     "the LR warm-up, warmup_epochs 0.04 = 0 steps at 10 per epoch, is short: the LR starts at its peak, too soon to keep the first "
     "steps from diverging (set warmup_steps: 20 or more, which replaces warmup_epochs)"),
    # warmup_steps, when set, replaces warmup_epochs (both set: the steps win, and the line says so); a count of steps is taken as meant
    ({"warmup_epochs": 1, "warmup_steps": 5}, ", LR warm-up 5 steps (warmup_steps; warmup_epochs is then not used)", None),
    ({"warmup_steps": 0}, ", LR warm-up 0 steps (warmup_steps; warmup_epochs is then not used)", None),
    ({"warmup_steps": 120}, ", LR warm-up 120 steps (warmup_steps; warmup_epochs is then not used)",
     "the LR warm-up, warmup_steps 120, is longer than the run of 100 steps and is cut to it: its LR rises to the peak at the last step "
     "and the cosine never starts (set a shorter warm-up)"),
])
def test_the_start_line_says_the_warmup_and_notes_one_too_short_or_as_long_as_the_run(warmup, line, note):
    model = make("dino", momentum=0.9, **warmup)  # (a teacher that keeps nothing of its initialisation: no note of its own)
    model.total_steps, model.steps_per_epoch, model.global_batch_size, model.peak_lr = 100, 10, 16, 0.1
    model._trainer = SimpleNamespace(world_size=2, accumulate_grad_batches=1, global_step=0)
    lines = model._start_notes(per_device=8)
    assert lines[0] == ("[ssl_vit] DINO on vit: effective batch size 16 = 8 per device x 2 device(s) x 1 accumulation; lr = base_lr 0.02 x "
                        f"16/256 = 0.1; 100 optimiser steps (10 per epoch){line}")
    assert lines[1:] == ([] if note is None else [f"[ssl_vit] note: {note}"])
    assert model.schedule_values(0)["lr"] == pytest.approx(0.1 / min(model.warmup_steps(), 100) if model.warmup_steps() else 0.1)
    model._resumed = {"total_steps": 80, "global_batch_size": 32}  # a resume with another length and batch: both said
    assert ["resumed a run planned for 80" in ln or "effective batch size of 32" in ln for ln in model._start_notes(8)].count(True) == 2


@pytest.mark.parametrize("momentum, total, kept", [(0.99, 150, "47 %"), (0.99, 702, None), (0.996, 125_000, None), (0.9, 10, "56 %"),
                                                    (0.99, 3, None)])  # (a smoke run: no note)
def test_a_dino_teacher_still_mostly_its_initialisation_at_the_end_is_named_with_a_momentum_that_is_not(momentum, total, kept):
    # Its initialisation's weight in the teacher: the product over the steps of lightly's cosine momentum schedule.
    model = make("dino", momentum=momentum)
    model.total_steps, model.steps_per_epoch, model.global_batch_size, model.peak_lr = total, 10, 16, 0.1
    model._trainer = SimpleNamespace(world_size=1, accumulate_grad_batches=1, global_step=0)
    exact = math.prod(cosine_schedule(t, total + 1, momentum, 1.0) for t in range(total))
    notes = [ln for ln in model._start_notes(8) if "DINO's teacher" in ln]
    if kept is None:
        assert notes == [] and (exact < 0.05 or total < 10)
        return
    assert exact == pytest.approx(float(kept[:-2]) / 100, abs=0.01)
    (note,) = notes
    assert f"keeps about {kept} of its random initialisation after {total} steps of momentum {momentum:g} -> 1" in note
    suggested = float(note.split("set momentum to ")[1].split()[0])
    assert math.prod(cosine_schedule(t, total + 1, suggested, 1.0) for t in range(total)) <= 0.011


def test_a_checkpoint_carries_the_step_seed_and_the_spent_skip_budget_to_the_resumed_run():
    """An unseeded run draws a new seed at each launch: the resumed one must take the checkpoint's
    (its drop path and masks are functions of it), and the non-finite skip budget spans resumes."""
    model = Supervised(**TINY_BACKBONE, num_classes=4, nonfinite_policy="skip", max_skipped_batches=3)
    model.seed, model.skipped_batches = 1234, 3
    checkpoint: dict = {}
    model.on_save_checkpoint(checkpoint)
    resumed = Supervised(**TINY_BACKBONE, num_classes=4, nonfinite_policy="skip", max_skipped_batches=3)
    resumed.seed = 99  # what this launch would have drawn
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.seed == 1234 and resumed.skipped_batches == 3
    resumed._trainer = SimpleNamespace(global_step=7, current_epoch=0, global_rank=0, checkpoint_callback=None)
    with pytest.raises(NonFiniteLossError, match="at step 7 .*3 batch\\(es\\) already skipped"):
        resumed._skip_or_raise(torch.tensor(float("nan")))


@pytest.mark.parametrize("name", ["dino", "mocov3"])
def test_a_skipped_batch_leaves_every_weight_buffer_and_ema_target_as_it_was(name):
    """The state after the skipped step 2 is the state after step 1, exactly: the online weights,
    the momentum encoder / teacher (no EMA update), DINO's centre and the BatchNorm statistics;
    the next step trains again."""
    cls = {"dino": DINO, "mocov3": MoCoV3}[name]

    class Exploding(cls):
        def step(self, views, labels):
            if self.global_step == 2:  # a batch that overflows: every output NaN
                views = [v * float("nan") for v in views]
            return super().step(views, labels)

    states = []

    class Snapshot(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            states.append({k: v.clone() for k, v in pl_module.state_dict().items()})

    torch.manual_seed(0)
    extra = {"use_bn_in_head": True} if name == "dino" else {}
    model = Exploding(**TINY_BACKBONE, num_classes=4, warmup_epochs=0.0, nonfinite_policy="skip", momentum=0.9,
                      momentum_end=0.9, **extra, **SMALL_HEADS[name])
    views, labels = fixed_views(VIEW_SIZES[name])
    losses = fit_steps(model, views, labels, steps=4, callbacks_extra=[Snapshot()])
    assert model.skipped_batches == 1 and all(math.isfinite(v) for v in losses)
    targets = [k for k in states[1] if k.startswith(("teacher", "momentum"))]
    buffers = {n for n, _ in model.named_buffers()}
    assert targets and buffers & set(states[1]) - {k for k in buffers if k.endswith("num_batches_tracked")}
    assert all(torch.equal(states[1][k], states[2][k]) for k in states[1]), [k for k in states[1] if not torch.equal(states[1][k], states[2][k])]
    assert not all(torch.equal(states[2][k], states[3][k]) for k in targets)  # step 3 trains (and moves the target)


def test_supervised_needs_labels(tmp_path):
    with pytest.raises(ValueError, match=r"needs at least 2 classes; the data has none \(num_classes unset\)"):
        Supervised(**TINY_BACKBONE)
    # A datamodule that says it has unlabelled training images is refused before training ...
    for i in range(4):
        Image.new("L", (16, 16), 40 * i).save(tmp_path / f"{i}.png")
    flat = ImageFolderDataModule(str(tmp_path), img_size=16, in_chans=1, batch_size=2, num_workers=0,
                                 views=SingleView(size=16))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="needs labels, but 4 training images of ImageFolderDataModule have none"):
        trainer.fit(Supervised(**TINY_BACKBONE, num_classes=4), datamodule=flat)
    # ... and any other data when a batch holds unlabelled samples (label -1).
    views, labels = fixed_views([16])
    labels[3] = -1
    with pytest.raises(ValueError, match="unlabelled samples"):
        fit_steps(Supervised(**TINY_BACKBONE, num_classes=4), views, labels, steps=1)


def test_methods_refuse_views_they_cannot_train_on_and_unknown_backbones():
    # check_views: what the recipe checks ask before training
    with pytest.raises(ValueError, match="MoCo v3 needs two views per image, got 1"):
        make("mocov3").check_views(1)
    make("mocov3").check_views(2)
    with pytest.raises(ValueError, match="DINO needs at least 2 views"):
        make("dino").check_views(1)
    with pytest.raises(ValueError, match=r"and n_global_crops >= 1"):
        make("dino", n_global_crops=0).check_views(4)
    make("dino").check_views(2)
    with pytest.raises(ValueError, match="unknown backbone"):
        MoCoV3(backbone="vit_gigantic")


def test_validation_accuracy_is_over_the_labelled_images_of_the_epoch():
    # An unreadable test image comes labelled -1: each batch's accuracy is over its labelled
    # images, weighted by their number, so the epoch's value counts every labelled image once.
    model = Supervised(**TINY_BACKBONE, num_classes=4)
    with torch.no_grad():
        model.classifier.bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # always class 0
    images = torch.randn(4, 1, 16, 16)
    batches = [(images, torch.tensor([0, 0, -1, -1])), (images, torch.tensor([1, 1, 1, 0]))]
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (metrics,) = trainer.validate(model, dataloaders=DataLoader(RepeatList(batches), batch_size=None), verbose=False)
    assert metrics["val/acc"] == pytest.approx((2 * 1.0 + 4 * 0.25) / 6)  # not the batches' mean, 0.625


class RepeatList(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


# ----------------------------------------------------------------------------- wiring of each step
# (how a method's step connects views, encoders, tokens and schedules: each test recomputes the
# paper's quantity from the modules by hand)


def _ctr(q: torch.Tensor, k: torch.Tensor, tau: float) -> torch.Tensor:
    """MoCo v3 Alg. 1 ctr(q, k), written out: 2τ · CE(q̂ k̂ᵀ / τ, arange)."""
    q, k = torch.nn.functional.normalize(q, dim=1), torch.nn.functional.normalize(k, dim=1)
    return 2 * tau * torch.nn.functional.cross_entropy(q @ k.T / tau, torch.arange(q.shape[0]))


def test_mocov3_contrasts_each_views_query_with_the_other_views_key():
    # MoCo v3 Alg. 1: loss = ctr(q1, k2) + ctr(q2, k1): a query's positive is the momentum
    # encoder's key of the *other* view of its image.
    torch.manual_seed(0)
    model = make("mocov3")
    views, labels = fixed_views([16, 16], batch=8)
    x1, x2 = views
    x2 = x2.flip(-1)  # views that differ, so pairing a query with its own view's key shows
    loss = model.step([x1, x2], labels)["loss"]
    with torch.no_grad():
        q1, q2 = (model.predictor(model.projector(model.backbone(x))) for x in (x1, x2))
        k1, k2 = (model.momentum_projector(model.momentum_backbone(x)) for x in (x1, x2))
    tau = model.criterion.temperature
    assert loss.item() == pytest.approx((_ctr(q1, k2, tau) + _ctr(q2, k1, tau)).item(), rel=1e-5)
    assert loss.item() != pytest.approx((_ctr(q1, k1, tau) + _ctr(q2, k2, tau)).item(), rel=1e-3)


def test_mpp_head_reads_the_output_tokens_of_the_corrupted_patches(monkeypatch):
    # ViT paper B.1.2: each corrupted patch's colour is predicted from that patch's own output
    # token ([CLS] aside), not a neighbour's.
    import ssl_vit.methods.mpp as mpp_module

    torch.manual_seed(0)
    model = make("mpp")
    plans, seen = [], {}
    real_plan = mpp_module.make_corruption_plan
    monkeypatch.setattr(mpp_module, "make_corruption_plan", lambda *a, **k: plans.append(real_plan(*a, **k)) or plans[-1])
    model.backbone.norm.register_forward_hook(lambda m, i, o: seen.setdefault("tokens", o.detach()))
    model.head.register_forward_hook(lambda m, i, o: seen.setdefault("head_in", i[0].detach()))
    x = fixed_views([16], batch=4)[0][0].clamp(-1, 1)
    model.step([x], torch.zeros(4, dtype=torch.long))
    tokens, idx = seen["tokens"], plans[0].corrupted_idx  # [B, 1+N, D], [B, k]
    expected = torch.stack([tokens[b, 1 + idx[b]] for b in range(4)])  # patch n is token 1 + n
    assert torch.equal(seen["head_in"], expected)


def test_the_ema_momentum_of_each_step_follows_the_cosine_from_its_first_step():
    # MoCo v3 / DINO: a cosine from m0 to 1 over the optimiser steps t = 0..T-1, t = 0 first;
    # m_t = 1 - (1 - m0)(cos(πt/T) + 1)/2 (DINO momentum_schedule, MoCo v3 adjust_moco_momentum).
    model = make("dino", momentum=0.9)
    seen = []

    class Momentum(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.append(float(trainer.callback_metrics["train/ema_momentum"]))

    views, labels = fixed_views([16, 16, 8, 8], batch=4)
    fit_steps(model, views, labels, steps=5, callbacks_extra=[Momentum()])
    expected = [1 - 0.1 * (math.cos(math.pi * t / 5) + 1) / 2 for t in range(5)]
    assert seen == pytest.approx(expected)


def test_the_optimisers_weight_decay_follows_the_cosine_schedule_on_the_decayed_group():
    # DINO: weight decay cosine 0.04 -> 0.4, applied to the optimiser at every step (not only
    # computed); biases and norms stay at 0.
    model = make("dino", weight_decay=0.04, weight_decay_end=0.4)
    seen = []

    class WeightDecay(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(sorted(g["weight_decay"] for g in optimizer.param_groups))

    views, labels = fixed_views([16, 16, 8, 8], batch=4)
    fit_steps(model, views, labels, steps=3, callbacks_extra=[WeightDecay()])
    # groups: no-decay 0, probe 0, decayed; the decayed one on DINO's cosine_scheduler, i / N of N = 3
    assert [row[-1] for row in seen] == pytest.approx([0.4 + (0.04 - 0.4) * (1 + math.cos(math.pi * t / 3)) / 2 for t in range(3)])
    assert all(row[:-1] == [0.0, 0.0] for row in seen)


def test_dinos_online_probe_and_collapse_monitor_read_the_first_global_crop():
    torch.manual_seed(0)
    model = make("dino")
    views, labels = fixed_views([16, 16, 8, 8], batch=4)
    views[1] = views[1].flip(-1)
    out = model.step(views, labels)
    with torch.no_grad():
        assert torch.allclose(out["features"], model.backbone(views[0]), atol=1e-6)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_online_probe_trains_on_the_representation_it_is_validated_on(method):
    # validation_step probes backbone(images), pooled by the backbone's global_pool; the training
    # features must be pooled the same way (here the patch mean, not the [CLS] token).
    torch.manual_seed(0)
    model = make(method, backbone_kwargs={**TINY_BACKBONE["backbone_kwargs"], "global_pool": "avg"})
    views, labels = fixed_views(VIEW_SIZES[method], batch=4)
    views = [v.clamp(-1, 1) for v in views]
    calls = []
    original = model.backbone.forward_features

    def spy(x, *args, **kwargs):
        calls.append(original(x, *args, **kwargs))
        return calls[-1]

    model.backbone.forward_features = spy
    out = model.step(views, labels)
    first = calls[0][:4]  # [B, 1+N, D]: the first view's tokens as the step saw them
    assert torch.allclose(out["features"], first[:, 1:].mean(1), atol=1e-6)
    assert not torch.allclose(out["features"], first[:, 0], atol=1e-3)


def test_a_batch_of_bare_images_is_refused_by_name():
    # A plain (images, labels) loader instead of a view transform's (views, labels): the images
    # would be unpacked along the batch as if they were views.
    model = make("supervised")
    with pytest.raises(TypeError, match=r"a training batch must be \(views, labels\) with views a list of \[B, C, H, W\] tensors.*got tuple of Tensor, Tensor"):
        model.training_step((torch.randn(4, 1, 16, 16), torch.zeros(4, dtype=torch.long)), 0)


def test_a_methods_other_scalars_are_logged_under_train_once():
    class Extra(Supervised):
        def step(self, views, labels):
            out = super().step(views, labels)
            return {**out, "z_std": torch.tensor(1.0), "train/already": torch.tensor(2.0)}

    seen = {}

    class Logged(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.update(trainer.callback_metrics)

    fit_steps(Extra(**TINY_BACKBONE, num_classes=4), *fixed_views([16]), steps=1, callbacks_extra=[Logged()])
    assert seen["train/z_std"] == 1.0 and seen["train/already"] == 2.0 and "train/train/already" not in seen


def test_a_warmup_longer_than_the_run_is_cut_to_it():
    model = make("supervised", base_lr=0.1, warmup_steps=120)
    model.total_steps, model.peak_lr = 12, 0.1
    lrs = [model.schedule_values(s)["lr"] for s in range(12)]
    assert lrs == pytest.approx([0.1 * (t + 1) / 12 for t in range(12)])  # peak·(t + 1)/W with W = 12, not 120


def test_a_checkpoints_record_restores_what_the_run_did_not_give_again():
    """The recipe of the resumed invocation (its new length or batch) wins over the checkpoint's;
    a module loaded from Python takes the checkpoint's. The epochs trained come from the loader's
    position, else from optimiser steps over steps per epoch (to 4 decimals)."""
    record = {"ssl_vit": {"recipe": "model: {old: 1}", "seed": 7, "skipped_batches": 2, "global_batch_size": 64, "total_steps": 100}}
    resumed = Supervised(**TINY_BACKBONE, num_classes=4)
    resumed.recipe = "model: {new: 2}"
    resumed.on_load_checkpoint(record)
    assert resumed.recipe == "model: {new: 2}"
    assert (resumed.seed, resumed.skipped_batches, resumed._resumed) == (7, 2, {"global_batch_size": 64, "total_steps": 100})
    loaded = Supervised(**TINY_BACKBONE, num_classes=4)
    loaded.on_load_checkpoint(record)
    assert loaded.recipe == "model: {old: 1}"

    model = Supervised(**TINY_BACKBONE, num_classes=4)
    assert model.epochs_done() is None  # no trainer
    model.steps_per_epoch = 3
    model._trainer = SimpleNamespace(train_dataloader=[], global_step=7)
    assert model.epochs_done() == 2.3333
    model._trainer = SimpleNamespace(train_dataloader=SimpleNamespace(epochs_done=lambda: 1.234567), global_step=7)
    assert model.epochs_done() == 1.2346


def test_one_class_has_no_online_probe_and_the_probe_learns_beside_the_method():
    assert MPP(mean=[0.5], std=[0.25], **TINY_BACKBONE, num_classes=1).probe is None  # nothing to tell apart
    model = MPP(mean=[0.5], std=[0.25], **TINY_BACKBONE, num_classes=2)
    probe_before = {k: v.detach().clone() for k, v in model.probe.named_parameters()}  # (not its BatchNorm's running stats)
    seen = []

    class Logged(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in ("train/lr", "probe/train_loss")})

    views, labels = fixed_views([16])
    fit_steps(model, views, labels % 2, steps=2, callbacks_extra=[Logged()])
    after = dict(model.probe.named_parameters())
    assert probe_before and all(not torch.equal(v, after[k]) for k, v in probe_before.items())  # it trained
    assert [set(s) for s in seen] == [{"train/lr", "probe/train_loss"}] * 2
    assert seen[0]["train/lr"] == pytest.approx(model.schedule_values(0)["lr"])


def teststeps_per_epoch_count_a_last_partial_accumulation_and_the_warmup_rounds():
    model = Supervised(**TINY_BACKBONE, num_classes=4, warmup_epochs=0.9)
    # 5 batches per epoch, 2 per optimiser step: Lightning steps after batches 2, 4 and the epoch's last
    model._trainer = SimpleNamespace(estimated_stepping_batches=30, num_training_batches=5, accumulate_grad_batches=2)
    model.on_train_start()
    assert (model.total_steps, model.steps_per_epoch, model.warmup_steps()) == (30, 3, 3)  # 0.9 x 3 = 2.7 -> 3


def test_each_batch_is_seeded_from_the_run_seed_epoch_batch_and_process(monkeypatch):
    import ssl_vit.methods.base as base

    keys = []
    monkeypatch.setattr(base, "seed_training_step", lambda *key: keys.append(key))
    model = Supervised(**TINY_BACKBONE, num_classes=4)
    model.seed = 11
    model._trainer = SimpleNamespace(current_epoch=3, global_rank=1)
    model._seed_step(5)
    assert keys == [(11, 3, 5, 1)]


def test_a_validation_split_without_labels_logs_no_metric():
    model = Supervised(**TINY_BACKBONE, num_classes=4)
    model._trainer = SimpleNamespace(world_size=1)
    logged = {}
    model.log = lambda name, value, **kwargs: logged.__setitem__(name, float(value))
    model._val_totals = {"probe/val_acc": torch.tensor([0.0, 0.0]), "val/loss": torch.tensor([3.0, 4.0])}  # [value sum, images]
    model.on_validation_epoch_end()
    assert logged == {"val/loss": 0.75}  # (not a 0/0 accuracy)
