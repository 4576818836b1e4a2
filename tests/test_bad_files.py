"""Weight files cut short (an interrupted download, copy or write) or not what their names say,
given to every command that reads them: one line naming the file (exit 2), never a traceback,
and the run folder's files byte-identical before and after.  A table: each row is a file kind,
a corruption and the commands that read it."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

from conftest import TINY_TRAIN, accel_train_here


def _cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _random_bytes(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 16)


CORRUPTIONS = {"cut in half": _cut_in_half, "random bytes": _random_bytes}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bad_files") / "run"
    accel_train_here(*TINY_TRAIN, "--max-steps", "1", "--output-dir", str(out), check=True)
    return out


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _library_says(path: Path) -> str:
    """What safetensors itself says of the file (first line): the reason the line must give."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as handle:
            handle.keys()
    except Exception as err:  # noqa: BLE001 (whatever the library raises is the oracle)
        return str(err).splitlines()[0]
    raise AssertionError(f"{path} reads as safetensors")


def _one_line(result, path: Path) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(path) in lines[0]
    return lines[0]


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("command", ["eval", "predict", "export"])
def test_a_runs_weights_damaged(trained, tmp_path, command, corruption):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    weights = run / "model.safetensors"
    CORRUPTIONS[corruption](weights)
    before = _hashes(run)
    image = tmp_path / "x.png"
    from PIL import Image
    Image.new("RGB", (32, 32), (200, 30, 30)).save(image)
    extra = {"eval": [], "predict": [str(image)], "export": ["-o", str(tmp_path / "export")]}
    result = accel_train_here(command, str(run), *extra[command])
    line = _one_line(result, weights)
    assert "not a readable safetensors file" in line and "train again" in line
    assert f"({_library_says(weights)[:160]})" in line
    assert _hashes(run) == before and not (tmp_path / "export").exists()


def _weights_file(path: Path) -> Path:
    state = timm.create_model("test_resnet", num_classes=10).state_dict()
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)
    return path


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_pretrained_weights_whole_are_taken(tmp_path, suffix):
    """The control: the same files undamaged pass the check and train."""
    weights = _weights_file(tmp_path / f"weights{suffix}")
    accel_train_here(*TINY_TRAIN, "--max-steps", "1", "--pretrained", str(weights),
                     "--output-dir", str(tmp_path / "run"), check=True)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_pretrained_weights_of_another_network_are_one_line(tmp_path, suffix):
    """test_vit's weights for test_resnet: no key name matches, and timm logged the unexpected
    keys and trained from random weights (exit 0).  A folder is named as one."""
    state = timm.create_model("test_vit", num_classes=10).state_dict()
    weights = tmp_path / f"vit{suffix}"
    if suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(weights))
    else:
        torch.save(state, weights)
    out = tmp_path / "run"
    line = _one_line(accel_train_here(*TINY_TRAIN, "--max-steps", "1", "--pretrained",
                                      str(weights), "--output-dir", str(out)), weights)
    assert line.endswith("none of its weights fit model test_resnet (no tensor of it was "
                         "loaded: weights of another network); pass weights saved from "
                         "test_resnet"), line
    assert not out.exists()
    line = _one_line(accel_train_here(*TINY_TRAIN, "--pretrained", str(tmp_path),
                                      "--output-dir", str(out)), tmp_path)
    assert "is a folder; pass the weights file in it" in line


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_pretrained_weights_damaged(tmp_path, suffix, corruption):
    """--pretrained with a file of test_resnet's weights, damaged: one line naming it, no run
    folder made.  (Random bytes in a .pth are not a zip archive at all: torch then says the file
    does not fit, still in one line.)"""
    weights = _weights_file(tmp_path / f"weights{suffix}")
    CORRUPTIONS[corruption](weights)
    out = tmp_path / "run"
    result = accel_train_here(*TINY_TRAIN, "--max-steps", "1", "--pretrained", str(weights),
                              "--output-dir", str(out))
    line = _one_line(result, weights)
    assert line.startswith(f"accel_train: error: --pretrained {weights}")
    if suffix == ".safetensors":
        assert f"is not a readable safetensors file ({_library_says(weights)[:160]})" in line
    elif corruption == "cut in half":  # a zip archive without its end
        assert "is a torch weights file without its end" in line
    else:  # not a zip at all: left to torch, whose refusal timm passes on
        assert "does not fit model" in line
    assert "fetch or copy it again" in line or "does not fit model" in line
    assert not out.exists()


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("command", ["train", "check-data"])
def test_a_parquet_file_damaged(cifar10_layout, tmp_path, command, corruption):
    data = tmp_path / "data"
    shutil.copytree(cifar10_layout, data)
    CORRUPTIONS[corruption](data / "train.parquet")
    out = tmp_path / "run"
    args = {"train": [*TINY_TRAIN, "--data-dir", str(data), "--output-dir", str(out)],
            "check-data": ["check-data", "--data-dir", str(data)]}[command]
    line = _one_line(accel_train_here(*args), data / "train.parquet")
    assert "is not a readable parquet file" in line and "copy it again" in line
    assert not out.exists()


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("corruption", [*CORRUPTIONS, "empty"])
def test_a_run_lock_damaged(trained, tmp_path, corruption):
    """The run folder's run.lock (accel_train/run/runlock.py) cut short, garbage or empty, found by
    a --resume auto: one line naming it and what to do (it may be a lock being written just now, so
    it is never taken for stale), the folder byte-identical."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    lock = run / "run.lock"
    lock.write_text('{"host": "vm", "pid": 1, "started": null, "boot_id": null, "job": null, '
                    '"token": "0123456789abcdef"}\n')
    {**CORRUPTIONS, "empty": _empty}[corruption](lock)
    before = _hashes(run)
    line = _one_line(accel_train_here(*TINY_TRAIN, "--max-steps", "2", "--output-dir", str(run),
                                      "--resume", "auto"), lock)
    assert line == (f"accel_train: error: {lock} cannot be read (not a lock record: empty, cut "
                    f"short or garbage); another start may be writing it just now: if no run "
                    f"uses {run}, delete {lock} and start again")
    assert _hashes(run) == before
