"""Checks that need to look inside the workers; run under a real launcher by test_equivalence.py:

    torchrun --nproc-per-node 2 -m tests.equiv_probe RESULT.json -- <accel_train train flags>

1. The gloo SyncBatchNorm (accel_train/model/syncbn.py) against nn.BatchNorm on the whole batch,
   which the two ranks split unevenly: forward output, running statistics after two steps (momentum
   and cumulative average), input gradients and the summed parameter gradients.
2. Gradient accumulation skips the all-reduce: the Trainer is built from the train flags exactly
   as `python -m accel_train` builds it, a DDP communication hook counts the all-reduces, and each
   micro-step records whether Accelerate meant to sync and how many all-reduces happened in it.

Rank 0 writes RESULT.json; the test makes the assertions.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from accel_train.run import distributed
from accel_train.cli import build_train_parser, config_from_args
from accel_train.model.syncbn import convert_gloo_sync_batchnorm
from accel_train.trainer import Trainer

SPLIT = (5, 3)  # samples per rank: uneven on purpose (the global statistics must weight by count)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check_syncbn(make_norm, channels: int = 6) -> dict:
    """Max relative differences between the synced layer on each rank's slice and the plain layer on
    the whole batch (two training steps, then the gradients of a fixed weighted sum)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1234)
    total = sum(SPLIT)
    batches = [torch.randn(total, channels, 5, 4, generator=gen) * 3 + 2 for _ in range(2)]
    upstream = torch.randn(total, channels, 5, 4, generator=gen)  # d(loss)/d(output)
    reference = make_norm(channels)
    with torch.no_grad():  # non-trivial affine parameters
        reference.weight.copy_(torch.rand(channels, generator=gen) + 0.5)
        reference.bias.copy_(torch.randn(channels, generator=gen))
    synced = convert_gloo_sync_batchnorm(copy.deepcopy(reference))
    unsynced = copy.deepcopy(reference)
    start, stop = sum(SPLIT[:rank]), sum(SPLIT[:rank + 1])

    diffs = {"output": 0.0, "input_grad": 0.0}
    for step, batch in enumerate(batches):
        full = batch.clone().requires_grad_(True)
        local = batch[start:stop].clone().requires_grad_(True)
        ref_out, out = reference(full), synced(local)
        unsynced(batch[start:stop])
        diffs["output"] = max(diffs["output"], _max_diff(out, ref_out[start:stop]))
        if step == len(batches) - 1:
            (ref_out * upstream).sum().backward()
            (out * upstream[start:stop]).sum().backward()
            diffs["input_grad"] = _max_diff(local.grad, full.grad[start:stop])
    for name in ("weight", "bias"):
        grad = synced.get_parameter(name).grad.clone()
        dist.all_reduce(grad)  # what DDP would sum (then average) across ranks
        diffs[f"{name}_grad"] = _max_diff(grad, reference.get_parameter(name).grad)
    for name in ("running_mean", "running_var"):
        diffs[name] = _max_diff(synced.get_buffer(name), reference.get_buffer(name))
    # The control: without synchronization the statistics really differ (the data is not trivial).
    diffs["unsynced_running_var"] = _max_diff(unsynced.running_var, reference.running_var)
    diffs["num_batches_tracked"] = int(synced.num_batches_tracked)
    return diffs


def syncbn_checks() -> dict:
    from timm.layers import BatchNormAct2d
    return {"BatchNorm2d": check_syncbn(lambda c: nn.BatchNorm2d(c)),
            "BatchNorm2d_cumulative": check_syncbn(lambda c: nn.BatchNorm2d(c, momentum=None)),
            "timm_BatchNormAct2d": check_syncbn(lambda c: BatchNormAct2d(c, act_layer=nn.ReLU))}


def accumulation_check(trainer: Trainer) -> dict:
    """Train through the real Trainer, recording per micro-step (sync intended?, all-reduces)."""
    allreduces: list[int] = []

    def counting_allreduce(state, bucket):
        allreduces.append(1)
        return allreduce_hook(state, bucket)

    trainer.model.register_comm_hook(state=None, hook=counting_allreduce)
    micro_steps: list[dict] = []
    train_step = trainer.train_step

    def recorded_train_step(images, labels):
        before = len(allreduces)
        sync = trainer.accelerator.sync_gradients
        loss = train_step(images, labels)
        micro_steps.append({"sync_gradients": sync, "allreduces": len(allreduces) - before})
        return loss

    trainer.train_step = recorded_train_step
    trainer.train()
    return {"micro_steps": micro_steps, "optimizer_steps": trainer.state.step,
            "world_size": dist.get_world_size(),
            "accumulation_steps": trainer.config.accumulation_steps,
            # accel_train's default, which must reach the DDP wrapper Accelerate built
            "gradient_as_bucket_view": trainer.model.gradient_as_bucket_view}


def main() -> int:
    result_path, train_argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    # Built exactly as `python -m accel_train` builds it (cli.main -> trainer.run_training).
    config = config_from_args(build_train_parser().parse_args(train_argv))
    trainer = Trainer.from_config(config)
    try:
        result = {"accumulation": accumulation_check(trainer), "syncbn": syncbn_checks(),
                  "rank": dist.get_rank()}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if dist.get_rank() == 0:
            with open(result_path, "w") as handle:
                json.dump({"ranks": gathered}, handle, indent=1)
    finally:
        trainer.close()  # ends the process group too
        distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
