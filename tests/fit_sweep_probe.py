"""A program that trains one network at several learning rates, one `accel_train.fit` after
another in the same processes (a sweep); run under a real launcher by test_sweep_in_one_program.py:

    torchrun --nproc-per-node 2 -m tests.fit_sweep_probe WORK_DIR 0.1,0.01
    python -m tests.fit_sweep_probe WORK_DIR 0.1/bf16,0.01
    torchrun --nproc-per-node 2 -m tests.fit_sweep_probe WORK_DIR 0.1/no/fails,0.01/no own-group

A run is LR[/PRECISION[/fails]]: `mixed_precision` ("auto" when not given); `fails`: a
callback raises at the run's second step, which the program catches (printing `run failed`)
before it goes on.  Each run goes to WORK_DIR/run-LR, from the same initial weights and data,
so a run made second in a sweep can be compared with the same run made alone in a new program.
The network is wide enough at 32 px for bf16 to run it about three times as fast as fp32 where
the CPU has native bf16 (timed on a 2-core Intel Xeon with AMX), so that "auto" has a choice to
make there.

`own-group`: the program starts the default process group itself, as scripts written for
torchrun do, gives the runs a tight collective timeout (3 s), and after them reduces over its
group with rank 1 arriving 6 s late, printing `after the sweep: all_reduce SUM` on each rank,
and `gloo threads: BEFORE -> AFTER`, the program's gloo threads before the first run and after
the last once the garbage is collected (fit_threads_probe.thread_names)."""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchvision.datasets import FakeData

import accel_train
from accel_train.callbacks import Callback
from tests.fit_threads_probe import GLOO_THREADS, thread_names


class ProbeFailure(RuntimeError):
    pass


class FailAtSecondStep(Callback):
    def on_step_end(self, trainer, step: int) -> None:
        if step == 2:  # after the epoch's first step has set the tight timeout
            raise ProbeFailure("the probe's callback failed at step 2")


def gloo_threads() -> int:
    return sum(name in GLOO_THREADS for name in thread_names())


def main() -> int:
    work, own_group = Path(sys.argv[1]), sys.argv[3:] == ["own-group"]
    runs = [(parts[0], parts[1] if len(parts) > 1 else "auto", parts[2:] == ["fails"])
            for parts in (run.split("/") for run in sys.argv[2].split(","))]
    if own_group:
        dist.init_process_group("gloo")
        dist.barrier()
        # gloo may start one of the group's threads just after the first collective returns
        # (measured: one rank read 2 where the other read 3, and 3 on both after the sweep)
        time.sleep(1)
        threads_before = gloo_threads()
    images = {split: FakeData(size, (3, 32, 32), num_classes=2, random_offset=offset)
              for split, size, offset in (("train", 64, 0), ("eval", 32, 1000))}
    for learning_rate, precision, fails in runs:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 32, 3), nn.BatchNorm2d(32), nn.ReLU(),
                              nn.Conv2d(32, 32, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(32, 2))
        try:
            accel_train.fit(model, images["train"], images["eval"], batch_size=8, epochs=1,
                            accumulation_steps=2, learning_rate=float(learning_rate),
                            mixed_precision=precision, channels_last=False, plots=False,
                            progress="log", output_dir=str(work / f"run-{learning_rate}"),
                            callbacks=[FailAtSecondStep()] if fails else [],
                            **({"collective_timeout": 3} if own_group else {}))
        except ProbeFailure:
            print("run failed", flush=True)
    if own_group:
        time.sleep(6 * dist.get_rank())  # longer than the runs' timeout, far within torch's
        total = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(total)
        print(f"after the sweep: all_reduce {total.item()}", flush=True)
        gc.collect()  # a failed run's trainer, in reference cycles the program dropped
        print(f"gloo threads: {threads_before} -> {gloo_threads()}", flush=True)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
