"""The collapse monitor: DINO's two collapses and a representation that loses its spread reach the
console once, with the step, the figure and what to try; a healthy run says nothing."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from helpers import SMALL_HEADS, TINY_BACKBONE, VIEW_SIZES, fit_steps, fixed_views
from torch import nn

from ssl_vit.cli import main as cli_main
from ssl_vit.methods import DINO
from ssl_vit.training.callbacks import CollapseMonitor

K, D = 256, 32


class Scripted(L.LightningModule):
    """Logs the monitors' figures from a script, one step at a time."""

    def __init__(self, entropy: list[float], std: list[float]) -> None:
        super().__init__()
        self.save_hyperparameters({"out_dim": K})
        self.backbone = nn.Linear(D, D)  # embed_dim: D
        self.backbone.embed_dim = D
        self.entropy, self.std = entropy, std

    def training_step(self, batch, i):
        self.log("train/teacher_entropy", self.entropy[self.global_step])
        self.log("train/embedding_std", self.std[self.global_step])
        return self.backbone(batch).sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _run(entropy: list[float], std: list[float]) -> None:
    trainer = L.Trainer(max_steps=len(entropy), accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[CollapseMonitor(window=5)])
    trainer.fit(Scripted(entropy, std), torch.utils.data.DataLoader(torch.zeros(len(entropy), D), batch_size=1))


HEALTHY_STD = 1 / math.sqrt(D)
LN_K = math.log(K)


@pytest.mark.parametrize("entropy, std, says", [
    ([0.7 * LN_K] * 12, [HEALTHY_STD] * 12, None),  # a healthy run
    ([LN_K] * 4 + [0.7 * LN_K] + [LN_K] * 4, [HEALTHY_STD] * 9, None),  # never five steps in a row
    ([LN_K] * 12, [HEALTHY_STD] * 12, "at step 5: the teacher's entropy is 5.545, at ln K = 5.545 (uniform collapse"),
    ([0.01] * 12, [HEALTHY_STD] * 12, "at step 5: the teacher's entropy is 0.010, near 0 (collapse onto one prototype"),
    ([0.7 * LN_K] * 12, [0.001] * 12, "at step 5: the embedding std is 0.0010, near 0 (healthy: about 1/sqrt(32) = 0.177"),
])
def test_a_sustained_collapse_is_said_once_with_the_step_the_figure_and_what_to_try(entropy, std, says, capsys):
    _run(entropy, std)
    lines = [line for line in capsys.readouterr().err.splitlines() if "collapsed" in line]
    if says is None:
        assert lines == []
    else:
        assert len(lines) == 1 and says in lines[0] and "try: normalise with the data's own statistics" in lines[0]


@pytest.mark.parametrize("craft, says", [
    ("uniform", "uniform collapse"),  # a teacher whose bottleneck is 0: every output the same flat one
    ("one-prototype", "collapse onto one prototype"),  # a centre far below one prototype: the teacher picks it always
])
def test_a_dino_run_crafted_to_collapse_says_so(craft, says, capsys):
    model = DINO(**TINY_BACKBONE, **SMALL_HEADS["dino"], center_momentum=1.0, base_lr=1e-9, warmup_epochs=0)
    if craft == "uniform":
        for m in (model.head, model.teacher_head):
            nn.init.zeros_(m.mlp[-1].weight), nn.init.zeros_(m.mlp[-1].bias)
    else:
        model.criterion.center[..., 0] = -1e3
    views, labels = fixed_views(VIEW_SIZES["dino"], batch=8)
    fit_steps(model, views, labels, steps=6, callbacks_extra=[CollapseMonitor(window=5)])
    assert says in capsys.readouterr().err


def _shapes_folder(root, per_class: int, seed: int = 0):
    """``root/<shape>/<i>.png``: 28-px grey discs, rings, squares, frames, pluses, crosses, bars and
    triangles, each at a random place, size and brightness on a noisy background."""
    from PIL import Image, ImageDraw

    rng = torch.Generator().manual_seed(seed)

    def draw(shape: str, d: ImageDraw.ImageDraw, x: float, y: float, r: float, v: int) -> None:
        box = (x - r, y - r, x + r, y + r)
        {"disc": lambda: d.ellipse(box, fill=v), "ring": lambda: d.ellipse(box, outline=v, width=2),
         "square": lambda: d.rectangle(box, fill=v), "frame": lambda: d.rectangle(box, outline=v, width=2),
         "plus": lambda: (d.line((x - r, y, x + r, y), fill=v, width=2), d.line((x, y - r, x, y + r), fill=v, width=2)),
         "cross": lambda: (d.line((x - r, y - r, x + r, y + r), fill=v, width=2), d.line((x - r, y + r, x + r, y - r), fill=v, width=2)),
         "bar": lambda: d.rectangle((x - r, y - r / 3, x + r, y + r / 3), fill=v),
         "triangle": lambda: d.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=v)}[shape]()

    for shape in ("disc", "ring", "square", "frame", "plus", "cross", "bar", "triangle"):
        (root / shape).mkdir(parents=True)
        for i in range(per_class):
            u = torch.rand(5, generator=rng).tolist()
            noise = (torch.rand(28, 28, generator=rng) * 60).to(torch.uint8).numpy()
            img = Image.fromarray(noise, mode="L")
            draw(shape, ImageDraw.Draw(img), 9 + 10 * u[0], 9 + 10 * u[1], 5 + 4 * u[2], int(140 + 115 * u[3]))
            img.save(root / shape / f"{i}.png")
    return root


def test_the_dino_recipe_trains_on_a_small_folder_of_its_own(tmp_path, capsys):
    # A folder of one's own (2k images), 150 steps: the shipped DINO recipe's loss leaves ln K,
    # nothing is said about collapse, and its teacher's kNN beats the random-init backbone's by 10
    # points. (Without BatchNorm in the head and the sharper teacher, the centred run sits at ln K
    # and its kNN is the random backbone's.)
    train, val = _shapes_folder(tmp_path / "train", 250), _shapes_folder(tmp_path / "val", 50, seed=1)
    recipe = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "fashion_mnist" / "dino.yaml").read_text())
    small = {"img_size": 28, "patch_size": 7, "in_chans": 1, "embed_dim": 64, "depth": 2, "num_heads": 2}
    # as the README's own-data section and the start line say for 150 steps: a 20-step warm-up, a faster teacher
    recipe["model"]["init_args"] |= {"backbone_kwargs": small, "warmup_steps": 20, "momentum": 0.93}
    recipe["trainer"] |= {"max_steps": 150, "default_root_dir": str(tmp_path / "run"), "enable_progress_bar": False, "accelerator": "cpu",
                          "logger": {"class_path": "CSVLogger", "init_args": {"save_dir": str(tmp_path), "name": "log"}}}
    recipe["data"] = {"class_path": "ImageFolderDataModule", "init_args": {
        "train_dir": str(train), "val_dir": str(val), "img_size": 28, "in_chans": 1, "batch_size": 64, "num_workers": 0,
        "views": recipe["data"]["init_args"]["views"]}}
    recipe["evaluate"] = {"protocols": ["knn"], "knn": {"k": 20}}
    (tmp_path / "dino.yaml").write_text(yaml.safe_dump(recipe))
    assert cli_main(["fit", "--config", str(tmp_path / "dino.yaml")]) == 0
    assert "collapsed" not in capsys.readouterr().err
    rows = [r for r in csv.DictReader((tmp_path / "log" / "version_0" / "metrics.csv").open()) if r.get("train/loss")]
    # (Sinkhorn-Knopp spreads each target over at least K / N prototypes, N the teacher's outputs per
    # step, so the loss stays well above 0: a uniform student's is ln K.)
    assert sum(float(r["train/loss"]) for r in rows[-3:]) / 3 < math.log(recipe["model"]["init_args"]["out_dim"]) - 0.25
    assert cli_main(["eval", "knn", "--backbone", "random:vit", "--backbone-kwargs", json.dumps(small), "--k", "20", "--data", "imagefolder",
                     "--data-arg", f"train_dir={train}", "--data-arg", f"val_dir={val}", "--data-arg", "in_chans=1", "--data-arg", "img_size=28",
                     "--out", str(tmp_path / "random.json")]) == 0
    (dino,) = [json.loads(p.read_text())["metrics"]["top1"] for p in (tmp_path / "run" / "results").glob("*knn*.json")]
    assert dino > json.loads((tmp_path / "random.json").read_text())["metrics"]["top1"] + 0.1
