"""Config validation and the command line: pure functions, no training."""

from __future__ import annotations

import dataclasses

import pytest

from accel_train.cli import build_train_parser, config_from_args, main
from accel_train.config import TrainConfig
from accel_train.base.errors import UsageError


def parse(*argv: str) -> TrainConfig:
    return config_from_args(build_train_parser().parse_args(list(argv)))


def test_defaults_are_valid():
    config = TrainConfig()
    assert config.model == "resnet18" and config.dataset == "synthetic"


@pytest.mark.parametrize("argv, expected", [
    (["--batch_size", "0"], "--batch-size must be a whole number >= 1"),
    (["--batch-size", "-3"], "--batch-size must be a whole number >= 1"),
    (["--epochs", "0"], "--epochs must be a whole number >= 1"),
    (["--learning_rate", "0"], "--learning-rate must be a number > 0"),
    (["--learning-rate", "-0.1"], "--learning-rate must be a number > 0"),
    (["--accumulation_steps", "0"], "--accumulation-steps must be a whole number >= 1"),
    (["--val-fraction", "1.5"], "--val-fraction must be between 0 and 1"),
    (["--image-size", "4"], "--image-size must be a whole number >= 8 .got 4."),
    (["--image-size", "0"], "--image-size must be a whole number >= 8 .got 0."),
    (["--grad-clip", "0"], "--grad-clip must be > 0"),
    (["--aux-loss-weight", "-0.4"], "--aux-loss-weight must be >= 0 .got -0.4."),
    # momentum m keeps m of the last step's velocity: at 1 a gradient is never forgotten, above
    # it the steps grow by m each time; 9 (for 0.9) trained on with a loss that only blew up
    (["--momentum", "1"], "--momentum is the share of the last step kept: in .0, 1. .got 1.0."),
    (["--momentum", "9"], "--momentum is the share of the last step kept: in .0, 1. .got 9.0."),
    (["--in-memory-limit-gb", "-1"], "--in-memory-limit-gb must be a number of GiB > 0"),
    (["--in-memory-limit-gb", "nan"], "--in-memory-limit-gb must be a number of GiB > 0"),
    (["--gpu_ids", "a,b"], "--gpu_ids 'a,b' is not a comma-separated list"),
    (["--mixed-precision", "fp8"], "invalid choice: 'fp8'"),
    (["--optimizer", "lanb"], "--optimizer 'lanb' is not one of timm's optimizers; did you mean "
                              "lamb"),
    (["--auto-augment", "randaugmnet"], "--auto-augment 'randaugmnet' is not a policy we know"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag .see --help.$"),
    # no abbreviations: --epoch meant --epochs without a word, --out was "ambiguous" between
    # the two spellings of one option; a close option's name is offered
    (["--epoch", "3"], "^unrecognized arguments: --epoch 3; --epoch is not an option: did you "
                       "mean --epochs. .see --help.$"),
    (["--out", "r"], "^unrecognized arguments: --out r .see --help.$"),
    (["--learnig-rate=0.1"], "--learnig-rate is not an option: did you mean --learning-rate"),
    (["--mean", "123.675", "116.28", "103.53"], "--mean 123.675 116.28 103.53: the run normalizes "
                                                "pixels scaled to [0, 1], so each value is <= 1; "
                                                "divide values on the 0-255 scale by 255"),
    (["--std", "58.395"], "--std 58.395 58.395 58.395: the run normalizes pixels scaled to"),
    (["--std", "0.2", "0.2"], "--std takes three numbers, R G B .or one for all three., got "
                              "['0.2', '0.2']; e.g. --std 0.229 0.224 0.225"),
    (["--mean", "0.5", "0.5", "0.5", "0.5"], "--mean takes three numbers"),
    (["--mean", "nan"], "--mean takes three numbers"),
    (["--mean", "red"], "--mean takes three numbers"),
    (["--mean", "-0.1", "0.5", "0.5"], "--mean -0.1 0.5 0.5: each value must be >= 0"),
    (["--std", "0.2", "0", "0.2"], "--std 0.2 0 0.2: each value must be > 0"),
    (["--mean"], "--mean: expected at least one argument"),
])
def test_bad_values_name_the_flag(argv, expected):
    with pytest.raises(UsageError, match=expected.replace("(", r"\(").replace("[", r"\[")):
        parse(*argv)


def test_mean_and_std_take_three_values_or_one_for_all():
    assert parse("--mean", "0.5", "--std", "0.1", "0.2", "0.3").mean == [0.5, 0.5, 0.5]
    assert parse("--mean", "0.5", "--std", "0.1", "0.2", "0.3").std == [0.1, 0.2, 0.3]
    assert parse().mean is None and parse().std is None  # chosen at the start (network.py)
    # fit() and run YAMLs give numbers: a tuple (timm's pretrained_cfg) or one number
    config = TrainConfig(mean=(0.485, 0.456, 0.406), std=0.25)
    assert (config.mean, config.std) == ([0.485, 0.456, 0.406], [0.25] * 3)
    assert TrainConfig(mean=[0, 1, 0.5]).mean == [0, 1, 0.5]  # both ends allowed
    with pytest.raises(UsageError, match="--mean takes three numbers"):
        TrainConfig(mean="0.5")  # a YAML's string is not split


def test_manual_flags_in_both_spellings():
    manual = parse("--epochs", "3", "--batch_size", "8", "--learning_rate", "0.01",
                   "--accumulation_steps", "2", "--checkpoint", "ck", "--world_size", "1",
                   "--rank", "0", "--gpu_ids", "0,1", "--dist_url", "tcp://127.0.0.1:23456")
    dashed = parse("--epochs", "3", "--batch-size", "8", "--learning-rate", "0.01",
                   "--accumulation-steps", "2", "--checkpoint-dir", "ck", "--world-size", "1",
                   "--rank", "0", "--gpu-ids", "0,1", "--dist-url", "tcp://127.0.0.1:23456")
    assert manual == dashed
    assert (manual.batch_size, manual.accumulation_steps, manual.checkpoint) == (8, 2, "ck")


def test_boolean_flags_and_lists():
    config = parse("--no-augment", "--freeze-backbone", "--sync-bn", "--report-to", "tensorboard")
    assert not config.augment and config.freeze_backbone and config.sync_bn
    assert config.report_to == ["tensorboard"]


def test_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
    assert text.count("(default:") >= len(dataclasses.fields(TrainConfig))
    for title in ("data:", "model:", "optimization:", "distributed"):
        assert title in text


def test_cli_turns_bad_input_into_one_line_and_exit_2(capsys):
    assert main(["--batch_size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("accel_train: error: --batch-size must be")


def test_run_yaml_gives_defaults_and_flags_override(tmp_path):
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("batch-size: 12\nepochs: 7\nmodel: test_resnet\n")
    config = parse("--config", str(run_yaml), "--epochs", "2")
    assert (config.batch_size, config.epochs, config.model) == (12, 2, "test_resnet")
    run_yaml.write_text("batch_sise: 12\n")
    with pytest.raises(UsageError, match="unknown option.*batch_sise"):
        parse("--config", str(run_yaml))


@pytest.mark.parametrize("word, known, hint", [
    # difflib's ratio 2M/T: resnet18 shares 7 of 16 characters' pairs (0.875), resnet50 6 (0.75)
    ("resnet19", ["vit_base", "resnet50", "resnet18"], "did you mean resnet18, resnet50? "),
    ("resnet19", ["vit_base", "convnext_atto"], ""),
    # four at 0.89: three of them, ties by the name, the later in the alphabet first (difflib)
    ("adam", ["adamw", "adamp", "nadam", "radam", "sgd"], "did you mean radam, nadam, adamw? "),
    ("ab", ["ac"], ""),  # 0.5: under the 0.6 line
    ("abc", ["abd"], "did you mean abd? "),  # 0.67
])
def test_a_misspelt_name_is_offered_the_three_closest(word, known, hint):
    from accel_train.base.errors import did_you_mean
    assert did_you_mean(word, known) == hint
