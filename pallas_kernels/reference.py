"""Pure-``jnp`` ragged paged attention: the CPU path of the engine and the oracle for the kernels.

A new token attends to two key sets, merged flash-attention style (running max and sums):

* its sequence's **prefix** — keys computed in earlier steps — read from the paged pools one
  block of pages at a time. The loop runs over the longest prefix in the batch, not over the
  page-table width, so a batch of fresh prompts reads no pages at all;
* the **new tokens** of its own sequence up to itself (causal), taken straight from this step's
  K/V in tiles of the flattened token axis; a query tile visits only the key tiles from the start
  of its first sequence up to itself.

So the cost is ∝ Σ new tokens × (prefix + own new tokens): never a dense mask over the batch.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
_rows = jax.lax.dynamic_slice_in_dim
Carry = tuple[jax.Array, jax.Array, jax.Array]  # running max, denominator, numerator


def _pad_rows(x: jax.Array, n: int) -> jax.Array:
    """Append ``n`` zero rows along the first axis."""
    return jnp.pad(x, ((0, n),) + ((0, 0),) * (x.ndim - 1))


def _online_update(carry: Carry, s: jax.Array, pv: Callable[[jax.Array], jax.Array]) -> Carry:
    """Fold scores ``s`` [..., keys] (-inf = masked) into the carry; ``pv(p)`` = p @ values."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv(p)


def _prefix_attention(carry: Carry, qg, k_pool, v_pool, layer, page_table, seq_ids, prefix_lens,
                      block_tokens: int, chunk: int, k_scale=None, v_scale=None) -> Carry:
    """Fold in each token's attention over its sequence's cached prefix in the pools.

    Tokens go in chunks; a chunk walks the KV blocks up to the longest prefix among its own
    tokens, so the cost follows the sum of the sequences' KV lengths (exactly so when the
    sequences of a batch come longest first), and a chunk's gathered block stays in cache. A
    chunk of one sequence's tokens (a prefill chunk after a cached prefix or earlier chunks)
    gathers each block once for all its tokens instead of once per token. FP8 pools are
    dequantised as each block is gathered (``k_scale``/``v_scale`` [kv_heads]).
    """

    def load(pool, pages, head_scale):  # index the pools in place: a reshape of the donated
        x = pool[layer, :, pages]  # carry would copy it; x: [..., kv_heads, page_size, D]
        if x.dtype == jnp.uint8:  # an FP8 pool held as its bits
            x = jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
        x = x.astype(jnp.float32)
        return x if head_scale is None else x * head_scale.astype(jnp.float32)[:, None, None]

    t, kvh, group, d = qg.shape
    ps = k_pool.shape[3]
    w = page_table.shape[1]
    ppb = max(1, min(w, block_tokens // ps))  # pages per block
    num_blocks = -(-w // ppb)
    pad = num_blocks * ppb - w
    table = jnp.pad(page_table, ((0, 0), (0, pad))) if pad else page_table
    token_pages = table[seq_ids].reshape(t, num_blocks, ppb)
    token_prefix = prefix_lens[seq_ids]
    block = ppb * ps
    chunk = min(chunk, t)
    t_pad = -t % chunk
    if t_pad:
        qg, token_pages, token_prefix = (
            _pad_rows(x, t_pad) for x in (qg, token_pages, token_prefix))
        carry = tuple(_pad_rows(c, t_pad) for c in carry)
    chunk_blocks = -(-token_prefix.reshape(-1, chunk).max(axis=1) // block)
    chunk_seqs = jnp.pad(seq_ids, (0, t_pad), mode="edge").reshape(-1, chunk)
    one_seq = chunk_seqs[:, 0] == chunk_seqs[:, -1]  # (tokens are grouped by sequence)

    def token_chunk(c, out):
        q = _rows(qg, c * chunk, chunk)
        pages_c, prefix_c = _rows(token_pages, c * chunk, chunk), _rows(token_prefix, c * chunk, chunk)

        def fold(b, acc, k, v, scores: str, values: str):
            s = jnp.einsum(scores, q, k, precision=HIGHEST).reshape(chunk, kvh, group, block)
            visible = b * block + jnp.arange(block)[None, :] < prefix_c[:, None]
            s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
            return _online_update(acc, s, lambda p: jnp.einsum(
                values, p.reshape(chunk, kvh, group, ppb, ps), v, precision=HIGHEST))

        def kv_block(b, acc):  # each token reads its own sequence's pages (a decode batch)
            pages = jax.lax.dynamic_index_in_dim(pages_c, b, axis=1, keepdims=False)
            k = load(k_pool, pages, k_scale)  # [chunk, ppb, kv_heads, ps, D]
            v = load(v_pool, pages, v_scale)
            return fold(b, acc, k, v, "tkgd,tpksd->tkgps", "tkgps,tpksd->tkgd")

        def kv_block_shared(b, acc):  # one sequence's tokens (a prefill chunk): read it once
            pages = jax.lax.dynamic_index_in_dim(pages_c[0], b, axis=0, keepdims=False)
            k = load(k_pool, pages, k_scale)  # [ppb, kv_heads, ps, D]
            v = load(v_pool, pages, v_scale)
            return fold(b, acc, k, v, "tkgd,pksd->tkgps", "tkgps,pksd->tkgd")

        acc = tuple(_rows(x, c * chunk, chunk) for x in out)
        n = jnp.minimum(chunk_blocks[c], num_blocks)
        acc = jax.lax.cond(one_seq[c], lambda a: jax.lax.fori_loop(0, n, kv_block_shared, a),
                           lambda a: jax.lax.fori_loop(0, n, kv_block, a), acc)
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, c * chunk, 0) for x, y in zip(out, acc))

    carry = jax.lax.fori_loop(0, (t + t_pad) // chunk, token_chunk, carry)
    return tuple(x[:t] for x in carry)


def _new_token_attention(carry: Carry, qg, k_new, v_new, seq_ids, positions, valid, seq_start,
                         tile: int) -> Carry:
    """Fold in causal attention among the new tokens of each sequence, tile by tile.

    Inside, queries, keys and the carry are head-major ([kv_heads, tokens, ...]), so each tile's
    two matmuls are plain batched matmuls over the kv heads, with no transpose per tile.
    """
    t, kvh, group, d = qg.shape
    tile = min(tile, t)
    pad = -t % tile
    if pad:  # padded rows are invalid keys and their query results are dropped below
        qg, k_new, v_new, seq_ids, positions, valid = (
            _pad_rows(x, pad) for x in (qg, k_new, v_new, seq_ids, positions, valid))
        carry = tuple(_pad_rows(c, pad) for c in carry)
    num_tiles = (t + pad) // tile
    head_major = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    qh, kh = head_major(qg), head_major(k_new.astype(jnp.float32))
    vh = head_major(v_new.astype(jnp.float32))
    carry = tuple(head_major(c) for c in carry)
    tokens = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=1)  # noqa: E731

    def q_tile(i, out):
        q = tokens(qh, i)
        q_seq, q_pos = _rows(seq_ids, i * tile, tile), _rows(positions, i * tile, tile)

        def k_tile(j, c):
            k, v = tokens(kh, j), tokens(vh, j)
            k_seq, k_pos = _rows(seq_ids, j * tile, tile), _rows(positions, j * tile, tile)
            k_ok = _rows(valid, j * tile, tile)
            s = jnp.einsum("kqgd,kjd->kqgj", q, k, precision=HIGHEST)
            visible = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
            s = jnp.where((visible & k_ok[None, :])[None, :, None, :], s, -jnp.inf)
            return _online_update(c, s, lambda p: jnp.einsum(
                "kqgj,kjd->kqgd", p, v, precision=HIGHEST))

        # key tiles from the start of this tile's first sequence (a padding tile: only itself)
        first = jnp.where(valid[i * tile], seq_start[q_seq[0]] // tile, i)
        c = jax.lax.fori_loop(first, i + 1, k_tile, tuple(tokens(x, i) for x in out))
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, i * tile, 1) for x, y in zip(out, c))

    carry = jax.lax.fori_loop(0, num_tiles, q_tile, carry)
    return tuple(jnp.moveaxis(c, 0, 1)[:t] for c in carry)


def ragged_paged_attention_ref(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    seq_ids: jax.Array,
    positions: jax.Array,
    kv_lens: jax.Array,
    scale: float,
    kv_block_tokens: int = 64,
    q_tile: int = 32,
    kv_chunk_tokens: int = 16,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of a ragged batch of new tokens over their paged prefixes and themselves.

    Args:
      q: [T, num_heads, D] queries of the new tokens (all sequences flattened, in order).
      k_new, v_new: [T, kv_heads, D] this step's keys and values.
      k_pool, v_pool: [layers, kv_heads, num_pages, page_size, D] holding every sequence's prefix.
      layer: which layer of the pools to read.
      page_table: [S, W] page ids of each sequence.
      cu_q_lens: [S+1] offsets of each sequence's new tokens; tokens past ``cu_q_lens[-1]`` are
        padding (they attend to nothing that matters, and nothing attends to them).
      seq_ids, positions: [T] each token's sequence and position in it.
      kv_lens: [S] KV length of each sequence after this step (prefix + new tokens).
      k_scale, v_scale: [kv_heads] float32 scales of FP8 pools (a stored key is k / k_scale),
        applied as the pages are read; None: the pools hold plain values. FP8 pools may come
        as float8_e4m3fn or as their bits (uint8: XLA on a CPU converts a whole float8 array
        around every gather and scatter). ``k_new``/``v_new`` are taken as they are (a caller
        attending to its new keys as an FP8 cache stores them rounds them first).
    Returns:
      [T, num_heads, D] in q's dtype.
    """
    t, nq, d = q.shape
    kvh = k_new.shape[1]
    group = nq // kvh
    qg = q.reshape(t, kvh, group, d).astype(jnp.float32) * scale
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    valid = jnp.arange(t) < cu_q_lens[-1]
    carry = (jnp.full((t, kvh, group), -jnp.inf, jnp.float32),
             jnp.zeros((t, kvh, group), jnp.float32), jnp.zeros(qg.shape, jnp.float32))
    prefix_lens = kv_lens - q_lens
    carry = jax.lax.cond(  # a batch of fresh prompts skips the pools altogether
        jnp.max(prefix_lens) > 0,
        lambda c: _prefix_attention(c, qg, k_pool, v_pool, layer, page_table, seq_ids,
                                    prefix_lens, kv_block_tokens, kv_chunk_tokens, k_scale,
                                    v_scale),
        lambda c: c, carry)
    carry = _new_token_attention(carry, qg, k_new, v_new, seq_ids, positions, valid,
                                 cu_q_lens[:-1], q_tile)
    _, l, acc = carry
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(t, nq, d).astype(q.dtype)
