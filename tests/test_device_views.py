"""Views made on the training device (``ssl_vit.data.device_views``) against the CPU views: the crop
sampler's areas and aspect ratios (two-sample Kolmogorov-Smirnov against torchvision's
``RandomResizedCrop.get_params``), the other draws' rates and ranges (DINO's and MoCo v3's
probabilities), the batched operations against torchvision's tensor ops, the pixels against the CPU
path's for the same draws, the datamodule's batch, short DINO / MoCo v3 fits and the benchmark's
worker row. Statistical checks are seeded."""

from __future__ import annotations

import dataclasses
import io
import math
import random
from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import default_collate
from torchvision.transforms import RandomResizedCrop

from ssl_vit import bench
from ssl_vit.data import MultiCrop, SyntheticDataModule, TwoViews
from ssl_vit.data.device_views import color_jitter, gaussian_blur, make_views, shift_hue
from ssl_vit.methods import DINO, MoCoV3


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    # Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs.
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(np.sort(a), grid, side="right") / len(a) - np.searchsorted(np.sort(b), grid, side="right") / len(b)).max())


def _photo(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    # Smooth colour fields with some detail: a crop or flip a few pixels off shows.
    field = np.random.default_rng(seed).integers(0, 256, (9, 12, 3), dtype=np.uint8)
    return Image.fromarray(field).resize((width, height), Image.Resampling.BICUBIC).convert(mode)


def _pack(transform, img: Image.Image, seeds) -> dict[str, torch.Tensor]:
    items = []
    for seed in seeds:
        random.seed(seed)  # as TransformedDataset seeds each sample
        items.append(transform(img))
    return default_collate(items)


def test_crop_areas_and_aspect_ratios_are_the_cpu_samplers():
    # A 300 x 200 image on a 100-px canvas (downscaled 3x): the boxes, read back in the image's
    # pixels, against torchvision's sampler (MoCo v3's and DINO's RandomResizedCrop).
    img, n = _photo(300, 200), 1000
    packed = _pack(TwoViews(size=32, on_device=True, canvas=100), img, range(n))
    boxes = packed["boxes"].reshape(-1, 4)  # [2n, 4] on the canvas
    assert boxes[:, 2].max() <= 100 and boxes[:, 3].max() <= 67 and boxes.min() >= 0  # inside the image's 100 x 67 corner
    w, h = (boxes[:, 2] - boxes[:, 0]) * 3, (boxes[:, 3] - boxes[:, 1]) * 200 / 67
    ours = {"area": (w * h / 60000).numpy(), "log_ratio": (w / h).log().numpy()}
    torch.manual_seed(0)

    def reference(scale: tuple[float, float]) -> dict[str, np.ndarray]:
        hw = np.array([RandomResizedCrop.get_params(torch.empty(3, 200, 300), list(scale), [3 / 4, 4 / 3])[2:] for _ in range(2 * n)], dtype=float)
        return {"area": hw[:, 0] * hw[:, 1] / 60000, "log_ratio": np.log(hw[:, 1] / hw[:, 0])}

    same, other = reference((0.08, 1.0)), reference((0.2, 1.0))
    assert max(abs(ours["log_ratio"]).max(), abs(same["log_ratio"]).max()) <= math.log(4 / 3) + 0.02
    for key in ("area", "log_ratio"):
        assert _ks(ours[key], same[key]) < 0.06  # 2000 vs 2000: the 0.1 % critical value is 0.062
    assert _ks(ours["area"], other["area"]) > 0.08  # and it tells a scale of (0.2, 1) from (0.08, 1)


def test_draw_rates_and_ranges_are_dinos():
    # main_dino.py: flip 0.5, jitter (0.4, 0.4, 0.2, 0.1) p 0.8, grey 0.2, blur 1.0 / 0.1 / 0.5, solarise 0 / 0.2 / 0.
    n, t = 1500, MultiCrop(global_size=32, local_size=16, n_local_crops=2, on_device=True)
    p = _pack(t, _photo(40, 30), range(n))
    jittered = p["order"][..., 0] >= 0  # [n, 4]
    for name, rate, expected in (("flip", p["flip"], [0.5] * 4), ("jitter", jittered, [0.8] * 4), ("grey", p["grey"], [0.2] * 4),
                                 ("blur", p["sigma"] > 0, [1.0, 0.1, 0.5, 0.5]), ("solarize", p["solarize"], [0.0, 0.2, 0.0, 0.0])):
        assert rate.float().mean(0).tolist() == pytest.approx(expected, abs=0.05), name  # 4 binomial sds at n = 1500
    sigma_range = t.augmentations()[0].blur_sigma  # (0.1, 2.0) x 32 / 224
    sigma = p["sigma"][p["sigma"] > 0].numpy()
    assert sigma_range[0] <= sigma.min() and sigma.max() <= sigma_range[1] and _ks(sigma, np.random.default_rng(0).uniform(*sigma_range, 4000)) < 0.05
    factors = p["factors"][jittered]  # [m, 4]
    for op, (lo, hi) in enumerate([(0.6, 1.4), (0.6, 1.4), (0.8, 1.2), (-0.1, 0.1)]):
        assert _ks(factors[:, op].numpy(), np.random.default_rng(op).uniform(lo, hi, 4000)) < 0.05
    orders = Counter(tuple(o) for o in p["order"][jittered].tolist())
    assert len(orders) == 24 and min(orders.values()) > 100  # each permutation about 4800 / 24 = 200 times
    assert (p["factors"][~jittered] == torch.tensor([1.0, 1.0, 1.0, 0.0])).all() and (p["order"][~jittered] == -1).all()


TWO, MULTI = TwoViews(size=48), MultiCrop(global_size=48, local_size=24, n_local_crops=3)


@pytest.mark.parametrize(("views", "mode", "canvas"), [(TWO, "RGB", None), (TWO, "L", None), (MULTI, "RGB", None), (MULTI, "L", None), (TWO, "RGB", 80)],
                         ids=["two", "two-grey", "multicrop", "multicrop-grey", "two-downscaled"])
def test_pixels_agree_with_the_cpu_views_for_the_same_draws(views, mode, canvas):
    # (the 120 x 90 image fits the default canvas of 109 px as it is; one of 80 px downscales it 1.5x)
    img, seeds = _photo(120, 90, mode), range(12)
    on_device = dataclasses.replace(views, on_device=True, canvas=canvas)
    channels = 3 if mode == "RGB" else 1
    made = make_views(_pack(on_device, img, seeds), on_device.augmentations(), (0.0,) * channels, (1.0,) * channels)
    errors, shifted = [], []
    for i, seed in enumerate(seeds):
        random.seed(seed)
        cpu = views(img)
        random.seed(seed + 100)
        other = views(img)
        errors += [(a - b[i]).abs().flatten() for a, b in zip(cpu, made)]
        shifted += [(a - b[i]).abs().flatten() for a, b in zip(other, made)]
    errors, shifted = torch.cat(errors), torch.cat(shifted)
    # bilinear / box-averaged vs Pillow's filters, float vs 8 bits between operations, exact vs
    # box-approximated blur: within 2/255 on average (other draws: 20 times that)
    assert errors.mean() < 0.012 and errors.quantile(0.99) < 0.05 and errors.max() < 0.2
    assert shifted.mean() > 0.1


def test_batched_colour_operations_match_torchvision_per_sample():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(6, 3, 8, 8, generator=gen)
    shifts = torch.tensor([-0.5, -0.3, -0.01, 0.0, 0.2, 0.45])
    expected = torch.stack([TF.adjust_hue(x[i], float(s)) for i, s in enumerate(shifts)])
    torch.testing.assert_close(shift_hue(x, shifts), expected, atol=1e-5, rtol=0)
    # the four ops in each sample's own order (-1: fewer ops), torchvision's tensor ops one sample at a time
    order = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [2, 0, -1, -1], [-1, -1, -1, -1], [3, -1, -1, -1]], dtype=torch.int8)
    factors = torch.stack([torch.rand(6, generator=gen) + 0.5, torch.rand(6, generator=gen) + 0.5,
                           torch.rand(6, generator=gen) + 0.5, torch.rand(6, generator=gen) - 0.5], 1)  # [6, 4]
    ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    expected = []
    for i in range(6):
        y = x[i]
        for op in order[i].tolist():
            y = ops[op](y, float(factors[i, op])) if op >= 0 else y
        expected.append(y)
    # (torchvision's grey weighs red 0.2989, Pillow's 0.299)
    torch.testing.assert_close(color_jitter(x.clone(), order, factors), torch.stack(expected), atol=2e-3, rtol=0)


def test_per_sample_blur_matches_torchvision_gaussian_blur():
    x = torch.rand(3, 2, 20, 20, generator=torch.Generator().manual_seed(0))
    sigma, radius = torch.tensor([0.3, 1.0, 2.0]), 6
    blurred = gaussian_blur(x, sigma, radius)
    for i, s in enumerate(sigma.tolist()):
        expected = TF.gaussian_blur(x[i], [2 * radius + 1] * 2, [s, s])  # (reflected edges: compared inside)
        torch.testing.assert_close(blurred[i, :, radius:-radius, radius:-radius], expected[:, radius:-radius, radius:-radius], atol=1e-5, rtol=0)
    assert (blurred - x).abs().mean() > 0.05 and blurred[0].sub(x[0]).abs().mean() < blurred[2].sub(x[2]).abs().mean()


def test_the_datamodules_batch_is_the_cpu_views_batch():
    # The same seeds, the same images, the same normalisation: the CPU batch within interpolation tolerance.
    batches = []
    for on_device in (False, True):
        dm = SyntheticDataModule(num_samples=16, num_test_samples=0, img_size=32, batch_size=8, num_workers=0, mean=(0.4, 0.5, 0.6),
                                 std=(0.2, 0.25, 0.3), views=TwoViews(on_device=on_device, jitter_p=0.0, blur_p=(0.0, 0.0)))
        dm.setup()
        batch = next(iter(dm.train_dataloader()))
        if on_device:  # drawn from the samples' seeds: the same again
            again = next(iter(dm.train_dataloader()))[0]
            assert all(torch.equal(batch[0][k], again[k]) for k in batch[0])
        batches.append(dm.on_after_batch_transfer(batch, 0))
    (cpu, labels), (device, device_labels) = batches
    assert torch.equal(labels, device_labels) and [v.shape for v in cpu] == [v.shape for v in device] == [(8, 3, 32, 32)] * 2
    for a, b in zip(cpu, device):
        assert (a - b).abs().mean() < 0.1  # normalised units (1/std: 3-5 per unit of [0, 1])
        assert (a.mean() - b.mean()).abs() < 0.02


@pytest.mark.parametrize("method", ["dino", "mocov3"])
def test_a_fit_with_views_on_the_device(method):
    if method == "dino":
        views, sizes = MultiCrop(local_size=8, n_local_crops=2, on_device=True), [16, 16, 8, 8]
        model = DINO(backbone="vit", backbone_kwargs=dict(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2),
                     out_dim=64, hidden_dim=32, bottleneck_dim=16, warmup_epochs=0.0)
    else:
        views, sizes = TwoViews(on_device=True), [16, 16]
        model = MoCoV3(backbone="vit", backbone_kwargs=dict(img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=1, num_heads=2),
                       proj_hidden_dim=32, pred_hidden_dim=32, proj_output_dim=16, warmup_epochs=0.0)
    chans = 1 if method == "dino" else 3
    dm = SyntheticDataModule(num_samples=16, num_test_samples=0, img_size=16, in_chans=chans, batch_size=4, num_workers=0, views=views)
    seen, step = [], model.step
    model.step = lambda views, labels: seen.append([tuple(v.shape) for v in views]) or step(views, labels)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2 and seen == [[(4, chans, s, s) for s in sizes]] * 2
    assert math.isfinite(trainer.callback_metrics["train/loss"])


def test_the_benchmarks_worker_row_times_each_worker():
    cfg = dataclasses.replace(bench.PRESETS["tiny"], data_seconds=0.02)
    out = {impl: bench.worker_job(cfg, impl) for impl in ("device", "ours", "peer")}
    assert all(o["ms_per_image"] > 0 for o in out.values())
    # the device's half (timed on CUDA only; here on the CPU): a batch of method_batch images
    timed = bench.device_views_time(cfg, MultiCrop(**cfg.multicrop, on_device=True), bench._jpegs(cfg, 2), torch.device("cpu"))
    assert timed["device_ms_per_batch"] > 0 and timed["device_batch"] == cfg.method_batch
    jpeg = Image.open(io.BytesIO(bench._jpegs(cfg, 1)[0]))
    assert (jpeg.format, jpeg.size) == ("JPEG", bench.JPEG_SIZE)
    row = {"name": "worker", "transform": "MultiCrop", "methods": "dino", "peer_name": "DINOTransform", **out, "ours_ratio": 0.1, "peer_ratio": 0.05}
    result = {"config": dataclasses.asdict(cfg), "rows": [], "data": [row]}
    assert "device views CPU ms/img" in bench.worker_table(result)
    assert bench.targets(result) == [("worker CPU time per image with device views <= 0.20x MultiCrop's: 0.100x", True)]
