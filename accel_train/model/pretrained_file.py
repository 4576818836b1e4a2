"""What a weights file given to --pretrained brings besides its tensors: its classifier, and
the normalization its weights learned under.

timm keeps a pretrained classifier only when the run's class count equals the one its
pretrained_cfg names (1000 for ImageNet weights), whatever the file holds.  For a file of
one's own that is the wrong rule: a run's model.safetensors given back to train on more photos
of the same 10 classes lost its trained classifier, and a 10-class file under 1000 classes of
data failed to load.  Here the file itself decides: its classifier is kept when it has as
many classes as the data and, where the file's folder names its classes (a run's or export's
config.json, a checkpoint's model_config.json), the same classes (in another order, its rows
are put in the data's); else the run starts a new classifier, and the summary says which and
why.  The same folder's file gives the mean and std its images were normalized with, which
timm would otherwise take from the architecture's own pretrained_cfg (ImageNet's, or 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from accel_train.base.errors import first_few
from accel_train.base.readers import BadFile, read_json, safetensors_shapes

# beside a weights file, the files that describe it: (file, kind, the class names' key, where
# its mean and std are: a section, or the top level)
DESCRIBING_FILES = (("config.json", "timm_config", "label_names", "pretrained_cfg"),
                    ("model_config.json", "model_config", "class_names", None))
# timm pops the classifier when the class count differs from the pretrained_cfg's: a count
# no model has makes it pop the file's
NO_CLASS_COUNT = -1


@dataclass(frozen=True)
class Described:
    """What the file's folder says of it."""
    class_names: Optional[list[str]] = None
    mean: Optional[tuple[float, ...]] = None
    std: Optional[tuple[float, ...]] = None


@dataclass(frozen=True)
class PretrainedHead:
    keep: bool
    file_classes: Optional[int]  # the file classifier's rows; None: it has no classifier
    words: str                   # the summary's account
    order: Optional[tuple[int, ...]] = None  # kept: the file's row for each of our classes
    described: Described = Described()

    def overlay(self) -> dict:
        """timm's pretrained_cfg_overlay entries: keep or drop the classifier; the mean and
        std the weights learned under, where the folder says them."""
        normalization = {"mean": self.described.mean, "std": self.described.std} \
            if self.described.mean is not None else {}
        return {"num_classes": self.file_classes if self.keep else NO_CLASS_COUNT,
                **normalization}


def classifier_names(model_name: str) -> Optional[tuple[str, ...]]:
    """The classifier's module name(s) in timm's pretrained_cfg ("fc", "head.fc"), or None
    (a model without one, or a name timm's registry does not hold)."""
    from timm.models import get_pretrained_cfg_value
    try:
        names = get_pretrained_cfg_value(model_name, "classifier")
    except (RuntimeError, ValueError, KeyError):
        return None
    if not names:
        return None
    return (names,) if isinstance(names, str) else tuple(names)


def file_class_count(path: Path, classifiers: Sequence[str]) -> Optional[int]:
    """Rows of the file's first classifier weight, None where it has none.  A file that cannot
    be read is left to the load that follows, which names it in one line."""
    keys = [f"{name}.weight" for name in classifiers]
    try:
        if path.suffix.lower() == ".safetensors":
            shapes = safetensors_shapes(path, "pretrained")  # the header alone
        else:
            from timm.models import load_state_dict  # weights_only; unwraps 'state_dict', ...
            shapes = {key: tuple(value.shape) for key, value in load_state_dict(str(path)).items()
                      if hasattr(value, "shape")}
    except Exception:  # noqa: BLE001 (any reader's error: the load reports it)
        return None
    key = next((k for k in keys if k in shapes), None)
    return None if key is None or not shapes[key] else int(shapes[key][0])


def described_beside(path: Path) -> Described:
    """What the file's folder says of it (a run's or export's config.json, a checkpoint's
    model_config.json); nothing where no such file reads."""
    for file_name, kind, names_key, section in DESCRIBING_FILES:
        beside = path.parent / file_name
        if not beside.is_file():
            continue
        try:
            config = read_json(beside, kind)
        except BadFile:
            continue
        names = config.get(names_key)
        numbers = config.get(section) if section else config
        mean, std = (numbers.get("mean"), numbers.get("std")) if isinstance(numbers, dict) \
            else (None, None)
        has_normalization = all(_three_numbers(v) for v in (mean, std))
        return Described(names if isinstance(names, list) and
                         all(isinstance(n, str) for n in names) else None,
                         tuple(mean) if has_normalization else None,
                         tuple(std) if has_normalization else None)
    return Described()


def _three_numbers(value) -> bool:
    return isinstance(value, list) and len(value) == 3 and \
        all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def plan_head(path: Path, model_name: str, class_names: Sequence[str]) -> Optional[PretrainedHead]:
    """Keep or start the classifier for `class_names`; None where timm names no classifier for
    the model (its own rule then applies)."""
    classifiers = classifier_names(model_name)
    if classifiers is None:
        return None
    described = described_beside(path)
    keep, theirs, words, order = _classifier_plan(path, classifiers, described.class_names,
                                                  class_names)
    if described.mean is not None:
        words += "; normalized as it was trained (its folder's mean and std)"
    return PretrainedHead(keep, theirs, words, order, described)


def _classifier_plan(path: Path, classifiers: Sequence[str], named: Optional[list[str]],
                     class_names: Sequence[str]):
    """(keep, the file's class count, the summary's words, the row order)."""
    ours = len(class_names)
    theirs = file_class_count(path, classifiers)
    new = f"{path} with a new {ours}-class classifier"
    if theirs is None:
        return False, None, f"{new} (the file holds none)", None
    if theirs != ours:
        return False, theirs, f"{new} (the file's has {theirs} classes)", None
    if named is None:
        return True, theirs, (f"{path}, its {theirs}-class classifier too (as many classes as "
                              f"the data; no class names beside the file to compare)"), None
    if list(named) == list(class_names):
        return True, theirs, f"{path}, its classifier too (the same {ours} classes)", None
    if sorted(named) == sorted(class_names) and len(set(named)) == len(named):
        return True, theirs, (f"{path}, its classifier too, its rows put in the data's class "
                              f"order (the same {ours} classes)"), \
            tuple(named.index(name) for name in class_names)
    return False, theirs, f"{new} (the file's is for other classes: {first_few(named)})", None


def reorder_classifier(model, order: Sequence[int]) -> None:
    """The classifier's rows (weight and bias: one per class) in `order`, through timm's
    get_classifier()."""
    import torch
    classifier = model.get_classifier()
    index = torch.tensor(list(order))
    with torch.no_grad():
        for tensor in (classifier.weight, classifier.bias):
            if tensor is not None:
                tensor.copy_(tensor[index])
