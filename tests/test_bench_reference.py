"""``ssl-vit benchmark`` arithmetic and configuration against references written independently
here: FLOP/s, fractions of the matmul rate and the ratios ours / peer worked out by hand from
made-up measurements (the direction: above 1 means ours is faster / needs more memory); medians
and quartiles against ``statistics`` / ``numpy.percentile``; timing and memory readings fed from
scripted clocks and ``/proc`` values; the peers against timm's registered ViTs and lightly's own
heads, transforms and momentum rule, the MoCo v3 loss and MPP's 3-bit colour target written out;
the command line's presets and options against its ``--help``. Nothing is timed for real."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from lightly.models.modules.heads import DINOProjectionHead
from lightly.transforms.byol_transform import BYOLTransform, BYOLView1Transform, BYOLView2Transform
from torch import nn

from ssl_vit.bench import measure, peers, report, runner, worker, workloads
from ssl_vit.bench.config import VIT_S16, VIT_TI16, BenchConfig, ModelSpec, preset
from ssl_vit.bench.data import data_rows, our_transform, peer_transform, source_images
from ssl_vit.cli.benchmark import load_result, main
from ssl_vit.data import bench as data_bench
from ssl_vit.data.views import MultiCrop, TwoViews

TINY = preset("tiny")
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("spec, timm_name, label", [(VIT_S16, "vit_small_patch16_224", "ViT-S/16"), (VIT_TI16, "vit_tiny_patch16_224", "ViT-Ti/16")])
def test_model_specs_are_timms_registered_vits(spec: ModelSpec, timm_name: str, label: str) -> None:
    ref = timm.create_model(timm_name, pretrained=False, num_classes=0)
    assert (spec.embed_dim, spec.depth, spec.patch_size) == (ref.embed_dim, len(ref.blocks), ref.patch_embed.patch_size[0])
    assert spec.num_heads == ref.blocks[0].attn.num_heads
    assert spec.mlp_ratio * spec.embed_dim == ref.blocks[0].mlp.fc1.out_features
    assert spec.label == label
    # another MLP width is not that ViT
    assert dataclasses.replace(spec, mlp_ratio=2.0).label == f"ViT(D={spec.embed_dim},L={spec.depth},H={spec.num_heads})/16"


def test_presets_are_what_the_help_says() -> None:
    # --help: "full (default): ViT-S/16 at 224 px for the backbone row, ViT-S/16 at 112 px for the
    # methods; quick: ViT-S/16 224 px batch 8 and ViT-Ti/16 at 64 px"
    full, quick = preset("full"), preset("quick")
    assert (full.backbone_model.label, full.backbone_img_size) == ("ViT-S/16", 224)
    assert (full.method_model.label, full.method_img_size) == ("ViT-S/16", 112)
    assert (quick.backbone_model.label, quick.backbone_img_size, quick.backbone_batch) == ("ViT-S/16", 224, 8)
    assert (quick.method_model.label, quick.method_img_size) == ("ViT-Ti/16", 64)
    assert quick.steps < full.steps and quick.warmup <= full.warmup  # "fewer steps"
    assert preset("tiny", steps=5).steps == 5 and preset("quick", methods=("dino",)).methods == ("dino",)


def test_full_preset_is_the_shipped_results_configuration() -> None:
    # benchmarks/results_cpu.json (RESULTS.md's numbers: "2×112 px + 8×48 px crops", the papers'
    # head widths) was measured with `--preset full` and default options.
    shipped = Path(__file__).resolve().parents[1] / "benchmarks" / "results_cpu.json"
    if not shipped.is_file():
        pytest.skip("no shipped benchmark result")
    result = json.loads(shipped.read_text())
    assert result["preset"] == "full"
    assert json.loads(json.dumps(preset("full").to_dict())) == {"compile": False, **result["config"]}  # (--compile came later)
    full = preset("full")
    assert {r["name"]: r["label"] for r in result["rows"]} == {r: runner._row_label(r, full) for r in ("backbone", *full.methods)}


@pytest.mark.parametrize("bad, match", [
    ({"steps": 0}, "steps >= 1"),
    ({"warmup": -1}, "warmup >= 0"),
    ({"memory_steps": 0}, "memory_steps >= 1"),
    ({"memory_repeats": 0}, "memory_repeats >= 1"),
    ({"backbone_batch": 0}, "backbone_batch >= 1"),
    ({"backbone_img_size": 100}, "backbone_img_size 100 is not divisible by the patch size 16"),
    ({"local_size": 40}, "local_size 40 is not divisible"),
    ({"precision": "16-mixed"}, "precision must be"),
    ({"isolation": "fork"}, "isolation must be"),
])
def test_config_refuses_each_bad_setting(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        BenchConfig(**bad)


def test_config_takes_the_least_good_values() -> None:
    cfg = BenchConfig(steps=1, warmup=0, memory_steps=1, memory_repeats=1, backbone_batch=1, method_batch=2, threads=1)
    assert (cfg.steps, cfg.warmup, cfg.method_batch) == (1, 0, 2)


# ------------------------------------------------------------------------------- timing
def _scripted_timed(monkeypatch, walls: dict[str, list[float]], utils: dict[str, list[float]], threads: int = 4) -> list[str]:
    """``measure._timed`` fed from per-step scripts of wall times and utilisations; returns the
    order in which the steps ran."""
    order: list[str] = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    it_w = {n: iter(v) for n, v in walls.items()}
    it_u = {n: iter(v) for n, v in utils.items()}

    def timed(step, device):
        name = step()
        order.append(name)
        w = next(it_w[name])
        return w, next(it_u[name]) * w * threads

    monkeypatch.setattr(measure, "_timed", timed)
    return order


def test_timing_is_abba_after_warmup_and_takes_the_median_of_the_counted_rounds(monkeypatch) -> None:
    # warm-up: the first step's utilisation (one-time work) does not count towards the best.
    walls = {"a": [9.0, 9.0, 1.0, 5.0, 2.0, 3.0, 1.5], "b": [9.0, 9.0, 2.0, 2.0, 4.0, 6.0, 3.0]}
    utils = {"a": [1.0, 0.5, 0.5, 0.2, 0.5, 0.5, 0.5], "b": [0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]}
    order = _scripted_timed(monkeypatch, walls, utils)
    out = measure.time_interleaved({"a": lambda: "a", "b": lambda: "b"}, warmup=2, rounds=4, device=CPU)
    assert order == ["a", "a", "b", "b"] + ["a", "b", "b", "a"] * 2 + ["a", "b"]
    # round 1: a at 0.2 < 0.75 * 0.5 is disturbed; rounds 0, 2, 3, 4 count
    assert out["counted"] == [0, 2, 3, 4]
    assert out["a"]["median_step_s"] == statistics.median([1.0, 2.0, 3.0, 1.5]) == 1.75
    assert out["b"]["median_step_s"] == statistics.median([2.0, 4.0, 6.0, 3.0]) == 3.5
    assert out["a"]["step_s"] == walls["a"][2:]  # every timed round, the disturbed one too
    assert out["a"]["cpu_utilization"] == pytest.approx(utils["a"][2:])  # cpu / (wall * threads)
    assert not out["a"]["disturbed"] and out["a"]["rounds_counted"] == 4


def test_too_many_disturbed_rounds_count_all_of_them_and_say_so(monkeypatch) -> None:
    # rounds=2: at most 2 * 2 + 1 = 5 rounds; only round 0 is undisturbed
    walls = {"a": [1.0, 1.0, 4.0, 2.0, 8.0, 16.0]}
    utils = {"a": [0.9, 0.9, 0.1, 0.1, 0.1, 0.1]}
    order = _scripted_timed(monkeypatch, walls, utils)
    out = measure.time_interleaved({"a": lambda: "a"}, warmup=1, rounds=2, device=CPU)
    assert len(order) == 1 + 5
    assert out["counted"] == [0, 1, 2, 3, 4] and out["a"]["disturbed"] and out["a"]["rounds_counted"] == 5
    assert out["a"]["median_step_s"] == 4.0


def test_a_round_at_the_threshold_counts_and_the_best_is_capped_at_one(monkeypatch) -> None:
    # best utilisation above 1 (more busy threads than torch's): the threshold stays 0.75, and a
    # round exactly at it counts
    walls = {"a": [1.0, 1.0, 1.0, 1.0]}
    utils = {"a": [2.0, 2.0, 0.75, 0.8]}
    _scripted_timed(monkeypatch, walls, utils)
    out = measure.time_interleaved({"a": lambda: "a"}, warmup=2, rounds=2, device=CPU)
    assert out["counted"] == [0, 1] and not out["a"]["disturbed"]


def test_paired_ratio_median_and_inclusive_quartiles() -> None:
    num, den = [2.0, 9.0, 3.0, 8.0, 10.0, 1.0], [1.0, 1.0, 1.0, 2.0, 2.0, 1.0]
    counted = [0, 1, 2, 3, 4]  # round 5 left out
    xs = [n / d for n, d in zip(num[:5], den[:5])]  # numerator / denominator: 2, 9, 3, 4, 5
    out = measure.paired(num, den, counted)
    assert out["median"] == float(np.median(xs)) == 4.0
    assert out["quartiles"] == pytest.approx(list(np.percentile(xs, [25, 75])))  # 3, 5
    assert measure.paired([3.0], [2.0], [0]) == {"median": 1.5, "quartiles": [1.5, 1.5]}


def _fake_time(monkeypatch, module, walls: list[float], cpus: list[float]) -> None:
    """``module.time`` whose perf_counter / process_time advance by the scripted amounts, one pair
    of readings (before, after) per entry."""
    state = {"p": 0, "c": 0}

    def clock(key: str, steps: list[float], base: float):
        def now() -> float:
            i = state[key]
            state[key] += 1
            return base + sum(steps[: (i + 1) // 2])

        return now

    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=clock("p", walls, 100.0), process_time=clock("c", cpus, 0.0)))


def test_matmul_rate_is_2mkn_over_the_best_undisturbed_product(monkeypatch) -> None:
    m, k, n = 8, 12, 16
    walls = [1.0, 0.5, 2.0, 0.8, 9.0]  # the 0.5 s product kept only half the threads busy
    cpus = [w * u * 2 for w, u in zip(walls, [1.0, 0.3, 1.0, 0.9, 1.0])]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _fake_time(monkeypatch, measure, walls, cpus)
    out = measure.matmul_rate(m, k, n, torch.float32, CPU, repeats=3)
    assert out["flops_per_s"] == pytest.approx(2 * m * k * n / 0.8)
    assert out["tries"] == 4 and out["disturbed"] is False and out["mkn"] == [m, k, n]


def test_matmul_rate_when_every_product_was_disturbed(monkeypatch) -> None:
    walls = [1.0, 0.7, 2.0, 3.0, 1.5, 1.2, 0.9, 4.0, 5.0]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    _fake_time(monkeypatch, measure, walls, [0.1 * w for w in walls])
    out = measure.matmul_rate(4, 4, 4, torch.float32, CPU, repeats=2)
    assert out["tries"] == 8 and out["disturbed"] is True  # up to 4 * repeats tries
    assert out["flops_per_s"] == pytest.approx(2 * 64 / 0.7)


def test_matmul_rates_take_the_best_size(monkeypatch) -> None:
    monkeypatch.setattr(measure, "matmul_rate", lambda m, k, n, dtype, device, repeats: {"mkn": [m, k, n], "flops_per_s": float(m)})
    out = measure.matmul_rates([(3, 1, 1), (7, 1, 1), (5, 1, 1)], torch.float32, CPU, 1)
    assert out["peak_flops_per_s"] == 7.0 and out["dtype"] == "float32"


# ------------------------------------------------------------------------------- memory
def test_memory_probe_subtracts_the_start_and_the_file_pages(monkeypatch) -> None:
    kib = {"VmRSS": 1000, "RssAnon": 600, "VmHWM": 1000, "RssFile": 300, "RssShmem": 50}
    monkeypatch.setattr(measure, "_proc_status_bytes", lambda field: kib[field] * 1024)
    probe = measure.MemoryProbe(CPU)
    kib.update(VmHWM=5000, RssFile=700, RssShmem=100)  # the job: 3600 KiB of anonymous memory at its peak
    out = probe.peak()
    assert out["peak_abs_bytes"] == 5000 * 1024
    assert out["peak_rss_bytes"] == (5000 - 1000) * 1024
    assert out["peak_mem_bytes"] == (5000 - 700 - 100 - 600) * 1024


def test_proc_status_values_are_kibibytes() -> None:
    # /proc/self/statm counts pages: an independent reading of the same resident set
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * page
    rss = measure._proc_status_bytes("VmRSS")
    with open("/proc/self/statm") as f:
        after = int(f.read().split()[1]) * page
    assert 0.995 * min(before, after) <= rss <= 1.005 * max(before, after)


def test_saved_activation_bytes_counts_a_tensor_saved_twice_once_and_no_parameter() -> None:
    x = torch.randn(16, 8, requires_grad=True)  # not a parameter: it counts
    assert measure.saved_activation_bytes(lambda: (x * x).sum().backward(), []) == 16 * 8 * 4
    w = nn.Parameter(torch.randn(8, 8))
    # x @ wᵀ saves x (for w's gradient) and a view of w (for x's): the parameter is left out
    assert measure.saved_activation_bytes(lambda: (x @ w.t()).sum().backward(), [w]) == 16 * 8 * 4


def test_bf16_mixed_autocasts_to_bfloat16() -> None:
    with workloads.autocast(dataclasses.replace(TINY, precision="bf16-mixed"), CPU):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with workloads.autocast(TINY, CPU):
        assert not torch.is_autocast_enabled("cpu")


# ------------------------------------------------------------------------------- derived numbers
def test_derived_flops_fractions_and_ratios_by_hand() -> None:
    row = {
        "flops_per_image": 2e9,
        "ours": {"images_per_s": 10.0, "peak_mem_bytes": 300, "flops_per_image_counted": 2.1e9, "matmul_fraction_paired": {"median": 0.4}},
        "peer": {"images_per_s": 4.0, "peak_mem_bytes": 400},
    }
    runner._derive(row, 8e10)
    ours, peer = row["ours"], row["peer"]
    assert ours["flops_per_s"] == 2e10 and peer["flops_per_s"] == 8e9  # FLOP/img x img/s
    assert ours["matmul_fraction_of_peak"] == 0.25 and peer["matmul_fraction_of_peak"] == 0.1
    assert ours["matmul_fraction"] == 0.4  # the one measured round by round, where there is one
    assert peer["matmul_fraction"] == 0.1
    assert ours["flops_check"] == pytest.approx(1.05)  # counted / analytic
    assert row["throughput_ratio"] == 2.5  # ours / peer: ours 2.5x as fast
    assert row["memory_ratio"] == 0.75  # ours / peer: ours needs 3/4 of the peer's memory


def _result_for_targets(speed: float, memory: float, backbone: float, frac: float) -> dict:
    return {"rows": [
        {"name": "backbone", "throughput_ratio": backbone, "ours": {"matmul_fraction": frac}, "peer": {"matmul_fraction": 0.5}},
        {"name": "dino", "throughput_ratio": speed, "memory_ratio": memory},
    ]}


def test_targets_at_their_bounds() -> None:
    cfg = BenchConfig(methods=("dino",))  # ViT-S/16 at 224 px on CPU: the matmul target applies
    t = runner._targets(_result_for_targets(1.0, 1.0, 0.95, 0.75), cfg)
    assert t["dino"]["pass"] and t["backbone"]["pass"] and t["matmul_fraction"]["pass"]
    assert t["matmul_fraction"] == {"ours": 0.75, "peer": 0.5, "pass": True}
    t = runner._targets(_result_for_targets(1.2, 1.01, 0.94, 0.74), cfg)
    assert not t["dino"]["pass"] and not t["backbone"]["pass"] and not t["matmul_fraction"]["pass"]
    assert not runner._targets(_result_for_targets(0.99, 0.5, 1.0, 1.0), cfg)["dino"]["pass"]
    # the matmul target is stated for ViT-S/16 at 224 px on CPU only
    assert "matmul_fraction" not in runner._targets(_result_for_targets(1, 1, 1, 1), dataclasses.replace(cfg, backbone_img_size=112))
    assert "matmul_fraction" not in runner._targets(_result_for_targets(1, 1, 1, 1), dataclasses.replace(cfg, device="cuda"))


def test_row_labels_say_the_views() -> None:
    assert runner._row_label("dino", TINY) == "ViT(D=32,L=2,H=2)/8 2x32+2x16px b4"
    assert runner._row_label("mocov3", TINY) == "ViT(D=32,L=2,H=2)/8 2x32px b4"
    assert runner._row_label("backbone", preset("quick")) == "ViT-S/16 224px b8 fwd+bwd"
    assert workloads.row_views("dino", TINY) == [(4, 3, 32, 32)] * 2 + [(4, 3, 16, 16)] * 2


class _FakeJobs:
    """``run_isolated`` answering from made-up measurements, recording every job."""

    def __init__(self) -> None:
        self.jobs: list = []
        self.mem = {"ours": iter([300, 200, 250] * 10), "peer": iter([500, 400, 450] * 10)}
        self.matmul_calls = 0

    def __call__(self, job) -> dict:
        self.jobs.append(job)
        if job.kind == "environment":
            return {"cpu": "fake"}
        if job.kind == "matmul":
            self.matmul_calls += 1
            rate = 4e9 if self.matmul_calls == 1 else 5e9  # the end measurement is the better one
            return {"dtype": "float32", "sizes": [{"mkn": list(s), "flops_per_s": rate} for s in job.matmul_sizes], "peak_flops_per_s": rate}
        if job.kind == "memory":
            return {"peak_mem_bytes": next(self.mem[job.impl]), "flops_per_image_analytic": 1e8 if job.impl == "ours" else None}
        if job.kind == "timing":
            side = {"images_per_s": 20.0, "disturbed": False}
            return {"ours": dict(side), "peer": {**side, "images_per_s": 10.0}, "paired_ratio": {"median": 2.0, "quartiles": [1.9, 2.1]},
                    "matmul": {}, "loadavg": [None, None]}
        assert job.kind == "views"
        return {"views_per_s": 30.0 if job.impl == "ours" else 10.0, "views_per_image": 2}


def test_run_benchmark_derives_from_its_jobs(monkeypatch) -> None:
    jobs = _FakeJobs()
    monkeypatch.setattr(runner, "run_isolated", jobs)
    cfg = dataclasses.replace(TINY, methods=("mocov3", "dino"), memory_repeats=3)
    result = runner.run_benchmark(cfg, progress=None)
    # the matmul sizes: the configured ones and the backbone's MLP [B·T, D] @ [D, 4D], T = 16 + [CLS]
    sizes = [j.matmul_sizes for j in jobs.jobs if j.kind == "matmul"]
    assert sizes == [((128, 128, 128), (4 * 17, 32, 128))] * 2
    assert result["matmul_peak_flops_per_s"] == 5e9  # the best of start and end
    assert [r["name"] for r in result["rows"]] == ["backbone", "mocov3", "dino"]
    for row in result["rows"]:
        assert row["ours"]["peak_mem_bytes"] == 200 and row["peer"]["peak_mem_bytes"] == 400  # least of 3 processes
        assert row["ours"]["peak_mem_bytes_runs"] == [300, 200, 250]
        assert row["throughput_ratio"] == 2.0 and row["memory_ratio"] == 0.5
        assert row["flops_per_image"] == 1e8 and row["ours"]["flops_per_s"] == 2e9 and row["peer"]["flops_per_s"] == 1e9
        assert row["ours"]["matmul_fraction"] == pytest.approx(2e9 / 5e9)
        assert row["paired_ratio"]["median"] == 2.0
    assert [d["name"] for d in result["data"]] == ["two", "multicrop"]
    assert all(d["throughput_ratio"] == 3.0 for d in result["data"])  # ours / peer views/s
    assert result["format"] == "ssl-vit-benchmark/1" and tuple(result["config"]["methods"]) == ("mocov3", "dino")


def test_no_peers_runs_no_peer_job(monkeypatch) -> None:
    jobs = _FakeJobs()
    monkeypatch.setattr(runner, "run_isolated", jobs)
    result = runner.run_benchmark(dataclasses.replace(TINY, methods=("mocov3",), peers=False), progress=None)
    assert all(j.impl == "ours" for j in jobs.jobs if j.kind in ("memory", "views"))
    assert "peer" not in result["data"][0] and "throughput_ratio" not in result["data"][0]


# ------------------------------------------------------------------------------- the worker
def test_timing_job_arithmetic(monkeypatch) -> None:
    a = torch.zeros(4, 3, 8, 8)
    works = {"ours": SimpleNamespace(step=None, views=[a], flops_per_image=1e6), "peer": SimpleNamespace(step=None, views=[a], flops_per_image=None)}
    monkeypatch.setattr(worker, "_build", lambda row, impl, cfg, device, compile=False: works[impl])
    walls = {"ours": [0.5, 0.4, 0.45], "peer": [1.0, 0.8, 1.8], "matmul": [0.1, 0.1, 0.2]}
    seen = {}

    def time_interleaved(steps, warmup, rounds, device):
        seen.update(names=list(steps), warmup=warmup, rounds=rounds)
        out = {n: {"step_s": w, "median_step_s": statistics.median(w), "disturbed": False} for n, w in walls.items()}
        return {**out, "counted": [0, 1, 2]}

    monkeypatch.setattr(measure, "time_interleaved", time_interleaved)
    cfg = dataclasses.replace(TINY, warmup=2, steps=5)
    out = worker._timing_job(worker.Job("timing", cfg, row="backbone"), CPU)
    assert seen == {"names": ["ours", "peer", "matmul"], "warmup": 2, "rounds": 5}
    assert out["ours"]["images_per_s"] == pytest.approx(4 / 0.45) and out["peer"]["images_per_s"] == pytest.approx(4 / 1.0)
    mm_flops = 2 * 128**3 * 3  # the probe: three 128-square products
    fractions = [(1e6 * 4 / t) / (mm_flops / m) for t, m in zip(walls["ours"], walls["matmul"])]
    assert out["ours"]["matmul_fraction_paired"]["median"] == pytest.approx(statistics.median(fractions))
    assert out["paired_ratio"]["median"] == 2.0  # peer time / ours time per round: 2, 2, 4


def test_memory_job_probes_before_building_and_counts_per_image(monkeypatch) -> None:
    events: list[str] = []
    model = nn.Linear(2, 3)
    model.bias.requires_grad_(False)
    a, b = torch.randn(4, 5), torch.randn(5, 6)

    def step() -> None:
        events.append("step")
        torch.mm(a, b)  # 2 * 4 * 5 * 6 FLOPs for a batch of 4

    class Probe:
        def __init__(self, device) -> None:
            events.append("probe")

        def peak(self) -> dict:
            events.append("peak")
            return {"peak_mem_bytes": 1}

    def build(row, impl, cfg, device):
        events.append("build")
        return SimpleNamespace(step=step, model=model, views=[torch.zeros(4, 1), torch.zeros(4, 1)], flops_per_image=60.0)

    monkeypatch.setattr(measure, "MemoryProbe", Probe)
    monkeypatch.setattr(worker, "_build", build)
    out = worker._memory_job(worker.Job("memory", dataclasses.replace(TINY, memory_steps=3), row="dino"), CPU)
    assert events[:6] == ["probe", "build", "step", "step", "step", "peak"]  # the model's weights are in the peak
    assert events.count("step") == 3 + 2  # then the saved-tensor and the FLOP-counting steps
    assert out["flops_per_image_counted"] == 2 * 4 * 5 * 6 / 4
    assert (out["params"], out["trainable_params"]) == (9, 6)


def test_matmul_job_is_fp32_on_cpu_and_jobs_get_their_threads() -> None:
    out = worker.run_job(worker.Job("matmul", TINY, matmul_sizes=((8, 8, 8),)))
    assert out["dtype"] == "float32" and out["sizes"][0]["mkn"] == [8, 8, 8]
    threads = torch.get_num_threads()
    try:
        assert worker.run_job(worker.Job("environment", dataclasses.replace(TINY, threads=threads + 1)))["torch_threads"] == threads + 1
    finally:
        torch.set_num_threads(threads)
    assert worker.resolve_isolation(dataclasses.replace(TINY, device="cuda:0")) == "spawn"
    assert worker.resolve_isolation(TINY) == "forkserver"


# ------------------------------------------------------------------------------- the peers
def _n(params) -> int:
    return sum(p.numel() for p in params)


def test_the_backbone_row_is_timms_vit_on_both_sides() -> None:
    ref = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0)
    ours, peer = workloads.ours("backbone", TINY, CPU), workloads.peer("backbone", TINY, CPU)
    assert [p.shape for p in peer.model.vit.parameters()] == [p.shape for p in ref.parameters()]  # qkv with bias, as timm's default
    assert _n(ours.model.parameters()) == _n(ref.parameters())
    for work in (ours, peer):
        work.step()
        work.step()
        assert all(p.grad is None for p in work.model.parameters())  # gradients dropped, not accumulated


def test_mocov3_heads_as_the_paper_and_ours() -> None:
    d, h, o = 32, TINY.moco_hidden_dim, TINY.moco_out_dim
    peer, ours = workloads.peer("mocov3", TINY, CPU).model, workloads.ours("mocov3", TINY, CPU).model
    trainable = lambda m: _n(p for p in m.parameters() if p.requires_grad)  # noqa: E731
    # projector: Linear(d, h) BN ReLU Linear(h, h) BN ReLU Linear(h, o) BN without affine; no biases
    assert trainable(peer.projection_head) == d * h + 2 * h + h * h + 2 * h + h * o == trainable(ours.projector)
    # predictor: Linear(o, h) BN ReLU Linear(h, o) BN without affine
    assert trainable(peer.prediction_head) == o * h + 2 * h + h * o == trainable(ours.predictor)
    # the backbone without its patch projection (frozen: MoCo v3 §4)
    patch = 3 * 8 * 8 * d + d
    assert trainable(peer.backbone) == _n(peer.backbone.parameters()) - patch == trainable(ours.backbone)
    assert trainable(peer.backbone_momentum) == trainable(peer.projection_head_momentum) == 0


def test_mocov3_peer_loss_is_the_symmetrised_ctr() -> None:
    torch.manual_seed(0)
    model = peers.PeerMoCoV3(ModelSpec(embed_dim=32, depth=1, num_heads=2, patch_size=8), 16, 64, 16)
    x0, x1 = torch.randn(6, 3, 16, 16), torch.randn(6, 3, 16, 16)

    def ctr(q, k, tau=0.2):  # MoCo v3, Algorithm 1: CE(q kᵀ / τ, arange) · 2τ
        q, k = q / q.norm(dim=1, keepdim=True), k / k.norm(dim=1, keepdim=True)
        logits = q @ k.T / tau
        return -(logits.diag() - logits.logsumexp(dim=1)).mean() * 2 * tau

    with torch.no_grad():
        p0, p1 = model(x0), model(x1)
        z0, z1 = model.forward_momentum(x0), model.forward_momentum(x1)
        expected = ctr(p0, z1) + ctr(p1, z0)
        assert model.loss([x0, x1], torch.zeros(6)) == pytest.approx(expected.item(), rel=1e-5)


def test_supervised_rows_smooth_labels_by_0_1() -> None:
    for build in (workloads.ours, workloads.peer):
        work = build("supervised", TINY, CPU)
        model = work.model
        head = model.vit.head if build is workloads.peer else model.classifier
        for p in head.parameters():  # confident logits: at the initial (near-zero) ones smoothing changes little
            nn.init.normal_(p, std=1.0)
        with torch.no_grad():
            logits = model.vit(work.views[0]) if build is workloads.peer else model.classifier(model.backbone(work.views[0]))
            loss = model.loss(work.views, work.labels) if build is workloads.peer else model.step(work.views, work.labels)["loss"]
        assert loss.item() == pytest.approx(F.cross_entropy(logits, work.labels, label_smoothing=0.1).item(), rel=1e-6)


def test_mpp_peer_target_is_the_3_bit_mean_colour_of_the_masked_patches(monkeypatch) -> None:
    torch.manual_seed(0)
    model = peers.PeerMPP(ModelSpec(embed_dim=32, depth=1, num_heads=2, patch_size=8), 16)
    # four 8-px patches (row-major) of one colour each; the 3-bit levels floor(8 c) written out
    colours = [(0.1, 0.6, 0.95), (0.0, 0.0, 0.0), (0.99, 0.5, 0.26), (0.3, 0.3, 0.3)]
    targets = [0 * 64 + 4 * 8 + 7, 0, 7 * 64 + 4 * 8 + 2, 2 * 64 + 2 * 8 + 2]
    raw = torch.zeros(2, 3, 16, 16)
    for i, c in enumerate(colours):
        raw[:, :, 8 * (i // 2) : 8 * (i // 2 + 1), 8 * (i % 2) : 8 * (i % 2 + 1)] = torch.tensor(c).view(3, 1, 1)
    views = [(raw - 0.5) / 0.25]  # the rows' normalisation
    seen = {}
    mask = peers.lightly_utils.random_token_mask
    ce = F.cross_entropy

    def random_token_mask(**kwargs):
        seen["keep"], seen["mask"] = out = mask(**kwargs)
        return out

    def cross_entropy(pred, target, **kwargs):
        seen["pred"], seen["target"] = pred, target
        return ce(pred, target, **kwargs)

    monkeypatch.setattr(peers.lightly_utils, "random_token_mask", random_token_mask)
    monkeypatch.setattr(peers.F, "cross_entropy", cross_entropy)
    model.loss(views, torch.zeros(2))
    idx = seen["mask"]  # [B, M], positions in the sequence with [CLS] at 0
    assert idx.shape == (2, 2)  # half of the four patches
    expected = torch.tensor([[targets[j - 1] for j in row] for row in idx.tolist()])
    assert torch.equal(seen["target"], expected.flatten())
    assert seen["pred"].shape == (4, 512)
    ours = workloads.ours("mpp", TINY, CPU).model  # ours reads the same normalisation
    assert model.backbone.vit.pos_embed.requires_grad and ours.backbone.pos_embed.requires_grad  # learned on both sides
    assert torch.allclose(ours.norm_mean.flatten(), torch.tensor(peers.NORM_MEAN))
    assert torch.allclose(ours.norm_std.flatten(), torch.tensor(peers.NORM_STD))


def test_dino_peer_heads_are_lightlys_and_start_equal() -> None:
    model = workloads.peer("dino", TINY, CPU).model
    with warnings.catch_warnings():  # lightly's head uses the deprecated nn.utils.weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        ref = DINOProjectionHead(32, TINY.dino_hidden_dim, TINY.dino_bottleneck_dim, TINY.dino_out_dim, batch_norm=False)
    assert [p.shape for p in model.student_head.parameters()] == [p.shape for p in ref.parameters()]
    for s, t in zip(model.student_head.state_dict().values(), model.teacher_head.state_dict().values()):
        assert torch.equal(s, t)
    assert not any(p.requires_grad for p in [*model.teacher_backbone.parameters(), *model.teacher_head.parameters()])


@pytest.mark.parametrize("row, pairs", [
    ("mocov3", [("backbone", "backbone_momentum"), ("projection_head", "projection_head_momentum")]),
    ("dino", [("student_backbone", "teacher_backbone"), ("student_head", "teacher_head")]),
])
def test_peer_step_moves_the_momentum_copy_by_lightlys_rule(row: str, pairs) -> None:
    # lightly's examples: update_momentum(student, teacher, m) with m = cosine_schedule(step, ...,
    # 0.996, 1): at step 0, m = 0.996 and teacher <- m · teacher + (1 - m) · student
    work = workloads.peer(row, TINY, CPU)
    before = {t: [p.detach().clone() for p in getattr(work.model, t).parameters()] for _, t in pairs}
    work.step()
    assert all(p.grad is None for p in work.model.parameters())
    for s, t in pairs:
        student = list(getattr(work.model, s).parameters())
        teacher = list(getattr(work.model, t).parameters())
        moved = [not torch.equal(a, b) for a, b in zip(before[t], teacher)]
        assert any(moved)
        for old, new, st in zip(before[t], teacher, student):
            torch.testing.assert_close(new, 0.996 * old + 0.004 * st.detach())


def test_ours_and_the_peer_get_the_same_seeded_batch() -> None:
    a, b = workloads.ours("dino", TINY, CPU), workloads.peer("dino", TINY, CPU)
    assert all(torch.equal(x, y) for x, y in zip(a.views, b.views)) and torch.equal(a.labels, b.labels)
    other = workloads.make_batch("dino", dataclasses.replace(TINY, seed=1), CPU)[0]
    assert not torch.equal(other[0], a.views[0])


# ------------------------------------------------------------------------------- data rows
def test_single_view_row_crops_to_the_global_size() -> None:
    image = source_images(TINY)[0]
    assert image.size == (40, 40)
    assert [tuple(v.shape) for v in our_transform("single", TINY)(image)] == [(3, 32, 32)]


def test_data_rows_follow_the_methods() -> None:
    assert data_rows(dataclasses.replace(TINY, methods=("mocov3",))) == ["two"]
    assert data_rows(dataclasses.replace(TINY, methods=("dino", "mpp"))) == ["single", "multicrop"]
    assert data_rows(TINY) == ["single", "two", "multicrop"]


def _settings(view) -> list:
    """A lightly view transform's steps with their plain settings."""
    out = []
    for t in view.transform.transforms:
        simple = {k: v for k, v in vars(t).items() if isinstance(v, int | float | tuple | list | str) and k != "training"}
        if type(t).__name__ == "RandomApply":
            simple["inner"] = [(type(x).__name__, {k: v for k, v in vars(x).items() if k != "training"}) for x in t.transforms]
            simple.pop("transforms", None)
        out.append((type(t).__name__, simple))
    return out


def test_two_view_peer_is_byol_with_our_settings() -> None:
    ours = TwoViews(size=TINY.data_global_size)
    sigma = tuple(ours.recipes()[0].blur_sigma)
    # BYOL's two views (lightly's defaults are the paper's): blur 1.0 / 0.1, solarize 0 / 0.2, no normalisation
    expected = BYOLTransform(
        BYOLView1Transform(input_size=32, gaussian_blur=1.0, solarization_prob=0.0, sigmas=sigma, normalize=None),
        BYOLView2Transform(input_size=32, gaussian_blur=0.1, solarization_prob=0.2, sigmas=sigma, normalize=None),
    )
    peer = peer_transform("two", TINY)
    assert len(peer.transforms) == 2
    for got, want in zip(peer.transforms, expected.transforms):
        assert _settings(got) == _settings(want)


def test_dino_peer_transform_gives_every_view_our_jitter_crops_and_blur() -> None:
    ours = MultiCrop(global_size=32, local_size=16, n_local=2)
    views = data_bench.lightly_dino_transform(ours).transforms
    assert len(views) == 4
    for i, view in enumerate(views):
        steps = {type(t).__name__: t for t in view.transform.transforms}
        jitter = steps["RandomApply"].transforms[0]
        assert jitter.brightness == pytest.approx((0.6, 1.4)) and jitter.contrast == pytest.approx((0.6, 1.4))
        assert jitter.saturation == pytest.approx((0.8, 1.2)) and jitter.hue == pytest.approx((-0.1, 0.1))
        crop = steps["RandomResizedCrop"]
        assert crop.size == ((32, 32) if i < 2 else (16, 16))
        assert crop.scale == ((0.4, 1.0) if i < 2 else (0.05, 0.4))
        assert steps["GaussianBlur"].prob == (1.0, 0.1, 0.5, 0.5)[i]
        assert steps["RandomSolarization"].prob == (0.0, 0.2, 0.0, 0.0)[i]


def test_views_per_second_counts_views_over_the_chosen_clock(monkeypatch) -> None:
    costs = iter([1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.5, 1.5])  # CPU seconds of each call (2 warm-up)
    clocks = {"wall": 1000.0, "cpu": 0.0}
    threads_seen = []

    def transform(image):
        threads_seen.append(torch.get_num_threads())
        c = next(costs)
        clocks["cpu"] += c
        clocks["wall"] += 3 * c
        return ["v1", "v2", "v3"]

    monkeypatch.setattr(data_bench, "time", SimpleNamespace(perf_counter=lambda: clocks["wall"], process_time=lambda: clocks["cpu"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rate = data_bench.views_per_second(transform, ["img"], 4, warmup=2, clock="cpu")
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(threads)
    assert rate == 3 * 4 / 2.0  # 4 calls of 3 views in 2 CPU seconds
    assert threads_seen == [1] * 6  # one thread, as a DataLoader worker
    costs = iter([0.5] * 10)
    assert data_bench.views_per_second(transform, ["img"], 1.2, warmup=0, clock="wall") == pytest.approx(3 * 2 / 3.0)  # 2 calls: 3 s >= 1.2
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="positive number"):
            data_bench.views_per_second(transform, ["img"], bad)


# ------------------------------------------------------------------------------- the command
@pytest.fixture()
def captured(monkeypatch):
    """``run_benchmark`` replaced: records the configuration, returns a result with no rows."""
    seen = {}

    def run_benchmark(cfg):
        seen["cfg"] = cfg
        return {"format": "ssl-vit-benchmark/1", "config": cfg.to_dict(), "rows": [], "data": [], "targets": {}}

    monkeypatch.setattr(runner, "run_benchmark", run_benchmark)
    return seen


def test_quick_is_the_quick_preset(captured) -> None:
    assert main(["--quick"]) == 0
    assert captured["cfg"] == preset("quick")
    with pytest.raises(ValueError, match="--quick contradicts --preset tiny"):
        main(["--quick", "--preset", "tiny"])


def test_options_reach_the_configuration_and_the_json(captured, tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = ["--preset", "tiny", "--precision", "bf16-mixed", "--isolation", "none", "--methods", "dino", "--warmup", "0", "--method-batch", "1",
            "--no-peers", "--no-data", "--no-flop-check", "--markdown", "--json", str(out)]
    assert main(argv) == 0
    expected = preset("tiny", precision="bf16-mixed", isolation="none", methods=("dino",), warmup=0, method_batch=1, peers=False, data=False, flop_check=False)
    assert captured["cfg"] == expected
    saved = json.loads(out.read_text())
    assert saved["preset"] == "tiny" and saved["config"]["precision"] == "bf16-mixed"
    assert "| step |" in capsys.readouterr().out  # --markdown


def test_render_refuses_another_format(tmp_path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "ssl-vit-benchmark/0", "config": {}, "rows": []}))
    with pytest.raises(ValueError, match=re.escape("format 'ssl-vit-benchmark/0'")):
        load_result(path)


# ------------------------------------------------------------------------------- the report
def _report_result() -> dict:
    ours = {"images_per_s": 20.0, "peak_mem_bytes": 100 * 2**20, "saved_activation_bytes": 10 * 2**20, "flops_per_s": 4e10,
            "matmul_fraction": 0.5, "flops_check": 1.0, "disturbed": True}
    peer = {"images_per_s": 10.0, "peak_mem_bytes": 200 * 2**20, "saved_activation_bytes": 30 * 2**20, "flops_per_s": 2e10,
            "matmul_fraction": 0.25, "flops_check": 1.0}
    row = {"name": "dino", "label": "L", "ours": ours, "peer": peer, "throughput_ratio": 2.0, "memory_ratio": 0.5, "flops_per_image": 2e9,
           "paired_ratio": {"median": 2.0, "quartiles": [1.8, 2.2]}}
    bad = {"name": "mpp", "label": "M", "ours": {"error": "RuntimeError: boom"}, "peer": peer}
    data = [{"name": "two", "transform": "TwoViews", "methods": "mocov3", "peer_name": "BYOLTransform",
             "ours": {"views_per_s": 123.0, "views_per_image": 2}, "peer": {"views_per_s": 41.0, "views_per_image": 2}, "throughput_ratio": 3.0}]
    cfg = {"device": "cpu", "precision": "32", "warmup": 1, "steps": 2, "lean_backward": True, "fused_optimizer": True}
    targets = {"dino": {"throughput_ratio": 2.0, "memory_ratio": 1.5, "pass": False},
               "matmul_fraction": {"ours": 0.8, "peer": 0.6, "pass": True}}
    return {"config": cfg, "rows": [row, bad], "data": data, "targets": targets}


def _cells(text: str, first: str) -> dict[str, str]:
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if cells[0] == first:
            return dict(zip(header, cells))
    raise AssertionError(f"no row {first}")


def test_step_table_columns_by_hand() -> None:
    text = report.step_table(_report_result(), markdown=True)
    row = _cells(text, "dino")
    assert row["ours img/s"] == "20.00*" and row["peer img/s"] == "10.00"  # * : disturbed
    assert row["speed"] == "2.00x" and row["per-round speed"] == "1.80-2.20"
    assert (row["ours MiB"], row["peer MiB"], row["memory"]) == ("100", "200", "0.50x")
    assert row["saved MiB ours/peer"] == "10/30"
    assert row["GFLOP/img"] == "2.00" and row["ours GFLOP/s"] == "40.0"
    assert row["ours/peer of matmul"] == "50%/25%"
    assert _cells(text, "mpp")["ours img/s"] == "error"
    # a tiny model's sub-0.005 GFLOPs and sub-MiB saved tensors keep two significant digits, not 0
    assert (report._num(1.2e6, ".2f", 1e9), report._num(0.3 * 2**20, ".0f", 2**20), report._num(0.0, ".2f")) == ("0.0012", "0.3", "0.00")


def test_report_text_by_hand() -> None:
    text = report.format_report(_report_result())
    assert "* other load took cores away" in text
    quiet = _report_result()
    quiet["rows"][0]["ours"]["disturbed"] = False
    assert "other load took cores away" not in report.format_report(quiet)
    quiet["rows"][0]["peer"]["disturbed"] = True  # the peer's timing alone: the same footnote
    assert "* other load took cores away" in report.format_report(quiet)
    assert "mpp (ours): RuntimeError: boom" in text
    assert "[MISSED]" in text and "dino >= 1.00x peer speed at <= its memory: 2.000x speed, 1.500x memory [MISSED]" in text
    assert "of the matmul rate: ours 80%, timm 60% [ok]" in text
    assert "AdamW: ours fused, peers torch default" in text
    data = _cells(report.data_table(_report_result(), markdown=True), "TwoViews")
    assert data["ours views/s/worker"] == "123.0" and data["peer views/s/worker"] == "41.0" and data["speed"] == "3.00x"


def test_lightly_peer_gets_our_resolved_local_crop_size():
    from PIL import Image

    from ssl_vit.data import MultiCrop
    from ssl_vit.data.bench import lightly_dino_transform

    ours = MultiCrop(global_size=32, n_local=2)  # local_size None: resolved to 12
    assert ours.resolved_local_size == 12
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8), "RGB")
    views = lightly_dino_transform(ours)(image)
    assert [tuple(v.shape[-2:]) for v in views] == [(32, 32), (32, 32), (12, 12), (12, 12)]
