"""timm's data pipeline above the small-image size (data/transforms.py, SMALL_IMAGE = 64 px).

Oracles, all timm's own:
* held-out images: `timm.data.create_transform(**resolve_data_config(model=timm.create_model(
  NAME)))` on the PIL image, for models whose pretrained_cfg crops differently (crop_pct 0.875,
  0.9, 0.95; bilinear and bicubic; ImageNet's and 0.5 normalization) and for --crop-pct,
  --crop-mode and --interpolation given: the pixel tensors equal within 1e-5;
* the training crop: its area fraction and aspect ratio, read back from a position-coded image,
  against timm's RandomResizedCropAndInterpolation on the same image (a two-sample
  Kolmogorov-Smirnov test over 2000 draws each, which the 0.25 lower scale of before fails),
  the flips' frequencies against --hflip and --vflip;
* each training image equals timm's create_transform(is_training=True, ...) with the run's flags,
  called inside the sample's documented seeded block (randomness.seeded(seed, epoch, index,
  CROP_SALT));
* a run trained on JPEGs of 96-160 px: `accel-train predict` on its export (timm's folder and
  its ONNX file) gives the probabilities of timm's own pipeline,
  `timm.create_model("local-dir:EXPORT", pretrained=True)` with create_transform(
  **resolve_data_config(model=that)), within 1e-4, and the run's own last evaluation the loss
  of that pipeline on its held-out images.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from timm.data import create_transform, resolve_data_config
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision.transforms.v2 import functional as TF

from accel_train.base.randomness import seeded
from accel_train.cli import build_train_parser, config_from_args
from accel_train.data.decode import decode, read_value
from accel_train.data.loaders import HeldOutImages, TrainImages, run_transforms
from accel_train.data.sources import ArraySource, load_data
from accel_train.data.transforms import CROP_SALT, SMALL_IMAGE
from accel_train.model.saved import ModelSpec, write_model_folder
from accel_train.train.network import build_network

from conftest import PINNED, accel_train_here

TOLERANCE = 1e-4  # probabilities, predict against timm's pipeline


def parse(*argv: str):
    """A TrainConfig as the command line makes it."""
    return config_from_args(build_train_parser().parse_args(list(argv)), environ={})


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like RGB image: smooth colour gradients, a few soft blobs and a little grain (a
    resize of pure noise would hide interpolation differences in the noise's own average)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack([120 + 100 * np.sin(x / width * rng.uniform(2, 6) + rng.uniform(0, 6))
                       * np.cos(y / height * rng.uniform(1, 4)) for _ in range(3)], axis=-1)
    for _ in range(6):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(10, width / 4)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None]
        pixels += blob * rng.uniform(-90, 90, 3)
    pixels += rng.normal(0, 6, pixels.shape)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")


def write_jpegs(root: Path, sizes: dict[str, list[tuple[int, int]]], seed: int) -> list[Path]:
    """root/SPLIT/CLASS/i.jpg for each split's list of (width, height), alternating classes a and
    b; returns the files in writing order."""
    files = []
    for split, shapes in sizes.items():
        for i, (width, height) in enumerate(shapes):
            path = root / split / "ab"[i % 2] / f"{i}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            photo(width, height, seed + 1000 * len(files)).save(path, quality=92)
            files.append(path)
    return files


# -- (a) held-out images: timm's eval transform at the model's crop, or the one given -------------

EVAL_CASES = {
    "resnet18 0.95 bicubic": ("resnet18", []),
    "resnet18.tv_in1k 0.875 bilinear": ("resnet18.tv_in1k", []),
    "convnext_atto 0.875 bicubic": ("convnext_atto", []),
    "vit_tiny 0.9 bicubic mean 0.5": ("vit_tiny_patch16_224", []),
    "given squash 0.8 bicubic": ("test_resnet", ["--crop-mode", "squash", "--crop-pct", "0.8",
                                                 "--interpolation", "bicubic"]),
    "given border": ("convnext_atto", ["--crop-mode", "border"]),
    "given center 1.0 nearest": ("test_resnet", ["--crop-pct", "1.0", "--interpolation",
                                                 "nearest"]),
}


@pytest.fixture(scope="module")
def imagenet_like(tmp_path_factory) -> tuple[Path, list[Path]]:
    """JPEGs of ImageNet's typical size and aspect (500 x 375, and one 375 x 500)."""
    root = tmp_path_factory.mktemp("imagenet_like")
    files = write_jpegs(root, {"train": [(500, 375)] * 4,
                               "val": [(500, 375), (500, 375), (500, 375)]}, seed=3)
    return root, files


@pytest.mark.parametrize("case", EVAL_CASES)
def test_held_out_images_are_prepared_by_timms_eval_transform(case, imagenet_like, tmp_path):
    """The run's held-out transform, built as training builds it (build_network's spec, then
    run_transforms) for a fine-tuning run (--pretrained: the model's own mean and std), on the
    run's held-out images and on each JPEG as predict reads it, against timm's transform of the
    PIL image."""
    name, flags = EVAL_CASES[case]
    root, files = imagenet_like
    source_model = timm.create_model(name, pretrained=False)
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in source_model.state_dict().items()}, str(weights))
    resolved = resolve_data_config(model=source_model)
    overrides = {flag[2:].replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2])}
    expected_cfg = {**resolved, **{k: float(v) if k == "crop_pct" else v
                                   for k, v in overrides.items()}}
    config = parse("--data-dir", str(root), "--model", name, "--pretrained", str(weights),
                   "--image-size", str(resolved["input_size"][-1]), *flags)
    data = load_data(config)
    assert data.train.native_size > SMALL_IMAGE
    spec = build_network(config, data, 1, False, lambda text: None).spec
    assert (spec.crop_pct, spec.crop_mode, spec.interpolation) == \
        (expected_cfg["crop_pct"], expected_cfg["crop_mode"], expected_cfg["interpolation"])
    assert (spec.mean, spec.std) == (tuple(resolved["mean"]), tuple(resolved["std"]))
    oracle = create_transform(**expected_cfg)
    expected = {path: oracle(Image.open(path).convert("RGB")) for path in files}

    _, held_out_tf = run_transforms(config, spec)
    for path in files:  # as predict reads a file
        got = held_out_tf(decode(read_value(str(path))))
        assert got.shape == expected[path].shape == (3, spec.image_size, spec.image_size)
        assert float((got - expected[path]).abs().max()) <= 1e-5, path
    dataset = HeldOutImages(data.held_out, held_out_tf)
    batch = dataset.__getitems__(list(range(len(dataset))))  # the evaluation's batched read
    assert len(batch) == 3
    for image, _ in batch:
        assert min(float((image - e).abs().max()) for e in expected.values()) <= 1e-5


def test_small_images_keep_the_plain_resize_and_the_flags_still_reach_them(tmp_path):
    """At 64 px or less the held-out preparation stays the resize of both sides (no crop of a
    CIFAR image); --crop-pct given, it is timm's eval transform there too, so that the export
    still says what evaluation did."""
    config = parse("--model", "test_resnet")  # the embedded synthetic set: 32 px
    data = load_data(config)
    spec = build_network(config, data, 1, False, lambda text: None).spec
    assert (spec.crop_pct, spec.crop_mode, spec.interpolation) == (1.0, "squash", "bilinear")
    image = data.held_out.images[0]
    _, held_out_tf = run_transforms(config, spec)
    assert torch.equal(held_out_tf.pixels(image), image)  # 32 px at 32 px: untouched
    config = parse("--model", "test_resnet", "--crop-pct", "0.75", "--crop-mode", "center")
    spec = build_network(config, data, 1, False, lambda text: None).spec
    assert (spec.crop_pct, spec.crop_mode, spec.interpolation) == (0.75, "center", "bilinear")
    _, held_out_tf = run_transforms(config, spec)
    oracle = create_transform(32, crop_pct=0.75, crop_mode="center", interpolation="bilinear",
                              use_prefetcher=True)
    assert torch.equal(held_out_tf.pixels(image), oracle(TF.to_pil_image(image)))


# -- (b) the training crop's distribution against timm's sampler ----------------------------------

DRAWS = 2000
KS_CRITICAL = 1.949 * math.sqrt(2 / DRAWS)  # two samples of DRAWS, significance 0.001
CODED_W, CODED_H, OUT = 500, 375, 48


def coded_image() -> torch.Tensor:
    """Each pixel's position in its colour: R = row % 256, G = column % 256, B = row // 256 +
    16 x (column // 256).  A crop resized with nearest-neighbour interpolation holds source
    pixels only, so the rows and columns it sampled read straight off its colours."""
    rows = torch.arange(CODED_H).view(-1, 1).expand(CODED_H, CODED_W)
    cols = torch.arange(CODED_W).view(1, -1).expand(CODED_H, CODED_W)
    return torch.stack([rows % 256, cols % 256, rows // 256 + 16 * (cols // 256)]).to(torch.uint8)


def read_crop(out: torch.Tensor) -> tuple[float, float, bool, bool]:
    """(area fraction, aspect w/h, mirrored, upside down) of a nearest-resized crop of
    `coded_image`: the sampled rows span (rows - 1) x OUT / (OUT - 1) source rows, to a pixel."""
    pixels = out.to(torch.int64)
    rows = pixels[0] + 256 * (pixels[2] % 16)
    cols = pixels[1] + 256 * (pixels[2] // 16)
    h = (int(rows.max() - rows.min()) + 1) * OUT / (OUT - 1)
    w = (int(cols.max() - cols.min()) + 1) * OUT / (OUT - 1)
    return h * w / (CODED_H * CODED_W), w / h, bool(cols[0, 0] > cols[0, -1]), \
        bool(rows[0, 0] > rows[-1, 0])


def product_crops(*flags: str, draws: int = DRAWS) -> np.ndarray:
    """What training does to the coded image in `draws` epochs (as the loader reads it), with
    the flags given: rows of (area fraction, aspect, mirrored, upside down)."""
    config = parse("--train-interpolation", "nearest", "--color-jitter", "0", *flags)
    spec = ModelSpec("test_resnet", 1, ["a"], OUT, (0.5,) * 3, (0.5,) * 3)
    train_tf, _ = run_transforms(config, spec)
    dataset = TrainImages(ArraySource(coded_image()[None], torch.zeros(1, dtype=torch.long)),
                          train_tf, seed=11)
    return np.array([read_crop(dataset[epoch][0]) for epoch in range(draws)])


def timm_crops(scale, ratio) -> np.ndarray:
    """timm's RandomResizedCropAndInterpolation on the same image, DRAWS times from one stream of
    Python's `random` (its only generator), read back alike; beside it, get_params' own boxes."""
    crop = RandomResizedCropAndInterpolation(OUT, scale=scale, ratio=ratio,
                                             interpolation="nearest")
    pil = TF.to_pil_image(coded_image())
    state = random.getstate()
    random.seed(12345)
    try:
        measured = np.array([read_crop(TF.pil_to_tensor(crop(pil)))[:2] for _ in range(DRAWS)])
        random.seed(12345)
        boxes = [crop.get_params(pil, scale, ratio) for _ in range(DRAWS)]
    finally:
        random.setstate(state)
    exact = np.array([(h * w / (CODED_H * CODED_W), w / h) for _, _, h, w in boxes])
    # the read-back is that of get_params' boxes: to 3% of the area, 4% of the aspect, each draw
    assert np.abs(measured[:, 0] / exact[:, 0] - 1).max() < 0.03
    assert np.abs(measured[:, 1] / exact[:, 1] - 1).max() < 0.04
    return measured


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical
    distribution functions."""
    grid = np.sort(np.concatenate([a, b]))
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


@pytest.mark.slow
def test_training_crop_scale_and_aspect_follow_timms_sampler():
    """--scale 0.08 1 (the default, timm's) and --ratio 3/4 4/3: the product's crops and timm's
    are one distribution (KS distance under the 0.001 critical value, for area fraction and log
    aspect); the 0.25 lower scale used before is told apart (and so is another ratio range),
    so the test fails for it.  --hflip 0.3 and --vflip 0.2 mirror and turn that share."""
    reference = timm_crops((0.08, 1.0), (3 / 4, 4 / 3))
    crops = product_crops("--scale", "0.08", "1", "--ratio", "0.75", "1.3333333333333333",
                          "--hflip", "0.3", "--vflip", "0.2")
    scale_d = ks_distance(crops[:, 0], reference[:, 0])
    aspect_d = ks_distance(np.log(crops[:, 1]), np.log(reference[:, 1]))
    print(f"KS: area {scale_d:.4f}, aspect {aspect_d:.4f}; critical {KS_CRITICAL:.4f}")
    assert scale_d < KS_CRITICAL and aspect_d < KS_CRITICAL
    assert crops[:, 0].min() < 0.1 and crops[:, 0].max() > 0.95  # the whole range is drawn
    # binomial: 4 standard deviations
    assert abs(crops[:, 2].mean() - 0.3) < 4 * math.sqrt(0.3 * 0.7 / DRAWS)
    assert abs(crops[:, 3].mean() - 0.2) < 4 * math.sqrt(0.2 * 0.8 / DRAWS)

    before = product_crops("--scale", "0.25", "1", "--hflip", "0", draws=1000)
    assert not before[:, 2].any() and not before[:, 3].any()  # --hflip 0, --vflip's default 0
    assert ks_distance(before[:, 0], reference[:, 0]) > 1.949 * math.sqrt(1 / 1000 + 1 / DRAWS)
    narrow = product_crops("--ratio", "0.9", "1.1", draws=1000)
    assert ks_distance(np.log(narrow[:, 1]), np.log(reference[:, 1])) > \
        1.949 * math.sqrt(1 / 1000 + 1 / DRAWS)


# -- each training image is timm's create_transform, drawn in the sample's seeded block ------------

TRAIN_CASES = {
    "timm's defaults": [],
    "every flag": ["--scale", "0.3", "0.9", "--ratio", "0.8", "1.25", "--hflip", "0.7",
                   "--vflip", "0.5", "--color-jitter", "0.3", "--train-interpolation", "bicubic"],
    "no jitter, bilinear": ["--color-jitter", "0", "--train-interpolation", "bilinear"],
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_each_training_image_is_timms_training_transform_in_its_seeded_block(case):
    """The loader's pixels of a photo of 200 x 150 px, for several (epoch, index), against timm's
    create_transform(is_training=True, scale=, ratio=, hflip=, vflip=, color_jitter=,
    interpolation=) given the run's flags, called on the PIL image inside the sample's
    documented key seeded(seed, epoch, index, CROP_SALT).  The defaults are timm's train.py's
    (colour jitter 0.4, random interpolation)."""
    flags = TRAIN_CASES[case]
    config = parse(*flags)
    spec = ModelSpec("test_resnet", 2, ["a", "b"], 72, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
    train_tf, _ = run_transforms(config, spec)
    images = [photo(200, 150, seed) for seed in range(3)]
    source = ArraySource(torch.stack([TF.pil_to_tensor(image) for image in images]),
                         torch.tensor([0, 1, 0]))
    dataset = TrainImages(source, train_tf, seed=5)
    oracle = create_transform(72, is_training=True, scale=tuple(config.scale),
                              ratio=tuple(config.ratio), hflip=config.hflip, vflip=config.vflip,
                              color_jitter=config.color_jitter or None,
                              interpolation=config.train_interpolation, use_prefetcher=True)
    keys = [0, 1, 2, 3 * 4 + 1, 3 * 9 + 2]  # epoch * 3 + index
    batch = dataset.__getitems__(keys)
    differs = 0
    for position, key in enumerate(keys):
        epoch, index = divmod(key, 3)
        with seeded(5, epoch, index, CROP_SALT):
            expected = oracle(images[index])
        assert torch.equal(dataset[key][0], expected), (case, key)
        assert torch.equal(batch[position][0], expected), (case, key)
        differs += not torch.equal(expected, oracle(images[index]))  # a draw, not a constant
    assert differs >= 4


def test_hflip_is_the_mirroring_probability_on_the_small_image_path_too():
    """32 px images, no shift (--crop-pad 0): each output is the image or its mirror; --hflip
    0.25 mirrors about a quarter, 0 none, 1 all; 0.5 (the default) keeps the draws of before
    this flag (the top bit of each sample's hash)."""
    images = torch.randint(0, 256, (400, 3, 32, 32), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(2))
    spec = ModelSpec("test_resnet", 1, ["a"], 32, (0.5,) * 3, (0.5,) * 3)

    def mirrored(*flags: str) -> np.ndarray:
        train_tf, _ = run_transforms(parse("--crop-pad", "0", *flags), spec)
        out = train_tf.pixel_batch(images, 3, [1] * 400, list(range(400)))
        same = [torch.equal(o, i) for o, i in zip(out, images)]
        flipped = [torch.equal(o, i.flip(-1)) for o, i in zip(out, images)]
        assert all(s != f for s, f in zip(same, flipped))
        return np.array(flipped)

    quarter = mirrored("--hflip", "0.25")
    assert abs(quarter.mean() - 0.25) < 4 * math.sqrt(0.25 * 0.75 / 400)
    assert not mirrored("--hflip", "0").any() and mirrored("--hflip", "1").all()
    half = mirrored()
    from accel_train.data.transforms import augment_bits
    top_bit = (augment_bits(3, [1] * 400, range(400)) >> np.uint64(63)).astype(bool)
    assert np.array_equal(half, top_bit)
    assert quarter[~half].sum() == 0  # a lower probability mirrors a subset of the higher's


def test_bad_pipeline_flags_are_one_line_naming_the_flag():
    for argv, words in ((["--scale", "0.5", "0.2"], "--scale"), (["--ratio", "0", "1"], "--ratio"),
                        (["--scale", "a", "1"], "--scale"), (["--hflip", "1.5"], "--hflip"),
                        (["--vflip", "-1"], "--vflip"), (["--color-jitter", "-0.1"],
                                                         "--color-jitter"),
                        (["--crop-pct", "0"], "--crop-pct"), (["--crop-mode", "middle"],
                                                              "--crop-mode"),
                        (["--flip", "alternate", "--hflip", "0.3"], "--flip alternate")):
        result = accel_train_here(*argv)
        assert result.returncode == 2, argv
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.stderr, lines
    assert parse("--aa", "rand-m9-mstd0.5").auto_augment == "rand-m9-mstd0.5"  # timm's spelling


# -- (c) a run above the small size, its export, and timm's own pipeline --------------------------

SIZES = {"train": [(96 + 8 * (i % 5), 160 - 12 * (i % 4)) for i in range(16)],
         "val": [(150, 110), (100, 140), (128, 96), (160, 120), (112, 150), (144, 144)]}


@pytest.mark.slow
def test_predict_on_an_export_gives_timms_own_pipelines_probabilities(tmp_path):
    """test_resnet (timm's pretrained_cfg: crop_pct 0.95, bilinear, center) trained 2 steps at
    96 px on JPEGs of 96-160 px, exported with --format onnx: config.json says that crop;
    `accel-train predict` on the folder and on model.onnx gives, and the run's last evaluation
    measured, what timm.create_model("local-dir:EXPORT", pretrained=True) with its own
    create_transform(**resolve_data_config(model=...)) gives on the same files."""
    data_dir, run, export = tmp_path / "photos", tmp_path / "run", tmp_path / "export"
    files = write_jpegs(data_dir, SIZES, seed=7)
    held_out = [p for p in files if p.parts[-3] == "val"]
    accel_train_here("--data-dir", str(data_dir), "--model", "test_resnet", "--image-size", "96",
                     "--batch-size", "8", "--max-steps", "2", "--num-workers", "0",
                     "--progress", "log", "--no-plots", *PINNED, "--output-dir", str(run),
                     check=True)
    accel_train_here("export", str(run), "-o", str(export), "--format", "onnx", check=True)
    config = json.loads((export / "config.json").read_text())
    cfg, names = config["pretrained_cfg"], config["label_names"]
    assert (cfg["crop_pct"], cfg["crop_mode"], cfg["interpolation"]) == \
        (0.95, "center", "bilinear")
    assert cfg["input_size"] == [3, 96, 96]

    model = timm.create_model("local-dir:" + str(export), pretrained=True).eval()
    transform = create_transform(**resolve_data_config(model=model))
    batch = torch.stack([transform(Image.open(p).convert("RGB")) for p in held_out])
    with torch.no_grad():
        logits = model(batch).double()
    expected = logits.softmax(dim=1).numpy()
    for target in (export, export / "model.onnx"):
        result = accel_train_here("predict", str(target), *map(str, held_out), "--json",
                                  "--top-k", "2", check=True)
        rows = [json.loads(line) for line in result.stdout.strip().splitlines()]
        assert [row["image"] for row in rows] == [str(p) for p in held_out]
        got = np.zeros_like(expected)
        for i, row in enumerate(rows):
            for entry in row["predictions"]:
                got[i, entry["index"]] = entry["probability"]
        worst = float(np.abs(got - expected).max())
        print(f"{target.name}: max |probability difference| {worst:.2e}")
        assert worst <= TOLERANCE, target

    # The run's own evaluation prepared its held-out images the same way.
    labels = torch.tensor([names.index(p.parts[-2]) for p in held_out])
    loss = float(torch.nn.functional.cross_entropy(logits, labels))
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"epoch"' in line]
    assert epochs[-1]["eval_loss"] == pytest.approx(loss, abs=1e-4)


def test_timms_test_size_of_the_export_is_the_size_the_run_evaluated_at(tmp_path):
    """resnet18's pretrained_cfg tests at 288 px with crop 1.0 (timm's validate.py takes the test
    size by default): a model folder of weights trained and evaluated at 96 px with crop 0.9
    makes timm resolve that size and crop with and without the test size."""
    spec = ModelSpec("resnet18", 2, ["a", "b"], 96, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3),
                     crop_pct=0.9, crop_mode="center", interpolation="bicubic")
    source = timm.create_model("resnet18", pretrained=False, num_classes=2)
    assert source.pretrained_cfg["test_input_size"] == (3, 288, 288)  # (the case in point)
    write_model_folder(source, tmp_path / "model", spec)
    loaded = timm.create_model(f"local-dir:{tmp_path / 'model'}", pretrained=True)
    for use_test_size in (False, True):
        resolved = resolve_data_config(model=loaded, use_test_size=use_test_size)
        assert resolved["input_size"] == (3, 96, 96), use_test_size
        assert (resolved["crop_pct"], resolved["crop_mode"], resolved["interpolation"]) == \
            (0.9, "center", "bicubic"), use_test_size
    assert source.pretrained_cfg["test_input_size"] == (3, 288, 288)  # the module's own, kept
