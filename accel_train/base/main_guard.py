"""fit() called at the top level of a script, outside `if __name__ == "__main__":`.

Loader workers start through forkserver (torch is not fork-safe once it has run), and a new
process imports the script that started the run to find what it defined: an unguarded fit()
there starts one more training in every worker, whose own workers import it again.  The run
hung, then failed inside multiprocessing.  Python's rule for any program that starts
processes; said in one line before anything starts.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import FrameType
from typing import Optional

from accel_train.base.errors import UsageError


def refuse_unguarded_call(frame: Optional[FrameType]) -> None:
    """`frame`: fit()'s caller.  Walks up to the script's own top-level code (a script run as
    `python script.py`; not an interactive session or a notebook, which have no file) and
    refuses when the statement running there is not under a `__name__` guard."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_globals is getattr(main, "__dict__", None)):
        frame = frame.f_back
    if frame is None or not script or not str(script).endswith(".py"):
        return
    try:
        tree = ast.parse(Path(script).read_text(), filename=script)
    except (OSError, SyntaxError, ValueError):  # its source is not ours to judge
        return
    line = frame.f_lineno
    statement = next((node for node in tree.body
                      if node.lineno <= line <= (node.end_lineno or node.lineno)), None)
    if statement is None or _is_main_guard(statement):
        return
    raise UsageError(f"{script}:{line}: fit() runs at the top level of the script; the data "
                     f"loader's worker processes import the script again and would each start "
                     f"a training: put the call under `if __name__ == \"__main__\":`")


def _is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either way round)."""
    return isinstance(node, ast.If) and any(isinstance(n, ast.Name) and n.id == "__name__"
                                            for n in ast.walk(node.test))
