"""CPU threads: training throughput with one thread per core (PyTorch's default), with the
OpenMP threads told to sleep instead of spin while they wait (OMP_WAIT_POLICY=PASSIVE), and with
one thread, on a quiet machine and with one core kept busy by another process.

Why: on the shared two-core machine these benchmarks were written on, runs with torch's default
two threads were at times 5-20x slower than the same runs minutes later, while one-thread runs
only slowed in proportion to the load.  OpenMP threads meet at a barrier after every parallel
operation; when another process holds one core, the spinning thread burns its time slice waiting
for the descheduled one.  This script makes that reproducible: the "busy" column runs a plain
Python busy loop on the side for the duration of each measurement (it is stopped right after).

Each cell is a child process (OpenMP reads its settings at start-up) running --steps training
steps of --model at batch 64 on 32 px images after two warm-up steps; settings alternate over
--rounds rounds; the table gives the median img/s and the ratio to the default setting measured
in the same condition.

    python benchmarks/bench_threads.py --quick
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

SETTINGS = {
    "default (threads = cores, OpenMP spins)": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
}
CHILD = r"""
import json, sys, time, torch, timm
model = timm.create_model(sys.argv[1], num_classes=10)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
def step():
    torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step(); opt.zero_grad()
for _ in range(2): step()
print("ready", flush=True); sys.stdin.readline()
t = time.perf_counter()
for _ in range(int(sys.argv[2])): step()
rate = 64 * int(sys.argv[2]) / (time.perf_counter() - t)
print(json.dumps({"bench": "threads", "img_per_s": rate, "threads": torch.get_num_threads()}),
      flush=True)
"""
BUSY = "import time\nwhile True:\n    pass\n"


def measure(setting: dict, busy: bool, args) -> dict:
    env = benchlib.child_env()
    env.pop("OMP_NUM_THREADS", None)
    env.pop("OMP_WAIT_POLICY", None)
    env.update(setting)
    child = subprocess.Popen([sys.executable, "-c", CHILD, args.model, str(args.steps)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"  # imports and warm-up done
    hog = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        time.sleep(0.2 if busy else 0)
        child.stdin.write("go\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=args.timeout)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return benchlib.last_json_line(out)


def main() -> int:
    parser = benchlib.make_parser(__doc__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--conditions", nargs="*", default=["quiet", "busy"],
                        choices=["quiet", "busy"])
    args = parser.parse_args()
    args.steps = args.steps or (4 if args.quick else 10)
    args.rounds = args.rounds or (1 if args.quick else 3)
    report = benchlib.Report("threads", "CPU threads: default vs passive OpenMP waits vs one "
                             "thread, quiet and with one core busy", args)
    names = list(SETTINGS)
    rows, data = [], {}
    for condition in args.conditions:
        rates: dict[str, list[float]] = {name: [] for name in names}
        for order in benchlib.round_orders(names, args.rounds):
            for name in order:
                rates[name].append(measure(SETTINGS[name], condition == "busy",
                                           args)["img_per_s"])
        base = rates[names[0]]
        for name in names:
            ratios = [r / b for r, b in zip(rates[name], base)]
            rows.append([condition, name, benchlib.median(rates[name]), benchlib.median(ratios),
                         benchlib.spread(ratios)])
        data[condition] = rates
    report.table(f"{args.model} training, batch 64, 32 px, {args.steps} steps x {args.rounds} "
                 f"round(s) ({os.cpu_count()} cores)",
                 ["condition", "setting", "img/s (median)", "vs default, same round",
                  "range"], rows,
                 notes=["busy: a pure-Python busy loop runs beside the measurement (one core's "
                        "worth of other work, as on a shared machine); it is killed after it",
                        "the load average printed with this table includes the machine's other "
                        "users: 'quiet' is only as quiet as they were"])
    report.data["result"] = data
    print(f"wrote {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
