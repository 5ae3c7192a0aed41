"""The FP8 KV cache's scales, calibrated from the served model itself when an engine starts
(``kv_cache_dtype="fp8_e4m3"``; why and how: :mod:`minijax_serve.attention.kv_cache`).

The model runs once over a fixed calibration sequence (its BOS token, if it has one, then
``CALIBRATION_TOKENS`` token ids drawn uniformly from its vocabulary by a fixed seed), through
the model protocol with a dense attention that records each layer's largest |K| and |V| per KV
head. One compiled layer serves every layer. Random ids need no tokenizer and give every model
the same calibration; on SmolLM2 their largest values were 0.44-1 times those of ShareGPT
prompts (median 0.86 for K, 0.79 for V), which ``HEADROOM`` covers (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from minijax_serve.attention.kv_cache import CALIBRATION_TOKENS, scales_from_amax
from minijax_serve.attention.layer import CalibrationAttention
from minijax_serve.models.config import ModelSpec
from minijax_serve.models.protocol import DecoderModel, layer_params

CALIBRATION_SEED = 0


def calibration_ids(spec: ModelSpec, num_tokens: int = CALIBRATION_TOKENS) -> np.ndarray:
    """The calibration sequence: BOS (if the model has one), then seeded random ids."""
    rng = np.random.default_rng(CALIBRATION_SEED)
    ids = rng.integers(0, spec.vocab_size, size=num_tokens)
    if spec.bos_token_id is not None:
        ids = np.concatenate([[spec.bos_token_id], ids])
    return ids.astype(np.int32)


def kv_amax(model: DecoderModel, spec: ModelSpec) -> tuple[jax.Array, jax.Array]:
    """The largest |K| and |V| of each layer and KV head, [layers, kv_heads] float32 each, over
    the calibration sequence."""
    ids = jnp.asarray(calibration_ids(spec))
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    layer = jax.jit(lambda p, h, attn: model.layer(p, h, attn))
    h = model.embed(ids, positions)
    k_amax, v_amax = [], []
    for p in layer_params(model):
        h, attn = layer(p, h, CalibrationAttention(positions))
        k_amax.append(attn.k_amax)
        v_amax.append(attn.v_amax)
    return jnp.stack(k_amax), jnp.stack(v_amax)


def kv_scales(model: DecoderModel, spec: ModelSpec) -> tuple[jax.Array, jax.Array]:
    """The FP8 pools' K and V scales, [layers, kv_heads] float32 each."""
    k_amax, v_amax = kv_amax(model, spec)
    if k_amax.shape != (spec.num_layers, spec.num_kv_heads):
        raise ValueError(f"KV calibration: the model's keys have {k_amax.shape[1]} heads in "
                         f"{k_amax.shape[0]} layers, model_config says num_kv_heads="
                         f"{spec.num_kv_heads}, num_layers={spec.num_layers}")
    return scales_from_amax(k_amax), scales_from_amax(v_amax)
