"""--mixed-precision auto and --channels-last auto (timed on a CPU, a rule on CUDA): the choice
logic with the probe's timings planted (no test depends on this machine's speed), the probe
itself on a real model, and the choice recorded by a run and reused on resume without probing
again."""

from __future__ import annotations

import json

import pytest
import torch

from accel_train.train import autotune
from accel_train.train.autotune import (PROBE_ROUNDS, SpeedChoice, candidate_name, choose,
                                        choose_on_this_machine, step_timer)
from accel_train.train.precision import cuda_has_tensor_cores, resolve_precision


class Timings:
    """A planted time_step: seconds per candidate, and a record of what was asked."""

    def __init__(self, **seconds: float):
        self.seconds, self.asked = seconds, []

    def __call__(self, precision: str, channels_last: bool) -> float:
        name = candidate_name(precision, channels_last).replace(" ", "_")
        self.asked.append(name)
        return self.seconds[name]


ALL = dict(fp32_NCHW=1.0, fp32_channels_last=0.9, bf16_NCHW=0.6, bf16_channels_last=0.5)


def test_no_native_bf16_is_fp32_without_timing_the_precision():
    timings = Timings(**ALL)
    choice = choose("auto", False, cuda=False, native_bf16=False, time_step=timings)
    assert (choice.precision, choice.channels_last, timings.asked) == ("no", False, [])
    # the start summary's words, as a user reads them
    assert choice.how == "fp32: this CPU has no native bf16 (AVX512-BF16 or AMX)"


def test_native_and_faster_bf16_is_chosen_with_the_figures():
    timings = Timings(**ALL)
    choice = choose("auto", None, cuda=False, native_bf16=True, time_step=timings)
    assert (choice.precision, choice.channels_last) == ("bf16", True)
    assert sorted(timings.asked) == sorted(list(ALL) * PROBE_ROUNDS)  # in turn, every round
    assert choice.how == ("fastest of 4 timed on this model, a step in fp32 NCHW 1000 ms, "
                          "fp32 channels_last 900 ms, bf16 NCHW 600 ms, bf16 channels_last 500 ms")


def test_without_native_bf16_the_layouts_are_timed_and_both_reasons_said():
    timings = Timings(**ALL)
    choice = choose("auto", None, cuda=False, native_bf16=False, time_step=timings)
    assert (choice.precision, choice.channels_last) == ("no", True)
    assert choice.how == ("fp32: this CPU has no native bf16 (AVX512-BF16 or AMX); fastest of 2 "
                          "timed on this model, a step in fp32 NCHW 1000 ms, fp32 channels_last "
                          "900 ms")


def test_each_candidate_keeps_its_fastest_round():
    """A load that comes and goes: each candidate's figure is its best round, whichever."""
    rounds = {"fp32_NCHW": iter([0.3, 0.9] * PROBE_ROUNDS),
              "fp32_channels_last": iter([0.8, 0.5] * PROBE_ROUNDS)}

    def time_step(precision: str, channels_last: bool) -> float:
        return next(rounds[candidate_name(precision, channels_last).replace(" ", "_")])

    choice = choose("no", None, cuda=False, native_bf16=True, time_step=time_step)
    assert choice.timings == {"fp32 NCHW": 0.3, "fp32 channels_last": 0.5}
    assert (choice.precision, choice.channels_last) == ("no", False)


def test_native_but_slower_bf16_loses_to_fp32():
    timings = Timings(fp32_NCHW=0.4, fp32_channels_last=0.3, bf16_NCHW=0.8,
                      bf16_channels_last=0.7)
    choice = choose("auto", None, cuda=False, native_bf16=True, time_step=timings)
    assert (choice.precision, choice.channels_last) == ("no", True)


def test_channels_last_auto_alone_is_timed_in_the_asked_precision():
    timings = Timings(**{**ALL, "fp32_channels_last": 1.2})
    choice = choose("no", None, cuda=False, native_bf16=True, time_step=timings)
    assert (choice.precision, choice.channels_last) == ("no", False)
    assert sorted(set(timings.asked)) == ["fp32_NCHW", "fp32_channels_last"]


def test_fp16_asked_on_a_cpu_is_timed_and_named_as_the_fp32_it_runs_in():
    """Accelerate trains fp16 on a CPU in fp32 (the run warns of it): the layouts timed for
    --channels-last auto are named fp32, as they ran, and the choice keeps the precision asked
    (what resolve_precision warns of)."""
    timings = Timings(fp16_NCHW=1.0, fp16_channels_last=0.9)  # (what step_timer is asked)
    choice = choose("fp16", None, cuda=False, native_bf16=True, time_step=timings)
    assert choice.timings == {"fp32 NCHW": 1.0, "fp32 channels_last": 0.9}
    assert "a step in fp32 NCHW 1000 ms, fp32 channels_last 900 ms" in choice.how
    assert (choice.precision, choice.channels_last) == ("fp16", True)


@pytest.mark.parametrize("precision, channels_last", [("bf16", False), ("no", True),
                                                      ("fp16", False)])
def test_explicit_flags_win_and_nothing_is_timed(precision, channels_last):
    timings = Timings(**ALL)
    choice = choose(precision, channels_last, cuda=False, native_bf16=True, time_step=timings)
    assert (choice.precision, choice.channels_last, choice.how, timings.asked) == \
        (precision, channels_last, "as asked", [])


def test_cuda_auto_is_fp16_and_channels_last_without_probing():
    timings = Timings(**ALL)
    choice = choose("auto", None, cuda=True, native_bf16=False, time_step=timings)
    assert (choice.precision, choice.channels_last, timings.asked) == ("fp16", True, [])
    assert choice.how == "CUDA: fp16 autocast; channels_last for tensor cores"
    # the memory format left to auto follows the precision: tensor cores only in fp16/bf16
    for asked, channels_last in (("bf16", True), ("fp16", True), ("no", False)):
        choice = choose(asked, None, cuda=True, native_bf16=False, time_step=timings)
        assert (choice.precision, choice.channels_last, timings.asked) == \
            (asked, channels_last, [])
    # on CUDA an explicit precision and memory format are taken as asked, without probing
    for asked in ("bf16", "no", "auto"):
        for channels_last in (True, False):
            choice = choose(asked, channels_last, cuda=True, native_bf16=False,
                            time_step=timings)
            assert (choice.channels_last, timings.asked) == (channels_last, []), asked
    assert choose("no", False, cuda=True, native_bf16=False, time_step=timings).how == "as asked"
    assert choose("no", None, cuda=True, native_bf16=False, time_step=timings).how == \
        "NCHW in fp32"


def test_a_gpu_without_tensor_cores_stays_nchw_unless_asked():
    timings = Timings(**ALL)
    choice = choose("auto", None, cuda=True, native_bf16=False, time_step=timings,
                    tensor_cores=False)
    assert (choice.precision, choice.channels_last, timings.asked) == ("fp16", False, [])
    assert choice.how == "CUDA: fp16 autocast; NCHW: this GPU has no tensor cores"
    for asked in ("fp16", "bf16", "no"):
        choice = choose(asked, None, cuda=True, native_bf16=False, time_step=timings,
                        tensor_cores=False)
        assert (choice.precision, choice.channels_last) == (asked, False)
        assert choice.how == "NCHW: this GPU has no tensor cores"
    # asked for explicitly, channels_last is taken as asked there too
    choice = choose("auto", True, cuda=True, native_bf16=False, time_step=timings,
                    tensor_cores=False)
    assert (choice.channels_last, choice.how) == (True, "CUDA: fp16 autocast")
    # on a CPU the flag means nothing: the timing decides, as without it
    choice = choose("auto", None, cuda=False, native_bf16=True, time_step=Timings(**ALL),
                    tensor_cores=False)
    assert (choice.precision, choice.channels_last) == ("bf16", True)


@pytest.mark.parametrize("capability, expected", [
    ((5, 2), False), ((6, 0), False), ((6, 1), False),   # Maxwell, Pascal: no tensor cores
    ((7, 0), True), ((7, 5), True), ((8, 0), True), ((8, 9), True), ((9, 0), True),
    ((10, 0), True), ((12, 0), True)])                    # Volta, Turing, Ampere, Ada, Hopper, ...
def test_tensor_cores_are_read_from_the_compute_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert cuda_has_tensor_cores() is expected


@pytest.mark.parametrize("native, tensor_cores", [(True, True), (False, False),
                                                  (True, False), (False, True)])
def test_on_this_machine_the_capabilities_are_read_for_the_device_in_use(
        monkeypatch, native, tensor_cores):
    """The CPU's bf16 is read only for a CPU run, the GPU's tensor cores only for a CUDA run."""
    read = []
    monkeypatch.setattr(autotune, "cpu_has_native_bf16", lambda: read.append("cpu") or native)
    monkeypatch.setattr(autotune, "cuda_has_tensor_cores",
                        lambda: read.append("cuda") or tensor_cores)
    # as in a new process (an earlier in-process test may have left Accelerate holding one)
    monkeypatch.setattr(autotune, "precision_this_process_holds", lambda: None)
    cpu = choose_on_this_machine("auto", None, cuda=False, time_step=Timings(**ALL))
    assert (cpu.precision, read) == (("bf16" if native else "no"), ["cpu"])
    read.clear()
    gpu = choose_on_this_machine("auto", None, cuda=True, time_step=Timings(**ALL))
    assert (gpu.precision, gpu.channels_last, read) == ("fp16", tensor_cores, ["cuda"])


HELD = "the precision this process trained in before (accelerate keeps one a process)"


def test_auto_keeps_the_precision_an_earlier_run_left_the_process_in():
    """A sweep in one program: Accelerate can only run the precision its first run chose."""
    timings = Timings(**ALL)
    choice = choose("auto", None, cuda=False, native_bf16=True, time_step=timings,
                    held_precision="no")  # where bf16 would win the timing
    assert (choice.precision, choice.channels_last) == ("no", True)
    assert sorted(timings.asked) == sorted(["fp32_NCHW", "fp32_channels_last"] * PROBE_ROUNDS)
    assert choice.how == (f"fp32: {HELD}; fastest of 2 timed on this model, a step in fp32 "
                          f"NCHW 1000 ms, fp32 channels_last 900 ms")
    timings = Timings(**ALL)  # bf16 held where the CPU would not choose it
    choice = choose("auto", False, cuda=False, native_bf16=False, time_step=timings,
                    held_precision="bf16")
    assert (choice.precision, choice.how, timings.asked) == ("bf16", f"bf16: {HELD}", [])
    choice = choose("auto", None, cuda=True, native_bf16=False, time_step=timings,
                    held_precision="bf16")
    assert (choice.precision, choice.channels_last, choice.how) == \
        ("bf16", True, f"bf16: {HELD}; channels_last for tensor cores")
    choice = choose("auto", None, cuda=True, native_bf16=False, time_step=timings,
                    held_precision="no")
    assert (choice.precision, choice.channels_last) == ("no", False)


@pytest.mark.parametrize("cuda", [False, True])
def test_on_this_machine_auto_keeps_what_the_process_holds(monkeypatch, cuda):
    monkeypatch.setattr(autotune, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(autotune, "cuda_has_tensor_cores", lambda: True)
    monkeypatch.setattr(autotune, "precision_this_process_holds", lambda: "no")
    choice = choose_on_this_machine("auto", False, cuda=cuda, time_step=Timings(**ALL))
    assert (choice.precision, choice.how) == ("no", f"fp32: {HELD}")


@pytest.mark.parametrize("cuda", [False, True])
def test_an_explicit_precision_is_taken_whatever_the_process_holds(cuda):
    """fit() then refuses it in one line if Accelerate cannot switch to it."""
    timings = Timings(**ALL)
    choice = choose("bf16", False, cuda=cuda, native_bf16=True, time_step=timings,
                    held_precision="no")
    assert (choice.precision, choice.how, timings.asked) == ("bf16", "as asked", [])


def test_an_emulated_bf16_asked_for_explicitly_gets_a_one_line_warning():
    precision, warning = resolve_precision("bf16", cuda=False, native_cpu_bf16=False)
    assert precision == "bf16" and "\n" not in warning
    assert "no native bf16" in warning and "slower than fp32" in warning
    assert resolve_precision("bf16", cuda=False, native_cpu_bf16=True) == ("bf16", None)


def test_the_probe_times_a_model_it_makes_once_when_first_asked():
    import timm
    made = []

    def make_model():
        made.append(timm.create_model("test_resnet", num_classes=10))
        return made[-1]

    time_step = step_timer(make_model, batch_size=8, image_size=32, num_classes=10)
    assert not made  # nothing is built until something is timed
    for precision, channels_last in (("no", False), ("bf16", True)):
        seconds = time_step(precision, channels_last)
        assert 0 < seconds < 60
    assert len(made) == 1
    assert all(p.grad is None for p in made[0].parameters())  # each step's gradients dropped


@pytest.mark.parametrize("precision, channels_last, dtype", [
    ("no", False, torch.float32), ("bf16", True, torch.bfloat16), ("no", True, torch.float32),
    ("fp16", False, torch.float32)])  # fp16 asked for on a CPU trains in fp32: timed as such
def test_the_probe_computes_in_the_precision_and_memory_format_it_times(precision,
                                                                        channels_last, dtype):
    """What the first convolution of the probe's model receives and returns: the timed step
    is the step the run would take."""
    import timm
    seen = []

    def make_model():
        model = timm.create_model("test_resnet", num_classes=10)
        conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
        conv.register_forward_hook(lambda module, args, out: seen.append(
            (out.dtype, args[0].is_contiguous(memory_format=torch.channels_last) and
             not args[0].is_contiguous(), module.weight.is_contiguous(
                 memory_format=torch.channels_last) and not module.weight.is_contiguous())))
        return model

    step_timer(make_model, batch_size=4, image_size=32, num_classes=10)(precision, channels_last)
    assert seen and set(seen) == {(dtype, channels_last, channels_last)}


def test_a_speed_choice_reads_back_from_its_record():
    choice = SpeedChoice("bf16", True, "fastest", {"bf16 channels_last": 0.5})
    assert SpeedChoice(**json.loads(json.dumps(choice.__dict__))) == choice


def test_each_candidate_counts_its_fastest_round():
    """A candidate timed cold in the first round and warm in the next is judged by the warm
    one: the first candidate timed must not lose for being first."""
    rounds = {"fp32_NCHW": [2.0, 0.2], "fp32_channels_last": [0.3, 0.3]}

    def time_step(precision: str, channels_last: bool) -> float:
        return rounds[candidate_name(precision, channels_last).replace(" ", "_")].pop(0)

    choice = choose("no", None, cuda=False, native_bf16=False, time_step=time_step)
    assert (choice.precision, choice.channels_last) == ("no", False)
    assert choice.timings == {"fp32 NCHW": 0.2, "fp32 channels_last": 0.3}


# A run's images a process against the probe's: 2 rounds x candidates x 2 steps (a warm one, a
# timed one) x the probe's batch, counted by hand.  The line is 4x the probe's images.
@pytest.mark.parametrize("precision, channels_last, native, batch, line, untimed", [
    # 4 candidates at a batch of 32: 2 x 4 x 2 x 32 = 512 images, timed from 2,048
    ("auto", None, True, 32, 2048, ("no", False)),
    # no native bf16: fp32 alone, its 2 layouts: 256 images, timed from 1,024
    ("auto", None, False, 32, 1024, ("no", False)),
    # a batch of 8: 2 x 4 x 2 x 8 = 128 images, timed from 512
    ("auto", None, True, 8, 512, ("no", False)),
    # the precision asked, the layout left to auto: bf16's 2 layouts, NCHW untimed
    ("bf16", None, True, 32, 1024, ("bf16", False)),
    # the layout asked, the precision left to auto: fp32 untimed, channels_last kept
    ("auto", True, True, 32, 1024, ("no", True)),
])
def test_a_run_too_short_to_pay_for_the_timing_keeps_pytorchs_defaults(
        precision, channels_last, native, batch, line, untimed):
    for run_images in (line - 1, 1, 0):
        timings = Timings(**ALL)
        choice = choose(precision, channels_last, cuda=False, native_bf16=native,
                        time_step=timings, run_images=run_images, probe_batch=batch)
        assert (choice.precision, choice.channels_last, timings.asked, choice.timings) == \
            (*untimed, [], {}), run_images
        assert choice.how.endswith(
            f"PyTorch's defaults, not timed: this run trains {run_images:,} images a process "
            f"and timing its {line // 4 // 2 // 2 // batch} candidates would train "
            f"{line // 4:,} (auto times runs of {line:,} or more)"), choice.how
    for run_images in (line, line + 1, 10 ** 9, None):  # None: the length is unknown
        timings = Timings(**ALL)
        choice = choose(precision, channels_last, cuda=False, native_bf16=native,
                        time_step=timings, run_images=run_images, probe_batch=batch)
        assert len(timings.asked) == line // 4 // 2 // batch and "fastest of" in choice.how, \
            run_images


def test_a_short_run_says_both_reasons_without_native_bf16():
    choice = choose("auto", None, cuda=False, native_bf16=False, time_step=Timings(**ALL),
                    run_images=96, probe_batch=16)
    assert choice.how == ("fp32: this CPU has no native bf16 (AVX512-BF16 or AMX); PyTorch's "
                          "defaults, not timed: this run trains 96 images a process and timing "
                          "its 2 candidates would train 128 (auto times runs of 512 or more)")


def test_a_short_run_on_cuda_or_asking_for_everything_is_as_before():
    """The line only decides whether to time: CUDA's rule and explicit flags time nothing."""
    timings = Timings(**ALL)
    assert choose("auto", None, cuda=True, native_bf16=False, time_step=timings,
                  run_images=1) == choose("auto", None, cuda=True, native_bf16=False,
                                          time_step=timings)
    assert choose("bf16", True, cuda=False, native_bf16=True, time_step=timings,
                  run_images=1).how == "as asked"
    assert timings.asked == []


class Options:
    """The options planned_images reads, as TrainConfig names them."""

    def __init__(self, epochs=1, batch_size=16, accumulation_steps=1, max_steps=None,
                 time_budget=None):
        self.epochs, self.batch_size, self.accumulation_steps = epochs, batch_size, \
            accumulation_steps
        self.max_steps, self.time_budget = max_steps, time_budget


@pytest.mark.parametrize("options, train_images, world_size, expected", [
    # 3 epochs of 1,000 images, 16 a process on 2: 31 whole global batches of 32 an epoch,
    # 3 x 31 x 16 = 1,488 images a process
    (Options(epochs=3), 1000, 2, 1488),
    # accumulation 2: global batch 64, 15 steps an epoch of 2 batches: 3 x 15 x 2 x 16 = 1,440
    (Options(epochs=3, accumulation_steps=2), 1000, 2, 1440),
    # --max-steps 5 caps it: 5 x 2 x 16 = 160
    (Options(epochs=3, accumulation_steps=2, max_steps=5), 1000, 2, 160),
    # --max-steps past the epochs' steps: the epochs decide
    (Options(epochs=1, max_steps=1000), 100, 1, 96),   # 6 batches of 16
    # a time budget decides the length: unknown, unless --max-steps caps it
    (Options(epochs=3, time_budget="10m"), 1000, 1, None),
    (Options(epochs=3, time_budget="10m", max_steps=7), 1000, 1, 112),
])
def test_the_images_a_run_plans_are_counted_as_the_loaders_count_them(
        options, train_images, world_size, expected):
    assert autotune.planned_images(options, train_images, world_size) == expected
