r"""GPU: CIFAR-10's training batches drawn on the device (--data-on-device always) against the
DataLoader path (never): steps/s of a hand-written training loop over each, and whether that
loop synchronizes with the device.

Both arms build their loader with accel_train's own `build_loaders` from the same decoded
CIFAR-10 and iterate it through the TrainLoader interface, as the trainer does; the step is a
plain torch loop (the model in bf16 autocast, channels_last, SGD): no `.item()`, no scaler, so
what synchronizes is the input's.  Per arm, alternating in rounds:
  input alone     batches only (nothing consumes them but a sum), steps/s on the device's clock;
  training        steps/s, wall and device (CUDA events), crossing an epoch's end;
  host ahead      steps at whose fetch the device was still busy with the step before (the
                  previous step's event not yet reached): the host ran ahead, nothing waited.
                  A loop that synchronizes every step has none;
  syncs flagged   warnings of torch.cuda.set_sync_debug_mode("warn") during the timed steps
                  (not every synchronizing call is flagged: a lower bound);
  data wait       the device's time between an event before each fetch and one after it
                  (accel_train's StreamWaitClock), as a share of the training time.
It also prints what --data-on-device auto chooses here, as the run's summary would say it.

Needs a CUDA device: without one it says so in one line and exits 1.  `--allow-cpu` runs the
same code on the CPU (the embedded data, host clocks for the events) so that tests keep it
working; its figures mean nothing.

    python benchmarks/bench_device_resident.py --data-dir ../shared/data/cifar10
    python benchmarks/bench_device_resident.py --quick --reprob 0 0.25
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

ARMS = {"loader": "never", "device": "always"}  # arm: --data-on-device


class HostEvent:
    """A CUDA event's interface on the host's clock (--allow-cpu: a CPU has no events)."""

    def __init__(self, enable_timing: bool = False):
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.at - self.at) * 1000


def on_cuda() -> bool:
    return torch.cuda.is_available()


def event():
    return torch.cuda.Event(enable_timing=True) if on_cuda() else HostEvent()


def synchronize() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def sync_debug(mode: str) -> None:
    if on_cuda():
        torch.cuda.set_sync_debug_mode(mode)


def flagged_syncs(caught: list) -> list:
    """The warnings of torch.cuda.set_sync_debug_mode("warn") among `caught`: not the one that
    setting the mode gives itself ("Synchronization debug mode is a prototype feature")."""
    return [w for w in caught if "synchroniz" in str(w.message).lower()
            and "debug mode is a prototype" not in str(w.message)]


def parse_args():
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--model", default="cifar_resnet9")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200, help="timed training steps per arm")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=2, help="arm orders alternate per round")
    parser.add_argument("--reprob", type=float, nargs="+", default=[0.0],
                        help="--reprob of both arms, a table for each value (the device arm's "
                             "loader workers draw its erasing plans)")
    parser.add_argument("--workers", type=int, default=None,
                        help="both arms' --num-workers (default: accel_train's); the device "
                             "arm's draw --reprob's erasing plans")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU with the embedded data (to test this script)")
    return parser.parse_args()


def build(args, data, spec, mode: str, accelerator, reprob: float):
    from accel_train.config import TrainConfig
    from accel_train.data.loading import build_loaders

    config = TrainConfig(batch_size=args.batch_size, reprob=reprob,
                         num_workers=args.workers, data_on_device=mode)
    loaders = build_loaders(config, data, spec, 1, 0, 1, on_cuda())
    loaders.train.prepare(accelerator)
    return loaders


def batches(train):
    """Micro-batches without end, the epoch advanced as the trainer does."""
    while True:
        yield from train
        train.set_epoch(train.epoch + 1)


def input_alone(train, steps: int, device: torch.device) -> float:
    """Steps/s of the input on its own (device clock): each batch summed, nothing else."""
    stream = iter(batches(train))
    total = torch.zeros((), device=device)
    start, end = event(), event()
    next(stream)
    synchronize()
    wall = time.perf_counter()
    start.record()
    for _ in range(steps):
        total += next(stream).images.sum()
    end.record()
    end.synchronize()
    wall = time.perf_counter() - wall
    return steps / max(wall, start.elapsed_time(end) / 1000)


def training(args, train, model, optimizer) -> dict:
    from accel_train.train.datawait import StreamWaitClock

    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.2)
    stream = iter(batches(train))

    def step(batch):
        images = batch.images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(images.device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(images), batch.labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step(next(stream))
    synchronize()
    clock = StreamWaitClock(torch.cuda.Event if on_cuda() else HostEvent)
    ahead, done = 0, []
    start, end = event(), event()
    sync_debug("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wall = time.perf_counter()
            start.record()
            for _ in range(args.steps):
                # query() never waits: False means the step before is still running
                ahead += bool(done) and not done[-1].query()
                clock.before_fetch()
                batch = next(stream)
                clock.after_fetch()
                step(batch)
                done.append(event())
                done[-1].record()
            end.record()
    finally:
        sync_debug("default")
    end.synchronize()
    wall = time.perf_counter() - wall
    device_s = start.elapsed_time(end) / 1000
    flagged = flagged_syncs(caught)
    return {"steps_per_s_wall": args.steps / wall, "steps_per_s_device": args.steps / device_s,
            "host_ahead": ahead, "of_steps": args.steps - 1, "syncs_flagged": len(flagged),
            "first_sync": str(flagged[0].message)[:160] if flagged else "",
            "data_wait": clock.take() / device_s}


def measure(args, data, spec, accelerator, reprob: float, classes: int) -> dict[str, list]:
    """Each arm's figures, one entry per round (the arms alternate in order)."""
    import timm

    results: dict[str, list] = {arm: [] for arm in ARMS}
    for order in benchlib.round_orders(list(ARMS), args.rounds):
        for arm in order:
            torch.manual_seed(0)
            model = timm.create_model(args.model, num_classes=classes).to(accelerator.device).to(
                memory_format=torch.channels_last)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                                        weight_decay=5e-4)
            loaders = build(args, data, spec, ARMS[arm], accelerator, reprob)
            measured = training(args, loaders.train, model, optimizer)
            measured["input_steps_per_s"] = input_alone(loaders.train, args.steps,
                                                        accelerator.device)
            measured["num_workers"] = loaders.num_workers
            # The arm's workers ended before the next arm is timed: the Accelerator keeps every
            # loader it prepared, and with it their persistent workers.
            loaders.train.close()
            results[arm].append(measured)
    return results


def table(report, args, reprob: float, results: dict[str, list]) -> None:
    rows = []
    for arm, runs in results.items():
        def med(key, runs=runs):
            return benchlib.median([r[key] for r in runs])
        rows.append([arm, runs[0]["num_workers"], med("input_steps_per_s"),
                     med("steps_per_s_wall"), med("steps_per_s_device"),
                     f"{min(r['host_ahead'] for r in runs)} / {runs[0]['of_steps']}",
                     max(r["syncs_flagged"] for r in runs), f"{med('data_wait'):.1%}"])
    speedup = (benchlib.median([r["steps_per_s_wall"] for r in results["device"]])
               / benchlib.median([r["steps_per_s_wall"] for r in results["loader"]]))
    first_syncs = {arm: next((r["first_sync"] for r in runs if r["first_sync"]), "")
                   for arm, runs in results.items()}
    report.table(f"--reprob {reprob:g}: {args.steps} timed steps per arm, median of "
                 f"{args.rounds} round(s)",
                 ["arm", "loader workers", "input alone steps/s", "training steps/s (wall)",
                  "training steps/s (device)", "host ahead (min)", "syncs flagged (max)",
                  "data wait"], rows,
                 notes=[f"device arm / loader arm, training steps/s (wall): {speedup:.2f}x"]
                 + [f"{arm}'s first flagged sync: {text}" for arm, text in first_syncs.items()
                    if text])


def main() -> int:
    args = parse_args()
    if not on_cuda() and not args.allow_cpu:
        sys.exit("bench_device_resident: no CUDA device here; it compares the two GPU input "
                 "paths and runs only with one")
    from accelerate import Accelerator

    import accel_train.model.small_nets  # noqa: F401  (registers cifar_resnet9 with timm)
    from accel_train.config import TrainConfig
    from accel_train.data.loaders import dataset_mean_std
    from accel_train.data.sources import load_data
    from accel_train.model.saved import ModelSpec

    if args.quick:
        args.steps, args.warmup, args.rounds = min(args.steps, 60), min(args.warmup, 10), 1
    report = benchlib.Report("device_resident", "GPU: CIFAR-10 batches drawn on the device "
                             "vs a DataLoader", args)
    report.data["results"] = {}
    name = torch.cuda.get_device_name(0) if on_cuda() else "CPU (--allow-cpu: no figures)"
    report.note(f"device: {name}; {args.model}, batch "
                f"{args.batch_size}, bf16 autocast, channels_last")
    data = load_data(TrainConfig()) if args.allow_cpu else benchlib.cifar_in_memory(args.data_dir)
    mean, std = dataset_mean_std(data.train)
    classes = len(data.class_names)
    spec = ModelSpec(args.model, classes, list(data.class_names), data.train.native_size, mean,
                     std)
    accelerator = Accelerator(cpu=not on_cuda())
    for reprob in args.reprob:
        auto = build(args, data, spec, "auto", accelerator, reprob).choice
        report.note(f"--reprob {reprob:g}: --data-on-device auto chooses here: {auto}")
        results = measure(args, data, spec, accelerator, reprob, classes)
        table(report, args, reprob, results)
        report.data["results"][reprob] = results
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
