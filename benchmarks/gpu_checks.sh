#!/usr/bin/env bash
# The checks to run on a machine with one CUDA GPU, in order of what they are for, each under its own
# time limit so that one that hangs leaves time for the rest (8.9 minutes at most; the first
# five took 6.6 on an H200):
#   1. bench_gpu_jpeg.py: ResNet-50 at 224 px, bf16, from a folder of ImageNet-sized JPEGs it
#      makes (make_imagenet_like.py, 6,400 files), against the same model trained by hand on a
#      batch already on the GPU: --decode-on-device auto (its row names the share of each batch
#      it left to the workers and the img/s it predicted), never (the loader workers decode),
#      always (nvJPEG on the GPU) and always with --host-decode-share 0.4 (the workers decode
#      40% of each batch), each decoding every epoch (--data-on-device never), and held
#      (--data-on-device always: the photos decoded once on the GPU, each batch cropped there),
#      img/s, data wait and MFU, the pixels of both paths, and one
#      batch through the device path alone (decode_jpeg by itself, then with the crops, and the
#      crops' resize batched against torchvision's crop by crop); then 6 steps of the always
#      arm under torch.profiler: the GPU's busy share, whether the side stream's decoding
#      overlaps the step, the longest kernels and host operators (trace-always.json.gz);
#   2. bench_anchor_side_by_side.py, eager: airbench94's own loop (anchors/airbench_gpu.py) for
#      10 epochs, then recipes/cifar10-gpu-airbench.yaml for 14 epochs at airbench's warmup
#      share with the data set held on the GPU: the CLI's time to the anchor's 10-epoch
#      accuracy and the ratio.  Eager, because compiling costs the CLI's first epoch about 20 s
#      against the anchor's 3 s of training (its compiled epochs already match the anchor's;
#      BENCHMARKS.md, "GPU");
#   3. bench_device_resident.py: the training batches drawn on the device (--data-on-device
#      always) against the DataLoader path, steps/s of a plain loop over each and whether it
#      synchronizes every step, without and with --reprob 0.25;
#   4. bench_step_syncs.py: the trainer's own loop (the airbench recipe, fp16 by auto, the data
#      on the device): whether the host runs ahead of the GPU step after step, and the CUDA
#      runtime's synchronizing calls in a few profiled steps;
#   5. bench_fp16_networks.py: torchvision's GoogLeNet and ResNet-18, 30 steps each in fp16 (the
#      GradScaler and fused SGD) and in bf16: whether fp16 trains (GoogLeNet once gave a NaN
#      loss from its first steps there) and the runs' losses.
#   6. the tests that need a GPU (a CUDA parameter or a skip without one): the batched colour
#      jitter against torchvision's on CUDA tensors, batches decoded ahead on a side stream
#      against those decoded in line, a module already on the GPU trained there, the crops
#      gathered and resized on CUDA against the same on the CPU, the loader workers' share of
#      the crops jittered on CUDA against torchvision's and pinned by the pin-memory thread,
#      the crops' flips on CUDA against numpy's, photos held on the GPU against the device
#      decode path's batches, a run's evaluations from uint8 batches normalized on the GPU
#      against `accel-train eval`'s, every pixel level normalized on CUDA against numpy's
#      division.
# Left out to stay under 9 minutes, each measured before (BENCHMARKS.md, "GPU"):
# a smoke run, bench_gpu_cifar.py (ResNet-9 to 94%, SIGTERM + resume), bench_gpu.py (the step
# against a hand loop on in-memory images), the longer runs toward 94%, the side by side with
# --compile.
# nvidia-smi dmon logs the GPU's utilization each second throughout (dmon.log).
# Results (markdown + JSON) and the runs' logs go to OUT; with PACK_TO=FILE.tar.gz they are also
# packed into that one file after each step (for a machine that sends back only a few files).
# A machine without Hugging Face `datasets` needs it (and dill, multiprocess, fsspec) on
# PYTHONPATH first.
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
# the cores the loader workers share: the --decode-on-device auto rule counts them
lscpu | grep -E '^(Model name|Thread|Core|Socket)'
"$python" -c "import torch, accelerate, timm, datasets; print('torch', torch.__version__, \
'accelerate', accelerate.__version__, 'timm', timm.__version__, 'datasets', datasets.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
nvidia-smi dmon -s u -d 1 -o T >"$out/dmon.log" 2>&1 &
dmon=$!
pack() { [ -z "${PACK_TO:-}" ] || tar czf "$PACK_TO" -C "$out" .; }
trap 'kill $dmon 2>/dev/null; pack' EXIT
stamp() { pack; echo "== $(date +%T) $*"; }
work=$(mktemp -d)
stamp bench_gpu_jpeg
timeout 220 "$python" benchmarks/bench_gpu_jpeg.py --out "$out" --profile-steps 6
echo "bench_gpu_jpeg exit $?"
stamp bench_anchor_side_by_side
timeout 90 "$python" benchmarks/bench_anchor_side_by_side.py --data-dir "$data_dir" --out "$out" \
    --tmp "$work/anchor" --cli-epochs 14
echo "bench_anchor_side_by_side exit $?"
stamp bench_device_resident
timeout 50 "$python" benchmarks/bench_device_resident.py --data-dir "$data_dir" --out "$out" \
    --steps 100 --reprob 0 0.25
echo "bench_device_resident exit $?"
stamp bench_step_syncs
timeout 35 "$python" benchmarks/bench_step_syncs.py --data-dir "$data_dir" --out "$out" \
    --tmp "$work/step_syncs"
echo "bench_step_syncs exit $?"
stamp bench_fp16_networks
timeout 95 "$python" benchmarks/bench_fp16_networks.py --data-dir "$data_dir" --out "$out" \
    --arm-timeout 40 --total-timeout 90
echo "bench_fp16_networks exit $?"
stamp the tests that need a GPU
# (-v: each test's name and outcome as it ends, so that a step cut by its limit still says
# which ran)
timeout 45 "$python" -m pytest -v -p no:cacheprovider -n 0 tests/test_decode_ahead.py \
    tests/test_device_decode.py tests/test_api.py tests/test_batched_resize.py \
    tests/test_host_decode_share.py tests/test_photos_on_device.py tests/test_held_out_kept.py \
    -k "cuda or on_the_gpu" 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|SKIPPED|^E |passed|failed|skipped|error" | tail -60
echo "tests exit ${PIPESTATUS[0]}"
stamp done
