"""--whiten-bias-epochs N: the whitened first layer's bias trains for the first N epochs only.

Why: airbench (Keller Jordan, arXiv:2404.00498) trains the bias of its whitening layer for its
first 3 epochs and then fixes it (its `whiten_bias_train_epochs`): the layer's weights are a
fixed change of basis of the pixels, and once the shift after it has settled, moving it further
only shifts what every later layer has adapted to.

How: from epoch N on, the bias's gradient is dropped (set to None) after every backward pass,
and torch's optimizers skip a parameter without a gradient: no update, no momentum, no weight
decay, as airbench's `requires_grad = False` gives.  In one process the bias then also stops
requiring a gradient, as airbench's does: with the layer's weights fixed, nothing before the
next layer's weights needs a backward pass any more, and skipping it (the layer's and its
activation's backward over the largest activation of the network) made a step of
cifar_airbench 5% faster on a 2-core Xeon (benchmarks/BENCHMARKS.md, "The step, against the
anchor's").  Not under DDP: it records the parameters that need gradients when it wraps the
model and expects each of their gradients at every step, so there the gradient is still
computed and exchanged (airbench's layer: 24 numbers) and only dropped.  The updates are the
same either way.  A function of the epoch alone, so a resumed run stops it at the same epoch;
nothing to save.
"""

from __future__ import annotations

from torch import nn

from accel_train.model.whitening import first_conv


class StemBiasStop:
    def __init__(self, bias: nn.Parameter, epochs: int, distributed: bool):
        self.bias, self.epochs = bias, epochs
        self.may_stop_requiring_grad = not distributed

    def before_update(self, epoch: int) -> None:
        """Called after the backward pass of every micro-batch of (0-based) `epoch`."""
        if epoch >= self.epochs:
            self.bias.grad = None
            if self.may_stop_requiring_grad:
                self.bias.requires_grad_(False)


class NoStemBiasStop:
    def before_update(self, epoch: int) -> None:
        pass


def maybe_stem_bias_stop(model: nn.Module, config, distributed: bool):
    """StemBiasStop over the whitened layer's bias of `model` (the bare model) with
    --whiten-bias-epochs, else NoStemBiasStop (also for a layer without a bias).
    `distributed`: the trained model is wrapped in DDP (more than one process)."""
    if config.whiten_bias_epochs is None:
        return NoStemBiasStop()
    _, conv = first_conv(model)
    if conv.bias is None or not conv.bias.requires_grad:
        return NoStemBiasStop()
    return StemBiasStop(conv.bias, config.whiten_bias_epochs, distributed)
