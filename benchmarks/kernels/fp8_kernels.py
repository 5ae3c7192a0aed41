"""The attention kernels over FP8 KV pools (``kv_cache_dtype="fp8_e4m3"``) on the device, beside
the same kernels over bfloat16 pools:

* correctness: each kernel (Triton ragged, Triton decode, Mosaic GPU ragged where the shape
  fits) over FP8 pools against the jnp reference over the same FP8 pools (relative error; the
  check ``bench_kernels.py`` makes for bfloat16: < 2e-2);
* time: the decode batch (``decode_batch`` sequences at the first context: the decode kernel
  and the ragged one) and the prefill batch (the ragged kernels), each over bfloat16 pools and
  over FP8 pools of the same values, and the KV bytes/s of each (FP8: half the bytes).

A scale per KV head maps its largest value onto 448, as the engine's calibration does.

    python benchmarks/kernels/fp8_kernels.py                 # the qwen3-0.6b attention shape
    python benchmarks/kernels/fp8_kernels.py --tiny          # tiny shapes (interpreted on CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_cases import (Args, full_sizes, make_args, make_layout, rel_err,  # noqa: E402
                          time_call, tiny_sizes, traffic)
from kernel_impls import mgpu_fits  # noqa: E402

from minijax_serve.attention.kv_cache import as_stored  # noqa: E402
from minijax_serve.core.fp8 import to_fp8  # noqa: E402
from pallas_kernels.paged_decode_attention import paged_decode_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu  # noqa: E402
from pallas_kernels.reference import ragged_paged_attention_ref  # noqa: E402


def to_fp8_pools(args: Args) -> Args:
    """``args`` with FP8 pools (a scale per KV head) and their scales."""
    out = dict(args)
    for name in ("k", "v"):
        pool = args[f"{name}_pool"].astype(jnp.float32)
        scale = jnp.maximum(jnp.abs(pool).max(axis=(0, 2, 3, 4)), 1e-6) / 448.0
        out[f"{name}_pool"] = to_fp8(pool, scale[None, :, None, None, None])
        out[f"{name}_scale"] = scale
        out[f"{name}_new"] = as_stored(args[f"{name}_new"], scale)
    return out


def kernels(head_dim: int, interpret: bool, fits_mgpu: bool) -> dict:
    scale = 1.0 / math.sqrt(head_dim)

    def scales(a):
        return (a["k_scale"], a["v_scale"]) if "k_scale" in a else None

    impls = {
        "pallas_ragged": lambda a: ragged_paged_attention(
            a["q"], a["k_pool"], a["v_pool"], 0, a["page_table"], a["cu_q_lens"], a["kv_lens"],
            scale=scale, interpret=interpret, scales=scales(a)),
        "pallas_decode": lambda a: paged_decode_attention(
            a["q"], a["k_pool"], a["v_pool"], 0, a["page_table"], a["kv_lens"], scale=scale,
            interpret=interpret, scales=scales(a)),
        "xla": lambda a: ragged_paged_attention_ref(
            a["q"], a["k_new"], a["v_new"], a["k_pool"], a["v_pool"], 0, a["page_table"],
            a["cu_q_lens"], a["seq_ids"], a["positions"], a["kv_lens"], scale,
            k_scale=a.get("k_scale"), v_scale=a.get("v_scale"))}
    if fits_mgpu:
        impls["mgpu_ragged"] = lambda a: ragged_paged_attention_mgpu(
            a["q"], a["k_pool"], a["v_pool"], 0, a["page_table"], a["cu_q_lens"], a["kv_lens"],
            scale=scale, interpret=interpret, scales=scales(a),
            **({"warpgroups": 1} if interpret else {}))
    return impls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU: interpreted)")
    p.add_argument("--budget-s", type=float, default=1.0, help="timing per row at most")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    sizes = tiny_sizes() if args.tiny else full_sizes()
    shape, interpret = sizes.shape, jax.default_backend() == "cpu"
    rng = np.random.default_rng(0)
    impls = kernels(shape.head_dim, interpret, mgpu_fits(shape))
    rows, failed = [], False
    mixed = make_layout(sizes.ragged_check, shape.page_size, sizes.pad_tokens, rng)
    decode = make_layout([(1, n) for n in sizes.decode_check], shape.page_size, 0, rng)
    for case, lay, names in (("ragged_mixed", mixed, ["pallas_ragged", "mgpu_ragged"]),
                             ("decode", decode, ["pallas_decode"])):
        a = to_fp8_pools(make_args(lay, shape, jnp.bfloat16, rng))
        ref = jax.jit(impls["xla"])(a)
        for name in (n for n in names if n in impls):
            err = rel_err(jax.jit(impls[name])(a), ref, lay.num_real)
            failed |= not err < 2e-2
            rows.append(dict(kind="check", case=case, impl=name, kv="fp8_e4m3", rel_err=err))
            print(f"check {case:<13} {name:<14} FP8 pools: rel. error {err:.2e} vs the "
                  f"reference on the same pools{'' if err < 2e-2 else '  FAILED'}", flush=True)
    timed = {f"decode_b{sizes.decode_batch}_{sizes.decode_contexts[0]}":
             ([(1, sizes.decode_contexts[0])] * sizes.decode_batch, ["pallas_decode",
                                                                      "pallas_ragged"]),
             "prefill": (sizes.prefill, ["pallas_ragged", "mgpu_ragged"])}
    for case, (seqs, names) in timed.items():
        lay = make_layout(seqs, shape.page_size, 0, rng)
        bf16 = make_args(lay, shape, jnp.bfloat16, rng)
        for kv, a in (("bfloat16", bf16), ("fp8_e4m3", to_fp8_pools(bf16))):
            kv_bytes, _ = traffic(lay, shape, 1 if kv == "fp8_e4m3" else 2)
            for name in (n for n in names if n in impls and not (interpret and n == "mgpu_ragged")):
                t = time_call(impls[name], a, reps=20, inner=1 if interpret else 10,
                              budget_s=args.budget_s, min_samples=1 if interpret else 3)
                rows.append(dict(kind="time", case=case, impl=name, kv=kv, bytes=kv_bytes, **t))
                print(f"time  {case:<18} {name:<14} {kv:<9} {t['median_s'] * 1e3:9.3f} ms "
                      f"{kv_bytes / t['median_s'] / 1e9:8.1f} GB/s", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"device": jax.devices()[0].device_kind,
                                                      "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
