"""--time-budget on a quiet machine and under a load that comes and goes: where training ends
against the budget, and the accuracy against a quiet run of the same number of steps.

Each arm runs the recipe file through the CLI on CIFAR-10, as users run it, with --budget
seconds.  "quiet" is the machine alone.  The loaded arms start CPU-hog processes (one busy loop
per core) at a time relative to the start of training (the summary's last line) and stop them
later: "load first" from 0 s for --hog-seconds, "load middle" from 40% of the budget for
--hog-seconds.  The precision and memory format the quiet arm's auto chose are pinned for the
others, so that only the budget's behaviour differs.

For each arm: "Training took" (the process's own line, every evaluation included) against the
budget, the steps fitted first and in the end, the number of fits recorded, what the last fit
set aside for the last epoch end against what the final evaluation took, and the final held-out
top-1.  A reference run per loaded arm (no budget, --max-steps = the steps the loaded
arm did, the machine quiet) gives the accuracy those steps reach without the load.

    python benchmarks/bench_budget.py                        # 180 s budgets, 60 s of load
    python benchmarks/bench_budget.py --budget 600 --hog-seconds 60
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

RECIPE = benchlib.REPO / "recipes" / "cifar10-cpu-10min.yaml"
TRAINING_STARTS = "  records:"  # the start-up summary's last line


def _spin() -> None:
    while True:
        pass


class Hog:
    """One busy process per core, started and stopped on a schedule."""

    def __init__(self):
        self.processes: list[multiprocessing.Process] = []

    def start(self) -> None:
        for _ in range(os.cpu_count() or 1):
            process = multiprocessing.Process(target=_spin, daemon=True)
            process.start()
            self.processes.append(process)

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
            process.join()
        self.processes = []


def run_arm(command: list[str], load: tuple[float, float] | None) -> tuple[str, float]:
    """Run `command`; with `load` = (start, length) in seconds after training starts, hog the
    cores meanwhile.  (its output, the seconds from training's start to the process's end)"""
    proc = benchlib.start_streaming(command, env=benchlib.child_env(), cwd=benchlib.REPO)
    lines, hog, timers, began = [], Hog(), [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if began is None and line.startswith(TRAINING_STARTS):
                began = time.monotonic()
                if load is not None:
                    timers = [threading.Timer(load[0], hog.start),
                              threading.Timer(load[0] + load[1], hog.stop)]
                    for timer in timers:
                        timer.start()
        proc.wait()
    finally:
        for timer in timers:
            timer.cancel()
        hog.stop()
    output = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}\n{output[-4000:]}")
    return output, time.monotonic() - (began or time.monotonic())


def summary(out: Path, output: str) -> dict:
    records = benchlib.read_jsonl(out / "metrics.jsonl")
    fits = [r for r in records if r["type"] == "budget"]
    epochs = [r for r in records if r["type"] == "epoch"]
    resolved = yaml.safe_load((out / "config.yaml").read_text())["resolved"]
    took = benchlib.TRAINING_TOOK.findall(output)
    return {"took": float(took[-1]) if took else float("nan"),
            "first_total": fits[0]["total_steps"] if fits else None,
            "steps": epochs[-1]["step"], "fits": len(fits),
            "top1": epochs[-1]["eval_top1"], "precision": resolved["precision_used"],
            # what the last fit set aside for the final evaluation, and what it took
            "eval_budgeted": fits[-1]["epoch_end_budgeted"] if fits else None,
            "eval_took": epochs[-1].get("eval_time"),
            "channels_last": resolved["channels_last"]}


def _seconds(value) -> str:
    return "" if value is None else f"{value:.1f}"


def main() -> None:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--budget", type=float, default=180.0, help="seconds per arm")
    parser.add_argument("--hog-seconds", type=float, default=60.0,
                        help="how long the load lasts in the loaded arms")
    parser.add_argument("--arms", nargs="+", default=["quiet", "load first", "load middle"],
                        choices=["quiet", "load first", "load middle"])
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the quiet runs of equal steps")
    parser.add_argument("--extra", default="", help="more training flags for every run")
    parser.add_argument("--tmp", default=None, help="folder for the runs (default: a new one)")
    args = parser.parse_args()
    benchlib.check_cifar(args.data_dir)
    report = benchlib.Report("budget", "The time budget under a load that comes and goes", args)
    work = Path(args.tmp or tempfile.mkdtemp(prefix="bench_budget_"))
    base = [sys.executable, "-m", "accel_train", "--config", str(RECIPE), "--data-dir",
            args.data_dir, "--progress", "log", "--no-plots", *args.extra.split()]
    loads = {"quiet": None, "load first": (0.0, args.hog_seconds),
             "load middle": (0.4 * args.budget, args.hog_seconds)}
    pinned: list[str] = []
    results = {}
    for arm in args.arms:
        out = work / arm.replace(" ", "_")
        output, _ = run_arm([*base, *pinned, "--time-budget", f"{args.budget:g}s",
                             "--output-dir", str(out)], loads[arm])
        results[arm] = summary(out, output)
        if not pinned:  # what auto chose on the quiet machine, for every later run
            chosen = results[arm]
            pinned = ["--mixed-precision", {"fp32": "no"}.get(chosen["precision"],
                                                              chosen["precision"]),
                      "--channels-last" if chosen["channels_last"] else "--no-channels-last"]
    references = {}
    if not args.no_reference:
        no_budget = work / "recipe-no-budget.yaml"
        recipe = yaml.safe_load(RECIPE.read_text())
        recipe.pop("time_budget", None)
        no_budget.write_text(yaml.safe_dump(recipe))
        for arm, result in results.items():
            if loads[arm] is None:
                continue
            out = work / f"reference_{arm.replace(' ', '_')}"
            command = [*base, *pinned, "--config", str(no_budget), "--epochs", "1000",
                       "--max-steps", str(result["steps"]), "--output-dir", str(out)]
            output, _ = run_arm(command, None)
            references[arm] = summary(out, output)
    rows = []
    for arm, result in results.items():
        reference = references.get(arm)
        rows.append([arm, f"{args.budget:g}", f"{result['took']:.1f}",
                     f"{result['took'] / args.budget:.3f}", result["first_total"],
                     result["steps"], result["fits"], _seconds(result["eval_budgeted"]),
                     _seconds(result["eval_took"]), f"{result['top1']:.2%}",
                     f"{reference['top1']:.2%}" if reference else "",
                     f"{100 * (result['top1'] - reference['top1']):+.2f}" if reference else ""])
    report.table("Training time against the budget, and accuracy against a quiet run of the "
                 "same steps",
                 ["arm", "budget s", "Training took s", "took / budget", "steps first fitted",
                  "steps done", "fits recorded", "last epoch end budgeted s",
                  "final evaluation took s", "top-1", "quiet, same steps", "points"], rows,
                 notes=[f"load: one busy process per core, for {args.hog_seconds:g} s from the "
                        f"start of training (load first) or from 40% of the budget (load "
                        f"middle)",
                        f"precision and memory format pinned after the quiet arm: "
                        f"{' '.join(pinned)}"])
    print(f"wrote {report.save()}")


if __name__ == "__main__":
    main()
