"""A read that never returns (a network mount that went away) stops each command that reads
images in one line naming the file, exit 75, instead of hanging silently.

The stuck file is real, not a patched function: a named pipe (FIFO) under an image's name.
Opening it for reading blocks in the kernel until a writer comes, and none does, as a read
from a dead mount blocks.  Each command runs in a process of its own: it is that process that
has to end.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from PIL import Image

import imagekinds as kinds
from conftest import accel_train, accel_train_here

STOP = ("the file system does not answer (a network mount that went away?); exit 75, for "
        "another try once the data can be read")


def _image_folder(root: Path) -> Path:
    """train/ and val/ with two classes of 8 small PNGs each."""
    for split, count in (("train", 8), ("val", 4)):
        for label, name in enumerate(("ant", "bee")):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                Image.fromarray(kinds.pixels(100 * label + i, 16, 16)).save(
                    root / split / name / f"{i}.png")
    return root


def _stuck_file(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _no_process_mentions(text: str) -> list[str]:
    """Processes still running whose command line holds `text` (a command's forked workers
    carry its command line): none may outlive the command."""
    left = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and \
                    any(text in part for part in process.info["cmdline"] or []):
                left.append(f"{process.pid}: {' '.join(process.info['cmdline'])}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


def _stopped(result: subprocess.CompletedProcess) -> str:
    """The command's last line, once it has exited 75 without a traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 75, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_a_note_names_the_innermost_read_and_the_outer_one_again_after_it(tmp_path):
    """loader_watch's stop, in a process of its own (it ends that process): a read noted inside
    another and finished leaves the outer read watched again, from when the outer one began;
    its line comes after the timeout, with exit 75.  Outside the `with`, nothing is watched."""
    script = textwrap.dedent("""
        import sys, time
        from accel_train.data.loader_watch import reading, stop_when_a_read_sticks
        line = lambda what, seconds: f"stuck: {what} after {seconds:.1f} s"
        with stop_when_a_read_sticks(1.0, line):
            pass
        with reading(lambda: "unwatched"):
            time.sleep(1.5)  # no watch now: nothing happens
        print("went on", flush=True)
        with stop_when_a_read_sticks(1.0, line):
            with reading(lambda: "outer"):
                with reading(lambda: "inner"):
                    pass
                time.sleep(30)
        print("never")
    """)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    took = time.monotonic() - started
    assert result.returncode == 75, result
    assert result.stdout == "went on\n", result
    stuck = result.stderr.strip()
    assert stuck.startswith("stuck: outer after "), stuck
    assert 1.0 <= float(stuck.split()[-2]) < 3.0, stuck
    assert took < 20, took


@pytest.mark.slow
def test_a_shard_that_stops_mid_way_is_named_with_the_sample_after_which_it_stopped(tmp_path):
    """A streamed shard whose file answers for its first two tar records (the first sample
    whole) and then never again, read by iter_shard as a streaming run and check-data read
    shards, under the command line's watch: the first sample comes, then the line names the
    shard and the sample after which it stopped.  The shard is a FIFO fed by a thread of the
    reading process: the first block for the look that tells a tar from a parquet file, then,
    once the look has it, 2 x 10,240 bytes for the stream, and nothing more."""
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as archive:
        for key in range(3):  # 15,000 bytes of image and a label: 16,896 bytes a sample
            for ext, data in (("jpg", os.urandom(15000)), ("cls", b"1")):
                member = tarfile.TarInfo(f"{key:06d}.{ext}")
                member.size = len(data)
                archive.addfile(member, io.BytesIO(data))
    (tmp_path / "shard.bytes").write_bytes(tar.getvalue())
    fifo = _stuck_file(tmp_path / "000000.tar")
    script = textwrap.dedent("""
        import fcntl, os, struct, sys, termios, threading, time
        from pathlib import Path
        fifo, data = Path(sys.argv[1]), Path(sys.argv[2]).read_bytes()
        def unread(out):
            return struct.unpack("i", fcntl.ioctl(out, termios.FIONREAD, b"0000"))[0]
        def answer_then_stall():
            out = os.open(fifo, os.O_WRONLY)  # (until the look at the first block opens it)
            os.write(out, data[:512])
            while unread(out):  # the look has its block: what comes next is the stream's
                time.sleep(0.01)
            try:  # kept in the pipe if the look's end is still open, for the stream's reader
                os.write(out, data[:2 * 10240])
            except BrokenPipeError:  # the look closed its end: wait for the stream's
                os.close(out)
                out = os.open(fifo, os.O_WRONLY)
                os.write(out, data[:2 * 10240])
            time.sleep(3600)
        threading.Thread(target=answer_then_stall, daemon=True).start()
        from accel_train.data.loader_watch import stop_when_a_read_sticks
        from accel_train.data.streaming.shards import iter_shard
        with stop_when_a_read_sticks(6.0, lambda what, seconds: f"stuck: {what}"):
            for image, label, name in iter_shard(fifo):
                print("read", name, len(image), label, flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script, str(fifo),
                             str(tmp_path / "shard.bytes")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 75, result
    assert result.stdout == "read 000000 15000 1\n", result
    assert result.stderr.strip() == f"stuck: {fifo} after sample 000000", result


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_check_data_stops_in_one_line_at_a_read_that_never_returns(tmp_path, workers):
    """With one worker the read is the command's own and its line names the file; with two,
    the stuck worker names the file (with its stack) and check-data stops once no image has
    been read for --read-timeout, its workers killed."""
    data = _image_folder(tmp_path / "data")
    fifo = _stuck_file(data / "train" / "bee" / "stuck.png")
    result = accel_train("check-data", "--data-dir", str(data), "--workers", str(workers),
                         "--read-timeout", "3", timeout=120)
    last = _stopped(result)
    if workers == 1:
        assert last == (f"accel_train: error: reading {fifo} has taken 3 s (--read-timeout), "
                        f"checking the data: {STOP}"), last
    else:
        said = [line for line in result.stderr.splitlines() if "has been reading" in line]
        assert len(said) == 1 and said[0].startswith("accel_train: check-data worker (pid "), \
            result.stderr[-3000:]
        # at 80% of the 3 s, 2.4 s (later by the watch's look every 0.3 s, and a busy machine)
        assert re.search(f"has been reading {re.escape(str(fifo))} for [2-5] s$", said[0]), \
            said[0]
        assert last == ("accel_train: error: no image read in 3 s (--read-timeout), checking "
                        "the data: a worker is stuck (its own line above names what it was "
                        "reading); exit 75, for another try once the data can be read"), last
    assert not _no_process_mentions(str(data))


def _with_a_folder_blocked(function: str, nth: int, argv: list[str], env=None):
    """The command line `argv` run in a process of its own whose `nth` call of os.`function`
    (scandir, stat) on the class folder train/bee never returns, as a call on a dead mount
    blocks in the kernel.  A FIFO cannot stand for a folder, hence this seam."""
    script = textwrap.dedent("""
        import os, sys, time
        function, nth = sys.argv[1], int(sys.argv[2])
        original, calls = getattr(os, function), []
        def blocked(*args, **kwargs):
            if os.fspath(args[0] if args else ".").endswith(os.path.join("train", "bee")):
                calls.append(args)
                if len(calls) == nth:
                    time.sleep(3600)
            return original(*args, **kwargs)
        setattr(os, function, blocked)
        from accel_train.cli import main
        sys.exit(main(sys.argv[3:]))
    """)
    return subprocess.run([sys.executable, "-c", script, function, str(nth), *argv],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("command, parquet_in_root", [("check-data", False), ("shard", True)])
def test_a_folder_whose_listing_never_returns_is_named(tmp_path, command, parquet_in_root):
    """An image folder on a mount that stops answering while it is listed (before any image is
    read): a listing of the class folder train/bee blocks (os.scandir wrapped in the command's
    process, as a dead mount's directory read blocks in the kernel), and the command stops in
    one line naming that folder.  The image folder's walk lists it; with a parquet file in the
    root (never read here), which stops that walk at once, the search for parquet files."""
    data = _image_folder(tmp_path / "data")
    if parquet_in_root:
        (data / "extra.parquet").write_bytes(b"")
    args = {"check-data": ["--workers", "1"], "shard": ["--output", str(tmp_path / "shards")]}
    result = _with_a_folder_blocked("scandir", 1, [command, "--data-dir", str(data),
                                                   "--read-timeout", "2", *args[command]])
    where = {"check-data": "checking the data",
             "shard": f"writing shards to {tmp_path / 'shards'}"}[command]
    assert _stopped(result) == (f"accel_train: error: reading the folder {data / 'train' / 'bee'}"
                                f" has taken 2 s (--read-timeout), {where}: {STOP}")


@pytest.mark.slow
def test_a_cached_index_whose_folder_never_answers_is_named(tmp_path):
    """A repeated start reads the image folder's cached index after checking each folder's
    mtime, before anything lists the tree: a folder whose stat blocks there (os.stat wrapped in
    the command's process, as a dead mount's blocks in the kernel) is named in the one line."""
    from accel_train.data.imagefolder import CACHE_ENV, index_folder
    from conftest import age_folders, test_env

    data, cache = _image_folder(tmp_path / "data"), tmp_path / "cache"
    age_folders(data)
    index_folder(data, cache_dir=cache, cache_min_files=0)  # the first start's walk, cached
    result = _with_a_folder_blocked("stat", 1, ["check-data", "--data-dir", str(data),
                                                "--workers", "1", "--read-timeout", "2"],
                                    env=test_env(**{CACHE_ENV: str(cache)}))
    assert _stopped(result) == (f"accel_train: error: reading the folder {data / 'train' / 'bee'}"
                                f" has taken 2 s (--read-timeout), checking the data: {STOP}")


@pytest.mark.slow
def test_shard_stops_in_one_line_and_its_next_start_finishes(tmp_path):
    """shard reads in its own process: stopped, it leaves no --output folder (its .partial
    one only), and once the file answers the same command writes every image."""
    data, shards = _image_folder(tmp_path / "data"), tmp_path / "shards"
    fifo = _stuck_file(data / "train" / "ant" / "stuck.png")
    last = _stopped(accel_train("shard", "--data-dir", str(data), "--output", str(shards),
                                "--read-timeout", "3", "--no-progress", timeout=120))
    assert last == (f"accel_train: error: reading {fifo} has taken 3 s (--read-timeout), "
                    f"writing shards to {shards}: {STOP}"), last
    assert not shards.exists()
    fifo.unlink()
    Image.fromarray(kinds.pixels(7, 16, 16)).save(fifo)  # the mount is back
    done = accel_train_here("shard", "--data-dir", str(data), "--output", str(shards),
                            "--no-progress", check=True)
    assert "wrote 25 images in" in done.stdout, done.stdout
    assert not shards.with_name("shards.partial").exists()


def _digests(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.slow
def test_training_and_eval_stop_in_one_line_and_touch_no_checkpoint(tmp_path):
    """A run trained on the folder; then a file of it stops answering.  Resumed, reading per
    step in the training process (--in-memory never --num-workers 0), the run stops in one line
    at its --loader-timeout, its checkpoints byte for byte as they were; eval reading the
    held-out images itself stops alike, and predict at its --read-timeout; a start that decodes
    everything in memory too."""
    data, out = _image_folder(tmp_path / "data"), tmp_path / "run"
    common = ["--data-dir", str(data), "--model", "test_resnet", "--batch-size", "4",
              "--max-eval-samples", "8", "--no-plots", "--progress", "log"]
    accel_train_here(*common, "--epochs", "1", "--output-dir", str(out), check=True)
    before = _digests(out / "checkpoints")
    assert before, "the first run saved a checkpoint"
    fifo = _stuck_file(data / "train" / "bee" / "stuck.png")
    last = _stopped(accel_train(*common, "--epochs", "2", "--resume", "auto", "--in-memory",
                                "never", "--num-workers", "0", "--loader-timeout", "3",
                                "--output-dir", str(out), timeout=180))
    assert last == (f"accel_train: error: reading {fifo} has taken 3 s (--loader-timeout), "
                    f"training: the file system does not answer (a network mount that went "
                    f"away?); exit 75, for a restart with --resume auto"), last
    assert _digests(out / "checkpoints") == before
    fifo.unlink()

    held_out = _stuck_file(data / "val" / "ant" / "stuck.png")
    last = _stopped(accel_train("eval", str(out), "--data-dir", str(data), "--num-workers", "0",
                                "--loader-timeout", "3", timeout=180))
    assert last == (f"accel_train: error: reading {held_out} has taken 3 s (--loader-timeout), "
                    f"evaluating the held-out split: {STOP}"), last
    held_out.unlink()

    # predict of a file that does not answer (given as itself: a pipe is a file predict reads)
    photo = _stuck_file(tmp_path / "photo.png")
    last = _stopped(accel_train("predict", str(out), str(data / "val" / "bee"), str(photo),
                                "--read-timeout", "3", timeout=180))
    assert last == (f"accel_train: error: reading {photo} has taken 3 s (--read-timeout), "
                    f"predicting: {STOP}"), last

    fifo = _stuck_file(data / "train" / "ant" / "stuck.png")
    last = _stopped(accel_train(*common, "--epochs", "1", "--in-memory", "always",
                                "--loader-timeout", "3", "--output-dir", str(tmp_path / "new"),
                                timeout=180))
    assert last.startswith(f"accel_train: error: reading {fifo} has taken 3 s"), last
