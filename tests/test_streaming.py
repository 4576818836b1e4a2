"""Streaming from shards (accel_train/data/streaming/, `accel-train shard`): the converter's round
trip, the epoch plan (each sample once, uneven shard counts, re-cuts for another layout), and
real runs on 1 and 2 processes with exact resume."""

from __future__ import annotations

import gzip
import io
import json
import shutil
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import PINNED, accel_train_here

from accel_train.data.streaming import (Layout, ShardSet, rank_batches_per_epoch, read_split,
                                        remaining_batches, slot_keys, slot_shards)

# --- the converter ---------------------------------------------------------------------------


def _shard_here(*args: str) -> subprocess.CompletedProcess:
    return accel_train_here("shard", "--no-progress", *args)


def _decoded(shards: ShardSet):
    """A split's images as a streamed run decodes them (a broken sample stops it)."""
    from accel_train.data.streaming import decode_substituting
    samples, labels = read_split(shards)
    images, _, _ = decode_substituting(samples, "error")
    return torch.stack(images), torch.tensor(labels)


def _index_sets(folder: Path) -> dict[str, ShardSet]:
    index = json.loads((folder / "index.json").read_text())
    return {name: ShardSet([folder / e["file"] for e in entries], [e["count"] for e in entries])
            for name, entries in index["splits"].items()}


@pytest.mark.slow
def test_streamed_held_out_images_are_those_a_sample_limit_keeps(synthetic_shards):
    """--max-eval-samples 64 of the synthetic set's 1,000 held-out images in shards: the draw's
    64 (numpy's default_rng(0).permutation, as for map-style data), or with --sample-subset
    first the first 64; the summary's rule recorded either way."""
    from accel_train.config import TrainConfig
    from accel_train.data import synthetic
    from accel_train.data.streaming import load_streaming
    from conftest import drawn_subset
    images, labels = synthetic.splits(200)["test"]
    for how, kept in (("random", drawn_subset(1000, 64)), ("first", np.arange(64))):
        loaded = load_streaming(TrainConfig(data_dir=str(synthetic_shards), max_eval_samples=64,
                                            sample_subset=how))
        assert torch.equal(loaded.held_out.images,
                           torch.from_numpy(images[kept]).permute(0, 3, 1, 2)), how
        assert loaded.held_out.labels.tolist() == labels[kept].tolist()
        assert loaded.sample_subset == how
    assert load_streaming(TrainConfig(data_dir=str(synthetic_shards))).sample_subset is None


def test_shard_round_trip_synthetic_and_parquet(synthetic_shards, cifar10_layout, tmp_path):
    """The shards hold the same images (pixel for pixel) and labels as the source, in order,
    with counts and class names in the index."""
    from accel_train.data import synthetic
    index = json.loads((synthetic_shards / "index.json").read_text())
    assert index["class_names"] == list(synthetic.CLASS_NAMES)
    assert index["counts"] == {"train": 200, "test": 1000}
    assert [e["count"] for e in index["splits"]["train"]] == [24] * 8 + [8]
    assert (synthetic_shards / "train" / "000000.tar").is_file()
    sets = _index_sets(synthetic_shards)
    parts = synthetic.splits(200)
    for split in ("train", "test"):
        images, labels = _decoded(sets[split])
        want = torch.from_numpy(parts[split][0]).permute(0, 3, 1, 2)
        assert torch.equal(images, want) and labels.tolist() == parts[split][1].tolist()

    # parquet (JPEG bytes kept as they are) against what training on the parquet reads
    from accel_train.config import TrainConfig
    from accel_train.data.sources import load_data
    out = tmp_path / "parquet_shards"
    result = _shard_here("--data-dir", str(cifar10_layout), "--shard-size", "40KB", "--output",
                         str(out))
    assert result.returncode == 0, result.stderr
    assert "wrote 800 images" in result.stdout
    sets = _index_sets(out)
    # cut by size: no tar holds more than 40 KB of members (plus tar's end-of-archive record),
    # and none but the last stops far short of it (each JPEG here is 1-2 KB)
    sizes = [Path(f).stat().st_size for f in sets["train"].files]
    assert len(sizes) > 2 and max(sizes) <= 40_960 + 10_240, sizes
    assert min(sizes[:-1]) > 30_000, sizes
    # the shards keep the data's own splits: what training reads when it selects on test
    source = load_data(TrainConfig(data_dir=str(cifar10_layout), in_memory="always",
                                   select_on_test=True))
    for split, loaded in (("train", source.train), ("test", source.held_out)):
        images, labels = _decoded(sets[split])
        assert torch.equal(images, loaded.images) and torch.equal(labels, loaded.labels)
    # and a streamed run says so, as a map-style run with --select-on-test does
    from accel_train.data.streaming import load_streaming
    assert load_streaming(TrainConfig(data_dir=str(out))).description.endswith(
        f"test {len(source.held_out)}, the test split used for selection)")
    assert "used for selection" in source.description


def test_shard_round_trip_image_folder(tmp_path):
    from PIL import Image
    src = tmp_path / "folder"
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(
                src / cls / f"{i}.png")
    out = tmp_path / "shards"
    result = _shard_here("--data-dir", str(src), "--samples-per-shard", "4", "--val-fraction",
                         "0.25", "--output", str(out))
    assert result.returncode == 0, result.stderr
    from accel_train.config import TrainConfig
    from accel_train.data.sources import load_data
    loaded = load_data(TrainConfig(data_dir=str(src), in_memory="always", val_fraction=0.25))
    index = json.loads((out / "index.json").read_text())
    assert index["class_names"] == ["cat", "dog"]
    sets = _index_sets(out)
    for split, source in (("train", loaded.train), ("validation", loaded.held_out)):
        images, labels = _decoded(sets[split])
        assert torch.equal(images, source.images) and torch.equal(labels, source.labels)



def _noise_images(root: Path, counts: dict[str, int], named_by_folder: bool = False) -> Path:
    """8x8 noise PNGs, `count` in each folder of `counts` (named 0.png, ..., or by the folder:
    train0.png, ...)."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for folder, count in counts.items():
        (root / folder).mkdir(parents=True)
        for i in range(count):
            name = f"{folder}{i}.png" if named_by_folder else f"{i}.png"
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(
                root / folder / name)
    return root


def test_shard_carves_class_by_class_with_val_stratify(tmp_path):
    """12 cats and 4 dogs, 0.25 held out: class by class 3 and 1 (by hand: the dogs' share is
    one; the random draw of these rows holds out four cats), as training carves the folder."""
    src = _noise_images(tmp_path / "folder", {"cat": 12, "dog": 4})
    out = tmp_path / "shards"
    result = _shard_here("--data-dir", str(src), "--val-fraction", "0.25", "--val-stratify",
                         "--output", str(out))
    assert result.returncode == 0, result.stderr
    from accel_train.config import TrainConfig
    from accel_train.data.sources import load_data
    loaded = load_data(TrainConfig(data_dir=str(src), in_memory="always", val_fraction=0.25,
                                   val_stratify=True))
    sets = _index_sets(out)
    images, labels = _decoded(sets["validation"])
    assert torch.bincount(labels).tolist() == [3, 1]
    assert torch.equal(images, loaded.held_out.images) and torch.equal(labels,
                                                                      loaded.held_out.labels)


def test_shard_reads_label_files_as_training_does(tmp_path):
    """train/IMAGE labelled by --train-labels, val/IMAGE by --val-labels: the shards hold each
    image under its file's class (the files written here), as training reads the folder; the
    label files without --data-dir are one line (the synthetic set was sharded instead)."""
    src = _noise_images(tmp_path / "folder", {"train": 6, "val": 4}, named_by_folder=True)
    (tmp_path / "train.csv").write_text("id,label\n" + "".join(
        f"train{i},{['cat', 'dog'][i % 2]}\n" for i in range(6)))
    (tmp_path / "val.csv").write_text("".join(f"val{i},{['dog', 'cat'][i % 2]}\n"
                                              for i in range(4)))
    labels = ["--train-labels", str(tmp_path / "train.csv"), "--val-labels",
              str(tmp_path / "val.csv")]
    out = tmp_path / "shards"
    result = _shard_here("--data-dir", str(src), *labels, "--output", str(out))
    assert result.returncode == 0, result.stderr
    sets = _index_sets(out)
    assert torch.equal(_decoded(sets["train"])[1], torch.tensor([0, 1, 0, 1, 0, 1]))
    assert torch.equal(_decoded(sets["validation"])[1], torch.tensor([1, 0, 1, 0]))
    from accel_train.config import TrainConfig
    from accel_train.data.sources import load_data
    loaded = load_data(TrainConfig(data_dir=str(src), in_memory="always",
                                   train_labels=labels[1], val_labels=labels[3]))
    assert torch.equal(_decoded(sets["train"])[0], loaded.train.images)
    refused = _shard_here("--dataset", "synthetic", *labels[:2], "--output",
                          str(tmp_path / "other"))
    assert refused.returncode == 2 and refused.stderr.strip().endswith(
        "--train-labels labels the training images of an image folder: pass --data-dir DIR "
        "too"), refused.stderr
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_a_test_split_beside_a_validation_split_is_sharded_and_tested_at_the_end(tmp_path):
    """train/, val/ and test/: shard copies all three (it dropped test/), and a streamed run
    selects on the validation shards and evaluates the test shards once at the end, as the
    map-style run of the folder does (its numbers the oracle)."""
    from PIL import Image
    src = tmp_path / "folder"
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 4), ("test", 6)):
        for cls in ("cat", "dog"):
            (src / split / cls).mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
                    src / split / cls / f"{i}.png")
    out = tmp_path / "shards"
    result = _shard_here("--data-dir", str(src), "--samples-per-shard", "4", "--output",
                         str(out))
    assert result.returncode == 0, result.stderr
    from accel_train.config import TrainConfig
    from accel_train.data.sources import load_data
    loaded = load_data(TrainConfig(data_dir=str(src), in_memory="always"))
    sets = _index_sets(out)
    assert set(sets) == {"train", "validation", "test"}
    for split, source in (("train", loaded.train), ("validation", loaded.held_out),
                          ("test", loaded.test)):
        images, labels = _decoded(sets[split])
        assert torch.equal(images, source.images) and torch.equal(labels, source.labels)
    run = accel_train_here("--data-dir", str(out), "--model", "test_resnet", "--batch-size",
                           "4", "--epochs", "1", "--no-plots", *PINNED, "--output-dir",
                           str(tmp_path / "run"))
    said = run.stdout + run.stderr
    assert run.returncode == 0, said[-3000:]
    assert "validation 8; test 12 kept for the end" in said, said[-3000:]
    assert "(12 images of the test split, evaluated once" in said


@pytest.mark.slow
def test_held_out_shards_of_photographs_in_many_sizes_are_evaluated_as_the_folder_is(tmp_path):
    """An image folder whose validation photographs differ in size (landscape and portrait
    JPEGs), sharded and trained streamed at 48 px: its evaluation gives the numbers that
    `accel-train eval` gives for the same model on the folder itself (map-style, each image
    decoded on demand and prepared by timm's eval transform).  (Refused before: "held-out
    shards of mixed image sizes are not supported yet".)"""
    from PIL import Image
    src, rng = tmp_path / "folder", np.random.default_rng(1)
    for split, count in (("train", 8), ("val", 4)):
        for cls in ("cat", "dog"):
            (src / split / cls).mkdir(parents=True)
            for i in range(count):
                size = (80, 60) if i % 2 else (60, 80)
                pixels = rng.integers(0, 255, (*size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(src / split / cls / f"{i}.jpg", quality=90)
    shards, run = tmp_path / "shards", tmp_path / "run"
    assert _shard_here("--data-dir", str(src), "--samples-per-shard", "8", "--output",
                       str(shards)).returncode == 0
    said = accel_train_here("--data-dir", str(shards), "--model", "test_resnet", "--image-size",
                            "48", "--batch-size", "4", "--max-steps", "2", "--num-workers", "0",
                            "--progress", "log", "--no-plots", *PINNED, "--output-dir",
                            str(run), check=True).stdout
    assert ", 0 loader worker(s)" in said, said  # the slot read in this process: no worker
    streamed = [r for r in metrics_of(run) if r["type"] == "epoch"][-1]
    report = json.loads(accel_train_here("eval", str(run), "--data-dir", str(src), "--json",
                                         check=True).stdout)
    assert report["count"] == streamed["eval_count"] == 8
    assert report["top1"] == pytest.approx(streamed["eval_top1"], abs=1e-6)
    assert report["loss"] == pytest.approx(streamed["eval_loss"], abs=1e-4)


def test_parquet_shards_keep_the_class_names_their_features_give(cifar10_layout, tmp_path):
    """Parquet files streamed as they are (no index) name their classes as `datasets` reads
    them (a ClassLabel in the schema's metadata: CIFAR-10's names), no longer 0..9; a file
    without such metadata still gets numbers."""
    import datasets
    import pyarrow.parquet as pq

    from accel_train.config import TrainConfig
    from accel_train.data.streaming import open_shards
    theirs = datasets.load_dataset("parquet", data_dir=str(cifar10_layout))["train"]
    config = TrainConfig(data_dir=str(cifar10_layout), streaming=True)
    opened = open_shards(config)
    assert opened.class_names == theirs.features["label"].names
    assert len(opened.train) == theirs.num_rows  # counted from the label column
    for kind, metadata in (("plain", None), ("garbled", {"huggingface": "{not json"})):
        folder = tmp_path / kind
        folder.mkdir()
        for split in ("train", "test"):
            table = pq.read_table(cifar10_layout / f"{split}.parquet")
            pq.write_table(table.replace_schema_metadata(metadata), folder / f"{split}.parquet")
        names = open_shards(TrainConfig(data_dir=str(folder), streaming=True)).class_names
        assert names == [str(i) for i in range(10)], kind


def test_shard_progress_off_a_terminal_is_whole_lines(tmp_path):
    """A log file or pipe gets whole progress lines (no carriage returns gluing them into one),
    the last at 100%."""
    from PIL import Image
    src = tmp_path / "folder"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(src / cls / f"{i}.png")
    result = accel_train_here("shard", "--data-dir", str(src), "--output",
                              str(tmp_path / "shards"), check=True)
    lines = result.stderr.splitlines()
    assert "\r" not in result.stderr and lines, result.stderr
    assert all(line.startswith("shard: ") for line in lines), lines
    assert lines[-1].startswith("shard: 6/6 images (100%)"), lines


def _webdataset_tar(path: Path, samples: int) -> None:
    """A WebDataset tar as `tar -cf` makes one of two folders and a README: its README, the
    folders' entries, then KEY.png and KEY.cls a sample, alternately in a/ and b/ under the same
    file names (a sample's key is its path up to the first dot: a/s_0000 and b/s_0000 are two),
    classes 0, 1, 2 in turn, and a/LICENSE half-way (no dot: of no sample, as the README);
    gzipped where the name ends in gz (.tar.gz, .tgz)."""
    from PIL import Image
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz" if path.name.endswith("gz") else "w") as tar:
        readme = b"samples: KEY.png, KEY.cls\n"
        info = tarfile.TarInfo("README")
        info.size = len(readme)
        tar.addfile(info, io.BytesIO(readme))
        for folder in ("a", "b"):
            info = tarfile.TarInfo(folder)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for i in range(samples):
            png = io.BytesIO()
            Image.new("RGB", (16, 16), (40 * i % 256, 90, 200)).save(png, "PNG")
            key = f"{'ab'[i % 2]}/{path.name.split('.')[0]}_{i // 2:04d}"
            members = [(f"{key}.png", png.getvalue()), (f"{key}.cls", str(i % 3).encode())]
            if i == samples // 2:
                members.append(("a/LICENSE", b"CC0\n"))
            for member, data in members:
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("names", [
    # timm's ImageNet WebDataset copies on the hub, in one folder
    ["imagenet1k-train-0000.tar", "imagenet1k-train-0001.tar", "imagenet1k-validation-00.tar"],
    ["train_000.tar", "val_000.tar"],
    ["train2017-000.tar", "test2017-000.tar"],
    ["train/shard-000.tar", "val/shard-000.tar"],
    ["train-000.tar.gz", "train-001.tgz", "validation-000.tar.gz"],  # gzipped, as webdataset's
])
def test_the_split_a_shards_file_name_holds_is_the_one_datasets_reads_there(tmp_path, names):
    """Tars whose names or folders hold their splits: the run trains on and holds out the
    files datasets' own split inference (data_files.get_data_patterns) gives each split, each
    tar's samples and classes counted as written (_webdataset_tar)."""
    from datasets.data_files import DataFilesDict, get_data_patterns
    root = tmp_path / "shards"
    for number, name in enumerate(names):
        _webdataset_tar(root / name, 6 + 2 * number)
    splits = DataFilesDict.from_patterns(get_data_patterns(str(root)), base_path=str(root))
    counts = {str(split): [6 + 2 * names.index(Path(file).relative_to(root).as_posix())
                           for file in files] for split, files in splits.items()}
    held_out = next(split for split in ("validation", "test") if split in counts)
    result = accel_train_here("--data-dir", str(root), *PINNED, "--model", "test_resnet",
                              "--batch-size", "2", "--epochs", "1", "--no-plots",
                              "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"(streamed: {len(counts['train'])} train shards, {sum(counts['train'])} images / "
            f"{held_out} {sum(counts[held_out])}") in result.stdout, result.stdout[-3000:]
    assert ", 3 classes," in result.stdout


def test_an_index_counts_a_tars_samples_as_they_are_read(tmp_path):
    """An index.json beside tars with folder entries and files of no sample (_webdataset_tar):
    the start checks the index's counts against the tars' member names and agrees with it."""
    from accel_train.data.streaming.writer import write_index
    root = tmp_path / "shards"
    splits = {}
    for split, samples in (("train", 9), ("validation", 5)):
        _webdataset_tar(root / f"{split}-000.tar", samples)
        splits[split] = [{"file": f"{split}-000.tar", "count": samples}]
    write_index(root, splits, ["0", "1", "2"], "hand-written tars")
    result = accel_train_here("--data-dir", str(root), *PINNED, "--model", "test_resnet",
                              "--batch-size", "2", "--epochs", "1", "--no-plots",
                              "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(streamed: 1 train shards, 9 images / validation 5" in result.stdout, \
        result.stdout[-3000:]


def test_a_tar_folders_counts_are_cached_until_a_tar_changes(tmp_path, monkeypatch):
    """A folder of tars without an index is counted once (its counts cached in the cache
    folder): a later start counts only the tars whose size or modification time changed, and
    never caches a tar written in the last seconds (it may still be being written)."""
    import os
    import time

    from accel_train.data.streaming import count_cache, shards
    monkeypatch.setenv("ACCEL_TRAIN_INDEX_CACHE", str(tmp_path / "home" / "cache"))  # made
    root = tmp_path / "shards"
    written = {"train-000.tar": 5, "train-001.tar": 7, "val/000.tgz": 3}
    for name, samples in written.items():
        _webdataset_tar(root / name, samples)
        os.utime(root / name, (time.time() - 3600, time.time() - 3600))
    tars = [root / name for name in written]
    counted = []

    def count(path):
        counted.append(Path(os.path.relpath(path, root)).as_posix())
        return shards._count(path)

    def counts(counting=count, say=print):
        counted.clear()
        found = count_cache.counted_tars(root, tars, counting, say)
        return {p.relative_to(root).as_posix(): c for p, c in found.items()}

    expected = {name: (samples, min(samples, 3)) for name, samples in written.items()}
    assert counts() == expected and sorted(counted) == sorted(written)
    assert counts() == expected and counted == []
    os.utime(root / "train-001.tar", (time.time() - 60, time.time() - 60))  # touched
    assert counts() == expected and counted == ["train-001.tar"]
    _webdataset_tar(root / "val/000.tgz", 4)  # written again just now: counted, not cached
    expected["val/000.tgz"] = (4, 3)
    assert counts() == expected and counted == ["val/000.tgz"]
    assert counts() == expected and counted == ["val/000.tgz"]
    # another folder's tars of the same names are its own
    shutil.copytree(root, tmp_path / "copy")
    found = count_cache.counted_tars(tmp_path / "copy", [tmp_path / "copy" / "train-000.tar"],
                                     count)
    assert list(found.values()) == [(5, 3)] and counted[-1] == "../copy/train-000.tar"
    # a count of more than a second says so: a line after the first second, one at its end
    for name in written:  # each touched: counted again
        os.utime(root / name, (time.time() - 60, time.time() - 60))
    said = []

    def slow_count(path):
        time.sleep(0.6)
        return shards._count(path)

    assert counts(slow_count, said.append) == expected
    assert said == [f"counting the samples of {root}'s tars (no index.json; counted once, cached "
                    f"for later starts): 2 of 3 tars, 12 samples so far",
                    said[-1]] and said[-1].startswith(f"counted 16 samples in 3 tars of {root} in ")
    assert said[-1].endswith("s (cached: later starts read the counts)")
    seconds = float(said[-1].split(" in ")[-1].split("s ")[0])
    assert 1.8 <= seconds < 60, said[-1]  # three counts of 0.6 s
    assert counts(count, said.append) == expected and len(said) == 2  # all cached: no line
    # a start's own count goes through the cache
    from accel_train.config import TrainConfig
    count_cache.cache_file(root).unlink()
    opened = shards.open_shards(TrainConfig(data_dir=str(root), streaming=True))
    assert (len(opened.train), len(opened.held_out)) == (12, 4)
    cached = json.loads(count_cache.cache_file(root).read_text())
    assert cached["root"] == str(root)  # (for a reader of the cache folder)
    assert {name: tuple(entry[2:]) for name, entry in cached["tars"].items()} == expected


def test_shard_bad_input_one_line_nothing_written(tmp_path):
    out = tmp_path / "out"
    result = _shard_here("--data-dir", str(tmp_path / "missing"), "--output", str(out))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    result = _shard_here("--dataset", "synthetic", "--shard-size", "lots", "--output", str(out))
    assert result.returncode == 2 and "--shard-size" in result.stderr
    assert not out.exists()


# --- the plan ----------------------------------------------------------------------------------
def _epoch_keys(shards: ShardSet, layout: Layout, epoch: int, buffer: int = 10,
                seed: int = 3) -> list[list[list[int]]]:
    """Per rank, its batches' sample numbers, as the loader workers make them."""
    out = []
    for rank in range(layout.ranks):
        batches = remaining_batches(shards, layout, 0, layout, rank)
        keys = {}
        out.append([[int(k) for slot, a, b in batch
                     for k in keys.setdefault(slot, slot_keys(shards, layout, seed, epoch, slot,
                                                             buffer))[a:b]]
                    for batch in batches])
    return out


@pytest.mark.parametrize("ranks,workers", [(1, 1), (2, 1), (2, 2), (3, 2)])
def test_uneven_shards_each_sample_at_most_once_and_ranks_in_step(ranks, workers):
    """7 shards of uneven sizes over ranks x workers slots: every shard goes to exactly one
    slot, every rank gets the same number of whole batches, no sample twice; the surplus of
    the slots that got more is left out of that epoch (a different surplus each epoch)."""
    counts = [13, 9, 11, 10, 12, 8, 7]
    shards = ShardSet([Path(f"{i}.tar") for i in range(7)], counts)
    layout = Layout(ranks, workers, 4, 1)
    owners = Counter(s for slot in range(layout.slots)
                     for s in slot_shards(shards, layout, 3, 0, slot))
    assert sorted(owners) == list(range(7)) and set(owners.values()) == {1}
    per_rank = rank_batches_per_epoch(shards, layout)
    smallest = sorted(counts)[: 7 // layout.slots]
    assert per_rank == workers * (sum(smallest) // 4)
    trained = []
    for epoch in range(3):
        ranks_keys = _epoch_keys(shards, layout, epoch)
        assert all(len(b) == per_rank for b in ranks_keys)
        keys = [k for rank in ranks_keys for batch in rank for k in batch]
        assert len(keys) == len(set(keys)) == per_rank * 4 * ranks
        trained.append(set(keys))
    if per_rank * 4 * ranks < sum(counts):
        assert len({frozenset(t) for t in trained}) > 1  # the surplus moves between epochs


def test_fewer_shards_than_processes_is_an_error():
    from accel_train.base.errors import UsageError
    from accel_train.data.streaming import fit_workers
    shards = ShardSet([Path("a.tar"), Path("b.tar")], [40, 40])
    assert fit_workers(shards, 1, 8, 1, 4) == 2  # workers lowered to the shards
    with pytest.raises(UsageError, match="2 training shard"):
        fit_workers(shards, 3, 8, 1, 1)


@pytest.mark.parametrize("counts, ranks, batch, wanted, expected", [
    ([40] * 4, 1, 8, 1, 1),   # one asked for: one, though the shards would feed four
    ([40] * 4, 1, 8, 0, 1),   # --num-workers 0 still gets one slot reader
    ([40] * 2, 2, 8, 4, 1),   # one shard per process: one worker each, not a shardless second
    ([12] * 2, 1, 16, 2, 1),  # two workers of 12 samples make no batch of 16; one of 24 does
    ([8] * 4, 1, 16, 4, 2),   # four or three workers of 8 make none; two of 16 each do
])
def test_loader_workers_are_those_asked_for_that_each_have_a_shard_and_a_batch(
        counts, ranks, batch, wanted, expected):
    from accel_train.data.streaming import fit_workers
    shards = ShardSet([Path(f"{i}.tar") for i in range(len(counts))], counts)
    assert fit_workers(shards, ranks, batch, 1, wanted) == expected


def test_shards_that_cannot_fill_one_step_are_one_line():
    from accel_train.base.errors import UsageError
    from accel_train.data.streaming import fit_workers
    with pytest.raises(UsageError, match="cannot fill one optimizer step"):
        fit_workers(ShardSet([Path("a.tar"), Path("b.tar")], [4, 4]), 1, 16, 1, 2)


@pytest.mark.parametrize("old,new", [((2, 1, 4, 1), (2, 1, 4, 1)), ((2, 1, 4, 1), (1, 2, 4, 2)),
                                     ((1, 2, 4, 2), (2, 2, 4, 1)), ((2, 2, 4, 1), (4, 1, 2, 1))])
def test_recut_epoch_trains_the_rest_exactly_once(old, new):
    """Resumed after n optimizer steps on another layout: what was trained plus what the new
    layout trains is the old epoch, each sample once; on the same layout, in the same order."""
    shards = ShardSet([Path(f"{i}.tar") for i in range(8)], [12] * 7 + [5])
    old, new = Layout(*old), Layout(*new)
    global_batch = old.batch * old.ranks * old.accumulation
    assert global_batch == new.batch * new.ranks * new.accumulation
    full = _epoch_keys(shards, old, epoch=1)
    total_steps = rank_batches_per_epoch(shards, old) // old.accumulation
    for steps in range(total_steps + 1):
        done_batches = steps * old.accumulation
        trained = [k for rank in full for batch in rank[:done_batches] for k in batch]
        rest = []
        for rank in range(new.ranks):
            batches = remaining_batches(shards, old, steps * global_batch, new, rank)
            assert len(batches) % new.accumulation == 0
            keys = {}
            mine = [[int(k) for slot, a, b in batch
                     for k in keys.setdefault(slot, slot_keys(shards, old, 3, 1, slot, 10))[a:b]]
                    for batch in batches]
            if old == new:
                assert mine == full[rank][done_batches:]
            rest.append(mine)
        counts = {len(r) for r in rest}
        assert len(counts) == 1  # the new ranks step together
        rest_keys = [k for r in rest for batch in r for k in batch]
        everything = trained + rest_keys
        assert len(everything) == len(set(everything))
        assert set(everything) == {k for rank in full for batch in rank for k in batch}


def _png(value: int) -> bytes:
    import io
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), value, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_broken_sample_takes_the_next_good_sample_of_its_batch_wrapping_around():
    """decode_substituting's rule, by hand: positions 1 and 2 (an image that does not decode, a
    sample with no image) take position 3's image and label; the last (a label of no class)
    wraps around to position 0; a batch with no good sample is one line naming its first."""
    from accel_train.base.errors import UsageError
    from accel_train.data.streaming import decode_substituting
    samples = [(_png(10), 0, "s0"), (b"not an image", 1, "s1"), (None, 2, "s2"),
               (_png(40), 3, "s3"), (_png(50), 4, "s4")]
    images, labels, bad = decode_substituting(samples, "substitute", num_classes=4)
    assert [int(image[0, 0, 0]) for image in images] == [10, 40, 40, 40, 10]
    assert labels == [0, 3, 3, 3, 0]
    assert [position for position, _ in bad] == [1, 2, 4]
    assert bad[2][1] == "label 4 is not one of the 4 classes (0 to 3)"
    with pytest.raises(UsageError, match=r"sample s1 cannot be used \("):
        decode_substituting(samples, "error", num_classes=4)
    with pytest.raises(UsageError) as raised:
        decode_substituting([(b"x", 0, "first"), (None, 1, "second")], "substitute", 4)
    assert str(raised.value).startswith("no sample of a batch can be decoded (the first: first: ")
    assert str(raised.value).endswith("); check the shards")
    reason = str(raised.value).split("first: first: ")[1][:-len("); check the shards")]
    assert reason and "first" not in reason  # the decoder's reason, not a sample's name


def test_shuffle_buffer_plan_is_a_bounded_permutation():
    from accel_train.data.streaming import planned_shuffle
    keys = np.arange(1000)
    order = planned_shuffle(keys, 50, np.random.default_rng(0))
    assert sorted(order.tolist()) == keys.tolist() and not np.array_equal(order, keys)
    # a buffer of 50 hands out sample t no later than ... and no earlier than t - 50 arrives
    position = np.empty(1000, int)
    position[order] = np.arange(1000)
    assert (position >= np.arange(1000) - 50).all()


# --- real runs -----------------------------------------------------------------------------------
STREAM_TRAIN = ["--model", "test_resnet", "--batch-size", "8", "--epochs", "2",
                "--max-eval-samples", "32", "--progress", "log", "--no-plots", "--log-every", "2",
                "--shuffle-buffer", "50", *PINNED]


def _keys_by_epoch(out: Path, num_samples: int = 200) -> dict[int, list[int]]:
    from faults import read_sample_keys
    by_epoch: dict[int, list[int]] = {}
    for key in read_sample_keys(out / "logs"):
        by_epoch.setdefault(key // num_samples, []).append(key % num_samples)
    return by_epoch


def _plan_set(shards: Path, layout: Layout, epoch: int) -> set[int]:
    sets = _index_sets(shards)
    return {k for rank in _epoch_keys(sets["train"], layout, epoch, buffer=50, seed=0)
            for batch in rank for k in batch}


@pytest.mark.slow  # loader workers over shards, > 10 s
def test_one_process_two_workers_each_sample_once_per_epoch(synthetic_shards, tmp_path):
    from fault_entry import SampleLog
    out = tmp_path / "run"
    output = accel_train_here("--data-dir", str(synthetic_shards), *STREAM_TRAIN,
                              "--num-workers", "2", "--output-dir", str(out), check=True,
                              callbacks=[SampleLog(out / "logs", 0)]).stdout
    assert "streamed: 9 train shards" in output and "20 steps/epoch" in output
    assert (out / "model.safetensors").is_file()
    for epoch, keys in _keys_by_epoch(out).items():
        assert len(keys) == len(set(keys)) == 160, epoch
        assert set(keys) == _plan_set(synthetic_shards, Layout(1, 2, 8, 1), epoch)
    state = json.loads(sorted((out / "checkpoints").glob("step_*"))[-1]
                       .joinpath("stream.json").read_text())
    assert state["layout"] == {"ranks": 1, "workers": 2, "batch": 8, "accumulation": 1}


@pytest.fixture(scope="module")
def stream_reference(synthetic_shards, tmp_path_factory):
    """Two processes under torchrun, left alone."""
    from faults import Run, torchrun_cmd
    base = tmp_path_factory.mktemp("stream_reference")
    run = Run(torchrun_cmd("--data-dir", str(synthetic_shards), *STREAM_TRAIN, "--num-workers",
                           "1", "--checkpoint-every", "3", "--output-dir", str(base / "run")),
              base / "run.log")
    try:
        run.check()
    finally:
        run.close()
    return base / "run"


@pytest.mark.slow
def test_sigterm_on_two_processes_then_finished_on_one_each_sample_once(synthetic_shards,
                                                                         tmp_path):
    from fault_entry import STEP_SECONDS_ENV, SampleLog
    from faults import SAMPLE_LOG_ENV, Run, checkpoint_steps, torchrun_cmd, wait_until
    import signal
    out = tmp_path / "run"
    command = ["--data-dir", str(synthetic_shards), *STREAM_TRAIN, "--num-workers", "1",
               "--checkpoint-every", "3", "--output-dir", str(out)]
    # each step of the first start half a second more (a sleep: the samples stay the same),
    # so that the SIGTERM sent once checkpoint 3 appears lands within the first epoch's 10
    first = Run(torchrun_cmd(*command), tmp_path / "first.log",
                **{SAMPLE_LOG_ENV: "1", STEP_SECONDS_ENV: "0.5"})
    try:
        wait_until(lambda: 3 in checkpoint_steps(out), "the first checkpoint", first)
        first.proc.send_signal(signal.SIGTERM)
        first.wait()
    finally:
        first.close()
    stopped = max(checkpoint_steps(out))
    assert 3 <= stopped < 10, "stopped within the first epoch"
    # finished on one process in this process (no new process's seconds of imports)
    output = accel_train_here(*command, "--resume", "auto", check=True,
                              callbacks=[SampleLog(out / "logs", 0)]).stdout
    assert f"at step {stopped}" in output and "accumulation steps 1 -> 2" in output
    by_epoch = _keys_by_epoch(out)
    assert len(by_epoch[0]) == len(set(by_epoch[0])) == 160
    assert set(by_epoch[0]) == _plan_set(synthetic_shards, Layout(2, 1, 8, 1), 0)
    assert len(by_epoch[1]) == len(set(by_epoch[1]))
    assert set(by_epoch[1]) <= _plan_set(synthetic_shards, Layout(1, 1, 8, 2), 1)


# --- bad input -----------------------------------------------------------------------------------
def _files(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*")} if folder.exists() else {}


def test_bad_shard_folders_one_line_exit_2_nothing_written(synthetic_shards, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notar").mkdir()
    (tmp_path / "notar" / "000000.tar").write_text("not a tar\n")
    shutil.copytree(synthetic_shards, tmp_path / "disagree")
    index = json.loads((tmp_path / "disagree" / "index.json").read_text())
    index["splits"]["train"][1]["count"] = 23
    (tmp_path / "disagree" / "index.json").write_text(json.dumps(index))
    shutil.copytree(synthetic_shards, tmp_path / "missing")
    (tmp_path / "missing" / "train" / "000003.tar").unlink()
    shutil.copytree(synthetic_shards, tmp_path / "unlisted")
    shutil.copy(tmp_path / "unlisted" / "train" / "000000.tar",
                tmp_path / "unlisted" / "train" / "000099.tar")
    for name, cls in (("names", b"cat\n"), ("bytes", b"\xff\xfe")):
        (tmp_path / name).mkdir()
        with tarfile.open(tmp_path / name / "000000.tar", "w") as tar:  # webdataset's layout
            for member, data in (("a.jpg", b"\xff\xd8"), ("a.cls", cls)):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "textlabels").mkdir()  # a class name where its index belongs
    pq.write_table(pa.table({"image": [{"bytes": b"\xff\xd8", "path": None}] * 2,
                             "label": ["cat", "dog"]}),
                   tmp_path / "textlabels" / "train.parquet")
    (tmp_path / "nolabels").mkdir()  # images and captions: no column of classes
    pq.write_table(pa.table({"image": [{"bytes": b"\xff\xd8", "path": None}] * 2,
                             "caption": ["a cat", "a dog"]}),
                   tmp_path / "nolabels" / "train.parquet")
    cases = {"names": "000000.tar: a.cls holds 'cat', not a class number; write the class's "
                      "index (0, 1, ...) there",
             "textlabels": "train.parquet: its label column 'label' holds string, not class "
                           "numbers; write each class's index (0, 1, ...) there",
             "nolabels": "train.parquet: cannot tell the image and label columns (columns: "
                         "image, caption); name them with --image-column/--label-column",
             "bytes": "000000.tar: a.cls holds '\ufffd\ufffd', not a class number",
             "empty": "no shards match", "notar": "is not a tar or parquet file",
             "disagree": "index disagrees with the shards",
             "missing": "index disagrees with the shards",
             "unlisted": "does not list train/000099.tar; the index disagrees with the shards"}
    for name, message in cases.items():
        out = tmp_path / f"out_{name}"
        result = accel_train_here("--data-dir", str(tmp_path / name), "--streaming",
                                  "--model", "test_resnet", "--output-dir", str(out))
        assert result.returncode == 2, (name, result.stderr[-2000:])
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, name
        assert not out.exists(), name
    result = accel_train_here("--data-dir", str(tmp_path / "nolabels"), "--streaming",
                              "--label-column", "labels", "--model", "test_resnet",
                              "--output-dir", str(tmp_path / "o"))
    assert result.returncode == 2 and result.stderr.strip().endswith(
        "train.parquet has no column 'labels' (--label-column); its columns: image, caption"), \
        result.stderr[-2000:]
    result = accel_train_here("--data-dir", str(synthetic_shards), "--eval-shards",
                              "nothing/*.tar", "--model", "test_resnet", "--output-dir",
                              str(tmp_path / "o"))
    assert result.returncode == 2 and "no shards match 'nothing/*.tar'" in result.stderr


@pytest.mark.slow  # four runs, 8-9 s on this tier's slowest machine
def test_resume_across_map_style_and_streaming_is_refused(synthetic_shards, tmp_path):
    common = [*PINNED, "--model", "test_resnet", "--batch-size", "8", "--max-steps", "2",
              "--max-eval-samples", "16", "--no-plots", "--progress", "log"]
    map_style = ["--dataset", "synthetic", "--synthetic-train-size", "200"]
    streamed = ["--data-dir", str(synthetic_shards)]
    for n, (first, second, message) in enumerate((
            (map_style, streamed, "saved by a map-style run"),
            (streamed, map_style, "saved by a streaming run"))):
        out = tmp_path / f"run{n}"
        accel_train_here(*first, *common, "--output-dir", str(out), check=True)
        before = _files(out)
        result = accel_train_here(*second, *common, "--output-dir", str(out), "--resume", "auto")
        assert result.returncode == 2, result.stderr[-2000:]
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
        assert _files(out) == before


def _shards_with_broken_samples(root: Path, broken, label_of_no_class: bool = False):
    """64 training and 16 test samples of the synthetic shapes (10 classes) in shards of 16,
    with an index: sample i (0-79, its number in the synthetic set) for which `broken(i, its
    label)` holds has bytes that do not decode, or with `label_of_no_class`, label 10."""
    from accel_train.data import synthetic
    from accel_train.data.streaming import ShardWriter, png_bytes, write_index
    images, labels = synthetic.generate(80, 5)
    no_class = len(synthetic.CLASS_NAMES)
    entries = {}
    for split, rows in (("train", range(64)), ("test", range(64, 80))):
        writer = ShardWriter(root / split, root, None, 16)
        for i in rows:
            is_broken = broken(i, int(labels[i]))
            data = b"this is not an image" if is_broken and not label_of_no_class \
                else png_bytes(images[i])
            writer.write(data, "png", no_class if is_broken and label_of_no_class
                         else int(labels[i]))
        writer.close()
        entries[split] = writer.entries
    write_index(root, entries, list(synthetic.CLASS_NAMES), "test")
    return labels[:64]


@pytest.mark.parametrize("bad", [
    pytest.param("an image that does not decode", marks=pytest.mark.slow),  # 5-8 s on 2 cores
    "a label of no class"])
def test_a_broken_image_in_a_shard_is_replaced_and_named_once(tmp_path, bad):
    """--bad-images substitute (the default): the run goes on with the next good sample of the
    batch in its place and names it once; --bad-images error stops, naming it, exit 2.  A label
    that is none of the index's classes is such a sample (the loss failed on it mid-run, a
    traceback), in training and, left out of the numbers, in the held-out split."""
    from accel_train.data import synthetic
    root = tmp_path / "shards"
    no_class = len(synthetic.CLASS_NAMES)
    _shards_with_broken_samples(root, lambda i, label: i in (5, 70),
                                label_of_no_class=bad.startswith("a label"))
    common = ["--data-dir", str(root), *PINNED, "--model", "test_resnet", "--batch-size", "8",
              "--epochs", "1", "--num-workers", "1", "--no-plots", "--progress", "log"]
    result = accel_train_here(*common, "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    said = (result.stdout + result.stderr).count("000000.tar 000000005")
    assert said == 1, result.stdout + result.stderr
    named = (tmp_path / "run" / "bad_images.txt").read_text()
    assert "000000.tar 000000005" in named
    if bad.startswith("a label"):
        why = f"label {no_class} is not one of the {no_class} classes (0 to {no_class - 1})"
        assert named.count(why) == 2, named  # the training sample and the held-out one
    result = accel_train_here(*common, "--bad-images", "error", "--output-dir",
                              str(tmp_path / "r2"))
    # the held-out split is read whole at the start: its bad sample (the test shard's 7th)
    # stops the run before training does
    assert result.returncode == 2 and "000000.tar 000000006" in result.stderr, result.stderr
    assert bad.startswith("an image") or why in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]


LOST_CLASS = 3


def _lost_class_shards(root: Path) -> tuple[list[str], int]:
    """Shards in which every training sample of class LOST_CLASS is broken: (the run's flags
    on them, how many such samples, counted by hand from the synthetic set's labels)."""
    labels = _shards_with_broken_samples(root, lambda i, label: i < 64 and label == LOST_CLASS)
    count = int((labels == LOST_CLASS).sum())
    assert count >= 2
    return ["--data-dir", str(root), *PINNED, "--model", "test_resnet", "--batch-size", "8",
            "--epochs", "2", "--no-plots", "--progress", "log", "--max-eval-samples", "8"], count


def assert_lost_class_said_once(output: str, count: int, run_dir: Path) -> None:
    from accel_train.data import synthetic
    name = synthetic.CLASS_NAMES[LOST_CLASS]
    said = [line for line in output.splitlines()
            if line.startswith("warning: no training image of class")]
    assert said == [f"warning: no training image of class {name!r} ({count} images) decodes "
                    f"(each was met and replaced): the run trains those outputs on substitutes "
                    f"of other classes, and its numbers for them mean nothing; fix or replace "
                    f"the files (listed in {run_dir / 'bad_images.txt'}), or remove "
                    f"the class, and start again"], output[-3000:]
    assert f"(no training image of class {name!r} ({count} images) decoded)" in output


def test_a_streamed_class_none_of_whose_training_samples_decodes_is_said_once(tmp_path):
    """Every training sample of class 3 in the shards is broken: the run cannot know it before
    reading them (the index holds no labels), so it says so at the end of the first epoch that
    met every sample, once, and in its closing summary, as a map-style run decoding per step
    does.  With one of them decoding, nothing is said."""
    common, count = _lost_class_shards(tmp_path / "shards")
    result = accel_train_here(*common, "--num-workers", "1", "--output-dir",
                              str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_lost_class_said_once(result.stdout + result.stderr, count, tmp_path / "run")
    # one of class 3's samples decodes: nothing said
    root2 = tmp_path / "one_good"
    labels = _shards_with_broken_samples(root2, lambda i, label: False)
    first = int(np.flatnonzero(labels == LOST_CLASS)[0])
    shutil.rmtree(root2)
    _shards_with_broken_samples(root2, lambda i, label: i < 64 and label == LOST_CLASS
                                and i != first)
    common[1] = str(root2)
    result = accel_train_here(*common, "--num-workers", "1", "--output-dir",
                              str(tmp_path / "one"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no training image of class" not in result.stdout + result.stderr


@pytest.mark.slow
def test_on_two_processes_a_streamed_class_none_of_whose_samples_decodes_is_said_once(tmp_path):
    """As above, each rank meeting half the shards: the ranks' counts are summed on rank 0."""
    from faults import Run, torchrun_cmd
    common, count = _lost_class_shards(tmp_path / "shards")
    run = Run(torchrun_cmd(*common, "--num-workers", "0", "--output-dir", str(tmp_path / "run")),
              tmp_path / "run.log")
    try:
        output = run.check()
    finally:
        run.close()
    import yaml
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["resolved"][
        "world_size"] == 2
    assert_lost_class_said_once(output, count, tmp_path / "run")


@pytest.mark.slow
def test_two_then_one_then_two_processes_each_sample_once(synthetic_shards, tmp_path):
    """SIGTERM on 2 processes, then on 1, then 2 finish: a stop inside an epoch that was itself
    re-cut for another layout still trains each of its samples once."""
    import signal

    from faults import (SAMPLE_LOG_ENV, Run, checkpoint_steps, python_cmd, torchrun_cmd,
                        wait_until)
    out = tmp_path / "run"
    command = ["--data-dir", str(synthetic_shards), *STREAM_TRAIN, "--num-workers", "1",
               "--checkpoint-every", "2", "--output-dir", str(out)]
    log = {SAMPLE_LOG_ENV: "1"}
    stops = []
    for cmd, after in ((torchrun_cmd(*command), 2),
                       (python_cmd(*command, "--resume", "auto"), None)):
        run = Run(cmd, tmp_path / f"run{len(stops)}.log", **log)
        try:
            floor = after if after is not None else stops[-1] + 1
            wait_until(lambda floor=floor: [s for s in checkpoint_steps(out) if s >= floor],
                       "a checkpoint", run)
            run.proc.send_signal(signal.SIGTERM)
            run.wait()
        finally:
            run.close()
        stops.append(max(checkpoint_steps(out)))
    assert stops[0] < stops[1] < 20, stops
    last = Run(torchrun_cmd(*command, "--resume", "auto"), tmp_path / "last.log", **log)
    try:
        output = last.check()
    finally:
        last.close()
    assert f"at step {stops[1]}" in output
    by_epoch = _keys_by_epoch(out)
    assert len(by_epoch[0]) == len(set(by_epoch[0])) == 160
    assert set(by_epoch[0]) == _plan_set(synthetic_shards, Layout(2, 1, 8, 1), 0)
    assert len(by_epoch[1]) == len(set(by_epoch[1])) == 160
    assert set(by_epoch[1]) <= (_plan_set(synthetic_shards, Layout(2, 1, 8, 1), 1)
                                | _plan_set(synthetic_shards, Layout(1, 1, 8, 2), 1))


@pytest.mark.slow  # a streamed run and its eval, > 20 s
def test_eval_of_a_streamed_run_reads_its_held_out_shards(stream_reference):
    """`accel-train eval RUN` on a run trained from shards evaluates the held-out shards and
    gives the numbers of the run's last epoch line; its training shards are not evaluable."""
    result = accel_train_here("eval", str(stream_reference), "--json", check=True)
    report = json.loads(result.stdout)
    last_epoch = [r for r in metrics_of(stream_reference) if r["type"] == "epoch"][-1]
    assert report["count"] == last_epoch["eval_count"] == 32
    assert report["top1"] == pytest.approx(last_epoch["eval_top1"], abs=1e-6)
    refused = accel_train_here("eval", str(stream_reference), "--split", "train")
    assert refused.returncode == 2 and "--split train" in refused.stderr


def metrics_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def test_a_tars_samples_are_those_datasets_webdataset_loader_reads(tmp_path):
    """Member names as ImageNet's file names make them (upper-case extensions, a class field
    named after its image) and a LICENSE among them: each sample's image and class as Hugging
    Face datasets' webdataset loader decodes them (a field by its name's last part: .JPEG.cls a
    class; a name without a dot is no sample's)."""
    import datasets
    from PIL import Image

    from accel_train.data.streaming import iter_tar
    members = []
    for i, key in enumerate(["n01440764_10026", "n01443537_2", "n01484850_3"]):
        png = io.BytesIO()
        Image.new("RGB", (8, 8), (60 * i, 0, 0)).save(png, "PNG")
        members += [(f"{key}.JPEG", png.getvalue()), (f"{key}.JPEG.cls", str(i + 4).encode()),
                    (f"{key}.json", b'{"w": 8}')]
    members.insert(3, ("LICENSE", b"CC0\n"))  # no dot, no key: of no sample
    path = tmp_path / "train-000000.tar"
    with tarfile.open(path, "w") as tar:
        for member, data in members:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    rows = datasets.load_dataset("webdataset", data_files={"train": str(path)}, split="train",
                                 cache_dir=str(tmp_path / "cache"))
    expected = []
    for row in rows:
        expected.append((row["__key__"], row["JPEG.cls"], np.asarray(row["JPEG"]).tolist()))
    ours = [(name, label, np.asarray(Image.open(io.BytesIO(data))).tolist())
            for data, label, name in iter_tar(path)]
    assert ours == expected and [label for _, label, _ in ours] == [4, 5, 6]
    # the same tar gzipped, as webdataset reads a .tar.gz (datasets' loader reads no such file)
    gzipped = tmp_path / "train-000000.tar.gz"
    gzipped.write_bytes(gzip.compress(path.read_bytes()))
    assert [(name, label, np.asarray(Image.open(io.BytesIO(data))).tolist())
            for data, label, name in iter_tar(gzipped)] == expected
