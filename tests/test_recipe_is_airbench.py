"""The CPU recipe (recipes/cifar10-cpu-10min.yaml) trains what airbench94's own loop trains.

The oracle is benchmarks/anchors/airbench_cpu.py, airbench94.py written out as one plain loop:
its network, its optimizer over the summed loss, its triangle, its averaging (Averager) and its
whitening-bias stop, none of them accel_train's code.  The recipe runs as users run it, through
`accel_train.fit` (without its time budget and smaller networks, in fp32), and a callback
records the weights it starts from, every batch it trains on and, after every update, the
weights, the momentum buffers and the Lookahead average.  Each of the 36 updates is then made
again by the anchor's loop from the recipe's state before it, on the same batch, and must give
the same state (after the last, the weights the run saved): the 64x BatchNorm shifts, the decay
of every parameter, label smoothing, BatchNorm's momentum, the learning rate of every update,
the Lookahead syncs every 5 updates (decay 0.95^5 x progress^3), the weights taking the average
when training ends, and the whitening bias fixed from epoch 3.

Why update by update: this training amplifies rounding. Run whole, the anchor from weights
differing by 1e-6 (relative) ended 4e-2 away after 40 updates, so a comparison of two whole runs
could only be loose; started from the same state, one update differs by rounding alone.

The one difference is written out below: accel_train's warmup is a step ahead of airbench's
(its first update is a step above --warmup-start-factor; the decay then equals airbench's).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.utils.data import Dataset

import accel_train
from accel_train.callbacks import Callback
from benchmark_smoke import SCRIPTS
from conftest import REPO

sys.path.insert(0, str(SCRIPTS / "anchors"))
import airbench_cpu  # noqa: E402

pytestmark = pytest.mark.slow  # about 25 s: 36 updates of the full network, batch 32

RECIPE = REPO / "recipes" / "cifar10-cpu-10min.yaml"
# 36 updates: int(0.23 x 36) = round(0.23 x 36), and the last is not a sync (36 = 7 x 5 + 1)
BATCH, STEPS_PER_EPOCH, EPOCHS = 32, 9, 4


class Patterns(Dataset):
    """32 px uint8 images of 10 classes: a class's colour and stripes under per-image noise."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(size) % 10
        noise = torch.randint(0, 80, (size, 3, 32, 32), generator=generator)
        stripes = (torch.arange(32) % (self.labels[:, None] + 2) == 0).to(torch.int64)
        colour = torch.stack([self.labels * 17, 170 - self.labels * 11, self.labels * 7 + 40], 1)
        self.images = (noise + colour[:, :, None, None] * stripes[:, None, None, :]).clamp(0, 255)
        self.images = self.images.to(torch.uint8)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


class Recorder(Callback):
    def __init__(self):
        self.first, self.batches, self.after = None, [], []

    @staticmethod
    def _weights(trainer) -> dict:
        return {key: value.detach().clone()
                for key, value in trainer.bare_model().state_dict().items()}

    def on_batch_start(self, trainer, batch):
        if self.first is None:
            self.first = self._weights(trainer)
        self.batches.append((batch.images.detach().clone(), batch.labels.clone(),
                             trainer.state.epoch))

    def on_step_end(self, trainer, step):
        names = {id(p): name for name, p in trainer.bare_model().named_parameters()}
        momentum = {names[id(p)]: state["momentum_buffer"].clone()
                    for p, state in trainer.optimizer.state.items()}
        slow = {key: value.clone() for key, value in trainer.lookahead.slow.items()}
        self.after.append((self._weights(trainer), momentum, slow))


def recipe_options(tmp_path) -> dict:
    options = yaml.safe_load(RECIPE.read_text())
    for budget_only in ("model", "time_budget", "smaller_models", "min_budget_epochs"):
        options.pop(budget_only)
    # airbench's per-image rate at this batch: the recipe's 1.5 is for 1024 images
    options.update(batch_size=BATCH,
                   learning_rate=options["learning_rate"] * BATCH / 1024, epochs=EPOCHS,
                   mixed_precision="no", channels_last=False, progress="log", plots=False,
                   output_dir=str(tmp_path / "recipe"), seed=0)
    return options


def anchor_updates(recorder: Recorder):
    """Each update of airbench94's loop made from the recipe's state before it, on the recipe's
    batch: yields (update, the anchor's state after it, the recipe's)."""
    net = airbench_cpu.make_net().to(memory_format=torch.contiguous_format)
    names = list(recorder.first)  # the recipe's names, in the anchor's layer order
    # the anchor's parameters and buffers by the recipe's names
    params = dict(zip(names, net.state_dict(keep_vars=True).values(), strict=True))
    optimizer, _, steps_per_epoch, total = airbench_cpu.optimizer_and_schedule(
        net, BATCH, BATCH * STEPS_PER_EPOCH, EPOCHS)
    assert (steps_per_epoch, total) == (STEPS_PER_EPOCH, STEPS_PER_EPOCH * EPOCHS)
    triangle = np.interp(np.arange(total + 1), [0, int(0.23 * total), total], [0.2, 1, 0.07])
    peak = int(0.23 * total)
    # accel_train's warmup a step ahead (update k at airbench's k + 1 while rising)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: triangle[i + 1] if i < peak else triangle[i])
    averager = airbench_cpu.Averager(net)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.2, reduction="none")
    before = (recorder.first, {}, {k: v for k, v in recorder.first.items()
                                   if v.is_floating_point()})
    for step, ((images, labels, epoch), after) in enumerate(
            zip(recorder.batches, recorder.after, strict=True), start=1):
        weights, momentum, slow = before
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value)
            averager.slow = [slow[name].clone() for name in names if name in slow]
        for name, buffer in momentum.items():  # the anchor's is over the summed loss
            optimizer.state[params[name]]["momentum_buffer"] = buffer * BATCH
        net[0].bias.requires_grad = epoch < 3   # airbench's whiten_bias_train_epochs
        loss = loss_fn(net(images), labels).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        averager.after_step(net, step, total)
        mine = ({name: value.detach().clone() for name, value in params.items()},
                {name: optimizer.state[params[name]]["momentum_buffer"] / BATCH
                 for name in names if params[name] in optimizer.state},
                dict(zip([n for n in names if n in slow], averager.slow, strict=True)))
        yield step, mine, after
        before = after


def test_the_cpu_recipe_updates_the_weights_as_airbench94s_own_loop(tmp_path):
    recorder = Recorder()
    assert yaml.safe_load(RECIPE.read_text())["model"] == "cifar_airbench"
    accel_train.fit("cifar_airbench", Patterns(BATCH * STEPS_PER_EPOCH, seed=1),
                    Patterns(100, seed=2), callbacks=[recorder], **recipe_options(tmp_path))
    assert len(recorder.batches) == len(recorder.after) == STEPS_PER_EPOCH * EPOCHS
    saved = load_file(tmp_path / "recipe" / "model.safetensors")
    checked = set()
    for step, anchor, (weights, momentum, average) in anchor_updates(recorder):
        if step == len(recorder.after):  # then the run's end: the weights take the average
            weights = saved
        recipe = weights, momentum, average
        for part, expected, actual in zip(("weights", "momentum", "average"), anchor, recipe):
            assert expected.keys() == actual.keys(), f"update {step}: {part}"
            for name, value in expected.items():
                if value.is_floating_point():
                    where = f"update {step}, {part} {name}"
                    torch.testing.assert_close(actual[name], value, rtol=1e-4, atol=1e-6,
                                               msg=lambda m, where=where: f"{where}: {m}")
                    checked.add(part)
    assert checked == {"weights", "momentum", "average"}
