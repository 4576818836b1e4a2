"""--max-train-samples / --max-eval-samples: which images of a split a limit keeps.

'random' (the default) keeps the images Hugging Face's example scripts keep,
`split.shuffle(seed=SUBSET_SEED).select(range(N))`, with a fixed seed: every class in about its
share, and the same images for every --seed and every later command that rebuilds the run's
data (eval).  'first' keeps the first N in the data's order: of an image folder, listed class by
class, that can be a single class.  The kept images stay in the data's order (a parquet file is
read front to back); only which ones are kept depends on the rule.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

SUBSET_SEED = 0  # fixed, as the validation carve's: the kept images must not change with --seed


def cuts(length: int, limit: Optional[int]) -> bool:
    """Whether `limit` keeps fewer than a split's `length` images."""
    return bool(limit) and limit < length


def kept_positions(length: int, limit: Optional[int], how: str) -> Optional[np.ndarray]:
    """The positions (ascending) of a split of `length` images that `limit` keeps by rule
    `how`; None when the limit keeps them all."""
    if not cuts(length, limit):
        return None
    if how == "first":
        return np.arange(limit)
    # The permutation split.shuffle(seed=SUBSET_SEED) applies is numpy's
    # default_rng(seed).permutation(length) (datasets' Dataset.shuffle, which the tests hold this
    # to): drawn here directly, because importing datasets costs every process that trains on
    # in-memory tensors 0.7 s of start-up
    permutation = np.random.default_rng(SUBSET_SEED).permutation(length)
    return np.sort(permutation[:limit])


def limit_rows(rows: np.ndarray, limit: Optional[int], how: str) -> np.ndarray:
    """The rows of a split (their numbers in the data) that `limit` keeps."""
    kept = kept_positions(len(rows), limit, how)
    return rows if kept is None else rows[kept]


def subset_if_cut(config, *splits: tuple[int, Optional[int]]) -> Optional[str]:
    """config.sample_subset where a limit cuts one of `splits` ((length, limit) each), else
    None."""
    return config.sample_subset if any(cuts(*split) for split in splits) else None


def few_classes_kept(limits: dict, labels: dict, num_classes: int, how: str) -> list[str]:
    """A warning for each split whose kept images hold fewer of the classes than it has images
    enough for.  `limits`: role -> (flag, limit); `labels`: role -> the kept images' labels."""
    warnings = []
    for role, (flag, limit) in limits.items():
        if not limit or role not in labels:
            continue
        present = len(torch.unique(torch.as_tensor(labels[role])))
        if present < num_classes and len(labels[role]) >= num_classes:
            split = {"train": "training", "held-out": "validation", "test": "test"}[role]
            why = ("the data lists its images in order, an image folder class by class; "
                   "--sample-subset random draws them from the whole split" if how == "first"
                   else "drawn at random from the whole split")
            warnings.append(f"{flag} {limit} keeps {len(labels[role])} {split} images "
                            f"({how}), which hold {present} of the {num_classes} classes "
                            f"({why}); its numbers say little of the others")
    return warnings
