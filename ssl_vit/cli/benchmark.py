"""``ssl-vit benchmark``: see :mod:`ssl_vit.bench`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ssl_vit.bench.config import METHOD_NAMES, RESULT_FORMAT, preset
from ssl_vit.bench.report import format_report
from ssl_vit.errors import ArgumentParser, OptionRule, check_option_values

# The numeric options and the least value each takes (warm-up steps may be none at all).
_AT_LEAST: dict[str, int] = {"steps": 1, "warmup": 0, "backbone_batch": 1, "method_batch": 1, "threads": 1}
# (unset: the preset's value)
_OPTION_RULES: dict[str, OptionRule] = {name: (lambda v, least=least: v is None or v >= least, f">= {least}") for name, least in _AT_LEAST.items()}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
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
    p.add_argument(
        "--compile", action="store_true",
        help="time ours and the peers with every ViT's blocks through torch.compile (inductor; compiled in the warm-up steps, "
        "a minute or more on a CPU); peak memory is still measured without it",
    )
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--json", "--out", dest="json", type=Path, default=None, help="also write the full results as JSON here")
    p.add_argument("--render", type=Path, default=None, metavar="JSON", help="print the report of an earlier --json result instead of measuring")
    return p


def load_result(path: Path) -> dict[str, Any]:
    """An earlier ``--json`` result; anything else is an error naming the file."""
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark result at {path}")

    def not_a_result(why: str) -> ValueError:
        return ValueError(f"{path}: not a benchmark result ({why})")

    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise not_a_result("not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise not_a_result(f"not JSON: {err}") from None
    if not isinstance(result, dict):
        raise not_a_result(f"a JSON {_json_kind(result)}, not an object")
    if result.get("format") != RESULT_FORMAT:
        found = f"format {result['format']!r}" if "format" in result else "no 'format' field"
        raise not_a_result(f"{found}; ssl-vit benchmark --json writes format {RESULT_FORMAT!r}")
    if not isinstance(result.get("config"), dict) or not isinstance(result.get("rows"), list):
        raise not_a_result("no 'config' object or no 'rows' list")
    return result


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool) or value is None:
        return "literal"
    return "number"


def _check_options(args: argparse.Namespace) -> None:
    """The numeric options, before anything is measured."""
    check_option_values(args, _OPTION_RULES)
    methods = args.methods or METHOD_NAMES
    if args.method_batch is not None and args.method_batch < 2 and "mocov3" in methods:
        raise ValueError(
            f"--method-batch {args.method_batch}: the mocov3 row needs a batch of >= 2 (its heads' BatchNorm "
            "normalises over the batch); raise it, or leave mocov3 out with --methods"
        )


def _check_writable(path: Path) -> None:
    """The ``--json`` file can be written: its folder is made now and a file created in it, so
    a bad path fails before the measurements rather than after them."""
    from ssl_vit.eval.options import check_output_folder

    if path.is_dir():
        raise IsADirectoryError(f"--json {path}: is a folder; give the path of a file")
    check_output_folder(path.parent, f"--json {path}", create=True)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.render is not None:
        result = load_result(args.render)
        try:
            report = format_report(result, markdown=args.markdown)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as err:
            what = f"missing {err}" if isinstance(err, KeyError) else str(err)
            raise ValueError(f"{args.render}: not a benchmark result (malformed: {what})") from None
        print(report)
        return 0
    if args.quick and args.preset not in (None, "quick"):
        raise ValueError(f"--quick contradicts --preset {args.preset}")
    _check_options(args)
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
    if args.compile:
        overrides["compile"] = True
    cfg = preset(name, **overrides)
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but no CUDA device is available")
    if args.json is not None:  # the last check: the folder it makes stays
        _check_writable(args.json)
    import importlib.util

    if importlib.util.find_spec("timm") is None:  # the peers are timm's ViT and lightly's timm wrappers
        raise RuntimeError("ssl-vit benchmark measures against timm's ViT and lightly + timm, and timm is not installed: "
                           "pip install 'ssl_vit[bench]' (or pip install timm)")
    from ssl_vit.bench.runner import run_benchmark  # heavy (torch, timm, lightly): after --help

    result = run_benchmark(cfg)
    result["preset"] = name
    if args.json is not None:  # first: the measurements are kept whatever happens next
        from ssl_vit.io import atomic_write_text

        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    print(format_report(result, markdown=args.markdown))
    if args.json is not None:
        print(f"\nwrote {args.json}")
    return 0
