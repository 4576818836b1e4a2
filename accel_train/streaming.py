"""Data larger than one machine: WebDataset tar (or parquet) shards, streamed, with exact resume.

Layout written by `accel-train shard` (commands/shard.py) and read here:

    DIR/index.json            {"format": "accel_train-shards/1", "class_names": [...],
                               "splits": {"train": [{"file": "train/000000.tar", "count": N}, ...],
                                          "test": [...]}}
    DIR/train/000000.tar      000000000.png + 000000000.cls, 000000001.png + ... (WebDataset)
    DIR/test/000000.tar

A folder of `*.tar` without an index is read too (its shards are scanned once at start for their
sample counts and labels), and so are parquet files with `--streaming`.

How an epoch is cut (all of it a function of seed, epoch, the shard counts and the layout):

* Shard order: a seeded permutation per (seed, epoch).  Shard i of that order goes to *slot*
  i mod L, where a slot is one (rank, loader worker) pair and L = ranks x workers: every shard,
  and so every sample, is read by exactly one process per epoch.
* Each slot reads its shards in order through a shuffle buffer of --shuffle-buffer samples,
  seeded by (seed, epoch, slot).  The buffer is *planned*: its output order is first computed
  on sample numbers alone (the index holds each shard's count), then the reader keeps in memory
  only the samples read and not yet handed out, which is exactly what a shuffle buffer holds.
* Rank r's batch i comes from its worker i mod W (the order in which a DataLoader collects its
  workers' batches), that worker's slot batch i // W.  Every slot gives the same number q of
  whole batches each epoch, q = (the samples of the floor(S / L) smallest shards) // batch: a
  bound that holds whatever the shard order.  **When the shard count S does not divide by
  L = ranks x workers** (or shards differ in size), the slots that got more samples leave their
  surplus untrained in that epoch; which samples those are changes every epoch with the shard
  order.  Fewer shards than ranks is an error; fewer than ranks x workers lowers the workers.
* Sample keys are `epoch * N + k`, k the sample's number in the split (shards in index order,
  samples in file order): the same convention as the map-style sampler.

Exact resume.  What was trained is a function of (epoch, samples trained in the epoch, layout):
the ranks step together, so each rank trained the first n batches of its plan.  A checkpoint
records the layout and every rank's and worker's position (`stream.json`); a resumed start
takes the batches the old layout had not reached, in the old order, flattened rank by rank and
re-cut for the new layout (chunk c of the new batch size goes to new rank c mod ranks).  On the
same layout that is exactly the uninterrupted order, so the weights end bit-identical; on
another layout every sample of the interrupted epoch is still trained exactly once (in that one
epoch a worker may read shards of several old slots).  The next epoch uses the new layout.

Why not `datasets` streaming (IterableDataset + split_dataset_by_node + state_dict): its
state_dict records shard positions but not the shuffle buffer's content ("Loading a state dict
of a shuffle buffer of a dataset without the buffer content. The shuffle buffer will be refilled
before starting to yield new examples", huggingface/datasets#7444): the samples that sat in the
buffer are never trained and the order changes.  And a state taken on one number of nodes cannot
be re-split over another.  So neither exact resume nor "each sample once" across world sizes.
torchdata's StatefulDataLoader aggregates state "across multiprocess workers (but not across
ranks)" (its README) and only replays what the dataset's own state_dict gives it.
The reader here is `tarfile`/`pyarrow` only: the plan is what needed writing, not the I/O.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from .errors import UsageError

INDEX_NAME = "index.json"
INDEX_FORMAT = "accel_train-shards/1"
STREAM_STATE = "stream.json"  # in each checkpoint of a streaming run
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "img")
EVAL_SPLITS = ("validation", "val", "valid", "test", "eval", "evaluation")
SHARD_ORDER_SALT = 7


# -- shards and the index ----------------------------------------------------------------------
@dataclass
class ShardSet:
    """The shards of one split: files, sample counts, and each shard's first sample number."""

    files: list[Path]
    counts: list[int]
    offsets: np.ndarray = field(init=False)

    def __post_init__(self):
        self.offsets = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __iter__(self):
        return iter(range(len(self.files)))


def shard_kind(path: Path) -> str:
    """'tar' or 'parquet' by content (a misnamed file is named in the error), else UsageError."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(512)
    except OSError as err:
        raise UsageError(f"shard {path}: cannot be read ({err.strerror})") from None
    if head[:4] == b"PAR1":
        return "parquet"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    raise UsageError(f"shard {path} is not a tar or parquet file; shards are WebDataset tars "
                     f"(accel-train shard writes them) or parquet files")


def _image_member(name: str) -> bool:
    return name.rsplit(".", 1)[-1].lower() in IMAGE_EXTS


def iter_tar(path: Path) -> Iterator[tuple[bytes, Optional[int], str]]:
    """(image bytes, label or None, sample name) of each sample of a WebDataset tar, in order.
    A sample is the run of members sharing a name up to the first dot."""
    current, image, label = None, None, None
    try:
        with tarfile.open(path, "r|") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                base = member.name.rsplit("/", 1)[-1]
                stem, _, ext = base.partition(".")
                stem = member.name[: len(member.name) - len(base)] + stem
                if stem != current:
                    if current is not None:
                        yield image, label, current
                    current, image, label = stem, None, None
                data = tar.extractfile(member).read()
                if ext.lower() == "cls":
                    label = int(data.decode().strip())
                elif _image_member(base) and image is None:
                    image = data
    except (tarfile.TarError, ValueError) as err:
        raise UsageError(f"shard {path}: not a readable tar ({err})") from None
    if current is not None:
        yield image, label, current


def iter_parquet(path: Path, image_column: Optional[str] = None,
                 label_column: Optional[str] = None):
    import pyarrow.parquet as pq
    from .sources import IMAGE_COLUMN_NAMES, LABEL_COLUMN_NAMES
    handle = pq.ParquetFile(path)
    columns = handle.schema_arrow.names
    image = image_column or next((c for c in IMAGE_COLUMN_NAMES if c in columns), None)
    label = label_column or next((c for c in LABEL_COLUMN_NAMES if c in columns), None)
    if image is None or label is None:
        raise UsageError(f"shard {path}: cannot tell the image and label columns (columns: "
                         f"{', '.join(columns)}); name them with --image-column/--label-column")
    row = 0
    for batch in handle.iter_batches(batch_size=256, columns=[image, label]):
        for value, target in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
            data = value.get("bytes") if isinstance(value, dict) else value
            yield data, target, f"row {row}"
            row += 1


def iter_shard(path: Path):
    return iter_tar(path) if shard_kind(path) == "tar" else iter_parquet(path)


def _count(path: Path) -> tuple[int, int]:
    """(samples, largest label + 1) of one shard, by reading it."""
    if shard_kind(path) == "parquet":
        import pyarrow.parquet as pq
        handle = pq.ParquetFile(path)
        labels = [label for _, label, _ in iter_parquet(path)]
        return handle.metadata.num_rows, (max(labels) + 1 if labels else 0)
    count, top = 0, 0
    for _, label, _ in iter_tar(path):
        count += 1
        top = max(top, (label or 0) + 1)
    return count, top


def _count_fast(path: Path) -> int:
    """Samples in one shard from its metadata: parquet row count, or tar member names."""
    if shard_kind(path) == "parquet":
        import pyarrow.parquet as pq
        return pq.ParquetFile(path).metadata.num_rows
    try:
        with tarfile.open(path, "r:") as tar:
            stems, last = 0, None
            for name in tar.getnames():
                base = name.rsplit("/", 1)[-1]
                stem = name[: len(name) - len(base)] + base.partition(".")[0]
                if stem != last:
                    stems, last = stems + 1, stem
            return stems
    except (tarfile.TarError, ValueError) as err:
        raise UsageError(f"shard {path}: not a readable tar ({err})") from None


@dataclass
class ShardData:
    """What a streaming run reads: the training shards, the held-out shards, the classes."""

    train: ShardSet
    eval: ShardSet
    class_names: list[str]
    origin: str
    eval_name: str


def is_shard_folder(data_dir: Optional[str]) -> bool:
    """--data-dir holds an index written by `accel-train shard`, or WebDataset tars."""
    if data_dir is None:
        return False
    path = Path(data_dir)
    if (path / INDEX_NAME).is_file():
        try:
            return json.loads((path / INDEX_NAME).read_text()).get("format") == INDEX_FORMAT
        except (OSError, ValueError, AttributeError):
            return False
    return path.is_dir() and (any(path.glob("*.tar")) or any(path.glob("*/*.tar")))


def _glob(root: Path, pattern: str) -> list[Path]:
    base = Path(pattern)
    if not base.is_absolute():
        base = root / pattern
    matches = sorted(p for p in base.parent.glob(base.name) if p.is_file()) \
        if base.parent.is_dir() else []
    if not matches:
        raise UsageError(f"no shards match {pattern!r} (looked in {base.parent})")
    return matches


def _split_of(path: Path) -> str:
    name = path.parent.name.lower() if path.parent.name.lower() in ("train", *EVAL_SPLITS) \
        else path.stem.split("-")[0].lower()
    return name if name in ("train", *EVAL_SPLITS) else "train"


def open_shards(config) -> ShardData:
    """The shards of --data-dir (index.json, else the tar/parquet files found), checked."""
    root = Path(config.data_dir)
    if not root.is_dir():
        raise UsageError(f"--data-dir {config.data_dir}: no such folder")
    index_path = root / INDEX_NAME
    eval_pattern = getattr(config, "eval_shards", None)
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            splits = {name: ShardSet([root / entry["file"] for entry in entries],
                                     [int(entry["count"]) for entry in entries])
                      for name, entries in index["splits"].items()}
            class_names = [str(name) for name in index["class_names"]]
        except (ValueError, KeyError, TypeError) as err:
            raise UsageError(f"{index_path}: not a shard index ({err})") from None
        for shards in splits.values():
            for path in shards.files:
                if not path.is_file():
                    raise UsageError(f"{index_path} names {path.name} but {path} does not exist;"
                                     f" the index disagrees with the shards (write it again "
                                     f"with accel-train shard)")
                shard_kind(path)
        for shards in splits.values():  # member names only: tar headers are seeked over
            for path, count in zip(shards.files, shards.counts):
                found = _count_fast(path)
                if found != count:
                    raise UsageError(f"{index_path} says {path.relative_to(root)} holds {count} "
                                     f"samples but it holds {found}; the index disagrees with "
                                     f"the shards (write it again with accel-train shard)")
        listed = {p.resolve() for s in splits.values() for p in s.files}
        unlisted = [p for p in sorted(root.rglob("*.tar")) + sorted(root.rglob("*.parquet"))
                    if p.resolve() not in listed]
        if unlisted:
            raise UsageError(f"{index_path} does not list {unlisted[0].relative_to(root)} (and "
                             f"{len(unlisted) - 1} more); the index disagrees with the shards")
    else:
        files = sorted(root.glob("*.tar")) + sorted(root.glob("*/*.tar"))
        if getattr(config, "streaming", False):
            files += sorted(root.glob("*.parquet")) + sorted(root.glob("*/*.parquet"))
        if not files:
            raise UsageError(f"--data-dir {config.data_dir}: no shards match *.tar or *.parquet")
        groups: dict[str, list[Path]] = {}
        for path in files:
            groups.setdefault(_split_of(path), []).append(path)
        splits, top = {}, 0
        for name, paths in groups.items():
            counted = [_count(path) for path in paths]
            top = max([top] + [t for _, t in counted])
            splits[name] = ShardSet(paths, [c for c, _ in counted])
        class_names = [str(i) for i in range(top)]
    if eval_pattern:
        held = _glob(root, eval_pattern)
        held_set = {p.resolve() for p in held}
        train_set = splits.get("train") or next(iter(splits.values()))
        train = [(p, c) for p, c in zip(train_set.files, train_set.counts)
                 if p.resolve() not in held_set]
        counts = {p.resolve(): c for s in splits.values() for p, c in zip(s.files, s.counts)}
        splits = {"train": ShardSet([p for p, _ in train], [c for _, c in train]),
                  "eval": ShardSet(held, [counts.get(p.resolve()) or _count(p)[0]
                                          for p in held])}
    if "train" not in splits or len(splits["train"]) == 0:
        raise UsageError(f"--data-dir {config.data_dir}: no training shards")
    eval_name = next((n for n in ("eval", *EVAL_SPLITS) if n in splits), None)
    if eval_name is None:
        raise UsageError(f"--data-dir {config.data_dir}: no held-out shards; pass --eval-shards "
                         f"PATTERN or write a test split with accel-train shard")
    if len(class_names) < 2:
        raise UsageError(f"{config.data_dir}: found {len(class_names)} class(es); a classifier "
                         f"needs at least 2")
    return ShardData(splits["train"], splits[eval_name], class_names, str(root), eval_name)


# -- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
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


# -- reading -----------------------------------------------------------------------------------
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
            for n, (image, label, name) in enumerate(iter_shard(path), start=1):
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


def decode_batch(samples: list[tuple]) -> tuple[list[torch.Tensor], list[int]]:
    from .decode import Unreadable, decode_many
    images = decode_many([image if image is not None else b"" for image, _, _ in samples])
    labels = []
    for result, (_, label, name) in zip(images, samples):
        if isinstance(result, Unreadable):
            raise UsageError(f"image {name} cannot be decoded ({result.reason}); remove it from "
                             f"the shard")
        if label is None:
            raise UsageError(f"sample {name} has no label (.cls)")
        labels.append(int(label))
    return images, labels


class StreamingTrain(IterableDataset):
    """One rank's training batches of the current epoch (already batched: DataLoader
    batch_size=None); loader worker p hands out batches p, p + W, ... of the rank's plan."""

    def __init__(self, shards: ShardSet, layout: Layout, rank: int, seed: int, buffer: int,
                 transform, shuffle: bool = True):
        self.shards, self.layout, self.rank, self.seed = shards, layout, rank, seed
        self.buffer, self.transform, self.shuffle = buffer, transform, shuffle
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
            images, labels = decode_batch([readers[s].take(k) for s, k in zip(slots, keys)])
            keys_t = torch.as_tensor(keys, dtype=torch.long)
            epochs = np.full(len(keys), epoch)
            if len({image.shape for image in images}) == 1:
                pixels = self.transform.batch(torch.stack(images), self.seed, epochs,
                                              keys_t.numpy())
            else:
                pixels = torch.stack([self.transform(image, (self.seed, epoch, k))
                                      for image, k in zip(images, keys)])
            yield (pixels, torch.as_tensor(labels, dtype=torch.long), keys_t + epoch * n,
                   torch.full((len(keys),), -1, dtype=torch.long))


class StreamLoader:
    """The training loader of a streaming run.  Not a DataLoader on purpose: Accelerate's
    prepare() passes it through untouched (it would otherwise re-shard an iterable dataset
    across processes, or read it all on rank 0 and scatter); it moves batches to the device."""

    streaming = True

    def __init__(self, dataset: StreamingTrain, num_workers: int, prefetch_factor: int,
                 pin_memory: bool):
        self.dataset, self.num_workers = dataset, num_workers
        extra = dict(prefetch_factor=prefetch_factor) if num_workers > 0 else {}
        # Not persistent: each epoch's workers are started with that epoch's plan.
        self.loader = DataLoader(dataset, batch_size=None, num_workers=num_workers,
                                 pin_memory=pin_memory, **extra)
        self.device = None

    @property
    def layout(self) -> Layout:
        return self.dataset.layout

    def set_epoch(self, epoch: int) -> None:
        self.dataset.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset.plan(self.dataset.epoch)[1])

    @property
    def usable(self) -> int:
        """Global samples of the current epoch (the trainer's end-of-epoch test)."""
        resume = self.dataset.resume
        lay = resume[1] if resume is not None and resume[0] == self.dataset.epoch \
            else self.layout
        return rank_batches_per_epoch(self.dataset.shards, lay) * lay.batch * lay.ranks

    def __iter__(self):
        if self.device is None:
            from accelerate import PartialState
            self.device = PartialState().device
        for batch in self.loader:
            yield tuple(t.to(self.device, non_blocking=True) for t in batch)

    # -- checkpoints ---------------------------------------------------------------------------
    def state(self, epoch: int, samples_in_epoch: int) -> dict:
        """What a checkpoint records: the layout and each rank's and worker's position."""
        resume = self.dataset.resume
        lay = resume[1] if resume is not None and resume[0] == epoch else self.layout
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

    def restore(self, checkpoint: Path, epoch: int, samples_in_epoch: int) -> None:
        """A resumed start: the interrupted epoch continues with the old plan's next batches."""
        path = Path(checkpoint) / STREAM_STATE
        if not path.is_file():
            raise UsageError(f"{checkpoint} was saved by a map-style run (no {STREAM_STATE}); "
                             f"it cannot resume a streaming run: start a new run, or resume "
                             f"without --streaming and a shard folder")
        saved = json.loads(path.read_text())
        if saved.get("shuffle_buffer") != self.dataset.buffer:
            raise UsageError(f"the checkpoint was trained with --shuffle-buffer "
                             f"{saved.get('shuffle_buffer')}; resume with the same value")
        if saved.get("num_shards") != len(self.dataset.shards.files):
            raise UsageError(f"the checkpoint was trained on {saved.get('num_shards')} shards but "
                             f"this start has {len(self.dataset.shards.files)}")
        if samples_in_epoch == 0 or saved["epoch"] != epoch:
            return
        self.dataset.resume = (epoch, Layout(**saved["layout"]), samples_in_epoch)


# -- sources for the rest of the trainer ---------------------------------------------------------
def read_split(shards: ShardSet, limit: Optional[int] = None) -> tuple[list, list[int]]:
    images, labels = [], []
    for s in shards:
        for image, label, name in iter_shard(shards.files[s]):
            if limit is not None and len(images) >= limit:
                return images, labels
            if label is None:
                raise UsageError(f"sample {shards.files[s].name} {name} has no label (.cls)")
            images.append((image, label, f"{shards.files[s].name} {name}"))
            labels.append(int(label))
    return images, labels


def load_streaming(config):
    """LoadedData for a streaming run: the training shards (read per epoch, by the loader),
    the held-out shards read whole into memory, decoded (they are evaluated every epoch)."""
    from .sources import ArraySource, ImageSource, LoadedData

    if config.max_train_samples:
        raise UsageError("--max-train-samples does not apply to streamed shards (an epoch is a "
                         "pass over the shards); bound the run with --max-steps instead")
    data = open_shards(config)

    class StreamSource(ImageSource):
        """Stands for the training shards: a length, and the first images (for the native
        image size and the normalization statistics)."""

        def __init__(self, shards: ShardSet):
            self.shards = shards
            self.labels = torch.zeros(0, dtype=torch.long)
            self._first: list[torch.Tensor] = []

        def __len__(self) -> int:
            return len(self.shards)

        def image(self, index: int) -> torch.Tensor:
            if index >= len(self._first):
                samples, _ = read_split(self.shards, limit=max(index + 1, 500))
                self._first, _ = decode_batch(samples)
            return self._first[index]

    samples, labels = read_split(data.eval, config.max_eval_samples)
    images, _ = decode_batch(samples)
    if len({image.shape for image in images}) != 1:
        raise UsageError("held-out shards of mixed image sizes are not supported yet")
    held_out = ArraySource(torch.stack(images), torch.as_tensor(labels, dtype=torch.long))
    description = (f"{data.origin} (streamed: {len(data.train.files)} train shards, "
                   f"{len(data.train):,} images / {data.eval_name} {len(held_out):,})")
    loaded = LoadedData(StreamSource(data.train), held_out, data.class_names, description)
    loaded.shards = data
    return loaded


def streaming_wanted(config) -> bool:
    return bool(getattr(config, "streaming", False)) or is_shard_folder(config.data_dir)


def build_stream_loaders(config, data, spec, num_processes: int, processes_per_machine: int,
                         pin_memory: bool):
    """The streaming counterpart of data.build_loaders (same Loaders record)."""
    from .augment import build_erasing, build_policy
    from .data import EvalImages, Loaders, default_num_workers, make_loader
    import torch.distributed as dist
    from .transforms import ImageTransform

    shards = data.shards.train
    global_batch = config.batch_size * num_processes * config.accumulation_steps
    train_tf = ImageTransform(spec.image_size, spec.mean, spec.std, augment=config.augment,
                              policy=build_policy(config.auto_augment)
                              if config.augment and config.auto_augment else None,
                              erasing=build_erasing(config.reprob) if config.augment else None)
    eval_tf = ImageTransform(spec.image_size, spec.mean, spec.std, augment=False)
    wanted = config.num_workers if config.num_workers is not None else \
        default_num_workers(data.train, processes_per_machine)
    slots = fit_workers(shards, num_processes, config.batch_size, config.accumulation_steps,
                        wanted)
    layout = Layout(num_processes, slots, config.batch_size, config.accumulation_steps)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dataset = StreamingTrain(shards, layout, rank, config.seed, config.shuffle_buffer, train_tf)
    # --num-workers 0 reads the slot in this process (one slot per rank then).
    train = StreamLoader(dataset, slots if wanted > 0 else 0, config.prefetch_factor,
                         pin_memory)
    eval_workers = 0
    held_out = make_loader(EvalImages(data.eval, eval_tf, mark_replaced=True), config.batch_size,
                           eval_workers, config.prefetch_factor, False, pin_memory)
    steps = rank_batches_per_epoch(shards, layout) // config.accumulation_steps
    return Loaders(train, held_out, train, slots, global_batch, steps)


def save_stream_state(loader: StreamLoader, folder: Path, epoch: int,
                      samples_in_epoch: int) -> None:
    (Path(folder) / STREAM_STATE).write_text(json.dumps(loader.state(epoch, samples_in_epoch),
                                                        indent=1) + "\n")


def check_not_streaming_checkpoint(checkpoint: Optional[Path]) -> None:
    """A map-style start must not resume a streaming run's checkpoint."""
    if checkpoint is not None and (Path(checkpoint) / STREAM_STATE).is_file():
        raise UsageError(f"{checkpoint} was saved by a streaming run (it holds {STREAM_STATE}); "
                         f"resume it with the same shard folder (--data-dir SHARDS), or start a "
                         f"new run")


# -- writing shards (accel-train shard) ----------------------------------------------------------
def image_ext(data: bytes, path: Optional[str] = None) -> str:
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:3] == b"GIF":
        return "gif"
    if data[:2] == b"BM":
        return "bmp"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if path and "." in path:
        ext = path.rsplit(".", 1)[-1].lower()
        if ext in IMAGE_EXTS:
            return ext
    return "img"


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


class ShardWriter:
    """Writes one split as numbered WebDataset tars, cut at --shard-size bytes or
    --samples-per-shard samples, whichever comes first."""

    def __init__(self, folder: Path, relative_to: Path, max_bytes: Optional[int],
                 max_samples: Optional[int]):
        self.folder, self.root = folder, relative_to
        self.max_bytes, self.max_samples = max_bytes, max_samples
        self.entries: list[dict] = []
        self.tar: Optional[tarfile.TarFile] = None
        self.count = self.size = 0
        self.key = 0

    def _open(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{len(self.entries):06d}.tar"
        self.tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)
        self.entries.append({"file": str(path.relative_to(self.root)), "count": 0})
        self.count = self.size = 0

    def _add(self, name: str, data: bytes):
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        self.tar.addfile(info, io.BytesIO(data))
        self.size += 512 + (len(data) + 511) // 512 * 512

    def write(self, image: bytes, ext: str, label: int):
        full = self.tar is not None and (
            (self.max_samples and self.count >= self.max_samples)
            or (self.max_bytes and self.size + len(image) + 2048 > self.max_bytes
                and self.count > 0))
        if self.tar is None or full:
            self.close()
            self._open()
        name = f"{self.key:09d}"
        self._add(f"{name}.{ext}", image)
        self._add(f"{name}.cls", str(int(label)).encode())
        self.key += 1
        self.count += 1
        self.entries[-1]["count"] = self.count

    def close(self):
        if self.tar is not None:
            self.tar.close()
            self.tar = None


def write_index(root: Path, splits: dict[str, list[dict]], class_names: list[str],
                source: str) -> Path:
    path = root / INDEX_NAME
    path.write_text(json.dumps({"format": INDEX_FORMAT, "source": source,
                                "class_names": list(class_names),
                                "counts": {name: sum(e["count"] for e in entries)
                                           for name, entries in splits.items()},
                                "splits": splits}, indent=1) + "\n")
    return path
