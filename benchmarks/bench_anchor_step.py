r"""The CLI's training step against airbench94's on a CPU, timed in one process, step against
step: where the side-by-side run (bench_anchor_side_by_side.py) reads two commands minutes
apart, on a machine whose pace moves by half within minutes, this alternates the two so the
pace moves both alike, and says what each difference between them costs.

Tables:
  networks   one plain training step (the anchor's: bf16 autocast where the CPU has native
             bf16, channels_last, Nesterov SGD over the summed loss) of airbench94's network as
             anchors/airbench_cpu.py builds it and of cifar_airbench as accel_train builds it
             (timm's registry, --whiten-stem's whitening, its layer computed in float32), each
             with the whitening bias trained (airbench's epochs 1-3) and fixed (epochs 4 on),
             and cifar_airbench with that layer in bf16 as the anchor's is (what float32
             costs), on the same batch, the arms' order rotated every round: seconds a step and
             the ratio to the anchor's network with the bias trained (median of the rounds'
             ratios).
  trainer    recipes/cifar10-cpu-10min.yaml through accel_train's trainer as the CLI runs it
             (one process), and after each of its steps one step of the anchor's loop (its own
             network, data and optimizer) in the same process: both steps' seconds and their
             ratio, with the whitening bias trained (--whiten-bias-epochs 3, the anchor's
             trained: epoch 1) and fixed from the start (0, the anchor's fixed: the regime of
             epochs 4 on).  The CLI's step is its trainer's, from the batch in hand to the end
             of the update (Lookahead, logging and the budget's bookkeeping included); fetching
             the next batch is timed apart.

    python benchmarks/bench_anchor_step.py --data-dir ../shared/data/cifar10
    python benchmarks/bench_anchor_step.py --quick --train-images 256 --batch-size 32  # smoke
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "anchors"))
import airbench_cpu  # noqa: E402
import benchlib  # noqa: E402

RECIPE = benchlib.REPO / "recipes" / "cifar10-cpu-10min.yaml"


def anchor_network(whitening_images: torch.Tensor, bias_trains: bool) -> nn.Module:
    """airbench94's network as anchors/airbench_cpu.py builds and whitens it."""
    net = airbench_cpu.make_net()
    airbench_cpu.whiten(net[0], whitening_images)
    net[0].bias.requires_grad_(bias_trains)
    return net


def cli_network(whitening_images: torch.Tensor, bias_trains: bool,
                float32_layer: bool = True) -> nn.Module:
    """cifar_airbench as the trainer builds it for the recipe: timm's registry, the whitening
    of the training images' patches (its layer then computes in float32 under autocast;
    `float32_layer` False: a plain Conv2d in autocast's dtype, to time what float32 costs)."""
    import timm

    import accel_train.model.small_nets  # noqa: F401  (registers cifar_airbench)
    from accel_train.model.whitening import first_conv, whiten_first_conv

    net = timm.create_model("cifar_airbench", num_classes=10)
    whiten_first_conv(net, whitening_images)
    _, layer = first_conv(net)
    layer.bias.requires_grad_(bias_trains)
    if not float32_layer:
        layer.__class__ = nn.Conv2d
    return net.to(memory_format=torch.channels_last)


def networks_table(args, report: benchlib.Report, images, labels) -> dict:
    normalized = airbench_cpu.normalize(images)
    whitening = normalized[:5000]
    arms = {"airbench94's network, bias trained": anchor_network(whitening, True),
            "airbench94's network, bias fixed": anchor_network(whitening, False),
            "cifar_airbench (accel_train), bias trained": cli_network(whitening, True),
            "cifar_airbench (accel_train), bias fixed": cli_network(whitening, False),
            "cifar_airbench, its whitened layer in bf16 (not float32), bias trained":
                cli_network(whitening, True, float32_layer=False),
            "cifar_airbench, its whitened layer in bf16 (not float32), bias fixed":
                cli_network(whitening, False, float32_layer=False)}
    batch = normalized[:args.batch_size].contiguous(memory_format=torch.channels_last)
    targets = labels[:args.batch_size]
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.2, reduction="none")
    optimizers = {name: torch.optim.SGD([p for p in net.parameters() if p.requires_grad],
                                        lr=1e-4, momentum=0.85, nesterov=True)
                  for name, net in arms.items()}

    def step(name: str) -> None:
        with torch.autocast(**airbench_cpu.AUTOCAST):
            loss = loss_fn(arms[name](batch), targets).sum()
        optimizers[name].zero_grad(set_to_none=True)
        loss.backward()
        optimizers[name].step()

    for name in arms:  # warm-up: oneDNN's kernels for these shapes
        step(name)
    seconds = {name: [] for name in arms}
    for order in benchlib.round_orders(list(arms), args.rounds):
        for name in order:
            seconds[name].append(benchlib.timed(functools.partial(step, name)))
    base = seconds[next(iter(arms))]
    rows = [[name, benchlib.median(s), benchlib.spread(s),
             benchlib.median([a / b for a, b in zip(s, base)])] for name, s in seconds.items()]
    precision = "bf16 autocast" if airbench_cpu.AUTOCAST["enabled"] else "fp32"
    native = "yes" if airbench_cpu.native_bf16() else "no"
    report.table(f"Networks alone: one training step at batch {args.batch_size}, {args.rounds} "
                 f"rounds", ["arm", "s a step (median)", "range", "ratio to the first arm"],
                 rows, notes=[f"precision: {precision} (--precision {args.precision}; native "
                              f"bf16 on this CPU: {native})"])
    return {name: s for name, s in seconds.items()}


class AnchorBeside:
    """The anchor's loop, one step at a time: its network (whitened), optimizer, schedule,
    averaging and translated batches, as anchors/airbench_cpu.py trains."""

    def __init__(self, images, labels, batch: int, bias_trains: bool):
        import torch.nn.functional as F

        self.net = airbench_cpu.make_net()
        self.net[0].bias.requires_grad_(bias_trains)
        self.averager = airbench_cpu.Averager(self.net)  # as airbench: before the whitening
        normalized = airbench_cpu.normalize(images)
        airbench_cpu.whiten(self.net[0], normalized[:5000])
        self.optimizer, self.scheduler, self.per_epoch, self.total = \
            airbench_cpu.optimizer_and_schedule(self.net, batch, len(labels), 10)
        self.images = airbench_cpu.translate(F.pad(normalized, (2,) * 4, "reflect"), 2)
        self.labels, self.batch, self.step_count = labels, batch, 0
        self.order = torch.randperm(len(labels))
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=0.2, reduction="none")

    def step(self) -> None:
        start = (self.step_count % self.per_epoch) * self.batch
        index = self.order[start:start + self.batch]
        with torch.autocast(**airbench_cpu.AUTOCAST):
            loss = self.loss_fn(self.net(self.images[index].contiguous(
                memory_format=torch.channels_last)), self.labels[index]).sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        self.averager.after_step(self.net, self.step_count, self.total)


def trainer_row(args, images, labels, bias_epochs: int, out: Path) -> list:
    from accel_train.callbacks import Callback
    from accel_train.cli import build_train_parser, config_from_args
    from accel_train.trainer import run_training

    anchor = AnchorBeside(images, labels, args.batch_size, bias_trains=bias_epochs > 0)
    # The recipe without its time budget (and the smaller networks it may choose): the same
    # network and schedule as the anchor's 10 epochs, stopped after --steps.
    recipe = benchlib.recipe_without_budget(RECIPE, out.parent / f"{out.name}.yaml")
    argv = ["--config", str(recipe), "--data-dir", args.data_dir,
            "--select-on-test", "--progress", "log", "--no-plots", "--output-dir", str(out),
            "--epochs", "10", "--whiten-bias-epochs", str(bias_epochs),
            "--max-steps", str(args.steps), "--checkpoint-every", "0",
            "--batch-size", str(args.batch_size),
            # The anchor's precision and layout, not auto's timed choice: on a loaded machine
            # that choice differed between this script's two trainer rows, and Accelerate's
            # state, made once per process, refuses a second mixed precision.
            "--mixed-precision", "bf16" if airbench_cpu.AUTOCAST["enabled"] else "no",
            "--channels-last"]
    if args.train_images:
        argv += ["--max-train-samples", str(args.train_images), "--max-eval-samples", "64",
                 "--sample-subset", "first"]  # the first N, as the anchor takes them
    config = config_from_args(build_train_parser().parse_args(argv))
    pairs, fetches = [], []

    class StepBeside(Callback):
        """Times the trainer's step, then runs one anchor step beside it."""
        began = anchor_ended = None

        def on_batch_start(self, trainer, batch):
            self.began = time.perf_counter()
            if self.anchor_ended is not None:
                fetches.append(self.began - self.anchor_ended)

        def on_step_end(self, trainer, step):
            cli = time.perf_counter() - self.began
            pairs.append((cli, benchlib.timed(anchor.step)))
            self.anchor_ended = time.perf_counter()

    run_training(config, [StepBeside()])
    steady = pairs[args.skip:] or pairs
    return [f"{bias_epochs} ({'trained' if bias_epochs else 'fixed'})", len(steady),
            benchlib.median([c for c, _ in steady]), benchlib.median([a for _, a in steady]),
            benchlib.median([c / a for c, a in steady]),
            sum(c for c, _ in steady) / sum(a for _, a in steady), benchlib.median(fetches)]


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--batch-size", type=int, default=1024, help="both arms' batch")
    parser.add_argument("--rounds", type=int, default=16, help="the networks table's rounds")
    parser.add_argument("--steps", type=int, default=24, help="the trainer's steps a row")
    parser.add_argument("--skip", type=int, default=3, help="first step pairs left out")
    parser.add_argument("--train-images", type=int, default=0, help="the first N (0: all)")
    parser.add_argument("--skip-networks", action="store_true")
    parser.add_argument("--tmp", default=None, help="folder for the trainer's runs")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="both arms': auto is the anchor's (bf16 where the CPU has native "
                             "bf16, else fp32)")
    args = parser.parse_args()
    # Set before anything steps: the imported loop's default is bf16, which a CPU without
    # native bf16 emulates at a fraction of fp32's pace.
    airbench_cpu.use_precision(args.precision)
    if args.quick:
        args.rounds, args.steps, args.skip = min(args.rounds, 2), min(args.steps, 3), 1
    data = benchlib.check_cifar(args.data_dir)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = benchlib.Report("anchor_step", "The CLI's step against airbench94's", args)
    images, labels = airbench_cpu.load(data / "train.parquet", args.train_images)
    if not args.skip_networks:
        report.data["networks"] = networks_table(args, report, images, labels)
    work = Path(args.tmp or tempfile.mkdtemp(prefix="bench-anchor-step-"))
    rows = [trainer_row(args, images, labels, epochs, work / f"bias{epochs}")
            for epochs in (3, 0)]
    report.table(f"The trainer's step (the CLI's recipe, one process) and the anchor's loop, "
                 f"step after step in one process, batch {args.batch_size}",
                 ["--whiten-bias-epochs (the whitening bias)", "step pairs",
                  "CLI s a step (median)", "anchor s a step (median)",
                  "ratio CLI / anchor (median of pairs)", "ratio of the sums",
                  "CLI's next batch, s (median)"], rows,
                 notes=[f"the first {args.skip} pairs of each row left out (warm-up); threads "
                        f"{torch.get_num_threads()} (OMP_NUM_THREADS "
                        f"{os.environ.get('OMP_NUM_THREADS', 'not set')})"])
    report.data["trainer"] = rows
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
