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
from accel_train.data.imagefolder import RACY_SECONDS, default_cache_dir

CACHE_FORMAT = "accel_train-shard-counts/1"

Counted = tuple[int, int]  # (samples, largest class + 1), as shards._count gives them


def cache_file(root: Path) -> Path:
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]
    return default_cache_dir() / f"shards-{key}.json"


def counted_tars(root: Path, tars: list[Path],
                 count: Callable[[Path], Counted]) -> dict[Path, Counted]:
    """Each tar's (samples, largest class + 1): from the cache where the tar is unchanged since
    it was counted, else by `count`; the cache then rewritten."""
    path = cache_file(root)
    cached = _read(path, root)
    found, entries, changed = {}, {}, False
    for tar in tars:
        name = tar.relative_to(root).as_posix()
        stat = tar.stat()
        entry = cached.get(name)
        if entry is not None and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
            found[tar] = (entry[2], entry[3])
        else:
            found[tar], changed = count(tar), True
        # a tar written in the last seconds may be written to again within its mtime's tick:
        # counted, not cached
        if stat.st_mtime_ns < time.time_ns() - RACY_SECONDS * 1e9:
            entries[name] = [stat.st_size, stat.st_mtime_ns, *found[tar]]
    if changed:
        _write(path, root, entries)
    return found


def _read(path: Path, root: Path) -> dict[str, list[int]]:
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
