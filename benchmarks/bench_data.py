"""Data: the input pipeline alone against the model's consumption, decode-once-in-memory against
decoding JPEG every epoch (the seed tutorial's way), and the trainer's own data-wait on CIFAR-10.

1. Decoding the shared CIFAR-10 (JPEG bytes in parquet): the seed's way per image (PIL +
   ToTensor, every epoch), PIL to uint8, and accel_train's decode-once (`HFSource.materialize`:
   Arrow batches + torchvision's libjpeg-turbo decoder), in images per second.
2. Input pipelines alone (no model), batch 64, images per second out of the DataLoader:
   in memory + batched augmentation (accel_train's default), in memory + per-sample augmentation
   (the design before), decode + augment every epoch (`--in-memory never`) with 0 and with the
   default workers, and the seed's torchvision-style dataset (PIL + ToTensor per sample).
   Beside them, what crosses from the loader to the training step: float32 normalized in the
   loader (before) against uint8 pixels normalized after it (now; on the device on a GPU), as
   images per second and per core used.
3. The model's consumption: training steps per second of --model on ready batches, as img/s;
   the ratio pipeline / model says how many times over the pipeline can feed the model.
4. The trainer itself on CIFAR-10 with default settings (and with --in-memory never): median
   data_wait and img/s of its log windows (metrics.jsonl), the figure the issue sets under 5%.
5. --reprob's random erasing of one batch: timm per image inside its own `seeded` block (the
   way before, in the training process), the batch's plan drawn at once (`erasing_plan`, now
   in the loader's workers), and what is left to the training process (`apply_erasing`).
6. In-memory 32 px images trained at a GPU's 224 or 336 px: their resize, crop and flip in the
   loader (before) against the loader handing over the stored pixels and a crop plan, placed on
   the device (now, on a GPU), each part's milliseconds per batch and the bytes that travel.

    python benchmarks/bench_data.py --quick
"""

from __future__ import annotations

import functools
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402


# -- 1. decoding ---------------------------------------------------------------------------------
def decode_rates(args, report) -> dict:
    import pyarrow.parquet as pq
    from PIL import Image
    from torchvision.transforms import functional as TVF

    from accel_train.config import TrainConfig
    from accel_train.data.sources import load_data
    path = benchlib.check_cifar(args.data_dir) / "train.parquet"
    blobs = pq.read_table(path, columns=["img"]).column("img").combine_chunks() \
        .field("bytes").to_pylist()[:args.decode_images]
    count = len(blobs)

    def seed_way():  # torchvision.datasets + transforms.ToTensor(), as in the tutorial
        for blob in blobs:
            TVF.to_tensor(Image.open(io.BytesIO(blob)).convert("RGB"))

    def pil_uint8():  # accel_train's decoder before this change
        for blob in blobs:
            torch.from_numpy(np.asarray(Image.open(io.BytesIO(blob)).convert("RGB")).copy())

    # the first N: the images of `blobs`, read straight from the file
    config = TrainConfig(data_dir=str(args.data_dir), max_train_samples=count,
                         max_eval_samples=1, in_memory="never", sample_subset="first")
    source = load_data(config).train
    materialized = {}

    def decode_once():
        materialized["source"] = source.materialize(8 * 2**30)

    rows, result = [], {}
    for name, fn in (("seed's way: PIL + ToTensor, per image", seed_way),
                     ("PIL to uint8, per image (accel_train before)", pil_uint8),
                     ("accel_train decode-once (Arrow batches, libjpeg-turbo)", decode_once)):
        seconds = benchlib.median([benchlib.timed(fn) for _ in range(args.repeats)])
        result[name] = count / seconds
        rows.append([name, count / seconds, seconds * 50_000 / count])
    base = result["seed's way: PIL + ToTensor, per image"]
    rows = [row + [result[row[0]] / base] for row in rows]
    report.table(f"Decoding CIFAR-10 JPEGs ({count} images, median of {args.repeats})",
                 ["decoder", "img/s", "s per 50k images", "speed vs seed's way"], rows,
                 notes=["decode-once pays this once per run; the seed's way pays it every epoch "
                        "(in loader workers, on the same cores as training)"])
    return result


# -- 2. pipelines alone --------------------------------------------------------------------------
class PerSample(Dataset):
    """Hides __getitems__: the loader then asks for one sample at a time (the design before)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        return self.dataset[key]


class SeedCifar(Dataset):
    """The tutorial's torchvision.datasets.CIFAR10 + ToTensor, reading the shared parquet."""

    def __init__(self, blobs, labels):
        self.blobs, self.labels = blobs, labels

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, index):
        from PIL import Image
        from torchvision.transforms import functional as TVF
        image = Image.open(io.BytesIO(self.blobs[index])).convert("RGB")
        return TVF.to_tensor(image), self.labels[index]


def pipeline_rate(loader, batches: int, finish=None) -> float:
    """Images per second out of `loader`; with `finish` (data.FinishOnDevice), made ready to
    train as the trainer does after the loader (normalized, erased): float batches either way."""
    iterator = iter(loader)
    next(iterator)  # worker start-up and first-batch costs are not steady state
    started, images = time.perf_counter(), 0
    for _ in range(batches):
        batch = next(iterator)
        if finish is not None:
            finish(batch[0], batch[4:])  # the pixels, then any plans after the samples
        images += len(batch[0])
    return images / (time.perf_counter() - started)


class NormalizedInLoader(Dataset):
    """TrainImages as it was before the uint8 path: normalized (and erased) inside the loader,
    so float32 batches cross from the workers to the training process."""
    def __init__(self, dataset, finish):
        self.dataset, self.finish = dataset, finish

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, keys):
        from accel_train.data.loaders import SampleBatch
        batch = self.dataset.__getitems__(keys)
        return SampleBatch(self.finish(batch.images), batch.labels, batch.keys,
                           batch.replaced)


def transfer(args, report, memory, disk, transform, loader) -> dict:
    """Before and after: float32 normalized in the loader against uint8 pixels normalized
    after it (on the device on a GPU; here on the CPU, in the training process)."""
    from accel_train.data.loaders import FinishOnDevice, TrainImages
    cores = benchlib.machine()["cores"] or 1
    rows, rates = [], {}
    for where, source, workers in (("in memory", memory, 0),
                                   ("decoded per step", disk, args.workers)):
        finish = FinishOnDevice(transform)
        arms = (("float32 out of the loader (before)",
                 lambda s=source, f=finish, w=workers:
                 loader(NormalizedInLoader(TrainImages(s, transform, 0), f), w), None, 4),
                ("uint8 out of the loader, normalized after (now)",
                 lambda s=source, w=workers: loader(TrainImages(s, transform, 0), w), finish,
                 1))
        for name, build, after, bytes_per_value in arms:
            rate = benchlib.median([pipeline_rate(build(), args.batches, after)
                                    for _ in range(args.repeats)])
            used = min(cores, workers + 1)
            rates[f"{where}: {name}"] = rate
            rows.append([f"{where}, {workers} workers", name, rate, rate / used,
                         64 * 3 * 32 * 32 * bytes_per_value // 1024])
    report.table(f"What crosses from the loader to the training step: float32 vs uint8 "
                 f"({args.pipeline_images} CIFAR-10 images, batches of 64, augmented, median of "
                 f"{args.repeats})",
                 ["data", "batches", "img/s", "img/s per core used", "kB per batch"], rows,
                 notes=["cores used = loader workers + the training process, at most the "
                        "machine's; on a GPU the 'after' normalization runs on the device"])
    return rates


def pipelines(args, report) -> dict:
    import pyarrow.parquet as pq

    from accel_train.config import TrainConfig
    from accel_train.data.loaders import (EpochSampler, FinishOnDevice, TrainImages,
                                          dataset_mean_std, make_loader)
    from accel_train.data.sources import load_data
    from accel_train.data.transforms import ImageTransform
    count = args.pipeline_images
    # the first N, read in the file's order (a draw would scatter the disk arm's reads)
    memory = load_data(TrainConfig(data_dir=str(args.data_dir), max_train_samples=count,
                                   max_eval_samples=1, in_memory="always",
                                   sample_subset="first")).train
    disk = load_data(TrainConfig(data_dir=str(args.data_dir), max_train_samples=count,
                                 max_eval_samples=1, in_memory="never",
                                 sample_subset="first")).train
    mean, std = dataset_mean_std(memory)
    transform = ImageTransform(32, mean, std, augment=True)
    finish_memory = finish_disk = FinishOnDevice(transform)  # (no erasing: no plan needed)
    batch, batches = 64, args.batches
    workers = args.workers

    def loader(dataset, num_workers):
        sampler = EpochSampler(len(dataset), batch, seed=0)
        return make_loader(dataset, batch, num_workers, 2, False, False, sampler=sampler,
                           drop_last=True)

    table = pq.read_table(benchlib.check_cifar(args.data_dir) / "train.parquet")
    blobs = table.column("img").combine_chunks().field("bytes").to_pylist()[:count]
    labels = table.column("label").to_pylist()[:count]
    arms = [
        ("in memory, batched augmentation (default)",
         lambda: loader(TrainImages(memory, transform, 0), 0), finish_memory),
        ("in memory, per-sample augmentation (before)",
         lambda: loader(PerSample(TrainImages(memory, transform, 0)), 0), finish_memory),
        ("decode every epoch (--in-memory never), 0 workers",
         lambda: loader(TrainImages(disk, transform, 0), 0), finish_disk),
        (f"decode every epoch (--in-memory never), {workers} workers (default)",
         lambda: loader(TrainImages(disk, transform, 0), workers), finish_disk),
        (f"seed's way: PIL + ToTensor per sample, {workers} workers",
         lambda: DataLoader(SeedCifar(blobs, labels), batch_size=batch, shuffle=True,
                            num_workers=workers, persistent_workers=False), None),
    ]
    rates = {}
    for name, build, finish in arms:
        rates[name] = benchlib.median([pipeline_rate(build(), batches, finish)
                                       for _ in range(args.repeats)])
    transfer_rates = transfer(args, report, memory, disk, transform, loader)
    model_rate = model_consumption(args, mean, std, memory)
    in_line = {name for name, *_ in arms if "workers" not in name or "0 workers" in name}
    rows = [[name, rate, rate / model_rate,
             f"{model_rate / (model_rate + rate):.1%}" if name in in_line
             else "overlapped (workers)"] for name, rate in rates.items()]
    rows.append([f"model consumption: {args.model} training, batch {batch}", model_rate, 1.0, ""])
    report.table(f"Input pipeline alone vs the model ({count} CIFAR-10 images, {batches} batches "
                 f"of {batch}, median of {args.repeats}; {torch.get_num_threads()} threads)",
                 ["pipeline", "img/s", "x model's consumption", "data-wait if run in-line"],
                 rows, notes=["data-wait if run in-line = pipeline time / (pipeline + model time) "
                              "per image, for pipelines that run in the training process",
                              "worker pipelines overlap with training but take CPU from it: on "
                              f"{benchlib.machine()['cores']} cores, workers and the model "
                              "share the same cores"])
    return {"pipelines": rates, "model": model_rate, "transfer": transfer_rates}


def model_consumption(args, mean, std, source) -> float:
    import timm
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    x = (source.images[:64].float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / \
        torch.tensor(std).view(1, 3, 1, 1)
    y = source.labels[:64]

    def steps(n):
        for _ in range(n):
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    steps(2)
    seconds = benchlib.median([benchlib.timed(lambda: steps(args.model_steps))
                               for _ in range(args.repeats)])
    return 64 * args.model_steps / seconds


# -- 4. the trainer's own data-wait --------------------------------------------------------------
def trainer_data_wait(args, report) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-data-", dir=args.tmp))
    rows, result = [], {}
    arms = [("defaults (in memory, batched augmentation, 0 workers)", []),
            ("--in-memory never (decode every epoch, default workers)", ["--in-memory", "never"])]
    for name, extra in arms:
        out = work / f"run{len(rows)}"
        cmd = [sys.executable, "-m", "accel_train", "--data-dir", str(args.data_dir),
               "--output-dir", str(out), "--model", args.model, "--max-steps",
               str(args.trainer_steps), "--log-every", str(args.log_every), "--progress", "log",
               "--no-plots", "--max-eval-samples", "256", *benchlib.FIXED_COMPUTE, *extra]
        if args.max_train:
            cmd += ["--max-train-samples", str(args.max_train)]
        started = time.perf_counter()
        benchlib.run(cmd, env=benchlib.child_env())
        wall = time.perf_counter() - started
        windows = benchlib.steady_windows(benchlib.read_jsonl(out / "metrics.jsonl"))
        waits = [w["data_wait"] for w in windows]
        rates = [w["img_per_s"] for w in windows]
        result[name] = {"data_wait": benchlib.median(waits), "img_per_s": benchlib.median(rates),
                        "wall_s": wall}
        rows.append([name, f"{benchlib.median(waits):.2%}",
                     f"{min(waits):.2%}-{max(waits):.2%}", benchlib.median(rates), wall])
    report.table(f"The trainer's own data-wait: accel_train on CIFAR-10, {args.model}, "
                 f"{args.trainer_steps} steps, windows of {args.log_every} (first dropped)",
                 ["setting", "data_wait (median)", "range", "img/s (median)",
                  "process wall s (load + train + eval 256)"], rows,
                 notes=["data_wait: fraction of each log window spent waiting for the next batch "
                        "(metrics.jsonl); target < 5% with default settings"])
    return result


def median_seconds(arms: dict, repeats: int) -> dict:
    """Each arm's median seconds over `repeats` calls, after one call to warm it."""
    times = {}
    for name, arm in arms.items():
        arm()
        times[name] = benchlib.median([benchlib.timed(arm) for _ in range(repeats)])
    return times


# -- 5. random erasing ---------------------------------------------------------------------------
def erasing_cost(args, report) -> dict:
    from accel_train.data.augment import ERASING_SALT, apply_erasing, build_erasing, erasing_plan
    from accel_train.base.randomness import seeded
    torch.set_num_threads(1)  # as in a loader worker (transforms.single_threaded)
    batch, size = args.erase_batch, 32
    images = torch.randn(batch, 3, size, size)
    erasing = build_erasing(args.reprob)
    epochs, indices = np.zeros(batch, dtype=np.int64), np.arange(batch)

    def per_image_seeded():  # the code before: a canvas drawn image by image, each in `seeded`
        canvas = torch.full(images.shape, float("nan"))
        for image, epoch, index in zip(canvas, epochs, indices):
            with seeded(0, int(epoch), int(index), ERASING_SALT):
                erasing(image)
        erased = ~torch.isnan(canvas)
        return torch.where(erased, canvas, images)

    plan = erasing_plan(erasing, images.shape, 0, epochs, indices)
    arms = {"timm per image, each in its own seeded block (before; training process)":
            per_image_seeded,
            "the batch's plan, states kept once (now; a loader worker)":
            lambda: erasing_plan(erasing, images.shape, 0, epochs, indices),
            "applying the plan (now; training process)": lambda: apply_erasing(images, plan)}
    assert torch.equal(per_image_seeded(), apply_erasing(images, plan))  # the same values
    times = median_seconds(arms, args.repeats * 3)
    before = times[next(iter(arms))]
    report.table(f"Random erasing of one batch ({batch} images, {size} px, --reprob "
                 f"{args.reprob}, median of {args.repeats * 3}, 1 thread)",
                 ["arm", "ms per batch", "us per image", "ratio to before"],
                 [[name, f"{t * 1e3:.1f}", f"{t * 1e6 / batch:.0f}", f"{t / before:.3f}"]
                  for name, t in times.items()],
                 notes=["the same erased values in both ways (checked in the run)"])
    return times


# -- 6. where small images are resized and cropped for a GPU's run -----------------------------
def placement_cost(args, report) -> dict:
    """In-memory CIFAR trained at a GPU's sizes (bench_gpu.py's 224 and 336 px, the seed
    tutorial's 336): a batch's resize, crop and flip in the loader (before) against the loader
    handing over the stored 32 px pixels and their crop plan, placed on the device (now;
    data.TrainImages.places_on_device).  The device's part is timed here on the CPU: on a GPU
    it runs there."""
    from accel_train.data.loaders import TrainImages
    from accel_train.data.sources import ArraySource
    from accel_train.data.transforms import ImageTransform
    torch.set_num_threads(1)  # as in a loader worker (transforms.single_threaded)
    count = 1024
    images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    source = ArraySource(images, torch.arange(count) % 10)
    rows, result = [], {}
    for size, batch in ((224, 128), (336, 64)):
        transform = ImageTransform(size, (0.5,) * 3, (0.25,) * 3, augment=True)
        keys = list(range(count + 7, count + 7 + batch))  # epoch 1
        kept = TrainImages(source, transform, 0, place_on_device=False)
        placed = TrainImages(source, transform, 0, place_on_device=True)
        handed = placed.__getitems__(keys)
        arms = {"in the loader (before)": functools.partial(kept.__getitems__, keys),
                "the loader's part now: stored pixels + crop plan":
                functools.partial(placed.__getitems__, keys),
                "the device's part now (here on the CPU)":
                functools.partial(transform.place, handed.images, handed.crop_plan)}
        # the same pixels either way (checked in the run)
        assert torch.equal(kept.__getitems__(keys).images,
                           transform.place(handed.images, handed.crop_plan))
        times = median_seconds(arms, args.repeats * 3)
        before = times["in the loader (before)"]
        sent = {"in the loader (before)": batch * 3 * size * size,
                "the loader's part now: stored pixels + crop plan":
                handed.images.numel() + handed.crop_plan.numel() * 8}
        for name, t in times.items():
            rows.append([f"{size} px, batch {batch}", name, f"{t * 1e3:.2f}",
                         f"{t / before:.3f}", f"{sent[name] / 1024:,.0f}" if name in sent
                         else ""])
        result[size] = times
    report.table(f"Resize, crop and flip of in-memory 32 px images for a GPU's run (median of "
                 f"{args.repeats * 3}, 1 thread)",
                 ["images", "arm", "ms per batch", "ratio to before", "kB from the loader"],
                 rows, notes=["the same uint8 pixels either way (checked in the run)"])
    return result


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--decode-images", type=int, default=None)
    parser.add_argument("--pipeline-images", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--model-steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None,
                        help="loader workers for the worker arms (default: the trainer's)")
    parser.add_argument("--trainer-steps", type=int, default=None)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--max-train", type=int, default=None,
                        help="limit the trainer's training set (default: all 50,000)")
    parser.add_argument("--erase-batch", type=int, default=512)
    parser.add_argument("--reprob", type=float, default=0.5)
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["decode", "pipelines", "trainer", "erasing", "placement"])
    parser.add_argument("--tmp", default=tempfile.gettempdir())
    args = parser.parse_args()
    quick = args.quick
    args.decode_images = args.decode_images or (2000 if quick else 10000)
    args.pipeline_images = args.pipeline_images or (2048 if quick else 10000)
    args.batches = args.batches or (10 if quick else 40)
    args.model_steps = args.model_steps or (3 if quick else 10)
    args.repeats = args.repeats or (1 if quick else 3)
    args.trainer_steps = args.trainer_steps or (30 if quick else 100)
    if args.workers is None:
        from accel_train.base.ranks import process_cores
        from accel_train.data.loaders import default_num_workers
        from accel_train.data.sources import ImageSource
        args.workers = default_num_workers(ImageSource(), process_cores(1), cuda=False)
    report = benchlib.Report("data", "Data: input pipeline, decode once vs every epoch, "
                             "data-wait", args)
    result = {}
    if "decode" not in args.skip:
        result["decode"] = decode_rates(args, report)
    if "pipelines" not in args.skip:
        result["pipelines"] = pipelines(args, report)
    if "trainer" not in args.skip:
        result["trainer"] = trainer_data_wait(args, report)
    if "erasing" not in args.skip:
        result["erasing"] = erasing_cost(args, report)
    if "placement" not in args.skip:
        result["placement"] = placement_cost(args, report)
    report.data["result"] = result
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
