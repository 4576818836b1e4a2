"""Rank helpers that work before the Accelerator exists (the start plan is made before it): rank
0 decides and broadcasts (`decide_on_main`), rank 0 first then the rest (`main_first`), a vote
(`any_rank`), and printing once in total (`print_once`).  Outside a process group each is the
one-process answer."""

from __future__ import annotations

import os
from typing import Callable, Collection, Iterable, Optional, TypeVar

import torch.distributed as dist

from accel_train.base.errors import UsageError
from accel_train.base.wording import in_callers_words

T = TypeVar("T")


def usable_core_ids() -> set[int]:
    """The cores this process may run on (a SLURM allocation or taskset narrows them), not all
    of the machine's: what the loader workers and the ranks of one machine share."""
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not on Linux: every core
        return set(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many cores this process may run on (usable_core_ids)."""
    return len(usable_core_ids())


def fair_core_share(mine: Collection[int], others: Iterable[Collection[int]]) -> float:
    """This process's share of the cores it may run on (`mine`), `others` being the cores each
    other process on its machine may run on: each core counts 1/n for the n processes that may
    run on it.  Processes given the same cores (what a launcher does by default) split them
    evenly; processes pinned to cores of their own (torchrun --numa-binding exclusive, taskset,
    numactl, srun's CPU binding) keep theirs, where dividing their own cores by the machine's
    process count again left a rank bound to 12 of 96 cores beside 7 others with one loader
    worker."""
    others = [set(cores) for cores in others]
    return sum(1 / (1 + sum(core in cores for cores in others)) for core in mine)


# This process's share of its machine's cores once the ranks of its process group compared the
# cores each may run on (run/distributed.py, at the group's start); None outside a group.
_compared_share: Optional[float] = None


def record_core_share(share: Optional[float]) -> None:
    global _compared_share
    _compared_share = share


def process_cores(processes_per_machine: int) -> float:
    """This process's share of its machine's cores: as the ranks of its group divided them
    among themselves (fair_core_share), else the usable cores split evenly among the machine's
    `processes_per_machine` processes."""
    if _compared_share is not None:
        return _compared_share
    return usable_cores() / max(1, processes_per_machine)


def more_than_one_rank() -> bool:
    """True inside a process group of two or more ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_global_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def decide_on_main(compute: Callable[[], T]) -> T:
    """Rank 0 decides, all follow: run `compute` on global rank 0 only and hand its result (or
    its UsageError) to every rank, so that decisions about shared files are made once and never
    diverge across ranks."""
    result: list = [None]
    if is_global_main():
        try:
            result[0] = ("ok", compute())
        except UsageError as err:
            result[0] = ("error", str(err))
    if more_than_one_rank():
        dist.broadcast_object_list(result, src=0)
    kind, value = result[0]
    if kind == "error":
        raise UsageError(value)
    return value


def main_first(compute: Callable[[], T]) -> T:
    """Run `compute` on rank 0 first, then on the other ranks (datasets builds its Arrow cache
    once).  Unlike `accelerator.main_process_first`, a UsageError on rank 0 reaches every rank
    at once, instead of leaving them at a barrier until the 30-minute collective timeout."""
    result = {}

    def on_main():
        result["value"] = compute()

    decide_on_main(on_main)
    return result["value"] if "value" in result else compute()


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (ranks that disagreed about, say,
    resuming would deadlock in their first collective)."""
    if not more_than_one_rank():
        return flag
    votes: list = [None] * dist.get_world_size()
    dist.all_gather_object(votes, flag)
    return any(votes)


def print_once(text: str) -> None:
    """Print on the global main process only.  Not `accelerator.print`: that prints once per
    *machine* (local main process), so a 2-machine run, or the manual --rank start where every
    process is local rank 0, would print everything twice."""
    if is_global_main():
        print(in_callers_words(text), flush=True)
