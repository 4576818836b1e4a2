"""Each recipe component changes what it should, each checked against an oracle that
does not come from the code under test.

* Mixup / CutMix (accel_train.data.mixing.SeededMixup, timm's Mixup): the mixed batch is
  lam * x + (1 - lam) * x.flip(0) (Mixup) or x with one rectangle taken from x.flip(0) (CutMix,
  lam = 1 - box area / image area), with lam read back from the soft targets, which are the
  label-smoothed one-hots mixed by the same lam (written out here); a function of the position
  alone, and the global numpy state is left alone.  Through the CLI, a 2-step run with --mixup
  trains other weights than the same run without it.
* --auto-augment / --reprob (the loaders of accel_train.data.loading.build_loaders): a policy
  changes the images of the plain crop/flip path, deterministically per (seed, epoch, index),
  identically when the images are decoded in memory and when they are decoded per step (the same
  parquet JPEGs); random erasing replaces exactly one rectangle of per-pixel noise; no global RNG
  moves.
* --model-ema (a 2-step CLI run with --checkpoint-every 1): timm's ModelEmaV3 rule written out:
  after step 1 the average IS the weights (timm's decay is 0 at the first update), after step 2
  it is lerp(ema_1, w_2, 1 - decay); metrics.jsonl carries eval_ema_*; config.json says
  which weights model.safetensors holds, consistently with the last evaluation.
* --drop-path: the model's DropPath modules get timm's linear rule up to the rate, and a forward
  in train mode becomes stochastic.
* --optimizer: the first update of AdamW, Lion and LAMB written out by hand; config.yaml and the
  checkpoint's optimizer state show LAMB ran.
* --layer-decay: each parameter's learning rate is the peak times timm's own
  param_groups_layer_decay scale (computed here independently), the head keeps the peak, the
  stem gets the least, and the schedule keeps the ratios.
(--keep-best is covered by test_checkpoint.py.)
"""

from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
import yaml
from safetensors.torch import load_file

from accel_train.config import TrainConfig
from accel_train.data.mixing import SeededMixup
from conftest import TINY_TRAIN, accel_train_here, model_spec_of
from faults import metrics

# the smoothing: not timm Mixup's own default (0.1), so that a mixer which dropped the run's
# --label-smoothing would make other targets
NUM_CLASSES, SMOOTHING = 10, 0.2


# -- Mixup and CutMix -----------------------------------------------------------------------------

def _batch(seed: int = 0, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(size, 3, 32, 32, generator=gen), torch.arange(size) % NUM_CLASSES


def _smoothed(labels: torch.Tensor) -> torch.Tensor:
    off = SMOOTHING / NUM_CLASSES
    out = torch.full((len(labels), NUM_CLASSES), off)
    out[torch.arange(len(labels)), labels] = 1 - SMOOTHING + off
    return out


def _lam_from_targets(targets: torch.Tensor, labels: torch.Tensor) -> float:
    """lam from a row whose label differs from its partner's: t[label] = lam*on + (1-lam)*off."""
    off = SMOOTHING / NUM_CLASSES
    on = 1 - SMOOTHING + off
    row = next(i for i in range(len(labels)) if labels[i] != labels.flip(0)[i])
    return float((targets[row, labels[row]] - off) / (on - off))


def _mix(mixer: SeededMixup, position) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
    images, labels = _batch()
    mixed, targets = mixer(images.clone(), labels, position)
    return images, labels, mixed, targets


def _kind(images, mixed) -> str:
    unchanged = (mixed == images).all(dim=(0, 1))  # [H, W]: pixels no image of the batch changed
    if unchanged.all():
        return "none"
    return "cutmix" if unchanged.any() else "mixup"


def _mixer(**overrides) -> SeededMixup:
    values = {"seed": 3, "label_smoothing": SMOOTHING, "batch_size": 16, **overrides}
    return SeededMixup(TrainConfig(**values), NUM_CLASSES)


def test_mixup_is_lam_x_plus_one_minus_lam_flipped_with_matching_soft_targets():
    mixer = _mixer(mixup=0.8)
    lams = []
    for position in [(0, 16 * k, 0) for k in range(6)]:
        images, labels, mixed, targets = _mix(mixer, position)
        assert torch.allclose(targets.sum(dim=1), torch.ones(len(labels)), atol=1e-6)
        lam = _lam_from_targets(targets, labels)
        lams.append(lam)
        assert 0.0 <= lam <= 1.0
        expected_targets = lam * _smoothed(labels) + (1 - lam) * _smoothed(labels).flip(0)
        assert torch.allclose(targets, expected_targets, atol=1e-6), position
        expected = lam * images + (1 - lam) * images.flip(0)
        assert torch.allclose(mixed, expected, atol=1e-5), (position, lam)
    assert len({round(lam, 6) for lam in lams}) == len(lams), lams  # each batch its own lam


def test_cutmix_replaces_one_rectangle_and_lam_is_its_complement_area():
    mixer = _mixer(cutmix=1.0)
    for position in [(1, 16 * k, 0) for k in range(6)]:
        images, labels, mixed, targets = _mix(mixer, position)
        changed = (mixed != images).any(dim=0).any(dim=0)  # [H, W]
        lam = _lam_from_targets(targets, labels)
        if not changed.any():  # a box of zero area: lam 1, nothing mixed
            assert lam == pytest.approx(1.0)
            continue
        rows, cols = changed.any(dim=1).nonzero()[:, 0], changed.any(dim=0).nonzero()[:, 0]
        top, bottom, left, right = int(rows.min()), int(rows.max()) + 1, int(cols.min()), \
            int(cols.max()) + 1
        box = torch.zeros_like(changed)
        box[top:bottom, left:right] = True
        assert torch.equal(changed, box), position  # exactly one rectangle
        assert torch.equal(mixed[:, :, top:bottom, left:right],
                           images.flip(0)[:, :, top:bottom, left:right])
        area = (bottom - top) * (right - left)
        assert lam == pytest.approx(1 - area / (32 * 32), abs=1e-6), position
        expected_targets = lam * _smoothed(labels) + (1 - lam) * _smoothed(labels).flip(0)
        assert torch.allclose(targets, expected_targets, atol=1e-6)


def test_mixing_is_a_function_of_the_position_and_leaves_numpy_alone():
    mixer = _mixer(mixup=0.8, cutmix=1.0)
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    _, _, first, first_targets = _mix(mixer, (2, 48, 1))
    _, _, again, again_targets = _mix(_mixer(mixup=0.8, cutmix=1.0), (2, 48, 1))
    assert np.array_equal(np.random.get_state()[1], before), "the global numpy state moved"
    assert torch.equal(first, again) and torch.equal(first_targets, again_targets)
    for other in [(2, 48, 0), (2, 64, 1), (3, 48, 1)]:  # another rank, step, epoch
        _, _, mixed, targets = _mix(mixer, other)
        assert not torch.equal(targets, first_targets), other
    assert not torch.equal(_mix(_mixer(mixup=0.8, cutmix=1.0, seed=4), (2, 48, 1))[3],
                           first_targets), "--seed must change the mixing"


def test_switch_prob_and_mix_prob_choose_what_a_batch_gets():
    positions = [(0, 16 * k, 0) for k in range(16)]

    def kinds(**values):
        mixer = _mixer(**values)
        return [_kind(images, mixed) for images, _, mixed, _ in (_mix(mixer, p)
                                                                 for p in positions)]
    both = kinds(mixup=0.8, cutmix=1.0, mixup_switch_prob=0.5)
    assert {"mixup", "cutmix"} <= set(both), both
    assert set(kinds(mixup=0.8, cutmix=1.0, mixup_switch_prob=0.0)) <= {"mixup", "none"}
    assert set(kinds(mixup=0.8, cutmix=1.0, mixup_switch_prob=1.0)) <= {"cutmix", "none"}
    # --mixup-prob 0: no batch is mixed; the targets are the smoothed one-hots
    mixer = _mixer(mixup=0.8, cutmix=1.0, mixup_prob=0.0)
    for position in positions[:4]:
        images, labels, mixed, targets = _mix(mixer, position)
        assert torch.equal(mixed, images)
        assert torch.allclose(targets, _smoothed(labels), atol=1e-7)
    half = kinds(mixup=0.8, mixup_prob=0.5)
    assert "none" in half and "mixup" in half, half


# -- augmentation policies and random erasing, both data paths -----------------------------------

SPEC = SimpleNamespace(image_size=32, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
KEYS_EPOCH0 = list(range(0, 24))


def _train_loader(data_dir, in_memory: str, **options):
    from accel_train.data.loading import build_loaders
    from accel_train.data.sources import load_data

    config = TrainConfig(data_dir=str(data_dir), in_memory=in_memory, batch_size=16,
                         num_workers=0, **options)
    data = load_data(config)
    loaders = build_loaders(config, data, SPEC, 1, 0, 1, False)
    return loaders.train, data


def _images(train, keys) -> torch.Tensor:
    """What the training loop gets: the loader's uint8 pixels and the erasing plan drawn with
    them, finished "on the device"."""
    pixels, _, _, _, *plans = train.loader.dataset.__getitems__(keys).tensors()
    assert pixels.dtype == torch.uint8  # what travels to the device
    return train.finish(pixels, plans)


def _image(train, key) -> torch.Tensor:
    """One sample through the dataset's single-item path (its erasing plan drawn for it)."""
    dataset = train.loader.dataset
    pixels = dataset[key][0].unsqueeze(0)
    epoch, index = divmod(key, len(dataset.source))
    plan = dataset.transform.erasing_plan(pixels.shape, dataset.seed, [epoch], [index])
    return train.finish(pixels, plan or ())[0]


def _rng_states():
    return (random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state())


def _same_rng(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and torch.equal(a[2], b[2])


@pytest.fixture(scope="module")
def plain_paths(cifar10_layout):
    """The crop/flip path alone, in memory and per step."""
    memory, data = _train_loader(cifar10_layout, "always")
    per_step, per_step_data = _train_loader(cifar10_layout, "never")
    from accel_train.data.sources import ArraySource
    assert isinstance(data.train, ArraySource) and not isinstance(per_step_data.train, ArraySource)
    return memory, per_step


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "trivialaugment",
                                    "autoaugment-cifar10"])
def test_a_policy_changes_the_images_deterministically_on_both_data_paths(cifar10_layout,
                                                                         plain_paths, policy):
    plain = _images(plain_paths[0], KEYS_EPOCH0)
    assert torch.equal(plain, _images(plain_paths[1], KEYS_EPOCH0))  # the paths agree already
    memory, _ = _train_loader(cifar10_layout, "always", auto_augment=policy)
    per_step, _ = _train_loader(cifar10_layout, "never", auto_augment=policy)
    rng = _rng_states()
    augmented = _images(memory, KEYS_EPOCH0)
    assert _same_rng(rng, _rng_states()), "augmenting moved a global random state"
    assert augmented.shape == plain.shape and augmented.dtype == torch.float32
    changed = [(augmented[i] != plain[i]).any().item() for i in range(len(KEYS_EPOCH0))]
    assert sum(changed) >= len(changed) // 2, (policy, changed)
    # a function of (seed, epoch, index): again, one by one, in another order, per step
    assert torch.equal(_images(memory, KEYS_EPOCH0), augmented)
    shuffled = KEYS_EPOCH0[::-1]
    assert torch.equal(_images(memory, shuffled), augmented.flip(0))
    assert torch.equal(_image(memory, KEYS_EPOCH0[5]), augmented[5])
    assert torch.equal(_images(per_step, KEYS_EPOCH0), augmented), "in memory != per step"
    # another epoch of the same indices is augmented otherwise
    n = len(memory.loader.dataset)
    next_epoch = _images(memory, [n + k for k in KEYS_EPOCH0])
    assert not torch.equal(next_epoch, augmented)
    # and another seed
    other_seed, _ = _train_loader(cifar10_layout, "always", auto_augment=policy, seed=1)
    assert not torch.equal(_images(other_seed, KEYS_EPOCH0), augmented)


def test_random_erasing_replaces_one_rectangle_deterministically(cifar10_layout, plain_paths):
    plain = _images(plain_paths[0], KEYS_EPOCH0)
    memory, _ = _train_loader(cifar10_layout, "always", reprob=1.0)
    per_step, _ = _train_loader(cifar10_layout, "never", reprob=1.0)
    rng = _rng_states()
    erased = _images(memory, KEYS_EPOCH0)
    assert _same_rng(rng, _rng_states()), "erasing moved a global random state"
    assert torch.equal(_images(memory, KEYS_EPOCH0), erased)
    assert torch.equal(_images(per_step, KEYS_EPOCH0), erased), "in memory != per step"
    rectangles = 0
    for i in range(len(KEYS_EPOCH0)):
        changed = (erased[i] != plain[i]).any(dim=0)  # [H, W]
        if not changed.any():  # timm gives up after 10 draws that do not fit: rare
            continue
        rows, cols = changed.any(dim=1).nonzero()[:, 0], changed.any(dim=0).nonzero()[:, 0]
        box = torch.zeros_like(changed)
        box[rows.min():rows.max() + 1, cols.min():cols.max() + 1] = True
        assert torch.equal(changed, box), f"image {i}: not one rectangle"
        assert box.sum() < 32 * 32 / 3 + 32, f"image {i}: more than timm's max area"
        # per-pixel noise: every channel of every pixel in the box is replaced
        assert (erased[i][:, box] != plain[i][:, box]).all()
        rectangles += 1
    assert rectangles >= len(KEYS_EPOCH0) - 2, rectangles
    # probability 0.5: some images erased, some not
    half, _ = _train_loader(cifar10_layout, "always", reprob=0.5)
    changed = [(a != b).any().item() for a, b in zip(_images(half, KEYS_EPOCH0), plain)]
    assert 0 < sum(changed) < len(changed), changed


# -- stochastic depth -----------------------------------------------------------------------------

def _network(**options):
    from accel_train.train.network import build_network
    from accel_train.data.sources import load_data

    config = TrainConfig(model="test_resnet", synthetic_train_size=64, max_eval_samples=8,
                         **options)
    return build_network(config, load_data(config), 1, False, lambda text: None).model


def test_drop_path_reaches_the_model():
    from timm.layers import DropPath

    model = _network(drop_path=0.1)
    rates = [m.drop_prob for m in model.modules() if isinstance(m, DropPath)]
    blocks = sum(len(getattr(model, f"layer{i}")) for i in range(1, 5))
    # timm's ResNet rule: block b of B drops with rate * b / (B - 1); block 0 gets none
    expected = [0.1 * b / (blocks - 1) for b in range(1, blocks)]
    assert sorted(rates) == pytest.approx(expected), rates
    assert not [m for m in _network().modules() if isinstance(m, DropPath)]
    # and it acts: two forwards of one batch in train mode differ with it, not without it
    images = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def two_forwards(net):
        with torch.no_grad():  # timm zero-inits each block's last norm: wake the branches up
            for module in net.modules():
                if isinstance(module, torch.nn.BatchNorm2d):
                    module.weight.fill_(1.0)
        net.eval()
        for module in net.modules():  # train mode for DropPath only: BatchNorm stays fixed
            if isinstance(module, DropPath):
                module.train()
        with torch.no_grad():
            torch.manual_seed(1)
            first = net(images)
            torch.manual_seed(2)
            return first, net(images)
    first, second = two_forwards(model)
    assert not torch.equal(first, second)
    first, second = two_forwards(_network())
    assert torch.equal(first, second)


# -- optimizers and layer decay -------------------------------------------------------------------

LR, WD = 0.01, 0.1


def _one_update(name: str):
    """(optimizer, {name: (p0, grad, p1, weight decay of its group)}) after one step on small
    fixed gradients (global norm below 1: LAMB's gradient clipping stays out of the way)."""
    import timm

    from accel_train.train.optim import build_optimizer

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=NUM_CLASSES)
    optimizer = build_optimizer(model, TrainConfig(optimizer=name, learning_rate=LR,
                                                   weight_decay=WD))
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    gen = torch.Generator().manual_seed(5)
    before = {}
    for pname, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        before[pname] = (p.detach().clone(), p.grad.clone(), decay_of[id(p)])
    optimizer.step()
    return optimizer, {n: (before[n][0], before[n][1], p.detach().clone(), before[n][2])
                       for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["adamw", "lion", "lamb"])
def test_the_first_update_of_each_optimizer_is_its_own(name):
    import timm.optim

    optimizer, updates = _one_update(name)
    expected_type = {"adamw": torch.optim.AdamW, "lion": timm.optim.Lion,
                     "lamb": timm.optim.Lamb}[name]
    assert type(optimizer) is expected_type
    assert {float(g["weight_decay"]) for g in optimizer.param_groups} == {0.0, WD}
    # biases and norm weights (the 1-d parameters of this model) are the ones without decay
    no_decay = {n for n, (_, _, _, wd) in updates.items() if wd == 0}
    assert no_decay == {n for n, (p0, _, _, _) in updates.items() if p0.ndim <= 1}
    eps = optimizer.param_groups[0].get("eps") or 1e-8
    for pname, (p0, g, p1, wd) in updates.items():
        if name == "adamw":    # decoupled decay, then m_hat / (sqrt(v_hat) + eps) = g / (|g| + eps)
            expected = p0 * (1 - LR * wd) - LR * g / (g.abs() + eps)
        elif name == "lion":   # decoupled decay, then the sign of the (zero-started) momentum mix
            expected = p0 * (1 - LR * wd) - LR * torch.sign(g)
        else:                  # LAMB: Adam direction + decay, scaled by the trust ratio
            u = g / (g.abs() + eps) + wd * p0
            trust = (p0.norm() / u.norm()).item() if wd and p0.norm() > 0 and u.norm() > 0 \
                else 1.0
            expected = p0 - LR * trust * u
        assert torch.allclose(p1, expected, rtol=1e-4, atol=1e-7), (name, pname, wd)


def test_the_optimizers_update_differently():
    deltas = {}
    for name in ("adamw", "lion", "lamb", "sgd"):
        _, updates = _one_update(name)
        deltas[name] = torch.cat([(p1 - p0).flatten() for p0, _, p1, _ in updates.values()])
    names = list(deltas)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.equal(deltas[a], deltas[b]), (a, b)


@pytest.mark.parametrize("layer_decay, scale, optimizer", [(None, 2.0, "sgd"),
                                                           (0.5, 8.0, "sgd"),
                                                           (None, 8.0, "adamw")])
def test_norm_bias_lr_scale_multiplies_only_the_normalization_shifts(layer_decay, scale,
                                                                   optimizer):
    """--norm-bias-lr-scale S: every BatchNorm bias trains at S x the rate timm's grouping gives
    it (alone and with --layer-decay); every other parameter keeps timm's rate and weight decay
    (oracle: timm's own param groups, and the BatchNorm modules of the model); the optimizer
    is still the one asked for, with the momentum asked for."""
    import timm
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay

    from accel_train.train.optim import build_optimizer

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=NUM_CLASSES)
    peak = 0.1
    config = TrainConfig(learning_rate=peak, weight_decay=WD, layer_decay=layer_decay,
                         optimizer=optimizer, momentum=0.8)
    plain = build_optimizer(model, config)
    optimizer = build_optimizer(model, dataclasses.replace(config, norm_bias_lr_scale=scale))
    assert type(optimizer) is type(plain)
    assert {g.get("momentum", 0.8) for g in optimizer.param_groups} == {0.8}
    groups = (param_groups_layer_decay(model, weight_decay=WD, layer_decay=layer_decay)
              if layer_decay else param_groups_weight_decay(model, weight_decay=WD))
    oracle = {id(p): (g.get("lr_scale", 1.0), g["weight_decay"]) for g in groups
              for p in g["params"]}
    factor = scale
    shifts = {id(m.bias) for m in model.modules() if isinstance(m, nn.BatchNorm2d)}
    assert len(shifts) > 3
    names = {id(p): n for n, p in model.named_parameters()}
    seen = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            scale, wd = oracle[id(p)]
            wanted = peak * scale * (factor if id(p) in shifts else 1.0)
            assert group["lr"] == pytest.approx(wanted), names[id(p)]
            assert group["weight_decay"] == wd, names[id(p)]
            seen.add(id(p))
    assert seen == set(names)


@pytest.mark.parametrize("layer_decay, scale", [(None, 1.0), (None, 64.0), (0.5, 64.0)])
def test_decay_norm_and_bias_decays_every_parameter_the_shifts_per_step_alike(layer_decay, scale):
    """--decay-norm-and-bias: every trainable parameter has the weight decay (the oracle: its
    dimensions, where timm exempts every 1-d one), the BatchNorm shifts theirs divided by
    --norm-bias-lr-scale, so that rate x decay, the decay per step of torch's coupled weight
    decay, is the same for every parameter (airbench's decoupled decay), with --layer-decay's
    scales too; without the flag the 1-d parameters have none."""
    import timm

    from accel_train.train.optim import build_optimizer

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=NUM_CLASSES)
    peak = 0.1
    config = TrainConfig(learning_rate=peak, weight_decay=WD, layer_decay=layer_decay,
                         norm_bias_lr_scale=scale)
    shifts = {id(m.bias) for m in model.modules() if isinstance(m, nn.BatchNorm2d)}
    one_d = {id(p) for p in model.parameters() if p.ndim <= 1}
    assert len(shifts) > 3 and len(one_d) > len(shifts)   # BatchNorm scales, the fc bias
    for decay_all in (True, False):
        optimizer = build_optimizer(model, dataclasses.replace(config,
                                                               decay_norm_and_bias=decay_all))
        seen = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen.add(id(p))
                if not decay_all and id(p) in one_d:
                    assert group["weight_decay"] == 0
                elif id(p) in shifts:
                    assert group["weight_decay"] == pytest.approx(WD / scale)
                    # the layer's rate (the group's over the shifts' factor) x WD per step
                    layer_rate = group["lr"] / scale
                    assert group["lr"] * group["weight_decay"] == pytest.approx(layer_rate * WD)
                else:
                    assert group["weight_decay"] == pytest.approx(WD)
        assert seen == {id(p) for p in model.parameters() if p.requires_grad}


def test_layer_decay_scales_each_parameters_rate_as_timm_does():
    import timm
    from timm.optim import param_groups_layer_decay

    from accel_train.train.optim import build_optimizer, scheduler_for, Schedule

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=NUM_CLASSES)
    peak, decay = 0.1, 0.5
    optimizer = build_optimizer(model, TrainConfig(optimizer="adamw", learning_rate=peak,
                                                   weight_decay=WD, layer_decay=decay))
    no_wd = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    oracle = {}
    for group in param_groups_layer_decay(model, weight_decay=WD, layer_decay=decay,
                                          no_weight_decay_list=no_wd):
        for p in group["params"]:
            oracle[id(p)] = (group["lr_scale"], group["weight_decay"])
    names = {id(p): n for n, p in model.named_parameters()}
    seen = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            scale, wd = oracle[id(p)]
            assert group["lr"] == pytest.approx(peak * scale), names[id(p)]
            assert group["weight_decay"] == wd, names[id(p)]
            seen[names[id(p)]] = group["lr"]
    assert set(seen) == set(names.values())
    assert seen["fc.weight"] == pytest.approx(peak)           # the head keeps the peak
    assert seen["conv1.0.weight"] == min(seen.values()) < peak  # the stem gets the least
    order = [seen[n] for n, _ in model.named_parameters()]     # input to output: never less
    assert all(a <= b + 1e-12 for a, b in zip(order, order[1:])), order
    # biases and norms still without weight decay, with the layer's rate
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, WD}
    # the schedule multiplies every group by the same factor: the ratios stay
    scheduler = scheduler_for(optimizer, Schedule(warmup_steps=4, total_steps=10))
    initial = [g["lr"] for g in optimizer.param_groups]
    optimizer.step()
    scheduler.step()
    now = [g["lr"] for g in optimizer.param_groups]
    factors = {round(b / a, 9) for a, b in zip(initial, now)}
    assert len(factors) == 1, factors


# -- through the CLI: two 2-step runs -------------------------------------------------------------

TWO_STEPS = [*TINY_TRAIN, "--max-steps", "2", "--log-every", "1", "--checkpoint-every", "1",
             "--model-ema", "--model-ema-decay", "0.5", "--optimizer", "lamb"]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """The same 2-step run (EMA with decay 0.5, LAMB, a checkpoint after each step) without and
    with --mixup, in this process (no new process's seconds of imports)."""
    root = tmp_path_factory.mktemp("components")
    commands = {"ema": [], "mixup": ["--mixup", "0.8"]}
    for name, extra in commands.items():
        accel_train_here(*TWO_STEPS, *extra, "--output-dir", str(root / name), check=True)
    return {name: root / name for name in commands}


def _checkpoint(out, step: int):
    return out / "checkpoints" / f"step_{step:08d}"


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
def test_mixup_changes_training(cli_runs):
    plain = load_file(str(_checkpoint(cli_runs["ema"], 2) / "model.safetensors"))
    mixed = load_file(str(_checkpoint(cli_runs["mixup"], 2) / "model.safetensors"))
    assert _max_difference(plain, mixed) > 1e-6
    config = yaml.safe_load((cli_runs["mixup"] / "config.yaml").read_text())["train"]
    assert config["mixup"] == 0.8
    losses = [[r["loss"] for r in metrics(out) if r["type"] == "train"]
              for out in (cli_runs["ema"], cli_runs["mixup"])]
    assert losses[0] != losses[1] and len(losses[0]) == 2


@pytest.mark.slow
def test_model_ema_follows_timms_rule_and_is_evaluated_saved_and_exported(cli_runs):
    out, decay = cli_runs["ema"], 0.5
    model1 = load_file(str(_checkpoint(out, 1) / "model.safetensors"))
    ema1 = load_file(str(_checkpoint(out, 1) / "ema.safetensors"))
    model2 = load_file(str(_checkpoint(out, 2) / "model.safetensors"))
    ema2 = load_file(str(_checkpoint(out, 2) / "ema.safetensors"))
    assert ema1.keys() == model1.keys() == ema2.keys()
    floats = [k for k in ema1 if ema1[k].is_floating_point()]
    assert floats
    # timm's ModelEmaV3: the first update (step 1) copies the weights (its decay is 0 there)
    assert _max_difference(ema1, model1) == 0.0
    # then ema_2 = decay * ema_1 + (1 - decay) * w_2, buffers included (integers copied)
    for key in ema2:
        expected = torch.lerp(ema1[key], model2[key], 1 - decay) if ema2[key].is_floating_point() \
            else model2[key]
        assert torch.allclose(ema2[key], expected, atol=1e-6, rtol=1e-6), key
    assert _max_difference(ema2, model2) > 1e-6  # a real average, not the weights
    # evaluated at the epoch end beside the raw model
    epochs = [r for r in metrics(out) if r["type"] == "epoch"]
    assert len(epochs) == 1
    last = epochs[-1]
    for key in ("eval_ema_top1", "eval_ema_loss", "eval_ema_top5"):
        assert key in last, last
    assert 0.0 <= last["eval_ema_top1"] <= 1.0
    assert last["eval_ema_loss"] != last["eval_loss"]
    # exported: the better of the two on the held-out split, and config.json says which
    spec = model_spec_of(out)
    better = "ema" if last["eval_ema_top1"] > last["eval_top1"] else "model"
    if last["eval_ema_top1"] != last["eval_top1"]:
        assert spec["weights"] == better, (spec["weights"], last)
    assert spec["weights"] in ("ema", "model")
    exported = load_file(str(out / "model.safetensors"))
    assert _max_difference(exported, ema2 if spec["weights"] == "ema" else model2) == 0.0


@pytest.mark.slow
def test_the_optimizer_is_recorded_and_is_the_one_that_ran(cli_runs):
    out = cli_runs["ema"]
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["optimizer"] == "lamb"
    state = torch.load(_checkpoint(out, 2) / "optimizer.bin", weights_only=True)
    per_param = list(state["state"].values())
    assert per_param and all({"exp_avg", "exp_avg_sq"} <= set(s) for s in per_param)
    assert all("momentum_buffer" not in s for s in per_param)  # not the default SGD
    assert all(int(g["step"]) == 2 for g in state["param_groups"])  # LAMB's per-group count


@pytest.mark.slow
def test_an_ema_runs_export_eval_and_predict_use_the_weights_it_says(cli_runs, tmp_path):
    """eval, predict and export of an --model-ema run: the export of the run holds exactly its
    model.safetensors (the better of raw and EMA) and says which; eval and predict of the run and
    of the export agree to the digit; a checkpoint's export holds that step's raw weights (its
    EMA stays in ema.safetensors)."""
    from PIL import Image
    from accel_train.data import synthetic

    out = cli_runs["ema"]
    run_export, step_export = tmp_path / "run_export", tmp_path / "step_export"
    accel_train_here("export", str(out), "-o", str(run_export), check=True)
    accel_train_here("export", str(_checkpoint(out, 2)), "-o", str(step_export), check=True)
    final = load_file(str(out / "model.safetensors"))
    assert _max_difference(load_file(str(run_export / "model.safetensors")), final) == 0.0
    spec = model_spec_of(out)
    assert model_spec_of(run_export)["weights"] == \
        spec["weights"]
    raw2 = load_file(str(_checkpoint(out, 2) / "model.safetensors"))
    assert _max_difference(load_file(str(step_export / "model.safetensors")), raw2) == 0.0

    def eval_json(target):
        result = accel_train_here("eval", str(target), "--dataset", "synthetic",
                                  "--max-samples", "64", "--json", check=True)
        return json.loads(result.stdout.strip().splitlines()[-1])

    assert eval_json(out)["loss"] == eval_json(run_export)["loss"]
    images = synthetic.splits(64)["test"][0][:4]
    files = []
    for i, array in enumerate(images):
        files.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(array).save(files[-1])

    def predictions(target):
        return accel_train_here("predict", str(target), *files, "--json", check=True).stdout

    assert predictions(out) == predictions(run_export)


@pytest.mark.parametrize("distributed, compiled, device_type", [
    (False, False, "cpu"), (True, False, "cpu"), (False, True, "cpu"), (False, True, "cuda")])
@pytest.mark.parametrize("model_name, epochs, stops", [("cifar_airbench_xs", 3, True),
                                                       ("cifar_airbench_xs", None, False),
                                                       # a first convolution without a bias
                                                       ("test_resnet", 3, False)])
def test_the_stem_bias_stop_acts_on_the_whitened_layers_bias_from_its_epoch(model_name, epochs,
                                                                             stops, distributed,
                                                                             compiled,
                                                                             device_type):
    """--whiten-bias-epochs N: from epoch N (0-based) on, the whitened layer's bias has no
    gradient after the backward pass (torch's optimizers then skip it); before that, and for
    every other parameter, the gradient is left as it was.  Nothing to stop without the flag or
    without a bias.  In one process the bias also stops requiring a gradient, so from the next
    micro-batch on the backward pass no longer reaches the stem (no gradient of its output), as
    airbench's `requires_grad = False` gives; under DDP (distributed) or --compile on a GPU it
    keeps requiring one, and the stem's backward runs at every micro-batch."""
    import timm

    from accel_train.train.stem_bias import maybe_stem_bias_stop

    torch.manual_seed(0)
    model = timm.create_model(model_name, num_classes=NUM_CLASSES)
    config = TrainConfig(whiten_stem=True, whiten_bias_epochs=epochs, compile=compiled)
    stop = maybe_stem_bias_stop(model, config, distributed=distributed, device_type=device_type)
    keeps_requiring_grad = distributed or (compiled and device_type == "cuda")
    bias = model.stem[0].bias if model_name.startswith("cifar") else None
    stem_backwards = []
    if bias is not None:
        model.stem[0].weight.requires_grad_(False)  # fixed, as --whiten-stem leaves it
        def watch_stem_output(_, __, out):  # its gradient: the backward pass reached the stem
            if out.requires_grad:
                out.register_hook(lambda _: stem_backwards.append(1))

        model.stem.register_forward_hook(watch_stem_output)
    for epoch in range(5):
        model.zero_grad()
        stem_backwards.clear()
        model(torch.randn(4, 3, 32, 32)).sum().backward()
        stop.before_update(epoch)
        grads = [p.grad for p in model.parameters() if p.requires_grad and p is not bias]
        assert all(g is not None for g in grads)
        stopped = stops and epoch >= epochs
        if bias is not None:
            assert (bias.grad is None) == stopped, epoch
            assert bias.requires_grad == (keeps_requiring_grad or not stopped), epoch
            # the stem's backward ran in this micro-batch unless an earlier one stopped it
            assert stem_backwards == ([] if stopped and not keeps_requiring_grad and epoch > epochs
                                      else [1]), epoch


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_under_compile_on_a_gpu_the_stem_bias_stop_keeps_the_compiled_graphs(device_type):
    """--compile: torch.compile guards each graph on the requires_grad of the parameters it was
    traced with, so flipping the bias's (what the stop does in one process) traces and
    compiles the model again in mid-run.  On a GPU the stop then only drops the gradient: no
    graph beyond the first epoch's.  On the CPU (its recompile repaid within a few epochs) it
    flips: a second graph, once.  A backend that only counts the graphs it is handed
    (torch.compile's custom-backend interface) keeps inductor's compile time out of the test;
    the model itself stays on the CPU, `device_type` is what the trainer would pass."""
    import timm

    from accel_train.train.stem_bias import maybe_stem_bias_stop

    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch.manual_seed(0)
    model = timm.create_model("cifar_airbench_xs", num_classes=NUM_CLASSES)
    bias = model.stem[0].bias
    model.stem[0].weight.requires_grad_(False)  # fixed, as --whiten-stem leaves it
    compiled = torch.compile(model, backend=counting_backend)
    config = TrainConfig(whiten_stem=True, whiten_bias_epochs=1, compile=True)
    stop = maybe_stem_bias_stop(model, config, distributed=False, device_type=device_type)
    images = torch.randn(4, 3, 32, 32)
    counts = []
    for epoch in range(4):
        model.zero_grad()
        compiled(images).sum().backward()
        stop.before_update(epoch)
        assert (bias.grad is None) == (epoch >= 1), epoch
        counts.append(len(graphs))
    # the flip made in epoch 1 shows in epoch 2's forward pass
    assert counts == ([counts[0]] * 4 if device_type == "cuda"
                      else [counts[0]] * 2 + [counts[2]] * 2), counts
    assert device_type == "cuda" or counts[2] > counts[0]
    if device_type == "cuda":  # the oracle: the same flip made by hand does trace anew
        bias.requires_grad_(False)
        compiled(images).sum().backward()
        assert len(graphs) > counts[0]
