"""What ``ssl-vit benchmark`` measures: the model shapes, batch sizes, views and step counts of each
row, with three presets (``full``, ``quick``, ``tiny``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

Precision = Literal["32", "bf16-mixed"]
Isolation = Literal["auto", "forkserver", "spawn", "none"]
METHOD_NAMES: tuple[str, ...] = ("supervised", "mpp", "mocov3", "dino")
# The "format" of the JSON that ``--json`` writes and ``--render`` reads.
RESULT_FORMAT = "ssl-vit-benchmark/1"

# The targets the report checks.
TARGET_METHOD_SPEED = 1.0  # every method's step >= 1.0x the lightly + timm composition
TARGET_METHOD_MEMORY = 1.0  # ... at <= its peak memory
TARGET_BACKBONE_SPEED = 0.95  # the bare backbone >= 0.95x timm's
TARGET_MATMUL_FRACTION = 0.75  # ViT-S/16 at 224 px training steps on CPU

# specs §1 (DeiT's Ti): (D, depth, heads) -> the name printed in tables.
_VIT_NAMES = {(192, 12, 3): "Ti", (384, 12, 6): "S", (768, 12, 12): "B", (1024, 24, 16): "L", (1280, 32, 16): "H"}


@dataclass(frozen=True)
class ModelSpec:
    """A plain ViT's shape; ours is built as ``create_backbone("vit", ...)``, the peer as timm's
    ``VisionTransformer`` with the same arguments."""

    embed_dim: int = 384
    depth: int = 12
    num_heads: int = 6
    patch_size: int = 16
    mlp_ratio: float = 4.0
    in_chans: int = 3

    @property
    def label(self) -> str:
        size = _VIT_NAMES.get((self.embed_dim, self.depth, self.num_heads))
        if size is not None and self.mlp_ratio == 4.0:
            return f"ViT-{size}/{self.patch_size}"
        return f"ViT(D={self.embed_dim},L={self.depth},H={self.num_heads})/{self.patch_size}"

    def backbone_kwargs(self, img_size: int) -> dict[str, Any]:
        return {
            "img_size": img_size,
            "patch_size": self.patch_size,
            "in_chans": self.in_chans,
            "embed_dim": self.embed_dim,
            "depth": self.depth,
            "num_heads": self.num_heads,
            "mlp_ratio": self.mlp_ratio,
        }


VIT_S16 = ModelSpec()
VIT_TI16 = ModelSpec(embed_dim=192, depth=12, num_heads=3)


@dataclass
class BenchConfig:
    """One benchmark run.

    The backbone row (ours vs timm, forward + backward) runs ``backbone_model`` at
    ``backbone_img_size`` with ``backbone_batch`` images: by default ViT-S/16 at 224 px, the
    configuration the matmul-fraction target is stated for. The method rows (supervised, MPP,
    MoCo v3, DINO against their lightly + timm compositions) run ``method_model`` at
    ``method_img_size``; DINO adds ``n_local`` local crops of ``local_size`` px. Head widths
    default to the papers' (specs §3, §4), ``num_classes`` to ImageNet's.

    Speed: ours and the peer of a row are built in one fresh process and, after ``warmup``
    untimed steps each, timed over ``steps`` interleaved rounds (ABBA); medians count, rounds in
    which another job took cores away are repeated. Memory: each implementation alone in a fresh
    process, over ``memory_steps`` steps; the least peak of ``memory_repeats`` such processes.
    """

    backbone_model: ModelSpec = VIT_S16
    backbone_img_size: int = 224
    backbone_batch: int = 32
    method_model: ModelSpec = VIT_S16
    method_img_size: int = 112
    method_batch: int = 32
    local_size: int = 48
    n_local: int = 8
    methods: tuple[str, ...] = METHOD_NAMES
    num_classes: int = 1000
    moco_hidden_dim: int = 4096
    moco_out_dim: int = 256
    dino_out_dim: int = 65536
    dino_hidden_dim: int = 2048
    dino_bottleneck_dim: int = 256
    warmup: int = 3
    steps: int = 11
    memory_steps: int = 2
    # Peak RSS of the same job differs by ~1 % from one process to the next (allocator and
    # page-cache luck); the least of a few processes is the job's own need (CPU only: a GPU's
    # max_memory_allocated does not vary).
    memory_repeats: int = 3
    # Matmul rate: these (m, k, n) plus the backbone row's MLP matmul [B·T, D] @ [D, 4D].
    matmul_sizes: tuple[tuple[int, int, int], ...] = ((2048, 2048, 2048),)
    matmul_repeats: int = 10
    # The matmul that takes its turn in every timing round (n x n @ n x n; 8192 on GPUs).
    matmul_probe_size: int = 2048
    # Data pipeline: views/s of one worker on synthetic RGB images of data_source_size px.
    data: bool = True
    data_source_size: int = 256
    data_global_size: int = 224
    data_local_size: int = 96
    data_n_local: int = 8
    data_seconds: float = 3.0
    data_images: int = 8
    device: str = "cpu"
    precision: Precision = "32"
    threads: int | None = None
    isolation: Isolation = "auto"
    job_timeout_s: float = 900.0
    seed: int = 0
    peers: bool = True
    flop_check: bool = True
    # Our ViT's lean_backward (norm_linear + gelu_linear); False measures the plain modules.
    lean_backward: bool = True
    # Our modules' fused_optimizer (torch's fused AdamW kernel); False: torch's default
    # implementation, as the peers use it (a per-tensor loop on CPU, foreach lists on CUDA).
    fused_optimizer: bool = True
    # torch.compile (inductor) of every ViT's blocks, ours (``ssl_vit.backbones.compile``) and the
    # peers' timm ViTs alike, in the timing jobs: compilation happens in the warm-up steps. Peak
    # memory is measured without it (the compiler's own memory would swamp a step's).
    compile: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(METHOD_NAMES))
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHOD_NAMES)}")
        if self.precision not in ("32", "bf16-mixed"):
            raise ValueError(f"precision must be '32' or 'bf16-mixed', got {self.precision!r}")
        if self.isolation not in ("auto", "forkserver", "spawn", "none"):
            raise ValueError(f"isolation must be auto, forkserver, spawn or none, got {self.isolation!r}")
        if self.steps < 1 or self.warmup < 0 or self.memory_steps < 1 or self.memory_repeats < 1:
            raise ValueError(
                "need steps >= 1, warmup >= 0, memory_steps >= 1, memory_repeats >= 1; got "
                f"{self.steps}, {self.warmup}, {self.memory_steps}, {self.memory_repeats}"
            )
        if self.compile and self.warmup < 1:
            raise ValueError("compile needs warmup >= 1: the first step compiles, and it must not be timed")
        if self.backbone_batch < 1 or self.method_batch < 1:
            raise ValueError(f"need backbone_batch >= 1 and method_batch >= 1; got {self.backbone_batch}, {self.method_batch}")
        if self.method_batch < 2 and "mocov3" in self.methods:
            raise ValueError(f"the mocov3 row needs method_batch >= 2 (its heads' BatchNorm normalises over the batch), got {self.method_batch}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None (torch's default), got {self.threads}")
        for name, model, size in (("backbone", self.backbone_model, self.backbone_img_size), ("method", self.method_model, self.method_img_size)):
            if size % model.patch_size:
                raise ValueError(f"{name}_img_size {size} is not divisible by the patch size {model.patch_size}")
        if self.local_size % self.method_model.patch_size:
            raise ValueError(f"local_size {self.local_size} is not divisible by the patch size {self.method_model.patch_size}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def preset(name: str, **overrides: Any) -> BenchConfig:
    """``full``: the numbers for RESULTS.md (several minutes on 2 cores). ``quick``: smaller
    models and images, fewer steps; the whole run takes under 2 minutes on 2 cores. ``tiny``: a
    smoke test of the machinery (seconds)."""
    if name == "full":
        cfg = BenchConfig()
    elif name == "quick":
        cfg = BenchConfig(
            backbone_batch=8,
            method_model=VIT_TI16,
            method_img_size=64,
            method_batch=16,
            local_size=32,
            warmup=1,
            steps=3,
            memory_repeats=1,
            matmul_repeats=5,
            data_seconds=1.0,
            data_images=4,
        )
    elif name == "tiny":
        tiny = ModelSpec(embed_dim=32, depth=2, num_heads=2, patch_size=8)
        cfg = BenchConfig(
            backbone_model=tiny,
            backbone_img_size=32,
            backbone_batch=4,
            method_model=tiny,
            method_img_size=32,
            method_batch=4,
            local_size=16,
            n_local=2,
            num_classes=10,
            moco_hidden_dim=64,
            moco_out_dim=16,
            dino_out_dim=128,
            dino_hidden_dim=64,
            dino_bottleneck_dim=16,
            warmup=1,
            steps=2,
            memory_repeats=1,
            matmul_sizes=((128, 128, 128),),
            matmul_repeats=2,
            matmul_probe_size=128,
            data_source_size=40,
            data_global_size=32,
            data_local_size=16,
            data_n_local=2,
            data_seconds=0.05,
            data_images=2,
        )
    else:
        raise ValueError(f"unknown preset {name!r}; choose full, quick or tiny")
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
