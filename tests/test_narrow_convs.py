"""Convolutions narrower than their stride compute in float32 (model/narrow_convs.py says why):
the rule picks exactly them, their weight gradients under CPU bf16 autocast then match float32's
(oracle: torch.nn.grad.conv2d_weight, and the same network without autocast), and a run on
8-px images in bf16 records them and trains."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from torch import nn

from accel_train.model.narrow_convs import narrower_than_stride, recording_input_widths
from accel_train.model.float32_convs import Float32Conv2d, compute_in_float32
from conftest import accel_train_here

# oneDNN's wrong columns come back in about a third of a lone convolution's backward passes and
# in about one in twenty of the network's (2-core AMD EPYC): these counts make a miss unlikely
# (< 1e-4 either way)
TRIALS = 40
NETWORK_TRIALS = 200


class SameConv(nn.Conv2d):
    """A Conv2d subclass with a forward of its own (as timm's Conv2dSame): never re-classed."""

    def forward(self, input):
        return super().forward(input)


def test_the_rule_picks_the_convolutions_whose_input_is_narrower_than_their_stride():
    model = nn.Sequential()
    model.add_module("wide", nn.Conv2d(8, 16, 3, stride=2, padding=1))     # 4 px -> 2 px
    model.add_module("still_wide", nn.Conv2d(16, 16, 3, stride=2, padding=1))  # 2 px: = stride
    model.add_module("narrow", nn.Conv2d(16, 16, 3, stride=2, padding=1))     # 1 px < 2
    model.add_module("pointwise", nn.Conv2d(16, 16, 1, stride=2))             # 1-px kernel
    model.add_module("stride_one", nn.Conv2d(16, 16, 3, padding=1))           # stride 1
    model.add_module("subclass", SameConv(16, 16, 3, stride=2, padding=1))    # own forward
    model.add_module("tall", nn.Conv2d(16, 16, (1, 3), stride=(1, 2), padding=(0, 1)))
    model.add_module("two_wide", nn.Conv2d(16, 16, 2, stride=2, padding=1))  # a 2-px kernel
    with recording_input_widths(model) as widths:
        model(torch.zeros(1, 8, 4, 4))
    assert widths == {"wide": 4, "still_wide": 2, "narrow": 1, "pointwise": 1, "stride_one": 1,
                      "subclass": 1, "tall": 1, "two_wide": 1}
    assert narrower_than_stride(model, widths) == ["narrow", "tall", "two_wide"]
    seen = dict(widths)
    model(torch.zeros(1, 8, 2, 2))   # narrower, after the block: not recorded (hooks removed)
    assert widths == seen
    with recording_input_widths(model) as widths:   # the narrowest of several forwards
        model(torch.zeros(1, 8, 8, 8))
        model(torch.zeros(1, 8, 4, 4))
    assert widths["wide"] == 4


def relative_error(got: torch.Tensor, oracle: torch.Tensor) -> float:
    """Norm-relative: a wrong column is NaN or 1e2-1e38 off; bf16's rounding of the
    gradient's inputs, well under a percent of its norm."""
    return ((got.double() - oracle).norm() / oracle.norm().clamp_min(1e-12)).nan_to_num(1e9).item()


def test_a_narrow_convolution_in_float32_has_the_right_weight_gradient_under_cpu_bf16():
    conv = nn.Conv2d(64, 96, 3, stride=2, padding=1, bias=False)
    with recording_input_widths(conv) as widths:
        conv(torch.zeros(1, 64, 1, 1))
    compute_in_float32(conv, narrower_than_stride(conv, widths))
    assert type(conv) is Float32Conv2d
    torch.manual_seed(0)
    for _ in range(TRIALS):
        conv.weight.grad = None
        x = torch.randn(4, 64, 1, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = conv(x)
        assert y.dtype == torch.bfloat16   # hands autocast's dtype on
        grad = torch.randn(y.shape)
        y.float().backward(grad)
        # what reaches the layer is the gradient rounded to its output's bf16
        oracle = torch.nn.grad.conv2d_weight(x.double(), conv.weight.shape,
                                             grad.bfloat16().double(), stride=2, padding=1)
        assert relative_error(conv.weight.grad, oracle) < 1e-5


@pytest.mark.slow
def test_every_convolution_of_a_resnet_at_8_px_has_the_right_weight_gradient_in_bf16():
    """The network a run at 8 px trains, in CPU bf16 autocast: each convolution's weight
    gradient against torch.nn.grad.conv2d_weight in float64 on the input and output gradient
    the layer itself saw (a per-layer oracle: the whole network's gradients in bf16 and fp32
    differ by more than rounding at a batch of 4, through its BatchNorms)."""
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=2).eval()
    with recording_input_widths(model) as widths:
        with torch.no_grad():
            model(torch.zeros(1, 3, 8, 8))
    narrow = narrower_than_stride(model, widths)
    assert narrow == ["layer3.0.conv2", "layer4.0.conv1"]
    compute_in_float32(model, narrow)
    model.train()
    convs = {name: m for name, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    seen = {}

    def keep(name):
        def hook(module, inputs, output):
            seen[name] = [inputs[0].detach()]
            output.register_hook(lambda grad: seen[name].append(grad.detach()))
        return hook
    handles = [m.register_forward_hook(keep(name)) for name, m in convs.items()]
    for trial in range(NETWORK_TRIALS):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(torch.randn(4, 3, 8, 8)).float(),
                                               torch.tensor([0, 1, 0, 1]))
        loss.backward()
        for name, conv in convs.items():
            x, grad_output = seen[name]
            if name not in narrow:   # the layer computed on its input rounded to bf16
                x = x.bfloat16()
            oracle = torch.nn.grad.conv2d_weight(
                x.double(), conv.weight.shape, grad_output.double(), stride=conv.stride,
                padding=conv.padding, dilation=conv.dilation, groups=conv.groups)
            assert relative_error(conv.weight.grad, oracle) < 0.02, (trial, name)
    for handle in handles:
        handle.remove()


@pytest.mark.slow
def test_a_bf16_run_on_8_px_images_records_its_float32_layers_and_trains(tmp_path):
    """Before, such a run stopped at its first step with NaN weights in about half its
    starts; the saved model records the layers, so eval rebuilds them as trained."""
    run = tmp_path / "run"
    result = accel_train_here("--dataset", "synthetic", "--synthetic-train-size", "64",
                              "--max-eval-samples", "16", "--image-size", "8",
                              "--model", "test_resnet", "--batch-size", "8", "--max-steps", "6",
                              "--mixed-precision", "bf16", "--no-plots", "--output-dir", str(run))
    assert result.returncode == 0, result.stderr[-2000:]
    saved = json.loads((run / "config.json").read_text())
    assert saved["accel_train"]["float32_layers"] == ["layer3.0.conv2", "layer4.0.conv1"]
    assert accel_train_here("eval", str(run)).returncode == 0
