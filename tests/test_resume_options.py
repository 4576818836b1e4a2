"""A refused resume names every option the start sets otherwise than the run's last start did,
not only the one that stopped it, and the flag that takes them all from the run's record."""

from __future__ import annotations

import re

from accel_train.config import TrainConfig
from accel_train.run.resume_options import differences
from conftest import TINY_TRAIN, accel_train_here

FIRST = [*TINY_TRAIN, "--max-steps", "2", "--seed", "3", "--image-size", "40"]


def named_differences(line: str) -> tuple[str, set[str]]:
    """(the record the line names, the differences it lists)."""
    match = re.search(r"otherwise than the run's last start \((.+?)\): (.+); --config (\S+) "
                      r"--resume auto takes the run's options$", line)
    assert match, line
    assert match.group(1) == match.group(3), line
    return match.group(1), set(match.group(2).split(", "))


def test_a_resume_with_only_the_output_dir_names_every_option_of_the_run(tmp_path):
    out = tmp_path / "run"
    accel_train_here(*FIRST, "--output-dir", str(out), check=True)
    alone = accel_train_here("--output-dir", str(out), "--resume", "auto", "--progress", "log")
    lines = alone.stderr.strip().splitlines()
    assert alone.returncode == 2 and len(lines) == 1, alone.stderr
    record, found = named_differences(lines[0])
    assert record == str(out / "config.yaml")
    # FIRST against the defaults, by hand: the precision and memory format it pins are left
    # to auto here, which takes the checkpoint's; --no-plots and --progress are this start's
    assert found == {"--synthetic-train-size 4000 (the run: 256)",
                     "--max-eval-samples not set (the run: 64)",
                     "--model resnet18 (the run: test_resnet)",
                     "--batch-size 64 (the run: 16)", "--epochs 10 (the run: 1)",
                     "--max-steps not set (the run: 2)", "--seed 0 (the run: 3)",
                     "--image-size not set (the run: 40)"}, lines[0]

    # the flag it offers resumes, with what is changed on purpose added
    accel_train_here("--config", record, "--resume", "auto", "--max-steps", "3",
                     check=True)
    # and the next refusal compares with that start's record, which trained to step 3
    again = accel_train_here("--config", record, "--resume", "auto", "--seed", "5")
    assert again.returncode == 2, again.stderr
    latest, found = named_differences(again.stderr.strip())
    assert re.fullmatch(re.escape(str(out)) + r"/config\.resume-\d{8}-\d{6}\.yaml", latest)
    assert found == {"--seed 5 (the run: 3)", "--max-steps 2 (the run: 3)"}
    assert "was trained with --seed 3" in again.stderr


def test_a_refusal_with_no_difference_from_the_record_is_left_as_it_is(tmp_path):
    """The refusal alone where the options are the run's: another --output-dir holds no
    record (a checkpoint resumed elsewhere), or the record says what this start says."""
    out = tmp_path / "run"
    accel_train_here(*FIRST, "--output-dir", str(out), check=True)
    elsewhere = accel_train_here(*FIRST, "--output-dir", str(tmp_path / "other"), "--resume",
                                 str(out / "checkpoints" / "step_00000002"), "--optimizer",
                                 "adamw")
    assert elsewhere.returncode == 2
    assert elsewhere.stderr.strip().endswith("or start a new run in another --output-dir"), \
        elsewhere.stderr


def test_paths_lists_and_auto_choices_compare_as_the_record_holds_them(tmp_path,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    config = TrainConfig(data_dir="data", scale=(0.08, 1.0))
    record = {**config.to_dict(), "data_dir": str(tmp_path / "data"), "scale": [0.08, 1.0],
              "mixed_precision": "bf16", "channels_last": True, "num_workers": 3}
    assert differences(config, record) == []
    assert differences(TrainConfig(data_dir="data", freeze_backbone=True), record) == \
        ["--freeze-backbone on (the run: off)"]
    assert differences(TrainConfig(data_dir="data", mixed_precision="no"), record) == \
        ["--mixed-precision no (the run: bf16)"]
    # lists in words, as they are typed; an empty one as none
    found = differences(TrainConfig(data_dir="data", scale=(0.5, 1.0), time_budget="1m",
                                    smaller_models=["cifar_convnet_s"], min_budget_epochs=2),
                        record)
    assert "--scale 0.5 1.0 (the run: 0.08 1.0)" in found
    assert "--smaller-models cifar_convnet_s (the run: none)" in found


def test_only_a_refusal_for_another_option_gets_the_list(tmp_path):
    """Any other refusal of a resumed start (a damaged file, a full disk) is left as it is,
    however many options differ; so is a record that is not one (no crash)."""
    import yaml
    from accel_train.base.errors import RunDiffers, UsageError
    from accel_train.run.resume_options import naming_differences
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(  # a run record's shape
        {"train": {**TrainConfig().to_dict(), "seed": 3, "epochs": 2}, "resolved": {},
         "versions": {}, "git_revision": None, "command": []}))
    config = TrainConfig(output_dir=str(tmp_path), resume="auto")
    other = UsageError("run.lock is damaged")
    assert naming_differences(other, config) is other
    listed = str(naming_differences(RunDiffers("another seed"), config))
    assert listed.startswith("another seed; this start sets 2 option(s)") and \
        "--epochs 10 (the run: 2), --seed 0 (the run: 3)" in listed, listed
    (tmp_path / "config.yaml").write_text("train: [1, 2]\n")
    refused = RunDiffers("another seed")
    assert naming_differences(refused, config) is refused


def test_a_first_start_that_ended_before_its_first_checkpoint_is_not_the_runs_record(tmp_path):
    """A first start that crashed at its first step left config.yaml; the next start, finding
    no checkpoint, trains from scratch, and its options are the run's: config.yaml described
    the start that never trained, and --config RUN/config.yaml repeated it."""
    from accel_train.callbacks import Callback
    import pytest
    import yaml

    class Crash(Callback):
        def on_step_end(self, trainer, step):
            raise RuntimeError("a crash at the first step")

    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="a crash at the first step"):
        accel_train_here(*FIRST, "--output-dir", str(out), callbacks=[Crash()])
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == 3
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    accel_train_here(*FIRST[:-4], "--seed", "5", "--output-dir", str(out), "--resume", "auto",
                     check=True)
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == 5
    assert not list(out.glob("config.resume-*.yaml"))


def test_a_refused_resume_says_nothing_of_the_batch_it_would_have_kept(tmp_path):
    """A start with another --batch-size and another --seed printed "resuming a global batch
    of 16 ...: accumulation steps 1 -> 2" just before its refusal, as though it had resumed.
    Oracle: the refusal is all the start prints; an accepted start with --batch-size 8 says
    accumulation 1 -> 2 (16 / 8, by hand) after its "resumed from" line, in its log too."""
    out = tmp_path / "run"
    accel_train_here(*FIRST, "--output-dir", str(out), check=True)
    resume = [*FIRST, "--output-dir", str(out), "--resume", "auto", "--batch-size", "8"]
    refused = accel_train_here(*resume, "--seed", "4")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "was trained with --seed 3" in refused.stderr and "accumul" not in refused.stderr
    accepted = accel_train_here(*resume, "--max-steps", "3", check=True)
    lines = accepted.stdout.splitlines()
    resumed = next(i for i, line in enumerate(lines) if line.startswith("resumed from"))
    assert lines[resumed + 1].endswith("accumulation steps 1 -> 2"), lines
    assert "accumulation steps 1 -> 2" in (out / "logs" / "rank0.log").read_text()
