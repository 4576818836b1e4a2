"""The network a run trains, built from its config and its data: the one place where what the
data says (its mean and std, its first images for a whitened stem) reaches the model, as numbers
and tensors.  The model package never imports the data package; this start step joins them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from accel_train.data.augment import build_policy
from accel_train.data.loaders import dataset_mean_std
from accel_train.data.sources import ArraySource
from accel_train.data.transforms import SMALL_IMAGE, ImageTransform
from accel_train.model.build import (check_image_size, check_model_name, create_model,
                                     freeze_backbone, pretrained_normalization)
from accel_train.model.saved import ModelSpec
from accel_train.model.syncbn import convert_sync_batchnorm, num_batchnorm_layers
from accel_train.model.whitening import IMAGES_DECODED, IMAGES_IN_MEMORY, whiten_first_conv


def check_library_names(config) -> None:
    """Names that timm must know (an --auto-augment policy, the --smaller-models networks),
    checked before the data loads: a typo is one line at once, not after minutes of loading."""
    if config.auto_augment:
        build_policy(config.auto_augment)
    for name in config.smaller_models or ():
        check_model_name(name, "--smaller-models")


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


def whitening_images(source, transform) -> torch.Tensor:
    """The first training images (index order: no random draw), resized and normalized as the
    held-out ones are: [N, C, S, S] float."""
    if isinstance(source, ArraySource) and source.native_size <= SMALL_IMAGE:
        return transform.batch(source.images[:IMAGES_IN_MEMORY])
    count = min(len(source), IMAGES_DECODED)
    return torch.stack([transform(image) for image in source.images_at(range(count))])
