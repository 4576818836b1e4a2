"""Label files for folders of images not sorted into class folders.

- `--val-labels FILE`: ImageNet's validation layout, `DIR/train/CLASS/IMAGE` beside all held-out
  images in one folder (`DIR/val/IMAGE`); its classes are the class folders of train/.
- `--train-labels FILE`: the layout Kaggle and many labelling tools hand out, the training
  images in one folder (`DIR/IMAGE` or `DIR/train/IMAGE`, subfolders allowed) and a CSV naming
  each one's class (`train.csv`: `id,label`); its classes are the file's labels.

In both, IMAGE may be the path relative to the folder, the file name, or the file name without
its extension (Kaggle's ids), and every image needs a label and every label an image: anything
else is one line naming the file's line (a parquet file's row).  Fields are separated by
commas, else by semicolons (Excel's CSV where the comma is the decimal mark), else by tabs (a
TSV), else by whitespace, as the file's first line separates them; a quoted field may go on
over several lines (a caption, as pandas writes it).

Hugging Face's imagefolder layout labels a folder with a metadata.csv (a header naming
file_name and label among other columns), a metadata.jsonl (one JSON object a line with
file_name and label keys) or a metadata.parquet (file_name and label columns) beside the images:
both flags read any of them, by those names, and an image folder takes those in a split folder
and its subfolders as its labels without a flag (imagefolder.py, read_metadata_labels).  A
parquet file has rows, not lines: its problems name "row N", counting its rows from 1 (pandas'
index N-1).
"""

from __future__ import annotations

import bisect
import csv
import functools
import itertools
import json
import os
import re
import unicodedata
from pathlib import Path, PurePosixPath
from typing import NamedTuple, Optional

from accel_train.base.errors import UsageError, first_few, first_line
from accel_train.base.readers import (parquet_file, parse_json_line, read_parquet_table,
                                      read_text)

# how programs write a missing value in a CSV cell (pandas' NaN and <NA>, R's NA, Excel's #N/A,
# SQL's NULL): a class of that name is a label that was never given
MISSING_VALUE_MARKS = frozenset({"nan", "-nan", "<na>", "na", "n/a", "#n/a", "null"})
METADATA_PARQUET = "metadata.parquet"
# Hugging Face's imagefolder metadata files (datasets' METADATA_FILENAMES)
METADATA_FILES = ("metadata.csv", "metadata.jsonl", METADATA_PARQUET)
NAMED_COLUMNS = ("file_name", "label")  # the two columns a metadata file is read by
# the reader's kind of a parquet label file: a flag's, or (None) an image folder's own
PARQUET_KINDS = {"--train-labels": "train_labels", "--val-labels": "val_labels",
                 None: "imagefolder_metadata_parquet"}


class LabelSource(NamedTuple):
    """Where the training split's labels came from, as a refusal of another split's label
    names them: `name` ("--train-labels", a metadata file's path, the split's metadata files)
    and what to use instead (`use`: "its class names", "their class names")."""
    name: str
    use: str = "its class names"


def where_of(file: Path, flag: Optional[str]) -> str:
    """How errors name a label file: with the flag it was passed with, or alone where the image
    folder's own metadata file was taken without one."""
    return f"{flag} {file}" if flag else str(file)


def label_text(file: Path, flag: Optional[str]) -> tuple[str, str]:
    """The text of a label file (bytes that are not UTF-8 replaced: a bad byte is judged by the
    line it stands in) and its reader's kind: the file of a flag, or (None) an image folder's
    own metadata file."""
    if flag == "--train-labels":
        return read_text(file, "train_labels", flag, errors="replace"), "train_labels"
    if flag == "--val-labels":
        return read_text(file, "val_labels", flag, errors="replace"), "val_labels"
    return read_text(file, "imagefolder_metadata", errors="replace"), "imagefolder_metadata"


def read_metadata(file: Path):
    """An image folder's metadata file read once, for its header (metadata_header) and then its
    rows (label_rows): its lines (file_lines, split once for both), or a parquet file's footer
    (a ParquetFile's `metadata`; the file itself closed, not held open while a folder's many
    files are looked at)."""
    if file.suffix.lower() == ".parquet":
        with parquet_file(file, "imagefolder_metadata_parquet") as handle:
            return handle.metadata
    return file_lines(label_text(file, None)[0])


def label_lines(file: Path, flag: Optional[str], lines: Optional[list[str]] = None
                ) -> tuple[list[str], str]:
    """The lines of `file` (file_lines), at least one not blank or a comment, and its reader's
    kind (label_text).  `lines`: an image folder's own metadata file's (flag None), where read
    before (read_metadata)."""
    where = where_of(file, flag)
    if lines is not None:
        kind = "imagefolder_metadata"
    elif not file.is_file():
        raise UsageError(f"{where}: no such file")
    else:
        text, kind = label_text(file, flag)
        lines = file_lines(text)
    if not any(_holds_a_record(line) for line in lines):
        raise UsageError(f"{where} holds no labels")
    return lines, kind


def _holds_a_record(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith("#")


def file_records(lines: list[str], separator: Optional[str], where: str,
                 limit: Optional[int] = None) -> list[tuple[int, list[str]]]:
    """(the number of its first line, its fields) of each record of a label file's lines that
    is not blank or a comment: fields separated by `separator` (file_separator; CSV, quoted
    fields as the csv module reads them), or by whitespace where it is None.  A record is a
    line, or (CSV) a line with a quoted field that goes on past its end, as pandas writes a
    caption over several lines, and the lines the csv module reads as the rest of it.  A quote
    that no later line closes is one line naming where it opens (pandas' read_csv refuses
    such a file too), not the rest of the file read as one field.  `limit`: the first records
    only (a header)."""
    if separator is None or not any('"' in line for line in lines):
        # no quoted field: a record a line, its fields what the csv module would give, faster
        records = ((number, line.split() if separator is None else
                    [field.strip() for field in line.split(separator)])
                   for number, line in enumerate(lines, 1)
                   if line.strip() and not line.lstrip().startswith("#"))  # _holds_a_record
        return list(itertools.islice(records, limit))
    source = _RecordLines(lines)
    reader = csv.reader(source, delimiter=separator)  # one for the file: its records, C-fast
    records = []
    while limit is None or len(records) < limit:
        source.record_starts = True
        try:
            fields = next(reader, None)
        except csv.Error as err:  # a field past the csv module's limit: a quote left open
            raise UsageError(f"{where} line {source.first + 1}: a quoted field (\") opened there "
                             f"goes on too far ({first_line(err)}); close the quote, or remove "
                             f"it") from None
        if fields is None:
            return records
        if source.past_end:
            raise UsageError(f"{where} line {source.first + 1} opens a quoted field (\") that no "
                             f"line after it closes; close the quote, or remove it")
        records.append((source.first + 1, [field.strip() for field in fields]))
    return records


class _RecordLines:
    """A label file's lines as the csv module reads them, a record at a time: blank lines and
    comments skipped where a record starts (not inside a quoted field that goes on over lines),
    `first` the index of the record's first line, and one empty line past the file's end, which
    only a quote never closed reads (`past_end`)."""

    def __init__(self, lines: list[str]):
        self.lines = lines
        self.at = 0
        self.first = 0
        self.record_starts = True
        self.past_end = False

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self.record_starts:
            while self.at < len(self.lines) and not _holds_a_record(self.lines[self.at]):
                self.at += 1
            self.record_starts, self.first = False, self.at
        if self.at < len(self.lines):
            self.at += 1
            return self.lines[self.at - 1] + "\n"
        if self.first == self.at or self.past_end:
            raise StopIteration  # no record left, or the empty line past the end read
        self.past_end = True
        return ""


def file_separator(lines: list[str]) -> Optional[str]:
    """How a label file separates its fields, from its first line (not blank or a comment):
    "," or ";", whichever it holds outside quoted fields, a comma first; else a tab where it
    holds one (a TSV, as pandas writes one with sep="\\t": "golden retriever" one class) and
    no line holds two in a row (tabs that align columns, whitespace as before); else "," or ";"
    as the second line holds them (under a header of words); else None, whitespace.  One for
    the whole file, not each line's own: in Excel's semicolon CSV, where the comma is the
    decimal mark, a line's 0,93 is one number."""
    heads = list(itertools.islice(filter(_holds_a_record, lines), 2))
    for number, line in enumerate(heads):
        unquoted = re.sub(r'"[^"]*"', "", line)
        for separator in (",", ";"):
            if separator in unquoted:
                return separator
        if number == 0 and "\t" in line and not any("\t\t" in line for line in lines):
            return "\t"
    return None


def label_rows(file: Path, flag: Optional[str], read=None
               ) -> tuple[list[tuple[str, list[str]]], bool]:
    """(where in the file, fields) of each line of a label file ("line 3"; a parquet file's
    "row 3"), and whether its columns are named: a metadata.jsonl, a parquet file, or a header
    naming file_name and label (Hugging Face's metadata.csv), whose rows are then [file_name,
    label] each, the header not among them.  Otherwise every line's fields as file_records
    splits them, a header line (if any) still first.  `read`: what read_metadata gave for the
    file, where it was read before."""
    where = where_of(file, flag)
    if file.suffix.lower() == ".parquet":
        return parquet_rows(file, flag, read), True
    lines, kind = label_lines(file, flag, read)
    if file.suffix.lower() == ".jsonl":
        return [(f"line {number}", _json_fields(line, number, file, flag, kind))
                for number, line in enumerate(lines, 1) if _holds_a_record(line)], True
    rows = [(f"line {number}", fields)
            for number, fields in file_records(lines, file_separator(lines), where)]
    named = metadata_columns(rows[0][1])
    if named is not None:
        rows = [(place, _named_fields(fields, named, where, place)) for place, fields in rows[1:]]
    return rows, named is not None


def _refuse_unreadable_names(fields: list[str], where: str, place: str) -> None:
    """An image or class name (labelled_images' [image, class]) that no one meant:

    - over several lines: a quote meant as a character (`"cat` for cat) that a quote on a later
      line closed, every line between read into it;
    - holding U+FFFD, which the file's bytes that are not UTF-8 became (label_text): a
      spreadsheet's CSV in the Windows encoding, where café would train as a class "caf\ufffd"
      (pandas' read_csv and datasets refuse such a file outright; here a bad byte in a header
      or a column not read is left alone).

    One line naming where, not a class named so."""
    for what, name in zip(("image", "class"), fields):
        lines = name.count("\n") + 1
        if lines > 1:
            raise UsageError(f"{where} {place} gives the {what} {json_text(name)}, over {lines} "
                             f"lines: a quote (\") opens it that only a later line closes; "
                             f"close the quote on its line, or remove it")
        if "\ufffd" in name:
            raise UsageError(f"{where} {place} gives the {what} {json_text(name)}: the file is "
                             f"not UTF-8 text (a spreadsheet's CSV in the Windows encoding); "
                             f"save it as UTF-8 (Excel: CSV UTF-8), or convert it (iconv -f "
                             f"cp1252 -t utf-8)")


def parquet_rows(file: Path, flag: Optional[str], footer=None) -> list[tuple[str, list[str]]]:
    """("row N", [file_name, label]) of each row of a parquet label file (a metadata.parquet),
    its columns found by name as a metadata.csv's are, each cell as text as a metadata.jsonl's
    value is (_cell_text): the same checks then apply.  Rows count from 1.  `footer`: the
    file's footer where read before (read_metadata)."""
    where = where_of(file, flag)
    if footer is None and not file.is_file():
        raise UsageError(f"{where}: no such file")
    kind = PARQUET_KINDS[flag]
    handle = parquet_file(file, kind, flag or "", footer)
    names = handle.schema_arrow.names
    columns = {name.strip().lower(): name for name in reversed(names)}  # the first of a name
    missing = [column for column in NAMED_COLUMNS if column not in columns]
    if missing:
        raise UsageError(f"{where} has no {' or '.join(map(repr, missing))} column (its "
                         f"columns: {first_few(names) if names else 'none'}); name the "
                         f"images' column file_name and their classes' label")
    table = read_parquet_table(file, kind, [columns[column] for column in NAMED_COLUMNS],
                               flag or "", handle)
    if table.num_rows == 0:
        raise UsageError(f"{where} holds no labels")
    cells = [table.column(i).to_pylist() for i in range(len(NAMED_COLUMNS))]
    return [(f"row {number}", [_cell_text(value, key, where, f"row {number}")
                               for key, value in zip(NAMED_COLUMNS, row)])
            for number, row in enumerate(zip(*cells), 1)]


def _json_fields(line: str, number: int, file: Path, flag: Optional[str],
                 kind: str) -> list[str]:
    """A metadata.jsonl line's file_name and label as text, as a CSV cell would give them
    (3 -> "3", 3.0 -> "3.0", null -> "", NaN -> "nan"): the same checks then apply."""
    where = where_of(file, flag)
    record = parse_json_line(line, number, file, kind, flag or "")
    if not isinstance(record, dict):
        raise UsageError(f"{where} line {number} is not a JSON object; write one "
                         f'{{"file_name": ..., "label": ...}} object a line')
    missing = [key for key in NAMED_COLUMNS if key not in record]
    if missing:
        raise UsageError(f"{where} line {number} has no {' or '.join(map(repr, missing))} key; "
                         f"give every line the image's file_name and its label")
    return [_cell_text(record[key], key, where, f"line {number}") for key in NAMED_COLUMNS]


def _cell_text(value, key: str, where: str, place: str) -> str:
    """A metadata value as text, as a CSV cell would give it (3 -> "3", 3.0 -> "3.0", a null
    -> "", NaN -> "nan"); a list, a mapping, true/false, a date is refused: no class name."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UsageError(f"{where} {place} gives {key} {json_text(value)}, neither text nor a "
                         f"number; write the {key} as text or a number")
    return str(value).strip()


def json_text(value) -> str:
    """A JSON value as the file wrote it (anything else as Python writes it), shortened, for
    an error."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def metadata_header(file: Path, read=None) -> list[str]:
    """The columns an image folder's metadata file names, as it writes them: its CSV header,
    its first JSON object's keys, a parquet file's columns ([] for an empty file).  `read`:
    what read_metadata gave for the file, where it was read before."""
    read = read_metadata(file) if read is None else read
    if file.suffix.lower() == ".parquet":
        return read.schema.to_arrow_schema().names  # a footer
    lines = read
    if file.suffix.lower() != ".jsonl":
        header = file_records(lines, file_separator(lines), str(file), limit=1)
        return header[0][1] if header else []
    first = next(((number, line) for number, line in enumerate(lines, 1)
                  if _holds_a_record(line)), None)
    if first is None:
        return []
    record = parse_json_line(first[1], first[0], file, "imagefolder_metadata")
    return list(record) if isinstance(record, dict) else []


def metadata_missing(file: Path) -> list[str]:
    """Which of file_name and label an image folder's metadata file does not name: [] where
    it labels the images."""
    return missing_columns(metadata_header(file))


def missing_columns(header: list[str]) -> list[str]:
    """Which of file_name and label a metadata file's columns (metadata_header) leave out,
    whatever their letter case."""
    names = [name.strip().lower() for name in header]
    return [column for column in NAMED_COLUMNS if column not in names]


def read_val_labels(file: Path, folder: Path, images: list[str], classes: set[str],
                    classes_from: Optional[LabelSource] = None,
                    flag: Optional[str] = "--val-labels") -> list[str]:
    """The class of each image (paths relative to `folder`, sorted) from `file`:

    - `IMAGE,CLASS` or `IMAGE CLASS` lines (CSV or whitespace), IMAGE a path relative to the
      folder, a file name, or a file name without its extension; the first line may be a header;
      CLASS may be followed by more fields (Kaggle's LOC_val_solution.csv: `ImageId,
      PredictionString` with the class first in the string);
    - or one CLASS per line, for the images in sorted file-name order.

    Every image needs a label, every label one of `classes` (the class folders of train/, or
    the labels of the file(s) `classes_from` names: --train-labels, train/'s metadata files),
    and every line an image of the folder; anything else is a UsageError naming the line.  A
    file whose columns are named (label_rows: metadata.jsonl, a header naming file_name and
    label) is read by those names, as read_train_labels reads it.  `flag` None: the folder's
    own metadata file, taken without one."""
    where = where_of(file, flag)
    rows, by_name = label_rows(file, flag)
    if by_name:
        labels = labelled_images(rows, ImageLookup(images), where, folder, by_name)
        refuse_unlabelled(where, folder, images, labels)
        return [_known_class(labels[image][0], classes, where, labels[image][1],
                             classes_from) for image in images]
    if all(len(fields) == 1 for _, fields in rows):
        if len(rows) != len(images):
            raise UsageError(f"{where} has {len(rows)} one-field lines for the {len(images)} "
                             f"images of {folder}; one class per image, in file-name order")
        return [_known_class(fields[0], classes, where, place, classes_from)
                for place, fields in rows]
    lookup = ImageLookup(images)
    labels: dict[str, str] = {}
    for position, (place, fields) in enumerate(rows):
        if len(fields) == 1:
            if position == 0:
                continue  # a header line of one field
            raise UsageError(f"{where} {place} gives {fields[0]!r} and no class; write "
                             f"IMAGE,CLASS on every line (or one CLASS a line, nothing else)")
        label = fields[1].split()[0] if fields[1].split() else ""
        if position == 0 and not lookup.holders(fields[0]) and label not in classes:
            continue  # a header line
        image = lookup.image(fields[0], where, place, folder)
        labels[image] = _known_class(label, classes, where, place, classes_from)
    refuse_unlabelled(where, folder, images, labels)
    return [labels[image] for image in images]


def read_train_labels(file: Path, folder: Path, images: list[str],
                      flag: Optional[str] = "--train-labels") -> list[str]:
    """The class of each training image (paths relative to `folder`, sorted) from `file`:
    `IMAGE,CLASS` lines (CSV, quoted fields as the csv module reads them, or whitespace), the
    first line a header where its first field names no image; a file whose columns are named
    (label_rows) by those names.  Every CLASS is a class name.  Exactly two fields a line: a
    table of more columns (a fold number, one column per class) would otherwise train on
    whichever column came second.  `flag` None: the folder's own metadata file, taken without
    one."""
    where = where_of(file, flag)
    rows, by_name = label_rows(file, flag)
    lookup = ImageLookup(images)
    if not by_name and not lookup.holders(rows[0][1][0]):
        rows = rows[1:]  # a header line
    labels = labelled_images(rows, lookup, where, folder, by_name)
    refuse_unlabelled(where, folder, images, labels)
    return whole_numbers_as_written([labels[image][0] for image in images])


def read_metadata_labels(files: list[Path], folder: Path, images: list[str],
                         classes: Optional[set[str]] = None,
                         classes_from: Optional[LabelSource] = None,
                         read: Optional[dict] = None) -> list[str]:
    """The class of each image of a split folder (paths relative to `folder`, sorted) from its
    metadata files (Hugging Face's imagefolder layout), in `folder` and its subfolders: each
    file's file_name is relative to the folder that holds it, as datasets' imagefolder reads
    it.  Every image labelled once across the files (datasets would leave an unlisted image
    out and give one listed twice two rows).  `classes` None: the training split's, whose
    classes are its labels; else every label must be one of `classes` (read_val_labels).
    `read`: {file: what read_metadata gave for it} of the files read before."""
    labels: dict[str, tuple[str, str, str]] = {}  # image: (class, file, "line 3")
    for file in files:
        under = file.parent.relative_to(folder).as_posix()
        prefix = "" if under == "." else f"{under}/"
        # the images under the file's folder: a run of the sorted paths
        own = images[bisect.bisect_left(images, prefix):
                     bisect.bisect_left(images, prefix[:-1] + "0")] if prefix else images
        own = [image[len(prefix):] for image in own]
        rows, _ = label_rows(file, None, (read or {}).get(file))
        found = labelled_images(rows, ImageLookup(own), str(file), file.parent, True)
        for image, (label, place) in found.items():
            image = prefix + image
            if image in labels:
                _, other, other_place = labels[image]
                raise UsageError(f"{file} {place} labels {image} again ({other} {other_place} "
                                 f"did); label each image in one metadata file")
            labels[image] = (label, str(file), place)
    if len(files) == 1:
        where = str(files[0])
    else:
        where = f"the metadata files of {folder} ({first_few(str(file) for file in files)})"
    refuse_unlabelled(where, folder, images, labels)
    if classes is None:
        return whole_numbers_as_written([labels[image][0] for image in images])
    return [_known_class(labels[image][0], classes, labels[image][1], labels[image][2],
                         classes_from) for image in images]


def labelled_images(rows: list[tuple[str, list[str]]], lookup: "ImageLookup", where: str,
                    folder: Path, by_name: bool) -> dict[str, tuple[str, str]]:
    """{image: (its class, where the file gives it: "line 3", a parquet file's "row 3")} from
    IMAGE,CLASS rows (`by_name`: a metadata file's file_name and label), each image labelled
    at most once; a missing class, a missing value's mark (a CSV's NaN, a JSON null) or a
    second label for an image is one line.  Images left unlabelled are the caller's to refuse
    (refuse_unlabelled): a split's metadata files label its images together."""
    write = "a label for every file_name" if by_name else "IMAGE,CLASS on every line"
    labels: dict[str, tuple[str, str]] = {}
    for place, fields in rows:
        if len(fields) != 2:
            raise UsageError(f"{where} {place} has {len(fields)} field(s); write "
                             f"IMAGE,CLASS on every line (a table of more columns, a fold "
                             f"number or one column per class, is not read: keep the image "
                             f"and class columns)")
        if any("\n" in name or "\ufffd" in name for name in fields):  # (inline: a million rows)
            _refuse_unreadable_names(fields, where, place)
        image = lookup.image(fields[0], where, place, folder)
        if not fields[1]:
            raise UsageError(f"{where} {place} gives {fields[0]!r} no class; write "
                             f"{write}")
        if fields[1].lower() in MISSING_VALUE_MARKS:
            raise UsageError(f"{where} {place} gives {fields[0]!r} the class "
                             f"{fields[1]!r}, the mark of a missing value (pandas and R write "
                             f"it for an empty cell); give the image its class, or remove the "
                             f"{place.split()[0]}")
        if image in labels:
            raise UsageError(f"{where} {place} labels {image} again ({labels[image][1]} "
                             f"did); one {place.split()[0]} per image")
        labels[image] = (fields[1], place)
    return labels


def metadata_columns(header: list[str]) -> Optional[tuple[int, int, int]]:
    """(file_name's column, label's column, the number of columns) where a header names both,
    as Hugging Face's imagefolder metadata.csv does among its other columns (a caption, a
    split); None otherwise, where every line is IMAGE,CLASS."""
    names = [name.strip().lower() for name in header]
    if "file_name" in names and "label" in names:
        return names.index("file_name"), names.index("label"), len(names)
    return None


def _named_fields(fields: list[str], named: tuple[int, int, int], where: str,
                  place: str) -> list[str]:
    """A metadata line's file_name and label, by the header's columns."""
    image_column, label_column, count = named
    if len(fields) != count:
        raise UsageError(f"{where} {place} has {len(fields)} field(s) where its header "
                         f"names {count}; give every line a value for each column")
    return [fields[image_column], fields[label_column]]


def whole_numbers_as_written(labels: list[str]) -> list[str]:
    """Class numbers a program wrote as floats (pandas writes 3.0 once a column held a
    missing value) as the whole numbers they are, so that they sort by value and name the
    classes 0..N-1 (class_order), not 0.0, 1.0, 10.0, 2.0 as text."""
    if labels and all(re.fullmatch(r"-?[0-9]+(\.0*)?", label) for label in labels):
        return [re.sub(r"\.0*$", "", label) for label in labels]
    return labels


def file_lines(text: str) -> list[str]:
    """A label file's text as its lines (text_lines), less the byte-order mark Excel starts a
    CSV with."""
    return text_lines(text.removeprefix("\ufeff"))


def text_lines(text: str) -> list[str]:
    r"""A label file's lines, split where the csv module and JSON Lines split them: at "\n",
    "\r\n" or "\r" only.  str.splitlines splits at U+2028, U+0085 and a form feed too,
    which a caption column may hold as they are (pandas writes them unquoted in a CSV, and
    unescaped in JSON lines with force_ascii=False; JSON allows them inside a string): its
    line would be read as two."""
    return re.split(r"\r\n|\r|\n", text)


def refuse_unlabelled(where: str, folder: Path, images: list[str], labelled) -> None:
    unlabelled = [image for image in images if image not in labelled]
    if unlabelled:
        raise UsageError(f"{where} gives no label for {len(unlabelled)} image(s) of {folder} "
                         f"(first: {unlabelled[0]}); label every image or remove the others")


def class_order(names: set[str], numbers_by_value: bool) -> list[str]:
    """Class names in index order: sorted, as image folders sort their class folders; with
    `numbers_by_value`, names that are all whole numbers sort by value, so a label file's
    classes 0..N-1 are the class indices (as strings they sort 0, 1, 10, 11, 2)."""
    if numbers_by_value and names and all(re.fullmatch(r"-?[0-9]+", name) for name in names):
        return sorted(names, key=lambda name: (int(name), name))
    return sorted(names)


def same_text(text: str) -> str:
    """`text` as names are compared: in Unicode's composed form (NFC).  macOS writes file names
    decomposed (NFD, "é" as "e" and a combining accent), a CSV written elsewhere composes them:
    the two print alike, and a line naming a photo copied from a Mac names that photo."""
    return unicodedata.normalize("NFC", text)


class ImageLookup:
    """Relative path, file name and file name without extension -> image; a name two images
    share (img000.jpg and img000.png; a/x.jpg and b/x.jpg) names neither, and `image` says
    which two it would be.  Names match whatever their Unicode form (same_text)."""

    def __init__(self, images: list[str]):
        self.by_name: dict[str, list[str]] = {}
        self.by_path: dict[str, list[str]] = {}
        for image in images:
            self.by_path.setdefault(same_text(image), []).append(image)
            name = PurePosixPath(image).name
            for key in {name, os.path.splitext(name)[0]} - {image}:
                self.by_name.setdefault(same_text(key), []).append(image)

    def holders(self, key: str) -> list[str]:
        """The images `key` may name: the one at that path, else those of that name."""
        key = same_text(key)
        return self.by_path.get(key) or self.by_name.get(key, [])

    def image(self, key: str, where: str, place: str, folder: Path) -> str:
        """The image `key` names, or the refusal of its line (`place`, "line 3"): no such
        image, or two of that name."""
        holders = self.holders(key)
        if len(holders) > 1:
            raise UsageError(f"{where} {place} names {key!r}, which is {holders[0]} and "
                             f"{holders[1]} alike; name the file with its extension, or its "
                             f"path inside {folder}")
        if not holders:
            raise UsageError(f"{where} {place} names {key!r}, which is not an image "
                             f"in {folder}; fix the {place.split()[0]} or add the image")
        return holders[0]


@functools.lru_cache(maxsize=4)
def _spellings(classes: frozenset) -> dict[str, str]:
    """same_text(class) -> the class as spelt: made once per set of classes, not per line."""
    return {same_text(name): name for name in classes}


def _known_class(label: str, classes: set[str], where: str, place: str,
                 classes_from: Optional[LabelSource]) -> str:
    """`label` as one of `classes` spells it; `classes_from`: the training labels' file(s), or
    None where the class folders gave them."""
    classes_from_file = classes_from is not None
    if label in classes:
        return label
    spelt = _spellings(frozenset(classes)).get(same_text(label))
    if spelt is not None:
        return spelt  # the class folder's own spelling
    whole = whole_numbers_as_written([label])[0]
    if classes_from_file and whole in classes:
        return whole  # 3.0 for the class 3 training read
    examples = ", ".join(sorted(classes)[:3])
    # the hint is for numbered labels against named class folders (ImageNet's numbering is not
    # the sorted one); a --train-labels file's classes may be numbers themselves
    hint = " (class numbers are not accepted: they mean different things in different files)" \
        if label.isdigit() and not classes_from_file else ""
    named = (f"the classes of {classes_from.name}", classes_from.use) if classes_from_file \
        else ("the class folders of train/", "the class folder names")
    raise UsageError(f"{where} {place}: {label!r} is not a class ({named[0]} are "
                     f"{examples}, ...){hint}; use {named[1]}")
