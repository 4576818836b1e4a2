"""scripts/with_env keys its environment by what pip installs from: a dependency change builds a
new one, an edit of the pytest or mutmut settings in setup.cfg does not (each build is ~6 GB).
The script runs as users run it, in a copy of the packaging files, with a Python that cannot
build anything (`false`): the environment it would build is named on its first line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from conftest import REPO


def env_it_would_build(repo: Path, env_home: Path) -> str:
    result = subprocess.run(["bash", str(repo / "scripts" / "with_env"), "true"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "ACCEL_TRAIN_ENV_HOME": str(env_home),
                                 "ACCEL_TRAIN_PYTHON": "false"})
    assert result.returncode != 0, result  # `false -m venv` builds nothing
    return re.search(r"with_env: building (\S+)", result.stderr).group(1)


def test_the_environment_is_keyed_by_the_dependencies_not_the_tool_settings(tmp_path):
    repo = tmp_path / "clone"
    (repo / "scripts").mkdir(parents=True)
    for name in ("setup.cfg", "pyproject.toml", "scripts/with_env"):
        shutil.copy(REPO / name, repo / name)
    setup = (repo / "setup.cfg").read_text()
    first = env_it_would_build(repo, tmp_path / "envs")
    assert Path(first).parent == tmp_path / "envs"
    assert env_it_would_build(repo, tmp_path / "envs") == first
    for tool_edit in ("[tool:pytest]\n", "[mutmut]\n"):
        assert tool_edit in setup
        (repo / "setup.cfg").write_text(setup.replace(tool_edit, tool_edit + "# a comment\n"))
        assert env_it_would_build(repo, tmp_path / "envs") == first, tool_edit
    for dependency_edit in ("[options]\n", "[options.extras_require]\n"):
        (repo / "setup.cfg").write_text(setup.replace(dependency_edit,
                                                      dependency_edit + "# a comment\n"))
        assert env_it_would_build(repo, tmp_path / "envs") != first, dependency_edit
    (repo / "setup.cfg").write_text(setup)
    (repo / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text() + "\n")
    assert env_it_would_build(repo, tmp_path / "envs") != first
