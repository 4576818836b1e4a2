"""Where images come from: local parquet / save_to_disk / image folders, the hub, or generated.

Every source ends as two `ImageSource`s (train and held-out) plus class names.  A source that
fits in memory is decoded once into a uint8 tensor (`ArraySource`); otherwise images are decoded
on demand from a Hugging Face dataset (`HFSource`).
"""

from __future__ import annotations

import functools
import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from . import synthetic
from .config import SYNTHETIC_DATASET, TrainConfig
from .errors import UsageError

IMAGE_COLUMN_NAMES = ("img", "image", "images", "pixel_values", "picture", "jpg", "png", "webp")
LABEL_COLUMN_NAMES = ("label", "labels", "fine_label", "coarse_label", "class", "target", "y")
EVAL_SPLIT_NAMES = ("validation", "val", "valid", "test", "eval", "evaluation")
VAL_CARVE_SEED = 0  # fixed: the held-out set must not change with --seed
MATERIALIZE_BATCH = 1024  # rows read from Arrow at a time when decoding into memory
NATIVE_SIZE_PROBE = 32  # images looked at to tell a data set's own image size
MIXED_SIZE_DEFAULT = 224  # --image-size for data sets of mixed sizes: timm's usual input size


class ImageSource:
    """Indexable images (uint8 CHW RGB tensors) with integer labels."""

    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def images_at(self, indices) -> list[torch.Tensor]:
        return [self.image(int(index)) for index in indices]

    @functools.cached_property
    def native_size(self) -> int:
        """The default --image-size: the images' own (shorter) side when the first few share one
        size, else 224.  Whether or not the images are decoded in memory: a lazily decoded
        CIFAR-10 (--in-memory never) is still 32 px."""
        probe = self.images_at(range(min(len(self), NATIVE_SIZE_PROBE)))
        shapes = {tuple(image.shape[-2:]) for image in probe}
        return min(shapes.pop()) if len(shapes) == 1 else MIXED_SIZE_DEFAULT


class ArraySource(ImageSource):
    """All images decoded in memory: uint8 [N, 3, H, W]."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images = images
        self.labels = labels

    def image(self, index: int) -> torch.Tensor:
        return self.images[index]

    @property
    def native_size(self) -> int:
        return int(min(self.images.shape[-2:]))


_JPEG_MAGIC = b"\xff\xd8\xff"


def _jpeg_bytes(value) -> Optional[bytes]:
    if isinstance(value, dict) and isinstance(value.get("bytes"), bytes) \
            and value["bytes"].startswith(_JPEG_MAGIC):
        return value["bytes"]
    return None


def _decode_jpegs(blobs: list[bytes]) -> list[Optional[torch.Tensor]]:
    """JPEG bytes -> uint8 CHW RGB tensors with torchvision's libjpeg-turbo decoder, in one call
    for a whole list: about 3x faster than PIL, and pixel-identical to PIL's RGB on the shared
    CIFAR-10 and on RGB, grayscale, CMYK and progressive test files.  None where it fails, so
    that PIL (which names the problem) gets those, as it gets everything when torchvision's
    decoder is gone (it is deprecated in favour of TorchCodec)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return [None] * len(blobs)
    tensors = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return list(decode_jpeg(tensors, mode=ImageReadMode.RGB))
        except (RuntimeError, ValueError):
            if len(tensors) == 1:
                return [None]
    return [_decode_jpegs([blob])[0] for blob in blobs]  # find the bad one(s)


def decode_values(values: list, where) -> list[torch.Tensor]:
    """decode_image over a list, with the JPEGs among them decoded in one batch; `where(i)`
    names value i in errors."""
    jpeg_positions = [i for i, value in enumerate(values) if _jpeg_bytes(value) is not None]
    decoded: list[Optional[torch.Tensor]] = [None] * len(values)
    if jpeg_positions:
        fast = _decode_jpegs([_jpeg_bytes(values[i]) for i in jpeg_positions])
        for position, image in zip(jpeg_positions, fast):
            decoded[position] = image
    return [image if image is not None else decode_image(value, where(i), fast=False)
            for i, (value, image) in enumerate(zip(values, decoded))]


def decode_image(value, where: str, fast: bool = True) -> torch.Tensor:
    """A datasets Image value (PIL image, or dict of bytes/path) -> uint8 CHW RGB tensor.

    Grayscale, palette, CMYK and RGBA become RGB.  An unreadable image is an error naming it:
    a silently skipped sample would change what "one epoch" means across runs and world sizes.
    """
    if fast and _jpeg_bytes(value) is not None:
        decoded = _decode_jpegs([_jpeg_bytes(value)])[0]
        if decoded is not None:
            return decoded
    try:
        if isinstance(value, dict):
            if value.get("bytes") is not None:
                pil = Image.open(io.BytesIO(value["bytes"]))
            else:
                pil = Image.open(value["path"])
        elif isinstance(value, Image.Image):
            pil = value
        else:
            raise UnidentifiedImageError(f"unexpected value of type {type(value).__name__}")
        rgb = np.asarray(pil.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise UsageError(f"{where} cannot be decoded ({err}); remove or replace that "
                         f"file") from None
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1)


class HFSource(ImageSource):
    """Images decoded on demand from a Hugging Face dataset (too large or mixed sizes)."""

    def __init__(self, dataset, image_column: str, labels: torch.Tensor, split: str):
        from datasets import Image as ImageFeature
        self.dataset = dataset.cast_column(image_column, ImageFeature(decode=False))
        self.image_column = image_column
        self.labels = labels
        self.split = split
        # Rows of the image column as Arrow: fetching a batch of rows at once is far cheaper
        # than one Python dict per row (0.3 ms a row here, more than decoding a CIFAR image).
        self.column = self.dataset.select_columns([image_column]).with_format("arrow")

    def image(self, index: int) -> torch.Tensor:
        return self.images_at([index])[0]

    def images_at(self, indices) -> list[torch.Tensor]:
        """The images at these indices (in that order), decoded; one Arrow read for all."""
        indices = [int(i) for i in indices]
        values = self.column[indices].column(0).to_pylist()
        return decode_values(values, lambda i: f"image {indices[i]} of split '{self.split}'")

    def materialize(self, limit_bytes: float) -> Optional[ArraySource]:
        """Decode every image once into memory, or None if sizes differ or it would not fit."""
        if len(self) == 0:
            return None
        first = self.image(0)
        if first.numel() * len(self) > limit_bytes:
            return None
        images = torch.empty((len(self), *first.shape), dtype=torch.uint8)
        # Arrow batches: a row-by-row walk through the dataset cost more than the decoding.
        column = self.dataset.select_columns([self.image_column]).with_format("arrow")
        start = 0
        for table in column.iter(batch_size=MATERIALIZE_BATCH):
            values = table.column(0).to_pylist()
            decoded = decode_values(  # it calls the lambda before `start` moves on
                values, lambda i: f"image {start + i} of split '{self.split}'")  # noqa: B023
            for offset, image in enumerate(decoded):
                if image.shape != first.shape:
                    return None
                images[start + offset] = image
            start += len(values)
        return ArraySource(images, self.labels)


@dataclass
class LoadedData:
    train: ImageSource
    eval: ImageSource
    class_names: list[str]
    description: str


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


def _labels_and_names(splits: dict, label_column: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    from datasets import ClassLabel
    feature = next(iter(splits.values())).features[label_column]
    # Through Arrow: `ds[column]` is a lazy Column here, and building a tensor from it walked the
    # rows one by one (over a minute for CIFAR-10's 50,000 labels on a busy machine).
    values = {k: ds.with_format("arrow")[label_column].to_pylist() for k, ds in splits.items()}
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        return {k: torch.tensor(vs, dtype=torch.long) for k, vs in values.items()}, names
    distinct = sorted({v for vs in values.values() for v in vs})
    if all(isinstance(v, (int, np.integer)) for v in distinct):
        if distinct and min(distinct) < 0:
            raise UsageError(f"label column {label_column!r} holds negative labels; labels must "
                             f"be class indices 0..N-1 or class names")
        names = [str(i) for i in range(int(max(distinct)) + 1)] if distinct else []
        index = {v: int(v) for v in distinct}
    else:
        names = [str(v) for v in distinct]
        index = {v: i for i, v in enumerate(distinct)}
    return {k: torch.tensor([index[v] for v in vs], dtype=torch.long)
            for k, vs in values.items()}, names


def _quiet_datasets():
    """The `datasets` library, with its progress bars off: for files already on this disk they
    only say "Generating train split ... 100%", hundreds of carriage-return updates that fill
    log files and land above a one-line error."""
    import datasets
    datasets.disable_progress_bars()
    return datasets


def _load_local(data_dir: str):
    """A DatasetDict from a save_to_disk folder, a folder of parquet files, or an image folder."""
    datasets = _quiet_datasets()
    path = Path(data_dir)
    if not path.exists():
        raise UsageError(f"--data-dir {data_dir}: no such folder")
    if not path.is_dir():
        raise UsageError(f"--data-dir {data_dir} is a file; pass the folder that holds the data")
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        loaded = datasets.load_from_disk(str(path))
        return (loaded if isinstance(loaded, datasets.DatasetDict)
                else datasets.DatasetDict(train=loaded))
    parquet = sorted(path.glob("*.parquet")) + sorted(path.glob("data/*.parquet"))
    if parquet:
        files: dict[str, list[str]] = {}
        for file in parquet:
            stem = file.stem.split("-")[0].lower()
            split = stem if stem in ("train", *EVAL_SPLIT_NAMES) else "train"
            files.setdefault(split, []).append(str(file))
        return datasets.load_dataset("parquet", data_files=files)
    has_files = any(p.is_file() for p in path.rglob("*"))
    if not has_files:
        raise UsageError(f"--data-dir {data_dir} holds no files; expected parquet files, a "
                         f"save_to_disk folder or one subfolder of images per class")
    try:
        return datasets.load_dataset("imagefolder", data_dir=str(path))
    except Exception as err:  # the datasets library raises many types for unusable folders
        raise UsageError(f"--data-dir {data_dir} is not a dataset we can read ({err}); expected "
                         f"parquet files, a save_to_disk folder or class subfolders of "
                         f"images") from None


def _load_hub(name: str):
    datasets = _quiet_datasets()
    try:
        return datasets.load_dataset(name)
    except Exception as err:  # offline, unknown id, gated: all end the same way for the user
        offline = (os.environ.get("HF_DATASETS_OFFLINE") == "1"
                   or os.environ.get("HF_HUB_OFFLINE") == "1")
        reason = "offline mode is set" if offline else str(err).splitlines()[0][:200]
        raise UsageError(f"--dataset {name}: cannot load it from the Hugging Face hub ({reason}); "
                         f"with no network, pass --data-dir PATH to a local copy, or --dataset "
                         f"{SYNTHETIC_DATASET} for the embedded set") from None


def _pick_splits(dataset_dict, val_fraction: float):
    names = list(dataset_dict.keys())
    train_name = "train" if "train" in names else names[0]
    eval_name = next((n for n in EVAL_SPLIT_NAMES if n in names and n != train_name), None)
    train = dataset_dict[train_name]
    if eval_name is not None:
        return train, dataset_dict[eval_name], f"{train_name}/{eval_name}"
    if len(train) < 2:
        raise UsageError("the data has fewer than 2 images; nothing to hold out for evaluation")
    parts = train.train_test_split(test_size=val_fraction, seed=VAL_CARVE_SEED, shuffle=True)
    return parts["train"], parts["test"], f"{train_name} minus {val_fraction:.0%} held out"


def _limit(source: ImageSource, limit: Optional[int]) -> ImageSource:
    if limit is None or limit >= len(source):
        return source
    if isinstance(source, ArraySource):
        return ArraySource(source.images[:limit], source.labels[:limit])
    return HFSource(source.dataset.select(range(limit)), source.image_column,
                    source.labels[:limit], source.split)


def _synthetic(config: TrainConfig) -> LoadedData:
    parts = synthetic.splits(config.synthetic_train_size)

    def to_source(images, labels):
        return ArraySource(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
                           torch.from_numpy(labels))

    return LoadedData(to_source(*parts["train"]), to_source(*parts["test"]),
                      list(synthetic.CLASS_NAMES), "synthetic shapes (embedded)")


def load_data(config: TrainConfig) -> LoadedData:
    """Load, pick splits and columns, apply sample limits, decode into memory when worthwhile."""
    if config.data_dir is None and config.dataset == SYNTHETIC_DATASET:
        data = _synthetic(config)
        return LoadedData(_limit(data.train, config.max_train_samples),
                          _limit(data.eval, config.max_eval_samples), data.class_names,
                          data.description)
    from datasets import ClassLabel, Image as ImageFeature
    if config.data_dir is not None:
        dataset_dict, origin = _load_local(config.data_dir), config.data_dir
    else:
        dataset_dict, origin = _load_hub(config.dataset), config.dataset
    if len(dataset_dict) == 0 or all(len(split) == 0 for split in dataset_dict.values()):
        raise UsageError(f"{origin}: the dataset is empty")
    train, held_out, split_desc = _pick_splits(dataset_dict, config.val_fraction)
    if config.max_train_samples:
        train = train.select(range(min(config.max_train_samples, len(train))))
    if config.max_eval_samples:
        held_out = held_out.select(range(min(config.max_eval_samples, len(held_out))))
    image_column = _find_column(train, config.image_column, IMAGE_COLUMN_NAMES, ImageFeature,
                                "--image-column")
    label_column = _find_column(train, config.label_column, LABEL_COLUMN_NAMES, ClassLabel,
                                "--label-column")
    labels, class_names = _labels_and_names({"train": train, "eval": held_out}, label_column)
    if len(class_names) < 2:
        raise UsageError(f"{origin}: found {len(class_names)} class(es) in {label_column!r}; a "
                         f"classifier needs at least 2")
    sources = [HFSource(train, image_column, labels["train"], "train"),
               HFSource(held_out, image_column, labels["eval"], "held-out")]
    if config.in_memory != "never":
        limit = config.in_memory_limit_gb * 2**30
        decoded = [s.materialize(limit) for s in sources]
        if all(d is not None for d in decoded):
            sources = decoded
        elif config.in_memory == "always":
            raise UsageError("--in-memory always: the images do not share one size or exceed "
                             "--in-memory-limit-gb; use --in-memory auto or raise the limit")
    return LoadedData(sources[0], sources[1], class_names, f"{origin} ({split_desc})")
