"""A run whose weights are no longer finite stops before it saves them.

Why: once a parameter is NaN or infinite (a learning rate too high, an fp32 overflow, a compiler
bug such as the one small_nets.py's pooling avoids), every later step and evaluation is NaN too,
yet the run would go on for hours and its checkpoints would rotate the good ones out
(--keep-checkpoints).  The check costs one pass over the parameters, so it runs where a save is
about to happen and where a logged loss is not finite, never per step.  A non-finite loss alone
does not stop a run: under fp16 the gradient scaler skips such steps and the weights stay intact.
All ranks hold the same weights (DDP), so all reach the same verdict without a collective.

A loss that stays non-finite is another matter: the scaler then skips every step, the weights
stay finite, and a run trains nothing to its end with exit 0 (torchvision's GoogLeNet in fp16 on
an H200 did, its loss NaN from its first steps; the likely cause, fused SGD's momentum left
uninitialized by a skipped first step, is mended in optim.start_momentum_at_zero, but any
forward pass that overflows in fp16 on every batch does the same).
NonFiniteLosses counts such batches in a row and stops the run once they are too many to be a
passing overflow, or at the end of a start none of whose batches had a finite loss.

The loss can stay finite while the backward pass overflows fp16 at every scale (activations or
gradients past fp16's 65504): the scaler then halves its scale at each skipped step, 65536 to
below 1e-4 in 30 steps, and on to zero, where every gradient is zero and nothing is skipped or
learned again.  stop_if_scale_collapsed stops such a run at the floor fairseq's dynamic loss
scaler stops at (its --min-loss-scale), read where a record already reads the loss.
"""

from __future__ import annotations

from typing import Iterable, Optional

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


# Batches in a row with a non-finite loss that stop a run.  A passing overflow in fp16 spoils a
# step or two while the scaler finds its scale; a forward pass that overflows on every batch
# does so on each of them, whatever the data.
NON_FINITE_LOSSES_LIMIT = 100

_CAUSE = ("the weights stayed finite, so nothing is being learned (under fp16 the gradient "
          "scaler skips every such step). A forward pass that overflows in fp16 is the usual "
          "cause: --mixed-precision bf16 (or no) computes it in a wider range; else lower "
          "--learning-rate, or look for NaN in the inputs")


class NonFiniteLosses:
    """Batches in a row whose training loss was NaN or infinite on any rank.  Fed the same
    reduced flags on every rank (track.py), so every rank reaches the same verdict."""

    def __init__(self, limit: int = NON_FINITE_LOSSES_LIMIT):
        self.limit = limit
        self.in_a_row = 0
        self.batches = 0  # trained by this start

    def add(self, finite: Iterable[bool]) -> None:
        for ok in finite:
            self.batches += 1
            self.in_a_row = 0 if ok else self.in_a_row + 1

    def stop_if_too_many(self, step: int) -> None:
        """Raise RunStopped (exit DIVERGED_EXIT) once `limit` batches in a row were non-finite."""
        if self.in_a_row >= self.limit:
            raise RunStopped(f"training stopped at step {step}: the training loss was NaN or "
                             f"infinite in each of the last {self.in_a_row} batches, while "
                             f"{_CAUSE}; checkpoints written before are intact",
                             DIVERGED_EXIT)

    def stop_if_none_finite(self, step: int, unsaved: str) -> None:
        """At the end of a start: raise RunStopped when not one of its batches had a finite
        loss (a run shorter than `limit` batches), before `unsaved` is written."""
        if self.batches and self.in_a_row == self.batches:
            raise RunStopped(f"training stopped at step {step}: the training loss was NaN or "
                             f"infinite in every one of this start's {self.batches} batches, "
                             f"while {_CAUSE}; {unsaved} was not written", DIVERGED_EXIT)


# fairseq's --min-loss-scale default: below it the gradients overflow fp16 even scaled down more
# than 10,000 times, which no passing spike does.
MIN_LOSS_SCALE = 1e-4


def loss_scale(scaler) -> Optional[float]:
    """fp16's gradient scale (a torch GradScaler's), None without one.  One synchronization:
    read where a record already made one."""
    if scaler is None or not scaler.is_enabled():
        return None
    return float(scaler.get_scale())


def stop_if_scale_collapsed(scale: Optional[float], step: int) -> None:
    """Raise RunStopped (exit DIVERGED_EXIT) when fp16's gradient scaler has backed its scale
    (`loss_scale`) off below MIN_LOSS_SCALE."""
    if scale is None or scale >= MIN_LOSS_SCALE:
        return
    raise RunStopped(f"training stopped at step {step}: fp16's gradient scaler backed its scale "
                     f"off to {scale:.3g} (below {MIN_LOSS_SCALE:g}), halving it at each step "
                     f"whose gradients overflowed, so the steps are being skipped and nothing "
                     f"is learned. --mixed-precision bf16 (or no) computes the backward pass in "
                     f"a wider range; else lower --learning-rate; checkpoints written before are "
                     f"intact", DIVERGED_EXIT)
