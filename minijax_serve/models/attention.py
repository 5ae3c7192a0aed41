"""The attention interface between the engine and the model: paged KV writes and reads."""

from __future__ import annotations

from typing import NamedTuple

import jax

from pallas_kernels.reference import ragged_paged_attention_ref


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


def write_kv(pool: jax.Array, layer: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """Scatter new K or V [T, kv_heads, head_dim] into ``pool[layer]`` at flat slots, in place."""
    page_size = pool.shape[3]
    return pool.at[layer, :, slots // page_size, slots % page_size].set(new.astype(pool.dtype))


def paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "xla",
) -> jax.Array:
    """Attention of the new tokens over their sequences' cached pages and the new tokens."""
    if backend != "xla":
        raise ValueError(f"attention_backend {backend!r} is not available (available: 'xla')")
    return ragged_paged_attention_ref(
        q, k_new, v_new, k_pool, v_pool, layer, meta.page_table, meta.cu_q_lens, meta.seq_ids,
        meta.positions, meta.kv_lens, scale,
    )
