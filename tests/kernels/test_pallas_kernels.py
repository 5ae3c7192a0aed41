"""The Pallas kernels in interpret mode against a float64 numpy reference, on fresh random inputs
each run (the seed is in every failure message). Pallas's interpreter fills outputs with NaN
before the call, so a finite result means every element was written."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import (
    gpu_callbacks,  # its race detector's verdict
)

from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu

KV_HEADS, LAYERS, LAYER = 2, 2, 1
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def make_batch(rng, seqs, page_size, group, head_dim, dtype, pad_tokens=3, pad_seqs=1,
               kv_heads=KV_HEADS):
    """Pools holding every sequence's keys (prefix and new tokens) on shuffled pages, queries,
    the ragged metadata; ``seqs`` = [(cached prefix, new tokens)], then padding."""
    page_counts = [-(-(p + n) // page_size) for p, n in seqs]
    num_pages = sum(page_counts) + 2
    width = max(page_counts) + 1
    order = rng.permutation(num_pages)
    table = np.zeros((len(seqs) + pad_seqs, width), np.int32)
    start = 0
    for i, count in enumerate(page_counts):
        table[i, :count] = order[start:start + count]
        start += count
    new = [n for _, n in seqs]
    cu = np.concatenate([[0], np.cumsum(new), [sum(new)] * pad_seqs]).astype(np.int32)
    kv_lens = np.array([p + n for p, n in seqs] + [0] * pad_seqs, np.int32)
    shape = (LAYERS, kv_heads, num_pages, page_size, head_dim)
    k_pool, v_pool = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    q = rng.standard_normal((sum(new) + pad_tokens, kv_heads * group, head_dim)).astype(dtype)
    return q, k_pool, v_pool, table, cu, kv_lens


def reference(q, k_pool, v_pool, table, cu, kv_lens, scale):
    """Dense causal attention per sequence in float64; padding rows are zero."""
    q, k_pool, v_pool = (np.asarray(x, np.float64) for x in (q, k_pool, v_pool))
    page_size, kv_heads = k_pool.shape[3], k_pool.shape[1]
    group = q.shape[1] // kv_heads
    out = np.zeros_like(q)
    for s in range(len(kv_lens)):
        lo, hi, kv = cu[s], cu[s + 1], kv_lens[s]
        if hi == lo:
            continue
        pos = np.arange(kv)
        pages, offsets = table[s, pos // page_size], pos % page_size
        k = k_pool[LAYER][:, pages, offsets]  # [kv_heads, kv, D]
        v = v_pool[LAYER][:, pages, offsets]
        qs = q[lo:hi].reshape(hi - lo, kv_heads, group, -1)
        scores = np.einsum("tkgd,ksd->tkgs", qs, k) * scale
        q_pos = kv - (hi - lo) + np.arange(hi - lo)
        scores = np.where(pos[None, None, None, :] <= q_pos[:, None, None, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[lo:hi] = np.einsum("tkgs,ksd->tkgd", p / p.sum(-1, keepdims=True), v).reshape(hi - lo, -1, q.shape[-1])
    return out


def assert_matches(out, ref, rows, dtype, seed):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), f"seed {seed}: an output element was not written"
    assert not out[rows:].any(), f"seed {seed}: padding rows are not zero"
    err = np.linalg.norm(out[:rows] - ref[:rows]) / np.linalg.norm(ref[:rows])
    assert err < TOLERANCE[dtype], f"seed {seed}: relative error {err:.3g}"


def batch_for(page_size):
    """Decode tokens, short and long prefills with and without a cached prefix, sequences
    ending exactly on and just past page boundaries."""
    ps = page_size
    return [(ps - 1, 1), (ps, 1), (2 * ps + 3, 1),  # decodes: KV ends on / past a boundary
            (0, 5), (0, 40), (ps, 17), (5, max(1, 3 * ps - 5)), (3 * ps + 1, 9)]  # prefills


RAGGED_CASES = [  # (page size, GQA group, head dim, dtype): pairwise coverage
    (1, 1, 64, "float32"), (16, 4, 128, "float32"), (16, 8, 64, "bfloat16"),
    (1, 8, 128, "float32"), (16, 1, 128, "bfloat16"), (1, 4, 64, "bfloat16"),
    (32, 3, 256, "float32"),  # the largest head dim and page size, a group padded (3 -> 4)
]


@pytest.mark.parametrize("page_size,group,head_dim,dtype", RAGGED_CASES)
def test_ragged_kernel_matches_float64(page_size, group, head_dim, dtype):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    q, k_pool, v_pool, table, cu, kv_lens = make_batch(
        rng, batch_for(page_size), page_size, group, head_dim, jnp.dtype(dtype))
    scale = head_dim ** -0.5
    out = ragged_paged_attention(q, k_pool, v_pool, LAYER, table, cu, kv_lens, scale=scale,
                                 block_q=16, block_kv=16, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, reference(q, k_pool, v_pool, table, cu, kv_lens, scale), cu[-1], dtype, seed)


MGPU_CASES = [  # (page size, GQA group, head dim, dtype, block_kv, num_slots, warpgroups, ws)
    (16, 2, 64, "float32", 64, 2, 1, False), (8, 1, 128, "float16", 128, 3, None, False),
    # two warpgroups, on one chunk of 40 after 130 cached (3 KV blocks through 2 slots, the last
    # on the diagonal; a partial block of rows): the interpreter compiles each of their programs
    # anew (~1.5 s each); a group of 4 on one KV head, so the two head pairs share it
    (16, 4, 64, "bfloat16", 64, 2, 2, False),
    # the same with a third warpgroup that only loads (warp_specialized): the two computing
    # ones take turns on the tensor cores through a barrier of their own
    (16, 4, 64, "bfloat16", 64, 2, 2, True),
    (32, 3, 256, "bfloat16", 64, 2, 1, False),  # the largest head dim and page size, a group of 3
]


@pytest.mark.parametrize("page_size,group,head_dim,dtype,block_kv,num_slots,warpgroups,ws",
                         MGPU_CASES)
def test_mgpu_ragged_kernel_matches_float64(page_size, group, head_dim, dtype, block_kv,
                                            num_slots, warpgroups, ws):
    """The Mosaic GPU kernel in its interpreter: the Triton kernel's batch (decode tokens,
    prefills with and without a cached prefix, page boundaries, padding) and a prefill over
    several KV blocks ending in a partial block of rows; the interpreter's race detector on
    (a slot overwritten before every warpgroup released it would be a race)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    seqs, kv_heads = (([(2 * block_kv + 2, 40)], 1) if warpgroups == 2
                      # the widest head: a decode and a chunk over 3 KV blocks, one KV head
                      else ([(page_size - 1, 1), (7, 2 * block_kv + 9)], 1) if head_dim == 256
                      else (batch_for(page_size) + [(3, 2 * block_kv + 70)], KV_HEADS))
    q, k_pool, v_pool, table, cu, kv_lens = make_batch(
        rng, seqs, page_size, group, head_dim, jnp.dtype(dtype), kv_heads=kv_heads)
    scale = head_dim ** -0.5
    out = ragged_paged_attention_mgpu(q, k_pool, v_pool, LAYER, table, cu, kv_lens, scale=scale,
                                      block_kv=block_kv, num_slots=num_slots,
                                      warpgroups=warpgroups, warp_specialized=ws,
                                      interpret=True, detect_races=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, reference(q, k_pool, v_pool, table, cu, kv_lens, scale), cu[-1], dtype, seed)
    # read once the call has run (the check above waits for it); the state is this call's
    assert not gpu_callbacks.get_races().races_found, "the interpreter saw a data race"


DECODE_CASES = [(16, 4, 128, "float32", None), (1, 8, 64, "bfloat16", 2),
                (16, 1, 64, "float32", 3), (32, 6, 256, "bfloat16", 2)]


@pytest.mark.parametrize("page_size,group,head_dim,dtype,splits", DECODE_CASES)
def test_decode_kernel_matches_float64(page_size, group, head_dim, dtype, splits):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    ps = page_size
    seqs = [(0, 1), (ps - 1, 1), (ps, 1), (3 * ps + 2, 1), (70, 1)]
    q, k_pool, v_pool, table, cu, kv_lens = make_batch(
        rng, seqs, page_size, group, head_dim, jnp.dtype(dtype), pad_tokens=2, pad_seqs=2)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k_pool, v_pool, LAYER, table, kv_lens, scale=scale,
                                 block_kv=16, num_splits=splits, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, reference(q, k_pool, v_pool, table, cu, kv_lens, scale), cu[-1], dtype, seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_lower_to_triton_for_gpus(dtype):
    """Both kernels lower for CUDA (to Triton IR) at an engine-sized shape: Qwen3-0.6B's
    attention, page size 16, a 2k context."""
    dt = jnp.dtype(dtype)
    pool = jax.ShapeDtypeStruct((28, 8, 4096, 16, 128), dt)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    ragged = jax.jit(functools.partial(ragged_paged_attention, scale=0.1))
    decode = jax.jit(functools.partial(paged_decode_attention, scale=0.1))
    for fn, args in ((ragged, (jax.ShapeDtypeStruct((512, 16, 128), dt), pool, pool, i32(()),
                               i32((64, 128)), i32((65,)), i32((64,)))),
                     (decode, (jax.ShapeDtypeStruct((64, 16, 128), dt), pool, pool, i32(()),
                               i32((64, 128)), i32((64,))))):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text


@pytest.mark.parametrize("tokens,block_kv,num_slots,warpgroups,ws", [
    (509, 128, 3, 1, False), (4096, 64, 2, None, False),
    (509, 64, 3, 1, True), (4096, 128, 2, 2, True)])  # with a loading warpgroup: 2 and 3 in all
def test_mgpu_kernel_lowers_to_mosaic_gpu(tokens, block_kv, num_slots, warpgroups, ws):
    """The Mosaic GPU kernel lowers for CUDA (its TMA and wgmma layouts and its shared memory
    are checked then) at the engine's shape, with a token count that is not a multiple of the
    8-row tiles too."""
    pool = jax.ShapeDtypeStruct((28, 8, 4096, 16, 128), jnp.bfloat16)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    fn = jax.jit(functools.partial(ragged_paged_attention_mgpu, scale=0.1, block_kv=block_kv,
                                   num_slots=num_slots, warpgroups=warpgroups,
                                   warp_specialized=ws))
    text = fn.trace(jax.ShapeDtypeStruct((tokens, 16, 128), jnp.bfloat16), pool, pool, i32(()),
                    i32((64, 128)), i32((65,)), i32((64,))).lower(
                        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


def test_kernel_shape_errors():
    q, pool = jnp.zeros((4, 4, 64)), jnp.zeros((1, 2, 4, 16, 64))
    table, lens = jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="block_kv must be a power of two"):
        paged_decode_attention(q, pool, pool, 0, table, lens, scale=1.0, block_kv=48, interpret=True)
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        ragged_paged_attention(q, pool, pool, 0, table, jnp.array([0, 2, 4]), lens, scale=1.0,
                               block_q=24, interpret=True)
    args = (pool, pool, 0, table, jnp.array([0, 2, 4]), lens)
    with pytest.raises(ValueError, match=r"float16 on a GPU \(float32 only in its interpreter\), "
                                         "got float32"):
        ragged_paged_attention_mgpu(q, *args, scale=1.0)
    # pools of the queries' dtype from here on (the kernel checks that first)
    qb, pb = q.astype(jnp.bfloat16), pool.astype(jnp.bfloat16)
    args = (pb, pb, *args[2:])
    with pytest.raises(ValueError, match="head_dim to be a multiple of 64, got 32"):
        ragged_paged_attention_mgpu(jnp.zeros((4, 4, 32), jnp.bfloat16), pb[..., :32],
                                    pb[..., :32], *args[2:], scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="block_kv=96"):
        ragged_paged_attention_mgpu(qb, *args, scale=1.0, block_kv=96, interpret=True)
    big = jnp.zeros((1, 2, 4, 16, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="num_slots=4, warpgroups=1 need 294912 bytes"):
        ragged_paged_attention_mgpu(jnp.zeros((4, 4, 128), jnp.bfloat16), big, big, *args[2:],
                                    scale=1.0, block_kv=128, num_slots=4, interpret=True)
    with pytest.raises(ValueError, match=r"divide the GQA group \(2\), got 4"):
        ragged_paged_attention_mgpu(qb, *args, scale=1.0, warpgroups=4, interpret=True)
    with pytest.raises(ValueError, match="head_dim of q"):
        ragged_paged_attention(jnp.zeros((4, 4, 32)), pool, pool, 0, table, jnp.array([0, 2, 4]),
                               lens, scale=1.0, interpret=True)
