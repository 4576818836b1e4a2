"""Networks whose forward returns an object holding the logits, as networks from outside timm
do; importable (PYTHONPATH=tests) so that `--model nets_with_output_objects:...` builds them."""

from __future__ import annotations

from collections import namedtuple
from typing import TYPE_CHECKING

import torch
from torch import nn
from torchvision.models.inception import InceptionOutputs

# transformers is imported by the two builders that need it: every test worker imports this
# module when it collects the test files, and transformers' import is most of 2 s a worker.
if TYPE_CHECKING:
    from transformers import ResNetForImageClassification, ViTForImageClassification


def tiny_hf_resnet(num_classes: int = 10) -> "ResNetForImageClassification":
    """A Hugging Face transformers image classifier (returns an ImageClassifierOutput...)."""
    from transformers import ResNetConfig, ResNetForImageClassification
    return ResNetForImageClassification(ResNetConfig(
        num_labels=num_classes, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]))



def tiny_hf_vit(num_classes: int = 10, image_size: int = 32) -> "ViTForImageClassification":
    """A transformers ViT, built for one input size (its config's image_size)."""
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(
        num_labels=num_classes, image_size=image_size, patch_size=8, hidden_size=16,
        num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))


class AuxHeadNet(nn.Module):
    """Shaped like torchvision's Inception v3: in train mode (logits, aux_logits) as its named
    tuple, in eval mode the logits alone."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8, num_classes)
        self.aux = nn.Linear(8, num_classes)

    def forward(self, images):
        features = self.body(images)
        if self.training:
            return InceptionOutputs(self.fc(features), self.aux(features))
        return self.fc(features)


# a program's own named tuple: its fields, not its class, name the logits and auxiliary logits
OwnOutputs = namedtuple("OwnOutputs", "logits aux_logits")


class BiasAuxNet(nn.Module):
    """In train mode (logits, aux_logits) as Inception v3's named tuple (or `outputs`, another
    with those fields), where the auxiliary logits are a bias the images do not change, zero at
    the start: their loss and its gradient are known by hand (uniform probabilities over the
    classes)."""

    def __init__(self, num_classes: int = 10, outputs: type = InceptionOutputs):
        super().__init__()
        self.outputs = outputs
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten())
        self.fc = nn.Linear(4, num_classes)
        self.aux_bias = nn.Parameter(torch.zeros(num_classes))

    def forward(self, images):
        logits = self.fc(self.body(images))
        if self.training:
            return self.outputs(logits, self.aux_bias.expand(len(images), -1))
        return logits
