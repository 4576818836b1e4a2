"""Scaling: 1 process against 2 processes (DDP over gloo) on the same global batch, with and
without gradient accumulation; accel_train under the real launcher (`accelerate launch` with
accelerate_configs/cpu_2proc.yaml) against the seed tutorial's hand-written DDP script
(DistributedSampler + DDP + plain loop, under torchrun) on identical settings; and the DDP knobs.

Identical settings for both: the same timm model and seed, CIFAR-10 decoded once into memory
(the first --max-train images), no augmentation (accel_train --no-augment; the script has none),
SGD with Nesterov momentum 0.9 and weight decay 5e-4, label smoothing 0.1, the same global batch
(--global-batch = per-process batch x processes x accumulation steps), --steps optimizer steps,
well inside the first epoch (no evaluation or checkpoint inside the measured windows).  Threads:
OMP_NUM_THREADS = cores / processes for every arm.

Throughput is measured the same way in both programs: images per second over windows of
--log-every optimizer steps (accel_train's metrics.jsonl; the script prints the same), the
first window dropped, the median of the rest.  The accel_train / hand-written pairs run in
alternating order over --rounds rounds and each round gives a ratio.

    python benchmarks/bench_scaling.py --quick
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

SEED_SCRIPT = benchlib.ANCHORS / "seed_tutorial.py"
# The hand-written script uses DDP's own defaults; accel_train turns gradient_as_bucket_view on
# by default.  "Identical settings" means DDP's defaults here, and the knob arm measures the flag
# (an arm's own flags come later on the command line and win).
DDP_AS_THE_ANCHOR = ("--no-ddp-grad-as-bucket-view",)


class Arm:
    def __init__(self, name: str, program: str, procs: int, accum: int = 1,
                 flags: tuple[str, ...] = (), hand_flags: tuple[str, ...] = ()):
        self.name, self.program, self.procs, self.accum = name, program, procs, accum
        self.flags, self.hand_flags = flags, hand_flags


def arms_for(args) -> list[Arm]:
    arms = [Arm("accel_train, 1 process", "accel_train", 1),
            Arm("accel_train, 2 processes", "accel_train", 2),
            Arm("hand-written DDP, 2 processes", "hand", 2),
            Arm("accel_train, 2 processes, accumulation 2", "accel_train", 2, accum=2),
            Arm("hand-written DDP, 2 processes, accumulation 2", "hand", 2, accum=2)]
    if not args.quick:
        arms[1:1] = [Arm("hand-written, 1 process", "hand", 1)]
        arms.append(Arm("accel_train, 1 process, accumulation 2", "accel_train", 1, accum=2))
    return arms


def knob_arms(args) -> list[Arm]:
    knobs = [Arm("2 processes, --ddp-bucket-mb 1", "accel_train", 2,
                 flags=("--ddp-bucket-mb", "1")),
             Arm("2 processes, --ddp-bucket-mb 100", "accel_train", 2,
                 flags=("--ddp-bucket-mb", "100")),
             Arm("2 processes, --ddp-grad-as-bucket-view (accel_train's default)", "accel_train", 2,
                 flags=("--ddp-grad-as-bucket-view",)),
             Arm("2 processes, --ddp-static-graph", "accel_train", 2,
                 flags=("--ddp-static-graph",)),
             Arm("2 processes, --channels-last", "accel_train", 2, flags=("--channels-last",))]
    if args.compile:
        knobs.append(Arm("2 processes, --compile", "accel_train", 2, flags=("--compile",)))
    return knobs


def run_arm(arm: Arm, args, work: Path) -> dict:
    cores = os.cpu_count() or 1
    threads = max(1, cores // arm.procs)
    env = benchlib.child_env(threads=threads)
    per_process = args.global_batch // (arm.procs * arm.accum)
    port = benchlib.free_port()
    out = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    if arm.program == "accel_train":
        launcher = (benchlib.accelerate_launch(arm.procs, port) if arm.procs > 1
                    else [sys.executable])
        cmd = [*launcher, "-m", "accel_train", "--data-dir", args.data_dir, "--output-dir",
               str(out / "run"), "--model", args.model, "--batch-size", str(per_process),
               "--accumulation-steps", str(arm.accum), "--max-train-samples", str(args.max_train),
               "--max-eval-samples", "128", "--max-steps", str(args.steps), "--log-every",
               str(args.log_every), "--no-augment", "--progress", "log", "--no-plots",
               *DDP_AS_THE_ANCHOR, *benchlib.FIXED_COMPUTE, *arm.flags]
        benchlib.run(cmd, env=env)
        windows = benchlib.steady_windows(benchlib.read_jsonl(out / "run" / "metrics.jsonl"))
        rates = [w["img_per_s"] for w in windows]
    else:
        launcher = benchlib.torchrun(arm.procs, port) if arm.procs > 1 else [sys.executable]
        mode = "ddp" if arm.procs > 1 else "standalone"
        cmd = [*launcher, str(SEED_SCRIPT), "--mode", mode, "--data-dir", args.data_dir,
               "--data", "memory", "--model", args.model, "--batch-size", str(per_process),
               "--accumulation-steps", str(arm.accum), "--max-train-samples", str(args.max_train),
               "--epochs", "1", "--max-steps", str(args.steps), "--log-every", str(args.log_every),
               "--optimizer", "sgd", "--lr", "0.05", "--label-smoothing", "0.1", *arm.hand_flags]
        result = benchlib.last_json_line(benchlib.run(cmd, env=env).stdout)
        rates = result["img_per_s_windows"][1:] or result["img_per_s_windows"]
    return {"img_per_s": benchlib.median(rates), "windows": rates, "threads": threads,
            "per_process_batch": per_process}


def measure_knobs(args, arms: list[Arm], work: Path, report) -> dict:
    """Each knob against the defaults in the same round (rounds in shifting order), so that a
    change in the machine's load between runs does not pass for an effect of the knob."""
    defaults = next(a for a in arms if a.name == "accel_train, 2 processes")
    candidates = [defaults, *knob_arms(args)]
    runs: dict[str, list[dict]] = {a.name: [] for a in candidates}
    for order in benchlib.round_orders([a.name for a in candidates], args.knob_rounds):
        for name in order:
            runs[name].append(run_arm(next(a for a in candidates if a.name == name), args, work))
    rows = []
    for arm in candidates:
        ratios = [k["img_per_s"] / d["img_per_s"] for k, d in zip(runs[arm.name],
                                                                  runs[defaults.name])]
        rows.append([arm.name if arm is not defaults else "DDP's defaults (2 processes)",
                     benchlib.median([r["img_per_s"] for r in runs[arm.name]]),
                     benchlib.median(ratios), benchlib.spread(ratios)])
    report.table(f"DDP knobs (accel_train, 2 processes, {args.model}, global batch "
                 f"{args.global_batch}, {args.knob_rounds} round(s))",
                 ["setting", "img/s (median)", "vs defaults, same round (median)", "range"],
                 rows, notes=["a knob's ratio is taken against the defaults run of the same "
                              "round; differences within the range are noise",
                              "every arm runs with DDP's defaults (as the hand-written script) "
                              "plus its own flag"])
    return runs


# -- DDP knobs in one pair of processes: the fine-grained, paired measurement -------------------
KNOB_SETTINGS = {
    "defaults (bucket 25 MB)": {},
    "bucket 1 MB": {"bucket_cap_mb": 1},
    "bucket 100 MB": {"bucket_cap_mb": 100},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "channels_last": {"channels_last": True},
}


def _knob_worker(rank: int, world: int, port: int, model_name: str, batch: int, steps: int,
                 rounds: int, queue) -> None:
    """Every setting wraps its own copy of the same model in DDP inside the same two processes;
    blocks of `steps` steps alternate between settings, so load changes hit all settings alike."""
    import copy

    import timm
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    base = timm.create_model(model_name, num_classes=10)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    runs = {}
    for name, setting in KNOB_SETTINGS.items():
        setting = dict(setting)
        model = copy.deepcopy(base)
        inputs = x
        if setting.pop("channels_last", False):
            model = model.to(memory_format=torch.channels_last)
            inputs = x.contiguous(memory_format=torch.channels_last)
        ddp = DDP(model, **setting)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        runs[name] = (ddp, optimizer, inputs)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    def block(name: str, count: int) -> float:
        ddp, optimizer, inputs = runs[name]
        dist.barrier()
        started = time.perf_counter()
        for _ in range(count):
            loss_fn(ddp(inputs), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    for name in runs:  # warm-up (static_graph records its graph on the first iterations)
        block(name, 3)
    seconds = {name: [] for name in runs}
    for order in benchlib.round_orders(list(runs), rounds):
        for name in order:
            seconds[name].append(block(name, steps))
    if rank == 0:
        queue.put(seconds)
    dist.barrier()
    dist.destroy_process_group()


def knobs_in_process(args, report) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    per_process = args.global_batch // 2
    mp.start_processes(_knob_worker, args=(2, benchlib.free_port(), args.model, per_process,
                                           args.knob_steps, args.knob_block_rounds, queue),
                       nprocs=2, join=True, start_method="spawn")
    seconds = queue.get()
    base = seconds["defaults (bucket 25 MB)"]
    rows = []
    for name, values in seconds.items():
        ratios = [b / v for b, v in zip(base, values)]
        rows.append([name, args.global_batch * args.knob_steps / benchlib.median(values),
                     benchlib.median(ratios), benchlib.spread(ratios)])
    report.table(f"DDP knobs, paired in one pair of processes ({args.model}, 2 x {per_process}, "
                 f"blocks of {args.knob_steps} steps x {args.knob_block_rounds} rounds, gloo, "
                 f"1 thread each)",
                 ["setting", "img/s (median)", "throughput vs defaults (median)", "range"], rows,
                 notes=["plain DDP on random 32 px batches: the knobs' effect on DDP itself, "
                        "every setting measured in the same processes, alternating in blocks; "
                        "accel_train passes them to DDP as --ddp-bucket-mb, "
                        "--ddp-grad-as-bucket-view, --ddp-static-graph, --channels-last"])
    return seconds


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--log-every", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--max-train", type=int, default=8192)
    parser.add_argument("--knobs", action=argparse_bool(), default=None,
                        help="also measure the DDP knobs (default: on unless --quick or "
                             "--pairs-only)")
    parser.add_argument("--compile", action="store_true", help="also --compile (slow to start)")
    parser.add_argument("--knob-rounds", type=int, default=None)
    parser.add_argument("--knob-steps", type=int, default=None,
                        help="steps per block in the paired in-process knob measurement")
    parser.add_argument("--knob-block-rounds", type=int, default=None)
    parser.add_argument("--only-knobs", action="store_true",
                        help="skip the scaling arms, measure the knobs only")
    parser.add_argument("--cli-knobs", action=argparse_bool(), default=True,
                        help="also run each knob through accelerate launch + accel_train (one "
                             "launch per knob and round; slower and noisier than the paired "
                             "in-process measurement)")
    parser.add_argument("--pairs-only", action="store_true",
                        help="only the 2-process accel_train / hand-written pair (smoke tests, or "
                             "more rounds of the comparison that has the target)")
    parser.add_argument("--with-accumulation", action="store_true",
                        help="with --pairs-only: also the pair with accumulation 2")
    parser.add_argument("--tmp", default=tempfile.gettempdir())
    args = parser.parse_args()
    benchlib.check_cifar(args.data_dir)
    args.steps = args.steps or (18 if args.quick else 60)
    args.log_every = args.log_every or (6 if args.quick else 10)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.knobs = (not args.quick and not args.pairs_only) if args.knobs is None else args.knobs
    args.knob_rounds = args.knob_rounds or (1 if args.quick else 2)
    args.knob_steps = args.knob_steps or (3 if args.quick else 5)
    args.knob_block_rounds = args.knob_block_rounds or (3 if args.quick else 12)
    if args.steps * args.global_batch > args.max_train:
        parser.error("--steps x --global-batch must fit in --max-train (one epoch)")
    report = benchlib.Report("scaling", "Scaling: 1 vs 2 processes, accel_train vs the seed's "
                             "hand-written DDP, DDP knobs", args)
    work = Path(tempfile.mkdtemp(prefix="bench-scaling-", dir=args.tmp))

    arms = arms_for(args)
    if args.only_knobs:
        data = {"knobs_paired": knobs_in_process(args, report)}
        if args.cli_knobs:
            data["knobs"] = measure_knobs(args, arms, work, report)
        report.data["result"] = data
        print(f"wrote {report.save()}")
        return 0
    if args.pairs_only:
        accumulations = (1, 2) if args.with_accumulation else (1,)
        arms = [a for a in arms if a.procs == 2 and a.accum in accumulations and not a.flags]
    results: dict[str, list[dict]] = {arm.name: [] for arm in arms}
    for order in benchlib.round_orders([a.name for a in arms], args.rounds):
        for name in order:
            arm = next(a for a in arms if a.name == name)
            results[name].append(run_arm(arm, args, work))
    rate = {name: benchlib.median([r["img_per_s"] for r in runs]) for name, runs in results.items()}
    base = rate.get("accel_train, 1 process", float("nan"))

    def pair_ratios(ours: str, theirs: str) -> list[float]:
        return [a["img_per_s"] / h["img_per_s"] for a, h in zip(results[ours], results[theirs])]

    rows = []
    for arm in arms:
        first = results[arm.name][0]
        rows.append([arm.name, f"{first['per_process_batch']} x {arm.procs} x {arm.accum}",
                     first["threads"], rate[arm.name], rate[arm.name] / base])
    report.table(f"Throughput on the same global batch ({args.global_batch}), {args.model}, "
                 f"{args.steps} steps, median over {args.rounds} round(s)",
                 ["arm", "batch x procs x accum", "threads/proc", "img/s", "vs accel_train 1 proc"],
                 rows, notes=["2 processes on this machine share its cores with each other: the "
                              "2-process figure is what DDP costs or gains on one box, not "
                              "multi-GPU scaling"])

    pairs = [("accel_train, 2 processes", "hand-written DDP, 2 processes"),
             ("accel_train, 2 processes, accumulation 2",
              "hand-written DDP, 2 processes, accumulation 2")]
    if not args.quick:
        pairs.insert(0, ("accel_train, 1 process", "hand-written, 1 process"))
    pairs = [(ours, theirs) for ours, theirs in pairs if ours in results and theirs in results]
    rows = []
    for ours, theirs in pairs:
        ratios = pair_ratios(ours, theirs)
        rows.append([ours, theirs, benchlib.median(ratios), benchlib.spread(ratios)])
    report.table("accel_train under its launcher vs the hand-written script, same settings",
                 ["accel_train arm", "anchor", "throughput ratio (median)", "range over rounds"],
                 rows, notes=["target >= 0.98"])
    data = {"arms": results}

    if args.knobs:
        data["knobs_paired"] = knobs_in_process(args, report)
        if args.cli_knobs:
            data["knobs"] = measure_knobs(args, arms, work, report)
    report.data["result"] = data
    print(f"wrote {report.save()}")
    return 0


def argparse_bool():
    import argparse
    return argparse.BooleanOptionalAction


if __name__ == "__main__":
    sys.exit(main())
