"""Overhead: accel_train's training loop against a minimal hand-written PyTorch loop.

Same model (timm, same seed), same batch, same optimizer family (SGD + Nesterov momentum, label-
smoothed cross-entropy), data already in memory (CIFAR-10 decoded once), one process.

Throughput, in one process: arms alternate in blocks of --steps optimizer steps, rounds in
shifting order (A B C, C B A, ...), and each round gives a ratio to the hand loop's block
of that round; the table shows the median over rounds, the ratio of the fastest blocks, and the
ratio of CPU time (robust to other processes when --threads 1).  Arms:

  hand loop          model(x) / loss / backward / SGD step on a random permutation of the
                     in-memory tensor, normalized per batch (the least any loop can do)
  accel_train        Trainer.train_epoch: its DataLoader and sampler, Accelerate's accumulate /
                     optimizer wrapper, scheduler, train top-1, log windows, stop checks;
                     --no-augment (the same work on the data as the hand loop)
  accel_train + aug  the same with the default augmentation (random crop + flip), to show
                     what the batched augmentation costs on top

Reseeding, in the same process: what `randomness.seed_globals` (Python's, numpy's and torch's
global generators seeded from the micro-batch's place in the run, once per micro-batch: what
makes dropout and drop-path exact on resume) costs per call, as a share of the accel_train
arm's step time measured above.

Memory, in separate child processes (one per arm, run one after the other): the peak resident
set (ru_maxrss) of the whole process, and the growth of the resident set while training (peak
sampled every 5 ms during the steps, minus the resident set just before the first step).  The
whole-process figure includes what each arm imports (Accelerate, datasets) and the dataset.

    python benchmarks/bench_overhead.py --quick
    python benchmarks/bench_overhead.py --threads 1     # steadier on a busy machine
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

ARMS = ("hand loop", "accel_train", "accel_train + aug")


class HandLoop:
    """The minimal loop: what someone writes by hand for in-memory tensors."""

    def __init__(self, model_name: str, images: torch.Tensor, labels: torch.Tensor,
                 batch_size: int, mean, std, seed: int = 0, channels_last: bool = False,
                 bf16: bool = False):
        import timm
        torch.manual_seed(seed)
        self.model = timm.create_model(model_name, num_classes=10)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.channels_last = channels_last
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9,
                                         nesterov=True, weight_decay=5e-4)
        self.loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
        self.images, self.labels, self.batch_size = images, labels, batch_size
        self.mean = torch.tensor(mean).view(1, 3, 1, 1)
        self.std = torch.tensor(std).view(1, 3, 1, 1)
        self.generator = torch.Generator().manual_seed(seed)

    def run(self, steps: int) -> None:
        self.model.train()
        order = torch.randperm(len(self.labels), generator=self.generator)
        for step in range(steps):
            index = order[step * self.batch_size:(step + 1) * self.batch_size]
            x = (self.images[index].float() / 255 - self.mean) / self.std
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with self.autocast:
                loss = self.loss_fn(self.model(x), self.labels[index])
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def make_trainer(args, augment: bool, out_dir: Path):
    """A real Trainer whose epoch is exactly --steps optimizer steps of in-memory CIFAR-10."""
    from accel_train.config import TrainConfig
    from accel_train.trainer import Trainer
    config = TrainConfig(data_dir=str(benchlib.check_cifar(args.data_dir)), model=args.model,
                         batch_size=args.batch_size, max_train_samples=args.steps * args.batch_size,
                         max_eval_samples=args.batch_size, epochs=1_000_000,
                         log_every=args.log_every, augment=augment, progress="log", plots=False,
                         channels_last=args.channels_last,
                         mixed_precision=args.mixed_precision,
                         output_dir=str(out_dir),
                         in_memory="always")
    trainer = Trainer.from_config(config)
    trainer.progress.enabled = False  # quiet: the benchmark prints its own
    return trainer


def trainer_block(trainer) -> None:
    """One epoch of the real loop; the epoch bookkeeping of _end_epoch without its evaluation
    and checkpoint (the hand loop does neither; checkpoints are bench_checkpoint's subject)."""
    trainer.train_epoch()
    trainer.next_epoch()


def throughput(args, report: benchlib.Report) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-", dir=args.tmp))
    plain = make_trainer(args, augment=False, out_dir=work / "plain")
    augmented = make_trainer(args, augment=True, out_dir=work / "aug")
    data = plain.data.train
    hand = HandLoop(args.model, data.images, data.labels, args.batch_size, plain.net.spec.mean,
                    plain.net.spec.std, channels_last=args.channels_last,
                    bf16=args.mixed_precision == "bf16")
    blocks = {"hand loop": lambda: hand.run(args.steps),
              "accel_train": lambda: trainer_block(plain),
              "accel_train + aug": lambda: trainer_block(augmented)}
    for run_block in blocks.values():  # warm-up: allocator, first-call costs
        run_block()
    wall: dict[str, list[float]] = {arm: [] for arm in ARMS}
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for order in benchlib.round_orders(ARMS, args.rounds):
        for arm in order:
            seconds, cpu_seconds = benchlib.timed_both(blocks[arm])
            wall[arm].append(seconds)
            cpu[arm].append(cpu_seconds)
    samples = args.steps * args.batch_size
    rows, result = [], {}
    for arm in ARMS:
        ratios = [h / a for h, a in zip(wall["hand loop"], wall[arm])]
        cpu_ratios = [h / a for h, a in zip(cpu["hand loop"], cpu[arm])]
        best = min(wall["hand loop"]) / min(wall[arm])
        result[arm] = {"wall": wall[arm], "cpu": cpu[arm], "ratio": benchlib.median(ratios),
                       "best_ratio": best, "cpu_ratio": benchlib.median(cpu_ratios)}
        rows.append([arm, samples / benchlib.median(wall[arm]), benchlib.median(ratios),
                     benchlib.spread(ratios), best, benchlib.median(cpu_ratios),
                     1000 * benchlib.median(wall[arm]) / args.steps])
    report.table(f"Throughput: {args.model}, batch {args.batch_size}, blocks of {args.steps} steps "
                 f"x {args.rounds} rounds, {torch.get_num_threads()} thread(s)",
                 ["arm", "img/s (median)", "ratio to hand loop", "ratio range",
                  "ratio of best blocks", "CPU-time ratio", "ms/step"], rows,
                 notes=["ratio = hand-loop block time / arm block time in the same round "
                        "(> 1: faster than the hand loop), median over rounds; target >= 0.98",
                        "ratio of best blocks = fastest hand-loop block / fastest arm block (the "
                        "blocks least disturbed by other processes)",
                        "CPU-time ratio: the same with this process's CPU time instead of wall "
                        "time (with one thread, insensitive to waiting for a busy core)",
                        "accel_train: the real Trainer.train_epoch on in-memory data "
                        f"(data_wait in its last log window: {_last_data_wait(plain)}; with "
                        f"augmentation: {_last_data_wait(augmented)})"])
    for trainer in (plain, augmented):
        trainer.close()  # its loader workers and run lock, as a run's end releases them
    return result


def reseed_cost(args, report: benchlib.Report, accel_blocks: list[float]) -> dict:
    """seed_globals per call (median of rounds of 2,000 calls) against the step it precedes."""
    import time

    from accel_train.base.randomness import MICRO_BATCH_SALT, seed_globals
    calls, rounds = 2000, 5
    per_call = []
    for round_index in range(rounds):
        started = time.perf_counter()
        for position in range(calls):
            seed_globals(0, round_index, position * args.batch_size, 0, MICRO_BATCH_SALT)
        per_call.append((time.perf_counter() - started) / calls)
    call_seconds = benchlib.median(per_call)
    step_seconds = benchlib.median(accel_blocks) / args.steps
    share = call_seconds / step_seconds
    report.table("Reseeding the global generators once per micro-batch",
                 ["call (us, median)", "accel_train step (ms, median)", "share of the step"],
                 [[1e6 * call_seconds, 1e3 * step_seconds, f"{share:.4%}"]],
                 notes=[f"median over {rounds} rounds of {calls} calls; the step is the "
                        f"accel_train arm's of the table above (batch {args.batch_size}, one "
                        f"micro-batch per step), which already includes one call per step"])
    return {"call_s": call_seconds, "step_s": step_seconds, "share": share}


def _last_data_wait(trainer) -> str:
    path = trainer.plan.output_dir / "metrics.jsonl"
    records = [r for r in benchlib.read_jsonl(path) if r.get("type") == "train"] \
        if path.exists() else []
    return f"{records[-1]['data_wait']:.1%}" if records else "n/a"


# -- memory: one child process per arm ---------------------------------------------------------
def child(args) -> None:
    """Run one arm for --steps steps and report memory as one JSON line."""
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-mem-", dir=args.tmp))
    if args.child == "hand loop":
        data = benchlib.cifar_in_memory(args.data_dir, args.steps * args.batch_size,
                                        args.batch_size)
        from accel_train.data.loaders import dataset_mean_std
        mean, std = dataset_mean_std(data.train)
        arm = HandLoop(args.model, data.train.images, data.train.labels, args.batch_size, mean,
                       std, channels_last=args.channels_last,
                       bf16=args.mixed_precision == "bf16")
        step = lambda: arm.run(args.steps)  # noqa: E731
    else:
        trainer = make_trainer(args, augment=args.child == "accel_train + aug", out_dir=work)
        step = lambda: trainer_block(trainer)  # noqa: E731
    with benchlib.PeakRSS() as sampled:
        step()
    print(json.dumps({"bench": "memory", "arm": args.child, "maxrss_mb": benchlib.max_rss_mb(),
                      "before_mb": sampled.start, "peak_mb": sampled.peak}), flush=True)


def memory(args, report: benchlib.Report) -> dict:
    results = {}
    arms = [arm for arm in ARMS if arm in args.memory_arms]
    for arm in arms:
        cmd = [sys.executable, __file__, "--child", arm, "--threads", str(torch.get_num_threads()),
               "--model", args.model, "--batch-size",
               str(args.batch_size), "--steps", str(args.memory_steps), "--data-dir",
               args.data_dir, "--tmp", args.tmp]
        if args.channels_last:
            cmd.append("--channels-last")
        cmd += ["--mixed-precision", args.mixed_precision]
        results[arm] = benchlib.last_json_line(benchlib.run(cmd, env=benchlib.child_env()).stdout)
    hand = results.get("hand loop", {"peak_mb": float("nan"), "before_mb": 0.0})
    hand_growth = hand["peak_mb"] - hand["before_mb"]
    rows = []
    for arm in arms:
        r = results[arm]
        growth = r["peak_mb"] - r["before_mb"]
        rows.append([arm, r["before_mb"], r["peak_mb"], r["peak_mb"] / hand["peak_mb"], growth,
                     growth / hand_growth if hand_growth > 0 else float("nan"), r["maxrss_mb"]])
    report.table(f"Peak memory: {args.model}, batch {args.batch_size}, {args.memory_steps} steps "
                 f"(one child process per arm)",
                 ["arm", "RSS before MB", "peak RSS training MB", "ratio to hand loop",
                  "growth MB", "growth ratio", "lifetime max RSS MB"], rows,
                 notes=["peak RSS training: resident set sampled every 5 ms during the steps "
                        "(imports, the CIFAR-10 subset in memory, model, optimizer, activations); "
                        "target ratio <= 1.05",
                        "growth: that peak minus the resident set just before the first step "
                        "(activations, gradients, momentum buffers, loader batches)",
                        "lifetime max RSS: ru_maxrss, set by data loading (Arrow + JPEG decoding, "
                        "the same code in every arm), not by training"])
    return results


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per block")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--memory-steps", type=int, default=None)
    parser.add_argument("--log-every", type=int, default=20, help="the trainer's default")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                        help="bf16: autocast in both loops (the CPU recipe's precision)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, one per core)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-arms", nargs="*", default=list(ARMS), choices=ARMS)
    parser.add_argument("--tmp", default=tempfile.gettempdir())
    parser.add_argument("--child", choices=ARMS, help=argparse_hidden())
    args = parser.parse_args()
    args.steps = args.steps or (5 if args.quick else 10)
    args.rounds = args.rounds or (5 if args.quick else 15)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.memory_steps = args.memory_steps or (5 if args.quick else 20)
    if args.child:
        child(args)
        return 0
    report = benchlib.Report("overhead", "Overhead: accel_train vs a hand-written loop", args)
    result = {"throughput": throughput(args, report)}
    result["reseed"] = reseed_cost(args, report, result["throughput"]["accel_train"]["wall"])
    if not args.skip_memory:
        result["memory"] = memory(args, report)
    report.data["result"] = result
    print(f"wrote {report.save()}")
    return 0


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
