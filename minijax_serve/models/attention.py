"""The attention interface between the engine and the model: paged KV writes and reads."""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_ref

BACKENDS = ("xla", "pallas")
log = logging.getLogger(__name__)


class AttentionMetadata(NamedTuple):
    """Where each new token sits and where its sequence's KV lives (device arrays).

    positions, seq_ids, slot_mapping: [T]; cu_q_lens: [S+1]; page_table: [S, W]; kv_lens: [S].
    ``slot_mapping`` is the flat KV slot (page * page_size + offset) each new token writes;
    tokens past ``cu_q_lens[-1]`` are padding.
    """

    positions: jax.Array
    seq_ids: jax.Array
    slot_mapping: jax.Array
    cu_q_lens: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array


def write_kv(pool: jax.Array, layer: jax.Array | int, slots: jax.Array,
             new: jax.Array) -> jax.Array:
    """Scatter new K or V [T, kv_heads, head_dim] into ``pool[layer]`` at flat slots, in place."""
    page_size = pool.shape[3]
    return pool.at[layer, :, slots // page_size, slots % page_size].set(new.astype(pool.dtype))


@functools.cache
def pallas_kernels_run() -> bool:
    """Whether both Pallas kernels compile and run on the default device (a tiny call each):
    ``attention_backend="auto"`` falls back to the reference where they do not."""
    q = jnp.ones((4, 2, 16), jnp.float32)
    pool = jnp.ones((1, 1, 2, 16, 16), jnp.float32)
    table, kv_lens = jnp.zeros((4, 1), jnp.int32), jnp.ones((4,), jnp.int32)
    interpret = jax.default_backend() == "cpu"
    try:
        outs = (ragged_paged_attention(q, pool, pool, 0, table, jnp.arange(5), kv_lens, scale=1.0,
                                       interpret=interpret),
                paged_decode_attention(q, pool, pool, 0, table, kv_lens, scale=1.0,
                                       interpret=interpret))
    except Exception as err:  # noqa: BLE001 (any lowering or compile failure means "no")
        log.warning("the Pallas attention kernels do not run here (%s: %s)", type(err).__name__, err)
        return False
    if not all(bool(jnp.allclose(o, 1.0)) for o in outs):  # every value is 1: so is attention
        log.warning("the Pallas attention kernels give wrong results here")
        return False
    return True


def paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "xla",
    *,
    decode: bool = False,
) -> jax.Array:
    """Attention of the new tokens over their sequences' cached pages and the new tokens.

    The new tokens' K/V must already be in the pools (``write_kv``): the Pallas kernels read
    every key from pages; the ``"xla"`` reference takes the new ones from ``k_new``/``v_new``.
    ``"pallas"`` runs in Pallas's interpreter on CPU. ``decode`` (static): token i is sequence
    i's only new token (padding sequences have none), which goes to the split-KV decode kernel.
    """
    if backend == "xla":
        return ragged_paged_attention_ref(
            q, k_new, v_new, k_pool, v_pool, layer, meta.page_table, meta.cu_q_lens,
            meta.seq_ids, meta.positions, meta.kv_lens, scale)
    if backend != "pallas":
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    interpret = jax.default_backend() == "cpu"
    args = (k_pool, v_pool, layer, meta.page_table)
    if decode:
        return paged_decode_attention(q, *args, meta.kv_lens, scale=scale, interpret=interpret)
    return ragged_paged_attention(q, *args, meta.cu_q_lens, meta.kv_lens, scale=scale,
                                  interpret=interpret)
