"""Networks of a fixed input size trained at another: timm's ViT, DeiT, Swin, BEiT, EVA, MaxViT
and kin build their position embeddings (or windows) for the `img_size` they are constructed
with, 224 by default, and refuse any other size at their first forward.  timm's own answer is
that argument: `create_model(name, img_size=S)` builds the network for S, and loading
pretrained weights resamples the position embeddings to it (timm's checkpoint filters).  So a
run at --image-size S builds such a network with img_size=S, and records it (ModelSpec.
model_args; timm's saver writes it among the export's model_args), so that eval, predict,
export and timm itself rebuild the same network.  A network that takes S as it is built is
left as it is: older runs rebuild unchanged."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from accel_train.base.errors import UsageError
from accel_train.model.build import builds_for_size, create_model, native_image_size, takes_size
from accel_train.model.saved import is_import_path


def create_at_size(name: str, num_classes: int, image_size: int, drop_rate: float = 0.0,
                   pretrained: Optional[str] = None, drop_path: float = 0.0,
                   head_overlay: Optional[dict] = None) -> tuple[nn.Module, dict]:
    """(the network, the model_args it was built with): as `create_model` builds it, or, when
    that network refuses `image_size` and its class takes img_size, built again for that size
    from the same random state (the weights are those a first build with img_size would have
    drawn: a run's initialisation stays a function of --seed alone)."""
    state = torch.random.get_rng_state()
    model = create_model(name, num_classes, drop_rate, pretrained, drop_path,
                         head_overlay=head_overlay)
    if is_import_path(name) or native_image_size(model) == image_size \
            or not builds_for_size(model) or takes_size(model, image_size):
        return model, {}
    torch.random.set_rng_state(state)
    model_args = {"img_size": image_size}
    try:
        return create_model(name, num_classes, drop_rate, pretrained, drop_path,
                            model_args, head_overlay), model_args
    except (TypeError, ValueError, AssertionError, RuntimeError):
        # it takes img_size but not this one (a window or patch it does not divide): the
        # first build, whose forward then says in one line what the size breaks
        torch.random.set_rng_state(state)
        return create_model(name, num_classes, drop_rate, pretrained, drop_path,
                            head_overlay=head_overlay), {}


def check_whole_patches(model: nn.Module, name: str, image_size: int) -> None:
    """A patch embedding (timm's ViT, DeiT, BEiT, EVA: a convolution whose stride is its patch)
    built for a size its patch does not divide takes the whole patches and drops the rest:
    vit_tiny_patch16 at 100 px trains on the top-left 96x96 of every image without a word."""
    embed = getattr(model, "patch_embed", None)
    patch = getattr(embed, "patch_size", None)
    if patch is None or getattr(embed, "dynamic_img_pad", False):  # padded: every pixel seen
        return
    patch = (patch, patch) if isinstance(patch, int) else tuple(patch)
    if not all(isinstance(side, int) and side > 0 for side in patch) or \
            all(image_size % side == 0 for side in patch):
        return
    side = max(patch)
    below, above = image_size // side * side, (image_size // side + 1) * side
    raise UsageError(f"--image-size {image_size} is not a whole number of {name}'s {side}-pixel "
                     f"patches: it would never see the last {image_size - below} rows and "
                     f"columns of each image; use --image-size {below} or {above}")
