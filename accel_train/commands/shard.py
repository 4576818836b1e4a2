"""`accel-train shard --data-dir SRC --output DIR [--shard-size 256MB | --samples-per-shard N]`:
any data the trainer reads (an image folder, parquet files, a save_to_disk folder, or the
embedded synthetic set with --dataset synthetic) -> WebDataset tar shards plus an index.

DIR/train/000000.tar, ... and DIR/<held-out split>/000000.tar, ... hold `KEY.jpg` (or .png,
the image file's own bytes, unchanged; generated images as PNG; with --max-side N, images
whose longer side exceeds N stored at N: streaming/max_side.py) and `KEY.cls` (the class index);
DIR/index.json lists every shard with its sample count, the class names and the splits.  The
splits are the data's own: train and its validation split, else its test split (CIFAR-10's),
else --val-fraction carved off as the trainer carves it; a split without labels (-1 in every
row) is left out.  Folders labelled by files (--train-labels, --val-labels) or classes named by
a higher folder level (--class-depth) are read as training reads them.  Train on the result
with `accel-train --data-dir DIR`, which selects on the held-out split the shards hold.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Sequence

from accel_train.cli import _Parser, add_read_timeout, read_timeout_checked, stop_on_a_stuck_read
from accel_train.base.errors import UsageError

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text or "")
    if not match or match.group(2).upper() not in SIZE_UNITS:
        raise UsageError(f"--shard-size {text!r}: expected a size such as 256MB, 1GB or 64KiB")
    size = int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])
    if size < 4096:
        raise UsageError(f"--shard-size {text!r} is too small: use 4KB or more")
    return size


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accel-train shard", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", metavar="SRC",
                        help="the data to convert (what --data-dir reads when training)")
    parser.add_argument("--dataset", default=None,
                        help="'synthetic' for the embedded set (or a hub id) instead of --data-dir")
    parser.add_argument("--synthetic-train-size", type=int, default=4000,
                        help="training images of the synthetic set (default: 4000)")
    parser.add_argument("--output", "-o", required=True, metavar="DIR",
                        help="a new (or empty) folder for the shards and index.json")
    parser.add_argument("--shard-size", default=None, metavar="SIZE",
                        help="largest shard in bytes, e.g. 256MB (default: 256MB unless "
                             "--samples-per-shard is given)")
    parser.add_argument("--samples-per-shard", type=int, default=None, metavar="N",
                        help="at most N samples per shard")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="held out when SRC has no held-out split (as training carves it)")
    parser.add_argument("--val-stratify", action="store_true",
                        help="carve --val-fraction class by class (as training's --val-stratify)")
    parser.add_argument("--train-labels", metavar="FILE", default=None,
                        help="label file of training images not sorted into class folders, "
                             "as for training")
    parser.add_argument("--val-labels", metavar="FILE", default=None,
                        help="label file of a held-out folder of unlabelled images, as for "
                             "training")
    parser.add_argument("--class-depth", type=int, metavar="N", default=None,
                        help="image folders: the folder level under the split folder that "
                             "names the class (1: the top level), as for training")
    parser.add_argument("--image-column", default=None)
    parser.add_argument("--label-column", default=None)
    parser.add_argument("--max-side", type=int, metavar="N", default=None,
                        help="store images whose longer side exceeds N pixels at N (the aspect "
                             "kept; JPEGs as JPEG quality 95, others as PNG), decoded as "
                             "training decodes them: large photos then decode fast at every "
                             "step (e.g. 512 for training at 224 px; default: every file as "
                             "it is)")
    add_read_timeout(parser, "shard")
    parser.add_argument("--no-progress", action="store_true", help="no progress line")
    return parser


def _samples(args):
    """(class names, source description, {split: iterator of (bytes, ext, label)}, counts)."""
    from accel_train.config import SYNTHETIC_DATASET, TrainConfig
    from accel_train.data.streaming import image_ext, png_bytes
    # built first: it refuses label files without --data-dir (the synthetic set would be
    # sharded, the files unread)
    config = TrainConfig(data_dir=args.data_dir, dataset=args.dataset or SYNTHETIC_DATASET,
                         val_fraction=args.val_fraction, image_column=args.image_column,
                         label_column=args.label_column, train_labels=args.train_labels,
                         val_labels=args.val_labels, class_depth=args.class_depth)
    if args.data_dir is None and (args.dataset or SYNTHETIC_DATASET) == SYNTHETIC_DATASET:
        from accel_train.data import synthetic
        parts = synthetic.splits(args.synthetic_train_size)

        def generated(images, labels):
            for pixels, label in zip(images, labels):
                yield png_bytes(pixels), "png", int(label)
        return (list(synthetic.CLASS_NAMES), "synthetic shapes (embedded)",
                {split: generated(*parts[split]) for split in ("train", "test")},
                {split: len(parts[split][1]) for split in ("train", "test")})
    from accel_train.data.decode import Unreadable, decode, read_value
    from accel_train.data.labels import labels_and_names, set_aside_unlabelled_splits
    from accel_train.data.sources import (find_columns, image_files, open_data, pick_splits,
                                          rows_of, training_split_name)
    raw = open_data(config)
    train_split = training_split_name(raw)
    _, label_column = find_columns(raw.splits[train_split], config)
    for warning in set_aside_unlabelled_splits(raw, label_column, train_split):
        print(f"warning: {warning}", file=sys.stderr)
    # The data's own splits as they are (train, its validation split and its test split; a
    # carved validation split only where there is neither): shards are a copy of the data, not
    # of one run's roles.
    splits = pick_splits(raw, config.val_fraction, label_column, select_on_test=True,
                         stratify=args.val_stratify)
    train_name, train_rows = splits.train_name, splits.train_rows
    eval_name, eval_rows = splits.eval_name, splits.eval_rows
    parts = {"train": rows_of(raw.splits[train_name], train_rows),
             "eval": rows_of(raw.splits[eval_name], eval_rows)}
    if splits.test_name is not None:  # beside a validation split
        parts["test"] = raw.splits[splits.test_name]
    image_column, label_column = find_columns(parts["train"], config)
    labels, class_names = labels_and_names(parts, label_column)
    out_eval = eval_name if eval_name != train_name else "validation"
    names = {"train": "train", "eval": out_eval, "test": splits.test_name}

    def rows(dataset, split_labels):
        column = image_files(dataset, image_column).select_columns([image_column]) \
            .with_format("arrow")
        row = 0
        for table in column.iter(batch_size=512):
            for value in table.column(0).to_pylist():
                try:
                    data = read_value(value, raw.root)
                    if not isinstance(data, bytes):  # a pixel array's PIL image
                        # as training decodes it (alpha over white), not convert("RGB")'s
                        data = png_bytes(decode(data).permute(1, 2, 0).numpy())
                except Unreadable as err:
                    raise UsageError(f"{raw.origin} row {row}: {err.reason}") from None
                path = value.get("path") if isinstance(value, dict) else None
                ext = image_ext(data, path)
                yield data, ext, int(split_labels[row])
                row += 1
    return (class_names, f"{raw.origin}",
            {names[part]: rows(dataset, labels[part]) for part, dataset in parts.items()},
            {names[part]: len(dataset) for part, dataset in parts.items()})


def convert(args, say=print) -> Path:
    from accel_train.data.streaming import ShardWriter, write_index
    from accel_train.data.streaming.max_side import check_max_side, within_max_side
    output = Path(args.output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UsageError(f"--output {output} already exists and is not an empty folder; choose "
                         f"a new one")
    if args.samples_per_shard is not None and args.samples_per_shard < 1:
        raise UsageError(f"--samples-per-shard must be >= 1 (got {args.samples_per_shard})")
    max_bytes = parse_size(args.shard_size) if args.shard_size else \
        (None if args.samples_per_shard else parse_size("256MB"))
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise UsageError(f"--data-dir {args.data_dir}: no such folder")
    max_side = check_max_side(args.max_side)
    class_names, origin, splits, counts = _samples(args)  # raises before anything is written
    total = sum(counts.values())
    done, started, last = 0, time.monotonic(), 0.0
    show = not args.no_progress
    # A terminal gets one line rewritten in place twice a second; a file or pipe (a job's log)
    # a line every ten seconds, as the trainer's own progress does off a terminal.
    terminal = sys.stderr.isatty()
    every, ending = (0.5, "") if terminal else (10.0, "\n")
    written: dict[str, list[dict]] = {}
    resized = 0
    tmp = output.with_name(output.name + ".partial")
    if tmp.exists():
        import shutil
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        for split, samples in splits.items():
            writer = ShardWriter(tmp / split, tmp, max_bytes, args.samples_per_shard)
            for data, ext, label in samples:
                if max_side is not None:
                    data, ext, smaller = within_max_side(data, ext, max_side)
                    resized += smaller
                writer.write(data, ext, label)
                done += 1
                now = time.monotonic()
                if show and (now - last > every or done == total):
                    last = now
                    rate = done / max(now - started, 1e-6)
                    print(f"{chr(13) if terminal else ''}shard: {done:,}/{total:,} images "
                          f"({done / max(total, 1):.0%}), {split} shard "
                          f"{len(writer.entries)}, {rate:,.0f} images/s",
                          end=ending, file=sys.stderr, flush=True)
            writer.close()
            written[split] = writer.entries
        write_index(tmp, written, class_names, origin)
    except BaseException:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if show and terminal:
        print(file=sys.stderr)
    if output.exists():
        output.rmdir()
    tmp.rename(output)
    shards = sum(len(v) for v in written.values())
    say(f"wrote {total:,} images in {shards} shard(s) to {output} ("
        + ", ".join(f"{split}: {sum(e['count'] for e in entries):,} in {len(entries)}"
                    for split, entries in written.items())
        + ")" + (f"; {resized:,} stored at a longer side of {max_side} px (--max-side)"
                 if max_side is not None else "")
        + f"; train with: accel-train --data-dir {output}")
    return output


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.data_dir is None and args.dataset is None:
        raise UsageError("pass --data-dir SRC (or --dataset synthetic)")
    read_timeout_checked(args.read_timeout)
    # A file that never answers ends the process (its read cannot be interrupted): the
    # .partial folder stays, and the next start on the same --output removes it first.
    with stop_on_a_stuck_read(args.read_timeout, "--read-timeout",
                              f"writing shards to {args.output}"):
        convert(args)
    return 0
