"""Evaluation at each epoch's end, with the held-out photos decoded by the loader workers every
time (--data-on-device never) and with their batches kept on the device after the first
(always, where the training set is held there): the seconds each evaluation takes.

Runs of the command line, as users run it, on a folder of ImageNet-sized photos
(make_imagenet_like.py) with a validation split larger than the training one (photo data sets'
often are); each run's metrics.jsonl gives every epoch end's `eval_time`.  Per arm: the first
evaluation (from the loader on both arms, workers starting), the median of the later ones, and
their held-out images a second; the ratio is the later evaluations' never / always, the arms
alternating in rounds.  On a CPU the model's forward passes are a large share of an evaluation;
on a GPU they are a small one, and the decoding the loader workers redo the larger.

    python benchmarks/bench_held_out.py --quick
    python benchmarks/bench_held_out.py --val-per-class 60 --epochs 5 --rounds 3
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import make_imagenet_like as imagenet_like  # noqa: E402

ARMS = {"from the loader (--data-on-device never)": "never",
        "kept after the first (--data-on-device always)": "always"}
CLASSES = 4


def eval_times(root: Path, mode: str, args, out: Path) -> list[float]:
    """Each epoch end's evaluation seconds of one run."""
    benchlib.run([sys.executable, "-m", "accel_train", "--data-dir", root, "--model",
                  args.model, "--image-size", args.size, "--batch-size", args.batch,
                  "--epochs", args.epochs, "--data-on-device", mode, "--in-memory", "never",
                  "--num-workers", args.workers, "--output-dir", out, "--progress", "log",
                  *benchlib.FIXED_COMPUTE], timeout=1800)
    records = benchlib.read_jsonl(out / "metrics.jsonl")
    return [r["eval_time"] for r in records if r.get("type") == "epoch" and "eval_time" in r]


def main() -> None:
    parser = benchlib.make_parser(__doc__, data_dir=None)
    parser.add_argument("--val-per-class", type=int, default=None,
                        help=f"held-out photos made per class ({CLASSES} classes)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--model", default="test_resnet")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    per_class = args.val_per_class or (6 if args.quick else 50)
    args.epochs = args.epochs or (2 if args.quick else 4)
    rounds = args.rounds or (1 if args.quick else 2)
    report = benchlib.Report("held_out", "Evaluation from the loader every time against "
                             "batches kept on the device after the first", args)
    with tempfile.TemporaryDirectory(prefix="held_out_") as tmp:
        root = Path(tmp) / "photos"
        # one global batch of training photos a class: the epochs are the evaluations' frame
        imagenet_like.make_folder(root, CLASSES, max(2, args.batch // CLASSES),
                                  val_per_class=per_class)
        images = CLASSES * per_class
        times: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
        for number, order in enumerate(benchlib.round_orders(list(ARMS), rounds)):
            for arm in order:
                out = Path(tmp) / f"run-{ARMS[arm]}-{number}"
                times[arm].append(eval_times(root, ARMS[arm], args, out))
    later = {arm: [t for run in runs for t in run[1:]] for arm, runs in times.items()}
    never = benchlib.median(later[list(ARMS)[0]])
    rows = []
    for arm, runs in times.items():
        first = benchlib.median([run[0] for run in runs])
        rest = benchlib.median(later[arm])
        rows.append([arm, first, rest, images / rest, never / rest])
    report.table(f"{args.model} at {args.size} px, {images} held-out photos of ImageNet's "
                 f"sizes, batch {args.batch}, {args.workers} loader worker(s), "
                 f"{args.epochs} epochs x {rounds} round(s) per arm",
                 ["held-out batches", "first evaluation (s)", "later evaluations (s, median)",
                  "held-out img/s (later)", "speed-up (later, vs never)"], rows,
                 notes=["each evaluation's seconds: the epoch record's eval_time "
                        "(metrics.jsonl), fp32 NCHW"])
    report.data["eval_times"] = times
    report.save()


if __name__ == "__main__":
    main()
