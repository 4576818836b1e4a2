r"""GPU: whether the trainer's own loop lets the host run ahead of the device, step after step.

accel_train's trainer (`train_and_close`, what the command line runs, with a callback watching
each step through the public callbacks) trains CIFAR-10 held on the device (--data-on-device
always) with recipes/cifar10-gpu-airbench.yaml's network and settings, in --precision (auto:
fp16 on a GPU, Accelerate's GradScaler with the optimizer's fused kernels), for --warmup
unwatched steps and then --steps watched ones, all inside the first epoch: an epoch's end
evaluates and checkpoints, which wait for the device by design, and so does the log window's
`.item()` every --log-every steps, set here past the watched steps.  Over the watched steps:
  host ahead     steps at whose start the device was still running the step before (a CUDA
                 event recorded at each step's end, queried without waiting at the next one's
                 start).  A loop that waits for each step's end has none;
  syncs flagged  warnings of torch.cuda.set_sync_debug_mode("warn") (not every synchronizing
                 call is flagged: a lower bound), and the first one's text;
  steps/s        their wall rate;
  sync calls     then, over --profiled steps more under torch.profiler, the CUDA runtime's
                 synchronizing calls (cudaStreamSynchronize, cudaDeviceSynchronize,
                 cudaEventSynchronize, a blocking cudaMemcpy), counted: every one of them,
                 where the debug mode flags only some.  A loop with no host ahead and none
                 of these is bound by the host's own pace, not by a wait.
Needs a CUDA device: without one it says so in one line and exits 1.  `--allow-cpu` runs the
same code on the CPU (the embedded data, the host's clock for the events) so that tests keep
it working; its figures mean nothing.

    python benchmarks/bench_step_syncs.py --data-dir ../shared/data/cifar10
    python benchmarks/bench_step_syncs.py --quick --allow-cpu
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from bench_device_resident import (event, flagged_syncs, on_cuda, sync_debug,  # noqa: E402
                                   synchronize)

from accel_train.callbacks import Callback  # noqa: E402

RECIPE = benchlib.REPO / "recipes" / "cifar10-gpu-airbench.yaml"


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")  # cudaMemcpy alone, not cudaMemcpyAsync: the blocking copy


class WatchSteps(Callback):
    """Counts, over the steps after `warmup`, those whose start found the device still busy
    with the step before, and times them; sync warnings are on while it watches.  Then it
    profiles `profiled` steps more for the synchronizing calls (`sync_calls`)."""

    def __init__(self, warmup: int, steps: int, profiled: int = 0):
        self.warmup, self.last = warmup, warmup + steps
        self.profiled_last = self.last + profiled
        self.ahead = self.watched = 0
        self.step_done = None  # the event after the step before, while watching
        self.started = self.wall = 0.0
        self.profiler = None
        self.sync_calls: dict[str, int] = {}

    def on_batch_start(self, trainer, batch) -> None:
        if self.step_done is not None:
            self.ahead += not self.step_done.query()  # query() never waits
            self.watched += 1

    def on_step_end(self, trainer, step: int) -> None:
        if step == self.warmup:
            synchronize()
            sync_debug("warn")
            self.started = time.perf_counter()
        if self.warmup <= step < self.last:
            self.step_done = event()
            self.step_done.record()
        elif step == self.last:
            sync_debug("default")
            self.wall = time.perf_counter() - self.started
            self.step_done = None
            if self.profiled_last > self.last:
                self.profiler = torch.profiler.profile(activities=profiled_activities())
                self.profiler.start()
        elif step == self.profiled_last and self.profiler is not None:
            self.profiler.stop()
            for average in self.profiler.key_averages():
                if average.key in SYNC_CALLS:
                    self.sync_calls[average.key] = average.count
            self.profiler = None


def profiled_activities() -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    return activities + [torch.profiler.ProfilerActivity.CUDA] if on_cuda() else activities


def options(args, out: Path) -> dict:
    """The recipe's settings, the data on the device, the run cut to the watched steps."""
    recipe = yaml.safe_load(RECIPE.read_text())
    steps = args.warmup + args.steps + args.profiled
    data = ({"dataset": "synthetic", "synthetic_train_size": 64 * (steps + 1),
             "batch_size": 64} if args.allow_cpu and not on_cuda()
            else {"data_dir": args.data_dir, "batch_size": args.batch_size,
                  # all 50,000 training images: 48 steps of 1,024 in the first epoch
                  "select_on_test": True})
    return {**recipe, **data, "data_on_device": "always", "mixed_precision": args.precision,
            "max_steps": steps, "log_every": steps + 1, "eval_every": 0, "epochs": 1,
            "max_eval_samples": 256, "progress": "log", "plots": False, "output_dir": str(out)}


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--precision", default="auto", help="--mixed-precision of the run")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=35, help="watched steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps before them")
    parser.add_argument("--profiled", type=int, default=8, help="steps profiled after them "
                        "(all three inside the first epoch: 48 steps of CIFAR-10 at 1,024)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU with the embedded data (to test this script)")
    parser.add_argument("--tmp", default=None, help="folder for the run (default: a new "
                        "temporary one)")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup: at least 1 (the watching starts at the end of a step)")
    if not on_cuda() and not args.allow_cpu:
        sys.exit("bench_step_syncs: no CUDA device here; it watches the trainer's loop on a GPU "
                 "and runs only with one")
    if args.quick:
        args.steps, args.warmup, args.profiled = min(args.steps, 10), min(args.warmup, 3), \
            min(args.profiled, 3)
    from accel_train.config import TrainConfig
    from accel_train.trainer import train_and_close

    report = benchlib.Report("step_syncs", "GPU: does the trainer's loop let the host run ahead?",
                             args)
    out = Path(args.tmp or tempfile.mkdtemp(prefix="bench-step-syncs-")) / "run"
    config = TrainConfig.from_dict(options(args, out), source="bench_step_syncs")
    watch = WatchSteps(args.warmup, args.steps, args.profiled)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = train_and_close(config, [watch])
    if outcome.exit_code != 0 or watch.watched != args.steps or watch.profiler is not None:
        raise RuntimeError(f"the run exited {outcome.exit_code} after {watch.watched} watched "
                           f"steps of {args.steps} (and {args.profiled} to profile): an epoch "
                           f"shorter than {args.warmup + args.steps + args.profiled} steps?")
    flagged = flagged_syncs(caught)
    precision = yaml.safe_load((out / "config.yaml").read_text())["resolved"]["precision_used"]
    name = torch.cuda.get_device_name(0) if on_cuda() else "CPU (--allow-cpu: no figures)"
    report.table(f"{name}: {args.steps} watched steps after {args.warmup}, "
                 f"{RECIPE.name} with --data-on-device always",
                 ["precision", "host ahead", "syncs flagged", "steps/s (wall)",
                  f"sync calls in {args.profiled} profiled steps"],
                 [[precision, f"{watch.ahead} / {watch.watched}", len(flagged),
                   args.steps / watch.wall,
                   ", ".join(f"{name} {count}" for name, count in watch.sync_calls.items())
                   or "none"]],
                 notes=[f"first flagged sync: {str(flagged[0].message)[:200]}"] if flagged
                 else [])
    report.data["result"] = {"precision": precision, "host_ahead": watch.ahead,
                             "watched": watch.watched, "syncs_flagged": len(flagged),
                             "sync_calls": watch.sync_calls}
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
