"""A program that trains through `accel_train.fit` and goes on; run under a real launcher by
test_process_group_end.py:

    torchrun --nproc-per-node 2 -m tests.fit_threads_probe WORK_DIR [fails | refused]

Each rank writes the kernel names of the threads its process still has (gloo names its worker
threads `pt_gloo_runloop` and `gloo_tcp_loop`) to WORK_DIR/threads-WHEN-RANK.json: once fit
(whose run folder is WORK_DIR/run) has returned, and from an exit handler registered before
fit, so run after any the run registers (Python runs them last registered first), before the
interpreter finalizes.  `fails`: a callback raises at the second step; `refused`: a narrower
network resumes WORK_DIR/run (a probe's run), which the trainer refuses after it has prepared
DDP.  The program catches either error (whose traceback holds the run) and goes on."""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torchvision.datasets import FakeData

import accel_train
from accel_train.base.errors import UsageError
from accel_train.callbacks import Callback


GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # what gloo names its worker threads


class ProbeFailure(RuntimeError):
    pass


class FailAtSecondStep(Callback):
    def on_step_end(self, trainer, step: int) -> None:
        if step == 2:
            raise ProbeFailure("the probe's callback failed at step 2")


def thread_names() -> list[str]:
    """What the kernel calls each thread of this process (an oracle outside Python and torch)."""
    tasks = f"/proc/{os.getpid()}/task"
    names = []
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/comm") as handle:
                names.append(handle.read().strip())
        except FileNotFoundError:  # ended while listed
            pass
    return sorted(names)


def report(work: Path, when: str) -> None:
    """A file per rank, not a line on the launcher's shared output, where the ranks' writes
    interleave."""
    (work / f"threads-{when}-{os.environ['RANK']}.json").write_text(json.dumps(thread_names()))


def main() -> int:
    work, mode = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else ""
    atexit.register(report, work, "at-exit")
    torch.manual_seed(0)
    width = 4 if mode == "refused" else 8
    model = nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(width, 2))
    images = {split: FakeData(size, (3, 16, 16), num_classes=2, random_offset=offset)
              for split, size, offset in (("train", 64, 0), ("eval", 32, 1000))}
    try:
        accel_train.fit(model, images["train"], images["eval"], batch_size=8, epochs=1,
                        accumulation_steps=2, mixed_precision="no",
                        channels_last=False, plots=False, progress="log",
                        callbacks=[FailAtSecondStep()] if mode == "fails" else [],
                        resume="auto" if mode == "refused" else None,
                        output_dir=str(work / "run"))
    except (ProbeFailure, UsageError) as error:
        print(f"fit raised: {error}", flush=True)
    report(work, "after-fit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
