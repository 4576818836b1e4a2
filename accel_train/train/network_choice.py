"""--smaller-models with --time-budget: the network trained is the largest that the budget holds
for --min-budget-epochs on this machine, timed at the start, never written into a recipe.

A recipe names the network it was tuned with, and its schedule assumes that the budget holds
some number of epochs of it.  Machines differ by more than a schedule can absorb: the CPU
recipe's network trains about six times slower in fp32 on a CPU without native bf16 than in
bf16 on one with AMX (benchmarks/BENCHMARKS.md), and there its budget held under two epochs, with
the learning rate still rising at the end.  A smaller network trained for its epochs does better
there, and worse where the large one fits.  So a recipe names its network, the smaller ones to
fall back to (largest first), and the fewest epochs a network must get; at the start each is
timed in turn, in the precision and memory format auto chooses for it (autotune.py: the same
probe), until one is estimated to get that many epochs; if none does, the fastest is trained.
Timing stops at the first network that fits: where the recipe's own network fits, nothing
beyond `--mixed-precision auto`'s usual probe is timed.

The estimate is the budget over a step timed apart from the run (no data loading, no
evaluation, no gradient exchange), the fastest of a few readings, so above what the run will
get (about twice in one side-by-side run on a 2-core Intel Xeon); `--min-budget-epochs` is set
with that in mind.  On a CPU the precision and
memory format are chosen on auto's small probe batch, but the estimate times the chosen one on
a batch near the run's: per image, a batch of 32 costs about a third more than one of 256 or
more on a CPU (benchmarks/BENCHMARKS.md, "airbench94 and the CLI side by side"), which had the
recipe's network estimated short of the epochs it then trained.

The choice is part of the run: the start summary says it with the figures, the run's
config.yaml records the network chosen (as it records auto's precision), checkpoints name it
(model_config.json), and a resumed run trains the checkpoint's network without timing again
(resume.keep_choices).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from accel_train.base.ranks import decide_on_main
from accel_train.train.autotune import (PROBE_MAX_BATCH, SpeedChoice, candidate_name,
                                        choose_on_this_machine, step_timer)
from accel_train.config import parse_duration
from accel_train.data.sources import default_image_size
from accel_train.model.build import create_model

# The batch a CPU's estimate is timed on, at most: near the per-image cost of the run's batch
# (32 images cost about a third more each than 256 or 1024) at a few seconds per network.
ESTIMATE_MAX_BATCH = 256
# The estimate is the fastest of this many readings of that step: a 2-core machine's pace moves
# by half within seconds, and one reading taken at a slow moment had the CPU recipe's network
# estimated at 7.7 epochs of a budget its anchor had just trained 10 in (8 needed: the narrower
# network was trained).  Eight readings of the same step read 1.83-2.81 s per 1,024 images
# (cifar_airbench, bf16, on a 2-core Intel Xeon with AMX).
ESTIMATE_ROUNDS = 5


@dataclass(frozen=True)
class NetworkChoice:
    model: str
    speed: SpeedChoice           # how the chosen network computes (its probe's choice)
    how: str                     # one line for the start summary
    epochs: dict = field(default_factory=dict)  # network -> epochs the budget was estimated to hold

    def to_dict(self) -> dict:
        """Plain values, to hand from rank 0 to the others."""
        return {**self.__dict__, "speed": self.speed.__dict__}

    @classmethod
    def from_dict(cls, values: dict) -> "NetworkChoice":
        return cls(**{**values, "speed": SpeedChoice(**values["speed"])})


def epochs_in_budget(budget_seconds: float, step_seconds: float, images_per_step: int,
                     train_samples: int) -> float:
    """How many epochs a budget holds at a measured step (all processes' images per step)."""
    return budget_seconds * images_per_step / step_seconds / train_samples


def choose_network(models: Sequence[str], min_epochs: float,
                   measure: Callable[[str], tuple[SpeedChoice, float]],
                   epochs_for: Callable[[float], float]) -> NetworkChoice:
    """The first of `models` whose estimated epochs reach `min_epochs`, else the fastest.
    `measure(name)` chooses how the network computes and returns that choice with its step's
    seconds; `epochs_for(seconds)` turns a step into epochs in the budget."""
    if not models:
        raise ValueError("choose_network needs at least one network")
    epochs: dict[str, float] = {}
    speeds: dict[str, SpeedChoice] = {}
    for name in models:
        speeds[name], seconds = measure(name)
        epochs[name] = epochs_for(seconds)
        if epochs[name] >= min_epochs:
            chosen, verdict = name, f"the first to reach {min_epochs:g}"
            break
    else:  # all were timed: the fastest as measured, whatever order they were listed in
        chosen = max(epochs, key=epochs.__getitem__)
        verdict = f"none reaches {min_epochs:g}: the fastest"
    figures = ", ".join(f"{network} {estimate:.1f}" for network, estimate in epochs.items())
    how = f"epochs the budget holds, timed at the start: {figures}; {verdict}"
    return NetworkChoice(chosen, speeds[chosen], how, epochs)


def choose_for_run(config, image_size: int, num_classes: int, train_samples: int,
                   world_size: int, cuda: bool) -> NetworkChoice:
    """The choice for a run with these options (`--time-budget` set), each network timed on
    this process's device: on a CPU the precision chosen on the CPU probe's batch and the
    estimate timed on up to ESTIMATE_MAX_BATCH images, on a GPU both on the run's batch (at a
    small one it would idle); all processes are counted as running at its pace."""
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    probe_batch = config.batch_size if cuda else min(config.batch_size, PROBE_MAX_BATCH)
    estimate_batch = config.batch_size if cuda else min(config.batch_size, ESTIMATE_MAX_BATCH)
    budget = parse_duration(config.time_budget)

    def measure(name: str) -> tuple[SpeedChoice, float]:
        def make() -> torch.nn.Module:
            return create_model(name, num_classes, config.drop_rate, None, config.drop_path)

        time_step = step_timer(make, probe_batch, image_size, num_classes, probe_batch, device)
        speed = choose_on_this_machine(config.mixed_precision, config.channels_last, cuda,
                                       time_step)
        if estimate_batch == probe_batch:
            timed = speed.timings.get(candidate_name(speed.precision, speed.channels_last))
            if timed is not None:  # auto's rounds already timed it
                return speed, timed
        else:
            time_step = step_timer(make, estimate_batch, image_size, num_classes,
                                   estimate_batch, device)
        return speed, min(time_step(speed.precision, speed.channels_last)
                          for _ in range(ESTIMATE_ROUNDS))

    return choose_network([config.model, *config.smaller_models], config.min_budget_epochs,
                          measure, lambda seconds: epochs_in_budget(
                              budget, seconds, estimate_batch * world_size, train_samples))


def network_for_run(config, data, world_size: int, cuda: bool,
                    warn: Callable[[str], None]) -> tuple[object, Optional[NetworkChoice]]:
    """--smaller-models with --time-budget: the network this machine can train for
    --min-budget-epochs within the budget, timed by rank 0 for all.  Returns the config with
    that network in --model, and the choice (None: nothing was chosen).  A resumed run's plan
    already names the checkpoint's network (resume.keep_choices)."""
    if not config.smaller_models:
        return config, None
    if config.time_budget is None:
        warn(f"--smaller-models chooses by --time-budget, which this run does not have: "
             f"training --model {config.model}")
        return config, None
    choice = NetworkChoice.from_dict(decide_on_main(lambda: choose_for_run(
        config, config.image_size or default_image_size(data.train), len(data.class_names),
        len(data.train), world_size, cuda).to_dict()))
    return dataclasses.replace(config, model=choice.model, smaller_models=[]), choice


def choice_words(choice: Optional[NetworkChoice], kept_choices: Sequence[str]) -> Optional[str]:
    """How the network was chosen, for the start summary (None: as --model named it)."""
    if choice is not None:
        return choice.how
    if "network" in kept_choices:
        return "kept from the checkpoint (--smaller-models)"
    return None
