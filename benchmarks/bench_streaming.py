"""Streaming from shards: the trainer's data-wait on CIFAR-10 written as WebDataset shards against
the map-style path, loader worker memory against the shuffle buffer, and the time from start to
first step on 1,000 shards.

1. `accel-train shard` CIFAR-10 (--samples-per-shard 1000: 50 train shards), then the trainer
   itself, resnet18 batch 64, streaming and map-style (defaults), --max-steps N each: median
   `data_wait` (the fraction of each log window the loop waited for data) and img/s from
   metrics.jsonl.
2. The streaming loader alone (2 workers, one rank): resident memory (RSS) of each worker
   process after reading past its shuffle buffer, with --shuffle-buffer 1000 and 10000.
3. 1,000 shards (CIFAR-10 at 50 per shard): seconds from starting `accel-train` to its first
   optimizer step (the first `step` record's wall clock minus the process start), and the part
   of it spent opening and checking the shards (index and tar headers).

    python benchmarks/bench_streaming.py --quick
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def accel(*args: str, env=None, timeout: float = 3600):
    return benchlib.run([sys.executable, "-m", "accel_train", *args], env=env, timeout=timeout)


def make_shards(args, folder: Path, per_shard: int, limit_train=None) -> Path:
    out = folder / f"shards-{per_shard}"
    if (out / "index.json").is_file():
        return out
    extra = []
    if limit_train:  # a prefix of CIFAR-10 as parquet, for --quick
        import pyarrow.parquet as pq
        small = folder / "small"
        small.mkdir(exist_ok=True)
        for split, n in (("train", limit_train), ("test", max(64, limit_train // 5))):
            table = pq.read_table(Path(args.data_dir) / f"{split}.parquet").slice(0, n)
            pq.write_table(table, small / f"{split}.parquet")
        source = small
    else:
        source = Path(args.data_dir)
    started = time.perf_counter()
    result = accel("shard", "--no-progress", "--data-dir", str(source), "--output", str(out),
                   "--samples-per-shard", str(per_shard), *extra)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    print(f"sharded {source} at {per_shard}/shard in {time.perf_counter() - started:.1f} s",
          flush=True)
    return out


def trainer_wait(args, data_dir: Path, streaming: bool, out: Path) -> dict:
    run_dir = out / ("run-stream" if streaming else "run-map")
    cmd = ["--data-dir", str(data_dir), "--model", args.model, "--batch-size", "64",
           "--max-steps", str(args.steps), "--log-every", str(args.log_every),
           "--max-eval-samples", "256", "--no-plots", "--progress", "log",
           "--output-dir", str(run_dir)]
    if streaming:
        cmd += ["--shuffle-buffer", str(args.buffer)]
    started = time.perf_counter()
    result = accel(*cmd, *benchlib.FIXED_COMPUTE, env=benchlib.child_env())
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    records = [r for r in benchlib.read_jsonl(run_dir / "metrics.jsonl") if r["type"] == "train"]
    windows = records[1:] or records  # the first window holds the start
    return {"data_wait": benchlib.median([r["data_wait"] for r in windows]),
            "img_per_s": benchlib.median([r["img_per_s"] for r in windows]),
            "windows": len(windows), "wall_s": time.perf_counter() - started}


def worker_rss(data_dir: Path, buffer: int, batches: int) -> dict:
    """RSS (MB) of each loader worker once it has read past its buffer."""
    import psutil

    from accel_train.config import TrainConfig
    from accel_train.data.streaming import Layout, StreamingTrain, StreamLoader, open_shards
    from accel_train.data.transforms import ImageTransform
    data = open_shards(TrainConfig(data_dir=str(data_dir)))
    transform = ImageTransform(32, (0.5,) * 3, (0.25,) * 3, augment=True)
    dataset = StreamingTrain(data.train, Layout(1, 2, 64, 1), 0, 0, buffer, transform)
    loader = StreamLoader(dataset, 2, 2, False)
    me = psutil.Process()
    peak: dict[int, float] = {}
    first: dict[int, float] = {}
    uss: dict[int, float] = {}
    taken = 0
    started = time.perf_counter()
    for _ in loader:
        taken += 1
        if taken == 2 or taken % 20 == 0:
            for child in me.children():
                try:
                    info = child.memory_full_info()
                except psutil.NoSuchProcess:
                    continue
                first.setdefault(child.pid, info.rss / 2**20)
                peak[child.pid] = max(peak.get(child.pid, 0.0), info.rss / 2**20)
                uss[child.pid] = max(uss.get(child.pid, 0.0), info.uss / 2**20)
        if taken >= batches:
            break
    return {"buffer": buffer, "batches": taken, "samples": taken * 64,
            "worker_rss_mb": sorted(round(v, 1) for v in peak.values()),
            "worker_growth_mb": sorted(round(peak[p] - first[p], 1) for p in peak),
            "worker_uss_mb": sorted(round(v, 1) for v in uss.values()),
            "main_rss_mb": round(me.memory_info().rss / 2**20, 1),
            "img_per_s": round(taken * 64 / (time.perf_counter() - started), 1)}


def first_step(args, data_dir: Path, out: Path) -> dict:
    from accel_train.config import TrainConfig
    from accel_train.data.streaming import open_shards
    started = time.perf_counter()
    data = open_shards(TrainConfig(data_dir=str(data_dir)))
    open_s = time.perf_counter() - started
    run_dir = out / "run-first-step"
    import subprocess
    began = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "accel_train", "--data-dir", str(data_dir), "--model", args.model,
         "--batch-size", "64", "--max-steps", "1", "--log-every", "1", "--max-eval-samples",
         "64", "--no-plots", "--progress", "log", "--output-dir", str(run_dir)],
        cwd=REPO, env=benchlib.child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    first = None
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:  # the first step's record appears when the step is done
        if first is None and metrics.is_file() and '"type": "train"' in metrics.read_text():
            first = time.perf_counter() - began
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr.read()[-3000:])
    if first is None:
        first = time.perf_counter() - began
    return {"shards": len(data.train.files), "open_and_check_s": round(open_s, 2),
            "start_to_first_step_s": round(first, 1) if first else None,
            "whole_command_s": round(time.perf_counter() - began, 1)}


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--buffer", type=int, default=1000)
    parser.add_argument("--rss-batches", type=int, default=500)
    parser.add_argument("--tmp", default=None, help="folder for the shards and runs")
    parser.add_argument("--skip", nargs="*", default=[], choices=["wait", "rss", "first"])
    args = parser.parse_args()
    if args.quick:
        args.steps, args.log_every, args.rss_batches = 4, 2, 20
    benchlib.check_cifar(args.data_dir)
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="bench_streaming-"))
    tmp.mkdir(parents=True, exist_ok=True)
    report = benchlib.Report("streaming", "Streaming from shards", args)
    limit = 2000 if args.quick else None
    shards = make_shards(args, tmp, 100 if args.quick else 1000, limit)
    if "wait" not in args.skip:
        rows = []
        for streaming in (True, False):
            figures = trainer_wait(args, shards if streaming else
                                   (tmp / "small" if args.quick else Path(args.data_dir)),
                                   streaming, tmp)
            rows.append(["streaming (shards)" if streaming else "map-style (parquet, defaults)",
                         f"{100 * figures['data_wait']:.2f}%", figures["img_per_s"],
                         figures["windows"], round(figures["wall_s"], 1)])
            print(rows[-1], flush=True)
        report.table(f"Trainer data-wait: {args.model}, batch 64, {args.steps} steps, 1 process",
                     ["path", "data-wait (median window)", "img/s", "windows", "command s"],
                     rows, [f"shuffle buffer {args.buffer}; loader workers: the default"])
    if "rss" not in args.skip:
        rows = []
        for buffer in ((100, 1000) if args.quick else (1000, 10000)):
            figures = worker_rss(shards, buffer, args.rss_batches)
            rows.append([buffer, figures["samples"], ", ".join(map(str, figures["worker_rss_mb"])),
                         ", ".join(map(str, figures["worker_growth_mb"])),
                         ", ".join(map(str, figures["worker_uss_mb"])), figures["img_per_s"]])
            print(rows[-1], flush=True)
        report.table("Loader worker memory against the shuffle buffer (2 workers, 1 rank)",
                     ["shuffle buffer", "samples read", "worker peak RSS MB",
                      "worker RSS growth after batch 2 MB", "worker peak USS MB",
                      "img/s (loader alone)"], rows,
                     ["RSS counts the pages a forked worker shares with its parent (torch and "
                      "the rest, imported before the fork); USS is what the worker holds alone; "
                      "the growth is what reading past the buffer added"])
    if "first" not in args.skip:
        many = make_shards(args, tmp, 2 if args.quick else 50, limit)
        figures = first_step(args, many, tmp)
        report.table("Start to first step on many shards",
                     ["shards", "open + check shards s", "start to first step s",
                      "whole command (1 step + eval + save) s"],
                     [[figures["shards"], figures["open_and_check_s"],
                       figures["start_to_first_step_s"], figures["whole_command_s"]]])
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
