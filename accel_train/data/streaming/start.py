"""What the trainer asks of a streaming run at its start: whether to stream at all, the loaded
data (training shards counted, held-out shards read whole), and the loaders."""

from __future__ import annotations

import numpy as np
import torch

from accel_train.base.errors import UsageError
from accel_train.data.streaming.decoding import (decode_substituting, label_problem,
                                                 sample_problem)
from accel_train.data.streaming.loader import StreamingTrain, StreamLoader
from accel_train.data.streaming.plan import Layout, fit_workers, rank_batches_per_epoch
from accel_train.data.streaming.shards import (ShardSet, is_shard_folder, iter_shard, open_shards,
                                               read_split)
from accel_train.data.decode import decode_many
from accel_train.data.sample_limits import few_classes_kept, kept_positions, subset_if_cut
from accel_train.data.sources import (TEST_SPLIT_NAMES, ArraySource, BadImage, DecodedImages,
                                      ImageSource, LoadedData)


def load_streaming(config):
    """LoadedData for a streaming run: the training shards (read per epoch, by the loader),
    the held-out shards read whole into memory, decoded (they are evaluated every epoch)."""

    if config.max_train_samples:
        raise UsageError("--max-train-samples does not apply to streamed shards (an epoch is a "
                         "pass over the shards); bound the run with --max-steps instead")
    data = open_shards(config)
    num_classes = len(data.class_names)  # a label outside them is a bad sample

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
                self._first, _, _ = decode_substituting(samples, "substitute", num_classes)
            return self._first[index]

        def bad_image(self, index: int):
            """Sample `index` (its number in the split) as a BadImage, re-read from its shard,
            if it cannot be used (badimages.py names each once)."""
            s = int(np.searchsorted(self.shards.offsets, index, side="right")) - 1
            for k, (image, label, name) in enumerate(iter_shard(self.shards.files[s],
                                                                self.shards.columns)):
                if k == index - int(self.shards.offsets[s]):
                    decoded = decode_many([image if image is not None else b""])[0]
                    reason = sample_problem(decoded, label, num_classes)
                    if reason is None:
                        return None
                    of_class = label_problem(label, num_classes) is None
                    return BadImage("train", index, f"{self.shards.files[s].name} {name}",
                                    reason, int(label) if of_class else None)
            return None

    held_out, bad = read_whole(data.held_out, config, "held-out", num_classes)
    test, test_bad = read_whole(data.test, config, "test", num_classes) \
        if data.test is not None else (None, [])
    # shards of CIFAR-10 hold its test split beside train: the run selects on it, and says so
    # as a map-style run with --select-on-test does
    selects_on_test = data.eval_name.lower() in TEST_SPLIT_NAMES
    description = (f"{data.origin} (streamed: {len(data.train.files)} train shards, "
                   f"{len(data.train):,} images / {data.eval_name} {len(held_out):,}"
                   f"{', the test split used for selection' if selects_on_test else ''}"
                   f"{f'; test {len(test):,} kept for the end' if test is not None else ''})")
    limit = config.max_eval_samples
    roles = {"held-out": held_out, **({"test": test} if test is not None else {})}
    warnings = few_classes_kept({role: ("--max-eval-samples", limit) for role in roles},
                                {role: held.labels for role, held in roles.items()},
                                num_classes, config.sample_subset)
    cut = subset_if_cut(config, (len(data.held_out), limit),
                        *([(len(data.test), limit)] if test is not None else []))
    loaded = LoadedData(StreamSource(data.train), held_out, data.class_names, description,
                        bad + test_bad, test=test, warnings=warnings, sample_subset=cut)
    loaded.shards = data
    return loaded


def read_whole(shards: ShardSet, config, role: str, num_classes: int):
    """(images, the BadImages among them) of held-out shards, read whole and decoded into
    memory (at most --max-eval-samples): one size, one tensor, transformed in batches;
    photographs of many sizes, each as decoded."""
    samples, _ = read_split(shards, kept=kept_positions(len(shards), config.max_eval_samples,
                                                         config.sample_subset))
    images, labels, bad = decode_substituting(samples, config.bad_images, num_classes)
    labels = torch.as_tensor(labels, dtype=torch.long)
    broken = [BadImage(role, position, samples[position][2], reason) for position, reason in bad]
    # (an ArraySource's broken images are left out of the evaluations' numbers)
    held = (ArraySource(torch.stack(images), labels, broken)
            if len({i.shape for i in images}) == 1 else DecodedImages(images, labels))
    return held, broken


def streaming_wanted(config) -> bool:
    return bool(getattr(config, "streaming", False)) or is_shard_folder(config.data_dir)


def build_stream_loader(config, data, train_tf, num_processes: int, rank: int,
                        wanted_workers: int, pin_memory: bool):
    """The streaming train loader (loading.TrainLoader), its loader workers, and its optimizer
    steps per epoch."""
    shards = data.shards.train
    slots = fit_workers(shards, num_processes, config.batch_size, config.accumulation_steps,
                        wanted_workers)
    layout = Layout(num_processes, slots, config.batch_size, config.accumulation_steps)
    dataset = StreamingTrain(shards, layout, rank, config.seed, config.shuffle_buffer, train_tf)
    dataset.bad_images = config.bad_images
    dataset.num_classes = len(data.class_names)
    # --num-workers 0 reads the slot in this process (one slot per rank then).
    train = StreamLoader(dataset, slots if wanted_workers > 0 else 0, config.prefetch_factor,
                         pin_memory)
    steps = rank_batches_per_epoch(shards, layout) // config.accumulation_steps
    # the loader workers started: none with --num-workers 0 (the summary said 1, the slot)
    return train, slots if wanted_workers > 0 else 0, steps
