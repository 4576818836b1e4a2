"""The seed tutorial's comparison: epoch time of its standalone, nn.DataParallel and
DistributedDataParallel scripts on the same data and model, with accel_train beside them.

The three scripts are benchmarks/anchors/seed_tutorial.py in its three modes: the article's loops
with its data path (PIL + ToTensor per sample in DataLoader workers, every epoch) and Adam at
0.01.  The article trains resnet50d at 336 px on 4 A10 GPUs; on this CPU machine the same loops
run a smaller timm model at CIFAR's native 32 px over the first --images training images, with
the same global batch in every arm (the article raised it to 224/256 for DataParallel/DDP).

nn.DataParallel only differs from the standalone loop with more than one GPU: with none (or
one) it calls the module directly.  The table says so instead of inventing a number, and its
measured row is the standalone loop again under another name.

    python benchmarks/bench_seed.py --quick
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

SEED_SCRIPT = benchlib.ANCHORS / "seed_tutorial.py"


def seed_arm(mode: str, procs: int, args) -> dict:
    threads = max(1, (os.cpu_count() or 1) // procs)
    launcher = benchlib.torchrun(procs, benchlib.free_port()) if mode == "ddp" \
        else [sys.executable]
    cmd = [*launcher, str(SEED_SCRIPT), "--mode", mode, "--data-dir", args.data_dir, "--data",
           "decode", "--model", args.model, "--batch-size", str(args.global_batch // procs),
           "--max-train-samples", str(args.images), "--epochs", str(args.epochs), "--workers",
           str(args.workers), "--optimizer", "adam", "--lr", "0.01", "--log-every", "1000000"]
    result = benchlib.last_json_line(benchlib.run(cmd, env=benchlib.child_env(threads)).stdout)
    return {"epoch_times": result["epoch_times"], "note": result["note"], "threads": threads}


def accel_arm(procs: int, args, work: Path) -> dict:
    threads = max(1, (os.cpu_count() or 1) // procs)
    out = Path(tempfile.mkdtemp(prefix="run-", dir=work)) / "run"
    launcher = benchlib.accelerate_launch(procs, benchlib.free_port()) if procs > 1 \
        else [sys.executable]
    cmd = [*launcher, "-m", "accel_train", "--data-dir", args.data_dir, "--output-dir", str(out),
           "--model", args.model, "--batch-size", str(args.global_batch // procs),
           # the first N, as the tutorial's arms take them
           "--max-train-samples", str(args.images), "--sample-subset", "first",
           "--max-eval-samples", "64", "--epochs",
           str(args.epochs), "--progress", "log", "--no-plots", *benchlib.FIXED_COMPUTE]
    benchlib.run(cmd, env=benchlib.child_env(threads))
    epochs = [r for r in benchlib.read_jsonl(out / "metrics.jsonl") if r.get("type") == "epoch"]
    return {"epoch_times": [r["epoch_time"] for r in epochs], "note": None, "threads": threads}


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--images", type=int, default=None, help="training images per epoch")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=None, help="loader workers (seed: 48)")
    parser.add_argument("--arms", nargs="*", default=None,
                        choices=["standalone", "dataparallel", "ddp", "accel1", "accel2"],
                        help="a subset of the arms (default: all)")
    parser.add_argument("--tmp", default=tempfile.gettempdir())
    args = parser.parse_args()
    benchlib.check_cifar(args.data_dir)
    args.images = args.images or (1024 if args.quick else 4096)
    args.epochs = args.epochs or 2
    args.workers = args.workers if args.workers is not None else min(4, os.cpu_count() or 1)
    report = benchlib.Report("seed", "The seed tutorial's comparison: standalone vs "
                             "DataParallel vs DDP", args)
    work = Path(tempfile.mkdtemp(prefix="bench-seed-", dir=args.tmp))
    gpus = torch.cuda.device_count()
    arms = [("standalone", "seed standalone (1 process)", lambda: seed_arm("standalone", 1, args)),
            ("dataparallel", "seed nn.DataParallel (1 process)",
             lambda: seed_arm("dataparallel", 1, args)),
            ("ddp", "seed DDP (torchrun, 2 processes)", lambda: seed_arm("ddp", 2, args)),
            ("accel1", "accel_train (1 process)", lambda: accel_arm(1, args, work)),
            ("accel2", "accel_train (accelerate launch, 2 processes)",
             lambda: accel_arm(2, args, work))]
    results = {name: run() for key, name, run in arms if not args.arms or key in args.arms}
    first = next(iter(results.values()))
    standalone = results.get("seed standalone (1 process)", first)["epoch_times"][-1]
    rows = []
    for name, r in results.items():
        last = r["epoch_times"][-1]
        shown = name
        if "DataParallel" in name and gpus <= 1:
            shown += f" = standalone ({gpus} GPU here)"
        rows.append([shown, r["threads"], " / ".join(f"{t:.1f}" for t in r["epoch_times"]),
                     last, standalone / last])
    notes = [f"{args.model}, {args.images} CIFAR-10 training images per epoch at 32 px, global "
             f"batch {args.global_batch}; seed scripts: Adam 0.01, PIL + ToTensor per sample in "
             f"{args.workers} loader workers (the article: resnet50d, 336 px, 48 workers, 4 A10s)",
             "accel_train: its defaults (data decoded once into memory, batched random crop + "
             "flip, SGD + cosine schedule), same model and global batch; epoch time excludes its "
             "evaluation, as the seed scripts have none",
             "speed-up = standalone's last epoch / this arm's last epoch (the first epoch "
             "includes worker start-up)"]
    if gpus <= 1:
        notes.insert(0, f"nn.DataParallel differs from standalone only with more than one GPU; "
                        f"this machine has {gpus}, so DataParallel runs the module directly and "
                        f"its row measures the standalone loop again (no multi-GPU number is "
                        f"invented)")
    report.table("Epoch time: the seed's three scripts and accel_train",
                 ["arm", "threads/proc", "epoch times s", "last epoch s",
                  "speed-up vs standalone"], rows, notes=notes)
    report.data["result"] = results
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
