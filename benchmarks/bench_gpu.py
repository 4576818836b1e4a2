r"""GPU: img/s and model FLOP utilisation (MFU) for ResNet-50 at 224 px and the seed article's
336 px, in fp16 and bf16, accel_train against the same loop written by hand.

Arms, per (image size, precision), alternating in rounds:
  hand loop            ResNet-50 (timm) in --layout's memory format (channels_last unless
                       asked), torch.autocast, GradScaler for fp16,
                       SGD + Nesterov (fused on CUDA, as the trainer's), on a batch already
                       on the GPU
  accel_train step     Trainer.train_step inside accelerator.accumulate (Accelerate's autocast,
                       its GradScaler for fp16, its optimizer wrapper), on the same GPU batch
  accel_train loop     Trainer.train_epoch: the whole loop with its input pipeline (embedded
                       in-memory images, resized to the size on the device on a GPU),
                       with the data_wait it reports: what the CPU side can feed
MFU = (model FLOPs per image for forward + backward, counted by torch's FlopCounterMode) x img/s
/ the GPU's dense peak for that precision (a table of known GPUs, or --peak-tflops).

Run on one NVIDIA H200 (BENCHMARKS.md, "GPU: one NVIDIA H200").  `--allow-cpu` runs the same
code on the CPU with a tiny model so that tests keep it working.

    python benchmarks/bench_gpu.py                      # on a machine with CUDA
    python benchmarks/bench_gpu.py --allow-cpu --quick --model test_resnet --sizes 32 \
        --precisions bf16
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

# Every arm in the same layout: the hand loop's model and images, and the trainer's
# --channels-last / --no-channels-last.
MEMORY_FORMATS = {"channels_last": torch.channels_last, "nchw": torch.contiguous_format}
# Dense (no sparsity) tensor-core peaks in TFLOP/s for fp16/bf16, from the vendors' data sheets.
PEAK_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0,
               "H100 NVL": 835.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0,
               "V100": 125.0, "RTX 4090": 165.2, "RTX 3090": 71.0}


def peak_tflops(name: str, override) -> float:
    if override:
        return override
    for key, value in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if key.lower() in name.lower():
            return value
    return float("nan")


def flops_per_image(model_name: str, size: int, device) -> float:
    """Forward + backward FLOPs of one image (FlopCounterMode counts matmuls and convolutions)."""
    import timm
    from torch.utils.flop_counter import FlopCounterMode
    model = timm.create_model(model_name, num_classes=10).to(device)
    x = torch.randn(2, 3, size, size, device=device)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops() / 2


class HandLoop:
    def __init__(self, model_name, batch, labels, precision, device, memory_format):
        import timm
        torch.manual_seed(0)
        self.model = timm.create_model(model_name, num_classes=10).to(device)
        self.model = self.model.to(memory_format=memory_format)
        # fused on CUDA, as the trainer's optimizer is there: the same loop, written by hand
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9,
                                         nesterov=True, weight_decay=5e-4,
                                         fused=device.type == "cuda")
        self.loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
        self.dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.batch, self.labels, self.device = batch, labels, device

    def run(self, steps: int) -> None:
        self.model.train()
        for _ in range(steps):
            with torch.autocast(self.device.type, dtype=self.dtype):
                loss = self.loss_fn(self.model(self.batch), self.labels)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)


def make_trainer(args, size: int, precision: str, batch: int, work: Path):
    from accel_train.config import TrainConfig
    from accel_train.trainer import Trainer
    config = TrainConfig(dataset="synthetic", synthetic_train_size=batch * args.steps,
                         max_eval_samples=batch, model=args.model, image_size=size,
                         batch_size=batch, epochs=1_000_000, mixed_precision=precision,
                         channels_last=args.layout == "channels_last", progress="log",
                         plots=False, log_every=args.steps,
                         output_dir=str(work / f"{size}-{precision}-{time.time_ns()}"))
    trainer = Trainer.from_config(config)
    trainer.progress.enabled = False  # quiet: the benchmark prints its own
    return trainer


def measure(args, size: int, precision: str, device, work: Path) -> dict:
    batch = args.batch or (128 if size <= 224 else 64)
    memory_format = MEMORY_FORMATS[args.layout]
    images = torch.randn(batch, 3, size, size, device=device).contiguous(
        memory_format=memory_format)
    labels = torch.randint(0, 10, (batch,), device=device)
    hand = HandLoop(args.model, images, labels, precision, device, memory_format)
    trainer = make_trainer(args, size, precision, batch, work)

    def step_block():
        for _ in range(args.steps):
            with trainer.accelerator.accumulate(trainer.model):
                trainer.train_step(images, labels)

    def loop_block():
        trainer.train_epoch()
        trainer.next_epoch()  # the loader too: without it the next epoch would be empty

    def synced(fn):
        def run():
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        return run

    blocks = {"hand loop": synced(lambda: hand.run(args.steps)),
              "accel_train step": synced(step_block), "accel_train loop": synced(loop_block)}
    for block in blocks.values():
        block()
    seconds = {name: [] for name in blocks}
    for order in benchlib.round_orders(list(blocks), args.rounds):
        for name in order:
            seconds[name].append(benchlib.timed(blocks[name]))
    # Each loop block must have trained a whole epoch (args.steps steps): a block that trained
    # nothing would report an impossible speed.
    loop_steps = args.steps * (args.rounds + 1)
    if trainer.state.step != loop_steps:
        raise RuntimeError(f"the accel_train loop arm trained {trainer.state.step} steps, not "
                           f"{loop_steps}")
    metrics_path = trainer.plan.output_dir / "metrics.jsonl"
    records = [r for r in benchlib.read_jsonl(metrics_path)
               if r.get("type") == "train"] if metrics_path.exists() else []
    trainer.close()
    # Accelerate keeps one state (one mixed precision) per process; the next arm is a new run
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    rate = {name: batch * args.steps / benchlib.median(s) for name, s in seconds.items()}
    ratio = {name: benchlib.median([h / a for h, a in zip(seconds["hand loop"], s)])
             for name, s in seconds.items()}
    return {"batch": batch, "img_per_s": rate, "ratio": ratio,
            "data_wait": records[-1]["data_wait"] if records else float("nan")}


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--sizes", type=int, nargs="*", default=[224, 336])
    parser.add_argument("--precisions", nargs="*", default=["bf16", "fp16"],
                        choices=["bf16", "fp16"])
    parser.add_argument("--batch", type=int, default=None,
                        help="per step (default: 128 at 224 px, 64 at 336 px)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--layout", choices=sorted(MEMORY_FORMATS), default="channels_last",
                        help="the memory format of every arm (images and model)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU (to test this script, not to measure)")
    args = parser.parse_args()
    args.steps = args.steps or (10 if args.quick else 50)
    args.rounds = args.rounds or (2 if args.quick else 5)
    cuda = torch.cuda.is_available()
    report = benchlib.Report("gpu", f"GPU: {args.model} img/s and MFU, accel_train vs a "
                             f"hand-written loop", args)
    if not cuda and not args.allow_cpu:
        report.note("Not run: this machine has no CUDA device. Run it where `torch.cuda."
                    "is_available()` (e.g. with the device tool) to fill this section.")
        report.save()
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    # (on a CPU, --allow-cpu's self-test: accel_train trains an fp16 request in fp32 and says
    # so; the point there is that several precisions run in one process, as on a GPU)
    # No cuDNN or TF32 settings of its own: the trainer sets them (precision.use_fast_cuda_math)
    # when it is built, process-wide, so every arm below runs as the product ships.
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    peak = peak_tflops(name, args.peak_tflops)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    rows, data = [], []
    for size in args.sizes:
        flops = flops_per_image(args.model, size, device)
        for precision in args.precisions:
            result = measure(args, size, precision, device, work)
            result.update(size=size, precision=precision, flops_per_image=flops)
            data.append(result)
            for arm, rate in result["img_per_s"].items():
                achieved = flops * rate / 1e12
                wait = f"{result['data_wait']:.1%}" if arm == "accel_train loop" else ""
                rows.append([f"{size} px", precision, result["batch"], arm, rate,
                             result["ratio"][arm], achieved, achieved / peak, wait])
    report.table(f"{args.model} on {name} (peak {peak} TFLOP/s dense fp16/bf16), {args.layout}, "
                 f"{args.steps} steps x {args.rounds} rounds",
                 ["size", "precision", "batch", "arm", "img/s", "ratio to hand loop",
                  "TFLOP/s", "MFU", "data_wait"], rows,
                 notes=["FLOPs per image (forward + backward): " + ", ".join(
                     f"{d['size']} px {d['flops_per_image'] / 1e9:.3g} GFLOP" for d in data
                     if d["precision"] == args.precisions[0]),
                        "accel_train loop: includes the CPU input pipeline (resize + augment of "
                        "in-memory images); its data_wait says how much of the step it costs"])
    report.data["result"] = data
    print(f"wrote {report.save()}")
    shutil.rmtree(work, ignore_errors=True)  # the runs' folders: scratch, nothing read after
    return 0


if __name__ == "__main__":
    sys.exit(main())
