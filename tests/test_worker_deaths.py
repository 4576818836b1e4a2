"""A loader worker killed while the training process takes a batch from it.

The batch's tensors come over a socket from that worker; the kill resets the socket and torch,
which asks its workers whether they live before the fork server has reported the death, lets
the bare ConnectionResetError out (a CI run failed so).  These tests raise that error where it
comes from, out of the loader's iterator in the training process, through public means only: a
sampler (which torch reads in the training process while it hands out batches) SIGKILLs the
loader's workers, found with psutil, and raises the socket error."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import psutil
import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Sampler, TensorDataset

from accel_train.config import TrainConfig
from accel_train.data.loaders import EpochSampler
from accel_train.data.loading import build_loaders
from accel_train.data.sources import load_data
from accel_train.data.worker_deaths import (handover_death, naming_handover_deaths,
                                            restarting_dead_workers, worker_died)
from accel_train.data.worker_start import worker_context, worker_init_fn

# What taking the batch's file descriptors from a dying worker raises, by the moment it dies: the
# handshake reset (seen in CI), its socket gone (refused), its end closed before the answer (EOF).
RESET = ConnectionResetError(104, "Connection reset by peer")
HANDOVER_ERRORS = [RESET, ConnectionRefusedError(111, "Connection refused"), EOFError()]


def products_workers() -> dict:
    """Workers started as data.make_loader starts them: from the fork server, which blocks stop
    signals until a worker's own start unblocks them (without it a worker outlives the test
    process).  A function, not a constant: every xdist worker imports this file to collect it."""
    return dict(multiprocessing_context=worker_context(), worker_init_fn=worker_init_fn())


def loader_workers(before: set[int]) -> list[psutil.Process]:
    """The loader workers started since `before` (pids): the fork server's children, this
    process's grandchildren (its own children are the fork server and the resource tracker)."""
    me = os.getpid()
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.ppid() != me]


def pids_now() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def reported_dead(pids: list[int]) -> None:
    """Until the fork server has reported each of `pids` dead (multiprocessing's children no
    longer hold them)."""
    deadline = time.monotonic() + 30
    while {p.pid for p in multiprocessing.active_children()} & set(pids):
        assert time.monotonic() < deadline, f"{pids} still reported alive"
        time.sleep(0.05)


class BreaksAt(Sampler):
    """Indices 0..n-1.  Asked for index `at` (while the training process takes an earlier
    batch), it SIGKILLs `kill` of the workers started since it was made, then raises `error`,
    once (`reported`: after the fork server has reported those deaths)."""

    def __init__(self, n: int, at: int, error: BaseException, kill: int, reported=False):
        self.n, self.at, self.error, self.kill = n, at, error, kill
        self.reported = reported
        self.before, self.killed, self.raised = pids_now(), [], False

    def __iter__(self):
        for index in range(self.n):
            if index == self.at and not self.raised:
                self.raised = True
                for worker in loader_workers(self.before)[: self.kill]:
                    os.kill(worker.pid, signal.SIGKILL)
                    self.killed.append(worker.pid)
                if self.reported:
                    reported_dead(self.killed)
                raise self.error
            yield index

    def __len__(self):
        return self.n


def broken_epoch(error: BaseException, kill: int, num_workers: int = 1, wait: float = 5.0,
                 reported: bool = False):
    sampler = BreaksAt(64, 40, error, kill, reported)
    loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, sampler=sampler,
                        num_workers=num_workers, **products_workers())
    with pytest.raises((RuntimeError, type(error))) as caught:
        for _ in naming_handover_deaths(loader, wait=wait):
            pass
    return caught.value, sampler.killed


@pytest.mark.parametrize("error", HANDOVER_ERRORS, ids=lambda e: type(e).__name__)
def test_a_socket_error_whose_worker_died_is_a_death_in_torchs_words_naming_its_pid(error):
    said, (pid,) = broken_epoch(error, kill=1)
    assert isinstance(said, RuntimeError) and worker_died(said), said
    assert str(said) == (f"DataLoader worker (pid(s) {pid}) died while handing over a batch: "
                         f"{type(error).__name__}: {str(error) or type(error).__name__}"), said
    assert said.__cause__ is error


def test_every_worker_found_dead_is_named():
    said, killed = broken_epoch(RESET, kill=2, num_workers=2, reported=True)
    assert len(killed) == 2 and worker_died(said), said
    named = str(said).split("(pid(s) ")[1].split(")")[0].split(", ")
    assert sorted(map(int, named)) == sorted(killed), said


def test_a_socket_error_whose_workers_live_goes_out_as_it_came():
    said, killed = broken_epoch(RESET, kill=0, wait=0.5)
    assert said is RESET and not killed


def a_dead_process() -> multiprocessing.Process:
    process = multiprocessing.get_context("forkserver").Process(target=os.getpid)
    process.start()
    process.join()
    return process


class MissingFile(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        raise FileNotFoundError(2, "No such file or directory", f"/data/{index}.png")


def test_a_workers_own_error_and_errors_of_other_kinds_are_not_deaths():
    """torch raises a worker's own error again in the training process with the same type: an
    OSError that goes out at once as the worker's, even beside a dead worker."""
    dead = a_dead_process()
    loader = DataLoader(MissingFile(), batch_size=4, num_workers=1, **products_workers())
    with pytest.raises(FileNotFoundError) as caught:
        next(iter(naming_handover_deaths(loader)))
    assert str(caught.value).startswith("Caught FileNotFoundError in DataLoader worker process")
    assert handover_death(caught.value, [dead], wait=0) is None
    assert handover_death(RESET, [dead], wait=0).startswith(
        f"DataLoader worker (pid(s) {dead.pid}) died while handing over a batch")
    assert handover_death(RESET, None, wait=0) is None  # the workers never listed
    assert handover_death(ValueError("reset"), [dead], wait=0) is None
    assert worker_died(RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly"))
    assert worker_died(RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed."))
    assert not worker_died(RuntimeError("DataLoader worker (pid 7) raised ValueError"))
    assert not worker_died(ValueError("DataLoader worker (pid(s) 7) exited unexpectedly"))


@pytest.mark.slow
def test_the_training_loader_restarts_its_workers_after_a_reset_handover_and_loses_nothing(
        monkeypatch):
    """The whole path: the training loader of a run meets the reset while handing out its
    fourth batch, warns once naming the pid, and hands out the very batches of a loader where
    nothing happened."""
    config = TrainConfig(synthetic_train_size=128, max_eval_samples=16, batch_size=8,
                         num_workers=1, persistent_workers=True, image_size=32)
    data = load_data(config)
    spec = SimpleNamespace(image_size=32, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    accelerator = Accelerator(cpu=True)

    def epoch(warnings: list):
        train = build_loaders(config, data, spec, 1, 0, 1, False).train
        train.prepare(accelerator)
        train.warn = warnings.append
        train.set_epoch(0)
        batches = [(batch.images.clone(), batch.labels.clone()) for batch in train]
        train.close()
        return batches

    reference = epoch([])
    keys = EpochSampler.__iter__
    broken = BreaksAt(0, 0, RESET, kill=1)  # its plan: 6 batches of 8 in, kill and raise once

    def breaking_keys(sampler):
        for position, key in enumerate(keys(sampler)):
            if position == 48 and not broken.raised:
                broken.raised = True
                for worker in loader_workers(broken.before)[:1]:
                    os.kill(worker.pid, signal.SIGKILL)
                    broken.killed.append(worker.pid)
                raise RESET
            yield key

    monkeypatch.setattr(EpochSampler, "__iter__", breaking_keys)
    warnings: list[str] = []
    batches = epoch(warnings)
    assert broken.raised and len(broken.killed) == 1
    assert len(warnings) == 1 and f"pid(s) {broken.killed[0]}) died while handing over" in \
        warnings[0], warnings
    assert "start again there" in warnings[0]
    assert len(batches) == len(reference) == 128 // 8
    for (images, labels), (ref_images, ref_labels) in zip(batches, reference):
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)


def test_restarts_stop_at_the_cap_and_other_errors_go_out_at_once():
    """The restart loop alone, with torch's words for a death: three restarts an epoch, each
    warned about word for word, then the fourth death goes out; an error that is not a death
    goes out at once, with no warning and no restart."""
    starts, restarted, warned = [], [], []

    def dying_every_time():  # yields one batch per start, then its worker dies (6 at most)
        starts.append(len(starts) + 1)
        yield len(starts)
        if len(starts) < 6:
            raise RuntimeError(f"DataLoader worker (pid(s) {100 + len(starts)}) exited "
                               f"unexpectedly")

    batches = []
    with pytest.raises(RuntimeError, match=r"pid\(s\) 104\)"):
        for batch in restarting_dead_workers(dying_every_time, lambda: restarted.append(1),
                                             lambda: "12 samples into epoch 2", warned.append):
            batches.append(batch)
    assert batches == [1, 2, 3, 4] and len(restarted) == 3
    assert warned[0] == (
        "a loader worker died (DataLoader worker (pid(s) 101) exited unexpectedly) 12 samples "
        "into epoch 2: its workers start again there (1 of at most 3 restarts this epoch). If "
        "the kernel's OOM killer did it (dmesg), lower --num-workers, --prefetch-factor or the "
        "image size")
    for n, text in enumerate(warned, 1):
        assert f"(pid(s) {100 + n}) exited" in text, text
        assert f"({n} of at most 3 restarts this epoch)" in text, text

    def failing():
        yield 1
        raise RuntimeError("DataLoader worker (pid 7) raised ValueError: a bad sample")

    restarted.clear()
    warned.clear()
    with pytest.raises(RuntimeError, match="a bad sample"):
        list(restarting_dead_workers(failing, lambda: restarted.append(1), lambda: "",
                                     warned.append))
    assert not restarted and not warned
