"""The benchmark's tables (stdout and RESULTS.md share them)."""

from __future__ import annotations

from typing import Any

from ssl_vit.bench.config import TARGET_BACKBONE_SPEED, TARGET_MATMUL_FRACTION, TARGET_METHOD_SPEED


def ratio(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


def _num(x: float | None, fmt: str = ".2f", scale: float = 1.0) -> str:
    if x is None:
        return "-"
    v = x / scale
    # A small value a fixed-point format would print as 0 (a tiny model's GFLOPs or MiB): two
    # significant digits instead.
    if fmt.endswith("f") and v != 0 and format(abs(v), fmt).strip("0.") == "":
        return format(v, ".2g")
    return format(v, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), *(fmt.format(*r) for r in rows)])


def _side(res: dict[str, Any] | None, key: str, fmt: str = ".2f", scale: float = 1.0) -> str:
    if res is None:
        return "-"
    if "error" in res:
        return "error"
    return _num(res.get(key), fmt, scale)


def _speed(res: dict[str, Any] | None) -> str:
    text = _side(res, "images_per_s")
    return text + "*" if res and res.get("disturbed") else text


def _spread(q: list[float] | None) -> str:
    return "-" if not q else f"{q[0]:.2f}-{q[1]:.2f}"


def step_table(result: dict[str, Any], markdown: bool = False) -> str:
    header = [
        "step", "config", "ours img/s", "peer img/s", "speed", "per-round speed", "ours MiB", "peer MiB", "memory", "saved MiB ours/peer",
        "GFLOP/img", "ours GFLOP/s", "ours/peer of matmul", "FLOPs counted/analytic",
    ]
    rows = []
    for r in result["rows"]:
        ours, peer = r.get("ours"), r.get("peer")
        fractions = "/".join(_pct((x or {}).get("matmul_fraction")) for x in (ours, peer))
        checks = "/".join(_num((x or {}).get("flops_check"), ".3f") for x in (ours, peer))
        rows.append([
            r["name"], r["label"],
            _speed(ours), _speed(peer), ratio(r.get("throughput_ratio")), _spread((r.get("paired_ratio") or {}).get("quartiles")),
            _side(ours, "peak_mem_bytes", ".0f", 2**20), _side(peer, "peak_mem_bytes", ".0f", 2**20), ratio(r.get("memory_ratio")),
            "/".join(_side(x, "saved_activation_bytes", ".0f", 2**20) for x in (ours, peer)),
            _num(r.get("flops_per_image"), ".2f", 1e9), _side(ours, "flops_per_s", ".1f", 1e9), fractions, checks,
        ])
    return _table(header, rows, markdown)


def data_table(result: dict[str, Any], markdown: bool = False) -> str:
    header = ["augmentation", "methods", "views/image", "ours views/s/worker", "peer", "peer views/s/worker", "speed"]
    rows = []
    for r in result.get("data", []):
        ours, peer = r.get("ours"), r.get("peer")
        rows.append([
            r["transform"], r["methods"], _side(ours, "views_per_image", ".0f"), _side(ours, "views_per_s", ".1f"),
            r["peer_name"] or "-", _side(peer, "views_per_s", ".1f"), ratio(r.get("throughput_ratio")),
        ])
    return _table(header, rows, markdown)


def targets_text(result: dict[str, Any]) -> str:
    t = result.get("targets", {})
    lines = []
    for name, v in t.items():
        mark = "ok" if v["pass"] else "MISSED"
        if name == "backbone":
            lines.append(f"backbone >= {TARGET_BACKBONE_SPEED:.2f}x timm: {ratio(v['throughput_ratio'], 3)} [{mark}]")
        elif name == "matmul_fraction":
            lines.append(
                f"ViT-S/16 224 px training >= {100 * TARGET_MATMUL_FRACTION:.0f}% of the matmul rate: "
                f"ours {_pct(v['ours'])}, timm {_pct(v.get('peer'))} [{mark}]"
            )
        else:
            lines.append(
                f"{name} >= {TARGET_METHOD_SPEED:.2f}x peer speed at <= its memory: "
                f"{ratio(v['throughput_ratio'], 3)} speed, {ratio(v['memory_ratio'], 3)} memory [{mark}]"
            )
    return "\n".join(lines)


def header_text(result: dict[str, Any]) -> str:
    env = result.get("environment", {})
    cfg = result["config"]
    lines = [
        f"machine: {env.get('cpu', '?')}, {env.get('cpus_usable', '?')} usable cores, "
        f"{env.get('mem_total_gib', '?')} GiB" + (f", {env['gpu']}" if env.get("gpu") else ""),
        f"software: torch {env.get('torch', '?')} ({env.get('torch_threads', '?')} threads), timm {env.get('timm', '?')}, "
        f"lightly {env.get('lightly', '?')}, Python {env.get('python', '?')}; C heap: {env.get('allocator', '?')}; "
        f"our ViT: lean_backward={cfg.get('lean_backward', True)}; AdamW: ours "
        f"{'fused' if cfg.get('fused_optimizer', False) else 'torch default'}, peers torch default"
        + ("; timed with every ViT's blocks compiled (torch.compile, inductor), ours and the peers'" if cfg.get("compile") else ""),
        f"device {cfg['device']}, precision {cfg['precision']}, {cfg['warmup']} warm-up steps + {cfg['steps']} timed rounds "
        f"(ours and peer interleaved; medians), load average at start {env.get('loadavg')} / end {result.get('loadavg_end')}",
    ]
    for key, when in (("matmul", "start"), ("matmul_end", "end")):
        mm = result.get(key, {})
        if "sizes" in mm:
            sizes = ", ".join(
                f"{'x'.join(map(str, s['mkn']))}: {s['flops_per_s'] / 1e9:.1f}" + (" (disturbed)" if s.get("disturbed") else "")
                for s in mm["sizes"]
            )
            lines.append(f"matmul {mm['dtype']} GFLOP/s at the {when}: {sizes}")
        elif "error" in mm:
            lines.append(f"matmul at the {when}: error: {mm['error']}")
    peak = result.get("matmul_peak_flops_per_s")
    if peak:
        lines.append(f"matmul rate, best of the above: {peak / 1e9:.1f} GFLOP/s")
    return "\n".join(lines)


def errors_text(result: dict[str, Any]) -> str:
    lines = []
    for r in [*result.get("rows", []), *result.get("data", [])]:
        if "timing_error" in r:
            lines.append(f"{r['name']} (timing): {r['timing_error']['error']}")
        for impl in ("ours", "peer"):
            res = r.get(impl)
            if isinstance(res, dict) and "error" in res:
                lines.append(f"{r['name']} ({impl}): {res['error']}")
    return "\n".join(lines)


def format_report(result: dict[str, Any], markdown: bool = False) -> str:
    parts = [header_text(result), "", step_table(result, markdown)]
    parts += [
        "",
        "speed, memory: ours / peer (speed from the median step times; per-round speed: quartiles of the "
        "ratio within each interleaved round, i.e. the noise). GFLOP/img: analytic model FLOPs of one "
        "training step per image (multiply-add = 2). of matmul: achieved FLOP/s / the dense matmul rate "
        "measured in the same rounds. saved MiB: the tensors autograd keeps for backward in one step, "
        "counted exactly (peak RSS on a CPU also carries the allocator's noise, about 1-3 %).",
    ]
    if any((r.get(i) or {}).get("disturbed") for r in result["rows"] for i in ("ours", "peer")):
        parts.append("* other load took cores away during most timed steps: rerun on a quiet machine")
    if result.get("data"):
        parts += ["", data_table(result, markdown)]
    if result.get("targets"):
        parts += ["", targets_text(result)]
    errors = errors_text(result)
    if errors:
        parts += ["", "errors:", errors]
    return "\n".join(parts)
