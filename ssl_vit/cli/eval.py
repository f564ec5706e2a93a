"""``ssl-vit eval {linear,knn,fewshot,frozen,finetune}``: evaluate a backbone and write result JSONs
(``frozen``: the linear probe, kNN and few-shot on one extraction of the features).

The backbone is a pretraining checkpoint, an export directory, a bare state dict (with ``--arch``),
or ``random:<name>`` (the random-init baseline). The data is a named datamodule built at the
backbone's resolution and channels, normalised as the backbone was trained.

Examples::

    ssl-vit eval knn --backbone runs/dino/checkpoints/last.ckpt --data fashion_mnist
    ssl-vit eval linear --backbone exports/dino --data imagefolder \\
        --data-arg train_dir=/data/imagenet/train --data-arg val_dir=/data/imagenet/val --features last4
    ssl-vit eval finetune --backbone exports/mocov3 --data cifar10 --img-size 64 --epochs 10 --export exports/mocov3_cifar10
    ssl-vit eval frozen --backbone runs/mocov3/checkpoints/last.ckpt --out results/
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from ssl_vit.cli import options
from ssl_vit.errors import ArgumentParser, OptionRule, check_option_values


def _at_least(low: int, rule: str = "") -> OptionRule:
    return (lambda v: all(x >= low for x in (v if isinstance(v, list) else [v]) if x is not None), f">= {low}{rule}")


# dest: (valid?, the rule as the message says it), for the options a command has
RULES: dict[str, OptionRule] = {
    **{dest: _at_least(1) for dest in ("batch_size", "epochs", "k", "seeds", "img_size", "checkpoint_every", "devices", "num_nodes")},
    **{dest: _at_least(0) for dest in ("num_workers", "warmup_epochs", "weight_decay")}, "mixup": _at_least(0, " (0: off)"), "cutmix": _at_least(0, " (0: off)"),
    "train_subset": _at_least(1, " (images)"), "test_subset": _at_least(1, " (images)"), "shots": _at_least(1, " each"),
    "probe_batch_size": _at_least(2, " (the probe's BatchNorm needs two examples)"), "temperature": (lambda v: v > 0, "> 0"), "l2": (lambda v: v > 0, "> 0"),
    "lr": (lambda v: v is None or all(x > 0 for x in (v if isinstance(v, list) else [v])), "> 0"), "max_steps": (lambda v: v == -1 or v >= 1, "-1 (no cap) or >= 1"),
    "select_fraction": (lambda v: v is None or 0 < v < 1, "in (0, 1)"), "layer_decay": (lambda v: 0 < v <= 1, "in (0, 1] (1: no decay)"),
    "drop_path": (lambda v: 0 <= v < 1, "in [0, 1)"), "label_smoothing": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "random_erasing": (lambda v: 0 <= v <= 1, "a probability in [0, 1] (0: off)"), "crop_scale": (lambda v: v is None or 0 < v[0] <= v[1] <= 1, "LO HI with 0 < LO <= HI <= 1"),
    "rand_augment": (lambda v: v is None or (v[0] >= 1 and 0 <= v[1] <= 30), "OPS MAGNITUDE with OPS >= 1 and MAGNITUDE in 0..30"),
}
# The options of runs on images, as left unset; every command has them (and those of finetune).
IMAGE_RUN = {"crop_scale": None, "run_dir": None, "resume": False, "checkpoint_every": 500, "max_steps": -1, "devices": 1, "num_nodes": 1}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="ssl-vit eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="protocol", required=True, metavar="{linear,knn,fewshot,frozen,finetune}")
    parts = {name: argparse.ArgumentParser(add_help=False) for name in ("common", "features", "linear", "sweep", "knn", "fewshot", "images")}
    parts["common"].set_defaults(**IMAGE_RUN, augment=False, select_fraction=None, img_size=None, export=None, features="cls")
    add = parts["common"].add_argument
    add("--backbone", required=True, help="checkpoint (.ckpt), export dir, state dict, or random:<name>")
    add("--which", help="encoder of a checkpoint: student, teacher, momentum, or NAME for a method's NAME_backbone (default: the method's; DINO: teacher)")
    add("--arch", help="registry name for a bare state dict")
    add("--backbone-kwargs", type=options.json_object, help="JSON kwargs (random init, bare state dicts, or overrides)")
    add("--method", help="the method the results name for weights that record none (a bare state dict, e.g. supervised)")
    add("--data", default="fashion_mnist", metavar="NAME", help=f"{', '.join(sorted(options.DATASETS))}, or the dotted path of a datamodule of your own")
    add("--data-arg", type=options.key_value, action="append", default=[], metavar="KEY=VALUE", help="extra datamodule argument (repeatable), e.g. root=/data")
    add("--train-subset", type=int, help="a fixed random subset of the training split")
    add("--test-subset", type=int, help="a fixed random subset of the test split")
    add("--batch-size", type=int, default=256, help="images per forward pass of the feature extraction; fine-tuning: per process and step")
    add("--num-workers", type=int, default=2)
    add("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    add("--precision", choices=["32-true", "bf16-mixed", "16-mixed"], default="32-true", help="of the backbone's passes and the training (16-mixed: CUDA)")
    add("--seed", type=int, default=0)
    add("--out", default="results", help="folder for the result JSONs (named after method, backbone, data and protocol), or a file name ending in .json")
    parts["features"].add_argument("--features", choices=["cls", "last4", "avg", "cls_avg"], default="cls", help="representation: the backbone's output ([CLS], or its global_pool); the last 4 [CLS] (DINO ViT-S); the mean patch token; [CLS] + mean (DINO ViT-B)")
    add = parts["linear"].add_argument
    add("--epochs", type=int, default=100)
    add("--lr", type=float, nargs="+", help="base LR per 256 examples (default: 0.01 with sgd, 0.1 with lars, MAE's); several: a sweep, one head per LR on the same batches, the LR picked on held-out training features (--select-fraction), then trained on all of them")
    add("--optimizer", choices=["sgd", "lars"], default="sgd")
    add("--warmup-epochs", type=int, default=10, help="linear LR warm-up before the cosine decay (MAE: 10 of 90 epochs)")
    add("--probe-batch-size", type=int, default=256, help="examples per step of the linear probe (with --augment: per process)")
    parts["sweep"].add_argument("--select-fraction", type=float, help="share of the training features held out to pick a sweep's LR or k (default 0.1)")
    add = parts["knn"].add_argument
    add("--k", type=int, nargs="+", default=[20], help="neighbours that vote (DINO: 20); several (DINO's table: 10 20 100 200): a sweep, k picked on held-out training features, every k's test top-1 recorded too")
    add("--temperature", type=float, default=0.07, help="vote weight exp(similarity / T) (DINO: 0.07)")
    add = parts["fewshot"].add_argument
    add("--shots", type=int, nargs="+", default=[1, 5, 10, 25], help="training examples per class in a support set (ViT paper: 1 5 10 25)")
    add("--seeds", type=int, default=5, help="support-set draws per shot count")
    add("--l2", type=float, default=2.0**10, help="ridge (L2) weight of the closed-form least squares")
    add = parts["images"].add_argument_group("training on images").add_argument
    add("--crop-scale", type=float, nargs=2, metavar=("LO", "HI"), help="area range of the random resized crop (+ flip); default 0.08 1 (DeiT/MAE/MoCo v3/DINO) from 96 px on, 0.5 1 below")
    add("--run-dir", help="checkpoint the run into RUN_DIR/checkpoints (atomically; SIGTERM/SIGUSR1 save and stop)")
    add("--resume", action="store_true", help="continue the run in --run-dir from its newest checkpoint")
    add("--checkpoint-every", type=int, default=500, help="steps between checkpoints (with --run-dir)")
    add("--max-steps", type=int, default=-1, help="stop after this many optimiser steps (the LR schedule follows)")
    add("--devices", type=int, default=1, help="processes on this machine (DDP); the batch size is per process")
    add("--num-nodes", type=int, default=1, help="machines (DDP under torchrun or SLURM, --devices processes on each)")
    common, features, linear, sweep, knn, fewshot, images = parts.values()  # (fine-tuning classifies from the backbone's own output)
    p = sub.add_parser("linear", parents=[common, features, linear, sweep, images], help="linear probe on frozen features; --augment: on augmented images")
    p.add_argument("--augment", action="store_true", help="the papers' protocol (recorded as linear_aug): each step a random resized crop and flip of each image through the frozen backbone (the options of 'training on images')")
    sub.add_parser("knn", parents=[common, features, knn, sweep], help="DINO's weighted kNN on L2-normalised features")
    sub.add_parser("fewshot", parents=[common, features, fewshot], help="the ViT paper's closed-form few-shot regression")
    p = sub.add_parser("frozen", parents=[common, features, linear, knn, sweep, fewshot], help="linear probe, kNN and few-shot on one extraction of the features")
    p.add_argument("--protocols", nargs="+", choices=["linear", "knn", "fewshot"], default=["linear", "knn", "fewshot"], help="the protocols to run")
    add = sub.add_parser("finetune", parents=[common, images], help="full fine-tuning with layer-wise LR decay").add_argument
    add("--epochs", type=int, default=10)
    add("--lr", type=float, default=5e-4, help="base LR per 256 examples")
    add("--layer-decay", type=float, default=0.65, help="layer-wise LR decay (MAE ViT-B: 0.65 with --lr 5e-4; ViT-L: 0.75 with 1e-3)")
    for flag, default in (("--drop-path", 0.1), ("--label-smoothing", 0.1), ("--weight-decay", 0.05)):
        add(flag, type=float, default=default)
    add("--warmup-epochs", type=float, default=5.0, help="linear LR warm-up before the cosine decay (MAE: 5 of 100 epochs)")
    add("--img-size", type=int, help="fine-tune at another resolution (position embedding interpolated)")
    add("--no-augment", action="store_true", help="train on the evaluation transform (resize + centre crop) instead")
    add("--mixup", type=float, default=0.0, help="MixUp alpha (MAE: 0.8; 0: off)")
    add("--cutmix", type=float, default=0.0, help="CutMix alpha (MAE: 1.0; 0: off); with both, one per batch")
    add("--rand-augment", type=int, nargs=2, metavar=("OPS", "MAGNITUDE"), help="RandAugment on the training crops (MAE: 2 9); off when not given")
    add("--random-erasing", type=float, default=0.0, help="probability of erasing a random box of each image with noise (MAE: 0.25)")
    add("--compile", action="store_true", help="torch.compile (inductor) the backbone one block at a time: for GPUs")
    add("--export", metavar="DIR", help="write the fine-tuned model as an export folder: backbone + classifier in model.safetensors (timm.create_model('local-dir:DIR', pretrained=True) builds the classifier), config.json with its result")
    add("--export-format", nargs="+", default=["safetensors"], choices=["safetensors", "torchscript", "export", "onnx"], help="also the traced backbone (without the classifier), as ssl-vit export --format")
    return parser


def settings(args: argparse.Namespace, protocol: str) -> Any:
    """A protocol's settings from the options (its seed is the evaluation's: ``--seed``)."""
    from ssl_vit.eval.evaluate import SETTINGS

    one, picked = (lambda v: v[0] if v and len(v) == 1 else v), ({} if args.select_fraction is None else {"select_fraction": args.select_fraction})
    if protocol == "linear":
        return SETTINGS[protocol](epochs=args.epochs, batch_size=args.probe_batch_size, base_lr=one(args.lr), optimizer=args.optimizer,
                                  warmup_epochs=args.warmup_epochs, **picked)
    if protocol == "knn":
        return SETTINGS[protocol](k=one(args.k), temperature=args.temperature, **picked)
    if protocol == "fewshot":
        return SETTINGS[protocol](shots=args.shots, num_seeds=args.seeds, l2_reg=args.l2)
    run = dict(epochs=args.epochs, warmup_epochs=args.warmup_epochs, crop_scale=args.crop_scale and tuple(args.crop_scale), max_steps=args.max_steps,
               checkpoint_every=args.checkpoint_every)
    if protocol == "linear_aug":
        return SETTINGS[protocol](**run, batch_size=args.probe_batch_size, base_lr=one(args.lr), optimizer=args.optimizer)
    return SETTINGS[protocol](**run, batch_size=args.batch_size, base_lr=args.lr, layer_decay=args.layer_decay, drop_path_rate=args.drop_path,
                              label_smoothing=args.label_smoothing, weight_decay=args.weight_decay, mixup_alpha=args.mixup, cutmix_alpha=args.cutmix,
                              rand_augment=args.rand_augment and tuple(args.rand_augment), random_erasing=args.random_erasing,
                              augment=not args.no_augment, compile_backbone=args.compile)


def trainer_devices(device: str, count: int) -> int | list[int]:
    """Lightning's ``devices`` for ``--device`` and ``--devices``: ``cuda:1`` is that GPU."""
    if ":" in device and count > 1:
        raise ValueError(f"--device {device} names one GPU; with --devices {count} use --device cuda (the first GPUs; CUDA_VISIBLE_DEVICES picks others)")
    return [int(device.split(":", 1)[1])] if ":" in device else count


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_option_values(args, RULES)  # before any note or work
    data_args = options.parse_data_args(args.data, dict(args.data_arg))  # a misspelt name or value: before the backbone loads
    protocols = args.protocols if args.protocol == "frozen" else ["linear_aug" if args.augment else args.protocol]
    if args.select_fraction is not None and not any(p in protocols and len(getattr(args, o, None) or []) > 1 for p, o in (("linear", "lr"), ("knn", "k"))):
        raise ValueError("--select-fraction: holds out features to pick the LR (--lr) or k (--k) of a sweep; give several, or leave it out")
    if args.augment and len(args.lr or []) > 1:
        raise ValueError("--lr: a sweep of several LRs is for the probe on fixed features; with --augment give one")
    if args.protocol == "linear" and not args.augment and (given := [f"--{k.replace('_', '-')}" for k, v in IMAGE_RUN.items() if getattr(args, k) != v]):
        raise ValueError(f"{', '.join(given)}: options of a linear probe trained on images; add --augment, or leave them out for the probe on features extracted once")
    if args.resume and (args.run_dir is None or not any(Path(args.run_dir, "checkpoints").glob("*.ckpt"))):
        raise ValueError(f"--resume needs the --run-dir of the {protocols[0]} run to continue, which holds its checkpoints")
    from lightning.pytorch.utilities import rank_zero_only

    first = rank_zero_only.rank == 0  # (the processes of --devices N run this too)
    if first and set(protocols) & {"linear", "linear_aug", "finetune"} and args.epochs <= args.warmup_epochs:
        what = "fine-tuning" if args.protocol == "finetune" else "the linear probe"
        print(f"ssl-vit eval: note: {what}'s {args.warmup_epochs:g} warm-up epochs cover its whole run of {args.epochs}: its LR only rises "
              "(--warmup-epochs sets fewer)", file=sys.stderr)
    options.check_out(args.out)  # where the results and the fine-tuned model go: checked now, not found unwritable after the run
    if args.export is not None:
        options.check_export(args.export, args.backbone)

    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.features import feature_dim
    from ssl_vit.eval.finetune import finetuned_architecture, new_head
    from ssl_vit.eval.train_run import EvalRunInterrupted, ImageRun
    from ssl_vit.export import save_backbone
    from ssl_vit.export.load import recorded_normalization, resolve, source_info
    from ssl_vit.runtime import resolve_device

    evaluation = Evaluation(protocols, features=args.features, which=args.which, **{p: settings(args, p) for p in protocols}, batch_size=args.batch_size,
                            train_subset=args.train_subset, test_subset=args.test_subset, seed=args.seed)
    device = resolve_device(args.device)
    if args.precision == "16-mixed" and not device.startswith("cuda"):
        raise ValueError("--precision 16-mixed needs a CUDA device; on a CPU use bf16-mixed or 32-true")
    backbone, source = resolve(args.backbone, "cpu", args.which, args.arch, args.backbone_kwargs, args.seed)
    info = source_info(source, backbone)
    if args.method is not None and info["method"] is not None and args.method.lower() != str(info["method"]).lower():
        raise ValueError(f"--method {args.method}: {args.backbone} is {'a random initialisation' if source.kind == 'random' else 'recorded'} as method "
                         f"{info['method']}; --method names the method of weights that record none (a bare state dict): leave it out")
    info["method"] = info["method"] or args.method
    try:  # a read-out this backbone lacks: said before any data is read
        feature_dim(backbone, args.features)
    except ValueError as err:
        raise ValueError(f"--features {args.features}: {err}") from None
    dm = options.build_datamodule(args.data, backbone, info, data_args, args.img_size)
    dm.num_workers = args.num_workers
    if first:
        options.note_channel_conversion(dm.eval_datasets()[0], backbone.in_chans, "ssl-vit eval", f"--data {args.data}")
    options.check_out(args.out, create=True)
    if args.export is not None:
        options.check_export(args.export, args.backbone, create=True)
    head = new_head(backbone.embed_dim, dm.num_classes, seed=args.seed) if args.protocol == "finetune" else None  # trained in place: --export
    image_run = ImageRun("gpu" if device.startswith("cuda") else "cpu", trainer_devices(device, args.devices), args.num_nodes, args.precision,
                         args.num_workers, args.seed, resume=args.resume)
    try:
        results = evaluation.run(backbone, info, dm, args.out, device=device, image_run=image_run, run_dirs=dict.fromkeys(protocols, args.run_dir), head=head)
    except EvalRunInterrupted as stop:
        if stop.rank == 0:
            print(f"ssl-vit eval: {stop}; continue with the same command and --resume", file=sys.stderr)
        return 128 + int(getattr(signal, stop.signal_name, signal.SIGTERM))
    for result, path in results:
        print(f"{result.summary_line()}\n  -> {path}")
    if results and args.export is not None:  # the fine-tuned backbone and classifier, saying what the run's checkpoints say
        _, source.backbone_kwargs = finetuned_architecture(backbone)  # (another --img-size resampled the position embedding)
        source.method, source.data = f"{info['method']}+finetune", {"name": results[0][0].data["name"], "mean": list(dm.mean), "std": list(dm.std)}
        source.normalization = recorded_normalization(source.data, {})
        out = save_backbone(backbone, args.export, source, formats=args.export_format, results=[results[0][1]], head=head)
        print(f"  -> {out.out_dir} (fine-tuned backbone + {head.out_features}-class classifier)")
    return 0
