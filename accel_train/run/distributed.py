"""Process-group start-up and the launcher's environment.

This is the only module that reads the launcher's variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*; SLURM_* only for the record, `slurm_facts`).  It
starts the process group itself, before Accelerate does, for two reasons found on these
machines (docs/architecture.md, "Why"):

* On a machine without CUDA, `accelerate launch --multi_gpu` workers otherwise each train alone
  with world size 1; a gloo group started here is picked up by `Accelerator(cpu=True)`.
* After an elastic restart under gloo, new workers read the dead round's peer addresses from the
  agent's store and fail with "Connection refused".  Keying the store by run id and restart
  attempt (a `PrefixStore`) gives each round a clean namespace (only on the agent's store: see
  `_make_store`).

It also holds the rank helpers that everything else uses to act once for all ranks: rank 0
decides and broadcasts (`decide_on_main`), rank 0 first then the rest (`main_first`), a vote
(`any_rank`), and printing once in total (`print_once`).  They work before the Accelerator exists.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import os
import re
import signal
import socket
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Optional, TypeVar
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import constants as dist_constants

from accel_train.run.collectives import LONG_TIMEOUT
from accel_train.config import TrainConfig, flag, parse_gpu_ids
from accel_train.base.errors import UsageError
from accel_train.base.ranks import (any_rank, decide_on_main, fair_core_share,  # noqa: F401
                                     is_global_main, main_first, more_than_one_rank,
                                     print_once, process_cores, record_core_share,
                                     usable_core_ids, usable_cores)

LAUNCHER_HELP = ("torchrun/accelerate launch set WORLD_SIZE = nnodes x nproc-per-node, RANK and "
                 "LOCAL_RANK per process, and MASTER_ADDR/MASTER_PORT from --master-addr/"
                 "--master-port (or the accelerate YAML's main_process_ip/port)")
_STORE: Optional[dist.Store] = None  # the process group's store, once setup made one
# The default process group, referenced from Python until it can be freed safely (teardown's
# docstring says why).
_HELD_GROUPS: list = []
# How many process groups this process has started: a program may call fit() again under the
# same launcher (a sweep), every rank the same number of times (see `_make_store`).
_groups_started = 0
# Whether the last setup() started the default group.  When the program that called fit() did,
# the group stays the program's: teardown() destroys only the groups the run made for itself.
_started_default_group = False
_RUN_SUBGROUPS: list = []  # the groups cpu_control_group() made, for teardown()
T = TypeVar("T")


@dataclass(frozen=True)
class LauncherEnv:
    """What the launcher told this process; launched=False for a plain `python -m accel_train`."""

    launched: bool
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    restart_count: int = 0
    run_id: str = "none"
    agent_store: bool = False
    max_restarts: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "LauncherEnv":
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env or "RANK" not in env:
            return cls(launched=False)
        port = env.get("MASTER_PORT")
        return cls(
            launched=True,
            world_size=int(env["WORLD_SIZE"]),
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(port) if port else None,
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)),
        )


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return socket.gethostbyname(a) == socket.gethostbyname(b)
    except OSError:
        return False


def _parse_dist_url(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
        raise UsageError(f"--dist_url {url!r} is not of the form tcp://HOST:PORT, "
                         f"e.g. tcp://127.0.0.1:23456")
    return parsed.hostname, parsed.port


def check_manual_flags(config: TrainConfig, env: LauncherEnv, cuda_count: int) -> None:
    """The seed manual's --world_size/--rank/--local_rank/--dist_url/--gpu_ids, checked.

    With a launcher they must agree with what it set; without one, --world_size > 1 needs
    --rank and --dist_url (the classic manual start, one command per process), and a single
    process takes no --rank but 0 and a well-formed --dist_url, which it then ignores, saying so
    (`ignored_dist_url_warning`).
    """
    if env.launched:
        pairs = (("world_size", config.world_size, env.world_size, "WORLD_SIZE"),
                 ("rank", config.rank, env.rank, "RANK"),
                 ("local_rank", config.local_rank, env.local_rank, "LOCAL_RANK"))
        for name, given, actual, var in pairs:
            if given is not None and given != actual:
                raise UsageError(f"--{name} {given} contradicts the launcher's {var}={actual} "
                                 f"({LAUNCHER_HELP}); drop --{name} or fix the launch command")
        if config.dist_url and env.master_addr and env.master_port:
            host, port = _parse_dist_url(config.dist_url)
            if port != env.master_port or not _same_host(host, env.master_addr):
                raise UsageError(f"--dist_url {config.dist_url} contradicts the launcher's "
                                 f"MASTER_ADDR={env.master_addr} MASTER_PORT={env.master_port}; "
                                 f"drop --dist_url or pass the same address to the launcher")
    elif (config.world_size or 1) > 1:
        if config.rank is None or config.dist_url is None:
            raise UsageError(f"--world_size {config.world_size} without a launcher needs --rank "
                             f"and --dist_url on each process; or start with torchrun "
                             f"--nproc-per-node {config.world_size} / accelerate launch")
        if config.rank >= config.world_size:
            raise UsageError(f"--rank {config.rank} must be below --world_size "
                             f"{config.world_size}")
        _parse_dist_url(config.dist_url)
    elif config.rank not in (None, 0):
        if config.world_size == 1:  # it was given: the rank is what cannot be
            raise UsageError(f"--rank {config.rank} must be below --world_size 1 (a single "
                             f"process is rank 0); for more processes give each --world_size N, "
                             f"its --rank and the same --dist_url, or use a launcher")
        raise UsageError(f"--rank {config.rank} given for a single process; add --world_size "
                         f"and --dist_url, or use a launcher")
    elif config.dist_url is not None:
        _parse_dist_url(config.dist_url)  # checked even where unused (ignored_dist_url_warning)

    if config.gpu_ids is not None:
        ids = parse_gpu_ids(config.gpu_ids)
        if cuda_count == 0:
            raise UsageError(f"--gpu_ids {config.gpu_ids} given but this machine has no CUDA "
                             f"device; drop --gpu_ids to train on the CPU")
        if len(ids) < env.local_world_size:
            raise UsageError(f"--gpu_ids {config.gpu_ids} lists {len(ids)} GPU(s) for "
                             f"{env.local_world_size} processes on this machine; list one per "
                             f"process")


def ignored_dist_url_warning(config: TrainConfig, env: LauncherEnv) -> Optional[str]:
    """A single process without a launcher (--world_size 1 or none) starts no process group,
    so --dist_url has nothing to address; said rather than silently dropped (it often means the
    other flags of a hand-started group were forgotten)."""
    if env.launched or config.dist_url is None or (config.world_size or 1) > 1:
        return None
    return (f"--dist_url {config.dist_url} is ignored: this is a single process (world size 1, "
            f"no launcher), which starts no process group; to start a group by hand give each "
            f"process --world_size N --rank R and the same --dist_url, or drop --dist_url")


def _show_only_the_gpus_asked_for(gpu_ids: str) -> None:
    """--gpu_ids as CUDA_VISIBLE_DEVICES (local rank i then uses the i-th).  Set before anything
    asks torch about CUDA: the driver reads the variable once, when CUDA initialises (which
    torch.cuda.is_available() may do), and ignores later changes.  A different value already in
    the environment is a contradiction, not something to override or be overridden by."""
    wanted = ",".join(str(i) for i in parse_gpu_ids(gpu_ids))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible not in (None, wanted):
        raise UsageError(f"--gpu_ids {gpu_ids} contradicts CUDA_VISIBLE_DEVICES={visible}; set "
                         f"only one of them")
    os.environ["CUDA_VISIBLE_DEVICES"] = wanted


def _env_from_manual_flags(config: TrainConfig, cuda_count: int) -> LauncherEnv:
    """The classic start without a launcher: --world_size N --rank R --dist_url tcp://H:P.

    Without --local_rank, a machine's processes are taken to be numbered consecutively, one per
    visible GPU (the manual's way: ranks 4k..4k+3 on a machine with 4), so rank R uses GPU
    R mod the GPUs it sees; taking 0 for all would put every process on GPU 0, which NCCL
    refuses."""
    host, port = _parse_dist_url(config.dist_url)
    local_rank = config.local_rank
    if local_rank is None:
        local_rank = config.rank % cuda_count if cuda_count else 0
    for key, value in (("WORLD_SIZE", config.world_size), ("RANK", config.rank),
                       ("LOCAL_RANK", local_rank), ("MASTER_ADDR", host), ("MASTER_PORT", port)):
        os.environ[key] = str(value)  # so Accelerate and any library see the same world
    return LauncherEnv(launched=True, world_size=config.world_size, rank=config.rank,
                       local_rank=local_rank, master_addr=host, master_port=port)


def _make_store(env: LauncherEnv) -> dist.Store:
    """A TCP store namespaced by run id and restart attempt (see the module docstring)."""
    if not env.master_addr or not env.master_port:
        raise UsageError("the launcher set WORLD_SIZE but not MASTER_ADDR/MASTER_PORT; launch "
                         "with torchrun or accelerate launch, or pass --dist_url")
    # Under torchelastic the agent hosts the store; otherwise rank 0 does.
    is_master = (not env.agent_store) and env.rank == 0
    base = dist.TCPStore(env.master_addr, env.master_port,
                         None if not is_master else env.world_size, is_master,
                         timeout=LONG_TIMEOUT, wait_for_workers=False)
    # Only the agent's store outlives a round of workers, so only there can keys go stale.  A
    # store that rank 0 hosts is new each round (the c10d rendezvous without a shared store picks
    # a new port), and there the restart count must stay out of the prefix: it is counted per
    # agent, so a machine that joined later has a lower one and would wait in another namespace
    # forever (found with `torchrun --nnodes 1:2`, a node leaving and a new one joining).
    attempt = f"attempt_{env.restart_count}" if env.agent_store else "own_store"
    # A second run in the same processes (fit() called again) finds the first one's keys on the
    # agent's store too: gloo would connect to the first group's closed sockets ("Connection
    # refused") and the heartbeats would read the first run's.  Each group gets its own
    # namespace; the ranks agree on its number because each starts the same runs in order.
    global _groups_started
    _groups_started += 1
    return dist.PrefixStore(f"accel_train/{env.run_id}/{attempt}/group_{_groups_started}", base)


@contextlib.contextmanager
def interruptible_by_ctrl_c():
    """The rendezvous waits inside torch's C++ (the store, the group's first barrier), where
    Python's Ctrl-C handler never runs: a rank waiting for a peer that was never started sat
    through Ctrl-C until its 30-minute timeout.  Nothing is trained or written yet, so the
    default action (end the process) is the right one meanwhile; restored after."""
    import threading
    if threading.current_thread() is not threading.main_thread():  # signal.signal refuses
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def setup(config: TrainConfig) -> LauncherEnv:
    """Check the manual's flags and start the process group when there is more than one process.

    Must run before anything touches CUDA (it may set CUDA_VISIBLE_DEVICES from --gpu_ids).
    """
    env = LauncherEnv.from_environ()
    if config.gpu_ids is not None:
        _show_only_the_gpus_asked_for(config.gpu_ids)
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_manual_flags(config, env, cuda_count)
    by_hand = not env.launched and (config.world_size or 1) > 1
    if by_hand:
        env = _env_from_manual_flags(config, cuda_count)
    global _STORE, _started_default_group
    _started_default_group = env.world_size > 1 and not dist.is_initialized()
    if _started_default_group:
        use_cuda = cuda_count > 0
        if use_cuda:
            torch.cuda.set_device(env.local_rank)
        # NCCL ends a collective that overruns its timeout only with async error handling on
        # (its watchdog aborts the communicator); without it a hang would last forever.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if by_hand:  # no launcher says what it waits for; a missing rank would look hung
            print(f"rank {env.rank} of {env.world_size}: waiting for the other ranks at "
                  f"{config.dist_url} (each started with --world_size {env.world_size}, its own "
                  f"--rank and this --dist_url; Ctrl-C stops)", flush=True)  # stdout: not an error
        with interruptible_by_ctrl_c():
            _STORE = _make_store(env)
            # Long, for start-up and the first step; collectives.py tightens it after that.
            dist.init_process_group("nccl" if use_cuda else "gloo", store=_STORE,
                                    rank=env.rank, world_size=env.world_size,
                                    timeout=LONG_TIMEOUT)
    record_core_share(None)
    if dist.is_initialized():  # started here, or by the program that called fit
        _hold_default_group()
        everyone = gather_each_rank(config)
        check_same_options(config, everyone)
        record_core_share(core_share(everyone))
    if _started_default_group:
        share_the_cores()
    return env


def gather_each_rank(config: TrainConfig) -> list[dict]:
    """What each rank was started with that the others must know, in one gather: its options
    (check_same_options), its machine and the cores it may run on (core_share)."""
    import socket
    mine = {"options": {key: value for key, value in dataclasses.asdict(config).items()
                        if key not in PER_PROCESS_OPTIONS},
            "host": socket.gethostname(), "cores": sorted(usable_core_ids())}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def core_share(everyone: list[dict]) -> float:
    """This rank's share of its machine's cores, beside the other ranks there (fair_core_share:
    ranks pinned to cores of their own keep them)."""
    rank = dist.get_rank()
    mine = everyone[rank]
    others = [theirs["cores"] for other, theirs in enumerate(everyone)
              if other != rank and theirs["host"] == mine["host"]]
    return fair_core_share(mine["cores"], others)


def share_the_cores() -> None:
    """Ranks on one machine share its cores: torch gives each process a thread per core, so
    two ranks on two cores ran four threads whose OpenMP barriers waited on each other
    (BENCHMARKS.md: a manual 2-rank start on 2 cores trained several times slower than with
    one thread each).  torchrun, `python -m torch.distributed.launch` and accelerate launch set
    OMP_NUM_THREADS for their workers; ranks started by hand (--world_size --rank --dist_url),
    or by SLURM's srun, get here the machine's cores divided among its ranks, and
    OMP_NUM_THREADS set to match (Accelerate, finding it unset, would give each process all
    the cores again: it counts the ranks on a machine from LOCAL_WORLD_SIZE, which only a
    launcher sets).  An OMP_NUM_THREADS the user set is kept.  The cores are divided as the
    ranks' affinities share them (base.ranks.fair_core_share: a rank pinned to cores of its own
    keeps them), whole cores, at least one."""
    share = process_cores(1)  # as the ranks compared their cores at the group's start
    if share < usable_cores() and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, int(share))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


# options that may differ between the ranks of one run: which process it is, and where its
# machine keeps the data, the weights and the run (paths local to each machine)
PER_PROCESS_OPTIONS = frozenset({"rank", "local_rank", "gpu_ids", "dist_url", "num_workers",
                                 "progress", "data_dir", "train_labels", "val_labels",
                                 "pretrained", "output_dir", "checkpoint", "config"})


def check_same_options(config: TrainConfig, everyone: list[dict]) -> None:
    """Every rank was started with the same options: commands typed per process (the manual's
    flags, one shell a machine) can differ by a typo, and then the ranks disagreed in a C++
    abort (another --batch-size: gloo's "data size doesn't match") or, worse, silently (another
    --seed: another data order on each rank).  One line on every rank, naming the first.
    `everyone`: what each rank was started with (gather_each_rank)."""
    options = [theirs["options"] for theirs in everyone]
    for rank, theirs in enumerate(options):
        differing = [key for key in options[0] if theirs.get(key) != options[0].get(key)]
        if differing:
            key, more = differing[0], len(differing) - 1
            also = f" (and {more} more option(s))" if more else ""
            raise UsageError(f"rank {rank} was started with {flag(key)} {theirs.get(key)!r}, "
                             f"rank 0 with {options[0].get(key)!r}{also}: start every rank "
                             f"with the same options")


def launcher_facts() -> dict:
    """What the launcher and the process group told this process, for the run's config.yaml: the
    proof of how a run was really started (world size, machines, elastic settings that reached
    the agent), whatever the command line claimed."""
    env = LauncherEnv.from_environ()
    group = dist.is_available() and dist.is_initialized()
    facts = {"launched": env.launched,
             "process_group_world_size": dist.get_world_size() if group else 1,
             "backend": dist.get_backend() if group else None,
             "processes_per_machine": env.local_world_size,
             "num_machines": max(1, env.world_size // max(1, env.local_world_size)),
             "master_addr": env.master_addr, "master_port": env.master_port}
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun's agent (accelerate launch too)
        facts["torchelastic"] = {"run_id": env.run_id, "max_restarts": env.max_restarts,
                                 "restart_count": env.restart_count,
                                 "agent_store": env.agent_store}
    if os.environ.get("SLURM_JOB_ID"):  # inside a SLURM job (scripts/slurm/train.sbatch)
        facts["slurm"] = slurm_facts()
    return facts


def slurm_facts(environ: Mapping[str, str] | None = None) -> dict:
    """The SLURM job this process runs in: job id, this node, how often it was requeued."""
    env = os.environ if environ is None else environ
    return {"job_id": env.get("SLURM_JOB_ID"), "job_name": env.get("SLURM_JOB_NAME"),
            "node": env.get("SLURMD_NODENAME") or socket.gethostname(),
            "node_id": int(env.get("SLURM_NODEID", 0)),
            "num_nodes": int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1),
            "restart_count": int(env.get("SLURM_RESTART_COUNT") or 0)}


def run_lock_job(environ: Mapping[str, str] | None = None) -> Optional[str]:
    """The job this process belongs to, as the run lock records it (runlock.py): a new round or
    allocation of the same job may wait for, or take over, its previous holder.  A torchelastic
    job by its rendezvous id, or (the default id "none") by its agent, the parent of every round
    of workers on this machine; else a SLURM job (a requeue keeps the job id); else none."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        run_id = env["TORCHELASTIC_RUN_ID"]
        if run_id not in ("", "none"):
            return f"torchelastic job {run_id}"
        return f"torchelastic agent pid {os.getppid()} on {socket.gethostname()}"
    if env.get("SLURM_JOB_ID"):
        return f"SLURM job {env['SLURM_JOB_ID']}"
    return None


def describe_process() -> str:
    """One line for each rank's own log: who this process is in the group it really joined."""
    env = LauncherEnv.from_environ()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return (f"process rank {rank} of {world} (local rank {env.local_rank} of "
            f"{env.local_world_size}) on {socket.gethostname()}, pid {os.getpid()}, "
            f"restart {env.restart_count}")


NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")  # written by NVIDIA's kernel module


def nvidia_driver_version(path: Optional[Path] = None) -> Optional[str]:
    """The NVIDIA driver this machine runs ("unknown" if its file says no number), or None
    where there is none: GPUs are there whether or not torch can use them."""
    try:
        text = (path or NVIDIA_DRIVER_FILE).read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", text)
    return match.group(1) if match else "unknown"


def unusable_gpu_warning() -> Optional[str]:
    """GPUs that this torch cannot use (most often a driver older than the CUDA torch was built
    for) leave a run on the CPU, in fp32, over gloo; without this line the only sign would be
    "device cpu" in the summary."""
    if torch.cuda.is_available():
        return None
    driver = nvidia_driver_version()
    if driver is None:
        return None
    built = torch.version.cuda
    return (f"this machine has NVIDIA GPU(s) (driver {driver}) but this torch "
            f"({torch.__version__}, {f'built for CUDA {built}' if built else 'a CPU-only build'}"
            f") cannot use them: training on the CPU. Install a torch built for a CUDA that "
            f"driver supports (nvidia-smi shows it), or update the driver")


class StopSignals:
    """SIGTERM/SIGINT become a request to stop at the next optimizer step, agreed by all ranks:
    a scheduler may signal only some of them, and ranks that stopped at different steps would
    hang in their next collective."""

    def __init__(self, control_group=None):
        """`control_group`: a `cpu_control_group()`, or None for one process."""
        self.requested: Optional[int] = None  # the signal received on this rank, if any
        self._group = control_group

    def request(self, signum, frame=None):
        # The first signal asks for a checkpoint at the next optimizer step; a second Ctrl-C
        # means "now", at the cost of what was trained since the last checkpoint.
        if signum == signal.SIGINT and self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum

    def handlers_installed(self):
        return _SignalHandlers(self.request)

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (the same answer on every rank)."""
        local = self.requested or 0
        if self._group is None:  # one process: nobody to agree with
            return local != 0
        flag = torch.tensor([local], dtype=torch.int32)  # on the CPU: see _group
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())


class _SignalHandlers:
    """Installs `handler` for SIGTERM and SIGINT inside a `with`, restoring the old ones after."""

    def __init__(self, handler):
        self.handler, self.previous = handler, {}

    def __enter__(self):
        self.previous = {sig: signal.signal(sig, self.handler)
                         for sig in (signal.SIGTERM, signal.SIGINT)}

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def cpu_control_group(num_processes: int):
    """A gloo group for the few small agreements made while training (stop now? how many
    steps?): under NCCL a CPU tensor there costs no host wait for the GPU, where the default
    group's .item() would sync every step.  Every rank must call it, in the same order, as
    new_group requires; None for one process."""
    if num_processes == 1:
        return None
    group = dist.new_group(backend="gloo")
    _RUN_SUBGROUPS.append(group)
    return group


def max_over_ranks(value: float, control_group) -> float:
    """The largest `value` of all ranks, on every rank (the slowest rank's step time)."""
    if control_group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=control_group)
    return float(tensor.item())


def from_main(value: int, control_group) -> int:
    """Rank 0's `value` on every rank (rank 0 decides, all follow; during training, on the CPU
    control group)."""
    if control_group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(tensor, src=0, group=control_group)
    return int(tensor.item())


class RankAgreement:
    """The agreements the loop's parts make over a control group (None: one process)."""

    def __init__(self, control_group):
        self.control_group = control_group

    def max(self, value: float) -> float:
        return max_over_ranks(value, self.control_group)

    def from_main(self, value: int) -> int:
        return from_main(value, self.control_group)


def group_store() -> Optional[dist.Store]:
    """The store of the process group this module started (None for one process, or a group
    started by someone else): where the ranks leave their heartbeats (collectives.py)."""
    return _STORE if dist.is_initialized() else None


def teardown(run: Optional[weakref.ref] = None) -> None:
    """Destroy the process groups the run started, and free them while the interpreter lives.
    A default group that the program calling fit() started stays, its own (its timeout set
    back to torch's default): only the run's control group goes.

    Why: a gloo group's worker thread drops a finished collective after its caller has moved
    on, and a tensor the collective holds may be the last reference to a Python object, which
    takes the GIL.  destroy_process_group() forgets the groups, but the DDP reducer still holds
    the default one from C++ and the run's control group sits in its reference cycles, so
    they lived until the interpreter finalized: a worker thread taking the GIL then ends the
    process with "terminate called without an active exception" (SIGABRT, about one rank in
    250 two-process runs on a 2-core CPU; pytorch/pytorch#179291).  Freeing a group joins its
    threads.  The last reference must go from Python, since torch's holder releases the GIL
    while the group joins (a thread may be waiting for it); from the reducer's C++ the GIL
    would be held, a deadlock.  Hence the collection first (the run's cycles: the reducer, and
    the control group, which only Python objects reference) while `_HELD_GROUPS` keeps the
    default group, then that reference dropped.

    `run`: a weak reference to what holds the groups (the trainer, which the caller has
    dropped).  Unless it is gone after the collection (an exception's traceback, a program's
    callback keeps it), or with none (eval's teardown, a start that failed before the trainer
    existed), the default group stays held until the interpreter's exit handlers, which run
    before it finalizes: `_free_held_groups` then."""
    global _STORE
    _STORE = None
    if dist.is_initialized():
        if _started_default_group:
            dist.destroy_process_group()
        else:  # the calling program's group: it may go on using it (another fit, a barrier)
            # The run tightened its timeout (collectives.py); torch offers no public way to
            # read the one it had, so it gets torch's default for its backend back.
            dist.set_timeout(torch_default_timeout(dist.get_backend()))
            for group in _RUN_SUBGROUPS:
                dist.destroy_process_group(group)
    _RUN_SUBGROUPS.clear()
    if _HELD_GROUPS and run is not None:
        gc.collect()
        if run() is None:
            _HELD_GROUPS.clear()


def torch_default_timeout(backend: str) -> timedelta:
    """What init_process_group gives a group when its caller names no timeout."""
    return (dist_constants.default_pg_nccl_timeout if backend == "nccl"
            else dist_constants.default_pg_timeout)


def _hold_default_group() -> None:
    """Reference the default group from Python until teardown() or the exit handlers free it."""
    if not any(held is dist.group.WORLD for held in _HELD_GROUPS):
        _HELD_GROUPS.append(dist.group.WORLD)
    atexit.unregister(_free_held_groups)  # once, however many runs the process makes
    atexit.register(_free_held_groups)


def _free_held_groups() -> None:
    """At exit, before the interpreter finalizes: the default group teardown() left held."""
    if _HELD_GROUPS:
        gc.collect()
        _HELD_GROUPS.clear()
