"""``ssl-vit compare`` checked against hand-written expectations: which baseline record a row is
compared with, what the figures draw (main metric per protocol, in percent) and which of two
records of one evaluation is kept."""

from __future__ import annotations

import pytest

from ssl_vit.eval import report
from ssl_vit.eval.compare import build_comparison, format_text, load_results
from ssl_vit.eval.results import MAIN_METRIC, EvalResult

BACKBONE = {"name": "vit_tiny", "kwargs": {"patch_size": 4}}
DATA = {"name": "fashion_mnist"}
ROW = "vit_tiny/4"


def record(method, protocol, metrics, created="2025-01-01T00:00:00", source=None, **pretrain):
    return EvalResult(method, BACKBONE, DATA, protocol, metrics, pretrain=pretrain, created=created,
                      source=source or f"{method}.ckpt")


@pytest.fixture()
def axes(monkeypatch) -> list:
    """The axes of every figure compare draws during the test."""
    made: list = []
    real = report._figure

    def spy(*args, **kwargs):
        fig, ax = real(*args, **kwargs)
        made.extend(ax)
        return fig, ax

    monkeypatch.setattr(report, "_figure", spy)
    return made


# ------------------------------------------------------------------------ baselines


@pytest.mark.parametrize("order", ["newest_last", "newest_first"])
def test_of_several_supervised_baselines_the_newest_is_the_reference(order):
    # Hand-written expectation (build_comparison: "of several such baselines (several
    # pretrainings), the newest"): Δ sup = 0.85 - 0.90, from the record created last, whatever
    # order the records come in.
    older = record("supervised", "knn", {"top1": 0.80}, "2025-01-01T00:00:00", source="runs/sup_a/last.ckpt")
    newer = record("supervised", "knn", {"top1": 0.90}, "2025-03-01T00:00:00", source="runs/sup_b/last.ckpt")
    dino = record("dino", "knn", {"top1": 0.85})
    sups = [older, newer] if order == "newest_last" else [newer, older]
    cmp = build_comparison([dino, *sups])
    assert cmp.get(("dino", ROW, "fashion_mnist"), "knn", "Δ sup") == pytest.approx(0.85 - 0.90)
    sup_rows = [row for row in cmp.rows if row[0] == "supervised"]
    assert len(sup_rows) == 2  # two pretrainings: two rows
    assert sorted(cmp.get(row, "knn", "Δ sup") for row in sup_rows) == pytest.approx([0.80 - 0.90, 0.0])


# ------------------------------------------------------------------------ figures


def test_compute_plot_draws_the_main_metric_in_percent(axes, tmp_path):
    # Hand-written expectation: points at (FLOPs, 100 x main metric); few-shot's is 5-shot.
    records = [record("dino", "knn", {"top1": 0.80, "top5": 0.99}, flops=2e15),
               record("dino", "fewshot", {"1shot": 0.40, "5shot": 0.60}, flops=2e15)]
    assert report.plot_compute(records, tmp_path / "compute.png") is not None
    knn_ax, fewshot_ax = axes
    (knn_line,) = knn_ax.get_lines()
    assert list(knn_line.get_xdata()) == pytest.approx([2e15]) and list(knn_line.get_ydata()) == pytest.approx([80.0])
    (fewshot_line,) = fewshot_ax.get_lines()
    assert list(fewshot_line.get_ydata()) == pytest.approx([60.0])
    assert knn_ax.get_ylabel() == "knn top1 (%)" and fewshot_ax.get_ylabel() == "fewshot 5shot (%)"


def test_bars_show_each_protocols_own_main_metric(axes, tmp_path):
    # Hand-written expectation: the linear group shows top-1 (83%), the few-shot group its 5-shot
    # accuracy (60%), not a top-1 it does not have nor its 1-shot.
    records = [record("dino", "linear", {"top1": 0.83, "top5": 0.99}), record("dino", "fewshot", {"1shot": 0.40, "5shot": 0.60})]
    cmp = build_comparison(records)
    report.plot_bars(cmp, tmp_path / "bars.png")
    (ax,) = axes
    (bars,) = ax.containers
    assert [b.get_height() for b in bars] == pytest.approx([83.0, 60.0])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["linear (top1)", "fewshot (5shot)"]
    assert MAIN_METRIC["fewshot"] == "5shot" and ax.get_ylim() == (0, 100)


def test_records_without_their_main_metric_are_left_out_not_fatal(axes, tmp_path):
    # Hand-written expectation: a few-shot record with only 1-shot and a supervised k-NN record
    # with only top-5 have no main metric: no Δ against them, no point, no bar; the rest is drawn.
    records = [record("dino", "knn", {"top1": 0.80}, flops=2e15),
               record("supervised", "knn", {"top5": 0.99}, flops=1e15),
               record("random", "knn", {"top1": 0.70}),
               record("dino", "fewshot", {"1shot": 0.40}, flops=2e15)]
    cmp = build_comparison(records)
    dino, sup = ("dino", ROW, "fashion_mnist"), ("supervised", ROW, "fashion_mnist")
    assert cmp.get(dino, "knn", "Δ sup") is None and cmp.get(sup, "knn", "Δ sup") is None
    assert cmp.get(sup, "knn", "Δ rand") is None
    assert cmp.get(dino, "knn", "Δ rand") == pytest.approx(0.80 - 0.70)
    assert cmp.get(dino, "fewshot", "1shot") == pytest.approx(0.40)
    out = report.write_report(cmp, tmp_path / "report.md")
    assert [p.name for p in out] == ["report.md", "report_bars.png", "report_compute.png"]
    bars_ax, compute_ax = axes  # one compute panel: k-NN (the few-shot record has no 5-shot)
    assert compute_ax.get_title() == "knn"
    points = sorted((line.get_label(), list(line.get_ydata())) for line in compute_ax.get_lines())
    assert points == [("dino", pytest.approx([80.0]))]
    heights = {c.get_label(): [b.get_height() for b in c] for c in bars_ax.containers}
    assert heights == {f"dino {ROW}": pytest.approx([80.0]), f"supervised {ROW}": [], f"random {ROW}": pytest.approx([70.0])}
    # with FLOPs only on records without a main metric there is nothing to plot: no file
    assert report.plot_compute([records[1], records[3]], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


# ------------------------------------------------------------------------ duplicates


def _write_twice(folder, first_created, second_created) -> None:
    # the same evaluation (same metrics) recorded at two times, in files read in this order
    for name, created in (("a.json", first_created), ("b.json", second_created)):
        record("dino", "knn", {"top1": 0.80}, created).to_json(folder / name)


@pytest.mark.parametrize("older_first", [True, False])
def test_a_record_repeated_at_another_time_is_kept_and_the_newest_wins(tmp_path, older_first):
    # Hand-written expectation: records that differ only in `created` are two evaluations (the
    # read-twice deduplication keys on `created`); the table keeps the newer one, whichever file
    # is read first. The same record read twice stays one.
    old, new = "2025-01-01T00:00:00", "2025-02-01T00:00:00"
    _write_twice(tmp_path, *((old, new) if older_first else (new, old)))
    records = load_results([tmp_path])
    assert sorted(r.created for r in records) == [old, new]
    cmp = build_comparison(records)
    assert [r.created for r in cmp.results] == [new]
    assert f", {new})" in report.format_markdown(cmp) and f", {old})" not in report.format_markdown(cmp)
    (tmp_path / "c.json").write_text((tmp_path / "a.json").read_text())
    assert len(load_results([tmp_path])) == 2


def test_of_two_records_created_in_the_same_second_the_one_read_last_wins(tmp_path):
    # compare.py build_comparison: `created` has whole seconds; an older record replaces nothing,
    # an equal one replaces the earlier read (files are read in name order).
    same = "2025-03-01T12:00:00"
    record("dino", "knn", {"top1": 0.80}, same).to_json(tmp_path / "a.json")
    record("dino", "knn", {"top1": 0.90}, same).to_json(tmp_path / "b.json")
    assert [r.metrics["top1"] for r in build_comparison(load_results([tmp_path])).results] == [0.90]


def test_compute_plot_tick_labels_do_not_collide_and_datasets_keep_their_line_style(axes, tmp_path):
    # The narrow FLOP range of two small runs (about 7 to 10 GFLOPs) got four "N GFLOP" labels
    # running into each other; and one method's two datasets, each alone in its panel, got the
    # same line style: two legend entries that looked alike.
    fm, folder = {"name": "fashion_mnist"}, {"name": "imagefolder", "train_dir": "imgs/train"}
    records = [EvalResult("dino", BACKBONE, fm, "linear", {"top1": 0.43}, pretrain={"flops": 1.0e10}),
               EvalResult("mocov3", BACKBONE, fm, "linear", {"top1": 0.54}, pretrain={"flops": 7.4e9}),
               EvalResult("dino", BACKBONE, folder, "knn", {"top1": 0.49}, pretrain={"flops": 1.0e10}),
               EvalResult("mocov3", BACKBONE, fm, "knn", {"top1": 0.60}, pretrain={"flops": 7.4e9})]
    report.plot_compute(records, tmp_path / "compute.png")
    for ax in axes:
        fig = ax.figure
        renderer = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        assert len(boxes) >= 2
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in ax.get_xticklabels()]
    styles = {line.get_label(): (line.get_color(), line.get_linestyle()) for ax in axes for line in ax.get_lines()}
    assert styles["dino, fashion_mnist"] != styles["dino, imagefolder:imgs/train"]


def test_results_at_fewer_labels_make_the_label_efficiency_table_not_rows_of_the_main_one(tmp_path):
    # Hand-written expectation: linear probes on 600 and 6000 labelled images (three draws each) and
    # on all 60000; the supervised baseline trained on those images alone, one pretraining each.
    def probe(method, n, top1, seed, created="2025-01-01T00:00:00"):
        return EvalResult(method, BACKBONE, {**DATA, "train_size": n}, "linear", {"top1": top1}, protocol_args={"seed": seed},
                          source=f"{method}_{n}_{seed}.ckpt" if method == "supervised" else f"{method}.ckpt", created=created)

    results = [probe("dino", 600, a, s) for s, a in enumerate((0.70, 0.72, 0.74))] + [probe("dino", 6000, 0.80, 0), probe("dino", 60000, 0.85, 0)]
    results += [probe("supervised", 600, a, s) for s, a in enumerate((0.50, 0.56))] + [probe("supervised", 60000, 0.88, 0)]
    cmp = build_comparison(results)
    assert [row[0] for row in cmp.rows] == ["dino", "supervised"] and [cmp.get(row, "linear", "top1") for row in cmp.rows] == [0.85, 0.88]
    text = format_text(cmp)
    assert "600 labels  6000 labels  60000 labels" in text
    assert "dino        vit_tiny/4  72.00 ± 2.00        80.00         85.00" in text  # mean ± sample std of 70, 72, 74
    assert "supervised  vit_tiny/4  53.00 ± 4.24            –         88.00" in text
    paths = report.write_report(cmp, tmp_path / "report.md")
    markdown = (tmp_path / "report.md").read_text()
    assert "## Few labels" in markdown and "| dino | vit_tiny/4 | 72.00 ± 2.00 | 80.00 | 85.00 |" in markdown
    assert tmp_path / "report_labels.png" in paths and markdown.count("supervised_600_1.ckpt") == 1
    assert build_comparison([probe("dino", 600, 0.7, 0)]).rows and format_text(build_comparison([probe("dino", 600, 0.7, 0)])).count("labels") == 0
