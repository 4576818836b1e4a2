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

from accel_train.config import (FROM_PROGRAM, PRECISIONS, TrainConfig, check_one_run_length,
                                load_run_yaml)
from accel_train.base.command import set_command
from accel_train.base.errors import RunStopped, UsageError, stacks_on_request

GROUP_TITLES = {
    "data": "data",
    "model": "model",
    "optimization": "optimization",
    "output": "output, logging and checkpoints",
    "distributed": "distributed (the launcher sets the real values; these are checked against "
                   "it) and DDP tuning",
}
_TYPES = {"int": int, "float": float, "str": str}
TRAIN_SUMMARY = "train an image classifier (the default; options below)"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every spelling of an option on one line with its value named once
    (`--batch-size, --batch_size BATCH_SIZE`), and an on/off switch's off form once: argparse
    would repeat the value for each spelling."""

    def _format_action_invocation(self, action):
        if not action.option_strings:
            return super()._format_action_invocation(action)
        if isinstance(action, argparse.BooleanOptionalAction):
            on = [s for s in action.option_strings if not s.startswith("--no-")]
            return ", ".join(on + ["--no-" + on[0][2:]])
        if action.nargs == 0:
            return ", ".join(action.option_strings)
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        return ", ".join(action.option_strings) + " " + value


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so every bad input takes the same exit path.
    No abbreviations: with two spellings of every option, `--out` was "ambiguous" between
    --output-dir and --output_dir while `--epoch` silently meant --epochs, and an option added
    later would make a script's abbreviation ambiguous.  A word close to an option's name is
    offered instead."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message}{self._close_option(message)} (see --help)")

    def _close_option(self, message: str) -> str:
        import difflib
        if not message.startswith("unrecognized arguments: "):
            return ""
        known = [s for action in self._actions for s in action.option_strings
                 if s.startswith("--")]
        for word in message.split(": ", 1)[1].split():
            close = difflib.get_close_matches(word.split("=")[0], known, n=1, cutoff=0.75)
            if word.startswith("--") and close:
                return f"; {word.split('=')[0]} is not an option: did you mean {close[0]}?"
        return ""


def _field_flags(f) -> tuple[list[str], list[str]]:
    """(spellings shown in --help, accepted-but-hidden spellings).  Every spelling is shown:
    --dash-name first, then the --underscore_name of the seed manual (the classic PyTorch DDP
    script's manual: --batch_size, --learning_rate, ...), then any extra alias, because people
    coming from that manual search --help for the underscore names.  Nothing is hidden."""
    dash = "--" + f.name.replace("_", "-")
    return list(dict.fromkeys([dash, "--" + f.name, *f.metadata.get("flags", ())])), []


def _describe_default(value) -> str:
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    return str(value)


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
        help_text = meta["help"]
        if "(default:" not in help_text:  # some helps explain their default in words
            help_text += f" (default: {_describe_default(default)})"
        kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)
        type_name = str(f.type).replace("Optional[", "").rstrip("]")
        if type_name == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif type_name == "list":
            kwargs["nargs"] = meta.get("nargs", "*")
        else:
            kwargs["type"] = _TYPES[type_name]
            kwargs["metavar"] = f.name.upper()
            if "bare" in meta:  # the flag alone stands for this value (--pretrained: hub)
                kwargs.update(nargs="?", const=meta["bare"])
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
            kwargs.pop("metavar", None)
        shown, hidden = _field_flags(f)
        groups[meta["group"]].add_argument(*shown, **kwargs)
        if hidden:
            groups[meta["group"]].add_argument(*hidden, **{**kwargs, "help": argparse.SUPPRESS})


def launcher_defaults(environ) -> dict:
    """Training options that `accelerate launch` passes from its config file (as environment
    variables).  Only the precision is also a training option: taking it means a user who chose
    bf16 in `accelerate config` trains in bf16 instead of silently in fp32.  Its "no" is also
    what accelerate exports when nobody chose anything, so it leaves our `auto` in place: a
    precision is taken from there only when it is bf16.  Its fp16 is `auto` as well: the answer
    to "mixed precision?" that `accelerate config` suggests first, which auto already gives on a
    GPU, and which a CPU cannot run (there auto measures bf16 against fp32; the trainer says so,
    precision.accelerate_fp16_note)."""
    precision = environ.get("ACCELERATE_MIXED_PRECISION")
    if precision in (None, "no", "fp16"):
        return {}
    if precision not in PRECISIONS:
        raise UsageError(f"the accelerate config asks for mixed_precision {precision!r}, which "
                         f"accel_train does not support; pass --mixed-precision "
                         f"{'/'.join(PRECISIONS)} or change it with `accelerate config`")
    return {"mixed_precision": precision}


def config_from_args(namespace: argparse.Namespace, environ=None) -> TrainConfig:
    """Dataclass defaults < accelerate launch's config < run YAML (--config) < command-line
    flags."""
    values = launcher_defaults(os.environ if environ is None else environ)
    if getattr(namespace, "config", None):
        values.update(load_run_yaml(namespace.config))
        given = vars(namespace)
        if values.pop(FROM_PROGRAM, False) and not (given.get("data_dir") or given.get("dataset")):
            raise UsageError(f"--config {namespace.config} is the record of a run of fit() on "
                             f"datasets a program handed it, which the command line cannot "
                             f"load; pass --data-dir PATH or --dataset NAME beside it")
    names = {f.name for f in fields(TrainConfig)}
    given = {k: v for k, v in vars(namespace).items() if k in names}  # flags typed
    check_one_run_length(given)
    if "epochs" in given:  # the command line's length over a --config file's time budget
        values.pop("time_budget", None)
    values.update(given)
    config = TrainConfig.from_dict(values, source=namespace.config or "command line")
    # The policy and network names resolve through timm (imported here, not for --help): a typo
    # is one line now, not after the data has loaded.
    from accel_train.train.network import check_library_names
    check_library_names(config)
    return config


def build_train_parser(prog: str = "accel-train train") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, usage="%(prog)s [--config RUN.yaml] [options]",
                     description="Train an image classifier (any timm model) with "
                     "Hugging Face Accelerate, on one device or many.",
                     formatter_class=_HelpFormatter,
                     epilog="Every option is listed in both spellings (--batch-size, "
                            "--batch_size). The underscore names are\nthose of the seed manual: "
                            "the manual of the classic PyTorch distributed training script (DDP,"
                            "\nmixed "
                            "precision, gradient accumulation), whose flags --epochs --batch_size "
                            "--learning_rate\n--accumulation_steps --checkpoint --world_size "
                            "--rank --gpu_ids --dist_url keep their meaning\nhere (--checkpoint "
                            "names a folder, not a file).\n"
                            "Which value wins: defaults < the accelerate config's mixed_precision "
                            "(its bf16 only: see --mixed-precision)\n< --config RUN.yaml < "
                            "flags.\n"
                            "Many processes or machines: accelerate launch, torchrun, python -m "
                            "torch.distributed.launch, or\naccel-train launch (elastic settings); "
                            "see docs/distributed.md.")
    add_train_options(parser)
    return parser


def _run_train(argv: Sequence[str]) -> int:
    config = config_from_args(build_train_parser().parse_args(argv))
    from accel_train.run import rank_launcher
    asked = rank_launcher.ranks_asked()
    if asked is not None:  # accelerate's MULTI_CPU answers: start the ranks it did not
        return rank_launcher.start_ranks(asked)
    from accel_train.data.loading import RESTART_HINT
    from accel_train.trainer import run_training  # heavy imports only once the input is known good
    from accel_train.run.resume_options import naming_differences
    # (the loader workers' reads have the DataLoader's timeout; these are the process's own)
    with stop_on_a_stuck_read(config.loader_timeout, "--loader-timeout", "training",
                              RESTART_HINT):
        try:
            return run_training(config)
        except UsageError as err:  # a refused resume: every option that differs, at once
            raise naming_differences(err, config) from None


def _subcommands() -> dict[str, Callable[[Sequence[str]], int]]:
    from accel_train.commands import subcommands
    return {"train": _run_train, **subcommands()}


def _one_line(err: UsageError) -> str:
    """The message alone.  A UsageError raised inside a DataLoader worker comes back with the
    worker's traceback folded into its text; its last line is the message we raised."""
    text = str(err).strip()
    if "Traceback" in text:
        text = text.splitlines()[-1].split("UsageError: ", 1)[-1]
    return " ".join(text.split("\n"))


def error_prefix() -> str:
    rank = os.environ.get("RANK")
    return "accel_train: error: " if rank in (None, "0") else \
        f"accel_train: error (rank {rank}): "


RETRY_HINT = "for another try once the data can be read"  # what exit 75 is for, outside training


def add_read_timeout(parser, command: str, what: str = "one image's read") -> None:
    """--read-timeout, for the commands that read image files themselves (check-data, shard,
    predict): training's loader workers have --loader-timeout instead."""
    parser.add_argument("--read-timeout", type=float, default=600.0, metavar="SECONDS",
                        help=f"seconds {what} may take before {command} stops in one line "
                             f"naming it, exit 75 (a network mount that went away); 0 waits "
                             f"for ever (default: 600)")


def read_timeout_checked(seconds: float) -> float:
    """--read-timeout's value (check-data, shard, predict), or the one-line error."""
    if not (0 <= seconds < float("inf")):
        raise UsageError(f"--read-timeout must be seconds >= 0 (got {seconds:g}); 0 waits for "
                         f"ever")
    return seconds


def stop_on_a_stuck_read(timeout: float, flag: str, where: str, then: str = RETRY_HINT):
    """Within: this command's own reads of image files; one that takes `timeout` seconds (a
    network mount that went away) ends the process in one line naming the file, exit 75
    (loader_watch.stop_when_a_read_sticks: nothing else could end it)."""
    from accel_train.data.loader_watch import read_stuck_line, stop_when_a_read_sticks
    return stop_when_a_read_sticks(timeout, lambda what, seconds: error_prefix() +
                                   read_stuck_line(what, seconds, flag, where, then))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line."""
    set_command(sys.argv if argv is None else ["accel-train", *argv])
    argv = list(sys.argv[1:] if argv is None else argv)
    stacks_on_request()  # `kill -USR1 PID`: where a process that hangs sits
    commands = _subcommands()
    if argv and argv[0] in commands:
        name, rest = argv[0], argv[1:]
    elif argv and not argv[0].startswith("-"):  # train takes no positional argument
        print(f"accel_train: error: unknown subcommand {argv[0]!r}; choose from "
              f"{', '.join(commands)} (see --help)", file=sys.stderr)
        return 2
    else:  # `python -m accel_train --epochs 3` means train, as the seed scripts did
        name, rest = "train", argv
    if argv[:1] in (["-h"], ["--help"]) and len(commands) > 1:
        from accel_train.commands import SUMMARIES
        lines = [f"  {n:<8} {text}" for n, text in {"train": TRAIN_SUMMARY, **SUMMARIES}.items()]
        print("usage: accel-train SUBCOMMAND [options]   (no subcommand: train)\n"
              + "\n".join(lines) + "\n`accel-train SUBCOMMAND --help` for each; the train "
              "options follow.\n", file=sys.stdout)
    try:
        return commands[name](rest) or 0
    except UsageError as err:
        print(error_prefix() + _one_line(err), file=sys.stderr)
        return 2
    except RunStopped as err:  # a full disk, a stuck loader: one line, its own exit code
        print(error_prefix() + " ".join(str(err).split("\n")), file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("accel_train: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left early (`accel-train predict ... | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 141  # 128 + SIGPIPE, as `yes | head` reports it


def entry() -> None:
    """`accel-train` and `python -m accel_train`."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
