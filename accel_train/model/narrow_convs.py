"""Convolutions whose input is narrower than their stride compute in float32 under autocast.

Why: on a CPU, oneDNN's bfloat16 weight gradient (torch 2.14) is wrong for them.  Where a
convolution's input is fewer pixels wide than its stride (a 3x3, stride-2 convolution over a
one-pixel-wide map: a ResNet's last stage on images of 16 px or less), the weight gradient's
kernel columns that see only padding come back holding whatever that memory held (NaN, 1e21, or
wrong small numbers) in about a third of the backward passes; the output and the input's
gradient are right.  A run at 8 px in bf16 diverged at its first step.  Measured against
torch.nn.grad.conv2d_weight in float32 on a 2-core AMD EPYC with AVX512-BF16, widths 1-14,
strides 1-4, kernels 2-7: every case with width < stride and a kernel wider than one pixel was
broken, no other.

These layers see one to three pixel columns: float32 costs nothing measurable there (a bf16
training step of resnet18 / resnet50 at 16 px, batch 128, took 0.99 / 0.95 of the plain
network's time, medians of 15 interleaved steps, same 2-core AMD EPYC).  The rule
holds on every device (a GPU does not need it), so that a run's network, and the float32_layers
its saved model records, are the same wherever it trains, resumes or is evaluated.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn


@contextmanager
def recording_input_widths(model: nn.Module) -> Iterator[dict[str, int]]:
    """Within the block, each forward pass records the narrowest input width each of the
    model's convolutions met: {name: width}."""
    widths: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            def record(_module, inputs, _output, name=name):
                if not inputs:  # called with its input as a keyword: not seen, not changed
                    return
                width = inputs[0].shape[-1]
                widths[name] = min(width, widths.get(name, width))
            handles.append(module.register_forward_hook(record))
    try:
        yield widths
    finally:
        for handle in handles:
            handle.remove()


def narrower_than_stride(model: nn.Module, widths: dict[str, int]) -> list[str]:
    """The plain convolutions (exactly nn.Conv2d: a subclass has a forward of its own, which
    Float32Conv2d would replace) whose recorded input is narrower than their stride, with a
    kernel wider than one pixel."""
    names = []
    for name, module in model.named_modules():
        if type(module) is nn.Conv2d and name in widths and \
                widths[name] < module.stride[1] and module.kernel_size[1] > 1:
            names.append(name)
    return names
