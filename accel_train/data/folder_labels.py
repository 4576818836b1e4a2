"""A split's label files, beside its class folders: the file a flag names (--train-labels,
--val-labels) and Hugging Face's imagefolder metadata files (metadata.csv, .jsonl, .parquet) in
a split folder and its subfolders, read as datasets' imagefolder reads them; what datasets
refuses is refused in one line.  The folder walk that finds them is imagefolder.py's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from accel_train.base.errors import UsageError, first_few
from accel_train.data.label_files import (LabelSource, metadata_header, missing_columns,
                                          read_metadata, read_metadata_labels,
                                          read_train_labels, read_val_labels)


def metadata_labels_line(metadata_labels: dict[str, list[str]]) -> Optional[str]:
    """What the start summary and check-data say where metadata files gave the labels."""
    if not metadata_labels:
        return None
    order = ("train", "validation", "test")
    files = [file for split in order for file in metadata_labels.get(split, ())]
    return f"from {first_few(files)} (file_name, label)"


def label_files_given(root: Path, splits: dict[str, Path], walked: dict,
                 val_labels: Optional[str], train_labels: Optional[str]
                 ) -> dict[str, tuple[list[Path], Optional[str]]]:
    """{split: ([its label file], the flag that gave it)} for --train-labels and
    --val-labels."""
    files: dict[str, tuple[list[Path], Optional[str]]] = {}
    if train_labels is not None:
        if "train" not in walked:
            folders = ", ".join(sorted(f"{folder.name}/" for folder in splits.values()))
            raise UsageError(f"--train-labels {train_labels}: --data-dir {root} has split "
                             f"folders ({folders}) and no train/ folder of images to "
                             f"label; put the training images in {root}/train")
        files["train"] = ([Path(train_labels)], "--train-labels")
    labelled = labelled_split(walked, val_labels, root)
    if labelled is not None:
        files[labelled] = ([Path(val_labels)], "--val-labels")
    return files


def split_classes(given: tuple[list[Path], Optional[str]], folder: Path, images: list[str],
                 classes: Optional[set[str]] = None,
                 classes_from: Optional[LabelSource] = None,
                 read: Optional[dict] = None) -> list[str]:
    """A split's classes from its label files (label_files_given, metadata_labels): a flag's one
    file, or (flag None) the split's metadata files (`read`: {file: its read_metadata}).
    `classes` None: the training split's; `classes_from`: where the training split's labels
    came from (training_labels_source), None for class folders."""
    paths, flag = given
    if flag is None:
        return read_metadata_labels(paths, folder, images, classes, classes_from, read)
    if classes is None:
        return read_train_labels(paths[0], folder, images, flag)
    return read_val_labels(paths[0], folder, images, classes, classes_from, flag)


def training_labels_source(given: Optional[tuple[list[Path], Optional[str]]]
                           ) -> Optional[LabelSource]:
    """The file(s) that labelled the training split (`given`, as split_classes takes it), as a
    refusal of another split's label names them; None where class folders labelled it."""
    if given is None:
        return None
    paths, flag = given
    if flag or len(paths) == 1:
        return LabelSource(flag or str(paths[0]))
    return LabelSource("the training split's metadata files", "their class names")


def metadata_labels(root: Path, found: dict[str, list[str]], dirs: list[tuple[str, int]],
                     files: dict[str, tuple[list[Path], Optional[str]]]
                     ) -> tuple[dict[str, list[str]], dict[Path, object]]:
    """Hugging Face's imagefolder layout: the metadata.csv, .jsonl or .parquet files in a split
    folder and its subfolders (`found`: {split: their paths relative to root}) that name
    file_name and label label that split, as datasets' imagefolder reads them (their label
    column, not the class folders, where both are there), unless a flag gave the split a
    label file; added to `files` (flag None).  Each one found goes into `dirs`, so that an
    edit of it (which changes no folder's mtime) is seen by the cached index.  Refused, as
    datasets refuses them: files of two kinds; files of two splits naming different columns
    (datasets compares one file of each split); beside a file that labels a split, one that
    does not (datasets would give its images no label).  The files of a split a flag labels
    are not read.  {split: the files, relative to root} of those taken, and {file: what
    read_metadata gave} of those, each file read once (its header, then its rows)."""
    every = sorted(rel for rels in found.values() for rel in rels)
    for rel in every:
        dirs.append((rel, os.stat(root / rel).st_mtime_ns))
    _one_kind_of_metadata(root, every)
    found = {split: sorted(rels) for split, rels in found.items() if split not in files}
    read = {rel: read_metadata(root / rel) for rels in found.values() for rel in rels}
    header = {rel: metadata_header(root / rel, read[rel]) for rel in read}
    _same_columns_across_splits(root, found, header)
    taken = {}
    for split, rels in found.items():
        labelling = [rel for rel in rels if not missing_columns(header[rel])]
        if not labelling:
            continue  # (without a label column, the class folders are the classes)
        lacking = next((rel for rel in rels if rel not in labelling), None)
        if lacking is not None:
            missing = " or ".join(missing_columns(header[lacking]))
            raise UsageError(f"{root / lacking} has no {missing} column, and "
                             f"{root / labelling[0]} labels the images of the same split; "
                             f"name each image's file_name and label in it too (Hugging "
                             f"Face's imagefolder would leave its images without a label)")
        files[split] = ([root / rel for rel in labelling], None)
        taken[split] = labelling
    return taken, {root / rel: read[rel] for rels in taken.values() for rel in rels}


def _one_kind_of_metadata(root: Path, metadata: list[str]) -> None:
    """Metadata files of two kinds (metadata.csv and metadata.jsonl) are refused, in one
    folder or in two: datasets' imagefolder refuses them ("different extensions")."""
    first_of_kind: dict[str, str] = {}
    for rel in metadata:
        first_of_kind.setdefault(os.path.splitext(rel)[1], rel)
    if len(first_of_kind) < 2:
        return
    by_folder: dict[str, list[str]] = {}
    for rel in metadata:
        by_folder.setdefault(os.path.dirname(rel), []).append(os.path.basename(rel))
    both = next((folder for folder, names in by_folder.items() if len(names) > 1), None)
    if both is not None:
        first, second = sorted(by_folder[both])[:2]
        raise UsageError(f"{root / both} holds both {first} and {second}; keep one (Hugging "
                         f"Face's imagefolder reads one kind of metadata file)")
    first, second = sorted(first_of_kind.values())[:2]
    raise UsageError(f"{root / first} and {root / second} are metadata files of two kinds; "
                     f"keep one kind (Hugging Face's imagefolder reads one kind of metadata "
                     f"file in a dataset)")


def _same_columns_across_splits(root: Path, found: dict[str, list[str]],
                                header: dict[str, list[str]]) -> None:
    """Where metadata files label more than one split, every one must name the same columns:
    datasets' imagefolder compares the columns of one file of each split, whichever it lists
    first, and refuses a difference ("different features")."""
    if sum(1 for rels in found.values() if rels) < 2 or \
            len({frozenset(columns) for columns in header.values()}) < 2:
        return
    split_of = {rel: split for split, rels in found.items() for rel in rels}
    every = sorted(header)
    first, second = next((a, b) for a in every for b in every
                         if split_of[a] != split_of[b] and set(header[a]) != set(header[b]))
    raise UsageError(f"{root / first} names the columns {', '.join(header[first]) or 'none'} "
                     f"and {root / second} {', '.join(header[second]) or 'none'}; give the "
                     f"metadata files of every split the same columns (Hugging Face's "
                     f"imagefolder refuses them otherwise)")


def is_labelled_split(split: str, val_labels: Optional[str]) -> bool:
    return val_labels is not None and split != "train"


def labelled_split(walked: dict, val_labels: Optional[str], root: Path) -> Optional[str]:
    """The held-out split that --val-labels labels (its images sit directly in its folder)."""
    if val_labels is None:
        return None
    held_out = [split for split in ("validation", "test") if split in walked]
    if "train" not in walked or not held_out:  # (no split folders: no held-out one either)
        raise UsageError(f"--val-labels {val_labels}: --data-dir {root} has no train/ folder "
                         f"beside a val/ (or validation/, test/) folder of images to label; "
                         f"expected DIR/train/CLASS/IMAGE and DIR/val/IMAGE")
    return held_out[0]
