#!/usr/bin/env bash
# The checks a session with one CUDA GPU runs, in order of what a failure would block, each under
# its own time limit so that one that hangs leaves time for the rest:
#   1. a short smoke run on the embedded data (stops everything if CUDA training fails);
#   2. bench_gpu_cifar.py: CIFAR-10 time to 94% with recipes/cifar10-gpu.yaml and --compile
#      (fp16 by auto), then SIGTERM + --resume auto;
#   2b. bench_device_resident.py: the training batches drawn on the device (--data-on-device
#      always) against the DataLoader path, steps/s of a plain loop over each and whether it
#      synchronizes every step, without and with --reprob 0.25 (CIFAR-10 decoded once);
#   3. bench_gpu.py --quick: ResNet-50 img/s and MFU, fp16 and bf16, against a hand loop (every
#      arm channels_last; the NCHW and 336 px tables of earlier sessions are in BENCHMARKS.md and
#      left out to keep the whole under 9 minutes: `bench_gpu.py --layout nchw`, `--sizes 336`);
#   4. a longer run toward 94%: the ResNet-9 recipe for 100 epochs with --reprob 0.25 (93.13% on
#      an H200 without more) and an average of the weights (--model-ema, decay 0.999: a time
#      constant of about 10 of its epochs), evaluated with and without the average.
# nvidia-smi dmon logs the GPU's utilization each second throughout (dmon.log).
# Results (markdown + JSON) and the runs' logs go to OUT; with PACK_TO=FILE.tar.gz they are also
# packed into that one file after each step (for a machine that sends back only a few files).
#
#   bash benchmarks/gpu_checks.sh DATA_DIR OUT
set -u
data_dir=${1:?CIFAR-10 parquet folder}
out=${2:?folder for the results}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc
"$python" -c "import torch, accelerate, timm, datasets; print('torch', torch.__version__, \
'accelerate', accelerate.__version__, 'timm', timm.__version__, 'datasets', datasets.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
nvidia-smi dmon -s u -d 1 -o T >"$out/dmon.log" 2>&1 &
dmon=$!
pack() { [ -z "${PACK_TO:-}" ] || tar czf "$PACK_TO" -C "$out" .; }
trap 'kill $dmon 2>/dev/null; pack' EXIT
stamp() { pack; echo "== $(date +%T) $*"; }
work=$(mktemp -d)
stamp smoke
timeout 60 "$python" -m accel_train --dataset synthetic --epochs 1 --max-steps 30 \
    --progress log --no-plots --output-dir "$work/smoke" 2>&1 | tail -n 12
status=${PIPESTATUS[0]}
[ "$status" = 0 ] || { echo "smoke run failed (exit $status): stopping"; exit 1; }
stamp bench_gpu_cifar
timeout 210 "$python" benchmarks/bench_gpu_cifar.py --data-dir "$data_dir" --out "$out" \
    --work "$work/cifar"
echo "bench_gpu_cifar exit $?"
cp "$work"/cifar/*.log "$out"/ 2>/dev/null
stamp bench_device_resident
timeout 180 "$python" benchmarks/bench_device_resident.py --data-dir "$data_dir" --out "$out" \
    --steps 150 --reprob 0 0.25
echo "bench_device_resident exit $?"
stamp bench_gpu
timeout 140 "$python" benchmarks/bench_gpu.py --quick --out "$out"
echo "bench_gpu exit $?"
stamp longer runs
long() {  # NAME ARGS...: a CIFAR-10 run whose log lines go to OUT/NAME.log
    local name=$1; shift
    timeout "${LONG_LIMIT:-170}" "$python" -m accel_train --data-dir "$data_dir" --compile \
        --progress log --no-plots --output-dir "$work/$name" "$@" >"$out/$name.log" 2>&1
    echo "$name exit $?"
}
long resnet9-100ep-reprob-ema --config recipes/cifar10-gpu.yaml --epochs 100 --reprob 0.25 \
    --model-ema --model-ema-decay 0.999 --eval-every 10
grep -h "Epoch\|Training took\|EMA\|ema" "$out"/resnet9-100ep-reprob-ema.log | tail -n 24
stamp done
