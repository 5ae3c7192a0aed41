"""HuggingFace configs read as transformers reads them: the precedence of the rotary keys,
the families' defaults for absent keys, a sliding window (which caps the context), and the EOS
ids of generation_config.json."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from minijax_serve import Engine
from minijax_serve.models.config import load_model_config, model_config_from_dict
from tests.models.test_model_config import _model_dir, _tiny_config_dict


def test_a_sliding_window_caps_the_context(tmp_path, tiny_dir):
    """Within its window sliding-window attention is plain causal attention: a model whose
    window is shorter than its positions is served up to the window (as transformers reads it:
    Mistral's default window 4096, Qwen's only where a layer slides)."""
    raw = _tiny_config_dict(tiny_dir, "mistral")
    assert raw["sliding_window"] is None  # the tiny model is fine as saved
    d = _model_dir(tmp_path / "m", {**raw, "sliding_window": 64, "max_position_embeddings": 128},
                   weights_from=tiny_dir["mistral"])
    assert load_model_config(d).context_limit()[0] == 64
    with pytest.raises(ValueError, match=r"context_length=128 exceeds the model's "
                                         r"sliding_window=64 \(sliding-window attention"):
        Engine(d, context_length=128, max_total_tokens=256, skip_tokenizer_init=True)
    assert model_config_from_dict({**raw, "sliding_window": 128}).sliding_window is None
    unset = {k: v for k, v in raw.items() if k != "sliding_window"}
    assert model_config_from_dict({**unset, "max_position_embeddings": 8192}).sliding_window == 4096
    qwen = _tiny_config_dict(tiny_dir, "qwen2")
    layers = qwen["num_hidden_layers"]
    for extra, window in (({}, None), ({"use_sliding_window": True}, None),
                          ({"use_sliding_window": True, "max_window_layers": layers}, None),
                          ({"use_sliding_window": True, "max_window_layers": 1}, 16),
                          ({"layer_types": ["sliding_attention"] * layers}, None),
                          ({"use_sliding_window": True,
                            "layer_types": ["full_attention"] * layers}, None),
                          ({"use_sliding_window": True,
                            "layer_types": ["sliding_attention"] * layers}, 16)):
        cfg = model_config_from_dict({**qwen, "sliding_window": 16, "layer_types": None, **extra})
        assert cfg.sliding_window == window, extra
    unset = {k: v for k, v in qwen.items() if k != "sliding_window"}  # Qwen2Config's default
    assert model_config_from_dict({**unset, "max_position_embeddings": 8192, "layer_types": None,
                                   "use_sliding_window": True, "max_window_layers": 1}
                                  ).sliding_window == 4096


ROPE_CASES = {  # rotary keys transformers reads in a set order
    "rope_scaling before rope_parameters": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 1234.0},
        rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "a top-level original_max_position_embeddings first": dict(
        original_max_position_embeddings=64, rope_scaling={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "else max_position_embeddings": dict(rope_scaling={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0}),
}


@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_keys_are_read_as_transformers_reads_them(case):
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = dict(model_type="llama", vocab_size=1000, hidden_size=128, num_attention_heads=2,
               num_key_value_heads=1, intermediate_size=64, num_hidden_layers=1,
               max_position_embeddings=4096, **ROPE_CASES[case])
    hf = transformers.LlamaConfig.from_dict(copy.deepcopy(raw))  # it fills in the rope dicts
    expected = LlamaRotaryEmbedding(hf).inv_freq
    np.testing.assert_allclose(model_config_from_dict(raw).rope_inv_freq(), expected.numpy(),
                               rtol=1e-6, atol=0)


def test_transformers_defaults_and_aliases(tiny_dir):
    """Keys transformers reads with a family default, or ignores, or names twice."""
    qwen3 = {k: v for k, v in _tiny_config_dict(tiny_dir, "qwen3").items() if k != "head_dim"}
    assert model_config_from_dict(qwen3).head_dim == 128  # Qwen3Config's default
    mistral = _tiny_config_dict(tiny_dir, "mistral")
    assert not model_config_from_dict({**mistral, "attention_bias": True}).qkv_bias  # ignored
    assert model_config_from_dict({**mistral, "hidden_act": "swish"}).model_type == "mistral"


def test_generation_config_eos_replaces_config_eos(tmp_path, tiny_dir):
    """transformers' generate stops on generation_config.json's EOS ids when it has them."""
    raw = {**_tiny_config_dict(tiny_dir), "eos_token_id": 24}
    d = _model_dir(tmp_path / "m", raw)
    assert load_model_config(d).eos_token_ids == (24,)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [143, 7]}))
    assert load_model_config(d).eos_token_ids == (143, 7)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert load_model_config(d).eos_token_ids == (24,)
