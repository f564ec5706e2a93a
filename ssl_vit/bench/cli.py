"""``ssl-vit benchmark``: see :mod:`ssl_vit.bench`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ssl_vit.bench.config import METHOD_NAMES, preset
from ssl_vit.bench.report import format_report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ssl-vit benchmark",
        description=(
            "Training-step throughput and peak memory of each method against the same step composed "
            "from lightly + timm, the bare backbone against timm's ViT, model FLOP/s as a fraction of "
            "the measured matmul rate, and views/s of the augmentations against lightly's. Peak memory "
            "is measured for each configuration in a process of its own; speed with ours and the peer "
            "interleaved in one process, so both see the same machine."
        ),
    )
    p.add_argument("--quick", action="store_true", help="same as --preset quick: smaller models, under 2 minutes on 2 cores")
    p.add_argument(
        "--preset", choices=("full", "quick", "tiny"), default=None,
        help="full (default): ViT-S/16 at 224 px for the backbone row, ViT-S/16 at 112 px for the methods; "
        "quick: ViT-S/16 224 px batch 8 and ViT-Ti/16 at 64 px; tiny: a smoke test of the machinery",
    )
    p.add_argument("--device", default=None, help="cpu (default) or cuda[:i]")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), default=None, help="fp32 (default) or bf16 autocast")
    p.add_argument("--methods", nargs="+", choices=METHOD_NAMES, default=None, help="method rows to run (default: all)")
    p.add_argument("--steps", type=int, default=None, help="timed rounds per row, ours and the peer interleaved (medians count)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps of each before timing")
    p.add_argument("--backbone-batch", type=int, default=None, help="batch of the backbone row")
    p.add_argument("--method-batch", type=int, default=None, help="batch of the method rows")
    p.add_argument("--threads", type=int, default=None, help="torch threads per job (default: torch's)")
    p.add_argument("--isolation", choices=("auto", "forkserver", "spawn", "none"), default=None,
                   help="how jobs get their own process (auto: forkserver on CPU, spawn on CUDA; none: in-process)")
    p.add_argument("--no-data", action="store_true", help="skip the data-pipeline rows")
    p.add_argument("--no-peers", action="store_true", help="measure ours only")
    p.add_argument("--no-flop-check", action="store_true", help="skip the FlopCounterMode cross-check step")
    p.add_argument(
        "--no-lean-backward", action="store_true", help="build our ViT with lean_backward=False (the plain LayerNorm / GELU modules)"
    )
    p.add_argument(
        "--no-fused-optimizer", action="store_true", help="our modules with fused_optimizer=False (torch's default AdamW, as the peers)"
    )
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--json", "--out", dest="json", type=Path, default=None, help="also write the full results as JSON here")
    p.add_argument("--render", type=Path, default=None, metavar="JSON", help="print the report of an earlier --json result instead of measuring")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.render is not None:
        if not args.render.is_file():
            raise FileNotFoundError(f"no benchmark result at {args.render}")
        print(format_report(json.loads(args.render.read_text()), markdown=args.markdown))
        return 0
    if args.quick and args.preset not in (None, "quick"):
        raise ValueError(f"--quick contradicts --preset {args.preset}")
    if args.device is not None:
        from ssl_vit.runtime import resolve_device

        resolve_device(args.device)  # a GPU this machine lacks: one line now, not from the workers
    name = "quick" if args.quick else (args.preset or "full")
    overrides = {
        "device": args.device, "precision": args.precision, "steps": args.steps, "warmup": args.warmup,
        "backbone_batch": args.backbone_batch, "method_batch": args.method_batch,
        "threads": args.threads, "isolation": args.isolation,
        "methods": tuple(args.methods) if args.methods else None,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.no_data:
        overrides["data"] = False
    if args.no_peers:
        overrides["peers"] = False
    if args.no_flop_check:
        overrides["flop_check"] = False
    if args.no_lean_backward:
        overrides["lean_backward"] = False
    if args.no_fused_optimizer:
        overrides["fused_optimizer"] = False
    cfg = preset(name, **overrides)
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but no CUDA device is available")
    from ssl_vit.bench.runner import run_benchmark  # heavy (torch, timm, lightly): after --help

    result = run_benchmark(cfg)
    result["preset"] = name
    print(format_report(result, markdown=args.markdown))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0
