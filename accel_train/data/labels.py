"""Class labels: the class names and each row's class index, and the checks that a held-out
split's classes are classes the model trains on.

Image folders and `ClassLabel` columns declare their classes (folder names, the feature's names);
a column of strings or numbers declares none, and its classes are its distinct values.  A class
with images only outside train/ (most often one class spelled otherwise in two splits) gets an
output the model never learns: refused in one line.  Numbers with gaps give outputs no image has:
a warning.
"""

from __future__ import annotations

import math
import shlex

import numpy as np
import torch

from accel_train.base.errors import UsageError, first_few


def labels_and_names(splits: dict, label_column: str) -> tuple[dict[str, torch.Tensor],
                                                               list[str]]:
    """Each split's class indices and the class names.  A row with no label (None, or the -1
    that Hugging Face data sets give unlabelled rows) gets UNLABELLED: training leaves out a
    split of only those and refuses them elsewhere (set_aside_unlabelled_splits), check-data
    counts them."""
    from datasets import ClassLabel
    feature = next(iter(splits.values())).features[label_column]
    # Through Arrow: `ds[column]` is a lazy Column here, and building a tensor from it walked the
    # rows one by one (over a minute for CIFAR-10's 50,000 labels on a busy machine).
    columns = {k: ds.with_format("arrow")[label_column] for k, ds in splits.items()}
    if isinstance(feature, ClassLabel):  # numbers already: no Python object per row
        return _declared_labels(splits, columns, label_column, list(feature.names))
    values = {k: column.to_pylist() for k, column in columns.items()}
    distinct = sorted({v for vs in values.values() for v in vs if not _unlabelled(v)})
    if distinct and all(_whole_float(v) for v in distinct):
        # class numbers stored as floats: pandas writes an integer column that held a missing
        # value (NaN) so; named "3.0" they read as other classes than the data's numbers
        values = {k: [v if _unlabelled(v) else int(v) for v in vs] for k, vs in values.items()}
        distinct = sorted({int(v) for v in distinct})
    if all(isinstance(v, (int, np.integer)) for v in distinct):
        names = [str(i) for i in range(int(max(distinct)) + 1)] if distinct else []
        index = {v: int(v) for v in distinct}
    else:
        names = [str(v) for v in distinct]
        index = {v: i for i, v in enumerate(distinct)}
    return {k: torch.tensor([UNLABELLED if _unlabelled(v) else index[v] for v in vs],
                            dtype=torch.long) for k, vs in values.items()}, names


UNLABELLED = -1  # what Hugging Face data sets store for a row without a label


def _unlabelled(value) -> bool:
    """None, a negative class number (Hugging Face's -1), or NaN: a float column's missing
    value (pandas), which trained as a class named "nan"."""
    if isinstance(value, (float, np.floating)):
        return math.isnan(value) or value < 0
    return value is None or (isinstance(value, (int, np.integer)) and value < 0)


def _whole_float(value) -> bool:
    return isinstance(value, (float, np.floating)) and math.isfinite(value) and \
        value == int(value)


def _declared_labels(splits: dict, columns: dict, label_column: str,
                     names: list[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """ClassLabel columns: indices into the first split's names.  A split whose feature lists
    its names in another order (each split built with the names it holds, say) is mapped by
    name, not by index; names only it has are added after the first's."""
    from datasets import ClassLabel
    labels = {}
    for k, column in columns.items():
        values = np.array(column.fill_null(UNLABELLED).to_numpy(), dtype=np.int64)
        own = splits[k].features[label_column]
        if isinstance(own, ClassLabel) and list(own.names) != names:
            names += [name for name in own.names if name not in names]
            by_name = np.array([names.index(name) for name in own.names], dtype=np.int64)
            values = np.where(values >= 0, by_name[values.clip(0)], UNLABELLED)
        labels[k] = torch.from_numpy(values)
    return labels, names


def unlabelled_rows(dataset, label_column: str) -> int:
    """How many rows have no label (None, or a negative number)."""
    import pyarrow.compute as pc
    import pyarrow.types as pa_types
    column = dataset.with_format("arrow")[label_column]
    missing = pc.sum(pc.is_null(column)).as_py() or 0
    if pa_types.is_integer(column.type):
        missing += pc.sum(pc.less(column, 0)).as_py() or 0
    if pa_types.is_floating(column.type):  # NaN (pandas' missing value) or negative
        missing += pc.sum(pc.or_(pc.is_nan(column), pc.less(column, 0))).as_py() or 0
    return int(missing)


def left_out_unlabelled(split: str, unlabelled: int, rows: int, train_name: str) -> bool:
    """Training leaves out a split whose rows all lack a label, unless it is the training
    split; it refuses unlabelled rows anywhere else (check-data reports the same verdict)."""
    return unlabelled == rows and split != train_name


def set_aside_unlabelled_splits(raw, label_column: str, train_name: str) -> list[str]:
    """Hugging Face data sets often ship a test split without labels (every row -1): it is left
    out, with a warning, instead of failing at the end of training.  A split with some rows
    unlabelled, or a training split with none labelled, is refused in one line (training would
    fail at the first such row, or evaluate them as a class).  Returns the warnings."""
    warnings = []
    for name in list(raw.splits):
        dataset = raw.splits[name]
        missing = unlabelled_rows(dataset, label_column)
        if not missing:
            continue
        if left_out_unlabelled(name, missing, len(dataset), train_name):
            del raw.splits[name]
            warnings.append(f"the {name} split has no labels ({label_column!r} is -1, empty or "
                            f"NaN in all {missing:,} rows): left out; accel-train predict RUN "
                            f"IMAGES gives its classes")
            continue
        raise UsageError(f"{raw.origin}: {missing:,} of the {len(dataset):,} rows of the {name} "
                         f"split have no label ({label_column!r} is -1, empty or NaN); label "
                         f"them or remove them (accel-train check-data counts them per split)")
    return warnings


def check_label_values(raw, splits, label_column: str) -> None:
    """A held-out or test split with rows of a class that no training row has is refused, as
    an image folder's class is (refuse_folders_never_trained, which speaks of folders): a
    value ('Dog' beside 'dog'), or a ClassLabel name (each split's own names: they may list
    them in another order).  Read over whole splits: --max-train-samples choosing no image
    of a class is not the data's fault."""
    if raw.root is not None:  # an image folder: its folders were checked
        return
    trained = _classes_used(raw, splits.train_name, label_column)
    for held_out in (splits.eval_name, splits.test_name):
        if held_out in (None, splits.train_name):
            continue
        never = sorted(_classes_used(raw, held_out, label_column) - trained,
                       key=lambda v: (str(type(v)), v))
        if never:  # the hint is a command to paste: check-data takes --data-dir, quoted
            raise UsageError(f"{raw.origin}: the {held_out} split's {label_column!r} holds "
                             f"{first_few(repr(v) for v in never)}, which no row of "
                             f"{splits.train_name} has: the model would never learn that class; "
                             f"correct the label (one spelling in every split) or give it "
                             f"training rows")


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


def _classes_used(raw, split: str, label_column: str) -> set:
    """The classes a split's labelled rows belong to: values, or a ClassLabel's names."""
    from datasets import ClassLabel
    feature = raw.splits[split].features[label_column]
    values = {v for v in _values(raw, split, label_column) if not _unlabelled(v)}
    if isinstance(feature, ClassLabel):
        return {feature.names[v] for v in values if v < len(feature.names)}
    return values


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
        if never:  # the hint is a command to paste: check-data takes --data-dir, quoted
            raise UsageError(f"--data-dir {raw.root}: the {held_out} split has images of "
                             f"class(es) {first_few(never)}, of which train has none: the "
                             f"model would never learn them; give them training images, or "
                             f"rename or remove those folders (accel-train check-data "
                             f"--data-dir {shlex.quote(str(raw.root))} lists each split's "
                             f"classes)")


def classes_left_unreadable(labels: torch.Tensor, broken, num_classes: int) -> list[int]:
    """The classes that have images in a split (`labels`, -1 for an unlabelled image) none of
    which decodes (`broken`: the indices of those that do not).  Training refuses them, and
    check-data names them: such a class would train on substitutes of other classes."""
    labels = torch.as_tensor(labels)
    broken = torch.as_tensor(list(broken), dtype=torch.long)
    counts = torch.bincount(labels[labels >= 0], minlength=num_classes)
    lost = labels[broken]
    lost = torch.bincount(lost[lost >= 0], minlength=num_classes)
    return [c for c in range(num_classes) if counts[c] and lost[c] == counts[c]]


def unreadable_classes_named(labels: torch.Tensor, broken, class_names: list[str]) -> str:
    """The classes none of whose images in a split (`labels`) decodes, named with their image
    counts ("'b' (3 images)"); '' when there are none."""
    labels = torch.as_tensor(labels)
    lost = classes_left_unreadable(labels, broken, len(class_names))
    counts = torch.bincount(labels[labels >= 0], minlength=len(class_names)).tolist()
    return first_few(f"{class_names[i]!r} ({counts[i]} image{'' if counts[i] == 1 else 's'})"
                     for i in lost) if lost else ""
