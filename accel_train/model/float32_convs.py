"""Convolutions that compute in float32 under autocast, inside a network that does not.

Two kinds of layer need it: a whitened first convolution (--whiten-stem, model/whitening.py:
its filters' nearly cancelling sums lose too much in bf16) and a convolution narrower than its
stride (model/narrow_convs.py: oneDNN's bf16 weight gradient is wrong there).  Both are rebuilt
from the names a saved model records (`float32_layers`), so eval, predict and export compute
what training computed.

The output goes on in autocast's dtype.  For the whitened layer, the cancelling happens inside the
convolution's sums, which float32 keeps, and the result rounded to bf16 is off by bf16's 0.4% at
most, as every other activation is.  The GELU after the layer then runs (forward and backward) in
bf16 like the rest of the network: in float32, over the network's largest activation, it cost 6% of
cifar_airbench's step while the layer's bias trains and 3% after, against 2% and 1% so, with the
gradients as close to fp32's as with a float32 output (2-core AMD EPYC with AVX512-BF16, bf16,
batch 1024).  For a narrow layer, what goes wrong is its weight gradient, which float32 computes
whatever the output's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from accel_train.base.errors import UsageError


class Float32Conv2d(nn.Conv2d):
    """A Conv2d that computes in float32 whatever autocast says and hands its output on in
    autocast's dtype (the module docstring says why both); the same parameters and state_dict
    as Conv2d.  Without autocast (fp32 runs, ONNX export) it is Conv2d's forward itself."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device_type = input.device.type
        if not torch.is_autocast_enabled(device_type):
            return super().forward(input)
        with torch.autocast(device_type, enabled=False):
            output = super().forward(input.float())
        return output.to(torch.get_autocast_dtype(device_type))


def compute_in_float32(model: nn.Module, names) -> None:
    """Make the named convolutions of `model` Float32Conv2d in place.  The class changes, not
    the module tree (no wrapper): the parameters keep the names timm's own network gives them,
    so the saved weights still load into the plain network (timm's local-dir, transformers,
    checkpoints written before), and the optimizer's hold on them stays."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise UsageError(f"the saved model's float32_layers is {str(names)[:40]!r}, not a list "
                         f"of layer names; was the model's config copied from another run?")
    modules = dict(model.named_modules())
    for name in names:
        conv = modules.get(name)
        if type(conv) not in (nn.Conv2d, Float32Conv2d):
            raise UsageError(f"the model's layer {name!r} is not a plain convolution (the saved "
                             f"model says it computes in float32); was the model's config "
                             f"copied from another run?")
        conv.__class__ = Float32Conv2d


def float32_layers(model: nn.Module) -> list[str]:
    """The names of the model's Float32Conv2d layers (what a saved model records)."""
    return [name for name, module in model.named_modules() if isinstance(module, Float32Conv2d)]
