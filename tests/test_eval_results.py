import json
import os

import pytest

from ssl_vit import __version__
from ssl_vit.eval.results import EvalResult


def _result(**kw) -> EvalResult:
    args = dict(
        method="dino",
        backbone={"name": "vit_tiny", "kwargs": {"patch_size": 4, "img_size": 28, "in_chans": 1}},
        data={"name": "fashion_mnist", "train_split": "train", "test_split": "test", "train_size": 60000},
        protocol="knn",
        metrics={"top1": 0.81234, "top5": 0.99},
        protocol_args={"k": 20, "temperature": 0.07, "mode": "cls"},
        pretrain={"steps": 1000, "epochs": 10, "flops": 1.5e15, "wall_time_s": 600.0},
        source="runs/dino/last.ckpt",
    )
    args.update(kw)
    return EvalResult(**args)


def test_json_round_trip(tmp_path):
    r = _result()
    path = r.to_json(tmp_path / "sub" / "knn.json")
    back = EvalResult.from_json(path)
    assert back == r
    d = json.loads(path.read_text())
    assert d["ssl_vit_version"] == __version__ and d["metrics"]["top1"] == 0.81234 and d["created"]


def test_summary_line():
    assert _result().summary_line() == "knn       dino  vit_tiny/4  fashion_mnist  top1=81.23% top5=99.00%"
    few = _result(protocol="fewshot", metrics={"5shot": 0.5, "5shot_std": 0.01}, backbone={"name": "resnet18"})
    assert few.summary_line() == "fewshot   dino  resnet18  fashion_mnist  5shot=50.00%"


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    _result().to_json(path)
    original = path.read_text()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        _result(metrics={"top1": 0.1}).to_json(path)
    assert path.read_text() == original  # the old record is intact
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # and no temporary file is left


def test_bad_records_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        EvalResult.from_json(bad)
    d = _result().to_dict()
    bad.write_text(json.dumps({**d, "accuracy": 1.0}))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['accuracy'\]"):
        EvalResult.from_json(bad)
    bad.write_text(json.dumps({k: v for k, v in d.items() if k not in ("metrics", "protocol")}))
    with pytest.raises(ValueError, match=r"missing field\(s\) \['protocol', 'metrics'\]"):
        EvalResult.from_json(bad)
    bad.write_text(json.dumps({**d, "protocol": "svm"}))
    with pytest.raises(ValueError, match="protocol must be one of"):
        EvalResult.from_json(bad)
    bad.write_text(json.dumps({**d, "metrics": {"top1": "high"}}))
    with pytest.raises(ValueError, match="'top1' must be a finite number"):
        EvalResult.from_json(bad)
    bad.write_text(json.dumps({**d, "metrics": {"top1": True}}))  # JSON true is no accuracy of 1.0
    with pytest.raises(ValueError, match="'top1' must be a finite number, got True"):
        EvalResult.from_json(bad)
    with pytest.raises(FileNotFoundError):
        EvalResult.from_json(tmp_path / "missing.json")


def test_a_record_refuses_non_finite_metrics_and_an_empty_source_and_labels_an_encoders_read_out():
    # results.py EvalResult: a NaN / inf metric would sort and plot as a number; "" names no
    # checkpoint; a chosen encoder and a feature mode both tell the row apart.
    backbone, data = {"name": "vit_tiny", "kwargs": {"patch_size": 4}}, {"name": "fashion_mnist"}
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"'top1' must be a finite number, got {bad}"):
            EvalResult("dino", backbone, data, "knn", {"top1": bad})
    with pytest.raises(ValueError, match="source must be a non-empty string"):
        EvalResult("dino", backbone, data, "knn", {"top1": 0.5}, source="")
    student = EvalResult("dino", {**backbone, "encoder": "student"}, data, "knn", {"top1": 0.5}, protocol_args={"features": "last4"})
    assert student.label == "vit_tiny/4 [student, last4]"
