"""The command-line front ends and the data plumbing under them against independent references:
torch's ``DistributedSampler`` shard layout (padding by wrapping, positions r, r + R, ...) and
``SequentialSampler`` order written out here, numpy's ``SeedSequence``, Python's ``random`` stream,
the papers' defaults (DINO's kNN, the ViT paper's few-shot, MAE's fine-tuning and linear probe,
the 0.08-1 crop of DeiT/MAE/MoCo v3/DINO), and the expectations the modules' docstrings state
(what each option reaches, where a record goes, which errors a bad input gets)."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset, SequentialSampler

from ssl_vit.cli import main as cli_main
from ssl_vit.data.sampler import ResumableLoader, ResumableSampler, SeededIndex

TINY = {"img_size": 16, "patch_size": 4, "in_chans": 3, "embed_dim": 32, "depth": 2, "num_heads": 2}
SYNTH = ["--data", "synthetic", "--data-arg", "num_samples=64", "--data-arg", "num_test_samples=32", "--data-arg", "num_classes=4",
         "--num-workers", "0"]


class _Ids(Dataset):
    """Items: the dataset index the sampler drew."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, item: SeededIndex | int) -> int:
        return item.index if isinstance(item, SeededIndex) else item


def _reference_shards(n: int, replicas: int, seed: int, epoch: int) -> list[list[int]]:
    # torch.utils.data.DistributedSampler(shuffle=True, drop_last=False): randperm(n) from a
    # generator seeded seed + epoch, padded to a multiple of the replicas by wrapping around
    # its start, process r taking positions r, r + R, r + 2R ...
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    total = math.ceil(n / replicas) * replicas
    padded = (perm * math.ceil(total / n))[:total]
    return [padded[r::replicas] for r in range(replicas)]


# -- sampler.py -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, replicas", [(10, 3), (7, 4), (12, 3)])
def test_the_shards_of_an_epoch_cover_every_image_with_only_the_padding_repeated(n, replicas):
    # Padded, not dropped (as Lightning's own distributed sampler): every image of the epoch is
    # seen by some process, each process gets ceil(n / R) of them.
    shards = [[i.index for i in ResumableSampler(_Ids(n), num_replicas=replicas, rank=r, seed=4)] for r in range(replicas)]
    assert shards == _reference_shards(n, replicas, seed=4, epoch=0)
    seen = [i for s in shards for i in s]
    assert sorted(set(seen)) == list(range(n)) and len(seen) == math.ceil(n / replicas) * replicas


def test_a_sequential_sampler_given_by_lightning_keeps_the_dataset_order():
    # overfit_batches: Lightning rebuilds the loader with torch's SequentialSampler to stop
    # shuffling; the loader stays resumable and reads the dataset in SequentialSampler's order.
    dataset = _Ids(9)
    loader = ResumableLoader(dataset, sampler=SequentialSampler(dataset), batch_size=4)
    assert isinstance(loader.sampler, ResumableSampler)
    assert [i for batch in loader for i in batch.tolist()] == list(SequentialSampler(dataset))


def test_the_state_of_a_new_epoch_is_its_start_even_after_a_resumed_pass():
    # Epoch 0 resumed after 4 images and read to its end; Lightning then sets epoch 1: a
    # checkpoint written before epoch 1's first batch says "epoch 1, nothing seen".
    n = 12
    loader = ResumableLoader(_Ids(n), sampler=ResumableSampler(_Ids(n), num_replicas=1, rank=0, seed=2), batch_size=4)
    loader.load_state_dict({"seed": 2, "epoch": 0, "batches": 1, "samples": 4})
    assert [i for b in loader for i in b.tolist()] == _reference_shards(n, 1, 2, 0)[0][4:]
    assert loader.state_dict() == {"seed": 2, "epoch": 0, "batches": 3, "samples": 12}
    loader.sampler.set_epoch(1)
    assert loader.state_dict() == {"seed": 2, "epoch": 1, "batches": 0, "samples": 0}
    assert [i for b in loader for i in b.tolist()] == _reference_shards(n, 1, 2, 1)[0]


def test_the_images_seen_never_exceed_the_epoch_and_batches_count_a_partial_start_as_one():
    # 10 images in batches of 4: 4 + 4 + 2; after the last batch all 10 are seen, not 12.
    n = 10
    loader = ResumableLoader(_Ids(n), sampler=ResumableSampler(_Ids(n), num_replicas=1, rank=0, seed=0), batch_size=4)
    list(loader)
    assert loader.state_dict() == {"seed": 0, "epoch": 0, "batches": 3, "samples": 10}
    # Resumed after 6 images (another batch size before): the 6 are one and a half batches of 4,
    # the next batch the third handed out (ceil(6 / 4) + 1), as a resume from "batches" would skip.
    resumed = ResumableLoader(_Ids(n), sampler=ResumableSampler(_Ids(n), num_replicas=1, rank=0, seed=0), batch_size=4)
    resumed.load_state_dict({"seed": 0, "epoch": 0, "batches": 3, "samples": 6})
    assert resumed.state_dict() == {"seed": 0, "epoch": 0, "batches": 2, "samples": 6}  # before its first batch
    it = iter(resumed)
    assert next(it).tolist() == _reference_shards(n, 1, 0, 0)[0][6:10]
    assert resumed.state_dict() == {"seed": 0, "epoch": 0, "batches": 3, "samples": 10}


def test_a_state_from_before_the_sample_count_skips_its_batches_of_images():
    # An older checkpoint says only "batches": that many batches of this loader's size are skipped.
    n = 20
    loader = ResumableLoader(_Ids(n), sampler=ResumableSampler(_Ids(n), num_replicas=1, rank=0, seed=1), batch_size=4)
    loader.load_state_dict({"seed": 1, "epoch": 3, "batches": 2})
    assert [i for b in loader for i in b.tolist()] == _reference_shards(n, 1, 1, 3)[0][8:]


@pytest.mark.parametrize("drop_last, seen, epoch_after", [(True, 8, 1), (True, 4, 0), (False, 8, 0), (False, 10, 1)])
def test_a_state_saved_after_the_epochs_last_batch_starts_the_next_epoch(drop_last, seen, epoch_after):
    # 10 images in batches of 4: with drop_last the epoch's last batch ends at image 8 (2 left
    # over make no batch), without it at image 10. Saved there, the resumed run starts the next
    # epoch afresh; saved before, it continues the same epoch after the images seen.
    n = 10
    loader = ResumableLoader(_Ids(n), sampler=ResumableSampler(_Ids(n), num_replicas=1, rank=0, seed=0), batch_size=4, drop_last=drop_last)
    loader.load_state_dict({"seed": 0, "epoch": 0, "batches": math.ceil(seen / 4), "samples": seen})
    order = [i for b in loader for i in b.tolist()]
    want = _reference_shards(n, 1, 0, epoch_after)[0][0 if epoch_after else seen:]
    assert order == want[: len(want) // 4 * 4 if drop_last else None]
    assert loader.sampler.epoch == epoch_after


# -- runtime.py ---------------------------------------------------------------------------------


def test_world_info_is_rank_then_world_size(monkeypatch):
    import torch.distributed as dist

    from ssl_vit.runtime import world_info

    assert world_info() == (0, 1)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    assert world_info() == (3, 8)


def test_a_gpu_index_the_machine_lacks_is_refused(monkeypatch):
    # One GPU: cuda:0 is it, cuda:1 is none.
    from ssl_vit.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == "cuda:0" and resolve_device(None) == "cuda"
    with pytest.raises(ValueError, match=r"^--device cuda:1: this machine has 1 CUDA GPU\(s\), cuda:0 to cuda:0$"):
        resolve_device("cuda:1")


def test_each_process_draws_its_own_step_seed_from_numpys_seed_sequence():
    # runtime.seed_training_step: torch seeded from (seed, epoch, batch, rank), the same position
    # the same draw, another process another one.
    from ssl_vit.runtime import seed_training_step

    def draw(*key: int) -> tuple[int, torch.Tensor]:
        seed_training_step(*key)
        return torch.initial_seed(), torch.rand(4)

    ref = int(np.random.SeedSequence([7, 2, 5, 0]).generate_state(1, np.uint64)[0])
    first, again, other_rank = draw(7, 2, 5, 0), draw(7, 2, 5, 0), draw(7, 2, 5, 1)
    assert first[0] == ref and torch.equal(first[1], again[1])
    assert other_rank[0] == int(np.random.SeedSequence([7, 2, 5, 1]).generate_state(1, np.uint64)[0])
    assert not torch.equal(first[1], other_rank[1])


def test_the_runs_seed_is_the_one_lightnings_seed_everything_set(monkeypatch):
    import lightning as L

    from ssl_vit.runtime import global_seed

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert global_seed(5) == 5  # nothing seeded: the default
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # (restored after the test)
    L.seed_everything(1234, verbose=False)
    assert global_seed(5) == 1234


# -- datasets.py ------------------------------------------------------------------------------------


def test_in_memory_images_take_a_trailing_grey_channel_and_default_to_unlabelled():
    from ssl_vit.data import InMemoryImages

    images = torch.arange(2 * 4 * 4, dtype=torch.uint8).view(2, 4, 4, 1)
    ds = InMemoryImages(images)
    img, label = ds[1]
    assert img.mode == "L" and np.array_equal(np.asarray(img), images[1, :, :, 0].numpy()) and label == -1


def test_image_files_default_to_unlabelled(tmp_path):
    from ssl_vit.data import ImageFiles

    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    assert ImageFiles([str(tmp_path / "a.png")])[0][1] == -1


def test_an_evaluation_twin_shares_the_marks_and_its_subsets_keep_its_stand_ins(tmp_path):
    # for_evaluation: "these files (sharing the marks of unreadable ones) with replace_unreadable=False".
    from ssl_vit.data import ImageFiles

    Image.new("RGB", (4, 4)).save(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    paths = [str(tmp_path / "good.png"), str(tmp_path / "bad.png")]
    train = ImageFiles(paths, [0, 1])
    test = train.for_evaluation()
    img, label = test[1]
    assert (img.size, label) == ((1, 1), -1)
    assert train.skipped_paths == [paths[1]]  # found by the twin, known to both
    sub = test.subset(torch.tensor([1]))
    assert sub[0][1] == -1  # a subset of the evaluation files still stands in, never replaces


def test_a_seeded_item_leaves_the_callers_random_stream_as_it_was():
    # TransformedDataset seeds Python's `random` for the item and restores the caller's state.
    from ssl_vit.data.datasets import TransformedDataset

    def transform(img):
        return torch.full((1, 2, 2), random.random(), dtype=torch.float64)

    ds = TransformedDataset([(Image.new("L", (2, 2)), 0)], transform, mean=(0.0,), std=(1.0,), in_chans=1, multi_view=False)
    ds.mean, ds.inv_std = ds.mean.double(), ds.inv_std.double()  # (the draw compared exactly)
    random.seed(123)
    want = [random.random() for _ in range(3)]
    random.seed(123)
    x, _ = ds[SeededIndex(0, 99)]
    assert [random.random() for _ in range(3)] == want
    random.seed(99)
    assert float(x[0, 0, 0]) == random.random()  # the item's own draw: from its own seed


# -- cli/options.py -----------------------------------------------------------------------------------


def test_dataset_names_map_to_their_datamodules_and_back():
    import ssl_vit.data as data
    from ssl_vit.cli.options import DATASETS, datamodule_class
    from ssl_vit.eval.results import dataset_name

    for name, cls in (("fashion_mnist", data.FashionMNISTDataModule), ("cifar10", data.CIFAR10DataModule), ("cifar100", data.CIFAR100DataModule),
                      ("stl10", data.STL10DataModule), ("imagefolder", data.ImageFolderDataModule), ("synthetic", data.SyntheticDataModule)):
        assert datamodule_class(name) is cls and dataset_name(cls.__name__) == name
    assert set(DATASETS) == {"fashion_mnist", "cifar10", "cifar100", "stl10", "imagefolder", "synthetic"}
    assert dataset_name("MyOwnDataModule") == "MyOwnDataModule"
    with pytest.raises(ValueError, match="--data collections.OrderedDict: not a datamodule class with eval_datasets()"):
        datamodule_class("collections.OrderedDict")


def test_a_data_argument_splits_at_its_first_equals_sign_and_nulls_an_optional():
    from ssl_vit.cli.options import key_value, parse_data_args

    assert key_value(" root=/data/a=b") == ("root", "/data/a=b")
    for text in ("null", "~", "", " "):
        assert parse_data_args("synthetic", {"subset": text}) == {"subset": None}


def test_the_arguments_of_a_datamodule_stop_at_an_init_that_does_not_forward_them():
    # A subclass whose __init__ takes no **kwargs accepts only its own arguments (what a misspelt
    # recipe key is compared with).
    from ssl_vit.cli.recipe_checks import class_arguments
    from ssl_vit.data import SyntheticDataModule

    class Fixed(SyntheticDataModule):
        def __init__(self, n: int = 3) -> None:
            super().__init__(num_samples=n)

    class Forwarding(SyntheticDataModule):
        def __init__(self, n: int = 3, **kwargs) -> None:
            super().__init__(num_samples=n, **kwargs)

    assert class_arguments(Fixed) == {"n"}
    assert {"n", "batch_size", "img_size"} <= class_arguments(Forwarding)  # its own and those it passes on


def test_labelled_classes_leave_the_unlabelled_out():
    from ssl_vit.eval.evaluate import labelled_classes

    assert labelled_classes(SimpleNamespace(source=SimpleNamespace(labels=[-1, 0, 1, 1, -1]))) == 2
    assert labelled_classes(SimpleNamespace(source=SimpleNamespace(labels=[-1, 2, 2]))) == 1


# -- cli/eval.py: what each option reaches --------------------------------------------------------

TINY_ARGS = ["--backbone", "random:vit", "--backbone-kwargs", json.dumps(TINY)]


def _spy_feature_protocols(monkeypatch) -> dict:
    """The feature protocols' evaluations replaced by recorders of their settings and of the
    features they are given; the extraction recorded, then run (without worker processes)."""
    import dataclasses

    import ssl_vit.eval.evaluate as evaluate

    calls: dict = {}
    for name in ("linear", "knn", "fewshot"):
        def spy(self, train_f, train_l, test_f, test_l, num_classes, name=name):
            calls[name], calls[f"{name}:data"] = dataclasses.asdict(self), (len(train_l), test_l.tolist(), num_classes)
            return {"top1": 0.5, "1shot": 0.5}

        monkeypatch.setattr(evaluate.SETTINGS[name], "evaluate", spy)
    extract = evaluate.extract_features

    def extraction(backbone, dataset, **kwargs):
        calls.setdefault("extract", []).append(dict(kwargs))
        return extract(backbone, dataset, **{**kwargs, "num_workers": 0})

    monkeypatch.setattr(evaluate, "extract_features", extraction)
    return calls


def test_every_frozen_feature_option_reaches_its_protocol_and_the_extraction(tmp_path, monkeypatch):
    from ssl_vit.data import SyntheticDataModule

    calls = _spy_feature_protocols(monkeypatch)
    args = ["eval", "frozen", *TINY_ARGS, *SYNTH[:-2], "--num-workers", "3", "--batch-size", "8", "--probe-batch-size", "32", "--epochs", "7",
            "--warmup-epochs", "3", "--lr", "0.5", "--optimizer", "lars", "--k", "3", "--temperature", "0.2", "--shots", "1", "2", "--seeds", "4",
            "--l2", "8", "--seed", "9", "--features", "avg", "--train-subset", "48", "--test-subset", "16", "--out", str(tmp_path)]
    assert cli_main(args) == 0

    def picked(name, *keys):
        return {k: calls[name][k] for k in keys}

    assert picked("linear", "epochs", "base_lr", "optimizer", "batch_size", "warmup_epochs", "seed") == {
        "epochs": 7, "base_lr": 0.5, "optimizer": "lars", "batch_size": 32, "warmup_epochs": 3, "seed": 9}
    assert picked("knn", "k", "temperature", "seed") == {"k": 3, "temperature": 0.2, "seed": 9}
    assert picked("fewshot", "shots", "num_seeds", "l2_reg", "seed") == {"shots": [1, 2], "num_seeds": 4, "l2_reg": 8.0, "seed": 9}
    assert [{k: e[k] for k in ("mode", "batch_size", "num_workers", "autocast_dtype")} for e in calls["extract"]] == [
        {"mode": "avg", "batch_size": 8, "num_workers": 3, "autocast_dtype": None}] * 2
    # --train-subset: 48 of the 64 training images; --test-subset: torch's randperm under --seed,
    # the first 16 in dataset order.
    test_labels = SyntheticDataModule(num_samples=64, num_test_samples=32, num_classes=4, img_size=16, num_workers=0).eval_datasets()[1].source.labels
    chosen = torch.randperm(32, generator=torch.Generator().manual_seed(9))[:16].sort().values
    assert calls["knn:data"] == (48, test_labels[chosen].tolist(), 4)
    results = {json.loads(p.read_text())["protocol"]: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert results["knn"]["protocol_args"] == {"k": 3, "temperature": 0.2, "select_fraction": 0.1, "seed": 9, "features": "avg", "precision": "32-true"}
    assert results["fewshot"]["data"]["train_size"] == 48 and results["fewshot"]["data"]["test_size"] == 16


def test_as_many_neighbours_as_training_images_is_allowed(tmp_path, monkeypatch):
    # "k neighbours, but the kNN bank holds fewer" is the error; k = N votes with every image.
    calls = _spy_feature_protocols(monkeypatch)
    assert cli_main(["eval", "knn", *TINY_ARGS, *SYNTH, "--k", "64", "--out", str(tmp_path)]) == 0
    assert calls["knn"]["k"] == 64


def _spy_image_run(monkeypatch, settings: type) -> dict:
    import dataclasses

    calls: dict = {}

    def run(self, backbone, train_ds, test_ds, num_classes, place, **kwargs):
        calls.update(dataclasses.asdict(self), **dataclasses.asdict(place), **kwargs, train_transform=train_ds.transform, num_classes=num_classes)
        calls["features"] = self.__dict__.get("features") or kwargs.get("features")  # (the settings' own wins)
        return {"top1": 0.5, "top5": 1.0}

    monkeypatch.setattr(settings, "run", run)
    return calls


def test_every_fine_tuning_option_reaches_the_fine_tuning_and_its_result(tmp_path, monkeypatch):
    from ssl_vit.data import SingleView
    from ssl_vit.eval.finetune import FineTuneSettings

    calls = _spy_image_run(monkeypatch, FineTuneSettings)
    (tmp_path / "ft" / "checkpoints").mkdir(parents=True)
    (tmp_path / "ft" / "checkpoints" / "last.ckpt").write_bytes(b"")  # (--resume continues a run that has a checkpoint)
    args = ["eval", "finetune", *TINY_ARGS, *SYNTH, "--epochs", "3", "--batch-size", "8", "--max-steps", "7", "--checkpoint-every", "11",
            "--lr", "0.002", "--layer-decay", "0.5", "--drop-path", "0.2", "--label-smoothing", "0.3", "--weight-decay", "0.01",
            "--warmup-epochs", "1", "--mixup", "0.4", "--cutmix", "0.6", "--rand-augment", "3", "7", "--random-erasing", "0.2",
            "--img-size", "24", "--crop-scale", "0.3", "0.9", "--seed", "5",
            "--run-dir", str(tmp_path / "ft"), "--resume", "--num-nodes", "2", "--out", str(tmp_path / "ft.json")]
    assert cli_main(args) == 0
    want = {"epochs": 3, "batch_size": 8, "max_steps": 7, "checkpoint_every": 11, "base_lr": 0.002, "layer_decay": 0.5, "drop_path_rate": 0.2,
            "label_smoothing": 0.3, "weight_decay": 0.01, "warmup_epochs": 1.0, "mixup_alpha": 0.4, "cutmix_alpha": 0.6, "random_erasing": 0.2, "img_size": 24,
            "seed": 5, "run_dir": tmp_path / "ft", "resume": True, "num_nodes": 2, "devices": 1, "accelerator": "cpu", "num_workers": 0}
    assert {k: calls[k] for k in want} == want
    assert isinstance(calls["train_transform"], SingleView) and calls["train_transform"].scale == (0.3, 0.9)
    assert calls["train_transform"].rand_augment == (3, 7)
    recorded = json.loads((tmp_path / "ft.json").read_text())["protocol_args"]
    assert recorded == {"epochs": 3, "batch_size": 8, "base_lr": 0.002, "layer_decay": 0.5, "drop_path_rate": 0.2, "label_smoothing": 0.3,
                        "weight_decay": 0.01, "warmup_epochs": 1.0, "mixup_alpha": 0.4, "cutmix_alpha": 0.6, "rand_augment": [3, 7], "random_erasing": 0.2,
                        "augment": True, "crop_scale": [0.3, 0.9], "betas": [0.9, 0.999], "max_steps": 7, "compile_backbone": False, "img_size": 24,
                        "seed": 5, "precision": "32-true", "devices": 1, "num_nodes": 2}
    # --no-augment: the evaluation transform (resize + centre crop), recorded without a crop.
    calls.clear()
    assert cli_main(["eval", "finetune", *TINY_ARGS, *SYNTH, "--no-augment", "--out", str(tmp_path / "plain.json")]) == 0
    assert not isinstance(calls["train_transform"], SingleView)
    assert json.loads((tmp_path / "plain.json").read_text())["protocol_args"]["crop_scale"] is None


def test_every_option_of_the_probe_on_images_reaches_it_and_its_result(tmp_path, monkeypatch):
    from ssl_vit.data import SingleView
    from ssl_vit.eval.linear_augmented import LinearAugSettings

    calls = _spy_image_run(monkeypatch, LinearAugSettings)
    args = ["eval", "linear", "--augment", *TINY_ARGS, *SYNTH, "--epochs", "3", "--probe-batch-size", "16", "--batch-size", "8", "--max-steps", "7",
            "--checkpoint-every", "11", "--lr", "0.3", "--optimizer", "lars", "--warmup-epochs", "2", "--features", "avg", "--seed", "4",
            "--run-dir", str(tmp_path / "lin"), "--out", str(tmp_path / "lin.json")]
    assert cli_main(args) == 0
    want = {"epochs": 3, "batch_size": 16, "max_steps": 7, "checkpoint_every": 11, "base_lr": 0.3, "optimizer": "lars", "warmup_epochs": 2,
            "features": "avg", "seed": 4, "run_dir": tmp_path / "lin", "resume": False, "num_nodes": 1, "devices": 1}
    assert {k: calls[k] for k in want} == want
    assert isinstance(calls["train_transform"], SingleView) and calls["train_transform"].scale == (0.5, 1.0)  # 16 px: the small-image crop
    recorded = json.loads((tmp_path / "lin.json").read_text())["protocol_args"]
    assert recorded == {"epochs": 3, "base_lr": 0.3, "optimizer": "lars", "batch_size": 16, "warmup_epochs": 2, "crop_scale": [0.5, 1.0],
                        "features": "avg", "precision": "32-true", "devices": 1, "num_nodes": 1, "seed": 4, "max_steps": 7}


def _parser_defaults(*argv: str) -> dict:
    from ssl_vit.cli.eval import build_parser

    return vars(build_parser().parse_args([*argv, "--backbone", "random:vit"]))


def test_the_eval_commands_defaults_are_the_papers_and_the_evaluators_own():
    import inspect

    from ssl_vit.eval.fewshot import FewShotEvaluator
    from ssl_vit.eval.finetune import FineTuneSettings
    from ssl_vit.eval.knn import KNNClassifier
    from ssl_vit.eval.linear import LinearProbe
    from ssl_vit.eval.linear_augmented import LinearAugSettings

    def defaults(fn) -> dict:
        return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}

    # DINO §4 weighted kNN: k 20, T 0.07.
    knn = _parser_defaults("knn")
    assert (knn["k"], knn["temperature"]) == ([20], 0.07)  # one k; several sweep it
    assert (knn["data"], knn["out"]) == ("fashion_mnist", "results")  # the offline dataset; compare's folder
    assert (defaults(KNNClassifier)["k"], defaults(KNNClassifier)["temperature"]) == (20, 0.07)
    # ViT paper §4.1: 1/5/10/25-shot, 5 draws; big_vision's λ = 2^10.
    few = _parser_defaults("fewshot")
    assert (few["shots"], few["seeds"], few["l2"]) == ([1, 5, 10, 25], 5, 2.0**10)
    assert (tuple(few["shots"]), few["seeds"], few["l2"]) == tuple(defaults(FewShotEvaluator)[k] for k in ("shots", "num_seeds", "l2_reg"))
    # The linear probe: 100 epochs (DINO), 10 warm-up epochs (MAE), SGD, batch 256, LR by the optimiser.
    lin = _parser_defaults("linear")
    assert {k: lin[k] for k in ("epochs", "warmup_epochs", "optimizer", "probe_batch_size", "lr")} == {
        "epochs": 100, "warmup_epochs": 10, "optimizer": "sgd", "probe_batch_size": 256, "lr": None}
    probe = defaults(LinearProbe)
    assert (probe["epochs"], probe["warmup_epochs"], probe["optimizer"], probe["batch_size"]) == (100, 10, "sgd", 256)
    aug = defaults(LinearAugSettings)
    assert (aug["epochs"], aug["warmup_epochs"], aug["batch_size"], aug["checkpoint_every"]) == (100, 10.0, 256, lin["checkpoint_every"]) == (100, 10, 256, 500)
    # MAE FINETUNE.md (ViT-B): 5e-4, layer decay 0.65, drop path 0.1, smoothing 0.1, wd 0.05, 5 warm-up
    # epochs, MixUp / CutMix off unless asked; 10 epochs as a first look.
    ft = _parser_defaults("finetune")
    want = {"lr": 5e-4, "layer_decay": 0.65, "drop_path": 0.1, "label_smoothing": 0.1, "weight_decay": 0.05, "warmup_epochs": 5.0,
            "mixup": 0.0, "cutmix": 0.0, "epochs": 10, "batch_size": 256, "checkpoint_every": 500, "max_steps": -1, "crop_scale": None}
    assert {k: ft[k] for k in want} == want
    settings = defaults(FineTuneSettings)
    names = {"lr": "base_lr", "drop_path": "drop_path_rate", "mixup": "mixup_alpha", "cutmix": "cutmix_alpha"}
    assert {k: settings[names.get(k, k)] for k in want} == want


@pytest.mark.parametrize("size, scale", [(224, (0.08, 1.0)), (96, (0.08, 1.0)), (95, (0.5, 1.0)), (32, (0.5, 1.0))])
def test_the_default_training_crop_is_the_papers_from_96_px_on(size, scale):
    # "(0.08, 1) (DeiT/MAE/MoCo v3/DINO) for images of 96 px or more, (0.5, 1) for smaller ones".
    from ssl_vit.eval.finetune import FineTuneSettings, default_crop_scale
    from ssl_vit.eval.linear_augmented import LinearAugSettings

    assert default_crop_scale(size) == scale == FineTuneSettings().train_views(size).scale == LinearAugSettings().train_views(size).scale


def _synthetic(**kwargs):
    from ssl_vit.data import SyntheticDataModule

    return SyntheticDataModule(**{"num_samples": 16, "num_test_samples": 8, "num_classes": 4, "img_size": 16, "num_workers": 0, **kwargs})


def test_a_probes_own_representation_wins_over_the_evaluations(tmp_path, monkeypatch):
    from ssl_vit import create_backbone
    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.linear_augmented import LinearAugSettings
    from ssl_vit.eval.train_run import ImageRun

    calls = _spy_image_run(monkeypatch, LinearAugSettings)
    backbone, on_one_gpu = create_backbone("vit", **TINY), ImageRun(devices=[1])
    ((result, path),) = Evaluation(["linear_aug"], features="cls", linear_aug=LinearAugSettings(features="avg")).run(backbone, {}, _synthetic(), tmp_path,
                                                                                                          image_run=on_one_gpu)
    assert calls["features"] == "avg" and result.protocol_args["features"] == "avg" and path.name.endswith("linear_aug-avg.json")
    assert result.protocol_args["devices"] == 1  # [1]: one GPU, the second
    ((result, _),) = Evaluation(["linear_aug"], features="last4").run(backbone, {"pretrain": {"steps": 3}}, _synthetic(), tmp_path, image_run=on_one_gpu)
    assert calls["features"] == "last4" == result.protocol_args["features"]
    assert calls["origin"] == {"pretrain_steps": 3}  # (as fine-tuning: not resumed on another step's weights)


def test_a_fine_tuning_on_a_chosen_gpu_records_one_device(tmp_path, monkeypatch):
    from ssl_vit import create_backbone
    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.finetune import FineTuneSettings
    from ssl_vit.eval.train_run import ImageRun

    calls = _spy_image_run(monkeypatch, FineTuneSettings)
    ((result, _),) = Evaluation(["finetune"]).run(create_backbone("vit", **TINY), {"pretrain": {"steps": 7}}, _synthetic(), tmp_path,
                                                  image_run=ImageRun(accelerator="gpu", devices=[1]))
    assert result.protocol_args["devices"] == 1 and result.protocol_args["img_size"] is None
    assert result.protocol_args["max_steps"] is None  # -1, no cap, is recorded as none
    # The run keeps the backbone's pretraining step: not resumed on the weights of another one.
    assert calls["origin"] == {"pretrain_steps": 7}


# -- eval/evaluate.py -------------------------------------------------------------------------------


def test_a_feature_row_with_one_nan_is_refused_and_label_zero_is_kept():
    from ssl_vit.eval.evaluate import labelled_features

    feats = torch.zeros(4, 3)
    feats[2, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite .* for 1 of 4 test images"):
        labelled_features(feats, torch.zeros(4), "test")
    f, labels = labelled_features(torch.arange(4.0).view(4, 1), torch.tensor([0, -1, 1, 0]), "train")
    assert labels.tolist() == [0, 1, 0] and f.flatten().tolist() == [0.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="no train image could be read or has a label"):
        labelled_features(torch.zeros(2, 1), torch.tensor([-1, -1]), "train")


class _Labelled(Dataset):
    def __init__(self, labels: list[int]) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return torch.full((3, 16, 16), float(i) / len(self)), self.labels[i]


def test_the_result_counts_the_images_evaluated_and_goes_where_its_pretraining_says(tmp_path):
    # The data sizes are of the labelled images the protocol saw; a result of the same name from
    # another pretraining (or a file that is no result) is kept, the next free _2, _3 ... taken.
    from ssl_vit import create_backbone
    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.knn import KNNClassifier
    from ssl_vit.eval.results import names_a_file, result_path

    backbone, dm = create_backbone("vit", **TINY), _synthetic(num_classes=2)
    dm.eval_datasets = lambda train_views=None: (_Labelled([0, 1, -1, 0, 1, 1]), _Labelled([0, -1, 1]))

    def evaluate(k, source):
        return Evaluation(["knn"], knn=KNNClassifier(k=k)).run(backbone, {"method": "m", "source": source}, dm, tmp_path)[0][0]

    first = evaluate(2, "run/a.ckpt")
    assert (first.data["train_size"], first.data["test_size"]) == (5, 2)
    name = "m_vit-D32-L2-H2-4_synthetic_knn.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    evaluate(3, "run/a.ckpt")  # the same pretraining: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    evaluate(2, "run/b.ckpt")  # another: added
    (tmp_path / name.replace(".json", "_3.json")).write_text("not a record")
    other = evaluate(2, "run/c.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name, name.replace(".json", "_2.json"), name.replace(".json", "_3.json"),
                                                          name.replace(".json", "_4.json")]
    assert result_path(tmp_path, other) == tmp_path / name.replace(".json", "_4.json")
    assert names_a_file(tmp_path / "R.JSON") and result_path(tmp_path / "R.JSON", other) == tmp_path / "R.JSON"


def test_an_image_folders_result_name_has_no_colon(tmp_path):
    from ssl_vit.eval.results import EvalResult, result_path

    result = EvalResult(method="m", backbone={"name": "vit"}, data={"name": "imagefolder", "train_dir": "/d/flowers/train"}, protocol="knn",
                        metrics={"top1": 0.5}, protocol_args={}, pretrain={}, source="random")
    assert ":" not in result_path(tmp_path, result).name and "imagefolder-flowers-train" in result_path(tmp_path, result).name


# -- cli/fit.py, cli/recipe_checks.py ----------------------------------------------------------------


def _trainer(**kwargs):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **{"max_steps": 10, **kwargs})


def _vit_model(**kwargs):
    from ssl_vit import create_backbone

    return SimpleNamespace(backbone=create_backbone("vit", **{**TINY, **kwargs}), check_views=lambda num_views: None)


def test_an_image_size_the_patch_does_not_divide_in_either_side_is_refused():
    from ssl_vit.cli.recipe_checks import validate_run
    from ssl_vit.errors import ConfigError

    for img in ((16, 18), (18, 16)):
        with pytest.raises(ConfigError, match=rf"^data.img_size \({img[0]}, {img[1]}\) is not divisible by the backbone's patch size 4; set model backbone_kwargs img_size and patch_size to fit the data$"):
            validate_run(_vit_model(), SimpleNamespace(img_size=img, in_chans=3), _trainer(), None)


def test_the_crops_a_view_transform_makes_are_checked_against_the_backbone():
    # Every crop size (MultiCrop's local size as it resolves it: here 10, which 4-px patches do not
    # divide); crops larger than the backbone's images are refused, whatever the data's own size.
    from ssl_vit.cli.recipe_checks import validate_run
    from ssl_vit.data import MultiCrop, TwoViews
    from ssl_vit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^data.views MultiCrop makes 10x10 crops, which the backbone's patch size 4 does not divide$"):
        validate_run(_vit_model(), SimpleNamespace(img_size=16, in_chans=3, views=MultiCrop(local_size=10).with_img_size(16)), _trainer(), None)
    with pytest.raises(ConfigError, match=r"the backbone was built for 16x16 images .* but the data gives 24x24 crops .*; set them to match$"):
        validate_run(_vit_model(), SimpleNamespace(img_size=24, in_chans=3, views=MultiCrop(local_size=8).with_img_size(24)), _trainer(), None)
    with pytest.raises(ConfigError, match=r"the backbone was built for 16x16 images .* but the data gives 24x24 crops"):  # the crops, not img_size
        validate_run(_vit_model(), SimpleNamespace(img_size=16, in_chans=3, views=TwoViews(size=24)), _trainer(), None)


def test_non_square_data_is_checked_on_each_side_against_the_backbone(capsys):
    from ssl_vit.cli.recipe_checks import validate_run
    from ssl_vit.errors import ConfigError

    for img in ((16, 24), (24, 16)):  # wider or taller than the backbone's 16x16: refused
        with pytest.raises(ConfigError, match=rf"built for 16x16 images .* but the data gives {img[0]}x{img[1]} crops .*; set them to match$"):
            validate_run(_vit_model(), SimpleNamespace(img_size=img, in_chans=3), _trainer(), None)
    capsys.readouterr()
    validate_run(_vit_model(img_size=(16, 24)), SimpleNamespace(img_size=(16, 20), in_chans=3), _trainer(), None)  # narrower: resampled
    assert "built for 16x24 images (model backbone_kwargs.img_size) but the data gives 16x20 crops" in capsys.readouterr().err


def test_zero_epochs_is_refused_by_name():
    from ssl_vit.cli.recipe_checks import validate_run
    from ssl_vit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^trainer.max_epochs 0 trains nothing"):
        validate_run(_vit_model(), SimpleNamespace(img_size=16, in_chans=3), _trainer(max_steps=-1, max_epochs=0), None)


class DINO:
    """A model as check_continuable reads it: its class name is the method."""

    backbone_name = "vit"
    backbone_kwargs = {**TINY, "drop_path_rate": 0.1, "drop_rate": 0.1, "attn_drop_rate": 0.1, "lean_backward": False}


def test_a_checkpoint_of_another_backbone_is_refused_and_dropout_rates_may_change(tmp_path):
    from ssl_vit.cli.recipe_checks import check_continuable
    from ssl_vit.errors import ConfigError

    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "ssl_vit": {"method": "DINO", "backbone": "vit_small", "backbone_kwargs": TINY}}, path)
    with pytest.raises(ConfigError, match=rf"^--ckpt_path {path} holds a vit_small backbone; this recipe builds vit$"):
        check_continuable(DINO(), str(path))
    torch.save({"state_dict": {}, "ssl_vit": {"method": "DINO", "backbone": "vit", "backbone_kwargs": TINY}}, path)
    check_continuable(DINO(), str(path))  # dropout, drop path and the backward's memory plan change no shape
    torch.save({"state_dict": {}, "ssl_vit": {"method": "DINO", "backbone": "vit"}}, path)  # a record without the arguments
    check_continuable(DINO(), str(path))  # (Lightning then compares the weights' shapes)


# -- cli/__init__.py: the dispatcher ------------------------------------------------------------------


@pytest.mark.parametrize("error, code, line", [
    (KeyboardInterrupt(), 130, "ssl-vit: interrupted\n"),
    (KeyError("no such column"), 1, "ssl-vit fit: error: 'no such column'\n"),
    (NotImplementedError("not on this backend"), 1, "ssl-vit fit: error: not on this backend\n"),
    # a library's message of several lines (a download's URL error) on one line
    (RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried http://host/, got:\n<urlopen error>\n"), 1,
     "ssl-vit fit: error: Error downloading train-images-idx3-ubyte.gz: Tried http://host/, got: <urlopen error>\n"),
    (None, 0, ""),
])
def test_what_a_command_raises_becomes_its_exit_status_and_one_line(monkeypatch, capsys, error, code, line):
    import ssl_vit.cli.fit as training_cli

    def command(argv):
        if error is not None:
            raise error

    monkeypatch.setattr(training_cli, "main", command)
    assert cli_main(["fit"]) == code
    assert capsys.readouterr().err == line


def test_a_ctrl_c_lightning_ends_with_exit_1_is_still_an_interruption(monkeypatch, capsys):
    # Lightning's _call_and_handle_interrupt: on a KeyboardInterrupt it tears down, then exit(1).
    import ssl_vit.cli.fit as training_cli

    def command(argv):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise SystemExit(1)  # noqa: B904 (as Lightning does it)

    monkeypatch.setattr(training_cli, "main", command)
    assert cli_main(["fit"]) == 130 and capsys.readouterr().err == "ssl-vit: interrupted\n"
    monkeypatch.setattr(training_cli, "main", lambda argv: exit(3))  # any other exit is the command's own
    with pytest.raises(SystemExit, match="3"):
        cli_main(["fit"])


def test_openmp_threads_wait_passively_unless_the_user_chose(monkeypatch):
    # Set before any command runs (spinning OpenMP threads slow a shared CPU several times over); the
    # demo without loader workers is one process alone on its cores, where spinning threads are faster.
    import os

    import ssl_vit.cli.demo as demo_cli
    import ssl_vit.cli.fit as training_cli

    seen = []
    for module in (training_cli, demo_cli):
        monkeypatch.setattr(module, "main", lambda argv: seen.append(os.environ.get("OMP_WAIT_POLICY")) or 0)
    runs = [(["fit"], None), (["demo"], None), (["demo", "--num-workers", "4"], None), (["demo", "--num-workers=2"], None), (["fit"], "ACTIVE"),
            (["demo"], "PASSIVE")]
    for argv, chosen in runs:
        monkeypatch.setenv("OMP_WAIT_POLICY", chosen or "unset")
        if chosen is None:
            monkeypatch.delenv("OMP_WAIT_POLICY")
        assert cli_main(argv) == 0
    assert seen == ["PASSIVE", "ACTIVE", "PASSIVE", "PASSIVE", "ACTIVE", "PASSIVE"]
