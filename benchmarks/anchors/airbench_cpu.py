"""airbench94 (Keller Jordan, arXiv:2404.00498) written out as one plain loop on a CPU: the anchor
for what its algorithm reaches on this machine in N epochs, against which the CPU recipe
(recipes/cifar10-cpu-10min.yaml: the same network and pieces, as accel_train options) is read.

Its network (2x2 whitening conv, fixed; three conv-pool-BatchNorm-GELU groups 64/256/256 with
dirac init and BatchNorm scales fixed at 1; logits x 1/9), its optimizer (Nesterov SGD over the
summed loss at airbench's decoupled lr 11.5, momentum 0.85, weight decay 0.0153 per 1024 images,
BatchNorm shifts at 64x), its triangular schedule (0.2 -> 1 at 23% -> 0.07), label smoothing 0.2,
alternating flips, 2-pixel reflect-padded translations, Lookahead-style averaging every 5 steps
from the first (rho = 0.95^5 x progress^3; the weights take the average after the last step),
the whitening bias trained for 3 epochs, and its TTA levels (none, mirror, mirror + 1-pixel
translations) at the end.

Changed for this machine: bf16 autocast (where the CPU has native bf16: AVX512-BF16 or AMX;
elsewhere fp32, since emulated bf16 is many times slower) and channels_last (airbench: fp16 on
CUDA);
CIFAR-10 from the parquet copy (train.parquet, test.parquet: PNG bytes), decoded once.
airbench's timer: `timed_seconds` is the whitening, each epoch's training loop and the final
evaluation with mirror TTA (the level A is read at; airbench times its own final TTA level), not
the evaluation after each epoch; `training_seconds` is the epochs' loops alone.  Printed at each
epoch end, with one JSON line at the end.

    python benchmarks/anchors/airbench_cpu.py --data-dir ../shared/data/cifar10 --epochs 10
    python benchmarks/anchors/airbench_cpu.py --train-images 2048 --test-images 256 --epochs 4
                                                    # a smoke run (tests/test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import io
import json
import time
from math import ceil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def load(path: Path, count: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    table = pq.read_table(path)
    table = table.slice(0, count) if count else table
    image_column = next(c for c in table.column_names if "im" in c)
    label_column = next(c for c in table.column_names if "label" in c)
    pixels = np.stack([np.asarray(Image.open(io.BytesIO(cell["bytes"])).convert("RGB"))
                       for cell in table.column(image_column).to_pylist()])
    labels = torch.tensor(table.column(label_column).to_pylist())
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(), labels


def normalize(images: torch.Tensor) -> torch.Tensor:
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return (images.float() / 255 - mean) / std


class BatchNorm(nn.BatchNorm2d):
    def __init__(self, width: int):
        super().__init__(width, eps=1e-12, momentum=0.4)   # airbench's 0.6 in its convention
        self.weight.requires_grad = False


class Conv(nn.Conv2d):
    def __init__(self, cin: int, cout: int, kernel: int = 3, padding="same", bias=False):
        super().__init__(cin, cout, kernel, padding=padding, bias=bias)

    def reset_parameters(self):
        super().reset_parameters()
        if self.bias is not None:
            self.bias.data.zero_()
        nn.init.dirac_(self.weight.data[:self.weight.size(1)])


class ConvGroup(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1, self.pool, self.norm1 = Conv(cin, cout), nn.MaxPool2d(2), BatchNorm(cout)
        self.conv2, self.norm2, self.activ = Conv(cout, cout), BatchNorm(cout), nn.GELU()

    def forward(self, x):
        x = self.activ(self.norm1(self.pool(self.conv1(x))))
        return self.activ(self.norm2(self.conv2(x)))


class Scale(nn.Module):
    def forward(self, x):
        return x / 9


def make_net() -> nn.Sequential:
    net = nn.Sequential(Conv(3, 24, 2, padding=0, bias=True), nn.GELU(), ConvGroup(24, 64),
                        ConvGroup(64, 256), ConvGroup(256, 256), nn.MaxPool2d(3), nn.Flatten(),
                        nn.Linear(256, 10, bias=False), Scale())
    net[0].weight.requires_grad = False
    return net.to(memory_format=torch.channels_last)


def whiten(layer: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4) -> None:
    patches = images.unfold(2, 2, 1).unfold(3, 2, 1).transpose(1, 3).reshape(-1, 12).double()
    values, vectors = torch.linalg.eigh(patches.T @ patches / len(patches), UPLO="U")
    values, vectors = values.flip(0).view(-1, 1, 1, 1), vectors.T.reshape(12, 3, 2, 2).flip(0)
    scaled = vectors / torch.sqrt(values + eps)
    layer.weight.data[:] = torch.cat((scaled, -scaled)).float()


def translate(padded: torch.Tensor, pad: int) -> torch.Tensor:
    shifts = torch.randint(-pad, pad + 1, (len(padded), 2))
    out = torch.empty(len(padded), 3, 32, 32)
    for dy in range(-pad, pad + 1):
        for dx in range(-pad, pad + 1):
            mask = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
            out[mask] = padded[mask, :, pad + dy:pad + dy + 32, pad + dx:pad + dx + 32]
    return out


class Averager:
    """airbench94's LookaheadState: a copy of the floating-point state taken before training
    (airbench takes it before the whitening too); every 5 steps it moves towards the weights,
    slow += (1 - rho)(weights - slow) with rho = 0.95^5 x (step / total)^3, and the weights take
    it; after the last step they take it as it stands.  Nothing at epoch ends."""

    def __init__(self, net: nn.Module):
        self.slow = [v.clone() for v in self._floats(net)]

    @staticmethod
    def _floats(net: nn.Module) -> list[torch.Tensor]:
        return [v for v in net.state_dict().values() if v.is_floating_point()]

    def _update(self, net: nn.Module, rho: float) -> None:
        for s, v in zip(self.slow, self._floats(net)):
            s.lerp_(v, 1 - rho)
            v.copy_(s)

    def after_step(self, net: nn.Module, step: int, total: int) -> None:
        if step % 5 == 0:
            self._update(net, 0.95 ** 5 * (step / total) ** 3)
        if step >= total:
            self._update(net, 1.0)


def optimizer_and_schedule(net: nn.Module, batch: int, num_images: int, epochs: float):
    """airbench's optimizer over the summed loss (Nesterov SGD, its decoupled lr and weight
    decay, every trainable parameter decayed, BatchNorm shifts at 64x the lr) and its triangular
    schedule: (optimizer, scheduler, steps per epoch, total steps)."""
    momentum = 0.85
    kilostep = 1024 * (1 + 1 / (1 - momentum))
    lr, wd = 11.5 / kilostep, 0.0153 * batch / kilostep
    norm_biases = [p for k, p in net.named_parameters() if "norm" in k and p.requires_grad]
    others = [p for k, p in net.named_parameters() if "norm" not in k and p.requires_grad]
    optimizer = torch.optim.SGD([dict(params=norm_biases, lr=lr * 64, weight_decay=wd / (lr * 64)),
                                 dict(params=others, lr=lr, weight_decay=wd / lr)],
                                momentum=momentum, nesterov=True)
    steps_per_epoch = num_images // batch
    total = ceil(steps_per_epoch * epochs)
    schedule = np.interp(np.arange(total + 1), [0, int(0.23 * total), total], [0.2, 1, 0.07])
    return (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: schedule[i]),
            steps_per_epoch, total)


def native_bf16() -> bool:
    """AVX512-BF16 or AMX (torch's own checks): where bf16 is emulated, fp32 is faster."""
    return any(getattr(torch.cpu, name, lambda: False)()
               for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


# bf16 autocast where native: use_precision() sets it from --precision, here and in the
# benchmarks that import this loop
AUTOCAST = {"device_type": "cpu", "dtype": torch.bfloat16, "enabled": True}


def use_precision(choice: str) -> str:
    """--precision: 'bf16', 'fp32', or 'auto' (bf16 where the CPU has native bf16, else fp32);
    the precision this process's loop then runs in."""
    AUTOCAST["enabled"] = choice == "bf16" or (choice == "auto" and native_bf16())
    return "bf16" if AUTOCAST["enabled"] else "fp32"


def _mirror(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (net(x).float() + net(x.flip(-1)).float())


@torch.no_grad()
def accuracy(net: nn.Module, images: torch.Tensor, labels: torch.Tensor, level: int) -> float:
    net.eval()
    outputs = []
    with torch.autocast(**AUTOCAST):
        for batch in images.split(1000):
            batch = batch.contiguous(memory_format=torch.channels_last)
            if level == 0:
                outputs.append(net(batch).float())
            elif level == 1:
                outputs.append(_mirror(net, batch))
            else:
                padded = F.pad(batch, (1,) * 4, "reflect")
                shifted = _mirror(net, padded[:, :, :32, :32]) + _mirror(net, padded[:, :, 2:, 2:])
                outputs.append(0.5 * _mirror(net, batch) + 0.25 * shifted)
    net.train()
    return (torch.cat(outputs).argmax(1) == labels).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="../shared/data/cifar10")
    parser.add_argument("--epochs", type=float, default=9.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-images", type=int, default=0, help="the first N (0: all)")
    parser.add_argument("--test-images", type=int, default=0, help="the first N (0: all)")
    parser.add_argument("--batch-size", type=int, default=1024,
                        help="airbench's 1024; the learning rate and weight decay follow its "
                        "per-image rule")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: bf16 where the CPU has native bf16, else fp32")
    args = parser.parse_args()
    print(f"precision: {use_precision(args.precision)}", flush=True)
    torch.manual_seed(args.seed)
    train_images, train_labels = load(Path(args.data_dir) / "train.parquet", args.train_images)
    test_images, test_labels = load(Path(args.data_dir) / "test.parquet", args.test_images)
    test_images = normalize(test_images)
    net = make_net()
    averager = Averager(net)  # as airbench: before the whitening
    started = time.perf_counter()
    whiten(net[0], normalize(train_images[:5000]))
    whitening = time.perf_counter() - started
    batch = args.batch_size
    optimizer, scheduler, steps_per_epoch, total = optimizer_and_schedule(
        net, batch, len(train_labels), args.epochs)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.2, reduction="none")
    normalized = normalize(train_images)
    flipped = torch.where((torch.rand(len(normalized)) < 0.5).view(-1, 1, 1, 1),
                          normalized.flip(-1), normalized)
    padded = F.pad(flipped, (2,) * 4, "reflect")
    step, trained = 0, 0.0
    for epoch in range(ceil(args.epochs)):
        started = time.perf_counter()
        net[0].bias.requires_grad = epoch < 3
        images = translate(padded, 2)
        images = images.flip(-1) if epoch % 2 == 1 else images
        order = torch.randperm(len(images))
        for i in range(steps_per_epoch):
            index = order[i * batch:(i + 1) * batch]
            with torch.autocast(**AUTOCAST):
                loss = loss_fn(net(images[index].contiguous(memory_format=torch.channels_last)),
                               train_labels[index]).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            averager.after_step(net, step, total)
            if step >= total:
                break
        trained += time.perf_counter() - started
        print(f"epoch {epoch + 1}: {trained:.0f} s of training, test top-1 "
              f"{accuracy(net, test_images, test_labels, 0):.4f}", flush=True)
    started = time.perf_counter()
    top1 = {"top1_tta1": accuracy(net, test_images, test_labels, 1)}
    evaluation = time.perf_counter() - started
    top1.update({f"top1_tta{level}": accuracy(net, test_images, test_labels, level)
                 for level in (0, 2)})
    result = {"precision": "bf16" if AUTOCAST["enabled"] else "fp32", "epochs": args.epochs,
              "steps": step, "training_seconds": round(trained, 1),
              "timed_seconds": round(whitening + trained + evaluation, 1),
              # the two short parts to 0.01 s: a small test split evaluates in under 0.05 s
              "whitening_seconds": round(whitening, 2),
              "mirror_eval_seconds": round(evaluation, 2), **top1}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
