"""A full disk while a checkpoint is written: one line naming the file, what a checkpoint takes
and what was free, and where to resume from; exit code 74 (errors.DISK_FULL_EXIT); the partial
`.tmp-step_*` folder removed, older checkpoints byte-identical; `--resume auto` then finishes
with the weights of a run that never stopped.  The disk "fills" through a seam: Accelerate's
part of the save writes its files, then one is cut short and the write fails as the OS (or a
library) reports a full disk."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accel_train.run import checkpoint as ck
from accel_train.run.checkpoint import AccelerateState
from conftest import TINY_TRAIN, accel_train_here

RUN = [*TINY_TRAIN, "--max-steps", "8", "--checkpoint-every", "3", "--keep-checkpoints", "5"]
FULL_AT_SAVE = 2  # the save of step 6; step 3's is complete


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _safetensors_error(path: Path) -> Exception:
    return Exception(f"Error while serializing: I/O error: {os.strerror(errno.ENOSPC)} "
                     f"(os error {errno.ENOSPC})")


FAILURES = {
    "OSError ENOSPC": lambda path: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)),
    "OSError EDQUOT": lambda path: OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path)),
    "safetensors' error": _safetensors_error,
}


def _fill_the_disk_on(monkeypatch, failure, seen: dict):
    original, saves = AccelerateState.save, []

    def save_then_fail(self, folder):
        original(self, folder)
        saves.append(folder)
        if len(saves) != FULL_AT_SAVE:
            return
        seen["older"] = _hashes(Path(folder).parent / "step_00000003")
        victim = Path(folder) / "optimizer.bin"
        victim.write_bytes(victim.read_bytes()[:100])  # the write that did not fit
        raise failure(victim)

    monkeypatch.setattr(AccelerateState, "save", save_then_fail)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same run, never stopped."""
    out = tmp_path_factory.mktemp("full_disk") / "reference"
    accel_train_here(*RUN, "--output-dir", str(out), check=True)
    return out


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_full_disk_during_a_save_stops_in_one_line_and_resume_finishes_it(
        tmp_path, monkeypatch, reference, failure):

    out, seen = tmp_path / "run", {}
    with monkeypatch.context() as patch:
        _fill_the_disk_on(patch, FAILURES[failure], seen)
        result = accel_train_here(*RUN, "--output-dir", str(out))
    checkpoints = out / "checkpoints"
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 74, result.stdout[-2000:] + result.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    line = lines[0]
    assert line.startswith(f"accel_train: error: no space left on the device of {checkpoints} "
                           f"(disk full or quota reached) while writing optimizer.bin of "
                           f"checkpoint step_00000006: ")  # the file that did not fit
    size = sum(p.stat().st_size for p in (checkpoints / "step_00000003").iterdir())
    assert f"a checkpoint of this run takes {size / 2**20:.1f} MiB" in line  # ~3 MiB
    assert f"--resume auto to continue from {checkpoints / 'step_00000003'}" in line
    assert not list(checkpoints.glob(".tmp-*"))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000003"]
    assert _hashes(checkpoints / "step_00000003") == seen["older"]
    assert not (out / "run.lock").exists()

    accel_train_here(*RUN, "--output-dir", str(out), "--resume", "auto", check=True)
    finished, expected = load_file(str(out / "model.safetensors")), \
        load_file(str(reference / "model.safetensors"))
    assert finished.keys() == expected.keys()
    assert all(torch.equal(finished[k], expected[k]) for k in expected)


def test_a_write_error_on_a_disk_with_space_keeps_its_traceback(tmp_path, monkeypatch):
    """torch.save's writer reports a full disk only as "unexpected pos": such an error counts as
    a full disk when the filesystem has (nearly) no space left, and stays a bug otherwise."""
    error = RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 576 vs 534")
    assert ck.out_of_space(error, tmp_path) is False
    monkeypatch.setattr(ck, "free_bytes", lambda path: 4096)
    assert ck.out_of_space(error, tmp_path) is True
    monkeypatch.undo()

    def broken(self, folder):
        raise RuntimeError("a bug in a part's save")

    monkeypatch.setattr(AccelerateState, "save", broken)
    with pytest.raises(RuntimeError, match="a bug in a part's save"):
        accel_train_here(*RUN, "--output-dir", str(tmp_path / "run"))
