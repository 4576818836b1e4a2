"""Image-folder layouts (accel_train/data/imagefolder.py): class folders with or without split
folders, ImageNet's validation layout with a label file, nested class folders; the cached index;
bad folders as one-line errors; quiet logs.

Oracles: Hugging Face's own imagefolder builder (`datasets.load_dataset("imagefolder")`, what
the trainer used before) for rows, labels, classes and the carved held-out split; the label
mappings and folder trees generated here for the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from accel_train.cli import main
from accel_train.config import TrainConfig
from accel_train.base.errors import UsageError
from accel_train.data import imagefolder
from accel_train.data.imagefolder import index_folder
from accel_train.data.sources import load_data
from conftest import PINNED, accel_train, accel_train_here, age_folders


def _png(path: Path, seed: int = 0, size: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="PNG")


def _paths(source) -> list[str]:
    return [value["path"] for value in source.column[:].column(0).to_pylist()]


def _files(root: Path, relative: list[str]) -> None:
    for i, name in enumerate(relative):
        _png(root / name, seed=i)


TRICKY = ["a/1.png", "a/10.png", "a/2.PNG", "a-b/1.png", "a_b/x.jpg.png", "b/3.png",
          "b/4.png", "B/5.png", "c d/6.png", ".hidden/7.png", "a/.8.png", "__MACOSX/a/9.png",
          "a/notes.txt", "b/thumbs.db", "b/__7.png", "c d/noextension"]


# split folders named as datasets' imagefolder reads them: by name, or with the split's name
# inside the folder's (COCO's train2017/, ImageNet's ILSVRC2012_img_val/)
SPLIT_NAMES = [("train", "val"), ("my-train", "my-val"), ("train2017", "val2017"),
               ("ILSVRC2012_img_train", "ILSVRC2012_img_val"), ("training set", "validation set")]


@pytest.mark.parametrize("splits", [None, *SPLIT_NAMES])
def test_rows_labels_and_classes_are_those_of_datasets_imagefolder(tmp_path, splits):
    root = tmp_path / "data"
    names = [f"{split}/{name}" for split in splits for name in TRICKY] if splits else TRICKY
    _files(root, names)
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never"))
    theirs = datasets.load_dataset("imagefolder", data_dir=str(root))
    train, held_out = (theirs["train"], theirs["validation"]) if splits else \
        (lambda p: (p["train"], p["test"]))(theirs["train"].train_test_split(test_size=0.1,
                                                                             seed=0))
    assert data.class_names == theirs["train"].features["label"].names
    for ours, reference in ((data.train, train), (data.held_out, held_out)):
        reference = reference.cast_column("image", datasets.Image(decode=False))
        expected = [os.path.relpath(v["path"], root) for v in reference["image"]]
        assert _paths(ours) == expected
        assert ours.labels.tolist() == list(reference["label"])


@pytest.mark.parametrize("name", ["my-train", "train2017", "ILSVRC2012_img_val", "training set",
                                  "validation.v2", "dev_01", "eval", "2024-testing", "x.test",
                                  "trainee", "devices", "retrain", "contest", "train_val",
                                  "train-training", "test-dev2017"])
def test_the_split_a_folders_name_names_is_the_one_datasets_finds_there(tmp_path, name):
    """Oracle: datasets' own split patterns for folder names (DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME),
    resolved by datasets on a folder of that name; a name that two splits' patterns match
    names none here (its images would be in both splits there)."""
    from datasets.data_files import DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME, resolve_pattern
    _files(tmp_path, [f"{name}/c/1.png"])

    def found(pattern: str) -> bool:
        try:
            return bool(resolve_pattern(pattern, str(tmp_path)))
        except FileNotFoundError:
            return False
    theirs = {str(split) for split, patterns in DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME.items()
              if any(found(pattern) for pattern in patterns)}
    assert imagefolder.split_in_name(name) == (theirs.pop() if len(theirs) == 1 else None)


def test_split_folders_one_folder_down_that_datasets_reads_as_splits_are_refused(tmp_path):
    """datasets' imagefolder finds split folders at any depth: photos/cifar/train/ and
    photos/cifar/val/ are its train and validation splits.  Read as one training split here,
    the validation images were trained on without a word: refused, naming the folder to
    pass, which then gives datasets' splits."""
    root = tmp_path / "photos"
    _files(root, [f"cifar/{split}/{name}" for split in ("train", "val")
                  for name in ("cat/1.png", "cat/2.png", "dog/3.png")])
    theirs = datasets.load_dataset("imagefolder", data_dir=str(root))
    assert set(theirs) == {"train", "validation"}
    with pytest.raises(UsageError, match=f"pass --data-dir {root / 'cifar'} to train"):
        load_data(TrainConfig(data_dir=str(root), in_memory="never"))
    data = load_data(TrainConfig(data_dir=str(root / "cifar"), in_memory="never"))
    reference = theirs["validation"].cast_column("image", datasets.Image(decode=False))
    assert [os.path.basename(p) for p in _paths(data.held_out)] == \
        [os.path.basename(v["path"]) for v in reference["image"]]


def test_split_folders_inside_class_folders_are_the_splits_datasets_finds(tmp_path):
    """photos/cat/train/, photos/cat/val/...: datasets' imagefolder finds its splits by those
    folders at any depth (the oracle for which image is in which split) but labels each image
    by its own folder, train or val; here the class is the folder above (cat, dog)."""
    root = tmp_path / "photos"
    names = [f"{c}/{split}/{i}.png" for c in ("cat", "dog") for split, count in
             (("train", 3), ("val", 2)) for i in range(count)]
    _files(root, names)
    theirs = datasets.load_dataset("imagefolder", data_dir=str(root))
    assert theirs["train"].features["label"].names == ["train", "val"]
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never"))
    assert data.class_names == ["cat", "dog"]
    for ours, split in ((data.train, "train"), (data.held_out, "validation")):
        reference = theirs[split].cast_column("image", datasets.Image(decode=False))
        assert _paths(ours) == [os.path.relpath(v["path"], root) for v in reference["image"]]
        assert ours.labels.tolist() == [data.class_names.index(p.split("/")[0])
                                        for p in _paths(ours)]


def test_classes_missing_from_a_held_out_split_are_fine_and_keep_their_numbers(tmp_path):
    """A class with no validation or test images (small held-out splits) trains as usual;
    only a held-out class that train/ lacks is refused (test_bad_folders_...)."""
    _files(tmp_path, ["train/a/1.png", "train/b/2.png", "train/c/3.png", "val/a/4.png",
                      "val/c/5.png", "test/b/6.png"])
    data = load_data(TrainConfig(data_dir=str(tmp_path), in_memory="never"))
    assert data.class_names == ["a", "b", "c"]
    assert data.held_out.labels.tolist() == [0, 2]
    _files(tmp_path, ["test/d/7.png"])  # the test split's classes are held to train's too
    with pytest.raises(UsageError, match=r"the test split has images of class\(es\) d, of"):
        load_data(TrainConfig(data_dir=str(tmp_path), in_memory="never"))


def test_a_test_split_beside_a_carved_validation_is_held_to_trains_classes(tmp_path):
    """No val/: validation is carved from train (same split, nothing to compare), and test/ is
    still checked; seven classes never trained are named five at a time."""
    _files(tmp_path, ["train/a/1.png", "train/a/2.png", "train/b/3.png", "train/b/4.png"]
           + [f"test/{c}/{i}.png" for i, c in enumerate("abcdefghi")])
    with pytest.raises(UsageError, match=r"the test split has images of class\(es\) c, d, e, "
                                         r"f, g and 2 more, of which train has none"):
        load_data(TrainConfig(data_dir=str(tmp_path), in_memory="never"))


def test_nested_class_folders_with_the_top_level_as_the_class(tmp_path):
    _files(tmp_path, ["animals/cat/siamese/1.png", "animals/cat/2.png", "animals/dog/3.png",
                      "plants/tree/oak/4.png", "plants/5.png", "plants/empty_leaf/x.txt"])
    top = load_data(TrainConfig(data_dir=str(tmp_path), in_memory="never", class_depth=1,
                                val_fraction=0.2))
    assert top.class_names == ["animals", "plants"]
    labels = {path: top.class_names[label] for source in (top.train, top.held_out)
              for path, label in zip(_paths(source), source.labels.tolist())}
    assert labels == {"animals/cat/siamese/1.png": "animals", "animals/cat/2.png": "animals",
                      "animals/dog/3.png": "animals", "plants/tree/oak/4.png": "plants",
                      "plants/5.png": "plants"}
    with pytest.raises(UsageError, match="class folder .*plants/empty_leaf holds no images"):
        load_data(TrainConfig(data_dir=str(tmp_path)))  # the leaf folders are the classes
    (tmp_path / "plants" / "empty_leaf" / "x.txt").unlink()
    (tmp_path / "plants" / "empty_leaf").rmdir()
    with pytest.raises(UsageError, match=r"plants/5.png is less than 2 folder\(s\) deep in its "
                                         r"split folder, so --class-depth 2 gives it no class"):
        load_data(TrainConfig(data_dir=str(tmp_path), class_depth=2))


# -- ImageNet's validation layout -------------------------------------------------------------
CLASSES = ["n01440764", "n01443537", "n01484850"]
VAL = {f"ILSVRC2012_val_{i:08d}.JPEG": CLASSES[(i * 7) % 3] for i in range(1, 10)}


def _imagenet(root: Path) -> Path:
    for c, name in enumerate(CLASSES):
        for i in range(4):
            _png(root / "train" / name / f"{name}_{i}.JPEG", seed=10 * c + i)
    for i, name in enumerate(VAL):
        _png(root / "val" / name, seed=100 + i)
    return root


LABEL_FILES = {
    "csv with a header": "ImageId,label\n" + "".join(f"{f},{c}\n" for f, c in VAL.items()),
    "kaggle LOC_val_solution": "ImageId,PredictionString\n" + "".join(
        f"{f.split('.')[0]},{c} 10 20 30 40 {c} 1 2 3 4\n" for f, c in reversed(VAL.items())),
    "whitespace": "".join(f"{f}\t{c}\n" for f, c in VAL.items()),
    "one class per line": "".join(f"{VAL[f]}\n" for f in sorted(VAL)),
}


@pytest.mark.parametrize("kind", list(LABEL_FILES))
def test_imagenet_validation_layout_with_a_label_file(tmp_path, kind):
    root = _imagenet(tmp_path / "imagenet")
    labels_file = tmp_path / "labels.txt"
    labels_file.write_text(LABEL_FILES[kind])
    data = load_data(TrainConfig(data_dir=str(root), val_labels=str(labels_file),
                                 in_memory="never"))
    assert data.class_names == CLASSES and len(data.train) == 12
    assert {path: data.class_names[label] for path, label in
            zip(_paths(data.held_out), data.held_out.labels.tolist())} == \
        {f"val/{name}": cls for name, cls in VAL.items()}


@pytest.mark.slow
def test_train_and_eval_on_the_imagenet_layout(tmp_path):
    root = _imagenet(tmp_path / "imagenet")
    labels_file = tmp_path / "LOC_val_solution.csv"
    labels_file.write_text(LABEL_FILES["kaggle LOC_val_solution"])
    out = tmp_path / "run"
    # trained in this process; evaluated in a new one, which has only the run's folder to go by
    trained = accel_train_here("--data-dir", str(root), *PINNED, "--val-labels", str(labels_file),
                               "--model", "test_resnet", "--batch-size", "4", "--epochs", "1",
                               "--progress", "log", "--no-plots", "--output-dir", str(out),
                               check=True)
    assert "12 train / 9 validation images, 3 classes" in trained.stdout
    evaluated = accel_train("eval", str(out), check=True)  # rebuilds the labelled held-out split
    assert "(9 images)" in evaluated.stdout
    epoch = trained.stdout.split("Epoch 1 Time")[1].splitlines()[0]
    assert epoch.split("top1 ")[1].split()[0] in evaluated.stdout.replace("top-1 ", "top1 ")


# -- bad folders and label files: one line, exit 2, nothing written ---------------------------
def _bad(tmp_path: Path, case: str) -> tuple[list[str], str]:
    root = _imagenet(tmp_path / "d")
    labels = tmp_path / "labels.csv"
    lines = [f"{f},{c}" for f, c in VAL.items()]
    if case == "no images":
        empty = tmp_path / "e"
        (empty / "cat").mkdir(parents=True)
        (empty / "cat" / "README.md").write_text("images go here")
        return ["--data-dir", str(empty)], f"--data-dir {empty} holds no image files"
    if case == "empty class folder":
        (root / "train" / "n09999999").mkdir()
        return ["--data-dir", str(root), "--val-labels", str(labels)], \
            f"class folder {root}/train/n09999999 holds no images; add images to it or remove it"
    if case == "label for a missing image":
        lines.append("ILSVRC2012_val_00000099.JPEG,n01440764")
        expected = (f"--val-labels {labels} line 10 names 'ILSVRC2012_val_00000099.JPEG', "
                    f"which is not an image in {root}/val")
    elif case == "unknown class":
        lines[3] = lines[3].split(",")[0] + ",n99999999"
        expected = f"--val-labels {labels} line 4: 'n99999999' is not a class"
    elif case == "class number":
        lines[0] = lines[0].split(",")[0] + ",65"
        expected = "class numbers are not accepted"
    elif case == "unlabelled image":
        del lines[4]
        expected = f"--val-labels {labels} gives no label for 1 image(s) of {root}/val"
    elif case == "no label file":
        labels = tmp_path / "nope.csv"
        expected = f"--val-labels {labels}: no such file"
    elif case == "held-out class never trained":
        # one class's folder named differently in val/: the model would get a class it never
        # trains on (a class missing from val/ only, as n01443537 here, is fine)
        mixed = tmp_path / "m"
        _files(mixed, ["train/n01440764/a.png", "train/n01443537/b.png", "train/n01484850/c.png",
                       "val/n01440764/d.png", "val/n01484850/e.png", "val/n01484851/f.png"])
        return ["--data-dir", str(mixed)], \
            (f"--data-dir {mixed}: the validation split has images of class(es) n01484851, of "
             f"which train has none")
    elif case == "empty split folder":
        split = tmp_path / "s"
        _files(split, ["train/a/1.png", "train/b/2.png"])
        (split / "val").mkdir()
        (split / "val" / "notes.txt").write_text("nothing yet")
        return ["--data-dir", str(split)], \
            (f"split folder {split}/val holds no images; put its images in one folder per "
             f"class inside it, or remove it")
    elif case == "symlink loop":
        # a link inside a class folder back to the data folder: walked, it never ends
        looped = tmp_path / "l"
        _files(looped, ["cat/1.png", "dog/2.png"])
        (looped / "cat" / "back").symlink_to("..")
        return ["--data-dir", str(looped)], \
            (f"the folder {looped}/cat/back is a link back to {looped}, which holds it (a "
             f"symlink loop: indexing would never end); remove the link or point it elsewhere")
    elif case == "split folders one folder down":  # an archive unpacked into its own folder
        wrapped = tmp_path / "w"
        _files(wrapped, ["cifar/train/a/1.png", "cifar/train/b/2.png", "cifar/val/a/3.png"])
        return ["--data-dir", str(wrapped)], \
            (f"--data-dir {wrapped} holds one folder, cifar/, whose folders are splits (train/, "
             f"val/): pass --data-dir {wrapped}/cifar to train")
    elif case == "split folders beside other folders":  # two data sets side by side
        two = tmp_path / "t"
        _files(two, ["cifar10/train/a/1.png", "cifar10/test/a/2.png", "extra/b/3.png"])
        return ["--data-dir", str(two)], \
            (f"--data-dir {two} holds split folders further down, beside other folders: "
             f"cifar10/ (test/, train/); read as class folders, their held-out images would be "
             f"trained on: pass --data-dir {two}/cifar10 to train")
    elif case == "unlabelled held-out folder":
        return ["--data-dir", str(root)], \
            f"{root}/val/ILSVRC2012_val_00000001.JPEG is not inside a class folder"
    if case != "no label file":
        labels.write_text("\n".join(lines) + "\n")
    return ["--data-dir", str(root), "--val-labels", str(labels)], expected


@pytest.mark.parametrize("case", ["no images", "empty class folder", "label for a missing image",
                                  "unknown class", "class number", "unlabelled image",
                                  "no label file", "unlabelled held-out folder",
                                  "held-out class never trained", "empty split folder",
                                  "symlink loop", "split folders one folder down",
                                  "split folders beside other folders"])
def test_bad_folders_and_label_files_are_one_line_errors(tmp_path, capsys, case):
    args, expected = _bad(tmp_path, case)
    out = tmp_path / "run"
    capsys.readouterr()
    code = main([*args, *PINNED, "--model", "test_resnet", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("accel_train: error: ") and expected in err[0], err[0]
    assert not out.exists()


def test_a_symlinked_class_folder_is_followed_and_a_link_to_a_sibling_is_no_loop(tmp_path):
    """Links are followed (a class folder kept on another disk); only a link back to a folder
    above it is a loop.  Two links to one folder index its images under each name."""
    elsewhere, root = tmp_path / "elsewhere", tmp_path / "data"
    _files(elsewhere, ["birds/1.png", "birds/2.png"])
    _files(root, ["cat/1.png", "dog/2.png"])
    (root / "birds").symlink_to(elsewhere / "birds")
    (root / "dog" / "pets").symlink_to(root / "cat")
    index = index_folder(root, cache_dir=tmp_path / "cache", cache_min_files=10**9)
    assert sorted(index.splits["train"][0].to_pylist()) == \
        ["birds/1.png", "birds/2.png", "cat/1.png", "dog/2.png", "dog/pets/1.png"]


# -- the cached index -----------------------------------------------------------------------------
def test_the_index_is_cached_and_rebuilt_when_a_folder_changes(tmp_path):
    root, cache = tmp_path / "data", tmp_path / "cache"
    _files(root, [f"{c}/{i}.png" for c in ("x", "y") for i in range(3)])
    fresh = index_folder(root, cache_dir=cache, cache_min_files=0)
    assert not fresh.cached and not list(cache.glob("*.arrow")), "just written: not cached"
    age_folders(root)
    assert not index_folder(root, cache_dir=cache, cache_min_files=0).cached
    cached = index_folder(root, cache_dir=cache, cache_min_files=0)
    assert cached.cached and cached.class_names == ["x", "y"]
    assert {k: (v[0].to_pylist(), v[1].tolist()) for k, v in cached.splits.items()} == \
        {k: (v[0].to_pylist(), v[1].tolist()) for k, v in fresh.splits.items()}
    for change in (lambda: _png(root / "y" / "new.png"),
                   lambda: (root / "x" / "0.png").rename(root / "x" / "renamed.png"),
                   lambda: (root / "y" / "1.png").unlink(),
                   lambda: _png(root / "z" / "0.png")):
        age_folders(root)
        index_folder(root, cache_dir=cache, cache_min_files=0)  # indexes and caches
        before = index_folder(root, cache_dir=cache, cache_min_files=0)
        change()
        after = index_folder(root, cache_dir=cache, cache_min_files=0)
        assert before.cached and not after.cached
        assert after.splits["train"][0].to_pylist() != before.splits["train"][0].to_pylist()
    assert "z" in after.class_names


def _parquet(path: Path, rows: int) -> None:
    """A parquet file of `rows` rows in the shape `datasets` writes: PNG bytes and labels."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    blobs = []
    for seed in range(rows):
        buffer = io.BytesIO()
        Image.fromarray(np.full((4, 4, 3), seed, np.uint8)).save(buffer, format="PNG")
        blobs.append({"bytes": buffer.getvalue(), "path": None})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"image": blobs, "label": [i % 2 for i in range(rows)]}), path)


def test_an_unchanged_indexed_folder_starts_without_listing_a_folder(tmp_path, monkeypatch):
    """The cached index is tried before the search for parquet files (a listing of every
    folder in the tree): an unchanged image folder's start lists none, and a parquet file
    added anywhere that search looks changes a folder the index saw, so it is found."""
    root, cache = tmp_path / "data", tmp_path / "cache"
    _files(root, [f"{c}/{i}.png" for c in ("x", "y") for i in range(10)])
    age_folders(root)
    index_folder(root, cache_dir=cache, cache_min_files=0)  # the first start's walk, cached
    monkeypatch.setenv(imagefolder.CACHE_ENV, str(cache))
    listed = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(path) or scandir(path))
    config = TrainConfig(data_dir=str(root), in_memory="never", val_fraction=0.1)
    data = load_data(config)
    assert listed == [] and data.class_names == ["x", "y"]
    assert sorted(_paths(data.train) + _paths(data.held_out)) == \
        sorted(f"{c}/{i}.png" for c in ("x", "y") for i in range(10))
    for where in ("train.parquet", "y/more.parquet"):
        _parquet(root / where, rows=6)
        loaded = load_data(config)
        assert len(loaded.train) + len(loaded.held_out) == 6, where
        assert listed, where  # the folder was searched again, and the parquet file taken
        (root / where).unlink()
        age_folders(root)
        index_folder(root, cache_dir=cache, cache_min_files=0)
        listed.clear()


def test_the_search_for_parquet_files_leaves_out_what_datasets_leaves_out(tmp_path):
    """Hidden files and folders and folders starting with `__` hold no data for `datasets`
    (its data_files patterns) nor for the image-folder index: nor for the search.  A file
    starting with `__` is data for `datasets` (only folders are special): it trains."""
    _parquet(tmp_path / "train.parquet", rows=4)
    _parquet(tmp_path / "__extra.parquet", rows=4)
    for left_out in (".cache/train.parquet", "__MACOSX/train.parquet", "._train.parquet",
                     "sub/__old/train-00001.parquet"):
        _parquet(tmp_path / left_out, rows=3)
    data = load_data(TrainConfig(data_dir=str(tmp_path), in_memory="never", val_fraction=0.25))
    assert len(data.train) + len(data.held_out) == 8


@pytest.mark.parametrize("split", ["", "train/"])
def test_a_first_start_lists_each_folder_of_an_image_folder_once(tmp_path, monkeypatch, split):
    """No cached index: one walk both indexes the images and looks for parquet files (a
    search for parquet files and then the index's walk listed every folder twice).  Beside
    split folders, a file in the root that is no parquet file changes nothing."""
    root = tmp_path / "data"
    _files(root, [f"{split}{c}/{sub}/{i}.png" for c in ("x", "y") for sub in ("p", "q")
                  for i in range(3)])
    (root / "README.md").write_text("cats and dogs\n")
    monkeypatch.setenv(imagefolder.CACHE_ENV, str(tmp_path / "cache"))
    listed = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(str(path)) or scandir(path))
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never", val_fraction=0.25))
    assert data.class_names == ["p", "q"] and len(data.train) + len(data.held_out) == 12
    walked = root / split
    folders = [str(walked), *(str(walked / c / sub) for c in ("x", "y") for sub in ("", "p", "q"))]
    # the root once more: listed for split folders (a few entries) before any walk
    assert sorted(listed) == sorted([str(root), *folders]), listed


@pytest.mark.parametrize("where", ["train/cat/deep/more.parquet", "extra.parquet",
                                   "__extra.parquet"])
def test_a_parquet_file_an_image_folders_walk_meets_makes_it_a_parquet_folder(tmp_path, where):
    """As when every parquet file was searched for first: a parquet file inside the image
    tree, or in the root beside split folders (which the split folders' walks do not list),
    makes the folder a parquet one, as datasets' own search would (for which only folders
    starting with __ are no data, not files)."""
    root = tmp_path / "data"
    _files(root, [f"{split}/{c}/{i}.png" for split in ("train", "test") for c in ("cat", "dog")
                  for i in range(4)])
    _parquet(root / where, rows=6)
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never", val_fraction=0.5))
    assert len(data.train) + len(data.held_out) == 6


def test_a_parquet_file_behind_a_symlinked_folder_leaves_an_image_folder_one(tmp_path):
    """The search for parquet files does not follow links (nor does datasets'); the index
    does: a parquet file only behind a link is not data, the images are."""
    root, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    _files(root, [f"{c}/{i}.png" for c in ("cat", "dog") for i in range(4)])
    _files(elsewhere, ["birds/1.png", "birds/2.png"])
    _parquet(elsewhere / "birds" / "old.parquet", rows=6)
    (root / "birds").symlink_to(elsewhere / "birds")
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never", val_fraction=0.25))
    assert data.class_names == ["birds", "cat", "dog"]
    assert len(data.train) + len(data.held_out) == 10


def test_a_folder_the_index_refuses_is_still_read_for_its_parquet_files(tmp_path):
    """Split folders beside another folder are no image folder (one line, exit 2), but
    parquet files in them are data, as before the index was tried first."""
    root = tmp_path / "data"
    _parquet(root / "train" / "part-0.parquet", rows=6)
    _parquet(root / "test" / "part-0.parquet", rows=4)
    (root / "notes").mkdir()
    data = load_data(TrainConfig(data_dir=str(root), in_memory="never"))
    assert len(data.train) + len(data.held_out) == 6 and len(data.test) == 4
    (root / "train" / "part-0.parquet").unlink()
    (root / "test" / "part-0.parquet").unlink()
    _files(root, ["train/cat/1.png", "test/cat/2.png"])
    with pytest.raises(UsageError, match="mixes split folders"):
        load_data(TrainConfig(data_dir=str(root), in_memory="never"))


@pytest.mark.slow
def test_training_on_an_image_folder_prints_nothing_of_datasets(tmp_path):
    """Output to a pipe (not a terminal): the start-up summary first, no progress bars."""
    _files(tmp_path / "data", [f"{split}/{c}/{i}.png" for split in ("train", "test")
                               for c in ("a", "b") for i in range(8)])
    result = accel_train("--data-dir", str(tmp_path / "data"), *PINNED, "--model", "test_resnet",
                         "--batch-size", "8", "--epochs", "1", "--warmup-fraction", "0.2",
                         "--progress", "log", "--no-plots", "--output-dir",
                         str(tmp_path / "run"), check=True)
    assert result.stdout.startswith("accel_train: test_resnet")  # (a warning would come first)
    for noise in ("Generating", "Resolving", "Downloading", "%|", "it/s]", "\r"):
        assert noise not in result.stdout + result.stderr, noise
