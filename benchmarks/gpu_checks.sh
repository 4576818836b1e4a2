#!/usr/bin/env bash
# The checks a session with one CUDA GPU runs, in order of what a failure would block, each under
# its own time limit so that one that hangs leaves time for the rest:
#   1. a one-minute smoke run on the embedded data (stops everything if CUDA training fails);
#   2. bench_gpu_cifar.py: CIFAR-10 time to 94% with recipes/cifar10-gpu.yaml and --compile
#      (fp16 by auto), then SIGTERM + --resume auto;
#   3. bench_gpu.py --quick: ResNet-50 img/s and MFU, fp16 and bf16, against a hand loop.
# Results (markdown + JSON) and the runs' logs go to OUT.
#
#   bash benchmarks/gpu_checks.sh DATA_DIR OUT
set -u
data_dir=${1:?CIFAR-10 parquet folder}
out=${2:?folder for the results}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$python" -c "import torch, accelerate, timm, datasets; print('torch', torch.__version__, \
'accelerate', accelerate.__version__, 'timm', timm.__version__, 'datasets', datasets.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
work=$(mktemp -d)
timeout 120 "$python" -m accel_train --dataset synthetic --epochs 1 --max-steps 30 \
    --progress log --no-plots --output-dir "$work/smoke" 2>&1 | tail -n 12
status=${PIPESTATUS[0]}
[ "$status" = 0 ] || { echo "smoke run failed (exit $status): stopping"; exit 1; }
timeout 330 "$python" benchmarks/bench_gpu_cifar.py --data-dir "$data_dir" --out "$out" \
    --work "$work/cifar"
echo "bench_gpu_cifar exit $?"
cp "$work"/cifar/*.log "$out"/ 2>/dev/null
timeout 150 "$python" benchmarks/bench_gpu.py --quick --out "$out"
echo "bench_gpu exit $?"
