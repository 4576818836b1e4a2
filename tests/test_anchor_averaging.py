"""The airbench anchor's averaging (benchmarks/anchors/airbench_cpu.py's Averager, which the GPU
anchor imports) against airbench94's LookaheadState written out by hand: every 5th step the
average moves 1 - rho of the way to the weights (rho = 0.95^5 x (step / total)^3) and the weights
take it; after the last step they take it as it stands; nothing happens between."""

from __future__ import annotations

import sys

import torch
from torch import nn

from benchmark_smoke import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "anchors"))
import airbench_cpu  # noqa: E402


def test_the_anchor_averages_as_airbench94_from_the_first_step_to_the_last():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    averager = airbench_cpu.Averager(net)
    slow = {k: v.clone() for k, v in net.state_dict().items() if v.is_floating_point()}
    fast = {k: v.clone() for k, v in slow.items()}
    total = 7
    for step in range(1, total + 1):
        with torch.no_grad():  # a made-up update of every float tensor, statistics too
            for key, value in net.state_dict().items():
                if value.is_floating_point():
                    value.add_(0.1 * step)
                    fast[key] += 0.1 * step
        averager.after_step(net, step, total)
        if step % 5 == 0:
            rho = 0.95 ** 5 * (step / total) ** 3
            for key in slow:
                slow[key] += (1 - rho) * (fast[key] - slow[key])
                fast[key] = slow[key].clone()
        if step == 4:  # no sync yet: the weights are as trained
            assert all(torch.equal(net.state_dict()[k], fast[k]) for k in fast)
    for key, value in net.state_dict().items():
        if value.is_floating_point():  # after the last step: the average (steps 6, 7 dropped)
            torch.testing.assert_close(value, slow[key])
    assert int(net[1].num_batches_tracked) == 0
