"""`--mixed-precision auto` and `--channels-last auto` on a CPU: chosen by measuring this model on
this machine, never written into a recipe.

CPUs differ in what runs fast: with native bf16 (AVX512-BF16 or AMX) bf16 autocast can run a
network about twice as fast as fp32, while where bf16 is emulated (AVX512 without BF16, AVX2) it
runs at about half the speed; channels_last helps some networks and not others
(benchmarks/BENCHMARKS.md).  So "auto" asks the machine: a capability check first (no native
bf16: fp32, nothing to time for the precision), then, when more than one candidate is left, a
few timed training steps of the run's own model on a batch of the run's shape per candidate
(seconds), and the fastest wins.  A run too short to pay for that timing is not timed: it
trains in PyTorch's defaults, fp32 and NCHW (`PROBE_PAYBACK` says where the line is).  On
CUDA nothing is timed: auto is fp16 (tensor cores), and channels_last whenever the run
computes in fp16 or bf16 on a GPU with tensor cores, since their convolutions read and write
channels-last tensors and an NCHW network pays a transpose around each one (measured on a
GPU: benchmarks/BENCHMARKS.md, "GPU: one NVIDIA H200, a third time");
a GPU without them (compute capability below 7.0) has no such kernels to feed: NCHW there.

The choice is part of the run: the start summary says it with the figures it was made on, the
run record and every checkpoint keep it, and a resumed run takes it from the checkpoint without
probing again (exact resume holds).  Explicit flags always win.  A process that trained
before (a program calling fit() again) keeps its precision: Accelerate holds one a process.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from accel_train.base.ranks import decide_on_main
from accel_train.train.precision import (cpu_has_native_bf16, cuda_has_tensor_cores,
                                         precision_name, precision_this_process_holds)

PROBE_ROUNDS = 2       # candidates timed in turn, round after round: a load that comes and goes
                       # falls on all of them, and the first candidate is not the only one cold
PROBE_WARM_STEPS = 1   # per call: a new memory format pays oneDNN's kernel selection once more
PROBE_TIMED_STEPS = 1  # then the fastest step over the rounds is the candidate's figure
PROBE_MAX_BATCH = 32   # a smaller batch than the run's keeps the probe to seconds
# The probe is timed only where the run trains at least this many times the images the probe
# does (a process's share; unknown, as under --time-budget: timed).  The best choice saves up
# to about half a step (bf16 against fp32 with native bf16: 1,045 against 2,252 ms a step of
# ResNet-18 at 224 px, AMD EPYC with AVX512-BF16, 2 threads), often a tenth (the memory
# format alone): at 4x the probe's images the timing costs at most a quarter of the training
# it decides, and a one-epoch run on a few hundred photographs no longer spends more seconds
# choosing (24 for ResNet-18, 74 for ResNet-50 there) than training.
PROBE_PAYBACK = 4


@dataclass(frozen=True)
class SpeedChoice:
    """How the run computes: Accelerate's precision name and the memory format."""

    precision: str                 # "no" (fp32), "bf16" or "fp16"
    channels_last: bool
    how: str                       # one line for the start summary: why this choice
    timings: dict = field(default_factory=dict)  # "bf16 channels_last" -> seconds per step


def candidate_name(precision: str, channels_last: bool) -> str:
    return f"{'fp32' if precision == 'no' else precision} " \
           f"{'channels_last' if channels_last else 'NCHW'}"


def choose(requested_precision: str, requested_channels_last: Optional[bool], cuda: bool,
           native_bf16: bool, time_step: Callable[[str, bool], float],
           tensor_cores: bool = True, held_precision: Optional[str] = None,
           run_images: Optional[int] = None, probe_batch: int = PROBE_MAX_BATCH) -> SpeedChoice:
    """The precision and memory format for a run that asked for these (`"auto"` / None: to be
    chosen).  `time_step(precision, channels_last)` times a training step of the run's model
    on a batch of `probe_batch`; it is called only when there is something to choose between
    and the run trains at least PROBE_PAYBACK times the probe's images (`run_images`, a
    process's; None: not known, timed).  `tensor_cores`: whether the GPU has them
    (precision.cuda_has_tensor_cores; ignored on a CPU).  `held_precision`: the one an earlier
    run left this process in (precision.precision_this_process_holds), which "auto" then
    keeps: Accelerate could run no other.  Explicit values are taken as they are
    (precision.resolve_precision says what then really runs)."""
    if requested_precision == "auto" and held_precision is not None:
        requested_precision = held_precision
        held = [f"{precision_name(held_precision)}: the precision this process trained in "
                f"before (accelerate keeps one a process)"]
    else:
        held = []
    if cuda:
        precision = "fp16" if requested_precision == "auto" else requested_precision
        reasons = held + (["CUDA: fp16 autocast"] if requested_precision == "auto" else [])
        channels_last = requested_channels_last
        if channels_last is None:
            channels_last = tensor_cores and precision in ("fp16", "bf16")
            reasons.append("channels_last for tensor cores" if channels_last
                           else "NCHW in fp32" if tensor_cores
                           else "NCHW: this GPU has no tensor cores")
        return SpeedChoice(precision, channels_last, "; ".join(reasons) or "as asked")
    precisions = [requested_precision]
    reasons = held
    if requested_precision == "auto":
        precisions = ["no", "bf16"] if native_bf16 else ["no"]
        if not native_bf16:
            reasons.append("fp32: this CPU has no native bf16 (AVX512-BF16 or AMX)")
    layouts = [False, True] if requested_channels_last is None else [requested_channels_last]
    candidates = [(p, c) for p in precisions for c in layouts]
    if len(candidates) == 1:
        (precision, channels_last), = candidates
        return SpeedChoice(precision, channels_last, "; ".join(reasons) or "as asked")
    probe_images = PROBE_ROUNDS * len(candidates) * (PROBE_WARM_STEPS + PROBE_TIMED_STEPS) \
        * probe_batch
    if run_images is not None and run_images < PROBE_PAYBACK * probe_images:
        # candidates[0]: fp32 where the precision was left to auto, NCHW where the format was
        (precision, channels_last) = candidates[0]
        reasons.append(f"PyTorch's defaults, not timed: this run trains {run_images:,} images "
                       f"a process and timing its {len(candidates)} candidates would train "
                       f"{probe_images:,} (auto times runs of {PROBE_PAYBACK * probe_images:,} "
                       f"or more)")
        return SpeedChoice(precision, channels_last, "; ".join(reasons))

    def timed_as(p: str, c: bool) -> str:
        # fp16 asked for on a CPU trains, and is timed (step_timer), in fp32: named so
        return candidate_name("no" if p == "fp16" else p, c)

    timings: dict[str, float] = {}
    for _ in range(PROBE_ROUNDS):
        for p, c in candidates:
            seconds = time_step(p, c)
            timings[timed_as(p, c)] = min(seconds, timings.get(timed_as(p, c), seconds))
    precision, channels_last = min(candidates, key=lambda pc: timings[timed_as(*pc)])
    measured = ", ".join(f"{name} {1000 * seconds:.0f} ms" for name, seconds in timings.items())
    reasons.append(f"fastest of {len(candidates)} timed on this model, a step in {measured}")
    return SpeedChoice(precision, channels_last, "; ".join(reasons), timings)


def choose_on_this_machine(requested_precision: str, requested_channels_last: Optional[bool],
                           cuda: bool, time_step: Callable[[str, bool], float],
                           run_images: Optional[int] = None,
                           probe_batch: int = PROBE_MAX_BATCH) -> SpeedChoice:
    """`choose` with this machine's capabilities read: native bf16 on a CPU, tensor cores on a
    GPU (the trainer's choice and --smaller-models' probe of each network ask the same way)."""
    return choose(requested_precision, requested_channels_last, cuda,
                  native_bf16=not cuda and cpu_has_native_bf16(), time_step=time_step,
                  tensor_cores=cuda and cuda_has_tensor_cores(),
                  held_precision=precision_this_process_holds(), run_images=run_images,
                  probe_batch=probe_batch)


def planned_images(config, train_images: int, world_size: int) -> Optional[int]:
    """The images each process trains in the run as its options plan it, as the loaders
    count them (whole global batches an epoch; an optimizer step is `accumulation_steps`
    batches): None where a --time-budget decides the length (unless --max-steps caps it)."""
    batches = None
    if config.time_budget is None:
        steps_per_epoch = train_images // (config.batch_size * world_size) \
            // config.accumulation_steps
        batches = config.epochs * steps_per_epoch * config.accumulation_steps
    if config.max_steps is not None:
        capped = config.max_steps * config.accumulation_steps
        batches = capped if batches is None else min(batches, capped)
    return None if batches is None else batches * config.batch_size


def step_timer(make_model: Callable[[], torch.nn.Module], batch_size: int, image_size: int,
               num_classes: int, max_batch: int = PROBE_MAX_BATCH,
               device: Optional[torch.device] = None) -> Callable[[str, bool], float]:
    """time_step for `choose`: forward, backward and an SGD update of a model of the run's
    architecture, made by `make_model` at the first call (never the run's own model: its
    weights, statistics and synchronized BatchNorm stay out of it), on a random batch of the
    run's image shape on `device` (default: the CPU); the fastest of a few steps, in seconds."""
    device = device or torch.device("cpu")
    probe: list = []
    batch = min(batch_size, max_batch)
    generator = torch.Generator().manual_seed(0)  # the global generators are not the probe's
    images = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device)
    labels = torch.randint(0, num_classes, (batch,), generator=generator).to(device)
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def time_step(precision: str, channels_last: bool) -> float:
        if not probe:
            model = make_model().to(device).train()
            probe.extend([model, torch.optim.SGD([p for p in model.parameters()
                                                  if p.requires_grad], lr=1e-6)])
        model, optimizer = probe
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        net = model.to(memory_format=memory_format)
        x = images.contiguous(memory_format=memory_format)
        seconds = []
        # fp16 asked for on a CPU trains in fp32 (precision.resolve_precision): timed as such
        low = torch.float16 if precision == "fp16" else torch.bfloat16
        lowered = precision == "bf16" or (precision == "fp16" and device.type == "cuda")
        for step in range(PROBE_WARM_STEPS + PROBE_TIMED_STEPS):
            wait()
            started = time.perf_counter()
            with torch.autocast(device.type, dtype=low, enabled=lowered):
                loss = torch.nn.functional.cross_entropy(net(x), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            wait()
            if step >= PROBE_WARM_STEPS:
                seconds.append(time.perf_counter() - started)
        return min(seconds)

    return time_step


def speed_for_run(config, make_model: Callable[[], torch.nn.Module], spec,
                  kept_choices: Sequence[str], chosen: Optional[SpeedChoice],
                  cuda: bool, run_images: Optional[int] = None) -> SpeedChoice:
    """--mixed-precision and --channels-last for a run: as asked; "auto" on a CPU, measured on
    fresh copies of its model (`make_model()`), by rank 0 for all, where the run trains
    `run_images` a process (planned_images; None: unknown) enough to pay for it.  `chosen`:
    already timed while choosing the network (network_choice.py).  A resumed run's plan
    already holds what the checkpoint ran with (resume.keep_choices): `kept_choices` says so."""
    if chosen is not None:
        return chosen

    def measure() -> dict:
        batch = min(config.batch_size, PROBE_MAX_BATCH)  # the probe's, and its images' count
        time_step = step_timer(make_model, batch, spec.image_size, spec.num_classes)
        return choose_on_this_machine(config.mixed_precision, config.channels_last, cuda,
                                      time_step, run_images, batch).__dict__

    choice = SpeedChoice(**decide_on_main(measure))
    kept = [name for name in kept_choices
            if name not in ("network", "decoding", "decoding share")]
    if kept:
        choice = dataclasses.replace(choice, how=f"{' and '.join(kept)} kept from the "
                                                 f"checkpoint")
    return choice
