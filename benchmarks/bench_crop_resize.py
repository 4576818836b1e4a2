r"""The device path's crop resize: a batch's random-resized crops resized one torchvision call a
crop, against the same crops resized as a batch (accel_train/data/batched_resize.py: one gather
from their images and two matrix products a chunk), side by side in alternating rounds, on the
GPU where there is one, else on the CPU.

Two kinds of batch: `calls`, 256 crops of 6-11 px resized to 4 px, where the work is the calls
themselves (what a GPU spends its host time on: each torchvision call costs its checks, dtype
conversions and kernel launches); `photos`, crops drawn by timm's RandomResizedCrop from images
of ImageNet's sizes (make_imagenet_like.image_size) resized to --size, where the arithmetic
counts (the batched products are dense: a CPU keeps torchvision's resize for that reason).
Per kind: ms a batch for each arm (median over rounds), the ratio, and how far the two arms'
pixels are apart (levels of 255).

    python benchmarks/bench_crop_resize.py                   # the GPU's if there is one
    python benchmarks/bench_crop_resize.py --quick           # a smoke run
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from make_imagenet_like import image_size  # noqa: E402
from accel_train.data.batched_resize import resized_as_batch, resized_one_by_one  # noqa: E402


Crops = tuple[list[torch.Tensor], torch.Tensor]  # images on the device, host boxes [N, 4]


def call_crops(count: int, device: torch.device) -> Crops:
    """Small images, each crop the whole image."""
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(6, 12, (count, 2), generator=generator).tolist()
    images = [torch.randint(0, 256, (3, h, w), generator=generator, dtype=torch.uint8).to(device)
              for h, w in sizes]
    return images, torch.tensor([[0, 0, h, w] for h, w in sizes], dtype=torch.int64)


def photo_crops(count: int, device: torch.device) -> Crops:
    """Smooth random images at ImageNet's sizes, boxes drawn as timm draws them."""
    from timm.data.transforms import RandomResizedCropAndInterpolation
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    images, boxes = [], []
    for _ in range(count):
        width, height = image_size(rng)
        coarse = torch.from_numpy(rng.integers(0, 256, (3, height // 16 + 2, width // 16 + 2),
                                               dtype=np.uint8))
        image = torch.nn.functional.interpolate(coarse[None].float(), (height, width),
                                                mode="bilinear")[0].to(torch.uint8)
        boxes.append(RandomResizedCropAndInterpolation.get_params(image, (0.08, 1.0),
                                                                  (3 / 4, 4 / 3)))
        images.append(image.to(device))
    return images, torch.tensor(boxes, dtype=torch.int64)


def timed(work, device: torch.device) -> float:
    """Seconds `work` takes, the GPU's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(crops: Crops, size: int, device: torch.device, rounds: int) -> dict:
    images, boxes = crops
    bicubic = torch.arange(len(images)) % 2 == 0
    arms = {"crop by crop (torchvision)": lambda: resized_one_by_one(images, boxes, size,
                                                                     bicubic),
            "batched": lambda: resized_as_batch(images, boxes, size, bicubic, device)}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    outputs = {}
    for name in arms:  # once each untimed: kernels, caches
        outputs[name] = arms[name]()
    for order in benchlib.round_orders(list(arms), rounds):
        for name in order:
            seconds[name].append(timed(arms[name], device))
    first, second = (outputs[name].int() for name in arms)
    difference = (first - second).abs().float()
    return {"ms": {name: 1000 * benchlib.median(values) for name, values in seconds.items()},
            "mean_abs": difference.mean().item(), "max": difference.max().item()}


def main() -> int:
    parser = benchlib.make_parser(__doc__, data_dir=None, data_help="(not read: the crops are "
                                  "made here)")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--photos", type=int, default=256, help="crops in a photos batch")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.quick:
        args.photos, args.rounds, args.size = 8, 2, 32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # per core, as the loader workers run
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU, one thread"
    report = benchlib.Report("crop_resize", "The device path's crop resize: crop by crop "
                             "against batched", args)
    rows = []
    for kind, crops, size in (("calls", call_crops(256, device), 4),
                              ("photos", photo_crops(args.photos, device), args.size)):
        result = measure(crops, size, device, args.rounds)
        per_crop, batched = result["ms"].values()
        rows.append([kind, len(crops[0]), size, per_crop, batched, per_crop / batched,
                     f"{result['mean_abs']:.3f} / {result['max']:.0f}"])
    report.table(f"{name}: ms a batch, median of {args.rounds} alternating rounds",
                 ["batch", "crops", "to px", "crop by crop ms", "batched ms",
                  "crop by crop / batched", "pixels apart (mean / max)"], rows)
    report.data["result"] = rows
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
