"""The subcommands around training: eval, predict, export, plot, launch (`train` lives in
cli.py).

Each module has `main(argv) -> exit code` and imports torch and friends only once its arguments
parsed, so `accel-train SUBCOMMAND --help` and argument errors stay instant.
"""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

SUMMARIES = {
    "eval": "loss, top-1/top-5 and per-class accuracy of a run, checkpoint or export",
    "predict": "top-k classes with probabilities for image files or folders",
    "export": "a checkpoint -> model.safetensors + model_config.json",
    "plot": "PNG curves (loss, learning rate, accuracy, throughput) of a run",
    "launch": "accelerate launch plus elastic settings (restarts, rendezvous) from a YAML",
}


def _lazy(name: str) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        return importlib.import_module(f"{__name__}.{name}").main(argv)
    return run


def subcommands() -> dict[str, Callable[[Sequence[str]], int]]:
    return {name: _lazy(name) for name in SUMMARIES}
