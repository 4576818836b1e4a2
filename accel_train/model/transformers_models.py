"""Hugging Face transformers networks a program hands to `fit()`, rebuilt from their config.

eval, predict, export and a resume rebuild a program's network through its class's import name
(`package.module:Class`, called with `num_classes=`).  A transformers model's class is built
from a config object instead (`ResNetForImageClassification(config)`), and what it is (depths,
widths, patch size, label count) lives only there.  So the run records the config, as the JSON
of `config.to_json_string()`, among the spec's model_args, and the rebuild hands it to the
class's own `config_class.from_dict`: the same network, with no factory to write.  Nothing
here imports transformers: the recorded class brings it.
"""

from __future__ import annotations

import json
from typing import Optional

from torch import nn

TRANSFORMERS_CONFIG = "transformers_config"  # its key in ModelSpec.model_args


def transformers_config_of(model: nn.Module) -> Optional[dict]:
    """The config a transformers model was built from, as a JSON dict; None for other
    networks (what `from_dict` takes back: every field, not only those that differ from the
    class's defaults, which could change between transformers versions)."""
    config = getattr(model, "config", None)
    if getattr(type(model), "config_class", None) is None or \
            not callable(getattr(config, "to_json_string", None)):
        return None
    recorded = json.loads(config.to_json_string(use_diff=False))
    # Where from_pretrained read the weights (a folder on the user's machine, or a hub name) is
    # not what the network is, and would travel into every config.json the run writes and
    # publishes: the rebuild loads the trained weights anyway.
    recorded.pop("_name_or_path", None)
    return recorded


def build_from_transformers_config(cls: type, recorded: dict) -> nn.Module:
    """`cls` built from the config the run recorded (random weights: the caller loads the
    trained ones)."""
    return cls(cls.config_class.from_dict(recorded))


def transformers_classifier(model: nn.Module) -> Optional[nn.Module]:
    """The head of a transformers image classifier, which names it `classifier` (ViT, DeiT,
    BEiT, Swin, ConvNeXt, ResNet, ...) where timm's networks have get_classifier(); None for
    other networks."""
    head = getattr(model, "classifier", None)
    return head if transformers_config_of(model) is not None and isinstance(head, nn.Module) \
        else None
