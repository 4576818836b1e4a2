"""The precision a run really uses, which is not always the one asked for."""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from accelerate import state as accelerate_state


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 convolutions and matmuls run natively.  Not oneDNN's own
    "bf16 supported", which is also true where it emulates bf16 with plain AVX512 (slowly: a
    2048x2048 matmul at a quarter of fp32's speed on such an Intel Xeon, BENCHMARKS.md)."""
    checks = [getattr(torch.cpu, name, None)
              for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


def cuda_has_tensor_cores() -> bool:
    """The current GPU has tensor cores: compute capability 7.0 (Volta) or later.  What
    channels_last pays off on (autotune.choose); older GPUs run cuDNN's NCHW kernels best."""
    return torch.cuda.get_device_capability() >= (7, 0)


def resolve_precision(requested: str, cuda: bool, activity: str = "trains",
                      native_cpu_bf16: Optional[bool] = None) -> tuple[str, Optional[str]]:
    """The precision that will really run, and a warning when it is not the one asked for
    (`activity`: what this run does in that precision, "trains" or "evaluates").

    "auto" is fp16 on CUDA (what tensor cores are fastest at; every CUDA GPU runs it) and fp32
    elsewhere, without a warning: nobody asked for anything (on a CPU the trainer first lets
    autotune.py measure whether bf16 is faster, and then asks for that).  Accelerate quietly
    runs fp32 when asked for fp16 without CUDA (docs/architecture.md): a user who asked must
    never believe they trained in fp16 when they did not."""
    if requested == "auto":
        return ("fp16" if cuda else "no"), None
    if requested == "fp16" and not cuda:
        return "no", (f"--mixed-precision fp16 needs a CUDA device; this run {activity} in fp32 "
                      "(use --mixed-precision bf16 for reduced precision on CPU)")
    if requested == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        return "no", f"this GPU has no bf16 support; this run {activity} in fp32"
    if requested == "bf16" and not cuda:
        native = cpu_has_native_bf16() if native_cpu_bf16 is None else native_cpu_bf16
        if not native:  # still bf16, as asked: the numbers are right, only the speed suffers
            return requested, ("--mixed-precision bf16: this CPU has no native bf16 (AVX512-BF16 "
                               "or AMX), so bf16 is emulated and usually slower than fp32; drop "
                               "the flag (or use mixed_precision: no) for speed")
    return requested, None


def precision_this_process_holds() -> Optional[str]:
    """The mixed precision an earlier run left this process in ("no", "bf16" or "fp16"), None
    where nothing has trained yet.  Accelerate keeps one state a process, its precision fixed
    by the first Accelerator (with no public way to reset it), so a later run in the same
    program (a sweep calling fit() again) can only train in that one."""
    if not accelerate_state.is_initialized():
        return None
    return accelerate_state.AcceleratorState().mixed_precision


def precision_name(precision: str) -> str:
    """Accelerate's "no" as people say it."""
    return "fp32" if precision == "no" else precision


def accelerate_fp16_note(requested: str, chosen: str, environ: Mapping[str, str]) -> Optional[str]:
    """One line when `accelerate config` answered fp16 but this run chose otherwise: its fp16
    counts as "auto" (cli.launcher_defaults), which is fp16 on a GPU and measured on a CPU."""
    if requested != "auto" or environ.get("ACCELERATE_MIXED_PRECISION") != "fp16" \
            or chosen == "fp16":
        return None
    return (f"the accelerate config asks for mixed_precision fp16, which needs a CUDA device: "
            f"this run uses {precision_name(chosen)}, as --mixed-precision auto chooses on this "
            f"machine")


def use_fast_cuda_math(cuda: bool) -> Optional[str]:
    """On CUDA: cuDNN autotuning (a training batch has one shape, drop_last, so the search is
    paid once per shape) and TF32 tensor cores for fp32 matmuls (torch's default is full fp32
    for matmuls; convolutions already use TF32).  Mixed-precision runs lose nothing by either.
    Returns what was set, for the run's summary and record; None (and nothing set) on a CPU.
    Process-wide settings, like Accelerate's own: the trainer owns the process."""
    if not cuda:
        return None
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")  # TF32 where fp32 matmuls run
    return "cuDNN autotuning on, TF32 matmuls for fp32"
