"""Every attention backend's kernel over FP8 pools (``kv_cache_dtype="fp8_e4m3"``), in interpret
mode, against the float64 reference of the dequantised pools: the kernels read float8_e4m3fn
pages and a scale per KV head and must reach the same attention as plain pools of the values
those pages hold. Each KV head gets its own magnitude (and so its own scale), so a scale applied
to the wrong head fails. Fresh random inputs each run (the seed is in every failure message)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minijax_serve.core.fp8 import FP8, to_fp8
from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu
from pallas_kernels.reference import ragged_paged_attention_ref
from tests.kernels.test_pallas_kernels import (LAYER, assert_matches, batch_for, fresh_seed,
                                               make_batch, reference)

HEAD_MAGNITUDES = np.array([0.05, 8.0])  # one per KV head: the scales differ by 160x


def fp8_batch(rng, seqs, page_size, group, head_dim, dtype, **kwargs):
    """``make_batch``'s batch with FP8 pools: (q, k8, v8, table, cu, kv_lens), the scales
    (k_scale, v_scale) [kv_heads] of LAYER, and the pools the FP8 ones stand for (float32)."""
    q, k_pool, v_pool, table, cu, kv_lens = make_batch(rng, seqs, page_size, group, head_dim,
                                                       np.float32, **kwargs)
    quantized, plain, scales = [], [], []
    for pool in (k_pool, v_pool):
        pool = pool * HEAD_MAGNITUDES[None, :, None, None, None]
        scale = np.abs(pool[LAYER]).max(axis=(1, 2, 3)) / 448.0
        stored = to_fp8(jnp.asarray(pool), jnp.asarray(scale)[None, :, None, None, None])
        quantized.append(stored)
        plain.append(np.asarray(stored.astype(jnp.float32)) * scale[None, :, None, None, None])
        scales.append(jnp.asarray(scale, jnp.float32))
    q = jnp.asarray(q, dtype)
    return (q, *quantized, table, cu, kv_lens), tuple(scales), plain


@pytest.mark.parametrize("page_size,group,head_dim,dtype", [(16, 4, 64, "float32"),
                                                            (1, 2, 128, "bfloat16")])
def test_ragged_kernel_reads_fp8_pools(page_size, group, head_dim, dtype):
    seed = fresh_seed()
    (q, k8, v8, table, cu, kv_lens), scales, (k, v) = fp8_batch(
        np.random.default_rng(seed), batch_for(page_size), page_size, group, head_dim,
        jnp.dtype(dtype))
    assert k8.dtype == v8.dtype == FP8
    scale = head_dim ** -0.5
    out = ragged_paged_attention(q, k8, v8, LAYER, table, cu, kv_lens, scale=scale, block_q=16,
                                 block_kv=16, interpret=True, scales=scales)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, reference(q, k, v, table, cu, kv_lens, scale), cu[-1], dtype, seed)


def test_decode_kernel_reads_fp8_pools():
    seed = fresh_seed()
    seqs = [(0, 1), (15, 1), (16, 1), (50, 1), (70, 1)]
    (q, k8, v8, table, cu, kv_lens), scales, (k, v) = fp8_batch(
        np.random.default_rng(seed), seqs, 16, 4, 64, jnp.float32, pad_tokens=2, pad_seqs=2)
    scale = 64 ** -0.5
    out = paged_decode_attention(q, k8, v8, LAYER, table, kv_lens, scale=scale, block_kv=16,
                                 num_splits=2, interpret=True, scales=scales)
    assert_matches(out, reference(q, k, v, table, cu, kv_lens, scale), cu[-1], "float32", seed)


@pytest.mark.parametrize("ws", [False, True])
def test_mgpu_kernel_reads_fp8_pools(ws):
    """The Mosaic GPU kernel in its interpreter, race detector on: FP8 pages land in shared
    memory and each warpgroup converts them; a prefill over several KV blocks too; with
    ``ws``, loaded by a warpgroup of their own for the one that computes."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    seed = fresh_seed()
    seqs = [(15, 1), (100, 30)]  # the last over 3 KV blocks through 2 slots
    (q, k8, v8, table, cu, kv_lens), scales, (k, v) = fp8_batch(
        np.random.default_rng(seed), seqs, 16, 1, 64, jnp.float32)
    scale = 64 ** -0.5
    out = ragged_paged_attention_mgpu(q, k8, v8, LAYER, table, cu, kv_lens, scale=scale,
                                      warpgroups=1, warp_specialized=ws, interpret=True,
                                      detect_races=True, scales=scales)
    assert_matches(out, reference(q, k, v, table, cu, kv_lens, scale), cu[-1], "float32", seed)
    assert not gpu_callbacks.get_races().races_found, "the interpreter saw a data race"


def test_jnp_reference_reads_fp8_pools():
    """The engine's CPU path: the pools as the engine holds them (the FP8 values' bits, uint8),
    their prefixes dequantised as gathered; the step's own new keys and values are given as the
    pools store them (as the backend rounds them)."""
    seed = fresh_seed()
    (q, k8, v8, table, cu, kv_lens), scales, (k, v) = fp8_batch(
        np.random.default_rng(seed), batch_for(16), 16, 4, 64, jnp.float32)
    t, seq_ids, positions = q.shape[0], np.zeros(q.shape[0], np.int32), np.zeros(q.shape[0], np.int32)
    k_new = np.zeros((t, k.shape[1], k.shape[-1]), np.float32)
    v_new = np.zeros_like(k_new)
    for s in range(len(kv_lens)):
        n = cu[s + 1] - cu[s]
        pos = np.arange(kv_lens[s] - n, kv_lens[s])
        pages, offsets = table[s, pos // 16], pos % 16
        rows = slice(cu[s], cu[s + 1])
        seq_ids[rows], positions[rows] = s, pos
        k_new[rows] = k[LAYER][:, pages, offsets].transpose(1, 0, 2)
        v_new[rows] = v[LAYER][:, pages, offsets].transpose(1, 0, 2)
    scale = 64 ** -0.5
    out = jax.jit(functools.partial(ragged_paged_attention_ref, scale=scale,
                                    k_scale=scales[0], v_scale=scales[1]))(
        q, k_new, v_new, *(jax.lax.bitcast_convert_type(p, jnp.uint8) for p in (k8, v8)), LAYER,
        table, cu, seq_ids, positions, kv_lens)
    rows = cu[-1]  # the reference leaves padding rows as they fall (the engine drops them)
    ref = reference(q, k, v, table, cu, kv_lens, scale)
    assert_matches(np.asarray(out)[:rows], ref[:rows], rows, "float32", seed)


@pytest.mark.parametrize("kernel", ["ragged", "decode", "mgpu"])
def test_fp8_kernels_lower_for_gpus(kernel):
    """With FP8 pools, each kernel lowers for CUDA at an engine-sized shape (Qwen3-0.6B's
    attention, bfloat16 queries): Triton's FP8 conversion, and Mosaic GPU's TMA copies of FP8
    pages, their conversion through registers and the shared memory it takes."""
    pool = jax.ShapeDtypeStruct((28, 8, 4096, 16, 128), FP8)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    scales = (jax.ShapeDtypeStruct((8,), jnp.float32),) * 2
    q = jax.ShapeDtypeStruct((64 if kernel == "decode" else 512, 16, 128), jnp.bfloat16)
    if kernel == "decode":
        fn, args = paged_decode_attention, (i32((64, 128)), i32((64,)))
    else:
        fn = ragged_paged_attention if kernel == "ragged" else ragged_paged_attention_mgpu
        args = (i32((64, 128)), i32((65,)), i32((64,)))
    text = jax.jit(lambda q, pool, scales, *args: fn(q, pool, pool, 0, *args, scale=0.1,
                                                      scales=scales)).trace(
        q, pool, scales, *args).lower(lowering_platforms=("cuda",)).as_text()
    assert ("custom_call @mosaic_gpu" if kernel == "mgpu" else "xla.gpu.triton") in text
