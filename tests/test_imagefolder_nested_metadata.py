"""Hugging Face's imagefolder layout with metadata files in subfolders: each file in a split
folder or below it labels the images it lists, its file_name relative to its own folder, as
datasets' imagefolder reads them; one beside the split folders is read by neither; what datasets
refuses (files of two kinds, splits whose files name different columns) is refused in one line,
and so is what it would read as a row without a label, twice, or not at all.

Oracle: Hugging Face's own builder (`datasets.load_dataset("imagefolder")`) on the same folders,
for each image's label and for what it refuses."""

from __future__ import annotations

import json
import os
import time

import datasets
import pytest

from accel_train.config import TrainConfig
from accel_train.data.imagefolder import index_folder
from accel_train.data.sources import load_data
from conftest import PINNED, accel_train_here, age_folders
from test_imagefolder_metadata import _image, _ours, _theirs, _write_metadata

KINDS = ["csv", "jsonl", "parquet"]


def _refusal(tmp_path, root) -> str:
    """The one line training refuses `root` with (and that no run folder was made)."""
    ran = accel_train_here("--data-dir", str(root), *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    lines = ran.stderr.strip().splitlines()
    assert ran.returncode == 2 and len(lines) == 1, ran.stderr
    assert not (tmp_path / "run").exists()
    return lines[0].removeprefix("accel_train: error: ")


def _labelled(folder, kind: str, labels: dict[str, str], value: int = 0) -> None:
    """Images named by `labels` (paths relative to `folder`) and the metadata file in `folder`
    that labels them, a caption column beside file_name and label."""
    for i, name in enumerate(labels):
        _image(folder / name, value + 30 * i)
    _write_metadata(folder / f"metadata.{kind}",
                    [{"file_name": name, "label": label, "caption": f"photo {name}"}
                     for name, label in labels.items()])


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_files_in_subfolders_label_their_own_images(tmp_path, kind):
    """train/indoor/ and train/outdoor/ each hold a metadata file naming their images by
    file name (relative to that folder), labels that are not the folders' names; test/ one at
    its root."""
    root = tmp_path / "hf"
    _labelled(root / "train" / "indoor", kind, {"0.png": "cat", "1.png": "dog", "2.png": "cat"})
    _labelled(root / "train" / "outdoor", kind,
              {"0.png": "dog", "deep/1.png": "cat", "2.png": "dog"}, value=7)
    _labelled(root / "test", kind, {"a/0.png": "cat", "b/1.png": "dog"}, value=3)
    theirs = _theirs(root)
    assert set(theirs["train"].values()) == {"cat", "dog"}  # not the folders' names
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never"))
    assert _ours(data) == {**theirs["train"], **theirs["test"]}
    assert data.class_names == ["cat", "dog"]
    report = json.loads(accel_train_here("check-data", "--data-dir", str(root), "--workers",
                                         "1", "--json", check=True).stdout)
    assert report["labels_from"] == {
        "train": [f"train/indoor/metadata.{kind}", f"train/outdoor/metadata.{kind}"],
        "test": [f"test/metadata.{kind}"]}
    assert report["files_not_read"] == {}


def test_sibling_folders_whose_names_share_a_start_keep_their_own_images(tmp_path):
    """train/sub/, train/sub-x/, train/sub0/ and train/subA/ each labelled by their own
    metadata file, the same file names in each: the images a file owns are its folder's, not a
    sibling's whose name sorts next to it ("-" before "/", "0" and "A" after it).  datasets'
    imagefolder is the oracle where rows give paths; a row that gives a file name alone (which
    datasets does not take) finds its one image among its own folder's, not two."""
    root = tmp_path / "hf"
    subs = ("sub", "sub-x", "sub0", "subA")
    for n, sub in enumerate(subs):
        _labelled(root / "train" / sub, "csv", {"0.png": ["cat", "dog"][n % 2],
                                                "1.png": ["dog", "cat"][n % 2]}, value=n)
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never", val_fraction=0.25))
    theirs = _theirs(root)
    assert len(theirs["train"]) == 8 and _ours(data) == theirs["train"]
    by_name = tmp_path / "by_name"
    for n, sub in enumerate(subs):
        _labelled(by_name / "train" / sub, "csv", {"deep/2.png": ["owl", "bee"][n % 2]}, value=n)
        _write_metadata(by_name / "train" / sub / "metadata.csv",
                        [{"file_name": "2.png", "label": ["owl", "bee"][n % 2]}])
    data = load_data(TrainConfig(data_dir=str(by_name), in_memory="never", val_fraction=0.25))
    assert _ours(data) == {f"train/{sub}/deep/2.png": ["owl", "bee"][n % 2]
                           for n, sub in enumerate(subs)}


@pytest.mark.parametrize("split_folder", ["train/", ""], ids=["split folder", "no split"])
def test_a_metadata_file_at_the_root_and_one_in_a_subfolder_label_together(tmp_path,
                                                                          split_folder):
    """The root's file lists its own images and one in a subfolder by its path; the
    subfolder's file lists the rest by file name."""
    root = tmp_path / "hf"
    folder = root / split_folder
    _labelled(folder, "jsonl", {"0.png": "a", "1.png": "b", "more/2.png": "a"})
    _labelled(folder / "more", "jsonl", {"3.png": "b", "4.png": "a", "5.png": "b"}, value=9)
    theirs = _theirs(root)["train"]
    assert len(theirs) == 6
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never", val_fraction=0.34))
    assert _ours(data) == theirs


def test_an_edited_metadata_file_in_a_subfolder_is_read_again(tmp_path):
    """Rewriting a subfolder's file in place changes no folder's mtime: the cached index
    checks each metadata file's own."""
    root, cache = tmp_path / "hf", tmp_path / "cache"
    _labelled(root, "csv", {"0.png": "a", "1.png": "b"})
    _labelled(root / "sub", "csv", {"2.png": "a", "3.png": "b"}, value=5)
    nested = root / "sub" / "metadata.csv"
    old = time.time() - 3600
    for file in (root / "metadata.csv", nested):
        os.utime(file, (old, old))
    age_folders(root, then=old)
    index_folder(root, cache_dir=cache, cache_min_files=0)
    cached = index_folder(root, cache_dir=cache, cache_min_files=0)
    assert cached.cached and cached.splits["train"][1].tolist() == [0, 1, 0, 1]
    _write_metadata(nested, [{"file_name": "2.png", "label": "c"},
                             {"file_name": "3.png", "label": "c"}])
    os.utime(nested, (old + 1, old + 1))
    edited = index_folder(root, cache_dir=cache, cache_min_files=0)
    assert not edited.cached and edited.class_names == ["a", "b", "c"]
    assert edited.splits["train"][1].tolist() == [0, 1, 2, 2]


def _beside_split_folders(root, sorted_into_folders: bool) -> None:
    """train/ and test/, and a metadata file beside them labelling every image by its path
    from the root."""
    rows = []
    for i in range(6):
        split = "test" if i >= 4 else "train"
        name = f"{split}/{['cat', 'dog'][i % 2] + '/' if sorted_into_folders else ''}{i}.png"
        _image(root / name, 30 * i)
        rows.append({"file_name": name, "label": ["indoor", "outdoor"][i // 3]})
    _write_metadata(root / "metadata.csv", rows)


def test_a_metadata_file_beside_the_split_folders_is_not_read_as_datasets_reads_none(tmp_path):
    root = tmp_path / "hf"
    _beside_split_folders(root, sorted_into_folders=True)
    theirs = _theirs(root)
    assert set(theirs["train"].values()) == {"0", "1"}  # the class folders' ClassLabel
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never"))
    assert data.class_names == ["cat", "dog"]
    names = datasets.load_dataset("imagefolder", data_dir=str(root))["train"].features[
        "label"].names
    assert _ours(data) == {path: names[int(label)]
                           for split in ("train", "test") for path, label in
                           theirs[split].items()}


def test_unsorted_images_beside_a_root_metadata_file_are_refused_naming_it(tmp_path):
    root = tmp_path / "hf"
    _beside_split_folders(root, sorted_into_folders=False)
    assert _refusal(tmp_path, root) == (
        f"{root / 'test' / '4.png'} is not inside a class folder; put each class's images in a "
        f"subfolder named after the class (the metadata.csv beside the split folders is not "
        f"read, as Hugging Face's imagefolder reads none there: put one in test/, each "
        f"file_name relative to it)")


def test_metadata_files_of_two_kinds_in_two_folders_are_refused(tmp_path):
    """In one split or in two, as datasets refuses them."""
    for where in ("train/more", "test"):
        root = tmp_path / where.replace("/", "_")
        _labelled(root / "train", "csv", {"0.png": "a", "1.png": "b"})
        _labelled(root / where, "jsonl", {"2.png": "a", "3.png": "b"})
        with pytest.raises(ValueError, match="different extensions"):
            datasets.load_dataset("imagefolder", data_dir=str(root))
        first, second = sorted([root / "train" / "metadata.csv", root / where / "metadata.jsonl"])
        assert _refusal(tmp_path, root) == (
            f"{first} and {second} are metadata files of two kinds; keep one kind (Hugging "
            f"Face's imagefolder reads one kind of metadata file in a dataset)")


def test_splits_whose_metadata_files_name_different_columns_are_refused(tmp_path):
    root = tmp_path / "hf"
    _labelled(root / "train", "csv", {"0.png": "a", "1.png": "b"})  # with a caption column
    for i in range(2):
        _image(root / "test" / f"{i}.png", 60 * i)
    _write_metadata(root / "test" / "metadata.csv",
                    [{"file_name": f"{i}.png", "label": label} for i, label in enumerate("ab")])
    with pytest.raises(ValueError, match="different features"):
        datasets.load_dataset("imagefolder", data_dir=str(root))
    assert _refusal(tmp_path, root) == (
        f"{root / 'test' / 'metadata.csv'} names the columns file_name, label and "
        f"{root / 'train' / 'metadata.csv'} file_name, label, caption; give the metadata files "
        f"of every split the same columns (Hugging Face's imagefolder refuses them otherwise)")


def test_a_subfolders_metadata_file_without_a_label_column_is_refused(tmp_path):
    """datasets reads its images as rows whose label is None (or, where it takes the columns
    from that file, which of a split's files it reads first varying from run to run, reads no
    label column at all)."""
    root = tmp_path / "hf"
    _labelled(root / "train", "csv", {"0.png": "a", "1.png": "b"})
    for i in range(2):
        _image(root / "train" / "more" / f"{i}.png", 90 + i)
    _write_metadata(root / "train" / "more" / "metadata.csv",
                    [{"file_name": f"{i}.png", "caption": "x"} for i in range(2)])
    read = datasets.load_dataset("imagefolder", data_dir=str(root))["train"]
    assert "label" not in read.column_names or \
        sorted(map(str, read["label"])) == ["None", "None", "a", "b"]
    assert _refusal(tmp_path, root) == (
        f"{root / 'train' / 'more' / 'metadata.csv'} has no label column, and "
        f"{root / 'train' / 'metadata.csv'} labels the images of the same split; name each "
        f"image's file_name and label in it too (Hugging Face's imagefolder would leave its "
        f"images without a label)")


def test_an_image_two_metadata_files_label_is_refused_naming_both(tmp_path):
    """datasets reads it twice, as two rows."""
    root = tmp_path / "hf"
    _labelled(root / "train", "jsonl", {"0.png": "a", "more/1.png": "a"})
    _labelled(root / "train" / "more", "jsonl", {"1.png": "b"}, value=5)
    read = datasets.load_dataset("imagefolder", data_dir=str(root))["train"]
    assert len(read) == 3
    assert _refusal(tmp_path, root) == (
        f"{root / 'train' / 'more' / 'metadata.jsonl'} line 1 labels more/1.png again "
        f"({root / 'train' / 'metadata.jsonl'} line 2 did); label each image in one metadata "
        f"file")


def test_an_image_no_metadata_file_lists_is_refused(tmp_path):
    """Beside class folders, a metadata file in one of them: datasets reads the images it
    lists and leaves the other class folder's out; training refuses, as it refuses any image
    left unlabelled."""
    root = tmp_path / "hf"
    _labelled(root / "train" / "cat", "csv", {"0.png": "kitten", "1.png": "kitten"})
    for i in range(2):
        _image(root / "train" / "dog" / f"{i}.png", 70 + i)
    assert _theirs(root)["train"] == {"train/cat/0.png": "kitten", "train/cat/1.png": "kitten"}
    assert _refusal(tmp_path, root) == (
        f"{root / 'train' / 'cat' / 'metadata.csv'} gives no label for 2 image(s) of "
        f"{root / 'train'} (first: dog/0.png); label every image or remove the others")


def test_a_held_out_label_training_never_saw_is_refused_in_one_line(tmp_path):
    """Metadata files label both splits; the test split's `bird` is no training class."""
    root = tmp_path / "hf"
    _labelled(root / "train" / "indoor", "csv", {"0.png": "cat", "1.png": "dog"})
    _labelled(root / "test", "csv", {"0.png": "cat", "1.png": "bird"}, value=3)
    line = _refusal(tmp_path, root)
    assert "bird" in line and "Traceback" not in line, line


def test_metadata_files_of_three_kinds_in_one_folder_are_refused_naming_two(tmp_path):
    root = tmp_path / "hf"
    for kind in KINDS:
        _labelled(root / "train", kind, {"0.png": "cat", "1.png": "dog"})
    line = _refusal(tmp_path, root)
    assert "holds both metadata.csv and metadata.jsonl" in line, line
