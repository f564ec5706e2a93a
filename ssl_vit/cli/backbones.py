"""``ssl-vit backbones``: the registry, with each architecture's size and compute at a resolution.

The ViT paper compares ViTs, ResNets and hybrids at equal pretraining compute (its Figure 5,
Table 6); this lists what each backbone costs per image, so that equal-compute pairs can be
picked before anything trains::

    ssl-vit backbones --img-size 224 --sort flops
    ssl-vit backbones --img-size 32 --in-chans 1 --arg small_input=true resnet18 hybrid_r18_vit_tiny
    ssl-vit backbones vit --arg embed_dim=128 --arg depth=4 --arg num_heads=4 --img-size 28 --patch-size 7

Backbones are built on the meta device (shapes only: no memory, no compute), so even ViT-H lists
in a moment. FLOPs follow ``ssl_vit.flops`` (matrix products, one multiply-add = 2 FLOPs; half of
it is timm's GMACs); a training pass costs about 3x the forward.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
import yaml

from ssl_vit.backbones.registry import create_backbone, get_spec, list_backbones
from ssl_vit.errors import ArgumentParser, did_you_mean
from ssl_vit.eval.data_args import key_value


@dataclass(frozen=True)
class BackboneSize:
    """One row: ``params`` (all parameters), ``forward_flops`` / ``train_flops`` per image,
    ``tokens`` the Transformer's sequence length (None for a ResNet)."""

    name: str
    params: int
    forward_flops: float
    train_flops: float
    tokens: int | None


def backbone_size(name: str, img_size: int, kwargs: dict[str, Any]) -> BackboneSize:
    """Parameters and FLOPs per image of backbone ``name`` built with ``kwargs`` at ``img_size``
    (on the meta device). Raises the backbone's own error for settings it cannot take."""
    from ssl_vit.flops import backbone_forward_flops, backbone_train_flops

    with torch.device("meta"):
        model = create_backbone(name, **kwargs)
    grid = getattr(model, "grid_size", None)  # ViTs and hybrids: the patch grid
    tokens = None if grid is None else grid[0] * grid[1] + model.num_prefix_tokens
    return BackboneSize(
        name=name,
        params=sum(p.numel() for p in model.parameters()),
        forward_flops=backbone_forward_flops(model, img_size),
        train_flops=backbone_train_flops(model, img_size),
        tokens=tokens,
    )


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="ssl-vit backbones", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help="backbones to list (default: all)")
    parser.add_argument("--img-size", type=int, default=224, help="input resolution in pixels (default 224)")
    parser.add_argument("--patch-size", type=int, default=None, help="patch size of the ViTs (default: each one's own, 16)")
    parser.add_argument("--in-chans", type=int, default=3, help="input channels (default 3; 1 for grey images)")
    parser.add_argument("--arg", dest="args", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                        help="another backbone argument, given to the backbones that take it (e.g. small_input=true for "
                             "the ResNets, embed_dim=128 for `vit`); repeatable")
    parser.add_argument("--sort", choices=("name", "params", "flops"), default="name", help="row order (default: name)")
    parser.add_argument("--no-kwargs", action="store_true", help="leave out each backbone's list of arguments")
    args = parser.parse_args(argv)
    if args.img_size < 1 or args.in_chans < 1 or (args.patch_size is not None and args.patch_size < 1):
        raise ValueError("--img-size, --patch-size and --in-chans must be positive")

    names = args.names or list_backbones()
    for name in names:
        get_spec(name)  # an unknown name lists the known ones
    settings = {"img_size": args.img_size, "in_chans": args.in_chans, **({"patch_size": args.patch_size} if args.patch_size else {})}
    extra = {k: yaml.safe_load(v) for k, v in args.args}  # 128 a number, true a flag, sincos text
    flagged = sorted({"img_size", "in_chans", "patch_size"} & extra.keys())
    if flagged:  # the header and the FLOPs read the flags: an --arg of the same would contradict them
        raise ValueError(f"give {', '.join(flagged)} with its own option ({', '.join('--' + k.replace('_', '-') for k in flagged)}), not --arg")
    taken = {k for name in names for k in get_spec(name).allowed_kwargs()}
    unused = sorted(set(extra) - taken)
    if unused:  # a misspelt --arg would change nothing: say so
        which = f"backbone {names[0]!r} takes no" if len(names) == 1 else "none of these backbones takes the"
        hint = did_you_mean(unused[0], taken) if len(unused) == 1 else ""
        raise ValueError(f"{which} argument(s) {unused}{hint}; {'it accepts' if len(names) == 1 else 'they accept'}: {', '.join(sorted(taken))}")

    rows: list[tuple[str, BackboneSize | str]] = []
    for name in names:
        allowed = set(get_spec(name).allowed_kwargs())
        kwargs = {k: v for k, v in {**settings, **extra}.items() if k in allowed}
        unset = [k for k in get_spec(name).required if k not in extra]
        if unset:  # `vit`, `hybrid`: a shape of one's own, not a size of their own
            if args.names:
                raise ValueError(f"backbone {name!r} has no shape of its own: set {', '.join(unset)} with --arg (e.g. --arg {unset[0]}=...)")
            rows.append((name, f"sized when --arg gives {', '.join(unset)}"))
            continue
        try:
            rows.append((name, backbone_size(name, args.img_size, kwargs)))
        except (TypeError, ValueError) as err:
            if args.names:
                raise ValueError(f"backbone {name!r}: {err}") from None
            rows.append((name, str(err).splitlines()[0]))  # e.g. a size its patch does not divide: listed, not sized

    def order(row: tuple[str, BackboneSize | str]) -> tuple[Any, ...]:
        name, size = row
        if args.sort == "name" or isinstance(size, str):
            return (isinstance(size, str), name)
        return (False, size.params if args.sort == "params" else size.forward_flops, name)

    channels = "1 channel" if args.in_chans == 1 else f"{args.in_chans} channels"
    patch = f", patch {args.patch_size}" if args.patch_size else ""
    print(f"at {args.img_size}x{args.img_size} px, {channels}{patch}; GFLOPs per image (matrix products, "
          "2 per multiply-add): forward, and a training pass (forward + backward)")
    print(f"{'name':<22} {'params':>8} {'fwd':>8} {'train':>8} {'tokens':>6}  description")
    for name, size in sorted(rows, key=order):
        spec = get_spec(name)
        if isinstance(size, str):
            print(f"{name:<22} {'-':>8} {'-':>8} {'-':>8} {'-':>6}  {spec.description} ({size})")
        else:
            tokens = "-" if size.tokens is None else str(size.tokens)
            print(f"{name:<22} {size.params / 1e6:>7.1f}M {size.forward_flops / 1e9:>8.2f} {size.train_flops / 1e9:>8.2f} "
                  f"{tokens:>6}  {spec.description}")
        if not args.no_kwargs:
            print(f"{'':<22} kwargs: {', '.join(spec.allowed_kwargs())}")
    return 0
