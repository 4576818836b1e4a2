"""Networks from outside timm.  Those whose forward returns an object holding the logits
(Hugging Face transformers' ModelOutput, torchvision's Inception named tuple) train, evaluate,
predict and export on their logits, through fit() and through a factory on the command line,
on one process and under DDP; a program's module comes back from fit() returning what it
returned before.  A transformers model handed to fit() is rebuilt from the config the run
records: resume, predict and export need no factory."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file
from torch import nn
from torchvision.models.googlenet import GoogLeNetOutputs
from torchvision.models.inception import InceptionOutputs

import accel_train
import accel_train.callbacks
from accel_train.base.errors import UsageError
from accel_train.model.build import create_model, native_image_size
from accel_train.model.outputs import logits_from
from accel_train.model.transformers_models import transformers_classifier, transformers_config_of
from conftest import REPO, accel_train_here, launched_program, model_spec_of, run
from conftest import test_env as child_env
from nets_with_output_objects import AuxHeadNet, tiny_hf_resnet, tiny_hf_vit
from test_api import Squares

TESTS = str(REPO / "tests")
# transformers is imported inside the tests that name its classes (nets_with_output_objects.py
# says why)


def test_the_logits_are_found_in_each_kind_of_output():
    from transformers.modeling_outputs import ImageClassifierOutputWithNoAttention
    logits, aux = torch.randn(2, 3), torch.randn(2, 3)
    assert logits_from(logits) is logits
    assert logits_from(ImageClassifierOutputWithNoAttention(logits=logits)) is logits
    assert logits_from(InceptionOutputs(logits, aux)) is logits
    assert logits_from(GoogLeNetOutputs(logits, aux, aux)) is logits
    assert logits_from({"logits": logits, "features": aux}) is logits  # a program's own dict
    # what holds no logits tensor is handed back, for the first-forward check to name
    pair = (logits, aux)
    assert logits_from(pair) is pair
    empty = ImageClassifierOutputWithNoAttention(logits=None)
    assert logits_from(empty) is empty
    features = {"features": aux}
    assert logits_from(features) is features


class LogitsOf(nn.Module):
    """The hand-written adapter a user would otherwise write: forward returns `.logits`."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = network

    def forward(self, images):
        return self.network(images).logits


def fit_on_squares(tmp_path, name, model, **options):
    return accel_train.fit(model, Squares(64), Squares(16), batch_size=8, epochs=2,
                           mixed_precision="no", channels_last=False, progress="log",
                           plots=False, output_dir=str(tmp_path / name), **options)


def test_fit_trains_a_transformers_model_as_the_adapter_that_returns_its_logits(tmp_path):
    from transformers.modeling_outputs import ImageClassifierOutputWithNoAttention
    torch.manual_seed(0)
    model = tiny_hf_resnet(num_classes=2)
    adapted = LogitsOf(copy.deepcopy(model))
    initial = copy.deepcopy(model.state_dict())
    fit_on_squares(tmp_path, "output-object", model)
    fit_on_squares(tmp_path, "adapter", adapted)
    trained, oracle = model.state_dict(), adapted.network.state_dict()
    assert all(torch.equal(trained[k], oracle[k]) for k in oracle)
    assert max(float((trained[k].float() - initial[k].float()).abs().max()) for k in initial) > 1e-3
    records = [json.loads(line) for line in
               (tmp_path / "output-object" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r.get("type") == "epoch"]
    assert len(epochs) == 2 and epochs[-1]["eval_count"] == 16
    # the program gets its module back as it was: calls return the transformers output again
    assert isinstance(model(torch.zeros(1, 3, 16, 16)), ImageClassifierOutputWithNoAttention)


class DictOf(LogitsOf):
    """A program's own forward returning a dict with a "logits" entry beside others."""

    def forward(self, images):
        return {"logits": self.network(images).logits, "pooled": images.mean((2, 3))}


def test_fit_trains_a_module_returning_a_dict_as_the_adapter_that_returns_its_logits(tmp_path):
    torch.manual_seed(0)
    network = tiny_hf_resnet(num_classes=2)
    as_dict, adapted = DictOf(copy.deepcopy(network)), LogitsOf(copy.deepcopy(network))
    fit_on_squares(tmp_path, "dict", as_dict)
    fit_on_squares(tmp_path, "adapter", adapted)
    trained, oracle = as_dict.network.state_dict(), adapted.network.state_dict()
    assert all(torch.equal(trained[k], oracle[k]) for k in oracle)
    assert set(as_dict(torch.zeros(1, 3, 16, 16))) == {"logits", "pooled"}  # given back as it was


def test_a_refused_fit_gives_the_module_back_as_it_was(tmp_path):
    from transformers.modeling_outputs import ImageClassifierOutputWithNoAttention
    model = tiny_hf_resnet(num_classes=2)
    with pytest.raises(UsageError, match="layer_decay=0.7"):
        fit_on_squares(tmp_path, "refused", model, layer_decay=0.7)
    assert isinstance(model(torch.zeros(1, 3, 16, 16)), ImageClassifierOutputWithNoAttention)


def test_a_transformers_network_built_for_another_size_is_told_its_own():
    """The size to try is the one the network's config was built for, not timm's 224."""
    from transformers import ViTConfig, ViTForImageClassification
    assert native_image_size(tiny_hf_vit(image_size=48)) == 48
    assert native_image_size(ViTForImageClassification(ViTConfig(image_size=(40, 40),
                                                                  hidden_size=8,
                                                                  num_hidden_layers=1,
                                                                  num_attention_heads=2,
                                                                  intermediate_size=8))) == 40
    assert native_image_size(timm.create_model("resnet18", pretrained=False)) == 224
    assert native_image_size(timm.create_model("test_vit", pretrained=False)) == \
        timm.get_pretrained_cfg("test_vit").input_size[-1]
    assert native_image_size(nn.Linear(2, 2)) == 224
    with pytest.raises(UsageError) as refused:
        accel_train.fit(tiny_hf_vit(num_classes=2, image_size=32), Squares(8), batch_size=8,
                        epochs=1, mixed_precision="no", plots=False)
    assert str(refused.value).startswith(
        "image_size=16 does not work with transformers.models.vit.modeling_vit:"
        "ViTForImageClassification (ValueError: Input image size (16*16) doesn't match model "
        "(32*32).); try image_size=32")


def test_a_transformers_model_resumes_bit_identically_from_its_recorded_config(tmp_path):
    torch.manual_seed(0)
    initial = tiny_hf_resnet(num_classes=2)
    whole = copy.deepcopy(initial)
    fit_on_squares(tmp_path, "whole", whole)

    class StopAfterFirstCheckpoint(accel_train.callbacks.Callback):
        def on_checkpoint(self, trainer, path):
            raise KeyboardInterrupt  # a user's Ctrl-C right after the checkpoint

    with pytest.raises(KeyboardInterrupt):
        fit_on_squares(tmp_path, "halves", copy.deepcopy(initial),
                       callbacks=[StopAfterFirstCheckpoint()])
    steps = []

    class Steps(accel_train.callbacks.Callback):
        def on_step_end(self, trainer, step):
            steps.append(step)

    resumed = copy.deepcopy(initial)
    fit_on_squares(tmp_path, "halves", resumed, resume="auto", callbacks=[Steps()])
    assert steps == list(range(9, 17))  # the second epoch's 8 steps: it resumed
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(),
                                                 resumed.state_dict().values()))
    recorded = json.loads((tmp_path / "halves" / "config.json").read_text())["model_args"]
    assert recorded["transformers_config"]["hidden_sizes"] == [8, 16]


HF_RESNET = "transformers.models.resnet.modeling_resnet:ResNetForImageClassification"


class ConfigOfItsOwn(nn.Linear):
    """A user's network with a `config` attribute of its own: not a transformers model."""

    class Settings:
        def to_json_string(self, use_diff=True):
            return "{}"

    def __init__(self):
        super().__init__(2, 2)
        self.config = self.Settings()


class ClassWithoutConfig(nn.Linear):
    config_class = dict  # the attribute alone, and no config

    def __init__(self):
        super().__init__(2, 2)


def test_only_a_transformers_model_has_its_config_recorded_with_every_field():
    from transformers import ResNetConfig
    recorded = transformers_config_of(tiny_hf_resnet(num_classes=3))
    assert (len(recorded["id2label"]), recorded["hidden_sizes"]) == (3, [8, 16])
    # fields left at their defaults too (a later transformers may change a default): the
    # model's own and the generic ones (return_dict decides what its forward returns)
    assert recorded["hidden_act"] == ResNetConfig().hidden_act
    assert recorded["return_dict"] is True and "output_hidden_states" in recorded
    for other in (nn.Linear(2, 2), timm.create_model("test_resnet"), ConfigOfItsOwn(),
                  ClassWithoutConfig()):
        assert transformers_config_of(other) is None


def test_a_transformers_classifier_is_the_head_named_classifier_of_a_transformers_model():
    model = tiny_hf_resnet(num_classes=3)
    assert transformers_classifier(model) is model.classifier
    mine = nn.Sequential()
    mine.classifier = nn.Linear(2, 2)  # a head by that name, on a network of one's own
    assert transformers_classifier(mine) is None
    del model.classifier  # a transformers model without that head
    assert transformers_classifier(model) is None
    model.classifier = "not a module"
    assert transformers_classifier(model) is None


def test_a_transformers_model_trains_its_classifier_alone_with_the_backbone_frozen(tmp_path):
    """--freeze-backbone finds a transformers model's head by its name, `classifier`: only its
    weights move, the backbone's (BatchNorm statistics too) stay as they were."""
    torch.manual_seed(0)
    model = tiny_hf_resnet(num_classes=2)
    initial = copy.deepcopy(model.state_dict())
    fit_on_squares(tmp_path, "frozen", model, freeze_backbone=True)
    moved = {k for k, v in model.state_dict().items() if not torch.equal(v, initial[k])}
    assert moved == {"classifier.1.weight", "classifier.1.bias"}


def test_a_transformers_head_for_another_class_count_is_told_num_labels(tmp_path):
    with pytest.raises(UsageError) as refused:
        fit_on_squares(tmp_path, "ten", tiny_hf_resnet(num_classes=10))
    assert str(refused.value) == (
        f"model='{HF_RESNET}' maps a [1, 3, 16, 16] batch of images to a tensor of shape "
        f"[1, 10], not to [1, 2] logits (one per class of the data); build it with "
        f"num_labels=2 (from_pretrained(..., num_labels=2, ignore_mismatched_sizes=True) "
        f"replaces a pretrained head)")


def test_a_from_pretrained_model_without_mean_and_std_is_told_its_processors(tmp_path, capsys):
    """A model loaded by from_pretrained learned from its image processor's normalization,
    which the run cannot read: it says so unless mean= and std= are given; a model built from
    a config (no weights loaded) is not told."""
    from transformers import AutoModelForImageClassification
    tiny_hf_resnet(num_classes=2).save_pretrained(tmp_path / "saved")
    said = {}
    for name, loaded, options in (
            ("loaded", True, {}), ("loaded-mean-only", True, {"mean": 0.5}),
            ("given", True, {"mean": 0.5, "std": 0.5}), ("built", False, {})):
        model = (AutoModelForImageClassification.from_pretrained(str(tmp_path / "saved"))
                 if loaded else tiny_hf_resnet(num_classes=2))
        capsys.readouterr()
        fit_on_squares(tmp_path, name, model, max_steps=1, **options)
        out = capsys.readouterr()
        said[name] = out.out + out.err
    line = (f"the model was loaded from '{tmp_path / 'saved'}', whose weights learned from "
            f"images its image processor normalized; without mean= and std= the run normalizes "
            f"with the training images' statistics: pass the processor's, AutoImageProcessor."
            f"from_pretrained('{tmp_path / 'saved'}').image_mean and .image_std")
    assert line in said["loaded"] and line in said["loaded-mean-only"]
    assert "whose weights learned" not in said["given"] + said["built"]
    # rebuilt from its recorded config, so the last line offers eval and predict
    assert "rebuild the network as" not in said["built"]
    assert f"next: accel-train eval {tmp_path / 'built'} --data-dir DATA  |" in said["built"]
    # where the weights came from stays on this machine: the recorded config does not carry it
    models = [json.loads(p.read_text()) for p in (tmp_path / "given").rglob("config.json")]
    assert models
    for recorded in models:
        config = recorded["model_args"]["transformers_config"]
        assert config["hidden_sizes"] == [8, 16] and "_name_or_path" not in config
    run_files = [p for p in (tmp_path / "given").rglob("*") if p.suffix in (".json", ".yaml")]
    assert run_files and not [p for p in run_files if str(tmp_path / "saved") in p.read_text()]


def test_a_transformers_class_is_built_from_a_recorded_config_and_returns_its_logits():
    recorded = {"num_labels": 3, "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1]}
    built = create_model(HF_RESNET, 3, model_args={"transformers_config": recorded})
    assert (built.config.hidden_sizes, built.config.num_labels) == ([8, 16], 3)
    assert built(torch.zeros(2, 3, 16, 16)).shape == (2, 3)  # the logits tensor
    with pytest.raises(UsageError) as refused:
        create_model(HF_RESNET, 3, model_args={"transformers_config": {"embedding_size": -1}})
    assert str(refused.value).startswith(
        f"--model {HF_RESNET}: building it from the config the run recorded raised "
        f"RuntimeError: ")
    assert str(refused.value).endswith(
        "; use the transformers version that trained it (config.json's "
        "model_args.transformers_config holds the config)")
    # a config.json edited by hand into something that is no config at all: the same one line
    for damaged in ("not a config", [1, 2]):
        with pytest.raises(UsageError, match=r"building it from the config the run recorded"):
            create_model(HF_RESNET, 3, model_args={"transformers_config": damaged})


@pytest.mark.slow
def test_a_transformers_model_fit_trained_is_rebuilt_by_predict_from_its_config(tmp_path,
                                                                              monkeypatch):
    """No factory: a new process rebuilds the class from the recorded config, and so does the
    export's model card's snippet.  Oracle: the saved weights in the network built here, in
    plain torch."""
    torch.manual_seed(0)
    run_dir = fit_on_squares(tmp_path, "run", tiny_hf_resnet(num_classes=2))
    image = torch.full((16, 16, 3), 40, dtype=torch.uint8)
    image[5:11, 5:11] = 220
    Image.fromarray(image.numpy()).save(tmp_path / "square.png")
    predicted = run([sys.executable, "-m", "accel_train", "predict", str(run_dir),
                     str(tmp_path / "square.png"), "--json"], check=True)
    spec = model_spec_of(run_dir)
    network = tiny_hf_resnet(num_classes=2).eval()
    network.load_state_dict(load_file(str(run_dir / "model.safetensors")))
    mean, std = (torch.tensor(spec[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    normalized = (image.permute(2, 0, 1)[None].float() / 255 - mean) / std
    with torch.no_grad():
        expected = network(normalized).logits.softmax(-1)[0]
    top = json.loads(predicted.stdout.splitlines()[-1])["predictions"]
    assert [p["index"] for p in top] == expected.argsort(descending=True).tolist()
    assert [p["probability"] for p in top] == pytest.approx(
        expected.sort(descending=True).values.tolist(), abs=1e-5)
    # the card's snippet, run as a reader would (from the folder beside the export)
    run([sys.executable, "-m", "accel_train", "export", str(run_dir), "-o",
         str(tmp_path / "exported")], check=True)
    card = (tmp_path / "exported" / "README.md").read_text()
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(snippet, namespace)
    with torch.no_grad():
        assert torch.equal(namespace["model"](normalized).logits, network(normalized).logits)


def train_on_synthetic(output_dir, *extra: str, launcher=None, batch_size=16,
                       in_process=False):
    """`in_process`: one process's run called here (the network imported from tests/, which
    is on this process's path), without a new process's seconds of imports."""
    options = ["--model", "nets_with_output_objects:" + extra[0], "--synthetic-train-size",
               "128", "--max-steps", "4", "--epochs", "1", "--no-plots", "--mixed-precision",
               "no", "--no-channels-last", "--no-augment", "--num-workers", "0",
               "--batch-size", str(batch_size), "--output-dir", str(output_dir), *extra[1:]]
    if in_process:
        return accel_train_here(*options, check=True)
    command = (launched_program(launcher, "accel_train", *options) if launcher else
               [sys.executable, "-m", "accel_train", *options])
    return run(command, env=child_env(PYTHONPATH=TESTS), check=True)


@pytest.mark.slow
def test_a_transformers_factory_predicts_and_exports_its_logits(tmp_path):
    """--model package.module:factory building a transformers classifier: its ONNX export
    predicts plain torch's softmax of `.logits` for the saved weights."""
    # (each command in this process, the factory's module imported from tests/ on its path;
    # the test above runs a new process, which rebuilds the network from the run's record)
    train_on_synthetic(tmp_path / "run", "tiny_hf_resnet", in_process=True)
    image = (torch.rand(32, 32, 3) * 255).to(torch.uint8)
    Image.fromarray(image.numpy()).save(tmp_path / "image.png")
    accel_train_here("export", str(tmp_path / "run"), "--format", "onnx", "--output",
                     str(tmp_path / "exported"), check=True)
    spec = model_spec_of(tmp_path / "run")
    network = tiny_hf_resnet(spec["num_classes"]).eval()
    network.load_state_dict(load_file(str(tmp_path / "run" / "model.safetensors")))
    mean, std = (torch.tensor(spec[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        normalized = (image.permute(2, 0, 1)[None].float() / 255 - mean) / std
        expected = network(normalized).logits.softmax(-1)[0]
    # (export rebuilt the network through the factory; predict of a run folder rebuilds it
    # the same way: the fit() test above runs that)
    predicted = accel_train_here("predict", str(tmp_path / "exported" / "model.onnx"),
                                 str(tmp_path / "image.png"), "--json", "--top-k", "3",
                                 check=True)
    top = json.loads(predicted.stdout.splitlines()[-1])["predictions"]
    assert [p["index"] for p in top] == expected.argsort(descending=True)[:3].tolist()
    assert [p["probability"] for p in top] == pytest.approx(
        expected.sort(descending=True).values[:3].tolist(), abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("weight", ["0", "0.4"])
def test_an_auxiliary_head_trains_under_ddp_as_on_one_process(tmp_path, weight):
    """A network returning (logits, aux_logits) in train mode, as Inception does: DDP would
    wait for the auxiliary head's gradients if it saw its output.  Two processes under
    torchrun train the weights of one process with the same global batch; the auxiliary
    head keeps its initial weights where no loss reaches it, and trains alike in both with
    --aux-loss-weight."""
    extra = ("AuxHeadNet", "--aux-loss-weight", weight)
    train_on_synthetic(tmp_path / "one", *extra, batch_size=16, in_process=True)
    train_on_synthetic(tmp_path / "two", *extra, launcher="torchrun", batch_size=8)
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "model.safetensors"))
    for key in one:
        assert torch.allclose(one[key], two[key], rtol=1e-5, atol=1e-6), key
    torch.manual_seed(0)  # the run's initial weights: a function of --seed (0) alone
    initial = AuxHeadNet(num_classes=10).state_dict()
    assert all(torch.equal(one[k], initial[k]) == (weight == "0") for k in ("aux.weight",
                                                                             "aux.bias"))
    assert float((one["fc.weight"] - initial["fc.weight"]).abs().max()) > 1e-4
