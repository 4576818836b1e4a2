"""A network of the user's own, by import path: `--model package.module:factory`.

The module is written by each test into tmp_path and reached as a user reaches it: through
PYTHONPATH in a new process (`python -m accel_train`), or on sys.path for the in-process runs
of the bad-input cases.  Oracles: an uninterrupted run of the same command (the resumed run's
weights, max |difference| 0.0); the network built here straight from the module with the run's
weights (predict's probabilities, ONNX Runtime's logits); the run's own last evaluation (eval's
top-1); the source folder's weights file (timm's local-dir: fine-tuning with a frozen backbone).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
import yaml
from PIL import Image
from safetensors.torch import load_file

from accel_train.model.build import check_train_forward, unused_parameters
from accel_train.run.checkpoint import write_manifest
from conftest import (PINNED, accel_train, accel_train_here, free_port, launched_program,
                      model_spec_of, run)
from conftest import test_env as child_env  # (as test_env, pytest would collect it)

MODULE = "user_nets"
FACTORY = f"{MODULE}:small_net"
USER_NETS = '''
from torch import nn


class SmallNet(nn.Module):
    def __init__(self, num_classes, drop_rate=0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.head(self.drop(self.features(x)))


def small_net(num_classes, drop_rate=0.0):
    return SmallNet(num_classes, drop_rate)


def bare(num_classes):  # no drop_rate parameter, no get_classifier()
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))


def raises(num_classes):
    raise ValueError(f"no design for {num_classes} classes yet")


def not_a_module(num_classes):
    return {"layers": num_classes}


def extra_logits(num_classes):  # a head for a data set with more classes
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes + 5))


class WithFeatures(nn.Module):  # (logits, features): not the logits the loop needs
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))

    def forward(self, x):
        return self.head(x), x


def all_frozen(num_classes):
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
    for param in net.parameters():
        param.requires_grad_(False)
    return net


def int_logits(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes), Rounded())


class Rounded(nn.Module):
    def forward(self, x):
        return x.round().long()


def half_net(num_classes):  # cast for inference, as a from_pretrained(torch_dtype=...) may be
    return small_net(num_classes).half()


def grey_cnn(num_classes):  # written for MNIST: its first layer takes one channel
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, num_classes))


class TrainOnlyHead(nn.Module):  # as Inception v3: an auxiliary head for images of 40 px and up
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
        self.aux = nn.Conv2d(3, num_classes, 40)

    def forward(self, x):
        return (self.head(x), self.aux(x)) if self.training else self.head(x)


class AuxFrom40(nn.Module):  # its auxiliary head takes images of 40 px and up
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes))
        self.aux = nn.Conv2d(3, num_classes, 40)

    def forward(self, x):
        return (self.head(x), self.aux(x)) if self.training else self.head(x)


class ForwardRaises(nn.Module):  # a bug in the user's forward, at any size
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.Linear(3, num_classes)

    def forward(self, x):
        raise KeyError("features")


class TupleInTraining(nn.Module):  # (logits, aux_logits) as a plain tuple, in train mode only
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
        self.aux = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))

    def forward(self, x):
        return (self.head(x), self.aux(x)) if self.training else self.head(x)


class EvalOnlyCalibration(nn.Module):  # a layer after the head that only eval mode runs
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
        self.calib = nn.Linear(num_classes, num_classes)

    def forward(self, x):
        out = self.head(x)
        return out if self.training else self.calib(out)


class SkipsEverySecondBatch(nn.Module):  # LayerDrop's skipped layer on a schedule, the same
    # on every rank: a block left out of every second training batch (the start's probe of
    # 2 images not counted, so that 1 and 2 processes skip at the same steps)
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
        self.block = nn.Linear(num_classes, num_classes)
        self.batches = 0

    def forward(self, x):
        out = self.head(x)
        if self.training and len(x) > 2:
            self.batches += 1
            if self.batches % 2 == 0:
                return out
        return self.block(out)


class WithUnused(nn.Module):  # a head left over from an experiment: never called
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
        self.old_head = nn.Linear(7, num_classes)

    def forward(self, x):
        return self.head(x)


width = 8
'''
# 64 images, 4 steps of 16
TINY = ["--dataset", "synthetic", "--synthetic-train-size", "64", "--batch-size", "16",
        "--epochs", "1", "--progress", "log", "--no-plots", *PINNED]
DROPOUT = ["--drop-rate", "0.3"]  # the resumed steps draw random numbers too


def write_module(folder: Path, name: str = MODULE, text: str = USER_NETS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(text)
    return folder


def import_from(folder: Path, name: str = MODULE):
    """The user's module, loaded from its file without touching sys.path or sys.modules."""
    spec = importlib.util.spec_from_file_location(f"oracle_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    assert lines[0].startswith("accel_train: error: "), lines
    return lines[0]


@pytest.mark.slow
def test_a_factory_trains_resumes_and_is_evaluated_predicted_and_exported(tmp_path,
                                                                          user_modules):
    """The training command as a user runs it (its own process, the module found through
    PYTHONPATH); the resume, predict, eval and export that check it in this process (the
    module on sys.path: user_modules); and a process without the module, for its one line."""
    nets = user_modules
    env = child_env(PYTHONPATH=str(nets))
    # 8 steps over 2 epochs; the resumed run starts from the checkpoint of step 3, mid-epoch, as
    # a run killed there would (its newest checkpoint), with Accelerate's RNG files removed:
    # exactness must not depend on a saved RNG stream.  (--max-steps is no interruption: it
    # also ends the epoch and the schedule there.)
    common = ["--model", FACTORY, *TINY, *DROPOUT, "--epochs", "2"]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    accel_train(*common, "--checkpoint-every", "1", "--keep-checkpoints", "10", "--output-dir",
                str(reference), env=env, check=True)
    stop = reference / "checkpoints" / "step_00000003"
    for rng_file in stop.glob("random_states_*.pkl"):
        rng_file.unlink()
    write_manifest(stop, 3)
    again = accel_train_here(*common, "--resume", str(stop), "--output-dir", str(resumed),
                             check=True)
    assert f"resumed from {stop} at step 3 (epoch 1, 48 samples into it)" in again.stdout, \
        again.stdout

    # What the run records: the import path, in the checkpoints and the final config.json.
    config = json.loads((reference / "config.json").read_text())
    assert config["architecture"] == FACTORY and config["num_classes"] == 10
    assert json.loads((stop / "model_config.json").read_text())["model_name"] == FACTORY
    assert yaml.safe_load((reference / "config.yaml").read_text())["train"]["model"] == FACTORY

    a, b = load_file(str(reference / "model.safetensors")), \
        load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) == 0.0

    # The oracle: the network built here from the module, with the run's weights.
    model = import_from(nets).small_net(num_classes=10, drop_rate=0.3)
    model.load_state_dict(a)
    model.eval()
    mean = torch.tensor(config["pretrained_cfg"]["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(config["pretrained_cfg"]["std"]).view(1, 3, 1, 1)
    draw = np.random.default_rng(0)
    pixels = draw.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)  # the run's own size: no resize
    images = []
    for i, array in enumerate(pixels):
        images.append(tmp_path / f"image{i}.png")
        Image.fromarray(array).save(images[-1])
    batch = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255 - mean) / std
    with torch.no_grad():
        logits = model(batch)
    probabilities = logits.softmax(dim=1)

    predicted = accel_train_here("predict", str(reference), *map(str, images), "--json",
                                 "--top-k", "10", check=True)
    rows = [json.loads(line) for line in predicted.stdout.splitlines() if line.startswith("{")]
    assert [row["image"] for row in rows] == [str(p) for p in images]
    for row, expected in zip(rows, probabilities):
        got = torch.zeros(10)
        for entry in row["predictions"]:
            got[entry["index"]] = entry["probability"]
        assert (got - expected).abs().max().item() < 1e-5, (row, expected)

    evaluated = accel_train_here("eval", str(reference), "--json", check=True)
    record = json.loads(evaluated.stdout.strip().splitlines()[-1])
    last_epoch = [json.loads(line) for line in (reference / "metrics.jsonl").read_text()
                  .splitlines() if '"epoch"' in line][-1]
    assert record["count"] == last_epoch["eval_count"]
    assert record["top1"] == pytest.approx(last_epoch["eval_top1"], abs=1e-6)

    export = tmp_path / "export"
    exported = accel_train_here("export", str(reference), "--output-dir", str(export),
                                "--format", "onnx", check=True)
    assert "checked model.onnx with ONNX Runtime" in exported.stdout, exported.stdout
    assert json.loads((export / "config.json").read_text())["architecture"] == FACTORY
    assert f"{MODULE}.small_net(num_classes=10, drop_rate=0.3)" in \
        (export / "README.md").read_text()
    import onnxruntime

    session = onnxruntime.InferenceSession(str(export / "model.onnx"))
    onnx_logits = session.run(None, {session.get_inputs()[0].name: batch.numpy()})[0]
    assert np.abs(onnx_logits - logits.numpy()).max() < 1e-4

    # The module must be importable where the model is rebuilt: without it, one line says so.
    elsewhere = accel_train("eval", str(reference), env=child_env(PYTHONPATH=""))
    line = one_error_line(elsewhere)
    assert f"--model {FACTORY}" in line and "no module named 'user_nets'" in line, line
    assert "PYTHONPATH" in line, line


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """The module folder on sys.path for in-process runs; modules imported from it are
    forgotten afterwards, so each test imports its own."""
    folder = write_module(tmp_path / "nets")
    monkeypatch.syspath_prepend(str(folder))
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        if name.startswith(MODULE):
            del sys.modules[name]


# (--model value, extra flags, what the one line must say)
BAD = [
    ("no_such_module:small_net", [], ["--model no_such_module:small_net",
                                      "no module named 'no_such_module'", "PYTHONPATH"]),
    (f"{MODULE}:smal_net", [], ["--model user_nets:smal_net", "has no 'smal_net'",
                                "did you mean small_net"]),
    (f"{MODULE}:raises", [], ["--model user_nets:raises", "raises(num_classes=10) raised "
                              "ValueError: no design for 10 classes yet", "fix the factory"]),
    (f"{MODULE}:not_a_module", [], ["--model user_nets:not_a_module", "returned a dict, not a "
                                    "torch nn.Module"]),
    (f"{MODULE}:width", [], ["--model user_nets:width", "width is not callable (a int)"]),
    (f"{MODULE}:extra_logits", [], ["--model user_nets:extra_logits maps a [1, 3, 32, 32] batch "
                                    "of images to a tensor of shape [1, 15], not to [1, 10] "
                                    "logits", "num_classes outputs"]),
    (f"{MODULE}:WithFeatures", [], ["--model user_nets:WithFeatures maps", "to a tuple, not to "
                                    "[1, 10] logits", "; return the logits tensor, or an object "
                                    "holding it as `.logits` (or a dict, as its \"logits\" "
                                    "entry)"]),
    ("user-nets:small_net", [], ["--model 'user-nets:small_net'", "import path "
                                 "package.module:factory"]),
    (f"{MODULE}_broken:small_net", [], ["--model user_nets_broken:small_net", "importing "
                                        "user_nets_broken failed (RuntimeError: broken at "
                                        "import)", "fix the module"]),
    (f"{MODULE}:bare", ["--drop-rate", "0.2"], ["--drop-rate 0.2: --model user_nets:bare takes "
                                               "no drop_rate= argument"]),
    (f"{MODULE}:small_net", ["--drop-path", "0.1"], ["--drop-path 0.1", "drop_path_rate="]),
    (f"{MODULE}:small_net", ["--pretrained", "hub"], ["--pretrained hub",
                                                      "--model user_nets:small_net is your own "
                                                      "factory"]),
    (f"{MODULE}:bare", ["--freeze-backbone"], ["--freeze-backbone", "get_classifier()"]),
    # timm finds no layers to decay by in a network without group_matcher() or a classifier
    # named in a pretrained_cfg: the flag would change nothing
    (f"{MODULE}:small_net", ["--layer-decay", "0.7"], ["--layer-decay 0.7: --model "
                                                       "user_nets:small_net names no layers",
                                                       "drop --layer-decay"]),
    # half-precision weights fail on float32 images: the dtype is named, not the image size
    (f"{MODULE}:half_net", [], ["--model user_nets:half_net holds float16 weights, and the run "
                                "trains float32 weights (mixed precision computes in bf16 or "
                                "fp16 under autocast): build it in float32 (model.float()); "
                                "--mixed-precision bf16 gives half precision's speed"]),
    # at 32 px, not timm's default 224: the size is not what to change
    (f"{MODULE}:grey_cnn", [], ["--model user_nets:grey_cnn takes 1-channel images, and the run "
                                "feeds 3-channel ones (grey images repeated to RGB): make its "
                                "first layer take 3 channels"]),
    # eval mode takes the size, train mode's auxiliary head does not: found before training
    (f"{MODULE}:TrainOnlyHead", [], ["--model user_nets:TrainOnlyHead takes [N, 3, 32, 32] "
                                     "images in eval mode but fails in train mode "
                                     "(RuntimeError: ", "; try a larger --image-size"]),
    # ... where a larger size trains, the first of those tried that does: 64 (2 x 32 >= 40)
    (f"{MODULE}:AuxFrom40", [], ["--model user_nets:AuxFrom40 takes [N, 3, 32, 32] images in "
                                 "eval mode but fails in train mode (RuntimeError: ",
                                 "needs other images; it trains at --image-size 64"]),
    # torchvision's own: its auxiliary head fails at 160, 224 and 256 px; 299 is its size
    ("torchvision.models:inception_v3", ["--image-size", "80"], [
        "--model torchvision.models:inception_v3 takes [N, 3, 80, 80] images in eval mode but "
        "fails in train mode (", "; it trains at --image-size 299"]),
    # eval mode returns the logits, train mode a plain tuple: its logits are not named (a
    # named tuple's are), and the first loss failed after the run folder was written
    *[(f"{MODULE}:TupleInTraining", flags, [
        "--model user_nets:TupleInTraining maps a [2, 3, 32, 32] batch of images in train mode "
        "to a tuple, not to [2, 10] logits (one per class of the data); return the logits "
        "tensor, or an object holding it as `.logits` (or a dict, as its \"logits\" entry) in "
        "train mode too; a named tuple with fields logits and aux_logits (as torchvision's "
        "Inception v3 returns) names auxiliary logits for --aux-loss-weight"])
      for flags in ([], ["--aux-loss-weight", "0.4"])],
    (f"{MODULE}:int_logits", [], ["--model user_nets:int_logits gives torch.int64 outputs; "
                                  "logits are floating point"]),
    (f"{MODULE}:all_frozen", [], ["--model user_nets:all_frozen has no trainable parameters "
                                  "(none with requires_grad=True)"]),
    # at the size its pretrained_cfg (timm's default, 224) names: the forward itself broke
    (f"{MODULE}:ForwardRaises", ["--image-size", "224"], [
        "--model user_nets:ForwardRaises failed on a [1, 3, 224, 224] batch of images "
        "(KeyError: 'features'); fix the network's forward"]),
    # ... and at the run's size (32 px): no size helps, so none is suggested
    (f"{MODULE}:ForwardRaises", [], [
        "--model user_nets:ForwardRaises failed on a [1, 3, 32, 32] batch of images "
        "(KeyError: 'features'); fix the network's forward"]),
    # a network for 32 px only, and no pretrained_cfg to name its size: not timm's default
    # 224, which fails as well, but the size that works
    (f"{MODULE}:bare", ["--image-size", "40"], ["--image-size 40 does not work with "
                                                "user_nets:bare (", "); try --image-size 32,"]),
]


@pytest.mark.parametrize("model, flags, said", BAD, ids=[f"{m} {' '.join(f)}".strip()
                                                         for m, f, _ in BAD])
def test_a_bad_factory_is_one_line_naming_what_to_fix(user_modules, tmp_path, model, flags,
                                                      said):
    write_module(user_modules, f"{MODULE}_broken", "raise RuntimeError('broken at import')\n")
    result = accel_train_here("--model", model, *TINY, *flags, "--output-dir",
                              str(tmp_path / "run"))
    line = one_error_line(result)
    for part in said:
        assert part in line, (part, line)
    assert not (tmp_path / "run").exists()  # refused before the run folder is written


def test_the_train_mode_check_leaves_the_statistics_the_random_state_and_the_mode():
    """Its forward in train mode moves BatchNorm's statistics and draws dropout's mask: both
    are put back, as the network's mode (the control: the same forward, unchecked, moves
    them)."""
    def network():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).eval()

    model, control = network(), network()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    random_state = torch.random.get_rng_state()
    check_train_forward(model, "net", 8, num_classes=2)
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), random_state)
    with torch.no_grad():
        control.train()(torch.zeros(2, 3, 8, 8))
    assert not torch.equal(control.state_dict()["1.running_mean"], before["1.running_mean"])
    assert not torch.equal(torch.random.get_rng_state(), random_state)


def test_a_factory_changed_since_training_is_one_line_naming_the_difference(user_modules,
                                                                             tmp_path):
    """The weights were trained as the factory built the network then; today it builds a
    wider first layer and one more layer.  eval, predict and export say so in one line, with
    the first differences (checked against the two networks' own state dicts), and send the
    user to the factory instead of to a copied config file."""
    run = tmp_path / "run"
    accel_train_here("--model", f"{MODULE}:bare", *TINY, "--output-dir", str(run), check=True)
    wider = USER_NETS.replace("nn.Linear(3 * 32 * 32, num_classes))",
                              "nn.Linear(3 * 32 * 32, 8), nn.Linear(8, num_classes))")
    write_module(user_modules, text=wider)
    for name in [n for n in sys.modules if n.startswith(MODULE)]:
        del sys.modules[name]  # the changed file, as a new process would import it
    trained = load_file(str(run / "model.safetensors"))
    built = import_from(user_modules).bare(10).state_dict()
    assert trained["1.weight"].shape != built["1.weight"].shape and "2.weight" not in trained
    Image.new("RGB", (32, 32)).save(tmp_path / "one.png")
    for argv in (("eval", str(run)), ("predict", str(run), str(tmp_path / "one.png")),
                 ("export", str(run), "-o", str(tmp_path / "export"))):
        line = one_error_line(accel_train_here(*argv))
        assert f"{MODULE}:bare (num_classes=10) builds another network than the one" in line
        assert "1.weight: [10, 3072] saved, [8, 3072] built" in line, line
        assert "not saved: 2.weight, 2.bias" in line and "as it was when the run trained" in line
    assert not (tmp_path / "export").exists()
    # resumed: the checkpoint's weights do not fit either, and the factory is named as the cause
    line = one_error_line(accel_train_here("--model", f"{MODULE}:bare", *TINY, "--output-dir",
                                           str(run), "--resume", "auto"))
    assert "holds another model's weights" in line and f"--model {MODULE}:bare builds another " \
        "network than the one this run trained" in line and "edited" not in line, line


def test_the_mismatch_words_name_the_first_differences_of_each_kind():
    from accel_train.commands.artifacts import state_dict_mismatch
    built = {name: torch.zeros(2) for name in "abcd"} | {"x": torch.zeros(3, 1)}
    saved = {"a": torch.zeros(5), "b": torch.zeros(6), "c": torch.zeros(7), "x": torch.zeros(3, 1),
             "old1": torch.zeros(1), "old2": torch.zeros(1)}
    assert state_dict_mismatch(saved, built) == (
        "a: [5] saved, [2] built; b: [6] saved, [2] built; not saved: d; not built: old1, old2")
    four_new = built | {f"new{i}": torch.zeros(1) for i in range(4)}
    assert state_dict_mismatch(built, four_new) == "not saved: new0, new1, new2"
    assert state_dict_mismatch(built, built) == \
        "the same names and shapes, yet torch refused them"


@pytest.mark.slow
def test_a_parameter_the_forward_never_uses_trains_on_two_processes(tmp_path):
    """DDP waits for a gradient of every trainable parameter and failed at the second step
    with its traceback; the start finds the unused one, says so, and DDP looks for it."""
    nets = write_module(tmp_path / "nets")
    result = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                  "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                  "-m", "accel_train", "--model", f"{MODULE}:WithUnused", *TINY, "--max-steps",
                  "3", "--output-dir", str(tmp_path / "run")],
                 env=child_env(PYTHONPATH=str(nets)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 trainable parameter(s) its train-mode forward pass never uses (old_head.weight, " \
        "old_head.bias)" in result.stdout + result.stderr


@pytest.mark.slow
def test_a_layer_skipped_at_some_steps_stops_in_one_line_or_trains_as_on_one_process(
        user_modules, tmp_path):
    """A block left out of every second batch (LayerDrop's way, on a schedule): the start's
    one forward sees it used, DDP waits for its gradient, and the step after the first skip
    raised torch's RuntimeError, whose advice (find_unused_parameters=True) the command line
    could not follow.  Now one line names --ddp-find-unused-parameters; with it, two
    processes under torchrun train the weights one process trains (the block's weights left
    alone at the skipping steps in both)."""
    nets = user_modules
    env = child_env(PYTHONPATH=str(nets))
    options = ["--model", f"{MODULE}:SkipsEverySecondBatch", *TINY, "--no-augment",
               "--num-workers", "0", "--mixed-precision", "no"]

    def torchrun(*extra: str):
        return run(launched_program("torchrun", "accel_train", *options, "--batch-size", "8",
                                    *extra), env=env)

    stopped = torchrun("--output-dir", str(tmp_path / "stopped"))
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0, said[-3000:]
    assert "accel_train: error: training stopped at step 3: --model user_nets:" \
        "SkipsEverySecondBatch left some of its trainable parameters without a gradient in " \
        "the step before" in said, said[-3000:]
    assert "pass --ddp-find-unused-parameters" in said
    assert "Expected to have finished reduction" not in said, said[-3000:]

    accel_train_here(*options, "--output-dir", str(tmp_path / "one"), check=True)
    two = torchrun("--ddp-find-unused-parameters", "--output-dir", str(tmp_path / "two"))
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    one, both = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("one", "two"))
    for key in one:
        assert torch.allclose(one[key], both[key], rtol=1e-5, atol=1e-6), key
    torch.manual_seed(0)  # the factory's initial weights, as the run builds them (--seed 0)
    initial = import_from(nets).SkipsEverySecondBatch(10).state_dict()
    assert not torch.equal(one["block.weight"], initial["block.weight"]), "the block trained"


def test_only_ddps_unfinished_reduction_becomes_the_one_line():
    """The text torch 2.x raises (the slow test above meets the real one under torchrun);
    any other RuntimeError in the forward keeps its traceback."""
    from accel_train.base.errors import UsageError
    from accel_train.train.skipped_parameters import naming_skipped_parameters
    ddp_says = ("Expected to have finished reduction in the prior iteration before starting a "
                "new one. This error indicates that your module has parameters that were not "
                "used in producing loss.")
    with pytest.raises(UsageError) as said:
        with naming_skipped_parameters(7, "mynets:Net"):
            raise RuntimeError(ddp_says)
    assert str(said.value) == (
        "training stopped at step 7: --model mynets:Net left some of its trainable parameters "
        "without a gradient in the step before (a layer skipped at random, as LayerDrop does, "
        "or a branch the input chooses), and DDP waits for a gradient of each at every step; "
        "pass --ddp-find-unused-parameters (DDP then looks for them at every step), or have "
        "every parameter take part in every step; checkpoints written before are intact")
    assert said.value.__cause__ is None and said.value.__suppress_context__
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with naming_skipped_parameters(7, "mynets:Net"):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with naming_skipped_parameters(7, "mynets:Net"):
        pass


def test_the_unused_parameters_are_those_the_train_mode_forward_leaves_without_gradient(
        tmp_path):
    """What DDP needs told: the parameters no gradient reaches in a training step.  A layer
    only eval mode runs is one of them; the network is left in its mode."""
    nets = import_from(write_module(tmp_path / "nets"))
    for factory, unused in ((nets.EvalOnlyCalibration, ["calib.weight", "calib.bias"]),
                            (nets.WithUnused, ["old_head.weight", "old_head.bias"]),
                            (nets.small_net, [])):
        network = factory(10).eval()
        assert unused_parameters(network, 32) == unused, factory
        assert not network.training
        assert all(p.grad is None for p in network.parameters())


@pytest.mark.slow
def test_a_layer_only_eval_mode_runs_trains_on_two_processes_as_on_one(user_modules, tmp_path):
    """A calibration layer after the head, run in eval mode only: the training steps give it
    no gradient, and DDP, not told to look for such parameters, failed at the second step
    ("Expected to have finished reduction ...").  Two processes under torchrun, each with
    half the batch, train the weights one process trains; the layer keeps its initial
    weights (the factory's, built from --seed 0 as the run builds it) and is evaluated."""
    nets = user_modules
    options = ["--model", f"{MODULE}:EvalOnlyCalibration", *TINY, "--no-augment",
               "--num-workers", "0"]
    env = child_env(PYTHONPATH=str(nets))
    accel_train_here(*options, "--output-dir", str(tmp_path / "one"), check=True)
    two = run(launched_program("torchrun", "accel_train", *options, "--batch-size", "8",
                               "--output-dir", str(tmp_path / "two")), env=env, check=True)
    assert "2 trainable parameter(s) its train-mode forward pass never uses (calib.weight, " \
        "calib.bias)" in two.stdout + two.stderr
    one, both = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("one", "two"))
    for key in one:
        assert torch.allclose(one[key], both[key], rtol=1e-5, atol=1e-6), key
    torch.manual_seed(0)
    initial = import_from(nets).EvalOnlyCalibration(10).state_dict()
    assert all(torch.equal(one[k], initial[k]) for k in ("calib.weight", "calib.bias"))
    assert float((one["head.1.weight"] - initial["head.1.weight"]).abs().max()) > 1e-4


def test_a_factory_that_takes_drop_rate_gets_it_and_freezes_by_its_classifier(user_modules,
                                                                              tmp_path):
    """--drop-rate reaches the factory's parameter of that name (recorded, and rebuilt with it);
    --freeze-backbone trains only what the network's get_classifier() returns."""
    with_classifier = USER_NETS.replace(
        "        return self.head(self.drop(self.features(x)))",
        "        return self.head(self.drop(self.features(x)))\n\n"
        "    def get_classifier(self):\n        return self.head")
    write_module(user_modules, f"{MODULE}_head", with_classifier)
    out = tmp_path / "run"
    accel_train_here("--model", f"{MODULE}_head:small_net", *TINY, *DROPOUT, "--freeze-backbone",
                     "--output-dir", str(out), check=True)
    trained = load_file(str(out / "model.safetensors"))
    torch.manual_seed(0)  # the run's --seed: the initial network is a function of it alone
    initial = import_from(user_modules, f"{MODULE}_head").small_net(num_classes=10,
                                                                    drop_rate=0.3)
    assert initial.drop.p == 0.3
    moved = {k for k, v in initial.state_dict().items() if not torch.equal(v, trained[k])}
    assert moved == {"head.weight", "head.bias"}, moved
    assert json.loads((out / "config.json").read_text())["accel_train"]["drop_rate"] == 0.3


@pytest.mark.slow
def test_a_timm_local_dir_trains_offline_from_its_weights(tmp_path):
    """timm's `local-dir:FOLDER` name (a run's folder, timm's format): built and loaded by timm
    with no network; frozen, its backbone ends equal to the folder's weights file."""
    source, tuned = tmp_path / "source", tmp_path / "tuned"
    accel_train_here("--model", "test_resnet", *TINY, "--max-steps", "2", "--output-dir",
                     str(source), check=True)
    tuning = accel_train_here("--model", f"local-dir:{source}", "--pretrained", "hub",
                              "--freeze-backbone", *TINY, "--output-dir", str(tuned), check=True)
    before, after = load_file(str(source / "model.safetensors")), \
        load_file(str(tuned / "model.safetensors"))
    assert before.keys() == after.keys()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.startswith("fc.") for k in moved), moved
    assert "random weights" not in tuning.stdout + tuning.stderr
    # the source's class names stay with the source: only the top-level list names the classes
    tuned_config = json.loads((tuned / "config.json").read_text())
    assert "label_names" not in tuned_config["pretrained_cfg"]
    assert tuned_config["label_names"] == model_spec_of(tuned)["class_names"]
    # without --pretrained hub the folder gives the architecture only, and the run says so
    fresh = accel_train_here("--model", f"local-dir:{source}", *TINY, "--max-steps", "1",
                             "--output-dir", str(tmp_path / "fresh"), check=True)
    assert f"warning: --model local-dir:{source}: the folder's architecture, from random " \
           f"weights; --pretrained hub starts from its model.safetensors" in fresh.stdout

    line = one_error_line(accel_train_here("--model", f"local-dir:{tmp_path / 'nothing'}",
                                           *TINY, "--output-dir", str(tmp_path / "run")))
    assert "no such folder" in line and "timm's format" in line, line
    # the source folder gone: its checkpoints cannot be rebuilt, the run folder can
    shutil.rmtree(source)
    line = one_error_line(accel_train_here("eval", str(tuned / "checkpoints")))
    assert "no such folder (from this folder); the network is built from that folder's " \
        "config.json: put it back, or pass the run folder" in line, line
    assert accel_train_here("eval", str(tuned)).returncode == 0


@pytest.mark.slow
def test_a_relative_local_dir_is_recorded_so_checkpoints_rebuild_from_elsewhere(tmp_path,
                                                                               monkeypatch):
    """local-dir:source given relative to the working folder: the checkpoints record the
    folder's absolute path, so eval of them works from another working folder."""
    accel_train_here("--model", "test_resnet", *TINY, "--max-steps", "1", "--output-dir",
                     str(tmp_path / "source"), check=True)
    monkeypatch.chdir(tmp_path)
    accel_train_here("--model", "local-dir:source", "--pretrained", "hub", *TINY, "--max-steps",
                     "1", "--output-dir", str(tmp_path / "tuned"), check=True)
    spec_file = next((tmp_path / "tuned" / "checkpoints").rglob("model_config.json"))
    assert json.loads(spec_file.read_text())["model_name"] == f"local-dir:{tmp_path / 'source'}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = accel_train_here("eval", str(tmp_path / "tuned" / "checkpoints"))
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_a_timm_hub_name_without_network_says_what_is_missing(tmp_path):
    """hf-hub: is accepted as timm accepts it; with no network and nothing in the cache, the
    run says so in one line and names the offline way (local-dir:)."""
    result = accel_train("--model", "hf-hub:timm/resnet18.a1_in1k", *TINY, "--output-dir",
                         str(tmp_path / "run"), env=child_env(HF_HOME=str(tmp_path / "hf")))
    line = one_error_line(result)
    # the children run offline (HF_HUB_OFFLINE=1): said at once, before timm asks the Hub
    assert "--model hf-hub:timm/resnet18.a1_in1k: HF_HUB_OFFLINE is set (unset it where there "\
           "is network to download), and the repository's config.json is not in the local " \
           f"cache ({tmp_path / 'hf' / 'hub'})" in line, line
    assert "local-dir:FOLDER" in line, line
