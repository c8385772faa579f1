#!/usr/bin/env bash
# bench/gpu_check.sh: the whole GPU path of hetero-paged-infer checked and measured on a lent GPU machine, in one
# command, in about 5 minutes on an H200 (a whole rerun still fits a 15-minute lease). See bench/README.md, "GPU check".
#
#   OUT=/some/dir bench/gpu_check.sh                 # every part, results in $OUT (the device tool sets OUT)
#   OUT=/some/dir bench/gpu_check.sh --only serve    # rerun parts (comma-separated); env always runs first
#   OUT=/tmp/x bench/gpu_check.sh --dry-run          # on CPU at toy sizes, CUDA-only measurements skipped (make test)
#
# Needs beside the checkout: .gpu_kit/ (make gpu-kit: the wheels the GPU image lacks, the embedded tokenizer), named
# in the device tool's `carry`. Uses the machine's own python3, torch and triton; builds nothing but the wheels'
# install into /tmp; runs the project from the checkout (PYTHONPATH, as the test suite does).
#
# Writes into $OUT at most 4 files (the device tool brings back 8): parts.json (every part's record: what ran, its
# numbers, what was skipped and why), junit.xml (the gpu tests), summary.md (printed last), log.txt (all output).
#
# Time budget per part, seconds on an H200 (a part sizes its loops to its budget and is killed at 1.25x of it):
#   env      20   versions, device, driver; imports and a first Triton launch (stops the run when broken)
#   weights  25   random bf16 checkpoints in the embedded (135M) and a 1B shape, on the GPU
#   tests   150   every `gpu`-marked test, -x, 90 s per test (53 s with Triton's cache warm; over 95 s cold)
#   step     55   decode step, eager vs CUDA graphs, batch 1/8/32/128, both shapes
#   kernels  40   Triton attention vs the torch reference; int8/int4 matmul vs bf16 cuBLAS
#   serve    95   hpi serve at 1/32/128 clients vs transformers' static batch, same GPU and prompts
#   kv_tier  15   the host KV tier's PCIe copy bandwidth
#   profile 150   `hpi profile` of Llama-3.1-8B's shape (random 16 GB weights): the fleet optimizer's H200 figures
#   total   550   plus the wheels' install (~5 s) and the summary; the first whole run on an H200 took 229 s
set -uo pipefail

declare -A BUDGET_S=([env]=20 [weights]=25 [tests]=150 [step]=55 [kernels]=40 [serve]=95 [kv_tier]=15 [profile]=150)
ORDER=(env weights tests step kernels serve kv_tier profile)

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
ONLY="" DRY_RUN=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --only) ONLY="${2:?--only needs a part: ${ORDER[*]}}"; shift 2 ;;
        --only=*) ONLY="${1#--only=}"; shift ;;
        --dry-run) DRY_RUN="--dry-run"; shift ;;
        -h|--help) usage ;;
        *) echo "unknown argument: $1" >&2; usage ;;
    esac
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/bench/results/tmp/gpu_check}"
KIT="${HPI_GPU_KIT_DIR:-$REPO/.gpu_kit}"
MODELS="${HPI_GPU_MODELS:-/tmp/hpi-gpu-models}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1

PARTS=("${ORDER[@]}")
if [[ -n "$ONLY" ]]; then
    IFS=',' read -r -a PARTS <<< "$ONLY"
    for part in "${PARTS[@]}"; do
        [[ -n "${BUDGET_S[$part]:-}" ]] || { echo "unknown part '$part'; parts: ${ORDER[*]}"; exit 2; }
    done
    [[ " ${PARTS[*]} " == *" env "* ]] || PARTS=(env "${PARTS[@]}")
fi

echo "== gpu_check $(date -u +%FT%TZ) ${DRY_RUN:-on the GPU}: parts ${PARTS[*]}; out $OUT"
# The machine has no package index: the kit's wheels (make gpu-kit) go into /tmp, ahead of the machine's own.
SITE=""
if [[ -z "$DRY_RUN" ]]; then
    if ! compgen -G "$KIT/wheels/*.whl" > /dev/null; then
        echo "FATAL: no wheels in $KIT/wheels: run 'make gpu-kit' on the development machine and carry .gpu_kit"
        exit 3
    fi
    SITE=/tmp/hpi-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$KIT"/wheels/*.whl || { echo "FATAL: installing the kit's wheels failed"; exit 3; }
fi
export PYTHONPATH="${SITE:+$SITE:}$REPO/contracts:$REPO/kernels:$REPO/runtime:$REPO/tests:$REPO"
export PYTHONUNBUFFERED=1 HPI_GPU_KIT=1 TOKENIZERS_PARALLELISM=false
export HPI_CACHE_DIR="${HPI_CACHE_DIR:-$REPO/.cache}"

START=$SECONDS
for part in "${PARTS[@]}"; do
    budget=${BUDGET_S[$part]}
    # The limit keeps a part inside the device tool's time; a dry run (toy sizes on a CPU that make test may share
    # with other tests) only needs it to catch a hang: 4x, since its parts can take several times an H200's budget.
    limit=$((budget * 5 / 4))
    [[ -n "$DRY_RUN" ]] && limit=$((budget * 4))
    echo "== $part (budget ${budget} s)"
    timeout --kill-after=10 "$limit" \
        "$PY" -m bench.gpu "$part" --out "$OUT" $DRY_RUN --budget "$budget" --models "$MODELS" --kit "$KIT"
    status=$?
    [[ $status -eq 124 || $status -eq 137 ]] && echo "$part: killed at its time limit ($limit s)"
    if [[ "$part" == env && $status -ne 0 ]]; then
        echo "FATAL: the environment check failed (above): nothing after it can run"
        "$PY" -m bench.gpu summary --out "$OUT" --parts env
        exit 4
    fi
done
echo "== summary ($((SECONDS - START)) s of parts)"
IFS=','; "$PY" -m bench.gpu summary --out "$OUT" --parts "${PARTS[*]}"
