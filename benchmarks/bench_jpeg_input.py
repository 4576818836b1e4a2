"""JPEG input path per core at ImageNet sizes: images per second that one core turns from
ImageNet-like JPEG files into 224 px random-resized-cropped, flipped training images, for
accel_train's own loader path beside timm's, torchvision's and TorchCodec's.

Arms, all reading the same files (benchmarks/make_imagenet_like.py: ~110 kB, ~470x390 px, made
in a temporary folder unless --data-dir names one), in one process with torch.set_num_threads(1),
batches of 32 collated as a loader would:

- accel_train: what its loader workers run for an image folder that is decoded per step (mixed
  sizes): `make_loader(TrainImages(...))` with 0 workers, built as `data/loading.py` builds it
  (`load_data`, `run_transforms`, `EpochSampler`); files read through the Arrow index, then
  per image timm's training transform as `train.py` sets it (crop scale 0.08-1, random
  interpolation, flip, colour jitter 0.4), seeded per sample; uint8 out (normalizing waits
  for the device: `FinishOnDevice`).
- accel_train --host-decode-share: what its loader workers run for their share of each batch
  when the JPEGs are decoded on the device (--decode-on-device): the same files, crops and
  flips, decoded, cropped and resized as the device would (`device_decode.decoded_crops` on
  the CPU), the colour jitter left to the GPU with the rest of the batch's.
- accel_train --data-on-device (photos held): what its loader workers run when the photos are
  held decoded on the GPU: each sample's draws alone (`held_photos.PhotoPlans`: timm's crop
  box, interpolation, flips and jitter factors), no file read, no pixel; the GPU crops.
- timm's loader: `timm.data.create_transform(224, is_training=True)` on
  `PIL.Image.open(f).convert('RGB')`, as timm's ImageDataset calls it: crop (scale 0.08-1,
  bilinear), flip, ColorJitter 0.4 (timm's default), to float and normalized.
- timm doing accel_train's work: no colour jitter, uint8 out (`color_jitter=None,
  use_prefetcher=True`: what timm's train.py hands a GPU, which normalizes there): PIL against
  libjpeg-turbo into tensors and torch's resize, the rest alike.
- torchvision: `torchvision.io.decode_jpeg` + `transforms.v2` RandomResizedCrop(224) and
  RandomHorizontalFlip on uint8 tensors.
- TorchCodec: `torchcodec.decoders.decode_jpeg` + the same v2 transforms, when it imports.

Arms alternate in rounds (A B C D E, E D C B A, ...); each round times every arm over all the
files.  img/s per core is images / CPU seconds of this process (immune to waiting for a core);
the ratio to timm's loader is taken within each round, median and range shown.  Beside it, the
folder's mean file size and resolution next to ImageNet's, and decoding alone per image.

    python benchmarks/bench_jpeg_input.py --quick
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import make_imagenet_like as imagenet_like  # noqa: E402

BATCH = 32
SIZE = 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # any: normalizing is not timed here


def batches(files: list[Path]):
    for start in range(0, len(files), BATCH):
        yield files[start:start + BATCH]


# -- the arms: each a function that processes every file once and returns the image count ------
def accel_train_arm(root: Path, share: bool = False):
    """`share`: the workers' part of the device path's --host-decode-share, every JPEG of the
    batch theirs (what --decode-on-device auto times them on: device_decode.sharing_all)."""
    from accel_train.config import TrainConfig
    from accel_train.data.loaders import EpochSampler, TrainImages, make_loader, run_transforms
    from accel_train.data.device_decode import sharing_all
    from accel_train.data.sources import load_data
    config = TrainConfig(data_dir=str(root), in_memory="never", batch_size=BATCH)
    data = load_data(config)
    train_tf, _ = run_transforms(config, SimpleNamespace(image_size=SIZE, mean=MEAN, std=STD))
    sampler = EpochSampler(len(data.train), BATCH, config.seed)
    images = TrainImages(data.train, train_tf, config.seed, mark_replaced=True)
    # As data/loading.py builds it on a CPU, with 0 workers: the loader then runs in this process
    # exactly what a worker runs (TrainImages.__getitems__, collate_batch), without the IPC.
    loader = make_loader(sharing_all(images) if share else images, BATCH, 0, 2, False, False,
                         sampler=sampler, drop_last=True, seed=config.seed)
    epoch = iter(range(10**9))

    def run() -> int:
        sampler.set_epoch(next(epoch))  # every round an epoch of its own: new crops
        if share:  # (the batch's EncodedImages: every image cropped here, or finished here)
            return sum(len(pixels.shared) + len(pixels.ready) for pixels, *_ in loader)
        return sum(len(pixels) for pixels, *_ in loader)
    return run


def held_draws_arm(root: Path):
    """The loader workers' part when the photos are held on the device: PhotoPlans' items, one
    a batch, as a worker draws them (the sizes from the files' headers, as held_photos.scan
    reads them)."""
    from accel_train.config import TrainConfig
    from accel_train.data.held_photos import PhotoPlans, scan
    from accel_train.data.loaders import EpochSampler, run_transforms
    from accel_train.data.sources import load_data
    config = TrainConfig(data_dir=str(root), in_memory="never", batch_size=BATCH)
    data = load_data(config)
    train_tf, _ = run_transforms(config, SimpleNamespace(image_size=SIZE, mean=MEAN, std=STD))
    sampler = EpochSampler(len(data.train), BATCH, config.seed)
    plans = PhotoPlans(train_tf, sampler, torch.Size((BATCH, 3, SIZE, SIZE)), config.seed, 1, 0)
    plans.sizes = scan(data.train).shapes
    epoch = iter(range(10**9))

    def run() -> int:
        number = next(epoch)
        return sum(len(plans[number, k][0]) for k in range(sampler.usable // BATCH))
    return run


def timm_arm(files: list[Path], **options):
    from PIL import Image
    from timm.data import create_transform
    transform = create_transform(SIZE, is_training=True, **options)

    def load(path: Path):
        with open(path, "rb") as handle:  # timm's ImageDataset: reader gives an open file
            return transform(Image.open(handle).convert("RGB"))

    def run() -> int:
        return sum(len(torch.stack([load(f) for f in batch])) for batch in batches(files))
    return run


def tensor_arm(files: list[Path], decode):
    from torchvision.transforms import v2
    transform = v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True),
                            v2.RandomHorizontalFlip()])

    def run() -> int:
        return sum(len(torch.stack([transform(decode(f)) for f in batch]))
                   for batch in batches(files))
    return run


def file_tensor(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def torchvision_decoder():
    from torchvision.io import ImageReadMode, decode_jpeg
    return lambda path: decode_jpeg(file_tensor(path), mode=ImageReadMode.RGB)


def torchcodec_decoder(sample: Path):
    """TorchCodec's JPEG decoder, or the reason it cannot be used (its wheels are built for one
    torch release: an import or a first decode is where a mismatch shows)."""
    try:
        import torchcodec
        from torchcodec.decoders import decode_jpeg
        decode = lambda path: decode_jpeg(file_tensor(path), mode="RGB")  # noqa: E731
        decode(sample)
    except Exception as err:  # noqa: BLE001 -- ImportError, OSError (FFmpeg), RuntimeError, ...
        return None, f"{type(err).__name__}: {' '.join(str(err).split())[:120]}"
    return decode, torchcodec.__version__


# -- measuring -----------------------------------------------------------------------------------
def timed_round(run) -> tuple[int, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    count = run()
    return count, time.process_time() - cpu, time.perf_counter() - wall


def folder_figures(files: list[Path], repeats: int) -> list[list]:
    """The folder beside ImageNet (make_imagenet_like.py cites the figures), and decoding alone."""
    from PIL import Image
    decode_tv = torchvision_decoder()
    sizes = imagenet_like.image_sizes(files)
    kb = statistics.mean(f.stat().st_size for f in files) / 1000

    def pil():
        for f in files:
            with open(f, "rb") as handle:
                Image.open(handle).convert("RGB")

    def tv():
        for f in files:
            decode_tv(f)
    ms = {name: 1000 * benchlib.median([timed_round(lambda fn=fn: fn() or 0)[1]
                                        for _ in range(repeats)]) / len(files)
          for name, fn in (("pil", pil), ("tv", tv))}
    width, height = np.mean(sizes, axis=0)
    short = [min(s) for s in sizes]
    return [["files", f"{len(files)}", "1,281,167 (train)"],
            ["mean file size", f"{kb:.0f} kB", f"{imagenet_like.IMAGENET_FILE_KB} kB"],
            ["mean resolution", f"{width:.0f}x{height:.0f}",
             "x".join(map(str, imagenet_like.IMAGENET_MEAN_SIZE))],
            ["shorter side (min / median / max)",
             f"{min(short)} / {int(np.median(short))} / {max(short)}", "-"],
            ["decode only, PIL open + convert('RGB')", f"{ms['pil']:.2f} ms/image", "-"],
            ["decode only, torchvision decode_jpeg", f"{ms['tv']:.2f} ms/image", "-"]]


def main() -> None:
    parser = benchlib.make_parser(__doc__, data_dir=None, data_help=(
        "an image folder of JPEGs, DIR/train/CLASS/*.jpg; when not given, one made by "
        "make_imagenet_like.py in a temporary folder"))
    parser.add_argument("--classes", type=int, default=None, help="classes of the made folder")
    parser.add_argument("--per-class", type=int, default=None, help="its images per class")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    classes = args.classes or (4 if args.quick else 10)
    per_class = args.per_class or (12 if args.quick else 40)
    rounds = args.rounds or (3 if args.quick else 7)
    torch.set_num_threads(1)  # per core: one thread, one process
    warnings.filterwarnings("ignore")  # torchvision.io's deprecation in favour of TorchCodec

    with tempfile.TemporaryDirectory(prefix="jpeg_input_") as tmp:
        root = Path(args.data_dir) if args.data_dir else Path(tmp)
        if not args.data_dir:
            # a small val/ too, so that the training split is every train/ file
            imagenet_like.make_folder(root, classes, per_class, val_per_class=1)
        files = sorted(f for f in (root / "train").glob("*/*")
                       if f.suffix.lower() in (".jpg", ".jpeg"))
        if len(files) < BATCH:
            sys.exit(f"{len(files)} JPEG files under {root}/train/CLASS/: at least {BATCH} needed")
        report = benchlib.Report("jpeg_input", "JPEG input path per core at ImageNet sizes",
                                 args)
        codec, codec_note = torchcodec_decoder(files[0])
        arms = {"accel_train loader path": accel_train_arm(root),
                "accel_train --host-decode-share (jitter left to the GPU)":
                    accel_train_arm(root, share=True),
                "accel_train --data-on-device (photos held: the draws alone)":
                    held_draws_arm(root),
                "timm loader (create_transform, PIL)": timm_arm(files),
                "timm, no jitter, uint8 out": timm_arm(files, color_jitter=None,
                                                       use_prefetcher=True),
                "torchvision decode_jpeg + v2": tensor_arm(files, torchvision_decoder())}
        if codec is not None:
            arms[f"torchcodec {codec_note} decode_jpeg + v2"] = tensor_arm(files, codec)
        reference = "timm loader (create_transform, PIL)"
        for run in arms.values():  # warm-up: imports, first calls, the page cache
            run()
        results: dict[str, list[tuple[int, float, float]]] = {name: [] for name in arms}
        for order in benchlib.round_orders(list(arms), rounds):
            for name in order:
                results[name].append(timed_round(arms[name]))
        rows = []
        for name, runs in results.items():
            per_core = [count / cpu for count, cpu, _ in runs]
            ratios = [rate / (ref[0] / ref[1]) for rate, ref in zip(per_core, results[reference])]
            rows.append([name, benchlib.median(per_core),
                         benchlib.median([count / wall for count, _, wall in runs]),
                         1000 / benchlib.median(per_core), benchlib.median(ratios),
                         benchlib.spread(ratios)])
        if codec is None:
            rows.append([f"torchcodec: not installed ({codec_note})", "-", "-", "-", "-", "-"])
        report.table(f"Images per second per core, {len(files)} files x {rounds} rounds "
                     f"(batches of {BATCH}, {SIZE} px out)",
                     ["input path", "img/s per core", "img/s (wall)", "ms/image",
                      "vs timm loader", "range over rounds"], rows,
                     notes=["img/s per core: images / CPU seconds of this one-thread process",
                            "uint8 out of every arm but timm's loader (float32, normalized: "
                            "accel_train normalizes on the device, as timm's train.py does)",
                            "crop scale 0.08-1 and ratio 3/4-4/3 in every arm (timm's "
                            "defaults, which accel_train's --scale and --ratio take)"])
        report.table("The folder beside ImageNet", ["", "this folder", "ImageNet (ILSVRC-2012)"],
                     folder_figures(files, 3 if args.quick else 5),
                     notes=["ImageNet figures: make_imagenet_like.py's docstring cites them",
                            f"torch {torch.__version__}, {versions()}"])
        report.save()


def versions() -> str:
    import PIL
    import timm
    import torchvision
    from PIL import features
    return (f"torchvision {torchvision.__version__}, timm {timm.__version__}, Pillow "
            f"{PIL.__version__} (libjpeg-turbo {features.version('libjpeg_turbo')})")


if __name__ == "__main__":
    main()
