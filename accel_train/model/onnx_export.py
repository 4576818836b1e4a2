"""A trained model as ONNX (torch's exporter), checked against torch with ONNX Runtime, and read
back by `accel-train predict MODEL.onnx`.

The graph takes a float32 NCHW batch of any size (`images`, a dynamic batch dimension) prepared
as the run prepared its held-out images, and returns the logits (`logits`).  That preparation
(size, mean, std, class names, TTA) is recorded twice: in the ONNX file's metadata (what predict
reads, so the file can travel alone) and in preprocessing.json beside it (for people).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from accel_train.base.errors import UsageError, first_line
from accel_train.model.saved import ModelSpec, resize_description

ONNX_FILE = "model.onnx"
PREPROCESSING_FILE = "preprocessing.json"
METADATA_KEY = "accel_train"  # in the ONNX model's metadata_props
INPUT, OUTPUT = "images", "logits"
TOLERANCE = 1e-4  # ONNX Runtime's logits against torch's, in float32
NEEDED = ("onnx", "onnxscript", "onnxruntime")


def require_onnx(what: str) -> None:
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UsageError(f"{what} needs {', '.join(missing)} (not installed): "
                         f"pip install \"accel_train[onnx]\"")


def preprocessing_record(spec: ModelSpec) -> dict:
    """What a program feeding the ONNX model must do to an image, and what the outputs mean."""
    return {"input": INPUT, "output": OUTPUT, "layout": "NCHW, RGB, float32",
            "dynamic_axes": {INPUT: {"0": "batch"}, OUTPUT: {"0": "batch"}},
            "resize": resize_description(spec),
            "crop_pct": spec.crop_pct, "crop_mode": spec.crop_mode,
            "interpolation": spec.interpolation,
            "scale": "pixel values / 255, then (x - mean) / std per channel",
            "input_size": [3, spec.image_size, spec.image_size],
            "mean": list(spec.mean), "std": list(spec.std),
            "tta": spec.tta, "tta_note": "flip: average the logits of the image and its "
                                         "mirror image (accel-train predict does)",
            "class_names": list(spec.class_names), "spec": asdict(spec)}


def export_onnx(model: nn.Module, path: Path, example: torch.Tensor, spec: ModelSpec) -> None:
    """torch.onnx.export (the torch.export-based exporter) with a dynamic batch dimension;
    a network it cannot trace is one line naming it (exit 2)."""
    require_onnx("--format onnx")
    import onnx
    from torch.onnx.errors import OnnxExporterError

    if example.shape[0] < 2:  # torch.export specializes a dimension of size 1 to a constant
        example = example.repeat(2, 1, 1, 1)
    try:
        with quiet_output():
            torch.onnx.export(model, (example,), str(path), input_names=[INPUT],
                              output_names=[OUTPUT], dynamo=True, external_data=False,
                              dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False)
    except OnnxExporterError as err:
        cause = err.__cause__ or err
        raise UsageError(f"--format onnx: torch's ONNX exporter cannot export "
                         f"{spec.model_name} ({type(cause).__name__}: {first_line(cause)}); "
                         f"export without --format onnx (timm's folder), or choose a model "
                         f"torch.export can trace") from None
    exported = onnx.load(str(path))
    onnx.helper.set_model_props(exported, {METADATA_KEY: json.dumps(preprocessing_record(spec))})
    onnx.save(exported, str(path))
    (path.parent / PREPROCESSING_FILE).write_text(
        json.dumps(preprocessing_record(spec), indent=2) + "\n")


@contextlib.contextmanager
def quiet_output():
    """Nothing from the exporter reaches the terminal: when it cannot trace a model it logs
    warnings and prints the graph (hundreds of lines) to the process's stdout and stderr, at
    the file-descriptor level too; our one line says what failed.  Its warnings go too."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings(), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            for stream in (sys.__stdout__, sys.__stderr__):  # what logging buffered, to the sink
                if stream is not None:
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def onnx_session(path: Path):
    require_onnx(f"reading {path}")
    import onnxruntime

    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def check_onnx(path: Path, model: nn.Module, images: torch.Tensor) -> float:
    """Run the written file in ONNX Runtime on `images` (all of them, then the first alone: the
    batch dimension is dynamic) and compare with torch; returns the largest |logit difference|,
    or raises when it is above TOLERANCE."""
    session = onnx_session(path)
    worst = 0.0
    for batch in (images, images[:1]):
        with torch.no_grad():
            expected = model(batch).float()
        got = torch.from_numpy(session.run([OUTPUT], {INPUT: batch.numpy()})[0])
        if got.shape != expected.shape:
            raise UsageError(f"{path}: ONNX Runtime returned logits of shape {tuple(got.shape)} "
                             f"for a batch of {len(batch)}, torch {tuple(expected.shape)}; "
                             f"the export is not usable")
        worst = max(worst, float((got - expected).abs().max()))
    if worst > TOLERANCE:
        raise UsageError(f"{path}: ONNX Runtime's logits differ from torch's by {worst:.2e} "
                         f"(more than {TOLERANCE:g}) on {len(images)} images; the ONNX export "
                         f"is not written, export without --format onnx")
    return worst


class OnnxClassifier:
    """An ONNX file behind the small part of nn.Module's interface that predict and eval use:
    called on a torch batch, it returns torch logits (computed on the CPU by ONNX Runtime)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.session = onnx_session(self.path)
        record = self.session.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
        if record is None:
            raise UsageError(f"{path} has no {METADATA_KEY} record of its preprocessing (not "
                             f"written by accel-train export --format onnx); export the run "
                             f"with it")
        try:
            self.spec = ModelSpec.from_dict(json.loads(record)["spec"])
        except (ValueError, KeyError, TypeError) as err:
            raise UsageError(f"{path}: its {METADATA_KEY} record is not the one accel-train "
                             f"export writes ({type(err).__name__}: {first_line(err)}); export "
                             f"the run again with --format onnx") from None
        self.input = self.session.get_inputs()[0].name

    training = False  # the graph as exported: BatchNorm and dropout in inference form

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.session.run(None, {self.input: images.float().cpu().numpy()})[0]
        return torch.from_numpy(logits).to(images.device)

    def to(self, device) -> "OnnxClassifier":
        return self  # ONNX Runtime's CPU provider: the batch is moved there in __call__

    def eval(self) -> "OnnxClassifier":
        return self

    def train(self, mode: bool = True) -> "OnnxClassifier":
        return self  # nothing to switch: evaluate_classifier restores what it found
