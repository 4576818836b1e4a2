"""A CPU run's host memory: the CLI with its freed memory kept for the next step (its default
under glibc, train/host_memory.py) against the same command under glibc's own malloc settings,
measured side by side: img/s of the steady log windows and the process's minor page faults.

Arms (each a child process running the CLI's CPU recipe without its time budget, --steps steps,
alternating over --rounds rounds):
  kept            the CLI as shipped;
  glibc defaults  the same command with GLIBC_TUNABLES set empty in its environment: glibc
                  reads no setting from it, and the CLI, which leaves malloc alone wherever the
                  environment speaks of it, says "host memory: as the environment sets it".
                  (Not a MALLOC_* variable at its default value: setting any of them turns off
                  glibc's dynamic mmap threshold, which made that arm a third slower again.)
Page faults: the child's whole life (getrusage of the children), start-up and decoding
included, which both arms pay alike; per step, the difference is the steps'.

    python benchmarks/bench_host_memory.py --data-dir ../shared/data/cifar10
    python benchmarks/bench_host_memory.py --quick --max-train 512 --batch-size 64   # smoke
"""

from __future__ import annotations

import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

RECIPE = benchlib.REPO / "recipes" / "cifar10-cpu-10min.yaml"
ARMS = {"kept (the CLI's default)": {},
        "glibc defaults (GLIBC_TUNABLES set empty: left alone)": {"GLIBC_TUNABLES": ""}}


def one_run(args, recipe: Path, env_extra: dict, out: Path) -> dict:
    cmd = [sys.executable, "-m", "accel_train", "--config", recipe, "--data-dir", args.data_dir,
           "--select-on-test", "--progress", "log", "--no-plots", "--output-dir", out,
           "--epochs", "10", "--max-steps", str(args.steps), "--log-every", str(args.log_every),
           "--eval-every", "0", "--checkpoint-every", "0", "--max-eval-samples", "64",
           *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
           *(["--max-train-samples", str(args.max_train)] if args.max_train else []),
           "--sample-subset", "first"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    done = benchlib.run(cmd, env=benchlib.child_env(**env_extra), timeout=args.timeout)
    faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
    said = next((line.split("host memory: ", 1)[1] for line in done.stdout.splitlines()
                 if "host memory: " in line), "(not said)")
    windows = benchlib.steady_windows(benchlib.read_jsonl(out / "metrics.jsonl"))
    return {"img_per_s": benchlib.median([w["img_per_s"] for w in windows]), "faults": faults,
            "said": said}


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=0, help="0: the recipe's (1024)")
    parser.add_argument("--max-train", type=int, default=0, help="the first N images (0: all)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--tmp", default=None, help="folder for the runs")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.log_every, args.rounds = min(args.steps, 4), 2, 1
    benchlib.check_cifar(args.data_dir)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = benchlib.Report("host_memory", "A CPU run's host memory: kept or glibc's", args)
    work = Path(args.tmp or tempfile.mkdtemp(prefix="bench-host-memory-"))
    recipe = benchlib.recipe_without_budget(RECIPE, work / "recipe.yaml")
    results = {arm: [] for arm in ARMS}
    for number, order in enumerate(benchlib.round_orders(list(ARMS), args.rounds)):
        for arm in order:
            out = work / f"round{number}-{list(ARMS).index(arm)}"
            results[arm].append(one_run(args, recipe, ARMS[arm], out))
    kept_rate = benchlib.median([r["img_per_s"] for r in results[next(iter(ARMS))]])
    rows = []
    for arm, runs in results.items():
        rate = benchlib.median([r["img_per_s"] for r in runs])
        faults = benchlib.median([r["faults"] for r in runs])
        rows.append([arm, runs[0]["said"], rate, benchlib.spread([r["img_per_s"] for r in runs]),
                     f"{faults:,.0f}", f"{faults / args.steps:,.0f}", rate / kept_rate])
    report.table(f"The CPU recipe's network, {args.steps} steps a run, {args.rounds} rounds",
                 ["arm", "the summary's host memory line", "img/s (median of steady windows)",
                  "range over rounds", "minor page faults a run", "of which per step (upper "
                  "bound)", "ratio to kept"], rows,
                 notes=["img/s: metrics.jsonl's train windows after the first (start-up) one; "
                        "faults: the whole child process (start-up and decoding included, alike "
                        "in both arms), so a step's share is at most the run's over its steps"])
    report.data["runs"] = results
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
