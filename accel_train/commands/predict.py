"""`accel-train predict RUN_OR_CHECKPOINT IMAGES_OR_FOLDERS...`: the top-k classes of each image.

Images are prepared exactly as training prepared its held-out images (resized and cropped to the
model's size as its config records, timm's eval transform above 64 px, normalized with its
mean/std).  The model may also be the model.onnx of an export made
with --format onnx: ONNX Runtime runs it, with the preparation recorded in the file.  Folders
are searched recursively for image files.  Output is a table, or with --json one JSON object
per line (for scripts); --csv FILE writes a competition's submission (each image's top-1 class,
its top-k with --csv-top-k, or with --csv-probabilities every class's probability).  An image
that cannot be read is reported in its row and the others are still predicted; the exit code is
then 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from accel_train.base.columns import display_width, pad
from accel_train.cli import _Parser, add_read_timeout, read_timeout_checked, stop_on_a_stuck_read
from accel_train.commands import EMA_HELP
from accel_train.commands.csv_files import CsvOutput, check_csv_target
from accel_train.commands.predict_csv import (IMAGE_FORMS, check_csv_top_k, csv_row,
                                              header_of, image_ids,
                                              refuse_csv_options_without_csv,
                                              refuse_names_with_spaces, what_each_row_holds)
from accel_train.config import PRECISIONS
from accel_train.base.errors import UsageError

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accel-train predict", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="RUN_OR_CHECKPOINT",
                        help="a run directory, a step_XXXXXXXX checkpoint, an export folder, or "
                             "an export's model.onnx")
    parser.add_argument("inputs", nargs="+", metavar="IMAGES_OR_FOLDERS",
                        help="image files, or folders searched recursively for the image files "
                             "training takes (every extension PIL opens: .jpg, .png, .webp, "
                             ".jfif, .tif, ...)")
    parser.add_argument("--ema", action="store_true", help=EMA_HELP)
    parser.add_argument("--top-k", type=int, default=3,
                        help="classes shown per image (default: 3)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="images per forward pass (default: 64)")
    parser.add_argument("--mixed-precision", choices=PRECISIONS, default="auto",
                        help="autocast precision; auto: what the run trained and evaluated in, "
                             "on the same kind of device (with its memory format), as eval does, "
                             "else fp16 on CUDA and fp32 on a CPU; an .onnx model runs as it "
                             "was exported (default: auto)")
    add_read_timeout(parser, "predict", "one image's read (or a folder's listing)")
    parser.add_argument("--json", action="store_true",
                        help='one JSON object per line: {"image": ..., "predictions": '
                             '[{"class": ..., "index": ..., "probability": ...}, ...]}')
    parser.add_argument("--csv", metavar="FILE", default=None,
                        help="write FILE, a CSV of each image and its top-1 class (a "
                             "competition's submission; header image,class), instead of the "
                             "table (--json lines still print); written only when every image "
                             "was predicted")
    parser.add_argument("--csv-image", choices=IMAGE_FORMS, default=None,
                        help="the CSV's image column: the path inside the folder given (a file "
                             "given alone: its name), the file name, or the name without its "
                             "extension (Kaggle's ids) (default: relative)")
    parser.add_argument("--csv-header", metavar="NAMES", default=None,
                        help="the CSV's column names, comma-separated: the image's and the "
                             "class's (id,label); with --csv-probabilities the image's only "
                             "(default: image,class)")
    parser.add_argument("--csv-probabilities", action="store_true",
                        help="the CSV holds every class's probability, one column per class "
                             "named by it, in the model's class order (log-loss submissions)")
    parser.add_argument("--csv-top-k", type=int, metavar="K", default=None,
                        help="the CSV's class cell holds the K best classes' names, best first, "
                             "separated by spaces (MAP@K submissions) (default: 1)")
    return parser


def find_images(inputs: Sequence[str]) -> list[tuple[Path, Optional[Path]]]:
    """(image, the folder given it was found in, or None for a file given by itself): files as
    given (a pipe too: `<(curl -s URL)`); folders expanded (sorted, recursive) to the image
    files inside as training's walk lists them (linked folders followed, a dangling link kept
    to be named as unreadable; less `._photo.jpg`, `__MACOSX/`: imagefolder.images_under).  An
    image given twice (or inside two folders given) comes once."""
    from accel_train.data.imagefolder import images_under, refuse_unless_utf8
    from accel_train.data.loader_watch import reading

    def say(text: str) -> None:  # a large folder's progress: stdout is the table or the JSON
        print(text, file=sys.stderr)

    images: dict[Path, Optional[Path]] = {}
    for text in inputs:
        path = Path(text)
        with reading(lambda given=text: given):  # a look at a dead mount blocks as a read does
            is_folder, exists = path.is_dir(), path.exists()
        if is_folder:
            found = sorted(images_under(path, say))  # a folder predicts what it would train on
            if not found:
                raise UsageError(f"{text}: no image files in that folder (looked for every "
                                 f"extension PIL opens: .jpg, .png, .webp, .tif, ...)")
            for image in found:
                images.setdefault(image, path)
        elif exists:
            if not text.isascii():  # as a folder's images are (the CSV could not name it)
                refuse_unless_utf8(text, text)
            images.setdefault(path, None)
        else:
            raise UsageError(f"{text}: no such image file or folder")
    return list(images.items())


def predict(model, spec, images: list[Path], top_k: int, batch_size: int, device,
            autocast=contextlib.nullcontext, channels_last: bool = False):
    """Yields (image path, [(class index, probability), ...] best first, None), or for an image
    that cannot be decoded (path, None, why): one bad file among thousands must not cost the
    predictions for the rest.  `autocast` and `channels_last`: as the run evaluated (eval's
    numbers and these probabilities then come from the same arithmetic)."""
    import torch

    from accel_train.data.decode import Unreadable, decode, read_value
    from accel_train.train.evaluate import logits_of
    from accel_train.data.transforms import held_out_transform
    transform = held_out_transform(spec)
    k = min(top_k, spec.num_classes)
    for start in range(0, len(images), batch_size):
        paths, tensors, reasons = images[start:start + batch_size], [], {}
        for path in paths:
            try:
                tensors.append(transform(decode(read_value(str(path)))))
            except Unreadable as err:
                reasons[path] = err.reason
        ranked = iter(())
        if tensors:
            batch = torch.stack(tensors).to(device)
            if channels_last:
                batch = batch.contiguous(memory_format=torch.channels_last)
            with torch.no_grad(), autocast():
                logits = logits_of(model, batch, spec.tta)  # float32 (logits_of)
            best = logits.softmax(dim=1).topk(k, dim=1)
            ranked = iter(zip(best.indices.tolist(), best.values.tolist()))
        for path in paths:  # in the order given, an unreadable image in its place
            if path in reasons:
                yield path, None, reasons[path]
            else:
                indices, values = next(ranked)
                yield path, list(zip(indices, values)), None


def _table_header(k: int, path_width: int, name_width: int) -> str:
    cells = "  ".join(pad(f"top-{rank + 1}", name_width + 7) for rank in range(k))
    return f"{pad('image', path_width)}  {cells}".rstrip()


def _table_row(path: Path, ranked, names: list[str], path_width: int, name_width: int) -> str:
    cells = "  ".join(f"{pad(names[i], name_width)} {p:6.1%}" for i, p in ranked)
    return f"{pad(str(path), path_width)}  {cells}"


def _load(model_text: str, asked: str, ema: bool, torch):
    """(model, spec, description, device, autocast, channels_last, precision name): an ONNX file
    through ONNX Runtime on the CPU, as exported; else the torch model of a run, checkpoint or
    export on CUDA when there is one, in --mixed-precision (auto: as the run ran, eval's rule)."""
    if model_text.endswith(".onnx") and Path(model_text).is_file():
        if asked != "auto":
            raise UsageError(f"--mixed-precision {asked}: an .onnx model runs in the precision "
                             f"it was exported in (ONNX Runtime); drop the flag")
        if ema:
            raise UsageError("--ema: an .onnx model holds the weights it was exported with; "
                             "export the checkpoint with --ema --format onnx, or drop the flag")
        from accel_train.model.onnx_export import OnnxClassifier
        onnx_model = OnnxClassifier(Path(model_text))
        return onnx_model, onnx_model.spec, f"ONNX file {model_text} (ONNX Runtime)", \
            torch.device("cpu"), contextlib.nullcontext, False, "as exported"
    from accelerate import Accelerator

    from accel_train.train.precision import precision_name, resolve_precision
    from accel_train.commands.artifacts import (as_the_run_ran, find_trained_model, load_model,
                                                read_run_config)
    trained = find_trained_model(model_text, lambda text: print(f"warning: {text}"), ema)
    cuda = torch.cuda.is_available()
    record = read_run_config(trained.run_dir) if trained.run_dir else {}
    asked, channels_last = as_the_run_ran(asked, record.get("resolved", {}), cuda)
    precision, warning = resolve_precision(asked, cuda, "predicts")
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    accelerator = Accelerator(cpu=not cuda, mixed_precision=precision)  # eval's autocast
    model = load_model(trained).to(accelerator.device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    name = precision_name(precision) + (", channels_last" if channels_last else "")
    return model, trained.spec, trained.description, accelerator.device, \
        accelerator.autocast, channels_last, name


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    for flag, value in (("--top-k", args.top_k), ("--batch-size", args.batch_size)):
        if value < 1:
            raise UsageError(f"{flag} must be a whole number >= 1 (got {value})")
    read_timeout_checked(args.read_timeout)
    refuse_csv_options_without_csv(args)
    if args.csv is not None:  # before any work: the file's folder, the header's names
        check_csv_target(Path(args.csv))
        header_of(args.csv_header, args.csv_probabilities, [])
        check_csv_top_k(args.csv_top_k, args.csv_probabilities)
    # this process's own reads: the paths given, the folders listed, each image
    with stop_on_a_stuck_read(args.read_timeout, "--read-timeout", "predicting"):
        return _predict_all(args)


def _predict_all(args) -> int:
    from accel_train.data.loader_watch import undone_on_a_stop
    found = find_images(args.inputs)
    ids = image_ids(found, args.csv_image or "relative") if args.csv is not None else None
    images = [image for image, _ in found]
    import torch

    model, spec, description, device, autocast, channels_last, ran_in = \
        _load(args.model, args.mixed_precision, args.ema, torch)
    names = spec.class_names
    if args.top_k > len(names):
        # Shown, not refused: --csv-top-k above the count names every class too, and timm's
        # inference script clamps its --topk to the class count (top_k = min(args.topk,
        # args.num_classes)), silently; a table three classes long says why it is not ten.
        print(f"note: --top-k {args.top_k} is more than the model's {len(names)} classes: "
              f"showing all {len(names)}", file=sys.stderr)
    csv_top_k = args.csv_top_k or 1
    if ids is not None:
        refuse_names_with_spaces(csv_top_k, names)
    path_width = max(display_width(str(p)) for p in images)
    name_width = max(display_width(name) for name in names)
    table = not args.json and args.csv is None
    if not args.json:
        print(f"model: {spec.model_name} from {description}; {len(images)} image(s) on "
              f"{device.type} in {ran_in}")
    if table:
        print(f"\n{_table_header(min(args.top_k, len(names)), path_width, name_width)}")
    # every class ranked for a CSV of probabilities; else as many as the table or CSV shows
    top_k = len(names) if args.csv_probabilities else max(args.top_k, csv_top_k)
    with contextlib.ExitStack() as stack:
        csv_out = None if ids is None else stack.enter_context(CsvOutput(
            Path(args.csv), header_of(args.csv_header, args.csv_probabilities, names)))
        if csv_out is not None:  # a stuck read's stop skips the `with`'s own removal
            stack.enter_context(undone_on_a_stop(csv_out.discard))
        failures: list[str] = []
        for position, (path, ranked, reason) in enumerate(predict(
                model, spec, images, top_k, args.batch_size, device, autocast, channels_last)):
            if reason is not None:
                failures.append(f"{path} cannot be decoded ({reason})")
                print(json.dumps({"image": str(path), "error": failures[-1]}) if args.json
                      else f"{pad(str(path), path_width if table else 0)}  (not predicted: "
                           f"{reason})")
                continue
            if csv_out is not None:
                csv_out.write(csv_row(ids[position], ranked, names, args.csv_probabilities,
                                      csv_top_k))
            shown = ranked[:args.top_k]
            if args.json:
                print(json.dumps({"image": str(path), "predictions": [
                    {"class": names[i], "index": i, "probability": round(p, 6)}
                    for i, p in shown]}))
            elif table:
                print(_table_row(path, shown, names, path_width, name_width))
        # the others were predicted; the exit code still tells scripts that some were not
        if failures:
            unwritten = (f"; {args.csv} was not written (a submission needs every image): "
                         f"fix or remove the image" if csv_out is not None else "")
            raise UsageError(f"{len(failures)} of {len(images)} image(s) could not be read, "
                             f"first: {failures[0]}{unwritten}")
        if csv_out is not None:
            csv_out.commit()
            if not args.json:
                holds = what_each_row_holds(args.csv_probabilities, len(names), csv_top_k)
                print(f"wrote {args.csv}: {csv_out.rows} image(s), {holds} each")
    return 0

