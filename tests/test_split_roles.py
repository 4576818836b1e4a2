"""Which split plays which role, whatever the data's layout: data without a training split, an
empty split, a carve that leaves nothing to train, and the split names (dev, testing) that
image folders and parquet files already took, in a save_to_disk folder too.  Oracles: the
splits and row counts built here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from accel_train.base.errors import UsageError
from accel_train.config import TrainConfig
from accel_train.data.carve import carve_rows
from accel_train.data.sources import load_data
from conftest import PINNED, accel_train_here

FEATURES = datasets.Features({"image": datasets.Image(),
                              "label": datasets.ClassLabel(names=["a", "b"])})


def rows(count: int, seed: int = 0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
              for _ in range(count)]
    return datasets.Dataset.from_dict({"image": images, "label": [i % 2 for i in range(count)]},
                                      features=FEATURES)


def image_folder(root: Path, splits: dict[str, int]) -> Path:
    for split, count in splits.items():
        for i in range(count):
            path = root / split / "ab"[i % 2] / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8, 3), i, dtype=np.uint8)).save(path)
    return root


def parquet_folder(root: Path, splits: dict[str, int]) -> Path:
    root.mkdir(parents=True)
    for seed, (split, count) in enumerate(splits.items()):
        rows(count, seed).to_parquet(str(root / f"{split}.parquet"))
    return root


def saved_folder(root: Path, splits: dict[str, int]) -> Path:
    datasets.DatasetDict({split: rows(count, seed) for seed, (split, count)
                          in enumerate(splits.items())}).save_to_disk(str(root))
    return root


LAYOUTS = {"folder": image_folder, "parquet": parquet_folder, "save_to_disk": saved_folder}


def one_line(tmp_path, data: Path, *flags: str) -> str:
    """`accel-train --data-dir DATA ...` and `check-data`: the same one line, exit 2."""
    said = []
    for command in (["--model", "test_resnet", "--epochs", "1", "--output-dir",
                     str(tmp_path / "run"), *flags], ["check-data", *flags]):
        result = accel_train_here(*command[:1], "--data-dir", str(data), *command[1:]) \
            if command[0] == "check-data" else accel_train_here("--data-dir", str(data), *command)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stdout[-2000:] + result.stderr
        said.append(lines[0])
    assert not (tmp_path / "run").exists()
    return said[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_data_without_a_training_split_is_refused_not_trained_from_its_test_split(tmp_path,
                                                                                   layout):
    data = LAYOUTS[layout](tmp_path / "data", {"validation": 6, "test": 6})
    line = one_line(tmp_path, data)
    assert "has no training split: its splits are" in line and "test" in line, line
    assert "put the training images in a split named train" in line


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_a_split_with_no_rows_is_one_line_naming_it(tmp_path, layout):
    data = LAYOUTS[layout](tmp_path / "data", {"train": 8, "validation": 0})
    line = one_line(tmp_path, data)
    assert "validation" in line and "holds no rows" in line, line


def streamed_shards(root: Path, splits: dict[str, int]) -> Path:
    source = parquet_folder(root.with_name(root.name + "_parquet"), splits)
    accel_train_here("shard", "--data-dir", str(source), "--output", str(root), check=True)
    return root


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk", "shards"])
@pytest.mark.parametrize("flag", ["--val-labels", "--train-labels", "--class-depth"])
def test_an_image_folders_labelling_options_on_data_with_labels_are_refused(tmp_path, layout,
                                                                         flag):
    """--val-labels, --train-labels and --class-depth say how an image folder's images are
    labelled; given with parquet, save_to_disk data or streamed shards they went unread
    without a word (the run trained on the data's own labels), so one line says so."""
    make = {**LAYOUTS, "shards": streamed_shards}[layout]
    data = make(tmp_path / "data", {"train": 6, "validation": 4})
    labels = tmp_path / "labels.csv"
    labels.write_text("0.png,a\n")
    value = "1" if flag == "--class-depth" else str(labels)
    line = one_line(tmp_path, data, flag, value)
    assert f"{flag} {value}" in line and "image folder" in line and f"drop {flag}" in line, line


def test_a_carve_that_leaves_nothing_to_train_is_one_line(tmp_path):
    data = parquet_folder(tmp_path / "data", {"train": 20})
    line = one_line(tmp_path, data, "--val-fraction", "0.999")
    assert line.endswith("--val-fraction 0.999 holds out all 20 training images, leaving none "
                         "to train on; choose a smaller fraction (0.1 holds out 2)"), line
    # the largest fraction that leaves one image trains, and says so as a percentage; the
    # other class's first held-out image trains too
    loaded = load_data(TrainConfig(data_dir=str(data), val_fraction=0.95, in_memory="never"))
    assert (len(loaded.train), len(loaded.held_out)) == (2, 18)
    assert sorted(loaded.train.labels.tolist()) == [0, 1]
    assert "train minus 95% for validation; 1 held-out image(s)" in loaded.description


@pytest.mark.parametrize("validation, test", [("dev", "testing"), ("valid", "test")])
def test_save_to_disk_split_names_play_the_roles_image_folders_give_them(tmp_path, validation,
                                                                        test):
    data = saved_folder(tmp_path / "data", {"train": 10, validation: 4, test: 6})
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never"))
    assert (len(loaded.train), len(loaded.held_out), len(loaded.test)) == (10, 4, 6)
    assert f"(train/{validation}/{test})" in loaded.description


def test_image_folder_dev_and_testing_are_the_same_roles(tmp_path):
    data = image_folder(tmp_path / "data", {"train": 10, "dev": 4, "testing": 6})
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never"))
    assert (len(loaded.train), len(loaded.held_out), len(loaded.test)) == (10, 4, 6)


def test_a_split_of_another_name_alone_still_trains(tmp_path):
    """A save_to_disk folder whose one split is named neither train nor for evaluation (a
    hub dataset's 'default', say) trains on it, with 10% carved off, as before."""
    data = saved_folder(tmp_path / "data", {"default": 20})
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never"))
    assert (len(loaded.train), len(loaded.held_out)) == (18, 2)
    with pytest.raises(UsageError, match="no training split"):
        load_data(TrainConfig(data_dir=str(saved_folder(tmp_path / "t", {"test": 20})),
                              in_memory="never"))


@pytest.mark.parametrize("splits, roles", [
    # the test split first: it trained, its 9 images carved, the 30 training images unused
    ({"test": 9, "training": 30}, ("training", 27, "training", 3, "test", 9)),
    # capitals: Test was dropped without a word, Validation carved around
    ({"Train": 30, "Test": 9}, ("Train", 27, "Train", 3, "Test", 9)),
    ({"train": 30, "Validation": 9, "TEST": 6}, ("train", 30, "Validation", 9, "TEST", 6))],
    ids=["test first, training", "capitals", "Validation TEST"])
def test_save_to_disk_split_names_match_in_any_case_and_training(tmp_path, splits, roles):
    data = saved_folder(tmp_path / "data", splits)
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never"))
    train, n_train, held, n_held, test, n_test = roles
    assert (len(loaded.train), len(loaded.held_out), len(loaded.test)) == \
        (n_train, n_held, n_test)
    assert loaded.description.startswith(f"{data} ({train}") and f"{test}" in \
        loaded.description, loaded.description
    assert held in loaded.description


def test_splits_no_role_takes_are_said_and_two_that_could_train_are_refused(tmp_path):
    data = saved_folder(tmp_path / "data", {"train": 10, "holdout": 4, "test": 6})
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never"))
    assert len(loaded.train) + len(loaded.held_out) == 10 and len(loaded.test) == 6
    assert f"{data}: split(s) holdout left out: neither train, validation nor test by name " \
           f"(rename a split to one of those to use it)" in loaded.warnings
    line = one_line(tmp_path, saved_folder(tmp_path / "two", {"part1": 10, "part2": 10,
                                                               "test": 4}))
    assert line.endswith("has no split named train, and 2 that could be it (part1, part2); "
                         "name the training split train (and the others validation or "
                         "test)"), line


def test_eval_of_a_run_whose_folder_changed_warns_that_its_validation_split_is_another(
        tmp_path):
    """A flat folder's validation split is carved: images added since make the carve another
    one (with images the run trained on).  eval of the run says so; of the unchanged folder, not."""
    data = image_folder(tmp_path / "data", {"train": 40})
    run = tmp_path / "run"
    accel_train_here("--data-dir", str(data), *PINNED, "--model", "test_resnet", "--epochs", "1",
                     "--batch-size", "8", "--no-plots", "--output-dir", str(run), check=True)
    unchanged = accel_train_here("eval", str(run))
    assert unchanged.returncode == 0 and "data changed" not in unchanged.stdout + unchanged.stderr
    for i in range(40, 60):  # 20 more images: the carve of 60 is 54 / 6, not 36 / 4
        Image.fromarray(np.full((8, 8, 3), i, dtype=np.uint8)).save(
            data / "train" / "ab"[i % 2] / f"{i}.png")
    changed = accel_train_here("eval", str(run))
    said = changed.stdout + changed.stderr
    assert changed.returncode == 0
    assert "now gives 54 training and 6 validation images, where the run had 36 and 4: the " \
           "data changed since" in said, said


def test_the_first_images_of_a_sorted_folder_holding_one_class_are_said(tmp_path):
    """--sample-subset first, --max-train-samples 10 of a folder listed class by class: its first
    10 images are all of class a (15 of each); the run says so.  20 images hold both: nothing
    said."""
    data = image_folder(tmp_path / "data", {"train": 30, "val": 12, "test": 12})
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never", max_train_samples=10,
                                   max_eval_samples=4, sample_subset="first"))
    assert set(loaded.train.labels.tolist()) == {0}  # the oracle: what the folder lists first
    said = " ".join(loaded.warnings)
    assert ("--max-train-samples 10 keeps 10 training images (first), which hold 1 of the 2 "
            "classes (the data lists its images in order, an image folder class by class; "
            "--sample-subset random draws them from the whole split); its numbers say little "
            "of the others") in said
    assert "--max-eval-samples 4 keeps 4 validation images (first)" in said
    assert "--max-eval-samples 4 keeps 4 test images (first)" in said
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never", max_train_samples=20,
                                   sample_subset="first"))
    assert set(loaded.train.labels.tolist()) == {0, 1}
    assert not [w for w in loaded.warnings if "which hold" in w]
    # without a training limit the held-out ones are still looked at; 2 images of 2 classes
    # are enough to hold both
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never", max_eval_samples=2,
                                   sample_subset="first"))
    said = [w.split(",")[0] for w in loaded.warnings if "which hold" in w]
    assert said == ["--max-eval-samples 2 keeps 2 validation images (first)",
                    "--max-eval-samples 2 keeps 2 test images (first)"], loaded.warnings
    # a draw can hold fewer classes too (positions 2 and 11 of 30: both in a's 15)
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never", max_train_samples=2))
    assert set(loaded.train.labels.tolist()) == {0}
    assert ("--max-train-samples 2 keeps 2 training images (random), which hold 1 of the 2 "
            "classes (drawn at random from the whole split); its numbers say little of the "
            "others") in loaded.warnings


def test_a_limit_keeps_the_images_datasets_shuffle_keeps(tmp_path):
    """--max-train-samples 10 and --max-eval-samples 5 (--sample-subset random, the default) of a
    folder listed class by class keep, of each split, the images Hugging Face datasets' own
    image folder reader, shuffled with seed 0, puts first (its file names compared), in the
    folder's order; so both classes, nothing warned; the same for every --seed."""
    from datasets import load_dataset
    data = image_folder(tmp_path / "data", {"train": 30, "val": 12, "test": 12})
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never", max_train_samples=10,
                                   max_eval_samples=5))
    for source, split, count in ((loaded.train, "train", 10), (loaded.held_out, "val", 5),
                                 (loaded.test, "test", 5)):
        theirs = load_dataset("imagefolder", data_dir=str(data / split), split="train")
        files = [Path(image.filename).relative_to(data).as_posix()
                 for image in theirs.shuffle(seed=0).select(range(count))["image"]]
        ours = [source.name(i) for i in range(len(source))]
        assert sorted(ours) == sorted(files), (split, ours, files)
        assert ours == sorted(ours)  # the folder's order: class, then file
    assert set(loaded.train.labels.tolist()) == {0, 1} and loaded.sample_subset == "random"
    assert not [w for w in loaded.warnings if "which hold" in w]
    again = load_data(TrainConfig(data_dir=str(data), in_memory="never", max_train_samples=10,
                                  max_eval_samples=5, seed=7))
    assert [again.train.name(i) for i in range(10)] == \
        [loaded.train.name(i) for i in range(10)]


@pytest.mark.parametrize("length, limit", [(10, 3), (256, 64), (1000, 999), (50_000, 5_000)])
def test_kept_positions_are_the_rows_datasets_shuffle_puts_first(length, limit):
    """The positions a random limit keeps are, sorted, the rows that datasets' own
    Dataset.shuffle(seed=0).select(range(limit)) picks from a split of that length."""
    from accel_train.data.sample_limits import kept_positions
    stand_in = datasets.Dataset.from_dict({"row": np.arange(length)})
    theirs = stand_in.shuffle(seed=0).select(range(limit))["row"]
    assert kept_positions(length, limit, "random").tolist() == sorted(theirs)
    assert kept_positions(length, limit, "first").tolist() == list(range(limit))
    assert kept_positions(length, length, "random") is None


def test_eval_given_the_data_dir_splits_it_as_the_run_split_its_own(tmp_path):
    """eval RUN --data-dir DATA (the run's own folder found elsewhere, say): its validation
    split is carved with the run's --val-fraction (20% of 40: 8 images), not the default 10%,
    which would hold images the run trained on."""
    data = image_folder(tmp_path / "data", {"train": 40})
    run = tmp_path / "run"
    accel_train_here("--data-dir", str(data), *PINNED, "--model", "test_resnet", "--epochs", "1",
                     "--batch-size", "8", "--no-plots", "--val-fraction", "0.2",
                     "--output-dir", str(run), check=True)
    result = accel_train_here("eval", str(run), "--data-dir", str(data), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["count"] == 8


@pytest.mark.parametrize("splits, words", [
    ({"train": 10, "validation": 4, "test": 6}, "has a validation split (validation), which "
                                                "selects"),
    ({"train": 20}, "has no test split; part of train is held out for validation"),
])
def test_select_on_test_that_changes_nothing_is_said(tmp_path, splits, words):
    data = parquet_folder(tmp_path / "data", splits)
    loaded = load_data(TrainConfig(data_dir=str(data), in_memory="never", select_on_test=True))
    assert f"--select-on-test has no effect: {data} {words}" in loaded.warnings
    used = parquet_folder(tmp_path / "used", {"train": 10, "test": 6})
    loaded = load_data(TrainConfig(data_dir=str(used), in_memory="never", select_on_test=True))
    assert not [w for w in loaded.warnings if "--select-on-test" in w]
    assert len(loaded.held_out) == 6 and loaded.test is None


def test_a_carve_asked_of_data_with_its_own_validation_split_is_said_to_change_nothing(
        tmp_path):
    """--val-fraction and --val-stratify carve a validation split off train where the data has
    none; beside a val/ folder they went unread without a word, the run holding out val/ (its
    4 images, counted here) where the user asked for 30% of train.  A folder without val/ is
    carved as asked, and nothing is said."""
    data = image_folder(tmp_path / "data", {"train": 10, "val": 4})
    argv = ["--model", "test_resnet", "--max-steps", "1", "--batch-size", "4", "--progress",
            "log", "--no-plots", *PINNED, "--val-fraction", "0.3", "--val-stratify"]
    result = accel_train_here("--data-dir", str(data), *argv, "--output-dir",
                              str(tmp_path / "run"), check=True)
    said = [line for line in (result.stdout + result.stderr).splitlines()
            if "no effect" in line]
    assert said == [f"warning: --val-fraction 0.3 and --val-stratify have no effect: {data} has "
                    f"a validation split (validation), which the run holds out"], result.stdout
    assert "10 train / 4 validation images" in result.stdout
    carved = accel_train_here("--data-dir", str(data / "train"), *argv, "--output-dir",
                              str(tmp_path / "carved"), check=True)
    assert "no effect" not in carved.stdout + carved.stderr
    assert "7 train / 3 validation images" in carved.stdout  # ceil(10 x 0.3) held out


def test_eval_on_other_data_checks_its_classes_against_the_models(tmp_path):
    """Other data whose validation folder holds a class its own train/ lacks: training would
    refuse it in its words; eval checks the classes against the model's, and says that."""
    data = image_folder(tmp_path / "data", {"train": 20})
    run = tmp_path / "run"
    accel_train_here("--data-dir", str(data), *PINNED, "--model", "test_resnet", "--epochs", "1",
                     "--batch-size", "8", "--no-plots", "--output-dir", str(run), check=True)
    other = image_folder(tmp_path / "other", {"train": 4, "val": 4})
    (other / "val" / "b").rename(other / "val" / "c")
    result = accel_train_here("eval", str(run), "--data-dir", str(other))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "class(es) c are not among the model's 2 classes (a, b)" in lines[0], lines[0]


def test_eval_split_test_of_a_run_that_selected_on_its_test_split_names_held_out(tmp_path):
    data = parquet_folder(tmp_path / "data", {"train": 16, "test": 8})
    run = tmp_path / "run"
    accel_train_here("--data-dir", str(data), *PINNED, "--model", "test_resnet", "--epochs", "1",
                     "--batch-size", "8", "--no-plots", "--select-on-test", "--output-dir",
                     str(run), check=True)
    result = accel_train_here("eval", str(run), "--split", "test")
    assert result.returncode == 2 and "the run selected on its test split" in result.stderr
    assert result.stderr.strip().endswith("pass --split held-out"), result.stderr
    assert accel_train_here("eval", str(run), "--split", "held-out").returncode == 0


def test_eval_takes_data_whose_class_label_declares_names_no_image_has(tmp_path):
    """A parquet file whose ClassLabel lists a spare name beside the model's two: eval counts
    the images by the model's names (the spare one has none); a name that images have and the
    model lacks is still refused."""
    data = image_folder(tmp_path / "data", {"train": 20})
    run = tmp_path / "run"
    accel_train_here("--data-dir", str(data), *PINNED, "--model", "test_resnet", "--epochs", "1",
                     "--batch-size", "8", "--no-plots", "--output-dir", str(run), check=True)
    spare = datasets.Features({"image": datasets.Image(),
                               "label": datasets.ClassLabel(names=["a", "b", "spare"])})
    other = tmp_path / "other"
    other.mkdir()
    rows(8).cast(spare).to_parquet(str(other / "test.parquet"))
    rows(8, seed=1).cast(spare).to_parquet(str(other / "train.parquet"))
    result = accel_train_here("eval", str(run), "--data-dir", str(other), "--split", "test",
                              "--json")
    assert result.returncode == 0, result.stderr
    per_class = json.loads(result.stdout.splitlines()[-1])["per_class"]
    assert {name: c["images"] for name, c in per_class.items()} == {"a": 4, "b": 4}


def test_eval_names_the_first_unknown_classes_and_the_models_first_ten(tmp_path):
    """The words of align_labels' refusal: five unknown classes and how many more, the
    model's first ten and how many more (the lists cut as first_few cuts them)."""
    from accel_train.commands.eval import align_labels
    from accel_train.data.sources import ArraySource
    import torch
    model = [f"m{i:02d}" for i in range(12)]
    data = [f"d{i}" for i in range(7)]
    source = ArraySource(torch.zeros(7, 3, 4, 4, dtype=torch.uint8), torch.arange(7))
    with pytest.raises(UsageError) as raised:
        align_labels(source, data, model, "DATA")
    assert str(raised.value) == (
        "DATA: class(es) d0, d1, d2, d3, d4 and 2 more are not among the model's 12 classes "
        "(m00, m01, m02, m03, m04, m05, m06, m07, m08, m09 and 2 more); evaluate on data "
        "labelled with the model's class names")


def test_the_carved_rows_are_arrays_torch_takes_without_a_warning():
    """fit() indexes its labels with the carved rows through torch.from_numpy, which warns
    for read-only arrays (arrays over Arrow's buffers are): each run that held out part of
    its training set printed torch's warning."""
    for num_rows, fraction in ((8, 0.1), (9, 0.5), (50, 0.2), (3, 0.34)):
        parts = carve_rows(num_rows, fraction)
        assert all(part.flags.writeable for part in parts), (num_rows, fraction)
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(num_rows))


def datasets_own_carve(num_rows: int, fraction: float) -> tuple[list[int], list[int]]:
    """The oracle: datasets' train_test_split with the product's fixed seed, called here."""
    parts = datasets.Dataset.from_dict({"row": list(range(num_rows))}).train_test_split(
        test_size=fraction, seed=0, shuffle=True)
    return list(parts["train"]["row"]), list(parts["test"]["row"])


def test_a_class_the_draw_holds_out_whole_keeps_its_first_held_out_image_for_training():
    """83 rows: classes 0 and 1 of 40, class 2 of one image (row 80), class 3 of two (81, 82).
    At 0.68 datasets' draw holds out both of class 3's: the model would never train on it."""
    labels = np.array([0] * 40 + [1] * 40 + [2] + [3, 3])
    plain_train, plain_held = datasets_own_carve(83, 0.68)
    assert {81, 82} <= set(plain_held) and 80 in plain_train  # the premise
    back = next(row for row in plain_held if labels[row] == 3)  # the first held out, by order
    for given in (labels, torch.as_tensor(labels), labels.tolist()):  # fit()'s and the CLI's
        train, held = carve_rows(83, 0.68, given)
        assert train.tolist() == plain_train + [back]
        assert held.tolist() == [row for row in plain_held if row != back]
    # a draw that trains every class is datasets' own, as carve_rows without labels gives it
    train, held = carve_rows(83, 0.3, labels)
    assert (train.tolist(), held.tolist()) == datasets_own_carve(83, 0.3)
    assert set(labels[train]) == {0, 1, 2, 3}


def test_two_images_carve_into_one_of_each_and_one_is_refused():
    assert [part.tolist() for part in carve_rows(2, 0.5)] == \
        [list(part) for part in datasets_own_carve(2, 0.5)]
    with pytest.raises(UsageError) as refused:
        carve_rows(1, 0.5)
    assert str(refused.value) == ("the data has fewer than 2 images; nothing to hold out for "
                                  "evaluation")


def test_rows_with_no_class_stay_held_out_and_a_carve_of_only_classes_never_trained_is_refused():
    plain_train, plain_held = datasets_own_carve(4, 0.5)
    labels = np.array([0, 0, 0, 0])
    labels[plain_held] = -1  # unlabelled: no class to train
    train, held = carve_rows(4, 0.5, labels)
    assert (train.tolist(), held.tolist()) == (plain_train, plain_held)
    labels = np.array([0, 0, 0, 0])
    labels[plain_held] = [1, 2]  # each held-out image the only one of its class
    with pytest.raises(UsageError) as raised:
        carve_rows(4, 0.5, labels)
    assert str(raised.value) == (
        "--val-fraction holds out 2 image(s), each of a class with no other image to train on; "
        "give those classes more images, or a validation split of your own")


def test_an_image_folder_carve_trains_every_class_and_says_what_it_gave_back(tmp_path):
    """The folder read by datasets' own imagefolder builder is the oracle for which image is
    which row; the run's training images then hold all four classes."""
    counts = {"a": 40, "b": 40, "c": 1, "d": 2}
    for name, count in counts.items():
        for i in range(count):
            path = tmp_path / "data" / name / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8, 3), i, dtype=np.uint8)).save(path)
    read = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "data"), split="train")
    labels = np.array(read["label"])
    _, plain_held = datasets_own_carve(83, 0.68)
    d = read.features["label"].names.index("d")
    assert set(np.flatnonzero(labels == d)) <= set(plain_held)  # the premise: d held out whole
    data = load_data(TrainConfig(data_dir=str(tmp_path / "data"), val_fraction=0.68,
                                 in_memory="always"))
    assert sorted(set(data.train.labels.tolist())) == [0, 1, 2, 3]
    assert len(data.held_out) == math.ceil(83 * 0.68) - 1
    assert data.description.endswith(
        "(train minus 68% for validation; 1 held-out image(s) trained on instead: no other "
        "image of their class was left for training)"), data.description


def datasets_own_stratified_carve(labels: list[int], held_out: int) -> tuple[list, list]:
    """datasets' train_test_split(stratify_by_column=...) of rows labelled by a ClassLabel
    column, called here: what --val-stratify would draw had it taken datasets' split."""
    features = datasets.Features({"row": datasets.Value("int64"),
                                  "label": datasets.ClassLabel(num_classes=max(labels) + 1)})
    parts = datasets.Dataset.from_dict({"row": list(range(len(labels))), "label": labels},
                                       features=features).train_test_split(
        test_size=held_out, seed=0, shuffle=True, stratify_by_column="label")
    return list(parts["train"]["row"]), list(parts["test"]["row"])


def check_partition(train: np.ndarray, held: np.ndarray, num_rows: int) -> None:
    assert np.array_equal(np.sort(np.concatenate([train, held])), np.arange(num_rows))


def test_a_stratified_carve_holds_out_each_class_in_its_share():
    """100 images, 90 of class 0 and 10 of class 1, 20% held out: class by class exactly 18
    and 2 (by hand), drawn at random within each class (not its first rows), the same for
    labels given as strings; the random draw of the same rows holds out another balance."""
    labels = np.array([0] * 90 + [1] * 10)
    train, held = carve_rows(100, 0.2, labels, stratify=True)
    check_partition(train, held, 100)
    assert np.bincount(labels[held]).tolist() == [18, 2]
    assert held[:18].tolist() != list(range(18))
    assert np.bincount(labels[carve_rows(100, 0.2, labels)[1]]).tolist() != [18, 2]
    names = np.array(["cat", "dog"])[labels]
    assert carve_rows(100, 0.2, names, stratify=True)[1].tolist() == held.tolist()


def test_a_stratified_carve_holds_out_one_image_of_every_class_where_datasets_held_none():
    """Four classes of 24 images and one of 4, 0.2 held out: each share is 4.8 (0.8 for the
    rare class), every remainder 0.8.  datasets' own stratified split (called here) held out
    none of the rare class, so validation never measured it; --val-stratify holds out one of
    it, and 5, 5, 5, 4 of the others (by hand: 20 in all, the floors 4 and one each, three more
    to the ties at random)."""
    labels = np.array([0] * 24 + [1] * 24 + [2] * 24 + [3] * 24 + [4] * 4)
    _, datasets_held = datasets_own_stratified_carve(labels.tolist(), 20)
    assert np.bincount(labels[datasets_held], minlength=5)[4] == 0  # the premise
    train, held = carve_rows(100, 0.2, labels, stratify=True)
    check_partition(train, held, 100)
    counts = np.bincount(labels[held], minlength=5)
    assert counts[4] == 1 and sorted(counts[:4].tolist()) == [4, 5, 5, 5]
    assert (np.bincount(labels[train]) >= 1).all()


@pytest.mark.parametrize("counts, held_out, expected", [
    ([1000] + [2] * 100, 120, [20] + [1] * 100),  # one each first: the large class gives way
    ([2, 2, 2, 2, 50], 10, [1, 1, 1, 1, 6]),      # shares 0.34 and 8.6: 1s and 8 are 12, 2 too many
    ([3, 3, 3], 6, [2, 2, 2]),                    # all but one of each
    ([7, 3], 2, [1, 1]),                          # the fewest that holds one of each
    ([11, 9], 4, [2, 2]),                         # shares 2.2, 1.8: the larger remainder gains
    ([30, 3, 3, 3], 6, [3, 1, 1, 1]),             # shares 4.6, 0.46: only 4 can give one back
    ([10, 3, 3, 3], 4, [1, 1, 1, 1]),             # shares 2.1, 0.63: 2 gives back to one
    ([12, 9, 2, 2, 2], 6, [2, 1, 1, 1, 1]),       # shares 2.67, 2.0: 2.0's is the furthest above
    ([2, 20], 20, [1, 19])])                      # shares 1.82, 18.2: the 2 keeps one to train
def test_held_out_counts_keep_one_of_each_class_on_both_sides(counts, held_out, expected):
    """By hand: each class holds out one at least and keeps one at least; the rest by share."""
    from accel_train.data.carve import held_out_counts
    taken = held_out_counts(np.array(counts), held_out, np.random.default_rng(0))
    assert taken.tolist() == expected


def test_a_stratified_carve_trains_a_class_of_one_and_draws_the_others_class_by_class():
    """26 images: class a 20, b 5, c 1 (the last row).  ceil(26 x 0.2) = 6 are held out, drawn
    from the 25 of a and b by class (shares 4.8 and 1.2 of 6: 5 and 1 by hand, the larger
    remainder gaining); c's one image trains (it cannot be both).  With a class d of two
    more: 28 images, 6 held out, shares 4.4, 1.1 and 0.44 of the 27 of a, b and d: 4, 1, 1."""
    labels = np.array(["a"] * 20 + ["b"] * 5 + ["c"])
    train, held = carve_rows(26, 0.2, labels, stratify=True)
    check_partition(train, held, 26)
    assert 25 in train.tolist()
    assert sorted(labels[held].tolist()) == ["a"] * 5 + ["b"]
    labels = np.append(labels, ["d", "d"])
    train, held = carve_rows(28, 0.2, labels, stratify=True)
    check_partition(train, held, 28)
    assert sorted(labels[held].tolist()) == ["a"] * 4 + ["b", "d"]


def test_the_rows_a_stratified_carve_holds_out_stay_the_same():
    """Pinned rows: `accel-train eval` and a resume of a run carve its held-out images again,
    in later versions too, so the draw (rows by class in order, a fixed seed) must not move."""
    labels = np.array([0, 1] * 10 + [2] * 5)
    assert carve_rows(25, 0.2, labels, stratify=True)[1].tolist() == [5, 8, 12, 19, 20]


@pytest.mark.parametrize("fraction, said", [
    (0.02, "--val-stratify: --val-fraction 0.02 holds out 1 image(s), fewer than the 5 classes "
           "with two or more images, and a stratified carve holds out one of each; use "
           "--val-fraction 0.193 or more, or drop --val-stratify"),
    (0.9, "--val-stratify: --val-fraction 0.9 holds out 24 of the 25 images of classes with two "
          "or more images, leaving fewer than one of each of their 5 classes to train on; "
          "choose a smaller fraction")])
def test_a_stratified_carve_that_cannot_hold_one_of_each_class_is_refused(fraction, said):
    """5 classes of 5 images and one of 1: 26 images.  0.193 (the fraction named) holds out
    ceil(5.018) = 6 >= 5, and is taken."""
    labels = np.array([0, 1, 2, 3, 4] * 5 + [9])
    with pytest.raises(UsageError) as refused:
        carve_rows(26, fraction, labels, stratify=True)
    assert str(refused.value) == said
    _, held = carve_rows(26, 0.193, labels, stratify=True)
    assert len(held) == 6 and set(labels[held].tolist()) == {0, 1, 2, 3, 4}
    # at both edges: one held-out image of each class, and one left of each to train on
    labels = np.array([0, 1, 2, 3, 4] * 5)
    _, held = carve_rows(25, 0.2, labels, stratify=True)
    assert sorted(labels[held].tolist()) == [0, 1, 2, 3, 4]
    train, _ = carve_rows(25, 0.8, labels, stratify=True)
    assert sorted(labels[train].tolist()) == [0, 1, 2, 3, 4]


def test_an_image_folder_carved_class_by_class_says_so_and_records_how(tmp_path):
    """--val-stratify through load_data with a whole TrainConfig: the held-out images of a
    folder of 45 + 5 images at 0.2 are 9 and 1 (by hand); the start says how it carved, and
    the run records it for a resume; a folder with its own val/ carves nothing."""
    for name, count in (("common", 45), ("rare", 5)):
        for i in range(count):
            path = tmp_path / "data" / name / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8, 3), i, dtype=np.uint8)).save(path)
    data = load_data(TrainConfig(data_dir=str(tmp_path / "data"), val_fraction=0.2,
                                 val_stratify=True, in_memory="always"))
    assert np.bincount(data.held_out.labels.numpy()).tolist() == [9, 1]
    assert data.description.endswith(
        "(train minus 20% for validation, class by class (--val-stratify))"), data.description
    assert data.held_out_carve == "stratified"
    assert load_data(TrainConfig(data_dir=str(tmp_path / "data"), val_fraction=0.2,
                                 in_memory="always")).held_out_carve == "random"
    split = image_folder(tmp_path / "split", {"train": 8, "val": 4})
    assert load_data(TrainConfig(data_dir=str(split), val_stratify=True)).held_out_carve is None


@pytest.mark.slow
def test_a_stratified_run_is_evaluated_and_resumed_on_the_images_it_carved(tmp_path):
    """45 + 5 images at 0.2: the random draw holds out none of the rare class (10 + 0: its
    premise, from load_data), --val-stratify 9 + 1 (by hand).  The run records how it carved:
    `accel-train eval` of it counts 9 and 1, and a resume without the flag (other images, as
    many) is refused in one line, nothing written; with it, it goes on."""
    for name, count in (("common", 45), ("rare", 5)):
        for i in range(count):
            path = tmp_path / "data" / name / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8, 3), 5 * i, dtype=np.uint8)).save(path)
    data_dir = str(tmp_path / "data")
    randomly = load_data(TrainConfig(data_dir=data_dir, val_fraction=0.2, in_memory="always"))
    assert np.bincount(randomly.held_out.labels.numpy(), minlength=2).tolist() == [10, 0]
    run = tmp_path / "run"
    flags = ["--data-dir", data_dir, "--val-fraction", "0.2", "--model", "test_resnet",
             "--batch-size", "8", "--output-dir", str(run), "--no-plots", "--progress", "log",
             *PINNED]
    accel_train_here(*flags, "--val-stratify", "--max-steps", "2", check=True)
    evaluated = json.loads(accel_train_here("eval", str(run), "--json", check=True).stdout)
    assert {name: counts["images"] for name, counts in evaluated["per_class"].items()} == \
        {"common": 9, "rare": 1}, evaluated
    assert evaluated["data"].endswith("class by class (--val-stratify))"), evaluated
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    refused = accel_train_here(*flags, "--max-steps", "4", "--resume", "auto")
    # the refusal, then the two options that differ (tests/test_resume_options.py)
    assert refused.returncode == 2 and refused.stderr.strip().split("; this start sets ")[0] == (
        "accel_train: error: the checkpoint's run carved its validation images class by class, "
        "this start by one random draw: they are other images; resume with --val-stratify, or "
        "start a new run"), refused.stderr
    assert "--val-stratify off (the run: on), --max-steps 4 (the run: 2)" in refused.stderr
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == files
    accel_train_here(*flags, "--val-stratify", "--max-steps", "4", "--resume", "auto",
                     check=True)


def test_a_local_folder_given_as_dataset_names_data_dir(tmp_path, monkeypatch):
    """--dataset takes a hub id; datasets reads a local folder with its own loaders, and where
    they fail the line said only that the hub could not be reached."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "photos").mkdir()
    result = accel_train_here("--dataset", "photos", "--model", "test_resnet", "--output-dir",
                              str(tmp_path / "run"))
    assert result.returncode == 2 and result.stderr.startswith(
        "accel_train: error: --dataset photos is a local folder, which Hugging Face datasets' "
        "loader could not read (") and result.stderr.endswith(
        "); pass it as --data-dir photos (--dataset takes a hub id)\n"), result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_eval_reads_a_run_that_recorded_image_folder_options_on_labelled_data(tmp_path,
                                                                           layout):
    """Runs from before those options were refused on data with a label column recorded them
    (unread: they trained on the column); eval of such a run reads its data as it trained, and
    gives what eval of the same run without them gives."""
    import yaml
    data = LAYOUTS[layout](tmp_path / "data", {"train": 16, "validation": 8})
    run = tmp_path / "run"
    accel_train_here("--data-dir", str(data), *PINNED, "--model", "test_resnet", "--epochs",
                     "1", "--batch-size", "8", "--no-plots", "--output-dir", str(run),
                     check=True)
    before = accel_train_here("eval", str(run), "--json")
    assert before.returncode == 0, before.stderr
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    recorded["train"].update(val_labels=str(tmp_path / "labels.csv"), class_depth=1)
    (run / "config.yaml").write_text(yaml.safe_dump(recorded))
    after = accel_train_here("eval", str(run), "--json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout.splitlines()[-1]) == json.loads(before.stdout.splitlines()[-1])
