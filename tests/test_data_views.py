"""View transforms, augmentation primitives and the IDX reader."""

from __future__ import annotations

import gzip
import random
import struct

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

from ssl_vit.data import (
    EvalTransform,
    MultiCrop,
    SingleView,
    TwoViews,
    read_idx,
    read_idx_images_labels,
)
from ssl_vit.data.augment import adjust_hue, to_pil


def _rgb_image(size: int = 32, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


def _grey_image(size: int = 28, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8), "L")


# -- IDX ------------------------------------------------------------------------------------


def _idx_bytes(array: np.ndarray) -> bytes:
    # Written out by hand from the format description: 0x00 0x00, type 0x08 (ubyte), ndim, sizes.
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


@pytest.mark.parametrize("compress", [False, True])
def test_idx_reader_on_tiny_files(tmp_path, compress):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 4, 3), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    suffix = ".gz" if compress else ""
    write = gzip.compress if compress else (lambda b: b)
    (tmp_path / f"img{suffix}").write_bytes(write(_idx_bytes(images)))
    (tmp_path / f"lab{suffix}").write_bytes(write(_idx_bytes(labels)))
    got = read_idx(tmp_path / f"img{suffix}")
    assert got.shape == (5, 4, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, images)
    imgs, labs = read_idx_images_labels(tmp_path / f"img{suffix}", tmp_path / f"lab{suffix}")
    np.testing.assert_array_equal(labs, labels.astype(np.int64))
    assert labs.dtype == np.int64


def test_idx_reader_rejects_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):  # a missing file is missing, not "corrupt"
        read_idx(tmp_path / "train-images-idx3-ubyte.gz")
    good = _idx_bytes(np.zeros((2, 3, 3), dtype=np.uint8))
    (tmp_path / "bad_magic").write_bytes(b"\x12\x34" + good[2:])
    with pytest.raises(ValueError, match="magic"):
        read_idx(tmp_path / "bad_magic")
    (tmp_path / "no_dims").write_bytes(b"\x00\x00\x08\x00\x05")  # zero dimensions: no IDX file either
    with pytest.raises(ValueError, match="magic"):
        read_idx(tmp_path / "no_dims")
    (tmp_path / "truncated").write_bytes(good[:-4])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "truncated")
    (tmp_path / "labels").write_bytes(_idx_bytes(np.zeros(4, dtype=np.uint8)))
    with pytest.raises(ValueError, match=r"expected unsigned-byte images \[N, H, W\] and labels \[N\], got uint8 \[4\] / uint8 \[4\]"):
        read_idx_images_labels(tmp_path / "labels", tmp_path / "labels")
    (tmp_path / "broken.gz").write_bytes(gzip.compress(good)[:20])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        read_idx(tmp_path / "broken.gz")
    (tmp_path / "img").write_bytes(good)
    with pytest.raises(ValueError, match="2 images but .* 4 labels"):
        read_idx_images_labels(tmp_path / "img", tmp_path / "labels")
    # labels of another element type (0x0B: big-endian int16) are not Fashion-MNIST's
    header = bytes([0, 0, 0x0B, 1]) + struct.pack(">I", 2)
    (tmp_path / "labels16").write_bytes(header + np.array([1, 2], dtype=">i2").tobytes())
    with pytest.raises(ValueError, match="expected unsigned-byte images .*, got uint8 \\[2, 3, 3\\] / int16 \\[2\\]"):
        read_idx_images_labels(tmp_path / "img", tmp_path / "labels16")
    # gzip is told by its magic bytes, whatever the file is called
    (tmp_path / "IMG.GZ").write_bytes(gzip.compress(good))
    (tmp_path / "renamed").write_bytes(gzip.compress(good))
    assert read_idx(tmp_path / "IMG.GZ").shape == read_idx(tmp_path / "renamed").shape == (2, 3, 3)


# -- view transforms --------------------------------------------------------------------------


@pytest.mark.parametrize("make_image", [_grey_image, _rgb_image])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_multicrop_views(make_image, as_tensor):
    img = make_image(28)
    chans = 1 if img.mode == "L" else 3
    if as_tensor:
        arr = np.asarray(img)
        img = torch.from_numpy((arr[None] if chans == 1 else arr.transpose(2, 0, 1)).copy())
    views = MultiCrop(global_size=28, local_size=12, n_local_crops=5)(img)
    assert len(views) == 7
    assert [tuple(v.shape) for v in views] == [(chans, 28, 28)] * 2 + [(chans, 12, 12)] * 5
    for v in views:
        assert v.dtype == torch.float32 and v.min() >= 0 and v.max() <= 1


def test_multicrop_defaults_follow_dino():
    mc = MultiCrop().with_img_size(224)
    assert (mc.global_size, mc.resolved_local_size, mc.n_local_crops, mc.n_global_crops) == (224, 96, 8, 2)
    assert mc.num_views == 10
    assert MultiCrop(global_size=28).resolved_local_size == 12
    # blur sigma (0.1, 2.0) px at 224 px (DINO), scaled with the resolution.
    assert mc.augmentations()[0].blur_sigma == pytest.approx((0.1, 2.0))
    assert MultiCrop(global_size=28).augmentations()[0].blur_sigma == pytest.approx((0.0125, 0.25))
    probs = [(r.blur_p, r.solarize_p) for r in mc.augmentations()]
    assert probs[:3] == [(1.0, 0.0), (0.1, 0.2), (0.5, 0.0)]


def test_the_colour_jitter_reaching_each_view_is_the_references():
    # MoCo v3 main_moco.py and DINO main_dino.py: RandomApply([ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
    # RandomGrayscale(p=0.2), for every view; jitter is (brightness, contrast, saturation, hue).
    for transform in (TwoViews().with_img_size(32), MultiCrop().with_img_size(32)):
        for augmentation in transform.augmentations():
            assert (augmentation.jitter, augmentation.jitter_p, augmentation.grayscale_p) == ((0.4, 0.4, 0.2, 0.1), 0.8, 0.2)


def test_colour_jitter_comes_before_grayscale():
    # Both references jitter first, then (maybe) turn grey: a grey view still carries the
    # brightness the hue shift gave its colours. Pure red, hue jitter 0.5, always grey: many grey levels.
    from ssl_vit.data.views import Augmentation

    augmentation = Augmentation(8, (1.0, 1.0), "bilinear", flip_p=0.0, jitter_p=1.0, jitter=(0.0, 0.0, 0.0, 0.5), grayscale_p=1.0)
    red = Image.new("RGB", (8, 8), (255, 0, 0))
    random.seed(0)
    levels = {augmentation(red)[0].getpixel((4, 4))[0] for _ in range(100)}
    assert len(levels) > 20  # grey first: red's one luma (76), whatever the hue does


def test_two_views_and_single_view_shapes():
    img = _rgb_image(40)
    views = TwoViews(size=32)(img)
    assert [tuple(v.shape) for v in views] == [(3, 32, 32)] * 2
    augmentations = TwoViews(size=32).augmentations()
    assert [(a.blur_p, a.solarize_p) for a in augmentations] == [(1.0, 0.0), (0.1, 0.2)]  # MoCo v3's asymmetry
    assert [tuple(v.shape) for v in SingleView(size=24)(img)] == [(3, 24, 24)]


def test_an_image_of_the_evaluation_size_is_kept_as_it_is():
    img = _grey_image(28)
    expected = torch.from_numpy(np.asarray(img).astype(np.float32) / 255.0)[None]  # [1, 28, 28]
    torch.testing.assert_close(EvalTransform(28)(img), expected)
    (view,) = SingleView(size=28, augment=False)(img)  # (its evaluation geometry)
    torch.testing.assert_close(view, expected)


def test_rand_augment_follows_the_crop_and_flip_with_its_own_draws():
    # SingleView(rand_augment=(ops, magnitude)): crop + flip (Python's random), then RandAugment
    # (torch's generator) on that crop, filling with mid-grey: written out with torchvision's op.
    from torchvision.transforms import RandAugment

    def randaugment(cropped: Image.Image, fill: int) -> torch.Tensor:
        return TF.to_dtype(TF.pil_to_tensor(RandAugment(num_ops=2, magnitude=9, fill=fill)(cropped)), torch.float32, scale=True)

    fill_shows = 0
    for seed, img in enumerate([_rgb_image(40), _grey_image(40)] + [_random_rgb(40, 40)] * 8):
        random.seed(seed)
        torch.manual_seed(seed)
        (got,) = SingleView(size=32, scale=(0.5, 1.0), rand_augment=(2, 9))(img)
        random.seed(seed)
        torch.manual_seed(seed)
        cropped, _ = SingleView(size=32, scale=(0.5, 1.0)).augmentations()[0](img)
        state = torch.get_rng_state()
        torch.testing.assert_close(got, randaugment(cropped, fill=128))
        torch.set_rng_state(state)
        fill_shows += not torch.equal(got, randaugment(cropped, fill=0))  # a geometric op's uncovered pixels
    assert fill_shows >= 1
    changed = 0
    for seed in range(10):  # the ops change the crop (an identity op can be drawn, not ten times)
        random.seed(seed)
        torch.manual_seed(seed)
        (a,) = SingleView(size=32, scale=(0.5, 1.0), rand_augment=(2, 9))(_rgb_image(40))
        random.seed(seed)
        (b,) = SingleView(size=32, scale=(0.5, 1.0))(_rgb_image(40))
        changed += not torch.equal(a, b)
    assert changed >= 5
    for bad in ((0, 9), (2, 31), (2,)):
        with pytest.raises(ValueError, match="rand_augment must be \\(ops, magnitude\\)"):
            SingleView(size=8, rand_augment=bad)


def test_views_on_grey_images_never_colourise():
    # Colour jitter and grayscale on grey input (both as "L" and as equal RGB channels).
    random.seed(0)
    grey = _grey_image(28)
    for _ in range(20):
        for v in TwoViews(size=28)(grey):
            assert v.shape[0] == 1
    # As RGB, grey stays grey up to the hue table's rounding (1 level, amplified by at most
    # contrast x brightness x saturation); a real hue error would be tens of levels.
    grey_rgb = grey.convert("RGB")
    spread = np.ptp(np.asarray(adjust_hue(grey_rgb, 0.1)).astype(int), axis=-1)
    assert spread.max() <= 1
    for _ in range(20):
        for v in TwoViews(size=28, jitter_p=1.0)(grey_rgb):
            assert v.shape[0] == 3
            assert (v.max(0).values - v.min(0).values).max() <= 4 / 255


def test_solarize_and_float_conversion_exact():
    # A constant image through crops/flips stays constant; solarisation maps v >= 128 to 255 - v.
    img = Image.new("L", (28, 28), 200)
    mc = MultiCrop(global_size=28, n_local_crops=1, jitter_p=0.0, blur_p=(0.0, 0.0, 0.0), solarize_p=1.0)
    v1, v2, local = mc(img)
    torch.testing.assert_close(v1, torch.full_like(v1, 200 / 255))
    torch.testing.assert_close(v2, torch.full_like(v2, 55 / 255))
    torch.testing.assert_close(local, torch.full_like(local, 200 / 255))


def test_hue_shift_matches_torchvision():
    # Reference: torchvision's float adjust_hue, with the shift rounded to 1/255 turn as ours is.
    img = _rgb_image(48, seed=3)
    x = torch.from_numpy(np.asarray(img).transpose(2, 0, 1).copy()).float() / 255
    for shift in (-0.1, -0.03, 0.05, 0.1, 0.4):
        ref = TF.adjust_hue(x, round(shift * 255) / 255) * 255
        got = torch.from_numpy(np.asarray(adjust_hue(img, shift)).transpose(2, 0, 1).copy()).float()
        diff = (ref - got).abs()
        assert diff.mean() < 1.0 and diff.max() <= 6.0, (shift, diff.mean(), diff.max())
    assert adjust_hue(img, 0.0) is img


def test_size_binding_and_errors():
    with pytest.raises(ValueError, match="global_size is not set"):
        MultiCrop()(_grey_image())
    with pytest.raises(ValueError, match="img_size=28"):
        MultiCrop(global_size=32).with_img_size(28)
    assert TwoViews().with_img_size(28).size == 28
    with pytest.raises(ValueError, match="probability"):
        TwoViews(size=28, jitter_p=1.5)
    with pytest.raises(ValueError, match="scale"):
        SingleView(size=8, scale=(0.5, 0.2))
    with pytest.raises(ValueError, match="scale"):
        SingleView(scale=(0.5, 0.2)).with_img_size(8)  # (a datamodule fills the size: checked there)


@pytest.mark.parametrize(("shape", "crop_pct", "short"),
                         [((60, 40), 0.875, 18), ((40, 30), 0.5, 32), ((30, 41), 0.875, 18), ((16, 22), 0.875, 18), ((22, 16), 0.875, 18)])
def test_eval_transform_resize_and_centre_crop_matches_torchvision(shape, crop_pct, short):
    # Reference: torchvision's Resize(short side) + CenterCrop on the same PIL image; the long
    # side truncated as torchvision does (40x30 at short 32: 42, not round(42.67) = 43). A
    # non-square image whose short side is already the size (16x22) is resized too, as timm does.
    img = _rgb_image(64).resize(shape)
    out = EvalTransform(16, crop_pct=crop_pct)(img)  # short side -> floor(16 / crop_pct)
    ref = TF.center_crop(TF.resize(img, short, interpolation=TF.InterpolationMode.BICUBIC), [16, 16])
    expected = torch.from_numpy(np.asarray(ref).transpose(2, 0, 1).copy()).float() / 255
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("fmt", [None, "PNG", "PPM", "TIFF"])
def test_16_bit_grey_images_are_scaled_to_8_bits_not_clipped(fmt, tmp_path):
    # Pillow opens a 16-bit PNG / TIFF as "I;16" and a 16-bit PGM as "I": both scaled, neither
    # clipped at 255 (None: the image as Pillow makes it from a uint16 array).
    ramp = (np.arange(1024, dtype=np.uint32).reshape(32, 32) * 60).astype(np.uint16)  # 0 .. 61380
    if fmt is None:
        grey = to_pil(Image.fromarray(ramp))
    else:
        Image.fromarray(ramp).save(tmp_path / f"ramp.{fmt.lower()}", fmt)
        with Image.open(tmp_path / f"ramp.{fmt.lower()}") as opened:
            grey = to_pil(opened)
    assert grey.mode == "L"
    np.testing.assert_array_equal(np.asarray(grey), (ramp >> 8).astype(np.uint8))
    assert to_pil(Image.new("LA", (4, 4))).mode == "L"  # grey with alpha stays grey


def test_crop_scales_jitter_rate_and_local_crop_sizes_are_checked_and_kept():
    for bad in ((0.0, 1.0), (0.5, 1.5)):
        with pytest.raises(ValueError, match="0 < min <= max <= 1"):
            SingleView(size=8, scale=bad)
    with pytest.raises(ValueError, match="must not exceed"):
        MultiCrop(global_size=16, local_size=24)
    # DINO's 96/224 of the global size, to the nearest multiple of 4 (64 px: 27.4 -> 28, 128 px: 54.9 -> 56)
    assert [MultiCrop(global_size=g).resolved_local_size for g in (64, 128, 16)] == [28, 56, 8]
    # colour jitter applied with the references' p = 0.8: counted over many views
    import ssl_vit.data.views as views_module

    calls = []
    original = views_module.apply_jitter
    views_module.apply_jitter = lambda img, *args: calls.append(1) or original(img, *args)
    try:
        random.seed(0)
        augmentation = TwoViews(size=8).augmentations()[0]
        for _ in range(2000):
            augmentation(_rgb_image(8))
    finally:
        views_module.apply_jitter = original
    assert len(calls) / 2000 == pytest.approx(0.8, abs=0.03)
    # MoCo v3's crops resize bilinearly (torchvision's default), DINO's bicubically
    assert TwoViews(size=8).augmentations()[0].interpolation == "bilinear"
    assert MultiCrop(global_size=8, local_size=8).augmentations()[0].interpolation == "bicubic"


def test_a_view_transform_of_ones_own_as_its_docstring_writes_it():
    from ssl_vit.data.views import Augmentation, ViewTransform

    class ThreeCrops(ViewTransform):
        n_global_crops = 3

        def __init__(self, size: int = 16) -> None:
            self.size = size

        def augmentations(self) -> list[Augmentation]:
            return [Augmentation(self.size, (0.2, 1.0), "bicubic", flip_p=0.5) for _ in range(3)]

    views = ThreeCrops()(torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8))
    assert ThreeCrops().num_views == 3 and [tuple(v.shape) for v in views] == [(3, 16, 16)] * 3
    assert ThreeCrops().with_img_size(32).size == 16  # (no size argument named: the transform's own)
    assert all(0.0 <= float(v.min()) and float(v.max()) <= 1.0 for v in views)


def _random_rgb(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def test_uint8_tensor_is_read_as_c_h_w_like_torchvision_to_pil_image():
    # A non-square [C, H, W] tensor: a transposed read would give a [W, H] image.
    for c in (1, 3):
        t = torch.randint(0, 256, (c, 5, 7), generator=torch.Generator().manual_seed(c), dtype=torch.uint8)
        want = np.asarray(TF.to_pil_image(t))
        got = np.asarray(to_pil(t))
        assert got.shape == want.shape == ((5, 7) if c == 1 else (5, 7, 3))
        assert np.array_equal(got, want)


def test_unaugmented_single_view_uses_its_interpolation_like_torchvision_resize_centre_crop():
    from torchvision.transforms import InterpolationMode

    img = _random_rgb(40, 40)
    for mode, tv_mode in (("bilinear", InterpolationMode.BILINEAR), ("bicubic", InterpolationMode.BICUBIC)):
        (got,) = SingleView(size=16, augment=False, interpolation=mode)(img)
        want = TF.center_crop(TF.resize(img, 18, interpolation=tv_mode), 16)  # 18 = floor(16 / 0.875)
        want = TF.to_dtype(TF.pil_to_tensor(want), torch.float32, scale=True)
        torch.testing.assert_close(got, want)


def test_rand_augment_takes_every_magnitude_torchvision_has():
    from torchvision.transforms import RandAugment

    top = RandAugment().num_magnitude_bins - 1  # 30: torchvision's (and timm's) magnitude scale
    for m in (0, 10, 15, top):
        view = SingleView(size=8, rand_augment=(2, m))
        assert view.rand_augment == (2, m)
        assert view.augmentations()[0]._rand_augment.magnitude == m
    with pytest.raises(ValueError, match="rand_augment"):
        SingleView(size=8, rand_augment=(2, top + 1))
