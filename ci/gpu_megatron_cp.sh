#!/usr/bin/env bash
# Context parallelism of the megatron backend on 2 CUDA GPUs (the nvidia-h200-x2 device: NCCL, fla 0.6.0):
#   pytest -m gpu tests/parity/test_megatron_cp.py
#     fla's CP chunk_kda on the zigzag layout == fla's whole-sequence chunk_kda (outputs and input gradients), and
#     the torch state chain / conv halos / all-gathered MLA attention over NCCL == the whole-sequence torch math.
#
#   bash ci/gpu_megatron_cp.sh          (run from anywhere; the repo root is found from this file)
#
# The wheels in .whl/ (megatron-core, fla; carried to the device) are installed into /tmp/site. Everything the
# run prints goes to $OUT/gpu_megatron_cp.log (the per-check relative errors are printed by the test). Exit 0
# when the test passes; the whole script stays under 5 minutes.
set +e
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_megatron_cp}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_megatron_cp.log") 2>&1

# A step that runs over its limit gets SIGABRT: with PYTHONFAULTHANDLER every thread's Python stack is printed.
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export TRITON_CACHE_DIR=/tmp/k3-triton-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || echo "wheel install failed (exit $?)"
export PYTHONPATH="/tmp/site:$PWD"
python3 -c "import torch; print('torch', torch.__version__, '| GPUs', torch.cuda.device_count())"
timeout --signal=ABRT --kill-after=10 240 python3 -m pytest -q -s -m gpu -p no:randomly tests/parity/test_megatron_cp.py
rc=$?
echo "== gpu_megatron_cp: pytest exit $rc"
exit $rc
