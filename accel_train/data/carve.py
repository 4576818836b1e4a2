"""The validation split carved off the training images where the data has none (--val-fraction).

The rows are drawn by Hugging Face datasets' own `train_test_split` on a stand-in dataset that
holds the row numbers, with a fixed seed: the same rows `train.train_test_split(...)` gives (a
random draw depends on the length and the seed only), so a run's held-out images are the same
for every --seed and for `accel-train eval` of the run later.  --val-stratify draws class by
class (stratified_rows), with a fixed seed too: each class holds out one image at least and
about its share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import numpy as np

from accel_train.base.errors import UsageError

VAL_CARVE_SEED = 0  # fixed: the held-out set must not change with --seed


def carve_rows(num_rows: int, val_fraction: float, labels: Optional[Sequence] = None,
               stratify: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(rows kept for training, rows held out): ceil(num_rows x `val_fraction`) rows, as
    datasets' train_test_split counts them.  With `labels` (one per row), a class whose every
    image the draw held out gets its first held-out image back for training (returned last):
    the model would never train on that class, which a validation folder of such a class is
    refused for (labels.refuse_folders_never_trained); classes with more images keep the draw.
    `stratify` (needs `labels`): the draw is made class by class (stratified_rows), which
    keeps a training image of every class itself."""
    if num_rows < 2:
        raise UsageError("the data has fewer than 2 images; nothing to hold out for evaluation")
    held_out = math.ceil(num_rows * val_fraction)  # as datasets' train_test_split counts it
    if held_out >= num_rows:
        raise UsageError(f"--val-fraction {val_fraction:g} holds out all {num_rows} training "
                         f"images, leaving none to train on; choose a smaller fraction "
                         f"(0.1 holds out {math.ceil(num_rows * 0.1)})")
    if stratify:
        if labels is None:
            raise ValueError("a stratified carve needs the rows' labels")
        return stratified_rows(np.asarray(labels), held_out, val_fraction)
    train_rows, held_out_rows = split_rows(np.arange(num_rows), held_out)
    if labels is None:
        return train_rows, held_out_rows
    return train_each_class(train_rows, held_out_rows, labels)


def split_rows(rows: np.ndarray, held_out: int) -> tuple[np.ndarray, np.ndarray]:
    """datasets' train_test_split of `rows` into (training rows, `held_out` rows)."""
    from datasets import Dataset
    parts = Dataset.from_dict({"row": rows}).train_test_split(
        test_size=held_out, seed=VAL_CARVE_SEED, shuffle=True)
    # copies: an array over Arrow's buffer can be read-only (a part of one row is), and
    # torch.from_numpy of one warns (fit() printed torch's warning for such a carve)
    return (parts["train"].with_format("arrow")["row"].to_numpy().copy(),
            parts["test"].with_format("arrow")["row"].to_numpy().copy())


def stratified_rows(labels: np.ndarray, held_out: int,
                    val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, `held_out` rows), each ascending, drawn class by class: every class of
    two or more images holds out one at least and trains on one at least, and the rest of the
    held-out count goes by each class's share (held_out_counts).  The images of a class of one
    cannot be split: they train.  A label of None or -1 (no class) counts as a class here; such
    rows are refused or set aside later, as after a random draw.

    Why not datasets' own train_test_split(stratify_by_column=...) (scikit-learn's
    StratifiedShuffleSplit): it guarantees no class a held-out image.  On a folder of four
    classes of 24 images and one of 4, at 0.2, it held out 5, 5, 5, 5 and 0: the rare class's
    share (0.8) tied with the others' remainders and lost the tie, and validation never
    measured it."""
    # a class number per row, in the order classes first appear (any label value: a string,
    # None, a number)
    numbers: dict = {}
    classes = np.array([numbers.setdefault(label, len(numbers)) for label in labels.tolist()])
    counts = np.bincount(classes)
    splittable = np.flatnonzero(counts > 1)
    shared = int(counts[splittable].sum())
    if held_out < len(splittable):
        fraction = math.ceil(len(splittable) / len(labels) * 1000) / 1000
        raise UsageError(f"--val-stratify: --val-fraction {val_fraction:g} holds out "
                         f"{held_out} image(s), fewer than the {len(splittable)} classes with "
                         f"two or more images, and a stratified carve holds out one of each; "
                         f"use --val-fraction {fraction:g} or more, or drop --val-stratify")
    if shared - held_out < len(splittable):
        raise UsageError(f"--val-stratify: --val-fraction {val_fraction:g} holds out "
                         f"{held_out} of the {shared} images of classes with two or more "
                         f"images, leaving fewer than one of each of their {len(splittable)} "
                         f"classes to train on; choose a smaller fraction")
    rng = np.random.default_rng(VAL_CARVE_SEED)
    taken = held_out_counts(counts[splittable], held_out, rng)
    by_class = np.split(np.argsort(classes, kind="stable"), np.cumsum(counts)[:-1])
    train_rows, held_out_rows = [np.flatnonzero(counts[classes] == 1)], []
    for number, take in zip(splittable, taken):
        rows = rng.permutation(by_class[number])
        held_out_rows.append(rows[:take])
        train_rows.append(rows[take:])
    return np.sort(np.concatenate(train_rows)), np.sort(np.concatenate(held_out_rows))


def held_out_counts(counts: np.ndarray, held_out: int, rng: np.random.Generator) -> np.ndarray:
    """How many of each class's `counts` images to hold out: `held_out` in all, each class
    one at least and all but one at most, the rest by share (held_out x count / total images):
    each class starts at its share rounded down, then the classes furthest below their share
    gain one (or, where the one-each floor took too many, the furthest above lose one), ties
    broken at random."""
    share = held_out * counts / counts.sum()
    # (below count - 1 already: held_out < the images, so each share < its count)
    taken = np.maximum(np.floor(share).astype(np.int64), 1)
    while taken.sum() != held_out:
        short = taken.sum() < held_out
        room = taken < counts - 1 if short else taken > 1
        gap = share - taken if short else taken - share
        order = np.lexsort((rng.random(len(counts)), -gap))  # the largest gap first
        chosen = order[room[order]][:abs(held_out - int(taken.sum()))]
        taken[chosen] += 1 if short else -1
    return taken


def train_each_class(train_rows: np.ndarray, held_out_rows: np.ndarray,
                     labels: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """`carve_rows`' rows with the first held-out row of each class that has no training row
    moved to the end of the training rows.  A label of None or -1 (no class) is no class."""
    labels = np.asarray(labels)  # a tensor's items would hash by identity, not value
    trained = set(labels[train_rows].tolist())
    back = []
    for position, label in enumerate(labels[held_out_rows].tolist()):
        if label not in trained and label is not None and label != -1:
            trained.add(label)
            back.append(position)
    if not back:
        return train_rows, held_out_rows
    if len(back) == len(held_out_rows):
        raise UsageError(f"--val-fraction holds out {len(held_out_rows)} image(s), each of a "
                         f"class with no other image to train on; give those classes more "
                         f"images, or a validation split of your own")
    return (np.concatenate([train_rows, held_out_rows[back]]),
            np.delete(held_out_rows, back))


def carve_name(stratify: bool) -> str:
    """How a carve was drawn, as a checkpoint records it (a resume must draw the same rows)."""
    return "stratified" if stratify else "random"


def carve_description(num_rows: int, val_fraction: float, held_out_rows: np.ndarray,
                      stratify: bool) -> str:
    """What the start summary says of a carve after `NAME minus 10%`: how it was drawn, and the
    images carve_rows gave back for training."""
    given_back = math.ceil(num_rows * val_fraction) - len(held_out_rows)
    return ((", class by class (--val-stratify)" if stratify else "")
            + (f"; {given_back} held-out image(s) trained on instead: no other image of their "
               f"class was left for training" if given_back else ""))
