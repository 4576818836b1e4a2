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

import os

import numpy as np
import pytest
import torch

from accel_train.data import loaders as data_module
from accel_train.data.augment import ERASING_SALT, apply_erasing, build_erasing, erasing_plan
from accel_train.base.ranks import fair_core_share, process_cores
from accel_train.data.loaders import FinishOnDevice, TrainImages, default_num_workers
from accel_train.train.datawait import HostWaitClock, StreamWaitClock, data_wait_clock
from accel_train.train.precision import use_fast_cuda_math
from accel_train.base.randomness import each_seeded, seeded
from accel_train.data.sources import ArraySource, ImageSource
from accel_train.data.transforms import ImageTransform

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
    finished = FinishOnDevice(transform)(pixels)
    assert finished.dtype == torch.float32
    np.testing.assert_array_equal(finished.numpy(), _numpy_normalized(pixels))
    # the same tensors as the one-call float path (held-out, predict, whitening use it)
    epochs, indices = np.array(keys) // N, np.array(keys) % N
    whole = transform.batch(_source().images.index_select(0, torch.from_numpy(indices)), SEED,
                            epochs, indices)
    assert torch.equal(whole, finished)


def test_erasing_on_the_device_half_is_timms_with_each_samples_seed():
    """The loader draws each batch's erasing with its pixels (in its workers, beside the
    training step), timm's, each sample inside its own seed; the device half writes it.  A
    reader that hands over no plan is a programming error, said at once (drawn there, the
    erasing would cost the training process its time and a sync a step)."""
    transform = ImageTransform(32, MEAN, STD, augment=True, erasing=build_erasing(1.0))
    dataset = TrainImages(_source(), transform, SEED, mark_replaced=True)
    keys = [N + 5, 3, 2 * N + 17, 9]
    batch = dataset.__getitems__(keys)
    handed_over = batch.tensors()
    assert len(handed_over) == 6 and handed_over[:4] == batch.samples_tensors()
    with pytest.raises(ValueError, match="no erasing plan"):
        FinishOnDevice(transform)(batch.images)
    finished = FinishOnDevice(transform)(batch.images, handed_over[4:])
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
    from accel_train.data import augment
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
    finish = FinishOnDevice(transform)
    handed = list(loader)
    expected = [transform.batch(_source().images.index_select(0, torch.tensor(part) % N), SEED,
                                np.array(part) // N, np.array(part) % N)
                for part in (keys[:3], keys[3:])]
    monkeypatch.setattr(ImageTransform, "erasing_plan",
                        lambda *a, **k: pytest.fail("drawn again in the training process"))
    for (pixels, _, batch_keys, _, *erasing), start, oracle in zip(handed, (0, 3), expected):
        assert len(erasing) == 2 and batch_keys.tolist() == keys[start:start + 3]
        assert torch.equal(finish(pixels, erasing), oracle)
    assert sum(batch[4].numel() for batch in handed) > 0  # some patches were drawn


def test_loader_workers_follow_the_cores_each_gpu_has(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)),
                        raising=False)
    decoded = ImageSource()  # decoded per step: workers are wanted

    def workers(source, processes, cuda):  # processes on the machine, not pinned
        return default_num_workers(source, process_cores(processes), cuda)

    assert workers(decoded, 1, cuda=True) == 15   # one core drives the GPU
    assert workers(decoded, 2, cuda=True) == 7
    assert workers(decoded, 8, cuda=True) == 1
    assert workers(decoded, 1, cuda=False) == 4   # a CPU step needs the cores
    assert workers(decoded, 8, cuda=False) == 2
    assert workers(decoded, 16, cuda=False) == 1  # its process's one core
    three = workers(decoded, 3, cuda=True)  # 5 whole cores each, not 5.33
    assert three == 4 and isinstance(three, int)
    in_memory = _source()  # decoded already: workers resize, crop and flip, only for a GPU
    assert workers(in_memory, 1, cuda=True) == 15
    assert workers(in_memory, 2, cuda=True) == 7
    assert workers(in_memory, 8, cuda=True) == 1
    assert workers(in_memory, 16, cuda=True) == 0  # one core each: it drives the GPU
    assert workers(in_memory, 1, cuda=False) == 0  # a CPU step needs the cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2},
                        raising=False)  # a SLURM allocation of 3 of the machine's cores
    assert workers(decoded, 1, cuda=True) == 2


@pytest.mark.parametrize("mine, others, share", [
    (range(16), [range(16)] * 7, 2.0),           # 8 ranks given the machine's 16 cores: 2 each
    (range(12), [range(12 * k, 12 * k + 12) for k in range(1, 8)], 12.0),  # pinned, 12 each
    (range(48), [range(48)] * 3 + [range(48, 96)] * 4, 12.0),  # a NUMA node's 48 cores, 4 ranks
    ({0, 1}, [{1}], 1.5),                        # core 0 its own, core 1 shared by two
    ({1}, [{0, 1}], 0.5),
    ({0, 1}, [], 2.0),                           # alone on its machine
])
def test_ranks_share_the_cores_their_affinities_share(mine, others, share):
    """By hand: each core counts 1/n for the n ranks of the machine that may run on it.
    Dividing a pinned rank's cores by the machine's 8 ranks again gave 12 // 8 = 1 core."""
    assert fair_core_share(mine, others) == pytest.approx(share)


def test_a_rank_pinned_to_cores_of_its_own_keeps_its_workers():
    """torchrun --numa-binding exclusive on a machine of 96 cores and 8 GPUs: each rank may run
    on 12 cores of its own; with the machine's cores divided by its 8 ranks (the rule before),
    12 // 8 = 1 core and a single loader worker fed the GPU."""
    pinned = fair_core_share(range(12), [range(12 * k, 12 * k + 12) for k in range(1, 8)])
    assert default_num_workers(ImageSource(), pinned, cuda=True) == 11


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


def _summary_facts(**changes) -> dict:
    """A run's resolved facts as report.summary reads them (a one-process GPU run)."""
    return {"model": {"model_name": "m", "class_names": ["a"], "image_size": 32},
            "trainable_parameters": 1, "world_size": 1, "global_batch": 8, "device": "cuda:0",
            "precision_used": "fp16", "channels_last": True, "speed_choice": "asked",
            "sync_bn": False, "train_samples": 8, "eval_samples": 8, "data_in_memory": True,
            "num_workers": 0, "steps_per_epoch": 1, "total_steps": 1, "output_dir": "o",
            "checkpoint_dir": "o/c", **changes}


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
    from accel_train.run.report import summary
    facts = _summary_facts(cuda_math=said)
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


# -- small in-memory images resized, cropped and flipped on the device (a GPU's runs) ------------

PLACEMENTS = [  # (stored size, trained size, transform options)
    (32, 32, dict(augment=True)),
    (32, 48, dict(augment=True)),  # upscaled, as CIFAR at 224 or 336 px on a GPU
    (32, 48, dict(augment=True, flip="alternate", crop_pad=2, erasing=build_erasing(0.5))),
    (16, 40, dict(augment=False)),  # a plain resize: no crop plan travels
    (32, 32, dict(augment=False, erasing=build_erasing(1.0))),  # erasing only when augmenting
    (64, 72, dict(augment=True)),  # the largest stored size still cropped CIFAR-style
]


@pytest.mark.parametrize("stored, size, options", PLACEMENTS)
@pytest.mark.parametrize("workers", [0, 2])
def test_images_placed_on_the_device_are_the_loaders_own_to_the_bit(stored, size, options,
                                                                   workers, monkeypatch):
    """Where the resize, crop and flip run (the loader, or the device half) must not change a
    value: on one device the same operations give the same bits.  Oracle: the one-call float
    path on the host (transform.batch, itself checked against a window of the reflect-padded
    image in test_augment.py); through the trainer's DataLoader, across worker processes."""
    source = _source(size=stored)
    transform = ImageTransform(size, MEAN, STD, **options)
    placed = TrainImages(source, transform, SEED, mark_replaced=True, place_on_device=True)
    assert placed.places_on_device
    keys = [N + 5, 3, 2 * N + 17, 9, 1, N + 30]
    loader = data_module.make_loader(placed, batch_size=3, num_workers=workers,
                                     prefetch_factor=2, persistent_workers=False,
                                     pin_memory=False, sampler=keys)
    finish = FinishOnDevice(transform, places=True)
    handed = list(loader)
    oracles = []
    for start, (pixels, _, batch_keys, _, *plans) in zip((0, 3), handed):
        part = keys[start:start + 3]
        epochs, indices = np.array(part) // N, np.array(part) % N
        # what travelled: the stored pixels, untouched, and the plans
        assert batch_keys.tolist() == part
        assert torch.equal(pixels, source.images.index_select(0, torch.from_numpy(indices)))
        assert len(plans) == int(transform.augment) + 2 * int(transform.erases)
        oracles.append(transform.batch(pixels, SEED, epochs, indices))
        assert oracles[-1].shape == (3, 3, size, size)
    # the plans came along: the device half draws nothing more
    monkeypatch.setattr(ImageTransform, "erasing_plan",
                        lambda *a, **k: pytest.fail("drawn again in the training process"))
    monkeypatch.setattr(ImageTransform, "crop_plan",
                        lambda *a, **k: pytest.fail("drawn again in the training process"))
    for (pixels, _, _, _, *plans), oracle in zip(handed, oracles):
        assert torch.equal(finish(pixels, plans), oracle), plans
    # and a loader that keeps the geometry gives those very tensors
    monkeypatch.undo()
    kept = TrainImages(source, transform, SEED, mark_replaced=True)
    assert not kept.places_on_device
    batch = kept.__getitems__(keys[:3])
    assert torch.equal(FinishOnDevice(transform)(batch.images, batch.tensors()[4:]),
                       finish(*_handed(placed, keys[:3])))


def _handed(dataset, keys):
    tensors = dataset.__getitems__(keys).tensors()
    return tensors[0], tensors[4:]


M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's step (Steele, Lea and Flood 2014; Vigna's splitmix64.c), in Python ints."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


@pytest.mark.parametrize("size, crop_pad, flip", [(32, None, "random"), (12, None, "random"),
                                                  (48, 5, "alternate")])
def test_the_crop_plan_is_the_documented_function_of_the_samples_place(size, crop_pad, flip):
    """Oracle, in Python integers: each sample's 64 bits are SplitMix64 chained over (seed,
    epoch, index); the flip is their top bit (under --flip alternate: the top bit of the
    epoch-0 bits, inverted in odd epochs); the offsets scale two 24-bit fields of the bits below
    it onto 0 .. 2 * pad (pad: --crop-pad, else the size / 8 and at least 1).  A resumed run's
    crops, and a checkpoint's from an earlier version, rely on this exact function."""
    transform = ImageTransform(size, MEAN, STD, augment=True, crop_pad=crop_pad, flip=flip)
    pad = crop_pad if crop_pad is not None else max(1, size // 8)
    span = 2 * pad + 1
    places = [(epoch, index) for epoch in (0, 1, 2, 7) for index in (0, 1, 5, 39, 12345)]
    plan = transform.crop_plan(SEED, [e for e, _ in places], [i for _, i in places])

    def bits(epoch, index):
        return _splitmix64(_splitmix64(_splitmix64(SEED) ^ epoch) ^ index)

    for (epoch, index), (top, left, mirrored) in zip(places, plan.tolist()):
        low = bits(epoch, index) >> 1
        assert top == ((low & 0xFFFFFF) * span) >> 24, (epoch, index)
        assert left == (((low >> 24) & 0xFFFFFF) * span) >> 24, (epoch, index)
        expected = bits(epoch, index) >> 63 if flip == "random" else \
            (bits(0, index) >> 63) ^ (epoch & 1)
        assert mirrored == expected, (epoch, index)
    many = transform.crop_plan(SEED, [0] * 400, list(range(400)))
    assert set(many[:, 0].tolist()) == set(many[:, 1].tolist()) == set(range(span))


def test_placing_keeps_to_the_images_device():
    """The crop plan arrives on the host or the device; the crop's index arithmetic follows the
    images (the meta device stands in for a GPU here: a tensor left on the host fails there as
    it would on CUDA)."""
    transform = ImageTransform(40, MEAN, STD, augment=True)
    plan = transform.crop_plan(SEED, [0, 1], [3, 4])
    for stored in (40, 32):  # cropped only, and resized then cropped
        images = torch.zeros(2, 3, stored, stored, dtype=torch.uint8, device="meta")
        placed = transform.place(images, plan)
        assert placed.device.type == "meta" and placed.shape == (2, 3, 40, 40)


def test_the_crop_plan_is_where_the_crop_window_lies():
    """Oracle: numpy's reflect pad and a slice at the plan's (top, left), mirrored where it says,
    after a resize; offsets within the padding; about half mirrored."""
    stored, size, pad = 16, 24, 3
    source = _source(size=stored)
    transform = ImageTransform(size, MEAN, STD, augment=True, crop_pad=pad)
    indices = np.arange(N)
    plan = transform.crop_plan(SEED, np.zeros(N, dtype=np.int64), indices)
    assert plan.shape == (N, 3) and plan.dtype == torch.int64
    assert 0 <= int(plan[:, :2].min()) and int(plan[:, :2].max()) <= 2 * pad
    assert 0.2 < float(plan[:, 2].float().mean()) < 0.8
    placed = transform.place(source.images, plan)
    from torchvision.transforms.v2 import functional as TF
    resized = TF.resize(source.images, [size, size], antialias=True).numpy()
    for i in range(N):
        padded = np.pad(resized[i], ((0, 0), (pad, pad), (pad, pad)), mode="reflect")
        top, left, mirrored = plan[i].tolist()
        window = padded[:, top:top + size, left:left + size]
        np.testing.assert_array_equal(placed[i].numpy(),
                                      window[:, :, ::-1] if mirrored else window)
    assert transform.place(source.images, None).shape == (N, 3, size, size)  # resize alone
    assert ImageTransform(size, MEAN, STD).crop_plan(SEED, [0], [1]) is None  # no augmenting


@pytest.mark.parametrize("why", ["policy", "large images", "decoded per step", "a CPU's run"])
def test_what_stays_in_the_loader(why):
    """--auto-augment works on the placed pixels, large images take a random resized crop
    each, images decoded per step are decoded there anyway: those keep the loader's geometry, and
    so does every run on a CPU (the step needs every core)."""
    from accel_train.data.augment import build_policy
    source, options, place = _source(), dict(augment=True), True
    if why == "policy":
        options["policy"] = build_policy("rand-m9-mstd0.5-inc1")
    elif why == "large images":
        source = _source(n=4, size=65)  # above 64 px: a random resized crop each
    elif why == "decoded per step":
        source = _Decoded(_source())
    else:
        place = False
    dataset = TrainImages(source, ImageTransform(32, MEAN, STD, **options), SEED,
                          place_on_device=place)
    assert not dataset.places_on_device
    batch = dataset.__getitems__([1, 2])
    assert batch.crop_plan is None and batch.images.shape == (2, 3, 32, 32)


class _Decoded(ImageSource):
    """The same images, read one by one as a decoding source hands them."""

    def __init__(self, source: ArraySource):
        self.source, self.labels = source, source.labels

    def __len__(self) -> int:
        return len(self.source)

    def samples_at(self, indices):
        return [self.source.images[i] for i in indices], list(indices)


@pytest.mark.parametrize("cuda", [True, False])
def test_a_gpus_run_places_its_small_in_memory_images_on_the_device(cuda, tmp_path):
    """build_loaders, as the trainer calls it: on a GPU the training loader's finishing half
    places the images; on a CPU it does not.  The run's summary says which."""
    from types import SimpleNamespace

    from accel_train.config import TrainConfig
    from accel_train.data.loading import build_loaders
    from accel_train.run.report import summary

    # the DataLoader path (the batches drawn on the device have tests of their own)
    config = TrainConfig(dataset="synthetic", batch_size=8, num_workers=0,
                         data_on_device="never")
    data = SimpleNamespace(train=_source(), held_out=_source(n=8), test=None)
    spec = SimpleNamespace(image_size=48, mean=MEAN, std=STD, crop_pct=1.0, crop_mode="squash",
                           interpolation="bilinear")
    loaders = build_loaders(config, data, spec, 1, 0, 1, cuda)
    assert loaders.train.finish.places is cuda
    assert loaders.train.loader.dataset.places_on_device is cuda
    facts = _summary_facts(num_workers=3, placed_on_device=cuda)
    said = "decoded in memory, resized and cropped on the device, 3 loader worker(s)\n"
    assert (said in summary(facts, "data", 1, None, "m")) is cuda


class _Substituting(_Decoded):
    """A decoding source whose image 2 could not be read: index 3's stands in for it, as a
    source with a broken image substitutes one (sources.py)."""

    def samples_at(self, indices):
        used = [3 if i == 2 else i for i in indices]
        return [self.source.images[i] for i in used], used


@pytest.mark.parametrize("mark_replaced", [True, False])
def test_a_replaced_image_is_marked_in_the_single_sample_and_the_batch_paths(mark_replaced):
    """Oracle: the source's own substitution (2 read as 3).  Marked: the sample's index where
    its image was replaced, else -1; without `mark_replaced` (the default) no mark at all."""
    transform = ImageTransform(32, MEAN, STD)
    options = {"mark_replaced": True} if mark_replaced else {}
    dataset = TrainImages(_Substituting(_source()), transform, SEED, **options)
    replaced, kept = dataset[2], dataset[N + 4]
    batch = dataset.__getitems__([2, N + 4])
    if not mark_replaced:
        assert len(replaced) == len(kept) == 3 and batch.replaced is None
        return
    assert replaced[3] == 2 and kept[3] == -1 and len(kept) == 4
    assert batch.replaced.tolist() == [2, -1]
    # the substitute's pixels and label, in the replaced sample's place
    assert torch.equal(replaced[0], _source().images[3]) and int(replaced[1]) == 3


@pytest.mark.slow  # stopped by a signal and resumed, > 10 s
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")  # a GPU's setting
def test_a_run_with_its_images_placed_on_the_device_stops_resumes_and_ends_bit_identical(
        tmp_path, monkeypatch):
    """End to end on a CPU, the trainer's loaders built as on a GPU (build_loaders' `cuda`, the
    only thing forced): the stored pixels and their crop and erasing plans go through
    Accelerate's prepared loader and a loader worker, a checkpoint, a SIGTERM in the second
    epoch and a resume that skips the batches already trained.  Oracle: the uninterrupted run
    that kept the geometry in the loader, to the bit (the same operations on one device)."""
    import os
    import signal

    from accel_train import trainer as trainer_module
    from accel_train.callbacks import Callback
    from conftest import PINNED, accel_train_here
    from faults import max_weight_difference

    command = ["--dataset", "synthetic", "--synthetic-train-size", "96", "--max-eval-samples",
               "32", "--model", "test_resnet", "--image-size", "40", "--batch-size", "16",
               "--epochs", "2", "--reprob", "0.5", "--flip", "alternate", "--num-workers", "1",
               "--checkpoint-every", "3", "--progress", "log", "--no-plots", *PINNED,
               "--data-on-device", "never"]  # a DataLoader (auto would hold these on a GPU)
    kept = accel_train_here(*command, "--output-dir", str(tmp_path / "kept"), check=True)
    assert "on the device" not in kept.stdout
    build = trainer_module.build_loaders
    # (build_loaders' `cuda`, its 7th argument, set; the device and the rest as given)
    monkeypatch.setattr(trainer_module, "build_loaders",
                        lambda *args, **kwargs: build(*args[:6], True, *args[7:], **kwargs))
    placed = tmp_path / "placed"

    class StopInTheSecondEpoch(Callback):  # 6 steps an epoch
        def on_checkpoint(self, trainer, path) -> None:
            if path.name == "step_00000009":
                os.kill(os.getpid(), signal.SIGTERM)

    stopped = accel_train_here(*command, "--output-dir", str(placed),
                               callbacks=[StopInTheSecondEpoch()])
    assert stopped.returncode == 143, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert "decoded in memory, resized and cropped on the device, 1 loader worker(s)" \
        in stopped.stdout
    resumed = accel_train_here(*command, "--output-dir", str(placed), "--resume", "auto",
                               check=True)
    assert "resumed from" in resumed.stdout and " at step 10" in resumed.stdout, resumed.stdout
    assert max_weight_difference(tmp_path / "kept", placed) == 0.0
