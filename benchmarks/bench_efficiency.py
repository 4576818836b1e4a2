"""Where accel_train's training step spends its time, and its FLOP/s against this machine's own
matmul peak (model FLOP utilization, on a CPU).

accel_train trains the recipe's network as shipped (the CLI in this process: the recipe file's
options, precision and memory format chosen by `auto` as a user's run would, --max-steps N
instead of the time budget), with timers put around its parts from outside the package:
  data       from the end of one micro-batch's step to the trainer's per-micro-batch callback
             (waiting for the loader, and noting replaced images)
  forward    Trainer.train_step minus the two below: seeding, Mixup/CutMix, the forward pass
             and the loss under autocast, zeroing the gradients
  backward   Accelerator.backward (and DDP's all-reduce, with more than one process)
  optimizer  the optimizer's step (torch's global step hooks)
  rest       the remainder of each step: the schedule, EMA, heartbeats, logging, checkpoints
and, apart, the evaluations (Trainer.evaluate).  Steps after the first --skip are counted.

The efficiency table: training FLOPs per image (torch's FLOP counter, forward and backward) x the
counted steps' img/s, against a large matmul timed in this run in the precision the run used,
and in the faster of fp32 and bf16 (a figure in seconds holds on one machine; a share of the
machine's own peak holds on any).

    python benchmarks/bench_efficiency.py                 # the recipe on ../shared/data/cifar10
    python benchmarks/bench_efficiency.py --quick
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from bench_precision import matmul_gflops, training_flops_per_image  # noqa: E402

RECIPE = benchlib.REPO / "recipes" / "cifar10-cpu-10min.yaml"
PARTS = ("data", "forward", "backward", "optimizer", "rest")


class PartTimers:
    """Seconds per part for each optimizer step (one micro-batch per step: no accumulation)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.current = dict.fromkeys(PARTS, 0.0)
        self.evaluation = 0.0
        self.step_started = self.last_end = None

    def install(self):
        """Wrap the trainer's parts; returns the trainer's callbacks and an undo."""
        from accelerate import Accelerator
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)

        from accel_train import trainer as trainer_module

        originals = (trainer_module.Trainer.train_step, trainer_module.Trainer.evaluate,
                     Accelerator.backward)
        timers, optimizer_started = self, [0.0]

        def train_step(trainer, *args, **kwargs):
            started = time.perf_counter()
            before = (timers.current["backward"], timers.current["optimizer"])
            result = originals[0](trainer, *args, **kwargs)
            ended = time.perf_counter()
            inner = (timers.current["backward"] - before[0]
                     + timers.current["optimizer"] - before[1])
            timers.current["forward"] += ended - started - inner
            timers.last_end = ended
            return result

        def evaluate(trainer, *args, **kwargs):
            started = time.perf_counter()
            try:
                return originals[1](trainer, *args, **kwargs)
            finally:
                timers.evaluation += time.perf_counter() - started
                timers.last_end = None  # the next data wait is not a step's

        def backward(accelerator, *args, **kwargs):
            started = time.perf_counter()
            try:
                return originals[2](accelerator, *args, **kwargs)
            finally:
                timers.current["backward"] += time.perf_counter() - started

        def pre_hook(optimizer, args, kwargs):
            optimizer_started[0] = time.perf_counter()

        def post_hook(optimizer, args, kwargs):
            timers.current["optimizer"] += time.perf_counter() - optimizer_started[0]

        trainer_module.Trainer.train_step = train_step
        trainer_module.Trainer.evaluate = evaluate
        Accelerator.backward = backward
        handles = [register_optimizer_step_pre_hook(pre_hook),
                   register_optimizer_step_post_hook(post_hook)]

        def undo():
            (trainer_module.Trainer.train_step, trainer_module.Trainer.evaluate,
             Accelerator.backward) = originals
            for handle in handles:
                handle.remove()
        from accel_train.callbacks import Callback

        class StepStarts(Callback):
            def on_batch_start(self, trainer, batch) -> None:
                timers.batch_started()

        return [StepStarts()], undo

    def batch_started(self) -> None:
        """A micro-batch begins (the trainer's callback); one per optimizer step here."""
        now = time.perf_counter()
        if self.step_started is not None:     # the previous step ends where this one starts
            total = now - self.step_started
            self.current["rest"] = max(0.0, total - sum(self.current.values()))
            self.steps.append(dict(self.current, total=total))
        self.current = dict.fromkeys(PARTS, 0.0)
        if self.last_end is not None:
            self.current["data"] = now - self.last_end
        self.step_started = now


def recipe_without_budget(recipe: Path, out: Path, overrides: dict) -> Path:
    """The recipe's options with its time budget taken out (the bench counts steps)."""
    options = yaml.safe_load(recipe.read_text())
    options.pop("time_budget", None)
    options.update(overrides)
    path = out / "recipe-for-bench.yaml"
    path.write_text(yaml.safe_dump(options))
    return path


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("--model", default=None, help="instead of the recipe's network")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 150)")
    parser.add_argument("--skip", type=int, default=None, help="first steps not counted")
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--tmp", default=None, help="folder for the run (default: a temporary "
                                                   "one)")
    args = parser.parse_args()
    steps = args.steps or (4 if args.quick else 150)
    skip = args.skip if args.skip is not None else (1 if args.quick else 10)
    report = benchlib.Report("efficiency", "Where the step time goes, and the share of the "
                             "machine's peak", args)
    repeats = 3 if args.quick else 10
    from accel_train.train.precision import cpu_has_native_bf16

    peaks = {"fp32": matmul_gflops(torch.float32, args.matmul_size, repeats)}
    # Where bf16 is emulated a run never trains in it (auto keeps fp32), and the matmul alone
    # took 10 minutes at this size on an AVX2-only CPU: its peak is not this machine's.
    if cpu_has_native_bf16():
        peaks["bf16"] = matmul_gflops(torch.bfloat16, args.matmul_size, repeats)

    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        out = Path(tmp)
        overrides = {k: v for k, v in (("model", args.model), ("batch_size", args.batch_size))
                     if v is not None}
        recipe = recipe_without_budget(Path(args.recipe), out, overrides)
        run_dir = out / "run"
        timers = PartTimers()
        callbacks, undo = timers.install()
        from accel_train.cli import build_train_parser, config_from_args
        from accel_train.trainer import run_training
        config = config_from_args(build_train_parser().parse_args([
            "--config", str(recipe), "--data-dir", args.data_dir, "--max-steps", str(steps),
            "--output-dir", str(run_dir), "--progress", "log", "--no-plots", "--log-every", "10",
            *(["--max-eval-samples", "256"] if args.quick else [])]))
        try:
            started = time.perf_counter()
            code = run_training(config, callbacks)
            wall = time.perf_counter() - started
        finally:
            undo()
        if code != 0:
            print(f"accel_train exited {code}", file=sys.stderr)
            return code
        resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    options = resolved["train"]
    facts = resolved.get("resolved", {})
    counted = timers.steps[skip:] or timers.steps
    per_step = {part: sum(s[part] for s in counted) / len(counted) for part in (*PARTS, "total")}
    rows = [[part, 1000 * per_step[part], per_step[part] / per_step["total"]] for part in PARTS]
    rows.append(["step (all parts)", 1000 * per_step["total"], 1.0])
    report.table(f"Step time by part: {options['model']}, batch {options['batch_size']}, "
                 f"{facts.get('precision_used')}, "
                 f"{'channels_last' if facts.get('channels_last') else 'NCHW'}, "
                 f"steps {skip + 1}-{len(timers.steps)} of {steps}",
                 ["part", "ms/step", "share of the step"], rows,
                 notes=[f"precision and memory format: {facts.get('speed_choice')}",
                        f"evaluations: {timers.evaluation:.1f} s in all (outside the steps); "
                        f"the whole command took {wall:.0f} s"])

    import timm

    from accel_train.model import small_nets  # noqa: F401  (registers the recipe's networks)
    size = facts.get("model", {}).get("image_size") or 32
    flops = training_flops_per_image(timm.create_model(options["model"], num_classes=10), size)
    img_s = options["batch_size"] / per_step["total"]
    used = "bf16" if facts.get("precision_used") == "bf16" else "fp32"
    if used not in peaks:  # a recipe that asked for bf16 where it is emulated: its own peak
        peaks[used] = matmul_gflops(torch.bfloat16, args.matmul_size, repeats)
    achieved = flops * img_s / 1e9
    report.table("Model FLOP utilization: the steps' FLOP/s against this machine's matmul peak",
                 ["network", "training GFLOP/image", "img/s (counted steps)",
                  "achieved GFLOP/s", f"matmul peak {used} GFLOP/s (the run's precision)",
                  "MFU (run's precision)", "best matmul peak GFLOP/s", "MFU (best peak)"],
                 [[options["model"], flops / 1e9, img_s, achieved, peaks[used],
                   achieved / peaks[used], max(peaks.values()),
                   achieved / max(peaks.values())]],
                 notes=[f"matmul peak: a {args.matmul_size}x{args.matmul_size} matmul, the "
                        f"fastest of {repeats}; "
                        + ", ".join(f"{dtype} {gflops:,.0f}" for dtype, gflops in peaks.items())
                        + " GFLOP/s" + ("" if "bf16" in peaks else
                                        " (bf16 not timed: not native on this CPU)"),
                        "training FLOPs: torch's FLOP counter over one forward and backward, "
                        "fp32 (the count does not depend on the precision)"])
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
