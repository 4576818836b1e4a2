"""`accel-train plot RUN_DIR`: PNG curves from the run's metrics.jsonl (also while it runs).

Writes loss_lr.png (loss and learning rate vs step), accuracy.png (train and held-out accuracy vs
epoch) and throughput.png (images/s and data waiting vs step) into RUN_DIR/plots, or --output-dir.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from accel_train.cli import _Parser
from accel_train.base.errors import UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accel-train plot", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--output-dir", "--output", "-o", metavar="DIR",
                        help="where to write the PNGs (default: RUN_DIR/plots)")
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    from accel_train.run.plots import write_plots
    from accel_train.run.rundir import CONFIG_FILE, METRICS_FILE
    run_dir = Path(args.run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        if (run_dir / CONFIG_FILE).is_file():  # a run stopped before its first logged steps
            raise UsageError(f"{run_dir}: the run logged no step yet ({METRICS_FILE} comes with "
                             f"the first --log-every steps); plot again after them")
        raise UsageError(f"{run_dir}: no {METRICS_FILE} there; pass a run directory (the "
                         f"--output-dir of a training run)")
    written = write_plots(run_dir, Path(args.output_dir) if args.output_dir else None)
    if not written:
        raise UsageError(f"{run_dir / METRICS_FILE} holds no training or epoch lines yet; plot "
                         f"again after the first --log-every steps")
    print("\n".join(str(path) for path in written))
    return 0
