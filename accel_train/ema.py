"""Model EMA: timm's ModelEmaV3 over the bare model, evaluated beside it at every epoch end,
saved into every checkpoint as safetensors and restored on resume.

Not registered with `accelerator.register_for_checkpointing`: Accelerate unpickles such objects
with weights_only=False (DESIGN.md), and a checkpoint must never be able to run code.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file
from timm.utils import ModelEmaV3
from torch import nn

EMA_FILE = "ema.safetensors"


class ModelEma:
    def __init__(self, model: nn.Module, decay: float):
        self.ema = ModelEmaV3(model, decay=decay)

    @property
    def module(self) -> nn.Module:
        return self.ema.module

    def update(self, model: nn.Module, step: int) -> None:
        self.ema.update(model, step=step)

    def save(self, folder: Path) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.module.state_dict().items()}
        save_file(tensors, str(Path(folder) / EMA_FILE))

    def load(self, folder: Path) -> bool:
        """Restore from a checkpoint folder; False when it holds no EMA (saved without one)."""
        path = Path(folder) / EMA_FILE
        if not path.is_file():
            return False
        self.module.load_state_dict(load_file(str(path)))
        return True
