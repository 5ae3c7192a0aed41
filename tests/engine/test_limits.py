"""Limits sized from the device (engine/limits.py): SGLang's rules on accelerators, a modest
budget on a CPU, the simulator sizing as the engine, the startup line, the flags."""

from __future__ import annotations

import argparse
import logging

import pytest

from minijax_serve import Engine, EngineConfig, SamplingParams
from minijax_serve.config.flags import add_engine_args, engine_config_from_args
from minijax_serve.engine.limits import (GIB, MAX_RUNNING, DeviceMemory, accelerator_chunk,
                                         resolve_limits, running_from_pool, slot_row_bytes)
from tests.engine.test_engine import assert_idle_and_clean

H200 = DeviceMemory("gpu", 141e9, 90e9)


def test_accelerator_limits_follow_the_device():
    limits = resolve_limits(EngineConfig(), H200, 131072, 2048, 2)
    assert limits.pool_tokens == int(0.85 * 90e9 / 131072) // 16 * 16  # not capped by running
    assert limits.max_running_requests == 4096  # SGLang: pool / context x 512, in [2048, 4096]
    assert (limits.chunked_prefill_size, limits.max_prefill_tokens, limits.mixed) == (8192, 16384,
                                                                                     True)
    chosen = resolve_limits(EngineConfig(max_running_requests=256, chunked_prefill_size=2048,
                                         max_prefill_tokens=4096, enable_mixed_chunk=False),
                            H200, 131072, 2048, 2)
    assert chosen[:2] == (limits.pool_tokens, 256)  # a chosen cap leaves the pool as it is
    assert (chosen.chunked_prefill_size, chosen.max_prefill_tokens, chosen.mixed) == (
        2048, 4096, False)
    off = resolve_limits(EngineConfig(chunked_prefill_size=-1), H200, 131072, 2048, 2)
    assert off.chunked_prefill_size is None and not off.mixed  # unified steps need chunks
    # speculative decoding: a verify step's rows (k + 1 a request) as many as a decode step's
    spec = resolve_limits(EngineConfig(speculative_method="ngram", num_speculative_tokens=3),
                          H200, 131072, 2048, 2)
    assert spec[:2] == (limits.pool_tokens, 4096 // 4)
    chosen_spec = resolve_limits(EngineConfig(speculative_method="ngram",
                                              max_running_requests=512), H200, 131072, 2048, 2)
    assert chosen_spec.max_running_requests == 512  # a chosen cap is the user's


def test_the_slots_penalty_rows_come_out_of_the_free_memory():
    """Each slot's count and bias rows (8 bytes a vocabulary entry, on every device) are reserved
    before the pool is sized: the pool and the rows of max_running_requests + 1 slots fill the
    free memory's share to within a page, whatever sized the cap."""
    row = slot_row_bytes(128256)  # Llama-3-8B's vocabulary: 1 MB a slot
    free = 0.85 * 90e9
    for config, memory in ((EngineConfig(), H200),  # the cap from the pool (4096 here)
                           (EngineConfig(max_running_requests=256), H200),  # the user's cap
                           (EngineConfig(), DeviceMemory("gpu", 24 * GIB, 7e9))):  # 3328 run
        limits = resolve_limits(config, memory, 131072, 2048, 2, row)
        share = 0.85 * memory.free_bytes
        used = limits.pool_tokens * 131072 + (limits.max_running_requests + 1) * row
        assert share - 16 * 131072 < used <= share, (config, limits)
    assert resolve_limits(EngineConfig(), H200, 131072, 2048, 2, row).max_running_requests == 4096
    assert limits.max_running_requests == 3328 < MAX_RUNNING  # the spare rows went to the pool
    without = resolve_limits(EngineConfig(), H200, 131072, 2048, 2)
    assert without.pool_tokens * 131072 > free - 16 * 131072  # no rows: the whole share
    cpu = resolve_limits(EngineConfig(), DeviceMemory("cpu", 8 * GIB, 1 * GIB), 1 << 20, 8192, 4,
                         row)  # the free memory's option, less the CPU's 64 + 1 rows
    assert cpu.pool_tokens == int((0.85 * GIB - 65 * row) / (1 << 20)) // 16 * 16


@pytest.mark.parametrize("gib,chunk", [(24, 2048), (40, 4096), (80, 8192), (141e9 / GIB, 8192),
                                       (192, 16384)])
def test_chunk_by_the_device_memory(gib, chunk):
    assert accelerator_chunk(gib * GIB) == chunk
    page_48 = resolve_limits(EngineConfig(page_size=48), DeviceMemory("gpu", gib * GIB, 1e9),
                             1024, 4096, 2)
    assert page_48.chunked_prefill_size == chunk // 48 * 48  # whole pages


def test_running_requests_from_the_pool():
    assert running_from_pool(2_000_000, 2048) == 4096  # capped
    assert running_from_pool(400_000, 131072) == 2048  # at least 2048 ...
    assert running_from_pool(3000, 2048) == 1500  # ... but never over half the pool's tokens
    assert running_from_pool(1_000_000, 200_000) == 2560


def test_cpu_pool_is_modest():
    memory = DeviceMemory("cpu", 64 * GIB, 40 * GIB)
    small = resolve_limits(EngineConfig(), memory, 1024, 128, 4)  # 64 x 128 tokens
    assert small.pool_tokens == 64 * 128 and small.max_running_requests == 64
    assert small.pool_rule.startswith("max_running_requests × context")
    assert (small.chunked_prefill_size, small.max_prefill_tokens, small.mixed) == (512, 4096,
                                                                                  False)
    big = resolve_limits(EngineConfig(), memory, 1 << 20, 8192, 4)  # 1 MiB a token
    assert big.pool_tokens == 4096 and big.pool_rule.startswith("4 GiB")
    # bfloat16 on a CPU: the step converts the pools to float32 (twice their bytes) beside them
    assert resolve_limits(EngineConfig(), memory, 1 << 20, 8192, 2).pool_tokens == 4096 // 3 // 16 * 16
    # two devices of this process share the host's budget
    shared = resolve_limits(EngineConfig(), DeviceMemory("cpu", 64 * GIB, 20 * GIB, 2), 1 << 20,
                            8192, 4)
    assert shared.pool_tokens == 2048
    tight = resolve_limits(EngineConfig(), DeviceMemory("cpu", 8 * GIB, 1 * GIB), 1 << 20, 8192, 4)
    assert tight.pool_tokens == int(0.85 * 1024) // 16 * 16 and "free memory" in tight.pool_rule
    chosen = resolve_limits(EngineConfig(max_total_tokens=512), memory, 1 << 20, 8192, 4)
    assert chosen.pool_tokens == 512 and chosen.max_running_requests == 64  # the CPU's 64 still


def test_a_chosen_pool_keeps_the_devices_chunk(monkeypatch):
    """max_total_tokens on an accelerator: the chunk's tier still from the device's memory
    (read locally: no collective), as the simulator sizes it."""
    from minijax_serve.engine import setup
    from minijax_serve.models.config import ModelConfig

    asked = []
    monkeypatch.setattr(setup, "device_memory", lambda tp, agree=True: asked.append(agree) or H200)
    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e4)
    limits = setup.device_limits(EngineConfig(max_total_tokens=4096), cfg, "bfloat16", 2048)
    assert (limits.pool_tokens, limits.chunked_prefill_size, asked) == (4096, 8192, [False])


def test_simulated_engine_sizes_as_the_device(caplog):
    with caplog.at_level(logging.INFO, logger="minijax_serve"):
        engine = Engine("llama-3-8b", simulate="h200", skip_tokenizer_init=True,
                        context_length=2048)
    config = engine.config  # what the device left open, resolved
    assert (config.max_running_requests, config.chunked_prefill_size, config.max_prefill_tokens,
            config.enable_mixed_chunk) == (4096, 8192, 16384, True)
    assert config.max_total_tokens == engine.kv_pool_tokens > 500_000
    assert engine.buckets.seqs[-1] == 4096 and not engine.buckets.split_decode
    assert f"KV pool {engine.kv_pool_tokens} tokens" in caplog.text
    assert "0.85 of the free memory" in caplog.text and "steps unified" in caplog.text


def test_cpu_engine_defaults(tiny_dir, tiny_prompts, tiny_greedy_refs, caplog):
    with caplog.at_level(logging.INFO, logger="minijax_serve"):
        engine = Engine(tiny_dir["llama"], skip_tokenizer_init=True, min_seq_bucket=16,
                        min_token_bucket=64, chunked_prefill_size=64)
    assert engine.kv_pool_tokens == 64 * 128  # max_running_requests x the context (128)
    assert "max_running_requests × context = 64 × 128" in caplog.text
    assert not engine.config.enable_mixed_chunk and engine.buckets.tokens == (64,)
    outs = engine.generate(tiny_prompts[:4], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r[:8] for r in tiny_greedy_refs["llama"][:4]]
    assert_idle_and_clean(engine)


def test_unified_flag_is_on_off_or_left_to_the_device():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).enable_mixed_chunk is None
    assert engine_config_from_args(parser.parse_args(["--enable-mixed-chunk"])).enable_mixed_chunk
    no = engine_config_from_args(parser.parse_args(["--no-enable-mixed-chunk"]))
    assert no.enable_mixed_chunk is False
