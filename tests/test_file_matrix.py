"""The corruption matrix (issue 27): every kind of file the product reads (readers.KINDS), each
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
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

from conftest import REPO, TINY_TRAIN, accel_train_here

from accel_train import readers

HALF_STEP, STEP = "step_00000001", "step_00000002"
EMA = ["--model-ema"]


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


COMMON = {"empty": _empty, "cut in half": _cut_in_half, "random bytes": _random_bytes}
JSON = {**COMMON, "JSON of another shape": _json_of_another_shape}
YAML = {**COMMON, "YAML of another shape": _yaml_of_another_shape}
WEIGHTS = {**COMMON, "another model's weights": _another_models_weights}


# -- the trained run every case copies -----------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Two steps with EMA, a checkpoint after each: step_1 is the older good one."""
    out = tmp_path_factory.mktemp("matrix") / "run"
    accel_train_here(*TINY_TRAIN, *EMA, "--max-steps", "2", "--checkpoint-every", "1",
                     "--output-dir", str(out), check=True)
    assert (out / "checkpoints" / STEP / "ema.safetensors").is_file()
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
    needs: list[str] = field(default_factory=list)      # flags the commands need besides


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
        {**JSON, "another model's file": _another_models_config}, RESUMES + READS_CHECKPOINT,
        sealed=True, says={"JSON of another shape": "has no 'model_name'",
                           "another model's file": "resnet18"}),
    Row("checkpoint_weights", f"{CHECKPOINT}/model.safetensors", WEIGHTS,
        RESUMES + READS_CHECKPOINT, sealed=True),
    Row("checkpoint_weights", f"{CHECKPOINT}/ema.safetensors", WEIGHTS, RESUMES, sealed=True,
        says={"another model's weights": "holds another model's weights"}),
    Row("accelerate_state", f"{CHECKPOINT}/optimizer.bin", COMMON, RESUMES, sealed=True),
    Row("accelerate_state", f"{CHECKPOINT}/random_states_0.pkl", COMMON, RESUMES, sealed=True),
    Row("model_config", "model_config.json", {**JSON, "another model's file":
                                              _another_models_config}, READS_RUN,
        says={"another model's file": "does not fit"}),
    Row("run_weights", "model.safetensors", WEIGHTS, READS_RUN),
    Row("run_config", "config.yaml", YAML, ["eval RUN", "plot"]),
]


def _cases():
    for row in ROWS:
        for corruption in row.corruptions:
            for command in row.commands:
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
