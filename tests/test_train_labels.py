"""Training images in one folder labelled by a file (--train-labels: Kaggle's train.csv beside
train/, a labelling tool's export): each image's class, the classes' order, the layouts it
combines with, the cached index, and each problem of the file or folder as one line.
Oracles: pandas' CSV reader (read_csv) for what the file says, the file trees generated here
for which image is which, and hand-written class orders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from accel_train.cli import main
from accel_train.config import TrainConfig
from accel_train.data.imagefolder import index_folder
from accel_train.data.label_files import LabelSource, read_train_labels, read_val_labels
from accel_train.data.sources import load_data
from conftest import PINNED, age_folders


def _image(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(path)


def _paths_and_classes(data) -> dict[str, str]:
    """{image path relative to --data-dir: class name} over the run's training and held-out
    images (decoded per step: their paths are the rows' own)."""
    found = {}
    for source in (data.train, data.held_out):
        paths = [value["path"] for value in source.column[:].column(0).to_pylist()]
        for path, label in zip(paths, source.labels.tolist()):
            found[path] = data.class_names[label]
    return found


# What each file form says, as pandas reads it; the images are named by id (no extension),
# by file name, or by a path under the folder, and the class names hold spaces and commas.
IDS = [f"img{i:02d}" for i in range(12)]
BREEDS = ["beagle", "golden, retriever", "pug"]
FORMS = {
    "kaggle ids": ("id,breed\n" + "".join(f"{name},{['a', 'b', 'c'][i % 3]}\n"
                                          for i, name in enumerate(IDS)), {"sep": ","}),
    "file names, quoted": ("file,label\n" + "".join(f'{name}.png,"{BREEDS[i % 3]}"\n'
                                                    for i, name in enumerate(IDS)), {"sep": ","}),
    "semicolons (Excel where the comma is the decimal mark)": (
        "id;label\r\n" + "".join(f'{name};"{BREEDS[i % 3].replace(",", "")}"\r\n'
                                   for i, name in enumerate(IDS)), {"sep": ";"}),
    "whitespace, no header": ("".join(f"{name}.png\t{i % 4}\n" for i, name in enumerate(IDS)),
                              {"sep": r"\s+", "header": None}),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_each_image_takes_the_class_its_line_gives(tmp_path, form):
    text, pandas_reads = FORMS[form]
    for i, name in enumerate(IDS):
        _image(tmp_path / "data" / f"{name}.png", i)
    labels = tmp_path / "train.csv"
    labels.write_text(text)
    table = pd.read_csv(labels, dtype=str, **pandas_reads)
    expected = {Path(str(image)).stem + ".png": str(label)
                for image, label in zip(table.iloc[:, 0], table.iloc[:, 1])}
    data = load_data(TrainConfig(data_dir=str(tmp_path / "data"), train_labels=str(labels),
                                 in_memory="never"))
    assert _paths_and_classes(data) == expected
    assert len(data.train) + len(data.held_out) == 12 and len(data.held_out) == 2  # 0.1 carved


def test_classes_that_are_whole_numbers_take_their_order_as_indices(tmp_path):
    """Labels 0..11 (a Kaggle file's classes): the indices are the numbers, not the string
    order 0, 1, 10, 11, 2, ... that class folders of those names would sort into."""
    lines = ["image_id,label"]
    for i in range(24):
        _image(tmp_path / "data" / f"{i}.png", i)
        lines.append(f"{i}.png,{i % 12}")
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    data = load_data(TrainConfig(data_dir=str(tmp_path / "data"),
                                 train_labels=str(tmp_path / "labels.csv"), in_memory="never"))
    assert data.class_names == [str(i) for i in range(12)]
    assert all(int(name.split(".")[0]) % 12 == int(data.class_names[label])
               for name, label in zip(_paths_and_classes(data), data.train.labels.tolist()))


def test_a_labelled_train_folder_beside_a_validation_folder_of_class_folders(tmp_path):
    """DIR/train/IMAGE labelled by the file, DIR/val/CLASS/IMAGE by its folders: one set of
    classes, and the validation split is the folder's (nothing carved)."""
    for i in range(6):
        _image(tmp_path / "d" / "train" / f"t{i}.png", i)
    for i, cls in enumerate(["cat", "dog"]):
        _image(tmp_path / "d" / "val" / cls / f"v{i}.png", 100 + i)
    (tmp_path / "labels.csv").write_text("".join(f"t{i},{['dog', 'cat'][i % 2]}\n"
                                                 for i in range(6)))
    data = load_data(TrainConfig(data_dir=str(tmp_path / "d"),
                                 train_labels=str(tmp_path / "labels.csv"), in_memory="never"))
    assert data.class_names == ["cat", "dog"] and data.held_out_carve is None
    assert _paths_and_classes(data) == {
        **{f"train/t{i}.png": ["dog", "cat"][i % 2] for i in range(6)},
        "val/cat/v0.png": "cat", "val/dog/v1.png": "dog"}


def test_an_edited_label_file_is_read_again_not_taken_from_the_cached_index(tmp_path):
    for i in range(4):
        _image(tmp_path / "d" / f"{i}.png", i)
    labels = tmp_path / "labels.csv"
    labels.write_text("0,a\n1,a\n2,b\n3,b\n")
    cache = tmp_path / "cache"
    index_folder(tmp_path / "d", cache_dir=cache, cache_min_files=0, train_labels=str(labels))
    age_folders(tmp_path / "d")
    index_folder(tmp_path / "d", cache_dir=cache, cache_min_files=0, train_labels=str(labels))
    cached = index_folder(tmp_path / "d", cache_dir=cache, cache_min_files=0,
                          train_labels=str(labels))
    assert cached.cached and cached.splits["train"][1].tolist() == [0, 0, 1, 1]
    labels.write_text("0,a\n1,b\n2,b\n3,c\n")
    edited = index_folder(tmp_path / "d", cache_dir=cache, cache_min_files=0,
                          train_labels=str(labels))
    assert not edited.cached and edited.class_names == ["a", "b", "c"]
    assert edited.splits["train"][1].tolist() == [0, 1, 1, 2]


IMAGES = ["a.png", "b.jpg", "sub/c.png"]


@pytest.mark.parametrize("text, message", [
    ("", "--train-labels {file} holds no labels"),
    ("id,label,fold\na,cat,0\nb,dog,1\nc,cat,2\n",
     "--train-labels {file} line 2 has 3 field(s); write IMAGE,CLASS on every line (a table of "
     "more columns, a fold number or one column per class, is not read: keep the image and "
     "class columns)"),
    ("image,cat,dog\na,1,0\nb,0,1\nc,1,0\n", "--train-labels {file} line 2 has 3 field(s)"),
    ("a cat\nb golden retriever\nc dog\n", "--train-labels {file} line 2 has 3 field(s)"),
    ("a,cat\nzz.png,dog\nc,cat\n", "--train-labels {file} line 2 names 'zz.png', which is not "
                                   "an image in {folder}; fix the line or add the image"),
    ("a,cat\nb,\nc,cat\n", "--train-labels {file} line 2 gives 'b' no class; write IMAGE,CLASS "
                           "on every line"),
    ("a,cat\nb,dog\nc,cat\na.png,dog\n", "--train-labels {file} line 4 labels a.png again "
                                         "(line 1 did); one line per image"),
    ("a,cat\nc,cat\n", "--train-labels {file} gives no label for 1 image(s) of {folder} (first: "
                       "b.jpg); label every image or remove the others"),
    ("cat\ndog\ncat\n", "--train-labels {file} line 2 has 1 field(s)"),
    ("a,cat\nb,NaN\nc,cat\n", "--train-labels {file} line 2 gives 'b' the class 'NaN', the mark "
                              "of a missing value (pandas and R write it for an empty cell); "
                              "give the image its class, or remove the line"),
    ("a,cat\nb,dog\nc,NA\n", "--train-labels {file} line 3 gives 'c' the class 'NA', the mark"),
    ("a,cat\nb,dog\nc,#N/A\n", "--train-labels {file} line 3 gives 'c' the class '#N/A'"),
])
def test_each_label_file_problem_is_one_sentence(tmp_path, text, message):
    file, folder = tmp_path / "labels.txt", tmp_path / "train"
    file.write_text(text)
    with pytest.raises(Exception) as caught:
        read_train_labels(file, folder, IMAGES)
    assert type(caught.value).__name__ == "UsageError"
    expected = message.format(file=file, folder=folder)
    assert str(caught.value).startswith(expected), (str(caught.value), expected)
    assert "\n" not in str(caught.value)


def test_whole_numbers_written_as_floats_are_the_class_numbers(tmp_path):
    """pandas writes a class column as 3.0 once it held a missing value: the classes are still
    0..11 in value order (not the text order 0.0, 1.0, 10.0, 11.0, 2.0), named as numbers,
    and a validation file's 3.0 names the class 3 too."""
    lines = ["image_id,label"]
    for i in range(24):
        _image(tmp_path / "data" / "train" / f"{i}.png", i)
        lines.append(f"{i}.png,{float(i % 12)}")
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    for i in range(12):
        _image(tmp_path / "data" / "val" / f"v{i}.png", 100 + i)
    (tmp_path / "val.csv").write_text("".join(f"v{i}.png,{i}.0\n" for i in range(12)))
    data = load_data(TrainConfig(data_dir=str(tmp_path / "data"),
                                 train_labels=str(tmp_path / "labels.csv"),
                                 val_labels=str(tmp_path / "val.csv"), in_memory="never"))
    assert data.class_names == [str(i) for i in range(12)]
    named = _paths_and_classes(data)
    assert all(named[f"train/{i}.png"] == str(i % 12) for i in range(24))
    assert all(named[f"val/v{i}.png"] == str(i) for i in range(12))
    one_a_line = tmp_path / "one_a_line.txt"  # the val file's other form: a class a line
    one_a_line.write_text("3.0\n4\n")
    assert read_val_labels(one_a_line, tmp_path, ["a.png", "b.png"], {"3", "4"},
                           classes_from=LabelSource("--train-labels")) == ["3", "4"]
    # a mix with a real fraction stays text: 2.5 is a name, not a number
    from accel_train.data.label_files import whole_numbers_as_written
    assert whole_numbers_as_written(["1.0", "2.5"]) == ["1.0", "2.5"]
    assert whole_numbers_as_written(["1.0", "-2.", "3", "10.00"]) == ["1", "-2", "3", "10"]
    assert whole_numbers_as_written([]) == []


def test_a_test_folder_beside_the_labelled_train_folder_names_the_way_out(tmp_path):
    """Kaggle's layout, train/ + test/ + train.csv, given whole: test/'s images have no labels;
    the line names --data-dir train/ and predicting test/."""
    for i in range(4):
        _image(tmp_path / "kag" / "train" / f"t{i}.png", i)
        _image(tmp_path / "kag" / "test" / f"s{i}.png", 50 + i)
    (tmp_path / "train.csv").write_text("".join(f"t{i},{'ab'[i % 2]}\n" for i in range(4)))
    root = tmp_path / "kag"
    with pytest.raises(Exception) as caught:
        load_data(TrainConfig(data_dir=str(root), train_labels=str(tmp_path / "train.csv"),
                              in_memory="never"))
    assert str(caught.value) == (
        f"{root}/test/s0.png is in test/, images without labels beside the labelled train/ (a "
        f"competition's test set?): pass --data-dir {root}/train to train, then predict "
        f"{root}/test (a labelled held-out folder needs --val-labels FILE)")
    data = load_data(TrainConfig(data_dir=str(root / "train"),
                                 train_labels=str(tmp_path / "train.csv"), in_memory="never"))
    assert data.class_names == ["a", "b"]


def test_a_name_two_images_share_names_both(tmp_path):
    """img000.jpg and img000.png: the id img000 is either; the line says so (not that there is
    no such image), and the names with extensions work."""
    images = ["img000.jpg", "img000.png", "x/b.png", "y/b.png"]
    file = tmp_path / "labels.csv"
    for key, both in (("img000", "img000.jpg and img000.png"), ("b.png", "x/b.png and y/b.png")):
        file.write_text(f"id,label\nimg000.jpg,cat\n{key},dog\n")
        with pytest.raises(Exception) as caught:
            read_train_labels(file, tmp_path, images)
        assert str(caught.value) == (f"--train-labels {file} line 3 names {key!r}, which "
                                     f"is {both} alike; name the file with its extension, or "
                                     f"its path inside {tmp_path}")
    file.write_text("img000.jpg,cat\nimg000.png,dog\nx/b.png,cat\ny/b.png,dog\n")
    assert read_train_labels(file, tmp_path, images) == ["cat", "dog", "cat", "dog"]


def test_a_file_saved_by_excel_with_a_byte_order_mark_and_no_header(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte-order mark: without a header line, the first
    image's name would carry it, name no image, and be taken for a header."""
    file = tmp_path / "labels.csv"
    file.write_bytes("a.png,cat\r\nb,dog\r\nsub/c.png,cat\r\n".encode("utf-8-sig"))
    assert read_train_labels(file, tmp_path, IMAGES) == \
        pd.read_csv(file, header=None, encoding="utf-8-sig", dtype=str)[1].tolist()


def test_a_header_line_and_quoted_fields_are_read_as_pandas_reads_them(tmp_path):
    file = tmp_path / "labels.csv"
    file.write_text('filename,class\n"a.png","a, b"\nb,"c"\nsub/c.png,d\n')
    assert read_train_labels(file, tmp_path, IMAGES) == \
        pd.read_csv(file, dtype=str)["class"].tolist() == ["a, b", "c", "d"]


def _run(tmp_path: Path, capsys, *args: str) -> tuple[int, list[str]]:
    out = tmp_path / "run"
    capsys.readouterr()
    code = main([*args, *PINNED, "--model", "test_resnet", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert not out.exists()
    return code, err


def test_hugging_faces_metadata_csv_passed_as_train_labels_is_read_by_its_column_names(
        tmp_path, capsys):
    """Hugging Face's imagefolder layout (train/ of images and a metadata.csv naming each
    one's file_name and label), passed with --train-labels: it labels each image as pandas
    reads the file, its columns found by name.  (Taken without the flag:
    test_imagefolder_metadata.py.)"""
    for i in range(8):
        _image(tmp_path / "hf" / "train" / f"{i}.png", i)
    metadata = tmp_path / "hf" / "train" / "metadata.csv"
    metadata.write_text("file_name,label\n" + "".join(f"{i}.png,{'cat' if i % 3 else 'dog'}\n"
                                                      for i in range(8)))
    data = load_data(TrainConfig(data_dir=str(tmp_path / "hf"), train_labels=str(metadata),
                                 in_memory="never"))
    expected = pd.read_csv(metadata, dtype=str)
    assert _paths_and_classes(data) == {f"train/{name}": label for name, label
                                        in zip(expected["file_name"], expected["label"])}
    # its other columns (a caption, a quoted one with a comma), label not second: read by name
    metadata.write_text("caption,label,file_name\n" + "".join(
        f'"a photo, number {i}",{"bird" if i % 2 else "fish"},{i}.png\n' for i in range(8)))
    data = load_data(TrainConfig(data_dir=str(tmp_path / "hf"), train_labels=str(metadata),
                                 in_memory="never"))
    expected = pd.read_csv(metadata, dtype=str)
    assert _paths_and_classes(data) == {f"train/{name}": label for name, label
                                        in zip(expected["file_name"], expected["label"])}
    metadata.write_text("file_name,label,caption\n0.png,cat\n")
    code, err = _run(tmp_path, capsys, "--data-dir", str(tmp_path / "hf"), "--train-labels",
                     str(metadata))
    assert code == 2 and err == [f"accel_train: error: --train-labels {metadata} line 2 has 2 "
                                 f"field(s) where its header names 3; give every line a value "
                                 f"for each column"]


def test_bad_input_through_the_command_line_is_one_line_and_writes_nothing(tmp_path, capsys):
    for i in range(4):
        _image(tmp_path / "flat" / f"{i}.png", i)
    code, err = _run(tmp_path, capsys, "--data-dir", str(tmp_path / "flat"))
    assert code == 2 and err == [
        f"accel_train: error: {tmp_path}/flat/0.png is not inside a class folder; put each "
        f"class's images in a subfolder named after the class (or name each image's class in a "
        f"file: --train-labels FILE)"]
    code, err = _run(tmp_path, capsys, "--data-dir", str(tmp_path / "flat"), "--train-labels",
                     str(tmp_path / "nope.csv"))
    assert code == 2 and err == [f"accel_train: error: --train-labels {tmp_path}/nope.csv: no "
                                 f"such file"]
    for i in range(2):
        _image(tmp_path / "no_train" / "val" / "cat" / f"{i}.png", i)
    code, err = _run(tmp_path, capsys, "--data-dir", str(tmp_path / "no_train"),
                     "--train-labels", str(tmp_path / "nope.csv"))
    assert code == 2 and err == [
        f"accel_train: error: --train-labels {tmp_path}/nope.csv: --data-dir "
        f"{tmp_path}/no_train has split folders (val/) and no train/ folder of images to "
        f"label; put the training images in {tmp_path}/no_train/train"]
    # without --data-dir the embedded set trained and the file went unread (--val-labels too)
    code, err = _run(tmp_path, capsys, "--train-labels", str(tmp_path / "nope.csv"))
    assert code == 2 and err == ["accel_train: error: --train-labels labels the training images "
                                 "of an image folder: pass --data-dir DIR too"]
    code, err = _run(tmp_path, capsys, "--val-labels", str(tmp_path / "nope.csv"))
    assert code == 2 and err == ["accel_train: error: --val-labels labels the held-out folder "
                                 "of an image folder: pass --data-dir DIR too"]
    code, err = _run(tmp_path, capsys, "--class-depth", "1")  # the embedded set trained too
    assert code == 2 and err == ["accel_train: error: --class-depth names the folder level of "
                                 "an image folder's classes: pass --data-dir DIR too"]


@pytest.mark.slow
def test_train_labels_alike_in_training_check_data_and_eval(tmp_path):
    """A Kaggle-style folder (train/ of 30 images named by id, train.csv): check-data counts the
    file's classes (pandas' value_counts the oracle), training carves and trains on them, eval
    of the run reads the recorded label file again (its held-out counts are the carve's), and
    eval of the folder as other data (--data-dir, --train-labels, --split
    all) counts every image under the file's class."""
    import json

    from conftest import accel_train_here
    labels = tmp_path / "train.csv"
    lines = ["id,label"]
    for i in range(30):
        _image(tmp_path / "kaggle" / "train" / f"{i:04x}.jpg", 8 * i)
        lines.append(f"{i:04x},{['0', '1', '2'][i % 3] if i < 27 else '10'}")
    labels.write_text("\n".join(lines) + "\n")
    counts = pd.read_csv(labels, dtype=str)["label"].value_counts().to_dict()
    assert counts == {"0": 9, "1": 9, "2": 9, "10": 3}  # the premise
    data = ["--data-dir", str(tmp_path / "kaggle" / "train"), "--train-labels", str(labels)]
    report = json.loads(accel_train_here("check-data", *data, "--workers", "1",
                                         "--json").stdout)
    assert report["classes"] == ["0", "1", "2", "10"]
    assert {name: sum(split[name] for split in report["class_counts"].values())
            for name in report["classes"]} == counts
    run = tmp_path / "run"
    trained = accel_train_here(*data, "--val-stratify", "--val-fraction", "0.2", *PINNED,
                               "--model", "test_resnet", "--batch-size", "8", "--max-steps",
                               "2", "--no-plots", "--progress", "log", "--output-dir",
                               str(run), check=True)
    assert "24 train / 6 validation images, 4 classes" in trained.stdout, trained.stdout
    evaluated = json.loads(accel_train_here("eval", str(run), "--json",
                                            check=True).stdout.strip().splitlines()[-1])
    # by hand: shares 1.8, 1.8, 1.8 and 0.6 of 6; one each, two of the ties a second
    held_out = {k: v["images"] for k, v in evaluated["per_class"].items()}
    assert held_out.pop("10") == 1 and sorted(held_out.values()) == [1, 2, 2], evaluated
    whole = json.loads(accel_train_here("eval", str(run), *data, "--split", "all", "--json",
                                        check=True).stdout.strip().splitlines()[-1])
    assert {k: v["images"] for k, v in whole["per_class"].items()} == counts


def test_classes_sort_by_value_only_where_every_name_is_a_whole_number():
    from accel_train.data.label_files import class_order
    assert class_order({"10", "2", "-1", "0"}, numbers_by_value=True) == ["-1", "0", "2", "10"]
    assert class_order({"10", "2", "x"}, numbers_by_value=True) == ["10", "2", "x"]
    assert class_order({"10", "2"}, numbers_by_value=False) == ["10", "2"]
    # not whole numbers as int() reads them: sorted as text, no error
    assert class_order({"--1", "2", "²"}, numbers_by_value=True) == ["--1", "2", "²"]


def test_bytes_that_are_not_utf8_and_an_unreadable_file(tmp_path, monkeypatch):
    """A file written on Windows (its header in cp1252) is read line by line, the bad byte
    replaced; a file that cannot be read is one line naming the flag."""
    file = tmp_path / "labels.csv"
    file.write_bytes("image,étiquette\na,cat\nb,dog\nsub/c.png,cat\n".encode("cp1252"))
    assert read_train_labels(file, tmp_path, IMAGES) == ["cat", "dog", "cat"]

    def refuse(self):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(Exception) as caught:
        read_train_labels(file, tmp_path, IMAGES)
    assert str(caught.value).startswith(f"--train-labels {file}: cannot be read (Permission "
                                        f"denied)"), str(caught.value)


def test_val_labels_beside_train_labels_name_the_files_classes(tmp_path):
    """DIR/train/IMAGE with --train-labels, DIR/val/IMAGE with --val-labels: the held-out
    labels must be the training file's classes, and a refusal says so (not "class folders")."""
    for i in range(4):
        _image(tmp_path / "d" / "train" / f"t{i}.png", i)
        _image(tmp_path / "d" / "val" / f"v{i}.png", 50 + i)
    (tmp_path / "train.csv").write_text("".join(f"t{i},{i % 2}\n" for i in range(4)))
    (tmp_path / "val.csv").write_text("v0,1\nv1,0\nv2,1\nv3,0\n")
    config = dict(data_dir=str(tmp_path / "d"), train_labels=str(tmp_path / "train.csv"),
                  val_labels=str(tmp_path / "val.csv"), in_memory="never")
    data = load_data(TrainConfig(**config))
    assert _paths_and_classes(data) == {**{f"train/t{i}.png": str(i % 2) for i in range(4)},
                                        **{f"val/v{i}.png": str((i + 1) % 2) for i in range(4)}}
    # a name, and a number the training file does not hold (not told that class numbers are
    # refused: the training file's classes are numbers themselves)
    for unknown in ("cat", "7"):
        (tmp_path / "val.csv").write_text(f"v0,1\nv1,0\nv2,{unknown}\nv3,0\n")
        with pytest.raises(Exception) as refused:
            load_data(TrainConfig(**config))
        assert str(refused.value) == (
            f"--val-labels {tmp_path}/val.csv line 3: {unknown!r} is not a class (the classes "
            f"of --train-labels are 0, 1, ...); use its class names")
