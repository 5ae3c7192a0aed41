"""The engine with ``attention_backend="pallas"`` (the kernels in interpret mode on CPU): token for
token HuggingFace's greedy output, with chunked prefill, mixed steps and decode steps."""

from __future__ import annotations

import pytest

from types import SimpleNamespace

from minijax_serve import Engine, EngineConfig, SamplingParams
from minijax_serve.engine import _attention_backend
from minijax_serve.models.attention import pallas_kernels_run
from pallas_kernels.ragged_paged_attention import check_shapes
from tests.test_chunked_prefill import run_arrivals
from tests.test_engine import assert_idle_and_clean

NEW = 24  # the length of the conftest's HF references


@pytest.mark.parametrize("family,page_size,chunk", [("llama", 16, 32), ("qwen3", 1, 8)])
def test_pallas_engine_matches_hf(family, page_size, chunk, tiny_dir, tiny_prompts,
                                  tiny_greedy_refs):
    """Llama: head_dim 16, MHA; Qwen3: head_dim 64, GQA 3 (padded to 4 in the kernels). The
    long prompts arrive while the short ones decode, so steps mix decode tokens and chunks."""
    engine = Engine(tiny_dir[family], attention_backend="pallas", page_size=page_size,
                    chunked_prefill_size=chunk, enable_mixed_chunk=True, skip_tokenizer_init=True,
                    max_total_tokens=1024, max_running_requests=4, max_prefill_tokens=64,
                    min_token_bucket=8, min_seq_bucket=4, min_kv_bucket=64)
    assert engine.attention_backend == "pallas"
    short, long = tiny_prompts[:4], tiny_prompts[-6:]
    refs = tiny_greedy_refs[family][:4] + tiny_greedy_refs[family][-6:]
    outs = run_arrivals(engine, short, long, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    stats = engine.stats()
    assert stats["mixed_steps"] > 0 and stats["chunked_steps"] > 0 and stats["decode_steps"] > 0
    assert_idle_and_clean(engine)


def test_pallas_config_errors():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="triton").validate()
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(attention_backend="pallas", page_size=12).validate()
    with pytest.raises(ValueError, match="head_dim"):
        check_shapes(num_heads=4, kv_heads=2, head_dim=80)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        check_shapes(num_heads=6, kv_heads=4, head_dim=64)
    assert EngineConfig().resolved_attention_backend("gpu") == "pallas"
    assert EngineConfig().resolved_attention_backend("cpu") == "xla"
    assert EngineConfig(attention_backend="pallas").resolved_attention_backend("cpu") == "pallas"
    assert pallas_kernels_run()  # the probe behind "auto" on GPUs (here: interpreted)


def test_auto_backend_falls_back_where_the_kernels_cannot_run(monkeypatch):
    """On a GPU, "auto" takes the kernels only for shapes they support; "pallas" raises."""
    monkeypatch.setattr("minijax_serve.engine.pallas_kernels_run", lambda: True)
    monkeypatch.setattr("minijax_serve.engine.jax.default_backend", lambda: "gpu")
    model = SimpleNamespace(num_heads=8, num_kv_heads=2, head_dim=64)
    assert _attention_backend(EngineConfig(), model) == "pallas"
    assert _attention_backend(EngineConfig(page_size=12), model) == "xla"
    odd = SimpleNamespace(num_heads=8, num_kv_heads=2, head_dim=80)
    assert _attention_backend(EngineConfig(), odd) == "xla"
    with pytest.raises(ValueError, match="head_dim"):
        _attention_backend(EngineConfig(attention_backend="pallas"), odd)
    assert _attention_backend(EngineConfig(attention_backend="xla"), model) == "xla"
    monkeypatch.setattr("minijax_serve.engine.pallas_kernels_run", lambda: False)
    assert _attention_backend(EngineConfig(), model) == "xla"
