"""checkpoint.py in one process, with a real Accelerator and a tiny model: atomic saves, the
manifest, finding the newest valid checkpoint, pruning, the refusal of pickled code, and keeping
the global batch on another number of processes."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from accel_train.run import checkpoint as ck
from accel_train.run import trainer_state as ts
from accel_train.run.checkpoint import (MANIFEST, AccelerateState, Checkpointer,
                                        find_latest_valid, recover_interrupted_saves, verify)
from accel_train.run.trainer_state import (STATE_FILE, TrainerState, check_same_held_out,
                                           read_state)
from accel_train.run.resume import accumulation_for, resolve_resume, set_aside_newer
from accel_train.cli import main
from accel_train.base.errors import UsageError
from accel_train.callbacks import Callback
from conftest import PINNED, TINY_TRAIN, accel_train_here, reset_accelerate


class Warnings(list):
    def __call__(self, text: str):
        self.append(text)


@pytest.fixture
def bundle(tmp_path):
    """An Accelerator with a prepared model, optimizer and scheduler, and a Checkpointer."""
    reset_accelerate()  # other tests in this process may have built one
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    warnings = Warnings()
    saver = Checkpointer(tmp_path / "checkpoints", keep=10, warn=warnings,
                         parts=[TrainerState(), AccelerateState(acc, warnings, models=[model])],
                         barrier=acc.wait_for_everyone)

    def train_step():
        loss = model(torch.randn(6, 4)).square().mean()
        acc.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    yield saver, model, train_step, warnings
    reset_accelerate()


def state(step: int) -> TrainerState:
    return TrainerState(step=step, epoch=0, samples_in_epoch=step * 32, samples_seen=step * 32,
                        world_size=2, batch_size=16, accumulation_steps=1, seed=0)


def save_as(saver: Checkpointer, run_state: TrainerState) -> Path:
    """Save with the run standing at `run_state` (the Checkpointer's part, updated in place)."""
    saver.state.__dict__.update(dataclasses.asdict(run_state))
    return saver.save()


def save_steps(saver: Checkpointer, train_step, *steps: int) -> dict[int, Path]:
    paths = {}
    for step in steps:
        train_step()
        paths[step] = save_as(saver, state(step))
    return paths


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_save_holds_everything_and_its_manifest_verifies(bundle):
    saver, _, train_step, _ = bundle
    path = save_steps(saver, train_step, 3)[3]
    assert path.name == "step_00000003"
    listed = set(json.loads((path / MANIFEST).read_text())["files"])
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            STATE_FILE} <= listed
    assert listed == {p.name for p in path.iterdir()} - {MANIFEST}
    assert verify(path) is None
    assert read_state(path).step == 3 and read_state(path).global_batch == 32
    assert not list(saver.root.glob(".tmp-*"))


def test_a_save_that_dies_before_its_manifest_never_appears(bundle, monkeypatch):
    """The crash lands between save_state and the manifest: the new checkpoint never gets its
    final name, nothing older is pruned, and the next start discards the temporary folder."""
    saver, _, train_step, warnings = bundle
    saver.keep = 1
    save_steps(saver, train_step, 3)
    before = tree_digest(saver.root)

    def die(*args):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(ck, "write_manifest", die)
    with pytest.raises(KeyboardInterrupt):
        save_steps(saver, train_step, 6)
    assert [p.name for p in ck.list_checkpoints(saver.root)] == ["step_00000003"]
    assert (saver.root / ".tmp-step_00000006" / "model.safetensors").is_file()
    assert tree_digest(saver.root / "step_00000003") == {
        k.split("/", 1)[1]: v for k, v in before.items()}
    assert resolve_resume(saver.root, "auto", warnings).name == "step_00000003"
    assert not (saver.root / ".tmp-step_00000006").exists()


def test_a_finished_save_killed_before_its_rename_is_completed(bundle):
    saver, _, train_step, warnings = bundle
    paths = save_steps(saver, train_step, 3, 6)
    os.replace(paths[6], saver.root / ".tmp-step_00000006")  # manifest written, rename lost
    (saver.root / ".tmp-step_00000009").mkdir()               # a save that never finished
    recover_interrupted_saves(saver.root, warnings)
    assert [p.name for p in ck.list_checkpoints(saver.root)] == ["step_00000006",
                                                                  "step_00000003"]
    assert verify(saver.root / "step_00000006") is None
    assert not list(saver.root.glob(".tmp-*"))
    assert any("completed the interrupted save" in w for w in warnings)


def test_the_newest_valid_checkpoint_is_found_and_bad_ones_are_named(bundle):
    saver, _, train_step, warnings = bundle
    paths = save_steps(saver, train_step, 3, 6, 9, 12)
    weights = paths[12] / "model.safetensors"                  # truncated
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (paths[9] / MANIFEST).unlink()                             # half-written
    optimizer = paths[6] / "optimizer.bin"                     # tampered, same size
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optimizer.write_bytes(bytes(data))

    assert find_latest_valid(saver.root, warnings) == paths[3]
    assert len(warnings) == 3
    assert "step_00000012" in warnings[0] and "model.safetensors does not match" in warnings[0]
    assert "step_00000009" in warnings[1] and "no manifest" in warnings[1]
    assert "step_00000006" in warnings[2] and "optimizer.bin does not match" in warnings[2]


def test_loading_restores_weights_exactly(bundle):
    saver, model, train_step, _ = bundle
    path = save_steps(saver, train_step, 3)[3]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    train_step()
    assert any(not torch.equal(saved[k], v) for k, v in model.state_dict().items())
    saver.state.step = 99
    saver.restore(path)
    assert saver.state.step == 3
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_pruning_keeps_the_newest_k_and_only_after_the_new_one_is_complete(bundle, monkeypatch):
    saver, _, train_step, _ = bundle
    saver.keep = 2
    save_steps(saver, train_step, 1, 2, 3)
    assert [p.name for p in ck.list_checkpoints(saver.root)] == ["step_00000003", "step_00000002"]
    monkeypatch.setattr(ck, "write_manifest", lambda *a: (_ for _ in ()).throw(OSError("full")))
    with pytest.raises(OSError):
        save_steps(saver, train_step, 4)
    assert [p.name for p in ck.list_checkpoints(saver.root)] == ["step_00000003", "step_00000002"]
    assert all(verify(p) is None for p in ck.list_checkpoints(saver.root))


def test_saving_the_same_step_twice_replaces_it_whole(bundle):
    saver, _, train_step, _ = bundle
    first = save_steps(saver, train_step, 5)[5]
    again = save_as(saver, TrainerState(**{**state(5).__dict__, "epoch": 1,
                                           "samples_in_epoch": 0}))
    assert again == first and verify(again) is None and read_state(again).epoch == 1
    assert not list(saver.root.glob(".tmp-*"))


def test_resuming_from_an_older_checkpoint_sets_the_newer_ones_aside(bundle):
    saver, _, train_step, warnings = bundle
    save_steps(saver, train_step, 3, 6, 9)
    set_aside_newer(saver.root, 3, warnings)
    assert [p.name for p in ck.list_checkpoints(saver.root)] == ["step_00000003"]
    assert sorted(p.name for p in saver.root.glob("superseded-*")) == [
        "superseded-step_00000006", "superseded-step_00000009"]


@pytest.mark.parametrize("victim", ["optimizer.bin", "random_states_0.pkl"])
def test_a_planted_pickle_is_refused_and_its_code_never_runs(bundle, tmp_path, victim):
    """optimizer.bin is loaded by Accelerate; random_states_0.pkl would be, inside a try/except
    that silently ignores any failure.  Either way the payload must not run, and the refusal
    must not depend on the checksum: the manifest is rewritten to match the planted file."""
    saver, _, train_step, _ = bundle
    path = save_steps(saver, train_step, 3)[3]
    marker = tmp_path / "pwned"
    payload = path / victim
    torch.save({"state": _Payload(str(marker))}, payload)
    torch.load(payload, weights_only=False)  # the control: unpickled naively, it runs
    assert marker.exists()
    marker.unlink()
    ck.write_manifest(path, read_state(path).step)
    assert verify(path) is None

    with pytest.raises(UsageError, match="refusing to load it"):
        saver.restore(path)
    assert not marker.exists()


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


@pytest.mark.parametrize("batch, procs, expected", [(16, 2, 1), (16, 1, 2), (8, 1, 4), (8, 4, 1),
                                                    (32, 1, 1)])
def test_the_global_batch_is_kept_by_recomputing_accumulation(batch, procs, expected):
    assert accumulation_for(state(1), batch, procs) == expected  # 16 x 2 x 1 = 32


@pytest.mark.parametrize("batch, procs, hint", [
    (16, 3, "use 1 or 2 process(es) with --batch-size 16"),
    (32, 2, "use --batch-size 16 or 8 or 4 or 2 on 2 process(es)"),
    (12, 1, "use --batch-size 32 or 16 or 8 or 4 on 1 process(es)"),
])
def test_a_global_batch_that_cannot_be_kept_says_what_would_work(batch, procs, hint):
    with pytest.raises(UsageError) as err:
        accumulation_for(state(1), batch, procs)
    message = str(err.value)
    assert "global batch of 32 (16 x 2 process(es) x 1 accumulation)" in message
    assert hint in message and "\n" not in message


def run_cli(capsys, *args: str) -> tuple[int, list[str]]:
    code = main([*TINY_TRAIN, *args])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("other, said", [
    (["--max-eval-samples", "10"],
     "the checkpoint's run evaluated 30 held-out images but this start has 10 (20 fewer); resume "
     "with the same data options (--max-eval-samples, the data's splits) on the same images, or "
     "start a new run"),
    (["--max-eval-samples", "30", "--sample-subset", "first"],
     "the checkpoint's run kept its sample limits' images by --sample-subset random, this "
     "start by first: they are other images; resume with --sample-subset random, or start a "
     "new run")], ids=["another count", "another rule"])
def test_a_resume_on_another_held_out_set_is_refused(tmp_path, capsys, other, said):
    """--max-eval-samples changed between starts, or the rule that keeps its images
    (--sample-subset: as many images, other ones): the run's evaluations (its best,
    --keep-best) would compare numbers of different image sets; one line, and nothing
    written.  With the same options it goes on."""
    out = tmp_path / "run"
    assert run_cli(capsys, "--output-dir", str(out), "--max-eval-samples", "30",
                   "--max-steps", "2")[0] == 0
    before = tree_digest(out)
    code, err = run_cli(capsys, "--output-dir", str(out), *other, "--max-steps", "4",
                        "--resume", "auto")
    assert code == 2 and len(err) == 1, err
    # the refusal, then the options that differ from the run's (tests/test_resume_options.py)
    assert err[0].split("; this start sets ")[0].endswith(said), err
    assert tree_digest(out) == before
    assert run_cli(capsys, "--output-dir", str(out), "--max-eval-samples", "30",
                   "--max-steps", "4", "--resume", "auto")[0] == 0


def test_a_checkpoint_from_before_the_subset_rule_kept_the_first_images():
    """A state without sample_subset (written before --sample-subset, when a limit kept the first
    N): a start that keeps random images is refused, one that keeps the first goes on, and one
    that cuts no split is not asked (nor is a start asked of a checkpoint that cut none: the
    counts differ, and say so: a streamed run's checkpoint is then refused for what it is)."""
    old = TrainerState.from_json({"seed": 0, "train_samples": 100})
    assert old.sample_subset is None
    with pytest.raises(UsageError, match="by --sample-subset first, this start by random"):
        ts.check_same_subset(old, "random")
    ts.check_same_subset(old, "first")
    ts.check_same_subset(old, "all")
    ts.check_same_subset(old, None)  # a state made without the field: nothing to compare
    ts.check_same_subset(dataclasses.replace(old, sample_subset="all"), "random")
    with pytest.raises(UsageError, match="by --sample-subset random, this start by first"):
        ts.check_same_subset(dataclasses.replace(old, sample_subset="random"), "first")


def test_a_carve_drawn_another_way_is_refused_and_one_from_before_the_option_was_random():
    """A state without held_out_carve (written before --val-stratify, whose carves were one
    random draw): a stratified start is refused, a random one goes on, and a start that
    carves nothing (the data's own splits) is not asked."""
    old = TrainerState.from_json({"seed": 0, "train_samples": 100})
    assert old.held_out_carve is None
    with pytest.raises(UsageError) as refused:
        ts.check_same_carve(old, "stratified")
    assert str(refused.value) == (
        "the checkpoint's run carved its validation images by one random draw, this start "
        "class by class: they are other images; resume without --val-stratify, or start a new "
        "run")
    ts.check_same_carve(old, "random")
    ts.check_same_carve(old, None)
    stratified = dataclasses.replace(old, held_out_carve="stratified")
    ts.check_same_carve(stratified, "stratified")
    ts.check_same_carve(stratified, None)
    with pytest.raises(UsageError, match="resume with --val-stratify"):
        ts.check_same_carve(stratified, "random")


def test_the_held_out_and_test_counts_are_each_compared_when_both_were_recorded():
    previous = TrainerState(held_out_samples=30, test_samples=20)
    check_same_held_out(previous, 30, 20)
    check_same_held_out(TrainerState(), 30, 20)  # a checkpoint from before these were recorded
    with pytest.raises(UsageError,
                       match=r"evaluated 20 test images but this start has 5 \(15 fewer\);"):
        check_same_held_out(previous, 30, 5)


def test_resume_from_a_bad_checkpoint_fails_in_one_line_and_touches_nothing(bundle, tmp_path,
                                                                           capsys):
    saver, _, train_step, _ = bundle
    paths = save_steps(saver, train_step, 3, 6)
    (paths[6] / STATE_FILE).write_text("{}")  # tampered
    (saver.root / ".tmp-step_00000009").mkdir()  # and a killed save, which a good start removes
    (saver.root / ".tmp-step_00000009" / "model.safetensors").write_bytes(b"partial")
    before = tree_digest(saver.root)
    out = str(tmp_path / "run")

    code, err = run_cli(capsys, "--output-dir", out, "--checkpoint", str(saver.root),
                        "--resume", str(paths[6]))
    assert code == 2 and len(err) == 1, err
    assert str(paths[6]) in err[0] and "trainer_state.json does not match its checksum" in err[0]

    code, err = run_cli(capsys, "--output-dir", out, "--resume", str(tmp_path / "nowhere"))
    assert code == 2 and len(err) == 1 and "no such checkpoint folder" in err[0], err

    assert tree_digest(saver.root) == before
    assert not Path(out).exists()


def test_a_new_run_refuses_a_checkpoint_folder_that_holds_checkpoints(bundle, tmp_path, capsys):
    saver, _, train_step, _ = bundle
    save_steps(saver, train_step, 3)
    before = tree_digest(saver.root)
    code, err = run_cli(capsys, "--output-dir", str(tmp_path / "new"), "--checkpoint",
                        str(saver.root))
    assert code == 2 and len(err) == 1 and "already holds checkpoints" in err[0], err
    assert tree_digest(saver.root) == before


def test_a_resume_that_would_change_the_data_order_is_refused(bundle, tmp_path, capsys):
    saver, _, train_step, _ = bundle
    out = tmp_path / "run"
    code = main([*TINY_TRAIN, "--max-steps", "2", "--checkpoint-every", "1", "--output-dir",
                 str(out)])
    assert code == 0
    capsys.readouterr()
    for flags, message in ((["--seed", "1"], "trained with --seed 0"),
                           (["--synthetic-train-size", "128"],
                            "the checkpoint was trained on 256 training images but this start "
                            "has 128 (128 fewer): images were added to or removed from the data "
                            "since, or its options changed (--max-train-samples, --val-fraction, "
                            "...); resume on the same images with the same options, or start a "
                            "new run (--pretrained RUN/model.safetensors goes on from its "
                            "weights)")):
        code, err = run_cli(capsys, *flags, "--max-steps", "2", "--output-dir", str(out),
                            "--resume", "auto")
        assert code == 2 and len(err) == 1 and message in err[0], err


def test_the_best_held_out_top1_counts_the_ema_weights_the_run_may_save():
    """The run's closing line ("best held-out top-1") read the raw weights' best while the EMA
    weights, better, were the ones saved."""
    run_state = TrainerState()
    run_state.note_evaluation({"eval_top1": 0.30, "eval_ema_top1": 0.25})
    run_state.note_evaluation({"eval_top1": 0.1094, "eval_ema_top1": 0.1406})
    assert (run_state.best_top1, run_state.eval_top1, run_state.ema_top1) == (0.30, 0.1094, 0.1406)
    run_state.note_evaluation({"eval_top1": 0.31})  # (no --model-ema)
    assert run_state.best_top1 == 0.31
    later = TrainerState()
    later.note_evaluation({"eval_top1": 0.1094, "eval_ema_top1": 0.1406})
    assert later.best_top1 == 0.1406


def test_a_finished_run_resumed_again_does_nothing_and_one_killed_in_its_end_finishes_it(
        tmp_path):
    """The test split is evaluated once, at the end: --resume auto of a run already finished
    trains nothing and writes nothing; one killed after its last checkpoint writes what its
    end had left (the model, the test record), and only that."""
    from PIL import Image
    data = tmp_path / "data"
    for split, count in (("train", 8), ("val", 2), ("test", 2)):
        for cls in ("a", "b"):
            (data / split / cls).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (16, 16), (200 * (cls == "a"), 20 * i, 90)).save(
                    data / split / cls / f"{i}.png")
    # pinned: solid-colour images train to NaN within 3 steps in bf16, which auto may choose
    command = ["--data-dir", str(data), "--model", "test_resnet", "--batch-size", "4",
               "--max-steps", "3", "--warmup-epochs", "0", "--progress", "log", "--no-plots",
               *PINNED, "--output-dir", str(tmp_path / "run")]
    run = tmp_path / "run"
    accel_train_here(*command, check=True)
    written = {path: path.stat().st_mtime_ns for path in run.rglob("*") if path.is_file()}
    again = accel_train_here(*command, "--resume", "auto", check=True)
    assert f"{run} finished: it trained its 3 steps" in again.stdout, again.stdout
    assert "test top-1" not in again.stdout and "Epoch" not in again.stdout
    # nothing written: no resume record, no second config, the same model
    assert {path: path.stat().st_mtime_ns for path in run.rglob("*") if path.is_file()} == written
    # killed inside its end, after the model and before the test record: the end is finished
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(
        line + "\n" for line in lines if json.loads(line)["type"] != "test"))
    ended = accel_train_here(*command, "--resume", "auto", check=True)
    assert "test top-1" in ended.stdout and "nothing to do" not in ended.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "test"] == [3], records
    # a damaged config.json: the end is written again rather than trusted (or refused)
    (run / "config.json").write_text("{not json")
    ended = accel_train_here(*command, "--resume", "auto", check=True)
    assert "saved" in ended.stdout and "test top-1" not in ended.stdout, ended.stdout
    # killed before the final model was written: written, and not tested a second time
    (run / "model.safetensors").unlink()
    (run / "config.json").unlink()
    ended = accel_train_here(*command, "--resume", "auto", check=True)
    assert "saved" in ended.stdout and "test top-1" not in ended.stdout, ended.stdout
    assert json.loads((run / "config.json").read_text())["accel_train"]["step"] == 3


class BatchLabels(Callback):
    """Each optimizer step's batch labels, by the step it makes (accumulation 1)."""

    def __init__(self):
        self.by_step: dict[int, list[int]] = {}

    def on_batch_start(self, trainer, batch) -> None:
        self.by_step[trainer.state.step + 1] = batch.labels.tolist()


def test_a_longer_run_resumed_where_max_steps_ended_mid_epoch_trains_the_rest_of_it(tmp_path):
    """--max-steps 6 ends inside the first epoch (14 steps of 16 images); the same run resumed
    with --max-steps 12 goes on in that epoch: its steps 7-12 take the batches that an
    uninterrupted --max-steps 12 run takes there, and it ends 12 batches into epoch 1.  (It
    had stepped to epoch 2, skipping the rest of epoch 1.)"""
    whole, first, longer = BatchLabels(), BatchLabels(), BatchLabels()
    accel_train_here(*TINY_TRAIN, "--max-steps", "12", "--output-dir", str(tmp_path / "whole"),
                     check=True, callbacks=[whole])
    out = tmp_path / "run"
    accel_train_here(*TINY_TRAIN, "--max-steps", "6", "--output-dir", str(out), check=True,
                     callbacks=[first])
    state = json.loads((out / "checkpoints" / "step_00000006" / STATE_FILE).read_text())
    assert (state["epoch"], state["samples_in_epoch"]) == (0, 6 * 16)
    resumed = accel_train_here(*TINY_TRAIN, "--max-steps", "12", "--output-dir", str(out),
                               "--resume", "auto", check=True, callbacks=[longer])
    assert "at step 6 (epoch 1, 96 samples into it)" in resumed.stdout, resumed.stdout
    assert sorted(longer.by_step) == list(range(7, 13))
    assert {step: whole.by_step[step] for step in longer.by_step} == longer.by_step
    assert first.by_step == {step: whole.by_step[step] for step in range(1, 7)}
    state = json.loads((out / "checkpoints" / "step_00000012" / STATE_FILE).read_text())
    assert (state["epoch"], state["samples_in_epoch"]) == (0, 12 * 16)
    # the finished run resumed once more trains nothing and records nothing new
    records = (out / "metrics.jsonl").read_text()
    again = accel_train_here(*TINY_TRAIN, "--max-steps", "12", "--output-dir", str(out),
                             "--resume", "auto", check=True)
    assert "Epoch" not in again.stdout and (out / "metrics.jsonl").read_text().startswith(records)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == \
        ["step_00000006", "step_00000012"]


def test_a_resume_at_another_image_size_or_model_is_refused_in_one_line_and_moves_nothing(
        tmp_path, capsys):
    """A finished run resumed with another --image-size (its final model still records the
    size it trained at: it was rewritten with the new one), another --model, or options that
    group the parameters otherwise: one line naming what the checkpoint holds."""
    out = tmp_path / "run"
    assert main([*TINY_TRAIN, "--max-steps", "2", "--checkpoint-every", "1", "--output-dir",
                 str(out)]) == 0
    capsys.readouterr()
    before = tree_digest(out)
    for flags, message in (
            (["--image-size", "40"], "was trained at --image-size 32 but this start asks for "
                                     "40; resume with --image-size 32"),
            (["--model", "cifar_convnet_s"], "was trained with --model test_resnet (10 classes) "
                                             "but this start builds cifar_convnet_s (10 classes)"),
            # options that group the parameters otherwise: torch's ValueError was a traceback
            (["--freeze-backbone"], "holds the optimizer state of other parameter groups than "
                                    "this start builds"),
            (["--layer-decay", "0.7"], "resume with the --freeze-backbone, --layer-decay"),
            # the weights learned from inputs scaled by the data's statistics
            (["--mean", "0.5"], "was trained on images normalized with --mean "),
            (["--std", "0.2", "0.3", "0.4"], "but this start normalizes with --mean ")):
        code, err = run_cli(capsys, *flags, "--max-steps", "2", "--output-dir", str(out),
                            "--resume", "auto")
        assert code == 2 and len(err) == 1, err
        assert message in err[0], err
        assert tree_digest(out) == before
    code, err = run_cli(capsys, "--image-size", "32", "--max-steps", "2", "--output-dir",
                        str(out), "--resume", "auto")
    assert code == 0, err  # the size it trained at, given explicitly: resumes
    # the normalization it trained with, given explicitly (the values the refusal names)
    _, err = run_cli(capsys, "--mean", "0.5", "--max-steps", "2", "--output-dir", str(out),
                     "--resume", "auto")
    recorded = json.loads((out / "checkpoints" / "step_00000002" / "model_config.json")
                          .read_text())
    said = err[0].split("resume with ")[1].split(", or")[0].split()
    assert said == ["--mean", *(f"{v:.6g}" for v in recorded["mean"]),
                    "--std", *(f"{v:.6g}" for v in recorded["std"])], err
    assert recorded["mean"] != [0.5] * 3
    code, err = run_cli(capsys, *said, "--max-steps", "2", "--output-dir", str(out),
                        "--resume", "auto")
    assert code == 0, err


def test_a_resume_on_other_classes_of_the_same_count_is_refused_and_moves_nothing(tmp_path,
                                                                                  capsys):
    """Two image folders of as many images in two classes each, named a/b and xx/yy: the
    count and the training-set size agree, so only the names tell.  Resumed on the second,
    the run went on and its final model named xx, yy for outputs trained as a, b."""
    from PIL import Image
    for data, names in (("ab", ("a", "b")), ("xy", ("xx", "yy"))):
        for label, name in enumerate(names):
            folder = tmp_path / data / "train" / name
            folder.mkdir(parents=True)
            for i in range(8):
                Image.new("RGB", (16, 16), (200 * label, 20 * i, 90)).save(folder / f"{i}.png")
    out = tmp_path / "run"
    # precision pinned: chosen by timing, it could differ from the one Accelerate already holds
    # in this process from an earlier test (it keeps one a process)
    flags = ["--model", "test_resnet", "--batch-size", "4", "--max-steps", "2",
             "--warmup-epochs", "0", "--progress", "log", "--no-plots", *PINNED,
             "--output-dir", str(out)]
    assert main(["--data-dir", str(tmp_path / "ab"), *flags]) == 0
    capsys.readouterr()
    before = tree_digest(out)
    code, err = run_cli(capsys, "--data-dir", str(tmp_path / "xy"), *flags, "--max-steps", "3",
                        "--resume", "auto")
    assert code == 2 and len(err) == 1, err
    assert "was trained on classes a, b but this start's data has xx, yy (a -> xx, b -> yy)" \
        in err[0], err
    assert tree_digest(out) == before


def test_a_resume_with_another_optimizer_is_refused_in_one_line_and_moves_nothing(tmp_path,
                                                                                capsys):
    """SGD's state (the default --optimizer) resumed with --optimizer adamw: torch would load
    it into Adam and fail inside (KeyError 'step'); instead one line naming both optimizers
    and the checkpoint, exit 2, every file of the run as it was.  The checkpoint's own
    optimizer goes on (the control)."""
    import hashlib
    out = tmp_path / "run"
    assert main([*TINY_TRAIN, "--max-steps", "2", "--checkpoint-every", "1", "--output-dir",
                 str(out)]) == 0
    capsys.readouterr()

    def files() -> dict:
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(out.rglob("*")) if p.is_file()}

    before = files()
    code, err = run_cli(capsys, "--optimizer", "adamw", "--max-steps", "3", "--output-dir",
                        str(out), "--resume", "auto")
    assert code == 2 and len(err) == 1, err
    assert err[0].split("; this start sets ")[0].endswith(
        f"--optimizer adamw: {out / 'checkpoints' / 'step_00000002'} holds the state of "
        f"--optimizer sgd; resume with --optimizer sgd, or start a new run in another "
        f"--output-dir"), err
    assert "--optimizer adamw (the run: sgd), --max-steps 3 (the run: 2)" in err[0], err
    assert files() == before
    code, err = run_cli(capsys, "--optimizer", "sgd", "--max-steps", "3", "--output-dir",
                        str(out), "--resume", "auto")
    assert code == 0, err


def test_a_resumed_state_keeps_every_field_of_the_checkpoint_but_the_process_layout(tmp_path):
    """Field by field restoring once dropped what it did not name; every field of the dataclass
    (including any added later) must come back from the checkpoint through its file, except
    the ones this start decides for itself (its process layout, how it computes, where it
    decodes JPEGs and whether it holds photographs on the device)."""
    layout = {"world_size": 1, "batch_size": 64, "accumulation_steps": 2, "precision": "bf16",
              "channels_last": True, "decoded_on_device": True, "host_decode_share": 0.25,
              "photos_held": True}
    assert set(layout) == set(TrainerState.THIS_START)
    saved = TrainerState()
    for number, field in enumerate(dataclasses.fields(TrainerState), start=3):
        value = getattr(saved, field.name)
        setattr(saved, field.name, 0.5 * number if isinstance(value, float) or value is None
                else number)
    saved.save(tmp_path)
    resumed = TrainerState(**layout, seed=saved.seed, train_samples=saved.train_samples,
                           eval_metric=saved.eval_metric)  # (a resume keeps the metric)
    resumed.load(tmp_path)
    for field in dataclasses.fields(TrainerState):
        expected = layout.get(field.name, getattr(saved, field.name))
        assert getattr(resumed, field.name) == expected, field.name
    assert set(f.name for f in dataclasses.fields(TrainerState)) - set(layout)  # something kept


def test_a_checkpoint_of_another_format_is_refused_before_anything_moves(bundle, tmp_path,
                                                                         capsys):
    """A checkpoint written before the parts were saved by one owner (no "format" in its
    manifest): --resume auto says so in one line, exit 2, and neither sets it aside nor starts
    from scratch (which a requeue loop would do silently)."""
    saver, _, train_step, _ = bundle
    paths = save_steps(saver, train_step, 3, 6)
    for path in paths.values():
        manifest = json.loads((path / MANIFEST).read_text())
        del manifest["format"]
        (path / MANIFEST).write_text(json.dumps(manifest))
    before = tree_digest(saver.root)
    out = tmp_path / "run"
    code, err = run_cli(capsys, "--output-dir", str(out), "--checkpoint", str(saver.root),
                        "--resume", "auto")
    assert code == 2 and len(err) == 1, err
    assert "step_00000006 is in checkpoint format 1" in err[0] and "writes format 2" in err[0]
    assert tree_digest(saver.root) == before


def test_an_fp16_grad_scaler_state_is_saved_vetted_and_restored(bundle, tmp_path):
    """With fp16 on CUDA, Accelerate writes the GradScaler's state into every checkpoint
    (scaler.pt, with torch.save).  No CUDA here, so the Accelerator is handed a CPU GradScaler
    (torch itself runs fp16 autocast with one on a CPU); Accelerate's own save_state and
    load_state then write and read the file exactly as on a GPU.  The file must pass the safe
    loading (plain numbers, no pickled objects) and come back exactly; a planted object in it
    must be refused."""
    saver, _, train_step, _ = bundle
    acc = saver.parts[1].accelerator
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 13, growth_interval=7)
    acc.scaler.scale(torch.ones(()))  # its first use makes its scale and growth tensors
    acc.scaler.update(2.0 ** 9)  # a state that is not the default: scale 512
    saved = acc.scaler.state_dict()
    path = save_steps(saver, train_step, 4)[4]
    assert (path / "scaler.pt").is_file() and verify(path) is None

    acc.scaler = torch.amp.GradScaler("cpu")  # a fresh start's scaler
    saver.restore(path)
    assert acc.scaler.state_dict() == saved == {**saved, "scale": 512.0, "growth_interval": 7}

    marker = tmp_path / "pwned"
    torch.save({**saved, "scale": _Payload(str(marker))}, path / "scaler.pt")
    ck.write_manifest(path, read_state(path).step)
    with pytest.raises(UsageError, match="refusing to load it"):
        saver.restore(path)
    assert not marker.exists()
    acc.scaler = None


def test_keep_best_keeps_the_highest_evaluated_top1_besides_the_newest(bundle):
    """keep=1, keep_best=2: the newest, plus the two best of those saved right after an
    evaluation (a mid-epoch save carries an older evaluation and does not count)."""
    saver, _, train_step, _ = bundle
    saver.keep, saver.keep_best = 1, 2
    # (step, top-1 of the last evaluation, the step it was made at)
    history = [(2, 0.40, 2), (4, 0.70, 4), (5, 0.70, 4), (6, 0.55, 6), (8, 0.65, 8),
               (9, 0.65, 8)]
    for step, top1, eval_step in history:
        train_step()
        save_as(saver, dataclasses.replace(state(step), eval_top1=top1, eval_step=eval_step))
    kept = [p.name for p in ck.list_checkpoints(saver.root)]
    # newest: 9; best evaluated: step 4 (0.70), step 8 (0.65); step 5 repeats step 4's number
    assert kept == ["step_00000009", "step_00000008", "step_00000004"]
    assert all(verify(p) is None for p in ck.list_checkpoints(saver.root))


def test_keep_best_ranks_by_the_better_of_the_raw_and_the_ema_weights(bundle):
    """With --model-ema the run's best (and its final model) is the better of the two
    evaluations: an evaluation whose EMA weights scored highest is kept as the best."""
    saver, _, train_step, _ = bundle
    saver.keep, saver.keep_best = 1, 1
    # (step, raw top-1, EMA top-1), each saved right after its evaluation
    for step, raw, ema in [(2, 0.33, 0.52), (4, 0.36, 0.44), (6, 0.30, 0.31)]:
        train_step()
        save_as(saver, dataclasses.replace(state(step), eval_top1=raw, ema_top1=ema,
                                           eval_step=step))
    kept = [p.name for p in ck.list_checkpoints(saver.root)]
    assert kept == ["step_00000006", "step_00000002"]  # the newest; the best, by its EMA 0.52


def _evaluated(step: int, metric: str, record: dict) -> TrainerState:
    """The state of a run picking by `metric`, right after an epoch end's evaluation
    (`record`: its eval_* numbers, as epoch_record writes them)."""
    run_state = dataclasses.replace(state(step), eval_metric=metric)
    run_state.note_evaluation({"eval_top1": 0.5, **record})
    return run_state


@pytest.mark.parametrize("metric, history, best", [
    # the lowest loss is the best: steps 4 (0.61) and 8 (0.70), where top-1 (0.5 in every
    # state here: ties, the newest first) would keep 8 and 6
    ("loss", [(2, {"eval_loss": 1.4}), (4, {"eval_loss": 0.61}), (6, {"eval_loss": 0.90}),
              (8, {"eval_loss": 0.70})], [8, 4]),
    # the mean of the classes' top-1, not top-1 (which the state's notes hold at 0.5 for all)
    ("mean_class_top1", [(2, {"eval_mean_class_top1": 0.30}),
                         (4, {"eval_mean_class_top1": 0.62}),
                         (6, {"eval_mean_class_top1": 0.58}),
                         (8, {"eval_mean_class_top1": 0.41})], [6, 4]),
    # the EMA weights' loss when lower than the raw weights'
    ("loss", [(2, {"eval_loss": 1.0, "eval_ema_loss": 0.2}), (4, {"eval_loss": 0.5}),
              (6, {"eval_loss": 0.3, "eval_ema_loss": 0.9}), (8, {"eval_loss": 0.8})], [6, 2]),
])
def test_keep_best_ranks_by_the_eval_metric(bundle, metric, history, best):
    saver, _, train_step, _ = bundle
    saver.keep, saver.keep_best = 1, 2
    for step, record in history:
        train_step()
        save_as(saver, _evaluated(step, metric, {f"eval_{metric}": 0.0, **record}))
    kept = {int(p.name[5:]) for p in ck.list_checkpoints(saver.root)}
    assert kept == {8, *best}  # the newest, and the best two by the metric


def test_the_best_of_numbers_by_each_metrics_direction():
    from accel_train.train.selection import best_of, describe
    assert best_of("loss", 0.5, None, 0.3) == 0.3 and best_of("top1", 0.5, None, 0.3) == 0.5
    assert best_of("mean_class_top1", None, None) is None  # nothing evaluated yet
    assert describe("loss", 0.25) == "loss 0.2500" and describe("top5", 0.875) == "top-5 87.50%"


def test_the_eval_metric_names_the_best_and_the_better_weights():
    """By hand: the state's best and its raw-or-EMA choice follow the metric's direction."""
    by_loss = dataclasses.replace(state(4), eval_metric="loss")
    by_loss.note_evaluation({"eval_top1": 0.9, "eval_loss": 0.8, "eval_ema_top1": 0.7,
                             "eval_ema_loss": 0.6})
    assert by_loss.ema_is_better()  # lower loss, lower top-1
    assert (by_loss.best_score, by_loss.best_top1) == (0.6, 0.9)
    by_loss.note_evaluation({"eval_top1": 0.95, "eval_loss": 0.7, "eval_ema_top1": 0.8,
                             "eval_ema_loss": 0.75})
    assert not by_loss.ema_is_better() and by_loss.best_score == 0.6  # 0.6 stays the best
    assert by_loss.best_words() == "best held-out loss 0.6000"
    by_class = dataclasses.replace(state(4), eval_metric="mean_class_top1")
    by_class.note_evaluation({"eval_top1": 0.9, "eval_mean_class_top1": 0.5,
                              "eval_ema_top1": 0.8, "eval_ema_mean_class_top1": 0.55})
    assert by_class.ema_is_better() and by_class.best_top1 == 0.9
    assert by_class.best_words() == "best held-out mean per-class top-1 55.00%"
    by_top1 = dataclasses.replace(state(4), eval_metric="top1")
    by_top1.note_evaluation({"eval_top1": 0.9, "eval_ema_top1": 0.8})
    assert not by_top1.ema_is_better()
    assert by_top1.best_words() == "best held-out top-1 90.00%"
    tied = dataclasses.replace(state(4), eval_metric="loss")
    tied.note_evaluation({"eval_top1": 0.9, "eval_loss": 0.5, "eval_ema_loss": 0.5})
    assert not tied.ema_is_better()  # a tie keeps the trained weights, as top-1 always did
    assert state(4).best_words() == "best held-out top-1 0.00%"  # never evaluated
    # a checkpoint from before the option: its top-1 fields are its scores
    old = TrainerState.from_json({"seed": 0, "eval_top1": 0.4, "ema_top1": 0.6,
                                     "best_top1": 0.6})
    assert old.metric == "top1" and old.scores() == (0.4, 0.6) and old.ema_is_better()
    assert old.best_words() == "best held-out top-1 60.00%"


def test_loading_a_state_runs_every_check_with_this_starts_values(tmp_path):
    """TrainerState.load hands each check this start's own numbers: other test images and
    another carve are each refused."""
    saved = dataclasses.replace(state(4), held_out_samples=30, test_samples=20,
                                held_out_carve="stratified", train_samples=100)
    saved.save(tmp_path)
    for change, words in [({"test_samples": 5}, "evaluated 20 test images but this start has 5"),
                          ({"held_out_carve": "random"}, "carved its validation images class "
                                                         "by class, this start by one random"),
                          ({"eval_metric": "loss"}, "--eval-metric top1, this start by loss")]:
        start = dataclasses.replace(saved, **change)
        with pytest.raises(UsageError, match=words):
            start.load(tmp_path)
    same = dataclasses.replace(saved, step=0)
    same.load(tmp_path)
    assert same.step == 4


def test_a_resume_picking_by_another_metric_is_refused():
    """The best kept so far were chosen by the checkpoint's metric; one from before the
    option chose by top-1."""
    old = TrainerState.from_json({"seed": 0, "train_samples": 100})
    from accel_train.train.selection import check_same_eval_metric
    check_same_eval_metric(old.eval_metric, "top1")
    with pytest.raises(UsageError) as refused:
        check_same_eval_metric(old.eval_metric, "loss")
    assert str(refused.value) == (
        "the checkpoint's run picked its best checkpoints and weights by --eval-metric top1, "
        "this start by loss; resume with --eval-metric top1, or start a new run")
    check_same_eval_metric("mean_class_top1", "mean_class_top1")
    with pytest.raises(UsageError, match="resume with --eval-metric mean_class_top1, or"):
        check_same_eval_metric("mean_class_top1", "top1")


def test_resume_auto_among_checkpoints_none_usable_stops_in_one_line(bundle, tmp_path, capsys):
    """Checkpoints there, none usable (each cut short): --resume auto names each with why and
    stops, exit 2, moving nothing; it never starts over from scratch in a folder that holds a
    run's checkpoints."""
    saver, _, train_step, _ = bundle
    paths = save_steps(saver, train_step, 3, 6)
    for path in paths.values():
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    before = tree_digest(saver.root)
    out = tmp_path / "run"
    code, err = run_cli(capsys, "--output-dir", str(out), "--checkpoint", str(saver.root),
                        "--resume", "auto")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"accel_train: error: --resume auto: none of the 2 checkpoint(s) "
                             f"in {saver.root} can be used")
    assert "step_00000003: " in err[0] and "step_00000006: " in err[0]
    assert tree_digest(saver.root) == before


# -- what a user sees of checkpoint.py that its mutation run found unchecked ----------------------

def test_pruning_leaves_nothing_but_the_kept_checkpoints_on_disk(bundle):
    """Pruned checkpoints are renamed, then deleted: no folder of them may stay behind, taking
    the disk space the pruning was for."""
    saver, _, train_step, _ = bundle
    saver.keep = 2
    save_steps(saver, train_step, 1, 2, 3, 4)
    assert sorted(os.listdir(saver.root)) == ["step_00000003", "step_00000004"]


def _cut_short(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("victim", ["optimizer.bin", "random_states_0.pkl", "scaler.pt"])
def test_a_torch_file_cut_short_is_refused_in_one_line_before_anything_loads(bundle, victim):
    """Each torch file of Accelerate's state (.bin, .pkl, .pt; scaler.pt is fp16's GradScaler,
    planted here) is checked whole before Accelerate loads anything: torch would fail deep
    inside, and Accelerate ignores a bad RNG file without a word.  The manifest is rewritten to
    match, as a hand edit would; the model in memory keeps its weights."""
    saver, model, train_step, _ = bundle
    path = save_steps(saver, train_step, 3)[3]
    if victim == "scaler.pt":
        torch.save({"scale": 1024.0}, path / victim)
    _cut_short(path / victim)
    ck.write_manifest(path, 3)
    train_step()  # the model in memory is no longer the checkpoint's
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UsageError) as caught:
        saver.restore(path)
    message = str(caught.value)
    assert message.startswith(f"{path / victim}: is a torch file without its end; it may be "
                              f"cut short"), message
    assert "resume from another checkpoint" in message and "\n" not in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_checkpoint_holding_another_models_weights_is_refused_in_one_line(bundle):
    from safetensors.torch import save_file

    saver, model, train_step, _ = bundle
    path = save_steps(saver, train_step, 3)[3]
    other = {"0.weight": torch.zeros(8, 5), "0.bias": torch.zeros(8)}  # 5 inputs, not 4
    save_file(other, str(path / "model.safetensors"))
    ck.write_manifest(path, 3)
    with pytest.raises(UsageError) as caught:
        saver.restore(path)
    message = str(caught.value)
    assert message.startswith(f"{path / 'model.safetensors'}: holds another model's weights"), \
        message
    assert "0.weight is [8, 5], not [8, 4]" in message and "resume from another" in message


def test_a_checkpoint_of_a_newer_format_asks_for_a_newer_accel_train(bundle, tmp_path, capsys):
    saver, _, train_step, _ = bundle
    path = save_steps(saver, train_step, 3)[3]
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["format"] = ck.FORMAT + 1
    (path / MANIFEST).write_text(json.dumps(manifest))
    code, err = run_cli(capsys, "--output-dir", str(tmp_path / "run"), "--checkpoint",
                        str(saver.root), "--resume", "auto")
    assert code == 2 and len(err) == 1, err
    assert f"is in checkpoint format {ck.FORMAT + 1}, written by a newer accel_train" in err[0]
    assert err[0].endswith("upgrade accel_train to resume it"), err[0]


@pytest.mark.parametrize("victim", ["optimizer.bin", "random_states_0.pkl"])
def test_a_planted_pickle_is_refused_with_torchs_reason(bundle, tmp_path, victim):
    """Named with the checkpoint and torch's own reason, whichever file carries it (Accelerate
    loads optimizer.bin; the RNG file is checked before, since Accelerate would skip it)."""
    saver, _, train_step, _ = bundle
    path = save_steps(saver, train_step, 3)[3]
    torch.save({"state": _Payload(str(tmp_path / "pwned"))}, path / victim)
    ck.write_manifest(path, 3)
    with pytest.raises(UsageError) as caught:
        saver.restore(path)
    message = str(caught.value)
    assert message.startswith(f"checkpoint {path} holds a pickled object"), message
    reason = message[message.index("refusing to load it (") + len("refusing to load it ("):-1]
    assert reason.startswith("Weights only load failed"), reason


def test_a_checkpoint_without_this_ranks_rng_file_warns_and_resumes(bundle):
    """Written by 2 processes (the state says so), restored by 1 without random_states_0.pkl:
    a warning naming the checkpoint, the rank and the writers' count, and the restore goes on."""
    saver, _, train_step, warnings = bundle
    path = save_steps(saver, train_step, 3)[3]
    (path / "random_states_0.pkl").unlink()
    ck.write_manifest(path, 3)
    saver.restore(path)
    assert [w for w in warnings if "RNG" in w] == [
        f"{path} has no RNG state for rank 0 (it was written by 2 process(es)); this rank keeps "
        f"its fresh RNG state (every random draw of training is seeded by its place in the run)"]


def test_verify_names_what_is_wrong_with_a_manifest(bundle):
    saver, _, train_step, _ = bundle
    path = save_steps(saver, train_step, 3)[3]
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][STATE_FILE] = {"sha256": manifest["files"][STATE_FILE]["sha256"],
                                     "bytes": "12"}  # a number as text
    (path / MANIFEST).write_text(json.dumps(manifest))
    problem = verify(path)
    assert problem is not None and problem.startswith(
        f"unreadable manifest (its entry for {STATE_FILE} "), problem
    (path / MANIFEST).unlink()
    assert verify(path) == "no manifest (the save never finished)"


def test_the_state_file_records_the_global_batch(bundle):
    """state.json says the global batch a user resumes with: batch x processes x accumulation."""
    saver, _, train_step, _ = bundle
    run = dataclasses.replace(state(3), batch_size=16, world_size=2, accumulation_steps=3)
    path = save_as(saver, run)
    assert json.loads((path / STATE_FILE).read_text())["global_batch"] == 16 * 2 * 3


def test_the_checkpointer_takes_keep_best_and_writes_the_manifest_last(tmp_path, bundle,
                                                                        monkeypatch):
    """Given to the constructor (as the trainer gives them): keep_best keeps the best evaluated
    checkpoint.  The manifest writer runs once per save, with the step, on the folder that holds
    every file but the manifest (where the fault tests stall a save: tests/fault_entry.py)."""
    saver, _, train_step, warnings = bundle
    seen, write_manifest = [], ck.write_manifest

    def recording(folder: Path, step: int) -> None:
        seen.append((step, folder.name, sorted(p.name for p in folder.iterdir())))
        write_manifest(folder, step)

    monkeypatch.setattr(ck, "write_manifest", recording)
    with_best = Checkpointer(saver.root, keep=1, warn=warnings, parts=saver.parts,
                             barrier=saver.barrier, keep_best=1)
    for step, top1 in [(1, 0.9), (2, 0.1)]:
        train_step()
        save_as(with_best, dataclasses.replace(state(step), eval_top1=top1, eval_step=step))
    assert [p.name for p in ck.list_checkpoints(saver.root)] == ["step_00000002",
                                                                 "step_00000001"]
    assert [(step, name) for step, name, _ in seen] == [(1, ".tmp-step_00000001"),
                                                        (2, ".tmp-step_00000002")]
    assert all(STATE_FILE in files and MANIFEST not in files for _, _, files in seen)
    assert {"model.safetensors", "optimizer.bin"} <= set(seen[0][2]), seen[0][2]


def test_the_checkpointer_refuses_parts_that_cannot_be_told_apart(tmp_path):
    with pytest.raises(ValueError, match=r"^checkpointed parts share a name: \['trainer_state', "
                                         r"'trainer_state'\]$"):
        Checkpointer(tmp_path, keep=1, warn=print, parts=[TrainerState(), TrainerState()])
    with pytest.raises(ValueError, match="^the checkpointed parts must hold exactly one "
                                         "TrainerState$"):
        Checkpointer(tmp_path, keep=1, warn=print, parts=[])


# -- a full disk: which errors mean it, and the sentence (test_full_disk.py runs it whole) --------

@pytest.mark.parametrize("count, shown", [(0, "0 bytes"), (1023, "1023 bytes"),
                                          (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                          (1024 ** 2 - 1, "1024.0 KiB"), (1024 ** 2, "1.0 MiB"),
                                          (5 * 1024 ** 3, "5.0 GiB"),
                                          (3 * 1024 ** 4, "3072.0 GiB")])
def test_sizes_in_the_full_disk_sentence_are_written_as_a_person_reads_them(count, shown):
    assert ck._size(count) == shown


def _enospc(filename=None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)


def test_a_full_disk_is_found_anywhere_in_the_error_chain(tmp_path, monkeypatch):
    roomy = tmp_path  # the fallback (is the disk nearly full?) says no here
    monkeypatch.setattr(ck, "free_bytes", lambda folder: 10 * ck.NEARLY_FULL_BYTES)
    assert ck.out_of_space(_enospc(), roomy)
    assert ck.out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"), roomy)
    wrapped = RuntimeError("safetensors: I/O error")
    wrapped.__cause__ = _enospc()  # raise ... from err, with no other error being handled
    assert ck.out_of_space(wrapped, roomy)
    during = RuntimeError("while handling it")
    during.__context__ = _enospc()
    assert ck.out_of_space(during, roomy)
    text_only = RuntimeError(f"write failed: {os.strerror(errno.ENOSPC)}")
    assert ck.out_of_space(text_only, roomy)
    first, second = RuntimeError("a"), RuntimeError("b")  # a cycle ends the walk
    first.__context__, second.__context__ = second, first
    assert not ck.out_of_space(first, roomy)
    assert not ck.out_of_space(OSError(errno.EIO, "Input/output error"), roomy)


def test_an_error_that_names_nothing_asks_the_disk(tmp_path, monkeypatch):
    """torch.save's writer says only "unexpected pos": a disk with less than 1 MiB free counts
    as full; exactly 1 MiB does not; a disk that cannot be asked does not."""
    opaque = RuntimeError("PytorchStreamWriter failed writing file data/0: unexpected pos")
    monkeypatch.setattr(ck, "free_bytes", lambda folder: ck.NEARLY_FULL_BYTES - 1)
    assert ck.out_of_space(opaque, tmp_path)
    monkeypatch.setattr(ck, "free_bytes", lambda folder: ck.NEARLY_FULL_BYTES)
    assert not ck.out_of_space(opaque, tmp_path)

    def unreachable(folder):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ck, "free_bytes", unreachable)
    assert not ck.out_of_space(opaque, tmp_path)


def test_the_full_disk_sentence_names_the_file_the_sizes_and_where_to_resume(bundle,
                                                                            monkeypatch):
    saver, _, train_step, _ = bundle
    monkeypatch.setattr(ck, "free_bytes", lambda folder: 512)
    final = saver.root / "step_00000009"
    tmp = saver.root / ".tmp-step_00000009"

    def partial_save():
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(b"m" * 1024)
        (tmp / "optimizer.bin").write_bytes(b"o" * 512)
        os.utime(tmp / "model.safetensors", ns=(1, 1))  # optimizer.bin is the newest

    partial_save()
    said = saver._out_of_space_message(_enospc(), tmp, final)
    assert said == (f"no space left on the device of {saver.root} (disk full or quota reached) "
                    f"while writing optimizer.bin of checkpoint step_00000009: it had written "
                    f"1.5 KiB when it failed, 512 bytes was free; removed the partial save; free "
                    f"some space, then run the same command with --resume auto to start again "
                    f"(no checkpoint was complete yet)")
    assert not tmp.exists()

    said = saver._out_of_space_message(RuntimeError("unexpected pos"), tmp, final)
    assert "while writing .tmp-step_00000009 of checkpoint step_00000009: it had written 0 " \
           "bytes when it failed" in said, said  # nothing written: the folder is named

    complete = save_steps(saver, train_step, 3)[3]
    size = sum(p.stat().st_size for p in complete.rglob("*") if p.is_file())
    partial_save()
    said = saver._out_of_space_message(_enospc("/elsewhere/scheduler.bin"), tmp, final)
    assert "while writing scheduler.bin of checkpoint step_00000009: a checkpoint of this run " \
           f"takes {size / 1024:.1f} KiB, 512 bytes was free" in said, said
    assert said.endswith(f"--resume auto to continue from {complete}"), said


class FullDiskPart:
    """A checkpointed part whose file does not fit on the disk."""
    name = "ema"

    def save(self, folder: Path) -> None:
        (folder / "ema.safetensors").write_bytes(b"e" * 100)
        raise _enospc(str(folder / "ema.safetensors"))

    def load(self, folder: Path) -> None:
        pass


def test_a_save_that_fills_the_disk_stops_the_run_naming_the_file(bundle, monkeypatch):
    from accel_train.base.errors import DISK_FULL_EXIT, RunStopped

    saver, _, train_step, warnings = bundle
    monkeypatch.setattr(ck, "free_bytes", lambda folder: 0)
    full = Checkpointer(saver.root, keep=2, warn=warnings, parts=[*saver.parts, FullDiskPart()])
    train_step()
    with pytest.raises(RunStopped) as caught:
        save_as(full, state(4))
    assert caught.value.exit_code == DISK_FULL_EXIT
    assert "while writing ema.safetensors of checkpoint step_00000004: it had written " in \
        str(caught.value), caught.value
    assert os.listdir(saver.root) == []  # the partial save removed


def test_a_stale_folder_of_the_same_save_is_replaced_not_merged(bundle):
    saver, _, train_step, _ = bundle
    stale = saver.root / ".tmp-step_00000003"
    stale.mkdir(parents=True)
    (stale / "leftover.bin").write_bytes(b"from a save that died")
    path = save_steps(saver, train_step, 3)[3]
    assert "leftover.bin" not in os.listdir(path) and verify(path) is None


def test_weight_files_are_readable_as_every_other_file_the_run_writes(tmp_path, capsys):
    """safetensors creates its files 0600: a run's model, EMA and lookahead weights and an
    export's take the umask every other file takes (config.yaml's mode the oracle)."""
    out = tmp_path / "run"
    assert run_cli(capsys, "--output-dir", str(out), "--max-steps", "2", "--model-ema",
                   "--lookahead-every", "2")[0] == 0
    assert main(["export", str(out), "-o", str(tmp_path / "export")]) == 0
    expected = (out / "config.yaml").stat().st_mode & 0o777
    weights = [*out.rglob("*.safetensors"), *(tmp_path / "export").rglob("*.safetensors")]
    assert {p.name for p in weights} >= {"model.safetensors", "ema.safetensors",
                                         "lookahead.safetensors"}
    assert {str(p): p.stat().st_mode & 0o777 for p in weights} == \
        {str(p): expected for p in weights}
