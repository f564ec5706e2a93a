"""Backbones: registry, shapes, timm parity, position-embedding resampling, attention paths,
the masking hook and the errors users hit."""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
import torchvision
from helpers import registered_backbones
from timm.layers import resample_abs_pos_embed

from ssl_vit import create_backbone, list_backbones
from ssl_vit.backbones import VisionTransformer, is_vit
from ssl_vit.backbones.pos_embed import resample_pos_embed, sincos_2d_pos_embed

TIMM_NAMES = {"vit_tiny": "vit_tiny_patch16_224", "vit_small": "vit_small_patch16_224", "vit_base": "vit_base_patch16_224"}


def _timm_twin(name: str, **kwargs) -> torch.nn.Module:
    return timm.create_model(TIMM_NAMES[name], pretrained=False, num_classes=0, **kwargs).eval()


# ----------------------------------------------------------------------------- registry


def test_registry_lists_the_families():
    names = list_backbones()
    for name in ["vit_tiny", "vit_small", "vit_base", "vit_large", "vit_huge", "hybrid_r50_vit_base", "resnet18", "resnet50"]:
        assert name in names
    assert names == sorted(names)


def test_unknown_backbone_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown backbone 'vit_gigantic'.*vit_tiny.*\(one of your own: name the module that registers it in SSL_VIT_PLUGINS\)"):
        create_backbone("vit_gigantic")


def test_a_module_registering_its_backbone_again_replaces_it_and_another_builder_is_refused():
    # A reloaded plugin module (a notebook cell run twice) makes a new builder of the same module
    # and name: it replaces the old one. A builder from elsewhere under a taken name is refused.
    from ssl_vit.backbones.registry import _REGISTRY, BackboneSpec, register_backbone

    def make(module: str):
        def vit_reloaded(img_size: int = 16):
            return VisionTransformer(img_size=img_size, embed_dim=32, depth=1, num_heads=2)
        vit_reloaded.__module__ = module
        return vit_reloaded

    try:
        first, again = make("mypkg.backbones"), make("mypkg.backbones")
        register_backbone(BackboneSpec("vit_reloaded", first))
        register_backbone(BackboneSpec("vit_reloaded", again))
        assert _REGISTRY["vit_reloaded"].build is again
        with pytest.raises(ValueError, match="backbone 'vit_reloaded' is registered twice: by mypkg.backbones.*and by other.pkg"):
            register_backbone(BackboneSpec("vit_reloaded", make("other.pkg")))
        assert isinstance(create_backbone("vit_reloaded", img_size=16), VisionTransformer)
    finally:
        _REGISTRY.pop("vit_reloaded", None)


def test_unknown_kwarg_names_accepted_ones():
    with pytest.raises(TypeError, match="unknown argument.*'embed_dim'.*accepts:.*patch_size"):
        create_backbone("vit_tiny", embed_dim=10)


def test_created_backbone_records_its_recipe():
    m = create_backbone("vit_tiny", img_size=28, patch_size=4, in_chans=1)
    assert m.backbone_name == "vit_tiny"
    assert m.backbone_kwargs == {"img_size": 28, "patch_size": 4, "in_chans": 1}


# ----------------------------------------------------------------------------- shapes

# (name, kwargs, embed_dim, tokens): all built on the meta device, so even ViT-H costs nothing.
SHAPE_CASES = [
    ("vit", {"embed_dim": 64, "depth": 4, "num_heads": 4, "patch_size": 32}, 64, 50),
    ("vit_tiny", {}, 192, 197),
    ("vit_small", {"patch_size": 8}, 384, 785),
    ("vit_small_mocov3", {}, 384, 197),
    ("vit_base", {"patch_size": 32}, 768, 50),
    ("vit_large", {}, 1024, 197),
    ("vit_huge", {"patch_size": 14}, 1280, 257),
    ("hybrid_r50_vit_small", {}, 384, 197),
    ("hybrid_r50_vit_base", {}, 768, 197),
    ("hybrid_r50_vit_large", {}, 1024, 197),
    ("hybrid_r18_vit_tiny", {}, 192, 197),
    ("hybrid_r18_vit_small", {"num_stages": 2}, 384, 785),
    ("hybrid", {"resnet": "resnet18", "embed_dim": 64, "depth": 4, "num_heads": 4}, 64, 197),
    ("resnet18", {}, 512, None),
    ("resnet34", {}, 512, None),
    ("resnet50", {}, 2048, None),
    ("resnet101", {}, 2048, None),
]


def test_every_registered_backbone_has_a_shape_case():
    assert sorted({c[0] for c in SHAPE_CASES}) == list_backbones()


@pytest.mark.parametrize("name,kwargs,dim,tokens", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_shapes_at_224(name, kwargs, dim, tokens):
    with torch.device("meta"):
        m = create_backbone(name, **kwargs)
        x = torch.empty(2, 3, 224, 224)
        assert m.embed_dim == dim
        assert m(x).shape == (2, dim)
        feats = m.forward_features(x)
        if tokens is None:
            assert feats.shape == (2, dim, 7, 7)
            assert [t.shape[1] for t in m.get_intermediate_layers(x, 2)] == [dim // 2, dim]
        else:
            assert feats.shape == (2, tokens, dim)
            maps = m.get_attention_maps(x)
            assert len(maps) == m.depth and maps[0].shape == (2, m.num_heads, tokens, tokens)
            assert [t.shape for t in m.get_intermediate_layers(x, 4)] == [(2, tokens, dim)] * 4


def test_small_image_backbones_for_fashion_mnist():
    x = torch.randn(3, 1, 28, 28)
    vit = create_backbone("vit_tiny", img_size=28, patch_size=4, in_chans=1)
    assert vit(x).shape == (3, 192) and vit.forward_features(x).shape == (3, 50, 192)
    hyb = create_backbone("hybrid_r18_vit_tiny", img_size=28, in_chans=1, small_input=True, num_stages=2)
    assert hyb.grid_size == (14, 14) and hyb.patch_size == 2
    assert hyb.forward_features(x).shape == (3, 197, 192)
    res = create_backbone("resnet18", in_chans=1, small_input=True)
    assert res(x).shape == (3, 512) and res.forward_features(x).shape == (3, 512, 4, 4)
    assert is_vit(vit) and is_vit(hyb) and not is_vit(res)


def test_hybrid_and_resnet_train():
    x = torch.randn(4, 3, 32, 32)
    for m in (
        create_backbone("hybrid_r18_vit_tiny", img_size=32, small_input=True, num_stages=3),
        create_backbone("resnet18", small_input=True),
    ):
        m(x).pow(2).mean().backward()
        assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- timm parity


@pytest.mark.parametrize("name", ["vit_tiny", "vit_small", "vit_base"])
@pytest.mark.parametrize("patch_size,img_size", [(16, 48), (8, 32)])
def test_state_dict_loads_into_timm_strict_with_same_outputs(name, patch_size, img_size):
    torch.manual_seed(0)
    ours = create_backbone(name, img_size=img_size, patch_size=patch_size).eval()
    ref = _timm_twin(name, img_size=img_size, patch_size=patch_size)
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert set(ours.state_dict()) == set(ref.state_dict())
    x = torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() < 1e-5
        assert (ours.forward_features(x) - ref.forward_features(x)).abs().max() < 1e-5


@pytest.mark.parametrize("lean_backward", [True, False])
def test_training_step_matches_timm_in_outputs_and_every_gradient(lean_backward):
    # The training path differs from timm's (unbind-then-transpose attention; with lean_backward
    # norm_linear and gelu_linear); it must give timm's gradients.
    torch.manual_seed(0)
    ours = create_backbone("vit_tiny", img_size=32, patch_size=8, lean_backward=lean_backward).train()
    ref = _timm_twin("vit_tiny", img_size=32, patch_size=8).train()
    ref.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(3, 3, 32, 32)
    target = torch.randn(3, 1 + 16, 192)
    for model in (ours, ref):
        ((model.forward_features(x) - target) ** 2).mean().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        g, r = p.grad, ref_grads[name].grad
        assert (g - r).abs().max() <= 1e-5 * r.abs().max() + 1e-12, name


def test_lean_backward_keeps_two_slices_per_block_fewer():
    from ssl_vit.bench import saved_activation_bytes

    x = torch.randn(2, 3, 32, 32)
    saved = {}
    for lean in (True, False):
        torch.manual_seed(0)
        model = create_backbone("vit_tiny", img_size=32, patch_size=8, lean_backward=lean).train()
        saved[lean] = saved_activation_bytes(lambda m=model: m(x).sum().backward(), list(model.parameters()))
    assert saved[False] - saved[True] == 2 * 12 * (2 * 17) * 192 * 4  # QKV's and fc1's inputs, per block


def test_timm_weights_load_into_ours_with_grey_input():
    torch.manual_seed(0)
    ref = _timm_twin("vit_tiny", img_size=28, patch_size=4, in_chans=1)
    ours = create_backbone("vit_tiny", img_size=28, patch_size=4, in_chans=1).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() < 1e-5


def test_parameter_count_matches_the_paper_table():
    # DeiT Table 1 (and timm's model cards): ViT-Ti/S/B at 224 px have 5.7 M / 22.1 M / 86.6 M parameters with a 1000-way head.
    for name, expected in [("vit_tiny", 5.7e6), ("vit_small", 22.1e6), ("vit_base", 86.6e6)]:
        with torch.device("meta"):
            m = create_backbone(name)
        head = m.embed_dim * 1000 + 1000
        assert abs(sum(p.numel() for p in m.parameters()) + head - expected) / expected < 0.01


# ----------------------------------------------------------------------------- position embeddings


def test_other_resolution_matches_timm_dynamic_resampling():
    torch.manual_seed(0)
    ours = create_backbone("vit_tiny", img_size=32, patch_size=8).eval()
    ref = _timm_twin("vit_tiny", img_size=32, patch_size=8, dynamic_img_size=True)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 56, 48)  # a 7x6 grid from a 4x4 one
    with torch.no_grad():
        assert (ours.forward_features(x) - ref.forward_features(x)).abs().max() < 1e-5


def test_resample_matches_timm_and_is_identity_on_same_grid():
    pe = torch.randn(1, 1 + 4 * 4, 16)
    ours = resample_pos_embed(pe, (6, 5), (4, 4))
    ref = resample_abs_pos_embed(pe, (6, 5), (4, 4), num_prefix_tokens=1)
    assert ours.shape == (1, 31, 16)
    assert torch.allclose(ours, ref, atol=1e-6)
    assert torch.equal(ours[:, 0], pe[:, 0])  # [CLS] position untouched
    assert resample_pos_embed(pe, (4, 4), (4, 4)) is pe


def test_resampling_a_grid_that_is_not_square_matches_timm():
    # a 3x5 grid (a 48x80 px model at patch 16) to 6x10 and to 5x3: rows and columns kept apart
    pe = torch.randn(1, 1 + 3 * 5, 16)
    for new in ((6, 10), (5, 3)):
        ref = resample_abs_pos_embed(pe, new, (3, 5), num_prefix_tokens=1)
        assert torch.allclose(resample_pos_embed(pe, new, (3, 5)), ref, atol=1e-6)


def test_average_pooling_matches_timms_avg_pool_vit():
    # global_pool="avg": the mean of the patch tokens after the final LayerNorm, [CLS] left out
    # (timm's global_pool="avg" with fc_norm=False, the layout our exports declare)
    torch.manual_seed(0)
    ours = create_backbone("vit_tiny", img_size=32, patch_size=8, global_pool="avg").eval()
    ref = _timm_twin("vit_tiny", img_size=32, patch_size=8, global_pool="avg", fc_norm=False)
    ref.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() < 1e-5


def test_set_img_size_changes_the_grid_permanently():
    torch.manual_seed(0)
    m = create_backbone("vit_tiny", img_size=32, patch_size=8).eval()
    old = m.pos_embed.detach().clone()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        on_the_fly = m(x)
        m.set_img_size(64)
        assert m.pos_embed.shape == (1, 1 + 64, 192) and m.grid_size == (8, 8)
        assert torch.allclose(m(x), on_the_fly, atol=1e-6)
    assert torch.allclose(m.pos_embed, resample_abs_pos_embed(old, (8, 8), (4, 4)), atol=1e-6)
    with pytest.raises(ValueError, match="not divisible by the patch size 8"):
        m.set_img_size(60)


def test_a_fixed_sincos_table_stays_fixed_and_exact_at_a_new_resolution():
    m = create_backbone("vit", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, pos_embed="sincos")
    m.set_img_size(24)
    assert not m.pos_embed.requires_grad and m.pos_embed_type == "sincos"
    torch.testing.assert_close(m.pos_embed, sincos_2d_pos_embed(32, (6, 6), 1).to(m.pos_embed), rtol=0, atol=0)
    m.make_pos_embed_learnable()  # fine-tuning: learned from here on, and resampled as any learned one
    m.set_img_size(16)
    assert m.pos_embed.requires_grad and m.pos_embed_type == "learn"


def test_sincos_position_embedding_is_frozen_and_follows_the_formula():
    m = create_backbone("vit_small", img_size=32, patch_size=8, pos_embed="sincos")
    assert not m.pos_embed.requires_grad
    pe = m.pos_embed[0]  # [1+16, 384]
    assert torch.count_nonzero(pe[0]) == 0  # [CLS] gets no position
    # MoCo v3 §4.2: first quarter sin(r * omega_k) of the patch's row r, last cos(c * omega_k) of
    # its column c, omega_k = 10000^(-k / (D/4)); row-major grid.
    d4 = 384 // 4
    for idx, (r, c) in [(1, (0, 0)), (2, (0, 1)), (7, (1, 2)), (16, (3, 3))]:
        for k in (0, 5, d4 - 1):
            omega = 1.0 / 10000 ** (k / d4)
            assert abs(pe[idx, k].item() - torch.sin(torch.tensor(r * omega)).item()) < 1e-6
            assert abs(pe[idx, 3 * d4 + k].item() - torch.cos(torch.tensor(c * omega)).item()) < 1e-6
    # The reference's construction (vits.py), written out: meshgrid over (w, h) with the default
    # "ij" indexing, flattened, the "w" grid first.
    side, dim = 5, 64
    gw, gh = torch.meshgrid(torch.arange(side, dtype=torch.float32), torch.arange(side, dtype=torch.float32), indexing="ij")
    om = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    ow, oh = torch.outer(gw.flatten(), om), torch.outer(gh.flatten(), om)
    reference = torch.cat([ow.sin(), ow.cos(), oh.sin(), oh.cos()], dim=1)
    assert torch.equal(sincos_2d_pos_embed(dim, (side, side))[0, 1:], reference)
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_2d_pos_embed(30, (2, 2))


# ----------------------------------------------------------------------------- attention paths


def test_attention_weight_path_agrees_with_fused_path():
    torch.manual_seed(0)
    m = create_backbone("vit_tiny", img_size=32, patch_size=8).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fused = m.forward_features(x)
        tokens = m.prepare_tokens(x)
        attns = []
        for blk in m.blocks:
            tokens, attn = blk(tokens, return_attention=True)
            attns.append(attn)
        explicit = m.norm(tokens)
        maps = m.get_attention_maps(x)
    assert (fused - explicit).abs().max() < 1e-5
    assert len(maps) == 12 and all(torch.allclose(a, b) for a, b in zip(maps, attns))
    assert torch.allclose(maps[0].sum(-1), torch.ones(2, 3, 17), atol=1e-5)


def test_attention_weights_follow_softmax_qk():
    torch.manual_seed(0)
    m = VisionTransformer(img_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=2).eval()
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        tokens = m.blocks[0].norm1(m.prepare_tokens(x))[0]  # [5, 8]
        q, k, _ = m.blocks[0].attn.qkv(tokens).chunk(3, dim=-1)
        for h in range(2):
            qh, kh = q[:, 4 * h : 4 * h + 4], k[:, 4 * h : 4 * h + 4]
            expected = torch.softmax(qh @ kh.T / 2.0, dim=-1)  # sqrt(head_dim) = 2
            assert torch.allclose(m.get_attention_maps(x)[0][0, h], expected, atol=1e-6)


def test_intermediate_layers_end_with_forward_features():
    torch.manual_seed(0)
    m = create_backbone("vit_tiny", img_size=16, patch_size=8).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        last = m.get_intermediate_layers(x, 1)[0]
        raw = m.get_intermediate_layers(x, [0, 11], norm=False)
        assert torch.allclose(last, m.forward_features(x), atol=1e-6)
        assert torch.allclose(m.norm(raw[1]), last, atol=1e-6)
        assert not torch.allclose(raw[0], raw[1])
    with pytest.raises(ValueError, match=r"n=\[12\]: blocks \[12\] are out of range for a backbone of depth 12"):
        m.get_intermediate_layers(x, [12])
    for n in (0, -1, 13):  # "the last n blocks": none, or more than there are, is an error, not []
        with pytest.raises(ValueError, match=rf"n={n}: blocks .* are out of range for a backbone of depth 12 \(the last 1..12, or indices\)"):
            m.get_intermediate_layers(x, n)
    resnet = create_backbone("resnet18", in_chans=3)
    for n in (0, 5):
        with pytest.raises(ValueError, match=r"n must be a number of last stages in 1..4"):
            resnet.get_intermediate_layers(torch.randn(1, 3, 32, 32), n)


# ----------------------------------------------------------------------------- masking hook


def test_patch_hook_runs_before_the_position_embedding():
    torch.manual_seed(0)
    m = create_backbone("vit_tiny", img_size=32, patch_size=8).eval()
    a, b = torch.randn(1, 3, 32, 32), torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        emb_b, _ = m.patch_embed(b)
        # Replacing every patch embedding of a by b's makes a look exactly like b.
        assert torch.allclose(m.forward_features(a, patch_hook=lambda t: emb_b), m.forward_features(b), atol=1e-6)
        # Permuting patch embeddings changes the [CLS] output only because positions are added after
        # the hook: with a zero position embedding, self-attention is permutation-equivariant.
        perm = torch.randperm(16)
        assert not torch.allclose(m(a), m.pool(m.forward_features(a, patch_hook=lambda t: t[:, perm])), atol=1e-4)
        m.pos_embed.zero_()
        assert torch.allclose(m(a), m.pool(m.forward_features(a, patch_hook=lambda t: t[:, perm])), atol=1e-5)


def test_patch_hook_replaces_chosen_positions_with_a_mask_embedding():
    torch.manual_seed(0)
    m = create_backbone("vit_tiny", img_size=16, patch_size=8)
    mask_token = torch.zeros(192, requires_grad=True)
    where = torch.tensor([[True, False, False, True]])
    seen = {}

    def hook(tokens):
        seen["before"] = tokens
        out = torch.where(where[..., None], mask_token.expand_as(tokens), tokens)
        seen["after"] = out
        return out

    m.forward_features(torch.randn(1, 3, 16, 16), patch_hook=hook).sum().backward()
    assert torch.equal(seen["after"][0, 0], mask_token.detach()) and torch.equal(seen["after"][0, 1], seen["before"][0, 1])
    assert mask_token.grad is not None and mask_token.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- training details


def test_drop_path_is_stochastic_in_training_only_and_grows_with_depth():
    m = create_backbone("vit_tiny", img_size=16, patch_size=8, drop_path_rate=0.2)
    assert isinstance(m.blocks[0].drop_path, torch.nn.Identity)
    assert m.blocks[-1].drop_path.p == pytest.approx(0.2)
    assert m.blocks[6].drop_path.p == pytest.approx(0.2 * 6 / 11)
    x = torch.randn(8, 3, 16, 16)
    torch.manual_seed(0)
    a = m.train()(x)
    b = m(x)
    assert not torch.allclose(a, b)
    m.eval()
    assert torch.equal(m(x), m(x))


def test_no_weight_decay_and_grad_checkpointing():
    m = create_backbone("vit_tiny", img_size=16, patch_size=8)
    assert m.no_weight_decay() == {"pos_embed", "cls_token"}
    x = torch.randn(2, 3, 16, 16)
    twin = copy.deepcopy(m)
    twin.set_grad_checkpointing(True)
    m(x).sum().backward()
    twin(x).sum().backward()
    for (name, p), q in zip(m.named_parameters(), twin.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name


def test_resnet_keys_are_torchvision_keys():
    ours = create_backbone("resnet18").eval()
    ref = torchvision.models.resnet18()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert sorted(missing) == ["fc.bias", "fc.weight"] and unexpected == []
    ref.fc = torch.nn.Identity()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(ours(x), ref.eval()(x), atol=1e-5)
    with pytest.raises(NotImplementedError, match="no attention"):
        ours.get_attention_maps(x)


# ----------------------------------------------------------------------------- errors


def test_image_size_not_divisible_by_patch_size_at_construction():
    with pytest.raises(ValueError, match=r"image size 30x30 is not divisible by the patch size 4"):
        create_backbone("vit_tiny", img_size=30, patch_size=4)


def test_image_size_not_divisible_at_forward():
    m = create_backbone("vit_tiny", img_size=28, patch_size=4, in_chans=1)
    with pytest.raises(ValueError, match=r"image size 30x28 is not divisible by the patch size 4"):
        m(torch.randn(1, 1, 30, 28))


@pytest.mark.parametrize("name,kwargs", [("vit_tiny", {"img_size": 28, "patch_size": 4, "in_chans": 1}), ("resnet18", {"in_chans": 1})])
def test_wrong_channel_count_at_forward(name, kwargs):
    m = create_backbone(name, **kwargs)
    with pytest.raises(ValueError, match=r"built for 1 input channels, got 3 \(the backbone takes grey images: set the data's in_chans to 1\)"):
        m(torch.randn(1, 3, 28, 28))
    with pytest.raises(ValueError, match=r"expects images \[B, C, H, W\]"):
        m(torch.randn(1, 28, 28))
    rgb = create_backbone(name, **{**kwargs, "in_chans": 3})
    with pytest.raises(ValueError, match=r"built for 3 input channels, got 1 \(the backbone takes RGB images: set the data's in_chans to 3"):
        rgb(torch.randn(1, 1, 28, 28))


def test_bad_architecture_arguments():
    # create_backbone checks a recipe's kwargs against the builders' typed signatures, once
    with pytest.raises(TypeError, match="backbone 'vit_tiny': pos_embed must be one of 'learn', 'sincos', got '2d'"):
        create_backbone("vit_tiny", pos_embed="2d")
    with pytest.raises(TypeError, match="backbone 'hybrid': resnet must be one of 'resnet18', 'resnet50', got 'resnet34'"):
        create_backbone("hybrid", img_size=32, embed_dim=32, depth=1, num_heads=2, resnet="resnet34")
    with pytest.raises(TypeError, match="backbone 'resnet18': num_stages must be one of 1, 2, 3, 4, got 5"):
        create_backbone("resnet18", num_stages=5)
    with pytest.raises(ValueError, match="embed_dim 10 is not divisible by num_heads 3"):
        create_backbone("vit", embed_dim=10, depth=1, num_heads=3)


@pytest.mark.parametrize("kwargs, message", [
    ({"embed_dim": "abc"}, "backbone 'vit': embed_dim must be an integer, got 'abc'"),
    ({"depth": 2.5}, "backbone 'vit': depth must be an integer, got 2.5"),
    ({"qkv_bias": 1}, "backbone 'vit': qkv_bias must be true or false, got 1"),
    ({"drop_path_rate": "0.1"}, "backbone 'vit': drop_path_rate must be a number, got '0.1'"),
])
def test_a_backbone_argument_of_the_wrong_type_is_named(kwargs, message):
    with pytest.raises((TypeError, ValueError)) as err:
        create_backbone("vit", **{"img_size": 28, "patch_size": 7, "embed_dim": 32, "depth": 1, "num_heads": 2, **kwargs})
    assert message in str(err.value)
    create_backbone("vit", img_size=[28, 14], patch_size=7, embed_dim=32, depth=1, num_heads=2, drop_path_rate=0)  # an int where a float goes


# ----------------------------------------------------------------------------- sizes (`ssl-vit backbones`)


@pytest.mark.parametrize(
    ("name", "peer"),
    [
        ("vit_small", lambda: timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0)),
        ("resnet50", lambda: torchvision.models.resnet50(num_classes=1)),
    ],
)
def test_backbone_size_matches_the_peer_model_counted_by_torch(name, peer):
    from torch.utils.flop_counter import FlopCounterMode

    from ssl_vit.cli.backbones import backbone_size

    size = backbone_size(name, 224, {"img_size": 224})
    with torch.device("meta"):
        model = peer()
    params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("fc."))  # torchvision's classifier
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, 224, 224, device="meta"))
    fc = 2 * 2048 if name == "resnet50" else 0  # torchvision's 1-class classifier, not part of the backbone
    assert size.params == params
    assert size.forward_flops == pytest.approx(counter.get_total_flops() - fc, rel=1e-6)
    assert size.tokens == (197 if name == "vit_small" else None)
    # a training pass: 3x the forward, less the image's gradient through the first layer
    assert 2.9 * size.forward_flops < size.train_flops < 3 * size.forward_flops


def test_backbones_command_lists_sizes_and_says_why_a_backbone_cannot_be_sized(capsys):
    from ssl_vit.cli.backbones import main

    assert main(["--img-size", "28", "--in-chans", "1", "--sort", "flops", "--no-kwargs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("at 28x28 px, 1 channel;")
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == set(list_backbones())
    assert "(image size 28x28 is not divisible by the patch size 16)" in rows["vit_small"]
    assert "(no shape of its own: set embed_dim, depth, num_heads with --arg)" in rows["vit"]
    sized = [line.split()[0] for line in lines[2:] if line.split()[2] != "-"]
    flops = [float(rows[n].split()[2]) for n in sized]
    assert "resnet18" in sized and flops == sorted(flops) and lines.index(rows["vit_small"]) > lines.index(rows["resnet50"])

    # an --arg goes to the backbones that take it: the ResNet's CIFAR stem beside a ViT
    assert main(["vit_tiny", "resnet18", "--img-size", "28", "--patch-size", "7", "--arg", "small_input=true", "--no-kwargs"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["vit_tiny"][4] == "17" and float(rows["resnet18"][2]) > 0.5  # stride-1 stem, no max-pool: 0.91 (0.07 without)

    # at 224 px, params and forward FLOPs order resnet50 and vit_small differently; training ~3x forward
    orders = []
    for sort, column in (("params", 1), ("flops", 2)):
        assert main(["resnet50", "vit_small", "--sort", sort, "--no-kwargs"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("at 224x224 px")  # the default resolution
        table = [line.split() for line in out.splitlines()[2:]]
        values = [float(row[column].rstrip("M")) for row in table]
        assert values == sorted(values), (sort, table)
        assert all(2.9 * float(row[2]) < float(row[3]) < 3 * float(row[2]) for row in table)
        orders.append([row[0] for row in table])
    assert orders == [["vit_small", "resnet50"], ["resnet50", "vit_small"]]


def test_backbones_command_errors_name_the_problem(capsys):
    from ssl_vit.cli.backbones import main

    with pytest.raises(ValueError, match="backbone 'vit_tiny': image size 30x30 is not divisible by the patch size 16"):
        main(["vit_tiny", "--img-size", "30"])
    with pytest.raises(ValueError, match=r"--arg small_inpt: no argument of backbone 'resnet18' \(did you mean 'small_input'\?\); "
                                         r"--arg takes layers, num_stages, small_input, zero_init_residual \(and --img-size"):
        main(["resnet18", "--arg", "small_inpt=1"])
    with pytest.raises(ValueError, match=r"--arg depth: no argument of these backbones; --arg takes "):
        main(["resnet18", "resnet50", "--arg", "depth=3"])
    with pytest.raises(ValueError, match="unknown backbone 'vit_smal'"):
        main(["vit_smal"])
    # the header and the FLOPs read the options: the same setting through --arg would contradict them
    with pytest.raises(ValueError, match=r"--arg img_size, in_chans: no argument of backbone 'vit_tiny'; .*\(and --img-size, --in-chans, --patch-size their own\)"):
        main(["vit_tiny", "--arg", "img_size=32", "--arg", "in_chans=1"])
    with pytest.raises(ValueError, match=r"--arg patch_size: no argument"):
        main(["vit_tiny", "--arg", "patch_size=8"])
    # a named `vit` takes its shape from --arg; values are read as YAML (numbers are numbers)
    assert main(["vit", "--arg", "embed_dim=128", "--arg", "depth=4", "--arg", "num_heads=4", "--img-size", "28", "--patch-size", "7", "--no-kwargs"]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    assert row[0] == "vit" and row[1] == "0.8M" and row[4] == "17"
    with pytest.raises(ValueError, match=r"backbone 'vit': no shape of its own: set embed_dim, depth, num_heads with --arg"):
        main(["vit"])
    with pytest.raises(TypeError, match=r"backbone 'vit' needs depth \(it has no shape of its own"):
        create_backbone("vit", embed_dim=64, num_heads=4)  # not ViT-B's 12 layers behind the user's back
    with pytest.raises(ValueError, match=r"backbone 'hybrid': no shape of its own: set resnet with --arg"):
        main(["hybrid", "--arg", "embed_dim=128", "--arg", "depth=4", "--arg", "num_heads=4"])


def test_a_hybrid_of_any_width_sits_beside_small_vits():
    # `hybrid`: ResNet-18's stem and first stage (stride 4 at 28 px: 7x7 tokens) feeding a 4-layer D=128 ViT
    hybrid = create_backbone("hybrid", resnet="resnet18", embed_dim=128, depth=4, num_heads=4, img_size=28, in_chans=1, num_stages=1)
    assert hybrid.grid_size == (7, 7) and hybrid.embed_dim == 128 and len(hybrid.blocks) == 4
    assert hybrid(torch.randn(2, 1, 28, 28)).shape == (2, 128)
    assert hybrid.get_attention_maps(torch.randn(1, 1, 28, 28))[0].shape == (1, 4, 50, 50)


def test_a_builder_taking_kwargs_passes_them_on_and_a_backbone_without_the_interface_is_named():
    def vit_forwarding(depth: int = 1, **kwargs):  # a subclass' builder that passes the rest on
        return VisionTransformer(depth=depth, embed_dim=32, num_heads=2, **kwargs)

    class Bare(torch.nn.Module):  # no embed_dim, no forward_features
        in_chans, img_size = 1, (16, 16)

    with registered_backbones(vit_forwarding_test=vit_forwarding, bare_test=Bare):
        model = create_backbone("vit_forwarding_test", img_size=16, patch_size=4, in_chans=1, drop_path_rate=0.1)
        assert model.img_size == (16, 16) and model.backbone_kwargs["drop_path_rate"] == 0.1
        from ssl_vit.methods import Supervised

        # a momentum encoder / teacher is built without stochastic depth
        online = Supervised(backbone="vit_forwarding_test", backbone_kwargs={"img_size": 16, "patch_size": 4, "in_chans": 1,
                                                                               "drop_path_rate": 0.1, "depth": 2}, num_classes=2)
        assert not isinstance(online.backbone.blocks[-1].drop_path, torch.nn.Identity)  # (the rate grows with depth from 0)
        assert isinstance(online.target_backbone().blocks[-1].drop_path, torch.nn.Identity)
        with pytest.raises(TypeError, match=r"backbone 'bare_test' \(Bare\) lacks embed_dim, forward_features, which every backbone has"):
            create_backbone("bare_test")


@pytest.mark.parametrize("kwargs", [{"small_input": False, "num_stages": 1}, {"small_input": False, "num_stages": 3},
                                    {"small_input": True, "num_stages": 2}])
def test_a_resnets_stride_and_a_hybrids_patch_size_are_what_the_feature_map_shows(kwargs):
    # The stride (pixels per token: the analysis figures' distances) against the feature map a
    # forward pass makes: torchvision's stem halves twice (conv1, maxpool), each stage after the first once more.
    resnet = create_backbone("resnet18", img_size=64, in_chans=1, **kwargs)
    fmap = resnet.forward_features(torch.randn(2, 1, 64, 64))  # [2, C, h, w]
    assert resnet.stride == 64 // fmap.shape[-1] == 64 // fmap.shape[-2]
    hybrid = create_backbone("hybrid", resnet="resnet18", embed_dim=32, depth=1, num_heads=2, img_size=64, in_chans=1, **kwargs)
    tokens = hybrid.forward_features(torch.randn(2, 1, 64, 64))  # [2, 1 + N, D]
    assert hybrid.patch_embed.patch_size == 64 // math.isqrt(tokens.shape[1] - 1)


def test_a_module_argument_is_not_a_registry_kwarg():
    # registry.py allowed_kwargs: VisionTransformer's patch_embed (the hybrid's stem goes there)
    # is a module, not a setting a recipe or a checkpoint's record can carry.
    from ssl_vit.backbones.registry import get_spec

    assert "patch_embed" not in get_spec("vit_small").allowed_kwargs() and "img_size" in get_spec("vit_small").allowed_kwargs()
    with pytest.raises(TypeError, match=r"backbone 'vit_tiny' got unknown argument\(s\) \['patch_embed'\]"):
        create_backbone("vit_tiny", patch_embed=torch.nn.Identity())
