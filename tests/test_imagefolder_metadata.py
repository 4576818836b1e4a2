"""Hugging Face's imagefolder layout labelled by a metadata file: a metadata.csv,
metadata.jsonl or metadata.parquet at a split folder's root, naming each image's file_name and
label (other columns beside them), taken without a flag; the same files passed as
--train-labels or --val-labels; each problem of such a file as one line naming it and its line
(a parquet file's row); the cached index.

Oracles: Hugging Face's own builder (`datasets.load_dataset("imagefolder")`) for each image's
label; pandas' readers (read_csv, read_json with lines=True) and writer (to_parquet) for what a
label file says; the folder trees and files written here for the rest."""

from __future__ import annotations

import datetime
import json
import os
import time
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from accel_train.base.errors import UsageError
from accel_train.config import TrainConfig
from accel_train.data.imagefolder import index_folder
from accel_train.data.sources import load_data
from conftest import PINNED, accel_train_here, age_folders


def _image(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value % 256, dtype=np.uint8)).save(path)


def _write_metadata(file: Path, rows: list[dict]) -> None:
    """rows as Hugging Face's docs write them: JSON lines, or a CSV or parquet file through
    pandas."""
    if file.suffix == ".jsonl":
        file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif file.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(file)
    else:
        pd.DataFrame(rows).to_csv(file, index=False)


def _theirs(root: Path) -> dict[str, dict[str, str]]:
    """{split: {image path relative to root: its label as text}} as datasets' imagefolder
    reads the folder."""
    read = datasets.load_dataset("imagefolder", data_dir=str(root))
    found = {}
    for split, rows in read.items():
        rows = rows.cast_column("image", datasets.Image(decode=False))
        found[split] = {os.path.relpath(row["image"]["path"], root): str(row["label"])
                        for row in rows}
    return found


def _ours(data) -> dict[str, str]:
    """{image path relative to --data-dir: class name} over a load's training, held-out and
    test images (decoded per step: their paths are the rows' own)."""
    found = {}
    for source in (data.train, data.held_out, data.test):
        if source is None:
            continue
        paths = [value["path"] for value in source.column[:].column(0).to_pylist()]
        for path, label in zip(paths, source.labels.tolist()):
            found[path] = data.class_names[label]
    return found


def _hf_folder(root: Path, kind: str) -> None:
    """train/ of 12 images (three in a subfolder) and test/ of 4, each split labelled by its
    metadata file; labels as text with a space (CSV) or as numbers past 9 (JSON lines, parquet's
    int64 column), a caption column beside them, file_name not the first column."""
    labels = ["golden retriever", "pug", "beagle"] if kind == "csv" else [0, 2, 10]
    for split, count in (("train", 12), ("test", 4)):
        rows = []
        for i in range(count):
            name = f"more/{i}.png" if split == "train" and i >= 9 else f"{i}.png"
            _image(root / split / name, 20 * i + (split == "test"))
            rows.append({"caption": f"a photo, number {i}", "label": labels[i % 3],
                         "file_name": name})
        _write_metadata(root / split / f"metadata.{kind}", rows)


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
def test_a_metadata_file_labels_its_split_as_datasets_imagefolder_reads_it(tmp_path, kind):
    root = tmp_path / "hf"
    _hf_folder(root, kind)
    theirs = _theirs(root)
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never"))
    assert _ours(data) == {**theirs["train"], **theirs["test"]}
    # classes: text sorted, whole numbers by value (0, 2, 10: the class indices' order)
    assert data.class_names == (["beagle", "golden retriever", "pug"] if kind == "csv" else
                                ["0", "2", "10"])
    report = json.loads(accel_train_here("check-data", "--data-dir", str(root), "--workers",
                                         "1", "--json", check=True).stdout)
    assert report["labels_from"] == {"train": [f"train/metadata.{kind}"],
                                     "test": [f"test/metadata.{kind}"]}
    # the line the start summary prints too
    assert report["labels"] == \
        f"from train/metadata.{kind}, test/metadata.{kind} (file_name, label)"
    assert report["files_not_read"] == {}  # the metadata files are read
    for split in ("train", "test"):
        assert {name: n for name, n in report["class_counts"][split].items() if n} == \
            dict(Counter(theirs[split].values()))


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_class_folders_and_a_metadata_label_column_take_the_metadata_as_datasets_does(
        tmp_path, kind):
    """datasets' imagefolder adds no folder labels where it finds a metadata file (at the root
    of a folder without split folders, beside class folders): the file's label column labels
    each image, whatever class folder holds it; other columns are left alone."""
    root = tmp_path / "hf"
    rows = []
    for i in range(8):
        name = f"{['cat', 'dog'][i % 2]}/{i}.png"
        _image(root / name, 30 * i)
        rows.append({"file_name": name, "label": "indoor" if i < 5 else "outdoor",
                     "caption": f"photo {i}"})
    _write_metadata(root / f"metadata.{kind}", rows)
    theirs = _theirs(root)
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never", val_fraction=0.25))
    assert _ours(data) == theirs["train"]
    assert data.class_names == ["indoor", "outdoor"]


def test_a_metadata_file_without_a_label_column(tmp_path):
    """Beside unsorted images, the refusal says what the file lacks; beside class folders the
    folders stay the classes (datasets would give the images no label at all)."""
    root = tmp_path / "hf"
    for i in range(4):
        _image(root / "train" / f"{i}.png", 40 * i)
    metadata = root / "train" / "metadata.csv"
    _write_metadata(metadata, [{"file_name": f"{i}.png", "caption": "x"} for i in range(4)])
    refused = accel_train_here("--data-dir", str(root), *PINNED, "--output-dir",
                               str(tmp_path / "run"))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"accel_train: error: {root}/train/0.png is not inside a class folder; put each "
        f"class's images in a subfolder named after the class (the metadata.csv beside it, "
        f"Hugging Face's imagefolder layout, has no label column to label the images by; add "
        f"one naming each image's class)"]
    assert not (tmp_path / "run").exists()
    sorted_root = tmp_path / "sorted"
    for i in range(4):
        _image(sorted_root / ["ant", "bee"][i % 2] / f"{i}.png", 40 * i)
    _write_metadata(sorted_root / "metadata.jsonl",
                    [{"file_name": f"{['ant', 'bee'][i % 2]}/{i}.png", "caption": "x"}
                     for i in range(4)])
    data = load_data(TrainConfig(data_dir=str(sorted_root), in_memory="never",
                                 val_fraction=0.5))
    assert data.class_names == ["ant", "bee"]
    assert _ours(data) == {f"{['ant', 'bee'][i % 2]}/{i}.png": ["ant", "bee"][i % 2]
                           for i in range(4)}


GOOD = '{"file_name": "0.png", "label": "cat"}\n'
REST = '{"file_name": "2.png", "label": "dog"}\n{"file_name": "3.png", "label": "cat"}\n'
JSONL_PROBLEMS = {
    "not JSON": (GOOD + '{"file_name": "1.png", "label": \n' + REST,
                 "{file}: line 2 is not JSON (Expecting value, column 33); fix the line, or "
                 "remove the file and sort the images into class folders"),
    "first line not JSON": ('{"file_name": "0.png" "label": "cat"}\n' + REST,
                            "{file}: line 1 is not JSON (Expecting ',' delimiter, column 23)"),
    "not an object": (GOOD + '["1.png", "dog"]\n' + REST,
                      "{file} line 2 is not a JSON object; write one "
                      '{{"file_name": ..., "label": ...}} object a line'),
    "no label key": (GOOD + '{"file_name": "1.png", "class": "dog"}\n' + REST,
                     "{file} line 2 has no 'label' key; give every line the image's file_name "
                     "and its label"),
    "neither key": (GOOD + '{"path": "1.png", "class": "dog"}\n' + REST,
                    "{file} line 2 has no 'file_name' or 'label' key; give every line the "
                    "image's file_name and its label"),
    "a long object": (GOOD + '{"file_name": "1.png", "label": {"name": "a dog of many colours '
                      'and sizes"}}\n' + REST,
                      '{file} line 2 gives label {{"name": "a dog of many colours and s..., '
                      "neither text nor a number"),
    "null": (GOOD + '{"file_name": "1.png", "label": null}\n' + REST,
             "{file} line 2 gives '1.png' no class; write a label for every file_name"),
    "NaN": (GOOD + '{"file_name": "1.png", "label": NaN}\n' + REST,
            "{file} line 2 gives '1.png' the class 'nan', the mark of a missing value"),
    "NA as text": (GOOD + '{"file_name": "1.png", "label": "NA"}\n' + REST,
                   "{file} line 2 gives '1.png' the class 'NA', the mark of a missing value"),
    "a list": (GOOD + '{"file_name": "1.png", "label": ["dog", "cat"]}\n' + REST,
               '{file} line 2 gives label ["dog", "cat"], neither text nor a number; write the '
               "label as text or a number"),
    "twice": (GOOD + '{"file_name": "0.png", "label": "dog"}\n' + REST,
              "{file} line 2 labels 0.png again (line 1 did); one line per image"),
    "no such image": (GOOD + '{"file_name": "zz.png", "label": "dog"}\n' + REST,
                      "{file} line 2 names 'zz.png', which is not an image in {folder}"),
    "an image left out": (GOOD + REST, "{file} gives no label for 1 image(s) of {folder} "
                                       "(first: 1.png)"),
}


@pytest.mark.parametrize("problem", list(JSONL_PROBLEMS))
def test_each_metadata_jsonl_problem_is_one_line_naming_its_line(tmp_path, problem):
    text, message = JSONL_PROBLEMS[problem]
    folder = tmp_path / "hf" / "train"
    for i in range(4):
        _image(folder / f"{i}.png", 50 * i)
    file = folder / "metadata.jsonl"
    file.write_text(text)
    ran = accel_train_here("--data-dir", str(tmp_path / "hf"), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    err = ran.stderr.strip().splitlines()
    assert ran.returncode == 2 and len(err) == 1, ran.stderr
    expected = "accel_train: error: " + message.format(file=file, folder=folder)
    assert err[0].startswith(expected), (err[0], expected)
    assert not (tmp_path / "run").exists()
    # passed as --train-labels, the same line, the flag before the file
    ran = accel_train_here("--data-dir", str(tmp_path / "hf"), "--train-labels", str(file),
                           *PINNED, "--output-dir", str(tmp_path / "run"))
    flagged = "accel_train: error: --train-labels " + message.format(file=file, folder=folder)
    if problem != "first line not JSON" and problem != "not JSON":
        assert ran.stderr.strip().startswith(flagged), (ran.stderr, flagged)
    else:  # (the reader's kind names the flag's fix)
        assert ran.stderr.strip().startswith(flagged.split("; fix")[0]), (ran.stderr, flagged)


def test_a_metadata_csv_excel_saved_with_its_byte_order_mark_is_read(tmp_path):
    """Excel's "CSV UTF-8" starts the file with a byte order mark: the header still names
    file_name, as pandas reads it (its oracle: encoding utf-8-sig)."""
    folder = tmp_path / "hf" / "train"
    for i in range(4):
        _image(folder / f"{i}.png", 50 * i)
    file = folder / "metadata.csv"
    file.write_bytes("file_name,label\n0.png,cat\n1.png,dog\n2.png,cat\n3.png,dog\n"
                     .encode("utf-8-sig"))
    expected = pd.read_csv(file, encoding="utf-8-sig")
    data = load_data(TrainConfig(data_dir=str(tmp_path / "hf"), in_memory="never"))
    ours = _ours(data)
    assert ours == {f"train/{name}": label
                    for name, label in zip(expected["file_name"], expected["label"])}


# captions as scraped text holds them: a line break pandas quotes in a CSV (an empty line and a
# "#" inside the caption too), Unicode's line and paragraph separators, NEL and a form feed,
# which str.splitlines breaks at but neither the csv module nor JSON Lines does (pandas writes
# them raw in a CSV, and in JSON lines with force_ascii=False), a comma and quotes
CAPTIONS = ["a photo\nover two lines", "one\n\n# not a comment", "line\u2028separator",
            "paragraph\u2029separator", "next line\u0085mark", "form\x0cfeed",
            'she said "hi", twice', "windows\r\nbreak"]


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_captions_over_several_lines_are_read_as_datasets_reads_them(tmp_path, kind):
    """A caption column beside file_name and label, its captions over several lines or holding
    a Unicode line break: every image labelled as datasets' imagefolder labels it."""
    root = tmp_path / "hf"
    rows = []
    for i, caption in enumerate(CAPTIONS):
        _image(root / "train" / f"{i}.png", 30 * i)
        rows.append({"file_name": f"{i}.png", "label": ["cat", "dog", "owl"][i % 3],
                     "caption": caption})
    file = root / "train" / f"metadata.{kind}"
    if kind == "csv":
        pd.DataFrame(rows).to_csv(file, index=False)
        assert file.read_text().count("\n") > len(rows) + 1  # captions over several lines
    else:
        pd.DataFrame(rows).to_json(file, orient="records", lines=True, force_ascii=False)
        assert "\u2028" in file.read_text()  # written as it is, not escaped
    theirs = _theirs(root)
    assert len(theirs["train"]) == len(rows)
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never"))
    assert _ours(data) == theirs["train"]
    assert data.class_names == ["cat", "dog", "owl"]


def test_a_semicolon_label_file_with_a_caption_over_lines_splits_at_semicolons(tmp_path):
    """Excel's semicolon CSV (the comma its decimal mark): the header decides the file's
    separator, not a line's decimal comma or a comma in a caption (pandas' read_csv with
    sep=";" is the oracle for what the file says)."""
    for i in range(4):
        _image(tmp_path / "flat" / f"{i}.png", 50 * i)
    file = tmp_path / "labels.csv"
    file.write_text('file_name;label;caption\n0.png;cat;"first\nthen, a comma"\n1.png;dog;0,93\n'
                    '2.png;cat;"a; b"\n3.png;dog;"2,5 cm\nlong"\n')
    table = pd.read_csv(file, sep=";")
    data = load_data(TrainConfig(data_dir=str(tmp_path / "flat"), train_labels=str(file),
                                 in_memory="never", val_fraction=0.5))
    found = {**_ours_held_out(data), **{
        value["path"]: data.class_names[label] for value, label in
        zip(data.train.column[:].column(0).to_pylist(), data.train.labels.tolist())}}
    assert found == dict(zip(table["file_name"], table["label"]))


def test_a_tsv_as_pandas_writes_it_keeps_spaces_inside_its_fields(tmp_path):
    """A tab-separated file (pandas' to_csv with sep="\\t", a spreadsheet's TSV): a class or
    file name with a space in it is one field, a comma in a caption is no separator (pandas'
    read_csv with sep="\\t" is the oracle).  Tabs that align columns, two in a row, are
    whitespace as before."""
    rows = []
    for i in range(6):
        _image(tmp_path / "flat" / f"photo {i}.png", 40 * i)
        rows.append({"file_name": f"photo {i}.png", "label": ["golden retriever", "pug"][i % 2],
                     "caption": f"a dog, number {i}"})
    file = tmp_path / "labels.tsv"
    pd.DataFrame(rows).to_csv(file, sep="\t", index=False)
    table = pd.read_csv(file, sep="\t")

    def labels(file: Path) -> dict[str, str]:
        data = load_data(TrainConfig(data_dir=str(tmp_path / "flat"), train_labels=str(file),
                                     in_memory="never", val_fraction=0.5))
        return {**_ours_held_out(data), **{
            value["path"]: data.class_names[label] for value, label in
            zip(data.train.column[:].column(0).to_pylist(), data.train.labels.tolist())}}

    assert labels(file) == dict(zip(table["file_name"], table["label"]))
    for i in range(6):
        (tmp_path / "flat" / f"photo {i}.png").rename(tmp_path / "flat" / f"p{i}.png")
    aligned = tmp_path / "aligned.txt"
    aligned.write_text("".join(f"p{i}.png\t\t{['cat', 'dog'][i % 2]}\n" for i in range(6)))
    assert labels(aligned) == {f"p{i}.png": ["cat", "dog"][i % 2] for i in range(6)}


def test_a_header_of_words_over_comma_separated_lines(tmp_path):
    """A header written by hand with spaces ("image label") over IMAGE,CLASS lines: the lines'
    commas separate, as each line's own did before a file had one separator."""
    for i in range(4):
        _image(tmp_path / "flat" / f"{i}.png", 50 * i)
    file = tmp_path / "labels.csv"
    file.write_text("image label\n" + "".join(f"{i}.png,{['cat', 'dog'][i % 2]}\n"
                                               for i in range(4)))
    data = load_data(TrainConfig(data_dir=str(tmp_path / "flat"), train_labels=str(file),
                                 in_memory="never", val_fraction=0.5))
    found = {**_ours_held_out(data), **{
        value["path"]: data.class_names[label] for value, label in
        zip(data.train.column[:].column(0).to_pylist(), data.train.labels.tolist())}}
    assert found == {f"{i}.png": ["cat", "dog"][i % 2] for i in range(4)}


def test_comments_and_blank_lines_between_quoted_records_are_skipped(tmp_path):
    """Comment lines (indented too) and blank lines before the header and between records of a
    quoted CSV are no records, as in an unquoted one; a "#" or a blank line inside a quoted
    caption is the caption's.  A comment line's comma or tab decides nothing, nor does a
    separator inside the first line's quotes (pandas' read_csv with comment="#" and
    skip_blank_lines is the oracle for the records)."""
    for i in range(4):
        _image(tmp_path / "flat" / f"{i}.png", 50 * i)
    for separator in (",", ";"):
        other = ";" if separator == "," else ","
        file = tmp_path / f"labels{len(separator)}.csv"
        file.write_text("\n".join([
            f"# written by hand{other} then saved", "", "  # an indented comment\t",
            separator.join(["file_name", "label", f'"caption{other} here"']),
            separator.join(["0.png", "cat", '"one\n\n# still the caption"']), "",
            "   # between records", separator.join(["1.png", "dog", "plain"]),
            separator.join(["2.png", '"cat"', '"two\nlines"']),
            separator.join(["3.png", "dog", "x"])]) + "\n")
        table = pd.read_csv(file, sep=separator, comment=None, skiprows=3)
        data = load_data(TrainConfig(data_dir=str(tmp_path / "flat"), train_labels=str(file),
                                     in_memory="never", val_fraction=0.5))
        found = {**_ours_held_out(data), **{
            value["path"]: data.class_names[label] for value, label in
            zip(data.train.column[:].column(0).to_pylist(), data.train.labels.tolist())}}
        expected = {name: label for name, label in zip(table["file_name"], table["label"])
                    if isinstance(name, str) and not name.lstrip().startswith("#")}
        assert found == expected == {"0.png": "cat", "1.png": "dog", "2.png": "cat",
                                     "3.png": "dog"}, separator
    # and in a file without a quote (read line by line)
    file = tmp_path / "plain.csv"
    file.write_text("# by hand, then saved\n  # indented\n\nfile_name,label\n0.png,cat\n"
                    "  # between\n1.png,dog\n2.png,cat\n3.png,dog\n")
    data = load_data(TrainConfig(data_dir=str(tmp_path / "flat"), train_labels=str(file),
                                 in_memory="never", val_fraction=0.5))
    assert sorted(data.class_names) == ["cat", "dog"] and len(data.train.labels) + \
        len(data.held_out.labels) == 4


@pytest.mark.parametrize("kind, text", [("csv", ""), ("csv", "# only a comment\n\n"),
                                        ("jsonl", ""), ("jsonl", "\n# a comment\n")])
def test_a_metadata_file_of_no_records_names_its_missing_columns(tmp_path, kind, text):
    folder = tmp_path / "hf" / "train"
    for i in range(4):
        _image(folder / f"{i}.png", 50 * i)
    (folder / f"metadata.{kind}").write_text(text)
    ran = accel_train_here("--data-dir", str(tmp_path / "hf"), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    assert ran.returncode == 2 and ran.stderr.strip().splitlines() == [
        f"accel_train: error: {folder / '0.png'} is not inside a class folder; put each "
        f"class's images in a subfolder named after the class (the metadata.{kind} beside it, "
        f"Hugging Face's imagefolder layout, has no file_name or label column to label the "
        f"images by; add one naming each image's class)"]


def test_an_image_name_over_lines_or_not_utf8_is_named_as_the_image(tmp_path):
    """The image's field, not only the class's: a quote left open in a file name two lines long
    (the shortest), and a file name in the Windows encoding."""
    folder = tmp_path / "hf" / "train"
    line = _quote_problem(tmp_path, 'file_name,label\n"0.png\n1.png",cat\n2.png,dog\n')
    assert line == (f"accel_train: error: {folder / 'metadata.csv'} line 2 gives the image "
                    f'"0.png\\n1.png", over 2 lines: a quote (") opens it that only a later '
                    f"line closes; close the quote on its line, or remove it")
    line = _quote_problem(tmp_path, "file_name,label\ncafé.png,cat\n".encode("cp1252"))
    assert line.startswith(f"accel_train: error: {folder / 'metadata.csv'} line 2 gives the "
                           f'image "caf\\ufffd.png": the file is not UTF-8 text'), line


@pytest.mark.parametrize("flag", ["--train-labels", "--val-labels"])
def test_a_flags_label_file_damaged_names_the_flag_and_its_fix(tmp_path, flag):
    """A --train-labels or --val-labels file, a line of its JSON lines not JSON or its parquet
    copy cut short: one line with the flag before the file and the flag's fix (not an image
    folder's metadata file's), the decoder's own words inside."""
    _imagenet_like(tmp_path / "d")
    names = [f"t{i}.png" for i in range(4)] if flag == "--train-labels" else \
        [f"v{i}.png" for i in range(4)]
    data = tmp_path / ("d/train" if flag == "--train-labels" else "d")
    file = tmp_path / "labels.jsonl"
    bad = '{"file_name": "x", "label": cat}'
    file.write_text(f'{{"file_name": "{names[0]}", "label": "cat"}}\n{bad}\n')
    try:
        json.loads(bad)
    except json.JSONDecodeError as err:
        decoder = f"{err.msg}, column {err.colno}"
    ran = accel_train_here("--data-dir", str(data), flag, str(file), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    assert ran.returncode == 2 and ran.stderr.strip().splitlines() == [
        f"accel_train: error: {flag} {file}: line 2 is not JSON ({decoder}); fix the line or "
        f"pass another file"]
    table = tmp_path / "labels.parquet"
    pd.DataFrame({"file_name": names, "label": ["cat", "dog"] * 2}).to_parquet(table)
    table.write_bytes(table.read_bytes()[:200])
    ran = accel_train_here("--data-dir", str(data), flag, str(table), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    assert ran.returncode == 2 and ran.stderr.startswith(
        f"accel_train: error: {flag} {table}: is not a readable parquet file ("), ran.stderr
    assert ran.stderr.strip().endswith("; fix the line or pass another file")


def _quote_problem(tmp_path: Path, text: str | bytes) -> str:
    """The one line training gives for a metadata.csv of `text` beside 0.png-5.png."""
    folder = tmp_path / "hf" / "train"
    for i in range(6):
        _image(folder / f"{i}.png", 40 * i)
    (folder / "metadata.csv").write_bytes(text if isinstance(text, bytes) else text.encode())
    ran = accel_train_here("--data-dir", str(tmp_path / "hf"), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    err = ran.stderr.strip().splitlines()
    assert ran.returncode == 2 and len(err) == 1, ran.stderr
    assert not (tmp_path / "run").exists()
    return err[0]


def test_a_quote_no_line_closes_is_one_line_naming_where_it_opens(tmp_path):
    """`"cat` for cat on line 4: pandas' read_csv refuses the file (the oracle); so does the
    run, naming line 4, where before the quote went unnoticed."""
    text = 'file_name,label\n0.png,cat\n1.png,dog\n2.png,"cat\n3.png,dog\n4.png,cat\n5.png,dog\n'
    folder = tmp_path / "hf" / "train"
    line = _quote_problem(tmp_path, text)
    with pytest.raises(pd.errors.ParserError, match="EOF inside string"):
        pd.read_csv(folder / "metadata.csv")
    assert line == (f"accel_train: error: {folder / 'metadata.csv'} line 4 opens a quoted "
                    f"field (\") that no line after it closes; close the quote, or remove it")
    # a long file after it: the csv module's field limit comes first, the same line's start
    long = text.replace("3.png,dog\n", "".join(f"3.png,dog {i}\n" for i in range(20_000)))
    assert _quote_problem(tmp_path, long) == (
        f"accel_train: error: {folder / 'metadata.csv'} line 4: a quoted field (\") opened "
        f"there goes on too far (field larger than field limit (131072)); close the quote, or "
        f"remove it")
    # the quote on the file's last line, with and without its line's end
    for end in ("\n", ""):
        text = 'file_name,label\n0.png,cat\n1.png,dog\n2.png,cat\n3.png,dog\n4.png,cat\n5.png,"dog'
        assert "line 7 opens a quoted field" in _quote_problem(tmp_path, text + end)


def test_a_quote_a_later_line_closes_is_one_line_naming_the_class_it_made(tmp_path):
    """`"cat` on line 4 and `dog"` on line 6: pandas reads lines 4 to 6 as one class over three
    lines (the oracle); the run names it instead of training on it."""
    text = 'file_name,label\n0.png,cat\n1.png,dog\n2.png,"cat\n3.png,dog\n4.png,cat"\n5.png,dog\n'
    folder = tmp_path / "hf" / "train"
    line = _quote_problem(tmp_path, text)
    read = pd.read_csv(folder / "metadata.csv")
    assert read["label"].tolist()[2] == "cat\n3.png,dog\n4.png,cat" and len(read) == 4
    assert line == (f"accel_train: error: {folder / 'metadata.csv'} line 4 gives the class "
                    f'"cat\\n3.png,dog\\n4.png,cat", over 3 lines: a quote (") opens it '
                    f"that only a later line closes; close the quote on its line, or remove it")


def test_a_csv_in_the_windows_encoding_is_one_line_not_classes_named_with_u_fffd(tmp_path):
    """Excel's "CSV (Comma delimited)" on Windows writes cp1252: café's é is a byte that is not
    UTF-8.  pandas' read_csv refuses the file (the oracle); the run names the line and the
    class, where it trained on "caf\ufffd" before.  A byte that is not UTF-8 in a column not
    read (a caption) is left alone, as before: the line judges it."""
    text = "file_name,label,caption\r\n" + "".join(
        f"{i}.png,{'café' if i % 2 else 'tea'},photo {i}\r\n" for i in range(6))
    folder = tmp_path / "hf" / "train"
    folder.mkdir(parents=True)
    (folder / "metadata.csv").write_bytes(text.encode("cp1252"))
    with pytest.raises(UnicodeDecodeError):
        pd.read_csv(folder / "metadata.csv")
    line = _quote_problem(tmp_path, text.encode("cp1252"))
    assert line == (f"accel_train: error: {folder / 'metadata.csv'} line 3 gives the class "
                    f'"caf\\ufffd": the file is not UTF-8 text (a spreadsheet\'s CSV in the '
                    f"Windows encoding); save it as UTF-8 (Excel: CSV UTF-8), or convert it "
                    f"(iconv -f cp1252 -t utf-8)")
    # the same in JSON lines, written with ensure_ascii=False and saved in cp1252
    (folder / "metadata.csv").unlink()
    (folder / "metadata.jsonl").write_bytes("".join(
        json.dumps({"file_name": f"{i}.png", "label": "tea" if i % 2 else "bière"},
                   ensure_ascii=False) + "\n" for i in range(6)).encode("cp1252"))
    ran = accel_train_here("--data-dir", str(tmp_path / "hf"), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    assert ran.returncode == 2 and ran.stderr.startswith(
        f"accel_train: error: {folder / 'metadata.jsonl'} line 1 gives the class "
        f'"bi\\ufffdre": the file is not UTF-8 text'), ran.stderr
    (folder / "metadata.jsonl").unlink()
    captions = text.replace("café", "cafe").replace("photo 3", "photo é")
    (folder / "metadata.csv").write_bytes(captions.encode("cp1252"))
    data = load_data(TrainConfig(data_dir=str(tmp_path / "hf"), in_memory="never"))
    assert data.class_names == ["cafe", "tea"]


def test_a_line_after_a_caption_over_lines_is_named_by_its_own_number(tmp_path):
    """Lines count as an editor counts them: the row after a two-line caption is line 4 (the
    header line 1, the caption's record lines 2 and 3), not the third record."""
    text = 'file_name,label,caption\n0.png,cat,"two\nlines"\n1.png,,missing class\n'
    folder = tmp_path / "hf" / "train"
    line = _quote_problem(tmp_path, text)
    assert line.startswith(f"accel_train: error: {folder / 'metadata.csv'} line 4 gives "
                           f"'1.png' no class"), line


@pytest.mark.parametrize("other", ["jsonl", "parquet"])
def test_metadata_files_of_both_kinds_in_one_folder_are_refused(tmp_path, other):
    """As datasets refuses them ("Found metadata files with different extensions")."""
    folder = tmp_path / "hf"
    for i in range(4):
        _image(folder / f"{i}.png", 50 * i)
    rows = [{"file_name": f"{i}.png", "label": i % 2} for i in range(4)]
    _write_metadata(folder / "metadata.csv", rows)
    _write_metadata(folder / f"metadata.{other}", rows)
    with pytest.raises(ValueError, match="different extensions"):
        datasets.load_dataset("imagefolder", data_dir=str(folder))
    ran = accel_train_here("--data-dir", str(folder), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    assert ran.returncode == 2 and ran.stderr.strip().splitlines() == [
        f"accel_train: error: {folder} holds both metadata.csv and metadata.{other}; keep one "
        f"(Hugging Face's imagefolder reads one kind of metadata file)"]


def _imagenet_like(root: Path) -> None:
    for i in range(4):
        _image(root / "train" / ["cat", "dog"][i % 2] / f"t{i}.png", 10 * i)
        _image(root / "val" / f"v{i}.png", 10 * i + 5)


def test_val_labels_read_a_header_naming_file_name_and_label_and_json_lines(tmp_path):
    """--val-labels reads metadata columns by name as --train-labels does: label before
    file_name, a caption between (read by position, the first field would be the image)."""
    root = tmp_path / "d"
    _imagenet_like(root)
    rows = [{"label": ["dog", "cat"][i % 2], "caption": f"photo {i}, indoors",
             "file_name": f"v{i}.png"} for i in range(4)]
    for file, read in ((tmp_path / "val.csv", lambda f: pd.read_csv(f, dtype=str)),
                       (tmp_path / "val.jsonl", lambda f: pd.read_json(f, lines=True))):
        _write_metadata(file, rows)
        table = read(file)
        expected = {f"val/{name}": label for name, label in zip(table["file_name"],
                                                                table["label"])}
        data = load_data(TrainConfig(data_dir=str(root), val_labels=str(file),
                                     in_memory="never"))
        assert {path: name for path, name in _ours_held_out(data).items()} == expected


def _ours_held_out(data) -> dict[str, str]:
    paths = [value["path"] for value in data.held_out.column[:].column(0).to_pylist()]
    return {path: data.class_names[label]
            for path, label in zip(paths, data.held_out.labels.tolist())}


def test_train_labels_read_json_lines(tmp_path):
    """A metadata.jsonl kept outside the folder, passed with --train-labels: whole numbers
    (3.0 as a float) are the class numbers, other keys ignored."""
    for i in range(6):
        _image(tmp_path / "flat" / f"{i}.png", 40 * i)
    file = tmp_path / "labels.jsonl"
    _write_metadata(file, [{"id": i, "file_name": f"{i}.png", "label": [0, 1.0, 2][i % 3]}
                           for i in range(6)])
    table = pd.read_json(file, lines=True)
    data = load_data(TrainConfig(data_dir=str(tmp_path / "flat"), train_labels=str(file),
                                 in_memory="never", val_fraction=0.5))
    assert data.class_names == ["0", "1", "2"]
    found = {**_ours_held_out(data), **{
        value["path"]: data.class_names[label] for value, label in
        zip(data.train.column[:].column(0).to_pylist(), data.train.labels.tolist())}}
    assert found == {name: str(int(label)) for name, label in zip(table["file_name"],
                                                                    table["label"])}


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_an_edited_metadata_file_is_read_again_not_taken_from_the_cached_index(tmp_path, kind):
    """Rewriting a file in place changes no folder's mtime: the cached index checks the
    metadata file's own."""
    root, cache = tmp_path / "hf", tmp_path / "cache"
    for i in range(4):
        _image(root / f"{i}.png", 40 * i)
    metadata = root / f"metadata.{kind}"
    _write_metadata(metadata, [{"file_name": f"{i}.png", "label": label}
                               for i, label in enumerate("aabb")])
    old = time.time() - 3600
    os.utime(metadata, (old, old))
    age_folders(root, then=old)
    index_folder(root, cache_dir=cache, cache_min_files=0)
    cached = index_folder(root, cache_dir=cache, cache_min_files=0)
    assert cached.cached and cached.splits["train"][1].tolist() == [0, 0, 1, 1]
    assert cached.metadata_labels == {"train": [f"metadata.{kind}"]}
    _write_metadata(metadata, [{"file_name": f"{i}.png", "label": label}
                               for i, label in enumerate("abbc")])
    age_folders(root, then=old)
    edited = index_folder(root, cache_dir=cache, cache_min_files=0)
    assert not edited.cached and edited.class_names == ["a", "b", "c"]
    assert edited.splits["train"][1].tolist() == [0, 1, 1, 2]


@pytest.mark.slow
def test_training_says_where_its_labels_came_from_and_eval_counts_them(tmp_path):
    """The start summary names the metadata files once; eval of the run's test split counts
    each class as datasets' imagefolder labels it."""
    root = tmp_path / "hf"
    _hf_folder(root, "jsonl")
    theirs = _theirs(root)
    run = tmp_path / "run"
    trained = accel_train_here("--data-dir", str(root), *PINNED, "--model", "test_resnet",
                               "--batch-size", "4", "--max-steps", "1", "--no-plots",
                               "--progress", "log", "--output-dir", str(run), check=True)
    line = "labels: from train/metadata.jsonl, test/metadata.jsonl (file_name, label)"
    assert trained.stdout.count(line) == 1, trained.stdout
    evaluated = json.loads(accel_train_here("eval", str(run), "--split", "test", "--json",
                                            check=True).stdout.strip().splitlines()[-1])
    assert {name: c["images"] for name, c in evaluated["per_class"].items() if c["images"]} \
        == dict(Counter(theirs["test"].values()))


def test_class_depth_where_files_label_every_split_is_refused(tmp_path):
    """--class-depth names the level of class folders; where metadata files (or label files)
    label every split, no class folder is read and the flag would change nothing: one line,
    exit 2.  Where a split is still labelled by its class folders, the flag is taken."""
    root = tmp_path / "hf"
    _hf_folder(root, "csv")
    ran = accel_train_here("--data-dir", str(root), "--class-depth", "1", *PINNED,
                           "--output-dir", str(tmp_path / "run"))
    assert ran.returncode == 2 and ran.stderr.strip().splitlines() == [
        f"accel_train: error: --class-depth 1 names the folder level of the classes, and files "
        f"label every split of {root} (test: test/metadata.csv; train: train/metadata.csv), "
        f"so no class folder is read; drop --class-depth"], ran.stderr
    assert not (tmp_path / "run").exists()
    # the training images labelled by --train-labels, no other split
    flat = tmp_path / "flat"
    for i in range(4):
        _image(flat / f"{i}.png", 40 * i)
    (tmp_path / "labels.csv").write_text("".join(f"{i}.png,{i % 2}\n" for i in range(4)))
    with pytest.raises(UsageError, match=r"--class-depth 2 names .* \(train: --train-labels "):
        index_folder(flat, class_depth=2, train_labels=str(tmp_path / "labels.csv"))
    # train/ by its metadata file, val/ by class folders two levels down: --class-depth reads
    # val's
    mixed = tmp_path / "mixed"
    rows = []
    for i in range(4):
        _image(mixed / "train" / f"{i}.png", 30 * i)
        rows.append({"file_name": f"{i}.png", "label": ["cat", "dog"][i % 2]})
        _image(mixed / "val" / "site" / ["cat", "dog"][i % 2] / f"v{i}.png", 30 * i + 5)
    _write_metadata(mixed / "train" / "metadata.csv", rows)
    index = index_folder(mixed, class_depth=2)
    assert index.class_names == ["cat", "dog"]


def _parquet_problem_folder(root: Path) -> Path:
    folder = root / "train"
    for i in range(4):
        _image(folder / f"{i}.png", 50 * i)
    return folder


def _cat_dog(labels: list, names=("0.png", "1.png", "2.png", "3.png")) -> list[dict]:
    return [{"file_name": name, "label": label} for name, label in zip(names, labels)]


# {problem: (the rows pandas writes, the line that names the file and its row)}: rows count
# from 1, pandas' index + 1 (each case's bad row is pandas' index 1, else its first)
PARQUET_PROBLEMS = {
    "no such image": (_cat_dog(["cat", "dog", "dog", "cat"], ["0.png", "zz.png", "2.png",
                                                            "3.png"]),
                      "{file} row 2 names 'zz.png', which is not an image in {folder}; fix the "
                      "row or add the image"),
    "a missing label": (_cat_dog(["cat", None, "dog", "cat"]),
                        "{file} row 2 gives '1.png' no class; write a label for every "
                        "file_name"),
    # (pandas writes a NaN of a column of numbers as parquet's null)
    "NaN in a column of numbers": (_cat_dog([0, float("nan"), 1, 0]),
                                   "{file} row 2 gives '1.png' no class"),
    "NA as text": (_cat_dog(["cat", "NA", "dog", "cat"]),
                   "{file} row 2 gives '1.png' the class 'NA', the mark of a missing value "
                   "(pandas and R write it for an empty cell); give the image its class, or "
                   "remove the row"),
    "a list": (_cat_dog([["cat"], ["dog"], ["dog"], ["cat"]]),
               '{file} row 1 gives label ["cat"], neither text nor a number; write the label '
               "as text or a number"),
    "a struct": (_cat_dog([{"name": n} for n in ("cat", "dog", "dog", "cat")]),
                 '{file} row 1 gives label {{"name": "cat"}}, neither text nor a number'),
    "true/false": (_cat_dog([True, False, True, False]),
                   "{file} row 1 gives label true, neither text nor a number"),
    # a spreadsheet's date column taken for the label: no JSON value, written as Python writes it
    "a date": (_cat_dog([datetime.date(2024, 5, d) for d in (1, 2, 3, 4)]),
               '{file} row 1 gives label "2024-05-01", neither text nor a number'),
    # shown whole up to 40 characters of JSON, cut to 37 and "..." past them
    "a list of 40 characters": (_cat_dog([["a" * 36]] * 4),
                                f'{{file}} row 1 gives label ["{"a" * 36}"], neither text'),
    "a list of 41 characters": (_cat_dog([["a" * 37]] * 4),
                                f'{{file}} row 1 gives label ["{"a" * 35}..., neither text'),
    "twice": (_cat_dog(["cat", "dog", "dog", "cat"], ["0.png", "0.png", "2.png", "3.png"]),
              "{file} row 2 labels 0.png again (row 1 did); one row per image"),
    "an image left out": (_cat_dog(["cat", "dog", "cat"], ["0.png", "2.png", "3.png"]),
                          "{file} gives no label for 1 image(s) of {folder} (first: 1.png)"),
    "no rows": ([], "{file} holds no labels"),
}


@pytest.mark.parametrize("problem", list(PARQUET_PROBLEMS))
def test_each_metadata_parquet_problem_is_one_line_naming_its_row(tmp_path, problem):
    """Each is refused as the same problem of a metadata.jsonl is, the row in place of the
    line; passed as --train-labels, the same line with the flag before the file."""
    rows, message = PARQUET_PROBLEMS[problem]
    folder = _parquet_problem_folder(tmp_path / "hf")
    file = folder / "metadata.parquet"
    frame = pd.DataFrame(rows) if rows else pd.DataFrame({"file_name": [], "label": []})
    frame.to_parquet(file)
    expected = message.format(file=file, folder=folder)
    for flag in ([], ["--train-labels", str(file)]):
        ran = accel_train_here("--data-dir", str(tmp_path / "hf"), *flag, *PINNED,
                               "--output-dir", str(tmp_path / "run"))
        err = ran.stderr.strip().splitlines()
        assert ran.returncode == 2 and len(err) == 1, ran.stderr
        said = "accel_train: error: " + " ".join([*flag[:1], expected])
        assert err[0].startswith(said), (err[0], said)
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage", ["random bytes", "cut short"])
def test_a_damaged_metadata_parquet_is_one_line(tmp_path, damage):
    folder = _parquet_problem_folder(tmp_path / "hf")
    file = folder / "metadata.parquet"
    _write_metadata(file, _cat_dog(["cat", "dog", "dog", "cat"]))
    whole = file.read_bytes()
    file.write_bytes(os.urandom(300) if damage == "random bytes" else whole[:len(whole) // 2])
    ran = accel_train_here("--data-dir", str(tmp_path / "hf"), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    assert ran.returncode == 2 and len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert ran.stderr.startswith(f"accel_train: error: {file}: is not a readable parquet file ")
    assert ran.stderr.strip().endswith("; write it again (pandas: DataFrame.to_parquet), or "
                                       "remove the file and sort the images into class folders")
    assert not (tmp_path / "run").exists()


def test_a_metadata_parquet_without_a_label_column_beside_unsorted_images(tmp_path):
    folder = _parquet_problem_folder(tmp_path / "hf")
    _write_metadata(folder / "metadata.parquet",
                    [{"file_name": f"{i}.png", "caption": "x"} for i in range(4)])
    ran = accel_train_here("--data-dir", str(tmp_path / "hf"), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    assert ran.returncode == 2 and ran.stderr.strip().splitlines() == [
        f"accel_train: error: {folder}/0.png is not inside a class folder; put each class's "
        f"images in a subfolder named after the class (the metadata.parquet beside it, Hugging "
        f"Face's imagefolder layout, has no label column to label the images by; add one "
        f"naming each image's class)"]
    # passed as --train-labels: the file itself is refused, naming the columns it has
    file = folder / "metadata.parquet"
    ran = accel_train_here("--data-dir", str(tmp_path / "hf"), "--train-labels", str(file),
                           *PINNED, "--output-dir", str(tmp_path / "run"))
    assert ran.returncode == 2 and ran.stderr.strip().splitlines() == [
        f"accel_train: error: --train-labels {file} has no 'label' column (its columns: "
        f"file_name, caption); name the images' column file_name and their classes' label"]


def test_whole_number_labels_in_parquet_are_the_classes_their_text_names(tmp_path):
    """An int64 label column (train/) and a text one (test/): 3 and "3" are one class, named
    "3", the classes sorted by value, as a metadata.csv's are."""
    root = tmp_path / "hf"
    labels = {"train": [3, 10, 2, 3, 10, 2], "test": ["10", "2", "3"]}
    for split, written in labels.items():
        for i in range(len(written)):
            _image(root / split / f"{i}.png", 30 * i + (split == "test"))
        _write_metadata(root / split / "metadata.parquet",
                        [{"file_name": f"{i}.png", "label": label}
                         for i, label in enumerate(written)])
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never"))
    assert data.class_names == ["2", "3", "10"]
    assert _ours(data) == {f"{split}/{i}.png": str(label) for split, written in labels.items()
                           for i, label in enumerate(written)}


def test_a_lone_metadata_parquet_of_image_rows_is_parquet_data(tmp_path):
    """Named metadata.parquet with no image or folder beside it, a parquet file is data (the
    parquet layout), not an image folder's labels."""
    import io
    blobs = []
    for i in range(6):
        buffer = io.BytesIO()
        Image.fromarray(np.full((4, 4, 3), i, np.uint8)).save(buffer, format="PNG")
        blobs.append({"bytes": buffer.getvalue(), "path": None})
    pd.DataFrame({"image": blobs, "label": [i % 2 for i in range(6)]}).to_parquet(
        tmp_path / "metadata.parquet")
    data = load_data(TrainConfig(data_dir=str(tmp_path), in_memory="never", val_fraction=0.5))
    assert len(data.train) + len(data.held_out) == 6


def test_a_held_out_label_outside_the_metadata_labelled_classes_names_their_file(tmp_path):
    """train/ and val/ each labelled by their own metadata.csv (no flag, no class folders): a
    val/ label the training file does not hold is refused naming the training split's
    metadata file, not --train-labels (which was never given) nor class folders."""
    root = tmp_path / "d"
    for i in range(4):
        _image(root / "train" / f"t{i}.png", 10 * i)
        _image(root / "val" / f"v{i}.png", 10 * i + 5)
    _write_metadata(root / "train" / "metadata.csv",
                    [{"file_name": f"t{i}.png", "label": ["cat", "dog"][i % 2]} for i in range(4)])
    _write_metadata(root / "val" / "metadata.csv",
                    [{"file_name": f"v{i}.png", "label": ["cat", "dog", "cat", "bird"][i]}
                     for i in range(4)])
    with pytest.raises(UsageError) as refused:
        load_data(TrainConfig(data_dir=str(root), in_memory="never"))
    assert str(refused.value) == (
        f"{root}/val/metadata.csv line 5: 'bird' is not a class (the classes of "
        f"{root}/train/metadata.csv are cat, dog, ...); use its class names")


def test_the_training_labels_source_names_the_file_or_flag(tmp_path):
    """--train-labels by its flag, one metadata file by its path, several as the split's
    metadata files, whose classes a refusal then calls theirs; class folders: None."""
    from accel_train.data.folder_labels import training_labels_source
    from accel_train.data.label_files import read_val_labels
    one, two = tmp_path / "train" / "metadata.csv", tmp_path / "train" / "a" / "metadata.csv"
    assert training_labels_source(None) is None
    assert tuple(training_labels_source(([tmp_path / "t.csv"], "--train-labels"))) == (
        "--train-labels", "its class names")
    assert tuple(training_labels_source(([one], None))) == (str(one), "its class names")
    several = training_labels_source(([one, two], None))
    assert tuple(several) == ("the training split's metadata files", "their class names")
    (tmp_path / "val.csv").write_text("v.png,bird\n")
    with pytest.raises(UsageError) as refused:
        read_val_labels(tmp_path / "val.csv", tmp_path, ["v.png"], {"cat", "dog"}, several)
    assert str(refused.value).endswith(
        "'bird' is not a class (the classes of the training split's metadata files are cat, "
        "dog, ...); use their class names")


@pytest.mark.parametrize("labelled_by", ["metadata.csv", "--train-labels"])
def test_split_folders_inside_class_folders_under_one_label_file_are_refused(tmp_path,
                                                                            labelled_by):
    """cat/train/, cat/val/, dog/train/... with one file labelling every image (a metadata.csv
    at the root, or --train-labels): read as one training split (the folders' splits are read
    only where the folders label the images), its validation images would be trained on.
    datasets' imagefolder splits the folder by them and reads no metadata file above them."""
    root = tmp_path / "photos"
    rows = []
    for i, name in enumerate(["cat/train/0.png", "cat/val/1.png", "dog/train/2.png",
                              "dog/val/3.png"]):
        _image(root / name, 40 * i)
        rows.append({"file_name": name, "label": "indoor" if i < 2 else "outdoor"})
    file = root / "metadata.csv" if labelled_by == "metadata.csv" else tmp_path / "labels.csv"
    _write_metadata(file, rows)
    if labelled_by == "metadata.csv":
        assert set(_theirs(root)) == {"train", "validation"}
    train_labels = str(file) if labelled_by == "--train-labels" else None
    with pytest.raises(UsageError) as caught:
        index_folder(root, train_labels=train_labels, cache_dir=tmp_path / "cache")
    source = "metadata.csv" if labelled_by == "metadata.csv" else f"--train-labels {file}"
    labels = "a metadata file in each" if labelled_by == "metadata.csv" else \
        "labelled by --train-labels and --val-labels"
    assert str(caught.value) == (
        f"--data-dir {root}: its images sit in split folders inside other folders (cat/train/, "
        f"cat/val/, dog/train/, dog/val/) and {source} labels them all as one training split, "
        f"so its held-out images would be trained on; put each split's images in a split "
        f"folder at the top of {root} (train/, val/), {labels}")
