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
    """Destroy the default process group while the interpreter is whole (gloo's, left to the exit,
    aborts the process now and then): where every process arrives."""
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
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        has = f"{count} CUDA GPU(s), cuda:0 to cuda:{count - 1}" if count else "no CUDA GPU that torch can use; use --device cpu"
        raise ValueError(f"--device {name}: this machine has {has}")
    return name


def seed_training_step(seed: int, epoch: int, batch_idx: int, rank: int) -> None:
    """Seed torch for one batch by its position: a resumed run draws what an uninterrupted one drew."""
    torch.manual_seed(int(np.random.SeedSequence([seed, epoch, batch_idx, rank]).generate_state(1, np.uint64)[0]))


def global_seed(default: int = 0) -> int:
    """The seed ``seed_everything`` set (``PL_GLOBAL_SEED``), else ``default``."""
    return int(os.environ.get("PL_GLOBAL_SEED", default))


_allocator_note = "system default"


def keep_freed_memory() -> str:
    """``SSL_VIT_MALLOC=keep``: glibc keeps freed memory instead of unmapping each large block, so a CPU
    step does not fault its pages in again (opt-in: peak RSS grows). Returns the setting in words."""
    global _allocator_note
    choice = os.environ.get("SSL_VIT_MALLOC", "system")
    if choice not in ("system", "keep"):
        raise ValueError(f"SSL_VIT_MALLOC must be 'system' or 'keep', got {choice!r}")
    _allocator_note = "system default"
    if choice == "keep" and any(k in os.environ for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")):
        _allocator_note = "as set by MALLOC_* in the environment"
    elif choice == "keep" and platform.libc_ver()[0] != "glibc":
        _allocator_note = "system default (not glibc)"
    elif choice == "keep":  # mallopt(M_MMAP_MAX = -4, 0) and mallopt(M_TRIM_THRESHOLD = -1, 2 GiB)
        ok = ctypes.CDLL(None).mallopt(-4, 0) == 1 and ctypes.CDLL(None).mallopt(-1, 2**31 - 1) == 1
        _allocator_note = "glibc, freed memory kept for reuse (mmap off, trim at 2 GiB)" if ok else "system default (mallopt refused)"
    return _allocator_note


def allocator_note() -> str:
    """The C heap setting of this process, in words (see :func:`keep_freed_memory`)."""
    return _allocator_note
