"""--decode-on-device: training JPEGs read by the loader workers and decoded, cropped, flipped and
colour-jittered on the device (accel_train/data/device_decode.py), checked on a CPU, where
`always` takes that path with the CPU's JPEG decoder (jpeg_decoders.py).

Oracles: the loader workers' path (timm's training transform on PIL images, `host_batch`) for
the same seed and position: the same labels, and pixels within the resizers' rounding (a
different crop, flip or jitter would differ by tens of levels); torchvision's own
`F.adjust_brightness/contrast/saturation`, image by image, for the batched colour jitter;
hand-made figures for the rule auto decides by.
"""

from __future__ import annotations

import io
import os
import shutil
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from PIL import Image, ImageDraw
from torchvision.transforms import functional as F

from accel_train.base.errors import UsageError
from accel_train.config import TrainConfig
from accel_train.data.decode import jpeg_header
from accel_train.data.device_decode import (DeviceDecoder, best_share, choose, flipped, jitter,
                                            time_paths)
from accel_train.data.jpeg_decoders import orient
from accel_train.data import held_photos
from accel_train.data.loaders import TrainImages, run_transforms, workers_rate
from accel_train.data.sources import ArraySource, ImageSource, load_data, spread
from accel_train.run.trainer_state import TrainerState
from accel_train.run.resume import keep_choices
from conftest import PINNED, accel_train_here

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 128


def _spec(size: int = SIZE) -> SimpleNamespace:
    return SimpleNamespace(image_size=size, mean=MEAN, std=STD, crop_pct=0.875,
                           crop_mode="center", interpolation="bicubic")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """12 JPEGs of 300-500 px a side in 2 classes (2 held out): smooth colour fields with
    sharp-edged shapes, so that a crop or a flip a pixel off shows."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for split, count in (("train", 6), ("val", 1)):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                height, width = rng.integers(300, 501, 2)
                coarse = rng.uniform(0, 255, (6, 8, 3)).astype(np.uint8)
                image = Image.fromarray(coarse).resize((int(width), int(height)),
                                                       Image.BICUBIC)
                draw = ImageDraw.Draw(image)
                for _ in range(5):
                    x, y = rng.integers(0, width), rng.integers(0, height)
                    draw.rectangle([x, y, x + 60, y + 40], fill=tuple(rng.integers(0, 256, 3)))
                image.save(root / split / label / f"{i}.jpg", quality=85)
    return root


def _dataset(root: Path, **options) -> TrainImages:
    config = TrainConfig(data_dir=str(root), in_memory="never", image_size=SIZE, **options)
    data = load_data(config)
    return TrainImages(data.train, run_transforms(config, _spec())[0], seed=11,
                       mark_replaced=True)


def garbled_jpeg(image: Image.Image) -> bytes:
    """`image` as a JPEG whose header reads (160x120) and whose data is noise after its first
    bytes: the device decoder refuses it, the host's PIL replaces it under --bad-images."""
    whole = io.BytesIO()
    image.convert("RGB").resize((160, 120)).save(whole, "JPEG")
    start = whole.getvalue().index(b"\xff\xda") + 14
    noise = np.random.default_rng(1).integers(0, 255, 3000, dtype=np.uint8).tobytes()
    return whole.getvalue()[:start] + noise


def with_a_garbled_jpeg(photos: Path, root: Path) -> Path:
    """A copy of `photos` at `root` with z_garbled.jpg (`garbled_jpeg`) in its first training
    class."""
    shutil.copytree(photos, root)
    a_class = sorted((root / "train").iterdir())[0]
    (a_class / "z_garbled.jpg").write_bytes(garbled_jpeg(Image.open(next(a_class.iterdir()))))
    return root


def _both_ways(images: TrainImages, keys: list[int]):
    host = images.host_batch(keys)
    encoded = images.encoded_batch(keys)
    pixels, labels, replaced = DeviceDecoder("cpu", images)(encoded.images, encoded.labels,
                                                            encoded.replaced)
    return host, pixels, labels, replaced


@pytest.mark.parametrize("options", [
    {},  # the defaults: random interpolation, colour jitter 0.4, random flips
    {"flip": "alternate", "vflip": 0.5, "train_interpolation": "bicubic", "color_jitter": 0.0,
     "scale": [0.3, 0.6], "ratio": [0.5, 2.0]},
    {"hflip": 0.0, "color_jitter": 0.2, "train_interpolation": "bilinear"},
], ids=["defaults", "alternate-vflip-bicubic", "no-flip"])
def test_the_device_path_trains_the_workers_samples(photos, options):
    images = _dataset(photos, **options)
    keys = [len(images) * epoch + index for epoch in (0, 3) for index in range(len(images))]
    host, pixels, labels, replaced = _both_ways(images, keys)
    assert torch.equal(labels, host.labels) and torch.equal(replaced, host.replaced)
    difference = (pixels.int() - host.images.int()).abs().float()
    # one image with another crop, flip or jitter would differ by tens of levels on average
    assert difference.mean(dim=(1, 2, 3)).max() < 1.0, difference.mean(dim=(1, 2, 3))
    assert difference.max() <= 12, difference.max()


def test_exif_orientations_are_applied_as_the_workers_decoder_applies_them(photos, tmp_path):
    """torchvision's CUDA decoder ignores EXIF orientation, so the device path decodes without
    it and turns each image itself: for each of the 8 orientations, `orient` gives what the
    workers' decoder gives with it applied, and a run's samples are the workers' ones."""
    from torchvision.io import ImageReadMode, decode_jpeg
    photo = Image.open(next((photos / "train" / "a").iterdir())).convert("RGB").resize((150, 100))
    root = tmp_path / "oriented"
    for split in ("train", "val"):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        path = root / "train" / "ab"[orientation % 2] / f"{orientation}.jpg"
        photo.save(path, exif=exif)
        blob = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        turned = decode_jpeg(blob, mode=ImageReadMode.RGB, apply_exif_orientation=True)
        plain = decode_jpeg(blob, mode=ImageReadMode.RGB)
        assert torch.equal(orient(plain, orientation), turned), orientation
        assert jpeg_header(path.read_bytes()) == (*turned.shape[-2:], orientation)
    photo.save(root / "val" / "a" / "0.jpg")
    photo.save(root / "val" / "b" / "0.jpg")
    images = _dataset(root)
    host, pixels, labels, _ = _both_ways(images, list(range(len(images))))
    difference = (pixels.int() - host.images.int()).abs().float()
    assert torch.equal(labels, host.labels)
    assert difference.mean(dim=(1, 2, 3)).max() < 1.0, difference.mean(dim=(1, 2, 3))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("low, high", [(0.6, 1.4), (0.0, 3.0)])  # timm's 0.4; clamped ones
def test_the_batched_colour_jitter_is_torchvisions_image_by_image(low, high, device):
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (48, 3, 9, 11), dtype=torch.uint8, generator=generator)
    order = torch.stack([torch.randperm(4, generator=generator) for _ in range(48)])
    factors = torch.empty(48, 3, dtype=torch.float64).uniform_(low, high, generator=generator)
    expected = []
    adjust = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation)
    for image, parts, image_factors in zip(images, order, factors.tolist()):
        for part in parts.tolist():
            if part < 3:  # 3, hue: off, as timm's scalar jitter has it
                image = adjust[part](image.to(device), image_factors[part])
        expected.append(image.to(device))
    batched = jitter(images.to(device), order.to(device), factors.to(device))
    assert torch.equal(batched, torch.stack(expected))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("batched", [True, False])  # a GPU's select; a CPU's flip a crop
def test_each_crop_is_flipped_as_its_draws_say(device, batched):
    """numpy's own flips, crop by crop: left-right, top-bottom, both, neither; and a batch
    without a flip comes back as it was."""
    generator = torch.Generator().manual_seed(0)
    crops = torch.randint(0, 256, (6, 3, 5, 7), dtype=torch.uint8, generator=generator)
    mirrored = torch.tensor([True, False, True, False, True, False])
    upside_down = torch.tensor([False, True, True, False, False, True])
    expected = [np.flip(crop, axis=[axis for axis, flip in ((1, down), (2, mirror)) if flip])
                for crop, mirror, down in zip(crops.numpy(), mirrored.tolist(),
                                              upside_down.tolist())]
    out = flipped(crops.to(device), mirrored, upside_down, batched)
    assert out.shape == crops.shape and out.device.type == device
    assert np.array_equal(out.cpu().numpy(), np.stack(expected))
    none = torch.zeros(6, dtype=torch.bool)
    assert torch.equal(flipped(crops.to(device), none, none, batched).cpu(), crops)
    # only left-right, only top-bottom
    assert np.array_equal(flipped(crops.to(device), mirrored, none, batched).cpu().numpy(),
                          np.stack([np.flip(c, 2) if m else c for c, m
                                    in zip(crops.numpy(), mirrored.tolist())]))
    assert np.array_equal(flipped(crops.to(device), none, upside_down, batched).cpu().numpy(),
                          np.stack([np.flip(c, 1) if d else c for c, d
                                    in zip(crops.numpy(), upside_down.tolist())]))


def test_files_the_device_cannot_take_are_finished_by_the_workers(photos, tmp_path):
    """A PNG, JPEGs of 40 and of 64 px (the small-image crop), a CMYK JPEG and a file with a
    JPEG's first bytes and nothing after them (replaced by the next image): each is finished the
    host way, in its place in the batch; a batch of such files alone, too.  A greyscale JPEG
    goes to the device and comes back in three channels, as the workers' RGB conversion."""
    root = tmp_path / "mixed"
    for split in ("train", "val"):
        for folder in (photos / split).iterdir():
            (root / split / folder.name).mkdir(parents=True)
            for file in sorted(folder.iterdir()):
                (root / split / folder.name / file.name).write_bytes(file.read_bytes())
    a_class = root / "train" / sorted(p.name for p in (root / "train").iterdir())[0]
    photo = Image.open(next(a_class.iterdir())).convert("RGB")
    photo.save(a_class / "z_png.png")
    photo.resize((40, 30)).save(a_class / "z_small.jpg")
    photo.resize((64, 48)).save(a_class / "z_64.jpg")
    photo.convert("CMYK").save(a_class / "z_cmyk.jpg")
    photo.convert("L").save(a_class / "z_grey.jpg")
    (a_class / "z_cut.jpg").write_bytes(b"\xff\xd8\xff")
    # a readable header, then noise where the image data belongs: the device decoder refuses it
    (a_class / "z_garbled.jpg").write_bytes(garbled_jpeg(photo))
    for name, kind in (("z_png.png", None), ("z_small.jpg", (30, 40, 1)),
                       ("z_64.jpg", (48, 64, 1)), ("z_cmyk.jpg", None), ("z_cut.jpg", None),
                       ("z_garbled.jpg", (120, 160, 1))):
        assert jpeg_header((a_class / name).read_bytes()) == kind, name
    images = _dataset(root)
    keys = list(range(len(images)))
    host, pixels, labels, replaced = _both_ways(images, keys)
    encoded = images.encoded_batch(keys).images
    assert len(encoded.ready_positions) == 5 and len(encoded.positions) == len(keys) - 5
    finished_here = encoded.ready_positions
    assert torch.equal(pixels[finished_here], host.images[finished_here])
    assert torch.equal(labels, host.labels) and torch.equal(replaced, host.replaced)
    garbled = next(i for i in keys if images.source.name(i).endswith("z_garbled.jpg"))
    assert garbled in encoded.positions.tolist()  # sent to the device, refused there
    assert torch.equal(pixels[garbled], host.images[garbled])
    assert (replaced >= 0).sum() >= 1  # the cut file at least, replaced by its neighbour
    grey = next(i for i in keys if images.source.name(i).endswith("z_grey.jpg"))
    assert grey in encoded.positions.tolist()
    difference = (pixels[grey].int() - host.images[grey].int()).abs().float()
    assert difference.mean() < 1.0 and difference.max() <= 12, difference.mean()
    host_only = finished_here.tolist()
    host, pixels, labels, replaced = _both_ways(images, host_only)
    assert torch.equal(pixels, host.images) and torch.equal(labels, host.labels)


def _folder_of(root: Path, size: int) -> Path:
    """JPEGs of size x size px, 2 classes, a training and a validation split."""
    for split in ("train", "val"):
        for label, colour in (("a", (200, 30, 30)), ("b", (30, 30, 200))):
            (root / split / label).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (size, size), colour).save(root / split / label / f"{i}.jpg")
    return root


def test_the_rule_auto_decides_by(photos, tmp_path):
    files = _dataset(photos).source  # JPEG files of 300-500 px
    transform = run_transforms(TrainConfig(image_size=SIZE), _spec())[0]

    def rates(host, shared, device, jitter, train):
        return lambda: {"host": host, "shared": shared, "device": device, "jitter": jitter,
                        "train": train}

    # workers 500 img/s on their whole path, 1000 cropping for the device; the GPU decodes 3000
    # and jitters the workers' crops at 12000, beside training at 2000.  The share where the
    # workers' bound (1000 / s) meets the GPU's (1 / (1/2000 + (1 - s)/3000 + s/12000)):
    # s = (1/2000 + 1/3000) / (1/1000 + 1/3000 - 1/12000) = (10/12000) / (15/12000) = 0.667
    # -> 0.67; the loop then at min(1000 / 0.67, 1 / (1/2000 + 0.33/3000 + 0.67/12000)) =
    # min(1492.5, 1501.9) = 1,493 img/s
    chosen, why, share = choose("auto", files, transform, True, False,
                                rates(500, 1000, 3000, 12000, 2000))
    assert chosen and share == 0.67, (why, share)
    assert why == ("on the device (--decode-on-device auto: the workers decode 500 img/s, or "
                   "crop 1,000 for the device to jitter (12,000 img/s), which decodes 3,000 "
                   "img/s beside training at 2,000 img/s: 1,493 with 67% of each batch's JPEGs "
                   "left to the workers against 500 img/s)"), why
    # without a share (given as 0), the device alone: 1 / (1/2000 + 1/3000) = 1,200
    chosen, why, share = choose("auto", files, transform, True, False,
                                rates(500, 1000, 3000, 12000, 2000), share=0.0)
    assert chosen and share == 0.0 and ": 1,200 against 500 img/s" in why, why
    # a share given is weighed as given: 0.5 -> min(1000 / 0.5, 1 / (1/2000 + 0.5/3000 +
    # 0.5/12000)) = min(2000, 1411.8) = 1,412
    chosen, why, share = choose("auto", files, transform, True, False,
                                rates(500, 1000, 3000, 12000, 2000), share=0.5)
    assert chosen and share == 0.5 and "1,412 with 50% of" in why, why
    # workers 1800 whole, 1900 cropping: s = (10/12000) / (1/1900 + 1/3000 - 1/12000) = 1.07
    # -> 1; min(1900, 1 / (1/2000 + 1/12000)) = 1,714, below the workers' 1,800 alone
    chosen, why, share = choose("auto", files, transform, True, False,
                                rates(1800, 1900, 3000, 12000, 2000))
    assert not chosen and share == 0.0, why
    assert "1,714 with 100% of each batch's JPEGs left to the workers against 1,800 img/s" in why
    # workers 1600 whole, 3200 cropping, the jitter at 20000: s = (10/12000) / (1/3200 +
    # 1/3000 - 1/20000) = 1.40 -> 1; min(3200, 1 / (1/2000 + 1/20000)) = 1,818: 14% above
    # 1,600, past the 10% (MIN_GAIN) the device path must promise
    chosen, why, share = choose("auto", files, transform, True, False,
                                rates(1600, 3200, 3000, 20000, 2000))
    assert chosen and share == 1.0 and "1,818 with 100% of" in why and "against 1,600" in why
    # with the jitter at 18000 the same loop is 1 / (1/2000 + 1/18000) = 1,800: 12.5% above,
    # and at 15000, 1,765: 10.3% above; at 14000, 1,750: 9.4%, the workers alone
    assert choose("auto", files, transform, True, False,
                  rates(1600, 3200, 3000, 15000, 2000)).on_device
    assert choose("auto", files, transform, True, False,
                  rates(1600, 3200, 3000, 14000, 2000)) == (
        False, "by the loader workers (--decode-on-device auto: the workers decode 1,600 img/s, "
               "or crop 3,200 for the device to jitter (14,000 img/s), which decodes 3,000 img/s "
               "beside training at 2,000 img/s: 1,750 with 100% of each batch's JPEGs left to "
               "the workers against 1,600 img/s)", 0.0)
    # a crop of the workers' that costs the GPU more than decoding there (1/1000 + 1/3000 <
    # 1/700): no share; the device alone at 1,200 against 500
    assert best_share({"shared": 1000, "device": 3000, "jitter": 700, "train": 2000}) == 0.0
    # and one that costs it exactly as much (1/2 + 1/2 = 1/1): nothing gained either
    assert best_share({"shared": 2, "device": 2, "jitter": 1, "train": 2000}) == 0.0
    chosen, why, share = choose("auto", files, transform, True, False,
                                rates(500, 1000, 3000, 700, 2000))
    assert chosen and share == 0.0 and ": 1,200 against 500 img/s" in why, why
    # workers whose whole path keeps up with training (2500 > 2000; and 2000, level with
    # it): the workers alone, whatever the share's figures or a share given
    assert choose("auto", files, transform, True, False,
                  rates(2000, 5000, 3000, 12000, 2000)) == (
        False, "by the loader workers (--decode-on-device auto: they decode 2,000 img/s, at "
               "least what training at 2,000 img/s takes)", 0.0)
    for given in (None, 1.0, 0.3):
        chosen, why, share = choose("auto", files, transform, True, False,
                                    rates(2500, 5000, 3000, 12000, 2000), share=given)
        assert (chosen, share) == (False, 0.0) and why == (
            "by the loader workers (--decode-on-device auto: they decode 2,500 img/s, at least "
            "what training at 2,000 img/s takes)"), why
    # always decodes on the device with the share given, else none
    assert choose("always", files, transform, True, False, share=0.25) == (
        True, "on the device (--decode-on-device always)", 0.25)
    assert choose("always", files, transform, True, False).share == 0.0
    # nothing is timed without a GPU, or when asked
    never_timed = lambda: pytest.fail("timed")  # noqa: E731
    assert choose("auto", files, transform, False, False, never_timed) == (False, "", 0.0)
    assert choose("always", files, transform, False, False, never_timed)[0]
    assert choose("never", files, transform, True, False, never_timed) == (
        False, "by the loader workers (--decode-on-device never)", 0.0)
    in_memory = ArraySource(torch.zeros(2, 3, 80, 80, dtype=torch.uint8), torch.zeros(2))
    with pytest.raises(UsageError, match="--decode-on-device always: .*--in-memory"):
        choose("always", in_memory, transform, True, False)
    with pytest.raises(UsageError, match="streamed"):
        choose("always", files, transform, True, True)
    assert choose("auto", in_memory, transform, True, False) == (False, "", 0.0)
    # images of 64 px or less take the small-image path: nothing to weigh; 65 px are weighed
    small = _dataset(_folder_of(tmp_path / "64", 64)).source
    assert choose("auto", small, transform, True, False, never_timed) == (False, "", 0.0)
    larger = _dataset(_folder_of(tmp_path / "65", 65)).source
    assert choose("auto", larger, transform, True, False,
                  rates(500, 1000, 3000, 12000, 2000))[0]
    # each reason in the words of the one line always gives
    plain = run_transforms(TrainConfig(image_size=SIZE, augment=False), _spec())[0]
    policy = run_transforms(TrainConfig(image_size=SIZE, auto_augment="randaugment"),
                            _spec())[0]
    decoded = ImageSource()
    for source, how, streaming, reason in (
            (files, transform, True, "the training data is streamed from shards"),
            (in_memory, transform, False,
             "the training images are decoded once, into memory (--in-memory always; "
             "--in-memory never leaves them files)"),
            (decoded, transform, False, "the training images are not files"),
            (files, plain, False, "the training images are not augmented"),
            (files, policy, False,
             "--auto-augment's policy works on the host, one image at a time")):
        with pytest.raises(UsageError) as raised:
            choose("always", source, how, True, streaming)
        assert str(raised.value) == (f"--decode-on-device always: {reason}; use "
                                     f"--decode-on-device auto or never")


def test_decode_on_device_always_takes_files_that_in_memory_auto_would_hold(tmp_path):
    """Same-size photos fit in memory, which --in-memory auto would choose: --decode-on-device
    always, asked for, has them decoded per batch instead (it was refused, naming --in-memory,
    which the user never set)."""
    folder = _folder_of(tmp_path / "same", 80)
    assert isinstance(load_data(TrainConfig(data_dir=str(folder))).train, ArraySource)
    kept = load_data(TrainConfig(data_dir=str(folder), decode_on_device="always"))
    assert not isinstance(kept.train, ArraySource)
    result = accel_train_here("--data-dir", str(folder), "--model", "test_resnet",
                              "--decode-on-device", "always", "--image-size", "64",
                              "--batch-size", "4", "--max-steps", "1", "--no-plots", *PINNED,
                              "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "JPEGs decoded on the device (--decode-on-device always)" in result.stdout


def test_auto_times_both_paths_on_the_runs_own_images(photos):
    """time_paths, as auto on a GPU calls it, here on the CPU: the device path is timed on the
    run's images, whole and taking the workers' crops of them; the workers' rates (whole, and
    cropping for the device) and the training rate are asked for."""
    images = _dataset(photos)
    count = min(32, len(images))  # the probe's images: all 12 here
    asked = []
    started = time.perf_counter()
    rates = time_paths(images, lambda: asked.append("host") or 456.0,
                       lambda: asked.append("shared") or 789.0, torch.device("cpu"),
                       lambda: asked.append("train") or 123.0)
    whole = time.perf_counter() - started
    assert asked == ["host", "shared", "train"]
    assert (rates["host"], rates["shared"], rates["train"]) == (456.0, 789.0, 123.0)
    # each best of two runs took less than the whole call
    assert rates["device"] >= count / whole and rates["jitter"] >= count / whole, (rates, whole)
    # taking crops made by the workers costs the device less than decoding the JPEGs
    assert rates["jitter"] > rates["device"], rates
    assert images.host_decode_share == 0.0  # the run's own dataset left as it was


class KeysAsked(TrainImages):
    """TrainImages that logs the keys of each batch asked of it, on either path."""

    asked: list

    def encoded_batch(self, keys):
        self.asked.append(list(keys))
        return super().encoded_batch(keys)

    def __getitems__(self, keys):
        self.asked.append(list(keys))
        return super().__getitems__(keys)


def test_the_start_up_timings_take_images_spread_over_the_set(tmp_path):
    """An image folder's rows go class by class: the probes of auto's timings (the device
    path's, the workers', the held photos' crops) and of --image-size's default take 32
    images spread over a training set of 48 (24 a class, the second class's photos another
    size), the first and the last among them, not the first class's alone."""
    assert spread(8, 20) == [0, 2, 5, 8, 10, 13, 16, 19]  # 19/7 apart, by hand
    assert spread(5, 5) == [0, 1, 2, 3, 4] and spread(7, 5) == list(range(7))
    root = tmp_path / "two_sizes"
    for split, count in (("train", 24), ("val", 1)):
        for label, size in (("a", (90, 80)), ("b", (120, 100))):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", size, (i * 10, 50, 0)).save(root / split / label / f"{i}.jpg")
    plain = _dataset(root)
    images = KeysAsked(plain.source, plain.transform, seed=11, mark_replaced=True)
    images.asked = []
    time_paths(images, lambda: 0.0, lambda: 0.0, torch.device("cpu"), lambda: 0.0)
    workers_rate(images, 0)
    read = []
    files_at = images.source.files_at
    images.source.files_at = lambda indices: read.append(list(indices)) or files_at(indices)
    held_photos.timed_rate(images.source, images.transform, 0, torch.device("cpu"))
    for keys in images.asked + read:
        assert keys == spread(32, 48), keys
        assert keys[0] == 0 and keys[-1] == 47 and len(set(keys)) == 32
        assert max(b - a for a, b in zip(keys, keys[1:])) <= 2
        assert sum(key >= 24 for key in keys) >= 15  # the second class's photos
    # time_paths' two device timings (whole and shared), workers_rate's two passes
    assert len(images.asked) == 4 and len(read) == 1
    assert sorted(set(images.source.probed_shapes)) == [(80, 90), (100, 120)]


class PidsOfDecoders(TrainImages):
    """TrainImages that leaves, for each host batch, a file named by the process that made it."""

    def __init__(self, *args, folder: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.folder = folder

    def host_batch(self, keys):
        (self.folder / f"{os.getpid()}-{uuid.uuid4().hex}").touch()
        return super().host_batch(keys)


@pytest.mark.parametrize("workers", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_the_workers_are_timed_together_in_their_own_processes(photos, tmp_path, workers):
    """The host rate auto weighs is the workers' own, timed while they all decode (one
    thread's rate times their number overestimated them 1.6x on an H200 node): each of 3
    worker processes decodes its share of a first and a timed pass; with no workers, this
    process does."""
    from accel_train.data.loaders import RATE_BATCH, RATE_BATCHES_EACH, workers_rate
    plain = _dataset(photos)
    images = PidsOfDecoders(plain.source, plain.transform, seed=11, mark_replaced=True,
                            folder=tmp_path)
    started = time.perf_counter()
    rate = workers_rate(images, workers)
    whole = time.perf_counter() - started
    pids = [path.name.split("-")[0] for path in tmp_path.iterdir()]
    if workers == 0:
        assert pids == [str(os.getpid())] * 2
        assert rate >= RATE_BATCH * RATE_BATCHES_EACH / whole
        return
    assert len(pids) == 2 * workers * RATE_BATCHES_EACH       # two passes of the batches
    assert len(set(pids)) == workers and str(os.getpid()) not in pids
    assert rate >= workers * RATE_BATCHES_EACH * RATE_BATCH / whole


def test_a_resumed_run_keeps_the_choice_auto_made():
    previous = TrainerState(decoded_on_device=True, host_decode_share=0.58)
    config, kept = keep_choices(TrainConfig(), previous, Path("unused"))
    assert (config.decode_on_device, config.host_decode_share) == ("always", 0.58)
    assert "decoding" in kept and "decoding share" in kept
    config, kept = keep_choices(TrainConfig(decode_on_device="never", host_decode_share=0.1),
                                previous, Path("unused"))
    assert (config.decode_on_device, config.host_decode_share) == ("never", 0.1)
    assert "decoding" not in kept and "decoding share" not in kept
    # auto chose the workers: a resume keeps them (no share recorded: none to keep)
    config, kept = keep_choices(TrainConfig(), TrainerState(decoded_on_device=False),
                                Path("unused"))
    assert (config.decode_on_device, config.host_decode_share) == ("never", None)
    assert kept == ("decoding",)
    # a checkpoint from before the share was recorded: nothing to keep
    config, kept = keep_choices(TrainConfig(), TrainerState(decoded_on_device=True),
                                Path("unused"))
    assert config.host_decode_share is None and "decoding share" not in kept


@pytest.mark.slow
def test_a_run_decoding_on_the_device_says_so_and_records_it(photos, tmp_path):
    out = tmp_path / "run"
    said = accel_train_here("--data-dir", str(photos), "--model", "test_resnet", "--image-size",
                            "96", "--batch-size", "4", "--max-steps", "2", "--in-memory",
                            "never", "--num-workers", "0", "--decode-on-device", "always",
                            "--progress", "log", "--no-plots", *PINNED, "--output-dir",
                            str(out), check=True).stdout
    assert "\n  JPEGs decoded on the device (--decode-on-device always)\n" in said, said
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["train"]["decode_on_device"] == "always", recorded["train"]
    assert recorded["train"]["host_decode_share"] == 0.0, recorded["train"]  # none given
    assert recorded["resolved"]["jpeg_decoding"].startswith("on the device")


@pytest.mark.slow
def test_unfit_data_is_one_line_exit_2(tmp_path):
    bad = accel_train_here("--dataset", "synthetic", "--synthetic-train-size", "64",
                           "--decode-on-device", "always", "--max-steps", "1", "--no-plots",
                           "--progress", "log", "--output-dir", str(tmp_path / "a"))
    assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-2000:]
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--decode-on-device always:" in lines[0], bad.stderr
    assert not (tmp_path / "a" / "checkpoints").exists()


def test_the_summary_of_a_run_with_nothing_to_choose_says_nothing_of_it(tmp_path):
    out = tmp_path / "run"
    said = accel_train_here("--dataset", "synthetic", "--synthetic-train-size", "64",
                            "--model", "test_resnet", "--max-steps", "1", "--batch-size", "16",
                            "--progress", "log", "--no-plots", *PINNED, "--output-dir",
                            str(out), check=True).stdout
    assert "JPEGs decoded" not in said, said


@pytest.mark.slow
def test_a_machine_of_two_processes_times_all_their_workers_at_once(photos, tmp_path):
    """Two processes a machine with 2 workers each: rank 0 times 4 workers together, and each
    process is given half of what they decode."""
    from accel_train.data.loaders import RATE_BATCH, RATE_BATCHES_EACH
    from accel_train.data.loading import machine_workers_rate
    plain = _dataset(photos)
    images = PidsOfDecoders(plain.source, plain.transform, seed=11, mark_replaced=True,
                            folder=tmp_path)
    started = time.perf_counter()
    rate = machine_workers_rate(images, 2, 2)
    whole = time.perf_counter() - started
    pids = [path.name.split("-")[0] for path in tmp_path.iterdir()]
    assert len(set(pids)) == 4 and len(pids) == 2 * 4 * RATE_BATCHES_EACH
    assert rate >= 4 * RATE_BATCHES_EACH * RATE_BATCH / whole / 2


@pytest.mark.parametrize("options, said", [
    (["--data-on-device", "always", "--in-memory", "never", "--train-interpolation", "nearest"],
     "--data-on-device always: --train-interpolation nearest is PIL's only"),
    (["--decode-on-device", "always", "--in-memory", "never", "--auto-augment",
      "rand-m9-mstd0.5"],
     "--decode-on-device always: --auto-augment's policy works on the host"),
], ids=["data-on-device", "decode-on-device"])
def test_an_always_the_data_cannot_take_is_refused_before_the_start_up_timings(
        photos, tmp_path, monkeypatch, options, said):
    """One line, exit 2, nothing written, and before the speed probe runs the model for
    seconds (here it would fail the run instead)."""
    import accel_train.trainer

    def probed(*args, **kwargs):
        raise AssertionError("the speed probe ran before the refusal")
    monkeypatch.setattr(accel_train.trainer, "speed_for_run", probed)
    out = tmp_path / "run"
    result = accel_train_here("--data-dir", str(photos), *options, "--batch-size", "4",
                              "--model", "test_resnet", "--output-dir", str(out))
    assert result.returncode == 2 and not out.exists(), result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"accel_train: error: {said}"), \
        result.stderr[-3000:]
