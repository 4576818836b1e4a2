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

from accel_train.model.saved import ModelSpec, is_import_path, resize_description
from accel_train.model.saved import OWN_NETWORKS
from accel_train.model.transformers_models import TRANSFORMERS_CONFIG
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
    onnx_checked_on: str = "held-out images"  # what that check ran on
    command: list = field(default_factory=list)  # the weights' config.json's, without a record


def _hub_dataset(train: dict) -> Optional[str]:
    """The training data as the Hub's card metadata names data (`datasets:`): a Hub dataset's
    id (--dataset); a local folder is no such id."""
    dataset = train.get("dataset")
    return dataset if dataset and dataset != "synthetic" and not train.get("data_dir") else None


def _data_words(train: dict) -> str:
    if train.get("data_dir"):
        return f"a local folder, `{Path(train['data_dir']).name}`"
    dataset = _hub_dataset(train)
    return f"`{dataset}` (Hugging Face Hub)" if dataset else "synthetic or unrecorded data"


def _data_counts(facts: CardFacts) -> str:
    """The images each role had, as the run recorded them (config.yaml's resolved facts);
    from the options alone for a run recorded before those were."""
    record = facts.run_record or {}
    resolved, train = record.get("resolved", {}), record.get("train", {})
    if isinstance(resolved.get("train_samples"), int):
        counts = [f"{resolved['train_samples']:,} training images",
                  f"{resolved.get('eval_samples', 0):,} for validation"]
        if resolved.get("test_samples"):
            counts.append(f"{resolved['test_samples']:,} test images (evaluated once, at the end)")
        kept = resolved.get("sample_subset")  # the rule of a sample limit that cut a split
        return ", ".join(counts) + (" (the sample limits kept a seeded draw of each split: "
                                    "--sample-subset random)" if kept == "random" else
                                    " (the sample limits kept each split's first images: "
                                    "--sample-subset first)" if kept == "first" else "")
    return (f"{train.get('max_train_samples') or 'all'} training images"
            + (f", at most {train['max_eval_samples']} held out"
               if train.get("max_eval_samples") else ""))


def _recipe(train: dict) -> dict:
    """The training options that differ from the defaults: what to repeat the run."""
    defaults = TrainConfig().to_dict()
    return {k: v for k, v in train.items() if k in defaults and v != defaults[k]
            and k not in ("output_dir", "resume")}


def _header(facts: CardFacts, dataset: Optional[str], data_name: Optional[str]) -> str:
    """`dataset`: a Hub id (the metadata's `datasets:`); `data_name`: what model-index calls
    the evaluation's data (a local folder's name too)."""
    timm = not is_import_path(facts.spec.model_name)  # else a user's factory built it
    tags = ["image-classification", *(["timm"] if timm else []), "accel_train"] + \
        (["onnx"] if facts.onnx_diff is not None else [])
    header = {"library_name": "timm" if timm else "pytorch",
              "pipeline_tag": "image-classification", "tags": tags}
    if dataset:
        header["datasets"] = [dataset]
    header["metrics"] = ["accuracy"]
    own = facts.metrics.get(facts.spec.tta)
    if own:
        header["model-index"] = [{"name": facts.folder_name, "results": [{
            "task": {"type": "image-classification", "name": "Image Classification"},
            "dataset": {"type": dataset or "custom", "name": data_name or "custom",
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


def shown_command(command: list) -> list[str]:
    """The recorded argv as a reader can type it: `python -m accel_train` and the console
    script record their program as the path of accel_train/__main__.py or of bin/accel-train,
    which mean nothing on another machine; a program of the user's (fit()) stays itself."""
    words = [str(word) for word in command]
    if not words:
        return words
    program = Path(words[0])
    if program.name == "accel-train" or (program.name == "__main__.py"
                                         and program.parent.name == "accel_train"):
        return ["accel-train", *words[1:]]
    if program.suffix == ".py":  # as typed: python records argv[0] so
        return ["python", *words]
    return words


def _training(facts: CardFacts) -> str:
    record = facts.run_record
    if not record and facts.command:
        return (f"- **Command:** `{shlex.join(shown_command(facts.command))}` (as the weights' "
                f"config.json recorded it; the rest of the run's record, config.yaml, did not "
                f"come with them)\n")
    if not record:
        return "No run record (config.yaml) came with these weights.\n"
    resolved, train = record.get("resolved", {}), record.get("train", {})
    seconds = sum(e.get("epoch_time", 0) for e in facts.epochs)
    lines = [f"- **Command:** `{shlex.join(shown_command(record.get('command', [])))}`",
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


def _factory_usage(facts: CardFacts) -> str:
    """A network of the user's own: timm and transformers cannot build it, its factory can."""
    spec, name = facts.spec, facts.folder_name
    module, _, factory = spec.model_name.partition(":")
    extra = f", drop_rate={spec.drop_rate}" if spec.drop_rate else ""
    tta = (f"\nThe run evaluates with {spec.tta} TTA; `accel-train predict` does that, the "
           f"snippet below does not.\n" if spec.tta != "none" else "")
    return f"""
`{spec.model_name}` is the import path of the function that built the network, not a timm
name: timm and transformers cannot build it, and its module must be importable (on PYTHONPATH,
or installed) wherever the model is loaded; config.json keeps timm's layout.
{tta}
```python
from safetensors.torch import load_file
import {module}
model = {module}.{factory}(num_classes={spec.num_classes}{extra})
model.load_state_dict(load_file("./{name}/model.safetensors"))
model.eval()
```

accel-train: `accel-train predict ./{name} IMAGES...`, `accel-train eval ./{name} --data-dir DATA`
(with the module importable).
"""


def _transformers_usage(facts: CardFacts) -> str:
    """A transformers model handed to fit(): its class, built from the config the run recorded
    (transformers_models.py)."""
    spec, name = facts.spec, facts.folder_name
    module, _, cls = spec.model_name.partition(":")
    tta = (f"\nThe run evaluates with {spec.tta} TTA; `accel-train predict` does that, the "
           f"snippet below does not.\n" if spec.tta != "none" else "")
    return f"""
`{spec.model_name}` is a Hugging Face transformers class, built from the config its run
recorded (config.json's `model_args.{TRANSFORMERS_CONFIG}`); config.json keeps timm's layout,
which transformers' own `from_pretrained` does not read.
{tta}
```python
import json
from safetensors.torch import load_file
import {module}
recorded = json.load(open("./{name}/config.json"))["model_args"]["{TRANSFORMERS_CONFIG}"]
network = {module}.{cls}
model = network(network.config_class.from_dict(recorded))
model.load_state_dict(load_file("./{name}/model.safetensors"))
model.eval()  # model(images).logits
```

accel-train: `accel-train predict ./{name} IMAGES...`, `accel-train eval ./{name} --data-dir DATA`.
"""


def _usage(facts: CardFacts) -> str:
    spec, name = facts.spec, facts.folder_name
    if is_import_path(spec.model_name):
        usage = (_transformers_usage if TRANSFORMERS_CONFIG in spec.model_args else
                 _factory_usage)
        return usage(facts) + _onnx_usage(facts)
    own = spec.model_name in OWN_NETWORKS
    prelude = (f"import accel_train  # registers {spec.model_name} in timm's registry\n"
               if own else "")
    note = (f"\n`{spec.model_name}` is one of accel_train's small networks: timm and "
            f"transformers know it once `accel_train` is imported (`pip install accel_train`)"
            + ("; the ONNX file needs nothing of ours" if facts.onnx_diff is not None else "")
            + ".\n" if own else "")
    tta = (f"\nThe run evaluates with {spec.tta} TTA (the logits of several views of each "
           f"image averaged); `accel-train predict` does that, the snippets below do not.\n"
           if spec.tta != "none" else "")
    text = f"""{note}{tta}
timm (>= 1.0.16, `local-dir:`):

```python
{prelude}import timm, torch
model = timm.create_model("local-dir:./{name}", pretrained=True).eval()
config = timm.data.resolve_data_config({{}}, model=model)
transform = timm.data.create_transform(**config)   # as the run prepared held-out images
```

transformers (its timm wrapper reads config.json):

```python
{prelude}from transformers import pipeline
classify = pipeline("image-classification", model="./{name}")
classify("image.png")
```

accel-train: `accel-train predict ./{name} IMAGES...`, `accel-train eval ./{name} --data-dir DATA`.
"""
    return text + _onnx_usage(facts)


# An image as the run saw it (decode.py): upright by its EXIF orientation (a phone's photo is
# stored on its side), transparency over white (convert("RGB") shows what the invisible pixels
# hold, often black).
_PIL_OPENING = (
    'image = ImageOps.exif_transpose(Image.open("image.png"))  # upright, as trained',
    'image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), '
    'image.convert("RGBA")).convert("RGB")  # transparency over white')


def _pil_preparation(spec: ModelSpec) -> str:
    """PIL lines that resize and crop an image as timm's eval transform does for this spec
    (torchvision's Resize and CenterCrop arithmetic), for a program without torch."""
    size, method = spec.image_size, spec.interpolation.upper()
    scaled = int(size / spec.crop_pct)  # timm: floor(size / crop_pct)
    lines = list(_PIL_OPENING)
    if spec.crop_mode == "border":  # padding with the mean: timm's own transform says it best
        return "\n".join(lines + [
            f"# then timm.data.create_transform(input_size={size}, crop_pct={spec.crop_pct}, "
            f"crop_mode=\"border\", interpolation=\"{spec.interpolation}\", "
            f"use_prefetcher=True)"])
    if spec.crop_mode == "squash":
        lines.append(f"image = image.resize(({scaled}, {scaled}), Image.{method})")
    else:  # center: the shorter side to `scaled`, the longer in proportion (truncated)
        lines += ["w, h = image.size",
                  f"image = image.resize(({scaled}, int({scaled} * h / w)) if w <= h else "
                  f"(int({scaled} * w / h), {scaled}), Image.{method})"]
    if scaled != size:
        lines += [f"left, top = round((image.width - {size}) / 2), "
                  f"round((image.height - {size}) / 2)",
                  f"image = image.crop((left, top, left + {size}, top + {size}))"]
    return "\n".join(lines)


def _onnx_usage(facts: CardFacts) -> str:
    spec, name = facts.spec, facts.folder_name
    text = ""
    if facts.onnx_diff is not None:
        text += f"""
ONNX Runtime (`model.onnx`: input `images` float32 [batch, 3, {spec.image_size}, \
{spec.image_size}], output `logits`; the preparation is in preprocessing.json):

```python
import numpy as np, onnxruntime
from PIL import Image, ImageOps
session = onnxruntime.InferenceSession("./{name}/model.onnx")
{_pil_preparation(spec)}
x = (np.asarray(image, np.float32) / 255 - {list(spec.mean)}) / {list(spec.std)}
logits = session.run(None, {{"images": x.transpose(2, 0, 1)[None].astype(np.float32)}})[0]
```

Checked at export: ONNX Runtime's logits equal torch's within {facts.onnx_diff:.1e} on \
{facts.onnx_checked_on} (`accel-train predict ./{name}/model.onnx IMAGES...` reads it too).
"""
    return text


def model_card(facts: CardFacts) -> str:
    spec = facts.spec
    train = facts.run_record.get("train", {})
    dataset = _hub_dataset(train)
    data_name = dataset or (Path(train["data_dir"]).name if train.get("data_dir") else None)
    names = ", ".join(spec.class_names[:20]) + (", ..." if len(spec.class_names) > 20 else "")
    weights = "the exponential moving average (EMA)" if spec.weights == "ema" else "the raw"
    own = is_import_path(spec.model_name)
    kind = "the network that the factory" if own else "timm's"
    origin = "the trainer's own factory, by import path" if own else "timm"
    return f"""{_header(facts, dataset, data_name)}
# {facts.folder_name}

An image classifier trained with accel_train: {kind} `{spec.model_name}` for \
{spec.num_classes} classes.

## Model details

- **Architecture:** `{spec.model_name}` ({origin})
- **Weights:** {weights} weights; from {facts.source}
- **Input:** {spec.image_size} x {spec.image_size} RGB: {resize_description(spec)}; \
scaled to [0, 1], normalized with mean {list(spec.mean)} and std {list(spec.std)}
- **Test-time augmentation:** {spec.tta}
- **Classes:** {names}

## Training data

{_data_words(train)}; {_data_counts(facts)}.

## Training

{_training(facts)}
## Evaluation

{_metrics_table(facts)}
## How to use
{_usage(facts)}"""
