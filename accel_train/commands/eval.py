"""`accel-train eval RUN_OR_CHECKPOINT`: loss, top-1, top-5 and per-class accuracy.

By default on the run's own held-out data, rebuilt from its config.yaml exactly as training built
it (same split, same sample limit), so the numbers match the run's last epoch line.  With
--data-dir/--dataset, on any other labelled data whose class names the model knows.  Launched on
N processes (torchrun, accelerate launch) it splits the data and counts each image once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

from accel_train.cli import RETRY_HINT, _Parser, stop_on_a_stuck_read
from accel_train.commands import EMA_HELP
from accel_train.commands.mistakes import image_namer, mistake_rows, write_mistakes
from accel_train.commands.csv_files import check_csv_target
from accel_train.commands.recorded_data import data_hint
from accel_train.config import PRECISIONS, SAMPLE_SUBSETS, TTA_MODES, TrainConfig
from accel_train.base.errors import UsageError, first_few

SPLITS = {"held-out": "the validation images", "test": "the test split (kept for the end)",
          "train": "the training images",
          "all": "all images (training and validation together)"}
# The options that say which data a run used; nothing else of the run matters to eval.
DATA_OPTIONS = ("dataset", "data_dir", "image_column", "label_column", "val_fraction",
                "val_stratify", "max_train_samples", "max_eval_samples", "sample_subset",
                "synthetic_train_size", "val_labels", "train_labels",
                "select_on_test",
                "class_depth", "streaming", "eval_shards")
# kept for other data (--data-dir) too
SPLIT_OPTIONS = ("val_fraction", "val_stratify", "select_on_test")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accel-train eval", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="RUN_OR_CHECKPOINT",
                        help="a run directory, a step_XXXXXXXX checkpoint, an export folder, or "
                             "an export's model.onnx (ONNX Runtime, with --data-dir or "
                             "--dataset)")
    parser.add_argument("--ema", action="store_true", help=EMA_HELP)
    data = parser.add_argument_group("data (default: the run's own held-out data)")
    data.add_argument("--data-dir", help="local data, as for training (parquet, save_to_disk, "
                      "image folder)")
    data.add_argument("--dataset", help="Hugging Face hub dataset id, or 'synthetic'")
    data.add_argument("--image-column", help="image column (default: found by name/type)")
    data.add_argument("--label-column", help="label column (default: found by name/type)")
    data.add_argument("--val-labels", metavar="FILE", help="with --data-dir: the label file of "
                      "an ImageNet-style val/ folder of unlabelled images, as for training")
    data.add_argument("--train-labels", metavar="FILE", help="with --data-dir: the label file "
                      "of a folder of training images not sorted into class folders, as for "
                      "training")
    data.add_argument("--class-depth", type=int, metavar="N", help="with --data-dir: the "
                      "folder level that names the class, as for training")
    data.add_argument("--split", choices=list(SPLITS), default="held-out",
                      help="held-out: the validation split the run selected on (the data's "
                           "own, or the fraction training carved off); test: the test split, "
                           "where the data has one beside a validation split or a carved one; "
                           "train; all: train and validation (e.g. a folder of labelled images "
                           "with no splits) (default: held-out)")
    # training's name for the same limit, which users carry over from the run's command
    data.add_argument("--max-samples", "--max-eval-samples", type=_positive_or_all,
                      metavar="N|all", dest="max_samples",
                      help="evaluate N of the images, chosen by --sample-subset (default: "
                           "those the run evaluated on its own data; all of other data)")
    data.add_argument("--sample-subset", choices=SAMPLE_SUBSETS,
                      help="which images --max-samples keeps: random (the ones "
                           "split.shuffle(seed=0).select(range(N)) keeps in Hugging Face "
                           "datasets) or the first N (default: the run's --sample-subset on "
                           "its own data, else random)")
    run = parser.add_argument_group("running")
    run.add_argument("--batch-size", type=int, help="per process (default: the run's)")
    run.add_argument("--num-workers", type=int, help="data loader workers per process "
                     "(default: as training chooses)")
    run.add_argument("--loader-timeout", type=float, metavar="SECONDS",
                     help="seconds to wait for a batch from the loader workers, or for one "
                          "image file eval reads itself (--num-workers 0), before stopping in "
                          "one line, exit 75 (a read stuck on a dead mount); 0 waits forever "
                          "(default: the run's --loader-timeout)")
    run.add_argument("--mixed-precision", choices=PRECISIONS, default="auto",
                     help="autocast precision; auto: what the run trained and evaluated in, on "
                          "the same kind of device (with its memory format), else fp16 on CUDA "
                          "and fp32 on a CPU; an explicit fp16 needs CUDA (default: auto)")
    run.add_argument("--tta", choices=TTA_MODES, help="test-time augmentation: 'flip' averages "
                     "the logits of each image and its mirror image (default: the run's --tta)")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object instead of the table")
    run.add_argument("--mistakes", metavar="FILE", default=None,
                     help="also write FILE, a CSV of each image the model got wrong (image, "
                          "class, predicted, probability, class_probability), the least likely "
                          "under its own label first: where mislabelled images gather")
    return parser


def _positive_or_all(text: str):
    if text == "all":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or 'all', got {text!r}")
    return int(text)


def onnx_classifier(args):
    """An export's model.onnx given as the model: ONNX Runtime runs it as exported (its
    preprocessing recorded in the file), on data given here; None for anything else."""
    if not (args.model.endswith(".onnx") and Path(args.model).is_file()):
        return None
    for flag, given in (("--mixed-precision", args.mixed_precision != "auto"),
                        ("--ema", args.ema)):
        if given:
            raise UsageError(f"{flag}: an .onnx model runs as it was exported (its weights, its "
                             f"precision); drop {flag}")
    if args.data_dir is None and args.dataset is None:
        hint = data_hint(Path(args.model).parent)  # an export's folder records the command
        raise UsageError(f"{args.model} is a model alone, without the run that says what it was "
                         f"trained on; {hint or 'pass --data-dir PATH or --dataset NAME'}")
    from accel_train.model.onnx_export import OnnxClassifier
    return OnnxClassifier(Path(args.model))


def data_config(trained, args) -> TrainConfig:
    """The run's data options (or the given data's), as a TrainConfig for `load_data`."""
    from accel_train.commands.artifacts import read_run_config
    run_config = read_run_config(trained.run_dir) if trained.run_dir else {}
    recorded = run_config.get("train")
    other_data = args.data_dir is not None or args.dataset is not None
    if not other_data and not isinstance(recorded, dict):
        # an export's config.json names the data in the training command, as it was typed
        hint = data_hint(trained.weights.parent) if trained.run_dir is None else None
        raise UsageError(f"{trained.description} has no run config.yaml saying what it was "
                         f"trained on; {hint or 'pass --data-dir PATH or --dataset NAME'}")
    resolved = run_config.get("resolved")
    if not other_data and isinstance(resolved, dict) and resolved.get("data_from_program"):
        raise UsageError(f"{trained.description} was trained on datasets a program handed to "
                         f"fit() ({resolved.get('data', 'not recorded')}), which no command can "
                         f"load again; pass --data-dir PATH or --dataset NAME")
    values = {k: recorded[k] for k in DATA_OPTIONS if k in recorded} \
        if isinstance(recorded, dict) else {}
    if other_data:
        # other data, split as the run split its own: the same carve (--val-fraction) and the
        # same role for a test split (--select-on-test); where the data lives and what it is
        # are the new data's
        values = {k: v for k, v in values.items() if k in SPLIT_OPTIONS}
    if values.get("data_dir") and not Path(values["data_dir"]).exists():
        # config.yaml records the path as typed: relative to wherever training was started
        raise UsageError(f"the run was trained on --data-dir {values['data_dir']}, which is not "
                         f"there from this folder; pass --data-dir PATH to that data")
    from accel_train.data.sources import IMAGE_FOLDER_OPTIONS, labelled_by_a_column
    if not other_data and values.get("data_dir") and \
            any(values.get(name) is not None for name in IMAGE_FOLDER_OPTIONS) and \
            labelled_by_a_column(values["data_dir"]):
        # recorded by a run from before these options were refused on such data, which it
        # trained on its label column, the option unread: read as it trained
        values.update({name: None for name in IMAGE_FOLDER_OPTIONS})
    if other_data:
        values.update(dataset=args.dataset or "synthetic", data_dir=args.data_dir)
    elif (args.val_labels, args.train_labels, args.class_depth) != (None, None, None):
        raise UsageError("--val-labels, --train-labels and --class-depth describe the data of "
                         "--data-dir; the run's own data is read as it trained on it")
    for name in ("image_column", "label_column", "val_labels", "train_labels", "class_depth"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if not other_data and isinstance(recorded, dict) and "sample_subset" not in recorded:
        values["sample_subset"] = "first"  # the rule of runs from before --sample-subset
    if args.max_samples is not None:  # a limit given here replaces the run's
        values.update(max_train_samples=None, max_eval_samples=None)
    if args.sample_subset is not None:
        if args.max_samples is None:  # the run's own limits keep the images by its own rule
            raise UsageError("--sample-subset chooses which images --max-samples keeps; give "
                             "--max-samples N too (without it, eval rebuilds the run's own "
                             "held-out images by the run's own rule)")
        values["sample_subset"] = args.sample_subset
    if args.loader_timeout is not None:  # else the run's own (a dead mount stops both alike)
        values["loader_timeout"] = args.loader_timeout
    elif isinstance(recorded, dict) and "loader_timeout" in recorded:
        values["loader_timeout"] = recorded["loader_timeout"]
    # Decode on demand: eval reads each image once, and need not decode the train split.
    return TrainConfig.from_dict({**values, "in_memory": "never"}, source="eval")


def data_changed_since_run(data, run_record: dict, args) -> Optional[str]:
    """A warning when the run's own data now gives other split sizes than the run recorded: the
    folder changed, and the validation split rebuilt now is not the one the run held out (a
    carved one is carved from other images, and may hold images the run trained on)."""
    resolved = run_record.get("resolved") or {}
    if args.data_dir is not None or args.dataset is not None or args.max_samples is not None:
        return None  # other data, or another limit: nothing to compare with
    then = (resolved.get("train_samples"), resolved.get("eval_samples"))
    now = (len(data.train), len(data.held_out))
    if not all(isinstance(count, int) for count in then) or then == now:
        return None
    return (f"{data.description} now gives {now[0]} training and {now[1]} validation images, "
            f"where the run had {then[0]} and {then[1]}: the data changed since, and the "
            f"validation split evaluated now is not the one the run held out (a carved one may "
            f"hold images it trained on); evaluate new images with --data-dir PATH of a folder "
            f"of their own")


def align_labels(source, data_names: list[str], model_names: list[str], origin: str) -> None:
    """Re-number the data's labels to the model's class indices, by class name: another data
    set (an image folder sorts its class names) may list the same classes in another order."""
    if list(data_names) == list(model_names):
        return
    import unicodedata

    import torch

    def same(name: str) -> str:
        # macOS writes folder names decomposed (NFD): "é" as "e" and a combining accent
        return unicodedata.normalize("NFC", name)

    index = {same(name): i for i, name in enumerate(model_names)}
    # names the data declares but no image of this split has (a ClassLabel's spare names) do
    # not stand in the way; they map to nothing
    present = set(torch.unique(source.labels).tolist()) if len(source.labels) else set()
    unknown = [name for i, name in enumerate(data_names)
               if same(name) not in index and i in present]
    if unknown:
        raise UsageError(f"{origin}: class(es) {first_few(unknown)} are not among the "
                         f"model's {len(model_names)} classes ({first_few(model_names, 10)}); "
                         f"evaluate on data labelled with the model's class names")
    source.labels = torch.tensor([index.get(same(name), -1) for name in data_names]
                                 )[source.labels]


def _dataset_for_split(data, split: str, transform, max_samples, sample_subset: str,
                       keyed: bool = False):
    """The images of `split` as one dataset, and the image_namer of its samples' keys (with
    `keyed`: each sample carries its key, a position in the parts before any --max-samples
    limit) or None."""
    from torch.utils.data import ConcatDataset, Subset

    from accel_train.data.loaders import HeldOutImages
    from accel_train.data.sample_limits import kept_positions
    parts = {"held-out": [data.held_out], "train": [data.train], "all": [data.train, data.held_out],
             "test": [data.test] if data.test is not None else []}
    if not parts[split]:
        if "the test split used for selection" in data.description:  # --select-on-test
            raise UsageError(f"--split test: the run selected on its test split, so that split "
                             f"is its held-out split here ({data.description}); pass --split "
                             f"held-out")
        raise UsageError(f"--split {split}: {data.description} has no test split; choose "
                         f"held-out, train or all")
    # marked: evaluate_classifier leaves out what could not be decoded (a substitute's image)
    first_keys = [sum(len(source) for source in parts[split][:k])
                  for k in range(len(parts[split]))]
    datasets = [HeldOutImages(source, transform, mark_replaced=True,
                              first_key=first if keyed else None)
                for source, first in zip(parts[split], first_keys)]
    dataset = datasets[0] if len(datasets) == 1 else ConcatDataset(datasets)
    kept = kept_positions(len(dataset), max_samples if isinstance(max_samples, int) else None,
                          sample_subset)
    if kept is not None:
        dataset = Subset(dataset, kept.tolist())
    if len(dataset) == 0:
        raise UsageError(f"the {split} split of {data.description} is empty; choose another "
                         f"--split")
    split_names = ["train", "held-out"] if split == "all" else [split]
    return dataset, image_namer(parts[split], first_keys, split_names) if keyed else None


def _report(results: dict, trained, data, split: str, num_processes: int, device,
            as_json: bool, tta: str, ran_in: str) -> str:
    from accel_train.train.evaluate import format_results
    names = trained.spec.class_names
    if as_json:
        per_class = results["per_class"]
        return json.dumps({
            "model": trained.description, "weights": str(trained.weights),
            "data": data.description, "split": split, "processes": num_processes, "tta": tta,
            "precision": ran_in,
            **{k: results[k] for k in ("loss", "top1", "top5", "mean_class_top1", "count",
                                       "left_out")},
            "per_class": {name: {"correct": c, "images": t, "top1": c / t if t else None,
                                 "predicted": p, "precision": c / p if p else None,
                                 "mistaken_for": {"class": names[m[0]], "images": m[1]}
                                 if m else None}
                          for name, c, t, p, m in zip(names, per_class["correct"],
                                                      per_class["total"],
                                                      per_class["predicted"],
                                                      per_class["mistaken_for"])}})
    return (f"model: {trained.spec.model_name} ({len(names)} classes) from {trained.description}\n"
            f"data:  {data.description}; evaluated on {SPLITS[split]}\n"
            f"       by {num_processes} process(es) on {device} in {ran_in}"
            f"{'; test-time augmentation: ' + tta if tta != 'none' else ''}\n\n"
            + format_results(results, names))


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from accelerate import Accelerator

    from accel_train.run import distributed
    from accel_train.data.loaders import default_num_workers, make_loader
    from accel_train.data.loading import stop_when_stuck
    from accel_train.train.evaluate import evaluate_classifier
    from accel_train.data.sources import load_data
    from accel_train.data.streaming import load_streaming, streaming_wanted
    from accel_train.base.ranks import main_first, print_once, process_cores
    from accel_train.train.precision import precision_name, resolve_precision
    from accel_train.data.transforms import held_out_transform
    from accel_train.commands.artifacts import (TrainedModel, as_the_run_ran,
                                                find_trained_model, load_model, read_run_config)

    if args.mistakes is not None:  # before any work: the file's folder
        check_csv_target(Path(args.mistakes), "--mistakes", "mistakes.csv")
    launcher = distributed.LauncherEnv.from_environ()
    say = print if launcher.rank == 0 else (lambda text: None)
    onnx_model = onnx_classifier(args)
    trained = find_trained_model(args.model, lambda text: say(f"warning: {text}"), args.ema) \
        if onnx_model is None else TrainedModel(onnx_model.spec, Path(args.model), None,
                                                f"ONNX file {args.model} (ONNX Runtime)")
    config = data_config(trained, args)
    run_record = read_run_config(trained.run_dir) if trained.run_dir else {}
    recorded = run_record.get("train", {})
    batch_size = args.batch_size or recorded.get("batch_size") or 64
    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1 (got {batch_size})")
    env = distributed.setup(TrainConfig())  # starts the process group when launched
    try:
        # the reads made here (--num-workers 0); the workers' have the loader's timeout
        with stop_on_a_stuck_read(config.loader_timeout, "--loader-timeout",
                                  f"evaluating the {args.split} split"):
            cuda = torch.cuda.is_available()
            asked, channels_last = as_the_run_ran(args.mixed_precision,
                                                  run_record.get("resolved", {}), cuda)
            if onnx_model is not None:  # runs as exported, on the CPU (ONNX Runtime)
                asked, channels_last, cuda = "no", False, False
            precision, warning = resolve_precision(asked, cuda, "evaluates")
            acc = Accelerator(cpu=not cuda, mixed_precision=precision)
            if warning:
                print_once(f"warning: {warning}")
            streamed = streaming_wanted(config)
            if streamed and args.split != "held-out":
                raise UsageError(f"--split {args.split}: a streamed run's training shards are read "
                                 f"by the trainer's loader only; evaluate its held-out split, or "
                                 f"pass --data-dir of a folder")
            # one class is data to evaluate a classifier on, if not to train one
            # --split all of other data: every image, no carve to make (a class of one image
            # could not give one)
            every_image = args.split == "all" and (args.data_dir or args.dataset) is not None
            data = main_first(lambda: load_streaming(config) if streamed else
                              load_data(config, min_classes=1, to_train=False,
                                        every_image=every_image))
            changed = None if streamed else data_changed_since_run(data, run_record, args)
            if changed:
                print_once(f"warning: {changed}")
            sources = (data.train, data.held_out, *([data.test] if data.test is not None else []))
            for source in sources if not streamed else (data.held_out,):
                align_labels(source, data.class_names, trained.spec.class_names, data.description)
            spec = trained.spec
            transform = held_out_transform(spec)
            dataset, image_name = _dataset_for_split(data, args.split, transform,
                                                     args.max_samples, config.sample_subset,
                                                     keyed=args.mistakes is not None)
            cuda = acc.device.type == "cuda"
            workers = args.num_workers if args.num_workers is not None else \
                default_num_workers(data.held_out, process_cores(env.local_world_size), cuda)
            loader = acc.prepare(make_loader(dataset, batch_size, workers, 2, False, cuda,
                                             timeout=config.loader_timeout))
            # not DDP-wrapped: inference only
            model = load_model(trained).to(acc.device) if onnx_model is None else onnx_model
            tta = args.tta or spec.tta
            if channels_last:
                model = model.to(memory_format=torch.channels_last)
            batches = stop_when_stuck(loader, config.loader_timeout,
                                      f"evaluating the {args.split} split", then=RETRY_HINT)
            results = evaluate_classifier(acc, model, batches, spec.num_classes,
                                          channels_last=channels_last, tta=tta,
                                          keep_samples=args.mistakes is not None)
            ran_in = precision_name(precision) + (", channels_last" if channels_last else "")
            if onnx_model is not None:
                ran_in = "the precision it was exported in"
            print_once(_report(results, trained, data, args.split, acc.num_processes, acc.device,
                               args.json, tta, ran_in))
            if args.mistakes is not None and acc.is_main_process:
                rows = mistake_rows(results["samples"], spec.class_names, image_name)
                write_mistakes(Path(args.mistakes), rows)
                if not args.json:
                    print(f"\nwrote {args.mistakes}: {len(rows)} wrong image(s) of "
                          f"{results['count']}, the least likely under their own label first")
    finally:
        distributed.teardown()
    return 0
