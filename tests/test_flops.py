"""FLOP counting. Backbones, measured on the meta device, against timm's published GMACs, against
the ViT paper's matrix products written out, and against torch's own FlopCounterMode on real
passes; the pretraining counter, which measures a run's training step, against FlopCounterMode
around each method's step, over short Lightning runs, several devices and a checkpoint round trip.

The FlopCounterMode references (``torch_flops``) run attention on the math backend, which torch
decomposes into matmuls its own table counts: independent of the CPU-attention formulas that
``ssl_vit.flops.flop_counter`` adds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import TINY_BACKBONE, TINY_VIT, fit_steps, fixed_views, torch_flops
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ssl_vit.backbones import VisionTransformer, create_backbone
from ssl_vit.flops import backbone_flops, count_flops
from ssl_vit.methods import DINO, MPP, MoCoV3, Supervised
from ssl_vit.training.callbacks import PretrainFlopsCounter

# ---------------------------------------------------------------------------------------------
# backbones


@pytest.mark.parametrize("name, gmacs", [("vit_tiny", 1.26), ("vit_small", 4.61), ("vit_base", 17.58)])  # timm's GMACs, 224 px
def test_vit_flops_match_timms_gmac_table_and_training_is_about_three_forwards(name: str, gmacs: float) -> None:
    with torch.device("meta"):
        model = create_backbone(name)
    forward, train = backbone_flops(model, 224)
    assert forward / 2 / 1e9 == pytest.approx(gmacs, rel=0.015)  # a MAC is 2 FLOPs
    # A product's backward is two products of its size (input and weight gradients); the image
    # needs no gradient, so the patch projection's input gradient is left out.
    assert 2.9 * forward < train < 3 * forward


def _vit_macs(dim: int, depth: int, hidden: int, grid: tuple[int, int], patch: int, chans: int) -> int:
    """Multiply-adds per image of a ViT, ViT paper eqs. 1-3 written out: E on N patches, then per
    block QKV, QKᵀ and AV (all heads together), the output projection and the two MLP layers on T = N + 1 tokens."""
    n = grid[0] * grid[1]
    t = n + 1
    return n * patch * patch * chans * dim + depth * (t * dim * 3 * dim + 2 * t * t * dim + t * dim * dim + 2 * t * dim * hidden)


@pytest.mark.parametrize("kwargs, size, grid", [
    ({"img_size": 4, "patch_size": 2, "in_chans": 1, "embed_dim": 8, "depth": 1, "num_heads": 2}, 4, (2, 2)),
    (TINY_VIT, 16, (4, 4)),
    (TINY_VIT, 8, (2, 2)),  # another resolution: fewer tokens
    ({**TINY_VIT, "img_size": [16, 24]}, (16, 24), (4, 6)),  # a 4x6 grid: the width is not taken for the height
    ({**TINY_VIT, "mlp_ratio": 2.0}, 16, (4, 4)),  # an MLP of 2·D, not 4·D
])
def test_vit_flops_are_the_papers_products_written_out(kwargs: dict, size, grid: tuple[int, int]) -> None:
    model = create_backbone("vit", **kwargs)
    hidden = int(kwargs["embed_dim"] * kwargs.get("mlp_ratio", 4.0))
    forward, _ = backbone_flops(model, size)
    assert forward == 2 * _vit_macs(kwargs["embed_dim"], kwargs["depth"], hidden, grid, kwargs["patch_size"], kwargs["in_chans"])


@pytest.mark.parametrize("name, kwargs, size", [
    ("vit", TINY_VIT, 16),
    ("resnet18", {"in_chans": 1, "small_input": True}, 16),
    ("resnet18", {"in_chans": 1}, 28),  # a 1x1 last feature map (BatchNorm in training needs 2 images)
    ("resnet18", {"in_chans": 1}, (32, 48)),
    ("hybrid_r18_vit_tiny", {"img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 2}, 16),
    ("hybrid_r18_vit_tiny", {"img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 2}, (16, 24)),  # an 8x12 map
])
def test_meta_device_counts_equal_torchs_count_of_real_passes(name: str, kwargs: dict, size) -> None:
    torch.manual_seed(0)
    model = create_backbone(name, **kwargs)
    x = torch.randn(2, 1, *((size, size) if isinstance(size, int) else size))  # [B, C, H, W]
    with torch.no_grad():
        forward = torch_flops(lambda: model(x)) / 2
    train = torch_flops(lambda: model(x).sum().backward()) / 2
    assert backbone_flops(model, size) == (forward, train)


def test_a_size_the_patches_do_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="image size 16x18 is not divisible by the patch size 4"):
        backbone_flops(create_backbone("vit", **TINY_VIT), (16, 18))


def test_count_flops_counts_cpu_attention_like_the_math_path() -> None:
    model = create_backbone("vit", **TINY_VIT)
    x = torch.randn(2, 1, 16, 16)
    fused = count_flops(lambda: model(x).sum().backward())  # the default (fused) attention kernel
    assert fused == torch_flops(lambda: model(x).sum().backward()) > 0


def test_frozen_layers_plugins_and_subclasses_are_measured_as_they_compute() -> None:
    base_forward, base_train = backbone_flops(create_backbone("vit", **TINY_VIT), 16)
    # MoCo v3's frozen patch projection: its weight gradient is not computed (16 tokens of 4x4x1 -> 32)
    frozen = create_backbone("vit", **TINY_VIT)
    frozen.patch_embed.proj.requires_grad_(False)
    assert backbone_flops(frozen, 16) == (base_forward, base_train - 2 * 16 * 16 * 32)

    class PixelMLP(nn.Module):  # a plug-in backbone that sees the image through a Linear
        in_chans = 1

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16 * 16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.flatten(1))

    assert backbone_flops(PixelMLP(), 16) == (2 * 256 * 8, 2 * 2 * 256 * 8)  # training: the weight gradient, none for the image

    class AttentionPooledViT(VisionTransformer):  # a user's subclass that pools with a learned query
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.query = nn.Parameter(torch.zeros(1, 1, self.embed_dim))
            self.pool_attn = nn.MultiheadAttention(self.embed_dim, 1, batch_first=True)

        def forward(self, x):
            tokens = self.forward_features(x)[:, 1:]  # [B, N, D]
            return self.pool_attn(self.query.expand(len(tokens), -1, -1), tokens, tokens, need_weights=False)[0][:, 0]

    model = AttentionPooledViT(**TINY_VIT)
    forward = torch_flops(lambda: model(torch.randn(2, 1, 16, 16))) / 2  # (MultiheadAttention refuses the tracker under no_grad)
    assert backbone_flops(model, 16)[0] == forward > base_forward


# ---------------------------------------------------------------------------------------------
# the pretraining counter


def _tiny_method(name: str) -> tuple[nn.Module, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    views, labels = fixed_views({"mpp": [16], "mocov3": [16, 16], "dino": [16, 16, 8, 8, 8], "supervised": [16]}[name], batch=8)
    module = {"mpp": lambda: MPP(mean=[0.5], std=[0.25], **TINY_BACKBONE, num_classes=4),
              "mocov3": lambda: MoCoV3(proj_hidden_dim=32, proj_output_dim=8, pred_hidden_dim=32, **TINY_BACKBONE, num_classes=4),
              "dino": lambda: DINO(out_dim=64, hidden_dim=32, bottleneck_dim=8, **TINY_BACKBONE, num_classes=4),
              "supervised": lambda: Supervised(**TINY_BACKBONE, num_classes=4)}[name]()
    return module, views, labels


def _step_flops(module: nn.Module, views: list[torch.Tensor], labels: torch.Tensor) -> int:
    """FlopCounterMode around what a training step computes: the method's step, the online
    probe on its detached features, the backward pass of both."""

    def step() -> None:
        out = module.step(views, labels)
        probe_loss, _ = module.probe.training_loss(out["features"].detach(), labels)
        (out["loss"] + probe_loss).backward()

    return torch_flops(step)


@pytest.mark.parametrize("name", ["mpp", "mocov3", "dino", "supervised"])
def test_the_counter_measures_each_methods_training_step(name: str) -> None:
    module, views, labels = _tiny_method(name)
    want = _step_flops(module, views, labels)
    module, views, labels = _tiny_method(name)
    counter = PretrainFlopsCounter()
    fit_steps(module, views, labels, steps=2, callbacks_extra=[counter])
    assert list(counter.per_step.values()) == [want]  # measured once: the second step had the same shapes
    assert counter.total == module.pretrain_flops == 2 * want


class _Module(SimpleNamespace):
    """What the counter touches of a LightningModule."""

    def log(self, name: str, value: float, **kwargs) -> None:
        self.logged = (name, value)


def test_every_device_counts_and_each_batch_shape_is_measured_once() -> None:
    model = create_backbone("vit", **TINY_VIT)
    trainer, module, counter = SimpleNamespace(world_size=2), _Module(), PretrainFlopsCounter()

    def train_step(batch: tuple[list[torch.Tensor], torch.Tensor]) -> None:
        counter.on_train_batch_start(trainer, module, batch, 0)
        model(batch[0][0]).sum().backward()
        counter.on_train_batch_end(trainer, module, None, batch, 0)

    big, small = ([torch.randn(4, 1, 16, 16)], torch.zeros(4)), ([torch.randn(4, 1, 8, 8)], torch.zeros(4))
    per_big, per_small = (torch_flops(lambda b=b: model(b[0][0]).sum().backward()) for b in (big, small))
    for batch in (big, big, small, big):
        train_step(batch)
    assert counter.per_step == {((4, 1, 16, 16), (4,)): per_big, ((4, 1, 8, 8), (4,)): per_small}
    assert counter.total == module.pretrain_flops == 2 * (3 * per_big + per_small)
    assert module.logged == ("train/pretrain_flops", counter.total)
    # A step that fails while measured leaves no FlopCounterMode behind.
    counter.on_train_batch_start(trainer, module, ([torch.randn(2, 1, 16, 16)], torch.zeros(2)), 0)
    assert _get_current_dispatch_mode() is not None
    counter.on_exception(trainer, module, RuntimeError("out of memory"))
    assert _get_current_dispatch_mode() is None
    # Another run with the same counter (twice as deep a model) is measured anew; its total goes on.
    model = create_backbone("vit", **{**TINY_VIT, "depth": 4})
    deeper = torch_flops(lambda: model(big[0][0]).sum().backward())
    counter.on_train_start(trainer, module)
    train_step(big)
    assert deeper > 1.5 * per_big and counter.total == 2 * (3 * per_big + per_small + deeper)


def test_the_total_is_checkpointed_and_carried_on_when_the_run_resumes(tmp_path) -> None:
    import lightning as L
    from helpers import RepeatBatch
    from torch.utils.data import DataLoader

    views, labels = fixed_views([16], batch=8)
    per_step = _step_flops(Supervised(**TINY_BACKBONE, num_classes=4), views, labels)

    def fit(counter: PretrainFlopsCounter, steps: int, ckpt_path=None) -> L.Trainer:
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[counter], default_root_dir=tmp_path)
        trainer.fit(Supervised(**TINY_BACKBONE, num_classes=4), DataLoader(RepeatBatch(views, labels, 10), batch_size=None), ckpt_path=ckpt_path)
        return trainer

    trainer = fit(counter := PretrainFlopsCounter(), 3)
    assert counter.total == 3 * per_step
    assert float(trainer.callback_metrics["train/pretrain_flops"]) == pytest.approx(3 * per_step, rel=1e-6)
    trainer.save_checkpoint(tmp_path / "three.ckpt")
    ckpt = torch.load(tmp_path / "three.ckpt", weights_only=False)
    assert ckpt["ssl_vit"]["pretrain_flops"] == ckpt["pretrain_flops"] == 3 * per_step  # the run info, and the top level for other readers
    fit(resumed := PretrainFlopsCounter(), 5, ckpt_path=tmp_path / "three.ckpt")
    assert resumed.total == 5 * per_step
