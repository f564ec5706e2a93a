"""What the running job is, as code outside Lightning's hooks sees it: its process layout
(``torch.distributed``'s default group), its seed (``seed_everything``'s) and its C heap setting
(``SSL_VIT_MALLOC``)."""

from __future__ import annotations

import os

import torch.distributed as dist


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def release_process_group() -> None:
    """Destroy the default process group while the interpreter is whole. Lightning registers this
    at exit for NCCL only; a gloo group left to the interpreter's finalisation aborts the process
    now and then (``terminate called without an active exception``, status -6 instead of the
    run's own), as a two-process CPU run stopped by SIGTERM showed."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "gloo":
            # Every process out of its last collective before any tears its connections down: a
            # process whose peer closed first aborts the same way now and then (FSDP on gloo:
            # 1 run in 8 without this wait, none in 32 with it). Call it where every process
            # arrives (a clean end), not before one process's long solo work.
            dist.barrier()
        dist.destroy_process_group()


def resolve_device(name: str | None) -> str:
    """The device a command runs on: ``name`` (``cpu``, ``cuda``, ``cuda:1`` ...) checked against
    this machine, or CUDA when there is a GPU and CPU otherwise (``name`` None)."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1 ...)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {name}: this machine has no CUDA GPU that torch can use; use --device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return name


def seed_training_step(seed: int, epoch: int, batch_idx: int, rank: int) -> None:
    """Seed torch's generators for one training batch (drop path, masking, MixUp) from its
    position in training: a resumed run then draws what the uninterrupted run drew, and each
    process draws its own."""
    import numpy as np
    import torch

    key = [seed, epoch, batch_idx, rank]
    torch.manual_seed(int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0]))


def global_seed(default: int = 0) -> int:
    """The run's seed: what ``seed_everything`` set (``PL_GLOBAL_SEED``, the seed Lightning's own
    distributed sampler uses), else ``default``."""
    return int(os.environ.get("PL_GLOBAL_SEED", default))


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_allocator_note = "system default"


def keep_freed_memory() -> str:
    """With ``SSL_VIT_MALLOC=keep``: make the C heap keep freed memory for reuse instead of
    handing it back to the OS. Off by default.

    glibc serves every block above 32 MiB (and smaller ones, until its threshold adapts) with a
    fresh ``mmap`` and returns it with ``munmap`` when freed, so each training step on a CPU can
    fault in again the pages of its large activations and gradients: about 200 000 minor page
    faults per ViT-S/16 step at 224 px, batch 32, some 5-7 % of the step on 2 cores. With
    ``mmap`` off and a high trim threshold, later steps reuse the first step's pages. The price
    is fragmentation: peak RSS measured up to 10 % higher, depending on the step's allocation pattern
    (MoCo v3 the worst), which is why it is an opt-in. PyTorch's CPU tuning guide gets the same
    by preloading jemalloc or tcmalloc.

    A no-op (returning why) unless asked, off glibc, or when the user set glibc's own
    ``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_``. Returns the allocator setting in words
    (the benchmark prints it); safe to call more than once.
    """
    global _allocator_note
    import ctypes
    import platform

    choice = os.environ.get("SSL_VIT_MALLOC", "system")
    if choice not in ("system", "keep"):
        raise ValueError(f"SSL_VIT_MALLOC must be 'system' or 'keep', got {choice!r}")
    if choice == "system":
        _allocator_note = "system default"
    elif any(k in os.environ for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")):
        _allocator_note = "as set by MALLOC_* in the environment"
    elif platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        _allocator_note = "system default (not glibc)"
    else:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
        _allocator_note = "glibc, freed memory kept for reuse (mmap off, trim at 2 GiB)" if ok else "system default (mallopt refused)"
    return _allocator_note


def allocator_note() -> str:
    """The C heap setting of this process, in words (see :func:`keep_freed_memory`)."""
    return _allocator_note
