"""Bad values of the training options: one line naming the flag on stderr, exit 2, no traceback,
and nothing written (the --output-dir is never created).

The values the configuration can judge alone fail before anything is imported (fast), each in a
process of its own; an unknown policy, optimizer, or stochastic depth on a model without it are
found while the run is being built: those three call the CLI in this process (`accel_train_here`:
the same exit code and stderr, without a new process's seconds of imports; an exception escaping
instead of the one line fails the test as a traceback would).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from accel_train.data.augment import build_policy
from accel_train.base.errors import UsageError
from conftest import REPO, TINY_TRAIN, accel_train_here
from conftest import test_env as child_env  # (imported as test_env, pytest would collect it)

CHEAP = [
    (["--mixup", "-1"], "--mixup"),
    (["--cutmix", "-0.5"], "--cutmix"),
    (["--mixup", "0.8", "--mixup-prob", "1.5"], "--mixup-prob"),
    (["--mixup", "0.8", "--mixup-switch-prob", "-0.1"], "--mixup-switch-prob"),
    (["--mixup", "0.8", "--batch-size", "15"], "--batch-size"),
    (["--cutmix", "1.0", "--batch-size", "7"], "--batch-size"),
    (["--model-ema", "--model-ema-decay", "1.0"], "--model-ema-decay"),
    (["--model-ema", "--model-ema-decay", "0"], "--model-ema-decay"),
    (["--model-ema", "--model-ema-decay", "-0.5"], "--model-ema-decay"),
    (["--checkpoint-minutes", "-1"], "--checkpoint-minutes"),
    (["--checkpoint-minutes", "inf"], "--checkpoint-minutes"),
    (["--time-budget", "abc"], "--time-budget"),
    (["--time-budget", "0"], "--time-budget"),
    (["--time-budget", "0m"], "--time-budget"),
    (["--time-budget", "10x"], "--time-budget"),
    (["--time-budget", "-5"], "--time-budget"),
    (["--layer-decay", "0"], "--layer-decay"),
    (["--layer-decay", "1.5"], "--layer-decay"),
    (["--drop-path", "1.0"], "--drop-path"),
    (["--drop-path", "-0.1"], "--drop-path"),
    (["--reprob", "1.5"], "--reprob"),
    (["--tta", "mirror"], "--tta"),
    (["--lr-decay", "step"], "--lr-decay"),
    (["--warmup-start-factor", "1.5"], "--warmup-start-factor"),
    (["--final-lr-factor", "-0.1"], "--final-lr-factor"),
    (["--warmup-fraction", "1"], "--warmup-fraction"),
    (["--warmup-fraction", "-0.2"], "--warmup-fraction"),
]
# in this process: (extra flags, the flag named, what else the line must say).  Those found
# while building the run, and the short-run options' values (cheap either way: no new
# process's imports to pay).
BUILT = {
    "bn_momentum": (["--bn-momentum", "1.5"], "--bn-momentum", ""),
    "crop_pad_negative": (["--crop-pad", "-1"], "--crop-pad", ""),
    # judged when the transform is built, against the image size (32 here)
    "crop_pad_too_large": (["--crop-pad", "32"], "--crop-pad", "32 px"),
    "norm_bias_lr_scale": (["--norm-bias-lr-scale", "0"], "--norm-bias-lr-scale", ""),
    "lookahead_every": (["--lookahead-every", "-1"], "--lookahead-every", ""),
    "whiten_bias_epochs": (["--whiten-stem", "--whiten-bias-epochs", "-1"],
                           "--whiten-bias-epochs", "airbench"),
    "whiten_bias_epochs_alone": (["--whiten-bias-epochs", "3"], "--whiten-bias-epochs",
                                 "--whiten-stem"),
    "eval_every": (["--eval-every", "-2"], "--eval-every", "only after the last epoch"),
    "policy": (["--auto-augment", "nonsense-policy"], "--auto-augment", "nonsense-policy"),
    "optimizer": (["--optimizer", "nonsense"], "--optimizer", "nonsense"),
    # vgg11 and ghostnet take no drop_path_rate (every tiny test_* model of timm does)
    "drop_path": (["--model", "ghostnet_050", "--drop-path", "0.1"], "--drop-path",
                  "ghostnet_050"),
}


def _command(extra: list[str], out) -> list[str]:
    return [sys.executable, "-m", "accel_train", *TINY_TRAIN, *extra, "--output-dir", str(out)]


def _check(code: int, stdout: str, stderr: str, flag: str, out, also: str = "") -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, f"exit {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("accel_train: error: "), stderr[-3000:]
    assert flag in lines[0] and also in lines[0], lines[0]
    assert "Traceback" not in stdout + stderr
    assert not out.exists(), f"{out} was created"


@pytest.mark.parametrize("extra, flag", CHEAP, ids=[" ".join(a) for a, _ in CHEAP])
def test_a_bad_value_is_one_line_exit_2_and_nothing_written(tmp_path, extra, flag):
    out = tmp_path / "run"
    result = subprocess.run(_command(extra, out), cwd=REPO, env=child_env(), capture_output=True,
                            text=True, timeout=120)
    _check(result.returncode, result.stdout, result.stderr, flag, out)


@pytest.mark.parametrize("name", BUILT)
def test_a_bad_value_found_while_building_is_one_line_exit_2(tmp_path, name):
    extra, flag, also = BUILT[name]
    out = tmp_path / name
    result = accel_train_here(*TINY_TRAIN, *extra, "--output-dir", str(out))
    _check(result.returncode, result.stdout, result.stderr, flag, out, also)


@pytest.mark.parametrize("policy", ["rand-x9", "rand-m9-zz1", "nonsense", "auto-augment"])
def test_an_unknown_policy_string_is_a_usage_error_naming_the_flag(policy):
    """Both ways a policy is read (torchvision's names, timm's strings) refuse what they do not
    know in a UsageError naming the flag (what the CLI turns into its one line and exit 2)."""
    with pytest.raises(UsageError, match=f"--auto-augment '{policy}'"):
        build_policy(policy)
