"""Small shared fixtures for the tests: tiny backbones, fixed batches, short Lightning runs."""

from __future__ import annotations

import contextlib
import gzip
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from PIL import Image
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.methods import BaseMethod

# A tiny ViT: 16 px grey images, 4 px patches -> 16 tokens; 2 blocks of width 32.
TINY_VIT: dict[str, Any] = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 2, "num_heads": 2}
TINY_BACKBONE: dict[str, Any] = {"backbone": "vit", "backbone_kwargs": TINY_VIT}
# Heads of each method small enough for TINY_VIT, and the view sizes each method trains on.
SMALL_HEADS: dict[str, dict[str, Any]] = {
    "mpp": {"mean": [0.5], "std": [0.5]},
    "mocov3": {"proj_hidden_dim": 64, "pred_hidden_dim": 64, "proj_output_dim": 32},
    "dino": {"out_dim": 256, "hidden_dim": 64, "bottleneck_dim": 32},
    "supervised": {},
}
VIEW_SIZES: dict[str, list[int]] = {"mpp": [16], "mocov3": [16, 16], "dino": [16, 16, 8, 8], "supervised": [16]}


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a subprocess that imports the test modules (class paths such as
    ``test_faults.Interrupt`` in a recipe), with ``extra`` variables set."""
    tests = str(Path(__file__).resolve().parent)
    # Without the variables of a distributed launch (a test suite run inside a torchrun or SLURM
    # job, or left by an in-process DDP test): a subprocess would take itself for one of its ranks.
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return {**env, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]), **extra}


def under_file_size_limit(limit: int, setup: str, call: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``setup`` then ``call`` (Python source; ``sys.argv[1:]`` is ``args``) in a fresh
    interpreter whose files cannot grow past ``limit`` bytes once ``setup`` is done: a write past
    it fails with EFBIG, as one on a full disk does. An ``OSError`` from ``call`` is printed as
    ``refused ERRNO MESSAGE``."""
    code = "\n".join([
        "import resource, signal, sys",
        setup,
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)",
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))",
        "try:",
        f"    {call}",
        "except OSError as err:",
        "    print('refused', err.errno, err)",
    ])
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=subprocess_env())


_LAUNCH_VARIABLES = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}


class RepeatBatch(Dataset):
    """Serves the same ``(views, labels)`` batch ``length`` times (batch_size=None loaders)."""

    def __init__(self, views: list[torch.Tensor], labels: torch.Tensor, length: int) -> None:
        self.views, self.labels, self.length = views, labels, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        return self.views, self.labels


def fixed_views(sizes: list[int], batch: int = 16, chans: int = 1, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(batch) % 4
    base = torch.randn(batch, chans, max(sizes), max(sizes), generator=g) * 0.5 + labels.view(-1, 1, 1, 1) * 0.5
    views = [torch.nn.functional.interpolate(base, size=(s, s), mode="bilinear", align_corners=False) + 0.05 * torch.randn(batch, chans, s, s, generator=g) for s in sizes]
    return views, labels


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def fit_steps(
    model: L.LightningModule,
    views: list[torch.Tensor],
    labels: torch.Tensor,
    steps: int,
    epochs: int = 1,
    callbacks_extra: list[Callback] | None = None,
    **trainer_kwargs: Any,
) -> list[float]:
    """Train ``steps`` optimiser steps per epoch on one fixed batch; returns the loss of each step."""
    recorder = LossRecorder()
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, *(callbacks_extra or [])],
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(RepeatBatch(views, labels, steps), batch_size=None))
    return recorder.losses


FSDP_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "trainer" / "fsdp.yaml"


def fsdp_recipe_policy() -> set[type]:
    """The module classes ``recipes/trainer/fsdp.yaml`` wraps as FSDP units."""
    import importlib

    import yaml

    init = yaml.safe_load(FSDP_RECIPE.read_text())["trainer"]["strategy"]["init_args"]
    return {getattr(importlib.import_module(module), name) for module, _, name in (p.rpartition(".") for p in init["auto_wrap_policy"])}


def cpu_fsdp_strategy() -> L.pytorch.strategies.FSDPStrategy:
    """Lightning's FSDP strategy with the recipe's wrapping, on CPU processes (gloo)."""
    return CPUFSDPStrategy()


class CPUFSDPStrategy(L.pytorch.strategies.FSDPStrategy):
    """Lightning's FSDP strategy on CPU processes (gloo), with ``recipes/trainer/fsdp.yaml``'s
    wrapping unless given another: Lightning refuses its FSDPStrategy class on a CPU and passes
    FSDP no CPU device, so the model is wrapped here with ``device_id=cpu`` and Lightning's own
    setup continues from the wrapped model. (A class path for recipes: ``helpers.CPUFSDPStrategy``.)"""

    def __init__(self, **kwargs: Any) -> None:
        # (a recipe passes every argument of the signature, None where it gives none)
        kwargs["auto_wrap_policy"] = kwargs.get("auto_wrap_policy") or fsdp_recipe_policy()
        kwargs["process_group_backend"] = kwargs.get("process_group_backend") or "gloo"
        super().__init__(**kwargs)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(model, sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs)
        self.kwargs.pop("auto_wrap_policy", None)
        return super()._setup_model(wrapped)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # Lightning gathers the full optimiser state with offload_to_cpu=True. On a CPU device
        # torch's FSDP then keeps each state as a view of one gather buffer (``.cpu()`` copies
        # nothing), so every state reads the last one gathered (exp_avg = exp_avg_sq): a torch bug
        # that only CPU devices meet. Without the offload, FSDP clones each state.
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            OptimStateKeyType,
            StateDictType,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        optimizer = getattr(optimizer, "_optimizer", optimizer)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)):
            state = FSDP.optim_state_dict(self.model, optimizer)
            return FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model) if self.global_rank == 0 else state



class Reconstruct(BaseMethod):
    """A fourth method as a user writes one (a BaseMethod subclass in a file of its own, named
    in recipes by its dotted path: ``helpers.Reconstruct``): predicts the pixels of its one view
    from the [CLS] output."""

    def __init__(self, pixels: int = 16 * 16 * 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.decoder = torch.nn.Linear(self.backbone.embed_dim, pixels)

    def step(self, views: list[torch.Tensor], labels: torch.Tensor) -> dict[str, torch.Tensor]:
        feats = self.backbone(views[0])  # [B, D]
        loss = (self.decoder(feats) - views[0].flatten(1)).pow(2).mean()
        return {"loss": loss, "features": feats.detach()}


def torch_flops(fn) -> int:
    """FLOPs of ``fn()`` by torch's own FlopCounterMode table, attention on the math backend
    (which torch decomposes into the matmuls its table counts): a reference independent of the
    attention formulas ``ssl_vit.flops`` adds."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@contextlib.contextmanager
def registered_backbones(**builds: Any) -> Iterator[None]:
    """Backbones of a test's own in the registry (``name=builder``), removed afterwards."""
    from ssl_vit.backbones.registry import _REGISTRY, BackboneSpec, register_backbone

    try:
        for name, build in builds.items():
            register_backbone(BackboneSpec(name, build))
        yield
    finally:
        for name in builds:
            _REGISTRY.pop(name, None)


def _idx(array: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_fake_fashion_mnist(root: Path, n_train: int = 12, n_test: int = 6) -> np.ndarray:
    """Fashion-MNIST's four gzipped IDX files in ``root`` with random 28x28 images (labels 0..9
    in turn); returns the training images."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    train = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    for prefix, images in (("train", train), ("t10k", rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8))):
        labels = (np.arange(len(images)) % 10).astype(np.uint8)
        (root / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(images)))
        (root / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(labels)))
    return train


def write_image_folder(root: Path, classes: dict[str, int] | int, sizes: list[tuple[int, int]], mode: str = "RGB", seed: int = 0) -> Path:
    """An image folder of PNGs: ``root/<class>/<i>.png`` for ``{class: count}``, or ``count`` images
    directly in ``root`` (unlabelled); sizes cycle through ``sizes`` (width, height); each class a
    brightness of its own, with noise, so classes differ."""
    rng = np.random.default_rng(seed)
    groups = {"": classes} if isinstance(classes, int) else classes
    for c, (name, count) in enumerate(groups.items()):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            w, h = sizes[i % len(sizes)]
            shape = (h, w) if mode == "L" else (h, w, 3)
            pixels = np.clip(rng.normal(40 + 50 * c, 30, shape), 0, 255).astype(np.uint8)
            Image.fromarray(pixels, mode).save(folder / f"{i}.png")
    return root
