"""`accel-train predict ... --csv FILE`: a submission's CSV of one real tiny run's predictions.

Oracles: pandas' CSV reader for what the file says, predict's own --json lines (checked against
plain torch in test_eval_oracle.py) for what it should say, and eval's top-1 over the folder
labelled by the file: a model scores 100% on its own predictions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from accel_train.base.errors import UsageError
from accel_train.data import synthetic
from conftest import TINY_TRAIN, accel_train_here
from test_commands import command, eval_json, predict_json


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("predict_csv") / "run"
    accel_train_here(*TINY_TRAIN, "--output-dir", str(out), check=True)
    return out


@pytest.fixture(autouse=True)
def _fresh(fresh_accelerate):
    """Every test here runs in process (conftest.fresh_accelerate)."""


@pytest.fixture(scope="module")
def test_folder(tmp_path_factory) -> Path:
    """A competition's test/ folder: images in two subfolders, no classes."""
    root = tmp_path_factory.mktemp("competition") / "test"
    images, _ = synthetic.generate(12, seed=5)
    for index, image in enumerate(images):
        folder = root / ("day1" if index % 2 else "day2")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"img{index:02d}.png")
    return root


def fp32(*argv: str) -> tuple[str, ...]:
    """One precision and batch for predict and eval alike: their top-1 then come from the same
    arithmetic (a near tie cannot flip between them)."""
    return (*argv, "--mixed-precision", "no", "--batch-size", "64")


def test_the_csv_holds_each_images_top1_as_predict_shows_it(run_dir, test_folder, tmp_path,
                                                           capsys):
    shown = predict_json(capsys, *fp32(str(run_dir), str(test_folder), "--top-k", "1"))
    out_file = tmp_path / "submission.csv"
    code, out, err = command(capsys, "predict", *fp32(str(run_dir), str(test_folder),
                                                      "--csv", str(out_file)))
    assert code == 0, err
    assert out.splitlines()[-1] == f"wrote {out_file}: 12 image(s), the top-1 class each"
    assert len(out.splitlines()) == 2  # the model line and this: the table gives way
    table = pd.read_csv(out_file, dtype=str)
    assert list(table.columns) == ["image", "class"]
    # paths inside the folder given, in predict's order, each with its top-1 class
    assert table["image"].tolist() == [
        Path(row["image"]).relative_to(test_folder).as_posix() for row in shown]
    assert table["class"].tolist() == [row["predictions"][0]["class"] for row in shown]
    assert not [p for p in tmp_path.iterdir() if p.name != "submission.csv"]  # no partial file


@pytest.mark.parametrize("form, first", [("name", "img01.png"), ("stem", "img01")])
def test_kaggle_ids_and_header(run_dir, test_folder, tmp_path, capsys, form, first):
    out_file = tmp_path / "submission.csv"
    code, _, err = command(capsys, "predict", str(run_dir), str(test_folder), "--csv",
                           str(out_file), "--csv-image", form, "--csv-header", "id,label")
    assert code == 0, err
    table = pd.read_csv(out_file, dtype=str)
    assert list(table.columns) == ["id", "label"]
    assert table["id"].iloc[0] == first  # day1/img01.png sorts first
    assert set(table["label"]) <= set(synthetic.CLASS_NAMES)


def test_the_probability_csv_is_every_class_in_the_models_order(run_dir, test_folder,
                                                                tmp_path, capsys):
    classes = len(synthetic.CLASS_NAMES)
    shown = predict_json(capsys, *fp32(str(run_dir), str(test_folder), "--top-k", str(classes)))
    out_file = tmp_path / "probabilities.csv"
    code, out, err = command(capsys, "predict", *fp32(
        str(run_dir), str(test_folder), "--csv", str(out_file), "--csv-probabilities",
        "--csv-header", "id", "--csv-image", "stem"))
    assert code == 0, err
    assert out.splitlines()[-1].endswith(f"12 image(s), the probabilities of {classes} classes "
                                         f"each")
    table = pd.read_csv(out_file, dtype={"id": str})
    assert list(table.columns) == ["id", *synthetic.CLASS_NAMES]
    for (_, line), row in zip(table.iterrows(), shown):
        assert line["id"] == Path(row["image"]).stem
        for prediction in row["predictions"]:
            assert line[prediction["class"]] == pytest.approx(prediction["probability"],
                                                              abs=1e-6)
        assert sum(line[name] for name in synthetic.CLASS_NAMES) == pytest.approx(1, abs=1e-5)


def test_the_top_k_csv_names_the_k_best_classes_best_first(run_dir, test_folder, tmp_path,
                                                          capsys):
    """Each cell against predict --json's ranking and, by a second route, against the
    probability CSV's columns sorted by numpy (pandas reads both files)."""
    shown = predict_json(capsys, *fp32(str(run_dir), str(test_folder), "--top-k", "3"))
    top3, probabilities = tmp_path / "top3.csv", tmp_path / "probabilities.csv"
    code, out, err = command(capsys, "predict", *fp32(str(run_dir), str(test_folder), "--csv",
                                                      str(top3), "--csv-top-k", "3"))
    assert code == 0, err
    assert out.splitlines()[-1] == f"wrote {top3}: 12 image(s), the top-3 classes each"
    code, _, err = command(capsys, "predict", *fp32(str(run_dir), str(test_folder), "--csv",
                                                    str(probabilities), "--csv-probabilities"))
    assert code == 0, err
    cells = pd.read_csv(top3, dtype=str)
    assert list(cells.columns) == ["image", "class"]
    assert cells["class"].tolist() == [" ".join(p["class"] for p in row["predictions"])
                                       for row in shown]
    one, plain = tmp_path / "top1.csv", tmp_path / "plain.csv"
    for target, extra in ((one, ["--csv-top-k", "1"]), (plain, [])):
        code, _, err = command(capsys, "predict", *fp32(str(run_dir), str(test_folder), "--csv",
                                                        str(target), *extra))
        assert code == 0, err
    assert one.read_bytes() == plain.read_bytes()  # 1 is the default's one class a cell
    numbers = pd.read_csv(probabilities)[synthetic.CLASS_NAMES].to_numpy()
    by_numpy = [" ".join(synthetic.CLASS_NAMES[i] for i in np.argsort(-line, kind="stable")[:3])
                for line in numbers]
    assert cells["class"].tolist() == by_numpy


def test_a_top_k_above_the_class_count_names_every_class(run_dir, test_folder, tmp_path,
                                                        capsys):
    out_file = tmp_path / "all.csv"
    code, out, err = command(capsys, "predict", str(run_dir), str(test_folder), "--csv",
                             str(out_file), "--csv-top-k", "50", "--csv-image", "stem")
    assert code == 0, err
    assert out.splitlines()[-1] == f"wrote {out_file}: 12 image(s), the top-10 classes each"
    for cell in pd.read_csv(out_file, dtype=str)["class"]:
        assert sorted(cell.split(" ")) == sorted(synthetic.CLASS_NAMES)


def test_a_top_k_above_the_class_count_shows_every_class_and_says_so(run_dir, test_folder,
                                                                     capsys):
    """--top-k 12 on a model of 10 classes: the table's 10 columns, each image's 10 classes
    (every class once), and one line on stderr saying why; a --top-k within the count, none."""
    one = sorted(test_folder.rglob("*.png"))[0]
    code, out, err = command(capsys, "predict", str(run_dir), str(one), "--top-k", "12")
    assert code == 0, err
    header, row = out.strip().splitlines()[-2:]
    assert header.split() == ["image", *(f"top-{k}" for k in range(1, 11))]
    assert err.strip().splitlines() == ["note: --top-k 12 is more than the model's 10 classes: "
                                        "showing all 10"]
    shown = predict_json(capsys, str(run_dir), str(one), "--top-k", "12")[0]["predictions"]
    assert sorted(p["class"] for p in shown) == sorted(synthetic.CLASS_NAMES)
    code, out, err = command(capsys, "predict", str(run_dir), str(one), "--top-k", "10")
    assert code == 0 and "note:" not in err, err


def test_class_names_with_spaces_are_refused_in_a_top_k_cell():
    from accel_train.commands.predict_csv import csv_row, refuse_names_with_spaces
    refuse_names_with_spaces(1, ["sea lion", "seal"])  # one class a cell: any name goes
    refuse_names_with_spaces(2, ["sea_lion", "seal"])
    for spaced in ("sea lion", "sea\tlion"):
        with pytest.raises(UsageError) as caught:
            refuse_names_with_spaces(2, ["seal", spaced, "walrus pup"])
        assert str(caught.value) == (f"--csv-top-k 2: the class {spaced!r} has a space in its "
                                     f"name, and spaces separate the classes of a cell; use "
                                     f"--csv-top-k 1 or --csv-probabilities")
    # the count the user typed is the one named, above the class count too; a model of one
    # class has one name a cell, whatever the count
    with pytest.raises(UsageError, match=r"^--csv-top-k 5: the class 'sea lion' has a space"):
        refuse_names_with_spaces(5, ["seal", "sea lion", "walrus"])
    refuse_names_with_spaces(5, ["sea lion"])
    ranked = [(2, 0.5), (0, 0.3), (1, 0.2)]
    assert csv_row("a.jpg", ranked, ["x", "y", "z"], False) == ["a.jpg", "z"]
    assert csv_row("a.jpg", ranked, ["x", "y", "z"], False, 2) == ["a.jpg", "z x"]


def test_a_model_scores_100_percent_on_the_folder_its_csv_labels(run_dir, test_folder,
                                                                 tmp_path, capsys):
    """The file is a label file training reads back (--train-labels, each of the id forms):
    eval of the folder so labelled counts every image right."""
    for form in ("relative", "name", "stem"):
        labels = tmp_path / f"labels_{form}.csv"
        code, _, err = command(capsys, "predict", *fp32(str(run_dir), str(test_folder),
                                                        "--csv", str(labels),
                                                        "--csv-image", form))
        assert code == 0, err
        result = eval_json(capsys, *fp32(str(run_dir), "--data-dir", str(test_folder),
                                         "--train-labels", str(labels), "--split", "all",
                                         "--tta", "none"))
        assert result["count"] == 12 and result["top1"] == 1.0, form


def test_an_unreadable_image_leaves_the_earlier_file_as_it_was(run_dir, test_folder, tmp_path,
                                                              capsys):
    folder = tmp_path / "test"
    shutil.copytree(test_folder, folder)
    (folder / "zz_broken.png").write_bytes(b"\x89PNG broken")
    out_file = tmp_path / "submission.csv"
    out_file.write_text("an earlier submission\n")
    code, out, err = command(capsys, "predict", str(run_dir), str(folder), "--csv",
                             str(out_file))
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"accel_train: error: 1 of 13 image(s) could not be read, first: {folder}/zz_broken.png "
        f"cannot be decoded (not an image format PIL can read (first bytes 89504e472062726f)); "
        f"{out_file} was not written (a submission needs every image): fix or remove the image")
    assert f"{folder}/zz_broken.png  (not predicted: not an image format" in out
    assert out_file.read_text() == "an earlier submission\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["submission.csv", "test"]


def test_json_lines_beside_the_csv(run_dir, test_folder, tmp_path, capsys):
    out_file = tmp_path / "submission.csv"
    code, out, err = command(capsys, "predict", str(run_dir), str(test_folder), "--csv",
                             str(out_file), "--json", "--top-k", "2")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 12 and all(len(row["predictions"]) == 2 for row in rows)
    table = pd.read_csv(out_file, dtype=str)
    assert table["class"].tolist() == [row["predictions"][0]["class"] for row in rows]


def _two_folders_of_one_name(tmp_path: Path, test_folder: Path) -> tuple[Path, Path]:
    first, second = tmp_path / "a" / "test", tmp_path / "b" / "test"
    shutil.copytree(test_folder, first)
    shutil.copytree(test_folder, second)
    return first, second


@pytest.mark.parametrize("case", ["stem", "stem of one name", "name", "relative"])
def test_ids_two_images_share_are_refused_before_any_work(run_dir, test_folder, tmp_path,
                                                          capsys, case):
    image = test_folder / "day1" / "img01.png"
    if case == "stem of one name":  # a/img01.png and b/img01.png: the name would clash too
        for folder in ("a", "b"):
            (tmp_path / "both" / folder).mkdir(parents=True)
            shutil.copy(image, tmp_path / "both" / folder / "img01.png")
        image, other = tmp_path / "both" / "a" / "img01.png", tmp_path / "both" / "b" / "img01.png"
        inputs, clash, second = [str(tmp_path / "both")], "'img01'", other
        hint = "use --csv-image relative (paths inside the folder given) or rename one"
    elif case == "stem":  # img01.png and img01.jpg
        other = tmp_path / "img01.jpg"
        Image.open(image).convert("RGB").save(other)
        inputs, clash, second = [str(image), str(other)], "'img01'", other
        hint = "use --csv-image name (ids with extensions) or rename one"
    elif case == "name":  # day1/img01.png and a copy elsewhere
        other = tmp_path / "elsewhere" / "img01.png"
        other.parent.mkdir()
        shutil.copy(image, other)
        inputs, clash, second = [str(test_folder), str(other.parent)], "'img01.png'", other
        hint = "use --csv-image relative (paths inside the folder given) or rename one"
    else:  # two folders holding the same paths
        first, other_folder = _two_folders_of_one_name(tmp_path, test_folder)
        inputs, clash = [str(first), str(other_folder)], "'day1/img01.png'"
        image, second = first / "day1" / "img01.png", other_folder / "day1" / "img01.png"
        hint = "predict the two folders into two files, or give the folder that holds both"
    out_file = tmp_path / "submission.csv"
    form = case.split()[0]
    code, out, err = command(capsys, "predict", str(run_dir), *inputs, "--csv", str(out_file),
                             "--csv-image", form)
    assert code == 2 and out == ""
    assert err.strip() == (f"accel_train: error: --csv-image {form}: {image} and {second} would "
                           f"both be {clash} in the CSV; {hint}")
    assert not out_file.exists()


@pytest.mark.parametrize("flags, line", [
    (["--csv-header", "id,label"], "--csv-header shapes the file of --csv FILE: pass --csv FILE "
                                   "too, or drop --csv-header"),
    (["--csv-image", "stem"], "--csv-image shapes the file of --csv FILE: pass --csv FILE too, "
                              "or drop --csv-image"),
    (["--csv-probabilities"], "--csv-probabilities shapes the file of --csv FILE: pass --csv "
                              "FILE too, or drop --csv-probabilities"),
    (["--csv", "{out}", "--csv-header", "id"], "--csv-header id: name the two columns, the "
                                             "image's and the class's (id,label)"),
    (["--csv", "{out}", "--csv-header", "id,label", "--csv-probabilities"],
     "--csv-header id,label: with --csv-probabilities name the image column only (id); the "
     "classes' columns are their names"),
    (["--csv", "{out}", "--csv-header", "id,id"], "--csv-header id,id: give distinct column "
                                                "names separated by commas (id,label)"),
    (["--csv", "{out}", "--csv-header", "id,"], "--csv-header id,: give distinct column names "
                                              "separated by commas (id,label)"),
    (["--csv", "{out}", "--csv-header", "ring", "--csv-probabilities"],
     "--csv-header: the image column 'ring' is also a class's name; name it otherwise "
     "(--csv-header id)"),
    (["--csv-top-k", "2"], "--csv-top-k shapes the file of --csv FILE: pass --csv FILE too, "
                           "or drop --csv-top-k"),
    (["--csv", "{out}", "--csv-top-k", "0"], "--csv-top-k must be a whole number >= 1 (got 0)"),
    (["--csv", "{out}", "--csv-top-k", "2", "--csv-probabilities"],
     "--csv-top-k and --csv-probabilities are two forms of the file: the K best classes' "
     "names, or every class's probability; pass one"),
    (["--csv", "{nowhere}/out.csv"], "--csv {nowhere}/out.csv: the folder {nowhere} does not "
                                     "exist; create it or name a file in an existing folder"),
    (["--csv", "{tmp}"], "--csv {tmp} is a folder; name the file to write (predictions.csv)"),
])
def test_csv_options_refused_in_one_line(run_dir, test_folder, tmp_path, capsys, flags, line):
    paths = {"out": tmp_path / "out.csv", "nowhere": tmp_path / "nowhere", "tmp": tmp_path}
    code, out, err = command(capsys, "predict", str(run_dir), str(test_folder),
                             *(flag.format(**paths) for flag in flags))
    assert code == 2
    assert err.strip() == f"accel_train: error: {line.format(**paths)}"
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_default_header_of_each_form():
    from accel_train.commands.predict_csv import header_of
    assert header_of(None, False, ["cat", "dog"]) == ["image", "class"]
    assert header_of(None, True, ["cat", "dog"]) == ["image", "cat", "dog"]
    assert header_of(" id , label ", False, ["cat"]) == ["id", "label"]


def test_a_file_that_cannot_be_made_beside_the_target_is_one_line(run_dir, test_folder,
                                                                  tmp_path, capsys):
    """A name the folder takes but not its hidden partial file beside it (255 bytes: the
    filesystems' limit), refused before any prediction, nothing written."""
    name = "p" * 250 + ".csv"
    code, out, err = command(capsys, "predict", str(run_dir), str(test_folder), "--csv",
                             str(tmp_path / name))
    assert code == 2
    assert err.strip() == (f"accel_train: error: --csv {tmp_path / name}: cannot write in "
                           f"{tmp_path} (File name too long); name a file in a folder you can "
                           f"write")
    assert list(tmp_path.iterdir()) == [] and "image(s)" not in out.split("\n", 1)[-1]


@pytest.mark.slow  # a predict process stopped by its read timeout: over 4 s
def test_the_partial_file_is_hidden_beside_the_target_and_gone_after_a_stop(run_dir,
                                                                          test_folder,
                                                                          tmp_path):
    """While predicting, the rows go to `.NAME.*.partial` in the target's folder (a rename
    there is atomic); a stop (an image read that never returns: --read-timeout) removes it and
    leaves the earlier file as it was."""
    import os
    import subprocess
    import sys
    import time
    from conftest import REPO
    from conftest import test_env as child_env  # (as test_env, pytest would collect it)
    fifo = tmp_path / "zz_stuck.png"  # sorted after the folder's images: read in the loop
    os.mkfifo(fifo)
    out_file = tmp_path / "out" / "submission.csv"
    out_file.parent.mkdir()
    out_file.write_text("an earlier submission\n")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "accel_train", "predict", str(run_dir), str(test_folder),
         str(fifo), "--csv", str(out_file), "--read-timeout", "3", "--batch-size", "4"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial, deadline = [], time.monotonic() + 60
    while not partial and time.monotonic() < deadline and process.poll() is None:
        partial = [p.name for p in out_file.parent.iterdir() if p.name != out_file.name]
        time.sleep(0.05)
    _, err = process.communicate(timeout=120)
    assert len(partial) == 1 and partial[0].startswith(".submission.csv.") and \
        partial[0].endswith(".partial"), (partial, err)
    assert process.returncode == 75, err
    assert sorted(p.name for p in out_file.parent.iterdir()) == ["submission.csv"]
    assert out_file.read_text() == "an earlier submission\n"
