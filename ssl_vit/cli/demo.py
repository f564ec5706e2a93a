"""``ssl-vit demo``: does self-supervision pay off? One run that answers it on real data, offline.

On Fashion-MNIST (the Debian package's files, or torchvision's download elsewhere) it pretrains a
small ViT with masked patch prediction, MoCo v3 and DINO, trains the supervised baseline on the
same backbone, then evaluates each backbone and a random-init one with a linear probe and a
weighted kNN on the test split (the probe's LR and the kNN's k picked on held-out training
features, never on the test split), and reports the table (stdout, ``report.md``, ``results.json``,
a PNG bar chart) with TensorBoard logs of every run.

The hyperparameters below are the Fashion-MNIST recipes in ``recipes/fashion_mnist/`` (a test
keeps the two in step); ``--epochs`` and ``--subset`` scale the budget, ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ssl_vit.errors import ArgumentParser

# The backbone every method shares: a small ViT for 28-px grey images, 4x4 patches of 7 px. On
# 2 CPU cores the supervised run trains at ~900 images/s, which is what a 15-minute budget buys.
DEMO_BACKBONE: dict[str, Any] = {"img_size": 28, "patch_size": 7, "in_chans": 1, "embed_dim": 128, "depth": 4, "num_heads": 4}
DEMO_BACKBONE_NAME = "vit"
# Fashion-MNIST's splits.
TRAIN_IMAGES, TEST_IMAGES = 60000, 10000
# The evaluation's sweeps (see Budget): the linear probe's base LRs and the kNN's k.
PROBE_LRS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
KNN_KS = (10, 20, 100, 200)


@dataclass
class MethodRecipe:
    """One method's model, views and training length (the values of its Fashion-MNIST recipe)."""

    method: str
    model_class: str
    model_args: dict[str, Any]
    views_class: str
    views_args: dict[str, Any] = field(default_factory=dict)
    epochs: float = 1.0


RECIPES: dict[str, MethodRecipe] = {
    "mpp": MethodRecipe(
        "mpp", "ssl_vit.methods.MPP",
        {"target": "mean_color", "corruption_ratio": 0.5, "base_lr": 2e-3, "warmup_epochs": 0.2, "weight_decay": 0.05},
        "ssl_vit.data.SingleView", {"scale": (0.5, 1.0)}, epochs=2.0,
    ),
    "mocov3": MethodRecipe(
        "mocov3", "ssl_vit.methods.MoCoV3",
        {"temperature": 0.2, "proj_hidden_dim": 512, "pred_hidden_dim": 512, "proj_output_dim": 128,
         "momentum": 0.99, "base_lr": 2e-3, "warmup_epochs": 0.2, "weight_decay": 0.1},
        "ssl_vit.data.TwoViews", {"scale": (0.3, 1.0)}, epochs=1.5,
    ),
    "dino": MethodRecipe(
        "dino", "ssl_vit.methods.DINO",
        {"out_dim": 1024, "hidden_dim": 512, "bottleneck_dim": 128, "momentum": 0.99, "warmup_teacher_temp_epochs": 0,
         "teacher_temp": 0.04, "base_lr": 2e-3, "warmup_epochs": 0.2, "weight_decay": 0.04, "weight_decay_end": 0.1,
         "grad_clip": 3.0, "grad_clip_mode": "per_param", "freeze_last_layer_epochs": 0},
        "ssl_vit.data.MultiCrop", {"n_local_crops": 4, "local_size": 14}, epochs=1.5,
    ),
    "supervised": MethodRecipe(
        "supervised", "ssl_vit.methods.Supervised",
        {"label_smoothing": 0.1, "base_lr": 2e-3, "warmup_epochs": 0.2, "weight_decay": 0.05},
        "ssl_vit.data.SingleView", {"scale": (0.5, 1.0)}, epochs=1.5,
    ),
}


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


@dataclass
class Budget:
    """How much of Fashion-MNIST each run sees."""

    epochs: float | None  # pretraining epochs of every method (None: each recipe's own)
    subset: int | None  # training images for pretraining (None: all 60k)
    eval_train: int  # training images whose features fit the linear probe / kNN bank
    eval_test: int | None  # test images (None: all 10k)
    probe_epochs: int
    # The linear probe's base LRs per 256 examples (a sweep: one head per LR on the same batches,
    # the LR picked on a held-out 10 % of the training features, as DINO's eval_linear.py sweeps
    # its LRs; never on the test split). The ImageNet protocols' 0.01 is the low end: on 128-d
    # features of 20k images it underfits in 100 epochs.
    probe_lrs: tuple[float, ...]
    # The kNN's k (DINO's eval_knn.py reports 10, 20, 100, 200), picked likewise on held-out features.
    knn_ks: tuple[int, ...]
    select_fraction: float  # the share of the training features held out to pick the LR and k
    batch_size: int

    @classmethod
    def default(cls) -> Budget:
        return cls(epochs=None, subset=None, eval_train=20000, eval_test=None, probe_epochs=100, probe_lrs=PROBE_LRS, knn_ks=KNN_KS,
                   select_fraction=0.1, batch_size=128)

    @classmethod
    def quick(cls) -> Budget:
        return cls(epochs=None, subset=4096, eval_train=4096, eval_test=2000, probe_epochs=50, probe_lrs=PROBE_LRS, knn_ks=KNN_KS,
                   select_fraction=0.1, batch_size=128)

    def protocols(self, seed: int) -> dict[str, dict[str, Any]]:
        """The linear probe's and the kNN's arguments (those of the Fashion-MNIST recipes' ``evaluate``)."""
        return {
            "linear": {"epochs": self.probe_epochs, "base_lr": list(self.probe_lrs), "warmup_epochs": min(10, self.probe_epochs // 5),
                       "select_fraction": self.select_fraction, "seed": seed},
            "knn": {"k": list(self.knn_ks), "temperature": 0.07, "select_fraction": self.select_fraction, "seed": seed},
        }


def smallest_knn_bank(budget: Budget) -> int:
    """The fewest training images whose kNN sweep works: the largest k must fit in what the
    held-out part leaves."""
    from ssl_vit.eval.knn import KNNClassifier

    knn = KNNClassifier(**budget.protocols(seed=0)["knn"])
    return next(n for n in range(max(budget.knn_ks), TRAIN_IMAGES + 1) if knn.bank_shortfall(n) is None)


def pretrain(
    recipe: MethodRecipe, budget: Budget, out_dir: Path, num_workers: int, accelerator: str, progress: bool, seed: int
) -> tuple[Any, dict[str, Any]]:
    """Train one method; returns the module and its training record."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from ssl_vit.data import FashionMNISTDataModule
    from ssl_vit.training.callbacks import PretrainFlopsCounter
    from ssl_vit.training.checkpoint import AtomicCheckpointIO, StepCheckpoint
    from ssl_vit.training.progress import ProgressLog

    L.seed_everything(seed, workers=True, verbose=False)
    views = _import(recipe.views_class)(**recipe.views_args)
    dm = FashionMNISTDataModule(views=views, batch_size=budget.batch_size, num_workers=num_workers, subset=budget.subset, seed=seed)
    model = _import(recipe.model_class)(
        backbone=DEMO_BACKBONE_NAME, backbone_kwargs=dict(DEMO_BACKBONE), num_classes=dm.num_classes, **recipe.model_args
    )
    run_dir = out_dir / "runs" / recipe.method
    steps_per_epoch = max(1, (budget.subset or TRAIN_IMAGES) // budget.batch_size)
    epochs = recipe.epochs if budget.epochs is None else budget.epochs
    max_steps = max(1, round(epochs * steps_per_epoch))
    trainer = L.Trainer(
        max_steps=max_steps,
        max_epochs=-1,
        accelerator=accelerator,
        devices=1,
        logger=TensorBoardLogger(str(out_dir / "tensorboard"), name=recipe.method),
        callbacks=[
            StepCheckpoint(dirpath=str(run_dir / "checkpoints"), every_n_train_steps=max(50, max_steps // 4), keep_last=1),
            PretrainFlopsCounter(),
            *([] if progress else [ProgressLog(name=recipe.method)]),
        ],
        plugins=[AtomicCheckpointIO()],
        default_root_dir=str(run_dir),
        enable_progress_bar=progress,
        enable_model_summary=False,
        log_every_n_steps=10,
        val_check_interval=None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    wall = time.perf_counter() - start
    record = {"steps": trainer.global_step, "epochs": round(trainer.global_step / steps_per_epoch, 3), "wall_time_s": round(wall, 1)}
    flops = trainer.callback_metrics.get("train/pretrain_flops")
    if flops is not None:
        record["flops"] = float(flops)
    return model, record


def evaluate(
    label: str, backbone: Any, budget: Budget, pretrain_record: dict[str, Any], source: str, out_dir: Path, num_workers: int, device: str, seed: int
) -> list[Any]:
    from ssl_vit.data import FashionMNISTDataModule
    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.knn import KNNClassifier
    from ssl_vit.eval.linear import LinearProbe

    protocols = budget.protocols(seed)
    evaluation = Evaluation(["linear", "knn"], linear=LinearProbe(**protocols["linear"]), knn=KNNClassifier(**protocols["knn"]), batch_size=512,
                            train_subset=budget.eval_train, test_subset=budget.eval_test, seed=seed)
    # Beside the method's checkpoints, as `ssl-vit fit` writes a recipe's evaluation: an export of
    # that checkpoint then carries its results (random init: out/results).
    out = (out_dir / "runs" / label if label in RECIPES else out_dir) / "results"
    info = {"method": label, "source": source, "pretrain": pretrain_record}
    return [r for r, _ in evaluation.run(backbone, info, FashionMNISTDataModule(num_workers=num_workers, seed=seed), out, device=device)]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="ssl-vit demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: pretraining on a 4k-image subset (about 1.5 minutes on 2 CPU cores); too short to learn features")
    p.add_argument("--epochs", type=float, default=None, help="pretraining epochs of every method (default: 1.5-2 depending on the method)")
    p.add_argument("--subset", type=int, default=None, help="pretrain on this many training images (default all 60k)")
    p.add_argument("--eval-train", type=int, default=None, help="training images whose features fit the probe and kNN bank (default 20000; --quick 4096)")
    p.add_argument("--eval-test", type=int, default=None, help="test images evaluated (default all 10000; --quick 2000)")
    p.add_argument("--methods", nargs="+", choices=list(RECIPES), default=list(RECIPES), help="which methods to run")
    p.add_argument("--out", default="demo_out", help="output directory (report.md, results.json, PNG, TensorBoard logs)")
    p.add_argument("--num-workers", type=int, default=0, help="data-loading worker processes (0: in the main process, best on 2 cores)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="hide progress bars (hidden anyway when the output is not a terminal)")
    return p


def check_args(args: argparse.Namespace, budget: Budget) -> None:
    """The numeric options, before anything is trained: a value that cannot work is one line now,
    not a failure after the first method's pretraining."""
    from ssl_vit.errors import check_option_values

    def within(low: int, high: int) -> Callable[[Any], bool]:
        return lambda v: v is None or low <= v <= high

    batch_size, bank = budget.batch_size, smallest_knn_bank(budget)
    check_option_values(args, {
        "epochs": (lambda v: v is None or v > 0, "a positive number"),
        # a subset smaller than one batch leaves no full training batch
        "subset": (within(batch_size, TRAIN_IMAGES), f"in {batch_size}..{TRAIN_IMAGES} (at least one batch of {batch_size}, "
                                                     f"at most the {TRAIN_IMAGES} training images)"),
        "eval_train": (within(bank, TRAIN_IMAGES), f"in {bank}..{TRAIN_IMAGES} (enough for the kNN's largest k={max(budget.knn_ks)} "
                                                   f"beside the {budget.select_fraction:.0%} held out to pick k, at most the {TRAIN_IMAGES} training images)"),
        "eval_test": (within(1, TEST_IMAGES), f"in 1..{TEST_IMAGES} (at most the {TEST_IMAGES} test images)"),
        "num_workers": (lambda v: v >= 0, ">= 0"),
        "seed": (within(0, 2**32 - 1), f"in 0..{2**32 - 1}"),
    })


def earlier_run(out: Path) -> list[Path]:
    """What an earlier demo run left in ``out`` that a new one would overwrite: the folders
    holding its checkpoints (``runs/<method>/checkpoints``) and its results (``results.json``)."""
    found = sorted({p.parent for p in out.glob("runs/*/checkpoints/*.ckpt")})
    return found + [p for p in (out / "results.json",) if p.is_file()]


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    budget = Budget.quick() if args.quick else Budget.default()
    check_args(args, budget)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; the demo writes a folder there")
    earlier = earlier_run(out)
    if earlier:
        # The demo has no resume: a run starts every method from scratch, and its checkpoints and
        # results would replace those already here.
        raise FileExistsError(
            f"{out} already holds a demo run (checkpoints and results: {', '.join(map(str, earlier))}), which a new run would overwrite; "
            f"choose another --out, or remove {out} first to start over"
        )

    from ssl_vit.eval.compare import build_comparison, format_text
    from ssl_vit.eval.report import write_report
    from ssl_vit.export import load_any_backbone
    from ssl_vit.io import atomic_write_json

    if args.epochs is not None:
        budget.epochs = args.epochs
    if args.subset is not None:
        budget.subset = args.subset
    if args.eval_train is not None:
        budget.eval_train = args.eval_train
    if args.eval_test is not None:
        budget.eval_test = args.eval_test
    from ssl_vit.runtime import resolve_device

    device = resolve_device(args.device)
    accelerator = "gpu" if device.startswith("cuda") else "cpu"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"[demo] Fashion-MNIST, backbone {DEMO_BACKBONE_NAME} {DEMO_BACKBONE}, {budget}", flush=True)

    results = []
    for name in args.methods:
        t0 = time.perf_counter()
        print(f"[demo] pretraining {name} ...", flush=True)
        model, record = pretrain(RECIPES[name], budget, out, args.num_workers, accelerator, not args.no_progress and sys.stderr.isatty(), args.seed)
        ckpt = out / "runs" / name / "checkpoints" / "last.ckpt"
        print(f"[demo] {name}: {record['steps']} steps in {record['wall_time_s']:.0f} s; evaluating ...", flush=True)
        backbone = model.backbone if name != "dino" else model.teacher_backbone  # DINO evaluates its teacher
        results += evaluate(name, backbone.eval(), budget, record, str(ckpt), out, args.num_workers, device, args.seed)
        print(f"[demo] {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
    random_backbone, _ = load_any_backbone(f"random:{DEMO_BACKBONE_NAME}", backbone_kwargs=dict(DEMO_BACKBONE), seed=args.seed)
    results += evaluate("random", random_backbone, budget, {"steps": 0}, "random", out, args.num_workers, device, args.seed)

    cmp = build_comparison(results)
    print()
    print(format_text(cmp))
    smoke = None
    if args.quick:
        smoke = ("--quick is a smoke run of the whole pipeline: a few dozen pretraining steps learn next "
                 "to nothing, so trained rows can score below random init. The default run is the measurement.")
        print(f"\n[demo] {smoke}")
    paths = write_report(cmp, out / "report.md", note=smoke)
    atomic_write_json(out / "results.json", [r.to_dict() for r in results])
    print(f"\n[demo] finished in {(time.perf_counter() - started) / 60:.1f} min; report: {', '.join(map(str, paths))}; "
          f"results: {out / 'results.json'}; TensorBoard: tensorboard --logdir {out / 'tensorboard'}")
    return 0
