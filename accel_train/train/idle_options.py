"""Options given that the run's other options leave with nothing to do, said at the start.

Each is a valid value, so none is refused: a recipe may keep `--mixup-prob 0.5` beside a Mixup it
turns off for one run.  But a user who gave `--cutmix 1` and sees the same curves as without it
should learn why before training, not after.  The run goes on as the options say.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from accel_train.config import TrainConfig, flag


def _default(name: str):
    return next(f.default for f in dataclasses.fields(TrainConfig) if f.name == name)


def _given(config: TrainConfig, name: str) -> bool:
    return getattr(config, name) != _default(name)


def idle_option_warnings(config: TrainConfig, total_steps: Optional[int]) -> list[str]:
    """One sentence per option that changes nothing, or nearly nothing, in this run.
    `total_steps`: the run's length where it is known before training (None under a time
    budget, which fits it later)."""
    warnings = []
    mixing = config.mixup > 0 or config.cutmix > 0
    if mixing and config.mixup_prob == 0:
        named = " and ".join(f"{flag(n)} {getattr(config, n):g}" for n in ("mixup", "cutmix")
                             if getattr(config, n) > 0)
        warnings.append(f"{named}: --mixup-prob 0 mixes no batch, so the run trains without "
                        f"them; --mixup-prob 1 mixes every batch")
    if not mixing and _given(config, "mixup_prob"):
        warnings.append(f"--mixup-prob {config.mixup_prob:g} has no effect without --mixup or "
                        f"--cutmix (both 0)")
    if not (config.mixup > 0 and config.cutmix > 0) and _given(config, "mixup_switch_prob"):
        warnings.append(f"--mixup-switch-prob {config.mixup_switch_prob:g} chooses between Mixup "
                        f"and CutMix: it has no effect unless both --mixup and --cutmix are on")
    if not config.model_ema and _given(config, "model_ema_decay"):
        warnings.append(f"--model-ema-decay {config.model_ema_decay:g} has no effect without "
                        f"--model-ema")
    if _given(config, "momentum") and not optimizer_has_momentum(config.optimizer):
        warnings.append(f"--momentum {config.momentum:g} has no effect with --optimizer "
                        f"{config.optimizer} (timm's {config.optimizer} has no momentum; its "
                        f"betas are its own); sgd, momentum, lars or madgrad take it")
    short_ema = ema_outlasts_the_run(config, total_steps)
    return warnings + ([short_ema] if short_ema else [])


def optimizer_has_momentum(name: str) -> bool:
    """Whether timm's optimizer (or the one a lookahead_ name wraps) takes --momentum: timm's
    factory passes it only to those its registry says have one, and drops it for the rest."""
    from timm.optim import get_optimizer_info

    return get_optimizer_info(name.lower().removeprefix("lookahead_")).has_momentum


def ema_outlasts_the_run(config: TrainConfig, total_steps: Optional[int],
                         run: str = "this run has") -> Optional[str]:
    """An EMA follows about 1 / (1 - decay) steps; over a run shorter than that, the average is
    mostly the weights it started from (timm's ModelEmaV3 runs here without its warmup).  Said
    at the start, or (`run`: words for the length) when a time budget has fitted the length."""
    if not (config.model_ema and total_steps):
        return None
    horizon = round(1 / (1 - config.model_ema_decay))
    if horizon <= total_steps:
        return None
    suggested = max(0.5, 1 - 10 / total_steps)  # over the run's last tenth
    return (f"--model-ema-decay {config.model_ema_decay:g} averages over about "
            f"{horizon:,.0f} steps and {run} {total_steps:,}: the EMA weights stay close to the "
            f"starting weights (and the final model will be the trained ones); "
            f"--model-ema-decay {suggested:.4g} averages over its last tenth")
