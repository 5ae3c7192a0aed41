"""FP8 under tensor parallelism (forced CPU devices, a subprocess): FP8 weights with their scales
split with their columns and an FP8 KV cache with its scales split with the KV heads (replicated
with them at tp = 4 over 2 KV heads) serve the tokens of tp = 1 under the radix cache, chunked +
mixed prefill, forced retracts and overlap; each device holds 1/tp of the FP8 weights (the
tp_worker's byte count)."""

from __future__ import annotations

from tests.executor.test_tensor_parallel import BUSY, run_worker, save_gqa_llama

FP8 = dict(BUSY, quantization="fp8", kv_cache_dtype="fp8_e4m3")


def test_fp8_tp_tokens_equal_tp1(tiny_prompts, tmp_path):
    model = str(save_gqa_llama(tmp_path / "gqa_llama", 304, tied=False))
    prompts = tiny_prompts[::3] + tiny_prompts[-2:]
    cases = [dict(name="fp8 tp1", model=model, tp=1, config=FP8),
             dict(name="fp8 tp4 (KV heads and their scales replicated)", model=model, tp=4,
                  config=FP8)]
    got = run_worker(tmp_path, prompts, cases)
    assert got["fp8 tp4 (KV heads and their scales replicated)"] == got["fp8 tp1"]
