"""`accel-train launch`: `accelerate launch` with the elastic and rendezvous settings that its YAML
cannot carry.

    accel-train launch --config_file accelerate_configs/2node.yaml \
        --elastic accelerate_configs/elastic.yaml -- --output-dir /shared/run1 --epochs 30

Accelerate reads `rdzv_backend` and `same_network` from its YAML but ignores them (its
command-line defaults win), and refuses `max_restarts`, `monitor_interval` and `rdzv_conf` there
(unknown keys are an error).  This command reads the machine's accelerate YAML (with accelerate's
own loader, so a file that `accelerate launch` would reject fails here first), adds our small
elastic file, and runs

    accelerate launch --config_file FILE <elastic flags> [other launch flags] -m accel_train ARGS

Everything before `--` that is not ours goes to `accelerate launch` unchanged (for example
`--main_process_port 29600` or `--machine_rank 1`); everything after `--` goes to accel_train.
`--dry-run` prints the command instead of running it.  Bad input: one line on stderr, exit code 2,
the training flags included (read here as every worker will read them).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import fields
from pathlib import Path
from typing import Sequence

from accel_train.base import readers
from accel_train.cli import _Parser
from accel_train.base.errors import UsageError

# The elastic file's keys -> accelerate launch's flags (which it hands to torchrun).
ELASTIC_KEYS = {
    "max_restarts": "--max_restarts",          # worker-group restarts before giving up
    "monitor_interval": "--monitor_interval",  # seconds between the agent's health checks
    "rdzv_backend": "--rdzv_backend",          # static (fixed machines) or c10d (elastic)
    "rdzv_conf": "--rdzv_conf",                # e.g. {join_timeout: 900} or "join_timeout=900"
}
# Keys with no `accelerate launch` flag, passed to torchrun through its environment instead.
ELASTIC_ENV_KEYS = {
    "rdzv_id": "PET_RDZV_ID",  # torchrun's --rdzv-id: the same job id on every machine
}
# Keys that the accelerate YAML accepts but `accelerate launch` ignores: passed on as flags.
IGNORED_YAML_KEYS = ("rdzv_backend", "same_network")


def read_yaml(path: str, what: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{what} {path}: no such file")
    if what == "--config_file":
        return readers.read_yaml(file, "accelerate_config", what, empty={})
    return readers.read_yaml(file, "elastic_config", what, empty={})


def check_accelerate_config(path: str) -> dict:
    """The YAML as accelerate itself would load it (an unknown key fails here, not on a node)."""
    raw = read_yaml(path, "--config_file")
    readers.load_accelerate_config(path)
    return raw


def rdzv_conf_text(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{key}={val}" for key, val in value.items())
    return str(value)


def elastic_flags(elastic: dict, source: str) -> list[str]:
    known = {**ELASTIC_KEYS, **ELASTIC_ENV_KEYS}
    unknown = sorted(set(elastic) - set(known))
    if unknown:
        raise UsageError(f"--elastic {source}: unknown key(s) {', '.join(unknown)}; "
                         f"use {', '.join(known)}")
    flags = []
    for key, flag in ELASTIC_KEYS.items():
        if key not in elastic or elastic[key] is None:
            continue
        value = elastic[key]
        if key == "max_restarts" and not (isinstance(value, int) and value >= 0):
            raise UsageError(f"--elastic {source}: max_restarts must be a whole number >= 0 "
                             f"(got {value!r})")
        if key == "monitor_interval" and not (isinstance(value, (int, float)) and value > 0):
            raise UsageError(f"--elastic {source}: monitor_interval must be seconds > 0 "
                             f"(got {value!r})")
        if key == "rdzv_backend" and value not in ("static", "c10d", "etcd", "etcd-v2"):
            raise UsageError(f"--elastic {source}: rdzv_backend {value!r} is not one of "
                             f"static, c10d, etcd, etcd-v2")
        flags += [flag, rdzv_conf_text(value) if key == "rdzv_conf" else str(value)]
    return flags


def launcher_environment(elastic: dict) -> dict[str, str]:
    """Environment for the launcher.  With c10d, torch 2.14 by default shares the rendezvous
    store with the workers; a machine that joins a running job then waits 60 s and fails (seen
    on loopback), so the sharing is turned off.  rdzv_id lets a joining machine find the job."""
    env = {var: str(elastic[key]) for key, var in ELASTIC_ENV_KEYS.items() if elastic.get(key)}
    if elastic.get("rdzv_backend") == "c10d":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def check_mpirun(accelerate_yaml: dict, launch_args: list[str], config_file: str) -> None:
    """`accelerate config`'s "launch mpirun? yes" on a machine without MPI: accelerate would
    stop in a traceback (its OSError) after its checks; say it in one line, before anything."""
    hostfile = (accelerate_yaml.get("mpirun_config") or {}).get("mpirun_hostfile")
    if hostfile is None and "--mpirun_hostfile" not in launch_args:
        return
    if shutil.which("mpirun") or shutil.which("mpiexec"):
        return
    raise UsageError(f"--config_file {config_file} asks accelerate to start the processes with "
                     f"mpirun, which is not installed: install an MPI (Open MPI: apt-get install "
                     f"openmpi-bin; or Intel MPI, MVAPICH), or answer no to mpirun in "
                     f"`accelerate config` (accel_train then starts the processes itself)")


def build_command(config_file: str, elastic_file: str | None, launch_args: list[str],
                  train_args: list[str]) -> list[str]:
    accelerate_yaml = check_accelerate_config(config_file)
    check_mpirun(accelerate_yaml, launch_args, config_file)
    settings = {key: accelerate_yaml[key] for key in IGNORED_YAML_KEYS if key in accelerate_yaml}
    elastic = read_yaml(elastic_file, "--elastic") if elastic_file else {}
    flags = []
    backend = elastic.get("rdzv_backend", settings.get("rdzv_backend"))
    if backend is not None:  # the elastic file wins over the accelerate YAML
        elastic = {**elastic, "rdzv_backend": backend}
    flags += elastic_flags(elastic, elastic_file or config_file)
    if settings.get("same_network"):
        flags.append("--same_network")
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file,
            *flags, *launch_args, "-m", "accel_train", *train_args]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="accel-train launch", description=" ".join(__doc__.split("\n\n")[0].split()),
        allow_abbrev=False,
        usage="%(prog)s --config_file ACCELERATE.yaml [--elastic ELASTIC.yaml] [--dry-run] "
              "[accelerate launch flags] -- [accel_train flags]")
    parser.add_argument("--config_file", required=True, help="this machine's accelerate YAML")
    parser.add_argument("--elastic", help="YAML with max_restarts, monitor_interval, "
                                          "rdzv_backend, rdzv_id, rdzv_conf")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    return parser


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(our options, flags for `accelerate launch`, flags for accel_train after `--`)."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        ours, train_args = argv[:cut], argv[cut + 1:]
    else:
        ours, train_args = argv, []
    args, launch_args = build_parser().parse_known_args(ours)
    return args, launch_args, train_args


def check_train_args(train_args: list[str]) -> None:
    """The training flags as every worker will read them: a bad one is one line here, not an
    error in each worker, once per machine and per elastic restart, under torchrun's
    ChildFailedError traceback.  (What only a worker can know, such as the data, it says
    itself.)"""
    from accel_train.cli import build_train_parser, config_from_args
    config_from_args(build_train_parser(prog="accel-train launch ... --").parse_args(train_args))


def check_launch_args(launch_args: list[str]) -> None:
    """A flag before `--` that `accelerate launch` does not know: one line now, naming where an
    accel_train flag goes, rather than accelerate's usage text on every machine."""
    from accelerate.commands.launch import launch_command_parser

    from accel_train.config import TrainConfig
    _, unknown = launch_command_parser().parse_known_args([*launch_args, "-m", "accel_train"])
    flag = next((word.split("=")[0] for word in unknown if word.startswith("-")), None)
    if flag is None:
        return
    name = flag.lstrip("-").replace("-", "_")
    ours = {f.name for f in fields(TrainConfig)}
    if name in ours or name.removeprefix("no_") in ours:
        raise UsageError(f"{flag} is an accel_train flag: put it after `--` (accel-train launch "
                         f"--config_file FILE -- {flag} ...); before it, flags go to accelerate "
                         f"launch")
    raise UsageError(f"{flag}: accelerate launch has no such flag (see accelerate launch "
                     f"--help); accel_train's flags go after `--`")


def main(argv: Sequence[str]) -> int:
    args, launch_args, train_args = parse(argv)
    command = build_command(args.config_file, args.elastic, launch_args, train_args)
    check_launch_args(launch_args)
    check_train_args(train_args)
    elastic = read_yaml(args.elastic, "--elastic") if args.elastic else {}
    environment = launcher_environment(elastic)
    if args.dry_run:
        print(shlex.join([f"{k}={v}" for k, v in environment.items()] + command))
        return 0
    os.environ.update(environment)
    sys.stdout.flush()
    sys.stderr.flush()
    # Replace this process: signals (Ctrl-C, a scheduler's SIGTERM) reach the launcher directly.
    os.execv(command[0], command)
    return 0  # not reached
