"""Files are read through accel_train/base/readers.py only: an AST scan of accel_train/
that fails when another module decodes a file itself (json/yaml/torch/pickle loads, safetensors,
pyarrow's readers, Path.read_text/read_bytes, open() for reading, accelerate's config reader),
but for the exceptions listed here, each with its reason.  A new one needs a reader (and a row
in tests/test_file_matrix.py), or a line here saying why not."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

DECODERS = {"json", "yaml", "torch", "pickle"}
DECODE_CALLS = {"load", "loads", "safe_load", "full_load", "unsafe_load"}
READ_CALLS = {"load_file", "safe_open", "ParquetFile", "read_table", "open_file", "read_text",
              "read_bytes", "load_from_disk", "load_config_from_file", "memory_map"}
READER_MODULE = "accel_train/base/readers.py"

# (module, the call) -> why it is not a reader call.
EXCEPTIONS = {
    ("accel_train/run/runlock.py", "read_bytes"): "run.lock: a record another start may be writing "
    "this instant, judged by runlock.read_holder itself (its own one line, never 'stale'); the "
    "matrix row is tests/test_bad_files.py::test_a_run_lock_damaged",
    ("accel_train/run/runlock.py", "json.loads"): "the same run.lock record (see read_bytes)",
    ("accel_train/run/runlock.py", "read_text"): "/proc files of the kernel (boot id, a process's "
    "start time), not files users or runs hand us",
    ("accel_train/run/distributed.py", "read_text"): "NVIDIA's kernel-module version file in /proc",
    ("accel_train/base/weightfiles.py", "read_text"): "/proc/self/status, the kernel's word on "
    "this process's umask",
    ("accel_train/run/rank_launcher.py", "read_bytes"): "/proc/PID/cmdline of the parent launcher",
    ("accel_train/run/rank_launcher.py", "load_config_from_file"): "accelerate's default or given "
    "config, which accelerate launch itself has just read successfully to start this process",
    ("accel_train/model/transformers_models.py", "json.loads"): "a transformers model's config "
    "as transformers itself serialized it in this process (to_json_string): not a file",
    ("accel_train/run/collectives.py", "json.loads"): "a heartbeat from the process group's store, "
    "written by our own ranks: not a file",
    ("accel_train/data/streaming/shards.py", "json.loads"): "the `datasets` features inside the "
    "schema of a parquet shard that readers.parquet_file opened: names that are missing, "
    "unreadable or in another layout leave the class numbers, never an error",
    ("accel_train/run/checkpoint.py", "load"): "accelerate.utils.load of the RNG file with "
    "weights_only=True, after readers.check_torch_file vetted it (AccelerateState._vet_files)",
    ("accel_train/run/checkpoint.py", "open"): "the checksum of a file's bytes (any bytes are "
    "fine)",
    ("accel_train/data/decode.py", "read_bytes"): "image files: a broken one is substituted and "
    "named (--bad-images, badimages.py; tests/test_bad_images.py), never read as one of our kinds",
    ("accel_train/data/decode.py", "Image.open"): "the same images, decoded by Pillow under "
    "--bad-images",
    ("accel_train/data/jpeg_decoders.py", "Image.open"): "the EXIF orientation of image bytes "
    "already read (decode.py's), from their header; one PIL cannot read is taken as upright",
    ("accel_train/data/streaming/max_side.py", "Image.open"): "image bytes shard has read, "
    "opened for their size before a resize; one PIL cannot open is stored as it is, for "
    "training's --bad-images to name (tests/test_shard_max_side.py)",
    ("accel_train/__init__.py", "load"): "an import hook's module loader (timm's), not a file",
    ("accel_train/base/main_guard.py", "read_text"): "the source of the user's running script, "
    "parsed to see whether fit() is under a __main__ guard; unreadable or not Python: no check",
    ("accel_train/model/onnx_export.py", "json.loads"): "the preprocessing record inside an ONNX "
    "file, which ONNX Runtime has just read; a record of another shape is one line there",
    ("accel_train/data/streaming/shards.py", "open"): "the first 512 bytes of a shard, to tell a "
    "tar from parquet; an OSError is one line there",
    ("accel_train/data/streaming/shards.py", "tarfile.open"): "tar shards, read member by member "
    "as a stream; tarfile's errors are one line there (the matrix's tar rows)",
}


def _call_name(call: ast.Call, from_readers: frozenset = frozenset()) -> str | None:
    """'json.loads', 'read_text', 'open', 'Image.open', ... when `call` reads or decodes."""
    func = call.func
    if isinstance(func, ast.Attribute):
        receiver = func.value.id if isinstance(func.value, ast.Name) else None
        if receiver in DECODERS and func.attr in DECODE_CALLS:
            return f"{receiver}.{func.attr}"
        if func.attr in READ_CALLS:
            return func.attr
        if func.attr == "open" and (receiver == "Image" or receiver == "tarfile"
                                    and _read_mode(call, 1)):
            return f"{receiver}.{func.attr}"
        if func.attr == "open" and _read_mode(call, 0):
            return "open"
        return None
    if isinstance(func, ast.Name) and func.id not in from_readers:
        if func.id in READ_CALLS or func.id in ("load", "loads"):
            return func.id
        if func.id == "open" and _read_mode(call, 1):
            return "open"
    return None


def _read_mode(call: ast.Call, position: int) -> bool:
    """open()'s mode (positional at `position`, or mode=) reads: absent, or without w/a/x."""
    mode = next((k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None and len(call.args) > position:
        mode = call.args[position]
    if mode is None:
        return True
    return isinstance(mode, ast.Constant) and not set(str(mode.value)) & set("wax")


def _reads_outside_readers() -> set[tuple[str, str]]:
    found = set()
    for source in sorted((REPO / "accel_train").rglob("*.py")):
        module = str(source.relative_to(REPO))
        if module == READER_MODULE:
            continue
        tree = ast.parse(source.read_text())
        from_readers = frozenset(alias.asname or alias.name for node in ast.walk(tree)
                                 if isinstance(node, ast.ImportFrom)
                                 and (node.module or "").endswith("readers")
                                 for alias in node.names)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (name := _call_name(node, from_readers)):
                found.add((module, name))
    return found


def test_files_are_read_through_readers_only():
    found = _reads_outside_readers()
    unexplained = sorted(found - set(EXCEPTIONS))
    assert not unexplained, ("read outside accel_train/base/readers.py, with no reason in "
                             f"EXCEPTIONS: {unexplained}")


def test_every_exception_is_still_needed():
    """An exception whose call is gone is removed, so the list stays what is true."""
    assert sorted(set(EXCEPTIONS) - _reads_outside_readers()) == []


def test_the_scan_sees_a_read(tmp_path):
    """The control: each form of read is seen."""
    calls = ["json.loads(p.read_text())", "yaml.safe_load(f)", "torch.load(p)", "load_file(p)",
             "open(p).read()", "open(p, 'rb')", "p.open()", "pq.ParquetFile(p)"]
    seen = [_call_name(node) for code in calls for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Call)]
    assert {"json.loads", "read_text", "yaml.safe_load", "torch.load", "load_file", "open",
            "ParquetFile"} <= set(seen)
    assert _call_name(ast.parse("open(p, 'w')").body[0].value) is None
    assert _call_name(ast.parse("p.open('a')").body[0].value) is None
    assert Path(REPO / READER_MODULE).is_file()
