"""--aux-loss-weight: each auxiliary classifier's loss, times the weight, added to the training
loss of networks that return auxiliary logits in train mode (torchvision's Inception v3 and
GoogLeNet); refused for a network without any.  Oracles: a loss and a gradient computed by
hand, and torchvision's own networks' parameters."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torchvision
from safetensors.torch import load_file
from torch.utils.data import Dataset
from torchvision.models.inception import InceptionOutputs

import accel_train
from accel_train.base.errors import UsageError
from nets_with_output_objects import BiasAuxNet, OwnOutputs

LABELS = [0, 0, 0, 1, 1, 2, 3, 4]  # five classes, their shares 3/8, 2/8, 1/8, 1/8, 1/8


class Pictures(Dataset):
    def __len__(self):
        return len(LABELS)

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=generator), \
            LABELS[index]


LR = 0.1  # the first step's: no warmup
ONE_PLAIN_STEP = dict(batch_size=8, epochs=1, optimizer="momentum", momentum=0.0, learning_rate=LR,
                      weight_decay=0.0, label_smoothing=0.0, warmup_epochs=0, augment=False,
                      mixed_precision="no", num_workers=0, log_every=1)


def one_step(tmp_path, weight: float, name: str, outputs: type = InceptionOutputs):
    torch.manual_seed(0)
    model = BiasAuxNet(num_classes=5, outputs=outputs)
    run = accel_train.fit(model, Pictures(), Pictures(), aux_loss_weight=weight,
                          output_dir=str(tmp_path / name), **ONE_PLAIN_STEP)
    (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["type"] == "train"]
    return model, record


@pytest.mark.parametrize("outputs", [InceptionOutputs, OwnOutputs],
                         ids=["torchvision's", "a program's own"])
def test_the_auxiliary_loss_and_its_gradient_are_the_hand_computed_ones(tmp_path, outputs):
    """One plain SGD step on all eight images.  The auxiliary logits start at zero: their
    cross-entropy is ln 5 whatever the images, and the gradient of w times it with respect to
    the bias is w (1/5 - share of class c); with the weight 0 the bias gets no gradient.  A
    named tuple of the program's own, with the same fields, is taken as torchvision's is."""
    plain, plain_record = one_step(tmp_path, 0.0, "plain", outputs)
    weighted, record = one_step(tmp_path, 0.4, "weighted", outputs)
    assert torch.equal(plain.aux_bias, torch.zeros(5))  # never trained
    assert record["loss"] == pytest.approx(plain_record["loss"] + 0.4 * math.log(5), abs=2e-6)
    shares = np.bincount(LABELS) / len(LABELS)
    gradient = 0.4 * (1 / 5 - shares)
    np.testing.assert_allclose(weighted.aux_bias.detach().numpy(), -LR * gradient, rtol=1e-5,
                               atol=1e-8)
    # the logits' own head took the same step in both runs: the auxiliary loss reaches only
    # what the auxiliary logits come from
    assert torch.equal(plain.fc.weight, weighted.fc.weight)
    assert not hasattr(weighted, "accel_train_auxiliary_logits")  # the module given back


def test_a_network_without_auxiliary_logits_is_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError) as refused:
        accel_train.fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 5)),
                        Pictures(), aux_loss_weight=0.4, output_dir=str(tmp_path / "run"),
                        **{k: v for k, v in ONE_PLAIN_STEP.items() if k != "batch_size"})
    assert str(refused.value) == (
        "aux_loss_weight=0.4: model='torch.nn.modules.container:Sequential' returns no "
        "auxiliary logits in train mode (torchvision's inception_v3 and googlenet, built with "
        "aux_logits=True, do); drop the flag"), str(refused.value)


@pytest.mark.parametrize("weight", [0.0, 0.3])
def test_torchvisions_googlenet_trains_its_two_auxiliary_heads_only_when_weighted(tmp_path,
                                                                                  weight):
    """GoogLeNet from the command line's spelling: its auxiliary classifiers (aux1, aux2) leave
    their initial weights only with a weight; its main classifier trains either way."""
    run = tmp_path / "run"
    torch.manual_seed(0)
    accel_train.fit("torchvision.models:googlenet", Pictures(), Pictures(),
                    aux_loss_weight=weight, image_size=32, output_dir=str(run),
                    **{**ONE_PLAIN_STEP, "momentum": 0.0})
    trained = load_file(run / "model.safetensors")
    torch.manual_seed(0)  # the run builds its network from --seed 0 alone, as here
    start = torchvision.models.googlenet(num_classes=5, aux_logits=True, init_weights=True)
    start_state = start.state_dict()
    for head in ("aux1.fc2.weight", "aux2.fc2.weight"):
        assert torch.equal(trained[head], start_state[head]) == (weight == 0), head
    assert not torch.equal(trained["fc.weight"], start_state["fc.weight"])
