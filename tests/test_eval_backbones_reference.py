"""Fine-tuning, linear probes, gradient clipping and backbones against independent references
(timm's drop path and resampling, MAE's LARS, torchvision's ResNets and their init, torch's
``clip_grad_norm_``): each test fails on a plausible one-line change to the code it pins."""

from __future__ import annotations

import itertools
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchvision
from timm.layers import resample_abs_pos_embed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ssl_vit import create_backbone
from ssl_vit.backbones import ResNetBackbone, VisionTransformer
from ssl_vit.backbones.hybrid import HybridEmbed, hybrid_vit
from ssl_vit.backbones.pos_embed import resample_pos_embed, sincos_2d_pos_embed
from ssl_vit.eval.finetune import (
    FineTuneModule,
    FineTuneSettings,
    new_head,
    param_groups_layer_decay,
    set_drop_path,
)
from ssl_vit.eval.linear import LARS, LinearProbe, predict_logits
from ssl_vit.eval.linear_augmented import AugmentedLinearProbe
from ssl_vit.heads import LinearProbeHead
from ssl_vit.methods import distributed as grad_clip
from ssl_vit.methods.distributed import clip_gradients

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*")  # lightning internals, not ours


def tiny_vit(depth: int = 2, **kwargs) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=depth, num_heads=2, **kwargs)


# ----------------------------------------------------------------------------- fine-tuning
def test_layer_decay_one_is_off_and_frozen_parameters_are_left_out():
    # MAE param_groups_lrd: layer_decay 1 gives every group scale 1; a parameter that does not
    # train (a fixed sin-cos table) belongs to no optimiser group.
    vit = tiny_vit(pos_embed="sincos")
    assert not vit.pos_embed.requires_grad
    groups = param_groups_layer_decay(vit, nn.Linear(32, 3), lr=0.1, weight_decay=0.05, layer_decay=1.0)
    assert {g["lr_scale"] for g in groups} == {1.0} and {g["lr"] for g in groups} == {0.1}
    names = [n for g in groups for n in g["names"]]
    assert "pos_embed" not in names and "cls_token" in names
    assert len(names) == sum(p.requires_grad for p in vit.parameters()) + 2


def _mae_param_groups_lrd(named, weight_decay, no_weight_decay_list, layer_decay, depth):
    """MAE util/lr_decay.py (param_groups_lrd + get_layer_id_for_vit), written out: name ->
    (lr_scale, weight_decay)."""
    num_layers = depth + 1
    layer_scales = [layer_decay ** (num_layers - i) for i in range(num_layers + 1)]

    def get_layer_id_for_vit(name):
        if name in ["cls_token", "pos_embed"]:
            return 0
        elif name.startswith("patch_embed"):
            return 0
        elif name.startswith("blocks"):
            return int(name.split(".")[1]) + 1
        else:
            return num_layers

    out = {}
    for n, p in named:
        if not p.requires_grad:
            continue
        this_decay = 0.0 if p.ndim == 1 or n in no_weight_decay_list else weight_decay
        out[n] = (layer_scales[get_layer_id_for_vit(n)], this_decay)
    return out


@pytest.mark.parametrize("name", ["vit", "hybrid"])
def test_layer_decay_groups_are_maes_for_vits_and_hybrids(name):
    # A hybrid's ResNet trunk sits in patch_embed: MAE's rule gives all of it layer 0.
    torch.manual_seed(0)
    if name == "vit":
        backbone = tiny_vit(depth=3)
    else:
        backbone = create_backbone("hybrid", resnet="resnet18", embed_dim=32, depth=3, num_heads=2, img_size=16,
                                   in_chans=1, num_stages=2, small_input=True)
    head = nn.Linear(32, 3)
    groups = param_groups_layer_decay(backbone, head, lr=2.0, weight_decay=0.05, layer_decay=0.65)
    ours = {n: (g["lr_scale"], g["weight_decay"]) for g in groups for n in g["names"]}
    for g in groups:
        assert g["lr"] == pytest.approx(2.0 * g["lr_scale"])
    named = list(backbone.named_parameters()) + [(f"head.{n}", p) for n, p in head.named_parameters()]
    want = _mae_param_groups_lrd(named, 0.05, {"pos_embed", "cls_token"}, 0.65, depth=3)
    assert ours.keys() == want.keys()
    for n, (scale, wd) in want.items():
        assert ours[n] == (pytest.approx(scale), wd), n


def test_a_seeded_new_head_does_not_depend_on_the_global_generator():
    torch.manual_seed(0)
    a = new_head(64, 10, seed=3)
    torch.manual_seed(1)
    b, c = new_head(64, 10, seed=3), new_head(64, 10, seed=4)
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, c.weight)


def test_the_finetuning_optimiser_and_loss_take_the_given_betas_and_smoothing(monkeypatch):
    module = FineTuneModule(tiny_vit(), 3, FineTuneSettings(drop_path_rate=0.0, label_smoothing=0.3, betas=(0.8, 0.95)),
                            total_steps=10, steps_per_epoch=5)
    opt = module.configure_optimizers()["optimizer"]
    assert {tuple(g["betas"]) for g in opt.param_groups} == {(0.8, 0.95)}
    torch.nn.init.normal_(module.head.weight)
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 0])
    loss = module.training_step((x, y), 0)
    with torch.no_grad():
        logp = module(x).log_softmax(-1)
    smoothed = 0.7 * F.one_hot(y, 3) + 0.3 / 3  # (1 - eps) onehot + eps / K
    assert loss.item() == pytest.approx(-(smoothed * logp).sum(-1).mean().item(), rel=1e-5)


def _timm_drop_path(x: torch.Tensor, drop_prob: float, generator: torch.Generator) -> torch.Tensor:
    """timm.layers.drop_path, written out: one Bernoulli draw per sample, kept ones scaled by
    1 / keep."""
    keep = 1.0 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    return x * torch.empty(shape).bernoulli_(keep, generator=generator) / keep


def test_drop_path_drops_whole_samples_as_timm_and_is_off_in_a_one_block_vit():
    vit = tiny_vit(depth=2)
    set_drop_path(vit, 0.5)  # block 1: rate 0.5 (timm's torch.linspace(0, 0.5, 2))
    x = torch.ones(64, 5, 8)
    out = vit.blocks[1].drop_path.train()(x)
    ref = _timm_drop_path(x, 0.5, torch.Generator().manual_seed(0))
    # per sample: all of its values dropped together, survivors scaled by 1/keep, as timm
    per_sample = out.flatten(1)
    assert torch.equal(per_sample, per_sample[:, :1].expand_as(per_sample))
    assert set(per_sample[:, 0].tolist()) == set(ref[:, 0, 0].tolist()) == {0.0, 2.0}
    one = tiny_vit(depth=1)
    set_drop_path(one, 0.3)  # timm: torch.linspace(0, 0.3, 1) == [0.]
    x = torch.randn(4, 5, 32)
    assert torch.equal(one.blocks[0].drop_path.train()(x), x)


def _mix_kind(x: torch.Tensor, out: torch.Tensor) -> str:
    """'cutmix' when every pixel comes from the image or from its rolled partner, some from each;
    'mixup' when every pixel is one convex combination of the two (torchvision v2 MixUp /
    CutMix); 'either' when the output is one of the two images (lambda 0 or 1)."""
    rolled = x.roll(1, 0)
    from_x, from_rolled = out == x, out == rolled
    if torch.all(from_x | from_rolled):
        return "cutmix" if from_x[0].any() and from_rolled[0].any() else "either"
    lam = ((out - rolled) / (x - rolled))[0].flatten()
    assert torch.allclose(lam, lam[0].expand_as(lam), atol=1e-4)
    return "mixup"


def test_mixup_and_cutmix_are_chosen_per_batch_with_their_own_alphas():
    # DeiT/MAE (timm Mixup, switch prob 0.5): with both on, each batch gets one of the two; MixUp's
    # lambda ~ Beta(mixup_alpha, mixup_alpha): with alpha 0.1 mostly near 0 or 1.
    module = FineTuneModule(tiny_vit(), 3, FineTuneSettings(mixup_alpha=0.1, cutmix_alpha=1.0, drop_path_rate=0.0))
    x = torch.randn(4, 1, 16, 16)
    y = torch.tensor([0, 2, 2, 1])  # image 0 is mixed with image 3 (label 1)
    kinds, mixup_lams = [], []
    for seed in range(60):
        torch.manual_seed(seed)
        out, soft = module.mix(x, y)
        kind = _mix_kind(x, out)
        kinds.append(kind)
        if kind == "mixup":
            mixup_lams.append(float(soft[0, 0]))
    assert kinds.count("mixup") >= 10 and kinds.count("cutmix") >= 10
    assert sum(abs(lam - 0.5) for lam in mixup_lams) / len(mixup_lams) > 0.35
    only_mixup = FineTuneModule(tiny_vit(), 3, FineTuneSettings(mixup_alpha=0.8, drop_path_rate=0.0)).mix
    only_cutmix = FineTuneModule(tiny_vit(), 3, FineTuneSettings(cutmix_alpha=1.0, drop_path_rate=0.0)).mix
    torch.manual_seed(0)
    assert _mix_kind(x, only_mixup(x, y)[0]) == "mixup"
    assert _mix_kind(x, only_cutmix(x, y)[0]) == "cutmix"


class _Record(L.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[-1]["lr"])


def test_fine_tuning_by_the_trainers_estimate_decays_to_zero_and_draws_anew_each_epoch():
    # Without total_steps the schedule spans the trainer's steps (2 epochs x 1 batch): the peak,
    # then MAE's cosine at step 1 of 2, 0.5 * (1 + cos(pi / 2)); the MixUp draw of batch 0 differs between epochs.
    module = FineTuneModule(tiny_vit(), 3, FineTuneSettings(base_lr=0.256, batch_size=8, warmup_epochs=0, mixup_alpha=1.0, drop_path_rate=0.1))
    lams = []
    module.mix.register_forward_hook(lambda m, args, out: lams.append(float(out[1][0, int(args[1][0])])))
    record = _Record()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 1, 16, 16, generator=g), torch.arange(8) % 3)
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", callbacks=[record])
    trainer.fit(module, DataLoader(data, batch_size=8))
    assert record.lrs == pytest.approx([0.256 * 8 / 256, 0.5 * 0.256 * 8 / 256])
    assert len(lams) == 2 and lams[0] != lams[1]


# ----------------------------------------------------------------------------- linear probe on images
def _probe(features: str = "cls") -> AugmentedLinearProbe:
    torch.manual_seed(1)
    probe = AugmentedLinearProbe(tiny_vit(), 3, features=features)
    probe.log = lambda *a, **k: None
    return probe.train()


def test_the_augmented_probe_reads_the_chosen_features():
    # "avg": the mean of the patch tokens after the final norm (timm global_pool="avg", fc_norm
    # False); "last4": DINO's [CLS] of the last 4 blocks, concatenated (4 x 32 inputs).
    x = torch.randn(4, 1, 16, 16)
    seen = []
    probe = _probe("avg").eval()
    probe.head.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    probe(x)
    with torch.no_grad():
        want = probe.backbone.forward_features(x)[:, 1:].mean(1)
    torch.testing.assert_close(seen[0], want)
    last4 = AugmentedLinearProbe(tiny_vit(depth=4), 3, features="last4").eval()
    assert last4.head.norm.num_features == 4 * 32 and last4(x).shape == (4, 3)


def test_the_augmented_probe_skips_a_batch_of_one_and_drops_unlabelled_items():
    probe = _probe()
    x, y = torch.randn(5, 1, 16, 16), torch.tensor([0, -1, 2, -1, 1])
    assert probe.training_step((x[:1], y[:1]), 0) is None  # BatchNorm cannot train on one example
    kept_x, kept_y = probe.on_before_batch_transfer((x, y), 0)
    assert kept_y.tolist() == [0, 2, 1] and torch.equal(kept_x, x[[0, 2, 4]])


# ----------------------------------------------------------------------------- linear probe, LARS
class MaeLARS(torch.optim.Optimizer):
    """MAE util/lars.py, written out (weight decay and the trust ratio on matrices only; a zero
    weight or a zero update keeps ratio 1; momentum buffer from zero)."""

    def __init__(self, params, lr=0, weight_decay=0, momentum=0.9, trust_coefficient=0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm, update_norm = torch.norm(p), torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.0, torch.where(update_norm > 0, g["trust_coefficient"] * param_norm / update_norm, one), one)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def test_lars_matches_maes_with_weight_decay_momentum_and_a_zero_matrix():
    torch.manual_seed(0)
    init = [torch.randn(4, 6), torch.zeros(3, 2), torch.randn(4)]  # a matrix, a zero matrix, a bias
    ours = [nn.Parameter(t.clone()) for t in init]
    ref = [nn.Parameter(t.clone()) for t in init]
    opt_ours = LARS(ours, lr=0.5, momentum=0.9, weight_decay=0.05, trust_coefficient=0.02)
    opt_ref = MaeLARS(ref, lr=0.5, momentum=0.9, weight_decay=0.05, trust_coefficient=0.02)
    for _ in range(4):
        grads = [torch.randn_like(t) for t in init]
        for params, opt in ((ours, opt_ours), (ref, opt_ref)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.data, b.data)


def test_the_probe_shuffles_every_epoch_by_its_seed_and_scales_the_lr_by_the_batch_used(monkeypatch):
    # Column 0 names the example: record which examples each step sees.
    n, bs = 24, 8
    x = torch.randn(n, 3)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    y = torch.arange(n) % 2
    seen, real_forward = [], LinearProbeHead.forward

    def forward(self, features):
        if self.training:
            seen.append(tuple(int(v) for v in features[:, 0].round()))
        return real_forward(self, features)

    monkeypatch.setattr(LinearProbeHead, "forward", forward)

    def order(seed: int) -> list[tuple[int, ...]]:
        seen.clear()
        head = LinearProbe(epochs=2, batch_size=bs, base_lr=0.1, warmup_epochs=0, seed=seed).fit(x, y, 2)
        assert not head.training  # handed back in eval mode (BatchNorm on running statistics)
        return list(seen)

    a, b, c = order(0), order(0), order(1)
    assert a == b and a != c
    epochs = [a[:3], a[3:]]
    for epoch in epochs:  # each epoch: a permutation of all 24 examples in 3 batches of 8
        assert sorted(i for batch in epoch for i in batch) == list(range(n))
    assert epochs[0] != epochs[1]
    assert epochs[0] != [tuple(range(i, i + bs)) for i in range(0, n, bs)]  # not the data order

    # The remainder is dropped (MAE drop_last): 20 examples give 2 batches of 8 an epoch.
    seen.clear()
    LinearProbe(epochs=2, batch_size=bs, warmup_epochs=0).fit(x[:20], y[:20], 2)
    assert [len(batch) for batch in seen] == [bs] * 4

    # A set smaller than the batch is one batch, and the LR follows that batch (base_lr x 6 / 256).
    lrs, real_step = [], torch.optim.SGD.step

    def step(self, *args, **kwargs):
        lrs.append(self.param_groups[0]["lr"])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", step)
    LinearProbe(epochs=2, batch_size=64, base_lr=0.1, warmup_epochs=0).fit(x[:6], y[:6], 2)
    assert lrs == pytest.approx([0.1 * 6 / 256, 0.5 * 0.1 * 6 / 256])  # MAE: cos(pi * t / T), T = 2 steps


def test_predicted_logits_use_the_running_statistics():
    torch.manual_seed(0)
    head = LinearProbeHead(4, 3)
    head.norm.running_mean.fill_(2.0)
    head.norm.running_var.fill_(9.0)
    x = torch.randn(8, 4)
    want = head.linear((x - 2.0) / math.sqrt(9.0 + 1e-6))
    torch.testing.assert_close(predict_logits(head.train(), x), want.detach())


def test_the_probe_has_an_output_for_every_class_of_the_test_set():
    # Training labels 0..3, test labels 0..4: five classes, so top-5 is reported.
    g = torch.Generator().manual_seed(0)
    xtr, ytr = torch.randn(40, 4, generator=g), torch.arange(40) % 4
    xte, yte = torch.randn(10, 4, generator=g), torch.arange(10) % 5
    metrics = LinearProbe(epochs=1, batch_size=8).evaluate(xtr, ytr, xte, yte)
    assert set(metrics) == {"top1", "top5"} and metrics["top5"] == 1.0


# ----------------------------------------------------------------------------- gradient clipping
def _grads(scales: list[float]) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for i, s in enumerate(scales):
        p = nn.Parameter(torch.zeros(3, i + 2))
        p.grad = torch.randn(3, i + 2, generator=g) * s
        params.append(p)
    return params


@pytest.mark.parametrize("sharded", [False, True])
def test_clipping_matches_torch_clip_grad_norm_and_never_scales_up(monkeypatch, sharded):
    # The sharded path on one process (the all-reduce of one shard is the identity) must clip as
    # torch.nn.utils.clip_grad_norm_ does: per parameter, small gradients untouched.
    if sharded:
        monkeypatch.setattr(grad_clip.dist, "all_reduce", lambda tensor, group=None: None)
        monkeypatch.setattr(grad_clip.dist, "get_backend", lambda group=None: "gloo")
    group = object() if sharded else None
    scales = [0.01, 10.0, 0.02, 5.0]  # two gradients below max_norm 1, two above
    ours, ref = _grads(scales), _grads(scales)
    norms = clip_gradients(ours, 1.0, "per_param", shard_group=group)
    want = torch.stack([torch.nn.utils.clip_grad_norm_([p], 1.0) for p in ref])
    torch.testing.assert_close(norms, want)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)
    # global: a total norm below max_norm leaves every gradient as it was
    small, ref = _grads([0.01, 0.02, 0.01, 0.03]), _grads([0.01, 0.02, 0.01, 0.03])
    norm = clip_gradients(small, 1.0, "global", shard_group=group)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref, 1.0))
    for a, b in zip(small, ref):
        torch.testing.assert_close(a.grad, b.grad)
    assert clip_gradients([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))], 1.0, "per_param").tolist() == [0.0, 0.0]
    if sharded:  # a skipped step (no gradients) still joins the all-reduce, with the parameters' device
        reduced = []
        monkeypatch.setattr(grad_clip.dist, "all_reduce", lambda tensor, group=None: reduced.append(tensor.device))
        assert clip_gradients([nn.Parameter(torch.ones(2))], 1.0, "per_param", shard_group=group).tolist() == [0.0]
        assert reduced == [torch.device("cpu")]


# ----------------------------------------------------------------------------- position embeddings
@pytest.mark.parametrize("prefix", [0, 2])
def test_position_embeddings_with_other_prefix_counts(prefix):
    table = sincos_2d_pos_embed(16, (2, 3), num_prefix_tokens=prefix)
    assert table.shape == (1, prefix + 6, 16) and not table[0, :prefix].any()
    torch.testing.assert_close(table[0, prefix:], sincos_2d_pos_embed(16, (2, 3))[0, 1:])
    torch.manual_seed(0)
    pe = torch.randn(1, prefix + 3 * 5, 16)
    for new in ((6, 10), (2, 3)):
        ref = resample_abs_pos_embed(pe, list(new), [3, 5], num_prefix_tokens=prefix)
        torch.testing.assert_close(resample_pos_embed(pe, new, (3, 5), num_prefix_tokens=prefix), ref, atol=1e-6, rtol=0)


def test_resampling_keeps_the_dtype_and_takes_the_interpolation_as_timm():
    torch.manual_seed(0)
    pe = torch.randn(1, 1 + 16, 8).to(torch.bfloat16)
    ours = resample_pos_embed(pe, (6, 6), (4, 4))
    ref = resample_abs_pos_embed(pe, [6, 6], [4, 4], num_prefix_tokens=1)
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours, ref)
    pe = pe.float()
    for mode, antialias in (("bilinear", True), ("bicubic", False)):
        ref = resample_abs_pos_embed(pe, [3, 2], [4, 4], num_prefix_tokens=1, interpolation=mode, antialias=antialias)
        torch.testing.assert_close(resample_pos_embed(pe, (3, 2), (4, 4), mode=mode, antialias=antialias), ref)


# ----------------------------------------------------------------------------- ResNets and hybrids
@pytest.mark.parametrize("arch", ["resnet18", "resnet34", "resnet50", "resnet101"])
def test_resnet_parameters_are_torchvisions_shape_for_shape(arch):
    with torch.device("meta"):
        ours = ResNetBackbone(arch)
        ref = getattr(torchvision.models, arch)()
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items() if not k.startswith("fc.")}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == want


def test_a_grey_imagenet_stem_is_torchvisions_and_the_init_is_its_init():
    # One input channel: torchvision's ResNet-18 on the grey image copied to 3 channels with
    # conv1's weight split in three computes the same function (same 7x7 stride-2 geometry).
    torch.manual_seed(0)
    ours = ResNetBackbone("resnet18", in_chans=1).eval()
    ref = torchvision.models.resnet18()
    ref.fc = nn.Identity()
    state = dict(ours.state_dict())
    state["conv1.weight"] = state["conv1.weight"].repeat(1, 3, 1, 1) / 3
    ref.load_state_dict(state)
    x = torch.randn(2, 1, 37, 45)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref.eval()(x.repeat(1, 3, 1, 1)), atol=1e-5, rtol=1e-4)
    # torchvision's ResNet init: kaiming_normal_(fan_out, relu) on every conv, the rebuilt stems
    # included: std sqrt(2 / (64 k^2)); BatchNorm weights 1 (zero_init_residual off).
    for kwargs, k in (({"in_chans": 1}, 7), ({"small_input": True}, 3), ({"small_input": True, "in_chans": 1}, 3)):
        net = ResNetBackbone("resnet18", **kwargs)
        assert float(net.conv1.weight.detach().std()) == pytest.approx(math.sqrt(2 / (64 * k * k)), rel=0.1), kwargs
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in ours.modules() if isinstance(m, nn.BatchNorm2d))


def test_the_hybrid_embedding_is_the_vit_papers():
    # ViT paper: the R50 hybrid keeps 3 stages with (3, 4, 9) blocks (stage 4's moved into 3).
    with torch.device("meta"):
        r50 = create_backbone("hybrid_r50_vit_base")
    trunk = r50.patch_embed.backbone
    assert [len(trunk.layer1), len(trunk.layer2), len(trunk.layer3)] == [3, 4, 9] and not hasattr(trunk, "layer4")
    # Tokens: a 1x1 convolution (with bias) of the trunk's map, read row-major (timm HybridEmbed:
    # proj, flatten(2), transpose(1, 2)); the grid is (rows, columns), also off the square.
    torch.manual_seed(0)
    embed = HybridEmbed("resnet18", 1, 8, num_stages=2, small_input=True).eval()
    assert embed.proj.bias is not None
    x = torch.randn(2, 1, 16, 24)
    with torch.no_grad():
        tokens, grid = embed(x)
        fmap = F.conv2d(embed.backbone.forward_features(x), embed.proj.weight, embed.proj.bias)  # [2, 8, 8, 12]
    assert grid == (8, 12)
    for r, c in itertools.product(range(8), range(12)):
        torch.testing.assert_close(tokens[:, r * 12 + c], fmap[:, :, r, c])
    with pytest.raises(ValueError, match="image size 30x30 is not divisible by the patch size 4"):  # the trunk's stride
        hybrid_vit("resnet18", 8, 1, 2, img_size=30, in_chans=1, num_stages=3, small_input=True)


@pytest.mark.parametrize("kwargs", [
    {"drop_path_rate": 0.3}, {"attn_drop_rate": 0.3}, {"drop_rate": 0.3}, {"pos_embed": "sincos"}, {"global_pool": "avg"},
])
def test_a_hybrid_is_the_vit_with_the_resnet_embedding_whatever_its_settings(kwargs):
    # The ViT paper's hybrid: the Transformer unchanged; every ViT setting reaches it.
    shape = {"embed_dim": 32, "depth": 2, "num_heads": 2}
    torch.manual_seed(0)
    ours = hybrid_vit("resnet18", img_size=16, in_chans=1, num_stages=2, small_input=True, **shape, **kwargs).train()
    torch.manual_seed(0)
    embed = HybridEmbed("resnet18", 1, 32, num_stages=2, small_input=True)
    ref = VisionTransformer(img_size=16, patch_embed=embed, **shape, **kwargs).train()
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name
    x = torch.randn(4, 1, 16, 16)
    outs = []
    for model in (ours, ref):
        torch.manual_seed(1)  # the same dropout / drop path draws
        outs.append(model(x))
    torch.testing.assert_close(outs[0], outs[1])
