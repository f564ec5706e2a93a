"""kNN, few-shot, frozen features, the EMA, synchronised BatchNorm, step checkpoints and heads
against independent references (DINO's weighted kNN as explicit loops over a tiny bank,
big_vision's few-shot classifier in numpy, the EMA and DINO's cosine momentum written out, torch's
BatchNorm over the whole batch and torch's own SyncBatchNorm converter, Lightning's own
ModelCheckpoint, torch's nn.Linear init, MAE's probe init): each test fails on a plausible
one-line change to the code it pins."""

from __future__ import annotations

import copy
import math
import os
import threading
import warnings
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ssl_vit import create_backbone
from ssl_vit.eval import fewshot
from ssl_vit.eval.features import extract_features
from ssl_vit.eval.fewshot import FewShotEvaluator
from ssl_vit.eval.knn import KNNClassifier
from ssl_vit.heads import DINOHead, LinearProbeHead, WeightNormLinear
from ssl_vit.methods import Supervised, distributed
from ssl_vit.methods.base import ema_update
from ssl_vit.methods.distributed import AllReduceBatchNorm, convert_sync_batchnorm
from ssl_vit.training.checkpoint import StepCheckpoint, newest_checkpoint


# ----------------------------------------------------------------------------- kNN
def _knn_votes(bank, labels, queries, k, t, num_classes):
    """DINO eval_knn.py / InstDisc written out: cosine similarity to every bank row, the k most
    similar vote for their label with weight exp(sim / T)."""
    votes = np.zeros((len(queries), num_classes))
    for qi, q in enumerate(queries.double().numpy()):
        sims = sorted(((float(q @ b / (np.linalg.norm(q) * np.linalg.norm(b))), int(y))
                       for b, y in zip(bank.double().numpy(), labels.tolist())), reverse=True)
        for sim, y in sims[:k]:
            votes[qi, y] += math.exp(sim / t)
    return torch.from_numpy(votes)


def test_knn_with_every_bank_row_as_a_neighbour_and_the_default_class_count():
    """Explicit-loop weighted kNN with k = the bank size (the largest allowed k) and no
    ``num_classes`` given (one class per label up to the largest)."""
    g = torch.Generator().manual_seed(0)
    bank, queries = torch.randn(6, 4, generator=g), torch.randn(3, 4, generator=g)
    labels = torch.tensor([0, 2, 1, 2, 0, 2])
    votes = KNNClassifier(k=6, temperature=0.5).scores(bank, labels, queries)
    assert votes.shape == (3, 3)
    torch.testing.assert_close(votes.double(), _knn_votes(bank, labels, queries, 6, 0.5, 3), rtol=1e-5, atol=0)


def test_knn_counts_the_classes_of_the_test_set_too():
    """A test class the bank lacks still counts as a class (DINO: the dataset's classes): with
    4 bank classes and a 5th in the test set, top-5 is reported, and top-1 is the loops' argmax."""
    g = torch.Generator().manual_seed(1)
    bank, queries = torch.randn(20, 5, generator=g), torch.randn(10, 5, generator=g)
    bank_labels, test_labels = torch.arange(20) % 4, torch.arange(10) % 5
    metrics = KNNClassifier(k=4, temperature=0.1).evaluate(bank, bank_labels, queries, test_labels)
    ref = _knn_votes(bank, bank_labels, queries, 4, 0.1, 5)
    assert set(metrics) == {"top1", "top5"} and metrics["top5"] == 1.0
    assert metrics["top1"] == pytest.approx(float((ref.argmax(1) == test_labels).double().mean()))


# ----------------------------------------------------------------------------- few-shot
def _lsr_predict(sx, sy, qx, num_classes, l2):
    """big_vision fewshot_lsr.py's classifier in numpy: standardise by the support's mean and
    population std (+1e-5), append a bias column of 100, ridge to 2·onehot − 1, argmax."""
    mean, std = sx.mean(0), sx.std(0) + 1e-5
    design = lambda x: np.hstack([(x - mean) / std, np.full((len(x), 1), 100.0)])  # noqa: E731
    xs = design(sx)
    w = np.linalg.lstsq(np.vstack([xs, math.sqrt(l2) * np.eye(xs.shape[1])]),
                        np.vstack([2.0 * np.eye(num_classes)[sy] - 1.0, np.zeros((xs.shape[1], num_classes))]), rcond=None)[0]
    return (design(qx) @ w).argmax(1)


def _recording(monkeypatch):
    """Wrap fewshot_fit_predict (called by the evaluator and its λ search) to record each call."""
    calls = []
    real = fewshot.fewshot_fit_predict

    def record(sx, sy, qx, num_classes, l2):
        pred = real(sx, sy, qx, num_classes, l2)
        calls.append({"sx": sx.clone(), "sy": sy.clone(), "qx": qx, "l2": l2, "pred": pred})
        return pred

    monkeypatch.setattr(fewshot, "fewshot_fit_predict", record)
    return calls


def _noisy_classes(per_class, num_classes=3, dim=6, seed=0, noise=1.5):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=g) * 2
    labels = torch.arange(num_classes).repeat(per_class)
    return centres[labels] + noise * torch.randn(len(labels), dim, generator=g), labels


def test_fewshot_supports_are_k_per_class_nested_redrawn_per_seed_and_averaged(monkeypatch):
    """ViT paper §4.1 / big_vision: per seed one random order of each class, the k-shot support
    is its first k (nested); each seed draws anew; the result is the mean over seeds and
    ``_std`` numpy's (population) std. A class with exactly max(shots) examples is enough."""
    xtr, ytr = _noisy_classes(6)  # 6 per class = the largest shot count
    xte, yte = _noisy_classes(20, seed=1)
    row = {tuple(r.tolist()): i for i, r in enumerate(xtr)}
    shots, seeds = (1, 3, 6), 4
    calls = _recording(monkeypatch)
    out = FewShotEvaluator(shots=shots, num_seeds=seeds, l2_reg=1.0).evaluate(xtr, ytr, xte, yte)
    assert len(calls) == len(shots) * seeds
    supports = {}
    for i, call in enumerate(calls):
        seed, k = divmod(i, len(shots))
        k = shots[k]
        idx = [row[tuple(r.tolist())] for r in call["sx"]]
        assert torch.equal(call["sy"], ytr[idx])
        assert torch.bincount(call["sy"], minlength=3).tolist() == [k] * 3
        supports[seed, k] = [[j for j in idx if ytr[j] == c] for c in range(3)]
    for s in range(seeds):
        for small, large in zip(shots, shots[1:]):
            assert all(a == b[:small] for a, b in zip(supports[s, small], supports[s, large]))
    assert len({str(supports[s, 3]) for s in range(seeds)}) > 1  # each seed its own draw
    spread = []
    for j, k in enumerate(shots):
        accs = [float((calls[s * len(shots) + j]["pred"] == yte).double().mean()) for s in range(seeds)]
        assert out[f"{k}shot"] == pytest.approx(np.mean(accs), abs=1e-12)
        assert out[f"{k}shot_std"] == pytest.approx(np.std(accs), abs=1e-12)
        spread.append(np.std(accs))
    assert spread[0] > 0 and spread[1] > 0  # the seeds disagree, so mean and std are informative


def test_fewshot_lambda_is_chosen_on_each_classes_held_out_half(monkeypatch):
    """The λ search against numpy: fit every λ on the first ceil(k/2) examples of each class,
    score on the rest, keep the best (the largest on ties), refit on the whole support; a
    1-shot support cannot be split and uses ``l2_reg``."""
    xtr, ytr = _noisy_classes(12, dim=10, seed=2, noise=2.5)
    xte, yte = _noisy_classes(10, dim=10, seed=3, noise=2.5)
    grid, l2_reg = (1e-3, 3.0, 1e3, 1e5), 7.0
    calls = _recording(monkeypatch)
    FewShotEvaluator(shots=(1, 4, 5), num_seeds=3, l2_reg=l2_reg, l2_grid=grid).evaluate(xtr, ytr, xte, yte)
    finals = [c for c in calls if len(c["qx"]) == len(xte)]  # the refits, scored on the test set
    assert len(finals) == 9
    chosen = []
    for final in finals:
        sx, sy = final["sx"].double().numpy(), final["sy"].numpy()
        k = len(sy) // 3
        if k == 1:
            assert final["l2"] == l2_reg
            continue
        per_class = [np.flatnonzero(sy == c) for c in range(3)]
        fit = np.concatenate([i[: (k + 1) // 2] for i in per_class])
        val = np.concatenate([i[(k + 1) // 2 :] for i in per_class])
        accs = {l2: (_lsr_predict(sx[fit], sy[fit], sx[val], 3, l2) == sy[val]).mean() for l2 in grid}
        best = max(grid, key=lambda l2: (accs[l2], l2))
        assert final["l2"] == best
        chosen.append(best)
    assert len(set(chosen)) > 1  # the data make the choice matter


# ----------------------------------------------------------------------------- features
def test_features_under_bf16_autocast_come_back_float32_close_to_float32_features():
    """A ResNet's pooled feature map computed under bf16 autocast comes back float32 (the
    documented contract), within bf16 precision of the float32 features."""
    torch.manual_seed(0)
    net = create_backbone("resnet18", in_chans=1, small_input=True, img_size=16)
    data = TensorDataset(torch.randn(4, 1, 16, 16), torch.arange(4))
    full, _ = extract_features(net, data)
    half, _ = extract_features(net, data, autocast_dtype=torch.bfloat16)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, rtol=0.05, atol=0.05)


# ----------------------------------------------------------------------------- EMA
def test_ema_updates_every_pair_with_dinos_cosine_momentum():
    """target <- m·target + (1 - m)·online, parameter by parameter, with the methods' momentum
    m_t = 1 - (1 - m0)(cos(πt/T) + 1)/2 (DINO utils.cosine_scheduler, MoCo v3
    adjust_moco_momentum); past the end the momentum stays at its end value."""
    from helpers import TINY_BACKBONE

    torch.manual_seed(0)
    onlines = [nn.Linear(3, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))]
    targets = [copy.deepcopy(m).requires_grad_(False) for m in onlines]
    method = Supervised(**TINY_BACKBONE, num_classes=4)  # (the cosine is every method's)
    total = method.total_steps = 4
    for step in (0, 1, 3, 5, 9):  # (past the end, well past it: lightly's cosine would turn back and warn)
        with torch.no_grad():
            for online in onlines:
                for p in online.parameters():
                    p.add_(torch.randn_like(p))  # the optimiser step before the update
        m = 1.0 - (1.0 - 0.9) * (math.cos(math.pi * min(step, total) / total) + 1) / 2
        want = [[m * t + (1 - m) * o for o, t in zip(online.parameters(), target.parameters())]
                for online, target in zip(onlines, targets)]
        method._trainer = SimpleNamespace(global_step=step)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert method.cosine(0.9, 1.0) == pytest.approx(m)
        for online, target in zip(onlines, targets):
            ema_update(online, target, method.cosine(0.9, 1.0))
        for target, w in zip(targets, want):
            for p, q in zip(target.parameters(), w):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # pieces of other shapes (FSDP sharding the two modules differently) are refused, not zipped
    with pytest.raises(RuntimeError, match=r"EMA: weight is \(2, 3\) here in the online module but \(3, 2\) in its target"):
        ema_update(nn.Linear(3, 2), nn.Linear(2, 3).requires_grad_(False), 0.9)


# ----------------------------------------------------------------------------- synchronised BatchNorm
class _ThreadWorld:
    """Ranks as threads of this process; ``all_reduce`` sums every rank's tensor (rank order)."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier, self.slots, self.local = size, threading.Barrier(size, timeout=60), {}, threading.local()

    def all_reduce(self, tensor: torch.Tensor, group=None, **kwargs) -> None:
        self.slots[self.local.rank] = tensor.clone()
        self.barrier.wait()
        total = sum(self.slots[r] for r in range(self.size))
        self.barrier.wait()
        tensor.copy_(total)

    def run(self, fn, *args_per_rank):
        results, errors = [None] * self.size, []

        def target(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(rank, *(a[rank] for a in args_per_rank))
            except BaseException as e:
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def _train_step(rank, bn, x, w):
    """One rank's forward and backward of sum(bn(x) * w)."""
    x = x.clone().requires_grad_(True)
    y = bn(x)
    (y * w).sum().backward()
    return y.detach(), x.grad, bn.weight.grad.clone()


@pytest.mark.parametrize("shape, momentum, scale", [((8, 3, 2, 2), None, 3.0), ((8, 3), 0.1, 3.0), ((8, 3), 0.1, 1e-3)])
def test_allreduce_batchnorm_over_a_split_batch_is_torchs_batchnorm_over_the_whole(monkeypatch, shape, momentum, scale):
    """Two ranks (threads; all_reduce = sum) holding 3 and 5 samples against one torch
    BatchNorm over all 8: outputs, input and weight gradients, running statistics (momentum
    0.1 and None, the cumulative average) after two steps, and eval mode on running statistics;
    inputs of a variance near eps too (1e-6: eps counts)."""
    world = _ThreadWorld(2)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(distributed.dist, "all_reduce", world.all_reduce)
    torch.manual_seed(0)
    ref = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(3, momentum=momentum)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ranks = [AllReduceBatchNorm(3, momentum=momentum) for _ in range(2)]
    for bn in ranks:
        bn.load_state_dict(ref.state_dict())
    parts = (slice(0, 3), slice(3, 8))
    for _ in range(2):
        x, w = torch.randn(shape) * scale + (1 if scale > 1 else 0), torch.randn(shape)  # (small: no offset for float32 to cancel)
        x_ref = x.clone().requires_grad_(True)
        y_ref = ref(x_ref)
        (y_ref * w).sum().backward()

        out = world.run(_train_step, ranks, [x[p] for p in parts], [w[p] for p in parts])
        torch.testing.assert_close(torch.cat([o[0] for o in out]), y_ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([o[1] for o in out]), x_ref.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out[0][2] + out[1][2], ref.weight.grad, rtol=1e-4, atol=1e-5)
        ref.weight.grad = None
        for bn in ranks:
            bn.weight.grad = None
    for bn in ranks:
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(bn.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    ref.eval()
    x = torch.randn(shape)
    evals = world.run(lambda rank, bn, part: bn.eval()(x[part]), ranks, parts)
    torch.testing.assert_close(torch.cat(evals), ref(x), rtol=1e-5, atol=1e-6)


def test_converting_to_allreduce_batchnorm_keeps_what_torchs_converter_keeps():
    """Against ``nn.SyncBatchNorm.convert_sync_batchnorm``: every BatchNorm replaced, with its
    eps, momentum, affine flag, training flag, and the very parameter and buffer tensors
    (trained weights and running statistics included) of the layer it replaces."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, eps=1e-3, momentum=0.3),
                          nn.Sequential(nn.Unflatten(1, (3, 1, 1)), nn.BatchNorm2d(3, affine=False, momentum=None)))
    for _ in range(3):
        model(torch.randn(6, 4))
    with torch.no_grad():
        model[1].weight.normal_()
        model[1].bias.normal_()
    model[2][1].eval()
    theirs = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    before = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    ours = convert_sync_batchnorm(model, "cpu")
    assert [type(m).__name__ for m in ours.modules() if "BatchNorm" in type(m).__name__] == ["AllReduceBatchNorm"] * 2
    for (name, mine), (_, ref) in zip(ours.named_modules(), theirs.named_modules()):
        if isinstance(ref, nn.SyncBatchNorm):
            for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats", "training"):
                assert getattr(mine, attr) == getattr(ref, attr), (name, attr)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    after = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    # layers already synchronised stay as they are (torch's with its process group)
    for synced in (AllReduceBatchNorm(3), nn.SyncBatchNorm(3, process_group=object())):
        assert convert_sync_batchnorm(synced, "cpu") is synced
    with pytest.raises(AssertionError, match="expected at least 2-D input"):
        AllReduceBatchNorm(3)(torch.randn(3))


# ----------------------------------------------------------------------------- step checkpoints
class _Regress(L.LightningModule):
    def __init__(self, stop_after: int | None = None) -> None:
        super().__init__()
        self.lin, self.stop_after = nn.Linear(2, 1), stop_after

    def training_step(self, batch, batch_idx):
        if self.stop_after is not None and self.global_step + 1 >= self.stop_after:
            self.trainer.should_stop = True  # another part of the run asks to stop after this batch
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("limits, stop_after, end_step", [({"max_steps": 3, "max_epochs": 5}, None, 3),
                                                           ({"max_epochs": 2}, None, 8),
                                                           ({"max_epochs": 5}, 2, 2)])
def test_the_final_last_ckpt_is_the_batch_end_checkpoint_lightning_writes(tmp_path, limits, stop_after, end_step):
    """The run's final ``last.ckpt`` (max_steps, the last epoch's last batch, a requested stop)
    records the loops as Lightning's own ``ModelCheckpoint`` does when it saves at that batch's
    end, so that a run continued from it neither repeats nor skips a batch."""
    ours = StepCheckpoint(dirpath=str(tmp_path / "ours"), every_n_train_steps=100)
    ref = ModelCheckpoint(dirpath=str(tmp_path / "ref"), filename="ref", every_n_train_steps=end_step, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ours, ref], **limits)
    trainer.fit(_Regress(stop_after), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2))
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["last.ckpt"]
    mine, theirs = (torch.load(p, weights_only=False) for p in (tmp_path / "ours" / "last.ckpt", tmp_path / "ref" / "ref.ckpt"))
    assert mine["global_step"] == theirs["global_step"] == end_step
    assert mine["loops"] == theirs["loops"]


def test_step_checkpoints_keep_the_last_three_by_default(tmp_path):
    """StepCheckpoint's docstring: the newest ``keep_last`` (3) step checkpoints and ``last.ckpt``."""
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, max_steps=5,
                        callbacks=[StepCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1)])
    trainer.fit(_Regress(None), DataLoader(TensorDataset(torch.randn(10, 2)), batch_size=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step00000003.ckpt", "step00000004.ckpt", "step00000005.ckpt"]


def test_a_stray_file_that_is_no_checkpoint_is_never_the_newest(tmp_path):
    """A newer ``*.ckpt`` that is no Lightning checkpoint (not torch's format, or a bare weights
    file without a ``global_step``) ranks below every real checkpoint, even one of step 0."""
    torch.save({"global_step": 0}, tmp_path / "last.ckpt")
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    torch.save({"state_dict": {}}, tmp_path / "weights.ckpt")
    for age, name in enumerate(("last.ckpt", "notes.ckpt", "weights.ckpt"), start=1):
        os.utime(tmp_path / name, ns=(age * 10**18, age * 10**18))
    assert newest_checkpoint(tmp_path) == tmp_path / "last.ckpt"

# ----------------------------------------------------------------------------- heads
def test_dino_heads_last_layer_starts_as_torchs_linear_and_a_one_layer_mlp_has_a_bias():
    """DINO vision_transformer.py: ``weight_norm(nn.Linear(bottleneck, K, bias=False))``, so v is
    nn.Linear's default init (same seed, same values) and g = 1; with nlayers = 1 the MLP is a
    plain ``nn.Linear(in_dim, bottleneck_dim)`` with its bias."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 24, bias=False)
    torch.manual_seed(0)
    layer = WeightNormLinear(8, 24)
    assert torch.equal(layer.weight_v, ref.weight) and torch.equal(layer.weight_g, torch.ones(24, 1))
    head = DINOHead(12, out_dim=24, nlayers=1, bottleneck_dim=8)
    assert sorted(head.state_dict()) == ["last_layer.weight_g", "last_layer.weight_v", "mlp.bias", "mlp.weight"]


def test_linear_probe_head_is_initialised_as_maes():
    """MAE main_linprobe.py: the head's weight trunc-normal with std 0.01, its bias zero."""
    torch.manual_seed(0)
    head = LinearProbeHead(256, 100)
    assert float(head.linear.weight.detach().std()) == pytest.approx(0.01, rel=0.05)
    assert torch.equal(head.linear.bias, torch.zeros(100))
