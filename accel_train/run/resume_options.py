"""A resume refused for one difference from its run (another --model, --seed, image size) named
only that one: a user who typed `--output-dir RUN --resume auto` alone, without the run's
options, met each of the others on the next try.  The refusal now names every option this start
sets otherwise than the run's latest start did, and the flag that takes them all from its
record."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from accel_train.base.errors import RunDiffers, UsageError, first_few
from accel_train.base.readers import BadFile, read_yaml
from accel_train.config import TrainConfig, flag
from accel_train.run.distributed import PER_PROCESS_OPTIONS
from accel_train.run.rundir import latest_record, recorded_options

# A start's own choices, not the run's: which process, where, how loudly, and --resume itself
THIS_START = PER_PROCESS_OPTIONS - {"data_dir", "train_labels", "val_labels", "pretrained"} | {
    "resume", "world_size", "report_to", "plots", "log_every", "prefetch_factor",
    "persistent_workers", "loader_timeout", "collective_timeout"}
# left to auto, a resume takes the checkpoint's choice (resume.keep_choices): no difference
AUTO = {"mixed_precision": "auto", "channels_last": None, "decode_on_device": "auto",
        "data_on_device": "auto"}
SHOWN = 8  # differences named in the line; the rest counted


def differences(config: TrainConfig, record: dict) -> list[str]:
    """'--model resnet18 (the run: test_resnet)' for each option set otherwise than in the
    record's options (a run's config.yaml `train` section)."""
    mine = recorded_options(config)
    found = []
    for key, value in mine.items():
        if key in THIS_START or key not in record or AUTO.get(key, ...) == value:
            continue
        if value != record[key]:  # (the config holds its pairs and triples as lists, as YAML)
            found.append(f"{flag(key)} {_words(value)} (the run: {_words(record[key])})")
    return found


def _words(value) -> str:
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "none"
    return str(value)


def naming_differences(err: UsageError, config: TrainConfig) -> UsageError:
    """`err`, a resume refused for an option or data not the run's, with the options that
    differ from the run's latest start and the way to take them all.  `err` as it is where it
    is another refusal, where only one option differs (the refusal names it), or where the
    run's record cannot be read (a checkpoint resumed into another --output-dir)."""
    if not isinstance(err, RunDiffers) or not config.resume:
        return err
    record = _latest_options(config.output_dir)
    found = differences(config, record) if record else []
    if len(found) < 2:
        return err
    path = latest_record(Path(config.output_dir))
    return UsageError(f"{err}; this start sets {len(found)} option(s) otherwise than the run's "
                      f"last start ({path}): {first_few(found, SHOWN)}; "
                      f"--config {path} --resume auto takes the run's options")


def _latest_options(output_dir: Optional[str]) -> Optional[dict]:
    if not output_dir:
        return None
    path = latest_record(Path(output_dir))
    try:
        record = read_yaml(path, "run_config") if path.is_file() else None
    except BadFile:
        return None  # the record's own damage is for the commands that need it to say
    options = record.get("train") if isinstance(record, dict) else None
    return options if isinstance(options, dict) else None
