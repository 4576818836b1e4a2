"""Every option of every command has a row in tests/option_table.py saying which test checks its
effect through the command line (or the function the command line calls) against an independent
expectation, or why none can cheaply: the first tests below fail when an option has no row, when
a row names a test that does not exist, or a test module that never passes the option.

The rest are the effect checks the table needed that no other module had, and the combinations
people use (checkpoint folder x pruning, resume forms, time budget x EMA x TTA x max-steps,
layout options given alike to training, check-data, eval and shard).  Each is one tiny
in-process run whose expectation is computed here by hand.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from accel_train.data import synthetic
from accel_train.run.checkpoint import verify

from conftest import REPO, TINY_TRAIN, accel_train_here, model_spec_of
from faults import metrics
from option_table import ROWS, all_options, spellings

TESTS = REPO / "tests"
# a budget sets the run's length in place of --epochs (the two together are refused)
TINY_BUDGET = [a for a in TINY_TRAIN if a not in ("--epochs", "1")]


# -- the table ------------------------------------------------------------------------------------

def test_every_option_has_a_row_and_every_row_an_option():
    options = all_options()
    missing = sorted(set(options) - set(ROWS))
    stale = sorted(set(ROWS) - set(options))
    assert not missing, f"options without a row in tests/option_table.py: {missing}"
    assert not stale, f"rows for options that no longer exist: {stale}"


@functools.cache  # a test file is named by many rows: read and parsed once
def _test_source(path: Path) -> str:
    return path.read_text()


@functools.cache
def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(_test_source(path))
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test_")}


@pytest.mark.parametrize("option", sorted(ROWS))
def test_each_row_names_a_real_test_that_passes_the_option(option):
    row = ROWS[option]
    if row.test is None:
        assert len(row.why.split()) >= 6, f"{option}: say why it cannot be checked cheaply"
        return
    file, _, function = row.test.partition("::")
    path = TESTS / file
    assert path.is_file(), f"{option}: {file} does not exist"
    assert function.split("[")[0] in _test_functions(path), f"{option}: no {row.test}"
    source = _test_source(path)
    names = spellings(option, all_options()[option])
    if names:  # (a positional argument has no spelling to look for)
        # (a flag must not be the start of a longer one: --mixup is not --mixup-prob)
        assert any(re.search(re.escape(name) + (r"(?![\w-])" if name[-1].isalnum() else ""),
                             source) for name in names), \
            f"{option}: {file} never passes it (looked for {names})"
    assert len(row.checks.split()) >= 4, f"{option}: say what the test compares with"


# -- checkpoints: where they go, how many are kept, the best ones --------------------------------

def _steps(folder: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in folder.glob("step_*"))


def test_checkpoint_folder_keep_checkpoints_and_keep_best(tmp_path):
    """3 epochs of 4 steps, a checkpoint every step, into --checkpoint: the newest 2 are kept,
    and the 2 with the best held-out top-1 among those saved at epoch ends (steps 4, 8, 12)."""
    out, folder = tmp_path / "run", tmp_path / "elsewhere"
    accel_train_here(*TINY_TRAIN, "--synthetic-train-size", "64", "--epochs", "3",
                     "--checkpoint-every", "1", "--keep-checkpoints", "2", "--keep-best", "2",
                     "--checkpoint", str(folder), "--output-dir", str(out), check=True)
    assert not (out / "checkpoints").exists()
    kept = _steps(folder)
    assert all(verify(folder / f"step_{s:08d}") is None for s in kept)
    top1 = {r["step"]: r["eval_top1"] for r in metrics(out) if r["type"] == "epoch"}
    assert sorted(top1) == [4, 8, 12]
    best = set(kept) - {11, 12}
    assert {11, 12} <= set(kept) and best <= {4, 8}
    # the best two of the three evaluated saves, 12 among them or not (ties: any of the tied)
    ranked = sorted(top1, key=top1.get, reverse=True)
    cutoff = top1[ranked[1]]
    assert len(best | ({12} if top1[12] >= cutoff else set())) == 2
    assert all(top1[s] >= cutoff for s in best)


def test_checkpoint_minutes_skips_epoch_ends_but_the_last_the_steps_and_new_bests(tmp_path):
    """4 epochs of 4 steps, --checkpoint-minutes 60 (no epoch end is an hour after the last
    save), which the start's summary says: with --checkpoint-every 3 the saves are its steps
    (3, 6, 9, 15: 12 is an epoch's last) and the last step, no other epoch end, and the final
    weights equal those of a run saving at every epoch end (saving draws nothing).  With
    --keep-best 1: the last step and each epoch end whose held-out top-1 beat every one before
    it (metrics.jsonl's, ranked here), on a run whose weights barely move (a learning rate of
    1e-9, the backbone's BatchNorm statistics frozen), so that the later evaluations tie the
    first and skip."""
    short = [*TINY_TRAIN, "--synthetic-train-size", "64", "--epochs", "4",
             "--keep-checkpoints", "20"]
    runs = {"every": ["--checkpoint-every", "3", "--checkpoint-minutes", "60"], "default": [],
            "best": ["--keep-best", "1", "--checkpoint-minutes", "60", "--learning-rate", "1e-9",
                     "--freeze-backbone"]}
    said = {name: accel_train_here(*short, *extra, "--output-dir", str(tmp_path / name),
                                   check=True).stdout for name, extra in runs.items()}
    assert "checkpoints; at an epoch end once 60 min have passed since the last, and at the " \
        "end)" in said["every"]
    assert "min have passed" not in said["default"]
    assert _steps(tmp_path / "every" / "checkpoints") == [3, 6, 9, 15, 16]
    assert _steps(tmp_path / "default" / "checkpoints") == [4, 8, 12, 16]
    every, default = (load_file(str(tmp_path / name / "model.safetensors"))
                      for name in ("every", "default"))
    assert all(torch.equal(every[k], default[k]) for k in default)
    top1 = [(r["step"], r["eval_top1"]) for r in metrics(tmp_path / "best")
            if r["type"] == "epoch"]
    assert [step for step, _ in top1] == [4, 8, 12, 16]
    new_bests = {step for i, (step, value) in enumerate(top1)
                 if all(value > before for _, before in top1[:i])}
    assert new_bests == {4}
    assert _steps(tmp_path / "best" / "checkpoints") == [4, 16]


def test_eval_metric_loss_picks_the_kept_checkpoint_the_weights_and_the_best(tmp_path):
    """--eval-metric loss with --model-ema: the checkpoint kept as the best is the epoch end
    whose lower loss (raw or EMA) is the lowest, model.safetensors holds the weights of the
    lower loss at the end, the last line names the lowest loss; the oracle is metrics.jsonl's
    numbers, ranked here.  A resume picking by top-1 is refused in one line, nothing touched."""
    out = tmp_path / "run"
    argv = [*TINY_TRAIN, "--synthetic-train-size", "64", "--epochs", "3", "--model-ema",
            "--model-ema-decay", "0.5", "--checkpoint-every", "1", "--keep-checkpoints", "1",
            "--keep-best", "1", "--output-dir", str(out)]
    result = accel_train_here(*argv, "--eval-metric", "loss", check=True)
    epochs = [r for r in metrics(out) if r["type"] == "epoch"]
    lowest = {r["step"]: min(r["eval_loss"], r["eval_ema_loss"]) for r in epochs}
    best_step = min(lowest, key=lowest.get)
    assert set(_steps(out / "checkpoints")) == {12, best_step}
    last = epochs[-1]
    assert model_spec_of(out)["weights"] == ("ema" if last["eval_ema_loss"] < last["eval_loss"]
                                             else "model")
    assert f"best held-out loss {min(lowest.values()):.4f}; next:" in result.stdout
    for record in epochs:  # the averages' loss on each epoch's line, as the metric picks by it
        assert f"EMA top1 {record['eval_ema_top1']:.2%} loss {record['eval_ema_loss']:.4f}" \
            in result.stdout
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    refused = accel_train_here(*argv, "--resume", "auto")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "accel_train: error: the checkpoint's run picked its best checkpoints and weights by "
        "--eval-metric loss, this start by top1; resume with --eval-metric loss, or start a new "
        "run"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_eval_metric_mean_class_top1_on_each_epoch_line_and_the_last(tmp_path):
    out = tmp_path / "run"
    result = accel_train_here(*TINY_TRAIN, "--synthetic-train-size", "64", "--epochs", "2",
                              "--eval-metric", "mean_class_top1", "--output-dir", str(out),
                              check=True)
    epochs = [r for r in metrics(out) if r["type"] == "epoch"]
    for record in epochs:
        assert (f"top5 {record['eval_top5']:.2%} mean per-class top1 "
                f"{record['eval_mean_class_top1']:.2%} (") in result.stdout
    best = max(r["eval_mean_class_top1"] for r in epochs)
    assert f"best held-out mean per-class top-1 {best:.2%}; next:" in result.stdout
    # the plot marks the epoch the run picked by its metric, read from its config.yaml
    from accel_train.base.readers import read_yaml
    from accel_train.run.plots import best_epoch, eval_metric_of
    assert eval_metric_of(read_yaml(out / "config.yaml", "run_config")) == "mean_class_top1"
    assert eval_metric_of({"train": {"epochs": 2}}) == "top1"  # a run from before the option
    assert best_epoch(epochs, "mean_class_top1")[1] == best
    drawn = accel_train_here("plot", str(out), check=True)
    assert f"{out / 'plots' / 'accuracy.png'}" in drawn.stdout


# -- resume: a checkpoints folder, a run folder, a step folder -----------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """2 epochs of 4 steps, checkpoints at 2, 4 (the end of epoch 1), 6 and 8: the run every
    resume below must reproduce."""
    out = tmp_path_factory.mktemp("resume_forms") / "run"
    accel_train_here(*TINY_TRAIN, "--synthetic-train-size", "64", "--epochs", "2",
                     "--checkpoint-every", "2", "--keep-checkpoints", "4",
                     "--output-dir", str(out), check=True)
    assert _steps(out / "checkpoints") == [2, 4, 6, 8]
    return out


@pytest.mark.parametrize("form, step", [("checkpoints-folder", 4), ("run-folder", 6),
                                        ("step-folder", 2)])
def test_resume_from_each_form_of_path_ends_bit_identical(finished_run, tmp_path, form, step):
    """A copy of the run without its checkpoints after `step`: each form of --resume finds that
    step (the end of epoch 1, a step inside epoch 2, a step inside epoch 1) and trains on into
    the very weights of the run that was never stopped."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    for later in _steps(copy / "checkpoints"):
        if later > step:
            shutil.rmtree(copy / "checkpoints" / f"step_{later:08d}")
    (copy / "model.safetensors").unlink()
    if form == "checkpoints-folder":  # a newer one cut short: passed over, and named
        broken = copy / "checkpoints" / "step_00000006"
        shutil.copytree(finished_run / "checkpoints" / "step_00000006", broken)
        (broken / "model.safetensors").write_bytes(b"cut short")
    target = {"checkpoints-folder": copy / "checkpoints", "run-folder": copy,
              "step-folder": copy / "checkpoints" / f"step_{step:08d}"}[form]
    out = tmp_path / "resumed"
    result = accel_train_here(*TINY_TRAIN, "--synthetic-train-size", "64", "--epochs", "2",
                              "--checkpoint-every", "2", "--resume", str(target),
                              "--output-dir", str(out), check=True)
    said = result.stdout + result.stderr
    assert f"step_{step:08d}" in said
    if form == "checkpoints-folder":
        assert re.search(r"warning: .*step_00000006", said), said
    assert [r["epoch"] for r in metrics(out) if r["type"] == "epoch"] == \
        ([2] if step >= 4 else [1, 2])
    a = load_file(str(finished_run / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_from_a_folder_without_a_valid_checkpoint_is_one_line(finished_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished_run / "checkpoints", copy)
    for step in _steps(copy):
        (copy / f"step_{step:08d}" / "model.safetensors").write_bytes(b"cut short")
    out = tmp_path / "resumed"
    result = accel_train_here(*TINY_TRAIN, "--resume", str(copy), "--output-dir", str(out))
    assert result.returncode == 2 and not out.exists()
    assert result.stderr.strip() == (f"accel_train: error: --resume {copy}: no valid checkpoint "
                                     f"in that folder; pass another folder, or --resume auto to "
                                     f"start over if none is left")


# -- the time budget counts every evaluation pass: EMA x TTA x max-steps ---------------------------

BUDGET_SECONDS, HELD_OUT, GLOBAL_BATCH, STEPS_PER_EPOCH = 60, 64, 16, 16


def _largest_total(passes: int, steps_done: int) -> int:
    """By hand (test_time_budget.py's brute-force count): 1 s a step on the fake clock, which has
    moved 1 s per step so far; `passes` forward passes over each held-out image at every epoch
    end, the last included."""
    from test_time_budget import _largest_that_fits
    return _largest_that_fits(BUDGET_SECONDS, steps_done, 1.0, steps_done, STEPS_PER_EPOCH,
                              passes * HELD_OUT, GLOBAL_BATCH)


@pytest.mark.parametrize("flags, passes", [((), 1), (("--model-ema", "--tta", "flip"), 4)],
                         ids=["plain", "ema-and-flip"])
@pytest.mark.slow
def test_time_budget_fits_every_evaluation_pass(monkeypatch, tmp_path, flags, passes):
    """A fake clock that moves 1 s per micro-batch (budget.py's clock, moved by a callback):
    the step count the run fixes is the hand-computed one for the raw model's pass, the EMA's,
    and each one's mirrored view; --max-steps below it wins."""
    from test_time_budget import fake_clock, ticking

    clock = fake_clock(monkeypatch)
    tick = ticking(clock)
    out = tmp_path / "run"
    said = accel_train_here(*TINY_BUDGET, "--time-budget", f"{BUDGET_SECONDS}s", *flags,
                            "--output-dir", str(out), check=True, callbacks=tick).stdout
    record = next(r for r in metrics(out) if r["type"] == "budget")
    assert record["step_seconds"] == 1.0
    expected = _largest_total(passes, record["step"])
    assert record["total_steps"] == expected
    # an EMA of the default decay (about 5,000 steps) over the few steps the budget fits: said
    # once the fit knows the length, as a run of known length says it at its start
    ema_words = (f"warning: --model-ema-decay 0.9998 averages over about 5,000 steps and the "
                 f"budget fits {expected}: the EMA weights stay close to the starting weights")
    assert (ema_words in said) == ("--model-ema" in flags), said[-3000:]
    assert expected != _largest_total(1 if passes > 1 else 4, record["step"])  # it can tell
    # The re-fits after it: the epoch ends took no time on this clock, and the latest measured
    # one is what those to come will cost; the run ends at the last fit's count
    from test_time_budget import _largest_that_fits
    last = [r for r in metrics(out) if r["type"] == "budget"][-1]
    assert last["epoch_end_seconds"] == 0.0
    assert last["total_steps"] == _largest_that_fits(BUDGET_SECONDS, last["step"], 1.0,
                                                     last["step"], STEPS_PER_EPOCH, 0,
                                                     GLOBAL_BATCH, eval_seconds=0.0)
    epochs = [r for r in metrics(out) if r["type"] == "epoch"]
    assert epochs[-1]["step"] == last["total_steps"]
    assert len(epochs) == math.ceil(last["total_steps"] / STEPS_PER_EPOCH)

    if passes > 1:  # the same with --max-steps below the fitted count: it ends there
        clock.now = 0.0
        capped = tmp_path / "capped"
        accel_train_here(*TINY_BUDGET, "--time-budget", f"{BUDGET_SECONDS}s", *flags,
                         "--max-steps", "20", "--log-every", "1", "--output-dir", str(capped),
                         check=True, callbacks=tick)
        records = metrics(capped)
        assert next(r for r in records if r["type"] == "budget")["total_steps"] == 20
        last = [r for r in records if r["type"] == "train"][-1]
        assert last["step"] == 20 and last["lr"] == pytest.approx(0.0, abs=1e-9)


def test_a_budget_run_resumed_keeps_its_step_count_and_ends_bit_identical(monkeypatch, tmp_path):
    """On the fake clock a budget run is deterministic, so its resume must be exact.  The
    count is fitted at step 13 (26 steps, by hand: 13 measured, then 13 steps and two 2 s
    evaluations fill the 17 s left), and again once the epoch end at step 16 has been measured
    (no time on this clock: 30 steps).  Resumed from step 20, the run keeps the latest fit
    without measuring again and ends in the uninterrupted run's weights."""
    from test_time_budget import fake_clock, ticking

    clock = fake_clock(monkeypatch)
    tick = ticking(clock)
    common = [*TINY_BUDGET, "--time-budget", "30s", "--checkpoint-every", "10",
              "--keep-checkpoints", "10"]
    full = tmp_path / "full"
    accel_train_here(*common, "--output-dir", str(full), check=True, callbacks=tick)
    assert [r["total_steps"] for r in metrics(full) if r["type"] == "budget"] == [26, 30]
    copy = tmp_path / "copy"
    shutil.copytree(full, copy)
    for later in _steps(copy / "checkpoints"):
        if later > 20:
            shutil.rmtree(copy / "checkpoints" / f"step_{later:08d}")
    clock.now = 1e6  # a resumed run must not measure again (this clock would fit nothing)
    resumed = tmp_path / "resumed"
    accel_train_here(*common, "--resume", str(copy), "--output-dir", str(resumed), check=True,
                     callbacks=tick)
    assert not [r for r in metrics(resumed) if r["type"] == "budget"]
    assert [r["step"] for r in metrics(resumed) if r["type"] == "epoch"][-1] == 30
    a = load_file(str(full / "model.safetensors"))
    b = load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- progress display -----------------------------------------------------------------------------

def test_progress_bar_or_log_lines(tmp_path):
    common = [*TINY_TRAIN, "--max-steps", "2", "--log-every", "1"]
    bar = accel_train_here(*common, "--progress", "bar", "--output-dir", str(tmp_path / "b"),
                           check=True)
    log = accel_train_here(*common, "--progress", "log", "--output-dir", str(tmp_path / "l"),
                           check=True)
    line = re.compile(r"^step 1/2 epoch 1 ", re.M)
    assert line.search(log.stdout) and not line.search(bar.stdout)
    assert "2/2" in bar.stderr and "2/2" not in log.stderr  # tqdm's counter, on stderr


# -- layout options given alike to training, check-data, eval and shard ---------------------------

@pytest.fixture(scope="module")
def decoy_parquet(tmp_path_factory) -> tuple[Path, dict]:
    """train/test parquet files whose columns named like an image and a label are decoys (blank
    images, all label 0 of a class of their own); the real images are in `photo`, the real
    labels in `truth`."""
    import datasets
    from PIL import Image as PILImage

    folder = tmp_path_factory.mktemp("decoy")
    features = datasets.Features({
        "image": datasets.Image(), "photo": datasets.Image(),
        "label": datasets.ClassLabel(names=["decoy"]),
        "truth": datasets.ClassLabel(names=synthetic.CLASS_NAMES)})
    truth = {}
    for split, (images, labels) in synthetic.splits(64).items():
        images, labels = images[:48], labels[:48]
        blank = PILImage.new("RGB", (20, 20))
        data = {"image": [blank] * len(images),
                "photo": [PILImage.fromarray(a) for a in images],
                "label": [0] * len(images), "truth": labels.tolist()}
        datasets.Dataset.from_dict(data, features=features).to_parquet(
            str(folder / f"{split}.parquet"))
        truth[split] = (images, labels)
    return folder, truth


def test_columns_chosen_by_flag_reach_training_check_data_eval_and_shard(decoy_parquet, tmp_path):
    folder, truth = decoy_parquet
    columns = ["--image-column", "photo", "--label-column", "truth"]
    out = tmp_path / "run"
    result = accel_train_here("--data-dir", str(folder), *columns, "--model", "test_resnet",
                              "--batch-size", "16", "--max-steps", "1", "--progress", "log",
                              "--no-plots", "--mixed-precision", "no", "--no-channels-last",
                              "--output-dir", str(out), check=True)
    spec = model_spec_of(out)
    assert spec["image_size"] == 32, "trained on the 20 px decoys, not the 32 px photos"
    counts = np.bincount(truth["train"][1], minlength=10)
    assert "43 train / 5 validation / 48 test images" in result.stdout, result.stdout

    report = json.loads(accel_train_here("check-data", "--data-dir", str(folder), *columns,
                                         "--json", check=True).stdout)
    names = synthetic.CLASS_NAMES
    assert report["class_counts"]["train"] == {names[c]: int(n) for c, n in enumerate(counts) if n}
    assert not report["unreadable"]

    evaluated = json.loads(accel_train_here("eval", str(out), "--data-dir", str(folder), *columns,
                                            "--split", "test", "--json",
                                            check=True).stdout.strip().splitlines()[-1])
    per_class = {name: v["images"] for name, v in evaluated["per_class"].items() if v["images"]}
    held_counts = np.bincount(truth["test"][1], minlength=10)
    assert per_class == {names[c]: int(n) for c, n in enumerate(held_counts) if n}

    shards = tmp_path / "shards"
    accel_train_here("shard", "--data-dir", str(folder), *columns, "-o", str(shards),
                     "--no-progress", check=True)
    from accel_train.data.streaming import ShardSet, decode_substituting, read_split
    index = json.loads((shards / "index.json").read_text())
    assert index["class_names"] == names
    entries = index["splits"]["train"]
    samples, labels = read_split(ShardSet([shards / e["file"] for e in entries],
                                          [e["count"] for e in entries]))
    images, _, _ = decode_substituting(samples, "error")  # as a streamed run decodes
    expected = torch.from_numpy(truth["train"][0]).permute(0, 3, 1, 2)
    assert labels == truth["train"][1].tolist()
    assert torch.equal(torch.stack(images), expected)

    # streamed as they are (--streaming): the same columns read, the decoys passed over
    streamed = tmp_path / "streamed"
    accel_train_here("--data-dir", str(folder), "--streaming", *columns, "--model", "test_resnet",
                     "--batch-size", "16", "--max-steps", "1", "--progress", "log", "--no-plots",
                     "--mixed-precision", "no", "--no-channels-last", "--output-dir",
                     str(streamed), check=True)
    spec = model_spec_of(streamed)
    assert spec["image_size"] == 32, "streamed the 20 px decoys"
    # the truth column's classes as datasets' features name them (the decoys': "decoy")
    assert spec["class_names"] == names
    # and where the decoy images cannot be decoded and no features name the classes: the
    # loader workers read the photos (--bad-images error stops at a broken one), the classes
    # are counted from the truth column (the decoys' all-0 would be one class, refused)
    import pyarrow as pa
    import pyarrow.parquet as pq
    broken = tmp_path / "broken_decoys"
    broken.mkdir()
    for split in ("train", "test"):
        table = pq.read_table(folder / f"{split}.parquet").replace_schema_metadata(None)
        decoys = pa.array([{"bytes": b"not an image", "path": None}] * table.num_rows,
                          table.schema.field("image").type)
        pq.write_table(table.set_column(table.schema.get_field_index("image"), "image", decoys),
                       broken / f"{split}.parquet")
    accel_train_here("--data-dir", str(broken), "--streaming", *columns, "--bad-images", "error",
                     "--model", "test_resnet", "--batch-size", "16", "--max-steps", "2",
                     "--progress", "log", "--no-plots", "--mixed-precision", "no",
                     "--output-dir", str(tmp_path / "streamed_broken"), check=True)
    spec = model_spec_of(tmp_path / "streamed_broken")
    assert spec["class_names"] == [str(c) for c in range(10)]


# -- data options alike in training and check-data ------------------------------------------------

SMALL_RUN = ["--model", "test_resnet", "--batch-size", "2", "--max-steps", "1", "--progress",
             "log", "--no-plots", "--mixed-precision", "no", "--no-channels-last"]


def _png(path: Path, seed: int) -> None:
    from PIL import Image
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def test_class_depth_alike_in_training_and_check_data(tmp_path):
    """Nested folders, --class-depth 1: the top folder names the class (3 animals, 2 plants, as
    written here) in training, check-data and shard alike; without it the leaf folders
    would."""
    tree = ["animals/cat/siamese/1.png", "animals/cat/2.png", "animals/dog/3.png",
            "plants/tree/oak/4.png", "plants/5.png"]
    for i, name in enumerate(tree):
        _png(tmp_path / "tree" / name, seed=i)
    data = ["--data-dir", str(tmp_path / "tree"), "--class-depth", "1"]
    trained = accel_train_here(*data, *SMALL_RUN, "--val-fraction", "0.4",
                               "--output-dir", str(tmp_path / "run"), check=True)
    assert "3 train / 2 validation images, 2 classes" in trained.stdout, trained.stdout
    spec = model_spec_of(tmp_path / "run")
    assert spec["class_names"] == ["animals", "plants"]
    report = json.loads(accel_train_here("check-data", *data, "--json").stdout)
    assert report["classes"] == ["animals", "plants"]
    totals = {name: sum(counts[name] for counts in report["class_counts"].values())
              for name in report["classes"]}
    assert totals == {"animals": 3, "plants": 2}
    # sharded alike: the index's classes, and each sample's .cls read back with tarfile
    shards = tmp_path / "shards"
    accel_train_here("shard", *data, "--val-fraction", "0.4", "--no-progress", "--output",
                     str(shards), check=True)
    index = json.loads((shards / "index.json").read_text())
    assert index["class_names"] == ["animals", "plants"]
    labels = []
    for tar in sorted(shards.rglob("*.tar")):
        with tarfile.open(tar) as archive:
            labels += [int(archive.extractfile(m).read()) for m in archive.getmembers()
                       if m.name.endswith(".cls")]
    assert sorted(labels) == [0, 0, 0, 1, 1]


def test_val_labels_alike_in_training_and_check_data(tmp_path):
    """ImageNet's layout (train/CLASS/*, val/* unlabelled) with a label file written here: the
    held-out classes counted by check-data and used by training are the file's."""
    classes = ["n01", "n02"]
    for c, name in enumerate(classes):
        for i in range(3):
            _png(tmp_path / "inet" / "train" / name / f"{name}_{i}.JPEG", seed=10 * c + i)
    labels = {f"val_{i}.JPEG": classes[i % 3 == 0] for i in range(5)}  # n02 for 0 and 3
    for i, name in enumerate(labels):
        _png(tmp_path / "inet" / "val" / name, seed=100 + i)
    label_file = tmp_path / "labels.csv"
    label_file.write_text("".join(f"{f},{c}\n" for f, c in labels.items()))
    data = ["--data-dir", str(tmp_path / "inet"), "--val-labels", str(label_file)]
    report = json.loads(accel_train_here("check-data", *data, "--json").stdout)
    held_out = [s for s in report["class_counts"] if s != "train"]
    assert len(held_out) == 1 and report["class_counts"][held_out[0]] == {"n01": 3, "n02": 2}
    trained = accel_train_here(*data, *SMALL_RUN, "--output-dir", str(tmp_path / "run"),
                               check=True)
    assert "6 train / 5 validation images, 2 classes" in trained.stdout, trained.stdout
    evaluated = json.loads(accel_train_here("eval", str(tmp_path / "run"), "--json",
                                            check=True).stdout.strip().splitlines()[-1])
    assert {k: v["images"] for k, v in evaluated["per_class"].items()} == {"n01": 3, "n02": 2}


def test_dataset_names_a_local_parquet_folder(cifar10_layout, tmp_path):
    """--dataset with a local folder (what datasets.load_dataset reads offline): the classes and
    counts of its parquet files, as pyarrow reads them, in training and check-data."""
    import pyarrow.parquet as pq
    label_counts = np.bincount(pq.read_table(cifar10_layout / "test.parquet")
                               .column("label").to_numpy(), minlength=10)
    report = json.loads(accel_train_here("check-data", "--dataset", str(cifar10_layout),
                                         "--json", check=True).stdout)
    assert sorted(report["splits"].values()) == [160, 640]
    from conftest import CIFAR10_CLASSES
    assert report["classes"] == CIFAR10_CLASSES
    held_out = [s for s in report["splits"] if report["splits"][s] == 160][0]
    assert list(report["class_counts"][held_out].values()) == label_counts.tolist()
    out = tmp_path / "run"
    trained = accel_train_here("--dataset", str(cifar10_layout), *SMALL_RUN,
                               "--max-train-samples", "64", "--output-dir", str(out), check=True)
    assert "64 train / 64 validation / 160 test images (limits kept a seeded draw: " \
        "--sample-subset random), 10 classes" in trained.stdout, trained.stdout
    assert model_spec_of(out)["class_names"] == CIFAR10_CLASSES


# -- streaming -------------------------------------------------------------------------------------

STREAM_RUN = ["--model", "test_resnet", "--batch-size", "8", "--epochs", "1", "--progress", "log",
              "--no-plots", "--mixed-precision", "no", "--no-channels-last", "--num-workers", "0"]


@pytest.mark.slow
def test_streaming_flag_and_eval_shards(cifar10_layout, synthetic_shards, tmp_path):
    """--streaming on a parquet folder streams it (the loader's position is a stream.json in the
    checkpoint; without the flag the same folder is indexed whole); --eval-shards holds two
    24-sample shards out: 48 evaluated images, 200 - 48 trained."""
    streamed, indexed = tmp_path / "streamed", tmp_path / "indexed"
    common = ["--data-dir", str(cifar10_layout), *STREAM_RUN, "--max-steps", "2",
              "--checkpoint-every", "2", "--max-eval-samples", "16"]
    accel_train_here(*common, "--streaming", "--output-dir", str(streamed), check=True)
    accel_train_here(*common, "--output-dir", str(indexed), check=True)
    assert (streamed / "checkpoints" / "step_00000002" / "stream.json").is_file()
    assert not (indexed / "checkpoints" / "step_00000002" / "stream.json").exists()

    out = tmp_path / "eval-shards"
    result = accel_train_here("--data-dir", str(synthetic_shards), *STREAM_RUN,
                              "--eval-shards", "train/00000[01].tar", "--output-dir", str(out),
                              check=True)
    assert "152 images" in result.stdout, result.stdout
    epochs = [r for r in metrics(out) if r["type"] == "epoch"]
    assert [r["eval_count"] for r in epochs] == [48]


# -- the seed manual's launcher flags --------------------------------------------------------------

def test_local_rank_is_checked_against_the_launcher(monkeypatch, tmp_path):
    """Under a launcher (its variables set), --local_rank other than LOCAL_RANK stops in one line
    that names both, before anything is written."""
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    result = accel_train_here(*TINY_TRAIN, "--local_rank", "1", "--output-dir", str(out))
    assert result.returncode == 2
    assert "--local_rank 1 contradicts the launcher's LOCAL_RANK=0" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


# -- shard's progress line ---------------------------------------------------------------------

def test_shard_progress_line_or_none(tmp_path):
    for i in range(4):
        _png(tmp_path / "pngs" / ("a" if i % 2 else "b") / f"{i}.png", seed=i)
    shown = accel_train_here("shard", "--data-dir", str(tmp_path / "pngs"), "-o",
                             str(tmp_path / "s1"), check=True)
    quiet = accel_train_here("shard", "--data-dir", str(tmp_path / "pngs"), "-o",
                             str(tmp_path / "s2"), "--no-progress", check=True)
    assert re.search(r"\b4/4\b", shown.stderr) and quiet.stderr == ""


# -- boundaries: first and last items, one-element cases ------------------------------------------

def test_the_first_and_last_training_images_broken_are_substituted_and_named(tmp_path,
                                                                             monkeypatch):
    """Per-step decoding: the first image of the split and the last (whose substitute is not
    after it) are each replaced by another that decodes, as are one more and a held-out image;
    each is named once with its reason in bad_images.txt and the checkpoint; warnings stop
    after the limit (2 here, through the module's constant) and the rest go to the log; a
    resume restores the list and ends bit-identical."""
    from accel_train.data import badimages
    monkeypatch.setattr(badimages, "MAX_SAID", 2)
    for split, count in (("train", 8), ("val", 2)):
        for c in ("a", "b"):
            for i in range(count):
                _png(tmp_path / "data" / split / c / f"{i}.png", seed=i)
    broken = ["train/a/0.png", "train/a/3.png", "train/b/7.png", "val/b/1.png"]
    for name in broken:
        (tmp_path / "data" / name).write_bytes(b"not an image")
    out = tmp_path / "run"
    command = ["--data-dir", str(tmp_path / "data"), "--in-memory", "never", "--num-workers",
               "0", "--model", "test_resnet", "--batch-size", "4", "--epochs", "2",
               "--progress", "log", "--no-plots", "--mixed-precision", "no",
               "--no-channels-last"]
    result = accel_train_here(*command, "--output-dir", str(out), check=True)
    listed = dict(line.split("\t") for line in (out / "bad_images.txt").read_text().splitlines())
    assert sorted(listed) == broken and all(listed.values())
    saved = out / "checkpoints" / "step_00000004" / "bad_images.json"
    assert json.loads(saved.read_text()) == listed  # all met in epoch 1
    console = result.stdout + result.stderr
    log = (out / "logs" / "rank0.log").read_text()
    said = [name for name in broken if f"image {name} cannot be decoded" in console]
    assert len(said) == 2 and console.count("cannot be decoded") == 2, console
    for name in said:  # as a warning, the held-out one saying so
        held_out = "held-out " if name.startswith("val/") else ""
        assert f"warning: {held_out}image {name} cannot be decoded" in console, console
    assert console.count(f"more broken images are listed in {out / 'bad_images.txt'} only") == 1
    for name in broken:  # each in the log once, with its reason; held-out ones say so
        assert log.count(f"image {name} cannot be decoded ({listed[name]})") == 1, name
        assert (f"held-out image {name}" in log) == name.startswith("val/"), name
    assert [r["step"] for r in metrics(out) if r["type"] == "epoch"] == [4, 8]

    # resumed from the end of epoch 1, the list is the checkpoint's again (a line that a
    # future being redone had added goes), and the run ends in the same weights
    shutil.rmtree(out / "checkpoints" / "step_00000008")
    (out / "model.safetensors").rename(tmp_path / "model.safetensors")
    with (out / "bad_images.txt").open("a") as handle:
        handle.write("train/b/5.png\tnamed by a future that is redone\n")
    with (out / "metrics.jsonl").open("a") as handle:  # and killed while logging a step
        handle.write('{"type": "train", "st')
    accel_train_here(*command, "--resume", "auto", "--output-dir", str(out), check=True)
    assert all(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    relisted = dict(line.split("\t")
                    for line in (out / "bad_images.txt").read_text().splitlines())
    assert relisted == listed
    a, b = load_file(str(tmp_path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_from_a_checkpoint_without_bad_images_clears_the_list(tmp_path):
    """bad_images.txt names what the checkpoint resumed from had named: none here, so a line
    that a future being redone had written goes, even when the list becomes empty."""
    out = tmp_path / "run"
    accel_train_here(*TINY_TRAIN, "--max-steps", "2", "--checkpoint-every", "1", "--output-dir",
                     str(out), check=True)
    shutil.rmtree(out / "checkpoints" / "step_00000002")
    (out / "bad_images.txt").write_text("train/x.png\tnamed by a future that is redone\n")
    accel_train_here(*TINY_TRAIN, "--max-steps", "2", "--checkpoint-every", "1", "--output-dir",
                     str(out), "--resume", "auto", check=True)
    assert (out / "bad_images.txt").read_text() == ""


def test_one_held_out_image_and_a_one_image_remainder(tmp_path):
    """17 training images at batch 16: one step an epoch (a batch of one would break BatchNorm's
    training statistics, so the remainder waits for the next epoch's order); 1 held-out image
    evaluated, once an epoch."""
    out = tmp_path / "run"
    accel_train_here(*TINY_TRAIN, "--synthetic-train-size", "17", "--max-eval-samples", "1",
                     "--epochs", "2", "--log-every", "1", "--output-dir", str(out), check=True)
    records = metrics(out)
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2]
    assert [(r["epoch"], r["eval_count"]) for r in records if r["type"] == "epoch"] == \
        [(1, 1), (2, 1)]


# -- GPUs chosen before CUDA starts ---------------------------------------------------------------

def test_gpu_ids_are_visible_before_torch_is_first_asked_about_cuda(monkeypatch):
    """--gpu_ids 2,3 must be CUDA_VISIBLE_DEVICES when torch is first asked about CUDA (the
    driver reads it once, then); a different value already set is refused before that.  torch's
    CUDA queries are replaced by recorders (a machine with 4 GPUs, as the process would see)."""
    from accel_train.run import distributed
    from accel_train.config import TrainConfig
    from accel_train.base.errors import UsageError

    seen = []

    def asked(answer):
        def query():
            seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
            return answer
        return query

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        # (set, then removed: monkeypatch then restores what was there, absence included, over
        # the value the product sets in os.environ)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(torch.cuda, "is_available", asked(True))
    monkeypatch.setattr(torch.cuda, "device_count", asked(2))
    distributed.setup(TrainConfig(gpu_ids="2,3"))
    assert seen and all(value == "2,3" for value in seen), seen

    seen.clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(UsageError, match="--gpu_ids 2,3 contradicts CUDA_VISIBLE_DEVICES=0,1"):
        distributed.setup(TrainConfig(gpu_ids="2,3"))
    assert seen == []


def test_a_manual_start_without_local_rank_spreads_a_machines_processes_over_its_gpus(
        monkeypatch):
    """--world_size 4 --rank R --dist_url ... on machines with 2 GPUs each: ranks 2 and 3 (the
    second machine) use GPUs 0 and 1, not both GPU 0; on a CPU the local rank is 0."""
    from accel_train.run import distributed
    from accel_train.config import TrainConfig

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # (restored afterwards: the helper sets them)
    manual = dict(world_size=4, dist_url="tcp://127.0.0.1:23456")
    assert [distributed._env_from_manual_flags(TrainConfig(rank=r, **manual), 2).local_rank
            for r in range(4)] == [0, 1, 0, 1]
    assert distributed._env_from_manual_flags(TrainConfig(rank=3, **manual), 0).local_rank == 0
    assert distributed._env_from_manual_flags(
        TrainConfig(rank=3, local_rank=0, **manual), 2).local_rank == 0  # given: kept


def test_eval_metric_top5_with_five_classes_or_fewer_is_said_to_pick_nothing(tmp_path):
    """Top-5 of a model of 5 classes or fewer holds every class: each evaluation scores 100%
    (metrics.jsonl's eval_top5, the oracle), so --eval-metric top5 ranks every epoch alike and
    the best checkpoints and weights it keeps are no choice at all; the start says so.  Ten
    classes (the synthetic set) leave top-5 a number to pick by: not said."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for name in ("cat", "dog", "fox"):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                tmp_path / "data" / name / f"{i}.png")
    out = tmp_path / "run"
    result = accel_train_here("--data-dir", str(tmp_path / "data"), "--model", "test_resnet",
                              "--epochs", "2", "--batch-size", "4", "--progress", "log",
                              "--no-plots", "--mixed-precision", "no", "--eval-metric", "top5",
                              "--keep-best", "1", "--output-dir", str(out), check=True)
    assert {r["eval_top5"] for r in metrics(out) if r["type"] == "epoch"} == {1.0}
    said = [line for line in (result.stdout + result.stderr).splitlines()
            if line.startswith("warning: --eval-metric top5")]
    assert said == ["warning: --eval-metric top5 with 3 classes: every class is among an "
                    "image's top 5, so every evaluation scores 100% and picks nothing (the "
                    "best checkpoints, the weights saved); pick by top1, loss or "
                    "mean_class_top1"], result.stdout
    ten = accel_train_here(*TINY_TRAIN, "--max-steps", "2", "--eval-metric", "top5",
                           "--output-dir", str(tmp_path / "ten"), check=True)
    assert "--eval-metric top5 with" not in ten.stdout + ten.stderr
