"""Classification metrics over a whole data set, each sample counted once, on one process or many.

The trainer (at each epoch end) and `accel-train eval` both call `evaluate_classifier`, so the
numbers a run logs and the numbers `eval` prints on the same data and weights are the same numbers.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from accel_train.data.loaders import collate_batch


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
                        channels_last: bool, tta: str) -> dict:
    """Loss, top-1, top-5 and per-class accuracy.

    `model` must be the bare module (not DDP-wrapped): DDP broadcasts buffers at every forward,
    a collective that would hang if ranks see different numbers of batches.  Per-sample values
    go through gather_for_metrics, which drops the samples the distributed sampler repeated to
    even out the last batch (reducing to a scalar first would defeat that).
    """
    was_training = model.training
    model.eval()
    parts: dict[str, list] = {"loss": [], "top1": [], "top5": [], "labels": []}
    for images, labels in loader:
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        # no_grad as a block (not a decorator: mutmut leaves decorated functions alone)
        with torch.no_grad(), accelerator.autocast():
            logits = logits_of(model, images, tta)
        topk = logits.topk(min(5, logits.shape[1]), dim=1).indices
        values = (F.cross_entropy(logits, labels, reduction="none"), topk[:, 0] == labels,
                  (topk == labels[:, None]).any(dim=1), labels)
        for key, value in zip(parts, accelerator.gather_for_metrics(values)):
            parts[key].append(value.cpu())
    model.train(was_training)
    merged = {k: torch.cat(v) for k, v in parts.items()}
    per_class_total = torch.bincount(merged["labels"], minlength=num_classes)
    per_class_correct = torch.bincount(merged["labels"][merged["top1"]], minlength=num_classes)
    return {"loss": float(merged["loss"].mean()), "top1": float(merged["top1"].float().mean()),
            "top5": float(merged["top5"].float().mean()), "count": len(merged["labels"]),
            "per_class": {"correct": per_class_correct.tolist(),
                          "total": per_class_total.tolist()}}


def batch_seconds(accelerator, model: nn.Module, dataset, batch_size: int,
                  channels_last: bool, tta: str, repeats: int = 2) -> tuple[float, int]:
    """(seconds, images): the time one held-out batch takes through the evaluation's path (its
    first `batch_size` images read and prepared as the loader's fetch does, moved to the device,
    the model's logits with `tta` under the run's autocast, the loss and top-k), the fastest of
    `repeats` (the first pays for new kernels; the held-out set's batches run warm).  Every
    module's train/eval flag is left as it was (a frozen backbone's BatchNorm stays in eval
    mode), and nothing is drawn from any random generator."""

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
    lines = [f"loss {results['loss']:.4f}  top-1 {results['top1']:.2%}  top-5 "
             f"{results['top5']:.2%}  ({results['count']} images)", ""]
    width = max([len("class"), *(len(name) for name in class_names)])
    lines.append(f"{'class':<{width}}  {'correct':>7}  {'images':>6}  {'top-1':>7}")
    per_class = results["per_class"]
    for name, correct, total in zip(class_names, per_class["correct"], per_class["total"]):
        accuracy = f"{correct / total:.1%}" if total else "-"
        lines.append(f"{name:<{width}}  {correct:>7}  {total:>6}  {accuracy:>7}")
    return "\n".join(lines)
