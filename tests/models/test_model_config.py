"""Model configs and broken inputs, against what transformers saves and expects:

- config parsing and rotary scaling (``rope_parameters`` and the legacy keys, every tiny
  family's saved config, parameter counts, inverse frequencies against transformers');
- every unsupported or broken input fails with an error that names the problem and the file.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from minijax_serve.models.config import ModelConfig, load_model_config, model_config_from_dict
from minijax_serve.models.decoder import DecoderLM
from minijax_serve.models.loader import load_model
from minijax_serve.models.registry import ALIASES, resolve_model
from tests import hf_reference
from tests.conftest import FAMILIES


def abstract_param_count(cfg: ModelConfig) -> tuple[int, dict[str, tuple[int, ...]]]:
    """Parameter count and shapes of the decoder for ``cfg``, without allocating it."""
    abstract = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
    flat = {".".join(map(str, k)): v.get_value().shape
            for k, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    return sum(int(np.prod(s)) for s in flat.values()), flat


# --------------------------------------------------------------------------------------------
# config parsing and rotary scaling

BASE = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1000,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
}
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("new, old", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, {"rope_theta": 1e6}),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     {"rope_theta": 1e6, "rope_scaling": None}),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}},
     {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 4.0}}),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3_SCALING}},
     {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}}),
], ids=["default", "default-null-scaling", "linear", "llama3"])
def test_rope_parameters_and_legacy_keys_agree(new, old):
    a = model_config_from_dict({**BASE, **new})
    b = model_config_from_dict({**BASE, **old})
    assert a == b
    assert a.rope_type == new["rope_parameters"]["rope_type"]
    assert a.rope_theta == new["rope_parameters"]["rope_theta"]


def test_tiny_configs_parse_as_saved_by_transformers(tiny_dir):
    for family in FAMILIES:
        hf = hf_reference.tiny_config(family)
        cfg = load_model_config(tiny_dir[family])
        assert cfg.model_type == family
        assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
            hf.num_attention_heads, hf.num_key_value_heads,
            getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
        assert cfg.tie_word_embeddings == hf.tie_word_embeddings
        assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
        assert cfg.rope_type == "default" and cfg.rope_theta == hf.rope_parameters["rope_theta"]


def test_num_params_matches_transformers_and_eval_shape(tiny_dir):
    for family in FAMILIES:
        cfg = load_model_config(tiny_dir[family])
        hf = hf_reference.load_hf(tiny_dir[family])
        assert cfg.num_params() == sum(p.numel() for p in hf.parameters()), family
        assert abstract_param_count(cfg)[0] == cfg.num_params(), family


@pytest.mark.parametrize("rope, head_dim", [
    ({"rope_type": "default", "rope_theta": 1e4}, 64),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}, 128),
    ({"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3_SCALING}, 128),
    ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 64),  # Llama 3.2
], ids=["default", "linear", "llama3.1", "llama3.2"])
def test_rope_inv_freq_matches_transformers(rope, head_dim):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, num_hidden_layers=1, max_position_embeddings=131072,
        rope_parameters=dict(rope))
    if rope["rope_type"] == "default":
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
    expected = expected.numpy()
    cfg = model_config_from_dict(hf.to_dict())
    assert cfg.head_dim == head_dim and cfg.rope_type == rope["rope_type"]
    ours = cfg.rope_inv_freq()
    assert ours.shape == expected.shape == (head_dim // 2,)
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=0)
    if rope["rope_type"] == "llama3":  # the scaling really changed something, in three bands
        plain = dataclasses.replace(cfg, rope_type="default").rope_inv_freq()
        ratio = plain / ours
        assert np.isclose(ratio[0], 1) and np.isclose(ratio[-1], rope["factor"])
        assert np.any((ratio > 1.01) & (ratio < rope["factor"] - 0.01))


# --------------------------------------------------------------------------------------------
# clear errors


def _model_dir(path: Path, config: dict | None, weights_from: Path | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if weights_from is not None:
        shutil.copy(weights_from / "model.safetensors", path / "model.safetensors")
    return path


def _tiny_config_dict(tiny_dir, family="llama") -> dict:
    return json.loads((tiny_dir[family] / "config.json").read_text())


def test_missing_model_directory(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        load_model(missing)
    assert str(missing) in str(e.value)


def test_directory_without_config_json(tmp_path, tiny_dir):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_dir["llama"] / "model.safetensors", d)
    with pytest.raises(FileNotFoundError, match="config.json") as e:
        load_model(d)
    assert str(d / "config.json") in str(e.value)


def test_directory_without_weights(tmp_path, tiny_dir):
    d = _model_dir(tmp_path / "m", _tiny_config_dict(tiny_dir))
    with pytest.raises(FileNotFoundError, match=r"safetensors") as e:
        load_model(d)
    assert str(d) in str(e.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tmp_path, tiny_dir, damage):
    d = _model_dir(tmp_path / "m", _tiny_config_dict(tiny_dir))
    good = (tiny_dir["llama"] / "model.safetensors").read_bytes()
    bad = np.random.default_rng(0).bytes(4096) if damage == "garbage" else good[: len(good) // 2]
    (d / "model.safetensors").write_bytes(bad)
    with pytest.raises(ValueError, match="unreadable safetensors") as e:
        load_model(d)
    assert str(d / "model.safetensors") in str(e.value)


@pytest.mark.parametrize("change, pattern", [
    ({"num_hidden_layers": 1}, r"model\.layers\.1\..* is for layer 1.*num_hidden_layers=1"),
    ({"num_hidden_layers": 3}, r"input_layernorm\.weight missing for layers \[2\]"),
], ids=["weights-have-more-layers", "weights-have-fewer-layers"])
def test_weights_and_config_disagree(tmp_path, tiny_dir, change, pattern):
    d = _model_dir(tmp_path / "m", {**_tiny_config_dict(tiny_dir), **change},
                   weights_from=tiny_dir["llama"])
    with pytest.raises(ValueError, match=pattern) as e:
        load_model(d)
    assert str(d) in str(e.value)


def test_weight_shape_or_tensor_missing(tmp_path, tiny_dir):
    from safetensors.numpy import load_file, save_file

    raw = _tiny_config_dict(tiny_dir)
    d = _model_dir(tmp_path / "shape", {**raw, "intermediate_size": 96},
                   weights_from=tiny_dir["llama"])
    mlp_shape = r"weight layers\.0\.w_(gate|up|down): shape .*128.*config expects .*96"
    with pytest.raises(ValueError, match=mlp_shape):
        load_model(d)
    tensors = load_file(str(tiny_dir["llama"] / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    d = _model_dir(tmp_path / "missing", raw)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"mlp\.down_proj\.weight missing for layers \[1\]") as e:
        load_model(d)
    assert str(d) in str(e.value)
    del tensors["lm_head.weight"]
    tensors["model.layers.1.mlp.down_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="'lm_head' missing"):
        load_model(d)


def test_shard_index_names_a_missing_shard(tmp_path):
    d = hf_reference.save_tiny_model("llama", tmp_path / "m", max_shard_size="20KB")
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    victim = sorted(set(weight_map.values()))[1]
    (d / victim).unlink()
    with pytest.raises(FileNotFoundError, match="missing") as e:
        load_model(d)
    assert str(d / victim) in str(e.value)


def test_unsupported_architecture(tmp_path):
    import transformers

    d = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(d)
    with pytest.raises(ValueError, match="gpt2") as e:
        load_model(d)
    assert str(d / "config.json") in str(e.value) and "not supported" in str(e.value)


@pytest.mark.parametrize("change, pattern", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 32}}, "rope type 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 1e4},
     "rope type 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
], ids=["yarn", "legacy-dynamic", "gelu"])
def test_unsupported_config_values(tmp_path, tiny_dir, change, pattern):
    raw = _tiny_config_dict(tiny_dir)
    raw.pop("rope_parameters")
    d = _model_dir(tmp_path / "m", {**raw, **change}, weights_from=tiny_dir["llama"])
    with pytest.raises(ValueError, match=pattern) as e:
        load_model(d)
    assert str(d / "config.json") in str(e.value) and "not supported" in str(e.value)


def test_resolve_unknown_model_names_aliases():
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("no-such-model")
    msg = str(e.value)
    assert "no-such-model" in msg
    for alias in ALIASES:
        assert alias in msg
