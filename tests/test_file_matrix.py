"""The corruption matrix: every kind of file the product reads (readers.KINDS), each
corruption, each command that reads it.  Exit 2 with one line naming the file, or the documented
fallback (an older good checkpoint, with a warning; a partial last line left out; a cache
rebuilt), never a traceback, and the run folder's files byte-identical before and after.

Generated from ROWS: a kind's row says how to reach its file in a trained run, what each
corruption writes there and which commands read it.  A checkpoint's own files are sealed by its
manifest's checksums, so to reach a part's own check the corrupted file's checksum is written
back into the manifest (a "hand-edited checkpoint"); the unsealed corruptions are the
manifest's to catch.  `test_every_kind_has_a_row` fails when the product reads a kind of file
(registered in readers.py, named by a reader call) that has no row here.

The oracles are independent of the product: the library's own error text where the line quotes
it (json, yaml, safetensors), SHA-256 hashes of every file, and the checkpoint's own files.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from conftest import REPO, TINY_TRAIN, accel_train_here

from accel_train.base import readers

HALF_STEP, STEP = "step_00000001", "step_00000002"
# the optional checkpointed parts, so that their files are in the checkpoint to corrupt
EMA = ["--model-ema", "--lookahead-every", "1"]


# -- corruptions: each writes over one file ------------------------------------------------------
def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _random_bytes(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 16)  # not UTF-8, not JSON/YAML, no known header


def _json_of_another_shape(path: Path) -> None:
    path.write_text('{"step": "two", "files": [], "epoch": null}\n')


def _yaml_of_another_shape(path: Path) -> None:
    path.write_text("- a list\n- where a mapping belongs\n")


def _jsonl_of_another_shape(path: Path) -> None:
    path.write_text("[1, 2]\n[3, 4]\n")


def _another_models_weights(path: Path) -> None:
    """test_resnet's tensors for 3 classes: the same names, a classifier of another shape."""
    import timm
    from safetensors.torch import save_file
    state = timm.create_model("test_resnet", num_classes=3).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


def _another_models_config(path: Path) -> None:
    """The same classes, another network (resnet18's tensors do not fit test_resnet's)."""
    spec = json.loads(path.read_text())
    path.write_text(json.dumps({**spec, "model_name": "resnet18"}))


def _unknown_key(path: Path) -> None:
    """A key this version never writes (a newer accel_train's, or a hand edit)."""
    spec = json.loads(path.read_text())
    path.write_text(json.dumps({**spec, "stem_width": 64}))


def test_model_configs_keys_are_the_model_specs_fields():
    """readers.py lists the keys model_config.json may hold (it cannot import model.py); they
    must stay ModelSpec's fields, or a new field would be refused as unknown."""
    from dataclasses import fields

    from accel_train.model.saved import ModelSpec
    shape = readers.KINDS["model_config"].shape
    assert set(shape.keys) | shape.optional == {f.name for f in fields(ModelSpec)}


def _another_timm_config(path: Path) -> None:
    """A run's config.json (timm's layout) naming another network: resnet18's tensors."""
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "architecture": "resnet18"}))


COMMON = {"empty": _empty, "cut in half": _cut_in_half, "random bytes": _random_bytes}
JSON = {**COMMON, "JSON of another shape": _json_of_another_shape}
YAML = {**COMMON, "YAML of another shape": _yaml_of_another_shape}
WEIGHTS = {**COMMON, "another model's weights": _another_models_weights}


# -- the trained run every case copies -----------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Two steps with EMA and lookahead, a checkpoint after each: step_1 is the older good
    one."""
    out = tmp_path_factory.mktemp("matrix") / "run"
    accel_train_here(*TINY_TRAIN, *EMA, "--max-steps", "2", "--checkpoint-every", "1",
                     "--output-dir", str(out), check=True)
    assert (out / "checkpoints" / STEP / "ema.safetensors").is_file()
    assert (out / "checkpoints" / STEP / "lookahead.safetensors").is_file()
    return out


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    from PIL import Image
    path = tmp_path_factory.mktemp("matrix_image") / "x.png"
    Image.new("RGB", (32, 32), (200, 30, 30)).save(path)
    return path


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _seal(checkpoint: Path, name: str) -> None:
    """Write the file's new checksum and size into the manifest: a hand-edited checkpoint."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _commands(run: Path, image: Path, tmp: Path) -> dict[str, list[str]]:
    checkpoint = run / "checkpoints" / STEP
    resume = [*TINY_TRAIN, *EMA, "--max-steps", "3", "--output-dir", str(run), "--resume"]
    return {
        "train --resume auto": [*resume, "auto"],
        "train --resume PATH": [*resume, str(checkpoint)],
        "eval CHECKPOINT": ["eval", str(checkpoint)],
        "predict CHECKPOINT": ["predict", str(checkpoint), str(image)],
        "export CHECKPOINT": ["export", str(checkpoint), "-o", str(tmp / "export")],
        "eval RUN": ["eval", str(run)],
        "predict RUN": ["predict", str(run), str(image)],
        "export RUN": ["export", str(run), "-o", str(tmp / "export")],
        "plot": ["plot", str(run), "-o", str(tmp / "plots")],
    }


def _one_line(result, path: Path) -> str:
    """Exit 2, no traceback, and one error line naming `path` or the checkpoint that holds it
    (warnings may come before)."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.strip().splitlines()
             if not line.startswith("warning:")]
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] or path.name in lines[0] or str(path.parent) in lines[0], \
        (path, lines[0])
    return lines[0]


# -- the rows -------------------------------------------------------------------------------------
@dataclass
class Row:
    kind: str                       # readers.KINDS
    file: str                       # relative to the run folder
    corruptions: dict[str, Callable[[Path], None]]
    commands: list[str]             # keys of _commands
    sealed: bool = False            # a checkpoint file: its checksum written into the manifest
    says: dict[str, str] = field(default_factory=dict)  # corruption -> text the line holds


CHECKPOINT = f"checkpoints/{STEP}"
RESUMES = ["train --resume auto", "train --resume PATH"]
READS_CHECKPOINT = ["eval CHECKPOINT", "predict CHECKPOINT", "export CHECKPOINT"]
READS_RUN = ["eval RUN", "predict RUN", "export RUN"]
SHAPE = "is not a checkpoint's"
ROWS = [
    Row("trainer_state", f"{CHECKPOINT}/trainer_state.json", JSON, RESUMES + READS_CHECKPOINT,
        sealed=True, says={"JSON of another shape": SHAPE}),
    Row("loader_state", f"{CHECKPOINT}/loader.json", JSON, RESUMES, sealed=True,
        says={"JSON of another shape": SHAPE}),
    Row("schedule", f"{CHECKPOINT}/schedule.json", JSON, RESUMES, sealed=True,
        says={"JSON of another shape": SHAPE}),
    Row("bad_images", f"{CHECKPOINT}/bad_images.json", JSON, RESUMES, sealed=True,
        says={"JSON of another shape": "has 'files' = '[]', not text"}),
    Row("model_config", f"{CHECKPOINT}/model_config.json",
        {**JSON, "another model's file": _another_models_config, "a key it never writes":
         _unknown_key}, RESUMES + READS_CHECKPOINT,
        sealed=True, says={"JSON of another shape": "has no 'model_name'",
                           "another model's file": "resnet18",
                           "a key it never writes": "has 'stem_width', a key no accel_train"}),
    Row("checkpoint_weights", f"{CHECKPOINT}/model.safetensors", WEIGHTS,
        RESUMES + READS_CHECKPOINT, sealed=True),
    Row("checkpoint_weights", f"{CHECKPOINT}/ema.safetensors", WEIGHTS, RESUMES, sealed=True,
        says={"another model's weights": "holds another model's weights"}),
    Row("checkpoint_weights", f"{CHECKPOINT}/lookahead.safetensors", WEIGHTS, RESUMES,
        sealed=True, says={"another model's weights": "holds another model's weights"}),
    Row("accelerate_state", f"{CHECKPOINT}/optimizer.bin", COMMON, RESUMES, sealed=True),
    Row("accelerate_state", f"{CHECKPOINT}/random_states_0.pkl", COMMON, RESUMES, sealed=True),
    Row("timm_config", "config.json", {**JSON, "another model's file": _another_timm_config},
        READS_RUN, says={"JSON of another shape": "has no 'architecture'",
                         "another model's file": "does not fit"}),
    Row("run_weights", "model.safetensors", WEIGHTS, READS_RUN),
    Row("run_config", "config.yaml", YAML, ["eval RUN", "plot"]),
]


def _cases():
    """Every row x corruption x command, but --resume PATH with one corruption a row: past
    choosing the checkpoint it reads the parts exactly as --resume auto does (and costs a
    second each)."""
    for row in ROWS:
        for corruption in row.corruptions:
            for command in row.commands:
                if command == "train --resume PATH" and corruption != "cut in half":
                    continue
                yield pytest.param(row, corruption, command,
                                   id=f"{row.file}-{corruption}-{command}")


@pytest.mark.parametrize("row, corruption, command", list(_cases()))
def test_a_damaged_file(trained, image, tmp_path, row, corruption, command):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    path = run / row.file
    row.corruptions[corruption](path)
    if row.sealed:
        _seal(path.parent, path.name)
    before = _hashes(run)
    result = accel_train_here(*_commands(run, image, tmp_path)[command])
    line = _one_line(result, path)
    if corruption in row.says:
        assert row.says[corruption] in line, line
    assert _hashes(run) == before
    assert not (tmp_path / "export").exists()


def test_a_run_config_cut_at_any_line_end_is_refused(trained, tmp_path):
    """config.yaml cut at a line's end still parses where the cut lands inside a mapping (the
    half above landed so for some lengths of the file, which the commit id it records moves):
    every such cut before its last keys' values is refused, and eval says so in one line.
    (Training writes it whole and renames it: no reader sees a cut inside the last list.)"""
    from accel_train.base.readers import BadFile
    from accel_train.commands.artifacts import read_run_config

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    whole = (run / "config.yaml").read_text()
    lines = whole.splitlines(keepends=True)
    last_keys = next(i for i, line in enumerate(lines) if line.startswith("versions:"))
    command = next(i for i, line in enumerate(lines) if line.startswith("command:"))
    assert command > last_keys   # the last key, a list: a cut after its name leaves it empty
    for end in range(1, command + 2):
        (run / "config.yaml").write_text("".join(lines[:end]))
        with pytest.raises(BadFile):
            read_run_config(run)
    (run / "config.yaml").write_text("".join(lines[:last_keys]))
    before = _hashes(run)
    line = _one_line(accel_train_here("eval", str(run)), run / "config.yaml")
    assert "has no 'versions'" in line and _hashes(run) == before
    (run / "config.yaml").write_text(whole)
    assert read_run_config(run)["resolved"]["world_size"] == 1


# -- the manifest: the checkpoint's seal ---------------------------------------------------------
def _format(value) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        manifest = json.loads(path.read_text())
        manifest.pop("format")
        path.write_text(json.dumps({**manifest, **({} if value is None else {"format": value})}))
    return write


MANIFEST_CASES = {**JSON, "an older checkpoint format": _format(None),
                  "a newer checkpoint format": _format(99)}
MANIFEST_SAYS = {"an older checkpoint format": "format 1, which this version",
                 "a newer checkpoint format": "upgrade accel_train"}


@pytest.mark.parametrize("command", ["train --resume PATH", "eval CHECKPOINT"])
@pytest.mark.parametrize("corruption", list(MANIFEST_CASES))
def test_a_damaged_manifest(trained, image, tmp_path, corruption, command):
    """--resume PATH or eval of that checkpoint: one line naming it (the formats: which one
    wrote it, or to upgrade); eval reads weights and files only, so another format is read."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    MANIFEST_CASES[corruption](run / CHECKPOINT / "manifest.json")
    before = _hashes(run)
    result = accel_train_here(*_commands(run, image, tmp_path)[command])
    if "format" in corruption and command == "eval CHECKPOINT":
        assert result.returncode == 0, result.stderr
    else:
        line = _one_line(result, run / CHECKPOINT)
        assert MANIFEST_SAYS.get(corruption, "unreadable manifest") in line, line
    assert _hashes(run) == before


@pytest.mark.parametrize("corruption", list(MANIFEST_CASES))
def test_a_damaged_manifest_under_resume_auto(trained, tmp_path, corruption):
    """--resume auto: a damaged manifest is passed over for the older good checkpoint, with a
    warning naming it (the documented fallback; the run then goes on from there, and the damaged
    checkpoint is kept, byte-identical, as superseded-); a checkpoint of another format is one
    line, nothing moved (it is not damaged: passing over it would redo its steps)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    damaged = run / CHECKPOINT
    MANIFEST_CASES[corruption](damaged / "manifest.json")
    before = _hashes(run)
    result = accel_train_here(*_commands(run, Path(), tmp_path)["train --resume auto"])
    if "format" in corruption:
        line = _one_line(result, damaged)
        assert MANIFEST_SAYS[corruption] in line
        assert _hashes(run) == before
        return
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout + result.stderr
    assert f"warning: skipping checkpoint {damaged}: unreadable manifest" in said
    assert f"resumed from {run / 'checkpoints' / HALF_STEP}" in result.stdout
    kept = run / "checkpoints" / f"superseded-{STEP}"
    assert _hashes(kept) == {name[len(CHECKPOINT) + 1:]: digest for name, digest in before.items()
                             if name.startswith(CHECKPOINT + "/")}


@pytest.mark.parametrize("command", ["train --resume PATH", "eval CHECKPOINT"])
def test_a_checkpoint_file_changed_without_its_manifest(trained, image, tmp_path, command):
    """Not hand-edited: the manifest's checksum catches any part's file changed, before the
    part reads it (one line; under --resume auto the older good checkpoint, tests/
    test_checkpoint.py)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    _cut_in_half(run / CHECKPOINT / "loader.json")
    before = _hashes(run)
    line = _one_line(accel_train_here(*_commands(run, image, tmp_path)[command]),
                     run / CHECKPOINT)
    assert "loader.json does not match its checksum" in line
    assert _hashes(run) == before


# -- metrics.jsonl: a partial last line is left out ----------------------------------------------
METRICS = {"empty": _empty, "cut in half": _cut_in_half, "random bytes": _random_bytes,
           "JSON of another shape": _jsonl_of_another_shape}


@pytest.mark.parametrize("command", ["plot", "train --resume auto"])
@pytest.mark.parametrize("corruption", list(METRICS))
def test_damaged_metrics(trained, image, tmp_path, corruption, command):
    """plot and a resume: a file cut short (a run killed mid-line) is read without its partial
    line, with a warning (plot draws, the resume goes on); garbage or lines that are not records
    are one line naming the file and line; an empty file is no records (plot says so; a resume
    starts its log afresh)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    metrics = run / "metrics.jsonl"
    METRICS[corruption](metrics)
    before = _hashes(run)
    result = accel_train_here(*_commands(run, image, tmp_path)[command])
    if corruption in ("random bytes", "JSON of another shape"):
        assert "line 1 is not a metrics record" in _one_line(result, metrics)
        assert _hashes(run) == before
    elif corruption == "empty" and command == "plot":
        assert "holds no training or epoch lines" in _one_line(result, metrics)
        assert not (tmp_path / "plots").exists()  # nothing to draw: no folder left behind
    elif command == "plot":  # the partial line left out, with a warning; what is left plotted
        assert f"warning: the last line of {metrics} is cut short" in result.stderr
        assert result.returncode == 0 or "holds no training or epoch lines" in \
            _one_line(result, metrics)
    else:  # the resume goes on; its metrics.jsonl is whole lines again
        assert result.returncode == 0, result.stderr[-3000:]
        assert all(isinstance(json.loads(line), dict)
                   for line in metrics.read_text().splitlines())


# -- what users hand us: a recipe, accelerate's and the elastic YAML -----------------------------
def _yaml_error(path: Path) -> str:
    """What PyYAML itself says of the file (the oracle for the line's reason), or ''."""
    import yaml
    try:
        yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        return str(err).splitlines()[0]
    return ""


def _user_yaml_case(tmp_path: Path, kind: str, corruption: str) -> tuple[Path, list[str]]:
    if kind == "recipe":
        path = tmp_path / "recipe.yaml"
        path.write_text("batch_size: 16\nlearning_rate: 0.05\nepochs: 1\n")
        return path, [*TINY_TRAIN, "--config", str(path), "--output-dir", str(tmp_path / "r")]
    config = REPO / "accelerate_configs" / "cpu_2proc.yaml"
    if kind == "accelerate_config":
        path = tmp_path / "accelerate.yaml"
        shutil.copy(config, path)
        return path, ["launch", "--config_file", str(path), "--dry-run"]
    path = tmp_path / "elastic.yaml"
    path.write_text("max_restarts: 3\nmonitor_interval: 5\nrdzv_backend: c10d\n")
    return path, ["launch", "--config_file", str(config), "--elastic", str(path), "--dry-run"]


@pytest.mark.parametrize("corruption", list(YAML))
@pytest.mark.parametrize("kind", ["recipe", "accelerate_config", "elastic_config"])
def test_a_damaged_yaml_we_are_handed(tmp_path, kind, corruption):
    """--config, --config_file, --elastic: one line naming the file; an empty recipe or elastic
    file is no settings (and accelerate refuses an empty config in the same one line)."""
    path, command = _user_yaml_case(tmp_path, kind, corruption)
    YAML[corruption](path)
    if corruption == "empty" and kind != "accelerate_config":
        from accel_train.commands.launch import read_yaml
        from accel_train.config import load_run_yaml
        assert (load_run_yaml(str(path)) if kind == "recipe" else read_yaml(str(path), "x")) == {}
        return
    line = _one_line(accel_train_here(*command), path)
    if corruption == "cut in half" and _yaml_error(path):  # else shorter YAML, still refused
        assert f"is not valid YAML ({_yaml_error(path)[:100]}" in line
    elif corruption == "random bytes":
        assert "is not UTF-8 text" in line
    elif corruption == "YAML of another shape":
        assert "holds a list; expected a mapping" in line
    assert not (tmp_path / "r").exists()


# -- data: parquet, shards and their index, an image folder's cached index -----------------------
@pytest.mark.parametrize("command", ["train", "check-data", "shard", "train --streaming"])
@pytest.mark.parametrize("corruption", list(COMMON))
def test_a_damaged_parquet_file(cifar10_layout, tmp_path, command, corruption):
    data = tmp_path / "data"
    shutil.copytree(cifar10_layout, data)
    COMMON[corruption](data / "test.parquet")
    before = _hashes(data)
    out = tmp_path / "out"
    args = {"train": [*TINY_TRAIN, "--data-dir", str(data), "--output-dir", str(out)],
            "check-data": ["check-data", "--data-dir", str(data)],
            "shard": ["shard", "--no-progress", "--data-dir", str(data), "--output", str(out)],
            "train --streaming": [*TINY_TRAIN, "--data-dir", str(data), "--streaming",
                                  "--output-dir", str(out)]}
    line = _one_line(accel_train_here(*args[command]), data / "test.parquet")
    if command == "train --streaming" and corruption != "cut in half":  # no parquet header
        assert f"shard {data / 'test.parquet'} is not a tar or parquet file" in line, line
    elif command == "train --streaming":  # read as a shard
        assert f"shard {data / 'test.parquet'}: is not a readable parquet file (" in line, line
    else:
        assert "is not a readable parquet file" in line and "copy it again" in line
    assert _hashes(data) == before and not out.exists()


@pytest.fixture(scope="module")
def saved_dataset(cifar10_layout, tmp_path_factory) -> Path:
    """The parquet layout saved by datasets' own save_to_disk (train and test splits)."""
    import datasets
    folder = tmp_path_factory.mktemp("saved") / "cifar10"
    datasets.load_dataset("parquet", data_files={
        split: str(cifar10_layout / f"{split}.parquet") for split in ("train", "test")}
    ).save_to_disk(str(folder))
    return folder


@pytest.fixture(scope="module")
def saved_split(cifar10_layout, tmp_path_factory) -> Path:
    """One Dataset saved by save_to_disk (no dataset_dict.json: the folder is the split)."""
    import datasets
    folder = tmp_path_factory.mktemp("saved_split") / "cifar10"
    datasets.load_dataset("parquet", data_files=str(cifar10_layout / "train.parquet"),
                          split="train").save_to_disk(str(folder))
    return folder


def _json_list(path: Path) -> None:
    path.write_text("[1, 2]\n")


def _nameless_data_file(path: Path) -> None:
    path.write_text('{"_data_files": [3]}\n')


SAVED = {**JSON, "a JSON list": _json_list, "a data file without its name": _nameless_data_file,
         "removed": Path.unlink}
SAVED_CASES = [("dataset_dict.json", c) for c in JSON] + [
    ("train/state.json", c) for c in [*JSON, "a data file without its name"]] + [
    ("test/dataset_info.json", c) for c in [*COMMON, "a JSON list"]] + [
    ("test/data-00000-of-00001.arrow", c) for c in [*COMMON, "removed"]] + [
    (f"single:{name}", c) for name in ("state.json", "data-00000-of-00001.arrow")
    for c in COMMON]


@pytest.mark.parametrize("command", ["train", "check-data"])
@pytest.mark.parametrize("file, corruption", SAVED_CASES)
def test_a_damaged_save_to_disk_folder(saved_dataset, saved_split, tmp_path, command, file,
                                       corruption):
    """Each file datasets' load_from_disk reads, of a DatasetDict's folder or (single:) one
    Dataset's: one line naming it after the flag that named the folder (the JSON decoder's or
    Arrow's own reason quoted), exit 2, the folder untouched, nothing written."""
    data = tmp_path / "data"
    single = file.startswith("single:")
    shutil.copytree(saved_split if single else saved_dataset, data)
    file = file.removeprefix("single:")
    assert (data / file).is_file(), sorted(p.name for p in data.rglob("*"))
    SAVED[corruption](data / file)
    before = _hashes(data)
    out = tmp_path / "out"
    args = {"train": [*TINY_TRAIN, "--data-dir", str(data), "--output-dir", str(out)],
            "check-data": ["check-data", "--data-dir", str(data)]}
    line = _one_line(accel_train_here(*args[command]), data / file)
    assert f"--data-dir {data}: {data / file}: " in line, line
    assert line.endswith("save the dataset again with save_to_disk, or copy the folder again"), \
        line
    if corruption == "a data file without its name":
        assert "lists '3' as a data file" in line, line
    if corruption == "removed":
        assert f"{data / file}: no such file;" in line, line
    elif file.endswith(".arrow"):  # Arrow's own reason, asked of pyarrow here
        reason = _arrow_stream_error(data / file)
        assert f"is not a readable Arrow file ({reason}); it may be cut short" in line, line
    assert _hashes(data) == before and not out.exists()


def _arrow_stream_error(path: Path) -> str:
    """pyarrow's first line (cut at 120 characters) when the file is read as the Arrow stream
    save_to_disk writes."""
    import pyarrow as pa
    try:
        with pa.memory_map(str(path)) as source:
            for _ in pa.ipc.open_stream(source):
                pass
    except (pa.ArrowException, OSError) as err:
        return str(err).strip().splitlines()[0][:120]
    raise AssertionError(f"{path} reads as an Arrow stream")


@pytest.mark.parametrize("which", ["a DatasetDict", "one Dataset"])
def test_an_intact_save_to_disk_folder_trains(saved_dataset, saved_split, tmp_path, which):
    """The checks pass folders that datasets itself wrote (the control for the cases above)."""
    data = saved_dataset if which == "a DatasetDict" else saved_split
    result = accel_train_here(*TINY_TRAIN, "--data-dir", str(data), "--max-steps", "1",
                              "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("matrix_shards") / "shards"
    accel_train_here("shard", "--no-progress", "--dataset", "synthetic", "--synthetic-train-size",
                     "96", "--samples-per-shard", "48", "--output", str(out), check=True)
    return out


def _first_tar(folder: Path) -> Path:
    return sorted(folder.rglob("*.tar"))[0]


SHARD_CASES = [("index.json", c) for c in JSON] + [("a tar shard", c) for c in COMMON] + [
    ("a tar shard without an index", c) for c in COMMON] + [  # every tar counted at the start
    ("a gzipped tar shard without an index", c) for c in COMMON]


@pytest.mark.parametrize("command", ["train", "check-data"])
@pytest.mark.parametrize("file, corruption", SHARD_CASES)
def test_a_damaged_shard_folder(shards, tmp_path, file, corruption, command):
    """Training from shards, or checking them: a damaged index.json or shard is one line
    naming it."""
    data = tmp_path / "shards"
    shutil.copytree(shards, data)
    if file.endswith("without an index"):
        (data / "index.json").unlink()
    path = data / "index.json" if file == "index.json" else _first_tar(data)
    if file.startswith("a gzipped"):  # as webdataset reads one: KEY.cls and KEY.png in a .tar.gz
        gzipped = path.with_name(path.name + ".gz")
        gzipped.write_bytes(gzip.compress(path.read_bytes()))
        path.unlink()
        path = gzipped
    (JSON if file == "index.json" else COMMON)[corruption](path)
    before = _hashes(data)
    out = tmp_path / "run"
    args = {"train": [*TINY_TRAIN, "--data-dir", str(data), "--output-dir", str(out)],
            "check-data": ["check-data", "--data-dir", str(data)]}[command]
    line = _one_line(accel_train_here(*args), path)
    if file == "index.json" and corruption == "JSON of another shape":
        assert "is not a shard folder's index.json (it has no 'splits')" in line
    assert _hashes(data) == before and not out.exists()


@pytest.mark.slow
def test_a_damaged_stream_state(shards, tmp_path):
    """A streaming run's stream.json, hand-edited: one line for each corruption, the run
    folder byte-identical (one run trained, its checkpoint copied per corruption)."""
    base = tmp_path / "base"
    train = [*TINY_TRAIN, "--data-dir", str(shards), "--max-steps", "2", "--checkpoint-every",
             "1"]
    accel_train_here(*train, "--output-dir", str(base), check=True)
    for corruption, damage in JSON.items():
        run = tmp_path / corruption.replace(" ", "_")
        shutil.copytree(base, run)
        path = run / CHECKPOINT / "stream.json"
        damage(path)
        _seal(path.parent, path.name)
        before = _hashes(run)
        line = _one_line(accel_train_here(*train, "--max-steps", "3", "--output-dir", str(run),
                                          "--resume", "auto"), path)
        assert corruption != "JSON of another shape" or SHAPE in line
        assert _hashes(run) == before, corruption


def test_a_damaged_image_folder_cache(tmp_path):
    """The cached index of an image folder (imagefolder.py; what train and check-data read):
    damaged in any way it is not an error but rebuilt by walking the folder (the documented
    fallback), for each corruption.  Through index_folder with its cache threshold at 0: the
    commands cache only folders of thousands of images."""
    from PIL import Image

    from accel_train.data.imagefolder import index_folder
    root = tmp_path / "images"
    for s, split in enumerate(("train", "test")):
        for c, label in enumerate(("a", "b")):
            (root / split / label).mkdir(parents=True)
            for i in range(2):  # each image its own colour: no file in two splits
                Image.new("RGB", (8, 8), (60 * i, 100 * c, 100 * s)).save(
                    root / split / label / f"{i}.png")
    old = time.time() - 3600  # older than the cache's "folder may still be filling" window
    for folder in [root, *root.rglob("*")]:
        os.utime(folder, (old, old))
    walked = index_folder(root, cache_dir=tmp_path / "cache", cache_min_files=0, say=str)
    cache = next((tmp_path / "cache").glob("*.arrow"))
    good = cache.read_bytes()
    assert index_folder(root, cache_dir=tmp_path / "cache", cache_min_files=0).cached
    for corruption, damage in {**COMMON, "another shape": _json_of_another_shape}.items():
        damage(cache)
        again = index_folder(root, cache_dir=tmp_path / "cache", cache_min_files=0, say=str)
        assert not again.cached and again.class_names == walked.class_names, corruption
        assert {s: p.to_pylist() for s, (p, _) in again.splits.items()} == \
            {s: p.to_pylist() for s, (p, _) in walked.splits.items()}
        assert cache.read_bytes() == good, corruption  # rebuilt


def test_a_damaged_shard_counts_cache(tmp_path, monkeypatch):
    """The cached sample counts of a folder of tars without an index (count_cache.py; what a
    streamed run's start reads): damaged in any way it is not an error but counted again from
    the tars and rewritten (the documented fallback), for each corruption."""
    import io
    import tarfile

    from accel_train.data.streaming import count_cache, shards
    monkeypatch.setenv("ACCEL_TRAIN_INDEX_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "tars"
    root.mkdir()
    with tarfile.open(root / "train-000.tar", "w") as tar:  # 3 samples of classes 0, 1, 4
        for key, label in (("a", 0), ("b", 1), ("c", 4)):
            for member, data in ((f"{key}.jpg", b"\xff\xd8"), (f"{key}.cls", b"%d" % label)):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    old = time.time() - 3600  # older than the cache's "may still be being written" window
    os.utime(root / "train-000.tar", (old, old))
    tars, counted = [root / "train-000.tar"], []

    def count(path):
        counted.append(path)
        return shards._count(path)

    assert count_cache.counted_tars(root, tars, count) == {tars[0]: (3, 5)} and counted
    cache = count_cache.cache_file(root)
    good = cache.read_bytes()
    def another_format(path):  # another version's cache, its entries as they were
        path.write_bytes(good.replace(count_cache.CACHE_FORMAT.encode(), b"accel_train-x/0"))

    def an_entry_damaged(path):  # the tar's count no longer a number
        path.write_bytes(good.replace(b", 3, 5]", b', "3", 5]'))

    for corruption, damage in {**COMMON, "another shape": _json_of_another_shape,
                               "another format": another_format,
                               "an entry damaged": an_entry_damaged}.items():
        damage(cache)
        counted.clear()
        assert count_cache.counted_tars(root, tars, count) == {tars[0]: (3, 5)}, corruption
        assert counted == tars and cache.read_bytes() == good, corruption  # rebuilt


# -- kinds covered elsewhere, and the check that every kind has a row ----------------------------
COVERED_ELSEWHERE = {
    "pretrained": "test_bad_files.py::test_pretrained_weights_damaged",
    "run_lock": "test_bad_files.py::test_a_run_lock_damaged",
    "val_labels": "test_layouts.py::test_bad_folders_and_label_files_are_one_line_errors",
    "train_labels": "test_train_labels.py::test_each_label_file_problem_is_one_sentence",
    "imagefolder_metadata":
        "test_imagefolder_metadata.py::test_each_metadata_jsonl_problem_is_one_line_naming_its_line",
    "imagefolder_metadata_parquet":
        "test_imagefolder_metadata.py::test_a_damaged_metadata_parquet_is_one_line",
    "elastic_job": "test_file_matrix.py::test_a_damaged_elastic_job_marker",
}


def test_a_damaged_elastic_job_marker(tmp_path):
    """<run>/elastic_run_id is read leniently: damaged, it is simply not this job's id (the run
    is then not taken as this job's: a fresh start is refused over it, one line)."""
    from accel_train.run.resume import started_by_elastic_job
    (tmp_path / "elastic_run_id").write_text("job7\n")
    assert started_by_elastic_job(str(tmp_path), "job7")
    for damage in COMMON.values():
        damage(tmp_path / "elastic_run_id")
        assert not started_by_elastic_job(str(tmp_path), "job7")


MATRIX_KINDS = {row.kind for row in ROWS} | {"manifest", "metrics", "recipe",
                                               "accelerate_config", "elastic_config", "parquet",
                                               "shard_index", "shard", "stream_state",
                                               "imagefolder_cache", "shard_counts_cache",
                                               "saved_dataset"}


def _reader_kinds_named_in_the_product() -> set[str]:
    """Every string literal passed as a reader call's kind, across accel_train/ (the second
    argument of readers' functions that take one, or a `kind_name=` keyword)."""
    takes_kind = {"read_bytes", "read_text", "read_json", "parse_json", "read_yaml",
                  "read_json_lines", "read_safetensors", "safetensors_shapes", "check_fits",
                  "check_torch_file", "parquet_file", "read_parquet_table",
                  "read_arrow_cache", "bad"}
    found = set()
    for source in (REPO / "accel_train").rglob("*.py"):
        tree = ast.parse(source.read_text())
        # Readers' functions as this module names them: imported from readers, or readers.X.
        imported = takes_kind if source.name == "readers.py" else {
            alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("readers")
            for alias in node.names if alias.name in takes_kind}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) and isinstance(
                func.value, ast.Name) and func.value.id == "readers" else \
                func.id if isinstance(func, ast.Name) and func.id in imported else None
            args = [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "kind_name")]
            if name in takes_kind:
                found |= {a.value for a in args if isinstance(a, ast.Constant)
                          and isinstance(a.value, str)}
    return found


def test_every_kind_has_a_row():
    """A kind of file read by the product without a row here fails: every kind registered in
    readers.py, and every kind a reader call names, is in the matrix or named as covered by
    another test (which must exist)."""
    covered = MATRIX_KINDS | set(COVERED_ELSEWHERE)
    assert set(readers.KINDS) == covered, (set(readers.KINDS) ^ covered)
    named = _reader_kinds_named_in_the_product()
    assert named - set(readers.KINDS) == set(), "reader calls name unregistered kinds"
    assert named >= set(readers.KINDS) - {"run_lock"}, "registered kinds no reader reads"
    for where in COVERED_ELSEWHERE.values():
        module, test = where.split("::")
        assert f"def {test}(" in (REPO / "tests" / module).read_text(), where
