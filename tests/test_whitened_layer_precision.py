"""--whiten-stem's layer computes in float32 under autocast, and a saved model rebuilds it so.

Oracles: plain torch's F.conv2d in float64 on the layer's own weights (what float32 must be near)
and the same F.conv2d under bf16 autocast (what it must not be); the saved folder read back
through timm's config.json layout."""

from __future__ import annotations

import json

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from accel_train.base.errors import UsageError
from accel_train.model.build import build_from_spec
from accel_train.model.saved import ModelSpec, write_model_folder
from accel_train.model.float32_convs import float32_layers
from accel_train.model.whitening import whiten_first_conv

BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


def _images(count: int = 40, size: int = 32) -> torch.Tensor:
    """Normalized images whose channels are correlated as photographs' are (the whitening then
    amplifies the weak directions, as on CIFAR-10)."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(count, 1, size, size, generator=generator)
    smooth = F.avg_pool2d(F.pad(base, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    return torch.cat([smooth, 0.9 * smooth + 0.1 * base, smooth - 0.05 * base], dim=1)


def _whitened_airbench() -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("cifar_airbench", num_classes=10)
    said = whiten_first_conv(model, _images(), bias_epochs=3)
    assert said.startswith("stem.0 (24 of 24 filters, computed in float32) whitened"), said
    with torch.no_grad():
        model.stem[0].bias.uniform_(-0.1, 0.1)   # a trained bias, not the zeros it starts at
    return model


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _worst_channel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest relative rms difference of one output channel: the finest, most amplified
    channels are where bf16 inputs and weights lose the most."""
    a, b = a.detach().double(), b.detach().double()
    return float(((a - b).square().mean(dim=(0, 2, 3)).sqrt()
                  / b.square().mean(dim=(0, 2, 3)).sqrt()).max())


def test_the_whitened_layer_computes_in_float32_under_bf16_autocast():
    model = _whitened_airbench()
    conv, x = model.stem[0], _images(8)
    exact = F.conv2d(x.double(), conv.weight.double(), conv.bias.double())
    with torch.autocast(**BF16):
        got = conv(x)
        bf16 = F.conv2d(x, conv.weight, conv.bias)    # what the layer would compute otherwise
    # Handed on in bf16, as the layers after it compute: off from the exact sums by the output's
    # own rounding only (bf16: at most 2**-9 of each value, about 0.2% rms), in every channel,
    # where bf16 arithmetic leaves its finest channels several per cent off.
    assert got.dtype == torch.bfloat16
    assert _worst_channel(got, exact) < 4e-3
    assert _worst_channel(bf16, exact) > 2e-2         # the oracle tells the two apart
    # Without autocast it is Conv2d's own forward, to the bit.
    assert torch.equal(conv(x), F.conv2d(x, conv.weight, conv.bias))
    # Its bias's gradient (the part of the layer that trains) is float32 arithmetic as well:
    # d/db of the sum of squared outputs is twice the outputs' sum per channel.
    bias = conv.bias.detach().clone().requires_grad_(True)
    with torch.autocast(**BF16):
        conv(x).square().sum().backward()
        F.conv2d(x, conv.weight, bias).square().sum().backward()
    exact_grad = 2 * exact.detach().sum(dim=(0, 2, 3))

    def worst(grad: torch.Tensor) -> float:   # the largest relative error of one channel's
        return float(((grad.double() - exact_grad).abs() / exact_grad.abs()).max())

    assert worst(conv.bias.grad) < 1e-2      # the outputs' bf16 rounding (0.35% here)
    assert worst(bias.grad) > 1.5e-2         # bf16 arithmetic (3.5% here)
    # The rest of the network still runs in bf16; the parameters keep their names.
    with torch.autocast(**BF16):
        assert model(x).dtype == torch.bfloat16
    assert list(model.state_dict()) == list(timm.create_model("cifar_airbench").state_dict())
    assert float32_layers(model) == ["stem.0"]


def test_a_convolution_subclass_keeps_its_own_forward():
    """timm's StdConv2d standardizes its weights in its forward: made a float32 Conv2d it would
    lose that, so a whitened subclass stays what it is (and the words do not say float32)."""
    from timm.layers import StdConv2d
    model = nn.Sequential(StdConv2d(3, 24, 2))
    said = whiten_first_conv(model, _images())
    assert said == ("0 (24 of 24 filters) whitened from the 2x2 patches of 40 training images; "
                    "its weights fixed")
    assert type(model[0]) is StdConv2d
    assert float32_layers(model) == []


def _spec(layers: list[str]) -> ModelSpec:
    return ModelSpec("cifar_airbench", 10, [str(i) for i in range(10)], 32, (0.5,) * 3,
                     (0.25,) * 3, float32_layers=layers)


def test_a_saved_model_rebuilds_its_float32_layers(tmp_path):
    """The spec's float32_layers travel through timm's config.json (our section) and the
    checkpoints' model_config.json; the rebuilt network computes them in float32 as the run did,
    with the same outputs as the trained module under bf16 autocast."""
    trained = _whitened_airbench().eval()
    folder = tmp_path / "model"
    write_model_folder(trained, folder, _spec(["stem.0"]))
    assert json.loads((folder / "config.json").read_text())["accel_train"][
        "float32_layers"] == ["stem.0"]
    for read in (ModelSpec.read(folder), ModelSpec.from_dict(json.loads(
            _spec(["stem.0"]).save(tmp_path).read_text()))):
        assert read.float32_layers == ["stem.0"]
        rebuilt = build_from_spec(read)
        rebuilt.load_state_dict(trained.state_dict())
        x = _images(4)
        with torch.no_grad(), torch.autocast(**BF16):
            assert type(rebuilt.stem[0]) is type(trained.stem[0])
            assert torch.equal(rebuilt.stem[0](x), trained.stem[0](x))
            assert torch.equal(rebuilt.eval()(x), trained(x))


def test_a_model_saved_before_float32_layers_rebuilds_plain(tmp_path):
    folder = tmp_path / "model"
    write_model_folder(timm.create_model("cifar_airbench", num_classes=10), folder, _spec([]))
    config = json.loads((folder / "config.json").read_text())
    del config["accel_train"]["float32_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    spec = ModelSpec.read(folder)
    assert spec.float32_layers == []
    with torch.autocast(**BF16):
        assert build_from_spec(spec).stem[0](_images(2)).dtype == torch.bfloat16


@pytest.mark.parametrize("layer", ["stem.9", "fc"])
def test_a_float32_layer_the_network_cannot_have_is_one_line(layer):
    with pytest.raises(UsageError, match=rf"^the model's layer '{layer}' is not a plain "
                       r"convolution .*copied from another run\?$"):
        build_from_spec(_spec([layer]))


# (a long value is cut at 40 characters: the line stays one line)
@pytest.mark.parametrize("layers, shown", [(5, "'5'"), ("stem.0", "'stem.0'"),
                                            ([0], "'[0]'"), ("x" * 99, repr("x" * 40))])
def test_float32_layers_that_are_not_a_list_of_names_are_one_line(layers, shown):
    with pytest.raises(UsageError) as raised:
        build_from_spec(_spec(layers))
    assert str(raised.value) == (f"the saved model's float32_layers is {shown}, not a list of "
                                 f"layer names; was the model's config copied from another run?")
