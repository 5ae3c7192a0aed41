"""FP8 numerics shared by the quantized weights (:mod:`minijax_serve.models.quantize`) and the FP8
KV cache (:mod:`minijax_serve.attention.kv_cache`): the format, its largest value, and the
saturating cast.

``float8_e4m3fn`` (OCP FP8 E4M3, no infinities): 3 mantissa bits, so a value is kept to within
2^-4 of itself wherever it lands in the normal range [2^-6, 448] · scale. A scale only decides
where that range sits: values above 448 · scale would become NaN (the format has no infinity),
so every cast here clips first; values far below 2^-6 · scale lose precision as subnormals.
Functions take numpy arrays (on the host, while loading) or JAX arrays alike; numpy casts
through ml_dtypes and rounds to nearest even, as XLA does.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def _xp(x: Any):
    return np if isinstance(x, np.ndarray) else jnp


def to_fp8(x: Any, scale: Any) -> Any:
    """``x / scale`` in float8_e4m3fn, clipped to ±448 (never NaN); ``scale`` broadcasts."""
    xp = _xp(x)
    scaled = x.astype(xp.float32) / scale
    return xp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8)


def amax_scale(amax: Any) -> Any:
    """The scale that maps ``amax`` (float32, any shape) onto 448, the format's largest value;
    1 where ``amax`` is 0 (an all-zero row keeps zeros)."""
    xp = _xp(amax)
    amax = amax.astype(xp.float32)
    return xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(xp.float32)


def quantize(x: Any, axis: int | tuple[int, ...]) -> tuple[Any, Any]:
    """``x`` in float8_e4m3fn with one float32 scale per index of the axes not reduced:
    ``(q, scale)`` with ``q * scale ≈ x``; ``axis``: the axes one scale covers (removed from
    the scale's shape)."""
    xp = _xp(x)
    scale = amax_scale(xp.abs(x).max(axis=axis).astype(xp.float32))
    return to_fp8(x, xp.expand_dims(scale, axis)), scale
