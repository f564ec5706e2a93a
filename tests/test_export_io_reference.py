"""Export, loading, atomic writes and preemption against independent references: timm's own
models and pretrained configs (ResNet and ViT ``first_conv`` / ``classifier`` /
``fixed_input_size``, ``local-dir:`` rebuilds with a classifier), torchvision's ResNet (channel
adaptation), ``hashlib`` and ``os.stat`` (file records, permissions a plain ``open()`` gives),
``torch.save``'s legacy format and ``weights_only`` loader, ``os.replace`` (the temporary file
sits beside its target) and expectations written out by hand from the docstrings (what an
export folder holds after a failure or a re-export, which encoder a bare state dict gives,
which signal handlers the preemption callback takes)."""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import signal
import stat
import warnings
from types import SimpleNamespace

import pytest
import timm
import torch
import torchvision
from helpers import TINY_VIT, under_file_size_limit
from safetensors.torch import load_file, save_file

import ssl_vit.export.save as export_save
from ssl_vit import cli, create_backbone
from ssl_vit.export import (
    ExportParityError,
    export_backbone,
    filter_foreign_state_dict,
    load_any_backbone,
    load_backbone,
    save_backbone,
)
from ssl_vit.export.traced import check_parity
from ssl_vit.io import atomic_write, atomic_write_json, stale_temporaries
from ssl_vit.training.preemption import PreemptionCheckpoint


def _x(c: int = 1, h: int = 16, w: int = 16, b: int = 3) -> torch.Tensor:
    return torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(7))


def _vit(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_backbone("vit", **{**TINY_VIT, **overrides}).eval()


def _config(out) -> dict:
    return json.loads((out / "config.json").read_text())


# ------------------------------------------------------------------------ config.json vs timm


def test_a_grey_resnet_export_is_rebuilt_by_timm_with_its_channels_and_pretrained_cfg(tmp_path):
    # Reference: timm.create_model("local-dir:DIR", pretrained=True) builds resnet18 with the
    # recorded in_chans and computes our pooled features; pretrained_cfg's first_conv, classifier
    # and fixed_input_size are timm's own for resnet18, num_features timm's model's.
    torch.manual_seed(0)
    net = create_backbone("resnet18", in_chans=1, img_size=32).eval()
    out = save_backbone(net, tmp_path / "exp").out_dir
    cfg = _config(out)
    assert cfg["architecture"] == "resnet18" and cfg["model_args"] == {"in_chans": 1}
    ref = timm.create_model(f"local-dir:{out}", pretrained=True, num_classes=0).eval()
    x = _x(1, 32, 32, b=2)
    with torch.no_grad():
        torch.testing.assert_close(ref(x), net(x))
    timm_cfg = timm.models.get_pretrained_cfg("resnet18")
    pc = cfg["pretrained_cfg"]
    assert (pc["first_conv"], pc["classifier"], pc["fixed_input_size"]) == (timm_cfg.first_conv, timm_cfg.classifier, timm_cfg.fixed_input_size)
    assert cfg["num_features"] == ref.num_features == 512
    assert cfg["global_pool"] == "avg"  # timm's ResNet pooling (ours has no global_pool attribute)


def test_a_vit_export_says_fixed_input_size_as_timm_does(tmp_path):
    # Reference: timm's ViT pretrained config (fixed_input_size=True: the position table fixes it).
    cfg = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=TINY_VIT).config
    assert cfg["pretrained_cfg"]["fixed_input_size"] is timm.models.get_pretrained_cfg("vit_tiny_patch16_224").fixed_input_size is True
    assert cfg["num_features"] == TINY_VIT["embed_dim"]
    assert cfg["model_args"]["class_token"] is True and cfg["global_pool"] == "token"  # ours pools the [CLS] token


@pytest.mark.parametrize("kwargs", [{"small_input": True}, {"num_stages": 3}, {"layers": [1, 1, 1, 1]}], ids=["cifar_stem", "three_stages", "other_depths"])
def test_a_resnet_timm_cannot_build_names_no_timm_architecture(kwargs, tmp_path):
    # Reference: timm's resnet18 does not take these weights (3x3 stem / no layer4), so config.json
    # must not name it (config.py: only "standard ResNets" rebuild in timm).
    torch.manual_seed(0)
    net = create_backbone("resnet18", in_chans=3, img_size=32, **kwargs).eval()
    out = save_backbone(net, tmp_path / "exp").out_dir
    timm_net = timm.create_model("resnet18", pretrained=False, num_classes=0)
    with pytest.raises(RuntimeError):
        timm_net.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    assert "architecture" not in _config(out) and "model_args" not in _config(out)


def test_a_hybrid_export_claims_neither_timm_names_nor_a_timm_architecture(tmp_path):
    # Hand-written expectation (config.py weights_format): hybrids use our own layout
    # (patch_embed.backbone.*), so no timm architecture and no first_conv is declared.
    kwargs = {"img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 3}
    cfg = export_backbone("random:hybrid_r18_vit_tiny", tmp_path / "exp", backbone_kwargs=kwargs).config
    assert cfg["ssl_vit"]["weights_format"] == "ssl_vit"
    assert "architecture" not in cfg and "first_conv" not in cfg["pretrained_cfg"]
    assert cfg["pretrained_cfg"]["classifier"] == "head"


def test_a_vit_with_its_classifier_is_built_whole_by_timm_and_pretrained_cfg_says_num_classes(tmp_path):
    # Reference: timm.create_model("local-dir:DIR", pretrained=True) builds the classifier from
    # config.json (head.* in model.safetensors) and gives head(backbone(x)); pretrained_cfg agrees.
    vit = _vit(3)
    head = torch.nn.Linear(TINY_VIT["embed_dim"], 5)
    out = save_backbone(vit, tmp_path / "exp", head=head).out_dir
    cfg = _config(out)
    assert cfg["num_classes"] == cfg["pretrained_cfg"]["num_classes"] == 5
    ref = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(ref(x), head(vit(x)))


def test_default_normalisation_of_a_four_channel_model_is_half_per_channel(tmp_path):
    # config.py: ImageNet statistics for RGB only, 0.5 / 0.5 "for any other channel count", one value
    # per input channel; a record without its std is no record.
    from ssl_vit.export.config import resolve_normalization

    cfg = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs={**TINY_VIT, "in_chans": 4}).config
    assert cfg["mean"] == cfg["std"] == cfg["pretrained_cfg"]["mean"] == [0.5] * 4 and cfg["input_size"] == [4, 16, 16]
    assert resolve_normalization({"mean": [0.1], "std": None}, 1) == {"mean": [0.5], "std": [0.5], "source": "default (0.5 / 0.5)"}


# ------------------------------------------------------------------------ file records


def test_file_records_are_the_sha256_and_size_of_the_bytes_on_disk(tmp_path):
    # Reference: hashlib.sha256 and os.stat of each file written.
    out = export_backbone("random:vit", tmp_path / "exp", backbone_kwargs=TINY_VIT).out_dir
    files = _config(out)["ssl_vit"]["files"]
    assert set(files) == {"model.safetensors"}
    data = (out / "model.safetensors").read_bytes()
    assert files["model.safetensors"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert files["model.safetensors"]["bytes"] == len(data) == os.stat(out / "model.safetensors").st_size


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield 0o022
    os.umask(old)


def test_exported_files_get_the_permissions_a_plain_open_gives(umask_022, tmp_path):
    # Reference: a file created with open() under umask 022 is 0644 (mkstemp's 0600 would hide an
    # export or a checkpoint from the rest of a group sharing it).
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    expected = stat.S_IMODE(plain.stat().st_mode)
    assert expected == 0o644
    out = save_backbone(_vit(), tmp_path / "exp", formats=["torchscript"]).out_dir
    for name in ("model.safetensors", "config.json", "model.torchscript.pt"):
        assert stat.S_IMODE((out / name).stat().st_mode) == expected, name


def _lightning_ckpt(path, vit: torch.nn.Module, step: int = 3):
    """What ``ssl-vit fit`` writes, reduced to the fields the readers use."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"pytorch-lightning_version": "2.6.0", "global_step": step, "epoch": 0,
                "state_dict": {f"backbone.{k}": v for k, v in vit.state_dict().items()},
                "ssl_vit": {"method": "Supervised", "backbone": "vit", "backbone_kwargs": dict(TINY_VIT)}}, path)
    return path


def test_results_of_the_run_folder_are_collected_once_and_copies_are_not(tmp_path):
    # config.py collect_results: the run's JSON results beside checkpoints/, not those inside it,
    # not hidden copies (Jupyter's .ipynb_checkpoints), not JSON files without metrics; a result
    # already recorded by the source (an export) is not recorded twice when passed again.
    run = tmp_path / "run"
    ckpt = _lightning_ckpt(run / "checkpoints" / "last.ckpt", _vit(0))
    for rel, top1 in (("eval/knn.json", 0.5), ("eval/.ipynb_checkpoints/knn-checkpoint.json", 0.4), ("checkpoints/probe.json", 0.3)):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(json.dumps({"metrics": {"top1": top1}}))
    (run / "notes.json").write_text(json.dumps({"lr": 0.1}))
    first = export_backbone(ckpt, tmp_path / "exp").config["ssl_vit"]["results"]
    assert [(r["metrics"]["top1"], r["file"]) for r in first] == [(0.5, str(run / "eval" / "knn.json"))]
    again = export_backbone(tmp_path / "exp", tmp_path / "exp2", results=[run / "eval" / "knn.json"]).config["ssl_vit"]["results"]
    assert [r["metrics"]["top1"] for r in again] == [0.5]


def test_records_of_an_earlier_checkpoint_of_the_run_are_not_credited_to_the_export(tmp_path):
    # A run evaluated at step 6 and resumed to step 12 overwrote last.ckpt; the step-6 records
    # still name that file. Expectation by hand: the export of step 12 keeps the step-12 record
    # and the one that says no step, not the step-6 one.
    from ssl_vit.eval.results import EvalResult

    run = tmp_path / "run"
    ckpt = _lightning_ckpt(run / "checkpoints" / "last.ckpt", _vit(0), step=12)
    (run / "results").mkdir(parents=True)
    for name, steps, top1 in (("knn.json", 6, 0.5), ("knn_2.json", 12, 0.6)):
        record = EvalResult("supervised", {"name": "vit"}, {"name": "synthetic"}, "knn", {"top1": top1}, pretrain={"steps": steps})
        (run / "results" / name).write_text(json.dumps(record.to_dict()))
    (run / "results" / "plain.json").write_text(json.dumps({"metrics": {"top1": 0.7}}))
    results = export_backbone(ckpt, tmp_path / "exp").config["ssl_vit"]["results"]
    assert sorted(r["metrics"]["top1"] for r in results) == [0.6, 0.7]
    # a file named explicitly (outside the run) is the user's word: kept whatever step it records; one that is no
    # JSON or no evaluation result is refused (in a scanned folder it is skipped instead)
    (tmp_path / "step6.json").write_text((run / "results" / "knn.json").read_text())
    results = export_backbone(ckpt, tmp_path / "exp", results=[tmp_path / "step6.json"]).config["ssl_vit"]["results"]
    assert sorted(r["metrics"]["top1"] for r in results) == [0.5, 0.6, 0.7]
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "notes.json").write_text(json.dumps({"lr": 0.1}))
    with pytest.raises(ValueError, match=r"bad.json: not valid JSON"):
        export_backbone(ckpt, tmp_path / "exp", results=[tmp_path / "bad.json"])
    with pytest.raises(ValueError, match=r"notes.json: not an evaluation result"):
        export_backbone(ckpt, tmp_path / "exp", results=[tmp_path / "notes.json"])
    (run / "results" / "notes.json").write_text(json.dumps({"lr": 0.1}))
    (run / "results" / "bad.json").write_text("{not json")
    results = export_backbone(ckpt, tmp_path / "exp").config["ssl_vit"]["results"]
    assert sorted(r["metrics"]["top1"] for r in results) == [0.6, 0.7]


def test_an_export_of_one_encoder_carries_only_that_encoders_results(tmp_path):
    # A MoCo v3 run evaluated its online encoder (records without "encoder") and, with --which
    # momentum, its momentum encoder (records naming it). Expectation by hand: each export
    # carries its own encoder's record only; a file of the other encoder given explicitly is refused.
    from ssl_vit.eval.results import EvalResult

    run = tmp_path / "run"
    vit = _vit(0)
    path = run / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    state = {f"{prefix}.{k}": v for prefix in ("backbone", "momentum_backbone") for k, v in vit.state_dict().items()}
    torch.save({"pytorch-lightning_version": "2.6.0", "global_step": 3, "epoch": 0, "state_dict": state,
                "ssl_vit": {"method": "MoCoV3", "backbone": "vit", "backbone_kwargs": dict(TINY_VIT)}}, path)
    (run / "results").mkdir()
    for name, encoder, top1 in (("knn.json", None, 0.5), ("knn_momentum.json", "momentum", 0.4)):
        backbone = {"name": "vit", **({"encoder": encoder} if encoder else {})}
        record = EvalResult("mocov3", backbone, {"name": "synthetic"}, "knn", {"top1": top1}, pretrain={"steps": 3})
        (run / "results" / name).write_text(json.dumps(record.to_dict()))
    online = export_backbone(path, tmp_path / "online").config["ssl_vit"]["results"]
    momentum = export_backbone(path, tmp_path / "momentum", which="momentum").config["ssl_vit"]["results"]
    assert [r["metrics"]["top1"] for r in online] == [0.5]
    assert [r["metrics"]["top1"] for r in momentum] == [0.4]
    with pytest.raises(ValueError, match=r"knn\.json: a result of the default encoder of its checkpoint; this export is of the momentum one"):
        export_backbone(path, tmp_path / "momentum2", which="momentum", results=[run / "results" / "knn.json"])


def test_our_record_marks_a_checkpoint_and_online_and_base_name_the_student(tmp_path):
    # sources.py: a checkpoint with an ssl_vit record is ours even when another tool re-saved it
    # without Lightning's version field; "online" / "base" are aliases of the student.
    vit = _vit(4)
    ckpt = torch.load(_lightning_ckpt(tmp_path / "run.ckpt", vit, step=6), weights_only=False)
    del ckpt["pytorch-lightning_version"]
    torch.save(ckpt, tmp_path / "resaved.ckpt")
    for which in ("online", "base"):
        model, info = load_any_backbone(tmp_path / "resaved.ckpt", which=which)
        assert (info["kind"], info["which"], info["method"], info["pretrain"]["steps"]) == ("lightning", "student", "supervised", 6)
        torch.testing.assert_close(model(_x()), vit(_x()), rtol=0, atol=0)


# ------------------------------------------------------------------------ atomic writes


def test_the_temporary_file_is_beside_its_target_and_found_by_stale_temporaries(monkeypatch, tmp_path):
    # io.py: "a temporary file in the target's directory (same filesystem) ... renamed over the
    # target with os.replace"; stale_temporaries lists what a killed writer leaves there.
    target = tmp_path / "run" / "last.ckpt"
    seen = {}
    real_replace = os.replace

    def replace(src, dst):
        seen["src"], seen["dst"] = str(src), str(dst)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)

    def write(tmp):
        tmp.write_bytes(b"half")
        seen["during"] = stale_temporaries(target.parent, ".ckpt")
        seen["other_suffix"] = stale_temporaries(target.parent, ".json")
        seen["tmp"] = tmp

    atomic_write(target, write)
    assert seen["during"] == [seen["tmp"]] and seen["other_suffix"] == []
    assert os.path.dirname(seen["src"]) == str(target.parent) and seen["dst"] == str(target)
    assert target.read_bytes() == b"half" and stale_temporaries(target.parent) == []


def test_atomic_json_writes_sets_sorted_and_tensors_as_lists(tmp_path):
    # Reference: json.loads of the file; sets are recorded sorted (a stable file), tensors as lists.
    path = atomic_write_json(tmp_path / "r.json", {"s": {"d", "a", "f", "c", "e", "b"}, "t": torch.tensor([1.5, 2.0]), "p": tmp_path})
    assert json.loads(path.read_text()) == {"s": ["a", "b", "c", "d", "e", "f"], "t": [1.5, 2.0], "p": str(tmp_path)}


# ------------------------------------------------------------------------ the export folder


class _Wrong:
    """A torch.jit.trace that traces another network (different weights)."""

    def __init__(self, other: torch.nn.Module) -> None:
        self.other, self.real = other, torch.jit.trace

    def __call__(self, m, x, **kw):
        return self.real(self.other, x, **kw)


def test_a_failed_re_export_leaves_no_config_and_no_staging_folder(monkeypatch, tmp_path):
    # save.py: "config.json last: a folder with a config.json is a complete export" and the earlier
    # export's config.json goes first, so a failed re-export is refused by the loader rather than
    # mixing old and new files; files.py: the staging folder is removed whatever happens.
    out = save_backbone(_vit(0), tmp_path / "exp").out_dir
    assert (out / "config.json").is_file()
    monkeypatch.setattr(torch.jit, "trace", _Wrong(_vit(2)))
    with pytest.raises(ExportParityError):
        save_backbone(_vit(1), out, formats=["torchscript"])
    assert not (out / "config.json").exists()
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # no .staging-* left
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_backbone(out)


def test_files_of_an_earlier_export_that_no_longer_match_are_removed(tmp_path):
    # save.py _ARTIFACTS: an earlier export's traced copies (and ONNX's side file) would not match
    # the new weights; a re-export with safetensors only leaves just the two files.
    out = tmp_path / "exp"
    out.mkdir()
    for name in ("model.torchscript.pt", "model.pt2", "model.onnx", "model.onnx.data"):
        (out / name).write_bytes(b"an earlier export's file")
    save_backbone(_vit(0), out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_weights_that_do_not_rebuild_the_model_are_refused_and_not_left_behind(tmp_path):
    # save.py: "proof that they rebuild the same function from name + kwargs alone"; a model
    # changed after create_backbone (its kwargs say token pooling) does not rebuild: no file stays.
    vit = _vit(0)
    vit.global_pool = "avg"
    with pytest.raises(ExportParityError, match="weights model.safetensors: outputs differ"):
        save_backbone(vit, tmp_path / "exp")
    assert not (tmp_path / "exp").exists()  # nor the folder the export had created
    (tmp_path / "mine").mkdir()  # a folder the user had made stays, empty
    with pytest.raises(ExportParityError):
        save_backbone(vit, tmp_path / "mine")
    assert list((tmp_path / "mine").iterdir()) == []


def test_a_refused_export_removes_the_folders_it_created_and_only_those(monkeypatch, tmp_path):
    # save.py _remove_created: the parents `--out` made are removed too while empty; an existing
    # parent stays, and so does a created parent that something else wrote into meanwhile.
    monkeypatch.setattr(torch.jit, "trace", _Wrong(_vit(2)))
    with pytest.raises(ExportParityError):
        save_backbone(_vit(1), tmp_path / "a" / "b" / "exp", formats=["torchscript"])
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    def publish_beside_a_note(stage, out_dir):
        (tmp_path / "a" / "note.txt").write_text("written meanwhile")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_save, "publish", publish_beside_a_note)
    with pytest.raises(OSError, match="No space left"):
        save_backbone(_vit(1), tmp_path / "a" / "b" / "exp", formats=["torchscript"])
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/note.txt"]


def test_save_backbone_restores_the_callers_training_mode_and_accepts_tolerance_zero(tmp_path):
    # save.py docstring: "its train/eval mode is restored"; tolerance must be >= 0, and the weights
    # rebuild exactly (the same float operations), so 0 passes.
    vit = _vit(0).train()
    result = save_backbone(vit, tmp_path / "exp", tolerance=0.0)
    assert vit.training and result.parity["model.safetensors"] == 0.0
    save_backbone(vit.eval(), tmp_path / "exp2")
    assert not vit.training
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        save_backbone(vit, tmp_path / "exp3", tolerance=-1e-3)


def test_bad_formats_and_a_file_as_the_folder_are_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"unknown export format\(s\) \['tflite'\]"):
        save_backbone(_vit(), tmp_path / "exp", formats=["safetensors", "tflite"])
    assert not (tmp_path / "exp").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        save_backbone(_vit(), tmp_path / "file")


# ------------------------------------------------------------------------ traced copies


def test_check_parity_refuses_nan_outputs_and_another_shape():
    # traced.py: "raises above tolerance" (NaN is not within any tolerance) and a file whose output
    # has another shape computes something else, even where broadcasting would hide it.
    vit, x = _vit(0), _x()
    with torch.no_grad():
        good = vit(x)
    assert check_parity(lambda t: good.clone(), vit, x, "same", 0.0) == 0.0
    with pytest.raises(ExportParityError, match="differ from the eager backbone by nan"):
        check_parity(lambda t: torch.full_like(good, float("nan")), vit, x, "nan", 1e-4)
    with pytest.raises(ExportParityError, match=r"output shape \(3, 1\) differs from the eager backbone's \(3, 32\)"):
        check_parity(lambda t: good[:, :1], vit, x, "narrow", 1e3)


def test_a_non_square_export_records_and_traces_its_own_height_and_width(tmp_path):
    # Reference: the eager backbone on an image [B, 1, 16, 24]; the traced copy refuses any other
    # size (traced.py _SizeChecked), also one with the right height and another width, or the
    # right width and another height.
    vit = _vit(0, img_size=[16, 24])
    out = save_backbone(vit, tmp_path / "exp", formats=["torchscript"]).out_dir
    cfg = _config(out)  # timm's input_size is (C, H, W)
    assert cfg["input_size"] == cfg["pretrained_cfg"]["input_size"] == [1, 16, 24] and cfg["ssl_vit"]["img_size"] == [16, 24]
    scripted = torch.jit.load(str(out / "model.torchscript.pt"))
    x = _x(1, 16, 24, b=2)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), vit(x), atol=1e-5, rtol=0)
        for bad in (_x(1, 16, 28, b=2), _x(1, 24, 16, b=2), _x(1, 20, 24, b=2)):
            with pytest.raises(torch.jit.Error, match=r"takes images \[batch, 1, 16, 24\]"):
                scripted(bad)


# ------------------------------------------------------------------------ reading weight files


def _unpickle_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "full unpickling" in str(w.message)]


def test_a_legacy_torch_save_file_loads(tmp_path):
    # Reference: torch.save(..., _use_new_zipfile_serialization=False), the format of checkpoints
    # written before PyTorch 1.6 (a pickle stream, no zip archive).
    vit = _vit(5)
    path = tmp_path / "legacy.pth"
    torch.save(vit.state_dict(), path, _use_new_zipfile_serialization=False)
    assert path.read_bytes()[:1] == b"\x80"
    model = load_backbone(path, backbone="vit", backbone_kwargs=TINY_VIT)
    x = _x()
    torch.testing.assert_close(model(x), vit(x), rtol=0, atol=0)


def test_weights_only_loading_warns_only_for_python_objects_and_refuses_them_on_request(tmp_path, capsys):
    # Reference: torch.load(weights_only=True) takes a plain state dict (no warning needed) and
    # refuses an argparse.Namespace (as the official DINO / MoCo v3 checkpoints hold); files.py:
    # None falls back to full unpickling with a warning, True (CLI --weights-only) refuses.
    vit = _vit(6)
    plain, objects = tmp_path / "plain.pth", tmp_path / "objects.pth"
    torch.save(vit.state_dict(), plain)
    torch.save({"model": vit.state_dict(), "args": argparse.Namespace(arch="vit_tiny")}, objects)
    torch.load(plain, weights_only=True)
    with pytest.raises(Exception, match="(?i)weights.only"):
        torch.load(objects, weights_only=True)
    kw = {"backbone": "vit", "backbone_kwargs": TINY_VIT}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_backbone(plain, **kw)
    assert _unpickle_warnings(caught) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_backbone(objects, **kw)
    assert len(_unpickle_warnings(caught)) == 1
    torch.testing.assert_close(model(_x()), vit(_x()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="holds Python objects besides tensors"):
        load_backbone(objects, weights_only=True, **kw)
    args = [str(objects), "--out", str(tmp_path / "exp"), "--arch", "vit", "--backbone-kwargs", json.dumps(TINY_VIT)]
    assert cli.main(["export", *args, "--weights-only"]) == 1
    assert "holds Python objects besides tensors" in capsys.readouterr().err and not (tmp_path / "exp").exists()
    with pytest.warns(UserWarning, match="full unpickling"):
        assert cli.main(["export", *args]) == 0


def test_a_safetensors_file_given_to_the_torch_reader_is_named_so(tmp_path):
    # Reference: safetensors' save_file; torch.load cannot read it, and the error says what it is.
    from ssl_vit.export.files import read_torch_file

    save_file({"w": torch.zeros(2)}, tmp_path / "w.pt")
    with pytest.raises(ValueError, match="a safetensors file; expected"):
        read_torch_file(tmp_path / "w.pt")


def test_the_model_safetensors_of_an_export_given_as_a_file_keeps_the_export_record(tmp_path):
    # sources.py: model.safetensors beside an ssl_vit config.json is read as that export (its
    # architecture and normalisation), not as a bare state dict that needs --arch.
    from ssl_vit.export import BackboneSource

    source = BackboneSource({}, "vit", dict(TINY_VIT), "memory", "memory", normalization={"mean": [0.2], "std": [0.3]})
    out = save_backbone(_vit(1), tmp_path / "exp", source).out_dir
    model, info = load_any_backbone(out / "model.safetensors")
    assert info["kind"] == "export" and info["name"] == "vit" and info["mean"] == [0.2]


# ------------------------------------------------------------------------ foreign state dicts


def test_a_bare_state_dict_of_our_two_encoder_checkpoints_gives_the_one_asked_for():
    # foreign.py: which='momentum' takes momentum_backbone.* (our MoCo v3), which='teacher' takes
    # teacher_backbone.* (our DINO); expectation: each encoder's own weights, by hand.
    online, other = _vit(1), _vit(2)
    model = _vit(3)
    for prefix, which in (("momentum_backbone.", "momentum"), ("teacher_backbone.", "teacher")):
        sd = {**{f"backbone.{k}": v for k, v in online.state_dict().items()}, **{f"{prefix}{k}": v for k, v in other.state_dict().items()}}
        picked = filter_foreign_state_dict(sd, model, which=which)
        assert all(torch.equal(picked[k], v) for k, v in other.state_dict().items()), which
        student = filter_foreign_state_dict(sd, model, which="student")
        assert all(torch.equal(student[k], v) for k, v in online.state_dict().items()), which


def test_teacher_of_an_official_mocov3_checkpoint_is_refused():
    # MoCo v3 has no teacher (base and momentum encoders): asking for one is an error, not silently
    # the base encoder.
    base = _vit(4)
    sd = {f"module.base_encoder.{k}": v for k, v in base.state_dict().items()}
    with pytest.raises(ValueError, match="MoCo v3 checkpoint; choose student"):
        filter_foreign_state_dict({"state_dict": sd}, _vit(), which="teacher")


def test_teacher_of_a_state_dict_without_one_is_refused_not_the_online_encoder():
    # Our MoCo v3's bare state dict (backbone.* + momentum_backbone.*) and a one-encoder one have
    # no teacher: backbone.* is the online encoder, so which='teacher' must not return it.
    online, momentum = _vit(5), _vit(6)
    one = {f"backbone.{k}": v for k, v in online.state_dict().items()}
    two = {**one, **{f"momentum_backbone.{k}": v for k, v in momentum.state_dict().items()}}
    for sd in (one, two, {"state_dict": two}):
        with pytest.raises(ValueError, match="no teacher backbone .teacher_backbone.. keys"):
            filter_foreign_state_dict(sd, _vit(), which="teacher")
    # an official DINO checkpoint's "teacher" entry does hold it as backbone.*
    picked = filter_foreign_state_dict({"teacher": one, "student": {}}, _vit(), which="teacher")
    assert all(torch.equal(picked[k], v) for k, v in online.state_dict().items())


def test_an_official_dino_file_of_the_student_alone_and_a_stray_module_key(tmp_path):
    # foreign.py: main_dino.py's save_dict is recognised by its "teacher" or "student" entry; a
    # file holding only the student (kept by hand) gives it on request and says what it lacks
    # otherwise. "module." is stripped only when every key has it (a DDP-wrapped state dict).
    student = _vit(8)
    sd = {f"module.backbone.{k}": v for k, v in student.state_dict().items()}
    sd["module.head.mlp.0.weight"] = torch.zeros(4, 32)  # the DINO head beside it
    picked = filter_foreign_state_dict({"student": sd, "epoch": 100}, _vit(), which="student")
    assert picked.keys() == student.state_dict().keys()
    assert all(torch.equal(picked[k], v) for k, v in student.state_dict().items())
    with pytest.raises(ValueError, match=r"DINO checkpoint has no 'teacher' entry \(it has student, epoch\)"):
        filter_foreign_state_dict({"student": sd, "epoch": 100}, _vit())
    mixed = {**{f"backbone.{k}": v for k, v in student.state_dict().items()}, "module.stray": torch.zeros(1)}
    picked = filter_foreign_state_dict(mixed, _vit())
    assert all(torch.equal(picked[k], v) for k, v in student.state_dict().items())


def test_rgb_torchvision_weights_into_a_grey_resnet_sum_the_stem_filters():
    # Reference: torchvision's resnet18 (RGB); timm adapt_input_conv sums the stem's filters over
    # channels, so the grey model on x == torchvision's pooled features on x repeated 3 times.
    torch.manual_seed(0)
    tv = torchvision.models.resnet18().eval()
    grey = create_backbone("resnet18", in_chans=1, img_size=32).eval()
    grey.load_state_dict(filter_foreign_state_dict(tv.state_dict(), grey), strict=True)
    tv.fc = torch.nn.Identity()
    x = _x(1, 32, 32, b=2)
    with torch.no_grad():
        torch.testing.assert_close(grey(x), tv(x.repeat(1, 3, 1, 1)), atol=1e-5, rtol=1e-5)


def test_half_precision_weights_load_into_a_float32_backbone(tmp_path):
    # Reference: the same weights cast with .half() and back; the loaded backbone keeps float32
    # parameters (load_weights casts when assigning), so it runs on float32 images.
    vit = _vit(7)
    half = {k: v.half() for k, v in vit.state_dict().items()}
    torch.save(half, tmp_path / "half.pth")
    model = load_backbone(tmp_path / "half.pth", backbone="vit", backbone_kwargs=TINY_VIT)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ref = _vit(0)
    ref.load_state_dict({k: v.float() for k, v in half.items()})
    torch.testing.assert_close(model(_x()), ref(_x()), rtol=0, atol=0)


def test_a_fixed_sincos_table_is_recomputed_for_another_size_not_resampled(tmp_path):
    # foreign.py: a sin-cos position table is a function of the grid alone (MoCo v3 §4.2), so a
    # backbone loaded at 24 px has the table of one built at 24 px, not a bicubic resample of 16 px's.
    from timm.layers import resample_abs_pos_embed

    out = save_backbone(_vit(0, pos_embed="sincos"), tmp_path / "exp").out_dir
    model = load_backbone(out, backbone_kwargs={"img_size": 24})
    built = create_backbone("vit", **{**TINY_VIT, "pos_embed": "sincos", "img_size": 24})
    torch.testing.assert_close(model.pos_embed.detach(), built.pos_embed.detach(), rtol=0, atol=1e-6)
    resampled = resample_abs_pos_embed(load_file(out / "model.safetensors")["pos_embed"], (6, 6), (4, 4), num_prefix_tokens=1)
    assert not torch.allclose(resampled, built.pos_embed.detach(), atol=1e-3)


def test_weights_of_another_width_are_a_one_line_error_naming_the_shapes(tmp_path):
    torch.save(_vit(0, embed_dim=64).state_dict(), tmp_path / "wide.pth")
    with pytest.raises(ValueError, match=r"shape mismatch cls_token \(1, 1, 64\) vs \(1, 1, 32\), pos_embed \(1, 17, 64\) vs \(1, 17, 32\) \(\+28 more\)$") as info:
        load_backbone(tmp_path / "wide.pth", backbone="vit", backbone_kwargs=TINY_VIT)
    assert "\n" not in str(info.value)
    # of another width and another grid too (16x24 images: 1 + 24 tokens): the same one line
    torch.save(_vit(0, embed_dim=64, img_size=[16, 24]).state_dict(), tmp_path / "wide_grid.pth")
    with pytest.raises(ValueError, match=r"shape mismatch cls_token \(1, 1, 64\) vs \(1, 1, 32\), pos_embed \(1, 25, 64\) vs \(1, 17, 32\)"):
        load_backbone(tmp_path / "wide_grid.pth", backbone="vit", backbone_kwargs=TINY_VIT)


# ------------------------------------------------------------------------ loading


def test_a_checkpoint_of_one_architecture_named_as_another_is_refused(tmp_path):
    out = save_backbone(_vit(0), tmp_path / "exp").out_dir
    with pytest.raises(ValueError, match="holds a 'vit' backbone, not 'resnet18'"):
        load_backbone(out, backbone="resnet18")


def test_an_export_holds_only_its_own_encoder(tmp_path):
    from ssl_vit.export import BackboneSource

    source = BackboneSource({}, "vit", dict(TINY_VIT), "memory", "memory", which="teacher")
    out = save_backbone(_vit(0), tmp_path / "exp", source).out_dir
    assert load_any_backbone(out, which="teacher")[1]["which"] == "teacher"
    with pytest.raises(ValueError, match="this export holds the teacher backbone; which='student' is not in it"):
        load_any_backbone(out, which="student")


def test_a_random_initialisation_is_seeded_and_leaves_the_global_generator_alone():
    # Reference: torch.manual_seed(seed) then create_backbone gives the same weights; the caller's
    # RNG stream is untouched (fork_rng).
    torch.manual_seed(123)
    state = torch.get_rng_state()
    model, info = load_any_backbone("random:vit", backbone_kwargs=TINY_VIT, seed=5)
    assert torch.equal(torch.get_rng_state(), state) and info["kind"] == "random"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        ref = create_backbone("vit", **TINY_VIT)
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in model.state_dict().items())
    assert not model.training


# ------------------------------------------------------------------------ preemption


class _Saver:
    def __init__(self) -> None:
        self.saved_at: list[int] = []

    def save_last_checkpoint(self, trainer):
        self.saved_at.append(trainer.global_step)
        return "last.ckpt"


def _trainer(step: int = 0, **kw) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, checkpoint_callback=_Saver(), world_size=1, accumulate_grad_batches=1,
                           is_last_batch=False, should_stop=False, sanity_checking=False,
                           state=SimpleNamespace(fn="fit"), _accelerator_connector=SimpleNamespace(), **kw)


@pytest.fixture
def usr1_default():
    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGUSR1, before)


def _other_handler(signum, frame):  # someone else's (a user's) handler
    pass


def test_the_callback_takes_free_signals_for_fit_only_and_gives_them_back(usr1_default):
    # preemption.py setup: the signal is taken when nobody handles it, only for fit; teardown
    # restores what was there.
    cb, trainer = PreemptionCheckpoint(), _trainer()
    cb.setup(trainer, None, "validate")
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    cb.setup(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) == cb._handler
    cb.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    # SIGTERM is taken at the first hook after Lightning registers its own (sanity check or train
    # start, whichever comes first) and given back as it was found then, not as our own handler.
    sigterm = signal.getsignal(signal.SIGTERM)
    cb.on_sanity_check_start(trainer, None)
    cb.on_train_start(trainer, None)
    assert signal.getsignal(signal.SIGTERM) == cb._handler
    cb.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGTERM) == sigterm


def test_a_handler_of_someone_else_stays_and_one_left_by_an_earlier_run_is_replaced(usr1_default):
    # preemption.py: "A handler left by an earlier run of this callback ... is replaced; anyone
    # else's stays in charge"; the stale one is not restored at teardown (SIG_DFL is).
    trainer = _trainer()
    signal.signal(signal.SIGUSR1, _other_handler)
    cb = PreemptionCheckpoint()
    cb.setup(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) is _other_handler
    cb.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) is _other_handler

    earlier = PreemptionCheckpoint()
    signal.signal(signal.SIGUSR1, earlier._handler)  # left installed (a run that ended in an exception)
    cb.setup(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) == cb._handler
    cb.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_a_signal_is_acted_on_once_and_not_during_the_sanity_check():
    # One signal: one checkpoint and a stop; the sanity check (before training) saves nothing; a
    # SIGTERMException after the validation stop has saved is not saved a second time.
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    cb, trainer = PreemptionCheckpoint(), _trainer(0)
    cb.on_train_start(trainer, None)
    try:
        trainer.global_step = 3
        cb._handler(signal.SIGUSR1, None)
        trainer.sanity_checking = True
        cb.on_validation_batch_end(trainer, None)  # no raise, nothing saved
        trainer.sanity_checking = False
        trainer.state.fn = "validate"  # trainer.validate(...) on the same trainer: not a training run to stop
        cb.on_validation_batch_end(trainer, None)
        trainer.state.fn = "fit"
        assert trainer.checkpoint_callback.saved_at == []
        cb.on_train_batch_end(trainer, None, None, None, 0)
        assert trainer.checkpoint_callback.saved_at == [3] and trainer.should_stop and cb.stopped_by == "SIGUSR1"
        trainer.should_stop = False
        cb.on_train_batch_end(trainer, None, None, None, 1)  # the same signal, already acted on
        assert trainer.checkpoint_callback.saved_at == [3] and not trainer.should_stop

        trainer.global_step = 4
        cb._handler(signal.SIGTERM, None)
        with pytest.raises(SIGTERMException):
            cb.on_validation_batch_end(trainer, None)
        cb.on_exception(trainer, None, SIGTERMException())  # Lightning's hook for that exception
        assert trainer.checkpoint_callback.saved_at == [3, 4] and cb.stopped_by == "SIGTERM"
        cb.on_exception(trainer, None, RuntimeError("non-finite loss"))
        assert trainer.checkpoint_callback.saved_at == [3, 4]
    finally:
        cb.teardown(trainer, None, "fit")


def test_without_slurm_auto_requeue_its_signal_is_a_plain_stop():
    # Reference: Lightning's SLURMEnvironment(auto_requeue=False) has a requeue_signal but does not
    # requeue; the callback then saves last.ckpt as for any signal (no hpc checkpoint, no requeue).
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    env = SLURMEnvironment(auto_requeue=False)
    assert env.requeue_signal == signal.SIGUSR1
    trainer = _trainer(2, _signal_connector=None)
    trainer._accelerator_connector = SimpleNamespace(cluster_environment=env)
    cb = PreemptionCheckpoint()
    cb._start_step = 0
    cb._handler(signal.SIGUSR1, None)
    cb.on_train_batch_end(trainer, None, None, None, 0)
    assert trainer.checkpoint_callback.saved_at == [2] and cb.stopped_by == "SIGUSR1"


def test_with_accumulation_a_signal_waits_for_the_optimiser_step_which_the_epochs_last_batch_takes():
    # Reference: Lightning steps the optimiser every accumulate_grad_batches batches and at the
    # last batch of an epoch; the callback acts there only (preemption.py on_train_batch_end).
    cb, trainer = PreemptionCheckpoint(), _trainer(0)
    trainer.accumulate_grad_batches = 2
    cb.on_train_start(trainer, None)
    try:
        trainer.global_step = 1
        cb._handler(signal.SIGUSR1, None)
        cb.on_train_batch_end(trainer, None, None, None, 2)  # 3rd batch of 5: between micro-batches
        assert trainer.checkpoint_callback.saved_at == [] and not trainer.should_stop
        trainer.is_last_batch = True  # ... unless it ends the epoch: Lightning steps there
        cb.on_train_batch_end(trainer, None, None, None, 2)
        assert trainer.checkpoint_callback.saved_at == [1] and trainer.should_stop
    finally:
        cb.teardown(trainer, None, "fit")


def test_a_bare_dino_state_dict_gives_its_teacher_by_default_as_its_checkpoint_does(tmp_path):
    # Our DINO's state dict holds backbone.* (student) and teacher_backbone.*; the checkpoint and
    # the official DINO files default to the teacher (the encoder the paper evaluates): so does it.
    from ssl_vit import create_backbone
    from ssl_vit.export import filter_foreign_state_dict
    from ssl_vit.export.sources import read_source

    torch.manual_seed(0)
    student, teacher = create_backbone("vit", **TINY_VIT), create_backbone("vit", **TINY_VIT)
    sd = {**{f"backbone.{k}": v for k, v in student.state_dict().items()}, **{f"teacher_backbone.{k}": v for k, v in teacher.state_dict().items()}}
    model = create_backbone("vit", **TINY_VIT)
    assert torch.equal(filter_foreign_state_dict(sd, model)["pos_embed"], teacher.pos_embed)
    assert torch.equal(filter_foreign_state_dict(sd, model, which="student")["pos_embed"], student.pos_embed)
    torch.save(sd, tmp_path / "dino.pt")
    assert read_source(tmp_path / "dino.pt").which == "teacher"  # and the record says so
    torch.save({f"backbone.{k}": v for k, v in student.state_dict().items()}, tmp_path / "one.pt")
    assert read_source(tmp_path / "one.pt").which is None


def test_a_vit_subclass_is_exported_as_its_own_architecture_not_timms(tmp_path):
    # A registered subclass of our ViT with a layer of its own (a learned-query pooling): timm's
    # ViT of the same arguments would drop that layer, so the export claims no timm architecture
    # or keys, and load_backbone rebuilds the subclass with every weight and its non-persistent buffer.
    from helpers import registered_backbones

    from ssl_vit.backbones import VisionTransformer
    from ssl_vit.export.config import timm_architecture, weights_format

    class PooledViT(VisionTransformer):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.pool_proj = torch.nn.Linear(self.embed_dim, self.embed_dim)
            # state no state dict carries: load.instantiate builds such a backbone off the meta device
            self.register_buffer("shift", torch.linspace(0, 1, self.embed_dim), persistent=False)

        def forward(self, x):
            return self.pool_proj(self.forward_features(x)[:, 1:].mean(1)) + self.shift

    def pooled_vit(img_size: int = 16, patch_size: int = 4, in_chans: int = 1) -> PooledViT:
        return PooledViT(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=32, depth=1, num_heads=2)

    with registered_backbones(pooled_vit_test=pooled_vit):
        torch.manual_seed(0)
        model = create_backbone("pooled_vit_test").eval()
        assert timm_architecture(model) is None and weights_format(model) == "ssl_vit"
        torch.save(model.state_dict(), tmp_path / "weights.pt")
        out = export_backbone(tmp_path / "weights.pt", tmp_path / "exp", backbone="pooled_vit_test").out_dir
        config = json.loads((out / "config.json").read_text())
        assert "architecture" not in config and config["ssl_vit"]["weights_format"] == "ssl_vit"
        torch.testing.assert_close(load_backbone(out)(_x()), model(_x()), rtol=0, atol=0)


# ------------------------------------------------------------------------ mended from a mutation round


def test_a_bad_head_is_refused_before_an_earlier_export_is_touched_and_one_without_bias_stores_zeros(tmp_path):
    # Reference: timm's ViT classifier has a bias; a Linear without one is that classifier at bias 0.
    vit = _vit(3)
    out = save_backbone(vit, tmp_path / "exp").out_dir
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match="the head takes 33 features; the backbone gives 32"):
        save_backbone(vit, out, head=torch.nn.Linear(TINY_VIT["embed_dim"] + 1, 5))
    assert sorted(p.name for p in out.iterdir()) == before and load_backbone(out) is not None
    head = torch.nn.Linear(TINY_VIT["embed_dim"], 5, bias=False)
    save_backbone(vit, tmp_path / "nobias", head=head)
    ref = timm.create_model(f"local-dir:{tmp_path / 'nobias'}", pretrained=True).eval()
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(ref(x), head(vit(x)))


def test_results_given_explicitly_in_a_hidden_folder_are_recorded(tmp_path):
    # The hidden-file rule is for what a folder scan finds below the folder (.ipynb_checkpoints),
    # not for a file or folder the user names.
    (tmp_path / ".eval" / ".ipynb_checkpoints").mkdir(parents=True)
    (tmp_path / ".eval" / "linear.json").write_text(json.dumps({"metrics": {"top1": 0.5}}))
    (tmp_path / ".eval" / ".ipynb_checkpoints" / "linear.json").write_text(json.dumps({"metrics": {"top1": 0.4}}))
    for given in (tmp_path / ".eval" / "linear.json", tmp_path / ".eval"):
        results = save_backbone(_vit(0), tmp_path / "exp", results=[given]).config["ssl_vit"]["results"]
        assert [r["metrics"]["top1"] for r in results] == [0.5], given


def test_the_strict_loader_names_missing_and_unexpected_keys_and_takes_old_batchnorm_files(tmp_path):
    sd = _vit(0).state_dict()
    missing = {k: v for k, v in sd.items() if k != "blocks.1.mlp.fc2.weight"}
    torch.save(missing, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="missing blocks.1.mlp.fc2.weight"):
        load_backbone(tmp_path / "missing.pt", backbone="vit", backbone_kwargs=TINY_VIT)
    deeper = _vit(0, depth=3).state_dict()
    torch.save(deeper, tmp_path / "deeper.pt")
    with pytest.raises(ValueError, match=r"unexpected blocks\.2\."):
        load_backbone(tmp_path / "deeper.pt", backbone="vit", backbone_kwargs=TINY_VIT)
    torch.save({"epoch": 3}, tmp_path / "empty.pt")
    with pytest.raises(ValueError, match="a dict without any weights"):
        load_backbone(tmp_path / "empty.pt", backbone="vit", backbone_kwargs=TINY_VIT)
    # Reference: torchvision's resnet18 state dict as written before BatchNorm counted its batches
    kwargs = {"in_chans": 3, "small_input": False}
    old = {k: v for k, v in torchvision.models.resnet18().state_dict().items() if not k.endswith("num_batches_tracked") and not k.startswith("fc.")}
    torch.save(old, tmp_path / "old_resnet.pt")
    model = load_backbone(tmp_path / "old_resnet.pt", backbone="resnet18", backbone_kwargs=kwargs)
    assert torch.equal(model.state_dict()["conv1.weight"], old["conv1.weight"])


def test_an_official_dino_file_of_the_teacher_alone_and_an_older_dino_checkpoint_give_the_teacher(tmp_path):
    teacher, student = _vit(1), _vit(2)
    picked = filter_foreign_state_dict({"teacher": {f"backbone.{k}": v for k, v in teacher.state_dict().items()}}, _vit(), which="teacher")
    assert all(torch.equal(picked[k], v) for k, v in teacher.state_dict().items())
    # a DINO checkpoint whose record predates default_encoder: DINO's default is its teacher (§3.1)
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    state = {**{f"backbone.{k}": v for k, v in student.state_dict().items()}, **{f"teacher_backbone.{k}": v for k, v in teacher.state_dict().items()}}
    torch.save({"pytorch-lightning_version": "2.6.0", "global_step": 3, "epoch": 0, "state_dict": state,
                "ssl_vit": {"method": "DINO", "backbone": "vit", "backbone_kwargs": dict(TINY_VIT)}}, path)
    model, info = load_any_backbone(path)
    assert info["which"] == "teacher" and torch.equal(model.state_dict()["cls_token"], teacher.state_dict()["cls_token"])


def test_a_re_export_keeps_the_results_and_a_relative_source_is_recorded_absolute(tmp_path, monkeypatch):
    first = save_backbone(_vit(0), tmp_path / "a", results=[_result_file(tmp_path / "r.json", 0.5)])
    again = export_backbone(tmp_path / "a", tmp_path / "b").config["ssl_vit"]["results"]
    assert again == first.config["ssl_vit"]["results"] and [r["metrics"]["top1"] for r in again] == [0.5]
    monkeypatch.chdir(tmp_path)
    assert load_any_backbone("a")[1]["source"] == str((tmp_path / "a").resolve())


def _result_file(path, top1: float):
    path.write_text(json.dumps({"metrics": {"top1": top1}}))
    return path


def test_traced_files_are_staged_inside_the_export_folder_and_take_any_batch(tmp_path, monkeypatch):
    # os.replace is an atomic rename only on one file system: the staging folder is in the export's
    staged = []
    publish = export_save.publish
    monkeypatch.setattr(export_save, "publish", lambda stage, out_dir: staged.append(stage) or publish(stage, out_dir))
    vit = _vit(0)
    out = save_backbone(vit, tmp_path / "exp", formats=["torchscript", "export"]).out_dir
    assert [s.parent for s in staged] == [out] and staged[0].name.startswith(".staging-")  # hidden: not a result folder
    program = torch.export.load(str(out / "model.pt2")).module()
    x = _x(b=5)
    with torch.no_grad():
        torch.testing.assert_close(program(x), vit(x), atol=1e-5, rtol=0)


def test_the_export_cli_checks_its_kwargs_and_honours_weights_only(tmp_path, capsys):
    from ssl_vit.cli.export import _earlier_export, build_parser

    assert build_parser().parse_args(["x", "--out", "y"]).tolerance == 1e-4
    torch.save(_vit(0).state_dict(), tmp_path / "sd.pt")
    with pytest.raises(SystemExit) as stop:
        cli.main(["export", str(tmp_path / "sd.pt"), "--out", str(tmp_path / "o"), "--arch", "vit", "--backbone-kwargs", "[4]"])
    assert stop.value.code == 2
    assert "expected a JSON object" in capsys.readouterr().err
    torch.save({"model": _vit(0).state_dict(), "args": argparse.Namespace(lr=0.1)}, tmp_path / "pickled.pt")
    assert cli.main(["export", str(tmp_path / "pickled.pt"), "--out", str(tmp_path / "o"), "--arch", "vit", "--backbone-kwargs",
                     json.dumps(TINY_VIT), "--weights-only"]) == 1
    assert "weights_only=True refuses" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"ssl_vit": None}))
    assert _earlier_export(str(tmp_path / "other")) is None


def test_timm_names_a_non_square_vit_by_its_sizes_first_entry_point_and_a_safetensors_file_records_its_encoder(tmp_path):
    from ssl_vit.export.config import timm_vit_name
    from ssl_vit.export.files import save_safetensors

    # timm has vit_small_patch8_224 and vit_small_patch16_224; no entry point is of 224x160 images
    assert timm_vit_name(384, 12, 6, 8, (224, 224)) == "vit_small_patch8_224"
    assert timm_vit_name(384, 12, 6, 8, (224, 160)) == "vit_small_patch16_224"
    teacher, student = _vit(1), _vit(2)
    state = {**{f"backbone.{k}": v for k, v in student.state_dict().items()}, **{f"teacher_backbone.{k}": v for k, v in teacher.state_dict().items()}}
    save_safetensors(tmp_path / "dino.safetensors", state)
    model, info = load_any_backbone(tmp_path / "dino.safetensors", backbone="vit", backbone_kwargs=TINY_VIT)
    assert info["which"] == "teacher" and torch.equal(model.state_dict()["cls_token"], teacher.state_dict()["cls_token"])


@pytest.mark.parametrize("writer", ["write_torchscript", "write_exported_program"])
def test_a_traced_file_that_does_not_fit_on_the_disk_is_an_os_error(tmp_path, writer):
    """A full disk (here a file-size limit of 8 KiB: writes past it fail with EFBIG) while writing
    TorchScript or torch.export: torch's own writers abort the whole process from C++ there."""
    setup = ("import pathlib\nfrom ssl_vit.backbones import create_backbone\nfrom ssl_vit.export import traced\n"
             "model = create_backbone('vit', img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2).eval()")
    run = under_file_size_limit(8192, setup, f"traced.{writer}(model, pathlib.Path(sys.argv[1]), 1e-4)", str(tmp_path))
    assert run.returncode == 0 and f"refused {errno.EFBIG}" in run.stdout, run.stderr[-2000:]
    name = "model.torchscript.pt" if writer == "write_torchscript" else "model.pt2"
    assert f"cannot write {tmp_path / name}: File too large" in run.stdout


def test_a_traced_file_refused_by_the_disk_is_named_where_it_would_have_been(monkeypatch, tmp_path):
    # files.py staging_dir: the traced files are written into a staging folder removed right
    # after; the error names the file the export would have made, not that folder.
    from ssl_vit.io import writing

    def full_disk(model, stage, tolerance):
        with writing(stage / "model.torchscript.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")

    def denied(model, stage, tolerance):
        raise PermissionError(errno.EACCES, "Permission denied", str(stage / "model.pt2"))

    monkeypatch.setattr(export_save, "write_torchscript", full_disk)
    monkeypatch.setattr(export_save, "write_exported_program", denied)
    out = tmp_path / "exp"
    out.mkdir()
    with pytest.raises(OSError) as refused:
        save_backbone(_vit(0), out, formats=["torchscript"])
    assert str(refused.value) == f"[Errno 28] cannot write {out / 'model.torchscript.pt'}: No space left on device"
    with pytest.raises(OSError) as refused:
        save_backbone(_vit(0), out, formats=["export"])
    assert refused.value.errno == errno.EACCES and refused.value.filename == str(out / "model.pt2")
    assert ".staging" not in str(refused.value)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_a_library_error_quoted_in_a_read_error_is_its_first_line_capped_at_200_characters():
    # files.py first_line: the cause inside "PATH: cannot be read ... (CAUSE)" stays one line and
    # short; terminal colour codes go; an empty message gives the exception's type.
    from ssl_vit.export.files import first_line

    assert first_line(RuntimeError("\x1b[31mbad magic\x1b[0m\n  at frame 3")) == "bad magic"
    capped = first_line("x" * 300)
    assert len(capped) == 200 and capped == "x" * 197 + "..."
    assert first_line("y" * 200) == "y" * 200
    assert first_line(EOFError()) == "EOFError"


def test_a_checkpoint_without_a_record_of_its_kwargs_is_built_from_its_hyperparameters(tmp_path):
    # sources.py: a checkpoint whose ssl_vit record lacks backbone_kwargs (or has no record: one
    # saved by a LightningModule of one's own) takes them from Lightning's hyper_parameters.
    model = _vit(3)
    hparams = {"backbone": "vit", "backbone_kwargs": TINY_VIT}
    for name, record in (("bare.ckpt", {}), ("partial.ckpt", {"ssl_vit": {"method": "MPP"}})):
        torch.save({"pytorch-lightning_version": "2.6.0", "global_step": 3, "epoch": 0, "hyper_parameters": hparams,
                    "state_dict": {f"backbone.{k}": v for k, v in model.state_dict().items()}, **record}, tmp_path / name)
    for name in ("bare.ckpt", "partial.ckpt"):
        torch.testing.assert_close(load_backbone(tmp_path / name)(_x()), model(_x()), rtol=0, atol=0)


def test_results_are_collected_from_a_run_folder_only(tmp_path):
    # config.py run_directory: <run>/checkpoints/last.ckpt gives <run>'s result records; a
    # checkpoint elsewhere gives none of the JSON files around it (its folder may hold anything).
    from ssl_vit.eval.results import EvalResult

    record = EvalResult("supervised", {"name": "vit"}, {"name": "synthetic"}, "knn", {"top1": 0.5}, pretrain={"steps": 3}).to_dict()
    for folder in ("run/checkpoints", "loose"):
        _lightning_ckpt(tmp_path / folder / "last.ckpt", _vit(3))
    (tmp_path / "run" / "results").mkdir()
    (tmp_path / "run" / "results" / "knn.json").write_text(json.dumps(record))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "knn.json").write_text(json.dumps(record))
    (tmp_path / "loose" / "knn.json").write_text(json.dumps(record))
    ran = export_backbone(tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "exp1").config["ssl_vit"]["results"]
    assert [r["file"] for r in ran] == [str(tmp_path / "run" / "results" / "knn.json")]
    assert export_backbone(tmp_path / "loose" / "last.ckpt", tmp_path / "exp2").config["ssl_vit"]["results"] == []


def test_load_backbone_reads_files_and_sends_random_weights_elsewhere(tmp_path):
    # load.py load_backbone: "random:NAME" (a baseline, no file) is load_any_backbone's
    for spec in ("random", "random:vit"):
        with pytest.raises(ValueError, match=f"load_backbone reads weights from a path; for '{spec}' use load_any_backbone"):
            load_backbone(spec, backbone_kwargs=TINY_VIT)


def test_a_text_file_with_a_brace_where_a_safetensors_header_starts_is_text(tmp_path):
    # files.py sniff: safetensors is an 8-byte header length below the file size, then "{"; a
    # text file with "{" at byte 8 reads as a huge length and stays a text file.
    from ssl_vit.export.files import sniff

    notes = tmp_path / "notes.pt"
    notes.write_bytes(b"notes:  {lr: 0.1}\n")
    assert sniff(notes) == "text"
    with pytest.raises(ValueError, match="a text file; expected"):
        load_backbone(notes, backbone="vit", backbone_kwargs=TINY_VIT)


def test_a_plugin_backbone_with_its_own_fc_layer_round_trips(tmp_path):
    # foreign.py fit_state_dict drops classifier keys (head., fc., ...) only where the model has
    # no such weights: a registered backbone whose last layer is named fc keeps it.
    from helpers import registered_backbones

    class WithFc(torch.nn.Module):
        def __init__(self, img_size: int = 8, in_chans: int = 1) -> None:
            super().__init__()
            self.img_size, self.in_chans, self.embed_dim = (img_size, img_size), in_chans, 4
            self.fc = torch.nn.Linear(in_chans * img_size * img_size, 4)

        def forward_features(self, x):  # [B, 1, 4]
            return self.fc(x.flatten(1))[:, None]

        def forward(self, x):  # [B, 4]
            return self.forward_features(x)[:, 0]

    with registered_backbones(with_fc_test=WithFc):
        torch.manual_seed(0)
        model = create_backbone("with_fc_test").eval()
        out = save_backbone(model, tmp_path / "exp").out_dir
        x = torch.randn(2, 1, 8, 8)
        torch.testing.assert_close(load_backbone(out)(x), model(x), rtol=0, atol=0)
