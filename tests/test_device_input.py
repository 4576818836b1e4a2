"""The input path built for a GPU, checked where a CPU can show it.

A training batch travels as uint8 pixels (a quarter of float32's bytes; pinned and copied without
blocking on CUDA) and is normalized, then erased with --reprob, on the device (`FinishOnDevice`).

Oracles: numpy's float32 arithmetic for the normalization; timm's RandomErasing applied by hand
(seeded as the product documents: randomness.seeded(seed, epoch, index, ERASING_SALT)) for
erasing; a fake CUDA event whose timestamps a test sets for the data-wait clock; torch's own
backend flags for the CUDA math settings.  That whole runs are bit-identical to the float32
loader they replace was measured once, before and after the change (BENCHMARKS.md); the
first-step oracle in test_flags.py keeps the normalization honest in a real run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accel_train import data as data_module
from accel_train.augment import ERASING_SALT, apply_erasing, build_erasing, erasing_plan
from accel_train.data import FinishOnDevice, TrainImages, default_num_workers
from accel_train.datawait import HostWaitClock, StreamWaitClock, data_wait_clock
from accel_train.precision import use_fast_cuda_math
from accel_train.randomness import each_seeded, seeded
from accel_train.sources import ArraySource, ImageSource
from accel_train.transforms import ImageTransform

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.247, 0.2435, 0.2616)
SEED, N = 11, 40


def _source(n: int = N, size: int = 32) -> ArraySource:
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(3))
    return ArraySource(images, torch.arange(n) % 10)


def _numpy_normalized(pixels: torch.Tensor) -> np.ndarray:
    x = pixels.numpy().astype(np.float32) / np.float32(255)
    mean = np.asarray(MEAN, np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(STD, np.float32).reshape(1, 3, 1, 1)
    return (x - mean) / std


def test_the_dataset_hands_out_uint8_and_the_device_half_normalizes_as_numpy_does():
    transform = ImageTransform(32, MEAN, STD, augment=True)
    dataset = TrainImages(_source(), transform, SEED)
    keys = [N + 5, 3, 2 * N + 17, 9]  # epochs 1, 0, 2, 0
    pixels = dataset.__getitems__(keys).images
    assert pixels.dtype == torch.uint8 and pixels.shape == (4, 3, 32, 32)
    finished = FinishOnDevice(transform, SEED, N)(pixels, torch.tensor(keys))
    assert finished.dtype == torch.float32
    np.testing.assert_array_equal(finished.numpy(), _numpy_normalized(pixels))
    # the same tensors as the one-call float path (held-out, predict, whitening use it)
    epochs, indices = np.array(keys) // N, np.array(keys) % N
    whole = transform.batch(_source().images.index_select(0, torch.from_numpy(indices)), SEED,
                            epochs, indices)
    assert torch.equal(whole, finished)


@pytest.mark.parametrize("drawn_by", ["loader", "device half"])
def test_erasing_on_the_device_half_is_timms_with_each_samples_seed(drawn_by):
    """The loader draws each batch's erasing with its pixels (in its workers, beside the
    training step); a reader that hands over no plan gets the same erasing drawn where the batch
    is finished.  Both are timm's, each sample inside its own seed."""
    transform = ImageTransform(32, MEAN, STD, augment=True, erasing=build_erasing(1.0))
    dataset = TrainImages(_source(), transform, SEED, mark_replaced=True)
    keys = [N + 5, 3, 2 * N + 17, 9]
    batch = dataset.__getitems__(keys)
    handed_over = batch.tensors()
    assert len(handed_over) == 6 and handed_over[:4] == batch.samples_tensors()
    plan = handed_over[4:] if drawn_by == "loader" else ()
    finished = FinishOnDevice(transform, SEED, N)(batch.images, torch.tensor(keys), plan)
    from timm.data.random_erasing import RandomErasing
    timm_erasing = RandomErasing(probability=1.0, mode="pixel", device="cpu")
    normalized = torch.from_numpy(_numpy_normalized(batch.images))
    for position, key in enumerate(keys):
        epoch, index = divmod(key, N)
        with seeded(SEED, epoch, index, ERASING_SALT):
            expected = timm_erasing(normalized[position].clone())
        assert torch.equal(finished[position], expected), key
        assert not torch.equal(finished[position], normalized[position])  # something erased
    assert len(batch[0]) == 4  # a sample is still (pixels, label, key, replaced)
    samples = batch[1:3]  # a reader that slices gets samples too
    assert len(samples) == 2 and all(len(sample) == 4 for sample in samples)
    assert torch.equal(samples[1][0], batch.images[2]) and int(samples[1][2]) == keys[2]


def test_a_batch_without_erasing_hands_over_its_samples_tensors_only():
    batch = TrainImages(_source(), ImageTransform(32, MEAN, STD, augment=True), SEED,
                        mark_replaced=True).__getitems__([1, 2])
    assert batch.erasing is None and len(batch.tensors()) == 4


@pytest.mark.parametrize("images_per_canvas", [1, 2, None])
def test_the_erasing_plan_is_where_and_what_timm_writes(images_per_canvas, monkeypatch):
    """Oracle: timm on a zero image, where it writes; positions in the whole batch, whether the
    plan's canvas holds one image, two (the last part shorter), or the whole batch; int32
    positions up to the limit, int64 past it."""
    from accel_train import augment
    if images_per_canvas is not None:
        monkeypatch.setattr(augment, "ERASING_CANVAS_ELEMENTS", images_per_canvas * 3 * 6 * 6)
    images = torch.zeros(5, 3, 6, 6)  # more images than channels, and an odd number
    erasing = build_erasing(1.0)
    places = [(0, 7), (2, 1), (1, 7), (0, 2), (3, 3)]
    where, values = erasing_plan(erasing, images.shape, SEED, *zip(*places))
    assert where.dtype == torch.int32 and values.dtype == torch.float32
    expected = torch.zeros_like(images)
    for position, (epoch, index) in enumerate(places):
        with seeded(SEED, epoch, index, ERASING_SALT):
            expected[position] = erasing(expected[position].clone())
    erased = apply_erasing(images, (where, values))
    assert torch.equal(erased, expected) and not torch.equal(erased, images)
    assert images.abs().sum() == 0  # the input is not written
    doubles = apply_erasing(images.double(), (where, values))  # values in the batch's dtype
    assert doubles.dtype == torch.float64 and torch.equal(doubles, expected.double())
    assert apply_erasing(images, (where[:0], values[:0])) is images
    monkeypatch.setattr(augment, "INT32_POSITIONS", images.numel())  # exactly this batch's
    assert erasing_plan(erasing, images.shape, SEED, *zip(*places))[0].dtype == torch.int32
    monkeypatch.setattr(augment, "INT32_POSITIONS", images.numel() - 1)  # one position more
    where64, values64 = erasing_plan(erasing, images.shape, SEED, *zip(*places))
    assert where64.dtype == torch.int64 and torch.equal(where64, where.long())
    assert torch.equal(values64, values)


def test_each_seeded_is_seeded_per_item_and_puts_the_outside_states_back():
    import random
    draw = lambda item: (item, random.random(), float(np.random.rand()), float(torch.rand(1)))  # noqa: E731
    keys = [(1, 0, 5, 9), (1, 3, 2, 9), (1, 0, 5, 9)]
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    outside = random.random(), float(np.random.rand()), float(torch.rand(1))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    got = each_seeded(draw, "abc", keys)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == outside
    expected = []
    for item, key in zip("abc", keys):
        with seeded(*key):
            expected.append(draw(item))
    assert got == expected and got[0][1:] == got[2][1:] and got[0][1:] != got[1][1:]
    with pytest.raises(ValueError):  # one key per item
        each_seeded(draw, "ab", keys)


def test_a_batch_through_the_training_loader_brings_its_erasing_along(monkeypatch):
    """Through the DataLoader the trainer builds (make_loader: its collate, its sampler), each
    batch arrives with the erasing its loader drew, and finishing it draws nothing more: the
    training process only writes the patches.  Oracle: the one-call float path."""
    transform = ImageTransform(32, MEAN, STD, augment=True, erasing=build_erasing(0.5))
    dataset = TrainImages(_source(), transform, SEED, mark_replaced=True)
    keys = [N + 5, 3, 2 * N + 17, 9, 1, N + 30]
    loader = data_module.make_loader(dataset, batch_size=3, num_workers=0, prefetch_factor=2,
                                     persistent_workers=False, pin_memory=False, sampler=keys)
    finish = FinishOnDevice(transform, SEED, N)
    handed = list(loader)
    expected = [transform.batch(_source().images.index_select(0, torch.tensor(part) % N), SEED,
                                np.array(part) // N, np.array(part) % N)
                for part in (keys[:3], keys[3:])]
    monkeypatch.setattr(ImageTransform, "erasing_plan",
                        lambda *a, **k: pytest.fail("drawn again in the training process"))
    for (pixels, _, batch_keys, _, *erasing), start, oracle in zip(handed, (0, 3), expected):
        assert len(erasing) == 2 and batch_keys.tolist() == keys[start:start + 3]
        assert torch.equal(finish(pixels, batch_keys, erasing), oracle)
    assert sum(batch[4].numel() for batch in handed) > 0  # some patches were drawn


def test_the_streamed_loader_finishes_with_the_same_key_arithmetic():
    """Streaming keys are epoch * len(shards) + the sample's number; the indexed loader's are
    epoch * N + index: one FinishOnDevice serves both, the epoch read from the key."""
    transform = ImageTransform(32, MEAN, STD, augment=True, erasing=build_erasing(1.0))
    pixels = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    finish = FinishOnDevice(transform, SEED, 7)
    a = finish(pixels, torch.tensor([3 * 7 + 2, 5]))
    b = transform.finish(pixels, SEED, [3, 0], [2, 5])
    assert torch.equal(a, b)
    assert not torch.equal(a, transform.finish(pixels, SEED, [0, 0], [2, 5]))


def test_loader_workers_follow_the_cores_each_gpu_has(monkeypatch):
    monkeypatch.setattr(data_module.os, "sched_getaffinity", lambda pid: set(range(16)),
                        raising=False)
    decoded = ImageSource()  # decoded per step: workers are wanted
    assert default_num_workers(decoded, 1, cuda=True) == 15   # one core drives the GPU
    assert default_num_workers(decoded, 2, cuda=True) == 7
    assert default_num_workers(decoded, 8, cuda=True) == 1
    assert default_num_workers(decoded, 1, cuda=False) == 4   # a CPU step needs the cores
    assert default_num_workers(decoded, 8, cuda=False) == 2
    assert default_num_workers(decoded, 16, cuda=False) == 1  # its process's one core
    workers = default_num_workers(decoded, 3, cuda=True)  # 5 whole cores each, not 5.33
    assert workers == 4 and isinstance(workers, int)
    in_memory = _source()  # decoded already: workers resize, crop and flip, only for a GPU
    assert default_num_workers(in_memory, 1, cuda=True) == 15
    assert default_num_workers(in_memory, 2, cuda=True) == 7
    assert default_num_workers(in_memory, 8, cuda=True) == 1
    assert default_num_workers(in_memory, 16, cuda=True) == 0  # one core each: it drives the GPU
    assert default_num_workers(in_memory, 1, cuda=False) == 0  # a CPU step needs the cores
    monkeypatch.setattr(data_module.os, "sched_getaffinity", lambda pid: {0, 1, 2},
                        raising=False)  # a SLURM allocation of 3 of the machine's cores
    assert default_num_workers(decoded, 1, cuda=True) == 2


class FakeEvent:
    """A CUDA event whose device timestamp the test decides (milliseconds)."""
    clock = [0.0]
    made: list["FakeEvent"] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at, self.synced = None, False
        FakeEvent.made.append(self)

    def record(self):
        self.at = FakeEvent.clock[0]

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.at - self.at


def test_the_stream_clock_sums_the_device_gaps_between_its_event_pairs():
    FakeEvent.made.clear()
    clock = StreamWaitClock(FakeEvent)
    for start, end in [(0.0, 4.0), (10.0, 10.5), (20.0, 27.5)]:  # ms on the device's stream
        FakeEvent.clock[0] = start
        clock.before_fetch()
        FakeEvent.clock[0] = end
        clock.after_fetch()
    assert clock.take() == pytest.approx(0.012)  # 4 + 0.5 + 7.5 ms
    assert FakeEvent.made[-1].synced and not FakeEvent.made[0].synced  # one sync, at the end
    assert clock.take() == 0.0  # taken: the next window starts from nothing
    FakeEvent.clock[0] = 30.0
    clock.before_fetch()
    FakeEvent.clock[0] = 31.0
    clock.after_fetch()
    assert clock.take() == pytest.approx(0.001)  # and counts again


def test_the_clock_follows_the_device():
    assert isinstance(data_wait_clock("cuda"), StreamWaitClock)
    assert StreamWaitClock().event_type is torch.cuda.Event  # made only when fetching
    assert isinstance(data_wait_clock("cpu"), HostWaitClock)
    assert isinstance(data_wait_clock("mps"), HostWaitClock)


def test_the_host_clock_counts_only_the_time_inside_fetches():
    now = iter([1.0, 1.25, 5.0, 5.5])
    clock = HostWaitClock(lambda: next(now))
    for _ in range(2):  # 0.25 s, then 0.5 s (the 3.75 s of step in between is not a wait)
        clock.before_fetch()
        clock.after_fetch()
    assert clock.take() == pytest.approx(0.75) and clock.take() == 0.0


@pytest.fixture
def cuda_flags():
    saved = (torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision())
    yield
    torch.backends.cudnn.benchmark = saved[0]
    torch.set_float32_matmul_precision(saved[1])


def test_fast_cuda_math_is_set_on_cuda_only_and_said(cuda_flags):
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    assert use_fast_cuda_math(False) is None
    assert not torch.backends.cudnn.benchmark
    assert torch.get_float32_matmul_precision() == "highest"
    said = use_fast_cuda_math(True)
    assert torch.backends.cudnn.benchmark
    assert torch.get_float32_matmul_precision() == "high"
    assert "cuDNN autotuning" in said and "TF32" in said
    from accel_train.report import summary
    facts = {"model": {"model_name": "m", "class_names": ["a"], "image_size": 32},
             "trainable_parameters": 1, "world_size": 1, "global_batch": 8, "device": "cuda:0",
             "precision_used": "fp16", "channels_last": True, "speed_choice": "asked",
             "sync_bn": False, "train_samples": 8, "eval_samples": 8, "data_in_memory": True,
             "num_workers": 0, "steps_per_epoch": 1, "total_steps": 1, "output_dir": "o",
             "checkpoint_dir": "o/c", "cuda_math": said}
    assert f"\n  cuda: {said}\n" in summary(facts, "data", 1, None, "metrics.jsonl")
    assert "\n  cuda: " not in summary({**facts, "cuda_math": None}, "data", 1, None, "m")


def test_erasing_draws_on_the_host_whatever_the_images_device():
    """On a GPU, timm writing each patch into a device image costs a host-to-device copy that
    waits for the queued GPU work, once per image: the patches are drawn into host tensors and
    the device sees one operation.  Images on the meta device stand in for a GPU's."""
    seen = []

    def spy(image):
        seen.append(image.device.type)
        image[:, :2, :2] = 0.0
        return image

    images = torch.empty(3, 3, 8, 8, device="meta")
    out = apply_erasing(images, erasing_plan(spy, images.shape, SEED, [0, 0, 1], [4, 5, 6]))
    assert seen == ["cpu"] * 3 and out.device.type == "meta" and out.shape == images.shape
