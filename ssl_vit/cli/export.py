"""``ssl-vit export SOURCE --out DIR``: the backbone of a pretraining checkpoint, an export folder or
a bare state dict (ours, timm's, an official DINO / MoCo v3 one: ``--arch`` names its architecture)
as ``model.safetensors`` (timm's keys for ViTs, torchvision's for ResNets), ``config.json`` and, with
``--format``, TorchScript / ``torch.export`` / ONNX copies, each checked against the eager backbone."""

import argparse
import json
import sys
from pathlib import Path

from ssl_vit.errors import ArgumentParser


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not a JSON object: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"patch_size\": 4}}', got {text!r}")
    return value


def _earlier_export(out: str) -> str | None:
    """What the folder ``out`` holds already (method, backbone, source), or None."""
    try:
        info = json.loads(Path(out, "config.json").read_text(encoding="utf-8"))["ssl_vit"]
        return (" ".join(str(info[k]) for k in ("method", "backbone") if info.get(k)) or "a backbone") + f" from {info.get('source', 'an unrecorded source')}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none, or a config.json of something else
        return None


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="ssl-vit export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="checkpoint (.ckpt), export folder, or state dict (.safetensors/.pt/.pth)")
    p.add_argument("--out", required=True, help="export folder to write (created; an earlier export there is replaced)")
    p.add_argument("--which", help="student (the online backbone), teacher (DINO's default: the paper evaluates it, §3.1), momentum "
                   "(MoCo v3's) or a method's own NAME_backbone; default: the method's own")
    p.add_argument("--format", nargs="+", choices=["safetensors", "torchscript", "export", "onnx"], default=["safetensors"],
                   help="model.safetensors always; model.torchscript.pt, torch.export's model.pt2, model.onnx on request")
    p.add_argument("--results", nargs="+", default=[], metavar="PATH", help="result JSONs (files, folders) for config.json besides the run's")
    p.add_argument("--arch", help="registered backbone name, for a state dict that does not record it")
    p.add_argument("--backbone-kwargs", type=_json_object, metavar="JSON", help="its kwargs as a JSON object; overrides recorded ones")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max abs difference from the eager outputs a written file may show")
    p.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's)")
    p.add_argument("--weights-only", action="store_true", help="refuse files that need full unpickling (untrusted sources)")
    return p


def main(argv: list[str]) -> int:
    if any(a == "--backbone" or a.startswith("--backbone=") for a in argv):  # as `ssl-vit eval --backbone FILE` names it
        raise ValueError("--backbone: ssl-vit export takes the backbone's file as its first argument (ssl-vit export FILE --out DIR); "
                         "--arch names the architecture of a state dict that does not record it")
    args = build_parser().parse_args(argv)
    from ssl_vit.export import chosen_encoder, export_backbone  # after parsing: --help stays fast

    earlier = _earlier_export(args.out)
    result = export_backbone(args.source, args.out, which=args.which, formats=args.format, results=args.results, backbone=args.arch,
                             backbone_kwargs=args.backbone_kwargs, tolerance=args.tolerance, opset=args.opset, weights_only=args.weights_only or None)
    if earlier:
        print(f"ssl-vit export: note: replaced the export in {args.out} ({earlier})", file=sys.stderr)
    info = result.config["ssl_vit"]
    which = info["which"] if info["which"] != "student" or chosen_encoder(info) else None  # (MPP's only, MoCo v3's default online one: unnamed)
    print(f"exported the {' '.join(str(x) for x in (info['method'], which) if x) or 'state dict'} backbone {info['backbone']} "
          f"({info['img_size'][0]}x{info['img_size'][1]}, {info['in_chans']} channel(s), {info['weights_format']} keys) from {args.source} to {args.out}")
    if "architecture" not in result.config:  # (timm.create_model('local-dir:...') needs one)
        print(f"  note: timm has no architecture for {info['backbone']}: load this export with ssl_vit.load_backbone")
    for path in result.files:  # (config.json: no parity, the results it records)
        print(f"  {path.name:<22} " + (f"max |diff| vs eager {result.parity[path.name]:.2e}" if path.name in result.parity else f"{len(info['results'])} evaluation result(s)"))
    return 0
