#!/usr/bin/env bash
# GuideLLM (the vLLM project's load harness) against `make run`'s gateway, with its default backend validation
# (it probes GET /health and /v1/models before a run; issue 41). GuideLLM lives in a venv of its own (it pulls
# torch): GUIDELLM_VENV, default .venv-guidellm. Output: docs/results/guidellm/ (the console report and CSV).
#   bash bench/guidellm_gateway.sh [REQUESTS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="${GUIDELLM_VENV:-$root/.venv-guidellm}"
requests="${1:-20}"
test -x "$venv/bin/guidellm" || { python3 -m venv "$venv" && "$venv/bin/pip" install --quiet guidellm; }
out="$root/docs/results/guidellm"
work=$(mktemp -d)
mkdir -p "$out"
python3 - "$work/prompts.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(50):
        f.write(json.dumps({"prompt": f"Tell me about topic {i}. " * 8, "output_tokens_count": 16}) + "\n")
PY
cd "$work"
"$root/.venv/bin/switchyard" up --duration 300 --gateway-port 8011 --api-port 8091 >up.log 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf http://127.0.0.1:8011/readyz >/dev/null && break; sleep 1; done
"$venv/bin/guidellm" run --backend kind=openai_http,target=http://127.0.0.1:8011 \
  --profile kind=synchronous --constraint "kind=max_requests,count=$requests" \
  --data "kind=json_file,path=$work/prompts.jsonl" --disable-console-interactive | tee "$out/console.txt"
cp benchmarks.csv "$out/benchmarks.csv"
