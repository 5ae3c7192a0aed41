"""check_model: a model of one's own is traced once through the engine's own layer loop, on
abstract values, before an engine serves it; what breaks the protocol fails here, by name."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from minijax_serve.attention.layer import AttentionMetadata, PagedAttention
from minijax_serve.models.config import ModelSpec
from minijax_serve.models.protocol import forward, layer_params

PROBE_TOKENS, PROBE_PAGE = 3, 4


class ModelProtocolError(ValueError):
    """A model does not follow :mod:`minijax_serve.models.protocol`."""


def _describe(x: Any) -> str:
    if isinstance(x, jax.Array):
        return f"a {x.dtype} array of shape {tuple(x.shape)}"
    return f"a {type(x).__module__}.{type(x).__qualname__}"


def _array(what: str, x: Any) -> None:
    if not isinstance(x, jax.Array):
        raise ModelProtocolError(f"{what} must return a JAX array, got {_describe(x)}")


class _CountedAttention:
    """The layer's attention object, counting its calls."""

    def __init__(self, attn: PagedAttention, calls: list):
        self._attn, self._calls = attn, calls
        self.positions = attn.positions

    def __call__(self, q, k, v, **kwargs):
        self._calls.append(1)
        return self._attn(q, k, v, **kwargs)


class _CheckedModel:
    """``model``'s protocol methods, each output checked."""

    def __init__(self, model, spec: ModelSpec, num_tokens: int, num_rows: int):
        self.model, self.spec, self.layers = model, spec, model.layers
        self.num_tokens, self.num_rows = num_tokens, num_rows

    def embed(self, ids, positions):
        h = self.model.embed(ids, positions)
        _array("model.embed(ids, positions)", h)
        if h.ndim < 1 or h.shape[0] != self.num_tokens:
            raise ModelProtocolError(f"model.embed(ids, positions) must return h [T={self.num_tokens}"
                                     f", ...] (a row per token), got {_describe(h)}")
        return h

    def layer(self, params, h, attn):
        calls: list = []
        try:
            out = self.model.layer(params, h, _CountedAttention(attn, calls))
        except TypeError as err:
            if "LayerWeight" in str(err):
                raise ModelProtocolError(
                    f"model.layer: {err}. Under the engine's scan over layers a weight matrix is "
                    "a LayerWeight: use it only as `x @ w`") from err
            raise
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ModelProtocolError(f"model.layer must return (h, attn), got {_describe(out)}")
        new_h, new_attn = out
        _array("model.layer(params, h, attn)'s h", new_h)
        if new_h.shape != h.shape or new_h.dtype != h.dtype:
            raise ModelProtocolError(f"model.layer must keep h's shape and dtype {h.dtype}"
                                     f"{tuple(h.shape)}, got {_describe(new_h)}")
        if len(calls) != 1:
            raise ModelProtocolError(f"model.layer must call attn(q, k, v) exactly once, called "
                                     f"it {len(calls)} times")
        if not isinstance(new_attn, PagedAttention):
            raise ModelProtocolError("model.layer must return the attention object that "
                                     f"attn(q, k, v) returned, got {_describe(new_attn)}")
        return new_h, new_attn

    def head(self, h, indices):
        logits = self.model.head(h, indices)
        _array("model.head(h, indices)", logits)
        want = (self.num_rows, self.spec.vocab_size)
        if tuple(logits.shape) != want:
            raise ModelProtocolError(f"model.head(h, indices) must return logits [len(indices)="
                                     f"{want[0]}, vocab_size={want[1]}], got {_describe(logits)}")
        if logits.dtype != jnp.float32:
            raise ModelProtocolError(f"model.head(h, indices) must return float32 logits, got "
                                     f"{_describe(logits)}")
        return logits


def check_model(model: Any, spec: ModelSpec, layer_loop: str, dtype=jnp.float32) -> None:
    """Raise :class:`ModelProtocolError` naming what ``model`` gets wrong: missing methods, a
    layer count other than ``spec.num_layers``, layers of different structures, outputs of the
    wrong kind, shape or dtype, an attention not called exactly once per layer."""
    if not isinstance(model, nnx.Module):
        raise ModelProtocolError(f"the model must be a flax.nnx.Module, got {_describe(model)}")
    for name in ("embed", "layer", "head"):
        if not callable(getattr(model, name, None)):
            raise ModelProtocolError(f"the model has no method {name}() (see "
                                     "minijax_serve.models.protocol)")
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(layers, "__len__"):
        raise ModelProtocolError("the model must have `layers`, a sequence of per-layer weights")
    if len(layers) != spec.num_layers:
        raise ModelProtocolError(f"model_config.num_layers={spec.num_layers}, but the model has "
                                 f"{len(layers)} layers")
    params = layer_params(model)
    first = jax.tree.map(jnp.shape, params[0])
    for i, p in enumerate(params[1:], 1):
        if jax.tree.map(jnp.shape, p) != first:
            raise ModelProtocolError(f"model.layers[{i}]'s weights differ from layers[0]'s in "
                                     "structure or shape; every layer must be alike")
    t, rows = PROBE_TOKENS, jnp.array([0, PROBE_TOKENS - 1], jnp.int32)
    pool = jax.ShapeDtypeStruct((spec.num_layers, spec.num_kv_heads, 2, PROBE_PAGE, spec.head_dim),
                                dtype)
    i32 = lambda *x: jnp.array(x, jnp.int32)  # noqa: E731
    meta = AttentionMetadata(positions=jnp.arange(t, dtype=jnp.int32), seq_ids=jnp.zeros(t, jnp.int32),
                             slot_mapping=jnp.arange(t, dtype=jnp.int32), cu_q_lens=i32(0, t),
                             page_table=i32([0, 1]), kv_lens=i32(t))
    checked = _CheckedModel(model, spec, t, len(rows))

    def probe(k_pool, v_pool):
        ids = jnp.zeros(t, jnp.int32)
        return forward(checked, ids, PagedAttention(k_pool, v_pool, meta), rows, layer_loop)

    try:
        jax.eval_shape(probe, pool, pool)
    except jax.errors.TracerArrayConversionError as err:
        raise ModelProtocolError("the model converts a traced value to numpy (use jax.numpy "
                                 f"inside embed, layer and head): {err}") from err
