"""The image-folder index (accel_train/data/imagefolder.py) called directly on small trees: which
files are rows, in which split and class, what a label file says, when the cache is used, and each
refusal's sentence.  Milliseconds a test, so that mutation testing can run them per mutant
(tests/test_layouts.py checks the same index against Hugging Face's imagefolder builder, which takes
seconds a call).

Oracles: the expected rows, classes and labels are written out by hand for each tree.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from accel_train.data import imagefolder
from accel_train.base.errors import UsageError
from accel_train.data.imagefolder import index_folder
from accel_train.data.label_files import read_val_labels
from conftest import age_folders

NEVER_CACHED = 10**9


def _tree(root: Path, files: list[str]) -> Path:
    """Files under root: images are tiny PNGs whatever their extension says (the index reads
    names, not pixels); a name ending in "/" is an empty folder."""
    for name in files:
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix.lower() in (".txt", ".db", ".md"):
            path.write_text("not an image")
        else:
            Image.fromarray(np.zeros((2, 2, 3), np.uint8)).save(path, format="PNG")
    return root


def _index(root: Path, **kwargs) -> imagefolder.FolderIndex:
    kwargs.setdefault("cache_dir", root.parent / "cache")
    kwargs.setdefault("cache_min_files", NEVER_CACHED)
    return index_folder(root, **kwargs)


def _rows(index) -> dict[str, list[tuple[str, str]]]:
    assert all(len(paths) == len(labels) for paths, labels in index.splits.values())
    return {split: [(path, index.class_names[label])
                    for path, label in zip(paths.to_pylist(), labels.tolist())]
            for split, (paths, labels) in index.splits.items()}


# -- which files are rows -----------------------------------------------------------------------
def test_class_folders_hidden_and_system_entries_and_extensions(tmp_path):
    root = _tree(tmp_path / "d", [
        "cat/b.png", "cat/a.JPG", "cat/10.png", "cat/2.png", "cat/.hidden.png", "cat/notes.txt",
        "cat/__init__.png", "dog/x.webp", "dog/sub/deep.png", ".git/objects/1.png",
        "__MACOSX/cat/y.png", "Dog/z.png"])
    index = _index(root)
    assert index.class_names == ["Dog", "cat", "dog", "sub"]
    # sorted as strings (Hugging Face's imagefolder order); a file named __*.png is an image,
    # only folders named __* are skipped; the class is the folder holding the image
    assert _rows(index) == {"train": [
        ("Dog/z.png", "Dog"), ("cat/10.png", "cat"), ("cat/2.png", "cat"),
        ("cat/__init__.png", "cat"), ("cat/a.JPG", "cat"), ("cat/b.png", "cat"),
        ("dog/sub/deep.png", "sub"), ("dog/x.webp", "dog")]}
    assert len(index) == 8 and not index.cached
    labels = index.splits["train"][1]
    assert labels.dtype == np.int64


def test_the_folders_nas_and_disks_add_beside_photos_are_left_out(tmp_path):
    """A Synology NAS keeps thumbnails of each photo in @eaDir/PHOTO/ (read as a class per
    photo: "1.jpg"), deleted files in #recycle and copies in #snapshot; Windows and ext4 add
    $RECYCLE.BIN, System Volume Information and an empty lost+found at a disk's root.  None is
    the user's data: training on them taught thumbnails under bogus classes, without a word."""
    root = _tree(tmp_path / "d", [
        "cat/1.jpg", "cat/@eaDir/1.jpg/SYNOPHOTO_THUMB_M.jpg", "dog/2.jpg",
        "dog/@eaDir/2.jpg/SYNOPHOTO_THUMB_XL.jpg", "#recycle/cat/old.jpg",
        "#snapshot/GMT+00_2024/cat/1.jpg", "$RECYCLE.BIN/S-1-5-21/$R1.jpg",
        "System Volume Information/x.jpg", "lost+found/"])
    index = _index(root)
    assert _rows(index) == {"train": [("cat/1.jpg", "cat"), ("dog/2.jpg", "dog")]}
    assert [path.name for path in imagefolder.images_under(root)] == ["1.jpg", "2.jpg"]


def test_every_folder_walked_is_recorded_with_its_mtime(tmp_path):
    root = _tree(tmp_path / "d", ["cat/1.png", "dog/sub/2.png", ".hidden/3.png",
                                  "__MACOSX/4.png"])
    age_folders(root, 100)
    os.utime(root / "dog" / "sub", (1_000_000, 1_000_000))
    walked = _index(root).dirs
    assert sorted(rel for rel, _ in walked) == ["", "cat/", "dog/", "dog/sub/"]  # each once
    dirs = dict(walked)
    assert dirs["dog/sub/"] == 1_000_000 * 10**9
    assert dirs[""] == os.stat(root).st_mtime_ns


def test_split_folders_by_any_of_their_names_in_any_case(tmp_path):
    root = _tree(tmp_path / "d", ["Train/cat/1.png", "Train/dog/2.png", "VAL/cat/3.png",
                                  "testing/bird/4.png", ".cache/x/5.png", "README.md"])
    index = _index(root)
    assert index.class_names == ["bird", "cat", "dog"]
    assert _rows(index) == {"train": [("Train/cat/1.png", "cat"), ("Train/dog/2.png", "dog")],
                            "validation": [("VAL/cat/3.png", "cat")],
                            "test": [("testing/bird/4.png", "bird")]}
    # the root itself is recorded too: a new split folder changes its mtime
    assert [rel for rel, _ in index.dirs][0] == ""
    assert {rel for rel, _ in index.dirs} == {"", "Train/", "Train/cat/", "Train/dog/", "VAL/",
                                              "VAL/cat/", "testing/", "testing/bird/"}


@pytest.mark.parametrize("names, split", [(["val", "dev"], "validation"),
                                          (["test", "Eval"], "test"),
                                          (["training", "train"], "train")])
def test_two_folders_for_one_split_are_refused_naming_both(tmp_path, names, split):
    root = _tree(tmp_path / "d", [f"{name}/c/1.png" for name in names])
    first, second = sorted(names)
    with pytest.raises(UsageError) as caught:
        _index(root)
    assert str(caught.value) == (f"--data-dir {root} has two folders for the {split} split "
                                 f"({first}/ and {second}/); keep one")


@pytest.mark.parametrize("name, split", [
    ("my-train", "train"), ("train2017", "train"), ("ILSVRC2012_img_val", "validation"),
    ("training set", "train"), ("Validation.v2", "validation"), ("dev_01", "validation"),
    ("eval", "test"), ("2024-TESTING", "test"),
    ("trainee", None), ("devices", None), ("retrain", None), ("contest", None),
    ("train_val", None),          # two splits in one name
    ("train-training", "train"),  # two names of one split
])
def test_a_split_in_a_folders_name_is_a_whole_word_between_separators(name, split):
    """datasets' rule (data_files.py: a keyword between "-._ 0-9" or the name's ends)."""
    assert imagefolder.split_in_name(name) == split


def test_an_exact_split_folder_name_names_its_split_in_any_case():
    for name, split in imagefolder.SPLIT_FOLDERS.items():
        assert imagefolder.split_in_name(name) == imagefolder.split_in_name(name.upper()) == split


def test_folders_that_all_name_splits_in_their_names_are_the_splits(tmp_path):
    root = _tree(tmp_path / "d", ["train2017/cat/1.png", "train2017/dog/2.png",
                                  "val2017/cat/3.png", "test2017/dog/4.png"])
    assert _rows(_index(root)) == {"train": [("train2017/cat/1.png", "cat"),
                                             ("train2017/dog/2.png", "dog")],
                                   "test": [("test2017/dog/4.png", "dog")],
                                   "validation": [("val2017/cat/3.png", "cat")]}


@pytest.mark.parametrize("folders", [
    ["test_tube", "beaker"],        # a class whose name holds a split's: not all name one
    ["val2017", "test2017"],        # no training split
    ["train-a", "train-b"],         # one split twice
    ["train_val", "test"],          # a name with two splits ("test" alone: an exact name, below)
    ["train2017", "test-dev2017"],  # (COCO's test-dev: a test and a validation split)
    ["train2017"],                  # one folder: the root is the training split, as before
])
def test_folders_whose_names_do_not_all_name_one_split_each_are_class_folders(tmp_path,
                                                                               folders):
    if "test" in folders:  # an exact split name beside another folder: refused, as always
        root = _tree(tmp_path / "d", [f"{name}/c/1.png" for name in folders])
        with pytest.raises(UsageError, match="mixes split folders"):
            _index(root)
        return
    root = _tree(tmp_path / "d", [f"{name}/1.png" for name in folders])
    assert _rows(_index(root)) == {"train": [(f"{name}/1.png", name) for name in sorted(folders)]}


@pytest.mark.parametrize("wrapper, inner, classes", [
    ("cifar", ["train", "val"], ["cat/", "dog/"]),
    ("cifar", ["my-train", "my-test"], ["cat/", "dog/"]),
    ("cifar", ["Train", "VAL"], [""]),  # images in the split folders (labelled by a file)
    ("cifar/cifar/data", ["train", "val"], ["cat/"]),  # unpacked twice, and one level more
])
def test_split_folders_further_down_are_refused_naming_the_folder_to_pass(tmp_path, wrapper,
                                                                         inner, classes):
    """An archive unpacked into a folder of its own: read as one training split, its
    validation images were trained on without a word."""
    root = _tree(tmp_path / "d", [f"{wrapper}/{name}/{c}{i}.png" for name in inner
                                  for c in classes for i in range(2)])
    with pytest.raises(UsageError) as caught:
        _index(root)
    assert str(caught.value) == (
        f"--data-dir {root} holds one folder, {wrapper}/, whose folders are splits "
        f"({', '.join(name + '/' for name in sorted(inner))}): pass --data-dir "
        f"{root / wrapper} to train on its training split and hold out the others")
    if classes != [""]:
        assert set(_index(root / wrapper).splits) == {"train", "validation" if "val" in inner
                                                      else "test"}


@pytest.mark.parametrize("files", [
    ["animals/cat/1.png", "animals/dog/2.png"],        # one folder of class folders
    ["cifar/train/cat/1.png", "cifar/train/dog/2.png"],  # one split below: nothing held out
    ["cifar/train/c/1.png", "cifar/training/c/2.png"],  # one split twice: not splits
    ["a/train/c/1.png", "a/x/c/2.png", "b/val/c/3.png"],  # no folder holds only splits
])
def test_one_folder_down_without_split_folders_is_read_as_before(tmp_path, files):
    root = _tree(tmp_path / "d", files)
    assert list(_index(root).splits) == ["train"]


@pytest.mark.parametrize("files, depth, expected", [
    (["cat/train/1.png", "cat/train/2.png", "cat/val/3.png", "dog/train/4.png", "dog/val/5.png"],
     None, {"train": [("cat/train/1.png", "cat"), ("cat/train/2.png", "cat"),
                      ("dog/train/4.png", "dog")],
            "validation": [("cat/val/3.png", "cat"), ("dog/val/5.png", "dog")]}),
    # nested class folders, split names inside folder names, a test split in one class only
    (["animals/cat/train2017/1.png", "animals/dog/train2017/2.png", "animals/dog/val2017/3.png",
      "animals/cat/Test/4.png"],
     None, {"train": [("animals/cat/train2017/1.png", "cat"),
                      ("animals/dog/train2017/2.png", "dog")],
            "test": [("animals/cat/Test/4.png", "cat")],
            "validation": [("animals/dog/val2017/3.png", "dog")]}),
    # --class-depth 1: the class above breeds, the split folder left out of the count
    (["cat/siamese/train/1.png", "cat/tabby/train/2.png", "cat/tabby/val/3.png",
      "dog/pug/train/4.png"],
     1, {"train": [("cat/siamese/train/1.png", "cat"), ("cat/tabby/train/2.png", "cat"),
                   ("dog/pug/train/4.png", "dog")],
         "validation": [("cat/tabby/val/3.png", "cat")]}),
])
def test_split_folders_inside_class_folders_are_the_splits(tmp_path, files, depth, expected):
    """cat/train/, cat/val/, dog/train/...: read as class folders, the classes would be train
    and val (with --class-depth 1, cat and dog with every validation image trained on)."""
    root = _tree(tmp_path / "d", files)
    index = _index(root, class_depth=depth)
    assert _rows(index) == expected
    assert index.class_names == sorted({name for rows in expected.values() for _, name in rows})


@pytest.mark.parametrize("files", [
    ["cat/train/1.png", "dog/2.png"],                       # a class folder without splits
    ["cat/train/1.png", "cat/3.png", "dog/train/2.png"],    # an image beside the split folders
    ["cat/val/1.png", "dog/test/2.png"],                    # no training split
    ["cat/train/1.png", "cat/training/2.png", "dog/train/3.png"],  # one class's train twice
    ["cat/train_val/1.png", "dog/train_val/2.png"],         # a name with two splits
])
def test_class_folders_not_all_holding_split_folders_are_read_as_before(tmp_path, files):
    root = _tree(tmp_path / "d", files)
    assert _rows(_index(root)) == {"train": [(name, name.split("/")[-2]) for name in
                                             sorted(files)]}


@pytest.mark.parametrize("files, holding", [
    (["cifar/train/cat/1.png", "cifar/val/cat/2.png", "other/x/3.png"], ["cifar/"]),
    (["a/b/train/c/1.png", "a/b/val/c/2.png", "a/x/3.png"], ["a/b/"]),
    # two data sets unpacked side by side, and a folder of something else
    (["cifar10/train/cat/1.png", "cifar10/test/cat/2.png", "cifar100/Training/apple/3.png",
      "cifar100/Testing/apple/4.png", "extra/misc/5.png"], ["cifar10/", "cifar100/"]),
    # three such folders, all named; five: three named
    ([f"set{k}/{split}/c/{k}.png" for k in range(3) for split in ("train", "val")],
     [f"set{k}/" for k in range(3)]),
    ([f"set{k}/{split}/c/{k}.png" for k in range(5) for split in ("train", "val")],
     [f"set{k}/" for k in range(5)]),
])
def test_split_folders_of_class_folders_beside_other_folders_are_refused(tmp_path, files,
                                                                        holding):
    """Read as class folders, each split's images would join the same classes of the others:
    the held-out images trained on without a word."""
    root = _tree(tmp_path / "d", files)
    below = {parent: sorted({name[len(parent):].split("/")[0] for name in files
                             if name.startswith(parent)}) for parent in holding}
    named = ", ".join(f"{parent} ({', '.join(name + '/' for name in below[parent])})"
                      for parent in holding[:3]) + \
        (f" and {len(holding) - 3} more" if len(holding) > 3 else "")
    with pytest.raises(UsageError) as caught:
        _index(root)
    assert str(caught.value) == (
        f"--data-dir {root} holds split folders further down, beside other folders: {named}; "
        f"read as class folders, their held-out images would be trained on: pass --data-dir "
        f"{root / holding[0].rstrip('/')} to train on its training split and hold out the "
        f"others")


def test_split_folders_mixed_with_class_folders_are_refused(tmp_path):
    root = _tree(tmp_path / "d", ["train/c/1.png", "val/c/2.png", "zebra/3.png", "ant/4.png",
                                  "cow/5.png", "dog/6.png", "__MACOSX/7.png"])
    with pytest.raises(UsageError) as caught:
        _index(root)
    assert str(caught.value) == (
        f"--data-dir {root} mixes split folders (train/, val/) with other folders (ant/, cow/, "
        f"dog/); put every class folder under a split folder, or remove the split folders")


@pytest.mark.parametrize("depth, classes, of_rows", [
    (None, ["cat", "dog", "oak"], ["cat", "dog", "oak"]),
    (1, ["animals", "plants"], ["animals", "animals", "plants"]),
    (2, ["cat", "dog", "tree"], ["cat", "dog", "tree"])])
def test_class_depth_picks_the_folder_level(tmp_path, depth, classes, of_rows):
    root = _tree(tmp_path / "d", ["train/animals/cat/1.png", "train/animals/dog/2.png",
                                  "train/plants/tree/oak/3.png"])
    index = _index(root, class_depth=depth)
    assert index.class_names == classes
    assert [name for _, name in _rows(index)["train"]] == of_rows


def test_an_image_above_the_class_depth_is_refused(tmp_path):
    root = _tree(tmp_path / "d", ["animals/cat/1.png", "animals/2.png"])
    assert _index(root, class_depth=1).class_names == ["animals"]
    with pytest.raises(UsageError) as caught:
        _index(root, class_depth=2)
    assert str(caught.value) == (
        f"{root}/animals/2.png is less than 2 folder(s) deep in its split folder, so "
        f"--class-depth 2 gives it no class; lower --class-depth or move the image into a "
        f"class folder")


@pytest.mark.parametrize("held_out", [False, True])
def test_an_image_outside_any_class_folder_is_refused(tmp_path, held_out):
    files = ["train/cat/1.png", "val/2.png", "val/cat/3.png"] if held_out else \
        ["cat/1.png", "2.png"]
    root = _tree(tmp_path / "d", files)
    image = "val/2.png" if held_out else "2.png"
    hint = " (a held-out folder of unlabelled images needs --val-labels FILE)" if held_out \
        else " (or name each image's class in a file: --train-labels FILE)"
    with pytest.raises(UsageError) as caught:
        _index(root)
    assert str(caught.value) == (f"{root}/{image} is not inside a class folder; put each "
                                 f"class's images in a subfolder named after the class{hint}")


@pytest.mark.parametrize("flags", [[], ["--val-labels", "labels.csv"]])
def test_an_unlabelled_test_folder_beside_labelled_train_and_val_names_the_way_out(tmp_path,
                                                                                   flags):
    """train/ and val/ sorted into class folders, test/ of unsorted images (a competition's
    test set): the line said that a held-out folder of unlabelled images needs --val-labels,
    which labels val/, not test/, and given so the same line came back.  It names the way
    out: test/ out of the data, predicted after training; nothing is written."""
    from conftest import PINNED, accel_train_here
    root = _tree(tmp_path / "d", ["train/cat/1.png", "train/dog/2.png", "val/cat/3.png",
                                  "val/dog/4.png", "test/5.png", "test/6.png"])
    (tmp_path / "labels.csv").write_text("cat/3.png,cat\ndog/4.png,dog\n")
    given = [flag if flag.startswith("--") else str(tmp_path / flag) for flag in flags]
    result = accel_train_here("--data-dir", str(root), *given, "--model", "test_resnet",
                              *PINNED, "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"accel_train: error: {root}/test/5.png is in test/, images not sorted into class "
        f"folders beside the labelled train/ and val/ (a competition's test set?): move "
        f"test/ out of {root} to train on train/ and val/, then predict it (accel-train "
        f"predict RUN FOLDER), or sort its images into class folders"], result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("files", [[], ["cat/notes.txt", "dog/"], [".hidden/1.png"],
                                   ["__MACOSX/cat/1.png"]])
def test_no_images_at_all_is_refused(tmp_path, files):
    root = _tree(tmp_path / "d", files)
    root.mkdir(exist_ok=True)
    with pytest.raises(UsageError) as caught:
        _index(root)
    assert str(caught.value) == (
        f"--data-dir {root} holds no image files (looked for .jpg, .png, .webp, ... in it and "
        f"its subfolders); expected one subfolder of images per class, parquet files or a "
        f"save_to_disk folder")


@pytest.mark.parametrize("files, empty", [
    (["cat/1.png", "dog/"], "dog"),
    (["cat/1.png", "dog/notes.txt"], "dog"),              # files, but no image
    (["train/cat/1.png", "val/cat/2.png", "val/dog/"], "val/dog"),
    (["cat/1.png", "dog/a/", "dog/b/"], "dog/a"),          # the first in name order
])
def test_an_empty_class_folder_is_refused(tmp_path, files, empty):
    root = _tree(tmp_path / "d", files)
    with pytest.raises(UsageError) as caught:
        _index(root)
    assert str(caught.value) == (f"class folder {root / empty} holds no images; add images to it "
                                 f"or remove it")


def test_a_folder_holding_only_subfolders_is_no_empty_class(tmp_path):
    root = _tree(tmp_path / "d", ["cat/siamese/1.png", "dog/2.png"])
    assert _index(root).class_names == ["dog", "siamese"]


def test_with_class_depth_an_empty_leaf_of_a_class_with_images_is_allowed(tmp_path):
    root = _tree(tmp_path / "d", ["animals/cat/1.png", "animals/empty/", "plants/tree/2.png"])
    assert _index(root, class_depth=1).class_names == ["animals", "plants"]
    _tree(root, ["rocks/empty/"])  # a class with no image anywhere
    with pytest.raises(UsageError, match=f"class folder {root}/rocks/empty holds no images"):
        _index(root, class_depth=1)
    # an empty folder above the class level has no class at all: nothing to complain about
    _tree(root, ["rocks/empty/x.png"])
    (root / "shallow").mkdir()
    with pytest.raises(UsageError, match=f"class folder {root}/shallow holds no images"):
        _index(root, class_depth=1)
    (root / "shallow").rmdir()
    assert _index(root, class_depth=2).class_names == ["cat", "empty", "tree"]
    _tree(root, ["animals/bare/"])  # the class of depth 2 that has no image
    with pytest.raises(UsageError, match=f"class folder {root}/animals/bare holds no images"):
        _index(root, class_depth=2)


def test_fingerprint_names_the_split_and_changes_with_a_folder(tmp_path):
    root = _tree(tmp_path / "d", ["train/cat/1.png", "val/cat/2.png"])
    index = _index(root)
    same = _index(root)
    assert index.fingerprint("train") == same.fingerprint("train")
    assert len(index.fingerprint("train")) == 32
    assert index.fingerprint("train") != index.fingerprint("validation")
    os.utime(root / "val" / "cat", (1, 1))
    assert _index(root).fingerprint("train") != index.fingerprint("train")
    twin = _tree(tmp_path / "twin", ["train/cat/1.png", "val/cat/2.png"])
    for folder in (root, twin):  # the same names and mtimes
        age_folders(folder, then=1_000_000)
    assert _index(twin).fingerprint("train") != _index(root).fingerprint("train")


def test_indexing_a_large_folder_says_so_in_one_progress_line_of_ours(tmp_path, monkeypatch):
    _tree(tmp_path, [f"c{c}/{i}.png" for c in range(2) for i in range(3)])
    monkeypatch.setattr(imagefolder, "PROGRESS_AFTER", 0.0)  # "large": indexing takes long
    said: list[str] = []
    index_folder(tmp_path, cache_dir=tmp_path / "cache", say=said.append)
    assert len(said) == 2, said  # at most one line per 10 s; pytest's stderr is no terminal
    assert said[0] == f"indexing {tmp_path}: 0 images so far"
    assert re.fullmatch(rf"indexed {tmp_path}: 6 images of 2 classes in \d+\.\ds", said[1])


class _Clock:
    """time.monotonic moving `step` seconds a call (floats that add up exactly)."""

    def __init__(self, step: float):
        self.now, self.step = 1000.0, step

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


class _Stderr:
    def __init__(self, terminal: bool):
        self.terminal, self.written = terminal, []

    def isatty(self) -> bool:
        return self.terminal

    def write(self, text: str) -> None:
        self.written.append(text)

    def flush(self) -> None:
        pass


def _walk_with_clock(tmp_path, monkeypatch, step: float, terminal: bool, folders: int):
    """The index of `folders` class folders of one image each, the clock moving `step` seconds
    at each of its readings (one at the start, one after each folder walked, the root first,
    one at the end)."""
    root = _tree(tmp_path / "d", [f"c{i:02d}/1.png" for i in range(folders)])
    monkeypatch.setattr(imagefolder, "time", _Clock(step))
    stderr = _Stderr(terminal)
    monkeypatch.setattr(imagefolder.sys, "stderr", stderr)
    said: list[str] = []
    index_folder(root, cache_dir=tmp_path / "cache", cache_min_files=NEVER_CACHED,
                 say=said.append)
    return root, stderr.written, said


def test_on_a_terminal_a_counter_at_most_every_fifth_of_a_second_after_the_first(tmp_path,
                                                                                monkeypatch):
    # readings 0.125 s apart: the walk's k-th reading is k/8 s after the start; nothing before
    # 1 s (k = 8: 7 folders walked), then a counter whenever 0.2 s have passed since the last
    root, written, said = _walk_with_clock(tmp_path, monkeypatch, 0.125, True, 15)
    assert written == [f"\rindexing {root}: {n} images" for n in (7, 9, 11, 13, 15)] + \
        ["\r\033[K"]
    assert said == [f"indexed {root}: 15 images of 15 classes in 2.1s"]  # 17 readings x 1/8


def test_off_a_terminal_a_line_at_first_then_every_ten_seconds(tmp_path, monkeypatch):
    # readings 2.5 s apart: a line at the first reading after 1 s, then after 10 s exactly
    root, written, said = _walk_with_clock(tmp_path, monkeypatch, 2.5, False, 10)
    assert written == []
    assert said == [f"indexing {root}: {n} images so far" for n in (0, 4, 8)] + \
        [f"indexed {root}: 10 images of 10 classes in 30.0s"]


def test_a_quick_walk_says_nothing(tmp_path, monkeypatch):
    _, written, said = _walk_with_clock(tmp_path, monkeypatch, 0.0625, True, 12)
    assert written == [] and said == []


# -- a label file for a folder of held-out images (ImageNet's validation layout) ------------------
CLASSES = {"cat", "dog", "n01", "zebra"}
IMAGES = ["a.png", "b.jpg", "c.png"]


def _labels(tmp_path: Path, text: str, images=IMAGES) -> list[str]:
    file = tmp_path / "labels.txt"
    file.write_text(text)
    return read_val_labels(file, tmp_path / "val", images, CLASSES)


@pytest.mark.parametrize("text", [
    "a.png,cat\nb.jpg,dog\nc.png,cat\n",                       # CSV, file names
    "ImageId,label\na,cat\nb,dog\nc,cat\n",                    # a header; names without extension
    "c.png cat\n\n# a comment\n  a.png\tcat\n   # indented\nb.jpg   dog\n",  # whitespace
    "ImageId,PredictionString\na,cat 1 2 3 4 dog 5 6 7 8\nb,dog 9 9 9 9\nc,cat\n",  # Kaggle's
    "cat\ndog\ncat\n",                                          # one class a line, name order
    " a.png , cat \nb.jpg,dog\nc.png,cat",                     # spaces around CSV fields
    '"a.png","cat"\n"b.jpg",dog\nc.png,"cat"\n',                # quoted as Excel quotes
    "a.png;cat\nb.jpg;dog\nc.png;cat\n",                      # Excel where , is a decimal
])
def test_label_files_in_each_form(tmp_path, text):
    assert _labels(tmp_path, text) == ["cat", "dog", "cat"]


def test_images_are_found_by_path_name_or_stem_unless_ambiguous(tmp_path):
    images = ["x/1.png", "y/1.png", "x/2.png", "y/3.jpg", "y/3.png"]
    text = "x/1.png,cat\ny/1.png,dog\n2,cat\n2.png,cat\ny/3.jpg,dog\ny/3.png,n01\n"
    assert _labels(tmp_path, text, images) == ["cat", "dog", "cat", "dog", "n01"]
    for ambiguous, both in (("1.png", "x/1.png and y/1.png"), ("3", "y/3.jpg and y/3.png")):
        with pytest.raises(UsageError, match=f"line 1 names '{ambiguous}', which is {both} "
                                             f"alike; name the file with its extension"):
            _labels(tmp_path, f"{ambiguous},cat\n", images)


def test_a_first_line_naming_a_class_is_a_label_not_a_header(tmp_path):
    # "cat" is a class: the first line is data and names no image of the folder
    with pytest.raises(UsageError, match="line 1 names 'x', which is not an image"):
        _labels(tmp_path, "x,cat\na,cat\nb,dog\nc,cat\n")
    # only the first line may be a header
    with pytest.raises(UsageError, match="line 2 names 'Name', which is not an image"):
        _labels(tmp_path, "a,cat\nName,Label\nb,dog\nc,cat\n")


@pytest.mark.parametrize("text, message", [
    ("", "--val-labels {file} holds no labels"),
    ("# only\n\n", "--val-labels {file} holds no labels"),
    ("cat\ndog\n", "--val-labels {file} has 2 one-field lines for the 3 images of {folder}; one "
                   "class per image, in file-name order"),
    ("cat\ndog\nbird\n", "--val-labels {file} line 3: 'bird' is not a class (the class folders "
                         "of train/ are cat, dog, n01, ...); use the class folder names"),
    ("a,cat\nb,7\nc,cat\n", "--val-labels {file} line 2: '7' is not a class (the class folders "
                            "of train/ are cat, dog, n01, ...) (class numbers are not accepted: "
                            "they mean different things in different files); use the class "
                            "folder names"),
    ("a,cat\nb,\nc,cat\n", "--val-labels {file} line 2: '' is not a class"),
    ("a,cat\nzz.png,dog\nc,cat\n", "--val-labels {file} line 2 names 'zz.png', which is not an "
                                   "image in {folder}; fix the line or add the image"),
    ("a,cat\nc,cat\n", "--val-labels {file} gives no label for 1 image(s) of {folder} (first: "
                       "b.jpg); label every image or remove the others"),
    ("a,cat\nb.jpg\nc,cat\n", "--val-labels {file} line 2 gives 'b.jpg' and no class; write "
                             "IMAGE,CLASS on every line (or one CLASS a line, nothing else)"),
])
def test_each_label_file_problem_is_one_sentence(tmp_path, text, message):
    file, folder = tmp_path / "labels.txt", tmp_path / "val"
    with pytest.raises(UsageError) as caught:
        _labels(tmp_path, text)
    expected = message.format(file=file, folder=folder)
    assert str(caught.value).startswith(expected), (str(caught.value), expected)


def test_a_one_field_first_line_is_a_header_and_bytes_that_are_not_utf8_are_kept(tmp_path):
    # (a label file written on Windows: its comment in cp1252)
    file = tmp_path / "labels.txt"
    file.write_bytes("labels\n# caf\xe9\na,cat\nb,dog\nc,cat\n".encode("cp1252"))
    assert read_val_labels(file, tmp_path, IMAGES, CLASSES) == ["cat", "dog", "cat"]


def test_a_label_file_that_cannot_be_read_names_the_flag(tmp_path, monkeypatch):
    file = tmp_path / "labels.txt"
    file.write_text("a,cat\n")

    def refuse(self):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(UsageError) as caught:
        read_val_labels(file, tmp_path, IMAGES, CLASSES)
    assert str(caught.value).startswith(f"--val-labels {file}: cannot be read (Permission "
                                        f"denied)"), str(caught.value)


def test_a_missing_label_file(tmp_path):
    with pytest.raises(UsageError) as caught:
        read_val_labels(tmp_path / "nope.csv", tmp_path, IMAGES, CLASSES)
    assert str(caught.value) == f"--val-labels {tmp_path / 'nope.csv'}: no such file"


def test_a_labelled_held_out_folder_through_the_index(tmp_path):
    root = _tree(tmp_path / "d", ["train/cat/1.png", "train/dog/2.png", "val/b.png",
                                  "val/a.png", "test/dog/c.png"])
    labels = tmp_path / "labels.csv"
    labels.write_text("a.png,dog\nb.png,cat\n")
    index = _index(root, val_labels=str(labels))
    # the labelled split is validation (before test), whose images sit directly in its folder;
    # test keeps its class folders
    assert _rows(index) == {"test": [("test/dog/c.png", "dog")],
                            "train": [("train/cat/1.png", "cat"), ("train/dog/2.png", "dog")],
                            "validation": [("val/a.png", "dog"), ("val/b.png", "cat")]}
    (root / "test" / "dog" / "c.png").rename(root / "test" / "c.png")
    with pytest.raises(UsageError, match="test/c.png is in test/, images not sorted into "
                                         "class folders beside "):
        _index(root, val_labels=str(labels))  # only the labelled split may do without


def test_a_label_file_labels_test_when_there_is_no_validation_folder(tmp_path):
    root = _tree(tmp_path / "d", ["test/b.png", "test/a.png", "train/cat/1.png",
                                  "train/dog/2.png"])
    labels = tmp_path / "labels.csv"
    labels.write_text("a.png,dog\nb.png,cat\n")
    index = _index(root, val_labels=str(labels))
    assert _rows(index) == {"test": [("test/a.png", "dog"), ("test/b.png", "cat")],
                            "train": [("train/cat/1.png", "cat"), ("train/dog/2.png", "dog")]}
    labels.write_text("a.png,dog\nb.png,cat\nzz.png,cat\n")
    with pytest.raises(UsageError) as caught:
        _index(root, val_labels=str(labels))
    assert str(caught.value) == (f"--val-labels {labels} line 3 names 'zz.png', which is not an "
                                 f"image in {root}/test; fix the line or add the image")


def test_a_label_file_does_not_excuse_an_empty_training_class_folder(tmp_path):
    root = _tree(tmp_path / "d", ["train/cat/1.png", "train/dog/", "val/a.png"])
    labels = tmp_path / "labels.csv"
    labels.write_text("a.png,cat\n")
    with pytest.raises(UsageError, match=f"class folder {root}/train/dog holds no images"):
        _index(root, val_labels=str(labels))


def test_a_labelled_layout_with_an_empty_held_out_subfolder_is_fine(tmp_path):
    root = _tree(tmp_path / "d", ["train/cat/1.png", "val/a.png", "val/empty/"])
    labels = tmp_path / "labels.csv"
    labels.write_text("a.png,cat\n")
    assert _rows(_index(root, val_labels=str(labels)))["validation"] == [("val/a.png", "cat")]


@pytest.mark.parametrize("files", [["cat/1.png"], ["train/cat/1.png"], ["val/1.png"]])
def test_a_label_file_needs_train_beside_a_held_out_folder(tmp_path, files):
    root = _tree(tmp_path / "d", files)
    labels = tmp_path / "labels.csv"
    labels.write_text("1.png,cat\n")
    with pytest.raises(UsageError) as caught:
        _index(root, val_labels=str(labels))
    assert str(caught.value) == (
        f"--val-labels {labels}: --data-dir {root} has no train/ folder beside a val/ (or "
        f"validation/, test/) folder of images to label; expected DIR/train/CLASS/IMAGE and "
        f"DIR/val/IMAGE")


# -- the cache ------------------------------------------------------------------------------------
def _cached_index(tmp_path: Path, **kwargs):
    kwargs.setdefault("cache_min_files", 0)
    kwargs.setdefault("cache_dir", tmp_path / "cache")
    return index_folder(tmp_path / "d", **kwargs)


def test_a_cached_index_has_the_rows_of_a_walked_one(tmp_path):
    root = _tree(tmp_path / "d", ["train/cat/1.png", "train/dog/2.png", "train/dog/3.png",
                                  "val/dog/4.png", "test/cat/5.png"])
    age_folders(root)
    walked = _cached_index(tmp_path)
    assert not walked.cached and len(list((tmp_path / "cache").glob("*.arrow"))) == 1
    cached = _cached_index(tmp_path)
    assert cached.cached and cached.root == root
    assert _rows(cached) == _rows(walked) and cached.dirs == walked.dirs
    assert cached.class_names == walked.class_names and len(cached) == 5
    assert list(cached.splits) == list(walked.splits) == ["test", "train", "validation"]


def test_small_folders_and_fresh_folders_are_not_cached(tmp_path):
    root = _tree(tmp_path / "d", ["cat/1.png", "cat/2.png"])
    age_folders(root)
    assert not _cached_index(tmp_path, cache_min_files=3).cached
    assert not (tmp_path / "cache").exists()
    _cached_index(tmp_path, cache_min_files=2)
    assert _cached_index(tmp_path, cache_min_files=2).cached
    # a folder changed a second ago may change again within its mtime's tick
    fresh = _tree(tmp_path / "f", ["cat/1.png"])
    age_folders(fresh, imagefolder.RACY_SECONDS + 60)
    os.utime(fresh / "cat", (time.time() - 1, time.time() - 1))
    index_folder(fresh, cache_dir=tmp_path / "c2", cache_min_files=0)
    assert not (tmp_path / "c2").exists() or not list((tmp_path / "c2").glob("*.arrow"))
    age_folders(fresh, imagefolder.RACY_SECONDS + 1)
    index_folder(fresh, cache_dir=tmp_path / "c2", cache_min_files=0)
    assert index_folder(fresh, cache_dir=tmp_path / "c2", cache_min_files=0).cached


def test_the_cache_is_keyed_by_layout_options_and_the_label_file(tmp_path):
    root = _tree(tmp_path / "d", ["train/a/x/1.png", "val/a/x/2.png"])
    age_folders(root)
    for _ in range(2):
        by_depth = [_cached_index(tmp_path, class_depth=depth) for depth in (None, 1)]
    assert all(index.cached for index in by_depth)
    assert [index.class_names for index in by_depth] == [["x"], ["a"]]
    (root / "val" / "a" / "x" / "2.png").rename(root / "val" / "2.png")
    labels = tmp_path / "labels.csv"
    labels.write_text("2.png,x\n")
    age_folders(root)
    with_labels = [_cached_index(tmp_path, val_labels=str(labels)) for _ in range(2)]
    assert _rows(with_labels[1])["validation"] == [("val/2.png", "x")]
    assert with_labels[1].cached
    labels.write_text("2.png,x\n# changed\n")  # another size: another key
    assert not _cached_index(tmp_path, val_labels=str(labels)).cached
    assert _cached_index(tmp_path, val_labels=str(labels)).cached
    # another file of the same size and mtime: another key all the same
    other = tmp_path / "other.csv"
    other.write_text("2.png,x\n# chang3d\n")
    stat = labels.stat()
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert not _cached_index(tmp_path, val_labels=str(other)).cached


def test_a_folder_of_the_same_shape_elsewhere_is_not_served_another_folders_cache(tmp_path):
    first = _tree(tmp_path / "first", ["cat/1.png"])
    second = _tree(tmp_path / "second", ["cat/2.png"])
    for folder in (first, second):  # the same folders and mtimes
        age_folders(folder, then=1_000_000)
    for root in (first, first, second):
        index = index_folder(root, cache_dir=tmp_path / "cache", cache_min_files=0)
    assert not index.cached and _rows(index) == {"train": [("cat/2.png", "cat")]}


def test_a_folder_gone_or_changed_or_a_damaged_cache_means_a_new_walk(tmp_path):
    root = _tree(tmp_path / "d", ["cat/1.png", "dog/sub/2.png"])
    age_folders(root)
    _cached_index(tmp_path)
    assert _cached_index(tmp_path).cached
    os.utime(root / "dog" / "sub", (1, 1))
    assert not _cached_index(tmp_path).cached          # a folder's mtime changed
    assert _cached_index(tmp_path).cached              # and the new walk was cached
    (root / "dog" / "sub" / "2.png").unlink()
    (root / "dog" / "sub").rmdir()
    _tree(root, ["dog/3.png"])
    age_folders(root)
    index = _cached_index(tmp_path)                    # a folder is gone
    assert not index.cached and _rows(index)["train"] == [("cat/1.png", "cat"),
                                                          ("dog/3.png", "dog")]
    cache_file = next((tmp_path / "cache").glob("*.arrow"))
    cache_file.write_bytes(cache_file.read_bytes()[:100])
    assert not _cached_index(tmp_path).cached          # damaged: walked again, rewritten
    assert _cached_index(tmp_path).cached


def test_the_cache_folder_is_made_with_its_parents(tmp_path, monkeypatch):
    root = _tree(tmp_path / "d", ["cat/1.png"])
    age_folders(root)
    nested = tmp_path / "home" / "cache" / "accel_train" / "folder-index"
    monkeypatch.setenv(imagefolder.CACHE_ENV, str(nested))
    index_folder(root, cache_min_files=0)  # the default folder, not there yet
    assert len(list(nested.glob("*.arrow"))) == 1
    assert index_folder(root, cache_min_files=0).cached


def test_a_cache_whose_record_has_another_shape_is_rebuilt(tmp_path):
    import json

    import pyarrow as pa
    root = _tree(tmp_path / "d", ["cat/1.png"])
    age_folders(root)
    _cached_index(tmp_path)
    cache_file = next((tmp_path / "cache").glob("*.arrow"))
    table = pa.ipc.open_file(pa.memory_map(str(cache_file))).read_all()
    table = table.replace_schema_metadata({"accel_train": json.dumps({"root": str(root)})})
    with pa.OSFile(str(cache_file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
        out.write_table(table)
    index = _cached_index(tmp_path)
    assert not index.cached and _rows(index) == {"train": [("cat/1.png", "cat")]}
    assert _cached_index(tmp_path).cached


def test_an_unwritable_cache_folder_costs_only_the_cache(tmp_path):
    root = _tree(tmp_path / "d", ["cat/1.png"])
    age_folders(root)
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the cache folder would be")
    for _ in range(2):
        index = index_folder(root, cache_dir=blocker / "cache", cache_min_files=0)
        assert not index.cached and _rows(index) == {"train": [("cat/1.png", "cat")]}


def test_the_default_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(imagefolder.CACHE_ENV, str(tmp_path / "mine"))
    assert imagefolder.default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(imagefolder.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert imagefolder.default_cache_dir() == tmp_path / "xdg" / "accel_train" / "folder-index"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert imagefolder.default_cache_dir() == \
        tmp_path / "home" / ".cache" / "accel_train" / "folder-index"


def test_image_extensions_are_what_pil_opens_less_data_files():
    extensions = imagefolder.image_extensions()
    assert {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif"} <= extensions
    assert not {".h5", ".hdf", ".txt", ".db"} & extensions


def test_a_folder_of_one_class_is_one_line_naming_its_class_folder(tmp_path):
    from accel_train.config import TrainConfig
    from accel_train.data.sources import load_data
    for i in range(3):
        (tmp_path / "only").mkdir(exist_ok=True)
        Image.fromarray(np.full((8, 8, 3), i, dtype=np.uint8)).save(tmp_path / "only" / f"{i}.png")
    with pytest.raises(UsageError) as caught:
        load_data(TrainConfig(data_dir=str(tmp_path), in_memory="never"))
    assert str(caught.value) == (f"{tmp_path}: found 1 class(es) (only; an image folder's "
                                 f"classes are its class folders, or the labels of "
                                 f"--train-labels); a classifier needs at least 2")


def test_a_run_folder_inside_an_image_folder_is_refused(tmp_path, monkeypatch):
    """Its plots would be read as images of a class named after it; the line that came first
    blamed the data, naming a folder the start had just made (and removed again)."""
    from PIL import Image
    from conftest import PINNED, accel_train_here
    data = tmp_path / "photos"
    for name in ("cat", "dog"):
        (data / name).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 8), (60 * i, 9, 9)).save(data / name / f"{i}.png")
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    common = ["--model", "test_resnet", "--max-steps", "1", "--batch-size", "2", "--no-plots",
              *PINNED]
    for inside in (data / "runs" / "a", data / "cat" / "run"):
        refused = accel_train_here("--data-dir", str(data), "--output-dir", str(inside),
                                   *common)
        assert refused.returncode == 2 and refused.stderr == (
            f"accel_train: error: --output-dir {inside} is inside --data-dir {data}, an image "
            f"folder: the run's files would be read as its images; choose an --output-dir "
            f"outside the data\n")
        assert sorted(p.relative_to(data) for p in data.rglob("*")) == before
    monkeypatch.chdir(tmp_path)  # beside the data: trains
    accel_train_here("--data-dir", "photos", "--output-dir", "run", *common, check=True)


@pytest.mark.parametrize("split_folder", ["", "train/", "train2017/"],
                         ids=["flat", "train/", "train2017/ beside val2017/"])
def test_deepest_folder_classes_spread_over_top_level_folders_are_said(tmp_path, split_folder):
    """cat/2019, cat/2020, dog/2019, dog/2020: the deepest folders are the classes (datasets'
    imagefolder rule), so the run trained 2019 against 2020, cats and dogs in each, and
    check-data found no problem.  Said in training's warnings and check-data's table, with
    --class-depth 1; the classes of a plain layout are not."""
    from PIL import Image
    from accel_train.config import TrainConfig
    from accel_train.data.sources import load_data
    from conftest import accel_train_here
    for top in ("cat", "dog"):
        for year in ("2019", "2020"):
            folder = tmp_path / "nested" / split_folder / top / year
            folder.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (8, 8), (40 * i, 9, 9)).save(folder / f"{i}.png")
    if split_folder == "train2017/":  # the validation split that makes it a split folder
        for year in ("2019", "2020"):
            (tmp_path / "nested" / "val2017" / "cat" / year).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / "nested" / "val2017" / "cat" / year /
                                          "0.png")
    line = ("the classes are the deepest folders (2019, 2020 of 2), each found under several "
            "top-level folders (cat, dog): if the top-level folders are the classes, pass "
            "--class-depth 1")
    data = str(tmp_path / "nested")
    assert line in load_data(TrainConfig(data_dir=data, in_memory="never")).warnings
    assert load_data(TrainConfig(data_dir=data, in_memory="never", class_depth=1)
                     ).class_names == ["cat", "dog"]
    table = accel_train_here("check-data", "--data-dir", data, "--workers", "1")
    assert table.returncode == 0 and f"  note: {line}\n" in table.stdout, table.stdout
    plain = tmp_path / "plain" / "cat"
    plain.mkdir(parents=True)
    for name in ("cat", "dog"):
        (tmp_path / "plain" / name).mkdir(exist_ok=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 9, 9)).save(tmp_path / "plain" / name / f"{i}.png")
    assert not any("deepest folders" in w for w in load_data(TrainConfig(
        data_dir=str(tmp_path / "plain"), in_memory="never")).warnings)


def test_photos_pil_does_not_open_are_said_at_every_start_cached_or_not(tmp_path):
    """An iPhone's folder, part HEIC: training left those out without a word.  The count by
    extension is said at the start and kept in the index's cache, so a start that reads the
    cache (and walks nothing) says it too.  Oracle: the files written here."""
    from accel_train.config import TrainConfig
    from accel_train.data.sources import load_data

    root = tmp_path / "phone"
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / label / f"IMG_{i}.jpg")
    for name in ("cat/IMG_7.HEIC", "dog/IMG_8.heic", "dog/DSC_9.NEF"):
        (root / name).write_bytes(b"\x00\x00\x00\x18ftypheic")
    (root / "cat" / "notes.txt").write_text("not a photo: not counted")
    line = (f"3 photo(s) under {root} left out (.heic 2, .nef 1): a format PIL does not open "
            f"(phones' HEIC, cameras' raw files); convert them to JPEG or PNG")
    assert line in load_data(TrainConfig(data_dir=str(root), in_memory="never")).warnings
    age_folders(root)
    cache = tmp_path / "cache"
    built = index_folder(root, cache_dir=cache, cache_min_files=1)
    cached = imagefolder.cached_index(root, cache_dir=cache)
    assert not built.cached and cached is not None and cached.cached
    assert built.not_opened == cached.not_opened == {".heic": 2, ".nef": 1}
