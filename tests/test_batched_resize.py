"""The device path's crops resized as a batch, as on a GPU (accel_train/data/batched_resize.py;
here on the CPU, whose own device path resizes crop by crop), against torchvision's own resize
of each crop (uint8, antialiased: PIL's filters and rounding), and PIL's resize where both
sides shrink; the weights of a halving by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from accel_train.data import batched_resize
from accel_train.data.batched_resize import resize_weights, resized_as_batch, resized_crops

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
    resized = resized_as_batch(crops, size, bicubic, CPU)
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
    resized = resized_as_batch(crops, 112, bicubic, CPU)
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
        resized = resized_as_batch([crop], 16, torch.tensor([True]), CPU)
        assert torch.equal(resized, torch.full((1, 3, 16, 16), level, dtype=torch.uint8))


def test_the_callers_matmul_precision_is_kept():
    """The products run in full float32, whatever the trainer asked for (TF32 on a GPU), and
    the setting is handed back."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        resized_as_batch(_crops(2, 10, 20), 8, torch.tensor([True, False]), CPU)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_cpu_resizes_crop_by_crop_with_torchvision():
    """On a CPU the dense products would cost 50 times the separable resize: torchvision's,
    exactly; no crops, an empty batch."""
    crops = _crops(4, 20, 60)
    bicubic = torch.tensor([True, False, True, False])
    expected = torch.stack([_torchvision(crop, 24, bool(cubic))
                            for crop, cubic in zip(crops, bicubic)])
    assert torch.equal(resized_crops(crops, 24, bicubic, CPU), expected)
    empty = resized_crops([], 16, torch.zeros(0, dtype=torch.bool), CPU)
    assert empty.shape == (0, 3, 16, 16) and empty.dtype == torch.uint8
