"""The device path's crops resized as a batch, as on a GPU (accel_train/data/batched_resize.py;
here on the CPU, whose own device path resizes crop by crop), against torchvision's own resize
of each crop (uint8, antialiased: PIL's filters and rounding), and PIL's resize where both
sides shrink; the weights of a halving by hand; each crop taken from its image by one gather,
against slicing it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from accel_train.data import batched_resize
from accel_train.data.batched_resize import padded_crops, resize_weights, resized_as_batch, \
    resized_crops

CPU = torch.device("cpu")


def _crops(count: int, low: int, high: int, seed: int = 0) -> list[torch.Tensor]:
    """Crops of random sizes: every third noise (a bicubic overshoot at every pixel), the rest
    smooth fields (what photographs mostly are)."""
    generator = torch.Generator().manual_seed(seed)
    crops = []
    for k in range(count):
        height, width = torch.randint(low, high + 1, (2,), generator=generator).tolist()
        if k % 3 == 0:
            crops.append(torch.randint(0, 256, (3, height, width), generator=generator,
                                       dtype=torch.uint8))
        else:
            coarse = torch.randint(0, 256, (3, height // 8 + 2, width // 8 + 2),
                                   generator=generator, dtype=torch.uint8)
            crops.append(TF.resize(coarse, [height, width], antialias=True))
    return crops


def _boxed(crops: list[torch.Tensor], seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What the device path hands over: each crop inside a larger image (margins of 0-6 px of
    noise on each side, which a box off by a pixel would take in) and its box (top, left,
    height, width) there; every third image a transposed view (not contiguous), as a quarter
    turn leaves a decoded photograph."""
    generator = torch.Generator().manual_seed(1000 + seed)
    images, boxes = [], []
    for k, crop in enumerate(crops):
        if k % 3 == 1:
            crop = crop.transpose(1, 2)
        top, bottom, left, right = torch.randint(0, 7, (4,), generator=generator).tolist()
        channels, height, width = crop.shape
        image = torch.randint(0, 256, (channels, top + height + bottom, left + width + right),
                              generator=generator, dtype=torch.uint8)
        image[:, top:top + height, left:left + width] = crop
        if k % 3 == 1:  # the same pixels, seen through a transposed view
            image, top, left = image.transpose(1, 2), left, top
        images.append(image)
        boxes.append([top, left, crops[k].shape[1], crops[k].shape[2]])
    return images, torch.tensor(boxes, dtype=torch.int64).view(-1, 4)


def _resized(crops: list[torch.Tensor], size: int, bicubic: torch.Tensor,
             seed: int = 0) -> torch.Tensor:
    """`resized_as_batch` of the crops, each handed over inside its image (`_boxed`)."""
    images, boxes = _boxed(crops, seed)
    return resized_as_batch(images, boxes, size, bicubic, CPU)


def _torchvision(crop: torch.Tensor, size: int, bicubic: bool) -> torch.Tensor:
    mode = TF.InterpolationMode.BICUBIC if bicubic else TF.InterpolationMode.BILINEAR
    return TF.resize(crop, [size, size], interpolation=mode, antialias=True)


@pytest.mark.parametrize("size, low, high", [(32, 40, 300), (64, 8, 200), (96, 1, 48)],
                         ids=["shrunk", "both", "enlarged"])
def test_each_crop_is_torchvisions_resize_of_it(size, low, high, monkeypatch):
    """Many chunks (a small chunk budget), crops in another order than their sizes."""
    monkeypatch.setattr(batched_resize, "CHUNK_BYTES", 3 * 120 * 120 * 4 * 3)
    crops = _crops(30, low, high)
    bicubic = torch.arange(30) % 2 == 0
    resized = _resized(crops, size, bicubic)
    assert resized.shape == (30, 3, size, size) and resized.dtype == torch.uint8
    for k, crop in enumerate(crops):
        expected = _torchvision(crop, size, bool(bicubic[k]))
        difference = (resized[k].int() - expected.int()).abs()
        # fixed-point weights there, float32 here: a level now and then, two at most
        assert difference.max() <= 2, (k, tuple(crop.shape), difference.max())
        assert difference.float().mean() < 0.05, (k, tuple(crop.shape))


def test_shrinking_both_sides_is_as_close_to_pils_resize_as_torchvisions():
    """The loader workers' resize (PIL) where both sides shrink, as a random-resized crop of a
    photograph mostly does: within a level of it, as close as torchvision's own resize comes
    (both sit a level off in 15-20% of the pixels of a tall bicubic crop)."""
    crops = _crops(12, 150, 400, seed=1)
    bicubic = torch.arange(12) % 2 == 1
    resized = _resized(crops, 112, bicubic)
    for k, crop in enumerate(crops):
        image = Image.fromarray(crop.permute(1, 2, 0).numpy())
        pil = torch.from_numpy(np.array(image.resize((112, 112), Image.BICUBIC if bicubic[k]
                                                     else Image.BILINEAR))).permute(2, 0, 1)
        ours = (resized[k].int() - pil.int()).abs().float()
        theirs = (_torchvision(crop, 112, bool(bicubic[k])).int() - pil.int()).abs().float()
        assert ours.max() <= max(1, theirs.max()), (k, ours.max(), theirs.max())
        assert ours.mean() <= theirs.mean() + 0.01, (k, ours.mean(), theirs.mean())


def test_a_halving_weighs_as_by_hand():
    """4 pixels to 2, bilinear: the filter doubles its radius to 2; output pixel 0 (centre 1.0)
    weighs pixels 0, 1, 2 by 0.75, 0.75, 0.25 over their sum 1.75, pixel 3 not at all; output
    pixel 1 (centre 3.0) mirrors it.  Padded to 6 pixels: nothing past the fourth."""
    weights = resize_weights(torch.tensor([4]), 2, 6, torch.tensor([False]))[0]
    expected = torch.tensor([[3, 3, 1, 0, 0, 0], [0, 1, 3, 3, 0, 0]], dtype=torch.float32) / 7
    assert torch.allclose(weights, expected, atol=1e-6), weights


def test_chunks_hold_every_crop_once_within_the_budget():
    """Largest first; a chunk grows while its padded float32 pixels stay within the budget;
    a crop larger than the budget is a chunk of its own."""
    budget = 3 * 10 * 10 * 4 * 2  # two 10x10 crops
    shapes = [(5, 5), (10, 10), (30, 30), (10, 9), (4, 12)]
    chunks = batched_resize._chunks(shapes, 3, budget)
    assert chunks == [[2], [1, 3], [4, 0]]  # 10x12 padding holds two: 4x12 and 5x5
    # a wide crop and a tall one of the same area pad to 20x20 together: too much
    assert batched_resize._chunks([(2, 20), (20, 2)], 3, budget) == [[0], [1]]


def test_black_stays_black_and_white_white():
    """A single crop (the batch's first sets the channels), all 0 or all 255, bicubic's
    overshoot clamped: the same levels after."""
    for level in (0, 255):
        crop = torch.full((3, 37, 23), level, dtype=torch.uint8)
        resized = _resized([crop], 16, torch.tensor([True]))
        assert torch.equal(resized, torch.full((1, 3, 16, 16), level, dtype=torch.uint8))


def test_weights_split_into_parts_bfloat16_holds_exactly():
    """Under TF32 or bfloat16 matmuls the weights go in as parts: their sum is the weights to
    the bit, and each part survives torch's own conversion to bfloat16 (8 significant bits)
    and back unchanged, as the levels 0-255 do."""
    generator = torch.Generator().manual_seed(1)
    weights = torch.cat([torch.rand(500, generator=generator),
                         -torch.rand(100, generator=generator) * 1e-3,
                         torch.tensor([1.0, 0.0, 1 / 3, -0.123456789, 2.0 ** -30])])
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        parts = batched_resize.exact_parts(weights)
        torch.set_float32_matmul_precision("highest")
        assert batched_resize.exact_parts(weights) == [weights]
    finally:
        torch.set_float32_matmul_precision(before)
    assert len(parts) == 3
    assert torch.equal(parts[0] + parts[1] + parts[2], weights)
    assert torch.equal((parts[0] + parts[1]) + parts[2], weights)
    for part in parts:
        assert torch.equal(part.to(torch.bfloat16).float(), part)
    levels = torch.arange(256, dtype=torch.float32)
    assert torch.equal(levels.to(torch.bfloat16).float(), levels)


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_the_pixels_do_not_depend_on_the_matmul_precision(precision):
    """What the trainer asks for on a GPU (TF32: "high") or less: the resize of the parts is as
    close to torchvision's, crop by crop, as full float32 products are (the parts' sums differ
    from one product's in the last bit, which moves a sum ending in exactly .5 by a level)."""
    crops = _crops(24, 20, 90, seed=5)
    bicubic = torch.tensor([k % 2 == 0 for k in range(24)])
    expected = torch.stack([_torchvision(c, 24, bool(b)) for c, b in zip(crops, bicubic)])
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        full = (_resized(crops, 24, bicubic).int() - expected.int()).abs()
        torch.set_float32_matmul_precision(precision)
        parts = (_resized(crops, 24, bicubic).int() - expected.int()).abs()
    finally:
        torch.set_float32_matmul_precision(before)
    assert parts.max() <= 1 and full.max() <= 1
    assert parts.float().mean() <= full.float().mean() + 0.002, (parts.float().mean(),
                                                                 full.float().mean())


def test_the_resize_never_touches_the_process_matmul_precision():
    """The products run on the decoding thread while the training thread trains: the
    process's setting (which the training thread's matmuls read) must stay what the trainer
    set throughout, not only after."""
    import threading
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    seen, done = set(), threading.Event()

    def resize_many():
        try:
            for seed in range(6):
                _resized(_crops(8, 30, 120, seed=seed), 32, torch.tensor([True] * 8))
        finally:
            done.set()

    worker = threading.Thread(target=resize_many)
    try:
        worker.start()
        while not done.is_set():
            seen.add(torch.get_float32_matmul_precision())
        worker.join()
        seen.add(torch.get_float32_matmul_precision())
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen == {"high"}, seen


def test_a_cpu_resizes_crop_by_crop_with_torchvision():
    """On a CPU the dense products would cost 50 times the separable resize: torchvision's,
    exactly; no crops, an empty batch."""
    crops = _crops(4, 20, 60)
    bicubic = torch.tensor([True, False, True, False])
    expected = torch.stack([_torchvision(crop, 24, bool(cubic))
                            for crop, cubic in zip(crops, bicubic)])
    images, boxes = _boxed(crops)
    assert torch.equal(resized_crops(images, boxes, 24, bicubic, CPU), expected)
    empty = resized_crops([], torch.zeros(0, 4, dtype=torch.int64), 16,
                          torch.zeros(0, dtype=torch.bool), CPU)
    assert empty.shape == (0, 3, 16, 16) and empty.dtype == torch.uint8


def test_the_gathered_crops_are_the_sliced_crops_zero_padded():
    """`padded_crops` against slicing by hand: each box's pixels in its slot's top left corner,
    zeros past it, for boxes of one pixel, whole images, transposed views and three channels
    of different images; a uint8 image's levels as float32 integers."""
    generator = torch.Generator().manual_seed(7)
    images = [torch.randint(0, 256, (3, h, w), generator=generator, dtype=torch.uint8)
              for h, w in [(9, 14), (20, 5), (1, 1), (12, 12), (30, 8)]]
    images[3] = images[3].transpose(1, 2)
    boxes = [[2, 3, 5, 9], [0, 0, 20, 5], [0, 0, 1, 1], [4, 1, 1, 11], [29, 7, 1, 1]]
    padded = padded_crops(images, boxes, CPU)
    expected = torch.zeros(5, 3, 20, 11)
    for k, (image, (top, left, height, width)) in enumerate(zip(images, boxes)):
        expected[k, :, :height, :width] = image[:, top:top + height, left:left + width].float()
    assert padded.dtype == torch.float32 and torch.equal(padded, expected)


def test_the_gather_costs_one_call_an_image_not_a_dozen():
    """The point of the gather: the operators the host issues for a chunk grow by one an image
    (its view as a row of pixels), not by a slice, a select and a copy a crop (counted by
    torch's profiler: the top-level aten operators, those Python called)."""
    from torch.profiler import ProfilerActivity, profile

    def calls(count: int) -> int:
        images = _crops(count, 10, 20)
        boxes = [[1, 2, image.shape[1] - 3, image.shape[2] - 4] for image in images]
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            padded_crops(images, boxes, CPU)
        return sum(event.cpu_parent is None and event.name.startswith("aten::")
                   for event in profiler.events())

    assert calls(40) - calls(8) <= 32, (calls(8), calls(40))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_gather_and_the_resize_on_cuda_are_the_cpus():
    """On the GPU (benchmarks/gpu_checks.sh runs it): the same padded crops to the bit (the
    int32 index on CUDA's index_select), and the resize within a level of the CPU's (the
    products' sums in another order)."""
    crops = _crops(20, 5, 120, seed=3)
    images, boxes = _boxed(crops, seed=3)
    cuda = torch.device("cuda")
    on_gpu = [image.to(cuda) for image in images]
    bicubic = torch.arange(20) % 2 == 0
    listed = boxes.tolist()
    assert torch.equal(padded_crops(on_gpu, listed, cuda).cpu(), padded_crops(images, listed, CPU))
    difference = (resized_as_batch(on_gpu, boxes, 40, bicubic, cuda).cpu().int()
                  - resized_as_batch(images, boxes, 40, bicubic, CPU).int()).abs()
    assert difference.max() <= 1, difference.max()
