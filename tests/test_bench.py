"""``ssl-vit benchmark`` machinery on a tiny configuration. No timing is asserted anywhere: only
that every configuration runs, that ours and each peer do the same work, and that the report and
JSON carry what they promise."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.bench import workloads
from ssl_vit.bench.config import BenchConfig, ModelSpec, preset
from ssl_vit.bench.data import views_job
from ssl_vit.bench.measure import saved_activation_bytes
from ssl_vit.bench.report import format_report, ratio
from ssl_vit.cli.benchmark import main

TINY = preset("tiny")


def _torch_flops(fn) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("row", workloads.ROWS)
def test_ours_and_the_peer_do_the_same_work(row: str) -> None:
    device = torch.device("cpu")
    ours, peer = workloads.ours(row, TINY, device), workloads.peer(row, TINY, device)
    assert [v.shape for v in ours.views] == [v.shape for v in peer.views]
    for work in (ours, peer):
        work.step()  # a warm-up step, as the benchmark does
    batch = ours.views[0].shape[0]
    counted_ours = _torch_flops(ours.step) / batch
    counted_peer = _torch_flops(peer.step) / batch
    assert ours.flops_per_image == pytest.approx(counted_ours, rel=1e-3)
    assert counted_peer == pytest.approx(ours.flops_per_image, rel=1e-3)
    # and hold the same parameters, trained and not (no online probe the timed step never runs)
    for trained in (True, False):
        held = [sum(p.numel() for p in w.model.parameters() if p.requires_grad == trained) for w in (ours, peer)]
        assert held[0] == held[1]


@pytest.mark.parametrize("row", workloads.ROWS)
def test_ours_keeps_no_more_for_backward_than_the_peer(row: str) -> None:
    # Activation memory, counted exactly: what autograd saves in one step. Where the layers are
    # the same (backbone, supervised, MoCo v3), ours keeps exactly two [T, D] slices per block
    # fewer: the inputs of QKV and fc1, which norm_linear recomputes from the LayerNorm's input.
    # MPP and DINO keep less again (the corrupted tokens only; one pass per crop resolution).
    device = torch.device("cpu")
    saved = {}
    for impl, build in (("ours", workloads.ours), ("peer", workloads.peer)):
        work = build(row, TINY, device)
        saved[impl] = saved_activation_bytes(work.step, list(work.model.parameters()))
    assert 0 < saved["ours"] < saved["peer"]
    if row in ("backbone", "supervised", "mocov3"):
        model = TINY.backbone_model if row == "backbone" else TINY.method_model
        tokens = sum(b * (1 + (h // model.patch_size) * (w // model.patch_size)) for b, _, h, w in workloads.row_views(row, TINY))
        assert saved["peer"] - saved["ours"] == 2 * model.depth * tokens * model.embed_dim * 4
        # --no-lean-backward: the plain modules keep exactly what timm's keep
        plain = workloads.ours(row, dataclasses.replace(TINY, lean_backward=False), device)
        assert saved_activation_bytes(plain.step, list(plain.model.parameters())) == saved["peer"]


def test_our_method_rows_use_the_fused_optimizer_unless_asked_not_to() -> None:
    device = torch.device("cpu")
    assert workloads.ours("supervised", TINY, device).model.hparams.fused_optimizer is True
    plain = workloads.ours("supervised", dataclasses.replace(TINY, fused_optimizer=False), device)
    assert plain.model.hparams.fused_optimizer is False


def test_saved_activation_bytes_counts_a_known_graph() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)

    def step() -> None:
        h = x @ w  # saves x (4x8) and w (a parameter: not counted)
        (h.relu() * 2).sum().backward()  # relu saves its output (4x8)

    assert saved_activation_bytes(step, [w]) == 2 * 4 * 8 * 4


def test_our_step_updates_the_momentum_encoder() -> None:
    work = workloads.ours("mocov3", TINY, torch.device("cpu"))
    before = [p.clone() for p in work.model.momentum_backbone.parameters()]
    work.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, work.model.momentum_backbone.parameters()))


@pytest.mark.parametrize("row", ["two", "multicrop"])
def test_data_rows_compare_like_with_like(row: str) -> None:
    ours, peer = views_job(row, "ours", TINY), views_job(row, "peer", TINY)
    assert ours["views_per_image"] == peer["views_per_image"] == (2 if row == "two" else 2 + TINY.data_n_local)
    assert ours["views_per_s"] > 0 and peer["views_per_s"] > 0


def test_memory_probe_sees_an_allocation() -> None:
    # In a fresh process, as the benchmark runs it: a long-lived one (this test's) can serve the
    # allocation from pages it already holds, and its resident set does not grow.
    script = (
        "import torch\n"
        "from ssl_vit.bench.measure import MemoryProbe\n"
        "probe = MemoryProbe(torch.device('cpu'))\n"
        "block = torch.ones(64, 2**20 // 4)  # 64 MiB, touched\n"
        "peak = probe.peak()\n"
        "assert block.sum() > 0\n"
        "print(peak['peak_mem_bytes'], peak['peak_rss_bytes'], peak['peak_abs_bytes'])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    mem, rss, absolute = map(int, done.stdout.split())
    assert 48 * 2**20 <= mem <= 96 * 2**20
    assert absolute >= rss > 0


def test_a_round_counts_unless_a_step_lost_cores_relative_to_its_own_best(monkeypatch) -> None:
    """A small step that never keeps every core busy (utilisation 0.6 on a quiet machine) is not
    'disturbed'; a round in which it drops to half of that is timed but not counted."""
    from ssl_vit.bench import measure

    threads = torch.get_num_threads()
    utilisation = iter([0.9, 0.6, 0.6] + [0.6, 0.62, 0.3, 0.61, 0.6, 0.6] * 3)  # warm-up, then rounds
    monkeypatch.setattr(measure, "_timed", lambda step, device: (1.0, next(utilisation) * threads))
    out = measure.time_interleaved({"small": lambda: None}, warmup=3, rounds=4, device=torch.device("cpu"))
    assert out["counted"] == [0, 1, 3, 4] and not out["small"]["disturbed"]


def test_config_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="unknown method"):
        BenchConfig(methods=("simclr",))
    with pytest.raises(ValueError, match="not divisible"):
        BenchConfig(method_img_size=100)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")
    assert ModelSpec().label == "ViT-S/16"


def test_config_rejects_batches_and_threads_that_cannot_run() -> None:
    with pytest.raises(ValueError, match="method_batch >= 1"):
        BenchConfig(method_batch=-2)
    with pytest.raises(ValueError, match="mocov3 row needs method_batch >= 2"):
        BenchConfig(method_batch=1)
    assert BenchConfig(method_batch=1, methods=("supervised", "dino")).method_batch == 1
    with pytest.raises(ValueError, match="threads must be >= 1"):
        BenchConfig(threads=0)


@pytest.fixture()
def no_measuring(monkeypatch):
    """A benchmark that must stop before measuring anything."""
    from ssl_vit.bench import runner

    def measure(cfg):
        raise AssertionError("the benchmark started measuring")

    monkeypatch.setattr(runner, "run_benchmark", measure)


@pytest.mark.parametrize("option, value, message", [
    ("--method-batch", "-2", "--method-batch must be >= 1, got -2"),
    ("--method-batch", "0", "--method-batch must be >= 1, got 0"),
    ("--method-batch", "1", "--method-batch 1: the mocov3 row needs a batch of >= 2"),
    ("--backbone-batch", "0", "--backbone-batch must be >= 1, got 0"),
    ("--steps", "0", "--steps must be >= 1, got 0"),
    ("--warmup", "-1", "--warmup must be >= 0, got -1"),
    ("--threads", "0", "--threads must be >= 1, got 0"),
])
def test_bad_numeric_options_are_refused_before_measuring(no_measuring, option, value, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        main(["--preset", "tiny", option, value])


def test_an_unwritable_json_path_is_refused_before_measuring(no_measuring, tmp_path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"--json {blocker / 'out.json'}: {blocker} exists and is not a folder")):
        main(["--preset", "tiny", "--json", str(blocker / "out.json")])
    with pytest.raises(IsADirectoryError, match="is a folder"):
        main(["--preset", "tiny", "--json", str(tmp_path)])


def test_a_json_path_in_new_folders_is_made_before_measuring(no_measuring, tmp_path) -> None:
    out = tmp_path / "new" / "deeper" / "bench.json"
    with pytest.raises(AssertionError, match="started measuring"):
        main(["--preset", "tiny", "--json", str(out)])
    assert out.parent.is_dir() and list(out.parent.iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize("content, why", [
    ("[1, 2]", "a JSON list, not an object"),
    ('{"rows": 3}', "no 'format' field"),
    ('{"format": "ssl-vit-benchmark/1", "rows": 3, "config": {}}', "no 'config' object or no 'rows' list"),
    ('{"format": "ssl-vit-benchmark/1", "rows": [{}], "config": {}}', "malformed: missing"),
    ("# benchmark\n\n| step |\n", "not JSON"),
    (b"\xff\xfe\x00", "not UTF-8 text"),
])
def test_render_names_a_file_that_is_no_benchmark_result(tmp_path, content, why) -> None:
    path = tmp_path / "rep.md"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a benchmark result (") + ".*" + re.escape(why)):
        main(["--render", str(path)])


def test_render_prints_an_earlier_result(capsys) -> None:
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "benchmarks" / "results_cpu.json"
    if not shipped.is_file():
        pytest.skip("no shipped benchmark result")
    assert main(["--render", str(shipped), "--markdown"]) == 0
    assert "| step |" in capsys.readouterr().out


def test_ratio_format() -> None:
    assert ratio(1.0712) == "1.07x"
    assert ratio(None) == "-"


def test_tiny_benchmark_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    # Every configuration in a process of its own; two methods keep the test short (all four
    # run in-process above); one thread per job keeps it short on a busy machine too.
    assert main(["--preset", "tiny", "--methods", "mocov3", "dino", "--threads", "1", "--no-lean-backward", "--no-fused-optimizer",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"\d+\.\d\dx", printed)  # ratios printed like 1.07x
    result = json.loads(out.read_text())

    assert result["environment"]["torch"] == torch.__version__
    assert result["matmul"]["peak_flops_per_s"] > 0 and result["matmul_peak_flops_per_s"] > 0
    assert [r["name"] for r in result["rows"]] == ["backbone", "mocov3", "dino"]
    for row in result["rows"]:
        for impl in ("ours", "peer"):
            res = row[impl]
            assert "error" not in res, res.get("traceback")
            assert res["images_per_s"] > 0 and res["peak_mem_bytes"] > 0 and res["saved_activation_bytes"] > 0
            assert res["flops_per_s"] > 0 and res["matmul_fraction"] > 0
            assert res["flops_check"] == pytest.approx(1.0, rel=1e-3)  # counted == analytic
        assert row["throughput_ratio"] > 0 and row["memory_ratio"] > 0
        assert row["flops_per_image"] > 0
    assert [d["name"] for d in result["data"]] == ["two", "multicrop"]
    for d in result["data"]:
        assert d["ours"]["views_per_s"] > 0 and d["throughput_ratio"] > 0
    assert set(result["targets"]) == {"mocov3", "dino", "backbone"}
    assert all(isinstance(t["pass"], bool) for t in result["targets"].values())
    # The report renders from the JSON alone (RESULTS.md is made from it).
    assert "mocov3" in format_report(result, markdown=True)
    assert result["config"]["lean_backward"] is False and "lean_backward=False" in printed
    assert result["config"]["fused_optimizer"] is False and "AdamW: ours torch default, peers torch default" in printed


@pytest.mark.parametrize("row", ["backbone", "dino"])
def test_compile_times_ours_and_the_peer_with_every_vit_compiled_block_by_block(row) -> None:
    cpu = torch.device("cpu")
    for build in (workloads.ours, workloads.peer):
        eager, compiled = build(row, TINY, cpu), build(row, TINY, cpu, compile=True)
        blocks = [b for m in compiled.model.modules() if hasattr(m, "blocks") for b in m.blocks]
        assert len(blocks) == TINY.backbone_model.depth * (1 if row == "backbone" else 2)  # DINO: student and teacher
        assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
        assert not any(getattr(m, "_compiled_call_impl", None) is not None for m in eager.model.modules())


def test_the_compile_option_reaches_the_timing_jobs_and_the_report(monkeypatch, capsys) -> None:
    from ssl_vit.bench import runner, worker

    with pytest.raises(ValueError, match="compile needs warmup >= 1"):
        BenchConfig(compile=True, warmup=0)
    seen = {}
    monkeypatch.setattr(runner, "run_benchmark", lambda cfg: seen.setdefault("cfg", cfg) and {"config": cfg.to_dict(), "rows": []})
    main(["--preset", "tiny", "--compile"])
    assert seen["cfg"].compile is True
    # The timing job builds both compiled; the memory job builds them eagerly.
    built = []
    monkeypatch.setattr(worker, "_build", lambda row, impl, cfg, device, compile=False: built.append((impl, compile)) or _raise())
    cfg = dataclasses.replace(TINY, compile=True)
    for kind in ("timing", "memory"):
        with pytest.raises(RuntimeError, match="built"):
            worker.run_job(worker.Job(kind, cfg, row="backbone"))
    assert built == [("ours", True), ("ours", False)]
    header = format_report({"config": cfg.to_dict(), "rows": []}).splitlines()
    assert any("blocks compiled (torch.compile, inductor), ours and the peers'" in line for line in header)


def _raise() -> None:
    raise RuntimeError("built")


def test_without_timm_the_benchmark_says_what_to_install(monkeypatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else find_spec(name, *a))
    with pytest.raises(RuntimeError, match=re.escape("timm is not installed: pip install 'ssl_vit[bench]'")):
        main(["--preset", "tiny", "--no-peers"])
