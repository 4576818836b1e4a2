"""Model EMA: timm's ModelEmaV3 over the bare model, evaluated beside it at every epoch end,
saved into every checkpoint as safetensors and restored on resume (a checkpointed part).
Without --model-ema the run's part is `NoEma`, which averages, evaluates and saves nothing.

Not registered with `accelerator.register_for_checkpointing`: Accelerate unpickles such objects
with weights_only=False (docs/architecture.md), and a checkpoint must never be able to run code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from accel_train.base.weightfiles import write_safetensors
from timm.utils import ModelEmaV3
from torch import nn

from accel_train.base.randomness import derive_seed
from accel_train.base.readers import check_fits, read_safetensors

EMA_FILE = "ema.safetensors"
EMA_ROUNDING_SALT = 0x656D61  # "ema"


class ModelEma:
    name = "ema"  # a checkpointed part (checkpoint.py)

    def __init__(self, model: nn.Module, decay: float, seed: int = 0,
                 warn: Callable[[str], None] = print):
        """`model`: the bare model the average follows (and starts from again when a resumed
        checkpoint holds no average)."""
        self.ema = ModelEmaV3(model, decay=decay)
        self.source, self.seed, self.warn = model, seed, warn

    @property
    def module(self) -> nn.Module:
        return self.ema.module

    def after_step(self, step: int) -> None:
        """After every optimizer step: the average takes in the model as it now is."""
        self.update(self.source, step)

    def averaged(self) -> dict[str, nn.Module]:
        """The averages evaluated beside the model, by name."""
        return {"ema": self.module}

    def update(self, model: nn.Module, step: int) -> None:
        # Newer timm rounds bf16 averages stochastically with a private generator seeded once
        # at construction: its draws would depend on the run's history (and restart on resume).
        # Seeded per step, they are a function of the step (randomness.py's rule).
        rounding = getattr(self.ema, "_sr_generator", None)
        if rounding is not None:
            rounding.manual_seed(derive_seed(self.seed, step, EMA_ROUNDING_SALT))
        self.ema.update(model, step=step)

    def save(self, folder: Path) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.module.state_dict().items()}
        write_safetensors(tensors, Path(folder) / EMA_FILE)

    def load(self, folder: Path) -> None:
        """The checkpoint's average; one saved without --model-ema has none, and the average
        starts again from the (already restored) weights."""
        path = Path(folder) / EMA_FILE
        if not path.is_file():
            self.warn(f"{folder} holds no EMA weights (saved without --model-ema): the average "
                      f"starts from the resumed weights")
            self.ema.set(self.source)
            return
        check_fits(path, "checkpoint_weights",  # another model's average is one line
                   {k: tuple(v.shape) for k, v in self.module.state_dict().items()})
        self.module.load_state_dict(read_safetensors(path, "checkpoint_weights"))


class NoEma:
    name = "ema"

    def after_step(self, step: int) -> None:
        pass

    def averaged(self) -> dict[str, nn.Module]:
        return {}

    def save(self, folder: Path) -> None:
        pass

    def load(self, folder: Path) -> None:
        pass


def maybe_ema(model: nn.Module, config, warn: Callable[[str], None]):
    """ModelEma over `model` (the bare model) with --model-ema, else NoEma."""
    if not config.model_ema:
        return NoEma()
    return ModelEma(model, config.model_ema_decay, config.seed, warn)
