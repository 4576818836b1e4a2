"""Start-up on large image folders: seconds to the loaded index and to the first training step,
and resident memory, for generated folders of 10k, 100k and 1M tiny image files; a first start
(the folder walked) and a repeated start (the cached index), beside the anchor, Hugging Face's
imagefolder builder (`datasets.load_dataset("imagefolder")`, which the trainer used before).

Every figure comes from a fresh process, as a user's start would: `index` is `load_data` on the
folder (`--in-memory never`, so that no image is decoded) timed inside the process after its
imports, with its resident memory before and after; `first step` is the whole training command
with `--max-steps 1` (start-up, the one step, an evaluation of 32 images, saving the weights),
timed from outside, with its peak resident memory (wait4's ru_maxrss).  "First start" empties
the index cache first (ACCEL_TRAIN_INDEX_CACHE points to a folder of this benchmark's); the
kernel's directory cache stays warm (the folders were just written, and dropping the page cache
of a shared machine is not ours to do), so a first start on a cold disk takes longer.

    python benchmarks/bench_index.py --sizes 10000 100000 1000000
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

INDEX_CHILD = """
import json, os, resource, sys, time
started = time.perf_counter()
from accel_train.config import TrainConfig
from accel_train.data.sources import load_data
import datasets, pyarrow  # what both arms import first: not part of the index's cost
imported = time.perf_counter()
def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before = rss()
if sys.argv[2] == "ours":
    data = load_data(TrainConfig(data_dir=sys.argv[1], in_memory="never"))
    count = len(data.train) + len(data.held_out)
else:
    import datasets
    datasets.disable_progress_bars()
    count = len(datasets.load_dataset("imagefolder", data_dir=sys.argv[1])["train"])
done = time.perf_counter()
print(json.dumps({"bench": {"imports": imported - started, "index": done - imported,
                            "images": count, "rss_before": before, "rss_after": rss(),
                            "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def tiny_png() -> bytes:
    from PIL import Image
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (90, 120, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def generate(root: Path, count: int) -> float:
    """`count` tiny PNG files in train/ (one class folder per 1,000 files, at least 10) and a
    tenth as many in val/; seconds taken (skipped when the folder is already complete)."""
    marker = root / ".complete"
    if marker.exists():
        return float("nan")
    shutil.rmtree(root, ignore_errors=True)
    started = time.perf_counter()
    blob = tiny_png()
    classes = max(10, count // 1000)
    for split, total in (("train", count), ("val", count // 10)):
        for c in range(classes):
            folder = root / split / f"class{c:04d}"
            folder.mkdir(parents=True)
            for i in range(total // classes):
                with open(folder / f"img{i:07d}.png", "wb") as handle:
                    handle.write(blob)
    # A folder changed in the last seconds is not cached (its mtime may not show a change yet):
    # wait that out, as any folder copied a while before training would be.
    time.sleep(2.5)
    marker.write_text("")
    return time.perf_counter() - started


def index_start(folder: Path, cache: Path, how: str) -> dict:
    env = benchlib.child_env(threads=1, ACCEL_TRAIN_INDEX_CACHE=str(cache))
    result = benchlib.run([sys.executable, "-c", INDEX_CHILD, str(folder), how], env=env,
                          timeout=7200)
    return benchlib.last_json_line(result.stdout)["bench"]


def first_step(folder: Path, cache: Path, out: Path) -> dict:
    """Wall seconds and peak RSS of a 1-step training command."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "accel_train", "--data-dir", str(folder), "--in-memory",
           "never", "--num-workers", "0", "--max-steps", "1", "--model", "test_resnet",
           "--batch-size", "32", "--max-eval-samples", "32", "--no-plots", "--progress", "log",
           "--output-dir", str(out), *benchlib.FIXED_COMPUTE]
    env = benchlib.child_env(threads=1, ACCEL_TRAIN_INDEX_CACHE=str(cache))
    started = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=benchlib.REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        tail = out.with_suffix(".log").read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{tail}")
    return {"seconds": seconds, "max_rss": usage.ru_maxrss / 1024}


def _median_of(results: list[dict]) -> dict:
    """Each figure's median over the repeats (counts are the same in all)."""
    return {key: benchlib.median([r[key] for r in results]) for key in results[0]}


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000],
                        help="training images per generated folder (the held-out folder gets a "
                             "tenth as many)")
    parser.add_argument("--tmp", default="/tmp",
                        help="where the folders are generated (in bench_index/, kept for the "
                             "next run but with --quick)")
    parser.add_argument("--anchor-max", type=int, default=100_000,
                        help="largest folder the anchor (datasets' imagefolder) is run on")
    parser.add_argument("--repeats", type=int, default=3,
                        help="starts of each kind of ours (the median is shown)")
    parser.add_argument("--no-first-step", action="store_true",
                        help="skip the training-command arms")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.anchor_max = [min(args.sizes[0], 2000)], min(args.anchor_max, 2000)
        args.repeats = 1
    report = benchlib.Report("index", "Start-up on large image folders", args)
    root = Path(args.tmp) / "bench_index"
    rows, raw = [], {}
    for size in args.sizes:
        folder, cache = root / f"folder_{size}", root / f"cache_{size}"
        made = generate(folder, size)
        images = size + size // 10
        runs: dict[str, list] = {"ours, first start": [], "ours, repeated start": []}
        step_runs: dict[str, list] = {"ours, first start": [], "ours, repeated start": []}
        for _ in range(args.repeats):  # first (cache emptied) and repeated, in turn
            shutil.rmtree(cache, ignore_errors=True)
            runs["ours, first start"].append(index_start(folder, cache, "ours"))
            runs["ours, repeated start"].append(index_start(folder, cache, "ours"))
            if not args.no_first_step:
                shutil.rmtree(cache, ignore_errors=True)
                step_runs["ours, first start"].append(
                    first_step(folder, cache, root / f"run_{size}_a"))
                step_runs["ours, repeated start"].append(
                    first_step(folder, cache, root / f"run_{size}_b"))
        if size <= args.anchor_max:  # minutes per start: once each
            runs["datasets imagefolder, first start"] = [index_start(folder, cache, "datasets")]
            runs["datasets imagefolder, repeated start"] = [
                index_start(folder, cache, "datasets")]
        arms = {name: _median_of(results) for name, results in runs.items()}
        steps = {name: _median_of(results) for name, results in step_runs.items() if results}
        anchor = arms.get("datasets imagefolder, first start")
        for name, result in arms.items():
            assert int(result["images"]) in (images, size), (name, result["images"])
            step = steps.get(name, {})
            rows.append([f"{size:,}", name, result["index"],
                         anchor["index"] / result["index"] if anchor else float("nan"),
                         result["rss_after"] - result["rss_before"], result["max_rss"],
                         step.get("seconds", float("nan")), step.get("max_rss", float("nan"))])
        raw[size] = {"generated_seconds": made, "index": runs, "first_step": step_runs}
        print(json.dumps({"size": size, **raw[size]}), flush=True)
    report.table(
        "Seconds to the loaded index and to the first training step, and memory",
        ["training images", "start", "index s", "x faster than datasets' first start",
         "index memory MB", "peak RSS MB (index process)", "first-step command s",
         "first-step peak RSS MB"], rows,
        notes=["index s: `load_data` (folder walk or cache, the Arrow table, splits, labels) "
               "after the imports of accel_train, datasets and pyarrow (the same for every "
               "arm); the held-out folder holds a tenth as many images again",
               "index memory: resident memory after the index minus before it",
               "first-step command: `python -m accel_train --in-memory never --max-steps 1` "
               "(test_resnet, batch 32, 32 held-out images evaluated), start to exit",
               f"ours: the median of {args.repeats} starts of each kind; datasets' "
               f"imagefolder: one of each (minutes per start at 100k)",
               "repeated start: the index read back from its cache (memory-mapped Arrow) after "
               "checking every folder's mtime; datasets' imagefolder has no such cache"])
    report.data["raw"] = raw
    report.save()
    if args.quick:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
