"""Distributed training is the computation one process does with the whole batch.

2 processes x batch b (DDP over gloo, on CPU; FSDP too) against 1 process x batch 2b, from the same initial
weights and the same data: MoCo v3 (keys gathered from both processes, SyncBN in the heads) and
DINO (centre all-reduced) give the same logged loss, the same weights after two SGD steps
(online and EMA), the same DINO centre, the same online-probe weights (its BatchNorm synchronised);
MPP and the supervised baseline train under DDP too, and so does MoCo v3 in bf16-mixed; a non-finite loss on
one process makes both skip the batch (one decision, no hang).

How the processes are launched: ``torchrun --standalone --nproc_per_node 2`` on this file, the
command users run (Lightning sees torchrun's environment and starts no processes of its own), so
the test also checks that launch path. Every rank runs the real Lightning ``Trainer`` with
``strategy="ddp"`` and the real datamodule (its resumable sampler shards the epoch's permutation,
and every sample's augmentations are seeded by (seed, epoch, index), so the two shards of a step
are exactly the one-process batch). The one-process reference runs here, in the test process.
SGD (not AdamW, whose first step is about lr * sign(grad)) makes the weights sensitive to the
gradient's scale, and a constant LR keeps the second step from being a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import TINY_BACKBONE, cpu_fsdp_strategy, subprocess_env
from torch._dynamo.utils import counters

from ssl_vit.data import MultiCrop, SyntheticDataModule, TwoViews
from ssl_vit.methods import DINO, MPP, BaseMethod, MoCoV3, Supervised

WORLD = 2
PER_DEVICE = 4  # b; the one-process reference trains on 2b
STEPS = 2
TEST_IMAGES = 7  # odd: the distributed sampler pads one share

COMMON: dict[str, Any] = {
    **TINY_BACKBONE,
    "num_classes": 4,
    "optimizer": "sgd",
    # peak LR = base_lr * global batch / 256 = 3.2 * 8 / 256 = 0.1 = min_lr: constant over the run
    "base_lr": 3.2,
    "min_lr": 0.1,
    "warmup_epochs": 0.0,
    "weight_decay": 1e-4,
    "probe_lr": 0.1,
}
DINO_KWARGS = {"out_dim": 64, "hidden_dim": 32, "bottleneck_dim": 16, "momentum": 0.9, "momentum_end": 0.9,
               "freeze_last_layer_epochs": 0, "warmup_teacher_temp_epochs": 0, "grad_clip": 3.0, "grad_clip_mode": "per_param"}
METHODS: dict[str, tuple[type[BaseMethod], dict[str, Any]]] = {
    "mocov3": (MoCoV3, {"proj_hidden_dim": 32, "pred_hidden_dim": 32, "proj_output_dim": 16, "momentum": 0.9, "momentum_end": 0.9}),
    "dino": (DINO, DINO_KWARGS),
    "mpp": (MPP, {"mean": [0.5], "std": [0.25]}),
    "dino_sk": (DINO, {**DINO_KWARGS, "centering": "sinkhorn_knopp"}),  # DINOv2's targets: Sinkhorn-Knopp over the global batch
    "supervised": (Supervised, {}),
}
EQUIVALENT = ("mocov3", "dino", "dino_sk")  # MPP draws its masks per process: only a smoke run
FSDP_EQUIVALENT = ("mocov3", "dino")


def build(name: str) -> BaseMethod:
    cls, kwargs = METHODS[name]
    return cls(**COMMON, **kwargs)


def datamodule(name: str, batch_size: int) -> SyntheticDataModule:
    views = TwoViews() if name == "mocov3" else MultiCrop(n_local_crops=2, local_size=8) if METHODS[name][0] is DINO else None
    return SyntheticDataModule(num_samples=STEPS * WORLD * PER_DEVICE, num_test_samples=TEST_IMAGES, num_classes=4,
                               img_size=16, in_chans=1, batch_size=batch_size, num_workers=0, views=views)


class LoggedLoss(L.Callback):
    """The logged ``train/loss`` of every batch (NaN where a skipped batch logged none)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics.pop("train/loss", float("nan"))))


def fit(model: BaseMethod, dm: SyntheticDataModule, **trainer_kwargs: Any) -> list[float]:
    L.seed_everything(0, verbose=False)  # the data seed (PL_GLOBAL_SEED) of both runs
    recorder = LoggedLoss()
    trainer = L.Trainer(accelerator="cpu", max_steps=STEPS, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[recorder], **trainer_kwargs)
    trainer.fit(model, datamodule=dm)
    return recorder.losses


class NaNOnRank1(Supervised):
    """The first batch's loss is NaN on rank 1 only."""

    def step(self, views: list[torch.Tensor], labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().step(views, labels)
        if self.global_step == 0 and self.global_rank == 1:
            out["loss"] = out["loss"] * float("nan")
        return out


# ----------------------------------------------------------------------------- worker (torchrun)


def _worker(out: Path) -> None:
    torch.set_num_threads(1)  # 2 processes on 2 cores
    rank = int(os.environ["RANK"])
    log = []
    handler = logging.Handler()
    handler.emit = lambda record: log.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch").addHandler(handler)
    init = torch.load(out / "init.pt")
    result: dict[str, Any] = {}
    for name in METHODS:
        model = build(name)
        model.load_state_dict(init[name])
        losses = fit(model, datamodule(name, PER_DEVICE), devices=WORLD, strategy="ddp")
        result[name] = {"state": model.state_dict(), "losses": losses,
                        "sync_bn": sorted({type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__})}
    for name in FSDP_EQUIVALENT:  # FSDP with recipes/trainer/fsdp.yaml's wrapping: the full state dict, on rank 0
        model = build(name)
        model.load_state_dict(init[name])
        fit(model, datamodule(name, PER_DEVICE), devices=WORLD, strategy=cpu_fsdp_strategy())
        result[f"fsdp_{name}"] = model.trainer.strategy.lightning_module_state_dict()
    # The blocks of student and teacher through torch.compile: under DDP with the eager backend (dynamo's graphs, split at
    # DDP's buckets), under FSDP with aot_eager (AOTAutograd over FSDP's flat parameters, then torch's kernels).
    for strategy, backend in (("ddp", "eager"), ("fsdp", "aot_eager")):
        model = METHODS["dino"][0](**COMMON, **METHODS["dino"][1], compile_backbone=True, compile_backend=backend)
        model.load_state_dict(init["dino"])
        counters.clear()
        fit(model, datamodule("dino", PER_DEVICE), devices=WORLD, strategy="ddp" if strategy == "ddp" else cpu_fsdp_strategy())
        blocks = [getattr(b, "_fsdp_wrapped_module", b) for b in [*model.backbone.blocks, *model.teacher_backbone.blocks]]  # (FSDP wraps each block)
        result[f"compiled_{strategy}"] = {
            "state": model.trainer.strategy.lightning_module_state_dict(),
            "compiled": [getattr(b, "_compiled_call_impl", None) is not None for b in blocks],
            "frames": counters["frames"]["ok"],
        }
    model = build("mocov3")
    model.load_state_dict(init["mocov3"])
    fit(model, datamodule("mocov3", PER_DEVICE), devices=WORLD, strategy="ddp", precision="bf16-mixed")
    result["bf16"] = {"state": model.state_dict(), "loss": float(model.trainer.callback_metrics["train/loss"])}
    model = NaNOnRank1(**COMMON, nonfinite_policy="skip")
    model.load_state_dict(init["supervised"])
    fit(model, datamodule("supervised", PER_DEVICE), devices=WORLD, strategy="ddp")
    result["skip"] = {"state": model.state_dict(), "skipped": model.skipped_batches, "step": model.global_step}
    result["log"] = log
    # The run's summary of unreadable files: each process found its own; rank 0 lists them all once.
    summary: list[str] = []
    data_log = logging.getLogger("ssl_vit.data.base")
    data_log.addHandler(catch := logging.Handler())
    catch.emit = lambda record: summary.append(record.getMessage())  # type: ignore[method-assign]

    class Skipping(SyntheticDataModule):
        skipped_paths = [f"bad{rank}.png", "both.png"]

    Skipping(num_samples=4, img_size=16).teardown("fit")
    data_log.removeHandler(catch)
    result["skipped_summary"] = summary
    torch.save(result, out / f"rank{rank}.pt")


# ----------------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Initial weights, the 2-process results (from torchrun) and the 1-process references."""
    out = tmp_path_factory.mktemp("ddp")
    torch.manual_seed(0)
    init = {name: build(name).state_dict() for name in METHODS}
    torch.save(init, out / "init.pt")
    env = subprocess_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", __file__, str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # Meanwhile, the references: one process, batch 2b, the same initial weights and data.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref: dict[str, Any] = {}
        for name in EQUIVALENT:
            model = build(name)
            model.load_state_dict(init[name])
            losses = fit(model, datamodule(name, WORLD * PER_DEVICE), devices=1)
            ref[name] = {"state": model.state_dict(), "losses": losses}
    finally:
        torch.set_num_threads(threads)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {"init": init, "ranks": ranks, "ref": ref}


def assert_same_update(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], init: dict[str, torch.Tensor]) -> None:
    """Every tensor moved from ``init`` by the same amount, to float tolerance: the largest
    difference of the updates is at most 1e-3 of the largest update (plus 1e-6 for tensors whose
    update is rounding noise, e.g. a bias that a following BatchNorm cancels)."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        if not value.is_floating_point():
            assert torch.equal(got[key], value), key
            continue
        step_want, step_got = value - init[key], got[key] - init[key]
        err = float((step_got - step_want).abs().max())
        assert err <= 1e-3 * float(step_want.abs().max()) + 1e-6, f"{key}: updates differ by {err:.3g} (update {float(step_want.abs().max()):.3g})"


@pytest.mark.parametrize("name", EQUIVALENT)
def test_two_processes_log_the_one_process_loss(runs, name):
    want = runs["ref"][name]["losses"]
    assert len(want) == STEPS
    for rank in runs["ranks"]:
        assert rank[name]["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", EQUIVALENT)
def test_two_processes_end_with_the_one_process_weights(runs, name):
    want = runs["ref"][name]["state"]
    rank0, rank1 = (r[name]["state"] for r in runs["ranks"])
    changed = [k for k, v in want.items() if v.is_floating_point() and not torch.equal(v, runs["init"][name][k])]
    # Trained, momentum-averaged and probe weights all moved, so the comparison covers them all.
    targets = ("momentum_backbone.", "momentum_projector.") if name == "mocov3" else ("teacher_backbone.", "teacher_head.")
    for prefix in ("backbone.", "probe.", *targets):
        assert any(k.startswith(prefix) for k in changed), prefix
    assert_same_update(rank0, want, runs["init"][name])
    assert_same_update(rank1, rank0, runs["init"][name])  # the replicas agree


@pytest.mark.parametrize("name", FSDP_EQUIVALENT)
def test_fsdp_over_two_processes_ends_with_the_one_process_weights(runs, name):
    # Parameters, gradients and optimiser state sharded over the processes: the same update,
    # the EMA target averaged shard by shard, DINO's per-parameter clipping on whole gradients.
    assert_same_update(runs["ranks"][0][f"fsdp_{name}"], runs["ref"][name]["state"], runs["init"][name])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_blocks_train_to_the_one_process_weights(runs, strategy):
    # compile_backbone under DDP and under FSDP (each block an FSDP unit, compiled inside it).
    got = runs["ranks"][0][f"compiled_{strategy}"]
    assert got["compiled"] and all(got["compiled"]) and got["frames"] > 0  # dynamo compiled them
    assert_same_update(got["state"], runs["ref"]["dino"]["state"], runs["init"]["dino"])


def test_mocov3_heads_and_probe_use_synchronised_batchnorm(runs):
    # (torch's SyncBatchNorm on GPUs; on CPU, where torch has none, ours)
    assert runs["ranks"][0]["mocov3"]["sync_bn"] == ["AllReduceBatchNorm"]
    assert runs["ranks"][0]["dino"]["sync_bn"] == ["AllReduceBatchNorm"]  # the probe's; DINO's ViT head has none
    # and the running statistics they keep are the global batch's
    want = runs["ref"]["mocov3"]["state"]
    for key in ("projector.1.running_mean", "projector.1.running_var", "predictor.4.running_var", "probe.head.norm.running_mean"):
        torch.testing.assert_close(runs["ranks"][0]["mocov3"]["state"][key], want[key], rtol=1e-4, atol=1e-6)


def test_dino_center_is_the_global_batch_mean(runs):
    got = runs["ranks"][0]["dino"]["state"]["criterion.center"]
    want = runs["ref"]["dino"]["state"]["criterion.center"]
    assert not torch.equal(want, torch.zeros_like(want))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", ["mpp", "supervised"])
def test_every_method_trains_under_ddp(runs, name):
    rank0, rank1 = (r[name] for r in runs["ranks"])
    assert len(rank0["losses"]) == STEPS and all(torch.isfinite(torch.tensor(rank0["losses"])))
    assert_same_update(rank1["state"], rank0["state"], runs["init"][name])


def test_bf16_mixed_trains_under_ddp(runs):
    rank0, rank1 = (r["bf16"] for r in runs["ranks"])
    assert torch.isfinite(torch.tensor(rank0["loss"]))
    assert_same_update(rank1["state"], rank0["state"], runs["init"]["mocov3"])


def test_a_nonfinite_loss_on_one_process_is_skipped_by_all(runs):
    rank0, rank1 = (r["skip"] for r in runs["ranks"])
    # Both skipped the first batch (rank 0's own loss was finite) and trained on the second.
    assert rank0["skipped"] == rank1["skipped"] == 1 and rank0["step"] == rank1["step"] == STEPS
    moved = [k for k, v in rank0["state"].items() if v.is_floating_point() and not torch.equal(v, runs["init"]["supervised"][k])]
    assert any(k.startswith("backbone.") for k in moved)
    assert_same_update(rank1["state"], rank0["state"], runs["init"]["supervised"])


def test_unreadable_files_are_summarised_once_for_all_processes(runs):
    assert [r["skipped_summary"] for r in runs["ranks"]] == [["skipped 3 unreadable files: bad0.png, bad1.png, both.png"], []]


def test_effective_batch_size_and_scaled_lr_are_printed(runs):
    lines = [m for m in runs["ranks"][0]["log"] if "effective batch size" in m]
    assert lines and "effective batch size 8 = 4 per device x 2 device(s) x 1 accumulation" in lines[0]
    assert "lr = base_lr 3.2 x 8/256 = 0.1" in lines[0]
    assert not [m for m in runs["ranks"][1]["log"] if "effective batch size" in m]  # rank 0 only


def test_the_fsdp_recipe_composes_with_a_method_recipe(tmp_path, capsys):
    # FSDP needs GPUs (Lightning refuses it on CPU): here the recipe parses, resolves its classes
    # and reaches the Trainer, which asks for a GPU in one line.
    from test_faults import recipe

    from ssl_vit.cli import main

    fsdp = Path(__file__).resolve().parents[1] / "recipes" / "trainer" / "fsdp.yaml"
    assert main(["fit", "--config", str(recipe(tmp_path)), "--config", str(fsdp)]) == 1
    assert "ssl-vit fit: error: The strategy `fsdp` requires a GPU accelerator" in capsys.readouterr().err


def test_fit_releases_the_process_group_at_its_end(tmp_path):
    """A DDP run destroys its gloo process group before ``ssl-vit fit`` returns (left to the
    interpreter's exit, gloo's threads abort the process now and then: status -6, not the run's).
    One process in this interpreter: Lightning initialises the group for ``strategy: ddp`` all the same."""
    from test_training_cli import tiny_config

    from ssl_vit.cli import main

    # Lightning writes MASTER_*, LOCAL_RANK and NODE_RANK into os.environ; left there, the later
    # tests' DDP subprocesses would take themselves for processes someone else launched.
    saved = dict(os.environ)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        assert main(["fit", "--config", str(tiny_config(tmp_path, max_steps=2, strategy="ddp"))]) == 0
        assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
        assert not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def test_sigterm_to_a_two_process_run_stops_both_after_one_step_and_checkpoints(tmp_path):
    """A scheduler's SIGTERM to one process of a DDP run (2 CPU processes) while the other waits
    in a collective: both stop after that step, ``last.ckpt`` holds it, the command exits with 143.
    (Lightning's own handler broadcast from inside the signal handler: with the other process
    waiting in the step's all-gather, both hung.)"""
    import signal

    from test_training_cli import tiny_config

    root = Path(__file__).resolve().parents[1]
    env = subprocess_env(OMP_NUM_THREADS="1")
    # MoCo v3: each step all-gathers the keys and synchronises BatchNorm across the processes.
    cfg = tiny_config(tmp_path, "ssl_vit.methods.MoCoV3", "ssl_vit.data.TwoViews", max_epochs=-1, max_steps=50, limit_val_batches=0,
                      num_sanity_val_steps=0, callbacks=[{"class_path": "test_faults.SignalWhileOthersWait", "init_args": {"step": 3}}])
    cmd = [sys.executable, "-m", "ssl_vit.cli", "fit", "--config", str(cfg), "--config", str(root / "recipes/trainer/ddp_cpu2.yaml")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:  # hung: take the whole process group down
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4  # the signalled step
    assert output.count("stopped by SIGTERM at step 4") == 1, output[-3000:]  # said once, by rank 0


def test_a_crash_in_one_process_ends_the_whole_run(tmp_path):
    """Process 1 of a 2-process CPU run raises mid-run while process 0 waits in the step's
    collectives: the command fails (no hang, no process left behind) and says why."""
    import signal

    from test_training_cli import tiny_config

    root = Path(__file__).resolve().parents[1]
    cfg = tiny_config(tmp_path, "ssl_vit.methods.MoCoV3", "ssl_vit.data.TwoViews", max_epochs=-1, max_steps=50, limit_val_batches=0,
                      num_sanity_val_steps=0, callbacks=[{"class_path": "test_faults.CrashOnRank", "init_args": {"step": 2, "rank": 1}}])
    cmd = [sys.executable, "-m", "ssl_vit.cli", "fit", "--config", str(cfg), "--config", str(root / "recipes/trainer/ddp_cpu2.yaml")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=subprocess_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail("hung after one process crashed:\n" + output[-3000:])
    left_behind = True  # a process of the run's session still alive 20 s after the command ended
    for _ in range(40):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            left_behind = False
            break
        time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and not left_behind, output[-3000:]
    assert "Crash: rank 1 crashed at step 2" in output
    # Whichever sees it first ends the run: process 0's collective (its error line), or Lightning's
    # watcher of the child processes, which kills the whole run (status -9).
    if proc.returncode == -signal.SIGKILL:
        assert "Forcefully terminating all other processes" in output, output[-3000:]
    else:
        assert proc.returncode == 1, output[-3000:]
        assert "ssl-vit fit: error (process 0 of 2): " in output and "Connection closed by peer" in output, output[-3000:]


def test_finetuning_on_two_processes_takes_the_steps_of_one_process_at_twice_the_batch(tmp_path):
    """``ssl-vit eval finetune --devices 2`` (2 CPU processes, 8 images each per step) ends with
    the weights of one process at 16 per step (the same images per step, the same crops, the
    gradients averaged, the LR scaled by the global batch), tests on the whole split once and
    writes one record."""
    import json

    tiny = json.dumps({"img_size": 16, "patch_size": 4, "in_chans": 3, "embed_dim": 32, "depth": 2, "num_heads": 2})
    base = [sys.executable, "-m", "ssl_vit.cli", "eval", "finetune", "--backbone", "random:vit", "--backbone-kwargs", tiny, "--data", "synthetic",
            "--data-arg", "num_samples=64", "--data-arg", "num_test_samples=30", "--data-arg", "num_classes=4", "--num-workers", "0",
            "--device", "cpu", "--epochs", "2", "--drop-path", "0", "--lr", "0.05"]
    runs = {}
    for name, layout in (("two", ["--devices", "2", "--batch-size", "8"]), ("one", ["--batch-size", "16"])):
        cmd = [*base, *layout, "--run-dir", str(tmp_path / name), "--out", str(tmp_path / f"{name}.json")]
        done = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        runs[name] = {"out": done.stdout, "record": json.loads((tmp_path / f"{name}.json").read_text()),
                      "state": torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]}
    two, one = runs["two"], runs["one"]
    assert two["out"].count("finetune") == 1  # process 0 reports; process 1 writes nothing
    assert two["record"]["protocol_args"]["devices"] == 2 and two["record"]["data"]["test_size"] == 30
    assert two["record"]["metrics"] == one["record"]["metrics"]
    assert one["state"]["head.weight"].abs().max() > 1e-3  # trained (initialised at std 2e-5)
    assert two["state"].keys() == one["state"].keys()
    for k, v in one["state"].items():
        if v.is_floating_point():
            torch.testing.assert_close(two["state"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_a_two_process_recipe_fine_tunes_on_both_processes_and_records_once(tmp_path):
    """A recipe's ``evaluate: {protocols: [finetune, knn]}`` after a two-process fit: both processes
    of the run fine-tune (each its half of every epoch), process 0 alone tests, writes the record
    and runs kNN."""
    import json

    from test_faults import recipe

    root = Path(__file__).resolve().parents[1]
    cfg = recipe(tmp_path, data={"num_samples": 32, "num_test_samples": 8}, max_epochs=1)
    cmd = [sys.executable, "-m", "ssl_vit.cli", "fit", "--config", str(cfg), "--config", str(root / "recipes/trainer/ddp_cpu2.yaml"),
           "--evaluate.protocols", "[finetune, knn]", "--evaluate.knn", "{k: 3}", "--evaluate.finetune", "{epochs: 1, batch_size: 4, warmup_epochs: 0}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("finetune  dino") == 1 and done.stdout.count("knn       dino") == 1
    records = {p.name: json.loads(p.read_text()) for p in (tmp_path / "run" / "results").glob("*.json")}
    assert set(records) == {"dino_vit-D32-L2-H2-4_synthetic_finetune.json", "dino_vit-D32-L2-H2-4_synthetic_knn.json"}
    ft = records["dino_vit-D32-L2-H2-4_synthetic_finetune.json"]
    assert ft["protocol_args"]["devices"] == 2 and ft["data"]["test_size"] == 8
    # 32 images, 4 per process and step on 2 processes: 4 steps.
    assert torch.load(tmp_path / "run" / "finetune" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4


@pytest.mark.slow
def test_ddp_from_the_cli_resumes_to_the_uninterrupted_weights(tmp_path):
    """``ssl-vit fit --config <recipe> --config recipes/trainer/ddp_cpu2.yaml`` (Lightning starts
    the second process): a crash at step 5 and ``--resume`` end with the weights of the
    uninterrupted two-process run. Three launches, about 40 s."""
    from test_faults import recipe

    root = Path(__file__).resolve().parents[1]
    env = subprocess_env(OMP_NUM_THREADS="1")
    crash = [{"class_path": "test_faults.Interrupt", "init_args": {"step": 5, "how": "crash"}}]

    def run(folder: str, *extra: str, callbacks: list[dict[str, Any]] | None = None) -> int:
        cfg = recipe(tmp_path / folder, data={"num_samples": 48}, callbacks=callbacks)
        cmd = [sys.executable, "-m", "ssl_vit.cli", "fit", "--config", str(cfg), "--config", str(root / "recipes/trainer/ddp_cpu2.yaml"), *extra]
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=300).returncode

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert run("a") == 0
    assert run("b", callbacks=crash) != 0
    assert torch.load(tmp_path / "b/run/checkpoints/last.ckpt", weights_only=False)["global_step"] == 4
    assert run("b", "--resume") == 0
    want = torch.load(tmp_path / "a/run/checkpoints/last.ckpt", weights_only=False)["state_dict"]
    got = torch.load(tmp_path / "b/run/checkpoints/last.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(got[k], v) for k, v in want.items())


if __name__ == "__main__":  # one rank, started by torchrun from the fixture above
    _worker(Path(sys.argv[1]))
    torch.distributed.destroy_process_group()  # gloo's group left to interpreter exit aborts now and then


_EVAL_ON_TWO_PROCESSES = '''
import json, sys
import lightning as L, torch
from torch.utils.data import Dataset
from helpers import TINY_BACKBONE
from ssl_vit.backbones import create_backbone
from ssl_vit.data import SyntheticDataModule
from ssl_vit.eval.finetune import FineTuneSettings
from ssl_vit.eval.linear_augmented import LinearAugSettings
from ssl_vit.eval.train_run import ImageRun
from ssl_vit.methods import Supervised

torch.set_num_threads(1)
devices = int(sys.argv[1])

class Images(Dataset):  # 8 images; those in `bad` unreadable (labelled -1, as ImageFiles.for_evaluation marks them)
    def __init__(self, bad):
        self.x, self.bad = torch.randn(8, 1, 16, 16, generator=torch.Generator().manual_seed(0)), bad
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return self.x[i], -1 if i in self.bad else i % 2

torch.manual_seed(0)
model = Supervised(**TINY_BACKBONE, num_classes=4)
dm = SyntheticDataModule(num_samples=8, num_test_samples=7, num_classes=4, img_size=16, in_chans=1, batch_size=4,
                         eval_batch_size=3, num_workers=0)
trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
                    enable_progress_bar=False, enable_model_summary=False)
metrics = trainer.validate(model, datamodule=dm, verbose=False)[0]
out = {"val": {k: float(v) for k, v in metrics.items()}}
if devices > 1:
    # Rank 1's first batch (images 1 and 3 of a batch of 2 per process) is all unreadable.
    backbone = create_backbone(TINY_BACKBONE["backbone"], **TINY_BACKBONE["backbone_kwargs"])
    common, place = {"epochs": 1, "batch_size": 2, "warmup_epochs": 0}, ImageRun("cpu", devices)
    out["linear_aug"] = LinearAugSettings(base_lr=0.1, **common).run(backbone, Images({1, 3}), Images(set()), 2, place)
    out["finetune"] = FineTuneSettings(**common).run(backbone, Images({1, 3}), Images(set()), 2, place)
if trainer.global_rank == 0:
    print("RESULT", json.dumps(out), flush=True)
'''


def test_two_processes_evaluate_each_test_image_once_and_train_past_unreadable_batches(tmp_path):
    """Validation over 2 processes pads the 7 test images to 8 with an unlabelled copy (not a
    second vote of image 0): the online probe's and the classifier's accuracies are the
    one-process values. And the evaluators that train on images go on when one process's batch
    has no readable image (Lightning refuses a skipped step under DDP)."""
    import json

    script = tmp_path / "eval_on_two.py"
    script.write_text(_EVAL_ON_TWO_PROCESSES)
    results = {}
    for devices in (1, 2):
        done = subprocess.run([sys.executable, str(script), str(devices)], cwd=tmp_path, env=subprocess_env(OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        results[devices] = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    one, two = results[1]["val"], results[2]["val"]
    assert set(one) == {"probe/val_acc", "val/acc"}
    # 7 images: an accuracy of k/7 with 0 < k < 7 cannot equal a mean over 8 votes.
    assert all(0 < v < 1 for v in one.values()), one
    assert two == pytest.approx(one, abs=1e-6)
    assert set(results[2]["linear_aug"]) == {"top1"} and set(results[2]["finetune"]) == {"top1"}
