"""`accel-train export` as the ecosystem opens it: a small network trained on real CIFAR-10,
exported with --format onnx, then loaded by timm (`local-dir:`, in a fresh process with nothing
of ours but `import accel_train`), by transformers' image-classification pipeline and by ONNX
Runtime, each fed real held-out images with its own preprocessing and compared with `accel-train
predict` (same top-1, probabilities within 1e-4).  The model card's numbers are compared with
`accel-train eval` and the run's metrics.jsonl; bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image

from conftest import PINNED, accel_train_here
from conftest import test_env as child_env

pytestmark = pytest.mark.slow  # trains on the real CIFAR-10

TOLERANCE = 1e-4
IMAGES = 8  # real held-out images compared


@pytest.fixture(scope="module")
def run_dir(real_cifar10, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export_formats") / "run"
    # --whiten-stem: its first layer computes in float32 under autocast, a layer the export's
    # readers (timm, transformers, ONNX Runtime) build as the plain convolution it is in fp32
    accel_train_here("--data-dir", str(real_cifar10), "--max-train-samples", "256",
                     "--max-eval-samples", "64", "--model", "cifar_convnet_s", "--whiten-stem",
                     "--batch-size", "32", "--max-steps", "3", "--progress", "log", "--no-plots",
                     *PINNED, "--output-dir", str(out), check=True)
    return out


@pytest.fixture(scope="module")
def export_dir(run_dir) -> Path:
    out = run_dir.parent / "exports" / "cifar-small"  # exports/ does not exist yet
    accel_train_here("export", str(run_dir), "-o", str(out), "--format", "onnx", check=True)
    return out


@pytest.fixture(scope="module")
def images(real_cifar10, tmp_path_factory) -> list[Path]:
    """The first held-out (test split) images of the real CIFAR-10, as the JPEG files they are."""
    import pyarrow.parquet as pq
    folder = tmp_path_factory.mktemp("held_out_images")
    rows = pq.read_table(real_cifar10 / "test.parquet").slice(0, IMAGES).to_pylist()
    paths = []
    for index, row in enumerate(rows):
        paths.append(folder / f"{index}.jpg")
        paths[-1].write_bytes(row["img"]["bytes"])
    return paths


def predict_probabilities(model: Path, images: list[Path]) -> np.ndarray:
    """accel-train predict's probabilities, one row per image, columns in class order."""
    result = accel_train_here("predict", str(model), *map(str, images), "--json", "--top-k",
                              "10", check=True)
    rows = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [row["image"] for row in rows] == [str(p) for p in images]
    table = np.zeros((len(rows), 10))
    for i, row in enumerate(rows):
        for entry in row["predictions"]:
            table[i, entry["index"]] = entry["probability"]
    return table


@pytest.fixture(scope="module")
def predicted(export_dir, images) -> np.ndarray:
    return predict_probabilities(export_dir, images)


# timm and transformers in a fresh process: only `import accel_train` (registering the network).
ECOSYSTEM = """
import json, sys
import accel_train
import timm, torch
from PIL import Image
from transformers import pipeline
folder, images = sys.argv[1], sys.argv[2:]
model = timm.create_model("local-dir:" + folder, pretrained=True).eval()
transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
batch = torch.stack([transform(Image.open(p).convert("RGB")) for p in images])
with torch.no_grad():
    timm_probs = model(batch).softmax(dim=1).tolist()
classify = pipeline("image-classification", model=folder, device="cpu")
pipe = [{r["label"]: r["score"] for r in classify(p, top_k=model.num_classes)} for p in images]
labels = model.pretrained_cfg["label_names"]
print(json.dumps({"timm": timm_probs, "pipeline": pipe, "labels": labels,
                  "state": {k: v.tolist() for k, v in model.state_dict().items() if "fc" in k}}))
"""


@pytest.fixture(scope="module")
def ecosystem(export_dir, images) -> dict:
    result = subprocess.run([sys.executable, "-c", ECOSYSTEM, str(export_dir), *map(str, images)],
                            capture_output=True, text=True, timeout=300, env=child_env())
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def agree(probabilities: np.ndarray, predicted: np.ndarray) -> float:
    assert (probabilities.argmax(axis=1) == predicted.argmax(axis=1)).all()
    worst = float(np.abs(probabilities - predicted).max())
    print(f"max |probability difference| {worst:.2e}")
    assert worst <= TOLERANCE
    return worst


def test_the_folder_is_timms_format_with_the_runs_preprocessing(run_dir, export_dir):
    files = sorted(p.name for p in export_dir.iterdir())
    assert files == ["README.md", "config.json", "model.onnx", "model.safetensors",
                     "preprocessing.json"]
    assert not list(export_dir.parent.glob(".*"))  # no staging folder left beside it
    config = json.loads((export_dir / "config.json").read_text())
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())["resolved"]["model"]
    assert config["architecture"] == "cifar_convnet_s" and config["num_classes"] == 10
    assert config["label_names"] == recorded["class_names"]
    cfg = config["pretrained_cfg"]
    assert cfg["input_size"] == [3, 32, 32] and cfg["crop_pct"] == 1.0
    assert cfg["mean"] == recorded["mean"] and cfg["std"] == recorded["std"]
    assert config["accel_train"]["tta"] == "none" and config["accel_train"]["weights"] == "model"
    # the command as config.yaml records it: the command line this process called (cli.main
    # with the fixture's arguments), as a user would type it, not pytest's own argv
    command = config["accel_train"]["command"]
    assert command == yaml.safe_load((run_dir / "config.yaml").read_text())["command"]
    assert command[0] == "accel-train" and command[-2:] == ["--output-dir", str(run_dir)]
    assert command[1] == "--data-dir" and "--whiten-stem" in command
    # The run's own final model is the same format, and eval/predict read both.
    assert json.loads((run_dir / "config.json").read_text())["pretrained_cfg"] == cfg


def test_timm_local_dir_builds_the_trained_model(run_dir, ecosystem, predicted):
    from safetensors.torch import load_file
    trained = load_file(str(run_dir / "model.safetensors"))
    for name, values in ecosystem["state"].items():
        assert torch.equal(torch.tensor(values), trained[name])
    agree(np.array(ecosystem["timm"]), predicted)


def test_transformers_pipeline_agrees_with_predict(ecosystem, predicted):
    labels = ecosystem["labels"]
    probabilities = np.array([[row[name] for name in labels] for row in ecosystem["pipeline"]])
    agree(probabilities, predicted)


def test_onnx_runtime_agrees_with_predict(export_dir, images, predicted):
    import onnxruntime
    session = onnxruntime.InferenceSession(str(export_dir / "model.onnx"),
                                           providers=["CPUExecutionProvider"])
    assert isinstance(session.get_inputs()[0].shape[0], str)  # a named, dynamic batch dimension
    prep = json.loads((export_dir / "preprocessing.json").read_text())
    mean, std = np.array(prep["mean"], np.float32), np.array(prep["std"], np.float32)
    pixels = np.stack([np.asarray(Image.open(p).convert("RGB"), np.float32) / 255
                       for p in images])                       # 32x32 already: no resize
    batch = ((pixels - mean) / std).transpose(0, 3, 1, 2).astype(np.float32)
    for part in (batch, batch[:1]):
        logits = session.run(None, {prep["input"]: part})[0]
        probabilities = torch.from_numpy(logits).double().softmax(dim=1).numpy()
        agree(probabilities, predicted[:len(part)])
    agree(predict_probabilities(export_dir / "model.onnx", images), predicted)


def test_an_export_in_the_format_before_still_predicts(run_dir, export_dir, images, predicted,
                                                       tmp_path):
    """model.safetensors + model_config.json, the spec as the run's config.yaml records it
    (what that file held)."""
    old = tmp_path / "old_export"
    old.mkdir()
    (old / "model.safetensors").write_bytes((export_dir / "model.safetensors").read_bytes())
    spec = yaml.safe_load((run_dir / "config.yaml").read_text())["resolved"]["model"]
    (old / "model_config.json").write_text(json.dumps(spec))
    assert np.array_equal(predict_probabilities(old, images), predicted)


def eval_json(run_dir: Path, tta: str) -> dict:
    result = accel_train_here("eval", str(run_dir), "--tta", tta, "--mixed-precision", "no",
                              "--json", check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_model_card_renders_the_runs_numbers(run_dir, export_dir):
    text = (export_dir / "README.md").read_text()
    _, header, body = text.split("---\n", 2)
    meta = yaml.safe_load(header)
    assert meta["library_name"] == "timm" and meta["pipeline_tag"] == "image-classification"
    # a local --data-dir is no Hub dataset id: named in the text and model-index, not datasets:
    assert "timm" in meta["tags"] and "datasets" not in meta
    assert meta["model-index"][0]["results"][0]["dataset"] == {
        "type": "custom", "name": "cifar10", "split": "held-out"}
    assert "## Training data\n\na local folder, `cifar10`;" in body
    assert meta["metrics"] == ["accuracy"]
    headings = [line for line in body.splitlines() if line.startswith("#")]
    assert headings == ["# cifar-small", "## Model details", "## Training data", "## Training",
                        "## Evaluation", "## How to use"]
    epoch = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"epoch"' in line][-1]
    rows = {line.split("|")[1].strip().split()[0]: [c.strip() for c in line.split("|")[2:5]]
            for line in body.splitlines() if line.startswith("| none") or line.startswith("| flip")}
    for tta in ("none", "flip"):
        measured = eval_json(run_dir, tta)
        assert rows[tta] == [f"{measured['top1']:.2%}", f"{measured['top5']:.2%}",
                             str(measured["count"])]
    assert rows["none"][0] == f"{epoch['eval_top1']:.2%}"  # the run trained with --tta none
    scores = meta["model-index"][0]["results"][0]["metrics"]
    assert scores[0]["value"] == round(epoch["eval_top1"], 4)
    assert f"{epoch['epoch_time']:.1f} s" in body
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())["resolved"]
    assert (f"{resolved['train_samples']:,} training images, {resolved['eval_samples']:,} for "
            f"validation, {resolved['test_samples']:,} test images") in body
    for snippet in ('timm.create_model("local-dir:', 'pipeline("image-classification"',
                    "onnxruntime.InferenceSession", "import accel_train", "max_steps: 3"):
        assert snippet in body, snippet


def test_an_export_exported_again_keeps_its_command_in_the_card(run_dir, export_dir, tmp_path):
    """An export carries no config.yaml, but its config.json records the command: the new
    card shows it (it said "No run record")."""
    again = tmp_path / "again"
    accel_train_here("export", str(export_dir), "-o", str(again), check=True)
    command = json.loads((export_dir / "config.json").read_text())["accel_train"]["command"]
    body = (again / "README.md").read_text()
    assert command and "No run record" not in body
    assert "- **Command:** `accel-train " in body and "as the weights' config.json recorded it" \
        in body


# -- bad input ----------------------------------------------------------------------------------
def _hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(result, *words: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_unknown_format_and_a_folder_holding_an_export(run_dir, export_dir, tmp_path):
    one_line(accel_train_here("export", str(run_dir), "-o", str(tmp_path / "x"), "--format",
                              "tflite"), "--format", "tflite")
    before = _hashes(export_dir)
    one_line(accel_train_here("export", str(run_dir), "-o", str(export_dir)),
             "already holds an export", str(export_dir))
    assert _hashes(export_dir) == before and not (tmp_path / "x").exists()


def test_a_run_with_no_model_and_no_valid_checkpoint(run_dir, tmp_path):
    import shutil
    broken = tmp_path / "run"
    # No final weights, and every checkpoint without the weights its manifest names.
    shutil.copytree(run_dir, broken, ignore=shutil.ignore_patterns("model.safetensors"))
    assert list((broken / "checkpoints").iterdir())
    one_line(accel_train_here("export", str(broken), "-o", str(tmp_path / "out")),
             "none of the checkpoints", "complete")
    assert not (tmp_path / "out").exists()


class DataDependent(torch.nn.Module):
    """A classifier whose output depends on a branch over its input's values, which
    torch.export cannot trace (a test-only timm model, registered below)."""

    def __init__(self, num_classes: int = 3, **kwargs):
        super().__init__()
        self.num_classes, self.num_features = num_classes, 3
        self.pretrained_cfg = {"architecture": "test_data_dependent", "input_size": (3, 8, 8),
                               "mean": (0.5,) * 3, "std": (0.5,) * 3, "num_classes": num_classes}
        self.fc = torch.nn.Linear(3, num_classes)

    def forward(self, x):
        pooled = x.mean(dim=(2, 3))
        return self.fc(pooled) if pooled.sum() > 0 else -self.fc(pooled)


def _test_data_dependent(pretrained=False, **kwargs):
    return DataDependent(**kwargs)


_test_data_dependent.__name__ = "test_data_dependent"  # the name timm registers it under


def test_eval_of_the_onnx_file_is_eval_of_the_export(export_dir, real_cifar10, tmp_path):
    """The model.onnx evaluated by ONNX Runtime on 64 real held-out images: the numbers of the
    torch export's evaluation (fp32) within the exporter's tolerance, the same per-class counts
    and wrong images; what an ONNX file cannot do is one line each."""
    import json

    def evaluated(model: Path, mistakes: Path) -> dict:
        result = accel_train_here("eval", str(model), "--data-dir", str(real_cifar10),
                                  "--max-samples", "64", "--mixed-precision", "auto"
                                  if model.suffix == ".onnx" else "no", "--json", "--mistakes",
                                  str(mistakes), check=True)
        return json.loads(result.stdout.strip().splitlines()[-1])

    torch_side = evaluated(export_dir, tmp_path / "torch.csv")
    onnx_side = evaluated(export_dir / "model.onnx", tmp_path / "onnx.csv")
    assert onnx_side["model"] == f"ONNX file {export_dir / 'model.onnx'} (ONNX Runtime)"
    assert onnx_side["count"] == torch_side["count"] == 64
    assert onnx_side["loss"] == pytest.approx(torch_side["loss"], abs=TOLERANCE)
    assert onnx_side["per_class"] == torch_side["per_class"]
    import pandas as pd
    wrong = [pd.read_csv(tmp_path / name) for name in ("torch.csv", "onnx.csv")]
    assert len(wrong[0]) > 0 and [set(map(tuple, table[["image", "class", "predicted"]].values))
                                  for table in wrong][0] == \
        set(map(tuple, wrong[1][["image", "class", "predicted"]].values))
    onnx_file = export_dir / "model.onnx"
    for flags, line in (
            ([], f"{onnx_file} is a model alone, without the run that says what it was trained "
                 f"on; pass --data-dir PATH: it was trained on --data-dir {real_cifar10}" +
                 (", which is there: pass it" if real_cifar10.is_absolute() else
                  " (relative to the folder training ran in)")),
            (["--data-dir", str(real_cifar10), "--mixed-precision", "bf16"],
             "--mixed-precision: an .onnx model runs as it was exported (its weights, its "
             "precision); drop --mixed-precision"),
            (["--data-dir", str(real_cifar10), "--ema"],
             "--ema: an .onnx model runs as it was exported (its weights, its precision); drop "
             "--ema")):
        one_line(accel_train_here("eval", str(onnx_file), *flags), line)


def test_a_model_the_onnx_exporter_cannot_trace(tmp_path, capfd):
    from timm.models import register_model
    if not timm.is_model("test_data_dependent"):
        register_model(_test_data_dependent)
    source = tmp_path / "source"
    timm.models.save_for_hf(DataDependent(), str(source), safe_serialization=True)
    capfd.readouterr()
    out = tmp_path / "exports" / "onnx"
    one_line(accel_train_here("export", str(source), "-o", str(out), "--format", "onnx"),
             "cannot export test_data_dependent", "GuardOnDataDependentSymNode")
    leaked = capfd.readouterr()
    assert "Traceback" not in leaked.err and "def forward" not in leaked.out + leaked.err
    assert not (tmp_path / "exports").exists()  # nor the parent it made


def test_without_onnx_installed_it_says_what_to_install(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    one_line(accel_train_here("export", str(run_dir), "-o", str(tmp_path / "o"), "--format",
                              "onnx"), "onnxruntime", 'pip install "accel_train[onnx]"')
    assert not (tmp_path / "o").exists()


def test_the_cards_onnx_snippet_sees_a_photo_as_predict_does(export_dir, images, tmp_path):
    """The card's ONNX Runtime lines, run as a reader copies them, on a phone's photo stored on
    its side (EXIF orientation 6, not square) and on a cut-out with transparent corners: the
    same probabilities as `accel-train predict`, which turns the one upright and puts the other
    over white.  A plain convert("RGB") fed the first lying down, the second over black."""
    card = (export_dir / "README.md").read_text()
    snippet = next(block for block in card.split("```python\n")[1:]
                   if "onnxruntime.InferenceSession" in block).split("```")[0]
    snippet = snippet.replace(f'"./{export_dir.name}/', f'"{export_dir}/')
    photo = np.asarray(Image.open(images[0]).convert("RGB").resize((48, 32)))
    exif = Image.Exif()
    exif[0x0112] = 6
    sideways, cutout = tmp_path / "sideways.jpg", tmp_path / "cutout.png"
    Image.fromarray(photo).save(sideways, exif=exif, quality=95)
    rgba = np.dstack([np.asarray(Image.open(images[1]).convert("RGB")),
                      np.full((32, 32), 255, np.uint8)])
    rgba[:8, :8, 3] = rgba[-8:, -8:, 3] = 0
    rgba[:8, :8, :3] = 0  # what the transparent pixels hold: black, not what anyone sees
    Image.fromarray(rgba, "RGBA").save(cutout)
    predicted = predict_probabilities(export_dir, [sideways, cutout])
    for row, path in enumerate((sideways, cutout)):
        scope: dict = {}
        exec(snippet.replace('"image.png"', f'"{path}"'), scope)  # noqa: S102 -- the card's code
        probabilities = torch.from_numpy(scope["logits"]).double().softmax(dim=1).numpy()
        agree(probabilities, predicted[row:row + 1])
