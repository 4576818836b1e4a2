"""The held-out batches kept on the device after the first evaluation where the training set is
held there (accel_train/data/held_out_kept.py).

Oracles: the prepared loader's own evaluation (the same numbers, to the bit, from the kept
batches, with no image read again); `accel-train eval` on one process, the loader's path, against
a two-process run's last evaluation, made from kept batches (each held-out image counted once,
where the last batch was evened out with repeats); the bytes and the rule's words by hand.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from PIL import Image
from torch import nn

from accel_train.config import TrainConfig
from accel_train.data.badimages import BadImageLog
from accel_train.data.held_out_kept import KeptHeldOut, keep_held_out, kept_bytes, pacer_for
from accel_train.data.loaders import HeldOutImages, make_loader, run_transforms
from accel_train.data.loading import build_loaders
from accel_train.data.sources import load_data
from accel_train.data.transforms import ImageTransform
from accel_train.train.evaluate import HeldOutEvaluator, evaluate_classifier
from conftest import PINNED, TINY_TRAIN, accel_train_here, clean_accelerate_state, free_port, run
from faults import metrics
from test_device_decode import _spec
from test_device_input import MEAN, STD, _numpy_normalized

MB = 10**6


def test_what_keeping_takes_and_when_it_is_kept_by_hand():
    # 10 images in batches of 4 on 2 processes: 2 batches of 4 a process, 8 images, each
    # 3 x 8 x 8 uint8 pixels (192 bytes) and a label and a mark (16)
    assert kept_bytes(10, 8, 4, 2) == 8 * (3 * 8 * 8 + 16)
    assert kept_bytes(16, 8, 4, 2) == 8 * 208 and kept_bytes(17, 8, 4, 2) == 12 * 208
    assert kept_bytes(10, 8, 4, 1) == 12 * 208
    # a tenth of 4 GB: 310 MB of training images and 90 MB kept fit, 91 MB do not
    assert keep_held_out("auto", True, 90 * MB, 310 * MB, True, memory=4000 * MB) == (
        True, "kept on the device after the first evaluation (90.0 MB a process; "
              "--data-on-device auto)")
    assert keep_held_out("always", True, 91 * MB, 310 * MB, False, memory=4000 * MB) == (
        False, "from the loader at each evaluation (91.0 MB a process beside the training "
               "set's 0.31 GB is over 10% of the machine's 4.00 GB)")
    assert keep_held_out("auto", True, 91 * MB, 310 * MB, True, memory=4000 * MB)[1].endswith(
        "over 10% of the device's 4.00 GB)")
    # small amounts in kB
    assert keep_held_out("auto", True, 49_408, 0, True, memory=4000 * MB)[1] == \
        "kept on the device after the first evaluation (49.4 kB a process; --data-on-device auto)"
    # the training set not held there, or never: not a word
    assert keep_held_out("auto", False, 1, 0, True, memory=4000 * MB) == (False, "")
    assert keep_held_out("never", True, 1, 0, True, memory=4000 * MB) == (False, "")


def test_a_pass_cut_short_keeps_nothing_and_a_pacer_of_another_length_is_an_error():
    """Plain lists for the loader and the pacer: the first whole pass is kept, the one before
    it, cut short (an error, a stop), is not; the pacer must end with the kept batches."""
    ended = []
    kept = KeptHeldOut(["a", "b"], [0, 1], lambda: ended.append(True))
    passes = iter(kept)
    assert next(passes) == "a"
    passes.close()  # cut short
    assert kept.kept is None and not ended
    assert list(kept) == ["a", "b"] and ended == [True]
    kept.loader = ["read again"]  # nothing is read from it now
    assert list(kept) == ["a", "b"] and ended == [True]
    kept.pacer = [0, 1, 2]  # another shard than the kept one's
    with pytest.raises(ValueError):
        list(kept)


def _tiny_model() -> nn.Module:
    """A 2-class network of a few parameters, the same weights each time."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 2))


def _kept_evaluator(accelerator, loaders, data, config, tmp_path) -> HeldOutEvaluator:
    """The run's evaluator over `loaders`' held-out split, keeping its batches as the trainer
    has it do (2 classes, NCHW)."""
    evaluator = HeldOutEvaluator(accelerator, accelerator.prepare(loaders.held_out),
                                 BadImageLog(tmp_path / "bad.txt", None, data, True), 2, False,
                                 config, finish=loaders.held_out_finish)
    evaluator.keep_batches(accelerator.prepare(pacer_for(loaders.held_out)))
    return evaluator


class CountedReads(HeldOutImages):
    """Held-out images that count the batches read from their files."""

    reads = 0

    def __getitems__(self, indices):
        CountedReads.reads += 1
        return super().__getitems__(indices)


@pytest.fixture(scope="module")
def photos_with_validation(tmp_path_factory) -> Path:
    """2 classes, 16 training and 13 validation JPEGs of 70-90 px (13: no whole batch of 4), one
    of the validation ones cut short."""
    root = tmp_path_factory.mktemp("kept")
    for split, counts in (("train", (8, 8)), ("val", (7, 6))):
        for (label, colour), count in zip((("a", (200, 40, 40)), ("b", (40, 40, 200))), counts):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                image = Image.new("RGB", (70 + 3 * i, 90 - 2 * i), colour)
                image.paste((i * 19 % 255, 128, 0), (5, 5, 30 + i, 40))
                image.save(root / split / label / f"{i}.jpg")
    cut = root / "val" / "a" / "6.jpg"  # one held-out file cut short: left out of the numbers
    cut.write_bytes(cut.read_bytes()[:300])
    return root


def test_kept_batches_give_the_loaders_numbers_and_read_no_image_again(photos_with_validation):
    config = TrainConfig(data_dir=str(photos_with_validation), in_memory="never",
                         image_size=32)
    data = load_data(config)
    transform = run_transforms(config, _spec(32))[1]
    model = _tiny_model()
    with clean_accelerate_state():
        accelerator = Accelerator(cpu=True)
        raw = make_loader(CountedReads(data.held_out, transform, mark_replaced=True), 4, 0, 2,
                          False, False)
        loader = accelerator.prepare(raw)
        expected = evaluate_classifier(accelerator, model, loader, 2, False, "none")
        assert (expected["count"], expected["left_out"], len(data.held_out)) == (12, 1, 13)
        ended = []
        kept = KeptHeldOut(loader, accelerator.prepare(pacer_for(raw)),
                           lambda: ended.append(True))
        CountedReads.reads = 0
        first = evaluate_classifier(accelerator, model, kept, 2, False, "none")
        assert CountedReads.reads == 4 and ended == [True]  # 13 images in batches of 4
        for _ in range(2):
            again = evaluate_classifier(accelerator, model, kept, 2, False, "none")
            assert again == first == expected
        assert CountedReads.reads == 4 and ended == [True]  # nothing read, nor ended, again
        # the same tensors, not copies of them
        assert [b[0].data_ptr() for b in kept] == [b[0].data_ptr() for b in kept.kept]


def test_the_run_keeps_uint8_pixels_and_normalizes_them_to_the_loaders_floats(
        photos_with_validation, tmp_path):
    """The run's way (build_loaders, HeldOutEvaluator.keep_batches): the held-out loader hands
    uint8 pixels, which the evaluator normalizes on the device at every evaluation.  Oracle:
    the loader's float batches of eval's path (normalized by the loader), evaluated as they
    come: the same numbers to the bit, three times; what is kept is uint8 (3 bytes a pixel, 16
    a label and mark, by hand)."""
    config = TrainConfig(data_dir=str(photos_with_validation), in_memory="never",
                         image_size=32, batch_size=4, num_workers=0, data_on_device="always")
    data = load_data(config)
    loaders = build_loaders(config, data, _spec(32), 1, 0, 1, False)
    assert loaders.held_out_kept and loaders.held_out_finish is not None
    transform = loaders.held_out.dataset.transform
    model = _tiny_model()
    with clean_accelerate_state():
        accelerator = Accelerator(cpu=True)
        floats = accelerator.prepare(make_loader(
            HeldOutImages(data.held_out, transform, mark_replaced=True), 4, 0, 2, False, False))
        expected = evaluate_classifier(accelerator, model, floats, 2, False, "none")
        evaluator = _kept_evaluator(accelerator, loaders, data, config, tmp_path)
        for step in range(3):
            assert evaluator.evaluate(model, step) == expected
        kept = evaluator.batches.kept
        assert {batch[0].dtype for batch in kept} == {torch.uint8}
        # (one process: the last batch stays short, 13 images; kept_bytes counts whole batches,
        # as on several processes, where Accelerate evens the last one out)
        assert sum(t.nbytes for batch in kept for t in batch) == 13 * (3 * 32 * 32 + 16) \
            <= kept_bytes(13, 32, 4, 1)
        # the floats they become are the loader's, to the bit
        for batch, loaders_batch in zip(kept, floats):
            assert torch.equal(loaders.held_out_finish(batch[0]), loaders_batch[0])


@pytest.fixture(scope="module")
def photos_with_three_splits(photos_with_validation, tmp_path_factory) -> Path:
    """photos_with_validation and a test split beside it: 3 and 2 JPEGs of 60-70 px."""
    root = tmp_path_factory.mktemp("three")
    shutil.copytree(photos_with_validation, root, dirs_exist_ok=True)
    for label, count in (("a", 3), ("b", 2)):
        (root / "test" / label).mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", (60 + 5 * i, 70), (30 * i, 200, 90)).save(
                root / "test" / label / f"{i}.jpg")
    return root


# (cuda=True on a machine without one: the loaders' pinning is skipped, with torch's warning)
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
@pytest.mark.parametrize("cuda", [True, False], ids=["a GPU run", "a CPU run"])
def test_a_gpu_runs_evaluations_hand_uint8_that_normalize_to_the_loaders_floats(
        photos_with_three_splits, cuda):
    """Not kept (--data-on-device never), a GPU run's held-out and test loaders still hand
    uint8 pixels, normalized on the device by the finish they come with (a quarter of the bytes
    to pin and copy); a CPU run's workers hand the floats.  Oracle: eval's path, the loader of
    normalized floats, to the bit."""
    config = TrainConfig(data_dir=str(photos_with_three_splits), in_memory="never",
                         image_size=32, batch_size=4, num_workers=0, data_on_device="never",
                         decode_on_device="never")
    data = load_data(config)
    assert (len(data.held_out), len(data.test)) == (13, 5)
    loaders = build_loaders(config, data, _spec(32), 1, 0, 1, cuda)
    assert not loaders.held_out_kept
    for loader, finish, source in ((loaders.held_out, loaders.held_out_finish, data.held_out),
                                   (loaders.test, loaders.test_finish, data.test)):
        floats = make_loader(HeldOutImages(source, loader.dataset.transform, mark_replaced=True),
                             4, 0, 2, False, False)
        batches = list(loader)
        assert len(batches) == len(floats) == math.ceil(len(source) / 4)
        assert {batch[0].dtype for batch in batches} == {torch.uint8 if cuda else torch.float32}
        assert (finish is not None) == cuda
        for (pixels, *rest), (expected, *expected_rest) in zip(batches, floats):
            assert torch.equal(finish(pixels) if cuda else pixels, expected)
            assert all(torch.equal(a, b) for a, b in zip(rest, expected_rest))


def test_the_summary_says_whether_the_held_out_batches_are_kept(photos_with_validation):
    for mode, said in (("always", "kept on the device after the first evaluation (49.4 kB a "
                                  "process; --data-on-device always)"),
                       ("never", "")):
        config = TrainConfig(data_dir=str(photos_with_validation), in_memory="never",
                             image_size=32, batch_size=4, num_workers=0, data_on_device=mode)
        loaders = build_loaders(config, load_data(config), _spec(32), 1, 0, 1, False)
        # 13 images: 4 batches of 4, each image 3 x 32 x 32 uint8 + 16 bytes
        assert kept_bytes(13, 32, 4, 1) == 16 * (3 * 32 * 32 + 16) == 49_408
        assert (loaders.held_out_kept, loaders.held_out_batches) == (bool(said), said)


def test_a_time_budget_times_its_evaluations_on_the_kept_pixels(tmp_path):
    """A --time-budget run times one held-out batch at its start: where the batches are kept,
    the loader hands uint8 pixels, and the timing normalizes them as an evaluation does (a
    model handed the uint8 pixels would stop the run)."""
    args = [arg for arg in TINY_TRAIN]
    del args[args.index("--epochs"):args.index("--epochs") + 2]  # the budget sets the length
    ran = accel_train_here(*args, "--time-budget", "1", "--data-on-device", "always",
                           "--output-dir", str(tmp_path / "run"), check=True)
    assert "held-out batches: kept on the device after the first evaluation" in ran.stdout
    # the budget's first reading, a fixed count of steps in, comes right after the probe
    # (pacing.BudgetPacer.after_step), whatever the machine's pace; the fitted length depends on it
    assert "time budget 1: warmup paced by an estimate at step" in \
        (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert [r["eval_count"] for r in metrics(tmp_path / "run") if r["type"] == "epoch"][-1] == 64


@pytest.mark.slow
def test_two_processes_evaluate_kept_batches_as_eval_does_each_image_once(
        photos_with_validation, tmp_path):
    """A run on 2 processes (torchrun, gloo) holding its photos, 2 epochs: the second epoch's
    evaluation comes from kept batches (2 a process of 4: 16 images for 13, the last batch
    evened out with repeats that Accelerate must drop; the cut file's substitute marked and
    left out): its numbers are those of `accel-train eval` on the saved model, one process
    reading the files."""
    out = tmp_path / "run"
    started = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   "-m", "accel_train", "--data-dir", str(photos_with_validation),
                   "--model", "test_resnet", "--image-size", "32", "--batch-size", "4",
                   "--epochs", "2", "--data-on-device", "always", "--num-workers", "0",
                   "--in-memory", "never", "--output-dir", str(out), "--progress", "log",
                   *PINNED], timeout=300, check=True)
    assert "held-out batches: kept on the device after the first evaluation" in started.stdout
    last = [r for r in metrics(out) if r.get("type") == "epoch"][-1]
    evaluated = run([sys.executable, "-m", "accel_train", "eval", str(out), "--json"],
                    timeout=300, check=True)
    oracle = json.loads(evaluated.stdout)
    assert (last["eval_count"], last["eval_left_out"]) == (oracle["count"],
                                                            oracle["left_out"]) == (12, 1), \
        (last, oracle)
    assert last["eval_top1"] == oracle["top1"]
    assert last["eval_loss"] == pytest.approx(oracle["loss"], abs=1e-5)


@pytest.mark.slow  # a fork server's start: the seconds of a process's imports
def test_the_held_out_loaders_workers_end_once_its_batches_are_kept(photos_with_validation,
                                                                     tmp_path):
    """With a loader worker (kept alive between epochs, --persistent-workers), the held-out
    loader's worker ends once the first evaluation has kept the batches: nothing is read from
    it again.  Oracle: multiprocessing's own list of this process's live children."""
    config = TrainConfig(data_dir=str(photos_with_validation), in_memory="never",
                         image_size=32, batch_size=4, num_workers=1, data_on_device="always")
    data = load_data(config)
    loaders = build_loaders(config, data, _spec(32), 1, 0, 1, False)
    model = _tiny_model()
    with clean_accelerate_state():
        accelerator = Accelerator(cpu=True)
        before = set(multiprocessing.active_children())
        evaluator = _kept_evaluator(accelerator, loaders, data, config, tmp_path)
        first = evaluator.evaluate(model, 0)
        deadline = time.monotonic() + 30
        while set(multiprocessing.active_children()) - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not set(multiprocessing.active_children()) - before
        assert evaluator.evaluate(model, 1) == first


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a GPU"))])
def test_every_pixel_level_normalizes_as_numpy_divides(device):
    """Every uint8 level of every channel, normalized on `device`, is numpy's float32
    (x / 255 - mean) / std to the bit.  On CUDA a division by a Python number is a product with
    its float32 reciprocal, one bit off for about half the levels: the device's normalization
    must not divide so (the loader workers' floats are the CPU's division)."""
    levels = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(2, 3, 16, 16)
    normalized = ImageTransform(16, MEAN, STD).finish(levels.contiguous().to(device))
    assert normalized.device.type == device
    np.testing.assert_array_equal(normalized.cpu().numpy(), _numpy_normalized(levels))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_kept_pixels_normalize_to_the_loaders_floats(photos_with_validation):
    """On CUDA the kept uint8 pixels, normalized there (the GPU's division, not the CPU's),
    give the floats the loader's workers make on the host, to the bit: a run that keeps its
    held-out batches evaluates the numbers `accel-train eval` does."""
    config = TrainConfig(data_dir=str(photos_with_validation), in_memory="never",
                         image_size=32, batch_size=4, num_workers=0, data_on_device="always")
    data = load_data(config)
    # (the loaders built as a CPU run's: the pixels then go to the GPU by hand)
    loaders = build_loaders(config, data, _spec(32), 1, 0, 1, False)
    assert loaders.held_out_kept
    floats = HeldOutImages(data.held_out, loaders.held_out.dataset.transform, mark_replaced=True)
    for (pixels, *_), (expected, *_) in zip(loaders.held_out, make_loader(floats, 4, 0, 2,
                                                                          False, False)):
        normalized = loaders.held_out_finish(pixels.cuda())
        assert normalized.device.type == "cuda"
        assert torch.equal(normalized.cpu(), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_a_runs_evaluations_from_uint8_batches_are_evals(photos_with_three_splits,
                                                                      tmp_path):
    """A run on the GPU, its held-out batches not kept: every evaluation and the test split's
    come from uint8 batches normalized on the GPU.  Oracle: `accel-train eval` on the saved
    model (the loader's floats, the same GPU) for each split: the same images counted, the
    same top-1, the loss within the GPU's reductions."""
    out = tmp_path / "run"
    accel_train_here("--data-dir", str(photos_with_three_splits), "--model", "test_resnet",
                     "--image-size", "32", "--batch-size", "4", "--epochs", "1",
                     "--data-on-device", "never", "--decode-on-device", "never",
                     "--num-workers", "0", "--in-memory", "never", "--output-dir", str(out),
                     "--progress", "log", "--no-plots", *PINNED, check=True)
    records = metrics(out)
    last = [r for r in records if r.get("type") == "epoch"][-1]
    (tested,) = [r for r in records if r.get("type") == "test"]
    for split, (count, top1, loss) in (
            ("held-out", (last["eval_count"], last["eval_top1"], last["eval_loss"])),
            ("test", (tested["images"], tested["top1"], tested["loss"]))):
        oracle = json.loads(accel_train_here("eval", str(out), "--split", split, "--json",
                                             check=True).stdout)
        assert (count, top1) == (oracle["count"], oracle["top1"]), (split, oracle)
        assert loss == pytest.approx(oracle["loss"], abs=1e-4), (split, oracle)
