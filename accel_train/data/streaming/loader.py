"""The training loader of a streaming run: each worker reads its slots' shards and hands out
the batches the plan gives it; a checkpoint records where the plan stood (stream.json), and a
resumed start takes the batches the interrupted epoch had not reached (see __init__.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from accel_train.base.errors import RunDiffers, UsageError
from accel_train.data.loaders import Batch, FinishOnDevice
from accel_train.base.randomness import loader_generator, reseed_loader
from accel_train.base.readers import read_json
from accel_train.data.worker_deaths import naming_handover_deaths, restarting_dead_workers
from accel_train.data.worker_start import worker_context, worker_init_fn
from accel_train.data.streaming.decoding import decode_substituting
from accel_train.data.streaming.plan import (Layout, Segment, rank_batches_per_epoch,
                                             remaining_batches, slot_keys, slot_shards)
from accel_train.data.streaming.shards import ShardSet, iter_shard

STREAM_STATE = "stream.json"  # in each checkpoint of a streaming run


class SlotReader:
    """Reads one slot's shards in order, keeping only the wanted samples that were read and not
    yet taken: with the planned shuffle, no more than the shuffle buffer."""

    def __init__(self, shards: ShardSet, owned: list[int], wanted: set[int]):
        self.shards, self.wanted = shards, wanted
        # Shards holding no wanted sample are not opened at all (a resumed epoch skips them).
        self.owned = [s for s in owned if any(shards.offsets[s] <= k < shards.offsets[s + 1]
                                              for k in wanted)] if len(wanted) < 4096 else owned
        self.held: dict[int, tuple] = {}
        self.samples = self._samples()

    def _samples(self):
        for s in self.owned:
            path, first = self.shards.files[s], int(self.shards.offsets[s])
            expected = self.shards.counts[s]
            n = 0
            for n, (image, label, name) in enumerate(iter_shard(path, self.shards.columns),
                                                     start=1):
                key = first + n - 1
                if n > expected:
                    break
                if key in self.wanted:
                    yield key, (image, label, f"{path.name} {name}")
            if n != expected:
                raise UsageError(f"shard {path} holds {n} samples but the index says "
                                 f"{expected}; the index disagrees with the shards")

    def take(self, key: int):
        while key not in self.held:
            try:
                got, sample = next(self.samples)
            except StopIteration:
                raise RuntimeError(f"sample {key} not found in its slot's shards") from None
            self.held[got] = sample
        return self.held.pop(key)



class StreamingTrain(IterableDataset):
    """One rank's training batches of the current epoch (already batched: DataLoader
    batch_size=None); loader worker p hands out batches p, p + W, ... of the rank's plan."""

    def __init__(self, shards: ShardSet, layout: Layout, rank: int, seed: int, buffer: int,
                 transform, shuffle: bool = True):
        self.shards, self.layout, self.rank, self.seed = shards, layout, rank, seed
        self.buffer, self.transform, self.shuffle = buffer, transform, shuffle
        self.bad_images = "substitute"  # --bad-images
        self.num_classes: Optional[int] = None  # a label outside them is a bad sample
        self.epoch = 0
        # (epoch, the layout that planned it, global samples of it already trained)
        self.resume: Optional[tuple[int, Layout, int]] = None

    def plan(self, epoch: int) -> tuple[Layout, list[list[Segment]]]:
        if self.resume is not None and self.resume[0] == epoch:
            _, old, done = self.resume
            return old, remaining_batches(self.shards, old, done, self.layout, self.rank)
        return self.layout, remaining_batches(self.shards, self.layout, 0, self.layout,
                                              self.rank)

    def __iter__(self):
        from torch.utils.data import get_worker_info
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = self.epoch
        source_layout, batches = self.plan(epoch)
        mine = batches[worker::workers]
        keys_of: dict[int, np.ndarray] = {}
        for batch in mine:
            for slot, _, _ in batch:
                if slot not in keys_of:
                    keys_of[slot] = slot_keys(self.shards, source_layout, self.seed, epoch,
                                              slot, self.buffer if self.shuffle else 1)
        wanted = {slot: set() for slot in keys_of}
        for batch in mine:
            for slot, a, b in batch:
                wanted[slot].update(int(k) for k in keys_of[slot][a:b])
        readers = {slot: SlotReader(self.shards, slot_shards(self.shards, source_layout,
                                                             self.seed, epoch, slot),
                                    wanted[slot]) for slot in keys_of}
        n = len(self.shards)
        for batch in mine:
            keys = [int(k) for slot, a, b in batch for k in keys_of[slot][a:b]]
            slots = [slot for slot, a, b in batch for _ in range(b - a)]
            images, labels, bad = decode_substituting(
                [readers[s].take(k) for s, k in zip(slots, keys)], self.bad_images,
                self.num_classes)
            keys_t = torch.as_tensor(keys, dtype=torch.long)
            replaced = torch.full((len(keys),), -1, dtype=torch.long)
            for position, _ in bad:  # the trainer names them (badimages.py, StreamSource)
                replaced[position] = keys[position]
            epochs = np.full(len(keys), epoch)
            # uint8 pixels; StreamLoader normalizes them on the device (data.FinishOnDevice)
            pixels = self.transform.pixel_list(images, self.seed, epochs, keys_t.numpy())
            # --reprob's erasing drawn here too, beside the training step (data.FinishOnDevice)
            erasing = self.transform.erasing_plan(pixels.shape, self.seed, epochs,
                                                  keys_t.numpy()) or ()
            yield (pixels, torch.as_tensor(labels, dtype=torch.long), keys_t + epoch * n,
                   replaced, *erasing)


class StreamLoader:
    """The training loader of a streaming run (loading.TrainLoader).  Not a DataLoader on
    purpose: Accelerate's prepare() would re-shard an iterable dataset across processes, or read
    it all on rank 0 and scatter; this one takes only the device from Accelerate."""

    name = "train_loader"  # a checkpointed part (checkpoint.py): stream.json

    def __init__(self, dataset: StreamingTrain, num_workers: int, prefetch_factor: int,
                 pin_memory: bool):
        self.dataset, self.num_workers = dataset, num_workers
        extra = dict(prefetch_factor=prefetch_factor,
                     multiprocessing_context=worker_context()) if num_workers > 0 else {}
        # Not persistent: each epoch's workers are started with that epoch's plan.  Its own
        # generator: workers' seeds never come from torch's global one (randomness.py); every
        # draw of theirs is seeded by the sample anyway.
        self.loader = DataLoader(dataset, batch_size=None, num_workers=num_workers,
                                 pin_memory=pin_memory, generator=loader_generator(dataset.seed),
                                 worker_init_fn=worker_init_fn(), **extra)
        self.device = None
        # Sample keys are epoch * len(shards) + the sample's number, as the indexed loader's.
        self.finish = FinishOnDevice(dataset.transform)
        self.samples_in_epoch = 0
        self.warn = lambda text: print(f"warning: {text}", file=sys.stderr)  # the trainer's

    @property
    def layout(self) -> Layout:
        return self.dataset.layout

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    def prepare(self, accelerator) -> None:
        self.device = accelerator.device

    def set_epoch(self, epoch: int) -> None:
        self.dataset.epoch, self.samples_in_epoch = epoch, 0

    def _epoch_layout(self) -> Layout:
        """The layout that planned the current epoch: a resumed one keeps the old plan."""
        resume = self.dataset.resume
        return resume[1] if resume is not None and resume[0] == self.epoch else self.layout

    def __len__(self) -> int:
        return len(self.dataset.plan(self.dataset.epoch)[1])

    @property
    def usable(self) -> int:
        """Global samples of the current epoch (the trainer's end-of-epoch test)."""
        lay = self._epoch_layout()
        return rank_batches_per_epoch(self.dataset.shards, lay) * lay.batch * lay.ranks

    def __iter__(self):
        """The rest of the epoch.  A loader worker that dies costs a warning: new workers plan
        the rest of the epoch from the samples handed out so far, as a resumed start plans it
        from a checkpoint's, so the run goes on with the batches it would have had."""
        yield from restarting_dead_workers(self._from_position, self._plan_from_position,
                                           self.where, self.warn)

    def where(self) -> str:
        return f"{self.samples_in_epoch} samples into epoch {self.epoch + 1}"

    def _plan_from_position(self) -> None:
        self.dataset.resume = (self.epoch, self._epoch_layout(), self.samples_in_epoch)

    def _from_position(self):
        # A restored epoch starts where it stopped by itself (StreamingTrain.plan).
        reseed_loader(self.loader.generator, self.dataset.seed, self.epoch, self.dataset.rank)
        per_micro_step = self.layout.batch * self.layout.ranks
        for batch in naming_handover_deaths(self.loader):
            self.samples_in_epoch += per_micro_step
            pixels, labels, keys, replaced, *erasing = (t.to(self.device, non_blocking=True)
                                                        for t in batch)
            yield Batch(self.finish(pixels, erasing), labels, keys, replaced)

    # -- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint records: the layout and each rank's and worker's position."""
        epoch, samples_in_epoch = self.epoch, self.samples_in_epoch
        lay = self._epoch_layout()
        positions = None
        if samples_in_epoch % (lay.batch * lay.ranks) == 0:  # else the epoch was re-cut
            done = samples_in_epoch // (lay.batch * lay.ranks)
            positions = [[{"slot": r * lay.workers + w,
                           "batches_taken": len(range(w, done, lay.workers)),
                           "samples_taken": len(range(w, done, lay.workers)) * lay.batch}
                          for w in range(lay.workers)] for r in range(lay.ranks)]
        return {"streaming": True, "epoch": epoch, "samples_in_epoch": samples_in_epoch,
                "seed": self.dataset.seed, "shuffle_buffer": self.dataset.buffer,
                "train_samples": len(self.dataset.shards),
                "num_shards": len(self.dataset.shards.files),
                "layout": lay.__dict__,  # the layout that planned this epoch
                "positions": positions}

    def close(self) -> None:
        """Nothing to end: its workers are not persistent, and end with the pass that started
        them (freed with the iteration, by reference count)."""

    def save(self, folder: Path) -> None:
        (Path(folder) / STREAM_STATE).write_text(json.dumps(self.state(), indent=1) + "\n")

    def load(self, folder: Path) -> None:
        """A resumed start: the interrupted epoch continues with the old plan's next batches."""
        path = Path(folder) / STREAM_STATE
        if not path.is_file():
            raise RunDiffers(f"{folder} was saved by a map-style run (no {STREAM_STATE}); "
                             f"it cannot resume a streaming run: start a new run, or resume "
                             f"without --streaming and a shard folder")
        saved = read_json(path, "stream_state")  # its shape checked (readers.py)
        if saved.get("shuffle_buffer") != self.dataset.buffer:
            raise RunDiffers(f"the checkpoint was trained with --shuffle-buffer "
                             f"{saved.get('shuffle_buffer')}; resume with the same value")
        if saved.get("num_shards") != len(self.dataset.shards.files):
            raise RunDiffers(f"the checkpoint was trained on {saved.get('num_shards')} shards but "
                             f"this start has {len(self.dataset.shards.files)}")
        epoch, samples_in_epoch = saved["epoch"], saved["samples_in_epoch"]
        self.dataset.epoch, self.samples_in_epoch = epoch, samples_in_epoch
        if samples_in_epoch:
            self.dataset.resume = (epoch, Layout(**saved["layout"]), samples_in_epoch)
