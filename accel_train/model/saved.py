"""The saved-model format, in one module: the spec that rebuilds a trained network, the weights
writer, and timm's own folder format (model.safetensors + config.json).

config.json is written by timm's hub saver (`save_config_for_hf`, what `push_to_hf_hub` writes),
so `timm.create_model("local-dir:DIR", pretrained=True)` (timm >= 1.0.16) and transformers'
TimmWrapper (image-classification pipeline) open the folder with no code of ours: architecture,
num_classes, label_names, and a pretrained_cfg saying how the run prepared images (input size,
interpolation, crop, mean, std).  What only accel_train's commands need rides along in one
`accel_train` section that both readers ignore: the test-time augmentation, which weights these
are (raw or EMA), the dropout rate, the layers computed in float32 under autocast (--whiten-stem's),
and the command that trained the run.

A run's final model and `accel-train export` write this; checkpoints keep model_config.json (a
checkpointed part, resume reads it), which is also what runs and exports made before this format
hold: `ModelSpec.read` reads both.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torchvision
from timm.data.constants import DEFAULT_CROP_MODE, DEFAULT_CROP_PCT
from torch import nn

from accel_train.base.weightfiles import write_safetensors
from accel_train.base.errors import RunDiffers, UsageError, first_few, first_line
from accel_train.base.readers import read_json
from accel_train.model.small_nets import NETWORKS
from accel_train.model.transformers_models import TRANSFORMERS_CONFIG

WEIGHTS_FILE = "model.safetensors"  # in checkpoints, run folders and export folders
SPEC_FILE = "model_config.json"     # in checkpoints (and runs and exports made before config.json)
LEGACY_SPEC_FILE = SPEC_FILE

TIMM_CONFIG = "config.json"
OUR_SECTION = "accel_train"  # keys timm's and transformers' readers leave alone
FORMAT_VERSION = 1
# what a ModelSpec records of how the network was built (ModelSpec.model_args): timm's
# arguments, and a transformers model's config (transformers_models.py)
MODEL_ARGS = ("img_size", TRANSFORMERS_CONFIG)
# The networks accel_train registers in timm's registry: other programs know them only once
# accel_train is imported.
OWN_NETWORKS = NETWORKS
# timm's prefixes of a model name that say where its config comes from (`hf-hub:REPO`,
# `local-dir:FOLDER`; hf_hub is timm's old spelling).  Any other NAME:REST is an import path.
TIMM_SOURCES = ("hf-hub", "hf_hub", "local-dir")


def is_import_path(model_name: str) -> bool:
    """`package.module:factory`, a user's function that builds the network (build.py), rather
    than a name that timm builds."""
    prefix, colon, _ = model_name.partition(":")
    return bool(colon) and prefix.lower() not in TIMM_SOURCES


def same_normalization(a: "ModelSpec", b: "ModelSpec") -> bool:
    """Whether two specs normalize alike, within float32's rounding (the values are written to
    JSON and may have passed through float32 tensors)."""
    return all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)
               for x, y in zip((*a.mean, *a.std), (*b.mean, *b.std)))


def normalization_flags(spec: "ModelSpec") -> str:
    return (f"--mean {' '.join(f'{v:.6g}' for v in spec.mean)} "
            f"--std {' '.join(f'{v:.6g}' for v in spec.std)}")


def builder_makes_class(builder_name: str, class_path: str) -> bool:
    """Whether `builder_name` is a torchvision builder (torchvision.models:resnet18) returning
    the class `class_path` names (torchvision.models.resnet:ResNet): earlier versions recorded a
    torchvision module fit() trained by its class, this one by its builder
    (torchvision_models.py), and a checkpoint of either holds the same network's state."""
    prefix, _, name = builder_name.partition(":")
    if prefix != "torchvision.models" or not class_path.startswith("torchvision.models."):
        return False
    try:
        made = inspect.signature(torchvision.models.get_model_builder(name)).return_annotation
    except ValueError:  # not one of torchvision's builders
        return False
    return isinstance(made, type) and class_path == f"{made.__module__}:{made.__qualname__}"


@dataclass
class ModelSpec:
    """Everything needed to rebuild the network and feed it images like training did."""

    model_name: str
    num_classes: int
    class_names: list[str]
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    drop_rate: float = 0.0
    weights: str = "model"  # which weights model.safetensors holds: "model" or "ema" (--model-ema)
    tta: str = "none"  # test-time augmentation the run evaluated with (--tta)
    # How held-out images are resized and cropped, in timm's pretrained_cfg terms (--crop-pct,
    # --crop-mode, --interpolation, or the model's own): what evaluation, eval, predict and the
    # export's config.json all follow.  The defaults are the plain resize of both sides that
    # every run used before these fields, so older spec files read as what they did.
    crop_pct: float = 1.0
    crop_mode: str = "squash"
    interpolation: str = "bilinear"
    # Layers that compute in float32 under autocast (--whiten-stem's layer: whitening.py), so that
    # eval, predict and export rebuild them as the run computed; older spec files had none.
    float32_layers: list[str] = field(default_factory=list)
    # More of timm's arguments the network was built with: {"img_size": S} for a network of a
    # fixed input size (ViT, Swin) trained at another (input_size.py); older files had none.
    model_args: dict = field(default_factory=dict)

    name = "model_spec"  # a checkpointed part (checkpoint.py): export/eval read a checkpoint alone

    def save(self, directory: Path) -> Path:
        path = Path(directory) / SPEC_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    def load(self, directory: Path) -> None:
        """A resumed start: the checkpoint's network and image size must be this start's
        (restored before the weights, so that another --model is one line, not a state-dict
        size mismatch)."""
        saved = ModelSpec.read(directory)
        same_network = (saved.model_name == self.model_name
                        or builder_makes_class(self.model_name, saved.model_name))
        if not same_network or saved.num_classes != self.num_classes:
            raise RunDiffers(f"checkpoint {directory} was trained with --model "
                             f"{saved.model_name} ({saved.num_classes} classes) but this start "
                             f"builds {self.model_name} ({self.num_classes} classes); resume "
                             f"with the same --model and data, or start a new run")
        if list(saved.class_names) != list(self.class_names):
            # the same count of other classes: the outputs would change meaning silently, and
            # the final model would record names its first steps never trained
            differ = [f"{a} -> {b}" for a, b in zip(saved.class_names, self.class_names)
                      if a != b]
            raise RunDiffers(f"checkpoint {directory} was trained on classes "
                             f"{first_few(saved.class_names)} but this start's data has "
                             f"{first_few(self.class_names)} ({', '.join(differ[:3])}"
                             f"{', ...' if len(differ) > 3 else ''}); resume with the data it "
                             f"trained on, or start a new run (--pretrained takes the run's "
                             f"model.safetensors)")
        if saved.image_size != self.image_size:
            # the crops it trained on, and the size its final model records for eval, predict
            # and export: a run has one
            raise RunDiffers(f"checkpoint {directory} was trained at --image-size "
                             f"{saved.image_size} but this start asks for {self.image_size}; "
                             f"resume with --image-size {saved.image_size}, or start a new run "
                             f"(--pretrained takes the run's model.safetensors)")
        if not same_normalization(saved, self):
            # the weights learned from inputs scaled one way; eval, predict and export would
            # record the other
            raise RunDiffers(f"checkpoint {directory} was trained on images normalized with "
                             f"{normalization_flags(saved)} but this start normalizes with "
                             f"{normalization_flags(self)} (the training images' "
                             f"statistics where --mean and --std are not given); resume "
                             f"with {normalization_flags(saved)}, or start a new run")

    @classmethod
    def read(cls, directory: Path) -> "ModelSpec":
        """From timm's config.json (a run's final model, an export: below), else from
        model_config.json (checkpoints; runs and exports made before timm's format)."""
        if (Path(directory) / TIMM_CONFIG).is_file():
            return spec_from_timm_config(Path(directory) / TIMM_CONFIG)
        path = Path(directory) / SPEC_FILE
        if not path.is_file():
            raise UsageError(f"{directory}: no {TIMM_CONFIG} or {SPEC_FILE} there; pass a run "
                             f"directory or an export made by accel-train")
        return cls.from_dict(read_json(path, "model_config"))  # readers.py: one line if bad

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        """From model_config.json, or the `resolved: model:` entry of a run's config.yaml
        (timm's config.json: spec_from_timm_config)."""
        return cls(**{**data, "mean": tuple(data["mean"]), "std": tuple(data["std"])})


def save_weights(state_dict: dict, directory: Path, spec: ModelSpec,
                 with_spec: bool = True) -> Path:
    """The one writer of model weights: DIR/model.safetensors (plain CPU tensors, with the
    metadata that tools reading safetensors as PyTorch weights look for) and, `with_spec`,
    DIR/model_config.json beside it (checkpoints; a model folder has timm's config.json
    instead: write_model_folder)."""

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    write_safetensors(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    if with_spec:
        spec.save(directory)
    return directory / WEIGHTS_FILE


def preprocessing(spec: ModelSpec) -> dict:
    """The held-out preprocessing of a run in timm's pretrained_cfg terms: the crop_pct,
    crop_mode and interpolation the run evaluated with (data/transforms.py runs timm's eval
    transform with them; squash at crop_pct 1 and bilinear, small images' plain resize, is that
    same resize of both sides with no crop)."""
    return {"input_size": (3, spec.image_size, spec.image_size),
            "interpolation": spec.interpolation, "crop_pct": spec.crop_pct,
            "crop_mode": spec.crop_mode, "mean": tuple(spec.mean), "std": tuple(spec.std),
            "num_classes": spec.num_classes}


def resize_description(spec: ModelSpec) -> str:
    """timm's eval transform (timm.data.create_transform) for the spec's crop, in words."""
    size, how = spec.image_size, spec.interpolation
    scaled = int(spec.image_size / spec.crop_pct)  # timm: floor(size / crop_pct)
    if spec.crop_mode == "squash":
        if scaled == size:
            return f"both sides to {size} px (aspect not kept), {how}"
        return (f"both sides to {scaled} px (aspect not kept), {how}, then the central "
                f"{size} x {size} px")
    if spec.crop_mode == "border":
        return (f"the longer side to {scaled} px (aspect kept), {how}, then padded to (or the "
                f"central part cut to) {size} x {size} px with the mean colour")
    return (f"the shorter side to {scaled} px (aspect kept), {how}, then the central {size} x "
            f"{size} px (timm's crop_pct {spec.crop_pct:g})")


# pretrained_cfg entries of the source checkpoint that say nothing true of the trained weights
SOURCE_ONLY = ("tag", "test_input_size", "test_crop_pct", "label_names", "label_descriptions")


def write_model_folder(model: nn.Module, directory: Path, spec: ModelSpec,
                       command: Optional[list] = None, step: Optional[int] = None) -> Path:
    """DIR/model.safetensors (our writer: plain contiguous CPU tensors with the "pt" metadata;
    timm's save_for_hf writes `model.state_dict()` as it is) and DIR/config.json by timm's
    saver, last: its `step` (the optimizer steps the weights trained) says the folder is whole
    for that step.  Returns the weights' path."""
    from timm.models._hub import save_config_for_hf

    directory = Path(directory)
    weights = save_weights(model.state_dict(), directory, spec, with_spec=False)
    ours = {"format_version": FORMAT_VERSION, "weights": spec.weights, "tta": spec.tta,
            "drop_rate": spec.drop_rate, "float32_layers": list(spec.float32_layers),
            "command": list(command or []), **({"step": step} if step is not None else {})}
    if is_import_path(spec.model_name):
        # A user's factory built it: the architecture must name that factory (even when it
        # returned a timm model, whose own config would name the timm network it started from),
        # so that eval, predict and export rebuild it through the same import.  timm cannot open
        # such a folder by itself; the layout is still timm's, which ModelSpec.read reads.
        config = {"architecture": spec.model_name, "num_classes": spec.num_classes,
                  "label_names": list(spec.class_names), "pretrained_cfg": preprocessing(spec),
                  **({"model_args": spec.model_args} if spec.model_args else {}),
                  OUR_SECTION: ours}
        (directory / TIMM_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return weights
    # timm's saver takes the preprocessing from model.pretrained_cfg (the `data_config` argument
    # exists only in the newest timm): describe the trained model there while it writes.  The
    # source checkpoint's tag and pool size no longer describe these weights, nor its test size
    # and crop (resnet50's 288 px, crop 1.0): timm's validate.py takes those by default, and
    # would evaluate the export at a size and crop the run never evaluated.
    source_cfg = model.pretrained_cfg
    size_changed = tuple(source_cfg.get("input_size", ())[1:]) != (spec.image_size,) * 2
    model.pretrained_cfg = {**{k: v for k, v in source_cfg.items() if k not in SOURCE_ONLY},
                            **preprocessing(spec), **({"pool_size": None} if size_changed else {})}
    try:
        save_config_for_hf(model, directory / TIMM_CONFIG,
                           model_config={"label_names": list(spec.class_names), OUR_SECTION: ours})
    finally:
        model.pretrained_cfg = source_cfg
    config = read_json(directory / TIMM_CONFIG, "timm_config")  # what timm's saver just wrote
    # timm >= 1.0.27 also records num_classes among model_args; transformers' TimmWrapper passes
    # num_classes=num_labels beside **model_args and fails ("got multiple values for keyword
    # argument 'num_classes'").  timm reads the top-level num_classes, so it is not lost.
    config.get("model_args", {}).pop("num_classes", None)
    (directory / TIMM_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return weights


def holds_model_spec(directory: Path) -> bool:
    return (Path(directory) / TIMM_CONFIG).is_file() or \
        (Path(directory) / LEGACY_SPEC_FILE).is_file()


def spec_from_timm_config(path: Path) -> ModelSpec:
    """The spec in a config.json of timm's layout (ModelSpec.read calls it).  Read here rather
    than with timm's reader (a private function, timm.models._hub.load_model_config_from_path,
    absent before timm 1.0.16) because we also need our own section, which that reader drops;
    the fields are the layout timm's saver writes."""
    config = read_json(Path(path), "timm_config")  # one line when cut short or not timm's
    try:
        cfg, ours = config["pretrained_cfg"], config.get(OUR_SECTION, {})
        num_classes = int(config.get("num_classes", cfg.get("num_classes")))
        names = config.get("label_names") or cfg.get("label_names") or \
            [str(i) for i in range(num_classes)]
        # A folder that does not say how to crop is read as timm reads it
        # (timm.data.resolve_data_config's defaults); ours always say.
        return ModelSpec(config["architecture"], num_classes, list(names),
                         int(cfg["input_size"][-1]), tuple(cfg["mean"]), tuple(cfg["std"]),
                         float(ours.get("drop_rate", 0.0)), ours.get("weights", "model"),
                         ours.get("tta", "none"),
                         crop_pct=float(cfg.get("crop_pct") or DEFAULT_CROP_PCT),
                         crop_mode=cfg.get("crop_mode") or DEFAULT_CROP_MODE,
                         interpolation=cfg.get("interpolation") or "bicubic",
                         # as written: build_from_spec says in one line when it is not a list
                         float32_layers=ours.get("float32_layers", []),
                         model_args=timm_model_args(config))
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise UsageError(f"{path} is not a timm model config ({type(err).__name__}: "
                         f"{first_line(err)}); export the run again with accel-train "
                         f"export") from None


def timm_model_args(config: dict) -> dict:
    """Of the model_args timm's saver records (every argument create_model was given), those a
    ModelSpec keeps: the rest (drop_rate, num_classes) it holds in fields of its own."""
    recorded = config.get("model_args") or {}
    return {key: recorded[key] for key in MODEL_ARGS if key in recorded}


def read_our_section(directory: Path) -> dict:
    path = Path(directory) / TIMM_CONFIG
    return read_json(path, "timm_config").get(OUR_SECTION, {}) if path.is_file() else {}


def unknown_architecture_hint(name: str) -> str:
    """What to tell someone whose timm does not know `name`."""
    if name in OWN_NETWORKS:
        return (f"{name} is one of accel_train's small networks, registered in timm's registry "
                f"by `import accel_train`: import it before timm.create_model or the "
                f"transformers pipeline")
    return "a newer timm may have it: pip install -U timm"
