r"""GPU: CIFAR-10 time to a target accuracy with a recipe file, and a SIGTERM + --resume auto in
the middle of a run, both through the CLI as users run them.

Arms:
  time to target   the recipe (default recipes/cifar10-gpu.yaml) with --compile and the
                   precision it leaves to auto (fp16 on CUDA); every line the run prints is
                   stamped on arrival, so the table gives, per epoch, the wall-clock time since
                   the command started (start-up, data decoding and compilation included), the
                   run's own training time (its epoch times summed) and the held-out top-1; the
                   summary names the first epoch at or above --target.
  stop and resume  the same recipe, --resume-epochs long, SIGTERM once --stop-after-epochs
                   epochs are done and a third of the next one has passed; the run must exit 143
                   having saved a checkpoint, and the same command with --resume auto must go on
                   from the step it stopped at and finish with exit 0.

Run on one NVIDIA H200 (BENCHMARKS.md, "GPU: one NVIDIA H200").  `--allow-cpu` runs the same
code on the CPU with the embedded data and a small model so that tests keep it working.

    python benchmarks/bench_gpu_cifar.py --data-dir ../shared/data/cifar10
    python benchmarks/bench_gpu_cifar.py --allow-cpu --quick
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

RECIPE = benchlib.REPO / "recipes" / "cifar10-gpu.yaml"
EPOCH_LINE = re.compile(r"Epoch (\d+)(?: Time ([\d.]+)s)?: eval loss \S+ top1 ([\d.]+)%")
STOPPED = re.compile(r"stopped by a signal at step (\d+)")
RESUMED = re.compile(r"resumed from .* at step (\d+)")


class StampedRun:
    """A CLI run whose output lines are stamped (seconds since its start) as they arrive."""

    def __init__(self, cmd: list[str], log: Path, environ: dict | None = None):
        self.started = time.perf_counter()
        self.lines: list[tuple[float, str]] = []
        self.epochs: list[dict] = []
        self.log = log.open("w")
        self.process = benchlib.start_streaming(cmd, env=benchlib.child_env(**(environ or {})),
                                                cwd=benchlib.REPO)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            at = time.perf_counter() - self.started
            self.lines.append((at, line.rstrip()))
            self.log.write(f"{at:9.2f} {line}")
            self.log.flush()
            match = EPOCH_LINE.search(line)
            if match:
                self.epochs.append({"epoch": int(match[1]), "wall_s": at,
                                    "epoch_s": float(match[2] or "nan"),
                                    "top1": float(match[3]) / 100})

    def wait(self, timeout: float) -> int:
        """The command's exit code, once its output has ended.  Sets `exited_s` (the process's
        own exit) and `closed_s` (the end of its output, later where a process it started,
        such as torch.compile's worker pool, inherited the output and outlived it), and
        `holders`: those processes' command lines, as they stood when the command exited."""
        code = self.process.wait(timeout=timeout)
        self.exited_s = time.perf_counter() - self.started
        self.holders: list[str] = []
        self.reader.join(timeout=1.0)
        if self.reader.is_alive():
            self.holders = output_holders(os.fstat(self.process.stdout.fileno()).st_ino)
            self.reader.join()
        self.closed_s = time.perf_counter() - self.started
        self.log.close()
        return code

    def find(self, pattern: re.Pattern) -> re.Match | None:
        return next((m for _, line in self.lines if (m := pattern.search(line))), None)

    def tail(self) -> str:
        return "\n".join(line for _, line in self.lines[-30:])


def output_holders(pipe_inode: int) -> list[str]:
    """The command lines of the processes, other than this one (the reading end), that hold
    the pipe `pipe_inode` open (Linux /proc; processes that vanish or are not ours to read are
    passed over)."""
    link, found = f"pipe:[{pipe_inode}]", []
    for proc in Path("/proc").glob("[0-9]*"):
        if proc.name == str(os.getpid()):
            continue
        try:
            if any(os.readlink(fd) == link for fd in (proc / "fd").iterdir()):
                words = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
                found.append(" ".join(" ".join(words).split())[:160])
        except OSError:
            continue
    return found


def cli(args, out: Path, *extra: str) -> list[str]:
    data = (["--dataset", "synthetic", "--model", "cifar_convnet_s", "--batch-size", "64",
             "--synthetic-train-size", "512", "--max-eval-samples", "128",
             "--learning-rate", "0.05", "--log-every", "2"]
            if args.allow_cpu
            else ["--data-dir", str(benchlib.check_cifar(args.data_dir))])
    return [sys.executable, "-m", "accel_train", "--config", str(args.recipe_file), *data,
            "--progress", "log", "--no-plots", "--output-dir", str(out), *extra]


def epoch_data_waits(metrics: Path) -> dict[int, float]:
    """Per epoch, the median share of its log windows' time the step waited for data
    (metrics.jsonl's train records; a window across an epoch's start counts in its own)."""
    by_epoch: dict[int, list[float]] = {}
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("type") == "train" and "data_wait" in record:
                by_epoch.setdefault(record["epoch"], []).append(record["data_wait"])
    return {epoch: statistics.median(waits) for epoch, waits in by_epoch.items()}


def time_to_target(args, report: benchlib.Report, work: Path) -> dict:
    extra = ["--compile"] if args.compile else []
    if args.epochs:
        extra += ["--epochs", str(args.epochs)]
    run = StampedRun(cli(args, work / "target", *extra), work / "target.log")
    code = run.wait(timeout=args.timeout)
    if code != 0:
        raise RuntimeError(f"the recipe run exited {code}:\n{run.tail()}")
    training = 0.0
    rows = []
    waits = epoch_data_waits(work / "target" / "metrics.jsonl")
    for record in run.epochs:
        training += record["epoch_s"]
        record["training_s"] = training
        record["data_wait"] = waits.get(record["epoch"])
        rows.append([record["epoch"], record["wall_s"], training, f"{record['top1']:.2%}",
                     "" if record["data_wait"] is None else f"{record['data_wait']:.1%}"])
    first = next((r for r in run.epochs if r["top1"] >= args.target), None)
    took = run.find(benchlib.TRAINING_TOOK)
    summary = (f"first epoch at or above {args.target:.0%}: "
               + (f"epoch {first['epoch']}, {first['wall_s']:.1f} s after the command started "
                  f"({first['training_s']:.1f} s of training)" if first else "none")
               + f"; final top-1 {run.epochs[-1]['top1']:.2%}; 'Training took' "
               + (f"{took[1]} s" if took else "not printed"))
    report.table(f"time to target: {args.recipe_file.name}"
                 f"{' --compile' if args.compile else ''}",
                 ["epoch", "wall s since start", "training s (epoch times summed)", "top-1",
                  "data wait (median of the epoch's log windows)"],
                 rows, notes=[summary])
    return {"epochs": run.epochs, "first_at_target": first, "training_took": took and took[1]}


def stop_and_resume(args, report: benchlib.Report, work: Path) -> dict:
    extra = ["--epochs", str(args.resume_epochs), *(["--compile"] if args.compile else [])]
    out = work / "resume"
    first = StampedRun(cli(args, out, *extra), work / "resume-1.log")
    while len(first.epochs) < args.stop_after_epochs and first.process.poll() is None:
        time.sleep(0.05)
    if first.epochs:
        epoch_s = first.epochs[-1]["epoch_s"]
        time.sleep(epoch_s / 3 if epoch_s == epoch_s else 1.0)
    first.process.send_signal(signal.SIGTERM)
    stopped_code = first.wait(timeout=args.timeout)
    stopped = first.find(STOPPED)
    second = StampedRun(cli(args, out, *extra, "--resume", "auto"), work / "resume-2.log")
    resumed_code = second.wait(timeout=args.timeout)
    resumed = second.find(RESUMED)
    result = {"stopped_exit": stopped_code, "stopped_step": stopped and int(stopped[1]),
              "resumed_exit": resumed_code, "resumed_step": resumed and int(resumed[1]),
              "final_top1": second.epochs[-1]["top1"] if second.epochs else None}
    ok = (stopped_code == 143 and resumed_code == 0 and stopped is not None
          and result["stopped_step"] == result["resumed_step"])
    report.table(f"SIGTERM after {args.stop_after_epochs} epochs and a third, then --resume "
                 f"auto ({args.resume_epochs} epochs in all)",
                 ["stopped: exit", "at step", "resumed: from step", "exit", "final top-1",
                  "steps lost"],
                 [[stopped_code, result["stopped_step"], result["resumed_step"], resumed_code,
                   f"{result['final_top1']:.2%}" if result["final_top1"] is not None else "n/a",
                   (result["stopped_step"] - result["resumed_step"])
                   if stopped and resumed else "n/a"]],
                 notes=["as expected: exit 143 with a checkpoint, resumed at that step, exit 0"
                        if ok else "NOT as expected: see the logs (resume-1.log, resume-2.log)"])
    if not ok:
        print(first.tail(), "\n---\n", second.tail(), file=sys.stderr)
    return {**result, "ok": ok}


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--recipe-file", type=Path, default=RECIPE)
    parser.add_argument("--target", type=float, default=0.94)
    parser.add_argument("--epochs", type=int, default=None,
                        help="override the recipe's epochs in the time-to-target arm")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        default=True)
    parser.add_argument("--resume-epochs", type=int, default=4)
    parser.add_argument("--stop-after-epochs", type=int, default=2)
    parser.add_argument("--arms", nargs="*", default=["target", "resume"],
                        choices=["target", "resume"])
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the runs and their stamped logs (default: a new "
                             "temporary folder)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU with the embedded data (to test this script)")
    args = parser.parse_args()
    if args.quick:
        args.epochs = args.epochs or 2
        args.resume_epochs, args.stop_after_epochs = 3, 1
    report = benchlib.Report("gpu_cifar", "GPU: CIFAR-10 time to accuracy, stop and resume",
                             args)
    if not torch.cuda.is_available() and not args.allow_cpu:
        report.note("Not run: this machine has no CUDA device.")
        report.save()
        return 0
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    report.note(f"device: {name}")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-gpu-cifar-"))
    work.mkdir(parents=True, exist_ok=True)
    if "target" in args.arms:
        report.data["target"] = time_to_target(args, report, work)
    if "resume" in args.arms:
        report.data["resume"] = stop_and_resume(args, report, work)
    print(f"wrote {report.save()} (logs in {work})")
    return 0 if report.data.get("resume", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
