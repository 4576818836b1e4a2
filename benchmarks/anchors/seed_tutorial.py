"""The seed tutorial's three training scripts ("Getting Started with PyTorch Distributed":
standalone, nn.DataParallel, DistributedDataParallel), kept as plain loops: the anchors the
benchmarks measure accel_train against.

Changed from the article only where this machine or a fair comparison needs it:
  * CPU and gloo instead of cuda:LOCAL_RANK and nccl (no GPU here); with CUDA it uses them;
  * the shared CIFAR-10 parquet instead of torchvision's download (the same JPEG bytes);
  * settings on the command line (the article hard-codes resnet50d, 336 px, Adam 0.01, batch
    64/224/256, 5 epochs, 48 workers), so that a benchmark can match accel_train's exactly;
  * `--data memory`: images decoded once into a uint8 tensor (TensorDataset) and normalized per
    batch, to compare with accel_train's in-memory data; `--data decode` is the article's way
    (PIL + ToTensor [+ Resize] per sample, in DataLoader workers);
  * optional gradient accumulation (the hand-written way: `model.no_sync()` on all but the last
    micro-batch), channels_last and the DDP bucket size, for the same reason;
  * timing: img/s per window of --log-every optimizer steps, as accel_train's metrics.jsonl
    has it, plus epoch times as the article prints them; one JSON line at the end.

    python benchmarks/anchors/seed_tutorial.py --mode standalone --epochs 1
    python benchmarks/anchors/seed_tutorial.py --mode dataparallel --epochs 1
    torchrun --nproc-per-node 2 benchmarks/anchors/seed_tutorial.py --mode ddp --epochs 1
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = 10


class ParquetCIFAR10(Dataset):
    """torchvision.datasets.CIFAR10's role, over the shared parquet: PIL image -> transform."""

    def __init__(self, path: str, transform, limit=None):
        import pyarrow.parquet as pq
        table = pq.read_table(path)
        self.blobs = table.column("img").combine_chunks().field("bytes").to_pylist()[:limit]
        self.labels = table.column("label").to_pylist()[:limit]
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        from PIL import Image
        image = Image.open(io.BytesIO(self.blobs[index])).convert("RGB")
        return self.transform(image), self.labels[index]


def in_memory(path: str, limit=None):
    """Decode once: uint8 [N, 3, 32, 32] and labels, plus per-channel mean/std for normalizing."""
    from torchvision.io import ImageReadMode, decode_jpeg
    import pyarrow.parquet as pq
    table = pq.read_table(path)
    blobs = table.column("img").combine_chunks().field("bytes").to_pylist()[:limit]
    images = torch.stack(decode_jpeg([torch.frombuffer(bytearray(b), dtype=torch.uint8)
                                      for b in blobs], mode=ImageReadMode.RGB))
    labels = torch.tensor(table.column("label").to_pylist()[:limit])
    pixels = images[:5000].float().div_(255)
    return images, labels, pixels.mean(dim=(0, 2, 3)), pixels.std(dim=(0, 2, 3))


@torch.no_grad()
def evaluate(model, args, mean, std, device) -> float:
    """Top-1 on the test split, through the same data path as training (not in the article)."""
    test_file = os.path.join(args.data_dir, "test.parquet")
    if args.data == "memory":
        images, labels, _, _ = in_memory(test_file, args.max_eval_samples)
        data = TensorDataset(images, labels)
    else:
        from torchvision import transforms
        steps = [transforms.ToTensor()]
        if args.image_size:
            steps.append(transforms.Resize((args.image_size, args.image_size)))
        data = ParquetCIFAR10(test_file, transforms.Compose(steps), args.max_eval_samples)
    loader = DataLoader(data, batch_size=256, num_workers=args.workers if args.data == "decode"
                        else 0)
    module = model.module if hasattr(model, "module") else model
    module.eval()
    correct = total = 0
    for features, labels in loader:
        features, labels = features.to(device), labels.to(device)
        if mean is not None:
            features = (features.float() / 255 - mean) / std
        correct += int((module(features).argmax(dim=1) == labels).sum())
        total += len(labels)
    return correct / total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("standalone", "dataparallel", "ddp"), default="ddp")
    parser.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "..",
                                                           "..", "shared", "data", "cifar10"))
    parser.add_argument("--data", choices=("memory", "decode"), default="memory")
    parser.add_argument("--model", default="resnet50d")
    parser.add_argument("--image-size", type=int, default=None, help="Resize (the article: 336)")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--max-train-samples", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--progress", action="store_true", help="tqdm bars, as the article")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="stop training after this many seconds of training loop")
    parser.add_argument("--eval", action="store_true",
                        help="after training, top-1 on test.parquet (not in the article)")
    parser.add_argument("--max-eval-samples", type=int, default=None)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if args.mode == "ddp":
        dist.init_process_group("nccl" if cuda else "gloo")
        local_rank = int(os.environ["LOCAL_RANK"])
        global_rank = int(os.environ["RANK"])
        world_size = dist.get_world_size()
    else:
        local_rank = global_rank = 0
        world_size = 1
    if cuda and args.mode == "ddp":
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")

    train_file = os.path.join(args.data_dir, "train.parquet")
    mean = std = None
    if args.data == "memory":
        images, labels, mean, std = in_memory(train_file, args.max_train_samples)
        data = TensorDataset(images, labels)
    else:
        from torchvision import transforms
        steps = [transforms.ToTensor()]
        if args.image_size:
            steps.append(transforms.Resize((args.image_size, args.image_size)))
        data = ParquetCIFAR10(train_file, transforms.Compose(steps), args.max_train_samples)

    if args.mode == "ddp":
        sampler = DistributedSampler(data)
        data_loader = DataLoader(data, batch_size=args.batch_size, shuffle=False, sampler=sampler,
                                 num_workers=args.workers if args.data == "decode" else 0,
                                 drop_last=True)
    else:
        sampler = None
        data_loader = DataLoader(data, batch_size=args.batch_size, shuffle=True,
                                 num_workers=args.workers if args.data == "decode" else 0,
                                 drop_last=True)

    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False, num_classes=CLASSES)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    dataparallel_note = None
    if args.mode == "dataparallel":
        device_ids = [i for i in range(torch.cuda.device_count())]
        model = nn.DataParallel(model, device_ids=device_ids)
        if len(device_ids) <= 1:
            dataparallel_note = (f"nn.DataParallel with {len(device_ids)} GPU(s) runs the module "
                                 f"directly: it is the standalone loop")
    model = model.to(device)
    if args.mode == "ddp":
        model = DDP(model, device_ids=[local_rank] if cuda else None,
                    bucket_cap_mb=args.bucket_mb)

    loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    if args.optimizer == "adam":
        optimizer = optim.Adam(model.parameters(), lr=args.lr)
    else:
        optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                              weight_decay=5e-4)
    if mean is not None:
        mean, std = mean.view(1, 3, 1, 1).to(device), std.view(1, 3, 1, 1).to(device)

    windows, epoch_times, step = [], [], 0
    samples_per_step = args.batch_size * world_size * args.accumulation_steps
    start = time.perf_counter()
    window_start, done = time.perf_counter(), False
    for epoch in range(args.epochs):
        epoch_start_time = time.perf_counter()
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        batches = data_loader
        if args.progress and global_rank == 0:
            from tqdm import tqdm
            batches = tqdm(data_loader, total=len(data_loader))
        for micro, batch in enumerate(batches):
            features, labels = batch[0].to(device), batch[1].to(device)
            if mean is not None:
                features = (features.float() / 255 - mean) / std
            if args.channels_last:
                features = features.contiguous(memory_format=torch.channels_last)
            last_micro = (micro + 1) % args.accumulation_steps == 0
            if args.mode == "ddp" and not last_micro:
                with model.no_sync():
                    loss_fn(model(features), labels).div(args.accumulation_steps).backward()
                continue
            preds = model(features)
            loss = loss_fn(preds, labels)
            (loss / args.accumulation_steps if args.accumulation_steps > 1 else loss).backward()
            if not last_micro:
                continue
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.log_every == 0:
                now = time.perf_counter()
                windows.append(samples_per_step * args.log_every / (now - window_start))
                window_start = now
            if args.max_steps and step >= args.max_steps:
                done = True
                break
            if args.time_budget and time.perf_counter() - start >= args.time_budget:
                done = True
                break
        epoch_end_time = time.perf_counter()
        epoch_times.append(epoch_end_time - epoch_start_time)
        if global_rank == 0:
            print(f"Epoch {epoch+1} Time", epoch_end_time - epoch_start_time, flush=True)
        if done:
            break
    end = time.perf_counter()
    top1 = None
    if args.eval and global_rank == 0:
        top1 = evaluate(model, args, mean, std, device)
    if global_rank == 0:
        print("Training Took", end - start, flush=True)
        print(json.dumps({"bench": "seed_tutorial", "mode": args.mode, "world_size": world_size,
                          "steps": step, "img_per_s_windows": windows,
                          "epoch_times": epoch_times, "total_s": end - start,
                          "samples": step * samples_per_step, "top1": top1,
                          "eval_s": time.perf_counter() - end,
                          "threads": torch.get_num_threads(), "note": dataparallel_note}),
              flush=True)
    if args.mode == "ddp":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
