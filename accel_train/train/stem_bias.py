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
anchor's").  Two cases keep it requiring one, the gradient computed and only dropped:
- under DDP: it records the parameters that need gradients when it wraps the model and
  expects each of their gradients at every step (its find_unused_parameters would let it
  go, at the price of a graph traversal every step and a warning from the reducer while the
  bias still trains);
- under --compile on a GPU: torch.compile's graphs hold for the requires_grad they were
  traced with, so the flip compiles the model a second time in mid-run.  On a 2-core Xeon
  (cifar_airbench, batch 512, inductor) that took 16.5 s, repaid in about three epochs of the
  5% it saves.  On an H200 compiling took 20 s of the GPU recipe's first epoch, whose later
  epochs take under 0.4 s each: a second compile would cost more than that layer's backward
  pass over the whole run.
The updates are the same either way.  A function of the epoch alone, so a resumed run stops
it at the same epoch; nothing to save.
"""

from __future__ import annotations

from torch import nn

from accel_train.model.whitening import first_conv


class StemBiasStop:
    def __init__(self, bias: nn.Parameter, epochs: int, keeps_requiring_grad: bool):
        self.bias, self.epochs = bias, epochs
        self.keeps_requiring_grad = keeps_requiring_grad

    def before_update(self, epoch: int) -> None:
        """Called after the backward pass of every micro-batch of (0-based) `epoch`."""
        if epoch >= self.epochs:
            self.bias.grad = None
            if not self.keeps_requiring_grad:
                self.bias.requires_grad_(False)


class NoStemBiasStop:
    def before_update(self, epoch: int) -> None:
        pass


def maybe_stem_bias_stop(model: nn.Module, config, distributed: bool, device_type: str):
    """StemBiasStop over the whitened layer's bias of `model` (the bare model) with
    --whiten-bias-epochs, else NoStemBiasStop (also for a layer without a bias).
    `distributed`: the trained model is wrapped in DDP (more than one process); then, and
    with --compile on a device other than the CPU (`device_type`, torch's name), the bias
    keeps requiring a gradient (see above)."""
    if config.whiten_bias_epochs is None:
        return NoStemBiasStop()
    _, conv = first_conv(model)
    if conv.bias is None or not conv.bias.requires_grad:
        return NoStemBiasStop()
    return StemBiasStop(conv.bias, config.whiten_bias_epochs,
                        keeps_requiring_grad=distributed or (config.compile
                                                             and device_type != "cpu"))
