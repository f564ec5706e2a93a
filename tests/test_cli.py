"""The `ssl-vit` entry point: dispatch, `eval`, `visualize`, `compare`, end to end on tiny inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Literal  # (resolved from this module by the annotation tests)

import pytest

from ssl_vit.cli import COMMANDS
from ssl_vit.cli import main as cli_main

TINY = '{"img_size": 16, "patch_size": 4, "in_chans": 3, "embed_dim": 32, "depth": 2, "num_heads": 2}'
SYNTH = ["--data", "synthetic", "--data-arg", "num_samples=64", "--data-arg", "num_test_samples=32", "--data-arg", "num_classes=4", "--num-workers", "0"]


def test_help_lists_every_subcommand(capsys):
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("fit", "eval", "compare", "demo", "export", "visualize", "benchmark"):
        assert name in COMMANDS and f"  {name}" in out


def test_every_module_folder_is_a_package_an_install_ships():
    # A folder without __init__.py works from a checkout (and an editable install) but is left
    # out of a wheel by find_packages: `ssl-vit fit` then fails to import it.
    from pathlib import Path

    from setuptools import find_packages

    root = Path(__file__).resolve().parents[1]
    folders = {".".join(p.parent.relative_to(root).parts) for p in (root / "ssl_vit").rglob("*.py")}
    assert folders - set(find_packages(where=str(root), include=["ssl_vit", "ssl_vit.*"])) == set()


def test_a_reader_that_goes_away_is_no_error():
    # `ssl-vit backbones | head -1`: the pipe closes before the output is written.
    proc = subprocess.Popen([sys.executable, "-m", "ssl_vit.cli", "backbones"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait()
    assert err == ""


def test_plugins_named_in_the_environment_are_imported_by_every_command(tmp_path):
    (tmp_path / "my_backbones.py").write_text(
        "from ssl_vit.backbones import BackboneSpec, VisionTransformer, register_backbone\n"
        "register_backbone(BackboneSpec('vit_micro', VisionTransformer, fixed={'embed_dim': 48, 'depth': 2, 'num_heads': 3}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), "SSL_VIT_PLUGINS": "my_backbones"}
    out = subprocess.run([sys.executable, "-m", "ssl_vit.cli", "backbones", "vit_micro"], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "vit_micro" in out.stdout
    env["SSL_VIT_PLUGINS"] = "my_backbones, no_such_module"
    out = subprocess.run([sys.executable, "-m", "ssl_vit.cli", "backbones"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "SSL_VIT_PLUGINS: cannot import no_such_module: ModuleNotFoundError" in out.stderr


def test_fit_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["fit", "--help"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("usage: ssl-vit fit ")


def test_a_records_data_names_the_dataset_not_where_it_lies(tmp_path, capsys):
    from helpers import write_fake_fashion_mnist

    write_fake_fashion_mnist(tmp_path / "fm", n_train=30, n_test=10)
    vit = '{"img_size": 28, "patch_size": 7, "in_chans": 1, "embed_dim": 16, "depth": 1, "num_heads": 2}'
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", vit, "--data", "fashion_mnist",
                     "--data-arg", f"root={tmp_path / 'fm'}", "--k", "3", "--num-workers", "0", "--out", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())["data"]
    assert data == {"name": "fashion_mnist", "test_size": 10, "train_size": 30}  # a local folder: no part of the record


def test_a_warm_up_as_long_as_the_run_is_noted(tmp_path, capsys):
    args = ["eval", "linear", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--epochs", "2", "--out", str(tmp_path)]
    assert cli_main([*args, "--warmup-epochs", "2"]) == 0
    assert "the linear probe's 2 warm-up epochs cover its whole run of 2: its LR only rises" in capsys.readouterr().err


def test_unknown_command_is_an_error(capsys):
    assert cli_main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "protocol,extra,metric",
    [
        ("knn", ["--k", "5"], "top1"),
        ("linear", ["--epochs", "3"], "top1"),
        ("fewshot", ["--shots", "1", "2", "--seeds", "2"], "2shot"),
        ("finetune", ["--epochs", "1", "--max-steps", "2", "--batch-size", "16", "--mixup", "0.8"], "top1"),
        ("linear_aug", ["--epochs", "2", "--probe-batch-size", "16", "--features", "avg"], "top1"),
    ],
)
def test_eval_writes_a_result_record(tmp_path, capsys, protocol, extra, metric):
    command = ["linear", "--augment"] if protocol == "linear_aug" else [protocol]
    args = ["eval", *command, "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--out", str(tmp_path), *extra]
    assert cli_main(args) == 0
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert record["protocol"] == protocol and record["method"] == "random" and record["data"]["name"] == "synthetic"
    assert 0.0 <= record["metrics"][metric] <= 1.0 and record["backbone"]["name"] == "vit"
    assert f"{protocol}" in capsys.readouterr().out
    assert cli_main([*args, "--out", str(tmp_path / "named.json")]) == 0  # the result file, named
    assert json.loads((tmp_path / "named.json").read_text())["method"] == "random"
    if protocol == "finetune":  # trained on augmented images; 16-px images: the small-image crop scale
        assert record["protocol_args"]["crop_scale"] == [0.5, 1.0] and record["protocol_args"]["mixup_alpha"] == 0.8
        assert record["protocol_args"]["warmup_epochs"] == 5.0
        # what ran: 2 steps of the 1-epoch run, with its seed
        assert (record["protocol_args"]["max_steps"], record["protocol_args"]["seed"]) == (2, 0)
        assert "fine-tuning's 5 warm-up epochs cover its whole run of 1: its LR only rises" in capsys.readouterr().err
    if protocol == "linear":
        assert record["protocol_args"]["warmup_epochs"] == 10
        assert "the linear probe's 10 warm-up epochs cover its whole run of 3: its LR only rises" in capsys.readouterr().err
        assert cli_main([*args, "--warmup-epochs", "1", "--out", str(tmp_path / "warm1.json")]) == 0
        assert "warm-up" not in capsys.readouterr().err
        assert json.loads((tmp_path / "warm1.json").read_text())["protocol_args"]["warmup_epochs"] == 1
        assert record["protocol_args"]["base_lr"] == 0.01  # SGD's default LR; LARS gets MAE's
        assert cli_main([*args, "--optimizer", "lars", "--out", str(tmp_path / "lars.json")]) == 0
        assert json.loads((tmp_path / "lars.json").read_text())["protocol_args"]["base_lr"] == 0.1
    if protocol == "linear_aug":
        assert record["protocol_args"]["crop_scale"] == [0.5, 1.0] and record["protocol_args"]["features"] == "avg"
        assert record["protocol_args"]["max_steps"] is None  # no cap
        assert path.name == "random_vit-D32-L2-H2-4_synthetic_linear_aug-avg.json"


def test_eval_precision_reaches_the_extraction_and_the_training_and_is_recorded(tmp_path, monkeypatch, capsys):
    import torch

    import ssl_vit.eval.evaluate as evaluate

    seen = []
    extract = evaluate.extract_features
    monkeypatch.setattr(evaluate, "extract_features", lambda *a, **k: seen.append(k["autocast_dtype"]) or extract(*a, **k))
    base = ["--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--precision", "bf16-mixed"]
    assert cli_main(["eval", "knn", *base, "--k", "5", "--out", str(tmp_path / "knn.json")]) == 0
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert cli_main(["eval", "finetune", *base, "--epochs", "1", "--max-steps", "1", "--batch-size", "16", "--out", str(tmp_path / "ft.json")]) == 0
    for name in ("knn", "ft"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["protocol_args"]["precision"] == "bf16-mixed"
    assert cli_main(["eval", "knn", *base[:-1], "16-mixed", "--device", "cpu"]) == 1
    assert "--precision 16-mixed needs a CUDA device; on a CPU use bf16-mixed or 32-true" in capsys.readouterr().err


def test_an_export_path_that_is_a_file_fails_before_the_fine_tuning(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert cli_main(["eval", "finetune", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--export", str(tmp_path / "f")]) == 1
    assert capsys.readouterr().err == f"ssl-vit eval: error: --export {tmp_path / 'f'}: exists and is not a directory; name a folder\n"


def test_fine_tuning_does_not_export_over_the_export_it_reads(tmp_path, capsys):
    from ssl_vit.backbones import create_backbone
    from ssl_vit.export import save_backbone

    out = save_backbone(create_backbone("vit", **json.loads(TINY)), tmp_path / "exp").out_dir
    before = (out / "model.safetensors").read_bytes()
    for backbone in (str(out), str(out / "model.safetensors")):
        assert cli_main(["eval", "finetune", "--backbone", backbone, *SYNTH, "--export", str(tmp_path / "exp")]) == 1
        assert capsys.readouterr().err == (f"ssl-vit eval: error: --export {tmp_path / 'exp'}: is the export --backbone reads; "
                                           "the fine-tuned model would replace the pretrained one: name another folder\n")
    assert (out / "model.safetensors").read_bytes() == before
    # a run folder holding the checkpoint read (no export there) may take the export
    from ssl_vit.cli.options import check_export

    (tmp_path / "run").mkdir()
    check_export(str(tmp_path / "run"), backbone=str(tmp_path / "run" / "last.ckpt"))


def test_the_export_folder_itself_is_tried_for_a_write_when_it_exists_else_its_parent(monkeypatch, tmp_path):
    # options.check_export: a read-only existing --export folder must fail before the fine-tuning
    import ssl_vit.cli.options as options
    from ssl_vit.cli.options import check_export

    tried, real = [], options.tempfile.NamedTemporaryFile
    monkeypatch.setattr(options.tempfile, "NamedTemporaryFile", lambda **kw: tried.append(Path(kw["dir"])) or real(**kw))
    (tmp_path / "exp").mkdir()
    check_export(str(tmp_path / "exp"), "random:vit")
    check_export(str(tmp_path / "new"), "random:vit")
    assert tried == [tmp_path / "exp", tmp_path]


def test_backbone_kwargs_that_are_not_a_json_object_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", "[1]", *SYNTH])
    assert stop.value.code == 2 and "expected a JSON object" in capsys.readouterr().err


def test_a_read_out_the_backbone_lacks_is_one_line_before_any_data(capsys, monkeypatch):
    import ssl_vit.cli.options as options

    monkeypatch.setattr(options, "build_datamodule", lambda *a, **k: pytest.fail("the data was built first"))
    resnet = ["--backbone", "random:resnet18", "--backbone-kwargs", '{"img_size": 16, "in_chans": 3, "small_input": true}', *SYNTH]
    assert cli_main(["eval", "linear", "--augment", *resnet, "--features", "last4"]) == 1
    assert capsys.readouterr().err == ("ssl-vit eval: error: --features last4: feature mode 'last4' needs a token sequence (ViT or hybrid); "
                                       "resnet18 has no tokens, use mode='cls' (--features cls: its globally pooled feature map)\n")
    with pytest.raises(SystemExit):  # fine-tuning classifies from the backbone's own output: it has no --features
        cli_main(["eval", "finetune", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--features", "avg"])
    assert "unrecognized arguments: --features avg" in capsys.readouterr().err
    shallow = ["--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH]  # depth 2
    assert cli_main(["eval", "linear", *shallow, "--features", "last4"]) == 1
    assert capsys.readouterr().err == ("ssl-vit eval: error: --features last4: feature mode 'last4' reads the [CLS] of the last 4 blocks "
                                       "(DINO's linear protocol), but this backbone has 2; choose another mode (cls, avg, cls_avg)\n")


def test_options_of_the_probe_on_images_need_augment(capsys):
    assert cli_main(["eval", "linear", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--run-dir", "x", "--max-steps", "3"]) == 1
    assert capsys.readouterr().err == ("ssl-vit eval: error: --run-dir, --max-steps: options of a linear probe trained on images; add --augment, "
                                       "or leave them out for the probe on features extracted once\n")


def test_eval_frozen_runs_every_feature_protocol_on_one_extraction(tmp_path, monkeypatch, capsys):
    import ssl_vit.eval.evaluate as evaluate

    calls = []
    extract = evaluate.extract_features
    monkeypatch.setattr(evaluate, "extract_features", lambda *a, **k: calls.append(1) or extract(*a, **k))
    args = ["eval", "frozen", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--out", str(tmp_path),
            "--epochs", "2", "--shots", "1", "2", "--seeds", "2", "--k", "5"]
    assert cli_main(args) == 0
    assert len(calls) == 2  # the train and the test split, once each
    records = {json.loads(p.read_text())["protocol"]: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(records) == {"linear", "knn", "fewshot"}
    assert records["knn"]["protocol_args"]["k"] == 5 and records["linear"]["protocol_args"]["epochs"] == 2
    assert "2shot" in records["fewshot"]["metrics"]
    # the kNN's options count only where it runs: a repeated k is no error for the probe alone
    only_linear = ["eval", "frozen", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--out", str(tmp_path / "lin"),
                   "--epochs", "2", "--protocols", "linear", "--k", "5", "5"]
    assert cli_main(only_linear) == 0
    assert [json.loads(p.read_text())["protocol"] for p in (tmp_path / "lin").glob("*.json")] == ["linear"]
    one_file = list(args)
    one_file[one_file.index("--out") + 1] = str(tmp_path / "one.json")
    assert cli_main(one_file) == 1
    assert "3 protocols write 3 results: the output (--out) must be a folder, not the file" in capsys.readouterr().err


def test_eval_finetune_checkpoints_into_its_run_dir_and_resumes(tmp_path, capsys):
    args = ["eval", "finetune", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--epochs", "1", "--batch-size", "16",
            "--run-dir", str(tmp_path / "ft"), "--out", str(tmp_path / "a.json")]
    assert cli_main(args) == 0
    assert (tmp_path / "ft" / "checkpoints" / "last.ckpt").is_file()
    assert cli_main(args) == 1  # a rerun would start over the run's checkpoints
    assert "already holds a fine-tuning run's checkpoints" in capsys.readouterr().err
    assert cli_main([*args[:-1], str(tmp_path / "b.json"), "--resume"]) == 0  # finished: only the test pass
    a, b = (json.loads((tmp_path / f"{n}.json").read_text())["metrics"] for n in "ab")
    assert a == b
    assert cli_main(["eval", "finetune", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--resume"]) == 1
    assert "--resume needs the --run-dir" in capsys.readouterr().err


def test_eval_finetune_exports_the_classifier_that_timm_builds(tmp_path, capsys, monkeypatch):
    """``--export DIR``: the fine-tuned backbone and classifier in one export folder; timm builds
    the whole classifier from it (its logits are ours), ssl_vit's loaders the backbone, and a
    fine-tuning at another resolution is exported at that resolution."""
    import timm
    import torch
    from safetensors.torch import load_file

    import ssl_vit

    args = ["eval", "finetune", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--epochs", "1", "--batch-size", "16",
            "--lr", "0.05", "--img-size", "24", "--run-dir", str(tmp_path / "ft"), "--out", str(tmp_path / "ft.json"), "--export", str(tmp_path / "exp")]
    from ssl_vit.eval.finetune import FineTuneModule

    seen, step = [], FineTuneModule.training_step
    monkeypatch.setattr(FineTuneModule, "training_step", lambda self, batch, i: seen.append(tuple(batch[0].shape[2:])) or step(self, batch, i))
    assert cli_main(args) == 0
    assert "4-class classifier" in capsys.readouterr().out
    assert set(seen) == {(24, 24)}  # the images are made at --img-size, not the backbone's 16
    trained = torch.load(tmp_path / "ft" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    weights = load_file(tmp_path / "exp" / "model.safetensors")
    assert torch.equal(weights["head.weight"], trained["head.weight"]) and weights["head.weight"].abs().max() > 1e-3
    assert torch.equal(weights["pos_embed"], trained["backbone.pos_embed"]) and weights["pos_embed"].shape[1] == 1 + 36  # 24 px / 4
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert cfg["num_classes"] == 4 and cfg["ssl_vit"]["method"] == "random+finetune"
    # The normalisation the fine-tuning fed the backbone, as its checkpoints record it.
    run_data = torch.load(tmp_path / "ft" / "checkpoints" / "last.ckpt", weights_only=False)["ssl_vit"]["data"]
    assert cfg["mean"] == run_data["mean"] and cfg["std"] == run_data["std"]
    assert cfg["ssl_vit"]["normalization"]["source"] == "training data (synthetic)"
    assert [r["protocol"] for r in cfg["ssl_vit"]["results"]] == ["finetune"]
    backbone = ssl_vit.load_backbone(tmp_path / "exp")
    x = torch.randn(3, 3, 24, 24)
    with torch.no_grad():
        ours = torch.nn.functional.linear(backbone(x), weights["head.weight"], weights["head.bias"])  # [3, 4]
        theirs = timm.create_model(f"local-dir:{tmp_path / 'exp'}", pretrained=True).eval()(x)
    torch.testing.assert_close(theirs, ours)
    # The run's own checkpoint names its backbone too: export and eval read the fine-tuned one from it.
    from ssl_vit.export import load_any_backbone

    from_run, info = load_any_backbone(tmp_path / "ft" / "checkpoints" / "last.ckpt")
    assert info["method"] == "random+finetune" and info["normalization_source"].startswith("training data (synthetic)")
    assert all(torch.equal(v, backbone.state_dict()[k]) for k, v in from_run.state_dict().items())


def test_eval_of_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert cli_main(["eval", "knn", "--backbone", str(tmp_path / "nope.ckpt"), *SYNTH]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.ckpt" in err[0]


@pytest.mark.parametrize("command", [["eval", "knn", "--backbone", "random:vit_tiny", *SYNTH], ["demo", "--quick"], ["benchmark", "--quick"],
                                     ["visualize", "random:vit_tiny", "--images", "synthetic", "--out", "figures"]])
def test_a_device_the_machine_lacks_is_one_line(monkeypatch, capsys, tmp_path, command):
    monkeypatch.chdir(tmp_path)  # (the default output folders: none of the checkout's)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli_main([*command, "--device", "cuda"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda: this machine has no CUDA GPU that torch can use; use --device cpu" in err[0]
    assert cli_main([*command, "--device", "gpu"]) == 1
    assert "--device 'gpu' is not a device name (cpu, cuda, cuda:1 ...)" in capsys.readouterr().err


def test_visualize_writes_every_figure(tmp_path):
    assert cli_main(["visualize", "random:vit", "--backbone-kwargs", TINY, "--images", "synthetic", "--data-arg", "num_test_samples=16",
                     "--out", str(tmp_path), "--num-images", "16", "--show", "2"]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"filters.png", "pos_embed.png", "attention_distance.png", "attention_distance.csv", "attention_rollout.png", "attention_dino.png"} <= names
    rows = (tmp_path / "attention_distance.csv").read_text().splitlines()
    assert rows[0].startswith("layer,head") and len(rows) == 1 + 2 * 2  # depth 2 x 2 heads


def test_visualize_hands_its_options_to_the_figures(tmp_path, monkeypatch):
    # --show images drawn (the pool holds at least that many), --num-images averaged for the
    # distance, the dataset's normalisation undone for display
    import ssl_vit.analysis.render as render

    calls = []
    monkeypatch.setattr(render, "render_all", lambda backbone, shown, out, **kw: calls.append((shown, kw)) or {})
    for num_images, show in ((3, 5), (6, 2)):
        assert cli_main(["visualize", "random:vit", "--backbone-kwargs", TINY, "--images", "synthetic", "--data-arg", "num_test_samples=16",
                         "--out", str(tmp_path / f"{num_images}_{show}"), "--num-images", str(num_images), "--show", str(show)]) == 0
        shown, kw = calls[-1]
        assert shown.shape[0] == show and kw["max_images"] == show
        assert kw["num_distance_images"] == num_images and len(kw["distance_images"].dataset) == max(num_images, show)
        assert (tuple(kw["mean"]), tuple(kw["std"])) == ((0.5,) * 3, (0.25,) * 3)


def test_visualize_draws_what_applies_to_a_resnet(tmp_path, capsys):
    args = ["visualize", "random:resnet18", "--backbone-kwargs", '{"in_chans": 3, "small_input": true}', "--images", "synthetic",
            "--data-arg", "num_test_samples=8", "--data-arg", "img_size=16", "--out", str(tmp_path), "--num-images", "8", "--show", "2"]
    assert cli_main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["filters.png"]
    assert "not pos_embed, attention_distance" in capsys.readouterr().err
    assert cli_main([*args, "--figures", "pos_embed"]) == 1  # asked for explicitly: an error naming why
    assert "has no attention or position embedding (a ViT's or hybrid's), which the pos_embed figure needs" in capsys.readouterr().err


def test_visualize_names_a_backbone_it_can_draw_nothing_of(tmp_path, capsys):
    import torch
    from helpers import registered_backbones

    class Pooled(torch.nn.Module):  # a backbone of one's own: no tokens, and its first layer is no conv1 / patch_embed.proj
        def __init__(self, in_chans: int = 3):
            super().__init__()
            self.embed_dim, self.in_chans, self.img_size = 8, in_chans, (16, 16)
            self.stem = torch.nn.Conv2d(in_chans, 8, 4, stride=4)

        def forward_features(self, x):
            return self.stem(x)

        def forward(self, x):
            return self.forward_features(x).mean((2, 3))

    with registered_backbones(pooled_test=Pooled):
        assert cli_main(["visualize", "random:pooled_test", "--images", "synthetic", "--data-arg", "num_test_samples=8",
                         "--data-arg", "img_size=16", "--out", str(tmp_path / "figs")]) == 1
    err = capsys.readouterr().err
    assert "ssl-vit visualize: error: Pooled has none of what the figures read" in err and "drawing" not in err
    assert not (tmp_path / "figs").exists()


def test_visualize_draws_no_cls_maps_of_a_token_backbone_without_an_output_token(tmp_path, capsys):
    import torch
    from helpers import registered_backbones

    class Pooled(torch.nn.Module):  # tokens and attention, no [CLS]: the representation is the mean token
        num_prefix_tokens = 0

        def __init__(self, in_chans: int = 3, img_size: int = 16):
            super().__init__()
            self.embed_dim, self.in_chans, self.img_size, self.patch_size = 8, in_chans, (img_size, img_size), 4
            self.grid_size = (img_size // 4, img_size // 4)
            self.patch_embed = torch.nn.Module()
            self.patch_embed.proj = torch.nn.Conv2d(in_chans, 8, 4, stride=4)
            self.pos_embed = torch.nn.Parameter(torch.randn(1, self.grid_size[0] * self.grid_size[1], 8))

        def forward_features(self, x):
            return self.patch_embed.proj(x).flatten(2).transpose(1, 2) + self.pos_embed  # [B, N, D]

        def get_attention_maps(self, x):
            t = self.forward_features(x)
            return [(t @ t.transpose(1, 2)).softmax(-1).unsqueeze(1)]  # 1 layer x [B, 1, N, N]

        def forward(self, x):
            return self.forward_features(x).mean(1)

    args = ["visualize", "random:pooled_cls_less", "--images", "synthetic", "--data-arg", "num_test_samples=8",
            "--data-arg", "img_size=16", "--num-images", "8", "--show", "2"]
    with registered_backbones(pooled_cls_less=Pooled):
        assert cli_main([*args, "--out", str(tmp_path / "all")]) == 0
        err = capsys.readouterr().err
        assert "Pooled has no output token ([CLS]) whose attention the maps show: drawing filters, pos_embed, " \
               "attention_distance (not attention_rollout, attention_dino)" in err
        assert sorted(p.name for p in (tmp_path / "all").glob("*.png")) == ["attention_distance.png", "filters.png", "pos_embed.png"]
        # Asked for by name: refused, rather than the first patch's row drawn as the [CLS] map.
        assert cli_main([*args, "--out", str(tmp_path / "cls"), "--figures", "attention_rollout"]) == 1
    assert "has no output token ([CLS]) whose attention the maps show, which the attention_rollout figure needs" in capsys.readouterr().err


def test_visualize_rejects_unknown_images(tmp_path, capsys):
    assert cli_main(["visualize", "random:vit", "--backbone-kwargs", TINY, "--images", "no_such_data", "--out", str(tmp_path)]) == 1
    assert "--images no_such_data: not a dataset name (cifar10," in capsys.readouterr().err


def test_compare_tabulates_eval_outputs(tmp_path, capsys):
    for spec in ("random:vit",):
        assert cli_main(["eval", "knn", "--backbone", spec, "--backbone-kwargs", TINY, *SYNTH, "--out", str(tmp_path / "res"), "--k", "5"]) == 0
    assert cli_main(["compare", str(tmp_path / "res"), "--out", str(tmp_path / "report.md")]) == 0
    assert "random" in capsys.readouterr().out
    assert (tmp_path / "report.md").read_text().count("|") > 4


def test_eval_out_may_name_the_record_file_and_compare_reads_it(tmp_path, capsys):
    record = tmp_path / "res" / "knn.json"
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--out", str(record), "--k", "5"]) == 0
    assert record.is_file() and json.loads(record.read_text())["protocol"] == "knn"
    (tmp_path / "res" / "old.json").mkdir()  # a folder named like a record is not one
    assert cli_main(["compare", str(tmp_path / "res"), "--out", str(tmp_path / "report.md")]) == 0
    assert "random" in capsys.readouterr().out


@pytest.mark.parametrize(
    "data_args,message",
    [
        (["--data", "imagefolder"], "--data imagefolder needs --data-arg train_dir=..."),
        ([*SYNTH, "--data-arg", "num_sample=8"], "--data synthetic takes no argument num_sample (did you mean 'num_samples'?); its arguments: num_samples,"),
    ],
)
def test_a_bad_data_argument_is_one_line_naming_the_fix(capsys, data_args, message):
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *data_args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_an_error_in_a_distributed_run_names_its_process(monkeypatch, capsys):
    # Each process of a DDP run prints its own error; one's crash reaches the others as gloo's
    # "Connection closed by peer", so the line says which process it comes from.
    import ssl_vit.cli.fit as training_cli
    import ssl_vit.runtime

    def lost_peer(argv):
        raise RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:51613")

    monkeypatch.setattr(training_cli, "main", lost_peer)
    monkeypatch.setattr(ssl_vit.runtime, "world_info", lambda: (1, 2))
    assert cli_main(["fit"]) == 1
    assert capsys.readouterr().err == "ssl-vit fit: error (process 1 of 2): [pair.cc:561] Connection closed by peer [127.0.0.1]:51613\n"


def test_an_unwritable_output_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    args = ["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--out", str(tmp_path / "file" / "res"), "--k", "5"]
    assert cli_main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "file" in err[0], err


def _heap_setting(value: str | None, **glibc: str) -> str:
    """What keep_freed_memory reports in a fresh interpreter (mallopt changes the whole process)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "SSL_VIT_MALLOC"} | glibc
    if value is not None:
        env["SSL_VIT_MALLOC"] = value
    code = "from ssl_vit.runtime import keep_freed_memory, allocator_note; keep_freed_memory(); print(allocator_note())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    return run.stdout.strip() or run.stderr.strip().splitlines()[-1]


def test_the_c_heap_is_left_alone_unless_asked():
    import platform

    assert _heap_setting(None) == "system default"
    assert _heap_setting("system") == "system default"
    kept = _heap_setting("keep")
    if platform.libc_ver()[0] == "glibc":
        assert kept.startswith("glibc, freed memory kept for reuse")
    assert "SSL_VIT_MALLOC must be 'system' or 'keep', got 'fast'" in _heap_setting("fast")
    # glibc's own settings, given by the user, win over the opt-in
    for name in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"):
        assert _heap_setting("keep", **{name: "65536"}) == "as set by MALLOC_* in the environment"


def test_a_bad_heap_setting_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("SSL_VIT_MALLOC", "fast")
    assert cli_main(["backbones"]) == 2
    assert "ssl-vit: error: SSL_VIT_MALLOC must be 'system' or 'keep'" in capsys.readouterr().err


def test_trainer_devices_of_the_device_options():
    from ssl_vit.cli.eval import trainer_devices

    assert trainer_devices("cuda:1", 1) == [1]  # that GPU, not the first
    assert trainer_devices("cuda", 4) == 4 and trainer_devices("cpu", 2) == 2
    with pytest.raises(ValueError, match="--device cuda:1 names one GPU; with --devices 2 use --device cuda"):
        trainer_devices("cuda:1", 2)


def test_eval_data_is_normalised_as_the_backbone_was_trained_or_else_as_the_dataset():
    from ssl_vit.cli.options import build_datamodule
    from ssl_vit.data import FashionMNISTDataModule
    from ssl_vit.export import load_any_backbone

    grey, info = load_any_backbone("random:vit", backbone_kwargs={**json.loads(TINY), "in_chans": 1})
    own = FashionMNISTDataModule.dataset_mean
    # A random initialisation records nothing: the dataset's statistics, as the demo's random row.
    assert tuple(build_datamodule("fashion_mnist", grey, info, {}, None).mean) == tuple(own)
    # Statistics a pretraining recorded are the ones its backbone learned with.
    recorded = {**info, "kind": "lightning", "normalization_source": "recorded", "mean": [0.3], "std": [0.2]}
    assert tuple(build_datamodule("fashion_mnist", grey, recorded, {}, None).mean) == (0.3,)
    # Foreign 3-channel weights that record nothing: ImageNet's, what timm's weights expect.
    rgb, rgb_info = load_any_backbone("random:vit", backbone_kwargs=json.loads(TINY))
    assert rgb_info["normalization_source"].startswith("default (ImageNet")  # a random one: still the dataset's
    assert tuple(build_datamodule("fashion_mnist", rgb, rgb_info, {}, None).mean) == tuple(own) * 3
    foreign = {**info, "kind": "state_dict", "normalization_source": "default (ImageNet statistics)", "mean": [0.485, 0.456, 0.406],
               "std": [0.229, 0.224, 0.225]}
    assert tuple(build_datamodule("fashion_mnist", rgb, foreign, {}, None).mean) == (0.485, 0.456, 0.406)


def _pretraining_checkpoint(path, method: str = "MPP"):
    """What `ssl-vit fit` saves, as far as evaluation reads it: the backbone's weights and a record
    naming the method and the architecture (no training: tiny and fast)."""
    import torch

    from ssl_vit import create_backbone

    kwargs = json.loads(TINY)
    state = {f"backbone.{k}": v for k, v in create_backbone("vit", **kwargs).state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state, "global_step": 1, "epoch": 0, "pytorch-lightning_version": "2.6.6",
                "ssl_vit": {"method": method, "backbone": "vit", "backbone_kwargs": kwargs, "global_step": 1, "epoch": 0}}, path)
    return path


def _not_reached(monkeypatch, what: str) -> None:
    """Loading the backbone (the start of the work) fails the test: the error came before it."""
    import ssl_vit.export.load as load

    monkeypatch.setattr(load, "resolve", lambda *a, **k: pytest.fail(f"{what}: the backbone was loaded first"))


@pytest.mark.parametrize(
    "protocol,out,message",
    [
        (["finetune"], ["--out", "{tmp}/file/res"], "--out {tmp}/file/res: cannot create the folder {tmp}/file/res: {tmp}/file is not a folder"),
        (["finetune"], ["--out", "{tmp}/file/res/ft.json"], "--out {tmp}/file/res/ft.json: cannot create the folder {tmp}/file/res: {tmp}/file is not a folder"),
        (["finetune"], ["--export", "{tmp}/file/exp"], "--export {tmp}/file/exp: {tmp}/file exists and is not a folder"),
        (["finetune"], ["--export", "{tmp}/file/sub/exp"], "--export {tmp}/file/sub/exp: cannot create the folder {tmp}/file/sub: {tmp}/file is not a folder"),
        (["linear", "--augment"], ["--out", "{tmp}/file/res"], "--out {tmp}/file/res: cannot create the folder {tmp}/file/res: {tmp}/file is not a folder"),
        (["knn"], ["--out", "{tmp}/file"], "--out {tmp}/file: exists and is not a folder; name a folder for the results, or a result file ending in .json"),
        (["knn"], ["--out", "{tmp}/dir.json"], "--out {tmp}/dir.json: is a folder; a name ending in .json names the result file itself"),
    ],
)
def test_an_output_that_cannot_be_written_fails_before_the_evaluation(tmp_path, monkeypatch, capsys, protocol, out, message):
    # Found after a fine-tuning, the record (or the fine-tuned model) would be lost.
    (tmp_path / "file").write_text("")
    (tmp_path / "dir.json").mkdir()
    _not_reached(monkeypatch, message)
    out = [o.format(tmp=tmp_path) for o in out]
    assert cli_main(["eval", *protocol, "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, *out]) == 1
    assert capsys.readouterr().err == f"ssl-vit eval: error: {message.format(tmp=tmp_path)}\n"


def test_the_output_folders_are_made_before_the_fine_tuning_and_not_on_a_bad_command(tmp_path, monkeypatch, capsys):
    from ssl_vit.eval.finetune import FineTuneSettings

    made = []

    def training(*args, **kwargs):
        made.append(((tmp_path / "a" / "b").is_dir(), (tmp_path / "c").is_dir(), (tmp_path / "c" / "exp").exists()))
        raise RuntimeError("stopped here")

    monkeypatch.setattr(FineTuneSettings, "run", training)
    args = ["eval", "finetune", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--out", str(tmp_path / "a" / "b"),
            "--export", str(tmp_path / "c" / "exp")]
    assert cli_main([*args, "--data-arg", "img_size=abc"]) == 1  # a bad command leaves no folders behind
    assert "img_size" in capsys.readouterr().err and sorted(p.name for p in tmp_path.iterdir()) == []
    assert cli_main(args) == 1 and "stopped here" in capsys.readouterr().err
    assert made == [(True, True, False)]
    assert list((tmp_path / "a" / "b").iterdir()) == []  # (the write check leaves nothing)


def test_a_method_the_backbone_contradicts_is_refused(tmp_path, capsys):
    import torch

    from ssl_vit import create_backbone

    ck = _pretraining_checkpoint(tmp_path / "mpp.ckpt")
    knn = ["eval", "knn", *SYNTH, "--k", "5"]
    assert cli_main([*knn, "--backbone", str(ck), "--method", "supervised"]) == 1
    assert capsys.readouterr().err == (f"ssl-vit eval: error: --method supervised: {ck} is recorded as method mpp; --method names the method "
                                       "of weights that record none (a bare state dict): leave it out\n")
    assert cli_main([*knn, "--backbone", "random:vit", "--backbone-kwargs", TINY, "--method", "dino"]) == 1
    assert "--method dino: random:vit is a random initialisation as method random;" in capsys.readouterr().err
    assert cli_main([*knn, "--backbone", str(ck), "--method", "MPP", "--out", str(tmp_path / "same.json")]) == 0  # the same method
    assert json.loads((tmp_path / "same.json").read_text())["method"] == "mpp"
    # A bare state dict records none: --method names it.
    torch.save(create_backbone("vit", **json.loads(TINY)).state_dict(), tmp_path / "weights.pt")
    assert cli_main([*knn, "--backbone", str(tmp_path / "weights.pt"), "--arch", "vit", "--backbone-kwargs", TINY, "--method", "supervised",
                     "--out", str(tmp_path / "bare.json")]) == 0
    assert json.loads((tmp_path / "bare.json").read_text())["method"] == "supervised"


@pytest.mark.parametrize(
    "protocol,option,message",
    [
        ("finetune", ["--mixup", "-1"], "--mixup must be >= 0 (0: off), got -1"),
        ("finetune", ["--cutmix", "-0.5"], "--cutmix must be >= 0 (0: off), got -0.5"),
        ("finetune", ["--rand-augment", "0", "9"], "--rand-augment must be OPS MAGNITUDE with OPS >= 1 and MAGNITUDE in 0..30, got 0 9"),
        ("finetune", ["--random-erasing", "1.5"], "--random-erasing must be a probability in [0, 1] (0: off), got 1.5"),
        ("finetune", ["--label-smoothing", "1"], "--label-smoothing must be in [0, 1), got 1"),
        ("finetune", ["--drop-path", "-0.1"], "--drop-path must be in [0, 1), got -0.1"),
        ("finetune", ["--drop-path", "1"], "--drop-path must be in [0, 1), got 1"),
        ("linear", ["--lr", "0"], "--lr must be > 0, got 0"),
        ("finetune", ["--layer-decay", "-0.5"], "--layer-decay must be in (0, 1] (1: no decay), got -0.5"),
        ("finetune", ["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1"),
        ("finetune", ["--lr", "0"], "--lr must be > 0, got 0"),
        ("finetune", ["--lr", "nan"], "--lr must be > 0, got nan"),
        ("finetune", ["--lr", "inf"], "--lr must be > 0, got inf"),  # > 0, but no LR
        ("finetune", ["--epochs", "0"], "--epochs must be >= 1, got 0"),
        ("finetune", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("finetune", ["--max-steps", "0"], "--max-steps must be -1 (no cap) or >= 1, got 0"),
        ("finetune", ["--crop-scale", "0.5", "0.2"], "--crop-scale must be LO HI with 0 < LO <= HI <= 1, got 0.5 0.2"),
        ("linear", ["--probe-batch-size", "1"], "--probe-batch-size must be >= 2 (the probe's BatchNorm needs two examples), got 1"),
        ("linear", ["--lr", "-0.1"], "--lr must be > 0, got -0.1"),
        ("knn", ["--k", "0"], "--k must be >= 1, got 0"),
        ("knn", ["--temperature", "0"], "--temperature must be > 0, got 0"),
        ("fewshot", ["--shots", "0", "5"], "--shots must be >= 1 each, got 0 5"),
        ("frozen", ["--seeds", "0"], "--seeds must be >= 1, got 0"),
        ("knn", ["--test-subset", "0"], "--test-subset must be >= 1 (images), got 0"),
    ],
)
def test_evaluation_options_are_checked_before_any_work(monkeypatch, capsys, protocol, option, message):
    _not_reached(monkeypatch, message)
    assert cli_main(["eval", protocol, "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, *option]) == 1
    assert capsys.readouterr().err == f"ssl-vit eval: error: {message}\n"


def test_the_epochs_error_comes_before_the_warm_up_note(monkeypatch, capsys):
    _not_reached(monkeypatch, "epochs")
    assert cli_main(["eval", "linear", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--epochs", "-2"]) == 1
    assert capsys.readouterr().err == "ssl-vit eval: error: --epochs must be >= 1, got -2\n"  # (no note on a run of -2 epochs)


def test_more_neighbours_than_training_images_is_said_before_the_features(monkeypatch, capsys):
    import ssl_vit.eval.evaluate as evaluate

    monkeypatch.setattr(evaluate, "extract_features", lambda *a, **k: pytest.fail("features were extracted"))
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--k", "65"]) == 1
    assert capsys.readouterr().err == "ssl-vit eval: error: knn: k=65 neighbours, but the kNN bank holds 64 training examples\n"


def _image_folder(root, classes: dict[str, int], mode: str = "RGB"):
    from PIL import Image

    for i, (name, count) in enumerate(classes.items()):
        (root / name).mkdir(parents=True)
        for j in range(count):
            Image.new(mode, (16, 16), (40 * i + 10 * j,) * len(mode)).save(root / name / f"{j}.png")
    return root


@pytest.mark.parametrize(
    "train,val,message",
    [
        ({"a": 3}, {"a": 2}, "the training images ({tmp}/train) are of 1 class; evaluation needs at least 2 classes"),
        ({"a": 3, "b": 3}, {"b": 2}, "the test images ({tmp}/val) are of 1 class; evaluation needs at least 2 classes"),
    ],
)
def test_data_of_one_class_is_refused_before_the_features(tmp_path, monkeypatch, capsys, train, val, message):
    import ssl_vit.eval.evaluate as evaluate

    monkeypatch.setattr(evaluate, "extract_features", lambda *a, **k: pytest.fail("features were extracted"))
    data = ["--data", "imagefolder", "--data-arg", f"train_dir={_image_folder(tmp_path / 'train', train)}",
            "--data-arg", f"val_dir={_image_folder(tmp_path / 'val', val)}", "--num-workers", "0"]
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *data, "--k", "1"]) == 1
    assert capsys.readouterr().err == f"ssl-vit eval: error: imagefolder: {message.format(tmp=tmp_path)}\n"


def test_training_data_of_one_class_is_refused_when_its_images_list_no_labels(tmp_path, monkeypatch, capsys):
    # evaluate.py: a datamodule whose splits do not list their labels (a plugin's) still says how
    # many classes it has; one is refused before the features.
    import ssl_vit.eval.evaluate as evaluate

    monkeypatch.setattr(evaluate, "labelled_classes", lambda dataset: None)
    monkeypatch.setattr(evaluate, "extract_features", lambda *a, **k: pytest.fail("features were extracted"))
    data = ["--data", "imagefolder", "--data-arg", f"train_dir={_image_folder(tmp_path / 'train', {'a': 3})}",
            "--data-arg", f"val_dir={_image_folder(tmp_path / 'val', {'a': 2})}", "--num-workers", "0"]
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *data, "--k", "1"]) == 1
    assert f"the training images ({tmp_path}/train) are of 1 class; evaluation needs at least 2 classes" in capsys.readouterr().err


def test_a_test_subset_of_one_class_is_refused_too(tmp_path, capsys):
    data = ["--data", "imagefolder", "--data-arg", f"train_dir={_image_folder(tmp_path / 'train', {'a': 2, 'b': 2})}",
            "--data-arg", f"val_dir={_image_folder(tmp_path / 'val', {'a': 2, 'b': 2})}", "--num-workers", "0", "--k", "1"]
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *data, "--test-subset", "1", "--out", str(tmp_path / "r")]) == 1
    assert f"the test images ({tmp_path}/val) are of 1 class; evaluation needs at least 2 classes" in capsys.readouterr().err


def test_colour_images_for_a_grey_backbone_are_noted_once(tmp_path, capsys):
    data = ["--data", "imagefolder", "--data-arg", f"train_dir={_image_folder(tmp_path / 'train', {'a': 2, 'b': 2})}",
            "--data-arg", f"val_dir={_image_folder(tmp_path / 'val', {'a': 1, 'b': 1})}", "--num-workers", "0", "--k", "1"]
    grey = json.dumps({**json.loads(TINY), "in_chans": 1})
    note = "ssl-vit eval: note: --data imagefolder holds RGB images: they are converted to grey, the backbone's 1 input channel\n"
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", grey, *data, "--out", str(tmp_path / "grey.json")]) == 0
    assert capsys.readouterr().err.count(note) == 1
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *data, "--out", str(tmp_path / "rgb.json")]) == 0
    assert "note:" not in capsys.readouterr().err
    # grey images whose first file cannot be read: its stand-in (1x1 RGB) says nothing of the folder
    data = ["--data", "imagefolder", "--data-arg", f"train_dir={_image_folder(tmp_path / 'grey', {'a': 2, 'b': 2}, mode='L')}",
            "--data-arg", f"val_dir={_image_folder(tmp_path / 'grey_val', {'a': 1, 'b': 1}, mode='L')}", "--num-workers", "0", "--k", "1"]
    (tmp_path / "grey" / "a" / "0.png").write_bytes(b"not a png")
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", grey, *data, "--out", str(tmp_path / "g.json")]) == 0
    assert "converted to grey" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "command,message",
    [
        (["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--data-arg", "img_size=abc"],
         "ssl-vit eval: error: --data-arg img_size: Expected a <class 'int'>. Got value: abc"),
        (["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--data-arg", "subset=abc"],
         "ssl-vit eval: error: --data-arg subset: Expected a <class 'int'>"),
        (["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--data-arg", "eval_crop_pct=true"],
         "ssl-vit eval: error: --data-arg eval_crop_pct: Expected a <class 'float'>. Got value: True"),
        (["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, "--data", "imagefolder", "--data-arg", "train_dir=2024"],
         "ssl-vit eval: error: image directory 2024 does not exist or is not a directory"),  # a folder's name stays text
        (["visualize", "random:vit", "--backbone-kwargs", TINY, "--images", "synthetic", "--data-arg", "img_size=abc", "--out", "{tmp}"],
         "ssl-vit visualize: error: --data-arg img_size: Expected a <class 'int'>. Got value: abc"),
    ],
)
def test_a_data_argument_of_the_wrong_type_names_its_key_and_type(tmp_path, capsys, command, message):
    assert cli_main([c.replace("{tmp}", str(tmp_path)) for c in command] + ([] if "--out" in command else ["--out", str(tmp_path)])) == 1
    assert capsys.readouterr().err == message + "\n"


def test_the_types_a_data_argument_is_checked_against():
    from ssl_vit.cli.options import parse_data_args

    parsed = parse_data_args("imagefolder", {"img_size": "28", "train_dir": "2024", "eval_crop_pct": "875e-3", "val_dir": "null", "mean": "[0.5]"})
    assert parsed == {"img_size": 28, "train_dir": "2024", "eval_crop_pct": 0.875, "val_dir": None, "mean": (0.5,)}  # text where text is taken; null is None
    assert parse_data_args("synthetic", {"subset": "null"}) == {"subset": None}
    with pytest.raises(ValueError, match=r"--data-arg img_size: Expected a <class 'int'>. Got value: True"):
        parse_data_args("synthetic", {"img_size": "true"})
    with pytest.raises(ValueError, match=r"--data-arg in_chans: Expected a typing.Literal\[1, 3\]. Got value: 2"):
        parse_data_args("synthetic", {"in_chans": "2"})
    # a text argument keeps "None" as the text it is
    assert parse_data_args("imagefolder", {"train_dir": "None"}) == {"train_dir": "None"}


def test_annotations_are_read_as_python_does_with_none_only_where_allowed():
    from ssl_vit.cli.options import note_channel_conversion
    from ssl_vit.errors import check_argument_types

    class A:
        def __init__(self, x: int, y: float = 1.0) -> None: ...

    class B(A):
        def __init__(self, x: str, **kwargs) -> None: ...

    with pytest.raises(TypeError, match="x must be a string, got 1"):  # the subclass's own annotation
        check_argument_types(B, {"x": 1}, "")
    check_argument_types(B, {"x": "1", "y": "passed on"}, "")  # what it passes on is the base's to check
    def f(x: int, mode: Literal["a", "b"] | None = None) -> None: ...
    with pytest.raises(TypeError, match="x must be an integer, got None"):
        check_argument_types(f, {"x": None}, "")
    with pytest.raises(TypeError, match="mode must be one of 'a', 'b' or null, got 'c'"):
        check_argument_types(f, {"mode": "c"}, "")
    check_argument_types(f, {"mode": None}, "")
    check_argument_types(f, {"x": 3, "y": object()}, "")  # an argument with no annotation of its own, or none at all: not checked
    note_channel_conversion(SimpleNamespace(source=[]), 1, "ssl-vit eval", "--data x")  # an empty split: nothing to say


@pytest.mark.parametrize(
    "args,message",
    [
        (["--images", "synthetic", "--show", "-1"], "--show must be >= 1, got -1"),
        (["--images", "synthetic", "--num-images", "0"], "--num-images must be >= 1, got 0"),
        (["--images", "synthetic", "--out", "{tmp}/rep.md"], "--out {tmp}/rep.md: {tmp}/rep.md exists and is not a folder"),
        (["--images", "synthetic", "--out", "{tmp}/rep.md/figs"], "--out {tmp}/rep.md/figs: cannot create the folder {tmp}/rep.md/figs: {tmp}/rep.md is not a folder"),
        (["--images", "imagefolder"], "--images imagefolder needs --data-arg train_dir=DIR; or name the folder itself: --images DIR"),
    ],
)
def test_visualize_options_are_checked_in_its_own_terms(tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "rep.md").write_text("")
    _not_reached(monkeypatch, message)
    command = ["visualize", "random:vit", "--backbone-kwargs", TINY, "--out", str(tmp_path / "figs"), *args]
    assert cli_main([c.replace("{tmp}", str(tmp_path)) for c in command]) == 1
    assert capsys.readouterr().err == f"ssl-vit visualize: error: {message.format(tmp=tmp_path)}\n"


def test_visualize_notes_colour_images_for_a_grey_backbone(tmp_path, capsys):
    folder = _image_folder(tmp_path / "imgs", {"a": 2})
    grey = json.dumps({**json.loads(TINY), "in_chans": 1})
    assert cli_main(["visualize", "random:vit", "--backbone-kwargs", grey, "--images", str(folder), "--out", str(tmp_path / "figs"),
                     "--num-images", "2", "--show", "1", "--figures", "filters"]) == 0
    assert capsys.readouterr().err.count(f"visualize: note: --images {folder} holds RGB images: they are converted to grey") == 1


def test_resuming_a_pretraining_run_as_a_fine_tuning_is_one_line(tmp_path, capsys):
    ck = _pretraining_checkpoint(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt")
    assert cli_main(["eval", "finetune", "--backbone", str(ck), *SYNTH, "--run-dir", str(tmp_path / "runs" / "tiny"), "--resume",
                     "--out", str(tmp_path / "res")]) == 1
    assert capsys.readouterr().err == (f"ssl-vit eval: error: --run-dir {tmp_path / 'runs' / 'tiny'} holds a pretraining run of MPP, "
                                       "not a fine-tuning run: choose another --run-dir\n")


def test_a_datamodule_of_ones_own_is_named_by_its_dotted_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_data.py").write_text("from ssl_vit.data import SyntheticDataModule\n\n\nclass MySynth(SyntheticDataModule):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = ["--data", "my_data.MySynth", *SYNTH[2:]]
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *data, "--k", "3", "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["data"]["name"] == "my_data.MySynth"
    # ... as a recipe's evaluation and a checkpoint's pretraining data name it (compare pairs them)
    import my_data

    from ssl_vit.eval.results import datamodule_name, pretraining_data

    assert datamodule_name(my_data.MySynth()) == "my_data.MySynth"
    assert pretraining_data({"name": "MySynth", "class": "my_data.MySynth"}) == "my_data.MySynth"
    assert datamodule_name(__import__("ssl_vit.data").data.SyntheticDataModule()) == "synthetic"
    # one of the user's named like a built-in keeps its import path (its records are not the built-in's)
    (tmp_path / "my_named.py").write_text("from ssl_vit.data import SyntheticDataModule as Base\n\n\nclass SyntheticDataModule(Base):\n    pass\n")
    import my_named

    assert datamodule_name(my_named.SyntheticDataModule()) == "my_named.SyntheticDataModule"
    assert pretraining_data({"name": "SyntheticDataModule", "class": "my_named.SyntheticDataModule"}) == "my_named.SyntheticDataModule"
    assert pretraining_data({"name": "SyntheticDataModule", "class": "ssl_vit.data.synthetic.SyntheticDataModule"}) == "synthetic"
    assert cli_main(["visualize", "random:vit", "--backbone-kwargs", TINY, "--images", "my_data.MySynth", *SYNTH[2:8], "--figures", "filters",
                     "--out", str(tmp_path / "figs")]) == 0
    capsys.readouterr()
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--data", "fashion_mnst"]) == 1
    assert "--data fashion_mnst: not a dataset name (did you mean 'fashion_mnist'?) (cifar10, cifar100, fashion_mnist," in capsys.readouterr().err
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--data", "my_data.Nope"]) == 1
    assert "--data my_data.Nope: cannot import it (AttributeError" in capsys.readouterr().err


def test_visualize_names_a_file_given_as_images(tmp_path, capsys):
    (tmp_path / "cat.png").write_bytes(b"not really")
    assert cli_main(["visualize", "random:vit", "--backbone-kwargs", TINY, "--images", str(tmp_path / "cat.png"), "--out", str(tmp_path / "f")]) == 1
    assert f"--images {tmp_path / 'cat.png'}: not a folder of images, a dataset (" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["eval", "linear", "--backbone", "random:vit_tiny", "--epocs", "3"], "unrecognized arguments: --epocs 3 (did you mean '--epochs'?)"),
        (["eval", "knn", "--backbone", "random:vit_tny"], "unknown backbone 'vit_tny' (did you mean 'vit_tiny'?)"),
        (["demo", "--quikc"], "(did you mean '--quick'?)"),
        (["export", "x.ckpt", "--out", "x", "--formt", "onnx"], "(did you mean '--format'?)"),
        (["compare", "results", "--outt", "r.md"], "(did you mean '--out'?)"),
        (["benchmark", "--quik"], "(did you mean '--quick'?)"),
        (["backbones", "--img-sz", "28"], "(did you mean '--img-size'?)"),
        (["backbones", "vit", "--arg", "embed_dims=8"], "--arg embed_dims: no argument of backbone 'vit' (did you mean 'embed_dim'?)"),
        (["visualize", "random:vit_tiny", "--images", "synthetic", "--out", "f", "--figurs", "filters"], "(did you mean '--figures'?)"),
    ],
    ids=["eval-option", "eval-backbone", "demo", "export", "compare", "benchmark", "backbones", "backbones-arg", "visualize"],
)
def test_every_command_answers_a_misspelling_with_its_likely_spelling(tmp_path, monkeypatch, capsys, argv, suggestion):
    monkeypatch.chdir(tmp_path)  # nothing a command might start writes into the checkout
    try:
        status = cli_main(argv)
    except SystemExit as stop:  # argparse's own errors
        status = stop.code
    assert status not in (0, None)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"ssl-vit {argv[0]}") and suggestion in err


def test_a_likely_spelling_is_one_within_reach():
    # difflib's ratio 2M/T, ignoring case: close typos are found, unrelated names are not.
    from ssl_vit.errors import closest, did_you_mean

    assert closest("batchsize", ["batch_size", "seed"]) == "batch_size"
    assert closest("Dino", ["MPP", "DINO"]) == "DINO"
    assert closest("EPOCHS", ["epochs", "seed"]) == "epochs"  # case ignored on both sides
    assert closest("vit_gigantic", ["vit_tiny", "vit_large", "vit_huge"]) is None
    assert closest("k", ["k"]) is None  # the name itself is not a suggestion
    assert did_you_mean("zzz", ["epochs"]) == "" and did_you_mean("epoch", ["epochs"]) == " (did you mean 'epochs'?)"


def test_eval_linear_sweeps_several_lrs_and_records_the_one_it_picked(tmp_path, capsys):
    args = ["eval", "linear", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH, "--epochs", "2", "--warmup-epochs", "0"]
    assert cli_main([*args, "--lr", "0.001", "0.1", "--select-fraction", "0.25", "--out", str(tmp_path / "sweep.json")]) == 0
    record = json.loads((tmp_path / "sweep.json").read_text())["protocol_args"]
    assert record["base_lr"] == [0.001, 0.1] and record["select_fraction"] == 0.25
    assert record["selected_base_lr"] in (0.001, 0.1) and set(record["select_top1"]) == {"0.001", "0.1"}
    assert f"(base_lr {record['selected_base_lr']:g}, picked of 0.001 0.1)" in capsys.readouterr().out
    # one LR: a plain run, recorded as a number
    assert cli_main([*args, "--lr", "0.1", "--out", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())["protocol_args"]
    assert one["base_lr"] == 0.1 and "selected_base_lr" not in one


def test_eval_knn_sweeps_several_k_and_records_the_one_it_picked(tmp_path, capsys):
    args = ["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", TINY, *SYNTH]
    assert cli_main([*args, "--k", "20", "1", "5", "--select-fraction", "0.25", "--out", str(tmp_path / "sweep.json")]) == 0
    record = json.loads((tmp_path / "sweep.json").read_text())
    args_ = record["protocol_args"]
    assert args_["k"] == [20, 1, 5] and args_["select_fraction"] == 0.25 and args_["seed"] == 0
    assert args_["selected_k"] in (20, 1, 5) and set(args_["select_top1"]) == set(args_["test_top1_by_k"]) == {"20", "1", "5"}
    assert record["metrics"]["top1"] == args_["test_top1_by_k"][str(args_["selected_k"])]
    assert f"(k {args_['selected_k']}, picked of 20 1 5)" in capsys.readouterr().out
    # one k: a plain run, recorded as a number
    assert cli_main([*args, "--k", "5", "--out", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())["protocol_args"]
    assert one["k"] == 5 and "selected_k" not in one


@pytest.mark.parametrize("extra, message", [
    (["linear", "--augment", "--lr", "0.1", "0.2"], "--lr: a sweep of several LRs is for the probe on fixed features; with --augment give one"),
    (["frozen", "--lr", "0.1", "-1"], "--lr must be > 0, got 0.1 -1"),
    (["linear", "--lr", "0.1", "--select-fraction", "0.2"], "--select-fraction: holds out features to pick the LR (--lr) or k (--k) of a sweep"),
    (["frozen", "--lr", "0.1", "0.2", "--select-fraction", "1"], "--select-fraction must be in (0, 1), got 1"),
    (["knn", "--k", "1", "0"], "--k must be >= 1, got 1 0"),
    (["knn", "--k", "5", "--select-fraction", "0.2"], "--select-fraction: holds out features to pick the LR (--lr) or k (--k) of a sweep"),
    (["frozen", "--select-fraction", "0.2"], "--select-fraction: holds out features to pick the LR (--lr) or k (--k) of a sweep"),
    (["knn", "--k", "1", "60"],
     "knn: k=60 neighbours, but the k sweep holds out 6 of the 64 training examples (select_fraction 0.1) and leaves 58 to vote"),
    (["knn", "--k", "1", "65"], "knn: k=65 neighbours, but the kNN bank holds 64 training examples"),
    # frozen: what counts is the protocols it runs
    (["frozen", "--protocols", "linear", "--k", "5", "20", "--select-fraction", "0.2"],
     "--select-fraction: holds out features to pick the LR (--lr) or k (--k) of a sweep"),
    (["frozen", "--protocols", "knn", "--lr", "0.1", "0.3", "--select-fraction", "0.2"],
     "--select-fraction: holds out features to pick the LR (--lr) or k (--k) of a sweep"),
])
def test_a_sweep_that_cannot_run_is_refused_before_any_work(capsys, extra, message):
    assert cli_main(["eval", *extra, "--backbone", "random:vit_tiny", *SYNTH]) == 1
    assert message in capsys.readouterr().err


def test_lightnings_advertisement_is_dropped_and_its_start_up_lines_stay():
    import logging

    import lightning.pytorch as pl

    from ssl_vit.cli import _drop_tip, quiet_lightning_tips

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    from lightning_utilities.core import rank_zero

    log = rank_zero.log  # lightning.pytorch's, or pytorch_lightning's once lightly imported that package
    log.removeFilter(_drop_tip)  # as before any ssl-vit command ran in this process
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        pl.Trainer(accelerator="cpu", logger=True, enable_checkpointing=False, enable_progress_bar=False)
        assert any("Tip:" in m for m in seen)  # Lightning's own line, as this test expects it
        seen.clear()
        quiet_lightning_tips()
        quiet_lightning_tips()  # once is enough; twice adds nothing
        pl.Trainer(accelerator="cpu", logger=True, enable_checkpointing=False, enable_progress_bar=False)
        assert seen and not any("Tip:" in m for m in seen)
        assert any("GPU available" in m for m in seen)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def test_an_out_record_file_with_an_upper_case_suffix_is_a_file_not_a_folder(tmp_path):
    from ssl_vit.cli.options import check_out

    out = tmp_path / "new" / "results.JSON"
    check_out(str(out), create=True)
    assert (tmp_path / "new").is_dir() and not out.exists()  # the record's folder is made, not a folder named like it


def test_an_export_over_the_backbone_export_is_refused_however_the_path_is_spelt(tmp_path, monkeypatch):
    from ssl_vit.cli.options import check_export

    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="is the export --backbone reads"):
        check_export("exp", backbone=str(tmp_path / "exp"))  # relative --export, absolute --backbone
    with pytest.raises(ValueError, match="is the export --backbone reads"):
        check_export(str(tmp_path / "exp"), backbone="./exp/../exp")


def test_layer_decay_one_means_no_decay_and_is_accepted():
    import argparse

    from ssl_vit.cli.eval import RULES
    from ssl_vit.errors import check_option_values

    check_option_values(argparse.Namespace(layer_decay=1.0), RULES)  # "(0, 1] (1: no decay)"
    check_option_values(argparse.Namespace(layer_decay=0.75), RULES)
    for bad in (0.0, 1.01):
        with pytest.raises(ValueError, match="--layer-decay must be in"):
            check_option_values(argparse.Namespace(layer_decay=bad), RULES)


def test_data_args_override_the_recorded_normalisation_and_the_backbone_size():
    from types import SimpleNamespace

    from ssl_vit.cli.options import build_datamodule

    grey = SimpleNamespace(img_size=(28, 28), in_chans=1)
    recorded = {"kind": "lightning", "normalization_source": "recorded", "mean": [0.3], "std": [0.2]}
    assert tuple(build_datamodule("fashion_mnist", grey, recorded, {}, None).mean) == (0.3,)
    dm = build_datamodule("fashion_mnist", grey, recorded, {"mean": (0.5,), "std": (0.25,), "img_size": 14}, None)
    assert tuple(dm.mean) == (0.5,) and tuple(dm.std) == (0.25,)  # what the user asked for wins
    assert dm.img_size == 14
