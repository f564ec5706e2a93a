"""The collapse monitor: DINO's two collapses and a representation that loses its spread reach the
console once, with the step, the figure and what to try; a healthy run says nothing."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from helpers import SMALL_HEADS, TINY_BACKBONE, VIEW_SIZES, fit_steps, fixed_views
from torch import nn

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
