"""The Mosaic GPU ragged kernel's limits (:mod:`pallas_kernels.ragged_paged_attention_mgpu`):
its block sizes, the shared memory its tiles take, and the inputs it accepts."""

from __future__ import annotations

import jax.numpy as jnp

BLOCK_Q = 64  # one warpgroup's wgmma rows
BLOCK_KV, NUM_SLOTS = 64, 2  # the defaults (the engine's)
# Registers per thread with warp specialisation and two computing warpgroups (FlashAttention-3's
# split): the loader gives up what the two accumulators need; 128 x (2 x 232 + 40) = 64,512 of
# the 65,536 an SM holds
COMPUTE_REGISTERS, LOADER_REGISTERS = 232, 40
# Hopper's shared memory per block, less what Mosaic GPU adds to the tiles (barriers, its
# scratch: 2.1 KiB in the lowerings measured)
MAX_TILE_BYTES = 232448 - 2560


def tile_bytes(head_dim: int, block_kv: int, num_slots: int, warpgroups: int,
               itemsize: int = 2, kv_itemsize: int | None = None) -> int:
    """Shared memory of the tiles: queries and output per warpgroup, K and V per slot (in
    ``kv_itemsize`` bytes; FP8 pools' also converted, per warpgroup, in ``itemsize``)."""
    kv_itemsize = kv_itemsize or itemsize
    converted = 2 * warpgroups * block_kv * itemsize if kv_itemsize != itemsize else 0
    return head_dim * (2 * warpgroups * BLOCK_Q * itemsize
                       + 2 * num_slots * block_kv * kv_itemsize + converted)


def default_warpgroups(group: int, head_dim: int, block_kv: int, num_slots: int,
                       kv_itemsize: int = 2) -> int:
    """Two warpgroups (query heads) per program where the GQA group splits in two and their
    tiles fit in shared memory, else one."""
    kv_itemsize = min(kv_itemsize, 2)  # float32 runs only interpreted, at a GPU's 16 bits
    fits = tile_bytes(head_dim, block_kv, num_slots, 2, 2, kv_itemsize) <= MAX_TILE_BYTES
    return 2 if group % 2 == 0 and fits else 1


def check_mgpu_shapes(dtype, head_dim: int, page_size: int, block_kv: int, num_slots: int,
                      group: int = 1, warpgroups: int = 1, interpret: bool = False,
                      kv_dtype=None) -> None:
    """Raise ValueError for inputs this kernel does not take (float32: in the interpreter only;
    ``kv_dtype``: the pools', ``dtype`` or float8_e4m3fn)."""
    dtypes = (jnp.bfloat16, jnp.float16) + ((jnp.float32,) if interpret else ())
    if jnp.dtype(dtype) not in tuple(map(jnp.dtype, dtypes)):
        raise ValueError(f"the Mosaic GPU kernel needs bfloat16 or float16 on a GPU (float32 "
                         f"only in its interpreter), got {jnp.dtype(dtype)}")
    kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
    if kv_dtype not in (jnp.dtype(dtype), jnp.dtype(jnp.float8_e4m3fn)):
        raise ValueError(f"the Mosaic GPU kernel reads pools of the queries' dtype or "
                         f"float8_e4m3fn, got {kv_dtype}")
    if head_dim % 64:
        raise ValueError(f"the Mosaic GPU kernel needs head_dim to be a multiple of 64, got {head_dim}")
    if page_size % 8 or block_kv % page_size or block_kv % 64:
        raise ValueError(f"the Mosaic GPU kernel needs page_size a multiple of 8 and block_kv a "
                         f"multiple of 64 and of page_size, got page_size={page_size}, "
                         f"block_kv={block_kv}")
    if num_slots < 2:
        raise ValueError(f"num_slots must be at least 2, got {num_slots}")
    if warpgroups not in (1, 2) or group % warpgroups:
        raise ValueError(f"warpgroups must be 1 or 2 and divide the GQA group ({group}), "
                         f"got {warpgroups}")
    # float32 runs only interpreted: its tiles are checked at a GPU's 16 bits
    need = tile_bytes(head_dim, block_kv, num_slots, warpgroups, min(2, jnp.dtype(dtype).itemsize),
                      min(2, kv_dtype.itemsize))
    if need > MAX_TILE_BYTES:
        raise ValueError(f"block_kv={block_kv}, num_slots={num_slots}, warpgroups={warpgroups} "
                         f"need {need} bytes of shared memory at head_dim {head_dim}, over "
                         f"{MAX_TILE_BYTES}")
