"""``ssl-vit benchmark``: one training step of each method against the same step composed the way
lightly's examples compose it around timm's ``VisionTransformer``, the bare backbone against
timm's ViT, the achieved FLOP/s as a fraction of the machine's dense matmul rate, and views per
second of our augmentations against lightly's transforms. Figures: ``benchmarks/RESULTS.md``.

- Speed: ours and the peer of a row are built in one fresh process and timed interleaved, round
  by round, with a dense matmul taking its turn in each round (:func:`time_interleaved`), so the
  ratio and the fraction of the matmul rate are measured on the same machine state.
- Memory: each implementation alone in a fresh process (:func:`peak_memory`), the least of
  ``memory_repeats`` processes; the tensors autograd keeps are counted exactly besides.
- FLOPs: one step of each side under torch's ``FlopCounterMode`` (:func:`ssl_vit.flops.count_flops`).

Our step is what training runs (the method's ``step``, backward, the AdamW it configures, the EMA
update) without the Trainer's logging and callbacks; the peers' likewise. Neither clips gradients
nor freezes DINO's last layer in the first epoch (lightly's examples do not either). The peers
(lightly 1.6, ``examples/pytorch/``): supervised is timm's ViT with cross-entropy (label smoothing
0.1); MPP, which lightly lacks, is its SimMIM example (``MaskedVisionTransformerTIMM``, a linear
head on the masked tokens) with our 3-bit mean-colour target and 50 % mask ratio, without BERT's
10 % random / 10 % kept split (lightly's masking has none); MoCo v3, whose heads and loss lightly
lacks, follows its MoCo/BYOL examples (one forward per view, ``deepcopy`` momentum copies,
``update_momentum``) with MoCo v3's MLPs from ``ProjectionHead`` blocks, the patch projection
frozen (MoCo v3 §4) and ``ctr`` of its Algorithm 1; DINO is ``examples/pytorch/dino.py``
(``DINOProjectionHead``, ``DINOLoss``, one forward per view).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_vit.backbones import compile_backbone, create_backbone
from ssl_vit.errors import one_line
from ssl_vit.flops import count_flops
from ssl_vit.io import read_json
from ssl_vit.runtime import allocator_note, keep_freed_memory

RESULT_FORMAT = "ssl-vit-benchmark/2"
READABLE_FORMATS = ("ssl-vit-benchmark/1", RESULT_FORMAT)  # /1 (other config keys, FLOPs also analytic) renders alike
METHODS = ("supervised", "mpp", "mocov3", "dino")
# The targets: each method >= 1.0x the peer's speed at <= its peak memory, the bare backbone
# >= 0.95x timm's, and ViT-S/16 at 224 px training on a CPU at >= 75 % of the matmul rate.
TARGET_SPEED, TARGET_MEMORY, TARGET_BACKBONE, TARGET_MATMUL = 1.0, 1.0, 0.95, 0.75
# ViT shapes: keyword arguments of ``create_backbone("vit", ...)`` and of timm's VisionTransformer alike.
VIT_S16 = {"embed_dim": 384, "depth": 12, "num_heads": 6, "patch_size": 16, "mlp_ratio": 4.0, "in_chans": 3}
VIT_TI16 = {**VIT_S16, "embed_dim": 192, "num_heads": 3}
_VIT_NAMES = {(192, 12, 3): "Ti", (384, 12, 6): "S", (768, 12, 12): "B", (1024, 24, 16): "L", (1280, 32, 16): "H"}  # DeiT Table 1, ViT Table 1
MIN_UTILIZATION = 0.75  # of the best CPU utilisation seen: below it, other load took cores away (time_interleaved)
_SCHEDULE_STEPS = 100_000  # a long schedule: the EMA momentum stays in its realistic range while timed
MiB = 2**20


def vit_label(m: dict[str, Any]) -> str:
    size = _VIT_NAMES.get((m["embed_dim"], m["depth"], m["num_heads"])) if m["mlp_ratio"] == 4.0 else None
    return f"ViT-{size}/{m['patch_size']}" if size else f"ViT(D={m['embed_dim']},L={m['depth']},H={m['num_heads']})/{m['patch_size']}"


@dataclass(frozen=True)
class BenchConfig:
    """One run. The backbone row trains ``backbone_model`` at ``backbone_img_size`` (ViT-S/16 at
    224 px: the matmul target's configuration); the method rows ``method_model`` at
    ``method_img_size``, DINO with ``n_local_crops`` more crops of ``local_size`` px; head widths
    are the papers'. The augmentation rows time one DataLoader worker for ``data_seconds``."""

    backbone_model: dict[str, Any] = field(default_factory=lambda: dict(VIT_S16))
    backbone_img_size: int = 224
    backbone_batch: int = 32
    method_model: dict[str, Any] = field(default_factory=lambda: dict(VIT_S16))
    method_img_size: int = 112
    method_batch: int = 32
    local_size: int = 48
    n_local_crops: int = 8
    methods: tuple[str, ...] = METHODS
    num_classes: int = 1000
    moco_hidden_dim: int = 4096
    moco_out_dim: int = 256
    dino_out_dim: int = 65536
    dino_hidden_dim: int = 2048
    dino_bottleneck_dim: int = 256
    warmup: int = 3
    steps: int = 11
    memory_steps: int = 2
    memory_repeats: int = 3  # peak RSS differs by ~1 % between processes of one job: the least is its need
    matmul_sizes: tuple[tuple[int, int, int], ...] = ((2048, 2048, 2048),)  # + the backbone's MLP matmul
    matmul_repeats: int = 10
    round_matmul_size: int = 2048  # the n x n @ n x n product timed in every round (at least 8192 on GPUs)
    data: bool = True
    data_source_size: int = 256
    data_global_size: int = 224
    data_local_size: int = 96
    data_n_local_crops: int = 8
    data_seconds: float = 3.0
    data_images: int = 8
    device: str = "cpu"
    precision: Literal["32", "bf16-mixed"] = "32"
    threads: int | None = None
    isolation: Literal["auto", "forkserver", "spawn", "none"] = "auto"
    job_timeout_s: float = 900.0
    seed: int = 0
    peers: bool = True
    lean_backward: bool = True  # our ViT's norm_linear + gelu_linear; False: the plain modules
    fused_optimizer: bool = True  # ours on torch's fused AdamW; False: torch's default, as the peers
    compile: bool = False  # every ViT's blocks through torch.compile (inductor) in the timing jobs


PRESETS: dict[str, dict[str, Any]] = {
    "full": {},  # RESULTS.md's numbers (about 14 minutes on 2 cores)
    "quick": dict(backbone_batch=8, method_model=VIT_TI16, method_img_size=64, method_batch=16, local_size=32, warmup=1, steps=3,
                  memory_repeats=1, matmul_repeats=5, data_seconds=1.0, data_images=4),  # under 2 minutes on 2 cores
    "tiny": dict(backbone_model=(tiny := {**VIT_S16, "embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 8}), backbone_img_size=32,
                 backbone_batch=4, method_model=tiny, method_img_size=32, method_batch=4, local_size=16, n_local_crops=2, num_classes=10,
                 moco_hidden_dim=64, moco_out_dim=16, dino_out_dim=128, dino_hidden_dim=64, dino_bottleneck_dim=16, warmup=1, steps=2,
                 memory_repeats=1, matmul_sizes=((128, 128, 128),), matmul_repeats=2, round_matmul_size=128, data_source_size=40,
                 data_global_size=32, data_local_size=16, data_n_local_crops=2, data_seconds=0.05, data_images=2),  # seconds
}


def preset(name: str, **overrides: Any) -> BenchConfig:
    return BenchConfig(**{**PRESETS[name], **overrides})


# ---------------------------------------------------------------------------------- instruments
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    """Wall and CPU seconds of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def time_interleaved(steps: dict[str, Callable[[], Any]], warmup: int, rounds: int, device: torch.device) -> dict[str, Any]:
    """Time step functions against each other: ``warmup`` untimed calls of each, then rounds that
    call each once, in reverse order on odd rounds (ABBA), until ``rounds`` rounds were undisturbed
    (at most ``2 * rounds + 1``).

    Disturbed: on a shared CPU a step loses cores to another job, and its utilisation
    ``cpu / (wall * threads)`` drops (to about half when it loses one of two). A small step never
    keeps every core busy, so a round counts when each step reached ``MIN_UTILIZATION`` of the
    best utilisation seen for it (warm-up calls after the first included; capped at 1). With too
    few such rounds all count and the result says ``disturbed``. On CUDA every round counts.
    Returns per name ``step_s``, ``cpu_utilization``, ``median_step_s`` over the counted rounds;
    and ``counted``, those rounds' indices (for :func:`paired`)."""
    names, threads = list(steps), max(torch.get_num_threads(), 1)
    best = dict.fromkeys(names, 0.0)
    for name in names:
        for i in range(warmup):
            wall, cpu = _timed(steps[name], device)
            if i > 0:  # the first call carries one-time work (allocations, kernel selection)
                best[name] = max(best[name], cpu / (wall * threads))
    walls: dict[str, list[float]] = {n: [] for n in names}
    utils: dict[str, list[float]] = {n: [] for n in names}
    kept: list[int] = []
    r = 0
    while len(kept) < rounds and r < 2 * rounds + 1:
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = _timed(steps[name], device)
            walls[name].append(wall)
            utils[name].append(cpu / (wall * threads))
            best[name] = max(best[name], utils[name][-1])
        if device.type == "cuda" or all(utils[n][r] >= MIN_UTILIZATION * min(best[n], 1.0) for n in names):
            kept.append(r)
        r += 1
    disturbed = len(kept) < rounds
    counted = list(range(r)) if disturbed else kept
    out: dict[str, Any] = {n: {"step_s": walls[n], "cpu_utilization": utils[n], "median_step_s": statistics.median(walls[n][i] for i in counted),
                               "rounds_counted": len(counted), "disturbed": disturbed} for n in names}
    return {**out, "counted": counted}


def paired(numerator: Sequence[float], denominator: Sequence[float], counted: Sequence[int]) -> dict[str, Any]:
    """Median and quartiles of ``numerator[i] / denominator[i]`` over the counted rounds: a ratio
    taken within each round; its quartiles are the noise of the measurement."""
    xs = sorted(numerator[i] / denominator[i] for i in counted)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0], xs[0], xs[0]]
    return {"median": statistics.median(xs), "quartiles": [q[0], q[2]]}


def _proc_status() -> dict[str, int]:
    """The memory fields of ``/proc/self/status`` in bytes (none without /proc)."""
    try:
        with open("/proc/self/status") as f:
            pairs = [line.split(":", 1) for line in f]
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in pairs if v.strip().endswith("kB")}


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, int]]:
    """Peak memory of the block, in the dict it yields once the block is done. CUDA:
    ``max_memory_allocated`` above the start. CPU: ``peak_abs_bytes``, the process's resident
    high-water mark (``VmHWM``, reset at the start through ``/proc/self/clear_refs``);
    ``peak_rss_bytes``, that above the resident set at the start; ``peak_mem_bytes``, the
    anonymous memory at the peak above the start (weights, gradients, optimiser state,
    activations, allocator caches), without the pages of shared libraries the block faulted in
    (the code of the first torch kernels it ran: tens of MiB that say nothing about a step)."""
    out: dict[str, int] = {}
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield out
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        out.update(peak_mem_bytes=max(peak - start, 0), peak_rss_bytes=0, peak_abs_bytes=peak)
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS
    before = _proc_status()
    yield out
    now = _proc_status()
    hwm = now.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    out.update(peak_rss_bytes=max(hwm - before.get("VmRSS", 0), 0), peak_abs_bytes=hwm)
    file_pages = now.get("RssFile", 0) + now.get("RssShmem", 0)
    out["peak_mem_bytes"] = max(hwm - file_pages - before["RssAnon"], 0) if "RssAnon" in before else out["peak_rss_bytes"]


def saved_activation_bytes(step: Callable[[], Any], params: Sequence[Tensor]) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass during ``step``,
    parameters (and views of them) left out: a step's activation memory, counted exactly."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if (ptr := t.untyped_storage().data_ptr()) not in param_storages:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, repeats: int = 10) -> dict[str, Any]:
    """FLOP/s of ``[m, k] @ [k, n]`` (2·m·k·n FLOPs): the best of ``repeats`` products that kept
    every thread busy (up to ``4 * repeats`` tried); the best, because other load only lowers it."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=gen).to(device, dtype) for shape in ((m, k), (k, n)))
    out = torch.empty(m, n, device=device, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=out)
    _sync(device)
    threads = max(torch.get_num_threads(), 1)
    times, kept = [], []
    while len(kept) < repeats and len(times) < 4 * repeats:
        wall, cpu = _timed(lambda: torch.mm(a, b, out=out), device)
        times.append(wall)
        if device.type == "cuda" or cpu >= MIN_UTILIZATION * wall * threads:
            kept.append(wall)
    return {"mkn": [m, k, n], "flops_per_s": 2.0 * m * k * n / min(kept or times), "disturbed": not kept, "tries": len(times)}


def matmul_rates(cfg: BenchConfig, sizes: Sequence[tuple[int, int, int]]) -> dict[str, Any]:
    """The rate of each size and the best of them, in fp32 on a CPU and in bf16 on a GPU (whose
    dense rate is quoted in bf16)."""
    device = torch.device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rates = [matmul_rate(*s, dtype=dtype, device=device, repeats=cfg.matmul_repeats) for s in sizes]
    return {"dtype": str(dtype).removeprefix("torch."), "sizes": rates, "peak_flops_per_s": max(r["flops_per_s"] for r in rates)}


def views_per_second(transform: Callable[[Any], Sequence[Any]], images: Sequence[Any], seconds: float, warmup: int = 2) -> float:
    """Views per CPU second of ``transform`` on one thread, as a DataLoader worker runs it (torch
    sets one thread there); CPU time, which other load on the machine does not stretch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(warmup):
            transform(images[i % len(images)])
        n_views, calls, start, elapsed = 0, 0, time.process_time(), 0.0
        while calls == 0 or elapsed < seconds:
            n_views += len(transform(images[calls % len(images)]))
            calls += 1
            elapsed = time.process_time() - start
        return n_views / elapsed
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------- the steps
NORM_MEAN, NORM_STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)  # the MPP rows' view normalisation, both sides
PEER_NAMES = {"backbone": "timm VisionTransformer", "supervised": "timm ViT + CE", "mpp": "lightly MaskedViT(timm) + linear",
              "mocov3": "lightly heads + timm ViT", "dino": "lightly DINO + timm ViT"}
LossFn = Callable[[list[Tensor], Tensor], Tensor]


@dataclass
class Workload:
    step: Callable[[], None]  # one training step on views, labels
    model: nn.Module
    views: list[Tensor]
    labels: Tensor


def row_views(row: str, cfg: BenchConfig) -> list[tuple[int, int, int, int]]:
    """The views ``[B, C, H, W]`` of a row."""
    if row == "backbone":
        return [(cfg.backbone_batch, cfg.backbone_model["in_chans"], cfg.backbone_img_size, cfg.backbone_img_size)]
    b, c, s, local = cfg.method_batch, cfg.method_model["in_chans"], cfg.method_img_size, cfg.local_size
    n_global = 2 if row in ("mocov3", "dino") else 1
    return [(b, c, s, s)] * n_global + [(b, c, local, local)] * (cfg.n_local_crops if row == "dino" else 0)


def row_label(row: str, cfg: BenchConfig) -> str:
    views = row_views(row, cfg)
    b, _, s, _ = views[0]
    if row == "backbone":
        return f"{vit_label(cfg.backbone_model)} {s}px b{b} fwd+bwd"
    crops = ("2x" if row in ("mocov3", "dino") else "") + str(s) + (f"+{len(views) - 2}x{views[-1][-1]}" if len(views) > 2 else "")
    return f"{vit_label(cfg.method_model)} {crops}px b{b}"


def _ours(row: str, cfg: BenchConfig) -> tuple[nn.Module, LossFn, Callable[[int], Any] | None]:
    """Our model of ``row``, its loss and what follows its optimiser step."""
    from ssl_vit.methods import DINO, MPP, MoCoV3, Supervised

    if row == "backbone":
        vit = create_backbone("vit", img_size=cfg.backbone_img_size, **cfg.backbone_model, lean_backward=cfg.lean_backward)
        return vit, lambda views, labels: vit(views[0]).float().mean(), None
    common = {"backbone": "vit", "fused_optimizer": cfg.fused_optimizer,
              "backbone_kwargs": {"img_size": cfg.method_img_size, **cfg.method_model, "lean_backward": cfg.lean_backward}}
    if row == "supervised":
        module = Supervised(num_classes=cfg.num_classes, label_smoothing=0.1, **common)
        module.probe = None  # the timed step never runs the online probe, and the peer has none
    elif row == "mpp":
        module = MPP(mean=NORM_MEAN, std=NORM_STD, **common)
    elif row == "mocov3":
        module = MoCoV3(proj_hidden_dim=cfg.moco_hidden_dim, proj_output_dim=cfg.moco_out_dim, pred_hidden_dim=cfg.moco_hidden_dim, **common)
    else:
        module = DINO(out_dim=cfg.dino_out_dim, hidden_dim=cfg.dino_hidden_dim, bottleneck_dim=cfg.dino_bottleneck_dim, **common)
    # after each optimiser step, as in training: the EMA of a momentum encoder / teacher (at the
    # schedule's first momentum: there is no Trainer step count here), DINO's centre
    return module, lambda views, labels: module.step(views, labels)["loss"], lambda i: module.after_optimizer_step()


def _peer(row: str, cfg: BenchConfig) -> tuple[nn.Module, LossFn, Callable[[int], Any] | None]:
    """The peer of ``row`` (see the module docstring), its loss and its momentum update."""
    from lightly.loss import DINOLoss
    from lightly.models import utils
    from lightly.models.modules import MaskedVisionTransformerTIMM, heads
    from lightly.utils.scheduler import cosine_schedule
    from timm.models.vision_transformer import VisionTransformer

    shape, size = (cfg.backbone_model, cfg.backbone_img_size) if row == "backbone" else (cfg.method_model, cfg.method_img_size)
    # our ViT's layers (pre-norm, LayerNorm eps 1e-6, qkv bias, [CLS] pooling); DINO's local crops have another size
    vit = VisionTransformer(img_size=size, num_classes=cfg.num_classes if row == "supervised" else 0, dynamic_img_size=row == "dino", **shape)
    d, h, o = shape["embed_dim"], cfg.moco_hidden_dim, cfg.moco_out_dim
    if row == "backbone":
        return vit, lambda views, labels: vit(views[0]).float().mean(), None
    if row == "supervised":
        return vit, lambda views, labels: F.cross_entropy(vit(views[0]), labels, label_smoothing=0.1), None
    if row == "mpp":
        m = nn.ModuleDict({"backbone": MaskedVisionTransformerTIMM(vit=vit, pos_embed_initialization="learn"), "head": nn.Linear(d, 8 ** shape["in_chans"])})
        return m, lambda views, labels: _mpp_loss(m, shape["patch_size"], views[0]), None
    if row == "mocov3":
        vit.patch_embed.proj.requires_grad_(False)  # a random patch projection (MoCo v3 §4)
        proj = heads.ProjectionHead([(d, h, nn.BatchNorm1d(h), nn.ReLU()), (h, h, nn.BatchNorm1d(h), nn.ReLU()), (h, o, nn.BatchNorm1d(o, affine=False), None)])
        pred = heads.ProjectionHead([(o, h, nn.BatchNorm1d(h), nn.ReLU()), (h, o, nn.BatchNorm1d(o, affine=False), None)])
        m = nn.ModuleDict({"backbone": vit, "projection_head": proj, "prediction_head": pred,
                           "backbone_momentum": copy.deepcopy(vit), "projection_head_momentum": copy.deepcopy(proj)})

        def loss(views: list[Tensor], labels: Tensor) -> Tensor:
            p0, p1 = (m.prediction_head(m.projection_head(m.backbone(x))) for x in views)
            z0, z1 = (m.projection_head_momentum(m.backbone_momentum(x)).detach() for x in views)
            return _ctr(p0, z1) + _ctr(p1, z0)

        pairs = [(m.backbone, m.backbone_momentum), (m.projection_head, m.projection_head_momentum)]
    else:
        with warnings.catch_warnings():  # lightly's head still uses the deprecated nn.utils.weight_norm
            warnings.simplefilter("ignore", FutureWarning)
            # two heads, the teacher's loaded from the student's: deepcopy fails on weight_norm's non-leaf weight
            student, teacher = (heads.DINOProjectionHead(d, cfg.dino_hidden_dim, cfg.dino_bottleneck_dim, cfg.dino_out_dim, batch_norm=False) for _ in range(2))
        teacher.load_state_dict(student.state_dict())
        m = nn.ModuleDict({"student_backbone": vit, "student_head": student, "teacher_backbone": copy.deepcopy(vit), "teacher_head": teacher,
                           "criterion": DINOLoss(output_dim=cfg.dino_out_dim, warmup_teacher_temp=0.04, teacher_temp=0.04)})

        def loss(views: list[Tensor], labels: Tensor) -> Tensor:
            teacher = [m.teacher_head(m.teacher_backbone(v)) for v in views[:2]]
            student = [m.student_head(m.student_backbone(v)) for v in views]
            return m.criterion(teacher, student, teacher_temp=0.04)

        pairs = [(m.student_backbone, m.teacher_backbone), (m.student_head, m.teacher_head)]
    for _, momentum in pairs:
        utils.deactivate_requires_grad(momentum)
    return m, loss, lambda i: [utils.update_momentum(a, b, cosine_schedule(i, _SCHEDULE_STEPS, 0.996, 1.0)) for a, b in pairs]


def _mpp_loss(m: nn.ModuleDict, patch_size: int, images: Tensor, mask_ratio: float = 0.5) -> Tensor:
    """lightly's SimMIM example with MPP's target: the masked patches' mean colour, 3 bits a channel."""
    from lightly.models import utils

    b, c = images.shape[:2]
    _, idx_mask = utils.random_token_mask(size=(b, m.backbone.sequence_length), mask_ratio=mask_ratio, device=images.device)
    tokens = m.backbone.encode(images=images, idx_mask=idx_mask)  # [B, 1+N, D]
    pred = m.head(utils.get_at_index(tokens, idx_mask))  # [B, M, 8^C]
    with torch.no_grad():
        mean, std = (torch.tensor(v, device=images.device).view(1, -1, 1, 1) for v in (NORM_MEAN, NORM_STD))
        patches = utils.patchify((images.float() * std + mean).clamp(0, 1), patch_size)  # [B, N, P*P*C], channel last
        levels = (patches.reshape(b, patches.shape[1], -1, c).mean(2) * 8).floor().clamp(0, 7).long()  # [B, N, C]
        target = (levels * 8 ** torch.arange(c - 1, -1, -1, device=images.device)).sum(-1)  # [B, N]
        target = torch.gather(target, 1, idx_mask - 1)  # [B, M]; the sequence has [CLS] first
    return F.cross_entropy(pred.flatten(0, 1).float(), target.flatten())


def _ctr(q: Tensor, k: Tensor, temperature: float = 0.2) -> Tensor:
    """MoCo v3's loss (Algorithm 1) in lightly's style: cross-entropy of ``q kᵀ / τ``, times 2τ."""
    logits = F.normalize(q.float(), dim=1) @ F.normalize(k.float(), dim=1).T / temperature  # [B, B]
    return F.cross_entropy(logits, torch.arange(q.shape[0], device=q.device)) * (2 * temperature)


def workload(row: str, impl: Literal["ours", "peer"], cfg: BenchConfig, device: torch.device, compile: bool = False) -> Workload:
    """One training step of ``row`` by ``impl`` on a seeded batch (the same for both sides). The
    peers' AdamW is created as lightly's examples create it (torch's default implementation; the
    LR and weight decay do not change a step's cost). ``compile``: every ViT's blocks through
    ``torch.compile`` (inductor), as ``compile_backbone: true`` trains them."""
    from timm.models.vision_transformer import VisionTransformer

    gen = torch.Generator().manual_seed(cfg.seed)
    views = [torch.randn(shape, generator=gen).to(device) for shape in row_views(row, cfg)]
    labels = torch.randint(0, cfg.num_classes, (views[0].shape[0],), generator=gen).to(device)
    model, loss_fn, update = (_ours if impl == "ours" else _peer)(row, cfg)
    model.to(device).train()
    if compile and impl == "ours" and row != "backbone":
        model.compile_backbones("inductor")  # its backbone, momentum encoder, teacher
    elif compile:  # our bare ViT, or each of the peer's timm ViTs
        for vit in [model] if impl == "ours" else [m for m in model.modules() if isinstance(m, VisionTransformer)]:
            compile_backbone(vit, "inductor")
    optimizer = None
    if row != "backbone":
        optimizer = model.configure_optimizers() if impl == "ours" else torch.optim.AdamW(model.parameters(), lr=1.5e-4, weight_decay=0.05)
    amp = torch.autocast(device.type, torch.bfloat16, enabled=cfg.precision == "bf16-mixed")
    counter = itertools.count()

    def step() -> None:
        with amp:
            loss = loss_fn(views, labels)
        loss.backward()
        if optimizer is None:  # the backbone row: forward and backward only
            model.zero_grad(set_to_none=True)
            return
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if update is not None:
            update(next(counter))

    return Workload(step, model, views, labels)


# ---------------------------------------------------------------------------------- augmentations
# row: (our transform, the methods that train on it, lightly's transform with the same settings)
DATA_ROWS = {"single": ("SingleView", "supervised, mpp", None), "two": ("TwoViews", "mocov3", "BYOLTransform"),
             "multicrop": ("MultiCrop", "dino", "DINOTransform")}


def view_transform(cfg: BenchConfig, row: str, impl: Literal["ours", "peer"]) -> Callable[[Any], list[Any]]:
    """Our transform of an augmentation row, or lightly's with its settings (unnormalised, as ours:
    the datamodule normalises)."""
    from lightly.transforms import BYOLTransform, BYOLView1Transform, BYOLView2Transform

    from ssl_vit.data.views import MultiCrop, SingleView, TwoViews

    size = cfg.data_global_size
    if row == "multicrop":
        ours = MultiCrop(global_size=size, local_size=cfg.data_local_size, n_local_crops=cfg.data_n_local_crops)
        return ours if impl == "ours" else lightly_dino_transform(ours)
    if row == "single" or impl == "ours":
        return SingleView(size=size) if row == "single" else TwoViews(size=size)
    ours = TwoViews(size=size)
    common = dict(input_size=ours.size, cj_prob=ours.jitter_p, cj_bright=ours.brightness, cj_contrast=ours.contrast, cj_sat=ours.saturation,
                  cj_hue=ours.hue, min_scale=ours.scale[0], random_gray_scale=ours.grayscale_p, hf_prob=ours.flip_p,
                  sigmas=tuple(ours.augmentations()[0].blur_sigma), normalize=None)  # ours scales the blur's sigma with the size
    return BYOLTransform(BYOLView1Transform(gaussian_blur=ours.blur_p[0], solarization_prob=ours.solarize_p[0], **common),
                         BYOLView2Transform(gaussian_blur=ours.blur_p[1], solarization_prob=ours.solarize_p[1], **common))


def lightly_dino_transform(multicrop: Any) -> Any:
    """lightly's ``DINOTransform`` with the settings of our ``MultiCrop``, unnormalised. lightly
    scales the jitter by ``cj_strength`` but does not pass it to its second global view (which keeps
    its default 0.5): at 0.5 and doubled strengths every view gets exactly ours."""
    from lightly.transforms import DINOTransform

    return DINOTransform(
        global_crop_size=multicrop.global_size, global_crop_scale=multicrop.global_scale, local_crop_size=multicrop.resolved_local_size,
        local_crop_scale=multicrop.local_scale, n_local_views=multicrop.n_local_crops, hf_prob=multicrop.flip_p, cj_prob=multicrop.jitter_p,
        cj_strength=0.5, cj_bright=2 * multicrop.brightness, cj_contrast=2 * multicrop.contrast, cj_sat=2 * multicrop.saturation,
        cj_hue=2 * multicrop.hue, random_gray_scale=multicrop.grayscale_p, gaussian_blur=multicrop.blur_p,
        sigmas=multicrop.augmentations()[0].blur_sigma, solarization_prob=multicrop.solarize_p, normalize=None,
    )


# ---------------------------------------------------------------------------------- jobs
def _loadavg() -> list[float] | None:
    with contextlib.suppress(OSError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def environment(cfg: BenchConfig) -> dict[str, Any]:
    """The machine and software the numbers were measured on."""
    import lightly
    import timm

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "timm": timm.__version__, "lightly": lightly.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "device": cfg.device, "loadavg": _loadavg(),
            "allocator": allocator_note(), "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    if cfg.device.startswith("cuda"):
        info.update(gpu=torch.cuda.get_device_name(cfg.device), cuda=torch.version.cuda)
    return info


def memory_job(cfg: BenchConfig, row: str, impl: Literal["ours", "peer"]) -> dict[str, Any]:
    """Peak memory of one side alone: its model, the optimiser state (made by the first step), the
    activations of ``memory_steps`` steps. Then one step whose saved tensors are counted and one
    under FlopCounterMode."""
    device = torch.device(cfg.device)
    with peak_memory(device) as out:
        work = workload(row, impl, cfg, device)
        for _ in range(cfg.memory_steps):
            work.step()
    params = list(work.model.parameters())
    out.update(params=sum(p.numel() for p in params), trainable_params=sum(p.numel() for p in params if p.requires_grad),
               saved_activation_bytes=saved_activation_bytes(work.step, params),
               flops_per_image_counted=count_flops(work.step) / work.views[0].shape[0])
    return out


def timing_job(cfg: BenchConfig, row: str) -> dict[str, Any]:
    """Ours and the peer of ``row`` timed interleaved, with a dense square matmul taking its turn in
    each round (fp32, three products on a CPU; bf16, ten of at least 8192 on a GPU)."""
    device = torch.device(cfg.device)
    works = {impl: workload(row, impl, cfg, device, cfg.compile) for impl in (("ours", "peer") if cfg.peers else ("ours",))}
    n, reps = (cfg.round_matmul_size, 3) if device.type == "cpu" else (max(cfg.round_matmul_size, 8192), 10)
    a = torch.randn(n, n, device=device, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
    product = torch.empty_like(a)
    steps: dict[str, Callable[[], Any]] = {impl: w.step for impl, w in works.items()}
    steps["matmul"] = lambda: [torch.mm(a, a, out=product) for _ in range(reps)]
    load = _loadavg()
    timing = time_interleaved(steps, cfg.warmup, cfg.steps, device)
    for impl, work in works.items():
        batch = timing[impl]["batch"] = work.views[0].shape[0]
        timing[impl]["images_per_s"] = batch / timing[impl]["median_step_s"]
    timing["matmul"]["flops_per_s"] = [2.0 * n**3 * reps / t for t in timing["matmul"]["step_s"]]
    if cfg.peers:  # > 1: ours is faster, in the same round
        timing["paired_ratio"] = paired(timing["peer"]["step_s"], timing["ours"]["step_s"], timing["counted"])
    return {**timing, "loadavg": [load, _loadavg()]}


def views_job(cfg: BenchConfig, row: str, impl: Literal["ours", "peer"]) -> dict[str, Any]:
    """Views per second of an augmentation row's transform on random RGB images (decoded: decoding is not timed)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(cfg.seed)
    size = cfg.data_source_size
    images = [Image.fromarray(torch.randint(0, 256, (size, size, 3), generator=gen, dtype=torch.uint8).numpy()) for _ in range(cfg.data_images)]
    transform = view_transform(cfg, row, impl)
    return {"views_per_s": views_per_second(transform, images, cfg.data_seconds), "views_per_image": len(transform(images[0]))}


def _run_job(cfg: BenchConfig, fn: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> dict[str, Any]:
    try:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        return fn(cfg, *args)
    except Exception as err:  # out of memory too: one failed row does not sink the run
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def _child(conn: Any, cfg: BenchConfig, fn: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> None:
    keep_freed_memory()  # a fresh interpreter gets the heap setting ssl-vit was given (SSL_VIT_MALLOC)
    conn.send(_run_job(cfg, fn, args))
    conn.close()


def isolated(cfg: BenchConfig, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(cfg, *args)`` in a process of its own, so that its peak memory is its own and nothing
    (allocator caches, thread pools, compiled kernels) carries over; an error comes back as
    ``{"error": ...}``. On a CPU forked from a forkserver that imported torch, timm, lightly and
    ssl_vit once but never computed (a process that ran OpenMP work cannot be forked safely); on
    CUDA a fresh ``spawn``; ``isolation="none"`` runs it here (debugging: memory then mixes jobs).
    Forkserver and spawn import the caller's main module again: call from under ``__main__``."""
    how = cfg.isolation if cfg.isolation != "auto" else ("spawn" if cfg.device.startswith("cuda") else "forkserver")
    if how == "none":
        return _run_job(cfg, fn, args)
    ctx = mp.get_context(how)
    if how == "forkserver":
        ctx.set_forkserver_preload([__name__, "ssl_vit.methods", "timm", "lightly.loss"])
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(sender, cfg, fn, args), daemon=True)
    process.start()
    sender.close()
    try:
        result = receiver.recv() if receiver.poll(cfg.job_timeout_s) else {"error": f"timed out after {cfg.job_timeout_s:.0f} s"}
    except EOFError:
        result = {"error": "the benchmark process died without a result (out of memory?)"}
    process.join(30)
    if process.is_alive():
        process.kill()
    elif process.exitcode and "error" not in result:
        result["error"] = f"the benchmark process exited with code {process.exitcode}"
    receiver.close()
    return result


# ---------------------------------------------------------------------------------- the run
def _train_row(cfg: BenchConfig, row: str, say: Callable[[str], None]) -> dict[str, Any]:
    impls = ("ours", "peer") if cfg.peers else ("ours",)
    out: dict[str, Any] = {"name": row, "label": row_label(row, cfg), "views": [list(v) for v in row_views(row, cfg)],
                           "peer_name": PEER_NAMES[row] if cfg.peers else None}
    for impl in impls:  # a GPU's max_memory_allocated is the same every time, a CPU's RSS is not
        runs = [isolated(cfg, memory_job, row, impl) for _ in range(cfg.memory_repeats if cfg.device == "cpu" else 1)]
        good = [r for r in runs if "error" not in r]
        res = out[impl] = min(good, key=lambda r: r["peak_mem_bytes"]) if good else runs[0]
        if len(good) > 1:
            res["peak_mem_bytes_runs"] = [r["peak_mem_bytes"] for r in good]
        say(f"  {row:<10} {impl:<4} " + (res["error"] if "error" in res else f"peak {res['peak_mem_bytes'] / MiB:.0f} MiB"))
    timing = isolated(cfg, timing_job, row)
    if "error" in timing:
        out["timing_error"] = timing
        say(f"  {row:<10} timing: {timing['error']}")
        return out
    for impl in impls:
        out[impl] = {**timing[impl], **out[impl]}  # a memory error stays visible
    out.update(paired_ratio=timing.get("paired_ratio"), round_matmul=timing["matmul"], counted=timing["counted"], loadavg=timing["loadavg"])
    say(f"  {row:<10} " + ", ".join(f"{impl} {timing[impl]['images_per_s']:.2f} img/s" for impl in impls)
        + (" (disturbed by other load)" if timing["ours"]["disturbed"] else ""))
    return out


def _derive(row: dict[str, Any], matmul_peak: float | None) -> None:
    """FLOP/s (ours' FLOPs per image, the same work for the peer), the fraction of the matmul rate
    (``matmul_fraction``: against the matmul in the same rounds; ``matmul_fraction_of_peak``:
    against the run's best rate, pessimistic on a machine whose speed drifts), and the ratios
    ours / peer: speed from the median step times, memory from the peaks."""
    flops = row["flops_per_image"] = (row.get("ours") or {}).get("flops_per_image_counted")
    for res in (row.get(impl) for impl in ("ours", "peer")):
        if res is None or "images_per_s" not in res or not flops:
            continue
        res["flops_per_s"] = flops * res["images_per_s"]
        res["matmul_fraction_of_peak"] = res["flops_per_s"] / matmul_peak if matmul_peak else None
        achieved = [flops * res["batch"] / t for t in res["step_s"]]
        res["matmul_fraction_paired"] = paired(achieved, row["round_matmul"]["flops_per_s"], row["counted"])
        res["matmul_fraction"] = res["matmul_fraction_paired"]["median"]
    ours, peer = row.get("ours") or {}, row.get("peer") or {}
    if "images_per_s" in ours and "images_per_s" in peer:
        row["throughput_ratio"] = ours["images_per_s"] / peer["images_per_s"]
    if ours.get("peak_mem_bytes") and peer.get("peak_mem_bytes"):
        row["memory_ratio"] = ours["peak_mem_bytes"] / peer["peak_mem_bytes"]


def _targets(rows: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for r in rows:
        speed, memory = r.get("throughput_ratio"), r.get("memory_ratio")
        if r["name"] != "backbone" and speed is not None and memory is not None:
            targets[r["name"]] = {"throughput_ratio": speed, "memory_ratio": memory, "pass": speed >= TARGET_SPEED and memory <= TARGET_MEMORY}
        elif r["name"] == "backbone" and speed is not None:
            targets["backbone"] = {"throughput_ratio": speed, "pass": speed >= TARGET_BACKBONE}
    backbone = next((r for r in rows if r["name"] == "backbone"), {})
    fraction = (backbone.get("ours") or {}).get("matmul_fraction")
    if fraction is not None and cfg.device == "cpu" and vit_label(cfg.backbone_model) == "ViT-S/16" and cfg.backbone_img_size == 224:
        targets["matmul_fraction"] = {"ours": fraction, "peer": (backbone.get("peer") or {}).get("matmul_fraction"), "pass": fraction >= TARGET_MATMUL}
    return targets


def run_benchmark(cfg: BenchConfig, progress: Callable[[str], None] | None = lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Every measurement ``cfg`` asks for, each in its own process (:func:`isolated`), and what
    follows from them; returns the JSON-ready result that :func:`format_report` prints."""
    say = progress or (lambda msg: None)
    start = time.perf_counter()
    m = cfg.backbone_model  # its largest matmul joins the sizes: the MLP's [B·T, D] @ [D, 4D]
    tokens = cfg.backbone_batch * ((cfg.backbone_img_size // m["patch_size"]) ** 2 + 1)
    sizes = (*cfg.matmul_sizes, (tokens, m["embed_dim"], int(m["embed_dim"] * m["mlp_ratio"])))
    result: dict[str, Any] = {"format": RESULT_FORMAT, "config": dataclasses.asdict(cfg), "environment": isolated(cfg, environment)}
    say("matmul rate ...")
    result["matmul"] = isolated(cfg, matmul_rates, sizes)
    result["rows"] = []
    for row in ("backbone", *cfg.methods):
        say(f"{row} ...")
        result["rows"].append(_train_row(cfg, row, say))
    result["data"] = []
    for name, (transform, methods, peer_name) in DATA_ROWS.items() if cfg.data else ():
        if set(methods.split(", ")) & set(cfg.methods):
            res = {"name": name, "transform": transform, "methods": methods, "peer_name": peer_name}
            for impl in ("ours", "peer") if peer_name and cfg.peers else ("ours",):
                res[impl] = isolated(cfg, views_job, name, impl)
                say(f"  {transform:<10} {impl:<4} " + (res[impl]["error"] if "error" in res[impl] else f"{res[impl]['views_per_s']:.1f} views/s"))
            if "views_per_s" in res.get("peer", {}) and "views_per_s" in res["ours"]:
                res["throughput_ratio"] = res["ours"]["views_per_s"] / res["peer"]["views_per_s"]
            result["data"].append(res)
    # Again at the end: one measurement can catch a busy moment, and the best rate is the machine's.
    result["matmul_end"] = isolated(cfg, matmul_rates, sizes)
    peak = result["matmul_peak_flops_per_s"] = max((r.get("peak_flops_per_s") or 0 for r in (result["matmul"], result["matmul_end"])), default=0) or None
    for row in result["rows"]:
        _derive(row, peak)
    return {**result, "targets": _targets(result["rows"], cfg), "loadavg_end": _loadavg(), "wall_s": time.perf_counter() - start}


# ---------------------------------------------------------------------------------- the report
def _num(x: float | None, fmt: str = ".2f", scale: float = 1.0) -> str:
    """``x / scale`` in ``fmt``; a value ``fmt`` would print as 0 (a tiny model's GFLOPs) keeps two digits."""
    if x is None:
        return "-"
    return format(x / scale, ".2g") if x and fmt.endswith("f") and not format(abs(x / scale), fmt).strip("0.") else format(x / scale, fmt)


def _ratio(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _side(res: dict[str, Any] | None, key: str, fmt: str = ".2f", scale: float = 1.0) -> str:
    return "-" if res is None else "error" if "error" in res else _num(res.get(key), fmt, scale)


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)])
    widths = [max(len(c) for c in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [header, *rows])


def step_table(result: dict[str, Any], markdown: bool = False) -> str:
    header = ["step", "config", "ours img/s", "peer img/s", "speed", "per-round speed", "ours MiB", "peer MiB", "memory", "saved MiB ours/peer",
              "GFLOP/img", "ours GFLOP/s", "ours/peer of matmul", "FLOPs ours/peer"]
    rows = []
    for r in result["rows"]:
        sides, flops, spread = (r.get("ours"), r.get("peer")), r.get("flops_per_image"), (r.get("paired_ratio") or {}).get("quartiles")
        counted = [(x or {}).get("flops_per_image_counted") for x in sides]
        rows.append([r["name"], r["label"], *(_side(x, "images_per_s") + ("*" if x and x.get("disturbed") else "") for x in sides),
                     _ratio(r.get("throughput_ratio")), f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
                     *(_side(x, "peak_mem_bytes", ".0f", MiB) for x in sides), _ratio(r.get("memory_ratio")),
                     "/".join(_side(x, "saved_activation_bytes", ".0f", MiB) for x in sides), _num(flops, ".2f", 1e9),
                     _side(sides[0], "flops_per_s", ".1f", 1e9), "/".join(_pct((x or {}).get("matmul_fraction")) for x in sides),
                     "/".join(_num(c / flops if c is not None and flops else None, ".3f") for c in counted)])
    return _table(header, rows, markdown)


def data_table(result: dict[str, Any], markdown: bool = False) -> str:
    header = ["augmentation", "methods", "views/image", "ours views/s/worker", "peer", "peer views/s/worker", "speed"]
    rows = [[d["transform"], d["methods"], _side(d.get("ours"), "views_per_image", ".0f"), _side(d.get("ours"), "views_per_s", ".1f"),
             d["peer_name"] or "-", _side(d.get("peer"), "views_per_s", ".1f"), _ratio(d.get("throughput_ratio"))] for d in result.get("data", [])]
    return _table(header, rows, markdown)


def _header(result: dict[str, Any]) -> list[str]:
    env, cfg = result.get("environment", {}), result["config"]
    lines = [
        f"machine: {env.get('cpu', '?')}, {env.get('cpus_usable', '?')} usable cores, {env.get('mem_total_gib', '?')} GiB" + (f", {env['gpu']}" if env.get("gpu") else ""),
        f"software: torch {env.get('torch', '?')} ({env.get('torch_threads', '?')} threads), timm {env.get('timm', '?')}, lightly {env.get('lightly', '?')}, "
        f"Python {env.get('python', '?')}; C heap: {env.get('allocator', '?')}; our ViT: lean_backward={cfg.get('lean_backward', True)}; AdamW: ours "
        f"{'fused' if cfg.get('fused_optimizer') else 'torch default'}, peers torch default"
        + ("; timed with every ViT's blocks compiled (torch.compile, inductor), ours and the peers'" if cfg.get("compile") else ""),
        f"device {cfg['device']}, precision {cfg['precision']}, {cfg['warmup']} warm-up steps + {cfg['steps']} timed rounds (ours and peer "
        f"interleaved; medians), load average at start {env.get('loadavg')} / end {result.get('loadavg_end')}",
    ]
    for key, when in (("matmul", "start"), ("matmul_end", "end")):
        mm = result.get(key, {})
        if "sizes" in mm:
            sizes = [f"{'x'.join(map(str, s['mkn']))}: {s['flops_per_s'] / 1e9:.1f}" + (" (disturbed)" if s.get("disturbed") else "") for s in mm["sizes"]]
            lines.append(f"matmul {mm['dtype']} GFLOP/s at the {when}: {', '.join(sizes)}")
        elif "error" in mm:
            lines.append(f"matmul at the {when}: error: {mm['error']}")
    if result.get("matmul_peak_flops_per_s"):
        lines.append(f"matmul rate, best of the above: {result['matmul_peak_flops_per_s'] / 1e9:.1f} GFLOP/s")
    return lines


def _target_lines(targets: dict[str, Any]) -> list[str]:
    lines = []
    for name, t in targets.items():
        mark = "[ok]" if t["pass"] else "[MISSED]"
        if name == "backbone":
            lines.append(f"backbone >= {TARGET_BACKBONE:.2f}x timm: {_ratio(t['throughput_ratio'], 3)} {mark}")
        elif name == "matmul_fraction":
            lines.append(f"ViT-S/16 224 px training >= {TARGET_MATMUL:.0%} of the matmul rate: ours {_pct(t['ours'])}, timm {_pct(t.get('peer'))} {mark}")
        else:
            lines.append(f"{name} >= {TARGET_SPEED:.2f}x peer speed at <= its memory: {_ratio(t['throughput_ratio'], 3)} speed, "
                         f"{_ratio(t['memory_ratio'], 3)} memory {mark}")
    return lines


def format_report(result: dict[str, Any], markdown: bool = False) -> str:
    """The report of a result: the machine, the step and augmentation tables, the targets, the errors."""
    parts = [*_header(result), "", step_table(result, markdown), "",
             "speed, memory: ours / peer (speed from the median step times; per-round speed: quartiles of the ratio within each interleaved "
             "round, i.e. the noise). GFLOP/img: FLOPs of one training step per image (a multiply-add is 2); FLOPs ours/peer: each side's, "
             "counted by torch's FlopCounterMode, over GFLOP/img (1.000: the same work). of matmul: achieved FLOP/s / the dense matmul rate "
             "measured in the same rounds. saved MiB: the tensors autograd keeps for backward in one step, counted exactly (peak RSS on a "
             "CPU also carries the allocator's noise, about 1-3 %)."]
    if any((r.get(i) or {}).get("disturbed") for r in result["rows"] for i in ("ours", "peer")):
        parts.append("* other load took cores away during most timed steps: rerun on a quiet machine")
    if result.get("data"):
        parts += ["", data_table(result, markdown)]
    if result.get("targets"):
        parts += ["", *_target_lines(result["targets"])]
    errors = [f"{r['name']} (timing): {r['timing_error']['error']}" for r in result["rows"] if "timing_error" in r]
    errors += [f"{r['name']} ({i}): {r[i]['error']}" for r in [*result["rows"], *result.get("data", [])] for i in ("ours", "peer") if "error" in (r.get(i) or {})]
    return "\n".join(parts + (["", "errors:", *errors] if errors else []))


def render(path: Path, markdown: bool = False) -> str:
    """The report of an earlier ``--json`` result; anything else is refused naming the file."""
    result = read_json(path)
    if not isinstance(result, dict) or result.get("format") not in READABLE_FORMATS:
        raise ValueError(f"{path}: not a benchmark result (no format {RESULT_FORMAT!r}, which ssl-vit benchmark --json writes)")
    try:
        return format_report(result, markdown)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as err:
        raise ValueError(f"{path}: not a benchmark result (malformed: {type(err).__name__} {one_line(str(err))})") from None
