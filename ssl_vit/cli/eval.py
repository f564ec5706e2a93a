"""``ssl-vit eval {linear,knn,fewshot,frozen,finetune}``: evaluate a backbone and write result JSONs
(``frozen`` runs the linear probe, kNN and few-shot on one extraction of the features).

The backbone is a pretraining checkpoint, an export directory, a bare state dict (with
``--arch``), or ``random:<name>`` (the random-init baseline). The data is a named datamodule built
at the backbone's resolution and channels, normalised as the backbone was trained.

Examples::

    ssl-vit eval knn --backbone runs/dino/checkpoints/last.ckpt --data fashion_mnist
    ssl-vit eval linear --backbone exports/dino --data imagefolder \\
        --data-arg train_dir=/data/imagenet/train --data-arg val_dir=/data/imagenet/val --features last4
    ssl-vit eval linear --augment --backbone exports/dino --data imagefolder \\
        --data-arg train_dir=/data/imagenet/train --data-arg val_dir=/data/imagenet/val --features last4 --run-dir runs/dino_linear
    ssl-vit eval finetune --backbone exports/mocov3 --data cifar10 --img-size 64 --epochs 10 --export exports/mocov3_cifar10
    ssl-vit eval fewshot --backbone random:vit_tiny --backbone-kwargs '{"img_size": 28, "patch_size": 4, "in_chans": 1}'
    ssl-vit eval frozen --backbone runs/mocov3/checkpoints/last.ckpt --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

from ssl_vit.errors import ArgumentParser
from ssl_vit.eval.data_args import (
    DATASETS,
    build_datamodule,
    datamodule_class,
    datamodule_name,
    key_value,
    labelled_classes,
    note_channel_conversion,
    parse_data_args,
)
from ssl_vit.eval.options import check_export, check_options, check_out

# The protocols on frozen features (ssl_vit.eval.run.FEATURE_PROTOCOLS; named here so that the
# parser is built without importing torch).
FEATURE_PROTOCOL_NAMES = ("linear", "knn", "fewshot")



def _json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not a JSON object: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object such as '{\"img_size\": 28}'")
    return value


def _image_run_options() -> argparse.ArgumentParser:
    """The options of the evaluators that train on images (fine-tuning, the linear probe with
    --augment): their runs."""
    images = argparse.ArgumentParser(add_help=False)
    g = images.add_argument_group("training on images")
    g.add_argument("--crop-scale", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="area range of the training images' random resized crop (+ horizontal flip); default: "
                        "0.08 1 (DeiT/MAE/MoCo v3/DINO) for images of 96 px or more, 0.5 1 for smaller ones (the small-image recipes')")
    g.add_argument("--run-dir", default=None, help="checkpoint the run into RUN_DIR/checkpoints (atomically; SIGTERM/SIGUSR1 save and stop)")
    g.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its newest checkpoint")
    g.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (with --run-dir)")
    g.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimiser steps (the LR schedule follows)")
    g.add_argument("--devices", type=int, default=1,
                   help="processes on this machine (DDP; --device cpu: CPU processes, cuda: the first N GPUs); the batch size is per process")
    g.add_argument("--num-nodes", type=int, default=1, help="machines (DDP under torchrun or SLURM, --devices processes on each)")
    return images


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="ssl-vit eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="protocol", required=True, metavar="{linear,knn,fewshot,frozen,finetune}")
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("backbone")
    g.add_argument("--backbone", required=True, help="checkpoint (.ckpt), export dir, state dict, or random:<name>")
    g.add_argument("--which", default=None, help="encoder of a checkpoint: student, teacher, momentum, or NAME for a method's NAME_backbone (default: the method's own; DINO: teacher)")
    g.add_argument("--arch", default=None, help="registry name for a bare state dict")
    g.add_argument("--backbone-kwargs", type=_json_dict, default=None, help="JSON kwargs (random init, bare state dicts, or overrides)")
    g.add_argument("--method", default=None, help="the method named in the record of weights that record none (a bare state dict, "
                                                   "e.g. supervised); a checkpoint, export or random:<name> records its own")
    g = common.add_argument_group("data")
    g.add_argument("--data", default="fashion_mnist", metavar="NAME",
                   help=f"{', '.join(sorted(DATASETS))}, or the dotted path of a datamodule of your own (an ImageDataModule subclass)")
    g.add_argument("--data-arg", type=key_value, action="append", default=[], metavar="KEY=VALUE", help="extra datamodule argument (repeatable), e.g. root=/data")
    g.add_argument("--train-subset", type=int, default=None, help="use a fixed random subset of the training split")
    g.add_argument("--test-subset", type=int, default=None, help="use a fixed random subset of the test split")
    g = common.add_argument_group("run")
    g.add_argument("--features", choices=["cls", "last4", "avg", "cls_avg"], default="cls",
                   help="representation: the backbone's output (the final [CLS], or its global_pool); last-4 [CLS] concatenated (DINO ViT-S); "
                        "mean patch token; [CLS] + mean patch token (DINO ViT-B)")
    g.add_argument("--batch-size", type=int, default=256,
                   help="images per forward pass of the feature extraction; fine-tuning: per process and step (--probe-batch-size: the probes')")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    g.add_argument("--precision", choices=["32-true", "bf16-mixed", "16-mixed"], default="32-true",
                   help="of the backbone's forward passes (and of fine-tuning's training): bf16-mixed halves a GPU's time; 16-mixed needs CUDA")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default="results", help="folder for the result JSON (named after method, backbone, data and protocol), or a file name ending in .json")

    linear = argparse.ArgumentParser(add_help=False)
    g = linear.add_argument_group("linear probe")
    g.add_argument("--epochs", type=int, default=100)
    g.add_argument("--lr", type=float, nargs="+", default=None,
                   help="base LR per 256 examples (default: 0.01 with sgd, 0.1 with lars as MAE's probe); several (--lr 0.01 0.1 1): "
                        "a sweep, one head per LR on the same batches, the LR picked on held-out training features (--select-fraction), "
                        "the probe then trained on all of them at that LR")
    g.add_argument("--optimizer", choices=["sgd", "lars"], default="sgd")
    g.add_argument("--warmup-epochs", type=int, default=10,
                   help="linear LR warm-up before the cosine decay (MAE: 10 of 90 epochs); a run no longer than it only warms up")
    g.add_argument("--probe-batch-size", type=int, default=256, help="examples per step of the linear probe (with --augment: per process)")
    knn = argparse.ArgumentParser(add_help=False)
    g = knn.add_argument_group("kNN")
    g.add_argument("--k", type=int, nargs="+", default=[20],
                   help="neighbours that vote (DINO: 20); several (--k 10 20 100 200, DINO's table): a sweep from one neighbour "
                        "search, k picked on held-out training features (--select-fraction), every k's test top-1 recorded too")
    g.add_argument("--temperature", type=float, default=0.07, help="vote weight exp(similarity / T) (DINO: 0.07)")
    fewshot = argparse.ArgumentParser(add_help=False)
    g = fewshot.add_argument_group("few-shot")
    g.add_argument("--shots", type=int, nargs="+", default=[1, 5, 10, 25],
                   help="training examples per class in each support set (the ViT paper: 1 5 10 25)")
    g.add_argument("--seeds", type=int, default=5, help="support-set draws per shot count")
    g.add_argument("--l2", type=float, default=2.0**10, help="ridge (L2) weight of the closed-form least squares")
    sweep = argparse.ArgumentParser(add_help=False)
    sweep.add_argument("--select-fraction", type=float, default=None,
                       help="share of the training features held out to pick the LR of a linear probe's sweep or kNN's k "
                            "(default: the protocol's, 0.1)")
    images = _image_run_options()
    p = sub.add_parser("linear", parents=[common, linear, sweep, images], help="linear probe on frozen features (BN + linear, SGD); --augment: trained on augmented images (the papers' protocol)",
                       description="Linear probe on the frozen backbone: on features extracted once from the evaluation transform, "
                                   "or with --augment the papers' protocol (MoCo v3, DINO, MAE): every step a random resized crop "
                                   "and flip of each image through the backbone (one backbone pass per image and epoch; recorded as "
                                   "protocol linear_aug). The options under 'training on images' apply with --augment.")
    p.add_argument("--augment", action="store_true", help="train on augmented images through the frozen backbone (the papers' linear evaluation)")
    sub.add_parser("knn", parents=[common, knn, sweep], help="DINO's weighted kNN on L2-normalised features")
    sub.add_parser("fewshot", parents=[common, fewshot], help="ViT paper's closed-form few-shot regression")
    p = sub.add_parser("frozen", parents=[common, linear, knn, sweep, fewshot],
                       help="linear probe, kNN and few-shot on one extraction of the frozen features")
    p.add_argument("--protocols", nargs="+", choices=list(FEATURE_PROTOCOL_NAMES), default=list(FEATURE_PROTOCOL_NAMES),
                   help="the protocols to run (each writes its own record into the --out folder)")
    p = sub.add_parser("finetune", parents=[common, images], help="full fine-tuning with layer-wise LR decay")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-4, help="base LR per 256 examples")
    p.add_argument("--layer-decay", type=float, default=0.65,
                   help="layer-wise LR decay (MAE's ViT-B recipe: 0.65 with --lr 5e-4; ViT-L: 0.75 with 1e-3)")
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=float, default=5.0,
                   help="linear LR warm-up before the cosine decay (MAE: 5 of 100 epochs); a run no longer than it only warms up")
    p.add_argument("--img-size", type=int, default=None, help="fine-tune at another resolution (position embedding interpolated)")
    p.add_argument("--no-augment", action="store_true", help="train on the evaluation transform (resize + centre crop) instead")
    p.add_argument("--mixup", type=float, default=0.0, help="MixUp alpha (MAE: 0.8; 0: off)")
    p.add_argument("--cutmix", type=float, default=0.0, help="CutMix alpha (MAE: 1.0; 0: off); with both, one per batch")
    p.add_argument("--rand-augment", type=int, nargs=2, default=None, metavar=("OPS", "MAGNITUDE"),
                   help="RandAugment on the training crops: OPS ops per image at MAGNITUDE of 30 (MAE: 2 9); off when not given")
    p.add_argument("--random-erasing", type=float, default=0.0,
                   help="probability of erasing a random box of each training image with noise (MAE: 0.25; 0: off)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile (inductor) the backbone one block at a time: for GPUs (the first steps compile; no faster on a small CPU)")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="write the fine-tuned model as an export folder: backbone + classifier in model.safetensors (timm names; "
                        "timm.create_model('local-dir:DIR', pretrained=True) builds the classifier), config.json with this result")
    p.add_argument("--export-format", nargs="+", default=["safetensors"], choices=["safetensors", "torchscript", "export", "onnx"],
                   help="also the traced backbone (features, without the classifier), as ssl-vit export --format")
    return parser


def _protocol_kwargs(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The constructor arguments of feature protocol ``name`` from its command-line options."""
    if name == "linear":
        lrs = args.lr or [None]
        sweep = {"base_lr": lrs} if len(lrs) > 1 else {"base_lr": lrs[0]}
        if args.select_fraction is not None:
            sweep["select_fraction"] = args.select_fraction
        return {"epochs": args.epochs, **sweep, "optimizer": args.optimizer, "batch_size": args.probe_batch_size,
                "warmup_epochs": args.warmup_epochs, "seed": args.seed}
    if name == "knn":
        if len(args.k) == 1:
            return {"k": args.k[0], "temperature": args.temperature}
        picked = {} if args.select_fraction is None else {"select_fraction": args.select_fraction}
        return {"k": args.k, "temperature": args.temperature, **picked, "seed": args.seed}
    return {"shots": args.shots, "num_seeds": args.seeds, "l2_reg": args.l2, "seed": args.seed}


def _runs(args: argparse.Namespace, protocol: str) -> bool:
    """Whether this command runs ``protocol`` (``frozen``: one of its ``--protocols``)."""
    return args.protocol == protocol or (args.protocol == "frozen" and protocol in args.protocols)


def _trainer_devices(device: str, count: int) -> int | list[int]:
    """Lightning's ``devices`` for ``--device`` and ``--devices``: ``cuda:1`` is that GPU."""
    if count < 1:
        raise ValueError(f"--devices must be >= 1, got {count}")
    if ":" in device:
        if count > 1:
            raise ValueError(f"--device {device} names one GPU; with --devices {count} use --device cuda "
                             "(the first GPUs; CUDA_VISIBLE_DEVICES picks others)")
        return [int(device.split(":", 1)[1])]
    return count


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_options(args)  # before any note or work
    datamodule_class(args.data)  # a misspelt name, before the backbone loads
    # The LR and k options count only where their protocol runs (frozen: the --protocols listed).
    lrs = getattr(args, "lr", None) if _runs(args, "linear") else None
    ks = getattr(args, "k", None) if _runs(args, "knn") else None
    swept = any(values is not None and len(values) > 1 for values in (lrs, ks))
    if getattr(args, "select_fraction", None) is not None and not swept:
        what = {"linear": "the LR of a sweep; give --lr several values", "knn": "the k of a sweep; give --k several values"}.get(
            args.protocol, "the LR (--lr) or kNN's k (--k) of a sweep; give one of them several values")
        raise ValueError(f"--select-fraction: holds out features to pick {what}, or leave it out")
    if ks is not None and len(set(ks)) != len(ks):
        raise ValueError(f"--k: the k of a sweep must be distinct, got {' '.join(map(str, ks))}")
    if lrs is not None and len(lrs) > 1:
        if args.protocol == "linear" and args.augment:
            raise ValueError("--lr: a sweep of several LRs is for the probe on fixed features; with --augment give one")
        if len(set(lrs)) != len(lrs):
            raise ValueError(f"--lr: the LRs of a sweep must be distinct, got {' '.join(f'{lr:g}' for lr in lrs)}")
    if args.protocol in ("linear", "frozen") and args.lr is None:
        from ssl_vit.eval.linear import PROBE_BASE_LR

        args.lr = [PROBE_BASE_LR[args.optimizer]]  # the LR that runs is the one recorded
    on_images = args.protocol == "finetune" or (args.protocol == "linear" and args.augment)
    if args.protocol == "linear" and not args.augment:
        given = [f"--{k.replace('_', '-')}" for k, v in vars(_image_run_options().parse_args([])).items() if getattr(args, k) != v]
        if given:
            raise ValueError(f"{', '.join(given)}: options of a linear probe trained on images; add --augment, "
                             "or leave them out for the probe on features extracted once")
    trains = args.protocol == "finetune" or _runs(args, "linear")
    first_process = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0  # (the processes of --devices N run this too)
    if trains and args.epochs <= args.warmup_epochs and first_process:
        what = "fine-tuning" if args.protocol == "finetune" else "the linear probe"
        print(f"ssl-vit eval: note: {what}'s {args.warmup_epochs:g} warm-up epochs cover its whole run of {args.epochs}: "
              "its LR only rises (--warmup-epochs sets fewer)", file=sys.stderr)
    if on_images and args.resume and args.run_dir is None:
        raise ValueError(f"--resume needs the --run-dir of the {args.protocol} run to continue")
    # Where the record and the fine-tuned model go: checked before the evaluation (and made just
    # before it starts), not found unwritable after it.
    check_out(args.out)
    if getattr(args, "export", None) is not None:
        check_export(args.export, backbone=args.backbone)

    from ssl_vit.eval.features import feature_dim
    from ssl_vit.eval.finetune import new_head
    from ssl_vit.eval.image_runs import (
        FineTuneSettings,
        LinearAugSettings,
        finetune_and_record,
        linear_aug_and_record,
    )
    from ssl_vit.eval.results import backbone_info, chosen_encoder
    from ssl_vit.eval.run import evaluate_features, result_path, subsample
    from ssl_vit.eval.train_run import EvalRunInterrupted
    from ssl_vit.export.load import resolve, source_info
    from ssl_vit.runtime import resolve_device

    # (settings it cannot run: refused before the backbone loads)
    settings: Any = None
    if args.protocol == "linear" and args.augment:
        settings = LinearAugSettings(epochs=args.epochs, batch_size=args.probe_batch_size, base_lr=args.lr and args.lr[0], optimizer=args.optimizer,
                                     warmup_epochs=args.warmup_epochs, crop_scale=args.crop_scale, max_steps=args.max_steps,
                                     checkpoint_every=args.checkpoint_every)
    elif args.protocol == "finetune":
        settings = FineTuneSettings(
            epochs=args.epochs, batch_size=args.batch_size, base_lr=args.lr, layer_decay=args.layer_decay, drop_path_rate=args.drop_path,
            label_smoothing=args.label_smoothing, weight_decay=args.weight_decay, warmup_epochs=args.warmup_epochs, mixup_alpha=args.mixup,
            cutmix_alpha=args.cutmix, rand_augment=args.rand_augment, random_erasing=args.random_erasing, augment=not args.no_augment, crop_scale=args.crop_scale, max_steps=args.max_steps,
            checkpoint_every=args.checkpoint_every, compile_backbone=args.compile,
        )
    device = resolve_device(args.device)
    if args.precision == "16-mixed" and not device.startswith("cuda"):
        raise ValueError("--precision 16-mixed needs a CUDA device; on a CPU use bf16-mixed or 32-true")
    backbone, source = resolve(args.backbone, "cpu", args.which, args.arch, args.backbone_kwargs, args.seed)
    info = source_info(source, backbone)
    recorded = info.get("method")
    if args.method is not None and recorded is not None and args.method.lower() != str(recorded).lower():
        what = "a random initialisation" if source.kind == "random" else "recorded"
        raise ValueError(f"--method {args.method}: {args.backbone} is {what} as method {recorded}; --method names the method "
                         "of weights that record none (a bare state dict): leave it out")
    if args.protocol == "finetune" and args.features != "cls":
        raise ValueError(f"--features {args.features}: fine-tuning classifies from the backbone's own pooled representation "
                         "([CLS], or the patch mean of a backbone built with global_pool avg); --features is for the frozen protocols")
    if args.protocol != "finetune":
        try:  # a read-out this backbone lacks: said before any data is read
            feature_dim(backbone, args.features)
        except ValueError as err:
            raise ValueError(f"--features {args.features}: {err}") from None
    data_args = parse_data_args(args.data, dict(args.data_arg))
    dm = build_datamodule(args.data, backbone, info, data_args, args.train_subset, getattr(args, "img_size", None))
    train_views = settings.train_views(dm.img_size) if on_images else None
    train_ds, test_ds = dm.eval_datasets(train_views=train_views)
    if test_ds is None:
        raise ValueError(f"{args.data}: no test split to evaluate on (an ImageFolder needs val_dir=...)")
    num_classes = dm.num_classes
    if not num_classes:
        raise ValueError(f"{args.data}: evaluation needs labelled data (num_classes is unknown)")
    test_ds = subsample(test_ds, args.test_subset, args.seed)
    # One class scores 100 % whatever the backbone: said before any feature is extracted.
    for split, dataset, folder in (("training", train_ds, data_args.get("train_dir")), ("test", test_ds, data_args.get("val_dir"))):
        classes = labelled_classes(dataset)
        if (split == "training" and num_classes < 2) or (classes is not None and classes < 2):
            held = num_classes if classes is None else classes
            where = f" ({folder})" if folder else ""
            raise ValueError(f"--data {args.data}: the {split} images{where} are of {held} class{'' if held == 1 else 'es'}; "
                             "evaluation needs at least 2 classes")
    if first_process:
        note_channel_conversion(train_ds, backbone.in_chans, "ssl-vit eval", f"--data {args.data}")
    if _runs(args, "knn"):
        from ssl_vit.eval.knn import KNNClassifier

        if max(args.k) > len(train_ds):
            raise ValueError(f"--k {' '.join(map(str, args.k))}: more neighbours than the {len(train_ds)} training images")
        short = KNNClassifier(**_protocol_kwargs(args, "knn")).bank_shortfall(len(train_ds))  # a sweep's held-out part
        if short is not None:
            raise ValueError(f"--k {' '.join(map(str, args.k))}: {short.replace('training examples', 'training images')}")
    data_record = {"name": datamodule_name(dm), "test_size": len(test_ds), "train_size": len(train_ds), **{k: v for k, v in data_args.items() if k != "root"}}
    method = recorded or args.method or "unknown"
    check_out(args.out, create=True)
    if getattr(args, "export", None) is not None:
        check_export(args.export, create=True)
    common = dict(method=method, data=data_record, num_classes=num_classes, source=str(info.get("source", args.backbone)), pretrain=info.get("pretrain") or {},
                  backbone_record=backbone_info(backbone, chosen_encoder(info)))

    if on_images:
        run = dict(accelerator="gpu" if device.startswith("cuda") else "cpu", devices=_trainer_devices(device, args.devices), num_nodes=args.num_nodes,
                   precision=args.precision, seed=args.seed, num_workers=args.num_workers, run_dir=args.run_dir, resume=args.resume,
                   out=args.out, data_record=data_record, **{k: common[k] for k in ("method", "source", "pretrain", "backbone_record")})
        try:
            if args.protocol == "finetune":
                head = new_head(backbone.embed_dim, num_classes, seed=args.seed)  # trained in place, for --export
                # What the run's checkpoints and its export say of the fine-tuned backbone's origin.
                normalization = {"name": data_record["name"], "mean": list(dm.mean), "std": list(dm.std)}
                done = finetune_and_record(backbone, train_ds, test_ds, num_classes, settings, img_size=dm.img_size, new_img_size=args.img_size,
                                           normalization=normalization, head=head, **run)
            else:
                done = linear_aug_and_record(backbone, train_ds, test_ds, num_classes, settings, img_size=dm.img_size, features=args.features, **run)
            if done is None:
                return 0  # another process of a distributed run: process 0 tests and writes the record
            results = [done]
        except EvalRunInterrupted as stop:
            if stop.rank == 0:
                print(f"ssl-vit eval: {stop}; continue with the same command and --resume", file=sys.stderr)
            return 128 + int(getattr(signal, stop.signal_name, signal.SIGTERM))
    else:
        names = args.protocols if args.protocol == "frozen" else [args.protocol]
        out = evaluate_features(
            backbone, train_ds, test_ds, {name: _protocol_kwargs(args, name) for name in names}, feature_mode=args.features, batch_size=args.batch_size,
            num_workers=args.num_workers, device=device, precision=args.precision, out_dir=args.out, **common,
        )
        results = [(r, result_path(args.out, r)) for r in out]
    for result, path in results:
        print(result.summary_line())
        print(f"  -> {path}")
    if args.protocol == "finetune" and args.export is not None:
        finetuned = {"method": f"{method}+finetune", "data": normalization}
        export_finetuned(backbone, head, source, finetuned, args.export, args.export_format, results[0][1])
    return 0


def export_finetuned(backbone: Any, head: Any, source: Any, finetuned: dict[str, Any], out_dir: str, formats: list[str], result: Any) -> None:
    """The fine-tuned backbone and its classifier as an export folder, saying what the run's
    checkpoints say (``finetuned``: method, data and its normalisation), its result recorded."""
    from ssl_vit.eval.finetune import finetuned_architecture
    from ssl_vit.export import save_backbone
    from ssl_vit.export.sources import recorded_normalization

    _, source.backbone_kwargs = finetuned_architecture(backbone)  # another --img-size resampled the position embedding
    source.method, source.data = finetuned["method"], finetuned["data"]
    source.normalization = recorded_normalization(finetuned["data"], {})  # what the fine-tuning fed the backbone
    out = save_backbone(backbone, out_dir, source, formats=formats, results=[result], head=head)
    print(f"  -> {out.out_dir} (fine-tuned backbone + {head.out_features}-class classifier)")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(__import__("sys").argv[1:]))
