"""A network that leaves some of its parameters out of some steps only: a layer skipped at
random (LayerDrop, stochastic depth that skips the block instead of scaling it), or a branch
its input chooses.

DDP without find_unused_parameters waits for a gradient of every parameter at every step.  The
start finds the parameters a train-mode forward never uses (build.unused_parameters) and has
DDP look for those, but one forward cannot see a layer that is skipped only now and then: the
first step that skips it leaves DDP's reduction unfinished, and the next forward raised
torch's RuntimeError, whose advice (find_unused_parameters=True in DistributedDataParallel)
a user of the command line cannot follow.  --ddp-find-unused-parameters can; this names it
(seen on 2 gloo processes both where the ranks skipped the same layer and where their own
random draws differed)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from accel_train.base.errors import UsageError

# The start of the RuntimeError DDP's forward raises after a step that left a parameter
# without a gradient (torch/nn/parallel/distributed.py, Reducer::prepare_for_forward)
DDP_UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"


@contextlib.contextmanager
def naming_skipped_parameters(step: int, model: str) -> Iterator[None]:
    """Around the training forward of optimizer step `step` (counted from 1) of --model
    `model`: DDP's unfinished-reduction error becomes one line naming the option."""
    try:
        yield
    except RuntimeError as err:
        if DDP_UNFINISHED_REDUCTION not in str(err):
            raise
        raise UsageError(
            f"training stopped at step {step}: --model {model} left some of its trainable "
            f"parameters without a gradient in the step before (a layer skipped at random, as "
            f"LayerDrop does, or a branch the input chooses), and DDP waits for a gradient of "
            f"each at every step; pass --ddp-find-unused-parameters (DDP then looks for them "
            f"at every step), or have every parameter take part in every step; checkpoints "
            f"written before are intact") from None
