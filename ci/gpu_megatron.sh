#!/usr/bin/env bash
# The megatron backend on one CUDA GPU (the H200 device: Python 3.12, torch 2.11 CUDA, no TransformerEngine):
#   1. one short `k3 train --backend megatron` loop on the tiny model, embedded engine, in one process:
#      make-checkpoint (bf16) -> convert hf-to-dist (--ref-load) -> prepare-data --task arith -> train 3 rollouts
#      -> `k3-harness check --tier smoke`
#   2. pytest -m gpu tests/parity/test_megatron_gpu.py  (megatron's own CUDA paths, without the CPU shim)
#
#   bash ci/gpu_megatron.sh            (run from anywhere; the repo root is found from this file)
#   K3_GPU_MEGATRON_TRAIN_ARGS="--expert-lora-kernel triton --lora-transfer-buffer" bash ci/gpu_megatron.sh
#                                      (extra `k3 train` flags for the loop, e.g. our opt-in paths)
#   K3_GPU_MEGATRON_SKIP_PARITY=1      (the loop and the harness only: step 2 is skipped)
#   K3_GPU_MEGATRON_NATIVE=1           (the recipe's pairing: --hf-checkpoint the native MXFP4 checkpoint, which the
#                                      engine decodes on load; --ref-load the torch_dist of its BF16 conversion)
#
# The wheels in .whl/ (megatron-core, fla; carried to the device) are installed into /tmp/site. Everything the
# run prints goes to $OUT/gpu_megatron.log; $OUT/verdict.json is the harness's verdict and $OUT/metrics.jsonl the
# run's metrics (3 files). Every step has its own timeout; the whole script stays under 10 minutes.
#
# Exit 0 when the GPU tests pass, the loop finishes, and the smoke criteria that apply at 3 rollouts pass
# (adapter version +1 per sync, memory back to baseline, the resolved-config lines); the tier's own verdict
# fails anyway (it wants >= 10 rollouts and a rising eval) and is shown as information.
set +e
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_megatron}"
mkdir -p "$OUT"
LOG="$OUT/gpu_megatron.log"
exec > >(tee "$LOG") 2>&1

# A step that runs over its limit gets SIGABRT: with PYTHONFAULTHANDLER every thread's Python stack is printed.
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 K3_IN_PROCESS=1
export TRITON_CACHE_DIR=/tmp/k3-triton-cache
# The loop and the parity tests check numbers, not speed: in cover mode a key that is not recorded takes the config
# recorded for a wider key of the same kernel, flags and dtypes (k3/kernels/kda/tuning.py), where a fresh H100
# autotuned each key of the tiny model's packed backward for ~16 s and ran out of the loop's limit; only a key
# nothing covers is autotuned. K3_FLA_PINNED_CONFIGS=strict runs k3's default instead. A key still autotuned is
# printed, so `k3 record-fla-tuning` can add it from this log.
export K3_FLA_PINNED_CONFIGS=${K3_FLA_PINNED_CONFIGS:-cover}
export TRITON_PRINT_AUTOTUNING=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WORK=/tmp/k3-gpu-megatron
rm -rf "$WORK" && mkdir -p "$WORK"
FAILED=()
T0=$(date +%s)

step() {  # step NAME TIMEOUT_S CMD...: run with a timeout, log its time and exit code
    local name=$1 limit=$2
    shift 2
    echo
    echo "== $name (timeout ${limit}s, at $(( $(date +%s) - T0 ))s)"
    echo "\$ $*"
    local t=$(date +%s)
    timeout --signal=ABRT --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc in $(( $(date +%s) - t ))s"
    [[ $rc -eq 0 ]] || FAILED+=("$name (exit $rc)")
    return $rc
}

step "install wheels" 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
python3 - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("megatron.core", "fla", "typer", "safetensors", "psutil", "rich", "transformers"):
    try:
        mod = __import__(name, fromlist=["_"])
        print(f"  {name} {getattr(mod, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 - report and go on: the steps below fail with the details
        print(f"  {name} MISSING: {type(e).__name__}: {e}")
EOF

K3="python3 -m k3"
if [[ ${K3_GPU_MEGATRON_NATIVE:-0} == 1 ]]; then
    step "make-checkpoint (tiny, mxfp4)" 25 $K3 make-checkpoint --variant tiny --format mxfp4 --out "$WORK/native" \
        --seed 0 --no-progress
    step "convert mxfp4-to-bf16" 40 $K3 convert mxfp4-to-bf16 --model-dir "$WORK/native" --save-dir "$WORK/base"
    HF_CHECKPOINT="$WORK/native"
else
    step "make-checkpoint (tiny, bf16)" 25 $K3 make-checkpoint --variant tiny --format bf16 --out "$WORK/base" \
        --seed 0 --no-progress
    HF_CHECKPOINT="$WORK/base"
fi
step "convert hf-to-dist" 40 $K3 convert hf-to-dist --hf-checkpoint "$WORK/base" --save "$WORK/dcp" --no-progress
step "prepare-data --task arith" 15 $K3 prepare-data --task arith --data-dir "$WORK/data"
RUN="$WORK/run"
# deterministic_random: the untrained tiny model solves no arith problem, a random reward still gives every
# GRPO step a gradient (and needs no math-verify, which the image lacks).
# 240 s: in strict mode, on a host where a key is not recorded in k3/kernels/kda/fla_tuned, fla autotunes it in the
# first step (the packed-sequence keys took ~80 s on the H200 before they were recorded; 180 s was too little then).
step "k3 train --backend megatron (3 rollouts)" 240 $K3 train --mode normal --model-variant tiny --task arith \
    --backend megatron --num-gpus-per-node 1 --reward-model deterministic_random --num-rollout 3 \
    --rollout-batch-size 4 --n-samples-per-prompt 4 --global-batch-size 16 --rollout-max-response-len 16 \
    --lr 1e-3 --save-interval 3 --seed 0 --hf-checkpoint "$HF_CHECKPOINT" --ref-load "$WORK/dcp" \
    --data-dir "$WORK/data" --run-dir "$RUN" ${K3_GPU_MEGATRON_TRAIN_ARGS:-}
TRAIN_RC=$?
cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null

echo
echo "== k3-harness check --tier smoke"
timeout 20 python3 -m harness.cli check "$RUN" --tier smoke --json "$OUT/verdict.json"
echo "== harness exit $? (the tier wants >= 10 rollouts: FAIL there is expected; the criteria below decide)"
timeout 20 python3 - "$OUT/verdict.json" "$RUN/metrics.jsonl" <<'EOF'
import json, sys
need = ["adapter_version_advances", "memory_returns_to_baseline", "config_expert_model_parallel_size",
        "config_lora_base_cpu_backup", "config_colocate_memory_peak_device"]
try:
    status = {r["id"]: r["status"] for r in json.load(open(sys.argv[1]))["results"]}
except Exception as e:  # noqa: BLE001
    sys.exit(f"no verdict: {e}")
bad = [f"{c}={status.get(c)}" for c in need if status.get(c) != "PASS"]
try:
    events = [json.loads(line) for line in open(sys.argv[2])]
except OSError as e:
    events = []
    bad.append(f"no metrics ({e})")
train = [e for e in events if e["event"] == "train"]
for t in train:
    print(f"  rollout {t['rollout_id']}: loss {t['train/loss']:.4f} grad_norm {t['train/grad_norm']:.3f} "
          f"entropy {t['train/entropy']:.3f} logprob |trainer-engine| {t['rollout/train_rollout_logprob_abs_diff']:.2e}")
if len(train) != 3:
    bad.append(f"{len(train)} train events (expected 3)")
print("criteria that apply at 3 rollouts:", "PASS" if not bad else "FAIL " + ", ".join(bad))
sys.exit(1 if bad else 0)
EOF
[[ $? -eq 0 ]] || FAILED+=("smoke criteria at 3 rollouts")

# After the loop (the loop's result matters most); per-test limits print the stacks of a test that runs over.
# Parity needs correct numbers, not the fastest configs: in cover mode (above) the wider slice's new shapes mostly
# compile once instead of autotuning.
# K3_GPU_MEGATRON_SKIP_PARITY=1 skips it (a lease that spends its time on the loop with other flags).
[[ ${K3_GPU_MEGATRON_SKIP_PARITY:-0} == 1 ]] || step "pytest -m gpu tests/parity/test_megatron_gpu.py" 200 \
    python3 -m pytest -v -rA -m gpu -p no:randomly -p no:cacheprovider --timeout=200 --durations=10 \
    tests/parity/test_megatron_gpu.py

echo
echo "== gpu_megatron: $(( $(date +%s) - T0 ))s; train exit $TRAIN_RC"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    printf 'FAILED: %s\n' "${FAILED[@]}"
    exit 1
fi
echo "PASS"
exit 0
