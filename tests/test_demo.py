"""The main job: `ssl-vit demo` runs the shipped Fashion-MNIST recipes end to end, with the few-label regime."""

from __future__ import annotations

import json
import re

import pytest

from ssl_vit.cli import main as cli_main
from ssl_vit.cli.demo import main as demo_main


def test_demo_quick_runs_the_recipes_end_to_end_with_few_labels(tmp_path, capsys):
    out = tmp_path / "demo"
    args = ["demo", "--quick", "--methods", "dino", "supervised", "--subset", "512", "--epochs", "0.25", "--label-fractions", "0.5", "--draws", "1",
            "--out", str(out), "--no-progress"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    kinds = sorted({(r["method"], r["protocol"], r["data"]["train_size"]) for r in results})
    # every backbone at full labels (the 512 training images); DINO's and random init's linear probe
    # on 256 of them; the supervised recipe trained on those 256 alone (the draw with --seed)
    assert kinds == sorted([(m, p, 512) for m in ("dino", "supervised", "random") for p in ("linear", "knn")]
                           + [("dino", "linear", 256), ("random", "linear", 256), ("supervised", "linear", 256), ("supervised", "knn", 256)])
    assert [r["protocol_args"]["seed"] for r in results if r["method"] == "dino" and r["data"]["train_size"] == 256] == [0]
    assert (out / "runs" / "supervised_256_labels_draw0" / "checkpoints" / "last.ckpt").is_file()
    assert all(0.0 <= r["metrics"]["top1"] <= 1.0 for r in results) and all(r["data"]["test_size"] == 2000 for r in results)
    # the recipe's length at --epochs 0.25 of 512 images: one step; its compute recorded (ViT Fig. 5)
    assert all(r["pretrain"]["steps"] == 1 and r["pretrain"]["flops"] > 0 for r in results if r["method"] == "dino")
    report = (out / "report.md").read_text()
    assert "## Few labels" in report and "256 labels" in printed and "**Note:** --quick is a smoke run" in report
    assert (out / "report_labels.png").stat().st_size > 1000 and (out / "report_compute.png").stat().st_size > 1000
    assert any((out / "runs" / "dino").rglob("events.out.tfevents.*"))
    # each method's results sit beside its checkpoints: an export of one carries them
    from ssl_vit.export import export_backbone

    exported = export_backbone(out / "runs" / "dino" / "checkpoints" / "last.ckpt", tmp_path / "exp").config["ssl_vit"]["results"]
    assert {(r["method"], r["protocol"]) for r in exported} == {("dino", "knn"), ("dino", "linear")}
    with pytest.raises(FileExistsError, match=re.escape(f"{out} already holds a demo run")):  # a second run into `out`
        demo_main(["--quick", "--out", str(out)])


@pytest.mark.parametrize("option, value, message", [
    ("--epochs", "0", "--epochs: 0: give a positive number"),
    ("--epochs", "nan", "--epochs: nan: give a positive number"),
    ("--subset", "100", "--subset: 100: give 256..60000 images"),
    ("--subset", "70000", "--subset: 70000: give 256..60000 images"),
    ("--label-fractions", "1.5", "--label-fractions: 1.5: give a share in (0, 1]"),
    ("--draws", "0", "--draws: 0: give 1..100"),
    ("--num-workers", "-1", "--num-workers: -1: give 0 or more"),
])
def test_demo_refuses_bad_numbers_before_training(tmp_path, option, value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["demo", option, value, "--out", str(tmp_path / "demo")])
    assert exit_.value.code == 2 and f"argument {message}" in capsys.readouterr().err and not (tmp_path / "demo").exists()


def test_demo_refuses_an_out_that_is_a_file_or_holds_a_run_and_names_a_missing_recipe(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(NotADirectoryError, match="is a file"):
        demo_main(["--out", str(afile)])
    ckpt = tmp_path / "demo" / "runs" / "mpp" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"the first run")
    with pytest.raises(FileExistsError, match=re.escape(f"already holds a demo run ({ckpt.parent})") + ".*another --out"):
        demo_main(["--out", str(tmp_path / "demo")])
    assert ckpt.read_bytes() == b"the first run"
    with pytest.raises(FileNotFoundError, match="no recipe .*supervised.yaml; name the folder of the Fashion-MNIST recipes with --recipes"):
        demo_main(["--recipes", str(tmp_path), "--out", str(tmp_path / "other")])
