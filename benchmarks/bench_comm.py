"""Communication: all-reduce against the parameter-server pattern (everyone sends its gradient
to rank 0, rank 0 sums and sends the result back), from the seed article's theory, over message
sizes from 4 KiB to the model's gradient size and world sizes 2 to 4, on gloo (nccl with GPUs).

Printed per size and world size N, with nccl-tests' definitions (S = message bytes, t = time):
  algbw = S / t;  all-reduce busbw = algbw x 2(N-1)/N;  for the parameter server, the bytes
  through rank 0's link are 2(N-1)S, so its "busbw" is algbw x 2(N-1) (what rank 0's link
  carried per second).
The cost model (K = time to send one full gradient over one link): parameter server
T = 2(N-1)K, ring all-reduce T = 2(N-1)K/N, so T_ps / T_allreduce = N; the table prints the
measured ratio beside it.  Two parameter-server variants: point-to-point (isend/irecv, the
pattern itself) and the library's reduce-to-0 + broadcast-from-0.

All ranks are processes on this machine (loopback): with more ranks than cores they also
compete for CPU, which the model does not know about.

    python benchmarks/bench_comm.py --quick
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

KIB = 1024


def gradient_bytes(model_name: str) -> int:
    import timm
    model = timm.create_model(model_name, num_classes=10)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def sizes_up_to(limit: int, quick: bool) -> list[int]:
    sizes, size = [], 4 * KIB
    step = 16 if quick else 4
    while size < limit:
        sizes.append(size)
        size *= step
    return sizes + [limit]


def _ps_p2p(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        pending = [dist.irecv(buffers[src - 1], src=src) for src in range(1, world)]
        for request in pending:
            request.wait()
        for buffer in buffers:
            tensor.add_(buffer)
        for request in [dist.isend(tensor, dst=dst) for dst in range(1, world)]:
            request.wait()
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)


def _ps_collectives(tensor: torch.Tensor, buffers) -> None:
    dist.reduce(tensor, dst=0)
    dist.broadcast(tensor, src=0)


def _allreduce(tensor: torch.Tensor, buffers) -> None:
    dist.all_reduce(tensor)


PATTERNS = {"all-reduce": _allreduce, "PS point-to-point": _ps_p2p,
            "PS reduce+broadcast": _ps_collectives}


def _time(op, tensor, buffers, min_seconds: float, min_iters: int) -> float:
    """Mean seconds per call; every rank runs the same number of iterations (rank 0 decides)."""
    for _ in range(2):
        op(tensor, buffers)
    dist.barrier()
    started = time.perf_counter()
    op(tensor, buffers)
    one = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.broadcast(one, src=0)
    iters = max(min_iters, int(min_seconds / max(float(one), 1e-6)))
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        op(tensor, buffers)
    elapsed = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time is the op's time
    return float(elapsed)


def _worker(rank: int, world: int, port: int, sizes: list[int], min_seconds: float,
            min_iters: int, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results = []
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32)
        buffers = [torch.empty_like(tensor) for _ in range(world - 1)] if rank == 0 else []
        row = {"bytes": size, "world": world}
        for name, op in PATTERNS.items():
            row[name] = _time(op, tensor, buffers, min_seconds, min_iters)
        results.append(row)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, sizes: list[int], min_seconds: float, min_iters: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, benchlib.free_port(), sizes, min_seconds, min_iters,
                                      queue), nprocs=world, join=True, start_method="spawn")
    return queue.get()


def heartbeat_cost(model_name: str, batch: int, beats: int) -> dict:
    """The trainer's per-step heartbeat (collectives.py: one set in the process group's
    TCPStore, over loopback to a store served by another thread here, as by the launcher's
    agent) against one training step of `model_name` at `batch` (32 px, fp32, SGD), both timed
    in this process, one after the other."""
    import timm

    from accel_train.run.collectives import CollectiveTimeouts

    store = dist.TCPStore("127.0.0.1", benchlib.free_port(), 1, True)
    timeouts = CollectiveTimeouts([], store, 0, 2, None)  # 2: a multi-process run beats
    for step in range(50):  # connection and allocator warm-up
        timeouts.beat(step)
    started = time.perf_counter()
    for step in range(beats):
        timeouts.beat(step)
    beat = (time.perf_counter() - started) / beats

    model = timm.create_model(model_name, num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, labels = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(8):
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
    return {"beat": beat, "step": benchlib.median(times[3:])}


def human(size: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{size} B"


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--model", default="resnet18", help="its gradient size is the largest "
                        "message")
    parser.add_argument("--worlds", type=int, nargs="*", default=None)
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="time spent per measurement")
    parser.add_argument("--max-bytes", type=int, default=None, help="override the largest size")
    parser.add_argument("--heartbeat-batch", type=int, default=64,
                        help="batch of the training step the heartbeat is compared with")
    args = parser.parse_args()
    args.worlds = args.worlds or ([2, 4] if args.quick else [2, 3, 4])
    args.min_seconds = args.min_seconds or (0.1 if args.quick else 0.5)
    grad = args.max_bytes or gradient_bytes(args.model)
    sizes = sizes_up_to(grad, args.quick)
    report = benchlib.Report("comm", "Communication: all-reduce vs parameter server (gloo)", args)
    rows, data = [], []
    for world in args.worlds:
        for row in measure(world, sizes, args.min_seconds, 3 if args.quick else 5):
            data.append(row)
            size, ar = row["bytes"], row["all-reduce"]
            p2p, coll = row["PS point-to-point"], row["PS reduce+broadcast"]
            alg = lambda t: size / t / 1e9  # noqa: E731, B023  (GB/s; called right here)
            rows.append([human(size), world, ar * 1e6, alg(ar), alg(ar) * 2 * (world - 1) / world,
                         p2p * 1e6, alg(p2p), alg(p2p) * 2 * (world - 1), coll * 1e6,
                         p2p / ar, coll / ar, float(world)])
    report.table(f"gloo on loopback, {args.model} gradient = {human(grad)} ({grad:,} bytes)",
                 ["size", "N", "all-reduce us", "algbw GB/s", "busbw GB/s", "PS p2p us",
                  "PS algbw GB/s", "PS busbw GB/s", "PS reduce+bcast us", "PS p2p / AR",
                  "PS r+b / AR", "model ratio N"], rows,
                 notes=["time = mean per call of the slowest rank; each rank is one process with "
                        "one thread", "model ratio: 2(N-1)K / (2(N-1)K/N) = N; it holds for "
                        "bandwidth-bound messages on links that work in parallel; small messages "
                        "are latency-bound, and loopback 'links' share one memory system and "
                        f"{os.cpu_count()} cores"])
    report.data["result"] = data
    cost = heartbeat_cost(args.model, args.heartbeat_batch, 200 if args.quick else 2000)
    report.table(f"The heartbeat per optimizer step vs a {args.model} step (batch "
                 f"{args.heartbeat_batch}, 32 px)",
                 ["heartbeat us", "training step ms", "heartbeat / step"],
                 [[cost["beat"] * 1e6, cost["step"] * 1e3, f"{cost['beat'] / cost['step']:.3%}"]],
                 notes=["heartbeat: collectives.CollectiveTimeouts.beat, one TCPStore set over "
                        "loopback (the mean of the calls); step: forward, backward and SGD, the "
                        "median of 5 after 3 warm-up"])
    report.data["heartbeat"] = cost
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
