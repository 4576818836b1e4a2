r"""airbench94 (Keller Jordan, arXiv:2404.00498) on a CUDA GPU the way its own script runs it: the
GPU anchor that benchmarks/bench_anchor_side_by_side.py times the accel_train CLI against.

The algorithm is airbench94.py's as published with the paper (averaging every 5 steps from the
first, the average copied back after the last step only; its drafts before that averaged from
epoch 3 and copied the average back at every epoch end), and so airbench_cpu.py's, whose
network, whitening (its eigenvectors in float64, airbench's in float32), averaging and
evaluation this file imports.  What the GPU changes, each as airbench does it:
  * fp16 by casting the model (net.half(), its BatchNorms kept in fp32), not by autocast;
    channels_last; cudnn.benchmark;
  * the whole data set as tensors on the GPU: normalized, flipped at random once and
    reflect-padded by 2 in the first epoch, then each epoch translated by up to 2 px and, every
    other epoch, all flipped (the alternating flip), all on the GPU and inside the timed epoch
    (airbench's loader does that work in its __iter__);
  * its timer: CUDA events around the whitening and each epoch's training loop, then
    torch.cuda.synchronize.  The evaluation at each epoch end is outside it, as in airbench.
    airbench also counts its final TTA evaluation; that is printed apart (tta2_eval_seconds)
    because the CLI's epoch times leave evaluation out;
  * --compile: torch.compile, and then first a whole warm-up run on random labels, as
    airbench94_compiled.py does ("warmup"), so that compiling stays out of the timed run (the
    same compiled module, its parameters reset).  Default mode, not airbench's max-autotune,
    whose first compile takes minutes (--compile-mode to choose).

Each epoch prints its training seconds and the test top-1 without TTA and with mirror TTA
(level 1: what the side-by-side compares); one JSON line at the end with the three levels and
the per-epoch list.  --device cpu runs the same code in fp32 (a test of this script, not a
measurement: airbench_cpu.py is the CPU anchor).

    python benchmarks/anchors/airbench_gpu.py --data-dir DATA_DIR --epochs 10 --compile
    python benchmarks/anchors/airbench_gpu.py --device cpu --train-images 64 --test-images 64 \
        --batch-size 32 --epochs 2                 # its code on a CPU, as the smoke test runs it
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from math import ceil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import airbench_cpu as cpu  # noqa: E402  (the network, whitening, loading and TTA levels)


class Timer:
    """airbench's: CUDA events around the timed work, synchronized at its end (wall clock on a
    CPU)."""

    def __init__(self, device: torch.device):
        self.cuda, self.seconds = device.type == "cuda", 0.0

    def __enter__(self):
        if self.cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        else:
            self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = 1e-3 * self.start.elapsed_time(self.end)
        else:
            self.seconds = time.perf_counter() - self.started


def random_flip(images: torch.Tensor) -> torch.Tensor:
    mask = (torch.rand(len(images), device=images.device) < 0.5).view(-1, 1, 1, 1)
    return torch.where(mask, images.flip(-1), images)


def translate(padded: torch.Tensor, pad: int) -> torch.Tensor:
    """airbench's batch_crop for pad <= 2: one masked copy per shift, on the images' device."""
    shifts = torch.randint(-pad, pad + 1, (len(padded), 2), device=padded.device)
    size = padded.size(-1) - 2 * pad
    out = torch.empty(len(padded), 3, size, size, device=padded.device, dtype=padded.dtype)
    for dy in range(-pad, pad + 1):
        for dx in range(-pad, pad + 1):
            mask = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
            out[mask] = padded[mask, :, pad + dy:pad + dy + size, pad + dx:pad + dx + size]
    return out


def build(device: torch.device) -> nn.Sequential:
    net = cpu.make_net().to(device)
    if device.type == "cuda":
        net = net.half()
        for module in net.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.float()
    return net.to(memory_format=torch.channels_last)


def reset(net: nn.Module) -> None:
    """airbench94_compiled.py's reinit_net: a new run on the same (compiled) module."""
    for module in net.modules():
        if isinstance(module, (nn.Conv2d, nn.BatchNorm2d, nn.Linear)):
            module.reset_parameters()


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW on the device -> airbench's (x / 255 - mean) / std in the model's dtype."""
    dtype = torch.half if images.is_cuda else torch.float
    mean = torch.tensor(cpu.MEAN, device=images.device, dtype=dtype).view(1, 3, 1, 1)
    std = torch.tensor(cpu.STD, device=images.device, dtype=dtype).view(1, 3, 1, 1)
    images = images.to(dtype).div(255).contiguous(memory_format=torch.channels_last)
    return (images - mean) / std


def train(net, compiled, images, labels, test_images, test_labels, args, quiet=False) -> dict:
    """One airbench94 run (airbench94.py's main): returns its timings and accuracies."""
    reset(net)
    batch = args.batch_size
    net[0].bias.requires_grad = True
    optimizer, scheduler, steps_per_epoch, total = cpu.optimizer_and_schedule(
        net, batch, len(labels), args.epochs)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.2, reduction="none")
    averager = cpu.Averager(net)  # as airbench: before the whitening
    with Timer(images.device) as timer:
        cpu.whiten(net[0], normalize(images[:5000]))
    trained, epochs, step, padded = timer.seconds, [], 0, None
    for epoch in range(ceil(args.epochs)):
        net[0].bias.requires_grad = epoch < 3
        with Timer(images.device) as timer:
            if padded is None:  # airbench's first epoch: normalize, flip once, pad
                padded = F.pad(random_flip(normalize(images)), (2,) * 4, "reflect")
            epoch_images = translate(padded, 2)
            epoch_images = epoch_images.flip(-1) if epoch % 2 == 1 else epoch_images
            order = torch.randperm(len(epoch_images), device=epoch_images.device)
            for i in range(steps_per_epoch):
                index = order[i * batch:(i + 1) * batch]
                loss = loss_fn(compiled(epoch_images[index]), labels[index]).sum()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                step += 1
                averager.after_step(net, step, total)
                if step >= total:
                    break
        trained += timer.seconds
        record = {"epoch": epoch + 1, "training_seconds": round(timer.seconds, 4),
                  "total_training_seconds": round(trained, 4),
                  **{f"top1_tta{level}": cpu.accuracy(compiled, test_images, test_labels, level)
                     for level in (0, 1)}}
        epochs.append(record)
        if not quiet:
            print(f"epoch {epoch + 1}: {timer.seconds:.3f} s ({trained:.3f} s of training), "
                  f"test top-1 {record['top1_tta0']:.4f}, mirror TTA {record['top1_tta1']:.4f}",
                  flush=True)
    with Timer(images.device) as final:
        top1_tta2 = cpu.accuracy(compiled, test_images, test_labels, 2)
    return {"steps": step, "training_seconds": round(trained, 3),
            "tta2_eval_seconds": round(final.seconds, 3), "top1_tta0": epochs[-1]["top1_tta0"],
            "top1_tta1": epochs[-1]["top1_tta1"], "top1_tta2": top1_tta2, "per_epoch": epochs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="../shared/data/cifar10")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to test this script")
    parser.add_argument("--epochs", type=float, default=9.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-images", type=int, default=0, help="the first N (0: all)")
    parser.add_argument("--test-images", type=int, default=0, help="the first N (0: all)")
    parser.add_argument("--batch-size", type=int, default=1024,
                        help="airbench's 1024; the learning rate and weight decay follow its "
                        "per-image rule")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the network, after a warm-up run on random labels")
    parser.add_argument("--compile-mode", default="default",
                        help="torch.compile's mode (airbench94_compiled.py: max-autotune)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                        help="a whole untimed run first (default: with --compile only)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    # The model is in the data's dtype already (half on CUDA): no autocast in the evaluation.
    cpu.AUTOCAST.update(device_type=device.type, enabled=False)
    train_images, train_labels = cpu.load(Path(args.data_dir) / "train.parquet",
                                          args.train_images)
    test_images, test_labels = cpu.load(Path(args.data_dir) / "test.parquet", args.test_images)
    train_images, train_labels = train_images.to(device), train_labels.to(device)
    test_images, test_labels = normalize(test_images.to(device)), test_labels.to(device)
    net = build(device)
    compiled = torch.compile(net, mode=args.compile_mode) if args.compile else net
    warmup_seconds = None
    if args.warmup if args.warmup is not None else args.compile:
        torch.manual_seed(args.seed + 1)
        started = time.perf_counter()
        # random labels, as airbench's warm-up: only the kernels and compiled graphs carry over
        train(net, compiled, train_images, torch.randint_like(train_labels, 10), test_images,
              test_labels, args, quiet=True)
        warmup_seconds = round(time.perf_counter() - started, 1)
        print(f"warm-up run: {warmup_seconds} s", flush=True)
    torch.manual_seed(args.seed)
    result = train(net, compiled, train_images, train_labels, test_images, test_labels, args)
    precision = "fp16 (model.half(), BatchNorm fp32)" if device.type == "cuda" else "fp32"
    print(json.dumps({"device": str(device), "precision": precision, "compile": args.compile,
                      "warmup_seconds": warmup_seconds, "epochs": args.epochs, **result}))


if __name__ == "__main__":
    main()
