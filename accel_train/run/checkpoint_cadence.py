"""Which epoch ends checkpoint: every one, or (--checkpoint-minutes M) only those reached M
minutes or more after the run's last checkpoint.

Why: the loop waits for each save's files (the weights and the optimizer's state copied to the
host, serialized, written: save_finishing.py seals the rest on a thread), 1.1 s for
wide_resnet50_2's 510 MB on 2 CPU cores (bench_checkpoint.py), and a GPU's queued steps drain
before the copy.  Where an epoch is short (a fine-tune of a few thousand photos on a fast GPU,
CIFAR-10 at airbench's pace) a save at every end is a share of the run; a save every few
minutes bounds what a hard kill loses to those minutes at a share the user chooses.

What always saves all the same: the run's last step (its end is what a finished run is
recognised by), a stop signal (the trainer saves it itself), --checkpoint-every's steps, and an
evaluation that is the run's best so far under --keep-best (which can keep only what was
saved).  Rank 0's clock decides for every rank: a save is collective.
"""

from __future__ import annotations

import time
from typing import Callable

from accel_train.base.ranks import decide_on_main


class CheckpointCadence:
    """The clock of the last checkpoint (this start's beginning before the first one)."""

    def __init__(self, minutes: float, clock: Callable[[], float] = time.monotonic):
        self.seconds = minutes * 60
        self.clock = clock
        self.last = clock()

    def saved(self) -> None:
        self.last = self.clock()

    def epoch_end_saves(self, must: bool) -> bool:
        """Whether an epoch end checkpoints; `must`: it does whatever the clock says (the same
        on every rank, so that only where it is False do the ranks ask rank 0's clock)."""
        if must or not self.seconds:
            return True
        return decide_on_main(lambda: self.clock() - self.last >= self.seconds)
