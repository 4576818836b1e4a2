"""Where loader workers come from (worker_start.py): a fork server, a new interpreter that
imports the workers' modules once (accel_train's way, multiprocessing's own "forkserver"), and
workers forked from the training process (torch's default on Linux, which can hang: see
docs/fault-tolerance.md).  What each costs at a loader's first start, at every later start
(workers per epoch, or the held-out loader's first evaluation), per image once running, and
the server's own CPU seconds.  (Not its memory: read while its workers live, a server's pages
are shared with them, so no figure separates what it adds.)

Each cell is a child process that builds accel_train's training loader (data.make_loader) over
CIFAR-10 decoded per step (the case that uses workers), with the way of starting workers under
test; the fork arm replaces `data.worker_context` in that child only.  It times the first batch
of the first loader (for the server: its start and its imports included), the first batch of a
second loader with new workers (an epoch start without persistent workers), and the images per
second after that.  The arms alternate over --rounds rounds.

    python benchmarks/bench_worker_start.py --quick
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

ARMS = ("a fork server started as a new interpreter (accel_train)",
        "fork of the training process (torch's default on Linux)")
FORK = ARMS[1]
CHILD = r"""
import json, multiprocessing, sys, time
import psutil
import accel_train.data.loaders as data
from accel_train.config import TrainConfig
from accel_train.data.sources import load_data
from accel_train.data.transforms import ImageTransform
arm, data_dir, images, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
config = TrainConfig(data_dir=data_dir, max_train_samples=images, max_eval_samples=1,
                     in_memory="never")
if arm == "fork":
    data.worker_context = lambda: multiprocessing.get_context("fork")
source = load_data(config).train
transform = ImageTransform(32, (0.5,) * 3, (0.25,) * 3, augment=True)
def loader():
    sampler = data.EpochSampler(len(source), 64, seed=0)
    return data.make_loader(data.TrainImages(source, transform, 0), 64, workers, 2, False, False,
                            sampler=sampler, drop_last=True)
def first_batch():
    started = time.perf_counter()
    batches = iter(loader())
    next(batches)
    return time.perf_counter() - started, batches
first, _ = first_batch()
again, batches = first_batch()
started, count = time.perf_counter(), 0
for batch in batches:
    count += len(batch[0])
rate = count / (time.perf_counter() - started)
server_cpu = 0.0
if arm != "fork":  # the server: the child of ours that multiprocessing started as one
    [server] = [child for child in psutil.Process().children()
                if "from multiprocessing.forkserver import main" in " ".join(child.cmdline())]
    times = server.cpu_times()
    server_cpu = times.user + times.system
print(json.dumps({"bench": "worker_start", "first": first, "again": again,
                  "img_per_s": rate, "server_cpu_s": server_cpu}))
"""


def measure(arm: str, args) -> dict:
    name = {ARMS[0]: "server", FORK: "fork"}[arm]
    out = benchlib.run([sys.executable, "-c", CHILD, name,
                        args.data_dir, str(args.images), str(args.workers)],
                       env=benchlib.child_env(threads=1)).stdout
    return benchlib.last_json_line(out)


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--images", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    args.images = args.images or (1024 if args.quick else 4096)
    args.rounds = args.rounds or (2 if args.quick else 5)
    benchlib.check_cifar(args.data_dir)
    report = benchlib.Report("worker_start", "Loader workers: where they are started from",
                             args)
    results = {arm: [] for arm in ARMS}
    for order in benchlib.round_orders(list(ARMS), args.rounds):
        for arm in order:
            results[arm].append(measure(arm, args))
    rows = []
    for arm in ARMS:
        cells = results[arm]
        rows.append([arm, benchlib.median([c["first"] for c in cells]),
                     benchlib.median([c["again"] for c in cells]),
                     benchlib.median([c["img_per_s"] for c in cells])])
        rows[-1] += [None, benchlib.median([c["server_cpu_s"] for c in cells])
                     if arm != FORK else "none"]
    base = rows[ARMS.index(FORK)]
    for row in rows:
        row[4] = row[3] / base[3]
    report.table(f"CIFAR-10 decoded per step, {args.images} images, batch 64, {args.workers} "
                 f"workers, 1 thread in the training process, median of {args.rounds} rounds",
                 ["workers started by", "first loader: s to first batch",
                  "next loader: s to first batch", "img/s after", "img/s vs fork",
                  "server: CPU s"], rows,
                 notes=["the first loader's time includes the server's start (for one started "
                        "anew, its imports), once per training process",
                        "the server's CPU seconds are read after the last batch"])
    report.data["result"] = results
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
