r"""GPU: do networks train in fp16, as --mixed-precision auto chooses on a GPU, beside bf16?

Each of --models trains --steps steps on CIFAR-10 at --image-size with the command line as a
user runs it (`python -m accel_train`, fp16's GradScaler with the optimizer's fused kernels),
in each of --precisions.  Per arm: the exit code (65 where the loss stayed NaN: the run stops
rather than train nothing), the first and last logged training loss, fp16's gradient scale at
the last record, the held-out top-1 and the wall time.  torchvision's GoogLeNet once gave a NaN
loss from its first steps in fp16 on an H200 (bf16 and fp32 trained), and the same network
trained in fp16 in a plain torch loop with torch's unfused SGD: the likely cause, fused SGD's
momentum left uninitialized by a first step the scaler skipped, is mended, and this check says
whether the mend holds on a GPU.
Needs a CUDA device: without one it says so in one line and exits 1.  `--allow-cpu` runs the
same code on the CPU (the embedded data; fp16 is fp32 there) so that tests keep it working;
its figures mean nothing.

    python benchmarks/bench_fp16_networks.py --data-dir ../shared/data/cifar10
    python benchmarks/bench_fp16_networks.py --quick --allow-cpu --models test_resnet
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402


def arm_command(args, model: str, precision: str, out: Path) -> list[str]:
    data = (["--dataset", "synthetic", "--synthetic-train-size", str(args.batch_size * 4)]
            if args.allow_cpu and not torch.cuda.is_available()
            else ["--data-dir", args.data_dir, "--max-train-samples",
                  str(args.batch_size * args.steps)])
    return [sys.executable, "-m", "accel_train", *data, "--model", model, "--image-size",
            str(args.image_size), "--batch-size", str(args.batch_size), "--max-steps",
            str(args.steps), "--log-every", str(max(1, args.steps // 3)), "--mixed-precision",
            precision, "--max-eval-samples", "256", "--progress", "log", "--no-plots",
            "--output-dir", str(out)]


def arm_row(args, model: str, precision: str, tmp: Path, seconds_left: float) -> list:
    out = tmp / f"{model.replace(':', '_').replace('.', '_')}-{precision}"
    timeout = min(args.arm_timeout, seconds_left)
    if timeout < 5:
        return [model, precision, "not run", "-", "-", "-", "-", "-",
                "--total-timeout spent by the arms before it"]
    started = time.perf_counter()
    # (not benchlib.run: an arm that exits 65, or runs out of time, is a result, not a
    # failure of this script)
    try:
        result = subprocess.run(arm_command(args, model, precision, out),
                                env=benchlib.child_env(), cwd=benchlib.REPO,
                                capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [model, precision, "timed out", "-", "-", "-", "-", f"{timeout:.0f}", ""]
    wall = time.perf_counter() - started
    records = benchlib.read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() \
        else []
    losses = [r.get("loss") for r in records if r.get("type") == "train"]
    # fp16's gradient scale at the last record: halved at each skipped step (a run whose
    # scale falls below 1e-4 stops with exit 65); bf16 has none
    scales = [r["loss_scale"] for r in records if "loss_scale" in r]
    evals = [r["eval_top1"] for r in records if r.get("type") == "epoch" and "eval_top1" in r]
    said = (result.stderr.strip().splitlines() or [""])[-1]
    return [model, precision, result.returncode, _loss(losses[0] if losses else None),
            _loss(losses[-1] if losses else None), f"{scales[-1]:g}" if scales else "-",
            f"{evals[-1]:.1%}" if evals else "-", f"{wall:.1f}",
            said[:160] if result.returncode else ""]


def _loss(value) -> str:
    """metrics.jsonl writes a NaN or infinite loss as null."""
    if value is None or not math.isfinite(value):
        return "NaN"
    return f"{value:.3f}"


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--models", nargs="+",
                        default=["torchvision.models:googlenet", "resnet18"])
    parser.add_argument("--precisions", nargs="+", default=["fp16", "bf16"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--arm-timeout", type=float, default=120, help="seconds an arm may take")
    parser.add_argument("--total-timeout", type=float, default=math.inf,
                        help="seconds all arms may take together: the arms after it are "
                             "reported as not run, and the table is still written (a caller's "
                             "own time limit would kill the script before it writes one)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU with the embedded data (to test this script)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        sys.exit("bench_fp16_networks: no CUDA device here; it checks fp16 training on a GPU "
                 "and runs only with one")
    if args.quick:
        args.steps, args.batch_size = min(args.steps, 3), min(args.batch_size, 16)
    report = benchlib.Report("fp16_networks", "GPU: networks in fp16 beside bf16", args)
    tmp = Path(tempfile.mkdtemp(prefix="bench-fp16-networks-"))
    deadline = time.perf_counter() + args.total_timeout
    rows = [arm_row(args, model, precision, tmp, deadline - time.perf_counter())
            for model in args.models for precision in args.precisions]
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        "CPU (--allow-cpu: fp16 runs fp32, no figures)"
    report.table(f"{name}: {args.steps} steps of {args.batch_size} at {args.image_size} px",
                 ["model", "precision", "exit", "first loss", "last loss", "loss scale",
                  "held-out top-1", "wall s", "last line (where it failed)"], rows)
    report.data["result"] = [{"model": r[0], "precision": r[1], "exit": r[2],
                              "first_loss": r[3], "last_loss": r[4], "loss_scale": r[5]}
                             for r in rows]
    print(f"wrote {report.save()}")
    shutil.rmtree(tmp, ignore_errors=True)  # the arms' run folders: their last lines are kept
    return 0


if __name__ == "__main__":
    sys.exit(main())
