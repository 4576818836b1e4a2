"""The public callbacks (accel_train/callbacks.py), handed to a run as a program hands them
(trainer.run_training): each is called at the point its docstring names, as often as the run
did that, with what the run itself recorded.

Oracle: the run's own records, read back after it ended: metrics.jsonl's train and epoch
records, the checkpoints its rank log says it saved, the sampler keys each epoch must cover
once.  A callback called at another point, another number of times or with other values
disagrees with them."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from accel_train.callbacks import Callback
from accel_train.cli import build_train_parser, config_from_args
from accel_train.trainer import Trainer, run_training
from conftest import TINY_TRAIN

# 256 images, global batch 16 made of 2 micro-batches of 8: 16 steps an epoch, 2 epochs.
OPTIONS = [*[a for a in TINY_TRAIN if a not in ("--batch-size", "16", "--epochs", "1")],
           "--batch-size", "8", "--accumulation-steps", "2", "--epochs", "2", "--log-every", "4",
           "--checkpoint-every", "5", "--keep-checkpoints", "20", "--model-ema"]


class Recorder(Callback):
    """Every call, in order, with what the trainer showed at that moment."""

    def __init__(self):
        self.calls: list[tuple] = []

    def on_train_begin(self, trainer) -> None:
        self.calls.append(("begin", trainer.state.step))

    def on_batch_start(self, trainer, batch) -> None:
        self.calls.append(("batch", trainer.state.step + 1, batch.keys.tolist()))

    def on_step_end(self, trainer, step: int) -> None:
        self.calls.append(("step", step, trainer.state.step))

    def on_log(self, trainer, record: dict) -> None:
        self.calls.append(("log", dict(record)))

    def on_evaluate(self, trainer, metrics: dict) -> None:
        self.calls.append(("evaluate", dict(metrics), trainer.state.step))

    def on_checkpoint(self, trainer, path) -> None:
        self.calls.append(("checkpoint", path.name, (path / "manifest.json").is_file()))

    def on_train_end(self, trainer) -> None:
        self.calls.append(("end", (trainer.plan.output_dir / "model.safetensors").is_file()))

    def of(self, kind: str) -> list[tuple]:
        return [call[1:] for call in self.calls if call[0] == kind]


def _config(out, *extra: str):
    return config_from_args(build_train_parser().parse_args(
        [*OPTIONS, "--output-dir", str(out), *extra]), environ={})


def _records(out, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] == kind]


def _saved(out) -> list[str]:
    """The checkpoints the run says it saved, in its own log."""
    return [os.path.basename(path) for path in
            re.findall(r"saved checkpoint (\S+) \(", (out / "logs" / "rank0.log").read_text())]


def test_each_callback_is_called_where_and_as_often_as_the_run_says(tmp_path, fresh_accelerate):
    out, recorder = tmp_path / "run", Recorder()
    assert run_training(_config(out), [recorder]) == 0

    assert recorder.calls[0] == ("begin", 0) and recorder.calls[-1] == ("end", True)
    assert recorder.of("step") == [(step, step) for step in range(1, 33)]
    # two micro-batches before each step's end, belonging to it; each epoch's keys cover its
    # 256 samples once (epoch * 256 + index)
    order = [call[:2] for call in recorder.calls if call[0] in ("batch", "step")]
    assert order == [kind for step in range(1, 33)
                     for kind in (("batch", step), ("batch", step), ("step", step))]
    keys = [key for _, keys in recorder.of("batch") for key in keys]
    assert sorted(keys) == list(range(512)) and max(keys[:256]) < 256

    assert [record for (record,) in recorder.of("log")] == _records(out, "train")
    epochs = _records(out, "epoch")
    assert [(metrics, step) for metrics, step in recorder.of("evaluate")] == \
        [({k: v for k, v in record.items() if k.startswith("eval_") and k != "eval_time"},
          record["step"]) for record in epochs]
    assert all("eval_ema_top1" in metrics for metrics, _ in recorder.of("evaluate"))
    assert recorder.of("checkpoint") == [(name, True) for name in _saved(out)]
    assert [name for name, _ in recorder.of("checkpoint")] == \
        [f"step_{step:08d}" for step in (5, 10, 15, 16, 20, 25, 30, 32)]


def test_a_resumed_start_begins_at_its_checkpoint_and_a_stopped_one_has_no_end(
        tmp_path, fresh_accelerate):
    out = tmp_path / "run"

    class StopAfterTheFirstCheckpoint(Recorder):
        def on_checkpoint(self, trainer, path) -> None:
            super().on_checkpoint(trainer, path)
            if path.name == "step_00000005":
                os.kill(os.getpid(), signal.SIGTERM)

    stopped = StopAfterTheFirstCheckpoint()
    assert run_training(_config(out), [stopped]) == 143
    assert stopped.of("end") == [] and stopped.of("step")[-1] == (6, 6)
    assert stopped.of("checkpoint") == [("step_00000005", True), ("step_00000006", True)]

    resumed = Recorder()
    assert run_training(_config(out, "--resume", "auto"), [resumed]) == 0
    assert resumed.calls[0] == ("begin", 6) and resumed.calls[-1] == ("end", True)
    assert [step for step, _ in resumed.of("step")] == list(range(7, 33))
    assert resumed.of("batch")[0][0] == 7


def test_a_callback_must_be_a_callback(tmp_path, fresh_accelerate):
    with pytest.raises(TypeError, match="^a callback must be an accel_train.callbacks.Callback, "
                                        "not function$"):
        Trainer.from_config(_config(tmp_path / "run"), callbacks=[lambda trainer: None])
    assert not (tmp_path / "run").exists()  # refused before anything starts


def test_an_error_inside_the_loop_is_in_the_ranks_log_too(tmp_path, fresh_accelerate):
    """A callback (a program's code) raising at step 2: the error propagates as it was, and
    the rank's log keeps its traceback (under a launcher stderr is the launcher's, often
    lost)."""
    class Breaks(Callback):
        def on_step_end(self, trainer, step):
            if step == 2:
                raise RuntimeError("the program's own bug")

    with pytest.raises(RuntimeError, match="the program's own bug"):
        run_training(_config(tmp_path / "run"), callbacks=[Breaks()])
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "the run stopped on an error" in log and "RuntimeError: the program's own bug" in log
    assert "Traceback" in log


def test_a_cpu_run_updates_with_the_unfused_optimizer(tmp_path, fresh_accelerate):
    """On a CPU the trainer builds the unfused optimizer the CPU figures were measured with;
    the fused kernels are for CUDA (train/optim.py says why)."""
    kernels: list = []

    class Kernels(Callback):
        def on_train_begin(self, trainer) -> None:
            kernels.extend(group["fused"] for group in trainer.optimizer.param_groups)

    out = tmp_path / "run"
    assert run_training(_config(out, "--epochs", "1", "--max-steps", "1"), [Kernels()]) == 0
    assert kernels and not any(kernels), kernels
