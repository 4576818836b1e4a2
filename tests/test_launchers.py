"""Topology YAMLs, `accel-train launch` (elastic settings), and two "machines" on 127.0.0.1.

The 2-process launch paths on one machine (accelerate launch, torchrun, torch.distributed.launch)
are tested in test_equivalence.py, where their runs are also compared with one process.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from accel_train import cli
from accel_train.run import rank_launcher
from accel_train.commands import launch
from accel_train.base.errors import UsageError

import conftest
from conftest import PINNED, CONFIGS, REPO, free_port

ACCELERATE_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name != "elastic.yaml")
MACHINE_PAIRS = [("2node.yaml", "2node_rank1.yaml"),
                 ("cpu_2node_rank0.yaml", "cpu_2node_rank1.yaml")]



# -- the YAMLs --------------------------------------------------------------------------------

def test_the_expected_topologies_are_there():
    assert {"1gpu.yaml", "1node_multigpu.yaml", "2node.yaml", "2node_rank1.yaml",
            "cpu_2proc.yaml", "cpu_2node_rank0.yaml", "cpu_2node_rank1.yaml"} <= \
        set(ACCELERATE_CONFIGS)


@pytest.mark.parametrize("name", ACCELERATE_CONFIGS)
def test_each_config_loads_with_accelerates_own_loader(name):
    config = load_config_from_file(str(CONFIGS / name))  # raises on unknown keys
    text = (CONFIGS / name).read_text()
    assert text.startswith("#"), "each file says what it is for"
    assert config.num_processes >= 1 and config.num_processes % config.num_machines == 0
    assert 0 <= config.machine_rank < config.num_machines
    if config.num_machines > 1:
        assert config.main_process_ip and config.main_process_port
        # same_network: true would leave a c10d (elastic) rendezvous without an endpoint.
        assert config.same_network is False
    if config.num_processes > 1:
        # MULTI_GPU picks the multi-process launcher; MULTI_CPU/--cpu would start one process.
        assert str(config.distributed_type.value) == "MULTI_GPU"


@pytest.mark.parametrize("rank0, rank1", MACHINE_PAIRS)
def test_the_two_machine_files_differ_only_in_machine_rank(rank0, rank1):
    first = yaml.safe_load((CONFIGS / rank0).read_text())
    second = yaml.safe_load((CONFIGS / rank1).read_text())
    assert (first.pop("machine_rank"), second.pop("machine_rank")) == (0, 1)
    assert first == second


# -- accel-train launch -----------------------------------------------------------------------

def test_launch_script_turns_the_elastic_file_into_launcher_flags():
    command = launch.build_command(str(CONFIGS / "2node.yaml"), str(CONFIGS / "elastic.yaml"),
                                   ["--main_process_port", "29600"], ["--epochs", "3"])
    text = " ".join(command)
    assert text.startswith(f"{sys.executable} -m accelerate.commands.launch --config_file ")
    assert "--max_restarts 3 --monitor_interval 5 --rdzv_backend c10d " \
           "--rdzv_conf join_timeout=900" in text
    assert "--same_network" not in command
    assert text.endswith("--main_process_port 29600 -m accel_train --epochs 3")


def test_launch_script_passes_rdzv_id_and_unshared_store_through_the_environment():
    elastic = launch.read_yaml(str(CONFIGS / "elastic.yaml"), "--elastic")
    assert launch.launcher_environment(elastic) == {
        "PET_RDZV_ID": "my-job-1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert launch.launcher_environment({"rdzv_backend": "static"}) == {}


def test_launch_script_honours_the_yaml_keys_accelerate_ignores():
    # cpu_2proc.yaml says rdzv_backend: static and same_network: true; no elastic file.
    command = launch.build_command(str(CONFIGS / "cpu_2proc.yaml"), None, [], [])
    assert command[command.index("--rdzv_backend") + 1] == "static"
    assert "--same_network" in command and "--max_restarts" not in command


@pytest.mark.parametrize("elastic, message", [
    ("max_restart: 2\n", "unknown key(s) max_restart; use max_restarts"),
    ("max_restarts: -1\n", "max_restarts must be a whole number >= 0"),
    ("monitor_interval: soon\n", "monitor_interval must be seconds > 0"),
    ("rdzv_backend: zookeeper\n", "rdzv_backend 'zookeeper' is not one of"),
    ("- a list\n", "expected a mapping"),
    (None, "no such file"),
])
def test_launch_script_bad_elastic_file_is_one_line_exit_2(tmp_path, capsys, elastic, message):
    path = tmp_path / "elastic.yaml"
    if elastic is not None:
        path.write_text(elastic)
    code = cli.main(["launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--elastic",
                     str(path), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert err.startswith("accel_train: error: --elastic ")
    with pytest.raises(UsageError, match=re.escape(message)):  # the module itself raises
        launch.main(["--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--elastic", str(path),
                     "--dry-run"])


def test_launch_script_rejects_what_accelerate_would_reject(tmp_path, capsys):
    bad = tmp_path / "acc.yaml"
    bad.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nmax_restarts: 3\n")
    code = cli.main(["launch", "--config_file", str(bad), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "accelerate rejects it" in err and "max_restarts" in err
    assert err.count("\n") == 1


def test_launch_script_dry_run_prints_the_command(capsys):
    code = launch.main(["--config_file", str(CONFIGS / "cpu_2node_rank1.yaml"), "--elastic",
                        str(CONFIGS / "elastic.yaml"), "--dry-run", "--main_process_port",
                        "29999", "--", "--epochs", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "--max_restarts 3" in out and "--main_process_port 29999" in out
    assert out.strip().endswith("-m accel_train --epochs 2")
    assert out.startswith("PET_RDZV_ID=my-job-1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ")


@pytest.mark.parametrize("train_args, message", [
    (["--epochs", "0"], "--epochs"),
    (["--model", "resnet_does_not_exist"], "--model 'resnet_does_not_exist' is not a timm"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_launch_refuses_bad_training_flags_before_starting_anything(tmp_path, capsys,
                                                                    train_args, message):
    """What follows `--` is read as every worker would read it: one line, exit 2, before the
    launcher starts (a worker's refusal would repeat once per process and elastic restart)."""
    code = cli.main(["launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--elastic",
                     str(CONFIGS / "elastic.yaml"), "--dry-run", "--", *train_args,
                     "--output-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, (out, err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("misplaced, message", [
    (["--epochs", "2"], "--epochs is an accel_train flag: put it after `--`"),
    (["--batch_size=8"], "--batch_size is an accel_train flag"),
    (["--no-plots"], "--no-plots is an accel_train flag"),
    (["--max_restart", "3"], "--max_restart: accelerate launch has no such flag"),
])
def test_launch_names_a_flag_before_the_separator_that_accelerate_does_not_take(
        capsys, misplaced, message):
    code = cli.main(["launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--dry-run",
                     "--main_process_port", "29600", *misplaced, "--", "--max-steps", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, (out, err)


def test_launch_without_config_file_is_one_line_exit_2(capsys):
    code = cli.main(["launch", "--dry-run", "--", "--epochs", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--config_file" in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_launch_dry_run_through_the_console_entry_point(tmp_path):
    """The real path a user takes: `python -m accel_train launch ...` in its own process."""
    result = conftest.run([sys.executable, "-m", "accel_train", "launch", "--config_file",
                           str(CONFIGS / "2node.yaml"), "--elastic",
                           str(CONFIGS / "elastic.yaml"), "--dry-run", "--machine_rank", "0",
                           "--", "--epochs", "3", "--output-dir", str(tmp_path / "run")],
                          check=True)
    printed = shlex.split(result.stdout.strip())
    assert result.stdout.count("\n") == 1 and not (tmp_path / "run").exists()
    assert printed[:2] == ["PET_RDZV_ID=my-job-1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
    assert printed[2:7] == [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                            str(CONFIGS / "2node.yaml")]
    assert printed[7:] == ["--max_restarts", "3", "--monitor_interval", "5", "--rdzv_backend",
                           "c10d", "--rdzv_conf", "join_timeout=900", "--machine_rank", "0",
                           "-m", "accel_train", "--epochs", "3", "--output-dir",
                           str(tmp_path / "run")]

    bad = conftest.run([sys.executable, "-m", "accel_train", "launch", "--config_file",
                        str(tmp_path / "missing.yaml"), "--dry-run"])
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == f"accel_train: error: --config_file {tmp_path / 'missing.yaml'}: " \
                         f"no such file\n"


# -- two machines -----------------------------------------------------------------------------

TINY = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--max-eval-samples", "64",
        "--model", "test_resnet", "--batch-size", "8", "--epochs", "1", "--max-steps", "4",
        "--log-every", "1", "--progress", "log", "--no-plots", *PINNED]


@pytest.mark.slow
def test_two_machines_on_loopback_with_per_machine_elastic_settings(tmp_path):
    """Two `accelerate launch` invocations through `accel-train launch`, machine ranks 0 and 1, each
    with its own YAML and its own elastic file; the elastic settings must reach the torchrun
    agent (its INFO log) and the workers (TORCHELASTIC_MAX_RESTARTS, recorded in config.yaml)."""
    port, out = free_port(), tmp_path / "run"
    env = conftest.test_env(LOGLEVEL="INFO")  # the torchrun agent logs its launch settings
    procs = []
    for rank in (0, 1):
        elastic = tmp_path / f"elastic_rank{rank}.yaml"
        # c10d: the backend accelerate's YAML cannot select.  Both "machines" are 127.0.0.1, so
        # say which one hosts the rendezvous store (on real machines c10d works it out).
        elastic.write_text(yaml.safe_dump({
            "max_restarts": 2, "monitor_interval": 0.5, "rdzv_backend": "c10d",
            "rdzv_id": f"job-{port}", "rdzv_conf": {"join_timeout": 300, "is_host": rank == 0}}))
        command = [sys.executable, "-m", "accel_train", "launch", "--config_file",
                   str(CONFIGS / f"cpu_2node_rank{rank}.yaml"), "--elastic", str(elastic),
                   "--main_process_port", str(port), "--", *TINY, "--output-dir", str(out)]
        procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=420)
            results.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"machine {rank} exited {code}\n{stdout[-3000:]}\n{stderr[-5000:]}"
        for setting in ("rdzv_backend             : c10d", "max_restarts             : 2",
                        "monitor_interval         : 0.5", "'join_timeout': '300'"):
            assert setting in stderr, f"machine {rank}: the agent did not get {setting!r}"

    resolved = yaml.safe_load((out / "config.yaml").read_text())["resolved"]
    launcher = resolved["launcher"]
    assert resolved["world_size"] == 2 and launcher["process_group_world_size"] == 2
    assert launcher["num_machines"] == 2 and launcher["processes_per_machine"] == 1
    assert launcher["torchelastic"]["max_restarts"] == 2  # what the worker saw
    assert launcher["torchelastic"]["run_id"] == f"job-{port}"  # rdzv_id reached torchrun
    for rank in (0, 1):
        log = (out / "logs" / f"rank{rank}.log").read_text()
        assert f"process rank {rank} of 2 (local rank 0 of 1)" in log
    # The summary and progress come from the global main process only: one of the two machines.
    for printed in ("accel_train: test_resnet", "x 2 process(es), gloo", "step 4/4 "):
        assert sorted(stdout.count(printed) for _, stdout, _ in results) == [0, 1], printed
    assert (out / "model.safetensors").exists()


# -- accelerate's single-process launcher (--cpu / MULTI_CPU): the ranks we start -------------
# (launched for real, from the files `accelerate config` writes, in test_accelerate_config.py)

SIMPLE_LAUNCHER_ENV = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29612"}
ACCELERATE = ["/venv/bin/python", "/venv/bin/accelerate", "launch"]


def _multi_cpu_yaml(tmp_path, **changes) -> str:
    config = yaml.safe_load((CONFIGS / "cpu_2proc.yaml").read_text())
    config.update(distributed_type="MULTI_CPU", use_cpu=True, **changes)
    path = tmp_path / "multi_cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("argv", [
    [*ACCELERATE, "--cpu", "--num_processes", "2", "-m", "accel_train", "--epochs", "1"],
    ["/venv/bin/accelerate", "launch", "--cpu", "--num-processes=2", "-m", "accel_train"],
    ["python", "-m", "accelerate.commands.launch", "--num_processes=2", "--cpu", "x.py"],
    ["/venv/bin/python", "/venv/lib/python3.11/site-packages/accelerate/commands/launch.py",
     "--num_processes", "2", "x.py"],
])
def test_the_ranks_asked_of_accelerate_are_read_from_its_command_line(argv):
    asked = rank_launcher.ranks_asked(SIMPLE_LAUNCHER_ENV, argv)
    assert (asked.num_processes, asked.num_machines, asked.machine_rank, asked.local_processes,
            asked.master_addr, asked.master_port) == (2, 1, 0, 2, "127.0.0.1", 29612)


def test_flags_win_over_the_config_file_as_in_accelerate_launch(tmp_path):
    config = _multi_cpu_yaml(tmp_path, num_processes=4, num_machines=2, machine_rank=0)
    from_file = rank_launcher.ranks_asked(SIMPLE_LAUNCHER_ENV,
                                          [*ACCELERATE, "--config_file", config, "-m", "x"])
    assert (from_file.num_processes, from_file.num_machines, from_file.machine_rank,
            from_file.local_processes) == (4, 2, 0, 2)
    flagged = rank_launcher.ranks_asked(SIMPLE_LAUNCHER_ENV, [
        *ACCELERATE, "--config_file", config, "--machine_rank", "1", "--num_processes", "6",
        "--max_restarts", "3", "--rdzv_backend", "c10d", "--rdzv_conf",
        "join_timeout=900,store_options=a=b", "-m", "x"])
    assert (flagged.num_processes, flagged.machine_rank, flagged.local_processes) == (6, 1, 3)
    assert (flagged.max_restarts, flagged.rdzv_backend) == (3, "c10d")
    assert rank_launcher._rendezvous_settings(flagged) == {"join_timeout": "900",
                                                           "store_options": "a=b"}
    assert rank_launcher._rendezvous_settings(from_file) == {"rank": 0}  # static: node rank


@pytest.mark.parametrize("environ, argv, why", [
    ({}, [*ACCELERATE, "--cpu", "--num_processes", "2", "-m", "x"], "plain python"),
    ({**SIMPLE_LAUNCHER_ENV, "WORLD_SIZE": "2", "RANK": "0"},
     [*ACCELERATE, "--num_processes", "2", "-m", "x"], "a multi-process launcher"),
    (SIMPLE_LAUNCHER_ENV, [*ACCELERATE, "--cpu", "--num_processes", "2", "--mpirun_hostfile",
                           "hosts", "-m", "x"], "mpirun starts the ranks"),
    (SIMPLE_LAUNCHER_ENV, [*ACCELERATE, "--cpu", "-m", "x"], "one process asked for"),
    (SIMPLE_LAUNCHER_ENV, ["/usr/bin/python", "train.py", "--num_processes", "2"],
     "not accelerate"),
])
def test_no_ranks_are_started_where_the_launcher_starts_them_or_one_was_asked(environ, argv,
                                                                              why):
    assert rank_launcher.ranks_asked(environ, argv) is None, why


def test_processes_that_do_not_divide_over_the_machines_are_one_line(tmp_path):
    config = _multi_cpu_yaml(tmp_path, num_processes=3, num_machines=2)
    with pytest.raises(UsageError, match="3 processes on 2 machines.*multiple of num_machines"):
        rank_launcher.ranks_asked(SIMPLE_LAUNCHER_ENV,
                                  [*ACCELERATE, "--config_file", config, "-m", "x"])
