"""The validation split carved off the training images where the data has none (--val-fraction).

The rows are drawn by Hugging Face datasets' own `train_test_split` on a stand-in dataset that
holds the row numbers, with a fixed seed: the same rows `train.train_test_split(...)` gives (a
random draw depends on the length and the seed only), so a run's held-out images are the same
for every --seed and for `accel-train eval` of the run later.  --val-stratify draws class by
class (`stratify_by_column`, scikit-learn's StratifiedShuffleSplit as datasets implements it):
each class holds out its share of the images, within one.
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
    `stratify` (needs `labels`): the draw is made class by class (stratified_rows)."""
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
        train_rows, held_out_rows = stratified_rows(np.asarray(labels), held_out, val_fraction)
    else:
        train_rows, held_out_rows = split_rows(np.arange(num_rows), held_out)
    if labels is None:
        return train_rows, held_out_rows
    return train_each_class(train_rows, held_out_rows, labels)


def split_rows(rows: np.ndarray, held_out: int,
               classes: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """datasets' train_test_split of `rows` into (training rows, `held_out` rows), by class
    where `classes` (one class number 0..K-1 per row) is given."""
    from datasets import ClassLabel, Dataset, Features, Value
    if classes is None:
        stand_in = Dataset.from_dict({"row": rows})
    else:  # datasets stratifies only by a ClassLabel column
        stand_in = Dataset.from_dict({"row": rows, "class": classes}, features=Features(
            {"row": Value("int64"), "class": ClassLabel(num_classes=int(classes.max()) + 1)}))
    parts = stand_in.train_test_split(test_size=held_out, seed=VAL_CARVE_SEED, shuffle=True,
                                      stratify_by_column="class" if classes is not None else None)
    # copies: an array over Arrow's buffer can be read-only (a part of one row is), and
    # torch.from_numpy of one warns (fit() printed torch's warning for such a carve)
    return (parts["train"].with_format("arrow")["row"].to_numpy().copy(),
            parts["test"].with_format("arrow")["row"].to_numpy().copy())


def stratified_rows(labels: np.ndarray, held_out: int,
                    val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """`held_out` rows drawn class by class, each class's count within one of its share.  The
    images of a class of one cannot be split (datasets refuses such a class): they train, and
    the others are drawn from.  A label of None or -1 (no class) counts as a class here; such
    rows are refused or set aside later, as after a random draw."""
    # a class number per row, in the order classes first appear (any label value: a string,
    # None, a number)
    numbers: dict = {}
    classes = np.array([numbers.setdefault(label, len(numbers)) for label in labels.tolist()])
    counts = np.bincount(classes)
    alone = np.flatnonzero(counts[classes] == 1)  # rows that are their class's only image
    shared = np.flatnonzero(counts[classes] > 1)
    splittable = int(np.count_nonzero(counts > 1))
    if held_out < splittable:
        fraction = math.ceil(splittable / len(labels) * 1000) / 1000
        raise UsageError(f"--val-stratify: --val-fraction {val_fraction:g} holds out "
                         f"{held_out} image(s), fewer than the {splittable} classes with two "
                         f"or more images, and a stratified carve holds out one of each at "
                         f"least; use --val-fraction {fraction:g} or more, or drop "
                         f"--val-stratify")
    if len(shared) - held_out < splittable:
        raise UsageError(f"--val-stratify: --val-fraction {val_fraction:g} holds out "
                         f"{held_out} of the {len(shared)} images of classes with two or more "
                         f"images, leaving fewer than one of each of their {splittable} "
                         f"classes to train on; choose a smaller fraction")
    train_rows, held_out_rows = split_rows(shared, held_out, classes[shared])
    return np.concatenate([train_rows, alone]), held_out_rows


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
