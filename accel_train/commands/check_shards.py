"""`accel-train check-data --data-dir SHARDS`: the same findings for streaming shards.

A shard folder (WebDataset tars, or `accel-train shard`'s tars with their index.json) is read
as a streaming run reads it (data/streaming: open_shards, iter_shard) and every sample decoded
as that run decodes it, one shard per task in worker processes.  A sample is named as the run
names it ("000003.tar 000000017"), beside its split.  What a run would replace with a
substitute is unreadable here: an image that does not decode, a sample with no image or no
label (.cls); and a label that is none of the classes (training has no output for it).
Duplicates are the same image bytes in two splits.  Folders and parquet files: check_data.py.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np


def _check_shard(split: str, number: int, path: Path, num_classes: int,
                 columns: tuple = (None, None)) -> tuple:
    """(split, shard number, [(name, label or -1, width or None, height or reason, digest)]).
    Decoded one sample at a time: a shard may hold thousands of large photographs."""
    from accel_train.commands.check_data import one_read_done
    from accel_train.data.decode import Unreadable, decode
    from accel_train.data.streaming import iter_shard
    from accel_train.data.streaming.decoding import label_problem
    results = []
    for image, label, name in iter_shard(path, columns):  # (each sample's read noted)
        one_read_done()
        named = f"{path.name} {name}"
        digest = hashlib.blake2b(image, digest_size=16).digest() if image else None
        problem = label_problem(label, num_classes)  # as the run finds it
        if problem is not None:
            results.append((named, -1, None, problem, digest))
            continue
        if image is None:  # of its class, for the classes left with no readable image
            results.append((named, int(label), None, "no image (no member with an image "
                                                     "file's extension)", digest))
            continue
        try:
            pixels = decode(image)
            results.append((named, int(label), int(pixels.shape[2]), int(pixels.shape[1]),
                            digest))
        except Unreadable as err:
            results.append((named, int(label), None, err.reason, digest))
    return split, number, results


def check_shards(config, workers: int, progress, read_timeout: float) -> dict:
    """Every sample of every split decoded; check_data's findings, as a JSON-ready dict.
    `progress(total)`: an object with update(count) and close(); a read stuck for
    `read_timeout` seconds stops check-data (check_data.in_workers)."""
    from accel_train.commands.check_data import in_workers, uneven_classes
    from accel_train.data.labels import classes_left_unreadable
    from accel_train.data.streaming import open_shards
    started = time.perf_counter()
    data = open_shards(config)
    splits = {"train": data.train, data.eval_name: data.held_out,
              **({"test": data.test} if data.test is not None else {})}
    names, num_classes = data.class_names, len(data.class_names)
    tasks = [(split, number, path, num_classes, shards.columns)
             for split, shards in splits.items()
             for number, path in enumerate(shards.files)]
    per_shard: dict[tuple[str, int], list] = {}
    bar = progress(sum(len(shards) for shards in splits.values()))
    try:
        for split, number, results in in_workers(_check_shard, tasks, workers, read_timeout):
            per_shard[split, number] = results
            bar.update(len(results))
    finally:
        bar.close()
    # each split's samples in the run's order (shards as listed, samples as stored)
    samples = {split: [s for number in range(len(shards.files)) for s in per_shard[split, number]]
               for split, shards in splits.items()}
    unreadable, by_digest, sizes = [], defaultdict(list), []
    for split, rows in samples.items():
        for index, (name, _, width, second, digest) in enumerate(rows):
            if width is None:
                unreadable.append({"split": split, "image": name, "reason": second})
            else:
                sizes.append((width, second))
            if digest is not None:
                by_digest[digest].append((split, index, name))
    labels = {split: np.array([row[1] for row in rows], dtype=np.int64)
              for split, rows in samples.items()}
    counts = {split: np.bincount(values[values >= 0], minlength=num_classes).tolist()
              for split, values in labels.items()}
    # in the order the first copy of each comes in the run's order
    duplicates = [[{"split": s, "image": name} for s, _, name in sorted(places)]
                  for places in by_digest.values() if len({s for s, _, _ in places}) > 1]
    # (open_shards refuses shards without held-out ones: there are always two splits or more)
    one_split = {name: next(s for s in counts if counts[s][c]) for c, name in enumerate(names)
                 if sum(1 for s in counts if counts[s][c]) == 1}
    broken_train = [i for i, row in enumerate(samples["train"]) if row[2] is None]
    no_readable = [names[c] for c in classes_left_unreadable(labels["train"], broken_train,
                                                             num_classes)]
    readable = np.array(sizes, dtype=np.int64).reshape(-1, 2)
    findings = {
        "data": data.origin, "images": int(sum(len(rows) for rows in samples.values())),
        "splits": {split: len(rows) for split, rows in samples.items()},
        "classes": names,
        "class_counts": {split: dict(zip(names, c)) for split, c in counts.items()},
        "unreadable": sorted(unreadable, key=lambda u: (u["split"], u["image"])),
        "sizes": {axis: _spread(readable[:, k]) for k, axis in enumerate(("width", "height"))},
        "duplicates_across_splits": duplicates,
        "classes_in_one_split": one_split,
        "unlabelled": {},  # a sample without a label is unreadable: the run replaces it
        "too_few_classes": False,  # open_shards refuses fewer than 2 classes
        "uneven_classes": uneven_classes(counts.get("train"), names),
        "classes_without_a_readable_training_image": no_readable,
        "files_not_read": {}, "photos_not_read": {},
        "workers": workers, "seconds": round(time.perf_counter() - started, 2)}
    findings["problems"] = len(unreadable) + len(duplicates) + len(one_split) + len(no_readable)
    return findings


def _spread(values: np.ndarray) -> Optional[dict]:
    if not len(values):
        return None
    return {"min": int(values.min()), "median": float(np.median(values)),
            "max": int(values.max())}
