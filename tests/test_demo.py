"""The main job: `ssl-vit demo` runs end to end, and its settings are the shipped Fashion-MNIST recipes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from ssl_vit.cli import main as cli_main
from ssl_vit.cli.demo import DEMO_BACKBONE, DEMO_BACKBONE_NAME, RECIPES, Budget, earlier_run
from ssl_vit.cli.demo import main as demo_main

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes" / "fashion_mnist"


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("method", sorted(RECIPES))
def test_demo_settings_are_the_fashion_mnist_recipe(method):
    recipe = RECIPES[method]
    cfg = yaml.safe_load((RECIPE_DIR / f"{method}.yaml").read_text())
    model = cfg["model"]
    assert model["class_path"] == recipe.model_class
    expected = {"backbone": DEMO_BACKBONE_NAME, "backbone_kwargs": DEMO_BACKBONE, **{k: _plain(v) for k, v in recipe.model_args.items()}}
    assert model["init_args"] == expected
    views = cfg["data"]["init_args"]["views"]
    assert views["class_path"] == recipe.views_class
    assert views.get("init_args", {}) == {k: _plain(v) for k, v in recipe.views_args.items()}
    batch = Budget.default().batch_size
    assert cfg["data"]["init_args"]["batch_size"] == batch
    assert cfg["trainer"]["max_steps"] == round(recipe.epochs * (60000 // batch))
    # ... and its evaluation is the demo's (the same 20k training images: both draw them with seed 0)
    budget = Budget.default()
    unseeded = {name: {k: v for k, v in kwargs.items() if k != "seed"} for name, kwargs in budget.protocols(seed=0).items()}
    assert cfg["evaluate"] == {"protocols": ["linear", "knn"], "train_subset": budget.eval_train, "batch_size": 512, **unseeded}


def test_demo_quick_runs_end_to_end(tmp_path, capsys, monkeypatch):
    import ssl_vit.cli.demo

    models, evaluated = {}, {}
    real_pretrain, real_evaluate = ssl_vit.cli.demo.pretrain, ssl_vit.cli.demo.evaluate

    def pretrain(recipe, *args, **kwargs):
        model, record = real_pretrain(recipe, *args, **kwargs)
        models[recipe.method] = model
        return model, record

    def evaluate(label, backbone, *args, **kwargs):
        evaluated[label] = backbone
        return real_evaluate(label, backbone, *args, **kwargs)

    monkeypatch.setattr(ssl_vit.cli.demo, "pretrain", pretrain)
    monkeypatch.setattr(ssl_vit.cli.demo, "evaluate", evaluate)
    out = tmp_path / "demo"
    args = ["demo", "--quick", "--subset", "256", "--epochs", "0.5", "--eval-train", "512", "--eval-test", "256", "--out", str(out), "--no-progress"]
    assert cli_main(args) == 0
    # DINO is evaluated on its teacher (DINO §3.1 / the paper's tables), the others on their backbone
    assert evaluated["dino"] is models["dino"].teacher_backbone
    assert all(evaluated[m] is models[m].backbone for m in ("mpp", "mocov3", "supervised"))
    printed = capsys.readouterr().out
    for method in ("mpp", "mocov3", "dino", "supervised", "random"):
        assert method in printed
    results = json.loads((out / "results.json").read_text())
    assert {(r["method"], r["protocol"]) for r in results} == {(m, p) for m in ("mpp", "mocov3", "dino", "supervised", "random") for p in ("linear", "knn")}
    assert all(0.0 <= r["metrics"]["top1"] <= 1.0 for r in results)
    assert all(r["data"]["test_size"] == 256 and r["data"]["train_size"] == 512 for r in results)  # --eval-test / --eval-train
    # each pretraining's compute is recorded: the report's accuracy-vs-compute plot (ViT Fig. 5)
    assert all(r["pretrain"]["flops"] > 0 for r in results if r["method"] != "random")
    # --subset 256 at batch 128: 2 steps per epoch, so --epochs 0.5 is one step of each method
    assert all((r["pretrain"]["steps"], r["pretrain"]["epochs"]) == (1, 0.5) for r in results if r["method"] != "random")
    assert (out / "report.md").is_file() and (out / "report_bars.png").stat().st_size > 1000
    assert (out / "report_compute.png").stat().st_size > 1000
    assert "**Note:** --quick is a smoke run" in (out / "report.md").read_text()  # the report read alone says so too
    assert any((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert (out / "runs" / "dino" / "checkpoints" / "last.ckpt").is_file()
    # each method's records sit beside its checkpoints: an export of one carries them
    from ssl_vit.export import export_backbone

    exported = export_backbone(out / "runs" / "dino" / "checkpoints" / "last.ckpt", tmp_path / "exp").config["ssl_vit"]["results"]
    assert sorted((r["method"], r["protocol"]) for r in exported) == [("dino", "knn"), ("dino", "linear")]
    assert out / "results.json" in earlier_run(out)  # a second run into `out` is refused


def test_a_short_probe_warms_up_over_a_fifth_of_its_epochs():
    from dataclasses import replace

    assert Budget.default().protocols(seed=0)["linear"]["warmup_epochs"] == 10  # MAE's linear probe: 10 of 90-100
    assert replace(Budget.quick(), probe_epochs=20).protocols(seed=3)["linear"] == {
        "epochs": 20, "base_lr": list(Budget.quick().probe_lrs), "warmup_epochs": 4, "select_fraction": 0.1, "seed": 3}


@pytest.fixture()
def no_training(monkeypatch):
    """A demo that must stop before it trains anything."""
    import ssl_vit.cli.demo

    def pretrain(*args, **kwargs):
        raise AssertionError("the demo started training")

    monkeypatch.setattr(ssl_vit.cli.demo, "pretrain", pretrain)


@pytest.mark.parametrize("option, value, message", [
    ("--epochs", "0", "--epochs must be a positive number, got 0"),
    ("--epochs", "-1", "--epochs must be a positive number, got -1"),
    ("--epochs", "nan", "--epochs must be a positive number, got nan"),
    ("--epochs", "inf", "--epochs must be a positive number, got inf"),
    ("--subset", "0", "--subset must be in 128..60000"),
    ("--subset", "100", "--subset must be in 128..60000 (at least one batch of 128"),
    ("--subset", "70000", "--subset must be in 128..60000"),
    ("--eval-train", "0", "--eval-train must be in 222..60000 (enough for the kNN's largest k=200 beside the 10% held out to pick k"),
    ("--eval-train", "221", "--eval-train must be in 222..60000"),
    ("--eval-train", "60001", "--eval-train must be in 222..60000"),
    ("--eval-test", "0", "--eval-test must be in 1..10000"),
    ("--eval-test", "10001", "--eval-test must be in 1..10000"),
    ("--num-workers", "-1", "--num-workers must be >= 0, got -1"),
    ("--seed", "-1", "--seed must be in 0..4294967295, got -1"),
])
def test_demo_refuses_bad_numbers_before_training(no_training, tmp_path, option, value, message):
    out = tmp_path / "demo"
    with pytest.raises(ValueError, match=re.escape(message)):
        demo_main([option, value, "--out", str(out)])
    assert not out.exists()  # nothing started


def test_demo_errors_are_one_line(no_training, tmp_path, capsys):
    assert cli_main(["demo", "--eval-train", "0", "--out", str(tmp_path / "demo")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ssl-vit demo: error: --eval-train must be in 222..60000") and "\n" not in err


def test_demo_refuses_to_overwrite_an_earlier_run(no_training, tmp_path):
    # The demo has no resume: a second run into the same --out would retrain every method from
    # scratch over the first run's checkpoints and results.
    out = tmp_path / "demo"
    ckpt = out / "runs" / "mpp" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"the first run")
    with pytest.raises(FileExistsError, match=re.escape(f"{out} already holds a demo run (checkpoints and results: {ckpt.parent})") + ".*another --out.*remove"):
        demo_main(["--quick", "--out", str(out)])
    assert ckpt.read_bytes() == b"the first run"
    ckpt.unlink()
    (out / "results.json").write_text("[]")
    with pytest.raises(FileExistsError, match="results.json"):
        demo_main(["--quick", "--out", str(out)])
    (out / "results.json").unlink()
    # a folder without either (an interrupted run's logs, or anything else) is used
    assert earlier_run(out) == []


def test_demo_out_must_be_a_folder(no_training, tmp_path):
    afile = tmp_path / "demo"
    afile.write_text("")
    with pytest.raises(NotADirectoryError, match="is a file"):
        demo_main(["--out", str(afile)])
