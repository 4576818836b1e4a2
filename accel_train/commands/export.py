"""`accel-train export CHECKPOINT --output-dir DIR`: a checkpoint (or a run) ->
DIR/model.safetensors plus DIR/model_config.json, the same two files a finished run leaves.

The export holds the weights only (no optimizer or RNG state, no pickles), loads with
`accel_train.model.build_from_spec` + safetensors, and is itself accepted by `eval` and `predict`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from ..cli import _Parser
from ..errors import UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accel-train export", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="CHECKPOINT",
                        help="a step_XXXXXXXX checkpoint folder, or a run directory (its final "
                             "model, else its newest valid checkpoint)")
    parser.add_argument("--output-dir", "-o", required=True, metavar="DIR",
                        help="folder to write model.safetensors and model_config.json into")
    return parser


def export(trained, output_dir: Path) -> Path:
    """Write the weights (wrapper prefixes removed, checked against the model) and the spec."""
    from ..model import WEIGHTS_FILE, save_weights
    from .artifacts import load_model
    if (output_dir / WEIGHTS_FILE).exists():
        raise UsageError(f"--output-dir {output_dir} already holds {WEIGHTS_FILE}; choose a new "
                         f"folder or remove it")
    # Loading into the rebuilt model proves the weights fit the spec before anything is written.
    model = load_model(trained)
    return save_weights(model.state_dict(), output_dir, trained.spec)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    from .artifacts import find_trained_model
    trained = find_trained_model(args.model, lambda text: print(f"warning: {text}"))
    weights = export(trained, Path(args.output_dir))
    print(f"exported {trained.description}\n  -> {weights}\n  -> "
          f"{weights.parent / 'model_config.json'}")
    return 0
