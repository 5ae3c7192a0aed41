"""Pure-``jnp`` paged attention: the CPU path of the engine and the oracle for the kernels.

Every query token attends over the pages of its own sequence only, walked in blocks of
``kv_block_tokens`` with an online softmax, so memory stays bounded and the cost is the number of
tokens times the page-table width of the batch (pages per sequence, bucketed to the longest
sequence), never a dense mask over the whole batch's KV.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_paged_attention_ref(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    page_table: jax.Array,
    seq_ids: jax.Array,
    positions: jax.Array,
    kv_lens: jax.Array,
    scale: float,
    kv_block_tokens: int = 256,
) -> jax.Array:
    """Causal attention of a ragged batch of new tokens over a paged KV cache.

    Args:
      q: [T, num_heads, head_dim] queries of the new tokens (all sequences flattened).
      k_pool, v_pool: [layers, kv_heads, num_pages, page_size, head_dim]; the new tokens' K/V
        must already be written.
      layer: which layer of the pools to read.
      page_table: [S, W] page ids of each sequence (padding entries may hold any valid page).
      seq_ids: [T] the sequence each token belongs to.
      positions: [T] each token's position in its sequence; it sees keys 0..position.
      kv_lens: [S] valid KV length of each sequence.
    Returns:
      [T, num_heads, head_dim] in q's dtype.
    """
    t, nq, d = q.shape
    _, kvh, _, ps, _ = k_pool.shape
    w = page_table.shape[1]
    group = nq // kvh
    pages_per_block = max(1, min(w, kv_block_tokens // ps))
    num_blocks = -(-w // pages_per_block)
    pad = num_blocks * pages_per_block - w
    table = jnp.pad(page_table, ((0, 0), (0, pad))) if pad else page_table
    token_pages = table[seq_ids].reshape(t, num_blocks, pages_per_block)
    last = jnp.minimum(positions, kv_lens[seq_ids] - 1)
    qg = q.reshape(t, kvh, group, d).astype(jnp.float32) * scale
    block = pages_per_block * ps

    def body(b, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_index_in_dim(token_pages, b, axis=1, keepdims=False)
        k = k_pool[layer, :, pages]  # [T, P, kv_heads, page_size, D]
        v = v_pool[layer, :, pages]
        k = jnp.swapaxes(k, 2, 3).reshape(t, block, kvh, d).astype(jnp.float32)
        v = jnp.swapaxes(v, 2, 3).reshape(t, block, kvh, d).astype(jnp.float32)
        s = jnp.einsum("tkgd,tjkd->tkgj", qg, k, precision=jax.lax.Precision.HIGHEST)
        idx = b * block + jnp.arange(block)
        s = jnp.where((idx[None, :] <= last[:, None])[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * corr + p.sum(axis=-1)
        acc = acc * corr[..., None] + jnp.einsum(
            "tkgj,tjkd->tkgd", p, v, precision=jax.lax.Precision.HIGHEST
        )
        return m_new, l, acc

    init = (
        jnp.full((t, kvh, group), -jnp.inf, jnp.float32),
        jnp.zeros((t, kvh, group), jnp.float32),
        jnp.zeros((t, kvh, group, d), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(t, nq, d).astype(q.dtype)
