"""Image folders: which files are images, which split and class each belongs to, fast.

Layouts (`--data-dir DIR`):

- `DIR/CLASS/IMAGE`: one split; the held-out part is carved off later (sources.py).
- `DIR/SPLIT/CLASS/IMAGE`, SPLIT one of train/training, validation/val/valid/dev,
  test/testing/eval/evaluation (Hugging Face's split names; any letter case).
- ImageNet's validation layout: `DIR/train/CLASS/IMAGE` plus all held-out images in one folder
  (`DIR/val/IMAGE`), labelled by a file (`--val-labels FILE`, label_files.py).
- Training images in one folder (`DIR/IMAGE` or `DIR/train/IMAGE`) labelled by a file
  (`--train-labels FILE`: Kaggle's train.csv and train/; label_files.py).
- Hugging Face's imagefolder layout: metadata.csv, metadata.jsonl or metadata.parquet files in
  a split folder (or in DIR without split folders) and its subfolders, each naming file_name
  (relative to its own folder) and label, label that split without a flag, as datasets'
  imagefolder reads them (their labels, not class folders, where both are there).  One beside
  the split folders is not read, by datasets either.  A metadata.parquet beside images or
  folders is no parquet layout's data file.
- Nested class folders: the class is the folder that holds the image (as Hugging Face's
  imagefolder has it), or with `--class-depth N` the N-th folder level under the split folder
  (1: the top level, so `animals/cat/siamese/1.jpg` is class `animals`).

Files and folders whose name starts with "." and folders starting with "__" (`__MACOSX`) are
skipped, as are files that are not images by their extension.  Rows are sorted by path, the order
Hugging Face's imagefolder gives, so a folder keeps the rows, classes and held-out split it had
when `datasets` indexed it (tests/test_layouts.py checks the two agree).

Why not `datasets.load_dataset("imagefolder")`: it took 20 s for 10,000 files on every start
(no cache), about half an hour for a million, and wrote progress bars for files already local.
Here a walk with os.scandir indexes a million files in seconds, and the index of a large folder
is cached (an Arrow file, memory-mapped): a repeated start only checks the folders' mtimes
(adding, removing or renaming a file changes its folder's mtime).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
from PIL import Image

from accel_train.base.errors import UsageError, first_few
from accel_train.base.readers import Shape, read_arrow_cache
from accel_train.data.folder_labels import (is_labelled_split, label_files_given,
                                            metadata_labels, split_classes,
                                            training_labels_source)
from accel_train.data.label_files import (METADATA_FILES, METADATA_PARQUET, class_order,
                                          metadata_missing)
from accel_train.data.loader_watch import reading

SPLIT_FOLDERS = {"train": "train", "training": "train", "validation": "validation",
                 "val": "validation", "valid": "validation", "dev": "validation",
                 "test": "test", "testing": "test", "eval": "test", "evaluation": "test"}
# A split's name inside a folder's name, as Hugging Face datasets' imagefolder finds it there
# (datasets.data_files: SPLIT_KEYWORDS between NON_WORDS_CHARS "-._ 0-9" or the name's ends):
# my-train, val2017, ILSVRC2012_img_val.  Longest first: "training" before "train".
SPLIT_WORD = re.compile(r"(?<![^-._ 0-9])(" + "|".join(sorted(SPLIT_FOLDERS, key=len,
                                                              reverse=True))
                        + r")(?![^-._ 0-9])", re.IGNORECASE)
CACHE_MIN_FILES = 10_000  # below this a walk takes well under a second: no cache file
CACHE_ENV = "ACCEL_TRAIN_INDEX_CACHE"  # folder for cached indexes (default ~/.cache/accel_train)
CACHE_VERSION = 6  # raised whenever the same folder would index otherwise
RACY_SECONDS = 2.0  # a folder changed this recently may change again within its mtime's tick
PROGRESS_AFTER = 1.0  # seconds of walking before we say anything
PROGRESS_LOG_EVERY = 10.0  # seconds between plain progress lines (not a terminal)


def image_extensions() -> frozenset[str]:
    """Every extension PIL can open (less HDF5: data files, not pictures)."""
    Image.init()
    return frozenset(ext for ext, fmt in Image.registered_extensions().items()
                     if fmt in Image.OPEN) - {".h5", ".hdf"}


@dataclass
class FolderIndex:
    """Per split: image paths relative to the root (sorted) and class indices."""

    root: Path
    splits: dict[str, tuple[pa.Array, np.ndarray]]
    class_names: list[str]
    dirs: list[tuple[str, int]]  # every folder walked (relative) and its mtime_ns
    cached: bool = False  # read from the cache
    # {extension: count} of the photos in formats PIL does not open, which it leaves out
    not_opened: dict[str, int] = field(default_factory=dict)
    # {split: its metadata.csv, .jsonl or .parquet files, relative to the root} where they
    # label it
    metadata_labels: dict[str, list[str]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(paths) for paths, _ in self.splits.values())

    def fingerprint(self, split: str) -> str:
        """Names this split's rows for `datasets` (its cache of derived tables): the folder,
        the split, its size and every folder's mtime, which change whenever the rows do."""
        text = json.dumps([str(self.root.resolve()), split, len(self.splits[split][0]),
                           self.class_names, self.dirs])
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def classes_across_folders(paths: pa.Array, class_names: list[str], prefix: str = ""
                           ) -> Optional[str]:
    """Where the classes are the deepest folders (no --class-depth) and each sits under more
    than one top-level folder (cat/2019, dog/2019: the classes 2019 and 2020, each holding
    cats and dogs), a line saying so: the folders say nothing to tell that from photos sorted
    by source first (batch1/cat, batch2/cat), so it is said, not refused.  `paths`: a split's
    image paths, each under `prefix` (its split folder's, `train/`)."""
    import pyarrow.compute as pc
    folders = pc.unique(pc.replace_substring_regex(paths, r"/[^/]*$", "")).to_pylist()
    tops: dict[str, set[str]] = {}
    for folder in folders:
        parts = folder[len(prefix):].split("/")
        if len(parts) >= 2:  # an image two folders deep or more
            tops.setdefault(parts[-1], set()).add(parts[0])
    spread = sorted(name for name, under in tops.items() if len(under) > 1)
    if len(spread) < 2:
        return None
    top_level = sorted(set().union(*(tops[name] for name in spread)))
    return (f"the classes are the deepest folders ({first_few(spread)} of "
            f"{len(class_names)}), each found under several top-level folders "
            f"({first_few(top_level)}): if the top-level folders are the classes, pass "
            f"--class-depth 1")


PARQUET = ".parquet"  # what sources.py's search for parquet files looks for


class HoldsParquet(Exception):
    """A walk told to stop at parquet files met one: the folder may be a parquet layout, which
    only a search for every parquet file decides (sources.py).  Not raised for a
    metadata.parquet beside images or folders: Hugging Face's imagefolder metadata."""


def is_imagefolder_metadata(file: Path) -> bool:
    """Whether a parquet file is Hugging Face's imagefolder metadata, not a parquet layout's
    data: named metadata.parquet, beside images or folders (as datasets' imagefolder finds it;
    alone, or beside other parquet files only, it is data)."""
    if file.name != METADATA_PARQUET:
        return False
    extensions = image_extensions()
    with reading(lambda: f"the folder {file.parent}"), os.scandir(file.parent) as entries:
        return any(_beside_metadata(entry, extensions) for entry in entries)


def _beside_metadata(entry: os.DirEntry, extensions) -> bool:
    """Whether `entry` makes a metadata.parquet beside it imagefolder metadata: a folder or an
    image the walk would take."""
    if left_out(entry.name, entry.is_dir()):
        return False
    return entry.is_dir() or os.path.splitext(entry.name)[1].lower() in extensions


def parquet_data_files(root: Path) -> Iterator[Path]:
    """The parquet files under `root` (files_under), less Hugging Face's imagefolder metadata
    (is_imagefolder_metadata): a parquet layout's data files."""
    return (file for file in files_under(root, PARQUET) if not is_imagefolder_metadata(file))


def index_folder(root: str | Path, class_depth: Optional[int] = None,
                 val_labels: Optional[str] = None, cache_dir: Optional[Path] = None,
                 cache_min_files: int = CACHE_MIN_FILES, say=print,
                 stop_at_parquet: bool = False,
                 train_labels: Optional[str] = None) -> FolderIndex:
    """The index of an image folder: from the cache when its folders are unchanged, else by
    walking it (and cached when large).  `say` gets the progress lines; UsageError for folders
    that are not a dataset (no images, an empty class folder, images outside class folders).
    `stop_at_parquet`: HoldsParquet at the first parquet file the walk meets, so that a start
    whose layout is not yet known lists an image folder's tree once, not twice."""
    root = Path(root)
    cached = cached_index(root, class_depth, val_labels, cache_dir, train_labels)
    if cached is not None:
        return cached
    index = _build(root, class_depth, val_labels, say, stop_at_parquet, train_labels)
    if len(index) >= cache_min_files:
        _write_cache(_cache_file(root, class_depth, val_labels, cache_dir, train_labels), index)
    return index


def cached_index(root: str | Path, class_depth: Optional[int] = None,
                 val_labels: Optional[str] = None, cache_dir: Optional[Path] = None,
                 train_labels: Optional[str] = None) -> Optional[FolderIndex]:
    """The cached index of `root` when every folder its walk saw still has its mtime (nothing
    added, removed or renamed in any of them) and its label files are unchanged, else None."""
    root = Path(root)
    return _read_cache(_cache_file(root, class_depth, val_labels, cache_dir, train_labels),
                       root)


def _cache_file(root: Path, class_depth, val_labels, cache_dir: Optional[Path],
                train_labels: Optional[str]) -> Path:
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    return cache_dir / f"{_cache_key(root, class_depth, val_labels, train_labels)}.arrow"


def default_cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "accel_train" / "folder-index"


# -- walking ------------------------------------------------------------------------------------
class _Progress:
    """One line of ours while a large folder is walked: a counter on a terminal, a plain line
    every few seconds otherwise; nothing for folders indexed within a second."""

    def __init__(self, root: Path, say):
        self.root, self.say = root, say
        self.started = self.last = time.monotonic()
        self.terminal = sys.stderr.isatty()
        self.shown = False

    def update(self, count: int) -> None:
        now = time.monotonic()
        if now - self.started < PROGRESS_AFTER:
            return
        if self.terminal and now - self.last >= 0.2:
            sys.stderr.write(f"\rindexing {self.root}: {count:,} images")
            sys.stderr.flush()
        elif not self.terminal and (not self.shown or now - self.last >= PROGRESS_LOG_EVERY):
            self.say(f"indexing {self.root}: {count:,} images so far")
        else:
            return
        self.shown, self.last = True, now

    def abandon(self) -> None:
        """The walk stopped early: the terminal's counter line is cleared."""
        if self.shown and self.terminal:
            sys.stderr.write("\r\033[K")

    def done(self, count: int, classes: int) -> None:
        if not self.shown:
            return
        if self.terminal:
            sys.stderr.write("\r\033[K")
        self.say(f"indexed {self.root}: {count:,} images of {classes:,} classes in "
                 f"{time.monotonic() - self.started:.1f}s")


# Folders that NAS boxes and file systems add beside the user's files: a Synology NAS's
# thumbnails of each photo (@eaDir/PHOTO.jpg/SYNOPHOTO_THUMB_M.jpg: read as one class per
# photo), its recycle bin and snapshots (deleted files, copies of the share), Windows' recycle
# bin and volume data, ext4's lost+found at a disk's root (empty: refused as a class folder).
SYSTEM_FOLDERS = frozenset({"@eaDir", "#recycle", "#snapshot", "$RECYCLE.BIN",
                            "System Volume Information", "lost+found"})


def left_out(name: str, is_folder: bool) -> bool:
    """Hidden files and folders (`.DS_Store`, macOS's `._photo.jpg`), folders starting with
    `__` (`__MACOSX`, `__pycache__`) and SYSTEM_FOLDERS: never the user's images, in training,
    check-data or predict."""
    return name.startswith(".") or (is_folder and (name.startswith("__")
                                                   or name in SYSTEM_FOLDERS))


def _plainly_a_file(entry: os.DirEntry) -> bool:
    """Whether `entry` is a file (a link to one too); False for one that cannot be looked at
    (a link to itself): the image folder's walk names it in one line (images_under), and this
    search, which runs after that walk refused, would otherwise end in a traceback first."""
    try:
        return entry.is_file()
    except OSError:
        return False


def files_under(root: Path, suffix: str = "") -> Iterator[Path]:
    """The files under `root` whose names end in `suffix`, leaving out what datasets' own
    search of a data folder leaves out and so does the image folder's index (hidden files and
    folders, folders starting with `__`), symlinked folders not followed, unreadable ones
    skipped.  Each folder's listing is noted (loader_watch.reading): on a mount that stops
    answering, the folder is named (one rglob over a large folder would be one read, too long
    to time)."""
    folders = [root]
    while folders:
        folder, files = folders.pop(), []
        with reading(lambda listed=folder: f"the folder {listed}"):
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            if not left_out(entry.name, is_folder=True):
                                folders.append(Path(entry.path))
                        elif (entry.name.endswith(suffix) and not left_out(entry.name, False)
                              and _plainly_a_file(entry)):
                            files.append(Path(entry.path))
            except PermissionError:
                continue
        yield from files


@contextlib.contextmanager
def _listing_refused_in_one_line(listed: str, root: Path):
    """Within: the listing of `listed`, a folder under `root`.  Any entry that cannot be looked
    at (a link to itself, ELOOP; a folder removed while the walk ran; a path too long; a folder
    root may not read) is bad input, named in one line: the error would otherwise reach the
    user as a traceback, and skipping it would leave images out without a word."""
    try:
        yield
    except OSError as error:
        where = error.filename or listed
        raise UsageError(f"{root} cannot be listed: {where}: "
                         f"{error.strerror or error}; repair or remove {where}, or give a "
                         f"folder without it") from error


# photographs in formats PIL does not open (phones' HEIC, cameras' raw files): an image folder
# that holds them trains without them, which check-data counts as a problem and predict says
PHOTO_FORMATS_NOT_OPENED = (".heic", ".heif", ".avif", ".cr2", ".cr3", ".nef", ".arw", ".dng",
                            ".orf", ".rw2", ".raf")


def images_under(root: Path, say=print) -> list[Path]:
    """The image files under `root` as training's walk indexes them (_walk): symlinked folders
    followed, a link back to a folder above refused, and a link to a file listed whether or not
    its target exists, so that reading it names it as broken.  What predict lists for a folder:
    files_under follows no linked folder and skips dangling links, and a folder of linked class
    folders would predict nothing (or a submission would be short, without a word)."""
    found: list[str] = []
    not_opened: dict[str, int] = {}
    _walk(root, "", image_extensions(), _Progress(root, say), found, [], [], False, not_opened)
    if not_opened:
        say(f"warning: {photos_left_out(root, not_opened)}")
    return [root / path for path in found]


def photos_left_out(root: Path, not_opened: dict[str, int]) -> str:
    """The line for the photos under `root` in formats PIL does not open."""
    counts = ", ".join(f"{suffix} {n}" for suffix, n in sorted(not_opened.items()))
    return (f"{sum(not_opened.values())} photo(s) under {root} left out ({counts}): a format "
            f"PIL does not open (phones' HEIC, cameras' raw files); convert them to JPEG or PNG")


def _walk(folder: Path, prefix: str, extensions, progress: _Progress, found: list[str],
          dirs: list[tuple[str, int]], empty: list[str], stop_at_parquet: bool,
          not_opened: Optional[dict[str, int]] = None,
          metadata: Optional[list[str]] = None) -> None:
    """Append the image paths under `folder` (as prefix + relative path) to `found`, every
    folder and its mtime to `dirs`, and folders with no image and no subfolder to `empty`;
    `stop_at_parquet`: HoldsParquet at the first parquet file; `not_opened`, where given:
    {extension: count} of the photos in formats PIL does not open; `metadata`, where given:
    the paths of Hugging Face's imagefolder metadata files (METADATA_FILES)."""
    # Symlinked folders are followed (a class folder may live elsewhere), so each folder carries
    # the identities (device, inode) of the folders above it: a link back to one of them would
    # be walked until the kernel refuses the path (ELOOP), every image indexed forty times.
    stack = [(str(folder), prefix, {})]
    while stack:
        path, rel, above = stack.pop()
        has_image = has_subfolder = has_metadata_parquet = False
        # noted: a folder on a mount that stopped answering is named (loader_watch.py)
        with reading(lambda folder=path: f"the folder {folder}"), \
                _listing_refused_in_one_line(path, folder):
            stat = os.stat(path)
            identity = (stat.st_dev, stat.st_ino)
            if identity in above:
                raise UsageError(f"the folder {path} is a link back to {above[identity]}, which "
                                 f"holds it (a symlink loop: indexing would never end); remove "
                                 f"the link or point it elsewhere")
            here = {**above, identity: path}
            dirs.append((rel, stat.st_mtime_ns))  # before listing: a later change shows
            # Per entry, the fewest calls: left_out's rule written out, one is_dir, the suffix
            # by rfind (a name not starting with "." has splitext's): 1.7 s instead of 3.0 s
            # for a million files (AMD EPYC), 0.9 s of either the listing itself.
            with os.scandir(path) as entries:
                for entry in entries:
                    name = entry.name
                    if name[0] == ".":
                        continue
                    if entry.is_dir():
                        if not (name.startswith("__") or name in SYSTEM_FOLDERS):
                            stack.append((entry.path, f"{rel}{name}/", here))
                            has_subfolder = True
                        continue
                    dot = name.rfind(".")
                    if dot > 0 and name[dot:].lower() in extensions:
                        if not (rel.isascii() and name.isascii()):
                            refuse_unless_utf8(entry.path, rel + name)
                        found.append(rel + name)
                        has_image = True
                    elif name in METADATA_FILES:  # (only non-images pay)
                        if metadata is not None:
                            metadata.append(rel + name)
                        has_metadata_parquet = has_metadata_parquet or name == METADATA_PARQUET
                    elif stop_at_parquet and name.endswith(PARQUET):
                        raise HoldsParquet
                    elif (not_opened is not None and dot > 0
                          and name[dot:].lower() in PHOTO_FORMATS_NOT_OPENED):
                        suffix = name[dot:].lower()
                        not_opened[suffix] = not_opened.get(suffix, 0) + 1
        if not (has_image or has_subfolder):
            if stop_at_parquet and has_metadata_parquet:  # alone: a parquet data file
                # (is_imagefolder_metadata)
                raise HoldsParquet
            empty.append(rel)
        progress.update(len(found))


def refuse_unless_utf8(path: str, name: str) -> None:
    """One line for an image at `path` whose name (`name`: the end of `path` from the folder
    indexed, or all of it) is not UTF-8: a zip made on Windows, unpacked on Linux, keeps its
    names in the old Windows code page, which Python reads with surrogates that the index
    (Arrow strings), the logs and the CSV files cannot hold; each ended in a traceback."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(name)
        folder = os.fsencode(path)[:-len(raw)].rstrip(b"/").decode("utf-8", "replace")
        fix = (f"convmv -r -f cp1252 -t utf-8 --notest {folder}" if folder else
               "convmv -f cp1252 -t utf-8 --notest FILE")
        raise UsageError(f"the image {raw!r}{' under ' + folder if folder else ''} is named in "
                         f"bytes that are not UTF-8 (a zip made on Windows keeps its names in "
                         f"the Windows code page; read as Windows-1252 it is "
                         f"{raw.decode('cp1252', 'replace')!r}); rename the files to UTF-8, "
                         f"e.g. {fix}") from None


def _split_folders(root: Path, stop_at_parquet: bool) -> dict[str, Path]:
    """{split: folder} when the root holds split folders (train/, val/, ...), else {}.
    `stop_at_parquet`: HoldsParquet for a parquet file in the root itself (beside split
    folders, the walks of the split folders would not see it), a metadata.parquet beside
    images or folders aside (is_imagefolder_metadata)."""
    with reading(lambda: f"the folder {root}"), \
            _listing_refused_in_one_line(str(root), root):
        with os.scandir(root) as listing:
            entries = list(listing)
        folders = [entry for entry in entries
                   if entry.is_dir() and not left_out(entry.name, is_folder=True)]
        if stop_at_parquet:
            parquet = {entry.name for entry in entries if not entry.is_dir()
                       and entry.name.endswith(PARQUET) and not left_out(entry.name, False)}
            if parquet == {METADATA_PARQUET}:  # data, unless beside images or folders
                extensions = image_extensions()
                if not any(_beside_metadata(entry, extensions) for entry in entries):
                    raise HoldsParquet
            elif parquet:
                raise HoldsParquet
    splits: dict[str, Path] = {}
    for entry in sorted(folders, key=lambda e: e.name):
        split = SPLIT_FOLDERS.get(entry.name.lower())
        if split is None:
            continue
        if split in splits:
            raise UsageError(f"--data-dir {root} has two folders for the {split} split "
                             f"({splits[split].name}/ and {entry.name}/); keep one")
        splits[split] = Path(entry.path)
    others = sorted(entry.name for entry in folders if entry.name.lower() not in SPLIT_FOLDERS)
    if splits and others:
        named = ", ".join(f"{folder.name}/" for folder in splits.values())
        raise UsageError(f"--data-dir {root} mixes split folders ({named}) with other folders "
                         f"({', '.join(o + '/' for o in others[:3])}); put every class folder "
                         f"under a split folder, or remove the split folders")
    if splits:
        return splits
    named = _splits_in_names([entry.name for entry in folders])
    return {split: root / name for split, name in named.items()}


def split_in_name(name: str) -> Optional[str]:
    """The split a folder's name names (SPLIT_WORD: train2017 -> train; an exact split
    folder name too: val -> validation), None where it names none or more than one
    (train_val)."""
    named = {SPLIT_FOLDERS[word.lower()] for word in SPLIT_WORD.findall(name)}
    return named.pop() if len(named) == 1 else None


def _splits_in_names(folders: list[str]) -> dict[str, str]:
    """{split: folder name} where the root's folders all name splits in their names (my-train/
    and my-val/, train2017/ and val2017/), a training split among them and no split twice, as
    datasets' imagefolder reads them; else {}.  Stricter than datasets, which takes any folder
    so named, at any depth, for a split (a class folder test_tube/ for a test split): here
    the names must all agree, and class folders sit at the root only without them."""
    named = {name: split_in_name(name) for name in folders}
    splits = list(named.values())
    if len(folders) < 2 or None in splits or "train" not in splits \
            or len(set(splits)) < len(splits):
        return {}
    return {named[name]: name for name in sorted(folders)}


def _refuse_split_folders_further_down(root: Path, dirs: list[tuple[str, int]]) -> None:
    """A root read as one training split whose only folder (or only folder's only folder, and
    so on) holds split folders (an archive unpacked into a folder of its own:
    photos/cifar/train/, photos/cifar/val/) is refused, naming the folder to pass: read so,
    its validation images would be trained on, and a tenth of all of them carved off instead,
    without a word (datasets' imagefolder finds split folders at any depth).  Told from the
    walk's folders (`dirs`: "cifar/", "cifar/train/", ...), not by listing again."""
    children: dict[str, set[str]] = {}  # {folder: the names of its folders}, "" the root
    for rel, _ in dirs:
        if rel:
            parent, _, name = rel.rstrip("/").rpartition("/")
            children.setdefault(f"{parent}/" if parent else "", set()).add(name)
    wrapper = ""
    while True:
        below = children.get(wrapper, set())
        if wrapper and _splits_in_names(sorted(below)):  # (train/ and val/ name theirs too)
            break
        if len(below) != 1:
            _refuse_split_folders_beside_others(root, children)
            return
        wrapper += f"{next(iter(below))}/"
    raise UsageError(f"--data-dir {root} holds one folder, {wrapper}, whose folders are "
                     f"splits ({', '.join(name + '/' for name in sorted(below))}): pass "
                     f"--data-dir {root / wrapper.rstrip('/')} to train on its training split "
                     f"and hold out the others")


def _refuse_split_folders_beside_others(root: Path, children: dict[str, set[str]]) -> None:
    """Split folders of class folders further down beside other folders (photos/cifar10/
    train/cat/ and photos/cifar10/test/ beside photos/cifar100/ or photos/extra/): read as class
    folders, each split's images merged into the others' classes, its held-out images trained
    on.  Refused, naming the folders that hold them.  Split folders holding images directly
    (cat/train/, cat/val/) are a class's splits: _splits_inside_classes.  `children`: {folder:
    the names of its folders}, as _refuse_split_folders_further_down gathers them."""
    holding = [parent for parent, names in sorted(children.items())
               if _splits_in_names(sorted(names))  # (the root's: split by _split_folders)
               and any(f"{parent}{name}/" in children for name in names)]
    if holding:
        named = ", ".join(f"{parent} ({', '.join(name + '/' for name in sorted(children[parent]))})"
                          for parent in holding[:3])
        more = f" and {len(holding) - 3} more" if len(holding) > 3 else ""
        raise UsageError(f"--data-dir {root} holds split folders further down, beside other "
                         f"folders: {named}{more}; read as class folders, their held-out images "
                         f"would be trained on: pass --data-dir {root / holding[0].rstrip('/')} "
                         f"to train on its training split and hold out the others")


def _class_of(path: str, split_prefix: str, depth: Optional[int],
              split_inside: bool = False) -> Optional[str]:
    """The class of an image from its path under the split folder; None if it has none.
    `split_inside`: the image's own folder is its split's (cat/train/0.jpg), left out.
    (String splitting: PurePosixPath cost seconds per million paths.)"""
    folders = path[len(split_prefix):].split("/")[:-1]
    return _folder_class(folders[:-1] if split_inside else folders, depth)


def _classes_of(found: list[str], split_prefix: str, depth: Optional[int],
                split_inside: bool = False) -> list[Optional[str]]:
    """Each image's class (_class_of), worked out once per folder: its images share it."""
    of_folder: dict[str, Optional[str]] = {}
    names = []
    for path in found:
        folder = path[:path.rfind("/") + 1]
        if folder not in of_folder:
            of_folder[folder] = _class_of(path, split_prefix, depth, split_inside)
        names.append(of_folder[folder])
    return names


def _splits_inside_classes(found: list[str]) -> dict[str, list[str]]:
    """{split: its image paths} where every image sits in a folder naming a split, inside a
    class folder (cat/train/0.jpg, cat/val/1.jpg, dog/train/2.jpg), a training split among
    them and no class folder holding two folders of one split; else {}.  Why: read as class
    folders, the deepest folders train/ and val/ would be the classes, and with --class-depth
    1 each class's validation images would be trained on.  datasets' imagefolder takes these
    folders for its splits too (it finds a split folder at any depth), but labels the images
    by their own folder (train, val), not by the class folder above it."""
    split_of: dict[str, Optional[str]] = {}  # each image folder's split, worked out once
    named: dict[tuple[str, str], str] = {}   # (class folder, split): the folder naming it
    by_split: dict[str, list[str]] = {}
    for path in found:
        folder = path[:path.rfind("/")]
        if folder not in split_of:
            above, _, name = folder.rpartition("/")
            split = split_in_name(name) if above else None
            if split is not None and named.setdefault((above, split), name) != name:
                return {}  # cat/train/ beside cat/training/: not one split folder a class
            split_of[folder] = split
        if split_of[folder] is None:
            return {}
        by_split.setdefault(split_of[folder], []).append(path)
    return by_split if "train" in by_split else {}


def _refuse_labelled_splits_inside_folders(root: Path, inside: dict[str, list[str]],
                                           files: dict) -> None:
    """Split folders inside other folders (_splits_inside_classes) under a label file or a
    metadata file that labels the whole folder: read as one training split, the held-out
    images would be trained on (datasets' imagefolder splits it by the folders and reads no
    metadata file above them)."""
    folders = sorted({path[:path.rfind("/") + 1] for paths in inside.values() for path in paths})
    paths, flag = next(iter(files.values()))
    source = f"{flag} {paths[0]}" if flag else os.path.relpath(paths[0], root)
    labels = "labelled by --train-labels and --val-labels" if flag else "a metadata file in each"
    raise UsageError(f"--data-dir {root}: its images sit in split folders inside other folders "
                     f"({first_few(folders)}) and {source} labels them all as one training "
                     f"split, so its held-out images would be trained on; put each split's "
                     f"images in a split folder at the top of {root} (train/, val/), {labels}")


def _folder_class(folders: list[str], depth: Optional[int]) -> Optional[str]:
    """The class of what sits in the folder `folders` (its parts under the split folder)."""
    if depth is None:
        return folders[-1] if folders else None
    return folders[depth - 1] if len(folders) >= depth else None


def _build(root: Path, class_depth: Optional[int], val_labels: Optional[str],
           say, stop_at_parquet: bool, train_labels: Optional[str]) -> FolderIndex:
    extensions = image_extensions()
    progress = _Progress(root, say)
    splits = _split_folders(root, stop_at_parquet) or {"train": root}
    dirs: list[tuple[str, int]] = []
    if splits.get("train") is not root:
        dirs.append(("", os.stat(root).st_mtime_ns))  # a new split folder changes the root
    walked: dict[str, tuple[str, list[str]]] = {}
    metadata_found: dict[str, list[str]] = {}  # {split: its metadata files}
    empties: dict[str, list[str]] = {}
    not_opened: dict[str, int] = {}
    try:
        for split, folder in splits.items():
            prefix = "" if folder is root else f"{folder.name}/"
            found: list[str] = []
            empties[split], metadata_found[split] = [], []
            _walk(folder, prefix, extensions, progress, found, dirs, empties[split],
                  stop_at_parquet, not_opened, metadata_found[split])
            found.sort()  # as datasets orders the rows
            walked[split] = (prefix, found)
    except HoldsParquet:
        progress.abandon()
        raise
    if splits.get("train") is root:
        _refuse_split_folders_further_down(root, dirs)
    total = sum(len(found) for _, found in walked.values())
    if total == 0:
        raise UsageError(f"--data-dir {root} holds no image files (looked for .jpg, .png, .webp, "
                         f"... in it and its subfolders); expected one subfolder of images per "
                         f"class, parquet files or a save_to_disk folder")
    files = label_files_given(root, splits, walked, val_labels, train_labels)
    metadata, read = metadata_labels(root, metadata_found, dirs, files)
    if class_depth is not None and all(split in files for split in walked):
        _class_depth_unread(root, class_depth, files)
    for split, (prefix, found) in walked.items():
        if empties[split] and not (class_depth is None and is_labelled_split(split, val_labels)
                                   or split in files):
            _check_empty_folders(root, sorted(empties[split]), found, prefix, class_depth)
    inside_classes = splits.get("train") is root and _splits_inside_classes(walked["train"][1])
    if inside_classes and files:
        _refuse_labelled_splits_inside_folders(root, inside_classes, files)
    if inside_classes:  # cat/train/, cat/val/: each split's images found by their folder
        walked = {split: ("", found) for split, found in inside_classes.items()}
    images = {split: [path[len(prefix):] for path in found]
              for split, (prefix, found) in walked.items()}
    classes: dict[str, list] = {}
    labelled_train = files.get("train")
    if labelled_train is not None:
        classes["train"] = split_classes(labelled_train, splits["train"], images["train"],
                                        read=read)
    for split, (prefix, found) in walked.items():
        if split in files:
            continue
        names = _classes_of(found, prefix, class_depth, split_inside=bool(inside_classes))
        missing = next((path for path, name in zip(found, names) if name is None), None)
        if missing is not None:
            # a test/ beside val/: --val-labels would label val/, not it
            beside_val = walked["validation"][0] if split == "test" and "validation" in walked \
                else None
            _outside_class_folder(root, missing, split, class_depth,
                                  beside_labelled_train=labelled_train is not None,
                                  beside_val=beside_val)
        classes[split] = names
    classes = _one_spelling_per_class(classes)
    class_names = class_order({name for names in classes.values() for name in names},
                              numbers_by_value=labelled_train is not None)
    for split, given in files.items():
        if split != "train":
            classes[split] = split_classes(given, splits[split], images[split],
                                          set(class_names), training_labels_source(labelled_train),
                                          read)
    number = {name: i for i, name in enumerate(class_names)}
    result = {split: (pa.array(found, pa.string()),
                      np.array([number[name] for name in classes[split]], dtype=np.int64))
              for split, (_, found) in walked.items()}
    progress.done(total, len(class_names))
    return FolderIndex(root, result, class_names, dirs, not_opened=not_opened,
                       metadata_labels=metadata)


def _metadata_files(folder: Path) -> list[Path]:
    """The metadata.csv, metadata.jsonl and metadata.parquet (Hugging Face's imagefolder
    layout) in `folder`."""
    return [folder / name for name in METADATA_FILES if (folder / name).is_file()]


def _class_depth_unread(root: Path, class_depth: int,
                        files: dict[str, tuple[list[Path], Optional[str]]]) -> None:
    """--class-depth where files label every split: no class folder is read, and a run would
    train on the files' labels as if the flag were not there."""
    def named(file: Path) -> str:
        return file.relative_to(root).as_posix() if file.is_relative_to(root) else str(file)
    by = "; ".join(f"{split}: {flag + ' ' if flag else ''}{first_few(map(named, paths))}"
                   for split, (paths, flag) in sorted(files.items()))
    raise UsageError(f"--class-depth {class_depth} names the folder level of the classes, and "
                     f"files label every split of {root} ({by}), so no class folder is read; "
                     f"drop --class-depth")


def _one_spelling_per_class(classes: dict[str, list]) -> dict[str, list]:
    """Each split's class names, those that differ only in their Unicode form (macOS writes
    "é" decomposed, NFD; Linux tools composed, NFC: a val/ copied from a Mac beside a train/
    made on Linux) spelt one way: the training split's where it has one, else the first in
    sorted order.  The two print alike; as two classes, val's would have no training image.
    Names written in one form only are kept as they are (a resumed run's classes are)."""
    spellings: dict[str, set[str]] = {}
    for names in classes.values():
        for name in set(names):
            spellings.setdefault(unicodedata.normalize("NFC", name), set()).add(name)
    if all(len(forms) == 1 for forms in spellings.values()):
        return classes
    trained = set(classes.get("train", ()))
    chosen = {name: min(forms, key=lambda form: (form not in trained, form))
              for forms in spellings.values() for name in forms}
    return {split: [chosen[name] for name in names] for split, names in classes.items()}


def _check_empty_folders(root: Path, empty: list[str], found: list[str], prefix: str,
                         depth: Optional[int]) -> None:
    """A folder without images or subfolders is an empty class folder, unless --class-depth
    puts the class above it and that class has images elsewhere."""
    if depth is not None:
        with_images = {_class_of(path, prefix, depth) for path in found}
        empty = [folder for folder in empty
                 if _folder_class(folder[len(prefix):].split("/")[:-1], depth)
                 not in with_images | {None}]
    if empty and empty[0] == prefix and prefix:  # the split folder itself (val/, test/)
        raise UsageError(f"split folder {root / prefix.rstrip('/')} holds no images; put its "
                         f"images in one folder per class inside it, or remove it")
    if empty:
        raise UsageError(f"class folder {root / empty[0]} holds no images; add images to it "
                         f"or remove it")


def _outside_class_folder(root: Path, path: str, split: str, depth: Optional[int],
                          beside_labelled_train: bool = False,
                          beside_val: Optional[str] = None) -> None:
    """`beside_val`: the validation folder's prefix (`val/`) where the image is in a test
    folder beside it."""
    if depth is not None:
        raise UsageError(f"{root / path} is less than {depth} folder(s) deep in its split "
                         f"folder, so --class-depth {depth} gives it no class; lower "
                         f"--class-depth or move the image into a class folder")
    folder = path.split("/")[0]
    if beside_labelled_train and split != "train":  # Kaggle's train/ + test/ + train.csv
        raise UsageError(f"{root / path} is in {folder}/, images without labels beside the "
                         f"labelled train/ (a competition's test set?): pass --data-dir "
                         f"{root / 'train'} to train, then predict {root / folder} (a labelled "
                         f"held-out folder needs --val-labels FILE)")
    if beside_val is not None and not beside_labelled_train:  # a competition's test/
        raise UsageError(f"{root / path} is in {folder}/, images not sorted into class folders "
                         f"beside the labelled train/ and {beside_val} (a competition's test "
                         f"set?): move {folder}/ out of {root} to train on train/ and "
                         f"{beside_val}, then predict it (accel-train predict RUN FOLDER), or "
                         f"sort its images into class folders")
    # (no metadata file in the split labels it: one that did would have been read,
    # _metadata_labels)
    here = (root / path).parent
    metadata = next(iter(_metadata_files(here)), None)
    beside_splits = next(iter(_metadata_files(root)), None) \
        if split_in_name(folder) and folder != path else None
    if metadata is not None:  # Hugging Face's imagefolder layout, without its labels
        missing = " or ".join(metadata_missing(metadata))
        hint = (f" (the {metadata.name} beside it, Hugging Face's imagefolder layout, has no "
                f"{missing} column to label the images by; add one naming each image's class)")
    elif beside_splits is not None:  # datasets' imagefolder reads none there either
        hint = (f" (the {beside_splits.name} beside the split folders is not read, as Hugging "
                f"Face's imagefolder reads none there: put one in {folder}/, each file_name "
                f"relative to it)")
    elif split != "train":
        hint = " (a held-out folder of unlabelled images needs --val-labels FILE)"
    else:
        hint = " (or name each image's class in a file: --train-labels FILE)"
    raise UsageError(f"{root / path} is not inside a class folder; put each class's images in "
                     f"a subfolder named after the class{hint}")


# -- the cache ------------------------------------------------------------------------------------
def _cache_key(root: Path, class_depth, val_labels, train_labels) -> str:
    def file_key(path: Optional[str]):
        if path is None or not Path(path).is_file():
            return None
        stat = Path(path).stat()
        return [str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size]
    key = [CACHE_VERSION, str(root.resolve()), class_depth, file_key(val_labels)]
    if train_labels is not None:  # (the key of an index without one is as it was)
        key.append(file_key(train_labels))
    text = json.dumps(key)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _write_cache(path: Path, index: FolderIndex) -> None:
    """One Arrow file: the splits' rows one after the other, what they are in its metadata.
    Not written when a folder changed in the last seconds (it may be being filled: a change
    within the same mtime tick would go unseen), nor when the cache folder is not writable."""
    if max(mtime for _, mtime in index.dirs) > time.time_ns() - RACY_SECONDS * 1e9:
        return
    spans, start = [], 0
    for split, (paths, _) in index.splits.items():
        spans.append([split, start, start + len(paths)])
        start += len(paths)
    meta = {"root": str(index.root.resolve()), "classes": index.class_names, "splits": spans,
            "dirs": index.dirs, "not_opened": index.not_opened,
            "metadata_labels": index.metadata_labels}
    table = pa.table({"path": pa.concat_arrays([p for p, _ in index.splits.values()]),
                      "label": np.concatenate([labels for _, labels in index.splits.values()])},
                     metadata={"accel_train": json.dumps(meta)})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        os.replace(tmp, path)
    except OSError:
        return  # a read-only home: every start walks the folder


def _mtime(folder: Path) -> int:
    # noted: on a mount that stopped answering, the folder is named (loader_watch.py)
    with reading(lambda: f"the folder {folder}"):
        return os.stat(folder).st_mtime_ns


# What the cache's metadata holds (_write_cache); another shape is a damaged cache, rebuilt.
CACHE_META = Shape({"root": str, "classes": list, "splits": list, "dirs": list})


def _read_cache(path: Path, root: Path) -> Optional[FolderIndex]:
    """The cached index if every folder it walked still has its mtime, else None."""
    read = read_arrow_cache(path, "imagefolder_cache", CACHE_META)
    if read is None:
        return None  # missing or damaged: the folder is walked again and the cache rewritten
    table, meta = read
    try:
        if any(_mtime(root / rel) != mtime for rel, mtime in meta["dirs"]):
            return None
    except OSError:  # a folder is gone
        return None
    # Slices of the memory-mapped file: no copy (the file holds one record batch).
    paths, labels = (table.column(name).combine_chunks() for name in ("path", "label"))
    splits = {split: (paths.slice(start, stop - start),
                      labels.slice(start, stop - start).to_numpy(zero_copy_only=True))
              for split, start, stop in meta["splits"]}
    # (a cache written before it counted them has none: as many as it would have said)
    not_opened = meta.get("not_opened")
    metadata = meta.get("metadata_labels")
    return FolderIndex(root, splits, meta["classes"], [tuple(d) for d in meta["dirs"]],
                       cached=True,
                       not_opened=not_opened if isinstance(not_opened, dict) else {},
                       metadata_labels=metadata if isinstance(metadata, dict) else {})
