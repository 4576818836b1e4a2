"""README.md of an export folder, in the Hugging Face Hub's model-card convention: a YAML header
(library, pipeline, tags, datasets, metrics, model-index) and sections on the model, its data,
how it was trained, its held-out accuracy, and how to load it with timm, transformers, ONNX
Runtime and accel-train.  Everything in it comes from the run (config.yaml, metrics.jsonl) and
from what export measured on the run's held-out images."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from accel_train.model.saved import ModelSpec
from accel_train.model.saved import OWN_NETWORKS
from accel_train.config import TrainConfig


@dataclass
class CardFacts:
    spec: ModelSpec
    folder_name: str
    source: str                       # which weights: "the final model of run ...", a checkpoint
    run_record: dict                  # the run's config.yaml ({} when there is no run)
    epochs: list = field(default_factory=list)    # metrics.jsonl's epoch records
    held_out: str = ""                # the held-out data measured, or why none
    metrics: dict = field(default_factory=dict)   # tta -> {"top1", "top5", "count"}
    onnx_diff: Optional[float] = None  # ONNX Runtime vs torch, when model.onnx is there


def _dataset_name(train: dict) -> Optional[str]:
    if train.get("data_dir"):
        return Path(train["data_dir"]).name
    dataset = train.get("dataset")
    return dataset if dataset and dataset != "synthetic" else None


def _recipe(train: dict) -> dict:
    """The training options that differ from the defaults: what to repeat the run."""
    defaults = TrainConfig().to_dict()
    return {k: v for k, v in train.items() if k in defaults and v != defaults[k]
            and k not in ("output_dir", "resume")}


def _header(facts: CardFacts, dataset: Optional[str]) -> str:
    tags = ["image-classification", "timm", "accel_train"] + (["onnx"] if facts.onnx_diff is not
                                                               None else [])
    header = {"library_name": "timm", "pipeline_tag": "image-classification", "tags": tags}
    if dataset:
        header["datasets"] = [dataset]
    header["metrics"] = ["accuracy"]
    own = facts.metrics.get(facts.spec.tta)
    if own:
        header["model-index"] = [{"name": facts.folder_name, "results": [{
            "task": {"type": "image-classification", "name": "Image Classification"},
            "dataset": {"type": dataset or "custom", "name": dataset or "custom",
                        "split": "held-out"},
            "metrics": [{"type": "accuracy", "name": "top-1 accuracy",
                         "value": round(own["top1"], 4)},
                        {"type": "accuracy", "name": "top-5 accuracy",
                         "value": round(own["top5"], 4)}]}]}]
    return "---\n" + yaml.safe_dump(header, sort_keys=False) + "---\n"


def _metrics_table(facts: CardFacts) -> str:
    if not facts.metrics:
        return f"Not measured at export: {facts.held_out}.\n"
    rows = ["| test-time augmentation | top-1 | top-5 | images |", "|---|---|---|---|"]
    labels = {"none": "none", "flip": "flip (mirror image averaged)",
              "flip-translate": "flip-translate (6 views: mirrored, shifted 1 px)"}
    for tta, m in facts.metrics.items():
        label = labels.get(tta, tta)
        chosen = " (the run's choice)" if tta == facts.spec.tta else ""
        rows.append(f"| {label}{chosen} | {m['top1']:.2%} | {m['top5']:.2%} | {m['count']} |")
    return f"On {facts.held_out}, measured at export:\n\n" + "\n".join(rows) + "\n"


def _training(facts: CardFacts) -> str:
    record = facts.run_record
    if not record:
        return "No run record (config.yaml) came with these weights.\n"
    resolved, train = record.get("resolved", {}), record.get("train", {})
    seconds = sum(e.get("epoch_time", 0) for e in facts.epochs)
    lines = [f"- **Command:** `{shlex.join(str(a) for a in record.get('command', []))}`",
             f"- **Recipe** (options that differ from the defaults): "
             f"`{yaml.safe_dump(_recipe(train), default_flow_style=True, width=10**6).strip()}`",
             f"- **Epochs:** {len(facts.epochs)}, {resolved.get('total_steps', '?')} steps of "
             f"{resolved.get('global_batch', '?')} images",
             f"- **Training time:** {seconds:.1f} s (the epochs' times added up)",
             f"- **Hardware:** {resolved.get('device', '?')}, "
             f"{resolved.get('world_size', '?')} process(es), precision "
             f"{resolved.get('precision_used', '?')}",
             "- **Software:** " + ", ".join(f"{k} {v}" for k, v in
                                             record.get("versions", {}).items())]
    return "\n".join(lines) + "\n"


def _usage(facts: CardFacts) -> str:
    spec, name = facts.spec, facts.folder_name
    own = spec.model_name in OWN_NETWORKS
    prelude = (f"import accel_train  # registers {spec.model_name} in timm's registry\n"
               if own else "")
    note = (f"\n`{spec.model_name}` is one of accel_train's small networks: timm and "
            f"transformers know it once `accel_train` is imported (`pip install accel_train`); "
            f"the ONNX file needs nothing of ours.\n" if own else "")
    tta = (f"\nThe run evaluates with {spec.tta} TTA (the logits of several views of each "
           f"image averaged); `accel-train predict` does that, the snippets below do not.\n"
           if spec.tta != "none" else "")
    text = f"""{note}{tta}
timm (>= 1.0.16, `local-dir:`):

```python
{prelude}import timm, torch
model = timm.create_model("local-dir:./{name}", pretrained=True).eval()
config = timm.data.resolve_data_config({{}}, model=model)
transform = timm.data.create_transform(**config)   # resize to {spec.image_size} px, normalize
```

transformers (its timm wrapper reads config.json):

```python
{prelude}from transformers import pipeline
classify = pipeline("image-classification", model="./{name}")
classify("image.png")
```

accel-train: `accel-train predict ./{name} IMAGES...`, `accel-train eval ./{name} --data-dir DATA`.
"""
    if facts.onnx_diff is not None:
        text += f"""
ONNX Runtime (`model.onnx`: input `images` float32 [batch, 3, {spec.image_size}, \
{spec.image_size}], output `logits`; the preparation is in preprocessing.json):

```python
import numpy as np, onnxruntime
from PIL import Image
session = onnxruntime.InferenceSession("./{name}/model.onnx")
image = Image.open("image.png").convert("RGB").resize(({spec.image_size}, {spec.image_size}), \
Image.BILINEAR)
x = (np.asarray(image, np.float32) / 255 - {list(spec.mean)}) / {list(spec.std)}
logits = session.run(None, {{"images": x.transpose(2, 0, 1)[None].astype(np.float32)}})[0]
```

Checked at export: ONNX Runtime's logits equal torch's within {facts.onnx_diff:.1e} on held-out \
images (`accel-train predict ./{name}/model.onnx IMAGES...` reads it too).
"""
    return text


def model_card(facts: CardFacts) -> str:
    spec = facts.spec
    train = facts.run_record.get("train", {})
    dataset = _dataset_name(train)
    names = ", ".join(spec.class_names[:20]) + (", ..." if len(spec.class_names) > 20 else "")
    weights = "the exponential moving average (EMA)" if spec.weights == "ema" else "the raw"
    return f"""{_header(facts, dataset)}
# {facts.folder_name}

An image classifier trained with accel_train: timm's `{spec.model_name}` for \
{spec.num_classes} classes.

## Model details

- **Architecture:** `{spec.model_name}` (timm)
- **Weights:** {weights} weights; from {facts.source}
- **Input:** {spec.image_size} x {spec.image_size} RGB, resized (aspect not kept, bilinear), \
scaled to [0, 1], normalized with mean {list(spec.mean)} and std {list(spec.std)}
- **Test-time augmentation:** {spec.tta}
- **Classes:** {names}

## Training data

{f'`{dataset}`' if dataset else 'synthetic or unrecorded data'}; \
{train.get('max_train_samples') or 'all'} training images\
{f", at most {train['max_eval_samples']} held out" if train.get('max_eval_samples') else ''}.

## Training

{_training(facts)}
## Evaluation

{_metrics_table(facts)}
## How to use
{_usage(facts)}"""
