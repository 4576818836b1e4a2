"""Classification metrics over a whole data set, each sample counted once, on one process or many.

The trainer (at each epoch end, through `HeldOutEvaluator`) and `accel-train eval` both call
`evaluate_classifier`, so the numbers a run logs and the numbers `eval` prints on the same data
and weights are the same numbers.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from accel_train.base.columns import display_width, pad
from accel_train.data.held_out_kept import KeptHeldOut
from accel_train.data.loaders import collate_batch, end_workers
from accel_train.data.loading import stop_when_stuck
from accel_train.train.budget import TTA_PASSES
from accel_train.train.selection import value_text


def logits_of(model: nn.Module, images: torch.Tensor, tta: str = "none") -> torch.Tensor:
    """The model's logits, with --tta: 'flip' averages them with those of the mirrored images
    (logits, not probabilities, as in airbench; a horizontal flip is in the training
    augmentation, so the model has learned both views); 'flip-translate' averages that with
    the mean of the same for the images shifted one pixel up-left and one down-right
    (reflect-padded, airbench's level 2: the training crops shift images too)."""
    if tta == "flip-translate":
        padded = F.pad(images, (1, 1, 1, 1), mode="reflect")
        height, width = images.shape[-2:]
        shifted = [padded[..., :height, :width], padded[..., 2:, 2:]]
        return (logits_of(model, images, "flip") / 2 +
                sum(logits_of(model, view, "flip") for view in shifted) / 4)
    logits = model(images).float()
    if tta == "flip":
        logits = (logits + model(images.flip(3)).float()) / 2
    return logits


def evaluate_classifier(accelerator, model: nn.Module, loader, num_classes: int,
                        channels_last: bool, tta: str, keep_samples: bool = False) -> dict:
    """Loss, top-1, top-5, per-class accuracy and its mean over the classes (mean_class_top1),
    and per class the images predicted as it and the class its wrong images went to most.
    With `keep_samples` (a loader whose batches carry each sample's key after its label:
    HeldOutImages' first_key), also "samples": each evaluated image's key, label, predicted
    class and the probabilities of the two.

    `model` must be the bare module (not DDP-wrapped): DDP broadcasts buffers at every forward,
    a collective that would hang if ranks see different numbers of batches.  Per-sample values
    go through gather_for_metrics, which drops the samples the distributed sampler repeated to
    even out the last batch (reducing to a scalar first would defeat that).
    """
    was_training = model.training
    model.eval()
    names = ("loss", "top1", "top5", "labels", "predicted", "kept") + \
        (("keys", "probability", "label_probability") if keep_samples else ())
    parts: dict[str, list] = {name: [] for name in names}
    for images, labels, *rest in loader:
        keys, marks = (rest[0], rest[1:]) if keep_samples else (None, rest)
        # a batch's last tensor, where the loader marks them: the images that could not be
        # decoded (>= 0), whose places a substitute image took.  Left out of the numbers: a
        # substitute is another class's image, or one counted twice.
        kept = marks[0] < 0 if marks else torch.ones_like(labels, dtype=torch.bool)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        # no_grad as a block (not a decorator: mutmut leaves decorated functions alone)
        with torch.no_grad(), accelerator.autocast():
            logits = logits_of(model, images, tta)
        topk = logits.topk(min(5, logits.shape[1]), dim=1).indices
        values = (F.cross_entropy(logits, labels, reduction="none"), topk[:, 0] == labels,
                  (topk == labels[:, None]).any(dim=1), labels, topk[:, 0],
                  kept.to(labels.device))
        if keep_samples:
            probabilities = logits.softmax(dim=1)
            values += (keys.to(labels.device), probabilities.gather(1, topk[:, :1])[:, 0],
                       probabilities.gather(1, labels[:, None])[:, 0])
        for key, value in zip(parts, accelerator.gather_for_metrics(values)):
            parts[key].append(value.cpu())
    model.train(was_training)
    kept = torch.cat(parts.pop("kept"))
    merged = {k: torch.cat(v)[kept] for k, v in parts.items()}
    per_class_total = torch.bincount(merged["labels"], minlength=num_classes)
    per_class_correct = torch.bincount(merged["labels"][merged["top1"]], minlength=num_classes)
    results = {
        "loss": float(merged["loss"].mean()), "top1": float(merged["top1"].float().mean()),
        "top5": float(merged["top5"].float().mean()), "count": len(merged["labels"]),
        "left_out": int((~kept).sum()),
        "mean_class_top1": mean_class_top1(per_class_correct.tolist(),
                                           per_class_total.tolist()),
        "per_class": {"correct": per_class_correct.tolist(),
                      "total": per_class_total.tolist(),
                      "predicted": torch.bincount(merged["predicted"],
                                                  minlength=num_classes).tolist(),
                      "mistaken_for": most_mistaken_for(merged["labels"], merged["predicted"],
                                                        num_classes)}}
    if keep_samples:
        results["samples"] = {k: merged[k] for k in ("keys", "labels", "predicted",
                                                      "probability", "label_probability")}
    return results


def most_mistaken_for(labels: torch.Tensor, predicted: torch.Tensor,
                      num_classes: int) -> list[Optional[tuple[int, int]]]:
    """For each class, (the class its wrong images were predicted as most often, how many), or
    None where none was wrong; a tie goes to the lower class index.  From the pairs that occur
    (not a classes x classes matrix: 10,000 classes would be 800 MB)."""
    wrong = labels != predicted
    pairs, counts = torch.unique(labels[wrong] * num_classes + predicted[wrong],
                                 return_counts=True)
    mistaken: list[Optional[tuple[int, int]]] = [None] * num_classes
    for pair, count in zip(pairs.tolist(), counts.tolist()):  # ascending: lower index first
        truth, guess = divmod(pair, num_classes)
        if mistaken[truth] is None or count > mistaken[truth][1]:
            mistaken[truth] = (guess, count)
    return mistaken


def mean_class_top1(correct: list[int], total: list[int]) -> float:
    """Top-1 of each class with held-out images, averaged over those classes (scikit-learn's
    balanced accuracy): where one class is most of the images, top-1 can be high while a rare
    class is never right; this is not."""
    shares = [right / images for right, images in zip(correct, total) if images]
    return sum(shares) / len(shares) if shares else 0.0


def batch_seconds(accelerator, model: nn.Module, dataset, batch_size: int,
                  channels_last: bool, tta: str, repeats: int = 2,
                  finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                  ) -> tuple[float, int]:
    """(seconds, images): the time one held-out batch takes through the evaluation's path (its
    first `batch_size` images read and prepared as the loader's fetch does, moved to the device,
    there normalized by `finish` where the loader hands uint8 pixels, the model's logits with
    `tta` under the run's autocast, the loss and top-k), the fastest of `repeats` (the first
    pays for new kernels; the held-out set's batches run warm).  Every module's train/eval flag
    is left as it was (a frozen backbone's BatchNorm stays in eval mode), and nothing is drawn
    from any random generator."""

    indices = list(range(min(batch_size, len(dataset))))
    fetch = getattr(dataset, "__getitems__", None)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    best = float("inf")
    try:
        for _ in range(repeats):
            began = time.perf_counter()
            samples = fetch(indices) if fetch else [dataset[i] for i in indices]
            images, labels = (t.to(accelerator.device) for t in collate_batch(samples)[:2])
            if finish is not None:
                images = finish(images)
            if channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with torch.no_grad(), accelerator.autocast():
                logits = logits_of(model, images, tta)
                F.cross_entropy(logits, labels, reduction="none").sum().item()  # a sync
                logits.topk(min(5, logits.shape[1]), dim=1)
            best = min(best, time.perf_counter() - began)
    finally:
        for module, training in modes:
            module.training = training
    return best, len(indices)


def format_results(results: dict, class_names: list[str]) -> str:
    """The summary line and a per-class accuracy table, for a terminal."""
    left_out = results.get("left_out", 0)
    lines = [f"loss {results['loss']:.4f}  top-1 {results['top1']:.2%}  top-5 "
             f"{results['top5']:.2%}  mean per-class top-1 {results['mean_class_top1']:.2%}  "
             f"({results['count']} images"
             + (f"; {left_out} that could not be decoded left out" if left_out else "") + ")",
             ""]
    width = max([len("class"), *(display_width(name) for name in class_names)])
    lines.append(f"{pad('class', width)}  {'correct':>7}  {'images':>6}  {'top-1':>7}  "
                 f"{'predicted':>9}  {'precision':>9}  mostly mistaken for")
    per_class = results["per_class"]
    for name, correct, total, predicted, mistaken in zip(
            class_names, per_class["correct"], per_class["total"], per_class["predicted"],
            per_class["mistaken_for"]):
        accuracy = f"{correct / total:.1%}" if total else "-"
        precision = f"{correct / predicted:.1%}" if predicted else "-"
        confused = f"{class_names[mistaken[0]]} ({mistaken[1]})" if mistaken else "-"
        lines.append(f"{pad(name, width)}  {correct:>7}  {total:>6}  {accuracy:>7}  "
                     f"{predicted:>9}  {precision:>9}  {confused}")
    return "\n".join(lines)


class HeldOutEvaluator:
    """A run's evaluations on its held-out split: when (--eval-every), how (every rank its
    share, with rank 0's BatchNorm statistics), and one batch timed for the time budget."""

    def __init__(self, accelerator, loader, bad_images, num_classes: int, channels_last: bool,
                 config, split: str = "held-out",
                 finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        """`finish`: where the loader hands uint8 pixels (loading.pixels_to_the_device), what
        normalizes each batch on the device as it is evaluated."""
        self.accelerator, self.loader, self.bad_images = accelerator, loader, bad_images
        self.split = split  # the loader's: where bad_images looks up the images it marks
        self.num_classes, self.channels_last, self.tta = num_classes, channels_last, config.tta
        self.batch_size, self.loader_timeout = config.batch_size, config.loader_timeout
        self.eval_every = config.eval_every
        self.batches = loader  # what each evaluation iterates
        self.finish = finish

    def keep_batches(self, pacer) -> None:
        """Evaluations after the first take its batches, kept on the device (data/
        held_out_kept.py; `pacer`: the loader's indices, prepared as the loader is): uint8
        pixels, normalized by `finish` as they are evaluated.  The loader's workers end once
        it has been read through."""
        self.batches = KeptHeldOut(self.loader, pacer, lambda: end_workers(self.loader))

    def due(self, epoch: int, last: bool) -> bool:
        """--eval-every N: the Nth epoch ends evaluate (`epoch` 0-based), and the `last` always
        does (the run's final numbers; a time budget's latest fit decides which is the last)."""
        return last or bool(self.eval_every and (epoch + 1) % self.eval_every == 0)

    def evaluate(self, model: nn.Module, step: int) -> dict:
        """evaluate_classifier's numbers for `model`, the bare module: no DDP buffer broadcast,
        so no collective inside forward.  (Not unwrap_model's default, keep_torch_compile=True:
        for a compiled DDP model that re-points the compiled wrapper at the bare model, and
        training after the first evaluation would bypass DDP, no_sync lost under
        accumulation.)"""
        if self.accelerator.num_processes > 1:
            # DDP hands rank 0's buffers (BatchNorm running statistics) to the other ranks only
            # at the next training forward; until then each rank holds the statistics of its
            # own last batch.  Every shard is evaluated with rank 0's, the ones the checkpoint
            # and model.safetensors keep (and the ones training continues with anyway).
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
        batches = stop_when_stuck(self.batches, self.loader_timeout,
                                  f"evaluating after step {step}")
        if self.finish is not None:
            batches = ((self.finish(images), *rest) for images, *rest in batches)
        return evaluate_classifier(self.accelerator, model,
                                   self.bad_images.strip(batches, self.split),
                                   self.num_classes, self.channels_last, self.tta)

    def time_one_batch(self, model: nn.Module) -> tuple[float, int]:
        """(this rank's seconds for one held-out batch, the image passes that batch makes on
        all ranks together: images x TTA views x ranks)."""
        seconds, images = batch_seconds(self.accelerator, model, self.loader.dataset,
                                        self.batch_size, self.channels_last, self.tta,
                                        finish=self.finish)
        return seconds, images * TTA_PASSES[self.tta] * self.accelerator.num_processes


class NoTestSplit:
    """The data has no test split (or the run selects on it): nothing to evaluate at the end."""

    def evaluate_once(self, model: nn.Module, step: int) -> Optional[dict]:
        return None


class TestSplit:
    """The test split: evaluated once, after training, with the weights the run saved.  Nothing
    reads it before, so it decides nothing (best checkpoints, EMA or raw, the budget's probes
    all read the validation split)."""

    def __init__(self, evaluator: HeldOutEvaluator):
        self.evaluator = evaluator

    def evaluate_once(self, model: nn.Module, step: int) -> Optional[dict]:
        return self.evaluator.evaluate(model, step)


def maybe_test_split(accelerator, loader, bad_images, num_classes: int, channels_last: bool,
                     config, finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
    if loader is None:
        return NoTestSplit()
    return TestSplit(HeldOutEvaluator(accelerator, accelerator.prepare(loader), bad_images,
                                      num_classes, channels_last, config, split="test",
                                      finish=finish))


def epoch_record(results: dict[str, dict]) -> dict:
    """An epoch record's entries for the evaluations of the model ("") and of the averages
    beside it ("ema"): eval_loss, eval_top1, ..., eval_ema_loss, ..."""
    entries = {f"eval_{k}": v for k, v in results[""].items() if k != "per_class"}
    for name, averaged in results.items():
        if name:
            entries.update({f"eval_{name}_{k}": averaged[k]
                            for k in ("loss", "top1", "top5", "mean_class_top1")})
    return entries


def epoch_words(results: dict[str, dict], metric: str = "top1") -> str:
    """The console's words for an epoch end's evaluations: loss, top-1 and top-5, the
    averages' top-1, and the --eval-metric the run picks by where these leave it out (the
    mean per-class top-1; the averages' loss or top-5)."""
    model = results[""]
    extra = _metric_words(model, metric) if metric == "mean_class_top1" else ""
    averages = "".join(f", {name.upper()} top1 {averaged['top1']:.2%}"
                       f"{_metric_words(averaged, metric) if metric != 'top1' else ''}"
                       for name, averaged in results.items() if name)
    return (f"eval loss {model['loss']:.4f} top1 {model['top1']:.2%} top5 {model['top5']:.2%}"
            f"{extra}{averages} ({model['count']} images)")


# the epoch line's names (top1, not top-1) of the metrics --eval-metric may add to it
_EPOCH_LINE_WORDS = {"loss": "loss", "top5": "top5", "mean_class_top1": "mean per-class top1"}


def _metric_words(results: dict, metric: str) -> str:
    return f" {_EPOCH_LINE_WORDS[metric]} {value_text(metric, results[metric])}"
