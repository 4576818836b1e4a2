"""`python -m tests.budget_skew_entry ARGS`: the accel_train command line, with rank 1's
--time-budget clock started BUDGET_SKEW_SECONDS earlier than rank 0's, for test_time_budget.py.

That is what happens when rank 0 reaches the first training step later than rank 1 (rank 0 alone
writes config.yaml, starts the trackers, prints the summary) while rank 1 already waits in the
first all-reduce: the ranks start their clocks at different moments.  The product itself reads
no such variable.
"""

from __future__ import annotations

import os
import sys

SKEW_ENV = "BUDGET_SKEW_SECONDS"


def main() -> int:
    skew = float(os.environ.get(SKEW_ENV) or 0)
    if skew and os.environ.get("RANK") == "1":
        from accel_train.train import budget

        start = budget.TimeBudget.start

        def start_earlier(self, step: int) -> None:
            start(self, step)
            self.started -= skew

        budget.TimeBudget.start = start_earlier
    from accel_train import cli

    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())  # as `python -m accel_train` ends (cli.entry)
