"""The recipe's ``evaluate`` section on labelled data of its own (``evaluate.data``): a pretraining on
an unlabelled folder evaluated on a separate labelled train/val pair, and the missing-label errors
naming what is missing."""

import json

import pytest
import torch
import yaml
from helpers import write_image_folder

from ssl_vit.cli import main as cli_main
from ssl_vit.data import ImageFolderDataModule
from ssl_vit.eval.evaluate import Evaluation

TINY = {"img_size": 16, "patch_size": 4, "in_chans": 3, "embed_dim": 32, "depth": 1, "num_heads": 2}


def _images(root, classes: dict[str, int] | int):
    return write_image_folder(root, classes, [(16, 16)])


def _recipe(tmp_path, evaluate_data: dict) -> str:
    flat = _images(tmp_path / "unlabelled", 16)
    recipe = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "default_root_dir": str(tmp_path / "run"), "enable_progress_bar": False,
                    "enable_model_summary": False, "logger": False},
        "model": {"class_path": "ssl_vit.methods.MPP", "init_args": {"backbone": "vit", "backbone_kwargs": TINY, "warmup_epochs": 0.0}},
        "data": {"class_path": "ImageFolderDataModule", "init_args": {"train_dir": str(flat), "img_size": 16, "batch_size": 8, "num_workers": 0,
                                                                      "mean": [0.4, 0.4, 0.4], "std": [0.2, 0.2, 0.2]}},
        "evaluate": {"protocols": ["knn"], "knn": {"k": 3}, "data": {"class_path": "ImageFolderDataModule", "init_args": evaluate_data}},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return str(tmp_path / "recipe.yaml")


def test_a_recipe_pretrains_on_an_unlabelled_folder_and_evaluates_on_a_labelled_pair(tmp_path, capsys, monkeypatch):
    train, val = _images(tmp_path / "labelled" / "train", {"a": 4, "b": 4}), _images(tmp_path / "labelled" / "val", {"a": 2, "b": 2})
    # a labelled pair whose val_dir lacks class folders stops the recipe before it trains
    flat_val = _images(tmp_path / "flat_val", 4)
    assert cli_main(["fit", "--config", _recipe(tmp_path, {"train_dir": str(train), "val_dir": str(flat_val)})]) == 1
    assert (f"evaluate.data: ImageFolderDataModule val_dir {flat_val} has no class folders (<class>/<image>): its images have no labels; "
            "set evaluate.protocols: [] to pretrain without evaluating\n") in capsys.readouterr().err
    assert not (tmp_path / "run").exists()

    seen = []
    run = Evaluation.run
    monkeypatch.setattr(Evaluation, "run", lambda self, backbone, info, dm, *a, **k: seen.append(dm) or run(self, backbone, info, dm, *a, **k))
    assert cli_main(["fit", "--config", _recipe(tmp_path, {"train_dir": str(train), "val_dir": str(val), "std": [0.5]})]) == 0
    # the pretraining's resolution, mean and loader workers follow, the std the recipe set wins
    (dm,) = seen
    assert (dm.img_size, dm.in_chans, dm.mean, dm.std, dm.num_workers) == (16, 3, (0.4, 0.4, 0.4), (0.5, 0.5, 0.5), 0)
    (path,) = (tmp_path / "run" / "results").glob("*.json")
    result = json.loads(path.read_text())
    assert result["protocol"] == "knn" and result["method"] == "mpp"
    assert result["data"] == {"name": "imagefolder", "train_dir": str(train), "val_dir": str(val), "train_size": 8, "test_size": 4}
    assert result["pretrain"]["data"] == f"imagefolder:{tmp_path.name}/unlabelled"  # what it was pretrained on
    assert "knn       mpp  vit-D32-L1-H2/4  imagefolder:labelled/train" in capsys.readouterr().out


@pytest.mark.parametrize("own, train, val, message", [
    # the run's data: an unlabelled folder alone, or beside a labelled val_dir (not blamed)
    (False, 4, None, "evaluate: ImageFolderDataModule has no val_dir (the labelled test split); set evaluate.protocols: [] to pretrain "
                           "without evaluating, or evaluate on labelled data of its own (evaluate.data)"),
    (False, 4, {"a": 1, "b": 1}, "evaluate: ImageFolderDataModule train_dir {tmp}/train has no class folders (<class>/<image>): its "
                                       "images have no labels; set evaluate.protocols: [] to pretrain without evaluating, or evaluate"),
    # evaluate.data of its own
    (True, {"a": 2, "b": 2}, None, "evaluate.data: ImageFolderDataModule has no val_dir (the labelled test split); set evaluate.protocols: []"),
    (True, {"a": 2, "b": 2}, 2, "evaluate.data: ImageFolderDataModule val_dir {tmp}/val has no class folders (<class>/<image>)"),
    (True, 4, {"a": 1, "b": 1}, "evaluate.data: ImageFolderDataModule train_dir {tmp}/train has no class folders (<class>/<image>)"),
])
def test_a_missing_labelled_split_is_named_before_training(tmp_path, own, train, val, message):
    dm = ImageFolderDataModule(str(_images(tmp_path / "train", train)), str(_images(tmp_path / "val", val)) if val else None)
    labelled = ImageFolderDataModule(str(_images(tmp_path / "ok_train", {"a": 1, "b": 1})), str(_images(tmp_path / "ok_val", {"a": 1, "b": 1})))
    evaluation = Evaluation(["knn"], data=dm if own else None)
    with pytest.raises(ValueError) as err:
        evaluation.check_data(labelled if own else dm)
    assert str(err.value).startswith(message.format(tmp=tmp_path))
    Evaluation(["knn"], data=labelled if own else None).check_data(labelled)  # a labelled pair passes


def test_few_labels_train_the_linear_probe_on_draws_of_the_training_split_a_subset_of_the_same_seed_holds(tmp_path):
    # Reference: ImageDataModule(subset=n, seed=s) draws the images the supervised baseline trains on;
    # the probe at n labels with draw seed s must train on exactly those images' features.
    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.linear import LinearProbe
    from ssl_vit.export import load_any_backbone

    backbone, info = load_any_backbone("random:vit", backbone_kwargs={"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 16,
                                                                       "depth": 1, "num_heads": 2})
    write_image_folder(tmp_path / "train", {"a": 20, "b": 20, "c": 20}, [(16, 16)], "L")
    write_image_folder(tmp_path / "val", {"a": 4, "b": 4, "c": 4}, [(16, 16)], "L", seed=1)
    data = dict(train_dir=str(tmp_path / "train"), val_dir=str(tmp_path / "val"), img_size=16, in_chans=1, num_workers=0)
    seen: list[set] = []

    class Recording(LinearProbe):
        def evaluate(self, train_features, train_labels, *args, **kwargs):
            seen.append({tuple(f.tolist()) for f in train_features})
            return super().evaluate(train_features, train_labels, *args, **kwargs)

    evaluation = Evaluation(["linear"], linear=Recording(epochs=2), train_subset=40, few_labels=[12], draws=2, seed=5)
    done = [r for r, _ in evaluation.run(backbone, info, ImageFolderDataModule(**data), tmp_path / "out")]
    assert [(r.data["train_size"], r.protocol_args["seed"]) for r in done] == [(40, 5), (12, 5), (12, 6)]
    for n, seed, features in ((40, 5, seen[0]), (12, 5, seen[1]), (12, 6, seen[2])):
        train, _ = ImageFolderDataModule(**data, subset=n, seed=seed).eval_datasets()
        with torch.no_grad():
            assert {tuple(f.tolist()) for f in backbone(torch.stack([x for x, _ in train]))} == features
    with pytest.raises(ValueError, match="few_labels trains the linear probe on few labels: add linear"):
        Evaluation(["knn"], few_labels=[10])
