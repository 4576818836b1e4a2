"""scripts/slurm/train.sbatch against a real SLURM: munged, slurmctld and slurmd started here
with a generated slurm.conf (one node, `localhost`, 2 CPUs, requeue allowed, no cgroups), the
real batch script submitted with sbatch, CPU processes over gloo.

Checked: a job trains to the end and is not requeued; a job sent its pre-emption signal
(`scancel --signal=USR1 --batch`, what `#SBATCH --signal=B:USR1@120` sends) saves, is requeued,
resumes from that checkpoint and ends bit-identical to the uninterrupted job; --max-requeues
stops the loop; a bad training flag or a YAML for another node count fails without a requeue,
the error in the job's output file.  Bad input outside SLURM needs no daemons.

The daemons need root and Debian's packages `slurm-wlm` and `munge`; without them these tests
skip with the reason (CI as root installs them, and `.ci/run` sets ACCEL_TRAIN_REQUIRE_SLURM=1 to
make them required).  Every wait polls the scheduler or a file; nothing sleeps a fixed time.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS, REPO, free_port
from conftest import test_env as child_env  # (imported as test_env, pytest would collect it)
from faults import (FAULT_TRAIN, assert_metrics_continuous, checkpoint_steps,
                    max_weight_difference, wait_until)

SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"
REQUIRE_ENV = "ACCEL_TRAIN_REQUIRE_SLURM"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin"])
DEADLINE = 240.0
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
PAUSE_STEP = 5  # the pre-emption test stops here (tests/slurm_entry.py); checkpoints every 3


def _which(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "they run as root (slurmd starts jobs as their user)"
    absent = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed"
    return None


def _skip_or_fail(reason: str):
    message = (f"SLURM tests: {reason}; to run them, as root: apt-get install -y slurm-wlm munge "
               f"(CI=true .ci/run does it when run as root)")
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message} ({REQUIRE_ENV}=1 requires them)", pytrace=False)
    pytest.skip(message)


def _wait(condition, what: str, timeout: float = DEADLINE, explain=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{explain()}")


def _job_port_base_free(first_job_id: int) -> bool:
    """train.sbatch derives the main port from the job id (10000 + id % 20000): start the job ids
    where the next few ports are free, so that two clusters on one machine never share one."""
    for job_id in range(first_job_id, first_job_id + 10):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", 10000 + job_id % 20000))
            except OSError:
                return False
    return True


class Cluster:
    """munged + slurmctld + slurmd of our own, in a temporary folder; stopped (and every job in
    it cancelled) at the end.  Only processes we started are signalled, by their pid."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.conf = root / "slurm.conf"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(self.conf)

    # -- start and stop ---------------------------------------------------------------------
    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = (self.root / "log" / f"{name}.out").open("w")
        proc = subprocess.Popen([_which(name), *args], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        root = self.root
        for sub in ("munge", "run", "log", "state", "spool"):
            (root / sub).mkdir()
        os.chmod(root, 0o755)        # munged: the socket's folder must be reachable by all
        os.chmod(root / "run", 0o755)
        os.chmod(root / "munge", 0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o600)
        socket_path = root / "run" / "munge.sock"
        self._spawn("munged", "--foreground", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={root / 'run' / 'munged.pid'}",
                    f"--seed-file={root / 'munge' / 'seed'}",
                    f"--log-file={root / 'log' / 'munged.log'}")
        self._wait_alive(lambda: socket_path.exists(), "munged's socket")

        # Random on purpose (not a test choice): two test clusters started one after the other
        # must not derive the same training ports from the same job ids.  Printed.
        first_job = random.randint(1, 19000)
        while not _job_port_base_free(first_job):
            first_job = random.randint(1, 19000)
        print(f"test cluster: first job id {first_job}")
        host = socket.gethostname().split(".")[0]
        self.conf.write_text(f"""\
ClusterName=acceltrain{os.getpid()}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits cred_expire + 1 s before it may start (default 120 s)
AuthInfo=socket={socket_path},cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}
SlurmdPidFile={root / 'run' / 'slurmd.pid'}
SlurmctldLogFile={root / 'log' / 'slurmctld.log'}
SlurmdLogFile={root / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
FirstJobId={first_job}
MinJobAge=900
KillWait=30
SlurmctldDebug=info
SlurmdDebug=info
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
        self._spawn("slurmctld", "-D", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-N", "localhost", "-f", str(self.conf))
        self._wait_alive(lambda: self.sinfo_state() == "idle", "the node to be idle")

    def _wait_alive(self, condition, what: str) -> None:
        def check():
            for proc in self.procs:
                if proc.poll() is not None:
                    raise AssertionError(f"{proc.args[0]} exited {proc.returncode} before "
                                         f"{what}\n{self.logs()}")
            return condition()
        _wait(check, what, 60, self.logs)

    def sinfo_state(self) -> str:
        result = self.client("sinfo", "-h", "-N", "-o", "%T", check=False)
        return result.stdout.strip().rstrip("*") if result.returncode == 0 else ""

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def cancel_all(self) -> None:
        """Cancel every job of this cluster and wait until they are gone from the node (slurmd
        would otherwise leave their slurmstepd and training processes running)."""
        self.client("scancel", "--partition", "test", check=False)

        def all_ended():
            result = self.client("squeue", "-h", "-t", "all", "-o", "%T", check=False)
            return result.returncode == 0 and set(result.stdout.split()) <= TERMINAL
        _wait(all_ended, "the jobs to end", 120, self.logs)

    def stop(self) -> None:
        for proc in reversed(self.procs):  # slurmd, slurmctld, munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    # -- clients ----------------------------------------------------------------------------
    def client(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([_which(name), *args], env=self.env, capture_output=True,
                                text=True, timeout=60)
        if check and result.returncode != 0:
            raise AssertionError(f"{name} {' '.join(args)} exited {result.returncode}: "
                                 f"{result.stderr}{result.stdout}")
        return result

    def submit(self, output: Path, script_args: list[str], **env: str) -> "Job":
        """sbatch the real script from the repository root, exporting a test environment
        (the project's Python first on PATH, as a user's activated environment would be)."""
        job_env = child_env(ACCEL_TRAIN_PYTHON=sys.executable, **env)
        job_env = {k: v for k, v in job_env.items() if not k.startswith("SLURM_")}
        job_env["SLURM_CONF"] = str(self.conf)
        result = subprocess.run(
            [_which("sbatch"), "--parsable", "--cpus-per-task=2", f"--chdir={REPO}",
             f"--output={output}", str(SCRIPT), *script_args],
            env=job_env, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert result.returncode == 0, f"sbatch failed: {result.stderr}\n{self.logs()}"
        return Job(self, int(result.stdout.strip().split(";")[0]), output)


class Job:
    def __init__(self, cluster: Cluster, job_id: int, output: Path):
        self.cluster, self.id, self.output_file = cluster, job_id, output

    def info(self) -> dict:
        text = self.cluster.client("scontrol", "show", "job", "-o", str(self.id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    @property
    def output(self) -> str:
        return self.output_file.read_text(errors="replace") if self.output_file.exists() else ""

    def explain(self) -> str:
        return f"--- job {self.id} output\n{self.output[-6000:]}\n{self.cluster.logs()}"

    def wait_for_output(self, text: str, timeout: float = DEADLINE) -> None:
        def seen():
            if text in self.output:
                return True
            state = self.info().get("JobState")
            if state in TERMINAL:
                raise AssertionError(f"job {self.id} ended ({state}) before printing "
                                     f"{text!r}\n{self.explain()}")
            return False
        _wait(seen, f"{text!r} in job {self.id}'s output", timeout, self.explain)

    def wait_end(self, timeout: float = DEADLINE) -> dict:
        """Poll until the job is in a final state (a requeued job passes through PENDING and
        RUNNING again: that is not the end)."""
        return _wait(lambda: (lambda info: info if info.get("JobState") in TERMINAL else None)(
            self.info()), f"job {self.id} to end", timeout, self.explain)


@pytest.fixture(scope="module")
def cluster():
    reason = _missing()
    if reason:
        _skip_or_fail(reason)
    root = Path(tempfile.mkdtemp(prefix="accel-slurm-", dir="/tmp"))
    instance = Cluster(root)
    try:
        instance.start()
        yield instance
    finally:
        try:
            if any(proc.poll() is None for proc in instance.procs[1:]):
                instance.cancel_all()
        finally:
            instance.stop()
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def jobs_cancelled_after(cluster):
    yield
    cluster.cancel_all()  # a failed test must not leave a job running into the next one


def _train_args(out: Path, *script_options: str) -> list[str]:
    return [*script_options, "--", *FAULT_TRAIN, "--output-dir", str(out)]


@pytest.fixture(scope="module")
def finished_job(cluster, tmp_path_factory):
    """An uninterrupted job: `accelerate launch` with cpu_2proc.yaml (2 CPU processes)."""
    tmp = tmp_path_factory.mktemp("slurm_finished")
    out = tmp / "run"
    job = cluster.submit(tmp / "job.out", _train_args(
        out, "--config_file", str(CONFIGS.relative_to(REPO) / "cpu_2proc.yaml")))
    try:
        return job, job.wait_end(), out
    finally:
        cluster.cancel_all()


@pytest.mark.slow
def test_job_trains_to_the_end_and_is_not_requeued(finished_job):
    job, info, out = finished_job
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), \
        job.explain()
    output = job.output
    assert "accelerate launch --config_file accelerate_configs/cpu_2proc.yaml, 2 process(es) " \
           "per node" in output
    assert "training finished (exit 0); not requeued" in output
    assert f"slurm: job {job.id} on localhost (node 0 of 1), requeued 0 time(s)" in output
    assert (out / "model.safetensors").is_file()
    resolved = yaml.safe_load((out / "config.yaml").read_text())["resolved"]["launcher"]
    assert resolved["process_group_world_size"] == 2
    assert resolved["slurm"] == {"job_id": str(job.id), "job_name": "accel-train",
                                 "node": "localhost", "node_id": 0, "num_nodes": 1,
                                 "restart_count": 0}
    assert_metrics_continuous(out, total_steps=16)


@pytest.mark.slow
def test_preempted_job_saves_is_requeued_and_resumes_bit_identical(cluster, finished_job,
                                                                    tmp_path,
                                                                    jobs_cancelled_after):
    """USR1 to the batch shell at step 5 (torchrun this time): the training saves step 5 and
    stops, the script requeues the job, the second allocation resumes from step 5 and finishes
    with exactly the uninterrupted job's weights."""
    out = tmp_path / "run"
    job = cluster.submit(tmp_path / "job.out", _train_args(out, "--procs-per-node", "2"),
                         ACCEL_TRAIN_MODULE="tests.slurm_entry",
                         ACCEL_TRAIN_TEST_PAUSE_AT_STEP=str(PAUSE_STEP))
    job.wait_for_output(f"slurm test: waiting for SIGTERM at step {PAUSE_STEP}")
    # step 3's checkpoint is sealed on a thread while training goes on (the pause holds only
    # the main thread): on a loaded machine it may still be on its way at step 5
    wait_until(lambda: 3 in checkpoint_steps(out), "step 3's checkpoint")
    cluster.client("scancel", "--signal=USR1", "--batch", str(job.id))
    info = job.wait_end()
    output = job.output
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        job.explain()
    checkpoint = out / "checkpoints" / f"step_{PAUSE_STEP:08d}"
    assert f"stopped by a signal at step {PAUSE_STEP}: saved {checkpoint}" in output
    assert f"requeueing job {job.id} (requeue 1 of at most 3)" in output
    assert f"job {job.id} (restart 1, at most 3 requeues)" in output
    assert f"resumed from {checkpoint} at step {PAUSE_STEP}" in output
    assert "requeued 1 time(s)" in output
    assert output.rstrip().endswith("training finished (exit 0); not requeued"), output[-2000:]
    # config.yaml is the first allocation's; the resumed start records itself beside it
    first = yaml.safe_load((out / "config.yaml").read_text())["resolved"]["launcher"]["slurm"]
    resumed, = out.glob("config.resume-*.yaml")
    second = yaml.safe_load(resumed.read_text())["resolved"]["launcher"]["slurm"]
    assert (first["job_id"], first["restart_count"]) == (str(job.id), 0)
    assert (second["job_id"], second["restart_count"]) == (str(job.id), 1)
    assert_metrics_continuous(out, total_steps=16)
    _, _, uninterrupted = finished_job
    assert max_weight_difference(uninterrupted, out) == 0.0


@pytest.mark.slow
def test_requeues_stop_at_the_maximum(cluster, tmp_path, jobs_cancelled_after):
    """--max-requeues 1, pre-empted twice: requeued once, then left for the user (exit 143).
    The script's rule alone: a stand-in that stops on SIGTERM with 143 instead of training."""
    job = cluster.submit(tmp_path / "job.out",
                         ["--procs-per-node", "2", "--max-requeues", "1", "--",
                          "--output-dir", str(tmp_path / "run")],
                         ACCEL_TRAIN_MODULE="tests.slurm_entry", ACCEL_TRAIN_TEST_STAND_IN="1")
    for allocation in (0, 1):
        for rank in (0, 1):
            job.wait_for_output(f"slurm test: stand-in rank {rank} of allocation {allocation} "
                                f"waiting for SIGTERM")
        cluster.client("scancel", "--signal=USR1", "--batch", str(job.id))
    info = job.wait_end()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "143:0", "1"), \
        job.explain()
    output = job.output
    assert f"requeueing job {job.id} (requeue 1 of at most 1)" in output
    assert output.rstrip().endswith(
        "pre-empted (training exit 1) but already requeued 1 time(s) (--max-requeues 1): not "
        "requeued; submit the same command again to continue"), output[-2000:]


@pytest.mark.slow
def test_bad_training_flag_fails_without_requeue(cluster, tmp_path, jobs_cancelled_after):
    job = cluster.submit(tmp_path / "job.out",
                         ["--procs-per-node", "2", "--", "--output-dir", str(tmp_path / "run"),
                          "--no-such-flag"])
    info = job.wait_end()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", job.explain()
    assert info["ExitCode"] != "0:0"
    output = job.output
    # Each rank finds the flag on its own, but torchrun stops the other rank as soon as one has
    # failed (its monitor looks every 0.1 s): one still importing then never gets to say it, and
    # which one gets there first is the machine's load.  So: the one line of whichever ranks
    # did, the same line, and no other error from them.
    said = re.findall(r"^accel_train: error(?: \(rank \d+\))?: (.*)$", output, re.MULTILINE)
    assert said and all(line.startswith("unrecognized arguments: --no-such-flag")
                        for line in said), job.explain()
    assert "not requeued" in output and "requeueing" not in output, job.explain()


@pytest.mark.slow
def test_yaml_for_another_node_count_is_refused_in_one_line(cluster, tmp_path,
                                                            jobs_cancelled_after):
    yaml_path = "accelerate_configs/cpu_2node_rank0.yaml"  # num_machines: 2; the job has 1 node
    job = cluster.submit(tmp_path / "job.out", ["--config_file", yaml_path, "--",
                                                "--output-dir", str(tmp_path / "run")])
    info = job.wait_end()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), \
        job.explain()
    assert job.output.strip().splitlines() == [
        f"train.sbatch: --config_file {yaml_path} says num_machines: 2 but the job has 1 "
        f"node(s); submit with sbatch --nodes 2, or use a YAML for 1 machine(s)"]
    assert not (tmp_path / "run").exists()


# -- bad input without any daemon: the script run by hand, or with a made-up job environment ---
def _run_script(args: list[str], **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in child_env(ACCEL_TRAIN_PYTHON=sys.executable).items()
            if not k.startswith("SLURM_")}
    return subprocess.run(["bash", str(SCRIPT), *args], env={**base, **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


FAKE_JOB = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost"}


@pytest.mark.parametrize("args, env, message", [
    (["--", "--output-dir", "runs/x"], {},
     "train.sbatch: not inside a SLURM job (SLURM_JOB_ID is unset); submit it: sbatch"),
    (["--", "--epochs", "1"], FAKE_JOB, "train.sbatch: no --output-dir given: pass --output-dir"),
    (["--config_file", "accelerate_configs/2node.yaml", "--", "--output-dir", "runs/x"], FAKE_JOB,
     "train.sbatch: --config_file accelerate_configs/2node.yaml says num_machines: 2 but the "
     "job has 1 node(s)"),
    (["--config_file", "nowhere.yaml", "--", "--output-dir", "runs/x"], FAKE_JOB,
     "train.sbatch: --config_file nowhere.yaml: no such file"),
    (["--nodes", "2", "--", "--output-dir", "runs/x"], FAKE_JOB,
     "train.sbatch: unknown option --nodes before --"),
    (["--", "--output-dir", "runs/x", "--resume", "runs/old/checkpoints"], FAKE_JOB,
     "train.sbatch: --resume runs/old/checkpoints: this script always passes --resume auto"),
    (["--max-requeues", "many", "--", "--output-dir", "runs/x"], FAKE_JOB,
     "train.sbatch: --max-requeues (or MAX_REQUEUES) must be a whole number"),
    (["--procs-per-node", "0", "--", "--output-dir", "runs/x"], FAKE_JOB,
     "train.sbatch: --procs-per-node (or ACCEL_TRAIN_PROCS_PER_NODE) must be a number >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(args, env, message, tmp_path):
    out = tmp_path / "x"
    result = _run_script([str(out) if arg == "runs/x" else arg for arg in args], **env)
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert not out.exists()
