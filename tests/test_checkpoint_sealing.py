"""A checkpoint sealed on a thread while training goes on (run/save_finishing.py): the save
returns with every part written and the folder still `.tmp-`; the manifest, the rename and the
pruning follow on another thread; the next save, the run's end and a stop signal wait for it;
what fails in it is raised once, where the run waits, and leaves the older checkpoints whole.

The sealing is held at its start by an event (the module's own write_manifest, wrapped), so
every order below is forced, not raced."""

from __future__ import annotations

import errno
import re
import threading

import pytest

from accel_train.base.errors import DISK_FULL_EXIT, RunStopped
from accel_train.callbacks import Callback
from accel_train.cli import build_train_parser, config_from_args
from accel_train.trainer import run_training
from accel_train.run import checkpoint as ck
from accel_train.run.checkpoint import Checkpointer, verify
from accel_train.run.resume import resolve_resume
import test_checkpoint
from test_checkpoint import state, tree_digest

from conftest import TINY_TRAIN
from test_loader_workers import StopAtStep  # SIGTERM at a step: a stop signal's save

bundle = test_checkpoint.bundle  # the fixture: an Accelerator, a tiny model, a Checkpointer
# 64 images, batch 16: 4 steps an epoch, 3 epochs
TINY_TRAIN_3_EPOCHS = [*[a for a in TINY_TRAIN if a not in ("--epochs", "1")], "--epochs", "3",
                       "--synthetic-train-size", "64", "--checkpoint-every", "3",
                       "--keep-checkpoints", "10"]


class HeldSealing:
    """write_manifest held until `release`, each call's step and thread recorded."""

    def __init__(self, monkeypatch, fail: Exception | None = None):
        self.gate, self.calls, self.fail = threading.Event(), [], fail
        real = ck.write_manifest

        def held(directory, step):
            self.calls.append((step, threading.current_thread().name))
            assert self.gate.wait(20), "the test never released the sealing"
            if self.fail is not None:
                raise self.fail
            real(directory, step)

        monkeypatch.setattr(ck, "write_manifest", held)

    def release(self):
        self.gate.set()


def save_at(saver: Checkpointer, step: int, **kwargs):
    saver.state.__dict__.update(state(step).__dict__)
    return saver.save(**kwargs)


def test_a_background_save_returns_with_its_parts_written_and_seals_on_another_thread(
        bundle, monkeypatch):
    saver, model, train_step, _ = bundle
    held = HeldSealing(monkeypatch)
    sealed = []
    train_step()
    path = save_at(saver, 3, background=True,
                   sealed=lambda p: sealed.append((p, (p / ck.MANIFEST).is_file())))
    tmp = saver.root / ".tmp-step_00000003"
    # returned while the sealing is held: every part on disk, nothing in place yet
    assert {"model.safetensors", "optimizer.bin", "trainer_state.json"} <= \
        {p.name for p in tmp.iterdir()}
    assert not path.exists() and sealed == []
    written = tree_digest(tmp)
    train_step()  # training goes on meanwhile, and changes nothing the save wrote
    assert tree_digest(tmp) == written
    held.release()
    saver.wait()
    assert [step for step, _ in held.calls] == [3]
    assert held.calls[0][1] != threading.main_thread().name
    assert verify(path) is None and not tmp.exists()
    assert sealed == [(path, True)]  # told once, with the folder in place
    saver.wait()  # nothing under way: nothing to do, nothing raised


def test_the_next_save_waits_for_the_sealing_and_prunes_only_after_its_own(bundle,
                                                                            monkeypatch):
    saver, _, train_step, _ = bundle
    saver.keep = 1
    order = []
    held = HeldSealing(monkeypatch)
    train_step()
    save_at(saver, 3, background=True, sealed=lambda p: order.append(("sealed", p.name)))
    releaser = threading.Timer(0.2, lambda: (order.append(("released",)), held.release()))
    releaser.start()
    train_step()
    path = save_at(saver, 6, sealed=lambda p: order.append(("sealed", p.name)))  # in line
    releaser.join()
    assert order == [("released",), ("sealed", "step_00000003"), ("sealed", "step_00000006")]
    assert [p.name for p in ck.list_checkpoints(saver.root)] == ["step_00000006"]
    assert verify(path) is None and not list(saver.root.glob(".tmp-*"))


def test_a_sealing_that_fails_is_raised_once_where_the_run_waits_and_loses_nothing(
        bundle, monkeypatch):
    saver, _, train_step, warnings = bundle
    saver.keep = 1
    train_step()
    save_at(saver, 3)
    before = tree_digest(saver.root / "step_00000003")
    held = HeldSealing(monkeypatch, fail=OSError(errno.EIO, "Input/output error"))
    train_step()
    save_at(saver, 6, background=True)
    held.release()
    with pytest.raises(OSError, match="Input/output error"):
        saver.wait()
    saver.wait()  # raised once
    assert [p.name for p in ck.list_checkpoints(saver.root)] == ["step_00000003"]
    assert tree_digest(saver.root / "step_00000003") == before  # not pruned, not touched
    assert resolve_resume(saver.root, "auto", warnings).name == "step_00000003"
    assert not (saver.root / ".tmp-step_00000006").exists()  # the next start discards it


def test_a_full_disk_while_sealing_stops_the_run_in_one_line_and_removes_the_partial_save(
        bundle, monkeypatch):
    saver, _, train_step, _ = bundle
    monkeypatch.setattr(ck, "free_bytes", lambda folder: 0)
    held = HeldSealing(monkeypatch, fail=OSError(errno.ENOSPC, "No space left on device"))
    train_step()
    save_at(saver, 4, background=True)
    held.release()
    with pytest.raises(RunStopped) as caught:
        train_step()
        save_at(saver, 8, background=True)  # the next save is where the run learns of it
    assert caught.value.exit_code == DISK_FULL_EXIT
    assert "of checkpoint step_00000004" in str(caught.value)
    assert list(saver.root.iterdir()) == []  # the partial save removed, step 8 never begun


def test_another_rank_is_told_once_its_parts_are_written_and_seals_nothing(bundle, monkeypatch):
    """A rank other than the main one writes its parts (the collective ones: Accelerate's), is
    told at once, and leaves the manifest, the rename and the pruning to the main process."""
    saver, _, train_step, warnings = bundle
    held = HeldSealing(monkeypatch)
    other = Checkpointer(saver.root, keep=1, warn=warnings, parts=saver.parts, is_main=False)
    (saver.root / ".tmp-step_00000005").mkdir(parents=True)  # the main process made it
    told = []
    train_step()
    path = save_at(other, 5, background=True, sealed=told.append)
    assert told == [path] and held.calls == []
    written = {p.name for p in (saver.root / ".tmp-step_00000005").iterdir()}
    assert "model.safetensors" in written  # Accelerate's part: every rank saves it
    assert "trainer_state.json" not in written  # the main process's alone
    assert not path.exists()
    other.wait()
    assert held.calls == []


@pytest.mark.parametrize("background", [False, True], ids=["in line", "background"])
def test_in_line_every_rank_waits_until_the_checkpoint_is_in_place(bundle, background):
    """What each of the save's barriers sees (every rank waits at them together): the last one
    of a save sealed in line comes after the rename, so that every rank returns with the
    checkpoint in place; one sealed in the background has none after the parts."""
    saver, _, train_step, warnings = bundle
    seen = []
    final = saver.root / "step_00000002"
    waiting = Checkpointer(saver.root, keep=3, warn=warnings, parts=saver.parts,
                           barrier=lambda: seen.append(final.exists()))
    train_step()
    save_at(waiting, 2, background=background)
    waiting.wait()
    assert seen == ([False, False] if background else [False, False, True])


class SeesCheckpoints(Callback):
    def __init__(self):
        self.seen = []

    def on_checkpoint(self, trainer, path) -> None:
        self.seen.append((path.name, verify(path)))


@pytest.mark.parametrize("callbacks, stop", [((), None), ((SeesCheckpoints(),), None),
                                             ((StopAtStep(6),), 6)],
                         ids=["a run's own saves", "a callback sees them", "a stop signal"])
def test_a_runs_saves_are_sealed_on_a_thread_unless_something_is_to_see_them_complete(
        tmp_path, monkeypatch, callbacks, stop):
    """3 epochs of 4 steps, --checkpoint-every 3: saves at steps 3, 4 (epoch end), 6, 8, 9,
    12; every one complete at the end, and the log names each once, after it is sealed."""
    held = HeldSealing(monkeypatch)
    held.release()  # not held: each save's step and the thread that sealed it, as the run goes
    calls = held.calls
    out = tmp_path / "run"
    code = run_training(config_from_args(build_train_parser().parse_args(
        [*TINY_TRAIN_3_EPOCHS, "--output-dir", str(out)]), environ={}), list(callbacks))
    main = threading.main_thread().name
    steps = [3, 4, 6] if stop else [3, 4, 6, 8, 9, 12]
    assert [step for step, _ in calls] == steps
    watched = any(isinstance(c, SeesCheckpoints) for c in callbacks)
    expected = {step: main if watched or step == stop else "accel_train checkpoint sealing"
                for step in steps}
    assert dict(calls) == expected
    checkpoints = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == [f"step_{s:08d}" for s in steps]
    assert all(verify(p) is None for p in checkpoints)
    log = (out / "logs" / "rank0.log").read_text()
    assert [int(s) for s in re.findall(r"saved checkpoint \S+step_(\d+) \(", log)] == steps
    assert code == (143 if stop else 0)
    if watched:
        assert callbacks[0].seen == [(f"step_{s:08d}", None) for s in steps]
