"""Broken images never end a run: each is replaced by a deterministic substitute, named once
for all ranks and loader workers, listed in <run>/bad_images.txt and counted; or, with
--bad-images error, the run stops at once naming it.  Real processes and launchers throughout.

Oracles: the broken files this test wrote (every one must be named, once); a run decoded once in
memory against the same run decoded per step by loader workers (the substitutes are the same
function of the index, so the weights are identical); an uninterrupted run against one stopped
by SIGTERM and resumed (identical weights); for the names of parquet rows, pyarrow reading the
named file and row back.
"""

from __future__ import annotations

import json
import shutil
import signal

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

import imagekinds as kinds
from accel_train.config import TrainConfig
from accel_train.base.errors import UsageError
from accel_train.data.sources import load_data
from conftest import PINNED, accel_train_here, accel_train
from faults import (Run, checkpoint_steps, max_weight_difference, metrics, python_cmd,
                    torchrun_cmd, wait_until)

# 46 good + 2 broken images per class: 96 training images, a whole number of global batches of
# 8 (one process) and 16 (two), so every image is used in every epoch.
TRAIN = ["--model", "test_resnet", "--batch-size", "8", "--epochs", "2", "--log-every", "2",
         "--progress", "log", "--no-plots", *PINNED]
PER_STEP = ["--in-memory", "never", "--num-workers", "2"]


@pytest.fixture(scope="module")
def broken_folder(tmp_path_factory):
    """An image folder with broken files of four kinds deep inside the training split and one
    in the held-out split; returns (folder, {name relative to it: words of the reason})."""
    root = kinds.write_folder(tmp_path_factory.mktemp("broken"), per_class=46, held_out=4)
    files = kinds.broken_files()
    expected = {}
    for i, name in enumerate(["truncated.jpg", "empty.jpg", "page.jpg", "truncated.png"]):
        relative = f"train/{('ant', 'bee')[i % 2]}/0{20 + i}_{name}"
        (root / relative).write_bytes(files[name][0])
        expected[relative] = files[name][1]
    (root / "val/bee/002_garbage.png").write_bytes(files["garbage.png"][0])
    expected["val/bee/002_garbage.png"] = files["garbage.png"][1]
    return root, expected



def assert_named_once(output: str, out, expected: dict) -> None:
    """Every broken file said once on the console, listed once with its reason, counted."""
    for name in expected:
        said = output.count(f"image {name} cannot be decoded")
        assert said == 1, f"{name} said {said} times\n{output[-4000:]}"
    listed = dict(line.split("\t") for line in (out / "bad_images.txt").read_text().splitlines())
    assert listed.keys() == expected.keys() and len(listed) == len(
        (out / "bad_images.txt").read_text().splitlines())
    for name, words in expected.items():
        assert words in listed[name], (name, listed[name])
    epochs = [r for r in metrics(out) if r["type"] == "epoch"]
    assert [r["bad_images"] for r in epochs][-1] == len(expected)
    assert f"{len(expected)} broken image(s) replaced by substitutes in training" in output


@pytest.mark.slow
def test_one_process_finishes_naming_each_broken_file_in_memory_and_per_step(
        tmp_path, runs, broken_folder):
    data, expected = broken_folder
    memory, per_step = tmp_path / "memory", tmp_path / "per_step"
    first = Run(python_cmd("--data-dir", str(data), *TRAIN, "--output-dir", str(memory)),
                tmp_path / "memory.log")
    runs.append(first)
    second = Run(python_cmd("--data-dir", str(data), *TRAIN, *PER_STEP, "--output-dir",
                            str(per_step)), tmp_path / "per_step.log")
    runs.append(second)
    for run, out, in_memory in ((first, memory, True), (second, per_step, False)):
        output = run.check()
        assert ("decoded in memory" if in_memory else "decoded per step, 2 loader") in output
        assert_named_once(output, out, expected)
    # The same substitutes (the next index that decodes, with its label), found while loading
    # or by loader workers mid-epoch: the same training, to the bit.
    assert max_weight_difference(memory, per_step) == 0.0


@pytest.mark.slow
def test_two_processes_meet_broken_files_mid_epoch_and_finish(tmp_path, runs, broken_folder):
    """Each rank's loader workers meet some of the broken files; rank 0 names them all once."""
    data, expected = broken_folder
    out = tmp_path / "run"
    run = Run(torchrun_cmd("--data-dir", str(data), *TRAIN, "--in-memory", "never",
                           "--num-workers", "1", "--output-dir", str(out)), tmp_path / "run.log")
    runs.append(run)
    assert_named_once(run.check(), out, expected)
    logs = [(out / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert all(f"image {name} cannot be decoded" in logs[0] for name in expected)


@pytest.mark.slow
def test_stopped_and_resumed_with_broken_files_is_bit_identical(tmp_path, runs, broken_folder):
    data, expected = broken_folder
    command = ["--data-dir", str(data), *TRAIN, *PER_STEP, "--checkpoint-every", "3",
               "--keep-checkpoints", "10"]
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    runs.append(Run(python_cmd(*command, "--output-dir", str(reference)),
                    tmp_path / "reference.log"))
    victim = Run(python_cmd(*command, "--output-dir", str(stopped)), tmp_path / "stopped.log")
    runs.append(victim)
    wait_until(lambda: 3 in checkpoint_steps(stopped), "the checkpoint of step 3", victim)
    victim.proc.send_signal(signal.SIGTERM)
    first_output = victim.check(expected=143)
    stop = int(first_output.split("stopped by a signal at step ")[1].split(":")[0])
    assert 3 <= stop < 12, "stopped mid-epoch 1"
    resumed = Run(python_cmd(*command, "--output-dir", str(stopped), "--resume", "auto"),
                  tmp_path / "resumed.log")
    runs.append(resumed)
    output = resumed.check()
    assert f"resumed from {stopped}/checkpoints/step_{stop:08d}" in output
    assert_named_once(runs[0].check(), reference, expected)
    # Named once over both starts: what the first start listed is not said again.
    for name in expected:
        assert (first_output + output).count(f"image {name} cannot be decoded") == 1, name
    assert max_weight_difference(reference, stopped) == 0.0
    assert_named_once(first_output + output, stopped, expected)


def test_bad_images_error_stops_naming_the_file(tmp_path, broken_folder):
    """Decoded in memory, the first broken file stops the start: one line, nothing written."""
    data, expected = broken_folder
    out = tmp_path / "run"
    result = accel_train_here("--data-dir", str(data), *TRAIN, "--bad-images", "error",
                              "--output-dir", str(out))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("accel_train: error: image train/")
    name = lines[0].split("image ", 1)[1].split(" cannot be decoded")[0]
    assert name in expected and "remove or replace that file" in lines[0]
    assert not out.exists()


# -- names of rows in parquet and save_to_disk data ---------------------------------------------
def _rows(count: int, broken: set[int]) -> dict:
    return {"image": [{"bytes": kinds.HTML if i in broken else
                       kinds.encoded(kinds.pixels(i, 8, 8), "PNG"), "path": None}
                      for i in range(count)],
            "label": [i % 2 for i in range(count)]}


def _dataset(rows: dict) -> datasets.Dataset:
    return datasets.Dataset.from_dict(rows, features=datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["ant", "bee"])}))


def _bad_names(data) -> set[str]:
    return {bad.name for source in (data.train, data.held_out)
            for bad in (source.bad_image(i) for i in range(len(source))) if bad is not None}


def test_parquet_rows_are_named_by_file_and_row_also_after_carving(tmp_path):
    """Two training shards (datasets concatenates them) and no held-out split: the held-out
    rows are carved off at random, yet every broken row is named by its own file and row."""
    shards = [(8, {1, 7}), (9, {0, 8})]  # (rows, broken rows) per file
    for shard, (count, rows) in enumerate(shards):
        _dataset(_rows(count, rows)).to_parquet(str(tmp_path / f"train-0000{shard}-of-00002"
                                                             f".parquet"))
    expected = {f"train-0000{shard}-of-00002.parquet row {row}"
                for shard, (_, rows) in enumerate(shards) for row in rows}
    data = load_data(TrainConfig(data_dir=str(tmp_path), in_memory="never", val_fraction=0.25))
    assert len(data.held_out) == 5 and _bad_names(data) == expected
    for name in expected:  # the oracle: the named file and row hold the broken bytes
        file, row = name.split(" row ")
        value = pq.read_table(tmp_path / file).column("image")[int(row)].as_py()
        assert value["bytes"] == kinds.HTML
    carved = load_data(TrainConfig(data_dir=str(tmp_path), val_fraction=0.25))  # in memory
    assert {bad.name for bad in carved.bad_images} == expected


def test_save_to_disk_rows_are_named_by_folder_split_and_row(tmp_path):
    folder = tmp_path / "saved"
    datasets.DatasetDict(train=_dataset(_rows(6, {4})),
                         validation=_dataset(_rows(4, {1}))).save_to_disk(str(folder))
    data = load_data(TrainConfig(data_dir=str(folder), in_memory="never"))
    assert _bad_names(data) == {f"{folder} split 'train' row 4",
                                f"{folder} split 'validation' row 1"}
    with pytest.raises(UsageError, match=f"image {folder} split 'train' row 4 cannot be decoded"):
        load_data(TrainConfig(data_dir=str(folder), bad_images="error"))


@pytest.mark.parametrize("in_memory", ["never", "always"])
@pytest.mark.slow
def test_a_broken_test_image_is_named_and_left_out_of_the_test_numbers(tmp_path, broken_folder,
                                                                        in_memory):
    """A broken file in the test split, decoded per step or into memory: named once by its own
    path (its marks were looked up in the validation split), and the test split's one
    evaluation counts the images that decode, not the substitute in the broken one's place."""
    data, _ = broken_folder
    folder = tmp_path / "data"
    shutil.copytree(data / "val", folder / "train")  # small: 9 images, one of them broken
    shutil.copytree(data / "val", folder / "val")
    shutil.copytree(data / "val", folder / "test")
    for split in ("train", "val"):
        (folder / split / "bee" / "002_garbage.png").unlink()
    result = accel_train_here("--data-dir", str(folder), *TRAIN, "--epochs", "1",
                              "--in-memory", in_memory, "--output-dir", str(tmp_path / "run"))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert output.count("image test/bee/002_garbage.png cannot be decoded") == 1, output[-3000:]
    assert "(8 images of the test split, evaluated once" in output, output[-3000:]


@pytest.mark.slow
def test_eval_names_a_broken_held_out_image(tmp_path, broken_folder):
    data, _ = broken_folder
    out = tmp_path / "run"
    accel_train_here("--data-dir", str(data), *TRAIN, "--epochs", "1", "--output-dir", str(out),
                     check=True)
    result = accel_train("eval", str(out), check=True)  # a new process: its warnings alone
    assert result.stderr.count("warning: image val/bee/002_garbage.png cannot be decoded "
                               "(not an image") == 1, result.stderr[-3000:]
    # the broken one is left out (its substitute, another image, was counted in its place)
    assert "(8 images; 1 that could not be decoded left out)" in result.stdout, result.stdout
    measured = json.loads(accel_train_here("eval", str(out), "--json").stdout.splitlines()[-1])
    on_disk = {name: len([f for f in (data / "val" / name).iterdir()
                          if f.name != "002_garbage.png"]) for name in ("ant", "bee")}
    assert {name: c["images"] for name, c in measured["per_class"].items()} == on_disk
    assert measured["count"] == sum(on_disk.values()) and measured["left_out"] == 1
    # the run's own evaluation counted the same images
    assert [r for r in metrics(out) if r["type"] == "epoch"][-1]["eval_count"] == measured["count"]


def test_the_classes_none_of_whose_images_decode_are_named_with_their_counts():
    """Counted by hand: class 0 like any other, an unlabelled image (-1) in no class, one image
    said in the singular; a class with one image that decodes is not named."""
    import torch
    from accel_train.data.labels import unreadable_classes_named
    labels, names = torch.tensor([0, 0, 0, 1, 1, -1, 2]), ["a", "b", "c"]
    assert unreadable_classes_named(labels, [0, 1, 2, 5], names) == "'a' (3 images)"
    assert unreadable_classes_named(labels, [5, 3, 6, 4], names) == \
        "'b' (2 images), 'c' (1 image)"
    assert unreadable_classes_named(labels, [0, 1, 3], names) == ""


@pytest.mark.slow
def test_a_class_none_of_whose_training_images_decodes_is_refused_and_checked(tmp_path):
    """Class b's three files are all empty: decoded into memory, the run refuses in one line
    (it trained b's output on substitutes of class a, and scored 100%); check-data says so."""
    folder = tmp_path / "data"
    for i in range(12):
        path = folder / "a" / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((16, 16, 3), 10 * i, dtype=np.uint8)).save(path)
    (folder / "b").mkdir()
    for i in range(3):
        (folder / "b" / f"{i}.jpg").write_bytes(b"")
    result = accel_train_here("--data-dir", str(folder), *TRAIN, "--batch-size", "4",
                              "--output-dir", str(tmp_path / "run"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "no training image of class 'b' (3 images) can be decoded" in lines[0]
    checked = accel_train_here("check-data", "--data-dir", str(folder), "--json")
    findings = json.loads(checked.stdout)
    assert checked.returncode == 1
    assert findings["classes_without_a_readable_training_image"] == ["b"]
    # decoded per step, the run meets them as it goes: said once an epoch's end has seen
    # each of them replaced, and again in the closing summary
    per_step = accel_train_here("--data-dir", str(folder), *TRAIN, "--batch-size", "4",
                                "--in-memory", "never", "--epochs", "3",
                                "--output-dir", str(tmp_path / "per_step"))
    assert per_step.returncode == 0, per_step.stderr
    said = [line for line in (per_step.stdout + per_step.stderr).splitlines()
            if line.startswith("warning: no training image of class")]
    assert len(said) == 1, per_step.stdout + per_step.stderr
    assert said[0].startswith("warning: no training image of class 'b' (3 images) decodes (each "
                              "was met and replaced): the run trains those outputs on "
                              "substitutes"), said
    assert "(no training image of class 'b' (3 images) decoded)" in \
        per_step.stdout + per_step.stderr
    # one of b's images decodes: nothing said
    Image.fromarray(np.full((16, 16, 3), 200, dtype=np.uint8)).save(folder / "b" / "0.jpg")
    one_good = accel_train_here("--data-dir", str(folder), *TRAIN, "--batch-size", "4",
                                "--in-memory", "never", "--output-dir", str(tmp_path / "one"))
    assert one_good.returncode == 0 and "no training image of class" not in \
        one_good.stdout + one_good.stderr, one_good.stderr


def test_in_memory_always_says_why_the_images_cannot_be_held(tmp_path):
    folder = tmp_path / "data"
    for i, size in enumerate([16] * 10 + [24]):
        path = folder / "ab"[i % 2] / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros((size, size, 3), dtype=np.uint8)).save(path)
    result = accel_train_here("--data-dir", str(folder), *TRAIN, "--batch-size", "4",
                              "--in-memory", "always", "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "its train images differ in size (16x16 and 24x24, height x width)" in \
        result.stderr, result.stderr


def test_streamed_class_counts_name_a_class_only_after_an_epoch_that_met_every_sample():
    """StreamCounts by hand: 6 training samples; class 2's two (indices 0 and 8) are broken, so
    the batches carry substitutes' labels in their places (replaced >= 0).  Epochs that met 5 of
    the 6 (a resumed start, samples left out) decide nothing, however many of them; the first
    whole epoch names class 2 with its 2 samples; a later whole epoch in which one of class 2's
    samples decoded names nothing.  Two ranks' counts are summed."""
    import torch

    from accel_train.data.badimages import StreamCounts

    def counts_of_broken() -> StreamCounts:
        counts = StreamCounts(3)
        counts.broken.update({0: 2, 8: 2})
        return counts

    rank_batches = (torch.tensor([0, 1, 0]), torch.tensor([-1, -1, 0])), \
        (torch.tensor([1, 0, 1]), torch.tensor([-1, 8, -1]))

    def epoch(counts: StreamCounts, batches) -> list:
        for labels, replaced in batches:
            counts.add(labels, replaced)
            counts.merge([counts.take()])  # one rank's take per collect
        return counts.lost_in_epoch(6)

    assert epoch(counts_of_broken(), rank_batches) == [(2, 2)]  # the first epoch, whole
    counts = counts_of_broken()
    partial = [(labels[:-1] if n else labels, replaced[:-1] if n else replaced)
               for n, (labels, replaced) in enumerate(rank_batches)]  # 5 samples
    assert epoch(counts, partial) == [] and epoch(counts, partial) == []
    assert epoch(counts, rank_batches) == [(2, 2)]
    # one of class 2's samples decoded this time: counted for class 2
    assert epoch(counts, [(torch.tensor([0, 1, 2]), torch.tensor([-1, -1, -1])),
                          rank_batches[1]]) == []
    # two ranks at one collect: their counts summed
    for labels, replaced in rank_batches:
        counts.add(labels, replaced)
    # decoded: class 0 once (the first batch's first), class 1 three times; the replaced count
    # for none (sample 0 among them: a mark of 0 is a replaced sample)
    assert counts.take() == (6, [1, 3, 0]) and counts.take() == (0, [0, 0, 0])
    counts.merge([(3, [1, 1, 0]), (3, [1, 1, 0])])
    assert counts.lost_in_epoch(6) == [(2, 2)]
