"""Two processes through the real launchers compute what one process computes.

Every 2-process run goes through a real launcher on CPU over gloo (`accelerate launch` with
accelerate_configs/cpu_2proc.yaml, `torchrun`, `python -m torch.distributed.launch`) and is
compared with 1-process runs of the same seed, data order and global batch (--no-augment, fp32):

  weights      test_convnext (no BatchNorm): 2 procs x 8 == 1 x 16 == 1 x 8 x accumulation 2
               == 2 procs x 4 x accumulation 2 (the probe)
  BatchNorm    test_resnet: 2 procs x 8 --sync-bn == 1 x 16 (running statistics and weights);
               without --sync-bn they differ
  evaluation   101 held-out samples on 2 processes are counted exactly once
  lr schedule  the same function of the optimizer step on 1 and 2 processes

All runs start together in one module fixture (a few at a time: start-up dominates on 2 cores),
and each test then reads the run directories.  tests/equiv_probe.py looks inside the workers:
all-reduces per micro-step under accumulation, and the gloo SyncBatchNorm layer by layer.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from accel_train.run.track import read_metrics

import conftest
from conftest import CONFIGS, PINNED, REPO, accel_train_here, free_port

pytestmark = pytest.mark.slow

STEPS = 8
EVAL_SAMPLES = 101        # not a multiple of processes x batch: the sampler pads, we must not count
SEED = 3
PEAK_LR = 0.05
COMMON = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--max-eval-samples",
          str(EVAL_SAMPLES), "--epochs", "1", "--max-steps", str(STEPS), "--log-every", "1",
          "--no-augment", "--seed", str(SEED), "--learning-rate", str(PEAK_LR),
          "--warmup-epochs", "0.25", "--progress", "log", "--no-plots", *PINNED]
STEPS_PER_EPOCH = 256 // 16  # every run has a global batch of 16
WARMUP_STEPS = round(0.25 * STEPS_PER_EPOCH)
CONVNEXT = ["--model", "test_convnext"]
# 15 BatchNorm2d layers, each followed by a ReLU.  Summing in a different order (two processes)
# moves a value by ~1e-7; now and then a ReLU input sits closer than that to zero (seen: 1 of
# 65536 after the first BatchNorm at step 4), flips, and changes one layer's gradient by ~1e-2.
# At lr 0.05 that grows ~10x per step (0.2 relative weight difference after 8 steps, with a
# correct SyncBatchNorm); at lr 0.001 it stays at float-rounding level.  So the
# BatchNorm runs use a small learning rate: the statistics still come from 8 global batches.
RESNET = ["--model", "test_resnet", "--learning-rate", "0.001"]
BN_PEAK_LR = 0.001
# float32 sums in a different order (gloo's all-reduce, the accumulation) differ in the last bits;
# over 8 SGD steps that stays around 1e-6 relative (measured), far below any real difference.
WEIGHT_RTOL = 1e-5
MAX_CONCURRENT = 3
HAS_LEGACY_LAUNCHER = importlib.util.find_spec("torch.distributed.launch") is not None
LEGACY_LAUNCHER = "torch.distributed.launch" if HAS_LEGACY_LAUNCHER else "torch.distributed.run"


@dataclass
class Run:
    name: str
    command: list[str]
    output_dir: Path
    returncode: int = -1
    stdout: str = ""
    stderr: str = ""

    def check(self) -> "Run":
        assert self.returncode == 0, (f"{self.name}: {' '.join(self.command)} exited "
                                      f"{self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n"
                                      f"--- stderr\n{self.stderr[-5000:]}")
        return self

    @property
    def config(self) -> dict:
        return yaml.safe_load((self.output_dir / "config.yaml").read_text())

    @property
    def metrics(self) -> list[dict]:
        return read_metrics(self.output_dir / "metrics.jsonl")

    def weights(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.output_dir / "model.safetensors"))


def _plan(root: Path) -> list[Run]:
    python = sys.executable
    probe_json = root / "probe.json"

    def out(name: str) -> list[str]:
        return ["--output-dir", str(root / name)]

    return [
        Run("accelerate_2proc", [python, "-m", "accelerate.commands.launch", "--config_file",
                                 str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port",
                                 str(free_port()), "-m", "accel_train", *COMMON, *CONVNEXT,
                                 "--batch-size", "8", *out("accelerate_2proc")],
            root / "accelerate_2proc"),
        Run("probe_2proc_accum", [python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                  "--master-port", str(free_port()),
                                  "-m", "tests.equiv_probe", str(probe_json), "--",
                                  *COMMON, *CONVNEXT, "--batch-size", "4",
                                  "--accumulation_steps", "2", *out("probe_2proc_accum")],
            root / "probe_2proc_accum"),
        Run("torchrun_syncbn", [python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                "--master-port", str(free_port()), "-m", "accel_train", *COMMON,
                                *RESNET, "--batch-size", "8", "--sync-bn",
                                *out("torchrun_syncbn")],
            root / "torchrun_syncbn"),
        # The seed manual's command: the launcher passes --local-rank=N, the manual adds
        # --world_size.
        # (torchrun, same flags, once torch stops shipping torch.distributed.launch.)
        Run("tdlaunch_no_syncbn", [python, "-m", LEGACY_LAUNCHER, "--nproc_per_node=2",
                                   f"--master_port={free_port()}", "-m", "accel_train", *COMMON,
                                   *RESNET, "--batch-size", "8", "--world_size", "2",
                                   *out("tdlaunch_no_syncbn")],
            root / "tdlaunch_no_syncbn"),
        Run("one_proc", [python, "-m", "accel_train", *COMMON, *CONVNEXT, "--batch-size", "16",
                         *out("one_proc")], root / "one_proc"),
        Run("one_proc_accum", [python, "-m", "accel_train", *COMMON, *CONVNEXT, "--batch-size",
                               "8", "--accumulation_steps", "2", *out("one_proc_accum")],
            root / "one_proc_accum"),
        Run("one_proc_bn", [python, "-m", "accel_train", *COMMON, *RESNET, "--batch-size", "16",
                            *out("one_proc_bn")], root / "one_proc_bn"),
    ]


def _kill(proc: subprocess.Popen) -> None:
    """The launcher and the workers it started (its own session, see below)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _run_all(runs: list[Run], timeout: float = 900) -> None:
    """Start the runs, at most MAX_CONCURRENT at a time; fill in their results."""
    waiting, running = list(runs), []
    deadline = time.monotonic() + timeout
    env = conftest.test_env()
    try:
        while waiting or running:
            while waiting and len(running) < MAX_CONCURRENT:
                run = waiting.pop(0)
                logs = (run.output_dir.parent / f"{run.name}.out",
                        run.output_dir.parent / f"{run.name}.err")
                handles = [open(path, "w") for path in logs]
                proc = subprocess.Popen(run.command, cwd=REPO, env=env,
                                        stdin=subprocess.DEVNULL, stdout=handles[0],
                                        stderr=handles[1], text=True, start_new_session=True)
                running.append((run, proc, logs, handles))
            for entry in list(running):
                run, proc, logs, handles = entry
                if proc.poll() is None and time.monotonic() < deadline:
                    continue
                _kill(proc)  # past the deadline: a hung rendezvous must not hang the suite
                for handle in handles:
                    handle.close()
                run.returncode = proc.returncode
                run.stdout, run.stderr = (path.read_text() for path in logs)
                running.remove(entry)
            time.sleep(0.2)
    finally:  # interrupted (Ctrl-C, pytest-timeout): leave no workers behind
        for _, proc, _, handles in running:
            _kill(proc)
            for handle in handles:
                handle.close()


def _run_here(run: Run) -> None:
    """A `python -m accel_train` run called in this process (`accel_train_here`): the same
    numbers without a new process's seconds of imports."""
    result = accel_train_here(*run.command[3:])
    run.returncode, run.stdout, run.stderr = result.returncode, result.stdout, result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("equivalence")
    plan = _plan(root)
    one_process = [run for run in plan if run.command[1:3] == ["-m", "accel_train"]]
    _run_all([run for run in plan if run not in one_process])  # the launchers
    for run in one_process:
        _run_here(run)
    return {run.name: run for run in plan}


@pytest.fixture(scope="module")
def probe(runs) -> list[dict]:
    runs["probe_2proc_accum"].check()
    probe_file = runs["probe_2proc_accum"].output_dir.parent / "probe.json"
    return json.loads(probe_file.read_text())["ranks"]


def weight_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                       which=lambda key: "running_" not in key) -> tuple[float, float]:
    """(largest absolute difference, largest per-tensor relative difference ||a-b||/||b||)."""
    assert a.keys() == b.keys()
    max_abs = max_rel = 0.0
    for key in a:
        if not which(key) or not a[key].is_floating_point():
            continue
        diff = (a[key].double() - b[key].double())
        max_abs = max(max_abs, float(diff.abs().max()))
        norm = float(b[key].double().norm())
        if norm > 0:
            max_rel = max(max_rel, float(diff.norm()) / norm)
    return max_abs, max_rel


def overall_change(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all floating-point tensors together."""
    keys = [k for k in b if b[k].is_floating_point()]
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in keys)
    return math.sqrt(diff / sum(float(b[k].double().pow(2).sum()) for k in keys))


def initial_weights(model: str) -> dict[str, torch.Tensor]:
    """The weights every run starts from (trainer: torch.manual_seed(--seed), then timm)."""
    import timm
    torch.manual_seed(SEED)
    return timm.create_model(model, num_classes=10, drop_rate=0.0).state_dict()


def assert_one_group(run: Run, world_size: int = 2) -> None:
    """The workers joined one process group, each kept its own log, and only the main process
    printed progress and wrote the shared files."""
    run.check()
    resolved = run.config["resolved"]
    assert resolved["world_size"] == world_size
    assert resolved["launcher"]["process_group_world_size"] == world_size
    assert resolved["launcher"]["backend"] == "gloo"
    assert resolved["global_batch"] == 16
    for rank in range(world_size):
        log = (run.output_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"process rank {rank} of {world_size} " in log, log[:500]
    printed = run.stdout + run.stderr
    assert printed.count("accel_train: test_") == 1, "the start-up summary is printed once"
    assert printed.count(f"x {world_size} process(es), gloo") == 1
    for step in range(1, STEPS + 1):
        assert printed.count(f"step {step}/{STEPS} ") == 1, "progress comes from one process"
    steps = [m["step"] for m in run.metrics if m["type"] == "train"]
    assert steps == list(range(1, STEPS + 1)), "metrics.jsonl is written by one process"
    assert not list(run.output_dir.glob("config.resume-*.yaml")), "config.yaml written twice"


# -- launch paths -----------------------------------------------------------------------------

def test_accelerate_launch_trains_two_processes_as_one_group(runs):
    assert_one_group(runs["accelerate_2proc"])
    assert runs["accelerate_2proc"].config["resolved"]["launcher"]["torchelastic"]


def test_torchrun_trains_two_processes_as_one_group(runs):
    assert_one_group(runs["torchrun_syncbn"])


@pytest.mark.skipif(not HAS_LEGACY_LAUNCHER, reason="this torch no longer ships it")
def test_torch_distributed_launch_with_the_manuals_flags(runs):
    run = runs["tdlaunch_no_syncbn"]
    assert_one_group(run)
    # torch 2.14 still ships it; it passes --local-rank=N (checked against LOCAL_RANK).
    assert "--local-rank=0" in run.config["command"]
    assert run.config["train"]["world_size"] == 2 and run.config["train"]["local_rank"] == 0
    assert "deprecated" in run.stderr  # it says so itself; the README recommends torchrun


# -- equivalence ------------------------------------------------------------------------------

def test_two_processes_train_the_same_weights_as_one(runs):
    one = runs["one_proc"].check().weights()
    two = runs["accelerate_2proc"].check().weights()
    max_abs, max_rel = weight_differences(two, one)
    moved = overall_change(one, initial_weights("test_convnext"))
    print(f"\n2 procs x 8 vs 1 x 16 (test_convnext, {STEPS} steps): max abs {max_abs:.3g}, "
          f"max rel {max_rel:.3g}; training moved the weights by {moved:.3g} (relative)")
    assert max_rel < WEIGHT_RTOL
    assert moved > 100 * WEIGHT_RTOL, "the weights must really have trained"


def test_accumulation_equals_the_larger_batch_and_skips_the_allreduce(runs, probe):
    one = runs["one_proc"].check().weights()
    for name in ("one_proc_accum", "probe_2proc_accum"):
        max_abs, max_rel = weight_differences(runs[name].check().weights(), one)
        print(f"\n{name} vs 1 x 16: max abs {max_abs:.3g}, max rel {max_rel:.3g}")
        assert max_rel < WEIGHT_RTOL, name
    for rank in probe:
        acc = rank["accumulation"]
        assert acc["world_size"] == 2 and acc["accumulation_steps"] == 2
        assert acc["gradient_as_bucket_view"] is True, "the default must reach DDP"
        assert acc["optimizer_steps"] == STEPS
        micro = acc["micro_steps"]
        assert len(micro) == 2 * STEPS
        # Accelerate's accumulate() wraps the first micro-step in no_sync: no all-reduce at all;
        # the second syncs (one all-reduce per DDP bucket).
        assert [m["sync_gradients"] for m in micro] == [False, True] * STEPS
        assert all(m["allreduces"] == 0 for m in micro[0::2])
        assert all(m["allreduces"] >= 1 for m in micro[1::2])


def test_sync_bn_running_stats_equal_one_process_and_differ_without_it(runs, probe):
    one = runs["one_proc_bn"].check().weights()
    synced = runs["torchrun_syncbn"].check().weights()
    unsynced = runs["tdlaunch_no_syncbn"].check().weights()
    assert runs["torchrun_syncbn"].config["resolved"]["sync_bn"] is True

    def running(key):
        return "running_" in key
    stats_abs, stats_rel = weight_differences(synced, one, which=running)
    weights_abs, weights_rel = weight_differences(synced, one)
    off_abs, off_rel = weight_differences(unsynced, one, which=running)
    print(f"\nBN running stats, 2 procs --sync-bn vs 1 x 16: max abs {stats_abs:.3g}, max rel "
          f"{stats_rel:.3g} (weights: rel {weights_rel:.3g}); without --sync-bn: max abs "
          f"{off_abs:.3g}, max rel {off_rel:.3g}")
    assert stats_rel < WEIGHT_RTOL and weights_rel < WEIGHT_RTOL
    assert off_rel > 100 * WEIGHT_RTOL, "without --sync-bn each process normalizes its own half"
    # Layer by layer (tests/equiv_probe.py): uneven 5/3 split, momentum and cumulative average,
    # timm's BatchNormAct2d; outputs, running stats, input and parameter gradients.
    worst = max(diffs[what] for rank in probe for diffs in rank["syncbn"].values()
                for what in ("output", "input_grad", "weight_grad", "bias_grad", "running_mean",
                             "running_var"))
    print(f"gloo SyncBatchNorm layer by layer vs nn.BatchNorm on the whole batch: worst relative "
          f"difference {worst:.3g}")
    for rank in probe:
        for layer, diffs in rank["syncbn"].items():
            for what in ("output", "input_grad", "weight_grad", "bias_grad", "running_mean",
                         "running_var"):
                assert diffs[what] < 1e-5, (rank["rank"], layer, what, diffs[what])
            assert diffs["unsynced_running_var"] > 1e-2, (layer, "the control must differ")
            assert diffs["num_batches_tracked"] == 2


def test_distributed_eval_counts_each_sample_once(runs):
    for name in ("one_proc", "accelerate_2proc", "probe_2proc_accum"):
        epochs = [m for m in runs[name].check().metrics if m["type"] == "epoch"]
        assert [e["eval_count"] for e in epochs] == [EVAL_SAMPLES], name
    one = [m for m in runs["one_proc"].metrics if m["type"] == "epoch"][0]
    two = [m for m in runs["accelerate_2proc"].metrics if m["type"] == "epoch"][0]
    # Same weights, same samples, each once: the same accuracy.
    assert two["eval_top1"] == pytest.approx(one["eval_top1"], abs=1e-9)


def warmup_then_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """The default schedule written out (the oracle): the update at 0-based step `step` uses
    (step + 1) / warmup_steps of the peak during warmup, then half a cosine down to 0 at
    `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps)))


def test_lr_schedule_is_the_same_function_of_the_optimizer_step(runs):
    def lrs(name):
        return [m["lr"] for m in runs[name].check().metrics if m["type"] == "train"]
    # The lr logged at step s is the one the next update (0-based index s) will use: warmup for
    # WARMUP_STEPS, then cosine decay to 0 at STEPS.
    factors = [warmup_then_cosine(step, WARMUP_STEPS, STEPS) for step in range(1, STEPS + 1)]
    for name in ("one_proc", "one_proc_accum", "accelerate_2proc", "probe_2proc_accum"):
        assert lrs(name) == pytest.approx([PEAK_LR * f for f in factors], rel=1e-12), name
    for name in ("one_proc_bn", "torchrun_syncbn", "tdlaunch_no_syncbn"):
        assert lrs(name) == pytest.approx([BN_PEAK_LR * f for f in factors], rel=1e-12), name
    assert max(factors) == 1.0 and not math.isclose(factors[-1], 1.0)  # warmup and decay both ran
