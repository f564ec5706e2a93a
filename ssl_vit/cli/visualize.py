"""``ssl-vit visualize BACKBONE --images DATA --out DIR``: the figures of ``ssl_vit.analysis`` (PNGs;
the mean attention distance also as CSV) of a backbone, drawn from a folder of images or a dataset.

Example::

    ssl-vit visualize runs/dino/checkpoints/last.ckpt --images fashion_mnist --out figures/dino
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from torch.utils.data import DataLoader

from ssl_vit.analysis import render
from ssl_vit.cli import options
from ssl_vit.errors import ArgumentParser, check_option_values
from ssl_vit.eval.evaluate import subsample
from ssl_vit.export import load_any_backbone
from ssl_vit.runtime import resolve_device


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="ssl-vit visualize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("backbone", help="checkpoint (.ckpt), export folder, state dict, or random:<name>")
    p.add_argument("--images", required=True, help=f"a folder of images, a dataset ({', '.join(sorted(options.DATASETS))}) or a datamodule's dotted path")
    p.add_argument("--out", required=True, help="folder for the PNGs and the CSV")
    p.add_argument("--which", help="encoder of a checkpoint: student, teacher, momentum, or NAME for a method's NAME_backbone (default: the method's own; DINO: teacher)")
    p.add_argument("--arch", help="registry name for a bare state dict")
    p.add_argument("--backbone-kwargs", type=options.json_object, help="JSON kwargs (random init, bare state dicts)")
    p.add_argument("--data-arg", type=options.key_value, action="append", default=[], metavar="KEY=VALUE", help="extra datamodule argument, e.g. root=/data")
    p.add_argument("--figures", nargs="+", choices=render.FIGURES, help="default: every figure that applies to the backbone (a ResNet: filters)")
    p.add_argument("--num-images", type=int, default=128, help="images averaged for the mean attention distance (the ViT paper: 128)")
    p.add_argument("--show", type=int, default=8, help="images drawn in the attention-map figures")
    p.add_argument("--seed", type=int, default=0, help="which images (a seeded draw); a random backbone's initialisation")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_option_values(args, {"num_images": (lambda v: v >= 1, ">= 1"), "show": (lambda v: v >= 1, ">= 1")})
    out = Path(args.out).expanduser()
    options.check_output_folder(out, f"--out {args.out}")  # before any work
    name, data_args = args.images, dict(args.data_arg)
    if Path(name).is_dir():
        name, data_args = "imagefolder", {"train_dir": name, **data_args}
    elif Path(name).exists() or not re.fullmatch(r"[A-Za-z_][\w.]*", name):  # not a dataset's name or a dotted path
        raise ValueError(f"--images {name}: not a folder of images, a dataset ({', '.join(sorted(options.DATASETS))}) or a datamodule's dotted path")
    elif name == "imagefolder" and "train_dir" not in data_args:
        raise ValueError("--images imagefolder needs --data-arg train_dir=DIR; or name the folder itself: --images DIR")
    data_args = options.parse_data_args(name, data_args, "--images")
    device = resolve_device(args.device)
    backbone, info = load_any_backbone(args.backbone, which=args.which, backbone=args.arch, backbone_kwargs=args.backbone_kwargs, seed=args.seed)
    figures = args.figures or render.applicable_figures(backbone)
    if not args.figures and (skipped := [f for f in render.FIGURES if f not in figures]):
        lacks = "; ".join(dict.fromkeys(render.missing_for(backbone, f) for f in skipped))  # each reason once
        if not figures:
            raise ValueError(f"{type(backbone).__name__} has none of what the figures read: {lacks}")
        print(f"visualize: {type(backbone).__name__} has {lacks}: drawing {', '.join(figures)} (not {', '.join(skipped)})", file=sys.stderr)
    dm = options.build_datamodule(name, backbone, info, data_args, option="--images")
    train, test = dm.eval_datasets(replace_unreadable=True)  # figures need images, not labels
    images = test if test is not None else train
    options.note_channel_conversion(images, backbone.in_chans, "visualize", f"--images {args.images}")
    options.check_output_folder(out, f"--out {args.out}", create=True)
    pool = subsample(images, max(args.num_images, args.show), args.seed)
    shown, _ = next(iter(DataLoader(pool, batch_size=args.show)))  # [S, C, H, W]
    paths = render.render_all(backbone.to(device), shown, out, mean=dm.mean, std=dm.std, figures=figures, max_images=args.show,
                              distance_images=DataLoader(pool, batch_size=64), num_distance_images=args.num_images)
    print("\n".join(f"{figure:<24} {path}" for figure, path in paths.items()))
    return 0
