"""Where images come from: local parquet / save_to_disk / image folders, the hub, or generated.

Every source ends as two `ImageSource`s (train and held-out) plus class names.  A source that
fits in memory is decoded once into a uint8 tensor (`ArraySource`); otherwise images are decoded
on demand from a Hugging Face dataset (`HFSource`).  Image folders are indexed by imagefolder.py
and made a dataset of (path, label) rows; files are decoded by decode.py.

An image that cannot be decoded is named for people (`HFSource.name`: its path relative to
--data-dir, or its parquet file and row) and, by default, replaced by a substitute that is a
function of its index alone (`HFSource._substitute`), so that an epoch keeps its length and
exact resumes keep working; the trainer says each once (badimages.py).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from accel_train.data import synthetic
from accel_train.config import SYNTHETIC_DATASET, TrainConfig
from accel_train.data.carve import carve_description, carve_name, carve_rows
from accel_train.data.decode import Unreadable, decode_many, read_value
from accel_train.base.errors import UsageError, first_few, first_line
from accel_train.base.ranks import print_once
from accel_train.base.readers import load_saved_dataset, parquet_file
from accel_train.data.pixel_arrays import check_pixel_arrays, image_files
from accel_train.data.folder_labels import metadata_labels_line
from accel_train.data.imagefolder import (FolderIndex, HoldsParquet, classes_across_folders,
                                          files_under, index_folder, parquet_data_files,
                                          photos_left_out, split_in_name)
from accel_train.data.sample_limits import (few_classes_kept, kept_positions, limit_rows,
                                            subset_if_cut)
from accel_train.data.labels import (check_label_values, unreadable_classes_named,
                                     label_gap_warnings, labels_and_names,
                                     refuse_folders_never_trained, set_aside_unlabelled_splits)

IMAGE_COLUMN_NAMES = ("img", "image", "images", "pixel_values", "picture", "jpg", "png", "webp")
LABEL_COLUMN_NAMES = ("label", "labels", "fine_label", "coarse_label", "class", "target", "y")
# Three roles: train, validation (every decision: best checkpoints, EMA or raw weights, the time
# budget's probes) and test (evaluated once, at the end, and decides nothing).
# the names image folders and parquet files take too (imagefolder.py, datasets' patterns)
TRAIN_SPLIT_NAMES = ("train", "training")
VALIDATION_SPLIT_NAMES = ("validation", "val", "valid", "dev", "eval", "evaluation")
TEST_SPLIT_NAMES = ("test", "testing")
EVAL_SPLIT_NAMES = VALIDATION_SPLIT_NAMES + TEST_SPLIT_NAMES
MATERIALIZE_BATCH = 1024  # rows read from Arrow at a time when decoding into memory,
MATERIALIZE_BYTES = 256 * 2**20  # or fewer: the decoded images a batch holds at most
NATIVE_SIZE_PROBE = 32  # images looked at to tell a data set's own image size
MIXED_SIZE_DEFAULT = 224  # --image-size for data sets of mixed sizes: timm's usual input size


def spread(count: int, length: int) -> list[int]:
    """`count` indices of a split of `length` images to look at or time: evenly spread over it,
    first and last included, where it holds more, else 0..count-1 (as sample keys, those past
    `length` are the next epoch's).  Spread, not the first few: an image folder's rows go class
    by class, and the first class's images are not the others' sizes."""
    if count >= length:
        return list(range(count))
    return sorted({int(i) for i in np.linspace(0, length - 1, count)})


def default_image_size(source: "ImageSource") -> int:
    """--image-size when not given: the images' own size where they share one (CIFAR's 32, no
    resize at all), but no more than MIXED_SIZE_DEFAULT: photographs from one camera share a
    size too, and a folder of 4032x3024 phone photos trained at 3024 px (180x the pixels of
    224, each step seconds on a CPU) where one rotated photo among them made it 224."""
    return min(source.native_size, MIXED_SIZE_DEFAULT)


class ImageSource:
    """Indexable images (uint8 CHW RGB tensors) with integer labels."""

    labels: torch.Tensor
    # reading an image draws from the global generators (a program's dataset with a random
    # transform of its own: user_data.py), so the training loader seeds each read
    reads_randomly: bool = False

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def images_at(self, indices) -> list[torch.Tensor]:
        return [self.image(int(index)) for index in indices]

    def samples_at(self, indices) -> tuple[list[torch.Tensor], list[int]]:
        """(images, the index each image and its label came from): another index than asked
        where the image asked for could not be decoded.  Only sources that decode on demand
        replace images here (sources decoded in memory replaced theirs while loading)."""
        indices = [int(index) for index in indices]
        return self.images_at(indices), indices

    @functools.cached_property
    def probed_shapes(self) -> list[tuple[int, int]]:
        """(height, width) of up to NATIVE_SIZE_PROBE images spread over the split."""
        return [tuple(image.shape[-2:]) for image in
                self.images_at(spread(min(len(self), NATIVE_SIZE_PROBE), len(self)))]

    @functools.cached_property
    def native_size(self) -> int:
        """The default --image-size: the images' own (shorter) side when the probed ones share
        one size, else 224.  Whether or not the images are decoded in memory: a lazily decoded
        CIFAR-10 (--in-memory never) is still 32 px."""
        shapes = set(self.probed_shapes)
        return min(shapes.pop()) if len(shapes) == 1 else MIXED_SIZE_DEFAULT


@dataclass(frozen=True)
class BadImage:
    """An image that could not be decoded: which split and index, its name for people (a file
    path relative to --data-dir, or a data file and row), and why."""

    split: str
    index: int
    name: str
    reason: str
    label: Optional[int] = None  # its class, where only reading it again tells (streamed)


class ArraySource(ImageSource):
    """All images decoded in memory: uint8 [N, 3, H, W].  `bad_images`: the ones that could not
    be decoded while loading; their slots hold their substitutes (image and label)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor,
                 bad_images: Sequence[BadImage] = ()):
        self.images = images
        self.labels = labels
        self.bad_images = list(bad_images)

    def image(self, index: int) -> torch.Tensor:
        return self.images[index]

    @property
    def native_size(self) -> int:
        return int(min(self.images.shape[-2:]))


class DecodedImages(ImageSource):
    """Images decoded in memory that differ in size (photographs), each kept as decoded: the
    held-out transform resizes and crops each, as it does images decoded on demand."""

    def __init__(self, images: Sequence[torch.Tensor], labels: torch.Tensor):
        self.decoded, self.labels = list(images), labels

    def image(self, index: int) -> torch.Tensor:
        return self.decoded[index]


class RowNames:
    """Names the rows of one split for people: the parquet file and the row in it (`datasets`
    concatenates a split's files in order, so row r falls in the file whose row span holds it),
    or `<where> row r` (a save_to_disk folder or a hub dataset, and its split)."""

    def __init__(self, where: str, files: Sequence[tuple[str, int]] = ()):
        self.where, self.files = where, list(files)
        self.starts = np.cumsum([0] + [rows for _, rows in self.files])

    def __call__(self, row: int) -> str:
        if not self.files:
            return f"{self.where} row {row}"
        k = int(np.searchsorted(self.starts, row, side="right")) - 1
        return f"{self.files[k][0]} row {row - int(self.starts[k])}"


def warn_substitute(source: "HFSource", bad: BadImage, used: int) -> None:
    """What a source decoding on demand does by default on meeting a broken image (in whatever
    process meets it): say so on stderr.  Outside training that is an evaluation (eval, an
    export's model card), which leaves the image out of its numbers (evaluate_classifier).
    The trainer replaces this: it collects them from every rank and worker and says each once
    (badimages.py)."""
    print(f"warning: image {bad.name} cannot be decoded ({bad.reason}); left out of the "
          f"evaluation's numbers", file=sys.stderr, flush=True)


class HFSource(ImageSource):
    """Images decoded on demand from a Hugging Face dataset (too large or mixed sizes).

    `rows`: each image's row in its split as read (before the held-out split was carved off or a
    sample limit applied), for `names`; `root`: the folder that relative image paths are in.
    An image that cannot be decoded is an error with `bad_images="error"`; with "substitute" it
    is replaced by the next image (index + 1, + 2, ..., wrapping around) that decodes, with that
    image's label: a function of the index alone, so every process, worker, resumed start and
    world size makes the same replacement, and an epoch keeps its length."""

    def __init__(self, dataset, image_column: str, labels: torch.Tensor, split: str, *,
                 rows: Optional[np.ndarray] = None, names: Optional[Callable] = None,
                 root: Optional[Path] = None, bad_images: str = "substitute"):
        self.dataset = image_files(dataset, image_column)
        self.image_column = image_column
        self.labels = labels
        self.split = split
        self.rows = np.arange(len(labels)) if rows is None else np.asarray(rows)
        self.names = names or RowNames(f"split '{split}'")
        self.root = root
        self.bad_images = bad_images
        self.on_substitute = warn_substitute  # None: tell nobody (the caller collects them)
        self.bad: dict[int, str] = {}  # index -> reason, met by this process
        self.not_held = ""  # why materialize held nothing, for --in-memory always's message
        self._substitutes: dict[int, int] = {}
        # Rows of the image column as Arrow: fetching a batch of rows at once is far cheaper
        # than one Python dict per row (0.3 ms a row here, more than decoding a CIFAR image).
        self.column = self.dataset.select_columns([image_column]).with_format("arrow")

    def subset(self, indices) -> "HFSource":
        """The images at these indices, as a source of their own (same names)."""
        indices = np.asarray(indices, dtype=np.int64)
        source = HFSource(self.dataset.select(indices), self.image_column,
                          self.labels[torch.from_numpy(indices)], self.split,
                          rows=self.rows[indices], names=self.names, root=self.root,
                          bad_images=self.bad_images)
        source.on_substitute = self.on_substitute
        return source

    def name(self, index: int) -> str:
        """The image at `index` for people: its file (relative to --data-dir) for image folders,
        else its data file or split and row (and the file name stored with it, if any)."""
        value = self.column[[int(index)]].column(0).to_pylist()[0]
        path = value.get("path") if isinstance(value, dict) else None
        if path and (self.root is not None or value.get("bytes") is None):
            if self.root is not None and os.path.isabs(path):
                relative = os.path.relpath(path, self.root)
                path = path if relative.startswith("..") else relative
            return path
        where = self.names(int(self.rows[index]))
        return f"{where} ({path})" if path else where

    def bad_image(self, index: int) -> Optional[BadImage]:
        """The image at `index` as a BadImage if it cannot be decoded (checked now, in this
        process, unless this process already met it), else None."""
        reason = self.bad.get(index)
        if reason is None:
            result = self._decode([index])[0]
            if not isinstance(result, Unreadable):
                return None
            reason = result.reason
        return BadImage(self.split, index, self.name(index), reason)

    def image(self, index: int) -> torch.Tensor:
        return self.images_at([index])[0]

    def images_at(self, indices) -> list[torch.Tensor]:
        """The images at these indices (in that order), decoded; one Arrow read for all."""
        return self.samples_at(indices)[0]

    def samples_at(self, indices) -> tuple[list[torch.Tensor], list[int]]:
        indices = [int(i) for i in indices]
        results = self._decode(indices)
        used = list(indices)
        for k, result in enumerate(results):
            if isinstance(result, Unreadable):
                used[k], results[k] = self._substitute(indices[k], result.reason)
        return results, used

    def files_at(self, indices) -> list:
        """The stored bytes of each image, undecoded (a PIL image where the data set holds
        one), or the Unreadable saying why they cannot be read."""
        return self._read_values(self.column[[int(i) for i in indices]].column(0).to_pylist())

    def _decode(self, indices: list[int]) -> list:
        """Decoded images, or Unreadable where one cannot be."""
        values = self.column[indices].column(0).to_pylist()
        return self._decode_values(values)

    def _read_values(self, values: list) -> list:
        items: list = []
        for value in values:
            try:
                items.append(read_value(value, self.root))
            except Unreadable as err:
                items.append(err)
        return items

    def _decode_values(self, values: list) -> list:
        items = self._read_values(values)
        readable = [i for i, item in enumerate(items) if not isinstance(item, Unreadable)]
        for i, result in zip(readable, decode_many([items[i] for i in readable])):
            items[i] = result
        return items

    def _met_bad(self, index: int, reason: str) -> None:
        """The image at `index` cannot be decoded: an error (naming it) under --bad-images
        error; otherwise remembered, so that it is decoded only once per process."""
        if self.bad_images == "error":
            raise UsageError(f"image {self.name(index)} cannot be decoded ({reason}); remove or "
                             f"replace that file, or pass --bad-images substitute to train on "
                             f"with a substitute for it")
        self.bad[index] = reason

    def _substitute(self, index: int, reason: str) -> tuple[int, torch.Tensor]:
        """(index, image) of the next image after `index` that decodes."""
        first_time = index not in self.bad
        self._met_bad(index, reason)
        known = self._substitutes.get(index)
        if known is not None:
            return known, self._decode([known])[0]
        for step in range(1, len(self)):
            candidate = (index + step) % len(self)
            if candidate in self.bad:
                continue
            result = self._decode([candidate])[0]
            if isinstance(result, Unreadable):
                self.bad[candidate] = result.reason
                continue
            self._substitutes[index] = candidate
            if first_time and self.on_substitute is not None:
                self.on_substitute(self, BadImage(self.split, index, self.name(index), reason),
                                   candidate)
            return candidate, result
        raise UsageError(f"no image of the {self.split} split can be decoded (the first: "
                         f"{self.name(index)}: {reason}); check the data with accel-train "
                         f"check-data --data-dir DIR")

    def materialize(self, limit_bytes: float) -> Optional[ArraySource]:
        """Decode every image once into memory, or None if sizes differ or it would not fit.
        Images that cannot be decoded get their substitutes (or raise, see _met_bad)."""
        if len(self) == 0:
            self.not_held = f"its {self.split} split holds no images"
            return None
        first = self.image(0)  # a substitute's, if image 0 is broken: the shape is what counts
        if first.numel() * len(self) > limit_bytes:
            self.not_held = (f"its {len(self)} {self.split} images take "
                             f"{first.numel() * len(self) / 2**30:.3g} GiB, over the "
                             f"{max(0.0, limit_bytes) / 2**30:.3g} GiB left of "
                             f"--in-memory-limit-gb")
            return None
        images = torch.empty((len(self), *first.shape), dtype=torch.uint8)
        bad: dict[int, str] = {}
        # Arrow batches: a row-by-row walk through the dataset cost more than the decoding.  A
        # batch's decoded images are held until copied in: as many as MATERIALIZE_BYTES take
        # (1,024 CIFAR images; a few photographs of 12 megapixels).
        batch = max(1, min(MATERIALIZE_BATCH, MATERIALIZE_BYTES // first.numel()))
        start = 0
        for table in self.column.iter(batch_size=batch):
            values = table.column(0).to_pylist()
            for offset, result in enumerate(self._decode_values(values)):
                if isinstance(result, Unreadable):
                    self._met_bad(start + offset, result.reason)
                    bad[start + offset] = result.reason
                elif result.shape != first.shape:
                    self.not_held = (f"its {self.split} images differ in size "
                                     f"({'x'.join(map(str, first.shape[1:]))} and "
                                     f"{'x'.join(map(str, result.shape[1:]))}, height x width)")
                    return None
                else:
                    images[start + offset] = result
            start += len(values)
        labels = self.labels
        if bad:
            labels = labels.clone()
            for index in bad:  # the same replacement as _substitute's: the next good index
                used = next((index + step) % len(self) for step in range(1, len(self))
                            if (index + step) % len(self) not in bad)
                images[index], labels[index] = images[used], labels[used]
        return ArraySource(images, labels, [BadImage(self.split, index, self.name(index), why)
                                            for index, why in sorted(bad.items())])


def held_in_memory(sources: Sequence, config) -> Optional[list[ArraySource]]:
    """Every source decoded into memory (each one's `materialize`), on one
    --in-memory-limit-gb budget for all, or none of them (None): a held training split beside a
    held-out one decoded per step would gain little.  --in-memory always refuses in one line
    naming the source that could not be held and why (its `not_held`)."""
    held, left = [], config.in_memory_limit_gb * 2**30
    for source in sources:
        decoded = source.materialize(left)
        if decoded is None:
            if config.in_memory == "always":
                raise UsageError(f"--in-memory always: the data cannot be held in memory: "
                                 f"{source.not_held}; use --in-memory auto (or never) to decode "
                                 f"the images per step")
            return None
        held.append(decoded)
        left -= decoded.images.numel()
    return held


@dataclass
class LoadedData:
    train: ImageSource
    held_out: ImageSource
    class_names: list[str]
    description: str
    # Met while decoding into memory (their slots hold substitutes); those decoded on demand are
    # met later, in the loaders.
    bad_images: list[BadImage] = field(default_factory=list)
    # Evaluated once, at the end of training, and never read before: it decides nothing.
    test: Optional[ImageSource] = None
    # Datasets a program handed to fit(), which no command can load again (eval asks for data)
    from_program: bool = False
    warnings: list[str] = field(default_factory=list)  # said at the start, on the main rank
    # --sample-subset, where a sample limit cut a split (a resume must keep the same images)
    sample_subset: Optional[str] = None
    # how the held-out images were carved off the training split, where they were: 'random'
    # or 'stratified' (--val-stratify; a resume must keep the same images)
    held_out_carve: Optional[str] = None
    # where the labels came from when not from class folders or flags: a metadata file's
    # (Hugging Face's imagefolder layout), said in the start summary
    labels: Optional[str] = None


@dataclass
class RawData:
    """Every split of the data as read, before the held-out split is chosen or carved off."""

    splits: dict  # split name -> datasets.Dataset
    names: dict[str, Callable[[int], str]]  # split name -> names of its rows
    origin: str
    root: Optional[Path] = None  # the folder relative image paths are in
    # an image folder's photos in formats PIL does not open, {extension: count}: left out
    photos_not_opened: dict = field(default_factory=dict)
    # {split: its metadata files, relative to root} of the splits metadata files label
    metadata_labels: dict = field(default_factory=dict)


def _find_column(dataset, wanted: Optional[str], names: tuple[str, ...], feature_type,
                 flag: str) -> str:
    columns = list(dataset.column_names)
    if wanted is not None:
        if wanted not in columns:
            raise UsageError(f"{flag} {wanted!r} is not a column of this dataset; its columns "
                             f"are: {', '.join(columns)}")
        return wanted
    for name in names:
        if name in columns:
            return name
    for name, feature in dataset.features.items():
        if isinstance(feature, feature_type):
            return name
    raise UsageError(f"cannot tell which column holds the {flag.split('-')[-2]}s (columns: "
                     f"{', '.join(columns)}); name it with {flag}")


def find_columns(dataset, config: TrainConfig) -> tuple[str, str]:
    """(image column, label column): as named by the flags, else found by name or type; an
    image column of arrays that are not pixels is refused (check_pixel_arrays)."""
    from datasets import ClassLabel, Image as ImageFeature
    image = _find_column(dataset, config.image_column, IMAGE_COLUMN_NAMES, ImageFeature,
                         "--image-column")
    check_pixel_arrays(dataset, image)
    return image, _find_column(dataset, config.label_column, LABEL_COLUMN_NAMES, ClassLabel,
                               "--label-column")


def _quiet_datasets():
    """The `datasets` library, with its progress bars and warnings off: for files already on
    this disk they only say "Generating train split ... 100%", hundreds of carriage-return
    updates that fill log files and land above a one-line error."""
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _parquet_rows(file: Path, data_dir: str) -> int:
    """The rows of a parquet file, from its footer; a footer that cannot be read (a copy or
    download that stopped halfway) is one line naming the file, where datasets would raise
    pyarrow's error from deep inside its builder."""
    return parquet_file(file, "parquet", f"--data-dir {data_dir}:").metadata.num_rows


def _parquet_names(data_dir: Path, files: list[Path], rows: dict[Path, int]) -> RowNames:
    return RowNames(str(data_dir), [(str(file.relative_to(data_dir)), rows[file])
                                    for file in files])


def parquet_splits(root: Path, parquet: list[Path]) -> dict[str, list[Path]]:
    """The split of each parquet file, by its name or its folder's, as Hugging Face's
    `load_dataset` reads a folder (`train*`, `validation*`/`valid*`/`val*`/`dev*`,
    `test*`/`eval*`, each followed by a separator or a digit: `test_data.parquet`,
    `train-00000-of-00001.parquet`, `validation/0000.parquet`), the split's name in any
    letter case (`Train.parquet`, `TEST/`), as image folders are split.  A file no split names
    trains (where datasets would leave it out without a word)."""
    from datasets.data_files import DataFilesDict, get_data_patterns
    patterns = get_data_patterns(str(root))
    if not _sharded(patterns):
        patterns = _split_patterns_any_case(root) or patterns
    found = DataFilesDict.from_patterns(patterns, base_path=str(root))
    ours = {file.resolve(): file for file in parquet}  # datasets lists absolute paths
    splits: dict[str, list[Path]] = {}
    for split, names in found.items():
        listed = sorted({ours[Path(n).resolve()] for n in names if Path(n).resolve() in ours})
        if listed:
            splits[str(split)] = listed
    placed = {file for group in splits.values() for file in group}
    rest = [file for file in parquet if file not in placed]
    if rest:
        splits["train"] = sorted(splits.get("train", []) + rest)
    return splits


def _sharded(patterns: dict) -> bool:
    """Whether datasets split the folder by its `data/{split}-00000-of-00001` file names: those
    keep the split names as written, which split_named matches in any case."""
    from datasets.data_files import SPLIT_PATTERN_SHARDED
    return any(SPLIT_PATTERN_SHARDED.format(split=split) in names
               for split, names in patterns.items())


def _split_patterns_any_case(root: Path) -> Optional[dict[str, list[str]]]:
    """datasets' own split patterns (split names in folder names first, then in file names),
    each keyword matched in any letter case: datasets' patterns are case-sensitive, so
    `Train.parquet` beside `Test.parquet` gave one train split of both, and the test rows were
    trained on.  None where no file or folder names a split."""
    from datasets.data_files import (KEYWORDS_IN_DIR_NAME_BASE_PATTERNS,
                                     KEYWORDS_IN_FILENAME_BASE_PATTERNS, NON_WORDS_CHARS,
                                     SPLIT_KEYWORDS, DataFilesDict)

    def any_case(word: str) -> str:  # glob's own classes: [tT][rR][aA][iI][nN]
        return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in word)

    for bases in (KEYWORDS_IN_DIR_NAME_BASE_PATTERNS, KEYWORDS_IN_FILENAME_BASE_PATTERNS):
        patterns = {str(split): [base.format(keyword=any_case(word), sep=NON_WORDS_CHARS)
                                 for word in words for base in bases]
                    for split, words in SPLIT_KEYWORDS.items()}
        found = DataFilesDict.from_patterns(patterns, base_path=str(root))
        named = {split: patterns[split] for split, files in found.items() if files}
        if named:
            return named
    return None


def _own_class_labels(dataset, file: Path, data_dir: str):
    """datasets' parquet loader gives every split the first split's features; a split whose
    files name their classes otherwise (each split written with the names it holds, say) gets
    its own ClassLabel names back, and labels.py maps its labels by name."""
    from datasets import ClassLabel, Features
    schema = parquet_file(file, "parquet", f"--data-dir {data_dir}:").schema_arrow
    try:
        own = Features.from_arrow_schema(schema)
    except (ValueError, TypeError, KeyError):  # metadata datasets cannot read: as loaded
        return dataset
    changed = {name: feature for name, feature in own.items()
               if isinstance(feature, ClassLabel) and name in dataset.features
               and dataset.features[name] != feature}
    if not changed:
        return dataset
    features = dataset.features.copy()
    features.update(changed)
    return dataset.cast(features)


def _load_local(config: TrainConfig) -> RawData:
    """Every split of a save_to_disk folder, a folder of parquet files, or an image folder."""
    datasets = _quiet_datasets()
    data_dir = config.data_dir
    path = Path(data_dir)
    if not path.exists():
        raise UsageError(f"--data-dir {data_dir}: no such folder")
    if not path.is_dir():
        raise UsageError(f"--data-dir {data_dir} is a file; pass the folder that holds the data")
    if saved_by_datasets(path):
        refuse_image_folder_options(config, "a save_to_disk folder, labelled by its label column")
        loaded = load_saved_dataset(path, f"--data-dir {data_dir}:")
        if not isinstance(loaded, datasets.DatasetDict):
            loaded = datasets.DatasetDict(train=loaded)
        return RawData(dict(loaded), {split: RowNames(f"{data_dir} split '{split}'")
                                      for split in loaded}, data_dir)
    # The image folder's index first (its cache, else a walk that stops at the first parquet
    # file): a start lists an image folder's tree once (the search for parquet files lists
    # every folder too: a second walk, a fifth of a first start at a million files), and an
    # unchanged folder's not at all.  Exact: a parquet file added anywhere the search looks
    # changes the mtime of a folder the cached index saw, and stops a walk that meets it.
    try:
        index = index_folder(path, config.class_depth, config.val_labels, say=print_once,
                             stop_at_parquet=True, train_labels=config.train_labels)
    except (HoldsParquet, UsageError) as stopped:
        # A parquet layout, or a folder that is no image folder: what the search finds decides
        # (an image folder's metadata.parquet is not among them: a problem it has is the
        # image folder's refusal, re-raised below)
        parquet = sorted(parquet_data_files(path))
        if parquet:
            refuse_image_folder_options(config, "a folder of parquet files, labelled by their "
                                                "label column")
            return _load_parquet(path, parquet, data_dir)
        if next(files_under(path), None) is None:
            raise UsageError(f"--data-dir {data_dir} holds no files; expected parquet files, a "
                             f"save_to_disk folder or one subfolder of images per class") from None
        if isinstance(stopped, UsageError):
            refuse_a_run_inside(path, config)
            raise
        # the parquet files met are behind a symlinked folder, which the search (as datasets')
        # does not follow: the images are the data
        index = index_folder(path, config.class_depth, config.val_labels, say=print_once,
                             train_labels=config.train_labels)
    refuse_a_run_inside(path, config)
    return _image_folder_data(path, index)


IMAGE_FOLDER_OPTIONS = ("val_labels", "train_labels", "class_depth")


def labelled_by_a_column(data_dir: str) -> bool:
    """Whether --data-dir holds data labelled by its own label column (a save_to_disk folder,
    parquet files), which --val-labels, --train-labels and --class-depth never applied to."""
    path = Path(data_dir)
    return path.is_dir() and (saved_by_datasets(path) or
                              next(parquet_data_files(path), None) is not None)


def saved_by_datasets(path: Path) -> bool:
    """A folder `save_to_disk` wrote (a DatasetDict's, or one Dataset's)."""
    return (path / "dataset_dict.json").exists() or (path / "state.json").exists()


def refuse_image_folder_options(config, what: str) -> None:
    """--val-labels, --train-labels and --class-depth say how an image folder's images are
    labelled; data with a label column of its own would train on that column, the option
    unread."""
    for name in IMAGE_FOLDER_OPTIONS:
        value = getattr(config, name, None)
        if value is not None:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {value} labels the images of an image folder, and "
                             f"--data-dir {config.data_dir} is {what}; drop {flag}")


def refuse_a_run_inside(image_folder: Path, config: TrainConfig) -> None:
    """A run folder inside an image folder is walked as part of it: its plots would be images
    of a class named after it, and the refusal that came first blamed the data ("class folder
    runs/first holds no images", about a folder this start had just made).  (Parquet files and
    a save_to_disk folder are found by name: a run beside them is not read.)"""
    data = image_folder.resolve()
    for name, folder in (("--output-dir", config.output_dir), ("--checkpoint", config.checkpoint)):
        if folder and (Path(folder).resolve() == data or data in Path(folder).resolve().parents):
            raise UsageError(f"{name} {folder} is inside --data-dir {config.data_dir}, an image "
                             f"folder: the run's files would be read as its images; choose an "
                             f"{name} outside the data")


def _load_parquet(path: Path, parquet: list[Path], data_dir: str) -> RawData:
    """The splits of a folder of parquet files, as datasets' own builder reads them."""
    datasets = _quiet_datasets()
    files = parquet_splits(path, parquet)
    rows = {file: _parquet_rows(file, data_dir) for file in parquet}  # each footer read once
    for split, group in files.items():  # datasets' builder fails on a split of no rows
        if not sum(rows[file] for file in group):
            raise UsageError(f"--data-dir {data_dir}: its {split} split "
                             f"({', '.join(str(f.relative_to(path)) for f in group)}) holds "
                             f"no rows; remove the file(s), or write the split's images "
                             f"into them")
    loaded = datasets.load_dataset("parquet", data_files={
        split: [str(file) for file in group] for split, group in files.items()})
    splits = {split: _own_class_labels(loaded[split], group[0], data_dir)
              for split, group in files.items()}
    return RawData(splits, {split: _parquet_names(path, group, rows)
                            for split, group in files.items()}, data_dir)


def _image_folder_data(path: Path, index: FolderIndex) -> RawData:
    import pyarrow as pa
    from datasets import ClassLabel, Dataset, DatasetInfo, Features, Image as ImageFeature
    from datasets.table import InMemoryTable

    features = Features({"image": ImageFeature(decode=False),
                         "label": ClassLabel(names=index.class_names)})
    splits = {}
    for split, (paths, labels) in index.splits.items():
        images = pa.StructArray.from_arrays([pa.nulls(len(paths), pa.binary()), paths],
                                            names=["bytes", "path"])
        table = pa.table({"image": images, "label": pa.array(labels, pa.int64())})
        # Our own fingerprint: without one, datasets pickles the whole table to make one
        # (a quarter of a second and 100 MB for a million paths).
        splits[split] = Dataset(InMemoryTable(table), info=DatasetInfo(features=features),
                                fingerprint=index.fingerprint(split))
    return RawData(splits, {split: RowNames(f"{path} split '{split}'") for split in splits},
                   str(path), root=path, photos_not_opened=index.not_opened,
                   metadata_labels=index.metadata_labels)


def folder_classes(raw: RawData, train_name: str, class_depth: Optional[int],
                   train_labels: Optional[str]) -> bool:
    """Whether an image folder's training classes are its deepest folders (no --class-depth,
    no label file, no metadata file): where deepest_classes_spread has something to say."""
    return (raw.root is not None and class_depth is None and train_labels is None
            and train_name not in raw.metadata_labels)


def deepest_classes_spread(raw: RawData, train_name: str) -> Optional[str]:
    """An image folder's classes_across_folders line for its training split."""
    import pyarrow.compute as pc
    paths = raw.splits[train_name].with_format("arrow")["image"].combine_chunks().field("path")
    first = (paths[0].as_py() or "").split("/")[0] if len(paths) else ""
    # (told by the paths, not by listing the root again: a first start lists each folder once)
    in_train_folder = split_in_name(first) == "train" \
        and pc.all(pc.starts_with(paths, f"{first}/")).as_py()
    prefix = f"{first}/" if in_train_folder else ""
    return classes_across_folders(paths, raw.splits[train_name].features["label"].names,
                                  prefix)


def _load_hub(name: str) -> RawData:
    datasets = _quiet_datasets()
    try:
        loaded = datasets.load_dataset(name)
    except Exception as err:  # offline, unknown id, gated: all end the same way for the user
        offline = (os.environ.get("HF_DATASETS_OFFLINE") == "1"
                   or os.environ.get("HF_HUB_OFFLINE") == "1")
        if Path(name).is_dir():  # datasets read it with its own folder loaders, and failed
            raise UsageError(f"--dataset {name} is a local folder, which Hugging Face datasets' "
                             f"loader could not read ({first_line(err, 200)}); pass it as "
                             f"--data-dir {name} (--dataset takes a hub id)") from None
        reason = "offline mode is set" if offline else first_line(err, 200)
        raise UsageError(f"--dataset {name}: cannot load it from the Hugging Face hub ({reason}); "
                         f"with no network, pass --data-dir PATH to a local copy, or --dataset "
                         f"{SYNTHETIC_DATASET} for the embedded set") from None
    return RawData(dict(loaded), {split: RowNames(f"{name} split '{split}'") for split in loaded},
                   name)


def open_data(config: TrainConfig) -> RawData:
    """Every split of --data-dir or --dataset, as read (not the embedded synthetic set)."""
    raw = _load_local(config) if config.data_dir is not None else _load_hub(config.dataset)
    if not raw.splits or all(len(split) == 0 for split in raw.splits.values()):
        raise UsageError(f"{raw.origin}: the dataset is empty")
    return raw


@dataclass
class Splits:
    """Which rows of which split play each role; `test_name` None where there is no test split
    (or where the test split itself is used for selection, as asked)."""

    train_name: str
    train_rows: np.ndarray
    eval_name: str
    eval_rows: np.ndarray
    test_name: Optional[str]
    description: str


def split_named(names, wanted: tuple[str, ...]) -> Optional[str]:
    """The first of `names` that is one of `wanted`, in any letter case (`Train`, `TEST`, as
    image folders are matched): a DatasetDict's keys are whatever its maker typed."""
    lowered = {name.lower(): name for name in reversed(list(names))}
    return next((lowered[w] for w in wanted if w in lowered), None)


def training_split_name(raw: RawData) -> str:
    """The split named train or training (any case), else the one split not named for
    evaluation.  Every split named for evaluation (validation, test, ...), or several that
    could each be the training split: one line, where the first split (a DatasetDict's test,
    say) trained without a word."""
    named = split_named(raw.splits, TRAIN_SPLIT_NAMES)
    if named is not None:
        return named
    candidates = [name for name in raw.splits if name.lower() not in EVAL_SPLIT_NAMES]
    if not candidates:
        raise UsageError(f"{raw.origin} has no training split: its splits are "
                         f"{', '.join(raw.splits)}, each named for evaluation; put the "
                         f"training images in a split named train")
    if len(candidates) > 1:
        raise UsageError(f"{raw.origin} has no split named train, and {len(candidates)} that "
                         f"could be it ({', '.join(candidates)}); name the training split "
                         f"train (and the others validation or test)")
    return candidates[0]


def pick_splits(raw: RawData, val_fraction: float, label_column: str,
                select_on_test: bool = False, stratify: bool = False,
                carve: bool = True) -> Splits:
    """The data's own validation split; else `val_fraction` of the training split carved off
    with a fixed seed (class by class with `stratify`; each class keeping a training image:
    carve.carve_rows), the test split kept
    for the end; with `select_on_test`, a data set with
    only train and test uses its test split for selection (and says so)."""
    names = list(raw.splits)
    train_name = training_split_name(raw)
    others = [n for n in names if n != train_name]
    validation = split_named(others, VALIDATION_SPLIT_NAMES)
    test = split_named(others, TEST_SPLIT_NAMES)
    train_rows = np.arange(len(raw.splits[train_name]))
    if validation is None and test is not None and select_on_test:
        return Splits(train_name, train_rows, test, np.arange(len(raw.splits[test])), None,
                      f"{train_name}/{test}, the test split used for selection")
    if validation is not None:
        return Splits(train_name, train_rows, validation,
                      np.arange(len(raw.splits[validation])), test,
                      f"{train_name}/{validation}" + (f"/{test}" if test else ""))
    if not carve:  # every image where it is: the training split whole, nothing held out
        return Splits(train_name, train_rows, train_name, np.arange(0), test,
                      f"{train_name}, nothing held out" + (f"; {test} apart" if test else ""))
    labels = raw.splits[train_name].with_format("arrow")[label_column].to_numpy()
    train_rows, held_out_rows = carve_rows(len(train_rows), val_fraction, labels, stratify)
    return Splits(train_name, train_rows, train_name, held_out_rows, test,
                  f"{train_name} minus {100 * val_fraction:.3g}% for validation"
                  + carve_description(len(train_rows) + len(held_out_rows), val_fraction,
                                      held_out_rows, stratify)
                  + (f"; {test} kept for the end" if test else ""))


def carve_options_unused(config: TrainConfig, origin: str, eval_name: str) -> Optional[str]:
    """The carve options given (--val-fraction other than its default, --val-stratify) where
    the data holds out a split of its own: nothing is carved, which a run should say rather
    than hold out other images than the ones asked for without a word."""
    default = next(f.default for f in fields(TrainConfig) if f.name == "val_fraction")
    given = ([f"--val-fraction {config.val_fraction:g}"]
             if config.val_fraction != default else []) + \
        (["--val-stratify"] if config.val_stratify else [])
    if not given:
        return None
    split = "test split, used for selection" if eval_name.lower() in TEST_SPLIT_NAMES else \
        "validation split"
    return (f"{' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect: {origin} "
            f"has a {split} ({eval_name}), which the run holds out")


def refuse_classes_left_unreadable(source: "HFSource", decoded: ArraySource,
                                   class_names: list[str]) -> None:
    """A class none of whose training images decodes would train as an output that only
    substitutes (other classes' images) teach: one line, as an empty class folder is."""
    names = unreadable_classes_named(source.labels, [bad.index for bad in decoded.bad_images],
                                     class_names)
    if names:
        raise UsageError(f"no training image of class {names} can be decoded: the run would "
                         f"train those outputs on substitutes of other classes; fix or replace "
                         f"the files (accel-train check-data --data-dir DIR lists them), or "
                         f"remove the class")


def rows_of(dataset, rows: np.ndarray):
    """dataset.select(rows); a prefix stays a slice (no indices mapping), all of it as it is."""
    if np.array_equal(rows, np.arange(len(rows))):
        return dataset if len(rows) == len(dataset) else dataset.select(range(len(rows)))
    return dataset.select(rows)


def _limit(source: ImageSource, limit: Optional[int], how: str) -> ImageSource:
    kept = kept_positions(len(source), limit, how)
    if kept is None:
        return source
    if isinstance(source, ArraySource):
        index = torch.from_numpy(kept)
        return ArraySource(source.images[index], source.labels[index])
    return source.subset(kept)


def _synthetic(config: TrainConfig) -> LoadedData:
    parts = synthetic.splits(config.synthetic_train_size)

    def to_source(images, labels):
        return ArraySource(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
                           torch.from_numpy(labels))

    return LoadedData(to_source(*parts["train"]), to_source(*parts["test"]),
                      list(synthetic.CLASS_NAMES),
                      "synthetic shapes (embedded; its fixed test split used for selection)")


def embedded_set(config: TrainConfig) -> bool:
    """Whether the run reads the embedded synthetic set (generated, in memory)."""
    return config.data_dir is None and config.dataset == SYNTHETIC_DATASET


def load_data(config: TrainConfig, min_classes: int = 2, to_train: bool = True,
              every_image: bool = False) -> LoadedData:
    """Load, pick splits and columns, apply sample limits, decode into memory when worthwhile.
    `min_classes`: 2 to train on; eval takes data of one class.  `to_train`: False for data a
    trained model is evaluated on, whose held-out classes are checked against the model's
    (eval.align_labels), not against the data's own training split.  `every_image`: nothing
    carved off a data set without a validation split (eval --split all of other data)."""
    if embedded_set(config):
        data = _synthetic(config)
        return LoadedData(_limit(data.train, config.max_train_samples, config.sample_subset),
                          _limit(data.held_out, config.max_eval_samples, config.sample_subset),
                          data.class_names, data.description,
                          sample_subset=subset_if_cut(
                              config, (len(data.train), config.max_train_samples),
                              (len(data.held_out), config.max_eval_samples)))
    raw = open_data(config)
    train_name = training_split_name(raw)
    # the columns of the training split are every split's (datasets loads them as one)
    image_column, label_column = find_columns(raw.splits[train_name], config)
    warnings = set_aside_unlabelled_splits(raw, label_column, train_name)
    splits = pick_splits(raw, config.val_fraction, label_column, config.select_on_test,
                         config.val_stratify, carve=not every_image)
    unused = [name for name in raw.splits
              if name not in (splits.train_name, splits.eval_name, splits.test_name)]
    if unused:  # a DatasetDict's own names (holdout, extra): said, never dropped unsaid
        warnings.append(f"{raw.origin}: split(s) {', '.join(unused)} left out: neither "
                        f"train, validation nor test by name (rename a split to one of those "
                        f"to use it)")
    if folder_classes(raw, splits.train_name, config.class_depth, config.train_labels):
        spread = deepest_classes_spread(raw, splits.train_name)
        warnings += [spread] if spread else []
    if raw.photos_not_opened:  # an iPhone's folder, half HEIC, trained on half without a word
        warnings.append(photos_left_out(raw.root, raw.photos_not_opened))
    if config.select_on_test and splits.eval_name.lower() not in TEST_SPLIT_NAMES:
        warnings.append(f"--select-on-test has no effect: {raw.origin} "
                        + (f"has a validation split ({splits.eval_name}), which selects"
                           if splits.eval_name != splits.train_name else
                           "has no test split; part of train is held out for validation"))
    if splits.eval_name != splits.train_name and not every_image:
        unused_carve = carve_options_unused(config, raw.origin, splits.eval_name)
        warnings += [unused_carve] if unused_carve else []
    if to_train:
        refuse_folders_never_trained(raw, splits)
    limits = {"train": ("--max-train-samples", config.max_train_samples),
              "held-out": ("--max-eval-samples", config.max_eval_samples),
              "test": ("--max-eval-samples", config.max_eval_samples)}
    roles = [("train", splits.train_name, splits.train_rows),
             ("held-out", splits.eval_name, splits.eval_rows)]
    if splits.test_name is not None:
        roles.append(("test", splits.test_name, np.arange(len(raw.splits[splits.test_name]))))
    cut = subset_if_cut(config, *((len(rows), limits[role][1]) for role, _, rows in roles))
    roles = [(role, name, limit_rows(rows, limits[role][1], config.sample_subset))
             for role, name, rows in roles]
    parts = {role: rows_of(raw.splits[name], rows) for role, name, rows in roles}
    if to_train:
        check_label_values(raw, splits, label_column)
    labels, class_names = labels_and_names(parts, label_column)
    warnings += label_gap_warnings(raw, splits, label_column, class_names)
    warnings += few_classes_kept(limits, labels, len(class_names), config.sample_subset)
    if len(class_names) < min_classes:
        where = f"in {label_column!r}" if raw.root is None else \
            f"({first_few(class_names)}; an image folder's classes are its class folders, or " \
            f"the labels of --train-labels)"
        raise UsageError(f"{raw.origin}: found {len(class_names)} class(es) {where}; a "
                         f"classifier needs at least 2")
    sources = [HFSource(parts[role], image_column, labels[role], role, rows=rows,
                        names=raw.names[name], root=raw.root, bad_images=config.bad_images)
               for role, name, rows in roles]
    for source in sources:  # while loading, every rank would say it: LoadedData.bad_images
        source.on_substitute = None
    bad: list[BadImage] = []
    # --decode-on-device always asks for the files decoded per batch: auto's memory yields
    held = config.in_memory == "always" or (config.in_memory == "auto"
                                            and config.decode_on_device != "always")
    if held:
        decoded = held_in_memory(sources, config)
        if decoded is not None:
            refuse_classes_left_unreadable(sources[0], decoded[0], class_names)
            sources = decoded
            bad = [image for source in decoded for image in source.bad_images]
    for source in sources:
        if isinstance(source, HFSource):
            source.on_substitute = warn_substitute
    return LoadedData(sources[0], sources[1], class_names, f"{raw.origin} ({splits.description})",
                      bad, test=sources[2] if len(sources) > 2 else None, warnings=warnings,
                      sample_subset=cut,
                      held_out_carve=carve_name(config.val_stratify)
                      if splits.eval_name == splits.train_name else None,
                      labels=metadata_labels_line(raw.metadata_labels))
