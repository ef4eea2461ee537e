#!/usr/bin/env bash
# make smoke-gpu: the recipe's memory dance on one CUDA GPU, at the 4layer variant's real width.
#
# The first four layers of Kimi-K3 at full width (hidden 7168, vocab 163,840, KDA ×3 + MLA, a dense layer and three
# latent-MoE layers) with the routed experts cut to SMOKE_GPU_EXPERTS (default 8), as a synthetic BF16 checkpoint
# -> its torch_dist copy -> `k3 train --backend megatron` under Ray: the Megatron trainer and the embedded engine as
# two actors on the one GPU, adapters over CUDA IPC, the trainer asleep (torch_memory_saver) while the engine
# generates and the engine's weights released while the trainer trains (--colocate-memory-peak-device gpu), GRPO
# for 20 rollouts of 64 responses × 512 tokens, every actor capped at --gpu-memory-gb-per-actor of the device and
# the device itself shrunk to that budget -> `k3-harness check --tier gpu` (harness/spec/gpu.toml) and the
# HTML report. The reward is deterministic_random (a coin from the sample's hash): the model needs no skill, as in
# the recipe's 4layer smoke.
#
#   bash ci/smoke_gpu.sh                  (or `make smoke-gpu`; run from anywhere)
#
# Needs: one CUDA GPU with more than the budget + 1.5 GiB (an 80 GB H100 or a 141 GB H200; 50 GB of disk is
# plenty), a python with a CUDA torch and Triton (K3_PYTHON, else the first of python3 and .venv/bin/python whose
# torch sees CUDA), and either this repo's dependencies in that python or the wheels of
# `python3 ci/prepare_gpu_wheels.py` in .whl/ (made on a machine with internet; installed here with pip --no-index
# --no-deps into that python). Without CUDA it stops at once with one line.
#
# Sizes (the arithmetic; GiB = 2^30 bytes):
#   - the model: 5.29 B parameters without routed experts (embedding and head 2 × 1.17 B, the dense MLP, attention,
#     shared experts) + 0.099 B per routed expert (3 MoE layers × 3 matrices × 3584 × 3072). 8 experts: 5.98 B =
#     11.1 GiB in BF16 (16: 6.78 B, 12.6 GiB; the issue's 32: 8.36 B, 15.6 GiB).
#   - the inputs: the checkpoint + its torch_dist copy = 2 × 11.1 GiB = 24 GB, plus the run (its adapters: 18 MB).
#     They go in RAM (/dev/shm) when the host has room (ci/smoke_gpu_work.sh: 128 GiB hosts do), else on disk (64
#     GB on the device: 8 experts leave 40 GB free; 32 would take 33 GB and its 289 s writer time).
#   - the budget: SMOKE_GPU_MEMORY_GIB (35) of the device, the same bytes on any card (0.25 of an H200's 139.8 GiB,
#     0.44 of an H100's 79.2): the actors get --gpu-memory-gb-per-actor, each turns it into a fraction of its
#     device, and the ballast below leaves only that much (+ the contexts) free. In the gpu peak order both BF16
#     bases are on the device at two moments (the trainer wakes while the engine's weights are still on;
#     the engine's weights come back before the trainer sleeps): 2 × 11.1 = 22.3 GiB. While the trainer trains, the
#     engine holds neither weights nor cache, leaving ~21 GiB for the step (a micro-batch of 4096 tokens: its logits
#     alone, 4096 × 163,840 × 6 bytes, are 3.75 GiB). Without the dance, the trainer trains beside the engine's
#     weights and its cache (measured: 8.6 GiB of cache and graphs after rollout 0), 2 × 11.1 + 8.6 = 30.9 GiB before
#     the step's own memory. 28 GiB (0.2 of the H200) was too tight: there the trainer ran out while being built
#     once its NCCL communicators were made at start. A per-process cap cannot forbid two processes that sum: the
#     device holds only the budget because a ballast process (ci/gpu_ballast.py) takes the rest, less
#     SMOKE_GPU_CONTEXT_GIB (1.5) for the two actors' CUDA contexts.
#   - the time (one 10-minute device call; an 80 GB H100, 2026-12-05, 2429a66, the inputs in RAM): 446 s in all. The
#     setup 90 s: the checks 19 s, the checkpoint 12 s (11.97 GB, --device cuda, 8 workers: 1.48 GB/s), the
#     torch_dist copy 44 s, the data 3 s. Then `k3 train` 354 s: 58 s to the first rollout (Ray, the two loads, the
#     startup sync, the first KDA compile) and 20 cycles of 12.1-12.5 s (median 12.16: generation 4.08 s, log-probs
#     1.45 s, the training step 4.73 s over ~37k tokens, the sleep and the engine's moves 0.77 s, the sync 0.04 s).
#     With the inputs on disk the setup took ~170 s (the checkpoint 26 s, the copy 77 s), too much for one call with
#     the run: a second call on the same warm machine then reuses them from SMOKE_GPU_WORK. The training run gets
#     what is left of SMOKE_GPU_DEADLINE_S (570 s from the script's start, less 30 s for the verdict); the tier's
#     criteria say how long it may take.
#   - the latest results, and what is not yet measured: docs/PERFORMANCE.md ("GPU checks").
#
# Variables: K3_PYTHON; SMOKE_GPU_EXPERTS (8); SMOKE_GPU_MEMORY_GIB (35); SMOKE_GPU_CONTEXT_GIB (1.5);
# SMOKE_GPU_BALLAST (1; 0: no budget, each actor capped only); K3_NUM_ROLLOUT (20); SMOKE_GPU_RESPONSE_LEN (512);
# SMOKE_GPU_WORK (checkpoint, torch_dist copy, data and the run; kept and reused between runs; default
# SMOKE_GPU_RAM_DIR/k3-smoke-gpu when RAM has room, SMOKE_GPU_RAM_DIR being /dev/shm, else /tmp/k3-smoke-gpu);
# SMOKE_GPU_DEADLINE_S (570); SMOKE_GPU_PROFILE_STEP (1: the optimizer step run under torch.profiler, its summary
# copied to OUT as train_step_1_rank0.txt; what the next step leaves allocated, by holder, as
# train_step_2_memory_rank0.txt); SMOKE_GPU_NO_DANCE=1: the same run without the trainer's sleep and the engine's
# release (--no-offload-train, K3_OFFLOAD_ROLLOUT_LEVEL="", --no-lora-base-cpu-backup), to record that it runs out
# of memory under the same budget; OUT (runs/smoke-gpu): where the log, verdict.json, summary.md, report.html,
# metrics.jsonl, resolved_config.txt and the two steps' profiles go (8 files; the run itself is $SMOKE_GPU_WORK/run, or SMOKE_GPU_RUN_DIR).
#
# Exit: 0 every criterion of the gpu tier passed; 1 a criterion failed; 3 something PENDING or MISSING; 2 a
# precondition is missing (nothing was started); otherwise the failing step's exit code.
set -uo pipefail
cd "$(dirname "$0")/.."

# ------------------------------------------------------------------------------------------------ CUDA, at once
source ci/cuda_python.sh
PY="$(pick_python)"
cuda_line=$("$PY" -c '
import sys
try:
    import torch
except Exception as e:
    print(f"no torch ({type(e).__name__}: {e})"); sys.exit(1)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA device"); sys.exit(1)
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.1f} GiB, torch {torch.__version__}")
' 2>&1)
cuda_rc=$?
cuda_line=$(tail -n 1 <<<"$cuda_line")
if (( cuda_rc != 0 )); then
    if ! command -v "$PY" >/dev/null 2>&1; then cuda_line="not found"; fi
    echo "smoke-gpu: needs one CUDA GPU: $PY: ${cuda_line}$(command -v nvidia-smi >/dev/null 2>&1 || echo '; no NVIDIA driver (nvidia-smi not found)') (set K3_PYTHON to a python whose torch sees the GPU); nothing was started" >&2
    exit 2
fi

# ------------------------------------------------------------------------------------------------ settings
OUT="${OUT:-runs/smoke-gpu}"
mkdir -p "$OUT"
exec > >(tee "$OUT/smoke_gpu.log") 2>&1
T0=$(date +%s)
EXPERTS=${SMOKE_GPU_EXPERTS:-8}
BUDGET_GIB=${SMOKE_GPU_MEMORY_GIB:-35}
CONTEXT_GIB=${SMOKE_GPU_CONTEXT_GIB:-1.5}
ROLLOUTS=${K3_NUM_ROLLOUT:-20}
PROFILE_STEP=${SMOKE_GPU_PROFILE_STEP:-1}  # the second step: the first carries the compiles and autotuning
MEMORY_STEP=$((PROFILE_STEP + 1))  # what it leaves allocated: recorded on the next step (k3/rl/step_memory.py)
(( PROFILE_STEP < ROLLOUTS )) || PROFILE_STEP=$(( ROLLOUTS - 1 ))  # one optimizer step per rollout here
RESPONSE_LEN=${SMOKE_GPU_RESPONSE_LEN:-512}
# The inputs and the run: SMOKE_GPU_WORK, else in RAM when the host has room (ci/smoke_gpu_work.sh), else on disk.
source ci/smoke_gpu_work.sh
NEED_GB=$(( (5290 + 99 * EXPERTS) * 2 * 2 / 1000 + 4 ))  # 2 × the BF16 base (checkpoint + torch_dist copy) + 4 GB
if [[ -n "${SMOKE_GPU_WORK:-}" ]]; then
    WORK=$SMOKE_GPU_WORK WORK_WHY="SMOKE_GPU_WORK"
else
    RAM_DIR=${SMOKE_GPU_RAM_DIR:-/dev/shm}
    ram_free=$(df -Pk "$RAM_DIR" 2>/dev/null | awk 'NR==2 {printf "%d", $4 / 1024 / 1024}')
    avail=$(awk '/^MemAvailable:/ {printf "%d", $2 / 1024 / 1024}' /proc/meminfo 2>/dev/null)
    kept=$(du -sk "$RAM_DIR/k3-smoke-gpu" 2>/dev/null | awk '{printf "%d", $1 / 1024 / 1024}')
    IFS=$'\t' read -r WORK WORK_WHY < <(smoke_gpu_work_dir "$NEED_GB" "$RAM_DIR" "${ram_free:-0}" "${avail:-0}" \
        "${kept:-0}" /tmp/k3-smoke-gpu)
fi
DEADLINE=${SMOKE_GPU_DEADLINE_S:-570}
NO_DANCE=${SMOKE_GPU_NO_DANCE:-0}
# Not under $OUT: a device call brings back 8 files of it, and the run holds more (adapters, tensorboard, lock).
RUN=${SMOKE_GPU_RUN_DIR:-$WORK/run}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A step that runs over its limit gets SIGABRT: with PYTHONFAULTHANDLER every thread's Python stack is printed.
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/k3-triton-cache} TRITON_PRINT_AUTOTUNING=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
K3=("$PY" -m k3)
echo "smoke-gpu: $PY: $cuda_line"
echo "smoke-gpu: inputs and run in $WORK ($WORK_WHY)"
echo "smoke-gpu: 4layer width, $EXPERTS routed experts, cap $BUDGET_GIB GiB per actor, $ROLLOUTS rollouts × 64 × $RESPONSE_LEN tokens$([[ $NO_DANCE == 1 ]] && echo ', WITHOUT the dance (expected: out of memory)')"

elapsed() { echo $(( $(date +%s) - T0 )); }
step() {  # step NAME TIMEOUT_S CMD...: run with a timeout (signal STEP_SIGNAL); print its time and exit code
    local name=$1 limit=$2
    shift 2
    echo
    echo "== $name (timeout ${limit}s, at $(elapsed)s)"
    local t=$(date +%s)
    timeout --signal="${STEP_SIGNAL:-ABRT}" --kill-after=20 "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc in $(( $(date +%s) - t ))s"
    return $rc
}
fail() { echo "smoke-gpu: $1" >&2; exit "${2:-2}"; }
[[ -z "${SMOKE_GPU_MEMORY_FRACTION:-}" ]] || fail "SMOKE_GPU_MEMORY_FRACTION is gone: the budget is SMOKE_GPU_MEMORY_GIB (default 35), the same bytes on any card; nothing was started"

# ------------------------------------------------------------------------------------------------ wheels
if compgen -G ".whl/*.whl" >/dev/null; then
    step "install .whl/ into $PY" 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --find-links .whl .whl/*.whl || fail "installing the wheels of .whl/ failed (above)" 2
fi
missing=$("$PY" - <<'EOF'
import importlib
need = {"megatron.core": "megatron-core", "fla": "flash-linear-attention", "torch_memory_saver": "torch-memory-saver",
        "ray": "ray", "jsonschema": "jsonschema", "safetensors": "safetensors", "transformers": "transformers",
        "tokenizers": "tokenizers", "typer": "typer", "triton": "triton"}
out = []
for module, dist in need.items():
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - named below
        out.append(f"{dist} ({type(e).__name__})")
print(", ".join(out))
EOF
)
[[ -z "$missing" ]] || fail "$PY lacks $missing: run \`python3 ci/prepare_gpu_wheels.py\` on a machine with internet and copy .whl/ here (or pip install 'k3-lora-rl[gpu]'); nothing was started"

DANCE_FLAGS=(--offload-train)  # the trainer sleeps while the engine generates (the default, stated)
if [[ $NO_DANCE == 1 ]]; then
    DANCE_FLAGS=(--no-offload-train --no-lora-base-cpu-backup)
    export K3_OFFLOAD_ROLLOUT_LEVEL=""  # the engine releases nothing (a list flag cannot be empty on the command line)
fi

# ------------------------------------------------------------------------------------------------ inputs
mkdir -p "$WORK"
free_gb=$(df -Pk "$WORK" | awk 'NR==2 {printf "%d", $4 / 1024 / 1024}')
stamp="experts=$EXPERTS seed=0 bf16"
if [[ "$(cat "$WORK/base/.smoke_gpu_stamp" 2>/dev/null)" != "$stamp" ]]; then
    (( free_gb >= NEED_GB )) || fail "$WORK has $free_gb GB free; the checkpoint and its torch_dist copy need ~$NEED_GB GB (set SMOKE_GPU_WORK, or fewer SMOKE_GPU_EXPERTS)"
    rm -rf "$WORK/base" "$WORK/dcp"
    step "make-checkpoint (4layer, $EXPERTS experts, bf16, on the GPU)" 240 "${K3[@]}" make-checkpoint \
        --variant 4layer --num-experts "$EXPERTS" --format bf16 --out "$WORK/base" --seed 0 --device cuda \
        --workers 8 --no-progress || fail "make-checkpoint failed (above)" 1
    step "tokenizer" 60 "$PY" ci/smoke_gpu_tokenizer.py "$WORK/base" || fail "writing the tokenizer failed (above)" 1
    step "convert hf-to-dist" 300 "${K3[@]}" convert hf-to-dist --hf-checkpoint "$WORK/base" --save "$WORK/dcp" \
        --no-progress || fail "convert hf-to-dist failed (above)" 1
    echo "$stamp" > "$WORK/base/.smoke_gpu_stamp"
else
    echo "smoke-gpu: reusing $WORK/base and $WORK/dcp ($stamp)"
fi
[[ -f "$WORK/data/arith/train.jsonl" ]] || step "prepare-data --task arith" 60 "${K3[@]}" prepare-data --task arith \
    --data-dir "$WORK/data" || fail "prepare-data failed (above)" 1
base_gib=$(du -sb "$WORK/base" | awk '{printf "%.1f", $1 / 2^30}')

# ------------------------------------------------------------------------------------------------ the budget
total_gib=$("$PY" -c "import torch; print(f'{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}')")
budget_gib=$BUDGET_GIB
echo "smoke-gpu: base $base_gib GiB; device $total_gib GiB; budget $budget_gib GiB ($(awk -v b="$budget_gib" -v t="$total_gib" 'BEGIN { printf "%.3f", b / t }') of the device) per actor and for the run"
awk -v b="$budget_gib" 'BEGIN { exit !(b > 0) }' || fail "SMOKE_GPU_MEMORY_GIB=$budget_gib: expected a positive number of GiB"
awk -v b="$budget_gib" -v w="$base_gib" 'BEGIN { exit !(b >= 2 * w + 2) }' ||
    fail "the budget $budget_gib GiB cannot hold both BF16 bases (2 × $base_gib GiB) at the gpu-peak moments: raise SMOKE_GPU_MEMORY_GIB or lower SMOKE_GPU_EXPERTS"
awk -v b="$budget_gib" -v c="$CONTEXT_GIB" -v t="$total_gib" 'BEGIN { exit !(b + c <= t) }' ||
    fail "the budget $budget_gib GiB + $CONTEXT_GIB GiB of CUDA contexts is more than the device's $total_gib GiB: lower SMOKE_GPU_MEMORY_GIB"

if [[ -e "$RUN" ]]; then
    kept="$RUN.$(date -u +%Y%m%d-%H%M%S)"
    echo "smoke-gpu: keeping the previous run: $RUN -> $kept"
    mv "$RUN" "$kept"
fi
TRAIN_ARGS=(
    --mode normal --model-variant tiny --backend megatron --rollout-engine embedded --task arith
    --num-gpus-per-node 1 --reward-model deterministic_random --num-rollout "$ROLLOUTS" --rollout-batch-size 8
    --n-samples-per-prompt 8 --global-batch-size 64 --rollout-max-concurrency 64
    --rollout-max-response-len "$RESPONSE_LEN" --max-tokens-per-gpu 4096 --lr 1e-4 --seed 0
    --save-interval "$ROLLOUTS" --colocate-memory-peak-device gpu --gpu-memory-gb-per-actor "$BUDGET_GIB"
    --hf-checkpoint "$WORK/base" --ref-load "$WORK/dcp" --data-dir "$WORK/data"
    --run-id "smoke-gpu-$(date -u +%Y%m%d-%H%M%S)" "${DANCE_FLAGS[@]}"
    --profile-train-step "$PROFILE_STEP"
)
# --model-variant tiny: the one variant whose layout rule is one process on one GPU (4layer's is TP8/EP8 on 8);
# the model itself is the checkpoint's config.json (the 4layer width).
PLAN=$(mktemp -d "${TMPDIR:-/tmp}/k3-smoke-gpu-plan.XXXXXX")
step "k3 train --dry-run" 60 "${K3[@]}" train "${TRAIN_ARGS[@]}" --dry-run --run-dir "$PLAN/run" >"$PLAN/plan.txt" ||
    { cat "$PLAN/plan.txt"; fail "k3 train --dry-run refused the configuration (above); nothing was started"; }
grep -E '^ +(gpu_memory_gb_per_actor|offload_train|offload_rollout_level|colocate_memory_peak_device|lora_base_cpu_backup|backend|rollout_engine) ' "$PLAN/plan.txt" || true
rm -rf "$PLAN"

BALLAST_PID=""
cleanup() {  # stop the ballast (the one process this script started in the background)
    if [[ -n "$BALLAST_PID" ]]; then
        kill "$BALLAST_PID" 2>/dev/null
        wait "$BALLAST_PID" 2>/dev/null
        BALLAST_PID=""
    fi
}
trap cleanup EXIT
if [[ ${SMOKE_GPU_BALLAST:-1} == 1 ]]; then
    leave=$(awk -v b="$budget_gib" -v c="$CONTEXT_GIB" 'BEGIN { printf "%.1f", b + c }')
    "$PY" ci/gpu_ballast.py --leave-gib "$leave" > "$WORK/ballast.out" 2>&1 &
    BALLAST_PID=$!
    for _ in $(seq 120); do
        grep -q "gpu_ballast: holding" "$WORK/ballast.out" 2>/dev/null && break
        kill -0 "$BALLAST_PID" 2>/dev/null || break
        sleep 0.5
    done
    cat "$WORK/ballast.out"
    grep -q "gpu_ballast: holding" "$WORK/ballast.out" || fail "the ballast did not take the device down to the budget (above)"
fi

# ------------------------------------------------------------------------------------------------ train and judge
limit=$(( DEADLINE - $(elapsed) - 30 ))
(( limit >= 60 )) || fail "only $limit s left of SMOKE_GPU_DEADLINE_S=$DEADLINE for the training run" 2
echo "smoke-gpu: training into $RUN (limit ${limit}s; watch it live with \`$PY -m harness.cli watch $RUN --tier gpu\`)"
train_rc=0
# TERM, not ABRT: k3 train's placement stops its Ray actors on SIGTERM (the run's status says failed).
STEP_SIGNAL=TERM step "k3 train ($ROLLOUTS rollouts)" "$limit" "${K3[@]}" train "${TRAIN_ARGS[@]}" --run-dir "$RUN" ||
    train_rc=$?
(( train_rc == 124 )) && echo "smoke-gpu: the training run reached its ${limit}s limit and was stopped"
cleanup
if grep -qE "OutOfMemoryError|CUDA out of memory" "$OUT/smoke_gpu.log"; then
    echo "smoke-gpu: out of memory: $(grep -m1 -oE "(OutOfMemoryError|CUDA out of memory)[^\"]{0,200}" "$OUT/smoke_gpu.log")"
fi

if [[ ! -f "$RUN/resolved_config.json" ]]; then
    fail "$RUN has no resolved_config.json: the run never started, nothing to judge" "$(( train_rc ? train_rc : 2 ))"
fi
check_rc=0
timeout 60 "$PY" -m harness.cli check "$RUN" --tier gpu --finished --json "$OUT/verdict.json" || check_rc=$?
timeout 60 "$PY" -m harness.cli report "$RUN" --tier gpu --finished --out "$OUT/report.html" \
    --markdown "$OUT/summary.md" >/dev/null || true  # it mirrors the verdict's exit code; the verdict above decides
cp "$RUN/metrics.jsonl" "$RUN/resolved_config.txt" "$OUT/" 2>/dev/null
cp "$RUN/profile/train_step_${PROFILE_STEP}_rank0.txt" "$OUT/" 2>/dev/null &&
    echo "smoke-gpu: where optimizer step $PROFILE_STEP's time went: $OUT/train_step_${PROFILE_STEP}_rank0.txt"
cp "$RUN/profile/train_step_${MEMORY_STEP}_memory_rank0.txt" "$OUT/" 2>/dev/null &&
    echo "smoke-gpu: what optimizer step $MEMORY_STEP left allocated: $OUT/train_step_${MEMORY_STEP}_memory_rank0.txt"
echo "smoke-gpu: $(elapsed)s; k3 train exit $train_rc; verdict exit $check_rc; in $OUT: verdict.json summary.md report.html metrics.jsonl resolved_config.txt smoke_gpu.log"
if (( check_rc == 0 && train_rc != 0 )); then exit "$train_rc"; fi
exit "$check_rc"
