"""``torch.compile`` of the backbones, one block at a time: the same function and gradients as
the eager modules, the same parameter names, engaged for every backbone of a method (teachers and
momentum encoders too), and refused with a clear message for a backend torch does not know.

Most tests use the ``aot_eager`` backend: it traces forward and backward as inductor does but
runs torch's own kernels, so the results must equal the eager ones exactly and compiling takes
seconds. One test compiles with inductor (generated kernels: equal to float tolerance)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from helpers import SMALL_HEADS, TINY_VIT, VIEW_SIZES, fit_steps, fixed_views, registered_backbones
from torch import nn
from torch._dynamo.utils import counters

from ssl_vit.backbones import create_backbone
from ssl_vit.backbones.compile import check_backend, compile_backbone, compile_regions
from ssl_vit.methods import METHODS

HYBRID = {"resnet": "resnet18", "num_stages": 1, "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 32, "in_chans": 1}
BUILDS = {
    "vit": ("vit", {**TINY_VIT, "depth": 3, "drop_path_rate": 0.2}),  # three drop-path rates: three graphs
    "hybrid": ("hybrid", HYBRID),
    "resnet": ("resnet18", {"img_size": 16, "in_chans": 1, "small_input": True, "num_stages": 2}),
}


def compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def twins(name: str, kwargs: dict) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = create_backbone(name, **kwargs)
    reference = create_backbone(name, **kwargs)
    reference.load_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize("kind", sorted(BUILDS))
def test_compiled_backbones_compute_the_eager_function_and_gradients(kind):
    name, kwargs = BUILDS[kind]
    model, reference = twins(name, kwargs)
    keys = list(model.state_dict())
    torch._dynamo.reset()
    counters.clear()
    regions = compile_backbone(model, "aot_eager")
    assert regions == {"vit": ["blocks.0", "blocks.1", "blocks.2"], "hybrid": ["blocks.0", "blocks.1"],
                       "resnet": ["layer1", "layer2"]}[kind]
    assert all(compiled(model.get_submodule(r)) for r in regions) and not compiled(model)
    x = torch.randn(3, 1, *model.img_size)
    outs, grads = [], []
    for m in (model, reference):
        torch.manual_seed(1)  # the same drop-path draws
        y = m(x)  # [B, D]
        (y**2).sum().backward()
        outs.append(y)
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert counters["frames"]["ok"] > 0  # dynamo compiled (blocks of one shape share a graph: see below)
    assert torch.equal(outs[0], outs[1])
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for n, g in grads[1].items():
        assert torch.equal(grads[0][n], g), n
    assert list(model.state_dict()) == keys  # the names checkpoints and exports use


def test_the_vit_blocks_share_one_graph():
    # Regional compilation compiles a block once and reuses it for the other blocks of one shape.
    model, _ = twins("vit", {**TINY_VIT, "depth": 4})
    torch._dynamo.reset()
    counters.clear()
    compile_backbone(model, "aot_eager")
    model(torch.randn(2, 1, 16, 16)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor builds C++ kernels on a CPU: no C++ compiler")
def test_inductor_kernels_match_the_eager_modules():
    model, reference = twins("vit", TINY_VIT)
    compile_backbone(model)  # inductor, the default
    x = torch.randn(4, 1, 16, 16)
    y, want = model(x), reference(x)
    (y**2).sum().backward()
    (want**2).sum().backward()
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=n)


def test_a_backbone_without_blocks_or_stages_is_compiled_whole():
    class Plain(nn.Module):
        def __init__(self, **_: object) -> None:
            super().__init__()
            self.embed_dim, self.in_chans, self.img_size = 8, 1, (4, 4)
            self.fc = nn.Linear(16, 8)

        def forward_features(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.flatten(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.forward_features(x)

    with registered_backbones(plain_test=Plain):
        model = create_backbone("plain_test")
    assert [n for n, _ in compile_regions(model)] == [""]
    assert compile_backbone(model, "aot_eager") == [""] and compiled(model)
    x = torch.randn(2, 1, 4, 4)
    assert torch.equal(model(x), model.fc(x.flatten(1)))


def test_an_unknown_backend_is_refused_naming_the_known_ones():
    message = "compile backend 'inductr' is not one torch.compile knows; choose from "
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        check_backend("inductr")
    assert "inductor" in str(err.value) and "aot_eager" in str(err.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        METHODS["supervised"](backbone="vit", backbone_kwargs=TINY_VIT, num_classes=4, compile_backbone=True, compile_backend="inductr")
    # Not compiling, the backend is not looked at.
    METHODS["supervised"](backbone="vit", backbone_kwargs=TINY_VIT, num_classes=4, compile_backend="inductr")


TARGETS = {"mocov3": ["momentum_backbone"], "dino": ["teacher_backbone"]}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_compiled_method_trains_as_the_eager_one(method):
    # Every backbone of the method (a momentum encoder, a teacher) compiled at setup; three steps
    # with drop path on: the same losses and the same weights, online and averaged.
    views, labels = fixed_views(VIEW_SIZES[method])
    if method == "mpp":
        views = [v.clamp(-1, 1) for v in views]  # raw pixels = v * 0.5 + 0.5 in [0, 1]
    runs = []
    for compile_ in (False, True):
        torch.manual_seed(0)
        model = METHODS[method](backbone="vit", backbone_kwargs={**TINY_VIT, "drop_path_rate": 0.1}, num_classes=4, warmup_epochs=0.0,
                                compile_backbone=compile_, compile_backend="aot_eager", **SMALL_HEADS[method])
        losses = fit_steps(model, views, labels, steps=3)
        runs.append((losses, model.state_dict(), model))
    (eager_losses, eager_state, _), (losses, state, model) = runs
    for name in ["backbone", *TARGETS.get(method, [])]:
        assert all(compiled(b) for b in getattr(model, name).blocks), name
    assert not any(compiled(m) for n, m in model.named_children() if n not in ["backbone", *TARGETS.get(method, [])])
    assert losses == eager_losses and len(losses) == 3
    assert state.keys() == eager_state.keys()
    for key, value in eager_state.items():
        assert torch.equal(state[key], value), key


def test_a_compiled_backbone_exports_its_traced_files_and_stays_compiled(tmp_path):
    from ssl_vit.export import load_backbone, save_backbone

    model, reference = twins("vit", TINY_VIT)
    compile_backbone(model, "aot_eager")
    model(torch.randn(2, 1, 16, 16))  # compiled and run, as after training
    # (tracing a compiled block fails: "using FX to torch.jit.trace a dynamo-optimized function")
    save_backbone(model, tmp_path / "exp", formats=["safetensors", "torchscript", "onnx"])
    assert all(compiled(b) for b in model.blocks)
    x = torch.randn(3, 1, 16, 16)
    with torch.no_grad():
        want = reference.eval()(x)
        torch.testing.assert_close(torch.jit.load(tmp_path / "exp" / "model.torchscript.pt")(x), want)
        torch.testing.assert_close(load_backbone(tmp_path / "exp").eval()(x), want)


def test_a_compiled_finetuning_trains_as_the_eager_one():
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from ssl_vit.eval.finetune import FineTuneModule, FineTuneSettings

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 1, 16, 16, generator=g), torch.arange(16) % 4)
    states = []
    for compile_ in (False, True):
        torch.manual_seed(0)
        module = FineTuneModule(create_backbone("vit", **TINY_VIT), 4, FineTuneSettings(batch_size=8, warmup_epochs=0.0, drop_path_rate=0.1,
                                                                                       compile_backbone=compile_, compile_backend="aot_eager"))
        trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(module, DataLoader(data, batch_size=8))
        assert all(compiled(b) for b in module.backbone.blocks) == compile_
        states.append(module.state_dict())
    assert states[0].keys() == states[1].keys()
    for key, value in states[0].items():
        assert torch.equal(states[1][key], value), key
    with pytest.raises(ValueError, match="compile backend 'nope'"):  # (before the first step)
        FineTuneModule(create_backbone("vit", **TINY_VIT), 4, FineTuneSettings(compile_backbone=True, compile_backend="nope")).setup("fit")


def test_eval_finetune_compile_compiles_the_backbone_it_trains_and_exports(tmp_path, monkeypatch, capsys):
    from ssl_vit.cli import main
    from ssl_vit.eval import finetune

    calls = []

    def compile_with_aot_eager(backbone, backend):  # inductor's C++ build is covered above
        calls.append(backend)
        return compile_backbone(backbone, "aot_eager")

    monkeypatch.setattr(finetune, "compile_backbone", compile_with_aot_eager)
    tiny = '{"img_size": 16, "patch_size": 4, "in_chans": 3, "embed_dim": 32, "depth": 2, "num_heads": 2}'
    synthetic = ["--data", "synthetic", "--data-arg", "num_samples=32", "--data-arg", "num_test_samples=16", "--data-arg", "num_classes=4"]
    args = ["eval", "finetune", "--backbone", "random:vit", "--backbone-kwargs", tiny, *synthetic, "--num-workers", "0", "--epochs", "1",
            "--batch-size", "16", "--compile", "--out", str(tmp_path / "ft.json"), "--export", str(tmp_path / "exp"), "--export-format", "torchscript"]
    assert main(args) == 0, capsys.readouterr().err
    assert calls == ["inductor"]
    assert (tmp_path / "exp" / "model.torchscript.pt").is_file()
    assert json.loads((tmp_path / "ft.json").read_text())["metrics"]["top1"] >= 0
    # Without --compile nothing is compiled.
    assert main([*args[:args.index("--compile")], "--out", str(tmp_path / "ft2.json")]) == 0 and calls == ["inductor"]


def test_a_recipe_finetuning_takes_compile_backbone():
    from jsonargparse import ArgumentParser

    from ssl_vit.eval.evaluate import Evaluation

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Evaluation, "evaluate")  # as ssl-vit fit reads a recipe's evaluate section
    cfg = parser.parse_args(["--evaluate.protocols", "[finetune]", "--evaluate.finetune", "{compile_backbone: true, epochs: 1}"])
    assert parser.instantiate(cfg).evaluate.settings["finetune"].compile_backbone is True
    with pytest.raises(Exception, match="compile_backbon"):
        parser.parse_args(["--evaluate.protocols", "[finetune]", "--evaluate.finetune", "{compile_backbon: true}"])
