"""The end of a run that trained to its end: the final model, the plots, the last words."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from torch import nn

from accel_train.base.command import recorded_command
from accel_train.base.errors import UsageError
from accel_train.model.saved import read_our_section, write_model_folder
from accel_train.run.plots import write_plots
from accel_train.run.rundir import run_paths
from accel_train.run.track import read_metrics
from accel_train.train.divergence import stop_if_diverged
from accel_train.train.selection import describe, value_text


def save_final_model(accelerator, model: nn.Module, averages: dict[str, nn.Module], state, spec,
                     output_dir: Path, report) -> nn.Module:
    """model.safetensors + config.json in timm's folder format (model/saved.py): timm,
    transformers and our eval/predict rebuild the model from them.  With --model-ema
    (`averages["ema"]`), the better of the raw and the EMA weights on the held-out split.
    Returns the module saved (on every rank)."""
    accelerator.wait_for_everyone()
    use_ema = "ema" in averages and state.ema_is_better()
    chosen = averages["ema"] if use_ema else model
    stop_if_diverged(chosen, state.step, "model.safetensors")
    if accelerator.is_main_process:
        spec = dataclasses.replace(spec, weights="ema" if use_ema else "model")
        path = write_model_folder(chosen, output_dir, spec, command=recorded_command(),
                                  step=state.step)
        raw, ema = state.scores()
        report.say(f"saved {path}" + (f" (the EMA weights: held-out {describe(state.metric, ema)} "
                                      f"vs {value_text(state.metric, raw)})"
                                      if use_ema else ""))
    accelerator.wait_for_everyone()
    return chosen


def already_finished(output_dir: Path, step: int, has_test_split: bool) -> bool:
    """Of a run resumed at its last step, evaluated there: whether the rest of its end is
    behind it too, its final model written for that step (config.json's step, written after
    the weights) and its test split evaluated.  Then a start with the same options has
    nothing to do and writes nothing; a run killed inside its end finishes it instead."""
    try:
        if read_our_section(output_dir).get("step") != step:
            return False
        return not has_test_split or tested_at(output_dir, step)
    except UsageError:  # a damaged config.json or metrics.jsonl: the end is written again
        return False


def tested_at(output_dir: Path, step: int) -> bool:
    """Whether metrics.jsonl holds the test split's record for `step`."""
    metrics = run_paths(output_dir).metrics
    return metrics.is_file() and any(record.get("type") == "test" and record.get("step") == step
                                     for record in read_metrics(metrics, warn=lambda _: None))


def test_record(results: dict, step: int) -> dict:
    """metrics.jsonl's one `test` record: the test split's numbers for the saved weights."""
    return {"type": "test", "step": step, "loss": results["loss"], "top1": results["top1"],
            "top5": results["top5"], "images": results["count"]}


def maybe_plot(wanted: bool, is_main: bool, output_dir: Path, report) -> None:
    """PNG curves in <run>/plots (main process).  Drawing comes after the model is saved and a
    failure only warns: a finished run must not end as failed over a figure."""
    if not (wanted and is_main):
        return
    try:
        written = write_plots(output_dir)
    except Exception as err:  # matplotlib/font trouble; the traceback goes to the rank log
        report.log_exception("drawing the plots failed")
        report.warn(f"could not draw the plots ({type(err).__name__}: {err}); try again with "
                    f"accel-train plot {output_dir}")
        return
    if written:
        report.say(f"plots: {', '.join(str(path) for path in written)}")


def say_next(best: str, output_dir: Path, report, data_from_program: bool = False,
             rebuilt_by_commands: bool = True) -> None:
    """`data_from_program`: fit()'s datasets, which the run cannot find again: eval needs data
    named (it says so itself, but the hint should not send the reader there empty-handed);
    `rebuilt_by_commands` False: a network eval and predict cannot build again (the start
    warned why), so they are not offered."""
    folder = shlex.quote(str(output_dir))  # a command a reader can paste, spaces and all
    data = " --data-dir DATA" if data_from_program else ""
    if not rebuilt_by_commands:
        report.say(f"{best}; next: accel-train plot {folder} (eval, predict and export cannot "
                   f"rebuild this network: the warning at the start says why)")
        return
    report.say(f"{best}; next: accel-train eval {folder}{data}  |  accel-train predict "
               f"{folder} IMAGES...  |  accel-train plot {folder}")
