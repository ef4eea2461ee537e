#!/usr/bin/env bash
# make acceptance-full: the validated Kimi-K3 recipe on an existing 16-node × 4-GPU Ray cluster, judged live.
#
#   1. ray job submit … -- k3 train <the recipe page's validated flags (§4)> into RUN_DIR
#   2. k3-harness watch RUN_DIR beside it: on the first hard FAIL it runs `ray job stop <id>` and stops
#   3. k3-harness check (verdict, Markdown summary, JSON), k3-harness report (HTML), the pytest acceptance
#      tests (JUnit XML)
#
# Needs: RAY_ADDRESS (the cluster's dashboard/job address, e.g. http://head:8265) and the inputs below.
# RUN_DIR must be visible both to the job's entrypoint (it runs on the Ray head) and to this machine: run this
# on the head node, or point K3_RUN_DIR at shared storage.
#
#   K3_HF_CHECKPOINT      native MXFP4 checkpoint (--hf-checkpoint)            required
#   K3_REF_LOAD           torch_dist checkpoint of the base (--ref-load)       required
#   K3_DATA_DIR           datasets of `k3 prepare-data` (--data-dir)           required
#   K3_SGLANG_PATH        directory holding sglang/ (default /sgl-workspace/sglang/python)
#   K3_NUM_ROLLOUT        rollouts to run (default 20: through eval@9 and 20 syncs, which decides every
#                         criterion; the validated launch runs 1000 — set it for the full length)
#   K3_HARDWARE_PROFILE   harness profile with hardware-specific criteria (gb300: allocated ≈ 91 GB)
#   K3_RUN_ID, K3_RUN_DIR job id (default acceptance-<UTC time>) and run directory (default runs/<id>)
#   K3_WATCH_TIMEOUT      give up watching after this many seconds (default: none)
#   K3_WATCH_POLL         seconds between the watch's reads of the run (default 30)
#   K3_EXTRA_TRAIN_ARGS   appended to `k3 train` (e.g. "--lora-rank 16")
#   K3_REMOTE_PATHS=1     the three paths exist on the cluster but not here (submitting from another machine):
#                         skip the local existence checks; the flags are still validated here
#   DRY_RUN=1 / --dry-run validate everything and print the resolved plan; submit nothing
#
# Before anything is submitted, `k3 train --dry-run` checks the launch here: the flags, every path, that
# K3_HF_CHECKPOINT is the native MXFP4 release (whole, as its config declares) and that K3_REF_LOAD is the
# torch_dist conversion of the same model (the stored config field by field, every tensor's shape). Every problem
# found is listed at once.
#
# Exit: the verdict's (0 every criterion passed); 2 a precondition is missing (nothing was submitted).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "acceptance-full: $*" >&2; exit 2; }
PROBLEMS=()
problem() { PROBLEMS+=("$1"); }
# Every problem at once, then stop: nothing was submitted.
stop_on_problems() {
  (( ${#PROBLEMS[@]} )) || return 0
  echo "acceptance-full: ${#PROBLEMS[@]} problem(s); nothing was submitted:" >&2
  printf '  - %s\n' "${PROBLEMS[@]}" >&2
  exit 2
}

DRY_RUN="${DRY_RUN:-0}"
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$arg' (extra k3 train flags go in K3_EXTRA_TRAIN_ARGS)" ;;
  esac
done
[[ "$DRY_RUN" == "0" || -z "$DRY_RUN" ]] && DRY_RUN=0 || DRY_RUN=1

if [[ -z "${RAY_ADDRESS:-}" && $DRY_RUN == 0 ]]; then
  problem "no Ray cluster: set RAY_ADDRESS to the job address of an existing 16-node × 4-GPU cluster (e.g.
    RAY_ADDRESS=http://head:8265 make acceptance-full). Nothing was submitted."
fi
BIN=${BIN:-.venv/bin}
RAY=$BIN/ray
# (the dry run submits nothing, so it needs no ray)
[[ -x $RAY || $DRY_RUN == 1 ]] || RAY=$(command -v ray) || problem "the 'ray' command is not installed (make install)"
[[ -n "${K3_HF_CHECKPOINT:-}" ]] || problem "set K3_HF_CHECKPOINT to the native MXFP4 checkpoint directory"
[[ -n "${K3_REF_LOAD:-}" ]] || problem "set K3_REF_LOAD to the torch_dist checkpoint of the base"
[[ -n "${K3_DATA_DIR:-}" ]] || problem "set K3_DATA_DIR to the datasets directory (k3 prepare-data)"
if [[ "${K3_REMOTE_PATHS:-0}" != 1 ]]; then
  # The job's entrypoint runs on the head node, which is where this script is meant to run.
  [[ -z "${K3_HF_CHECKPOINT:-}" || -f "$K3_HF_CHECKPOINT/config.json" ]] || problem \
    "K3_HF_CHECKPOINT=$K3_HF_CHECKPOINT has no config.json (set K3_REMOTE_PATHS=1 if it exists only on the cluster)"
  [[ -z "${K3_REF_LOAD:-}" || -d "$K3_REF_LOAD" ]] ||
    problem "K3_REF_LOAD=$K3_REF_LOAD does not exist (\`k3 convert hf-to-dist\`)"
  if [[ -n "${K3_DATA_DIR:-}" ]]; then
    for f in dapo-math-17k/dapo-math-17k.jsonl aime-2024/aime-2024.jsonl; do
      [[ -f "$K3_DATA_DIR/$f" ]] || problem \
        "K3_DATA_DIR=$K3_DATA_DIR has no $f: run \`k3 prepare-data --task dapo-math --data-dir $K3_DATA_DIR\`"
    done
  fi
fi
stop_on_problems

RUN_ID=${K3_RUN_ID:-acceptance-$(date -u +%Y%m%d-%H%M%S)}
RUN_DIR=${K3_RUN_DIR:-runs/$RUN_ID}
PROFILE=${K3_HARDWARE_PROFILE:-}
[[ -e "$RUN_DIR/resolved_config.json" ]] && die "$RUN_DIR already holds a run: set K3_RUN_ID / K3_RUN_DIR to a new one"
mkdir -p "$(dirname "$RUN_DIR")"
RUN_DIR=$(cd "$(dirname "$RUN_DIR")" && pwd)/$(basename "$RUN_DIR")
SUMMARY=${GITHUB_STEP_SUMMARY:-$RUN_DIR/summary.md}
HARNESS=("$BIN/k3-harness")
PROFILE_ARGS=()
[[ -n $PROFILE ]] && PROFILE_ARGS=(--profile "$PROFILE")

# The recipe page's validated launch (§4), with our run directory and the cluster joined as it is.
TRAIN=(k3 train --external-ray --run-dir "$RUN_DIR" --run-id "$RUN_ID"
  --backend megatron --rollout-engine sglang
  --mode normal --model-variant full --task dapo-math --reward-model deepscaler
  --num-nodes 16 --num-gpus-per-node 4
  --pipeline-parallel-size 8 --context-parallel-size 2
  --rollout-tp-size 16 --rollout-max-concurrency 8
  --lora-rank 32 --lora-alpha 64
  --num-rollout "${K3_NUM_ROLLOUT:-20}" --rollout-batch-size 8 --n-samples-per-prompt 8
  --rollout-max-response-len 4096 --sglang-max-total-tokens 65536
  --global-batch-size 64 --lr 1e-05 --eval-interval 10
  --distributed-timeout-minutes 60
  --hf-checkpoint "$K3_HF_CHECKPOINT" --ref-load "$K3_REF_LOAD"
  --sglang-path "${K3_SGLANG_PATH:-/sgl-workspace/sglang/python}"
  --data-dir "$K3_DATA_DIR" --enable-wandb)
# shellcheck disable=SC2206  # extra args are words on purpose
TRAIN+=(${K3_EXTRA_TRAIN_ARGS:-})

# Validate the flags here before anything reaches the cluster: `k3 train --dry-run` (it writes nothing)
# (exit 2: the configuration is invalid; 1: inputs missing here, fatal unless they live on the cluster only).
PLAN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/k3-acceptance-plan.XXXXXX")
trap 'rm -rf "$PLAN_DIR"' EXIT
PLAN=("${TRAIN[@]:2}")
for i in "${!PLAN[@]}"; do [[ "${PLAN[$i]}" == "$RUN_DIR" ]] && PLAN[$i]="$PLAN_DIR/run"; done
# W&B logs from the cluster's driver, so wandb is the cluster's dependency, not this host's: the plan leaves it out
# (the run itself checks it on the cluster before it writes anything).
PLAN+=(--no-enable-wandb)
echo "acceptance-full: resolved plan (k3 train --dry-run)"
set +e
"$BIN/k3" train "${PLAN[@]}" --dry-run > "$PLAN_DIR/plan.txt"
PLAN_RC=$?
cat "$PLAN_DIR/plan.txt"
set -e
if [[ $PLAN_RC -eq 2 ]] || { [[ $PLAN_RC -ne 0 ]] && [[ "${K3_REMOTE_PATHS:-0}" != 1 ]]; }; then
  die "k3 train --dry-run rejected the launch (exit $PLAN_RC, see above). Nothing was submitted."
fi
# The recipe's pairing: the native MXFP4 release for the engines, its torch_dist conversion for the trainer (the
# dry run above has checked K3_REF_LOAD against it). A BF16 checkpoint would run the engines in BF16.
if [[ "${K3_REMOTE_PATHS:-0}" != 1 ]] && ! grep -q '^checkpoint: --hf-checkpoint .* is native MXFP4 ' "$PLAN_DIR/plan.txt"
then
  die "K3_HF_CHECKPOINT=$K3_HF_CHECKPOINT is not the native MXFP4 checkpoint (see the plan above): the recipe's launch
  gives the release as --hf-checkpoint and its torch_dist conversion as K3_REF_LOAD. Nothing was submitted."
fi
# The four lines the recipe page (§5.1) says to check first.
grep -E '^ +(expert_model_parallel_size|max_tokens_per_gpu|colocate_memory_peak_device|lora_base_cpu_backup) ' \
  "$PLAN_DIR/plan.txt" || true
if [[ $DRY_RUN == 1 ]]; then
  echo "acceptance-full: dry run: the launch is valid; it would run as job $RUN_ID into $RUN_DIR"
  exit 0
fi
mkdir -p "$RUN_DIR"

echo "acceptance-full: job $RUN_ID on $RAY_ADDRESS, run directory $RUN_DIR"
"$RAY" job submit --address "$RAY_ADDRESS" --submission-id "$RUN_ID" --no-wait -- "${TRAIN[@]}"
"$RAY" job logs --address "$RAY_ADDRESS" --follow "$RUN_ID" > "$RUN_DIR/job.log" 2>&1 &
LOGS_PID=$!

WATCH_ARGS=(--tier full "${PROFILE_ARGS[@]}" --poll "${K3_WATCH_POLL:-30}"
  --kill-cmd "$RAY job stop --address $RAY_ADDRESS $RUN_ID")
[[ -n "${K3_WATCH_TIMEOUT:-}" ]] && WATCH_ARGS+=(--timeout "$K3_WATCH_TIMEOUT")
set +e
"${HARNESS[@]}" watch "$RUN_DIR" "${WATCH_ARGS[@]}"
WATCH_RC=$?
set -e
echo "acceptance-full: watch exited $WATCH_RC"
if [[ $WATCH_RC -ne 0 ]]; then
  # Failed, timed out or incomplete: make sure nothing keeps running on the cluster.
  "$RAY" job stop --address "$RAY_ADDRESS" "$RUN_ID" >/dev/null 2>&1 || true
fi
kill "$LOGS_PID" 2>/dev/null || true

set +e
"${HARNESS[@]}" check "$RUN_DIR" --tier full "${PROFILE_ARGS[@]}" --summary "$SUMMARY" --json "$RUN_DIR/verdict.json"
CHECK_RC=$?
"${HARNESS[@]}" report "$RUN_DIR" --tier full "${PROFILE_ARGS[@]}" --out "$RUN_DIR/report.html" >/dev/null
PYTEST_PROFILE=()
[[ -n $PROFILE ]] && PYTEST_PROFILE=(--k3-profile "$PROFILE")
"$BIN/python" -m pytest -q tests/cluster --k3-run "$RUN_DIR" --k3-tier full "${PYTEST_PROFILE[@]}" \
  --junitxml "$RUN_DIR/acceptance.xml"
set -e
echo "acceptance-full: verdict in $RUN_DIR/verdict.json, report $RUN_DIR/report.html, summary $SUMMARY"
exit "$CHECK_RC"
