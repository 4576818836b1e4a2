"""The precision a run really uses, which is not always the one asked for."""

from __future__ import annotations

from typing import Optional

import torch


def resolve_precision(requested: str, cuda: bool,
                      activity: str = "trains") -> tuple[str, Optional[str]]:
    """The precision that will really run, and a warning when it is not the one asked for
    (`activity`: what this run does in that precision, "trains" or "evaluates").

    "auto" is fp16 on CUDA (what tensor cores are fastest at; every CUDA GPU runs it) and fp32
    elsewhere, without a warning: nobody asked for anything.  Accelerate quietly runs fp32 when
    asked for fp16 without CUDA (DESIGN.md): a user who asked must never believe they trained
    in fp16 when they did not."""
    if requested == "auto":
        return ("fp16" if cuda else "no"), None
    if requested == "fp16" and not cuda:
        return "no", (f"--mixed-precision fp16 needs a CUDA device; this run {activity} in fp32 "
                      "(use --mixed-precision bf16 for reduced precision on CPU)")
    if requested == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        return "no", f"this GPU has no bf16 support; this run {activity} in fp32"
    return requested, None


def precision_name(precision: str) -> str:
    """Accelerate's "no" as people say it."""
    return "fp32" if precision == "no" else precision
