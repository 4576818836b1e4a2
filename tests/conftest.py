"""Shared helpers for the test suite.

Everything runs on CPU.  Multi-process tests use the real launchers (`accelerate launch`,
`torchrun`, `python -m torch.distributed.launch`) over gloo on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import random
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_CIFAR10 = REPO.parent / "shared" / "data" / "cifar10"
# Where the real CIFAR-10 is looked for (ACCEL_TRAIN_CIFAR10 overrides), and the switch that
# turns its absence from a skip into a failure (.ci/run sets it: CI must not pass without it).
CIFAR10_ENV, REQUIRE_CIFAR10_ENV = "ACCEL_TRAIN_CIFAR10", "ACCEL_TRAIN_REQUIRE_CIFAR10"
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck"]
CONFIGS = REPO / "accelerate_configs"

# Small enough that a 2-process run finishes in well under a minute on 2 cores.
# fp32 and NCHW fixed (PINNED): the tests compare with plain-torch oracles and across process
# counts, which a machine-dependent choice would move; tests/test_autotune.py tests "auto".
PINNED = ["--mixed-precision", "no", "--no-channels-last"]
TINY_TRAIN = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--max-eval-samples",
              "64", "--model", "test_resnet", "--batch-size", "16", "--epochs", "1",
              "--progress", "log", "--no-plots", *PINNED]


def pytest_configure(config):
    """One torch thread in each pytest process, as in every process a test starts (`test_env`):
    the pytest workers share the cores with each other and with the runs they start, and a
    second OpenMP thread then mostly spins, waiting for a core.

    The console scripts installed beside the interpreter running the tests (accelerate,
    torchrun, accel-train, ruff, lint-imports) come first on PATH, for the tests and every
    process they start, as in an activated environment: the suite run as `ENV/bin/python -m
    pytest` must not fail to find `accelerate`, skip the lint, or start another install's."""
    import torch

    torch.set_num_threads(1)
    scripts = os.path.dirname(sys.executable)
    os.environ["PATH"] = os.pathsep.join([scripts, os.environ.get("PATH", "")])


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """How many pytest-xdist workers `-n logical` (setup.cfg) starts: one more than the cores
    for the full suite, one per core for the quick tier (`-m "not slow"`).  With one worker per
    core the full suite kept the cores only 84% busy (/proc/stat over a whole run on 2 cores):
    its multi-process tests wait on launchers' rendezvous and restarts, stall timeouts and
    processes winding down, and a third worker fills those waits (99.5% busy, 20:40 against
    22:35 in the same hour).  The quick tier runs in process and never waits: there a third
    worker only adds its start-up and contention (3:20 against 2:59).
    PYTEST_XDIST_AUTO_NUM_WORKERS still overrides, as in pytest-xdist itself."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own hook reads it
    cores = len(os.sched_getaffinity(0))
    quick_tier = "not slow" in (config.option.markexpr or "")
    return cores if quick_tier else cores + 1


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collection caches what it compiles, as a default Python does, where the environment
    turned that off (PYTHONDONTWRITEBYTECODE, set in some containers; sys.dont_write_bytecode is
    Python's documented switch): pytest rewrites the asserts of every test module in every
    pytest process (each xdist worker, the suites tests start) and caches the result beside
    the module as bytecode, and without the cache each process rewrote all 120-odd of them
    again (about 10 of the 17 s one process took to collect the quick tier on a 2-core AMD EPYC
    without AVX512); the processes tests start then read accel_train's modules from the same
    cache.  Only during collection: a module a test writes and rewrites, within a second at
    the same size, must not be read back from a stale cache."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = before


def pytest_collection_modifyitems(config, items):
    """Test files likely to take longest first: the most tests marked slow (each starts
    processes of its own, tens of seconds apiece: the benchmark scripts' smoke runs, split in
    two files, are the longest), then the most tests.  A long file started last would leave one
    worker running it alone while the others idle; the short files fill the workers' last
    minutes instead.  pytest-xdist's own reordering is off in setup.cfg (it would undo this);
    each file stays whole and in its own order (`--dist loadfile`)."""
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)

    def longest_first(name: str) -> tuple[int, int]:
        tests = by_file[name]
        return (-sum(test.get_closest_marker("slow") is not None for test in tests), -len(tests))

    items[:] = [item for name in sorted(by_file, key=longest_first) for item in by_file[name]]


def test_env(**extra: str) -> dict:
    """Environment for child processes: offline, quiet, one thread each (2 cores, 2 ranks)."""
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    if "PYTHONPATH" in extra:  # before, not instead of, the clone scripts/with_env put first
        extra["PYTHONPATH"] = os.pathsep.join(filter(None, [extra["PYTHONPATH"],
                                                            env.get("PYTHONPATH")]))
    env.update(extra)
    return env


test_env.__test__ = False  # a helper the test files import, not a test pytest should collect


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test leaves os.environ as it found it: in-process runs go through code that sets
    variables for the whole process (CUDA_VISIBLE_DEVICES from --gpu_ids, a manual start's
    RANK/WORLD_SIZE), which must not reach the next test on the same worker."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def runs():
    """The processes a test starts (faults.Run objects): each is killed with its children when
    the test ends, however it ends."""
    started: list = []
    yield started
    for run in started:
        run.close()


@pytest.fixture
def rng(request) -> random.Random:
    """A seeded RNG per test for its random choices (which step to kill at, ...); the seed is
    printed (shown with -s, and on failure), and ACCEL_TRAIN_TEST_SEED replays or varies it."""
    seed = int(os.environ.get("ACCEL_TRAIN_TEST_SEED", zlib.crc32(request.node.name.encode())))
    print(f"random choices of {request.node.name}: seed {seed} (ACCEL_TRAIN_TEST_SEED)")
    return random.Random(seed)


# Below Linux's ephemeral range (32768-60999): a port the kernel hands out to any outgoing
# connection (gloo's, a store client's) between our pick and the launcher's bind is one that
# launcher then finds in use (seen in a suite run).  Drawn from the OS's entropy: a test that
# seeds `random` must not make every pytest worker draw the same ports.
PORT_RANGE = (20000, 32768)
_PORTS = random.SystemRandom()


def free_port() -> int:
    """A port nobody listens on now, at random below the ephemeral range."""
    while True:
        port = _PORTS.randrange(*PORT_RANGE)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


# Two CPU processes on 127.0.0.1 through each real launcher, up to the option its port follows.
TWO_PROCESS_LAUNCHERS = {
    "torchrun": ["torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port"],
    "accelerate launch": ["accelerate.commands.launch", "--config_file",
                          str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port"],
}


def launched_program(launcher: str, module: str, *args: str) -> list[str]:
    """The command running `python -m module args` in two processes under `launcher` (a key
    of TWO_PROCESS_LAUNCHERS) on a free port."""
    return [sys.executable, "-m", *TWO_PROCESS_LAUNCHERS[launcher], str(free_port()),
            "-m", module, *args]


def run(cmd: list[str], cwd: Path | None = None, timeout: float = 300, env: dict | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """Run a command, capturing text output; on failure with check=True, show its output."""
    result = subprocess.run(cmd, cwd=cwd or REPO, env=env or test_env(),
                            stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n--- stdout\n"
                             f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def accel_train(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """`python -m accel_train ARGS` in a subprocess (a fresh process, as a user would run it)."""
    return run([sys.executable, "-m", "accel_train", *args], **kwargs)


@contextlib.contextmanager
def training_callbacks(callbacks):
    """Training started by cli.main runs with `callbacks` (accel_train.callbacks.Callback, what
    a program hands trainer.run_training; the command line has none): run_training, which
    cli.main looks up as it trains, is wrapped meanwhile."""
    from accel_train import trainer

    run_training = trainer.run_training
    trainer.run_training = functools.partial(run_training, callbacks=callbacks)
    try:
        yield
    finally:
        trainer.run_training = run_training


def drawn_subset(length: int, limit: int) -> np.ndarray:
    """The positions --sample-subset random keeps of a split of `length` images, from numpy
    alone: Hugging Face datasets' shuffle(seed=0) is default_rng(0).permutation; the first
    `limit` of it, in the split's order."""
    return np.sort(np.random.default_rng(0).permutation(length)[:limit])


def accel_train_here(*args: str, check: bool = False,
                     callbacks=()) -> subprocess.CompletedProcess:
    """`accel_train ARGS` called in this process (cli.main, what `python -m accel_train` runs),
    without the seconds of imports a new process pays: for commands that end at bad input and
    for tiny one-process runs (`callbacks`: its training's, `training_callbacks`).  Returns what
    `accel_train()` returns."""
    from accel_train.cli import main

    out, err = io.StringIO(), io.StringIO()
    with clean_accelerate_state(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err), training_callbacks(callbacks):
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's own errors
            code = exit.code
    result = subprocess.CompletedProcess(["accel_train (in process)", *args], code,
                                         out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"accel_train {' '.join(args)} exited {code}\n--- stdout\n"
                             f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def age_folders(root: Path, seconds: float = 3600, then: float | None = None) -> None:
    """Every folder under `root` (itself included) given an mtime `seconds` back, or `then`: an
    image folder changed in the last seconds may change again within its mtime's tick, and its
    index is not cached (imagefolder.RACY_SECONDS)."""
    then = time.time() - seconds if then is None else then
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        os.utime(folder, (then, then))


def model_spec_of(folder: Path) -> dict:
    """The model a run's final model or an export holds, read from timm's config.json as timm's
    saver lays it out (architecture, label_names, pretrained_cfg; accel_train's own section),
    in the keys of the model_config.json it replaced: what the tests check of a run's model."""
    config = json.loads((Path(folder) / "config.json").read_text())
    cfg, ours = config["pretrained_cfg"], config.get("accel_train", {})
    return {"model_name": config["architecture"], "num_classes": config["num_classes"],
            "class_names": config["label_names"], "image_size": cfg["input_size"][-1],
            "mean": cfg["mean"], "std": cfg["std"], "drop_rate": ours.get("drop_rate"),
            "weights": ours.get("weights"), "tta": ours.get("tta")}


# The CPU features that make bf16 native (faster than fp32), as the kernel lists them: the
# oracle for every check of a precision chosen by the CPU (torch's own checks are the product's).
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_tile"}


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it has none: not x86 Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_flags_say_native_bf16() -> bool:
    return bool(NATIVE_BF16_FLAGS & cpu_flags())


def write_cifar10_layout(folder: Path, train_rows: int = 640, test_rows: int = 160) -> Path:
    """A small stand-in for ../shared/data/cifar10 in the same layout and schema: train.parquet
    and test.parquet, columns `img` (datasets.Image: struct of JPEG `bytes` and `path`) and
    `label` (datasets.ClassLabel with the ten CIFAR-10 names), 32x32 RGB.  The pixels are the
    embedded synthetic shapes (learnable, deterministic); the class names are CIFAR-10's."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from accel_train.data import synthetic

    features = {"img": {"_type": "Image"},
                "label": {"names": CIFAR10_CLASSES, "_type": "ClassLabel"}}
    schema = pa.schema([("img", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                        ("label", pa.int64())],
                       metadata={"huggingface": json.dumps({"info": {"features": features}})})
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows, seed in (("train", train_rows, 11), ("test", test_rows, 12)):
        images, labels = synthetic.generate(rows, seed)
        blobs = []
        for pixels in images:
            buffer = io.BytesIO()
            Image.fromarray(pixels, "RGB").save(buffer, format="JPEG", quality=90)
            blobs.append({"bytes": buffer.getvalue(), "path": None})
        table = pa.table({"img": blobs, "label": labels.tolist()}, schema=schema)
        pq.write_table(table, folder / f"{split}.parquet")
    return folder


@pytest.fixture(scope="session")
def cifar10_layout(tmp_path_factory) -> Path:
    """Some data in the shared CIFAR-10 copy's layout, generated: for tests that need parquet
    data shaped like CIFAR-10 but not CIFAR-10 itself (they run in any clone)."""
    return write_cifar10_layout(tmp_path_factory.mktemp("cifar10_layout"))


BIG_CLASSES, BIG_SIZE = ["circle", "square", "stripes", "noise"], 80


def write_big_image_folder(root: Path, train_per_class: int = 32,
                           test_per_class: int = 4, suffix: str = ".png") -> Path:
    """PNG (or, with suffix ".jpg", JPEG) files of 80x80 px (above the 64 px the synthetic set
    never exceeds: the random resized crop path), in class folders under train/ and test/."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    grid = np.mgrid[0:BIG_SIZE, 0:BIG_SIZE].astype(np.float32)
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for label, name in enumerate(BIG_CLASSES):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                cy, cx = rng.uniform(20, 60, 2)
                pattern = [np.hypot(grid[0] - cy, grid[1] - cx) < 15,
                           np.maximum(abs(grid[0] - cy), abs(grid[1] - cx)) < 13,
                           (grid[1] // 6) % 2 == 0,
                           rng.uniform(size=(BIG_SIZE, BIG_SIZE)) < 0.5][label]
                pixels = rng.uniform(0, 80, (BIG_SIZE, BIG_SIZE, 3))
                pixels[pattern] += rng.uniform(80, 175, 3)
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB").save(
                    root / split / name / f"{i}{suffix}")
    return root


@pytest.fixture(scope="session")
def big_image_folder(tmp_path_factory) -> Path:
    """128 training images of 80 px in 4 class folders (and 16 held out), as PNG files."""
    return write_big_image_folder(tmp_path_factory.mktemp("big_images") / "images")


@pytest.fixture(scope="session")
def big_jpeg_folder(tmp_path_factory) -> Path:
    """big_image_folder's images as JPEG files (PIL's quality 75)."""
    return write_big_image_folder(tmp_path_factory.mktemp("big_jpegs") / "images",
                                  suffix=".jpg")


@pytest.fixture(scope="session")
def synthetic_shards(tmp_path_factory) -> Path:
    """`accel-train shard` of 200 synthetic images, 24 per shard (9 training shards)."""
    out = tmp_path_factory.mktemp("shards") / "synthetic"
    accel_train_here("shard", "--no-progress", "--dataset", "synthetic",
                     "--synthetic-train-size", "200", "--samples-per-shard", "24",
                     "--output", str(out), check=True)  # (setting up: in process)
    return out


@contextlib.contextmanager
def clean_accelerate_state():
    """Accelerate keeps process-wide singletons: an in-process run starts and leaves them clean
    (tests that build Accelerators in the test process itself must not see each other's)."""
    reset_accelerate()
    try:
        yield
    finally:
        reset_accelerate()


def reset_accelerate() -> None:
    """Accelerate's own way for tests to forget its process-wide state (the accelerator and
    gradient singletons): the tearDown of the test case its documentation asks such tests to
    inherit from."""
    from accelerate.test_utils.testing import AccelerateTestCase
    AccelerateTestCase().tearDown()


@pytest.fixture
def fresh_accelerate(monkeypatch):
    """An in-process run outside any launcher, offline, with Accelerate's state clean."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with clean_accelerate_state():
        yield


@pytest.fixture(scope="session")
def real_cifar10() -> Path:
    """The real CIFAR-10 parquet copy, for the tests that need the real images: at
    $ACCEL_TRAIN_CIFAR10 if set, else ../shared/data/cifar10.  Without it these tests skip
    (saying where to put it), or fail when ACCEL_TRAIN_REQUIRE_CIFAR10=1 (CI sets it)."""
    path = Path(os.environ.get(CIFAR10_ENV) or SHARED_CIFAR10)
    if (path / "train.parquet").is_file() and (path / "test.parquet").is_file():
        return path
    reason = (f"the real CIFAR-10 (train.parquet and test.parquet, Hugging Face parquet layout) "
              f"is not at {path}; put it at {SHARED_CIFAR10} or point {CIFAR10_ENV} at it")
    if os.environ.get(REQUIRE_CIFAR10_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_CIFAR10_ENV}=1 requires it)", pytrace=False)
    pytest.skip(reason)
