"""``ssl-vit benchmark``: each method's training step against the same step composed as lightly's
examples compose it around timm's ViT (speed, peak memory, saved activations, FLOP/s against a dense
matmul timed in the same rounds), the bare backbone against timm's, a DataLoader worker's CPU time per
JPEG, and DINO fed by the real loader. Each measurement runs in a fresh process. Figures: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import itertools
import math
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_vit.backbones import VisionTransformer, compile_backbone, create_backbone
from ssl_vit.flops import count_flops
from ssl_vit.io import read_json
from ssl_vit.runtime import allocator_note, keep_freed_memory

RESULT_FORMAT = "ssl-vit-benchmark/3"
METHODS = ("supervised", "mpp", "mocov3", "dino")
TARGET_SPEED = 1.0  # each method's step: at least the peer's speed ...
TARGET_MEMORY = 1.0  # ... at no more than its peak memory
TARGET_BACKBONE = 0.95  # the bare backbone: of timm's speed
TARGET_MATMUL = 0.75  # ViT-S/16 at 224 px training on a CPU: of the dense matmul rate
TARGET_WORKER = 0.2  # a worker making DINO's views on the device: at most this of MultiCrop's CPU time per image
TARGET_FEED = 0.9  # DINO fed by the real loader: of its speed on ready-made input
JPEG_SIZE = (500, 375)  # the worker and feed rows' photos: ImageNet's commonest size
# ViT shapes: keyword arguments of ``create_backbone("vit", ...)`` and of timm's VisionTransformer alike.
VIT_S16 = {"embed_dim": 384, "depth": 12, "num_heads": 6, "patch_size": 16, "mlp_ratio": 4.0, "in_chans": 3}
VIT_TI16 = {**VIT_S16, "embed_dim": 192, "num_heads": 3}
_TINY_VIT = {**VIT_S16, "embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 8}
_VIT_NAMES = {(192, 12, 3): "Ti", (384, 12, 6): "S", (768, 12, 12): "B", (1024, 24, 16): "L", (1280, 32, 16): "H"}  # DeiT, ViT Table 1
MIN_RATE = 0.75  # of the best in-round matmul rate: a round below it lost cores to other load
_SCHEDULE_STEPS = 100_000  # the peers' momentum schedule: long, so the EMA momentum stays realistic while timed
NORM_MEAN, NORM_STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)  # the views' normalisation, both sides (MPP's target undoes it)
MiB = 2**20


def vit_label(m: dict[str, Any]) -> str:
    """``ViT-S/16`` for a shape of the papers' tables, else its dimensions."""
    size = _VIT_NAMES.get((m["embed_dim"], m["depth"], m["num_heads"])) if m["mlp_ratio"] == 4.0 else None
    name = f"ViT-{size}" if size else f"ViT(D={m['embed_dim']},L={m['depth']},H={m['num_heads']})"
    return f"{name}/{m['patch_size']}"


@dataclass(frozen=True)
class BenchConfig:
    """One run. The backbone row trains ``backbone_model`` at ``backbone_img_size`` (ViT-S/16 at 224 px: the
    matmul target's configuration), the method rows ``method_model`` at ``method_img_size`` with the papers' heads."""

    backbone_model: dict[str, Any] = field(default_factory=lambda: dict(VIT_S16))
    backbone_img_size: int = 224
    backbone_batch: int = 32
    method_model: dict[str, Any] = field(default_factory=lambda: dict(VIT_S16))
    method_img_size: int = 112
    method_batch: int = 32
    local_size: int = 48  # DINO's row: n_local_crops more crops of local_size px
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
    round_matmul_size: int = 2048  # the n x n @ n x n product timed in every round (at least 8192 on GPUs)
    data: bool = True  # the worker row (with DINO among the methods): MultiCrop(**multicrop), data_seconds of CPU each
    multicrop: dict[str, int] = field(default_factory=lambda: {"global_size": 224, "local_size": 96, "n_local_crops": 8})
    data_seconds: float = 3.0
    device: str = "cpu"
    precision: Literal["32", "bf16-mixed"] = "32"
    threads: int | None = None
    isolation: Literal["auto", "forkserver", "spawn", "none"] = "auto"
    seed: int = 0
    peers: bool = True
    lean_backward: bool = True  # our ViT's norm_linear + gelu_linear; False: the plain modules
    fused_optimizer: bool = True  # ours on torch's fused AdamW; False: torch's default, as the peers
    compile: bool = False  # every ViT's blocks through torch.compile (inductor) in the timing jobs
    feed: bool = False  # DINO at the multicrop sizes fed by the loader vs ready-made input (a GPU's measurement)
    feed_workers: int = 8  # the loader's worker processes in the feed row


PRESETS = {
    "full": BenchConfig(),  # RESULTS.md's numbers (about 14 minutes on 2 cores)
    "quick": BenchConfig(backbone_batch=8, method_model=VIT_TI16, method_img_size=64, method_batch=16, local_size=32,
                         warmup=1, steps=3, memory_repeats=1, data_seconds=1.0),  # under 2 minutes on 2 cores
    "tiny": BenchConfig(  # seconds
        backbone_model=_TINY_VIT, backbone_img_size=32, backbone_batch=4, method_model=_TINY_VIT, method_img_size=32,
        method_batch=4, local_size=16, n_local_crops=2, num_classes=10, moco_hidden_dim=64, moco_out_dim=16,
        dino_out_dim=128, dino_hidden_dim=64, dino_bottleneck_dim=16, warmup=1, steps=2, memory_repeats=1,
        round_matmul_size=128, multicrop={"global_size": 32, "local_size": 16, "n_local_crops": 2}, data_seconds=0.05,
    ),
}


# ---------------------------------------------------------------------------------- instruments
def time_interleaved(steps: dict[str, Callable[[], Any]], warmup: int, rounds: int, device: torch.device) -> dict[str, list[float]]:
    """Wall seconds of each step in each round, after ``warmup`` untimed calls of each; odd rounds run
    the steps in reverse order (ABBA), so that a drift of the machine's speed reaches all alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    walls: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            start = time.perf_counter()
            steps[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            walls[name].append(time.perf_counter() - start)
    return walls


def paired(numerator: Sequence[float], denominator: Sequence[float], counted: Sequence[int]) -> dict[str, Any]:
    """Median and quartiles (the noise) of the ratio ``numerator[i] / denominator[i]`` within each counted round."""
    xs = sorted(numerator[i] / denominator[i] for i in counted)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0], xs[0], xs[0]]
    return {"median": statistics.median(xs), "quartiles": [q[0], q[2]]}


def _proc_status() -> dict[str, int]:
    """The memory fields of ``/proc/self/status`` in bytes (none without /proc)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if v.strip().endswith("kB")}
    return {}


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, int]]:
    """Sets ``peak_mem_bytes`` of the block in the dict it yields. CUDA: ``max_memory_allocated`` above the start.
    CPU: the resident high-water mark (reset through ``/proc/self/clear_refs``) less the anonymous memory at the
    start and the file-backed pages at the end (the code of shared libraries says nothing about a step)."""
    out: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield out
        torch.cuda.synchronize(device)
        out["peak_mem_bytes"] = max(torch.cuda.max_memory_allocated(device) - start, 0)
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the current resident set
    before = _proc_status()
    yield out
    now = _proc_status()
    hwm = now.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    out["peak_mem_bytes"] = max(hwm - now.get("RssFile", 0) - now.get("RssShmem", 0) - before.get("RssAnon", 0), 0)


def saved_activation_bytes(step: Callable[[], Any], params: Sequence[Tensor]) -> int:
    """Bytes of the distinct tensors autograd keeps for backward during ``step``, parameters (and their views) left out."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if (ptr := t.untyped_storage().data_ptr()) not in param_storages:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def cpu_ms_per_call(fn: Callable[[Any], Any], items: Sequence[Any], seconds: float) -> float:
    """CPU milliseconds per call of ``fn`` over ``items`` on one thread, as a DataLoader worker runs it, for at least
    ``seconds`` after one untimed call on each; CPU time, which other load on the machine does not stretch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for item in items:
            fn(item)
        calls, start = 0, time.process_time()
        while (elapsed := time.process_time() - start) < seconds or calls == 0:
            fn(items[calls % len(items)])
            calls += 1
        return 1e3 * elapsed / calls
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------- the steps
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
    n_global, n_local = (2 if row in ("mocov3", "dino") else 1), (cfg.n_local_crops if row == "dino" else 0)
    return [(b, c, s, s)] * n_global + [(b, c, local, local)] * n_local


def row_label(row: str, cfg: BenchConfig) -> str:
    """``ViT-S/16 2x112+8x48px b32``: the model, the crops and the batch of a row."""
    views = row_views(row, cfg)
    crops = "+".join(f"{n}x{size}" if n > 1 else str(size) for size, n in Counter(v[-1] for v in views).items())
    model = vit_label(cfg.backbone_model if row == "backbone" else cfg.method_model)
    return f"{model} {crops}px b{views[0][0]}" + (" fwd+bwd" if row == "backbone" else "")


def _ours(row: str, cfg: BenchConfig) -> tuple[nn.Module, LossFn, Callable[[int], Any] | None]:
    """Our model of ``row``, its loss and what follows its optimiser step (the EMA of a momentum encoder or
    teacher at the schedule's first momentum, DINO's centre)."""
    from ssl_vit.methods import DINO, MPP, MoCoV3, Supervised

    if row == "backbone":
        vit = create_backbone("vit", img_size=cfg.backbone_img_size, **cfg.backbone_model, lean_backward=cfg.lean_backward)
        return vit, lambda views, labels: vit(views[0]).float().mean(), None
    backbone_kwargs = {"img_size": cfg.method_img_size, **cfg.method_model, "lean_backward": cfg.lean_backward}
    common = {"backbone": "vit", "backbone_kwargs": backbone_kwargs, "fused_optimizer": cfg.fused_optimizer}
    if row == "supervised":
        module = Supervised(num_classes=cfg.num_classes, label_smoothing=0.1, **common)
        module.probe = None  # the timed step never runs the online probe, and the peer has none
    elif row == "mpp":
        module = MPP(mean=NORM_MEAN, std=NORM_STD, **common)
    elif row == "mocov3":
        hidden, out = cfg.moco_hidden_dim, cfg.moco_out_dim
        module = MoCoV3(proj_hidden_dim=hidden, proj_output_dim=out, pred_hidden_dim=hidden, **common)
    else:
        module = DINO(out_dim=cfg.dino_out_dim, hidden_dim=cfg.dino_hidden_dim, bottleneck_dim=cfg.dino_bottleneck_dim, **common)
    return module, lambda views, labels: module.step(views, labels)["loss"], lambda i: module.after_optimizer_step()


def _peer(row: str, cfg: BenchConfig) -> tuple[nn.Module, LossFn, Callable[[int], Any] | None]:
    """The peer of ``row``, its loss and its momentum update, after lightly 1.6's ``examples/pytorch/`` around timm's
    ViT. Supervised: cross-entropy. MPP, which lightly lacks: its SimMIM example with our target (:func:`_mpp_loss`).
    MoCo v3, whose heads and loss lightly lacks: its MoCo/BYOL examples with MoCo v3's MLPs and loss (:func:`_ctr`).
    DINO: ``dino.py``."""
    from lightly.loss import DINOLoss
    from lightly.models import utils
    from lightly.models.modules import MaskedVisionTransformerTIMM, heads
    from lightly.utils.scheduler import cosine_schedule
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    shape, size = (cfg.backbone_model, cfg.backbone_img_size) if row == "backbone" else (cfg.method_model, cfg.method_img_size)
    # our ViT's layers (pre-norm, LayerNorm eps 1e-6, qkv bias, [CLS] pooling); DINO's local crops have another size
    vit = TimmViT(img_size=size, num_classes=cfg.num_classes if row == "supervised" else 0, dynamic_img_size=row == "dino", **shape)
    d, h, o = shape["embed_dim"], cfg.moco_hidden_dim, cfg.moco_out_dim
    if row == "backbone":
        return vit, lambda views, labels: vit(views[0]).float().mean(), None
    if row == "supervised":
        return vit, lambda views, labels: F.cross_entropy(vit(views[0]), labels, label_smoothing=0.1), None
    if row == "mpp":
        backbone = MaskedVisionTransformerTIMM(vit=vit, pos_embed_initialization="learn")
        m = nn.ModuleDict({"backbone": backbone, "head": nn.Linear(d, 8 ** shape["in_chans"])})
        return m, lambda views, labels: _mpp_loss(m, shape["patch_size"], views[0]), None
    if row == "mocov3":
        vit.patch_embed.proj.requires_grad_(False)  # a random patch projection (MoCo v3 §4)
        proj = heads.ProjectionHead([(d, h, nn.BatchNorm1d(h), nn.ReLU()), (h, h, nn.BatchNorm1d(h), nn.ReLU()),
                                     (h, o, nn.BatchNorm1d(o, affine=False), None)])
        pred = heads.ProjectionHead([(o, h, nn.BatchNorm1d(h), nn.ReLU()), (h, o, nn.BatchNorm1d(o, affine=False), None)])
        m = nn.ModuleDict({"backbone": vit, "projection_head": proj, "prediction_head": pred,
                           "backbone_momentum": copy.deepcopy(vit), "projection_head_momentum": copy.deepcopy(proj)})

        def loss(views: list[Tensor], labels: Tensor) -> Tensor:
            p0, p1 = (m.prediction_head(m.projection_head(m.backbone(x))) for x in views)
            z0, z1 = (m.projection_head_momentum(m.backbone_momentum(x)).detach() for x in views)
            return _ctr(p0, z1) + _ctr(p1, z0)

        pairs = [(m.backbone, m.backbone_momentum), (m.projection_head, m.projection_head_momentum)]
    else:
        # two heads, the teacher's loaded from the student's: deepcopy fails on weight_norm's non-leaf weight
        with warnings.catch_warnings():  # lightly's head still uses the deprecated nn.utils.weight_norm
            warnings.simplefilter("ignore", FutureWarning)
            student, teacher = (heads.DINOProjectionHead(d, cfg.dino_hidden_dim, cfg.dino_bottleneck_dim, cfg.dino_out_dim,
                                                         batch_norm=False) for _ in range(2))
        teacher.load_state_dict(student.state_dict())
        criterion = DINOLoss(output_dim=cfg.dino_out_dim, warmup_teacher_temp=0.04, teacher_temp=0.04)
        m = nn.ModuleDict({"student_backbone": vit, "student_head": student, "teacher_backbone": copy.deepcopy(vit),
                           "teacher_head": teacher, "criterion": criterion})

        def loss(views: list[Tensor], labels: Tensor) -> Tensor:
            teacher = [m.teacher_head(m.teacher_backbone(v)) for v in views[:2]]
            student = [m.student_head(m.student_backbone(v)) for v in views]
            return m.criterion(teacher, student, teacher_temp=0.04)

        pairs = [(m.student_backbone, m.teacher_backbone), (m.student_head, m.teacher_head)]
    for _, momentum in pairs:
        utils.deactivate_requires_grad(momentum)
    return m, loss, lambda i: [utils.update_momentum(a, b, cosine_schedule(i, _SCHEDULE_STEPS, 0.996, 1.0)) for a, b in pairs]


def _mpp_loss(m: nn.ModuleDict, patch_size: int, images: Tensor, mask_ratio: float = 0.5) -> Tensor:
    """lightly's SimMIM example with MPP's target, the masked patches' mean colour at 3 bits a channel, and no
    BERT-style 10 % random / 10 % kept split (lightly's masking has none)."""
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
    """One training step of ``row`` by ``impl`` on a seeded batch (the same for both sides): the step, backward, AdamW
    (the peers' as lightly's examples create it) and the momentum update; neither side clips gradients or freezes
    DINO's last layer (lightly's examples do not). ``compile``: every ViT's blocks through ``torch.compile``."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    gen = torch.Generator().manual_seed(cfg.seed)
    views = [torch.randn(shape, generator=gen).to(device) for shape in row_views(row, cfg)]
    labels = torch.randint(0, cfg.num_classes, (views[0].shape[0],), generator=gen).to(device)
    model, loss_fn, update = (_ours if impl == "ours" else _peer)(row, cfg)
    model.to(device).train()
    for vit in [m for m in model.modules() if isinstance(m, VisionTransformer | TimmViT)] if compile else []:
        compile_backbone(vit, "inductor")  # the backbone, its momentum encoder or teacher
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


def lightly_dino_transform(multicrop: Any) -> Any:
    """lightly's ``DINOTransform`` with the settings of our ``MultiCrop``, unnormalised as ours. lightly scales the
    jitter by ``cj_strength`` but not on its second global view (which keeps 0.5): at 0.5 and doubled strengths every
    view gets ours."""
    from lightly.transforms import DINOTransform

    return DINOTransform(
        global_crop_size=multicrop.global_size, global_crop_scale=multicrop.global_scale, local_crop_size=multicrop.resolved_local_size,
        local_crop_scale=multicrop.local_scale, n_local_views=multicrop.n_local_crops, hf_prob=multicrop.flip_p, cj_prob=multicrop.jitter_p,
        cj_strength=0.5, cj_bright=2 * multicrop.brightness, cj_contrast=2 * multicrop.contrast, cj_sat=2 * multicrop.saturation,
        cj_hue=2 * multicrop.hue, random_gray_scale=multicrop.grayscale_p, gaussian_blur=multicrop.blur_p,
        sigmas=multicrop.augmentations()[0].blur_sigma, solarization_prob=multicrop.solarize_p, normalize=None,
    )


# ---------------------------------------------------------------------------------- jobs
def environment(cfg: BenchConfig) -> dict[str, Any]:
    """The machine and software the numbers were measured on."""
    import lightly
    import timm

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"cpu": cpu, "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "gpu": torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else None, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "timm": timm.__version__, "lightly": lightly.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "allocator": allocator_note(),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def memory_job(cfg: BenchConfig, row: str, impl: Literal["ours", "peer"]) -> dict[str, Any]:
    """Peak memory of one side alone (model, optimiser state, ``memory_steps`` steps), then one step's saved tensors
    and one step's FLOPs per image under FlopCounterMode."""
    device = torch.device(cfg.device)
    with peak_memory(device) as out:
        work = workload(row, impl, cfg, device)
        for _ in range(cfg.memory_steps):
            work.step()
    out["saved_activation_bytes"] = saved_activation_bytes(work.step, list(work.model.parameters()))
    out["flops_per_image_counted"] = count_flops(work.step) / work.views[0].shape[0]
    return out


def timing_job(cfg: BenchConfig, row: str) -> dict[str, Any]:
    """Ours and the peer of ``row`` timed interleaved with a dense square matmul (fp32 on a CPU; bf16, the rate GPUs
    are quoted in, on a GPU). A round counts when its matmul ran at ``MIN_RATE`` of the best; with fewer than half
    counting, all count and the result says ``disturbed``."""
    device = torch.device(cfg.device)
    works = {impl: workload(row, impl, cfg, device, cfg.compile) for impl in (("ours", "peer") if cfg.peers else ("ours",))}
    if device.type == "cpu":
        n, reps, dtype = cfg.round_matmul_size, 3, torch.float32
    else:
        n, reps, dtype = max(cfg.round_matmul_size, 8192), 10, torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    product = torch.empty_like(a)
    steps = {**{impl: w.step for impl, w in works.items()}, "matmul": lambda: [torch.mm(a, a, out=product) for _ in range(reps)]}
    walls = time_interleaved(steps, cfg.warmup, cfg.steps, device)
    rates = [2.0 * n**3 * reps / t for t in walls.pop("matmul")]
    counted = [i for i, rate in enumerate(rates) if rate >= MIN_RATE * max(rates)]
    disturbed = len(counted) < len(rates) / 2
    counted = list(range(len(rates))) if disturbed else counted
    out: dict[str, Any] = {"round_matmul": {"dtype": str(dtype).removeprefix("torch."), "flops_per_s": rates}, "counted": counted}
    for impl, work in works.items():
        batch = work.views[0].shape[0]
        images_per_s = batch / statistics.median(walls[impl][i] for i in counted)
        out[impl] = {"step_s": walls[impl], "batch": batch, "images_per_s": images_per_s, "disturbed": disturbed}
    if cfg.peers:  # > 1: ours is faster, in the same round
        out["paired_ratio"] = paired(walls["peer"], walls["ours"], counted)
    return out


def _jpegs(cfg: BenchConfig, n: int = 8) -> list[bytes]:
    """Photo-like JPEGs of ``JPEG_SIZE`` (quality 90): smooth colour fields (a 16 x 12 grid, bicubic) with grain."""
    import numpy as np
    from PIL import Image

    rng, out = np.random.default_rng(cfg.seed), []
    for _ in range(n):
        field = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(JPEG_SIZE, Image.Resampling.BICUBIC)
        photo = (np.asarray(field, dtype=np.int16) + rng.integers(-20, 21, (JPEG_SIZE[1], JPEG_SIZE[0], 3))).clip(0, 255).astype(np.uint8)
        Image.fromarray(photo).save(buffer := io.BytesIO(), "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def worker_job(cfg: BenchConfig, impl: Literal["device", "ours", "peer"]) -> dict[str, Any]:
    """CPU milliseconds per image of a DataLoader worker from JPEG bytes to what it hands the collate:
    ``MultiCrop(on_device=True)`` (decode, fit the canvas, draw the parameters), our ``MultiCrop`` or lightly's
    ``DINOTransform``. ``device`` with CUDA available also times the device's half (:func:`device_views_time`)."""
    from PIL import Image

    from ssl_vit.data.views import MultiCrop

    transform = MultiCrop(**cfg.multicrop, on_device=impl == "device")
    worker = lightly_dino_transform(transform) if impl == "peer" else transform
    jpegs = _jpegs(cfg)
    out = {"ms_per_image": cpu_ms_per_call(lambda data: worker(Image.open(io.BytesIO(data)).convert("RGB")), jpegs, cfg.data_seconds)}
    if impl == "device" and torch.cuda.is_available():
        out |= device_views_time(cfg, transform, jpegs, torch.device(cfg.device if cfg.device.startswith("cuda") else "cuda"))
    return out


def device_views_time(cfg: BenchConfig, transform: Any, jpegs: Sequence[bytes], device: torch.device) -> dict[str, Any]:
    """Milliseconds of the device's half (``make_views``) on a batch of ``method_batch`` images packed by ``transform``."""
    from PIL import Image
    from torch.utils.data import default_collate

    from ssl_vit.data.device_views import make_views

    batch = default_collate([transform(Image.open(io.BytesIO(jpegs[i % len(jpegs)])).convert("RGB")) for i in range(cfg.method_batch)])
    batch = {k: v.to(device) for k, v in batch.items()}
    make = {"views": lambda: make_views(batch, transform.augmentations(), NORM_MEAN, NORM_STD)}
    walls = time_interleaved(make, cfg.warmup, max(cfg.steps, 5), device)["views"]
    return {"device_ms_per_batch": 1e3 * statistics.median(walls), "device_batch": cfg.method_batch}


def feed_job(cfg: BenchConfig, source: Literal["loader", "synthetic"]) -> dict[str, Any]:
    """Images/s of DINO's step at ``cfg.multicrop``'s sizes fed by ``ImageFolderDataModule`` from photo-like JPEGs
    with the views made on the device (the wait for each batch timed), or on one ready-made batch of the same shapes."""
    from ssl_vit.data import ImageFolderDataModule
    from ssl_vit.data.views import MultiCrop

    mc, device = cfg.multicrop, torch.device(cfg.device)
    cfg = dataclasses.replace(cfg, method_img_size=mc["global_size"], local_size=mc["local_size"], n_local_crops=mc["n_local_crops"])
    work = workload("dino", "ours", cfg, device, cfg.compile)
    if source == "synthetic":
        walls = time_interleaved({source: work.step}, cfg.warmup, cfg.steps, device)[source]
    else:
        with tempfile.TemporaryDirectory() as root:
            for i, data in enumerate(itertools.islice(itertools.cycle(_jpegs(cfg)), cfg.method_batch * (cfg.warmup + cfg.steps))):
                Path(root, f"{i:06d}.jpg").write_bytes(data)
            dm = ImageFolderDataModule(train_dir=root, img_size=mc["global_size"], batch_size=cfg.method_batch,
                                       num_workers=cfg.feed_workers, mean=NORM_MEAN, std=NORM_STD, views=MultiCrop(**mc, on_device=True))
            batches = iter(dm.train_dataloader())

            def step() -> None:
                packed, _ = next(batches)
                work.views[:] = dm.on_after_batch_transfer(({k: v.to(device, non_blocking=True) for k, v in packed.items()}, None), 0)[0]
                work.step()

            walls = time_interleaved({source: step}, cfg.warmup, cfg.steps, device)[source]
    return {"images_per_s": cfg.method_batch * len(walls) / sum(walls), "label": row_label("dino", cfg), "workers": cfg.feed_workers}


def _run_job(cfg: BenchConfig, fn: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> dict[str, Any]:
    try:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        return fn(cfg, *args)
    except Exception as err:  # out of memory too: one failed row does not sink the run
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def isolated(cfg: BenchConfig, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(cfg, *args)`` in a process of its own, so that its peak memory is its own and nothing carries over; an
    error comes back as ``{"error": ...}``. CPU: forked from a forkserver that imported the libraries but never
    computed (a process that ran OpenMP work cannot be forked safely); CUDA: spawned; ``isolation="none"``: here."""
    how = cfg.isolation if cfg.isolation != "auto" else ("spawn" if cfg.device.startswith("cuda") else "forkserver")
    if how == "none":
        return _run_job(cfg, fn, args)
    ctx = mp.get_context(how)
    if how == "forkserver":
        ctx.set_forkserver_preload([__name__, "ssl_vit.methods", "timm", "lightly.loss"])
    # keep_freed_memory: a fresh interpreter gets the heap setting ssl-vit was given (SSL_VIT_MALLOC)
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=keep_freed_memory) as pool:
        try:
            return pool.submit(_run_job, cfg, fn, args).result()
        except BrokenProcessPool:
            return {"error": "the benchmark process died without a result (out of memory?)"}


# ---------------------------------------------------------------------------------- the run
def _train_row(cfg: BenchConfig, row: str, say: Callable[[str], None]) -> dict[str, Any]:
    """A row's memory jobs (on a CPU the least of ``memory_repeats`` processes) and timing job; then each side's
    FLOP/s (ours' FLOPs per image: the same work) and fraction of the in-round matmul rate, and ours / peer."""
    impls = ("ours", "peer") if cfg.peers else ("ours",)
    out: dict[str, Any] = {"name": row, "label": row_label(row, cfg)}
    for impl in impls:
        runs = [isolated(cfg, memory_job, row, impl) for _ in range(cfg.memory_repeats if cfg.device == "cpu" else 1)]
        res = out[impl] = min(runs, key=lambda r: r.get("peak_mem_bytes", math.inf))
        say(f"  {row:<10} {impl:<4} " + (res["error"] if "error" in res else f"peak {res['peak_mem_bytes'] / MiB:.0f} MiB"))
    timing = isolated(cfg, timing_job, row)
    if "error" in timing:
        say(f"  {row:<10} timing: {timing['error']}")
        return {**out, "timing_error": timing}
    out.update({**timing, **{impl: {**timing[impl], **out[impl]} for impl in impls}})  # a memory error stays visible
    disturbed = " (disturbed by other load)" if timing["ours"]["disturbed"] else ""
    say(f"  {row:<10} " + ", ".join(f"{impl} {timing[impl]['images_per_s']:.2f} img/s" for impl in impls) + disturbed)
    if flops := out["ours"].get("flops_per_image_counted"):
        for res in (out[impl] for impl in impls):
            res["flops_per_s"] = flops * res["images_per_s"]
            achieved = [flops * res["batch"] / t for t in res["step_s"]]
            res["matmul_fraction"] = paired(achieved, out["round_matmul"]["flops_per_s"], out["counted"])["median"]
    out["flops_per_image"] = flops
    if cfg.peers:
        ours, peer = out["ours"], out["peer"]
        out["throughput_ratio"] = ours["images_per_s"] / peer["images_per_s"]
        if ours.get("peak_mem_bytes") and peer.get("peak_mem_bytes"):
            out["memory_ratio"] = ours["peak_mem_bytes"] / peer["peak_mem_bytes"]
    return out


def run_benchmark(cfg: BenchConfig,
                  progress: Callable[[str], None] | None = lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Every measurement ``cfg`` asks for, each in its own process (:func:`isolated`), and what follows from them:
    the JSON-ready result that :func:`format_report` prints."""
    say = progress or (lambda msg: None)
    start = time.perf_counter()
    result: dict[str, Any] = {"format": RESULT_FORMAT, "config": dataclasses.asdict(cfg), "environment": isolated(cfg, environment),
                              "rows": [], "data": []}
    for row in ("backbone", *cfg.methods):
        say(f"{row} ...")
        result["rows"].append(_train_row(cfg, row, say))
    if cfg.data and "dino" in cfg.methods:
        worker = {"name": "worker", "transform": "MultiCrop", "methods": "dino", "peer_name": "DINOTransform" if cfg.peers else None}
        for impl in ("device", "ours", "peer") if cfg.peers else ("device", "ours"):
            res = worker[impl] = isolated(cfg, worker_job, impl)
            say(f"  worker     {impl:<6} " + (res["error"] if "error" in res else f"{res['ms_per_image']:.2f} CPU ms/image"))
        for impl in ("ours", "peer"):  # the device views' CPU time per image over the others'
            if "ms_per_image" in worker["device"] and "ms_per_image" in worker.get(impl, {}):
                worker[f"{impl}_ratio"] = worker["device"]["ms_per_image"] / worker[impl]["ms_per_image"]
        result["data"].append(worker)
    if cfg.feed:
        feed = result["feed"] = {source: isolated(cfg, feed_job, source) for source in ("loader", "synthetic")}
        say("  feed       " + ", ".join(f"{k} " + (r["error"] if "error" in r else f"{r['images_per_s']:.1f} img/s")
                                        for k, r in feed.items()))
        if all("images_per_s" in r for r in feed.values()):
            feed["ratio"] = feed["loader"]["images_per_s"] / feed["synthetic"]["images_per_s"]
    return {**result, "loadavg_end": [round(x, 2) for x in os.getloadavg()], "wall_s": time.perf_counter() - start}


# ---------------------------------------------------------------------------------- the report
def _cell(d: dict[str, Any] | None, key: str, spec: str = ".2f", scale: float = 1.0, unit: str = "") -> str:
    """``d[key] / scale`` in ``spec``, then ``unit``; ``-`` if absent, ``error`` for a failed job; a value that would
    print as 0 (a tiny model's GFLOPs) keeps two significant digits."""
    if d is not None and "error" in d:
        return "error"
    if (x := (d or {}).get(key)) is None:
        return "-"
    text = format(x / scale, spec)
    return (format(x / scale, ".2g") if x and spec.endswith("f") and not text.strip("0.") else text) + unit


def targets(result: dict[str, Any]) -> list[tuple[str, bool]]:
    """Each target of the benchmark (``TARGET_*``) with what was measured, and whether it was met."""
    out, cfg, rows = [], result["config"], result["rows"]
    for r in rows:
        speed, memory = r.get("throughput_ratio"), r.get("memory_ratio")
        if r["name"] == "backbone" and speed is not None:
            out.append((f"backbone >= {TARGET_BACKBONE:.2f}x timm: {speed:.3f}x", speed >= TARGET_BACKBONE))
        elif speed is not None and memory is not None:
            text = f"{r['name']} >= {TARGET_SPEED:.2f}x peer speed at <= its memory: {speed:.3f}x speed, {memory:.3f}x memory"
            out.append((text, speed >= TARGET_SPEED and memory <= TARGET_MEMORY))
    backbone = next((r for r in rows if r["name"] == "backbone"), {})
    frac = (backbone.get("ours") or {}).get("matmul_fraction")
    if frac is not None and cfg["device"] == "cpu" and vit_label(cfg["backbone_model"]) == "ViT-S/16" and cfg["backbone_img_size"] == 224:
        ours, timm = (_cell(backbone.get(impl), "matmul_fraction", ".0%") for impl in ("ours", "peer"))
        out.append((f"ViT-S/16 224 px training >= {TARGET_MATMUL:.0%} of the matmul rate: ours {ours}, timm {timm}", frac >= TARGET_MATMUL))
    for w in (d for d in result.get("data", []) if "ours_ratio" in d):
        text = f"worker CPU time per image with device views <= {TARGET_WORKER:.2f}x MultiCrop's: {w['ours_ratio']:.3f}x"
        out.append((text, w["ours_ratio"] <= TARGET_WORKER))
    if "ratio" in (feed := result.get("feed") or {}):
        text = f"DINO fed by the loader >= {TARGET_FEED:.2f}x its speed on ready-made input: {feed['ratio']:.3f}x"
        out.append((text, feed["ratio"] >= TARGET_FEED))
    return out


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)])
    widths = [max(len(c) for c in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [header, *rows])


def step_table(result: dict[str, Any], markdown: bool = False) -> str:
    header = ["step", "config", "ours img/s", "peer img/s", "speed", "per-round speed", "ours MiB", "peer MiB", "memory",
              "saved MiB ours/peer", "GFLOP/img", "ours GFLOP/s", "ours/peer of matmul", "FLOPs ours/peer"]
    rows = []
    for r in result["rows"]:
        sides, flops, spread = (r.get("ours"), r.get("peer")), r.get("flops_per_image"), (r.get("paired_ratio") or {}).get("quartiles")
        rows.append([
            r["name"], r["label"], *(_cell(x, "images_per_s") + ("*" if x and x.get("disturbed") else "") for x in sides),
            _cell(r, "throughput_ratio", unit="x"), f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
            *(_cell(x, "peak_mem_bytes", ".0f", MiB) for x in sides), _cell(r, "memory_ratio", unit="x"),
            "/".join(_cell(x, "saved_activation_bytes", ".0f", MiB) for x in sides), _cell(r, "flops_per_image", scale=1e9),
            _cell(sides[0], "flops_per_s", ".1f", 1e9), "/".join(_cell(x, "matmul_fraction", ".0%") for x in sides),
            "/".join(_cell(x, "flops_per_image_counted", ".3f", flops) if flops else "-" for x in sides),
        ])
    return _table(header, rows, markdown)


def worker_table(result: dict[str, Any], markdown: bool = False) -> str:
    header = ["worker from JPEG", "methods", "device views CPU ms/img", "MultiCrop CPU ms/img", "peer", "peer CPU ms/img",
              "device/MultiCrop", "device/peer", "device ms/batch"]
    rows = []
    for d in (d for d in result["data"] if d["name"] == "worker"):
        device = d["device"]
        batch = f"{_cell(device, 'device_ms_per_batch')} (b{device['device_batch']})" if "device_batch" in device else "-"
        rows.append([d["transform"], d["methods"], *(_cell(d.get(i), "ms_per_image") for i in ("device", "ours")), d["peer_name"] or "-",
                     _cell(d.get("peer"), "ms_per_image"), _cell(d, "ours_ratio", unit="x"), _cell(d, "peer_ratio", unit="x"), batch])
    return _table(header, rows, markdown)


def format_report(result: dict[str, Any], markdown: bool = False) -> str:
    """The report of a result: the machine, the tables, the targets, the errors."""
    env, cfg, rows, feed = result["environment"], result["config"], result["rows"], result.get("feed") or {}
    timed = [r for r in rows if "round_matmul" in r]
    rates = [statistics.median(r["round_matmul"]["flops_per_s"][i] for i in r["counted"]) / 1e9 for r in timed]
    gpu = f", {env['gpu']}" if env.get("gpu") else ""
    adamw = "fused" if cfg.get("fused_optimizer") else "torch default"
    compiled = "; timed with every ViT's blocks compiled (torch.compile, inductor), ours and the peers'" if cfg.get("compile") else ""
    parts = [
        f"machine: {env['cpu']}, {env['cpus_usable']} usable cores, {env['mem_total_gib']} GiB{gpu}",
        f"software: torch {env['torch']} ({env['torch_threads']} threads), timm {env['timm']}, lightly {env['lightly']}, "
        f"Python {env['python']}; C heap: {env.get('allocator', '?')}; our ViT: lean_backward={cfg.get('lean_backward', True)}; "
        f"AdamW: ours {adamw}, peers torch default{compiled}",
        f"device {cfg['device']}, precision {cfg['precision']}, {cfg['warmup']} warm-up steps + {cfg['steps']} timed rounds (ours and "
        f"peer interleaved; medians), load average at start {env['loadavg']} / end {result['loadavg_end']}",
        *([f"dense {timed[0]['round_matmul']['dtype']} matmul in the timed rounds: {min(rates):.1f}-{max(rates):.1f} GFLOP/s "
           "(the rows' medians)"] if timed else []),
        "", step_table(result, markdown), "",
        "speed, memory: ours / peer (per-round speed: quartiles of the ratio within each interleaved round, i.e. the noise). "
        "GFLOP/img: one training step's FLOPs per image (a multiply-add is 2); FLOPs ours/peer: each side's count by torch's "
        "FlopCounterMode over it (1.000: the same work). of matmul: achieved FLOP/s over the dense matmul rate in the same rounds. "
        "saved MiB: the tensors autograd keeps for backward in one step (peak RSS on a CPU also carries allocator noise, 1-3 %).",
    ]
    if any((r.get(i) or {}).get("disturbed") for r in rows for i in ("ours", "peer")):
        parts.append("* other load took cores away during most timed steps: rerun on a quiet machine")
    if any(d["name"] == "worker" for d in result["data"]):
        parts += ["", worker_table(result, markdown), f"worker: CPU time per {JPEG_SIZE[0]}x{JPEG_SIZE[1]} JPEG from its bytes to "
                  "the collate, decoding included, one thread; device views: the worker decodes, fits the canvas and draws the "
                  "parameters, the device makes the views (device ms/batch: that half, on CUDA only)"]
    if "images_per_s" in feed.get("loader", {}):
        parts += ["", f"feed: DINO {feed['loader']['label']} from {JPEG_SIZE[0]}x{JPEG_SIZE[1]} JPEGs, views on the device, "
                  f"{feed['loader']['workers']} workers: {_cell(feed['loader'], 'images_per_s', '.1f')} img/s; on ready-made input "
                  f"{_cell(feed['synthetic'], 'images_per_s', '.1f')} img/s: {_cell(feed, 'ratio', unit='x')}"]
    if met := targets(result):
        parts += ["", *(f"{text} {'[ok]' if ok else '[MISSED]'}" for text, ok in met)]
    errors = [f"{r['name']} (timing): {r['timing_error']['error']}" for r in rows if "timing_error" in r]
    errors += [f"{r['name']} ({i}): {r[i]['error']}" for r in [*rows, *result["data"]] for i in ("device", "ours", "peer")
               if "error" in (r.get(i) or {})]
    errors += [f"feed ({k}): {feed[k]['error']}" for k in ("loader", "synthetic") if "error" in feed.get(k, {})]
    return "\n".join(parts + (["", "errors:", *errors] if errors else []))


def render(path: Path, markdown: bool = False) -> str:
    """The report of an earlier ``--json`` result; anything else is refused naming the file."""
    result = read_json(path)
    if not isinstance(result, dict) or result.get("format") != RESULT_FORMAT:
        raise ValueError(f"{path}: not a benchmark result (no format {RESULT_FORMAT!r}, which ssl-vit benchmark --json writes)")
    return format_report(result, markdown)
