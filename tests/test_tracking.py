"""What a run records and tells the user: TensorBoard files through accelerate's tracking API
(read back with TensorBoard's own reader), metrics.jsonl beside them, the PNG curves drawn at
the end, and the start-up summary and progress lines.  One tiny run, in-process, for the module."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from pathlib import Path

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from accel_train.cli import main
from accel_train.run.track import read_metrics
from conftest import TINY_TRAIN, clean_accelerate_state

MAX_STEPS = 8


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> tuple[Path, str]:
    """(run directory, everything the run printed)."""
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                     "ACCELERATE_MIXED_PRECISION")
    assert not any(v in os.environ for v in launcher_vars), "run pytest outside a launcher"
    out = tmp_path_factory.mktemp("tracking") / "run"
    printed = io.StringIO()
    with clean_accelerate_state(), contextlib.redirect_stdout(printed):
        # (a warmup that is a share of the short run: one in epochs would outlast it, and the
        # run would rightly warn before its summary)
        code = main([*TINY_TRAIN, "--plots", "--report-to", "tensorboard", "--log-every", "2",
                     "--max-steps", str(MAX_STEPS), "--warmup-fraction", "0.25",
                     "--output-dir", str(out)])
    assert code == 0, printed.getvalue()
    return out, printed.getvalue()


def test_tensorboard_files_hold_the_logged_scalars(tracked_run):
    out, _ = tracked_run
    records = read_metrics(out / "metrics.jsonl")  # always written, trackers or not
    train = [r for r in records if r["type"] == "train"]
    epoch = [r for r in records if r["type"] == "epoch"][-1]
    assert [r["step"] for r in train] == list(range(2, MAX_STEPS + 1, 2))

    events = EventAccumulator(str(out / "trackers" / "accel_train"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/top1", "train/lr", "train/img_per_s", "eval/loss", "eval/top1",
            "eval/top5"} <= tags
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/top1", "top1")):
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in logged] == [r["step"] for r in train], tag
        assert [v for _, v in logged] == pytest.approx([r[key] for r in train], rel=1e-5), tag
    (top1,) = events.Scalars("eval/top1")
    assert top1.step == MAX_STEPS and top1.value == pytest.approx(epoch["eval_top1"], rel=1e-5)


def test_metrics_carry_a_running_train_accuracy(tracked_run):
    out, _ = tracked_run
    train = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "train"]
    # 2 steps x 16 images per logged window: the accuracy is a whole number of 32nds
    assert all(0 <= r["top1"] <= 1 and (r["top1"] * 32) == pytest.approx(round(r["top1"] * 32),
                                                                        abs=0.01) for r in train)


def test_plots_are_drawn_at_the_end_of_training(tracked_run):
    out, printed = tracked_run
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert pngs == ["accuracy.png", "loss_lr.png", "throughput.png"]
    for name in pngs:
        with Image.open(out / "plots" / name) as image:
            assert image.format == "PNG" and image.size == (800, 600)
    assert f"plots: {out / 'plots' / 'loss_lr.png'}" in printed


def test_drawing_leaves_the_calling_programs_matplotlib_as_it_was(tracked_run, tmp_path):
    """A notebook that calls fit() keeps its backend and its open figures: the run draws on
    Figure objects of its own (matplotlib.use would switch the program's backend and close
    every figure it holds)."""
    import matplotlib
    import matplotlib.pyplot as plt

    from accel_train.run.plots import write_plots

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # the program's own choice: not the Agg the PNGs are drawn with
    figure = plt.figure()
    try:
        written = write_plots(tracked_run[0], tmp_path)
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == [figure.number]
    finally:
        plt.close(figure)
        matplotlib.use(before)
    assert sorted(p.name for p in written) == ["accuracy.png", "loss_lr.png", "throughput.png"]
    for path in written:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (800, 600)


def test_the_accuracy_plots_title_gives_the_final_numbers_and_the_emas_beside_them():
    from accel_train.run.plots import accuracy_title
    raw = {"eval_top1": 0.1094, "eval_top5": 0.5}
    assert accuracy_title(raw) == "Accuracy: final held-out top-1 10.9%, top-5 50.0%"
    assert accuracy_title({**raw, "eval_ema_top1": 0.1406}) == \
        "Accuracy: final held-out top-1 10.9%, top-5 50.0%; EMA weights top-1 14.1%"
    assert accuracy_title(None) == "Accuracy"


def test_the_accuracy_plot_marks_the_best_epoch_by_the_runs_eval_metric():
    """By hand: the better of raw and EMA per epoch, lower for loss, the first of equals."""
    from accel_train.run.plots import best_epoch, best_label
    epochs = [
        {"epoch": 1, "eval_top1": 0.50, "eval_loss": 0.9, "eval_mean_class_top1": 0.40},
        {"epoch": 2, "eval_top1": 0.70, "eval_loss": 0.7, "eval_mean_class_top1": 0.35,
         "eval_ema_top1": 0.60, "eval_ema_loss": 0.5},
        {"epoch": 3, "eval_top1": 0.60, "eval_loss": 0.6, "eval_mean_class_top1": 0.40,
         "eval_ema_top1": 0.72, "eval_ema_loss": 0.8},
        {"epoch": 4, "eval_top1": 0.72, "eval_loss": 0.65, "eval_mean_class_top1": 0.30},
    ]
    picked = {metric: (record["epoch"], value) for metric in ("top1", "loss", "mean_class_top1")
              for record, value in [best_epoch(epochs, metric)]}
    assert picked == {"top1": (3, 0.72), "loss": (2, 0.5), "mean_class_top1": (1, 0.40)}
    assert best_epoch([], "top1") is None
    assert best_epoch([{"epoch": 1}], "loss") is None  # an epoch record with no evaluation
    record, value = best_epoch(epochs, "loss")
    assert best_label(record, value, "loss") == "best held-out loss 0.5000 (epoch 2)"
    record, value = best_epoch(epochs, "mean_class_top1")
    assert best_label(record, value, "mean_class_top1") == \
        "best held-out mean per-class top-1 40.00% (epoch 1)"


def test_start_up_summary_progress_and_closing_lines(tracked_run):
    out, printed = tracked_run
    lines = printed.splitlines()
    assert lines[0].startswith("accel_train: test_resnet (") and "trainable parameters) on " \
        "synthetic shapes" in lines[0]
    summary = "\n".join(lines[:8])
    for fact in ("device cpu x 1 process(es)", "precision fp32",
                 "data: 256 train / 64 validation images (limits kept a seeded draw: "
                 "--sample-subset random), 10 classes, 32px",
                 "global batch 16 = 16 per process", f"16 steps/epoch, {MAX_STEPS} steps in all",
                 f"output: {out} (checkpoints in {out / 'checkpoints'})",
                 "records: metrics.jsonl, tensorboard (files in trackers/), PNG curves"):
        assert fact in summary, fact
    progress = [line for line in lines if line.startswith("step ")]
    assert progress[0].startswith(f"step 2/{MAX_STEPS} epoch 1 loss ") and " train-top1 " in \
        progress[0] and " eta " in progress[0]
    assert lines[-1].startswith("best held-out top-1 ") and f"accel-train eval {out}" in lines[-1]


@pytest.mark.parametrize("tracker, message", [
    ("nosuch", "--report-to nosuch: not a tracker accelerate knows; choose from aim,"),
    ("wandb", "--report-to wandb: its package is not installed; pip install wandb"),
])
def test_an_unusable_tracker_is_one_line_before_anything_is_written(tmp_path, capsys, tracker,
                                                                    message):
    if tracker == "wandb" and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    out = tmp_path / "run"
    assert main([*TINY_TRAIN, "--report-to", tracker, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("accel_train: error: " + message)
    assert not out.exists()


def test_an_epoch_shorter_than_log_every_gets_one_train_record_at_its_end(tmp_path):
    """Epochs of 4 steps, --log-every 100, the run ending at step 6 inside its second epoch:
    a record at each epoch's end (4) and at the last step (6), each the mean of its steps'
    losses and accuracies as the same run logging every step records them; the rate and
    learning rate there too."""
    runs = {}
    for every in (1, 100):
        out = tmp_path / f"every{every}"
        with clean_accelerate_state(), contextlib.redirect_stdout(io.StringIO()):
            assert main([*TINY_TRAIN, "--synthetic-train-size", "64", "--epochs", "2",
                         "--max-steps", "6", "--log-every", str(every),
                         "--output-dir", str(out)]) == 0
        runs[every] = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "train"]
    each_step = {r["step"]: r for r in runs[1]}
    assert sorted(each_step) == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in runs[100]] == [4, 6]
    for record, steps in zip(runs[100], ([1, 2, 3, 4], [5, 6])):
        assert record["loss"] == pytest.approx(
            sum(each_step[s]["loss"] for s in steps) / len(steps), abs=2e-6)
        assert record["top1"] == pytest.approx(
            sum(each_step[s]["top1"] for s in steps) / len(steps), abs=1e-4)
        assert record["lr"] == each_step[record["step"]]["lr"] and record["img_per_s"] > 0
        assert record["epoch"] == each_step[record["step"]]["epoch"]


def test_a_run_resumed_inside_an_epoch_logs_where_the_run_it_continues_would(tmp_path):
    """Epochs of 4 steps, --log-every 3: each epoch holds a logged step (3; 6), so none gets a
    record at its end.  A run stopped at step 6, inside its second epoch, and resumed: the same
    steps logged, no record at step 8 (the resumed start knows where its epoch began)."""
    def train(out, *extra):
        with clean_accelerate_state(), contextlib.redirect_stdout(io.StringIO()):
            assert main([*TINY_TRAIN, "--synthetic-train-size", "64", "--epochs", "2",
                         "--log-every", "3", "--output-dir", str(out), *extra]) == 0
        return [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["type"] == "train"]

    assert train(tmp_path / "whole") == [3, 6]
    assert train(tmp_path / "resumed", "--max-steps", "6") == [3, 6]
    assert train(tmp_path / "resumed", "--resume", "auto") == [3, 6]


def test_the_summary_says_a_budget_run_stays_within_max_steps():
    from accel_train.run.report import _length_words
    assert _length_words(120, None) == "120 steps in all"
    assert _length_words(None, None) == "fitted to --time-budget after a few steps in all"
    assert _length_words(None, 40) == ("fitted to --time-budget after a few steps in all, at "
                                       "most 40 (--max-steps)")
