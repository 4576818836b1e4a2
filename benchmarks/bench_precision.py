"""Precision and memory format on this CPU: fp32 and bf16, NCHW and channels_last, against what
`--mixed-precision auto --channels-last auto` chooses, and the share of this machine's own
matmul peak each reaches.

For each network (the CIFAR recipe's cifar_convnet_l and resnet18, at 32 px): training steps
(forward, backward, SGD update) on a random batch, each of the four candidates timed in turn,
round after round (a load that comes and goes falls on all of them); img/s is the batch over the
median step of each.  The auto row is the candidate that accel_train's own choice
(autotune.choose with its probe, as a run's start does) picked, with its measured img/s and its
ratio to the fastest candidate.  The peak: a 2048x2048 matmul in fp32 and in bf16, GFLOP/s; a
network's share is its training FLOPs per image (torch's FLOP counter, forward and backward) x
img/s over the faster of the two peaks.

    python benchmarks/bench_precision.py            # the machine's CPU flags are in the header
    python benchmarks/bench_precision.py --quick
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

MODELS = {"cifar_convnet_l": 256, "resnet18": 64}  # network -> batch (the recipe's, the default)


def matmul_gflops(dtype: torch.dtype, size: int, repeats: int) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b  # warm
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        seconds.append(time.perf_counter() - started)
    return 2 * size ** 3 / min(seconds) / 1e9


def training_flops_per_image(model: torch.nn.Module, size: int) -> float:
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.randn(2, 3, size, size)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 2


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--batch", type=int, default=None, help="instead of each model's own")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--matmul-size", type=int, default=2048)
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 6)
    from accel_train.model import small_nets  # noqa: F401  (registers cifar_convnet_*)
    from accel_train.train.autotune import candidate_name, choose, step_timer
    from accel_train.train.precision import cpu_has_native_bf16
    import timm

    report = benchlib.Report("precision", "Precision and memory format on a CPU", args)
    native = cpu_has_native_bf16()
    flags = sorted({flag for flag in ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f")
                    if flag in Path("/proc/cpuinfo").read_text()} if Path("/proc/cpuinfo")
                   .exists() else set())
    repeats = 3 if args.quick else 10
    peaks = {"fp32": matmul_gflops(torch.float32, args.matmul_size, repeats),
             "bf16": matmul_gflops(torch.bfloat16, args.matmul_size, repeats)}
    report.table(f"Matmul peak, {args.matmul_size}x{args.matmul_size} (CPU flags: "
                 f"{', '.join(flags) or 'none'}; native bf16: {native})",
                 ["dtype", "GFLOP/s"], [[name, value] for name, value in peaks.items()],
                 notes=["fastest of the repeats; the peak a network's share is measured against "
                        "is the faster of the two"])
    best_peak = max(peaks.values())
    rows = []
    for name in args.models:
        batch = args.batch or MODELS.get(name, 64)
        make = functools.partial(timm.create_model, name, num_classes=10)
        flops = training_flops_per_image(make(), 32)
        time_step = step_timer(make, batch, 32, 10, max_batch=batch)  # the run's own batch
        candidates = [(p, c) for p in ("no", "bf16") for c in (False, True)]
        seconds = {candidate_name(p, c): [] for p, c in candidates}
        for _ in range(args.rounds):
            for p, c in candidates:
                seconds[candidate_name(p, c)].append(time_step(p, c))
        picked = choose("auto", None, False, native, step_timer(make, batch, 32, 10))
        picked_name = candidate_name(picked.precision, picked.channels_last)
        img_s = {key: batch / statistics.median(values) for key, values in seconds.items()}
        fastest = max(img_s.values())
        for key, value in img_s.items():
            rows.append([name, batch, key + (" (auto)" if key == picked_name else ""), value,
                         value / fastest, flops * value / 1e9 / best_peak])
    report.table("Training img/s by precision and memory format (32 px)",
                 ["network", "batch", "candidate", "img/s", "ratio to fastest",
                  "share of matmul peak"], rows,
                 notes=[f"median step over {args.rounds} rounds, the candidates in turn each "
                        f"round; (auto): what --mixed-precision auto --channels-last auto chose "
                        f"in a separate probe (the start-up one: batch at most 32, 2 rounds)",
                        "share of matmul peak: training FLOPs per image (forward + backward, "
                        "torch's FLOP counter) x img/s / the faster matmul peak above"])
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
