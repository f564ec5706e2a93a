"""One benchmark job in a process of its own, so that peak memory is the job's alone and nothing
(allocator caches, thread pools, compiled kernels) carries over from the previous job.

On CPU the jobs are forked from a ``forkserver`` that has imported torch, timm, lightly and
ssl_vit once but never computed anything (a process that has run OpenMP work cannot be forked
safely), so a job starts in a fraction of a second instead of re-importing for seconds. On CUDA
each job is a fresh ``spawn``-ed interpreter. ``isolation="none"`` runs jobs in the calling
process (debugging; peak memory then mixes jobs).
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ssl_vit.bench import measure, workloads
from ssl_vit.bench.config import BenchConfig
from ssl_vit.runtime import keep_freed_memory

JobKind = Literal["environment", "matmul", "memory", "timing", "views"]


@dataclass
class Job:
    kind: JobKind
    config: BenchConfig
    row: str = ""
    impl: Literal["ours", "peer"] = "ours"
    matmul_sizes: tuple[tuple[int, int, int], ...] = ()


def run_job(job: Job) -> dict[str, Any]:
    """Run one job in this process and return its measurements."""
    cfg = job.config
    device = torch.device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if job.kind == "environment":
        return measure.environment(device)
    if job.kind == "matmul":
        # fp32 on CPU; bf16 on GPUs, whose dense rate is quoted in bf16 (the convention).
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return measure.matmul_rates(job.matmul_sizes, dtype, device, cfg.matmul_repeats)
    if job.kind == "views":
        from ssl_vit.bench.data import views_job

        return views_job(job.row, job.impl, cfg)
    if job.kind == "memory":
        return _memory_job(job, device)
    if job.kind == "timing":
        return _timing_job(job, device)
    raise ValueError(f"unknown job kind {job.kind!r}")


def _build(row: str, impl: str, cfg: BenchConfig, device: torch.device, compile: bool = False) -> workloads.Workload:
    return (workloads.ours if impl == "ours" else workloads.peer)(row, cfg, device, compile)


def _memory_job(job: Job, device: torch.device) -> dict[str, Any]:
    """Peak memory of one implementation of a row, alone in its process: model, optimiser state
    (allocated by the first optimiser step), activations of ``memory_steps`` steps. Then, after
    the memory reading, one step that counts the tensors saved for backward exactly, and one
    under FlopCounterMode."""
    cfg = job.config
    probe = measure.MemoryProbe(device)
    work = _build(job.row, job.impl, cfg, device)
    for _ in range(cfg.memory_steps):
        work.step()
    measure.synchronize(device)
    out: dict[str, Any] = dict(probe.peak())
    out["params"] = sum(p.numel() for p in work.model.parameters())
    out["trainable_params"] = sum(p.numel() for p in work.model.parameters() if p.requires_grad)
    out["flops_per_image_analytic"] = work.flops_per_image
    out["saved_activation_bytes"] = measure.saved_activation_bytes(work.step, list(work.model.parameters()))
    if cfg.flop_check:
        from ssl_vit.flops import flop_counter

        with flop_counter() as counter:
            work.step()
        out["flops_per_image_counted"] = counter.get_total_flops() / work.views[0].shape[0]
    return out


def _timing_job(job: Job, device: torch.device) -> dict[str, Any]:
    """Ours and the peer of a row in one process, timed interleaved (``measure.time_interleaved``):
    their ratio is measured on the same machine state, which a shared machine does not keep from
    one process to the next. A dense matmul takes its turn in every round too, so the fraction
    of the matmul rate is also taken within each round."""
    cfg = job.config
    impls = ["ours", "peer"] if cfg.peers else ["ours"]
    works = {impl: _build(job.row, impl, cfg, device, cfg.compile) for impl in impls}
    steps = {impl: w.step for impl, w in works.items()}
    mm_flops, steps["matmul"] = _matmul_probe(cfg.matmul_probe_size, device)
    load_before = measure.loadavg()
    timing = measure.time_interleaved(steps, cfg.warmup, cfg.steps, device)
    counted = timing.pop("counted")
    flops = works["ours"].flops_per_image
    mm_wall = timing["matmul"]["step_s"]
    for impl, work in works.items():
        res = timing[impl]
        res["batch"] = batch = work.views[0].shape[0]
        res["images_per_s"] = batch / res["median_step_s"]
        if flops:
            # achieved FLOP/s over the matmul's FLOP/s, in the same round
            achieved = [flops * batch / t for t in res["step_s"]]
            res["matmul_fraction_paired"] = measure.paired(achieved, [mm_flops / t for t in mm_wall], counted)
    if "peer" in works:
        timing["paired_ratio"] = measure.paired(timing["peer"]["step_s"], timing["ours"]["step_s"], counted)
    timing["loadavg"] = [load_before, measure.loadavg()]
    return timing


def _matmul_probe(size: int, device: torch.device) -> tuple[float, Any]:
    """A dense ``size``-square matmul (fp32 on CPU, bf16 on GPUs, then at least 8192), three
    times: ~0.15 s on a 2-core CPU at 2048."""
    n, reps = (size, 3) if device.type == "cpu" else (max(size, 8192), 10)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty_like(a)

    def probe() -> None:
        for _ in range(reps):
            torch.mm(a, a, out=out)

    return 2.0 * n**3 * reps, probe


def _child_main(conn: Any, job: Job) -> None:
    # A forkserver / spawn child is a fresh interpreter: give it the heap setting ``ssl-vit``
    # itself was given (SSL_VIT_MALLOC; for ours and the peer alike, which share the process).
    keep_freed_memory()
    try:
        result = run_job(job)
    except BaseException as err:  # report everything, OOM-ish errors included
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    conn.send(result)
    conn.close()


def resolve_isolation(cfg: BenchConfig) -> str:
    if cfg.isolation != "auto":
        return cfg.isolation
    return "spawn" if cfg.device.startswith("cuda") else "forkserver"


def run_isolated(job: Job) -> dict[str, Any]:
    """Run ``job`` in a fresh process (see the module docstring); errors come back as
    ``{"error": ...}`` instead of raising, so one failed row does not sink the run."""
    isolation = resolve_isolation(job.config)
    if isolation == "none":
        try:
            return run_job(job)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    ctx = mp.get_context(isolation)
    if isolation == "forkserver":
        ctx.set_forkserver_preload([__name__, "ssl_vit.bench.data", "ssl_vit.methods", "timm", "lightly.loss"])
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child_main, args=(sender, job), daemon=True)
    process.start()
    sender.close()
    timeout = job.config.job_timeout_s
    try:
        if receiver.poll(timeout):
            result = receiver.recv()
        else:
            process.kill()
            result = {"error": f"timed out after {timeout:.0f} s"}
    except EOFError:
        result = {"error": "the benchmark process died without a result (out of memory?)"}
    process.join(30)
    if process.exitcode not in (0, None) and "error" not in result:
        result["error"] = f"the benchmark process exited with code {process.exitcode}"
    receiver.close()
    return result
