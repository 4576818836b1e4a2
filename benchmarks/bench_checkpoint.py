"""Checkpoints: save and load time against model size, as a ratio to plain sequential write and
read bandwidth of the same disk, and the training time lost per checkpoint.

For each model, a real Trainer (embedded synthetic data, a couple of SGD steps so that the
momentum buffers exist) saves checkpoints through its own `save_checkpoint` (Accelerate's
save_state with safetensors, then our manifest: SHA-256 of every file and fsync, then an atomic
rename) and loads them as a resume does (`verify`: re-hash against the manifest, then
`Checkpointer.load`).  Loads are timed from a cold page cache (the checkpoint's files are
evicted with posix_fadvise(DONTNEED) first, which touches nothing else on the machine).

The anchor is plain sequential I/O of the same number of bytes in the same folder: one file
written in 8 MiB chunks and fsynced, then read back cold.  Ratio = plain time / checkpoint time
(1.0: the checkpoint goes as fast as the disk allows).

Training time lost, two arms side by side on the same trainer.  Sealed in line (a save that
returns complete, as one a callback's on_checkpoint sees): the loop waits for the whole save.
Sealed in the background (what the loop's epoch-end and --checkpoint-every saves do): the loop
waits for the parts' files, then trains on while the main process hashes, syncs and renames on
a thread (run/save_finishing.py); its loss is that wait plus what the next epochs took beyond
the same epochs without a save (the thread shares the cores), plus any wait left at their end.
Each arm alternates with the other, repeated; the table gives the loss in training steps of that
model (batch 64 on 32 px images, the same process) and as a share of an epoch of CIFAR-10 (781
steps) with one checkpoint per epoch.

A run of short epochs, two arms alternating: the whole training (`Trainer.train`: its epochs,
their evaluations and saves, the end) of E epochs of 2 steps saving at every epoch end, against
the same run with `--checkpoint-minutes 60`, which saves at its last step only: what the option
gives back where epochs take seconds.

    python benchmarks/bench_checkpoint.py --quick
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

CHUNK = 8 * 2**20
CIFAR_STEPS_PER_EPOCH = 50_000 // 64


def evict(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def plain_io(folder: Path, size: int) -> tuple[float, float]:
    """Seconds to write `size` bytes sequentially (+ fsync) and to read them back cold."""
    path = folder / "plain.bin"
    block = os.urandom(CHUNK)
    started = time.perf_counter()
    with open(path, "wb") as handle:
        left = size
        while left > 0:
            handle.write(block[:min(left, CHUNK)])
            left -= CHUNK
        handle.flush()
        os.fsync(handle.fileno())
    write = time.perf_counter() - started
    evict([path])
    started = time.perf_counter()
    with open(path, "rb") as handle:
        while handle.read(CHUNK):
            pass
    read = time.perf_counter() - started
    path.unlink()
    return write, read


def make_trainer(model: str, out: Path, **options):
    from accel_train.config import TrainConfig
    from accel_train.trainer import Trainer
    config = TrainConfig(**{**dict(
        dataset="synthetic", synthetic_train_size=128, max_eval_samples=64, model=model,
        batch_size=64, epochs=1000, progress="log", plots=False, output_dir=str(out),
        keep_checkpoints=2, log_every=1000, mixed_precision="no", channels_last=False),
        **options})
    trainer = Trainer.from_config(config)
    trainer.progress.enabled = False  # quiet: the benchmark prints its own
    return trainer


def one_epoch(trainer) -> float:
    started = time.perf_counter()
    trainer.train_epoch()
    seconds = time.perf_counter() - started
    trainer.next_epoch()
    return seconds / trainer.loaders.steps_per_epoch


def train_for(trainer, epochs: int) -> float:
    """Seconds to train `epochs` epochs (of the 128-image set: 2 steps each)."""
    return sum(one_epoch(trainer) for _ in range(epochs)) * trainer.loaders.steps_per_epoch


def time_lost(trainer, background: bool, after: int) -> tuple[float, float]:
    """(seconds the loop lost to one save, seconds it waited inside save_checkpoint): the
    save, then `after` epochs and any wait left, against the same epochs without a save."""
    without = train_for(trainer, after)
    trainer.state.step += 1
    started = time.perf_counter()
    trainer.save_checkpoint(background=background)
    stall = time.perf_counter() - started
    with_save = stall + train_for(trainer, after)
    started = time.perf_counter()
    trainer.checkpointer.wait()
    with_save += time.perf_counter() - started
    return with_save - without, stall


def run_seconds(model: str, minutes: float, epochs: int, out: Path) -> float:
    """Seconds of a whole run's training of `epochs` epochs of 2 steps, --checkpoint-minutes
    `minutes`."""
    trainer = make_trainer(model, out, epochs=epochs, checkpoint_minutes=minutes)
    started = time.perf_counter()
    code = trainer.train()
    seconds = time.perf_counter() - started
    trainer.close()
    assert code == 0, code
    return seconds


def measure(model: str, args, work: Path) -> dict:
    from accel_train.run.checkpoint import _sha256, verify
    trainer = make_trainer(model, work / model)
    one_epoch(trainer)  # momentum buffers now exist: the checkpoint is full size
    step_seconds = benchlib.median([one_epoch(trainer) for _ in range(args.step_repeats)])
    saves, hashes, loads, verifies, paths = [], [], [], [], []
    for _ in range(args.repeats):
        trainer.state.step += 1  # a new checkpoint name each time, as in training
        started = time.perf_counter()
        path = trainer.save_checkpoint()
        saves.append(time.perf_counter() - started)
        paths.append(path)
        files = files_under(path)
        started = time.perf_counter()
        for file in files:  # what the manifest costs (warm cache: the bytes were just written)
            _sha256(file)
        hashes.append(time.perf_counter() - started)
        evict(files)
        started = time.perf_counter()
        problem = verify(path)
        verifies.append(time.perf_counter() - started)
        assert problem is None, problem
        evict(files)
        started = time.perf_counter()
        trainer.checkpointer.restore(path)
        loads.append(time.perf_counter() - started)
    size = sum(f.stat().st_size for f in files_under(paths[-1]))  # before pruning takes it
    lost = {True: [], False: []}
    for _ in range(args.repeats):
        for background in (False, True):
            lost[background].append(time_lost(trainer, background, args.epochs_after))
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    plain = [plain_io(work, size) for _ in range(args.repeats)]
    trainer.close()
    runs = {0: [], 60: []}
    for repeat in range(args.repeats):
        for minutes in runs:
            runs[minutes].append(run_seconds(model, minutes, args.run_epochs,
                                             work / f"{model}-run{repeat}-{minutes}"))
    return {"model": model, "bytes": size, "weight_bytes": weights,
            "save_s": benchlib.median(saves), "hash_s": benchlib.median(hashes),
            "verify_s": benchlib.median(verifies), "load_s": benchlib.median(loads),
            "plain_write_s": benchlib.median([w for w, _ in plain]),
            "plain_read_s": benchlib.median([r for _, r in plain]), "step_s": step_seconds,
            "lost_in_line_s": benchlib.median([t for t, _ in lost[False]]),
            "lost_background_s": benchlib.median([t for t, _ in lost[True]]),
            "stall_background_s": benchlib.median([w for _, w in lost[True]]),
            "run_every_end_s": benchlib.median(runs[0]),
            "run_minutes_60_s": benchlib.median(runs[60])}


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--step-repeats", type=int, default=None)
    parser.add_argument("--epochs-after", type=int, default=None, help="epochs trained after "
                        "each save of the time-lost arms (default 3; --quick 1)")
    parser.add_argument("--run-epochs", type=int, default=None, help="epochs of the short "
                        "runs' arms (default 6; --quick 3)")
    parser.add_argument("--tmp", default=None, help="folder on the disk to measure "
                        "(default: bench_out/, the repository's disk)")
    args = parser.parse_args()
    args.models = args.models or (["test_resnet", "resnet18"] if args.quick
                                  else ["test_resnet", "resnet18", "resnet50", "wide_resnet50_2"])
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.step_repeats = args.step_repeats or (1 if args.quick else 3)
    args.epochs_after = args.epochs_after or (1 if args.quick else 3)
    args.run_epochs = args.run_epochs or (3 if args.quick else 6)
    if args.run_epochs < 2:
        parser.error("--run-epochs: at least 2 (the arms differ in the saves before the last)")
    base = Path(args.tmp or args.out)
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=base))
    report = benchlib.Report("checkpoint", "Checkpoints: save/load vs plain disk I/O", args)
    results = [measure(model, args, work) for model in args.models]
    mb = 2**20
    rows = []
    for r in results:
        rows.append([r["model"], r["bytes"] / mb, r["save_s"], r["hash_s"],
                     r["plain_write_s"] / r["save_s"], r["verify_s"], r["load_s"],
                     r["plain_read_s"] / r["load_s"], r["bytes"] / mb / r["plain_write_s"],
                     r["bytes"] / mb / r["plain_read_s"]])
    report.table(f"Save and load (median of {args.repeats}; disk of {work})",
                 ["model", "checkpoint MB", "save s", "of which hashing s",
                  "save ratio (plain write / save)", "verify s (cold)", "load s (cold)",
                  "load ratio (plain read / load)", "plain write MB/s", "plain read MB/s"], rows,
                 notes=["checkpoint = weights + SGD momentum + scheduler + RNG + manifest; a "
                        "resume runs verify (re-hash) then load",
                        "hashing: SHA-256 of the files for the manifest, read back from the page "
                        "cache"])
    rows = []
    for r in results:
        epoch = r["step_s"] * CIFAR_STEPS_PER_EPOCH
        rows.append([r["model"], r["step_s"] * 1000, r["lost_in_line_s"],
                     r["lost_background_s"], r["stall_background_s"],
                     r["lost_in_line_s"] / max(r["lost_background_s"], 1e-3),
                     r["lost_background_s"] / r["step_s"],
                     f"{r['lost_background_s'] / (r['lost_background_s'] + epoch):.2%}"])
    report.table(f"Training time lost per checkpoint (median of {args.repeats}, each arm "
                 f"alternating, {args.epochs_after} epoch(s) of 2 steps after each save)",
                 ["model", "train step ms (batch 64, 32 px)", "lost, sealed in line s",
                  "lost, sealed in the background s", "of which the loop waited s",
                  "in line / background", "= training steps (background)",
                  "share of a CIFAR-10 epoch (1 checkpoint/epoch)"], rows,
                 notes=["in line: the loop waits for the whole save (a callback's on_checkpoint "
                        "gets it complete); background: the loop's own saves, sealed on a "
                        "thread while the next steps train",
                        "lost = save wait + the next epochs beyond the same epochs without a "
                        "save + any wait left; it can be below the wait alone where the epochs "
                        "after happened to run faster"])
    rows = []
    for r in results:
        every, hourly = r["run_every_end_s"], r["run_minutes_60_s"]
        rows.append([r["model"], every, hourly, every / hourly,
                     (every - hourly) / (args.run_epochs - 1)])
    report.table(f"A run of {args.run_epochs} epochs of 2 steps (median of {args.repeats}, the "
                 f"arms alternating): saving at every epoch end against --checkpoint-minutes 60",
                 ["model", "every epoch end s", "--checkpoint-minutes 60 s",
                  "every end / --checkpoint-minutes 60", "s per save skipped"], rows,
                 notes=["the whole Trainer.train: epochs, evaluations of 64 images, the saves "
                        "(sealed in the background), the end; the hour saves at the last step "
                        f"only, {args.run_epochs - 1} saves fewer"])
    report.data["result"] = results
    print(f"wrote {report.save()}")
    import shutil
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
