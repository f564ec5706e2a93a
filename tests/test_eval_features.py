import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ssl_vit import create_backbone
from ssl_vit.backbones import VisionTransformer
from ssl_vit.eval.features import extract_features, feature_dim


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=4, num_heads=2, drop_path_rate=0.1)


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(11, 1, 16, 16, generator=g), torch.arange(11) % 3


def test_modes_shapes_and_values(vit, data):
    x, y = data
    ds = TensorDataset(x, y)
    with torch.no_grad():
        vit.eval()
        tokens = vit.forward_features(x)  # [11, 17, 32]
        # reference for last4: run the blocks by hand, keep the normed [CLS] of the last 4
        h, outs = vit.prepare_tokens(x), []
        for blk in vit.blocks:
            h, _ = blk(h)
            outs.append(vit.norm(h)[:, 0])
        last = vit.norm(h)  # [11, 17, 32]: DINO's intermediate output of the last block
    vit.train()  # drop path is on: features computed in train mode would differ
    for mode, width, expected in (
        ("cls", 32, tokens[:, 0]),
        ("last4", 128, torch.cat(outs[-4:], dim=1)),
        ("avg", 32, tokens[:, 1:].mean(dim=1)),
        ("cls_avg", 64, torch.cat([last[:, 0], last[:, 1:].mean(dim=1)], dim=1)),  # DINO ViT-B: [CLS] + mean patch token
    ):
        f, labels = extract_features(vit, ds, mode=mode, batch_size=4)  # 4 does not divide 11
        assert f.shape == (11, width) == (11, feature_dim(vit, mode)) and f.dtype == torch.float32
        assert torch.equal(labels, y)
        torch.testing.assert_close(f, expected, rtol=1e-5, atol=1e-5)
    assert vit.training, "extract_features must restore the training flag"
    vit.blocks[0].eval()  # a submodule with its own mode (a frozen part) keeps it
    extract_features(vit, ds, batch_size=4)
    assert vit.training and vit.blocks[1].training and not vit.blocks[0].training


@pytest.mark.parametrize("n", [1, 2, 4])
def test_last_n_blocks_features_are_as_wide_as_feature_dim_says(vit, data, n):
    x, y = data
    f, _ = extract_features(vit, TensorDataset(x, y), mode="last4", batch_size=4, n_last_blocks=n)
    assert f.shape[1] == feature_dim(vit, "last4", n_last_blocks=n) == 32 * n


class _NoCls(VisionTransformer):
    """A ViT of one's own without [CLS]: the mean patch token is its representation."""

    num_prefix_tokens = 0

    def prepare_tokens(self, x, patch_hook=None):
        tokens, grid = self.patch_embed(x)  # [B, N, D]
        return self.pos_drop(tokens + self._pos_embed_for(grid)[:, 1:])  # (the table less its [CLS] row)


def test_modes_reading_cls_are_refused_for_a_backbone_without_it(data):
    x, y = data
    vit = _NoCls(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=2, global_pool="avg").eval()
    f, _ = extract_features(vit, TensorDataset(x, y), mode="avg", batch_size=4)
    with torch.no_grad():
        torch.testing.assert_close(f, vit.forward_features(x).mean(dim=1), rtol=1e-5, atol=1e-5)  # all 16 tokens are patches
    for mode in ("last4", "cls_avg"):  # would read the first patch as [CLS]
        with pytest.raises(ValueError, match=f"feature mode '{mode}' reads the \\[CLS\\] token, and this backbone has none"):
            feature_dim(vit, mode, n_last_blocks=2)


def test_dataloader_input_and_autocast(vit, data):
    x, y = data
    loader = DataLoader(TensorDataset(x, y), batch_size=5)
    f, labels = extract_features(vit, loader)
    assert f.shape == (11, 32) and torch.equal(labels, y)
    torch.testing.assert_close(f, extract_features(vit, TensorDataset(x, y), batch_size=4)[0])  # batches or a dataset alike
    f16, _ = extract_features(vit, loader, autocast_dtype=torch.bfloat16)
    assert f16.dtype == torch.float32 and torch.allclose(f16, f, atol=0.1)


def test_resnet_only_has_pooled_features(data, capsys):
    from ssl_vit.cli import main as cli_main

    x, y = data
    net = create_backbone("resnet18", in_chans=1, small_input=True, img_size=16)
    f, _ = extract_features(net, TensorDataset(x[:4], y[:4]))
    assert f.shape == (4, 512)
    for mode in ("last4", "avg", "cls_avg"):
        with pytest.raises(ValueError, match="mode='cls'"):
            feature_dim(net, mode)
    with pytest.raises(SystemExit):  # a read-out of no name: refused where the options are parsed
        cli_main(["eval", "knn", "--backbone", "random:resnet18", "--features", "mean"])
    assert "argument --features: invalid choice: 'mean'" in capsys.readouterr().err


def test_a_backbone_with_broken_weights_is_an_error_not_a_score(data):
    from ssl_vit.eval.evaluate import labelled_features

    broken = VisionTransformer(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2)
    with torch.no_grad():
        broken.blocks[0].mlp.fc1.weight[0, 0] = float("nan")
    features, labels = extract_features(broken, TensorDataset(*data), batch_size=8)
    with pytest.raises(ValueError, match=r"non-finite \(NaN/Inf\) features for 11 of 11 train images"):
        labelled_features(features, labels, "train")


def test_feature_protocols_record_the_encoder_and_refuse_two_results_in_one_file(tmp_path):
    # evaluate.py Evaluation.run: the backbone's chosen encoder (DINO's student) is the result's,
    # and one --out FILE.json cannot take two protocols' results.
    from ssl_vit.data import SyntheticDataModule
    from ssl_vit.eval.evaluate import Evaluation
    from ssl_vit.eval.knn import KNNClassifier

    torch.manual_seed(0)
    vit = VisionTransformer(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2)
    dm = SyntheticDataModule(num_samples=12, num_test_samples=6, num_classes=3, img_size=16, in_chans=1, num_workers=0)
    info = {"method": "dino", "which": "student", "source": "run/last.ckpt"}
    ((result, path),) = Evaluation(["knn"], knn=KNNClassifier(k=3)).run(vit, info, dm, tmp_path, device="cpu")
    assert result.backbone["encoder"] == "student" and result.source == "run/last.ckpt"
    assert path.name.startswith("dino_") and "-student_" in path.name
    with pytest.raises(ValueError, match="2 protocols write 2 results"):
        Evaluation(["knn", "fewshot"]).run(vit, info, dm, tmp_path / "one.json")
