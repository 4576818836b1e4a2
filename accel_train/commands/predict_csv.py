"""`accel-train predict RUN IMAGES... --csv FILE`: the predictions as the CSV file a
competition's submission or a spreadsheet takes.

Three forms, the ones Kaggle's image competitions ask for:
- top-1 (default): `image,class` lines, the best class's name for each image (`id,label` with
  `--csv-header id,label`);
- `--csv-top-k K`: the K best classes' names in the class cell, best first, separated by
  spaces (the MAP@K competitions' `Id` column: `new_whale w_1287fbc w_98baff9`);
- `--csv-probabilities`: `image,CLASS_1,CLASS_2,...` lines, every class's probability in the
  model's class order (the log-loss competitions' `sample_submission.csv`).

The image column is the image's path relative to the folder given (a file given by itself: its
name), its file name, or its file name without extension (`--csv-image stem`: Kaggle's ids); the
label files of training read each of the three forms, so a model's predictions label a folder
again.  Ids that two images share are refused before anything is predicted.  The file is
written beside its final name and renamed onto it only when every image was predicted
(csv_files.CsvOutput): an interrupted or failed prediction leaves an earlier file of that name
as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from accel_train.base.errors import UsageError

IMAGE_FORMS = ("relative", "name", "stem")
DEFAULT_HEADER = ("image", "class")


def image_ids(found: Sequence[tuple[Path, Optional[Path]]], form: str) -> list[str]:
    """The CSV's id of each (image, folder it was found under or None) in `form`; a UsageError
    naming two images that would share one (a submission with a repeated id is rejected, and
    a label file with one is refused by training)."""
    ids, first_holder = [], {}
    for image, folder in found:
        text = _image_id(image, folder, form)
        if text in first_holder:
            raise UsageError(f"--csv-image {form}: {first_holder[text][0]} and {image} would "
                             f"both be {text!r} in the CSV; "
                             f"{_other_form_hint(first_holder[text], (image, folder))}")
        first_holder[text] = (image, folder)
        ids.append(text)
    return ids


def _image_id(image: Path, folder: Optional[Path], form: str) -> str:
    if form == "stem":
        return image.stem
    if form == "name" or folder is None:
        return image.name
    return image.relative_to(folder).as_posix()


def _other_form_hint(first: tuple[Path, Optional[Path]],
                     second: tuple[Path, Optional[Path]]) -> str:
    """The first form that tells the two apart: the file name (img01.png, img01.jpg), else
    the path inside the folder given (day1/img01.png, day2/img01.png), else neither."""
    if _image_id(*first, "name") != _image_id(*second, "name"):
        return "use --csv-image name (ids with extensions) or rename one"
    if _image_id(*first, "relative") != _image_id(*second, "relative"):
        return "use --csv-image relative (paths inside the folder given) or rename one"
    return "predict the two folders into two files, or give the folder that holds both"


def header_of(text: Optional[str], probabilities: bool, class_names: Sequence[str]) -> list[str]:
    """The CSV's header line: `--csv-header` (the image column's name, and in the top-1 form
    the class column's), the class names as the probability columns."""
    names = [name.strip() for name in text.split(",")] if text is not None else None
    if names is not None and (not all(names) or len(set(names)) != len(names)):
        raise UsageError(f"--csv-header {text}: give distinct column names separated by commas "
                         f"(id,label)")
    if probabilities:
        if names is not None and len(names) != 1:
            raise UsageError(f"--csv-header {text}: with --csv-probabilities name the image "
                             f"column only (id); the classes' columns are their names")
        image_column = names[0] if names else DEFAULT_HEADER[0]
        if image_column in class_names:  # two columns of one name: readers keep one of them
            raise UsageError(f"--csv-header: the image column {image_column!r} is also a "
                             f"class's name; name it otherwise (--csv-header id)")
        return [image_column, *class_names]
    if names is not None and len(names) != 2:
        raise UsageError(f"--csv-header {text}: name the two columns, the image's and the "
                         f"class's (id,label)")
    return names or list(DEFAULT_HEADER)


def refuse_csv_options_without_csv(args) -> None:
    for flag, given in (("--csv-image", args.csv_image is not None),
                        ("--csv-header", args.csv_header is not None),
                        ("--csv-probabilities", args.csv_probabilities),
                        ("--csv-top-k", args.csv_top_k is not None)):
        if given and args.csv is None:
            raise UsageError(f"{flag} shapes the file of --csv FILE: pass --csv FILE too, or "
                             f"drop {flag}")


def check_csv_top_k(top_k: Optional[int], probabilities: bool) -> None:
    """Before any work: --csv-top-k is a count, and names classes (not probabilities)."""
    if top_k is None:
        return
    if top_k < 1:
        raise UsageError(f"--csv-top-k must be a whole number >= 1 (got {top_k})")
    if probabilities:
        raise UsageError("--csv-top-k and --csv-probabilities are two forms of the file: the "
                         "K best classes' names, or every class's probability; pass one")


def refuse_names_with_spaces(top_k: int, names: Sequence[str]) -> None:
    """With more than one class in a cell, spaces separate them: a name holding one would
    read as two classes.  Checked once the model's names are known, before any image; the
    line names `top_k` as the user typed it (a cell holds at most every class)."""
    if min(top_k, len(names)) < 2:
        return
    spaced = [name for name in names if any(char.isspace() for char in name)]
    if spaced:
        raise UsageError(f"--csv-top-k {top_k}: the class {spaced[0]!r} has a space in its "
                         f"name, and spaces separate the classes of a cell; use --csv-top-k 1 "
                         f"or --csv-probabilities")


def csv_row(image_id: str, ranked: Sequence[tuple[int, float]], names: Sequence[str],
            probabilities: bool, top_k: int = 1) -> list:
    """One CSV line: the id and the top-k classes' names (best first, space-separated), or
    every class's probability in the model's class order (`ranked` is then all classes, best
    first)."""
    if not probabilities:
        return [image_id, " ".join(names[index] for index, _ in ranked[:top_k])]
    by_class = dict(ranked)
    return [image_id, *(f"{by_class[index]:.6f}" for index in range(len(names)))]


def what_each_row_holds(probabilities: bool, num_classes: int, top_k: int) -> str:
    """The end of the "wrote FILE" line."""
    if probabilities:
        return f"the probabilities of {num_classes} classes"
    shown = min(top_k, num_classes)
    return "the top-1 class" if shown == 1 else f"the top-{shown} classes"
