#!/usr/bin/env bash
# One prepared check for a GPU machine: jax (0.11, CUDA), flax, transformers, safetensors and
# orbax installed, no network. Runs the package from this working tree (no install), each section
# under its own time limit (the default sections on the GPU: device 20 + kernels 150 + bench 240
# + overlap 60 + layers 80 + idle 90 + pallas 150 + table 10 = 800 s at most; GPU runs of
# 2026-11-29: 183 s for all but layers and idle, 224 s for all but kernels and idle, 59 s for
# idle; each opt-in section at most 150-360 s, see below); writes full logs and JSON under $OUT
# as it goes (a cut run keeps what it measured) and prints a short table last.
#
#   bash benchmarks/gpu_check.sh            # on the GPU: qwen3-0.6b shape, dummy weights, bf16
#   bash benchmarks/gpu_check.sh --tiny     # tiny model and shapes (also on CPU: 1-2 min, 2 cores)
#   OUT=/some/dir bash benchmarks/gpu_check.sh
#   GPU_CHECK_SECTIONS="device bench overlap" bash benchmarks/gpu_check.sh   # only these
#
# Every section runs the engine's one code path: a jax.sharding mesh (of one device at
# tensor_parallel_size=1), attention under shard_map; comparing bench, overlap and idle with the
# runs of 2026-11-29 (RESULTS.md) shows what that path costs on a GPU.
#
# Sections, in this order (logs: $OUT/<section>.log):
#   device  jax, flax and transformers versions, backend, devices and memory; the matmul peak
#           (bf16 and f32) and the device-to-device copy bandwidth  -> $OUT/device.json
#   kernels benchmarks/kernels/bench_kernels.py: the Pallas ragged and decode attention kernels against
#           the jnp reference (relative errors, float32 and bf16), then single bf16 calls timed
#           at the qwen3-0.6b attention shape: decode batch 64 at context 2048 and 4096 (our
#           decode kernel, our ragged kernel, JAX's paged_attention, the reference) and a mixed
#           batch (4 prefill chunks of 1024 after 1024 cached + 64 decodes at 2048) and the
#           prefill batch (the 4 chunks alone): the ragged kernel, the Mosaic GPU ragged kernel
#           (TMA + wgmma, issue 26's prefill candidate) and the reference; torch's peers beside
#           them (SDPA's FlashAttention on the K/V made dense, FlexAttention over the pages:
#           benchmarks/kernels/torch_peer.py), then the Mosaic GPU kernel with a warpgroup that
#           only loads (mgpu_ragged_ws, FlashAttention-3's split, untried on a GPU); bytes/s
#           against its own copy bandwidth, attention TFLOP/s against its own bf16 matmul
#           peak                                                   -> $OUT/kernels.json.
#           When a Pallas kernel fails its check, bench, overlap, layers and idle use xla.
#           The rows of kernels no GPU has run (mgpu_ragged_ws here, ws=1 in ksweep) print
#           ptxas's report (registers a thread, spills) into the log just before their row.
#   bench   minijax-serve bench, 128 random prompts (half the nano-vllm workload's 256), input
#           and output 100-1024 tokens, on qwen3-0.6b with dummy weights in bfloat16, offline,
#           the engine's defaults but the workload's context (2048)
#                                                         -> $OUT/bench.jsonl, $OUT/bench.png
#   overlap the same model on a decode-heavy workload of many short requests at batch 64 (256
#           of them), --compare enable_overlap=True,False: host time, time blocked on the
#           device and the device-idle estimate per step  -> $OUT/overlap.jsonl
#   layers  the overlap workload, --compare layer_loop=unroll,scan (EngineConfig.layer_loop):
#           the layers written out against the scan with a switch per layer -> $OUT/layers.jsonl
#   idle    benchmarks/device_idle.py, overlap on then off: 64 requests decoding, the engine's
#           tick against the same step replayed back to back with no host work (the device's
#           own step time): the device's idle share of a tick  -> $OUT/idle.jsonl
#   pallas  the same model, 128 requests of 512-1024 prompt and 64-128 output tokens at batch
#           64 (decode at ~1k context), --compare attention_backend=pallas,pallas_mgpu: the
#           engine with the Triton kernels against the same with the Mosaic GPU ragged kernel
#           for the steps holding prefill tokens (issue 26's candidate; the jnp reference this
#           section compared before timed out on the GPU)  -> $OUT/pallas.jsonl
#   features (opt-in: not in the default list; GPU_CHECK_SECTIONS="features") the overlap
#           workload three times, --compare logprobs=none,5,none --compare
#           repetition_penalty=1.0,1.0,1.1: the plain run, every request asking logprobs=5 (the
#           logprobs program), every request penalised (the penalty sampler and token counts)
#                                                         -> $OUT/features.jsonl
#   simcal  (opt-in: GPU_CHECK_SECTIONS="simcal") benchmarks/simulate_validate.py --calibrate:
#           qwen3-0.6b steps (dummy weights, bf16) timed one by one and replayed, the simulated
#           accelerator's H200 profile fitted to them (efficiencies, launch and dispatch costs;
#           docs/parallel_and_simulator.md "Simulated accelerator")                 -> $OUT/simcal.jsonl
#   peer_qwen (opt-in) vLLM's published Qwen3-0.6B workload (kvcached PR 331: vLLM 0.19.0, one
#           H100, random 512 in / 128 out, 500 prompts, all at once: 94.91 req/s), on the
#           qwen3-0.6b shape, dummy weights, bf16, the engine's defaults but the workload's
#           context (2048, vLLM's --max-model-len there)          -> $OUT/peer_qwen.jsonl
#   peer_llama (opt-in) SGLang's published Llama-3-8B ShareGPT workload (sglang issue 1639:
#           2,000 prompts, all at once; SGLang 0.3.2 on two GPUs 24,023 total tok/s), on the
#           llama-3-8b shape with SmolLM2's tokenizer (token counts are SmolLM2's, not
#           Llama-3's) and a ShareGPT slice, from $GPU_CHECK_ASSETS (default ./gpu_assets,
#           written by benchmarks/gpu_assets.py and carried to the GPU machine); the
#           engine's defaults but the workload's context (2048)  -> $OUT/peer_llama.jsonl
#   ksweep  (opt-in) bench_kernels.py --sweep: the kernels' tiles and Triton warps/stages, the
#           decode kernel at batch 64 / 2048, the ragged kernel on the prefill batch (4 x 1024
#           after 1024 cached: issue 26's 300 TFLOP/s target) and the mixed one, and the Mosaic
#           GPU kernel's block_kv x num_slots x warpgroups on the same two batches (first in
#           each) and on the decode batch (after the decode kernel's), last 4 x 2 with its
#           loading warpgroup (warp_specialized, untried on a GPU); ~119 variants (--tiny:
#           the first 3 of each kernel, as a CPU interprets them: 45 s on 2 cores); on a GPU
#           each kernel's fastest tiles written as this device's rows of a copy of the tuning
#           tables (pallas_kernels/tuning/: copy them back), written before the untried rows
#           run and again after them                          -> $OUT/ksweep.json, $OUT/tuning/
#   kgrid   (opt-in) bench_kernels.py --grid: decode batch 8-256 x context 512-8192, our two
#           kernels and JAX's paged_attention, and the decode-vs-ragged routing it implies,
#           written on a GPU as this device's decode_routing row  -> $OUT/kgrid.json, $OUT/tuning/
#   steps   (opt-in) benchmarks/step_roofline.py on qwen3-0.6b and llama-3-8b shapes: decode
#           steps at batch 64 and 128 (context 2048) against the copy bandwidth, an 8192-token
#           prefill step's MFU, and each step's kernels by self time (--profile, in steps.log:
#           where the time goes)                          -> $OUT/steps.jsonl
#   spec    (opt-in: GPU_CHECK_SECTIONS="spec") speculative decoding's inter-token latency:
#           n-gram against none (--compare speculative_method=none,ngram) at concurrency 1 and
#           8, on the qwen3-0.6b and llama-3-8b shapes (dummy weights, bf16) with SmolLM2's
#           tokenizer and ShareGPT replies the model is asked to repeat (--dataset
#           sharegpt-copy from $GPU_CHECK_ASSETS, 16 of at most 128 tokens); dummy weights copy
#           nothing, so the acceptance is the dummy model's own (--tiny: the wide tiny model at
#           concurrency 8 only)                           -> $OUT/spec.jsonl
#   warmup  (opt-in) benchmarks/compile_cache.py --workers 1,0: the bench section's programs
#           compiled from an empty cache one at a time, then one per CPU at once (Engine.warmup's
#           default)                                      -> $OUT/warmup.jsonl
#   fp8kernels (opt-in; with fp8: 4 min at most) benchmarks/kernels/fp8_kernels.py: the
#           attention kernels over FP8 KV pools (issue 48) against the jnp reference on the same
#           pools (Triton ragged and decode, Mosaic GPU ragged), then timed beside bf16 pools:
#           the decode batch (64 at 2048) and the prefill batch    -> $OUT/fp8kernels.json
#   fp8     (opt-in) benchmarks/step_roofline.py, decode steps at batch 64 and 256 (context
#           2048) on qwen3-0.6b and llama-3-8b: bf16, then FP8 weights (dequantised in the
#           matmul) + FP8 KV, then FP8 x FP8 (w8a8) + FP8 KV: which weight path is faster, and
#           the gain                                      -> $OUT/fp8.jsonl
#   fp8_peer (opt-in, ~5 min) the peer_llama workload with --quantization fp8
#           --kv-cache-dtype fp8_e4m3 (compare with peer_llama: issue 48's target, 1.4x bf16's
#           request throughput)                           -> $OUT/fp8_peer.jsonl
#   table   the summary below                             -> $OUT/summary.txt
# GPU_CHECK_TINY=1 is the same as --tiny; GPU_CHECK_<SECTION>_TIMEOUT (DEVICE, KERNELS, BENCH,
# OVERLAP, LAYERS, IDLE, PALLAS, FEATURES, SIMCAL, PEER_QWEN, PEER_LLAMA, KSWEEP, KGRID, STEPS,
# WARMUP, FP8KERNELS, FP8, FP8_PEER, SPEC; seconds) override the limits.

set -u
cd "$(dirname "$0")/.."
TINY="${GPU_CHECK_TINY:-0}"
for arg in "$@"; do
  case "$arg" in
    --tiny) TINY=1 ;;
    -h|--help) sed -n '2,/^set -u/{/^set -u/d;p}' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python}"
command -v "$PY" > /dev/null || PY=python3
START=$(date +%s)

if [ "$TINY" = 1 ]; then
  DEVICE_TIMEOUT="${GPU_CHECK_DEVICE_TIMEOUT:-60}"
  KERNELS_TIMEOUT="${GPU_CHECK_KERNELS_TIMEOUT:-120}"
  BENCH_TIMEOUT="${GPU_CHECK_BENCH_TIMEOUT:-90}"
  OVERLAP_TIMEOUT="${GPU_CHECK_OVERLAP_TIMEOUT:-90}"
  LAYERS_TIMEOUT="${GPU_CHECK_LAYERS_TIMEOUT:-120}"
  IDLE_TIMEOUT="${GPU_CHECK_IDLE_TIMEOUT:-120}"
  PALLAS_TIMEOUT="${GPU_CHECK_PALLAS_TIMEOUT:-120}"
  FEATURES_TIMEOUT="${GPU_CHECK_FEATURES_TIMEOUT:-120}"
  SIMCAL_TIMEOUT="${GPU_CHECK_SIMCAL_TIMEOUT:-240}"
  PEER_QWEN_TIMEOUT="${GPU_CHECK_PEER_QWEN_TIMEOUT:-120}"
  PEER_LLAMA_TIMEOUT="${GPU_CHECK_PEER_LLAMA_TIMEOUT:-180}"
  KSWEEP_TIMEOUT="${GPU_CHECK_KSWEEP_TIMEOUT:-240}"
  KGRID_TIMEOUT="${GPU_CHECK_KGRID_TIMEOUT:-120}"
  STEPS_TIMEOUT="${GPU_CHECK_STEPS_TIMEOUT:-120}"
  WARMUP_TIMEOUT="${GPU_CHECK_WARMUP_TIMEOUT:-120}"
  FP8KERNELS_TIMEOUT="${GPU_CHECK_FP8KERNELS_TIMEOUT:-180}"
  FP8_TIMEOUT="${GPU_CHECK_FP8_TIMEOUT:-180}"
  FP8_PEER_TIMEOUT="${GPU_CHECK_FP8_PEER_TIMEOUT:-180}"
  SPEC_TIMEOUT="${GPU_CHECK_SPEC_TIMEOUT:-240}"
  MODEL="$OUT/tiny_model"
  WIDE_MODEL="$OUT/tiny_model_wide"  # SmolLM2's vocabulary, for its tokenizer
  ASSETS="$OUT/assets"
  KERNELS_ARGS=(--tiny --budget-s 0.05 --min-samples 1)
  KSWEEP_ARGS=(--tiny --budget-s 0.05 --min-samples 1)
  STEPS_ARGS=(--model "$MODEL" "$WIDE_MODEL" --num-seqs 4 8 --context 100 --prefill-tokens 160
              --prompt-len 64 --inner 2 --repeats 3)
  FP8_ARGS=(--model "$MODEL" --num-seqs 4 8 --context 100 --inner 2 --repeats 3)
  FP8KERNELS_ARGS=(--tiny --budget-s 0.05)
  WARMUP_ENGINE='{"load_format": "dummy", "skip_tokenizer_init": true, "max_total_tokens": 1024,
    "max_running_requests": 8}'
  IDLE_ARGS=(--model "$MODEL" --batch 8 --input-len 16 --steps 30 --warm 5)
  MATMUL=256
  COPY_MIB=16
  BENCH_ARGS=(--model "$MODEL" --load-format dummy --skip-tokenizer-init --dtype bfloat16
              --num-prompts 8 --random-input-len 32 --random-output-len 16
              --random-range-ratio 0.5 --max-running-requests 8 --max-total-tokens 1024
              --max-prefill-tokens 64 --min-token-bucket 64 --min-seq-bucket 8)
  OVERLAP_ARGS=(--model "$MODEL" --load-format dummy --skip-tokenizer-init --dtype bfloat16
                --num-prompts 16 --random-input-len 16 --random-output-len 16
                --max-running-requests 8 --max-total-tokens 1024 --max-prefill-tokens 64
                --min-token-bucket 64 --min-seq-bucket 8)
  PALLAS_ARGS=(--model "$MODEL" --load-format dummy --skip-tokenizer-init --dtype bfloat16
               --num-prompts 4 --random-input-len 32 --random-output-len 8
               --random-range-ratio 0.5 --max-running-requests 8 --max-total-tokens 1024
               --max-prefill-tokens 64 --min-token-bucket 64 --min-seq-bucket 8)
  PEER_QWEN_ARGS=(--model "$MODEL" --load-format dummy --skip-tokenizer-init --num-prompts 16
                  --random-input-len 32 --random-output-len 8 --random-range-ratio 1.0
                  --context-length 64 --max-running-requests 8 --max-total-tokens 1024
                  --max-prefill-tokens 64 --min-token-bucket 64 --min-seq-bucket 8)
  PEER_LLAMA_ARGS=(--model "$WIDE_MODEL" --load-format dummy --num-prompts 8
                   --context-length 128 --sharegpt-max-prompt-len 64
                   --max-running-requests 8 --max-total-tokens 2048
                   --max-prefill-tokens 64 --min-token-bucket 64 --min-seq-bucket 8)
  SPEC_MODELS="$WIDE_MODEL" SPEC_CONCURRENCY=8
  SPEC_ARGS=(--load-format dummy --num-prompts 4 --copy-max-len 16 --context-length 128
             --max-running-requests 8 --max-total-tokens 2048 --max-prefill-tokens 128
             --min-token-bucket 64 --min-seq-bucket 8)
else
  DEVICE_TIMEOUT="${GPU_CHECK_DEVICE_TIMEOUT:-20}"
  # the H200 run of 2026-12-04 took 63 s for our kernels; torch's peers add torch's import and
  # FlexAttention's compile for each decode case
  KERNELS_TIMEOUT="${GPU_CHECK_KERNELS_TIMEOUT:-150}"
  BENCH_TIMEOUT="${GPU_CHECK_BENCH_TIMEOUT:-240}"
  OVERLAP_TIMEOUT="${GPU_CHECK_OVERLAP_TIMEOUT:-60}"
  LAYERS_TIMEOUT="${GPU_CHECK_LAYERS_TIMEOUT:-80}"
  IDLE_TIMEOUT="${GPU_CHECK_IDLE_TIMEOUT:-90}"
  PALLAS_TIMEOUT="${GPU_CHECK_PALLAS_TIMEOUT:-150}"
  FEATURES_TIMEOUT="${GPU_CHECK_FEATURES_TIMEOUT:-90}"
  SIMCAL_TIMEOUT="${GPU_CHECK_SIMCAL_TIMEOUT:-150}"
  PEER_QWEN_TIMEOUT="${GPU_CHECK_PEER_QWEN_TIMEOUT:-300}"
  PEER_LLAMA_TIMEOUT="${GPU_CHECK_PEER_LLAMA_TIMEOUT:-420}"
  # ~119 variants, each compiled (1-2.6 s a call on the H200 of 2026-12-04) and timed for 0.3 s;
  # the warp-specialised ones last: a cut run loses those first
  KSWEEP_TIMEOUT="${GPU_CHECK_KSWEEP_TIMEOUT:-300}"
  KGRID_TIMEOUT="${GPU_CHECK_KGRID_TIMEOUT:-240}"
  STEPS_TIMEOUT="${GPU_CHECK_STEPS_TIMEOUT:-240}"
  WARMUP_TIMEOUT="${GPU_CHECK_WARMUP_TIMEOUT:-180}"
  FP8KERNELS_TIMEOUT="${GPU_CHECK_FP8KERNELS_TIMEOUT:-60}"
  FP8_TIMEOUT="${GPU_CHECK_FP8_TIMEOUT:-180}"
  FP8_PEER_TIMEOUT="${GPU_CHECK_FP8_PEER_TIMEOUT:-360}"
  SPEC_TIMEOUT="${GPU_CHECK_SPEC_TIMEOUT:-240}"
  MODEL=qwen3-0.6b
  WIDE_MODEL=llama-3-8b
  ASSETS="${GPU_CHECK_ASSETS:-./gpu_assets}"
  KERNELS_ARGS=(--budget-s 1)  # timed samples per row at most 1 s: the compiles dominate
  KSWEEP_ARGS=(--budget-s 0.3)
  STEPS_ARGS=(--model "$MODEL" "$WIDE_MODEL" --num-seqs 64 128 --context 2048
              --prefill-tokens 8192 --prompt-len 1024)
  # the bench section's engine: the defaults but its context (fitted to the workload)
  WARMUP_ENGINE='{"load_format": "dummy", "skip_tokenizer_init": true, "context_length": 2048}'
  FP8_ARGS=(--model "$MODEL" "$WIDE_MODEL" --num-seqs 64 256 --context 2048 --inner 5
            --repeats 3)
  FP8KERNELS_ARGS=(--budget-s 0.5)
  IDLE_ARGS=(--model "$MODEL" --batch 64 --steps 200 --warm 20)
  MATMUL=8192
  COPY_MIB=2048
  # 128 prompts (the nano-vllm workload has 256; halved to fit the limit), input and output
  # uniform in [100, 1024] (int(1024 * 0.098) = 100); the engine's defaults but the context,
  # fitted to the workload (2048)
  BENCH_ARGS=(--model "$MODEL" --num-prompts 128 --random-input-len 1024
              --random-output-len 1024 --random-range-ratio 0.098 --context-length 2048)
  # decode-heavy: 256 requests, input 16-32, output 64-128 tokens, 64 at a time; one decode
  # bucket (64) and one prefill bucket (2048) per run keep the two runs' compile short
  OVERLAP_ARGS=(--model "$MODEL" --dtype bfloat16 --num-prompts 256 --random-input-len 32
                --random-output-len 128 --random-range-ratio 0.5 --max-running-requests 64
                --max-total-tokens 65536 --max-prefill-tokens 2048 --min-token-bucket 2048
                --min-seq-bucket 64)
  # attention-heavy decode: 128 requests, input 512-1024, output 64-128 tokens, 64 at a time
  # (a full decode step reads ~64 x 800 tokens x 112 KiB of KV, several times the ~1.2 GB of
  # weights: arithmetic, not measured); one decode bucket (64) and one prefill bucket (2048)
  # per run
  PALLAS_ARGS=(--model "$MODEL" --dtype bfloat16 --num-prompts 128 --random-input-len 1024
               --random-output-len 128 --random-range-ratio 0.5 --max-running-requests 64
               --max-total-tokens 131072 --max-prefill-tokens 2048 --min-token-bucket 2048
               --min-seq-bucket 64)
  # the peers' workloads on the engine's defaults: vLLM's --max-model-len 2048 is the context
  PEER_QWEN_ARGS=(--model "$MODEL" --num-prompts 500 --random-input-len 512
                  --random-output-len 128 --random-range-ratio 1.0 --context-length 2048)
  # ShareGPT as vLLM's benchmark_serving.py (the peer's script) prunes it: prompt <= 1024,
  # prompt + output <= 2048
  PEER_LLAMA_ARGS=(--model "$WIDE_MODEL" --num-prompts 2000 --context-length 2048
                   --sharegpt-max-prompt-len 1024)
  # 16 copies of at most 128 tokens at a time of 1 and 8 requests: a context of 1024, 3 token
  # buckets (256 .. 1024: the prompts, and the verify steps) and one decode bucket (8)
  SPEC_MODELS="$MODEL $WIDE_MODEL" SPEC_CONCURRENCY="1 8"
  SPEC_ARGS=(--num-prompts 16 --copy-max-len 128 --context-length 1024
             --max-running-requests 8 --max-total-tokens 16384 --max-prefill-tokens 1024
             --min-token-bucket 256 --min-seq-bucket 8)
fi
SPEC_ARGS+=(--dtype bfloat16 --dataset sharegpt-copy --dataset-path "$ASSETS/sharegpt.json"
            --tokenizer "$ASSETS/smollm2" --compare speculative_method=none,ngram
            --peak-matmul-size "$MATMUL" --peak-copy-mib "$COPY_MIB" --disable-tqdm
            --output-json "$OUT/spec.jsonl")
PEER_QWEN_ARGS+=(--dataset random --peak-matmul-size "$MATMUL"
                 --peak-copy-mib "$COPY_MIB" --disable-tqdm --output-json "$OUT/peer_qwen.jsonl")
PEER_LLAMA_ARGS+=(--dataset sharegpt --dataset-path "$ASSETS/sharegpt.json"
                  --tokenizer "$ASSETS/smollm2" --peak-matmul-size "$MATMUL"
                  --peak-copy-mib "$COPY_MIB" --disable-tqdm)
FP8_PEER_ARGS=("${PEER_LLAMA_ARGS[@]}" --quantization fp8 --kv-cache-dtype fp8_e4m3
               --output-json "$OUT/fp8_peer.jsonl")
PEER_LLAMA_ARGS+=(--output-json "$OUT/peer_llama.jsonl")
FP8_ARGS+=(--mode decode --dtype bfloat16 --quantization none fp8 fp8_w8a8
           --kv-cache-dtype auto fp8_e4m3 fp8_e4m3 --matmul-size "$MATMUL" --copy-mib "$COPY_MIB"
           --output-json "$OUT/fp8.jsonl")
FP8KERNELS_ARGS+=(--output-json "$OUT/fp8kernels.json")
LAYERS_ARGS=("${OVERLAP_ARGS[@]}" --compare layer_loop=unroll,scan --peak-matmul-size "$MATMUL"
             --peak-copy-mib "$COPY_MIB" --disable-tqdm --output-json "$OUT/layers.jsonl")
FEATURES_ARGS=("${OVERLAP_ARGS[@]}" --compare logprobs=none,5,none
               --compare repetition_penalty=1.0,1.0,1.1 --peak-matmul-size "$MATMUL"
               --peak-copy-mib "$COPY_MIB" --disable-tqdm --output-json "$OUT/features.jsonl")
OVERLAP_ARGS+=(--compare enable_overlap=True,False --peak-matmul-size "$MATMUL"
               --peak-copy-mib "$COPY_MIB" --disable-tqdm --output-json "$OUT/overlap.jsonl")
PALLAS_ARGS+=(--compare attention_backend=pallas,pallas_mgpu --peak-matmul-size "$MATMUL"
              --peak-copy-mib "$COPY_MIB" --disable-tqdm --output-json "$OUT/pallas.jsonl")
STEPS_ARGS+=(--dtype bfloat16 --matmul-size "$MATMUL" --copy-mib "$COPY_MIB" --profile
            --output-json "$OUT/steps.jsonl")
KGRID_ARGS=("${KSWEEP_ARGS[@]}" --skip-correctness --skip-timings --grid
            --output-json "$OUT/kgrid.json")
KSWEEP_ARGS+=(--skip-correctness --skip-timings --sweep --output-json "$OUT/ksweep.json")
if [ "$TINY" != 1 ]; then  # measured choices: the tuning tables' rows of this device and shape
  mkdir -p "$OUT/tuning" && cp -n pallas_kernels/tuning/*.json "$OUT/tuning/"
  KSWEEP_ARGS+=(--write-tuning "$OUT/tuning")
  KGRID_ARGS+=(--write-tuning "$OUT/tuning")
fi
KERNELS_ARGS+=(--output-json "$OUT/kernels.json")
SIMCAL_ARGS=(--calibrate --model "$MODEL" --dtype bfloat16 --output-json "$OUT/simcal.jsonl")
[ "$TINY" = 1 ] && SIMCAL_ARGS+=(--replays 2)
IDLE_ARGS+=(--dtype bfloat16 --output-json "$OUT/idle.jsonl")
BENCH_ARGS+=(--peak-matmul-size "$MATMUL" --peak-copy-mib "$COPY_MIB" --disable-tqdm
             --output-json "$OUT/bench.jsonl" --plot "$OUT/bench.png")

declare -A STATUS
SECTIONS=" ${GPU_CHECK_SECTIONS:-device kernels bench overlap layers idle pallas} "
section() {  # section NAME TIMEOUT_S COMMAND...: run it with a limit, log it, record its status
  local name=$1 limit=$2; shift 2
  if [ "$name" != table ] && [[ "$SECTIONS" != *" $name "* ]]; then
    echo "[$name] skipped (GPU_CHECK_SECTIONS)"; return
  fi
  local t0 rc
  t0=$(date +%s)
  echo "[$name] running (limit ${limit}s, log $OUT/$name.log)"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  case $rc in
    0) STATUS[$name]="ok" ;;
    124|137) STATUS[$name]="TIMED OUT after ${limit}s" ;;
    *) STATUS[$name]="FAILED (exit $rc)" ;;
  esac
  echo "[$name] ${STATUS[$name]} in $(( $(date +%s) - t0 ))s"
  [ $rc = 0 ] || tail -n 15 "$OUT/$name.log" | sed "s/^/[$name]   /"
}

rm -f "$OUT/bench.jsonl" "$OUT/overlap.jsonl" "$OUT/layers.jsonl" "$OUT/idle.jsonl" "$OUT/pallas.jsonl" "$OUT/kernels.json" \
  "$OUT/features.jsonl" "$OUT/simcal.jsonl" "$OUT/peer_qwen.jsonl" "$OUT/peer_llama.jsonl" \
  "$OUT/ksweep.json" "$OUT/kgrid.json" "$OUT/steps.jsonl" "$OUT/warmup.jsonl" \
  "$OUT/fp8kernels.json" "$OUT/fp8.jsonl" "$OUT/fp8_peer.jsonl" "$OUT/spec.jsonl" \
  "$OUT/device.json" \
  "$OUT/summary.txt"

if [ "$TINY" = 1 ]; then  # a config-only Llama (dummy weights), written without Python
  mkdir -p "$MODEL"
  cat > "$MODEL/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
 "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
 "max_position_embeddings": 128,
 "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "hidden_act": "silu",
 "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2}
JSON
  mkdir -p "$WIDE_MODEL"
  sed 's/"vocab_size": 256/"vocab_size": 49152/' "$MODEL/config.json" > "$WIDE_MODEL/config.json"
  if [[ "$SECTIONS" == *" peer_llama "* || "$SECTIONS" == *" fp8_peer "* || "$SECTIONS" == *" spec "* ]]; then
    "$PY" benchmarks/gpu_assets.py --records 400 --out "$ASSETS" > /dev/null
  fi
fi

section device "$DEVICE_TIMEOUT" "$PY" -c "
import json, sys, time
import jax, jax.numpy as jnp
from minijax_serve.executor import ceilings
out = sys.argv[1]
dev = jax.devices()[0]
import flax, transformers
info = {'jax_version': jax.__version__, 'flax_version': flax.__version__,
        'transformers_version': transformers.__version__, 'backend': jax.default_backend(),
        'device_kind': dev.device_kind, 'num_devices': jax.device_count(),
        'devices': [str(d) for d in jax.devices()], 'memory_stats': dev.memory_stats()}
print(json.dumps(info, indent=1, default=str), flush=True)
json.dump(info, open(out, 'w'), indent=1, default=str)
for dtype in ('bfloat16', 'float32'):
    info['matmul_peak_flops_' + dtype] = ceilings.matmul_peak_flops(jnp.dtype(dtype), int(sys.argv[2]))
    print(dtype, 'matmul peak', info['matmul_peak_flops_' + dtype] / 1e12, 'TFLOP/s', flush=True)
    json.dump(info, open(out, 'w'), indent=1, default=str)
info['matmul_size'] = int(sys.argv[2])
info['copy_mib'] = int(sys.argv[3])
info['copy_bytes_per_s'] = ceilings.copy_bandwidth(int(sys.argv[3]))
print('copy bandwidth', info['copy_bytes_per_s'] / 1e9, 'GB/s', flush=True)
json.dump(info, open(out, 'w'), indent=1, default=str)
" "$OUT/device.json" "$MATMUL" "$COPY_MIB"

section kernels "$KERNELS_TIMEOUT" "$PY" benchmarks/kernels/bench_kernels.py "${KERNELS_ARGS[@]}"
# bench and overlap run the default backend ("auto": Pallas on a GPU) only when both Pallas
# kernels passed their correctness checks above, else the jnp reference ("xla"): one broken
# kernel must not cost the engine's figures
ENGINE_BACKEND=(--attention-backend xla)
if [ -z "${STATUS[kernels]:-}" ]; then  # not run this time: the default backend
  ENGINE_BACKEND=()
elif "$PY" - "$OUT/kernels.json" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])][-1].get("correctness", [])
passed = {r["impl"] for r in rows if r.get("ok")} - {r["impl"] for r in rows if not r.get("ok")}
sys.exit(0 if {"pallas_ragged", "pallas_decode"} <= passed else 1)
PYEOF
then
  ENGINE_BACKEND=()
else
  echo "[kernels] a Pallas kernel failed or went unchecked: bench and overlap use the xla backend"
fi
section bench "$BENCH_TIMEOUT" "$PY" -m minijax_serve bench "${BENCH_ARGS[@]}" "${ENGINE_BACKEND[@]}"
section overlap "$OVERLAP_TIMEOUT" "$PY" -m minijax_serve bench "${OVERLAP_ARGS[@]}" \
  "${ENGINE_BACKEND[@]}"
section layers "$LAYERS_TIMEOUT" "$PY" -m minijax_serve bench "${LAYERS_ARGS[@]}" \
  "${ENGINE_BACKEND[@]}"
# overlap on, then off (the second run's compile comes from the compilation cache)
section idle "$IDLE_TIMEOUT" bash -c '"$0" benchmarks/device_idle.py "$@" &&
  "$0" benchmarks/device_idle.py "$@" --no-overlap' "$PY" "${IDLE_ARGS[@]}" "${ENGINE_BACKEND[@]}"
section pallas "$PALLAS_TIMEOUT" "$PY" -m minijax_serve bench "${PALLAS_ARGS[@]}"
section features "$FEATURES_TIMEOUT" "$PY" -m minijax_serve bench "${FEATURES_ARGS[@]}" \
  "${ENGINE_BACKEND[@]}"
section simcal "$SIMCAL_TIMEOUT" "$PY" benchmarks/simulate_validate.py "${SIMCAL_ARGS[@]}"
section peer_qwen "$PEER_QWEN_TIMEOUT" "$PY" -m minijax_serve bench "${PEER_QWEN_ARGS[@]}" \
  "${ENGINE_BACKEND[@]}"
section peer_llama "$PEER_LLAMA_TIMEOUT" "$PY" -m minijax_serve bench "${PEER_LLAMA_ARGS[@]}" \
  "${ENGINE_BACKEND[@]}"
section ksweep "$KSWEEP_TIMEOUT" "$PY" benchmarks/kernels/bench_kernels.py "${KSWEEP_ARGS[@]}"
section kgrid "$KGRID_TIMEOUT" "$PY" benchmarks/kernels/bench_kernels.py "${KGRID_ARGS[@]}"
section steps "$STEPS_TIMEOUT" "$PY" benchmarks/step_roofline.py "${STEPS_ARGS[@]}" \
  "${ENGINE_BACKEND[@]}"
# each model at concurrency 1, then 8 (--tiny: 8 only); each run n-gram against none
section spec "$SPEC_TIMEOUT" bash -c 'py=$0 models=$1 levels=$2; shift 3; for m in $models; do
  for c in $levels; do "$py" -m minijax_serve bench --model "$m" --max-concurrency "$c" "$@" ||
  exit 1; done; done' "$PY" "$SPEC_MODELS" "$SPEC_CONCURRENCY" -- "${SPEC_ARGS[@]}" \
  "${ENGINE_BACKEND[@]}"
section warmup "$WARMUP_TIMEOUT" "$PY" benchmarks/compile_cache.py --model "$MODEL" \
  --workers 1,0 --engine "$WARMUP_ENGINE" --output-json "$OUT/warmup.jsonl"
section fp8kernels "$FP8KERNELS_TIMEOUT" "$PY" benchmarks/kernels/fp8_kernels.py \
  "${FP8KERNELS_ARGS[@]}"
section fp8 "$FP8_TIMEOUT" "$PY" benchmarks/step_roofline.py "${FP8_ARGS[@]}" \
  "${ENGINE_BACKEND[@]}"
section fp8_peer "$FP8_PEER_TIMEOUT" "$PY" -m minijax_serve bench "${FP8_PEER_ARGS[@]}" \
  "${ENGINE_BACKEND[@]}"

STATUS_TEXT=""
for name in device kernels bench overlap layers idle pallas features simcal peer_qwen peer_llama \
    ksweep kgrid steps spec warmup fp8kernels fp8 fp8_peer; do
  [ -n "${STATUS[$name]:-}" ] && STATUS_TEXT+="$name: ${STATUS[$name]}; "
done
section table 10 "$PY" - "$OUT" "$STATUS_TEXT" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys
from pathlib import Path

out, status, elapsed = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return {}

def load_lines(name):
    if not (out / name).is_file():
        return []
    rows = []
    for line in (out / name).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut by a timeout
            pass
    return rows

dev = load("device.json")
runs = load_lines("bench.jsonl")
b = runs[-1] if runs else {}
overlap = load_lines("overlap.jsonl") + load_lines("layers.jsonl") + load_lines("features.jsonl")
pallas = load_lines("pallas.jsonl")
kernel_runs = load_lines("kernels.json")
k = kernel_runs[-1] if kernel_runs else {}

def f(value, scale=1.0, fmt="{:.1f}", unit=""):
    return "-" if value is None else fmt.format(value / scale) + unit

rows = [
    ("device", f"{dev.get('device_kind', b.get('device', '-'))} x{dev.get('num_devices', '-')} "
               f"({dev.get('backend', b.get('backend', '-'))}, jax {dev.get('jax_version', '-')})"),
    ("matmul peak bf16 / f32",
     f"{f(dev.get('matmul_peak_flops_bfloat16'), 1e12, '{:.4g}', ' TFLOP/s')} / "
     f"{f(dev.get('matmul_peak_flops_float32'), 1e12, '{:.4g}', ' TFLOP/s')} "
     f"({dev.get('matmul_size', '-')}^2)"),
    ("copy bandwidth (read+write)",
     f"{f(dev.get('copy_bytes_per_s'), 1e9, unit=' GB/s')} ({dev.get('copy_mib', '-')} MiB)"),
]
if b:
    w = b.get("workload", {})
    rows += [
        ("bench", f"{b.get('model')} {b.get('dtype')}: {b.get('completed')}/{b.get('num_requests')} "
                  f"requests, in {w.get('random_input_len')}, out {w.get('random_output_len')} "
                  f"(ratio {w.get('random_range_ratio')})"),
        ("  duration / warm-up compile",
         f"{f(b.get('duration_s'), unit=' s')} / {f(b.get('compile_time_s'), unit=' s')} "
         f"({b.get('num_compiled_shapes')} shapes; {b.get('num_compilations_after', 0) - b.get('num_compilations_before', 0)} during the run)"),
        ("  output / total tokens/s",
         f"{f(b.get('output_throughput'))} / {f(b.get('total_throughput'))}"),
        ("  MFU (vs the run's matmul peak)",
         f"{f(b.get('mfu'), 0.01, '{:.2f}', ' %')} ({f(b.get('achieved_flops_per_s'), 1e12, '{:.4g}', ' TFLOP/s')})"),
        ("  decode bandwidth utilisation",
         f"{f(b.get('decode_bandwidth_utilisation'), 0.01, '{:.2f}', ' %')} "
         f"({f(b.get('decode_bandwidth_bytes_per_s'), 1e9, '{:.4g}', ' GB/s')}; mean step "
         f"{f(b.get('mean_decode_step_ms'), fmt='{:.2f}', unit=' ms')} for "
         f"{f(b.get('mean_decode_batch'), fmt='{:.0f}')} requests)"),
        ("  median TTFT / TPOT / ITL",
         f"{f(b.get('median_ttft_ms'), unit=' ms')} / {f(b.get('median_tpot_ms'), fmt='{:.2f}', unit=' ms')}"
         f" / {f(b.get('median_itl_ms'), fmt='{:.2f}', unit=' ms')}"),
    ]
else:
    rows.append(("bench", "no result (see bench.log)"))
for r in overlap:
    rows.append((f"{r['compare']['field']}={r['compare']['value']}",
                 f"{f(r.get('output_throughput'))} out tok/s; per step: host "
                 f"{f(r.get('mean_host_ms_per_step'), fmt='{:.2f}', unit=' ms')}, blocked "
                 f"{f(r.get('mean_blocked_ms_per_step'), fmt='{:.2f}', unit=' ms')}, decode step "
                 f"{f(r.get('mean_decode_step_ms'), fmt='{:.2f}', unit=' ms')}; device idle <= "
                 f"{f(r.get('device_idle_fraction'), 0.01, unit=' %')}; compile "
                 f"{f(r.get('compile_time_s'), unit=' s')}"))
if not overlap:
    rows.append(("overlap", "no result (see overlap.log)"))
for r in load_lines("idle.jsonl"):
    rows.append((f"idle, batch {r['batch']}, overlap {'on' if r['enable_overlap'] else 'off'}",
                 f"tick {r['tick_ms']:.2f} ms, device step alone {r['device_step_ms']:.2f} ms, "
                 f"host {r['host_ms_per_tick']:.2f} ms, blocked {r['blocked_ms_per_tick']:.2f} ms"
                 f" per tick; device idle ~{100 * r['device_idle_fraction']:.1f} % "
                 f"({r['layer_loop']}, {r['attention_backend']})"))
if k:
    rows.append(("kernels", f"{k.get('device_kind')} ({k.get('backend')}"
                            f"{', interpret' if k.get('interpret') else ''}), "
                            f"{'tiny' if k.get('tiny') else 'qwen3-0.6b'} shape; copy "
                            f"{f(k.get('copy_bytes_per_s'), 1e9, unit=' GB/s')} (read+write), "
                            f"bf16 matmul {f(k.get('matmul_bf16_flops_per_s'), 1e12, '{:.4g}', ' TF/s')}"
                            f"; torch {k.get('torch_version') or 'absent: no peers'}"
                            f"{'' if k.get('complete') else '; INCOMPLETE (cut short)'}"))
    checks = {}
    for c in k.get("correctness", []):
        checks.setdefault(f"  {c['case']} {c['impl']}", []).append(
            f"{c['dtype']} " + ("ERROR" if "error" in c else f"{c['rel_err']:.1e} "
            f"{'ok' if c['ok'] else ('FAIL' if c['required'] else 'above (info)')}"))
    rows += [(name, "; ".join(items) + "  (||out-ref||/||ref||)") for name, items in checks.items()]
    cases = {}
    for t in k.get("timings", []):
        cases.setdefault(t["case"], []).append(
            f"{t['impl']} ERROR" if "error" in t else
            f"{t['impl']} {t['median_s'] * 1e3:.3f} ms {t['fraction_of_copy'] * 100:.0f}%"
            + ("" if t["case"].startswith("decode") else f" {t['flops_per_s'] / 1e12:.0f} TF/s"))
    for case, items in cases.items():
        rows.append((f"  {case}", "; ".join(items) + "  (bf16, % of copy bw, attention FLOP/s)"))
    for v in k.get("versus_peers", []):
        rows.append((f"  {v['case']} vs {v['peer']}", f"{v['ours']} at {v['speed']:.2f}x the "
                     f"peer's speed ({v['ours_ms']:.3f} vs {v['peer_ms']:.3f} ms)"))
else:
    rows.append(("kernels", "no result (see kernels.log)"))
for r in pallas:
    rows.append((f"{r['compare']['field']}={r['compare']['value']}",
                 f"{f(r.get('output_throughput'))} out tok/s; decode step "
                 f"{f(r.get('mean_decode_step_ms'), fmt='{:.2f}', unit=' ms')} for "
                 f"{f(r.get('mean_decode_batch'), fmt='{:.0f}')} requests "
                 f"({f(r.get('decode_bandwidth_utilisation'), 0.01, unit=' %')} of copy bw); "
                 f"median TPOT {f(r.get('median_tpot_ms'), fmt='{:.2f}', unit=' ms')}, TTFT "
                 f"{f(r.get('median_ttft_ms'), unit=' ms')}; prefill steps "
                 f"{f(r.get('prefill_time_s'), fmt='{:.2f}', unit=' s')}; compile "
                 f"{f(r.get('compile_time_s'), unit=' s')}"))
if not pallas:
    rows.append(("pallas vs pallas_mgpu", "no result (see pallas.log)"))
PEERS = {"peer_qwen": "vLLM 0.19.0, 1 x H100: 94.91 req/s, mean TTFT 2,905 ms, TPOT 5.45 ms",
         "peer_llama": "SGLang 0.3.2, 2 GPUs: 24,023 total tok/s; vLLM 0.6.3: 22,116",
         "fp8_peer": "peer_llama in FP8 weights and KV; issue 48's target: 1.4x its req/s"}
for name, peer in PEERS.items():
    for r in load_lines(name + ".jsonl"):
        rows.append((name, f"{f(r.get('request_throughput'), fmt='{:.2f}')} req/s, "
                           f"{f(r.get('total_throughput'))} total tok/s, mean TTFT "
                           f"{f(r.get('mean_ttft_ms'), unit=' ms')}, TPOT "
                           f"{f(r.get('mean_tpot_ms'), fmt='{:.2f}', unit=' ms')} (peer: {peer})"))
for c in load_lines("simcal.jsonl"):
    rows.append(("simulated accelerator fit",
                 f"{c['steps']} steps: matmul {c['matmul_eff']}, memory {c['memory_eff']}, "
                 f"attention {c['attention_flops_eff']} / {c['attention_bw_eff']}, launch "
                 f"{f(c['launch_s'], 1e-3, '{:.3f}', ' ms')}, dispatch "
                 f"{f(c['dispatch_s'], 1e-3, '{:.3f}', ' ms')}; error median "
                 f"{f(c['median_error'], 0.01, unit=' %')}"))
ksweep = (load_lines("ksweep.json") or [{}])[-1].get("sweep", [])
for case in dict.fromkeys(r["case"] for r in ksweep):
    timed = [r for r in ksweep if r["case"] == case and "median_s" in r]
    errors = sum(1 for r in ksweep if r["case"] == case and "error" in r)
    if timed:
        r = min(timed, key=lambda r: r["median_s"])
        rows.append((f"ksweep {case}", f"best {r['impl']} {r['median_s'] * 1e3:.3f} ms, "
                     f"{r['fraction_of_copy'] * 100:.0f} % of copy bw, "
                     f"{r['flops_per_s'] / 1e12:.1f} TFLOP/s ({len(timed)} timed, "
                     f"{errors} errors)"))
kgrid = (load_lines("kgrid.json") or [{}])[-1]
if kgrid.get("routing"):
    route, ratios = kgrid["routing"], {}
    for r in kgrid.get("grid", []):
        if "median_s" in r:
            ratios.setdefault(r["case"], {})[r["impl"]] = r["median_s"]
    worst = max((min(t.get("pallas_decode", 1e9), t.get("pallas_ragged", 1e9)) / t["jax_paged"]
                 for t in ratios.values() if "jax_paged" in t), default=None)
    programs = route["ragged_wins_from_programs"]
    wins = ("the decode kernel wins at the largest batch" if programs is None else
            f"ragged wins at every context from {programs} programs (batch x KV heads)")
    rows.append(("kgrid decode routing",
                 f"{wins}; ours beat jax_paged everywhere: "
                 f"{route['ours_beat_jax_paged_everywhere']} (worst ours / jax "
                 f"{f(worst, fmt='{:.2f}')}; {len(route['points'])} points)"))
for r in load_lines("steps.jsonl"):
    rows.append((f"steps {Path(r['model']).name} {r['mode']} x{r['num_seqs']}",
                 f"{r['step_s'] * 1e3:.3f} ms for {r['new_tokens']} new / {r['kv_tokens']} KV "
                 f"tokens: {r['bandwidth_share'] * 100:.1f} % of copy bw, MFU "
                 f"{r['mfu'] * 100:.1f} % ({r['attention_backend']})"))
fp8k = load("fp8kernels.json").get("rows", [])
for r in fp8k:
    if r["kind"] == "check":
        rows.append((f"fp8 check {r['case']} {r['impl']}",
                     f"{r['rel_err']:.1e} vs the reference on the same FP8 pools "
                     f"({'ok' if r['rel_err'] < 2e-2 else 'FAIL'})"))
times = {}
for r in fp8k:
    if r["kind"] == "time":
        times.setdefault(f"fp8 kernel {r['case']} {r['impl']}", []).append(
            f"{r['kv']} {r['median_s'] * 1e3:.3f} ms ({r['bytes'] / r['median_s'] / 1e9:.0f} GB/s)")
rows += [(name, "; ".join(items)) for name, items in times.items()]
steps8 = load_lines("fp8.jsonl")
bf16 = {(r["model"], r["num_seqs"]): r["step_s"] for r in steps8 if r.get("quantization") is None}
for r in steps8:
    base = bf16.get((r["model"], r["num_seqs"]))
    rows.append((f"fp8 {Path(r['model']).name} decode x{r['num_seqs']}",
                 f"weights {r.get('quantization') or 'bf16'}, KV {r.get('kv_cache_dtype')}: "
                 f"{r['step_s'] * 1e3:.3f} ms"
                 + ("" if base is None else f" ({base / r['step_s']:.2f}x bf16's speed)")
                 + f"; {r['bandwidth_share'] * 100:.1f} % of copy bw"))
for r in load_lines("spec.jsonl"):
    rows.append((f"spec {Path(r['model']).name} at {r['max_concurrency']}, "
                 f"{r['compare']['value']}",
                 f"mean ITL {f(r.get('mean_itl_ms'), fmt='{:.2f}', unit=' ms')}, TPOT "
                 f"{f(r.get('mean_tpot_ms'), fmt='{:.2f}', unit=' ms')}; acceptance "
                 f"{f(r.get('spec_acceptance_rate'), 0.01, unit=' %')}, accepted length "
                 f"{f(r.get('spec_accept_length'), fmt='{:.2f}')}; "
                 f"{f(r.get('output_throughput'))} out tok/s"))
for r in load_lines("warmup.jsonl"):
    rows.append((f"cold warm-up, {r['workers']} workers",
                 f"{r['warmup_s']:.1f} s for {r['programs']} programs (empty cache)"))
rows.append(("sections", status + f"{elapsed} s before the table"))
width = max(len(name) for name, _ in rows) + 2
text = "\n".join(["=" * 30 + " gpu_check summary " + "=" * 30]
                 + [f"{name:<{width}}{value}" for name, value in rows] + ["=" * 79])
print(text)
(out / "summary.txt").write_text(text + "\n")
EOF
cat "$OUT/table.log"
echo "total $(( $(date +%s) - START ))s; logs and JSON in $OUT"
