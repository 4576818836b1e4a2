"""Time to accuracy on CPU: CIFAR-10 test top-1 reached within a fixed wall-clock budget of
training by accel_train (its defaults, and recipes tried for better defaults) and by the seed
tutorial's hand-written loop given the same budget.

The budget counts the training loop only: evaluation (which both do on the full 10,000-image
test split) and process start-up are outside it.  The seed loop checks the clock after every
step and stops when the budget is spent.  accel_train's learning-rate schedule needs its length
up front, so each recipe is first timed for --pilot-steps steps through the CLI and
then run with --max-steps = budget x measured img/s / batch; its training time is read back from
metrics.jsonl (the sum of its log windows) and printed beside the budget, so an over- or
under-run caused by other load on the machine is visible.

A recipe file (`--recipe-file recipes/cifar10-cpu-10min.yaml`) runs as users run it: through
the CLI with --config, its own --time-budget fitting the schedule (or --budget's, which replaces
it); the training time is the process's own "Training took" line, evaluations included.

    python benchmarks/bench_accuracy.py --quick            # 60 s budgets, 2,000 test images
    python benchmarks/bench_accuracy.py --budget 600       # the 10-minute comparison
    python benchmarks/bench_accuracy.py --recipe-file recipes/cifar10-cpu-10min.yaml --no-seed \
        --recipes                                          # the recipe as it ships (10 minutes)
    python benchmarks/bench_accuracy.py --quick --recipe-file recipes/cifar10-cpu-10min.yaml
"""

from __future__ import annotations

import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

SEED_SCRIPT = benchlib.ANCHORS / "seed_tutorial.py"
LOG_EVERY = 10

# Named accel_train recipes: extra CLI flags on top of the defaults.
RECIPES = {
    "defaults": [],
    "warmup 0.1 epoch": ["--warmup-epochs", "0.1"],
    "warmup 0.1 + channels_last": ["--warmup-epochs", "0.1", "--channels-last"],
    "resnet10t, warmup 0.1": ["--model", "resnet10t", "--warmup-epochs", "0.1"],
    "batch 128 lr 0.1, warmup 0.1": ["--batch-size", "128", "--learning-rate", "0.1",
                                     "--warmup-epochs", "0.1"],
    "resnet18 at 64 px, warmup 0.1": ["--image-size", "64", "--warmup-epochs", "0.1"],
}


def pilot_rate(flags: list[str], args, work: Path) -> float:
    """Steady-state img/s of this recipe, measured the way the real run will go: the CLI in a
    fresh process, --pilot-steps steps in windows of 10, the first window (start-up) dropped,
    the median of the rest.  (An in-process pilot of a few steps read 20-60% off the CLI's rate
    on this machine, and the budgets came out uneven.)"""
    out = work / f"pilot-{time.time_ns()}"
    steps = max(2 * LOG_EVERY, args.pilot_steps // LOG_EVERY * LOG_EVERY)
    benchlib.run([sys.executable, "-m", "accel_train", "--data-dir", args.data_dir,
                  "--output-dir", str(out), "--max-steps", str(steps), "--log-every",
                  str(LOG_EVERY), "--max-eval-samples", "64", "--progress", "log", "--no-plots",
                  *flags], env=benchlib.child_env(), timeout=1800)
    windows = benchlib.steady_windows(benchlib.read_jsonl(out / "metrics.jsonl"))
    return benchlib.median([w["img_per_s"] for w in windows])


def recipe_flags(name: str, args) -> list[str]:
    flags = list(RECIPES[name])
    if args.model:  # a recipe that names its own model keeps it (later flags win)
        flags = ["--model", args.model, *flags]
    if args.max_train:
        flags += ["--max-train-samples", str(args.max_train)]
    return flags + ["--sample-subset", "first"]  # the first N, as the seed loop takes them


def accel_arm(name: str, args, work: Path) -> dict:
    flags = recipe_flags(name, args)
    rate = pilot_rate(flags, args, work)
    batch = int(flags[flags.index("--batch-size") + 1]) if "--batch-size" in flags else 64
    steps = max(LOG_EVERY, int(args.budget * rate / batch) // LOG_EVERY * LOG_EVERY)
    out = work / f"run-{len(list(work.iterdir()))}"
    cmd = [sys.executable, "-m", "accel_train", "--data-dir", args.data_dir, "--output-dir",
           str(out), "--max-steps", str(steps), "--epochs", "1000", "--log-every",
           str(LOG_EVERY), "--progress", "log", "--no-plots", *flags]
    if args.eval_samples:
        cmd += ["--max-eval-samples", str(args.eval_samples)]
    started = time.perf_counter()
    benchlib.run(cmd, env=benchlib.child_env(), timeout=args.budget * 6 + 900)
    wall = time.perf_counter() - started
    records = benchlib.read_jsonl(out / "metrics.jsonl")
    train_seconds, previous = 0.0, 0
    for record in records:
        if record.get("type") == "train":
            train_seconds += (record["samples_seen"] - previous) / record["img_per_s"]
            previous = record["samples_seen"]
    final = [r for r in records if r.get("type") == "epoch"][-1]
    return {"top1": final["eval_top1"], "train_s": train_seconds, "samples": previous,
            "steps": steps, "pilot_img_per_s": rate, "wall_s": wall}


def recipe_file_arm(path: str, args, work: Path, budget_given: bool) -> dict:
    out = work / f"run-{len(list(work.iterdir()))}"
    cmd = [sys.executable, "-m", "accel_train", "--config", path, "--data-dir", args.data_dir,
           "--output-dir", str(out), "--log-every", str(LOG_EVERY), "--progress", "log",
           "--no-plots"]
    if budget_given:
        cmd += ["--time-budget", f"{args.budget:g}"]
    if args.eval_samples:
        cmd += ["--max-eval-samples", str(args.eval_samples)]
    if args.max_train:
        cmd += ["--max-train-samples", str(args.max_train)]
    cmd += ["--sample-subset", "first"]  # the first N, as the seed loop takes them
    cmd += shlex.split(args.recipe_file_extra)
    started = time.perf_counter()
    output = benchlib.run(cmd, env=benchlib.child_env(), timeout=7200).stdout
    wall = time.perf_counter() - started
    records = benchlib.read_jsonl(out / "metrics.jsonl")
    final = [r for r in records if r.get("type") == "epoch"][-1]
    trains = [r for r in records if r.get("type") == "train"]
    last = trains[-1] if trains else {"samples_seen": 0, "step": 0}
    fixed = [r for r in records if r.get("type") == "budget"]
    took = benchlib.TRAINING_TOOK.search(output)
    windows = benchlib.steady_windows(records)
    return {"top1": final["eval_top1"], "ema_top1": final.get("eval_ema_top1"),
            "train_s": float(took.group(1)) if took else float("nan"),
            "samples": last["samples_seen"], "steps": last["step"],
            "step_ms": 1000 * fixed[0]["step_seconds"] if fixed else float("nan"),
            "pilot_img_per_s": benchlib.median([w["img_per_s"] for w in windows]),
            "wall_s": wall}


def seed_arm(args) -> dict:
    cmd = [sys.executable, str(SEED_SCRIPT), "--mode", "standalone", "--data-dir",
           args.data_dir, "--data", "decode", "--model", args.seed_model, "--optimizer", "adam",
           "--lr", "0.01", "--batch-size", "64", "--epochs", "1000", "--workers",
           str(args.workers), "--time-budget", str(args.budget), "--eval", "--log-every",
           "1000000"]
    if args.eval_samples:
        cmd += ["--max-eval-samples", str(args.eval_samples)]
    if args.max_train:
        cmd += ["--max-train-samples", str(args.max_train)]
    started = time.perf_counter()
    result = benchlib.last_json_line(benchlib.run(cmd, env=benchlib.child_env(),
                                                  timeout=args.budget * 3 + 900).stdout)
    return {"top1": result["top1"], "train_s": result["total_s"], "samples": result["samples"],
            "steps": result["steps"], "pilot_img_per_s": float("nan"),
            "wall_s": time.perf_counter() - started}


def recipe_notes(args) -> list[str]:
    return ["all: resnet18 unless named, 32 px, full 50,000-image training set, top-1 on the "
            f"first {args.eval_samples or 10_000:,} images of the test split",
            "seed loop: the tutorial's recipe (Adam 0.01, batch 64, ToTensor only, PIL decode "
            "per sample in 2 workers) on the same model",
            "accel_train defaults: SGD Nesterov 0.05, warmup 1 epoch then cosine to the end of "
            "--max-steps, label smoothing 0.1, random crop + flip, data decoded once; recipes: "
            f"{RECIPES}"]


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--budget", type=float, default=None, help="seconds of training")
    parser.add_argument("--recipes", nargs="*", default=None, choices=list(RECIPES))
    parser.add_argument("--model", default=None, help="accel_train's model for every recipe "
                        "that does not name one (default: accel_train's default, resnet18)")
    parser.add_argument("--max-train", type=int, default=None,
                        help="train on the first N images only (default: all 50,000)")
    parser.add_argument("--seed-model", default="resnet18",
                        help="the seed loop's model (the article: resnet50d at 336 px)")
    parser.add_argument("--no-seed", action="store_true", help="skip the seed loop")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pilot-steps", type=int, default=None)
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="test images evaluated (default: all 10,000; --quick: 2,000)")
    parser.add_argument("--recipe-file", action="append", default=[],
                        help="a recipes/*.yaml run through the CLI with --config (repeatable); "
                             "its own --time-budget unless --budget or --quick is given")
    parser.add_argument("--recipe-file-extra", default="", metavar="'FLAGS'",
                        help="more accel-train flags for the recipe-file runs (a smoke run's "
                             "--max-steps, say), after the file's")
    parser.add_argument("--tmp", default=tempfile.gettempdir())
    args = parser.parse_args()
    benchlib.check_cifar(args.data_dir)
    budget_given = args.budget is not None or args.quick
    args.budget = args.budget or (60.0 if args.quick else 600.0)
    if args.eval_samples is None and args.quick:
        args.eval_samples = 2000
    if args.recipes is None:  # "--recipes" with no names: the recipe files only
        args.recipes = (["defaults", "warmup 0.1 epoch"] if args.quick
                        else ["defaults", "warmup 0.1 epoch", "warmup 0.1 + channels_last"])
    args.pilot_steps = args.pilot_steps or (30 if args.quick else 60)
    report = benchlib.Report("accuracy", f"Time to accuracy on CPU ({args.budget:.0f} s of "
                             f"training)", args)
    work = Path(tempfile.mkdtemp(prefix="bench-accuracy-", dir=args.tmp))
    results = {}
    if not args.no_seed:
        results["seed's hand-written loop (Adam 0.01, no augmentation)"] = seed_arm(args)
    for name in args.recipes:
        results[f"accel_train: {name}"] = accel_arm(name, args, work)
    if results:
        rows = [[name, f"{r['top1']:.2%}", r["train_s"], r["samples"], r["samples"] / 50_000,
                 r["steps"], r["pilot_img_per_s"], r["wall_s"]] for name, r in results.items()]
        report.table(f"CIFAR-10 test top-1 after {args.budget:.0f} s of training",
                     ["run", "test top-1", "training s", "images seen", "epochs", "steps",
                      "pilot img/s", "process wall s"], rows, notes=recipe_notes(args))
    files = {path: recipe_file_arm(path, args, work, budget_given) for path in args.recipe_file}
    if files:
        budget = f"--time-budget {args.budget:g}" if budget_given else "each file's --time-budget"
        report.table(f"CIFAR-10 test top-1 of recipe files ({budget})",
                     ["recipe file", "test top-1", "EMA top-1", "training s (with evals)",
                      "images seen", "epochs", "steps", "measured ms/step", "median img/s",
                      "process wall s"],
                     [[path, f"{r['top1']:.2%}",
                       "-" if r["ema_top1"] is None else f"{r['ema_top1']:.2%}", r["train_s"],
                       r["samples"], r["samples"] / 50_000, r["steps"], r["step_ms"],
                       r["pilot_img_per_s"], r["wall_s"]] for path, r in files.items()],
                     notes=["run as `accel-train --config FILE --data-dir ...`; the budget fixes "
                            "the step count after measuring (budget.py); top-1 on the first "
                            f"{args.eval_samples or 10_000:,} images of the test split"])
        results.update({f"file: {path}": r for path, r in files.items()})
    report.data["result"] = results
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
