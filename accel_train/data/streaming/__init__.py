"""Data larger than one machine: WebDataset tar (or parquet) shards, streamed, with exact resume.

Layout written by `accel-train shard` (commands/shard.py) and read here:

    DIR/index.json            {"format": "accel_train-shards/1", "class_names": [...],
                               "splits": {"train": [{"file": "train/000000.tar", "count": N}, ...],
                                          "test": [...]}}
    DIR/train/000000.tar      000000000.png + 000000000.cls, 000000001.png + ... (WebDataset)
    DIR/test/000000.tar

A folder of `*.tar` (or gzipped `*.tar.gz`, `*.tgz`) without an index is read too (its shards
are scanned once at start for their sample counts and labels, which are then cached), and so are
parquet files with `--streaming`.

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

The package, in reading order: shards.py (the shard files and index.json, reading them),
plan.py (the epoch's plan, from sample numbers alone), decoding.py (--bad-images),
loader.py (the training loader, checkpoint state and resume), start.py (what the trainer calls
at a run's start), writer.py (`accel-train shard`'s tar and index writer).
"""

from accel_train.data.streaming.decoding import decode_substituting
from accel_train.data.streaming.loader import STREAM_STATE, SlotReader, StreamingTrain, StreamLoader
from accel_train.data.streaming.plan import (Layout, Segment, batches_per_slot, fit_workers,
                                             planned_shuffle, rank_batches_per_epoch,
                                             remaining_batches, shard_order, slot_keys, slot_shards)
from accel_train.data.streaming.shards import (EVAL_SPLITS, IMAGE_EXTS, INDEX_FORMAT, INDEX_NAME,
                                               ShardData, ShardSet, is_shard_folder, iter_parquet,
                                               iter_shard, iter_tar, open_shards, read_split,
                                               shard_kind)
from accel_train.data.streaming.start import build_stream_loader, load_streaming, streaming_wanted
from accel_train.data.streaming.writer import ShardWriter, image_ext, png_bytes, write_index

__all__ = [
    "EVAL_SPLITS", "IMAGE_EXTS", "INDEX_FORMAT", "INDEX_NAME", "STREAM_STATE", "Layout",
    "Segment", "ShardData", "ShardSet", "ShardWriter", "SlotReader", "StreamLoader",
    "StreamingTrain", "batches_per_slot", "build_stream_loader",
    "decode_substituting", "fit_workers", "image_ext", "is_shard_folder",
    "iter_parquet", "iter_shard", "iter_tar", "load_streaming", "open_shards", "planned_shuffle",
    "png_bytes", "rank_batches_per_epoch", "read_split", "remaining_batches",
    "shard_kind", "shard_order", "slot_keys", "slot_shards", "streaming_wanted", "write_index",
]
