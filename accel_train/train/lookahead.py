"""--lookahead-every K: airbench's Lookahead-style weight averaging.

Every K optimizer steps a slow copy of the model's floating-point state (weights and BatchNorm
statistics) moves towards the trained one, slow += (1 - rho) * (model - slow), and training goes
on from the slow copy (model = slow): Lookahead (Zhang et al., 2019), with airbench's decay
(Keller Jordan, arXiv:2404.00498), which grows over the run, rho = 0.95**K * progress**3, where
progress is the step over the run's planned total (the time budget's latest fit).  Early on
the weights move freely; towards the end they are averaged strongly, which a short run's last
epochs need most.  When training ends the model is set to the slow copy, so that what is
finally evaluated, checkpointed and exported is the average.  An epoch end before that leaves
the weights as trained: setting them to the slow copy there would drop the up to K - 1 steps
since the last sync (about 4% of a 10-epoch run of 48-step epochs at K = 5), and airbench94
copies the average back only after its last step.

Without --lookahead-every the run's part is `NoLookahead`, which does nothing.

Not timm's Lookahead (`--optimizer lookahead_NAME`): that one pulls the weights halfway back
every k steps from the first step to the last, which slows a short run's start.  No random
draws; the slow copy is a checkpointed part (safetensors), so a resumed run averages on from
where the stopped one stood.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from accel_train.base.weightfiles import write_safetensors
from torch import nn

from accel_train.base.readers import check_fits, read_safetensors

LOOKAHEAD_FILE = "lookahead.safetensors"
DECAY_PER_STEP = 0.95   # airbench's decay_base: rho's ceiling is this to the power K
DECAY_POWER = 3.0       # airbench's decay_pow: rho = ceiling * progress ** 3


def decay(every: int, step: int, total_steps: int) -> float:
    """rho at optimizer step `step` of `total_steps`: how much of the slow copy a sync keeps."""
    progress = min(1.0, step / max(1, total_steps))
    return DECAY_PER_STEP ** every * progress ** DECAY_POWER


class LookaheadAverage:
    name = "lookahead"  # a checkpointed part (checkpoint.py)

    def __init__(self, model: nn.Module, every: int, total_steps: Callable[[], int],
                 warn: Callable[[str], None] = print):
        """`model`: the bare model (not a DDP wrapper); its floating-point state at this moment
        starts the slow copy.  `total_steps()`: the run's planned total as it stands (a time
        budget fits it again as the run goes)."""
        if every < 1:
            raise ValueError(f"every must be >= 1 (got {every})")
        self.model, self.every, self.warn = model, every, warn
        self.total_steps = total_steps
        self.slow = self._copy_of_model()

    def _floats(self) -> dict[str, torch.Tensor]:
        return {key: value for key, value in self.model.state_dict().items()
                if value.is_floating_point()}

    def _copy_of_model(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().clone() for key, value in self._floats().items()}

    def after_step(self, step: int) -> None:
        """Called after every optimizer step (1-based `step`): syncs on every K-th."""
        if step % self.every == 0:
            self._sync(decay(self.every, step, self.total_steps()))

    def at_training_end(self) -> None:
        """The model takes the slow copy as it stands (airbench's rho = 1 sync after its last
        step)."""
        self._sync(1.0)

    def _sync(self, rho: float) -> None:
        # no_grad as a block, not a decorator: mutmut leaves decorated functions alone
        with torch.no_grad():
            for key, value in self._floats().items():
                slow = self.slow[key]
                slow.lerp_(value.to(slow.dtype), 1.0 - rho)
                value.copy_(slow)

    def save(self, folder: Path) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.slow.items()}
        write_safetensors(tensors, Path(folder) / LOOKAHEAD_FILE)

    def load(self, folder: Path) -> None:
        """The checkpoint's slow copy; one saved without --lookahead-every has none, and the
        average starts again from the (already restored) weights."""
        path = Path(folder) / LOOKAHEAD_FILE
        if not path.is_file():
            self.warn(f"{folder} holds no lookahead average (saved without --lookahead-every): "
                      f"the average starts from the resumed weights")
            self.slow = self._copy_of_model()
            return
        check_fits(path, "checkpoint_weights", {k: tuple(v.shape) for k, v in self.slow.items()})
        for key, value in read_safetensors(path, "checkpoint_weights").items():
            self.slow[key].copy_(value)


class NoLookahead:
    name = "lookahead"

    def after_step(self, step: int) -> None:
        pass

    def at_training_end(self) -> None:
        pass

    def save(self, folder: Path) -> None:
        pass

    def load(self, folder: Path) -> None:
        pass


def maybe_lookahead(model: nn.Module, config, total_steps: Callable[[], int],
                    warn: Callable[[str], None]):
    """LookaheadAverage over `model` (the bare model) with --lookahead-every, else NoLookahead."""
    if not config.lookahead_every:
        return NoLookahead()
    return LookaheadAverage(model, config.lookahead_every, total_steps, warn)
