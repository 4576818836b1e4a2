"""Accented file and folder names written in either Unicode form.  macOS's HFS+ (and zips made
on it) write "é" decomposed (NFD: "e" and a combining accent), Linux tools and CSV writers
composed (NFC); the two print alike, so a class folder or a label file's line that differs only
so names the same thing to the user.

Oracle: the names as written here, and their forms by Python's unicodedata.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from PIL import Image

import imagekinds as kinds
from accel_train.cli import main

CLASSES = ("café", "thé")


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def nfd(text: str) -> str:
    return unicodedata.normalize("NFD", text)


def image(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(kinds.pixels(seed)).save(path)


def check_data(capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["check-data", *args, "--json", "--workers", "1"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("train_form, val_form", [(nfc, nfd), (nfd, nfc)],
                         ids=["train-composed", "train-decomposed"])
def test_a_class_folder_spelt_in_the_other_form_in_val_is_the_same_class(
        tmp_path, capsys, train_form, val_form):
    for split, form, count, seed in (("train", train_form, 3, 0), ("val", val_form, 1, 50)):
        for label, name in enumerate(CLASSES):
            for i in range(count):
                image(tmp_path / split / form(name) / f"{i}.png", seed + 10 * label + i)
    code, findings = check_data(capsys, "--data-dir", str(tmp_path))
    assert (code, findings["classes_in_one_split"]) == (0, {})
    assert findings["classes"] == [train_form(name) for name in CLASSES]  # the training spelling
    assert findings["class_counts"]["validation"] == {train_form(name): 1 for name in CLASSES}


def test_a_val_labels_file_in_the_other_form_names_the_images_and_classes(tmp_path, capsys):
    for label, name in enumerate(CLASSES):
        for i in range(3):
            image(tmp_path / "train" / nfd(name) / f"{i}.png", 10 * label + i)
    lines = []
    for i, name in enumerate(CLASSES * 2):
        image(tmp_path / "val" / nfd(f"été{i}.png"), 50 + i)
        lines.append(f"{nfc(f'été{i}.png')},{nfc(name)}\n")
    (tmp_path / "val.csv").write_text("".join(lines), encoding="utf-8")
    code, findings = check_data(capsys, "--data-dir", str(tmp_path),
                                "--val-labels", str(tmp_path / "val.csv"))
    assert code == 0
    assert findings["class_counts"]["validation"] == {nfd(name): 2 for name in CLASSES}


def test_a_train_labels_file_in_the_other_form_names_the_images(tmp_path, capsys):
    lines = ["file,label\n"]
    for i in range(6):
        image(tmp_path / "photos" / nfd(f"photo_é{i}.jpg"), i)
        lines.append(f"{nfc(f'photo_é{i}.jpg')},{'ab'[i % 2]}\n")
    (tmp_path / "train.csv").write_text("".join(lines), encoding="utf-8")
    code, findings = check_data(capsys, "--data-dir", str(tmp_path / "photos"),
                                "--train-labels", str(tmp_path / "train.csv"))
    assert code == 0
    assert findings["class_counts"]["train"] == {"a": 3, "b": 3}
