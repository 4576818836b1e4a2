"""Class labels: the class names and each row's class index, and the checks that a held-out
split's classes are classes the model trains on.

Image folders and `ClassLabel` columns declare their classes (folder names, the feature's names);
a column of strings or numbers declares none, and its classes are its distinct values.  A class
with images only outside train/ (most often one class spelled otherwise in two splits) gets an
output the model never learns: refused in one line.  Numbers with gaps give outputs no image has:
a warning.
"""

from __future__ import annotations

import numpy as np
import torch

from accel_train.base.errors import UsageError


def labels_and_names(splits: dict, label_column: str) -> tuple[dict[str, torch.Tensor],
                                                               list[str]]:
    from datasets import ClassLabel
    feature = next(iter(splits.values())).features[label_column]
    # Through Arrow: `ds[column]` is a lazy Column here, and building a tensor from it walked the
    # rows one by one (over a minute for CIFAR-10's 50,000 labels on a busy machine).
    columns = {k: ds.with_format("arrow")[label_column] for k, ds in splits.items()}
    if isinstance(feature, ClassLabel):  # numbers already: no Python object per row
        return ({k: torch.from_numpy(np.array(column.to_numpy(), dtype=np.int64))
                 for k, column in columns.items()}, list(feature.names))
    values = {k: column.to_pylist() for k, column in columns.items()}
    distinct = sorted({v for vs in values.values() for v in vs})
    if all(isinstance(v, (int, np.integer)) for v in distinct):
        if distinct and min(distinct) < 0:
            raise UsageError(f"label column {label_column!r} holds negative labels; labels must "
                             f"be class indices 0..N-1 or class names")
        names = [str(i) for i in range(int(max(distinct)) + 1)] if distinct else []
        index = {v: int(v) for v in distinct}
    else:
        names = [str(v) for v in distinct]
        index = {v: i for i, v in enumerate(distinct)}
    return {k: torch.tensor([index[v] for v in vs], dtype=torch.long)
            for k, vs in values.items()}, names



def check_label_values(raw, splits, label_column: str) -> None:
    """Labels given as values (strings or numbers): a held-out or test split whose values
    train has none of is refused, as an image folder's class is (refuse_folders_never_trained).
    Read over whole splits: --max-train-samples choosing no image of a class is not the data's
    fault."""
    if declares_classes(raw, splits, label_column):
        return
    trained = _values(raw, splits.train_name, label_column)
    for held_out in (splits.eval_name, splits.test_name):
        if held_out in (None, splits.train_name):
            continue
        never = sorted(_values(raw, held_out, label_column) - trained,
                       key=lambda v: (str(type(v)), v))
        if never:
            shown = ", ".join(repr(v) for v in never[:5]) + \
                (f" and {len(never) - 5} more" if len(never) > 5 else "")
            raise UsageError(f"{raw.origin}: the {held_out} split's {label_column!r} holds "
                             f"{shown}, which no row of {splits.train_name} has: the model "
                             f"would never learn that class; correct the label (one spelling "
                             f"in every split) or give it training rows")


def label_gap_warnings(raw, splits, label_column: str, class_names: list[str]) -> list[str]:
    """Numbers as labels number the classes 0..max: numbers no row has become
    outputs no image trains (labels 1, 5, 9 give ten outputs).  Said, not refused: a subset of
    a larger numbering is a choice."""
    if declares_classes(raw, splits, label_column) or \
            not all(name == str(i) for i, name in enumerate(class_names)):
        return []  # declared classes, or names from strings: no numbering to leave gaps in
    # train's numbers are all there are: a held-out number train lacks is refused before this
    present = _values(raw, splits.train_name, label_column)
    missing = [i for i in range(len(class_names)) if i not in present]
    if not missing:
        return []
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    return [f"label column {label_column!r} numbers the classes 0..{len(class_names) - 1} and "
            f"{len(missing)} of those numbers ({shown}) no row has: the model gets "
            f"{len(class_names)} outputs, {len(missing)} for classes no image trains; renumber "
            f"the labels 0..{len(present) - 1}, or give the classes names"]


def declares_classes(raw, splits, label_column: str) -> bool:
    """Whether the label column is a ClassLabel (image folders' are): classes named once."""
    from datasets import ClassLabel
    return isinstance(raw.splits[splits.train_name].features[label_column], ClassLabel)


def _values(raw, split: str, label_column: str) -> set:
    return set(raw.splits[split].with_format("arrow")[label_column].to_pylist())


def refuse_folders_never_trained(raw, splits) -> None:
    """An image folder's held-out split with a class folder that train/ has no images of gives
    the model a class it never trains on, most often one class named differently in the two
    splits: refused.  (A class with no held-out images is common in small validation sets and
    passes; labels given as values: check_label_values.)"""
    if raw.root is None:
        return

    def classes_with_images(split: str) -> set[int]:
        return set(np.unique(raw.splits[split].with_format("arrow")["label"].to_numpy()).tolist())

    trained = classes_with_images(splits.train_name)
    names = raw.splits[splits.train_name].features["label"].names
    for held_out in (splits.eval_name, splits.test_name):
        if held_out in (None, splits.train_name):
            continue
        never = [names[c] for c in sorted(classes_with_images(held_out) - trained)]
        if never:
            shown = ", ".join(never[:5]) + (f" and {len(never) - 5} more" if len(never) > 5 else "")
            raise UsageError(f"--data-dir {raw.root}: the {held_out} split has images of "
                             f"class(es) {shown}, of which train has none: the model would never "
                             f"learn them; give them training images, or rename or remove those "
                             f"folders (accel-train check-data {raw.root} lists each split's "
                             f"classes)")
