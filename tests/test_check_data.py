"""`accel-train check-data`: its table, its JSON and its exit codes, through the real command.

Oracles: the folders are generated here, so the sizes, classes, broken files and duplicates
they hold are known; sizes are summarized with Python's statistics module.
"""

from __future__ import annotations

import io
import json
import shlex
import tarfile
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import imagekinds as kinds
from accel_train.cli import main
from conftest import accel_train, accel_train_here

# (width, height) of the training images per class; one JPEG is stored 30 wide and 40 high
# with EXIF orientation 6 (a quarter turn): it is 40 wide and 30 high upright.
SIZES = {"ant": [(12, 10), (20, 10), (16, 24)], "bee": [(30, 30), (8, 12)]}
HELD_OUT = {"ant": [(14, 14)], "bee": [(10, 18), (22, 8)]}


def _write(root: Path) -> list[tuple[int, int]]:
    """A clean folder with train/ and val/; returns every image's upright (width, height)."""
    upright = []
    for split, table in (("train", SIZES), ("val", HELD_OUT)):
        for label, (name, sizes) in enumerate(table.items()):
            (root / split / name).mkdir(parents=True)
            for i, (width, height) in enumerate(sizes):
                array = kinds.pixels(10 * label + i + (100 if split == "val" else 0), height,
                                     width)
                Image.fromarray(array).save(root / split / name / f"{i}.png")
                upright.append((width, height))
    rotated = kinds.pixels(99, 40, 30)  # 30 wide, 40 high as stored
    (root / "train" / "bee" / "turned.jpg").write_bytes(kinds.exif_oriented_jpeg(rotated, 6))
    upright.append((40, 30))
    return upright


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, list[tuple[int, int]]]:
    root = tmp_path_factory.mktemp("clean")
    return root, _write(root)


@pytest.fixture(scope="module")
def troubled(tmp_path_factory) -> Path:
    """The clean folder plus: every kind of broken file, a training image copied into val/
    under another name, and a class folder in train/ only."""
    root = tmp_path_factory.mktemp("troubled")
    _write(root)
    for name, (data, _) in kinds.broken_files().items():
        (root / "train" / "ant" / f"bad_{name}").write_bytes(data)
    shutil.copy(root / "train" / "bee" / "1.png", root / "val" / "ant" / "copy.png")
    (root / "train" / "cow").mkdir()
    Image.fromarray(kinds.pixels(7)).save(root / "train" / "cow" / "0.png")
    return root


def check(*args: str):
    """The real command, in its own process."""
    result = accel_train("check-data", *args)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def check_here(capsys, *args: str) -> tuple[int, str, str]:
    """The same command line, in this process (quicker: no imports to pay again)."""
    capsys.readouterr()
    code = main(["check-data", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_a_clean_folder_exits_0_with_the_table(clean):
    root, upright = clean
    result = check("--data-dir", str(root), "--workers", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith(f"check-data {root}: 9 images in 2 split(s) (train 6, validation 3), "
                          f"2 classes; 2 worker process(es)")
    assert "unreadable images (0)\n" in out and "result: no problems found" in out
    table = out.split("images per class:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split() for line in table] == [["class", "train", "validation"],
                                                ["ant", "3", "1"], ["bee", "3", "2"],
                                                ["total", "6", "3"]]
    sizes = out.split("(after EXIF orientation):\n")[1].split("\n\n")[0].splitlines()[1:]
    widths, heights = zip(*upright)
    for line, values in zip(sizes, (widths, heights)):
        expected = [min(values), statistics.median(values), max(values)]
        assert [float(v) for v in line.split()[1:]] == expected, line


@pytest.mark.slow
def test_problems_exit_1_and_are_all_named_in_the_json(troubled, capsys):
    result = check("--data-dir", str(troubled), "--json", "--workers", "2")
    assert result.returncode == 1
    findings = json.loads(result.stdout)  # one object, nothing else on stdout
    unreadable = {u["image"]: u["reason"] for u in findings["unreadable"]}
    assert unreadable.keys() == {f"train/ant/bad_{name}" for name in kinds.broken_files()}
    for name, (_, words) in kinds.broken_files().items():
        assert words in unreadable[f"train/ant/bad_{name}"]
    assert findings["duplicates_across_splits"] == [[
        {"split": "train", "image": "train/bee/1.png"},
        {"split": "validation", "image": "val/ant/copy.png"}]]
    assert findings["classes_in_one_split"] == {"cow": "train"}
    assert findings["problems"] == len(kinds.broken_files()) + 2
    assert findings["class_counts"]["train"] == {"ant": 3 + len(kinds.broken_files()),
                                                 "bee": 3, "cow": 1}
    assert findings["sizes"]["width"]["max"] == 40  # the broken files have no size
    # One process decoding everything finds the same; and its table says the same.
    code, out, _ = check_here(capsys, "--data-dir", str(troubled), "--json", "--workers", "1")
    serial = json.loads(out)
    assert code == 1
    for one in (findings, serial):
        del one["seconds"], one["workers"]
    assert serial == findings
    code, table, _ = check_here(capsys, "--data-dir", str(troubled), "--workers", "1")
    assert code == 1
    assert f"result: {findings['problems']} problem(s): 5 unreadable image(s)" in table
    assert "train/bee/1.png (train) = val/ant/copy.png (validation)" in table
    assert "  cow: train only" in table
    for name in kinds.broken_files():
        assert f"  train/ant/bad_{name}" in table


def test_parquet_rows_are_checked_and_named(tmp_path, capsys):
    import datasets
    rows = {"image": [{"bytes": kinds.encoded(kinds.pixels(i, 8, 8), "PNG"), "path": None}
                      for i in range(6)], "label": [0, 1] * 3}
    rows["image"][4] = {"bytes": kinds.HTML, "path": None}
    datasets.Dataset.from_dict(rows, features=datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    ).to_parquet(str(tmp_path / "train.parquet"))
    code, out, _ = check_here(capsys, "--data-dir", str(tmp_path), "--json")
    findings = json.loads(out)
    assert code == 1 and [(u["split"], u["image"]) for u in findings["unreadable"]] == \
        [("train", "train.parquet row 4")]
    assert "holds text" in findings["unreadable"][0]["reason"]
    assert findings["classes_in_one_split"] == {}  # one split: nothing to compare


@pytest.mark.parametrize("args, message", [
    (["--data-dir", "{tmp}/missing"], "--data-dir {tmp}/missing: no such folder"),
    (["--data-dir", "{tmp}/nothing"], "holds no image files"),
    (["--data-dir", "{tmp}/empty_class"], "class folder {tmp}/empty_class/dog holds no images"),
    ([], "check-data needs the data: pass --data-dir DIR"),
    # the embedded set is not looked up on the hub (whose refusal named it as the way out)
    (["--dataset", "synthetic"], "--dataset synthetic is the embedded set, drawn in memory: it "
                                 "has no files to check; pass --data-dir DIR"),
    (["--data-dir", "{tmp}/nothing", "--workers", "0"], "--workers must be a whole number"),
    (["--data-dir", "{tmp}/nothing", "--read-timeout", "-1"],
     "--read-timeout must be seconds >= 0 (got -1); 0 waits for ever"),
    (["--data-dir", "{tmp}/nothing", "--read-timeout", "inf"], "--read-timeout must be seconds"),
    # a tar with no member at all (only the end blocks): read as a shard, named as one
    (["--data-dir", "{tmp}/shards"], "000000.tar is not a tar or parquet file"),
])
def test_bad_input_exits_2_in_one_line(tmp_path, capsys, args, message):
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.txt").write_text("no images here")
    for name in ("cat", "dog"):
        (tmp_path / "empty_class" / name).mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "empty_class" / "cat" / "0.png")
    (tmp_path / "shards" / "train").mkdir(parents=True)  # WebDataset tars: a shard folder
    with tarfile.open(tmp_path / "shards" / "train" / "000000.tar", "w"):
        pass
    code, out, err = check_here(capsys, *[a.format(tmp=tmp_path) for a in args])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and out == "", err
    assert lines[0].startswith("accel_train: error: ") and message.format(tmp=tmp_path) in lines[0]


# Hand-made WebDataset shards with an index (classes ant, bee, cow, dog): (stem, label or
# None, image bytes or None) per sample.  Training: a broken cow (cow's only training image), a
# sample with no label, one labelled 4 (no such class), a dog with no image, a bee whose bytes
# are also in the test split, and dog, found in training only; a validation split beside the
# test split, whose one bee is a copy of a training ant (the validation split holds the
# held-out role, the test split is the run's test set).
def _png(seed: int, width: int, height: int) -> bytes:
    return kinds.encoded(kinds.pixels(seed, height, width), "PNG")


BROKEN_DATA, BROKEN_WORDS = kinds.broken_files()["truncated.jpg"]
SHARDS = {
    "train/000000.tar": [("s0", 0, _png(0, 12, 10)), ("s1", 0, _png(1, 20, 10)),
                         ("s2", 1, _png(2, 30, 30)), ("s3", 2, BROKEN_DATA)],
    "train/000001.tar": [("s4", 1, _png(4, 8, 12)), ("s5", None, _png(5, 16, 16)),
                         ("s6", 4, _png(6, 9, 9)), ("s8", 3, None), ("s7", 3, _png(7, 10, 20))],
    "validation/000000.tar": [("v0", 1, _png(0, 12, 10))],
    "test/000000.tar": [("t0", 0, _png(10, 14, 14)), ("t1", 1, _png(4, 8, 12)),
                        ("t2", 2, _png(12, 22, 8))]}
# (width, height) of every sample that decodes and is labelled with a class: s0-s2, s4, s7, v0, t*
READABLE = [(12, 10), (20, 10), (30, 30), (8, 12), (10, 20), (12, 10), (14, 14), (8, 12),
            (22, 8)]


def _write_shards(root: Path) -> Path:
    for file, samples in SHARDS.items():
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(root / file, "w") as tar:
            for stem, label, image in samples:
                members = [(f"{stem}.png", image)] if image is not None else []
                if label is not None:
                    members.append((f"{stem}.cls", str(label).encode()))
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    index = {"format": "accel_train-shards/1", "class_names": ["ant", "bee", "cow", "dog"],
             "splits": {split: [{"file": f, "count": len(SHARDS[f])} for f in SHARDS
                                if f.startswith(split + "/")]
                        for split in ("train", "validation", "test")}}
    (root / "index.json").write_text(json.dumps(index))
    return root


def _expected_shard_findings(findings: dict) -> None:
    assert findings["splits"] == {"train": 9, "validation": 1, "test": 3}
    assert findings["unreadable"] == [
        {"split": "train", "image": "000000.tar s3", "reason": findings["unreadable"][0]["reason"]},
        {"split": "train", "image": "000001.tar s5", "reason": "no label (.cls)"},
        {"split": "train", "image": "000001.tar s6",
         "reason": "label 4 is not one of the 4 classes (0 to 3)"},
        {"split": "train", "image": "000001.tar s8",
         "reason": "no image (no member with an image file's extension)"}]
    assert BROKEN_WORDS in findings["unreadable"][0]["reason"]
    assert findings["class_counts"] == {"train": {"ant": 2, "bee": 2, "cow": 1, "dog": 2},
                                        "validation": {"ant": 0, "bee": 1, "cow": 0, "dog": 0},
                                        "test": {"ant": 1, "bee": 1, "cow": 1, "dog": 0}}
    # in the order each first copy comes (train before the held-out splits), each group by split
    assert findings["duplicates_across_splits"] == [
        [{"split": "train", "image": "000000.tar s0"},
         {"split": "validation", "image": "000000.tar v0"}],
        [{"split": "test", "image": "000000.tar t1"},
         {"split": "train", "image": "000001.tar s4"}]]
    assert findings["classes_in_one_split"] == {"dog": "train"}
    assert findings["classes_without_a_readable_training_image"] == ["cow"]
    widths, heights = zip(*READABLE)
    for axis, values in (("width", widths), ("height", heights)):
        assert findings["sizes"][axis] == {"min": min(values),
                                           "median": statistics.median(values),
                                           "max": max(values)}, axis
    assert findings["too_few_classes"] is False and findings["unlabelled"] == {}
    assert findings["problems"] == 4 + 2 + 1 + 1


def test_streaming_shards_are_checked_sample_by_sample(tmp_path, capsys):
    """check-data reads WebDataset shards as a streaming run does and finds each problem a run
    would meet there, each sample named as the run names it ("000001.tar s5"): an image that
    does not decode, a sample with no label, a label that is no class, a file in two splits, a
    class in one split only, and a class none of whose training images decodes."""
    root = _write_shards(tmp_path / "shards")
    code, out, _ = check_here(capsys, "--data-dir", str(root), "--json", "--workers", "1")
    assert code == 1
    _expected_shard_findings(json.loads(out))
    code, table, _ = check_here(capsys, "--data-dir", str(root), "--workers", "1")
    assert code == 1 and table.startswith(f"check-data {root}: 13 images in 3 split(s) "
                                          f"(train 9, validation 1, test 3), 4 classes"), table
    assert "000001.tar s4 (train) = 000000.tar t1 (test)" not in table  # sorted by split
    assert "000000.tar t1 (test) = 000001.tar s4 (train)" in table
    assert "classes none of whose training images can be read (1): cow" in table
    assert "  dog: train only" in table


def test_shards_of_a_clean_folder_read_as_the_folder_does(clean, tmp_path, capsys):
    """`accel-train shard` of a clean folder, checked: no problem, and the same images per class
    and image sizes as check-data finds in the folder itself (the oracle: the folder's known
    sizes, its EXIF-turned JPEG upright)."""
    root, upright = clean
    shards = tmp_path / "shards"
    assert main(["shard", "--data-dir", str(root), "--output", str(shards),
                 "--no-progress"]) in (0, None)
    code, out, _ = check_here(capsys, "--data-dir", str(shards), "--json", "--workers", "1")
    from_shards = json.loads(out)
    code_folder, out, _ = check_here(capsys, "--data-dir", str(root), "--json", "--workers", "1")
    from_folder = json.loads(out)
    assert code == code_folder == 0 and from_shards["problems"] == 0, from_shards
    assert list(from_shards["class_counts"].values()) == \
        list(from_folder["class_counts"].values())
    assert from_shards["sizes"] == from_folder["sizes"]
    widths, heights = zip(*upright)
    assert from_shards["sizes"]["width"]["median"] == statistics.median(widths)
    assert from_shards["sizes"]["height"]["max"] == max(heights)


@pytest.mark.slow
def test_shards_checked_by_two_worker_processes_find_the_same(tmp_path):
    """The same shards, in the real command's own process with a worker process per core: the
    same findings as the one-process check above."""
    root = _write_shards(tmp_path / "shards")
    result = check("--data-dir", str(root), "--json", "--workers", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    findings = json.loads(result.stdout)
    assert findings["workers"] == 2
    _expected_shard_findings(findings)


def test_one_class_is_a_problem_as_training_refuses_it(tmp_path, capsys):
    """check-data said "no problems found" of a folder training refuses (a classifier needs
    at least 2 classes)."""
    for i in range(3):
        (tmp_path / "only" / "cat").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (80 * i, 0, 0)).save(tmp_path / "only" / "cat" / f"{i}.png")
    code, out, _ = check_here(capsys, "--data-dir", str(tmp_path / "only"))
    assert code == 1 and "1 class: training needs at least 2" in out, out
    assert "fewer than 2 classes" in out.splitlines()[-1]
    code, out, _ = check_here(capsys, "--data-dir", str(tmp_path / "only"), "--json")
    assert json.loads(out.strip().splitlines()[-1])["too_few_classes"] is True


@pytest.mark.parametrize("counts, expected", [
    # 12, 4 and 3 images: the largest holds 4 times the smallest's
    ({"ant": 12, "bee": 4, "cow": 3}, {"smallest": {"class": "cow", "images": 3},
                                       "largest": {"class": "ant", "images": 12}, "ratio": 4.0}),
    # 3 times: named; under it (ImageNet's 1.8x), quiet
    ({"ant": 3, "bee": 9}, {"smallest": {"class": "ant", "images": 3},
                            "largest": {"class": "bee", "images": 9}, "ratio": 3.0}),
    ({"ant": 4, "bee": 11}, None),
])
def test_uneven_classes_name_their_options_and_are_no_problem(tmp_path, capsys, counts,
                                                              expected):
    root = tmp_path / "data"
    for label, (name, count) in enumerate(counts.items()):
        (root / name).mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", (8, 8), (20 * i, 60 * label, 0)).save(root / name / f"{i}.png")
    code, out, _ = check_here(capsys, "--data-dir", str(root), "--json")
    findings = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and findings["uneven_classes"] == expected
    code, out, _ = check_here(capsys, "--data-dir", str(root))
    line = [text for text in out.splitlines() if text.startswith("  uneven")]
    if expected is None:
        assert code == 0 and line == []
        return
    low, high = expected["smallest"], expected["largest"]
    assert code == 0 and line == [
        f"  uneven: {low['class']} has {low['images']} training image(s), {high['class']} "
        f"{high['images']} ({expected['ratio']:g}x); for classes this uneven: --val-stratify, "
        f"--class-weight balanced, --eval-metric mean_class_top1"]


def test_files_training_does_not_read_are_counted_and_photos_among_them_are_problems(
        tmp_path, capsys):
    """An iPhone's .HEIC photo beside JPEGs: training leaves it out without a word (PIL opens no
    such file).  check-data counts every file it will not read, by extension, and a photo
    format among them is a problem; notes and hidden files are only counted or left out."""
    root = tmp_path / "photos"
    for label in ("ant", "bee"):
        (root / label).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8), (60 * i, 0, 0)).save(root / label / f"{i}.jpg")
    (root / "bee" / "IMG_0001.HEIC").write_bytes(b"\x00\x00\x00\x18ftypheic")
    (root / "ant" / "notes.txt").write_text("taken in May")
    (root / "bee" / "more notes.txt").write_text("and June")
    (root / "bee" / "__README").write_text("a file named so is read as any other")
    (root / "ant" / ".DS_Store").write_bytes(b"\x00")
    (root / "__MACOSX" / "ant").mkdir(parents=True)  # left out whole, as training leaves it
    (root / "__MACOSX" / "ant" / "x.txt").write_text("")
    code, out, _ = check_here(capsys, "--data-dir", str(root), "--json")
    findings = json.loads(out.strip().splitlines()[-1])
    assert code == 1 and findings["images"] == 4
    assert findings["files_not_read"] == {"(no extension)": 1, ".heic": 1, ".txt": 2}
    assert findings["photos_not_read"] == {".heic": 1} and findings["problems"] == 1
    (root / "bee" / "IMG_0001.HEIC").unlink()
    code, out, _ = check_here(capsys, "--data-dir", str(root))
    assert code == 0 and "files not read as images (3): (no extension) 1, .txt 2" in out, out


def test_the_classes_left_unreadable_by_hand():
    """The one rule training and check-data share: classes with images, none of which decodes;
    an unlabelled image (-1), broken or not, counts for no class (it made check-data's count
    fail before)."""
    from accel_train.data.labels import classes_left_unreadable
    labels = [0, 0, 1, 1, 2, -1, -1]
    assert classes_left_unreadable(labels, [], 4) == []
    assert classes_left_unreadable(labels, [0], 4) == []           # class 0 keeps image 1
    assert classes_left_unreadable(labels, [0, 1], 4) == [0]
    assert classes_left_unreadable(labels, [0, 1, 4, 5], 4) == [0, 2]  # class 3 has no images
    assert classes_left_unreadable(labels, [5, 6], 4) == []


def test_a_training_refusals_check_data_hint_is_a_command_check_data_takes(tmp_path, capsys):
    """A refusal that points to check-data gives the command line to paste: check-data takes
    the folder as --data-dir (a folder named with a space quoted), and that command names the
    class the refusal is about.  Oracle: the hint's own words, run as the command it says."""
    root = tmp_path / "my photos"
    for folder, count in (("train/cat", 2), ("train/dog", 2), ("val/Cat", 1), ("val/dog", 1)):
        (root / folder).mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", (8, 8), (40 * i, 90, 0)).save(root / folder / f"{i}.png")
    refused = accel_train_here("--data-dir", str(root), "--output-dir", str(tmp_path / "run"))
    assert refused.returncode == 2 and not (tmp_path / "run").exists(), refused.stderr
    hint = refused.stderr.split("(accel-train check-data ")[1].split(" lists each")[0]
    code, out, err = check_here(capsys, *shlex.split(hint))
    assert code == 1, err  # problems found (Cat in one split), not an unrecognized argument
    assert "  Cat: validation only" in out


def test_the_table_lines_up_class_and_file_names_of_any_script(tmp_path, capsys):
    """Class folders named in Japanese and a broken file among them: each name is padded by the
    terminal columns it takes (a CJK character two, counted here by hand), so every count ends
    in one column and every reason starts in one."""
    root = tmp_path / "data"
    for label, name in enumerate(["猫", "cat", "犬犬犬"]):
        (root / name).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(kinds.pixels(10 * label + i, 8, 8)).save(root / name / f"{i}.png")
    (root / "猫" / "壊れた.png").write_bytes(b"not a png")
    (root / "cat" / "bad.png").write_bytes(b"not a png")
    code, out, _ = check_here(capsys, "--data-dir", str(root))
    assert code == 1, out
    lines = out.splitlines()
    # names padded to 6 columns (犬犬犬: 3 wide characters), the counts (broken files counted)
    # right-aligned under "train" in 6
    table = lines[lines.index("images per class:") + 1:][:5]
    assert table == ["  class    train",
                     "  cat          3",
                     "  犬犬犬       2",
                     "  猫           3",
                     "  total        8"], table
    # the paths padded to 13 columns (猫/壊れた.png: 4 wide characters and 5 narrow ones)
    unreadable = lines[lines.index("unreadable images (2):") + 1:][:2]
    assert [line.split(" not an image")[0] for line in sorted(unreadable)] == \
        ["  cat/bad.png   ", "  猫/壊れた.png "], unreadable
