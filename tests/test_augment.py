"""Training augmentation (accel_train/data/loaders.py TrainImages, accel_train/data/transforms.py).

The dataset hands out uint8 pixels; normalizing and erasing run later, on the device
(tests/test_device_input.py).
Oracles: the one-image path (`__getitem__`) for the batched path (`__getitems__`); numpy's
reflect padding for the small-image pad-crop-flip; for the random resized crop of large images,
a coordinate-ramp image from whose output the crop box is read back and checked against the
documented ranges (scale 0.08-1, aspect 3/4-4/3, inside the image); its distribution against
timm's own sampler: tests/test_timm_pipeline.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accel_train.data.augment import build_erasing, build_policy
from accel_train.data.loaders import TrainImages
from accel_train.data.sources import ArraySource, ImageSource
from accel_train.data.transforms import SMALL_IMAGE, ImageTransform

IDENTITY = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))  # output = pixel / 255


class ListSource(ImageSource):
    """Images decoded one by one (data not held in memory)."""

    def __init__(self, images: list[torch.Tensor], labels: torch.Tensor):
        self._images, self.labels = images, labels

    def image(self, index: int) -> torch.Tensor:
        return self._images[index]


def _random_images(n: int, h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def _keys(n: int, count: int, seed: int) -> list[int]:
    """Sampler keys epoch * n + index over a few epochs, in a scrambled order."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 5, (count,), generator=gen) * n
            + torch.randint(0, n, (count,), generator=gen)).tolist()


def _as_pixels(images: torch.Tensor) -> np.ndarray:
    """The dataset's output as it is: uint8 pixels (normalizing waits for the device)."""
    assert images.dtype == torch.uint8
    return images.to(torch.int64).numpy()


SOURCES = {
    "in_memory_small": lambda: ArraySource(_random_images(12, 32, 32, 1), torch.arange(12) % 3),
    "in_memory_large": lambda: ArraySource(_random_images(6, 72, 90, 2), torch.arange(6) % 3),
    "per_image_same_size": lambda: ListSource(list(_random_images(12, 32, 32, 3)),
                                              torch.arange(12) % 3),
    "per_image_mixed_sizes": lambda: ListSource(
        [_random_images(1, 24 + 4 * (i % 3), 32, 10 + i)[0] for i in range(6)]
        + [_random_images(1, 70, 100, 20 + i)[0] for i in range(3)], torch.arange(9) % 3),
    # photos of many sizes, all above SMALL_IMAGE: timm's transform over the batch in one pass
    "per_image_photos_of_many_sizes": lambda: ListSource(
        [_random_images(1, 66 + 7 * i, 90 - 3 * i, 40 + i)[0] for i in range(8)],
        torch.arange(8) % 3),
}


@pytest.mark.parametrize("name", SOURCES)
def test_batched_path_equals_the_one_image_path_item_by_item(name):
    source = SOURCES[name]()
    dataset = TrainImages(source, ImageTransform(32, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3),
                                                 augment=True), seed=5)
    keys = _keys(len(source), 10, seed=len(name))
    batch = dataset.__getitems__(keys)
    assert len(batch) == len(keys)
    for position, key in enumerate(keys):
        single, batched = dataset[key], batch[position]  # (image, label, key, ...)
        image, label = single[0], single[1]
        assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
        assert torch.equal(batched[0], image), (name, position, key)
        assert int(batched[1]) == int(label) == int(source.labels[key % len(source)])
        assert len(batched) == len(single)
        assert [int(v) for v in batched[2:]] == [int(v) for v in single[2:]]


def _same_image_source(n: int, size: int) -> ArraySource:
    image = _random_images(1, size, size, 7)
    return ArraySource(image.expand(n, -1, -1, -1).contiguous(), torch.zeros(n, dtype=torch.long))


@pytest.mark.parametrize("size", [32, 80], ids=["pad_crop_flip", "random_resized_crop"])
def test_the_draw_depends_on_seed_and_on_index(size):
    n = 16
    source = _same_image_source(n, size)  # one image n times: only the index tells them apart
    transform = ImageTransform(32, **IDENTITY, augment=True)
    seed0, seed1 = TrainImages(source, transform, seed=0), TrainImages(source, transform, seed=1)
    by_index = [seed0[i][0] for i in range(n)]
    distinct = {tuple(_as_pixels(image).ravel()) for image in by_index}
    assert len(distinct) >= n - 2, f"only {len(distinct)} distinct crops for {n} indices"
    differs_by_seed = sum(not torch.equal(seed0[i][0], seed1[i][0]) for i in range(n))
    assert differs_by_seed >= n - 2
    epoch_3 = [seed0[3 * n + i][0] for i in range(n)]
    assert sum(not torch.equal(a, b) for a, b in zip(by_index, epoch_3)) >= n - 2
    # a function of (seed, epoch, index) alone: the global RNG does not matter
    torch.manual_seed(123)
    assert all(torch.equal(seed0[i][0], by_index[i]) for i in range(n))


def test_pad_crop_flip_is_a_window_of_the_reflect_padded_image():
    size, pad = 32, 32 // 8
    source = ArraySource(_random_images(40, size, size, 9), torch.zeros(40, dtype=torch.long))
    dataset = TrainImages(source, ImageTransform(size, **IDENTITY, augment=True), seed=3)
    offsets, flips = set(), []
    for index in range(40):
        out = _as_pixels(dataset[index][0])
        padded = np.pad(source.images[index].numpy().astype(np.int64),
                        ((0, 0), (pad, pad), (pad, pad)), mode="reflect")
        matches = [(top, left, flip)
                   for top in range(2 * pad + 1) for left in range(2 * pad + 1)
                   for flip in (False, True)
                   if np.array_equal(out, (lambda w: w[:, :, ::-1] if flip else w)(
                       padded[:, top:top + size, left:left + size]))]
        assert len(matches) == 1, (index, matches)
        offsets.add(matches[0][:2])
        flips.append(matches[0][2])
    assert 0.2 < np.mean(flips) < 0.8  # about half mirrored
    assert len(offsets) >= 20  # offsets spread over the 9 x 9 possibilities
    # every offset of the padding is reachable on both axes, the extremes included (a
    # 200-image draw misses one of the 9 values with probability about 1e-9)
    many = ArraySource(_random_images(200, size, size, 10), torch.zeros(200, dtype=torch.long))
    tops, lefts = set(), set()
    for index in range(200):
        out = _as_pixels(TrainImages(many, ImageTransform(size, **IDENTITY, augment=True),
                                     seed=3)[index][0])
        padded = np.pad(many.images[index].numpy().astype(np.int64),
                        ((0, 0), (pad, pad), (pad, pad)), mode="reflect")
        found = [(top, left) for top in range(2 * pad + 1) for left in range(2 * pad + 1)
                 if np.array_equal(out, padded[:, top:top + size, left:left + size])
                 or np.array_equal(out, padded[:, top:top + size, left:left + size][:, :, ::-1])]
        tops.add(found[0][0])
        lefts.add(found[0][1])
    assert tops == lefts == set(range(2 * pad + 1))


def test_augmenting_without_the_samples_place_is_refused():
    transform = ImageTransform(32, **IDENTITY, augment=True)
    image = _random_images(1, 32, 32, 5)[0]
    with pytest.raises(ValueError, match=r"^augmenting needs the sample's \(seed, epoch, index\)$"):
        transform.pixels(image)
    with pytest.raises(ValueError, match="augmenting needs"):
        transform(image)


def test_a_panorama_no_crop_fits_gets_the_central_square():
    """8 x 200 pixels: a crop of 0.08 of the area or more at an aspect within 3/4-4/3 never
    fits in 8 rows, so after its ten draws the crop falls back, as timm's
    RandomResizedCropAndInterpolation does, to the central 8 rows x round(8 x 4/3) = 11
    columns (the widest aspect allowed)."""
    height, width, size = 8, 200, 16
    ramp = _ramp_image(height, width)  # G = 3 * column (wrapping at 256: columns < 85 here)
    ramp[1] = torch.arange(width).view(1, -1).expand(height, width).to(torch.uint8)  # G = column
    source = ArraySource(ramp.unsqueeze(0).expand(6, -1, -1, -1).contiguous(),
                         torch.zeros(6, dtype=torch.long))
    dataset = TrainImages(source, ImageTransform(size, **IDENTITY, augment=True), seed=4)
    for index in range(6):
        out = _as_pixels(dataset[index][0])
        columns = sorted({int(v) for v in out[1].ravel()})
        assert columns[0] >= (width - 11) // 2 - 1 and columns[-1] <= (width + 11) // 2, \
            (index, columns)  # the central 11 columns: 94-104
        rows = sorted({int(v) for v in out[0].ravel()})
        assert rows[0] == 0 and rows[-1] == 2 * (height - 1), (index, rows)  # every row


def _pil_resized(image: torch.Tensor, size: int) -> np.ndarray:
    """The oracle: PIL's bilinear resize of a uint8 [3, H, W] image to size x size (PIL
    filters over the whole footprint when it shrinks: antialiased)."""
    from PIL import Image
    pil = Image.fromarray(image.permute(1, 2, 0).numpy()).resize((size, size), Image.BILINEAR)
    return np.asarray(pil).transpose(2, 0, 1).astype(int)


def test_a_larger_held_out_image_is_shrunk_as_pil_shrinks_it():
    """Noise, 128 x 96, to 32 x 32 by the held-out transform: PIL's bilinear resize, to the
    level (without antialiasing a shrink by 3-4 samples 2 of every 3-4 source pixels: noise
    comes through at full strength, off by 37 levels on average)."""
    noise = torch.randint(0, 256, (3, 128, 96), generator=torch.Generator().manual_seed(0),
                          dtype=torch.uint8)
    out = ImageTransform(32, **IDENTITY).pixels(noise).numpy().astype(int)
    assert np.abs(out - _pil_resized(noise, 32)).max() <= 1


def test_a_large_training_crop_is_shrunk_as_pil_shrinks_it():
    """A 64 x 2000 panorama: no crop of 0.08 of the area at an aspect of 3/4-4/3 fits in 64
    rows, so the crop is timm's fallback, the central 64 rows x round(64 x 4/3) = 85 columns,
    shrunk to 16 x 16: PIL's bilinear resize of that block, mirrored or not (the flip's
    coin)."""
    height, width, size = 64, 2000, 16
    noise = torch.randint(0, 256, (3, height, width), generator=torch.Generator().manual_seed(1),
                          dtype=torch.uint8)
    crop_width = round(height * 4 / 3)
    left = (width - crop_width) // 2
    expected = _pil_resized(noise[:, :, left:left + crop_width].contiguous(), size)
    transform = ImageTransform(size, **IDENTITY, augment=True)
    for index in range(4):
        out = transform.pixels(noise, (3, 0, index)).numpy().astype(int)
        error = min(np.abs(out - expected).max(), np.abs(out[..., ::-1] - expected).max())
        assert error <= 1, (index, error)


def _ramp_image(height: int, width: int) -> torch.Tensor:
    """R = 2 * row, G = 3 * column, B = 77: the crop box can be read back from the output."""
    rows = torch.arange(height).view(-1, 1).expand(height, width)
    cols = torch.arange(width).view(1, -1).expand(height, width)
    return torch.stack([2 * rows, 3 * cols, torch.full_like(rows, 77)]).to(torch.uint8)


def _fit_axis(profile: np.ndarray, slope_per_pixel: float, size: int) -> tuple[float, float, float]:
    """Source start and length of a resized span from its ramp profile (interior samples only:
    the antialiasing filter is cut at the borders); returns (start, length, worst residual).
    Output sample i (centre i + 0.5) comes from source coordinate start + (i + 0.5) * length /
    size - 0.5, whose ramp value is slope_per_pixel times that."""
    i = np.arange(3, size - 3)
    a, b = np.polyfit(i, profile[i], 1)
    residual = np.abs(a * i + b - profile[i]).max()
    length = a * size / slope_per_pixel
    start = b / slope_per_pixel - 0.5 * length / size + 0.5
    return start, length, residual


def test_random_resized_crop_of_large_images():
    height, width, size = 96, 80, 40
    assert max(height, width) > SMALL_IMAGE  # the random-resized-crop path, not pad-and-crop
    n = 48
    source = ArraySource(_ramp_image(height, width).expand(n, -1, -1, -1).contiguous(),
                         torch.zeros(n, dtype=torch.long))
    dataset = TrainImages(source, ImageTransform(size, **IDENTITY, augment=True), seed=4)
    boxes, flips = [], []
    for index in range(n):
        out = _as_pixels(dataset[index][0])
        assert out.shape == (3, size, size)
        assert (out[2] == 77).all()  # channels are never mixed
        # R depends on the row only, G on the column only: a crop, not a rotation or a shear
        assert (out[0].max(axis=1) - out[0].min(axis=1)).max() <= 1
        assert (out[1].max(axis=0) - out[1].min(axis=0)).max() <= 1
        rows, cols = out[0].mean(axis=1), out[1].mean(axis=0)
        flipped = cols[-1] < cols[0]
        top, h, res_r = _fit_axis(rows, 2.0, size)
        left, w, res_c = _fit_axis(cols[::-1] if flipped else cols, 3.0, size)
        assert max(res_r, res_c) < 1.5, (index, res_r, res_c)  # values come from the ramp
        assert -1 <= top and top + h <= height + 1, (index, top, h)
        assert -1 <= left and left + w <= width + 1, (index, left, w)
        scale, ratio = h * w / (height * width), w / h
        assert 0.08 - 0.03 <= scale <= 1.0 + 0.03, (index, scale)
        assert 3 / 4 - 0.05 <= ratio <= 4 / 3 + 0.05, (index, ratio)
        boxes.append((round(top), round(left), round(h), round(w)))
        flips.append(flipped)
        # deterministic per (seed, epoch, index); another epoch draws again
        assert torch.equal(dataset[index][0], dataset[index][0])
    assert 0.2 < np.mean(flips) < 0.8
    assert len(set(boxes)) >= n - 4
    scales = [h * w / (height * width) for _, _, h, w in boxes]
    assert min(scales) < 0.25 and max(scales) > 0.7  # the whole scale range is used
    ratios = [w / h for _, _, h, w in boxes]
    assert min(ratios) < 0.9 and max(ratios) > 1.1  # and both sides of the aspect range
    again = [dataset[n + index][0] for index in range(n)]  # epoch 1
    assert sum(not torch.equal(dataset[i][0], again[i]) for i in range(n)) >= n - 2


def test_a_sample_is_transformed_alike_alone_and_in_a_batch_with_every_random_piece_on():
    """--flip alternate, --auto-augment and --reprob 1 all on: each sample's tensor is the same
    whether it comes alone (`__call__`, the per-image reads), in a batch (`batch`), or in the
    two halves the loaders run apart (`pixel_batch` then `finish`); and its seed, its epoch
    and its index each move what is drawn for it."""
    transform = ImageTransform(32, **IDENTITY, augment=True, flip="alternate",
                               policy=build_policy("rand-m9-mstd0.5"),
                               erasing=build_erasing(1.0))
    images = _random_images(6, 32, 32, 5)
    seed, epochs, indices = 7, [0, 1, 2, 3, 0, 1], [0, 0, 0, 0, 3, 3]
    batched = transform.batch(images, seed, epochs, indices)
    alone = torch.stack([transform(images[k], (seed, epochs[k], indices[k]))
                         for k in range(len(images))])
    halves = transform.finish(transform.pixel_batch(images, seed, epochs, indices), seed, epochs,
                              indices)
    assert torch.equal(batched, alone) and torch.equal(batched, halves)
    one = images[:1]
    drawn = transform.batch(one, seed, [2], [5])
    assert torch.equal(drawn, transform.batch(one, seed, [2], [5]))
    for other in ((seed + 1, [2], [5]), (seed, [4], [5]), (seed, [2], [6])):
        assert not torch.equal(drawn, transform.batch(one, *other)), other


@pytest.mark.parametrize("augment", [True, False], ids=["training", "held_out"])
def test_photos_of_many_sizes_in_one_pass_are_each_photo_alone(augment):
    """A batch of photos of different sizes (decoded per step) through timm's transform in one
    pass, with every random piece on (--flip alternate, --vflip, --auto-augment, colour
    jitter, random interpolation), equals each photo through `pixels` alone: its own seed,
    epoch and index decide its draws, not its neighbours."""
    transform = ImageTransform(40, **IDENTITY, augment=augment, flip="alternate", vflip=0.5,
                               color_jitter=0.4, train_interpolation="random",
                               policy=build_policy("rand-m9-mstd0.5") if augment else None)
    photos = [_random_images(1, 66 + 9 * k, 120 - 7 * k, 60 + k)[0] for k in range(6)]
    seed, epochs, indices = 3, [0, 1, 2, 0, 1, 2], [4, 4, 9, 1, 0, 7]
    together = transform.pixel_list(photos, seed, epochs, indices)
    alone = torch.stack([transform.pixels(photo, (seed, epoch, index))
                         for photo, epoch, index in zip(photos, epochs, indices)])
    assert together.shape == (6, 3, 40, 40) and torch.equal(together, alone)
    # a small image among them (one of exactly SMALL_IMAGE px too): its own path, still each
    # alone's pixels
    for small in ((30, 28), (SMALL_IMAGE, SMALL_IMAGE)):
        mixed = [*photos[:3], _random_images(1, *small, 99)[0]]
        assert torch.equal(transform.pixel_list(mixed, seed, epochs[:4], indices[:4]),
                           torch.stack([transform.pixels(image, (seed, epochs[k], indices[k]))
                                        for k, image in enumerate(mixed)])), small


@pytest.mark.parametrize("flip", ["random", "alternate"])
def test_an_image_of_exactly_the_small_size_is_mirrored_or_not_but_never_resized(flip):
    """At SMALL_IMAGE px an image still takes the CIFAR-style path (above it, the random resized
    crop): with no padding to shift it, each output is the image or its mirror, pixel for pixel.
    --flip alternate mirrors a sample in epoch e exactly when it does not in epoch e + 1."""
    transform = ImageTransform(SMALL_IMAGE, **IDENTITY, augment=True, crop_pad=0, flip=flip)
    images = _random_images(8, SMALL_IMAGE, SMALL_IMAGE, 9)
    mirrored = {}
    for epoch in range(3):
        out = transform.pixel_batch(images, 3, [epoch] * 8, list(range(8)))
        for k in range(8):
            same, flipped = torch.equal(out[k], images[k]), torch.equal(out[k], images[k].flip(-1))
            assert same != flipped, (epoch, k)
            mirrored[epoch, k] = flipped
    if flip == "alternate":
        assert all(mirrored[0, k] != mirrored[1, k] and mirrored[0, k] == mirrored[2, k]
                   for k in range(8))
    assert 0 < sum(mirrored[0, k] for k in range(8)) < 8  # a draw, not all or none


def test_the_policy_draws_inside_each_samples_documented_seed():
    """The key a sample's --auto-augment draws come from is the documented one,
    randomness.seeded(seed, epoch, index, 0), so that a run resumed by another version of
    accel_train augments its samples as before.  Oracle: the policy called by hand in that
    seeded block, on the sample's crop-and-flip pixels (the same transform without a policy)."""
    from accel_train.base.randomness import seeded
    policy = build_policy("rand-m9-mstd0.5")
    with_policy = ImageTransform(32, **IDENTITY, augment=True, policy=policy)
    without = ImageTransform(32, **IDENTITY, augment=True)
    images = _random_images(4, 32, 32, 11)
    seed, epochs, indices = 5, [0, 1, 0, 2], [3, 3, 9, 1]
    out = with_policy.pixel_batch(images, seed, epochs, indices)
    cropped = without.pixel_batch(images, seed, epochs, indices)
    for k in range(4):
        with seeded(seed, epochs[k], indices[k], 0):
            expected = policy(cropped[k])
        assert torch.equal(out[k], expected), k
