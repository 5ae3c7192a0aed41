"""The KV cache's element type (``EngineConfig.kv_cache_dtype``) and its FP8 scales.

``"auto"``: the pools hold the model's dtype. ``"fp8_e4m3"``: the pools hold float8_e4m3fn and
each (layer, KV head) has a static float32 scale for K and one for V, ``[layers, kv_heads]``
each: a key is stored as ``k / k_scale`` (clipped to ±448) and read as ``k_fp8 · k_scale``.

Why per KV head and static: every attention kernel's program works on one KV head, so its
scale is one scalar there, which factors out of both products (the scores are multiplied by
the K scale, the output by the V scale) and costs nothing in the loads; under tensor
parallelism the scales split with the pools' heads. A static scale keeps every stored value
valid for the engine's life, so the prefix cache, retract and chunked prefill read what any
later step would write. The scales are calibrated when the engine starts
(:func:`scales_from_amax`; :class:`~minijax_serve.attention.layer.CalibrationAttention`): the largest |K| and |V| per layer and
head over a fixed calibration sequence, times ``HEADROOM`` (a later value up to that many times
larger is still represented, not clipped), mapped onto 448. vLLM's default without checkpoint
scales, 1.0 for every tensor, puts SmolLM2's small V values (|v| < 0.6 in its first layer)
among the format's subnormals; calibrated scales keep them in its normal range
(benchmarks/RESULTS.md, "FP8 weights and KV cache").

The new tokens of a step attend to their own keys as stored, quantized, by every backend (the
reference rounds them through FP8 too), so a token's output does not depend on whether its
prefix was computed in the same step or read from the cache.

The engine holds FP8 pools as their bits, ``uint8`` arrays (``POOL_DTYPE``): XLA on a CPU
converts a whole float8 array to float32 and back around every scatter into it (64 ms for a
23 MB SmolLM2 pool, measured; the same happens to bfloat16 pools there), while a uint8 scatter
updates the pool in place (0.1 ms). Writes store the FP8 values' bits; the reference reads the
gathered bits as FP8 (:func:`pallas_kernels.reference.ragged_paged_attention_ref` takes either);
the kernels are handed the pools as float8_e4m3fn (:func:`fp8_view`, a bitcast).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from minijax_serve.config.names import KV_CACHE_DTYPES
from minijax_serve.core.fp8 import FP8, amax_scale, to_fp8

POOL_DTYPE = jnp.uint8  # an FP8 pool's storage: the float8_e4m3fn values' bits
KV_DTYPES = {"fp8_e4m3": POOL_DTYPE}
HEADROOM = 4.0  # calibrated scales cover this many times the largest value seen
CALIBRATION_TOKENS = 64


class KVCache(NamedTuple):
    """An engine's KV cache: the pools' element type and, FP8, their scales."""

    dtype: jnp.dtype
    scales: tuple[jax.Array, jax.Array] | None  # K and V scales, [layers, kv_heads] each


def kv_dtype(kv_cache_dtype: str, model_dtype):
    """The pools' element type: the model's dtype for ``"auto"``, else the storage of FP8
    values (their bits, a byte an element)."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {kv_cache_dtype!r}")
    return jnp.dtype(KV_DTYPES[kv_cache_dtype])


def kv_value_dtype(kv_cache_dtype: str, model_dtype):
    """What the pools' elements are read as: the model's dtype for ``"auto"``, else FP8."""
    return jnp.dtype(model_dtype if kv_cache_dtype == "auto" else FP8)


def is_quantized(pool_dtype) -> bool:
    """Whether pools of ``pool_dtype`` hold FP8 values (their bits)."""
    return jnp.dtype(pool_dtype) == jnp.dtype(POOL_DTYPE)


def fp8_view(pool: jax.Array) -> jax.Array:
    """An FP8 pool as float8_e4m3fn (a bitcast of its bits); any other pool as it is."""
    return jax.lax.bitcast_convert_type(pool, FP8) if is_quantized(pool.dtype) else pool


def store(new: jax.Array, head_scale: jax.Array | None, pool_dtype) -> jax.Array:
    """New K or V [T, kv_heads, D] as the pools hold it (``head_scale`` [kv_heads]: an FP8
    pool's scales; its values' bits)."""
    if head_scale is None:
        return new.astype(pool_dtype)
    return jax.lax.bitcast_convert_type(to_fp8(new, head_scale[None, :, None]), POOL_DTYPE)


def as_stored(new: jax.Array, head_scale: jax.Array | None) -> jax.Array:
    """New K or V [T, kv_heads, D] rounded as the pools store it, in its own dtype (the
    reference's new tokens read what a kernel reads from the pages)."""
    if head_scale is None:
        return new
    stored = to_fp8(new, head_scale[None, :, None]).astype(jnp.float32)
    return (stored * head_scale[None, :, None]).astype(new.dtype)


def scales_from_amax(amax: jax.Array) -> jax.Array:
    """FP8 scales [layers, kv_heads] from the largest magnitudes seen, with ``HEADROOM``."""
    return amax_scale(jnp.asarray(amax, jnp.float32) * HEADROOM)
