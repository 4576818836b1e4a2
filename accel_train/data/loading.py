"""The one train-loader interface, and the loaders of a run chosen once when it is built.

Two kinds of data feed training: indexed (map-style: images in memory or decoded per step,
loaders.py; small in-memory images may instead be held on the device and drawn there,
device_resident.py) and streamed from shards (streaming/).  The trainer sees one interface,
`TrainLoader`, and never asks which kind it has:

* `prepare(accelerator)`: hand the loader to Accelerate (or take the device from it);
* `set_epoch(epoch)`: the next iteration is that epoch, from its start;
* iterating yields the rest of the current epoch as `data.Batch`es on the device, from the
  loader's position, and advances the position by each micro-batch it hands out
  (`samples_in_epoch`, all processes together).  A batch travels as uint8 pixels (pinned
  memory and a non-blocking copy on a GPU) and is normalized there (`data.FinishOnDevice`);
* `save(folder)` / `load(folder)`: the position, as a checkpointed part (checkpoint.py); a
  resumed start continues the interrupted epoch exactly where it stopped.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Protocol

import torch
from torch.utils.data import DataLoader

from accel_train.data.loaders import (Batch, EpochSampler, FinishOnDevice, HeldOutImages,
                                      TrainImages, default_num_workers, end_workers, make_loader,
                                      run_transforms, workers_rate)
from accel_train.base.errors import STALLED_EXIT, RunDiffers, RunStopped, UsageError
from accel_train.base.randomness import reseed_loader
from accel_train.base.ranks import decide_on_main, process_cores
from accel_train.base.readers import read_json
from accel_train.data.decode_ahead import DecodeAhead
from accel_train.data.device_decode import Decoding, DeviceDecoder, sharing_all, time_paths
from accel_train.data.device_decode import unfit_reason as device_decoding_unfit
from accel_train.data.device_decode import choose as choose_device_decoding
from accel_train.data.device_resident import (DevicePhotoBatches, DeviceResidentBatches,
                                              held_bytes, small_in_memory)
from accel_train.data.device_resident import choose as choose_data_on_device
from accel_train.data.held_out_kept import keep_held_out, kept_bytes
from accel_train.data.held_photos import timed_rate
from accel_train.data.streaming import STREAM_STATE, build_stream_loader, streaming_wanted
from accel_train.data.worker_deaths import restarting_dead_workers, watch_workers_quietly

LOADER_STATE = "loader.json"  # in each checkpoint of an indexed run


def timed_out(err: RuntimeError) -> bool:
    """The DataLoader's own timeout (its `timeout`, --loader-timeout) ended the wait."""
    return "DataLoader timed out" in str(err)


RESTART_HINT = "for a restart with --resume auto"


def loader_stuck(timeout: float, where: str, then: str = RESTART_HINT) -> RunStopped:
    """The one-line stop when no batch came in --loader-timeout; `where` says at what point,
    `then` what the exit code is for."""
    return RunStopped(f"no batch from the loader workers in {timeout:g} s (--loader-timeout), "
                      f"{where}: a worker is stuck (its own line above names what it was "
                      f"reading); exit {STALLED_EXIT}, {then}", STALLED_EXIT)


def stop_when_stuck(batches: Iterable, timeout: float, where: str,
                    then: str = RESTART_HINT) -> Iterator:
    """`batches`, with the loader's timeout turned into the one-line stop (held-out data, and
    `accel-train eval`: the training loader does this itself, with its place in the epoch)."""
    try:
        yield from batches
    except RuntimeError as err:
        if not timed_out(err):
            raise
        raise loader_stuck(timeout, where, then) from None


class TrainLoader(Protocol):
    name: str              # "train_loader": a checkpointed part
    epoch: int
    samples_in_epoch: int  # handed out so far in this epoch, all processes together
    usable: int            # samples in a whole epoch, all processes together
    warn: Callable[[str], None]  # says what it recovered from (a loader worker restarted)
    finish: FinishOnDevice  # the batches' second half, run on the device

    def prepare(self, accelerator) -> None: ...

    def set_epoch(self, epoch: int) -> None: ...

    def __iter__(self) -> Iterator[Batch]: ...

    def save(self, folder: Path) -> None: ...

    def load(self, folder: Path) -> None: ...

    def close(self) -> None: ...  # its loader workers ended now (the run's end, a stop)


class EpochPosition:
    """The saved position of an indexed epoch (`epoch`, `samples_in_epoch`): the same file for
    both indexed loaders, so that either resumes a checkpoint of the other; and the pass from
    it.  Its loader has `epoch`, `samples_in_epoch`, `seed`, `sampler`, `per_micro_step`,
    `timeout`, `warn`, `_from_position()` (the batches from the position on) and
    `_drop_workers()` (after one of its loader workers died)."""

    on_device = False  # recorded with the position: which loader drew the batches

    def where(self) -> str:
        return f"{self.samples_in_epoch} samples into epoch {self.epoch + 1}"

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the epoch.  A loader worker that dies costs a warning: the workers start
        again at the same position, and since a batch is a function of its position the run
        goes on as if nothing had happened."""
        try:
            yield from restarting_dead_workers(self._from_position, self._drop_workers,
                                               self.where, self.warn)
        except RuntimeError as err:
            if not timed_out(err):
                raise
            raise loader_stuck(self.timeout, self.where()) from None

    def save(self, folder: Path) -> None:
        (Path(folder) / LOADER_STATE).write_text(json.dumps(
            {"kind": "indexed", "epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch,
             "seed": self.seed, "train_samples": self.sampler.num_samples,
             "on_device": self.on_device}, indent=1) + "\n")

    def load(self, folder: Path) -> None:
        if (Path(folder) / STREAM_STATE).is_file():
            raise RunDiffers(f"{folder} was saved by a streaming run (it holds {STREAM_STATE}); "
                             f"resume it with the same shard folder (--data-dir SHARDS), or "
                             f"start a new run")
        saved = read_json(Path(folder) / LOADER_STATE, "loader_state")  # its shape checked
        if saved["samples_in_epoch"] % self.per_micro_step:
            raise RunDiffers(f"{folder} stopped {saved['samples_in_epoch']} samples into its "
                             f"epoch, which {self.per_micro_step} samples per micro-step do not "
                             f"divide; resume with the global batch it was trained with")
        self.epoch, self.samples_in_epoch = saved["epoch"], saved["samples_in_epoch"]


class IndexedTrainLoader(EpochPosition):
    """Map-style training data: the seeded epoch sampler through a DataLoader that Accelerate
    shards across processes; a resumed epoch skips the batches already trained."""

    name = "train_loader"

    def __init__(self, loader: DataLoader, sampler: EpochSampler, batch_size: int,
                 num_processes: int, rank: int, seed: int, timeout: float = 0):
        self.loader, self.sampler, self.generator = loader, sampler, loader.generator
        # The second half of its dataset's transform (TrainImages hands out uint8 pixels).
        self.finish = FinishOnDevice(loader.dataset.transform,
                                     places=loader.dataset.places_on_device)
        self.per_micro_step = batch_size * num_processes
        self.rank, self.seed, self.timeout = rank, seed, timeout
        self.epoch, self.samples_in_epoch = 0, 0
        self.accelerator = None
        self.ahead = DecodeAhead()  # --decode-on-device: the next batch decoded meanwhile
        self.warn = lambda text: print(f"warning: {text}", file=sys.stderr)  # the trainer's

    @property
    def usable(self) -> int:
        return self.sampler.usable

    def prepare(self, accelerator) -> None:
        self.accelerator = accelerator
        self.loader = accelerator.prepare(self.loader)
        self.decoder = DeviceDecoder(accelerator.device, self.loader.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.samples_in_epoch = epoch, 0

    def __len__(self) -> int:
        return self.usable // self.per_micro_step

    def _from_position(self) -> Iterator[Batch]:
        self.loader.set_epoch(self.epoch)  # the sampler, which a skipping loader shares
        loader, done = self.loader, self.samples_in_epoch // self.per_micro_step
        if done:
            loader = self.accelerator.skip_first_batches(self.loader, done)
            loader.set_epoch(self.epoch)  # it starts its own epoch count at 0
        # The prepared and the skipping loader share this generator: the iterator's base seed
        # (its workers' seeds) is a function of (seed, epoch, rank), however the epoch starts.
        reseed_loader(self.generator, self.seed, self.epoch, self.rank)
        batches = watch_workers_quietly(loader)
        if self.loader.dataset.decodes_on_device:  # bytes and draws: decoded a batch ahead
            batches = self.ahead.batches(batches, len(self) - done, self._decode_start,
                                         self._decode_hand_over)
        for pixels, labels, keys, replaced, *erasing in batches:
            # Counted as handed out: a checkpoint after this batch's step includes it.
            self.samples_in_epoch += self.per_micro_step
            yield Batch(self.finish(pixels, erasing), labels, keys, replaced)

    def _decode_start(self, batch: tuple):
        encoded, labels, keys, replaced, *erasing = batch
        return self.decoder.start(encoded, labels, replaced), keys, erasing

    def _decode_hand_over(self, started: tuple) -> tuple:
        decoded, keys, erasing = started
        pixels, labels, replaced = self.decoder.hand_over(decoded)
        return (pixels, labels, keys, replaced, *erasing)

    def _drop_workers(self) -> None:
        end_workers(self.loader)

    def close(self) -> None:
        self._drop_workers()
        self.ahead.close()


class DeviceResidentTrainLoader(EpochPosition, DeviceResidentBatches):
    """The training set held on the device, its batches drawn there (device_resident.py)."""

    on_device = True
    timeout = 0.0  # --loader-timeout, for the workers that draw its plans

    def _from_position(self) -> Iterator[Batch]:
        return DeviceResidentBatches.__iter__(self)

    def _drop_workers(self) -> None:
        if self.ahead is not None:  # (only the plans' workers can die)
            self.ahead.end_workers()

    def close(self) -> None:
        self._drop_workers()


class DevicePhotosTrainLoader(DeviceResidentTrainLoader, DevicePhotoBatches):
    """Training photographs decoded once on the device, their batches cropped there
    (device_resident.DevicePhotoBatches: its `_epoch_plan` and `_made` make the batches
    that DeviceResidentTrainLoader's pass hands out)."""

    def close(self) -> None:
        super().close()
        self.crops_ahead.close()  # the thread that crops ahead (a later pass starts another)


@dataclass
class Loaders:
    """The training and held-out loaders of a run, before `accelerator.prepare`."""

    train: TrainLoader
    held_out: DataLoader
    num_workers: int
    global_batch: int     # one optimizer step: batch x processes x accumulation
    steps_per_epoch: int  # optimizer steps
    choice: str = ""      # which training loader, and why (--data-on-device): for the summary
    test: Optional[DataLoader] = None  # the test split, evaluated once at the end
    decoding: str = ""    # where training JPEGs are decoded, and why (--decode-on-device)
    decoded_on_device: bool = False
    host_decode_share: Optional[float] = None  # on the device: the workers' share of each batch
    # photographs (not small in-memory images, not streamed) held on the device or not; None
    # for other data
    photos_held: Optional[bool] = None
    # the summary's words on the held-out batches ("" where the training set is not held on the
    # device), and whether they are kept there after the first evaluation (held_out_kept.py)
    held_out_batches: str = ""
    held_out_kept: bool = False
    # where the held-out (and the test) loader hands uint8 pixels (`pixels_to_the_device`), what
    # normalizes them on the device; None where its workers hand normalized floats
    held_out_finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    test_finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


def machine_workers_rate(images: TrainImages, workers: int, processes_per_machine: int) -> float:
    """A process's share of what its machine's loader workers decode together: every process
    on the machine runs `workers` of them while it trains, and rank 0 times them all at once
    for all (the others wait), so that they meet the contention they will train with.  (The
    device path's --host-decode-share: `images` as device_decode.sharing_all makes it.)"""
    if workers == 0:  # each process decodes for itself, in its own process
        return workers_rate(images, 0)
    return workers_rate(images, workers * processes_per_machine) / processes_per_machine


class StartUpRates:
    """The input paths' rates (img/s) that the start-up's auto choices weigh, each measured once
    by rank 0 for all (`decide_on_main`: every rank asks, in the same order): `paths()`,
    device_decode.time_paths' (or, where the device cannot decode the files, the loader
    workers' whole path and training alone); `with_held()`, those and the device cropping held
    photographs (held_photos.timed_rate)."""

    def __init__(self, images: TrainImages, workers: int, processes_per_machine: int, device,
                 train_rate: Optional[Callable[[], float]]):
        self.images, self.workers, self.per_machine = images, workers, processes_per_machine
        self.device, self.train_rate = device, train_rate
        self._paths: Optional[dict] = None
        self._held: Optional[float] = None

    def _workers(self, images: TrainImages) -> float:
        return machine_workers_rate(images, self.workers, self.per_machine)

    def paths(self) -> dict:
        if self._paths is None:
            self._paths = decide_on_main(self._measured_paths)
        return self._paths

    def _measured_paths(self) -> dict:
        images = self.images
        if device_decoding_unfit(images.source, images.transform, streaming=False):
            return {"host": self._workers(images), "train": self.train_rate()}
        return time_paths(images, lambda: self._workers(images),
                          lambda: self._workers(sharing_all(images)), self.device,
                          self.train_rate)

    def with_held(self) -> dict:
        paths = self.paths()
        if self._held is None:
            images = self.images
            self._held = decide_on_main(lambda: timed_rate(images.source, images.transform,
                                                           images.seed, self.device))
        return {**paths, "held": self._held}


def refuse_bad_loader_input(config, data, spec, num_processes: int, cuda: bool) -> None:
    """The UsageErrors of build_loaders that the options and the data alone decide: an empty
    held-out split, fewer training images than one global batch, --data-on-device always or
    --decode-on-device always on data their path cannot take.  Trainer.from_config asks before
    the start-up's timings (the speed probe runs the model for seconds), not after them."""
    if len(data.held_out) == 0:
        raise UsageError("the held-out split is empty; raise --val-fraction or "
                         "--max-eval-samples")
    streaming = streaming_wanted(config)
    global_batch = config.batch_size * num_processes * config.accumulation_steps
    if not streaming and len(data.train) < global_batch:
        raise UsageError(f"the training set has {len(data.train)} images, fewer than one "
                         f"global batch of {global_batch} (batch_size x processes x "
                         f"accumulation_steps); lower --batch-size")
    train_tf = run_transforms(config, spec)[0]
    if config.data_on_device == "always":
        choose_data_on_device("always", data.train, train_tf, cuda, streaming=streaming)
    if config.decode_on_device == "always":
        choose_device_decoding("always", data.train, train_tf, cuda, streaming=streaming)


def build_loaders(config, data, spec, num_processes: int, rank: int, processes_per_machine: int,
                  cuda: bool, device=None,
                  train_rate: Optional[Callable[[], float]] = None) -> Loaders:
    """Seeded, augmented training batches in an order that is a function of (seed, epoch), and
    the held-out batches; a UsageError when the data cannot fill one global batch.  On a GPU
    the batches wait in pinned memory (the copy to the device can then overlap the step).
    `device` and `train_rate()` (img/s the run's model trains at): for --decode-on-device
    auto on a GPU, which times both input paths on `device` (by rank 0 for all)."""
    refuse_bad_loader_input(config, data, spec, num_processes, cuda)
    pin_memory = cuda
    global_batch = config.batch_size * num_processes * config.accumulation_steps
    train_tf, held_out_tf = run_transforms(config, spec)
    wanted_workers = config.num_workers if config.num_workers is not None else \
        default_num_workers(data.train, process_cores(processes_per_machine), cuda)
    decoding = Decoding(False, "")
    on_device = False
    if streaming_wanted(config):
        # (--data-on-device always is bad input here; auto's reason is for the summary)
        _, choice = choose_data_on_device(config.data_on_device, data.train, train_tf, cuda,
                                          streaming=True)
        decoding = choose_device_decoding(config.decode_on_device, data.train, train_tf, cuda,
                                          streaming=True)
        train, workers, steps = build_stream_loader(config, data, train_tf, num_processes, rank,
                                                    wanted_workers, pin_memory)
        held_out_workers = 0  # held-out shards are decoded in memory at the start
    else:
        sampler = EpochSampler(len(data.train), global_batch, config.seed)
        # The marks of replaced images ride along to the loop (badimages.py names them); on
        # a GPU small in-memory images are resized and cropped there (TrainImages).
        images = TrainImages(data.train, train_tf, config.seed, mark_replaced=True,
                             place_on_device=cuda)
        rates = StartUpRates(images, wanted_workers, processes_per_machine, device, train_rate)
        on_device, choice = choose_data_on_device(config.data_on_device, data.train, train_tf,
                                                  cuda, streaming=False, workers=wanted_workers,
                                                  rates=rates.with_held)
        if on_device:  # no image loader: batches are drawn from the images held on the device
            photos = not small_in_memory(data.train)
            # they draw erasing plans, and the photographs' crops, flips and jitter
            workers = wanted_workers if train_tf.erases or photos else 0

            def plan_loader(plans, positions):
                return make_loader(plans, None, workers, config.prefetch_factor,
                                   config.persistent_workers, pin_memory, sampler=positions,
                                   seed=config.seed, timeout=config.loader_timeout, collate=None)

            kind = DevicePhotosTrainLoader if photos else DeviceResidentTrainLoader
            train = kind(data.train, train_tf, sampler, config.batch_size, num_processes, rank,
                         config.seed, plan_loader)
            train.timeout = config.loader_timeout
            drawn = " and ".join(what for what, on in (
                ("timm's draws for each photograph", photos),
                ("--reprob's erasing plans", train_tf.erases)) if on)
            if workers:
                choice += f"; {drawn} drawn by {workers} loader worker(s)"
        else:
            decoding = choose_device_decoding(
                config.decode_on_device, data.train, train_tf, cuda, streaming=False,
                rates=rates.paths, share=config.host_decode_share)
            images.decodes_on_device = decoding.on_device
            if decoding.on_device and decoding.share > 0:
                images.host_decode_share = decoding.share
                if config.decode_on_device == "always":  # (auto's words already say it)
                    decoding = decoding._replace(
                        why=f"{decoding.why}; {decoding.share:.0%} of each batch's by the "
                            f"loader workers (--host-decode-share {decoding.share:g})")
            loader = make_loader(images,
                                 config.batch_size, wanted_workers, config.prefetch_factor,
                                 config.persistent_workers, pin_memory, sampler=sampler,
                                 drop_last=True, seed=config.seed, timeout=config.loader_timeout)
            train = IndexedTrainLoader(loader, sampler, config.batch_size, num_processes, rank,
                                       config.seed, config.loader_timeout)
            workers = wanted_workers
        held_out_workers = wanted_workers
        steps = len(train) // config.accumulation_steps
    photos = not streaming_wanted(config) and not small_in_memory(data.train)
    keeps, kept_words = keep_held_out(
        config.data_on_device, on_device,
        kept_bytes(len(data.held_out), held_out_tf.image_size, config.batch_size,
                   num_processes),
        held_bytes(data.train, photos) if on_device else 0, cuda)
    pixels = {"held-out": pixels_to_the_device(keeps, cuda),
              "test": pixels_to_the_device(False, cuda)}  # (evaluated once: never kept)
    held_out, test = (
        make_loader(HeldOutImages(source, held_out_tf, mark_replaced=True,
                                  normalized=not pixels[split]),
                    config.batch_size, held_out_workers, config.prefetch_factor,
                    config.persistent_workers and held_out_workers > 0 and source is data.held_out,
                    pin_memory, seed=config.seed, timeout=config.loader_timeout)
        if source is not None else None
        for split, source in (("held-out", data.held_out), ("test", data.test)))
    return Loaders(train, held_out, workers, global_batch, steps, choice, test,
                   decoding=decoding.why, decoded_on_device=decoding.on_device,
                   host_decode_share=decoding.share if decoding.on_device else None,
                   photos_held=isinstance(train, DevicePhotosTrainLoader) if photos else None,
                   held_out_batches=kept_words, held_out_kept=keeps,
                   held_out_finish=held_out_tf.finish if pixels["held-out"] else None,
                   test_finish=held_out_tf.finish if pixels["test"] else None)


def pixels_to_the_device(kept: bool, cuda: bool) -> bool:
    """Whether an evaluation's loader hands uint8 pixels for the device to normalize
    (`ImageTransform.finish`, as the training batches are; timm's prefetcher form) instead of
    the normalized floats its workers make: where its batches are kept on the device
    (held_out_kept.py: a quarter of float32's bytes held), and on a GPU at every evaluation (a
    quarter of the bytes to pin and copy, none of the normalizing in the workers, which decode
    the next batches meanwhile).  Not on a CPU otherwise: there the "device" is the training
    process, and the normalizing would move from the workers onto the cores the step uses."""
    return kept or cuda

