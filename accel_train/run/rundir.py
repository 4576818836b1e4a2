"""The run directory: its names, choosing it safely, and recording what ran.

A run directory holds config.yaml (the options, what was resolved from them, package versions and
the git revision), metrics.jsonl, logs/, checkpoints/, trackers/, plots/, and model.safetensors +
model_config.json.  Every name lives here, and `RunPaths` is the one way to spell a path in it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml

from accel_train.config import TrainConfig
from accel_train.base.command import recorded_command
from accel_train.base.errors import UsageError
from accel_train.base.readers import read_yaml
from accel_train.model.saved import SPEC_FILE, WEIGHTS_FILE  # noqa: F401  (run folders hold them)

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
TRACKERS_DIR = "trackers"  # where file-writing trackers (tensorboard) write
PLOTS_DIR = "plots"
ELASTIC_JOB_FILE = "elastic_run_id"  # the rendezvous id of the torchelastic job that started it
BAD_IMAGES_FILE = "bad_images.txt"  # images that could not be decoded: "name<TAB>reason" lines
LOCK_FILE = "run.lock"  # held by the run that writes here (runlock.py)

PACKAGES = ("accel_train", "torch", "torchvision", "accelerate", "timm", "datasets",
            "safetensors", "numpy")


@dataclass(frozen=True)
class RunPaths:
    """Where each thing of a run directory lives."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    @property
    def trackers(self) -> Path:
        return self.root / TRACKERS_DIR

    @property
    def plots(self) -> Path:
        return self.root / PLOTS_DIR

    @property
    def weights(self) -> Path:
        return self.root / WEIGHTS_FILE

    @property
    def elastic_job(self) -> Path:
        return self.root / ELASTIC_JOB_FILE

    @property
    def bad_images(self) -> Path:
        return self.root / BAD_IMAGES_FILE

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    def markers(self) -> tuple[Path, ...]:
        """What only a run leaves behind."""
        return (self.metrics, self.weights, self.checkpoints, self.config)


def run_paths(output_dir) -> RunPaths:
    return RunPaths(Path(output_dir))


def _holds_a_run(path: Path) -> bool:
    return path.is_dir() and any(marker.exists() for marker in run_paths(path).markers())


def prepare_output_dir(config: TrainConfig, env) -> str:
    """Pick the run directory without creating or touching anything (a failed start must leave
    no trace)."""
    if config.output_dir is None:
        if env.max_restarts > 0:
            raise UsageError("elastic restarts (--max-restarts) need a fixed --output-dir so that "
                             "restarted workers find the checkpoints; add --output-dir PATH")
        base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        path, suffix = base, 1
        while path.exists():
            suffix += 1
            path = base.with_name(f"{base.name}-{suffix}")
        return str(path)
    path = Path(config.output_dir)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--output-dir {path} is a file; pass a folder")
    return str(path)


def refuse_new_run_over_old(output_dir: Path, resume) -> None:
    """A new run must not start on top of an old one."""
    if resume is None and _holds_a_run(output_dir):
        raise UsageError(f"--output-dir {output_dir} already holds a run; pass --resume auto "
                         f"to continue it, or choose a new --output-dir")


def package_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_revision() -> str | None:
    source = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def update_resolved(output_dir: Path, updates: dict) -> Path:
    """Facts resolved after the start (a --time-budget run's step count) into the record of
    this start: config.yaml, or the newest config.resume-*.yaml when this start resumed."""
    path = latest_record(output_dir)
    record = read_yaml(path, "run_config")
    record["resolved"].update(updates)
    _write_whole(path, record)
    return path


def latest_record(output_dir: Path) -> Path:
    """The record of the run's latest start: config.yaml, or the newest config.resume-*.yaml
    (their names sort by the time of the start)."""
    paths = run_paths(output_dir)
    resumes = sorted(paths.root.glob("config.resume-*.yaml"))
    return resumes[-1] if resumes else paths.config


def _write_whole(path: Path, record: dict) -> None:
    """A run record as YAML, whole or not at all: written beside, then renamed, so that a
    reader (eval of a running run, a kill mid-write) never sees half of it."""
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(record, sort_keys=False))
    tmp.replace(path)


def recorded_options(config: TrainConfig) -> dict:
    """The options as a run's record holds them: paths made absolute (`eval` may run
    elsewhere)."""
    options = config.to_dict()
    for name in ("data_dir", "pretrained", "val_labels", "train_labels"):
        if options[name] and options[name] != "hub":
            options[name] = str(Path(options[name]).resolve())
    return options


def write_run_config(output_dir: Path, config: TrainConfig, resolved: dict,
                     resumed: bool = False) -> Path:
    """config.yaml on the first start; a resumed start records itself beside it instead of
    rewriting what the original run was.  A start that found no checkpoint to resume from is
    a first start: a record left by one that ended before its first checkpoint (a crash)
    described a run that never trained, and `--config RUN/config.yaml` repeated it."""
    output_dir.mkdir(parents=True, exist_ok=True)
    record = {"train": recorded_options(config), "resolved": resolved,
              "versions": package_versions(), "git_revision": git_revision(),
              "command": recorded_command()}
    path = run_paths(output_dir).config
    # (a folder whose earlier starts resumed keeps its records as they are: latest_record
    # would read their newest, not a rewritten config.yaml)
    if path.exists() and (resumed or latest_record(output_dir) != path):
        path = output_dir / f"config.resume-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    _write_whole(path, record)
    return path
