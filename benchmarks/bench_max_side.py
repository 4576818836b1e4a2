"""Camera-sized photos through the training input path, as they are and as `accel-train shard
--max-side N` stores them: what storing them smaller once saves at every step.

A folder of phone-camera-sized JPEGs (4032x3024, quality 90, about 3 MB: make_imagenet_like.py's
scenes rendered at ImageNet size, enlarged, with sensor grain added at full size), and beside
it the same files passed through `streaming.max_side.within_max_side` (what shard writes for
each).  Arms, alternating in rounds, one thread: accel_train's loader path (bench_jpeg_input's
arm: decode, timm's training crop at 224 px, flip, colour jitter) over each folder; img/s per
core is images / CPU seconds.  Beside them, what storing cost (ms a file, once).

    python benchmarks/bench_max_side.py --quick
"""

from __future__ import annotations

import io
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import make_imagenet_like as imagenet_like  # noqa: E402
from bench_jpeg_input import BATCH, accel_train_arm, timed_round  # noqa: E402
from accel_train.data.streaming.max_side import within_max_side  # noqa: E402

CAMERA = (4032, 3024)  # a 12-megapixel phone photo


def camera_photo(seed: int, index: int, size: tuple[int, int]) -> bytes:
    scene = imagenet_like.render(seed, index % 2, "train", index).resize(size,
                                                                         Image.Resampling.BICUBIC)
    grain = np.random.default_rng([seed, index]).normal(0, 3.5, (size[1], size[0], 1))
    pixels = (np.asarray(scene, dtype=np.float32) + grain).clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


def main() -> None:
    parser = benchlib.make_parser(__doc__, data_dir=None)
    parser.add_argument("--photos", type=int, default=None, help="camera photos to make")
    parser.add_argument("--max-side", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--camera-size", type=int, nargs=2, default=CAMERA,
                        metavar=("WIDTH", "HEIGHT"), help="the photos' size (default: 4032 3024)")
    args = parser.parse_args()
    count = max(BATCH, args.photos or (BATCH if args.quick else 64))
    rounds = args.rounds or (2 if args.quick else 4)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # torchvision.io's deprecation in favour of TorchCodec
    with tempfile.TemporaryDirectory(prefix="max_side_") as tmp:
        folders = {"as taken": Path(tmp) / "camera", "stored": Path(tmp) / "stored"}
        storing, sizes = [], {name: [] for name in folders}
        for index in range(count):
            data = camera_photo(0, index, tuple(args.camera_size))
            started = time.process_time()
            smaller, _, _ = within_max_side(data, "jpg", args.max_side)
            storing.append(time.process_time() - started)
            for name, blob in (("as taken", data), ("stored", smaller)):
                label = imagenet_like.class_name(index % 2)
                path = folders[name] / "train" / label / f"{index}.jpg"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(blob)
                sizes[name].append(len(blob))
                if index < 2:  # a val/ folder, so that the training split is every train/ file
                    held_out = folders[name] / "val" / path.parent.name / path.name
                    held_out.parent.mkdir(parents=True)
                    held_out.write_bytes(blob)
        arms = {name: accel_train_arm(folder) for name, folder in folders.items()}
        for run in arms.values():  # warm-up: imports, the page cache
            run()
        results = {name: [] for name in arms}
        for order in benchlib.round_orders(list(arms), rounds):
            for name in order:
                results[name].append(timed_round(arms[name]))
        report = benchlib.Report("max_side", "Camera photos as taken and as shard --max-side "
                                 "stores them", args)
        base = [count / cpu for count, cpu, _ in results["as taken"]]
        rows = []
        for name, runs in results.items():
            per_core = [images / cpu for images, cpu, _ in runs]
            ratios = [rate / ref for rate, ref in zip(per_core, base)]
            width, height = Image.open(next(folders[name].rglob("*.jpg"))).size
            rows.append([f"{name} ({width}x{height}, {np.mean(sizes[name]) / 1e6:.2f} MB)",
                         benchlib.median(per_core), 1000 / benchlib.median(per_core),
                         benchlib.median(ratios), benchlib.spread(ratios)])
        report.table(f"Training input path per core, {count} photos x {rounds} rounds, "
                     f"--max-side {args.max_side}",
                     ["files", "img/s per core", "ms/image", "vs as taken", "range"], rows,
                     notes=[f"storing (once, shard's work a file): "
                            f"{1000 * benchlib.median(storing):.0f} ms a photo (median)",
                            "the loader path: decode, timm's training crop to 224 px, flip, "
                            "colour jitter 0.4 (bench_jpeg_input.py's accel_train arm)"])
        report.save()


if __name__ == "__main__":
    main()
