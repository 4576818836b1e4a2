"""`python -m tests.slurm_entry ARGS`: the accel_train command line with one callback for the SLURM
tests (tests/test_slurm.py), which start it through scripts/slurm/train.sbatch with
ACCEL_TRAIN_MODULE=tests.slurm_entry.  The product reads none of these variables.

* ACCEL_TRAIN_TEST_PAUSE_AT_STEP=STEP: in the job's first allocation (SLURM_RESTART_COUNT
  unset or 0), rank 0 waits before the first micro-batch of optimizer step STEP until its
  SIGTERM arrives, and says so on stdout ("slurm test: waiting for SIGTERM at step STEP").  The
  test sends the pre-emption signal when it reads that line, so the stop falls at exactly STEP
  whatever the machine's speed.  The other ranks wait in their first collective of that step.
  Without a signal it goes on after WAIT_SECONDS (the test then fails, never hangs).
* ACCEL_TRAIN_TEST_STAND_IN=1: no training at all, for tests of the batch script's own rules
  (quick to start: torch is never imported).  Every rank prints "slurm test: stand-in rank R of
  allocation A waiting for SIGTERM", waits for it, and exits 143 as a stopped training does.
"""

from __future__ import annotations

import os
import signal
import sys
import time

PAUSE_ENV = "ACCEL_TRAIN_TEST_PAUSE_AT_STEP"
STAND_IN_ENV = "ACCEL_TRAIN_TEST_STAND_IN"
WAIT_SECONDS = 180.0


def pause_until_sigterm(wanted_step: int):
    """A callback (accel_train.callbacks): see the module docstring."""
    from accel_train.callbacks import Callback

    class PauseUntilSigterm(Callback):
        done = False

        def on_batch_start(self, trainer, batch) -> None:
            step = trainer.state.step + 1
            if self.done or step != wanted_step or int(os.environ.get("RANK", 0)) != 0:
                return
            self.done = True
            received = []
            previous = signal.getsignal(signal.SIGTERM)  # the trainer's: still called

            def note(signum, frame):
                received.append(signum)
                if callable(previous):
                    previous(signum, frame)

            signal.signal(signal.SIGTERM, note)
            print(f"slurm test: waiting for SIGTERM at step {step}", flush=True)
            deadline = time.monotonic() + WAIT_SECONDS
            while not received and time.monotonic() < deadline:
                time.sleep(0.05)
            signal.signal(signal.SIGTERM, previous)

    return PauseUntilSigterm()


def stand_in() -> int:
    """See the module docstring: wait for SIGTERM, exit 143."""
    received = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    allocation = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    print(f"slurm test: stand-in rank {os.environ.get('RANK', 0)} of allocation {allocation} "
          f"waiting for SIGTERM", flush=True)
    deadline = time.monotonic() + WAIT_SECONDS
    while not received and time.monotonic() < deadline:
        time.sleep(0.05)
    return 143 if received else 1


def main() -> int:
    if os.environ.get(STAND_IN_ENV) == "1":
        return stand_in()
    import functools

    from accel_train import cli, trainer

    restarted = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    if os.environ.get(PAUSE_ENV) and not restarted:
        # cli.main looks run_training up as it trains: the run gets the callback
        trainer.run_training = functools.partial(
            trainer.run_training, callbacks=[pause_until_sigterm(int(os.environ[PAUSE_ENV]))])
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())  # as `python -m accel_train` ends (cli.entry)
