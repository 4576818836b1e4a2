"""Command line: `accel-train [train|eval|predict|export|plot] ...` and `python -m accel_train ...`.

Training flags are generated from `TrainConfig`'s fields, each in both spellings
(`--batch-size` and the seed manual's `--batch_size`).  Bad input becomes one line on stderr and
exit code 2 (`UsageError`); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING, fields
from typing import Callable, Sequence

from .config import TrainConfig, load_run_yaml
from .errors import UsageError

GROUP_TITLES = {
    "data": "data",
    "model": "model",
    "optimization": "optimization",
    "output": "output, logging and checkpoints",
    "distributed": "distributed (the seed manual's flags; launchers set the real values)",
}
_TYPES = {"int": int, "float": float, "str": str}


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so every bad input takes the same exit path."""

    def error(self, message):
        raise UsageError(f"{message} (see --help)")


def _field_flags(f) -> list[str]:
    dash = "--" + f.name.replace("_", "-")
    under = "--" + f.name
    return list(dict.fromkeys([dash, under, *f.metadata.get("flags", ())]))


def _field_default(f):
    return f.default_factory() if f.default is MISSING else f.default


def add_train_options(parser: argparse.ArgumentParser) -> None:
    """Add every TrainConfig field as an option, grouped by topic, defaults in the help."""
    parser.add_argument("--config", metavar="RUN.yaml",
                        help="Run config file of training options (CLI flags override it); a "
                             "run directory's config.yaml repeats that run.")
    groups = {key: parser.add_argument_group(title) for key, title in GROUP_TITLES.items()}
    for f in fields(TrainConfig):
        meta = f.metadata
        default = _field_default(f)
        help_text = f"{meta['help']} (default: {default!r})"
        kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)
        type_name = str(f.type).replace("Optional[", "").rstrip("]")
        if type_name == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif type_name == "list":
            kwargs["nargs"] = meta.get("nargs", "*")
        else:
            kwargs["type"] = _TYPES[type_name]
            kwargs["metavar"] = f.name.upper()
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
            kwargs.pop("metavar", None)
        groups[meta["group"]].add_argument(*_field_flags(f), **kwargs)


def config_from_args(namespace: argparse.Namespace) -> TrainConfig:
    """Dataclass defaults < run YAML (--config) < flags given on the command line."""
    values = {}
    if getattr(namespace, "config", None):
        values.update(load_run_yaml(namespace.config))
    names = {f.name for f in fields(TrainConfig)}
    values.update({k: v for k, v in vars(namespace).items() if k in names})
    return TrainConfig.from_dict(values, source=namespace.config or "command line")


def build_train_parser(prog: str = "accel-train train") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Train an image classifier (any timm model) with "
                     "Hugging Face Accelerate, on one device or many.",
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="Launch on many processes with accelerate launch, torchrun or python "
                            "-m torch.distributed.launch; see README.md.")
    add_train_options(parser)
    return parser


def _run_train(argv: Sequence[str]) -> int:
    config = config_from_args(build_train_parser().parse_args(argv))
    from .trainer import run_training  # heavy imports only once the input is known good
    return run_training(config)


def _subcommands() -> dict[str, Callable[[Sequence[str]], int]]:
    return {"train": _run_train}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _subcommands()
    if argv and argv[0] in commands:
        name, rest = argv[0], argv[1:]
    else:  # `python -m accel_train --epochs 3` means train, as the seed scripts did
        name, rest = "train", argv
    if argv[:1] in (["-h"], ["--help"]) and len(commands) > 1:
        print(f"subcommands: {', '.join(commands)} (default: train); "
              f"`accel-train SUBCOMMAND --help` for each.\n", file=sys.stdout)
    try:
        return commands[name](rest) or 0
    except UsageError as err:
        prefix = "accel_train: error: "
        rank = os.environ.get("RANK")
        if rank not in (None, "0"):
            prefix = f"accel_train: error (rank {rank}): "
        print(prefix + str(err).replace("\n", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("accel_train: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
