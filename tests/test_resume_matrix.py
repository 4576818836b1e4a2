"""The resume matrix: every option that draws random numbers on at once, on the three data paths
(decoded in memory, decoded per step by loader workers, streamed from shards), on 1 process and on
2 under torchrun (there the files decoded per step are the JPEGs of the decoded-on-device row, by
two loader workers a rank); and, on 1 process, the in-memory images held on the device with their
batches drawn there (--data-on-device always, its erasing plans drawn by a loader worker; without
--auto-augment, which that path refuses).  A run stopped by SIGTERM mid-epoch (after a checkpoint)
and continued with `--resume auto` (on 1 process all three runs in the pytest process, the SIGTERM
sent to it) ends bit-identical to the run left alone (and, on 1 process, the in-memory run with its
global batch made of 2 accumulation steps, and timm's training transform on images above 64 px, in
memory, with its colour jitter and flips and no policy, and the same as JPEG files decoded and
cropped "on the device" with --decode-on-device always, and the same again decoded once and held
there with --data-on-device always, also on 2 processes): the final weights and the EMA weights of
the last checkpoint, max |difference| 0.0 (the in-memory rows train on the images
--max-train-samples' seeded draw keeps), with Accelerate's RNG files removed from the checkpoint
before the resume (exactness must not depend on a saved RNG stream).

Oracle: the uninterrupted run of the same command.  Each draw (dropout, drop-path, Mixup/CutMix,
the policy, random erasing, crop and flip) must be a function of its place in the run, and every
part of the run's state must come back from the checkpoint, for the two to agree to the bit.

An option marked `draws_random` in config.py that this matrix does not turn on fails
`test_every_option_that_draws_random_numbers_is_in_the_matrix`: a new random option cannot
silently fall outside the guarantee.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from accel_train.callbacks import Callback
from accel_train.run.checkpoint import write_manifest
from accel_train.cli import build_train_parser, config_from_args
from accel_train.config import TrainConfig
from conftest import BIG_SIZE, PINNED, accel_train_here
from fault_entry import STEP_SECONDS_ENV
from faults import (Run, checkpoint, checkpoint_steps, max_weight_difference, metrics, resolved,
                    stopped_at, torchrun_cmd, wait_until)

# Every random draw of training, on at once (and the EMA and the lookahead average, the state
# that rides along: checkpoints every 3 steps, syncs every 2, so one falls between syncs).
RANDOM_OPTIONS = ["--drop-rate", "0.3", "--drop-path", "0.1",
                  "--mixup", "0.8", "--cutmix", "1.0", "--mixup-switch-prob", "0.5",
                  "--auto-augment", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--augment",
                  "--flip", "alternate", "--crop-pad", "2", "--vflip", "0.5",
                  "--model-ema", "--model-ema-decay", "0.9", "--lookahead-every", "2"]
COMMON = ["--model", "test_resnet", "--batch-size", "16", "--checkpoint-every", "3",
          "--log-every", "1", "--keep-checkpoints", "10", "--progress", "log", "--no-plots",
          *PINNED, *RANDOM_OPTIONS]


def _common(path: str) -> list[str]:
    """COMMON, less --auto-augment where the batches are drawn on the device: its policy works
    on the host, image by image, and --data-on-device always refuses it (one line, exit 2).
    timm's pipeline (images above 64 px, in memory) without it too, for timm's colour jitter,
    which a policy turns off, and with timm's own random flip (--hflip 0.3) for --flip
    alternate's hash."""
    if path not in ("on-device", "timm", "decoded-on-device", "photos-on-device"):
        return COMMON
    at = COMMON.index("--auto-augment")
    common = COMMON[:at] + COMMON[at + 2:]
    if path in ("timm", "decoded-on-device", "photos-on-device"):
        at = common.index("--flip")
        common = common[:at] + ["--hflip", "0.3"] + common[at + 2:]
    return common


def _data_options(path: str, data: dict) -> list[str]:
    if path == "on-device":  # the in-memory images held on the device, batches drawn there,
        # the erasing plans by a loader worker
        return [*_data_options("in-memory", data), "--data-on-device", "always",
                "--num-workers", "1"]
    if path in ("in-memory", "accumulated"):
        # accumulated: the same global batch of 16 as 8 x 2 accumulation steps (a resume must
        # restart the accumulation count at an optimizer step's boundary)
        per_step = ["--batch-size", "8", "--accumulation-steps", "2"] if path == "accumulated" \
            else []
        # 256 of 288 images kept by --max-train-samples' seeded draw: a resume must keep the
        # same 256 (the steps per epoch are those of 256 images)
        return ["--dataset", "synthetic", "--synthetic-train-size", "288",
                "--max-train-samples", "256", "--max-eval-samples", "64", *per_step]
    if path == "per-step":  # PNG files decoded per step by 2 loader workers per process
        return ["--data-dir", str(data["images"]), "--in-memory", "never", "--num-workers", "2",
                "--batch-size", "8"]
    if path == "timm":  # the 80 px PNGs decoded in memory: timm's crop, flips, colour jitter
        return ["--data-dir", str(data["images"]), "--in-memory", "always",
                "--train-interpolation", "random", "--color-jitter", "0.4"]
    if path == "decoded-on-device":  # 80 px JPEGs, decoded, cropped and jittered "on the
        # device" (torchvision's decoder on a CPU): timm's draws made in a loader worker, which
        # decodes a third of each batch itself (--host-decode-share)
        return ["--data-dir", str(data["jpegs"]), "--in-memory", "never", "--num-workers", "1",
                "--decode-on-device", "always", "--host-decode-share", "0.34",
                "--train-interpolation", "random", "--color-jitter", "0.4"]
    if path == "photos-on-device":  # the same JPEGs decoded once and held "on the device",
        # each batch cropped and jittered there; the erasing plans by a loader worker
        return ["--data-dir", str(data["jpegs"]), "--in-memory", "never", "--num-workers", "1",
                "--data-on-device", "always", "--train-interpolation", "random",
                "--color-jitter", "0.4"]
    return ["--data-dir", str(data["shards"]), "--num-workers", "1",  # streamed
            "--max-eval-samples", "64"]


def _newest_checkpoint(out) -> int:
    return max(checkpoint_steps(out))


def _ema(out, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step_{step:08d}" / "ema.safetensors"))


def test_every_option_that_draws_random_numbers_is_in_the_matrix():
    """Each config field marked draws_random is turned on by the matrix's command line."""
    config = config_from_args(build_train_parser().parse_args(COMMON), environ={})
    marked = [f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("draws_random")]
    assert {"drop_rate", "drop_path", "mixup", "cutmix", "auto_augment", "reprob",
            "augment", "flip", "crop_pad"} <= set(marked), marked
    # A mode with choices (--flip) counts as on only in a mode other than its default: the
    # default's draws are those of another option already here (the crop's hash).
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    off = [name for name in marked if not getattr(config, name) or (
        TrainConfig.__dataclass_fields__[name].metadata.get("choices")
        and getattr(config, name) == defaults[name])]
    assert not off, (f"options that draw random numbers but are off in the resume matrix: {off}; "
                     f"turn them on in RANDOM_OPTIONS")


@pytest.fixture(scope="module")
def matrix_data(big_image_folder, big_jpeg_folder, synthetic_shards) -> dict:
    return {"images": big_image_folder, "jpegs": big_jpeg_folder, "shards": synthetic_shards}


# (the checkpoint after which SIGTERM is sent, the epoch the stop then falls in): the first
# epoch and a later one (where the epoch must reach the sampler of a loader that skips the
# batches already trained) on 1 process and on 2 alike.  Steps per epoch (in memory, per
# step, streamed): 16, 16, 12 on 1 process; in memory and streamed 8 and 5 on 2, the
# decoded-on-device row 9 (its batch below).
STOP_AFTER = {("in-memory", 1): (18, 1), ("per-step", 1): (3, 0), ("streamed", 1): (15, 1),
              ("in-memory", 2): (3, 0), ("streamed", 2): (6, 1),
              ("accumulated", 1): (6, 0), ("on-device", 1): (18, 1), ("timm", 1): (9, 1),
              ("decoded-on-device", 1): (9, 1), ("decoded-on-device", 2): (9, 1),
              ("photos-on-device", 1): (9, 1), ("photos-on-device", 2): (9, 1)}


@pytest.mark.parametrize("path, processes", [
    # every row takes over 10 s on a 2-core machine without AVX512: the full suite's
    *[pytest.param(path, 1, marks=pytest.mark.slow)
      for path in ("in-memory", "accumulated", "on-device", "timm", "per-step", "streamed",
                   "decoded-on-device", "photos-on-device")],
    # (files decoded per step on 2 processes: the decoded-on-device row, whose two loader
    # workers a rank draw every image's crop and decode a share of the files)
    *[pytest.param(path, 2, marks=pytest.mark.slow)
      for path in ("in-memory", "streamed", "decoded-on-device", "photos-on-device")]])
def test_a_stopped_and_resumed_run_ends_bit_identical(path, processes, matrix_data, tmp_path,
                                                      runs):
    command = [*_common(path), *_data_options(path, matrix_data), "--epochs", "2"]
    if path in ("decoded-on-device", "photos-on-device") and processes == 2:
        # the global batch of one process (16): 9 steps an epoch, time for the stop to land
        # before the run ends, the next batch decoded ahead on each rank; two loader workers
        # a rank, each drawing its own images' crops (seeded by rank and worker)
        command += ["--batch-size", "8", "--num-workers", "2"]
    after, epoch = STOP_AFTER[path, processes]

    def launch(*args: str) -> list[str]:
        return torchrun_cmd(*args, nproc=processes)

    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    reference_run = None
    if processes == 1:
        # In this process (no new process's seconds of imports), each run with its own history
        # of global RNG draws.  The stop is a real SIGTERM to this process, sent once checkpoint
        # `after` is complete (a callback): the trainer's handler hears it as it would from a
        # launcher, and the run stops at the end of the next step.
        accel_train_here(*command, "--output-dir", str(reference), check=True)

        class StopAfterCheckpoint(Callback):
            def on_checkpoint(self, trainer, path) -> None:
                if path.name == f"step_{after:08d}":
                    os.kill(os.getpid(), signal.SIGTERM)

        code = accel_train_here(*command, "--output-dir", str(stopped),
                                callbacks=[StopAfterCheckpoint()])
        assert code.returncode == 143, code.stdout[-2000:] + code.stderr[-2000:]
    else:
        reference_run = Run(launch(*command, "--output-dir", str(reference)),
                            tmp_path / "reference.log")
        runs.append(reference_run)
        # Each step of the run to be stopped takes a second more (a sleep, no arithmetic: its
        # numbers stay those of the reference): the SIGTERM sent once checkpoint `after`
        # appears, forwarded by torchrun, must land before the last step (the streamed row
        # has 4 steps left, which a quiet machine trains in well under a second).
        victim = Run(launch(*command, "--output-dir", str(stopped)), tmp_path / "stopped.log",
                     **{STEP_SECONDS_ENV: "1"})
        runs.append(victim)
        wait_until(lambda: after in checkpoint_steps(stopped), f"the checkpoint of step {after}",
                   victim)
        victim.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
        victim.wait()
    logs = [(stopped / "logs" / f"rank{r}.log").read_text() for r in range(processes)]
    stops = {stopped_at(log) for log in logs}
    assert len(stops) == 1, stops  # the ranks agreed where to stop
    stop = stops.pop()
    about = (f"({path}, {processes} process(es), SIGTERM after checkpoint {after}, stopped at "
             f"{stop})")
    print(about)
    state = checkpoint(stopped, stop)
    assert state["world_size"] == processes and 0 < state["samples_in_epoch"], (state, about)
    assert state["epoch"] == epoch, (state, about)
    facts = resolved(stopped)
    assert facts["data_in_memory"] == (path in ("in-memory", "accumulated", "on-device",
                                                "timm")), facts
    if path != "streamed":  # which loader drew the batches: the saved position says
        position = stopped / "checkpoints" / f"step_{stop:08d}" / "loader.json"
        assert json.loads(position.read_text())["on_device"] == \
            (path in ("on-device", "photos-on-device")), about
    if "--max-train-samples" in command:  # (256 of 288 images kept)
        assert state["sample_subset"] == "random", state
    if path == "accumulated":
        assert state["accumulation_steps"] == 2, state
    if path == "per-step":
        assert facts["num_workers"] == 2 and facts["model"]["image_size"] == BIG_SIZE, facts
    if path == "timm":  # above 64 px: timm's crop, and the model's own held-out crop
        assert facts["model"]["image_size"] == BIG_SIZE and \
            facts["model"]["crop_mode"] == "center", facts
    if path == "photos-on-device":
        assert facts["train_loader"].startswith(
            "drawn on the device, the training photos decoded once and held there"), facts
        assert state["photos_held"] is True, state
    if path == "decoded-on-device":
        assert facts["jpeg_decoding"].startswith("on the device") and \
            "34% of each batch's by the loader workers" in facts["jpeg_decoding"] and \
            state["decoded_on_device"] is True and state["host_decode_share"] == 0.34, \
            (facts, state)

    # Exactness must not depend on Accelerate's RNG files: the resumed run starts without them
    # (the manifest rewritten to match), so its global generators are a fresh process's.
    folder = stopped / "checkpoints" / f"step_{stop:08d}"
    # (every rank wrote its own: Accelerate's part of a save runs on every rank together)
    assert sorted(p.name for p in folder.glob("random_states_*.pkl")) == \
        [f"random_states_{rank}.pkl" for rank in range(processes)], about
    for rng_file in folder.glob("random_states_*.pkl"):
        rng_file.unlink()
    write_manifest(folder, stop)

    if processes == 1:
        if path == "decoded-on-device":
            # left out: the checkpoint's share of the decoding is kept (it decides pixels)
            at = command.index("--host-decode-share")
            command = command[:at] + command[at + 2:]
        output = accel_train_here(*command, "--output-dir", str(stopped), "--resume", "auto",
                                  check=True).stdout
    else:
        resumed = Run(launch(*command, "--output-dir", str(stopped), "--resume", "auto"),
                      tmp_path / "resumed.log")
        runs.append(resumed)
        output = resumed.check()
    assert f"resumed from {stopped}/checkpoints/step_{stop:08d} at step {stop}" in output, about
    assert "holds no EMA" not in output
    if reference_run is not None:
        reference_run.check()

    assert max_weight_difference(reference, stopped) == 0.0, about
    last = _newest_checkpoint(reference)
    assert _newest_checkpoint(stopped) == last, about
    a, b = _ema(reference, last), _ema(stopped, last)
    assert a.keys() == b.keys()
    ema_difference = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert ema_difference == 0.0, f"EMA differs by {ema_difference} {about}"
    # the EMA is a real average here (decay 0.9), not a copy of the weights
    weights = load_file(str(reference / "checkpoints" / f"step_{last:08d}" / "model.safetensors"))
    assert max((a[k].double() - weights[k].double()).abs().max().item() for k in a) > 0
    assert [r["eval_ema_top1"] for r in metrics(reference) if r["type"] == "epoch"] == \
        [r["eval_ema_top1"] for r in metrics(stopped) if r["type"] == "epoch"], about
    train_steps = [r["step"] for r in metrics(stopped) if r["type"] == "train"]
    assert train_steps == list(range(1, last + 1)), (train_steps, about)
