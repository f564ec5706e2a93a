"""Export and loading: timm / torchvision parity of the exported weights, the right encoder of
each method, round trips, TorchScript / ONNX parity, foreign checkpoint layouts, error messages
and the CLI. Checkpoints are written by a real Lightning Trainer after a couple of steps."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import timm
import torch
import torchvision
from helpers import TINY_BACKBONE, TINY_VIT, RepeatBatch, fixed_views
from safetensors.torch import load_file
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch.utils.data import DataLoader

from ssl_vit import cli, create_backbone
from ssl_vit.eval.results import EvalResult
from ssl_vit.export import (
    ExportParityError,
    export_backbone,
    filter_foreign_state_dict,
    load_any_backbone,
    load_backbone,
    save_backbone,
)
from ssl_vit.methods import DINO, MPP, MoCoV3, Supervised

TIMM_TINY = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 2, "num_heads": 2}
COMMON = {"num_classes": 4, "warmup_epochs": 0.0, "base_lr": 0.5, "weight_decay": 0.0}


def _fit_and_save(model: L.LightningModule, views, labels, steps: int, path) -> str:
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(RepeatBatch(views, labels, steps), batch_size=None))
    path.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(path)
    return str(path)


def _encoder(ckpt: str, prefix: str) -> dict[str, torch.Tensor]:
    """The reference: the checkpoint's weights under ``prefix``, stripped by hand."""
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _reference(ckpt: str, prefix: str, name: str = "vit", kwargs: dict | None = None) -> torch.nn.Module:
    model = create_backbone(name, **(kwargs or TINY_VIT))
    model.load_state_dict(_encoder(ckpt, prefix), strict=True)
    return model.eval()


def _x(c: int = 1, s: int = 16, b: int = 3) -> torch.Tensor:
    return torch.randn(b, c, s, s, generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def dino_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("dino_run")
    model = DINO(out_dim=64, hidden_dim=32, bottleneck_dim=16, **TINY_BACKBONE, **COMMON)
    # What `ssl-vit fit` records from its datamodule and recipe.
    model.data_info = {"name": "FakeData", "mean": [0.3], "std": [0.2], "img_size": 16, "in_chans": 1, "num_classes": 4}
    model.recipe = "model:\n  class_path: ssl_vit.methods.DINO\n"
    path = _fit_and_save(model, *fixed_views([16, 16, 8], batch=8), steps=2, path=run / "checkpoints" / "last.ckpt")
    ckpt = torch.load(path, weights_only=False)
    ckpt["ssl_vit"]["pretrain_flops"] = 1.5e12  # a field later versions add: must travel along
    torch.save(ckpt, path)
    EvalResult(method="dino", backbone={"name": "vit"}, data={"name": "FakeData"}, protocol="knn", metrics={"top1": 0.61}).to_json(run / "eval" / "knn.json")
    return path


@pytest.fixture(scope="module")
def moco_ckpt(tmp_path_factory):
    torch.manual_seed(1)
    model = MoCoV3(proj_hidden_dim=32, pred_hidden_dim=32, proj_output_dim=16, **TINY_BACKBONE, **COMMON)
    return _fit_and_save(model, *fixed_views([16, 16], batch=8), steps=2, path=tmp_path_factory.mktemp("moco") / "moco.ckpt")


@pytest.fixture(scope="module")
def mpp_ckpt(tmp_path_factory):
    torch.manual_seed(2)
    model = MPP(mean=[0.5], std=[0.5], **TINY_BACKBONE, **COMMON)
    views, labels = fixed_views([16], batch=8)
    return _fit_and_save(model, [v.clamp(-1, 1) for v in views], labels, steps=1, path=tmp_path_factory.mktemp("mpp") / "mpp.ckpt")


# ------------------------------------------------------------------------ timm / torchvision


def test_dino_exports_the_teacher_in_timm_layout(dino_ckpt, tmp_path):
    out = export_backbone(dino_ckpt, tmp_path / "exp").out_dir
    weights = load_file(out / "model.safetensors")
    teacher, student = _encoder(dino_ckpt, "teacher_backbone."), _encoder(dino_ckpt, "backbone.")
    assert weights.keys() == teacher.keys()
    assert all(torch.equal(weights[k], teacher[k]) for k in teacher)
    assert any(not torch.equal(teacher[k], student[k]) for k in teacher), "teacher == student: the test cannot tell them apart"

    ref = _reference(dino_ckpt, "teacher_backbone.")
    timm_vit = TimmViT(**TIMM_TINY, num_classes=0).eval()
    timm_vit.load_state_dict(weights, strict=True)
    x = _x()
    torch.testing.assert_close(timm_vit(x), ref(x))
    # config.json is timm's Hugging Face layout too
    from_dir = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    torch.testing.assert_close(from_dir(x), ref(x))

    cfg = json.loads((out / "config.json").read_text())
    info = cfg["ssl_vit"]
    assert (info["method"], info["which"], info["backbone"]) == ("dino", "teacher", "vit")
    assert cfg["mean"] == cfg["pretrained_cfg"]["mean"] == [0.3] and cfg["std"] == [0.2]
    assert cfg["input_size"] == [1, 16, 16] and cfg["num_classes"] == 0
    assert info["recipe"].startswith("model:") and info["training"]["pretrain_flops"] == 1.5e12
    assert info["training"]["global_step"] == 2
    assert [r["metrics"]["top1"] for r in info["results"]] == [0.61]


def test_a_subclass_of_dino_is_evaluated_by_its_teacher_too(dino_ckpt, tmp_path):
    # The default encoder is the method's own (recorded), not looked up by the class's name.
    from ssl_vit.eval.results import chosen_encoder

    ckpt = torch.load(dino_ckpt, weights_only=False)
    assert ckpt["ssl_vit"]["default_encoder"] == "teacher"
    ckpt["ssl_vit"]["method"] = "MyDINO"  # what `class MyDINO(DINO)` writes
    torch.save(ckpt, tmp_path / "mine.ckpt")
    _, info = load_any_backbone(tmp_path / "mine.ckpt")
    assert (info["method"], info["which"]) == ("mydino", "teacher") and chosen_encoder(info) is None
    assert info["source"] == str((tmp_path / "mine.ckpt").resolve())  # absolute, however it was typed
    out = export_backbone(tmp_path / "mine.ckpt", tmp_path / "exp").out_dir
    _, info = load_any_backbone(out)
    assert info["which"] == "teacher" and chosen_encoder(info) is None
    _, info = load_any_backbone(tmp_path / "mine.ckpt", which="student")
    assert chosen_encoder(info) == "student"


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
    assert json.loads((out / "config.json").read_text())["ssl_vit"]["which"] == "target"
    # the same from a bare state dict: the NAME_backbone weights, or an error
    torch.save(ckpt["state_dict"], tmp_path / "bare.pt")
    bare, _ = load_any_backbone(tmp_path / "bare.pt", which="target", backbone="vit", backbone_kwargs=TINY_BACKBONE["backbone_kwargs"])
    assert all(torch.equal(bare.state_dict()[k], v) for k, v in teacher.items())
    with pytest.raises(ValueError, match="which='nope' but the state dict has no nope_backbone"):
        load_any_backbone(tmp_path / "bare.pt", which="nope", backbone="vit", backbone_kwargs=TINY_BACKBONE["backbone_kwargs"])


def test_a_checkpoint_and_its_export_are_one_pretraining(dino_ckpt, tmp_path):
    from ssl_vit.eval.results import EvalResult

    out = export_backbone(dino_ckpt, tmp_path / "exp").out_dir
    records = []
    for spec in (dino_ckpt, out, export_backbone(out, tmp_path / "exp2").out_dir):  # an export of the export too
        _, info = load_any_backbone(spec)
        assert info["pretrain"]["checkpoint"] == str(Path(dino_ckpt).resolve())
        records.append(EvalResult("dino", {"name": "vit"}, {"name": "fashion_mnist"}, "knn", {"top1": 0.5}, pretrain=info["pretrain"], source=info["source"]))
    assert len({r.pretraining for r in records}) == 1


def test_dino_student_on_request(dino_ckpt, tmp_path):
    out = export_backbone(dino_ckpt, tmp_path / "exp", which="student").out_dir
    weights, student = load_file(out / "model.safetensors"), _encoder(dino_ckpt, "backbone.")
    assert all(torch.equal(weights[k], student[k]) for k in student)
    assert json.loads((out / "config.json").read_text())["ssl_vit"]["which"] == "student"


def test_named_vit_loads_into_timm_create_model(tmp_path):
    kwargs = {"img_size": 16, "patch_size": 4, "in_chans": 1}
    out = export_backbone("random:vit_tiny", tmp_path / "exp", backbone_kwargs=kwargs).out_dir
    with torch.device("meta"):  # skip timm's random init: every tensor is replaced below
        ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, **kwargs).eval()
    ref.load_state_dict(load_file(out / "model.safetensors"), strict=True, assign=True)
    model, info = load_any_backbone(out)
    x = _x()
    torch.testing.assert_close(ref(x), model(x))
    assert info["method"] == "random" and info["name"] == "vit_tiny"


def test_average_pooled_vit_rebuilds_in_timm_from_config(tmp_path):
    # Ours pools after the final LayerNorm; config.json must tell timm (fc_norm=False) to do the same.
    kwargs = {**TINY_VIT, "global_pool": "avg"}
    out = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=kwargs).out_dir
    model, _ = load_any_backbone("random:vit", backbone_kwargs=kwargs)
    x = _x()
    torch.testing.assert_close(timm.create_model(f"local-dir:{out}", pretrained=True).eval()(x), model(x))


def test_an_mlp_width_that_float_rounding_would_miss_rebuilds_in_timm(tmp_path):
    # 176 x 8/3 -> a 469-wide MLP; 469 / 176 as timm's mlp_ratio gives int(176 * r) = 468.
    kwargs = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 176, "depth": 1, "num_heads": 2, "mlp_ratio": 8 / 3}
    out = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=kwargs).out_dir
    model, _ = load_any_backbone(out)
    assert model.blocks[0].mlp.fc1.out_features == 469
    x = _x()
    torch.testing.assert_close(timm.create_model(f"local-dir:{out}", pretrained=True).eval()(x), model(x))


def test_a_non_square_export_reloads_at_another_size_from_its_own_grid(tmp_path):
    kwargs = {**TINY_VIT, "img_size": [16, 24]}  # a 4 x 6 grid: 1 + 24 positions, not 1 + a square
    out = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=kwargs).out_dir
    stored = load_file(out / "model.safetensors")["pos_embed"]
    model, _ = load_any_backbone(out, backbone_kwargs={"img_size": 32})
    torch.testing.assert_close(model.pos_embed.detach(), resample_abs_pos_embed(stored, (8, 8), (4, 6), num_prefix_tokens=1))


def test_a_backbone_moved_to_another_size_exports_at_that_size(tmp_path):
    torch.manual_seed(0)
    model = create_backbone("vit", **TINY_VIT)
    model.set_img_size(24)  # fine-tuning at a higher resolution
    out = save_backbone(model, tmp_path / "exp").out_dir
    assert json.loads((out / "config.json").read_text())["input_size"] == [1, 24, 24]
    x = torch.randn(2, 1, 24, 24)
    torch.testing.assert_close(load_any_backbone(out)[0](x), model.eval()(x))


def test_a_resnet_classifier_exports_under_torchvision_names(tmp_path):
    # A fine-tuned ResNet's head goes in as torchvision's fc: resnet18(num_classes=K) loads the
    # file strictly and computes the same logits; the backbone loaders leave fc out.
    torch.manual_seed(0)
    net = create_backbone("resnet18", in_chans=3, img_size=16).eval()
    head = torch.nn.Linear(512, 4)
    out = save_backbone(net, tmp_path / "exp", head=head).out_dir
    tv = torchvision.models.resnet18(num_classes=4).eval()
    tv.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(tv(x), head(net(x)))
        torch.testing.assert_close(load_backbone(out)(x), net(x))
    assert json.loads((out / "config.json").read_text())["num_classes"] == 4
    with pytest.raises(ValueError, match="the head takes 384 features; the backbone gives 512"):
        save_backbone(net, tmp_path / "bad", head=torch.nn.Linear(384, 4))


def test_resnet_export_loads_into_torchvision(tmp_path):
    torch.manual_seed(3)
    kwargs = {"in_chans": 3, "img_size": 16}
    model = Supervised(backbone="resnet18", backbone_kwargs=kwargs, **COMMON)
    ckpt = _fit_and_save(model, *fixed_views([16], batch=4, chans=3), steps=1, path=tmp_path / "sup.ckpt")
    out = export_backbone(ckpt, tmp_path / "exp").out_dir
    tv = torchvision.models.resnet18()
    result = tv.load_state_dict(load_file(out / "model.safetensors"), strict=False)
    assert sorted(result.missing_keys) == ["fc.bias", "fc.weight"] and not result.unexpected_keys
    tv.fc = torch.nn.Identity()
    x = _x(3, 16)
    torch.testing.assert_close(tv.eval()(x), _reference(ckpt, "backbone.", "resnet18", kwargs)(x))
    assert json.loads((out / "config.json").read_text())["ssl_vit"]["weights_format"] == "torchvision"


# ------------------------------------------------------------------------ round trips


@pytest.mark.parametrize(
    ("fixture", "which", "prefix", "other"),
    [
        ("moco_ckpt", None, "backbone.", "momentum_backbone."),
        ("moco_ckpt", "momentum", "momentum_backbone.", "backbone."),
        ("mpp_ckpt", None, "backbone.", None),
    ],
)
def test_load_backbone_round_trips(fixture, which, prefix, other, request, tmp_path):
    ckpt = request.getfixturevalue(fixture)
    ref, x = _reference(ckpt, prefix), _x()
    if other is not None:  # the two encoders must differ, or the test could not tell them apart
        assert not torch.equal(ref(x), _reference(ckpt, other)(x))
    from_ckpt = load_backbone(ckpt, which=which)
    out = export_backbone(ckpt, tmp_path / "exp", which=which).out_dir
    from_dir = load_backbone(out)
    assert not from_dir.training
    torch.testing.assert_close(from_ckpt(x), ref(x), rtol=0, atol=0)
    torch.testing.assert_close(from_dir(x), ref(x), rtol=0, atol=0)
    _, info = load_any_backbone(out)
    assert info["method"] == ("mocov3" if "moco" in fixture else "mpp")
    if fixture == "mpp_ckpt":  # no datamodule: MPP's own mean/std arguments are the normalisation
        assert info["mean"] == [0.5] and "MPP" in info["normalization_source"]


def test_other_resolution_resamples_the_position_embedding(dino_ckpt):
    model = load_backbone(dino_ckpt, backbone_kwargs={"img_size": 24})
    expected = resample_abs_pos_embed(_encoder(dino_ckpt, "teacher_backbone.")["pos_embed"], new_size=(6, 6), old_size=(4, 4), num_prefix_tokens=1)
    torch.testing.assert_close(model.pos_embed.detach(), expected)


# ------------------------------------------------------------------------ TorchScript / ONNX


def test_torchscript_and_onnx_match_eager(dino_ckpt, tmp_path):
    import onnxruntime as ort

    result = export_backbone(dino_ckpt, tmp_path / "exp", formats=["torchscript", "export", "onnx"])
    ref, x = _reference(dino_ckpt, "teacher_backbone."), _x(b=5)  # not the traced batch size
    scripted = torch.jit.load(str(result.out_dir / "model.torchscript.pt"))
    exported = torch.export.load(str(result.out_dir / "model.pt2")).module()
    session = ort.InferenceSession(str(result.out_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    onnx_out = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), ref(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(exported(x), ref(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(onnx_out, ref(x), atol=1e-5, rtol=0)
        # The traced copy checks the size it was traced at (a trace would crop a larger image).
        with pytest.raises(torch.jit.Error, match=r"takes images \[batch, 1, 16, 16\] \(traced at that size\), got \[2, 1, 20, 20\]"):
            scripted(torch.randn(2, 1, 20, 20))
    files = json.loads((result.out_dir / "config.json").read_text())["ssl_vit"]["files"]
    assert files["model.onnx"]["max_abs_diff"] < 1e-4 and "sha256" in files["model.torchscript.pt"]
    assert files["model.pt2"]["max_abs_diff"] < 1e-4
    # a small model's ONNX file holds its weights (no model.onnx.data beside it)
    assert sorted(p.name for p in result.out_dir.iterdir()) == ["config.json", "model.onnx", "model.pt2", "model.safetensors", "model.torchscript.pt"]


def test_onnx_weights_past_the_protobuf_limit_go_to_a_side_file_that_travels_with_it(monkeypatch, tmp_path):
    # traced.py: a protobuf cannot hold more than 2 GB, so above _ONNX_INLINE_LIMIT the weights
    # are written to model.onnx.data (ONNX's external data), moved in and recorded beside it.
    # Stood in for here by a limit of 0 bytes.
    import onnxruntime as ort

    from ssl_vit.export import traced

    monkeypatch.setattr(traced, "_ONNX_INLINE_LIMIT", 0)
    model = _tiny(0)
    out = save_backbone(model, tmp_path / "exp", formats=["onnx"]).out_dir
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.onnx", "model.onnx.data", "model.safetensors"]
    assert set(json.loads((out / "config.json").read_text())["ssl_vit"]["files"]) == {"model.safetensors", "model.onnx", "model.onnx.data"}
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    x = _x(b=4)
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(session.run(None, {"images": x.numpy()})[0]), model(x), atol=1e-5, rtol=0)


def test_a_torchscript_file_is_checked_at_another_batch_size_than_it_was_traced_at(monkeypatch, tmp_path):
    # traced.py: the written file is checked on 3 images, not the trace's 2: a trace that baked
    # its batch size in fails the export.
    real_trace = torch.jit.trace

    class OnlyAtTwo(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.inner(x)
            return y if x.shape[0] == 2 else y + 1.0

    monkeypatch.setattr(torch.jit, "trace", lambda m, x, **kw: torch.jit.script(OnlyAtTwo(real_trace(m, x, **kw))))
    with pytest.raises(ExportParityError, match=r"TorchScript model.torchscript.pt: outputs differ"):
        save_backbone(_tiny(0), tmp_path / "exp", formats=["torchscript"])


def test_hybrid_exports_reloads_and_traces(tmp_path):
    # The hybrid (ResNet stem -> ViT) through every format: safetensors + config.json rebuild it,
    # TorchScript and ONNX compute what the eager model computes.
    import onnxruntime as ort

    torch.manual_seed(4)
    # (a hybrid of free shape, 2 blocks: the formats see every kind of layer at a fraction of ViT-Ti's export time)
    kwargs = {"resnet": "resnet18", "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 3}
    result = export_backbone("random:hybrid", tmp_path / "exp", backbone_kwargs=kwargs, formats=["torchscript", "onnx"])
    out, x = result.out_dir, _x(b=2)
    eager, info = load_any_backbone(out)
    assert info["name"] == "hybrid" and eager.grid_size == (4, 4) and len(eager.blocks) == 2
    rebuilt = create_backbone("hybrid", **kwargs).eval()
    rebuilt.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    scripted = torch.jit.load(str(out / "model.torchscript.pt"))
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    onnx_out = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
    with torch.no_grad():
        ref = eager(x)
        torch.testing.assert_close(rebuilt(x), ref, atol=0, rtol=0)
        torch.testing.assert_close(scripted(x), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(onnx_out, ref, atol=1e-4, rtol=0)


def test_onnx_without_its_packages_is_refused_before_anything_is_written(monkeypatch, tmp_path):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"ONNX export needs onnxruntime: pip install 'ssl_vit\[onnx\]'"):
        export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=TINY_VIT, formats=["onnx"])
    assert not (tmp_path / "exp").exists()


def test_a_trace_that_disagrees_is_an_error_and_leaves_no_file(monkeypatch, tmp_path):
    model = create_backbone("vit", **TINY_VIT).eval()
    other = create_backbone("vit", **TINY_VIT).eval()  # different random weights
    real_trace = torch.jit.trace
    monkeypatch.setattr(torch.jit, "trace", lambda m, x, **kw: real_trace(other, x, **kw))
    with pytest.raises(ExportParityError, match=r"TorchScript model.torchscript.pt: outputs differ .* > tolerance"):
        save_backbone(model, tmp_path / "exp", formats=["torchscript"])
    assert not (tmp_path / "exp" / "model.torchscript.pt").exists()


# ------------------------------------------------------------------------ foreign layouts


def _tiny(seed: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_backbone("vit", **{**TINY_VIT, **overrides}).eval()


def test_timm_state_dict_with_head_and_rgb_weights():
    timm_vit = TimmViT(**{**TIMM_TINY, "in_chans": 3}, num_classes=5).eval()
    ours = create_backbone("vit", **{**TINY_VIT, "in_chans": 3}).eval()
    ours.load_state_dict(filter_foreign_state_dict(timm_vit.state_dict(), ours), strict=True)
    x = _x(3)
    torch.testing.assert_close(ours(x), timm_vit.forward_head(timm_vit.forward_features(x), pre_logits=True))
    # RGB weights into a grey backbone: the patch filters are summed over channels (timm
    # adapt_input_conv), so a grey image gives what the RGB model gives for it repeated 3 times.
    grey = create_backbone("vit", **TINY_VIT).eval()
    grey.load_state_dict(filter_foreign_state_dict(timm_vit.state_dict(), grey), strict=True)
    x1 = _x(1)
    torch.testing.assert_close(grey(x1), timm_vit.forward_head(timm_vit.forward_features(x1.repeat(1, 3, 1, 1)), pre_logits=True), atol=1e-5, rtol=1e-5)


def test_position_embedding_without_class_position():
    timm_vit = TimmViT(**TIMM_TINY, num_classes=0, no_embed_class=True).eval()  # pos_embed [1, 16, D]
    ours = create_backbone("vit", **TINY_VIT).eval()
    ours.load_state_dict(filter_foreign_state_dict(timm_vit.state_dict(), ours), strict=True)
    x = _x()
    torch.testing.assert_close(ours(x), timm_vit(x))


def test_official_dino_checkpoint(tmp_path):
    teacher, student = _tiny(10), _tiny(11)
    ckpt = {
        "student": {**{f"module.backbone.{k}": v for k, v in student.state_dict().items()}, "module.head.mlp.0.weight": torch.zeros(8, 32)},
        "teacher": {**{f"backbone.{k}": v for k, v in teacher.state_dict().items()}, "head.last_layer.weight_g": torch.ones(64, 1)},
        "epoch": 100,
    }
    path = tmp_path / "dino_deit_tiny_full_checkpoint.pth"
    torch.save(ckpt, path)
    x = _x()
    for which, expected in ((None, teacher), ("student", student)):
        model = load_backbone(path, which=which, backbone="vit", backbone_kwargs=TINY_VIT)
        torch.testing.assert_close(model(x), expected(x), rtol=0, atol=0)


def test_official_mocov3_checkpoint(tmp_path):
    base, momentum = _tiny(20), _tiny(21)
    head = {"head.0.weight": torch.zeros(16, 32), "head.1.running_mean": torch.zeros(16)}  # the projector
    state = {f"module.base_encoder.{k}": v for k, v in {**base.state_dict(), **head}.items()}
    state |= {f"module.momentum_encoder.{k}": v for k, v in {**momentum.state_dict(), **head}.items()}
    state["module.predictor.0.weight"] = torch.zeros(16, 16)
    path = tmp_path / "vit-s-300ep.pth.tar"
    torch.save({"epoch": 300, "arch": "vit_small", "state_dict": state, "optimizer": {}}, path)
    x = _x()
    for which, expected in ((None, base), ("momentum", momentum)):
        model, info = load_any_backbone(path, which=which, backbone="vit", backbone_kwargs=TINY_VIT)
        torch.testing.assert_close(model(x), expected(x), rtol=0, atol=0)
        assert info["kind"] == "state_dict"


# ------------------------------------------------------------------------ errors and CLI


def _fake_lightning(path):
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {"layer.weight": torch.zeros(2, 2)}, "hyper_parameters": {}}, path)


@pytest.mark.parametrize(
    ("make", "error", "expected"),
    [
        (None, FileNotFoundError, "no such file"),
        (lambda p: p.write_text("epochs: 10\nlr: 0.1\n"), ValueError, "a text file; expected a pretraining checkpoint"),
        ("truncate", ValueError, "truncated or corrupt"),
        # a legacy (pickle) file cut in its header: the loader fails with struct.error
        (lambda p: p.write_bytes(b"\x80\x02}q\x00(X\x01"), ValueError, r"truncated or corrupt \(unpack requires a buffer of 4 bytes\)"),
        (lambda p: p.write_bytes(b"\x00" * 16), ValueError, "not a PyTorch file; expected"),
        (_fake_lightning, ValueError, "not of an ssl_vit pretext module.*expected a checkpoint written by `ssl-vit fit`"),
        (lambda p: torch.save([1, 2, 3], p), ValueError, "holds a list, not a checkpoint"),
        (lambda p: torch.save(_tiny(0).state_dict(), p), ValueError, "without a record of its architecture; name it: --arch NAME --backbone-kwargs JSON"),
    ],
    ids=["missing", "text", "truncated", "cut_legacy", "zeros", "wrong_kind", "list", "bare_state_dict"],
)
def test_bad_inputs_give_one_line_errors(make, error, expected, dino_ckpt, tmp_path):
    path = tmp_path / "model.ckpt"
    if make == "truncate":
        data = open(dino_ckpt, "rb").read()
        path.write_bytes(data[: len(data) // 2])
    elif make is not None:
        make(path)
    with pytest.raises(error, match=expected) as info:
        load_backbone(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message


def test_cli_end_to_end(dino_ckpt, tmp_path, capsys):
    extra = tmp_path / "linear.json"
    extra.write_text(json.dumps({"metrics": {"top1": 0.42}, "note": "any JSON with metrics"}))
    out = tmp_path / "exp"
    assert cli.main(["export", dino_ckpt, "--out", str(out), "--which", "student", "--format", "torchscript", "--results", str(extra)]) == 0
    assert "dino student backbone vit" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "model.torchscript.pt"}
    cfg = json.loads((out / "config.json").read_text())
    # the run's record (0.61) is of DINO's default encoder, the teacher: not this export's
    assert sorted(r["metrics"]["top1"] for r in cfg["ssl_vit"]["results"]) == [0.42]
    x = _x()
    torch.testing.assert_close(load_backbone(out)(x), _reference(dino_ckpt, "backbone.")(x), rtol=0, atol=0)

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


def test_cli_exports_a_bare_state_dict_named_with_arch(tmp_path, capsys):
    # The option the error message names (--arch, as in eval and visualize) is accepted here too.
    bare = tmp_path / "bare.pth"
    torch.save(_tiny(0).state_dict(), bare)
    assert cli.main(["export", str(bare), "--out", str(tmp_path / "a")]) == 1
    assert "--arch NAME --backbone-kwargs JSON" in capsys.readouterr().err
    assert cli.main(["export", str(bare), "--out", str(tmp_path / "a"), "--arch", "vit", "--backbone-kwargs", json.dumps(TINY_VIT)]) == 0
    x = _x()
    torch.testing.assert_close(load_backbone(tmp_path / "a")(x), _tiny(0)(x), rtol=0, atol=0)
