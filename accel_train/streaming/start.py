"""What the trainer asks of a streaming run at its start: whether to stream at all, the loaded
data (training shards counted, held-out shards read whole), and the loaders."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import UsageError
from .decoding import decode_substituting
from .loader import StreamingTrain, StreamLoader
from .plan import Layout, fit_workers, rank_batches_per_epoch
from .shards import ShardSet, is_shard_folder, iter_shard, open_shards, read_split


def load_streaming(config):
    """LoadedData for a streaming run: the training shards (read per epoch, by the loader),
    the held-out shards read whole into memory, decoded (they are evaluated every epoch)."""
    from ..sources import ArraySource, BadImage, ImageSource, LoadedData

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
                self._first, _, _ = decode_substituting(samples, "substitute")
            return self._first[index]

        def bad_image(self, index: int):
            """Sample `index` (its number in the split) as a BadImage, re-read from its shard,
            if it cannot be used (badimages.py names each once)."""
            from ..decode import Unreadable, decode_many
            s = int(np.searchsorted(self.shards.offsets, index, side="right")) - 1
            for k, (image, label, name) in enumerate(iter_shard(self.shards.files[s])):
                if k == index - int(self.shards.offsets[s]):
                    result = decode_many([image if image is not None else b""])[0]
                    reason = result.reason if isinstance(result, Unreadable) else \
                        ("no label (.cls)" if label is None else None)
                    return None if reason is None else BadImage(
                        "train", index, f"{self.shards.files[s].name} {name}", reason)
            return None

    samples, _ = read_split(data.eval, config.max_eval_samples)
    images, labels, bad = decode_substituting(samples, config.bad_images)
    if len({image.shape for image in images}) != 1:
        raise UsageError("held-out shards of mixed image sizes are not supported yet")
    held_out = ArraySource(torch.stack(images), torch.as_tensor(labels, dtype=torch.long))
    description = (f"{data.origin} (streamed: {len(data.train.files)} train shards, "
                   f"{len(data.train):,} images / {data.eval_name} {len(held_out):,})")
    loaded = LoadedData(StreamSource(data.train), held_out, data.class_names, description,
                        [BadImage("held-out", position, samples[position][2], reason)
                         for position, reason in bad])
    loaded.shards = data
    return loaded


def streaming_wanted(config) -> bool:
    return bool(getattr(config, "streaming", False)) or is_shard_folder(config.data_dir)


def build_stream_loaders(config, data, spec, num_processes: int, processes_per_machine: int,
                         pin_memory: bool):
    """The streaming counterpart of data.build_loaders (same Loaders record)."""
    from ..data import EvalImages, Loaders, default_num_workers, make_loader, run_transforms
    import torch.distributed as dist

    shards = data.shards.train
    global_batch = config.batch_size * num_processes * config.accumulation_steps
    train_tf, eval_tf = run_transforms(config, spec)
    wanted = config.num_workers if config.num_workers is not None else \
        default_num_workers(data.train, processes_per_machine)
    slots = fit_workers(shards, num_processes, config.batch_size, config.accumulation_steps,
                        wanted)
    layout = Layout(num_processes, slots, config.batch_size, config.accumulation_steps)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dataset = StreamingTrain(shards, layout, rank, config.seed, config.shuffle_buffer, train_tf)
    dataset.bad_images = config.bad_images
    # --num-workers 0 reads the slot in this process (one slot per rank then).
    train = StreamLoader(dataset, slots if wanted > 0 else 0, config.prefetch_factor,
                         pin_memory)
    eval_workers = 0
    held_out = make_loader(EvalImages(data.eval, eval_tf, mark_replaced=True), config.batch_size,
                           eval_workers, config.prefetch_factor, False, pin_memory)
    steps = rank_batches_per_epoch(shards, layout) // config.accumulation_steps
    return Loaders(train, held_out, train, slots, global_batch, steps)
