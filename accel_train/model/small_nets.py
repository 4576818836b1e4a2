"""Convolutional networks for small (CIFAR-sized, 32 px) images, registered in timm's registry.

Why this exists: timm's networks are built for ImageNet-sized inputs.  At 32 px their stride-4
stem leaves 8x8 feature maps before the first block (resnet10t), so on a CPU they are fast but
give away accuracy; the same networks without that downsampling are too slow for a CPU.  The
networks that train CIFAR-10 fastest keep the full resolution in the stem and downsample with max
pooling between plain 3x3 conv/BatchNorm blocks: David Page's ResNet-9 ("How to train your ResNet",
2018, the DAWNBench CIFAR-10 entry) and Keller Jordan's airbench ("94% on CIFAR-10 in 3.29
seconds on a single GPU", arXiv:2404.00498, 2024).  These are that design, narrower (a CPU has
a fraction of a GPU's arithmetic), and with the pooling before each group's convolutions rather
than after its first one, which quarters the cost of those convolutions.

Registering them in timm's registry (what the registry is for) makes them ordinary timm models:
`--model cifar_convnet_m` works wherever a timm name does, including `timm.create_model` in
other code once `accel_train` is imported, and timm's pretrained-file loading, classifier reset
and layer-decay grouping apply to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

# CIFAR-10's training-set statistics: the defaults a model reports (pretrained_cfg) when it
# has no pretrained weights; accel-train normalizes with the data's own statistics anyway.
_CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR_STD = (0.2470, 0.2435, 0.2616)


def _conv_bn_act(in_channels: int, out_channels: int, act: type[nn.Module] = nn.GELU
                 ) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), act()]


class _SmallImageClassifier(nn.Module):
    """What the networks below share: a stem and stages built by each, then a global pool, dropout
    and a linear classifier; and the methods timm's tooling expects of a model (classifier access
    and reset for fine-tuning and --freeze-backbone, parameter groups for --layer-decay, features
    and head separately)."""

    def __init__(self, stem: nn.Module, stages: nn.Sequential, widths: tuple[int, ...],
                 num_classes: int, drop_rate: float, global_pool: str,
                 classifier_bias: bool = True, logit_scale: float = 1.0):
        super().__init__()
        if global_pool not in ("max", "avg"):
            raise ValueError(f"global_pool must be 'max' or 'avg' (got {global_pool!r})")
        self.stem, self.stages = stem, stages
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = widths[-1]
        self.drop_rate = drop_rate
        self.global_pool = global_pool
        self.classifier_bias, self.logit_scale = classifier_bias, logit_scale
        self.head_drop = nn.Dropout(drop_rate)
        self.fc = self._classifier(num_classes)
        self.feature_info = [dict(num_chs=w, reduction=2 ** i, module=f"stages.{i - 1}")
                             for i, w in enumerate(widths) if i > 0]

    def _classifier(self, num_classes: int) -> nn.Module:
        return (nn.Linear(self.num_features, num_classes, bias=self.classifier_bias)
                if num_classes > 0 else nn.Identity())

    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = global_pool
        self.fc = self._classifier(num_classes)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        return dict(stem=r"^stem", blocks=r"^stages\.(\d+)")

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        if enable:
            raise NotImplementedError("gradient checkpointing is not supported by this network")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        # A max pool over the whole map, not torch.amax: under torch.compile with bf16 autocast
        # on a CPU, amax's gradient came out NaN from the first step (torch 2.11 and 2.14;
        # eager and fp32 were right), and a compiled amax's gradient is wrong in fp16/bf16 on
        # CUDA too (pytorch/pytorch#186799).  Nor flatten(2).max(-1): its gradient reaches the
        # last BatchNorm and GELU in NCHW while their activations are channels_last, and their
        # backward in that mix took ten times as long, 4% of cifar_airbench's step on a 2-core
        # Xeon (benchmarks/BENCHMARKS.md, "The step, against the anchor's").  max_pool2d's
        # gradient keeps the input's layout.  Same values; ties send the gradient to one element.
        x = (F.max_pool2d(x, x.shape[-2:]).flatten(1) if self.global_pool == "max"
             else x.mean(dim=(2, 3)))
        x = self.head_drop(x)
        if pre_logits:
            return x
        x = self.fc(x)
        return x * self.logit_scale if self.logit_scale != 1.0 else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


class SmallImageConvNet(_SmallImageClassifier):
    """stem (3x3 conv at full resolution), then per group: 2x2 max pool, two 3x3 convs; global
    max pool; linear classifier."""

    def __init__(self, widths: tuple[int, ...] = (24, 48, 96, 192), num_classes: int = 10,
                 in_chans: int = 3, drop_rate: float = 0.0, global_pool: str = "max"):
        stem_width, *group_widths = widths
        groups, channels = [], stem_width
        for width in group_widths:
            groups.append(nn.Sequential(nn.MaxPool2d(2), *_conv_bn_act(channels, width),
                                        *_conv_bn_act(width, width)))
            channels = width
        super().__init__(nn.Sequential(*_conv_bn_act(in_chans, stem_width)),
                         nn.Sequential(*groups), tuple(widths), num_classes, drop_rate,
                         global_pool)


class _Residual(nn.Module):
    """x + two 3x3 conv-BatchNorm-ReLU layers of x (ResNet-9's residual block)."""

    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(*_conv_bn_act(width, width, nn.ReLU),
                                  *_conv_bn_act(width, width, nn.ReLU))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResNet9(_SmallImageClassifier):
    """David Page's ResNet-9 (myrtle.ai, "How to train your ResNet", 2018), as published: prep
    conv 64; layer 1: conv 128, max pool 2, residual block; layer 2: conv 256, max pool 2;
    layer 3: conv 512, max pool 2, residual block (each conv 3x3-BatchNorm-ReLU); global max
    pool; linear classifier without bias; logits scaled by 0.125 (Page's output scaling, which
    keeps the early softmax from saturating at his high learning rate).  Far more arithmetic than
    the cifar_convnet_* networks: for GPUs (Page's report: 94% on the original CIFAR-10 images in
    24 epochs)."""

    def __init__(self, num_classes: int = 10, in_chans: int = 3, drop_rate: float = 0.0,
                 global_pool: str = "max"):
        def layer(cin: int, cout: int, residual: bool) -> nn.Sequential:
            parts = [*_conv_bn_act(cin, cout, nn.ReLU), nn.MaxPool2d(2)]
            return nn.Sequential(*parts, _Residual(cout)) if residual else nn.Sequential(*parts)
        stages = nn.Sequential(layer(64, 128, True), layer(128, 256, False),
                               layer(256, 512, True))
        super().__init__(nn.Sequential(*_conv_bn_act(in_chans, 64, nn.ReLU)), stages,
                         (64, 128, 256, 512), num_classes, drop_rate, global_pool,
                         classifier_bias=False, logit_scale=0.125)


class _DiracConv(nn.Conv2d):
    """3x3 convolution, no bias, whose first `in_channels` filters start as the identity
    (torch's dirac_) and the rest as torch's default: airbench's initialization, which lets
    each new layer start by passing its input on, so a short run trains from the first step."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(in_channels, out_channels, 3, padding=1, bias=False)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            nn.init.dirac_(self.weight[:self.in_channels])


def _fixed_scale_bn(width: int) -> nn.BatchNorm2d:
    """BatchNorm whose scale stays 1 (not trained) and whose shift trains: airbench's setting
    (eps 1e-12 as there; the convolution before it is scale-free, so a trained scale only adds
    a direction that weight decay and the learning rate fight over)."""
    bn = nn.BatchNorm2d(width, eps=1e-12)
    bn.weight.requires_grad_(False)
    return bn


class AirbenchNet(_SmallImageClassifier):
    """Keller Jordan's airbench94 network (arXiv:2404.00498, airbench94.py), as published:
    a 2x2 convolution without padding (24 filters; airbench writes the whitened patches of the
    training images into it: --whiten-stem) and GELU; then three groups of 3x3 conv, 2x2 max
    pool, BatchNorm, GELU, 3x3 conv, BatchNorm, GELU (widths 64, 256, 256; convs start as
    identity on their first channels, BatchNorm scales fixed at 1); global max pool; linear
    classifier without bias; logits scaled by 1/9.  Pooling right after each group's first
    convolution puts most of the arithmetic in wide layers at small maps, which a CPU runs
    near its matmul speed (BENCHMARKS.md, "airbench's pieces on a CPU", has the figures)."""

    def __init__(self, widths: tuple[int, ...] = (24, 64, 256, 256), num_classes: int = 10,
                 in_chans: int = 3, drop_rate: float = 0.0, global_pool: str = "max"):
        stem_width, *group_widths = widths
        groups, channels = [], stem_width
        for width in group_widths:
            groups.append(nn.Sequential(
                _DiracConv(channels, width), nn.MaxPool2d(2), _fixed_scale_bn(width), nn.GELU(),
                _DiracConv(width, width), _fixed_scale_bn(width), nn.GELU()))
            channels = width
        stem = nn.Sequential(nn.Conv2d(in_chans, stem_width, 2, padding=0, bias=True), nn.GELU())
        super().__init__(stem, nn.Sequential(*groups), tuple(widths), num_classes, drop_rate,
                         global_pool, classifier_bias=False, logit_scale=1 / 9)


def _cfg(**kwargs) -> dict:
    return dict(num_classes=10, input_size=(3, 32, 32), pool_size=None, crop_pct=1.0,
                interpolation="bilinear", mean=_CIFAR_MEAN, std=_CIFAR_STD,
                first_conv="stem.0", classifier="fc", license="apache-2.0", **kwargs)


# timm's register_model reads this module-level name for each registered function's defaults.
# The networks this module registers (other programs know them only once accel_train is
# imported: model/saved.py and model_card.py say so).
NETWORKS = ("cifar_convnet_s", "cifar_convnet_m", "cifar_convnet_l", "cifar_resnet9",
            "cifar_airbench", "cifar_airbench_m", "cifar_airbench_s", "cifar_airbench_xs")
default_cfgs = generate_default_cfgs({name: _cfg() for name in NETWORKS})


def _create(variant: str, widths: tuple[int, ...], pretrained: bool, **kwargs) -> nn.Module:
    return build_model_with_cfg(SmallImageConvNet, variant, pretrained, widths=widths,
                                feature_cfg=dict(flatten_sequential=True), **kwargs)


@register_model
def cifar_convnet_s(pretrained: bool = False, **kwargs) -> nn.Module:
    """Widths 16-32-64-128: the fastest; for quick checks."""
    return _create("cifar_convnet_s", (16, 32, 64, 128), pretrained, **kwargs)


@register_model
def cifar_convnet_m(pretrained: bool = False, **kwargs) -> nn.Module:
    """Widths 24-48-96-192: the CPU recipe's network (recipes/cifar10-cpu-10min.yaml)."""
    return _create("cifar_convnet_m", (24, 48, 96, 192), pretrained, **kwargs)


@register_model
def cifar_convnet_l(pretrained: bool = False, **kwargs) -> nn.Module:
    """Widths 32-64-128-256: for longer CPU runs or a GPU."""
    return _create("cifar_convnet_l", (32, 64, 128, 256), pretrained, **kwargs)


@register_model
def cifar_resnet9(pretrained: bool = False, **kwargs) -> nn.Module:
    """Page's ResNet-9 (6.57 M parameters): the GPU recipe's network
    (recipes/cifar10-gpu.yaml)."""
    return build_model_with_cfg(ResNet9, "cifar_resnet9", pretrained,
                                feature_cfg=dict(flatten_sequential=True), **kwargs)


def _create_airbench(variant: str, widths: tuple[int, ...], pretrained: bool,
                     **kwargs) -> nn.Module:
    return build_model_with_cfg(AirbenchNet, variant, pretrained, widths=widths,
                                feature_cfg=dict(flatten_sequential=True), **kwargs)


@register_model
def cifar_airbench(pretrained: bool = False, **kwargs) -> nn.Module:
    """airbench94's network (1.97 M parameters): the CPU recipe's network
    (recipes/cifar10-cpu-10min.yaml), with --whiten-stem."""
    return _create_airbench("cifar_airbench", (24, 64, 256, 256), pretrained, **kwargs)


# Narrower airbench networks (the same layers, fewer channels after the whitened stem) for a
# machine on which a budget holds too few epochs of airbench's own: the CPU recipe falls back
# to them (--smaller-models).  A training step costs about 0.58, 0.28 and 0.20 of airbench's
# FLOPs (torch's FLOP counter).
@register_model
def cifar_airbench_m(pretrained: bool = False, **kwargs) -> nn.Module:
    """airbench's network at widths 48-192-192."""
    return _create_airbench("cifar_airbench_m", (24, 48, 192, 192), pretrained, **kwargs)


@register_model
def cifar_airbench_s(pretrained: bool = False, **kwargs) -> nn.Module:
    """airbench's network at widths 32-128-128."""
    return _create_airbench("cifar_airbench_s", (24, 32, 128, 128), pretrained, **kwargs)


@register_model
def cifar_airbench_xs(pretrained: bool = False, **kwargs) -> nn.Module:
    """airbench's network at widths 32-96-96."""
    return _create_airbench("cifar_airbench_xs", (24, 32, 96, 96), pretrained, **kwargs)
