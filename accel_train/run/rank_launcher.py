"""Starting the ranks that `accelerate launch` was asked for on a CPU machine but did not start.

`accelerate config`, answered for a machine without GPUs (multi-CPU, N processes, no mpirun),
writes `distributed_type: MULTI_CPU`.  `accelerate launch` then uses its single-process launcher:
it starts ONE process, exports MASTER_ADDR/MASTER_PORT but no RANK or WORLD_SIZE, and the other
processes never exist (accelerate's issue 2741, "Multiple processes on CPUs").  The answers say
exactly what the user wants, so this process becomes that launcher: it starts the local ranks
with torch's elastic launcher (the API torchrun runs), rendezvous "static" at the address
accelerate exported, this machine's `machine_rank` as its node rank, and waits for them as
torchrun would.  Each rank then starts as any torchrun worker does (distributed.setup).

What was asked is read from the launcher's command line (our parent process) with accelerate's
own argument parser, then from its config file, flags first, as `accelerate launch` resolves
them.  A process started any other way (plain python, torchrun, accelerate's multi-process
launcher, mpirun) has WORLD_SIZE or no accelerate parent and is left alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from accel_train.base.errors import UsageError

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class RanksAsked:
    """What the accelerate command line and config asked of this machine."""

    num_processes: int    # in all, over every machine (accelerate's meaning of num_processes)
    num_machines: int
    machine_rank: int
    master_addr: str
    master_port: int
    # The elastic settings of accelerate's command line (`accel-train launch --elastic` puts
    # them there), with its defaults.
    max_restarts: int = 0
    monitor_interval: float = 0.1
    rdzv_backend: str = "static"
    rdzv_conf: str = ""

    @property
    def local_processes(self) -> int:
        return self.num_processes // self.num_machines

    def describe(self) -> str:
        machines = (f" on machine {self.machine_rank} of {self.num_machines}"
                    if self.num_machines > 1 else "")
        return (f"accelerate's config asks for {self.num_processes} CPU processes (MULTI_CPU), "
                f"for which `accelerate launch` starts one: accel_train starts the "
                f"{self.local_processes} rank(s) of this machine itself{machines} "
                f"(torch's elastic launcher, gloo, rendezvous at "
                f"{self.master_addr}:{self.master_port})")


def parent_command_line() -> list[str]:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:  # not Linux, or the parent is gone
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _accelerate_launch_args(argv: Sequence[str]) -> Optional[list[str]]:
    """The arguments of `accelerate launch` in a command line, or None if it is not one.
    Spelled `accelerate launch ...` (the console script, maybe run by python) or
    `python -m accelerate.commands.launch ...`."""
    for i, part in enumerate(argv[:4]):
        if part == "accelerate.commands.launch" or part.endswith("accelerate/commands/launch.py"):
            return list(argv[i + 1:])
        if Path(part).name == "accelerate" and argv[i + 1:i + 2] == ["launch"]:
            return list(argv[i + 2:])
    return None


def ranks_asked(environ: Optional[Mapping[str, str]] = None,
                parent_argv: Optional[Sequence[str]] = None) -> Optional[RanksAsked]:
    """The ranks to start here, when accelerate's single-process launcher started this process
    under a command line or config that asks for more than one; else None."""
    env = os.environ if environ is None else environ
    if "ACCELERATE_USE_CPU" not in env or "WORLD_SIZE" in env:
        return None  # not accelerate's single-process launcher, or a real multi-process launch
    args = _accelerate_launch_args(parent_command_line() if parent_argv is None else parent_argv)
    if args is None:
        return None
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        launch = launch_command_parser().parse_known_args(args)[0]
    except SystemExit:  # accelerate parsed this same line already; cannot happen, but not ours
        return None
    if launch.mpirun_hostfile is not None:
        return None  # mpirun starts the ranks
    # As accelerate resolves them: a flag, else the config file (an explicit one, or its default
    # file unless --cpu), else 1 machine and machine rank 0.
    config_file = launch.config_file
    if config_file is None and os.path.isfile(default_config_file) and not launch.cpu:
        config_file = default_config_file
    config = load_config_from_file(config_file) if config_file else None
    if config is not None and getattr(config, "mpirun_config", None):
        if config.mpirun_config.get("mpirun_hostfile"):
            return None

    def asked(name: str, default: int) -> int:
        value = getattr(launch, name)
        if value is None and config is not None:
            value = getattr(config, name, None)
        return default if value is None else int(value)

    num_processes, num_machines = asked("num_processes", 1), asked("num_machines", 1)
    if num_processes <= 1 and num_machines <= 1:
        return None
    if num_machines < 1 or num_processes % num_machines or num_processes < num_machines:
        raise UsageError(f"the accelerate config asks for {num_processes} processes on "
                         f"{num_machines} machines: num_processes counts the processes of all "
                         f"machines together and must be a multiple of num_machines; answer "
                         f"`accelerate config` again or pass --num_processes")
    return RanksAsked(num_processes, num_machines, asked("machine_rank", 0),
                      env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                      launch.max_restarts, launch.monitor_interval, launch.rdzv_backend,
                      launch.rdzv_conf or "")


def _rendezvous_settings(asked: RanksAsked) -> dict:
    """torchrun's --rdzv-conf "key=value,key=value" as LaunchConfig takes it; a static
    rendezvous also needs this machine's rank (torchrun's --node-rank)."""
    settings = dict(item.split("=", 1) for item in asked.rdzv_conf.split(",") if "=" in item)
    if asked.rdzv_backend == "static":
        settings["rank"] = asked.machine_rank
    return settings


def _stop_when_the_launcher_dies() -> None:
    """`accelerate launch` runs us with subprocess and forwards no signal: a SIGTERM sent to it
    (by a user, a scheduler, a test) would end it and leave us training.  The kernel sends us
    SIGTERM when our parent dies instead (Linux), which the elastic agent passes on to every
    rank, as torchrun does; each then checkpoints and exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: a stopped launcher leaves us running
        return
    if os.getppid() == 1:  # the launcher already died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def start_ranks(asked: RanksAsked, say=print) -> int:
    """Start this machine's ranks, each the same program with the same arguments as this
    process (`sys.orig_argv`: `python -m accel_train ...`, the `accel-train` script, or a
    program that wraps the CLI), and wait for them.  The exit code is the first failed rank's
    (128 + the signal, for a rank killed by one)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    say(f"accel_train: {asked.describe()}", flush=True)
    config = LaunchConfig(
        min_nodes=asked.num_machines, max_nodes=asked.num_machines,
        nproc_per_node=asked.local_processes,
        # As torchrun under `accelerate launch`: the rendezvous at the main process's address,
        # "static" unless the command line says otherwise, the job id torchrun would take
        # (every machine must name the same one), the restarts asked for (none by default).
        rdzv_backend=asked.rdzv_backend, rdzv_endpoint=f"{asked.master_addr}:{asked.master_port}",
        rdzv_configs=_rendezvous_settings(asked),
        run_id=os.environ.get("PET_RDZV_ID", "none"), max_restarts=asked.max_restarts,
        monitor_interval=asked.monitor_interval)
    _stop_when_the_launcher_dies()
    try:
        elastic_launch(config, entrypoint=sys.executable)(*sys.orig_argv[1:])
    except ChildFailedError as err:
        failure = err.get_first_failure()[1]
        return failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
    except SignalException as err:  # the agent has passed the signal on to every rank
        return 128 + int(err.sigval)
    return 0
