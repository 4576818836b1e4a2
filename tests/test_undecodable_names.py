"""Image files whose names are not UTF-8: a zip made on Windows and unpacked on Linux keeps
its names in the old Windows code page ("föto.jpg" as the bytes f\\xf6to.jpg), which Python
reads with surrogates that no index of names can store.  Training, check-data and predict
each refuse in one line naming the file and how to rename it, never a traceback.

Oracle: the bytes written here, and the exit code and stderr of the real commands.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

import imagekinds as kinds
from conftest import accel_train_here

pytestmark = pytest.mark.skipif(os.name != "posix", reason="file names as bytes: POSIX only")


def windows_zip_folder(root: Path) -> Path:
    """Two classes, one of them (and its files) named in cp1252 bytes."""
    for label, folder in enumerate((b"ant", "café".encode("cp1252"))):
        path = os.path.join(os.fsencode(root), folder)
        os.makedirs(path)
        for i in range(3):
            name = os.path.join(path, f"föto{i}.png".encode("cp1252"))
            Image.fromarray(kinds.pixels(10 * label + i)).save(os.fsdecode(name), format="PNG")
    return root


def refused_in_one_line(*args: str) -> str:
    result = accel_train_here(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("command", ["train", "check-data", "predict", "predict-file"])
def test_a_file_name_that_is_not_utf8_is_one_line_naming_it(tmp_path, command):
    root = windows_zip_folder(tmp_path / "photos")
    if command == "train":
        line = refused_in_one_line("--data-dir", str(root), "--model", "test_resnet",
                                   "--max-steps", "1", "--no-plots", "--output-dir",
                                   str(tmp_path / "run"))
        assert not (tmp_path / "run").exists()
    elif command == "check-data":
        line = refused_in_one_line("check-data", "--data-dir", str(root))
    else:  # a folder, or one file of it given by its path (its CSV row could not name it)
        clean = tmp_path / "clean"
        for label in ("ant", "bee"):
            for i in range(2):
                image = clean / label / f"{i}.png"
                image.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(kinds.pixels(i)).save(image)
        trained = accel_train_here("--data-dir", str(clean), "--model", "test_resnet",
                                   "--max-steps", "1", "--batch-size", "2", "--num-workers",
                                   "0", "--no-plots", "--output-dir", str(tmp_path / "run"))
        assert trained.returncode == 0, trained.stderr[-3000:]
        given = root if command == "predict" else os.fsdecode(
            os.path.join(os.fsencode(root), "café/föto0.png".encode("cp1252")))
        line = refused_in_one_line("predict", str(tmp_path / "run"), str(given), "--csv",
                                   str(tmp_path / "predictions.csv"))
    assert "caf\\xe9/f\\xf6to0.png'" in line  # the bytes as they are on disk
    assert "not UTF-8" in line and "convmv" in line
