"""How a command-line process of accel_train ends: `python -m accel_train` and the `accel-train`
script call `exit_with(main())`, never main() itself (a program or test that calls main() in its
own process goes on running after it).

A process that imported torch, timm and the rest spends a noticeable share of its CPU in the
interpreter's exit, most of it the cyclic collector walking that imported heap again, object by
object, as the modules are torn down.  Collecting once here first runs the finalizers of
everything that is garbage now (a finished run's loaders, files and trackers, cycles included);
`gc.freeze()` then moves what is still reachable out of the collector's sight, so the exit frees
it by reference counts without walking it (the measurement: docs/performance.md, "How a command
ends").
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_with(code: int) -> NoReturn:
    gc.collect()
    gc.freeze()
    sys.exit(code)
