import os
import signal

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchvision.ops import StochasticDepth

from ssl_vit import create_backbone
from ssl_vit.backbones import VisionTransformer
from ssl_vit.eval.finetune import (
    FineTuneModule,
    FineTuneSettings,
    new_head,
    param_groups_layer_decay,
    set_drop_path,
)
from ssl_vit.eval.train_run import EvalRunInterrupted, ImageRun

# lightning internals, not ours
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*")


def tiny_vit(depth: int = 2) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=depth, num_heads=2)


def run_finetune(backbone, train, test, num_classes, run_dir=None, resume=False, run_info=None, origin=None, img_size=None, **settings):
    """Fine-tune on the CPU with ``FineTuneSettings(**settings)``."""
    return FineTuneSettings(**settings).run(backbone, train, test, num_classes, ImageRun(accelerator="cpu", run_dir=run_dir, resume=resume),
                                            run_info=run_info, origin=origin, img_size=img_size)


def test_layer_ids_scales_and_weight_decay_for_a_tiny_vit():
    vit = tiny_vit(depth=2)
    head = torch.nn.Linear(32, 3)
    groups = param_groups_layer_decay(vit, head, lr=1.0, weight_decay=0.05, layer_decay=0.5)
    seen = {}
    for g in groups:
        for name in g["names"]:
            assert name not in seen
            seen[name] = (g["layer_id"], g["lr"], g["weight_decay"])
    # depth 2: ids 0 (embeddings), 1-2 (blocks), 3 (final norm, head); lr = 0.5 ** (3 - id)
    expected = {
        "cls_token": (0, 0.125, 0.0),
        "pos_embed": (0, 0.125, 0.0),
        "patch_embed.proj.weight": (0, 0.125, 0.05),
        "patch_embed.proj.bias": (0, 0.125, 0.0),
        "blocks.0.norm1.weight": (1, 0.25, 0.0),
        "blocks.0.attn.qkv.weight": (1, 0.25, 0.05),
        "blocks.0.mlp.fc2.bias": (1, 0.25, 0.0),
        "blocks.1.attn.proj.weight": (2, 0.5, 0.05),
        "blocks.1.norm2.bias": (2, 0.5, 0.0),
        "norm.weight": (3, 1.0, 0.0),
        "head.weight": (3, 1.0, 0.05),
        "head.bias": (3, 1.0, 0.0),
    }
    for name, value in expected.items():
        assert seen[name] == value, name
    assert len(seen) == len(list(vit.parameters())) + 2


def test_resnet_layer_ids_follow_stages():
    net = create_backbone("resnet18", in_chans=1, small_input=True)
    groups = param_groups_layer_decay(net, None, lr=1.0, weight_decay=0.0, layer_decay=0.5)
    ids = {n: g["layer_id"] for g in groups for n in g["names"]}
    assert ids["conv1.weight"] == 0 and ids["bn1.weight"] == 0
    assert ids["layer1.0.conv1.weight"] == 1 and ids["layer4.1.bn2.bias"] == 4
    assert {g["layer_id"]: g["lr"] for g in groups}[1] == 0.5**4


def test_drop_path_increases_linearly():
    vit = tiny_vit(depth=3)
    set_drop_path(vit, 0.2)
    assert isinstance(vit.blocks[0].drop_path, torch.nn.Identity)
    assert [vit.blocks[i].drop_path.p for i in (1, 2)] == pytest.approx([0.1, 0.2])
    assert all(isinstance(vit.blocks[i].drop_path, StochasticDepth) for i in (1, 2))


def _data(n: int = 16, size: int = 16):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, size, size, generator=g), torch.arange(n) % 3)


@pytest.mark.filterwarnings("ignore:.*self.trainer.*")
def test_random_erasing_replaces_one_box_of_each_image_with_noise_before_mixing():
    module = FineTuneModule(tiny_vit(), 3, FineTuneSettings(random_erasing=1.0, warmup_epochs=0))
    seen = []
    forward = module.forward
    module.forward = lambda x: seen.append(x.clone()) or forward(x)
    mixed = []
    module.mix = lambda x, y: (mixed.append(x.clone()), (x, F.one_hot(y, 3).float()))[1]  # MixUp's place, spied on
    x = torch.randn(6, 1, 16, 16)
    torch.manual_seed(0)
    module.training_step((x.clone(), torch.arange(6) % 3), 0)
    (inp,) = seen
    assert torch.equal(mixed[0], inp)  # erased before mixing
    boxes = set()
    for before, after in zip(x, inp):
        rows, cols = torch.nonzero((before != after)[0], as_tuple=True)
        top, bottom, left, right = int(rows.min()), int(rows.max()), int(cols.min()), int(cols.max())
        area = (bottom - top + 1) * (right - left + 1)
        assert len(rows) == area  # one whole box, the rest as it was
        assert 0.02 * 256 <= area <= 256 / 3 + 1  # 2-33 % of the image (Zhong et al.; timm's defaults)
        boxes.add((top, bottom, left, right))
    assert len(boxes) > 1  # drawn per image


def test_a_run_recorded_before_a_setting_existed_resumes_while_the_setting_is_off():
    from ssl_vit.eval.train_run import settings_difference

    older = {"base_lr": 5e-4, "epochs": 2}  # a checkpoint written before random_erasing existed
    assert settings_difference(older, {"base_lr": 5e-4, "epochs": 2, "random_erasing": 0.0, "rand_augment": None}) is None
    assert settings_difference(older, {"base_lr": 5e-4, "epochs": 2, "random_erasing": 0.25}) == "random_erasing: None there, 0.25 here"
    assert settings_difference(older, {"base_lr": 5e-4, "epochs": 3}) == "epochs: 2 there, 3 here"


def test_rand_augment_reaches_the_training_crops():
    assert FineTuneSettings(rand_augment=(2, 9)).train_views(32).rand_augment == (2, 9)
    assert FineTuneSettings(rand_augment=(2, 9), augment=False).train_views(32) is None  # the evaluation transform


def test_two_steps_change_weights_and_lr_groups_follow_the_decay():
    vit = tiny_vit(depth=2)
    before = {n: p.detach().clone() for n, p in vit.named_parameters()}
    module = FineTuneModule(vit, 3, FineTuneSettings(base_lr=1e-2, batch_size=8, layer_decay=0.5, warmup_epochs=0, drop_path_rate=0.1))
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    changed = [n for n, p in vit.named_parameters() if not torch.equal(p, before[n])]
    assert "blocks.0.attn.qkv.weight" in changed and "patch_embed.proj.weight" in changed
    # peak LR 1e-2 * 8 / 256 for the head; the scheduler (LambdaLR) multiplies each group's own
    # initial LR by one factor, so the groups keep the ratios decay ** (3 - id)
    assert trainer.optimizers[0].defaults["fused"]  # torch's fused AdamW kernel on CPU
    groups = trainer.optimizers[0].param_groups
    assert {g["layer_id"] for g in groups} == {0, 1, 2, 3}
    for g in groups:
        assert g["initial_lr"] == pytest.approx(1e-2 * 8 / 256 * 0.5 ** (3 - g["layer_id"]))
    assert vit.blocks[1].drop_path.p == pytest.approx(0.1)


def test_a_sincos_position_embedding_trains_in_fine_tuning_from_the_table():
    # MAE / MoCo v3 fine-tune timm's ViT, whose pos_embed is a learnable parameter loaded with
    # the pretraining's table: every weight trains (MAE `main_finetune.py`, `interpolate_pos_embed`).
    vit = create_backbone("vit", img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2, pos_embed="sincos")
    table = vit.pos_embed.detach().clone()
    module = FineTuneModule(vit, 3, FineTuneSettings(base_lr=1e-2, batch_size=8, warmup_epochs=0), img_size=24)
    assert vit.pos_embed.requires_grad and vit.backbone_kwargs["pos_embed"] == "learn" and vit.backbone_kwargs["img_size"] == 24
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    trainer.fit(module, DataLoader(_data(size=24), batch_size=8))
    names = {id(p): n for n, p in vit.named_parameters()}
    assert "pos_embed" in {names.get(id(p)) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    resampled_table = VisionTransformer(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2)
    resampled_table.pos_embed.data.copy_(table)
    resampled_table.set_img_size(24)
    assert not torch.equal(vit.pos_embed, resampled_table.pos_embed)  # it moved from where it started


class _Modes(L.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[bool, bool]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        self.seen.append((pl_module.backbone.training, all(m.training for m in pl_module.backbone.modules())))


def test_a_backbone_handed_over_in_eval_mode_trains_in_train_mode():
    # Backbones are loaded for evaluation in eval mode, and Lightning keeps each module's mode:
    # fine-tuning would run without drop path and with frozen BatchNorm statistics.
    modes = _Modes()
    module = FineTuneModule(tiny_vit(depth=2).eval(), 3, FineTuneSettings(batch_size=8, warmup_epochs=0, drop_path_rate=0.1))
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", callbacks=[modes])
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    assert modes.seen == [(True, True), (True, True)]


def test_run_finetune_with_mixup_cutmix_and_new_resolution():
    vit = tiny_vit(depth=2)
    old = vit.pos_embed.detach().clone()  # [1, 1 + 16, 32]
    metrics = run_finetune(
        vit, _data(size=24), _data(8, size=24), num_classes=3, epochs=1, batch_size=8, max_steps=2, img_size=24, mixup_alpha=0.8, cutmix_alpha=1.0,
    )
    assert set(metrics) == {"top1"} and 0.0 <= metrics["top1"] <= 1.0
    assert vit.pos_embed.shape == (1, 1 + 36, 32) and vit.grid_size == (6, 6)
    assert torch.allclose(vit.pos_embed[:, 0], old[:, 0], atol=1e-3)  # [CLS] entry is carried over


def test_unlabelled_items_neither_train_nor_count():
    # An unreadable file of an evaluation split comes labelled -1 (ImageFiles.for_evaluation).
    # Training skips such items (MixUp included), and the test accuracy is the same with or
    # without them in the test set.
    train = _data(n=24)
    train.tensors[1][::5] = -1
    test = _data(n=12)
    x, y = test.tensors
    padded = TensorDataset(torch.cat([x, torch.randn(5, *x.shape[1:])]), torch.cat([y, torch.full((5,), -1)]))
    accs = [
        run_finetune(tiny_vit(), train, t, num_classes=3, epochs=1, batch_size=8, mixup_alpha=0.8)["top1"]
        for t in (test, padded)
    ]
    assert accs[0] == accs[1]


def test_an_interrupted_fine_tuning_resumes_to_the_uninterrupted_weights(tmp_path, monkeypatch):
    # A signal mid-epoch saves the run and stops it; resumed, it ends where the run that was never
    # interrupted ends (data order, MixUp and drop path draws included).
    common = {"num_classes": 3, "epochs": 2, "batch_size": 8, "mixup_alpha": 0.8, "drop_path_rate": 0.2, "warmup_epochs": 0.5, "checkpoint_every": 1000}
    train, test = _data(n=24), _data(n=12)
    whole = tiny_vit()
    want = run_finetune(whole, train, test, run_dir=tmp_path / "whole", **common)

    step = FineTuneModule.training_step

    def signalled(self, batch, batch_idx):
        if self.global_step == 1 and not getattr(self, "_signalled", False):
            self._signalled = True
            os.kill(os.getpid(), signal.SIGUSR1)
        return step(self, batch, batch_idx)

    monkeypatch.setattr(FineTuneModule, "training_step", signalled)
    common = {**common, "origin": {"pretrain_steps": 2}}  # (the backbone's pretraining step)
    with pytest.raises(EvalRunInterrupted, match="stopped by SIGUSR1 at step 2") as stop:
        run_finetune(tiny_vit(), train, test, run_dir=tmp_path / "cut", **common)
    assert stop.value.checkpoint == tmp_path / "cut" / "checkpoints" / "last.ckpt"
    monkeypatch.setattr(FineTuneModule, "training_step", step)
    with pytest.raises(ValueError, match="already holds a fine-tuning run's checkpoints"):
        run_finetune(tiny_vit(), train, test, run_dir=tmp_path / "cut", **common)
    # Other settings on resume would not run (the optimiser and its LR schedule are restored)
    # while the record would claim them: refused, naming them.
    with pytest.raises(ValueError, match=r"is a fine-tuning run started with other settings: base_lr: 0.0005 there, 0.05 here; "
                                         r"epochs: 2 there, 3 here; total_steps: 6 there, 9 here; resume it with the command"):
        run_finetune(tiny_vit(), train, test, run_dir=tmp_path / "cut", resume=True, **{**common, "epochs": 3}, base_lr=0.05)
    # nor on the weights of another pretraining step (a pretraining extended after it started)
    with pytest.raises(ValueError, match=r"started with other settings: origin: \{'pretrain_steps': 2\} there, \{'pretrain_steps': 4\} here"):
        run_finetune(tiny_vit(), train, test, run_dir=tmp_path / "cut", resume=True, **{**common, "origin": {"pretrain_steps": 4}})
    resumed = tiny_vit()
    got = run_finetune(resumed, train, test, run_dir=tmp_path / "cut", resume=True, **common)
    assert got == want
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def _saved(module: L.LightningModule, path, **extra) -> None:
    """``module``'s checkpoint as a run saves it (its on_save_checkpoint), without training."""
    checkpoint = {"state_dict": module.state_dict(), "global_step": 1, "epoch": 0, "pytorch-lightning_version": L.__version__, **extra}
    module.on_save_checkpoint(checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, path)


def test_a_run_dir_of_another_run_is_refused_in_one_line_before_lightning_loads_it(tmp_path):
    common = {"num_classes": 3, "epochs": 1, "batch_size": 8}
    train, test = _data(n=16), _data(n=8)
    tiny = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 2, "num_heads": 2}
    # A pretraining run (what `ssl-vit fit` saves: an ssl_vit record naming its method).
    (tmp_path / "pre" / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {f"backbone.{k}": v for k, v in create_backbone("vit", **tiny).state_dict().items()}, "global_step": 3,
                "epoch": 0, "ssl_vit": {"method": "MPP", "backbone": "vit", "backbone_kwargs": tiny}}, tmp_path / "pre" / "checkpoints" / "last.ckpt")
    for resume in (True, False):  # (without --resume: no advice to resume it)
        with pytest.raises(ValueError) as err:
            run_finetune(create_backbone("vit", **tiny), train, test, run_dir=tmp_path / "pre", resume=resume, **common)
        assert str(err.value) == (f"--run-dir {tmp_path / 'pre'} holds a pretraining run of MPP, not a fine-tuning run: "
                                  "choose another --run-dir")
    # A fine-tuning run of another backbone: its recorded architecture and method differ.
    _saved(FineTuneModule(create_backbone("vit", **tiny), 3, run_info={"method": "mpp+finetune"}), tmp_path / "ft" / "checkpoints" / "last.ckpt")
    with pytest.raises(ValueError) as err:
        run_finetune(create_backbone("vit", **{**tiny, "depth": 3}), train, test, run_dir=tmp_path / "ft", resume=True,
                     run_info={"method": "dino+finetune"}, **common)
    assert str(err.value) == (f"--run-dir {tmp_path / 'ft'} was fine-tuned from another backbone: depth: 2 there, 3 here; "
                              "method mpp+finetune there, dino+finetune here; resume it with the command that started it, or choose another --run-dir")
    # Backbones that record no architecture: their weights' names and shapes say it.
    _saved(FineTuneModule(tiny_vit(depth=2), 3), tmp_path / "plain" / "checkpoints" / "last.ckpt")
    with pytest.raises(ValueError, match=r"was fine-tuned from another backbone: 2 weights of other shapes \(e.g. head.weight: \[3, 32\] there, "
                                         r"\[4, 32\] here\); resume it"):
        run_finetune(tiny_vit(depth=2), train, test, run_dir=tmp_path / "plain", resume=True, **{**common, "num_classes": 4})
    with pytest.raises(ValueError, match=r"other shapes .*; 12 weights missing there \(e.g. backbone.blocks.2.norm1.weight\)"):
        run_finetune(VisionTransformer(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=3, num_heads=2), train, test,
                     run_dir=tmp_path / "plain", resume=True, **{**common, "num_classes": 4})


def test_the_training_loss_is_label_smoothed_cross_entropy_from_a_near_zero_head(monkeypatch):
    # MAE main_finetune.py: the head starts trunc-normal(std 2e-5) (predictions near uniform);
    # the loss is cross-entropy with label smoothing 0.1.
    head = new_head(512, 100, seed=0)
    assert float(head.weight.detach().std()) == pytest.approx(2e-5, rel=0.05)  # (truncated at ±2 absolute, as timm's: in effect not)
    assert not head.bias.any()
    module = FineTuneModule(tiny_vit(), 3, FineTuneSettings(drop_path_rate=0.0, label_smoothing=0.1))
    torch.nn.init.normal_(module.head.weight)  # logits away from uniform, where smoothing shows
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 0])
    loss = module.training_step((x, y), 0)
    with torch.no_grad():
        logp = module(x).log_softmax(-1)
    smoothed = 0.9 * torch.nn.functional.one_hot(y, 3) + 0.1 / 3  # (1 - ε) onehot + ε / K
    assert loss.item() == pytest.approx(-(smoothed * logp).sum(-1).mean().item(), rel=1e-5)


@pytest.mark.parametrize(("replicas", "batch", "want"), [(1, 48, 1), (2, 48, 1), (2, 16, 2), (1, 16, 4)])
def test_each_process_gets_a_batch_when_its_share_is_smaller_than_one(replicas, batch, want):
    # 64 images over 2 processes are 32 each: a per-process batch of 48 must give one short batch,
    # not none (drop_last was decided on the whole set: "No training batches", an untrained record).
    from ssl_vit.data.sampler import ResumableSampler
    from ssl_vit.eval.train_run import training_loader

    data = TensorDataset(torch.zeros(64, 1), torch.zeros(64, dtype=torch.long))
    loader = training_loader(data, ResumableSampler(data, num_replicas=replicas, rank=0, seed=0), batch, num_workers=0)
    assert len(loader) == want and len(list(loader)) == want


def test_train_and_test_sizes_the_schedule_to_its_steps():
    from types import SimpleNamespace

    from ssl_vit.eval.train_run import ImageClassifier, train_and_test

    data = TensorDataset(torch.randn(16, 1, 8, 8), torch.arange(16) % 2)

    class Built(Exception):
        pass

    def record(total_steps, steps_per_epoch, world_size):
        raise Built(total_steps, steps_per_epoch, world_size)

    for epochs, batch, max_steps, expected in ((5, 4, 3, (3, 4, 1)), (5, 4, -1, (20, 4, 1)), (3, 16, -1, (3, 1, 1)),
                                               (2, 4, 100, (8, 4, 1))):  # (max_steps beyond the epochs: the epochs end it)
        with pytest.raises(Built) as built:
            train_and_test(record, data, data, FineTuneSettings(epochs=epochs, batch_size=batch, max_steps=max_steps), ImageRun("cpu"), "x")
        assert built.value.args == expected  # the LR schedule's length: the steps the run takes
    assert set(ImageClassifier(5).test_acc) == {"top1", "top5"} and set(ImageClassifier(4).test_acc) == {"top1"}
    # one process skips a batch with nothing to learn (None); under DDP every process joins with a zero
    module = ImageClassifier(2)
    module.linear = torch.nn.Linear(2, 1)
    module._trainer = SimpleNamespace(world_size=1)
    assert module.nothing_to_learn() is None
    module._trainer = SimpleNamespace(world_size=2)
    assert float(module.nothing_to_learn().detach()) == 0.0


def test_the_eval_option_rules_take_their_documented_bounds(tmp_path):
    from ssl_vit.cli.eval import RULES
    from ssl_vit.cli.options import check_out

    def ok(name, value):
        check, _ = RULES[name]
        return check(value)

    assert ok("layer_decay", 1.0) and not ok("layer_decay", 1.01)  # 1: no decay
    assert ok("rand_augment", [2, 30]) and not ok("rand_augment", [2, 31])  # torchvision's magnitude bins
    assert ok("random_erasing", 1.0) and not ok("random_erasing", 1.01)
    (tmp_path / "dir.JSON").mkdir()
    with pytest.raises(ValueError, match="is a folder; a name ending in .json names the result file itself"):
        check_out(str(tmp_path / "dir.JSON"))


def test_an_image_run_keeps_its_newest_step_checkpoint_at_its_interval(tmp_path):
    train, test = _data(n=24), _data(n=6)
    run_finetune(tiny_vit(), train, test, 3, epochs=2, batch_size=8, max_steps=5, run_dir=tmp_path, checkpoint_every=2)
    # steps 2 and 4 written, the newer kept; last.ckpt at the end (step 5)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt", "step00000004.ckpt"]


def test_the_result_counts_the_devices_of_a_device_list(tmp_path, monkeypatch):
    from ssl_vit.data import SyntheticDataModule
    from ssl_vit.eval.evaluate import Evaluation

    monkeypatch.setattr(FineTuneSettings, "run", lambda *a, **k: {"top1": 0.5})
    dm = SyntheticDataModule(num_samples=8, num_test_samples=4, num_classes=3, img_size=16, in_chans=1, num_workers=0)
    ((result, path),) = Evaluation(["finetune"]).run(tiny_vit(), {"method": "dino"}, dm, tmp_path, image_run=ImageRun(devices=[0, 1]))
    assert result.protocol_args["devices"] == 2 and path.exists()


def test_drop_path_zero_is_no_stochastic_depth():
    vit = tiny_vit(depth=2)
    set_drop_path(vit, 0.0)
    assert all(isinstance(b.drop_path, torch.nn.Identity) for b in vit.blocks)


def test_a_fine_tuning_checkpoint_says_it_is_one_and_a_resume_names_another_backbone_name(tmp_path):
    # finetune.py on_save_checkpoint: method "finetune" when no record names the pretraining (a
    # module used directly); train_run.run_kind reads any method ending in "finetune" as a
    # fine-tuning run. resume_difference names a registry name that differs, kwargs alike.
    from ssl_vit.eval.train_run import resume_difference, run_kind

    tiny = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2}
    module = FineTuneModule(create_backbone("vit", **tiny), 3)
    _saved(module, tmp_path / "ft.ckpt")
    saved = torch.load(tmp_path / "ft.ckpt", weights_only=False)
    assert saved["ssl_vit"]["method"] == "finetune" and run_kind(saved) == "fine-tuning run"
    assert resume_difference(module, saved) is None
    saved["ssl_vit"]["backbone"] = "my_vit"
    assert resume_difference(module, saved) == "my_vit there, vit here"
