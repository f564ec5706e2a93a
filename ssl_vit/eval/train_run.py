"""The run of the evaluations that train on images: a Lightning Trainer over a resumable, seeded
training order, then the test; checkpointed atomically into ``<run_dir>/checkpoints``, stopped
after a step by SIGTERM / SIGUSR1 (:class:`EvalRunInterrupted`), and resumed to the weights the
uninterrupted run reaches; a checkpoint of another run, backbone or settings is refused in one line.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy

from ssl_vit.backbones.registry import kwargs_differences
from ssl_vit.data.datasets import TransformedDataset
from ssl_vit.data.sampler import ResumableLoader, ResumableSampler, SeededIndex
from ssl_vit.runtime import release_process_group
from ssl_vit.training.checkpoint import (
    AtomicCheckpointIO,
    StepCheckpoint,
    load_record,
    newest_checkpoint,
)
from ssl_vit.training.preemption import PreemptionCheckpoint
from ssl_vit.training.progress import ProgressLog


@dataclass
class ImageRun:
    """Where and how a run on images trains: Lightning's ``accelerator``, ``devices`` (processes on this
    machine, DDP), ``num_nodes`` and ``precision``; the seed of its order and draws; its ``run_dir``."""

    accelerator: str = "auto"
    devices: int | list[int] = 1
    num_nodes: int = 1
    precision: str = "32-true"
    num_workers: int = 0
    seed: int = 0
    run_dir: str | Path | None = None
    resume: bool = False


class EvalRunInterrupted(RuntimeError):
    """A signal stopped a run on images after a step; the same call with ``resume`` continues it."""

    def __init__(self, what: str, signal_name: str, step: int, checkpoint: Path, rank: int = 0) -> None:
        super().__init__(f"{what} stopped by {signal_name} at step {step}; its checkpoint: {checkpoint}")
        self.signal_name, self.step, self.checkpoint, self.rank = signal_name, step, checkpoint, rank


class ImageClassifier(L.LightningModule):
    """The classifiers trained on images: items labelled -1 (unreadable files) neither train nor count;
    a test pass logs ``test_top1`` (and ``test_top5`` with >= 5 classes)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.test_acc = nn.ModuleDict({f"top{k}": MulticlassAccuracy(num_classes, top_k=k, average="micro") for k in (1, 5) if k == 1 or num_classes >= 5})

    def on_before_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        x, y = batch
        return batch if bool((y >= 0).all()) else (x[y >= 0], y[y >= 0])

    def nothing_to_learn(self) -> Tensor | None:
        """``training_step``'s return for a batch with nothing to learn from: None (Lightning skips
        the step), or under DDP, where every process joins the gradient reduction, a zero loss of every parameter."""
        if self._trainer is None or self._trainer.world_size <= 1:
            return None
        return torch.stack([p.sum() for p in self.parameters() if p.requires_grad]).sum() * 0.0

    def on_fit_start(self) -> None:
        self.train()  # Lightning keeps each module's mode: a backbone handed over in eval mode would train so (a probe's train() keeps it frozen)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        if len(y):  # (a batch of unreadable files only: nothing to count)
            logits = self(x)
            for name, metric in self.test_acc.items():
                metric.update(logits, y)
                self.log(f"test_{name}", metric, on_epoch=True)


class _PlainIndex(Dataset):
    """A dataset indexed by int under a sampler of ``SeededIndex`` items (only ``TransformedDataset`` reads them)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: SeededIndex | int) -> Any:
        return self.dataset[index.index if isinstance(index, SeededIndex) else index]


def training_loader(train_ds: Dataset, sampler: ResumableSampler, batch_size: int, num_workers: int) -> ResumableLoader:
    """One process's resumable loader: full batches, or the one short batch of a share smaller than one."""
    return ResumableLoader(train_ds if isinstance(train_ds, TransformedDataset) else _PlainIndex(train_ds), sampler=sampler,
                           batch_size=batch_size, drop_last=sampler.num_samples > batch_size, num_workers=num_workers)


def train_and_test(make_module: Callable[[int, int, int], L.LightningModule], train_ds: Dataset, test_ds: Dataset, settings: Any,
                   run: ImageRun, what: str, origin: Mapping[str, Any] | None = None) -> dict[str, float] | None:
    """Train ``make_module(total_steps, steps_per_epoch, world_size)`` for ``settings.epochs``, then
    return its test ``{"top1", "top5"}``. Under DDP process 0 alone tests, on the whole split (a
    distributed test would count padded images twice); the others return None."""
    L.seed_everything(run.seed, workers=True, verbose=False)
    callbacks: list[L.Callback] = [ProgressLog(name=what)]
    newest = held = None
    if run.run_dir is not None:
        checkpoints = Path(run.run_dir).expanduser().resolve() / "checkpoints"
        if (newest := newest_checkpoint(checkpoints)) is not None and (held := read_checkpoint(newest)) is not None:
            if (kind := run_kind(held)) not in (None, f"{what} run"):
                raise ValueError(f"--run-dir {checkpoints.parent} holds a {kind}, not a {what} run: choose another --run-dir")
        if not run.resume and newest is not None:
            raise ValueError(f"{checkpoints} already holds a {what} run's checkpoints (newest: {newest.name}): continue it with --resume, "
                             "or choose another --run-dir")
        callbacks += [StepCheckpoint(dirpath=str(checkpoints), every_n_train_steps=settings.checkpoint_every, keep_last=1), PreemptionCheckpoint()]
    trainer = L.Trainer(max_epochs=settings.epochs, max_steps=settings.max_steps, accelerator=run.accelerator, devices=run.devices,
                        num_nodes=run.num_nodes, precision=run.precision, logger=False, enable_checkpointing=run.run_dir is not None,
                        callbacks=callbacks, plugins=[AtomicCheckpointIO()] if run.run_dir is not None else [], enable_model_summary=False,
                        enable_progress_bar=False, default_root_dir=run.run_dir, num_sanity_val_steps=0)
    # The training order: shuffled per (seed, epoch), sharded over the processes, resumable.
    sampler = ResumableSampler(train_ds, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=True, seed=run.seed)
    train_loader = training_loader(train_ds, sampler, settings.batch_size, run.num_workers)
    per_epoch = max(1, len(train_loader))
    total = settings.epochs * per_epoch if settings.max_steps < 0 else min(settings.max_steps, settings.epochs * per_epoch)
    module = make_module(total, per_epoch, trainer.world_size)
    # The run's settings, kept in its checkpoints: a resume restores optimiser and schedule, so others are refused.
    module.hparams.update(epochs=settings.epochs, max_steps=settings.max_steps, seed=run.seed, **({"origin": dict(origin)} if origin else {}))
    if held is not None and run.resume:  # said before Lightning loads it
        other = "was fine-tuned from another backbone" if what == "fine-tuning" else f"is a {what} run of another backbone or setting"
        for trained, difference in ((other, resume_difference(module, held)),
                                    (f"is a {what} run started with other settings", settings_difference(held.get("hyper_parameters"), module.hparams))):
            if difference is not None:
                raise ValueError(f"--run-dir {run.run_dir} {trained}: {difference}; resume it with the command that started it, or choose another --run-dir")
    held = None  # (its file mapping closed before the run replaces the file)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")  # (resuming: its own files)
        try:
            trainer.fit(module, train_dataloaders=train_loader, ckpt_path=str(newest) if run.resume else None)
        except SIGTERMException:
            pass  # stopped after the current step; PreemptionCheckpoint saved it
    if (stopped := next((cb.stopped_by for cb in callbacks if isinstance(cb, PreemptionCheckpoint)), None)) is not None:
        release_process_group()  # every process stopped at the same step
        raise EvalRunInterrupted(what, stopped, trainer.global_step, PreemptionCheckpoint.last_path(trainer), trainer.global_rank)
    if trainer.world_size > 1:
        release_process_group()  # (every process ended at the same step; the test is process 0's alone)
        if trainer.global_rank != 0:
            return None
        root = trainer.strategy.root_device
        trainer = L.Trainer(accelerator=run.accelerator, devices=[root.index] if root.type == "cuda" else 1, precision=run.precision,
                            logger=False, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    (metrics,) = trainer.test(module, dataloaders=DataLoader(test_ds, batch_size=settings.batch_size, num_workers=run.num_workers), verbose=False)
    return {k.removeprefix("test_"): float(v) for k, v in metrics.items() if k.startswith("test_top")}


def read_checkpoint(path: Path) -> dict[str, Any] | None:
    """A run's checkpoint, tensors memory-mapped; None when it is not one (Lightning then says why)."""
    try:
        checkpoint = load_record(path)
    except Exception:  # not a checkpoint of this torch: left to Lightning's loading
        return None
    return checkpoint if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), Mapping) else None


def run_kind(checkpoint: Mapping[str, Any]) -> str | None:
    """``"pretraining run of <method>"`` (``ssl-vit fit``), ``"fine-tuning run"`` (a method ending in
    ``finetune``), ``"linear probe run"`` (a head alone); None when the checkpoint does not say."""
    info = checkpoint.get("ssl_vit") if isinstance(checkpoint.get("ssl_vit"), Mapping) else {}
    if (method := str(info.get("method") or "")).endswith("finetune"):
        return "fine-tuning run"
    if method and info.get("backbone"):
        return f"pretraining run of {method}"
    keys = list(checkpoint["state_dict"])
    return "linear probe run" if keys and all(k.startswith("head.") for k in keys) else None


def resume_difference(module: L.LightningModule, checkpoint: Mapping[str, Any]) -> str | None:
    """How ``checkpoint`` differs from what ``module`` saves (architecture and method, else weights); None if not."""
    ours: dict[str, Any] = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(ours)
    mine, theirs = ours.get("ssl_vit") or {}, checkpoint.get("ssl_vit") if isinstance(checkpoint.get("ssl_vit"), Mapping) else {}
    if mine and theirs:
        said = [] if theirs.get("backbone") == mine.get("backbone") else [f"{theirs.get('backbone')} there, {mine.get('backbone')} here"]
        said += kwargs_differences(theirs.get("backbone_kwargs") or {}, mine.get("backbone_kwargs") or {})
        said += [f"method {theirs.get('method')} there, {mine.get('method')} here"] if theirs.get("method") != mine.get("method") else []
        if said:
            return "; ".join(said)
    saved, expected = checkpoint["state_dict"], ours["state_dict"]
    reshaped = [k for k in expected if k in saved and tuple(getattr(saved[k], "shape", ())) != tuple(expected[k].shape)]
    missing, extra = [k for k in expected if k not in saved], [k for k in saved if k not in expected]
    said = [f"{len(reshaped)} weights of other shapes (e.g. {reshaped[0]}: {list(saved[reshaped[0]].shape)} there, "
            f"{list(expected[reshaped[0]].shape)} here)"] if reshaped else []
    said += [f"{len(missing)} weights missing there (e.g. {missing[0]})"] if missing else []
    said += [f"{len(extra)} weights this run lacks (e.g. {extra[0]})"] if extra else []
    return "; ".join(said) or None


def settings_difference(saved: Mapping[str, Any] | None, settings: Mapping[str, Any]) -> str | None:
    """``"base_lr: 0.0005 there, 0.05 here; ..."``; None when they agree (or the checkpoint records
    none). A setting the record lacks (one added later) agrees while it is off here (0, None, False)."""
    if not isinstance(saved, Mapping):
        return None
    return "; ".join(kwargs_differences(saved, {k: v for k, v in settings.items() if k in saved or v})) or None
