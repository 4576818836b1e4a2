"""Networks whose forward returns more than the logits tensor.

timm's networks return the logits.  Networks from elsewhere wrap them in an object that names
them `logits`: Hugging Face transformers' image classifiers return a `ModelOutput`
(`ImageClassifierOutput...`), and torchvision's Inception v3 and GoogLeNet a named tuple
`(logits, aux_logits...)` in train mode.  The run trains and evaluates on the logits alone, as
those networks are used for inference: an auxiliary head gets no loss.

A forward hook (public nn.Module API) makes such a network's calls return the logits, in one
place rather than at each call (the training step, evaluation and its TTA views, the speed
probe, the first-forward check and the unused-parameter search, predict, the ONNX export and
its check, and a callback's own calls).  Copies (deepcopy: EMA, the speed probe's fresh copies)
keep the hook, and torch.export traces it.  The auxiliary head's parameters get no gradient:
build.unused_parameters finds them, so DDP is told to look for them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def logits_from(output: Any) -> Any:
    """`output` if it is a tensor, else its `logits` attribute where that is a tensor;
    anything else unchanged (build.check_first_forward names what it is)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else output


def _logits_of_output(module: nn.Module, args: tuple, output: Any) -> Any:
    return logits_from(output)


def return_logits(model: nn.Module) -> RemovableHandle:
    """From now on `model(images)` returns the logits tensor (unchanged for a network that
    returns it already); the handle's `remove()` undoes it (a program's own module, at the
    end of its run)."""
    return model.register_forward_hook(_logits_of_output)
