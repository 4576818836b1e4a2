"""Options the others leave with nothing to do: said at the start, and the run goes on.  The
claim "has no effect" is checked where it is cheap: weights bit-identical to the run without."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from accel_train.config import TrainConfig
from accel_train.train.idle_options import idle_option_warnings
from conftest import TINY_TRAIN, accel_train_here


def said(total_steps=100, **options) -> list[str]:
    return idle_option_warnings(TrainConfig(**options), total_steps)


def test_the_defaults_and_options_that_act_say_nothing():
    assert said() == []
    assert said(mixup=0.8, cutmix=1.0, mixup_prob=0.5, mixup_switch_prob=0.3) == []
    assert said(cutmix=1.0, mixup_prob=0.5) == []
    assert said(model_ema=True, model_ema_decay=0.9) == []          # 10 steps of 100
    assert said(total_steps=None, model_ema=True) == []             # a budget: length unknown
    for optimizer in ("sgd", "momentum", "lars", "madgrad", "lookahead_sgd"):
        assert said(optimizer=optimizer, momentum=0.5) == [], optimizer
    assert said(optimizer="adamw") == []                            # the default momentum


@pytest.mark.parametrize("options, words", [
    (dict(cutmix=1.0, mixup_prob=0.0), "--cutmix 1: --mixup-prob 0 mixes no batch"),
    (dict(mixup=0.5, mixup_prob=0.0), "--mixup 0.5: --mixup-prob 0 mixes no batch"),
    (dict(cutmix=1.0, mixup_switch_prob=0.2), "--mixup-switch-prob 0.2 chooses between"),
    (dict(mixup=0.8, cutmix=1.0, mixup_prob=0.0),
     "--mixup 0.8 and --cutmix 1: --mixup-prob 0 mixes no batch"),
    (dict(mixup_prob=0.5), "--mixup-prob 0.5 has no effect without --mixup or --cutmix"),
    (dict(mixup=0.8, mixup_switch_prob=0.2), "--mixup-switch-prob 0.2 chooses between"),
    (dict(model_ema_decay=0.99), "--model-ema-decay 0.99 has no effect without --model-ema"),
    (dict(optimizer="adamw", momentum=0.5), "--momentum 0.5 has no effect with --optimizer adamw"),
    (dict(optimizer="lookahead_lamb", momentum=0),
     "--momentum 0 has no effect with --optimizer lookahead_lamb"),
])
def test_an_option_with_nothing_to_do_is_named(options, words):
    warnings = said(**options)
    assert len(warnings) == 1 and warnings[0].startswith(words), warnings


def test_an_ema_longer_than_the_run_says_how_long_and_what_would_fit():
    # 1 / (1 - 0.9998) = 5,000 steps of averaging in a run of 500
    (words,) = said(total_steps=500, model_ema=True)
    assert "averages over about 5,000 steps and this run has 500" in words
    assert "--model-ema-decay 0.98 averages over its last tenth" in words  # 1 - 10/500
    assert said(total_steps=5000, model_ema=True) == []
    (short,) = said(total_steps=8, model_ema=True, model_ema_decay=0.9)
    assert "--model-ema-decay 0.5 " in short  # never a decay at or below 0


def test_cutmix_that_mixes_no_batch_trains_as_the_run_without_it(tmp_path):
    """The warning's claim, through the CLI: the weights equal those of the run without CutMix."""
    common = [*TINY_TRAIN, "--max-steps", "3", "--warmup-epochs", "0"]
    plain = accel_train_here(*common, "--output-dir", str(tmp_path / "plain"), check=True)
    idle = accel_train_here(*common, "--cutmix", "1", "--mixup-prob", "0", "--output-dir",
                            str(tmp_path / "idle"), check=True)
    assert "--cutmix 1: --mixup-prob 0 mixes no batch" in idle.stdout + idle.stderr
    assert "mixes no batch" not in plain.stdout + plain.stderr
    a, b = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("plain", "idle"))
    assert all(a[k].equal(b[k]) for k in a)


def test_momentum_an_optimizer_has_none_of_trains_as_the_run_without_it(tmp_path):
    """The warning's claim, through the CLI: AdamW's weights with --momentum 0.5 equal those
    with the default, and the same --momentum does change SGD's (the check can tell)."""
    common = [*TINY_TRAIN, "--max-steps", "3", "--warmup-epochs", "0"]

    def weights(name, *options):
        run = accel_train_here(*common, *options, "--output-dir", str(tmp_path / name),
                               check=True)
        return load_file(str(tmp_path / name / "model.safetensors")), run.stdout + run.stderr

    adamw, _ = weights("adamw", "--optimizer", "adamw")
    adamw_momentum, said_there = weights("adamw_m", "--optimizer", "adamw", "--momentum", "0.5")
    assert "--momentum 0.5 has no effect with --optimizer adamw" in said_there
    assert all(adamw[k].equal(adamw_momentum[k]) for k in adamw)
    sgd, _ = weights("sgd")
    sgd_momentum, said_there = weights("sgd_m", "--momentum", "0.5")
    assert "has no effect" not in said_there
    assert not all(sgd[k].equal(sgd_momentum[k]) for k in sgd)
