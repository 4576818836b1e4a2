"""A run whose weights are no longer finite stops before it saves them.

Why: once a parameter is NaN or infinite (a learning rate too high, an fp32 overflow, a compiler
bug such as the one small_nets.py's pooling avoids), every later step and evaluation is NaN too,
yet the run would go on for hours and its checkpoints would rotate the good ones out
(--keep-checkpoints).  The check costs one pass over the parameters, so it runs where a save is
about to happen and where a logged loss is not finite, never per step.  A non-finite loss alone
does not stop a run: under fp16 the gradient scaler skips such steps and the weights stay intact.
All ranks hold the same weights (DDP), so all reach the same verdict without a collective.
"""

from __future__ import annotations

from typing import Optional

import torch

from accel_train.base.errors import DIVERGED_EXIT, RunStopped


def first_non_finite(model: torch.nn.Module) -> Optional[str]:
    """The name of the first parameter holding a NaN or an infinity, or None."""
    named = list(model.named_parameters())
    if not named:
        return None
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).tolist()
    return next((name for (name, _), ok in zip(named, finite) if not ok), None)


def stop_if_diverged(model: torch.nn.Module, step: int, unsaved: str = "") -> None:
    """Raise RunStopped (exit DIVERGED_EXIT) when the weights are no longer finite; `unsaved`
    names what was about to be written and now is not."""
    name = first_non_finite(model)
    if name is None:
        return
    skipped = f"; {unsaved} was not written" if unsaved else ""
    raise RunStopped(f"training diverged at step {step}: parameter {name} holds NaN or infinite "
                     f"values{skipped}; checkpoints written before are intact. Lower "
                     f"--learning-rate (or set --grad-clip, or --mixed-precision no) and go on "
                     f"from one of them with --resume, or train again", DIVERGED_EXIT)
