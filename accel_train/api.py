"""The Python API, for what the command line cannot express: your own `nn.Module` and your own
datasets, in the style of Keras' `fit` and Hugging Face's Trainer.

    import accel_train
    run_dir = accel_train.fit(MyNet(num_classes=10), train_set, val_set,
                              batch_size=64, epochs=10, output_dir="runs/mine")

Everything the command line has applies: the options are `TrainConfig`'s fields (`--batch-size`
is `batch_size=`), and the run folder, checkpoints, exact resume (`resume="auto"`), evaluation,
precision, SyncBatchNorm and the records are the same. The script runs as it is on one device
(`python script.py`) and on many (`accelerate launch script.py`, `torchrun script.py`): every
process runs it, and `fit` joins them as the command line does.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Union

from torch import nn

from accel_train.base.command import set_command
from accel_train.base.wording import spoken_as
from accel_train.base.errors import UsageError
from accel_train.callbacks import Callback
from accel_train.config import TrainConfig, check_one_run_length
from accel_train.data.user_data import load_user_data
from accel_train.base.main_guard import refuse_unguarded_call
from accel_train.trainer import train_and_close
from accel_train.train.network import check_library_names


def fit(model: Union[nn.Module, str], train_dataset, eval_dataset=None, *,
        callbacks: Iterable[Callback] = (), **options: Any) -> Path:
    """Train `model` on `train_dataset`, select on `eval_dataset`; returns the run folder.

    `model`: an `nn.Module` whose output has one logit per class, as a tensor or as an object
    holding them as `.logits` (a transformers classifier's output), or a name as `--model`
    takes it (a timm model, `package.module:factory`).  A module is trained in place: after
    `fit` it holds the run's last weights (the run folder's `model.safetensors` holds the
    chosen ones; with `whiten_stem` its first layer comes back whitened, `requires_grad` False
    where the run fixed it: docs/training.md).
    `train_dataset`, `eval_dataset`: map-style datasets (a torch `Dataset`, a Hugging Face
    dataset) whose items are `(image, label)` or a dict with both; an image is a PIL image, a
    uint8 or float (0-1) CHW tensor or an HWC numpy array (RGB), a label a class index (the
    dataset's `classes`, where it has them, name the indices). Without `eval_dataset`,
    `val_fraction` of the training set is held out for validation with a fixed seed.  No
    random transforms in them: the run augments the images itself (refused at the start; a
    dataset's own augmentation alone trains with augment=False and in_memory='never').
    `callbacks`: `accel_train.callbacks.Callback` instances. `options`: `TrainConfig`'s fields.

    The run records the module by its class's import name, through which `eval`, `predict` and
    `export` rebuild it: define the class in a module the script imports, not in the script
    (run as `__main__`, it cannot be imported again; fit warns). The datasets are not recorded:
    `eval` of such a run takes `--data-dir` or `--dataset`.

    Call it under `if __name__ == "__main__":` in a script: loader worker processes import
    the script again, and an unguarded call would start a training in each (refused, in one
    line, before anything starts).

    A program may call it again (a sweep), under a launcher too, where every rank must make
    the same calls in the same order: each run starts its own process group.  Accelerate keeps
    one mixed precision a process, so a sweep keeps one `mixed_precision`.

    A run stopped by a signal (SIGTERM, Ctrl-C) has saved a checkpoint; the process then ends
    with the command line's exit code (143), so a scheduler sees the same thing.  Bad input
    raises `UsageError`, whose one line names the keyword arguments to change (`resume='auto'`,
    not the command line's `--resume auto`); its warnings and start summary name them so too.
    """
    refuse_unguarded_call(inspect.currentframe().f_back)
    set_command(sys.argv)  # the program ran itself (and may have run the command line before)

    def bring_data(options: TrainConfig):
        return load_user_data(train_dataset, eval_dataset, options)

    try:
        config = config_for(model, options)
        callbacks = callback_list(callbacks)
        user_module = model if isinstance(model, nn.Module) else None
        if user_module is None:
            check_library_names(config)
        with spoken_as(in_python_terms):  # its warnings and summary in keyword arguments too
            result = train_and_close(config, callbacks, bring_data=bring_data,
                                     model=user_module)
    except UsageError as err:  # the product's messages name flags; fit()'s caller wrote keywords
        raise UsageError(in_python_terms(str(err))) from None
    if result.exit_code != 0:
        raise SystemExit(result.exit_code)
    return result.output_dir


# a flag as messages write it, and the word after it
FLAG_IN_TEXT = re.compile(r"--(no-)?([a-z][a-z0-9_-]*)(?: ('[^' ]*'|[\w./:~+-]+))?"
                          r"((?: -?\d[\d.]*(?:e-?\d+)?(?=[\s,;)]|$))*)")  # a list's numbers
# a command a message quotes for the user to run (`accel-train check-data --data-dir DIR`), up to
# the clause's or the sentence's end (a dot inside a path goes on): its flags are the command
# line's, whoever reads them
COMMAND_IN_TEXT = re.compile(r"((?:accel-train|accelerate launch|torchrun)\b"
                             r"(?:[^;,()|`.]|\.(?!\s|$))*)")   # one group: split keeps them
NUMBER = r"-?[\d.]+(e-?\d+)?"
# a word in capitals after a flag stands for the value the reader gives (PATH, N, F, DIR)
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*")
# words that are an option's value where they follow its flag (else the sentence goes on)
KEYWORD_VALUES = {"auto", "always", "never", "no", "yes", "hub", "none"}


def in_python_terms(message: str) -> str:
    """A message for fit()'s caller: each flag of a TrainConfig field as the keyword argument
    that sets it (`--resume auto` -> `resume='auto'`, `--epochs 3` -> `epochs=3`, `--no-plots`
    -> `plots=False`, a flag with no value after it -> `output_dir=`); other words stay, and
    so do the commands it quotes to run (`accel-train eval RUN --data-dir DATA`)."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}

    def is_value(word: str, name: str) -> bool:
        return bool(re.search(r"\d", word) or set(word) & set("/.:~_'")
                    or word in KEYWORD_VALUES
                    or word in (fields[name].metadata.get("choices") or ()))

    def keyword(match: re.Match) -> str:
        negated, name, word = match.group(1), match.group(2).replace("-", "_"), match.group(3)
        if name not in fields or (negated and not isinstance(fields[name].default, bool)):
            return match.group(0)
        numbers = match.group(4).split()
        if "list" in str(fields[name].type) and re.fullmatch(NUMBER, word or ""):
            return f"{name}=[{', '.join([word, *numbers])}]"  # --mean 0.485 0.456 0.406
        if numbers:  # the words after a one-value flag: the sentence's own
            return keyword(FLAG_IN_TEXT.match(match.group(0)[:match.start(4) - match.start()])) \
                + match.group(4)
        word, stop = word or "", ""
        if word[-1:] in (":", "."):  # the sentence's punctuation, not the value's
            word, stop = word[:-1], word[-1]
        after = (f" {word}" if word else "") + stop
        if isinstance(fields[name].default, bool):
            return f"{name}={not negated}" + after
        if word and is_value(word, name):
            numeric = re.fullmatch(NUMBER, word) or word.startswith("'")
            return (f"{name}={word}" if numeric else f"{name}={word!r}") + stop
        if PLACEHOLDER.fullmatch(word):  # what the reader fills in: --pretrained PATH
            return f"{name}={word}" + stop
        return f"{name}=" + after

    # prose and quoted commands alternate: only the prose is translated
    pieces = COMMAND_IN_TEXT.split(message)
    return "".join(piece if i % 2 else FLAG_IN_TEXT.sub(keyword, piece)
                   for i, piece in enumerate(pieces))


# options that choose or read the data, which fit() is handed: they would be ignored
DATA_SOURCE_OPTIONS = ("data_dir", "dataset", "image_column", "label_column", "val_labels",
                       "train_labels", "class_depth", "eval_shards", "streaming",
                       "select_on_test")


def callback_list(callbacks) -> list[Callback]:
    """callbacks= as a list of Callback instances (None or one instance taken as such)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        return [callbacks]
    items = list(callbacks) if isinstance(callbacks, (list, tuple)) else None
    wrong = next((c for c in items or [] if not isinstance(c, Callback)), None)
    if items is None or wrong is not None:
        got = callbacks if items is None else wrong
        raise UsageError(f"fit(): callbacks= takes a list of accel_train.callbacks.Callback "
                         f"instances (got {type(got).__name__}: {got!r:.60})")
    return items


def config_for(model: Union[nn.Module, str], options: dict) -> TrainConfig:
    """The run's options; a module object is recorded by its class's import name."""
    if "model" in options:
        raise UsageError("fit(): pass the model as the first argument, not as model=")
    given = [f"{key}=" for key in DATA_SOURCE_OPTIONS if options.get(key)]
    if given:
        raise UsageError(f"fit(): {', '.join(given)} choose and read data for the command "
                         f"line; fit() trains on the datasets it is handed (drop them)")
    if isinstance(model, nn.Module):
        name = f"{type(model).__module__}:{type(model).__qualname__}"
        refused = [f"{key}=" for key in ("pretrained", "smaller_models") if options.get(key)]
        if refused:
            raise UsageError(f"fit(): {', '.join(refused)} choose or load a network by name, "
                             f"which does not apply to a module you pass (load your weights "
                             f"into it first)")
    elif isinstance(model, str):
        name = model
    else:
        raise UsageError(f"fit(): model must be an nn.Module or a model name, not "
                         f"{type(model).__name__}")
    check_one_run_length(options)
    # paths as a program holds them (fit() itself returns a Path): the options take text
    options = {key: os.fspath(value) if isinstance(value, os.PathLike) else value
               for key, value in options.items()}
    return TrainConfig.from_dict({**options, "model": name}, source="fit()")
