"""The subcommands around training: eval, predict, export, plot, launch, check-data, ...
(`train` lives in cli.py).

Each module has `main(argv) -> exit code` and imports torch and friends only once its arguments
parsed, so `accel-train SUBCOMMAND --help` and argument errors stay instant.
"""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

SUMMARIES = {
    "eval": "loss, top-1/top-5 and per-class accuracy of a run, checkpoint or export",
    "predict": "top-k classes with probabilities for image files or folders",
    "export": "a run or checkpoint -> timm's folder format (+ model card, + ONNX) for timm, "
              "transformers and the Hub",
    "plot": "PNG curves (loss, learning rate, accuracy, throughput) of a run",
    "launch": "accelerate launch plus elastic settings (restarts, rendezvous) from a YAML",
    "check-data": "decode every image (in parallel): unreadable files, class counts, sizes, "
                  "duplicates across splits",
    "shard": "any training data -> WebDataset tar shards + index.json, for --data-dir streaming",
}

# eval, predict and export: a checkpoint's averaged weights instead of its trained ones
EMA_HELP = ("a checkpoint's EMA weights (ema.safetensors, kept by --model-ema) instead of its "
            "trained weights; a finished run's model.safetensors is already the better of the two")


def _lazy(name: str) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        module = name.replace("-", "_")  # check-data lives in check_data.py
        return importlib.import_module(f"{__name__}.{module}").main(argv)
    return run


def subcommands() -> dict[str, Callable[[Sequence[str]], int]]:
    return {name: _lazy(name) for name in SUMMARIES}
