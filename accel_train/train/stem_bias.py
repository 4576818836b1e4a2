"""--whiten-bias-epochs N: the whitened first layer's bias trains for the first N epochs only.

Why: airbench (Keller Jordan, arXiv:2404.00498) trains the bias of its whitening layer for its
first 3 epochs and then fixes it (its `whiten_bias_train_epochs`): the layer's weights are a
fixed change of basis of the pixels, and once the shift after it has settled, moving it further
only shifts what every later layer has adapted to.

How: from epoch N on, the bias's gradient is dropped (set to None) after every backward pass,
and torch's optimizers skip a parameter without a gradient: no update, no momentum, no weight
decay, as airbench's `requires_grad = False` gives.  Not `requires_grad` itself: DDP records
the parameters that need gradients when it wraps the model and expects each of their gradients
at every step.  The gradient is still computed and exchanged (airbench's layer: 24 numbers).
A function of the epoch alone, so a resumed run stops it at the same epoch; nothing to save.
"""

from __future__ import annotations

from torch import nn

from accel_train.model.whitening import first_conv


class StemBiasStop:
    def __init__(self, bias: nn.Parameter, epochs: int):
        self.bias, self.epochs = bias, epochs

    def before_update(self, epoch: int) -> None:
        """Called after the backward pass of every micro-batch of (0-based) `epoch`."""
        if epoch >= self.epochs:
            self.bias.grad = None


class NoStemBiasStop:
    def before_update(self, epoch: int) -> None:
        pass


def maybe_stem_bias_stop(model: nn.Module, config):
    """StemBiasStop over the whitened layer's bias of `model` (the bare model) with
    --whiten-bias-epochs, else NoStemBiasStop (also for a layer without a bias)."""
    if config.whiten_bias_epochs is None:
        return NoStemBiasStop()
    _, conv = first_conv(model)
    if conv.bias is None or not conv.bias.requires_grad:
        return NoStemBiasStop()
    return StemBiasStop(conv.bias, config.whiten_bias_epochs)
