"""Export checked against independent references: timm's own model definitions and pretrained
configs (architecture names, ``first_conv``, channel adaptation), the safetensors file format,
Lightning's checkpoint fields and hand-written expectations."""

from __future__ import annotations

import json

import lightning as L
import pytest
import timm
import torch
from helpers import TINY_BACKBONE, TINY_VIT, RepeatBatch, fixed_views
from safetensors import safe_open
from safetensors.torch import load_file
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch.utils.data import DataLoader

from ssl_vit import create_backbone
from ssl_vit.export import (
    export_backbone,
    filter_foreign_state_dict,
    load_any_backbone,
    save_backbone,
)
from ssl_vit.export.config import TIMM_VIT_ENTRY_POINTS, timm_architecture
from ssl_vit.flops import PretrainFlopsCounter, pretrain_flops_from_checkpoint
from ssl_vit.methods import Supervised

GEOMETRY = {"img_size": 16, "patch_size": 4, "in_chans": 1}
TIMM_TINY = {**TINY_VIT}  # our tiny ViT's arguments are timm's names for the same shape


def _x(c: int = 1, s: int = 16, b: int = 3) -> torch.Tensor:
    return torch.randn(b, c, s, s, generator=torch.Generator().manual_seed(7))


def _timm_shape(name: str, **kwargs) -> tuple[int, int, int, int]:
    """(width, depth, heads, MLP width) of timm's model ``name``, built on the meta device."""
    with torch.device("meta"):
        m = timm.create_model(name, pretrained=False, num_classes=0, **kwargs)
    return m.embed_dim, len(m.blocks), m.blocks[0].attn.num_heads, m.blocks[0].mlp.fc1.out_features


def _config(out) -> dict:
    return json.loads((out / "config.json").read_text())


# ------------------------------------------------------------------------ timm architecture


@pytest.mark.parametrize("size", ["tiny", "small", "base", "large", "huge"])
def test_each_vit_size_is_named_after_the_timm_model_of_its_shape(size):
    # Reference: timm's own entry point of that name has the same width, depth, heads and MLP
    # (ViT paper Table 1 / DeiT Ti), and the name says ViT-<size>.
    with torch.device("meta"):
        ours = create_backbone(f"vit_{size}")
    name, args = timm_architecture(ours)
    assert name.startswith(f"vit_{size}_patch")
    assert _timm_shape(name) == (ours.embed_dim, ours.depth, ours.num_heads, ours.blocks[0].mlp.fc1.out_features)
    assert (args["embed_dim"], args["depth"], args["num_heads"]) == (ours.embed_dim, ours.depth, ours.num_heads)


@pytest.mark.parametrize("size, patch, img", [(size, patch, img) for size, points in TIMM_VIT_ENTRY_POINTS.items() for patch, img in points])
def test_each_named_patch_and_resolution_is_a_timm_entry_point_of_that_exact_model(size, patch, img):
    # Reference: timm's registry. The name an export writes for a ViT-<size>/<patch> at <img> px
    # is an entry point of timm that builds, with no overrides, a model whose every parameter has
    # the shape of ours.
    with torch.device("meta"):
        ours = create_backbone(f"vit_{size}", patch_size=patch, img_size=img)
    name, _ = timm_architecture(ours)
    assert name == f"vit_{size}_patch{patch}_{img}" and timm.is_model(name)
    with torch.device("meta"):
        ref = timm.create_model(name, pretrained=False, num_classes=0)
    assert {k: v.shape for k, v in ref.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}


def test_every_plain_vit_entry_point_of_timm_is_in_the_table():
    # Reference: timm's registry, the other way round: each vit_<size>_patch<P>_<S> it lists is
    # one the table names exactly (a missing one would be exported under another shape's name).
    import re

    listed = {(m[1], int(m[2]), int(m[3])) for n in timm.list_models("vit_*") if (m := re.fullmatch(r"vit_(\w+?)_patch(\d+)_(\d+)", n))}
    plain = {(size, patch, img) for size, patch, img in listed if size in TIMM_VIT_ENTRY_POINTS}
    ours = {(size, patch, img) for size, points in TIMM_VIT_ENTRY_POINTS.items() for patch, img in points}
    assert len(plain) >= 15 and plain == ours


@pytest.mark.parametrize("size, patch, img, named", [("huge", 16, 224, "vit_huge_patch14_224"), ("tiny", 8, 224, "vit_tiny_patch16_224"),
                                                      ("small", 16, 96, "vit_small_patch16_224")])
def test_a_shape_timm_has_no_entry_point_for_takes_its_size_s_first_with_its_own_arguments(size, patch, img, named):
    # timm registers no ViT-H/16, ViT-Ti/8 or 96-px ViT-S/16 (checked here): the name falls back to
    # the size's entry point and model_args carry the patch and image size, from which timm builds
    # our shape.
    assert not timm.is_model(f"vit_{size}_patch{patch}_{img}")
    with torch.device("meta"):
        ours = create_backbone(f"vit_{size}", patch_size=patch, img_size=img)
        name, args = timm_architecture(ours)
        ref = timm.create_model(name, pretrained=False, num_classes=0, **args)
    assert name == named
    assert {k: v.shape for k, v in ref.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}


def test_a_vit_tiny_export_names_vit_tiny_patch16_224_and_that_name_alone_fits_the_weights(tmp_path):
    # Reference: timm.create_model("vit_tiny_patch16_224") with only the image geometry given
    # (width, depth and heads from timm's definition) loads the file strictly and computes the same.
    out = export_backbone("random:vit_tiny", tmp_path / "exp", backbone_kwargs=GEOMETRY).out_dir
    cfg = _config(out)
    assert cfg["architecture"] == "vit_tiny_patch16_224"
    args = cfg["model_args"]
    assert (args["img_size"], args["patch_size"], args["in_chans"]) == ([16, 16], 4, 1)
    assert (args["embed_dim"], args["depth"], args["num_heads"]) == (192, 12, 3)
    ref = timm.create_model(cfg["architecture"], pretrained=False, num_classes=0, **GEOMETRY).eval()
    ref.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    model, _ = load_any_backbone(out)
    x = _x()
    torch.testing.assert_close(ref(x), model(x))


def test_another_shape_rebuilds_from_the_base_entry_point_with_its_own_arguments(tmp_path):
    # The documented fallback (config.py: "any other shape rebuilds from the base entry point with
    # overrides"); reference: timm builds that entry point at the recorded shape.
    out = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=TINY_VIT).out_dir
    cfg = _config(out)
    assert cfg["architecture"] == "vit_base_patch16_224"
    assert _timm_shape(cfg["architecture"], **cfg["model_args"]) == (32, 2, 2, 128)


def test_first_conv_names_timm_patch_projection_and_lets_timm_adapt_the_channels(tmp_path):
    # Reference: timm's pretrained config of the same model says first_conv="patch_embed.proj"
    # (classifier "head"), and timm's loader uses first_conv to adapt RGB weights to a grey model
    # (adapt_input_conv sums the filters): the grey model on x == the RGB model on x repeated.
    kwargs = {**TINY_VIT, "in_chans": 3}
    out = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=kwargs).out_dir
    cfg = _config(out)["pretrained_cfg"]
    timm_cfg = timm.models.get_pretrained_cfg("vit_tiny_patch16_224")
    assert cfg["first_conv"] == timm_cfg.first_conv == "patch_embed.proj"
    assert cfg["classifier"] == timm_cfg.classifier == "head"
    timm_rgb = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert f"{cfg['first_conv']}.weight" in timm_rgb.state_dict()
    assert f"{cfg['first_conv']}.weight" in load_file(out / "model.safetensors")
    timm_grey = timm.create_model(f"local-dir:{out}", pretrained=True, in_chans=1).eval()
    rgb, _ = load_any_backbone(out)
    x = _x(1)
    torch.testing.assert_close(timm_grey(x), rgb(x.repeat(1, 3, 1, 1)), atol=1e-5, rtol=1e-5)


def test_a_vit_without_qkv_bias_loads_strictly_into_timm_and_computes_the_same(tmp_path):
    # Reference: timm's VisionTransformer(qkv_bias=False) has no qkv.bias; config.json's model_args
    # must say so, both through the named entry point and through local-dir.
    kwargs = {**TINY_VIT, "qkv_bias": False}
    out = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=kwargs).out_dir
    weights = load_file(out / "model.safetensors")
    assert not any(k.endswith("attn.qkv.bias") for k in weights)
    cfg = _config(out)
    assert cfg["model_args"]["qkv_bias"] is False
    model, _ = load_any_backbone(out)
    x = _x()
    direct = TimmViT(**TIMM_TINY, qkv_bias=False, num_classes=0).eval()
    direct.load_state_dict(weights, strict=True)
    named = timm.create_model(cfg["architecture"], pretrained=False, num_classes=0, **cfg["model_args"]).eval()
    named.load_state_dict(weights, strict=True)
    from_dir = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    for ref in (direct, named, from_dir):
        torch.testing.assert_close(ref(x), model(x))


# ------------------------------------------------------------------------ normalisation


def test_default_normalisation_is_imagenet_for_rgb_and_half_for_grey(tmp_path):
    # Reference: timm's IMAGENET_DEFAULT_MEAN / STD for 3 channels; 0.5 / 0.5 otherwise (config.py).
    rgb = export_backbone("random:vit", tmp_path / "rgb", backbone_kwargs={**TINY_VIT, "in_chans": 3}).config
    assert rgb["mean"] == pytest.approx(list(IMAGENET_DEFAULT_MEAN)) and rgb["std"] == pytest.approx(list(IMAGENET_DEFAULT_STD))
    grey = export_backbone("random:vit", tmp_path / "grey", backbone_kwargs=TINY_VIT).config
    assert grey["mean"] == [0.5] and grey["std"] == [0.5]


def test_grey_statistics_are_repeated_for_a_three_channel_model(tmp_path):
    # Hand-written expectation: a grey model's recorded mean 0.3 / std 0.2, loaded or exported as a
    # 3-channel model, become [0.3] * 3 / [0.2] * 3 (every channel holds the grey image); and the
    # adapted model on the grey image repeated and so normalised gives the grey model's features.
    from ssl_vit.export import BackboneSource

    torch.manual_seed(0)
    grey = create_backbone("vit", **TINY_VIT).eval()
    recorded = {"mean": [0.3], "std": [0.2], "source": "training data (FakeData)"}
    source = BackboneSource({}, "vit", dict(TINY_VIT), "memory", "memory", normalization=recorded)
    grey_dir = save_backbone(grey, tmp_path / "grey", source).out_dir
    assert _config(grey_dir)["mean"] == [0.3]

    rgb, info = load_any_backbone(grey_dir, backbone_kwargs={"in_chans": 3})
    assert info["mean"] == pytest.approx([0.3] * 3) and info["std"] == pytest.approx([0.2] * 3)
    assert info["normalization_source"] == "training data (FakeData)"
    x = torch.rand(3, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    mean, std = torch.tensor(info["mean"]).view(1, 3, 1, 1), torch.tensor(info["std"]).view(1, 3, 1, 1)
    torch.testing.assert_close(rgb((x.repeat(1, 3, 1, 1) - mean) / std), grey((x - 0.3) / 0.2), atol=1e-5, rtol=1e-5)

    cfg = export_backbone(grey_dir, tmp_path / "rgb", backbone_kwargs={"in_chans": 3}).config
    for where in (cfg, cfg["pretrained_cfg"], cfg["ssl_vit"]["normalization"]):
        assert where["mean"] == pytest.approx([0.3] * 3) and where["std"] == pytest.approx([0.2] * 3)
    assert cfg["input_size"] == [3, 16, 16]


# ------------------------------------------------------------------------ foreign weights


def test_fc_norm_and_pre_logits_of_a_foreign_state_dict_are_dropped(tmp_path):
    # Reference: a timm ViT's own state dict, plus the classifier-side parameters the docstring
    # lists (fc_norm.*, pre_logits.*, head.*), which no backbone of ours has; what remains loads
    # strictly and computes timm's pre-logits features.
    torch.manual_seed(0)
    timm_vit = TimmViT(**TIMM_TINY, num_classes=5).eval()
    state = dict(timm_vit.state_dict())
    state |= {"fc_norm.weight": torch.ones(32), "fc_norm.bias": torch.zeros(32), "pre_logits.fc.weight": torch.zeros(32, 32)}
    ours = create_backbone("vit", **TINY_VIT).eval()
    filtered = filter_foreign_state_dict(state, ours)
    assert set(filtered) == set(ours.state_dict())
    ours.load_state_dict(filtered, strict=True)
    x = _x()
    expected = timm_vit.forward_head(timm_vit.forward_features(x), pre_logits=True)
    torch.testing.assert_close(ours(x), expected)
    # the same through a file on disk
    torch.save(state, tmp_path / "timm_vit.pth")
    loaded, info = load_any_backbone(tmp_path / "timm_vit.pth", backbone="vit", backbone_kwargs=TINY_VIT)
    assert info["kind"] == "state_dict"
    torch.testing.assert_close(loaded(x), expected)


# ------------------------------------------------------------------------ file format


def test_safetensors_metadata_says_format_pt(tmp_path):
    # Reference: the safetensors reader; Hugging Face loaders expect metadata {"format": "pt"}.
    out = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=TINY_VIT).out_dir
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() is not None and f.metadata().get("format") == "pt"
        assert set(f.keys()) == set(create_backbone("vit", **TINY_VIT).state_dict())


# ------------------------------------------------------------------------ training record


@pytest.fixture(scope="module")
def supervised_ckpt(tmp_path_factory):
    """A checkpoint written by a real Trainer after 3 steps (2 batches per epoch), with the FLOP
    counter of `ssl-vit fit`; returns (path, FLOPs the callback counted)."""
    torch.manual_seed(0)
    model = Supervised(**TINY_BACKBONE, num_classes=4, warmup_epochs=0.0, base_lr=0.1, weight_decay=0.0)
    counter = PretrainFlopsCounter()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[counter])
    views, labels = fixed_views([16], batch=4)
    trainer.fit(model, DataLoader(RepeatBatch(views, labels, 2), batch_size=None))
    path = tmp_path_factory.mktemp("sup") / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(path)
    return path, counter.total


def test_load_any_backbone_reads_pretrain_flops_and_global_step(supervised_ckpt, tmp_path):
    # Reference: Lightning's own checkpoint fields (global_step, epoch) and the FLOPs the
    # PretrainFlopsCounter callback counted (read back with flops.pretrain_flops_from_checkpoint).
    path, flops = supervised_ckpt
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["global_step"] == 3 and flops > 0
    assert pretrain_flops_from_checkpoint(ckpt) == pytest.approx(flops)
    export = export_backbone(path, tmp_path / "exp").out_dir
    for spec in (path, export):
        _, info = load_any_backbone(spec)
        pretrain = info["pretrain"]
        assert pretrain["steps"] == ckpt["global_step"] == 3
        assert pretrain["epochs"] == 1.5  # 3 steps of a 2-batch epoch (not Lightning's epoch index)
        assert pretrain["flops"] == pytest.approx(flops)
        assert pretrain["checkpoint"] == str(path.resolve())


def test_the_flops_of_a_checkpoint_without_its_ssl_vit_record_are_read_from_lightnings_top_level(supervised_ckpt, tmp_path):
    # PretrainFlopsCounter writes the count at the checkpoint's top level as well as in its record:
    # a checkpoint whose record was stripped (another tool re-saved it) keeps its x-axis value.
    path, flops = supervised_ckpt
    ckpt = torch.load(path, weights_only=False)
    ckpt.pop("ssl_vit")
    ckpt["pretrain_flops"] = flops
    torch.save(ckpt, tmp_path / "bare.ckpt")
    _, info = load_any_backbone(tmp_path / "bare.ckpt", backbone="vit", backbone_kwargs=ckpt["hyper_parameters"]["backbone_kwargs"])
    assert info["pretrain"]["flops"] == pytest.approx(flops) and info["pretrain"]["steps"] == 3
