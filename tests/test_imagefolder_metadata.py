"""Hugging Face's imagefolder layout labelled by a metadata file: a metadata.csv or
metadata.jsonl at a split folder's root, naming each image's file_name and label (other columns
beside them), taken without a flag; the same files passed as --train-labels or --val-labels;
each problem of such a file as one line naming it and its line; the cached index.

Oracles: Hugging Face's own builder (`datasets.load_dataset("imagefolder")`) for each image's
label; pandas' readers (read_csv, read_json with lines=True) for what a label file passed with
a flag says; the folder trees and files written here for the rest."""

from __future__ import annotations

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
    """rows as Hugging Face's docs write them: JSON lines, or a CSV through pandas."""
    if file.suffix == ".jsonl":
        file.write_text("".join(json.dumps(row) + "\n" for row in rows))
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
    metadata file; labels as text with a space (CSV) or as numbers past 9 (JSON lines), a
    caption column beside them, file_name not the first column."""
    labels = ["golden retriever", "pug", "beagle"] if kind == "csv" else [0, 2, 10]
    for split, count in (("train", 12), ("test", 4)):
        rows = []
        for i in range(count):
            name = f"more/{i}.png" if split == "train" and i >= 9 else f"{i}.png"
            _image(root / split / name, 20 * i + (split == "test"))
            rows.append({"caption": f"a photo, number {i}", "label": labels[i % 3],
                         "file_name": name})
        _write_metadata(root / split / f"metadata.{kind}", rows)


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
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
    assert report["labels_from"] == {"train": f"train/metadata.{kind}",
                                     "test": f"test/metadata.{kind}"}
    assert report["files_not_read"] == {}  # the metadata files are read
    for split in ("train", "test"):
        assert {name: n for name, n in report["class_counts"][split].items() if n} == \
            dict(Counter(theirs[split].values()))


def test_class_folders_and_a_metadata_label_column_take_the_metadata_as_datasets_does(
        tmp_path):
    """datasets' imagefolder adds no folder labels where it finds a metadata file: the
    file's label column labels each image, whatever class folder holds it."""
    root = tmp_path / "hf"
    rows = []
    for i in range(8):
        name = f"{['cat', 'dog'][i % 2]}/{i}.png"
        _image(root / name, 30 * i)
        rows.append({"file_name": name, "label": "indoor" if i < 5 else "outdoor"})
    _write_metadata(root / "metadata.jsonl", rows)
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


def test_metadata_files_of_both_kinds_in_one_folder_are_refused(tmp_path):
    folder = tmp_path / "hf"
    for i in range(4):
        _image(folder / f"{i}.png", 50 * i)
    rows = [{"file_name": f"{i}.png", "label": i % 2} for i in range(4)]
    _write_metadata(folder / "metadata.csv", rows)
    _write_metadata(folder / "metadata.jsonl", rows)
    ran = accel_train_here("--data-dir", str(folder), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    assert ran.returncode == 2 and ran.stderr.strip().splitlines() == [
        f"accel_train: error: {folder} holds both metadata.csv and metadata.jsonl; keep one "
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


def test_an_edited_metadata_file_is_read_again_not_taken_from_the_cached_index(tmp_path):
    """Rewriting a file in place changes no folder's mtime: the cached index checks the
    metadata file's own."""
    root, cache = tmp_path / "hf", tmp_path / "cache"
    for i in range(4):
        _image(root / f"{i}.png", 40 * i)
    metadata = root / "metadata.csv"
    metadata.write_text("file_name,label\n0.png,a\n1.png,a\n2.png,b\n3.png,b\n")
    old = time.time() - 3600
    os.utime(metadata, (old, old))
    age_folders(root, then=old)
    index_folder(root, cache_dir=cache, cache_min_files=0)
    cached = index_folder(root, cache_dir=cache, cache_min_files=0)
    assert cached.cached and cached.splits["train"][1].tolist() == [0, 0, 1, 1]
    assert cached.metadata_labels == {"train": "metadata.csv"}
    metadata.write_text("file_name,label\n0.png,a\n1.png,b\n2.png,b\n3.png,c\n")
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


def test_metadata_parquet_is_one_line_saying_how_to_write_it_as_csv(tmp_path):
    """datasets' imagefolder also reads a metadata.parquet; taken here for a folder of parquet
    data files, it failed naming columns the user never chose.  Now one line names the file and
    the pandas call that writes it as metadata.csv; done as it says, the labels are those
    datasets reads from the parquet file."""
    root = tmp_path / "hf"
    rows = []
    for i in range(8):
        _image(root / "train" / f"{i}.png", 30 * i)
        rows.append({"file_name": f"{i}.png", "label": ["tabby", "siamese"][i % 2]})
    parquet = root / "train" / "metadata.parquet"
    pd.DataFrame(rows).to_parquet(parquet)
    theirs = _theirs(root)
    ran = accel_train_here("--data-dir", str(root), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    csv = root / "train" / "metadata.csv"
    assert ran.returncode == 2 and ran.stderr.strip().splitlines() == [
        f"accel_train: error: {parquet} is Hugging Face's imagefolder metadata as parquet, "
        f"which is not read here; write it as {csv} (pandas: pd.read_parquet('{parquet}')"
        f".to_csv('{csv}', index=False)) and move the parquet file out"], ran.stderr
    assert not (tmp_path / "run").exists()
    pd.read_parquet(parquet).to_csv(csv, index=False)  # as the line says
    parquet.rename(tmp_path / "metadata.parquet")
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never", val_fraction=0.25))
    assert _ours(data) == theirs["train"]
