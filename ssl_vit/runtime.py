"""The running process: its place in the process group, its seeds, its device, its C heap."""

from __future__ import annotations

import ctypes
import os
import platform

import numpy as np
import torch
import torch.distributed as dist


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` when not distributed."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def release_process_group() -> None:
    """Destroy the default process group where every process arrives (gloo's, left to the exit, aborts now and then)."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "gloo":
            dist.barrier()  # every process out of its last collective before any closes its connections
        dist.destroy_process_group()


def resolve_device(name: str | None) -> str:
    """``name`` (``cpu``, ``cuda:1`` ...) checked against this machine; None: CUDA if there is a GPU."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1 ...)") from None
    if device.type == "cuda" and (device.index or 0) >= (count := torch.cuda.device_count()):  # (0 without CUDA)
        has = f"{count} CUDA GPU(s), cuda:0 to cuda:{count - 1}" if count else "no CUDA GPU that torch can use; use --device cpu"
        raise ValueError(f"--device {name}: this machine has {has}")
    return name


def seed_training_step(seed: int, epoch: int, batch_idx: int, rank: int) -> None:
    """Seed torch for one batch by its position: a resumed run draws what an uninterrupted one drew."""
    torch.manual_seed(int(np.random.SeedSequence([seed, epoch, batch_idx, rank]).generate_state(1, np.uint64)[0]))


def global_seed(default: int = 0) -> int:
    """The seed ``seed_everything`` set (``PL_GLOBAL_SEED``), else ``default``."""
    return int(os.environ.get("PL_GLOBAL_SEED", default))


def allocator_note() -> str:
    """The C heap setting ``SSL_VIT_MALLOC`` asks for (:func:`keep_freed_memory` applies it), in words."""
    choice = os.environ.get("SSL_VIT_MALLOC", "system")
    if choice not in ("system", "keep"):
        raise ValueError(f"SSL_VIT_MALLOC must be 'system' or 'keep', got {choice!r}")
    if choice == "system":
        return "system default"
    if any(k in os.environ for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")):
        return "as set by MALLOC_* in the environment"
    return "glibc, freed memory kept for reuse (mmap off, trim at 2 GiB)" if platform.libc_ver()[0] == "glibc" else "system default (not glibc)"


def keep_freed_memory() -> str:
    """``SSL_VIT_MALLOC=keep``: glibc keeps freed memory instead of unmapping each large block, so a CPU
    step does not fault its pages in again (opt-in: peak RSS grows). Returns the setting in words."""
    if (note := allocator_note()).startswith("glibc"):  # mallopt(M_MMAP_MAX = -4, 0) and mallopt(M_TRIM_THRESHOLD = -1, 2 GiB)
        ctypes.CDLL(None).mallopt(-4, 0)
        ctypes.CDLL(None).mallopt(-1, 2**31 - 1)
    return note
