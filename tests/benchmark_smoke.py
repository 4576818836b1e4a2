"""The benchmark scripts' smoke runs, shared by tests/test_benchmarks.py (the CPU scripts) and
tests/test_benchmarks_gpu.py (the GPU scripts, whose code also runs on a CPU): each script runs
as `python benchmarks/bench_NAME.py --quick ...` in its smallest form (a tiny model, a few steps,
only the arms that start distinct programs) and writes its table.  Two files, not one: the
test files run in parallel, each whole on one worker, and all the smoke runs in one file made
it the suite's longest by far.

Nothing here checks a speed or a ratio: those belong in benchmarks/BENCHMARKS.md, measured when
the machine is quiet, never in a timed test.  This only keeps the scripts runnable as the code
changes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from conftest import REPO, cpu_flags_say_native_bf16, run
from conftest import test_env as child_env  # not test_*: pytest would collect it

SCRIPTS = REPO / "benchmarks"
TINY = ["--quick", "--model", "test_resnet"]
TIMEOUT = 900  # seconds a script may take on a busy 2-core machine (most take well under 60)

# Each script's smallest --quick form (a tiny model, a few steps, only the arms that start
# distinct programs).
CASES = {
    "overhead": [*TINY, "--steps", "2", "--rounds", "1", "--memory-steps", "1", "--batch-size",
                 "16", "--memory-arms", "accel_train"],
    # no loader workers and no trainer runs here: the other cases start those programs
    "data": [*TINY, "--decode-images", "64", "--pipeline-images", "256", "--batches", "2",
             "--model-steps", "1", "--workers", "0", "--skip", "trainer", "--erase-batch", "32"],
    "scaling": [*TINY, "--pairs-only", "--steps", "4", "--log-every", "2", "--max-train", "512"],
    "seed": [*TINY, "--arms", "dataparallel", "accel1", "--images", "128", "--epochs", "1",
             "--workers", "0"],
    "comm": ["--quick", "--worlds", "2", "--max-bytes", "65536", "--min-seconds", "0.01",
             "--model", "test_resnet", "--heartbeat-batch", "8"],
    "checkpoint": ["--quick", "--models", "test_resnet", "--repeats", "1", "--step-repeats", "1"],
    # the seed loop is smoke-tested by "seed" (the same anchor script)
    "accuracy": [*TINY, "--recipes", "defaults", "--budget", "3", "--pilot-steps", "1", "--no-seed",
                 "--eval-samples", "64", "--seed-model", "test_resnet", "--workers", "0",
                 "--max-train", "512", "--recipe-file", "recipes/cifar10-cpu-10min.yaml",
                 "--recipe-file-extra", "--max-steps 2 --batch-size 16"],
    "threads": [*TINY, "--steps", "1", "--conditions", "quiet"],
    # the product's own division of the cores (the every-core arm is the same program with
    # OMP_NUM_THREADS set, which tests/test_manual_flags.py runs)
    "manual_ranks": [*TINY, "--steps", "4", "--log-every", "2", "--arms", "divided"],
    "host_memory": ["--quick", "--max-train", "256", "--batch-size", "32"],
    # one loaded arm and its quiet reference: a budget run and a --max-steps run
    "budget": ["--quick", "--budget", "4", "--hog-seconds", "1", "--arms", "load first",
               "--extra=--model test_resnet --batch-size 16 --max-eval-samples 64 "
               "--num-workers 0"],
    # (the first-step arms start the same training command as every other smoke here)
    "index": ["--quick", "--sizes", "300", "--no-first-step"],
    "streaming": [*TINY, "--rss-batches", "4", "--steps", "4", "--skip", "first"],
    "precision": ["--quick", "--models", "test_resnet", "--batch", "8", "--rounds", "1",
                  "--matmul-size", "256"],
    # the trainer in process with timers around its parts; a tiny matmul for the peak
    "efficiency": ["--quick", "--model", "test_resnet", "--batch-size", "16", "--matmul-size",
                   "256"],
    # both ways of starting workers, one round, a loader of two batches
    "worker_start": ["--quick", "--images", "128", "--rounds", "1"],
    # both precisions in one process, as the GPU run does (each arm a new Accelerator)
    "gpu": ["--quick", "--allow-cpu", "--model", "test_resnet", "--sizes", "32", "--precisions",
            "bf16", "fp16", "--batch", "8", "--steps", "1", "--rounds", "1"],
    # the recipe's settings on the embedded data with a small network; SIGTERM + resume
    "gpu_cifar": ["--quick", "--allow-cpu", "--no-compile"],
    # both arms (DataLoader, batches drawn on the device) on the embedded data, with erasing
    "device_resident": ["--quick", "--allow-cpu", "--model", "cifar_convnet_s", "--batch-size",
                        "16", "--steps", "2", "--warmup", "1", "--reprob", "0", "0.25"],
    # the trainer's loop on the embedded data, 10 steps watched after 3
    "step_syncs": ["--quick", "--allow-cpu"],
    # JPEGs at ImageNet sizes it makes itself (make_imagenet_like.py): 2 classes of 16
    "jpeg_input": ["--quick", "--classes", "2", "--per-class", "16", "--rounds", "1"],
    # 32 photos it makes at 800x600, stored at 256
    "max_side": ["--quick", "--camera-size", "800", "600", "--max-side", "256", "--rounds", "1"],
    # the JPEG folder it makes (6 images a class), each arm 2 epochs of 2 steps at 96 px
    "gpu_jpeg": ["--quick", "--allow-cpu", "--model", "test_resnet", "--size", "96", "--images",
                 "60", "--batch", "16", "--epochs", "2", "--profile-steps", "1"],
    # the anchor's network and cifar_airbench one step each, then each trainer row 3 steps
    "anchor_step": ["--quick", "--train-images", "128", "--batch-size", "16"],
    # both rows (the GPU row's code on the CPU): each anchor 2 epochs of 2 steps, each CLI run
    # a few steps, the CPU row's in two processes (the GPU row's is one), its anchor run again;
    # both arms at seed 1
    "anchor_side_by_side": ["--quick", "--allow-cpu", "--cpu-row", "--train-images", "64",
                            "--test-images", "64", "--batch-size", "32", "--cli-processes", "2",
                            "--anchor-again", "--anchor-memory", "kept", "--seed", "1",
                            "--cli-epochs", "1", "2"],
    # both kinds of batch, a few crops, two rounds
    "crop_resize": ["--quick"],
    # one tiny network in both precisions (a CPU's fp16 is fp32: the arms' code, no figures)
    "fp16_networks": ["--quick", "--allow-cpu", "--models", "test_resnet", "--image-size", "32"],
    # 12 held-out photos it makes, 2 epochs a run at 64 px: a first and a later evaluation
    "held_out": ["--quick", "--val-per-class", "3", "--size", "64", "--batch", "8"],
}
# The scripts that make their own data instead of reading CIFAR-10
OWN_DATA = {"jpeg_input", "gpu_jpeg", "crop_resize", "max_side", "held_out"}
# The scripts that take no --tmp (they write nothing large)
NO_TMP = {"comm", "gpu", "threads", "manual_ranks", "precision", "worker_start", "gpu_cifar",
          "device_resident", "jpeg_input", "gpu_jpeg", "fp16_networks", "crop_resize",
          "max_side", "held_out"}
# The scripts that keep their runs' logs for the reader (in a temporary folder of the system's
# unless given --work): here, in the test's own folder
KEEP_WORK = {"gpu_cifar"}
# benchmarks/anchors/airbench_cpu.py on generated data in the CIFAR-10 layout: 2 steps an epoch
# for 4 epochs (the averaging syncs at steps 5 and the last, 8), one JSON line with the three
# levels.  Batch
# 128 instead of airbench's 1024: the same code path at an eighth of the arithmetic.
ANCHOR_ARGS = ["--epochs", "4", "--test-images", "64", "--batch-size", "128"]


def both_arms_and_a_ratio(data: dict) -> None:
    """bench_anchor_side_by_side.py: each row's table holds the anchor and the CLI, and the
    CLI's ratio to the anchor (the GPU row's: "not reached" where the CLI missed A)."""
    assert len(data["tables"]) == 2, [t["title"] for t in data["tables"]]
    for table in data["tables"]:
        anchor, cli = table["rows"][:2]  # (the CPU table's third row: below)
        ratio = next(i for i, h in enumerate(table["headers"])
                     if h.startswith("ratio CLI / anchor"))
        assert anchor[0].startswith("airbench94") and cli[0].startswith("accel_train CLI"), table
        assert anchor[ratio] == "1 (the anchor)", table
        assert cli[ratio] == "not reached" or float(cli[ratio].replace(",", "")) > 0, table
    gpu_table, cpu_table = data["tables"]
    # the GPU row's schedules (--cli-epochs 1 2): the second runs only where the first missed A
    gpu_runs = data["gpu"]["cli_epochs"]
    assert gpu_runs in ([1], [1, 2]), gpu_runs
    assert len(gpu_table["rows"]) == 1 + len(gpu_runs) and len(cpu_table["rows"]) == 3, cpu_table
    for epochs, row in zip(gpu_runs, gpu_table["rows"][1:]):
        assert f"--epochs {epochs} --warmup-fraction 0.23:" in row[0], row
    reached_a = [row[-2] != "not reached" for row in gpu_table["rows"][1:]]
    assert reached_a[:-1] == [False] * (len(gpu_runs) - 1), gpu_table
    assert reached_a[-1] == (data["gpu"]["first_at_target"] is not None), gpu_table
    assert reached_a[-1] or gpu_runs == [1, 2], gpu_table
    # each command's ending: its process's exit, then the end of its output (later only where
    # a process it started held the output; the notes name such processes)
    for row in ("gpu", "cpu"):
        for arm in ("anchor", "cli"):
            ending = data[row][arm]["exit"]
            assert 0 < ending["exited_s"] <= ending["closed_s"], (row, arm, ending)
            assert bool(ending["holders"]) == (ending["closed_s"] - ending["exited_s"] > 1), ending
        said = f"the CLI {data[row]['cli']['exit']['exited_s']:.1f}"
        assert any("to its process's exit: the anchor " in note and said in note
                   for note in data["tables"][row == "cpu"]["notes"]), row
    # the CPU row's anchor again after the CLI (--anchor-again): the same deterministic run,
    # its timed s read against the first's
    again = cpu_table["rows"][2]
    # (--anchor-memory kept: both anchor runs say so)
    assert cpu_table["rows"][0][0] == "airbench94, anchors/airbench_cpu.py, its freed host " \
        "memory kept", cpu_table
    assert again[0] == "airbench94, again, anchors/airbench_cpu.py, its freed host memory kept", \
        again
    assert again[5] == "(A)", again   # the same top-1: the anchor is deterministic
    assert float(again[-1].split()[0]) > 0 and again[-1].endswith("of T (the machine's pace)"), \
        again
    assert any("the anchor run again after the CLI took" in note
               for note in cpu_table["notes"]), cpu_table
    # --seed 1 reached both arms: the anchor's command line, the seed the CLI's run recorded
    for row in ("gpu", "cpu"):
        command = data[row]["anchor"]["command"]
        assert command[command.index("--seed") + 1] == "1", command
        assert data[row]["cli"]["seed"] == 1, data[row]["cli"]
    for table in data["tables"]:
        assert "seeds: the anchor's 1, the CLI's 1 (A is the anchor's top-1 at its seed; one " \
            "pair is one draw of each)" in table["notes"], table


# What a script's tables must hold beyond the common checks
def each_arm_as_it_says(data: dict) -> None:
    """bench_host_memory.py: the CLI's own summary says that one arm kept its freed memory
    and that the other left glibc's settings as its environment set them."""
    from accel_train.train.host_memory import KEPT
    said = [row[1] for row in data["tables"][0]["rows"]]
    assert said == [KEPT, "as the environment sets it (GLIBC_TUNABLES)"], said


def every_step_watched(data: dict) -> None:
    """bench_step_syncs.py: the callback saw each of the steps it was to watch (a CPU's
    events are always reached: no step ahead) and no sync was flagged (a CPU flags none)."""
    assert data["result"]["watched"] == 10, data["result"]
    assert data["result"]["host_ahead"] == 0 and data["result"]["syncs_flagged"] == 0, data
    assert data["result"]["sync_calls"] == {}, data  # the profiled steps ran, CUDA's calls none


def the_anchors_precision(data: dict) -> None:
    """bench_anchor_step.py: both arms in the anchor's precision, bf16 only where the CPU has
    it natively (/proc/cpuinfo's flags: torch's own check is what the script asks)."""
    expected = "bf16 autocast" if cpu_flags_say_native_bf16() else "fp32"
    notes = data["tables"][0]["notes"]
    assert notes[0].startswith(f"precision: {expected} (--precision auto;"), notes


def every_arm_trained(data: dict) -> None:
    """bench_fp16_networks.py: each arm exited 0 with a finite first and last loss (a CPU's
    fp16 runs fp32)."""
    assert [(r["precision"], r["exit"]) for r in data["result"]] == [("fp16", 0), ("bf16", 0)]
    assert all(r["first_loss"] != "NaN" and r["last_loss"] != "NaN" for r in data["result"])


def the_always_arm_profiled(data: dict) -> None:
    """bench_gpu_jpeg.py --profile-steps 1: the always arm's step profiled (a CPU runs no
    kernels: none to read); the training thread ran the step's operators and not the JPEG
    decoder, which runs on the decoding thread (data/decode_ahead.py); the held arm's photos
    held, and what decoding them at the start took."""
    profile = data["result"]["always"]["profile"]
    assert profile[0].startswith("profiled 1 steps:") and "no kernels" in profile[0], profile
    # (the convolutions by whichever kernel this CPU's torch runs: aten::mkldnn_convolution,
    # or aten::_slow_conv2d_forward where oneDNN does not take the layout)
    assert "conv" in profile[2] and "decode_jpeg" not in profile[2], profile
    assert "profile" not in data["result"]["never"], data["result"]["never"]
    # the arm with --host-decode-share: the workers decode 40% of each batch
    assert "40% of each batch's by the loader workers" in \
        data["result"]["always:0.4"]["decoding"], data["result"]["always:0.4"]
    # the decoding arms decode every epoch; the held arm decoded the photos once
    assert data["result"]["never"]["decoding"].startswith("by the loader workers"), \
        data["result"]["never"]
    assert data["result"]["held"]["decoding"].startswith(
        "drawn on the device, the training photos decoded once and held there"), \
        data["result"]["held"]
    assert re.search(r"; held in \d+\.\d s$", data["result"]["held"]["decoding"]), \
        data["result"]["held"]
    assert data["result"]["held"]["img_per_s"] > 0


def both_folders_at_their_sizes(data: dict) -> None:
    """bench_max_side.py: the photos as made (800x600) and as stored (256x192), both timed."""
    (table,) = data["tables"]
    taken, stored = table["rows"]
    assert taken[0].startswith("as taken (800x600") and stored[0].startswith("stored (256x192"), \
        table
    assert float(taken[1]) > 0 and float(stored[1].replace(",", "")) > 0, table


def both_ways_of_evaluating(data: dict) -> None:
    """bench_held_out.py: each arm ran a first and a later evaluation, each timed."""
    (table,) = data["tables"]
    never, kept = table["rows"]
    assert never[0].startswith("from the loader") and kept[0].startswith("kept after"), table
    assert all(len(run) == 2 and min(run) > 0 for runs in data["eval_times"].values()
               for run in runs), data["eval_times"]


TABLE_CHECKS = {"max_side": both_folders_at_their_sizes, "held_out": both_ways_of_evaluating,
                "anchor_side_by_side": both_arms_and_a_ratio, "host_memory": each_arm_as_it_says,
                "step_syncs": every_step_watched, "anchor_step": the_anchors_precision,
                "fp16_networks": every_arm_trained, "gpu_jpeg": the_always_arm_profiled}


def env() -> dict:
    return child_env(PYTHONWARNINGS="ignore::DeprecationWarning")


def ran(cmd: list[str], name: str) -> str:
    """`cmd`'s output, once it has exited 0."""
    result = run(cmd, env=env(), timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{output[-6000:]}"
    return result.stdout



# The scripts written for a GPU (tests/test_benchmarks_gpu.py runs them with --allow-cpu)
GPU_SCRIPTS = {"gpu", "gpu_cifar", "device_resident", "gpu_jpeg", "anchor_side_by_side",
               "step_syncs", "fp16_networks"}


def run_script(name: str, cifar10_like: Path, tmp_path: Path) -> None:
    """bench_NAME.py's smoke run: it exits 0 and writes its tables (markdown and JSON)."""
    out = tmp_path / name
    out.mkdir()
    extra = [] if name in NO_TMP else ["--tmp", str(out)]
    if name in KEEP_WORK:
        extra = ["--work", str(out / "work")]
    data = [] if name in OWN_DATA else ["--data-dir", str(cifar10_like)]
    ran([sys.executable, str(SCRIPTS / f"bench_{name}.py"), *CASES[name], "--out", str(out),
         *extra, *data], name)
    markdown = (out / f"{name}.md").read_text()
    assert "| " in markdown and "load average" in markdown, markdown[-2000:]
    tables = json.loads((out / f"{name}.json").read_text())
    assert tables["tables"] and tables["machine"]["cores"] >= 1
    TABLE_CHECKS.get(name, lambda _: None)(tables)
