"""The training run of the evaluators that train on images (fine-tuning, the linear probe on
augmented images): a Lightning Trainer over a resumable, seeded training order, then the test.

With ``run_dir``, the run is checkpointed (atomically) into ``<run_dir>/checkpoints`` every
``checkpoint_every`` steps and at the end, a SIGTERM / SIGUSR1 saves after the current step and
raises :class:`EvalRunInterrupted`, and ``resume=True`` continues from the newest checkpoint
there to the weights the uninterrupted run would have reached (the data order, augmentations and
random draws are functions of the position in training).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
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
from ssl_vit.training.checkpoint_io import AtomicCheckpointIO
from ssl_vit.training.preemption import PreemptionCheckpoint
from ssl_vit.training.progress import ProgressLog
from ssl_vit.training.step_checkpoint import StepCheckpoint, load_record, newest_checkpoint

ModuleFactory = Callable[[int, int, int], L.LightningModule]
"""``(total_steps, steps_per_epoch, world_size) -> module``: the module to train, its LR schedule
sized by the run (known before a resumed run restores its position in the data) and its LR
scaled by the global batch (``batch_size`` per process x ``world_size`` processes)."""


def drop_unlabelled_batch(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """A batch without its items labelled -1 (an evaluation split's unreadable files,
    ``ImageFiles.for_evaluation``), on the host: they neither train nor count in the accuracy."""
    x, y = batch
    keep = y >= 0  # [B]
    return batch if bool(keep.all()) else (x[keep], y[keep])


def nothing_to_learn(module: L.LightningModule) -> Tensor | None:
    """``training_step``'s return for a batch with nothing to learn from (its images unreadable,
    too few for a BatchNorm): ``None``, so Lightning skips the step, on one process. Under DDP,
    where every process must join the backward's gradient reduction (and Lightning refuses
    ``None``), a zero that reaches every trainable parameter: this process adds a zero gradient
    to the average, and the step goes on with the others' batches."""
    trainer = module._trainer
    if trainer is None or trainer.world_size <= 1:
        return None
    return torch.stack([p.sum() for p in module.parameters() if p.requires_grad]).sum() * 0.0


def accuracy_metrics(num_classes: int) -> nn.ModuleDict:
    """Top-1 (and top-5 with >= 5 classes) accuracy over a test pass, as ``test_top1`` ... logs them."""
    ks = (1, 5) if num_classes >= 5 else (1,)
    return nn.ModuleDict({f"top{k}": MulticlassAccuracy(num_classes, top_k=k, average="micro") for k in ks})


def log_accuracy(module: L.LightningModule, metrics: nn.ModuleDict, logits: Tensor, labels: Tensor, prefix: str) -> None:
    for name, metric in metrics.items():
        metric.update(logits, labels)
        module.log(f"{prefix}_{name}", metric, on_epoch=True)


class EvalRunInterrupted(RuntimeError):
    """A signal (SIGTERM, SIGUSR1) stopped an evaluator's training run after a step; its state is
    in ``checkpoint`` and the same call with ``resume=True`` continues it."""

    def __init__(self, what: str, signal_name: str, step: int, checkpoint: Path, rank: int = 0) -> None:
        super().__init__(f"{what} stopped by {signal_name} at step {step}; its checkpoint: {checkpoint}")
        self.signal_name, self.step, self.checkpoint, self.rank = signal_name, step, checkpoint, rank


class _PlainIndex(Dataset):
    """A dataset indexed by int under a sampler of ``SeededIndex`` items (only a
    ``TransformedDataset`` seeds its augmentations from them)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: SeededIndex | int) -> Any:
        return self.dataset[index.index if isinstance(index, SeededIndex) else index]


def training_loader(train_ds: Dataset, sampler: ResumableSampler, batch_size: int, num_workers: int) -> ResumableLoader:
    """The resumable training loader of one process: full batches only where the process's share
    of the epoch holds more than one (else the one short batch there is, not none)."""
    return ResumableLoader(
        train_ds if isinstance(train_ds, TransformedDataset) else _PlainIndex(train_ds), sampler=sampler,
        batch_size=batch_size, drop_last=sampler.num_samples > batch_size, num_workers=num_workers,
    )


def train_and_test(
    make_module: ModuleFactory,
    train_ds: Dataset,
    test_ds: Dataset,
    *,
    what: str,
    epochs: int,
    batch_size: int,
    max_steps: int = -1,
    num_workers: int = 0,
    accelerator: str = "auto",
    devices: int | str = 1,
    num_nodes: int = 1,
    precision: str = "32-true",
    seed: int = 0,
    default_root_dir: str | None = None,
    enable_progress_bar: bool = False,
    run_dir: str | Path | None = None,
    resume: bool = False,
    checkpoint_every: int = 500,
    origin: Mapping[str, Any] | None = None,
) -> dict[str, float] | None:
    """Train the module ``make_module`` builds on ``train_ds`` for ``epochs`` (capped at
    ``max_steps``), then return its test metrics whose names start with ``test_top``, without
    that prefix (``{"top1", "top5"}``). ``what`` names the run in its messages.

    With several processes (``devices`` x ``num_nodes``; DDP, Lightning starts the processes on
    one machine as it does for ``ssl-vit fit``) ``batch_size`` is per process and each takes its
    share of every epoch; the test runs on the whole test split in process 0, which returns the
    metrics, while the others return None (a distributed test would pad the split to a multiple of
    the processes and count some images twice).

    ``origin``: what the trained backbone came from (its pretraining step): a resume from a
    checkpoint of a run on other weights is refused, as one with other settings is."""
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"need epochs >= 1 and batch_size >= 1, got {epochs} and {batch_size}")
    if checkpoint_every < 1 or not (max_steps == -1 or max_steps >= 1):
        raise ValueError(f"need checkpoint_every >= 1 and max_steps -1 (no cap) or >= 1, got {checkpoint_every} and {max_steps}")
    if resume and run_dir is None:
        raise ValueError("resume needs the run_dir of the run to continue")
    L.seed_everything(seed, workers=True, verbose=False)
    callbacks: list[L.Callback] = []
    plugins: list[Any] = []
    ckpt_path = None
    held = None  # the checkpoint to resume from, memory-mapped, to be checked against this run
    if run_dir is not None:
        run_dir = Path(run_dir).expanduser().resolve()
        ckpt_dir = run_dir / "checkpoints"
        newest = newest_checkpoint(ckpt_dir)
        held = None if newest is None else read_checkpoint(newest)
        other = None if held is None else other_run(held, what)
        if other is not None:
            raise ValueError(f"--run-dir {run_dir} holds {other}, not a {what} run: choose another --run-dir")
        if resume:
            if newest is None:
                raise FileNotFoundError(f"resume: no {what} checkpoint in {ckpt_dir}")
            ckpt_path = str(newest)
        elif newest is not None:
            raise ValueError(f"{ckpt_dir} already holds a {what} run's checkpoints (newest: {newest.name}): "
                             "continue it with --resume, or choose another --run-dir")
        callbacks = [StepCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=checkpoint_every, keep_last=1), PreemptionCheckpoint()]
        plugins = [AtomicCheckpointIO()]
    if not enable_progress_bar:  # a line every minute rather than silence through a long run
        callbacks.append(ProgressLog(name=what))
    trainer = L.Trainer(
        max_epochs=epochs,
        max_steps=max_steps,
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        precision=precision,
        logger=False,
        enable_checkpointing=run_dir is not None,
        callbacks=callbacks,
        plugins=plugins,
        enable_model_summary=False,
        enable_progress_bar=enable_progress_bar,
        default_root_dir=str(run_dir) if run_dir is not None else default_root_dir,
        num_sanity_val_steps=0,
    )
    # The training order: shuffled per (seed, epoch), sharded over the processes, resumable.
    sampler = ResumableSampler(train_ds, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=True, seed=seed)
    train_loader = training_loader(train_ds, sampler, batch_size, num_workers)
    test_loader = DataLoader(test_ds, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    per_epoch = max(1, len(train_loader))
    total = epochs * per_epoch if max_steps < 0 else min(max_steps, epochs * per_epoch)
    module = make_module(total, per_epoch, trainer.world_size)
    # What the run was started with: a resume restores its optimiser and LR schedule, so other
    # settings would not run, while the record would claim them.
    settings = {"epochs": epochs, "max_steps": max_steps, "seed": seed, **dict(module.hparams),
                **({"origin": dict(origin)} if origin is not None else {})}
    trainer.callbacks.append(_RunSettings(settings))
    if held is not None and ckpt_path is not None:
        difference = resume_difference(module, held)
        trained = "was fine-tuned from another backbone" if what == "fine-tuning" else f"is a {what} run of another backbone or setting"
        if difference is None:
            difference = settings_difference(held.get(_RunSettings.KEY), settings)
            trained = f"is a {what} run started with other settings"
        if difference is not None:  # said before Lightning loads it (and lists every key)
            raise ValueError(f"--run-dir {run_dir} {trained}: {difference}; resume it with the command that started it, or choose another --run-dir")
    held = None  # (its file mapping closed before the run replaces the file)
    with warnings.catch_warnings():
        if ckpt_path is not None:  # the directory holds this run's own files
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        try:
            trainer.fit(module, train_dataloaders=train_loader, ckpt_path=ckpt_path)
        except SIGTERMException:
            pass  # stopped after the current step; PreemptionCheckpoint saved it
    preemption = next((cb for cb in callbacks if isinstance(cb, PreemptionCheckpoint)), None)
    if preemption is not None and preemption.stopped_by:
        release_process_group()  # every process stopped at the same step
        raise EvalRunInterrupted(what, preemption.stopped_by, trainer.global_step, PreemptionCheckpoint.last_path(trainer), trainer.global_rank)
    if trainer.world_size > 1:
        # Every process ended the run at the same step: the group goes (the test below is one
        # process's, and torchmetrics would otherwise try to synchronise it with the others).
        release_process_group()
        if trainer.global_rank != 0:
            return None
        trainer = L.Trainer(accelerator=accelerator, devices=_first_device(trainer), precision=precision, logger=False,
                            enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=enable_progress_bar)
    (metrics,) = trainer.test(module, dataloaders=test_loader, verbose=False)
    return {k.removeprefix("test_"): float(v) for k, v in metrics.items() if k.startswith("test_top")}


def read_checkpoint(path: Path) -> dict[str, Any] | None:
    """A run's checkpoint, its tensors memory-mapped (not read); None when it is not one (Lightning
    then says why it cannot load it)."""
    try:
        checkpoint = load_record(path)
    except Exception:  # not a checkpoint of this torch: left to Lightning's loading
        return None
    return checkpoint if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), Mapping) else None


def run_kind(checkpoint: Mapping[str, Any]) -> str | None:
    """What kind of run wrote ``checkpoint``: ``"pretraining run of <method>"`` (``ssl-vit fit``),
    ``"fine-tuning"`` (``FineTuneModule``: a method ending in ``finetune``), ``"linear probe"``
    (``AugmentedLinearProbe``: a head without the frozen backbone); None when it does not say."""
    record = checkpoint.get("ssl_vit") if isinstance(checkpoint.get("ssl_vit"), Mapping) else {}
    method = record.get("method")
    if isinstance(method, str) and method.endswith("finetune"):
        return "fine-tuning"
    if isinstance(method, str) and method and record.get("backbone"):
        return f"pretraining run of {method}"
    keys = list(checkpoint["state_dict"])
    if keys and all(k.startswith("head.") for k in keys):
        return "linear probe"
    return None


def other_run(checkpoint: Mapping[str, Any], what: str) -> str | None:
    """``"a pretraining run of MPP"`` ... when ``checkpoint`` is of another kind of run than ``what``."""
    kind = run_kind(checkpoint)
    return None if kind is None or kind == what else f"a {kind}" + ("" if kind.startswith("pretraining") else " run")


def resume_difference(module: L.LightningModule, checkpoint: Mapping[str, Any]) -> str | None:
    """How ``checkpoint`` differs from what ``module`` would save (its architecture and method as
    recorded, else its weights' names and shapes); None when it can resume from it."""
    ours: dict[str, Any] = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(ours)  # what this run's checkpoints hold
    mine, theirs = ours.get("ssl_vit") or {}, checkpoint.get("ssl_vit") if isinstance(checkpoint.get("ssl_vit"), Mapping) else {}
    if mine and theirs:
        said = []
        if theirs.get("backbone") != mine.get("backbone"):
            said.append(f"{theirs.get('backbone')} there, {mine.get('backbone')} here")
        said += kwargs_differences(theirs.get("backbone_kwargs") or {}, mine.get("backbone_kwargs") or {})
        if theirs.get("method") != mine.get("method"):
            said.append(f"method {theirs.get('method')} there, {mine.get('method')} here")
        if said:
            return "; ".join(said)
    saved, expected = checkpoint["state_dict"], ours["state_dict"]
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    reshaped = [k for k in expected if k in saved and tuple(getattr(saved[k], "shape", ())) != tuple(expected[k].shape)]
    said = []
    if reshaped:
        k = reshaped[0]
        said.append(f"{len(reshaped)} weights of other shapes (e.g. {k}: {list(saved[k].shape)} there, {list(expected[k].shape)} here)")
    if missing:
        said.append(f"{len(missing)} weights missing there (e.g. {missing[0]})")
    if extra:
        said.append(f"{len(extra)} weights this run lacks (e.g. {extra[0]})")
    return "; ".join(said) or None


class _RunSettings(L.Callback):
    """Writes the run's settings into its checkpoints (``checkpoint["ssl_vit_run"]``)."""

    KEY = "ssl_vit_run"

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[self.KEY] = dict(self.settings)


def settings_difference(saved: Mapping[str, Any] | None, settings: Mapping[str, Any]) -> str | None:
    """``"base_lr: 0.0005 there, 0.05 here; ..."`` for the settings a checkpoint's run was started
    with and this one's; None when they agree (or the checkpoint predates the record). A setting
    the record lacks (one added in a later version) counts as agreed while it is off here (0,
    None, False: the run was started without it)."""
    if not isinstance(saved, Mapping):
        return None
    here = {k: v for k, v in settings.items() if k in saved or v}
    return "; ".join(kwargs_differences(saved, here)) or None


def _first_device(trainer: L.Trainer) -> int | list[int]:
    """The device process 0 trained on, for a one-device trainer (CUDA: its index)."""
    device = trainer.strategy.root_device
    return [device.index] if device.type == "cuda" and device.index is not None else 1
