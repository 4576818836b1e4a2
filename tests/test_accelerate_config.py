"""`accelerate config` answered at a terminal as a user of a 2-core machine without a GPU answers
it (this machine, multi-CPU, 2 processes, fp16), then `accelerate launch` with the file it wrote.

accelerate's single-process launcher starts ONE process for those answers; accel_train starts
the ranks they ask for (accel_train/run/rank_launcher.py).  Checked here against the other
launchers' arithmetic: 2 ranks x 16 train the weights of 1 process x 32 (within float rounding),
a SIGTERM to `accelerate launch` stops every rank at a checkpoint from which `--resume auto` ends
bit-identical to the run that was never stopped, and the two-machine answers meet on 127.0.0.1.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

import conftest
from accelerate_config_pty import answer_accelerate_config
from conftest import PINNED, REPO, free_port
from faults import Run, checkpoint_steps, wait_until
from test_equivalence import SEED, WEIGHT_RTOL, initial_weights, overall_change, weight_differences

pytestmark = pytest.mark.slow

ONE_MACHINE = {"compute environment": "This machine", "Which type of machine": "multi-CPU",
               "How many different machines": "1",
               "checked while running for errors": "no", "launch mpirun": "no",
               "torch dynamo": "no", "How many processes": "2", "mixed precision": "fp16"}
# 256 images, global batch 32: 8 steps an epoch, 16 in all, a checkpoint every 3.
TRAIN = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--max-eval-samples", "64",
         "--model", "test_convnext", "--epochs", "2", "--no-augment", "--checkpoint-every", "3",
         "--log-every", "1", "--seed", str(SEED), "--progress", "log", "--no-plots"]


def _launch(config: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            "--main_process_port", str(free_port()), "-m", "accel_train", *TRAIN,
            "--batch-size", "16", *args,
            "--output-dir", str(out)]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def answered(tmp_path_factory) -> Path:
    config = tmp_path_factory.mktemp("accelerate_config") / "multi_cpu.yaml"
    answer_accelerate_config(config, ONE_MACHINE, conftest.test_env())
    return config


@pytest.fixture(scope="module")
def uninterrupted(answered, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = conftest.run(_launch(answered, out, *PINNED), check=True, timeout=300)
    return out, result.stdout + result.stderr


def test_the_answers_write_what_a_user_of_a_cpu_machine_gets(answered):
    config = yaml.safe_load(answered.read_text())
    assert (config["distributed_type"], config["num_processes"], config["use_cpu"],
            config["mixed_precision"], config["num_machines"]) == ("MULTI_CPU", 2, True, "fp16", 1)


def test_the_answers_train_two_ranks_with_the_numbers_of_one_process(uninterrupted, tmp_path):
    out, printed = uninterrupted
    resolved = yaml.safe_load((out / "config.yaml").read_text())["resolved"]
    assert resolved["world_size"] == 2 and resolved["global_batch"] == 32
    assert resolved["launcher"]["process_group_world_size"] == 2
    assert resolved["launcher"]["torchelastic"]["run_id"] == "none"
    for rank in (0, 1):
        assert f"process rank {rank} of 2 " in (out / "logs" / f"rank{rank}.log").read_text()
    said = [line for line in printed.splitlines() if "accelerate launch` starts one" in line]
    assert len(said) == 1 and "starts the 2 rank(s) of this machine itself" in said[0], printed
    assert printed.count("step 16/16 ") == 1, "progress from one rank"

    one = tmp_path / "one"
    conftest.accel_train_here(*TRAIN, *PINNED, "--batch-size", "32", "--output-dir", str(one),
                              check=True)  # (in this process: no second start's imports)
    two, one_weights = _weights(out), _weights(one)
    _, difference = weight_differences(two, one_weights)
    moved = overall_change(one_weights, initial_weights("test_convnext"))
    print(f"\n2 ranks x 16 (accelerate config answers) vs 1 x 32: max relative {difference:.3g}"
          f"; training moved the weights by {moved:.3g}")
    assert difference < WEIGHT_RTOL
    assert moved > 100 * WEIGHT_RTOL, "the weights must really have trained"


def test_sigterm_to_accelerate_launch_stops_every_rank_and_the_resume_is_exact(
        answered, uninterrupted, tmp_path):
    reference, _ = uninterrupted
    out = tmp_path / "run"
    first = Run(_launch(answered, out, *PINNED), tmp_path / "first.log")
    try:
        wait_until(lambda: 3 in checkpoint_steps(out), "the first checkpoint", first)
        tree = psutil.Process(first.proc.pid).children(recursive=True)
        first.proc.send_signal(signal.SIGTERM)
        first.wait()  # accelerate launch itself dies of the signal; it forwards nothing
        gone, alive = psutil.wait_procs(tree, timeout=120)
        assert not alive, f"still running after the launcher was stopped: {alive}"
    finally:
        first.close()
    logs = [(out / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    stops = [int(log.split("stopped by a signal at step ")[1].split(":")[0]) for log in logs]
    assert stops[0] == stops[1] and 3 <= stops[0] < 16, stops
    assert stops[0] in checkpoint_steps(out)

    resumed = conftest.run(_launch(answered, out, *PINNED, "--resume", "auto"), check=True)
    assert f"resumed from {out}/checkpoints/step_{stops[0]:08d}" in resumed.stdout
    finished, never_stopped = _weights(out), _weights(reference)
    assert all(torch.equal(finished[k], never_stopped[k]) for k in never_stopped), \
        "the resumed run must end bit-identical to the one that was never stopped"


def test_the_two_machine_answers_meet_on_loopback(tmp_path):
    """Two `accelerate config` sessions, one per "machine" (ranks 0 and 1, main process at
    127.0.0.1), 2 processes in all; precision left to the fp16 answer, which a CPU resolves as
    auto does, saying so once."""
    port, out = free_port(), tmp_path / "run"
    configs = []
    for rank in (0, 1):
        config = tmp_path / f"machine{rank}.yaml"
        answer_accelerate_config(config, {
            **ONE_MACHINE, "How many different machines": "2",
            "rank of this machine": str(rank), "IP address": "127.0.0.1",
            "port you will use": str(port), "same local network": "yes",
            "How many processes": "2"}, conftest.test_env())
        configs.append(config)
    assert yaml.safe_load(configs[1].read_text())["machine_rank"] == 1
    procs = [subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch",
                               "--config_file", str(config), "-m", "accel_train", *TRAIN,
                               "--batch-size", "16", "--max-steps", "4", "--output-dir",
                               str(out)],
                              cwd=REPO, env=conftest.test_env(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for config in configs]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, printed) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"machine {rank}: exit {proc.returncode}\n{printed[-4000:]}"
        assert f"the 1 rank(s) of this machine itself on machine {rank} of 2" in printed
    resolved = yaml.safe_load((out / "config.yaml").read_text())["resolved"]
    launcher = resolved["launcher"]
    assert (launcher["process_group_world_size"], launcher["num_machines"],
            launcher["processes_per_machine"]) == (2, 2, 1)
    notes = [line for text in outputs for line in text.splitlines()
             if "asks for mixed_precision fp16" in line]
    assert len(notes) == 1, notes
    assert resolved["precision_requested"] == "auto"
    used = resolved["precision_used"]
    assert notes[0].endswith(f"this run uses {used}, as --mixed-precision auto chooses on this "
                             f"machine")


def test_the_mpirun_answer_without_mpirun_is_one_line_and_starts_nothing(tmp_path):
    config = tmp_path / "mpirun.yaml"
    answer_accelerate_config(config, {**ONE_MACHINE, "launch mpirun": "yes",
                                      "hostfile": str(tmp_path / "hostfile")},
                             conftest.test_env())
    assert yaml.safe_load(config.read_text())["mpirun_config"]["mpirun_hostfile"]
    env = conftest.test_env(PATH=str(Path(sys.executable).parent))  # no MPI on this PATH
    result = conftest.run([sys.executable, "-m", "accel_train", "launch", "--config_file",
                           str(config), "--", *TRAIN, "--output-dir", str(tmp_path / "run")],
                          env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "mpirun, which is not installed" in result.stderr
    assert "answer no to mpirun" in result.stderr
    assert not (tmp_path / "run").exists()
