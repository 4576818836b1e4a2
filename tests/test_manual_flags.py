"""The seed manual's --world_size --rank --gpu_ids --dist_url given to ONE process started
without a launcher (`python -m accel_train`): each is checked and used, or the run says in one
line that it is ignored and why; bad values stop in one line (exit 2) with the folder untouched."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

from conftest import TINY_TRAIN, accel_train_here

URL = "tcp://127.0.0.1:23456"
IGNORED = (f"warning: --dist_url {URL} is ignored: this is a single process (world size 1, no "
           f"launcher), which starts no process group; to start a group by hand give each process "
           f"--world_size N --rank R and the same --dist_url, or drop --dist_url")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("flags", [["--dist_url", URL],
                                   ["--world_size", "1", "--rank", "0", "--dist_url", URL]],
                         ids=["dist_url alone", "world_size 1 rank 0 dist_url"])
def test_a_dist_url_for_a_single_process_is_said_to_be_ignored(tmp_path, flags):
    out = tmp_path / "run"
    result = accel_train_here(*TINY_TRAIN, "--max-steps", "1", *flags, "--output-dir", str(out),
                              check=True)
    lines = (result.stdout + result.stderr).splitlines()
    assert lines.count(IGNORED) == 1, result.stdout[-3000:]
    assert "23456" not in "\n".join(line for line in lines if line != IGNORED)
    facts = yaml.safe_load((out / "config.yaml").read_text())["resolved"]
    assert facts["world_size"] == 1 and facts["launcher"]["process_group_world_size"] == 1
    assert "MASTER_PORT" not in os.environ  # nothing was set up from it


def test_a_single_process_without_a_dist_url_says_nothing_of_it(tmp_path):
    result = accel_train_here(*TINY_TRAIN, "--max-steps", "1", "--world_size", "1", "--rank",
                              "0", "--output-dir", str(tmp_path / "run"), check=True)
    assert "--dist_url" not in result.stdout + result.stderr


BAD = [
    (["--rank", "1"], "--rank 1 given for a single process; add --world_size and --dist_url, "
                      "or use a launcher"),
    # --world_size was given: the rank is what is wrong
    (["--world_size", "1", "--rank", "1", "--dist_url", URL],
     "--rank 1 must be below --world_size 1 (a single process is rank 0); for more processes "
     "give each --world_size N, its --rank and the same --dist_url, or use a launcher"),
    (["--dist_url", "127.0.0.1:23456"], "--dist_url '127.0.0.1:23456' is not of the form "
                                        "tcp://HOST:PORT"),
    (["--gpu_ids", "0"], "--gpu_ids 0 given but this machine has no CUDA device"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_a_manual_flag_a_single_process_cannot_use_stops_in_one_line(tmp_path, flags, message):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = accel_train_here(*TINY_TRAIN, *flags, "--output-dir", str(out))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("accel_train: error: ") and message in lines[0]
    assert sorted(os.listdir(out)) == ["notes.txt"]


@pytest.mark.slow  # a rank as a process, stopped by SIGINT: over 4 s
def test_a_rank_waiting_for_its_peer_says_so_and_stops_at_ctrl_c(tmp_path):
    """--world_size 2 --rank 0 started alone (the second shell's command never ran): one line
    on stdout says what it waits for (stderr stays for errors), and Ctrl-C ends it at once
    (the rendezvous waits inside torch's C++, where Python's handler never ran: it sat through
    Ctrl-C for 30 minutes)."""
    import signal
    import subprocess
    import sys
    import time
    from conftest import REPO, free_port
    from conftest import test_env as child_env  # (as test_env, pytest would collect it)
    url = f"tcp://127.0.0.1:{free_port()}"
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    process = subprocess.Popen(
        [sys.executable, "-m", "accel_train", *TINY_TRAIN, "--world_size", "2", "--rank", "0",
         "--dist_url", url, "--output-dir", str(tmp_path / "run")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    waiting = process.stdout.readline()  # blocks until the line comes (or the process ends)
    assert waiting.strip() == (f"rank 0 of 2: waiting for the other ranks at {url} (each "
                               f"started with --world_size 2, its own --rank and this "
                               f"--dist_url; Ctrl-C stops)")
    time.sleep(1)  # inside the rendezvous
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGINT and time.monotonic() - sent < 10
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two ranks, each a process: over 4 s
def test_ranks_started_with_other_options_are_refused_in_one_line(tmp_path):
    """Two shells, one typo: --seed 3 and --seed 4 trained two data orders as one run (exit 0),
    --batch_size 8 and 16 ended in gloo's C++ abort.  Now every rank says which option differs
    (exit 2) and nothing is written."""
    import subprocess
    import sys
    from conftest import free_port
    url = f"tcp://127.0.0.1:{free_port()}"
    env = _hand_started_env()
    ranks = [subprocess.Popen(
        [sys.executable, "-m", "accel_train", *TINY_TRAIN, "--world_size", "2", "--rank",
         str(rank), "--dist_url", url, "--seed", str(3 + rank), "--output-dir",
         str(tmp_path / "run")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for rank in (0, 1)]
    said = [process.communicate(timeout=300) for process in ranks]
    line = "rank 1 was started with --seed 4, rank 0 with 3: start every rank with the same options"
    assert [process.returncode for process in ranks] == [2, 2], said
    assert said[0][1].strip().splitlines()[-1] == f"accel_train: error: {line}"
    assert said[1][1].strip().splitlines()[-1] == f"accel_train: error (rank 1): {line}"
    assert not (tmp_path / "run").exists()


def _hand_started_env() -> dict:
    """The environment of a rank started by hand: the repository importable, nothing a launcher
    would set, no OMP_NUM_THREADS."""
    from conftest import REPO
    from conftest import test_env as child_env  # (as test_env, pytest would collect it)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "OMP_NUM_THREADS"):
        env.pop(key, None)
    return env


@pytest.mark.slow  # two pairs of ranks trained
@pytest.mark.parametrize("omp, threads", [(None, max(1, len(os.sched_getaffinity(0)) // 2)),
                                          ("2", 2)], ids=["unset", "OMP_NUM_THREADS=2"])
def test_ranks_started_by_hand_on_one_machine_share_its_cores(tmp_path, omp, threads):
    """torch gives every process a thread per core: two ranks on two cores ran four threads
    (several times slower, BENCHMARKS.md).  Ranks started by hand on one machine get its cores
    divided among them, as the launchers' OMP_NUM_THREADS does; one the user set is kept."""
    import subprocess
    import sys
    from conftest import free_port
    url = f"tcp://127.0.0.1:{free_port()}"
    env = _hand_started_env()
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = tmp_path / "run"
    ranks = [subprocess.Popen(
        [sys.executable, "-m", "accel_train", *TINY_TRAIN, "--max-steps", "2", "--world_size",
         "2", "--rank", str(rank), "--dist_url", url, "--output-dir", str(out)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    said = [process.communicate(timeout=300) for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0], said
    each = f"{threads} thread{'' if threads == 1 else 's'} each"
    assert f"x 2 process(es), gloo, {each};" in said[0][0], said[0][0][-2000:]
    assert yaml.safe_load((out / "config.yaml").read_text())["resolved"]["cpu_threads"] == \
        threads


@pytest.mark.slow  # two ranks trained
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None,
                    reason="needs two cores and taskset to pin two ranks")
def test_ranks_pinned_by_hand_share_only_the_cores_they_share(tmp_path):
    """Rank 0 pinned to two cores, rank 1 to the second of them (taskset, as numactl or
    torchrun --numa-binding pin ranks): by hand, rank 0 has its first core to itself and half
    of the second, 1.5 cores (its threads: 1), where dividing its cores by the machine's two
    ranks gave 1.  config.yaml records rank 0's."""
    import subprocess
    import sys
    from conftest import free_port
    first, second = sorted(os.sched_getaffinity(0))[:2]
    url = f"tcp://127.0.0.1:{free_port()}"
    env = _hand_started_env()
    out = tmp_path / "run"
    cores = {0: f"{first},{second}", 1: f"{second}"}
    ranks = [subprocess.Popen(
        ["taskset", "-c", cores[rank], sys.executable, "-m", "accel_train", *TINY_TRAIN,
         "--max-steps", "2", "--world_size", "2", "--rank", str(rank), "--dist_url", url,
         "--output-dir", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for rank in (0, 1)]
    said = [process.communicate(timeout=300) for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0], said
    resolved = yaml.safe_load((out / "config.yaml").read_text())["resolved"]
    assert resolved["cpu_cores"] == 1.5 and resolved["cpu_threads"] == 1, resolved


def test_a_checkpoint_file_of_the_manual_is_refused_at_the_start(tmp_path):
    """The seed manual's --checkpoint names a file (model_checkpoint.pth); here it is a folder.
    A file already there ended the run at its first save, after training, in a traceback."""
    old = tmp_path / "model_checkpoint.pth"
    old.write_bytes(b"the seed script's weights")
    result = accel_train_here(*TINY_TRAIN, "--max-steps", "1", "--checkpoint", str(old),
                              "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and result.stderr == (
        f"accel_train: error: --checkpoint {old} is a file; accel_train keeps its checkpoints "
        f"in a folder (a step_XXXXXXXX folder each, the final weights in the run's "
        f"model.safetensors): pass a folder's name\n")
    assert old.read_bytes() == b"the seed script's weights" and not (tmp_path / "run").exists()
    # a new name of the manual's form is the folder the checkpoints go in
    accel_train_here(*TINY_TRAIN, "--max-steps", "1", "--checkpoint", str(tmp_path / "new.pth"),
                     "--output-dir", str(tmp_path / "run"), check=True)
    assert (tmp_path / "new.pth" / "step_00000001" / "manifest.json").is_file()
