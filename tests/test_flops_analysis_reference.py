"""FLOP counts against torch's FlopCounterMode (attention on the math backend), written here
independently, on backbones, convolutions and training steps the other tests do not reach
(non-square images, an MLP ratio other than 4, grouped and dilated convolutions, three global
crops, several devices). Each test fails on a plausible one-line change to the code it pins."""

from __future__ import annotations

import pytest
import torch
from helpers import torch_flops
from torch import nn

from ssl_vit.backbones import create_backbone
from ssl_vit.flops import (
    PretrainFlops,
    backbone_forward_flops,
    backbone_train_flops,
    conv2d_flops,
    method_step_flops,
    pretrain_flops_from_checkpoint,
)
from ssl_vit.methods import DINO, MPP, Supervised


# ----------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize(
    "name, kwargs, size",
    [
        # a 4x6 grid: the width must not be taken for the height (nor the other way round)
        ("vit", {"img_size": [16, 24], "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}, (16, 24)),
        # an MLP of 2·D, not the usual 4·D
        ("vit", {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2, "mlp_ratio": 2.0}, (16, 16)),
        # a hybrid and a ResNet on a non-square image (the stem's output is 8x12, not 8x8)
        ("hybrid_r18_vit_tiny", {"img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 2}, (16, 24)),
        ("resnet18", {"in_chans": 1}, (32, 48)),
    ],
)
def test_backbone_counts_on_non_square_images_and_other_mlp_ratios(name: str, kwargs: dict, size: tuple[int, int]) -> None:
    """Forward and training FLOPs per image against FlopCounterMode counting the same passes."""
    torch.manual_seed(0)
    model = create_backbone(name, **kwargs)
    x = torch.randn(2, 1, *size)  # [B, C, H, W]
    with torch.no_grad():
        forward = torch_flops(lambda: model(x)) / 2
    train = torch_flops(lambda: model(x).sum().backward()) / 2
    assert backbone_forward_flops(model, size) == pytest.approx(forward, rel=1e-9)
    assert backbone_train_flops(model, size) == pytest.approx(train, rel=1e-9)


def test_a_width_the_patches_do_not_divide_is_refused() -> None:
    """A 16x18 image has no whole number of 4-pixel patches across: no count, an error."""
    model = create_backbone("vit", img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2)
    with pytest.raises(ValueError, match="not divisible"):
        backbone_forward_flops(model, (16, 18))


@pytest.mark.parametrize(
    "conv, size",
    [
        (nn.Conv2d(4, 6, kernel_size=(3, 5), stride=(2, 1), padding=(1, 2), groups=2), (9, 11)),
        (nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=(0, 3), dilation=(1, 3)), (13, 10)),
        (nn.Conv2d(2, 4, kernel_size=(1, 3), padding="same"), (5, 7)),
    ],
)
def test_conv2d_flops_of_grouped_rectangular_and_dilated_convolutions(conv: nn.Conv2d, size: tuple[int, int]) -> None:
    """conv2d_flops against FlopCounterMode on one image: output size, kernel area, groups."""
    x = torch.randn(1, conv.in_channels, *size)
    with torch.no_grad():
        counted = torch_flops(lambda: conv(x))
    assert conv2d_flops(conv, size) == counted


def test_dino_with_three_global_crops_counts_three_teacher_passes() -> None:
    """DINO's step with n_global_crops=3 (teacher on 3 views, loss over 3 x 5 pairs) against
    FlopCounterMode counting the step and its backward."""
    torch.manual_seed(0)
    vit = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}
    module = DINO(out_dim=64, hidden_dim=32, bottleneck_dim=8, n_global_crops=3, backbone="vit", backbone_kwargs=vit)
    views = [torch.randn(4, 1, 16, 16) for _ in range(3)] + [torch.randn(4, 1, 8, 8) for _ in range(2)]
    labels = torch.zeros(4, dtype=torch.long)
    counted = torch_flops(lambda: module.step(views, labels)["loss"].backward())
    analytic = method_step_flops(module, [v.shape for v in views], include_probe=False) * 4
    assert analytic == pytest.approx(counted, rel=1e-9)


def test_mpp_on_non_square_views() -> None:
    """MPP on 16x24 views (a 4x6 grid, 12 corrupted patches) against FlopCounterMode."""
    torch.manual_seed(0)
    vit = {"img_size": [16, 24], "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}
    module = MPP(mean=[0.5], std=[0.25], backbone="vit", backbone_kwargs=vit)
    views = [torch.randn(4, 1, 16, 24)]
    counted = torch_flops(lambda: module.step(views, torch.zeros(4, dtype=torch.long))["loss"].backward())
    analytic = method_step_flops(module, [v.shape for v in views], include_probe=False) * 4
    assert analytic == pytest.approx(counted, rel=1e-9)


def test_the_running_total_counts_every_device() -> None:
    """PretrainFlops.add on a batch of 4 per device on 2 devices: 2 x what FlopCounterMode counts
    for one device's step (supervised: the per-device work does not depend on the device count)."""
    torch.manual_seed(0)
    vit = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}
    module = Supervised(num_classes=4, backbone="vit", backbone_kwargs=vit)
    views, labels = [torch.randn(4, 1, 16, 16)], torch.arange(4)

    def step() -> None:
        out = module.step(views, labels)
        probe_loss, _ = module.probe.training_loss(out["features"].detach(), labels)
        (out["loss"] + probe_loss).backward()

    one_device = torch_flops(step)
    flops = PretrainFlops()
    assert flops.add(module, views, world_size=2) == pytest.approx(2 * one_device, rel=1e-9)
    assert flops.add(module, views, world_size=2) == pytest.approx(4 * one_device, rel=1e-9)
    # The same counter on another model of the same method (twice as deep) counts that one.
    module = Supervised(num_classes=4, backbone="vit", backbone_kwargs={**vit, "depth": 2})
    deeper = torch_flops(step)
    assert deeper > 1.5 * one_device
    assert flops.add(module, views, world_size=2) == pytest.approx(4 * one_device + 2 * deeper, rel=1e-9)


def test_a_checkpoint_with_only_the_ssl_vit_record_has_its_flops_read() -> None:
    """The total lives under ``["ssl_vit"]["pretrain_flops"]`` (the documented record); a
    checkpoint holding only that record still gives its total back."""
    assert pretrain_flops_from_checkpoint({"ssl_vit": {"pretrain_flops": 3e12}}) == 3e12
