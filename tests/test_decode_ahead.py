"""--decode-on-device's next batch decoded on a thread while the trainer holds this one
(accel_train/data/decode_ahead.py): the batches, their order and the errors are those of
decoding in line; the epoch's last batch is not taken from the loader early; the pixels are
those of the decoder called in line (on a GPU too, where there is one).

Oracles: a log of when each item was taken, started and handed over (the order the module
promises, written out by hand); Accelerate's own GradientState, which must learn that the epoch
ended at its last batch and no sooner, in a run through the trainer.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from accel_train.callbacks import Callback
from accel_train.config import TrainConfig
from accel_train.data.decode_ahead import DecodeAhead
from accel_train.data.device_decode import DeviceDecoder
from accel_train.trainer import train_and_close
from test_device_decode import _dataset, photos, with_a_garbled_jpeg  # noqa: F401 -- the fixture, shared


class Logged:
    """A loader of `items` and a decoder that log what happens, in order."""

    def __init__(self, items, fail_start_at=None, fail_take_at=None, slow_start=0.0):
        self.items, self.log = list(items), []
        self.fail_start_at, self.fail_take_at = fail_start_at, fail_take_at
        self.slow_start, self.threads = slow_start, set()

    def raw(self):
        for item in self.items:
            if item == self.fail_take_at:
                raise RuntimeError(f"loader failed at {item}")
            self.log.append(("take", item))
            yield item

    def start(self, item):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.slow_start)
        if item == self.fail_start_at:
            raise ValueError(f"decoder failed at {item}")
        self.log.append(("start", item))
        return item * 10

    def hand_over(self, started):
        self.log.append(("hand", started // 10))
        return started + 1


@pytest.fixture
def ahead():
    """A DecodeAhead, its thread ended after the test whatever the test met."""
    decoding = DecodeAhead()
    yield decoding
    decoding.close()


def test_each_batch_is_handed_over_in_order_decoded_on_a_thread(ahead):
    logged = Logged(range(6))
    got = list(ahead.batches(logged.raw(), 6, logged.start, logged.hand_over))
    assert got == [1, 11, 21, 31, 41, 51]
    # a thread of its own, named for what it does (in a profiler's or py-spy's list of threads)
    assert logged.threads and all(name.startswith("decode-ahead") for name in logged.threads)


def test_the_next_batch_is_taken_before_this_one_is_handed_over_but_never_the_last(ahead):
    logged = Logged(range(5))
    for _ in ahead.batches(logged.raw(), 5, logged.start, logged.hand_over):
        logged.log.append(("trained", None))
    events = [e for e in logged.log if e[0] in ("take", "hand", "trained")]
    # by hand: 0 taken; 1 taken ahead before 0 goes out; ...; 4 (the last) only after 3 trained
    assert events == [("take", 0), ("take", 1), ("hand", 0), ("trained", None),
                      ("take", 2), ("hand", 1), ("trained", None),
                      ("take", 3), ("hand", 2), ("trained", None),
                      ("hand", 3), ("trained", None),
                      ("take", 4), ("hand", 4), ("trained", None)]


def test_a_resumed_epoch_counts_only_its_remaining_batches(ahead):
    logged = Logged(range(3))  # the loader, skipped ahead, has 3 left; so does the count
    got = list(ahead.batches(logged.raw(), 3, logged.start, logged.hand_over))
    assert got == [1, 11, 21]
    assert [e for e in logged.log if e[0] == "take"][-1] == ("take", 2)
    # the last batch was taken after the one before it was handed over
    assert logged.log.index(("take", 2)) > logged.log.index(("hand", 1))


def test_no_more_than_count_batches_are_taken_and_a_short_loader_just_ends(ahead):
    logged = Logged(range(10))
    assert list(ahead.batches(logged.raw(), 4, logged.start, logged.hand_over)) == \
        [1, 11, 21, 31]
    assert [e for e in logged.log if e[0] == "take"] == [("take", k) for k in range(4)]
    short = Logged(range(2))
    assert list(ahead.batches(short.raw(), 5, short.start, short.hand_over)) == [1, 11]


def test_a_decoding_error_comes_out_at_its_own_batch(ahead):
    logged = Logged(range(5), fail_start_at=2)
    got = []
    with pytest.raises(ValueError, match="decoder failed at 2"):
        for batch in ahead.batches(logged.raw(), 5, logged.start, logged.hand_over):
            got.append(batch)
    assert got == [1, 11]


def test_a_loader_error_met_reading_ahead_comes_out_after_the_batch_in_hand(ahead):
    logged = Logged(range(5), fail_take_at=3)
    got = []
    with pytest.raises(RuntimeError, match="loader failed at 3"):
        for batch in ahead.batches(logged.raw(), 5, logged.start, logged.hand_over):
            got.append(batch)
    assert got == [1, 11, 21]  # as in line: batches 0-2 trained, then the loader's error


def test_a_stop_waits_for_the_batch_being_decoded(ahead):
    logged = Logged(range(5), slow_start=0.2)
    batches = ahead.batches(logged.raw(), 5, logged.start, logged.hand_over)
    assert next(batches) == 1
    batches.close()  # the trainer stops: batch 1 was being decoded on the thread
    assert ("start", 1) in logged.log  # finished before close returned, not abandoned


class EpochEnds(Callback):
    """At each micro-batch: where the trainer stands and whether Accelerate believes the
    training loader has handed out its last batch."""

    def __init__(self):
        self.seen: list[tuple[int, bool]] = []

    def on_batch_start(self, trainer, batch) -> None:
        self.seen.append((trainer.train_loader.samples_in_epoch,
                          trainer.accelerator.gradient_state.end_of_dataloader))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["always", "never"])
def test_accelerate_learns_of_the_epochs_end_at_its_last_batch(photos, tmp_path,  # noqa: F811
                                                                 mode):
    """The 12 training photos in batches of 2, 2 micro-batches a step: Accelerate's
    accumulate() syncs where its loader says the epoch ends, so that must be the last batch
    (the 6th, 12 samples in), with the device decoding ahead as without it."""
    watch = EpochEnds()
    config = TrainConfig(data_dir=str(photos), model="test_resnet", image_size=64,
                         batch_size=2, accumulation_steps=2, epochs=2, in_memory="never",
                         num_workers=0, decode_on_device=mode,
                         # as conftest.PINNED: Accelerate keeps one precision a process, and
                         # other tests of this process train in fp32
                         mixed_precision="no", channels_last=False,
                         progress="log", plots=False, seed=3,
                         output_dir=str(Path(tmp_path) / "run"))
    outcome = train_and_close(config, [watch])
    assert outcome.exit_code == 0
    # counted as handed out, before the callback: 2, 4, ... 12, the end known at 12 alone
    per_epoch = [(2 * k, k == 6) for k in range(1, 7)]
    assert watch.seen == per_epoch * 2, watch.seen


DEVICES = [pytest.param("cpu", marks=pytest.mark.slow),  # 4-5 s on the slowest machine kind
           pytest.param("cuda", marks=pytest.mark.skipif(
               not torch.cuda.is_available(), reason="the GPU's side stream needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_batches_decoded_ahead_are_the_batches_decoded_in_line(photos, device,  # noqa: F811
                                                                ahead):
    """On a GPU the thread queues each batch on the decoder's side stream while the caller's
    stream is busy (here: products standing in for a training step, which read the last
    batch): the pixels must be those of the decoder called in line, batch by batch."""
    images = _dataset(photos)
    keys = [[len(images) * epoch + k for k in range(4)] for epoch in range(5)]
    encoded = [images.encoded_batch(batch) for batch in keys]
    in_line = DeviceDecoder(device, images)
    expected = [in_line(e.images, e.labels, e.replaced)[0].cpu() for e in encoded]
    decoder = DeviceDecoder(device, images)
    got = []
    busy = torch.randn(1024, 1024, device=device)
    for pixels, *_ in ahead.batches(
            iter(encoded), len(encoded),
            lambda e: decoder.start(e.images, e.labels, e.replaced), decoder.hand_over):
        for _ in range(20):  # the step's stream stays busy while the next batch decodes
            busy = (busy @ busy).tanh_() + pixels.float().mean()
        got.append(pixels.cpu())
    for batch, (want, have) in enumerate(zip(expected, got)):
        assert torch.equal(want, have), batch


def test_files_the_device_refuses_are_made_in_the_training_thread(photos, tmp_path,  # noqa: F811
                                                                  ahead):
    """A JPEG whose header reads but whose data is noise goes to the device, which refuses it;
    the host way then draws its crop from the process's generators, seeded for the image: that
    must happen in the thread that trains (whose own draws, dropout and Mixup, it would
    otherwise cut into), and the batch must be the one decoded in line."""
    images = _dataset(with_a_garbled_jpeg(photos, tmp_path / "with_garbled"))
    garbled = next(i for i in range(len(images))
                   if images.source.name(i).endswith("z_garbled.jpg"))
    threads = []
    host_sample = images.host_sample

    def watched(epoch, index):
        threads.append(threading.current_thread().name)
        return host_sample(epoch, index)

    images.host_sample = watched
    batches = [images.encoded_batch([garbled, (garbled + 1) % len(images)]) for _ in range(3)]
    expected = [DeviceDecoder("cpu", images)(b.images, b.labels, b.replaced)[0] for b in batches]
    threads.clear()
    decoder = DeviceDecoder("cpu", images)
    got = [pixels for pixels, *_ in ahead.batches(
        iter(batches), 3, lambda b: decoder.start(b.images, b.labels, b.replaced),
        decoder.hand_over)]
    assert threads == [threading.current_thread().name] * 3, threads
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_close_ends_the_thread_and_a_later_epoch_starts_another():
    """The loader's close (the run's end, a stop) ends the decoding thread, waiting for it; the
    next pass (a later run of the same loader) starts a new one."""
    threads = []

    def start(item):
        threads.append(threading.current_thread())
        return item

    ahead = DecodeAhead()
    try:
        assert list(ahead.batches(iter(range(3)), 3, start, lambda x: x)) == [0, 1, 2]
    finally:
        ahead.close()
    assert threads and not any(thread.is_alive() for thread in threads)
    first = set(threads)
    try:
        assert list(ahead.batches(iter(range(2)), 2, start, lambda x: x)) == [0, 1]
    finally:
        ahead.close()
    assert set(threads) - first and not any(thread.is_alive() for thread in threads)
