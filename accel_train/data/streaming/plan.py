"""The plan of an epoch: which slot reads which shards, in which shuffled order, and which
batches each rank trains, all computed from sample numbers alone (no shard is opened here).

Pure functions of (seed, epoch, shard counts, layout), so every rank and worker computes the
same plan on its own, and a resumed run re-computes the interrupted one (see __init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from accel_train.base.errors import UsageError
from accel_train.data.streaming.shards import ShardSet

SHARD_ORDER_SALT = 7


@dataclass(frozen=True)
class Layout:
    """How an epoch is cut: processes, loader workers per process, per-process batch size,
    accumulation steps.  A checkpoint records the one that planned its epoch."""

    ranks: int
    workers: int
    batch: int
    accumulation: int

    @property
    def slots(self) -> int:
        return self.ranks * self.workers


def shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64([seed, epoch, SHARD_ORDER_SALT])) \
        .permutation(num_shards)


def slot_shards(shards: ShardSet, layout: Layout, seed: int, epoch: int, slot: int) -> list[int]:
    return [int(s) for s in shard_order(len(shards.files), seed, epoch)[slot::layout.slots]]


def planned_shuffle(keys: np.ndarray, buffer: int, rng: np.random.Generator) -> np.ndarray:
    """The order a shuffle buffer of `buffer` samples hands `keys` (read in order) out in."""
    if buffer <= 1 or len(keys) <= 1:
        return keys.copy()
    out = np.empty_like(keys)
    held = list(keys[:buffer])
    draws = rng.integers(0, len(held), size=max(0, len(keys) - len(held)))
    for t, key in enumerate(keys[len(held):]):
        j = draws[t]
        out[t] = held[j]
        held[j] = key
    n = len(keys) - len(held)
    out[n:] = np.asarray(held, dtype=keys.dtype)[rng.permutation(len(held))]
    return out


def slot_keys(shards: ShardSet, layout: Layout, seed: int, epoch: int, slot: int,
              buffer: int) -> np.ndarray:
    owned = slot_shards(shards, layout, seed, epoch, slot)
    keys = np.concatenate([np.arange(shards.offsets[s], shards.offsets[s + 1])
                           for s in owned]) if owned else np.zeros(0, np.int64)
    rng = np.random.Generator(np.random.PCG64([seed, epoch, slot + 1000]))
    return planned_shuffle(keys.astype(np.int64), buffer, rng)


def batches_per_slot(shards: ShardSet, layout: Layout) -> int:
    """q: whole batches every slot gives every epoch, whatever the shard order."""
    per_slot = len(shards.files) // layout.slots
    smallest = sorted(shards.counts)[:per_slot]
    return int(sum(smallest)) // layout.batch


def rank_batches_per_epoch(shards: ShardSet, layout: Layout) -> int:
    """T: batches per rank per epoch, a multiple of the accumulation steps."""
    total = layout.workers * batches_per_slot(shards, layout)
    return total // layout.accumulation * layout.accumulation


def fit_workers(shards: ShardSet, ranks: int, batch: int, accumulation: int,
                wanted: int) -> int:
    """Loader workers per rank (>= 1 slot reader even with --num-workers 0): each needs a
    shard of its own and one whole batch."""
    if len(shards.files) < ranks:
        raise UsageError(f"{len(shards.files)} training shard(s) for {ranks} processes: each "
                         f"process needs at least one; write smaller shards (accel-train shard "
                         f"--samples-per-shard N)")
    workers = max(1, min(max(1, wanted), len(shards.files) // ranks))
    while workers > 1 and rank_batches_per_epoch(
            shards, Layout(ranks, workers, batch, accumulation)) == 0:
        workers -= 1
    if rank_batches_per_epoch(shards, Layout(ranks, workers, batch, accumulation)) == 0:
        raise UsageError(f"the shards cannot fill one optimizer step per epoch on {ranks} "
                         f"process(es) x batch {batch} x {accumulation} accumulation step(s); "
                         f"lower --batch-size or write smaller shards")
    return workers


Segment = tuple[int, int, int]  # (slot, first position, end position) in the slot's keys


def remaining_batches(shards: ShardSet, old: Layout, done_samples: int, new: Layout,
                      rank: int) -> list[list[Segment]]:
    """The batches new rank `rank` trains in an epoch planned by the `old` layout, of which
    `done_samples` (global) were trained: the old plan's batches flattened in order (batch i of
    rank 0, of rank 1, ..., then batch i + 1), the first `done_samples` samples dropped, the
    rest cut into new batches; chunk c goes to new rank c mod new.ranks.  On the old layout
    itself, with done_samples = 0, that is the old plan.  Each stop and re-cut within one epoch
    only moves `done_samples` on: the epoch keeps the layout that planned it."""
    total = rank_batches_per_epoch(shards, old)
    flat: list[Segment] = []
    skip = done_samples
    for i in range(total):
        for r in range(old.ranks):
            slot = r * old.workers + i % old.workers
            start = (i // old.workers) * old.batch
            if skip >= old.batch:
                skip -= old.batch
                continue
            flat.append((slot, start + skip, start + old.batch))
            skip = 0
    out: list[list[Segment]] = []
    chunk: list[Segment] = []
    room, c = new.batch, 0
    for slot, a, b in flat:
        while a < b:
            take = min(room, b - a)
            if c % new.ranks == rank:
                chunk.append((slot, a, a + take))
            a += take
            room -= take
            if room == 0:
                if c % new.ranks == rank:
                    out.append(chunk)
                chunk, room, c = [], new.batch, c + 1
    return out
