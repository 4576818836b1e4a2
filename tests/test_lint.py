"""The code passes the linter (ruff, settings in ruff.toml), so CI's one test command lints too."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import REPO


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed; it comes with the test extra: "
                    "pip install -e '.[test]'")
    result = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
