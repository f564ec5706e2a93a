"""The linear probe trained on images through the frozen backbone (``ssl-vit eval linear --augment``)."""

from __future__ import annotations

import math
import os
import signal

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ssl_vit import create_backbone
from ssl_vit.backbones import VisionTransformer
from ssl_vit.eval.linear_augmented import AugmentedLinearProbe, LinearAugSettings
from ssl_vit.eval.train_run import EvalRunInterrupted, ImageRun

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),  # lightning internals, not ours
    pytest.mark.filterwarnings("ignore:Found .* module.s. in eval mode"),  # the frozen backbone, on purpose
]


def tiny_vit() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=2, drop_path_rate=0.5)


def _data(n: int = 24, size: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, size, size, generator=g), torch.arange(n) % 3)


def _trainer(steps: int) -> L.Trainer:
    return L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, accelerator="cpu")


def test_it_trains_the_head_on_frozen_features_as_the_protocol_states():
    """Against the protocol written out here: eval-mode [CLS] features, BatchNorm without affine +
    Linear (trunc-normal std 0.01, zero bias), SGD momentum 0.9 at base_lr x batch / 256, a
    linear warm-up over one epoch then MAE's cosine cos(pi (t - W) / (T - W)), per step."""
    data, batch, epochs, base_lr = _data(24), 8, 3, 0.5
    steps_per_epoch = len(data) // batch
    total = epochs * steps_per_epoch
    backbone = tiny_vit()
    frozen = {k: v.clone() for k, v in backbone.state_dict().items()}
    torch.manual_seed(1)
    probe = AugmentedLinearProbe(backbone, 3, LinearAugSettings(base_lr=base_lr, batch_size=batch, warmup_epochs=1), total_steps=total,
                                 steps_per_epoch=steps_per_epoch)
    init = {k: v.clone() for k, v in probe.head.state_dict().items()}
    _trainer(total).fit(probe, DataLoader(data, batch_size=batch))

    # The reference: the same initial head, trained by hand on features computed once.
    ref_backbone = tiny_vit().eval()
    with torch.no_grad():
        feats = ref_backbone(data.tensors[0])  # [N, 32]
    norm = torch.nn.BatchNorm1d(32, affine=False, eps=1e-6)
    linear = torch.nn.Linear(32, 3)
    linear.load_state_dict({"weight": init["linear.weight"], "bias": init["linear.bias"]})
    assert init["linear.bias"].abs().sum() == 0 and init["linear.weight"].std() < 0.05
    peak = base_lr * batch / 256
    opt = torch.optim.SGD(linear.parameters(), lr=peak, momentum=0.9)
    for step in range(total):
        warm = steps_per_epoch
        factor = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
        for g in opt.param_groups:
            g["lr"] = peak * factor
        i = step % steps_per_epoch
        x, y = feats[i * batch : (i + 1) * batch], data.tensors[1][i * batch : (i + 1) * batch]
        loss = F.cross_entropy(linear(norm(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.allclose(probe.head.linear.weight, linear.weight, atol=1e-5)
    assert torch.allclose(probe.head.norm.running_mean, norm.running_mean, atol=1e-5)
    # The backbone was not trained, and ran without its drop path (eval mode).
    assert all(torch.equal(v, frozen[k]) for k, v in backbone.state_dict().items())
    assert not any(p.requires_grad for p in backbone.parameters())


def test_a_resnet_backbone_keeps_its_batchnorm_statistics():
    backbone = create_backbone("resnet18", in_chans=1, img_size=16, small_input=True, num_stages=1)
    stats = {k: v.clone() for k, v in backbone.state_dict().items() if "running" in k}
    probe = AugmentedLinearProbe(backbone.train(), 3, LinearAugSettings(batch_size=8), total_steps=2, steps_per_epoch=2)
    _trainer(2).fit(probe, DataLoader(_data(16), batch_size=8))
    assert stats and all(torch.equal(backbone.state_dict()[k], v) for k, v in stats.items())
    assert probe.head.training and not backbone.training


def test_an_interrupted_probe_resumes_to_the_uninterrupted_head(tmp_path, monkeypatch):
    train, test = _data(24), _data(12)

    def run_probe(run_dir, resume=False, seed=0):
        settings = LinearAugSettings(epochs=2, batch_size=8, checkpoint_every=1000, warmup_epochs=0.5)
        return settings.run(tiny_vit(), train, test, 3, ImageRun(accelerator="cpu", seed=seed, run_dir=run_dir, resume=resume), features="avg")

    want = run_probe(tmp_path / "whole")
    whole_head = torch.load(tmp_path / "whole" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert whole_head and not any(k.startswith("backbone.") for k in whole_head)  # the head only

    step = AugmentedLinearProbe.training_step

    def signalled(self, batch, batch_idx):
        if self.global_step == 1 and not getattr(self, "_signalled", False):
            self._signalled = True
            os.kill(os.getpid(), signal.SIGUSR1)
        return step(self, batch, batch_idx)

    monkeypatch.setattr(AugmentedLinearProbe, "training_step", signalled)
    with pytest.raises(EvalRunInterrupted, match="linear probe stopped by SIGUSR1 at step 2"):
        run_probe(tmp_path / "cut")
    monkeypatch.setattr(AugmentedLinearProbe, "training_step", step)
    # another seed would change the data order and crops the checkpoint's position counts in
    with pytest.raises(ValueError, match=r"started with other settings: .*seed: 0 there, 1 here"):
        run_probe(tmp_path / "cut", resume=True, seed=1)
    got = run_probe(tmp_path / "cut", resume=True)
    assert got == want
    cut_head = torch.load(tmp_path / "cut" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert cut_head.keys() == whole_head.keys() and all(torch.equal(cut_head[k], v) for k, v in whole_head.items())


def test_a_checkpoint_of_another_module_is_refused():
    # train_run.resume_difference compares the head alone: the frozen backbone is not in its checkpoints
    from ssl_vit.eval.train_run import resume_difference

    probe = AugmentedLinearProbe(tiny_vit(), 3)
    assert resume_difference(probe, {"state_dict": {"head.linear.weight": torch.zeros(3, 32)}}) == (
        "4 weights missing there (e.g. head.norm.running_mean)")


def test_lars_trains_the_probe_and_the_runner_gives_the_backbone_back_as_it_was():
    # Lightning hands the optimiser a closure (forward + backward) to run inside step.
    backbone = tiny_vit()
    lars = LinearAugSettings(epochs=2, batch_size=8, optimizer="lars", warmup_epochs=0)
    metrics = lars.run(backbone, _data(24), _data(12), 3, ImageRun(accelerator="cpu"))
    assert metrics is not None and 0.0 <= metrics["top1"] <= 1.0
    probe = AugmentedLinearProbe(tiny_vit(), 3, lars, total_steps=3, steps_per_epoch=3)
    before = probe.head.linear.weight.detach().clone()
    _trainer(3).fit(probe, DataLoader(_data(24), batch_size=8))
    assert not torch.equal(before, probe.head.linear.weight)
    # The runner froze the backbone for the probe only: a fine-tuning after it trains every weight.
    assert all(p.requires_grad for p in backbone.parameters())


def test_a_run_dir_of_another_run_or_probe_is_refused_in_one_line(tmp_path):
    from ssl_vit.eval.finetune import FineTuneModule

    def save(module, run):
        checkpoint = {"state_dict": module.state_dict(), "global_step": 1, "epoch": 0}
        module.on_save_checkpoint(checkpoint)
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        torch.save(checkpoint, tmp_path / run / "checkpoints" / "last.ckpt")

    settings = LinearAugSettings(epochs=1, batch_size=8)
    save(FineTuneModule(create_backbone("vit", img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=2), 3), "ft")
    with pytest.raises(ValueError, match=r"^--run-dir .*ft holds a fine-tuning run, not a linear probe run: choose another --run-dir$"):
        settings.run(tiny_vit(), _data(), _data(12), 3, ImageRun(accelerator="cpu", run_dir=tmp_path / "ft", resume=True))
    save(AugmentedLinearProbe(tiny_vit(), 3), "probe")  # on [CLS]; resumed on [CLS] + mean patch token
    with pytest.raises(ValueError, match=r"^--run-dir .*probe is a linear probe run of another backbone or setting: 3 weights of other shapes "
                                         r"\(e.g. head.norm.running_mean: \[32\] there, \[64\] here\); resume it"):
        settings.run(tiny_vit(), _data(), _data(12), 3, ImageRun(accelerator="cpu", run_dir=tmp_path / "probe", resume=True), features="cls_avg")


@pytest.mark.parametrize("protocol", ["linear_aug", "finetune"])
def test_the_lr_scales_with_the_global_batch_of_every_process(protocol, monkeypatch):
    # MAE's rule: lr = base_lr x (batch per process x processes) / 256; here 2 processes of 32
    import ssl_vit.eval.finetune as finetune
    import ssl_vit.eval.linear_augmented as linear_augmented

    module = {"linear_aug": linear_augmented, "finetune": finetune}[protocol]
    settings = {"linear_aug": linear_augmented.LinearAugSettings, "finetune": finetune.FineTuneSettings}[protocol]
    built = []
    monkeypatch.setattr(module, "train_and_test", lambda make_module, *a, **k: built.append(make_module(10, 5, 2)) or {})
    backbone = create_backbone("vit", img_size=8, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2)
    settings(epochs=2, batch_size=32, base_lr=0.1).run(backbone, None, None, 3)
    assert built[0].lr == pytest.approx(0.1 * 64 / 256)


def test_the_frozen_backbone_runs_without_building_a_graph():
    # one backbone pass per image, kept out of autograd (no activations held for a backward)
    from ssl_vit.eval.linear_augmented import AugmentedLinearProbe

    backbone = create_backbone("vit", img_size=8, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2)
    grad_on = []
    backbone.register_forward_hook(lambda module, args, out: grad_on.append(torch.is_grad_enabled()))
    logits = AugmentedLinearProbe(backbone, 3)(torch.randn(2, 1, 8, 8))
    assert grad_on == [False] and logits.requires_grad  # the head still learns
