"""FP8 weights for the built-in decoder (``EngineConfig.quantization``).

Each decoder layer's linear weights (q, k, v, o, gate, up, down; stored ``[in, out]``) are held
in float8_e4m3fn with one float32 scale per output channel, ``<name>_scale`` [out], beside them
in the layer's parameters; the embedding, the norms, the biases and the LM head keep the model's
dtype. A per-output-channel scale factors out of the product, ``x @ (q · s) = (x @ q) · s``, so
the matmuls never materialise dequantised weights:

* ``"fp8"`` (weight-only): ``x @ q`` with q converted to x's dtype inside the product (XLA fuses
  the conversion into the matmul's operand load), accumulated in float32, then scaled by s;
* ``"fp8_w8a8"``: each token's activations are quantized too, with a scale per token (the
  dynamic per-token scheme of vLLM and SGLang), and the product is FP8 × FP8 accumulated in
  float32, scaled by both; Hopper's FP8 matrix units run it at twice the bfloat16 rate.

Which is faster on a GPU awaits a measurement there (``benchmarks/gpu_check.sh fp8``); both are
selectable. Weights are quantized when loaded (:func:`quantize_layers`), from any checkpoint the
engine reads; FP8 checkpoints are read as stored (:mod:`minijax_serve.models.fp8_checkpoint`).
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from minijax_serve.config.names import QUANTIZATIONS
from minijax_serve.core.fp8 import FP8, quantize
from minijax_serve.models.protocol import LayerWeight

LINEAR = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # [in, out] each
SCALE = "_scale"  # wq -> wq_scale


def scale_name(weight: str) -> str:
    return weight + SCALE


def check_method(method: str | None) -> None:
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None, 'fp8' or 'fp8_w8a8', got {method!r}")


def quantize_layers(layers: Iterable[Any]) -> None:
    """Replace, in place, each layer's linear weights (``nnx.Dict`` s of ``nnx.Param``) by FP8
    weights and their per-output-channel scales; a layer already in FP8 is left as it is."""
    for layer in layers:
        for name in LINEAR:
            w = layer[name][...]
            if w.dtype == FP8:
                continue
            q, scale = quantize(w, axis=0)
            layer[name] = nnx.Param(q)
            layer[scale_name(name)] = nnx.Param(scale)


def quantize_model(model: Any, method: str, copy: bool = False) -> Any:
    """``model`` (the built-in decoder) with FP8 linear weights multiplied by ``method``; its
    layers are quantized one after another (the full-precision matrices of a layer are freed
    as the next is quantized), in place or, with ``copy``, in a copy."""
    check_method(method)
    if not hasattr(model, "quantization"):
        raise ValueError(f"quantization={method!r} needs the built-in decoder (DecoderLM); a "
                         f"model of one's own ({type(model).__name__}) holds its own weights")
    if copy:
        model = nnx.clone(model)
    quantize_layers(model.layers)
    model.quantization = method
    return model


def _dot(w: jax.Array, x: jax.Array) -> jax.Array:
    """x @ w accumulated in float32, w converted to x's dtype first where they differ."""
    return jnp.dot(x, w if w.dtype == x.dtype else w.astype(x.dtype),
                   preferred_element_type=jnp.float32)


def linear(x: jax.Array, w: Any, scale: jax.Array | None, method: str | None) -> jax.Array:
    """``x @ w`` for a layer weight ``w`` (an array or, under the engine's scan, a
    :class:`LayerWeight`): as it is without ``scale``, else the FP8 product of ``method``
    scaled per output channel; returns x's dtype."""
    if scale is None:
        return x @ w
    dtype, post = x.dtype, scale
    if method == "fp8_w8a8":
        x, token_scale = quantize(x, axis=-1)
        post = token_scale[:, None] * scale
    y = w.apply(_dot, x) if isinstance(w, LayerWeight) else _dot(w, x)
    return (y * post).astype(dtype)
