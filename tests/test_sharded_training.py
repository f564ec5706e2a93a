"""What FSDP's sharding must not change: which parameters get weight decay, the gradient norms
that clipping uses, and the EMA of MoCo v3's momentum encoder and DINO's teacher.

Lightning refuses FSDP on a CPU, so two CPU processes (gloo) wrap the modules with torch's
``FullyShardedDataParallel`` the way Lightning's ``FSDPStrategy`` does with
``recipes/trainer/fsdp.yaml`` (its ``auto_wrap_policy``, ``use_orig_params=True``, the model
wrapped after ``setup`` and before the optimiser is built) and compare with the same module
unwrapped in the same process.
"""

from __future__ import annotations

import copy
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import TINY_BACKBONE, TINY_VIT, fsdp_recipe_policy

from ssl_vit.backbones import create_backbone
from ssl_vit.methods import DINO, MoCoV3
from ssl_vit.methods.distributed import (
    clip_gradients,
    gradient_shard_group,
    unwrapped_name,
)

WORLD = 2


def _wrap(module: torch.nn.Module, policy: set[type] | None = None) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(module, auto_wrap_policy=ModuleWrapPolicy(policy or fsdp_recipe_policy()), use_orig_params=True,
                                    device_id=torch.device("cpu"))


def _groups_by_name(model) -> list[tuple[float, set[str]]]:
    names = {id(p): unwrapped_name(n) for n, p in model.named_parameters()}
    return [(g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in model._param_groups()]


def _check_weight_decay_groups() -> None:
    heads = {"out_dim": 64, "hidden_dim": 32, "bottleneck_dim": 16}
    for model in (DINO(**TINY_BACKBONE, num_classes=4, **heads),
                  MoCoV3(**TINY_BACKBONE, num_classes=4, proj_hidden_dim=32, pred_hidden_dim=32, proj_output_dim=16)):
        plain = copy.deepcopy(model)
        model.setup("fit")  # as Lightning: before the strategy wraps the model
        _wrap(model)
        assert next(model.backbone.parameters()).ndim == 1  # each parameter is now a flat shard
        assert _groups_by_name(model) == _groups_by_name(plain)
        assert any(wd > 0 for wd, _ in _groups_by_name(model))


def _check_clipping(mode: str) -> None:
    torch.manual_seed(0)
    backbone = create_backbone("vit", **TINY_VIT)
    reference = copy.deepcopy(backbone)
    wrapped = _wrap(backbone)
    x = torch.randn(4, 1, 16, 16)  # the same batch on both processes: the averaged gradient is this one
    weights = torch.randn(4, TINY_VIT["embed_dim"])
    (wrapped(x) * weights).sum().backward()
    (reference(x) * weights).sum().backward()
    plain_norms = [p.grad.norm() for p in reference.parameters()]
    max_norm = float(torch.stack(plain_norms).norm() / 2) if mode == "global" else float(torch.stack(plain_norms).median())
    expected = clip_gradients(list(reference.parameters()), max_norm, mode)
    norms = clip_gradients(list(backbone.parameters()), max_norm, mode, shard_group=dist.group.WORLD)
    torch.testing.assert_close(norms, expected)
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
        for (name, p), q in zip(backbone.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"{n}: {m}")


def _ema_models() -> list:
    torch.manual_seed(0)
    models = [DINO(**TINY_BACKBONE, out_dim=64, hidden_dim=32, bottleneck_dim=16),
              MoCoV3(**TINY_BACKBONE, proj_hidden_dim=32, pred_hidden_dim=32, proj_output_dim=16)]
    for model in models:
        with torch.no_grad():  # the online modules away from their targets
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p))
        model.setup("fit")
    return models


def _ema_step(model) -> None:
    """The method's EMA update after optimiser step 3 of 10."""
    model.total_steps, model._trainer = 10, SimpleNamespace(global_step=3)
    model.after_optimizer_step()


def _check_ema() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    for model in _ema_models():
        reference = copy.deepcopy(model)
        wrapped = _wrap(model)
        _ema_step(model)
        _ema_step(reference)
        with FullyShardedDataParallel.summon_full_params(wrapped):
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p, q, msg=lambda m, n=name: f"{n}: {m}")
    # One unit per block only: the backbone and its target share the root unit and are split
    # differently; the EMA says so instead of averaging mismatched pieces.
    from ssl_vit.backbones.vit import Block

    model = _ema_models()[0]
    _wrap(model, {Block})
    with pytest.raises(RuntimeError, match="FSDP sharded the two differently"):
        _ema_step(model)


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _check_weight_decay_groups()
        _check_clipping("global")
        _check_clipping("per_param")
        _check_ema()
    finally:
        dist.destroy_process_group()


def test_fsdp_sharding_keeps_weight_decay_groups_clipping_norms_and_the_ema():
    pytest.importorskip("torch.distributed.fsdp")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_worker, args=(port,), nprocs=WORLD, join=True)


def test_ssl_vit_fit_under_fsdp_trains_checkpoints_and_resumes_exactly(tmp_path):
    """``ssl-vit fit`` with FSDP over 2 CPU processes (torchrun, the recipe's wrapping): the full
    checkpoint holds every tensor at its built shape, the FLOP count is the unsharded model's, and
    a run stopped by SIGTERM in its second epoch and resumed ends where an uninterrupted run ends."""
    import subprocess
    import sys

    from helpers import subprocess_env
    from test_faults import STEPS_PER_EPOCH, load, recipe

    from ssl_vit.flops import count_flops

    def fit(run: str, *extra: str, callbacks: list | None = None) -> subprocess.CompletedProcess:
        (tmp_path / run).mkdir(exist_ok=True)
        cfg = recipe(tmp_path / run, devices=WORLD, max_epochs=2, strategy={"class_path": "helpers.CPUFSDPStrategy"},
                     data={"batch_size": 4}, callbacks=callbacks)  # 24 images / (4 x 2 processes): 3 steps an epoch
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", "-m", "ssl_vit.cli", "fit",
               "--config", str(cfg), *extra]
        return subprocess.run(cmd, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)

    def finished(run: subprocess.CompletedProcess) -> bool:
        """The run trained to its end: status 0, or a worker's rare abort while its interpreter
        exits after the run ("terminate called without an active exception", status -6, behind
        the last "(done)" progress line; gloo's teardown at finalisation, seen about once in 30
        runs; the checks below still compare what the run wrote)."""
        done, abort = run.stderr.rfind("(done)"), run.stderr.find("terminate called without an active exception")
        return run.returncode == 0 or ("exitcode  : -6" in run.stderr and 0 <= done < abort)

    done = fit("whole")
    assert finished(done), done.stderr[-4000:]
    stopped = fit("split", callbacks=[{"class_path": "test_faults.Interrupt", "init_args": {"step": STEPS_PER_EPOCH + 1, "how": "SIGTERM"}}])
    first = load(tmp_path / "split" / "run" / "checkpoints" / "last.ckpt")
    assert first["global_step"] == STEPS_PER_EPOCH + 1, stopped.stderr[-4000:]
    done = fit("split", "--resume")
    assert finished(done), done.stderr[-4000:]
    want = load(tmp_path / "whole" / "run" / "checkpoints" / "last.ckpt")
    got = load(tmp_path / "split" / "run" / "checkpoints" / "last.ckpt")
    assert got["global_step"] == want["global_step"] == 2 * STEPS_PER_EPOCH
    model = DINO(**{k: v for k, v in first["hyper_parameters"].items() if not k.startswith("_")})
    assert {k: v.shape for k, v in got["state_dict"].items()} == {k: v.shape for k, v in model.state_dict().items()}
    for key, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key  # online, teacher, centre, probe
    moved = [k for k, v in got["state_dict"].items() if k.startswith("teacher_backbone.") and not torch.equal(v, first["state_dict"][k])]
    assert moved  # the EMA target followed the student after the resume
    # The count of one process's step (forward, backward, probe) on its 4 images, as the unsharded model computes it.
    views, labels = [torch.randn(4, 1, 16, 16)] * 2 + [torch.randn(4, 1, 8, 8)] * 2, torch.arange(4) % 2

    def one_step() -> None:
        out = model.step(views, labels)
        probe = model.probe.training_loss(out["features"], labels)[0] if model.probe is not None else 0
        (out["loss"] + probe).backward()

    # (Measured under FSDP, a step's count comes out a per cent or two off the unsharded one, and
    # the first step of a resumed process is measured anew: equal to that tolerance.)
    per_step = count_flops(one_step) * WORLD
    assert got["ssl_vit"]["pretrain_flops"] == pytest.approx(want["ssl_vit"]["pretrain_flops"], rel=0.03)
    assert want["ssl_vit"]["pretrain_flops"] == pytest.approx(2 * STEPS_PER_EPOCH * per_step, rel=0.03)


@pytest.mark.parametrize("sharding, world, whole", [("FULL_SHARD", 2, False), ("SHARD_GRAD_OP", 2, False), ("NO_SHARD", 2, True),
                                                    ("FULL_SHARD", 1, True)])
def test_gradients_are_split_over_processes_only_where_fsdp_shards_them(monkeypatch, sharding, world, whole):
    # Clipping sums the squared gradient norms over the group gradient_shard_group names: under
    # NO_SHARD (or one process) every process holds whole gradients and there is nothing to sum.
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = FSDPStrategy(sharding_strategy=sharding)
    monkeypatch.setattr(FSDPStrategy, "world_size", property(lambda self: world))
    shards = object()  # the root FSDP module's process group
    strategy._model = SimpleNamespace(process_group=shards)
    assert gradient_shard_group(strategy) is (None if whole else shards)


def test_the_names_inside_activation_checkpointing_and_torch_compile_are_the_originals():
    """recipes/trainer/fsdp.yaml checkpoints the blocks' activations and a user may compile the
    model: the weight-decay rules read through both wrappers, whose name parts are torch's own."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = create_backbone("vit", **TINY_VIT)
    original = [n for n, _ in model.named_parameters()]
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    compiled = torch.compile(model)  # (nothing is compiled before a forward)
    wrapped = [n for n, _ in compiled.named_parameters()]
    assert any("_checkpoint_wrapped_module." in n for n in wrapped) and all(n.startswith("_orig_mod.") for n in wrapped)
    assert [unwrapped_name(n) for n in wrapped] == original
