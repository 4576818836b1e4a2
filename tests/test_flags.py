"""Each training flag changes what training does, checked against an independent first step.

The runs train ONE optimizer step on the whole synthetic training set (32 images, one batch of
32, no augmentation), so the step can be redone here in plain torch: the initial weights are
timm's for --seed 0 (torch.manual_seed(0), then timm.create_model), the batch is the raw images
normalized with the run's config.json (whose mean/std test_data_stats.py checks), and the
loss, gradient, clipping, weight decay and optimizer update are written out below by hand.  The
order of the batch does not matter: the loss is a mean, and BatchNorm's batch statistics are
order-free.

A probe (tests/flag_probe.py) watches torch from outside the package while the CLI runs, in this
process or in each launched process (PROBE below): the memory format and dtype at every training
Conv2d, the DDP wrapper's settings, the DataLoaders' worker settings, torch.compile calls and the
zeros reaching the classifier.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from torch import nn

from accel_train.data import synthetic
from accel_train.config import TrainConfig
from accel_train.train.optim import build_optimizer
from accel_train.run.track import read_metrics

from conftest import PINNED, REPO, accel_train_here, free_port, model_spec_of, run
from conftest import test_env as child_env  # (imported as test_env, pytest would collect it)

MODEL, SEED, NUM_CLASSES, TRAIN_SIZE = "test_resnet", 0, 10, 32
FLAG_TRAIN = ["--dataset", "synthetic", "--synthetic-train-size", str(TRAIN_SIZE),
              "--max-eval-samples", "16", "--model", MODEL, "--batch-size", str(TRAIN_SIZE),
              "--epochs", "1", "--max-steps", "1", "--no-augment", "--warmup-epochs", "0",
              "--log-every", "1", "--seed", str(SEED), "--progress", "log", "--no-plots",
              *PINNED]  # (a later --mixed-precision or --channels-last overrides it)

# The probe of the runs that start processes (launchers, compile): the CLI unchanged, with
# tests/flag_probe.py's watchers installed first and their records written at exit.
PROBE = r'''
import atexit, json, os, runpy, sys
from tests.flag_probe import install

records = install(conv=os.environ.get("FLAG_PROBE_CONV", "1") == "1")
path = os.environ["FLAG_PROBE_OUT"] + ".rank" + os.environ.get("RANK", "0") + ".json"

@atexit.register
def _write():
    with open(path, "w") as handle:
        json.dump(records, handle)

sys.argv = ["accel_train", *sys.argv[1:]]
runpy.run_module("accel_train", run_name="__main__", alter_sys=True)
'''


# -- the independent first step ------------------------------------------------------------------
def no_decay_names(model: nn.Module) -> set[str]:
    """Biases and the parameters of normalization layers, classified here by module type."""
    norms = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)
    names = set()
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            if name == "bias" or isinstance(module, norms):
                names.add(f"{module_name}.{name}" if module_name else name)
    return names


def initial_model(seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    return timm.create_model(MODEL, num_classes=NUM_CLASSES, drop_rate=0.0)


def first_step(run_dir, label_smoothing: float, seed: int = SEED, mean=None, std=None,
               class_weights=None) -> dict:
    """W0, the first batch's loss and gradient, computed here; the images normalized with
    `mean` and `std` where given, else with the run's recorded ones; each class's terms
    weighted by `class_weights` where given (the weighted mean over the batch's targets'
    weights, as torch's cross-entropy defines it)."""
    spec = model_spec_of(run_dir)
    assert (spec["model_name"], spec["num_classes"], spec["image_size"]) == (MODEL, NUM_CLASSES, 32)
    images, labels = synthetic.splits(TRAIN_SIZE)["train"]
    x = torch.from_numpy(images).permute(0, 3, 1, 2).to(torch.float64) / 255
    x = (x - torch.tensor(mean or spec["mean"], dtype=torch.float64).view(1, 3, 1, 1)) \
        / torch.tensor(std or spec["std"], dtype=torch.float64).view(1, 3, 1, 1)
    y = torch.from_numpy(labels)
    model = initial_model(seed).train()
    w0 = {name: p.detach().clone() for name, p in model.named_parameters()}
    log_p = F.log_softmax(model(x.float()), dim=1)
    nll = -log_p[torch.arange(len(y)), y]
    uniform = -log_p.mean(dim=1)  # cross-entropy against the uniform distribution
    eps = label_smoothing
    loss = ((1 - eps) * nll + eps * uniform).mean()
    if class_weights is not None:
        w = torch.as_tensor(class_weights, dtype=log_p.dtype)
        smooth = -(log_p * w).mean(dim=1)  # each class's term weighted, over the classes
        loss = ((1 - eps) * w[y] * nll + eps * smooth).sum() / w[y].sum()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return {"w0": w0, "grad": grads, "loss": float(loss.detach()),
            "plain_loss": float(nll.detach().mean()),
            "no_decay": no_decay_names(model),
            "grad_norm": math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))}


def max_diff(a: dict, b: dict, names=None) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in (names or a))


# -- the runs -------------------------------------------------------------------------------------
class FlagRun:
    def __init__(self, out, probe_out):
        self.out, self.probe_out = out, probe_out

    @property
    def weights(self) -> dict:
        return load_file(str(self.out / "model.safetensors"))

    @property
    def params(self) -> dict:
        names = {n for n, _ in initial_model().named_parameters()}
        return {n: t for n, t in self.weights.items() if n in names}

    @property
    def first_loss(self) -> float:
        train = [m for m in read_metrics(self.out / "metrics.jsonl") if m["type"] == "train"]
        assert [m["step"] for m in train] == [1]
        return train[0]["loss"]

    @property
    def resolved(self) -> dict:
        return yaml.safe_load((self.out / "config.yaml").read_text())["resolved"]

    def probe(self, rank: int = 0) -> dict:
        return json.loads(self.probe_out.with_name(self.probe_out.name + f".rank{rank}.json")
                          .read_text())

    def training_convs(self, rank: int = 0) -> list[dict]:
        convs = [c for c in self.probe(rank)["conv"] if c["batch"] > 1]
        assert convs, "the probe saw no training forward pass"
        return convs


def flag_run_here(root, name: str, *flags: str) -> FlagRun:
    """The run in this process (cli.main, as `python -m accel_train` runs it), watched by the
    same probe: no seconds of imports per run."""
    import flag_probe
    out, probe_out = root / name, root / f"{name}.probe"
    records = flag_probe.install()
    try:
        accel_train_here(*FLAG_TRAIN, *flags, "--output-dir", str(out), check=True)
    finally:
        flag_probe.uninstall()
    (probe_out.parent / (probe_out.name + ".rank0.json")).write_text(json.dumps(records))
    return FlagRun(out, probe_out)


def flag_run(root, name: str, *flags: str, launcher: list[str] | None = None,
             conv_probe: bool = True, timeout: float = 300) -> FlagRun:
    """The run in its own process(es), started by `launcher`, the probe installed in each."""
    probe = root / "probe.py"
    if not probe.exists():
        probe.write_text(PROBE)
    out, probe_out = root / name, root / f"{name}.probe"
    cmd = [*(launcher or [sys.executable]), str(probe), *FLAG_TRAIN, *flags,
           "--output-dir", str(out)]
    # On the CPU, as the oracle: exact float32 arithmetic, no TF32 or cuDNN algorithm choice.
    env = child_env(FLAG_PROBE_OUT=str(probe_out), FLAG_PROBE_CONV="1" if conv_probe else "0",
                    CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    run(cmd, env=env, timeout=timeout, check=True)
    return FlagRun(out, probe_out)


SGD_LR, CLIP, SGD_WD, SMOOTHING = 0.05, 0.1, 0.5, 0.3
ADAM_LR, ADAM_WD = 0.01, 0.05
BF16_LR = 0.05
MEAN, STD = 0.25, (0.5, 0.25, 0.125)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("flags")
    here = flag_run_here
    return {
        # plain SGD (no momentum) with clipping, weight decay, label smoothing and channels_last
        "sgd": here(root, "sgd", "--optimizer", "sgd", "--momentum", "0", "--lr", str(SGD_LR),
                    "--weight-decay", str(SGD_WD), "--grad-clip", str(CLIP),
                    "--label-smoothing", str(SMOOTHING), "--channels-last"),
        # AdamW with decoupled weight decay, no smoothing, no channels_last
        "adamw": here(root, "adamw", "--optimizer", "adamw", "--lr", str(ADAM_LR),
                      "--weight-decay", str(ADAM_WD), "--label-smoothing", "0"),
        # bf16 autocast; defaults otherwise (Nesterov momentum 0.9, wd 5e-4, smoothing 0.1)
        "bf16": here(root, "bf16", "--mixed-precision", "bf16", "--lr", str(BF16_LR)),
        # dropout before the classifier; loader knobs (in-memory data defaults to no workers)
        "dropout": here(root, "dropout", "--drop-rate", "0.5", "--momentum", "0",
                        "--weight-decay", "0", "--label-smoothing", "0", "--num-workers", "1",
                        "--prefetch-factor", "3", "--no-persistent-workers"),
        # another seed, and mixing asked for but with probability 0: the plain step from seed 7
        "seed7": here(root, "seed7", "--seed", "7", "--mixup", "0.8", "--cutmix", "1.0",
                      "--mixup-prob", "0", "--momentum", "0", "--weight-decay", "0",
                      "--label-smoothing", "0", "--lr", str(SGD_LR)),
        # the model sees images resized to 16 px (the synthetic data is 32 px)
        "small": here(root, "small", "--image-size", "16"),
        # normalized with given statistics, one value for all channels in --mean
        "normalized": here(root, "normalized", "--mean", str(MEAN), "--std", *map(str, STD),
                           "--momentum", "0", "--weight-decay", "0", "--label-smoothing", "0",
                           "--lr", str(SGD_LR)),
        # each class's loss weighted by its rarity in the training split, smoothing kept
        "class_weight": here(root, "class_weight", "--class-weight", "balanced", "--momentum",
                             "0", "--weight-decay", "0", "--label-smoothing", str(SMOOTHING),
                             "--lr", str(SGD_LR)),
    }


# -- tests ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_weight_decay_groups_exclude_norms_and_biases():
    model = initial_model()
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = no_decay_names(model)
    assert {"fc.bias", "bn1.weight", "bn1.bias"} <= no_decay  # the classifier's bias, a BN layer
    assert "fc.weight" in set(names.values()) - no_decay
    for optimizer_name, optimizer_type in (("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)):
        optimizer = build_optimizer(model, TrainConfig(weight_decay=0.3, optimizer=optimizer_name,
                                                       learning_rate=0.2))
        assert type(optimizer) is optimizer_type
        by_decay: dict[float, list[str]] = {}
        for group in optimizer.param_groups:
            by_decay.setdefault(group["weight_decay"], []).extend(
                names[id(p)] for p in group["params"])
            assert group["lr"] == 0.2
        assert sorted(by_decay) == [0.0, 0.3]
        assert sorted(by_decay[0.0]) == sorted(no_decay)
        assert sorted(by_decay[0.3]) == sorted(set(names.values()) - no_decay)
    sgd = build_optimizer(model, TrainConfig(momentum=0.8))
    assert all(g["momentum"] == 0.8 and g["nesterov"] for g in sgd.param_groups)


@pytest.mark.parametrize("name, norm_bias_lr_scale",
                         [("sgd", 1), ("momentum", 1), ("adamw", 1), ("sgd", 64)])
def test_a_fused_optimizer_makes_torchs_own_update(name, norm_bias_lr_scale):
    """What the trainer builds on CUDA (fused kernels: one per step, and fp16's overflow flag
    read on the device) updates as torch's plain for-loop optimizer does with the same groups:
    three steps, each on the same gradients (the fused model's, handed to the oracle's
    parameters: Adam's normalization would make rounding-level differences in gradients
    computed apart into visible ones), every parameter equal to float32 rounding."""
    config = TrainConfig(optimizer=name, learning_rate=0.1, weight_decay=0.05, momentum=0.9,
                         norm_bias_lr_scale=norm_bias_lr_scale)
    model, oracle_model = initial_model(), initial_model()
    fused = build_optimizer(model, config, fused=True)
    assert all(group["fused"] for group in fused.param_groups)
    assert not any(group.get("fused") for group in build_optimizer(initial_model(),
                                                                   config).param_groups)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    oracle_params = list(oracle_model.parameters())
    groups = [{"params": [oracle_params[index[id(p)]] for p in group["params"]],
               "weight_decay": group["weight_decay"], "lr": group["lr"]}
              for group in fused.param_groups]
    if name == "adamw":
        oracle = torch.optim.AdamW(groups, lr=0.1, foreach=False)
    else:
        oracle = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=name == "sgd",
                                 foreach=False)
    images = torch.randn(4, 3, 32, 32)
    for _ in range(3):
        fused.zero_grad()
        model(images).square().mean().backward()
        for param, oracle_param in zip(model.parameters(), oracle_params):
            oracle_param.grad = param.grad.clone()
        fused.step()
        oracle.step()
    for (param_name, param), expected in zip(model.named_parameters(), oracle_params):
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6, msg=param_name)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(),
                                                     initial_model().parameters()))


@pytest.mark.parametrize("name", ["sgd", "momentum"])
def test_a_fused_sgd_step_the_gradient_scaler_skips_leaves_momentum_as_torchs_own(name):
    """fp16's GradScaler skips a step whose gradients overflowed, routine in a run's first
    steps.  Torch's fused SGD made its momentum buffers with empty_like at its first step and
    left them unwritten when that step was skipped: the next step took uninitialized memory
    for momentum (NaN or garbage weights).  The buffers start at zero before any step, and a
    skipped first step then three finite ones leave every parameter as torch's plain SGD
    (foreach=False, its own GradScaler on the same scaled gradients) leaves it."""
    config = TrainConfig(optimizer=name, learning_rate=0.1, weight_decay=0.05, momentum=0.9)
    model, oracle_model = initial_model(), initial_model()
    fused = build_optimizer(model, config, fused=True)
    for param in model.parameters():
        assert torch.equal(fused.state[param]["momentum_buffer"], torch.zeros_like(param))
    index = {id(p): i for i, p in enumerate(model.parameters())}
    oracle_params = list(oracle_model.parameters())
    groups = [{"params": [oracle_params[index[id(p)]] for p in group["params"]],
               "weight_decay": group["weight_decay"], "lr": group["lr"]}
              for group in fused.param_groups]
    oracle = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=name == "sgd",
                             foreach=False)
    scaler, oracle_scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    images = torch.randn(4, 3, 32, 32)
    for overflow in (True, False, False, False):
        fused.zero_grad()
        loss = model(images).square().mean() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        oracle_scaler.scale(torch.ones(()))  # (its scale starts where the other's does)
        for param, oracle_param in zip(model.parameters(), oracle_params):
            oracle_param.grad = param.grad.clone()
        # freed NaN-filled memory of the parameters' sizes, which an uninitialized buffer
        # made next would likely be given
        garbage = [torch.full_like(p, float("nan")) for p in model.parameters()]
        del garbage
        for optimizer, its_scaler in ((fused, scaler), (oracle, oracle_scaler)):
            its_scaler.step(optimizer)
            its_scaler.update()
    assert scaler.get_scale() == oracle_scaler.get_scale() == 2.0 ** 15  # one step skipped
    for (param_name, param), expected in zip(model.named_parameters(), oracle_params):
        assert torch.isfinite(param).all(), param_name
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6, msg=param_name)


def test_fused_sgd_without_momentum_keeps_no_momentum_buffers():
    """--momentum 0: torch's SGD keeps no buffer, and a zero one per parameter would be
    memory the size of the network for nothing."""
    optimizer = build_optimizer(initial_model(), TrainConfig(optimizer="sgd", momentum=0),
                                fused=True)
    assert all(group["fused"] and group["momentum"] == 0 for group in optimizer.param_groups)
    assert len(optimizer.state) == 0


@pytest.mark.parametrize("saved_fused, built_fused", [(False, True), (True, False)])
def test_a_checkpoints_optimizer_state_keeps_the_kernels_chosen(saved_fused, built_fused):
    """A checkpoint saved unfused (on a CPU, or before the trainer fused on CUDA) resumed where
    the optimizer is fused keeps it fused (GradScaler hands a fused optimizer its overflow flag,
    which torch's unfused SGD refuses), and the other way round stays unfused; the state
    itself (momentum) is the checkpoint's."""
    config = TrainConfig(optimizer="sgd", learning_rate=0.1, momentum=0.9)
    saved = build_optimizer(initial_model(), config, fused=saved_fused)
    model = initial_model()
    saved_model_params = [p for group in saved.param_groups for p in group["params"]]
    saved_model_params[0].grad = torch.ones_like(saved_model_params[0])
    saved.step()
    resumed = build_optimizer(model, config, fused=built_fused)
    resumed.load_state_dict(saved.state_dict())
    assert [bool(g["fused"]) for g in resumed.param_groups] == [built_fused] * 2
    first = resumed.param_groups[0]["params"][0]
    torch.testing.assert_close(resumed.state[first]["momentum_buffer"],
                               torch.ones_like(first))


def test_optimizers_without_fused_kernels_are_built_as_they_are():
    """timm's own optimizers and its Lookahead wrapper take no `fused=`: asked on CUDA, the
    trainer builds them unfused rather than failing."""
    from timm.optim import Lamb, Lookahead

    for name, optimizer_type in (("lamb", Lamb), ("lookahead_sgd", Lookahead)):
        optimizer = build_optimizer(initial_model(), TrainConfig(optimizer=name), fused=True)
        assert type(optimizer) is optimizer_type
        assert not any(group.get("fused") for group in optimizer.param_groups)


def test_frozen_backbone_leaves_only_the_head_in_the_optimizer():
    model = initial_model()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("fc."))
    optimizer = build_optimizer(model, TrainConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for g in optimizer.param_groups for p in g["params"]) == \
        ["fc.bias", "fc.weight"]


def test_sgd_grad_clip_weight_decay_and_label_smoothing(runs):
    run_ = runs["sgd"]
    ref = first_step(run_.out, label_smoothing=SMOOTHING)
    no_decay = ref["no_decay"]
    # the loss of the first batch is the smoothed cross-entropy, not the plain one
    assert run_.first_loss == pytest.approx(ref["loss"], abs=2e-5)
    assert abs(ref["loss"] - ref["plain_loss"]) > 5e-3

    assert ref["grad_norm"] > 5 * CLIP  # clipping is active in this run
    scale = CLIP / (ref["grad_norm"] + 1e-6)

    def predict(clip_scale: float, decay_on: set[str]) -> dict:
        # SGD without momentum: w1 = w0 - lr * (clipped g + wd * w0 on the decayed params)
        return {n: w - SGD_LR * (clip_scale * ref["grad"][n] + (SGD_WD * w if n in decay_on else 0))
                for n, w in ref["w0"].items()}

    decayed = set(ref["w0"]) - no_decay
    got = run_.params
    tol = 2e-6
    assert max_diff(got, predict(scale, decayed)) < tol
    # each flag mattered: ignoring any one of them predicts other weights
    assert max_diff(got, predict(1.0, decayed)) > 100 * tol           # without --grad-clip
    assert max_diff(got, predict(scale, set())) > 100 * tol           # without --weight-decay
    assert max_diff(got, predict(scale, set(ref["w0"]))) > 100 * tol  # decay on norms/biases too
    # the clipped update's gradient part has norm lr * clip exactly
    grad_part = {n: got[n] - ref["w0"][n] + (SGD_LR * SGD_WD * ref["w0"][n] if n in decayed else 0)
                 for n in got}
    norm = math.sqrt(sum(float((d.double() ** 2).sum()) for d in grad_part.values()))
    assert norm == pytest.approx(SGD_LR * CLIP, rel=1e-4)


def test_channels_last_reaches_the_model_and_the_images(runs):
    convs = runs["sgd"].training_convs()
    assert all(c["input_channels_last"] and c["weight_channels_last"] for c in convs)
    # the first convolution (3 x 32 x 32 images, 3 x 3 kernel) is unambiguous: not NCHW
    assert not convs[0]["input_contiguous"] and not convs[0]["weight_contiguous"]
    # the control: without the flag everything is NCHW (the probe can tell)
    control = runs["adamw"].training_convs()
    assert all(c["input_contiguous"] and c["weight_contiguous"] for c in control)
    assert not control[0]["input_channels_last"] and not control[0]["weight_channels_last"]


def test_adamw_first_step_is_lr_times_the_gradient_sign(runs):
    run_ = runs["adamw"]
    ref = first_step(run_.out, label_smoothing=0.0)
    assert run_.first_loss == pytest.approx(ref["plain_loss"], abs=2e-5)  # --label-smoothing 0
    got, decayed = run_.params, set(ref["w0"]) - ref["no_decay"]
    with_gradient = 0
    for name, w0 in ref["w0"].items():
        g = ref["grad"][name]
        decay = (1 - ADAM_LR * ADAM_WD) if name in decayed else 1.0  # decoupled (AdamW) decay
        # step 1: m_hat = g, sqrt(v_hat) = |g|: the update is lr * g / (|g| + 1e-8), i.e. about
        # lr * sign(g) in every element, whatever the gradient's size
        adam_part = (w0 * decay - got[name]) / ADAM_LR
        assert adam_part.abs().max() <= 1 + 1e-4, name  # never more than lr per element
        if not g.any():  # (timm zero-initializes each block's last BatchNorm: some g are 0)
            assert not adam_part.any(), name
            continue
        with_gradient += 1
        clear = g.abs() > 1e-6  # clear of float noise between this g and the run's
        assert clear.float().mean() > 0.99, name
        assert torch.allclose(adam_part[clear], g[clear] / (g[clear].abs() + 1e-8), atol=5e-4), name
        assert (adam_part[g.abs() > 1e-4].abs() > 0.99).all(), name
    assert with_gradient >= 25
    # the oracle tells AdamW apart: SGD's w0 - lr * g, or AdamW without the decay, are far off
    sgd_like = {n: w - ADAM_LR * ref["grad"][n] for n, w in ref["w0"].items()}
    assert max_diff(got, sgd_like) > 1e-3
    no_decay_adam = {n: w - ADAM_LR * ref["grad"][n] / (ref["grad"][n].abs() + 1e-8)
                     for n, w in ref["w0"].items()}
    assert max_diff(got, no_decay_adam, decayed) > ADAM_LR * ADAM_WD * 1e-2


def test_bf16_is_recorded_runs_in_bf16_and_trains(runs):
    run_ = runs["bf16"]
    assert run_.resolved["precision_used"] == "bf16"
    assert run_.resolved["precision_requested"] == "bf16"
    assert all(c["out_dtype"] == "torch.bfloat16" for c in run_.training_convs())
    assert all(c["out_dtype"] == "torch.float32" for c in runs["adamw"].training_convs())
    ref = first_step(run_.out, label_smoothing=0.1)  # the default smoothing
    loss = run_.first_loss
    assert math.isfinite(loss)
    assert loss == pytest.approx(ref["loss"], rel=1e-2)  # bf16 rounding, not another loss
    assert loss != pytest.approx(ref["loss"], abs=1e-6)   # ... but rounded: bf16 really ran
    # Nesterov SGD, first step: buf = d, update = d + 0.9 * buf = 1.9 * d, d = g + 5e-4 * w0
    decayed = set(ref["w0"]) - ref["no_decay"]
    got = run_.params
    expected = torch.cat([(-BF16_LR * 1.9 * (ref["grad"][n] + (5e-4 * w if n in decayed else 0)))
                          .ravel() for n, w in ref["w0"].items()])
    moved = torch.cat([(got[n] - w).ravel() for n, w in ref["w0"].items()])
    assert torch.isfinite(moved).all()
    cosine = float(F.cosine_similarity(moved.double(), expected.double(), dim=0))
    assert cosine > 0.97, cosine
    assert float(moved.norm() / expected.norm()) == pytest.approx(1.0, abs=0.05)


def test_drop_rate_drops_in_training_and_is_recorded(runs):
    run_ = runs["dropout"]
    spec = model_spec_of(run_.out)
    assert spec["drop_rate"] == 0.5  # eval, predict and export rebuild the model with it
    ref = first_step(run_.out, label_smoothing=0.0)
    # without dropout the first loss would be ref's to float precision (as the other runs show);
    # half the features dropped (the rest doubled) gives another loss
    assert abs(run_.first_loss - ref["plain_loss"]) > 1e-2
    assert math.isfinite(run_.first_loss)
    # ... and another step: the head's update is not lr * the no-dropout gradient
    got = run_.params
    expected = {n: w - 0.05 * ref["grad"][n] for n, w in ref["w0"].items()}  # default lr 0.05
    assert max_diff(got, expected, ["fc.weight"]) > 1e-4
    # what dropout does: it zeroes half of the classifier's inputs at random.  Some pooled
    # features are zero already (dead ReLUs); the control's first batch (same seed, same
    # initial model, no dropout) says how many, so the share of zeros must be 1 - (1 - z) / 2.
    already = runs["adamw"].probe()["linear_zeros"][0]
    dropped = runs["dropout"].probe()["linear_zeros"][0]
    assert dropped == pytest.approx(1 - (1 - already) * 0.5, abs=0.05), (already, dropped)


def test_seed_sets_the_initial_weights(runs):
    """--seed 7 (and --mixup/--cutmix with --mixup-prob 0): exactly the plain SGD step from
    timm's initialization after torch.manual_seed(7), not from seed 0's."""
    run_ = runs["seed7"]
    for seed, should_match in ((7, True), (SEED, False)):
        ref = first_step(run_.out, label_smoothing=0.0, seed=seed)
        expected = {n: w - SGD_LR * ref["grad"][n] for n, w in ref["w0"].items()}
        assert (max_diff(run_.params, expected) < 2e-6) == should_match, seed


def test_mix_probability_zero_trains_the_plain_step(runs):
    """--mixup-prob 0 turns mixing off whatever --mixup and --cutmix say: the first loss is the
    plain cross-entropy of the unmixed batch (the step: test_seed_sets_the_initial_weights)."""
    run_ = runs["seed7"]
    ref = first_step(run_.out, label_smoothing=0.0, seed=7)
    assert run_.first_loss == pytest.approx(ref["plain_loss"], abs=2e-5)


def test_image_size_resizes_what_the_model_sees(runs):
    assert runs["small"].training_convs()[0]["hw"] == [16, 16]
    assert runs["adamw"].training_convs()[0]["hw"] == [32, 32]
    spec = model_spec_of(runs["small"].out)
    assert spec["image_size"] == 16


def test_mean_and_std_normalize_what_the_model_sees(runs):
    """--mean 0.25 --std 0.5 0.25 0.125: the first loss and step are the plain SGD step on
    (x - 0.25) / std, written out here from the flags' values, not from the run's record; the
    data's own statistics (which the other runs use, test_data_stats.py) give another step."""
    run_ = runs["normalized"]
    flags = {"mean": [MEAN] * 3, "std": list(STD)}
    ref = first_step(run_.out, label_smoothing=0.0, **flags)
    assert run_.first_loss == pytest.approx(ref["plain_loss"], abs=2e-5)
    expected = {n: w - SGD_LR * ref["grad"][n] for n, w in ref["w0"].items()}
    assert max_diff(run_.params, expected) < 2e-6
    data_stats = first_step(runs["adamw"].out, label_smoothing=0.0)
    assert abs(data_stats["plain_loss"] - ref["plain_loss"]) > 1e-3
    assert {k: model_spec_of(run_.out)[k] for k in flags} == flags  # eval and export take them
    assert model_spec_of(runs["adamw"].out)["mean"] != flags["mean"]


def test_class_weight_balanced_weighs_the_first_loss_and_step(runs):
    """--class-weight balanced: the weights are 32 / (10 x each class's count in the 32
    training images), counted here; the first loss and SGD step are those of the weighted,
    smoothed cross-entropy written out in first_step; the unweighted loss gives another step."""
    run_ = runs["class_weight"]
    _, labels = synthetic.splits(TRAIN_SIZE)["train"]
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    weights = [TRAIN_SIZE / (NUM_CLASSES * int(count)) for count in counts]
    assert len(set(weights)) > 1  # the split is uneven: a weighting that does something
    assert run_.resolved["class_weights"]["weights"] == pytest.approx(weights, abs=1e-6)
    ref = first_step(run_.out, label_smoothing=SMOOTHING, class_weights=weights)
    assert run_.first_loss == pytest.approx(ref["loss"], abs=2e-5)
    expected = {n: w - SGD_LR * ref["grad"][n] for n, w in ref["w0"].items()}
    assert max_diff(run_.params, expected) < 2e-6
    unweighted = first_step(run_.out, label_smoothing=SMOOTHING)
    plain_step = {n: w - SGD_LR * unweighted["grad"][n] for n, w in ref["w0"].items()}
    assert max_diff(run_.params, plain_step) > 100 * 2e-6


def test_loader_flags_reach_the_training_loader(runs):
    def train_loaders(run_):
        loaders = [entry for entry in run_.probe().get("loaders", [])
                   if entry["dataset"] == "TrainImages"]
        assert loaders, "the probe saw no training DataLoader"
        return loaders

    assert all((entry["num_workers"], entry["prefetch_factor"], entry["persistent_workers"])
               == (1, 3, False) for entry in train_loaders(runs["dropout"]))
    # the control: in-memory data, no flags: no worker processes
    assert all(entry["num_workers"] == 0 for entry in train_loaders(runs["adamw"]))


def test_in_memory_limit_decides_whether_images_are_decoded_up_front(tmp_path):
    import datasets
    import numpy as np
    from PIL import Image

    from accel_train.data.sources import ArraySource, load_data

    rng = np.random.default_rng(0)
    rows = {"image": [Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8))
                      for _ in range(8)], "label": [i % 2 for i in range(8)]}
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["a", "b"])})
    dataset = datasets.Dataset.from_dict(rows, features=features)
    dataset.to_parquet(str(tmp_path / "train.parquet"))
    dataset.to_parquet(str(tmp_path / "test.parquet"))
    roomy = load_data(TrainConfig(data_dir=str(tmp_path)))
    assert isinstance(roomy.train, ArraySource) and isinstance(roomy.held_out, ArraySource)
    # 8 images of 12 x 12 x 3 bytes = 3456 bytes: over a limit of 1e-6 GiB (1074 bytes)
    tight = load_data(TrainConfig(data_dir=str(tmp_path), in_memory_limit_gb=1e-6))
    assert not isinstance(tight.train, ArraySource)
    assert torch.equal(tight.train.image(3), roomy.train.images[3])  # same pixels, on demand
    # one budget for all the splits held: each split's 3456 bytes fit 5000, both together not
    both = load_data(TrainConfig(data_dir=str(tmp_path), in_memory_limit_gb=5000 / 2**30))
    assert not isinstance(both.train, ArraySource) and not isinstance(both.held_out, ArraySource)


@pytest.mark.slow
def test_ddp_knobs_reach_the_ddp_wrapper(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port())]
    run_ = flag_run(tmp_path, "ddp", "--batch-size", str(TRAIN_SIZE // 2), "--ddp-bucket-mb",
                    "1.5", "--no-ddp-grad-as-bucket-view", "--ddp-static-graph",
                    launcher=launcher)
    assert run_.resolved["world_size"] == 2
    for rank in (0, 1):
        (ddp,) = run_.probe(rank)["ddp"]  # one DDP wrapper, built once
        assert ddp["bucket_bytes_cap"] == 1_572_864  # 1.5 MiB = 1.5 * 1024 * 1024 bytes
        assert ddp["gradient_as_bucket_view"] is False  # accel_train's default is True
        assert ddp["static_graph"] is True
        assert ddp["kwargs"].get("bucket_cap_mb") == 1.5


def _inductor_problem() -> str | None:
    """Why torch.compile (inductor, CPU) cannot work here, or None."""
    try:
        compiled = torch.compile(lambda t: (t * 2).sin(), backend="inductor")
        value = compiled(torch.ones(3))
    except Exception as err:  # no compiler, unsupported platform, ...
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return None if torch.allclose(value, torch.ones(3).mul(2).sin()) else "wrong result"


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    problem = _inductor_problem()
    if problem:
        print(f"skipping --compile: torch.compile with inductor does not work here ({problem})")
        pytest.skip(f"torch.compile (inductor) unavailable: {problem}")
    # A cold inductor cache costs ~75 s of CPU (minutes of wall time on 2 busy cores).
    return flag_run(tmp_path_factory.mktemp("compile"), "compile", "--compile", "--momentum",
                    "0", "--weight-decay", "0", "--label-smoothing", "0", "--lr", str(SGD_LR),
                    conv_probe=False, timeout=540)


def _strip_compile_prefix(weights: dict) -> dict:
    return {k.removeprefix("_orig_mod."): v for k, v in weights.items()}


@pytest.mark.slow
def test_compile_compiles_the_model_and_trains_the_same_step(compiled_run):
    calls = compiled_run.probe()["compile"]
    assert [c["backend"] for c in calls if c["module"]] == ["inductor"], calls
    assert compiled_run.resolved["precision_used"] == "fp32"
    ref = first_step(compiled_run.out, label_smoothing=0.0)
    assert compiled_run.first_loss == pytest.approx(ref["plain_loss"], abs=1e-4)
    weights = _strip_compile_prefix(compiled_run.weights)
    expected = {n: w - SGD_LR * ref["grad"][n] for n, w in ref["w0"].items()}
    assert max_diff(weights, expected, list(expected)) < 1e-5


@pytest.mark.slow
def test_a_compiled_runs_model_safetensors_loads_into_the_plain_model(compiled_run):
    """A --compile run's model.safetensors once named every tensor '_orig_mod.<name>'."""
    model = initial_model()
    model.load_state_dict(load_file(str(compiled_run.out / "model.safetensors")))  # strict
