"""The main job: `ssl-vit demo` runs end to end, and its settings are the shipped Fashion-MNIST recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ssl_vit.cli import main as cli_main
from ssl_vit.demo import DEMO_BACKBONE, DEMO_BACKBONE_NAME, RECIPES, Budget

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
    assert cfg["evaluate"] == {
        "protocols": ["linear", "knn"], "train_subset": budget.eval_train, "batch_size": 512,
        "linear": {"epochs": budget.probe_epochs, "base_lr": budget.probe_lr, "warmup_epochs": min(10, budget.probe_epochs // 5)},
        "knn": {"k": 20, "temperature": 0.07},
    }


def test_demo_quick_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    args = ["demo", "--quick", "--subset", "256", "--epochs", "0.5", "--eval-train", "512", "--eval-test", "256", "--out", str(out), "--no-progress"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    for method in ("mpp", "mocov3", "dino", "supervised", "random"):
        assert method in printed
    results = json.loads((out / "results.json").read_text())
    assert {(r["method"], r["protocol"]) for r in results} == {(m, p) for m in ("mpp", "mocov3", "dino", "supervised", "random") for p in ("linear", "knn")}
    assert all(0.0 <= r["metrics"]["top1"] <= 1.0 for r in results)
    assert (out / "report.md").is_file() and (out / "report_bars.png").stat().st_size > 1000
    assert any((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert (out / "runs" / "dino" / "checkpoints" / "last.ckpt").is_file()
