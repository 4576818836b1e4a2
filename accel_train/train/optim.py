"""Optimizer and learning-rate schedule (linear warmup, then cosine decay).

The schedule is a pure function of the optimizer step, stepped once per optimizer step by the
trainer (not by Accelerate's scheduler wrapper, which steps `num_processes` times per call), so
it is the same function on 1 process and on N.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from accel_train.config import TrainConfig, check_optimizer_name
from accel_train.base.readers import read_json


def build_optimizer(model: nn.Module, config: TrainConfig, fused: bool = False
                    ) -> torch.optim.Optimizer:
    """timm's optimizer factory: any of its optimizers by name, no weight decay on biases and
    normalization weights (timm's and most recipes' choice; --decay-norm-and-bias decays them
    too, as airbench does), frozen parameters left out, and
    layer-wise learning-rate decay when asked (the layer scales live in each group's
    "lr_scale", which timm's schedulers read; ours is a LambdaLR, so they are applied here).

    `fused`: the optimizer's fused kernels where its class has them (torch's SGD, Adam, AdamW,
    Adagrad; others as they are).  The trainer asks for them on CUDA, for two reasons: one
    kernel updates every parameter (foreach, torch's default there, launches several per step,
    which a small network's step waits on), and fp16's GradScaler hands a fused optimizer its
    scale and overflow flag on the device, where with any other it reads the flag on the host
    (`.item()`) every step, so the host could never run ahead of the GPU.  On a CPU neither
    applies and the unfused update, which the CPU figures were measured with, stays."""
    from timm.optim import create_optimizer_v2

    name = check_optimizer_name(config.optimizer)
    if name == "sgd" and config.momentum == 0:
        name = "momentum"  # timm's sgd is Nesterov, which torch refuses without momentum
    fusable = has_fused_kernels(name)
    kernels = {"fused": True} if fused and fusable else {}
    optimizer = create_optimizer_v2(model, opt=name, lr=config.learning_rate,
                                    weight_decay=config.weight_decay, momentum=config.momentum,
                                    layer_decay=config.layer_decay,
                                    filter_bias_and_bn=not config.decay_norm_and_bias, **kernels)
    if config.norm_bias_lr_scale != 1:
        # timm's groups (weight decay, layer scales) each split in two, its normalization
        # shifts scaled: timm has no such option, and its groups are what the scale applies to.
        groups = _with_norm_shifts_apart(optimizer.param_groups, norm_shifts(model),
                                         config.norm_bias_lr_scale)
        optimizer = create_optimizer_v2(groups, opt=name, lr=config.learning_rate,
                                        momentum=config.momentum, **kernels)
    for group in optimizer.param_groups:
        group["lr"] = config.learning_rate * group.get("lr_scale", 1.0)
    if fusable:
        keep_kernels_on_load(optimizer)
    if kernels and isinstance(optimizer, torch.optim.SGD):
        start_momentum_at_zero(optimizer)
    return optimizer


def start_momentum_at_zero(optimizer: torch.optim.SGD) -> None:
    """Fused SGD's momentum buffers, made as zeros before its first step.  Why: torch's fused
    SGD makes them with `empty_like` at its first step and leaves filling them to its kernel;
    where fp16's GradScaler skips that step (an overflow, routine while the scaler finds its
    scale), the kernel writes nothing, and the next step takes the uninitialized memory for
    momentum: weights of garbage or NaN (torch 2.14.1 on a CPU, tests/test_optim.py; torch
    2.11 on CUDA alike).  From a zero buffer the first step's momentum is momentum x 0 plus
    the gradient, the gradient itself, as torch's own first step makes it (where dampening is
    0, as timm's SGD has it; a group with dampening is left to torch)."""
    for group in optimizer.param_groups:
        if group["momentum"] == 0 or group["dampening"] != 0:
            continue
        for param in group["params"]:
            if param.requires_grad:
                optimizer.state[param].setdefault("momentum_buffer", torch.zeros_like(param))


def keep_kernels_on_load(optimizer: torch.optim.Optimizer) -> None:
    """The kernels chosen here outlast a checkpoint's optimizer state, which would otherwise
    bring its own (torch's load_state_dict takes each group's settings from the file).  Why:
    a fused optimizer has told GradScaler at its construction that it takes the overflow flag
    itself; loaded from a checkpoint saved unfused (on a CPU, or by a version before this
    choice) its steps would run torch's unfused update, which refuses that flag: the resumed
    fp16 run would fail at its first step.  The other way, a CPU run resumed from a GPU's
    checkpoint keeps the unfused update its figures were measured with."""
    chosen = [group["fused"] for group in optimizer.param_groups]

    def restore(loaded: torch.optim.Optimizer) -> None:
        for group, fused in zip(loaded.param_groups, chosen):
            group["fused"] = fused

    optimizer.register_load_state_dict_post_hook(restore)


def has_fused_kernels(name: str) -> bool:
    """Whether timm's optimizer `name` is a class that takes torch's `fused=`.  Not where timm
    wraps it in its Lookahead (a `lookahead_` name: the wrapper is what GradScaler sees) nor
    where timm cannot hand the class out here (bitsandbytes' and APEX's without CUDA or the
    package: building the optimizer then says so, as before)."""
    from timm.optim import get_optimizer_class

    try:
        optimizer_class = get_optimizer_class(name)
    except (ValueError, AssertionError, ImportError):
        return False
    return "fused" in inspect.signature(optimizer_class).parameters


def norm_shifts(model: nn.Module) -> set[int]:
    """ids of the normalization layers' shift parameters (BatchNorm, GroupNorm, LayerNorm and
    their timm subclasses) that train."""
    kinds = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    return {id(module.bias) for module in model.modules()
            if isinstance(module, kinds) and getattr(module, "bias", None) is not None
            and module.bias.requires_grad}


def _with_norm_shifts_apart(groups: list[dict], shifts: set[int], scale: float) -> list[dict]:
    """Each group as timm made it (params, weight decay, layer scale), split into its
    normalization shifts (learning-rate scale times `scale`, weight decay over `scale`) and the
    rest.  Why the decay is divided: torch's weight decay is coupled (the update subtracts
    lr x decay x weight), so at `scale` times the rate the shifts would decay `scale` times
    faster; airbench decouples the two and decays them as the other weights."""
    split = []
    for group in groups:
        kept = {key: group[key] for key in ("weight_decay", "lr_scale") if key in group}
        for is_shift in (True, False):
            params = [p for p in group["params"] if (id(p) in shifts) == is_shift]
            if params:
                factor = scale if is_shift else 1.0
                decay = {"weight_decay": kept["weight_decay"] / factor} \
                    if "weight_decay" in kept else {}
                split.append({**kept, **decay, "params": params,
                              "lr_scale": kept.get("lr_scale", 1.0) * factor})
    return split


SCHEDULE_FILE = "schedule.json"


@dataclass
class Schedule:
    """Warmup, then a decay (cosine or linear) over `total_steps`.  Mutable for one reason: a
    --time-budget run fits its total once it has measured its step time, and again as the run
    goes (budget.py); each fit is part of the run, saved in every checkpoint and restored (a
    checkpointed part), so a resumed run keeps the schedule it was on.

    A fit never makes the learning rate jump: from the step where it happens, the decay
    continues from the factor of that moment (`decay_from_factor`) down to `final_factor` at the
    new total, stretched or shrunk over what remains.  Warmup is never repeated; a fit during
    warmup only moves the end of the decay, unless the warmup's end moves with the total: a
    warmup that is a share of the run (`warmup_fraction`, --warmup-fraction) ends at that share
    of the new total, and one in epochs (`warmup_planned`) longer than the total peaks at the
    total's last step.  Then the rise goes on from the factor of that moment (`warmup_from_*`)
    to the new end; a fit that puts the end behind the step it happens at ends the warmup
    there, the decay going on from there.  The budget's estimates of the total, before its
    first fit, move the warmup's end the same way (the total stays open).
    Why a share: a warmup in epochs written for a fast machine outlasts the whole budget of a
    slow one, whose rate then never comes down.

    The shape (`decay`, `warmup_start`, `final_factor`, `warmup_fraction`: --lr-decay,
    --warmup-start-factor, --final-lr-factor, --warmup-fraction) comes from the command line,
    not the checkpoint: a resumed run is given the same flags.  Linear from 0.2 through the peak
    to 0.07 is airbench's triangle."""

    warmup_steps: int
    total_steps: int
    budget_step_seconds: Optional[float] = None  # the reading of the latest fit, if any
    decay_from_step: int = 0      # where the current decay starts (at the warmup's end if later)
    decay_from_factor: float = 1.0
    decay: str = "cosine"
    warmup_start: float = 0.0     # the factor warmup rises from (the first update: a step above)
    final_factor: float = 0.0     # the factor the decay ends at
    warmup_fraction: Optional[float] = None  # the warmup's share of the total, if so given
    # The warmup's line runs through (warmup_from_step, warmup_from_factor) and reaches the peak
    # at its last step; a fit or estimate that moves the warmup's end moves this point to where
    # it stands.
    warmup_from_step: int = -1
    warmup_from_factor: Optional[float] = None  # None: warmup_start
    # The warmup as the flags give it (--warmup-epochs in steps); `warmup_steps` is where it
    # ends now, which a budget's estimates and fits move (to a share of the total, or to the
    # total when shorter).  None: `warmup_steps`.
    warmup_planned: Optional[int] = None

    name = "schedule"
    STATE = ("warmup_steps", "total_steps", "budget_step_seconds", "decay_from_step",
             "decay_from_factor", "warmup_from_step", "warmup_from_factor")

    def factor(self, step: int) -> float:
        warmup = min(self.warmup_steps, self.total_steps)
        if warmup > 0 and step < warmup:
            origin = self.warmup_start if self.warmup_from_factor is None \
                else self.warmup_from_factor
            rise = (step - self.warmup_from_step) / (warmup - 1 - self.warmup_from_step)
            return origin + (1.0 - origin) * rise
        start = max(warmup, self.decay_from_step)
        progress = min(1.0, max(0.0, (step - start) / max(1, self.total_steps - start)))
        left = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.decay == "cosine" \
            else 1.0 - progress
        return self.final_factor + (self.decay_from_factor - self.final_factor) * left

    def __post_init__(self):
        if self.warmup_planned is None:
            self.warmup_planned = self.warmup_steps

    def fit_total(self, total_steps: int, step_seconds: Optional[float], at_step: int) -> None:
        """A --time-budget fit at optimizer step `at_step` (the next update's index);
        `step_seconds` None: an estimate of the total that only paces the warmup (the budget's
        first readings), not a fit."""
        if self._rising(at_step):
            # The warmup ends at its share of the new total, or where planned, but not after
            # the total (a fast machine's warmup in epochs outlasts a slow machine's budget);
            # the rise goes on to that end from the rate of this moment, not redrawn from the
            # start (a jump at every fit).
            end = min(total_steps, warmup_share(self.warmup_fraction, total_steps)
                      if self.warmup_fraction is not None else self.warmup_planned)
            # Only a fit ends it: an estimate from a step or two can read far too slow.
            if step_seconds is not None or end > at_step + 1:
                self._rise_on(at_step, end)
        if step_seconds is None:
            return
        if not self._rising(at_step):
            # Its end is kept where it was met: a total that grows past a warmup once cut short
            # must not start it again.
            self.warmup_steps = min(self.warmup_steps, self.total_steps)
            self.decay_from_factor = self.factor(at_step)
            self.decay_from_step = at_step
        self.total_steps, self.budget_step_seconds = total_steps, step_seconds

    def _rising(self, step: int) -> bool:
        return step < min(self.warmup_steps, self.total_steps)

    def _rise_on(self, at_step: int, end: int) -> None:
        """The warmup now reaches the peak at update `end - 1`, rising from the factor of update
        `at_step` (already set: the scheduler stepped before the fit) or, if that leaves no
        step to rise over, ends here, the decay going on from that factor."""
        now = self.factor(at_step)
        if end > at_step + 1:
            self.warmup_steps = end
            self.warmup_from_step, self.warmup_from_factor = at_step, now
        else:
            self.warmup_steps = at_step
            self.decay_from_step, self.decay_from_factor = at_step, now

    @property
    def fixed_by_budget(self) -> bool:
        return self.budget_step_seconds is not None

    def save(self, folder: Path) -> None:
        state = {name: getattr(self, name) for name in self.STATE}
        (Path(folder) / SCHEDULE_FILE).write_text(json.dumps(state, indent=1) + "\n")

    def load(self, folder: Path) -> None:
        """A total fitted by a --time-budget is kept, with the cosine it was on; otherwise the
        length follows this start's --epochs / --max-steps (a run may be resumed to train
        longer)."""
        saved = read_json(Path(folder) / SCHEDULE_FILE, "schedule")  # its shape checked
        fitted = saved.get("budget_step_seconds") is not None
        if fitted:
            self.total_steps = int(saved["total_steps"])
            self.budget_step_seconds = float(saved["budget_step_seconds"])
            # Absent in the checkpoints of versions that fitted once, at the warmup's end.
            self.decay_from_step = int(saved.get("decay_from_step", 0))
            self.decay_from_factor = float(saved.get("decay_from_factor", 1.0))
        # The warmup's line and end as the fits moved them, or the estimates before any fit (a
        # run stopped during the budget's pilot: the total stays open, the rate where it was).
        if fitted or saved.get("warmup_from_step", -1) >= 0:
            self.warmup_steps = int(saved["warmup_steps"])
            self.warmup_from_step = int(saved.get("warmup_from_step", -1))
            origin = saved.get("warmup_from_factor")
            self.warmup_from_factor = None if origin is None else float(origin)


def scheduler_for(optimizer: torch.optim.Optimizer, schedule: Schedule) -> LambdaLR:
    # A plain function, not the bound method: LambdaLR would save a callable object's state
    # into every checkpoint (pickled); the schedule is a checkpointed part of its own.
    return LambdaLR(optimizer, lambda step: schedule.factor(step))


def base_learning_rates(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each parameter group's learning rate before the schedule's factor (the run's
    --learning-rate times the group's --layer-decay scale)."""
    return [group["initial_lr"] for group in optimizer.param_groups]


def scheduled_learning_rate(optimizer: torch.optim.Optimizer) -> float:
    """The run's learning rate now: --learning-rate times the schedule's factor, what the logs
    show.  Read from the first group without its own scale (--layer-decay, --norm-bias-lr-scale:
    the first group can be the normalization shifts at 64x, or the layer decayed most)."""
    group = optimizer.param_groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)


def take_new_learning_rate(optimizer: torch.optim.Optimizer, scheduler,
                           wanted: list[float]) -> Optional[tuple[float, float]]:
    """A resumed run given another --learning-rate.  Why: loading a checkpoint restores the
    optimizer's and the scheduler's state whole, learning rates included (torch's state dicts
    carry them), so the flag would be ignored without a word.  Here the base rates become
    `wanted` (what this start's flags built) and the current rate follows at the schedule's
    present factor: the schedule keeps its place and shape, scaled.  Returns (the checkpoint's
    rate, the new one) of the first group when they differ, else None."""
    inner = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper holds LambdaLR
    loaded = list(inner.base_lrs)
    if all(math.isclose(old, new) for old, new in zip(loaded, wanted)):
        return None
    for group, new, factor in zip(optimizer.param_groups, wanted, inner.lr_lambdas):
        group["initial_lr"] = new
        group["lr"] = new * factor(inner.last_epoch)
    inner.base_lrs = list(wanted)
    inner._last_lr = [group["lr"] for group in optimizer.param_groups]
    return loaded[0], wanted[0]


# Until a --time-budget run has measured its steps, its length is open: --epochs do not bound it.
OPEN_ENDED = 10**12


def warmup_share(fraction: float, total_steps: int) -> int:
    """--warmup-fraction's warmup, in steps, of a run of `total_steps`."""
    return round(fraction * total_steps)


def plan_schedule(config: TrainConfig, steps_per_epoch: int) -> Schedule:
    """The whole run's schedule: --epochs (or --max-steps) long; a --time-budget run is
    open-ended until it has measured its steps (its first steps are warmup, which does not
    depend on the total, unless given as a share: then the budget's pilot paces it), and a
    resumed one restores the total it fixed (Schedule.load)."""
    total = config.epochs * steps_per_epoch
    if config.time_budget is not None:
        total = OPEN_ENDED
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    warmup = round(config.warmup_epochs * steps_per_epoch)
    if config.warmup_fraction is not None:
        warmup = warmup_share(config.warmup_fraction, total)
    return Schedule(warmup, total, decay=config.lr_decay, warmup_start=config.warmup_start_factor,
                    final_factor=config.final_lr_factor, warmup_fraction=config.warmup_fraction)


def long_warmup_warning(config: TrainConfig, schedule: Schedule) -> Optional[str]:
    """A warmup in epochs as long as the whole run (--max-steps, or few --epochs): the rate
    rises to its peak at the last step and never comes down, which a run should say (as a time
    budget's does: pacing.py)."""
    if (schedule.total_steps == OPEN_ENDED or config.warmup_fraction is not None
            or schedule.warmup_steps < schedule.total_steps):
        return None
    return warmup_outlasts_words(config.warmup_epochs, schedule.warmup_steps,
                                 f"the run's {schedule.total_steps:,}")


def warmup_outlasts_words(warmup_epochs: float, warmup_steps: int, run_steps: str) -> str:
    """The warning that a warmup in epochs is as long as the run (`run_steps`: its steps, in
    words), whether --epochs, --max-steps or a time budget's fit made it that short."""
    steps = f"{warmup_steps:,} step{'' if warmup_steps == 1 else 's'}"
    return (f"--warmup-epochs {warmup_epochs:g} is {steps}, as many as or more than "
            f"{run_steps}: the learning rate will not come down from its peak "
            f"(--warmup-fraction F makes the warmup a share of the run, the decay the rest)")
