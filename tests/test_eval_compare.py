import json
import re

import pytest

from ssl_vit.cli.compare import main
from ssl_vit.eval.compare import build_comparison, load_results
from ssl_vit.eval.report import backbone_family, compute_ticks
from ssl_vit.eval.results import EvalResult

BACKBONE = {"name": "vit_tiny", "kwargs": {"patch_size": 4}}
DATA = {"name": "fashion_mnist"}
# (method, protocol, metrics, flops)
RECORDS = [
    ("dino", "knn", {"top1": 0.80, "top5": 0.99}, 2e15),
    ("mocov3", "knn", {"top1": 0.78, "top5": 0.98}, 3e15),
    ("supervised", "knn", {"top1": 0.85, "top5": 0.995}, 1e15),
    ("random", "knn", {"top1": 0.70, "top5": 0.95}, None),
    ("dino", "linear", {"top1": 0.83, "top5": 0.99}, 2e15),
    ("supervised", "linear", {"top1": 0.88, "top5": 0.99}, 1e15),
    ("random", "linear", {"top1": 0.72, "top5": 0.97}, None),
    ("dino", "fewshot", {"1shot": 0.4, "5shot": 0.60, "5shot_std": 0.02}, 2e15),
    ("random", "fewshot", {"1shot": 0.3, "5shot": 0.40, "5shot_std": 0.03}, None),
]


@pytest.fixture()
def results_dir(tmp_path):
    d = tmp_path / "results"
    for i, (method, protocol, metrics, flops) in enumerate(RECORDS):
        pretrain = {"flops": flops} if flops else {}
        EvalResult(method, BACKBONE, DATA, protocol, metrics, pretrain=pretrain, created=f"2025-01-01T00:00:{i:02d}",
                   source="random" if method == "random" else f"{method}.ckpt").to_json(d / f"{method}_{protocol}.json")
    # an older duplicate (must lose to the newer record) and a JSON that is no result (skipped)
    EvalResult("dino", BACKBONE, DATA, "knn", {"top1": 0.10}, created="2024-01-01T00:00:00", pretrain={"flops": 2e15},
               source="dino.ckpt").to_json(d / "old" / "dino_knn.json")
    (d / "config.json").write_text(json.dumps({"backbone": "vit_tiny", "img_size": 28}))
    return d


def test_delta_values(results_dir):
    cmp = build_comparison(load_results([results_dir]))
    dino, sup = ("dino", "vit_tiny/4", "fashion_mnist"), ("supervised", "vit_tiny/4", "fashion_mnist")
    assert cmp.get(dino, "knn", "top1") == pytest.approx(0.80)
    assert cmp.get(dino, "knn", "Δ sup") == pytest.approx(0.80 - 0.85)
    assert cmp.get(dino, "knn", "Δ rand") == pytest.approx(0.80 - 0.70)
    assert cmp.get(dino, "linear", "Δ sup") == pytest.approx(0.83 - 0.88)
    assert cmp.get(dino, "fewshot", "Δ rand") == pytest.approx(0.60 - 0.40)  # main few-shot metric: 5-shot
    assert ("fewshot", "Δ sup") not in cmp.columns  # no supervised few-shot record
    assert cmp.get(("mocov3", "vit_tiny/4", "fashion_mnist"), "linear", "top1") is None
    assert cmp.get(sup, "knn", "Δ sup") == pytest.approx(0.0)
    assert ("fewshot", "5shot_std") not in cmp.columns
    assert [r[0] for r in cmp.rows] == ["dino", "mocov3", "supervised", "random"]


def test_the_probe_on_augmented_images_is_its_own_column_beside_the_fixed_one(results_dir):
    for method, top1 in (("dino", 0.85), ("supervised", 0.90)):
        EvalResult(method, BACKBONE, DATA, "linear_aug", {"top1": top1}, source=f"{method}.ckpt").to_json(results_dir / f"{method}_linear_aug.json")
    cmp = build_comparison(load_results([results_dir]))
    dino = ("dino", "vit_tiny/4", "fashion_mnist")
    assert cmp.get(dino, "linear", "top1") == pytest.approx(0.83)  # not replaced by the other protocol's record
    assert cmp.get(dino, "linear_aug", "top1") == pytest.approx(0.85)
    assert cmp.get(dino, "linear_aug", "Δ sup") == pytest.approx(0.85 - 0.90)


def test_what_a_sweep_picked_is_a_column_beside_its_score_and_absent_without_sweeps(results_dir, tmp_path, capsys):
    picks = {("dino", "linear"): {"base_lr": [0.1, 1.0], "selected_base_lr": 0.1}, ("dino", "knn"): {"k": [10, 20], "selected_k": 20},
             ("random", "knn"): {"k": [10, 20], "selected_k": 10}}
    for (method, protocol), args in picks.items():
        path = results_dir / f"{method}_{protocol}.json"
        record = EvalResult.from_json(path)
        record.protocol_args = args
        record.to_json(path)
    cmp = build_comparison(load_results([results_dir]))
    dino, sup = ("dino", "vit_tiny/4", "fashion_mnist"), ("supervised", "vit_tiny/4", "fashion_mnist")
    assert cmp.get(dino, "linear", "LR") == 0.1 and cmp.get(dino, "knn", "k") == 20
    assert cmp.get(sup, "knn", "k") is None  # that record ran one k
    assert ("fewshot", "LR") not in cmp.columns and ("fewshot", "k") not in cmp.columns
    # placed after the protocol's metrics, before its differences
    knn = [c for p, c in cmp.columns if p == "knn"]
    assert knn == ["top1", "top5", "k", "Δ sup", "Δ rand"]
    assert main([str(results_dir), "--out", str(tmp_path / "r.md"), "--no-plots"]) == 0
    text = capsys.readouterr().out
    head, dino_line = [re.split(r"\s{2,}", line) for line in text.splitlines() if line.startswith(("method ", "dino "))]
    shown = dict(zip(head, dino_line))
    assert (shown["linear LR"], shown["knn k"], shown["linear top1"]) == ("0.1", "20", "83.00")  # settings as set, scores in %
    assert "LR / k: what the row's sweep picked" in (tmp_path / "r.md").read_text()
    # records without a sweep: no such column
    plain = build_comparison([r for r in load_results([results_dir]) if not r.protocol_args])
    assert not any(c in ("LR", "k") for _, c in plain.columns)


def test_another_representation_is_another_row_and_another_file(tmp_path):
    from ssl_vit.eval.results import result_path

    def linear(method, features, top1):
        return EvalResult(method, BACKBONE, DATA, "linear", {"top1": top1}, protocol_args={"features": features})

    records = [linear("dino", "cls", 0.80), linear("dino", "last4", 0.83), linear("supervised", "last4", 0.85)]
    cmp = build_comparison(records)
    assert cmp.get(("dino", "vit_tiny/4", "fashion_mnist"), "linear", "top1") == pytest.approx(0.80)
    last4 = ("dino", "vit_tiny/4 [last4]", "fashion_mnist")
    assert cmp.get(last4, "linear", "Δ sup") == pytest.approx(0.83 - 0.85)  # against supervised on last4
    assert cmp.get(("dino", "vit_tiny/4", "fashion_mnist"), "linear", "Δ sup") is None  # no supervised [CLS] record
    paths = {result_path(tmp_path, r).name for r in records}
    assert paths == {"dino_vit_tiny-4_fashion_mnist_linear.json", "dino_vit_tiny-4_fashion_mnist_linear-last4.json",
                     "supervised_vit_tiny-4_fashion_mnist_linear-last4.json"}


def test_main_writes_report_and_figures(results_dir, tmp_path, capsys):
    out = tmp_path / "report" / "report.md"
    assert main([str(results_dir), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    table = text.split("\nwrote")[0].splitlines()
    assert table[0].split()[:4] == ["method", "backbone", "linear", "top1"]
    dino_line = next(line for line in table if line.startswith("dino "))
    assert "-5.00" in dino_line and "+10.00" in dino_line and "80.00" in dino_line
    assert len({len(line) for line in table[:2]}) == 1  # header and rule line up
    md = out.read_text()
    assert "| dino | vit_tiny/4 |" in md and "-5.00" in md and "![report_bars](report_bars.png)" in md
    for name in ("report_bars.png", "report_compute.png"):
        assert (out.parent / name).read_bytes()[:4] == b"\x89PNG"


def spy_on_axes(monkeypatch) -> list:
    """The axes of every figure compare draws from now on (filled as they are made)."""
    from ssl_vit.eval import report

    axes: list = []
    real_figure = report._figure

    def spy(*args, **kwargs):
        fig, made = real_figure(*args, **kwargs)
        axes.extend(made)
        return fig, made

    monkeypatch.setattr(report, "_figure", spy)
    return axes


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_results([tmp_path / "nothing.json"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no results found"):
        load_results([tmp_path / "empty"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"protocol": "knn", "metrics": {}, "method": "x"}))
    with pytest.raises(ValueError, match="missing field"):
        load_results([tmp_path])


def test_a_folder_without_records_says_why_each_file_was_skipped(tmp_path, results_dir):
    d = tmp_path / "none"
    d.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"no results found in {d} (no *.json files)")):
        load_results([d])
    (d / "a.json").write_text(json.dumps({"method": "dino"}))
    (d / "b.json").write_text(json.dumps([1, 2]))
    (d / "c.json").write_text(json.dumps([{"method": "dino"}, {"protocol": "knn"}]))
    (d / "d.json").write_text("not json")
    (d / "e.json").write_text("[]")
    with pytest.raises(ValueError) as err:
        load_results([d])
    assert str(err.value) == (
        f"no results found in {d}: {d / 'a.json'}: no 'protocol'/'metrics' fields; "
        f"{d / 'b.json'}: item [0] of a list: a JSON number, not an object; "
        f"{d / 'c.json'}: item [0] of a list: no 'protocol'/'metrics' fields; and 2 more file(s)"
    )
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match=re.escape(f"no results found in {empty}: {empty}: an empty list")):
        load_results([empty])
    # beside records, files that hold none are still skipped without a word
    assert len(load_results([d, results_dir])) == len(load_results([results_dir]))


def test_another_encoder_is_another_row_compared_with_the_same_baseline(tmp_path):
    # DINO's student beside its teacher (the default): two rows and two files, both compared
    # with the supervised row of the same backbone.
    from ssl_vit.eval.results import result_path
    from ssl_vit.export import chosen_encoder

    assert chosen_encoder({"method": "dino", "which": "student"}) == "student"
    assert chosen_encoder({"method": "dino", "which": "teacher"}) is None
    assert chosen_encoder({"method": "mocov3", "which": "student"}) is None
    assert chosen_encoder({"method": "mocov3", "which": "momentum"}) == "momentum"
    student = {**BACKBONE, "encoder": "student"}
    records = [EvalResult("dino", BACKBONE, DATA, "knn", {"top1": 0.80}), EvalResult("dino", student, DATA, "knn", {"top1": 0.78}),
               EvalResult("supervised", BACKBONE, DATA, "knn", {"top1": 0.85})]
    cmp = build_comparison(records)
    assert cmp.get(("dino", "vit_tiny/4", "fashion_mnist"), "knn", "Δ sup") == pytest.approx(0.80 - 0.85)
    assert cmp.get(("dino", "vit_tiny/4 [student]", "fashion_mnist"), "knn", "Δ sup") == pytest.approx(0.78 - 0.85)
    assert {result_path(tmp_path, r).name for r in records[:2]} == {"dino_vit_tiny-4_fashion_mnist_knn.json", "dino_vit_tiny-4-student_fashion_mnist_knn.json"}
    # a baseline of a chosen encoder (a supervised run's EMA weights) is still the reference
    ema = EvalResult("supervised", {**BACKBONE, "encoder": "ema"}, DATA, "knn", {"top1": 0.86})
    cmp = build_comparison([records[0], ema])
    assert cmp.get(("dino", "vit_tiny/4", "fashion_mnist"), "knn", "Δ sup") == pytest.approx(0.80 - 0.86)


def test_metric_columns_are_in_numeric_order_and_right_aligned():
    # compare.py: top-k columns by k (top5 before top10), then the few-shot ones by shots; the
    # Markdown table right-aligns every number column.
    from ssl_vit.eval.report import format_markdown

    cmp = build_comparison([EvalResult("dino", BACKBONE, DATA, "knn", {"top10": 0.9, "top5": 0.8, "top1": 0.5})])
    assert [c for p, c in cmp.columns] == ["top1", "top5", "top10"]
    align = [line for line in format_markdown(cmp).splitlines() if line.startswith("| ---")][0]
    assert align == "| --- | --- | ---: | ---: | ---: |"


def test_a_list_of_records_in_one_file_is_read(results_dir, tmp_path):
    # The demo writes its records as one JSON list (results.json).
    records = [r.to_dict() for r in load_results([results_dir])]
    listed = tmp_path / "results.json"
    listed.write_text(json.dumps(records))
    assert [r.to_dict() for r in load_results([listed])] == records
    listed.write_text(json.dumps([records[0], {"protocol": "knn"}]))
    with pytest.raises(ValueError, match=r"results\.json\[1\]: missing field"):
        load_results([listed])


@pytest.mark.parametrize("lo, hi, want", [
    (1.27e11, 1.9e11, [1.4e11, 1.6e11, 1.8e11]),  # within a decade: no minor labels to collide
    (5e9, 3e11, [5e9, 1e10, 2e10, 5e10, 1e11, 2e11]),
    (1e9, 1e18, [1e9, 1e11, 1e13, 1e15, 1e17]),
])
def test_compute_axis_ticks_are_few_and_round(lo, hi, want):
    assert compute_ticks(lo, hi) == pytest.approx(want)


def test_a_range_narrower_than_any_round_step_is_ticked_at_its_ends():
    # report.compute_ticks promises two to six ticks: 1.05e9..1.15e9 holds only 1.1e9 of
    # the finest round steps, so the ends are the ticks.
    assert compute_ticks(1.05e9, 1.15e9) == [1.05e9, 1.15e9]


def test_backbone_families_of_figure_5():
    assert [backbone_family(n) for n in ("vit_small", "vit", "resnet50", "hybrid_r50_vit_base")] == ["ViT", "ViT", "ResNet", "hybrid"]


def test_image_folder_datasets_are_told_apart_in_rows_baselines_files_and_the_compute_plot(tmp_path, monkeypatch):
    from ssl_vit.eval import report
    from ssl_vit.eval.results import result_path

    def record(method, train_dir, top1, flops):
        data = {"name": "imagefolder", "train_dir": train_dir, "val_dir": train_dir.replace("train", "val")}
        return EvalResult(method, BACKBONE, data, "linear", {"top1": top1}, pretrain={"flops": flops} if flops else {})

    records = [record("dino", "/data/imagenet/train", 0.70, 2e15), record("supervised", "/data/flowers/train", 0.95, 1e15),
               record("dino", "/data/flowers/train", 0.90, 2e15)]
    cmp = build_comparison(records)
    imagenet, flowers = ("dino", "vit_tiny/4", "imagefolder:imagenet/train"), ("dino", "vit_tiny/4", "imagefolder:flowers/train")
    assert cmp.get(imagenet, "linear", "top1") == pytest.approx(0.70) and cmp.get(flowers, "linear", "top1") == pytest.approx(0.90)
    assert cmp.get(imagenet, "linear", "Δ sup") is None  # no supervised record on that dataset
    assert cmp.get(flowers, "linear", "Δ sup") == pytest.approx(0.90 - 0.95)
    assert len({result_path(tmp_path, r) for r in records}) == 3  # no record overwrites another on disk
    axes = spy_on_axes(monkeypatch)
    report.plot_compute(records, tmp_path / "compute.png")
    lines = sorted((line.get_label(), len(line.get_xdata())) for ax in axes for line in ax.get_lines())
    assert lines == [("dino, imagefolder:flowers/train", 1), ("dino, imagefolder:imagenet/train", 1),
                     ("supervised, imagefolder:flowers/train", 1)]


def test_a_folder_with_the_demos_records_and_its_list_reads_each_record_once(results_dir, tmp_path):
    records = load_results([results_dir])
    (results_dir / "results.json").write_text(json.dumps([r.to_dict() for r in records]))
    assert len(load_results([results_dir])) == len(records)
    only_list = tmp_path / "demo_out"
    only_list.mkdir()
    (only_list / "results.json").write_text(json.dumps([r.to_dict() for r in records]))
    assert len(load_results([only_list])) == len(records)


def knn_of(source, top1, created="2025-01-01T00:00:00", method="dino", **pretrain):
    return EvalResult(method, BACKBONE, DATA, "knn", {"top1": top1}, pretrain=pretrain, source=source, created=created)


def test_each_pretraining_is_a_row_of_its_own_and_a_point_of_the_compute_plot(tmp_path, monkeypatch):
    # The same run's last.ckpt at two lengths and another run: three rows told apart by their
    # epochs, each compared with the supervised row; re-evaluating one pretraining replaces it.
    from ssl_vit.eval import report

    records = [knn_of("runs/a/last.ckpt", 0.70, steps=100, epochs=10, flops=1e15),
               knn_of("runs/a/last.ckpt", 0.80, steps=300, epochs=30, flops=3e15),
               knn_of("runs/a/last.ckpt", 0.81, "2025-01-02T00:00:00", steps=300, epochs=30, flops=3e15),  # evaluated again
               knn_of("./runs/b/../b/last.ckpt", 0.75, steps=200, epochs=20, flops=2e15),
               knn_of("sup.ckpt", 0.85, method="supervised", steps=100, epochs=10)]
    cmp = build_comparison(records)
    rows = {row[1]: row for row in cmp.rows if row[0] == "dino"}
    assert sorted(rows) == ["vit_tiny/4 (10 ep)", "vit_tiny/4 (20 ep)", "vit_tiny/4 (30 ep)"]
    assert cmp.get(rows["vit_tiny/4 (30 ep)"], "knn", "top1") == pytest.approx(0.81)
    assert cmp.get(rows["vit_tiny/4 (10 ep)"], "knn", "Δ sup") == pytest.approx(0.70 - 0.85)
    assert ("supervised", "vit_tiny/4", "fashion_mnist") in cmp.rows  # one pretraining: no tag
    axes = spy_on_axes(monkeypatch)
    report.plot_compute(cmp.results, tmp_path / "compute.png")
    (dino_line,) = [line for line in axes[0].get_lines() if line.get_label() == "dino"]
    assert list(dino_line.get_xdata()) == [1e15, 2e15, 3e15]


def test_pretraining_tags_say_what_differs():
    from ssl_vit.eval.compare import pretraining_tags

    same_length = [knn_of("runs/a/checkpoints/last.ckpt", 0.7, steps=100), knn_of("runs/b/checkpoints/last.ckpt", 0.7, steps=100)]
    assert pretraining_tags(same_length) == ["a/checkpoints/last.ckpt", "b/checkpoints/last.ckpt"]
    other_data = [knn_of("a.ckpt", 0.7, steps=100, epochs=10, data="fashion_mnist"),
                  knn_of("b.ckpt", 0.7, steps=100, epochs=10, data="imagefolder:imagenet/train")]
    assert pretraining_tags(other_data) == ["on fashion_mnist", "on imagefolder:imagenet/train"]
    # epochs as records keep them (floats: epochs_done rounds images seen / dataset size)
    assert pretraining_tags([knn_of("a.ckpt", 0.7, epochs=10.0), knn_of("b.ckpt", 0.7, epochs=1 / 3)]) == ["10 ep", "0.333333 ep"]
    assert pretraining_tags([knn_of("a.ckpt", 0.7, steps=50), knn_of("b.ckpt", 0.7, steps=60)]) == ["50 steps", "60 steps"]
    assert pretraining_tags([knn_of("a.ckpt", 0.7, steps=50), knn_of("b.ckpt", 0.7)]) == ["50 steps", "?"]


def test_a_results_folder_keeps_each_pretrainings_record(tmp_path):
    from ssl_vit.eval.results import result_path

    first, longer, again = knn_of("runs/a/last.ckpt", 0.7, steps=100), knn_of("runs/a/last.ckpt", 0.8, steps=300), knn_of("runs/a/last.ckpt", 0.71, steps=100)
    other = knn_of("runs/b/last.ckpt", 0.75, steps=100)
    paths = []
    for r in (first, longer, other, again):
        paths.append(result_path(tmp_path, r))
        r.to_json(paths[-1])
    names = [p.name for p in paths]
    assert names == ["dino_vit_tiny-4_fashion_mnist_knn.json", "dino_vit_tiny-4_fashion_mnist_knn_2.json",
                     "dino_vit_tiny-4_fashion_mnist_knn_3.json", "dino_vit_tiny-4_fashion_mnist_knn.json"]
    assert EvalResult.from_json(paths[0]).metrics["top1"] == pytest.approx(0.71)  # its own record replaced
    (tmp_path / "dino_vit_tiny-4_fashion_mnist_knn_4.json").write_text("not json")  # not a record: not overwritten
    assert result_path(tmp_path, knn_of("runs/c/last.ckpt", 0.7)).name == "dino_vit_tiny-4_fashion_mnist_knn_5.json"
    assert result_path(tmp_path / "one.json", other) == tmp_path / "one.json"  # a file named by the user is the user's


def test_a_record_needs_its_source():
    with pytest.raises(ValueError, match="EvalResult.source must be a non-empty string"):
        EvalResult("dino", BACKBONE, DATA, "knn", {"top1": 0.5}, source=None)


def test_the_pretraining_data_is_named_as_evaluation_data():
    from ssl_vit.eval.results import pretraining_data

    assert pretraining_data({"name": "FashionMNISTDataModule", "img_size": 28}) == "fashion_mnist"
    assert pretraining_data({"name": "ImageFolderDataModule", "train_dir": "/data/imagenet/train"}) == "imagefolder:imagenet/train"
    assert pretraining_data({"name": "MyDataModule"}) == "MyDataModule"
    assert pretraining_data(None) is None
    assert pretraining_data({"train_dir": "/x/y"}) is None and pretraining_data({"name": None}) is None  # names no data


def test_records_in_subfolders_are_found_and_a_bad_item_of_a_list_is_named_by_its_index(tmp_path):
    # compare.py load_results: folders are searched recursively; a list item that is a record but
    # a malformed one (an unknown protocol) is an error naming the file and the item.
    good = EvalResult("dino", BACKBONE, DATA, "knn", {"top1": 0.5}).to_dict()
    for sub, method in (("dino", "dino"), ("deep/random", "random")):
        (tmp_path / "results" / sub).mkdir(parents=True)
        EvalResult(method, BACKBONE, DATA, "knn", {"top1": 0.5}).to_json(tmp_path / "results" / sub / "knn.json")
    assert sorted(r.method for r in load_results([tmp_path / "results"])) == ["dino", "random"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.json").write_text(json.dumps([good, {**good, "protocol": "bogus"}]))
    with pytest.raises(ValueError, match=r"x\.json\[1\]"):
        load_results([tmp_path / "bad"])


def test_a_result_file_that_is_not_json_is_named(tmp_path):
    # results.py read_json: compare reads many files; the error says which one
    from ssl_vit.io import read_json

    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}: not valid JSON"):
        read_json(bad)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        load_results([bad])


def test_a_list_of_records_with_a_broken_item_in_a_folder_is_named(results_dir, tmp_path):
    good = EvalResult("dino", BACKBONE, DATA, "knn", {"top1": 0.5}).to_dict()
    (results_dir / "mixed.json").write_text(json.dumps([good, {"protocol": "knn"}]))
    with pytest.raises(ValueError, match=r"mixed.json: item \[1\] of a list: no 'metrics' field, beside results"):
        load_results([results_dir])


def test_backbones_of_one_free_shape_name_and_other_sizes_are_rows_compared_with_their_like():
    """Two ``vit`` (or ``hybrid``) backbones of other widths share a name: the size arguments
    label them (``vit-D128-L4-H4/7``), so each is a row of its own and an SSL row's Δ is taken
    against the supervised row of its own size, never another's."""
    def vit(dim, depth):
        return {"name": "vit", "kwargs": {"img_size": 28, "patch_size": 7, "embed_dim": dim, "depth": depth, "num_heads": 4}}

    records = [
        EvalResult("dino", vit(128, 4), DATA, "knn", {"top1": 0.70}, source="dino_small.ckpt", created="2025-01-01T00:00:00"),
        EvalResult("dino", vit(192, 6), DATA, "knn", {"top1": 0.75}, source="dino_big.ckpt", created="2025-01-01T00:00:01"),
        EvalResult("supervised", vit(192, 6), DATA, "knn", {"top1": 0.90}, source="sup_big.ckpt", created="2025-01-01T00:00:02"),
        EvalResult("supervised", {"name": "hybrid", "kwargs": {"resnet": "resnet18", "num_stages": 1, "embed_dim": 64, "depth": 4, "num_heads": 2}},
                   DATA, "knn", {"top1": 0.80}, source="sup_hybrid.ckpt", created="2025-01-01T00:00:03"),
    ]
    cmp = build_comparison(records)
    small, big = ("dino", "vit-D128-L4-H4/7", "fashion_mnist"), ("dino", "vit-D192-L6-H4/7", "fashion_mnist")
    assert cmp.get(big, "knn", "Δ sup") == pytest.approx(0.75 - 0.90)
    assert cmp.get(small, "knn", "top1") == pytest.approx(0.70) and cmp.get(small, "knn", "Δ sup") is None  # no supervised D128
    assert ("supervised", "hybrid-r18-S1-D64-L4-H2", "fashion_mnist") in cmp.rows
    assert EvalResult("x", {"name": "resnet50", "kwargs": {"num_stages": 3, "layers": [3, 4, 6], "img_size": 28}}, DATA, "knn", {}).backbone_label \
        == "resnet50-S3-B3.4.6"
    assert EvalResult("x", {"name": "vit", "kwargs": {"mlp_ratio": 2.0}}, DATA, "knn", {}).backbone_label == "vit-M2"


def test_a_baseline_of_another_backbone_only_adds_no_delta_column():
    # The random init of a ViT-Ti beside a DINO ViT-S: no row has that baseline on its backbone,
    # so no "Δ rand" column (the random row alone would fill it with +0.00 against itself).
    tiny, small = {"name": "vit_tiny", "kwargs": {"patch_size": 4}}, {"name": "vit_small", "kwargs": {"patch_size": 4}}
    records = [EvalResult("random", tiny, DATA, "fewshot", {"5shot": 0.4}, source="random"),
               EvalResult("dino", small, DATA, "fewshot", {"5shot": 0.6}, source="dino.ckpt")]
    assert build_comparison(records).columns == [("fewshot", "5shot")]
    # with the random init of the ViT-S too, the column is there, the random rows' cells their own 0
    cmp = build_comparison([*records, EvalResult("random", small, DATA, "fewshot", {"5shot": 0.5}, source="random")])
    assert cmp.columns == [("fewshot", "5shot"), ("fewshot", "Δ rand")]
    assert cmp.get(("dino", "vit_small/4", "fashion_mnist"), "fewshot", "Δ rand") == pytest.approx(0.1)
    assert cmp.get(("random", "vit_small/4", "fashion_mnist"), "fewshot", "Δ rand") == pytest.approx(0.0)


def test_an_equal_compute_comparison_of_one_method_has_no_delta_columns_and_one_legend_per_family(tmp_path, monkeypatch):
    """Supervised runs of a ViT, a ResNet and a hybrid (the ViT paper's Figure 5 setting): no
    Δ sup column (each row would be compared with itself: all zeros), one point per run in both
    panels, and one legend for the figure with one entry per family, below the panels."""
    from ssl_vit.eval import report

    backbones = [{"name": "vit", "kwargs": {"patch_size": 7, "embed_dim": 128, "depth": 4, "num_heads": 4}},
                 {"name": "resnet18", "kwargs": {"num_stages": 2}},
                 {"name": "hybrid", "kwargs": {"resnet": "resnet18", "num_stages": 1, "embed_dim": 64, "depth": 4, "num_heads": 2}}]
    records = [EvalResult("supervised", b, DATA, protocol, {"top1": 0.8 + 0.01 * i}, pretrain={"flops": (i + 1) * 1e13}, source=f"run{i}.ckpt")
               for i, b in enumerate(backbones) for protocol in ("linear", "knn")]
    cmp = build_comparison(records)
    assert [c for c in cmp.columns if c[1].startswith("Δ")] == []
    assert sorted(r[1] for r in cmp.rows) == ["hybrid-r18-S1-D64-L4-H2", "resnet18-S2", "vit-D128-L4-H4/7"]
    axes = spy_on_axes(monkeypatch)
    report.plot_compute(records, tmp_path / "compute.png")
    assert [sorted(line.get_label() for line in ax.get_lines()) for ax in axes] == [["supervised, ResNet", "supervised, ViT", "supervised, hybrid"]] * 2
    assert all(ax.get_legend() is None for ax in axes)
    (legend,) = axes[0].figure.legends
    assert [t.get_text() for t in legend.get_texts()] == ["supervised, ViT", "supervised, ResNet", "supervised, hybrid"]
    with_sup = build_comparison([*records, EvalResult("dino", backbones[0], DATA, "knn", {"top1": 0.7}, source="dino.ckpt")])
    assert with_sup.get(("dino", "vit-D128-L4-H4/7", "fashion_mnist"), "knn", "Δ sup") == pytest.approx(0.7 - 0.80)  # against the supervised ViT of its size


def test_no_plots_writes_the_report_alone(results_dir, tmp_path, capsys):
    out = tmp_path / "report.md"
    assert main([str(results_dir), "--out", str(out), "--no-plots"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["report.md"]
    assert "![" not in out.read_text()


def test_compute_axis_is_logarithmic(results_dir, tmp_path, monkeypatch):
    from ssl_vit.eval import report

    axes = spy_on_axes(monkeypatch)
    report.plot_compute(load_results([results_dir]), tmp_path / "compute.png")
    assert axes and all(ax.get_xscale() == "log" for ax in axes)  # Figure 5: FLOPs on a log axis


def test_few_shot_columns_in_order_of_shots_and_rows_by_data_then_backbone_then_method():
    shots = {"10shot": 0.7, "1shot": 0.4, "25shot": 0.8, "5shot": 0.6, "5shot_std": 0.01}
    small = {"name": "vit_small", "kwargs": {"patch_size": 4}}
    other = {"name": "cifar10"}
    records = [EvalResult("supervised", BACKBONE, DATA, "fewshot", shots), EvalResult("dino", small, DATA, "fewshot", shots),
               EvalResult("dino", BACKBONE, DATA, "fewshot", shots), EvalResult("mocov3", small, DATA, "fewshot", shots),
               EvalResult("dino", BACKBONE, other, "fewshot", shots)]
    cmp = build_comparison(records)
    assert [c for p, c in cmp.columns if p == "fewshot"][:4] == ["1shot", "5shot", "10shot", "25shot"]  # not as strings sort
    assert cmp.rows == [("dino", "vit_tiny/4", "cifar10"), ("dino", "vit_small/4", "fashion_mnist"),
                        ("mocov3", "vit_small/4", "fashion_mnist"), ("dino", "vit_tiny/4", "fashion_mnist"),
                        ("supervised", "vit_tiny/4", "fashion_mnist")]


def test_the_text_table_left_aligns_every_name_column_as_the_report_does():
    from ssl_vit.eval.compare import format_text

    records = [EvalResult("dino", BACKBONE, {"name": "cifar10"}, "knn", {"top1": 0.5}),
               EvalResult("dino", BACKBONE, {"name": "fashion_mnist"}, "knn", {"top1": 0.812})]
    text = format_text(build_comparison(records)).splitlines()
    assert text[0].startswith("method  backbone    data           knn top1")
    assert text[2] == "dino    vit_tiny/4  cifar10           50.00"  # data left, numbers right
    assert text[3] == "dino    vit_tiny/4  fashion_mnist     81.20"


def test_exactly_the_shown_number_of_skipped_files_has_no_more_clause(tmp_path):
    for name in "abc":
        (tmp_path / f"{name}.json").write_text(json.dumps({"method": "dino"}))
    with pytest.raises(ValueError) as err:
        load_results([tmp_path])
    assert str(err.value).endswith(f"{tmp_path / 'c.json'}: no 'protocol'/'metrics' fields")


def test_records_of_two_checkpoints_alike_in_all_else_are_both_kept(tmp_path):
    a, b = knn_of("runs/a/last.ckpt", 0.8), knn_of("runs/b/last.ckpt", 0.8)
    a.to_json(tmp_path / "a.json")
    b.to_json(tmp_path / "b.json")
    assert sorted(r.source for r in load_results([tmp_path])) == ["runs/a/last.ckpt", "runs/b/last.ckpt"]


def test_a_checkpoints_other_encoder_is_a_line_of_its_own_in_the_compute_plot(tmp_path, monkeypatch):
    from ssl_vit.eval import report

    student = {**BACKBONE, "encoder": "student"}
    records = [EvalResult("dino", BACKBONE, DATA, "knn", {"top1": 0.80}, pretrain={"flops": 1e15}),
               EvalResult("dino", student, DATA, "knn", {"top1": 0.70}, pretrain={"flops": 1e15}),
               EvalResult("dino", BACKBONE, DATA, "knn", {"top1": 0.85}, pretrain={"flops": 2e15}, source="long.ckpt"),
               EvalResult("dino", {**BACKBONE, "encoder": "student"}, DATA, "knn", {"top1": 0.75}, pretrain={"flops": 2e15},
                          source="long.ckpt")]
    axes = spy_on_axes(monkeypatch)
    report.plot_compute(records, tmp_path / "compute.png")
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for ax in axes for line in ax.get_lines()}
    assert lines == {"dino": ([1e15, 2e15], [80.0, 85.0]), "dino, [student]": ([1e15, 2e15], [70.0, 75.0])}
