"""The methods' steps and the ViT backbone against independent references (the ViT paper's 3-bit
mean-colour target and 80/10/10 corruption written out, lightly's DINO loss and ``update_momentum``,
DINO's and MoCo v3's target initialisation, torch's label-smoothed cross-entropy written out, timm's
VisionTransformer init and its training-mode drop path / attention dropout): each test fails on a
plausible one-line change to the code it pins (a fifth mutation pass)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import lightly.models.modules.center as lightly_center
import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_BACKBONE, fit_steps, fixed_views
from timm.models.vision_transformer import VisionTransformer as TimmViT

import ssl_vit.methods.mpp as mpp_module
from ssl_vit.backbones import VisionTransformer
from ssl_vit.losses import DINOLoss
from ssl_vit.methods import DINO, MPP, MoCoV3, Supervised

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*")  # lightning internals, not ours

COMMON = {**TINY_BACKBONE, "num_classes": 4, "warmup_epochs": 0.0, "base_lr": 0.02, "weight_decay": 0.0}
SMALL_DINO = {"out_dim": 64, "hidden_dim": 32, "bottleneck_dim": 16}
SMALL_MOCO = {"proj_hidden_dim": 32, "pred_hidden_dim": 32, "proj_output_dim": 16}


def _spy_plans(monkeypatch) -> list:  # noqa: ANN001
    """Record the corruption plans MPP draws (the real function does the drawing)."""
    plans = []
    real = mpp_module.make_corruption_plan
    monkeypatch.setattr(mpp_module, "make_corruption_plan", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    return plans


# ----------------------------------------------------------------------------- MPP
def _mean_color_ids(raw: np.ndarray, p: int) -> np.ndarray:
    """ViT paper B.1.2, written out: per patch (row-major) the mean R, G, B of the raw pixels in
    [0, 1], each quantised to 3 bits (8 levels), read as one of 512 classes (R most significant)."""
    b, c, h, w = raw.shape
    ids = np.zeros((b, (h // p) * (w // p)), dtype=np.int64)
    for i in range(b):
        for r in range(h // p):
            for col in range(w // p):
                digits = [min(int(math.floor(8 * raw[i, ch, r * p:(r + 1) * p, col * p:(col + 1) * p].mean())), 7) for ch in range(c)]
                ids[i, r * (w // p) + col] = sum(d * 8 ** (c - 1 - ch) for ch, d in enumerate(digits))
    return ids


def test_mpp_step_loss_is_the_cross_entropy_of_the_raw_mean_colours_of_the_corrupted_patches(monkeypatch):
    """ViT paper B.1.2: the target of a corrupted patch is the 3-bit mean colour of its raw
    pixels (the view's per-channel normalisation undone), cross-entropy on the corrupted patches
    only, predicted from their own output tokens; the probe reads [CLS] of the corrupted pass."""
    torch.manual_seed(0)
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    model = MPP(**{**COMMON, "backbone_kwargs": {**TINY_BACKBONE["backbone_kwargs"], "in_chans": 3}}, mean=mean, std=std)
    plans = _spy_plans(monkeypatch)
    raw = torch.rand(4, 3, 16, 16)
    x = (raw - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    out = model.step([x], torch.zeros(4, dtype=torch.long))
    plan = plans[0]
    with torch.no_grad():
        tokens = model.backbone.forward_features(x, patch_hook=lambda t: plan.apply(t, model.mask_token))  # [B, 17, D]
        logits = model.head(tokens[:, 1:])  # [B, 16, 512]
    target = torch.from_numpy(_mean_color_ids(raw.double().numpy(), 4))  # [B, 16]
    ce = F.cross_entropy(logits.reshape(-1, 512), target.reshape(-1), reduction="none").reshape(4, 16)
    assert out["loss"].item() == pytest.approx(ce[plan.corrupted].mean().item(), rel=1e-5)
    torch.testing.assert_close(out["features"], tokens[:, 0])


def test_mpp_step_corrupts_with_the_papers_80_10_10_split():
    """ViT paper B.1.2 (BERT's rule): of the corrupted half of the patch embeddings, 80 % become
    the shared [mask] embedding, 10 % another patch's embedding, 10 % stay as they are."""
    torch.manual_seed(0)
    model = MPP(**COMMON, mean=[0.5], std=[0.5])
    model.mask_token.data.fill_(3.0)  # unlike any patch embedding
    seen = {}
    original = model.backbone.forward_features

    def spy(x, patch_hook=None):  # noqa: ANN001, ANN202
        tokens, _ = model.backbone.patch_embed(x)
        seen["before"], seen["after"] = tokens.detach(), patch_hook(tokens).detach()
        return original(x, patch_hook=patch_hook)

    model.backbone.forward_features = spy
    x = torch.rand(64, 1, 16, 16) * 2 - 1
    model.step([x], torch.zeros(64, dtype=torch.long))
    before, after = seen["before"], seen["after"]  # [64, 16, D]
    flat = before.reshape(-1, before.shape[-1])  # [B*N, D]
    masked = (after == model.mask_token.detach()).all(-1)  # [64, 16]
    copied = (after != before).any(-1) & ~masked
    # every other replacement is the embedding of some patch of the batch
    assert all((after[i, j] == flat).all(-1).any() for i, j in copied.nonzero().tolist())
    corrupted = 64 * 16 // 2  # 512: 80 % -> 410 +- 9, 10 % -> 51 +- 7
    assert 0.72 < masked.sum().item() / corrupted < 0.88
    assert 0.04 < copied.sum().item() / corrupted < 0.16


# ----------------------------------------------------------------------------- DINO
def test_dino_step_is_the_papers_loss_of_the_teacher_and_student_outputs_and_its_monitors_use_that_centre():
    """DINO Alg. 1: the teacher (global crops only) against the
    student (every crop), τ_t of epoch 0 = 0.04, the centre before this batch's update; the
    collapse monitors (§5.3) read the first global crop with the same centre."""
    torch.manual_seed(0)
    model = DINO(**COMMON, **SMALL_DINO)
    model.criterion.center.normal_(0, 0.5)
    c0 = model.criterion.center.clone()
    views, labels = fixed_views([16, 16, 8, 8], batch=4)
    views = [views[0], views[1].flip(-1), views[2], views[3].flip(-2)]  # four different crops
    with torch.no_grad():
        teacher = list(model.teacher_head(model.teacher_backbone(torch.cat(views[:2]))).chunk(2))
        feats = [model.backbone(v) for v in views]
        student = [model.head(f) for f in feats]
    # DINO Alg. 1, written out (our DINOLoss is lightly's, so lightly would be no second opinion):
    # the mean over pairs (teacher view t, student view s), s != t, of H(P_t, P_s).
    pairs = [-(F.softmax((t.double() - c0.double()) / 0.04, dim=-1) * F.log_softmax(s.double() / 0.1, dim=-1)).sum(-1).mean()
             for i, t in enumerate(teacher) for j, s in enumerate(student) if i != j]
    want = torch.stack(pairs).mean()
    out = model.step(views, labels)
    assert len(pairs) == 6 and out["loss"].item() == pytest.approx(want.item(), rel=1e-5)
    p_t = F.softmax((teacher[0] - c0.reshape(1, -1)) / 0.04, dim=-1).double()
    log_p_s = F.log_softmax(student[0] / 0.1, dim=-1).double()
    entropy = -(p_t * p_t.clamp_min(1e-300).log()).sum(-1).mean()
    assert out["teacher_entropy"].item() == pytest.approx(entropy.item(), rel=1e-4, abs=1e-6)
    assert out["teacher_student_kl"].item() == pytest.approx((-(p_t * log_p_s).sum(-1).mean() - entropy).item(), rel=1e-4)
    z = F.normalize(feats[0], dim=1)
    assert out["embedding_std"].item() == pytest.approx(z.std(dim=0).mean().item(), rel=1e-5)


def test_dino_teacher_temperature_follows_the_epoch_not_the_step():
    """main_dino.py: teacher_temp_schedule = linspace(0.04, 0.07, 30)[epoch], one value for all
    the steps of an epoch."""
    torch.manual_seed(0)
    model = DINO(**COMMON, **SMALL_DINO)
    seen = []

    class Temperature(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):  # noqa: ANN001, ANN002, ANN202
            seen.append(float(trainer.callback_metrics["train/teacher_temp"]))

    views, labels = fixed_views([16, 16, 8, 8], batch=4)
    fit_steps(model, views, labels, steps=2, epochs=2, callbacks_extra=[Temperature()])
    schedule = np.linspace(0.04, 0.07, 30)
    assert seen == pytest.approx([schedule[0]] * 2 + [schedule[1]] * 2)


def test_deferred_dino_centre_is_the_mean_of_the_all_reduced_batch_means(monkeypatch):
    """main_dino.py update_center: dist.all_reduce(batch_center) / world_size. Two processes with
    the same batch (a fake group whose all-reduce sums two copies) move the deferred centre as
    one process with that batch: c <- m c + (1 - m) mean over the teacher outputs of both global views."""
    teacher = [torch.randn(3, 8, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    student = [torch.randn(3, 8, generator=torch.Generator().manual_seed(s)) for s in (2, 3)]
    fake = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 2,
                           all_reduce=lambda t, *a, **k: t.mul_(2))
    monkeypatch.setattr(lightly_center, "dist", fake)  # (lightly's center_mean all-reduces the batch mean)
    ours = DINOLoss(output_dim=8)
    ours.defer_center = True
    ours(teacher, student, teacher_temp=0.04)
    ours.step_center()
    want = 0.9 * torch.zeros(1, 8) + 0.1 * torch.cat(teacher).mean(dim=0, keepdim=True)  # the centre starts at 0
    torch.testing.assert_close(ours.center.reshape(1, 8), want)


def test_a_skipped_step_under_gradient_accumulation_leaves_dinos_centre_as_it_was():
    """The centre moves once per optimiser step by the mean of its micro-batches (the reference's
    undivided batch); a step skipped for a non-finite loss moves it not at all, so after the
    skip the centre is the one of the steps that were taken (lightly's update, applied by hand)."""

    class Exploding(DINO):
        def step(self, views, labels):  # noqa: ANN001, ANN202
            if self.global_step == 1:  # both micro-batches of the second step overflow
                views = [v * float("nan") for v in views]
            return super().step(views, labels)

    torch.manual_seed(0)
    model = Exploding(**COMMON, **SMALL_DINO, nonfinite_policy="skip")
    views, labels = fixed_views([16, 16, 8, 8], batch=4)
    trainer = L.Trainer(max_steps=2, accumulate_grad_batches=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    centres = []

    class Centre(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):  # noqa: ANN001, ANN002, ANN202
            centres.append(pl_module.criterion.center.clone())

    trainer.callbacks.append(Centre())
    trainer.fit(model, torch.utils.data.DataLoader([(views, labels)] * 4, batch_size=None))
    assert model.skipped_batches == 2  # each micro-batch counts against the budget
    assert torch.isfinite(model.criterion.center).all() and centres[1].abs().sum() > 0
    torch.testing.assert_close(model.criterion.center, centres[1])  # as after the first step


# ----------------------------------------------------------------------------- EMA targets
@pytest.mark.parametrize("method", ["dino", "mocov3"])
def test_ema_targets_start_as_copies_and_average_backbone_and_head(method):
    """DINO main_dino.py: teacher.load_state_dict(student.state_dict()), then the EMA of backbone
    and head; MoCo v3 builder: param_m.data.copy_(param_b.data) for backbone and projector (not
    the predictor), then the EMA. One step with a constant momentum 0.9 moves each target
    parameter to 0.9 x itself + 0.1 x the online parameter after the step."""
    torch.manual_seed(0)
    if method == "dino":
        model = DINO(**COMMON, **SMALL_DINO, momentum=0.9, momentum_end=0.9)
        pairs = [("backbone", "teacher_backbone"), ("head", "teacher_head")]
        views, labels = fixed_views([16, 16, 8, 8], batch=4)
    else:
        model = MoCoV3(**COMMON, **SMALL_MOCO, momentum=0.9, momentum_end=0.9)
        pairs = [("backbone", "momentum_backbone"), ("projector", "momentum_projector")]
        views, labels = fixed_views([16, 16], batch=4)
    for online, target in pairs:
        a, b = getattr(model, online).state_dict(), getattr(model, target).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (online, target)
    before = {target: copy.deepcopy(getattr(model, target)) for _, target in pairs}
    after = {}

    class Snapshot(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):  # noqa: ANN001, ANN002, ANN202
            after.update({online: copy.deepcopy(getattr(pl_module, online)) for online, _ in pairs})

    fit_steps(model, views, labels, steps=1, callbacks_extra=[Snapshot()])
    for online, target in pairs:
        # theta_target <- m theta_target + (1 - m) theta_online, written out (ema_update calls lightly's update_momentum)
        for (name, p), q, o in zip(getattr(model, target).named_parameters(), before[target].parameters(), after[online].parameters()):
            torch.testing.assert_close(p, 0.9 * q + 0.1 * o, rtol=0, atol=1e-6, msg=f"{target}.{name}")
        moved = [n for (n, p), q in zip(getattr(model, target).named_parameters(), before[target].parameters()) if not torch.equal(p, q)]
        assert moved, f"{target} did not move"


# ----------------------------------------------------------------------------- MoCo v3
def test_mocov3_with_a_batchnorm_backbone_encodes_each_view_in_a_pass_of_its_own():
    """MoCo v3 builder (MoCo_ResNet): base_encoder(x1) and base_encoder(x2) are separate calls,
    so a BatchNorm backbone normalises each view with its own batch statistics."""
    torch.manual_seed(0)
    model = MoCoV3(**{**COMMON, "backbone": "resnet18", "backbone_kwargs": {"in_chans": 1, "small_input": True}}, **SMALL_MOCO)
    calls = []
    model.backbone.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    views, labels = fixed_views([16, 16], batch=4)
    model.step(views, labels)
    assert calls == [4, 4]


# ----------------------------------------------------------------------------- supervised
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_supervised_step_is_the_label_smoothed_cross_entropy_written_out(smoothing):
    """torch's CrossEntropyLoss(label_smoothing=ε), written out: (1 - ε)·(-log p_y) + ε·mean_k
    (-log p_k) over the batch; the accuracy is the fraction of argmax hits."""
    torch.manual_seed(0)
    model = Supervised(**COMMON, label_smoothing=smoothing)
    torch.nn.init.normal_(model.classifier.weight, std=1.0)  # (zero-initialised: every loss would be log C)
    views, labels = fixed_views([16], batch=8)
    out = model.step(views, labels)
    with torch.no_grad():
        logp = F.log_softmax(model.classifier(model.backbone(views[0])), dim=-1).double()
    nll = -logp[torch.arange(8), labels]
    want = ((1 - smoothing) * nll - smoothing * logp.mean(-1)).mean()
    assert out["loss"].item() == pytest.approx(want.item(), rel=1e-5)
    assert out["acc"].item() == pytest.approx((logp.argmax(-1) == labels).double().mean().item())


# ----------------------------------------------------------------------------- ViT backbone
def _twins(**kwargs) -> tuple[VisionTransformer, TimmViT]:
    shape = {"img_size": 32, "patch_size": 8, "in_chans": 3, "embed_dim": 32, "depth": 3, "num_heads": 2, **kwargs}
    torch.manual_seed(0)
    ours = VisionTransformer(**shape)
    ref = TimmViT(**shape, num_classes=0)
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


def test_vit_initialisation_is_timms():
    """timm VisionTransformer.init_weights: pos_embed trunc-normal(0.02), [CLS] normal(1e-6),
    every Linear of the blocks trunc-normal(0.02) with zero bias."""
    shape = {"img_size": 64, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 2}
    torch.manual_seed(0)
    ours = VisionTransformer(**shape)
    ref = TimmViT(**shape, num_classes=0)
    for name in ("pos_embed", "cls_token", "blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight"):
        a, b = ours.get_parameter(name), ref.get_parameter(name)
        assert a.std().item() == pytest.approx(b.std().item(), rel=0.25), name
    for name, p in ref.blocks.named_parameters():
        if name.endswith("bias") and ("attn" in name or "mlp" in name):
            assert not p.any() and not ours.blocks.get_parameter(name).any(), name


@pytest.mark.parametrize("kwargs", [{"drop_path_rate": 0.5}, {"attn_drop_rate": 0.3}])
def test_vit_in_training_drops_as_timm_does_and_not_at_all_in_eval(kwargs):
    """timm's blocks in training: drop path on both residual branches, one draw per sample
    (DropPath), attention dropout inside the attention; none of it in eval. Same seed, same draws."""
    ours, ref = _twins(**kwargs)
    x = torch.randn(8, 3, 32, 32)
    for train in (True, False):
        outs = []
        for model in (ours.train(train), ref.train(train)):
            torch.manual_seed(1)
            outs.append(model.forward_features(x))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours.train()(x), ours.eval()(x))  # the draws did drop something
