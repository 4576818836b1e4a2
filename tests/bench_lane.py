"""Runs benchmark scripts one after another in this one process, each as `python SCRIPT ARGS`
would run it (`runpy.run_path` with `__name__ == "__main__"` and its own `sys.argv`), for
tests/test_benchmarks.py's smoke runs.

Why not a process per script: each new process pays seconds of imports (torch, timm,
torchvision's ops with torch._dynamo) before it reads an argument, and the smoke runs are mostly
that; a lane pays them once for all its scripts.  The runs the scripts start themselves (their
arms: launchers, training processes) are still processes of their own, as they must be; those
started through benchlib.run as `python -m accel_train` or a launcher are forked from a warm
starter of the lane's (tests/warm_start.py, the one the tests' own runs use: a launcher's ranks
forked by the launcher), the others are new interpreters.  ACCEL_TRAIN_TEST_WARM=0 makes every
run a new interpreter.

    python tests/bench_lane.py JOBS.json RESULTS.json [PARENT_PID]

JOBS.json: a list of {"name", "script", "argv", "log"}, which several lanes may share: a lane
runs a job only if it is the first to claim it (creates JOBS.claims/NAME, exclusively), so the
lanes take the next job as each comes free and end within about one job of each other whatever
the jobs cost on this machine.  Each script's stdout and stderr (its
children's too: the file descriptors are redirected, not only sys.stdout) go to its "log";
RESULTS.json gets {name: exit code}, written after each script, so a lane that hangs still
says which scripts finished; RESULTS.cpu.json beside it {name: CPU seconds}, the script's own
and its children's, forked ones included (where a smoke test's time goes:
docs/development.md).  Between scripts the process-wide state a script may change is put
back: the environment, the working directory, torch's thread count, Accelerate's singletons,
sys.argv and sys.path.  Given PARENT_PID (tests/bench_background.py starts the lanes in a
session of their own, in the background), the lane kills its process group and itself when
that process is gone: a pytest worker that died leaves no lane behind.  RESULTS.priority.json
says at the end what CPU priority the lane had (its cgroup, its nice value).
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from warm_start import WarmStarter

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, argv: list[str], log: str) -> int:
    import torch
    from accelerate.state import AcceleratorState

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_argv, saved_path, threads = sys.argv[:], sys.path[:], torch.get_num_threads()
    sys.stdout.flush(), sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1), os.dup2(out.fileno(), 2)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))  # as `python SCRIPT` puts the script's folder
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the script's failure, as python would
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
        os.close(saved_fds[0]), os.close(saved_fds[1])
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv, sys.path[:] = saved_argv, saved_path
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    return code


def _cpu_seconds(warm: WarmStarter) -> float:
    used = os.times()
    return (used.user + used.system + used.children_user + used.children_system
            + warm.forked_cpu_seconds)


def _warm_children(log: Path) -> WarmStarter:
    """benchlib.run's and benchlib.start_streaming's children forked from a warm starter
where they can be (its seams)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import benchlib  # the module the scripts' own `import benchlib` finds in sys.modules

    sys.path.pop(0)
    warm = WarmStarter(benchlib.child_env, REPO, log)
    benchlib.start_command = warm.run
    benchlib.start_streaming = functools.partial(warm.start, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True)
    return warm


def _claim(path: Path) -> bool:
    """True for the one lane whose exclusive create of `path` succeeds (it names the lane)."""
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(descriptor, str(os.getpid()).encode())
    os.close(descriptor)
    return True


def _end_with(parent: int) -> None:
    """Watch `parent` from a thread; once it is gone, kill this lane's process group."""
    def watch():
        while os.getppid() == parent:
            time.sleep(2)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def main(jobs_file: str, results_file: str, parent: str = "") -> int:
    if parent:
        _end_with(int(parent))
    results: dict[str, int] = {}
    cpu: dict[str, float] = {}
    warm = _warm_children(Path(results_file).with_suffix(".starter.log"))
    try:
        claims = Path(jobs_file).with_suffix(".claims")
        claims.mkdir(exist_ok=True)
        for job in json.loads(Path(jobs_file).read_text()):
            if not _claim(claims / job["name"]):
                continue
            before = _cpu_seconds(warm)
            results[job["name"]] = _run(job["script"], job["argv"], job["log"])
            cpu[job["name"]] = round(_cpu_seconds(warm) - before, 1)
            Path(results_file).write_text(json.dumps(results))
            Path(results_file).with_suffix(".cpu.json").write_text(json.dumps(cpu))
    finally:
        warm.close()
        Path(results_file).with_suffix(".priority.json").write_text(json.dumps(_priority()))
    return 0


def _priority() -> dict:
    """What this lane ran at: its `cpu` cgroup (cgroup v1's line of /proc/self/cgroup) and
    its nice value."""
    groups = dict(line.split(":", 2)[1:] for line in
                  Path("/proc/self/cgroup").read_text().splitlines() if line.count(":") >= 2)
    return {"cgroup": groups.get("cpu", groups.get("", "")),
            "nice": os.getpriority(os.PRIO_PROCESS, 0)}


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
