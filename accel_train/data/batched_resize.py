"""Crops of different sizes resized to one square size: on a GPU as a batch, in a few kernels,
the antialiased bilinear or bicubic resize of torch's `interpolate(..., antialias=True)` (what
torchvision's resize calls, itself PIL's filters) written as two matrix products, each chunk of
crops padded into one tensor; on a CPU crop by crop, by torchvision's resize.

Why batched on a GPU: crops of different sizes take torchvision's resize one call each, and
each call costs about 65 us of host time (its checks, dtype conversions and several kernels;
AMD EPYC, 256 calls on 8x7 crops: 17 ms a batch), while the GPU waits for the next call.  On
an H200 the crops and flips took two thirds of the device path's time (BENCHMARKS.md: 5,729
img/s with them, 17,284 for decoding alone).  Here each crop costs one copy into its chunk;
the weights of the whole chunk are computed at once.  The products are dense (about 0.5 GFLOP
a 224 px crop of a 400x500 photograph, a few ms a batch of 256 on a GPU): on a CPU they cost
21 times torchvision's separable resize (AMD EPYC, one thread: benchmarks/bench_crop_resize.py),
so there torchvision's resize stays.

The weights are torch's antialiasing ones (aten's `upsample_*_aa` kernels, after PIL's
ImagingResample): each output pixel i of a side resized from n to `size` pixels weighs input
pixel j by filter((j + 0.5 - center) * invscale) inside [floor(center - support + 0.5),
floor(center + support + 0.5)) and the crop (outside the first, the filter is zero),
normalised to sum to one, where scale = n / size, center =
scale * (i + 0.5), support = the filter's radius (1 bilinear, 2 bicubic) times max(scale, 1),
invscale = 1 / max(scale, 1); bicubic with a = -0.5, as torch and PIL antialias it.  Computed in
float32 whatever the process's matmul precision (`exact_parts`), the width then the height, each
pass rounded to 8 bits as PIL rounds them (the loader workers' resize; torchvision's on uint8 on
a CPU): tests compare it with torchvision's resize, crop by crop.

The crops reach a chunk as one gather from their images (`padded_crops`), not a copy a crop:
a slice, a select and a copy a crop make 2,000 small operators a batch of 256, which took an
H200's host 25-31 ms a step to issue (BENCHMARKS.md, the always arm's profile), as long as the
step itself, on the thread that decodes the next batch.
"""

from __future__ import annotations

import itertools

import torch
from torchvision.transforms.v2 import functional as TF

# A chunk's padded float32 pixels at most (a crop larger than it is a chunk of its own): one or
# two chunks for a batch of 256 ImageNet crops, a small share of the memory a network trains in;
# on a GPU of less than 32 GiB, 1/128 of its memory (an 8 GiB card: 64 MiB), since the chunk
# comes on top of a step that may fill it.  While a chunk is gathered its int32 index takes as
# many bytes again, and a copy of its images' uint8 pixels comes on top (256 photographs of
# ImageNet's sizes: about 150 MB).
CHUNK_BYTES = 256 * 2 ** 20
GPU_MEMORY_SHARE = 128
_BICUBIC_A = -0.5  # torch's and PIL's antialiasing bicubic


def on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the GPU: a copy from pageable memory first
    synchronizes the stream (CUDA's rule for such copies), one from pinned memory is queued
    behind the work already there."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def resized_crops(images: list[torch.Tensor], boxes: torch.Tensor, size: int,
                  bicubic: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 [N, C, size, size] on `device`: the box of each uint8 [C, H, W] image (on `device`)
    resized, where `boxes` is a host int64 tensor [N, 4] of (top, left, height, width), bicubic
    where the host bool tensor `bicubic` [N] says, else bilinear: as a batch on a GPU, crop by
    crop on a CPU (the module's docstring says why)."""
    device = torch.device(device)
    if not images:
        return torch.zeros(0, 3, size, size, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        return resized_one_by_one(images, boxes, size, bicubic)
    return resized_as_batch(images, boxes, size, bicubic, device)


def resized_one_by_one(images: list[torch.Tensor], boxes: torch.Tensor, size: int,
                       bicubic: torch.Tensor) -> torch.Tensor:
    """torchvision's resize of each image's box (on a CPU its uint8 path: PIL's arithmetic)."""
    modes = {True: TF.InterpolationMode.BICUBIC, False: TF.InterpolationMode.BILINEAR}
    return torch.stack([TF.resize(image[:, top:top + height, left:left + width], [size, size],
                                  interpolation=modes[cubic], antialias=True)
                        for image, (top, left, height, width), cubic
                        in zip(images, boxes.tolist(), bicubic.tolist())])


def resized_as_batch(images: list[torch.Tensor], boxes: torch.Tensor, size: int,
                     bicubic: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`resized_crops` in a few kernels a chunk (any device: the tests run it on a CPU)."""
    device = torch.device(device)
    channels = images[0].shape[0]
    out = torch.empty(len(images), channels, size, size, dtype=torch.uint8, device=device)
    budget = CHUNK_BYTES
    if device.type == "cuda":
        budget = min(budget, torch.cuda.get_device_properties(device).total_memory
                     // GPU_MEMORY_SHARE)
    boxes = boxes.tolist()  # Python numbers: no tensor operator a crop
    for chunk in _chunks([(box[2], box[3]) for box in boxes], channels, budget):
        padded = padded_crops([images[k] for k in chunk], [boxes[k] for k in chunk], device)
        resized = _resized_chunk(padded, [boxes[k][2] for k in chunk],
                                 [boxes[k][3] for k in chunk], size, bicubic[chunk], device)
        out[on_device(torch.tensor(chunk), device)] = resized
    return out


def padded_crops(images: list[torch.Tensor], boxes: list[list[int]],
                 device: torch.device) -> torch.Tensor:
    """float32 [n, C, tallest box, widest box]: each uint8 [C, H, W] image's box (top, left,
    height, width) in its slot's top left corner, zeros past it.  One gather for the whole
    chunk from the images' pixels laid end to end, its index computed on `device`: a view an
    image and a dozen operators in all, where a copy a crop costs a GPU a launch and the host a
    slice, a select and a copy (the module's docstring says what those cost)."""
    channels = images[0].shape[0]
    # every image's pixels end to end, and one zero after them that the padding reads
    flat = torch.cat([image.reshape(-1) for image in images]
                     + [torch.zeros(1, dtype=images[0].dtype, device=device)])
    starts = itertools.accumulate((image.numel() for image in images), initial=0)
    geometry = torch.tensor([[start, image.shape[-2] * image.shape[-1], image.shape[-1], *box]
                             for start, image, box in zip(starts, images, boxes)],
                            dtype=torch.int64).T.contiguous()  # [7, n]
    # int32 wherever it holds every position (a chunk's images under 2 GiB): half the index
    kind = torch.int32 if flat.numel() <= torch.iinfo(torch.int32).max else torch.int64
    start, plane, row, top, left, height, width = \
        on_device(geometry, device).to(kind).view(7, -1, 1, 1, 1)
    span_h, span_w = max(box[2] for box in boxes), max(box[3] for box in boxes)
    y = torch.arange(span_h, dtype=kind, device=device).view(1, 1, -1, 1)
    x = torch.arange(span_w, dtype=kind, device=device).view(1, 1, 1, -1)
    channel = torch.arange(channels, dtype=kind, device=device).view(1, -1, 1, 1)
    index = (start + channel * plane) + (top + y) * row + (left + x)  # [n, C, span_h, span_w]
    index.masked_fill_((y >= height) | (x >= width), flat.numel() - 1)
    # index_select reads an int32 index as it is (indexing with [] would widen it to int64)
    return flat.index_select(0, index.view(-1)).view(index.shape).to(torch.float32)


def _chunks(shapes: list[tuple[int, int]], channels: int, budget: int) -> list[list[int]]:
    """The crops' indices in chunks whose padded float32 pixels stay within `budget` bytes,
    the largest crops first, so that little of a chunk is padding."""
    order = sorted(range(len(shapes)), key=lambda k: shapes[k][0] * shapes[k][1], reverse=True)
    chunks: list[list[int]] = []
    height = width = 0
    for k in order:
        grown_h, grown_w = max(height, shapes[k][0]), max(width, shapes[k][1])
        if chunks and (len(chunks[-1]) + 1) * channels * grown_h * grown_w * 4 <= budget:
            chunks[-1].append(k)
            height, width = grown_h, grown_w
        else:
            chunks.append([k])
            height, width = shapes[k]
    return chunks


def _resized_chunk(padded: torch.Tensor, heights: list[int], widths: list[int], size: int,
                   bicubic: torch.Tensor, device: torch.device) -> torch.Tensor:
    bicubic = on_device(bicubic, device)
    rows = resize_weights(on_device(torch.tensor(heights), device), size, max(heights), bicubic)
    columns = resize_weights(on_device(torch.tensor(widths), device), size, max(widths),
                             bicubic)
    # PIL's order and rounding: the width first, its result rounded to 8 bits, then the height
    # (a bicubic overshoot clamped in between, as PIL's and the workers' resize do)
    across = _as_levels(sum(padded @ part for part in
                            exact_parts(columns.transpose(1, 2).unsqueeze(1))))
    resized = _as_levels(sum(part @ across for part in exact_parts(rows.unsqueeze(1))))
    return resized.to(torch.uint8)


def exact_parts(weights: torch.Tensor) -> list[torch.Tensor]:
    """`weights` as float32 parts whose products with whole levels (0-255) are float32's in any
    matmul precision: the weights alone under "highest"; else three parts that sum to them
    exactly, each of 8 significant bits, which TF32 ("high") and bfloat16 ("medium") hold
    exactly, as they hold the levels.

    Why: the trainer asks for TF32 matmuls on a GPU (precision.py), whose 10-bit mantissa
    would move a pixel by a level in a quarter of them; setting the precision to "highest"
    around the products is not an option, as the setting is the process's, and the products
    run on the decoding thread (decode_ahead.py) while the training thread runs its step."""
    if torch.get_float32_matmul_precision() == "highest":
        return [weights]
    parts, rest = [], weights
    for _ in range(2):
        # float32's low 16 bits cleared: the value truncated to bfloat16's 8 significant bits
        high = (rest.contiguous().view(torch.int32) & -65536).view(torch.float32)
        parts.append(high)
        rest = rest - high  # exact: what the truncation left, at most 16 significant bits
    return parts + [rest]  # at most 8 significant bits left


def _as_levels(pixels: torch.Tensor) -> torch.Tensor:
    """Rounded half up, as PIL's fixed-point sums are (torch's round goes half to even: a level
    off wherever a sum ends in .5, common in smooth images)."""
    return pixels.add_(0.5).floor_().clamp_(0, 255)


def resize_weights(lengths: torch.Tensor, size: int, span: int,
                   bicubic: torch.Tensor) -> torch.Tensor:
    """float32 [N, size, span]: row i of item k holds the weights output pixel i gives input
    pixels 0..span-1 when `lengths[k]` pixels are resized to `size` (zero past lengths[k])."""
    length = lengths.to(torch.float32).view(-1, 1, 1)
    scale = length / size
    # a reduction widens the filter (its support times the scale), an enlargement does not
    invscale = 1.0 / torch.clamp(scale, min=1.0)
    center = scale * (torch.arange(size, device=lengths.device, dtype=torch.float32)
                      .view(1, -1, 1) + 0.5)
    pixel = torch.arange(span, device=lengths.device, dtype=torch.float32).view(1, 1, -1)
    distance = ((pixel - center + 0.5) * invscale).abs()
    weights = torch.where(bicubic.view(-1, 1, 1), _cubic(distance),
                          torch.clamp(1.0 - distance, min=0.0))
    # torch's window [first, end) holds every pixel whose filter is not zero: only its clamp
    # to the crop matters here, where the padding past the crop would count in the sum
    weights = torch.where(pixel < length, weights, 0.0)
    return weights / weights.sum(dim=-1, keepdim=True)


def _cubic(x: torch.Tensor) -> torch.Tensor:
    """Keys' cubic convolution kernel with a = -0.5 at distances x >= 0."""
    a = _BICUBIC_A
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, 0.0))
