"""``ssl-vit eval {linear,knn,fewshot,frozen,finetune}``: evaluate a backbone and write result JSONs
(``frozen``: the linear probe, kNN and few-shot on one extraction of the features).

The backbone is a pretraining checkpoint, an export directory, a bare state dict (with ``--arch``),
or ``random:<name>`` (the random-init baseline). The data is a named datamodule built at the
backbone's resolution and channels, normalised as the backbone was trained.

Examples::

    ssl-vit eval knn --backbone runs/dino/checkpoints/last.ckpt --data fashion_mnist
    ssl-vit eval linear --backbone exports/dino --data imagefolder \\
        --data-arg train_dir=/data/imagenet/train --data-arg val_dir=/data/imagenet/val --features last4
    ssl-vit eval linear --augment --backbone exports/dino --data imagefolder ... --features last4 --run-dir runs/dino_linear
    ssl-vit eval finetune --backbone exports/mocov3 --data cifar10 --img-size 64 --epochs 10 --export exports/mocov3_cifar10
    ssl-vit eval fewshot --backbone random:vit_tiny --backbone-kwargs '{"img_size": 28, "patch_size": 4, "in_chans": 1}'
    ssl-vit eval frozen --backbone runs/mocov3/checkpoints/last.ckpt --out results/
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from ssl_vit.cli.options import (
    DATASETS,
    build_datamodule,
    check_output_folder,
    datamodule_class,
    json_object,
    key_value,
    note_channel_conversion,
    parse_data_args,
)
from ssl_vit.errors import ArgumentParser, OptionRule, check_option_values

# dest: (valid?, the rule as the message says it); checked for the options a protocol has.
RULES: dict[str, OptionRule] = {
    "batch_size": (lambda v: v >= 1, ">= 1"), "num_workers": (lambda v: v >= 0, ">= 0"), "epochs": (lambda v: v >= 1, ">= 1"),
    "train_subset": (lambda v: v is None or v >= 1, ">= 1 (images)"), "test_subset": (lambda v: v is None or v >= 1, ">= 1 (images)"),
    "lr": (lambda v: v is None or all(x > 0 for x in (v if isinstance(v, list) else [v])), "> 0"),
    "select_fraction": (lambda v: v is None or 0 < v < 1, "in (0, 1)"), "warmup_epochs": (lambda v: v >= 0, ">= 0"),
    "probe_batch_size": (lambda v: v >= 2, ">= 2 (the probe's BatchNorm needs two examples)"), "k": (lambda v: all(k >= 1 for k in v), ">= 1"),
    "temperature": (lambda v: v > 0, "> 0"), "shots": (lambda v: all(s >= 1 for s in v), ">= 1 each"), "seeds": (lambda v: v >= 1, ">= 1"),
    "l2": (lambda v: v > 0, "> 0"), "layer_decay": (lambda v: 0 < v <= 1, "in (0, 1] (1: no decay)"), "drop_path": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "label_smoothing": (lambda v: 0 <= v < 1, "in [0, 1)"), "weight_decay": (lambda v: v >= 0, ">= 0"), "mixup": (lambda v: v >= 0, ">= 0 (0: off)"),
    "cutmix": (lambda v: v >= 0, ">= 0 (0: off)"), "random_erasing": (lambda v: 0 <= v <= 1, "a probability in [0, 1] (0: off)"),
    "rand_augment": (lambda v: v is None or (v[0] >= 1 and 0 <= v[1] <= 30), "OPS MAGNITUDE with OPS >= 1 and MAGNITUDE in 0..30"),
    "img_size": (lambda v: v is None or v >= 1, ">= 1"), "crop_scale": (lambda v: v is None or 0 < v[0] <= v[1] <= 1, "LO HI with 0 < LO <= HI <= 1"),
    "max_steps": (lambda v: v == -1 or v >= 1, "-1 (no cap) or >= 1"), "checkpoint_every": (lambda v: v >= 1, ">= 1"),
    "devices": (lambda v: v >= 1, ">= 1"), "num_nodes": (lambda v: v >= 1, ">= 1"),
}
IMAGE_RUN = ("crop_scale", "run_dir", "resume", "checkpoint_every", "max_steps", "devices", "num_nodes")  # the options of runs on images


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="ssl-vit eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="protocol", required=True, metavar="{linear,knn,fewshot,frozen,finetune}")
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("backbone")
    g.add_argument("--backbone", required=True, help="checkpoint (.ckpt), export dir, state dict, or random:<name>")
    g.add_argument("--which", help="encoder of a checkpoint: student, teacher, momentum, or NAME for a method's NAME_backbone (default: the method's own; DINO: teacher)")
    g.add_argument("--arch", help="registry name for a bare state dict")
    g.add_argument("--backbone-kwargs", type=json_object, help="JSON kwargs (random init, bare state dicts, or overrides)")
    g.add_argument("--method", help="the method named in the results of weights that record none (a bare state dict, e.g. supervised)")
    g = common.add_argument_group("data")
    g.add_argument("--data", default="fashion_mnist", metavar="NAME", help=f"{', '.join(sorted(DATASETS))}, or the dotted path of a datamodule of your own")
    g.add_argument("--data-arg", type=key_value, action="append", default=[], metavar="KEY=VALUE", help="extra datamodule argument (repeatable), e.g. root=/data")
    g.add_argument("--train-subset", type=int, help="use a fixed random subset of the training split")
    g.add_argument("--test-subset", type=int, help="use a fixed random subset of the test split")
    g = common.add_argument_group("run")
    g.add_argument("--features", choices=["cls", "last4", "avg", "cls_avg"], default="cls", help="representation: the backbone's output ([CLS], or its global_pool); "
                   "last-4 [CLS] concatenated (DINO ViT-S); mean patch token; [CLS] + mean patch token (DINO ViT-B)")
    g.add_argument("--batch-size", type=int, default=256, help="images per forward pass of the feature extraction; fine-tuning: per process and step")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    g.add_argument("--precision", choices=["32-true", "bf16-mixed", "16-mixed"], default="32-true", help="of the backbone's passes (and the training's): 16-mixed needs CUDA")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default="results", help="folder for the result JSONs (named after method, backbone, data and protocol), or a file name ending in .json")
    linear = argparse.ArgumentParser(add_help=False)
    g = linear.add_argument_group("linear probe")
    g.add_argument("--epochs", type=int, default=100)
    g.add_argument("--lr", type=float, nargs="+", help="base LR per 256 examples (default: 0.01 with sgd, 0.1 with lars, MAE's); several: a sweep, "
                   "one head per LR on the same batches, the LR picked on held-out training features (--select-fraction), then trained on all")
    g.add_argument("--optimizer", choices=["sgd", "lars"], default="sgd")
    g.add_argument("--warmup-epochs", type=int, default=10, help="linear LR warm-up before the cosine decay (MAE: 10 of 90 epochs)")
    g.add_argument("--probe-batch-size", type=int, default=256, help="examples per step of the linear probe (with --augment: per process)")
    sweep = argparse.ArgumentParser(add_help=False)
    sweep.add_argument("--select-fraction", type=float, help="share of the training features held out to pick a sweep's LR or k (default 0.1)")
    knn = argparse.ArgumentParser(add_help=False)
    g = knn.add_argument_group("kNN")
    g.add_argument("--k", type=int, nargs="+", default=[20], help="neighbours that vote (DINO: 20); several (DINO's table: 10 20 100 200): a sweep, "
                   "k picked on held-out training features, every k's test top-1 recorded too")
    g.add_argument("--temperature", type=float, default=0.07, help="vote weight exp(similarity / T) (DINO: 0.07)")
    fewshot = argparse.ArgumentParser(add_help=False)
    g = fewshot.add_argument_group("few-shot")
    g.add_argument("--shots", type=int, nargs="+", default=[1, 5, 10, 25], help="training examples per class in a support set (ViT paper: 1 5 10 25)")
    g.add_argument("--seeds", type=int, default=5, help="support-set draws per shot count")
    g.add_argument("--l2", type=float, default=2.0**10, help="ridge (L2) weight of the closed-form least squares")
    images = argparse.ArgumentParser(add_help=False)
    g = images.add_argument_group("training on images")
    g.add_argument("--crop-scale", type=float, nargs=2, metavar=("LO", "HI"), help="area range of the random resized crop (+ flip); default: 0.08 1 "
                   "(DeiT/MAE/MoCo v3/DINO) from 96 px on, 0.5 1 below")
    g.add_argument("--run-dir", help="checkpoint the run into RUN_DIR/checkpoints (atomically; SIGTERM/SIGUSR1 save and stop)")
    g.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its newest checkpoint")
    g.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (with --run-dir)")
    g.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimiser steps (the LR schedule follows)")
    g.add_argument("--devices", type=int, default=1, help="processes on this machine (DDP); the batch size is per process")
    g.add_argument("--num-nodes", type=int, default=1, help="machines (DDP under torchrun or SLURM, --devices processes on each)")
    p = sub.add_parser("linear", parents=[common, linear, sweep, images], help="linear probe on frozen features; --augment: on augmented images (the papers')",
                       description="Linear probe (BN + linear) on the frozen backbone's features extracted once, or with --augment the papers' "
                                   "protocol (recorded as linear_aug): every step a random resized crop and flip of each image through the backbone.")
    p.add_argument("--augment", action="store_true", help="train on augmented images through the frozen backbone (the options under 'training on images')")
    sub.add_parser("knn", parents=[common, knn, sweep], help="DINO's weighted kNN on L2-normalised features")
    sub.add_parser("fewshot", parents=[common, fewshot], help="the ViT paper's closed-form few-shot regression")
    p = sub.add_parser("frozen", parents=[common, linear, knn, sweep, fewshot], help="linear probe, kNN and few-shot on one extraction of the features")
    p.add_argument("--protocols", nargs="+", choices=["linear", "knn", "fewshot"], default=["linear", "knn", "fewshot"], help="the protocols to run")
    p = sub.add_parser("finetune", parents=[common, images], help="full fine-tuning with layer-wise LR decay")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-4, help="base LR per 256 examples")
    p.add_argument("--layer-decay", type=float, default=0.65, help="layer-wise LR decay (MAE ViT-B: 0.65 with --lr 5e-4; ViT-L: 0.75 with 1e-3)")
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=float, default=5.0, help="linear LR warm-up before the cosine decay (MAE: 5 of 100 epochs)")
    p.add_argument("--img-size", type=int, help="fine-tune at another resolution (position embedding interpolated)")
    p.add_argument("--no-augment", action="store_true", help="train on the evaluation transform (resize + centre crop) instead")
    p.add_argument("--mixup", type=float, default=0.0, help="MixUp alpha (MAE: 0.8; 0: off)")
    p.add_argument("--cutmix", type=float, default=0.0, help="CutMix alpha (MAE: 1.0; 0: off); with both, one per batch")
    p.add_argument("--rand-augment", type=int, nargs=2, metavar=("OPS", "MAGNITUDE"), help="RandAugment on the training crops (MAE: 2 9); off when not given")
    p.add_argument("--random-erasing", type=float, default=0.0, help="probability of erasing a random box of each image with noise (MAE: 0.25)")
    p.add_argument("--compile", action="store_true", help="torch.compile (inductor) the backbone one block at a time: for GPUs")
    p.add_argument("--export", metavar="DIR", help="write the fine-tuned model as an export folder: backbone + classifier in model.safetensors "
                   "(timm.create_model('local-dir:DIR', pretrained=True) builds the classifier), config.json with its result")
    p.add_argument("--export-format", nargs="+", default=["safetensors"], choices=["safetensors", "torchscript", "export", "onnx"],
                   help="also the traced backbone (without the classifier), as ssl-vit export --format")
    return parser


def _settings(args: argparse.Namespace, protocol: str) -> Any:
    """A protocol's settings from its options (the section's seed fills the seeds left None)."""
    from ssl_vit.eval.evaluate import SETTINGS

    picked = {} if args.__dict__.get("select_fraction") is None else {"select_fraction": args.select_fraction}
    if protocol == "linear":
        return SETTINGS[protocol](epochs=args.epochs, batch_size=args.probe_batch_size, base_lr=args.lr[0] if args.lr and len(args.lr) == 1 else args.lr,
                                  optimizer=args.optimizer, warmup_epochs=args.warmup_epochs, **picked)
    if protocol == "knn":
        return SETTINGS[protocol](k=args.k[0] if len(args.k) == 1 else args.k, temperature=args.temperature, **picked)
    if protocol == "fewshot":
        return SETTINGS[protocol](shots=args.shots, num_seeds=args.seeds, l2_reg=args.l2)
    run = dict(epochs=args.epochs, warmup_epochs=args.warmup_epochs, crop_scale=args.crop_scale and tuple(args.crop_scale), max_steps=args.max_steps,
               checkpoint_every=args.checkpoint_every)
    if protocol == "linear_aug":
        return SETTINGS[protocol](**run, batch_size=args.probe_batch_size, base_lr=args.lr and args.lr[0], optimizer=args.optimizer)
    return SETTINGS[protocol](**run, batch_size=args.batch_size, base_lr=args.lr, layer_decay=args.layer_decay, drop_path_rate=args.drop_path,
                              label_smoothing=args.label_smoothing, weight_decay=args.weight_decay, mixup_alpha=args.mixup, cutmix_alpha=args.cutmix,
                              rand_augment=args.rand_augment and tuple(args.rand_augment), random_erasing=args.random_erasing,
                              augment=not args.no_augment, compile_backbone=args.compile)


def trainer_devices(device: str, count: int) -> int | list[int]:
    """Lightning's ``devices`` for ``--device`` and ``--devices``: ``cuda:1`` is that GPU."""
    if ":" not in device:
        return count
    if count > 1:
        raise ValueError(f"--device {device} names one GPU; with --devices {count} use --device cuda (the first GPUs; CUDA_VISIBLE_DEVICES picks others)")
    return [int(device.split(":", 1)[1])]


def check_out(out: str, create: bool = False) -> None:
    """``--out``: a folder of results, or a result file (``*.json``) in one, that can be written."""
    path = Path(out).expanduser()
    if path.suffix.lower() == ".json" and path.is_dir():
        raise ValueError(f"--out {out}: is a folder; a name ending in .json names the record file itself")
    if path.suffix.lower() != ".json" and path.exists() and not path.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder; name a folder for the records, or a record file ending in .json")
    check_output_folder(path.parent if path.suffix.lower() == ".json" else path, f"--out {out}", create)


def check_export(export: str, backbone: str, create: bool = False) -> None:
    """``--export DIR``: a folder in a folder that can be written, and not the export ``--backbone``
    reads (the fine-tuned model would replace the pretrained one)."""
    path, source = Path(export).expanduser(), Path(backbone).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--export {export}: exists and is not a directory; name a folder")
    source = source if source.is_dir() else source.parent
    if path.is_dir() and source.resolve() == path.resolve() and (source / "config.json").is_file():
        raise ValueError(f"--export {export}: is the export --backbone reads; the fine-tuned model would replace the pretrained one: name another folder")
    check_output_folder(path if path.is_dir() else path.parent, f"--export {export}", create)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_option_values(args, RULES)  # before any note or work
    datamodule_class(args.data)  # a misspelt name, before the backbone loads
    augment = args.protocol == "linear" and args.augment
    protocols = args.protocols if args.protocol == "frozen" else ["linear_aug" if augment else args.protocol]
    lrs, ks = (args.lr if "linear" in protocols else None), (args.k if "knn" in protocols else None)
    if args.__dict__.get("select_fraction") is not None and not any(v is not None and len(v) > 1 for v in (lrs, ks)):
        what = {"linear": "the LR of a sweep; give --lr several values", "knn": "the k of a sweep; give --k several values"}.get(
            args.protocol, "the LR (--lr) or kNN's k (--k) of a sweep; give one of them several values")
        raise ValueError(f"--select-fraction: holds out features to pick {what}, or leave it out")
    if augment and args.lr and len(args.lr) > 1:
        raise ValueError("--lr: a sweep of several LRs is for the probe on fixed features; with --augment give one")
    if args.protocol == "linear" and not augment and (given := [f"--{k.replace('_', '-')}" for k in IMAGE_RUN if args.__dict__[k] != build_parser().parse_args(["linear", "--backbone", "x"]).__dict__[k]]):
        raise ValueError(f"{', '.join(given)}: options of a linear probe trained on images; add --augment, or leave them out for the probe on features extracted once")
    from lightning.pytorch.utilities import rank_zero_only

    trains = [p for p in protocols if p in ("linear", "linear_aug", "finetune")]
    if trains and args.epochs <= args.warmup_epochs and rank_zero_only.rank == 0:  # (the processes of --devices N run this too)
        what = "fine-tuning" if trains[0] == "finetune" else "the linear probe"
        print(f"ssl-vit eval: note: {what}'s {args.warmup_epochs:g} warm-up epochs cover its whole run of {args.epochs}: its LR only rises "
              "(--warmup-epochs sets fewer)", file=sys.stderr)
    if args.__dict__.get("resume") and args.run_dir is None:
        raise ValueError(f"--resume needs the --run-dir of the {protocols[0]} run to continue")
    check_out(args.out)  # where the results and the fine-tuned model go: checked now, not found unwritable after the run
    if args.__dict__.get("export") is not None:
        check_export(args.export, args.backbone)

    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.features import feature_dim
    from ssl_vit.eval.finetune import finetuned_architecture, new_head
    from ssl_vit.eval.train_run import EvalRunInterrupted, ImageRun
    from ssl_vit.export import save_backbone
    from ssl_vit.export.load import resolve, source_info
    from ssl_vit.export.sources import recorded_normalization
    from ssl_vit.runtime import resolve_device

    evaluation = Evaluation(protocols, features=args.features, which=args.which, **{p: _settings(args, p) for p in protocols},
                            batch_size=args.batch_size, train_subset=args.train_subset, test_subset=args.test_subset, seed=args.seed)
    device = resolve_device(args.device)
    if args.precision == "16-mixed" and not device.startswith("cuda"):
        raise ValueError("--precision 16-mixed needs a CUDA device; on a CPU use bf16-mixed or 32-true")
    backbone, source = resolve(args.backbone, "cpu", args.which, args.arch, args.backbone_kwargs, args.seed)
    info = source_info(source, backbone)
    if args.method is not None and info["method"] is not None and args.method.lower() != str(info["method"]).lower():
        what = "a random initialisation" if source.kind == "random" else "recorded"
        raise ValueError(f"--method {args.method}: {args.backbone} is {what} as method {info['method']}; --method names the method "
                         "of weights that record none (a bare state dict): leave it out")
    info["method"] = info["method"] or args.method
    if args.protocol == "finetune" and args.features != "cls":
        raise ValueError(f"--features {args.features}: fine-tuning classifies from the backbone's own pooled representation "
                         "([CLS], or the patch mean of a backbone built with global_pool avg); --features is for the frozen protocols")
    try:  # a read-out this backbone lacks: said before any data is read
        feature_dim(backbone, args.features) if args.protocol != "finetune" else None
    except ValueError as err:
        raise ValueError(f"--features {args.features}: {err}") from None
    dm = build_datamodule(args.data, backbone, info, parse_data_args(args.data, dict(args.data_arg)), args.__dict__.get("img_size"))
    dm.num_workers = args.num_workers
    if rank_zero_only.rank == 0:
        note_channel_conversion(dm.eval_datasets()[0], backbone.in_chans, "ssl-vit eval", f"--data {args.data}")
    check_out(args.out, create=True)
    if args.__dict__.get("export") is not None:
        check_export(args.export, args.backbone, create=True)
    head = new_head(backbone.embed_dim, dm.num_classes, seed=args.seed) if args.protocol == "finetune" else None  # trained in place, for --export
    image_run = ImageRun("gpu" if device.startswith("cuda") else "cpu", trainer_devices(device, args.__dict__.get("devices", 1)), args.__dict__.get("num_nodes", 1),
                         args.precision, args.num_workers, args.seed, resume=args.__dict__.get("resume", False))
    try:
        results = evaluation.run(backbone, info, dm, args.out, device=device, image_run=image_run, run_dirs={p: args.__dict__.get("run_dir") for p in protocols}, head=head)
    except EvalRunInterrupted as stop:
        if stop.rank == 0:
            print(f"ssl-vit eval: {stop}; continue with the same command and --resume", file=sys.stderr)
        return 128 + int(getattr(signal, stop.signal_name, signal.SIGTERM))
    for result, path in results:
        print(f"{result.summary_line()}\n  -> {path}")
    if results and args.__dict__.get("export") is not None:  # the fine-tuned backbone and classifier, saying what the run's checkpoints say
        _, source.backbone_kwargs = finetuned_architecture(backbone)  # (another --img-size resampled the position embedding)
        source.method, source.data = f"{info['method']}+finetune", {"name": results[0][0].data["name"], "mean": list(dm.mean), "std": list(dm.std)}
        source.normalization = recorded_normalization(source.data, {})
        out = save_backbone(backbone, args.export, source, formats=args.export_format, results=[results[0][1]], head=head)
        print(f"  -> {out.out_dir} (fine-tuned backbone + {head.out_features}-class classifier)")
    return 0
