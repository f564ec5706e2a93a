"""On a CUDA GPU (skipped without one): the paper recipes run with their own trainer settings
(gpu, DDP, bf16-mixed) shrunk to one device and a tiny model; FSDP (recipes/trainer/fsdp.yaml)
trains, checkpoints and resumes the methods with a momentum encoder / teacher; bf16 autocast and the
fused attention kernels agree with fp32 and the explicit attention path; the benchmark runs on
CUDA, and so do eval and visualize; the lean backward and the fused optimiser agree with the plain modules and torch's default AdamW."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from ssl_vit.cli import main as cli_main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[1]
PAPER_RECIPES = sorted((ROOT / "recipes" / "imagenet").glob("*.yaml"))
FSDP = ROOT / "recipes" / "trainer" / "fsdp.yaml"
TINY_BACKBONE = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2}
SMALL_HEADS = {
    "ssl_vit.methods.DINO": {"out_dim": 256, "hidden_dim": 64, "bottleneck_dim": 32},
    "ssl_vit.methods.MoCoV3": {"proj_hidden_dim": 64, "pred_hidden_dim": 64, "proj_output_dim": 32},
    "ssl_vit.methods.MPP": {},
    "ssl_vit.methods.Supervised": {},
}
VIEW_SIZES = {
    "ssl_vit.data.MultiCrop": {"global_size": 32, "local_size": 16, "n_local_crops": 2},
    "ssl_vit.data.TwoViews": {"size": 32},
    "ssl_vit.data.SingleView": {"size": 32},
}


def _shrink(recipe: Path, tmp_path: Path, steps: int) -> list[str]:
    """Keep the recipe's accelerator, strategy and precision; one GPU, a tiny model, synthetic data."""
    cfg = yaml.safe_load(recipe.read_text())
    method = cfg["model"]["class_path"]
    views = cfg["data"]["init_args"]["views"]["class_path"]
    kwargs = {**cfg["model"]["init_args"].get("backbone_kwargs", {}), **TINY_BACKBONE, "in_chans": 3}
    args = [
        "--trainer.devices", "1", "--trainer.num_nodes", "1", "--trainer.max_steps", str(steps), "--trainer.max_epochs", "5",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp_path / "run"), "--global_batch_size", "16", "--checkpoint.every_n_train_steps", "2",
        "--model.init_args.backbone", "vit", "--model.init_args.backbone_kwargs", yaml.safe_dump(kwargs, default_flow_style=True).strip(),
        "--data", "ssl_vit.data.SyntheticDataModule", "--data.init_args.num_samples", "64", "--data.init_args.num_test_samples", "16",
        "--data.init_args.img_size", "32", "--data.init_args.num_workers", "2", "--data.init_args.views", views,
    ]
    for key, value in SMALL_HEADS[method].items():
        args += [f"--model.init_args.{key}", str(value)]
    for key, value in VIEW_SIZES[views].items():
        args += [f"--data.init_args.views.init_args.{key}", str(value)]
    return args


def _last(tmp_path: Path) -> dict:
    return torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def _all_finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state.values() if torch.is_tensor(v) and v.is_floating_point())


@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=[p.stem for p in PAPER_RECIPES])
def test_paper_recipe_trains_on_one_gpu_in_bf16(recipe: Path, tmp_path: Path) -> None:
    cfg = yaml.safe_load(recipe.read_text())
    assert cfg["trainer"]["accelerator"] == "gpu" and cfg["trainer"]["precision"] == "bf16-mixed"
    assert cli_main(["fit", "--config", str(recipe), *_shrink(recipe, tmp_path, steps=3)]) == 0
    ckpt = _last(tmp_path)
    assert ckpt["global_step"] == 3 and _all_finite(ckpt["state_dict"])
    assert ckpt["ssl_vit"]["pretrain_flops"] > 0


@pytest.mark.parametrize("recipe", ["dino_vit_small16", "mocov3_vit_small16"])
def test_fsdp_trains_checkpoints_and_resumes(recipe: str, tmp_path: Path) -> None:
    path = ROOT / "recipes" / "imagenet" / f"{recipe}.yaml"
    args = ["fit", "--config", str(path), "--config", str(FSDP), *_shrink(path, tmp_path, steps=2)]
    assert cli_main(args) == 0
    first = _last(tmp_path)
    assert first["global_step"] == 2 and _all_finite(first["state_dict"])
    assert cli_main([*args, "--trainer.max_steps", "4", "--resume"]) == 0
    ckpt = _last(tmp_path)
    assert ckpt["global_step"] == 4 and _all_finite(ckpt["state_dict"])
    state = ckpt["state_dict"]
    # The full (unsharded) state dict: every block of the backbone, the EMA copy moved towards it.
    student = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
    target_prefix = "teacher_backbone." if recipe.startswith("dino") else "momentum_backbone."
    target = {k[len(target_prefix):]: v for k, v in state.items() if k.startswith(target_prefix)}
    assert set(student) == set(target) and "blocks.1.mlp.fc2.weight" in student
    moved = [k for k in student if not torch.equal(first["state_dict"][target_prefix + k], target[k])]
    assert moved, "the EMA target did not change between steps 2 and 4"


def test_bf16_autocast_and_fused_attention_agree_with_fp32() -> None:
    from ssl_vit.backbones import create_backbone

    torch.manual_seed(0)
    model = create_backbone("vit_small", img_size=224, patch_size=16).cuda().eval()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    with torch.no_grad():
        ref = model.double()(x.double()).float()
        model.float()
        fp32 = model(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = model(x).float()
            maps = model.get_attention_maps(x)  # the explicit path, in bf16 too
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(fp32, ref) < 1e-3  # TF32 matmuls at most
    assert rel(bf16, ref) < 3e-2
    assert len(maps) == 12 and all(torch.isfinite(m).all() for m in maps)
    rows = maps[-1].float().sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=2e-2)


def test_benchmark_runs_on_cuda(tmp_path: Path) -> None:
    from ssl_vit.cli.benchmark import main

    out = tmp_path / "bench.json"
    assert main(["--preset", "tiny", "--device", "cuda", "--precision", "bf16-mixed", "--methods", "dino", "--no-data", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rows"][0]["round_matmul"]["dtype"] == "bfloat16" and result["environment"]["gpu"]
    for row in result["rows"]:
        for impl in ("ours", "peer"):
            assert "error" not in row[impl], row[impl].get("traceback")
            assert row[impl]["peak_mem_bytes"] > 0 and row[impl]["images_per_s"] > 0


def test_eval_and_visualize_run_on_cuda(tmp_path: Path) -> None:
    backbone = ["random:vit", "--backbone-kwargs", json.dumps({**TINY_BACKBONE, "in_chans": 3}), "--device", "cuda"]
    synth = ["--data-arg", "num_samples=64", "--data-arg", "num_test_samples=32", "--data-arg", "num_classes=4"]
    out = tmp_path / "knn.json"
    assert cli_main(["eval", "knn", "--backbone", *backbone, "--data", "synthetic", *synth, "--num-workers", "0", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["metrics"]["top1"] >= 0
    for protocol in (["knn"], ["linear", "--augment", "--epochs", "1", "--probe-batch-size", "16"], ["finetune", "--epochs", "1", "--batch-size", "16"]):
        rec = tmp_path / f"{protocol[0]}_16.json"
        assert cli_main(["eval", *protocol, "--backbone", *backbone, "--data", "synthetic", *synth, "--num-workers", "0",
                         "--precision", "16-mixed", "--out", str(rec)]) == 0
        assert json.loads(rec.read_text())["protocol_args"]["precision"] == "16-mixed"
    assert cli_main(["visualize", *backbone[:3], "--device", "cuda", "--images", "synthetic", *synth, "--out", str(tmp_path / "fig"), "--num-images", "8"]) == 0
    assert (tmp_path / "fig" / "attention_distance.png").is_file()


def test_lean_backward_under_bf16_autocast_matches_the_plain_modules_with_less_memory() -> None:
    # norm_linear / gelu_linear cast as autocast would; on CUDA the same values and gradients as
    # the plain modules (to bf16 rounding) and a lower peak of allocated memory.
    from ssl_vit import create_backbone

    dev = torch.device("cuda")
    x = torch.randn(64, 3, 112, 112, device=dev)
    grads, peaks = {}, {}
    for lean in (True, False):
        torch.manual_seed(0)
        model = create_backbone("vit_small", img_size=112, patch_size=16, lean_backward=lean).to(dev).train()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        peaks[lean] = torch.cuda.max_memory_allocated() - base
        grads[lean] = {n: p.grad.float() for n, p in model.named_parameters()}
        assert out.dtype == torch.bfloat16
    for name, g in grads[False].items():
        diff = (grads[True][name] - g).abs().max()
        assert diff <= 5e-2 * g.abs().max() + 1e-6, name
        assert grads[True][name].dtype == torch.float32
    assert peaks[True] < peaks[False]


def test_methods_optimiser_is_fused_on_cuda_and_matches_the_loop() -> None:
    # torch's fused AdamW kernel on CUDA (our modules' default) against its default (foreach):
    # the same weights after a few steps on the same gradients, to float rounding.
    from ssl_vit.methods import Supervised

    dev = torch.device("cuda")
    kwargs = {"backbone": "vit", "backbone_kwargs": TINY_BACKBONE, "num_classes": 4, "weight_decay": 0.1}
    fused, plain = Supervised(**kwargs).to(dev), Supervised(**kwargs, fused_optimizer=False).to(dev)
    plain.load_state_dict(fused.state_dict())
    opts = fused.configure_optimizers(), plain.configure_optimizers()
    assert opts[0].defaults["fused"] and not opts[1].defaults.get("fused")
    g = torch.Generator(device=dev).manual_seed(0)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, device=dev, generator=g) for n, p in fused.named_parameters()}
        for model, opt in zip((fused, plain), opts):
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            opt.step()
    for a, b in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sharded_clipping_of_a_skipped_step_reduces_on_the_gpu_for_nccl() -> None:
    # A skipped batch under FSDP has no gradients: the norms to all-reduce must still be CUDA
    # tensors for NCCL (a CPU tensor there is an error), and nothing is clipped.
    import os

    import torch.distributed as dist

    from ssl_vit.methods.distributed import clip_gradients

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    group = dist.new_group(backend="nccl") if dist.is_initialized() else None
    if group is None:
        dist.init_process_group("nccl", rank=0, world_size=1)
        group = dist.group.WORLD
    try:
        params = [torch.nn.Parameter(torch.ones(3, device="cuda")), torch.nn.Parameter(torch.ones(2, device="cuda"))]
        norms = clip_gradients(params, 3.0, "per_param", group)  # no gradients: a skipped step
        assert norms.device.type == "cuda" and norms.tolist() == [0.0, 0.0]
        params[0].grad = torch.full((3,), 4.0, device="cuda")
        clip_gradients(params, 3.0, "per_param", group)
        assert params[0].grad.norm().item() == pytest.approx(3.0, rel=1e-4)
    finally:
        if group is dist.group.WORLD:
            dist.destroy_process_group()


def test_sweeps_take_features_on_the_gpu_with_labels_on_the_cpu() -> None:
    # the single-setting paths accept that mix; the sweeps index the labels with a permutation
    # made on the features' device
    from ssl_vit.eval.knn import KNNClassifier
    from ssl_vit.eval.linear import LinearProbe

    g = torch.Generator().manual_seed(0)
    feats, labels = torch.randn(40, 8, generator=g).cuda(), torch.arange(40) % 2
    knn, probe = KNNClassifier(k=[1, 3]), LinearProbe(epochs=1, batch_size=8, base_lr=[0.1, 1.0], warmup_epochs=0)
    knn.evaluate(feats, labels, feats, labels, 2)
    probe.evaluate(feats, labels, feats, labels, 2)
    assert knn.picked["selected_k"] in (1, 3) and probe.picked["selected_base_lr"] in (0.1, 1.0)
