"""``ssl-vit benchmark`` on tiny configurations, against references written independently here:
ours and each peer do the same work (FLOPs, parameters, seeded batch), the peers are timm's ViTs
and lightly's heads, losses, transforms and momentum rule (MoCo v3's loss and MPP's 3-bit colour
target written out); the instruments (interleaved timing, the rounds that count, paired ratios,
peak memory, saved tensors, a worker's CPU time per call) fed from scripted clocks and ``/proc`` values; the
derived numbers and the report worked out by hand; the command line. Nothing asserts a
wall-clock time."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from lightly.models.modules import DINOProjectionHead
from PIL import Image
from torch import nn

from ssl_vit import bench
from ssl_vit.cli.benchmark import main
from ssl_vit.data.views import MultiCrop
from ssl_vit.flops import count_flops

TINY = bench.PRESETS["tiny"]
CPU = torch.device("cpu")
ROWS = ("backbone", *bench.METHODS)
SHIPPED = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.json"))


def _n(params) -> int:
    return sum(p.numel() for p in params)


# ------------------------------------------------------------------------------- ours and the peers
@pytest.mark.parametrize("row", ROWS)
def test_ours_and_the_peer_do_the_same_work(row: str) -> None:
    ours, peer = bench.workload(row, "ours", TINY, CPU), bench.workload(row, "peer", TINY, CPU)
    assert all(torch.equal(a, b) for a, b in zip(ours.views, peer.views)) and torch.equal(ours.labels, peer.labels)  # one seeded batch
    for work in (ours, peer):
        work.step()  # a warm-up step, as the benchmark does
    assert count_flops(ours.step) == pytest.approx(count_flops(peer.step), rel=1e-3)
    # and hold the same parameters, trained and not (no online probe: the timed step never runs it)
    for trained in (True, False):
        assert _n(p for p in ours.model.parameters() if p.requires_grad == trained) == _n(p for p in peer.model.parameters() if p.requires_grad == trained)
    other = bench.workload(row, "peer", dataclasses.replace(TINY, seed=1), CPU)
    assert not torch.equal(other.views[0], ours.views[0])


@pytest.mark.parametrize("row", ROWS)
def test_ours_keeps_no_more_for_backward_than_the_peer(row: str) -> None:
    # Where the layers are the same (backbone, supervised, MoCo v3) ours keeps exactly two [T, D]
    # slices per block fewer: the inputs of QKV and fc1, which norm_linear recomputes from the
    # LayerNorm's input. MPP and DINO keep less again (the corrupted tokens; one pass per resolution).
    saved = {}
    for impl in ("ours", "peer"):
        work = bench.workload(row, impl, TINY, CPU)
        saved[impl] = bench.saved_activation_bytes(work.step, list(work.model.parameters()))
    assert 0 < saved["ours"] < saved["peer"]
    if row in ("backbone", "supervised", "mocov3"):
        model = TINY.backbone_model if row == "backbone" else TINY.method_model
        tokens = sum(b * (1 + (h // model["patch_size"]) * (w // model["patch_size"])) for b, _, h, w in bench.row_views(row, TINY))
        assert saved["peer"] - saved["ours"] == 2 * model["depth"] * tokens * model["embed_dim"] * 4
        # --no-lean-backward: the plain modules keep exactly what timm's keep
        plain = bench.workload(row, "ours", dataclasses.replace(TINY, lean_backward=False), CPU)
        assert bench.saved_activation_bytes(plain.step, list(plain.model.parameters())) == saved["peer"]


def test_our_rows_use_the_fused_optimizer_unless_asked_not_to_and_move_the_momentum_encoder() -> None:
    assert bench.workload("supervised", "ours", TINY, CPU).model.hparams.fused_optimizer is True
    assert bench.workload("supervised", "ours", dataclasses.replace(TINY, fused_optimizer=False), CPU).model.hparams.fused_optimizer is False
    work = bench.workload("mocov3", "ours", TINY, CPU)
    before = [p.clone() for p in work.model.momentum_backbone.parameters()]
    work.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, work.model.momentum_backbone.parameters()))


@pytest.mark.parametrize("shape, timm_name, label", [(bench.VIT_S16, "vit_small_patch16_224", "ViT-S/16"), (bench.VIT_TI16, "vit_tiny_patch16_224", "ViT-Ti/16")])
def test_model_shapes_are_timms_registered_vits(shape, timm_name, label) -> None:
    ref = timm.create_model(timm_name, pretrained=False, num_classes=0)
    assert (shape["embed_dim"], shape["depth"], shape["patch_size"]) == (ref.embed_dim, len(ref.blocks), ref.patch_embed.patch_size[0])
    assert shape["num_heads"] == ref.blocks[0].attn.num_heads and shape["mlp_ratio"] * shape["embed_dim"] == ref.blocks[0].mlp.fc1.out_features
    assert bench.vit_label(shape) == label
    assert bench.vit_label({**shape, "mlp_ratio": 2.0}) == f"ViT(D={shape['embed_dim']},L=12,H={shape['num_heads']})/16"  # another MLP: not that ViT


def test_the_backbone_row_is_timms_vit_on_both_sides() -> None:
    ref = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0)
    ours, peer = bench.workload("backbone", "ours", TINY, CPU), bench.workload("backbone", "peer", TINY, CPU)
    assert [p.shape for p in peer.model.parameters()] == [p.shape for p in ref.parameters()]  # qkv with bias, as timm's default
    assert _n(ours.model.parameters()) == _n(ref.parameters())
    for work in (ours, peer):
        work.step()
        work.step()
        assert all(p.grad is None for p in work.model.parameters())  # gradients dropped, not accumulated


def test_mocov3_heads_as_the_paper_and_ours() -> None:
    d, h, o = 32, TINY.moco_hidden_dim, TINY.moco_out_dim
    peer, ours = bench.workload("mocov3", "peer", TINY, CPU).model, bench.workload("mocov3", "ours", TINY, CPU).model
    trainable = lambda m: _n(p for p in m.parameters() if p.requires_grad)  # noqa: E731
    # projector: Linear(d, h) BN ReLU Linear(h, h) BN ReLU Linear(h, o) BN without affine; no biases
    assert trainable(peer.projection_head) == d * h + 2 * h + h * h + 2 * h + h * o == trainable(ours.projector)
    # predictor: Linear(o, h) BN ReLU Linear(h, o) BN without affine
    assert trainable(peer.prediction_head) == o * h + 2 * h + h * o == trainable(ours.predictor)
    patch = 3 * 8 * 8 * d + d  # the backbone without its patch projection (frozen: MoCo v3 §4)
    assert trainable(peer.backbone) == _n(peer.backbone.parameters()) - patch == trainable(ours.backbone)
    assert trainable(peer.backbone_momentum) == trainable(peer.projection_head_momentum) == 0


def test_mocov3_peer_loss_is_the_symmetrised_ctr() -> None:
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, method_model={**TINY.method_model, "depth": 1}, method_img_size=16)
    m, loss, _ = bench._peer("mocov3", cfg)
    x0, x1 = torch.randn(6, 3, 16, 16), torch.randn(6, 3, 16, 16)

    def ctr(q, k, tau=0.2):  # MoCo v3, Algorithm 1: CE(q kᵀ / τ, arange) · 2τ
        q, k = q / q.norm(dim=1, keepdim=True), k / k.norm(dim=1, keepdim=True)
        logits = q @ k.T / tau
        return -(logits.diag() - logits.logsumexp(dim=1)).mean() * 2 * tau

    with torch.no_grad():
        p0, p1 = (m.prediction_head(m.projection_head(m.backbone(x))) for x in (x0, x1))
        z0, z1 = (m.projection_head_momentum(m.backbone_momentum(x)) for x in (x0, x1))
        assert loss([x0, x1], torch.zeros(6)).item() == pytest.approx((ctr(p0, z1) + ctr(p1, z0)).item(), rel=1e-5)


def test_supervised_rows_smooth_labels_by_0_1() -> None:
    for impl in ("ours", "peer"):
        work = bench.workload("supervised", impl, TINY, CPU)
        head = work.model.head if impl == "peer" else work.model.classifier
        for p in head.parameters():  # confident logits: at the initial (near-zero) ones smoothing changes little
            nn.init.normal_(p, std=1.0)
        with torch.no_grad():
            logits = work.model(work.views[0]) if impl == "peer" else work.model.classifier(work.model.backbone(work.views[0]))
            loss = F.cross_entropy(work.model(work.views[0]), work.labels, label_smoothing=0.1) if impl == "peer" else work.model.step(work.views, work.labels)["loss"]
        assert loss.item() == pytest.approx(F.cross_entropy(logits, work.labels, label_smoothing=0.1).item(), rel=1e-6)


def test_mpp_peer_target_is_the_3_bit_mean_colour_of_the_masked_patches(monkeypatch) -> None:
    from lightly.models import utils

    torch.manual_seed(0)
    m, loss, _ = bench._peer("mpp", dataclasses.replace(TINY, method_model={**TINY.method_model, "depth": 1}, method_img_size=16))
    # four 8-px patches (row-major) of one colour each; the 3-bit levels floor(8 c) written out
    colours = [(0.1, 0.6, 0.95), (0.0, 0.0, 0.0), (0.99, 0.5, 0.26), (0.3, 0.3, 0.3)]
    targets = [0 * 64 + 4 * 8 + 7, 0, 7 * 64 + 4 * 8 + 2, 2 * 64 + 2 * 8 + 2]
    raw = torch.zeros(2, 3, 16, 16)
    for i, c in enumerate(colours):
        raw[:, :, 8 * (i // 2) : 8 * (i // 2 + 1), 8 * (i % 2) : 8 * (i % 2 + 1)] = torch.tensor(c).view(3, 1, 1)
    seen = {}
    mask, ce = utils.random_token_mask, F.cross_entropy

    def random_token_mask(**kwargs):
        seen["keep"], seen["mask"] = out = mask(**kwargs)
        return out

    def cross_entropy(pred, target, **kwargs):
        seen["pred"], seen["target"] = pred, target
        return ce(pred, target, **kwargs)

    monkeypatch.setattr(utils, "random_token_mask", random_token_mask)
    monkeypatch.setattr(bench.F, "cross_entropy", cross_entropy)
    loss([(raw - 0.5) / 0.25], torch.zeros(2))  # the rows' normalisation
    idx = seen["mask"]  # [B, M], positions in the sequence with [CLS] at 0
    assert idx.shape == (2, 2)  # half of the four patches
    assert torch.equal(seen["target"], torch.tensor([[targets[j - 1] for j in row] for row in idx.tolist()]).flatten())
    assert seen["pred"].shape == (4, 512)
    ours = bench.workload("mpp", "ours", TINY, CPU).model  # ours reads the same normalisation
    assert m.backbone.vit.pos_embed.requires_grad and ours.backbone.pos_embed.requires_grad  # learned on both sides
    assert torch.allclose(ours.norm_mean.flatten(), torch.tensor(bench.NORM_MEAN)) and torch.allclose(ours.norm_std.flatten(), torch.tensor(bench.NORM_STD))


def test_dino_peer_heads_are_lightlys_and_start_equal() -> None:
    model = bench.workload("dino", "peer", TINY, CPU).model
    with warnings.catch_warnings():  # lightly's head uses the deprecated nn.utils.weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        ref = DINOProjectionHead(32, TINY.dino_hidden_dim, TINY.dino_bottleneck_dim, TINY.dino_out_dim, batch_norm=False)
    assert [p.shape for p in model.student_head.parameters()] == [p.shape for p in ref.parameters()]
    assert all(torch.equal(s, t) for s, t in zip(model.student_head.state_dict().values(), model.teacher_head.state_dict().values()))
    assert not any(p.requires_grad for p in [*model.teacher_backbone.parameters(), *model.teacher_head.parameters()])


@pytest.mark.parametrize("row, pairs", [
    ("mocov3", [("backbone", "backbone_momentum"), ("projection_head", "projection_head_momentum")]),
    ("dino", [("student_backbone", "teacher_backbone"), ("student_head", "teacher_head")]),
])
def test_peer_step_moves_the_momentum_copy_by_lightlys_rule(row: str, pairs) -> None:
    # lightly's examples: update_momentum(student, teacher, m) with m = cosine_schedule(step, ...,
    # 0.996, 1): at step 0, m = 0.996 and teacher <- m · teacher + (1 - m) · student
    work = bench.workload(row, "peer", TINY, CPU)
    before = {t: [p.detach().clone() for p in getattr(work.model, t).parameters()] for _, t in pairs}
    work.step()
    assert all(p.grad is None for p in work.model.parameters())
    for s, t in pairs:
        teacher = list(getattr(work.model, t).parameters())
        assert any(not torch.equal(a, b) for a, b in zip(before[t], teacher))
        for old, new, st in zip(before[t], teacher, getattr(work.model, s).parameters()):
            torch.testing.assert_close(new, 0.996 * old + 0.004 * st.detach())


@pytest.mark.parametrize("row", ["backbone", "dino"])
def test_compile_times_ours_and_the_peer_with_every_vit_compiled_block_by_block(row) -> None:
    for impl in ("ours", "peer"):
        eager, compiled = bench.workload(row, impl, TINY, CPU), bench.workload(row, impl, TINY, CPU, compile=True)
        blocks = [b for m in compiled.model.modules() if hasattr(m, "blocks") for b in m.blocks]
        assert len(blocks) == TINY.backbone_model["depth"] * (1 if row == "backbone" else 2)  # DINO: student and teacher
        assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
        assert not any(getattr(m, "_compiled_call_impl", None) is not None for m in eager.model.modules())


def test_bf16_mixed_runs_the_step_in_bfloat16() -> None:
    work = bench.workload("supervised", "peer", dataclasses.replace(TINY, precision="bf16-mixed"), CPU)
    dtypes = []
    work.model.head.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    work.step()
    assert dtypes == [torch.bfloat16]
    work = bench.workload("supervised", "peer", TINY, CPU)
    work.model.head.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    work.step()
    assert dtypes[-1] == torch.float32


def test_row_labels_say_the_views() -> None:
    assert bench.row_label("dino", TINY) == "ViT(D=32,L=2,H=2)/8 2x32+2x16px b4"
    assert bench.row_label("mocov3", TINY) == "ViT(D=32,L=2,H=2)/8 2x32px b4"
    assert bench.row_label("supervised", TINY) == "ViT(D=32,L=2,H=2)/8 32px b4"
    assert bench.row_label("backbone", bench.PRESETS["quick"]) == "ViT-S/16 224px b8 fwd+bwd"
    assert bench.row_views("dino", TINY) == [(4, 3, 32, 32)] * 2 + [(4, 3, 16, 16)] * 2


def test_presets_are_what_the_help_says() -> None:
    # --help: "full: ViT-S/16 at 224 and 112 px"; the quick preset: ViT-S/16 224 px batch 8 and ViT-Ti/16 at 64 px
    full, quick = bench.PRESETS["full"], bench.PRESETS["quick"]
    assert (bench.vit_label(full.backbone_model), full.backbone_img_size, bench.vit_label(full.method_model), full.method_img_size) == ("ViT-S/16", 224, "ViT-S/16", 112)
    assert (bench.vit_label(quick.backbone_model), quick.backbone_img_size, quick.backbone_batch) == ("ViT-S/16", 224, 8)
    assert (bench.vit_label(quick.method_model), quick.method_img_size) == ("ViT-Ti/16", 64)
    assert quick.steps < full.steps and quick.warmup <= full.warmup  # "fewer steps"


def test_full_preset_is_the_shipped_results_configuration() -> None:
    # benchmarks/results_cpu.json (RESULTS.md's numbers) was measured with the full preset and default options.
    # Settings renamed or regrouped since (the multi-crop row's), or added (--compile, --feed), or gone (the separate matmul measurements' sizes) aside.
    result = json.loads((SHIPPED[0].parent / "results_cpu.json").read_text())
    stored, full = result["config"], dataclasses.asdict(bench.PRESETS["full"])
    renamed = {"n_local": "n_local_crops", "matmul_probe_size": "round_matmul_size"}
    stored = {renamed.get(k, k): tuple(v) if k == "methods" else v for k, v in stored.items()}
    stored["multicrop"] = {"global_size": stored["data_global_size"], "local_size": stored["data_local_size"], "n_local_crops": stored["data_n_local"]}
    added = ("compile", "feed", "feed_workers")
    assert {k: stored[k] for k in full if k not in added} == {k: v for k, v in full.items() if k not in added}
    assert {r["name"]: r["label"] for r in result["rows"]} == {r: bench.row_label(r, bench.PRESETS["full"]) for r in ROWS}


# ------------------------------------------------------------------------------- the worker row
def test_dino_peer_transform_gives_every_view_our_jitter_crops_and_blur() -> None:
    views = bench.lightly_dino_transform(MultiCrop(global_size=32, local_size=16, n_local_crops=2)).transforms
    assert len(views) == 4
    for i, view in enumerate(views):
        steps = {type(t).__name__: t for t in view.transform.transforms}
        jitter = steps["RandomApply"].transforms[0]
        assert jitter.brightness == pytest.approx((0.6, 1.4)) and jitter.contrast == pytest.approx((0.6, 1.4))
        assert jitter.saturation == pytest.approx((0.8, 1.2)) and jitter.hue == pytest.approx((-0.1, 0.1))
        crop = steps["RandomResizedCrop"]
        assert crop.size == ((32, 32) if i < 2 else (16, 16)) and crop.scale == ((0.4, 1.0) if i < 2 else (0.05, 0.4))
        assert steps["GaussianBlur"].prob == (1.0, 0.1, 0.5, 0.5)[i] and steps["RandomSolarization"].prob == (0.0, 0.2, 0.0, 0.0)[i]
    # a local size left to MultiCrop: lightly gets the resolved one (32 px -> 12)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8), "RGB")
    assert [tuple(v.shape[-2:]) for v in bench.lightly_dino_transform(MultiCrop(global_size=32, n_local_crops=2))(image)] == [(32, 32)] * 2 + [(12, 12)] * 2


def test_cpu_ms_per_call_times_cpu_seconds_on_one_thread(monkeypatch) -> None:
    costs = iter([1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.5, 1.5])  # CPU seconds of each call (one untimed per item)
    clock = {"cpu": 0.0}
    threads_seen = []

    def fn(item):
        threads_seen.append(torch.get_num_threads())
        clock["cpu"] += next(costs)

    monkeypatch.setattr(bench, "time", SimpleNamespace(process_time=lambda: clock["cpu"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ms = bench.cpu_ms_per_call(fn, ["img1", "img2"], 1.8)
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(threads)
    assert ms == 1e3 * 2.0 / 4  # 4 timed calls in 2 CPU seconds (>= 1.8), the 2 untimed left out
    assert threads_seen == [1] * 6  # one thread, as a DataLoader worker


# ------------------------------------------------------------------------------- instruments
def test_timing_is_abba_after_warmup(monkeypatch) -> None:
    clock, order = {"t": 0.0}, []
    walls = {"a": iter([9.0, 9.0, 1.0, 5.0, 2.0]), "b": iter([9.0, 9.0, 2.0, 2.0, 4.0])}  # two warm-up calls each, then three rounds

    def step(name):
        order.append(name)
        clock["t"] += next(walls[name])

    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))
    out = bench.time_interleaved({"a": lambda: step("a"), "b": lambda: step("b")}, warmup=2, rounds=3, device=CPU)
    assert order == ["a", "a", "b", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert out == {"a": [1.0, 5.0, 2.0], "b": [2.0, 2.0, 4.0]}


@pytest.mark.parametrize("matmul, counted, disturbed", [
    ([0.1, 0.1, 0.2], [0, 1], False),  # round 2: the matmul at half its best rate, other load took cores away
    ([0.1, 0.13, 0.12], [0, 1, 2], False),  # 0.77 and 0.83 of the best rate: no round lost cores
    ([0.1, 0.2, 0.2], [0, 1, 2], True),  # too few undisturbed rounds: all count, and the result says so
])
def test_timing_job_counts_the_rounds_whose_matmul_kept_its_rate(monkeypatch, matmul, counted, disturbed) -> None:
    a = torch.zeros(4, 3, 8, 8)
    monkeypatch.setattr(bench, "workload", lambda row, impl, cfg, device, compile=False: SimpleNamespace(step=None, views=[a]))
    walls = {"ours": [0.5, 0.4, 0.45], "peer": [1.0, 0.8, 1.8], "matmul": matmul}
    seen = {}

    def time_interleaved(steps, warmup, rounds, device):
        seen.update(names=list(steps), warmup=warmup, rounds=rounds)
        return {n: list(w) for n, w in walls.items()}

    monkeypatch.setattr(bench, "time_interleaved", time_interleaved)
    out = bench.timing_job(dataclasses.replace(TINY, warmup=2, steps=5), "backbone")
    assert seen == {"names": ["ours", "peer", "matmul"], "warmup": 2, "rounds": 5}
    assert out["round_matmul"] == {"dtype": "float32", "flops_per_s": pytest.approx([2 * 128**3 * 3 / t for t in matmul])}  # three 128-square products
    assert out["counted"] == counted and out["ours"]["disturbed"] is out["peer"]["disturbed"] is disturbed
    assert out["ours"]["images_per_s"] == pytest.approx(4 / statistics.median(walls["ours"][i] for i in counted))
    assert out["peer"]["images_per_s"] == pytest.approx(4 / statistics.median(walls["peer"][i] for i in counted))
    assert out["paired_ratio"]["median"] == statistics.median(walls["peer"][i] / walls["ours"][i] for i in counted)  # peer time / ours time per round


def test_paired_ratio_median_and_inclusive_quartiles() -> None:
    num, den = [2.0, 9.0, 3.0, 8.0, 10.0, 1.0], [1.0, 1.0, 1.0, 2.0, 2.0, 1.0]
    xs = [n / d for n, d in zip(num[:5], den[:5])]  # round 5 left out: 2, 9, 3, 4, 5
    out = bench.paired(num, den, [0, 1, 2, 3, 4])
    assert out["median"] == float(np.median(xs)) == 4.0 and out["quartiles"] == pytest.approx(list(np.percentile(xs, [25, 75])))
    assert bench.paired([3.0], [2.0], [0]) == {"median": 1.5, "quartiles": [1.5, 1.5]}


def test_peak_memory_subtracts_the_start_and_the_file_pages(monkeypatch) -> None:
    kib = {"VmRSS": 1000, "RssAnon": 600, "VmHWM": 1000, "RssFile": 300, "RssShmem": 50}
    monkeypatch.setattr(bench, "_proc_status", lambda: {k: v * 1024 for k, v in kib.items()})
    with bench.peak_memory(CPU) as out:
        kib.update(VmHWM=5000, RssFile=700, RssShmem=100)  # the block: 3600 KiB of anonymous memory at its peak
    assert out == {"peak_mem_bytes": (5000 - 700 - 100 - 600) * 1024}


def test_peak_memory_sees_an_allocation_and_proc_status_is_in_bytes() -> None:
    # In a fresh process, as the benchmark runs it: a long-lived one (this test's) can serve the
    # allocation from pages it already holds, and its resident set does not grow.
    script = ("import torch\nfrom ssl_vit.bench import peak_memory\nwith peak_memory(torch.device('cpu')) as peak:\n"
              "    block = torch.ones(64, 2**20 // 4)  # 64 MiB, touched\nprint(peak['peak_mem_bytes'])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert 48 * MiB <= int(done.stdout) <= 96 * MiB
    with open("/proc/self/statm") as f:  # pages: an independent reading of the same resident set
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    rss = bench._proc_status()["VmRSS"]
    with open("/proc/self/statm") as f:
        after = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert 0.995 * min(before, after) <= rss <= 1.005 * max(before, after)


MiB = 2**20


def test_saved_activation_bytes_counts_each_tensor_once_and_no_parameter() -> None:
    x = torch.randn(16, 8, requires_grad=True)  # not a parameter: it counts
    assert bench.saved_activation_bytes(lambda: (x * x).sum().backward(), []) == 16 * 8 * 4  # saved twice, counted once
    w = nn.Parameter(torch.randn(8, 8))
    # x @ wᵀ saves x (for w's gradient) and a view of w (for x's); relu saves its output
    assert bench.saved_activation_bytes(lambda: (x @ w.t()).relu().sum().backward(), [w]) == 2 * 16 * 8 * 4


# ------------------------------------------------------------------------------- jobs and the run
def test_memory_job_measures_from_before_building_and_counts_per_image(monkeypatch) -> None:
    events: list[str] = []
    model = nn.Linear(2, 3)
    a, b = torch.randn(4, 5), torch.randn(5, 6)

    def step() -> None:
        events.append("step")
        torch.mm(a, b)  # 2 * 4 * 5 * 6 FLOPs for a batch of 4

    class Peak:
        def __enter__(self):
            events.append("start")
            return {}

        def __exit__(self, *exc):
            events.append("peak")

    def build(row, impl, cfg, device):
        events.append("build")
        return SimpleNamespace(step=step, model=model, views=[torch.zeros(4, 1), torch.zeros(4, 1)])

    monkeypatch.setattr(bench, "peak_memory", lambda device: Peak())
    monkeypatch.setattr(bench, "workload", build)
    out = bench.memory_job(dataclasses.replace(TINY, memory_steps=3), "dino", "ours")
    assert events == ["start", "build", "step", "step", "step", "peak", "step", "step"]  # then the saved-tensor and FLOP-counting steps
    assert out["flops_per_image_counted"] == 2 * 4 * 5 * 6 / 4


def test_jobs_get_their_threads_and_their_kind_of_process(monkeypatch) -> None:
    threads = torch.get_num_threads()
    try:
        assert bench.isolated(dataclasses.replace(TINY, threads=threads + 1, isolation="none"), lambda cfg: {"t": torch.get_num_threads()}) == {"t": threads + 1}
    finally:
        torch.set_num_threads(threads)
    assert "ZeroDivisionError" in bench.isolated(dataclasses.replace(TINY, isolation="none"), lambda cfg: {"x": 1 / 0})["error"]
    kinds = []
    monkeypatch.setattr(bench.mp, "get_context", lambda how: kinds.append(how) or _raise())
    for device in ("cuda:0", "cpu"):
        with pytest.raises(RuntimeError):
            bench.isolated(dataclasses.replace(TINY, device=device), bench.environment)
    assert kinds == ["spawn", "forkserver"]


def _raise() -> None:
    raise RuntimeError("built")


def _targets(speed: float, memory: float, backbone: float, frac: float, **config) -> dict[str, bool]:
    rows = [{"name": "backbone", "throughput_ratio": backbone, "ours": {"matmul_fraction": frac}, "peer": {"matmul_fraction": 0.5}},
            {"name": "dino", "throughput_ratio": speed, "memory_ratio": memory}]
    # ViT-S/16 at 224 px on CPU (the full preset): the matmul target applies
    met = bench.targets({"config": dataclasses.asdict(dataclasses.replace(bench.PRESETS["full"], **config)), "rows": rows})
    return {text.split(" ")[0]: ok for text, ok in met}


def test_targets_at_their_bounds() -> None:
    assert _targets(1.0, 1.0, 0.95, 0.75) == {"backbone": True, "dino": True, "ViT-S/16": True}
    assert _targets(1.2, 1.01, 0.94, 0.74) == {"backbone": False, "dino": False, "ViT-S/16": False}
    assert not _targets(0.99, 0.5, 1.0, 1.0)["dino"]
    for other in ({"backbone_img_size": 112}, {"device": "cuda"}):  # the matmul target: ViT-S/16 at 224 px on CPU only
        assert "ViT-S/16" not in _targets(1, 1, 1, 1, **other)


class _FakeJobs:
    """``bench.isolated`` answering from made-up measurements, recording every job."""

    def __init__(self) -> None:
        self.jobs: list = []
        self.mem = {"ours": iter([300, 200, 250] * 10), "peer": iter([500, 400, 450] * 10)}

    def __call__(self, cfg, fn, *args) -> dict:
        self.jobs.append((fn.__name__, *args))
        if fn is bench.environment:
            return {"cpu": "fake"}
        if fn is bench.memory_job:
            return {"peak_mem_bytes": next(self.mem[args[1]]), "flops_per_image_counted": 2e9}
        if fn is bench.timing_job:
            peer = {"peer": {"images_per_s": 4.0, "disturbed": False, "batch": 2, "step_s": [0.5, 0.5, 0.5]},
                    "paired_ratio": {"median": 2.0, "quartiles": [1.9, 2.1]}} if cfg.peers else {}
            return {"ours": {"images_per_s": 10.0, "disturbed": False, "batch": 2, "step_s": [0.2, 0.1, 0.4]}, **peer,
                    "round_matmul": {"dtype": "float32", "flops_per_s": [4e10, 8e10, 1e10]}, "counted": [0, 1]}
        assert fn is bench.worker_job
        return {"ms_per_image": {"device": 2.0, "ours": 20.0, "peer": 25.0}[args[0]]}


def test_run_benchmark_derives_from_its_jobs(monkeypatch) -> None:
    jobs = _FakeJobs()
    monkeypatch.setattr(bench, "isolated", jobs)
    result = bench.run_benchmark(dataclasses.replace(TINY, methods=("mocov3", "dino"), memory_repeats=3), progress=None)
    assert [r["name"] for r in result["rows"]] == ["backbone", "mocov3", "dino"]
    for row in result["rows"]:
        ours, peer = row["ours"], row["peer"]
        assert ours["peak_mem_bytes"] == 200 and peer["peak_mem_bytes"] == 400  # the least of 3 processes
        assert row["flops_per_image"] == 2e9  # ours' count: the same work for both sides
        assert ours["flops_per_s"] == 2e10 and peer["flops_per_s"] == 8e9  # FLOP/img x img/s
        # in the same round: achieved 2e9 * 2 / t over the round's matmul rate; rounds 0 and 1 count
        assert ours["matmul_fraction"] == pytest.approx(statistics.median([2e10 / 4e10, 4e10 / 8e10])) == 0.5
        assert peer["matmul_fraction"] == pytest.approx(statistics.median([8e9 / 4e10, 8e9 / 8e10]))
        assert row["throughput_ratio"] == 2.5 and row["memory_ratio"] == 0.5 and row["paired_ratio"]["median"] == 2.0  # ours / peer
    [worker] = result["data"]  # CPU ms per image with the views made on the device, over MultiCrop's and the peer's
    assert (worker["name"], worker["ours_ratio"], worker["peer_ratio"]) == ("worker", 0.1, 0.08)
    assert [j[1] for j in jobs.jobs if j[0] == "worker_job"] == ["device", "ours", "peer"]
    assert result["format"] == bench.RESULT_FORMAT and tuple(result["config"]["methods"]) == ("mocov3", "dino")
    assert bench.run_benchmark(dataclasses.replace(TINY, methods=("mocov3", "mpp")), progress=None)["data"] == []  # the worker row only with DINO
    assert bench.run_benchmark(dataclasses.replace(TINY, methods=("dino",), data=False), progress=None)["data"] == []  # --no-data


def test_no_peers_runs_no_peer_job(monkeypatch) -> None:
    jobs = _FakeJobs()
    monkeypatch.setattr(bench, "isolated", jobs)
    result = bench.run_benchmark(dataclasses.replace(TINY, methods=("dino",), peers=False), progress=None)
    assert all(j[-1] == "ours" for j in jobs.jobs if j[0] == "memory_job")
    assert [j[1] for j in jobs.jobs if j[0] == "worker_job"] == ["device", "ours"]
    assert "peer" not in result["data"][0] and "peer_ratio" not in result["data"][0] and result["data"][0]["ours_ratio"] == 0.1
    assert all("peer" not in r and "throughput_ratio" not in r and r["ours"]["matmul_fraction"] == 0.5 for r in result["rows"])
    assert "dino (peer)" not in bench.format_report({**result, "environment": _report_result()["environment"]})  # the report has no peer to show


# ------------------------------------------------------------------------------- the report
def _report_result() -> dict:
    ours = {"images_per_s": 20.0, "peak_mem_bytes": 100 * MiB, "saved_activation_bytes": 10 * MiB, "flops_per_s": 4e10,
            "matmul_fraction": 0.5, "flops_per_image_counted": 2e9, "disturbed": True}
    peer = {"images_per_s": 10.0, "peak_mem_bytes": 200 * MiB, "saved_activation_bytes": 30 * MiB, "flops_per_s": 2e10,
            "matmul_fraction": 0.25, "flops_per_image_counted": 2.1e9}
    row = {"name": "dino", "label": "L", "ours": ours, "peer": peer, "throughput_ratio": 2.0, "memory_ratio": 0.5, "flops_per_image": 2e9,
           "paired_ratio": {"median": 2.0, "quartiles": [1.8, 2.2]}, "round_matmul": {"dtype": "float32", "flops_per_s": [1e11, 3e11, 9e11]}, "counted": [0, 1]}
    backbone = {"name": "backbone", "label": "B", "ours": {"matmul_fraction": 0.8}, "peer": {"matmul_fraction": 0.6}, "throughput_ratio": 0.9,
                "round_matmul": {"dtype": "float32", "flops_per_s": [4e11]}, "counted": [0]}
    bad = {"name": "mpp", "label": "M", "ours": {"error": "RuntimeError: boom"}, "peer": peer}
    data = [{"name": "worker", "transform": "MultiCrop", "methods": "dino", "peer_name": "DINOTransform", "device": {"ms_per_image": 2.5},
             "ours": {"ms_per_image": 20.0}, "peer": {"error": "OSError: no JPEG"}, "ours_ratio": 0.125}]
    cfg = {**dataclasses.asdict(bench.PRESETS["full"]), "warmup": 1, "steps": 2}
    env = {"cpu": "C", "cpus_usable": 2, "mem_total_gib": 8, "torch": "T", "torch_threads": 2, "timm": "t", "lightly": "l", "python": "P", "loadavg": None}
    return {"format": bench.RESULT_FORMAT, "config": cfg, "environment": env, "rows": [backbone, row, bad], "data": data, "loadavg_end": None}


def _cells(text: str, first: str) -> dict[str, str]:
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return next(dict(zip(header, cells)) for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]) if cells[0] == first)


def test_step_table_columns_by_hand() -> None:
    row = _cells(bench.step_table(_report_result(), markdown=True), "dino")
    assert row["ours img/s"] == "20.00*" and row["peer img/s"] == "10.00"  # * : disturbed
    assert row["speed"] == "2.00x" and row["per-round speed"] == "1.80-2.20"
    assert (row["ours MiB"], row["peer MiB"], row["memory"], row["saved MiB ours/peer"]) == ("100", "200", "0.50x", "10/30")
    assert (row["GFLOP/img"], row["ours GFLOP/s"], row["ours/peer of matmul"], row["FLOPs ours/peer"]) == ("2.00", "40.0", "50%/25%", "1.000/1.050")
    assert _cells(bench.step_table(_report_result(), markdown=True), "mpp")["ours img/s"] == "error"


@pytest.mark.parametrize("d, args, text", [
    ({"x": 1.2e6}, (".2f", 1e9), "0.0012"),  # a tiny model's sub-0.005 GFLOPs keep two significant digits, not 0
    ({"x": 0.3 * MiB}, (".0f", MiB), "0.3"),  # and its sub-MiB saved tensors
    ({"x": 0.0}, (".2f",), "0.00"),
    ({"x": 1.0712}, (".2f", 1.0, "x"), "1.07x"),
    ({"x": 0.684}, (".0%",), "68%"),
    ({}, (".2f", 1.0, "x"), "-"),
    (None, (), "-"),
    ({"error": "boom", "x": 1.0}, (), "error"),
])
def test_cells_format_by_hand(d, args, text) -> None:
    assert bench._cell(d, "x", *args) == text


def test_report_text_by_hand() -> None:
    text = bench.format_report(_report_result())
    assert "dense float32 matmul in the timed rounds: 200.0-400.0 GFLOP/s" in text  # the rows' medians over their counted rounds
    assert "* other load took cores away" in text
    quiet = _report_result()
    quiet["rows"][1]["ours"]["disturbed"] = False
    assert "other load took cores away" not in bench.format_report(quiet)
    quiet["rows"][1]["peer"]["disturbed"] = True  # the peer's timing alone: the same footnote
    assert "* other load took cores away" in bench.format_report(quiet)
    assert "mpp (ours): RuntimeError: boom" in text
    assert "dino >= 1.00x peer speed at <= its memory: 2.000x speed, 0.500x memory [ok]" in text and "backbone >= 0.95x timm: 0.900x [MISSED]" in text
    assert "of the matmul rate: ours 80%, timm 60% [ok]" in text and "AdamW: ours fused, peers torch default" in text
    worker = _cells(bench.worker_table(_report_result(), markdown=True), "MultiCrop")
    assert (worker["device views CPU ms/img"], worker["MultiCrop CPU ms/img"], worker["peer CPU ms/img"]) == ("2.50", "20.00", "error")
    assert (worker["device/MultiCrop"], worker["device/peer"], worker["device ms/batch"]) == ("0.12x", "-", "-")
    assert "worker CPU time per image with device views <= 0.20x MultiCrop's: 0.125x [ok]" in text and "worker (peer): OSError: no JPEG" in text
    header = bench.format_report({**_report_result(), "config": {**_report_result()["config"], "compile": True}})
    assert "blocks compiled (torch.compile, inductor), ours and the peers'" in header


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_render_prints_every_shipped_result(capsys, path) -> None:
    assert main(["--render", str(path), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| step |" in out and "| backbone |" in out and "matmul in the timed rounds" in out


@pytest.mark.parametrize("content, why", [
    ("[1, 2]", "no format 'ssl-vit-benchmark/3'"),
    ('{"rows": 3}', "no format"),
    ('{"format": "ssl-vit-benchmark/2", "config": {}, "rows": []}', "no format"),
    ("# benchmark\n\n| step |\n", "not valid JSON"),
    (b"\xff\xfe\x00", "not valid JSON"),
])
def test_render_names_a_file_that_is_no_benchmark_result(tmp_path, content, why) -> None:
    path = tmp_path / "rep.md"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(why)):
        main(["--render", str(path)])


# ------------------------------------------------------------------------------- the command
@pytest.fixture()
def captured(monkeypatch):
    """``run_benchmark`` replaced: records the configuration, returns a result with no rows."""
    seen = {}

    def run_benchmark(cfg):
        seen["cfg"] = cfg
        return {**_report_result(), "config": dataclasses.asdict(cfg), "rows": [], "data": []}

    monkeypatch.setattr(bench, "run_benchmark", run_benchmark)
    return seen


def test_options_reach_the_configuration_and_the_json(captured, tmp_path, capsys) -> None:
    assert main(["--quick"]) == 0 and captured["cfg"] == bench.PRESETS["quick"]
    tiny = bench.PRESETS["tiny"]
    assert main(["--preset", "tiny", "--compile"]) == 0 and captured["cfg"] == dataclasses.replace(tiny, compile=True)
    out = tmp_path / "r.json"
    argv = ["--preset", "tiny", "--precision", "bf16-mixed", "--isolation", "none", "--methods", "dino", "--warmup", "0", "--method-batch", "1",
            "--no-peers", "--no-data", "--no-lean-backward", "--no-fused-optimizer", "--threads", "1", "--markdown", "--json", str(out)]
    assert main(argv) == 0
    assert captured["cfg"] == dataclasses.replace(tiny, precision="bf16-mixed", isolation="none", methods=("dino",), warmup=0, method_batch=1,
                                                  peers=False, data=False, lean_backward=False, fused_optimizer=False, threads=1)
    saved = json.loads(out.read_text())
    assert saved["preset"] == "tiny" and saved["config"]["precision"] == "bf16-mixed"
    assert "| step |" in capsys.readouterr().out  # --markdown


@pytest.mark.parametrize("argv, message", [
    (["--method-batch", "0"], "--method-batch must be >= 1"),
    (["--backbone-batch", "-2"], "--backbone-batch must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--quick", "--preset", "tiny"], "not allowed with argument --quick"),
    (["--methods", "simclr"], "invalid choice: 'simclr'"),
])
def test_bad_options_are_refused_before_measuring(captured, capsys, argv, message) -> None:
    with pytest.raises(SystemExit):
        main(["--preset", "tiny", *argv] if "--preset" not in argv else argv)
    assert message in capsys.readouterr().err and "cfg" not in captured


def test_a_json_path_is_tried_before_measuring(captured, tmp_path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError):
        main(["--preset", "tiny", "--json", str(blocker / "out.json")])
    with pytest.raises(IsADirectoryError, match="is a folder"):
        main(["--preset", "tiny", "--json", str(tmp_path)])
    assert "cfg" not in captured
    out = tmp_path / "new" / "deeper" / "bench.json"
    assert main(["--preset", "tiny", "--json", str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["bench.json"]  # the folders made, no stray file


def test_tiny_benchmark_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    # Every measurement in a process of its own; one method keeps it short (all four run
    # in-process above); one thread per job keeps it short on a busy machine too.
    assert main(["--preset", "tiny", "--methods", "dino", "--threads", "1", "--no-lean-backward", "--no-fused-optimizer", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"\d+\.\d\dx", printed)  # ratios printed like 1.07x
    result = json.loads(out.read_text())
    assert result["environment"]["torch"] == torch.__version__
    assert [r["name"] for r in result["rows"]] == ["backbone", "dino"]
    for row in result["rows"]:
        assert row["round_matmul"]["dtype"] == "float32" and min(row["round_matmul"]["flops_per_s"]) > 0
        for impl in ("ours", "peer"):
            res = row[impl]
            assert "error" not in res, res.get("traceback")
            assert res["images_per_s"] > 0 and res["peak_mem_bytes"] > 0 and res["saved_activation_bytes"] > 0
            assert res["flops_per_s"] > 0 and res["matmul_fraction"] > 0
            assert res["flops_per_image_counted"] == pytest.approx(row["flops_per_image"], rel=1e-3)  # the same work
        assert row["throughput_ratio"] > 0 and row["memory_ratio"] > 0
    assert [d["name"] for d in result["data"]] == ["worker"]
    assert result["data"][0]["ours_ratio"] > 0 and result["data"][0]["peer_ratio"] > 0
    assert [text.split(" ")[0] for text, _ in bench.targets(result)] == ["backbone", "dino", "worker"]
    assert "dino" in bench.format_report(result, markdown=True)  # the report renders from the JSON alone
    assert result["config"]["lean_backward"] is False and "lean_backward=False" in printed
    assert result["config"]["fused_optimizer"] is False and "AdamW: ours torch default, peers torch default" in printed


def test_the_feed_row_times_dino_fed_by_the_loader_against_ready_made_input() -> None:
    cfg = dataclasses.replace(TINY, feed_workers=0)
    loader, ready = bench.feed_job(cfg, "loader"), bench.feed_job(cfg, "synthetic")
    assert loader["images_per_s"] > 0 and ready["images_per_s"] > 0
    assert loader["label"] == ready["label"] == "ViT(D=32,L=2,H=2)/8 2x32+2x16px b4"  # the multicrop's sizes, not the method rows'
    result = {**_report_result(), "feed": {"loader": {**loader, "images_per_s": 9.0}, "synthetic": {**ready, "images_per_s": 10.0}, "ratio": 0.9}}
    text = bench.format_report(result)
    assert "0 workers: 9.0 img/s; on ready-made input 10.0 img/s: 0.90x" in text
    assert "DINO fed by the loader >= 0.90x its speed on ready-made input: 0.900x [ok]" in text
    result["feed"] = {"loader": {"error": "RuntimeError: no GPU"}, "synthetic": ready}
    assert "feed (loader): RuntimeError: no GPU" in bench.format_report(result)
