"""``ssl-vit benchmark`` (:mod:`ssl_vit.bench`), or ``--render`` of an earlier ``--json`` result."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from ssl_vit import bench
from ssl_vit.errors import ArgumentParser
from ssl_vit.io import atomic_write_text
from ssl_vit.runtime import resolve_device


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="ssl-vit benchmark", description="Training steps against lightly + timm: speed, peak memory, FLOP/s of the matmul rate.")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--preset", choices=bench.PRESETS, default="full", help="full: RESULTS.md's (ViT-S/16 at 224 and 112 px); tiny: a smoke test")
    size.add_argument("--quick", dest="preset", action="store_const", const="quick", help="--preset quick: under 2 minutes on 2 cores")
    p.add_argument("--device", help="cpu (default) or cuda[:i]")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), help="fp32 (default) or bf16 autocast")
    p.add_argument("--methods", nargs="+", choices=bench.METHODS, help="method rows to run (default: all)")
    for option, text in (("--steps", "timed rounds per row"), ("--warmup", "untimed steps first"), ("--backbone-batch", "batch of the backbone row"),
                         ("--method-batch", "batch of the method rows"), ("--threads", "torch threads per job (default: torch's)")):
        p.add_argument(option, type=int, help=text)
    p.add_argument("--isolation", choices=("auto", "forkserver", "spawn", "none"), help="a process per job: auto (forkserver on CPU, spawn on CUDA) or none")
    for option, dest, text in (("--no-data", "data", "skip the worker row"), ("--no-peers", "peers", "measure ours only"), ("--no-lean-backward",
                               "lean_backward", "our ViT's plain LayerNorm / GELU"), ("--no-fused-optimizer", "fused_optimizer", "ours on torch's default AdamW")):
        p.add_argument(option, dest=dest, action="store_false", default=None, help=text)
    p.add_argument("--feed", action="store_true", default=None, help="also DINO at the multi-crop sizes fed by the real loader (views on the device) vs ready-made input")
    p.add_argument("--feed-workers", type=int, help="the feed row's loader workers (default 8)")
    p.add_argument("--compile", action="store_true", default=None, help="time every ViT's blocks compiled (inductor, in the warm-up), ours and the peers'")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--json", "--out", type=Path, help="also write the full result as JSON here")
    p.add_argument("--render", type=Path, metavar="JSON", help="print the report of an earlier --json result instead of measuring")
    args = p.parse_args(argv)
    if low := [o for o in ("steps", "backbone_batch", "method_batch", "threads", "feed_workers") if getattr(args, o) is not None and getattr(args, o) < 1]:
        p.error(f"--{low[0].replace('_', '-')} must be >= 1")
    if args.render is not None:
        print(bench.render(args.render, args.markdown))
        return 0
    resolve_device(args.device or "cpu")  # a GPU this machine lacks: one line now, not from every job
    if args.json is not None:  # a path that cannot be written fails now, not after the measurements
        if args.json.is_dir():
            raise IsADirectoryError(f"--json {args.json} is a folder; give a file's path")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.json.parent).close()
    options = {k: tuple(v) if k == "methods" else v for k, v in vars(args).items() if v is not None and k not in ("preset", "markdown", "json", "render")}
    result = {**bench.run_benchmark(dataclasses.replace(bench.PRESETS[args.preset], **options)), "preset": args.preset}
    if args.json is not None:  # first: the measurements are kept whatever happens next
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    print(bench.format_report(result, markdown=args.markdown) + (f"\n\nwrote {args.json}" if args.json else ""))
    return 0
