"""Shared helpers for the benchmark scripts (benchmarks/bench_*.py).

Every benchmark measures accel_train next to an anchor (a hand-written loop, the seed tutorial's
scripts, plain file I/O, ...) in the same run and prints a table of ratios and raw figures.  This
module holds what they share: the command line (--quick, --out), the machine description that
goes above every table, child processes with a controlled environment, steady-state statistics,
peak-memory sampling, and the table printer (GitHub markdown, so that the output can be pasted
into BENCHMARKS.md as it is).

Timing on a shared machine: other processes come and go, so a benchmark never compares two
numbers taken minutes apart.  Arms alternate in rounds (A B C, C B A, ...), each round gives a
ratio, and the tables show the median ratio with its range over rounds.  The 1-minute load
average is printed with the results; above about the number of cores, treat absolute figures
as pessimistic and ratios as the result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
# The benchmarks import accel_train from this checkout also where it is not installed (a GPU
# machine with its own torch runs `python3 benchmarks/X.py` from a bare copy).
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))
SHARED_CIFAR10 = REPO.parent / "shared" / "data" / "cifar10"
DEFAULT_OUT = REPO / "bench_out"
# fp32 and NCHW for accel_train's arms, like the anchors they are compared with: its defaults
# (--mixed-precision auto, --channels-last auto) time the machine and may choose otherwise.
FIXED_COMPUTE = ["--mixed-precision", "no", "--no-channels-last"]
ANCHORS = REPO / "benchmarks" / "anchors"
TWO_PROCESS_CONFIG = REPO / "accelerate_configs" / "cpu_2proc.yaml"
# The CLI's own line at a run's end: its training time, every evaluation included.
TRAINING_TOOK = re.compile(r"Training took ([\d.]+)s")


# -- command line and output ------------------------------------------------------------------
def make_parser(module_doc: str, data_dir: Optional[str] = str(SHARED_CIFAR10),
                data_help: str = "CIFAR-10 parquet folder (train.parquet, test.parquet)",
                ) -> argparse.ArgumentParser:
    """The options every benchmark has; --help describes it by its docstring's first paragraph.
    `data_dir`/`data_help`: for a benchmark whose --data-dir is not CIFAR-10's."""
    description = " ".join(module_doc.split("\n\n")[0].split())
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a few minutes instead of the full measurement")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help="folder for raw results (JSON) and this run's markdown")
    parser.add_argument("--data-dir", default=data_dir, help=data_help)
    parser.add_argument("--tag", default="", help="suffix for this run's output file names")
    return parser


class Report:
    """Collects tables; prints them as they come; writes <out>/<name>.md and <name>.json."""

    def __init__(self, name: str, title: str, args: argparse.Namespace):
        if getattr(args, "tag", ""):
            name = f"{name}-{args.tag}"
        self.name, self.title, self.args = name, title, args
        self.started = time.time()
        self.lines: list[str] = []
        self.data: dict = {"name": name, "machine": machine(), "argv": sys.argv,
                           "tables": []}
        self.emit(f"## {title}\n")
        self.emit(f"`{command_line()}`  \n{machine_line(self.data['machine'])}\n")

    def emit(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def table(self, title: str, headers: Sequence[str], rows: Iterable[Sequence],
              notes: Sequence[str] = ()) -> None:
        rows = [[_cell(value) for value in row] for row in rows]
        self.data["tables"].append({"title": title, "headers": list(headers), "rows": rows,
                                    "notes": list(notes), "load": load_average()})
        self.emit(f"### {title}\n")
        self.emit(markdown_table(headers, rows))
        for note in notes:
            self.emit(f"- {note}")
        self.emit(f"- load average (1/5/15 min) after this table: {load_text()}\n")

    def note(self, text: str) -> None:
        self.emit(text + "\n")

    def save(self) -> Path:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        self.emit(f"_{self.name}: {time.time() - self.started:.0f} s of wall-clock time_")
        (out / f"{self.name}.md").write_text("\n".join(self.lines) + "\n")
        (out / f"{self.name}.json").write_text(json.dumps(self.data, indent=1, default=str))
        return out / f"{self.name}.md"


def _cell(value) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:,.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        if magnitude >= 0.01:
            return f"{value:.3f}"
        return f"{value:.2e}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)]) + "\n"


def command_line() -> str:
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(REPO)
    except ValueError:
        pass
    return " ".join(["python", str(script), *map(shlex.quote, sys.argv[1:])])


# -- the machine --------------------------------------------------------------------------------
def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def load_text() -> str:
    return " / ".join(f"{v:.2f}" for v in load_average())


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> dict:
    import torch
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": socket.gethostname(),
            "cpu": _cpu_model(), "cores": os.cpu_count(),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load_average": load_average(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for name in ("accelerate", "timm", "torchvision"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    try:
        info["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True, timeout=5).stdout.strip()
        # tracked files changed since that commit: the figures are not that commit's alone
        info["git_changed"] = bool(subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        info["git"] = info["git_changed"] = None
    return info


def machine_line(info: dict) -> str:
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ", no GPU"
    return (f"{info['date']} on {info['cpu']} ({info['cores']} cores, {info['memory_gb']} GiB"
            f"{gpu}); torch {info['torch']}, accelerate {info['accelerate']}, timm "
            f"{info['timm']}; git {info['git']}"
            f"{' + uncommitted changes' if info.get('git_changed') else ''}; load average at start "
            f"{' / '.join(f'{v:.2f}' for v in info['load_average'])}")


# -- child processes ------------------------------------------------------------------------------
def child_env(threads: Optional[int] = None, **extra: str) -> dict:
    """Offline, unbuffered; OMP_NUM_THREADS pinned when given (the launchers otherwise pick)."""
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


def start_streaming(cmd: list[str], *, env: dict, cwd: Path) -> subprocess.Popen:
    """`cmd` as a new process, its stdout and stderr one text stream to read as it goes
    (`.stdout`)."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run(cmd: Sequence[str], env: Optional[dict] = None, timeout: float = 1800,
        cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run a command to completion; on failure raise with the tail of its output."""
    result = subprocess.run(list(map(str, cmd)), env=env or child_env(), cwd=cwd or REPO,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {result.returncode}\n--- stdout\n"
                           f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}")
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def last_json_line(text: str, key: str = "bench") -> dict:
    """The last stdout line of the form {"bench": ...}: how child processes report."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and f'"{key}"' in line:
            return json.loads(line)
    raise RuntimeError(f"no result line in the output:\n{text[-2000:]}")


def accelerate_launch(num_processes: int, port: int) -> list[str]:
    """The real multi-process launcher with the repository's CPU config (gloo on loopback)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "accelerate_configs" / "cpu_2proc.yaml"), "--num_processes",
            str(num_processes), "--main_process_port", str(port)]


def torchrun(num_processes: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
            str(num_processes), "--master-addr", "127.0.0.1", "--master-port", str(port)]


# -- statistics -----------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "n/a"
    return f"{min(values):.3f}-{max(values):.3f}"


def round_orders(arms: Sequence[str], rounds: int) -> list[list[str]]:
    """A B C, C B A, B C A, ...: every arm takes every position, drift cancels in the median."""
    orders = []
    for r in range(rounds):
        shift = (r // 2) % len(arms)
        order = list(arms[shift:]) + list(arms[:shift])
        orders.append(order if r % 2 == 0 else order[::-1])
    return orders


def steady_windows(records: list[dict], skip: int = 1) -> list[dict]:
    """metrics.jsonl train records after the first `skip` windows (start-up, allocator warm-up)."""
    train = [r for r in records if r.get("type") == "train"]
    return train[skip:] if len(train) > skip else train[-1:]


def recipe_without_budget(recipe: Path, path: Path) -> Path:
    """`recipe` written to `path` without its time budget and the budget's choice of network
    (smaller_models, min_budget_epochs): the same network and schedule at a fixed length."""
    import yaml

    settings = yaml.safe_load(Path(recipe).read_text())
    for key in ("time_budget", "smaller_models", "min_budget_epochs"):
        settings.pop(key, None)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(settings))
    return Path(path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# -- memory ---------------------------------------------------------------------------------------
def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


class PeakRSS:
    """Samples this process's resident memory every few milliseconds while active."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak, self.start = interval, 0.0, 0.0
        self._stop = threading.Event()

    def __enter__(self):
        self.start = self.peak = rss_mb()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb())


# -- data -----------------------------------------------------------------------------------------
def check_cifar(data_dir: str) -> Path:
    path = Path(data_dir)
    if not (path / "train.parquet").is_file():
        sys.exit(f"no CIFAR-10 parquet at {path}; pass --data-dir (see ../shared/data/cifar10)")
    return path


def cifar_in_memory(data_dir: str, max_train: Optional[int] = None,
                    max_eval: Optional[int] = None):
    """CIFAR-10 decoded once into uint8 tensors, through accel_train's own loader."""
    from accel_train.config import TrainConfig
    from accel_train.data.sources import load_data
    return load_data(TrainConfig(data_dir=str(check_cifar(data_dir)), max_train_samples=max_train,
                                 max_eval_samples=max_eval, in_memory="always"))


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def timed_both(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for one call.  CPU time does not advance while
    the process waits for a core, so with one thread it is nearly immune to other processes."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu
