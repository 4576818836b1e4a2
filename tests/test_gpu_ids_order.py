"""--gpu_ids reaches CUDA_VISIBLE_DEVICES before anything asks torch about CUDA, on the whole path
of a training run (`cli.main` -> `run_training`), not only in distributed.setup: the driver reads
the variable once, when CUDA starts, and a query made earlier (torch.cuda.is_available() may
start it) would leave the run on the GPUs it had before, silently.

The run is the real command line in a process of its own whose torch CUDA queries are guarded
before accel_train is imported: each query records the CUDA_VISIBLE_DEVICES it sees, and one
made while that is not yet the --gpu_ids value ends the process at once (exit 97, with the
stack of the query).
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import PINNED, run
from conftest import test_env as child_env  # not test_*: pytest would collect it

TOO_EARLY = 97
# The torch.cuda functions that ask the driver, or may start CUDA to answer.
QUERIES = ("is_available", "device_count", "is_initialized", "init", "current_device",
           "get_device_capability", "get_device_properties", "get_device_name",
           "is_bf16_supported", "mem_get_info", "set_device")
GUARDED_RUN = r"""
import os, sys, traceback
import torch

wanted, record, queries = sys.argv[1], sys.argv[2], sys.argv[3].split(",")


def guarded(name, query):
    def asked(*args, **kwargs):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        with open(record, "a") as seen:
            seen.write(f"{name} {visible}\n")
        if visible != wanted:
            sys.stderr.write(f"torch.cuda.{name}() asked with CUDA_VISIBLE_DEVICES={visible!r}, "
                             f"before --gpu_ids {wanted} was applied:\n"
                             + "".join(traceback.format_stack()))
            sys.stderr.flush()
            os._exit(%d)
        return query(*args, **kwargs)
    return asked


for name in queries:
    setattr(torch.cuda, name, guarded(name, getattr(torch.cuda, name)))
from accel_train.cli import main  # after: every module it imports sees the guarded queries

sys.exit(main(sys.argv[4:]))
""" % TOO_EARLY


@pytest.mark.slow
def test_gpu_ids_are_visible_before_the_first_cuda_query_of_a_training_run(tmp_path):
    gpus = torch.cuda.device_count()
    wanted = "1" if gpus != 1 else "0"  # one this machine has, where it has any
    record = tmp_path / "queries.txt"
    env = child_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = run([sys.executable, "-c", GUARDED_RUN, wanted, str(record), ",".join(QUERIES),
                  "--dataset", "synthetic", "--synthetic-train-size", "64", "--model",
                  "test_resnet", "--batch-size", "16", "--max-steps", "1", "--epochs", "1",
                  "--max-eval-samples", "32", "--no-plots", "--progress", "log", *PINNED,
                  "--output-dir", str(tmp_path / "run"), "--gpu_ids", wanted], env=env)
    assert result.returncode != TOO_EARLY, result.stderr[-6000:]
    seen = record.read_text().splitlines() if record.exists() else []
    # Asked at all (else this test guards nothing), and only once the variable was set.
    assert seen and all(line.split()[1] == wanted for line in seen), seen
    if gpus == 0:
        # As far as a machine without CUDA goes: the check that needs an answer from CUDA.
        assert result.returncode == 2, result.stderr[-6000:]
        assert result.stderr.strip().splitlines()[-1] == (
            f"accel_train: error: --gpu_ids {wanted} given but this machine has no CUDA "
            f"device; drop --gpu_ids to train on the CPU"), result.stderr[-3000:]
    else:
        assert result.returncode == 0, result.stderr[-6000:]
        assert (tmp_path / "run" / "metrics.jsonl").is_file()
