"""accel_train/base/readers.py called directly: each reader's line for each way a file goes bad,
and what it returns for a good one.  The corruption matrix (test_file_matrix.py) reaches these
readers through the commands; here each case is one call, fast enough to run for every mutant
of the module.

Oracles: the decoding libraries' own errors (json, PyYAML, safetensors, pyarrow, the OS's
strerror), Python's float() for YAML 1.2's numbers, files written here by torch, safetensors,
pyarrow and datasets, and hand-written expected lines."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from accel_train.base import readers
from accel_train.base.errors import UsageError
from accel_train.base.readers import BadFile, Shape

CUT = "it may be cut short (an interrupted download, copy or write)"
MANIFEST_FIX = readers.KINDS["manifest"].fix


# -- shapes ---------------------------------------------------------------------------------------
STATE = Shape({"step": readers.INT, "rate": readers.NUMBER, "name": (readers.TEXT, readers.NONE),
               "flag": readers.FLAG})
GOOD = {"step": 3, "rate": 0.5, "name": None, "flag": False}

SHAPE_PROBLEMS = {
    "a list": ([1, 2], "holds a list; expected a mapping"),
    "text": ("step", "holds text; expected a mapping"),
    "null": (None, "holds null; expected a mapping"),
    "a key missing (the first in the shape's order)": ({"rate": 1, "flag": True},
                                                       "has no 'step'"),
    "a float for a whole number": ({**GOOD, "step": 3.0}, "has 'step' = '3.0', not a whole number"),
    "true for a whole number": ({**GOOD, "step": True}, "has 'step' = 'True', not a whole number"),
    "text for a number": ({**GOOD, "rate": "fast"}, "has 'rate' = 'fast', not a whole number or "
                                                      "a number"),
    "a number for text or null": ({**GOOD, "name": 7}, "has 'name' = '7', not text or null"),
    "1 for true/false": ({**GOOD, "flag": 1}, "has 'flag' = '1', not true/false"),
    "a long value, cut to 40 characters": (
        {**GOOD, "step": "x" * 100}, f"has 'step' = '{'x' * 40}', not a whole number"),
}


@pytest.mark.parametrize("case", list(SHAPE_PROBLEMS))
def test_a_shape_names_the_first_thing_wrong(case):
    data, problem = SHAPE_PROBLEMS[case]
    assert STATE.problem(data) == problem


def test_a_shape_takes_what_it_describes():
    assert STATE.problem(GOOD) is None
    assert STATE.problem({**GOOD, "rate": 2, "name": "resnet", "flag": True}) is None
    assert STATE.problem({**GOOD, "anything": [1]}) is None  # optional None: any other key
    assert Shape().problem({}) is None and Shape().problem({"a": {"b": 1}}) is None


def test_a_shape_with_optional_keys_names_the_first_unknown_one():
    shape = Shape({"a": readers.INT}, optional=frozenset({"b"}))
    assert shape.problem({"a": 1}) is None and shape.problem({"a": 1, "b": "x"}) is None
    assert shape.problem({"a": 1, "z": 0, "c": 0}) == \
        "has 'c', a key no accel_train of this version writes"  # sorted: c before z


def test_a_shape_of_values_checks_every_value():
    shape = Shape(values=readers.TEXT)
    assert shape.problem({"a.png": "cannot be decoded", "b.png": "truncated"}) is None
    assert shape.problem({"a.png": "x", "b.png": 3}) == "has 'b.png' = '3', not text"
    assert shape.problem({"a.png": False}) == "has 'a.png' = 'False', not text"
    assert shape.problem({"a.png": 7 * 10 ** 50}) == f"has 'a.png' = '{'7' + '0' * 39}', not text"
    assert Shape({"files": readers.MAPPING}).problem({"files": []}) == \
        "has 'files' = '[]', not a mapping"


# -- the line a bad file gives --------------------------------------------------------------------
def test_a_bad_file_is_a_usage_error_naming_the_file_the_problem_and_the_kinds_fix(tmp_path):
    path = tmp_path / "manifest.json"
    err = readers.bad(path, "manifest", "is empty")
    assert isinstance(err, UsageError) and isinstance(err, ValueError)
    assert str(err) == f"{path}: is empty; {MANIFEST_FIX}" and err.problem == "is empty"
    assert str(readers.bad(path, "recipe", "is empty", "--config")) == \
        f"--config {path}: is empty; fix it, or pass another --config file"


def test_a_kind_never_registered_is_a_bug_not_a_bad_file(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(KeyError):
        readers.read_json(tmp_path / "a.json", "no such kind")


# -- bytes and text ------------------------------------------------------------------------------
def test_a_file_that_cannot_be_opened_says_why(tmp_path):
    with pytest.raises(BadFile) as missing:
        readers.read_bytes(tmp_path / "absent.json", "manifest")
    assert str(missing.value) == f"{tmp_path / 'absent.json'}: no such file; {MANIFEST_FIX}"
    with pytest.raises(BadFile) as folder:
        readers.read_bytes(tmp_path, "recipe", "--config")
    assert str(folder.value) == (f"--config {tmp_path}: is a folder, not a file; fix it, or "
                                 f"pass another --config file")
    loop = tmp_path / "loop"
    os.symlink(loop, loop)  # a link to itself: ELOOP, an OSError of neither kind above
    with pytest.raises(BadFile) as looped:
        readers.read_bytes(loop, "manifest")
    assert looped.value.problem == f"cannot be read ({os.strerror(errno.ELOOP)})"


def test_text_that_is_not_utf8_names_its_first_bad_byte(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"epochs: 3\n\xff\xfe")
    with pytest.raises(BadFile) as err:
        readers.read_text(path, "recipe")
    # byte 10: b"epochs: 3\n" is ten bytes
    assert err.value.problem == "is not UTF-8 text (byte 10: random bytes, or another kind of file)"
    assert readers.read_text(path, "recipe", errors="replace") == "epochs: 3\n\ufffd\ufffd"
    path.write_bytes("température: 20\n".encode())
    assert readers.read_text(path, "recipe") == "température: 20\n"


# -- JSON -----------------------------------------------------------------------------------------
def _json_error(text: str) -> str:
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        return str(err)
    raise AssertionError(f"{text!r} is JSON")


@pytest.mark.parametrize("text", ["", "  \n\t"])
def test_an_empty_json_file_may_be_cut_short(tmp_path, text):
    path = tmp_path / "manifest.json"
    path.write_text(text)
    with pytest.raises(BadFile) as err:
        readers.read_json(path, "manifest")
    assert str(err.value) == f"{path}: is empty; {CUT}; {MANIFEST_FIX}"


@pytest.mark.parametrize("text", ['{"step": 2, "files": {', "[1, 2", "step: 2"])
def test_json_that_does_not_decode_quotes_the_decoder(tmp_path, text):
    path = tmp_path / "manifest.json"
    path.write_text(text)
    with pytest.raises(BadFile) as err:
        readers.read_json(path, "manifest")
    assert err.value.problem == f"is not valid JSON ({_json_error(text)}); {CUT}"


def test_json_of_another_shape_names_the_kind_and_what_it_holds(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text('{"files": {}, "step": "two"}')
    with pytest.raises(BadFile) as err:
        readers.read_json(path, "manifest")
    assert str(err.value) == (f"{path}: is not a checkpoint's manifest.json (it has 'step' = "
                              f"'two', not a whole number); {MANIFEST_FIX}")
    path.write_text('{"files": {"model.safetensors": "ab"}, "step": 2}')
    assert readers.read_json(path, "manifest") == {"files": {"model.safetensors": "ab"},
                                                   "step": 2}
    # a shape passed in is checked in place of the kind's
    assert readers.read_json(path, "manifest", shape=Shape({"files": readers.MAPPING}))
    with pytest.raises(BadFile, match=r"\(it has no 'other'\)"):
        readers.read_json(path, "manifest", shape=Shape({"other": readers.INT}))


def test_a_json_line_names_its_number_and_column_as_the_decoder_does(tmp_path):
    path = tmp_path / "metadata.jsonl"
    line = '{"file_name": "a.png", "label": cat}'
    try:
        json.loads(line)
    except json.JSONDecodeError as decoded:
        msg, column = decoded.msg, decoded.colno
    with pytest.raises(BadFile) as err:
        readers.parse_json_line(line, 7, path, "imagefolder_metadata", "--train-labels")
    assert err.value.problem == f"line 7 is not JSON ({msg}, column {column})"
    assert str(err.value).startswith(f"--train-labels {path}: line 7")
    assert readers.parse_json_line('{"a": [1]}', 1, path, "imagefolder_metadata") == {"a": [1]}


# -- JSON lines (metrics.jsonl) -----------------------------------------------------------------
def _records(path: Path) -> tuple[list, list[str]]:
    warned: list[str] = []
    return readers.read_json_lines(path, "metrics", warned.append), warned


def test_json_lines_read_every_record_and_skip_blank_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n  \n{"step": 2, "note": "a\u2028b\u0085c"}\r\n')
    assert _records(path) == ([{"step": 1}, {"step": 2, "note": "a\u2028b\u0085c"}], [])


def test_a_last_json_line_cut_short_is_left_out_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    records, warned = _records(path)
    assert records == [{"step": 1}, {"step": 2}]
    assert warned == [f"the last line of {path} is cut short (the run was stopped while "
                      f"writing it); read without it"]


@pytest.mark.parametrize("text, line", [
    ('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n', 2),  # cut inside the file: damaged
    ('{"step": 1}\n{"step": 2, "lo\n', 2),                # the last line, but whole (its \n)
    ('{"step": 1}\n[1, 2]\n{"step": 3}\n', 2),            # JSON, not a record
    ('{"step": 1}\n\xff\xfe\n', 2),                       # bytes that are not UTF-8
    ('{"step": 1}\n[1, 2]\n{"step": 3}', 2),              # the file's end cut, not this line
    ('{"step": 1}\n"' + "a" * 70 + '"\n', 2),             # shown to 60 characters
])
def test_any_other_json_line_that_is_not_a_record_is_a_damaged_file(tmp_path, text, line):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(BadFile) as err:
        _records(path)
    shown = repr(text.encode("latin-1").decode("utf-8", "replace").split("\n")[line - 1][:60])
    assert str(err.value) == (f"{path} line {line} is not a record ({shown}); the file is "
                              f"damaged: remove that line or restore the file")
    assert err.value.problem == f"line {line} is not a record ({shown})"


# -- YAML -----------------------------------------------------------------------------------------
# YAML 1.2's numbers that YAML 1.1 (PyYAML) reads as text: the oracle is Python's float()
YAML_12_FLOATS = ["1e-3", "5e-4", "1E3", "-2e+3", "+7e0", "1.5e-3", ".5", "-.25e2", "1_000.5"]


@pytest.mark.parametrize("text", YAML_12_FLOATS)
def test_yaml_reads_exponents_without_a_dot_as_numbers(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"learning_rate: {text}\n")
    value = readers.read_yaml(path, "recipe")["learning_rate"]
    assert type(value) is float and value == float(text.replace("_", ""))


def test_pyyaml_alone_reads_an_exponent_without_a_dot_as_text():
    """Why the reader adds YAML 1.2's numbers: PyYAML's own loader (YAML 1.1) does not."""
    assert yaml.safe_load("learning_rate: 1e-3") == {"learning_rate": "1e-3"}


@pytest.mark.parametrize("text, expected", [
    ("10", 10), ("-3", -3), ("0x1F", 31), ("1.0", 1.0), (".inf", float("inf")),
    ("-.Inf", float("-inf")), ("1e", "1e"), ("e5", "e5"), ("1.2.3", "1.2.3"), ("true", True),
    ("'1e-3'", "1e-3"), ("resnet50", "resnet50"), ("1e-3x", "1e-3x")])
def test_yaml_reads_everything_else_as_pyyaml_does(tmp_path, text, expected):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"value: {text}\n")
    value = readers.read_yaml(path, "recipe")["value"]
    assert value == expected and type(value) is type(expected)
    assert yaml.safe_load(path.read_text())["value"] == expected


def test_yaml_nan_is_a_float(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("value: .nan\n")
    value = readers.read_yaml(path, "recipe")["value"]
    assert isinstance(value, float) and value != value


def test_an_empty_yaml_file_is_its_empty_value_or_cut_short(tmp_path):
    path = tmp_path / "recipe.yaml"
    for text in ("", "\n  \n", "# only a comment\n", "~\n"):
        path.write_text(text)
        assert readers.read_yaml(path, "recipe", empty={}) == {}, text
    path.write_text(" \n")
    with pytest.raises(BadFile) as err:
        readers.read_yaml(path, "accelerate_config", "--config_file")
    assert str(err.value) == (f"--config_file {path}: is empty; {CUT}; recreate it with "
                              f"`accelerate config --config_file PATH`")


def test_yaml_that_does_not_parse_quotes_pyyamls_first_line(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("epochs: [3\nmodel: resnet\n")
    try:
        yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        first = str(err).strip().splitlines()[0]
    with pytest.raises(BadFile) as bad:
        readers.read_yaml(path, "recipe", "--config")
    assert bad.value.problem == f"is not valid YAML ({first})"


def test_yaml_of_another_shape_names_what_it_holds(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("- a list\n- where a mapping belongs\n")
    with pytest.raises(BadFile) as err:
        readers.read_yaml(path, "recipe", "--config", empty={})
    assert err.value.problem == ("is not a recipe of training options (--config) (it holds a "
                                 "list; expected a mapping)")


def test_accelerates_own_reader_refusing_a_config_is_one_line(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\n"
                    "no_such_accelerate_key: 1\n")
    from accelerate.commands.config.config_args import load_config_from_file
    with pytest.raises(ValueError, match="unknown keys") as theirs:
        load_config_from_file(str(path))
    with pytest.raises(BadFile) as err:
        readers.load_accelerate_config(str(path))
    assert str(err.value).startswith(f"--config_file {path}: accelerate rejects it (")
    assert str(theirs.value).splitlines()[0][:160] in str(err.value)
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n"
                    "num_processes: 2\nmixed_precision: 'no'\n")
    assert readers.load_accelerate_config(str(path)).num_processes == 2


# -- weights and torch files ----------------------------------------------------------------------
def _weights(path: Path, **shapes) -> None:
    from safetensors.torch import save_file
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, str(path))


def test_safetensors_read_whole_or_by_their_header(tmp_path):
    path = tmp_path / "model.safetensors"
    _weights(path, w=(2, 3), b=(2,))
    tensors = readers.read_safetensors(path, "run_weights")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {"w": (2, 3), "b": (2,)}
    assert readers.safetensors_shapes(path, "run_weights") == {"w": (2, 3), "b": (2,)}


@pytest.mark.parametrize("damage", ["cut in half", "random bytes", "empty"])
def test_a_damaged_safetensors_file_quotes_the_library(tmp_path, damage):
    from safetensors import safe_open
    path = tmp_path / "model.safetensors"
    _weights(path, w=(64, 64))
    data = path.read_bytes()
    path.write_bytes({"cut in half": data[:len(data) // 2], "random bytes": bytes(range(256)),
                      "empty": b""}[damage])
    with pytest.raises(Exception) as theirs:  # noqa: PT011 (the library's own, whatever it is)
        with safe_open(str(path), "pt") as handle:
            handle.keys()
    said = str(theirs.value).strip().splitlines()[0][:160]
    problem = f"is not a readable safetensors file ({said}); {CUT}"
    for read in (readers.read_safetensors, readers.safetensors_shapes):
        with pytest.raises(BadFile) as err:
            read(path, "run_weights", "--weights")
        assert str(err.value) == (f"--weights {path}: {problem}; train again, or use another "
                                  f"checkpoint or export of the run")
    # the caller's own words in place of the kind's fix
    with pytest.raises(BadFile) as err:
        readers.read_safetensors(path, "pretrained", "--pretrained", fix="fetch it again")
    assert str(err.value) == f"--pretrained: {path} {problem}: fetch it again"
    with pytest.raises(BadFile) as err:
        readers.safetensors_shapes(path, "pretrained", fix="fetch it again")
    assert str(err.value) == f"{path} {problem}: fetch it again" and err.value.problem == problem
    with pytest.raises(BadFile) as err:  # the tensors checked against a model's
        readers.check_fits(path, "checkpoint_weights", {"w": (64, 64)})
    assert str(err.value) == f"{path}: {problem}; {readers.KINDS['checkpoint_weights'].fix}"


def test_weights_of_another_model_say_what_differs(tmp_path):
    path = tmp_path / "model.safetensors"
    expected = {"conv.weight": (8, 3, 3, 3), "fc.weight": (10, 8), "fc.bias": (10,)}
    _weights(path, **{"conv.weight": (8, 3, 3, 3), "fc.weight": (10, 8), "fc.bias": (10,)})
    readers.check_fits(path, "run_weights", expected)  # the same: nothing said
    readers.check_fits(path, "run_weights", {**expected, "tied.weight": (10, 8)})  # one missing

    def problem(**shapes) -> str:
        _weights(path, **shapes)
        with pytest.raises(BadFile) as err:
            readers.check_fits(path, "run_weights", expected)
        assert str(err.value) == (f"{path}: {err.value.problem}; train again, or use another "
                                  f"checkpoint or export of the run")
        return err.value.problem

    assert problem(**{"conv.weight": (8, 3, 3, 3), "fc.weight": (3, 8), "fc.bias": (3,)}) == (
        "holds another model's weights (0 missing, 0 unexpected, 2 of another shape; fc.bias "
        "is [3], not [10])")
    assert problem(**{"conv.weight": (8, 3, 3, 3), "fc.weight": (10, 8), "fc.bias": (10,),
                      "head.weight": (2,)}) == (
        "holds another model's weights (0 missing, 1 unexpected, 0 of another shape; "
        "head.weight is not in this model)")
    assert problem(other=(1,)) == (
        "holds another model's weights (3 missing, 1 unexpected, 0 of another shape; "
        "conv.weight is missing)")


def test_a_torch_file_must_be_a_whole_zip_archive(tmp_path):
    path = tmp_path / "optimizer.bin"
    torch.save({"state": {}, "param_groups": [{"lr": 0.1}]}, path)
    readers.check_torch_file(path, "accelerate_state")  # whole: nothing said
    assert readers.torch_file_problem(path) is None
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    assert readers.torch_file_problem(path) == "is a torch file without its end"
    path.write_bytes(b"\x80\x02}q\x00.")  # a pickle: the format before torch's zip archives
    assert readers.torch_file_problem(path) == "is not a torch file (not a zip archive)"
    with pytest.raises(BadFile) as err:
        readers.check_torch_file(path, "accelerate_state")
    assert str(err.value) == (f"{path}: is not a torch file (not a zip archive); {CUT}; "
                              f"{readers.KINDS['accelerate_state'].fix}")


# -- parquet and Arrow ----------------------------------------------------------------------------
def _parquet(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"image": [b"a", b"b"], "label": [0, 1]}), path)


def test_parquet_read_and_damaged(tmp_path):
    import pyarrow.parquet as pq
    path = tmp_path / "train-00000.parquet"
    _parquet(path)
    assert readers.read_parquet_table(path, "parquet", ["label"]).to_pydict() == {"label": [0, 1]}
    handle = readers.parquet_file(path, "parquet")
    assert readers.parquet_file(path, "parquet", footer=handle.metadata).metadata.num_rows == 2
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(Exception) as theirs:  # noqa: PT011 (pyarrow's own)
        pq.ParquetFile(path)
    with pytest.raises(BadFile) as err:
        readers.parquet_file(path, "parquet", "--data-dir")
    said = str(theirs.value).strip().splitlines()[0][:120]
    assert str(err.value) == (f"--data-dir {path}: is not a readable parquet file ({said}); "
                              f"{CUT}; copy it again")


def test_an_arrow_cache_damaged_or_of_another_shape_is_none(tmp_path):
    import pyarrow as pa
    path = tmp_path / "index.arrow"
    shape = Shape({"version": readers.INT})

    def write(meta: bytes) -> None:
        table = pa.table({"path": ["a.png"]}).replace_schema_metadata({b"accel_train": meta})
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table)

    write(b'{"version": 2}')
    table, meta = readers.read_arrow_cache(path, "imagefolder_cache", shape)
    assert meta == {"version": 2} and table.column("path").to_pylist() == ["a.png"]
    for meta in (b'{"version": "2"}', b"{", b"\xff"):
        write(meta)
        assert readers.read_arrow_cache(path, "imagefolder_cache", shape) is None, meta
    path.write_bytes(path.read_bytes()[:40])
    assert readers.read_arrow_cache(path, "imagefolder_cache", shape) is None
    assert readers.read_arrow_cache(tmp_path / "absent.arrow", "imagefolder_cache", shape) is None


def test_a_saved_dataset_folder_is_checked_before_datasets_reads_it(tmp_path):
    import datasets
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"label": [0, 1, 1]}),
                          "test": datasets.Dataset.from_dict({"label": [1]})}).save_to_disk(
        str(folder))
    assert readers.load_saved_dataset(folder)["train"]["label"] == [0, 1, 1]
    arrow = next((folder / "test").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:100])
    with pytest.raises(BadFile) as err:
        readers.load_saved_dataset(folder, "--data-dir")
    assert str(err.value).startswith(f"--data-dir {arrow}: is not a readable Arrow file (")
    arrow.unlink()
    with pytest.raises(BadFile) as err:
        readers.load_saved_dataset(folder, "--data-dir")
    assert err.value.problem == "no such file"
    (folder / "dataset_dict.json").write_text('{"splits": "train"}')
    with pytest.raises(BadFile) as err:
        readers.load_saved_dataset(folder)
    assert err.value.problem == ("is not a file of a save_to_disk folder (--data-dir) (it has "
                                 "'splits' = 'train', not a list)")


def test_a_saved_split_without_rows_is_one_line(tmp_path):
    import datasets
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"label": [0, 1]}),
                          "test": datasets.Dataset.from_dict({"label": [1]})}).save_to_disk(
        str(folder))
    state = folder / "test" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "_data_files": []}))
    with pytest.raises(UsageError) as err:
        readers.load_saved_dataset(folder, "--data-dir")
    assert str(err.value) == ("--data-dir its split 'test' holds no rows; save the data again "
                              "without it, or with its images")
    state.write_text(json.dumps({**json.loads(state.read_text()), "_data_files": ["x.arrow"]}))
    with pytest.raises(BadFile) as err:
        readers.load_saved_dataset(folder)
    assert err.value.problem == ("is not a file of a save_to_disk folder (--data-dir) (it lists "
                                 "'x.arrow' as a data file)")


# -- every reader's line: the flag, then the file, then the problem and the kind's fix -------------
READS = {  # the file's bytes (None: no file), its kind, the reader
    "text not UTF-8": (b"a: 1\n\xff", "recipe", readers.read_text),
    "JSON empty": (b" \n", "manifest", readers.read_json),
    "JSON not JSON": (b'{"step": ', "manifest", readers.read_json),
    "JSON of another shape": (b'{"files": {}, "step": "two"}', "manifest", readers.read_json),
    "YAML not YAML": (b"a: [1\n", "recipe", readers.read_yaml),
    "YAML empty": (b"\n", "recipe", readers.read_yaml),
    "YAML of another shape": (b"- a\n", "recipe", readers.read_yaml),
    "no such file": (None, "manifest", readers.read_bytes),
    "not parquet": (b"PAR1 and no footer", "parquet", readers.parquet_file),
}


@pytest.mark.parametrize("label", ["", "--flag"])
@pytest.mark.parametrize("case", list(READS))
def test_each_line_names_the_flag_the_file_the_problem_and_the_fix(tmp_path, case, label):
    content, kind, read = READS[case]
    path = tmp_path / "file"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(BadFile) as err:
        read(path, kind, label)
    said = err.value
    assert said.problem and str(said) == \
        f"{label + ' ' if label else ''}{path}: {said.problem}; {readers.KINDS[kind].fix}"


def test_a_parquet_file_whose_pages_are_damaged_quotes_pyarrow(tmp_path):
    """The footer reads, a page does not (a copy damaged in its middle): the line quotes what
    pyarrow says reading the column."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "train-00000.parquet"
    pq.write_table(pa.table({"label": list(range(1000))}), path)
    page = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[page:page + 40] = b"\xab" * 40  # the page's header
    path.write_bytes(bytes(data))
    with pytest.raises(OSError) as theirs:
        pq.ParquetFile(path).read(columns=["label"])
    said = str(theirs.value).strip().splitlines()[0][:120]
    for handle in (None, readers.parquet_file(path, "parquet")):
        with pytest.raises(BadFile) as err:
            readers.read_parquet_table(path, "parquet", ["label"], "--data-dir", handle)
        assert str(err.value) == (f"--data-dir {path}: is not a readable parquet file ({said}); "
                                  f"{CUT}; copy it again")
    with pytest.raises(BadFile, match=f"^{path}: is not a readable parquet file"):
        readers.read_parquet_table(path, "parquet", ["label"])


def test_a_saved_dataset_of_one_split_and_each_bad_json_file_named_with_the_flag(tmp_path):
    import datasets
    one = tmp_path / "one"
    datasets.Dataset.from_dict({"label": [2, 0]}).save_to_disk(str(one))  # no dataset_dict.json
    assert readers.load_saved_dataset(one)["label"] == [2, 0]
    fix = readers.KINDS["saved_dataset"].fix
    info = one / "dataset_info.json"
    info.write_text("[]")
    with pytest.raises(BadFile) as err:
        readers.load_saved_dataset(one, "--data-dir")
    assert str(err.value) == (f"--data-dir {info}: is not a file of a save_to_disk folder "
                              f"(--data-dir) (it holds a list; expected a mapping); {fix}")
    info.write_text("{}")
    state = one / "state.json"
    good = json.loads(state.read_text())
    state.write_text(json.dumps({**good, "_data_files": "data.arrow"}))
    with pytest.raises(BadFile) as err:
        readers.load_saved_dataset(one, "--data-dir")
    assert str(err.value) == (f"--data-dir {state}: is not a file of a save_to_disk folder "
                              f"(--data-dir) (it has '_data_files' = 'data.arrow', not a list); "
                              f"{fix}")
    entry = {"file": "x" * 60}
    state.write_text(json.dumps({**good, "_data_files": [entry]}))
    with pytest.raises(BadFile) as err:
        readers.load_saved_dataset(one, "--data-dir")
    assert str(err.value) == (f"--data-dir {state}: is not a file of a save_to_disk folder "
                              f"(--data-dir) (it lists {str(entry)[:40]!r} as a data file); {fix}")
    state.write_text(json.dumps({**good, "_data_files": []}))
    with pytest.raises(UsageError) as err:
        readers.load_saved_dataset(one)
    assert str(err.value) == ("its split 'one' holds no rows; save the data again without it, "
                              "or with its images")
    state.write_text(json.dumps({**good, "_data_files": [{"filename": "gone.arrow"}]}))
    with pytest.raises(BadFile) as err:
        readers.load_saved_dataset(one, "--data-dir")
    assert str(err.value) == f"--data-dir {one / 'gone.arrow'}: no such file; {fix}"
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "dataset_dict.json").write_text("{")
    with pytest.raises(BadFile, match=rf"^--data-dir {tmp_path / 'two' / 'dataset_dict.json'}: "
                                      rf"is not valid JSON"):
        readers.load_saved_dataset(tmp_path / "two", "--data-dir")
