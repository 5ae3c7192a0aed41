"""torch's attention beside ours in ``bench_kernels.py``: the same batch in the same run, so that
every kernel figure has a peer measured on the same GPU (issue 51).

* ``torch_sdpa``  ``scaled_dot_product_attention`` restricted to its flash backend, on the batch's
  K/V gathered into contiguous dense tensors once, outside the timing: FlashAttention on unpaged
  K/V, the figure paging is measured against. The causal mask is aligned bottom right (a chunk
  after its cached prefix); GQA as the flash kernel takes it (fewer K/V heads). SDPA takes no
  ragged batch, so only batches whose sequences all have one shape: the decode and prefill
  cases.
* ``torch_flex``  FlexAttention over the paged pool itself: the pool viewed as
  ``[1, kv_heads, pages * page_size, D]`` (batch 1, broadcast) and a ``BlockMask`` whose KV
  blocks are each sequence's pages in its table order (full pages unmasked, the last partial
  page masked by position). ``torch.compile``d on GPUs; eager on a CPU, where it is torch's
  reference implementation, as the Pallas kernels are interpreted there. Decode batches (one
  new token per sequence).

Both take the arrays JAX made through DLPack (no copy). Timed like ours (``kernel_cases.
sample``): the first call (FlexAttention's compile) reported as the compile, warm-up calls, then
samples of ``inner`` back-to-back calls and one synchronisation.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np
from kernel_cases import OURS, PEERS, Args, Layout, Shape, sample

_compiled_flex: list[Callable] = []  # torch.compile(flex_attention), made once per process


def torch_version() -> str | None:
    """torch's version, or None where it is not installed (the peers' rows then say so)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def _torch(x: jax.Array) -> Any:
    import torch
    return torch.from_dlpack(x)


def _uniform(lay: Layout) -> tuple[int, int]:
    """(new tokens, kv_len) shared by every sequence of the batch."""
    shapes = set(zip(lay.q_lens.tolist(), lay.kv_lens.tolist()))
    if len(shapes) != 1 or lay.num_real != lay.num_tokens:
        raise ValueError("torch_sdpa takes batches whose sequences all have one shape and no "
                         f"padding tokens, got {sorted(shapes)[:4]}")
    return shapes.pop()


def _sdpa(args: Args, lay: Layout, shape: Shape) -> Callable[[], Any]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    new, kv_len = _uniform(lay)
    s, h, d = len(lay.kv_lens), shape.num_heads, shape.head_dim

    def dense(pool: jax.Array) -> Any:  # [1, kv_heads, P, ps, D] -> [S, kv_heads, kv_len, D]
        x = pool[0][:, args["page_table"]]
        x = x.reshape(shape.kv_heads, s, -1, d)[:, :, :kv_len]
        return _torch(x.transpose(1, 0, 2, 3))

    q = _torch(args["q"].reshape(s, new, h, d).transpose(0, 2, 1, 3))
    k, v = dense(args["k_pool"]), dense(args["v_pool"])
    mask = causal_lower_right(new, kv_len) if new > 1 else None
    scale = 1.0 / float(np.sqrt(d))

    def call() -> Any:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)  # [S, new, H, D], a view
    return call


def _block_mask(lay: Layout, page_size: int, device: Any) -> Any:
    """The BlockMask of a decode batch over the physical pool: query block 0 of sequence b sees
    the pages of its table; the pages it fills are full blocks, a last partial one is masked by
    position (``mask_mod`` also refuses every page not in the sequence, for torch's eager path,
    which reads only the mask)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    s, pages = len(lay.kv_lens), lay.num_pages
    used = -(-lay.kv_lens // page_size)
    full = lay.kv_lens // page_size
    logical = np.full((s, pages), -1, np.int32)  # physical page -> its index in the sequence
    partial_num = (used - full).astype(np.int32)
    partial_idx = np.zeros((s, pages), np.int32)
    full_idx = np.zeros((s, pages), np.int32)
    for b in range(s):
        row = lay.page_table[b, :used[b]]
        logical[b, row] = np.arange(used[b])
        full_idx[b, :full[b]] = row[:full[b]]
        if used[b] > full[b]:
            partial_idx[b, 0] = row[-1]
    t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    logical_t, kv_lens_t = t(logical), t(lay.kv_lens.astype(np.int32))

    def mask_mod(b, h, q_idx, kv_idx):
        page = logical_t[b, kv_idx // page_size]
        return (page >= 0) & (page * page_size + kv_idx % page_size < kv_lens_t[b])

    return BlockMask.from_kv_blocks(
        t(partial_num).view(s, 1, 1), t(partial_idx).view(s, 1, 1, pages),
        t(full.astype(np.int32)).view(s, 1, 1), t(full_idx).view(s, 1, 1, pages),
        BLOCK_SIZE=page_size, mask_mod=mask_mod, seq_lengths=(1, pages * page_size))


def _flex(args: Args, lay: Layout, shape: Shape) -> Callable[[], Any]:
    from torch.nn.attention.flex_attention import flex_attention

    if not (lay.q_lens == 1).all():
        raise ValueError("torch_flex takes decode batches (one new token per sequence)")
    s, d, ps = len(lay.kv_lens), shape.head_dim, shape.page_size
    q = _torch(args["q"])[:s].unsqueeze(2)  # [S, H, 1, D]
    # one pool for every sequence: K/V of batch 1, which FlexAttention broadcasts over the
    # queries' batch (an expanded view would be copied whole per sequence where it needs a
    # contiguous input)
    pools = [_torch(args[k]).reshape(1, shape.kv_heads, lay.num_pages * ps, d)
             for k in ("k_pool", "v_pool")]
    mask = _block_mask(lay, ps, q.device)
    fn = flex_attention
    if q.device.type != "cpu":
        if not _compiled_flex:
            import torch
            _compiled_flex.append(torch.compile(flex_attention, dynamic=False))
        fn = _compiled_flex[0]
    scale = 1.0 / float(np.sqrt(d))
    options = {"BLOCK_N": ps}  # a KV tile is one page: the block mask's blocks are pages
    return lambda: fn(q, *pools, block_mask=mask, scale=scale, enable_gqa=True,
                      kernel_options=options).transpose(1, 2)


PREPARE = {"torch_sdpa": _sdpa, "torch_flex": _flex}


def run(name: str, args: Args, lay: Layout, shape: Shape) -> np.ndarray:
    """The peer's output on a batch as [real tokens, num_heads, head_dim] float32 (the rows the
    reference has), for the correctness check."""
    out = PREPARE[name](args, lay, shape)()
    return out.float().reshape(-1, shape.num_heads, shape.head_dim).cpu().numpy()


def time_peer(name: str, args: Args, lay: Layout, shape: Shape, reps: int, inner: int,
              budget_s: float, min_samples: int = 3, warmups: int = 2) -> dict[str, Any]:
    """``kernel_cases.time_call`` for a peer (same fields; compile_s = the first call)."""
    import torch

    call = PREPARE[name](args, lay, shape)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t0 = time.perf_counter()
    call()
    sync()
    compile_s = time.perf_counter() - t0
    for _ in range(warmups):
        call()
    sync()

    def calls() -> None:
        for _ in range(inner):
            call()
        sync()
    return {**sample(calls, inner, reps, budget_s, min_samples), "compile_s": compile_s,
            "torch_version": torch.__version__}


def versus_peers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per timed case and peer: our fastest kernel's time against the peer's (``speed`` > 1: ours
    is faster), from the timing rows that ran."""
    ran = [r for r in rows if "error" not in r and "median_s" in r]
    out = []
    for case in dict.fromkeys(r["case"] for r in ran):
        ours = [r for r in ran if r["case"] == case and r["impl"] in OURS]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["median_s"])
        out += [{"case": case, "ours": best["impl"], "ours_ms": best["median_s"] * 1e3,
                 "peer": p["impl"], "peer_ms": p["median_s"] * 1e3,
                 "speed": p["median_s"] / best["median_s"]}
                for p in ran if p["case"] == case and p["impl"] in PEERS]
    return out


def format_versus(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{r['case']:<16} {r['ours']} {r['ours_ms']:.3f} ms vs {r['peer']} "
            f"{r['peer_ms']:.3f} ms: ours at {r['speed']:.2f}x the peer's speed" for r in rows]
