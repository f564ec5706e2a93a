"""The augmentation primitives and view recipes against independent references: torchvision's
RandomResizedCrop / ColorJitter semantics, Pillow's ImageEnhance, ImageOps.solarize and
ImageFilter.GaussianBlur, and formulas written out here (ITU-R 601 luma, HSV hue rotation, the
variance of a Gaussian). Statistical checks are seeded and use wide margins."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as TF
from PIL import Image, ImageFilter, ImageOps

from ssl_vit.data import MultiCrop, SingleView, TwoViews, augment
from ssl_vit.data.augment import (
    CROP_RATIO,
    apply_jitter,
    draw_jitter,
    gaussian_blur,
    random_resized_crop_box,
    to_float_tensor,
)
from ssl_vit.data.views import Augmentation

# The strengths of BYOL's / DINO's colour jitter; torchvision turns them into these ranges.
JITTER = (0.4, 0.4, 0.2, 0.1)
TV_JITTER = T.ColorJitter(*JITTER)


def _rgb(width: int = 32, height: int | None = None, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height or width, width, 3), dtype=np.uint8), "RGB")


def _u8(view: torch.Tensor) -> np.ndarray:
    # float view [C, H, W] in [0, 1] -> uint8 [H, W, C]
    return (view * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    # Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs.
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def _ks_uniform(x: np.ndarray, lo: float, hi: float) -> float:
    # One-sample KS statistic against U(lo, hi).
    x = np.sort(x)
    cdf = np.clip((x - lo) / (hi - lo), 0.0, 1.0)
    n = len(x)
    return float(max((np.arange(1, n + 1) / n - cdf).max(), (cdf - np.arange(n) / n).max()))


def _blur_sigma_of(profile: np.ndarray) -> float:
    # Standard deviation of a blurred line impulse (a Gaussian of std sigma has variance sigma^2).
    x = np.arange(len(profile)) - len(profile) // 2
    return math.sqrt(float((profile * x**2).sum() / profile.sum()))


def _line_image(n: int = 41) -> Image.Image:
    arr = np.zeros((n, n), dtype=np.uint8)
    arr[:, n // 2] = 255
    return Image.fromarray(arr, "L")


# -- random resized crop ----------------------------------------------------------------------


@pytest.mark.parametrize(("width", "height", "scale"), [(256, 256, (0.2, 0.6)), (64, 48, (0.08, 1.0))])
def test_crop_box_distribution_matches_torchvision_get_params(width, height, scale):
    """torchvision RandomResizedCrop.get_params: area ~ U(scale), log aspect ~ U(log 3/4, log 4/3)."""
    n = 3000
    random.seed(0)
    ours = []
    for _ in range(n):
        left, top, right, bottom = random_resized_crop_box(width, height, scale)
        ours.append((top, left, bottom - top, right - left))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        img = torch.zeros(1, height, width)
        ref = [T.RandomResizedCrop.get_params(img, list(scale), list(CROP_RATIO)) for _ in range(n)]
    ours_a, ref_a = np.array(ours, dtype=float), np.array(ref, dtype=float)

    def stats(b):  # (area fraction, log aspect w/h, top / free rows, left / free columns)
        top, left, h, w = b.T
        with np.errstate(divide="ignore", invalid="ignore"):
            return w * h / (width * height), np.log(w / h), top / (height - h), left / (width - w)

    for name, a, r in zip(("area", "log aspect", "top", "left"), stats(ours_a), stats(ref_a)):
        a, r = a[np.isfinite(a)], r[np.isfinite(r)]
        assert _ks(a, r) < 0.06, (name, _ks(a, r))
    area, log_aspect, _, _ = stats(ours_a)
    if scale == (0.2, 0.6):  # no draw falls back to the central crop: the sampler itself
        # the scale bounds are honoured (up to the rounding of w and h) and reached at both ends
        assert area.min() >= scale[0] - 0.01 and area.max() <= scale[1] + 0.01
        assert area.min() < scale[0] + 0.01 and area.max() > scale[1] - 0.01
        # two-sided aspect ratio: wide and tall boxes alike, up to 4/3 and down to 3/4
        lo, hi = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
        assert log_aspect.min() >= lo - 0.02 and log_aspect.max() <= hi + 0.02
        assert log_aspect.min() < lo + 0.03 and log_aspect.max() > hi - 0.03
        assert (log_aspect > math.log(1.2)).mean() > 0.1 and (log_aspect < -math.log(1.2)).mean() > 0.1
        assert _ks_uniform(log_aspect, lo, hi) < 0.06
        assert _ks_uniform(area, *scale) < 0.06


@pytest.mark.parametrize(("width", "height"), [(100, 10), (10, 100)])
def test_crop_box_fallback_matches_torchvision(width, height):
    """torchvision RandomResizedCrop.get_params: after 10 misses, the centre crop clipped to the ratio."""
    random.seed(0)
    left, top, right, bottom = random_resized_crop_box(width, height, (0.9, 1.0))
    ref = T.RandomResizedCrop.get_params(torch.zeros(1, height, width), [0.9, 1.0], list(CROP_RATIO))
    assert (top, left, bottom - top, right - left) == ref


# -- colour jitter ----------------------------------------------------------------------------


def _recover_brightness(img_out: np.ndarray) -> float:
    return img_out[0, 0, 0] / 100.0  # a flat grey 100 image times the factor


def _recover_contrast(img_out: np.ndarray) -> float:
    return (int(img_out[0, 1, 0]) - int(img_out[0, 0, 0])) / 100.0  # halves 50 / 150 about mean 100


def _recover_saturation(img_out: np.ndarray) -> float:
    # (200, 100, 50): ITU-R 601 luma 0.299 * 200 + 0.587 * 100 + 0.114 * 50 = 124.2 -> 124
    return (int(img_out[0, 0, 0]) - 124) / 76.0


def _recover_hue(img_out: np.ndarray) -> float:
    # Pure red rotated by s turns (|s| <= 1/6): (255, 6 * 255 * s, 0) for s > 0, (255, 0, -6 * 255 * s) below.
    return (int(img_out[0, 0, 1]) - int(img_out[0, 0, 2])) / (6 * 255.0)


_FLAT = {
    "brightness": np.full((2, 2, 3), 100, np.uint8),
    "contrast": np.array([[[50] * 3, [150] * 3]], np.uint8),
    "saturation": np.full((2, 2, 3), (200, 100, 50), np.uint8),
    "hue": np.full((2, 2, 3), (255, 0, 0), np.uint8),
}


@pytest.mark.parametrize(
    ("op", "recover"),
    [("brightness", _recover_brightness), ("contrast", _recover_contrast),
     ("saturation", _recover_saturation), ("hue", _recover_hue)],
)
def test_jitter_factors_are_two_sided_uniform_as_torchvision(op, recover):
    """torchvision ColorJitter(0.4, 0.4, 0.2, 0.1): factors ~ U(1 - s, 1 + s), hue shift ~ U(-0.1, 0.1)."""
    lo, hi = getattr(TV_JITTER, op)
    strengths = {name: (s if name == op else 0.0) for name, s in zip(_FLAT, JITTER)}
    img = Image.fromarray(_FLAT[op], "RGB")
    random.seed(1)
    factors = np.array([recover(np.asarray(apply_jitter(img, draw_jitter(**strengths)))) for _ in range(1000)])
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    assert factors.min() >= lo - 0.02 and factors.max() <= hi + 0.02
    assert factors.min() < lo + 0.1 * half and factors.max() > hi - 0.1 * half  # both ends reached
    assert 0.35 < (factors < mid).mean() < 0.65  # as often below 1 (or 0 for hue) as above
    assert _ks_uniform(factors, lo, hi) < 0.08


def test_jitter_applies_the_four_ops_in_a_random_order():
    """torchvision ColorJitter.get_params: fn_idx = torch.randperm(4), a fresh order every call, applied in that order."""
    random.seed(2)
    orders = Counter(tuple(op for op, _ in draw_jitter(*JITTER)) for _ in range(960))
    assert all(sorted(order) == [0, 1, 2, 3] for order in orders)
    assert len(orders) == 24  # every permutation occurs, each about 960 / 24 = 40 times
    assert min(orders.values()) > 15 and max(orders.values()) < 70
    # saturation, brightness, contrast (which do not commute), one after the other as drawn
    img, ops = _rgb(16, seed=3), [(2, 1.8), (0, 0.6), (1, 1.4)]
    want = np.asarray(TF.adjust_contrast(TF.adjust_brightness(TF.adjust_saturation(img, 1.8), 0.6), 1.4))
    np.testing.assert_array_equal(np.asarray(apply_jitter(img, ops)), want)
    assert not np.array_equal(np.asarray(apply_jitter(img, ops[::-1])), want)


@pytest.mark.parametrize("factor", [0.0, 0.5, 1.0, 1.7])
@pytest.mark.parametrize("op", ["brightness", "contrast", "saturation"])
def test_enhance_ops_match_torchvisions_on_pil_images(op, factor):
    """torchvision's adjust_brightness / adjust_contrast / adjust_saturation on a PIL image (the
    path of DINO's and MoCo v3's ColorJitter)."""
    index = ("brightness", "contrast", "saturation").index(op)
    reference = getattr(TF, f"adjust_{op}")
    for img in (_rgb(24, 20, seed=4), _rgb(24, 20, seed=4).convert("L")):
        np.testing.assert_array_equal(np.asarray(apply_jitter(img, [(index, factor)])), np.asarray(reference(img, factor)))


def test_saturation_factor_one_is_identity_and_zero_is_greyscale():
    """ImageEnhance.Color: factor 1 the original, 0 the ITU-R 601 luma L = (299 R + 587 G + 114 B) / 1000."""
    img = _rgb(16, seed=5)
    np.testing.assert_array_equal(np.asarray(apply_jitter(img, [(2, 1.0)])), np.asarray(img))
    rgb = np.asarray(img).astype(float)
    luma = rgb @ np.array([0.299, 0.587, 0.114])
    grey = np.asarray(apply_jitter(img, [(2, 0.0)])).astype(float)
    assert np.abs(grey - luma[..., None]).max() <= 1.0
    # and 2 pushes away from grey: the chroma doubles
    more = np.asarray(apply_jitter(img, [(2, 2.0)])).astype(float)
    ok = (2 * rgb - grey > 0).all(-1) & (2 * rgb - grey < 255).all(-1)
    assert np.abs(more - (2 * rgb - grey))[ok].max() <= 1.0


# -- solarisation and blur --------------------------------------------------------------------


def test_solarize_matches_pillow_imageops_at_threshold_128():
    """ImageOps.solarize(img, 128): 127 kept, 128 -> 127, 255 -> 0 (DINO / BYOL solarisation)."""
    grey = Image.fromarray(np.arange(256, dtype=np.uint8).reshape(16, 16), "L")
    rgb = Image.fromarray((np.random.default_rng(6).permutation(768) % 256).reshape(16, 16, 3).astype(np.uint8), "RGB")
    small = _rgb(8, seed=7)
    out = [to_float_tensor(img, solarize) for img, solarize in ((grey, False), (small, False), (grey, True), (rgb, True))]
    np.testing.assert_array_equal(_u8(out[0])[..., 0], np.asarray(grey))
    np.testing.assert_array_equal(_u8(out[1]), np.asarray(small))
    np.testing.assert_array_equal(_u8(out[2])[..., 0], np.asarray(ImageOps.solarize(grey, 128)))
    np.testing.assert_array_equal(_u8(out[3]), np.asarray(ImageOps.solarize(rgb, 128)))
    flat = _u8(out[2])[..., 0].reshape(-1)
    assert (flat[127], flat[128], flat[255], flat[0]) == (127, 127, 0, 0)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 3.5])
def test_gaussian_blur_radius_is_sigma(sigma):
    """DINO / MoCo v3 GaussianBlur: PIL ImageFilter.GaussianBlur(radius=sigma), sigma the std dev."""
    line = _line_image()
    got = gaussian_blur(line, sigma)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(line.filter(ImageFilter.GaussianBlur(radius=sigma))))
    rgb = _rgb(20, seed=8)
    np.testing.assert_array_equal(
        np.asarray(gaussian_blur(rgb, sigma)), np.asarray(rgb.filter(ImageFilter.GaussianBlur(radius=sigma)))
    )
    # the blurred line's spread is sigma (the variance of a Gaussian is sigma^2)
    profile = np.asarray(got).astype(float)[20]
    assert _blur_sigma_of(profile) == pytest.approx(sigma, rel=0.1)


# -- augmentation chains ---------------------------------------------------------------------


def test_flip_p_one_mirrors_and_zero_keeps_the_image():
    """torchvision RandomHorizontalFlip(p): p = 1 always mirrors (crop of scale 1 on a square = whole image)."""
    img = _rgb(32, seed=9)
    random.seed(3)
    for _ in range(5):
        (kept,) = SingleView(size=32, scale=(1.0, 1.0), flip_p=0.0)(img)
        (flipped,) = SingleView(size=32, scale=(1.0, 1.0), flip_p=1.0)(img)
        np.testing.assert_array_equal(_u8(kept), np.asarray(img))
        np.testing.assert_array_equal(_u8(flipped), np.asarray(TF.horizontal_flip(img)))
        np.testing.assert_array_equal(_u8(flipped), np.asarray(img)[:, ::-1])


def _plain(cls, **kw):
    # every random op off except the ones kw switches on; whole-image crops of a square image
    base = dict(scale=(1.0, 1.0), flip_p=0.0, jitter_p=0.0, grayscale_p=0.0)
    if cls is TwoViews:
        base.update(size=32, blur_p=(0.0, 0.0), solarize_p=(0.0, 0.0))
    else:
        base = dict(global_size=32, local_size=32, n_local_crops=1, global_scale=(1.0, 1.0), local_scale=(1.0, 1.0),
                    flip_p=0.0, jitter_p=0.0, grayscale_p=0.0, blur_p=(0.0, 0.0, 0.0), solarize_p=0.0)
    return cls(**{**base, **kw})


def test_grayscale_p_one_gives_equal_channels_of_luma():
    """torchvision RandomGrayscale(p) with 3 output channels: L = 0.299 R + 0.587 G + 0.114 B, replicated."""
    img = _rgb(32, seed=10)
    luma = np.asarray(img).astype(float) @ np.array([0.299, 0.587, 0.114])
    random.seed(4)
    for view in _plain(TwoViews, grayscale_p=1.0)(img):
        out = _u8(view)
        assert out.shape == (32, 32, 3)
        np.testing.assert_array_equal(out, np.asarray(TF.rgb_to_grayscale(img, num_output_channels=3)))
        assert np.abs(out.astype(float) - luma[..., None]).max() <= 1.0
    for view in _plain(TwoViews, grayscale_p=0.0)(img):
        np.testing.assert_array_equal(_u8(view), np.asarray(img))


@pytest.mark.parametrize(
    ("cls", "blur_p"),
    [(TwoViews, (1.0, 0.0)), (TwoViews, (0.0, 1.0)),
     (MultiCrop, (1.0, 0.0, 0.0)), (MultiCrop, (0.0, 1.0, 0.0)), (MultiCrop, (0.0, 0.0, 1.0))],
)
def test_blur_probability_is_per_view(cls, blur_p):
    """BYOL Table 6 / MoCo v3 / DINO: blur p 1.0 on view 1 and 0.1 on view 2 (0.5 on local crops)."""
    img = _rgb(32, seed=11)
    blurred = np.asarray(img.filter(ImageFilter.GaussianBlur(radius=1.5)))
    random.seed(5)
    for _ in range(3):
        views = _plain(cls, blur_p=blur_p, blur_sigma=(1.5, 1.5))(img)
        assert len(views) == len(blur_p)
        for view, p in zip(views, blur_p):
            np.testing.assert_array_equal(_u8(view), blurred if p == 1.0 else np.asarray(img))


def test_blur_sigma_is_drawn_from_its_range_each_time():
    """DINO / MoCo v3 GaussianBlur: sigma ~ U(sigma_min, sigma_max) drawn afresh for every view."""
    line = _line_image()
    random.seed(6)
    tv = TwoViews(size=41, scale=(1.0, 1.0), flip_p=0.0, jitter_p=0.0, grayscale_p=0.0,
                  blur_p=(1.0, 1.0), blur_sigma=(0.5, 3.0), solarize_p=(0.0, 0.0))
    sigmas = np.array([_blur_sigma_of(v[0, 20].numpy()) for _ in range(30) for v in tv(line)])
    assert sigmas.min() > 0.4 and sigmas.max() < 3.3
    assert sigmas.min() < 0.9 and sigmas.max() > 2.6
    assert len(np.unique(sigmas.round(3))) > 30


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
def test_view_is_the_sampled_box_cropped_and_resized(interpolation):
    """torchvision RandomResizedCrop: resized_crop(img, top, left, h, w, size) of the sampled box."""
    img = _rgb(48, 40, seed=12)
    mode = {"nearest": TF.InterpolationMode.NEAREST, "bilinear": TF.InterpolationMode.BILINEAR}[interpolation]
    augmentation = Augmentation(16, (0.1, 0.6), interpolation, flip_p=0.0)
    for seed in range(10):
        random.seed(seed)
        out, solarize = augmentation(img)
        random.seed(seed)  # the box is the augmentation's first draw
        left, top, right, bottom = random_resized_crop_box(48, 40, (0.1, 0.6))
        assert (right - left, bottom - top) != (48, 40)
        ref = np.asarray(TF.resized_crop(img, top, left, bottom - top, right - left, [16, 16], interpolation=mode))
        got = np.asarray(out)
        assert got.shape == (16, 16, 3) and not solarize
        np.testing.assert_array_equal(got, ref)  # (no pixel outside the box reaches the border)


def test_augmentations_use_their_scales_and_sizes():
    """DINO DataAugmentationDINO: global crops at global_crops_scale, local crops at local_crops_scale."""
    mc = MultiCrop(global_size=32, local_size=16, n_local_crops=3, global_scale=(0.5, 1.0), local_scale=(0.1, 0.3))
    assert [(r.size, r.scale) for r in mc.augmentations()] == [(32, (0.5, 1.0))] * 2 + [(16, (0.1, 0.3))] * 3
    default = MultiCrop(global_size=224).augmentations()
    assert [r.scale for r in default] == [(0.4, 1.0)] * 2 + [(0.05, 0.4)] * 8
    assert [r.scale for r in TwoViews(size=32, scale=(0.2, 0.9)).augmentations()] == [(0.2, 0.9)] * 2
    assert [r.scale for r in SingleView(size=32, scale=(0.3, 0.8)).augmentations()] == [(0.3, 0.8)]
    # and the local crops sample from local_scale: a 1/4 .. 1/2 side crop of a 64-px ramp image
    ramp = Image.fromarray(np.tile(np.arange(64, dtype=np.uint8) * 4, (64, 1)), "L")
    random.seed(7)
    views = MultiCrop(global_size=64, local_size=16, n_local_crops=40, global_scale=(1.0, 1.0),
                      local_scale=(0.05, 0.2), flip_p=0.0, jitter_p=0.0, blur_p=(0.0, 0.0, 0.0),
                      solarize_p=0.0)(ramp)
    spans = np.array([float(v[0, 8, -1] - v[0, 8, 0]) * 255 / 4 for v in views[2:]])  # columns covered
    assert spans.max() < 64 * math.sqrt(0.2 * 4 / 3) and spans.min() > 0.5 * 64 * math.sqrt(0.05 * 3 / 4)


def test_crop_box_tries_ten_times_and_takes_a_crop_as_wide_as_the_image(monkeypatch):
    # torchvision RandomResizedCrop.get_params: `for _ in range(10)`, accepting
    # `0 < w <= width and 0 < h <= height`, then the central crop. Scripted draws (area
    # fraction, log aspect ratio): nine tries far too wide, the tenth a 10 x 20 box of a 10 x 40 image.
    draws = [1.0, math.log(100.0)] * 9 + [0.5, math.log(0.5)]
    monkeypatch.setattr(augment.random, "uniform", lambda lo, hi: draws.pop(0))
    left, top, right, bottom = augment.random_resized_crop_box(10, 40, (0.08, 1.0))
    assert (right - left, bottom - top) == (10, 20) and not draws
    draws[:] = [1.0, math.log(100.0)] * 10  # ten failures: the central crop, clipped to the ratio range
    assert augment.random_resized_crop_box(10, 40, (0.08, 1.0)) == (0, 13, 10, 26)  # h = round(10 / (3/4)) = 13, top (40 - 13) // 2
