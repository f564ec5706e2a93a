from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from ssl_vit.heads import (
    DINOHead,
    LinearProbeHead,
    MoCoV3MLP,
    MPPHead,
    WeightNormLinear,
)

# ------------------------------------------------------------------------------------------
# MoCo v3


def _layer_kinds(mlp: nn.Sequential) -> list[str]:
    kinds = []
    for m in mlp:
        if isinstance(m, nn.Linear):
            kinds.append("linear" if m.bias is None else "linear+bias")
        elif isinstance(m, nn.BatchNorm1d):
            kinds.append("bn" if m.affine else "bn-noaffine")
        elif isinstance(m, nn.ReLU):
            kinds.append("relu")
        else:
            kinds.append(type(m).__name__)
    return kinds


def test_mocov3_projector_structure_and_shapes() -> None:
    head = MoCoV3MLP(32, hidden_dim=64, output_dim=16)
    assert _layer_kinds(head) == [
        "linear", "bn", "relu", "linear", "bn", "relu", "linear", "bn-noaffine",
    ]  # fmt: skip
    dims = [(m.in_features, m.out_features) for m in head if isinstance(m, nn.Linear)]
    assert dims == [(32, 64), (64, 64), (64, 16)]
    assert head(torch.randn(5, 32)).shape == (5, 16)


def test_mocov3_defaults() -> None:
    from helpers import TINY_BACKBONE

    from ssl_vit.methods import MoCoV3

    assert [m.out_features for m in MoCoV3MLP(384) if isinstance(m, nn.Linear)] == [4096, 4096, 256]
    model = MoCoV3(**TINY_BACKBONE)  # the method's heads at the paper's widths: projector 3 layers, predictor 2
    assert [(m.in_features, m.out_features) for m in model.projector if isinstance(m, nn.Linear)] == [(32, 4096), (4096, 4096), (4096, 256)]
    assert [(m.in_features, m.out_features) for m in model.predictor if isinstance(m, nn.Linear)] == [(256, 4096), (4096, 256)]
    # Reference MoCo_ViT builds its predictor with last_bn=True (the default of _build_mlp).
    assert _layer_kinds(model.predictor) == ["linear", "bn", "relu", "linear", "bn-noaffine"]


def _reference_build_mlp(
    num_layers: int, d_in: int, d_hid: int, d_out: int, last_bn: bool
) -> nn.Sequential:
    # The structure of moco-v3 builder.py `_build_mlp`, written out from the paper's description.
    layers: list[nn.Module] = []
    for i in range(num_layers):
        a = d_in if i == 0 else d_hid
        b = d_out if i == num_layers - 1 else d_hid
        layers.append(nn.Linear(a, b, bias=False))
        if i < num_layers - 1:
            layers += [nn.BatchNorm1d(b), nn.ReLU(inplace=True)]
        elif last_bn:
            layers.append(nn.BatchNorm1d(b, affine=False))
    return nn.Sequential(*layers)


@pytest.mark.parametrize("num_layers,last_bn", [(3, True), (2, True), (2, False), (1, True)])
def test_mocov3_state_dict_matches_reference_layout(num_layers: int, last_bn: bool) -> None:
    ref = _reference_build_mlp(num_layers, 12, 20, 8, last_bn)
    ours = MoCoV3MLP(12, 20, 8, num_layers=num_layers, last_bn=last_bn)
    ours.load_state_dict(ref.state_dict(), strict=True)  # same names and shapes
    x = torch.randn(6, 12)
    ref.train(), ours.train()
    assert torch.allclose(ours(x), ref(x))


def test_mocov3_last_bn_standardises() -> None:
    head = MoCoV3MLP(8, hidden_dim=16, output_dim=4).train()
    out = head(torch.randn(64, 8) * 5 + 3)
    assert torch.allclose(out.mean(0), torch.zeros(4), atol=1e-5)
    assert torch.allclose(out.var(0, unbiased=False), torch.ones(4), atol=1e-3)


# ------------------------------------------------------------------------------------------
# DINO


def _small_dino(**kw: object) -> DINOHead:
    torch.manual_seed(0)
    return DINOHead(12, out_dim=50, hidden_dim=24, bottleneck_dim=8, **kw)  # type: ignore[arg-type]


def test_dino_head_shapes_and_structure() -> None:
    head = _small_dino()
    assert head(torch.randn(4, 12)).shape == (4, 50)
    kinds = [type(m).__name__ for m in head.mlp]
    assert kinds == ["Linear", "GELU", "Linear", "GELU", "Linear"]
    bn = _small_dino(use_bn=True)
    assert [type(m).__name__ for m in bn.mlp] == [
        "Linear", "BatchNorm1d", "GELU", "Linear", "BatchNorm1d", "GELU", "Linear",
    ]  # fmt: skip
    assert isinstance(_small_dino(nlayers=1).mlp, nn.Linear)
    sd = head.state_dict()
    assert sd["last_layer.weight_g"].shape == (50, 1)
    assert sd["last_layer.weight_v"].shape == (50, 8)
    assert "last_layer.weight" not in sd


def test_dino_head_defaults() -> None:
    head = DINOHead(384)
    assert head.last_layer.weight_v.shape == (65536, 256)
    assert [m.out_features for m in head.mlp if isinstance(m, nn.Linear)] == [2048, 2048, 256]
    assert not head.last_layer.weight_g.requires_grad  # norm_last_layer: g fixed at 1


def test_dino_head_init() -> None:
    head = DINOHead(256, out_dim=10, hidden_dim=512, bottleneck_dim=64)
    lin = [m for m in head.mlp if isinstance(m, nn.Linear)]
    for m in lin:
        assert torch.all(m.bias == 0)
    # trunc_normal_(std=0.02) truncated at +-2 absolute (timm / DINO), i.e. barely: the std stays
    # 0.02 (cut at +-2 sigma it would be 0.0176). 512*512 draws.
    assert abs(lin[1].weight.std().item() - 0.02) < 0.001
    assert torch.all(head.last_layer.weight_g == 1)


def test_dino_last_layer_is_weight_normalised() -> None:
    head = _small_dino()
    assert not head.last_layer.weight_g.requires_grad
    w = head.last_layer.weight
    assert torch.allclose(w.norm(dim=1), torch.ones(50), atol=1e-6)
    # Rows keep unit norm after an optimiser step on v.
    opt = torch.optim.SGD(head.parameters(), lr=1.0)
    head(torch.randn(8, 12)).pow(2).sum().backward()
    assert head.last_layer.weight_g.grad is None
    opt.step()
    assert torch.allclose(head.last_layer.weight.norm(dim=1), torch.ones(50), atol=1e-6)
    # Without norm_last_layer, g is trainable.
    assert _small_dino(norm_last_layer=False).last_layer.weight_g.requires_grad


def test_weight_norm_linear_matches_torch_weight_norm() -> None:
    torch.manual_seed(0)
    ours = WeightNormLinear(6, 9)
    with torch.no_grad():
        ours.weight_g.uniform_(0.5, 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ref = nn.utils.weight_norm(nn.Linear(6, 9, bias=False))
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 6)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    # Gradients agree too.
    ours(x).sum().backward()
    ref(x).sum().backward()
    assert torch.allclose(ours.weight_v.grad, ref.weight_v.grad, atol=1e-6)
    assert torch.allclose(ours.weight_g.grad, ref.weight_g.grad, atol=1e-6)


def test_dino_head_matches_lightly_head_with_same_weights() -> None:
    from lightly.models.modules.heads import DINOProjectionHead

    ours = _small_dino()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        theirs = DINOProjectionHead(12, 24, 8, 50)
    sd = {k.replace("mlp.", "layers."): v for k, v in ours.state_dict().items()}
    theirs.load_state_dict(sd, strict=True)
    x = torch.randn(5, 12)
    assert torch.allclose(ours(x), theirs(x), atol=1e-6)


def test_dino_head_survives_deepcopy_and_state_dict() -> None:
    head = _small_dino()
    x = torch.randn(3, 12)
    head(x)  # a forward first: hook-based weight norm breaks deepcopy after it
    clone = copy.deepcopy(head)
    assert torch.equal(clone(x), head(x))
    assert not clone.last_layer.weight_g.requires_grad
    # Independent parameters.
    with torch.no_grad():
        clone.last_layer.weight_v.add_(1.0)
    assert not torch.equal(clone(x), head(x))

    buf = io.BytesIO()
    torch.save(head.state_dict(), buf)
    buf.seek(0)
    fresh = DINOHead(12, out_dim=50, hidden_dim=24, bottleneck_dim=8)
    assert not torch.equal(fresh(x), head(x))
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(fresh(x), head(x))


def test_lightly_dino_head_fails_deepcopy() -> None:
    # Why DINOHead implements weight norm itself: lightly's head (torch's hook-based
    # nn.utils.weight_norm) cannot be deep-copied on this torch version.
    from lightly.models.modules.heads import DINOProjectionHead

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        theirs = DINOProjectionHead(12, 24, 8, 50)
    with pytest.raises(RuntimeError, match="deepcopy"):
        copy.deepcopy(theirs)


def test_dino_cancel_last_layer_gradients() -> None:
    head = _small_dino(norm_last_layer=False)
    head(torch.randn(4, 12)).sum().backward()
    assert head.last_layer.weight_v.grad is not None
    assert head.last_layer.weight_g.grad is not None
    head.cancel_last_layer_gradients()
    assert head.last_layer.weight_v.grad is None
    assert head.last_layer.weight_g.grad is None
    assert all(p.grad is not None for p in head.mlp.parameters())
    # The optimiser then leaves the last layer untouched (even with weight decay).
    before = head.last_layer.weight_v.detach().clone()
    torch.optim.AdamW(head.parameters(), lr=0.1, weight_decay=0.5).step()
    assert torch.equal(head.last_layer.weight_v, before)


# ------------------------------------------------------------------------------------------
# MPP and linear probe


@pytest.mark.parametrize(
    "target,chans,p,shape",
    [
        ("mean_color", 3, 4, (512,)),
        ("mean_color", 1, 4, (8,)),
        ("downsized", 3, 8, (16, 512)),
        ("downsized", 1, 4, (16, 8)),
        ("pixels", 3, 4, (48,)),
        ("pixels", 1, 7, (49,)),
    ],
)
def test_mpp_head_shapes(target: str, chans: int, p: int, shape: tuple[int, ...]) -> None:
    head = MPPHead(16, in_chans=chans, patch_size=p, target=target)  # type: ignore[arg-type]
    out = head(torch.randn(2, 5, 16))
    assert out.shape == (2, 5, *shape)
    assert head.linear.out_features == torch.Size(shape).numel()


def test_mpp_head_downsized_reshape_is_cell_major() -> None:
    head = MPPHead(4, in_chans=1, patch_size=4, target="downsized")
    tok = torch.randn(3, 4)
    flat = head.linear(tok)  # [3, 128]
    assert torch.equal(head(tok), flat.reshape(3, 16, 8))


def test_mpp_head_init_is_trunc_normal_002_with_zero_bias() -> None:
    head = MPPHead(384, in_chans=3, patch_size=16)  # 512 x 384 draws
    assert torch.all(head.linear.bias == 0)
    assert abs(head.linear.weight.std().item() - 0.02) < 0.001 and head.linear.weight.abs().max() <= 2.0


def test_mpp_head_refuses_a_downsized_target_of_a_patch_size_four_does_not_divide() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        MPPHead(8, in_chans=3, patch_size=7, target="downsized")


def test_linear_probe_head() -> None:
    torch.manual_seed(0)
    head = LinearProbeHead(6, 4)
    assert not head.norm.affine and head.norm.eps == 1e-6
    assert list(head.norm.parameters()) == []
    assert torch.all(head.linear.bias == 0)
    # MAE main_linprobe.py: trunc_normal_(head.weight, std=0.01) (timm's default for heads is 0.02)
    assert LinearProbeHead(256, 1000).linear.weight.std().item() == pytest.approx(0.01, rel=0.05)
    x = torch.randn(32, 6) * 3 + 1
    out = head.train()(x)
    standardised = (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + 1e-6)
    assert torch.allclose(out, standardised @ head.linear.weight.T + head.linear.bias, atol=1e-5)
    assert head.eval()(x[:2]).shape == (2, 4)
