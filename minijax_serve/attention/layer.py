"""The attention objects a model's layer calls: :class:`PagedAttention` (the engine's) and
:class:`DenseAttention` (a reference forward's), one interface.

A layer calls ``o, attn = attn(q, k, v)`` once: q [T, heads, D], k and v [T, kv_heads, D] of
its new tokens (rotary already applied), o [T, heads, D]. The paged object writes k and v into
its layer of the KV pools and returns itself with the updated pools; the layer returns that
object, so the pools travel through the layer loop functionally (and stay donated buffers).
``attn.positions`` [T] are the new tokens' positions in their sequences.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from minijax_serve.attention.backends import AttentionMetadata
from minijax_serve.attention.kv_cache import store
from minijax_serve.attention.registry import get_backend

TP_AXIS = "tp"  # the mesh axis of tensor parallelism: heads split over it


def write_kv(pool: jax.Array, layer: jax.Array | int, slots: jax.Array, new: jax.Array,
             head_scale: jax.Array | None = None) -> jax.Array:
    """Scatter new K or V [T, kv_heads, head_dim] into ``pool[layer]`` at flat slots, in place
    (an FP8 pool: divided by its ``head_scale`` [kv_heads] first)."""
    page_size = pool.shape[3]
    stored = store(new, head_scale, pool.dtype)
    return pool.at[layer, :, slots // page_size, slots % page_size].set(stored)


def _check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, num_tokens: int) -> None:
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"attention takes q [T, heads, D] and k, v [T, kv_heads, D]; got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[0] != num_tokens or k.shape[0] != num_tokens or q.shape[2] != k.shape[2]:
        raise ValueError(f"attention: q {q.shape}, k {k.shape} must have T={num_tokens} rows "
                         "and one head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads is not a multiple of "
                         f"{k.shape[1]} kv heads")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k_pool", "v_pool", "meta",
                   "layer", "k_scale", "v_scale"], meta_fields=["backend", "decode", "mesh"])
@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """Attention of a step's new tokens over their sequences' paged KV, for one layer.

    ``k_pool``/``v_pool`` [layers, kv_heads, pages, page_size, D]; ``layer``: the layer whose
    pages are read and written. ``backend``: the name of a backend of
    :mod:`minijax_serve.attention.registry` (``"xla"``, ``"pallas"``, ``"pallas_mgpu"``).
    ``decode``: every sequence has exactly one new token, which a backend with a decode kernel
    runs there. ``mesh``:
    tensor parallelism: q's heads and the pools' KV heads are split over its ``"tp"`` axis and
    each device attends over its own heads (``shard_map``), so the kernels see local heads only.
    ``k_scale``/``v_scale`` [layers, kv_heads] float32: FP8 pools' scales
    (:mod:`minijax_serve.attention.kv_cache`), split with the pools' heads; None otherwise.
    """

    k_pool: jax.Array
    v_pool: jax.Array
    meta: AttentionMetadata
    layer: jax.Array | int = 0
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    backend: str = "xla"
    decode: bool = False
    mesh: Any = None

    def __post_init__(self):
        get_backend(self.backend)  # a ValueError naming the backends for an unknown one

    @property
    def positions(self) -> jax.Array:
        return self.meta.positions

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *,
                 scale: float | None = None) -> tuple[jax.Array, PagedAttention]:
        """Write k, v into this layer's pages; the output of q over each sequence's keys (its
        cached ones and its new ones up to itself), softmax scaled by ``scale`` (default
        ``head_dim ** -0.5``); and this object with the updated pools."""
        _check_qkv(q, k, v, self.positions.shape[0])
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        run = functools.partial(self._attend, scale)
        scales = () if self.k_scale is None else (self.k_scale, self.v_scale)
        if self.mesh is not None:
            heads, pool = P(None, TP_AXIS, None), P(None, TP_AXIS, None, None, None)
            per_head = (P(None, TP_AXIS),) * len(scales)
            run = jax.shard_map(run, mesh=self.mesh,
                                in_specs=(heads, heads, heads, pool, pool, P(), P(), *per_head),
                                out_specs=(heads, pool, pool), check_vma=False)
        o, k_pool, v_pool = run(q, k, v, self.k_pool, self.v_pool, self.meta,
                                jnp.asarray(self.layer, jnp.int32), *scales)
        return o, dataclasses.replace(self, k_pool=k_pool, v_pool=v_pool)

    def _attend(self, scale, q, k, v, k_pool, v_pool, m, layer, *scales):
        """Write k, v and attend: on one device, or on one device's heads under shard_map;
        ``scales``: FP8 pools' K and V scales [layers, kv_heads] (this device's heads)."""
        k_scale, v_scale = (s[layer] for s in scales) if scales else (None, None)
        k_pool = write_kv(k_pool, layer, m.slot_mapping, k, k_scale)
        v_pool = write_kv(v_pool, layer, m.slot_mapping, v, v_scale)
        o = get_backend(self.backend)(q, k, v, k_pool, v_pool, layer, m, scale, self.decode,
                                      k_scale, v_scale)
        return o, k_pool, v_pool


@functools.partial(jax.tree_util.register_dataclass, data_fields=["positions"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """Full causal attention over one sequence's tokens, no cache: the same interface as
    :class:`PagedAttention`, so a model's reference forward runs its own layer code
    (:func:`minijax_serve.models.protocol.dense_forward`). ``positions`` [T]: 0..T-1."""

    positions: jax.Array

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *,
                 scale: float | None = None) -> tuple[jax.Array, DenseAttention]:
        _check_qkv(q, k, v, self.positions.shape[0])
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        t, heads, d = q.shape
        group = heads // k.shape[1]
        k, v = (jnp.repeat(x, group, axis=1) for x in (k, v))
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST) * scale
        causal = self.positions[None, :, None] >= self.positions[None, None, :]
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        o = jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
        return o.astype(q.dtype), self


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["positions", "k_amax", "v_amax"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CalibrationAttention:
    """:class:`DenseAttention` over one sequence that also returns the largest |K| and |V| of
    each KV head ([kv_heads] each) of the layer that called it."""

    positions: jax.Array
    k_amax: jax.Array | None = None
    v_amax: jax.Array | None = None

    def __call__(self, q, k, v, *, scale=None):
        o, _ = DenseAttention(self.positions)(q, k, v, scale=scale)
        amax = [jnp.abs(x.astype(jnp.float32)).max(axis=(0, 2)) for x in (k, v)]
        return o, dataclasses.replace(self, k_amax=amax[0], v_amax=amax[1])
