"""--smaller-models with --time-budget: the choice with planted step times (no test depends on
this machine's speed), the epochs a budget holds computed by hand, and through the command line
(in this process, the budget's clock a fake one): the network chosen is the one trained, named
in the summary, config.yaml and the model's files, evaluated by `eval`, and kept by a resumed
run without timing again."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from accel_train.train import autotune, network_choice
from accel_train.train.autotune import PROBE_ROUNDS, SpeedChoice
from accel_train.train.network_choice import ESTIMATE_ROUNDS, choose_network, epochs_in_budget
from conftest import TINY_TRAIN, accel_train_here, model_spec_of
from faults import metrics
from test_time_budget import fake_clock, ticking

SPEED = SpeedChoice("no", False, "as asked")


class Planted:
    """measure(name) -> (speed, seconds) from planted seconds, recording what was timed."""

    def __init__(self, **seconds: float):
        self.seconds, self.timed = seconds, []

    def __call__(self, name: str):
        self.timed.append(name)
        return SpeedChoice("no", False, f"timed {name}"), self.seconds[name]


def epochs_of(seconds: float) -> float:
    return 100.0 / seconds  # a budget that holds 100 epochs at 1 s a step


def test_the_epochs_a_budget_holds_by_hand():
    # 600 s at 0.5 s for 32 images (2 processes x 16) is 38,400 images: 0.768 of 50,000
    assert epochs_in_budget(600, 0.5, 32, 50_000) == pytest.approx(0.768)
    assert epochs_in_budget(20, 1.0, 16, 256) == pytest.approx(1.25)


def test_the_first_network_that_fits_is_chosen_and_nothing_after_it_is_timed():
    planted = Planted(big=20.0, mid=10.0, small=1.0)
    choice = choose_network(["big", "mid", "small"], 10, planted, epochs_of)
    assert choice.model == "mid" and planted.timed == ["big", "mid"]
    assert choice.speed.how == "timed mid"  # the chosen network's own speed choice
    assert choice.epochs == {"big": 5.0, "mid": 10.0}  # exactly the minimum reaches it
    assert "big 5.0, mid 10.0; the first to reach 10" in choice.how


def test_the_recipe_network_that_fits_is_the_only_one_timed():
    planted = Planted(big=1.0, small=0.1)
    choice = choose_network(["big", "small"], 50, planted, epochs_of)
    assert (choice.model, planted.timed) == ("big", ["big"])


def test_when_none_fits_the_fastest_as_measured_is_trained_whatever_its_place():
    # (the fastest is neither the last listed nor the last in alphabetical order)
    planted = Planted(wide=50.0, fast=20.0, narrow=40.0)
    choice = choose_network(["wide", "fast", "narrow"], 10, planted, epochs_of)
    assert choice.model == "fast" and planted.timed == ["wide", "fast", "narrow"]
    assert choice.speed.how == "timed fast"
    assert "none reaches 10: the fastest" in choice.how


def test_no_network_to_choose_from_is_a_programming_error():
    with pytest.raises(ValueError, match="choose_network needs at least one network"):
        choose_network([], 10, Planted(), epochs_of)


# -- the run's probing: choose_for_run --------------------------------------------------------

# seconds of a probe step by network, precision and memory format
PROBE_SECONDS = {
    ("test_resnet", "no", False): 1.0, ("test_resnet", "no", True): 0.8,
    ("test_resnet", "bf16", False): 0.6, ("test_resnet", "bf16", True): 0.5,
    ("cifar_convnet_s", "no", False): 0.2, ("cifar_convnet_s", "no", True): 0.3,
    ("cifar_convnet_s", "bf16", False): 0.4, ("cifar_convnet_s", "bf16", True): 0.25}


# A step of twice the probe's batch costs 1.8 times as much (per image, large batches are
# cheaper on a CPU): the estimate reads the larger step.
PER_IMAGE_AT_64 = 0.9


def planted_seconds(name: str, precision: str, channels_last: bool, batch: int) -> float:
    return PROBE_SECONDS[(name, precision, channels_last)] * (
        1.0 if batch == 32 else 2 * PER_IMAGE_AT_64)


@pytest.mark.parametrize("native, precision, channels_last, expected, steps", [
    # auto on a CPU with native bf16: each network chosen in its fastest of four, timed in
    # auto's rounds at the probe's batch of 32, then ESTIMATE_ROUNDS times in that choice at
    # the run's 64 for the estimate: 20 s x 64 images x 2 processes / 256 images = 10 epochs
    # per second of that step (test_resnet 10 / (0.5 x 1.8) = 11.1, short of the 12 asked)
    (True, "auto", None, {"test_resnet": (10 / (0.5 * 1.8), "bf16", True),
                          "cifar_convnet_s": (10 / (0.2 * 1.8), "no", False)},
     4 * PROBE_ROUNDS + ESTIMATE_ROUNDS),
    # without native bf16, auto times only fp32's two memory formats
    (False, "auto", None, {"test_resnet": (10 / (0.8 * 1.8), "no", True),
                           "cifar_convnet_s": (10 / (0.2 * 1.8), "no", False)},
     2 * PROBE_ROUNDS + ESTIMATE_ROUNDS),
    # as asked: nothing to choose, each timed in it at the estimate's batch only
    (True, "no", True, {"test_resnet": (10 / (0.8 * 1.8), "no", True),
                        "cifar_convnet_s": (10 / (0.3 * 1.8), "no", True)}, ESTIMATE_ROUNDS)])
def test_each_network_is_timed_as_the_run_would_compute_it(monkeypatch, native, precision,
                                                           channels_last, expected, steps):
    from accel_train.config import TrainConfig
    made, probes, timed = [], [], []

    def create_model(name, *args):
        made.append((name, *args))
        return SimpleNamespace(name=name)

    def step_timer(make_model, batch_size, image_size, num_classes, max_batch, device):
        probes.append((batch_size, image_size, num_classes, max_batch, device.type))
        model = make_model()

        def time_step(precision, channels_last):
            timed.append(model.name)
            return planted_seconds(model.name, precision, channels_last,
                                   min(batch_size, max_batch))
        return time_step

    monkeypatch.setattr(network_choice, "create_model", create_model)
    monkeypatch.setattr(network_choice, "step_timer", step_timer)
    # the capability choose_on_this_machine reads for every network probed
    monkeypatch.setattr(autotune, "cpu_has_native_bf16", lambda: native)
    # as in a new process (an earlier in-process test may have left Accelerate holding one)
    monkeypatch.setattr(autotune, "precision_this_process_holds", lambda: None)
    config = TrainConfig(model="test_resnet", smaller_models=["cifar_convnet_s"],
                         min_budget_epochs=12, time_budget="20s", batch_size=64, drop_rate=0.25,
                         drop_path=0.1, mixed_precision=precision, channels_last=channels_last)
    choice = network_choice.choose_for_run(config, image_size=24, num_classes=7,
                                           train_samples=256, world_size=2, cuda=False)
    assert choice.model == "cifar_convnet_s"
    assert choice.epochs == pytest.approx({name: e for name, (e, _, _) in expected.items()})
    _, chosen_precision, chosen_layout = expected["cifar_convnet_s"]
    assert (choice.speed.precision, choice.speed.channels_last) == (chosen_precision,
                                                                    chosen_layout)
    # the probe's networks are the run's (classes, dropout; no pretrained weights), made
    # afresh for each batch; its batch the CPU probe's 32 of the run's 64 for the choice of
    # precision, the run's 64 for the estimate, on the CPU
    assert made == [(name, 7, 0.25, None, 0.1) for name in ("test_resnet", "test_resnet",
                                                              "cifar_convnet_s", "cifar_convnet_s")]
    assert probes == [(32, 24, 7, 32, "cpu"), (64, 24, 7, 64, "cpu")] * 2
    assert timed == ["test_resnet"] * steps + ["cifar_convnet_s"] * steps


def _cpu_choice(monkeypatch, batch_size: int, step_timer):
    """choose_for_run on a CPU with `step_timer` planted: 10 s of budget, 1,000 images, the
    precision and memory format asked (auto's probe times nothing)."""
    from accel_train.config import TrainConfig
    monkeypatch.setattr(network_choice, "create_model", lambda name, *args: name)
    monkeypatch.setattr(network_choice, "step_timer", step_timer)
    config = TrainConfig(model="test_resnet", smaller_models=["cifar_convnet_s"],
                         min_budget_epochs=1, time_budget="10s", batch_size=batch_size,
                         mixed_precision="no", channels_last=False)
    return network_choice.choose_for_run(config, image_size=24, num_classes=7,
                                         train_samples=1000, world_size=1, cuda=False)


@pytest.mark.parametrize("batch_size, estimated_on", [(1024, 256), (256, 256), (100, 100),
                                                      (32, 32), (8, 8)])
def test_a_cpu_estimate_times_a_batch_near_the_runs(monkeypatch, batch_size, estimated_on):
    probes = []

    def step_timer(make_model, batch, image_size, num_classes, max_batch, device):
        probes.append(min(batch, max_batch))
        return lambda precision, channels_last: 0.001 * min(batch, max_batch)

    choice = _cpu_choice(monkeypatch, batch_size, step_timer)
    # 1 ms an image: 10 s hold 10,000 images, 10 epochs of 1,000, whatever batch timed it
    assert choice.epochs == {"test_resnet": pytest.approx(10.0)}
    assert probes[-1] == estimated_on
    assert probes[0] == min(batch_size, 32)


@pytest.mark.parametrize("batch_size", [1024, 32])
def test_a_cpu_estimate_is_the_fastest_of_its_readings(monkeypatch, batch_size):
    """A machine whose pace moves: the step reads 3, 1.25, 2, 4, 2.5 ms an image in turn."""
    readings = iter([3.0, 1.25, 2.0, 4.0, 2.5][:ESTIMATE_ROUNDS] + [9.0] * 10)

    def step_timer(make_model, batch, image_size, num_classes, max_batch, device):
        return lambda precision, channels_last: next(readings) * 0.001 * min(batch, max_batch)

    choice = _cpu_choice(monkeypatch, batch_size, step_timer)
    # 10 s at 1.25 ms an image: 8,000 images, 8 epochs of 1,000
    assert choice.epochs == {"test_resnet": pytest.approx(8.0)}
    assert next(readings) == 9.0  # no reading beyond the estimate's


def test_a_choice_reads_back_from_what_rank_0_hands_on():
    choice = choose_network(["big", "small"], 10, Planted(big=20.0, small=1.0), epochs_of)
    assert type(choice).from_dict(json.loads(json.dumps(choice.to_dict()))) == choice


# -- through the command line ------------------------------------------------------------------

# 256 images at batch 16 (one process): a probe step is 16 images, an epoch 16 steps
BUDGET_TRAIN = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--time-budget", "20s",
                "--log-every", "1", "--eval-every", "0"]
SMALLER = ["--smaller-models", "cifar_convnet_s"]


@pytest.fixture
def planted_probe(monkeypatch):
    """network_choice's step timer replaced: it builds the network as the real one does and
    reads its planted seconds (test_resnet 1 s a step: 20 s hold 20 x 16 / 256 = 1.25 epochs;
    cifar_convnet_s 0.1 s: 12.5 epochs); what was timed is recorded."""
    seconds = {"test_resnet": 1.0, "cifar_convnet_s": 0.1}
    timed: list[str] = []

    def step_timer(make_model, batch_size, image_size, num_classes, max_batch=32, device=None):
        assert (batch_size, image_size, num_classes) == (16, 32, 10)

        def time_step(precision, channels_last):
            name = make_model().pretrained_cfg["architecture"]
            timed.append(name)
            return seconds[name]
        return time_step

    monkeypatch.setattr(network_choice, "step_timer", step_timer)
    return timed


def _train(out, clock, *extra: str):
    """A budgeted run in this process; the budget's clock moves 1 s a training step."""
    return accel_train_here(*BUDGET_TRAIN, "--output-dir", str(out), *extra, check=True,
                            callbacks=ticking(clock))


@pytest.fixture
def clock(monkeypatch):
    return fake_clock(monkeypatch)


def _run_config(out) -> dict:
    return yaml.safe_load((out / "config.yaml").read_text())["train"]


@pytest.mark.parametrize("min_epochs, chosen, timed", [
    ("2", "cifar_convnet_s", ["test_resnet", "cifar_convnet_s"]),
    ("1", "test_resnet", ["test_resnet"])])
def test_the_network_the_budget_holds_long_enough_is_the_one_trained(
        tmp_path, clock, planted_probe, min_epochs, chosen, timed):
    out = tmp_path / "run"
    result = _train(out, clock, *SMALLER, "--min-budget-epochs", min_epochs)
    assert planted_probe == [name for name in timed for _ in range(ESTIMATE_ROUNDS)]
    estimates = ", ".join(f"{name} {e}" for name, e in
                          zip(timed, ["1.2", "12.5"]))  # 1.25 printed to one place: 1.2
    assert f"network: epochs the budget holds, timed at the start: {estimates}" in result.stdout
    assert f"accel_train: {chosen} (" in result.stdout
    config = _run_config(out)
    assert (config["model"], config["smaller_models"]) == (chosen, [])
    assert model_spec_of(out)["model_name"] == chosen
    last = sorted((out / "checkpoints").glob("step_*"))[-1] / "model_config.json"
    assert json.loads(last.read_text())["model_name"] == chosen
    accel_train_here("eval", str(out), check=True)  # builds the network the files name


def test_a_resumed_run_keeps_the_checkpoints_network_without_timing(tmp_path, clock,
                                                                    planted_probe):
    out = tmp_path / "run"
    _train(out, clock, *SMALLER, "--min-budget-epochs", "2", "--max-steps", "3",
           "--checkpoint-every", "3")
    assert planted_probe == [name for name in ("test_resnet", "cifar_convnet_s")
                             for _ in range(ESTIMATE_ROUNDS)]
    planted_probe.clear()
    result = _train(out, clock, *SMALLER, "--min-budget-epochs", "2", "--max-steps", "5",
                    "--resume", "auto")
    assert planted_probe == []  # timing again could choose otherwise: not done
    assert "network: kept from the checkpoint (--smaller-models)" in result.stdout
    assert "accel_train: cifar_convnet_s (" in result.stdout
    steps = [r["step"] for r in metrics(out) if r["type"] == "train"]
    assert steps[-1] == 5
    resumed, = out.glob("config.resume-*.yaml")  # what the resumed start records of itself
    recorded = yaml.safe_load(resumed.read_text())["train"]
    assert (recorded["model"], recorded["smaller_models"]) == ("cifar_convnet_s", [])


def test_without_a_time_budget_the_model_is_trained_and_the_run_says_why(tmp_path,
                                                                          planted_probe):
    out = tmp_path / "run"
    result = accel_train_here(*TINY_TRAIN, "--max-steps", "2", "--output-dir", str(out),
                              *SMALLER, "--min-budget-epochs", "2", check=True)
    assert planted_probe == []
    assert "--smaller-models chooses by --time-budget, which this run does not have: " \
           "training --model test_resnet" in result.stdout + result.stderr
    assert _run_config(out)["model"] == "test_resnet"


@pytest.mark.parametrize("extra, names", [
    (SMALLER, "--min-budget-epochs"),
    ([*SMALLER, "--min-budget-epochs", "0"], "--min-budget-epochs must be > 0"),
    (["--smaller-models", "cifar_convnet_q", "--min-budget-epochs", "2"],
     "--smaller-models 'cifar_convnet_q' is not a timm model"),
    ([*SMALLER, "--min-budget-epochs", "2", "--pretrained", "weights.safetensors"],
     "--pretrained weights.safetensors holds the weights of one network")])
def test_bad_network_choices_are_one_line_and_exit_2(tmp_path, extra, names):
    out = tmp_path / "run"
    result = accel_train_here(*BUDGET_TRAIN, "--output-dir", str(out), *extra)
    assert result.returncode == 2, result.stdout + result.stderr
    assert names in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()
