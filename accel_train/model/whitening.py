"""--whiten-stem: the model's first convolution starts as a whitening of the training images.

Why: airbench (Keller Jordan, arXiv:2404.00498) initializes its first layer from the training
images themselves: the eigenvectors of the covariance of their pixel patches, each divided by the
square root of its eigenvalue, so the layer's outputs start decorrelated and of equal variance
whatever the data's pixel statistics are.  Each filter comes with its negative, so that an
activation after it keeps both signs of every component.  In short runs the network then spends
no steps learning what a linear map of the data could have told it.

Nothing here is CIFAR-specific: the first convolution is the one timm names in the model's
pretrained_cfg (`first_conv`), else the first `Conv2d` that reads the image's channels; its kernel
size sets the patch size; big images contribute patches on a strided grid so that the statistics
cost the same at any resolution.  Channels beyond twice the patch dimension keep their own
initialization; with fewer channels, the filters of the largest eigenvalues are taken first.
The result is a function of the training images and the model alone (no random draws), so every
rank computes the same filters and a resumed run, which loads its weights, never depends on it.

The whitened layer computes in float32 under autocast (Float32Conv2d).  Why: its filters scale
the finest pixel-patch directions by up to 40x (CIFAR-10), so each output is a difference of
large, nearly cancelling terms; with inputs and weights rounded to bf16's 8 bits, the finest
channels carry 10-15% rms rounding noise (the coarsest 0.2%), and a step's gradients on a 2-core
Xeon with AMX came 15-24% (relative norm) from fp32's on every layer, 8-13% with this one layer
in fp32.  It is a small share of the network's arithmetic (3 input channels).
Why its output goes on in autocast's dtype: model/float32_convs.py.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from accel_train.base.errors import UsageError
from accel_train.model.float32_convs import compute_in_float32

# Images whose patches estimate the covariance: airbench's 5,000 where they are in memory;
# fewer where each must be decoded first (the estimate of a 27- to 147-dimensional covariance
# from hundreds of images' patches is already stable).
IMAGES_IN_MEMORY = 5000
IMAGES_DECODED = 500
PATCHES_PER_IMAGE = 1024    # at most, on a strided grid: the cost does not grow with resolution
EPS = 5e-4                  # added to the eigenvalues (airbench's): near-zero ones stay bounded
_CHUNK = 250                # images unfolded at a time (memory)


def first_conv(model: nn.Module, in_channels: int = 3) -> tuple[str, nn.Conv2d]:
    """(name, module) of the convolution that reads the image; UsageError when there is none a
    whitening can be written into."""
    named = dict(model.named_modules())
    cfg_name = getattr(model, "pretrained_cfg", {}).get("first_conv")
    candidates = [cfg_name] if isinstance(cfg_name, str) and cfg_name in named else []
    candidates += [name for name, module in named.items() if isinstance(module, nn.Conv2d)]
    for name in candidates:
        module = named[name]
        if isinstance(module, nn.Conv2d) and module.in_channels == in_channels:
            if module.groups != 1 or module.dilation != (1, 1):
                break
            return name, module
    raise UsageError("--whiten-stem: this model's first layer is not a plain convolution over "
                     "the image's channels (groups 1, no dilation); train it without "
                     "--whiten-stem")


def patch_covariance(images: torch.Tensor, kernel: tuple[int, int]) -> torch.Tensor:
    """The (uncentred, as airbench's) second moment of the images' kernel-sized patches, in
    float64: [c*kh*kw, c*kh*kw], patches flattened in Conv2d's weight order (c, kh, kw)."""
    height, width = images.shape[-2:]
    places = (height - kernel[0] + 1) * (width - kernel[1] + 1)
    stride = max(1, int((places / PATCHES_PER_IMAGE) ** 0.5))
    dim = images.shape[1] * kernel[0] * kernel[1]
    total = torch.zeros(dim, dim, dtype=torch.float64)
    count = 0
    for start in range(0, len(images), _CHUNK):
        patches = F.unfold(images[start:start + _CHUNK].double(), kernel, stride=stride)
        patches = patches.transpose(1, 2).reshape(-1, dim)          # [patches, dim]
        total += patches.T @ patches
        count += patches.shape[0]
    return total / count


def whitening_filters(covariance: torch.Tensor, num_filters: int, eps: float = EPS
                      ) -> torch.Tensor:
    """[num_filters, dim]: eigenvectors of `covariance` from the largest eigenvalue down, each
    scaled by 1/sqrt(eigenvalue + eps), alternately positive and negative (filter 2k is
    vector k, filter 2k+1 its negative)."""
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)        # ascending
    order = torch.argsort(eigenvalues, descending=True)
    scaled = (eigenvectors[:, order] / torch.sqrt(eigenvalues[order] + eps)).T   # rows
    k = torch.arange(num_filters)
    sign = 1.0 - 2.0 * (k % 2).to(scaled.dtype)
    return scaled[k // 2] * sign[:, None]


def whiten_first_conv(model: nn.Module, images: torch.Tensor, eps: float = EPS,
                      bias_epochs: Optional[int] = None) -> str:
    """Write the whitening of `images` (normalized, [N, C, H, W]) into the first convolution's
    first min(out_channels, 2 * patch dim) filters (and zero its bias); says what it did
    (`bias_epochs`: for how many epochs the caller lets the bias of a fixed layer train).  A
    plain Conv2d becomes Float32Conv2d (the module docstring says why).

    When that is every filter, the weights are frozen (airbench's choice): the layer is then a
    fixed change of basis of the pixels, which the learning rate of the rest of the network
    would only disturb.  A layer with filters of its own init beyond those trains whole."""
    name, conv = first_conv(model, images.shape[1])
    kernel = tuple(conv.kernel_size)
    dim = conv.in_channels * kernel[0] * kernel[1]
    num_filters = min(conv.out_channels, 2 * dim)
    filters = whitening_filters(patch_covariance(images, kernel), num_filters, eps)
    with torch.no_grad():  # a block, not a decorator: mutmut leaves decorated functions alone
        conv.weight[:num_filters] = filters.reshape(num_filters, conv.in_channels,
                                                    *kernel).to(conv.weight.dtype)
        if conv.bias is not None:
            conv.bias.zero_()
    # A subclass (timm's StdConv2d, Conv2dSame) keeps its own forward, in autocast's precision.
    in_float32 = type(conv) is nn.Conv2d
    if in_float32:
        compute_in_float32(model, [name])
    fixed = num_filters == conv.out_channels
    if fixed:
        conv.weight.requires_grad_(False)
    said = (f"{name} ({num_filters} of {conv.out_channels} filters"
            f"{', computed in float32' if in_float32 else ''}) whitened from the "
            f"{kernel[0]}x{kernel[1]} patches of {len(images)} training images")
    if not fixed:
        return said + "; the layer trains"
    said += "; its weights fixed"
    if conv.bias is None:
        return said
    return said + ", its bias trains" + ("" if bias_epochs is None
                                        else f" for {bias_epochs} epoch(s)")


