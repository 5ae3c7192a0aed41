"""Where the weights come from: sharded safetensors load like the single file; the Orbax load
cache restores bitwise equal parameters, and a second process saving the same checkpoint keeps
the first."""

from __future__ import annotations

import json

import jax
import numpy as np
from flax import nnx

from minijax_serve.models import loader
from minijax_serve.models.decoder import DecoderLM
from minijax_serve.models.loader import load_model
from tests import hf_reference


def _param_leaves(model: DecoderLM) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_sharded_safetensors_load_like_single_file(tiny_dir, tmp_path):
    family = "qwen3"  # saved with the same seed as tiny_dir's
    sharded = hf_reference.save_tiny_model(family, tmp_path / "sharded", max_shard_size="20KB")
    index = sharded / "model.safetensors.index.json"
    assert index.is_file()
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()

    single = _param_leaves(load_model(tiny_dir[family], use_cache=False).model)
    split = _param_leaves(load_model(sharded, use_cache=False).model)
    assert single.keys() == split.keys()
    for name in single:
        assert np.array_equal(single[name], split[name]), name
    # and they are the saved weights, not some initialisation
    from safetensors.numpy import load_file

    saved = load_file(str(tiny_dir[family] / "model.safetensors"))
    np.testing.assert_array_equal(single["embed_tokens"], saved["model.embed_tokens.weight"])
    np.testing.assert_array_equal(single["layers.1.wq"],
                                  saved["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(single["lm_head"], saved["lm_head.weight"].T)


def test_orbax_cache_restores_identical_parameters(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIJAX_SERVE_CACHE", str(tmp_path / "c"))
    first = load_model(tiny_dir["qwen2"])
    assert first.source == "safetensors"
    assert any((tmp_path / "c" / "orbax").iterdir())
    second = load_model(tiny_dir["qwen2"])
    assert second.source == "orbax-cache"
    assert second.config == first.config
    a = jax.tree.leaves(nnx.state(first.model))
    b = jax.tree.leaves(nnx.state(second.model))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


def test_a_second_process_caching_the_same_weights_keeps_the_first(tiny_dir, tmp_path,
                                                                   monkeypatch):
    """Two processes loading one model at once both save a checkpoint; the later rename finds
    the directory taken, keeps it and removes its own."""
    monkeypatch.setenv("MINIJAX_SERVE_CACHE", str(tmp_path / "c"))
    first = load_model(tiny_dir["qwen2"])
    (cached,) = (tmp_path / "c" / "orbax").iterdir()
    stamp = cached.stat().st_mtime_ns
    loader._save_cached(cached, first.model)
    assert list((tmp_path / "c" / "orbax").iterdir()) == [cached]
    assert cached.stat().st_mtime_ns == stamp
    assert load_model(tiny_dir["qwen2"]).source == "orbax-cache"
