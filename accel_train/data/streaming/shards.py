"""Shard files and the index `accel-train shard` writes: what a split holds, and reading it.

A split is a ShardSet: files in order, each one's sample count, and so each sample's number in
the split (its key).  The counts come from index.json, checked against the tars' member names
(cheap: headers only); a folder without an index is read once to count and to find the classes
(its tars' counts then cached: count_cache.py).
"""

from __future__ import annotations

import gzip
import json
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from accel_train.base.errors import UsageError
from accel_train.base.ranks import print_once
from accel_train.base.readers import (BadFile, Shape, bad, parquet_file, read_json,
                                      read_parquet_table)
from accel_train.data.imagefolder import SPLIT_FOLDERS, split_in_name
from accel_train.data.streaming.count_cache import counted_tars
from accel_train.data.loader_watch import reading
from accel_train.data.sources import (IMAGE_COLUMN_NAMES, LABEL_COLUMN_NAMES, TEST_SPLIT_NAMES,
                                      refuse_image_folder_options)

INDEX_NAME = "index.json"
INDEX_FORMAT = "accel_train-shards/1"
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "img")
EVAL_SPLITS = ("validation", "val", "valid", "test", "eval", "evaluation")
# a shard folder's tars, gzipped ones too (webdataset reads .tar.gz and .tgz shards)
TAR_PATTERNS = ("*.tar", "*.tar.gz", "*.tgz")
# what a damaged tar raises: tarfile's errors, and a gzipped one's (cut short: EOFError; not
# gzip: OSError; a corrupt stream: zlib.error)
TAR_ERRORS = (tarfile.TarError, ValueError, EOFError, OSError, zlib.error)


@dataclass
class ShardSet:
    """The shards of one split: files, sample counts, and each shard's first sample number;
    `columns`: a parquet shard's image and label columns where the user named them
    (--image-column, --label-column), else found by name."""

    files: list[Path]
    counts: list[int]
    columns: tuple[Optional[str], Optional[str]] = (None, None)
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
    if head[:2] == b"\x1f\x8b":  # gzip: a tar inside?
        try:
            with gzip.open(path) as inner:
                head = inner.read(512)
        except (OSError, EOFError, zlib.error):
            head = b""
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
        with tarfile.open(path, "r|*") as tar:  # (* : a gzipped tar too)
            for member in tar:
                key = _sample_key(member)
                if key is None:
                    continue
                stem, ext = key
                if stem != current:
                    if current is not None:
                        yield image, label, current
                    current, image, label = stem, None, None
                data = tar.extractfile(member).read()
                if _class_field(ext):
                    label = _class_number(data, path, member.name)
                elif _image_member(member.name) and image is None:
                    image = data
    except UsageError:
        raise
    except TAR_ERRORS as err:
        raise UsageError(f"shard {path}: not a readable tar ({err})") from None
    if current is not None:
        yield image, label, current


def _sample_key(member: tarfile.TarInfo) -> Optional[tuple[str, str]]:
    """A tar member's sample key (its path up to its file name's first dot, webdataset's rule)
    and the rest of its name (its extension: "cls", "jpg", "seg.png"); None for a member of no
    sample: a folder's entry, or a file whose name has no dot (a README, a LICENSE), which
    webdataset and datasets' webdataset loader skip for want of a key."""
    folder, _, base = member.name.rpartition("/")
    if not member.isfile() or "." not in base:
        return None
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext


def _class_field(ext: str) -> bool:
    """A member holds the sample's class: its last extension is cls, as webdataset decodes a
    field by its name's last part (n01440764_10026.JPEG.cls)."""
    return ext.rsplit(".", 1)[-1].lower() == "cls"


def _class_number(data: bytes, path: Path, member: str) -> int:
    """A .cls member's class index, as webdataset decodes one (int of its text); text that is
    no whole number (a class name) is one line naming the member, not an unreadable tar."""
    try:
        return int(data.decode().strip())
    except ValueError:  # a UnicodeDecodeError too
        shown = data[:40].decode(errors="replace").strip()
        raise UsageError(f"shard {path}: {member} holds {shown!r}, not a class number; write "
                         f"the class's index (0, 1, ...) there, as webdataset reads a .cls "
                         f"(accel-train shard writes shards so, the class names in its "
                         f"index.json)") from None


def _parquet_columns(path: Path, handle, image_column: Optional[str] = None,
                     label_column: Optional[str] = None) -> tuple[str, str]:
    """(image column, label column) of a parquet shard: those named, else the usual names."""
    columns = handle.schema_arrow.names
    for named, option in ((image_column, "--image-column"), (label_column, "--label-column")):
        if named is not None and named not in columns:
            raise UsageError(f"shard {path} has no column {named!r} ({option}); its columns: "
                             f"{', '.join(columns)}")
    image = image_column or next((c for c in IMAGE_COLUMN_NAMES if c in columns), None)
    label = label_column or next((c for c in LABEL_COLUMN_NAMES if c in columns), None)
    if image is None or label is None:
        raise UsageError(f"shard {path}: cannot tell the image and label columns (columns: "
                         f"{', '.join(columns)}); name them with --image-column/--label-column")
    return image, label


def iter_parquet(path: Path, image_column: Optional[str] = None,
                 label_column: Optional[str] = None):
    handle = parquet_file(path, "shard", "shard")
    image, label = _parquet_columns(path, handle, image_column, label_column)
    row = 0
    for batch in handle.iter_batches(batch_size=256, columns=[image, label]):
        for value, target in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
            data = value.get("bytes") if isinstance(value, dict) else value
            yield data, target, f"row {row}"
            row += 1


def iter_shard(path: Path, columns: tuple[Optional[str], Optional[str]] = (None, None)
               ) -> Iterator[tuple[bytes, Optional[int], str]]:
    """(image bytes, label or None, sample name) of each sample of a shard, each sample's read
    noted (loader_watch.reading): a shard on a mount that stops answering is named, and the
    sample after which it stopped, by a loader worker's watch or the command's own."""
    with reading(lambda: str(path)):
        kind = shard_kind(path)
    samples = iter_tar(path) if kind == "tar" else iter_parquet(path, *columns)
    after = None
    while True:
        with reading(lambda previous=after: str(path) + (f" after sample {previous}"
                                                         if previous else "")):
            sample = next(samples, None)
        if sample is None:
            return
        yield sample
        after = sample[2]


def parquet_class_names(path: Path, label_column: Optional[str] = None) -> Optional[list[str]]:
    """The label column's class names where a parquet file carries them (Hugging Face
    `datasets` writes its features, a ClassLabel's names among them, into the schema's
    metadata, as in CIFAR-10's parquet files); None where it does not."""
    schema = parquet_file(path, "shard", "shard").schema_arrow
    label = label_column or next((c for c in LABEL_COLUMN_NAMES if c in schema.names), None)
    try:
        feature = json.loads((schema.metadata or {})[b"huggingface"])["info"]["features"][label]
    except (KeyError, TypeError, ValueError):  # none, or not datasets' layout: numbers it is
        return None
    if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel" \
            or not isinstance(feature.get("names"), list):
        return None
    return [str(name) for name in feature["names"]]


def _count(path: Path, columns: tuple[Optional[str], Optional[str]] = (None, None)
           ) -> tuple[int, int]:
    """(samples, largest label + 1) of one shard: a parquet file's labels read, a tar's headers
    and class members (its images seeked over)."""
    if shard_kind(path) == "parquet":  # the label column only: its images are never read
        import pyarrow.compute as pc
        import pyarrow.types as pa_types

        handle = parquet_file(path, "shard", "shard")
        label = _parquet_columns(path, handle, *columns)[1]
        labels = read_parquet_table(path, "shard", [label], "shard", handle).column(0)
        if not pa_types.is_integer(labels.type):
            raise UsageError(f"shard {path}: its label column {label!r} holds {labels.type}, "
                             f"not class numbers; write each class's index (0, 1, ...) there")
        top = pc.max(labels).as_py()  # (None: no labels, or all missing)
        return handle.metadata.num_rows, (top + 1 if top is not None else 0)
    count, top, last = 0, 0, None
    try:
        # seekable: the images are skipped, only headers and .cls members read (a start reads
        # every shard without an index; timm's ImageNet copy is some 150 GB).  Not iter_tar's
        # loop: that one streams, and yields each sample before it reads the next one's data
        # (a read that stalls then names the sample after which it stopped)
        with tarfile.open(path, "r:*") as tar:  # (a gzipped one is read whole: gzip cannot seek)
            for member in tar:
                key = _sample_key(member)
                if key is None:
                    continue
                stem, ext = key
                if stem != last:
                    count, last = count + 1, stem
                if _class_field(ext):
                    label = _class_number(tar.extractfile(member).read(), path, member.name)
                    top = max(top, label + 1)
    except UsageError:
        raise
    except TAR_ERRORS as err:
        raise UsageError(f"shard {path}: not a readable tar ({err})") from None
    return count, top  # (a tar cut short: tarfile's "unexpected end of data", as it seeks)


def _count_fast(path: Path) -> int:
    """Samples in one shard from its metadata: parquet row count, or tar member names (as
    _count and iter_tar find them)."""
    if shard_kind(path) == "parquet":
        return parquet_file(path, "shard", "shard").metadata.num_rows
    try:
        with tarfile.open(path, "r:*") as tar:
            stems, last = 0, None
            for member in tar.getmembers():
                key = _sample_key(member)
                if key is None:
                    continue
                stem = key[0]
                if stem != last:
                    stems, last = stems + 1, stem
            return stems
    except TAR_ERRORS as err:
        raise UsageError(f"shard {path}: not a readable tar ({err})") from None


# index.json's record of one shard.
SHARD_ENTRY = Shape({"file": str, "count": int})


@dataclass
class ShardData:
    """What a streaming run reads: the training shards, the held-out shards, the classes."""

    train: ShardSet
    held_out: ShardSet
    class_names: list[str]
    origin: str
    eval_name: str
    test: Optional[ShardSet] = None  # a test split beside a validation one: for the end


def is_shard_folder(data_dir: Optional[str]) -> bool:
    """--data-dir holds an index written by `accel-train shard`, or WebDataset tars."""
    if data_dir is None:
        return False
    path = Path(data_dir)
    if (path / INDEX_NAME).is_file():
        try:
            if read_json(path / INDEX_NAME, "shard_index", shape=Shape()).get("format") \
                    == INDEX_FORMAT:
                return True
        except BadFile:
            pass  # damaged: beside tars, open_shards names it; else the folder is not ours
    # Only the top and the split folders: an image folder's class folders are not listed.
    folders = ("", *(f"{split}/" for split in ("train", *EVAL_SPLITS)))
    return path.is_dir() and any(any(path.glob(f"{folder}{pattern}"))
                                 for pattern in TAR_PATTERNS for folder in folders)


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
    """A shard's split, named as datasets names the split it finds in a data file's path
    (imagefolder.SPLIT_FOLDERS, split_in_name): its folder's where that is a split's name (val/
    -> validation), else the one its file's name holds (timm's imagenet1k-validation-0003.tar,
    val_000.tar -> validation; train2017-000.tar -> train), else train."""
    return SPLIT_FOLDERS.get(path.parent.name.lower()) or split_in_name(path.stem) or "train"


def open_shards(config) -> ShardData:
    """The shards of --data-dir (index.json, else the tar/parquet files found), checked."""
    root = Path(config.data_dir)
    if not root.is_dir():
        raise UsageError(f"--data-dir {config.data_dir}: no such folder")
    refuse_image_folder_options(config, "a folder of streamed shards, labelled by "
                                        "their samples' classes")
    index_path = root / INDEX_NAME
    eval_pattern = getattr(config, "eval_shards", None)
    columns = (getattr(config, "image_column", None), getattr(config, "label_column", None))
    if index_path.is_file():
        index = read_json(index_path, "shard_index")  # readers.py: its shape checked
        splits = {}
        for name, entries in index["splits"].items():
            problems = [SHARD_ENTRY.problem(entry) for entry in entries] \
                if isinstance(entries, list) else ["is not a list"]
            problem = next((p for p in problems if p), None)
            if problem:
                raise bad(index_path, "shard_index", f"is not a shard index (split {name!r}: "
                                                      f"{problem})")
            splits[name] = ShardSet([root / entry["file"] for entry in entries],
                                    [entry["count"] for entry in entries], columns)
        class_names = [str(name) for name in index["class_names"]]
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
        unlisted = [p for pattern in (*TAR_PATTERNS, "*.parquet")
                    for p in sorted(root.rglob(pattern)) if p.resolve() not in listed]
        if unlisted:
            more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
            raise UsageError(f"{index_path} does not list {unlisted[0].relative_to(root)}{more}; "
                             f"the index disagrees with the shards")
    else:
        files = [p for pattern in TAR_PATTERNS for p in sorted(root.glob(pattern))
                 + sorted(root.glob(f"*/{pattern}"))]
        if getattr(config, "streaming", False):
            files += sorted(root.glob("*.parquet")) + sorted(root.glob("*/*.parquet"))
        if not files:
            raise UsageError(f"--data-dir {config.data_dir}: no shards match *.tar, *.tar.gz, "
                             f"*.tgz or *.parquet")
        groups: dict[str, list[Path]] = {}
        for path in files:
            groups.setdefault(_split_of(path), []).append(path)
        tars = counted_tars(root, [path for path in files if path.suffix != ".parquet"], _count,
                            print_once)
        splits, top = {}, 0
        for name, paths in groups.items():
            counted = [tars[path] if path in tars else _count(path, columns) for path in paths]
            top = max([top] + [t for _, t in counted])
            splits[name] = ShardSet(paths, [c for c, _ in counted], columns)
        class_names = [str(i) for i in range(top)]
        named = {tuple(names) for path in files if shard_kind(path) == "parquet"
                 and (names := parquet_class_names(path, columns[1])) is not None}
        if len(named) == 1 and len(next(iter(named))) >= top:  # every parquet file agrees
            class_names = list(named.pop())
    if eval_pattern:
        held = _glob(root, eval_pattern)
        held_set = {p.resolve() for p in held}
        train_set = splits.get("train") or next(iter(splits.values()))
        train = [(p, c) for p, c in zip(train_set.files, train_set.counts)
                 if p.resolve() not in held_set]
        counts = {p.resolve(): c for s in splits.values() for p, c in zip(s.files, s.counts)}
        splits = {"train": ShardSet([p for p, _ in train], [c for _, c in train], columns),
                  "eval": ShardSet(held, [counts.get(p.resolve()) or _count(p, columns)[0]
                                          for p in held], columns)}
    if "train" not in splits or len(splits["train"]) == 0:
        raise UsageError(f"--data-dir {config.data_dir}: no training shards")
    eval_name = next((n for n in ("eval", *EVAL_SPLITS) if n in splits), None)
    if eval_name is None:
        raise UsageError(f"--data-dir {config.data_dir}: no held-out shards; pass --eval-shards "
                         f"PATTERN or write a test split with accel-train shard")
    if len(class_names) < 2:
        raise UsageError(f"{config.data_dir}: found {len(class_names)} class(es); a classifier "
                         f"needs at least 2")
    test_name = next((n for n in TEST_SPLIT_NAMES if n in splits and n != eval_name), None)
    return ShardData(splits["train"], splits[eval_name], class_names, str(root), eval_name,
                     splits[test_name] if test_name else None)


def read_split(shards: ShardSet, limit: Optional[int] = None,
               kept: Optional[np.ndarray] = None) -> tuple[list, list[int]]:
    """A split's samples in order, at most `limit` (the first ones), or only those at the
    ascending positions `kept`: (image bytes, label, name) each (decoded later, under
    --bad-images), and their labels (-1 where a sample has none)."""
    images, labels = [], []
    wanted = None if kept is None else set(kept.tolist())
    position = -1
    for s in shards:
        for image, label, name in iter_shard(shards.files[s], shards.columns):
            position += 1
            if limit is not None and len(images) >= limit or \
                    wanted is not None and len(images) == len(wanted):
                return images, labels
            if wanted is not None and position not in wanted:
                continue
            images.append((image, label, f"{shards.files[s].name} {name}"))
            labels.append(-1 if label is None else int(label))
    return images, labels
