"""--data-on-device with photographs: every training photo decoded once into the device's memory
and each batch cropped there (accel_train/data/held_photos.py), checked on a CPU, where
`always` takes that path with the CPU's JPEG decoder.

Oracles: the device decode path (--decode-on-device always: the same decoder, draws, resize,
flips and jitter, on files decoded a batch at a time), batch by batch to the bit for the same
seed and position, across an epoch and a half and a resume from either loader's checkpoint;
the loader workers' path (timm's transform on PIL images) for labels and marks, and pixels
within the resizers' rounding, where files the device decoder does not take are held; sizes
added up by hand from the files' dimensions for what holding them takes.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from PIL import Image

from accel_train.base.errors import UsageError
from accel_train.config import TrainConfig
from accel_train.data import held_photos
from accel_train.data.device_resident import choose
from accel_train.data.loaders import TrainImages, run_transforms
from accel_train.data.loading import (LOADER_STATE, DevicePhotosTrainLoader,
                                      IndexedTrainLoader, StartUpRates, build_loaders)
from accel_train.data.sources import ArraySource, load_data
from accel_train.run.report import summary
from accel_train.run.resume import keep_choices
from accel_train.run.trainer_state import TrainerState
from conftest import clean_accelerate_state
from test_data_on_device import _assert_same, _batches
from test_device_decode import SIZE, _spec, garbled_jpeg, photos  # noqa: F401 -- the fixture

BATCH = 4  # the fixture's 12 training photos: 3 batches an epoch


def _config(root: Path, **options) -> TrainConfig:
    return TrainConfig(**{"data_dir": str(root), "in_memory": "never", "image_size": SIZE,
                          "batch_size": BATCH, "num_workers": 0, "seed": 7, **options})


def _loader(root: Path, accelerator, where: str, **options):
    """The training loader of a run on `root`: `where` "held" (--data-on-device always),
    "decoded" (--decode-on-device always) or "workers" (both never)."""
    modes = {"held": ("always", "never"), "decoded": ("never", "always"),
             "workers": ("never", "never")}[where]
    config = _config(root, data_on_device=modes[0], decode_on_device=modes[1], **options)
    train = build_loaders(config, load_data(config), _spec(), 1, 0, 1, False).train
    train.prepare(accelerator)
    return train


@pytest.mark.parametrize("options", [
    {},  # the defaults: random interpolation, colour jitter 0.4, random flips
    {"flip": "alternate", "vflip": 0.5, "train_interpolation": "bicubic", "color_jitter": 0.0,
     "scale": [0.3, 0.6], "ratio": [0.5, 2.0], "reprob": 0.5},
    # the draws (and erasing plans) by 2 loader workers, on both paths
    pytest.param({"reprob": 0.5, "num_workers": 2}, marks=pytest.mark.slow),
], ids=["defaults", "alternate-vflip-bicubic-erasing", "workers"])
def test_held_photos_give_the_device_decode_paths_batches_and_resume_between_them(
        photos, options, tmp_path):  # noqa: F811
    """Epoch 0 whole, epoch 1 in two parts: a checkpoint after its first batch, then the rest
    from a fresh loader of either kind that loaded either kind's checkpoint."""
    with clean_accelerate_state():
        accelerator = Accelerator(cpu=True)
        reference = _loader(photos, accelerator, "decoded", **options)
        assert isinstance(reference, IndexedTrainLoader)
        expected = {0: _batches(reference)}
        reference.set_epoch(1)
        expected[1] = _batches(reference)
        assert len(expected[1]) == 3
        held = _loader(photos, accelerator, "held", **options)
        assert isinstance(held, DevicePhotosTrainLoader)
        assert held.ahead.loader.num_workers == options.get("num_workers", 0)
        _assert_same(_batches(held), expected[0], "held, epoch 0")
        held.set_epoch(1)
        _assert_same(_batches(held, 1), expected[1][:1], "held, epoch 1's start")
        saved = {"held": tmp_path / "held", "decoded": tmp_path / "decoded"}
        for folder in saved.values():
            folder.mkdir()
        held.save(saved["held"])
        assert json.loads((saved["held"] / LOADER_STATE).read_text())["on_device"] is True
        other = _loader(photos, accelerator, "decoded", **options)
        other.set_epoch(1)
        _batches(other, 1)
        other.save(saved["decoded"])
        for where in ("held", "decoded"):
            for source, folder in saved.items():
                resumed = _loader(photos, accelerator, where, **options)
                resumed.load(folder)
                _assert_same(_batches(resumed), expected[1][1:],
                             f"{where} resumed from the {source} loader's checkpoint")


def _as_the_workers_within_rounding(held, workers) -> int:
    """Two epochs of both loaders: labels, keys and marks equal batch by batch, each image's
    pixels within a level on average (in levels of 255); the samples marked replaced."""
    marked = 0
    for epoch in (0, 1):
        held.set_epoch(epoch)
        workers.set_epoch(epoch)
        for got, expected in zip(_batches(held), _batches(workers), strict=True):
            for name, x, y in zip(("labels", "keys", "replaced"), got[1:], expected[1:]):
                assert torch.equal(x, y), name
            marked += int((got[3] >= 0).sum())
            difference = (got[0] - expected[0]).abs() * torch.tensor(
                (0.229, 0.224, 0.225)).view(1, 3, 1, 1) * 255
            assert difference.mean(dim=(1, 2, 3)).max() < 1.0, difference.mean(dim=(1, 2, 3))
    return marked


@pytest.mark.parametrize("scan_batch", [held_photos.SCAN_BATCH, 3])  # one read; several
def test_files_the_device_decoder_does_not_take_are_held_as_the_workers_read_them(
        photos, tmp_path, monkeypatch, scan_batch):  # noqa: F811
    """A PNG, a CMYK JPEG, JPEGs with EXIF orientations, a JPEG whose data is noise after its
    header and a file that is only a JPEG's first bytes (both replaced by the next image that
    decodes, and marked), among the photos: every batch's
    labels and marks are the loader workers' and its pixels theirs within the resizers'
    rounding (another crop, flip or jitter would differ by tens of levels)."""
    root = tmp_path / "mixed"
    shutil.copytree(photos, root)
    a_class = sorted((root / "train").iterdir())[0]
    photo = Image.open(next(a_class.iterdir())).convert("RGB")
    photo.save(a_class / "z_png.png")
    photo.convert("CMYK").save(a_class / "z_cmyk.jpg")
    (a_class / "z_garbled.jpg").write_bytes(garbled_jpeg(photo))
    # the class's last file: its substitute, the next class's first, has another label
    (a_class / "zz_cut.jpg").write_bytes(b"\xff\xd8\xff")
    for orientation in (3, 6, 8):  # turned by the decoder's caller: a half and quarter turns
        exif = Image.Exif()
        exif[0x0112] = orientation
        photo.resize((300, 200)).save(a_class / f"z_turned{orientation}.jpg", exif=exif)
    # files read and decoded a few at a time: the buffer filled across reads
    monkeypatch.setattr(held_photos, "SCAN_BATCH", scan_batch)
    held_photos.scan.cache_clear()
    with clean_accelerate_state():
        accelerator = Accelerator(cpu=True)
        # (batches of one: every image in every epoch)
        held = _loader(root, accelerator, "held", batch_size=1)
        workers = _loader(root, accelerator, "workers", batch_size=1)
        marked = _as_the_workers_within_rounding(held, workers)
        assert marked == 4  # the cut and the garbled file's samples, once an epoch
        source = held.source
        names = [source.name(i) for i in range(len(source))]
        broken = sorted(i for i, name in enumerate(names)
                        if name.endswith(("zz_cut.jpg", "z_garbled.jpg")))
        assert held.held.replaced.tolist() == [i if i in broken else -1
                                               for i in range(len(source))]
        for index in broken:  # held again: its substitute's pixels and label, as the loader's
            (_,), (used,) = source.samples_at([index])
            assert used not in broken
            assert torch.equal(held.held.images[index], held.held.images[used])
            assert held.held.labels[index] == source.labels[used]
        assert held.held.labels[broken[-1]] != source.labels[broken[-1]]  # the cut file's


def _size(file) -> tuple[int, int]:
    """(width, height), as PIL reads the header."""
    with Image.open(file) as image:
        return image.size


def _rates(host, shared, device, jitter, train, held):
    return lambda: {"host": host, "shared": shared, "device": device, "jitter": jitter,
                    "train": train, "held": held}


def test_what_holding_photos_takes_is_their_pixels_added_up_and_auto_decides_by_it(
        photos, tmp_path):  # noqa: F811
    config = _config(photos)
    files = load_data(config).train
    transform = run_transforms(config, _spec())[0]
    shapes = [_size(file) for file in photos.glob("train/*/*.jpg")]
    pixels = sum(3 * width * height for width, height in shapes)  # by hand, from PIL
    found = held_photos.scan(files)
    assert found.pixel_bytes == pixels and found.jpegs == len(files) == 12
    held = pixels + 16 * len(files)  # and an int64 label and mark an image
    mb = f"{held / 1e6:.1f} MB"
    assert choose("always", files, transform, False, False) == (
        True, f"drawn on the device, the training photos decoded once and held there ({mb}; "
              f"--data-on-device always)")
    fits = f"{mb}, within 10% of its {10 * held / 1e6:.1f} MB"
    # the rates of test_device_decode's rule, where the device decode path promises 1,493
    # img/s; cropping held photos at 8,000 beside training at 2,000: 1 / (1/2000 + 1/8000) =
    # 1,600, held
    assert choose("auto", files, transform, True, False, memory=10 * held, workers=1,
                  rates=_rates(500, 1000, 3000, 12000, 2000, 8000)) == (
        True, f"drawn on the device, the training photos decoded once and held there ({fits}; "
              f"--data-on-device auto: cropping the held photos there at 8,000 img/s beside "
              f"training at 2,000 img/s: 1,600 against 1,493 img/s decoding them every epoch)")
    assert choose("auto", files, transform, True, False, memory=10 * held - 1, workers=1) == (
        False, f"a DataLoader (--data-on-device auto: the training set's {mb} is over 10% of "
               f"the device's {(10 * held - 1) / 1e6:.1f} MB)")
    assert choose("auto", files, transform, False, False, memory=10**12) == \
        (False, "a DataLoader (--data-on-device auto: not on a CUDA device)")
    # at 5,000: 1 / (1/2000 + 1/5000) = 1,429, below 1,493: the files decoded every epoch
    assert choose("auto", files, transform, True, False, memory=10 * held, workers=1,
                  rates=_rates(500, 1000, 3000, 12000, 2000, 5000)) == (
        False, f"a DataLoader (--data-on-device auto: {fits}, but cropping the held photos "
               f"there at 5,000 img/s beside training at 2,000 img/s: 1,429 against 1,493 "
               f"img/s decoding them every epoch)")
    # at 6,000: 1,500, held (a tie or better holds)
    assert choose("auto", files, transform, True, False, memory=10 * held, workers=1,
                  rates=_rates(500, 1000, 3000, 12000, 2000, 6000))[0]
    # the workers alone keep up with training (2,500 against 2,000): nothing to gain
    assert "1,600 against 2,000 img/s" in choose(
        "auto", files, transform, True, False, memory=10 * held, workers=1,
        rates=_rates(2500, 3000, 3000, 12000, 2000, 8000))[1]
    # where the device cannot decode the files (arrays in memory): the workers alone, 500;
    # held at 1,000: 1 / (1/2000 + 1/1000) = 667
    arrays = ArraySource(torch.zeros(4, 3, 80, 72, dtype=torch.uint8), torch.arange(4))
    held_arrays, why = choose("auto", arrays, transform, True, False, memory=10**12, workers=1,
                              rates=lambda: {"host": 500, "train": 2000, "held": 1000})
    assert held_arrays and ": 667 against 500 img/s" in why, why
    # none of the probed photos decoded on the device: nothing held, whatever the others
    assert not choose("auto", files, transform, True, False, memory=10 * held, workers=1,
                      rates=_rates(500, 1000, 3000, 12000, 2000, 0))[0]
    assert not choose("auto", arrays, transform, True, False, memory=10**12, workers=1,
                      rates=lambda: {"host": 0.5, "train": 2000, "held": 0})[0]
    # a tie holds: 1 / (1/2000 + 1/2000) = 1,000 against the workers' 1,000
    assert choose("auto", arrays, transform, True, False, memory=10**12, workers=1,
                  rates=lambda: {"host": 1000, "train": 2000, "held": 2000})[0]
    # the draws are host work: auto leaves them to loader workers or holds nothing
    assert choose("auto", files, transform, True, False, memory=10 * held) == (
        False, "a DataLoader (--data-on-device auto: each photograph's crop, flips and jitter "
               "are timm's draws on the host, and with --num-workers 0 the training process "
               "would draw them)")
    # far over by the probed images' sizes (those --image-size's default decoded): no header
    # is read
    fresh = load_data(config).train
    probed = [_size(file) for file in sorted(photos.glob("train/*/*.jpg"))]
    assert sorted(fresh.probed_shapes) == sorted((h, w) for w, h in probed)  # all 12 probed
    guess = 12 * 3 * sum(w * h for w, h in probed) / 12  # the probed images' mean, 12 times
    scans = held_photos.scan.cache_info().misses
    memory = int(5 * guess) - 10
    assert choose("auto", fresh, transform, True, False, memory=memory, workers=1) == (
        False, f"a DataLoader (--data-on-device auto: the training set's about "
               f"{int(guess) / 1e6:.1f} MB decoded is over 10% of the device's "
               f"{memory / 1e6:.1f} MB)")
    assert held_photos.scan.cache_info().misses == scans
    # each reason whole: auto says it, always refuses with it
    policy = run_transforms(_config(photos, auto_augment="randaugment"), _spec())[0]
    plain = run_transforms(_config(photos, augment=False), _spec())[0]
    nearest = run_transforms(_config(photos, train_interpolation="nearest"), _spec())[0]
    small = tmp_path / "small"
    for split in ("train", "val"):
        for label in ("a", "b"):
            (small / split / label).mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (300, 200) if i else (60, 40)).save(
                    small / split / label / f"{i}.jpg")
    small_files = load_data(_config(small)).train
    at_64 = tmp_path / "at_64"  # all 64 px: the small-image path's, held only in memory
    for split in ("train", "val"):
        for label in ("a", "b"):
            (at_64 / split / label).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (64, 64)).save(at_64 / split / label / f"{i}.jpg")
    for source, tf, reason in (
            (load_data(_config(at_64)).train, transform, "the training images are decoded per "
                                                         "step, not held in memory "
                                                         "(--in-memory)"),
            (files, policy, "--auto-augment's policy works on the host, one image at a time"),
            (files, plain, "the training images are not augmented"),
            (files, nearest, "--train-interpolation nearest is PIL's only; use random, "
                             "bilinear or bicubic"),
            (small_files, transform, "2 of its images are 64 px or less, whose crop is the "
                                     "small-image path's, not the photographs'")):
        assert choose("auto", source, tf, True, False, memory=10**12, workers=1) == (
            False, f"a DataLoader (--data-on-device auto: {reason})"), reason
        with pytest.raises(UsageError) as raised:
            choose("always", source, tf, True, False, memory=10**12)
        assert str(raised.value) == f"--data-on-device always: {reason}; use " \
            "--data-on-device auto or never"
    # arrays above 64 px (decoded in memory) are held as photographs: as they are stored
    assert choose("always", arrays, transform, False, False)[1] == (
        f"drawn on the device, the training photos decoded once and held there "
        f"({(4 * 3 * 80 * 72 + 16 * 4) / 1e3:.1f} kB; --data-on-device always)")


def test_the_summary_says_the_photographs_are_held_and_who_draws_their_crops(photos):  # noqa: F811
    for options, said in (
            ({"num_workers": 2}, "; timm's draws for each photograph drawn by 2 loader "
                                 "worker(s)"),
            ({"num_workers": 1, "reprob": 0.5}, "; timm's draws for each photograph and "
                                                "--reprob's erasing plans drawn by 1 loader "
                                                "worker(s)"),
            ({}, "; --data-on-device always)")):
        config = _config(photos, data_on_device="always", **options)
        loaders = build_loaders(config, load_data(config), _spec(), 1, 0, 1, False)
        assert loaders.choice.startswith("drawn on the device, the training photos decoded "
                                         "once and held there (") and \
            loaders.choice.endswith(said), loaders.choice
        assert loaders.num_workers == options.get("num_workers", 0)
        assert loaders.photos_held is True
    # the data line says where the training photos were decoded (the held-out ones: per step)
    facts = {"model": {"model_name": "m", "class_names": ["a", "b"], "image_size": SIZE},
             "trainable_parameters": 1, "world_size": 1, "global_batch": 4, "device": "cpu",
             "precision_used": "fp32", "channels_last": False, "speed_choice": "set",
             "sync_bn": False, "train_samples": 12, "eval_samples": 2, "data_in_memory": False,
             "num_workers": 1, "steps_per_epoch": 3, "total_steps": 3, "output_dir": "o",
             "checkpoint_dir": "c"}
    assert "12 train / 2 validation images, 2 classes, 128px, training photos decoded once on " \
        "the device, 1 loader worker(s)\n" in summary({**facts, "photos_held": True}, "data", 1,
                                                      None, "m")
    assert "128px, training photos decoded once on the device in 2.5 s, 1 loader worker(s)\n" \
        in summary({**facts, "photos_held": True, "photos_held_seconds": 2.46}, "data", 1,
                   None, "m")
    assert "128px, decoded per step, 1 loader worker(s)\n" in summary(facts, "data", 1, None,
                                                                       "m")


def test_the_start_up_times_holding_on_the_runs_own_photos_once(photos):  # noqa: F811
    """What auto weighs (on a CPU here): the paths device_decode.time_paths times and the
    device's crops of held photos, each measured once however often asked."""
    config = _config(photos)
    images = TrainImages(load_data(config).train, run_transforms(config, _spec())[0], seed=1)
    rates = StartUpRates(images, 0, 1, torch.device("cpu"), lambda: 123.0)
    measured = rates.with_held()
    assert set(measured) == {"host", "shared", "device", "jitter", "train", "held"}
    assert measured["train"] == 123.0 and all(rate > 0 for rate in measured.values())
    assert rates.with_held() == measured and rates.paths() == \
        {k: v for k, v in measured.items() if k != "held"}  # (timed again, they would differ)
    arrays = ArraySource(torch.randint(0, 256, (8, 3, 90, 80), dtype=torch.uint8),
                         torch.arange(8) % 2)
    in_memory = StartUpRates(TrainImages(arrays, images.transform, seed=1), 0, 1,
                             torch.device("cpu"), lambda: 50.0).with_held()
    assert set(in_memory) == {"host", "train", "held"} and in_memory["held"] > 0


def test_a_resume_keeps_whether_auto_held_the_photographs():
    """Held photos' pixels are the device's crops, the workers' differ by the resizers'
    rounding: a resume left to auto takes the checkpoint's choice (timing again could choose
    otherwise); a flag given wins; data that are not photographs record nothing to keep."""
    for held, mode in ((True, "always"), (False, "never")):
        config, kept = keep_choices(TrainConfig(), TrainerState(photos_held=held), Path("x"))
        assert config.data_on_device == mode and kept == ("photographs held",)
    config, kept = keep_choices(TrainConfig(data_on_device="never"),
                                TrainerState(photos_held=True), Path("x"))
    assert config.data_on_device == "never" and kept == ()
    config, kept = keep_choices(TrainConfig(), TrainerState(), Path("x"))
    assert config.data_on_device == "auto" and kept == ()


def test_photographs_decoded_in_memory_are_held_as_they_are_stored(photos):  # noqa: F811
    """Arrays above 64 px (photos of one size decoded into memory): held as one copy, each
    batch cropped from them; labels and keys the loader workers', pixels theirs within the
    resizers' rounding (the workers' path is timm's transform on PIL)."""
    files = sorted(photos.glob("train/*/*.jpg"))
    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(f).convert("RGB").resize(
        (120, 100), Image.BICUBIC))).permute(2, 0, 1) for f in files])
    labels = torch.tensor([0 if f.parent.name == "a" else 1 for f in files])
    data = SimpleNamespace(train=ArraySource(pixels, labels),
                           held_out=ArraySource(pixels[:2], labels[:2]), test=None)
    with clean_accelerate_state():
        accelerator = Accelerator(cpu=True)
        loaders = {}
        for mode in ("always", "never"):
            config = TrainConfig(batch_size=BATCH, num_workers=0, seed=7, image_size=SIZE,
                                 data_on_device=mode, decode_on_device="never")
            loaders[mode] = build_loaders(config, data, _spec(), 1, 0, 1, False).train
            loaders[mode].prepare(accelerator)
        held, workers = loaders["always"], loaders["never"]
        assert isinstance(held, DevicePhotosTrainLoader)
        assert [tuple(image.shape) for image in held.held.images] == [(3, 100, 120)] * 12
        assert torch.equal(torch.stack(held.held.images), pixels)
        _as_the_workers_within_rounding(held, workers)


def test_the_held_crops_rate_is_images_over_the_best_of_two_timings(
        photos, tmp_path, monkeypatch):  # noqa: F811
    """A clock read at 10, 10.25, 10.75 and 11.5 s: the two timings 0.25 and 0.75 s, the rate
    the 12 photos over the shorter; a set without a JPEG among its first images: 0 (nothing to
    time)."""
    config = _config(photos)
    files = load_data(config).train
    transform = run_transforms(config, _spec())[0]
    steps = iter([10.0, 10.25, 10.75, 11.5] + [99.0] * 10)
    monkeypatch.setattr(held_photos.time, "perf_counter", lambda: next(steps))
    assert held_photos.timed_rate(files, transform, 0, torch.device("cpu")) == 48.0
    monkeypatch.undo()
    pngs = tmp_path / "pngs"
    for split in ("train", "val"):
        for label in ("a", "b"):
            (pngs / split / label).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (150, 100)).save(pngs / split / label / f"{i}.png")
    assert held_photos.timed_rate(load_data(_config(pngs)).train, transform, 0,
                                  torch.device("cpu")) == 0.0


def test_holding_the_photos_is_timed_from_the_first_read_to_the_last_decode(
        photos, monkeypatch):  # noqa: F811
    """A clock read at 5 s when holding starts and 7.5 s when it ends: 2.5 s, which the summary
    gives (the start's cost of holding, in a real run's data line)."""
    files = load_data(_config(photos)).train
    held_photos.scan(files)  # (read beforehand, as choose reads it: no clock in it anyway)
    steps = iter([5.0, 7.5])
    monkeypatch.setattr(held_photos.time, "perf_counter", lambda: next(steps))
    held = held_photos.hold(files, torch.device("cpu"))
    monkeypatch.undo()
    assert held.seconds == 2.5 and len(held.images) == len(files)
    arrays = ArraySource(torch.zeros(3, 3, 80, 80, dtype=torch.uint8), torch.zeros(3).long())
    steps = iter([1.0, 1.25])
    monkeypatch.setattr(held_photos.time, "perf_counter", lambda: next(steps))
    assert held_photos.hold(arrays, torch.device("cpu")).seconds == 0.25


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_held_photos_give_the_device_decode_paths_batches(photos):  # noqa: F811
    """On CUDA (nvJPEG, the batched resize, the batched flips, the crops queued ahead on a side
    stream while the caller's stream is busy with products that read the last batch, standing
    in for a training step): held photos' batches equal --decode-on-device always's to the
    bit, the same decoder's pixels cropped the same way."""
    with clean_accelerate_state():
        accelerator = Accelerator()
        assert accelerator.device.type == "cuda"
        expected = _batches(_loader(photos, accelerator, "decoded"))
        held = _loader(photos, accelerator, "held")
        assert held.held.labels.device.type == "cuda"
        got, busy = [], torch.randn(1024, 1024, device=accelerator.device)
        for batch in held:
            for _ in range(20):
                busy = (busy @ busy).tanh_() + batch.images.float().mean()
            got.append(tuple(t.clone() for t in batch))
        _assert_same(got, expected, "held on the GPU")


def test_the_next_batchs_crops_are_made_on_a_thread_while_this_one_trains(photos):  # noqa: F811
    """The crops of batch k+1 are made on the decode-ahead thread while the trainer holds batch
    k (on a GPU: queued on a side stream while the step runs), never the epoch's last batch's
    before the one before it is trained (its end is the loader's end), in a resumed epoch too;
    the loader's close ends the thread.  Oracle: the crops made by the time the trainer holds
    each batch, counted by hand (the thread's crops waited for, with a generous timeout: the
    thread runs when the machine lets it)."""
    with clean_accelerate_state():
        held = _loader(photos, Accelerator(cpu=True), "held")
        made, threads, crops = [], set(), held.held.crops
        changed = threading.Condition()

        def logged(size, drawn):
            pixels = crops(size, drawn)
            with changed:
                threads.add(threading.current_thread())
                made.append(int(drawn[0][0]))
                changed.notify_all()
            return pixels

        def made_by_now(count: int, seconds: float) -> bool:
            with changed:
                return changed.wait_for(lambda: len(made) >= count, timeout=seconds)

        held.held.crops = logged
        keys = []
        for k, batch in enumerate(held):  # 3 batches of 4
            keys.append(int(batch.keys[0]))
            if k == 0:  # the next batch's crops, made while this one is held
                assert made_by_now(2, 60), made
            elif k == 1:  # the next is the last: not made before this one is done with
                assert not made_by_now(3, 1.0), made
        assert made == keys
        assert threads and all(thread.name.startswith("decode-ahead") for thread in threads)
        assert threading.current_thread() not in threads
        made.clear()
        held.samples_in_epoch = BATCH  # a resumed epoch: 2 batches left, the 2nd the last
        for k, _ in enumerate(held):
            if k == 0:
                assert not made_by_now(2, 1.0), made
        assert made == keys[1:]
        held.close()
        assert not any(thread.is_alive() for thread in threads)


def test_auto_holds_photo_files_only_where_all_but_one_in_a_hundred_are_jpegs(tmp_path):
    """The files the device does not decode are decoded at the start by the training process:
    auto takes 1 in 100 of them, not 2; always takes any."""
    transform = run_transforms(_config(tmp_path), _spec())[0]
    for others, held in ((1, True), (2, False)):
        root = tmp_path / f"others{others}"
        for split, count in (("train", 50), ("val", 1)):
            for label in ("a", "b"):
                (root / split / label).mkdir(parents=True)
                for i in range(count):
                    kind = "png" if split == "train" and label == "a" and i < others else "jpg"
                    Image.new("RGB", (80, 70), (i, 0, 0)).save(root / split / label /
                                                               f"{i}.{kind}")
        files = load_data(_config(root)).train
        chosen, why = choose("auto", files, transform, True, False, memory=10**12, workers=1,
                             rates=_rates(500, 1000, 3000, 12000, 2000, 8000))
        assert chosen == held, why
        if not held:
            assert why == ("a DataLoader (--data-on-device auto: 2 of its 100 files are not "
                           "JPEGs the device decodes (the training process would decode them "
                           "at the start))")
        assert choose("always", files, transform, False, False)[0]


def test_a_held_loader_not_prepared_says_so(photos):  # noqa: F811
    config = _config(photos, data_on_device="always")
    train = build_loaders(config, load_data(config), _spec(), 1, 0, 1, False).train
    with pytest.raises(RuntimeError, match="prepare.accelerator. decodes the photos"):
        next(iter(train))
