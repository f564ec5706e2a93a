"""Measuring instruments: step timing, peak memory, the machine's matmul rate, and a description
of the machine. Everything here runs inside the isolated process of one benchmark job."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ssl_vit.runtime import allocator_note


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0


def time_interleaved(
    steps: dict[str, Callable[[], None]],
    warmup: int,
    rounds: int,
    device: torch.device,
    min_utilization: float = 0.75,
    max_rounds: int | None = None,
) -> dict[str, Any]:
    """Time several step functions against each other, interleaved.

    After ``warmup`` untimed steps of each, every round runs each step once, the order reversed
    on odd rounds (ABBA), so drifts of the machine's speed hit all of them alike. Rounds go on
    until ``rounds`` of them ran undisturbed (at most ``max_rounds``, default ``2 * rounds + 1``).

    Disturbed: on a CPU shared with other jobs a step can lose its cores to someone else. The
    process's CPU time tells: the utilisation ``cpu / (wall * threads)`` of a step (with
    ``torch.get_num_threads()`` threads) falls to about half when it loses one of two cores. A
    step's own utilisation on a quiet machine need not be near 1 (a small model's step spends
    part of its time in one Python thread: 0.6-0.7 for a ViT-Ti at 64 px on 2 cores), so a
    round counts when each step reached ``min_utilization`` of the best utilisation seen for
    that step so far (the untimed warm-up steps after the first included, at most 1). A round
    below is timed but not counted; if too few rounds are left, all count and the result says
    ``disturbed``. (On CUDA every round counts.)

    Returns, per name, ``step_s``, ``cpu_utilization`` and ``median_step_s`` (over the counted
    rounds); and ``counted``, the indices of the rounds that count (see :func:`paired`).
    """
    names = list(steps)
    threads = max(torch.get_num_threads(), 1)
    best: dict[str, float] = {n: 0.0 for n in names}  # the best utilisation seen, per step
    for name in names:
        for i in range(warmup):
            w, c = _timed(steps[name], device)
            if i > 0:  # the first step carries one-time work (allocations, kernel selection)
                best[name] = max(best[name], c / (w * threads))
    limit = max_rounds if max_rounds is not None else 2 * rounds + 1
    wall: dict[str, list[float]] = {n: [] for n in names}
    util: dict[str, list[float]] = {n: [] for n in names}
    kept: list[int] = []
    r = 0
    while len(kept) < rounds and r < limit:
        for name in names if r % 2 == 0 else names[::-1]:
            w, c = _timed(steps[name], device)
            wall[name].append(w)
            util[name].append(c / (w * threads))
            best[name] = max(best[name], util[name][-1])
        if device.type == "cuda" or all(util[n][r] >= min_utilization * min(best[n], 1.0) for n in names):
            kept.append(r)
        r += 1
    disturbed = len(kept) < rounds
    counted = list(range(r)) if disturbed else kept
    out: dict[str, Any] = {
        name: {
            "step_s": wall[name],
            "cpu_utilization": util[name],
            "median_step_s": statistics.median(wall[name][i] for i in counted),
            "rounds_counted": len(counted),
            "disturbed": disturbed,
        }
        for name in names
    }
    out["counted"] = counted
    return out


def paired(numerator: Sequence[float], denominator: Sequence[float], counted: Sequence[int]) -> dict[str, Any]:
    """Median and quartiles over the counted rounds of ``numerator[i] / denominator[i]``: a
    ratio measured within each round, so the machine's state is the same for both sides; the
    quartiles show how much two measurements of the same thing disagree (the noise)."""
    xs = sorted(numerator[i] / denominator[i] for i in counted)
    if len(xs) < 2:
        return {"median": xs[0], "quartiles": [xs[0], xs[0]]}
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": statistics.median(xs), "quartiles": [q[0], q[2]]}


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


class MemoryProbe:
    """Peak memory of what happens after it is created.

    CPU: the resident-set high-water mark (``VmHWM``; ``ru_maxrss`` where /proc is missing),
    reset at the start where the kernel allows it (``/proc/self/clear_refs``; in a freshly forked
    process it starts at the current size anyway). Two numbers: ``peak_rss_bytes``, the
    high-water mark above the resident set at the start; and ``peak_mem_bytes``, the same
    without the shared-library pages the job faulted in (``RssFile``, e.g. the code of the torch
    kernels it ran first: tens of MiB that say nothing about the step's memory), i.e. the peak of
    anonymous memory: weights, gradients, optimiser state, activations, allocator caches.
    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = torch.cuda.memory_allocated(device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak RSS to the current RSS
        except OSError:
            pass
        rss = _proc_status_bytes("VmRSS")
        self.baseline = rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.anon_start = _proc_status_bytes("RssAnon")

    def peak(self) -> dict[str, int]:
        """``peak_mem_bytes`` (see the class docstring), ``peak_rss_bytes`` (above the start) and
        ``peak_abs_bytes`` (the process's high-water mark)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            return {"peak_mem_bytes": max(peak - self.baseline, 0), "peak_rss_bytes": 0, "peak_abs_bytes": peak}
        hwm = _proc_status_bytes("VmHWM")
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out = {"peak_rss_bytes": max(hwm - self.baseline, 0), "peak_abs_bytes": hwm}
        file_now, shmem_now = _proc_status_bytes("RssFile"), _proc_status_bytes("RssShmem")
        if self.anon_start is not None and file_now is not None and shmem_now is not None:
            out["peak_mem_bytes"] = max(hwm - file_now - shmem_now - self.anon_start, 0)
        else:
            out["peak_mem_bytes"] = out["peak_rss_bytes"]
        return out


def saved_activation_bytes(step: Callable[[], None], params: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass during one ``step``,
    parameters (and views of them) left out: the activation memory of a training step, counted
    exactly (``torch.autograd.graph.saved_tensors_hooks``), free of the allocator's noise that
    the peak RSS carries."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_storages:
            storages[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def matmul_rate(
    m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, repeats: int = 10, min_utilization: float = 0.75
) -> dict[str, Any]:
    """Dense ``[m, k] @ [k, n]`` FLOP/s (2·m·k·n per product): the best of ``repeats`` products
    that kept all threads busy (see :func:`time_interleaved`; up to ``4 * repeats`` are tried). The
    best, because it is the rate the machine sustains, which other load only ever lowers."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=out)
    synchronize(device)
    threads = max(torch.get_num_threads(), 1)
    times, kept = [], []
    while len(kept) < max(repeats, 1) and len(times) < 4 * max(repeats, 1):
        t0, c0 = time.perf_counter(), time.process_time()
        torch.mm(a, b, out=out)
        synchronize(device)
        wall = time.perf_counter() - t0
        times.append(wall)
        if device.type == "cuda" or time.process_time() - c0 >= min_utilization * wall * threads:
            kept.append(wall)
    flops = 2.0 * m * k * n
    return {"mkn": [m, k, n], "flops_per_s": flops / min(kept or times), "disturbed": not kept, "tries": len(times)}


def matmul_rates(sizes: Sequence[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, repeats: int) -> dict[str, Any]:
    """The rate of each size, and the best of them: the denominator of 'fraction of matmul'."""
    rates = [matmul_rate(*s, dtype=dtype, device=device, repeats=repeats) for s in sizes]
    return {"dtype": str(dtype).replace("torch.", ""), "sizes": rates, "peak_flops_per_s": max(r["flops_per_s"] for r in rates)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """The machine and software the numbers were measured on."""
    import lightly
    import timm

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "lightly": lightly.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "loadavg": loadavg(),
        "allocator": allocator_note(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info
