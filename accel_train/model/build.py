"""timm models: creation by name, local pretrained weights, backbone freezing, and the small JSON
spec that is enough to rebuild a trained model for inference.

The model knows nothing of ranks or devices; wrapping happens in `accelerator.prepare`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Optional

import timm
import torch
from torch import nn

from accel_train.model import small_nets  # noqa: F401  (registers the small-image networks in timm's registry)
from accel_train.base.errors import UsageError, first_line
from accel_train.model.saved import ModelSpec, unknown_architecture_hint
from accel_train.base.weightfiles import check_weights_file


def check_model_name(name: str, flag: str = "--model") -> None:
    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise UsageError(f"{flag} {name!r} is not a timm model; {hint}list them with "
                     f"python -c \"import timm; print(timm.list_models('*{name[:6]}*'))\"")


def create_model(name: str, num_classes: int, drop_rate: float = 0.0,
                 pretrained: Optional[str] = None, drop_path: float = 0.0) -> nn.Module:
    """A timm model; `pretrained` is None, 'hub', or a local weights file."""
    check_model_name(name)
    kwargs = dict(num_classes=num_classes, drop_rate=drop_rate)
    if drop_path:  # only when asked: not every timm model takes it
        kwargs["drop_path_rate"] = drop_path
    try:
        return _create(name, pretrained, kwargs)
    except TypeError as err:
        if "drop_path_rate" not in str(err):
            raise
        raise UsageError(f"--drop-path: {name} has no stochastic depth (timm's drop_path_rate); "
                         f"drop --drop-path or choose a residual model") from None


def _create(name: str, pretrained: Optional[str], kwargs: dict) -> nn.Module:
    if pretrained is None:
        return timm.create_model(name, pretrained=False, **kwargs)
    if pretrained == "hub":
        try:
            return timm.create_model(name, pretrained=True, **kwargs)
        except Exception as err:  # offline, missing cache entry, no weights for this name
            raise UsageError(f"--pretrained hub: cannot fetch weights for {name} "
                             f"({first_line(err)}); with no network, pass "
                             f"--pretrained PATH to a local .safetensors or .pth file") from None
    path = Path(pretrained)
    if not path.is_file():
        raise UsageError(f"--pretrained {pretrained}: no such file; pass a local .safetensors/"
                         f".pth weights file, or 'hub'")
    check_weights_file(path, f"--pretrained {pretrained}", "fetch or copy it again")
    try:
        # timm loads the file and drops a classifier whose class count differs from ours.
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                                 **kwargs)
    except (RuntimeError, KeyError, ValueError, OSError) as err:
        raise UsageError(f"--pretrained {pretrained}: does not fit model {name} "
                         f"({first_line(err, 200)}); pass weights saved from "
                         f"{name}") from None


def pretrained_normalization(model: nn.Module) -> tuple[tuple, tuple]:
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    return (tuple(cfg.get("mean", (0.485, 0.456, 0.406))),
            tuple(cfg.get("std", (0.229, 0.224, 0.225))))


def check_image_size(model: nn.Module, name: str, image_size: int) -> None:
    """Run one tiny forward pass so a size the model cannot take fails now, in one line."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, image_size, image_size))
    except Exception as err:  # shape errors surface as RuntimeError/AssertionError/ValueError
        default = (getattr(model, "pretrained_cfg", {}) or {}).get("input_size", (3, 224, 224))[-1]
        raise UsageError(f"--image-size {image_size} does not work with {name} "
                         f"({first_line(err)}); try --image-size "
                         f"{default}") from None
    finally:
        model.train(was_training)


def freeze_backbone(model: nn.Module) -> int:
    """Leave only the classifier trainable; returns the number of trainable parameters."""
    classifier = model.get_classifier()
    if not isinstance(classifier, nn.Module) or not any(True for _ in classifier.parameters()):
        raise UsageError("--freeze-backbone: this model has no separate classifier to train")
    for param in model.parameters():
        param.requires_grad_(False)
    for param in classifier.parameters():
        param.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def set_train_mode(model: nn.Module, backbone_frozen: bool) -> None:
    """model.train(), but a frozen backbone keeps its BatchNorm statistics fixed too: transfer
    learning with frozen features should not drift the features' normalization."""
    model.train()
    if backbone_frozen:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()


def build_from_spec(spec: ModelSpec) -> nn.Module:
    if not timm.is_model(spec.model_name):
        raise UsageError(f"the model's architecture {spec.model_name!r} is not in this timm's "
                         f"registry (timm {timm.__version__}); "
                         f"{unknown_architecture_hint(spec.model_name)}")
    return create_model(spec.model_name, spec.num_classes, spec.drop_rate)
