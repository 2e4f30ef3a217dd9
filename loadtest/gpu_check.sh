#!/usr/bin/env bash
# One-call GPU check (aimed at under 8 minutes on one H200): build the ops, the CUDA kernel tests, the HF
# exactness suite and the decode-graph tests on CUDA, profile_step with decode graphs and without
# (--enforce-eager), bench_offline against transformers static / continuous batching (and pagedserve with
# --async-scheduling), bench_kernels. Every
# step runs under its own time limit; one failing step does not stop the others. Writes ONE JSON (rewritten
# after each step, so a run cut short keeps what finished): each step's command, exit status, seconds, log
# tail and the JSON it wrote.
#
#   bash loadtest/gpu_check.sh [--dry-run] [--json FILE]    (default FILE: $OUT/gpu_check.json, else ./)
#
# --dry-run: the same steps on CPU (--device cpu) at tiny sizes, to check the script where no GPU is.
# Tests needing redis, openai or pytest-asyncio are not in these files (tests/service is never run here).
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
json="${OUT:-.}/gpu_check.json"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --json) json="$2"; shift ;;
    *) echo "usage: $0 [--dry-run] [--json FILE]" >&2; exit 2 ;;
  esac
  shift
done
logs="$(dirname "$json")/gpu_check_logs"
mkdir -p "$logs"
steps_file="$logs/steps.tsv"
: > "$steps_file"

if [ "$dry_run" = 1 ]; then
  device=cpu
  exactness_k="(llama and not window) or cuda_graphs"
  kernels_args=(--contexts 128 --dtypes fp32 --seconds 0.05)
  profile_args=(--model llama-19m --num-seqs 4 --steps 5 --profile-steps 2)
  offline_args=(--models llama-19m --workloads alpaca --num-requests 4 --batch-sizes 4 --hf-page-sizes 64
                --hf-threads 1)
else
  device=cuda
  exactness_k=""
  kernels_args=(--contexts 128 512 2048 --seconds 0.3)
  profile_args=(--model qwen2-0.5b --num-seqs 64 --steps 100 --profile-steps 10)
  offline_args=(--models qwen2-0.5b --workloads alpaca --num-requests 64 --batch-sizes 32,64 --hf-page-sizes 256
                --hf-threads 1)
fi

# step NAME LIMIT_S RESULT_JSON|- COMMAND...: runs it, logs it, records it, rewrites the summary.
step() {
  local name="$1" limit="$2" result="$3"; shift 3
  local start end rc
  echo "== $name: $*" >&2
  start=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" > "$logs/$name.log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  tail -n 5 "$logs/$name.log" >&2
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$start" "$end" "$result" "$*" >> "$steps_file"
  python -m loadtest.gpu_check_report "$steps_file" "$logs" "$json" "$device" "$dry_run"
}

step build 300 - python -m cuda_ext.build
step kernel_tests 90 - python -m pytest -q -p no:cacheprovider tests/kernels -m cuda
PAGEDSERVE_TEST_DEVICE="$device" step exactness 150 - python -m pytest -q -p no:cacheprovider \
  tests/engine/test_hf_equivalence.py tests/engine/test_cuda_graphs.py -k "$exactness_k"
step profile_graphs 60 "$logs/profile_graphs.json" python -m loadtest.profile_step --device "$device" \
  "${profile_args[@]}" --json "$logs/profile_graphs.json"
step profile_eager 60 "$logs/profile_eager.json" python -m loadtest.profile_step --device "$device" \
  "${profile_args[@]}" --enforce-eager --json "$logs/profile_eager.json"
# transformers' static and continuous batching in separate runs, each with pagedserve: one peer failing on the
# GPU does not lose the other's comparison. The static run also times the engine with async scheduling.
step bench_offline_static 180 "$logs/bench_offline_static.json" python -m loadtest.bench_offline \
  --device "$device" "${offline_args[@]}" --skip-hf-continuous --async-scheduling \
  --json "$logs/bench_offline_static.json"
step bench_offline_continuous 120 "$logs/bench_offline_continuous.json" python -m loadtest.bench_offline \
  --device "$device" "${offline_args[@]}" --skip-hf-static --json "$logs/bench_offline_continuous.json"
step bench_kernels 45 "$logs/bench_kernels.json" python -m loadtest.bench_kernels --device "$device" \
  "${kernels_args[@]}" --json "$logs/bench_kernels.json"
echo "wrote $json" >&2
python -c "import json, sys; d = json.load(open(sys.argv[1])); sys.exit(0 if d['all_ok'] else 1)" "$json"
