"""Run config files: the override order (defaults < accelerate launch's config < --config YAML <
flags), and a run's own config.yaml passed back in repeats the run, here under `accelerate
launch` with the file that `accelerate config default` writes, made without a terminal."""

from __future__ import annotations

import contextlib
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file

import conftest
from accel_train.cli import build_train_parser, config_from_args, main
from accel_train.base.errors import UsageError

# A run YAML as a user writes one: dashes or underscores, any training option.
RUN_YAML = """\
dataset: synthetic
synthetic-train-size: 128
max_eval_samples: 32
model: test_resnet
batch-size: 16
epochs: 1
max_steps: 4
seed: 3
augment: false
progress: log
plots: false
"""


@contextlib.contextmanager
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


in_process_run = conftest.clean_accelerate_state


def without_terminal(cmd: list[str]) -> subprocess.CompletedProcess:
    """As from a script or CI: stdin is not a terminal (interactive prompts would fail)."""
    result = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            env=conftest.test_env(), cwd=conftest.REPO, timeout=300)
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def parse(argv: list[str], environ: dict | None = None):
    return config_from_args(build_train_parser().parse_args(argv), environ=environ or {})


def test_override_order(tmp_path):
    """Each layer beats the one before it, for the same option."""
    run_config = tmp_path / "config.yaml"  # shaped like a run directory's: options under train:
    run_config.write_text(yaml.safe_dump({"train": {"batch_size": 12, "epochs": 7,
                                                    "mixed_precision": "no"},
                                          "resolved": {"world_size": 8}, "git_revision": None}))
    launched_bf16 = {"ACCELERATE_MIXED_PRECISION": "bf16"}  # what `accelerate launch` exports

    assert parse([]).mixed_precision == "auto"                          # default
    assert parse([], {"ACCELERATE_MIXED_PRECISION": "no"}).mixed_precision == "auto"  # unchosen
    assert parse([], launched_bf16).mixed_precision == "bf16"           # accelerate's config
    # Its fp16 is auto's choice on a GPU and impossible on a CPU: auto (which says so on a CPU)
    assert parse([], {"ACCELERATE_MIXED_PRECISION": "fp16"}).mixed_precision == "auto"
    assert parse(["--mixed-precision", "fp16"],
                 {"ACCELERATE_MIXED_PRECISION": "fp16"}).mixed_precision == "fp16"
    from_yaml = parse(["--config", str(run_config)], launched_bf16)
    assert (from_yaml.mixed_precision, from_yaml.batch_size, from_yaml.epochs) == ("no", 12, 7)
    flags = parse(["--config", str(run_config), "--epochs", "2", "--mixed-precision", "bf16"],
                  launched_bf16)
    assert (flags.mixed_precision, flags.batch_size, flags.epochs) == ("bf16", 12, 2)


def recipe_refusal(path, text: str) -> str:
    """The one line a recipe of `text` at `path` is refused with."""
    path.write_text(text)
    with pytest.raises(UsageError) as refused:
        parse(["--config", str(path)])
    return str(refused.value)


def test_one_length_for_a_run_epochs_or_a_time_budget(tmp_path, capsys):
    """--epochs and --time-budget typed together are refused (the budget ignored the epochs
    without a word); a length typed on the command line beats the other kind from a --config
    file (the file's budget, or its epochs, which a budget never reads)."""
    code = main(["--epochs", "3", "--time-budget", "10m", "--output-dir",
                 str(tmp_path / "run")])
    assert code == 2 and capsys.readouterr().err == (
        "accel_train: error: --epochs 3 and --time-budget 10m both set the run's length: give "
        "one (a budget fits the steps into its time; --max-steps caps them)\n")
    assert not (tmp_path / "run").exists()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("time_budget: 10m\nbatch_size: 12\n")
    typed_epochs = parse(["--config", str(recipe), "--epochs", "3"])
    assert (typed_epochs.time_budget, typed_epochs.epochs, typed_epochs.batch_size) == \
        (None, 3, 12)
    assert parse(["--config", str(recipe)]).time_budget == "10m"  # the file's, as it was
    epochs_recipe = tmp_path / "epochs.yaml"
    epochs_recipe.write_text("epochs: 5\n")
    typed_budget = parse(["--config", str(epochs_recipe), "--time-budget", "2m"])
    assert typed_budget.time_budget == "2m"
    both = tmp_path / "both.yaml"  # one recipe holding both: its epochs went unused unsaid
    assert recipe_refusal(both, "time_budget: 10\nepochs: 2\n") == (
        f"--config {both}: --epochs 2 and --time-budget 10 both set the run's length: give "
        f"one (a budget fits the steps into its time; --max-steps caps them)")
    from accel_train import fit
    with pytest.raises(UsageError, match=r"^epochs=3 and time_budget='1m' both set the run's "
                                         r"length: give one .*; max_steps= caps them\)$"):
        fit("test_resnet", [], epochs=3, time_budget="1m")


def test_numbers_in_exponent_form_are_numbers(tmp_path):
    """`1e-3` is a number to YAML 1.2 and to every reader but PyYAML's 1.1, which needs a dot
    (`1.0e-3`): a recipe's learning rate so written was refused as text.  Oracle: Python's
    float() of the same words."""
    written = {"learning-rate": "1e-3", "weight_decay": "5E-4", "momentum": ".9",
               "label_smoothing": "1.5e-1", "warmup_epochs": "2"}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("".join(f"{key}: {value}\n" for key, value in written.items())
                      + "output_dir: 1e3x\n")  # not a number: a word, as before
    config = parse(["--config", str(recipe)])
    for key, value in written.items():
        assert getattr(config, key.replace("-", "_")) == float(value), key
    assert isinstance(config.warmup_epochs, int) and config.output_dir == "1e3x"


def test_a_recipe_takes_the_other_names_the_command_line_takes(tmp_path):
    """--help lists --lr, --gradient_accumulation_steps, --sync_batchnorm, --checkpoint-dir:
    a recipe holding them was refused as "unknown option(s)", pointing at --help."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr: 0.02\ngradient_accumulation_steps: 3\nsync_batchnorm: false\n"
                      "checkpoint-dir: ckpt\n")
    config = parse(["--config", str(recipe)])
    assert (config.learning_rate, config.accumulation_steps, config.sync_bn,
            config.checkpoint) == (0.02, 3, False, "ckpt")
    assert recipe_refusal(recipe, "lr: 0.02\nlearning_rate: 0.1\n").endswith(
        "lr and learning_rate are one option; give one")
    assert recipe_refusal(recipe, "epoch: 3\nwarmpu_epochs: 1\n") == (
        f"{recipe}: unknown option(s) epoch (did you mean epochs?), warmpu_epochs (did "
        f"you mean warmup_epochs?); see `python -m accel_train --help` for the names")


def test_an_accelerate_precision_we_cannot_run_is_one_clear_error():
    with pytest.raises(UsageError, match="accelerate config asks for mixed_precision 'fp8'.*"
                                         "pass --mixed-precision auto/no/fp16/bf16"):
        parse([], {"ACCELERATE_MIXED_PRECISION": "fp8"})


@pytest.mark.slow  # starts accelerate's launcher
def test_a_runs_config_yaml_repeats_it_under_accelerate_config_default(tmp_path):
    accelerate_config = tmp_path / "accelerate.yaml"
    made = without_terminal(["accelerate", "config", "default", "--config_file",
                             str(accelerate_config)])
    assert "configuration saved" in made.stdout
    assert yaml.safe_load(accelerate_config.read_text())["mixed_precision"] == "no"

    (tmp_path / "run.yaml").write_text(RUN_YAML)
    first, repeat = tmp_path / "first", tmp_path / "repeat"
    # One thread in both runs (CPU kernels then sum in the same order); the first runs in this
    # process, to spare a start-up of torch.
    with in_process_run(), one_thread():
        assert main(["--config", str(tmp_path / "run.yaml"), "--output-dir", str(first)]) == 0
    launched = without_terminal(["accelerate", "launch", "--config_file", str(accelerate_config),
                                 "--num_cpu_threads_per_process", "1", "-m", "accel_train",
                                 "--config", str(first / "config.yaml"), "--output-dir",
                                 str(repeat)])
    assert "accel_train: test_resnet" in launched.stdout

    recorded = [yaml.safe_load((d / "config.yaml").read_text()) for d in (first, repeat)]
    assert recorded[0]["train"]["seed"] == 3 and recorded[0]["train"]["augment"] is False
    assert {**recorded[1]["train"], "output_dir": None} == \
        {**recorded[0]["train"], "output_dir": None}
    # what auto chose on the first run is recorded as the option, and the repeat runs it
    assert recorded[0]["resolved"]["precision_requested"] == "auto"
    assert recorded[1]["resolved"]["precision_used"] == recorded[0]["resolved"]["precision_used"]
    assert recorded[1]["resolved"]["speed_timings"] == {}, "the repeat timed the machine again"
    weights = [load_file(str(d / "model.safetensors")) for d in (first, repeat)]
    assert weights[0].keys() == weights[1].keys()
    different = [k for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])]
    assert not different, f"the repeat differs in {different[:5]}"


@pytest.mark.parametrize("values, expected", [
    ({"plots": "no"}, "plots is a switch: true or false (got 'no')"),
    ({"augment": "false"}, "augment is a switch: true or false (got 'false')"),
    ({"epochs": 2.5}, "--epochs must be a whole number (got 2.5)"),
    ({"progress": "fancy"}, "--progress 'fancy' is not one of auto, bar, log"),
    ({"report_to": "tensorboard"}, None),  # one tracker as a word: the list of it
    # options that may be left unset, set to the wrong kind (a traceback where they are used)
    ({"num_workers": "abc"}, "--num-workers must be a whole number (got 'abc')"),
    ({"max_eval_samples": True}, "--max-eval-samples must be a whole number (got True)"),
    ({"grad_clip": "x"}, "--grad-clip must be a number (got 'x')"),
    ({"host_decode_share": True}, "--host-decode-share must be a number (got True)"),
    ({"data_dir": True}, "--data-dir must be text: a path, a name or a word (got True)"),
    ({"pretrained": 3}, "--pretrained must be text: a path, a name or a word (got 3)"),
])
def test_a_recipes_values_are_checked_as_the_flags_are(tmp_path, values, expected):
    """A run YAML's values reach the options without argparse's types: a switch written 'no'
    was taken as on (a non-empty string), an epoch count of 2.5 kept."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    if expected is None:
        assert parse(["--config", str(recipe)]).report_to == ["tensorboard"]
        return
    with pytest.raises(UsageError) as raised:
        parse(["--config", str(recipe)])
    assert str(raised.value) == expected


@pytest.mark.parametrize("values, option, expected", [
    ({"time_budget": 600}, "time_budget", "600"),          # seconds as a YAML number
    ({"time_budget": 1.5}, "time_budget", "1.5"),
    ({"pretrained": True}, "pretrained", "hub"),            # timm's args.yaml: the flag alone
    ({"pretrained": False}, "pretrained", None),
    ({"pretrained": "w.safetensors"}, "pretrained", "w.safetensors"),
    ({"grad_clip": 1}, "grad_clip", 1),                     # a whole number is a number
    ({"num_workers": None}, "num_workers", None),           # left unset
])
def test_a_recipe_writes_in_yamls_own_forms(tmp_path, values, option, expected):
    """A run YAML's numbers, switches and nulls where the command line spells text or leaves
    the option unset: read as the flag would be."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    assert getattr(parse(["--config", str(recipe)]), option) == expected
