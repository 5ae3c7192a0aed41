"""An engine's KV cache: the pools' element type (``EngineConfig.kv_cache_dtype``) and, for an
FP8 cache, the scales calibrated from the served model (:mod:`minijax_serve.models.kv_calibration`)."""

from __future__ import annotations

import jax.numpy as jnp

from minijax_serve.attention.kv_cache import KVCache, is_quantized, kv_dtype
from minijax_serve.config import EngineConfig
from minijax_serve.models.config import ModelSpec
from minijax_serve.models.kv_calibration import kv_scales
from minijax_serve.models.protocol import DecoderModel


def kv_cache(config: EngineConfig, model: DecoderModel, spec: ModelSpec, model_dtype,
             kv_replicas: int = 1) -> KVCache:
    """The KV cache of ``model`` (its own KV heads, each repeated ``kv_replicas`` times as
    tensor parallelism replicates them)."""
    dtype = kv_dtype(config.kv_cache_dtype, model_dtype)
    if not is_quantized(dtype):
        return KVCache(dtype, None)
    scales = kv_scales(model, spec)
    return KVCache(dtype, tuple(jnp.repeat(s, kv_replicas, axis=1) for s in scales))
