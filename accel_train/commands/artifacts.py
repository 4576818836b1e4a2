"""What `eval`, `predict` and `export` accept as RUN_OR_CHECKPOINT, turned into a model.

Accepted: a run directory (its final model.safetensors, or its newest valid checkpoint when
training did not finish), an export folder (model.safetensors + timm's config.json, or the
model_config.json of exports made before it), a
`step_XXXXXXXX` checkpoint folder, or a checkpoints folder (its newest valid checkpoint).
Weights are only ever read as safetensors, and a checkpoint is verified against its manifest
first: a truncated or modified checkpoint is refused rather than silently evaluated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from torch import nn

from accel_train.base.readers import read_yaml
from accel_train.base.weightfiles import read_safetensors
from accel_train.run.checkpoint import (MANIFEST, NAME_PATTERN, find_latest_valid,
                                        list_checkpoints, verify)
from accel_train.run.trainer_state import STATE_FILE, read_state
from accel_train.base.errors import UsageError
from accel_train.model.ema import EMA_FILE
from accel_train.model.saved import SPEC_FILE, WEIGHTS_FILE, ModelSpec
from accel_train.model.build import build_from_spec
from accel_train.train.precision import cpu_has_native_bf16
from accel_train.model.saved import holds_model_spec, is_import_path
from accel_train.run.rundir import CONFIG_FILE as RUN_CONFIG
from accel_train.run.rundir import run_paths
from accel_train.run.runlock import read_holder
# Prefixes that wrappers add to parameter names: DDP (`module.`) and torch.compile (`_orig_mod.`).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


@dataclass
class TrainedModel:
    spec: ModelSpec
    weights: Path                # a safetensors file
    run_dir: Optional[Path]      # the run it came from, when known (for its data and options)
    description: str             # for the user: which weights these are
    step: Optional[int] = None   # the optimizer step, for a checkpoint


def read_run_config(run_dir: Path) -> dict:
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        return {}
    return read_yaml(path, "run_config")  # readers.py: one line naming it when damaged


def as_the_run_ran(asked: str, resolved: dict, cuda: bool) -> tuple[str, bool]:
    """--mixed-precision auto on the kind of device the run trained on: the precision and memory
    format it ran in (config.yaml's resolved facts), which are also those of its own epoch-end
    evaluations.  Why: on a CPU, auto alone means fp32, and a run that chose bf16 there because
    it was faster (autotune.py) would be evaluated several times slower than it evaluated
    itself, and in another precision than its logged numbers."""
    device = str(resolved.get("device", "")).split(":")[0]
    if asked != "auto" or device != ("cuda" if cuda else "cpu"):
        return asked, False
    used = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}.get(resolved.get("precision_used"))
    if used == "bf16" and not cuda and not cpu_has_native_bf16():
        return asked, False  # trained where bf16 was native: emulated here, slower than fp32
    return used or asked, bool(resolved.get("channels_last"))


def _spec_for_checkpoint(checkpoint: Path, run_dir: Optional[Path]) -> ModelSpec:
    """The checkpoint's own model_config.json (written into every checkpoint since it exists),
    else its run's: the final model's config.json (or model_config.json), or the model recorded
    in config.yaml."""
    if (checkpoint / SPEC_FILE).is_file():
        return ModelSpec.read(checkpoint)
    if run_dir is not None:
        if holds_model_spec(run_dir):
            return ModelSpec.read(run_dir)
        recorded = read_run_config(run_dir).get("resolved", {}).get("model")
        if isinstance(recorded, dict):
            return ModelSpec.from_dict(recorded)
    raise UsageError(f"{checkpoint}: cannot tell which model this checkpoint holds (no "
                     f"{SPEC_FILE} in it and no run directory with one above it); pass the run "
                     f"directory or an export instead")


def _run_dir_of_checkpoint(checkpoint: Path) -> Optional[Path]:
    """<run>/checkpoints/step_N -> <run>, when that folder holds a run."""
    candidate = checkpoint.parent.parent
    if (candidate / RUN_CONFIG).is_file() or holds_model_spec(candidate):
        return candidate
    return None


def _from_checkpoint(checkpoint: Path, run_dir: Optional[Path], why: str = "") -> TrainedModel:
    problem = verify(checkpoint)
    if problem is not None:
        raise UsageError(f"checkpoint {checkpoint} is not usable ({problem}); pass another "
                         f"step_XXXXXXXX folder, or the run directory for its newest valid one")
    run_dir = run_dir or _run_dir_of_checkpoint(checkpoint)
    step = read_state(checkpoint).step
    return TrainedModel(_spec_for_checkpoint(checkpoint, run_dir), checkpoint / WEIGHTS_FILE,
                        run_dir, f"checkpoint {checkpoint} (step {step}){why}", step)


def _checkpoint_root(run_dir: Path) -> Path:
    """A run's checkpoint folder: <run>/checkpoints unless the run chose another (--checkpoint).
    The recorded path is absolute: for a run folder copied or moved elsewhere it names the
    original's, so it is followed only where the run chose its folder."""
    config = read_run_config(run_dir)
    recorded = config.get("resolved", {}).get("checkpoint_dir")
    chosen = (config.get("train") or {}).get("checkpoint")
    if chosen and recorded and Path(recorded).is_dir():
        return Path(recorded)
    return run_paths(run_dir).checkpoints


def find_trained_model(path_text: str, warn: Callable[[str], None],
                       ema: bool = False) -> TrainedModel:
    """Resolve RUN_OR_CHECKPOINT; `warn` is told about skipped (incomplete) checkpoints.
    `ema` (--ema): a checkpoint's EMA weights instead of its trained ones."""
    trained = _find(path_text, warn)
    return _ema_of(trained, path_text) if ema else trained


def _ema_of(trained: TrainedModel, path_text: str) -> TrainedModel:
    """The averaged weights beside a checkpoint's trained ones.  A final model or an export
    holds one set of weights, already the better of the two (config.json says which)."""
    if trained.step is None:
        raise UsageError(f"--ema: {path_text} holds one set of weights ({trained.description}, "
                         f"the {trained.spec.weights} weights); pass a checkpoint, "
                         f"<run>/checkpoints/step_XXXXXXXX, for its EMA weights, or drop --ema")
    averaged = trained.weights.parent / EMA_FILE
    if not averaged.is_file():
        raise UsageError(f"--ema: {trained.weights.parent} holds no EMA weights (its run trained "
                         f"without --model-ema); drop --ema")
    return dataclasses.replace(trained, spec=dataclasses.replace(trained.spec, weights="ema"),
                               weights=averaged, description=f"{trained.description}, "
                                                             f"its EMA weights")


def _find(path_text: str, warn: Callable[[str], None]) -> TrainedModel:
    path = Path(path_text)
    if not path.exists():
        raise UsageError(f"{path_text}: no such run directory, checkpoint or export folder")
    if not path.is_dir():
        raise UsageError(f"{path_text} is a file; pass the run directory, the step_XXXXXXXX "
                         f"checkpoint folder or the export folder that holds it")
    # A checkpoint copied under another name is still verified against its manifest, never
    # read as an export that nothing checks.
    if NAME_PATTERN.match(path.name) or (path / MANIFEST).is_file() and \
            (path / STATE_FILE).is_file():
        return _from_checkpoint(path, None)
    if (path / WEIGHTS_FILE).is_file() and holds_model_spec(path):
        run_dir = path if (path / RUN_CONFIG).is_file() else None
        kind = "the final model of run" if run_dir else "export"
        return TrainedModel(ModelSpec.read(path), path / WEIGHTS_FILE, run_dir, f"{kind} {path}")
    is_run = (path / RUN_CONFIG).is_file()
    root = _checkpoint_root(path) if is_run else path
    if list_checkpoints(root):
        latest = find_latest_valid(root, warn)
        if latest is None:
            raise UsageError(f"{path_text}: none of the checkpoints in {root} is complete; there "
                             f"is nothing to load")
        why = ", newest valid: training did not finish" if is_run else ", newest valid"
        return _from_checkpoint(latest, path if is_run else None, why)
    if is_run:
        raise _no_model_saved_yet(path_text, path)
    raise UsageError(f"{path_text} holds no trained model: expected a run directory (with "
                     f"{WEIGHTS_FILE} or checkpoints/), a step_XXXXXXXX checkpoint or an export")


def _no_model_saved_yet(path_text: str, run_dir: Path) -> UsageError:
    """A run folder whose training has saved neither a checkpoint nor its final model: still in
    its first epoch, or stopped before its first save.  "Expected a run directory" misread a
    run directory; its lock (runlock.py) tells a training that holds the folder."""
    holder = read_holder(run_paths(run_dir).lock)
    if holder is not None:
        return UsageError(f"{path_text} is a run whose training ({holder.describe()}) has saved "
                          f"no checkpoint yet; run this again after its first checkpoint "
                          f"(every --checkpoint-every steps and at each epoch's end)")
    return UsageError(f"{path_text} is a run whose training stopped before its first "
                      f"checkpoint: there is no model to load; train it again (it has "
                      f"nothing to resume from)")


def strip_wrapper_prefixes(state: dict) -> dict:
    """Parameter names as the bare model has them; wrappers nest (compile around DDP gives
    `_orig_mod.module.`), so strip until no wrapper prefix is shared by every name."""
    while state:
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)
        if prefix is None:
            break
        state = {key[len(prefix):]: value for key, value in state.items()}
    return state


def load_model(trained: TrainedModel) -> nn.Module:
    """The timm model rebuilt from its spec with the trained weights, in eval mode."""
    model = build_from_spec(trained.spec)
    state = strip_wrapper_prefixes(read_safetensors(
        trained.weights, trained.description,
        "train again, or use another checkpoint or export of the run"))
    try:
        model.load_state_dict(state)
    except RuntimeError:
        spec = trained.spec
        mismatch = state_dict_mismatch(state, model.state_dict())
        if is_import_path(spec.model_name):  # the user's code, which may have changed since
            raise UsageError(f"{spec.model_name} (num_classes={spec.num_classes}) builds another "
                             f"network than the one {trained.weights} was trained as "
                             f"({mismatch}); run with the factory as it was when the run "
                             f"trained, or train again") from None
        raise UsageError(f"{trained.weights} does not fit {spec.model_name} with "
                         f"{spec.num_classes} classes ({mismatch}); was its config.json or "
                         f"{SPEC_FILE} copied from another run?") from None
    return model.eval()


def state_dict_mismatch(saved: dict, built: dict) -> str:
    """The first differences between saved weights and a built model's, in words (torch's
    own message puts them on lines after a first line that names none)."""
    shapes = [f"{name}: {list(saved[name].shape)} saved, {list(built[name].shape)} built"
              for name in saved if name in built and saved[name].shape != built[name].shape]
    missing = [name for name in built if name not in saved]
    extra = [name for name in saved if name not in built]
    parts = shapes[:2] + ([f"not saved: {', '.join(missing[:3])}"] if missing else []) + \
        ([f"not built: {', '.join(extra[:3])}"] if extra else [])
    return "; ".join(parts) or "the same names and shapes, yet torch refused them"
