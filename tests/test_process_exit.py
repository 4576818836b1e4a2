"""How a command-line process ends (accel_train/base/process_exit.py): garbage of the run finalized
first, then the rest frozen for the interpreter's exit; `python -m accel_train` and the
`accel-train` script both end that way.  Oracles: a finalizer's own file, the collector's
freeze count read at exit (atexit), the installed entry point's metadata."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

from conftest import REPO
from conftest import test_env as child_env  # (imported as test_env, pytest would collect it)

# A cycle only the cyclic collector can free, whose finalizer writes a file, made garbage just
# before the process ends; and the freeze count as the exit's handlers see it.
PROBE = r"""
import atexit, gc, sys
from accel_train.base.process_exit import exit_with

atexit.register(lambda: open(sys.argv[2], "w").write(str(gc.get_freeze_count())))

class Noted:
    def __del__(self):
        open(sys.argv[1], "w").write("finalized")

noted = Noted()
noted.itself = noted
del noted
exit_with(3)
"""


def test_garbage_is_finalized_and_the_rest_frozen_before_the_exit(tmp_path):
    finalized, frozen = tmp_path / "finalized", tmp_path / "frozen"
    result = subprocess.run([sys.executable, "-c", PROBE, str(finalized), str(frozen)],
                            env=child_env(), cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 3, result.stderr
    assert finalized.read_text() == "finalized", "the run's cyclic garbage was never finalized"
    assert int(frozen.read_text()) > 0, "nothing was frozen before the exit"


def test_python_dash_m_and_the_script_end_through_it(tmp_path):
    frozen = tmp_path / "frozen"
    # (an unknown subcommand: exit 2 before anything heavy is imported)
    run_module = ("import atexit, gc, runpy, sys; "
                  f"atexit.register(lambda: open({str(frozen)!r}, 'w')"
                  ".write(str(gc.get_freeze_count()))); "
                  "sys.argv = ['accel_train', 'no-such-subcommand']; "
                  "runpy.run_module('accel_train', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", run_module], env=child_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unknown subcommand" in result.stderr, result.stderr
    assert int(frozen.read_text()) > 0
    script, = [point for point in entry_points(group="console_scripts")
               if point.name == "accel-train"]
    assert script.value == "accel_train.cli:entry"
