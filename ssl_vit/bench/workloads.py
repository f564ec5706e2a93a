"""The training steps being timed: ours exactly as training runs them, and the peers'.

Ours: the method's ``step(views, labels)``, backward, the optimiser it configures (AdamW with its
parameter groups; torch's fused kernel unless ``fused_optimizer`` is off), ``zero_grad``, and the
EMA update of its momentum encoder / teacher (``module.ema.update``), which is what
``BaseMethod.training_step`` and ``optimizer_step`` do inside Lightning. The Trainer's own
overhead (logging, callbacks, the progress bar) is left out, for the peers too; so are gradient
clipping and DINO's first-epoch freezing of the head's last layer (the steady state after epoch
1), which lightly's examples do not do either.

Peers: the ``PeerModel`` compositions of :mod:`ssl_vit.bench.peers`, with AdamW on the same
learning rate and weight decay, created as lightly's examples create it (torch's default
implementation), and lightly's ``update_momentum`` after the step.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from lightly.utils.scheduler import cosine_schedule
from torch import Tensor, nn

from ssl_vit.backbones import create_backbone
from ssl_vit.backbones.compile import DEFAULT_BACKEND, compile_backbone
from ssl_vit.bench import peers
from ssl_vit.bench.config import BenchConfig
from ssl_vit.flops import backbone_train_flops, method_step_flops

ROWS: tuple[str, ...] = ("backbone", "supervised", "mpp", "mocov3", "dino")
# A long schedule, so the EMA momentum stays in its realistic range during the timed steps.
_SCHEDULE_STEPS = 100_000


@dataclass
class Workload:
    step: Callable[[], None]
    model: nn.Module
    views: list[Tensor]
    labels: Tensor
    flops_per_image: float | None  # analytic, per image (ours only)


def row_views(row: str, cfg: BenchConfig) -> list[tuple[int, int, int, int]]:
    """The view shapes ``[B, C, H, W]`` of a row."""
    if row == "backbone":
        m, s, b = cfg.backbone_model, cfg.backbone_img_size, cfg.backbone_batch
        return [(b, m.in_chans, s, s)]
    m, s, b = cfg.method_model, cfg.method_img_size, cfg.method_batch
    if row in ("supervised", "mpp"):
        return [(b, m.in_chans, s, s)]
    if row == "mocov3":
        return [(b, m.in_chans, s, s)] * 2
    if row == "dino":
        return [(b, m.in_chans, s, s)] * 2 + [(b, m.in_chans, cfg.local_size, cfg.local_size)] * cfg.n_local
    raise ValueError(f"unknown benchmark row {row!r}; rows: {', '.join(ROWS)}")


def make_batch(row: str, cfg: BenchConfig, device: torch.device) -> tuple[list[Tensor], Tensor]:
    """Random normalised views and labels (the same for ours and the peer: seeded)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    views = [torch.randn(shape, generator=gen).to(device) for shape in row_views(row, cfg)]
    labels = torch.randint(0, cfg.num_classes, (views[0].shape[0],), generator=gen).to(device)
    return views, labels


def autocast(cfg: BenchConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def our_module(row: str, cfg: BenchConfig) -> nn.Module:
    """Our pretext module (or bare backbone) for a row."""
    from ssl_vit.methods import DINO, MPP, MoCoV3, Supervised

    lean = {"lean_backward": cfg.lean_backward}
    if row == "backbone":
        return create_backbone("vit", **cfg.backbone_model.backbone_kwargs(cfg.backbone_img_size), **lean)
    common = {
        "backbone": "vit",
        "backbone_kwargs": {**cfg.method_model.backbone_kwargs(cfg.method_img_size), **lean},
        "fused_optimizer": cfg.fused_optimizer,
    }
    if row == "supervised":
        module = Supervised(num_classes=cfg.num_classes, label_smoothing=0.1, **common)  # as the peer (and the stored results)
        # The timed step (``step``, not Lightning's ``training_step``) never runs the online
        # probe, and the peer has none: without it both hold the same parameters.
        module.probe = None
        return module
    if row == "mpp":
        return MPP(mean=peers.NORM_MEAN, std=peers.NORM_STD, **common)
    if row == "mocov3":
        return MoCoV3(proj_hidden_dim=cfg.moco_hidden_dim, proj_output_dim=cfg.moco_out_dim, pred_hidden_dim=cfg.moco_hidden_dim, **common)
    if row == "dino":
        return DINO(out_dim=cfg.dino_out_dim, hidden_dim=cfg.dino_hidden_dim, bottleneck_dim=cfg.dino_bottleneck_dim, **common)
    raise ValueError(f"unknown benchmark row {row!r}; rows: {', '.join(ROWS)}")


def peer_model(row: str, cfg: BenchConfig) -> peers.PeerModel:
    m, s = cfg.method_model, cfg.method_img_size
    if row == "backbone":
        return peers.PeerBackbone(cfg.backbone_model, cfg.backbone_img_size)
    if row == "supervised":
        return peers.PeerSupervised(m, s, cfg.num_classes)
    if row == "mpp":
        return peers.PeerMPP(m, s)
    if row == "mocov3":
        return peers.PeerMoCoV3(m, s, cfg.moco_hidden_dim, cfg.moco_out_dim)
    if row == "dino":
        return peers.PeerDINO(m, s, cfg.dino_hidden_dim, cfg.dino_bottleneck_dim, cfg.dino_out_dim)
    raise ValueError(f"unknown benchmark row {row!r}; rows: {', '.join(ROWS)}")


def ours(row: str, cfg: BenchConfig, device: torch.device, compile: bool = False) -> Workload:
    """Our step of ``row``; ``compile``: its backbones' blocks through ``torch.compile`` (inductor),
    as ``compile_backbone: true`` trains them."""
    module = our_module(row, cfg).to(device).train()
    if compile and row == "backbone":
        compile_backbone(module, DEFAULT_BACKEND)
    elif compile:
        module.compile_backbones(DEFAULT_BACKEND)
    views, labels = make_batch(row, cfg, device)
    amp = autocast(cfg, device)
    if row == "backbone":
        flops = backbone_train_flops(module, cfg.backbone_img_size)

        def backbone_step() -> None:
            with amp:
                loss = module(views[0]).float().mean()
            loss.backward()
            for p in module.parameters():
                p.grad = None

        return Workload(backbone_step, module, views, labels, flops)

    flops = method_step_flops(module, [v.shape for v in views], include_probe=False)
    optimizer = module.configure_optimizers()
    counter = itertools.count()

    def method_step() -> None:
        with amp:
            loss = module.step(views, labels)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if module.ema is not None:
            module.ema.update(next(counter), _SCHEDULE_STEPS)

    return Workload(method_step, module, views, labels, flops)


def peer(row: str, cfg: BenchConfig, device: torch.device, compile: bool = False) -> Workload:
    """The peer's step of ``row``; ``compile``: the blocks of each of its timm ViTs through
    ``torch.compile`` (inductor), one block at a time as ours."""
    model = peer_model(row, cfg).to(device).train()
    if compile:
        for vit in [m for m in model.modules() if isinstance(m, peers.TimmViT)]:
            compile_backbone(vit, DEFAULT_BACKEND)
    views, labels = make_batch(row, cfg, device)
    amp = autocast(cfg, device)
    if row == "backbone":

        def backbone_step() -> None:
            with amp:
                loss = model.loss(views, labels)
            loss.backward()
            for p in model.parameters():
                p.grad = None

        return Workload(backbone_step, model, views, labels, None)

    # AdamW as lightly's examples create it (the LR and weight decay values do not change a step's cost).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.5e-4, weight_decay=0.05)
    counter = itertools.count()

    def peer_step() -> None:
        with amp:
            loss = model.loss(views, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.update_momentum(cosine_schedule(next(counter), _SCHEDULE_STEPS, 0.996, 1.0))

    return Workload(peer_step, model, views, labels, None)
