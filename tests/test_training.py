"""The single-process path end to end: real training, export and reload, bad input."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from accel_train.callbacks import Callback
from accel_train.cli import main
from accel_train.config import TrainConfig
from accel_train.model.saved import ModelSpec
from accel_train.model.build import build_from_spec, create_model
from accel_train.run import records as run_records
from accel_train.run.report import Reporter
from accel_train.run.track import read_metrics
from accel_train.trainer import Trainer, run_training

from conftest import PINNED, TINY_TRAIN, accel_train, accel_train_here, model_spec_of

QUICK = dict(dataset="synthetic", synthetic_train_size=256, max_eval_samples=64,
             model="test_resnet", batch_size=32, epochs=1, progress="log", plots=False,
             mixed_precision="no", channels_last=False)  # conftest.PINNED


@pytest.fixture(autouse=True)
def _fresh(fresh_accelerate):
    """Every test here runs in process (conftest.fresh_accelerate)."""


@pytest.mark.slow
def test_training_in_a_subprocess_improves_accuracy(tmp_path):
    out = tmp_path / "run"
    result = accel_train("--model", "test_resnet", "--synthetic-train-size", "1000",
                         "--epochs", "2", "--batch_size", "32", "--output-dir", str(out),
                         "--progress", "log", "--log-every", "10", "--no-plots", *PINNED,
                         check=True)
    epochs = [m for m in read_metrics(out / "metrics.jsonl") if m["type"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert epochs[-1]["eval_top1"] > max(0.5, epochs[0]["eval_top1"])  # chance is 0.1
    assert all(e["eval_count"] == 1000 for e in epochs)  # the whole held-out split, once
    steps = [m for m in read_metrics(out / "metrics.jsonl") if m["type"] == "train"]
    assert steps and all(m["img_per_s"] > 0 and 0 <= m["data_wait"] <= 1 for m in steps)
    assert "Epoch 1 Time" in result.stdout and "Training took" in result.stdout
    assert ("global batch 32 = 32 per process x 1 process(es) x 1 accumulation step(s)"
            in result.stdout)
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["train"]["epochs"] == 2 and resolved["resolved"]["precision_used"] == "fp32"
    assert resolved["versions"]["torch"] == torch.__version__.split("+")[0] or \
        resolved["versions"]["torch"].startswith(torch.__version__.split("+")[0])
    logged = (out / "logs" / "rank0.log").read_text()  # a detached run's numbers are there too
    for number, epoch in enumerate(epochs, 1):
        assert f"Epoch {number} Time {epoch['epoch_time']:.1f}s: eval loss " \
               f"{epoch['eval_loss']:.4f} top1 {epoch['eval_top1']:.2%}" in logged


def test_exported_weights_rebuild_the_same_model(tmp_path):
    config = TrainConfig(**QUICK, output_dir=str(tmp_path / "run"))
    trainer = Trainer.from_config(config)
    assert trainer.train() == 0
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    trainer.close()

    spec = ModelSpec.read(tmp_path / "run")
    assert spec.class_names[:2] == ["disk", "square"] and spec.image_size == 32
    rebuilt = build_from_spec(spec)
    rebuilt.load_state_dict(load_file(str(tmp_path / "run" / "model.safetensors")))
    rebuilt.eval()
    images = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(trained(images), rebuilt(images))


def test_fp16_on_cpu_says_so_and_records_fp32(tmp_path, capsys):
    config = TrainConfig(**{**QUICK, "mixed_precision": "fp16"}, output_dir=str(tmp_path / "run"),
                         max_steps=2)
    assert run_training(config) == 0
    assert "fp16 needs a CUDA device; this run trains in fp32" in capsys.readouterr().out
    resolved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["resolved"]
    assert (resolved["precision_requested"], resolved["precision_used"]) == ("fp16", "fp32")


def test_pretrained_local_weights_and_frozen_backbone(tmp_path):
    # "Pretrained" weights: a model with a different head (1000 classes), saved as safetensors.
    torch.manual_seed(123)
    source = create_model("test_resnet", num_classes=1000)
    weights = tmp_path / "pretrained.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(weights))

    config = TrainConfig(**QUICK, output_dir=str(tmp_path / "run"), pretrained=str(weights),
                         freeze_backbone=True, learning_rate=0.5)
    assert run_training(config) == 0
    trained = load_file(str(tmp_path / "run" / "model.safetensors"))
    spec = model_spec_of(tmp_path / "run")
    assert spec["mean"] == list(source.pretrained_cfg["mean"])  # normalization of the weights
    head = {k for k in trained if k.startswith(source.default_cfg["classifier"])}
    assert head and all(trained[k].shape[0] == 10 for k in head if k.endswith("weight"))
    for name, tensor in source.state_dict().items():
        if name not in head:  # backbone weights AND BatchNorm statistics did not move
            assert torch.equal(trained[name], tensor), name
    # --mean given: it wins over the weights' own, whose std stays
    config = TrainConfig(**QUICK, output_dir=str(tmp_path / "given"), pretrained=str(weights),
                         mean=[0.25])
    assert run_training(config) == 0
    spec = model_spec_of(tmp_path / "given")
    assert (spec["mean"], spec["std"]) == ([0.25] * 3, list(source.pretrained_cfg["std"]))


BAD_INPUTS = [
    (["--model", "resnet_does_not_exist"], "--model 'resnet_does_not_exist' is not a timm model"),
    # a tag timm has no weights config for (timm.is_model takes it; building it raised)
    (["--model", "test_resnet.bogus_tag"], "--model 'test_resnet.bogus_tag': timm has no "
     "'bogus_tag' weights for test_resnet (its tags: test_resnet.r160_in1k); pass 'test_resnet'"),
    (["--data-dir", "/nonexistent/data"], "--data-dir /nonexistent/data: no such folder"),
    (["--batch_size", "0"], "--batch-size must be a whole number >= 1"),
    (["--learning_rate", "-1"], "--learning-rate must be a number > 0"),
    (["--mixed-precision", "fp64"], "invalid choice: 'fp64'"),
    # its 16-pixel patches (test_maxvit in test_fixed_size_networks.py: what a model says)
    (["--model", "test_vit", "--image-size", "40"], "--image-size 40 is not a whole number of "
     "test_vit's 16-pixel patches: it would never see the last 8 rows and columns of each "
     "image; use --image-size 32 or 48"),
    (["--pretrained", "/nonexistent.safetensors"],
     "--pretrained /nonexistent.safetensors: no such"),

    (["--world_size", "2"], "--world_size 2 without a launcher needs --rank and --dist_url"),
    (["--gpu_ids", "0,1"], "--gpu_ids 0,1 given but this machine has no CUDA device"),
    (["--batch_size", "512", "--synthetic-train-size", "100"], "fewer than one global batch"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[m[:30] for _, m in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_leaves_outputs_alone(tmp_path, capsys, monkeypatch,
                                                               argv, message):
    """... and before the start-up's speed probe, which would run the model for seconds first
    (here it fails the run instead)."""
    import accel_train.trainer

    def probed(*args, **kwargs):
        raise AssertionError("the speed probe ran before the refusal")
    monkeypatch.setattr(accel_train.trainer, "speed_for_run", probed)
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(argv + ["--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0, err
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_an_exports_onnx_file_as_pretrained_weights_is_named_so(tmp_path, capsys):
    """An export holds model.onnx beside model.safetensors; the ONNX file given to
    --pretrained was reported as torch's refused pickle."""
    onnx = tmp_path / "export" / "model.onnx"
    onnx.parent.mkdir()
    onnx.write_bytes(b"\x08\x07\x12\x07pytorch")  # an ONNX protobuf's first bytes
    assert main(["--pretrained", str(onnx), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is an ONNX model, which training cannot start from; pass the " \
        "model.safetensors beside it" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_bad_input_from_a_real_process_has_no_traceback(tmp_path, cifar10_layout):
    result = accel_train("--data-dir", str(cifar10_layout), "--label-column", "nope",
                         "--max-train-samples", "64", "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "accel_train: error: --label-column 'nope' is not a column of this dataset; its columns "
        "are: img, label"]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_an_existing_run_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"type": "epoch", "step": 5}\n')
    assert main(["--output-dir", str(out)]) == 2
    assert "already holds a run; pass --resume auto" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == '{"type": "epoch", "step": 5}\n'


def test_unreadable_image_when_decoding_per_step(tmp_path, capsys):
    import datasets
    from test_data import CLASSES, _image, _png_bytes
    rows = {"image": [{"bytes": _png_bytes(_image(i % 2, i)), "path": None} for i in range(8)],
            "label": [i % 2 for i in range(8)]}
    rows["image"][5] = {"bytes": b"\x89PNG broken", "path": None}
    ds = datasets.Dataset.from_dict(rows, features=datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES[:2])}))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    ds.select(range(4)).to_parquet(str(tmp_path / "test.parquet"))
    capsys.readouterr()  # drop the parquet writer's progress bars
    code = main(["--data-dir", str(tmp_path), "--in-memory", "never", "--num-workers", "1",
                 *PINNED, "--model", "test_resnet", "--batch_size", "4", "--output-dir",
                 str(tmp_path / "run"), "--bad-images", "error"])
    err = capsys.readouterr().err.strip()  # datasets' own progress bars may precede it
    assert code == 2 and "Traceback" not in err
    assert "image train.parquet row 5 cannot be decoded" in err.splitlines()[-1]
    assert err.splitlines()[-1].startswith("accel_train: error: ")


def test_gpus_that_torch_cannot_use_are_named_in_one_warning(tmp_path, monkeypatch):
    """A machine whose NVIDIA driver is older than torch's CUDA build: torch sees no GPU and the
    run trains on the CPU; one warning names the driver (read from the kernel module's file, here
    a copy in /proc's format) and the CUDA torch was built for."""
    from accel_train.run import distributed
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.82.01  Thu Oct 28 "
                    "20:14:04 UTC 2021\nGCC version:  gcc version 9.3.0\n")
    assert distributed.nvidia_driver_version(proc) == "470.82.01"
    assert distributed.nvidia_driver_version(tmp_path / "absent") is None
    monkeypatch.setattr(distributed, "NVIDIA_DRIVER_FILE", proc)  # the probe's seam
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = accel_train_here(*TINY_TRAIN, "--max-steps", "1", "--output-dir",
                              str(tmp_path / "run"), check=True)
    said = [line for line in (result.stdout + result.stderr).splitlines() if "driver" in line]
    assert len(said) == 1 and "driver 470.82.01" in said[0] and "cannot use them" in said[0]
    assert (f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only") \
        in said[0]
    monkeypatch.setattr(distributed, "NVIDIA_DRIVER_FILE", tmp_path / "no")
    quiet = accel_train_here(*TINY_TRAIN, "--max-steps", "1", "--output-dir",
                             str(tmp_path / "run2"), check=True)
    assert "driver" not in quiet.stdout + quiet.stderr


def _files_held_open_under(folder) -> list[str]:
    """The files under `folder` this process holds open, as Linux lists them (/proc/self/fd)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (the listing's own descriptor, closed by now)
            continue
        if target.startswith(f"{folder}{os.sep}"):
            held.append(target)
    return held


# the tests that list this process's open files (_files_held_open_under)
reads_open_files = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                                      reason="reads Linux's /proc/self/fd")


class _FailsAtTheFirstStep(Callback):
    def on_step_end(self, trainer, step: int) -> None:
        raise RuntimeError("a program's callback failed")


@reads_open_files
def test_a_run_in_a_program_closes_its_log_whether_it_ends_or_fails(tmp_path):
    """A program may train many runs in one process (a sweep): each run's logs/rank0.log is
    closed at its end, and at an error, not held open until the next run replaces it."""
    accel_train_here(*TINY_TRAIN, "--max-steps", "2", "--output-dir", str(tmp_path / "ends"),
                     check=True)
    assert (tmp_path / "ends" / "logs" / "rank0.log").stat().st_size > 0
    assert _files_held_open_under(tmp_path) == []
    with pytest.raises(RuntimeError, match="a program's callback failed"):
        run_training(TrainConfig(**QUICK, max_steps=2, output_dir=str(tmp_path / "fails")),
                     callbacks=[_FailsAtTheFirstStep()])
    assert "the run stopped on an error" in \
        (tmp_path / "fails" / "logs" / "rank0.log").read_text()
    assert _files_held_open_under(tmp_path) == []
    # the first run's log holds nothing of the second's (its handler gone, not only closed:
    # a closed FileHandler left on the logger opens its file again to write)
    assert str(tmp_path / "fails") not in (tmp_path / "ends" / "logs" / "rank0.log").read_text()


@reads_open_files
def test_a_start_that_fails_once_its_log_opened_closes_the_log(tmp_path, monkeypatch):
    """The start opens the rank log and then records the run: a record that cannot be written
    (a full disk, planted) ends the start with the log closed, not left to the collector."""
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_records, "write_run_config", disk_full)
    with pytest.raises(OSError, match="No space left"):
        run_training(TrainConfig(**QUICK, max_steps=2, output_dir=str(tmp_path / "full")))
    assert (tmp_path / "full" / "logs" / "rank0.log").stat().st_size > 0  # it had opened
    assert _files_held_open_under(tmp_path) == []


@reads_open_files
def test_what_is_said_after_the_log_closed_reaches_the_console_only(tmp_path, capsys):
    report = Reporter()
    report.open_log(tmp_path, 0, "the first line")
    report.say("said while open")
    report.close_log()
    report.say("said after the end")
    report.warn("warned after the end")
    logged = (tmp_path / "rank0.log").read_text()
    assert "said while open" in logged and "after the end" not in logged, logged
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "said after the end", "warning: warned after the end"]
    assert _files_held_open_under(tmp_path) == []
