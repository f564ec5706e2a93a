"""torch's fused AdamW / SGD kernels run the pretext and fine-tune optimisers where the parameters
allow it, and update to the same parameters as torch's per-tensor loop (up to float rounding)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import TINY_BACKBONE

from ssl_vit.methods import MoCoV3, Supervised
from ssl_vit.methods.optim import fused_kwargs


def test_fused_support_follows_device_and_dtype() -> None:
    def fused(*params) -> bool:
        return fused_kwargs([{"params": list(params[:1])}, {"params": list(params[1:])}]) == {"fused": True}

    f32 = torch.nn.Parameter(torch.zeros(3))
    assert fused(f32, torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)))  # over every group's parameters
    assert not fused()
    assert not fused(torch.zeros(3, dtype=torch.long))
    assert not fused(f32, torch.zeros(3, device="meta"))  # one device type only
    assert not fused(torch.zeros(3, device="meta"))
    # CPU and CUDA each have the kernels, but one optimizer over both cannot fuse (a stand-in for
    # a CUDA tensor: only its device type and dtype are read)
    on_cuda = SimpleNamespace(device=torch.device("cuda", 0), is_floating_point=lambda: True)
    assert fused(on_cuda) and not fused(f32, on_cuda)
    assert fused_kwargs([{"params": [f32]}], enabled=False) == {}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "lars"])
def test_methods_optimisers_are_fused_unless_switched_off(optimizer: str) -> None:
    model = Supervised(**TINY_BACKBONE, num_classes=4, optimizer=optimizer)
    fused = model.configure_optimizers().defaults.get("fused")
    assert bool(fused) == (optimizer != "lars")  # lightly's LARS has no fused kernel
    off = Supervised(**TINY_BACKBONE, num_classes=4, optimizer=optimizer, fused_optimizer=False)
    assert not off.configure_optimizers().defaults.get("fused")


def _random_grads(model: torch.nn.Module, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters() if p.requires_grad}


def _set_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        p.grad = grads[n].clone() if n in grads else None


def test_fused_updates_match_the_per_tensor_loop() -> None:
    """MoCo v3's optimiser (AdamW over its groups: scheduled weight decay, no decay for norms and
    biases, the probe's fixed LR) fed the same gradients for several steps, with the LR and weight
    decay changed between steps as training does: fused and the loop end at the same weights."""
    torch.manual_seed(0)
    kwargs = {**TINY_BACKBONE, "num_classes": 4, "warmup_epochs": 0.0, "base_lr": 0.05, "weight_decay": 0.1,
              "proj_hidden_dim": 32, "pred_hidden_dim": 32, "proj_output_dim": 16}
    fused, loop = MoCoV3(**kwargs), MoCoV3(**kwargs, fused_optimizer=False)
    loop.load_state_dict(fused.state_dict())
    opts = fused.configure_optimizers(), loop.configure_optimizers()
    assert opts[0].defaults["fused"] and not opts[1].defaults.get("fused")
    start = {n: p.detach().clone() for n, p in fused.named_parameters()}
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = _random_grads(fused, g)
        for model, opt in zip((fused, loop), opts):
            _set_grads(model, grads)
            for group in opt.param_groups:  # as BaseMethod.on_train_batch_start
                if "fixed_lr" not in group:
                    group["lr"] = 0.05 / (1 + step)
                if group.get("scheduled_wd"):
                    group["weight_decay"] = 0.1 + 0.1 * step
            opt.step()
    moved = 0
    for (name, a), b in zip(fused.named_parameters(), loop.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        moved += int(not torch.equal(a, start[name]))
    assert moved == len(grads)  # every trainable parameter was updated, and nothing else


def test_a_checkpoint_of_the_loop_resumes_as_it_was_written() -> None:
    """Optimiser state written by torch's default AdamW (checkpoints from before the fused
    default) loads into the optimiser training now builds, and the run continues with the updates
    it would have made: the checkpoint's param groups (``fused`` included) are restored, as torch
    restores every group setting."""
    kwargs = {**TINY_BACKBONE, "num_classes": 4, "weight_decay": 0.1}
    torch.manual_seed(0)
    old = Supervised(**kwargs, fused_optimizer=False)
    old_opt = old.configure_optimizers()
    g = torch.Generator().manual_seed(2)
    _set_grads(old, _random_grads(old, g))
    old_opt.step()
    new = Supervised(**kwargs)
    new.load_state_dict(old.state_dict())
    new_opt = new.configure_optimizers()
    assert new_opt.defaults["fused"]
    new_opt.load_state_dict(copy.deepcopy(old_opt.state_dict()))  # as read back from a file
    assert not any(group.get("fused") for group in new_opt.param_groups)
    for _ in range(2):
        grads = _random_grads(old, g)
        for model, opt in ((old, old_opt), (new, new_opt)):
            _set_grads(model, grads)
            opt.step()
    for a, b in zip(old.parameters(), new.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(float(s["step"]) == 3.0 for s in new_opt.state.values())


@pytest.mark.parametrize("skip", [False, True])
def test_fp16_loss_scaling_unscales_a_fused_optimiser_before_clipping_and_skipping(skip: bool) -> None:
    # Lightning unscales before the clipping hooks only for optimisers that do not unscale in
    # their step; the fused ones do. Expectation: the clip sees the same (unscaled) gradient norm
    # and the step moves the weights as far as with the per-tensor loop; a skipped batch (a
    # non-finite loss) leaves the scaler an inf check to update from instead of failing.
    import lightning as L
    from helpers import RepeatBatch, fixed_views
    from lightning.pytorch.plugins.precision import MixedPrecision

    from ssl_vit.methods import distributed

    seen: list[float] = []
    real = distributed.clip_gradients

    def spy(params, clip, mode, group):
        norm = real(params, clip, mode, group)
        seen.append(float(norm.max()))
        return norm

    class NaNOnce(Supervised):
        def step(self, views, labels):
            out = super().step(views, labels)
            return {**out, "loss": out["loss"] * float("nan")} if skip and self.global_step == 1 else out

    moved = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = NaNOnce(**TINY_BACKBONE, num_classes=4, optimizer="sgd", base_lr=0.1, warmup_epochs=0.0, weight_decay=0.0,
                        grad_clip=1.0, grad_clip_mode="global", fused_optimizer=fused, nonfinite_policy="skip")
        before = [p.detach().clone() for p in model.backbone.parameters()]
        views, labels = fixed_views([16], batch=8)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
        trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, plugins=[plugin])
        seen.clear()
        distributed.clip_gradients = spy
        try:
            trainer.fit(model, torch.utils.data.DataLoader(RepeatBatch(views, labels, 2), batch_size=None))
        finally:
            distributed.clip_gradients = real
        assert trainer.global_step == 2 and model.skipped_batches == int(skip)
        assert seen[0] < 100  # the unscaled norm, not 65536 times it
        moved.append((seen[0], sum(float((p.detach() - b).norm()) for p, b in zip(model.backbone.parameters(), before))))
    assert moved[1] == pytest.approx(moved[0], rel=1e-3)
