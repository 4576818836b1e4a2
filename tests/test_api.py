"""The Python API: `accel_train.fit` trains a program's own nn.Module on its own Dataset, as the
command line trains a named model: the run folder and its records, checkpoints and exact
resume, and on two processes under `accelerate launch` the same weights as one process with the
same global batch."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset

import accel_train
import accel_train.callbacks
from accel_train.cli import main
from accel_train.api import in_python_terms
from conftest import CONFIGS, REPO, free_port, model_spec_of, run
from conftest import test_env as child_env
from accel_train.base.errors import UsageError
from accel_train.model.build import cuda_index, probe_images, weights_device

EXAMPLE = REPO / "examples" / "custom_model.py"


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

    def forward(self, images):
        return self.body(images)


class Squares(Dataset):
    """Class 1: a bright square in the middle; class 0: none.  uint8 CHW tensors."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        image = torch.full((3, 16, 16), 40, dtype=torch.uint8)
        if index % 2:
            image[:, 5:11, 5:11] = 220
        return image, index % 2


class Relabelled(Dataset):
    """Another dataset's items, some labels replaced (a class the training data lacks)."""

    def __init__(self, dataset, mapping: dict):
        self.dataset, self.mapping = dataset, mapping

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        image, label = self.dataset[index]
        return image, self.mapping.get(label, label)


def fit_tiny(tmp_path, name: str, model: nn.Module | None = None, **options):
    torch.manual_seed(0)
    return accel_train.fit(Tiny() if model is None else model, Squares(64), Squares(16),
                           batch_size=8, epochs=2, mixed_precision="no", channels_last=False,
                           augment=False,
                           progress="log", plots=False, output_dir=str(tmp_path / name),
                           **options)


def test_fit_trains_a_module_on_a_dataset_into_a_run_folder(tmp_path):
    run_dir = fit_tiny(tmp_path, "run")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r.get("type") == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and epochs[-1]["eval_count"] == 16
    # 64 images in batches of 8: 8 steps an epoch
    assert max(r["step"] for r in records if "step" in r) == 16
    assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints").is_dir()
    saved = load_file(str(run_dir / "model.safetensors"))
    assert set(saved) == set(Tiny().state_dict())


class HalfAndBfloat(Tiny):
    """Weights in two half precisions at once: both are named."""

    def __init__(self):
        super().__init__()
        self.body[0].to(torch.bfloat16)
        self.body[4].to(torch.float16)


@pytest.mark.parametrize("cast, named", [(lambda m: m.to(torch.bfloat16), "bfloat16"),
                                         (lambda m: m.half(), "float16"),
                                         (lambda m: m.double(), "float64"),
                                         (lambda m: HalfAndBfloat(), "bfloat16 and float16")],
                         ids=["bf16", "fp16", "fp64", "two"])
def test_a_module_in_another_precision_than_float32_is_one_line(tmp_path, cast, named):
    """Its first forward on float32 images fails; the refusal names the weights' dtype, not an
    image size that is not the cause, and the run writes nothing."""
    model = cast(Tiny())
    dtypes = [p.dtype for p in model.parameters()]
    with pytest.raises(UsageError) as refused:
        fit_tiny(tmp_path, "run", model)
    assert str(refused.value) == (
        f"model='{type(model).__module__}:{type(model).__qualname__}' holds {named} weights, "
        f"and the run trains float32 weights (mixed precision computes in bf16 or fp16 under "
        f"autocast): build it in float32 (model.float()); mixed_precision='bf16' gives half "
        f"precision's speed")
    assert not (tmp_path / "run").exists()
    assert [p.dtype for p in model.parameters()] == dtypes  # the program's module as it was


def test_the_starts_probe_images_are_made_where_the_weights_are():
    """A module a program moved to its GPU is probed there, not with CPU images that would fail
    its forward as if the size were wrong (the meta device stands in for a GPU here)."""
    assert probe_images(Tiny().to("meta"), 2, 16).device == torch.device("meta")
    assert probe_images(Tiny(), 2, 16).shape == (2, 3, 16, 16)
    buffers_only = nn.BatchNorm2d(3, affine=False).to("meta")
    assert weights_device(buffers_only) == torch.device("meta")
    assert weights_device(nn.ReLU()) == torch.device("cpu")
    assert cuda_index(torch.device("cpu")) == [] and cuda_index(torch.device("cuda", 1)) == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a module already on a GPU needs one")
def test_a_module_already_on_the_gpu_trains_there(tmp_path):
    model = Tiny().cuda()
    run_dir = fit_tiny(tmp_path, "run", model)
    assert (run_dir / "model.safetensors").is_file()
    assert next(model.parameters()).is_cuda


@pytest.mark.slow
def test_fit_records_its_program_even_after_the_command_line_ran_in_the_process(tmp_path):
    """A program that called the command line (cli.main) and then fit(): each run records
    what ran it, `accel-train ARGS` and then the program's own argv."""
    assert main(["--dataset", "synthetic", "--synthetic-train-size", "32", "--batch-size", "16",
                 "--model", "test_resnet", "--max-eval-samples", "16",
                 "--max-steps", "1", "--no-plots", "--mixed-precision", "no",
                 "--no-channels-last", "--output-dir", str(tmp_path / "cli")]) == 0
    fit_tiny(tmp_path, "fit", max_steps=1)
    recorded = {name: yaml.safe_load((tmp_path / name / "config.yaml").read_text())["command"]
                for name in ("cli", "fit")}
    assert recorded["cli"][:2] == ["accel-train", "--dataset"]
    assert recorded["fit"] == sys.argv


def test_fit_twice_in_one_process_in_two_precisions_is_one_line(tmp_path):
    """A notebook's second fit() in another precision: accelerate keeps one precision a process
    (its ValueError, with no public reset); one UsageError naming what to do.  The same
    precision again trains, and one Callback instance is taken as the one callback."""
    seen = []

    class Count(accel_train.callbacks.Callback):
        def on_step_end(self, trainer, step):
            seen.append(step)

    fit_tiny(tmp_path, "fp32", max_steps=1)
    with pytest.raises(UsageError) as refused:
        accel_train.fit(Tiny(), Squares(64), Squares(16), batch_size=8, max_steps=1,
                        mixed_precision="bf16", output_dir=str(tmp_path / "bf16"))
    assert str(refused.value) == (
        "this process already trained in fp32, and accelerate keeps one precision a process: "
        "this run cannot train in bf16; pass mixed_precision='no' (or leave it to auto), or "
        "train in a new process")
    fit_tiny(tmp_path, "again", max_steps=1, callbacks=Count())
    assert seen == [1]


@pytest.mark.slow
def test_a_resume_in_another_precision_than_the_process_holds_says_to_use_a_new_process(tmp_path):
    """A sweep whose later run resumes a checkpoint saved in bf16 by another process: auto takes
    the checkpoint's precision on resume, so the refusal names a new process, not the keyword
    (auto would choose the same precision again)."""
    saved_in_bf16 = tmp_path / "bf16"
    run([sys.executable, "-c", (
        "import sys, torch, accel_train; sys.path.insert(0, 'tests')\n"
        "from test_api import Tiny, Squares\n"
        "torch.manual_seed(0)\n"
        "accel_train.fit(Tiny(), Squares(64), Squares(16), batch_size=8, epochs=2, max_steps=8,"
        " mixed_precision='bf16', channels_last=False, augment=False, plots=False,"
        f" output_dir={str(saved_in_bf16)!r})")], check=True)
    assert list((saved_in_bf16 / "checkpoints").iterdir())
    fit_tiny(tmp_path, "fp32", max_steps=1)
    with pytest.raises(UsageError) as refused:
        accel_train.fit(Tiny(), Squares(64), Squares(16), batch_size=8, epochs=2,
                        channels_last=False, augment=False, plots=False, resume="auto",
                        output_dir=str(saved_in_bf16))
    assert str(refused.value) == (
        "this process already trained in fp32, and accelerate keeps one precision a process: "
        "the checkpoint this run resumes trained in bf16; resume it in a new process")


def test_fit_resumes_bit_identically(tmp_path):
    """Stopped after its first epoch's checkpoint and resumed: the weights of the run that was
    never stopped, exactly."""
    whole = fit_tiny(tmp_path, "whole")

    class StopAfterFirstCheckpoint(accel_train.callbacks.Callback):
        def on_checkpoint(self, trainer, path):
            raise KeyboardInterrupt  # a user's Ctrl-C right after the checkpoint

    with pytest.raises(KeyboardInterrupt):
        fit_tiny(tmp_path, "halves", callbacks=[StopAfterFirstCheckpoint()])
    halves = fit_tiny(tmp_path, "halves", resume="auto")
    a = load_file(str(whole / "model.safetensors"))
    b = load_file(str(halves / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


class ShiftedSquares(Squares):
    """Squares through a random transform of the dataset's own (a shift drawn from torch's
    global generator), as a program keeps its own augmentation with augment=False."""

    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        image[:, :, 0] = 0  # a dark edge: no image is flat, so every shift shows
        return torch.roll(image, int(torch.randint(-3, 4, ())), dims=2), label


@pytest.mark.slow  # two runs of two epochs, one stopped and resumed: over 4 s
def test_a_datasets_own_augmentation_resumes_bit_identically_mid_epoch(tmp_path):
    """Its draws are a function of the sample's place in the run, not of what the loader
    worker drew before: a run stopped after a mid-epoch checkpoint and resumed ends with the
    weights of the run that never stopped."""
    def fit_own(name: str, **options):
        torch.manual_seed(0)
        return accel_train.fit(Tiny(), ShiftedSquares(64), Squares(16), batch_size=8, epochs=2,
                               augment=False, in_memory="never", checkpoint_every=3,
                               mixed_precision="no", channels_last=False, progress="log",
                               plots=False, output_dir=str(tmp_path / name), **options)

    whole = fit_own("whole")

    class StopAtFirstCheckpoint(accel_train.callbacks.Callback):
        def on_checkpoint(self, trainer, path):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit_own("halves", callbacks=[StopAtFirstCheckpoint()])
    assert [p.name for p in (tmp_path / "halves" / "checkpoints").iterdir()] == ["step_00000003"]
    halves = fit_own("halves", resume="auto")
    a = load_file(str(whole / "model.safetensors"))
    b = load_file(str(halves / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


def test_callbacks_see_every_step_and_evaluation(tmp_path):
    seen = {"steps": [], "evaluations": 0}

    class Watch(accel_train.callbacks.Callback):
        def on_step_end(self, trainer, step):
            seen["steps"].append(step)

        def on_evaluate(self, trainer, metrics):
            seen["evaluations"] += 1

    fit_tiny(tmp_path, "run", callbacks=[Watch()])
    assert seen == {"steps": list(range(1, 17)), "evaluations": 2}


class ScriptTiny(Tiny):
    """Tiny as a class of the script that runs: what `python my_script.py` defines.  Built
    from the class count, so only where it is defined keeps commands from rebuilding it."""

    def __init__(self, num_classes: int = 2):
        super().__init__()


ScriptTiny.__module__ = "__main__"


def test_a_scripts_own_class_and_datasets_are_named_as_what_commands_cannot_rebuild(tmp_path,
                                                                                    capsys):
    """eval and predict rebuild a run's network and data from its records: a class defined in
    the training script and datasets handed to fit() are neither, and each says so in one
    line (fit warns of the class at the start)."""
    torch.manual_seed(0)
    run_dir = accel_train.fit(ScriptTiny(), Squares(32), Squares(8), batch_size=8, epochs=1,
                              mixed_precision="no", channels_last=False, augment=False,
                              progress="log", plots=False,
                              output_dir=tmp_path / "run")  # a Path, as fit() returns one
    assert run_dir.resolve() == (tmp_path / "run").resolve()
    said = capsys.readouterr()
    assert "the model's class ScriptTiny is defined in the script that runs" in \
        said.out + said.err
    assert "cannot rebuild this network" in said.out + said.err
    image = tmp_path / "square.png"
    Image.fromarray(Squares(2)[1][0].permute(1, 2, 0).numpy()).save(image)
    for command, expected in (
            (["eval", str(run_dir)], "was trained on datasets a program handed to fit() "
                                     "(Squares (train_dataset/eval_dataset)), which no command "
                                     "can load again; pass --data-dir PATH"),
            (["predict", str(run_dir), str(image)], "the model is __main__:ScriptTiny, a class "
                                                    "that the script which trained it defined "
                                                    "in itself")):
        assert main(command) == 2, command
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], lines


@pytest.mark.parametrize("call, expected", [
    (lambda: accel_train.fit("no_such_model_name", Squares(8)), "model='no_such_model_name'"),
    (lambda: accel_train.fit(Tiny(), Squares(8), batch_sise=8), "unknown option"),
    (lambda: accel_train.fit(Tiny(), [1, 2, 3], epochs=1), "each item must be"),
    (lambda: accel_train.fit(Tiny(), object()), "map-style dataset"),
    (lambda: accel_train.fit(Tiny(), Squares(8), pretrained="w.safetensors"), "pretrained"),
    (lambda: accel_train.fit(Tiny(), Squares(8), Squares(0)), r"^eval_dataset: it holds no "
                                                              r"items to evaluate on"),
    (lambda: accel_train.fit(Tiny(), Squares(0), Squares(8)), r"^train_dataset: it holds no "
                                                              r"items"),
    (lambda: accel_train.fit(Tiny(), Squares(8), Relabelled(Squares(8), {1: 7})),
     r"^eval_dataset: its labels hold 7, which no item of train_dataset has"),
    # values no argparse type read: a switch as 'no' was taken as on, a seed of 1.7 kept
    (lambda: accel_train.fit(Tiny(), Squares(8), plots="no"),
     r"^plots is a switch: true or false \(got 'no'\)"),
    (lambda: accel_train.fit(Tiny(), Squares(8), seed=1.7), r"^seed= must be a whole number"),
    (lambda: accel_train.fit(Tiny(), Squares(8), progress="fancy"),
     r"^progress='fancy' is not one of auto, bar, log"),
    (lambda: accel_train.fit(Tiny(), Squares(8), label_smoothing=2.0),
     r"^label_smoothing= must be below 1 \(got 2.0\)"),
    (lambda: accel_train.fit(Tiny(), Squares(8), data_dir="/elsewhere", streaming=True),
     r"^fit\(\): data_dir=, streaming= choose and read data for the command line"),
    (lambda: accel_train.fit(Tiny(), Squares(8), callbacks=[len]),
     r"^fit\(\): callbacks= takes a list of accel_train.callbacks.Callback instances "
     r"\(got builtin_function_or_method"),
    (lambda: accel_train.fit(Tiny(), Squares(8), callbacks=3), r"callbacks= takes a list"),
])
def test_bad_arguments_are_one_clear_error(tmp_path, monkeypatch, call, expected):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=expected):
        call()


@pytest.mark.parametrize("message, expected", [
    ("--output-dir /x/run holds a finished run; pass --resume auto to go on, or another "
     "--output-dir", "output_dir='/x/run' holds a finished run; pass resume='auto' to go on, or "
     "another output_dir="),
    ("--image-size 96 does not work with vit; try --image-size 224",
     "image_size=96 does not work with vit; try image_size=224"),
    ("Lower --learning-rate (or set --grad-clip, or --mixed-precision no)",
     "Lower learning_rate= (or set grad_clip=, or mixed_precision='no')"),
    ("drop --no-plots or --model-ema; --model resnet18: x", "drop plots=False or model_ema=True; "
     "model='resnet18': x"),
    ("--cutmix 1.0 with --mixup-prob 0: idle. --epochs 3.",
     "cutmix=1.0 with mixup_prob=0: idle. epochs=3."),
    ("--val-fraction must be between 0 and 1", "val_fraction= must be between 0 and 1"),
    ("--format onnx beside --data-on-device always", "--format onnx beside "
     "data_on_device='always'"),  # --format is export's, no option of fit()
    ("--tta flip and --model resnet18.", "tta='flip' and model='resnet18'."),  # a choice, a stop
    ("--learning-rate 1e-05 is small", "learning_rate=1e-05 is small"),
    # a command quoted to run keeps its flags, to the clause's end
    ("list them (accel-train check-data --data-dir DIR), or pass --resume auto",
     "list them (accel-train check-data --data-dir DIR), or pass resume='auto'"),
    ("next: accel-train eval r  |  accel-train predict r --top-k 3; --epochs 2",
     "next: accel-train eval r  |  accel-train predict r --top-k 3; epochs=2"),
    ("accel-train eval /x/r1.v2 evaluates it. Then pass --epochs 5",   # a sentence's end
     "accel-train eval /x/r1.v2 evaluates it. Then pass epochs=5"),
    # a list's numbers as a Python list; numbers after a one-value option stay the sentence's
    ("e.g. --mean 0.485 0.456 0.406 or --scale 0.08 1; --epochs 3 2 more",
     "e.g. mean=[0.485, 0.456, 0.406] or scale=[0.08, 1]; epochs=3 2 more"),
    ("resume with --mean 0.5 --std 0.25, or start", "resume with mean=[0.5] std=[0.25], or start"),
    # a placeholder the reader fills in
    ("or pass --pretrained PATH to a local file (--warmup-fraction F makes it a share)",
     "or pass pretrained=PATH to a local file (warmup_fraction=F makes it a share)"),
])
def test_messages_name_keyword_arguments_where_the_command_line_names_flags(message, expected):
    assert in_python_terms(message) == expected


@pytest.mark.slow
def test_fits_warnings_and_summary_name_keywords_and_the_command_line_then_flags(tmp_path,
                                                                                capsys):
    """Not only its errors: what fit() prints on the way is in its caller's terms; the
    command line run after it in the same process speaks flags again."""
    fit_tiny(tmp_path, "fit", Sized(num_classes=2), max_steps=1, sync_bn=True)
    said = capsys.readouterr()
    text = said.out + said.err
    assert "warning: sync_bn=True: " in text and "--sync-bn" not in text
    assert "(data_on_device='auto': not on a CUDA device)" in text and "--data-on" not in text
    # the commands to run next keep their flags; eval of a program's data needs data named
    assert f"next: accel-train eval {tmp_path / 'fit'} --data-dir DATA  |" in text
    assert main(["--dataset", "synthetic", "--synthetic-train-size", "32", "--batch-size", "16",
                 "--model", "test_resnet", "--max-eval-samples", "16",
                 "--max-steps", "1", "--no-plots", "--mixed-precision", "no",
                 "--no-channels-last", "--output-dir", str(tmp_path / "cli")]) == 0
    said = capsys.readouterr()
    assert "(--data-on-device auto: not on a CUDA device)" in said.out + said.err
    assert f"next: accel-train eval {tmp_path / 'cli'}  |" in said.out + said.err


def test_fit_says_what_to_change_in_its_own_keywords(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"^val_fraction= must be between 0 and 1 \(got 2\)"):
        accel_train.fit(Tiny(), Squares(8), val_fraction=2)


@pytest.mark.slow
def test_the_example_on_two_processes_equals_one_process(tmp_path):
    """examples/custom_model.py as its docstring says: 1 process x 32 and, under `accelerate
    launch` with accelerate_configs/cpu_2proc.yaml, 2 processes x 16 train the same weights."""
    one = run([sys.executable, str(EXAMPLE), "--output-dir", str(tmp_path / "one"),
               "--batch-size", "32"], cwd=tmp_path, env=child_env())
    assert one.returncode == 0, one.stderr[-3000:]
    two = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port()),
               str(EXAMPLE), "--output-dir", str(tmp_path / "two"), "--batch-size", "16"],
              cwd=tmp_path, env=child_env())
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es)" in two.stdout
    assert two.stdout.count("trained: ") == one.stdout.count("trained: ") == 1, two.stdout
    a = load_file(str(tmp_path / "one" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "model.safetensors"))
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-5), key
    # and training moved the weights (the comparison is not of two untouched networks)
    torch.manual_seed(0)
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from custom_model import SmallNet
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    initial = SmallNet().state_dict()
    assert max(float((a[k] - initial[k]).abs().max()) for k in a) > 1e-3
    # and predict rebuilds the network from the module the run recorded (custom_net, on
    # PYTHONPATH as the docstring says): the probabilities of the trained weights in plain
    # torch on the image normalized by the run's recorded mean and std
    from custom_model import Stripes
    image = (Stripes(1, offset=20_000)[0][0] * 255).round().to(torch.uint8)
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(tmp_path / "stripes.png")
    predicted = run([sys.executable, "-m", "accel_train", "predict", str(tmp_path / "one"),
                     str(tmp_path / "stripes.png"), "--json"], cwd=tmp_path,
                    env=child_env(PYTHONPATH=str(EXAMPLE.parent)))
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    spec = model_spec_of(tmp_path / "one")
    trained = SmallNet()
    trained.load_state_dict(a)
    mean, std = (torch.tensor(spec[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        expected = trained((image[None].float() / 255 - mean) / std).softmax(-1)[0]
    top = json.loads(predicted.stdout.splitlines()[-1])["predictions"]
    assert [p["index"] for p in top] == expected.argsort(descending=True).tolist()
    assert [p["probability"] for p in top] == pytest.approx(
        expected.sort(descending=True).values.tolist(), abs=1e-5)


def test_fits_sample_limits_keep_the_cli_draw_of_the_users_items():
    """max_train_samples=10 and max_eval_samples=4 of a program's datasets keep the items the
    CLI's rule keeps (numpy's default_rng(0).permutation, as datasets' shuffle(seed=0)), in the
    datasets' order; sample_subset="first" the first ones."""
    from accel_train.config import TrainConfig
    from accel_train.data.user_data import load_user_data
    from conftest import drawn_subset
    drawn = load_user_data(Squares(64), Squares(16), TrainConfig(
        max_train_samples=10, max_eval_samples=4, in_memory="never"))
    assert drawn.train.indices.tolist() == drawn_subset(64, 10).tolist()
    assert drawn.held_out.indices.tolist() == drawn_subset(16, 4).tolist()
    assert drawn.sample_subset == "random"
    first = load_user_data(Squares(64), Squares(16), TrainConfig(
        max_train_samples=10, max_eval_samples=4, sample_subset="first", in_memory="never"))
    assert first.train.indices.tolist() == list(range(10))
    assert first.held_out.indices.tolist() == list(range(4))
    whole = load_user_data(Squares(64), Squares(16), TrainConfig(max_train_samples=64,
                                                                 in_memory="never"))
    assert whole.sample_subset is None and len(whole.train) == 64


def test_float_images_outside_0_1_are_refused_and_0_1_are_the_uint8_image(tmp_path):
    """fit() clamped floats to 0-1: 0-255 floats trained on near-white images and normalized
    ones lost everything below 0, without a word.  A float image in 0-1 is the uint8 image
    x / 255 (the oracle: numpy's rounding of x * 255)."""
    import numpy as np

    from accel_train.data.user_data import as_uint8_chw
    pixels = torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8)
    pixels[0, 0, :2] = torch.tensor([0, 255], dtype=torch.uint8)  # both ends of the range
    assert torch.equal(as_uint8_chw(pixels.float() / 255, "item 0"), pixels)
    assert torch.equal(as_uint8_chw(np.full((4, 5), 0.5, np.float32), "item 0"),
                       torch.full((3, 4, 5), 128, dtype=torch.uint8))
    with pytest.raises(UsageError, match=r"item 3: a float image must hold values in 0-1, got "
                                         r"0 to 255 \(0-255 values: divide by 255"):
        as_uint8_chw(pixels.float().index_fill(1, torch.tensor([0]), 255)
                     .index_fill(1, torch.tensor([1]), 0), "item 3")
    with pytest.raises(UsageError, match=r"got -2 to 0.5 \(normalized values"):
        as_uint8_chw(torch.tensor([[[-2.0, 0.5]]]), "item 0")
    with pytest.raises(UsageError, match=r"got -1.5 to 2.5 \(normalized values"):
        as_uint8_chw(torch.tensor([[[-1.5, 2.5]]]), "item 0")
    with pytest.raises(UsageError, match=r"got 0 to 1.5 \(0-255 values"):
        as_uint8_chw(torch.tensor([[[0.0, 1.5]]]), "item 0")


@pytest.mark.filterwarnings("error")  # torch's warning for read-only arrays reaches users
def test_numpy_images_are_height_width_channels_as_numpy_writes_them():
    """PIL images, and np.asarray of one (H, W, 3), of a grey one (H, W); a channels-first array
    stays as it is.  Oracle: PIL's own pixels, read back through torchvision's pil_to_tensor.
    (An RGBA array is blended over white as its PIL image is: test_user_photos.)"""
    import numpy as np
    from torchvision.transforms.functional import pil_to_tensor

    from accel_train.data.user_data import as_uint8_chw
    rgba = Image.fromarray(np.random.default_rng(0).integers(0, 256, (5, 7, 4), np.uint8), "RGBA")
    for image in (rgba.convert("RGB"), rgba.convert("L")):
        expected = pil_to_tensor(image.convert("RGB"))
        assert torch.equal(as_uint8_chw(np.asarray(image), "item 0"), expected), image.mode
        assert torch.equal(as_uint8_chw(image, "item 0"), expected), image.mode  # PIL's own
    chw = pil_to_tensor(rgba.convert("RGB")).numpy()
    assert torch.equal(as_uint8_chw(chw, "item 0"), torch.from_numpy(chw))
    with pytest.raises(UsageError, match=r"item 2: a tensor image must be channels-first"):
        as_uint8_chw(np.zeros((5, 7, 2), np.uint8), "item 2")


class NamedLabels(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.zeros(3, 8, 8, dtype=torch.uint8), ["cat", "dog"][index % 2]


def test_labels_that_are_names_are_one_line_saying_how_to_map_them(tmp_path):
    with pytest.raises(UsageError) as refused:
        accel_train.fit(Tiny(), NamedLabels(), batch_size=4, epochs=1, mixed_precision="no",
                        plots=False, output_dir=str(tmp_path / "run"))
    assert str(refused.value) == (
        "train_dataset: labels must be class indices 0..N-1 (integers), found 'cat' (str); map "
        "class names to indices, say {name: i for i, name in enumerate(sorted(names))}, and "
        "pass the names in that order as the dataset's `classes`")
    assert not (tmp_path / "run").exists()


GUARD_SCRIPT = """
import sys
import torch
import accel_train
from torch.utils.data import TensorDataset

images = torch.rand(16, 3, 8, 8)
data = TensorDataset(images, torch.arange(16) % 2)
{call}
"""


@pytest.mark.parametrize("call, refused", [
    ("accel_train.fit('test_resnet', data, max_steps=1, output_dir=sys.argv[1])", True),
    ("def main():\n    accel_train.fit('test_resnet', data, max_steps=1, "
     "output_dir=sys.argv[1])\n\nmain()", True),
    ("if __name__ == '__main__':\n    accel_train.fit('test_resnet', data, max_steps=1, "
     "output_dir=sys.argv[1], num_workers=1, batch_size=4)", False),
])
@pytest.mark.slow
def test_fit_outside_a_main_guard_is_one_line_before_anything_starts(tmp_path, call, refused):
    """Loader workers import the script again: an unguarded fit() started a training in each
    (the run hung, then failed inside multiprocessing).  Under the guard it trains, workers
    and all."""
    script = tmp_path / "train_script.py"
    script.write_text(GUARD_SCRIPT.format(call=call))
    result = run([sys.executable, str(script), str(tmp_path / "run")], timeout=240)
    if refused:
        line = result.stderr.strip().splitlines()[-1]
        assert result.returncode != 0 and "fit() runs at the top level of the script" in line
        assert f"{script}:" in line and not (tmp_path / "run").exists()
    else:
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / "run" / "model.safetensors").is_file()


@pytest.mark.parametrize("script, refused", [
    ("x = 1\nfit()\n", True),
    ("def main():\n    fit()\n\nmain()\n", True),
    ("if __name__ == '__main__':\n    fit()\n", False),
    ("def main():\n    fit()\n\n\nif __name__ == '__main__':\n    main()\n", False),
    ("if '__main__' == __name__:\n    fit()\n", False),
    ("import sys\nif len(sys.argv) > 500:\n    pass\nelse:\n    fit()\n", True),
])
def test_the_guard_check_reads_the_statement_that_calls(tmp_path, monkeypatch, script, refused):
    """In process, as the script's own module: the statement at the calling line decides (the
    subprocess test above runs the whole thing)."""
    import inspect
    import types

    from accel_train.base.main_guard import refuse_unguarded_call
    path = tmp_path / "user_script.py"
    path.write_text(script)
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "__main__", module)
    module.fit = lambda: refuse_unguarded_call(inspect.currentframe().f_back)
    code = compile(script, str(path), "exec")
    if refused:
        with pytest.raises(UsageError, match=rf"{path}:\d+: fit\(\) runs at the top level"):
            exec(code, module.__dict__)
    else:
        exec(code, module.__dict__)
    # a script with no file (a notebook, python -c) is not judged
    module.__file__ = None
    exec(compile(script, "<stdin>", "exec"), module.__dict__)


def test_a_module_its_class_cannot_rebuild_from_the_class_count_is_said(tmp_path, capsys):
    """A timm module handed to fit(): eval, predict and export rebuild a program's module as
    CLASS(num_classes=N), which timm's ResNet cannot be (it needs block and layers); the run
    says so at its start and names the timm name to pass instead."""
    import timm
    accel_train.fit(timm.create_model("test_resnet", num_classes=2), Squares(64), Squares(16),
                    batch_size=8, max_steps=1, mixed_precision="no", channels_last=False,
                    progress="log", plots=False, output_dir=str(tmp_path / "run"))
    said = capsys.readouterr()
    assert "eval, predict and export rebuild the network as ResNet(num_classes=N), which that " \
           "class cannot do (its constructor needs more); pass the model by its timm name, " \
           "fit('test_resnet', ...), to use them" in said.out + said.err
    # and the last line offers only what works on such a run
    assert f"; next: accel-train plot {tmp_path / 'run'} (eval, predict and export cannot " \
           f"rebuild this network: the warning at the start says why)" in said.out + said.err
    assert "accel-train eval" not in said.out + said.err
    accel_train.fit(Tiny(), Squares(64), Squares(16), batch_size=8, max_steps=1,
                    mixed_precision="no", channels_last=False, progress="log", plots=False,
                    output_dir=str(tmp_path / "tiny"))
    said = capsys.readouterr()  # Tiny() takes no num_classes either: a factory is named
    assert "Tiny(num_classes=N), which that class cannot do (its constructor needs more); " \
           "give it a constructor that takes num_classes alone" in said.out + said.err
    accel_train.fit(Sized(num_classes=2), Squares(64), Squares(16), batch_size=8, max_steps=1,
                    mixed_precision="no", channels_last=False, progress="log", plots=False,
                    output_dir=str(tmp_path / "sized"))
    said = capsys.readouterr()
    assert "rebuild the network as" not in said.out + said.err
    assert f"next: accel-train eval {tmp_path / 'sized'} --data-dir DATA  |  accel-train " \
           f"predict {tmp_path / 'sized'} IMAGES..." in said.out + said.err


class Sized(Tiny):
    """Tiny, built from the class count as eval, predict and export rebuild a module."""

    def __init__(self, num_classes: int):
        super().__init__()


def test_the_record_of_a_fit_run_as_a_recipe_asks_for_data(tmp_path, capsys):
    """--config RUN/config.yaml of a fit() run: its datasets were a program's, and the record's
    dataset entry is the embedded set's name; the command line trained the synthetic shapes
    in their place.  One line now, and with --dataset given it trains on that."""
    run = fit_tiny(tmp_path, "fit", max_steps=1)
    capsys.readouterr()
    again = tmp_path / "again"
    assert main(["--config", str(run / "config.yaml"), "--output-dir", str(again)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "is the record of a run of fit() on datasets a program handed " \
        "it" in lines[0] and lines[0].endswith("pass --data-dir PATH or --dataset NAME beside it")
    assert not again.exists()
