"""torchvision's classification networks handed to `fit()` as modules (`resnet18(weights=...)`,
perhaps with a new `fc`): eval, predict, export and resume rebuild a network by its recorded
name, and torchvision's classes cannot be rebuilt from a class count (`ResNet(num_classes=N)`
needs its block and layers), while its builders can (`resnet18(num_classes=N)`).  So the run
finds the builder that makes this very network and records it as a factory,
`torchvision.models:resnet18`, which every command already imports and calls."""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torchvision
from torch import nn

from accel_train.model.build import weights_device
from accel_train.model.outputs import logits_from

TORCHVISION_FACTORY = "torchvision.models:{}"


def torchvision_builder(model: nn.Module, num_classes: int, image_size: int) -> Optional[str]:
    """`torchvision.models:NAME` for the torchvision builder whose network, built with
    num_classes=N, has the same class and parameter shapes as `model` and, given its weights,
    the same outputs (a dilated ResNet, `replace_stride_with_dilation`, has resnet50's shapes
    and computes otherwise); None when no builder does (a network changed beyond its head)."""
    if not type(model).__module__.startswith("torchvision.models."):
        return None
    with torch.random.fork_rng(devices=[]):  # the builders' initializations draw from it
        return _find_builder(model, num_classes, image_size)


def _find_builder(model: nn.Module, num_classes: int, image_size: int) -> Optional[str]:
    shapes = _shapes(model)
    for name in sorted(torchvision.models.list_models(module=torchvision.models)):
        builder = torchvision.models.get_model_builder(name)
        # a builder's annotation names the class it returns: only those are built
        if inspect.signature(builder).return_annotation is not type(model):
            continue
        try:
            with torch.device("meta"):  # the shapes alone: no memory, no initialization
                candidate = builder(num_classes=num_classes)
        except Exception:  # a builder that takes other arguments: not this network's
            continue
        if _shapes(candidate) == shapes and _same_outputs(model, builder, num_classes,
                                                          image_size):
            return TORCHVISION_FACTORY.format(name)
    return None


def _shapes(model: nn.Module) -> dict[str, tuple]:
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def _same_outputs(model: nn.Module, builder, num_classes: int, image_size: int) -> bool:
    """Whether the builder's network, holding `model`'s weights, gives its logits for two
    random images (eval mode: BatchNorm's statistics stay as they are).  Both run on the
    module's device (a GPU's TF32 convolutions would differ from the CPU's beyond the
    tolerance)."""
    device = weights_device(model)
    candidate = builder(num_classes=num_classes)
    candidate.load_state_dict(model.state_dict())
    candidate.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            torch.manual_seed(0)
            images = torch.rand(2, 3, image_size, image_size).to(device)
            ours = logits_from(model(images)).float()
            theirs = logits_from(candidate.eval()(images)).float()
        return ours.shape == theirs.shape and torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    finally:
        model.train(was_training)
