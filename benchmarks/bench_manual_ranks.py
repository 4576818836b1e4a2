"""Ranks started by hand on one machine: two `python -m accel_train --world_size 2 --rank R
--dist_url tcp://...` processes, each with every core's thread (what torch and Accelerate gave
them: OMP_NUM_THREADS set to the core count here, as before the product divided the cores)
against the product's own choice (OMP_NUM_THREADS unset: the machine's cores divided among its
ranks, as torchrun and accelerate launch do for their workers).

Each cell is one pair training --steps steps of --model at 32 px on the embedded synthetic
set; the arms alternate over --rounds rounds; the table gives the median img/s of the steady
log windows (metrics.jsonl, the first window left out) and the ratio to the every-core arm.

    python benchmarks/bench_manual_ranks.py --quick
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

CORES = len(os.sched_getaffinity(0))
ARMS = {f"every rank {CORES} threads (OMP_NUM_THREADS={CORES})": str(CORES),
        "cores divided among the ranks (OMP_NUM_THREADS unset)": None}
ARM_NAMES = dict(zip(("every-core", "divided"), ARMS))  # --arms


def pair(args, omp, out: Path) -> float:
    """Median img/s of one manual pair's steady windows."""
    env = benchlib.child_env()
    env.pop("OMP_NUM_THREADS", None)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    url = f"tcp://127.0.0.1:{benchlib.free_port()}"
    common = [sys.executable, "-m", "accel_train", "--dataset", "synthetic", "--model",
              args.model, "--image-size", "32", "--batch-size", "32", "--max-steps",
              str(args.steps), "--log-every", str(args.log_every), "--progress", "log",
              "--no-plots", "--mixed-precision", "no", "--no-channels-last",
              "--max-eval-samples", "64", "--output-dir", str(out), "--world_size", "2",
              "--dist_url", url]
    ranks = [subprocess.Popen([*common, "--rank", str(rank)], cwd=benchlib.REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [rank.communicate(timeout=1800)[0] for rank in ranks]
    if any(rank.returncode for rank in ranks):
        raise RuntimeError(f"a rank failed:\n{outputs[0][-3000:]}\n{outputs[1][-3000:]}")
    windows = benchlib.steady_windows(benchlib.read_jsonl(out / "metrics.jsonl"))
    return benchlib.median([w["img_per_s"] for w in windows])


def main() -> None:
    parser = benchlib.make_parser(__doc__, data_dir=None, data_help="unused (embedded data)")
    parser.add_argument("--model", default="resnet10t")
    parser.add_argument("--steps", type=int, help="steps a pair trains (default: 120, "
                        "--quick 60)")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", nargs="+", choices=list(ARM_NAMES), default=list(ARM_NAMES),
                        help="which arms to run (the ratio is to the first of them)")
    args = parser.parse_args()
    arms = {ARM_NAMES[name]: ARMS[ARM_NAMES[name]] for name in dict.fromkeys(args.arms)}
    args.steps = args.steps or (60 if args.quick else 120)
    if args.quick:
        args.rounds = 1
    report = benchlib.Report("manual_ranks", "Two ranks started by hand on one machine", args)
    work = Path(args.out) / "manual_ranks_runs"
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    for round_number, order in enumerate(benchlib.round_orders(list(arms), args.rounds)):
        for arm in order:
            out = work / f"round{round_number}-{list(ARMS).index(arm)}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            rates[arm].append(pair(args, arms[arm], out))
            print(f"round {round_number}: {arm}: {rates[arm][-1]:.0f} img/s", flush=True)
    base = benchlib.median(rates[next(iter(arms))])
    report.table(f"{args.model} at 32 px, batch 32 a rank, {args.steps} steps, fp32 NCHW, "
                 f"{args.rounds} round(s)",
                 ["threads", "img/s (median)", "spread", "ratio"],
                 [[arm, f"{benchlib.median(r):.0f}", benchlib.spread(r),
                   f"{benchlib.median(r) / base:.2f}"] for arm, r in rates.items()])
    report.save()


if __name__ == "__main__":
    main()
