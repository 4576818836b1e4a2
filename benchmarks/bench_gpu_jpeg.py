r"""GPU: ResNet-50 at 224 px trained from a folder of ImageNet-sized JPEGs, accel_train's whole
loop against the same model trained by hand on a batch already on the device: whether the input
path keeps the GPU busy.

Arms, in one process, one after the other:
  hand loop            ResNet-50 (timm), channels_last, autocast, SGD + Nesterov (fused, as
                       the trainer's on CUDA), on a random batch already on the GPU
                       (bench_gpu.HandLoop): the ceiling
  accel_train MODE     Trainer.train_epoch over the folder (make_imagenet_like.py's JPEGs, 300-500
                       px, about 110 kB), --decode-on-device MODE: auto (what a user gets:
                       where the device path wins, with the share of each batch auto gives
                       the workers), never
                       (the loader workers decode, crop and jitter: timm's transform on PIL
                       images), always (the workers read the files, the GPU decodes them with
                       nvJPEG and crops them), always:0.4 (--host-decode-share 0.4: the workers
                       decode 40% of each batch themselves), each with --data-on-device never
                       (the folder is small enough to be held on the GPU; a set of ImageNet's
                       size is not); held (--data-on-device always: every photo decoded once
                       on the GPU at the start, each batch cropped and jittered there from
                       them, the workers drawing the crops); the first epoch untimed (workers,
                       cuDNN)
and the pixels: the same 64 training samples through both paths (mean and largest difference
in levels of 255; the crops, flips and labels are the same by construction); and one batch
through the device path alone: torchvision's batched decode_jpeg, TorchCodec's where it loads,
the whole decode with the crops, and the crops' resize alone, batched (the product's) against
torchvision's resize crop by crop.
MFU = forward + backward FLOPs per image (FlopCounterMode) x img/s / the GPU's dense peak.
img/s within epochs: the median of the train records' windows (5 steps each), each epoch's first
left out (it waits for the workers' first batches: a short epoch weighs that far more than an
ImageNet epoch of thousands of steps does).
With --profile-steps N, each arm of --profile-modes trains one epoch more, untimed, N of its
steps under torch.profiler (step_profile.py): the GPU's busy share of the wall time, whether the
device path's side stream overlaps the step's, the longest kernels and host operators; the
traces go to OUT (trace-MODE.json.gz).

    python benchmarks/bench_gpu_jpeg.py                  # on a machine with CUDA
    python benchmarks/bench_gpu_jpeg.py --allow-cpu --quick --model test_resnet --size 96 \
        --images 64 --batch 16                           # a smoke run (tests/test_benchmarks.py)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from accel_train.base.errors import RunStopped  # noqa: E402
from bench_gpu import HandLoop, flops_per_image, peak_tflops  # noqa: E402
from step_profile import ProfileSteps, describe  # noqa: E402
from make_imagenet_like import make_folder  # noqa: E402


def parse_args():
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--jpeg-dir", default=None,
                        help="an image folder (DIR/train/CLASS/*.jpg); default: made here")
    parser.add_argument("--images", type=int, default=6400, help="training images to make")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--precision", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--epochs", type=int, default=3, help="per arm, the first untimed")
    parser.add_argument("--modes", nargs="*",
                        default=["auto", "never", "always", "always:0.4", "held"],
                        help="--decode-on-device of each arm; MODE:SHARE adds "
                             "--host-decode-share SHARE; held: --data-on-device always")
    parser.add_argument("--workers", type=int, default=None, help="loader workers (default: "
                        "accel_train's own choice)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="steps profiled in one more epoch of each --profile-modes arm")
    parser.add_argument("--profile-modes", nargs="*", default=["always"])
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU (to test this script, not to measure)")
    return parser.parse_args()


def folder(args, work: Path) -> Path:
    if args.jpeg_dir:
        return Path(args.jpeg_dir)
    root = work / "jpegs"
    classes = 10
    started = time.perf_counter()
    make_folder(root, classes, max(1, args.images // classes), val_per_class=2,
                workers=os.cpu_count() or 1)
    print(f"made {root} in {time.perf_counter() - started:.1f} s", flush=True)
    return root


LOG_EVERY = 5  # steps a train record's window spans


def config(args, root: Path, mode: str, work: Path):
    """The run of an arm: MODE is --decode-on-device's, or MODE:SHARE with --host-decode-share
    SHARE (always:0.4: the workers decode 40% of each batch, the GPU the rest), the files
    decoded every epoch (--data-on-device never); or held (--data-on-device always)."""
    from accel_train.config import TrainConfig
    decode, _, share = mode.partition(":")
    held = mode == "held"
    return TrainConfig(data_dir=str(root), model=args.model, image_size=args.size,
                       batch_size=args.batch, mixed_precision=args.precision,
                       channels_last=True, in_memory="never",
                       data_on_device="always" if held else "never",
                       decode_on_device="never" if held else decode,
                       host_decode_share=float(share) if share else None,
                       num_workers=args.workers,
                       epochs=1_000_000, progress="log", plots=False, log_every=LOG_EVERY,
                       output_dir=str(work / f"run-{mode.replace(':', '-')}"))


def train_images(args, root: Path, work: Path):
    """The run's training images (loaders.TrainImages) as --decode-on-device always sees them."""
    from accel_train.data.loaders import TrainImages, run_transforms
    from accel_train.data.sources import load_data
    from accel_train.model.saved import ModelSpec
    cfg = config(args, root, "always", work)
    data = load_data(cfg)
    spec = ModelSpec(model_name=args.model, num_classes=10, image_size=args.size,
                     mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), class_names=[])
    return TrainImages(data.train, run_transforms(cfg, spec)[0], seed=0, mark_replaced=True)


def pixels_agree(images, device) -> dict:
    """The same training samples through the workers' path and the device's."""
    from accel_train.data.device_decode import DeviceDecoder
    keys = list(range(min(64, len(images))))
    host = images.host_batch(keys)
    encoded = images.encoded_batch(keys)
    pixels, labels, _ = DeviceDecoder(device, images)(encoded.images, encoded.labels,
                                                       encoded.replaced)
    diff = (pixels.cpu().int() - host.images.int()).abs().float()
    return {"images": len(keys), "mean_abs": diff.mean().item(), "max": diff.max().item(),
            "labels_equal": bool(torch.equal(labels.cpu(), host.labels))}


def device_path_parts(images, device, batch: int) -> dict:
    """Where the device path's time goes, one batch alone (median of 3, synchronized): the
    batched decode_jpeg call by itself, the whole DeviceDecoder call (decode, crops,
    resizes, flips), and the crops' resize alone, batched (the product's) and crop by crop
    (torchvision's); img/s each.  What the rest of a step leaves the device path is in the
    arms' rows."""
    from accel_train.data.batched_resize import resized_as_batch
    from accel_train.data.device_decode import DeviceDecoder
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as TF
    keys = list(range(min(batch, len(images))))
    encoded = images.encoded_batch(keys).images
    blobs = list(encoded.data.split(encoded.lengths))
    decoder = DeviceDecoder(device, images)
    replaced = torch.full((len(keys),), -1)
    labels = torch.zeros(len(keys), dtype=torch.int64)

    def timed(work) -> float:
        seconds = []
        for _ in range(4):  # the first pays the decoder's start
            wait(device)
            started = time.perf_counter()
            work()
            wait(device)
            seconds.append(time.perf_counter() - started)
        return len(keys) / benchlib.median(seconds[1:])

    decoded = decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device)
    crops = [image[:, top:top + height, left:left + width] for image, (top, left, height, width)
             in zip(decoded, encoded.boxes.tolist())]
    parts = {"decode_img_per_s": timed(lambda: decode_jpeg(blobs, mode=ImageReadMode.RGB,
                                                           device=device)),
             "decode_and_crop_img_per_s": timed(lambda: decoder(encoded, labels, replaced)),
             # the crops' resize alone, the product's batched one against torchvision's
             # resize crop by crop (what the device path did before), on the same crops
             "resize_batched_img_per_s": timed(lambda: resized_as_batch(
                 decoded, encoded.boxes, encoded.size, encoded.bicubic, device)),
             "resize_per_crop_img_per_s": timed(lambda: [TF.resize(
                 crop, [encoded.size] * 2, antialias=True,
                 interpolation=TF.InterpolationMode.BICUBIC if bicubic
                 else TF.InterpolationMode.BILINEAR)
                 for crop, bicubic in zip(crops, encoded.bicubic.tolist())]),
             "images": len(keys)}
    # TorchCodec's decoder, which the product takes where torchvision has none left
    # (jpeg_decoders.py): the same batch, where it loads
    try:
        from torchcodec.decoders import decode_jpeg as codec_decode_jpeg
    except Exception as err:  # noqa: BLE001 -- not installed, or built for another torch
        parts["torchcodec"] = f"not available ({type(err).__name__})"
    else:
        parts["torchcodec"] = (f"{timed(lambda: codec_decode_jpeg(blobs, device=device)):,.0f} "
                               f"img/s")
    return parts


def wait(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hand_rate(args, device, steps: int) -> float:
    images = torch.randn(args.batch, 3, args.size, args.size, device=device).contiguous(
        memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (args.batch,), device=device)
    hand = HandLoop(args.model, images, labels, args.precision, device, torch.channels_last)
    hand.run(3)
    seconds = []
    for _ in range(max(1, args.epochs - 1)):
        wait(device)
        started = time.perf_counter()
        hand.run(steps)
        wait(device)
        seconds.append(time.perf_counter() - started)
    return args.batch * steps / benchlib.median(seconds)


def trainer_rate(args, root: Path, mode: str, device, work: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    from accel_train.trainer import Trainer
    profiled = args.profile_steps > 0 and mode in args.profile_modes
    profile = ProfileSteps(0, args.profile_steps, out / f"trace-{mode}.json.gz")
    trainer = Trainer.from_config(config(args, root, mode, work),
                                  [profile] if profiled else [])
    trainer.progress.enabled = False
    decoding = trainer.loaders.decoding or ("on the device" if trainer.loaders.decoded_on_device
                                            else "by the loader workers")
    if mode == "held":  # with what decoding every photo once at the start took
        decoding = f"{trainer.loaders.choice}; held in {trainer.train_loader.held.seconds:.1f} s"
    per_epoch = max(1, trainer.loaders.steps_per_epoch)
    # the profiled steps: inside one more epoch, after its first two (the workers' restart)
    profile.skip = per_epoch * args.epochs + 2
    profile.count = min(args.profile_steps, max(1, per_epoch - 3))
    seconds, steps = [], []
    try:
        for epoch in range(args.epochs + profiled):
            wait(device)
            before, started = trainer.state.step, time.perf_counter()
            trainer.train_epoch()
            wait(device)
            if 0 < epoch < args.epochs:  # the first pays the workers' start and cuDNN's
                seconds.append(time.perf_counter() - started)
                steps.append(trainer.state.step - before)
            trainer.next_epoch()
    finally:  # a diverged arm too: its loader workers would keep this process alive
        trainer.close()
        # Accelerate keeps one state per process; the next arm is a new run
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(reset_partial_state=True)
    records = [r for r in benchlib.read_jsonl(trainer.plan.output_dir / "metrics.jsonl")
               if r.get("type") == "train"]
    later = [r for r in records if per_epoch < r.get("step", 0) <= per_epoch * args.epochs] \
        or records
    data_wait = benchlib.median([r["data_wait"] for r in later]) if later else float("nan")
    # Within epochs: each epoch's first window waits for the workers' first batches, which a
    # short epoch (25 steps here, thousands on ImageNet) weighs far more than a real one does.
    within = [r["img_per_s"] for r in later if (r["step"] - 1) % per_epoch >= LOG_EVERY]
    result = {"img_per_s": args.batch * sum(steps) / sum(seconds), "data_wait": data_wait,
              "within_epochs_img_per_s": benchlib.median(within) if within else float("nan"),
              "decoding": decoding, "workers": trainer.loaders.num_workers,
              "steps_per_epoch": per_epoch}
    if profile.summary is not None:
        result["profile"] = describe(profile.summary, profile.host_ops)
        for line in result["profile"]:
            print(f"{mode}: {line}", flush=True)
    return result


def main() -> int:
    args = parse_args()
    cuda = torch.cuda.is_available()
    report = benchlib.Report("gpu_jpeg", f"GPU: {args.model} at {args.size} px from JPEG files "
                             f"against a hand loop on the device", args)
    if not cuda and not args.allow_cpu:
        report.note("Not run: this machine has no CUDA device.")
        report.save()
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    peak = peak_tflops(name, args.peak_tflops)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-jpeg-") as work:
        return measure(args, report, device, name, peak, Path(work))


def measure(args, report, device, name: str, peak: float, work: Path) -> int:
    root = folder(args, work)
    images = train_images(args, root, work)
    agree = pixels_agree(images, device)
    print(f"pixels: {agree}", flush=True)
    parts = device_path_parts(images, device, args.batch)
    print(f"device path: {parts}", flush=True)
    flops = flops_per_image(args.model, args.size, device)
    results = {}
    for mode in args.modes:
        try:
            results[mode] = trainer_rate(args, root, mode, device, work, Path(args.out))
        except RunStopped as stopped:  # a row that says so, and the other arms still run
            results[mode] = {"img_per_s": float("nan"), "data_wait": float("nan"),
                             "decoding": f"stopped: {str(stopped)[:90]}", "workers": "",
                             "steps_per_epoch": 0}
        print(f"{mode}: {results[mode]}", flush=True)
    steps = max([r["steps_per_epoch"] for r in results.values()], default=0) or 10
    hand = hand_rate(args, device, steps)
    rows = [["hand loop (batch on the device)", "", hand, 1.0, flops * hand / 1e12 / peak, "",
             "", "", ""]]
    for mode, result in results.items():
        rate, within = result["img_per_s"], result.get("within_epochs_img_per_s", float("nan"))
        decode, _, share = mode.partition(":")
        arm = f"accel_train --decode-on-device {decode}" + \
            (f" --host-decode-share {share}" if share else "")
        if mode == "held":
            arm = "accel_train --data-on-device always (the photos held decoded)"
        rows.append([arm, result["decoding"], rate,
                     rate / hand, flops * rate / 1e12 / peak, f"{result['data_wait']:.1%}",
                     within, within / hand, result["workers"]])
    report.table(f"{args.model}, {args.size} px, {args.precision}, batch {args.batch}, on {name} "
                 f"(peak {peak} TFLOP/s dense), {os.cpu_count()} CPU cores; "
                 f"{args.epochs - 1} timed epochs of {steps} steps per arm",
                 ["arm", "JPEGs decoded", "img/s", "ratio to hand loop", "MFU", "data_wait",
                  "img/s within epochs", "its ratio", "workers"], rows,
                 notes=[f"the same {agree['images']} samples through both paths: pixels differ "
                        f"by {agree['mean_abs']:.3f} levels on average, {agree['max']:.0f} at "
                        f"most; labels equal: {agree['labels_equal']}",
                        f"the device path on one batch of {parts['images']} alone: "
                        f"decode_jpeg {parts['decode_img_per_s']:,.0f} img/s (TorchCodec's: "
                        f"{parts['torchcodec']}), with the crops and flips "
                        f"{parts['decode_and_crop_img_per_s']:,.0f} img/s; the resize of "
                        f"its crops alone, batched "
                        f"{parts['resize_batched_img_per_s']:,.0f} img/s, crop by crop "
                        f"(torchvision's resize) {parts['resize_per_crop_img_per_s']:,.0f} img/s",
                        f"forward + backward FLOPs per image: {flops / 1e9:.3g} GFLOP",
                        *[f"{mode}: {line}" for mode, result in results.items()
                          for line in result.get("profile", [])]])
    report.data.update(result=results, hand_img_per_s=hand, pixels=agree, device_path=parts)
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
