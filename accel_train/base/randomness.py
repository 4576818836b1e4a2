"""Every random draw of a run is a function of where it sits in the run, never of what drew before.

A run that stops and resumes creates its loaders, iterators and models at other moments than a run
that never stopped, so any generator whose *history* matters (torch's global generator after a
DataLoader iterator drew its base seed from it, numpy's after timm's Mixup, ...) diverges on
resume.  Saving and restoring generator states can only patch that for the draws somebody
remembered to save.  Here the rule holds by construction instead: whoever draws seeds from a key
(seed, epoch, position, rank, ...) first, and the key is all a resumed run needs to know.

* `derive_seed(*key)` is the one mixing function (numpy's SeedSequence: well mixed, stable across
  numpy versions and platforms, any number of non-negative integers in).
* `seed_globals(*key)` seeds Python's, numpy's and torch's global generators (CPU and every CUDA
  device): the trainer calls it before each micro-batch, so that dropout and timm's drop-path,
  which draw from torch's global generator inside the model, are functions of the micro-batch's
  place in the run.
* `seeded(*key)` does the same inside a `with` block and puts the outside states back: for draws
  made on behalf of one sample (augmentation policies, random erasing) in the middle of others;
  `each_seeded` makes such draws for a whole batch, one key per sample.
* `loader_generator` / `reseed_loader`: a DataLoader otherwise draws each iterator's base seed (and
  so its workers' seeds) from torch's global generator; an explicit generator, seeded per
  (seed, epoch, rank), keeps the loader out of the global stream and the global stream out of it.
"""

from __future__ import annotations

import contextlib
import random
from typing import Callable, Iterable

import numpy as np
import torch

# Salts keep keys of different purposes apart when the rest of the key is the same.
MICRO_BATCH_SALT = 0x6D62  # the global generators before a micro-batch ("mb")
LOADER_SALT = 0x6C64       # a loader's own generator ("ld")
DATASET_READ_SALT = 0x6472  # the global generators while a program's dataset reads a sample ("dr")


def derive_seed(*key: int) -> int:
    """A 32-bit seed that is a pure function of `key` (integers; negatives are folded in)."""
    return int(np.random.SeedSequence([int(k) & 0xFFFFFFFFFFFFFFFF for k in key])
               .generate_state(1)[0])


def seed_globals(*key: int) -> None:
    """Python's, numpy's and torch's global generators (every initialized CUDA device's too)
    seeded from `key`.

    Not `torch.manual_seed`: on a CUDA build without an initialized CUDA it queues a lazy
    CUDA seeding and formats a stack trace for it at every call, many times the cost of the
    rest (benchmarks/BENCHMARKS.md, "Reseeding").  Where CUDA is in use it is initialized
    before the first micro-batch, and its generators are seeded directly."""
    seed = derive_seed(*key)
    seed_globals_cpu(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


@contextlib.contextmanager
def seeded(*key: int):
    """The global generators (Python, numpy, torch CPU) seeded from `key` inside the block, and
    put back as they were after it."""
    with states_kept():
        seed_globals_cpu(derive_seed(*key))
        yield


def each_seeded(function: Callable, items: Iterable, keys: Iterable[tuple[int, ...]]) -> list:
    """`[function(item) for item in items]`, each call inside `seeded(*key)` of its own key:
    the same draws, with the outside states saved and put back once for all of them.  Why:
    saving and restoring them (numpy's legacy state above all) costs more than the draws it
    guards, and per image it ran once for every image of every batch (BENCHMARKS.md, "Random
    erasing drawn in the loader workers")."""
    out = []
    with states_kept():
        for item, key in zip(items, keys, strict=True):
            seed_globals_cpu(derive_seed(*key))
            out.append(function(item))
    return out


@contextlib.contextmanager
def states_kept():
    """The global generators' CPU states (Python, numpy, torch) put back after the block."""
    py_state, np_state = random.getstate(), np.random.get_state()
    torch_state = torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)


def seed_globals_cpu(seed: int) -> None:
    # CPU only: `seeded` restores the CPU states, and must not touch (or initialize) CUDA's.
    random.seed(seed)
    np.random.seed(seed)
    torch.random.default_generator.manual_seed(seed)


def loader_generator(seed: int) -> torch.Generator:
    """A DataLoader's own generator (reseeded per epoch by `reseed_loader`)."""
    return torch.Generator().manual_seed(derive_seed(seed, LOADER_SALT))


def reseed_loader(generator: torch.Generator, seed: int, epoch: int, rank: int) -> None:
    """Before an epoch's iterator is created: its base seed (and its workers' seeds) become a
    function of (seed, epoch, rank), whenever and however often the iterator is created."""
    generator.manual_seed(derive_seed(seed, epoch, rank, LOADER_SALT))
