"""``ssl-vit export SOURCE --out DIR``: the backbone of a checkpoint as an export folder.

SOURCE is a pretraining checkpoint (``.ckpt`` from ``ssl-vit fit``), an export folder, or a bare
state dict (ours, timm's, an official DINO / MoCo v3 checkpoint; then ``--arch`` and
``--backbone-kwargs`` name the architecture). The folder gets ``model.safetensors`` (timm keys for
ViTs, torchvision keys for ResNets), ``config.json`` and, with ``--format``, TorchScript / torch.export (``model.pt2``) / ONNX
copies, each checked against the eager backbone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ssl_vit.errors import ArgumentParser


def _kwargs(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not a JSON object: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"patch_size\": 4}}', got {text!r}")
    return value


def _earlier_export(out: str) -> str | None:
    """What the export folder ``out`` holds already (method, backbone, source), or None."""
    try:
        info = json.loads((Path(out) / "config.json").read_text(encoding="utf-8"))["ssl_vit"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(info, dict):  # a config.json of something else
        return None
    what = " ".join(str(x) for x in (info.get("method"), info.get("backbone")) if x) or "a backbone"
    return f"{what} from {info.get('source', 'an unrecorded source')}"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="ssl-vit export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="checkpoint (.ckpt), export folder, or state dict (.safetensors/.pt/.pth)")
    parser.add_argument("--out", required=True, help="export folder to write (created; an earlier export there is replaced)")
    parser.add_argument(
        "--which",
        default=None,
        help="encoder to export. Default: the method's own: DINO's teacher (the paper evaluates the teacher, §3.1), "
        "otherwise the online backbone (MoCo v3's base encoder). 'student' is the online backbone of "
        "any method; 'momentum' is MoCo v3's momentum encoder; NAME: a method's own NAME_backbone",
    )
    parser.add_argument(
        "--format",
        nargs="+",
        choices=["safetensors", "torchscript", "export", "onnx"],
        default=["safetensors"],
        help="files to write besides config.json; model.safetensors is always written; torchscript: "
        "model.torchscript.pt, export: torch.export's model.pt2, onnx: model.onnx",
    )
    parser.add_argument(
        "--results",
        nargs="+",
        default=[],
        metavar="PATH",
        help="evaluation result JSONs (files or folders) to record in config.json, besides those found in "
        "the checkpoint's run folder",
    )
    parser.add_argument("--arch", dest="backbone", default=None, help="registered backbone name, for state dicts that do not record it")
    parser.add_argument("--backbone-kwargs", type=_kwargs, default=None, metavar="JSON", help="its kwargs as a JSON object; overrides recorded ones")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="max abs difference from the eager outputs a written file may show (float32 reordering "
        "stays far below 1e-4 for these sizes)",
    )
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    parser.add_argument("--weights-only", action="store_true", help="refuse files that need full unpickling (untrusted sources)")
    return parser


def main(argv: list[str]) -> int:
    if any(a == "--backbone" or a.startswith("--backbone=") for a in argv):
        # `ssl-vit eval --backbone FILE` names the file so; here it is the first argument.
        raise ValueError("--backbone: ssl-vit export takes the backbone's file as its first argument "
                         "(ssl-vit export FILE --out DIR); --arch names the architecture of a state dict that does not record it")
    args = build_parser().parse_args(argv)
    from ssl_vit.export import export_backbone  # after parsing: --help stays fast

    earlier = _earlier_export(args.out)

    result = export_backbone(
        args.source,
        args.out,
        which=args.which,
        formats=args.format,
        results=args.results,
        backbone=args.backbone,
        backbone_kwargs=args.backbone_kwargs,
        tolerance=args.tolerance,
        opset=args.opset,
        weights_only=True if args.weights_only else None,
    )
    if earlier:
        print(f"ssl-vit export: note: replaced the export in {args.out} ({earlier})", file=sys.stderr)
    info = result.config["ssl_vit"]
    # The encoder is named unless it is the online backbone a method evaluates by default (MPP's
    # or a supervised run's only one, MoCo v3's base encoder): DINO's teacher or student, MoCo
    # v3's momentum encoder.
    from ssl_vit.eval.results import chosen_encoder

    which = info["which"] if info["which"] != "student" or chosen_encoder(info) else None
    what = " ".join(str(x) for x in (info["method"], which) if x) or "state dict"
    h, w = info["img_size"]
    print(
        f"exported the {what} backbone {info['backbone']} ({h}x{w}, {info['in_chans']} channel(s), "
        f"{info['weights_format']} keys) from {args.source} to {result.out_dir}"
    )
    if "architecture" not in result.config:
        print(f"  note: timm has no architecture for {info['backbone']}: load this export with ssl_vit.load_backbone "
              "(timm.create_model('local-dir:...') needs one)")
    for path in result.files:
        diff = result.parity.get(path.name)
        check = f"max |diff| vs eager {diff:.2e}" if diff is not None else f"{len(info['results'])} evaluation result(s)"
        print(f"  {path.name:<22} {check}")
    return 0
