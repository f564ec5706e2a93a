"""``ssl-vit benchmark``: speed and memory of every method's training step against lightly + timm
(:mod:`ssl_vit.bench`), or ``--render`` of an earlier ``--json`` result."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

from ssl_vit import bench
from ssl_vit.errors import ArgumentParser
from ssl_vit.io import atomic_write_text
from ssl_vit.runtime import resolve_device


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="ssl-vit benchmark", description="Training-step throughput and peak memory of each method against the same step "
                       "composed from lightly + timm, the bare backbone against timm's ViT, model FLOP/s as a fraction of the measured matmul "
                       "rate, and views/s of the augmentations against lightly's. Memory: each side in a process of its own; speed: ours and "
                       "the peer interleaved in one process.")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--preset", choices=("full", "quick", "tiny"), default="full", help="full: ViT-S/16 at 224 px for the backbone row and "
                      "at 112 px for the methods (RESULTS.md); quick: ViT-S/16 224 px batch 8 and ViT-Ti/16 at 64 px; tiny: a smoke test")
    size.add_argument("--quick", dest="preset", action="store_const", const="quick", help="--preset quick: under 2 minutes on 2 cores")
    p.add_argument("--device", help="cpu (default) or cuda[:i]")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), help="fp32 (default) or bf16 autocast")
    p.add_argument("--methods", nargs="+", choices=("supervised", "mpp", "mocov3", "dino"), help="method rows to run (default: all)")
    p.add_argument("--steps", type=int, help="timed rounds per row, ours and the peer interleaved (medians count)")
    p.add_argument("--warmup", type=int, help="untimed steps of each before timing")
    p.add_argument("--backbone-batch", type=int, help="batch of the backbone row")
    p.add_argument("--method-batch", type=int, help="batch of the method rows")
    p.add_argument("--threads", type=int, help="torch threads per job (default: torch's)")
    p.add_argument("--isolation", choices=("auto", "forkserver", "spawn", "none"), help="a process per job: auto (forkserver on CPU, spawn on CUDA) or none")
    p.add_argument("--no-data", dest="data", action="store_false", default=None, help="skip the augmentation rows")
    p.add_argument("--no-peers", dest="peers", action="store_false", default=None, help="measure ours only")
    p.add_argument("--no-lean-backward", dest="lean_backward", action="store_false", default=None, help="our ViT with its plain LayerNorm / GELU modules")
    p.add_argument("--no-fused-optimizer", dest="fused_optimizer", action="store_false", default=None, help="ours on torch's default AdamW, as the peers")
    p.add_argument("--compile", action="store_true", default=None, help="time every ViT's blocks through torch.compile (inductor), ours and the "
                   "peers'; compiled in the warm-up (a minute or more on a CPU); memory is measured without it")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--json", "--out", type=Path, help="also write the full result as JSON here")
    p.add_argument("--render", type=Path, metavar="JSON", help="print the report of an earlier --json result instead of measuring")
    args = p.parse_args(argv)
    for name, least in (("steps", 1), ("warmup", 1 if args.compile else 0), ("backbone_batch", 1), ("method_batch", 1), ("threads", 1)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}" + (" with --compile (its first step compiles)" if name == "warmup" else ""))
    if args.method_batch == 1 and "mocov3" in (args.methods or ["mocov3"]):
        p.error("--method-batch 1 cannot train mocov3 (its heads' BatchNorm normalises over the batch): raise it or leave mocov3 out")
    if args.render is not None:
        print(bench.render(args.render, args.markdown))
        return 0
    if args.device is not None:
        resolve_device(args.device)  # a GPU this machine lacks: one line now, not from every job
    if importlib.util.find_spec("timm") is None:
        raise RuntimeError("ssl-vit benchmark measures against timm's ViT, and timm is not installed: pip install 'ssl_vit[bench]'")
    if args.json is not None:  # a path that cannot be written fails now, not after the measurements
        if args.json.is_dir():
            raise IsADirectoryError(f"--json {args.json} is a folder; give a file's path")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.json.parent).close()
    options = {k: tuple(v) if k == "methods" else v for k, v in vars(args).items() if v is not None and k not in ("preset", "markdown", "json", "render")}
    result = {**bench.run_benchmark(bench.preset(args.preset, **options)), "preset": args.preset}
    if args.json is not None:  # first: the measurements are kept whatever happens next
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    print(bench.format_report(result, markdown=args.markdown) + (f"\n\nwrote {args.json}" if args.json else ""))
    return 0
