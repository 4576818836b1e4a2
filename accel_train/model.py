"""timm models: creation by name, local pretrained weights, backbone freezing, and the small JSON
spec that is enough to rebuild a trained model for inference.

The model knows nothing of ranks or devices; wrapping happens in `accelerator.prepare`.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import timm
import torch
from torch import nn

from . import small_nets  # noqa: F401  (registers the small-image networks in timm's registry)
from .errors import UsageError, first_line
from .rundir import SPEC_FILE, WEIGHTS_FILE  # noqa: F401  (WEIGHTS_FILE: callers name it here)
from .readers import read_json
from .weightfiles import check_weights_file


@dataclass
class ModelSpec:
    """Everything needed to rebuild the network and feed it images like training did."""

    model_name: str
    num_classes: int
    class_names: list[str]
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    drop_rate: float = 0.0
    weights: str = "model"  # which weights model.safetensors holds: "model" or "ema" (--model-ema)
    tta: str = "none"  # test-time augmentation the run evaluated with (--tta)

    name = "model_spec"  # a checkpointed part (checkpoint.py): export/eval read a checkpoint alone

    def save(self, directory: Path) -> Path:
        path = Path(directory) / SPEC_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    def load(self, directory: Path) -> None:
        """A resumed start: the checkpoint's network must be this start's (restored before the
        weights, so that another --model is one line, not a state-dict size mismatch)."""
        saved = ModelSpec.read(directory)
        if (saved.model_name, saved.num_classes) != (self.model_name, self.num_classes):
            raise UsageError(f"checkpoint {directory} was trained with --model "
                             f"{saved.model_name} ({saved.num_classes} classes) but this start "
                             f"builds {self.model_name} ({self.num_classes} classes); resume "
                             f"with the same --model and data, or start a new run")

    @classmethod
    def read(cls, directory: Path) -> "ModelSpec":
        """From timm's config.json (a run's final model, an export: timm_folder.py), else from
        model_config.json (checkpoints; runs and exports made before timm's format)."""
        from .timm_folder import TIMM_CONFIG, spec_from_timm_config
        if (Path(directory) / TIMM_CONFIG).is_file():
            return spec_from_timm_config(Path(directory) / TIMM_CONFIG)
        path = Path(directory) / SPEC_FILE
        if not path.is_file():
            raise UsageError(f"{directory}: no {TIMM_CONFIG} or {SPEC_FILE} there; pass a run "
                             f"directory or an export made by accel-train")
        return cls.from_dict(read_json(path, "model_config"))  # readers.py: one line if bad

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        """From model_config.json, or the `resolved: model:` entry of a run's config.yaml
        (timm's config.json: timm_folder.spec_from_timm_config)."""
        return cls(**{**data, "mean": tuple(data["mean"]), "std": tuple(data["std"])})


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


def save_weights(state_dict: dict, directory: Path, spec: ModelSpec,
                 with_spec: bool = True) -> Path:
    """The one writer of model weights: DIR/model.safetensors (plain CPU tensors, with the
    metadata that tools reading safetensors as PyTorch weights look for) and, `with_spec`,
    DIR/model_config.json beside it (checkpoints; a model folder has timm's config.json
    instead: timm_folder.py)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    if with_spec:
        spec.save(directory)
    return directory / WEIGHTS_FILE


def build_from_spec(spec: ModelSpec) -> nn.Module:
    if not timm.is_model(spec.model_name):
        from .timm_folder import unknown_architecture_hint
        raise UsageError(f"the model's architecture {spec.model_name!r} is not in this timm's "
                         f"registry (timm {timm.__version__}); "
                         f"{unknown_architecture_hint(spec.model_name)}")
    return create_model(spec.model_name, spec.num_classes, spec.drop_rate)


@dataclass
class Network:
    """A model built for training, with what the run reports about it."""

    model: nn.Module
    spec: ModelSpec
    num_trainable: int
    sync_bn: bool
    whitened: Optional[str] = None   # --whiten-stem: what was whitened, from what


def build_network(config, data, num_processes: int, cuda: bool,
                  warn: Callable[[str], None]) -> Network:
    """The model a run trains: created from --seed alone, checked against the image size,
    normalized like its pretrained weights (else like the data), maybe frozen, maybe with
    synchronized BatchNorm.  Still a bare module in its default memory format (the trainer
    applies channels_last once it is chosen: autotune.py); wrapping happens in
    `accelerator.prepare`."""
    from .data import dataset_mean_std
    from .syncbn import convert_sync_batchnorm, num_batchnorm_layers

    image_size = config.image_size or data.train.native_size
    torch.manual_seed(config.seed)  # model init is a function of --seed alone
    model = create_model(config.model, len(data.class_names), config.drop_rate, config.pretrained,
                         config.drop_path)
    check_image_size(model, config.model, image_size)
    mean, std = pretrained_normalization(model) if config.pretrained else \
        dataset_mean_std(data.train)
    spec = ModelSpec(config.model, len(data.class_names), list(data.class_names), image_size,
                     tuple(mean), tuple(std), config.drop_rate, tta=config.tta)
    if config.bn_momentum is not None:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.momentum = config.bn_momentum
    if config.whiten_stem:
        from .transforms import ImageTransform
        from .whitening import whiten_first_conv, whitening_images
        whitened = whiten_first_conv(model, whitening_images(
            data.train, ImageTransform(image_size, spec.mean, spec.std)))
    num_trainable = (freeze_backbone(model) if config.freeze_backbone
                     else sum(p.numel() for p in model.parameters() if p.requires_grad))
    sync_bn = config.sync_bn and num_processes > 1
    if sync_bn:
        convert_sync_batchnorm(model, cuda=cuda)
    if config.sync_bn and num_batchnorm_layers(model) == 0:
        warn(f"--sync-bn: {config.model} has no BatchNorm layers; nothing to sync")
    return Network(model, spec, num_trainable, sync_bn,
                   whitened if config.whiten_stem else None)
