r"""airbench94 itself and the accel_train CLI on the same machine, one after the other in one run:
the time the CLI takes to reach the accuracy airbench94's own loop reaches in 10 epochs, against
the time that loop takes, and their ratio (CLI / anchor).

Rows (a table each):
  GPU (where CUDA is; --allow-cpu runs its code on the CPU, to test this script)
    anchor  anchors/airbench_gpu.py --epochs 10 [--compile]: its training seconds T (airbench's
            timer: the whitening and each epoch's training loop, synchronized; no evaluation)
            and its top-1 after the 10 epochs with mirror TTA (airbench's level 1), A;
    CLI     recipes/cifar10-gpu-airbench.yaml for 10 epochs, then 12 where 10 missed A
            (--cli-epochs), with airbench's warmup share (the CPU recipe's settings, then), on
            all 50,000 training images (--select-on-test, as airbench trains) with the batches
            drawn on the GPU, evaluated at every epoch end with flip TTA (= mirror): the
            first epoch at or above A, the CLI's training seconds to it (metrics.jsonl's
            epoch_time summed), the same with its evaluations, the wall seconds from the
            command's start to that epoch's line, and the ratio to T, also counted from epoch
            2 on (the CLI compiles in its first epoch, the anchor in an untimed warm-up run).
  CPU (where CUDA is not, or --cpu-row)
    anchor  anchors/airbench_cpu.py --epochs 10: A as above, and T as airbench's timer counts
            it: the whitening, the 10 epochs' loops and the final evaluation with mirror TTA
            (the CLI's budget holds its final evaluation too);
    CLI     recipes/cifar10-cpu-10min.yaml with --time-budget T: its final top-1 with flip TTA
            against A;
    again   (--anchor-again) the anchor once more after the CLI: its timed s against T says how
            the machine's pace moved while the CLI ran (a shared machine's moves by half
            within minutes).
    The CPU anchor runs under glibc malloc's defaults, as published; --anchor-memory kept gives
    it the freed host memory kept that the CLI sets for itself (through GLIBC_TUNABLES).
  Both rows: --seed N seeds both arms (the anchor's --seed, the CLI's --seed), so A is the
  anchor's top-1 at that seed; airbench94 states its accuracy as a mean over runs, and one
  pair is one draw of each.

    python benchmarks/bench_anchor_side_by_side.py --data-dir ../shared/data/cifar10 --compile
    python benchmarks/bench_anchor_side_by_side.py --data-dir ../shared/data/cifar10 --anchor-again
    python benchmarks/bench_anchor_side_by_side.py --anchor-again --anchor-memory kept  # one malloc
    python benchmarks/bench_anchor_side_by_side.py --anchor-memory kept --seed 1       # a new draw
    python benchmarks/bench_anchor_side_by_side.py --quick --allow-cpu --cpu-row       # a smoke
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from accel_train.train.host_memory import NEVER_TRIM  # noqa: E402
from bench_gpu_cifar import StampedRun  # noqa: E402

GPU_RECIPE = benchlib.REPO / "recipes" / "cifar10-gpu-airbench.yaml"
CPU_RECIPE = benchlib.REPO / "recipes" / "cifar10-cpu-10min.yaml"
ANCHOR_EPOCH = re.compile(r"^epoch (\d+):")  # the anchors' line at each epoch end
# airbench's warmup share of the steps at any length, as the CPU recipe gives it (23%); the GPU
# recipe's warmup_epochs 2 is the shape of its 30 epochs
AIRBENCH_WARMUP = str(yaml.safe_load(CPU_RECIPE.read_text())["warmup_fraction"])
ANCHOR_TRAINED = re.compile(r"([\d.]+) s of training")  # in it: the training seconds so far
PRECISION = re.compile(r"precision (\S+?),")  # the CLI's start-up summary
STEPS_PER_EPOCH = re.compile(r"(\d+) steps/epoch")
# The anchor's host memory: airbench's loop as published runs under glibc malloc's defaults, which
# fault a CPU step's activations in anew every step; "kept" gives it, through glibc's tunables
# before it starts, what the CLI sets with mallopt from inside (train/host_memory.py).
ANCHOR_MEMORY = {"as-published": {},
                 "kept": {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:"
                                            f"glibc.malloc.trim_threshold={NEVER_TRIM}"}}


def shrink(args, anchor: bool) -> list[str]:
    """The smoke-run options, in the anchor's or the CLI's words."""
    names = (("--train-images", "--test-images") if anchor
             else ("--max-train-samples", "--max-eval-samples"))
    out = []
    for name, value in zip(names, (args.train_images, args.test_images)):
        out += [name, str(value)] if value else []
    if out and not anchor:  # the first N, as the anchor takes them
        out += ["--sample-subset", "first"]
    return out + (["--batch-size", str(args.batch_size)] if args.batch_size else [])


def run(cmd: list[str], log: Path, timeout: float, environ: dict | None = None) -> StampedRun:
    """`cmd` to its end, each output line stamped (seconds since its start) into `log`;
    `environ`: variables set for it beside the benchmark's own."""
    started = StampedRun([str(c) for c in cmd], log, environ)
    try:
        code = started.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        started.process.kill()
        raise
    if code != 0:
        raise RuntimeError(f"{shlex.join(map(str, cmd))} exited {code}:\n{started.tail()}")
    return started


def run_anchor(args, script: str, extra: list[str], log: Path,
               environ: dict | None = None) -> dict:
    cmd = [sys.executable, benchlib.ANCHORS / script, "--data-dir", args.data_dir, "--epochs",
           str(args.anchor_epochs), "--seed", str(args.seed), *shrink(args, anchor=True), *extra]
    done = run(cmd, log, args.timeout, environ)
    result = benchlib.last_json_line("\n".join(line for _, line in done.lines),
                                     key="training_seconds")
    result["command"] = [str(c) for c in cmd]  # (its JSON line does not say its seed)
    ends = [(int(m[1]), at) for at, line in done.lines if (m := ANCHOR_EPOCH.match(line))]
    result["wall_s"] = ends[-1][1] if ends else float("nan")
    so_far = [float(m[1]) for _, line in done.lines
              if ANCHOR_EPOCH.match(line) and (m := ANCHOR_TRAINED.search(line))]
    result["epoch_s"] = [b - a for a, b in zip([0.0] + so_far, so_far)]
    result["exit"] = ending(done)
    return result


def cli_launcher(args, recipe: Path) -> tuple[list, list[str]]:
    """How the CLI is started, and the batch options that go with it: one process, or
    (--cli-processes 2, a CPU row) two one-thread processes under `accelerate launch` with
    accelerate_configs/cpu_2proc.yaml, each with half the recipe's batch (the same global batch
    and learning rate; the recipe file says why a small network trains faster so).  The GPU
    row's CLI is always one process."""
    if args.cli_processes == 1 or recipe != CPU_RECIPE:
        return [sys.executable, "-m", "accel_train"], []
    batch = args.batch_size or yaml.safe_load(recipe.read_text())["batch_size"]
    accelerate = Path(sys.executable).parent / "accelerate"
    return ([accelerate, "launch", "--config_file",
             benchlib.REPO / "accelerate_configs" / "cpu_2proc.yaml", "-m", "accel_train"],
            ["--batch-size", str(batch // 2)])


def run_cli(args, recipe: Path, extra: list[str], out: Path, log: Path) -> dict:
    launcher, batch = cli_launcher(args, recipe)
    cmd = [*launcher, "--config", recipe, "--data-dir", args.data_dir,
           "--select-on-test", "--tta", "flip", "--progress", "log", "--no-plots",
           "--output-dir", out, "--seed", str(args.seed), *extra, *shrink(args, anchor=False),
           *batch, *shlex.split(args.cli_extra)]
    done = run(cmd, log, args.timeout)
    text = "\n".join(line for _, line in done.lines)
    epochs = [r for r in benchlib.read_jsonl(out / "metrics.jsonl") if r.get("type") == "epoch"]
    walls = {e["epoch"]: e["wall_s"] for e in done.epochs}
    training = evaluating = 0.0
    for record in epochs:
        training += record.get("epoch_time", 0.0)
        evaluating += record.get("eval_time", 0.0)
        record.update(training_s=training, with_eval_s=training + evaluating,
                      wall_s=walls.get(record["epoch"], float("nan")))
    precision, per_epoch = PRECISION.search(text), STEPS_PER_EPOCH.search(text)
    return {"epochs": epochs, "wall_s": done.lines[-1][0] if done.lines else float("nan"),
            "exit": ending(done),
            "precision": precision[1] if precision else "?",
            "steps_per_epoch": int(per_epoch[1]) if per_epoch else None,
            "network": json.loads((out / "config.json").read_text()).get("architecture", "?"),
            # the seed the run recorded (--cli-extra may give its own)
            "seed": yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"]}


def log_file(args, report: benchlib.Report, arm: str) -> Path:
    """Each command's stamped output, beside the table."""
    return Path(args.out) / f"{report.name}-{arm}.log"


def ending(done: StampedRun) -> dict:
    """When a finished command's process exited and its output ended, and which processes
    held the output past its exit."""
    return {"exited_s": done.exited_s, "closed_s": done.closed_s, "holders": done.holders}


def whole_commands(anchor: dict, cli: dict) -> str:
    """Where a command outlives its last line, or leaves processes holding its output."""
    def said(ending: dict) -> str:
        held = ending["closed_s"] - ending["exited_s"]
        return (f"{ending['exited_s']:.1f}"
                + (f" (its output held {held:.1f} s longer by: " + "; ".join(ending["holders"])
                   + ")" if ending["holders"] else ""))
    return (f"each command's whole wall s, from its start to its process's exit: the anchor "
            f"{said(anchor['exit'])}, the CLI {said(cli['exit'])}.")


def seeds(args, cli: dict) -> str:
    """Which draw of each arm the table is (the CLI's as its run recorded it)."""
    return (f"seeds: the anchor's {args.seed}, the CLI's {cli['seed']} (A is the anchor's top-1 "
            f"at its seed; one pair is one draw of each)")


def reached(record: dict, target: float) -> bool:
    """At or above `target`, to half an image: both top-1s are counts over the same images."""
    return "eval_top1" in record and record["eval_top1"] >= target - 0.5 / record["eval_count"]


def gpu_row(args, report: benchlib.Report, work: Path) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compile_flag = ["--compile"] if args.compile else []
    anchor = run_anchor(args, "airbench_gpu.py", ["--device", device, *compile_flag],
                        log_file(args, report, "gpu-anchor"))
    target, anchor_s = anchor["top1_tta1"], anchor["training_seconds"]
    anchor_later = sum(e["training_seconds"] for e in anchor["per_epoch"][1:])
    warmup = [] if args.recipe_warmup else ["--warmup-fraction", AIRBENCH_WARMUP]
    # A schedule reaches its accuracy at its end (the decay, the averaging handed over last):
    # each length is its own run, the next only where the one before missed A.
    runs, first = [], None
    for epochs in args.cli_epochs:
        cli = run_cli(args, GPU_RECIPE, ["--data-on-device", "always", "--eval-every", "1",
                                         "--epochs", str(epochs), *warmup, *compile_flag],
                      work / f"cli-gpu-{epochs}", log_file(args, report, f"gpu-cli-{epochs}"))
        first = next((r for r in cli["epochs"] if reached(r, target)), None)
        runs.append((epochs, cli, first))
        if first:
            break
    anchor_row = [f"airbench94, anchors/airbench_gpu.py: {anchor['precision']}",
                  f"{args.anchor_epochs:g}", f"{target:.2%}", anchor_s,
                  anchor["per_epoch"][0]["training_seconds"], "not timed", anchor["wall_s"],
                  "1 (the anchor)", "1 (the anchor)"]
    rows = [anchor_row] + [gpu_cli_row(cli, epochs, first, warmup, anchor_s, anchor_later)
                           for epochs, cli, first in runs]
    notes = [f"A = the anchor's top-1 after {args.anchor_epochs:g} epochs with mirror TTA, "
             f"{target:.2%}; without TTA {anchor['top1_tta0']:.2%}, with mirror + translate "
             f"{anchor['top1_tta2']:.2%}. Its training s are airbench's timer: the whitening and "
             f"each epoch's training loop (augmentation on the GPU included), synchronized; its "
             f"final mirror + translate evaluation ({anchor['tta2_eval_seconds']:.2f} s), which "
             f"airbench's printed total also counts, is left out like the CLI's evaluations.",
             "the CLI: the recipe for each number of epochs in turn (--cli-epochs), the next "
             "only where the one before missed A; "
             + ("its own warmup" if args.recipe_warmup else
                f"--warmup-fraction {AIRBENCH_WARMUP}, airbench's warmup share at any length "
                f"(the recipe's 2 epochs are its 30-epoch shape), so that its settings are the "
                f"CPU recipe's"),
             "the CLI's training s: metrics.jsonl's epoch_time summed (each epoch's steps and "
             "batch drawing; not its evaluations, checkpoints, start-up, whitening or decoding). "
             "That clock stops without a CUDA synchronize, so the GPU work queued after an "
             "epoch's last log line is counted in its evaluation: 'training + evaluation s' "
             "bounds the CLI's training time from above.",
             "precision: the anchor casts its model as airbench does; the CLI's is its "
             "start-up summary's (fp16 and bf16 are autocast over fp32 weights).",
             "wall s: from each command's start (decoding the images included) to the output "
             "line of the epoch at A, which comes after that epoch's evaluation; "
             + whole_commands(anchor, runs[-1][1]), seeds(args, runs[-1][1])]
    if args.compile:
        notes.append(f"--compile: the anchor compiled in an untimed warm-up run on random labels "
                     f"({anchor['warmup_seconds']} s, as airbench94_compiled.py), the CLI in its "
                     f"first epoch; 'ratio, epochs 2 on' leaves both first epochs out.")
    report.table(f"{'GPU' if device == 'cuda' else 'the GPU row on the CPU (a test)'}: the CLI "
                 f"to airbench94's own {args.anchor_epochs:g}-epoch accuracy A",
                 ["arm", "epochs to A", "top-1 there (mirror TTA)", "training s to A",
                  "of which epoch 1", "training + evaluation s to A",
                  "wall s from the command's start to A", "ratio CLI / anchor (training s)",
                  "ratio, epochs 2 on"],
                 rows, notes=notes)
    return {"anchor": anchor, "cli": runs[-1][1], "cli_epochs": [e for e, _, _ in runs],
            "target": target, "first_at_target": runs[-1][2]}


def gpu_cli_row(cli: dict, epochs: int, first: dict | None, warmup: list[str], anchor_s: float,
                anchor_later: float) -> list:
    """The GPU table's row of one CLI run: its first epoch at or above A, or its best."""
    name = (f"accel_train CLI, {GPU_RECIPE.name} --epochs {epochs} {' '.join(warmup)}".rstrip()
            + f": precision {cli['precision']}")
    if first:
        later = first["training_s"] - cli["epochs"][0]["training_s"]
        return [name, first["epoch"], f"{first['eval_top1']:.2%}", first["training_s"],
                cli["epochs"][0]["training_s"], first["with_eval_s"], first["wall_s"],
                first["training_s"] / anchor_s,
                later / anchor_later if first["epoch"] > 1 and anchor_later else "n/a"]
    best = max((r for r in cli["epochs"] if "eval_top1" in r), key=lambda r: r["eval_top1"])
    return [name, f"not reached in {epochs} (best {best['eval_top1']:.2%}, epoch "
            f"{best['epoch']})", "n/a", "n/a", cli["epochs"][0]["training_s"], "n/a", "n/a",
            "not reached", "not reached"]


def cpu_row(args, report: benchlib.Report, work: Path) -> dict:
    anchor = run_anchor(args, "airbench_cpu.py", [], log_file(args, report, "cpu-anchor"),
                        ANCHOR_MEMORY[args.anchor_memory])
    target, anchor_s = anchor["top1_tta1"], anchor["timed_seconds"]
    budget = f"{max(anchor_s, args.min_budget):.1f}s"
    cli = run_cli(args, CPU_RECIPE, ["--time-budget", budget], work / "cli-cpu",
                  log_file(args, report, "cpu-cli"))
    last = [r for r in cli["epochs"] if "eval_top1" in r][-1]
    steps = cli["epochs"][-1]["step"]
    epochs = f" ({steps / cli['steps_per_epoch']:.1f})" if cli["steps_per_epoch"] else ""
    timed = cli["epochs"][-1]["training_s"] + last.get("eval_time", 0.0)
    gap = 100 * (last["eval_top1"] - target)
    rows = [anchor_cpu_row(args, anchor, "(A)", "1 (the anchor)"),
            [f"accel_train CLI, {CPU_RECIPE.name} --time-budget {budget}"
             + (f", {args.cli_processes} processes" if args.cli_processes > 1 else ""),
             f"{cli['network']} ({cli['precision']})", f"{steps}{epochs}", timed,
             f"{last['eval_top1']:.2%}",
             "yes" if reached(last, target) else f"no ({gap:+.2f} points)", cli["wall_s"],
             timed / anchor_s]]
    again, pace_notes = None, []
    if args.anchor_again:
        # The same deterministic run again after the CLI: if its seconds moved, the machine's
        # pace moved under the CLI's arm, and a miss says as much about the machine as the CLI.
        again = run_anchor(args, "airbench_cpu.py", [], log_file(args, report, "cpu-anchor-again"),
                           ANCHOR_MEMORY[args.anchor_memory])
        drift = again["timed_seconds"] / anchor_s
        rows.append(anchor_cpu_row(args, again, "(A)" if again["top1_tta1"] == target
                                   else f"{again['top1_tta1']:.2%} (not A)",
                                   f"{drift:.3f} of T (the machine's pace)", "again, "))
        pace_notes = [f"the machine's pace: the anchor run again after the CLI took "
                      f"{drift:.3f} of its timed s before it (epochs "
                      + ", ".join(f"{sec:.0f}" for sec in again["epoch_s"]) + " s); "
                      "the CLI's arm ran between the two"]
    report.table(f"CPU: the CLI's CPU recipe in the anchor's timed seconds, against airbench94's "
                 f"own {args.anchor_epochs:g}-epoch accuracy A",
                 ["arm", "network (precision)", "steps (epochs)", "timed s",
                  "top-1 (mirror = flip TTA)", "reached A", "wall s from the command's start",
                  "ratio CLI / anchor (timed s)"], rows,
                 notes=[f"timed s: the anchor's is airbench's timer, the whitening "
                        f"({anchor['whitening_seconds']:.1f} s), the epochs' loops "
                        f"({anchor['training_seconds']:.1f} s) and the final mirror-TTA "
                        f"evaluation ({anchor['mirror_eval_seconds']:.1f} s), not the "
                        f"evaluations after each epoch; the CLI's: metrics.jsonl's epoch_time "
                        f"summed (its steps; the whitening is before them) and its final "
                        f"evaluation ({last.get('eval_time', 0.0):.1f} s), both inside its budget.",
                        "wall s: the anchor's to its last epoch line, the CLI's to its last "
                        "line (the model saved); " + whole_commands(anchor, cli),
                        "each epoch's training s, as the machine's pace moved from arm to arm "
                        "(a shared machine's can move by half within minutes): the anchor "
                        + ", ".join(f"{sec:.0f}" for sec in anchor["epoch_s"]) + "; the CLI "
                        + ", ".join(f"{r.get('epoch_time', 0.0):.0f}" for r in cli["epochs"])
                        + (f" ({cli['steps_per_epoch']} steps each, the last "
                           f"{steps - cli['steps_per_epoch'] * (len(cli['epochs']) - 1)})"
                           if cli["steps_per_epoch"] else ""),
                        *([f"the budget raised to --min-budget {args.min_budget:g} s: the "
                           f"ratio is not the anchor's time"]
                          if args.min_budget > anchor_s else []),
                        seeds(args, cli), *pace_notes])
    return {"anchor": anchor, "cli": cli, "target": target, "budget": budget,
            "anchor_again": again}


def anchor_cpu_row(args, anchor: dict, verdict: str, ratio, again: str = "") -> list:
    """The CPU table's row of an anchor run (the one before the CLI, or the one after it)."""
    memory = ", its freed host memory kept" if ANCHOR_MEMORY[args.anchor_memory] else ""
    return [f"airbench94, {again}anchors/airbench_cpu.py{memory}",
            f"airbench94 ({anchor['precision']})",
            f"{anchor['steps']} ({anchor['epochs']:g})", anchor["timed_seconds"],
            f"{anchor['top1_tta1']:.2%}", verdict, anchor["wall_s"], ratio]


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--anchor-epochs", type=float, default=10)
    parser.add_argument("--cli-epochs", type=int, nargs="+", default=[10, 12],
                        help="the GPU row's CLI schedules: a run of each length in turn, the "
                        "next only where the one before missed A (the recipe's own is 30)")
    parser.add_argument("--recipe-warmup", action="store_true",
                        help="the GPU row's CLI with its recipe's warmup (2 epochs) instead of "
                        f"airbench's share of each schedule (--warmup-fraction {AIRBENCH_WARMUP})")
    parser.add_argument("--compile", action="store_true", help="torch.compile in the GPU row "
                        "(both arms)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run the GPU row without CUDA, on the CPU (to test this script)")
    parser.add_argument("--cpu-row", action="store_true",
                        help="the CPU row also where CUDA is")
    parser.add_argument("--train-images", type=int, default=0,
                        help="only the first N training images, both arms (0: all)")
    parser.add_argument("--test-images", type=int, default=0,
                        help="only the first N test images, both arms (0: all)")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="both arms' batch (0: each one's own, 1024)")
    parser.add_argument("--min-budget", type=float, default=0.0,
                        help="the CPU row's budget at least this many seconds (--quick: 3; the "
                        "CLI times steps before it fits the budget and refuses one too short)")
    parser.add_argument("--cli-extra", default="", help="more options for the CLI runs")
    parser.add_argument("--cli-processes", type=int, choices=(1, 2), default=1,
                        help="the CPU row's CLI as one process, or two one-thread processes "
                        "under accelerate launch (accelerate_configs/cpu_2proc.yaml), each "
                        "with half the recipe's batch")
    parser.add_argument("--anchor-again", action="store_true",
                        help="the CPU row: run the anchor once more after the CLI, to read how "
                        "the machine's pace moved while the CLI ran (its timed s after / before)")
    parser.add_argument("--anchor-memory", choices=tuple(ANCHOR_MEMORY), default="as-published",
                        help="the CPU anchor under glibc malloc's defaults, as airbench's loop "
                        "is published, or with freed host memory kept as the CLI keeps its own "
                        "(the same settings through GLIBC_TUNABLES)")
    parser.add_argument("--seed", type=int, default=0,
                        help="both arms' seed (A is the anchor's top-1 at this seed)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per command")
    parser.add_argument("--tmp", default=None, help="folder for the CLI's runs (default: a "
                        "new temporary one)")
    args = parser.parse_args()
    if args.quick:  # a smoke run: the figures mean nothing
        args.anchor_epochs = min(args.anchor_epochs, 2)
        args.cli_epochs = list(dict.fromkeys(min(epochs, 4) for epochs in args.cli_epochs))
        args.train_images = args.train_images or 2048
        args.test_images = args.test_images or 500
        args.batch_size = args.batch_size or 256
        # (3 s was too short on a busy 2-core machine: the budget's pilot steps took it all)
        args.min_budget = args.min_budget or 10.0
    benchlib.check_cifar(args.data_dir)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = benchlib.Report("anchor_side_by_side", "airbench94 and the CLI, side by side", args)
    work = Path(args.tmp or tempfile.mkdtemp(prefix="bench-anchor-side-by-side-"))
    cuda = torch.cuda.is_available()
    if cuda or args.allow_cpu:
        report.data["gpu"] = gpu_row(args, report, work)
    if not cuda or args.cpu_row:
        report.data["cpu"] = cpu_row(args, report, work)
    print(f"wrote {report.save()} (the runs in {work}, the logs in {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
