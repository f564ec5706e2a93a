"""``ssl-vit backbones``: each architecture's size and compute per image at a resolution, so that
pairs of equal compute (the ViT paper's comparison, its Figure 5 and Table 6) can be picked::

    ssl-vit backbones --img-size 224 --sort flops
    ssl-vit backbones --img-size 32 --in-chans 1 --arg small_input=true resnet18 hybrid_r18_vit_tiny
    ssl-vit backbones vit --arg embed_dim=128 --arg depth=4 --arg num_heads=4 --img-size 28 --patch-size 7

FLOPs are measured on the meta device (``ssl_vit.flops.backbone_flops``: matrix products, 2 per
multiply-add, so half of it is timm's GMACs); a training pass costs about 3x the forward.
"""

import argparse
from typing import Any, NamedTuple

import torch
import yaml

from ssl_vit.backbones import create_backbone, get_spec, list_backbones
from ssl_vit.cli.options import key_value
from ssl_vit.errors import ArgumentParser, did_you_mean, one_line
from ssl_vit.flops import backbone_flops


class BackboneSize(NamedTuple):
    params: int  # all parameters
    forward_flops: float  # per image
    train_flops: float  # forward + backward, per image
    tokens: int | None  # the Transformer's sequence length (None for a ResNet)


def backbone_size(name: str, img_size: int, kwargs: dict[str, Any]) -> BackboneSize:
    """Parameters and FLOPs per image of backbone ``name`` built with ``kwargs`` (on the meta device)."""
    with torch.device("meta"):
        model = create_backbone(name, **kwargs)
    grid = getattr(model, "grid_size", None)
    return BackboneSize(sum(p.numel() for p in model.parameters()), *backbone_flops(model, img_size), grid and grid[0] * grid[1] + 1)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="ssl-vit backbones", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help="backbones to list (default: all)")
    parser.add_argument("--img-size", type=int, default=224, help="input resolution in pixels (default 224)")
    parser.add_argument("--patch-size", type=int, default=None, help="patch size of the ViTs (default: each one's own, 16)")
    parser.add_argument("--in-chans", type=int, default=3, help="input channels (default 3; 1 for grey images)")
    parser.add_argument("--arg", dest="args", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                        help="a backbone argument for those that take it (small_input=true for ResNets, embed_dim=128 for `vit`); repeatable")
    parser.add_argument("--sort", choices=("name", "params", "flops"), default="name", help="row order (default: name)")
    parser.add_argument("--no-kwargs", action="store_true", help="leave out each backbone's list of arguments")
    args = parser.parse_args(argv)
    specs = {name: get_spec(name) for name in args.names or list_backbones()}  # an unknown name lists the known ones
    extra = {k: yaml.safe_load(v) for k, v in args.args}  # 128 a number, true a flag, sincos text
    taken = {k for spec in specs.values() for k in spec.allowed_kwargs()} - {"img_size", "in_chans", "patch_size"}
    if unknown := sorted(set(extra) - taken):  # a misspelt --arg would change nothing, and one of the options would contradict the header
        raise ValueError(f"--arg {', '.join(unknown)}: no argument of {'backbone ' + repr(next(iter(specs))) if len(specs) == 1 else 'these backbones'}"
                         f"{did_you_mean(unknown[0], taken) if len(unknown) == 1 else ''}; --arg takes {', '.join(sorted(taken))} "
                         "(and --img-size, --in-chans, --patch-size their own)")
    settings = {"img_size": args.img_size, "in_chans": args.in_chans, **({"patch_size": args.patch_size} if args.patch_size else {}), **extra}
    rows = {}  # name -> (sort key, cells, note)
    for name, spec in specs.items():
        try:
            if unset := [k for k in spec.required if k not in extra]:  # `vit`, `hybrid`: no shape of their own
                raise ValueError(f"no shape of its own: set {', '.join(unset)} with --arg")
            size = backbone_size(name, args.img_size, {k: v for k, v in settings.items() if k in spec.allowed_kwargs()})
            rows[name] = ((0, {"params": size.params, "flops": size.forward_flops}.get(args.sort, 0)),
                          [f"{size.params / 1e6:.1f}M", f"{size.forward_flops / 1e9:.2f}", f"{size.train_flops / 1e9:.2f}", size.tokens or "-"], "")
        except (TypeError, ValueError) as err:
            if args.names:
                raise ValueError(f"backbone {name!r}: {err}") from None
            rows[name] = ((1, 0), ["-"] * 4, f" ({one_line(str(err))})")  # e.g. a size its patch does not divide: listed, not sized
    print(f"at {args.img_size}x{args.img_size} px, {args.in_chans} channel{'s' * (args.in_chans != 1)}{f', patch {args.patch_size}' * bool(args.patch_size)}; "
          "GFLOPs per image (matrix products, 2 per multiply-add): forward, and a training pass (forward + backward)")
    print(f"{'name':<22} {'params':>8} {'fwd':>8} {'train':>8} {'tokens':>6}  description")
    for name, (_, cells, note) in sorted(rows.items(), key=lambda row: (row[1][0], row[0])):
        print(f"{name:<22} {cells[0]:>8} {cells[1]:>8} {cells[2]:>8} {cells[3]:>6}  {specs[name].description}{note}"
              + ("" if args.no_kwargs else f"\n{'':<22} kwargs: {', '.join(specs[name].allowed_kwargs())}"))
    return 0
