"""ProgressLog: the plain progress lines of runs without a progress bar."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from ssl_vit.training.progress import CountProgress, ProgressLog


@pytest.fixture
def printed(monkeypatch):
    """The lines ProgressLog prints (through Lightning's rank-zero logger), kept."""
    lines: list[str] = []
    monkeypatch.setattr("ssl_vit.training.progress.rank_zero_info", lines.append)
    return lines


def _trainer(step: int, total: float, batches: float = 10, accumulate: int = 1, **metrics) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, estimated_stepping_batches=total, num_training_batches=batches,
                           accumulate_grad_batches=accumulate, callback_metrics={k.replace("__", "/"): torch.tensor(v) for k, v in metrics.items()})


def test_a_line_says_the_step_the_epoch_the_loss_and_the_time_left():
    log = ProgressLog(name="mocov3")
    log._start, log._first_step = 100.0, 0
    # 25 of 100 steps in 300 s: 75 more at 12 s each, 900 s
    line = log.line(_trainer(25, 100, batches=20, train__loss=2.13749), now=400.0)
    assert line == "[ssl_vit] mocov3: step 25/100 (25 %), epoch 1.25, loss 2.137, 5.0 min, about 15.0 min left"
    # a resumed run's rate counts only the steps it took itself: 10 steps (40 -> 50) in 60 s
    log._start, log._first_step = 0.0, 40
    assert log.line(_trainer(50, 100, batches=20), now=60.0).endswith("epoch 2.50, 1.0 min, about 5.0 min left")
    # epochs are counted in optimiser steps (20 batches, 4 per step: 5 steps an epoch)
    assert "epoch 10.00" in log.line(_trainer(50, 100, batches=20, accumulate=4), now=60.0)
    # an epoch's last, partial accumulation is a step too: 10 batches, 4 per step: 3 steps
    assert "epoch 1.00" in log.line(_trainer(3, 100, batches=10, accumulate=4), now=60.0)
    # no known length: no share and no estimate; no step yet: no estimate either
    assert log.line(_trainer(50, float("inf"), batches=float("inf")), now=60.0) == "[ssl_vit] mocov3: step 50, 1.0 min"
    assert log.line(_trainer(40, 100, batches=20), now=1.0) == "[ssl_vit] mocov3: step 40/100 (40 %), epoch 2.00, 0.0 min"


def test_a_resumed_run_estimates_from_the_steps_it_took_itself():
    now = [0.0]
    log = ProgressLog(name="dino", every_n_seconds=60, clock=lambda: now[0])
    trainer = _trainer(900, 1000, batches=100)
    log.on_train_start(trainer, None)  # resumed at step 900
    now[0], trainer.global_step = 60.0, 910  # 10 steps in a minute: 90 more take 9
    assert log.line(trainer, now[0]).endswith("step 910/1000 (91 %), epoch 9.10, 1.0 min, about 9.0 min left")


class _Logged(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"])
        return out


def _fit(callback: ProgressLog, max_steps: int) -> None:
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, max_epochs=-1, limit_train_batches=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(_Logged(), train_dataloaders=torch.utils.data.DataLoader(torch.randn(8, 32), batch_size=2))


def test_lines_come_once_an_interval_has_passed_and_once_at_the_end(printed):
    ticks = iter(range(0, 1000, 25))  # every call of the clock: 25 s later
    _fit(ProgressLog(name="tiny", every_n_seconds=60, clock=lambda: float(next(ticks))), max_steps=6)
    ours = [line for line in printed if line.startswith("[ssl_vit] tiny:")]
    # start 0; batch ends at 25, 50, 75 (line), 100, 125, 150 (line); the end at 175
    assert [line.split(",")[0] for line in ours] == ["[ssl_vit] tiny: step 3/6 (50 %)", "[ssl_vit] tiny: step 6/6 (100 %)",
                                                      "[ssl_vit] tiny: step 6/6 (100 %)"]
    assert ours[0] == f"[ssl_vit] tiny: step 3/6 (50 %), epoch 0.75, loss {float(ours[0].split('loss ')[1].split(',')[0]):.4g}, 1.2 min, about 1.2 min left"
    assert ours[-1].endswith("2.9 min (done)")


def test_a_run_stopped_before_its_end_says_so(printed):
    class Stop(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = trainer.global_step >= 2

    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Stop(), ProgressLog(name="tiny", every_n_seconds=1e9)])
    trainer.fit(_Logged(), train_dataloaders=torch.utils.data.DataLoader(torch.randn(8, 32), batch_size=2))
    ours = [line for line in printed if line.startswith("[ssl_vit] tiny:")]
    assert len(ours) == 1 and ours[0].startswith("[ssl_vit] tiny: step 2/6 (33 %)") and ours[0].endswith("(stopped)")


def test_the_interval_counts_from_the_start_of_training_and_a_line_is_due_at_exactly_one_interval(printed):
    ticks = iter(range(10**6, 10**6 + 1000, 30))  # a monotonic clock far from 0; 30 s per call
    _fit(ProgressLog(name="tiny", every_n_seconds=60, clock=lambda: float(next(ticks))), max_steps=4)
    ours = [line for line in printed if line.startswith("[ssl_vit] tiny:")]
    # start at 0 (relative); batch ends at 30, 60 (line), 90, 120 (line); the end at 150
    assert [line.split(",")[0] for line in ours] == ["[ssl_vit] tiny: step 2/4 (50 %)", "[ssl_vit] tiny: step 4/4 (100 %)",
                                                      "[ssl_vit] tiny: step 4/4 (100 %)"]


def test_counted_work_reports_its_items_share_and_time_left(printed):
    now = [0.0]
    progress = CountProgress("features (train)", total=1000, every_n_seconds=60, clock=lambda: now[0])
    progress.start()
    now[0] = 30.0
    progress.update(100)  # before the first interval: nothing
    assert printed == []
    now[0] = 120.0
    progress.update(150)  # 250 of 1000 in 2 min: 750 more take 6
    assert printed == ["[ssl_vit] features (train): 250/1000 images (25 %), 2.0 min, about 6.0 min left"]
    now[0] = 150.0
    progress.update(250)  # 30 s after the last line: none
    now[0] = 480.0
    progress.update(500)
    progress.finish()
    assert printed[1:] == ["[ssl_vit] features (train): 1000/1000 images (100 %), 8.0 min",
                           "[ssl_vit] features (train): 1000/1000 images (100 %), 8.0 min (done)"]
    # an unknown total: the count and the time only
    unknown = CountProgress("features", total=None, unit="batches", every_n_seconds=0, clock=lambda: 60.0)
    unknown.start()
    unknown.update(3)
    assert printed[-1] == "[ssl_vit] features: 3 batches, 0.0 min"


def test_short_counted_work_prints_nothing_at_all(printed):
    progress = CountProgress("features (test)", total=10, every_n_seconds=60, clock=lambda: 5.0)
    progress.start()
    progress.update(10)
    progress.finish()
    assert printed == []


def test_the_feature_pass_of_an_evaluation_reports_each_split(printed, monkeypatch, tmp_path):
    import functools

    import ssl_vit.eval.evaluate as evaluate
    from ssl_vit.backbones import create_backbone
    from ssl_vit.data import SyntheticDataModule
    from ssl_vit.eval.knn import KNNClassifier

    g = torch.Generator().manual_seed(0)
    train = torch.utils.data.TensorDataset(torch.randn(12, 1, 8, 8, generator=g), torch.arange(12) % 2)
    test = torch.utils.data.TensorDataset(torch.randn(6, 1, 8, 8, generator=g), torch.arange(6) % 2)
    backbone = create_backbone("vit", img_size=8, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2)
    dm = SyntheticDataModule(num_classes=2, num_workers=0)
    dm.eval_datasets = lambda train_views=None: (train, test)
    monkeypatch.setattr(evaluate, "CountProgress", functools.partial(evaluate.CountProgress, every_n_seconds=0))
    evaluate.Evaluation(["knn"], knn=KNNClassifier(k=2), batch_size=5).run(backbone, {"method": "random"}, dm, tmp_path)
    # every batch a line (interval 0), then the last again as done: 5 + 5 + 2 train images, 5 + 1 test
    counts = [line.split(": ", 1)[1].split(" images")[0] for line in printed]
    assert [line.split(":")[0] for line in printed] == ["[ssl_vit] features (train)"] * 4 + ["[ssl_vit] features (test)"] * 3
    assert counts == ["5/12", "10/12", "12/12", "12/12", "5/6", "6/6", "6/6"]
    assert printed[3].endswith("(done)") and printed[-1].endswith("(done)")


def test_the_linear_probe_reports_its_epochs_and_a_sweep_its_heads(printed):
    from ssl_vit.eval.linear import LinearProbe

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 8, generator=g), torch.arange(40) % 2
    LinearProbe(epochs=3, batch_size=8, base_lr=0.1, warmup_epochs=0, progress_every_n_seconds=0).fit(x, y, 2)
    assert [line.split(", ")[0] for line in printed] == [f"[ssl_vit] linear probe: {e}/3 epochs ({p} %)" for e, p in ((1, 33), (2, 67), (3, 100), (3, 100))]
    assert printed[-1].endswith("(done)")
    printed.clear()
    LinearProbe(epochs=2, batch_size=8, base_lr=[0.1, 1.0], warmup_epochs=0, progress_every_n_seconds=0).evaluate(x, y, x, y, 2)
    # the sweep's two heads on the training part, then the one picked on all of it
    assert [line.split(": ")[0] for line in printed] == ["[ssl_vit] linear probe, 2 LRs"] * 3 + ["[ssl_vit] linear probe"] * 3
    printed.clear()
    LinearProbe(epochs=2, batch_size=8, base_lr=0.1, warmup_epochs=0).fit(x, y, 2)  # a minute between lines: a short run prints none
    assert printed == []


def test_progress_says_no_share_of_nothing_and_a_restarted_count_starts_from_0(printed):
    log = ProgressLog(name="x")
    log._start, log._first_step = 0.0, 0
    assert log.line(_trainer(0, 0, batches=0), now=60.0) == "[ssl_vit] x: step 0/0, 1.0 min"  # no share, no epoch of 0 steps
    # a restarted count starts from 0
    progress = CountProgress("features", total=10, every_n_seconds=0, clock=lambda: 0.0)
    progress.start()
    progress.update(5)
    progress.start()
    progress.update(2)
    assert printed[-1].startswith("[ssl_vit] features: 2/10 images (20 %)")
