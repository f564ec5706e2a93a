"""``ssl-vit demo``: does self-supervision pay off? One run that answers it on real data, offline.

It runs the shipped Fashion-MNIST recipes (``recipes/fashion_mnist/``: masked patch prediction,
MoCo v3, DINO and the supervised baseline on one small ViT), each evaluated by its recipe's
``evaluate`` section (a linear probe and a weighted kNN, the probe's LR and the kNN's k picked on
held-out training features, never on the test split), and a random-init backbone the same way.
Then the few-label regime, where self-supervision is meant to pay off: the linear probe of every
backbone pretrained without labels is trained on 1 % and 10 % of the labels (several draws), against
the supervised recipe trained from scratch on the same labelled images alone. The report
(``report.md``, stdout) has both tables and their plots; ``runs/`` the checkpoints, results and
TensorBoard logs of every run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from ssl_vit.errors import ArgumentParser

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "fashion_mnist"
METHODS = ("mpp", "mocov3", "dino", "supervised")
TRAIN_IMAGES, BATCH = 60000, 128
# --quick: the pipeline end to end on a subset, in a minute or two (it learns next to nothing).
QUICK = {"subset": 4096, "evaluate": {"train_subset": 4096, "test_subset": 2000, "linear": {"epochs": 20}}}


def _flags(prefix: str, settings: dict[str, Any]) -> list[str]:
    """``{"linear": {"epochs": 20}}`` -> ``["--evaluate.linear.epochs", "20"]``."""
    flags = []
    for key, value in settings.items():
        if isinstance(value, dict):
            flags += _flags(f"{prefix}.{key}", value)
        else:
            flags += [f"--{prefix}.{key}", yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()]
    return flags


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    return {**base, **{k: _merge(base.get(k) or {}, v) if isinstance(v, dict) else v for k, v in extra.items()}}


def fit(recipe: Path, run_dir: Path, steps: int, args: argparse.Namespace, *extra: str) -> None:
    """``ssl-vit fit`` of ``recipe`` into ``run_dir`` for ``steps`` optimiser steps."""
    from ssl_vit.cli.fit import main as fit_main

    quiet = args.no_progress or not sys.stderr.isatty()
    argv = ["--config", str(recipe), "--trainer.default_root_dir", str(run_dir), "--trainer.max_steps", str(steps),
            "--seed_everything", str(args.seed), "--data.init_args.num_workers", str(args.num_workers),
            "--trainer.enable_progress_bar", str(not quiet).lower(), *(["--trainer.accelerator", "gpu"] if args.device.startswith("cuda") else []), *extra]
    if (code := fit_main(argv)) != 0:
        raise RuntimeError(f"ssl-vit fit {' '.join(argv)} ended with status {code}")


def _within(kind: type, low: float, high: float, what: str) -> Any:
    """An argparse type: a ``kind`` in ``low..high`` (``what`` says the range in the message)."""
    def parse(text: str) -> Any:
        value = kind(text)
        if not low <= value <= high:  # (a NaN fails too)
            raise argparse.ArgumentTypeError(f"{text}: give {what}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="ssl-vit demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run of the pipeline on a 4k-image subset (a minute or two; learns next to nothing)")
    p.add_argument("--epochs", type=_within(float, 1e-6, 1e6, "a positive number"), default=None, help="pretraining epochs of every method (default: each recipe's length)")
    p.add_argument("--subset", type=_within(int, 2 * BATCH, TRAIN_IMAGES, f"{2 * BATCH}..{TRAIN_IMAGES} images"), default=None, help="pretrain on this many training images (default: all 60k)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="which recipes to run")
    p.add_argument("--label-fractions", type=_within(float, 1e-6, 1.0, "a share in (0, 1]"), nargs="*", default=[0.01, 0.1],
                   help="the few-label regime: these shares of the labelled training images (none: skip it)")
    p.add_argument("--draws", type=_within(int, 1, 100, "1..100"), default=3, help="draws of the labelled images at each share (their seeds: --seed, --seed + 1 ...)")
    p.add_argument("--recipes", type=Path, default=RECIPES, help="the folder of the recipes (default: the shipped recipes/fashion_mnist)")
    p.add_argument("--out", type=Path, default=Path("demo_out"), help="output folder (report.md, results.json, runs/)")
    p.add_argument("--num-workers", type=_within(int, 0, 1024, "0 or more"), default=0, help="data-loading worker processes (0: in the main process, best on 2 cores)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="hide progress bars (hidden anyway when the output is not a terminal)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; the demo writes a folder there")
    if earlier := sorted({p.parent for p in out.glob("runs/*/checkpoints/*.ckpt")}):
        raise FileExistsError(f"{out} already holds a demo run ({', '.join(map(str, earlier))}), which a new run would overwrite; "
                              f"choose another --out, or remove {out} first")
    recipes = {m: args.recipes / f"{m}.yaml" for m in args.methods}
    if missing := [str(p) for p in recipes.values() if not p.is_file()]:
        raise FileNotFoundError(f"no recipe {', '.join(missing)}; name the folder of the Fashion-MNIST recipes with --recipes")
    from ssl_vit.runtime import resolve_device

    args.device = resolve_device(args.device)
    quick = QUICK if args.quick else {}
    images = args.subset or quick.get("subset") or TRAIN_IMAGES
    labels = sorted({max(2 * BATCH, round(f * images)) for f in args.label_fractions})  # (a batch or two at least)
    subset = ["--data.init_args.subset", str(images)] if images < TRAIN_IMAGES else []
    started = time.perf_counter()

    def steps(recipe: dict[str, Any]) -> int:
        """The recipe's length in epochs, on ``images`` images (``--epochs``: that many)."""
        epochs = args.epochs if args.epochs is not None else recipe["trainer"]["max_steps"] * BATCH / TRAIN_IMAGES
        return max(1, round(epochs * images / BATCH))

    for method, path in recipes.items():
        print(f"[demo] {method}: ssl-vit fit --config {path}", flush=True)
        recipe = yaml.safe_load(path.read_text())
        few = {"few_labels": labels, "draws": args.draws} if method != "supervised" and labels else {}
        fit(path, out / "runs" / method, steps(recipe), args, *subset, *_flags("evaluate", _merge(quick.get("evaluate", {}), few)))
    if "supervised" in recipes:  # trained from scratch on the few labels alone, probed on them
        recipe = yaml.safe_load(recipes["supervised"].read_text())
        for n in labels:
            for seed in range(args.seed, args.seed + args.draws):
                print(f"[demo] supervised on {n} labelled images (draw {seed})", flush=True)
                # as many epochs of its images as its recipe's images (at least a tenth of the recipe's steps)
                n_steps = max(1, steps(recipe) // 10, round(steps(recipe) * n / images))
                # a warm-up of 20 steps (the recipe's 0.2 epochs is a step or two of a few hundred images); no
                # validation each of the many short epochs: the evaluation follows
                fit(recipes["supervised"], out / "runs" / f"supervised_{n}_labels_draw{seed}", n_steps, args, "--data.init_args.subset", str(n),
                    "--data.init_args.seed", str(seed), "--model.init_args.warmup_steps", str(min(20, n_steps // 2)),
                    "--trainer.limit_val_batches", "0", *_flags("evaluate", quick.get("evaluate", {})))
    print("[demo] random init", flush=True)
    _evaluate_random(recipes, out, labels, images, args, quick)

    from ssl_vit.eval.compare import build_comparison, format_text, load_results
    from ssl_vit.eval.report import write_report
    from ssl_vit.io import atomic_write_json

    results = load_results([out / "runs", out / "results"])
    cmp = build_comparison(results)
    print(f"\n{format_text(cmp)}")
    note = ("--quick is a smoke run of the whole pipeline: a few dozen pretraining steps learn next to nothing, so trained rows can "
            "score below random init. The default run is the measurement.") if args.quick else None
    paths = write_report(cmp, out / "report.md", note=note)
    atomic_write_json(out / "results.json", [r.to_dict() for r in results])
    print(f"\n[demo] finished in {(time.perf_counter() - started) / 60:.1f} min; report: {', '.join(map(str, paths))}; "
          f"TensorBoard: tensorboard --logdir {out / 'runs'}")
    return 0


def _evaluate_random(recipes: dict[str, Path], out: Path, labels: list[int], images: int, args: argparse.Namespace, quick: dict[str, Any]) -> None:
    """The random-init backbone of the recipes, evaluated by their ``evaluate`` section."""
    from jsonargparse import ArgumentParser as ConfigParser

    from ssl_vit.data import FashionMNISTDataModule
    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.export import load_any_backbone

    recipe = yaml.safe_load(next(iter(recipes.values())).read_text())
    settings = _merge(recipe.get("evaluate") or {}, _merge(quick.get("evaluate", {}), {"few_labels": labels, "draws": args.draws} if labels else {}))
    parser = ConfigParser()
    parser.add_class_arguments(Evaluation, "evaluate")
    evaluation = parser.instantiate_classes(parser.parse_object({"evaluate": settings})).evaluate
    backbone, info = load_any_backbone(f"random:{recipe['model']['init_args']['backbone']}", backbone_kwargs=recipe["model"]["init_args"]["backbone_kwargs"],
                                       seed=args.seed)
    data = FashionMNISTDataModule(num_workers=args.num_workers, subset=images if images < TRAIN_IMAGES else None)  # (the recipes' images)
    evaluation.run(backbone, info, data, out / "results", device=args.device)
