"""torchvision networks handed to fit() as modules: the builder that makes each is found (and no
builder for a network it does not make), recorded as the model's name, and eval, predict and
export rebuild the network through it.  Oracles: torchvision's own builders and plain torch."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch
import torchvision
from PIL import Image
from safetensors.torch import load_file
from torch import nn

import accel_train
from accel_train.model.saved import builder_makes_class
from accel_train.model.torchvision_models import torchvision_builder
from conftest import model_spec_of, run
from test_api import Squares


def shapes(model: nn.Module) -> dict:
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenet_v3_small", "googlenet"])
def test_the_builder_of_a_torchvision_network_is_found(name):
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, num_classes=3)
    assert torchvision_builder(model, 3, 64) == f"torchvision.models:{name}"


def test_a_new_head_of_the_builders_shape_is_the_builders_network():
    """The usual fine-tuning recipe: pretrained weights (here random ones), `fc` replaced."""
    model = torchvision.models.resnet34()
    model.fc = nn.Linear(model.fc.in_features, 5)
    assert torchvision_builder(model, 5, 64) == "torchvision.models:resnet34"


@pytest.mark.slow  # several ResNet-50s and -18s built: over 4 s
def test_networks_no_builder_makes_are_not_given_one():
    # a dilated ResNet-50 (a segmentation backbone): resnet50's shapes, other outputs
    dilated = torchvision.models.resnet50(num_classes=3,
                                          replace_stride_with_dilation=[False, True, True])
    assert shapes(dilated) == shapes(torchvision.models.resnet50(num_classes=3))
    assert torchvision_builder(dilated, 3, 64) is None
    # a head of another shape than the builder's, and another class count than the run's
    headed = torchvision.models.resnet18()
    headed.fc = nn.Sequential(nn.Dropout(0.2), nn.Linear(512, 3))
    assert torchvision_builder(headed, 3, 64) is None
    assert torchvision_builder(torchvision.models.resnet18(num_classes=4), 3, 64) is None

    class MyResNet(torchvision.models.ResNet):  # a subclass of the user's: not torchvision's
        pass
    mine = MyResNet(torchvision.models.resnet.BasicBlock, [2, 2, 2, 2], num_classes=3)
    assert torchvision_builder(mine, 3, 64) is None


def test_finding_the_builder_leaves_the_network_and_the_random_state_as_they_were():
    model = torchvision.models.resnet18(num_classes=3).train()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    random_state = torch.random.get_rng_state()
    assert torchvision_builder(model, 3, 32) == "torchvision.models:resnet18"
    assert model.training
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), random_state)


@pytest.mark.slow
def test_a_torchvision_module_fit_trained_is_rebuilt_by_predict_through_its_builder(tmp_path,
                                                                                     capsys):
    """fit() of resnet18 with a new head: no warning that the commands cannot rebuild it,
    the builder recorded as the model, and predict in a new process gives plain torchvision's
    softmax for the saved weights."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    model.fc = nn.Linear(512, 2)
    run_dir = accel_train.fit(model, Squares(64), Squares(16), batch_size=8, max_steps=2,
                              mixed_precision="no", channels_last=False, progress="log",
                              plots=False, output_dir=str(tmp_path / "run"))
    said = capsys.readouterr()
    assert "rebuild the network as" not in said.out + said.err
    assert "next: accel-train eval" in said.out + said.err
    spec = model_spec_of(run_dir)
    assert spec["model_name"] == "torchvision.models:resnet18"
    image = torch.full((16, 16, 3), 40, dtype=torch.uint8)
    image[5:11, 5:11] = 220
    Image.fromarray(image.numpy()).save(tmp_path / "square.png")
    predicted = run([sys.executable, "-m", "accel_train", "predict", str(run_dir),
                     str(tmp_path / "square.png"), "--json"], check=True)
    network = torchvision.models.resnet18(num_classes=2).eval()
    network.load_state_dict(load_file(str(run_dir / "model.safetensors")))
    mean, std = (torch.tensor(spec[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        expected = network((image.permute(2, 0, 1)[None].float() / 255 - mean) / std)
    expected = expected.softmax(-1)[0]
    top = json.loads(predicted.stdout.splitlines()[-1])["predictions"]
    assert [p["index"] for p in top] == expected.argsort(descending=True).tolist()
    assert [p["probability"] for p in top] == pytest.approx(
        expected.sort(descending=True).values.tolist(), abs=1e-5)


def fit_resnet18(tmp_path, name: str, **options):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=2)
    return accel_train.fit(model, Squares(16), Squares(8), batch_size=8, epochs=2,
                           mixed_precision="no", channels_last=False, augment=False,
                           progress="log", plots=False, output_dir=str(tmp_path / name),
                           **options)


@pytest.mark.slow
def test_a_checkpoint_that_recorded_the_torchvision_class_resumes_bit_identically(tmp_path):
    """Earlier versions recorded a torchvision module by its class
    (torchvision.models.resnet:ResNet): such a checkpoint resumes into the weights of the run
    that was never stopped, and the run then records the builder."""
    whole = fit_resnet18(tmp_path, "whole")

    class StopAfterFirstCheckpoint(accel_train.callbacks.Callback):
        def on_checkpoint(self, trainer, path):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit_resnet18(tmp_path, "halves", callbacks=[StopAfterFirstCheckpoint()])
    specs = list((tmp_path / "halves").rglob("model_config.json"))
    assert len(specs) == 1
    earlier = json.loads(specs[0].read_text())
    assert earlier["model_name"] == "torchvision.models:resnet18"
    specs[0].write_text(json.dumps({**earlier, "model_name": "torchvision.models.resnet:ResNet"}))
    # as that version wrote it: the manifest's checksum is of the file it holds
    manifest_path = specs[0].parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][specs[0].name] = {"sha256": hashlib.sha256(specs[0].read_bytes()).hexdigest(),
                                        "bytes": specs[0].stat().st_size}
    manifest_path.write_text(json.dumps(manifest))
    halves = fit_resnet18(tmp_path, "halves", resume="auto")
    a = load_file(str(whole / "model.safetensors"))
    b = load_file(str(halves / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert model_spec_of(halves)["model_name"] == "torchvision.models:resnet18"


def test_only_the_class_a_torchvision_builder_returns_is_its_earlier_name():
    assert builder_makes_class("torchvision.models:resnet18", "torchvision.models.resnet:ResNet")
    assert builder_makes_class("torchvision.models:vgg11", "torchvision.models.vgg:VGG")
    for builder, cls in [("torchvision.models:resnet18", "torchvision.models.vgg:VGG"),
                         ("torchvision.models:no_such_net", "torchvision.models.resnet:ResNet"),
                         ("resnet18", "torchvision.models.resnet:ResNet"),
                         ("torchvision.models:resnet18", "mypackage.nets:ResNet"),
                         ("torchvision.models:resnet18", "torchvision.models.resnet:BasicBlock")]:
        assert not builder_makes_class(builder, cls), (builder, cls)
