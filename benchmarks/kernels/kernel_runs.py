"""The three runs of ``bench_kernels.py``: the correctness checks against the float32
reference, the timed cases, and lowering every call for CUDA (``--lower-only``)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from kernel_cases import (CHECKS, INFO_ONLY, PEERS, THRESHOLD, Args, Sizes, Variant,
                          abstract_args, cast, check_cases, make_args, make_layout, rel_err,
                          time_call, timing_variants, traffic)
from kernel_impls import implementations
from kernel_report import Report, run_case
from kernel_sweeps import untried
from torch_peer import run as run_peer
from torch_peer import time_peer


def correctness(report: Report, sizes: Sizes, rng: np.random.Generator,
                impls: dict[str, Callable], ok_impls: set[str]) -> None:
    for case, lay, names in check_cases(sizes, rng):
        # inputs are made lazily (functools.cache), so that an error lands in the rows
        base = functools.cache(functools.partial(make_args, lay, sizes.shape, jnp.float32, rng))
        for dtype in ("float32", "bfloat16"):
            @functools.cache
            def inputs(dtype: str = dtype, base: Callable[[], Args] = base) -> tuple[Args, Any]:
                args = cast(base(), jnp.dtype(dtype))
                return args, jax.jit(impls["xla"])(cast(args, jnp.float32))  # ref: rounded values

            for name in (n for n in names if n in ok_impls and (n, dtype) in CHECKS):
                row = {"case": case, "impl": name, "dtype": dtype, "threshold": THRESHOLD[dtype],
                       "required": name not in INFO_ONLY,
                       "seqs": [[int(q), int(k)] for q, k in zip(lay.q_lens, lay.kv_lens)]}

                def check(name=name, inputs=inputs, lay=lay) -> dict:
                    args, ref = inputs()
                    out = (run_peer(name, args, lay, sizes.shape) if name in PEERS
                           else jax.jit(impls[name])(args))
                    err = rel_err(out, ref, lay.num_real)
                    return {"rel_err": err, "ok": err <= THRESHOLD[dtype]}
                run_case(report, "correctness", row, check)


def timed(report: Report, key: str, variants: list[Variant], sizes: Sizes,
          rng: np.random.Generator, ceiling: dict[str, float], opts: argparse.Namespace) -> None:
    """Time each variant in bfloat16, its case's batch made once (lazily) for its variants."""
    shape, dtype = sizes.shape, jnp.bfloat16
    for case in dict.fromkeys(v.case for v in variants):
        group = [v for v in variants if v.case == case]
        lay = make_layout(group[0].seqs, shape.page_size, 0, rng)
        args = functools.cache(functools.partial(make_args, lay, shape, dtype, rng))
        nbytes, flops = traffic(lay, shape, jnp.dtype(dtype).itemsize)
        for v in group:
            row = {"case": case, "impl": v.impl, "required": v.required, "dtype": "bfloat16",
                   "num_seqs": len(v.seqs), "num_tokens": lay.num_tokens,
                   "kv_tokens": int(lay.kv_lens.sum()), "bytes": nbytes, "flops": flops}

            def measure(v=v, lay=lay) -> dict:
                timing = (opts.reps, opts.inner, opts.budget_s, opts.min_samples, opts.warmups)
                with ptxas_report(untried(v.impl)):
                    r = (time_peer(v.impl, args(), lay, shape, *timing) if v.impl in PEERS
                         else time_call(v.fn, args(), *timing))
                bps, fps = nbytes / r["median_s"], flops / r["median_s"]
                return {**r, "bytes_per_s": bps, "fraction_of_copy": bps / ceiling["copy"],
                        "flops_per_s": fps, "fraction_of_matmul": fps / ceiling["matmul"]}
            run_case(report, key, row, measure)
        args.cache_clear()  # free the pools before the next case


@contextlib.contextmanager
def ptxas_report(on: bool) -> Iterator[None]:
    """With ``on``, the Mosaic GPU kernels compiled inside print ptxas's report (registers a
    thread, spills) to stdout, just before their row: Mosaic GPU reads the variable at each
    compile. Only for kernels no GPU has run, so that a JAX whose compiler gives no report
    costs no other row."""
    name = "MOSAIC_GPU_DUMP_PTXAS"
    before = os.environ.get(name)
    if on:
        os.environ[name] = "1"
    try:
        yield
    finally:
        if on and before is None:
            del os.environ[name]
        elif on:
            os.environ[name] = before


def lower_only(report: Report, sizes: Sizes, rng: np.random.Generator,
               extra: list[Variant]) -> None:
    """Lower every call of a run (correctness in float32 and bfloat16, timings in bfloat16, and
    ``extra``) for CUDA with interpret=False: Pallas -> Triton or Mosaic GPU, no GPU needed,
    nothing runs."""
    impls = implementations(sizes.shape, interpret=False)
    calls = [(case, lay, n, impls[n], dtype)
             for case, lay, names in check_cases(sizes, rng) for dtype in ("float32", "bfloat16")
             for n in names + ["xla"] if (n, dtype) in CHECKS and n in impls]
    calls += [(v.case, make_layout(v.seqs, sizes.shape.page_size, 0, rng), v.impl, v.fn,
               "bfloat16") for v in timing_variants(sizes, impls) + extra]
    for case, lay, name, fn, dtype in calls:
        args = abstract_args(lay, sizes.shape, jnp.dtype(dtype))

        def lower(fn=fn, args=args) -> dict:
            text = jax.jit(fn).trace(args).lower(lowering_platforms=("cuda",)).as_text()
            calls = text.count("__gpu$xla.gpu.triton") + text.count("@mosaic_gpu")
            return {"kernel_calls": calls, "chars": len(text)}
        run_case(report, "lowered", {"case": case, "impl": name, "dtype": dtype}, lower)
