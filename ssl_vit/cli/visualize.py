"""``ssl-vit visualize BACKBONE --images DIR_OR_DATASET --out DIR``: the ViT paper's figures.

Writes ``filters.png`` (top principal components of the patch embedding), ``pos_embed.png``
(position-embedding similarity), ``attention_distance.png`` + ``.csv`` (mean attention distance
per layer and head over ``--num-images`` images, 128 as in the paper), ``attention_rollout.png``
and ``attention_dino.png`` (rollout from [CLS], and the last layer's per-head [CLS] attention
thresholded to 60 % of its mass).

BACKBONE is a pretraining checkpoint, an export directory, a state dict (with ``--arch``) or
``random:<name>``; images come from a folder of images or a named dataset's test split.

Example::

    ssl-vit visualize runs/dino/checkpoints/last.ckpt --images fashion_mnist --out figures/dino
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ssl_vit.cli.eval import _json_dict
from ssl_vit.errors import ArgumentParser
from ssl_vit.eval.data_args import DATASETS, datamodule_class, key_value
from ssl_vit.eval.options import check_output_folder


def build_parser() -> argparse.ArgumentParser:
    from ssl_vit.analysis.render import FIGURES

    p = ArgumentParser(prog="ssl-vit visualize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("backbone", help="checkpoint (.ckpt), export dir, state dict, or random:<name>")
    p.add_argument("--images", required=True, help=f"a folder of images, or a dataset: {', '.join(sorted(DATASETS))} "
                   "or the dotted path of a datamodule of your own")
    p.add_argument("--out", required=True, help="output directory for the PNGs and the CSV")
    p.add_argument("--which", default=None, help="encoder of a checkpoint: student, teacher, momentum, or NAME for a method's NAME_backbone (default: the method's own; DINO: teacher)")
    p.add_argument("--arch", default=None, help="registry name for a bare state dict")
    p.add_argument("--backbone-kwargs", type=_json_dict, default=None, help="JSON kwargs (random init, bare state dicts)")
    p.add_argument("--data-arg", type=key_value, action="append", default=[], metavar="KEY=VALUE", help="extra datamodule argument, e.g. root=/data")
    p.add_argument("--figures", nargs="+", choices=FIGURES, default=None, help="default: every figure that applies to the backbone (a ResNet: filters)")
    p.add_argument("--num-images", type=int, default=128, help="images averaged for the mean attention distance")
    p.add_argument("--show", type=int, default=8, help="images drawn in the attention-map figures")
    p.add_argument("--seed", type=int, default=0, help="which images (a seeded random draw)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    for option, value in (("--num-images", args.num_images), ("--show", args.show)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out}: exists and is not a folder; name a folder for the figures")
    check_output_folder(out, f"--out {args.out}")  # before the backbone is loaded and the figures computed (made then)
    import torch
    from torch.utils.data import DataLoader

    from ssl_vit.analysis.render import FIGURES, applicable_figures, missing_for, render_all
    from ssl_vit.eval.data_args import build_datamodule, note_channel_conversion, parse_data_args
    from ssl_vit.eval.run import subsample
    from ssl_vit.export import load_any_backbone
    from ssl_vit.runtime import resolve_device

    extra = dict(args.data_arg)
    if Path(args.images).is_dir():
        name, extra = "imagefolder", {"train_dir": args.images, **extra}
    elif Path(args.images).exists():
        raise ValueError(f"--images {args.images}: a file; name a folder of images or a dataset ({', '.join(sorted(DATASETS))})")
    elif args.images in DATASETS or re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", args.images):  # a name, or a datamodule's dotted path
        name = args.images
        datamodule_class(name, "--images")
        if name == "imagefolder" and "train_dir" not in extra:
            raise ValueError("--images imagefolder needs --data-arg train_dir=DIR; or name the folder itself: --images DIR")
    else:
        raise FileNotFoundError(f"--images {args.images!r} is neither a folder nor a dataset ({', '.join(sorted(DATASETS))})")
    extra = parse_data_args(name, extra)  # before the datamodule compares or opens them
    device = resolve_device(args.device)
    backbone, info = load_any_backbone(args.backbone, which=args.which, backbone=args.arch, backbone_kwargs=args.backbone_kwargs, seed=args.seed)
    backbone = backbone.to(device)
    figures = args.figures
    if figures is None:
        figures = list(applicable_figures(backbone))
        skipped = {f: missing_for(backbone, f) for f in FIGURES if f not in figures}
        reasons = "; ".join(dict.fromkeys(skipped.values()))  # each reason once, in figure order
        if not figures:
            raise ValueError(f"{type(backbone).__name__} has none of what the figures read: {reasons}")
        if skipped:
            print(f"visualize: {type(backbone).__name__} has {reasons}: drawing {', '.join(figures)} (not {', '.join(skipped)})", file=sys.stderr)
    dm = build_datamodule(name, backbone, info, extra, train_subset=None, option="--images")
    train, test = dm.eval_datasets(replace_unreadable=True)  # figures need images, not labels
    note_channel_conversion(test if test is not None else train, backbone.in_chans, "visualize", f"--images {args.images}")
    check_output_folder(out, f"--out {args.out}", create=True)
    pool = subsample(test if test is not None else train, max(args.num_images, args.show), args.seed)
    shown = torch.stack([pool[i][0] for i in range(min(args.show, len(pool)))])  # [S, C, H, W]
    paths = render_all(
        backbone, shown, args.out, mean=dm.mean, std=dm.std, figures=figures, max_images=args.show,
        distance_images=DataLoader(pool, batch_size=64), num_distance_images=args.num_images,
    )
    for fig, path in paths.items():
        print(f"{fig:<24} {path}")
    return 0
