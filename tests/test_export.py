"""Export of checkpoints that a real Lightning Trainer wrote: the encoder each method exports and
loads back, the weights and config.json against timm's and torchvision's own models (strict loads,
equal outputs, timm's entry points and pretrained configs), the run info carried along, the traced
copies against the eager model, and ``ssl-vit export``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning as L
import pytest
import timm
import torch
import torchvision
from helpers import SMALL_HEADS, TINY_BACKBONE, TINY_VIT, RepeatBatch, fixed_views
from safetensors import safe_open
from safetensors.torch import load_file
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch.utils.data import DataLoader

from ssl_vit import cli, create_backbone
from ssl_vit.eval.results import EvalResult
from ssl_vit.export import (
    chosen_encoder,
    export_backbone,
    load_any_backbone,
    load_backbone,
    save_backbone,
)
from ssl_vit.export.save import TIMM_VIT_SIZES, timm_architecture
from ssl_vit.methods import DINO, MPP, MoCoV3, Supervised
from ssl_vit.training.callbacks import PretrainFlopsCounter

COMMON = {"num_classes": 4, "warmup_epochs": 0.0, "base_lr": 0.5, "weight_decay": 0.0}
GEOMETRY = {"img_size": 16, "patch_size": 4, "in_chans": 1}


def _fit_and_save(model: L.LightningModule, views, labels, steps: int, path: Path, callbacks=()) -> Path:
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=list(callbacks))
    trainer.fit(model, DataLoader(RepeatBatch(views, labels, steps), batch_size=None))
    path.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(path)
    return path


def _encoder(ckpt, prefix: str) -> dict[str, torch.Tensor]:
    """The reference: the checkpoint's weights under ``prefix``, stripped by hand."""
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _reference(ckpt, prefix: str, name: str = "vit", kwargs: dict | None = None) -> torch.nn.Module:
    model = create_backbone(name, **(kwargs or TINY_VIT))
    model.load_state_dict(_encoder(ckpt, prefix), strict=True)
    return model.eval()


def _x(c: int = 1, s: int = 16, b: int = 3) -> torch.Tensor:
    return torch.randn(b, c, s, s, generator=torch.Generator().manual_seed(7))


def _config(out) -> dict:
    return json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def dino_ckpt(tmp_path_factory) -> str:
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("dino_run")
    model = DINO(**SMALL_HEADS["dino"], **TINY_BACKBONE, **COMMON)
    # what `ssl-vit fit` records from its datamodule and recipe
    model.data_info = {"name": "FakeData", "mean": [0.3], "std": [0.2], "img_size": 16, "in_chans": 1, "num_classes": 4}
    model.recipe = "model:\n  class_path: ssl_vit.methods.DINO\n"
    path = _fit_and_save(model, *fixed_views([16, 16, 8], batch=8), steps=2, path=run / "checkpoints" / "last.ckpt")
    ckpt = torch.load(path, weights_only=False)
    ckpt["ssl_vit"]["wall_time_s"] = 12.5  # a field later versions add: must travel along
    torch.save(ckpt, path)
    EvalResult(method="dino", backbone={"name": "vit"}, data={"name": "FakeData"}, protocol="knn", metrics={"top1": 0.61}).to_json(run / "eval" / "knn.json")
    return str(path)


@pytest.fixture(scope="module")
def moco_ckpt(tmp_path_factory) -> str:
    torch.manual_seed(1)
    model = MoCoV3(**SMALL_HEADS["mocov3"], **TINY_BACKBONE, **COMMON)
    return str(_fit_and_save(model, *fixed_views([16, 16], batch=8), steps=2, path=tmp_path_factory.mktemp("moco") / "moco.ckpt"))


@pytest.fixture(scope="module")
def mpp_ckpt(tmp_path_factory) -> str:
    torch.manual_seed(2)
    views, labels = fixed_views([16], batch=8)
    model = MPP(**SMALL_HEADS["mpp"], **TINY_BACKBONE, **COMMON)
    return str(_fit_and_save(model, [v.clamp(-1, 1) for v in views], labels, steps=1, path=tmp_path_factory.mktemp("mpp") / "mpp.ckpt"))


@pytest.fixture(scope="module")
def supervised_ckpt(tmp_path_factory) -> tuple[Path, float]:
    """3 steps of 2-batch epochs with `ssl-vit fit`'s FLOP counter: (path, FLOPs it counted)."""
    torch.manual_seed(0)
    counter = PretrainFlopsCounter()
    model = Supervised(**TINY_BACKBONE, num_classes=4, warmup_epochs=0.0, base_lr=0.1, weight_decay=0.0)
    views, labels = fixed_views([16], batch=4)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[counter])
    trainer.fit(model, DataLoader(RepeatBatch(views, labels, 2), batch_size=None))
    path = tmp_path_factory.mktemp("sup") / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(path)
    return path, counter.total


# ------------------------------------------------------------------------ each method's encoder


def test_dino_exports_the_teacher_in_timm_layout(dino_ckpt, tmp_path):
    out = export_backbone(dino_ckpt, tmp_path / "exp").out_dir
    weights = load_file(out / "model.safetensors")
    teacher, student = _encoder(dino_ckpt, "teacher_backbone."), _encoder(dino_ckpt, "backbone.")
    assert weights.keys() == teacher.keys() and all(torch.equal(weights[k], teacher[k]) for k in teacher)
    assert any(not torch.equal(teacher[k], student[k]) for k in teacher), "teacher == student: the test cannot tell them apart"
    ref, x = _reference(dino_ckpt, "teacher_backbone."), _x()
    timm_vit = TimmViT(**TINY_VIT, num_classes=0).eval()  # our tiny ViT's arguments are timm's names for that shape
    timm_vit.load_state_dict(weights, strict=True)
    torch.testing.assert_close(timm_vit(x), ref(x))
    torch.testing.assert_close(timm.create_model(f"local-dir:{out}", pretrained=True).eval()(x), ref(x))  # timm's HF layout

    cfg = _config(out)
    info = cfg["ssl_vit"]
    assert (info["method"], info["which"], info["backbone"]) == ("dino", "teacher", "vit")
    assert cfg["mean"] == cfg["pretrained_cfg"]["mean"] == [0.3] and cfg["std"] == [0.2]
    assert cfg["input_size"] == [1, 16, 16] and cfg["num_classes"] == 0
    assert info["recipe"].startswith("model:") and info["training"]["wall_time_s"] == 12.5 and info["training"]["global_step"] == 2
    assert [r["metrics"]["top1"] for r in info["results"]] == [0.61]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:  # the metadata Hugging Face loaders expect
        assert f.metadata() == {"format": "pt"}

    student_out = export_backbone(dino_ckpt, tmp_path / "student", which="student").out_dir
    assert all(torch.equal(load_file(student_out / "model.safetensors")[k], v) for k, v in student.items())
    assert _config(student_out)["ssl_vit"]["which"] == "student"


def test_a_subclass_of_dino_is_evaluated_by_its_teacher_too(dino_ckpt, tmp_path):
    # The default encoder is the method's own (recorded), not looked up by the class's name.
    ckpt = torch.load(dino_ckpt, weights_only=False)
    assert ckpt["ssl_vit"]["default_encoder"] == "teacher"
    ckpt["ssl_vit"]["method"] = "MyDINO"  # what `class MyDINO(DINO)` writes
    torch.save(ckpt, tmp_path / "mine.ckpt")
    _, info = load_any_backbone(tmp_path / "mine.ckpt")
    assert (info["method"], info["which"]) == ("mydino", "teacher") and chosen_encoder(info) is None
    assert info["source"] == str((tmp_path / "mine.ckpt").resolve())  # absolute, however it was typed
    _, info = load_any_backbone(export_backbone(tmp_path / "mine.ckpt", tmp_path / "exp").out_dir)
    assert info["which"] == "teacher" and chosen_encoder(info) is None
    assert chosen_encoder(load_any_backbone(tmp_path / "mine.ckpt", which="student")[1]) == "student"
    assert chosen_encoder({"method": "mocov3", "which": "momentum"}) == "momentum" and chosen_encoder({"method": "mocov3", "which": "student"}) is None


def test_an_encoder_of_a_method_of_ones_own_is_named_by_its_attribute(dino_ckpt, tmp_path):
    # A BYOL-like method keeps its EMA target as `target_backbone`: `--which target` takes it.
    ckpt = torch.load(dino_ckpt, weights_only=False)
    ckpt["state_dict"] = {k.replace("teacher_backbone.", "target_backbone."): v for k, v in ckpt["state_dict"].items()}
    ckpt["ssl_vit"].update(method="BYOL", default_encoder="student")
    torch.save(ckpt, tmp_path / "byol.ckpt")
    target, info = load_any_backbone(tmp_path / "byol.ckpt", which="target")
    teacher = _encoder(dino_ckpt, "teacher_backbone.")
    assert info["which"] == "target" and all(torch.equal(target.state_dict()[k], v) for k, v in teacher.items())
    assert load_any_backbone(tmp_path / "byol.ckpt")[1]["which"] == "student"
    with pytest.raises(ValueError, match="has no nope backbone .nope_backbone.. weights.; it holds: student, target"):
        load_any_backbone(tmp_path / "byol.ckpt", which="nope")
    with pytest.raises(ValueError, match="which must be one of student, teacher, momentum or the NAME"):
        load_any_backbone(tmp_path / "byol.ckpt", which="Bad Name")
    out = export_backbone(tmp_path / "byol.ckpt", tmp_path / "exp", which="target").out_dir
    assert _config(out)["ssl_vit"]["which"] == "target"
    # the same from a bare state dict: the NAME_backbone weights, or an error
    torch.save(ckpt["state_dict"], tmp_path / "bare.pt")
    bare, _ = load_any_backbone(tmp_path / "bare.pt", which="target", backbone="vit", backbone_kwargs=TINY_VIT)
    assert all(torch.equal(bare.state_dict()[k], v) for k, v in teacher.items())
    with pytest.raises(ValueError, match=r"which='nope' but the state dict has no nope_backbone\.\* weights"):
        load_any_backbone(tmp_path / "bare.pt", which="nope", backbone="vit", backbone_kwargs=TINY_VIT)


@pytest.mark.parametrize(("fixture", "which", "prefix", "other"), [
    ("moco_ckpt", None, "backbone.", "momentum_backbone."),
    ("moco_ckpt", "momentum", "momentum_backbone.", "backbone."),
    ("mpp_ckpt", None, "backbone.", None),
])
def test_load_backbone_round_trips(fixture, which, prefix, other, request, tmp_path):
    ckpt = request.getfixturevalue(fixture)
    ref, x = _reference(ckpt, prefix), _x()
    if other is not None:  # the two encoders must differ, or the test could not tell them apart
        assert not torch.equal(ref(x), _reference(ckpt, other)(x))
    out = export_backbone(ckpt, tmp_path / "exp", which=which).out_dir
    from_dir = load_backbone(out)
    assert not from_dir.training
    torch.testing.assert_close(load_backbone(ckpt, which=which)(x), ref(x), rtol=0, atol=0)
    torch.testing.assert_close(from_dir(x), ref(x), rtol=0, atol=0)
    _, info = load_any_backbone(out)
    assert info["method"] == ("mocov3" if "moco" in fixture else "mpp")
    if fixture == "mpp_ckpt":  # no datamodule: MPP's own mean/std arguments are the normalisation
        assert info["mean"] == [0.5] and "MPP" in info["normalization_source"]


def test_another_resolution_resamples_the_position_embedding(dino_ckpt):
    model = load_backbone(dino_ckpt, backbone_kwargs={"img_size": 24})
    expected = resample_abs_pos_embed(_encoder(dino_ckpt, "teacher_backbone.")["pos_embed"], new_size=(6, 6), old_size=(4, 4), num_prefix_tokens=1)
    torch.testing.assert_close(model.pos_embed.detach(), expected)


def test_a_checkpoint_and_its_exports_are_one_pretraining(dino_ckpt, tmp_path):
    out = export_backbone(dino_ckpt, tmp_path / "exp").out_dir
    records = []
    for spec in (dino_ckpt, out, export_backbone(out, tmp_path / "exp2").out_dir):  # an export of the export too
        _, info = load_any_backbone(spec)
        assert info["pretrain"]["checkpoint"] == str(Path(dino_ckpt).resolve())
        records.append(EvalResult("dino", {"name": "vit"}, {"name": "fashion_mnist"}, "knn", {"top1": 0.5}, pretrain=info["pretrain"], source=info["source"]))
    assert len({r.pretraining for r in records}) == 1


def test_the_run_info_gives_steps_epochs_and_flops_also_without_its_record(supervised_ckpt, tmp_path):
    # Reference: Lightning's own checkpoint fields (global_step) and the FLOPs PretrainFlopsCounter
    # counted; a checkpoint whose run info was stripped (another tool re-saved it) keeps the count
    # the callback writes at its top level.
    path, flops = supervised_ckpt
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["global_step"] == 3 and flops > 0 and ckpt["pretrain_flops"] == pytest.approx(flops)
    for spec in (path, export_backbone(path, tmp_path / "exp").out_dir):
        pretrain = load_any_backbone(spec)[1]["pretrain"]
        assert (pretrain["steps"], pretrain["epochs"]) == (3, 1.5)  # 3 steps of a 2-batch epoch, not Lightning's epoch index
        assert pretrain["flops"] == pytest.approx(flops) and pretrain["checkpoint"] == str(path.resolve())
    ckpt.pop("ssl_vit")
    torch.save(ckpt, tmp_path / "bare.ckpt")
    _, info = load_any_backbone(tmp_path / "bare.ckpt", backbone="vit", backbone_kwargs=ckpt["hyper_parameters"]["backbone_kwargs"])
    assert info["pretrain"]["flops"] == pytest.approx(flops) and info["pretrain"]["steps"] == 3


def test_a_resnet_export_loads_into_torchvision(tmp_path):
    torch.manual_seed(3)
    kwargs = {"in_chans": 3, "img_size": 16}
    ckpt = _fit_and_save(Supervised(backbone="resnet18", backbone_kwargs=kwargs, **COMMON), *fixed_views([16], batch=4, chans=3), steps=1,
                         path=tmp_path / "sup.ckpt")
    out = export_backbone(ckpt, tmp_path / "exp").out_dir
    tv = torchvision.models.resnet18()
    result = tv.load_state_dict(load_file(out / "model.safetensors"), strict=False)
    assert sorted(result.missing_keys) == ["fc.bias", "fc.weight"] and not result.unexpected_keys
    tv.fc = torch.nn.Identity()
    torch.testing.assert_close(tv.eval()(_x(3)), _reference(ckpt, "backbone.", "resnet18", kwargs)(_x(3)))
    assert _config(out)["ssl_vit"]["weights_format"] == "torchvision"


# ------------------------------------------------------------------------ timm's names and config.json


@pytest.mark.parametrize("size", sorted(set(TIMM_VIT_SIZES.values())))
def test_each_vit_size_is_named_after_the_timm_model_of_its_shape(size):
    # Reference: timm's entry point of that name has our width, depth, heads and MLP (ViT paper Table 1, DeiT-Ti).
    with torch.device("meta"):
        ours = create_backbone(f"vit_{size}")
        name, args = timm_architecture(ours)
        ref = timm.create_model(name, pretrained=False, num_classes=0)
    assert name.startswith(f"vit_{size}_patch") and (args["embed_dim"], args["depth"], args["num_heads"]) == (ours.embed_dim, ours.depth, ours.num_heads)
    assert (ref.embed_dim, len(ref.blocks), ref.blocks[0].attn.num_heads, ref.blocks[0].mlp.fc1.out_features) == (
        ours.embed_dim, ours.depth, ours.num_heads, ours.blocks[0].mlp.fc1.out_features)


_PLAIN_VITS = sorted((m[1], int(m[2]), int(m[3])) for n in timm.list_models("vit_*")
                     if (m := re.fullmatch(r"vit_(\w+?)_patch(\d+)_(\d+)", n)) and m[1] in TIMM_VIT_SIZES.values())


@pytest.mark.parametrize("size, patch, img", _PLAIN_VITS)
def test_each_plain_vit_entry_point_of_timm_names_exactly_our_model_of_that_shape(size, patch, img):
    # Reference: timm's registry; each vit_<size>_patch<P>_<S> builds, without overrides, a model
    # whose every parameter has the shape of ours, and an export of ours names it.
    with torch.device("meta"):
        ours = create_backbone(f"vit_{size}", patch_size=patch, img_size=img)
        ref = timm.create_model(f"vit_{size}_patch{patch}_{img}", pretrained=False, num_classes=0)
    assert timm_architecture(ours)[0] == f"vit_{size}_patch{patch}_{img}"
    assert {k: v.shape for k, v in ref.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}


@pytest.mark.parametrize("size, patch, img, named", [("huge", 16, 224, "vit_huge_patch14_224"), ("tiny", 8, 224, "vit_tiny_patch16_224"),
                                                      ("small", 16, 96, "vit_small_patch16_224"), ("base", 16, (224, 160), "vit_base_patch16_224")])
def test_a_shape_timm_has_no_entry_point_for_takes_its_sizes_first_with_its_own_arguments(size, patch, img, named):
    # timm registers no ViT-H/16, ViT-Ti/8, 96-px ViT-S/16 or 224x160 ViT-B/16: the name falls back
    # to the size's entry point and model_args carry the shape, from which timm builds ours.
    assert len(_PLAIN_VITS) >= 15 and not timm.is_model(f"vit_{size}_patch{patch}_{img}")
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
    args = cfg["model_args"]
    assert cfg["architecture"] == "vit_tiny_patch16_224" and (args["img_size"], args["patch_size"], args["in_chans"]) == ([16, 16], 4, 1)
    assert (args["embed_dim"], args["depth"], args["num_heads"]) == (192, 12, 3)
    with torch.device("meta"):  # (every tensor is replaced below)
        ref = timm.create_model(cfg["architecture"], pretrained=False, num_classes=0, **GEOMETRY).eval()
    ref.load_state_dict(load_file(out / "model.safetensors"), strict=True, assign=True)
    model, info = load_any_backbone(out)
    torch.testing.assert_close(ref(_x()), model(_x()))
    assert info["method"] == "random" and info["name"] == "vit_tiny"


@pytest.mark.parametrize("kwargs", [
    {},  # another shape: vit_base_patch16_224 with overrides
    {"global_pool": "avg"},  # ours pools after the final norm: model_args say fc_norm=False
    {"embed_dim": 176, "mlp_ratio": 8 / 3},  # a 469-wide MLP: 469 / 176 as timm's mlp_ratio would build 468
    {"qkv_bias": False},
    {"img_size": [16, 24]},
], ids=["base_fallback", "avg_pool", "mlp_rounding", "no_qkv_bias", "non_square"])
def test_config_json_rebuilds_the_vit_in_timm_by_name_and_from_its_folder(kwargs, tmp_path):
    # Reference: timm.create_model(architecture, **model_args) loads model.safetensors strictly, and
    # timm.create_model("local-dir:DIR", pretrained=True) builds it whole; both compute our features.
    kwargs = {**TINY_VIT, "depth": 1, **kwargs}
    out = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=kwargs).out_dir
    cfg, weights = _config(out), load_file(out / "model.safetensors")
    model, _ = load_any_backbone(out)
    named = timm.create_model(cfg["architecture"], pretrained=False, num_classes=0, **cfg["model_args"]).eval()
    named.load_state_dict(weights, strict=True)
    x = torch.randn(3, 1, *model.img_size, generator=torch.Generator().manual_seed(7))
    for ref in (named, timm.create_model(f"local-dir:{out}", pretrained=True).eval()):
        torch.testing.assert_close(ref(x), model(x))
    assert cfg["architecture"] == "vit_base_patch16_224" and cfg["input_size"] == cfg["pretrained_cfg"]["input_size"] == [1, *model.img_size]
    if "mlp_ratio" in kwargs:
        assert named.blocks[0].mlp.fc1.out_features == model.blocks[0].mlp.fc1.out_features == 469


def test_pretrained_cfg_says_what_timm_says_and_lets_timm_adapt_the_channels(tmp_path):
    # Reference: timm's pretrained config of the same model (first_conv "patch_embed.proj", classifier
    # "head", fixed_input_size); timm's loader uses first_conv to adapt RGB weights to a grey model
    # (adapt_input_conv sums the filters): the grey model on x == the RGB model on x repeated.
    out = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs={**TINY_VIT, "in_chans": 3}).out_dir
    cfg = _config(out)
    pc, timm_cfg = cfg["pretrained_cfg"], timm.models.get_pretrained_cfg("vit_tiny_patch16_224")
    assert (pc["first_conv"], pc["classifier"], pc["fixed_input_size"]) == (timm_cfg.first_conv, timm_cfg.classifier, True)
    assert cfg["num_features"] == TINY_VIT["embed_dim"] and cfg["model_args"]["class_token"] is True and cfg["global_pool"] == "token"
    assert "patch_embed.proj.weight" in load_file(out / "model.safetensors")
    timm_grey = timm.create_model(f"local-dir:{out}", pretrained=True, in_chans=1).eval()
    rgb, _ = load_any_backbone(out)
    torch.testing.assert_close(timm_grey(_x()), rgb(_x().repeat(1, 3, 1, 1)), atol=1e-5, rtol=1e-5)


def test_a_grey_resnet_export_is_rebuilt_by_timm_with_its_channels_and_pretrained_cfg(tmp_path):
    # Reference: timm.create_model("local-dir:DIR", pretrained=True) builds resnet18 with the recorded
    # in_chans and computes our pooled features; pretrained_cfg's fields are timm's own for resnet18.
    torch.manual_seed(0)
    net = create_backbone("resnet18", in_chans=1, img_size=32).eval()
    cfg = _config(save_backbone(net, tmp_path / "exp").out_dir)
    assert cfg["architecture"] == "resnet18" and cfg["model_args"] == {"in_chans": 1}
    ref = timm.create_model(f"local-dir:{tmp_path / 'exp'}", pretrained=True, num_classes=0).eval()
    with torch.no_grad():
        torch.testing.assert_close(ref(_x(1, 32, 2)), net(_x(1, 32, 2)))
    pc, timm_cfg = cfg["pretrained_cfg"], timm.models.get_pretrained_cfg("resnet18")
    assert (pc["first_conv"], pc["classifier"], pc["fixed_input_size"]) == (timm_cfg.first_conv, timm_cfg.classifier, timm_cfg.fixed_input_size)
    assert cfg["num_features"] == ref.num_features == 512 and cfg["global_pool"] == "avg"


@pytest.mark.parametrize("kwargs", [{"small_input": True}, {"num_stages": 3}, {"layers": [1, 1, 1, 1]}], ids=["cifar_stem", "three_stages", "other_depths"])
def test_a_resnet_timm_cannot_build_names_no_timm_architecture(kwargs, tmp_path):
    # Reference: timm's resnet18 does not take these weights (3x3 stem, no layer4, other depths).
    torch.manual_seed(0)
    out = save_backbone(create_backbone("resnet18", in_chans=3, img_size=32, **kwargs).eval(), tmp_path / "exp").out_dir
    with pytest.raises(RuntimeError):
        timm.create_model("resnet18", pretrained=False, num_classes=0).load_state_dict(load_file(out / "model.safetensors"), strict=True)
    assert "architecture" not in _config(out) and "model_args" not in _config(out)


def test_a_hybrid_and_a_vit_subclass_claim_no_timm_architecture_and_round_trip(tmp_path):
    # The hybrid's layout (patch_embed.backbone.*) and a registered ViT subclass's own layer (a
    # learned-query pooling, which timm's ViT of the same arguments would drop) are ours: no timm
    # architecture, no first_conv; load_backbone rebuilds them, the subclass's non-persistent buffer too.
    from helpers import registered_backbones

    from ssl_vit.backbones import VisionTransformer

    cfg = export_backbone("random:hybrid_r18_vit_tiny", tmp_path / "hyb", backbone_kwargs={"img_size": 16, "in_chans": 1, "small_input": True,
                                                                                           "num_stages": 3}).config
    assert cfg["ssl_vit"]["weights_format"] == "ssl_vit" and "architecture" not in cfg and "first_conv" not in cfg["pretrained_cfg"]
    assert cfg["pretrained_cfg"]["classifier"] == "head"

    class PooledViT(VisionTransformer):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.pool_proj = torch.nn.Linear(self.embed_dim, self.embed_dim)
            self.register_buffer("shift", torch.linspace(0, 1, self.embed_dim), persistent=False)

        def forward(self, x):
            return self.pool_proj(self.forward_features(x)[:, 1:].mean(1)) + self.shift

    def pooled_vit(img_size: int = 16, patch_size: int = 4, in_chans: int = 1) -> PooledViT:
        return PooledViT(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=32, depth=1, num_heads=2)

    with registered_backbones(pooled_vit_test=pooled_vit):
        torch.manual_seed(0)
        model = create_backbone("pooled_vit_test").eval()
        torch.save(model.state_dict(), tmp_path / "weights.pt")
        out = export_backbone(tmp_path / "weights.pt", tmp_path / "exp", backbone="pooled_vit_test").out_dir
        assert "architecture" not in _config(out) and _config(out)["ssl_vit"]["weights_format"] == "ssl_vit"
        torch.testing.assert_close(load_backbone(out)(_x()), model(_x()), rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_a_classifier_exports_under_timms_and_torchvisions_names(bias, tmp_path):
    # Reference: timm builds the ViT with its classifier from the folder (head.*), torchvision's
    # resnet18(num_classes=K) loads the ResNet's strictly (fc.*): both give head(backbone(x)); a
    # head without a bias is that classifier at bias 0; the backbone loaders leave it out.
    torch.manual_seed(0)
    vit, net = create_backbone("vit", **TINY_VIT).eval(), create_backbone("resnet18", in_chans=3, img_size=16).eval()
    vit_head, net_head = torch.nn.Linear(32, 5, bias=bias), torch.nn.Linear(512, 4, bias=bias)
    cfg = save_backbone(vit, tmp_path / "vit", head=vit_head).config
    save_backbone(net, tmp_path / "net", head=net_head)
    tv = torchvision.models.resnet18(num_classes=4).eval()
    tv.load_state_dict(load_file(tmp_path / "net" / "model.safetensors"), strict=True)
    x, x3 = _x(), _x(3)
    with torch.no_grad():
        torch.testing.assert_close(timm.create_model(f"local-dir:{tmp_path / 'vit'}", pretrained=True).eval()(x), vit_head(vit(x)))
        torch.testing.assert_close(tv(x3), net_head(net(x3)))
        torch.testing.assert_close(load_backbone(tmp_path / "net")(x3), net(x3))
    assert cfg["num_classes"] == cfg["pretrained_cfg"]["num_classes"] == 5
    # a head of another width is refused before the earlier export is touched
    with pytest.raises(ValueError, match="the head takes 33 features; the backbone gives 32"):
        save_backbone(vit, tmp_path / "vit", head=torch.nn.Linear(33, 5))
    assert load_backbone(tmp_path / "vit") is not None


@pytest.mark.parametrize(("in_chans", "mean", "std"), [(3, list(IMAGENET_DEFAULT_MEAN), list(IMAGENET_DEFAULT_STD)), (1, [0.5], [0.5]),
                                                       (4, [0.5] * 4, [0.5] * 4)])
def test_default_normalisation_is_timms_imagenet_statistics_for_rgb_and_half_otherwise(in_chans, mean, std, tmp_path):
    cfg = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs={**TINY_VIT, "in_chans": in_chans}).config
    assert cfg["mean"] == cfg["pretrained_cfg"]["mean"] == pytest.approx(mean) and cfg["std"] == pytest.approx(std)
    assert cfg["input_size"] == [in_chans, 16, 16]
    from ssl_vit.export.load import resolve_normalization  # a record without its std is no record

    assert resolve_normalization({"mean": [0.1], "std": None}, in_chans)["mean"] == pytest.approx(mean)


def test_grey_statistics_are_repeated_for_a_three_channel_model(tmp_path):
    # Hand-written expectation: a grey model's recorded mean 0.3 / std 0.2, loaded or exported as a
    # 3-channel model, become [0.3] * 3 / [0.2] * 3 (every channel holds the grey image); the adapted
    # model on the grey image repeated and so normalised gives the grey model's features.
    from ssl_vit.export import BackboneSource

    torch.manual_seed(0)
    grey = create_backbone("vit", **TINY_VIT).eval()
    source = BackboneSource({}, "vit", dict(TINY_VIT), "memory", "memory", normalization={"mean": [0.3], "std": [0.2], "source": "training data (FakeData)"})
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


def test_a_backbone_moved_to_another_size_exports_at_that_size(tmp_path):
    torch.manual_seed(0)
    model = create_backbone("vit", **TINY_VIT)
    model.set_img_size(24)  # fine-tuning at a higher resolution
    out = save_backbone(model, tmp_path / "exp").out_dir
    assert _config(out)["input_size"] == [1, 24, 24]
    x = torch.randn(2, 1, 24, 24)
    torch.testing.assert_close(load_any_backbone(out)[0](x), model.eval()(x))


# ------------------------------------------------------------------------ traced copies


def test_torchscript_export_and_onnx_match_eager_at_another_batch_size(dino_ckpt, tmp_path):
    import onnxruntime as ort

    result = export_backbone(dino_ckpt, tmp_path / "exp", formats=["torchscript", "export", "onnx"])
    out, ref, x = result.out_dir, _reference(dino_ckpt, "teacher_backbone."), _x(b=5)  # not the traced batch size
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    scripted = torch.jit.load(str(out / "model.torchscript.pt"))
    with torch.no_grad():
        for got in (scripted(x), torch.export.load(str(out / "model.pt2")).module()(x), torch.from_numpy(session.run(None, {"images": x.numpy()})[0])):
            torch.testing.assert_close(got, ref(x), atol=1e-5, rtol=0)
        # the traced copy checks the size it was traced at (a trace would crop a larger image)
        with pytest.raises(torch.jit.Error, match=r"takes images \[batch, 1, 16, 16\] \(traced at that size\), got \[2, 1, 20, 20\]"):
            scripted(torch.randn(2, 1, 20, 20))
    files = _config(out)["ssl_vit"]["files"]
    assert files["model.onnx"]["max_abs_diff"] < 1e-4 and files["model.pt2"]["max_abs_diff"] < 1e-4 and "sha256" in files["model.torchscript.pt"]
    # a small model's ONNX file holds its weights (no model.onnx.data beside it)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.onnx", "model.pt2", "model.safetensors", "model.torchscript.pt"]


def test_hybrid_exports_reloads_and_traces(tmp_path):
    # The hybrid (ResNet stem -> ViT) through the formats: safetensors + config.json rebuild it,
    # TorchScript and ONNX compute what the eager model computes.
    import onnxruntime as ort

    kwargs = {"resnet": "resnet18", "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 3}
    out, x = export_backbone("random:hybrid", tmp_path / "exp", backbone_kwargs=kwargs, formats=["torchscript", "onnx"]).out_dir, _x(b=2)
    eager, info = load_any_backbone(out)
    assert info["name"] == "hybrid" and eager.grid_size == (4, 4) and len(eager.blocks) == 2
    rebuilt = create_backbone("hybrid", **kwargs).eval()
    rebuilt.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ref = eager(x)
        torch.testing.assert_close(rebuilt(x), ref, atol=0, rtol=0)
        torch.testing.assert_close(torch.jit.load(str(out / "model.torchscript.pt"))(x), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.from_numpy(session.run(None, {"images": x.numpy()})[0]), ref, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------ ssl-vit export


def test_cli_end_to_end(dino_ckpt, tmp_path, capsys):
    extra = tmp_path / "linear.json"
    extra.write_text(json.dumps({"metrics": {"top1": 0.42}, "note": "any JSON with metrics"}))
    out = tmp_path / "exp"
    assert cli.main(["export", dino_ckpt, "--out", str(out), "--which", "student", "--format", "torchscript", "--results", str(extra)]) == 0
    assert "dino student backbone vit" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "model.torchscript.pt"}
    # the run's result (0.61) is of DINO's default encoder, the teacher: not this export's
    assert sorted(r["metrics"]["top1"] for r in _config(out)["ssl_vit"]["results"]) == [0.42]
    torch.testing.assert_close(load_backbone(out)(_x()), _reference(dino_ckpt, "backbone.")(_x()), rtol=0, atol=0)

    assert cli.main(["export", str(tmp_path / "nope.ckpt"), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ssl-vit export: error: ") and "nope.ckpt" in err and "\n" not in err
    # exporting into the folder again says what it replaces
    assert cli.main(["export", dino_ckpt, "--out", str(out)]) == 0
    assert f"note: replaced the export in {out} (dino vit from {dino_ckpt})" in capsys.readouterr().err
    # `--backbone FILE`, as `ssl-vit eval` takes it, is named as the first argument here
    assert cli.main(["export", "--backbone", dino_ckpt, "--out", str(out)]) == 1
    assert "ssl-vit export takes the backbone's file as its first argument" in capsys.readouterr().err


@pytest.mark.parametrize(("fixture", "which", "said"), [("mpp_ckpt", None, "the mpp backbone vit"), ("moco_ckpt", None, "the mocov3 backbone vit"),
                                                         ("moco_ckpt", "momentum", "the mocov3 momentum backbone vit")])
def test_the_cli_names_the_encoder_only_where_there_is_a_choice(request, tmp_path, capsys, fixture, which, said):
    # MPP has no "student": its one online backbone goes unnamed, as MoCo v3's default base encoder
    args = ["export", str(request.getfixturevalue(fixture)), "--out", str(tmp_path / "exp")] + (["--which", which] if which else [])
    assert cli.main(args) == 0
    assert f"exported {said} (" in capsys.readouterr().out


def test_the_cli_says_when_timm_cannot_build_the_export(tmp_path, capsys):
    kwargs = {"resnet": "resnet18", "embed_dim": 32, "depth": 1, "num_heads": 2, "img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 3}
    assert cli.main(["export", "random:hybrid", "--backbone-kwargs", json.dumps(kwargs), "--out", str(tmp_path / "hyb")]) == 0
    assert "note: timm has no architecture for hybrid: load this export with ssl_vit.load_backbone" in capsys.readouterr().out
    assert cli.main(["export", "random:vit_tiny", "--backbone-kwargs", '{"img_size": 16, "patch_size": 8}', "--out", str(tmp_path / "vit")]) == 0
    assert "timm has no architecture" not in capsys.readouterr().out


def test_the_cli_exports_a_bare_state_dict_named_with_arch_and_checks_its_kwargs(tmp_path, capsys):
    # The option the error message names (--arch, as in eval and visualize) is accepted here too.
    from ssl_vit.cli.export import _earlier_export, build_parser

    torch.manual_seed(0)
    vit = create_backbone("vit", **TINY_VIT).eval()
    torch.save(vit.state_dict(), tmp_path / "bare.pth")
    assert cli.main(["export", str(tmp_path / "bare.pth"), "--out", str(tmp_path / "a")]) == 1
    assert "--arch NAME --backbone-kwargs JSON" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "bare.pth"), "--out", str(tmp_path / "a"), "--arch", "vit", "--backbone-kwargs", json.dumps(TINY_VIT)]) == 0
    torch.testing.assert_close(load_backbone(tmp_path / "a")(_x()), vit(_x()), rtol=0, atol=0)
    for bad, said in (("[4]", "expected a JSON object"), ("{bad", "not a JSON object")):
        with pytest.raises(SystemExit) as stop:
            cli.main(["export", str(tmp_path / "bare.pth"), "--out", str(tmp_path / "o"), "--arch", "vit", "--backbone-kwargs", bad])
        assert stop.value.code == 2 and said in capsys.readouterr().err
    assert build_parser().parse_args(["x", "--out", "y"]).tolerance == 1e-4
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"ssl_vit": None}))  # a config.json of something else
    assert _earlier_export(str(tmp_path / "other")) is None


@pytest.mark.parametrize("mode, sizes, img_size, crop_pct", [
    ("L", [(28, 28)], 28, 1.0),  # images already at the model's size: evaluated whole
    ("RGB", [(40, 52), (64, 48)], 32, 0.875),  # photos of any size: short side to 32/0.875, centre crop
])
def test_timm_preprocesses_an_export_of_a_folder_as_ssl_vit_evaluates_it(mode, sizes, img_size, crop_pct, tmp_path):
    # Reference: timm's own resolve_data_config + create_transform on the exported model. The image
    # folder's normalisation is measured on its images, recorded in the checkpoint and config.json
    # with its source, and timm's transform of each file is the tool's evaluation input to the bit.
    from helpers import write_image_folder
    from PIL import Image

    from ssl_vit.data import ImageFolderDataModule
    from ssl_vit.training.checkpoint import StepCheckpoint

    chans = 1 if mode == "L" else 3
    folder = write_image_folder(tmp_path / "train", {"a": 6, "b": 6}, sizes, mode)
    dm = ImageFolderDataModule(str(folder), img_size=img_size, in_chans=chans, batch_size=4, num_workers=0)
    kwargs = {**TINY_VIT, "img_size": img_size, "in_chans": chans}
    model = Supervised(backbone="vit", backbone_kwargs=kwargs, num_classes=2)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path / "run", callbacks=[StepCheckpoint()])
    trainer.fit(model, datamodule=dm)
    assert dm.stats_source == "measured on 12 training images" and dm.eval_crop_pct == crop_pct
    assert json.loads((tmp_path / "run" / "data_stats.json").read_text())["mean"] == list(dm.mean)
    out = export_backbone(str(tmp_path / "run" / "checkpoints" / "last.ckpt"), tmp_path / "exp").out_dir
    cfg = _config(out)
    assert cfg["pretrained_cfg"]["mean"] == list(dm.mean) and cfg["pretrained_cfg"]["crop_pct"] == crop_pct
    assert "measured on 12 training images" in cfg["ssl_vit"]["normalization"]["source"]
    timm_model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config(model=timm_model))
    ours, _ = dm.eval_datasets()
    for i, path in enumerate(sorted(folder.rglob("*.png"))):
        torch.testing.assert_close(transform(Image.open(path)), ours[i][0], atol=1e-6, rtol=0)
