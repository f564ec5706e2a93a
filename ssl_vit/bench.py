"""``ssl-vit benchmark``: one training step of each method against the same step composed the way
lightly's examples compose it around timm's ``VisionTransformer``, the bare backbone against timm's
ViT, the achieved FLOP/s as a fraction of the machine's dense matmul rate, DINO's multi-crop
views per second against lightly's ``DINOTransform``, a DataLoader worker's CPU time per JPEG
with the views made on the device against both, and (``feed``) DINO's training images/s fed by the
real loader from JPEGs against the same steps on ready-made input. Figures: ``benchmarks/RESULTS.md``.

Speed: ours and the peer of a row run in one fresh process, timed interleaved with a dense matmul
taking its turn in every round, so that the speed ratio and the fraction of the matmul rate are
taken on one machine state. Memory: each side alone in a fresh process. FLOPs: one step of each
side under torch's ``FlopCounterMode``. Our step is what training runs (the method's ``step``,
backward, its AdamW, the EMA update) without the Trainer's logging and callbacks; the peers'
likewise (:func:`_peer`). Neither clips gradients nor freezes DINO's last layer in the first epoch
(lightly's examples do not either).
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
# The targets: each method >= 1.0x the peer's speed at <= its peak memory, the bare backbone
# >= 0.95x timm's, and ViT-S/16 at 224 px training on a CPU at >= 75 % of the matmul rate.
TARGET_SPEED, TARGET_MEMORY, TARGET_BACKBONE, TARGET_MATMUL = 1.0, 1.0, 0.95, 0.75
# A worker making DINO's views on the device spends <= a fifth of the CPU time per image of MultiCrop's.
TARGET_WORKER = 0.2
# DINO fed by the real loader (views on the device) trains at >= 0.9x its speed on ready-made input.
TARGET_FEED = 0.9
JPEG_SIZE = (500, 375)  # the worker row's photos: ImageNet's commonest size
# ViT shapes: keyword arguments of ``create_backbone("vit", ...)`` and of timm's VisionTransformer alike.
VIT_S16 = {"embed_dim": 384, "depth": 12, "num_heads": 6, "patch_size": 16, "mlp_ratio": 4.0, "in_chans": 3}
VIT_TI16 = {**VIT_S16, "embed_dim": 192, "num_heads": 3}
_VIT_NAMES = {(192, 12, 3): "Ti", (384, 12, 6): "S", (768, 12, 12): "B", (1024, 24, 16): "L", (1280, 32, 16): "H"}  # DeiT Table 1, ViT Table 1
MIN_RATE = 0.75  # of the best in-round matmul rate: a round below it lost cores to other load
_SCHEDULE_STEPS = 100_000  # a long schedule: the EMA momentum stays in its realistic range while timed
MiB = 2**20


def vit_label(m: dict[str, Any]) -> str:
    size = _VIT_NAMES.get((m["embed_dim"], m["depth"], m["num_heads"])) if m["mlp_ratio"] == 4.0 else None
    return f"ViT-{size}/{m['patch_size']}" if size else f"ViT(D={m['embed_dim']},L={m['depth']},H={m['num_heads']})/{m['patch_size']}"


@dataclass(frozen=True)
class BenchConfig:
    """One run. The backbone row trains ``backbone_model`` at ``backbone_img_size`` (ViT-S/16 at
    224 px: the matmul target's configuration); the method rows ``method_model`` at
    ``method_img_size``, DINO with ``n_local_crops`` more crops of ``local_size`` px; the heads'
    widths are the papers'. The augmentation row times ``multicrop`` in one thread for ``data_seconds``."""

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
    round_matmul_size: int = 2048  # the n x n @ n x n product timed in every round (at least 8192 on GPUs)
    data: bool = True  # the augmentation row (when DINO is among the methods)
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
    "quick": BenchConfig(backbone_batch=8, method_model=VIT_TI16, method_img_size=64, method_batch=16, local_size=32, warmup=1, steps=3,
                  memory_repeats=1, data_seconds=1.0),  # under 2 minutes on 2 cores
    "tiny": BenchConfig(backbone_model=(tiny := {**VIT_S16, "embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 8}), backbone_img_size=32,
                 backbone_batch=4, method_model=tiny, method_img_size=32, method_batch=4, local_size=16, n_local_crops=2, num_classes=10,
                 moco_hidden_dim=64, moco_out_dim=16, dino_out_dim=128, dino_hidden_dim=64, dino_bottleneck_dim=16, warmup=1, steps=2,
                 memory_repeats=1, round_matmul_size=128, multicrop={"global_size": 32, "local_size": 16, "n_local_crops": 2},
                 data_seconds=0.05),  # seconds
}


# ---------------------------------------------------------------------------------- instruments
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(steps: dict[str, Callable[[], Any]], warmup: int, rounds: int, device: torch.device) -> dict[str, list[float]]:
    """Wall seconds of each step in each of ``rounds`` rounds, after ``warmup`` untimed calls of
    each; a round calls every step once, in reverse order on odd rounds (ABBA), so that a drift of
    the machine's speed reaches all alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    walls: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            start = time.perf_counter()
            steps[name]()
            _sync(device)
            walls[name].append(time.perf_counter() - start)
    return walls


def paired(numerator: Sequence[float], denominator: Sequence[float], counted: Sequence[int]) -> dict[str, Any]:
    """Median and quartiles of ``numerator[i] / denominator[i]`` over the counted rounds: a ratio
    taken within each round; its quartiles are the noise of the measurement."""
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
    """``peak_mem_bytes`` of the block, in the dict it yields, once the block is done. CUDA:
    ``max_memory_allocated`` above the start. CPU: the resident high-water mark (``VmHWM``, reset
    at the start through ``/proc/self/clear_refs``) less the anonymous memory at the start and the
    file-backed pages at the end: weights, gradients, optimiser state, activations and allocator
    caches, without the code of the shared libraries the block faulted in (tens of MiB that say
    nothing about a step)."""
    out: dict[str, int] = {}
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield out
        _sync(device)
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


def views_per_second(transform: Callable[[Any], Sequence[Any]], images: Sequence[Any], seconds: float) -> float:
    """Views per CPU second of ``transform`` on one thread, as a DataLoader worker runs it, after one
    untimed call on each image; CPU time, which other load on the machine does not stretch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for image in images:
            transform(image)
        n_views, calls, start = 0, 0, time.process_time()
        while (elapsed := time.process_time() - start) < seconds or calls == 0:
            n_views += len(transform(images[calls % len(images)]))
            calls += 1
        return n_views / elapsed
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------- the steps
NORM_MEAN, NORM_STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)  # the MPP rows' view normalisation, both sides
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
    return [(b, c, s, s)] * (2 if row in ("mocov3", "dino") else 1) + [(b, c, local, local)] * (cfg.n_local_crops if row == "dino" else 0)


def row_label(row: str, cfg: BenchConfig) -> str:
    """``ViT-S/16 2x112+8x48px b32``: the model, the crops and the batch of a row."""
    views = row_views(row, cfg)
    crops = "+".join(f"{n}x{size}" if n > 1 else str(size) for size, n in Counter(v[-1] for v in views).items())
    return f"{vit_label(cfg.backbone_model if row == 'backbone' else cfg.method_model)} {crops}px b{views[0][0]}" + (" fwd+bwd" if row == "backbone" else "")


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
    """The peer of ``row``, its loss and its momentum update, after lightly 1.6's ``examples/pytorch/``.
    Supervised: timm's ViT with cross-entropy (label smoothing 0.1). MPP, which lightly lacks: its
    SimMIM example (``MaskedVisionTransformerTIMM``, a linear head on the masked tokens) with our
    3-bit mean-colour target and 50 % mask ratio, without BERT's 10 % random / 10 % kept split
    (lightly's masking has none). MoCo v3, whose heads and loss lightly lacks: its MoCo/BYOL
    examples (one forward per view, ``deepcopy`` momentum copies, ``update_momentum``) with MoCo
    v3's MLPs from ``ProjectionHead`` blocks, the patch projection frozen (MoCo v3 §4) and ``ctr``
    of its Algorithm 1. DINO: ``dino.py`` (``DINOProjectionHead``, ``DINOLoss``, one forward per view)."""
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
    """lightly's ``DINOTransform`` with the settings of our ``MultiCrop``, unnormalised (as ours: the
    datamodule normalises). lightly scales the jitter by ``cj_strength`` but does not pass it to its
    second global view (which keeps its default 0.5): at 0.5 and doubled strengths every view gets ours."""
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
    return {"cpu": cpu, "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "gpu": torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else None, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "timm": timm.__version__, "lightly": lightly.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "allocator": allocator_note(), "loadavg": _loadavg()}


def memory_job(cfg: BenchConfig, row: str, impl: Literal["ours", "peer"]) -> dict[str, Any]:
    """Peak memory of one side alone: its model, the optimiser state (made by the first step), the
    activations of ``memory_steps`` steps. Then one step whose saved tensors are counted and one
    under FlopCounterMode."""
    device = torch.device(cfg.device)
    with peak_memory(device) as out:
        work = workload(row, impl, cfg, device)
        for _ in range(cfg.memory_steps):
            work.step()
    out["saved_activation_bytes"] = saved_activation_bytes(work.step, list(work.model.parameters()))
    out["flops_per_image_counted"] = count_flops(work.step) / work.views[0].shape[0]
    return out


def timing_job(cfg: BenchConfig, row: str) -> dict[str, Any]:
    """Ours and the peer of ``row`` timed interleaved, with a dense square matmul taking its turn in
    each round (fp32, three products on a CPU; bf16, whose rate GPUs are quoted in, ten of at least
    8192 on a GPU). A round counts when its matmul ran at ``MIN_RATE`` of the best: no other job took
    cores away. With fewer than half counting, all count and the result says ``disturbed``."""
    device = torch.device(cfg.device)
    works = {impl: workload(row, impl, cfg, device, cfg.compile) for impl in (("ours", "peer") if cfg.peers else ("ours",))}
    n, reps, dtype = (cfg.round_matmul_size, 3, torch.float32) if device.type == "cpu" else (max(cfg.round_matmul_size, 8192), 10, torch.bfloat16)
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
        out[impl] = {"step_s": walls[impl], "batch": batch, "images_per_s": batch / statistics.median(walls[impl][i] for i in counted), "disturbed": disturbed}
    if cfg.peers:  # > 1: ours is faster, in the same round
        out["paired_ratio"] = paired(walls["peer"], walls["ours"], counted)
    return out


def views_job(cfg: BenchConfig, impl: Literal["ours", "peer"]) -> dict[str, Any]:
    """Views per second of our ``MultiCrop`` or lightly's ``DINOTransform`` on random 256-px RGB images (decoding is not timed)."""
    from PIL import Image

    from ssl_vit.data.views import MultiCrop

    gen = torch.Generator().manual_seed(cfg.seed)
    images = [Image.fromarray(torch.randint(0, 256, (256, 256, 3), generator=gen, dtype=torch.uint8).numpy()) for _ in range(8)]
    transform = MultiCrop(**cfg.multicrop)
    transform = transform if impl == "ours" else lightly_dino_transform(transform)
    return {"views_per_s": views_per_second(transform, images, cfg.data_seconds), "views_per_image": len(transform(images[0]))}


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
    """CPU milliseconds per image of a DataLoader worker from JPEG bytes to what it hands the collate
    (decoding included, one thread): ``MultiCrop(on_device=True)`` (decode, fit the canvas, draw the
    parameters), our ``MultiCrop`` or lightly's ``DINOTransform``. ``device`` with CUDA available also
    times the device's half (``make_views``) on a batch of ``method_batch`` images."""
    from PIL import Image

    from ssl_vit.data.views import MultiCrop

    transform = MultiCrop(**cfg.multicrop, on_device=impl == "device")
    worker = lightly_dino_transform(transform) if impl == "peer" else transform
    jpegs = _jpegs(cfg)
    per_s = views_per_second(lambda data: [worker(Image.open(io.BytesIO(data)).convert("RGB"))], jpegs, cfg.data_seconds)
    out = {"ms_per_image": 1e3 / per_s}
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
    walls = time_interleaved({"views": lambda: make_views(batch, transform.augmentations(), (0.5,) * 3, (0.25,) * 3)}, cfg.warmup,
                             max(cfg.steps, 5), device)["views"]
    return {"device_ms_per_batch": 1e3 * statistics.median(walls), "device_batch": cfg.method_batch}


def feed_job(cfg: BenchConfig, source: Literal["loader", "synthetic"]) -> dict[str, Any]:
    """Images/s of DINO's training step at ``cfg.multicrop``'s sizes (``method_model``, ``method_batch``)
    fed by ``ImageFolderDataModule`` over photo-like JPEGs with the views made on the device
    (``feed_workers`` workers, the wait for each batch timed), or on one ready-made batch of views of the same shapes."""
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
            dm = ImageFolderDataModule(train_dir=root, img_size=mc["global_size"], batch_size=cfg.method_batch, num_workers=cfg.feed_workers,
                                       mean=NORM_MEAN, std=NORM_STD, views=MultiCrop(**mc, on_device=True))
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
    # keep_freed_memory: a fresh interpreter gets the heap setting ssl-vit was given (SSL_VIT_MALLOC)
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=keep_freed_memory) as pool:
        try:
            return pool.submit(_run_job, cfg, fn, args).result()
        except BrokenProcessPool:
            return {"error": "the benchmark process died without a result (out of memory?)"}


# ---------------------------------------------------------------------------------- the run
def _train_row(cfg: BenchConfig, row: str, say: Callable[[str], None]) -> dict[str, Any]:
    """A row's memory jobs (each side alone; on a CPU the least of ``memory_repeats`` processes)
    and its timing job; then each side's FLOP/s (ours' FLOPs per image: the same work for the peer)
    and its fraction of the matmul rate in the same rounds, and the ratios ours / peer."""
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
    say(f"  {row:<10} " + ", ".join(f"{impl} {timing[impl]['images_per_s']:.2f} img/s" for impl in impls)
        + (" (disturbed by other load)" if timing["ours"]["disturbed"] else ""))
    flops = out["flops_per_image"] = out["ours"].get("flops_per_image_counted")
    for res in (out[impl] for impl in impls) if flops else ():
        res["flops_per_s"] = flops * res["images_per_s"]
        achieved = [flops * res["batch"] / t for t in res["step_s"]]
        res["matmul_fraction"] = paired(achieved, out["round_matmul"]["flops_per_s"], out["counted"])["median"]
    if cfg.peers:
        ours, peer = out["ours"], out["peer"]
        out["throughput_ratio"] = ours["images_per_s"] / peer["images_per_s"]
        if ours.get("peak_mem_bytes") and peer.get("peak_mem_bytes"):
            out["memory_ratio"] = ours["peak_mem_bytes"] / peer["peak_mem_bytes"]
    return out


def run_benchmark(cfg: BenchConfig, progress: Callable[[str], None] | None = lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Every measurement ``cfg`` asks for, each in its own process (:func:`isolated`), and what
    follows from them; returns the JSON-ready result that :func:`format_report` prints."""
    say = progress or (lambda msg: None)
    start = time.perf_counter()
    result: dict[str, Any] = {"format": RESULT_FORMAT, "config": dataclasses.asdict(cfg), "environment": isolated(cfg, environment), "rows": [], "data": []}
    for row in ("backbone", *cfg.methods):
        say(f"{row} ...")
        result["rows"].append(_train_row(cfg, row, say))
    if cfg.data and "dino" in cfg.methods:
        data = {"name": "multicrop", "transform": "MultiCrop", "methods": "dino", "peer_name": "DINOTransform" if cfg.peers else None}
        for impl in ("ours", "peer") if cfg.peers else ("ours",):
            res = data[impl] = isolated(cfg, views_job, impl)
            say(f"  MultiCrop  {impl:<4} " + (res["error"] if "error" in res else f"{res['views_per_s']:.1f} views/s"))
        if "views_per_s" in data.get("peer", {}) and "views_per_s" in data["ours"]:
            data["throughput_ratio"] = data["ours"]["views_per_s"] / data["peer"]["views_per_s"]
        result["data"].append(data)
        worker = {"name": "worker", "transform": "MultiCrop", "methods": "dino", "peer_name": "DINOTransform" if cfg.peers else None}
        for impl in ("device", "ours", "peer") if cfg.peers else ("device", "ours"):
            res = worker[impl] = isolated(cfg, worker_job, impl)
            say(f"  worker     {impl:<6} " + (res["error"] if "error" in res else f"{res['ms_per_image']:.2f} CPU ms/image"))
        for impl in ("ours", "peer"):  # device views' CPU time per image over the others'
            if "ms_per_image" in worker["device"] and "ms_per_image" in worker.get(impl, {}):
                worker[f"{impl}_ratio"] = worker["device"]["ms_per_image"] / worker[impl]["ms_per_image"]
        result["data"].append(worker)
    if cfg.feed:
        feed = result["feed"] = {source: isolated(cfg, feed_job, source) for source in ("loader", "synthetic")}
        say("  feed       " + ", ".join(f"{k} " + (r["error"] if "error" in r else f"{r['images_per_s']:.1f} img/s") for k, r in feed.items()))
        if all("images_per_s" in r for r in feed.values()):
            feed["ratio"] = feed["loader"]["images_per_s"] / feed["synthetic"]["images_per_s"]
    return {**result, "loadavg_end": _loadavg(), "wall_s": time.perf_counter() - start}


# ---------------------------------------------------------------------------------- the report
def targets(result: dict[str, Any]) -> list[tuple[str, bool]]:
    """Each target of the benchmark (the constants ``TARGET_*``) with what was measured, and whether it was met."""
    out, cfg, rows = [], result["config"], result["rows"]
    for r in rows:
        speed, memory = r.get("throughput_ratio"), r.get("memory_ratio")
        if r["name"] == "backbone" and speed is not None:
            out.append((f"backbone >= {TARGET_BACKBONE:.2f}x timm: {speed:.3f}x", speed >= TARGET_BACKBONE))
        elif speed is not None and memory is not None:
            out.append((f"{r['name']} >= {TARGET_SPEED:.2f}x peer speed at <= its memory: {speed:.3f}x speed, {memory:.3f}x memory",
                        speed >= TARGET_SPEED and memory <= TARGET_MEMORY))
    ours, peer = ((next((r for r in rows if r["name"] == "backbone"), {}).get(impl) or {}).get("matmul_fraction") for impl in ("ours", "peer"))
    if ours is not None and cfg["device"] == "cpu" and vit_label(cfg["backbone_model"]) == "ViT-S/16" and cfg["backbone_img_size"] == 224:
        out.append((f"ViT-S/16 224 px training >= {TARGET_MATMUL:.0%} of the matmul rate: ours {_pct(ours)}, timm {_pct(peer)}", ours >= TARGET_MATMUL))
    for w in (d for d in result.get("data", []) if d["name"] == "worker" and "ours_ratio" in d):
        out.append((f"worker CPU time per image with device views <= {TARGET_WORKER:.2f}x MultiCrop's: {w['ours_ratio']:.3f}x", w["ours_ratio"] <= TARGET_WORKER))
    if "ratio" in (feed := result.get("feed") or {}):
        out.append((f"DINO fed by the loader >= {TARGET_FEED:.2f}x its speed on ready-made input: {feed['ratio']:.3f}x", feed["ratio"] >= TARGET_FEED))
    return out


def _num(x: float | None, fmt: str = ".2f", scale: float = 1.0) -> str:
    """``x / scale`` in ``fmt``; a value ``fmt`` would print as 0 (a tiny model's GFLOPs) keeps two digits."""
    if x is None:
        return "-"
    return format(x / scale, ".2g") if x and fmt.endswith("f") and not format(abs(x / scale), fmt).strip("0.") else format(x / scale, fmt)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


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
             d["peer_name"] or "-", _side(d.get("peer"), "views_per_s", ".1f"), _ratio(d.get("throughput_ratio"))]
            for d in result["data"] if d["name"] != "worker"]
    return _table(header, rows, markdown)


def worker_table(result: dict[str, Any], markdown: bool = False) -> str:
    header = ["worker from JPEG", "methods", "device views CPU ms/img", "MultiCrop CPU ms/img", "peer", "peer CPU ms/img",
              "device/MultiCrop", "device/peer", "device ms/batch"]
    rows = [[d["transform"], d["methods"], *(_side(d.get(i), "ms_per_image") for i in ("device", "ours")), d["peer_name"] or "-",
             _side(d.get("peer"), "ms_per_image"), *(_ratio(d.get(f"{i}_ratio")) for i in ("ours", "peer")),
             f"{_side(d['device'], 'device_ms_per_batch')} (b{d['device']['device_batch']})" if "device_batch" in d["device"] else "-"]
            for d in result["data"] if d["name"] == "worker"]
    return _table(header, rows, markdown)


def format_report(result: dict[str, Any], markdown: bool = False) -> str:
    """The report of a result: the machine, the step and augmentation tables, the targets, the errors."""
    env, cfg = result["environment"], result["config"]
    timed = [r for r in result["rows"] if "round_matmul" in r]
    rates = [statistics.median(r["round_matmul"]["flops_per_s"][i] for i in r["counted"]) / 1e9 for r in timed]
    parts = [
        f"machine: {env['cpu']}, {env['cpus_usable']} usable cores, {env['mem_total_gib']} GiB" + (f", {env['gpu']}" if env.get("gpu") else ""),
        f"software: torch {env['torch']} ({env['torch_threads']} threads), timm {env['timm']}, lightly {env['lightly']}, Python {env['python']}; "
        f"C heap: {env.get('allocator', '?')}; our ViT: lean_backward={cfg.get('lean_backward', True)}; AdamW: ours "
        f"{'fused' if cfg.get('fused_optimizer') else 'torch default'}, peers torch default"
        + ("; timed with every ViT's blocks compiled (torch.compile, inductor), ours and the peers'" if cfg.get("compile") else ""),
        f"device {cfg['device']}, precision {cfg['precision']}, {cfg['warmup']} warm-up steps + {cfg['steps']} timed rounds (ours and peer "
        f"interleaved; medians), load average at start {env['loadavg']} / end {result['loadavg_end']}",
        *([f"dense {timed[0]['round_matmul']['dtype']} matmul in the timed rounds: {min(rates):.1f}-{max(rates):.1f} GFLOP/s (the rows' medians)"] if timed else []),
        "", step_table(result, markdown), "",
        "speed, memory: ours / peer (speed from the median step times; per-round speed: quartiles of the ratio within each interleaved "
        "round, i.e. the noise). GFLOP/img: FLOPs of one training step per image (a multiply-add is 2); FLOPs ours/peer: each side's, "
        "counted by torch's FlopCounterMode, over GFLOP/img (1.000: the same work). of matmul: achieved FLOP/s / the dense matmul rate "
        "measured in the same rounds. saved MiB: the tensors autograd keeps for backward in one step, counted exactly (peak RSS on a "
        "CPU also carries the allocator's noise, about 1-3 %).",
    ]
    if any((r.get(i) or {}).get("disturbed") for r in result["rows"] for i in ("ours", "peer")):
        parts.append("* other load took cores away during most timed steps: rerun on a quiet machine")
    if result["data"]:
        parts += ["", data_table(result, markdown)]
    if any(d["name"] == "worker" for d in result["data"]):
        parts += ["", worker_table(result, markdown), f"worker: CPU time per {JPEG_SIZE[0]}x{JPEG_SIZE[1]} JPEG from its bytes to the collate, "
                  "decoding included, one thread; device views: the worker decodes, fits the canvas and draws the parameters, the device "
                  "makes the views (device ms/batch: that half, on CUDA only)"]
    if (feed := result.get("feed")) and "images_per_s" in feed["loader"]:
        parts += ["", f"feed: DINO {feed['loader']['label']} from {JPEG_SIZE[0]}x{JPEG_SIZE[1]} JPEGs, views on the device, "
                  f"{feed['loader']['workers']} workers: {_side(feed['loader'], 'images_per_s', '.1f')} img/s; on ready-made input "
                  f"{_side(feed['synthetic'], 'images_per_s', '.1f')} img/s: {_ratio(feed.get('ratio'))}"]
    if met := targets(result):
        parts += ["", *(f"{text} {'[ok]' if ok else '[MISSED]'}" for text, ok in met)]
    errors = [f"{r['name']} (timing): {r['timing_error']['error']}" for r in result["rows"] if "timing_error" in r]
    errors += [f"{r['name']} ({i}): {r[i]['error']}" for r in [*result["rows"], *result["data"]] for i in ("ours", "peer") if "error" in (r.get(i) or {})]
    errors += [f"feed ({k}): {r['error']}" for k, r in (result.get("feed") or {}).items() if isinstance(r, dict) and "error" in r]
    return "\n".join(parts + (["", "errors:", *errors] if errors else []))


def render(path: Path, markdown: bool = False) -> str:
    """The report of an earlier ``--json`` result; anything else is refused naming the file."""
    result = read_json(path)
    if not isinstance(result, dict) or result.get("format") != RESULT_FORMAT:
        raise ValueError(f"{path}: not a benchmark result (no format {RESULT_FORMAT!r}, which ssl-vit benchmark --json writes)")
    return format_report(result, markdown)
