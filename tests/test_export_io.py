"""Reading and writing weights without a training run: foreign layouts (timm, torchvision, the
official DINO and MoCo v3 checkpoints) against those libraries' own models, every file a user may
pass with its one-line error, the strict loader, the evaluation results an export records, and the
export folder's atomicity (``io.py``: ``os.replace``, ``hashlib``, ``os.stat``, a file-size limit
standing in for a full disk) with the traced copies' checks."""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import stat
import warnings

import pytest
import torch
import torchvision
from helpers import TINY_VIT, registered_backbones, under_file_size_limit
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer as TimmViT

import ssl_vit.export.save as export_save
from ssl_vit import cli, create_backbone
from ssl_vit.eval.results import EvalResult
from ssl_vit.export import (
    BackboneSource,
    ExportParityError,
    export_backbone,
    filter_foreign_state_dict,
    load_any_backbone,
    load_backbone,
    save_backbone,
)
from ssl_vit.export.load import read_source, read_torch_file
from ssl_vit.export.traced import check_parity
from ssl_vit.io import atomic_write, atomic_write_json, stale_temporaries, writing


def _x(c: int = 1, h: int = 16, w: int = 16, b: int = 3) -> torch.Tensor:
    return torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(7))


def _vit(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_backbone("vit", **{**TINY_VIT, **overrides}).eval()


def _prefixed(prefix: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{prefix}{k}": v for k, v in model.state_dict().items()}


def _same(state: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    return all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def _config(out) -> dict:
    return json.loads((out / "config.json").read_text())


def _lightning_ckpt(path, state: dict[str, torch.Tensor], step: int = 3, method: str = "Supervised", **fields):
    """What ``ssl-vit fit`` writes, reduced to the fields the readers use."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"pytorch-lightning_version": "2.6.0", "global_step": step, "epoch": 0, "state_dict": state,
                "ssl_vit": {"method": method, "backbone": "vit", "backbone_kwargs": dict(TINY_VIT)}, **fields}, path)
    return path


# ------------------------------------------------------------------------ foreign layouts


def test_a_timm_state_dict_loads_without_its_classifier_and_rgb_weights_fit_a_grey_model(tmp_path):
    # Reference: timm's ViT with a classifier, plus the classifier-side parameters no backbone of
    # ours has (fc_norm, pre_logits): what remains loads strictly and gives timm's pre-logits features;
    # into a grey backbone the patch filters are summed (adapt_input_conv): the RGB model on x repeated.
    torch.manual_seed(0)
    timm_vit = TimmViT(**{**TINY_VIT, "in_chans": 3}, num_classes=5).eval()
    state = timm_vit.state_dict() | {"fc_norm.weight": torch.ones(32), "fc_norm.bias": torch.zeros(32), "pre_logits.fc.weight": torch.zeros(32, 32)}
    rgb = _vit(0, in_chans=3)
    filtered = filter_foreign_state_dict(state, rgb)
    assert set(filtered) == set(rgb.state_dict())
    rgb.load_state_dict(filtered, strict=True)
    x = _x(3)
    torch.testing.assert_close(rgb(x), timm_vit.forward_head(timm_vit.forward_features(x), pre_logits=True))
    torch.save(state, tmp_path / "timm_vit.pth")
    grey, info = load_any_backbone(tmp_path / "timm_vit.pth", backbone="vit", backbone_kwargs=TINY_VIT)
    assert info["kind"] == "state_dict"
    torch.testing.assert_close(grey(_x()), timm_vit.forward_head(timm_vit.forward_features(_x().repeat(1, 3, 1, 1)), pre_logits=True),
                               atol=1e-5, rtol=1e-5)
    # timm's no_embed_class=True: no position for [CLS], the same as a zero one
    no_cls = TimmViT(**TINY_VIT, num_classes=0, no_embed_class=True).eval()
    ours = _vit()
    ours.load_state_dict(filter_foreign_state_dict(no_cls.state_dict(), ours), strict=True)
    torch.testing.assert_close(ours(_x()), no_cls(_x()))


def test_rgb_torchvision_weights_into_a_grey_resnet_sum_the_stem_filters():
    torch.manual_seed(0)
    tv = torchvision.models.resnet18().eval()
    grey = create_backbone("resnet18", in_chans=1, img_size=32).eval()
    grey.load_state_dict(filter_foreign_state_dict(tv.state_dict(), grey), strict=True)
    tv.fc = torch.nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(grey(_x(1, 32, 32, b=2)), tv(_x(1, 32, 32, b=2).repeat(1, 3, 1, 1)), atol=1e-5, rtol=1e-5)


def test_official_dino_checkpoints_give_the_teacher_by_default(tmp_path):
    # main_dino.py's save_dict: {"teacher", "student"} with backbone. / module.backbone. prefixes and
    # the DINO heads beside them; a file of the student alone gives it on request and names what it
    # lacks otherwise; "module." is stripped only when every key has it (a DDP-wrapped state dict).
    teacher, student = _vit(10), _vit(11)
    ckpt = {"student": {**_prefixed("module.backbone.", student), "module.head.mlp.0.weight": torch.zeros(8, 32)},
            "teacher": {**_prefixed("backbone.", teacher), "head.last_layer.weight_g": torch.ones(64, 1)}, "epoch": 100}
    torch.save(ckpt, tmp_path / "dino_deit_tiny_full_checkpoint.pth")
    for which, expected in ((None, teacher), ("student", student)):
        model = load_backbone(tmp_path / "dino_deit_tiny_full_checkpoint.pth", which=which, backbone="vit", backbone_kwargs=TINY_VIT)
        torch.testing.assert_close(model(_x()), expected(_x()), rtol=0, atol=0)
    assert _same(filter_foreign_state_dict({"teacher": ckpt["teacher"]}, _vit(), which="teacher"), teacher)
    alone = {"student": ckpt["student"], "epoch": 100}
    assert _same(filter_foreign_state_dict(alone, _vit(), which="student"), student)
    with pytest.raises(ValueError, match=r"DINO checkpoint has no 'teacher' entry \(it has student, epoch\)"):
        filter_foreign_state_dict(alone, _vit())
    stray = {**_prefixed("backbone.", student), "module.stray": torch.zeros(1)}
    assert _same(filter_foreign_state_dict(stray, _vit()), student)


def test_official_mocov3_checkpoints_give_the_base_encoder_by_default(tmp_path):
    # main_moco.py's checkpoint: module.base_encoder. / module.momentum_encoder. with the projector
    # as head.* (dropped, as convert_to_deit.py does) and a predictor.
    base, momentum = _vit(20), _vit(21)
    head = {"head.0.weight": torch.zeros(16, 32), "head.1.running_mean": torch.zeros(16)}
    state = {f"module.base_encoder.{k}": v for k, v in {**base.state_dict(), **head}.items()}
    state |= {f"module.momentum_encoder.{k}": v for k, v in {**momentum.state_dict(), **head}.items()}
    state["module.predictor.0.weight"] = torch.zeros(16, 16)
    torch.save({"epoch": 300, "arch": "vit_small", "state_dict": state, "optimizer": {}}, tmp_path / "vit-s-300ep.pth.tar")
    for which, expected in ((None, base), ("momentum", momentum)):
        model, info = load_any_backbone(tmp_path / "vit-s-300ep.pth.tar", which=which, backbone="vit", backbone_kwargs=TINY_VIT)
        torch.testing.assert_close(model(_x()), expected(_x()), rtol=0, atol=0)
        assert info["kind"] == "state_dict"


def test_a_bare_state_dict_of_our_two_encoder_checkpoints_gives_the_one_asked_for(tmp_path):
    # Our DINO's state dict gives its teacher by default, as its checkpoint and the official files
    # do (the encoder the paper evaluates), and the reader records which; MoCo v3's the online one.
    online, other = _vit(1), _vit(2)
    for prefix, which in (("momentum_backbone.", "momentum"), ("teacher_backbone.", "teacher")):
        sd = {**_prefixed("backbone.", online), **_prefixed(prefix, other)}
        assert _same(filter_foreign_state_dict(sd, _vit(), which=which), other)
        assert _same(filter_foreign_state_dict(sd, _vit(), which="student"), online)
        assert _same(filter_foreign_state_dict(sd, _vit()), other if which == "teacher" else online)
    torch.save({**_prefixed("backbone.", online), **_prefixed("teacher_backbone.", other)}, tmp_path / "dino.pt")
    assert read_source(tmp_path / "dino.pt").which == "teacher"
    torch.save(_prefixed("backbone.", online), tmp_path / "one.pt")
    assert read_source(tmp_path / "one.pt").which is None
    save_file({**_prefixed("backbone.", online), **_prefixed("teacher_backbone.", other)}, tmp_path / "dino.safetensors")
    model, info = load_any_backbone(tmp_path / "dino.safetensors", backbone="vit", backbone_kwargs=TINY_VIT)
    assert info["which"] == "teacher" and _same(model.state_dict(), other)


@pytest.mark.parametrize(("state", "which", "message"), [
    ({"state_dict": {"module.base_encoder.w": torch.zeros(1)}}, "teacher", "this is a MoCo v3 checkpoint: choose student"),
    ({"backbone.w": torch.zeros(1)}, "teacher", r"no teacher_backbone\.\* weights"),  # backbone.* is the online encoder, not a teacher
    ({"backbone.w": torch.zeros(1), "momentum_backbone.w": torch.zeros(1)}, "teacher", r"no teacher_backbone\.\* weights"),
    ({"backbone.w": torch.zeros(1)}, "momentum", r"no momentum_backbone\.\* / momentum_encoder\.\* weights"),
    ({"teacher": {}, "student": {}}, "momentum", "this DINO checkpoint holds a teacher and a student"),
])
def test_an_encoder_the_weights_lack_is_refused_not_replaced_by_another(state, which, message):
    with pytest.raises(ValueError, match=message):
        filter_foreign_state_dict(state, _vit(), which=which)


def test_half_precision_weights_load_into_a_float32_backbone(tmp_path):
    vit = _vit(7)
    half = {k: v.half() for k, v in vit.state_dict().items()}
    torch.save(half, tmp_path / "half.pth")
    model = load_backbone(tmp_path / "half.pth", backbone="vit", backbone_kwargs=TINY_VIT)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ref = _vit(0)
    ref.load_state_dict({k: v.float() for k, v in half.items()})
    torch.testing.assert_close(model(_x()), ref(_x()), rtol=0, atol=0)


def test_position_tables_follow_the_grid_they_were_made_for(tmp_path):
    # A non-square export (4 x 6 grid: 1 + 24 positions, not 1 + a square) reloads at 32 px from its
    # own grid (Reference: timm's resample_abs_pos_embed); a fixed sin-cos table, a function of the
    # grid alone (MoCo v3 §4.2), is recomputed, not resampled.
    out = save_backbone(_vit(0, img_size=[16, 24]), tmp_path / "rect").out_dir
    model = load_backbone(out, backbone_kwargs={"img_size": 32})
    stored = load_file(out / "model.safetensors")["pos_embed"]
    torch.testing.assert_close(model.pos_embed.detach(), resample_abs_pos_embed(stored, (8, 8), (4, 6), num_prefix_tokens=1))
    out = save_backbone(_vit(0, pos_embed="sincos"), tmp_path / "sincos").out_dir
    built = create_backbone("vit", **{**TINY_VIT, "pos_embed": "sincos", "img_size": 24})
    torch.testing.assert_close(load_backbone(out, backbone_kwargs={"img_size": 24}).pos_embed.detach(), built.pos_embed.detach(), rtol=0, atol=1e-6)
    resampled = resample_abs_pos_embed(load_file(out / "model.safetensors")["pos_embed"], (6, 6), (4, 4), num_prefix_tokens=1)
    assert not torch.allclose(resampled, built.pos_embed.detach(), atol=1e-3)


# ------------------------------------------------------------------------ files and their errors


def _truncated(path):
    torch.save(_vit(0).state_dict(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(("make", "kwargs", "error", "expected"), [
    (None, {}, FileNotFoundError, "no such file"),
    (lambda p: p.write_text("epochs: 10\nlr: 0.1\n"), {}, ValueError, "a text file; expected a pretraining checkpoint"),
    (lambda p: p.write_bytes(b"notes:  {lr: 0.1}\n"), {}, ValueError, "a text file; expected"),  # "{" where a safetensors header starts
    (_truncated, {}, ValueError, "probably truncated or corrupt"),
    # a legacy (pickle) file cut in its header: the loader fails with struct.error
    (lambda p: p.write_bytes(b"\x80\x02}q\x00(X\x01"), {}, ValueError, r"truncated or corrupt \(unpack requires a buffer of 4 bytes\)"),
    (lambda p: p.write_bytes(b"\x00" * 16), {}, ValueError, "not a PyTorch file; expected"),
    (lambda p: torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {"layer.weight": torch.zeros(2, 2)}}, p), {}, ValueError,
     "not of an ssl_vit pretext module.*expected a checkpoint written by `ssl-vit fit`"),
    (lambda p: torch.save([1, 2, 3], p), {}, ValueError, "holds a list, not a checkpoint"),
    (lambda p: torch.save({"epoch": 3}, p), {"backbone": "vit"}, ValueError, "a dict without any weights"),
    (lambda p: torch.save(_vit(0).state_dict(), p), {}, ValueError, "without a record of its architecture; name it: --arch NAME --backbone-kwargs JSON"),
    (lambda p: _lightning_ckpt(p, _prefixed("backbone.", _vit(0))), {"backbone": "resnet18"}, ValueError, "holds a 'vit' backbone, not 'resnet18'"),
    (lambda p: torch.save(_vit(0, embed_dim=64).state_dict(), p), {"backbone": "vit", "backbone_kwargs": TINY_VIT}, ValueError,
     r"shape mismatch cls_token \(1, 1, 64\) vs \(1, 1, 32\), pos_embed \(1, 17, 64\) vs \(1, 17, 32\) \(\+28 more\)$"),
    # of another width and another grid too (16x24 images: 1 + 24 tokens): the same one line
    (lambda p: torch.save(_vit(0, embed_dim=64, img_size=[16, 24]).state_dict(), p), {"backbone": "vit", "backbone_kwargs": TINY_VIT}, ValueError,
     r"shape mismatch cls_token \(1, 1, 64\) vs \(1, 1, 32\), pos_embed \(1, 25, 64\) vs \(1, 17, 32\)"),
    (lambda p: torch.save({k: v for k, v in _vit(0).state_dict().items() if k != "blocks.1.mlp.fc2.weight"}, p),
     {"backbone": "vit", "backbone_kwargs": TINY_VIT}, ValueError, "missing blocks.1.mlp.fc2.weight"),
    (lambda p: torch.save(_vit(0, depth=3).state_dict(), p), {"backbone": "vit", "backbone_kwargs": TINY_VIT}, ValueError, r"unexpected blocks\.2\."),
], ids=["missing", "text", "brace_at_byte_8", "truncated", "cut_legacy", "zeros", "other_lightning", "list", "no_weights", "bare_state_dict",
        "other_arch", "wider", "wider_other_grid", "missing_key", "unexpected_key"])
def test_a_file_that_holds_no_such_backbone_is_a_one_line_error_naming_it(make, kwargs, error, expected, tmp_path):
    path = tmp_path / "model.ckpt"
    if make is not None:
        make(path)
    with pytest.raises(error, match=expected) as info:
        load_backbone(path, **kwargs)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_old_and_legacy_files_load(tmp_path):
    # Reference: torch.save's pre-1.6 format (a pickle stream, no zip archive), and torchvision's
    # resnet18 as written before BatchNorm counted its batches (no num_batches_tracked).
    vit = _vit(5)
    torch.save(vit.state_dict(), tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    assert (tmp_path / "legacy.pth").read_bytes()[:1] == b"\x80"
    torch.testing.assert_close(load_backbone(tmp_path / "legacy.pth", backbone="vit", backbone_kwargs=TINY_VIT)(_x()), vit(_x()), rtol=0, atol=0)
    old = {k: v for k, v in torchvision.models.resnet18().state_dict().items() if not k.endswith("num_batches_tracked") and not k.startswith("fc.")}
    torch.save(old, tmp_path / "old_resnet.pt")
    model = load_backbone(tmp_path / "old_resnet.pt", backbone="resnet18", backbone_kwargs={"in_chans": 3, "small_input": False})
    assert torch.equal(model.state_dict()["conv1.weight"], old["conv1.weight"])


def test_python_objects_besides_tensors_are_unpickled_with_a_warning_or_refused_on_request(tmp_path, capsys):
    # Reference: torch.load(weights_only=True) takes a plain state dict and refuses an
    # argparse.Namespace (as the official DINO / MoCo v3 checkpoints hold); None falls back to full
    # unpickling with a warning, True (--weights-only) refuses.
    vit = _vit(6)
    plain, objects = tmp_path / "plain.pth", tmp_path / "objects.pth"
    torch.save(vit.state_dict(), plain)
    torch.save({"model": vit.state_dict(), "args": argparse.Namespace(arch="vit_tiny")}, objects)
    with pytest.raises(Exception, match="(?i)weights.only"):
        torch.load(objects, weights_only=True)
    kw = {"backbone": "vit", "backbone_kwargs": TINY_VIT}
    for path, warned in ((plain, 0), (objects, 1)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = load_backbone(path, **kw)
        assert len([w for w in caught if "full unpickling" in str(w.message)]) == warned
        torch.testing.assert_close(model(_x()), vit(_x()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="holds Python objects besides tensors, which weights_only=True refuses"):
        load_backbone(objects, weights_only=True, **kw)
    args = [str(objects), "--out", str(tmp_path / "exp"), "--arch", "vit", "--backbone-kwargs", json.dumps(TINY_VIT)]
    assert cli.main(["export", *args, "--weights-only"]) == 1
    assert "holds Python objects besides tensors" in capsys.readouterr().err and not (tmp_path / "exp").exists()
    with pytest.warns(UserWarning, match="full unpickling"):
        assert cli.main(["export", *args]) == 0
    save_file({"w": torch.zeros(2)}, tmp_path / "w.pt")  # a safetensors file handed to the torch reader is named so
    with pytest.raises(ValueError, match="a safetensors file; expected"):
        read_torch_file(tmp_path / "w.pt")


def test_checkpoints_of_our_own_and_of_other_tools_are_read_by_their_record_or_hyperparameters(tmp_path):
    # A checkpoint with ssl_vit run info is ours even when another tool re-saved it without
    # Lightning's version field ("online" / "base" name the student); one without it (a
    # LightningModule of one's own) or without the backbone's kwargs takes them from Lightning's
    # hyper_parameters; an older DINO record without default_encoder still gives the teacher (§3.1).
    vit, teacher = _vit(4), _vit(5)
    ckpt = torch.load(_lightning_ckpt(tmp_path / "run.ckpt", _prefixed("backbone.", vit), step=6), weights_only=False)
    del ckpt["pytorch-lightning_version"]
    torch.save(ckpt, tmp_path / "resaved.ckpt")
    for which in ("online", "base"):
        model, info = load_any_backbone(tmp_path / "resaved.ckpt", which=which)
        assert (info["kind"], info["which"], info["method"], info["pretrain"]["steps"]) == ("lightning", "student", "supervised", 6)
        torch.testing.assert_close(model(_x()), vit(_x()), rtol=0, atol=0)
    hparams = {"backbone": "vit", "backbone_kwargs": TINY_VIT}
    for name, record in (("bare.ckpt", {}), ("partial.ckpt", {"ssl_vit": {"method": "MPP"}})):
        torch.save({"pytorch-lightning_version": "2.6.0", "global_step": 3, "epoch": 0, "hyper_parameters": hparams,
                    "state_dict": _prefixed("backbone.", vit), **record}, tmp_path / name)
        torch.testing.assert_close(load_backbone(tmp_path / name)(_x()), vit(_x()), rtol=0, atol=0)
    _lightning_ckpt(tmp_path / "dino.ckpt", {**_prefixed("backbone.", vit), **_prefixed("teacher_backbone.", teacher)}, method="DINO")
    model, info = load_any_backbone(tmp_path / "dino.ckpt")
    assert info["which"] == "teacher" and torch.equal(model.state_dict()["cls_token"], teacher.state_dict()["cls_token"])


def test_an_export_is_read_whole_and_holds_only_its_own_encoder(tmp_path, monkeypatch):
    # model.safetensors beside an ssl_vit config.json is that export (not a bare state dict that
    # needs --arch); asking it for another encoder is an error; a relative path is recorded absolute.
    source = BackboneSource({}, "vit", dict(TINY_VIT), "memory", "memory", which="teacher", normalization={"mean": [0.2], "std": [0.3]})
    out = save_backbone(_vit(1), tmp_path / "exp", source).out_dir
    _, info = load_any_backbone(out / "model.safetensors")
    assert (info["kind"], info["name"], info["mean"], info["which"]) == ("export", "vit", [0.2], "teacher")
    with pytest.raises(ValueError, match="this export holds the teacher backbone; which='student' is not in it"):
        load_any_backbone(out, which="student")
    monkeypatch.chdir(tmp_path)
    assert load_any_backbone("exp")[1]["source"] == str(out.resolve())


def test_a_random_initialisation_is_seeded_leaves_the_global_generator_alone_and_is_no_path():
    # Reference: torch.manual_seed(seed) then create_backbone gives the same weights; the caller's
    # generator is untouched (fork_rng); load_backbone reads files only.
    torch.manual_seed(123)
    state = torch.get_rng_state()
    model, info = load_any_backbone("random:vit", backbone_kwargs=TINY_VIT, seed=5)
    assert torch.equal(torch.get_rng_state(), state) and info["kind"] == "random" and not model.training
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        assert _same(model.state_dict(), create_backbone("vit", **TINY_VIT))
    for spec in ("random", "random:vit"):
        with pytest.raises(ValueError, match=f"load_backbone reads weights from a path; for '{spec}' use load_any_backbone"):
            load_backbone(spec, backbone_kwargs=TINY_VIT)


def test_a_plugin_backbone_with_its_own_fc_layer_round_trips(tmp_path):
    # Classifier keys (head., fc., ...) are dropped only where the model has no such weights.
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


# ------------------------------------------------------------------------ results in config.json


def _result(path, top1: float, steps: int | None = None, encoder: str | None = None):
    backbone = {"name": "vit", **({"encoder": encoder} if encoder else {})}
    record = EvalResult("supervised", backbone, {"name": "synthetic"}, "knn", {"top1": top1}, pretrain={"steps": steps} if steps else {})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record.to_dict()))
    return path


def _top1(result) -> list[float]:
    return sorted(r["metrics"]["top1"] for r in result.config["ssl_vit"]["results"])


def test_results_of_the_run_folder_are_collected_once_and_only_from_a_run_folder(tmp_path):
    # <run>/checkpoints/last.ckpt: the run's results beside checkpoints/, not those inside it, not
    # hidden copies (Jupyter's .ipynb_checkpoints), not JSON files without metrics or not JSON; a
    # result the source (an export) records already is not recorded twice; a checkpoint elsewhere
    # gives none of the JSON files around it (its folder may hold anything).
    run = tmp_path / "run"
    ckpt = _lightning_ckpt(run / "checkpoints" / "last.ckpt", _prefixed("backbone.", _vit(0)))
    for rel, top1 in (("eval/knn.json", 0.5), ("eval/.ipynb_checkpoints/knn-checkpoint.json", 0.4), ("checkpoints/probe.json", 0.3)):
        _result(run / rel, top1)
    (run / "notes.json").write_text(json.dumps({"lr": 0.1}))
    (run / "bad.json").write_text("{not json")
    first = export_backbone(ckpt, tmp_path / "exp").config["ssl_vit"]["results"]
    assert [(r["metrics"]["top1"], r["file"]) for r in first] == [(0.5, str(run / "eval" / "knn.json"))]
    again = export_backbone(tmp_path / "exp", tmp_path / "exp2", results=[run / "eval" / "knn.json"]).config["ssl_vit"]["results"]
    assert again == first
    loose = _lightning_ckpt(tmp_path / "loose" / "last.ckpt", _prefixed("backbone.", _vit(0)))
    _result(tmp_path / "loose" / "knn.json", 0.5)
    _result(tmp_path / "results" / "knn.json", 0.5)
    assert _top1(export_backbone(loose, tmp_path / "exp3")) == []


def test_results_of_an_earlier_checkpoint_or_another_encoder_are_not_credited_to_the_export(tmp_path):
    # A run evaluated at step 6 and resumed to step 12 overwrote last.ckpt; the step-6 result still
    # names that file. A MoCo v3 run evaluated its online encoder and, with --which momentum, its
    # momentum encoder (results naming it). Expectation by hand: each export keeps its own step's
    # and encoder's results and those that say neither; a file named explicitly is the user's word
    # (whatever step), refused when not a result or of another encoder.
    vit = _vit(0)
    ckpt = _lightning_ckpt(tmp_path / "run" / "checkpoints" / "last.ckpt", {**_prefixed("backbone.", vit), **_prefixed("momentum_backbone.", vit)},
                           step=12, method="MoCoV3")
    results = tmp_path / "run" / "results"
    _result(results / "knn.json", 0.5, steps=6)
    _result(results / "knn_2.json", 0.6, steps=12)
    _result(results / "knn_momentum.json", 0.4, steps=12, encoder="momentum")
    (results / "plain.json").write_text(json.dumps({"metrics": {"top1": 0.7}}))
    assert _top1(export_backbone(ckpt, tmp_path / "online")) == [0.6, 0.7]
    assert _top1(export_backbone(ckpt, tmp_path / "momentum", which="momentum")) == [0.4, 0.7]
    step6 = tmp_path / "step6.json"
    step6.write_text((results / "knn.json").read_text())
    assert _top1(export_backbone(ckpt, tmp_path / "exp", results=[step6])) == [0.5, 0.6, 0.7]
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "notes.json").write_text(json.dumps({"lr": 0.1}))
    for given, message in (("bad.json", r"bad.json: not valid JSON"), ("notes.json", r"notes.json: not an evaluation result"),
                           ("missing.json", "missing.json: no such result file or folder")):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            export_backbone(ckpt, tmp_path / "exp", results=[tmp_path / given])
    with pytest.raises(ValueError, match=r"knn_2\.json: a result of the default encoder of its checkpoint; this export is of the momentum one"):
        export_backbone(ckpt, tmp_path / "momentum2", which="momentum", results=[results / "knn_2.json"])


def test_results_given_explicitly_in_a_hidden_folder_are_recorded(tmp_path):
    # The hidden-file rule is for what a folder scan finds below the folder, not for what the user names.
    (tmp_path / ".eval" / ".ipynb_checkpoints").mkdir(parents=True)
    (tmp_path / ".eval" / "linear.json").write_text(json.dumps({"metrics": {"top1": 0.5}}))
    (tmp_path / ".eval" / ".ipynb_checkpoints" / "linear.json").write_text(json.dumps({"metrics": {"top1": 0.4}}))
    for given in (tmp_path / ".eval" / "linear.json", tmp_path / ".eval"):
        assert _top1(save_backbone(_vit(0), tmp_path / "exp", results=[given])) == [0.5], given


# ------------------------------------------------------------------------ the export folder


def test_file_records_are_the_sha256_and_size_of_the_bytes_on_disk_with_the_permissions_of_a_plain_open(tmp_path):
    # Reference: hashlib.sha256 and os.stat; a file created with open() under umask 022 is 0644
    # (mkstemp's 0600 would hide an export from the rest of a group sharing it).
    old = os.umask(0o022)
    try:
        out = save_backbone(_vit(), tmp_path / "exp", formats=["torchscript"]).out_dir
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(old)
    files = _config(out)["ssl_vit"]["files"]
    assert set(files) == {"model.safetensors", "model.torchscript.pt"}
    data = (out / "model.safetensors").read_bytes()
    assert files["model.safetensors"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert files["model.safetensors"]["bytes"] == len(data) == os.stat(out / "model.safetensors").st_size
    expected = stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)
    assert expected == 0o644
    for name in ("model.safetensors", "config.json", "model.torchscript.pt"):
        assert stat.S_IMODE((out / name).stat().st_mode) == expected, name


class _Wrong:
    """A torch.jit.trace that traces another network (different weights)."""

    def __init__(self, other: torch.nn.Module) -> None:
        self.other, self.real = other, torch.jit.trace

    def __call__(self, m, x, **kw):
        return self.real(self.other, x, **kw)


def test_a_trace_that_disagrees_leaves_no_file_and_a_failed_re_export_no_config(monkeypatch, tmp_path):
    # config.json goes first and comes last: a failed re-export is refused by the loader rather
    # than mixing old and new files; the staging folder is removed whatever happens.
    monkeypatch.setattr(torch.jit, "trace", _Wrong(_vit(2)))
    with pytest.raises(ExportParityError, match=r"TorchScript model.torchscript.pt: outputs differ .* > tolerance"):
        save_backbone(_vit(1), tmp_path / "exp", formats=["torchscript"])
    assert not (tmp_path / "exp").exists()
    monkeypatch.undo()
    out = save_backbone(_vit(0), tmp_path / "exp").out_dir
    monkeypatch.setattr(torch.jit, "trace", _Wrong(_vit(2)))
    with pytest.raises(ExportParityError):
        save_backbone(_vit(1), out, formats=["torchscript"])
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # no .staging-* left
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_backbone(out)


def test_a_traced_file_is_checked_at_another_batch_size_than_it_was_traced_at(monkeypatch, tmp_path):
    # The written file is checked on 3 images, not the trace's 2: a trace that baked its batch size in fails.
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
        save_backbone(_vit(0), tmp_path / "exp", formats=["torchscript"])


def test_files_of_an_earlier_export_that_no_longer_match_are_removed(tmp_path):
    out = tmp_path / "exp"
    out.mkdir()
    for name in ("model.torchscript.pt", "model.pt2", "model.onnx", "model.onnx.data"):
        (out / name).write_bytes(b"an earlier export's file")
    save_backbone(_vit(0), out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_weights_that_do_not_rebuild_the_model_are_refused_and_not_left_behind(tmp_path):
    # A model changed after create_backbone (its kwargs say token pooling) does not rebuild from
    # name and kwargs: no file stays, nor the folder the export created; a folder the user made stays.
    vit = _vit(0)
    vit.global_pool = "avg"
    with pytest.raises(ExportParityError, match="weights model.safetensors: outputs differ"):
        save_backbone(vit, tmp_path / "exp")
    assert not (tmp_path / "exp").exists()
    (tmp_path / "mine").mkdir()
    with pytest.raises(ExportParityError):
        save_backbone(vit, tmp_path / "mine")
    assert list((tmp_path / "mine").iterdir()) == []


def test_a_refused_export_removes_the_folders_it_created_and_only_those(monkeypatch, tmp_path):
    # The parents `--out` made go too while empty; a created parent something else wrote into
    # meanwhile stays. The traced files are staged in a hidden folder inside the export's (an
    # atomic os.replace needs one file system), and an error names the file where it would have been.
    monkeypatch.setattr(torch.jit, "trace", _Wrong(_vit(2)))
    with pytest.raises(ExportParityError):
        save_backbone(_vit(1), tmp_path / "a" / "b" / "exp", formats=["torchscript"])
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    staged = []

    def full_disk(fmt, model, stage, tolerance, opset=None):
        staged.append(stage)
        (tmp_path / "a" / "note.txt").write_text("written meanwhile")
        with writing(stage / "model.torchscript.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_save, "write_traced", full_disk)
    with pytest.raises(OSError) as refused:
        save_backbone(_vit(1), tmp_path / "a" / "b" / "exp", formats=["torchscript"])
    out = tmp_path / "a" / "b" / "exp"
    assert str(refused.value) == f"[Errno 28] cannot write {out / 'model.torchscript.pt'}: No space left on device"
    assert staged[0].parent == out and staged[0].name.startswith(".staging-")  # hidden: no results folder
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/note.txt"]

    def denied(fmt, model, stage, tolerance, opset=None):
        raise PermissionError(errno.EACCES, "Permission denied", str(stage / "model.pt2"))

    monkeypatch.setattr(export_save, "write_traced", denied)
    (tmp_path / "exp").mkdir()
    with pytest.raises(OSError) as refused:
        save_backbone(_vit(0), tmp_path / "exp", formats=["export"])
    assert refused.value.errno == errno.EACCES and refused.value.filename == str(tmp_path / "exp" / "model.pt2")
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("fmt", ["torchscript", "export"])
def test_a_traced_file_that_does_not_fit_on_the_disk_is_an_os_error(tmp_path, fmt):
    """A full disk (a file-size limit of 8 KiB: writes past it fail with EFBIG) while writing
    TorchScript or torch.export: torch's own writers abort the whole process from C++ there."""
    setup = ("import pathlib\nfrom ssl_vit.backbones import create_backbone\nfrom ssl_vit.export import traced\n"
             "model = create_backbone('vit', img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2).eval()")
    run = under_file_size_limit(8192, setup, f"traced.write_traced({fmt!r}, model, pathlib.Path(sys.argv[1]), 1e-4)", str(tmp_path))
    assert run.returncode == 0 and f"refused {errno.EFBIG}" in run.stdout, run.stderr[-2000:]
    name = "model.torchscript.pt" if fmt == "torchscript" else "model.pt2"
    assert f"cannot write {tmp_path / name}: File too large" in run.stdout


def test_save_backbone_keeps_the_callers_mode_and_refuses_what_it_cannot_write_before_writing(monkeypatch, tmp_path):
    # The weights rebuild exactly (the same float operations): tolerance 0 passes.
    vit = _vit(0).train()
    assert save_backbone(vit, tmp_path / "exp", tolerance=0.0).parity["model.safetensors"] == 0.0 and vit.training
    save_backbone(vit.eval(), tmp_path / "exp2")
    assert not vit.training
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        save_backbone(vit, tmp_path / "file")
    with pytest.raises(ValueError, match="formats: no format 'onxx'; the formats: safetensors, torchscript, export, onnx"):
        save_backbone(vit, tmp_path / "new", formats=["onxx"])
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"ONNX export needs onnxruntime: pip install 'ssl_vit\[onnx\]'"):
        save_backbone(vit, tmp_path / "new", formats=["onnx"])
    assert not (tmp_path / "new").exists()


def test_check_parity_refuses_nan_outputs_and_another_shape():
    # NaN is within no tolerance; a file whose output has another shape computes something else,
    # even where broadcasting would hide it.
    vit = _vit(0)
    assert check_parity(vit, vit, "same", 0.0) == 0.0
    with pytest.raises(ExportParityError, match="differ from the eager backbone by nan"):
        check_parity(lambda t: torch.full_like(vit(t), float("nan")), vit, "nan", 1e-4)
    with pytest.raises(ExportParityError, match=r"output shape \(3, 1\) differs from the eager backbone's \(3, 32\)"):
        check_parity(lambda t: vit(t)[:, :1], vit, "narrow", 1e3)


def test_a_non_square_export_records_and_traces_its_own_height_and_width(tmp_path):
    # Reference: the eager backbone on images [B, 1, 16, 24]; the traced copy refuses any other size,
    # also the right height with another width or the right width with another height.
    vit = _vit(0, img_size=[16, 24])
    out = save_backbone(vit, tmp_path / "exp", formats=["torchscript"]).out_dir
    cfg = _config(out)  # timm's input_size is (C, H, W)
    assert cfg["input_size"] == cfg["pretrained_cfg"]["input_size"] == [1, 16, 24] and cfg["ssl_vit"]["img_size"] == [16, 24]
    scripted = torch.jit.load(str(out / "model.torchscript.pt"))
    with torch.no_grad():
        torch.testing.assert_close(scripted(_x(1, 16, 24, b=2)), vit(_x(1, 16, 24, b=2)), atol=1e-5, rtol=0)
        for bad in (_x(1, 16, 28, b=2), _x(1, 24, 16, b=2), _x(1, 20, 24, b=2)):
            with pytest.raises(torch.jit.Error, match=r"takes images \[batch, 1, 16, 24\]"):
                scripted(bad)


def test_onnx_weights_past_the_protobuf_limit_go_to_a_side_file_that_travels_with_it(monkeypatch, tmp_path):
    # A protobuf holds at most 2 GB: above the limit the weights go to model.onnx.data (ONNX's
    # external data), moved in and recorded beside it. Stood in for by a limit of 0 bytes.
    import onnxruntime as ort

    from ssl_vit.export import traced

    monkeypatch.setattr(traced, "_ONNX_INLINE_LIMIT", 0)
    model = _vit(0)
    out = save_backbone(model, tmp_path / "exp", formats=["onnx"]).out_dir
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.onnx", "model.onnx.data", "model.safetensors"]
    assert set(_config(out)["ssl_vit"]["files"]) == {"model.safetensors", "model.onnx", "model.onnx.data"}
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(session.run(None, {"images": _x(b=4).numpy()})[0]), model(_x(b=4)), atol=1e-5, rtol=0)


def test_the_temporary_file_is_beside_its_target_and_found_by_stale_temporaries(monkeypatch, tmp_path):
    # io.py: a temporary file in the target's folder (one file system) renamed over the target
    # with os.replace; stale_temporaries lists what a killed writer leaves there.
    target = tmp_path / "run" / "last.ckpt"
    seen = {}
    real_replace = os.replace

    def replace(src, dst):
        seen["src"], seen["dst"] = str(src), str(dst)
        return real_replace(src, dst)

    def write(tmp):
        tmp.write_bytes(b"half")
        seen["during"], seen["other_suffix"], seen["tmp"] = stale_temporaries(target.parent, ".ckpt"), stale_temporaries(target.parent, ".json"), tmp

    monkeypatch.setattr(os, "replace", replace)
    atomic_write(target, write)
    assert seen["during"] == [seen["tmp"]] and seen["other_suffix"] == []
    assert os.path.dirname(seen["src"]) == str(target.parent) and seen["dst"] == str(target)
    assert target.read_bytes() == b"half" and stale_temporaries(target.parent) == []


def test_atomic_json_writes_sets_sorted_and_tensors_as_lists(tmp_path):
    path = atomic_write_json(tmp_path / "r.json", {"s": {"d", "a", "f", "c", "e", "b"}, "t": torch.tensor([1.5, 2.0]), "p": tmp_path})
    assert json.loads(path.read_text()) == {"s": ["a", "b", "c", "d", "e", "f"], "t": [1.5, 2.0], "p": str(tmp_path)}
