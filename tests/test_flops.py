"""FLOP counting: the analytic counts against the specs' GMAC table and against torch's
FlopCounterMode on tiny models; the cumulative-FLOPs callback through a short Lightning run and a
checkpoint round trip.

The FlopCounterMode references run attention on the math backend, which torch decomposes into
matmuls that its own table counts, so they are independent of the CPU-attention formulas that
``ssl_vit.flops.flop_counter`` adds.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import TINY_BACKBONE, TINY_VIT, RepeatBatch, fixed_views, torch_flops
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch.utils.data import DataLoader

from ssl_vit.backbones import VisionTransformer, create_backbone
from ssl_vit.flops import (
    PretrainFlopsCounter,
    backbone_forward_flops,
    backbone_train_flops,
    flop_counter,
    method_step_flops,
    pretrain_flops_from_checkpoint,
    vit_forward_flops,
)
from ssl_vit.methods import DINO, MPP, MoCoV3, Supervised

# ---------------------------------------------------------------------------------------------
# the analytic ViT count


@pytest.mark.parametrize(
    "dim, heads, gmacs",
    [(192, 3, 1.26), (384, 6, 4.61), (768, 12, 17.58)],  # specs §1: timm's GMACs at 224 px
)
def test_vit_forward_flops_matches_the_specs_gmac_table(dim: int, heads: int, gmacs: float) -> None:
    flops = vit_forward_flops(dim, 12, heads, 4.0, 196, 16, 3)
    assert flops / 2 / 1e9 == pytest.approx(gmacs, rel=0.015)  # a MAC is 2 FLOPs


def test_vit_forward_flops_by_hand() -> None:
    # D=8, 1 block, MLP 32, 2x2 patches of 2x2x1 pixels: N=4, T=5.
    d, t, n, hidden = 8, 5, 4, 32
    macs = n * (2 * 2 * 1) * d + t * d * 3 * d + 2 * t * t * d + t * d * d + 2 * t * d * hidden
    assert vit_forward_flops(8, 1, 2, 4.0, 4, 2, 1) == 2 * macs


@pytest.mark.parametrize("make", ["ours", "timm"])
def test_vit_forward_flops_agree_with_flop_counter(make: str) -> None:
    kw = dict(img_size=32, patch_size=8, in_chans=3, embed_dim=32, depth=2, num_heads=2)
    model = create_backbone("vit", **kw) if make == "ours" else TimmViT(num_classes=0, **kw)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        counted = torch_flops(lambda: model(x))
    assert counted == pytest.approx(2 * vit_forward_flops(32, 2, 2, 4.0, 16, 8, 3), rel=1e-6)


def test_flop_counter_counts_cpu_attention_like_the_math_path() -> None:
    model = create_backbone("vit", **TINY_VIT)
    x = torch.randn(2, 1, 16, 16)
    with flop_counter() as fused:  # default (fused) attention kernel
        model(x).sum().backward()
    assert fused.get_total_flops() == torch_flops(lambda: model(x).sum().backward())


@pytest.mark.parametrize(
    "name, kwargs, size",
    [
        ("vit", TINY_VIT, 16),
        ("vit", TINY_VIT, 8),  # another resolution: fewer tokens
        ("resnet18", {"in_chans": 1, "small_input": True}, 16),
        ("resnet18", {"in_chans": 1}, 28),  # a 1x1 last feature map (BatchNorm needs 2 images)
        ("hybrid_r18_vit_tiny", {"img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 2}, 16),
    ],
)
def test_backbone_counts_agree_with_flop_counter(name: str, kwargs: dict, size: int) -> None:
    model = create_backbone(name, **kwargs)
    x = torch.randn(2, 1, size, size)
    with torch.no_grad():
        forward = torch_flops(lambda: model(x))
    train = torch_flops(lambda: model(x).sum().backward())
    assert backbone_forward_flops(model, size) * 2 == pytest.approx(forward, rel=1e-6)
    assert backbone_train_flops(model, size) * 2 == pytest.approx(train, rel=1e-6)


class _AttentionPooledViT(VisionTransformer):
    """A user's ViT subclass that pools the patch tokens with a learned query: more FLOPs than the
    ViT it extends."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.query = torch.nn.Parameter(torch.zeros(1, 1, self.embed_dim))
        self.pool_attn = torch.nn.MultiheadAttention(self.embed_dim, 1, batch_first=True)

    def forward(self, x):
        tokens = self.forward_features(x)[:, 1:]  # [B, N, D]
        return self.pool_attn(self.query.expand(len(tokens), -1, -1), tokens, tokens, need_weights=False)[0][:, 0]


def test_a_vit_subclass_is_counted_with_what_it_adds() -> None:
    model = _AttentionPooledViT(**TINY_VIT)
    x = torch.randn(2, 1, 16, 16)
    forward = torch_flops(lambda: model(x))  # forward only (MultiheadAttention refuses the tracker under no_grad)
    assert backbone_forward_flops(model, 16) * 2 == pytest.approx(forward, rel=1e-6)
    assert backbone_forward_flops(model, 16) > backbone_forward_flops(create_backbone("vit", **TINY_VIT), 16)


def test_frozen_patch_projection_saves_its_weight_gradient() -> None:
    model = create_backbone("vit", **TINY_VIT)
    model.patch_embed.proj.requires_grad_(False)
    x = torch.randn(2, 1, 16, 16)
    assert backbone_train_flops(model, 16) * 2 == pytest.approx(torch_flops(lambda: model(x).sum().backward()), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# one training step of each method


def _tiny_method(name: str) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    if name == "mpp":
        return MPP(mean=[0.5], std=[0.25], **TINY_BACKBONE), fixed_views([16])[0]
    if name == "mocov3":
        return MoCoV3(proj_hidden_dim=32, proj_output_dim=8, pred_hidden_dim=32, **TINY_BACKBONE), fixed_views([16, 16])[0]
    if name == "dino":
        return DINO(out_dim=64, hidden_dim=32, bottleneck_dim=8, **TINY_BACKBONE), fixed_views([16, 16, 8, 8, 8])[0]
    return Supervised(num_classes=4, **TINY_BACKBONE), fixed_views([16])[0]


@pytest.mark.parametrize("name", ["mpp", "mocov3", "dino", "supervised"])
def test_method_step_flops_agree_with_flop_counter(name: str) -> None:
    module, views = _tiny_method(name)
    labels = torch.arange(views[0].shape[0]) % 4
    counted = torch_flops(lambda: module.step(views, labels)["loss"].backward())
    analytic = method_step_flops(module, [v.shape for v in views], include_probe=False) * views[0].shape[0]
    assert analytic == pytest.approx(counted, rel=1e-9)  # exact: every product counted


def test_method_step_flops_counts_the_online_probe() -> None:
    module, views = _tiny_method("supervised")  # num_classes gives it a probe too
    labels = torch.arange(views[0].shape[0]) % 4

    def step() -> None:
        out = module.step(views, labels)
        probe_loss, _ = module.probe.training_loss(out["features"].detach(), labels)
        (out["loss"] + probe_loss).backward()

    analytic = method_step_flops(module, [v.shape for v in views]) * views[0].shape[0]
    assert analytic == pytest.approx(torch_flops(step), rel=1e-9)


def test_mocov3_logits_grow_with_the_global_batch() -> None:
    module, views = _tiny_method("mocov3")
    shapes = [v.shape for v in views]
    b, c = shapes[0][0], module.projector.output_dim
    # ctr's logits [B, W·B]: forward + dL/dq, two terms -> 8·B·C FLOPs per image per extra device.
    extra = method_step_flops(module, shapes, world_size=2) - method_step_flops(module, shapes, world_size=1)
    assert extra == pytest.approx(8 * b * c)


def test_a_subclass_of_a_method_may_count_its_own_flops() -> None:
    from ssl_vit.flops import linear_flops

    module, views = _tiny_method("mpp")

    class Counted(type(module)):
        def step_flops(self, views_shapes, world_size):
            return 7.0

    module.__class__ = Counted  # (the same module, its class now counting its own)
    probe = 2.0 * linear_flops(module.probe) if module.probe is not None else 0.0
    assert method_step_flops(module, [v.shape for v in views]) == pytest.approx(7.0 + probe)


def test_method_step_flops_rejects_bad_input() -> None:
    module, views = _tiny_method("mocov3")
    with pytest.raises(ValueError, match="two views"):
        method_step_flops(module, [views[0].shape])
    with pytest.raises(ValueError, match="same batch size"):
        method_step_flops(module, [(4, 1, 16, 16), (8, 1, 16, 16)])
    with pytest.raises(ValueError, match=r"empty view shape \(4, 1, 0, 0\)"):  # any view, not the first only
        method_step_flops(module, [(4, 1, 16, 16), (4, 1, 0, 0)])
    with pytest.raises(TypeError, match="no FLOP model"):
        method_step_flops(torch.nn.Linear(2, 2), [(4, 1, 16, 16)])
    with pytest.raises(ValueError, match="divisible"):
        vit_forward_flops(10, 1, 3, 4.0, 4, 2, 1)
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        method_step_flops(module, [v.shape for v in views], world_size=0)
    for zero in range(6):  # a ViT without blocks, tokens, ... has no FLOP count
        args = [8, 1, 2, 4, 2, 1]
        args[zero] = 0
        dim, depth, heads, tokens, patch, chans = args
        with pytest.raises(ValueError, match="must be >= 1"):
            vit_forward_flops(dim, depth, heads, 4.0, tokens, patch, chans)
    # DINO with one global crop still needs a second view to have a loss
    dino = DINO(out_dim=64, hidden_dim=32, bottleneck_dim=8, n_global_crops=1, **TINY_BACKBONE)
    with pytest.raises(ValueError, match=r"at least 2 views \(1 global first\), got 1"):
        method_step_flops(dino, [(4, 1, 16, 16)])
    assert method_step_flops(dino, [(4, 1, 16, 16), (4, 1, 8, 8)]) > 0


def test_a_backbone_without_a_first_conv_is_trained_at_three_times_its_forward() -> None:
    class PixelMLP(torch.nn.Module):  # a plugin backbone that sees the image through a Linear
        in_chans = 1

        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(16 * 16, 8)

        def forward_features(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.flatten(1))

        forward = forward_features

    model = PixelMLP()
    forward = backbone_forward_flops(model, 16)
    assert forward == pytest.approx(2 * 256 * 8)
    # (the image's gradient is not needed, but nothing says which layer is the first: 3x)
    assert backbone_train_flops(model, 16) == pytest.approx(3 * forward)


def test_the_per_image_count_is_kept_per_device_count() -> None:
    from ssl_vit.flops import PretrainFlops

    module, views = _tiny_method("mocov3")
    shapes = [v.shape for v in views]
    flops = PretrainFlops()
    one, two = flops.per_image(module, shapes, 1), flops.per_image(module, shapes, 2)
    assert one == pytest.approx(method_step_flops(module, shapes, world_size=1))
    assert two == pytest.approx(method_step_flops(module, shapes, world_size=2)) and two > one
    b = shapes[0][0]
    assert flops.add(module, views, world_size=2) == pytest.approx(two * b * 2)


# ---------------------------------------------------------------------------------------------
# cumulative pretraining FLOPs


def _fit(module: L.LightningModule, counter: PretrainFlopsCounter, steps: int, tmp_path, ckpt_path=None) -> L.Trainer:
    views, labels = fixed_views([16], batch=8)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[counter], default_root_dir=tmp_path,
    )
    trainer.fit(module, DataLoader(RepeatBatch(views, labels, 10), batch_size=None), ckpt_path=ckpt_path)
    return trainer


def test_pretrain_flops_counter_accumulates_and_round_trips(tmp_path) -> None:
    module = Supervised(num_classes=4, **TINY_BACKBONE)
    per_step = method_step_flops(module, [(8, 1, 16, 16)]) * 8
    counter = PretrainFlopsCounter()
    trainer = _fit(module, counter, 3, tmp_path)
    assert counter.total == pytest.approx(3 * per_step)
    assert float(trainer.callback_metrics["train/pretrain_flops"]) == pytest.approx(3 * per_step, rel=1e-6)
    assert module.pretrain_flops == pytest.approx(3 * per_step)

    path = tmp_path / "three.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    assert pretrain_flops_from_checkpoint(ckpt) == pytest.approx(3 * per_step)

    # Resuming continues from the stored total.
    resumed = PretrainFlopsCounter()
    _fit(Supervised(num_classes=4, **TINY_BACKBONE), resumed, 5, tmp_path, ckpt_path=path)
    assert resumed.total == pytest.approx(5 * per_step)


def test_pretrain_flops_goes_into_the_ssl_vit_record_when_there_is_one() -> None:
    counter = PretrainFlopsCounter()
    counter.flops.total = 1.5e15
    ckpt = {"ssl_vit": {"method": "DINO"}}
    counter.on_save_checkpoint(None, None, ckpt)
    assert ckpt["ssl_vit"]["pretrain_flops"] == 1.5e15
    assert pretrain_flops_from_checkpoint({"pretrain_flops": 2.0}) == 2.0
    assert pretrain_flops_from_checkpoint({}) is None
