"""Data a user hands to `accel_train.fit`: a map-style torch `Dataset` or a Hugging Face dataset,
each item an image (a PIL image, a uint8 or float CHW tensor, or an HWC numpy array) and a
label, made into the trainer's `LoadedData` so that everything the CLI does (in-memory
decoding, the batched small-image path, seeded augmentation, exact resume) applies to it
unchanged.

Items may be `(image, label)` pairs or dicts (the image and label found under the usual column
names, as for Hugging Face datasets). Float images are taken to lie in [0, 1], the convention of
torchvision's `ToTensor`, and stored as uint8 like every other source: the pipeline works on
uint8 pixels until normalisation.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import torch
from PIL import Image

from accel_train.base.errors import UsageError, first_few
from accel_train.base.randomness import seeded
from accel_train.data.sample_limits import kept_positions, subset_if_cut
from accel_train.data.decode import Unreadable, decode
from accel_train.data.carve import carve_description, carve_name, carve_rows
from accel_train.data.sources import (IMAGE_COLUMN_NAMES, LABEL_COLUMN_NAMES, ArraySource,
                                      ImageSource, LoadedData, held_in_memory)


def as_uint8_chw(value: Any, where: str) -> torch.Tensor:
    """One image as a uint8 [3, H, W] tensor (grey images repeated to three channels).  A PIL
    image becomes what its file becomes on the command line (decode.py: EXIF orientation
    applied, transparency over white, 16-bit and float gray scaled), so that a model fit() trained
    sees its photos as `predict` and `eval` show them to it; a plain convert("RGB") would train
    on a phone's photos lying on their side."""
    if isinstance(value, Image.Image):
        try:
            return decode(value).contiguous()
        except Unreadable as err:
            raise UsageError(f"{where}: the image cannot be decoded ({err.reason})") from None
    if isinstance(value, np.ndarray):
        if value.ndim == 3 and value.shape[-1] == 4:
            # a fourth channel is alpha (np.asarray of an RGBA PNG): over white, as decode()
            # puts the same file's transparent pixels for predict and eval; dropping it trained
            # on whatever colour the file kept under them (often black)
            if value.dtype == np.uint8:
                return as_uint8_chw(Image.fromarray(value, "RGBA"), where)
            alpha = value[..., 3:]
            if np.issubdtype(value.dtype, np.floating) and 0 <= alpha.min() <= alpha.max() <= 1:
                value = value[..., :3] * alpha + (1 - alpha)  # (other floats: refused below)
        if value.ndim == 3 and value.shape[-1] in (1, 3, 4):
            # numpy's images are height, width, channels (np.asarray of a PIL image, imageio,
            # matplotlib)
            value = np.moveaxis(value[..., :3], -1, 0)
        value = torch.tensor(value)  # a copy: np.asarray of a PIL image is read-only
    if not isinstance(value, torch.Tensor) or value.dim() not in (2, 3):
        raise UsageError(f"{where}: an image must be a PIL image, a CHW tensor or an HWC numpy "
                         f"array, got "
                         f"{type(value).__name__}{tuple(getattr(value, 'shape', ()))}")
    image = value.unsqueeze(0) if value.dim() == 2 else value
    if image.shape[0] not in (1, 3):
        raise UsageError(f"{where}: a tensor image must be channels-first (C, H, W) with 1 or 3 "
                         f"channels, got shape {tuple(value.shape)}")
    if image.is_floating_point():
        low, high = float(image.min()), float(image.max())
        if low < 0 or high > 1:  # 0-255 floats, or already normalized: clamped, they were lost
            hint = ("0-255 values: divide by 255, or pass uint8" if high > 1 and low >= 0 else
                    "normalized values: pass the images before normalization (the run "
                    "normalizes with its own mean and std)")
            raise UsageError(f"{where}: a float image must hold values in 0-1, got {low:g} to "
                             f"{high:g} ({hint})")
        image = (image * 255).round().to(torch.uint8)
    elif image.dtype != torch.uint8:
        raise UsageError(f"{where}: integer images must be uint8 (0-255), got {image.dtype}")
    return image.expand(3, -1, -1).contiguous() if image.shape[0] == 1 else image.contiguous()


def split_item(item: Any, where: str) -> tuple[Any, Any]:
    """(image, label) of one item: a pair, or a dict with an image and a label column."""
    if isinstance(item, dict):
        image_key = next((k for k in IMAGE_COLUMN_NAMES if k in item), None)
        label_key = next((k for k in LABEL_COLUMN_NAMES if k in item), None)
        if image_key is None or label_key is None:
            raise UsageError(f"{where}: a dict item needs an image under one of "
                             f"{', '.join(IMAGE_COLUMN_NAMES)} and a label under one of "
                             f"{', '.join(LABEL_COLUMN_NAMES)}; it has {', '.join(item)}")
        return item[image_key], item[label_key]
    if isinstance(item, (tuple, list)) and len(item) >= 2:
        return item[0], item[1]
    raise UsageError(f"{where}: each item must be (image, label) or a dict with both, got "
                     f"{type(item).__name__}")


def labels_of(dataset, name: str) -> torch.Tensor:
    """Every label of the dataset: from `targets` (torchvision's datasets), a label column (Hugging
    Face's), else read item by item (which also reads each image once)."""
    targets = getattr(dataset, "targets", None)
    if targets is None and hasattr(dataset, "column_names"):
        column = next((c for c in LABEL_COLUMN_NAMES if c in dataset.column_names), None)
        targets = dataset[column] if column is not None else None
    if targets is None:
        targets = [split_item(dataset[i], f"{name}[{i}]")[1] for i in range(len(dataset))]
    labels = torch.as_tensor([class_index(t, name) for t in targets], dtype=torch.long)
    if len(labels) and labels.min() < 0:
        raise UsageError(f"{name}: labels must be class indices 0..N-1, found {labels.min()}")
    return labels


def class_index(label: Any, name: str) -> int:
    """One label as a class index. int() alone would truncate a fractional label (a soft label's
    0.7 became class 0 and trained silently), so the value must survive the conversion."""
    shape = tuple(label.shape) if hasattr(label, "shape") else np.shape(label)
    if math.prod(shape) != 1:
        raise UsageError(f"{name}: each label must be one class index, found a "
                         f"{type(label).__name__} of shape {shape} (one-hot or soft labels?); "
                         f"pass the class index, say label.argmax()")
    value = label.item() if hasattr(label, "item") else label  # numpy's int() takes 0-d only
    try:
        index = int(value)
        exact = float(value) == index
    except (TypeError, ValueError):
        raise UsageError(f"{name}: labels must be class indices 0..N-1 (integers), found "
                         f"{repr(label)[:40]} ({type(label).__name__}); map class names to "
                         f"indices, say {{name: i for i, name in enumerate(sorted(names))}}, "
                         f"and pass the names in that order as the dataset's `classes`") from None
    if not exact:
        raise UsageError(f"{name}: labels must be class indices 0..N-1 (integers), found "
                         f"{float(value):g}, which is not a whole number; pass each image's class "
                         f"index (for soft targets, label_smoothing= smooths the one-hot ones)")
    return index


def declared_names(dataset) -> Optional[list[str]]:
    """The class names a dataset declares: torchvision's `classes`, a Hugging Face ClassLabel's
    names; None where it declares none (a count or a mapping of one's own is not names)."""
    names = getattr(dataset, "classes", None)
    if not isinstance(names, (list, tuple)):
        names = None
    features = getattr(dataset, "features", None) or {}
    for column in LABEL_COLUMN_NAMES:
        if names is None and hasattr(features.get(column), "names"):
            names = features[column].names
    return None if names is None else [str(name) for name in names]


def eval_labels_by_name(train_dataset, eval_dataset, eval_labels: torch.Tensor
                        ) -> tuple[torch.Tensor, bool]:
    """eval_dataset's labels as train_dataset's class indices, where both declare their class
    names and these differ: two torchvision ImageFolders whose val/ lacks a class number the
    classes after it otherwise (val's fox 1 is train's dog 1), and every evaluation scored the
    model against the wrong classes without a word.  Returns the labels and whether they were
    matched by name; a class train_dataset does not name is one line."""
    train_names, eval_names = declared_names(train_dataset), declared_names(eval_dataset)
    if train_names is None or eval_names is None or eval_names == train_names:
        return eval_labels, False
    index = {name: i for i, name in enumerate(train_names)}
    for label in sorted(set(eval_labels.tolist())):
        name = eval_names[label] if label < len(eval_names) else None
        if name not in index:
            what = f"class {name!r}" if name is not None else f"label {label}, past its names,"
            raise UsageError(f"eval_dataset: its {what} is not one of train_dataset's classes "
                             f"({first_few(train_names)}): the model cannot be scored on a "
                             f"class it does not train on; leave those items out of "
                             f"eval_dataset")
    by_name = torch.tensor([index.get(name, -1) for name in eval_names], dtype=torch.long)
    return by_name[eval_labels], True


def class_names_of(dataset, labels: Sequence[torch.Tensor],
                   parts: Sequence[str] = ("train_dataset", "eval_dataset")) -> list[str]:
    """The declared names (declared_names), else the indices as text.  A label past the names
    is one line naming its item: the model would otherwise be built for more classes than the
    data names, and refused as the wrong shape."""
    names = declared_names(dataset)
    count = max(int(part.max()) + 1 for part in labels if len(part))
    if names is not None and len(names) < count:
        part, values = next((name, values) for name, values in zip(parts, labels)
                            if len(values) and int(values.max()) >= len(names))
        index = int((values >= len(names)).nonzero()[0])
        raise UsageError(f"{part}[{index}]: label {int(values[index])} is past the dataset's "
                         f"{len(names)} class names ({first_few(map(str, names))}: labels "
                         f"0..{len(names) - 1}); "
                         f"fix the label, or add its class to the names")
    if names is not None:
        return names
    return [str(i) for i in range(count)]


class DatasetSource(ImageSource):
    """The items of a user's dataset at `indices`, each image read when asked for."""

    def __init__(self, dataset, all_labels: torch.Tensor, indices: np.ndarray, name: str):
        self.dataset, self.indices, self.name = dataset, np.asarray(indices, np.int64), name
        self.all_labels = all_labels  # the whole dataset's, for subsets of this one
        self.labels = all_labels[torch.from_numpy(self.indices)]
        self.not_held = ""  # why materialize held nothing, for --in-memory always's message

    def image(self, index: int) -> torch.Tensor:
        row = int(self.indices[index])
        where = f"{self.name}[{row}]"
        return as_uint8_chw(split_item(self.dataset[row], where)[0], where)

    def materialize(self, limit_bytes: float) -> Optional[ArraySource]:
        """Every image decoded once (the fast paths need that); None, with the reason in
        `not_held`, where there are none, the sizes differ, or they would take more than
        `limit_bytes` (as the command line's sources do)."""
        if len(self) == 0:
            self.not_held = f"{self.name} holds no images"
            return None
        first = self.image(0)
        if first.numel() * len(self) > limit_bytes:
            self.not_held = (f"the {len(self)} images of {self.name} take "
                             f"{first.numel() * len(self) / 2**30:.3g} GiB, over the "
                             f"{max(0.0, limit_bytes) / 2**30:.3g} GiB left of "
                             f"--in-memory-limit-gb")
            return None
        images = torch.empty((len(self), *first.shape), dtype=torch.uint8)
        for index in range(len(self)):
            image = self.image(index)
            if image.shape != first.shape:
                self.not_held = (f"the images of {self.name} differ in size "
                                 f"({'x'.join(map(str, first.shape[1:]))} and "
                                 f"{'x'.join(map(str, image.shape[1:]))}, height x width)")
                return None
            images[index] = image
        return ArraySource(images, self.labels)


def changes_when_read(source: DatasetSource, reads: int = 8) -> bool:
    """Whether an item's image differs between reads with the global generators (Python's,
    numpy's, torch's) seeded apart: the dataset applies a random transform of its own
    (torchvision's RandomResizedCrop, an albumentations pipeline).  Eight reads of the first
    item, then of the middle one: a flat or symmetric first image hides a shift or a flip, and
    a flip of probability 0.5 alone leaves eight reads alike once in 128 transforms."""
    for position in sorted({0, len(source) // 2}):
        with seeded(1):
            first = source.image(position)
        for key in range(2, reads + 1):
            with seeded(key):
                again = source.image(position)
            if first.shape != again.shape or not torch.equal(first, again):
                return True
    return False


def refuse_random_items(train: DatasetSource, held_out: DatasetSource, config) -> bool:
    """A dataset with a random transform of its own (the torchvision tutorials' training
    transform) would train on one frozen draw where its images are held in memory, under the
    run's own augmentation on top; its own augmentation alone is kept with augment=False and
    in_memory='never' (then True: the training images' reads draw at random).  Validation needs
    the same images at every evaluation."""
    random_train = changes_when_read(train)
    if random_train and (config.augment or config.in_memory != "never"):
        raise UsageError("train_dataset: its images change each time they are read (a random "
                         "transform of its own: RandomResizedCrop, RandomHorizontalFlip, ...); "
                         "the run augments the images itself, and held in memory yours would "
                         "be one draw: give the dataset no random transform (PIL images, or "
                         "Resize alone), or keep yours with augment=False and in_memory='never'")
    if changes_when_read(held_out):
        where = ("eval_dataset" if held_out.dataset is not train.dataset else
                 "train_dataset's held-out part (val_fraction)")
        raise UsageError(f"{where}: its images change each time they are read (a random "
                         f"transform of its own), and validation must score the same images "
                         f"at every evaluation: pass eval_dataset= a dataset with a "
                         f"deterministic transform (Resize and CenterCrop, or none)")
    return random_train


def kept_items(source: DatasetSource, limit: Optional[int], how: str) -> DatasetSource:
    """--max-train-samples / --max-eval-samples: the items `limit` keeps, as of the CLI's data."""
    kept = kept_positions(len(source), limit, how)
    if kept is None:
        return source
    return DatasetSource(source.dataset, source.all_labels, source.indices[kept], source.name)


def load_user_data(train_dataset, eval_dataset: Optional[Any], config) -> LoadedData:
    """The trainer's data from the user's datasets; without `eval_dataset`, --val-fraction of the
    training set is carved off for validation with the CLI's fixed seed."""
    for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if dataset is not None and not (hasattr(dataset, "__getitem__")
                                        and hasattr(dataset, "__len__")):
            raise UsageError(f"{name}: a map-style dataset is needed (__getitem__ and __len__); "
                             f"got {type(dataset).__name__}")
    train_labels = labels_of(train_dataset, "train_dataset")
    if eval_dataset is None:
        train_rows, eval_rows = carve_rows(len(train_dataset), config.val_fraction, train_labels,
                                           config.val_stratify)
        train = DatasetSource(train_dataset, train_labels, train_rows, "train_dataset")
        held_out = DatasetSource(train_dataset, train_labels, eval_rows, "train_dataset")
        description = (f"train_dataset minus {100 * config.val_fraction:.3g}% held out"
                       + carve_description(len(train_dataset), config.val_fraction, eval_rows,
                                           config.val_stratify))
        all_labels = [train_labels]
    else:
        eval_labels, matched = eval_labels_by_name(
            train_dataset, eval_dataset, labels_of(eval_dataset, "eval_dataset"))
        train = DatasetSource(train_dataset, train_labels, np.arange(len(train_dataset)),
                              "train_dataset")
        held_out = DatasetSource(eval_dataset, eval_labels, np.arange(len(eval_dataset)),
                                 "eval_dataset")
        description = "train_dataset/eval_dataset" + (
            ", eval_dataset's classes matched to train_dataset's by name" if matched else "")
        all_labels = [train_labels, eval_labels]
    if len(train) == 0:
        raise UsageError("train_dataset: it holds no items to train on")
    if len(held_out) == 0:  # only a given eval_dataset can be empty: a carve holds one or more
        raise UsageError("eval_dataset: it holds no items to evaluate on; pass one that does, "
                         "or none (then val_fraction of train_dataset is held out)")
    if eval_dataset is not None:
        unseen = sorted(set(eval_labels.unique().tolist()) - set(train_labels.unique().tolist()))
        if unseen:
            raise UsageError(f"eval_dataset: its labels hold {first_few(map(str, unseen))}, "
                             f"which no item of train_dataset has: the model would be scored on "
                             f"classes it "
                             f"never trains on; give train_dataset items of those classes, or "
                             f"leave them out of eval_dataset")
    class_names = class_names_of(train_dataset, all_labels)
    if len(class_names) < 2:
        raise UsageError(f"train_dataset: found {len(class_names)} class(es); a classifier "
                         f"needs at least 2")
    cut = subset_if_cut(config, (len(train), config.max_train_samples),
                        (len(held_out), config.max_eval_samples))
    train, held_out = (kept_items(train, config.max_train_samples, config.sample_subset),
                       kept_items(held_out, config.max_eval_samples, config.sample_subset))
    train.reads_randomly = refuse_random_items(train, held_out, config)
    if config.in_memory != "never":
        train, held_out = held_in_memory([train, held_out], config) or (train, held_out)
    return LoadedData(train, held_out, class_names, f"{type(train_dataset).__name__} "
                                                    f"({description})", from_program=True,
                      sample_subset=cut,
                      held_out_carve=carve_name(config.val_stratify)
                      if eval_dataset is None else None)
