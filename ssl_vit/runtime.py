"""What the running job is, as code outside Lightning's hooks sees it: its process layout
(``torch.distributed``'s default group) and its seed (``seed_everything``'s)."""

from __future__ import annotations

import os

import torch.distributed as dist


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_seed(default: int = 0) -> int:
    """The run's seed: what ``seed_everything`` set (``PL_GLOBAL_SEED``, the seed Lightning's own
    distributed sampler uses), else ``default``."""
    return int(os.environ.get("PL_GLOBAL_SEED", default))


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_allocator_note = "system default"


def keep_freed_memory() -> str:
    """Make the C heap keep freed memory for reuse instead of handing it back to the OS.

    glibc serves every block above 32 MiB (and, by default, smaller ones after a free) with a
    fresh ``mmap`` and returns it with ``munmap`` when freed, so each training step on a CPU
    faults in again every page of its large activations and gradients: about a million minor page
    faults per ViT-S/16 step at 224 px, batch 32, some 7 % of the step. With ``mmap`` off and a
    high trim threshold, the second step reuses the first step's pages. The cost is memory that
    stays resident at the process's high-water mark (peak RSS a few per cent higher, from
    fragmentation). This is what PyTorch's CPU tuning guide gets by preloading jemalloc or
    tcmalloc, without the dependency or a relaunch.

    A no-op (returning why) off glibc, when ``SSL_VIT_MALLOC=system``, or when the user set
    glibc's own ``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_``. Returns the allocator setting
    in words (the benchmark prints it); safe to call more than once.
    """
    global _allocator_note
    import ctypes
    import platform

    if os.environ.get("SSL_VIT_MALLOC", "keep") == "system":
        _allocator_note = "system default (SSL_VIT_MALLOC=system)"
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
