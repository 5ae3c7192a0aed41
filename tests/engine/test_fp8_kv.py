"""The FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``): pools of float8_e4m3fn values (held as their
bits) with a calibrated scale per layer and KV head; the prefix cache, chunked prefill, retract and overlap serve the tokens of
the plain FP8 engine; the Pallas kernels the reference's; about twice the tokens in the pool a
bfloat16 model gets from the same memory; a backend or device that cannot read FP8 refused with
the field's name before any weight is loaded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minijax_serve import Engine, EngineConfig, SamplingParams
from minijax_serve.attention.kv_cache import POOL_DTYPE
from minijax_serve.attention.registry import check_before_loading
from minijax_serve.engine import setup
from minijax_serve.engine.limits import DeviceMemory
from minijax_serve.models.config import load_model_config
from tests.engine.test_engine import assert_idle_and_clean

FP8_KV = dict(kv_cache_dtype="fp8_e4m3", skip_tokenizer_init=True, max_total_tokens=1024,
              max_running_requests=3, max_prefill_tokens=128, min_token_bucket=16,
              min_seq_bucket=4, min_kv_bucket=128)
PLAIN = dict(enable_radix_cache=False, chunked_prefill_size=-1, enable_overlap=False)
BUSY = dict(chunked_prefill_size=32, enable_mixed_chunk=True, force_retract_every=3)
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    """Prompts longer than a chunk, and each one's first half again (a cached prefix)."""
    rng = np.random.default_rng(48)
    long = [rng.integers(0, 250, size=n).tolist() for n in (70, 45, 9, 100)]
    return long + [p[:len(p) // 2] + [7, 8, 9] for p in long[:2]]


@pytest.fixture(scope="module")
def plain_tokens(tiny_dir, prompts):
    engine = Engine(tiny_dir["llama"], **FP8_KV, **PLAIN)
    k_scale, v_scale = engine.runner.kv_scales
    assert engine.runner.k_pool.dtype == engine.runner.v_pool.dtype == POOL_DTYPE
    cfg = engine.model_config
    assert k_scale.shape == v_scale.shape == (cfg.num_layers, cfg.num_kv_heads)
    assert (k_scale > 0).all() and len(np.unique(np.asarray(k_scale))) > 1  # per layer and head
    tokens = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert_idle_and_clean(engine)
    return tokens


def test_features_serve_the_plain_fp8_tokens(tiny_dir, prompts, plain_tokens):
    """Radix cache, chunked + mixed prefill, forced retracts and overlap over FP8 pools: the
    tokens of the plain FP8 engine (every backend reads what was stored, however computed)."""
    engine = Engine(tiny_dir["llama"], **FP8_KV, **BUSY)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain_tokens
    again = engine.generate(prompts[:2], GREEDY)  # now from the prefix cache
    assert [o.token_ids for o in again] == plain_tokens[:2]
    assert all(o.cached_tokens > 0 for o in again)
    stats = engine.stats()
    assert stats["num_retracted"] > 0 and stats["mixed_steps"] > 0
    assert_idle_and_clean(engine)


def test_pallas_kernels_serve_the_reference_fp8_tokens(tiny_dir, prompts, plain_tokens):
    engine = Engine(tiny_dir["llama"], attention_backend="pallas", **FP8_KV, **PLAIN)
    assert engine.attention_backend == "pallas" and engine.runner.k_pool.dtype == POOL_DTYPE
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain_tokens
    assert_idle_and_clean(engine)


def test_the_pool_holds_twice_the_tokens_of_bfloat16(tiny_dir, monkeypatch):
    # an accelerator's pool: mem_fraction_static of its free memory (here 1 GiB of 80)
    monkeypatch.setattr(setup, "device_memory",
                        lambda tp, agree=True: DeviceMemory("gpu", 80 << 30, 1 << 30))
    cfg = load_model_config(tiny_dir["llama"])
    config = EngineConfig()
    bf16 = setup.device_limits(config, cfg, jnp.bfloat16, 2048).pool_tokens
    fp8 = setup.device_limits(config, cfg, POOL_DTYPE, 2048).pool_tokens
    assert fp8 == pytest.approx(2 * bf16, abs=16)  # to a page (both in whole pages)
    # the simulated H200 sizes its pool the same way (less weights: FP8 ones take half)
    sizes = {kv: Engine("llama-3-8b", simulate="h200", dtype="bfloat16", kv_cache_dtype=kv,
                        max_running_requests=4096, context_length=2048).kv_pool_tokens
             for kv in ("auto", "fp8_e4m3")}
    assert 1.95 < sizes["fp8_e4m3"] / sizes["auto"] < 2.05


class OldGPU:
    platform, device_kind, compute_capability = "gpu", "NVIDIA A100-SXM4-80GB", "8.0"


def test_an_fp8_cache_the_backend_cannot_read_is_refused_before_loading(monkeypatch, tmp_path):
    """Triton converts FP8 from compute capability 8.9 on: an A100 cannot run the Pallas
    kernels over FP8 pools; the engine says so before it reads the model (here: none)."""
    monkeypatch.setattr(jax, "devices", lambda *a: [OldGPU()])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    message = ("kv_cache_dtype='fp8_e4m3' with attention_backend='pallas' needs an NVIDIA GPU of "
               r"compute capability 8.9 \(Ada, Hopper\) or more")
    with pytest.raises(ValueError, match=message):
        check_before_loading(EngineConfig(attention_backend="pallas", kv_cache_dtype="fp8_e4m3"),
                             "gpu", simulated=False)
    with pytest.raises(ValueError, match=message):  # no model directory: nothing was loaded
        Engine(tmp_path / "no-such-model", attention_backend="pallas",
               kv_cache_dtype="fp8_e4m3")
    check_before_loading(EngineConfig(attention_backend="xla", kv_cache_dtype="fp8_e4m3"), "gpu",
                         simulated=False)  # the reference reads FP8 anywhere
    check_before_loading(EngineConfig(attention_backend="pallas", kv_cache_dtype="fp8_e4m3"),
                         "gpu", simulated=True)  # a simulated GPU runs no kernel
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or 'fp8_e4m3', got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")


def test_ngram_speculation_serves_the_plain_fp8_tokens(tiny_dir, prompts, plain_tokens):
    """Verify steps over FP8 pools: a draft's keys are stored and read as any new token's."""
    engine = Engine(tiny_dir["llama"], **FP8_KV, **PLAIN, speculative_method="ngram")
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain_tokens
    assert engine.stats()["spec_proposed_tokens"] > 0
    assert_idle_and_clean(engine)
