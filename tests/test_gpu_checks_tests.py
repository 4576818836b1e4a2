"""benchmarks/gpu_checks.sh's last step runs the tests that need a GPU, on a machine that has
one; every test this CPU skips for want of a GPU must be among them, or it runs nowhere.

Oracle: pytest's own collection, twice: the tests whose skipif mark is in force for want of a
GPU (its reason names one), collected from the whole suite; and the tests the script's own
pytest command selects (its files and its -k expression, read from the script)."""

from __future__ import annotations

import shlex
import sys

import pytest
import torch

from conftest import REPO, run
from conftest import test_env as child_env

pytestmark = pytest.mark.slow  # two collections of the suite in processes of their own

# Writes the node ids of the tests whose skipif mark, in force here, names a GPU.
PROBE = '''
import os

def pytest_collection_modifyitems(items):
    with open(os.environ["GPU_ONLY_OUT"], "w") as out:
        for item in items:
            if any(mark.args and mark.args[0] is True and "GPU" in mark.kwargs.get("reason", "")
                   for mark in item.iter_markers("skipif")):
                out.write(item.nodeid + "\\n")
'''


def gpu_checks_pytest_command() -> tuple[list[str], str]:
    """(the test files, the -k expression) of gpu_checks.sh's pytest command."""
    script = (REPO / "benchmarks" / "gpu_checks.sh").read_text().replace("\\\n", " ")
    line = next(line for line in script.splitlines() if " -m pytest " in line)
    words = shlex.split(line.split("2>&1")[0])
    return [word for word in words if word.startswith("tests/")], words[words.index("-k") + 1]


def collected(args: list[str], **env: str) -> set[str]:
    result = run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                  "no:cacheprovider", *args], env=child_env(**env), check=True)
    return {line for line in result.stdout.splitlines() if "::" in line}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU nothing is skipped for one")
def test_every_test_skipped_for_want_of_a_gpu_is_one_gpu_checks_runs(tmp_path):
    (tmp_path / "gpu_only_probe.py").write_text(PROBE)
    listing = tmp_path / "gpu_only.txt"
    collected(["-p", "gpu_only_probe", "tests"], PYTHONPATH=str(tmp_path),
              GPU_ONLY_OUT=str(listing))
    gpu_only = set(listing.read_text().split())
    # the probe finds them: one of them by name
    assert "tests/test_batched_resize.py::test_the_gather_and_the_resize_on_cuda_are_the_cpus" \
        in gpu_only, gpu_only
    files, expression = gpu_checks_pytest_command()
    run_there = collected([*files, "-k", expression])
    assert gpu_only <= run_there, sorted(gpu_only - run_there)
