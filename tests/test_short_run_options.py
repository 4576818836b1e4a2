"""The options taken from the fastest short-run CIFAR-10 trainers (airbench), each against an
independent oracle: --flip alternate (which images are mirrored, read off the pixels),
--tta flip-translate (the six views built by hand with index arrays), and --whiten-stem (the
first convolution's filters against numpy's own eigendecomposition of the images' patches)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from accel_train.train import budget
from accel_train.data import synthetic
from accel_train.train.evaluate import logits_of
from accel_train.data.transforms import ImageTransform
from accel_train.base.errors import UsageError
from accel_train.model.whitening import first_conv, patch_covariance, whiten_first_conv
from conftest import TINY_TRAIN, accel_train_here, model_spec_of
from faults import checkpoint_steps, metrics

IDENTITY = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))  # pixels stay 0..255


def _ramp_images(count: int, size: int) -> torch.Tensor:
    """Images whose columns brighten left to right: a mirrored crop is read off its middle."""
    ramp = torch.arange(size, dtype=torch.uint8) * (200 // size)
    return ramp.expand(count, 3, size, size).clone()


def _mirrored(out: torch.Tensor) -> np.ndarray:
    """Per image: True where the middle columns darken left to right (the ramp reversed).  The
    middle of any crop lies inside the original image, away from the reflect-padded border."""
    mid = out.shape[-1] // 2
    return (out[:, 0, 0, mid] > out[:, 0, 0, mid + 1]).numpy()


@pytest.mark.parametrize("size", [32, 80])   # the batched CIFAR path and the per-image one
def test_alternate_flip_mirrors_a_random_half_then_the_other_half(size):
    count = 64 if size > 32 else 400
    images = _ramp_images(count, size)
    indices = np.arange(count)
    seen = {}
    for mode in ("alternate", "random"):
        transform = ImageTransform(size, augment=True, flip=mode, **IDENTITY)
        seen[mode] = [_mirrored(transform.batch(images, 7, [epoch] * count, indices))
                      for epoch in range(4)]
    alternate, random = seen["alternate"], seen["random"]
    assert 0.3 < alternate[0].mean() < 0.7
    for epoch in range(4):
        assert (alternate[epoch] == (alternate[0] ^ bool(epoch % 2))).all(), epoch
    # the random flip is drawn afresh each epoch: not tied to epoch 0 that way
    assert not (random[1] == ~random[0]).all() and not (random[2] == random[0]).all()
    # alternate is still a function of the seed: another seed mirrors other images
    other = ImageTransform(size, augment=True, flip="alternate", **IDENTITY)
    assert (_mirrored(other.batch(images, 8, [0] * count, indices)) != alternate[0]).any()


def _crop_shifts(config, size: int = 32) -> tuple[set[int], set[int]]:
    """The (vertical, horizontal) offsets of the training crops run_transforms builds for
    `config` (what the CLI calls), read off images whose pixels hold their own row (channel 0)
    and column (channel 1) index x 7: the crop's middle pixel shows where it came from (a
    mirrored crop's middle column is the one left of the middle)."""
    from types import SimpleNamespace

    from accel_train.data.loaders import run_transforms
    ramp = torch.arange(size, dtype=torch.uint8) * 7
    images = torch.zeros(600, 3, size, size, dtype=torch.uint8)
    images[:, 0] = ramp.view(size, 1)
    images[:, 1] = ramp.view(1, size)
    train, _ = run_transforms(config, SimpleNamespace(image_size=size, **IDENTITY))
    out = train.batch(images, 3, [0] * 600, np.arange(600)).round().to(torch.int64)
    mid = size // 2
    rows = out[:, 0, mid, mid] // 7 - mid
    mirrored = out[:, 1, mid, mid + 1] < out[:, 1, mid, mid]
    cols = out[:, 1, mid, mid] // 7 - torch.where(mirrored, mid - 1, mid)
    return set(rows.tolist()), set(cols.tolist())


def test_crop_pad_bounds_the_training_crops_shift():
    """--crop-pad 2: every crop shifted by -2..2 rows and columns, each of the five seen over
    600 images; not set: -4..4 at 32 px and -1..1 at 8 px (the size / 8, at least 1); 0: none."""
    from accel_train.config import TrainConfig
    both = lambda span: (set(span), set(span))    # noqa: E731
    assert _crop_shifts(TrainConfig(crop_pad=2)) == both(range(-2, 3))
    assert _crop_shifts(TrainConfig()) == both(range(-4, 5))
    assert _crop_shifts(TrainConfig(), size=8) == both(range(-1, 2))
    assert _crop_shifts(TrainConfig(crop_pad=0)) == both([0])


def _shifted(images: torch.Tensor, step: int) -> torch.Tensor:
    """The images moved `step` pixels down and right (step -1: up-left... as airbench's views:
    step +1 shows rows -1..H-2), borders reflected, by index arrays alone."""
    height = images.shape[-1]
    index = np.arange(height) - step
    index = np.abs(index)                                          # reflect at the top/left
    index = np.where(index > height - 1, 2 * (height - 1) - index, index)  # and bottom/right
    index = torch.from_numpy(index)
    return images.index_select(2, index).index_select(3, index)


def test_flip_translate_tta_averages_six_views_built_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(5)).eval()
    images = torch.randn(6, 3, 8, 8)
    model(images)

    def both(x):
        return (model(x) + model(x.flip(3))) / 2

    with torch.no_grad():
        expected = both(images) / 2 + (both(_shifted(images, 1)) + both(_shifted(images, -1))) / 4
        got = logits_of(model, images, "flip-translate")
        assert torch.allclose(got, expected, atol=1e-6)
        assert not torch.allclose(got, logits_of(model, images, "flip"), atol=1e-3)
    # the time budget counts what it costs: six passes per image per evaluated model
    assert budget.evaluation_passes(False, "flip-translate") == 6
    assert budget.evaluation_passes(True, "flip-translate") == 12


def _numpy_whitening(images: np.ndarray, kernel, eps: float):
    """Eigenvalues (descending) and eigenvectors (rows) of the patches' second moment: numpy's
    sliding windows and eigh, sharing nothing with the product's unfold.  `kernel`: (kh, kw)."""
    height, width = kernel
    windows = np.lib.stride_tricks.sliding_window_view(images, (height, width), axis=(2, 3))
    # [N, C, H', W', kh, kw] -> patches [N*H'*W', C*kh*kw] in Conv2d's (c, kh, kw) order
    patches = windows.transpose(0, 2, 3, 1, 4, 5).reshape(-1, images.shape[1] * height * width)
    covariance = patches.T @ patches / len(patches)
    values, vectors = np.linalg.eigh(covariance)
    order = np.argsort(values)[::-1]
    return values[order], vectors[:, order].T, covariance


def _assert_whitening(weights: np.ndarray, images: np.ndarray, eps: float,
                      per_vector: bool = True):
    """Filters 2k and 2k+1 are +-eigenvector k / sqrt(eigenvalue k + eps).  `per_vector`: each
    compared with numpy's own (for data whose eigenvalues are well apart: a near-tie leaves the
    vectors' directions within it arbitrary); always, the decorrelation it must achieve."""
    values, vectors, covariance = _numpy_whitening(images, weights.shape[-2:], eps)
    flat = weights.reshape(len(weights), -1)
    for k in range(len(flat) // 2):
        np.testing.assert_allclose(flat[2 * k + 1], -flat[2 * k], atol=1e-7)
        if per_vector:
            expected = vectors[k] / np.sqrt(values[k] + eps)
            sign = np.sign(flat[2 * k] @ expected)    # an eigenvector's sign is arbitrary
            np.testing.assert_allclose(flat[2 * k], sign * expected, atol=1e-5, rtol=1e-3)
    # what a whitening means: the filters' outputs are decorrelated, variance l/(l+eps)
    positive = flat[0::2]
    np.testing.assert_allclose(positive @ covariance @ positive.T,
                               np.diag(values[:len(positive)] / (values[:len(positive)] + eps)),
                               atol=1e-3)


def test_whitening_a_convolution_matches_numpy():
    rng = np.random.default_rng(0)
    # correlated channels, as in real images
    base = rng.normal(size=(40, 1, 12, 12))
    images = np.concatenate([base, 0.5 * base + rng.normal(size=base.shape),
                             rng.normal(size=base.shape)], axis=1).astype(np.float32)
    conv = nn.Conv2d(3, 64, 3, bias=True)   # more filters than 2 x 27: the rest keep theirs
    before = conv.weight.detach().clone()
    said = whiten_first_conv(conv, torch.from_numpy(images), bias_epochs=3)
    weights = conv.weight.detach().double().numpy()
    _assert_whitening(weights[:54], images.astype(np.float64), 5e-4)
    assert torch.equal(conv.weight[54:], before[54:]) and not conv.bias.any()
    assert "54 of 64 filters" in said and "40 training images" in said
    assert conv.weight.requires_grad and said.endswith("; the layer trains")
    # Every filter whitened: the weights are fixed (airbench's), the bias trains.
    whole = nn.Conv2d(3, 54, 3, bias=True)
    said = whiten_first_conv(whole, torch.from_numpy(images))
    assert not whole.weight.requires_grad and whole.bias.requires_grad
    assert said.endswith("; its weights fixed, its bias trains")
    torch.testing.assert_close(whole.weight, conv.weight[:54])
    # --whiten-bias-epochs: the words say for how long (a layer that trains whole: no limit)
    again = whiten_first_conv(nn.Conv2d(3, 54, 3, bias=True), torch.from_numpy(images),
                              bias_epochs=3)
    assert again.endswith("; its weights fixed, its bias trains for 3 epoch(s)")
    # another eps: each direction scaled by 1/sqrt(eigenvalue + that eps)
    other = nn.Conv2d(3, 54, 3, bias=False)
    whiten_first_conv(other, torch.from_numpy(images), eps=0.1)
    _assert_whitening(other.weight.detach().double().numpy(), images.astype(np.float64), 0.1)


def _strided_second_moment(images: np.ndarray, kernel: tuple[int, int], stride: int
                           ) -> np.ndarray:
    """The uncentred second moment of every stride-th patch, by slicing: the oracle."""
    rows, cols = images.shape[2] - kernel[0] + 1, images.shape[3] - kernel[1] + 1
    patches = [image[:, r:r + kernel[0], c:c + kernel[1]].reshape(-1)
               for image in images for r in range(0, rows, stride)
               for c in range(0, cols, stride)]
    flat = np.stack(patches)
    return flat.T @ flat / len(flat)


@pytest.mark.parametrize("height, width, stride",
                         [(65, 66, 2), (64, 67, 1), (129, 130, 4)])
def test_patch_covariance_of_big_images_takes_a_strided_grid(height, width, stride):
    """Above about 1,024 patch places an image contributes every stride-th patch, stride =
    floor(sqrt(places / 1024)): 64 x 64 places of a 2x3 kernel take every 2nd row and column,
    63 x 65 (4,095, just under) every one, 128 x 128 every 4th.  Non-square images and kernel:
    rows and columns kept apart."""
    images = np.random.default_rng(2).normal(size=(3, 3, height, width))
    got = patch_covariance(torch.from_numpy(images), (2, 3)).numpy()
    np.testing.assert_allclose(got, _strided_second_moment(images, (2, 3), stride), rtol=1e-10,
                               atol=1e-12)


class _TwoStems(nn.Module):
    """A layer registered before the one that reads the image, and a second convolution over
    the image's channels: which one is the first is the model's pretrained_cfg's to say."""

    def __init__(self, named_first: str = ""):
        super().__init__()
        self.head = nn.Conv2d(8, 8, 1)       # registered first, reads 8 channels
        self.stem = nn.Conv2d(3, 8, 3)
        self.side = nn.Conv2d(3, 8, 3)
        if named_first:
            self.pretrained_cfg = {"first_conv": named_first}


def test_the_first_convolution_is_the_one_reading_the_image_or_the_one_timm_names():
    assert first_conv(_TwoStems())[0] == "stem"            # not the 8-channel layer before it
    assert first_conv(_TwoStems("side"))[0] == "side"      # timm's pretrained_cfg names it
    assert first_conv(_TwoStems("missing"))[0] == "stem"   # a name the model does not have
    grouped = nn.Sequential(nn.Conv2d(3, 9, 3, groups=3))
    dilated = nn.Sequential(nn.Conv2d(3, 8, 3, dilation=2))
    for model in (grouped, dilated, nn.Sequential(nn.Linear(3, 3))):
        with pytest.raises(UsageError, match=r"^--whiten-stem: this model's first layer is not "
                           r"a plain convolution over the image's channels \(groups 1, no "
                           r"dilation\); train it without --whiten-stem$"):
            first_conv(model)


def test_whitening_a_one_channel_convolution_with_a_tall_kernel_and_no_bias():
    """Grayscale images and a 2x1 kernel: patches of 2 values, so 4 filters (each vector and its
    negative) fill the layer, which is then fixed; with no bias the words say nothing of one."""
    rng = np.random.default_rng(1)
    base = rng.normal(size=(40, 1, 12, 12))
    images = (base + 0.8 * np.roll(base, 1, axis=2)).astype(np.float32)  # rows correlated
    model = nn.Sequential(nn.Conv2d(1, 4, (2, 1), bias=False), nn.ReLU())
    said = whiten_first_conv(model, torch.from_numpy(images), bias_epochs=3)
    assert said == ("0 (4 of 4 filters, computed in float32) whitened from the 2x1 patches of "
                    "40 training images; its weights fixed")
    assert not model[0].weight.requires_grad
    _assert_whitening(model[0].weight.detach().double().numpy(), images.astype(np.float64),
                      5e-4)


def _spec(run: Path) -> dict:
    return model_spec_of(run)


def test_whiten_stem_through_the_command_line(tmp_path):
    """A run with --whiten-stem (test_resnet: a 3x3 first convolution with 16 filters, all
    whitened, so fixed): after two steps at learning rate 0.5 (with weight decay), its first
    convolution is still exactly numpy's whitening of its 256 training images, normalized as the
    run says; the summary says what was done."""
    out = tmp_path / "run"
    result = accel_train_here(*TINY_TRAIN, "--whiten-stem", "--max-steps", "2", "--lr", "0.5",
                              "--output-dir", str(out), check=True)
    assert "init: conv1.0 (16 of 16 filters, computed in float32) whitened from the 3x3 " \
           "patches of 256 training images; its weights fixed" in result.stdout
    spec = _spec(out)
    images, _ = synthetic.splits(256)["train"]
    pixels = images.transpose(0, 3, 1, 2).astype(np.float64) / 255
    mean, std = (np.array(spec[k]).reshape(1, 3, 1, 1) for k in ("mean", "std"))
    weights = load_file(str(out / "model.safetensors"))["conv1.0.weight"].double().numpy()
    _assert_whitening(weights, (pixels - mean) / std, 5e-4, per_vector=False)


def test_whiten_stem_refuses_pretrained_weights(tmp_path):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    result = accel_train_here(*TINY_TRAIN, "--whiten-stem", "--pretrained", str(weights),
                              "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "--whiten-stem" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_lookahead_optimizer_through_the_command_line(tmp_path):
    """--optimizer lookahead_sgd is timm's Lookahead around its SGD (k=6, alpha=0.5; its slow
    copy starts at the first sync, step 6, so that sync moves nothing): after 12 steps the
    weights lie halfway between plain SGD's at step 6 and at step 12 (same seed, same batches,
    same schedule)."""
    runs = {}
    for name in ("sgd", "lookahead_sgd"):
        runs[name] = tmp_path / name
        accel_train_here(*TINY_TRAIN, "--optimizer", name, "--max-steps", "12", "--lr", "0.2",
                         "--checkpoint-every", "6", "--output-dir", str(runs[name]), check=True)
    at_6 = load_file(str(runs["sgd"] / "checkpoints" / "step_00000006" / "model.safetensors"))
    at_12 = load_file(str(runs["sgd"] / "model.safetensors"))
    lookahead = load_file(str(runs["lookahead_sgd"] / "model.safetensors"))
    moved = 0
    for key, start in at_6.items():
        if not start.is_floating_point() or "running" in key:
            continue       # buffers: BatchNorm statistics are not the optimizer's
        halfway = start + 0.5 * (at_12[key] - start)
        torch.testing.assert_close(lookahead[key], halfway, atol=2e-6, rtol=1e-4)
        moved += int(not torch.allclose(at_12[key], start))
    assert moved > 10


def test_bn_momentum_through_the_command_line(tmp_path):
    """One training step with --bn-momentum m leaves each BatchNorm's running statistics at
    (1 - m) x their start (mean 0, variance 1) + m x the batch's: with m = 0.5 and 0.25 on the same
    first batch and weights, the batch's statistics solved from either run must agree."""
    stats = {}
    for momentum in ("0.5", "0.25"):
        out = tmp_path / momentum
        accel_train_here(*TINY_TRAIN, "--bn-momentum", momentum, "--max-steps", "1",
                         "--output-dir", str(out), check=True)
        stats[float(momentum)] = load_file(str(out / "model.safetensors"))
    means = [k for k in stats[0.5] if k.endswith("running_mean")]
    assert len(means) > 5
    for key in means:
        var = key.replace("running_mean", "running_var")
        torch.testing.assert_close(stats[0.5][key] / 0.5, stats[0.25][key] / 0.25)
        torch.testing.assert_close((stats[0.5][var] - 0.5) / 0.5, (stats[0.25][var] - 0.75) / 0.25,
                                   atol=1e-5, rtol=1e-4)
    assert any(stats[0.5][k].abs().max() > 1e-3 for k in means)   # the batch moved them


def test_norm_bias_lr_scale_through_the_command_line(tmp_path):
    """One step with --norm-bias-lr-scale 64 against one without, same batch and weights: each
    BatchNorm bias (zero at the start) moved exactly 64 times as far; every other tensor
    (convolutions, BatchNorm scales, the classifier's bias, running statistics) is identical.
    The logged learning rate is the run's (--learning-rate's schedule), not the shifts' 64x."""
    weights, logged = {}, {}
    for scale in ("1", "64"):
        out = tmp_path / scale
        accel_train_here(*TINY_TRAIN, "--norm-bias-lr-scale", scale, "--max-steps", "1",
                         "--log-every", "1", "--output-dir", str(out), check=True)
        weights[scale] = load_file(str(out / "model.safetensors"))
        logged[scale] = [r["lr"] for r in metrics(out) if r["type"] == "train"]
    assert logged["64"] == logged["1"] and len(logged["1"]) == 1, logged
    shifts = {k[:-len("running_mean")] + "bias" for k in weights["1"] if k.endswith("running_mean")}
    assert len(shifts) > 3 and "fc.bias" in weights["1"] and "fc.bias" not in shifts
    for key, value in weights["1"].items():
        if key in shifts:
            torch.testing.assert_close(weights["64"][key], 64 * value, rtol=1e-5, atol=1e-9)
        else:
            assert torch.equal(weights["64"][key], value), key
    # the step moved most (a block's inner ones wait: timm zero-inits its last BatchNorm scale)
    assert sum(bool(weights["1"][k].abs().max() > 0) for k in shifts) >= 5


def test_decay_norm_and_bias_through_the_command_line(tmp_path):
    """One step at learning rate 0.5, momentum 0.9 (Nesterov), weight decay 0.1, from the same
    weights and batch, with and without --decay-norm-and-bias: each one-dimensional parameter
    (BatchNorm scales and shifts, the classifier's bias) ends lower by lr x (1 + momentum) x
    decay x its start, torch's first Nesterov step with the decay added to the gradient, by
    hand (the shifts start at 0: no move); every other tensor, decayed in both runs, is
    identical.  The start: a run whose --lookahead-every 2 never syncs in its one step and ends
    on its initial weights (test_lookahead_every_through_the_command_line)."""
    weights = {}
    for name, extra in (("start", ["--lookahead-every", "2"]), ("plain", []),
                        ("all", ["--decay-norm-and-bias"])):
        out = tmp_path / name
        accel_train_here(*TINY_TRAIN, *extra, "--max-steps", "1", "--lr", "0.5",
                         "--momentum", "0.9", "--weight-decay", "0.1", "--warmup-epochs", "0",
                         "--output-dir", str(out), check=True)
        weights[name] = load_file(str(out / "model.safetensors"))
    start, plain, decayed = weights["start"], weights["plain"], weights["all"]
    norms = {k[:-len("running_mean")] for k in plain if k.endswith("running_mean")}
    one_d = {k for k in plain for norm in norms if k in (norm + "weight", norm + "bias")}
    one_d.add("fc.bias")
    assert len(one_d) > 6 and any(start[k].abs().min() > 0 for k in one_d)
    for key, value in plain.items():
        if key in one_d:
            torch.testing.assert_close(value - decayed[key], 0.5 * 1.9 * 0.1 * start[key],
                                       rtol=0, atol=1e-6)
        else:
            assert torch.equal(decayed[key], value), key


@pytest.mark.slow
def test_whiten_bias_epochs_through_the_command_line(tmp_path):
    """cifar_airbench_xs (its 2x2 whitened stem has a bias), 16 steps an epoch, 2 epochs: with
    --whiten-bias-epochs 1 the bias moved in epoch 1 and not at all in epoch 2 (no update, no
    momentum, no decay: bit-identical to the epoch-1 checkpoint's) while the rest trained on;
    with 2 it moved in both."""
    common = [a for a in TINY_TRAIN if a not in ("--epochs", "1")]
    common[common.index("test_resnet")] = "cifar_airbench_xs"
    moved = {}
    for epochs in ("1", "2"):
        out = tmp_path / epochs
        result = accel_train_here(*common, "--epochs", "2", "--whiten-stem",
                                  "--whiten-bias-epochs", epochs, "--checkpoint-every", "16",
                                  "--lr", "0.2", "--output-dir", str(out), check=True)
        assert f"its weights fixed, its bias trains for {epochs} epoch(s)" in result.stdout
        at_16 = load_file(str(out / "checkpoints" / "step_00000016" / "model.safetensors"))
        final = load_file(str(out / "model.safetensors"))
        assert at_16["stem.0.bias"].abs().max() > 0, "trained in epoch 1"
        assert not torch.equal(final["stages.0.0.weight"], at_16["stages.0.0.weight"])
        moved[epochs] = not torch.equal(final["stem.0.bias"], at_16["stem.0.bias"])
    assert moved == {"1": False, "2": True}


def test_lookahead_every_through_the_command_line(tmp_path):
    """One step, then the end of training at --max-steps 1 (where the model takes the slow copy).
    --lookahead-every 2 never syncs in one step, so the run ends on its starting state: weights
    as initialized, BatchNorm statistics at torch's 0 and 1.  --lookahead-every 1 syncs at
    step 1 of 1, rho = 0.95 ** 1 * (1/1) ** 3: every float tensor ends at
    start + 0.05 x (trained - start), trained being the same step without lookahead."""
    weights = {}
    for name, extra in (("start", ["--lookahead-every", "2"]), ("plain", []),
                        ("every1", ["--lookahead-every", "1"])):
        out = tmp_path / name
        accel_train_here(*TINY_TRAIN, *extra, "--max-steps", "1", "--output-dir", str(out),
                         check=True)
        weights[name] = load_file(str(out / "model.safetensors"))
    start, plain, every1 = weights["start"], weights["plain"], weights["every1"]
    means = [k for k in start if k.endswith("running_mean")]
    assert means and all(not start[k].any() for k in means)
    assert all(torch.equal(start[k.replace("mean", "var")], torch.ones_like(start[k]))
               for k in means)
    moved = 0
    for key, value in start.items():
        if not value.is_floating_point():
            continue
        expected = value + 0.05 * (plain[key] - value)
        torch.testing.assert_close(every1[key], expected, rtol=1e-5, atol=1e-7)
        moved += bool((plain[key] != value).any())
    assert moved > 10     # the step moved most tensors: the three runs differ


def test_lookahead_leaves_an_epoch_end_alone_and_ends_on_the_average(tmp_path):
    """2 epochs of 4 steps with --lookahead-every 5, against the same run without it (its
    checkpoints at every step) and the initial weights (a --max-steps 1 run of --lookahead-every
    2, test_lookahead_every_through_the_command_line).  Epoch 1's end (step 4) comes before any
    sync: its checkpoint holds the weights as trained, bit for bit those of the run without
    lookahead (not the slow copy, the initial weights).  Step 5 syncs at
    rho = 0.95^5 x (5/8)^3, and the end of training hands the model that slow copy: every float
    tensor ends at start + (1 - rho)(trained at step 5 - start), steps 6 to 8 dropped, by hand."""
    short = [a for a in TINY_TRAIN if a not in ("--epochs", "1")]
    short[short.index("256")] = "64"        # --synthetic-train-size: 4 steps of 16 an epoch
    runs = {}
    for name, extra in (("start", ["--epochs", "1", "--lookahead-every", "2", "--max-steps",
                                   "1"]),
                        ("plain", ["--epochs", "2", "--checkpoint-every", "1",
                                   "--keep-checkpoints", "8"]),
                        ("every5", ["--epochs", "2", "--lookahead-every", "5"])):
        runs[name] = tmp_path / name
        accel_train_here(*short, *extra, "--output-dir", str(runs[name]), check=True)

    def weights(name: str, step: int = 0) -> dict:
        folder = runs[name] / "checkpoints" / f"step_{step:08d}" if step else runs[name]
        return load_file(str(folder / "model.safetensors"))

    assert 4 in checkpoint_steps(runs["every5"])
    start, plain4, plain5 = weights("start"), weights("plain", 4), weights("plain", 5)
    every5_at_4, every5 = weights("every5", 4), weights("every5")
    assert all(torch.equal(every5_at_4[k], plain4[k]) for k in plain4)
    assert not all(torch.equal(start[k], plain4[k]) for k in plain4)
    rho = 0.95 ** 5 * (5 / 8) ** 3
    moved = 0
    for key, value in start.items():
        if value.is_floating_point():
            expected = value + (1 - rho) * (plain5[key] - value)
            torch.testing.assert_close(every5[key], expected, rtol=1e-5, atol=1e-7)
            moved += bool((plain5[key] != value).any())
    assert moved > 10


def test_eval_every_evaluates_every_nth_epoch_and_the_last(tmp_path):
    """3 epochs of 4 steps.  --eval-every 2: epoch 2 and the last evaluate, epoch 1 only
    checkpoints (said on the console), and --keep-best chooses among the evaluated checkpoints
    only; --eval-every 0: only the last.  Evaluating draws nothing: the weights end as those
    of --eval-every 1 to the bit, and the evaluations that run give that run's figures."""
    short = [*TINY_TRAIN, "--synthetic-train-size", "64", "--keep-checkpoints", "1",
             "--keep-best", "1"]
    runs, said = {}, {}
    for every, epochs in ((1, 3), (2, 3), (0, 2)):
        out = tmp_path / f"every{every}"
        said[every] = accel_train_here(*short, "--epochs", str(epochs), "--eval-every",
                                       str(every), "--output-dir", str(out), check=True).stdout
        runs[every] = (out, [r for r in metrics(out) if r["type"] == "epoch"])
    (every1, all_epochs), (every2, some), (every0, last_only) = runs[1], runs[2], runs[0]
    assert [r["step"] for r in some] == [4, 8, 12]
    assert ["eval_top1" in r for r in some] == [False, True, True]
    assert ["eval_top1" in r for r in last_only] == [False, True]
    assert [r["eval_top1"] for r in some[1:]] == [r["eval_top1"] for r in all_epochs[1:]]
    assert ": not evaluated (--eval-every 2)" in said[2].split("Epoch 1 ")[1].splitlines()[0]
    assert "not evaluated" not in said[2].split("Epoch 2 ")[1]
    a, b = (load_file(str(out / "model.safetensors")) for out in (every1, every2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    best = max(some[1:], key=lambda r: (r["eval_top1"], r["step"]))["step"]
    assert set(checkpoint_steps(every2)) == {12, best}
    assert set(checkpoint_steps(every0)) == {8}


def test_lookahead_decay_is_airbenchs_schedule():
    from accel_train.train.lookahead import decay
    assert decay(5, 240, 480) == pytest.approx(0.95 ** 5 * 0.5 ** 3)
    assert decay(5, 480, 480) == pytest.approx(0.7737809375)
    assert decay(5, 600, 480) == pytest.approx(0.7737809375)    # past the plan: the ceiling
    assert decay(1, 0, 480) == 0.0


def _bn_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 2))


def _floats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def test_lookahead_syncs_save_and_load_as_written_by_hand(tmp_path):
    """The slow copy against a dict of tensors updated by hand: a sync every 2nd step at
    rho = 0.95^2 x (step/4)^3, the model set to it; saved into the checkpoint folder and loaded
    into another model's average it continues the same; the end of training hands the model the
    slow copy; BatchNorm's step counter (an integer) is left alone."""
    from accel_train.train.lookahead import LOOKAHEAD_FILE, LookaheadAverage
    model = _bn_net(0)
    average = LookaheadAverage(model, every=2, total_steps=lambda: 4)
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * step)
            model[1].running_mean.add_(1.0)
        average.after_step(step)
    rho = 0.95 ** 2 * (2 / 4) ** 3
    # by hand: the model before the sync of step 2 is the start + 0.1 + 0.2 (parameters) and
    # + 2 (running mean); the sync moves the slow copy (the start) 1 - rho of the way there
    start = _floats(_bn_net(0))
    trained = {k: v + (0.3 if k in dict(model.named_parameters()) else 0.0)
               for k, v in start.items()}
    trained["1.running_mean"] = start["1.running_mean"] + 2.0
    expected = {k: start[k] + (1 - rho) * (trained[k] - start[k]) for k in start}
    for key, value in _floats(model).items():
        torch.testing.assert_close(value, expected[key])          # the model took the copy
    assert int(model[1].num_batches_tracked) == 0
    average.save(tmp_path)
    assert (tmp_path / LOOKAHEAD_FILE).is_file()
    other = _bn_net(1)
    restored = LookaheadAverage(other, every=2, total_steps=lambda: 4)
    restored.load(tmp_path)
    for key, value in restored.slow.items():
        torch.testing.assert_close(value, expected[key])
    with torch.no_grad():
        for p in other.parameters():
            p.add_(5.0)
    restored.at_training_end()                                     # rho 1: the slow copy as is
    for key, value in _floats(other).items():
        torch.testing.assert_close(value, expected[key])


def test_lookahead_load_without_a_file_warns_and_starts_from_the_weights(tmp_path):
    from accel_train.train.lookahead import LookaheadAverage
    said = []
    model = _bn_net(2)
    average = LookaheadAverage(model, every=5, total_steps=lambda: 10, warn=said.append)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)                     # the resumed weights, loaded after construction
    average.load(tmp_path)
    assert said == [f"{tmp_path} holds no lookahead average (saved without --lookahead-every): "
                    f"the average starts from the resumed weights"]
    for key, value in _floats(model).items():
        assert torch.equal(average.slow[key], value)
    with pytest.raises(ValueError, match=r"^every must be >= 1 \(got 0\)$"):
        LookaheadAverage(model, every=0, total_steps=lambda: 10)


def test_lookahead_refuses_another_models_average_in_one_line(tmp_path):
    from accel_train.train.lookahead import LookaheadAverage
    from accel_train.base.readers import BadFile
    LookaheadAverage(_bn_net(0), every=5, total_steps=lambda: 10).save(tmp_path)
    wider = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(128, 2))
    another = r"holds another model's weights .*0\.bias is \[4\], not \[8\]"
    with pytest.raises(BadFile, match=another):
        LookaheadAverage(wider, every=5, total_steps=lambda: 10).load(tmp_path)
    # cut short: refused, in the checkpoint's words, before anything is loaded
    path = tmp_path / "lookahead.safetensors"
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(BadFile, match=r"lookahead\.safetensors.*resume from another checkpoint"):
        LookaheadAverage(_bn_net(0), every=5, total_steps=lambda: 10).load(tmp_path)




def test_a_flip_translate_runs_export_card_shows_its_own_tta(tmp_path):
    """The model card's table has the run's own TTA beside none and flip, with the numbers
    `accel-train eval --tta flip-translate` gives, and the Hub header carries those."""
    import yaml

    run, export = tmp_path / "run", tmp_path / "export"
    accel_train_here(*TINY_TRAIN, "--max-steps", "4", "--tta", "flip-translate",
                     "--output-dir", str(run), check=True)
    accel_train_here("export", str(run), "-o", str(export), check=True)
    card = (export / "README.md").read_text()
    evaluated = json.loads(accel_train_here("eval", str(run), "--json", check=True).stdout)
    assert evaluated["tta"] == "flip-translate"
    row = next(line for line in card.splitlines() if line.startswith("| flip-translate"))
    assert "(the run's choice)" in row and f"{evaluated['top1']:.2%}" in row
    header = yaml.safe_load(card.split("---")[1])
    top1 = header["model-index"][0]["results"][0]["metrics"][0]["value"]
    assert top1 == pytest.approx(round(evaluated["top1"], 4))
