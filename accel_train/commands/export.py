"""`accel-train export RUN_OR_CHECKPOINT --output-dir DIR [--format timm|onnx]`: a trained model
as a folder that timm, transformers and the Hugging Face Hub open as it is.

DIR gets model.safetensors and config.json in timm's own folder format (timm.create_model(
"local-dir:DIR", pretrained=True); transformers' image-classification pipeline), and README.md,
a model card with the run's recipe and its held-out top-1/top-5 with and without test-time
augmentation.  --format onnx adds model.onnx (dynamic batch dimension, torch's exporter), checked
at export against torch with ONNX Runtime on the run's held-out images, and preprocessing.json.
The folder is written beside DIR under a temporary name and renamed when complete: a failed
export leaves nothing.  `eval` and `predict` accept DIR (and predict DIR/model.onnx).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Sequence

from accel_train.cli import _Parser
from accel_train.commands import EMA_HELP
from accel_train.base.errors import UsageError

FORMATS = {"timm": "model.safetensors + config.json (timm's folder format) + README.md",
           "onnx": "the same, plus model.onnx and preprocessing.json"}
CHECK_IMAGES = 16  # held-out images the ONNX check runs
# What marks a folder as holding an export already (model_config.json: the format before).
EXPORT_FILES = ("model.safetensors", "config.json", "model.onnx", "model_config.json")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accel-train export", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="RUN_OR_CHECKPOINT",
                        help="a run directory (its final model, else its newest valid "
                             "checkpoint), a step_XXXXXXXX checkpoint folder, or an export")
    parser.add_argument("--ema", action="store_true", help=EMA_HELP)
    # --output: shard's name for its folder, and what an abbreviation of --output-dir was
    parser.add_argument("--output-dir", "--output", "-o", required=True, metavar="DIR",
                        help="a new (or empty) folder to write the export into")
    parser.add_argument("--format", choices=list(FORMATS), default="timm",
                        help="; ".join(f"{k}: {v}" for k, v in FORMATS.items())
                        + " (default: timm)")
    return parser


def check_output_dir(output_dir: Path) -> None:
    """A new or empty folder only: the finished export is renamed onto it whole."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output-dir {output_dir} is a file; pass a new folder")
    if output_dir.is_dir():
        held = sorted(p.name for p in output_dir.iterdir())
        export = [name for name in EXPORT_FILES if name in held]
        if export:
            raise UsageError(f"--output-dir {output_dir} already holds an export ({export[0]}); "
                             f"choose a new folder or remove it")
        if held:
            raise UsageError(f"--output-dir {output_dir} is not empty ({held[0]}, ...); choose "
                             f"a new or empty folder")


def write_export(trained, output_dir: Path, fmt: str, say) -> list[Path]:
    """Everything into a temporary folder beside DIR, then one rename."""
    output_dir = output_dir.absolute()
    created = [p for p in (output_dir.parent, *output_dir.parent.parents) if not p.exists()]
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = output_dir.parent / f".{output_dir.name}.exporting-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _write_into(trained, staging, output_dir.name, fmt, say)
        if output_dir.is_dir():
            output_dir.rmdir()  # empty (checked): the rename replaces it
        staging.rename(output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # the parents this export made, innermost first
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
    return sorted(output_dir.iterdir())


def _write_into(trained, folder: Path, name: str, fmt: str, say) -> None:
    from accel_train.model.model_card import CardFacts, model_card
    from accel_train.model.saved import read_our_section, write_model_folder
    from accel_train.run.track import read_metrics
    from accel_train.commands.artifacts import load_model, read_run_config
    from accel_train.commands.held_out import measure, run_held_out

    if fmt == "onnx":
        from accel_train.model.onnx_export import require_onnx
        require_onnx("--format onnx")  # before any work
    # Loading into the rebuilt model proves the weights fit the spec before anything is written.
    model = load_model(trained)
    record = read_run_config(trained.run_dir) if trained.run_dir else {}
    source_dir = trained.weights.parent
    command = record.get("command") or read_our_section(source_dir).get("command")
    write_model_folder(model, folder, trained.spec, command)
    held_out = run_held_out(trained)
    if held_out.dataset is None:
        say(f"note: no held-out accuracy in the model card: {held_out.description}")
    measure(held_out, model, trained.spec.num_classes, run_tta=trained.spec.tta)
    facts = CardFacts(trained.spec, name, trained.description, record,
                      held_out=held_out.description, metrics=held_out.metrics,
                      command=[] if record else list(command or []))
    metrics_file = trained.run_dir / "metrics.jsonl" if trained.run_dir else None
    if metrics_file is not None and metrics_file.is_file():
        facts.epochs = [r for r in read_metrics(metrics_file) if r.get("type") == "epoch"]
    if fmt == "onnx":
        facts.onnx_diff, facts.onnx_checked_on = _write_onnx(model, folder, trained.spec,
                                                             held_out, say)
    (folder / "README.md").write_text(model_card(facts))


def _write_onnx(model, folder: Path, spec, held_out, say) -> tuple[float, str]:
    """model.onnx, checked against torch; returns the largest logit difference and what the
    check ran on, in words."""
    import torch

    from accel_train.model.onnx_export import ONNX_FILE, check_onnx, export_onnx
    images = held_out.first_images(CHECK_IMAGES)
    what = f"{len(images)} held-out images" if images is not None else None
    if images is None:  # no data here: the check still runs, on seeded noise of the right shape
        images = torch.randn(CHECK_IMAGES, 3, spec.image_size, spec.image_size,
                             generator=torch.Generator().manual_seed(0))
        what = f"{CHECK_IMAGES} random inputs"
    export_onnx(model, folder / ONNX_FILE, images, spec)
    worst = check_onnx(folder / ONNX_FILE, model, images)
    why = "" if held_out.dataset is not None else f" (no held-out images: {held_out.description})"
    say(f"checked {ONNX_FILE} with ONNX Runtime on {what}{why}: logits within {worst:.1e} of "
        f"torch's")
    return worst, what


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    output_dir = Path(args.output_dir)
    check_output_dir(output_dir)
    from accel_train.commands.artifacts import find_trained_model
    trained = find_trained_model(args.model, lambda text: print(f"warning: {text}"), args.ema)
    written = write_export(trained, output_dir, args.format, print)
    # named under the folder as the user typed it, as training's "saved DIR/..." lines are
    print(f"exported {trained.description}\n"
          + "\n".join(f"  -> {output_dir / p.name}" for p in written))
    return 0
