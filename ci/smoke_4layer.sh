#!/usr/bin/env bash
# make smoke-4layer: the recipe's single-node tier. The first 4 layers of Kimi-K3 (the real 4layer checkpoint)
# on one node with 8 GPUs: Megatron trainer TP8/EP8 and an SGLang engine TP8/EP8 colocated on the same GPUs,
# the recipe's debug_minimal sizes (dapo-math, deterministic_random reward, 8 prompts x 2 samples, 32-token
# responses, lr 1e-6), then the harness's verdict against harness/spec/4layer.toml.
#
#   K3_HF_CHECKPOINT=/models/Kimi-K3-4layer-bf16 K3_REF_LOAD=/models/Kimi-K3-4layer-torch-dist \
#   K3_DATA_DIR=/datasets bash ci/smoke_4layer.sh [--dry-run] [-- extra k3 train flags]
#
# Exit: 0 every criterion passed (or, with --dry-run, everything is in place); 1 the verdict failed (or the dry
# run found problems); 2 a precondition is missing (nothing was started); other: the exit code of `k3 train`.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bash ci/smoke_4layer.sh [--dry-run] [--help] [-- EXTRA_K3_TRAIN_FLAGS...]

Runs the 4layer tier on this node and judges it (harness/spec/4layer.toml).

Required environment:
  K3_HF_CHECKPOINT   BF16 HF checkpoint of the 4layer model (the engine loads it; needs config.json)
  K3_REF_LOAD        torch_dist (DCP) checkpoint of the same base (the Megatron trainer loads it)
  K3_DATA_DIR        datasets dir of `k3 prepare-data --task dapo-math` (dapo-math-17k/dapo-math-17k.jsonl)
Optional:
  DRY_RUN=1          same as --dry-run: check paths, GPUs and versions, print the resolved plan, start nothing
  K3_PYTHON          python with CUDA torch, sglang and this repo's deps (default: the first of python3,
                     .venv/bin/python whose torch sees CUDA)
  K3_SGLANG_PATH     an SGLang source tree (directory holding sglang/) to use instead of the installed one
  K3_SMOKE_RUN_DIR   run directory (default runs/smoke-4layer; an existing one is moved aside, never deleted)
  K3_NUM_ROLLOUT     rollouts to run (default 10, the tier's minimum)
  K3_SMOKE_TIMEOUT_MIN  wall-clock limit of the training run in minutes (default 90; the tier allows 60)
EOF
}

DRY_RUN="${DRY_RUN:-0}"
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "smoke-4layer: unknown argument '$1' (extra k3 train flags go after --)" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
[[ "$DRY_RUN" == "0" || "$DRY_RUN" == "" ]] && DRY_RUN=0 || DRY_RUN=1

cd "$(dirname "$0")/.."
NEED_GPUS=8
PROBLEMS=()
declare -A V=()  # what the python probe found: key -> value
problem() { PROBLEMS+=("$1"); }
note() { printf '  %-14s %s\n' "$1" "$2"; }

# ------------------------------------------------------------------------------------------------ paths
check_paths() {
    if [[ -z "${K3_HF_CHECKPOINT:-}" ]]; then
        problem "K3_HF_CHECKPOINT is not set: export the BF16 4layer checkpoint dir (the recipe's Kimi-K3-4layer-bf16)"
    elif [[ ! -f "$K3_HF_CHECKPOINT/config.json" ]]; then
        problem "K3_HF_CHECKPOINT=$K3_HF_CHECKPOINT has no config.json: point it at the HF checkpoint directory"
    elif ! compgen -G "$K3_HF_CHECKPOINT/*.safetensors" >/dev/null; then
        problem "K3_HF_CHECKPOINT=$K3_HF_CHECKPOINT holds no *.safetensors weights"
    fi
    if [[ -z "${K3_REF_LOAD:-}" ]]; then
        problem "K3_REF_LOAD is not set: export the torch_dist checkpoint dir (\`k3 convert hf-to-dist --hf-checkpoint BF16 --save DCP\`)"
    elif [[ ! -d "$K3_REF_LOAD" ]]; then
        problem "K3_REF_LOAD=$K3_REF_LOAD does not exist: convert the checkpoint with \`k3 convert hf-to-dist\`"
    fi
    if [[ -z "${K3_DATA_DIR:-}" ]]; then
        problem "K3_DATA_DIR is not set: export the datasets dir of \`k3 prepare-data --task dapo-math --data-dir DIR\`"
    elif [[ ! -f "$K3_DATA_DIR/dapo-math-17k/dapo-math-17k.jsonl" ]]; then
        problem "K3_DATA_DIR=$K3_DATA_DIR has no dapo-math-17k/dapo-math-17k.jsonl: run \`k3 prepare-data --task dapo-math --data-dir $K3_DATA_DIR\`"
    fi
    if [[ -n "${K3_SGLANG_PATH:-}" && ! -d "$K3_SGLANG_PATH/sglang" ]]; then
        problem "K3_SGLANG_PATH=$K3_SGLANG_PATH has no sglang/ directory"
    fi
}

# ------------------------------------------------------------------------------------------------ GPUs
check_gpus() {
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        problem "no NVIDIA driver here (nvidia-smi not found): smoke-4layer needs one node with $NEED_GPUS GPUs"
        return
    fi
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    note "gpus" "$n ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *//' | paste -sd, -))"
    if (( n < NEED_GPUS )); then
        problem "smoke-4layer needs $NEED_GPUS GPUs on this node (TP8/EP8 trainer and engine); nvidia-smi lists $n"
    fi
}

# ------------------------------------------------------------------------------------------------ python and versions
source ci/cuda_python.sh

PY="$(pick_python)"
export PYTHONPATH="$PWD${K3_SGLANG_PATH:+:$K3_SGLANG_PATH}${PYTHONPATH:+:$PYTHONPATH}"

check_versions() {
    if ! command -v "$PY" >/dev/null 2>&1; then
        problem "python '$PY' not found: set K3_PYTHON to the cluster image's python"
        return
    fi
    local probe
    # One interpreter start reports everything; each line is key=value.
    probe=$("$PY" - <<'EOF' 2>&1 || true
import importlib.metadata as md
import importlib.util
import sys

def version(dist, module):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        if importlib.util.find_spec(module) is None:
            return "missing"
        return getattr(__import__(module), "__version__", "unknown")

print(f"python={sys.version.split()[0]}")
print(f"python_ok={int(sys.version_info >= (3, 11))}")
try:
    import torch
    print(f"torch={torch.__version__}")
    print(f"cuda={int(torch.cuda.is_available())}")
    print(f"cuda_gpus={torch.cuda.device_count() if torch.cuda.is_available() else 0}")
except Exception as e:
    print(f"torch=missing ({type(e).__name__}: {e})".replace("\n", " "))
print(f"sglang={version('sglang', 'sglang')}")
print(f"megatron_core={version('megatron-core', 'megatron.core')}")
try:
    from k3.rollout.sglang.surface import SGLANG_VERSION
    print(f"sglang_pin={SGLANG_VERSION}")
except Exception as e:
    print(f"k3=missing ({type(e).__name__}: {e})".replace("\n", " "))
EOF
)
    local key value
    while IFS='=' read -r key value; do
        [[ -n "$key" && "$key" != *" "* ]] && V["$key"]="$value"
    done <<<"$probe"
    note "python" "$PY (${V[python]:-?})"
    note "torch" "${V[torch]:-?} (cuda ${V[cuda]:-0}, ${V[cuda_gpus]:-0} devices)"
    note "sglang" "${V[sglang]:-?} (k3 is pinned to ${V[sglang_pin]:-?})"
    note "megatron-core" "${V[megatron_core]:-?}"
    [[ "${V[python_ok]:-0}" == 1 ]] || problem "$PY is Python ${V[python]:-?}; k3-lora-rl needs >= 3.11"
    if [[ -n "${V[k3]:-}" ]]; then
        problem "$PY cannot import k3 (${V[k3]}): install the repo's dependencies into it (pip install -e '.[cluster]')"
    fi
    if [[ "${V[torch]:-missing}" == missing* ]]; then
        problem "$PY has no torch: set K3_PYTHON to a python with CUDA torch and sglang"
    elif [[ "${V[cuda]:-0}" != 1 ]]; then
        problem "torch ${V[torch]} in $PY sees no CUDA device (a CPU build?): set K3_PYTHON to the cluster image's python"
    elif (( ${V[cuda_gpus]:-0} < NEED_GPUS )); then
        problem "torch in $PY sees ${V[cuda_gpus]} CUDA devices; smoke-4layer needs $NEED_GPUS (check CUDA_VISIBLE_DEVICES)"
    fi
    if [[ "${V[sglang]:-missing}" == missing ]]; then
        problem "sglang is not importable from $PY: pip install 'k3-lora-rl[cluster]', or set K3_SGLANG_PATH"
    elif [[ -n "${V[sglang_pin]:-}" && "${V[sglang]}" != "${V[sglang_pin]}" ]]; then
        echo "smoke-4layer: warning: sglang ${V[sglang]} is installed; k3 is contract-tested against ${V[sglang_pin]}" >&2
    fi
    if [[ "${V[megatron_core]:-missing}" == missing ]]; then
        problem "megatron-core is not importable from $PY (the megatron backend needs it)"
    elif [[ "${V[megatron_core]}" != 0.16.1 ]]; then
        echo "smoke-4layer: warning: megatron-core ${V[megatron_core]} is installed; k3 is tested with 0.16.1" >&2
    fi
}

echo "smoke-4layer: checking this node"
check_paths
check_gpus
check_versions

RUN_DIR="${K3_SMOKE_RUN_DIR:-runs/smoke-4layer}"
RUN_ID="smoke-4layer-$(date -u +%Y%m%d-%H%M%S)"
TRAIN_ARGS=(
    --mode debug_minimal --model-variant 4layer --backend megatron --rollout-engine sglang --task dapo-math
    --num-nodes 1 --num-gpus-per-node "$NEED_GPUS" --num-rollout "${K3_NUM_ROLLOUT:-10}"
    --hf-checkpoint "${K3_HF_CHECKPOINT:-}" --ref-load "${K3_REF_LOAD:-}" --data-dir "${K3_DATA_DIR:-}"
    --run-id "$RUN_ID"
)
[[ -n "${K3_SGLANG_PATH:-}" ]] && TRAIN_ARGS+=(--sglang-path "$K3_SGLANG_PATH")
TRAIN_ARGS+=("${EXTRA[@]}")

# The resolved plan, from `k3 train --dry-run` (it writes nothing; its output holds the resolved_config.txt lines
# the run would write).
PLAN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/k3-smoke-4layer-plan.XXXXXX")"
trap 'rm -rf "$PLAN_DIR"' EXIT
plan_rc=0
if command -v "$PY" >/dev/null 2>&1 && [[ -z "${V[k3]:-}" ]]; then
    echo "smoke-4layer: resolved plan (k3 train --dry-run)"
    "$PY" -m k3 train "${TRAIN_ARGS[@]}" --dry-run --run-dir "$PLAN_DIR/run" > "$PLAN_DIR/plan.txt" || plan_rc=$?
    cat "$PLAN_DIR/plan.txt"
    if (( plan_rc == 2 )); then
        problem "k3 train --dry-run rejected the configuration (see above)"
    elif (( plan_rc != 0 )); then
        problem "k3 train --dry-run found inputs missing (listed above; exit $plan_rc)"
    else
        # The resolved lines harness/spec/4layer.toml checks.
        grep -E '^ +(expert_model_parallel_size|max_tokens_per_gpu|colocate_memory_peak_device|lora_base_cpu_backup) ' \
            "$PLAN_DIR/plan.txt" || true
    fi
fi

if (( ${#PROBLEMS[@]} )); then
    echo >&2
    echo "smoke-4layer: ${#PROBLEMS[@]} problem(s); nothing was started:" >&2
    printf '  - %s\n' "${PROBLEMS[@]}" >&2
    if (( DRY_RUN )); then exit 1; fi
    exit 2
fi
if (( DRY_RUN )); then
    echo "smoke-4layer: dry run: paths, GPUs and versions are in place; the run would go to $RUN_DIR"
    exit 0
fi

# ------------------------------------------------------------------------------------------------ run and judge
if [[ -e "$RUN_DIR" ]]; then
    kept="$RUN_DIR.$(date -u +%Y%m%d-%H%M%S)"
    echo "smoke-4layer: keeping the previous run: $RUN_DIR -> $kept"
    mv "$RUN_DIR" "$kept"
fi
mkdir -p "$(dirname "$RUN_DIR")"
limit_s=$(( ${K3_SMOKE_TIMEOUT_MIN:-90} * 60 ))
echo "smoke-4layer: training into $RUN_DIR (limit ${K3_SMOKE_TIMEOUT_MIN:-90} min; watch it live with"
echo "              \`$PY -m harness.cli watch $RUN_DIR --tier 4layer\`)"
train_rc=0
timeout --signal=TERM --kill-after=120 "$limit_s" \
    "$PY" -m k3 train "${TRAIN_ARGS[@]}" --run-dir "$RUN_DIR" || train_rc=$?
if (( train_rc == 124 )); then
    echo "smoke-4layer: training ran past ${K3_SMOKE_TIMEOUT_MIN:-90} min and was stopped" >&2
elif (( train_rc != 0 )); then
    echo "smoke-4layer: k3 train exited with $train_rc; judging what the run wrote" >&2
fi

if [[ ! -f "$RUN_DIR/resolved_config.json" ]]; then
    echo "smoke-4layer: $RUN_DIR has no resolved_config.json: the run never started, nothing to judge" >&2
    exit $(( train_rc ? train_rc : 2 ))
fi
check_rc=0
"$PY" -m harness.cli check "$RUN_DIR" --tier 4layer --finished --json "$RUN_DIR/verdict.json" || check_rc=$?
"$PY" -m harness.cli report "$RUN_DIR" --tier 4layer --finished >/dev/null 2>&1 ||
    true  # the report mirrors the verdict's exit code; the verdict above already decides
echo "smoke-4layer: verdict $RUN_DIR/verdict.json, report $RUN_DIR/report.html"
if (( train_rc != 0 )); then exit "$train_rc"; fi
exit "$check_rc"
