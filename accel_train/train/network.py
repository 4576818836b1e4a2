"""The network a run trains, built from its config and its data: the one place where what the
data says (its mean and std, its first images for a whitened stem) reaches the model, as numbers
and tensors.  The model package never imports the data package; this start step joins them."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from timm.data import resolve_data_config
from torch import nn

from accel_train.config import TrainConfig
from accel_train.data.augment import build_policy
from accel_train.data.loaders import dataset_mean_std
from accel_train.data.large_photos import large_photo_note
from accel_train.data.sources import ArraySource, HFSource, default_image_size
from accel_train.data.transforms import SMALL_IMAGE, held_out_transform
from accel_train.model.build import (check_first_forward, check_float32_weights,
                                     check_layer_decay, check_model_name,
                                     check_train_forward, check_trainable, freeze_backbone,
                                     keep_auxiliary_losses,
                                     pretrained_normalization,
                                     recorded_model_name, timm_source,
                                     unused_parameters)
from accel_train.model.input_size import check_whole_patches, create_at_size
from accel_train.model.pretrained_file import plan_head, reorder_classifier
from accel_train.model.saved import ModelSpec, is_import_path
from accel_train.model.transformers_models import TRANSFORMERS_CONFIG, transformers_config_of
from accel_train.model.torchvision_models import torchvision_builder
from accel_train.model.syncbn import convert_sync_batchnorm, num_batchnorm_layers
from accel_train.model.narrow_convs import narrower_than_stride, recording_input_widths
from accel_train.model.float32_convs import compute_in_float32, float32_layers
from accel_train.model.whitening import IMAGES_DECODED, IMAGES_IN_MEMORY, whiten_first_conv


def rebuilt_by_class_count(cls) -> bool:
    """Whether `cls(num_classes=N)` can be called, as eval, predict and export rebuild a
    program's module (model/build.py's factory call)."""
    try:
        inspect.signature(cls).bind(num_classes=1)
        return True
    except TypeError:
        return False
    except ValueError:  # a signature Python cannot read: let the rebuild itself say
        return True


def check_library_names(config) -> None:
    """Names that must resolve (an --auto-augment policy, the --model and --smaller-models
    networks: timm's, or a factory's import path, imported here), checked before the data
    loads: a typo is one line at once, not after minutes of loading."""
    if config.auto_augment:
        build_policy(config.auto_augment)
    check_model_name(config.model, "--model")
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
    # trainable parameters the train-mode forward never uses: DDP must look for them
    # (build.py)
    unused: tuple[str, ...] = ()
    # eval, predict and export can build it again (not a class a script defined in itself, or
    # one whose constructor needs more than the class count)
    rebuilt_by_commands: bool = True
    weights: Optional[str] = None  # --pretrained: the weights it started from, its classifier


def build_network(config, data, num_processes: int, cuda: bool,
                  warn: Callable[[str], None], model: Optional[nn.Module] = None) -> Network:
    """The model a run trains: created from --seed alone, checked against the image size,
    normalized by --mean/--std, else like its pretrained weights, else like the data; maybe
    frozen, maybe with synchronized BatchNorm.  Still a bare module in its default memory
    format (the trainer applies channels_last once it is chosen: autotune.py); wrapping is
    `accelerator.prepare`'s.  `model`: a module a program brings (the Python API), initialised
    by the program, used as it is."""
    image_size = config.image_size or default_image_size(data.train)
    program_module = model
    if model is None and timm_source(config.model) == "local-dir" and config.pretrained is None:
        warn(f"--model {config.model}: the folder's architecture, from random weights; "
             f"--pretrained hub starts from its model.safetensors")
    model_args = {}
    head = pretrained_head(config, data.class_names) if model is None else None
    if model is None:
        torch.manual_seed(config.seed)  # model init is a function of --seed alone
        model, model_args = create_at_size(config.model, len(data.class_names), image_size,
                                           config.drop_rate, config.pretrained,
                                           config.drop_path,
                                           head.overlay() if head is not None else None)
        if head is not None and head.order is not None:
            reorder_classifier(model, head.order)
    check_float32_weights(model, config.model)
    check_whole_patches(model, config.model, image_size)
    with recording_input_widths(model) as widths:
        check_first_forward(model, config.model, image_size, len(data.class_names))
    check_train_forward(model, config.model, image_size, len(data.class_names))
    keep_auxiliary_losses(model, config.model, image_size, config.aux_loss_weight)
    model_name, program_args, rebuilt_by_commands = (recorded_model_name(config.model), {}, True)
    if program_module is not None:
        model_name, program_args, rebuilt_by_commands = how_commands_rebuild(
            program_module, model_name, len(data.class_names), image_size, warn)
    model_args = {**model_args, **program_args}
    compute_in_float32(model, narrower_than_stride(model, widths))  # a oneDNN bf16 bug: see there
    check_layer_decay(model, config.model, config.layer_decay)
    mean, std = choose_normalization(config, model, data.train)
    if program_module is not None and (config.mean is None or config.std is None):
        warn_of_own_normalization(program_module, warn)
    native_size = data.train.native_size
    spec = ModelSpec(model_name, len(data.class_names),
                     list(data.class_names), image_size,
                     tuple(mean), tuple(std), config.drop_rate, tta=config.tta,
                     **choose_held_out_crop(config, model, native_size),
                     model_args=model_args)
    small_data_notes(config, native_size, warn)
    if isinstance(data.train, HFSource):  # files decoded per step, which shard can store
        where = f"--data-dir {config.data_dir}" if config.data_dir else \
            f"--dataset {config.dataset}"
        note = large_photo_note(data.train.probed_shapes, image_size, where)
        if note:
            warn(note)
    if config.bn_momentum is not None:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.momentum = config.bn_momentum
    if config.whiten_stem:
        # --whiten-bias-epochs: train/stem_bias.py freezes the bias after that many epochs
        whitened = whiten_first_conv(model, whitening_images(data.train, held_out_transform(spec)),
                                     bias_epochs=config.whiten_bias_epochs)
    # eval, predict and export rebuild the layers a run computes in float32 as it computed them
    spec.float32_layers = float32_layers(model)
    num_trainable = (freeze_backbone(model) if config.freeze_backbone
                     else sum(p.numel() for p in model.parameters() if p.requires_grad))
    check_trainable(num_trainable, config.model)
    unused = tuple(unused_parameters(model, image_size)) if num_processes > 1 else ()
    if unused:
        warn(f"--model {config.model}: {len(unused)} trainable parameter(s) its train-mode "
             f"forward pass never uses ({', '.join(unused[:3])}"
             f"{', ...' if len(unused) > 3 else ''}): DDP "
             f"looks for them at every step (find_unused_parameters, slower); remove them or "
             f"set their requires_grad=False")
    sync_bn = config.sync_bn and num_processes > 1
    if sync_bn:
        convert_sync_batchnorm(model, cuda=cuda)
    if config.sync_bn and num_batchnorm_layers(model) == 0:
        warn(f"--sync-bn: {config.model} has no BatchNorm layers; nothing to sync")
    return Network(model, spec, num_trainable, sync_bn,
                   whitened if config.whiten_stem else None, unused, rebuilt_by_commands,
                   weights_words(config, head, len(data.class_names), model))


def pretrained_head(config, class_names):
    """A local --pretrained file's plan for a timm model (pretrained_file.py)."""
    if config.pretrained in (None, "hub") or timm_source(config.model) is not None \
            or is_import_path(config.model):
        return None
    path = Path(config.pretrained)
    return plan_head(path, config.model, class_names) if path.is_file() else None


def weights_words(config, head, num_classes: int, model: nn.Module) -> Optional[str]:
    """The summary's account of --pretrained: the file and its classifier, or the hub's
    weights and timm's rule for theirs (kept only for as many classes as they were for)."""
    if config.pretrained is None:
        return None
    if head is not None:
        return head.words
    if config.pretrained != "hub":
        return config.pretrained
    theirs = (getattr(model, "pretrained_cfg", None) or {}).get("num_classes")
    if not isinstance(theirs, int) or theirs == num_classes:
        return f"timm's pretrained {config.model}"
    return (f"timm's pretrained {config.model} with a new {num_classes}-class classifier "
            f"(theirs has {theirs} classes)")


def how_commands_rebuild(model: nn.Module, name: str, num_classes: int, image_size: int,
                         warn: Callable[[str], None]) -> tuple[str, dict, bool]:
    """How eval, predict, export and resume rebuild a module a program hands over: the name
    to record (`name`, its class's import path; or the torchvision builder that makes it),
    the arguments to record (a transformers model's config), and whether they can at all
    (else a warning says why and what would)."""
    hf_config = transformers_config_of(model)
    # a transformers model is rebuilt from the config it records, not from the class count
    model_args = {TRANSFORMERS_CONFIG: hf_config} if hf_config is not None else {}
    if type(model).__module__ == "__main__":
        warn(f"the model's class {type(model).__qualname__} is defined in the script that runs, "
             f"which eval, predict and export cannot import to rebuild the network; define it "
             f"in a module the script imports to use them")
        return name, model_args, False
    if model_args:
        return name, model_args, True
    builder = torchvision_builder(model, num_classes, image_size)
    if builder is not None:
        return builder, {}, True
    if rebuilt_by_class_count(type(model)):
        return name, {}, True
    arch = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
    warn(f"eval, predict and export rebuild the network as {type(model).__qualname__}("
         f"num_classes=N), which that class cannot do (its constructor needs more); "
         + (f"pass the model by its timm name, fit({arch!r}, ...), to use them"
            if type(model).__module__.startswith("timm.") and arch else
            "give it a constructor that takes num_classes alone, or a factory function "
            "(package.module:factory) that builds it so, to use them"))
    return name, {}, False


def choose_normalization(config, model: nn.Module, train) -> tuple[tuple, tuple]:
    """The mean and std images are normalized with: --mean and --std where given, else the
    pretrained weights' (--pretrained), else the training images' (computed only when one of
    the two is still needed: a sample of a large folder is decoded for it)."""
    if config.mean is not None and config.std is not None:
        return tuple(config.mean), tuple(config.std)
    mean, std = pretrained_normalization(model) if config.pretrained else \
        dataset_mean_std(train)
    return (tuple(config.mean or mean), tuple(config.std or std))


def warn_of_own_normalization(model: nn.Module, warn: Callable[[str], None]) -> None:
    """A transformers model loaded by from_pretrained learned its weights from images its image
    processor normalized (ViT's 0.5, ResNet's ImageNet statistics), which the run cannot read
    from the model: without mean= and std= it normalizes with the training images' own."""
    loaded_from = getattr(model, "name_or_path", "") \
        if transformers_config_of(model) is not None else ""
    if isinstance(loaded_from, str) and loaded_from:
        warn(f"the model was loaded from {loaded_from!r}, whose weights learned from images "
             f"its image processor normalized; without mean= and std= the run normalizes with "
             f"the training images' statistics: pass the processor's, "
             f"AutoImageProcessor.from_pretrained({loaded_from!r}).image_mean and .image_std")


def choose_held_out_crop(config, model: nn.Module, native_size: int) -> dict:
    """How held-out images are resized and cropped (ModelSpec's crop_pct, crop_mode and
    interpolation): the flags where given, else the model's own, as timm's resolve_data_config
    reads them from its pretrained_cfg (a centre crop at its crop_pct, mostly).  Images of
    SMALL_IMAGE px or less keep the plain resize of both sides (squash, crop_pct 1, bilinear):
    at their native size that is no resize at all, and a centre crop would cut off an eighth of
    a CIFAR image."""
    if native_size <= SMALL_IMAGE:
        chosen = {"crop_pct": 1.0, "crop_mode": "squash", "interpolation": "bilinear"}
    else:
        resolved = resolve_data_config(model=model)
        chosen = {"crop_pct": float(resolved["crop_pct"]), "crop_mode": resolved["crop_mode"],
                  "interpolation": resolved["interpolation"]}
    given = {name: getattr(config, name) for name in chosen if getattr(config, name) is not None}
    return {**chosen, **given}


# Flags whose effect is on the training crop of images above SMALL_IMAGE alone.
LARGE_IMAGE_FLAGS = ("scale", "ratio", "vflip", "color_jitter", "train_interpolation")


def small_data_notes(config, native_size: int, warn: Callable[[str], None]) -> None:
    """Say so when a flag that only acts on images above SMALL_IMAGE px was changed for data
    that is not: the pad-and-crop path of small images leaves it unused."""
    if native_size > SMALL_IMAGE:
        return
    defaults = TrainConfig()
    changed = [name for name in LARGE_IMAGE_FLAGS if getattr(config, name) !=
               getattr(defaults, name)]
    if changed and config.augment:
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        warn(f"{flags}: act on images above {SMALL_IMAGE} px only (timm's training transform); "
             f"these are {native_size} px and take the pad-and-crop path (--crop-pad, --flip, "
             f"--hflip)")


def whitening_images(source, transform) -> torch.Tensor:
    """The first training images (index order: no random draw), resized and normalized as the
    held-out ones are: [N, C, S, S] float."""
    if isinstance(source, ArraySource) and source.native_size <= SMALL_IMAGE:
        return transform.batch(source.images[:IMAGES_IN_MEMORY])
    count = min(len(source), IMAGES_DECODED)
    return torch.stack([transform(image) for image in source.images_at(range(count))])
