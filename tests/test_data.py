"""Data sources, columns, image modes, splits, sampler and augmentation determinism."""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from accel_train.data import synthetic
from accel_train.config import TrainConfig
from accel_train.data.loaders import EpochSampler, TrainImages, dataset_mean_std
from accel_train.base.errors import UsageError
from accel_train.data.sources import ArraySource, HFSource, load_data
from accel_train.data.transforms import ImageTransform
from conftest import accel_train_here, model_spec_of

CLASSES = ["cat", "dog", "fish"]


def _image(label: int, index: int, mode: str = "RGB", size: int = 12) -> Image.Image:
    rng = np.random.default_rng(index)
    pixels = (rng.uniform(0, 60, (size, size, 3)) + 80 * label).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    return image.convert(mode) if mode != "RGB" else image


def _png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _hf_dataset(num: int, modes=("RGB",), image_col="image", label_col="label") -> datasets.Dataset:
    rows = {image_col: [], label_col: []}
    for i in range(num):
        label = i % len(CLASSES)
        rows[image_col].append(_image(label, i, modes[i % len(modes)]))
        rows[label_col].append(label)
    features = datasets.Features({image_col: datasets.Image(),
                                  label_col: datasets.ClassLabel(names=CLASSES)})
    return datasets.Dataset.from_dict(rows, features=features)


def config(**kwargs) -> TrainConfig:
    return TrainConfig(**kwargs)


def test_synthetic_is_deterministic_balanced_and_held_out():
    images, labels = synthetic.generate(200, seed=5)
    again, _ = synthetic.generate(200, seed=5)
    assert images.shape == (200, 32, 32, 3) and images.dtype == np.uint8
    assert np.array_equal(images, again)
    assert np.bincount(labels).tolist() == [20] * 10
    data = load_data(config(synthetic_train_size=300, max_eval_samples=50))
    assert isinstance(data.train, ArraySource) and len(data.train) == 300
    assert len(data.held_out) == 50
    assert data.class_names == synthetic.CLASS_NAMES
    assert not torch.equal(data.train.images[:50], data.held_out.images)


# SHA-256 of the embedded set's test split (images then labels, as bytes) as every earlier
# version generated it: held-out figures compare across versions only while this holds.
HELD_OUT_SHA256 = "58cf5132120e7edc5e8665fbba9baec734c61e1ab4aa6a153013f24c83768ecc"
# and of a 300-image training split (more than one block of the generator), as the version that
# made the whole set at once generated it: a run on the embedded set trains on the same images
TRAIN_300_SHA256 = "1c59e11543877e349bf736541b3ccfba53fdfc205c7d7f6c32f8e02953f2ca81"
# and of the default training split (--synthetic-train-size 4000), the one every figure measured
# on the embedded set trained on: a change of float precision in the generator that moves no
# pixel of the smaller splits can still move one of these 4,000
TRAIN_DEFAULT_SHA256 = "5177c8319568ae252d8ccc5f3b81a8e5f25674fa0b20ca1ff3087d092609fb58"


def test_the_held_out_split_is_made_once_and_each_caller_gets_its_own_copy():
    import hashlib

    def digest(split):
        return hashlib.sha256(split[0].tobytes() + split[1].tobytes()).hexdigest()

    first = synthetic.held_out_split()
    assert digest(first) == HELD_OUT_SHA256
    first[0][0, 0, 0, 0] ^= 255  # a caller changing its copy
    first[1][0] = 9 - first[1][0]
    assert digest(synthetic.splits(10)["test"]) == HELD_OUT_SHA256
    assert digest(synthetic.held_out_split()) == HELD_OUT_SHA256
    assert digest(synthetic.splits(300)["train"]) == TRAIN_300_SHA256
    default_size = TrainConfig().synthetic_train_size
    assert default_size == 4000
    assert digest(synthetic.splits(default_size)["train"]) == TRAIN_DEFAULT_SHA256


@pytest.mark.parametrize("copy", ["real_cifar10", "cifar10_layout"])
def test_shared_cifar10_parquet(copy, request):
    """The real copy (skipped where it is absent) and the generated stand-in load alike."""
    data = load_data(config(data_dir=str(request.getfixturevalue(copy)), max_train_samples=256,
                            max_eval_samples=100))
    assert data.class_names[:3] == ["airplane", "automobile", "bird"]
    # validation carved from train (10%: 64 of the stand-in's 640 rows, 5,000 of the real
    # 50,000), the test split kept for the end; each capped at --max-eval-samples
    assert len(data.train) == 256 and len(data.held_out) == 64 if copy == "cifar10_layout" \
        else len(data.held_out) == 100
    assert len(data.test) == 100
    assert isinstance(data.train, ArraySource) and data.train.images.shape[1:] == (3, 32, 32)
    assert "for validation" in data.description and "test kept for the end" in data.description
    assert 0 <= int(data.train.labels.min()) and int(data.train.labels.max()) <= 9


def test_the_generated_stand_in_has_the_real_copys_schema(real_cifar10, cifar10_layout):
    """What the tests without the real CIFAR-10 use is the same parquet schema (columns, types
    and the datasets features in the metadata), so a change to the real layout shows here."""
    import pyarrow.parquet as pq
    for split in ("train", "test"):
        real = pq.read_schema(real_cifar10 / f"{split}.parquet")
        assert pq.read_schema(cifar10_layout / f"{split}.parquet").equals(real, check_metadata=True)


def test_parquet_folder_with_mixed_image_modes(tmp_path):
    ds = _hf_dataset(12, modes=("RGB", "L", "P", "CMYK", "RGBA"))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    data = load_data(config(data_dir=str(tmp_path)))
    # No held-out split in the folder: 10% is carved off, the same way every time.
    assert len(data.train) + len(data.held_out) == 12 and len(data.held_out) >= 1
    again = load_data(config(data_dir=str(tmp_path), seed=99))
    assert torch.equal(data.held_out.labels, again.held_out.labels)
    assert data.train.image(0).shape == (3, 12, 12)  # every mode became 3-channel RGB


def test_save_to_disk_and_label_column_flags(tmp_path):
    ds = _hf_dataset(9, image_col="picture", label_col="kind")
    datasets.DatasetDict(train=ds, validation=ds.select(range(3))).save_to_disk(str(tmp_path / "d"))
    data = load_data(config(data_dir=str(tmp_path / "d")))  # found by feature type
    assert len(data.train) == 9 and len(data.held_out) == 3 and data.class_names == CLASSES
    with pytest.raises(UsageError, match="--label-column 'nope' is not a column.*picture, kind"):
        load_data(config(data_dir=str(tmp_path / "d"), label_column="nope"))


def test_string_labels_become_sorted_class_names(tmp_path):
    ds = datasets.Dataset.from_dict(
        {"image": [_image(i % 2, i) for i in range(6)], "label": ["b", "a"] * 3},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("string")}))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    ds.to_parquet(str(tmp_path / "validation.parquet"))
    data = load_data(config(data_dir=str(tmp_path)))
    assert data.class_names == ["a", "b"]
    assert data.train.labels.tolist() == [1, 0] * 3


def _labelled_parquet(path: Path, labels: list, kind: str = "string") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(
        {"image": [_image(i % 3, i) for i in range(len(labels))], "label": labels},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value(kind)})
    ).to_parquet(str(path))


def test_a_held_out_label_value_train_lacks_is_refused_in_one_line(tmp_path):
    """Labels as strings (or numbers): 'Dog' in validation and 'dog' in train would be two
    classes, one never trained.  Checked over whole splits, before any sample limit; a value
    only in train (none held out) is fine.  Through the CLI: one line, exit 2."""
    _labelled_parquet(tmp_path / "train.parquet", ["cat", "dog", "cat", "dog"])
    _labelled_parquet(tmp_path / "validation.parquet", ["cat", "Dog"])
    with pytest.raises(UsageError, match=r"the validation split's 'label' holds 'Dog', which no "
                                         r"row of train has"):
        load_data(config(data_dir=str(tmp_path)))
    _labelled_parquet(tmp_path / "validation.parquet", ["cat"])
    _labelled_parquet(tmp_path / "test.parquet", ["dog", "bird", "cat"])
    with pytest.raises(UsageError, match=r"the test split's 'label' holds 'bird'"):
        load_data(config(data_dir=str(tmp_path)))
    result = accel_train_here("--data-dir", str(tmp_path), "--output-dir", str(tmp_path / "run"))
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1 and "'bird'" in err[0], result.stderr
    assert not (tmp_path / "run").exists()
    _labelled_parquet(tmp_path / "test.parquet", ["dog"])
    data = load_data(config(data_dir=str(tmp_path), max_train_samples=1))  # whole splits count
    assert data.class_names == ["cat", "dog"] and data.warnings == []
    # no validation file: validation is carved from train, and test is still held to train's
    (tmp_path / "validation.parquet").unlink()
    _labelled_parquet(tmp_path / "test.parquet", ["zebra", "dog", "bird", *"ABCDE"])
    with pytest.raises(UsageError, match=r"the test split's 'label' holds 'A', 'B', 'C', 'D', "
                                         r"'E' and 2 more, which no row of train has"):
        load_data(config(data_dir=str(tmp_path)))


def test_numeric_labels_with_gaps_warn_of_outputs_no_image_trains(tmp_path):
    """Labels 1, 5 and 9 number ten classes: the run gets ten outputs, seven for no image, and
    is told; labels 0..2 say nothing."""
    _labelled_parquet(tmp_path / "gaps" / "train.parquet", [1, 5, 9, 1, 5, 9], "int64")
    _labelled_parquet(tmp_path / "gaps" / "validation.parquet", [5, 9], "int64")
    data = load_data(config(data_dir=str(tmp_path / "gaps")))
    assert data.class_names == [str(i) for i in range(10)]
    (words,) = data.warnings
    assert "numbers the classes 0..9 and 7 of those numbers (0, 2, 3, 4, 6, 7, 8) no row has" \
        in words and "renumber the labels 0..2" in words
    _labelled_parquet(tmp_path / "sparse" / "train.parquet", [0, 20, 0, 20], "int64")
    (words,) = load_data(config(data_dir=str(tmp_path / "sparse"))).warnings
    assert "19 of those numbers (1, 2, 3, 4, 5, 6, 7, 8, ...) no row has" in words, words
    # eight missing are all shown; nine end in "..." (the first eight shown)
    for top, shown in ((9, "(1, 2, 3, 4, 5, 6, 7, 8) no row has"),
                       (10, "(1, 2, 3, 4, 5, 6, 7, 8, ...) no row has")):
        _labelled_parquet(tmp_path / f"to{top}" / "train.parquet", [0, top, 0, top], "int64")
        (words,) = load_data(config(data_dir=str(tmp_path / f"to{top}"))).warnings
        assert f"{top - 1} of those numbers {shown}" in words, words
    _labelled_parquet(tmp_path / "whole" / "train.parquet", [0, 1, 2, 0], "int64")
    _labelled_parquet(tmp_path / "whole" / "validation.parquet", [2], "int64")
    whole = load_data(config(data_dir=str(tmp_path / "whole"), in_memory="never"))
    assert whole.warnings == [] and whole.held_out.labels.tolist() == [2]
    assert sorted(whole.train.labels.tolist()) == [0, 0, 1, 2]  # 0 is a class, not "no label"


def _class_label_parquet(path: Path, labels: list, names: list[str], first: int = 0) -> None:
    """Labels given by name (None: unlabelled, stored as -1) under a ClassLabel of `names`;
    images `first`, `first + 1`, ... (other numbers: other pixels)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(
        {"image": [_image(i % 3, first + i) for i in range(len(labels))],
         "label": [-1 if v is None else names.index(v) for v in labels]},
        features=datasets.Features({"image": datasets.Image(),
                                    "label": datasets.ClassLabel(names=names)})
    ).to_parquet(str(path))


def test_a_training_split_without_labels_is_refused_and_every_split_is_checked(tmp_path):
    """A training split of unlabelled rows only is refused, not left out as a test split of
    them is; and a split left out does not end the check of those after it (the validation
    split ahead of the test split, and behind it)."""
    names = ["cat", "dog"]
    _class_label_parquet(tmp_path / "a" / "train.parquet", [None] * 4, names)
    _class_label_parquet(tmp_path / "a" / "test.parquet", ["cat", "dog"], names)
    with pytest.raises(UsageError, match=r"4 of the 4 rows of the train split have no label"):
        load_data(config(data_dir=str(tmp_path / "a")))
    for unlabelled, partly in (("test", "validation"), ("validation", "test")):
        folder = tmp_path / f"{unlabelled}_only"
        _class_label_parquet(folder / "train.parquet", ["cat", "dog"] * 3, names)
        _class_label_parquet(folder / f"{unlabelled}.parquet", [None] * 3, names, first=50)
        _class_label_parquet(folder / f"{partly}.parquet", ["cat", None], names, first=100)
        with pytest.raises(UsageError, match=rf"1 of the 2 rows of the {partly} split have no"):
            load_data(config(data_dir=str(folder)))


def test_an_unlabelled_test_split_is_left_out_and_unlabelled_rows_are_refused(tmp_path):
    """Hub data sets store -1 for rows without a label: a test split of only those is left out
    with a warning (it failed at the end of training); some such rows in a split, or a None
    among string labels, are one line naming the split.  check-data counts them."""
    names = ["cat", "dog"]
    _class_label_parquet(tmp_path / "train.parquet", ["cat", "dog"] * 3, names)
    _class_label_parquet(tmp_path / "test.parquet", [None] * 4, names, first=100)
    data = load_data(config(data_dir=str(tmp_path)))
    assert data.test is None and len(data.train) + len(data.held_out) == 6
    assert any("the test split has no labels" in w and "all 4 rows" in w for w in data.warnings)
    result = accel_train_here("check-data", "--data-dir", str(tmp_path), "--json")
    findings = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and findings["unlabelled"] == {
        "test": {"rows": 4, "of": 4, "refused": False}}
    _class_label_parquet(tmp_path / "train.parquet", ["cat", "dog", None, "dog"], names)
    with pytest.raises(UsageError, match=r"1 of the 4 rows of the train split have no label"):
        load_data(config(data_dir=str(tmp_path)))
    result = accel_train_here("check-data", "--data-dir", str(tmp_path))
    assert result.returncode == 1 and "train: 1 of 4 rows (training refuses them)" in result.stdout
    (tmp_path / "test.parquet").unlink()
    _labelled_parquet(tmp_path / "train.parquet", ["cat", "dog", "cat", "dog"])
    _labelled_parquet(tmp_path / "validation.parquet", ["cat", None, "dog"])
    with pytest.raises(UsageError, match=r"1 of the 3 rows of the validation split have no"):
        load_data(config(data_dir=str(tmp_path)))
    result = accel_train_here("check-data", "--data-dir", str(tmp_path))  # None crashed it
    assert result.returncode == 1, result.stderr[-2000:]
    assert "validation: 1 of 3 rows (training refuses them)" in result.stdout, result.stdout


def test_class_labels_listed_in_another_order_per_split_are_matched_by_name(tmp_path):
    """Each split built with ClassLabel(names=sorted(set(its labels))): validation lacks
    'apple', so its index 0 is 'banana'.  Labels follow the names, not the indices."""
    train = ["apple", "banana", "cherry", "banana", "cherry", "cherry"]
    held_out = ["cherry", "banana", "cherry"]
    _class_label_parquet(tmp_path / "train.parquet", train, ["apple", "banana", "cherry"])
    _class_label_parquet(tmp_path / "validation.parquet", held_out, ["banana", "cherry"])
    data = load_data(config(data_dir=str(tmp_path), in_memory="never"))
    assert data.class_names == ["apple", "banana", "cherry"]
    assert [data.class_names[i] for i in data.train.labels.tolist()] == train
    assert [data.class_names[i] for i in data.held_out.labels.tolist()] == held_out
    # a name only validation's rows have: a class the model would never learn, one line
    _class_label_parquet(tmp_path / "validation.parquet", ["durian", "banana"],
                         ["banana", "durian"])
    with pytest.raises(UsageError, match=r"the validation split's 'label' holds 'durian', which "
                                         r"no row of train has"):
        load_data(config(data_dir=str(tmp_path), in_memory="never"))


@pytest.mark.parametrize("layout", [
    ["train.parquet", "test_data.parquet"],
    ["train_00000.parquet", "validation_00000.parquet", "test_00000.parquet"],
    ["train.parquet", "dev.parquet"],
    ["train/0000.parquet", "train/0001.parquet", "validation/0000.parquet"],
    ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
     "data/test-00000-of-00001.parquet"],
])
def test_parquet_file_names_split_as_datasets_reads_them(tmp_path, layout):
    """Oracle: Hugging Face's own load_dataset on the same folder, split by split and row by
    row count (file i holds i + 2 rows).  test_data.parquet was trained on, and split folders
    were refused as holding no images."""
    from accel_train.data.sources import open_data
    for i, name in enumerate(layout):
        _labelled_parquet(tmp_path / name, ["cat", "dog"] * (i + 2))
    ours = open_data(config(data_dir=str(tmp_path))).splits
    theirs = datasets.load_dataset(str(tmp_path))
    assert {k: len(v) for k, v in ours.items()} == {k: len(v) for k, v in theirs.items()}


@pytest.mark.parametrize("layout", [
    ["Train.parquet", "Test.parquet"],
    ["train.parquet", "Validation.parquet", "TEST_data.parquet"],
    ["Train/0000.parquet", "Train/0001.parquet", "VAL/0000.parquet"],
])
def test_parquet_split_names_match_in_any_case(tmp_path, layout):
    """Train.parquet beside Test.parquet trained on both (datasets' split patterns are
    case-sensitive), where image folders take split names in any case.  Oracle: Hugging Face's
    own load_dataset on a copy whose names are lower case, split by split (file i holds i + 2
    rows); and the command line keeps the test file for the end."""
    from accel_train.data.sources import open_data
    for i, name in enumerate(layout):
        for root, written in ((tmp_path / "ours", name), (tmp_path / "lower", name.lower())):
            (root / written).parent.mkdir(parents=True, exist_ok=True)
            _labelled_parquet(root / written, ["cat", "dog"] * (i + 2))
    ours = open_data(config(data_dir=str(tmp_path / "ours"))).splits
    theirs = datasets.load_dataset(str(tmp_path / "lower"))
    assert len(theirs) > 1  # the oracle itself splits the folder
    assert {k: len(v) for k, v in ours.items()} == {k: len(v) for k, v in theirs.items()}
    if "test" in theirs:
        result = accel_train_here("--data-dir", str(tmp_path / "ours"), "--model", "test_resnet",
                                  "--max-steps", "1", "--batch-size", "2", "--num-workers", "0",
                                  "--no-plots", "--output-dir", str(tmp_path / "run"))
        assert result.returncode == 0, result.stderr[-2000:]
        assert f" / {len(theirs['test'])} test images" in result.stdout, result.stdout


def test_a_parquet_file_no_split_names_trains(tmp_path):
    """datasets leaves a file out when others name splits; here it trains, with train's."""
    from accel_train.data.sources import open_data
    _labelled_parquet(tmp_path / "data.parquet", ["cat", "dog"] * 2)
    _labelled_parquet(tmp_path / "eval.parquet", ["cat", "dog"])  # eval: a test split
    assert {k: len(v) for k, v in open_data(config(data_dir=str(tmp_path))).splits.items()} \
        == {"test": 2, "train": 4}


def _write_class_folders(root: Path, per_class: int, size: int = 12):
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            _image(label, i, size=size).save(root / name / f"{i}.png")


def test_image_folder_flat_and_with_split_folders(tmp_path):
    _write_class_folders(tmp_path / "flat", 4)
    flat = load_data(config(data_dir=str(tmp_path / "flat")))
    assert flat.class_names == CLASSES and len(flat.train) + len(flat.held_out) == 12
    _write_class_folders(tmp_path / "split" / "train", 4)
    _write_class_folders(tmp_path / "split" / "val", 2)
    split = load_data(config(data_dir=str(tmp_path / "split")))
    assert (len(split.train), len(split.held_out)) == (12, 6)


def test_native_size_does_not_depend_on_decoding_in_memory(tmp_path):
    """The default --image-size is the data's own: a lazily decoded 12 px set is not trained at
    224 px (49x the compute of the same run decoded in memory)."""
    _write_class_folders(tmp_path / "train", 3, size=12)
    _write_class_folders(tmp_path / "test", 1, size=12)
    in_memory = load_data(config(data_dir=str(tmp_path)))
    lazy = load_data(config(data_dir=str(tmp_path), in_memory="never"))
    assert isinstance(in_memory.train, ArraySource) and isinstance(lazy.train, HFSource)
    assert in_memory.train.native_size == lazy.train.native_size == 12


def test_photos_of_one_size_train_at_most_at_224_by_default(tmp_path):
    """A folder of one camera's photos shares one size: trained at it, 3024 px photos cost 180x
    the pixels of 224 a step.  The default is the shared size up to 224 (CIFAR's 32 stays 32:
    tests above); --image-size given wins."""
    _write_class_folders(tmp_path / "photos" / "train", 3, size=240)
    data = load_data(config(data_dir=str(tmp_path / "photos"), in_memory="never"))
    assert data.train.native_size == 240
    common = ["--data-dir", str(tmp_path / "photos"), "--model", "test_resnet", "--batch-size", "2",
              "--max-steps", "1", "--no-plots", "--mixed-precision", "no", "--no-channels-last"]
    for flags, size in (([], 224), (["--image-size", "240"], 240)):
        out = tmp_path / f"run{size}"
        said = accel_train_here(*common, *flags, "--output-dir", str(out), check=True).stdout
        assert f"classes, {size}px," in said, said
        assert model_spec_of(out)["image_size"] == size


def test_the_default_size_looks_past_the_first_classes(tmp_path):
    """Classes a and b of 12 px images, then c of 20 px: rows go class by class, and the first
    32 images were all 12 px, so the run trained c at 12 px.  Spread over the split, the
    probe sees both sizes: the mixed-size default."""
    for name, size in (("a", 12), ("b", 12), ("c", 20)):
        for i in range(20):
            path = tmp_path / "train" / name / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            _image(0, i, size=size).save(path)
    data = load_data(config(data_dir=str(tmp_path), in_memory="never", val_fraction=0.05))
    assert data.train.native_size == 224


def test_mixed_sizes_stay_on_disk_and_decode_per_sample(tmp_path):
    _write_class_folders(tmp_path / "train", 3, size=12)
    _write_class_folders(tmp_path / "test", 1, size=20)
    _image(0, 99, size=30).save(tmp_path / "train" / "cat" / "big.png")
    data = load_data(config(data_dir=str(tmp_path)))
    assert isinstance(data.train, HFSource)
    assert data.train.native_size == 224  # mixed sizes: timm's usual input size
    transform = ImageTransform(16, (0.5,) * 3, (0.25,) * 3)
    assert {tuple(transform(data.train.image(i)).shape) for i in range(len(data.train))} == \
        {(3, 16, 16)}
    with pytest.raises(UsageError, match="--in-memory always"):
        load_data(config(data_dir=str(tmp_path), in_memory="always"))


def test_unreadable_image_is_named(tmp_path):
    # class 1 keeps one readable image (a class with none is refused: test_bad_images.py)
    rows = {"image": [{"bytes": _png_bytes(_image(0, 0)), "path": None},
                      {"bytes": b"not an image", "path": None},
                      {"bytes": _png_bytes(_image(1, 1)), "path": None}], "label": [0, 1, 1]}
    ds = datasets.Dataset.from_dict(rows, features=datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES[:2])}))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    ds.to_parquet(str(tmp_path / "validation.parquet"))
    with pytest.raises(UsageError, match=r"image train.parquet row 1 cannot be decoded \(not an "
                       r"image: the file holds text \('not an image'"):
        load_data(config(data_dir=str(tmp_path), bad_images="error"))
    data = load_data(config(data_dir=str(tmp_path)))  # the default: a substitute, and its label
    assert [(bad.split, bad.index, bad.name) for bad in data.bad_images] == \
        [("train", 1, "train.parquet row 1"), ("held-out", 1, "validation.parquet row 1")]
    assert torch.equal(data.train.images[1], data.train.images[2])  # the next that decodes
    assert data.train.labels.tolist() == [0, 1, 1]


@pytest.mark.parametrize("setup, expected", [
    ("missing", "no such folder"),
    ("empty", "holds no files"),
    ("file", "is a file"),
])
def test_bad_data_dirs(tmp_path, setup, expected):
    path = tmp_path / "data"
    if setup == "empty":
        path.mkdir()
    elif setup == "file":
        path.write_text("x")
    with pytest.raises(UsageError, match=expected):
        load_data(config(data_dir=str(path)))


def test_hub_dataset_offline_names_data_dir(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Both libraries read these at import: set where they already look (else each lookup waits
    # for the network to time out before failing the same way).
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(UsageError, match="--dataset someone/imagenet-ish.*--data-dir"):
        load_data(config(dataset="someone/imagenet-ish"))


def test_epoch_sampler_is_a_function_of_seed_and_epoch():
    sampler = EpochSampler(103, global_batch=10, seed=3)
    assert len(sampler) == 100  # cut to whole global batches
    sampler.set_epoch(2)
    keys = list(sampler)
    assert all(2 * 103 <= k < 3 * 103 for k in keys) and len(set(keys)) == 100
    assert [k % 103 for k in keys] == EpochSampler(103, 10, 3).order(2).tolist()
    assert EpochSampler(103, 10, 3).order(1).tolist() != EpochSampler(103, 10, 3).order(2).tolist()


def test_augmentation_depends_on_seed_epoch_index_only():
    source = ArraySource(torch.randint(0, 255, (4, 3, 32, 32), dtype=torch.uint8),
                         torch.tensor([0, 1, 0, 1]))
    transform = ImageTransform(32, (0.5,) * 3, (0.25,) * 3, augment=True)
    images = TrainImages(source, transform, seed=7)
    key = 5 * len(source) + 2  # epoch 5, sample 2
    torch.manual_seed(0)
    first = images[key][0]
    torch.manual_seed(1)  # the global RNG must not matter
    assert torch.equal(first, images[key][0])
    assert not all(torch.equal(first, images[6 * len(source) + 2][0]) for _ in range(1))


def test_dataset_statistics():
    images = torch.full((10, 3, 4, 4), 51, dtype=torch.uint8)
    mean, std = dataset_mean_std(ArraySource(images, torch.zeros(10, dtype=torch.long)))
    assert mean == pytest.approx((0.2, 0.2, 0.2), abs=1e-4)
    assert std == pytest.approx((0.001,) * 3)  # clamped: never divide by zero


def test_the_splits_share_one_in_memory_budget_or_stay_on_disk_together(tmp_path):
    """12 training and 6 validation images of 12x12 RGB: 432 bytes each, 7,776 in all."""
    _write_class_folders(tmp_path / "train", 4)
    _write_class_folders(tmp_path / "val", 2)
    both = 18 * 432 / 2**30
    held = load_data(config(data_dir=str(tmp_path), in_memory_limit_gb=both))
    assert isinstance(held.train, ArraySource) and isinstance(held.held_out, ArraySource)
    for limit in (both - 1 / 2**30, 12 * 432 / 2**30):  # a byte short; the training part's own
        on_disk = load_data(config(data_dir=str(tmp_path), in_memory_limit_gb=limit))
        assert isinstance(on_disk.train, HFSource) and isinstance(on_disk.held_out, HFSource)
    with pytest.raises(UsageError) as refused:
        load_data(config(data_dir=str(tmp_path), in_memory="always",
                         in_memory_limit_gb=12 * 432 / 2**30))
    assert str(refused.value) == (
        "--in-memory always: the data cannot be held in memory: its 6 held-out images take "
        f"{6 * 432 / 2**30:.3g} GiB, over the 0 GiB left of --in-memory-limit-gb; use "
        "--in-memory auto (or never) to decode the images per step")


def _pixel_rows(count: int, seed: int) -> list[np.ndarray]:
    """HxWx3 uint8 images, 8 high and 10 wide: not square, so a transposed read shows."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (8, 10, 3), dtype=np.uint8) for _ in range(count)]


def _pixel_splits(root: Path, layout: str, dtype: str = "uint8") -> dict[str, list[np.ndarray]]:
    """train (6) and validation (3) of pixel arrays as `layout` stores them (their values in
    `dtype`); returns what each split's images are, as PIL reads the HxWx3 (or HxW) uint8 array
    they came from."""
    splits, stored = {}, {}
    for split, count, seed in (("train", 6, 1), ("validation", 3, 2)):
        images = _pixel_rows(count, seed)
        if layout == "gray":
            images = [image[:, :, 0] for image in images]
        stored[split] = [(image.transpose(2, 0, 1) if layout in ("chw", "lists") else image)
                         .astype(dtype) for image in images]
        splits[split] = [np.asarray(Image.fromarray(image).convert("RGB")) for image in images]
    labels = {split: [i % 2 for i in range(len(rows))] for split, rows in stored.items()}
    if layout == "lists":  # pandas' parquet of arrays: lists of lists of int64
        import pandas as pd
        root.mkdir(parents=True)
        for split, rows in stored.items():
            pd.DataFrame({"pixel_values": [row.tolist() for row in rows],
                          "label": labels[split]}).to_parquet(root / f"{split}.parquet")
        return splits
    shape = stored["train"][0].shape
    kind = datasets.Array2D if len(shape) == 2 else datasets.Array3D
    features = datasets.Features({"pixel_values": kind(shape=shape, dtype=dtype),
                                  "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.DatasetDict({split: datasets.Dataset.from_dict(
        {"pixel_values": rows, "label": labels[split]}, features=features)
        for split, rows in stored.items()}).save_to_disk(str(root))
    return splits


@pytest.mark.parametrize("layout", ["chw", "hwc", "gray", "lists"])
def test_a_column_of_uint8_pixel_arrays_trains_on_the_images_it_holds(tmp_path, layout):
    """transformers' `pixel_values` of plain pixels, channels first or last, gray, or lists as
    pandas writes them: datasets' cast to Image crashed on CxHxW arrays.  Oracle: PIL's image of
    each HxWx3 array, in RGB; and the command line trains and checks them."""
    expected = _pixel_splits(tmp_path / "data", layout)
    data = load_data(config(data_dir=str(tmp_path / "data")))
    for source, split in ((data.train, "train"), (data.held_out, "validation")):
        ours = [source.image(i).permute(1, 2, 0).numpy() for i in range(len(source))]
        assert len(ours) == len(expected[split])
        assert all(np.array_equal(a, b) for a, b in zip(ours, expected[split]))
    if layout == "chw":
        result = accel_train_here("--data-dir", str(tmp_path / "data"), "--model",
                                  "test_resnet", "--max-steps", "1", "--batch-size", "2",
                                  "--num-workers", "0", "--no-plots", "--output-dir",
                                  str(tmp_path / "run"))
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        assert "6 train / 3 validation images, 2 classes, 8px" in result.stdout
        checked = accel_train_here("check-data", "--data-dir", str(tmp_path / "data"), "--json",
                                   "--workers", "1")
        sizes = json.loads(checked.stdout)["sizes"]
        assert checked.returncode == 0 and sizes["width"]["min"] == 10, checked.stdout


def test_rgba_pixel_arrays_are_sharded_as_they_train_over_white(tmp_path):
    """A column of HxWx4 arrays trains with its alpha blended over white; `shard` wrote them
    with the alpha dropped (PIL's convert), so the streamed run trained on other pixels than the
    same data read directly.  Oracle: numpy's blend over white, and the PNGs in the tars."""
    import tarfile

    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 256, (8, 10, 4), dtype=np.uint8) for _ in range(6)]
    features = datasets.Features({"pixel_values": datasets.Array3D(shape=(8, 10, 4),
                                                                   dtype="uint8"),
                                  "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.Dataset.from_dict({"pixel_values": rows, "label": [i % 2 for i in range(6)]},
                               features=features).save_to_disk(str(tmp_path / "d"))
    over_white = [row[:, :, :3] * (row[:, :, 3:] / 255) + 255 * (1 - row[:, :, 3:] / 255)
                  for row in rows]
    result = accel_train_here("shard", "--no-progress", "--data-dir", str(tmp_path / "d"),
                              "--output", str(tmp_path / "s"))
    assert result.returncode == 0, result.stderr
    sharded = []
    for tar in sorted((tmp_path / "s").glob("*/*.tar")):
        with tarfile.open(tar) as archive:
            sharded += [np.asarray(Image.open(archive.extractfile(member)))
                        for member in archive.getmembers() if member.name.endswith(".png")]
    assert len(sharded) == 6
    for image in sharded:  # carved and reordered: each is one of the rows, over white
        assert min(np.abs(image - blended).max() for blended in over_white) <= 0.5 + 1e-9


@pytest.mark.parametrize("dtype", ["uint16", "int32", "int64"])
def test_wider_whole_number_pixels_train_within_0_to_255_and_are_refused_beyond(tmp_path,
                                                                               dtype):
    """Whole-number arrays of a wider type: within 0..255 they are 8-bit pixels and train;
    beyond (16-bit images), every row was counted as a broken image, one by one.  Now one line
    naming the column and the range, exit 2, nothing written.  Oracles: PIL's image of each
    array cast to uint8; numpy's min and max of the values written."""
    expected = _pixel_splits(tmp_path / "fits", "chw", dtype)
    data = load_data(config(data_dir=str(tmp_path / "fits")))
    ours = [data.train.image(i).permute(1, 2, 0).numpy() for i in range(len(data.train))]
    assert len(ours) == 6 and all(np.array_equal(a, b) for a, b in zip(ours, expected["train"]))

    rng = np.random.default_rng(4)
    rows = [rng.integers(0, 256, (3, 8, 10)).astype(dtype) for _ in range(6)]
    rows[2][0, 1, 1] = 1000  # one value of one image: a 16-bit image's
    if dtype != "uint16":
        rows[4][1, 2, 3] = -7
    low, high = int(min(r.min() for r in rows)), int(max(r.max() for r in rows))
    labels = [i % 2 for i in range(6)]
    if dtype == "int64":  # as pandas writes arrays to parquet: lists of lists
        import pandas as pd
        (tmp_path / "wide").mkdir()
        pd.DataFrame({"pixel_values": [r.tolist() for r in rows], "label": labels}).to_parquet(
            tmp_path / "wide" / "train.parquet")
    else:
        datasets.Dataset.from_dict({"pixel_values": rows, "label": labels}, features=(
            datasets.Features({"pixel_values": datasets.Array3D(shape=(3, 8, 10), dtype=dtype),
                               "label": datasets.ClassLabel(names=["a", "b"])}))).save_to_disk(
            str(tmp_path / "wide"))
    wide = str(tmp_path / "wide")
    for args in (["check-data", "--data-dir", wide],
                 ["--data-dir", wide, "--model", "test_resnet", "--max-steps", "1",
                  "--batch-size", "2", "--num-workers", "0", "--no-plots", "--output-dir",
                  str(tmp_path / "run")],
                 ["shard", "--data-dir", wide, "--output", str(tmp_path / "s")]):
        result = accel_train_here(*args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert f"the image column 'pixel_values' holds {dtype} arrays of shape (3, 8, 10) " \
               f"with values from {low} to {high}, outside the 0..255" in lines[0], lines[0]
        assert "uint8" in lines[0] and "Image column" in lines[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "s").exists()


@pytest.mark.parametrize("shape", [(3, 8, 8), (8, 8, 3)])
def test_float_pixel_values_are_refused_in_one_line_naming_what_to_pass(tmp_path, shape):
    """An image processor's float output (normalized, its mean and std not recorded) gave a
    traceback from datasets' cast; now one line, exit 2, nothing written.  Its advice works:
    --image-column naming the column of the images themselves trains."""
    rng = np.random.default_rng(0)
    columns = {"pixel_values": [rng.random(shape, dtype=np.float32) for _ in range(8)],
               "label": [i % 2 for i in range(8)]}
    features = {"pixel_values": datasets.Array3D(shape=shape, dtype="float32"),
                "label": datasets.Value("int64")}
    datasets.Dataset.from_dict(columns, features=datasets.Features(features)).save_to_disk(
        str(tmp_path / "d"))
    columns["image"] = [Image.fromarray(rows) for rows in _pixel_rows(8, 3)]
    datasets.Dataset.from_dict(columns, features=datasets.Features(
        {**features, "image": datasets.Image()})).save_to_disk(str(tmp_path / "with_images"))
    run = ["--data-dir", str(tmp_path / "d"), "--model", "test_resnet", "--max-steps", "1",
           "--batch-size", "2", "--num-workers", "0", "--no-plots"]
    for args in (["check-data", "--data-dir", str(tmp_path / "d")],
                 [*run, "--output-dir", str(tmp_path / "run")],
                 ["shard", "--data-dir", str(tmp_path / "d"), "--output", str(tmp_path / "s")]):
        result = accel_train_here(*args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert f"the image column 'pixel_values' holds float32 arrays of shape {shape}, not " \
               f"8-bit pixels" in lines[0] and "--image-column" in lines[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "s").exists()
    run[1] = str(tmp_path / "with_images")
    trained = accel_train_here(*run, "--image-column", "image", "--output-dir",
                               str(tmp_path / "run"))
    assert trained.returncode == 0, trained.stderr[-2000:]


def test_rows_without_a_label_are_counted_by_hand():
    """Nulls, negative numbers and a float column's NaN each count, together: pandas' NaN is
    stored as a null, but Arrow and datasets keep a NaN written as a value."""
    from accel_train.data.labels import unlabelled_rows
    nan = float("nan")
    floats = datasets.Dataset.from_dict({"label": [0.0, nan, None, -1.0, 2.0, nan]})
    assert unlabelled_rows(floats, "label") == 4   # nan, None, -1.0, nan
    numbers = datasets.Dataset.from_dict({"label": [0, None, -1, 2, -1, None]})
    assert unlabelled_rows(numbers, "label") == 4  # None, -1, -1, None
    assert unlabelled_rows(datasets.Dataset.from_dict({"label": ["a", None, "b"]}), "label") == 1


def _float_label_parquet(folder: Path, split: str, labels: list) -> None:
    import pandas as pd
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"image": [{"bytes": _png_bytes(_image(0, i)), "path": None}
                            for i in range(len(labels))],
                  "label": labels}).to_parquet(folder / f"{split}.parquet")


def test_float_class_numbers_are_the_numbers_and_nan_is_no_label(tmp_path):
    """pandas writes an integer column that held a missing value as floats, NaN for the
    missing one: 3.0 named a class "3.0" and NaN trained as a class "nan"."""
    import pandas as pd
    data = tmp_path / "floats"
    _float_label_parquet(data, "train", [0.0, 1.0, 2.0, 10.0] * 5)
    loaded = load_data(config(data_dir=str(data), in_memory="never", val_fraction=0.2))
    assert loaded.class_names == [str(i) for i in range(11)]  # as an integer column's
    read = pd.read_parquet(data / "train.parquet")["label"].astype(int).tolist()
    every = torch.cat([loaded.train.labels, loaded.held_out.labels]).tolist()
    assert sorted(every) == sorted(read)
    with_nan = tmp_path / "nan"
    _float_label_parquet(with_nan, "train", [0.0, 1.0, float("nan"), 1.0] * 5)
    with pytest.raises(UsageError) as refused:
        load_data(config(data_dir=str(with_nan), in_memory="never"))
    assert str(refused.value) == (
        f"{with_nan}: 5 of the 20 rows of the train split have no label ('label' is -1, empty "
        f"or NaN); label them or remove them (accel-train check-data counts them per split)")
    _float_label_parquet(with_nan, "train", [0.0, 1.0] * 10)  # a test split of NaN only
    _float_label_parquet(with_nan, "test", [float("nan")] * 4)
    loaded = load_data(config(data_dir=str(with_nan), in_memory="never"))
    assert loaded.test is None and any("the test split has no labels" in w
                                       for w in loaded.warnings)
