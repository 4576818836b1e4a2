"""The one way files that users and runs hand us are read.

Every file the product reads goes through a function here that names its *kind* (`KINDS`: what
the file is, the shape its content must have, and what the user should do when it is bad).  A
file that is empty, cut short, not text, not JSON/YAML, or JSON/YAML of another shape becomes
one `BadFile` (a UsageError: one line, exit 2) naming the file, what is wrong and what to do,
instead of the decoding library's traceback.  Only the library's *decode* errors are turned
into that line; anything else (a bug) keeps its traceback.

tests/test_file_matrix.py holds a row for every kind registered here (a kind without one fails
it), and tests/test_readers_lint.py fails when a module outside this one (and weightfiles.py,
the weights' checks built on it) decodes a file itself.
"""

from __future__ import annotations

import functools
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from accel_train.base.errors import UsageError, first_line

CUT_SHORT = "it may be cut short (an interrupted download, copy or write)"
# What a checkpoint's own file being bad means: the manifest's checksums held, so the file was
# edited by hand with the manifest rewritten, or written by a version that wrote it otherwise.
EDITED = ("the checkpoint was edited after it was written, or written by another version of "
          "accel_train; resume from another checkpoint (--resume PATH) or start a new run")
RUN_FILE = "written by training; restore it from a copy of the run, or train again"
ANOTHER_MODELS_WEIGHTS = "holds another model's weights"  # check_fits's problem, by its words


class BadFile(UsageError):
    """A file that cannot be read as its kind: `problem` is what is wrong, without the file's
    name or the fix (a checkpoint's verification quotes it as its reason)."""

    def __init__(self, message: str, problem: str):
        super().__init__(message)
        self.problem = problem


# -- shapes: a JSON/YAML value's expected type, checked after decoding ----------------------------
INT, NUMBER, TEXT, LIST, MAPPING, FLAG = int, (int, float), str, list, dict, bool
NONE = type(None)


def _type_ok(value: Any, expected) -> bool:
    expected = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in expected:
        return False  # True is an int to Python, not to a step count
    return isinstance(value, expected)


def _type_name(expected) -> str:
    names = {int: "a whole number", float: "a number", str: "text", list: "a list",
             dict: "a mapping", bool: "true/false", NONE: "null"}
    expected = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in expected))


@dataclass(frozen=True)
class Shape:
    """A mapping with these keys (each of these types), maybe with every value of one type."""

    keys: dict = field(default_factory=dict)
    values: Any = None  # the type of every value (a name -> reason list), None: not checked
    # Every key allowed besides `keys` (None: any).  For files whose content becomes keyword
    # arguments: an unknown key would be a TypeError far from the file that holds it.
    optional: Optional[frozenset] = None

    def problem(self, data: Any) -> Optional[str]:
        if not isinstance(data, dict):
            return f"holds {_type_name(type(data))}; expected a mapping"
        for key, expected in self.keys.items():
            if key not in data:
                return f"has no {key!r}"
            if not _type_ok(data[key], expected):
                return f"has {key!r} = {str(data[key])[:40]!r}, not {_type_name(expected)}"
        if self.optional is not None:
            unknown = sorted(set(data) - set(self.keys) - self.optional)
            if unknown:
                return f"has {unknown[0]!r}, a key no accel_train of this version writes"
        if self.values is not None:
            for key, value in data.items():
                if not _type_ok(value, self.values):
                    return f"has {key!r} = {str(value)[:40]!r}, not {_type_name(self.values)}"
        return None


@dataclass(frozen=True)
class FileKind:
    name: str
    what: str                     # the file, for the user ("a checkpoint's trainer state")
    fix: str                      # what to do when it is bad
    shape: Optional[Shape] = None  # a JSON/YAML kind's content


KINDS: dict[str, FileKind] = {}


def _register(name: str, what: str, fix: str, shape: Optional[Shape] = None) -> None:
    KINDS[name] = FileKind(name, what, fix, shape)


# -- every kind of file the product reads ---------------------------------------------------------
_register("recipe", "a recipe of training options (--config)",
          "fix it, or pass another --config file", Shape())
# versions, git_revision and command are the last keys every config.yaml was written with: a
# file cut short that still parses (halfway through `resolved`, at a line's end) lacks them (a
# cut inside the command's list cannot happen: the file is written whole, then renamed)
_register("run_config", "a run's config.yaml", RUN_FILE,
          Shape({"train": MAPPING, "resolved": MAPPING, "versions": MAPPING,
                 "git_revision": (TEXT, NONE), "command": LIST}))
_register("accelerate_config", "an accelerate config (--config_file)",
          "recreate it with `accelerate config --config_file PATH`", Shape())
_register("elastic_config", "an elastic settings file (--elastic)",
          "fix it (keys: max_restarts, monitor_interval, rdzv_backend, ...)", Shape())
_register("model_config", "a model's model_config.json",
          "restore it, or export the model again from a checkpoint (accel-train export)",
          Shape({"model_name": TEXT, "num_classes": INT, "class_names": LIST,
                 "image_size": INT, "mean": LIST, "std": LIST},
                optional=frozenset({"drop_rate", "weights", "tta", "crop_pct", "crop_mode",
                                    "interpolation", "float32_layers", "model_args"})))
_register("timm_config", "a model folder's config.json (timm's layout)",
          "restore it, or export the model again (accel-train export)",
          Shape({"architecture": TEXT, "pretrained_cfg": MAPPING}))
_register("metrics", "a run's metrics.jsonl",
          "remove that line or restore the file")
_register("manifest", "a checkpoint's manifest.json", EDITED,
          Shape({"files": MAPPING, "step": INT}, values=None))
_register("trainer_state", "a checkpoint's trainer_state.json", EDITED,
          Shape({"step": INT, "epoch": INT, "samples_in_epoch": INT, "world_size": INT,
                 "batch_size": INT, "accumulation_steps": INT, "seed": INT}))
_register("loader_state", "a checkpoint's loader.json", EDITED,
          Shape({"epoch": INT, "samples_in_epoch": INT}))
_register("stream_state", "a checkpoint's stream.json", EDITED,
          Shape({"epoch": INT, "samples_in_epoch": INT, "num_shards": INT,
                 "layout": MAPPING}))
_register("schedule", "a checkpoint's schedule.json", EDITED,
          Shape({"warmup_steps": INT, "total_steps": INT,
                 "budget_step_seconds": (int, float, NONE)}))
_register("bad_images", "a checkpoint's bad_images.json", EDITED, Shape(values=TEXT))
_register("checkpoint_weights", "a checkpoint's model or EMA weights (safetensors)", EDITED)
_register("accelerate_state", "a checkpoint's optimizer, scheduler, scaler or RNG file", EDITED)
_register("run_weights", "a run's or export's model.safetensors",
          "train again, or use another checkpoint or export of the run")
_register("pretrained", "a --pretrained weights file", "fetch or copy it again")
_register("parquet", "a parquet file of --data-dir", "copy it again")
_register("saved_dataset", "a file of a save_to_disk folder (--data-dir)",
          "save the dataset again with save_to_disk, or copy the folder again")
_register("val_labels", "a --val-labels file", "fix the line or pass another file")
_register("train_labels", "a --train-labels file", "fix the line or pass another file")
_register("imagefolder_metadata", "an image folder's metadata.csv or metadata.jsonl",
          "fix the line, or remove the file and sort the images into class folders")
_register("imagefolder_metadata_parquet", "an image folder's metadata.parquet",
          "write it again (pandas: DataFrame.to_parquet), or remove the file and sort the "
          "images into class folders")
_register("imagefolder_cache", "an image folder's cached index",
          "(not an error: a damaged cache is rebuilt by walking the folder)")
_register("shard_counts_cache", "a shard folder's cached sample counts",
          "(not an error: a damaged cache is counted again from the tars)",
          Shape({"format": TEXT, "root": TEXT, "tars": MAPPING}))
_register("shard_index", "a shard folder's index.json",
          "write the shards again with accel-train shard",
          Shape({"splits": MAPPING, "class_names": LIST}))
_register("shard", "a shard (WebDataset tar or parquet)",
          "write the shards again with accel-train shard, or copy it again")
_register("run_lock", "a run folder's run.lock", "(runlock.py says what to do)")
_register("elastic_job", "a run folder's elastic_run_id",
          "(not an error: read leniently; a mismatch means another job)")


def kind(name: str) -> FileKind:
    return KINDS[name]  # a name not registered is a bug here: KeyError


def bad(path: Path, kind_name: str, problem: str, label: str = "") -> BadFile:
    """The one-line error for a file of `kind_name`: `label` (a flag, say) before its path."""
    text = f"{label} {path}" if label else str(path)
    return BadFile(f"{text}: {problem}; {kind(kind_name).fix}", problem)


# -- text, JSON, YAML -----------------------------------------------------------------------------
def read_bytes(path: Path, kind_name: str, label: str = "") -> bytes:
    kind(kind_name)
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise bad(path, kind_name, "no such file", label) from None
    except IsADirectoryError:
        raise bad(path, kind_name, "is a folder, not a file", label) from None
    except OSError as err:
        raise bad(path, kind_name, f"cannot be read ({err.strerror})", label) from None


def read_text(path: Path, kind_name: str, label: str = "", errors: str = "strict") -> str:
    """UTF-8 text; bytes that are not UTF-8 are a BadFile (`errors='replace'`: kept as U+FFFD,
    for files whose damage the caller judges line by line)."""
    raw = read_bytes(path, kind_name, label)
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise bad(path, kind_name, f"is not UTF-8 text (byte {err.start}: random bytes, or "
                                   f"another kind of file)", label) from None


def _checked(data: Any, path: Path, kind_name: str, label: str, shape: Optional[Shape]) -> Any:
    shape = kind(kind_name).shape if shape is None else shape
    problem = shape.problem(data) if shape is not None else None
    if problem is not None:
        raise bad(path, kind_name, f"is not {kind(kind_name).what} (it {problem})", label)
    return data


def parse_json(text: str, path: Path, kind_name: str, label: str = "",
               shape: Optional[Shape] = None) -> Any:
    """JSON already read (a record inside another file): decoded and its shape checked."""
    if not text.strip():
        raise bad(path, kind_name, f"is empty; {CUT_SHORT}", label)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise bad(path, kind_name, f"is not valid JSON ({first_line(err)}); {CUT_SHORT}",
                  label) from None
    return _checked(data, path, kind_name, label, shape)


def parse_json_line(line: str, number: int, path: Path, kind_name: str, label: str = "") -> Any:
    """Line `number` of a JSON-lines file a user wrote (a metadata.jsonl), decoded; a line that
    is not JSON is named with its line number and the place in it."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise bad(path, kind_name, f"line {number} is not JSON ({err.msg}, column {err.colno})",
                  label) from None


def read_json(path: Path, kind_name: str, label: str = "", shape: Optional[Shape] = None) -> Any:
    """A JSON file of `kind_name`, its shape checked (the kind's, or `shape`)."""
    return parse_json(read_text(path, kind_name, label), path, kind_name, label, shape)


# YAML 1.1 (PyYAML's) reads `1e-3` and `5e-4` as text: a float needs a dot there (`1.0e-3`).
# YAML 1.2 and every other reader take them as numbers, and a recipe's learning rate or weight
# decay is written so: "--learning-rate must be a number (got '1e-3')" told the user otherwise.
# The safe loader, with YAML 1.2's float pattern (PyYAML's own documented way, a resolver).
FLOAT_1_2 = (r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+"
             r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")


@functools.lru_cache(maxsize=None)
def _yaml_loader():
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(FLOAT_1_2),
                                 list("-+0123456789."))
    return Loader


def read_yaml(path: Path, kind_name: str, label: str = "", empty: Any = None,
              shape: Optional[Shape] = None) -> Any:
    """A YAML file of `kind_name`; an empty one is `empty` when given (a recipe without
    options), else a BadFile."""
    import yaml

    text = read_text(path, kind_name, label)
    if not text.strip():
        if empty is not None:
            return empty
        raise bad(path, kind_name, f"is empty; {CUT_SHORT}", label)
    try:
        data = yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as err:
        raise bad(path, kind_name, f"is not valid YAML ({first_line(err)})", label) from None
    if data is None and empty is not None:
        return empty
    return _checked(data, path, kind_name, label, shape)


def read_json_lines(path: Path, kind_name: str, warn: Callable[[str], None],
                    noun: str = "a record") -> list[dict]:
    """The records of a JSON-lines file.  A last line cut short (a process killed while writing
    it) is left out, with a warning; any other line that is not a JSON record (a mapping) is a
    damaged file, named with its line.  Lines end at a newline alone, as JSON Lines defines
    them (str.splitlines would also cut a record at a U+2028, which JSON allows inside a
    string)."""
    text = read_text(path, kind_name, errors="replace")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number == len(lines):  # (a file ending in a newline ends in an empty line)
            warn(f"the last line of {path} is cut short (the run was stopped while writing "
                 f"it); read without it")
        else:
            problem = f"line {number} is not {noun} ({line[:60]!r})"
            raise BadFile(f"{path} {problem}; the file is damaged: {kind(kind_name).fix}",
                          problem)
    return records


def load_accelerate_config(path: str, label: str = "--config_file"):
    """accelerate's own config object for its YAML, through accelerate's reader, after the file
    is read here (so that bytes and YAML errors are one line, not accelerate's traceback)."""
    read_yaml(Path(path), "accelerate_config", label)
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        return load_config_from_file(path)
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise bad(Path(path), "accelerate_config", f"accelerate rejects it ({first_line(err)})",
                  label) from None


# -- weights --------------------------------------------------------------------------------------
def read_safetensors(path: Path, kind_name: str, label: str = "", fix: str = "") -> dict:
    """Every tensor of a safetensors file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise _bad_safetensors(path, kind_name, err, label, fix) from None


def safetensors_shapes(path: Path, kind_name: str, label: str = "",
                       fix: str = "") -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a safetensors file, from its header alone."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (SafetensorError, OSError) as err:
        raise _bad_safetensors(path, kind_name, err, label, fix) from None


def _bad_safetensors(path, kind_name, err, label, fix) -> BadFile:
    problem = f"is not a readable safetensors file ({first_line(err)}); {CUT_SHORT}"
    if fix:  # the caller's own words (weightfiles.py's messages)
        text = f"{label}: {path}" if label else str(path)
        return BadFile(f"{text} {problem}: {fix}", problem)
    return bad(path, kind_name, problem, label)


def check_fits(path: Path, kind_name: str, expected: dict[str, tuple[int, ...]]) -> None:
    """A safetensors file holds exactly the tensors (names and shapes) of the model it is
    loaded into: another model's file is one line, not a state-dict mismatch's 80 lines."""
    found = safetensors_shapes(path, kind_name)
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    wrong = sorted(n for n in set(found) & set(expected) if found[n] != tuple(expected[n]))
    # Names missing alone are not judged: a writer may leave out tensors that share storage
    # with others (Accelerate's safetensors save does), and the loader then says so itself.
    if extra or wrong or (missing and len(missing) == len(expected)):
        first = (f"{wrong[0]} is {list(found[wrong[0]])}, not {list(expected[wrong[0]])}"
                 if wrong else f"{missing[0]} is missing" if missing
                 else f"{extra[0]} is not in this model")
        raise bad(path, kind_name, f"{ANOTHER_MODELS_WEIGHTS} ({len(missing)} missing, "
                                   f"{len(extra)} unexpected, {len(wrong)} of another shape; "
                                   f"{first})")


def torch_file_problem(path: Path) -> Optional[str]:
    """Why a file torch.save wrote (a zip archive) cannot be a whole one, or None: the zip's
    directory is at its end, so a file cut short or replaced has none.  Checked before torch
    (through Accelerate) would raise its own error from deep inside."""
    with open(path, "rb") as handle:
        starts_as_zip = handle.read(4) == b"PK\x03\x04"
    if not starts_as_zip:
        return "is not a torch file (not a zip archive)"
    if not zipfile.is_zipfile(path):
        return "is a torch file without its end"
    return None


def check_torch_file(path: Path, kind_name: str) -> None:
    problem = torch_file_problem(path)
    if problem is not None:
        raise bad(path, kind_name, f"{problem}; {CUT_SHORT}")


# -- parquet and Arrow ----------------------------------------------------------------------------
def parquet_file(path: Path, kind_name: str, label: str = "", footer=None):
    """pyarrow's ParquetFile with its footer read; a footer that cannot be read (a copy cut
    short, garbage) is a BadFile, not pyarrow's ArrowInvalid from deep inside a loader.
    `footer`: the file's footer (a ParquetFile's `metadata`) where read before, not read
    again."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, metadata=footer)
    except (pa.ArrowException, OSError) as err:
        raise bad(path, kind_name, f"is not a readable parquet file ({first_line(err, 120)}); "
                                   f"{CUT_SHORT}", label) from None


def read_parquet_table(path: Path, kind_name: str, columns: list[str], label: str = "",
                       handle=None):
    """`columns` of a parquet file, read whole (a pyarrow Table); a file whose footer or pages
    cannot be read is a BadFile, as parquet_file's footer is.  `handle`: the file's
    ParquetFile where already open."""
    import pyarrow as pa

    if handle is None:
        handle = parquet_file(path, kind_name, label)
    try:
        return handle.read(columns=columns)
    except (pa.ArrowException, OSError) as err:
        raise bad(path, kind_name, f"is not a readable parquet file ({first_line(err, 120)}); "
                                   f"{CUT_SHORT}", label) from None


# A datasets save_to_disk folder: dataset_dict.json naming the splits (absent for one Dataset),
# and in each split's folder state.json listing its Arrow files and dataset_info.json.
SAVED_SPLITS = Shape({"splits": LIST})
SAVED_STATE = Shape({"_data_files": LIST})


def load_saved_dataset(folder: Path, label: str = ""):
    """datasets.load_from_disk of a save_to_disk folder, every file it reads checked here
    first: a bad one is a BadFile naming it, not a traceback from inside datasets (which
    decodes the JSON files itself and memory-maps the Arrow files)."""
    import datasets
    import pyarrow as pa

    folder = Path(folder)
    splits = [folder]
    if (folder / "dataset_dict.json").exists():
        listed = read_json(folder / "dataset_dict.json", "saved_dataset", label, SAVED_SPLITS)
        splits = [folder / str(name) for name in listed["splits"]]
    for split in splits:
        read_json(split / "dataset_info.json", "saved_dataset", label, Shape())
        state = split / "state.json"
        files = read_json(state, "saved_dataset", label, SAVED_STATE)["_data_files"]
        if not files:  # save_to_disk of a split with no rows; datasets' reader fails on it
            raise UsageError(f"{label + ' ' if label else ''}its split {split.name!r} holds no "
                             f"rows; save the data again without it, or with its images")
        for entry in files:
            if not (isinstance(entry, dict) and isinstance(entry.get("filename"), str)):
                raise bad(state, "saved_dataset", f"is not {kind('saved_dataset').what} (it "
                                                  f"lists {str(entry)[:40]!r} as a data file)",
                          label)
            arrow = split / entry["filename"]
            try:  # datasets writes Arrow's stream format; memory-mapped, nothing is copied
                with pa.memory_map(str(arrow)) as source:
                    for _ in pa.ipc.open_stream(source):
                        pass
            except FileNotFoundError:
                raise bad(arrow, "saved_dataset", "no such file", label) from None
            except (pa.ArrowException, OSError) as err:
                raise bad(arrow, "saved_dataset", f"is not a readable Arrow file "
                                                  f"({first_line(err, 120)}); {CUT_SHORT}",
                          label) from None
    return datasets.load_from_disk(str(folder))


def read_arrow_cache(path: Path, kind_name: str, shape: Shape):
    """(table, metadata) of an Arrow IPC file we wrote as a cache, its `accel_train` metadata
    decoded and checked; None when it cannot be used (a cache is rebuilt, never an error)."""
    import pyarrow as pa

    try:
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        meta = parse_json(table.schema.metadata[b"accel_train"].decode(), path, kind_name,
                          shape=shape)
    except (OSError, KeyError, TypeError, UnicodeDecodeError, pa.ArrowInvalid, BadFile):
        return None
    return table, meta
