"""`accel-train check-data --data-dir DIR`: decode every image before training and say what is
wrong with the data.

Reads the data as training would (image folders with their layouts, parquet, save_to_disk, a
hub dataset, or streaming shards: check_shards.py), decodes every image of every split in
parallel worker processes (the machine's cores; --workers N), and reports: each unreadable image
and why, the images per class and split, the image sizes (min / median / max, after EXIF
orientation), files with the same bytes in two splits (a held-out image that is also a training
image), and classes found in one split only; classes of very uneven sizes, with the options made for
them (no problem).
A table, or one JSON object with --json.  Exit code 0: no problem found; 1: problems found
(unreadable images, duplicates across splits, classes in one split only); 2: bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from accel_train.cli import (RETRY_HINT, _Parser, add_read_timeout, read_timeout_checked,
                             stop_on_a_stuck_read)
from accel_train.base.columns import display_width, pad
from accel_train.base.errors import STALLED_EXIT, RunStopped, UsageError
from accel_train.data.imagefolder import PHOTO_FORMATS_NOT_OPENED
from accel_train.data.loader_watch import start_watch

CHUNK = 256  # images per task handed to a worker process
PLAIN_PROGRESS_SECONDS = 10.0  # between progress lines when stderr is not a terminal
_SOURCES: dict = {}  # split -> HFSource; set before the worker processes fork


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accel-train check-data", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data (as for training)")
    data.add_argument("--data-dir", help="local data: an image folder, parquet files, a "
                      "save_to_disk folder or a folder of streaming shards")
    data.add_argument("--dataset", help="a Hugging Face hub dataset id (instead of --data-dir)")
    data.add_argument("--image-column", help="image column (default: found by name/type)")
    data.add_argument("--label-column", help="label column (default: found by name/type)")
    data.add_argument("--val-labels", metavar="FILE", help="label file of a held-out folder of "
                      "unlabelled images (ImageNet's validation layout)")
    data.add_argument("--train-labels", metavar="FILE", help="label file of a folder of "
                      "training images not sorted into class folders (Kaggle's train.csv)")
    data.add_argument("--class-depth", type=int, metavar="N", help="image folders: the folder "
                      "level under the split folder that names the class (1: the top level)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="decoding processes (default: one per core, here "
                             f"{os.cpu_count() or 1})")
    add_read_timeout(parser, "check-data")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _config(args):
    from accel_train.config import SYNTHETIC_DATASET, TrainConfig
    if args.data_dir is None and args.dataset is None:
        raise UsageError("check-data needs the data: pass --data-dir DIR (or --dataset NAME)")
    if args.data_dir is None and args.dataset == SYNTHETIC_DATASET:  # not a hub id to look up
        raise UsageError(f"--dataset {SYNTHETIC_DATASET} is the embedded set, drawn in memory: "
                         f"it has no files to check; pass --data-dir DIR (or --dataset NAME, a "
                         f"hub id)")
    if args.workers < 1:
        raise UsageError(f"--workers must be a whole number >= 1 (got {args.workers})")
    read_timeout_checked(args.read_timeout)
    return TrainConfig(dataset=args.dataset or "synthetic", data_dir=args.data_dir,
                       image_column=args.image_column, label_column=args.label_column,
                       val_labels=args.val_labels, train_labels=args.train_labels,
                       class_depth=args.class_depth,
                       in_memory="never")


# -- decoding, in worker processes --------------------------------------------------------------
_last_read = None  # in a worker process: when any worker last finished reading an image


def _init_worker(last_read=None, read_timeout: float = 0.0) -> None:
    import torch
    torch.set_num_threads(1)  # one process per core already
    global _last_read
    _last_read = last_read
    start_watch("check-data worker", read_timeout)


def one_read_done() -> None:
    """After each image: the clock by which the parent process sees a read stuck."""
    if _last_read is not None:
        _last_read.value = time.monotonic()  # CLOCK_MONOTONIC: one clock for all processes


def _check_chunk(split: str, start: int, stop: int) -> tuple[str, int, list]:
    """Per image: (width, height, digest of its bytes) or (None, reason, digest or None)."""
    from accel_train.data.decode import Unreadable, decode, read_value
    source = _SOURCES[split]
    results = []
    for value in source.column[start:stop].column(0).to_pylist():
        digest = None
        try:
            item = read_value(value, source.root)
            if isinstance(item, bytes):
                digest = hashlib.blake2b(item, digest_size=16).digest()
            image = decode(item)
            results.append((int(image.shape[2]), int(image.shape[1]), digest))
        except Unreadable as err:
            results.append((None, err.reason, digest))
        one_read_done()
    return split, start, results


def _decode_all(sources: dict, workers: int, read_timeout: float):
    """Yields (split, start, results) for every chunk, in parallel when workers > 1."""
    tasks = [(split, start, min(start + CHUNK, len(source)))
             for split, source in sources.items() for start in range(0, len(source), CHUNK)]
    yield from in_workers(_check_chunk, tasks, workers, read_timeout)


def in_workers(work, tasks: list[tuple], workers: int, read_timeout: float):
    """Yields work(*task) for every task: here, in order, with one worker (or one task); else
    as each finishes in `workers` processes forked from this one.  A read stuck for
    `read_timeout` seconds ends check-data in one line, exit 75: here the watch of
    loader_watch.py ends the process (the read cannot be interrupted); with worker processes,
    the stuck worker names its read and this process stops once no worker has finished an
    image for that long (the others may still have been working)."""
    if workers == 1 or len(tasks) == 1:
        _init_worker()
        for task in tasks:  # (under main's watch: a stuck read ends the process)
            yield work(*task)
        return
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    # Forked workers inherit what the tasks read (memory-mapped Arrow, the folder index) as it is.
    forking = multiprocessing.get_context("fork")
    last_read = forking.RawValue("d", time.monotonic())
    with ProcessPoolExecutor(max_workers=workers, mp_context=forking, initializer=_init_worker,
                             initargs=(last_read, read_timeout)) as pool:
        pending = {pool.submit(work, *task) for task in tasks}
        while pending:
            done, pending = wait(pending, timeout=min(1.0, read_timeout / 10 or 1.0),
                                 return_when=FIRST_COMPLETED)
            for future in done:
                yield future.result()
            if pending and read_timeout and time.monotonic() - last_read.value >= read_timeout:
                pool.shutdown(wait=False, cancel_futures=True)
                for worker in multiprocessing.active_children():
                    worker.kill()  # SIGKILL: a read in the kernel may not return for SIGTERM
                raise RunStopped(f"no image read in {read_timeout:g} s (--read-timeout), "
                                 f"checking the data: a worker is stuck (its own line above "
                                 f"names what it was reading); exit {STALLED_EXIT}, {RETRY_HINT}",
                                 STALLED_EXIT)


class _Progress:
    """A bar on a terminal; otherwise a plain line every few seconds (both on stderr, so that
    --json output stays one object)."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm
        self.total, self.done = total, 0
        self.bar = tqdm(total=total, unit="img", file=sys.stderr, desc="decoding") \
            if sys.stderr.isatty() else None
        self.last = time.monotonic()

    def update(self, count: int) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(count)
        elif time.monotonic() - self.last >= PLAIN_PROGRESS_SECONDS:
            self.last = time.monotonic()
            print(f"checked {self.done:,} of {self.total:,} images "
                  f"({self.done / self.total:.0%})", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- the report -----------------------------------------------------------------------------------
def check(args) -> dict:
    """Every image decoded; the findings as a JSON-ready dict."""
    import numpy as np

    from accel_train.data.labels import (classes_left_unreadable, labels_and_names,
                                         left_out_unlabelled)
    from accel_train.data.folder_labels import metadata_labels_line
    from accel_train.data.sources import (HFSource, deepest_classes_spread, find_columns,
                                          folder_classes, open_data, training_split_name)
    from accel_train.data.streaming import is_shard_folder
    config = _config(args)
    if is_shard_folder(config.data_dir):
        from accel_train.commands.check_shards import check_shards
        return check_shards(config, args.workers, _Progress, args.read_timeout)
    started = time.perf_counter()
    raw = open_data(config)
    splits = {name: ds for name, ds in raw.splits.items() if len(ds)}
    image_column, label_column = find_columns(next(iter(splits.values())), config)
    labels, class_names = labels_and_names(splits, label_column)
    sources = {name: HFSource(ds, image_column, labels[name], name, names=raw.names[name],
                              root=raw.root) for name, ds in splits.items()}
    _SOURCES.clear()
    _SOURCES.update(sources)
    sizes = {name: np.zeros((len(source), 2), dtype=np.int64) for name, source in sources.items()}
    unreadable, by_digest = [], defaultdict(list)
    progress = _Progress(sum(len(source) for source in sources.values()))
    try:
        for split, start, results in _decode_all(sources, args.workers, args.read_timeout):
            for offset, (width, second, digest) in enumerate(results):
                if width is None:
                    unreadable.append((split, start + offset, second))
                else:
                    sizes[split][start + offset] = (width, second)
                if digest is not None:
                    by_digest[digest].append((split, start + offset))
            progress.update(len(results))
    finally:
        progress.close()
    readable = np.concatenate([sizes[s][sizes[s][:, 0] > 0] for s in sizes])
    labelled = {split: labels[split][labels[split] >= 0] for split in sources}
    counts = {split: np.bincount(labelled[split].numpy(), minlength=len(class_names)).tolist()
              for split in sources}
    train = training_split_name(raw)
    unlabelled = {split: len(labels[split]) - len(labelled[split]) for split in sources
                  if len(labelled[split]) < len(labels[split])}
    refused = [s for s, n in unlabelled.items()
               if not left_out_unlabelled(s, n, len(labels[s]), train)]
    duplicates = [[{"split": s, "image": sources[s].name(i)} for s, i in sorted(places)]
                  for places in by_digest.values() if len({s for s, _ in places}) > 1]
    with_labels = [s for s in counts if len(labelled[s])]  # an unlabelled split names no class
    one_split = {name: next(s for s in with_labels if counts[s][c]) for c, name in
                 enumerate(class_names)
                 if len(with_labels) > 1 and sum(1 for s in with_labels if counts[s][c]) == 1}
    # classes whose every training image is unreadable: training refuses them (in memory) or
    # would teach them only with other classes' images (decoded per step)
    no_readable = [class_names[c] for c in classes_left_unreadable(
        labels[train], [index for split, index, _ in unreadable if split == train],
        len(class_names))] if train in labels else []
    not_read = files_not_read(raw.root, [file for files in raw.metadata_labels.values()
                                         for file in files]) \
        if raw.root is not None else {}
    findings = {
        "data": raw.origin, "images": int(sum(len(s) for s in sources.values())),
        "splits": {split: len(source) for split, source in sources.items()},
        # {split: its metadata files} where they label it (Hugging Face's imagefolder layout)
        "labels_from": dict(raw.metadata_labels),
        "labels": metadata_labels_line(raw.metadata_labels),
        "classes": class_names,
        "class_counts": {split: dict(zip(class_names, c)) for split, c in counts.items()},
        "unreadable": [{"split": split, "image": sources[split].name(index), "reason": reason}
                       for split, index, reason in sorted(unreadable)],
        "sizes": {axis: ({"min": int(readable[:, k].min()),
                          "median": float(np.median(readable[:, k])),
                          "max": int(readable[:, k].max())} if len(readable) else None)
                  for k, axis in enumerate(("width", "height"))},
        "duplicates_across_splits": sorted(duplicates, key=lambda group: group[0]["image"]),
        "classes_in_one_split": one_split,
        "unlabelled": {split: {"rows": n, "of": len(labels[split]), "refused": split in refused}
                       for split, n in unlabelled.items()},
        "too_few_classes": len(class_names) < 2,
        "uneven_classes": uneven_classes(counts.get(train), class_names),
        "classes_without_a_readable_training_image": no_readable,
        # not a problem: the folders cannot tell which level was meant
        "classes_across_folders": deepest_classes_spread(raw, train)
        if folder_classes(raw, train, args.class_depth, args.train_labels)
        and train in raw.splits else None,
        "files_not_read": not_read,
        "photos_not_read": {k: n for k, n in not_read.items() if k in PHOTO_FORMATS_NOT_OPENED},
        "workers": args.workers, "seconds": round(time.perf_counter() - started, 2)}
    findings["problems"] = (len(findings["unreadable"]) + len(duplicates) + len(one_split)
                            + len(refused) + findings["too_few_classes"] + len(no_readable)
                            + sum(findings["photos_not_read"].values()))
    return findings


# The training split's largest class over its smallest from which check-data names the options
# for uneven classes (not a problem: the exit code stays): ImageNet's 732 to 1,300 images a
# class (1.8x) stays quiet, a folder of 45 photos of one class and 5 of another does not.
UNEVEN_RATIO = 3


def uneven_classes(train_counts, class_names: list[str]):
    """The smallest and the largest class of the training split (classes with images), where
    the largest holds UNEVEN_RATIO times the smallest's images or more; else None."""
    if train_counts is None:
        return None
    present = [(int(n), name) for n, name in zip(train_counts, class_names) if n > 0]
    if len(present) < 2:
        return None
    (low, low_name), (high, high_name) = min(present), max(present)
    if high < UNEVEN_RATIO * low:
        return None
    return {"smallest": {"class": low_name, "images": low},
            "largest": {"class": high_name, "images": high}, "ratio": round(high / low, 2)}


def files_not_read(root: Path, label_files=()) -> dict[str, int]:
    """{extension: count} of the files in an image folder that training does not read as
    images (PIL opens no such file; hidden files and __ folders left out, as training does),
    less the metadata files that label it (`label_files`, relative to root): those are read."""
    from accel_train.data.imagefolder import image_extensions, left_out
    extensions, counts = image_extensions(), defaultdict(int)
    for file in label_files:
        counts[os.path.splitext(file)[1].lower()] -= 1
    for _, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if not left_out(name, True)]
        for name in files:
            suffix = os.path.splitext(name)[1].lower()
            if not left_out(name, False) and suffix not in extensions:
                counts[suffix or "(no extension)"] += 1
    return dict(sorted((suffix, n) for suffix, n in counts.items() if n))


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def format_table(findings: dict) -> str:
    splits = list(findings["splits"])
    lines = [f"check-data {findings['data']}: {findings['images']:,} images in "
             f"{len(splits)} split(s) ("
             + ", ".join(f"{s} {n:,}" for s, n in findings["splits"].items())
             + f"), {len(findings['classes'])} classes; {findings['workers']} worker "
               f"process(es), {findings['seconds']:.1f}s", ""]
    if findings.get("labels"):  # a metadata file's, not the class folders'
        lines.insert(1, f"labels: {findings['labels']}")
    unreadable = findings["unreadable"]
    lines.append(f"unreadable images ({len(unreadable)})" + (":" if unreadable else ""))
    # padded by the columns a name shows at (CJK takes two), not its characters: columns.py
    width = max([display_width(u["image"]) for u in unreadable] or [0])
    lines += [f"  {pad(u['image'], width)}  {u['reason']}" for u in unreadable]
    names = findings["classes"]
    name_width = max(len("class"), len("total"), *(display_width(n) for n in names))
    columns = [max(display_width(s), 6) for s in splits]
    lines += ["", "images per class:",
              "  " + pad("class", name_width) + "".join(
                  "  " + " " * (w - display_width(s)) + s for s, w in zip(splits, columns))]
    for name in names:
        lines.append("  " + pad(name, name_width) + "".join(
            f"  {findings['class_counts'][s][name]:>{w},}" for s, w in zip(splits, columns)))
    lines.append("  " + pad("total", name_width) + "".join(
        f"  {findings['splits'][s]:>{w},}" for s, w in zip(splits, columns)))
    if findings.get("classes_across_folders"):
        lines.append(f"  note: {findings['classes_across_folders']}")
    uneven = findings["uneven_classes"]
    if uneven:
        low, high = uneven["smallest"], uneven["largest"]
        lines.append(f"  uneven: {low['class']} has {low['images']:,} training image(s), "
                     f"{high['class']} {high['images']:,} ({uneven['ratio']:g}x); for classes "
                     f"this uneven: --val-stratify, --class-weight balanced, --eval-metric "
                     f"mean_class_top1")
    lines += ["", "image sizes in pixels (after EXIF orientation):", "          min  median  max"]
    for axis in ("width", "height"):
        stats = findings["sizes"][axis]
        lines.append(f"  {axis:<6}" + ("  (no readable image)" if stats is None else
                                       f"{stats['min']:>5}  {_number(stats['median']):>6}  "
                                       f"{stats['max']:>3}"))
    duplicates = findings["duplicates_across_splits"]
    lines += ["", f"same file in two splits ({len(duplicates)})" + (":" if duplicates else "")]
    lines += ["  " + " = ".join(f"{d['image']} ({d['split']})" for d in group)
              for group in duplicates]
    one_split = findings["classes_in_one_split"]
    lines += ["", f"classes in one split only ({len(one_split)})" + (":" if one_split else "")]
    lines += [f"  {name}: {split} only" for name, split in one_split.items()]
    unlabelled = findings["unlabelled"]
    lines += ["", f"splits with rows without a label, -1, empty or NaN ({len(unlabelled)})"
              + (":" if unlabelled else "")]
    lines += [f"  {split}: {u['rows']:,} of {u['of']:,} rows (" +
              ("training refuses them" if u["refused"] else "no labels at all: training leaves "
               "the split out") + ")" for split, u in unlabelled.items()]
    refused = sum(u["refused"] for u in unlabelled.values())
    if findings["too_few_classes"]:
        lines += ["", f"{len(names)} class: training needs at least 2"]
    not_read = findings["files_not_read"]
    if not_read:
        lines += ["", f"files not read as images ({sum(not_read.values())}): "
                  + ", ".join(f"{suffix} {n}" for suffix, n in not_read.items())
                  + ("; photos among them: convert them to JPEG or PNG to train on them"
                     if findings["photos_not_read"] else "")]
    no_readable = findings["classes_without_a_readable_training_image"]
    if no_readable:
        lines += ["", f"classes none of whose training images can be read ({len(no_readable)}): "
                  + ", ".join(no_readable)]
    problems = findings["problems"]
    lines += ["", "result: no problems found" if not problems else
              f"result: {problems} problem(s): {len(unreadable)} unreadable image(s) (training "
              f"replaces each with a substitute, --bad-images), {len(duplicates)} file(s) in "
              f"two splits, {len(one_split)} class(es) in one split only, {refused} split(s) "
              f"partly unlabelled" + (", fewer than 2 classes" if findings["too_few_classes"]
                                      else "")
              + (f", {len(no_readable)} class(es) without a readable training image"
                 if no_readable else "")
              + (f", {sum(findings['photos_not_read'].values())} photo(s) in a format PIL "
                 f"does not open" if findings["photos_not_read"] else "")]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    # this process's own reads: the folders listed, and the images with --workers 1
    with stop_on_a_stuck_read(args.read_timeout, "--read-timeout", "checking the data"):
        findings = check(args)
    print(json.dumps(findings) if args.json else format_table(findings), flush=True)
    return 1 if findings["problems"] else 0
