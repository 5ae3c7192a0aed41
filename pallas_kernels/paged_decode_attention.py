"""Paged decode attention in Pallas: one query token per sequence, the KV length split across
programs and merged by log-sum-exp (flash-decoding).

A decode batch has one new token per sequence, so the ragged kernel would run one program per
sequence and KV head, each walking the whole context alone: too few programs to fill a GPU at
small batches, and a ``block_q``-row tile of which only the group's rows are real. Here a program
takes one (sequence, KV head, split) and its GQA group's query heads (padded to the 16 rows
Triton's matmul needs), walks its share of the pages, and writes its unnormalised partial output,
running max and denominator; a few ``jnp`` ops merge the splits.

The same portable-Pallas choice as :mod:`pallas_kernels.ragged_paged_attention` (Triton on GPUs,
``interpret=True`` on CPU), with the same constraints: head dim and page size powers of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import (MASK_VALUE, MIN_DOT, check_blocks,
                                                   head_scales, kv_scales, load_kv, mm,
                                                   online_softmax_step, pool_shapes)


def _kernel(kv_lens_ref, table_ref, layer_ref, q_ref, k_ref, v_ref, *refs, scale: float,
            pages_per_block: int, blocks_per_split: int, quantized: bool):
    seq, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_scale, v_scale, o_ref = head_scales(refs[:-2], h, quantized)
    l_ref, m_ref = refs[-2:]
    kv_len, layer = kv_lens_ref[seq], layer_ref[0]
    page_size, d = k_ref.shape[3], k_ref.shape[4]
    block_kv = pages_per_block * page_size
    rows = q_ref.shape[-2]
    q = q_ref[seq, h, :, :]
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pl.cdiv(kv_len, block_kv))

    def kv_block(j, carry):
        pages = table_ref[seq, pl.ds(j * pages_per_block, pages_per_block)]
        k = load_kv(k_ref, layer, h, pages, block_kv, q.dtype)
        v = load_kv(v_ref, layer, h, pages, block_kv, q.dtype)
        s = mm(q, k, 1) * (scale * k_scale)
        key_pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        return online_softmax_step(carry, jnp.where(key_pos < kv_len, s, MASK_VALUE), v)

    init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, last, kv_block, init)
    o_ref[split, seq, h, :, :] = acc * v_scale if quantized else acc
    l_ref[split, seq, h, :] = l
    m_ref[split, seq, h, :] = m


def default_num_splits(num_seqs: int, kv_heads: int, max_blocks: int) -> int:
    """Enough splits for about 4 programs per SM of a large GPU (132 SMs), never more than the
    KV blocks there are."""
    want = -(-528 // max(1, num_seqs * kv_heads))
    return max(1, min(want, max_blocks, 64))


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def paged_decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    page_table: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float,
    block_kv: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    scales: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Attention of one new token per sequence over its sequence's paged KV (its own included).

    Args:
      q: [S, num_heads, D], sequence i's query in row i.
      k_pool, v_pool: [layers, kv_heads, num_pages, page_size, D].
      layer: the layer of the pools to read.
      page_table: [S, W] page ids of each sequence.
      kv_lens: [S] KV lengths; a sequence of length 0 (padding) gets zeros.
      scale: the softmax scale.
      block_kv: key tokens per inner step (at least one page).
      num_splits: programs per (sequence, KV head) along the KV length; None picks one from
        the batch size.
      num_warps, num_stages: Triton's warps per program and software-pipelining depth of the
        KV loop.
      interpret: run the kernel in Pallas's interpreter (on CPU).
      scales: FP8 pools' (k_scale, v_scale), as ``ragged_paged_attention`` takes them.
    Returns:
      [S, num_heads, D] in q's dtype.
    """
    s, num_heads, d = q.shape
    _, kv_heads, _, page_size, _ = k_pool.shape
    group, padded = pool_shapes(q, k_pool)
    check_blocks(block_kv=block_kv)
    rows = max(padded, MIN_DOT)
    ppb = max(1, max(block_kv, MIN_DOT) // page_size)
    w = page_table.shape[1]
    max_blocks = -(-w // ppb)
    splits = num_splits or default_num_splits(s, kv_heads, max_blocks)
    per_split = -(-max_blocks // splits)
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, max_blocks * ppb - w)))
    qg = jnp.pad(q.reshape(s, kv_heads, group, d), ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    f32 = jnp.float32
    extra, quantized = kv_scales(scales, q.dtype)
    o, l, m = pl.pallas_call(
        functools.partial(_kernel, scale=scale, pages_per_block=ppb, blocks_per_split=per_split,
                          quantized=quantized),
        grid=(s, kv_heads, splits),
        out_shape=(jax.ShapeDtypeStruct((splits, s, kv_heads, rows, d), f32),
                   jax.ShapeDtypeStruct((splits, s, kv_heads, rows), f32),
                   jax.ShapeDtypeStruct((splits, s, kv_heads, rows), f32)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="paged_decode_attention",
    )(kv_lens.astype(jnp.int32), table, jnp.asarray(layer, jnp.int32).reshape(1), qg,
      k_pool, v_pool, *extra)
    m_all = m.max(axis=0)
    corr = jnp.exp(m - m_all[None])
    l_all = (l * corr).sum(axis=0)
    out = (o * corr[..., None]).sum(axis=0) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return out[:, :, :group].reshape(s, num_heads, d).astype(q.dtype)
