"""The datasets a program hands to fit(), read as the run reads them: items as pairs, lists,
triples or dicts; labels from `targets`, a Hugging Face label column or the items; class names
from `classes` or a ClassLabel; the held-out part carved or given; the images decoded into
memory where they fit.  Oracles: the items as the test wrote them, torchvision's pil_to_tensor,
and hand-counted sizes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2
from torchvision.transforms.functional import pil_to_tensor

from accel_train.base.errors import UsageError
from accel_train.config import TrainConfig
from accel_train.data.loaders import TrainImages
from accel_train.data.sources import ArraySource
from accel_train.data.transforms import ImageTransform
from accel_train.data.user_data import (DatasetSource, as_uint8_chw, class_names_of,
                                        labels_of, load_user_data, split_item)


def pixels(index: int, size: int = 6) -> torch.Tensor:
    """Item `index`'s image: uint8 CHW, each item's own."""
    return (torch.arange(3 * size * size).view(3, size, size) * (index + 1) % 256).to(torch.uint8)


class Items(Dataset):
    """`count` items, item i of label i % classes, in the form `shape` says."""

    def __init__(self, count: int, classes: int = 2, shape=lambda image, label: (image, label)):
        self.count, self.num_classes, self.shape = count, classes, shape

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return self.shape(pixels(index), index % self.num_classes)


def all_images(source) -> torch.Tensor:
    return torch.stack([source.image(i) for i in range(len(source))])


@pytest.mark.parametrize("shape", [lambda image, label: (image, label),
                                   lambda image, label: [image, label],
                                   lambda image, label: (image, label, "extra"),
                                   lambda image, label: {"image": image, "label": label},
                                   lambda image, label: {"img": image, "fine_label": label,
                                                         "id": 7},
                                   lambda image, label: {"pixel_values": image, "labels": label}],
                         ids=["pair", "list", "triple", "dict", "dict-cifar100", "dict-hf"])
def test_every_item_form_gives_the_items_images_and_labels(shape):
    dataset = Items(8, shape=shape)
    data = load_user_data(dataset, Items(4, shape=shape), TrainConfig(in_memory="never"))
    assert torch.equal(all_images(data.train), torch.stack([pixels(i) for i in range(8)]))
    assert data.train.labels.tolist() == [0, 1] * 4
    assert torch.equal(all_images(data.held_out), torch.stack([pixels(i) for i in range(4)]))
    assert data.class_names == ["0", "1"] and data.from_program
    assert data.description == "Items (train_dataset/eval_dataset)"


def test_items_that_are_neither_pairs_nor_dicts_with_both_are_one_line():
    with pytest.raises(UsageError) as refused:
        split_item({"image": pixels(0), "caption": "a cat"}, "train_dataset[3]")
    assert str(refused.value) == (
        "train_dataset[3]: a dict item needs an image under one of img, image, images, "
        "pixel_values, picture, jpg, png, webp and a label under one of label, labels, "
        "fine_label, coarse_label, class, target, y; it has image, caption")
    with pytest.raises(UsageError, match=r"a dict item needs .*; it has label$"):
        split_item({"label": 1}, "train_dataset[0]")
    for item in ((pixels(0),), pixels(0), 5):
        with pytest.raises(UsageError) as refused:
            split_item(item, "train_dataset[2]")
        assert str(refused.value) == ("train_dataset[2]: each item must be (image, label) or a "
                                      f"dict with both, got {type(item).__name__}")


def test_without_an_eval_dataset_the_held_out_part_is_carved_from_the_training_items():
    data = load_user_data(Items(20), None, TrainConfig(in_memory="never", val_fraction=0.25))
    train, held_out = data.train.indices.tolist(), data.held_out.indices.tolist()
    assert len(held_out) == 5 and sorted(train + held_out) == list(range(20))  # ceil(20 x 0.25)
    assert torch.equal(all_images(data.held_out), torch.stack([pixels(i) for i in held_out]))
    assert data.held_out.labels.tolist() == [i % 2 for i in held_out]
    assert data.description == "Items (train_dataset minus 25% held out)"


class Targets(Items):
    """Items whose labels are `targets` (torchvision's attribute), images as Items'."""

    def __init__(self, targets):
        super().__init__(len(targets))
        self.targets = targets

    def __getitem__(self, index):
        return pixels(index), self.targets[index]


def test_a_carve_holding_a_class_out_whole_trains_on_its_first_held_out_item():
    """datasets' own draw, called here, holds out both items of class 3 at 0.68 of 83; fit()'s
    carve gives the first of them back for training (the model would never learn class 3)."""
    from datasets import Dataset as HFDataset
    targets = [0] * 40 + [1] * 40 + [2] + [3, 3]
    draw = HFDataset.from_dict({"row": list(range(83))}).train_test_split(
        test_size=0.68, seed=0, shuffle=True)
    plain_held = list(draw["test"]["row"])
    assert {81, 82} <= set(plain_held)
    back = 81 if plain_held.index(81) < plain_held.index(82) else 82
    data = load_user_data(Targets(targets), None, TrainConfig(in_memory="never",
                                                             val_fraction=0.68))
    assert data.train.indices.tolist() == list(draw["train"]["row"]) + [back]
    assert data.held_out.indices.tolist() == [row for row in plain_held if row != back]
    assert sorted(set(data.train.labels.tolist())) == [0, 1, 2, 3]
    assert "1 held-out image(s) trained on instead" in data.description



def test_val_stratify_carves_a_programs_items_class_by_class():
    """90 items of class 0 and 10 of class 1, 0.2 held out: class by class exactly 18 and 2
    (by hand), as fit(val_stratify=True) asks; the start says so and records it."""
    data = load_user_data(Targets([0] * 90 + [1] * 10), None, TrainConfig(
        in_memory="never", val_fraction=0.2, val_stratify=True))
    assert np.bincount(data.held_out.labels.numpy()).tolist() == [18, 2]
    assert sorted(data.train.indices.tolist() + data.held_out.indices.tolist()) == \
        list(range(100))
    assert data.description == ("Targets (train_dataset minus 20% held out, class by class "
                                "(--val-stratify))")
    assert data.held_out_carve == "stratified"
    given = load_user_data(Items(8), Items(4), TrainConfig(in_memory="never", val_stratify=True))
    assert given.held_out_carve is None  # an eval_dataset of the program's: nothing carved

class LabelsOnly(Items):
    """torchvision's way: the labels in `targets`, read without touching an image."""

    def __init__(self, targets):
        super().__init__(len(targets))
        self.targets = targets

    def __getitem__(self, index):
        raise AssertionError("labels are read from targets, not from the items")


def test_labels_come_from_targets_a_label_column_or_the_items():
    assert labels_of(LabelsOnly([1, 0, 2]), "train_dataset").tolist() == [1, 0, 2]
    from datasets import Dataset as HFDataset
    columns = HFDataset.from_dict({"img": [[0]] * 3, "coarse_label": [2, 0, 1]})
    assert labels_of(columns, "train_dataset").tolist() == [2, 0, 1]
    assert labels_of(Items(5, classes=3), "train_dataset").tolist() == [0, 1, 2, 0, 1]
    # numpy and 0-d tensor labels are indices too
    assert labels_of(LabelsOnly([np.int64(1), torch.tensor(0)]), "x").tolist() == [1, 0]
    with pytest.raises(UsageError) as refused:
        labels_of(LabelsOnly([0, -1, 1]), "eval_dataset")
    assert str(refused.value) == "eval_dataset: labels must be class indices 0..N-1, found -1"
    with pytest.raises(UsageError, match=r"^train_dataset: labels must be class indices 0\.\.N-1 "
                                         r"\(integers\), found None \(NoneType\); map class names"):
        labels_of(LabelsOnly([0, None]), "train_dataset")
    with pytest.raises(UsageError) as refused:  # a long name: its first 40 characters
        labels_of(LabelsOnly(["n02085620-" + "Chihuahua" * 8]), "train_dataset")
    assert str(refused.value).startswith(
        "train_dataset: labels must be class indices 0..N-1 (integers), found "
        "'n02085620-ChihuahuaChihuahuaChihuahuaCh (str); map class names")


@pytest.mark.parametrize("label", [0.7, np.float64(2.5), torch.tensor(1.25)])
def test_a_fractional_label_is_refused_rather_than_truncated(label):
    # int() alone turned 0.7 into class 0: a soft label would have trained as a wrong hard one
    with pytest.raises(UsageError) as refused:
        labels_of(LabelsOnly([1, label]), "train_dataset")
    assert str(refused.value) == (
        f"train_dataset: labels must be class indices 0..N-1 (integers), found {float(label):g}, "
        "which is not a whole number; pass each image's class index (for soft targets, "
        "label_smoothing= smooths the one-hot ones)")


def test_whole_floats_and_one_element_labels_are_the_indices_they_hold():
    held = [2.0, np.float32(1.0), torch.tensor([3]), np.array([0]), torch.tensor(4.0)]
    assert labels_of(LabelsOnly(held), "train_dataset").tolist() == [2, 1, 3, 0, 4]


@pytest.mark.parametrize("label, kind, shape", [
    (torch.tensor([0.0, 1.0, 0.0]), "Tensor", (3,)), (np.eye(4)[2], "ndarray", (4,)),
    ([0, 1], "list", (2,)), (torch.zeros(0), "Tensor", (0,))])
def test_a_one_hot_label_is_one_line_naming_its_shape(label, kind, shape):
    with pytest.raises(UsageError) as refused:
        labels_of(LabelsOnly([label]), "eval_dataset")
    assert str(refused.value) == (
        f"eval_dataset: each label must be one class index, found a {kind} of shape {shape} "
        "(one-hot or soft labels?); pass the class index, say label.argmax()")


class Named(Items):
    classes = ["cat", "dog", "eel"]


def test_class_names_come_from_classes_or_a_class_label_else_the_indices():
    labels = [torch.tensor([0, 1]), torch.tensor([2])]  # the largest label of either part counts
    assert class_names_of(Named(3), labels) == ["cat", "dog", "eel"]
    from datasets import ClassLabel, Dataset as HFDataset, Features, Value
    columns = HFDataset.from_dict({"x": [0, 1, 2], "label": [0, 1, 2]}, features=Features(
        {"x": Value("int64"), "label": ClassLabel(names=["a", "b", "c"])}))
    assert class_names_of(columns, labels) == ["a", "b", "c"]
    assert class_names_of(Items(3), labels) == ["0", "1", "2"]
    # a label past the names: a wrong label (not a model of the wrong size), named
    with pytest.raises(UsageError) as caught:
        class_names_of(Named(3), [torch.tensor([0, 1, 2]), torch.tensor([1, 2, 9, 5])])
    assert str(caught.value) == ("eval_dataset[2]: label 9 is past the dataset's 3 class names "
                                 "(cat, dog, eel: labels 0..2); fix the label, or add its class "
                                 "to the names")
    assert class_names_of(Items(3), [torch.tensor([], dtype=torch.long), torch.tensor([1])]) \
        == ["0", "1"]
    # a `classes` of the dataset's own that holds no names (a count): the indices
    counted = Items(3)
    counted.classes = 3
    assert class_names_of(counted, labels) == ["0", "1", "2"]


def test_images_are_decoded_into_memory_where_they_fit_and_share_one_size():
    source = DatasetSource(Items(4), torch.tensor([0, 1, 0, 1]), np.array([3, 1]), "train_dataset")
    per_image = 3 * 6 * 6
    kept = source.materialize(limit_bytes=2 * per_image)  # exactly the two images' bytes
    assert isinstance(kept, ArraySource) and kept.images.dtype == torch.uint8
    assert torch.equal(kept.images, torch.stack([pixels(3), pixels(1)]))
    assert kept.labels.tolist() == [1, 1]
    assert source.materialize(limit_bytes=2 * per_image - 1) is None
    assert source.not_held == ("the 2 images of train_dataset take 2.01e-07 GiB, over the "
                               "2e-07 GiB left of --in-memory-limit-gb")  # 216 and 215 bytes

    class TwoSizes(Items):
        def __getitem__(self, index):
            return pixels(index, size=6 if index == 0 else 8), 0

    mixed = DatasetSource(TwoSizes(2), torch.tensor([0, 0]), np.arange(2), "eval_dataset")
    assert mixed.materialize(limit_bytes=1e9) is None
    assert mixed.not_held == ("the images of eval_dataset differ in size (6x6 and 8x8, height x "
                              "width)")
    empty = DatasetSource(Items(2), torch.tensor([0, 1]), np.arange(0), "eval_dataset")
    assert empty.materialize(limit_bytes=1e9) is None
    assert empty.not_held == "eval_dataset holds no images"


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_both_parts_are_held_on_one_budget_or_neither(mode):
    """--in-memory-limit-gb is one budget for the training and held-out images together, as
    for the command line's data: 8 + 4 images of 108 bytes fit in 1296 bytes and not in one
    byte less, where the held-out part would still fit alone."""
    per_image = 3 * 6 * 6
    fits = load_user_data(Items(8), Items(4), TrainConfig(
        in_memory=mode, in_memory_limit_gb=12 * per_image / 2**30))
    assert isinstance(fits.train, ArraySource) and isinstance(fits.held_out, ArraySource)
    assert torch.equal(fits.held_out.images, torch.stack([pixels(i) for i in range(4)]))
    tight = TrainConfig(in_memory=mode, in_memory_limit_gb=(12 * per_image - 1) / 2**30)
    if mode == "auto":
        read = load_user_data(Items(8), Items(4), tight)
        assert isinstance(read.train, DatasetSource) and isinstance(read.held_out, DatasetSource)
        return
    with pytest.raises(UsageError) as refused:
        load_user_data(Items(8), Items(4), tight)
    assert str(refused.value) == (
        "--in-memory always: the data cannot be held in memory: the 4 images of eval_dataset "
        "take 4.02e-07 GiB, over the 4.01e-07 GiB left of --in-memory-limit-gb; use "
        "--in-memory auto (or never) to decode the images per step")
    # the training images take the whole budget: none is left for the held-out ones
    with pytest.raises(UsageError, match=r"the 4 images of eval_dataset take 4\.02e-07 GiB, "
                                         r"over the 0 GiB left of --in-memory-limit-gb"):
        load_user_data(Items(8), Items(4), TrainConfig(
            in_memory=mode, in_memory_limit_gb=8 * per_image / 2**30))


def test_a_broken_image_names_the_item_it_came_from():
    class Broken(Items):
        def __getitem__(self, index):
            return torch.zeros(5, 4, 4, dtype=torch.uint8), 0

    source = DatasetSource(Broken(9), torch.zeros(9, dtype=torch.long), np.array([7]),
                           "eval_dataset")
    with pytest.raises(UsageError) as refused:
        source.image(0)
    assert str(refused.value) == ("eval_dataset[7]: a tensor image must be channels-first "
                                  "(C, H, W) with 1 or 3 channels, got shape (5, 4, 4)")


class Sized:
    """A length and no items."""

    def __len__(self):
        return 3


@pytest.mark.parametrize("train, held_out, said", [
    (iter([]), None, "train_dataset: a map-style dataset is needed (__getitem__ and __len__); "
                     "got list_iterator"),
    (Items(8), (x for x in []), "eval_dataset: a map-style dataset is needed (__getitem__ and "
                                "__len__); got generator"),
    (Sized(), None, "train_dataset: a map-style dataset is needed (__getitem__ and __len__); "
                    "got Sized"),
    (Items(8), Items(0), "eval_dataset: it holds no items to evaluate on; pass one that does, "
                        "or none (then val_fraction of train_dataset is held out)"),
    (Items(8), Items(3, classes=3), "eval_dataset: its labels hold 2, which no item of "
                                    "train_dataset has"),
    (Items(8, classes=1), Items(2, classes=1), "train_dataset: found 1 class(es); a classifier "
                                               "needs at least 2"),
    (Items(0), Items(2), "train_dataset: it holds no items to train on"),
], ids=["train-iterator", "eval-generator", "length-only", "eval-empty", "eval-unseen-class",
        "one-class", "train-empty"])
def test_datasets_the_run_cannot_use_are_one_line(train, held_out, said):
    with pytest.raises(UsageError) as refused:
        load_user_data(train, held_out, TrainConfig(in_memory="never"))
    assert str(refused.value).startswith(said), str(refused.value)


class Broken(Items):
    """Item 5 has no label under a known name; its label is read from `targets`, its image
    only when the run asks for it."""

    @property
    def targets(self):
        return [i % 2 for i in range(self.count)]

    def __getitem__(self, index):
        return {"picture": pixels(index)} if index == 5 else (pixels(index), index % 2)


def test_a_bad_item_is_named_by_its_dataset_and_position_however_the_parts_were_made():
    # (item 5 is not the first of its part: the start reads each part's first item)
    carved = load_user_data(Broken(10), None, TrainConfig(in_memory="never", val_fraction=0.3))
    given = load_user_data(Items(10), Broken(8), TrainConfig(in_memory="never"))
    cut = load_user_data(Broken(10), Items(4), TrainConfig(
        in_memory="never", max_train_samples=8, sample_subset="first"))
    carved_part = next(p for p in (carved.train, carved.held_out) if 5 in p.indices.tolist())
    for source in (carved_part, given.held_out, cut.train):
        position = source.indices.tolist().index(5)
        with pytest.raises(UsageError) as refused:
            source.image(position)
        dataset = "eval_dataset" if source is given.held_out else "train_dataset"
        assert str(refused.value).startswith(f"{dataset}[5]: a dict item needs an image under "
                                             f"one of img, "), str(refused.value)
    with pytest.raises(UsageError, match=r"^eval_dataset: labels must be class indices 0\.\.N-1 "
                                         r"\(integers\), found 'cat'"):
        load_user_data(Items(8), LabelsOnly([0, "cat"]), TrainConfig(in_memory="never"))


def test_the_training_datasets_class_names_name_the_classes():
    data = load_user_data(Named(6, classes=3), Items(3, classes=3), TrainConfig(in_memory="never"))
    assert data.class_names == ["cat", "dog", "eel"]


def test_the_sample_limits_cut_the_users_items_and_record_how():
    data = load_user_data(Items(20), Items(10), TrainConfig(
        in_memory="never", max_train_samples=6, max_eval_samples=3, sample_subset="first"))
    assert data.train.indices.tolist() == list(range(6))
    assert data.held_out.indices.tolist() == [0, 1, 2]
    assert torch.equal(all_images(data.train), torch.stack([pixels(i) for i in range(6)]))
    assert data.sample_subset == "first"
    train_only = load_user_data(Items(20), Items(10), TrainConfig(
        in_memory="never", max_train_samples=6, sample_subset="first"))
    assert train_only.sample_subset == "first" and len(train_only.held_out) == 10
    whole = load_user_data(Items(20), Items(10), TrainConfig(in_memory="never"))
    assert whole.sample_subset is None and len(whole.train) == 20 and len(whole.held_out) == 10


def test_in_memory_always_holds_every_image_and_never_holds_none():
    held = load_user_data(Items(8), Items(4), TrainConfig(in_memory="always"))
    assert isinstance(held.train, ArraySource) and isinstance(held.held_out, ArraySource)
    assert torch.equal(held.train.images, torch.stack([pixels(i) for i in range(8)]))
    read = load_user_data(Items(8), Items(4), TrainConfig(in_memory="never"))
    assert isinstance(read.train, DatasetSource) and isinstance(read.held_out, DatasetSource)


def test_integer_images_other_than_uint8_and_non_images_are_one_line():
    with pytest.raises(UsageError) as refused:
        as_uint8_chw(torch.zeros(3, 4, 4, dtype=torch.int32), "train_dataset[1]")
    assert str(refused.value) == ("train_dataset[1]: integer images must be uint8 (0-255), got "
                                  "torch.int32")
    for value, named in (("cat.jpg", "str()"), (torch.zeros(1, 3, 4, 4), "Tensor(1, 3, 4, 4)"),
                         (torch.zeros(4), "Tensor(4,)")):
        with pytest.raises(UsageError) as refused:
            as_uint8_chw(value, "train_dataset[0]")
        assert str(refused.value) == ("train_dataset[0]: an image must be a PIL image, a CHW "
                                      f"tensor or an HWC numpy array, got {named}")
    with pytest.raises(UsageError) as refused:
        as_uint8_chw(torch.tensor([[[-0.5, 0.5]]]), "train_dataset[0]")
    assert str(refused.value) == (
        "train_dataset[0]: a float image must hold values in 0-1, got -0.5 to 0.5 (normalized "
        "values: pass the images before normalization (the run normalizes with its own mean and "
        "std))")
    assert as_uint8_chw(torch.full((3, 2, 2), 0.5), "x").dtype == torch.uint8
    grey = np.asarray(Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4)))
    assert torch.equal(as_uint8_chw(grey[..., None], "x"),  # (H, W, 1): numpy's grey channel
                       pil_to_tensor(Image.fromarray(grey).convert("RGB")))


class Transformed(Items):
    """Items(count) as PIL images through `transform`, as torchvision's datasets apply one."""

    def __init__(self, count: int, transform):
        super().__init__(count)
        self.transform = transform

    def __getitem__(self, index):
        image = Image.fromarray(pixels(index, size=16).permute(1, 2, 0).numpy())
        return self.transform(image), index % 2


def python_random_flip(image):  # an albumentations-style transform: Python's generator
    return image.transpose(Image.FLIP_LEFT_RIGHT) if random.random() < 0.5 else image


def numpy_random_shift(image):
    return Image.fromarray(np.roll(np.asarray(image), np.random.randint(1, 16), axis=1))


TRAIN_REFUSAL = (
    "train_dataset: its images change each time they are read (a random transform of its own: "
    "RandomResizedCrop, RandomHorizontalFlip, ...); the run augments the images itself, and held "
    "in memory yours would be one draw: give the dataset no random transform (PIL images, or "
    "Resize alone), or keep yours with augment=False and in_memory='never'")


def held_out_refusal(where: str) -> str:
    return (f"{where}: its images change each time they are read (a random transform of its "
            f"own), and validation must score the same images at every evaluation: pass "
            f"eval_dataset= a dataset with a deterministic transform (Resize and CenterCrop, or "
            f"none)")


RANDOM_TRANSFORMS = [v2.Compose([v2.RandomResizedCrop(8), v2.PILToTensor()]),
                     v2.RandomHorizontalFlip(), python_random_flip, numpy_random_shift]


@pytest.mark.parametrize("transform", RANDOM_TRANSFORMS,
                         ids=["torchvision-crop", "torchvision-flip", "python", "numpy"])
def test_a_dataset_with_its_own_random_transform_is_refused_unless_it_augments_alone(transform):
    deterministic = Transformed(8, v2.Resize(8))
    for options in ({}, {"in_memory": "never"}, {"augment": False}):
        with pytest.raises(UsageError) as refused:
            load_user_data(Transformed(16, transform), deterministic, TrainConfig(**options))
        assert str(refused.value) == TRAIN_REFUSAL
    alone = TrainConfig(augment=False, in_memory="never")
    data = load_user_data(Transformed(16, transform), deterministic, alone)
    assert data.train.dataset.transform is transform  # read per step, its transform each time
    assert data.train.reads_randomly  # so the loader seeds each read (test_api: exact resume)
    with pytest.raises(UsageError) as refused:
        load_user_data(Transformed(16, transform), None, alone)
    assert str(refused.value) == held_out_refusal("train_dataset's held-out part (val_fraction)")
    with pytest.raises(UsageError) as refused:
        load_user_data(deterministic, Transformed(8, transform), TrainConfig())
    assert str(refused.value) == held_out_refusal("eval_dataset")


class FlatFirst(Transformed):
    """Transformed, but its first picture one colour: no flip or shift changes it."""

    def __getitem__(self, index):
        if index == 0:
            return self.transform(Image.new("RGB", (16, 16), (90, 30, 200))), 0
        return super().__getitem__(index)


@pytest.mark.parametrize("transform", RANDOM_TRANSFORMS[1:], ids=["torchvision-flip", "python",
                                                                  "numpy"])
def test_a_random_transform_a_flat_first_image_hides_is_still_found(transform):
    flat = FlatFirst(16, transform)
    assert all(torch.equal(as_uint8_chw(flat[0][0], "x"), as_uint8_chw(flat[0][0], "x"))
               for _ in range(8))  # the premise: the first item alone reads the same
    with pytest.raises(UsageError) as refused:
        load_user_data(flat, Transformed(8, v2.Resize(8)), TrainConfig())
    assert str(refused.value) == TRAIN_REFUSAL


def test_a_deterministic_transform_is_read_as_it_is_and_the_generators_are_left_alone():
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    data = load_user_data(Transformed(16, v2.Resize(8)), None, TrainConfig(in_memory="never"))
    assert not data.train.reads_randomly
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    resized = v2.Resize(8)(Image.fromarray(pixels(0, size=16).permute(1, 2, 0).numpy()))
    source = next(part for part in (data.train, data.held_out) if 0 in part.indices.tolist())
    assert torch.equal(source.image(source.indices.tolist().index(0)), pil_to_tensor(resized))


class OnePicture(Transformed):
    """Every item the same picture through `transform`: what differs between reads is the draw."""

    def __getitem__(self, index):
        return super().__getitem__(0)[0], index % 2


def test_a_datasets_own_random_reads_are_a_function_of_the_samples_place_in_the_run():
    """The training reads of a dataset that augments alone: the same (seed, epoch, index) gives
    the same crop whatever was read before it, another epoch, index or seed another crop."""
    crop = v2.Compose([v2.RandomCrop(10), v2.PILToTensor()])
    data = load_user_data(OnePicture(16, crop), Items(4),
                          TrainConfig(augment=False, in_memory="never"))
    reads = TrainImages(data.train, ImageTransform(10, (0.0,) * 3, (1.0,) * 3), seed=5)
    states = torch.get_rng_state(), random.getstate()
    alone = reads[3][0]
    after_others = reads.__getitems__([0, 1, 2, 3])[3][0]
    assert torch.equal(alone, after_others) and torch.equal(reads[3][0], alone)
    assert (torch.equal(torch.get_rng_state(), states[0]), random.getstate()) == (True, states[1])
    n = len(data.train)
    again = TrainImages(data.train, ImageTransform(10, (0.0,) * 3, (1.0,) * 3), seed=6)
    for other in (reads[3 + n][0], reads[4][0], again[3][0]):  # epoch, index, seed
        assert not torch.equal(other, alone)


def _image_folders(root, classes_of_split: dict[str, list[str]]):
    from torchvision.datasets import ImageFolder
    made = {}
    for split, classes in classes_of_split.items():
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (8, 8), (40 * len(name), 20 * i, 9)).save(folder / f"{i}.png")
        made[split] = ImageFolder(str(root / split))
    return made


def test_an_eval_folder_lacking_a_class_is_scored_by_class_name(tmp_path):
    """torchvision's ImageFolder numbers the classes it finds: val/ without dog makes fox 1,
    train's dog.  Each held-out label must be train's index of the folder the file is in
    (the oracle: ImageFolder's own file list)."""
    folders = _image_folders(tmp_path, {"train": ["cat", "dog", "fox"], "val": ["cat", "fox"]})
    data = load_user_data(folders["train"], folders["val"], TrainConfig(in_memory="never"))
    expected = [["cat", "dog", "fox"].index(Path(path).parent.name)
                for path, _ in folders["val"].samples]
    assert data.held_out.labels.tolist() == expected == [0, 0, 0, 2, 2, 2]
    assert data.class_names == ["cat", "dog", "fox"]
    assert "eval_dataset's classes matched to train_dataset's by name" in data.description
    same = load_user_data(folders["train"], folders["train"], TrainConfig(in_memory="never"))
    assert "by name" not in same.description


def test_an_eval_class_train_does_not_name_is_one_line(tmp_path):
    folders = _image_folders(tmp_path, {"train": ["cat", "dog"], "val": ["cat", "emu"]})
    with pytest.raises(UsageError) as refused:
        load_user_data(folders["train"], folders["val"], TrainConfig(in_memory="never"))
    assert str(refused.value) == (
        "eval_dataset: its class 'emu' is not one of train_dataset's classes (cat, dog): the "
        "model cannot be scored on a class it does not train on; leave those items out of "
        "eval_dataset")


class _Declared(Dataset):
    """Items of one 8x8 image each, with the class names it declares (torchvision's way)."""

    def __init__(self, classes: list[str], targets: list[int]):
        self.classes, self.targets = classes, targets

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return torch.full((3, 8, 8), 10 * i, dtype=torch.uint8), self.targets[i]


def test_eval_names_matched_past_unused_and_missing_names():
    """A class eval_dataset names but holds no item of (emu) matches nothing and is no
    trouble; a label past eval_dataset's own names is refused as such."""
    train = _Declared(["cat", "dog", "fox"], [0, 1, 2] * 4)
    data = load_user_data(train, _Declared(["cat", "emu", "fox"], [0, 2, 2]),
                          TrainConfig(in_memory="never"))
    assert data.held_out.labels.tolist() == [0, 2, 2]  # cat 0, fox 2 in train's numbering
    with pytest.raises(UsageError) as refused:
        load_user_data(train, _Declared(["cat", "fox"], [0, 2]), TrainConfig(in_memory="never"))
    assert str(refused.value).startswith("eval_dataset: its label 2, past its names, is not one "
                                         "of train_dataset's classes (cat, dog, fox)")
