"""The sample counts of a folder of tars without an index.json, cached beside the image folders'
cached indexes (imagefolder.default_cache_dir).

Such a folder is counted from its tars' headers at the start (shards._count): timm's ImageNet
copy on the hub is some 2.6 million members, a minute or two of tarfile's Python, and every
start of every rank paid it again.  The trainer reads the data on rank 0 first
(ranks.main_first), so rank 0 counts and writes the cache, and the other ranks of its machine,
and every later start, read it.  A tar's entry holds for as long as its size and modification
time are those it was counted at; a damaged cache is counted again and rewritten, never an
error.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

from accel_train.base.readers import BadFile, read_json
from accel_train.data.imagefolder import (PROGRESS_AFTER, PROGRESS_LOG_EVERY, RACY_SECONDS,
                                         default_cache_dir)

CACHE_FORMAT = "accel_train-shard-counts/1"

Counted = tuple[int, int]  # (samples, largest class + 1), as shards._count gives them


def cache_file(root: Path) -> Path:
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]
    return default_cache_dir() / f"shards-{key}.json"


def counted_tars(root: Path, tars: list[Path], count: Callable[[Path], Counted],
                 say: Callable[[str], None] = print) -> dict[Path, Counted]:
    """Each tar's (samples, largest class + 1): from the cache where the tar is unchanged since
    it was counted, else by `count`; the cache then rewritten.  `say` gets a line every 10 s
    of counting after the first second, and one at its end (a first start on a large folder
    is otherwise minutes of silence)."""
    path = cache_file(root)
    cached = _read(path)
    stats = {tar: tar.stat() for tar in tars}
    found = {}
    for tar, stat in stats.items():
        entry = cached.get(tar.relative_to(root).as_posix())
        if entry is not None and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
            found[tar] = (entry[2], entry[3])
    changed = [tar for tar in tars if tar not in found]
    progress = _Progress(root, len(changed), say)
    for tar in changed:
        found[tar] = count(tar)
        progress.counted(found[tar][0])
    # a tar written in the last seconds may be written to again within its mtime's tick:
    # counted, not cached
    recent = time.time_ns() - RACY_SECONDS * 1e9
    entries = {tar.relative_to(root).as_posix(): [stat.st_size, stat.st_mtime_ns, *found[tar]]
               for tar, stat in stats.items() if stat.st_mtime_ns < recent}
    if changed:
        _write(path, root, entries)
    progress.done()
    return {tar: found[tar] for tar in tars}


class _Progress:
    """The counting's lines: none for a count within a second."""

    def __init__(self, root: Path, tars: int, say: Callable[[str], None]):
        self.root, self.tars, self.say = root, tars, say
        self.started = self.last = time.monotonic()
        self.shown, self.done_tars, self.samples = False, 0, 0

    def counted(self, samples: int) -> None:
        self.done_tars, self.samples = self.done_tars + 1, self.samples + samples
        now = time.monotonic()
        if now - self.started >= PROGRESS_AFTER and (
                not self.shown or now - self.last >= PROGRESS_LOG_EVERY):
            self.say(f"counting the samples of {self.root}'s tars (no index.json; counted "
                     f"once, cached for later starts): {self.done_tars:,} of {self.tars:,} "
                     f"tars, {self.samples:,} samples so far")
            self.shown, self.last = True, now

    def done(self) -> None:
        if self.shown:
            self.say(f"counted {self.samples:,} samples in {self.done_tars:,} tars of "
                     f"{self.root} in {time.monotonic() - self.started:.1f}s (cached: later "
                     f"starts read the counts)")


def _read(path: Path) -> dict[str, list[int]]:
    """The cache's entries ({tar relative to root: [size, mtime_ns, samples, classes]}), or {}
    where there is none or it cannot be used."""
    try:
        data = read_json(path, "shard_counts_cache")  # its shape: readers.py
    except (BadFile, OSError):
        return {}
    if data["format"] != CACHE_FORMAT:
        return {}  # another version's layout
    return {name: entry for name, entry in data["tars"].items()
            if isinstance(entry, list) and len(entry) == 4
            and all(type(value) is int for value in entry)}


def _write(path: Path, root: Path, entries: dict[str, list[int]]) -> None:
    """Written whole, then renamed over the old one (two ranks of one machine may write at
    once: each writes its own file); a cache folder that cannot be written leaves every start
    counting."""
    text = json.dumps({"format": CACHE_FORMAT, "root": str(root.resolve()), "tars": entries})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text + "\n")
        os.replace(tmp, path)
    except OSError:
        return
