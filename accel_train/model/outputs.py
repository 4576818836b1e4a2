"""Networks whose forward returns more than the logits tensor.

timm's networks return the logits.  Networks from elsewhere wrap them in an object that names
them `logits`: Hugging Face transformers' image classifiers return a `ModelOutput`
(`ImageClassifierOutput...`), torchvision's Inception v3 and GoogLeNet a named tuple
`(logits, aux_logits...)` in train mode, and a program's own may return a dict with a
"logits" entry.  The run trains and evaluates on the logits alone, as
those networks are used for inference: an auxiliary head gets no loss, unless
--aux-loss-weight asks for its loss (torchvision's fine-tuning tutorial trains Inception v3 on
the logits' loss plus 0.4 times the auxiliary logits'; GoogLeNet's paper weighs its two 0.3).

A forward hook (public nn.Module API) makes such a network's calls return the logits, in one
place rather than at each call (the training step, evaluation and its TTA views, the speed
probe, the first-forward check and the unused-parameter search, predict, the ONNX export and
its check, and a callback's own calls).  Copies (deepcopy: EMA, the speed probe's fresh copies)
keep the hook, and torch.export traces it.  The auxiliary head's parameters get no gradient:
build.unused_parameters finds them, so DDP is told to look for them.  Where their loss trains,
the hook sets the auxiliary logits of each train-mode forward aside, on the module it is
registered on (`keep_auxiliary_logits`), for the training step to take.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def logits_from(output: Any) -> Any:
    """`output` if it is a tensor, else its `logits` attribute or, for a dict (a program's
    forward returning {"logits": ..., "features": ...}), its "logits" entry where that is a
    tensor; anything else unchanged (build.check_first_forward names what it is)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(
        output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else output


# the attribute of a module whose auxiliary logits are kept (a plain attribute: no state_dict
# entry, and copies of the module keep their own)
AUXILIARY_LOGITS = "accel_train_auxiliary_logits"


class AuxiliaryLogits:
    """The auxiliary logits of the module's last train-mode forward, until taken."""

    def __init__(self) -> None:
        self.kept: tuple[torch.Tensor, ...] = ()

    def take(self) -> tuple[torch.Tensor, ...]:
        kept, self.kept = self.kept, ()  # not held past the step: they hold its graph
        return kept


def auxiliary_logits_of(output: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of a named tuple's fields named aux_logits*: torchvision's InceptionOutputs
    (aux_logits) and GoogLeNetOutputs (aux_logits2, aux_logits1); () for anything else."""
    names = getattr(output, "_fields", ())
    return tuple(value for name in names if name.startswith("aux_logits")
                 for value in (getattr(output, name),) if isinstance(value, torch.Tensor))


def keep_auxiliary_logits(model: nn.Module) -> AuxiliaryLogits:
    """From now on the logits hook of `model` keeps its auxiliary logits (return_logits)."""
    kept = AuxiliaryLogits()
    setattr(model, AUXILIARY_LOGITS, kept)
    return kept


def kept_auxiliary_logits(model: nn.Module) -> tuple[torch.Tensor, ...]:
    """What `model`'s last forward set aside (keep_auxiliary_logits), taken; () where nothing
    is kept."""
    kept = getattr(model, AUXILIARY_LOGITS, None)
    return kept.take() if kept is not None else ()


def _logits_of_output(module: nn.Module, args: tuple, output: Any) -> Any:
    kept = getattr(module, AUXILIARY_LOGITS, None)
    if kept is not None:
        kept.kept = auxiliary_logits_of(output)
    return logits_from(output)


class LogitsHook:
    """The hook return_logits registered; `remove()` undoes it, kept auxiliary logits too."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.handle: RemovableHandle = model.register_forward_hook(_logits_of_output)

    def remove(self) -> None:
        self.handle.remove()
        self.model.__dict__.pop(AUXILIARY_LOGITS, None)


def return_logits(model: nn.Module) -> LogitsHook:
    """From now on `model(images)` returns the logits tensor (unchanged for a network that
    returns it already); the hook's `remove()` undoes it (a program's own module, at the
    end of its run)."""
    return LogitsHook(model)
