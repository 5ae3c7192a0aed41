"""FP8 weights (``quantization="fp8"``): quantized at load from any checkpoint, read from FP8
checkpoints in vLLM's format (per tensor, per channel, per block), refused with the missing
scale's name before any weight is read; the FP8 checkpoint of per-channel scales serves the same
tokens as the float checkpoint quantized at load (the same weights)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minijax_serve import Engine, SamplingParams
from minijax_serve.bench.engine_run import fp8_weights
from minijax_serve.core.fp8 import FP8
from minijax_serve.models import fp8_checkpoint
from minijax_serve.models.decoder import DecoderLM
from minijax_serve.models.loader import load_model
from minijax_serve.models.quantize import LINEAR, quantize_model
from tests.engine.test_engine import assert_idle_and_clean
from tests.models.fp8_writer import write_fp8_checkpoint

SMALL = dict(skip_tokenizer_init=True, max_total_tokens=512, max_running_requests=4,
             max_prefill_tokens=64, min_token_bucket=64, min_seq_bucket=4)


def dequantized(model: DecoderLM, layer: int, name: str) -> np.ndarray:
    p = model.layers[layer]
    return np.asarray(p[name][...].astype(jnp.float32)) * np.asarray(p[name + "_scale"][...])


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_checkpoints_load_as_per_channel_fp8(scheme, tiny_dir, tmp_path):
    src = tiny_dir["qwen2"]  # q/k/v biases stay float
    dst = write_fp8_checkpoint(src, tmp_path / scheme, scheme, block=32)
    loaded = load_model(dst)
    full = load_model(src, use_cache=False).model
    model = loaded.model
    assert loaded.source == "safetensors-fp8" and model.quantization == "fp8"
    for layer in range(len(model.layers)):
        for name in LINEAR:
            assert model.layers[layer][name].dtype == FP8
            w = np.asarray(full.layers[layer][name][...])
            err = np.linalg.norm(dequantized(model, layer, name) - w) / np.linalg.norm(w)
            assert err < 0.05, (scheme, layer, name, err)  # FP8's 3 mantissa bits
        assert model.layers[layer]["bq"].dtype == jnp.float32
    assert model.embed_tokens.dtype == jnp.float32
    if scheme == "tensor":  # stored as the file holds it: one scale over every channel
        scale = np.asarray(model.layers[0]["wq_scale"][...])
        assert np.all(scale == scale[0])


def test_fp8_checkpoint_serves_the_weights_quantized_at_load(tiny_dir, tiny_prompts, tmp_path):
    """Per-channel scales written by the quantizer the engine runs at load: the same weights,
    so the same tokens, bit for bit."""
    src = tiny_dir["llama"]
    dst = write_fp8_checkpoint(src, tmp_path / "channel", "channel")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = tiny_prompts[::4]
    from_checkpoint = Engine(dst, **SMALL)
    at_load = Engine(src, quantization="fp8", **SMALL)
    outs = [[o.token_ids for o in e.generate(prompts, params)] for e in (from_checkpoint, at_load)]
    assert outs[0] == outs[1]
    for e in (from_checkpoint, at_load):
        assert e.runner.params[0].dtype == jnp.float32  # the embedding stays in the model dtype
        assert any(p.dtype == FP8 for p in e.runner.params)
        assert fp8_weights(e, e.config)  # the bench's bandwidth: a byte a weight, from both
        assert_idle_and_clean(e)
    assert from_checkpoint.config.quantization is None


def test_a_missing_scale_is_refused_before_any_weight_is_read(tiny_dir, tmp_path, monkeypatch):
    name = "model.layers.1.mlp.down_proj.weight_scale"
    dst = write_fp8_checkpoint(tiny_dir["llama"], tmp_path / "broken", drop_scale=name)

    def read(*args):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(fp8_checkpoint, "_tensor", read)
    with pytest.raises(ValueError, match=f"FP8 weight model.layers.1.mlp.down_proj.weight has "
                                         f"no scale tensor {name}"):
        Engine(dst, **SMALL)


def test_other_quantization_methods_are_refused(tiny_dir, tmp_path):
    dst = write_fp8_checkpoint(tiny_dir["llama"], tmp_path / "awq")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.quant_method='awq' is not supported"):
        load_model(dst)


def test_quantizing_a_model_object(tiny_dir):
    """A DecoderLM of one's own is quantized in a copy (the caller's stays float); a model of
    another class cannot be."""
    model = load_model(tiny_dir["llama"], use_cache=False).model
    copy = quantize_model(model, "fp8_w8a8", copy=True)
    assert copy.quantization == "fp8_w8a8" and copy.layers[0]["wq"].dtype == FP8
    assert model.quantization is None and model.layers[0]["wq"].dtype == jnp.float32
    with pytest.raises(ValueError, match="quantization='fp8' needs the built-in decoder"):
        quantize_model(nnx.Dict(layers=[]), "fp8")
    with pytest.raises(ValueError, match="quantization must be None, 'fp8' or 'fp8_w8a8'"):
        Engine(tiny_dir["llama"], quantization="int4", **SMALL)
