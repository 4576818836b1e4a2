"""--data-on-device: small in-memory training sets held on the device, batches drawn there
(accel_train/data/device_resident.py), checked on a CPU, where `always` takes that path too.

Oracles: the DataLoader path (TrainImages through Accelerate's prepared loader, which skips the
batches already trained on a resume) for the same seed and position, compared batch by batch to
the bit: images, labels, keys and marks; Accelerate's own BatchSamplerShard for which batches a
second process draws; a run with --data-on-device never for what a run with always trains.
"""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import psutil
import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from accel_train.base.errors import UsageError
from accel_train.config import TrainConfig
from accel_train.data.device_resident import MEMORY_SHARE, choose, gb
from accel_train.data.loaders import EpochSampler, FinishOnDevice, TrainImages, run_transforms
from accel_train.data.loading import (LOADER_STATE, DeviceResidentTrainLoader,
                                      IndexedTrainLoader, build_loaders)
from accel_train.data.sources import ArraySource, ImageSource
from accel_train.run.report import summary
from conftest import PINNED, accel_train_here, clean_accelerate_state
from faults import checkpoint_steps, max_weight_difference, metrics

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.247, 0.2435, 0.2616)
N, BATCH = 44, 8  # 5 batches an epoch (4 images left out of each)


def _spec(image_size: int = 32) -> SimpleNamespace:
    """A run's ModelSpec as the transforms read it (held out: the plain resize)."""
    return SimpleNamespace(image_size=image_size, mean=MEAN, std=STD, crop_pct=1.0,
                           crop_mode="squash", interpolation="bilinear")


def _data(n: int = N, size: int = 32) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(5)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)
    held_out = torch.randint(0, 256, (8, 3, size, size), dtype=torch.uint8, generator=generator)
    return SimpleNamespace(train=ArraySource(images, torch.arange(n) % 10),
                           held_out=ArraySource(held_out, torch.arange(8) % 10), test=None)


def _loader(mode: str, accelerator, image_size: int = 32, **options):
    config = TrainConfig(**{"batch_size": BATCH, "num_workers": 0, "seed": 7,
                            "data_on_device": mode, **options})
    spec = _spec(image_size)
    train = build_loaders(config, _data(), spec, 1, 0, 1, False).train
    train.prepare(accelerator)
    return train


def _batches(loader, count: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for batch in loader:
        out.append(tuple(t.clone() for t in batch))
        if count is not None and len(out) == count:
            break
    return out


def _assert_same(got: list, expected: list, about: str) -> None:
    assert len(got) == len(expected), about
    for k, (a, b) in enumerate(zip(got, expected)):
        for name, x, y in zip(("images", "labels", "keys", "replaced"), a, b):
            assert x.dtype == y.dtype and torch.equal(x, y), f"{about}: batch {k}'s {name}"


@pytest.mark.parametrize("image_size, options", [
    (32, {"reprob": 0.5, "flip": "alternate", "crop_pad": 2}),  # crop, flip, erasing
    # erasing plans drawn by two loader workers (their start: the full suite's)
    pytest.param(32, {"reprob": 0.5, "num_workers": 2}, marks=pytest.mark.slow),
    (40, {}),                                                    # resized, default crop
    (32, {"augment": False})])                                   # no plans at all
def test_device_batches_equal_the_loaders_for_an_epoch_and_a_half_and_across_a_resume(
        image_size, options, tmp_path):
    """Epoch 0 whole and epoch 1 in two halves: the second half from a fresh loader that loaded
    the position saved after the first, each loader from its own checkpoint and from the
    other's; the first loader also goes on by itself, in a pass of one batch and then the
    rest.  Every batch equals the DataLoader path's to the bit.  With loader workers, the
    device path's erasing plans come from them (persistent across the epochs and passes)."""
    with clean_accelerate_state():
        accelerator = Accelerator(cpu=True)
        make = {mode: (lambda mode=mode: _loader(mode, accelerator, image_size, **options))
                for mode in ("never", "always")}
        assert isinstance(make["never"](), IndexedTrainLoader)
        on_device = make["always"]()
        assert isinstance(on_device, DeviceResidentTrainLoader)
        if "reprob" in options:
            assert on_device.ahead.loader.num_workers == options.get("num_workers", 0)
        reference = make["never"]()
        expected = {0: _batches(reference)}
        reference.set_epoch(1)
        expected[1] = _batches(reference)
        assert len(expected[0]) == len(expected[1]) == N // BATCH
        assert not torch.equal(expected[0][0][2] % N, expected[1][0][2] % N)  # reshuffled

        saved = {}
        for mode in ("never", "always"):
            loader = make[mode]()
            _assert_same(_batches(loader), expected[0], f"{mode}, epoch 0")
            loader.set_epoch(1)
            _assert_same(_batches(loader, 2), expected[1][:2], f"{mode}, epoch 1's start")
            saved[mode] = tmp_path / mode
            saved[mode].mkdir()
            loader.save(saved[mode])
            assert json.loads((saved[mode] / LOADER_STATE).read_text())["on_device"] == \
                (mode == "always")
            # the same loader, a pass left after its third batch, then the rest of the epoch
            _assert_same(_batches(loader, 1), expected[1][2:3], f"{mode}, a one-batch pass")
            _assert_same(_batches(loader), expected[1][3:], f"{mode}, the same loader's rest")
        for mode in ("never", "always"):
            for source in ("never", "always"):
                resumed = make[mode]()
                resumed.load(saved[source])
                assert (resumed.epoch, resumed.samples_in_epoch) == (1, 2 * BATCH)
                _assert_same(_batches(resumed), expected[1][2:],
                             f"{mode} resumed from the {source} loader's checkpoint")


def _loader_workers() -> set[int]:
    """The pids of this process's loader workers: the fork server's children."""
    me = psutil.Process()
    children = set(me.children())
    return {p.pid for p in me.children(recursive=True) if p not in children}


@pytest.mark.slow  # torch looks at its workers every 5 s
def test_a_dead_erasing_worker_is_replaced_and_the_batches_stay_the_same():
    """--reprob's erasing plans drawn by one loader worker, SIGKILLed after the second batch:
    one warning naming it, new workers from that position, and every batch of the epoch still
    the DataLoader path's to the bit."""
    with clean_accelerate_state():
        accelerator = Accelerator(cpu=True)
        # (a timeout: a loader left with its dead worker waits for it forever)
        options = {"reprob": 0.5, "num_workers": 1, "loader_timeout": 30}
        expected = _batches(_loader("never", accelerator, **options))
        loader = _loader("always", accelerator, **options)
        warnings: list[str] = []
        loader.warn = warnings.append
        before = _loader_workers()
        got, killed = [], None
        for k, batch in enumerate(loader):
            got.append(tuple(t.clone() for t in batch))
            if k == 1:
                (killed,) = _loader_workers() - before
                os.kill(killed, signal.SIGKILL)
        _assert_same(got, expected, "with a worker killed after batch 2")
        assert len(warnings) == 1 and f"pid(s) {killed}" in warnings[0], warnings
        assert "16 samples into epoch 1" in warnings[0], warnings[0]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_process_draws_the_batches_accelerates_sharding_hands_it(rank):
    """Two processes: rank r's micro-batches are those Accelerate's BatchSamplerShard gives
    rank r of the epoch's sampler, finished as the DataLoader path finishes them."""
    config = TrainConfig(batch_size=4, num_workers=0, seed=3, data_on_device="always",
                         reprob=0.5)
    spec = _spec()
    data = _data()
    loaders = build_loaders(config, data, spec, 2, rank, 1, False)
    train = loaders.train
    train.prepare(SimpleNamespace(device=torch.device("cpu")))
    train.set_epoch(2)
    got = _batches(train)

    sampler = EpochSampler(N, 8, 3)
    sampler.set_epoch(2)
    shard = BatchSamplerShard(BatchSampler(sampler, 4, drop_last=True), num_processes=2,
                              process_index=rank)
    train_tf, _ = run_transforms(config, spec)
    dataset = TrainImages(data.train, train_tf, 3, mark_replaced=True)
    finish = FinishOnDevice(train_tf)
    expected = []
    for keys in shard:
        pixels, labels, keys, replaced, *plans = dataset.__getitems__(keys).tensors()
        expected.append((finish(pixels, plans), labels, keys, replaced))
    assert len(expected) == len(train) == N // 8
    _assert_same(got, expected, f"rank {rank}")


class _Decoded(ImageSource):
    def __init__(self):
        self.labels = torch.zeros(4, dtype=torch.long)


def test_auto_always_and_never_choose_and_say_why():
    """auto holds the data on a CUDA device when it fits in a tenth of its memory (`memory`
    planted here), not on a CPU, not with erasing unless loader workers draw it; always does
    whatever the images allow, and is bad input where they do not."""
    small, large = _data().train, _data(n=4, size=72).train
    size = small.images.numel() + small.labels.numel() * 8  # uint8 pixels, int64 labels
    plain = run_transforms(TrainConfig(), _spec())[0]
    erasing = run_transforms(TrainConfig(reprob=0.25),
                             _spec())[0]
    policy = run_transforms(TrainConfig(auto_augment="randaugment"),
                            _spec())[0]
    fits, over = size / MEMORY_SHARE, size / MEMORY_SHARE - 1

    held, why = choose("auto", small, plain, True, False, memory=int(fits) + 1)
    assert held and why.startswith("drawn on the device") and "within 10%" in why, why
    held, why = choose("auto", small, plain, True, False, memory=int(over))
    assert not held and "is over 10% of the device's" in why, why
    assert choose("auto", small, plain, False, False, memory=10**12) == \
        (False, "a DataLoader (--data-on-device auto: not on a CUDA device)")
    held, why = choose("auto", small, erasing, True, False, memory=10**12)
    assert why == ("a DataLoader (--data-on-device auto: --reprob's erasing is drawn image by "
                   "image on the host, and with --num-workers 0 the training process would "
                   "draw it)") and not held
    # with loader workers to draw the erasing plans, as without erasing
    assert choose("auto", small, erasing, True, False, memory=10**12, workers=1) == \
        choose("auto", small, plain, True, False, memory=10**12)
    assert choose("always", small, erasing, False, False)[0]  # on a CPU, with erasing too
    # the sizes in the words, by hand: 44 x 3 x 32 x 32 bytes of pixels + 44 x 8 of labels =
    # 135,520 bytes; a device of exactly 10^8 bytes is the first said in GB
    assert size == 135_520
    assert choose("always", small, plain, False, False) == (
        True, "drawn on the device, the training set held there (0.1 MB; --data-on-device "
              "always)")
    assert choose("auto", small, plain, True, False, memory=10**8) == (
        True, "drawn on the device, the training set held there (0.1 MB, within 10% of its "
              "0.10 GB; --data-on-device auto)")
    assert choose("auto", small, plain, True, False, memory=10**8 - 1)[1].endswith(
        "within 10% of its 100.0 MB; --data-on-device auto)")
    assert choose("auto", small, plain, True, False, memory=1_355_199) == (
        False, "a DataLoader (--data-on-device auto: the training set's 0.1 MB is over 10% of "
               "the device's 1.4 MB)")
    assert choose("never", small, plain, True, False, memory=10**12) == \
        (False, "a DataLoader (--data-on-device never)")
    # not augmenting, with timm's resize and centre crop for the held-out images: the training
    # images get that resize too, on the host
    timm_resize = run_transforms(TrainConfig(augment=False), SimpleNamespace(
        **{**vars(_spec()), "crop_pct": 0.875, "crop_mode": "center"}))[0]
    # each reason whole: auto says it, always refuses with it
    for source, transform, streaming, reason in (
            (small, policy, False, "--auto-augment's policy works on the host, one image at a "
                                   "time"),
            (_Decoded(), plain, False, "the training images are decoded per step, not held in "
                                       "memory (--in-memory)"),
            (small, plain, True, "the training data is streamed from shards"),
            (small, timm_resize, False, "its resize (--crop-pct, --crop-mode, --interpolation) "
                                        "is timm's, on the host")):
        assert choose("auto", source, transform, True, streaming, memory=10**12) == (
            False, f"a DataLoader (--data-on-device auto: {reason})")
        with pytest.raises(UsageError) as raised:
            choose("always", source, transform, True, streaming, memory=10**12)
        assert str(raised.value) == f"--data-on-device always: {reason}; use " \
            "--data-on-device auto or never"
    # above 64 px in memory: held as photographs are (test_photos_on_device.py)
    assert choose("always", large, plain, False, False)[1].startswith(
        "drawn on the device, the training photos decoded once and held there")
    # 64 px is the small-image path's own; a set of exactly a tenth of the memory fits
    at_64 = ArraySource(torch.zeros(2, 3, 64, 64, dtype=torch.uint8), torch.zeros(2).long())
    assert choose("always", at_64, plain, False, False)[0]
    assert choose("auto", small, plain, True, False, memory=1_355_200)[0]


def test_the_summarys_bytes_in_gb_mb_and_kb_by_hand():
    # (values whose last digit a divisor 1 off, or a bound moved by 1, would change)
    assert gb(115_000_000) == "0.12 GB" and gb(99_999_999) == "100.0 MB"
    assert gb(1_050_000) == "1.1 MB" and gb(100_000) == "0.1 MB"
    assert gb(99_999) == "100.0 kB" and gb(1_050) == "1.1 kB" and gb(49_408) == "49.4 kB"


def test_the_summary_names_the_training_loader_and_why():
    facts = {"model": {"model_name": "m", "class_names": ["a"], "image_size": 32},
             "trainable_parameters": 1, "world_size": 1, "global_batch": 8, "device": "cpu",
             "precision_used": "fp32", "channels_last": False, "speed_choice": "set",
             "sync_bn": False, "train_samples": 8, "eval_samples": 8, "data_in_memory": True,
             "num_workers": 0, "steps_per_epoch": 1, "total_steps": 1, "output_dir": "o",
             "checkpoint_dir": "c"}
    loaders = build_loaders(TrainConfig(batch_size=BATCH, data_on_device="always"), _data(),
                            _spec(), 1, 0, 1, False)
    assert loaders.num_workers == 0 and loaders.choice.startswith("drawn on the device")
    erasing = build_loaders(TrainConfig(batch_size=BATCH, data_on_device="always", reprob=0.5,
                                        num_workers=2), _data(), _spec(), 1, 0, 1, False)
    assert erasing.num_workers == 2 and erasing.choice.endswith(
        "; --reprob's erasing plans drawn by 2 loader worker(s)"), erasing.choice
    said = summary({**facts, "train_loader": loaders.choice}, "data", 1, None, "m")
    assert f"\n  train batches: {loaders.choice}\n" in said
    assert "train batches" not in summary(facts, "data", 1, None, "m")


@pytest.mark.slow  # a start up to the loaders (the data and the network built first)
def test_bad_modes_and_unfit_data_are_one_line_exit_2(tmp_path):
    bad = accel_train_here("--data-on-device", "sometimes", "--output-dir", str(tmp_path / "a"))
    assert bad.returncode == 2 and "--data-on-device" in bad.stderr, bad.stderr
    unfit = accel_train_here("--dataset", "synthetic", "--synthetic-train-size", "64",
                             "--data-on-device", "always", "--auto-augment", "randaugment",
                             "--max-steps", "1", "--no-plots", "--progress", "log",
                             "--output-dir", str(tmp_path / "b"))
    assert unfit.returncode == 2, unfit.stdout[-2000:] + unfit.stderr[-2000:]
    assert "--data-on-device always: --auto-augment" in unfit.stderr
    assert len([line for line in unfit.stderr.splitlines() if line.strip()]) == 1, unfit.stderr


def test_a_two_step_run_with_the_data_on_the_device_trains_what_the_loader_trains(tmp_path):
    """Two steps of --data-on-device always on a CPU: its summary and checkpoint say the
    batches were drawn on the device, and the weights equal, to the bit, a --data-on-device
    never run's."""
    command = ["--dataset", "synthetic", "--synthetic-train-size", "64", "--max-eval-samples",
               "16", "--model", "test_resnet", "--batch-size", "16", "--max-steps", "2",
               "--reprob", "0.5", "--crop-pad", "2", "--log-every", "1", "--progress", "log",
               "--no-plots",
               *PINNED]
    runs = {mode: tmp_path / mode for mode in ("never", "always")}
    for mode, out in runs.items():
        said = accel_train_here(*command, "--data-on-device", mode, "--output-dir", str(out),
                                check=True).stdout
        # the summary names the loader chosen and why
        assert ("\n  train batches: drawn on the device, the training set held there "
                if mode == "always" else
                "\n  train batches: a DataLoader (--data-on-device never)\n") in said, said
        (step,) = checkpoint_steps(out)
        assert step == 2
        state = json.loads((out / "checkpoints" / "step_00000002" / LOADER_STATE).read_text())
        assert state["on_device"] == (mode == "always"), state
        assert [r["step"] for r in metrics(out) if r["type"] == "train"] == [1, 2]
    assert max_weight_difference(runs["never"], runs["always"]) == 0.0


def test_build_loaders_refuses_an_empty_held_out_split_and_a_set_short_of_one_global_batch():
    """The refusals the data alone decides, for a program that builds the loaders itself (the
    command line and fit() refuse an empty split earlier, as they load it)."""
    data = _data()
    empty = SimpleNamespace(train=data.train, test=None,
                            held_out=ArraySource(data.held_out.images[:0], torch.zeros(0)))
    with pytest.raises(UsageError, match=r"^the held-out split is empty; raise --val-fraction "
                                         r"or --max-eval-samples$"):
        build_loaders(TrainConfig(batch_size=BATCH), empty, _spec(), 1, 0, 1, False)
    # 44 images; 8 x 3 processes x 2 micro-batches = 48 a step: one short of a step
    with pytest.raises(UsageError, match=r"^the training set has 44 images, fewer than one "
                                         r"global batch of 48 \(batch_size x processes x "):
        build_loaders(TrainConfig(batch_size=BATCH, accumulation_steps=2), data, _spec(), 3, 0,
                      1, False)
    assert build_loaders(TrainConfig(batch_size=BATCH, accumulation_steps=2), data, _spec(),
                         2, 0, 1, False).global_batch == 32  # 44 images hold one
