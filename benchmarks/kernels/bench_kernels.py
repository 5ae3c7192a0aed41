"""Check and time the paged-attention kernels on the default device, one kernel call at a time.

Implementations (all read one layer of paged K/V pools [1, kv_heads, pages, page_size, D]):

* ``pallas_decode``  :func:`pallas_kernels.paged_decode_attention.paged_decode_attention`
* ``pallas_ragged``  :func:`pallas_kernels.ragged_paged_attention.ragged_paged_attention`
* ``mgpu_ragged``    :func:`pallas_kernels.ragged_paged_attention_mgpu.ragged_paged_attention_mgpu`
  (Hopper's TMA and wgmma; bfloat16 only, head_dim a multiple of 64: left out where it does not fit)
* ``mgpu_ragged_ws`` the same with ``warp_specialized=True`` (a warpgroup that only loads;
  information only until a GPU has run it; not in the interpreter)
* ``jax_paged``      JAX's ``jax.experimental.pallas.ops.gpu.paged_attention`` (decode only; it
  takes no scale, so it gets ``q * scale``, precomputed; ``k_splits``/``pages_per_compute_block``
  the largest divisors of the table width up to its defaults 16 / 8)
* ``xla``            the pure-jnp reference, ``reference.ragged_paged_attention_ref`` (it is
  the engine's "xla" backend; it takes the new tokens' K/V as inputs, precomputed here)
* ``torch_sdpa``, ``torch_flex``  torch's FlashAttention (SDPA's flash backend, on the K/V
  gathered dense) and FlexAttention over the paged pool, the same-run peers (``torch_peer.py``;
  information only, left out where torch is not installed or with ``--no-peers``)

1. Correctness, on random inputs (``--seed``, printed), float32 and bfloat16: a ragged mixed
   batch (decodes, short and long prefills with and without a cached prefix, sequences ending
   exactly on a page boundary, one with no new tokens, padding tokens) for ``pallas_ragged`` (and
   ``mgpu_ragged`` and ``mgpu_ragged_ws``, bfloat16), a decode batch for ``pallas_decode`` (and
   ``jax_paged`` and ``torch_flex``, bfloat16 only, for information) and a prefill batch for
   ``torch_sdpa`` (bfloat16), against the float32 reference on the same (bf16-rounded)
   values. Reported: ||out - ref|| / ||ref|| over the real tokens; must be <= 1e-5 (float32) or
   2e-2 (bfloat16).
2. Timings in bfloat16: a decode batch (every sequence at the same context) with every
   implementation, a ragged mixed batch (prefill chunks after a cached prefix plus decodes)
   and a prefill batch (the same chunks alone) with ``pallas_ragged``, ``mgpu_ragged``,
   ``mgpu_ragged_ws`` and ``xla`` (the Mosaic GPU kernel not in the interpreter, where a call
   takes seconds).
   Each implementation is jitted and compiled ahead (compile time reported), run twice (once in
   the interpreter), then timed: one sample = ``--inner`` back-to-back calls, blocked on all
   their outputs, divided by ``--inner`` (so Python dispatch overlaps the device work); the
   median of up to ``--reps`` samples within ``--budget-s`` seconds (at least
   ``--min-samples``, 3 unless told).
   Bytes = the useful traffic: each sequence's kv_len x kv_heads x head_dim x 2 (K and V) x
   itemsize, plus q read and the output written (the same for every implementation, whatever it
   really moves). Achieved bytes/s is compared with the copy bandwidth measured in the same run
   (:func:`minijax_serve.executor.ceilings.copy_bandwidth`: bytes read + bytes written per second),
   the same read + write convention. Attention FLOP/s counts 4 x num_heads x head_dim per
   (query, visible key) pair, against the bf16 matmul peak measured in the same run. Last,
   our fastest kernel of each case against each peer.

Sizes. Default: the qwen3-0.6b attention shape (16 q heads, 8 kv heads, head_dim 128, page size
16, Pallas tiles 64 x 64); decode batch 64 at contexts 2048 and 4096; mixed = 4 prefill chunks
of 1024 tokens after 1024 cached + 64 decodes at 2048; prefill = the 4 chunks alone.
``--tiny``: 4 q heads, 2 kv heads, head_dim 64, page size 8, tiles 16 x 16, decode batch 8 at
128, mixed 2 x (32 after 32) + 4 decodes at 64 (~30-60 s on a 2-core CPU). Timed in the order:
decode at the first context, mixed, prefill, decode at the others (a run cut short has every
kind). On CPU the Pallas kernels run with ``interpret=True``.
``--sweep`` and ``--grid`` (``kernel_sweeps.py``): then the kernels' tile sizes and Triton
settings, and decode batch x context with the routing between our kernels that it implies;
``--skip-timings`` leaves out part 2.
``--lower-only``: lower every call of a run (with ``--sweep``/``--grid``, theirs too) for CUDA
with ``interpret=False`` (Pallas -> Triton IR or Mosaic GPU's; needs no GPU, runs nothing; the
compile to PTX happens only on a GPU, where a tile too large for shared memory shows). With
``--tiny`` each sweep variant is lowered on its first case only: tiny cases differ in sizes
alone. A ``--tiny`` sweep that runs times the first 3 variants of each kernel, on their first
case (interpreted on a CPU, a call takes up to seconds: the full sweep would take minutes).

Prints the rows as they finish and a table at the end; ``--output-json`` gets one JSON object
appended, rewritten after every row (a run cut short keeps what it measured). Exit status 1 if a
required check fails or a Pallas/XLA row errors (JAX's kernel is information only).

    PYTHONPATH=. python benchmarks/kernels/bench_kernels.py --tiny --output-json /tmp/kernels.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from kernel_cases import PEERS, UNTRIED, Variant, full_sizes, timing_variants, tiny_sizes
from kernel_impls import implementations
from kernel_report import BANDWIDTH_CONVENTION, HEADERS, T0, Report, print_summary
from kernel_runs import correctness, lower_only, timed
from kernel_sweeps import (a_few_of_each, first_case_only, format_routing, grid_variants, routing,
                           sweep_variants, untried, write_routing, write_tuning)
from torch_peer import format_versus, torch_version, versus_peers

from minijax_serve.executor import ceilings
from pallas_kernels import tuning


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (~30-60 s on a 2-core CPU)")
    p.add_argument("--lower-only", action="store_true",
                   help="only lower every call of a run for CUDA, interpret=False (no GPU "
                        "needed; nothing runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=50, help="timed samples at most (default 50)")
    p.add_argument("--min-samples", type=int, default=3,
                   help="timed samples at least, whatever the budget (default 3)")
    p.add_argument("--inner", type=int, default=None,
                   help="back-to-back calls per sample (default 5 on accelerators, 1 on CPU)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds of timed samples per implementation and case, after its "
                        "compile and warm-up (default 2 on accelerators, 1 on CPU)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="size of the copy-bandwidth probe (default 2048 MiB on accelerators, "
                        "256 on CPU, 32 with --tiny)")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-timings", action="store_true", help="leave out the timed cases")
    p.add_argument("--no-peers", action="store_true",
                   help="leave out torch's SDPA and FlexAttention (torch_peer.py; left out "
                        "anyway where torch is not installed)")
    p.add_argument("--sweep", action="store_true",
                   help="then time the Pallas kernels' tile sizes and Triton settings "
                        "(kernel_sweeps.py)")
    p.add_argument("--grid", action="store_true",
                   help="then time decode batch x context, our kernels and JAX's, and print "
                        "the routing it implies (kernel_sweeps.py)")
    p.add_argument("--write-tuning", nargs="?", const=str(tuning.TABLE_DIR), default=None,
                   metavar="DIR", help="with --sweep: write each kernel's fastest variant, with "
                   "--grid the decode routing, as the row of this device and shape in the tuning "
                   "tables (pallas_kernels/tuning/, or DIR); refused where the kernels are "
                   "interpreted")
    p.add_argument("--output-json", default=None, help="append one JSON object to this file")
    opts = p.parse_args(argv)
    if opts.write_tuning and not (opts.sweep or opts.grid):
        p.error("--write-tuning needs --sweep or --grid")
    if opts.min_samples < 1:
        p.error(f"--min-samples must be >= 1, got {opts.min_samples}")

    cpu = jax.default_backend() == "cpu"
    interpret = cpu and not opts.lower_only
    opts.inner = opts.inner or (1 if cpu else 5)
    opts.warmups = 1 if interpret else 2  # the interpreter has nothing more to warm
    opts.budget_s = opts.budget_s if opts.budget_s is not None else (1.0 if cpu else 2.0)
    sizes = tiny_sizes() if opts.tiny else full_sizes()
    rng = np.random.default_rng(opts.seed)  # every layout and array comes from it
    dev = jax.devices()[0]
    print(f"bench_kernels: seed {opts.seed}, jax {jax.__version__}, {jax.default_backend()} "
          f"({dev.device_kind}), interpret={interpret}, {'tiny' if opts.tiny else 'full'} sizes: "
          f"{sizes.shape}", flush=True)
    if interpret and not opts.tiny:
        print("note: full sizes in Pallas's interpreter are slow; --tiny or --lower-only on CPU",
              flush=True)
    report = Report(opts.output_json, {
        "kind": "bench_kernels", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "seed": opts.seed,
        "tiny": opts.tiny, "jax_version": jax.__version__, "backend": jax.default_backend(),
        "device_kind": dev.device_kind, "interpret": interpret,
        "shape": dataclasses.asdict(sizes.shape), "complete": False})

    def extra(interpret: bool, jax_paged: Callable | None) -> dict[str, list[Variant]]:
        grid = grid_variants(sizes, interpret, jax_paged) if opts.grid else []
        sweep = sweep_variants(sizes, interpret) if opts.sweep else []
        if opts.tiny:
            sweep = first_case_only(sweep)
            sweep = sweep if opts.lower_only else a_few_of_each(sweep)
        return {"sweep": sweep,
                "grid": [v for v in grid if v.fn is not None]}

    if opts.lower_only:
        report.obj["lowered"] = []
        lowered_impls = implementations(sizes.shape, interpret=False)
        lower_only(report, sizes, rng,
                   sum(extra(False, lowered_impls["jax_paged"]).values(), []))
        failed = [r for r in report.obj["lowered"]
                  if "error" in r or (r["impl"] != "xla" and not r["kernel_calls"])]
    else:
        impls = implementations(sizes.shape, interpret)
        torch_v = None if opts.no_peers else torch_version()
        peers = PEERS if torch_v else ()
        ok_impls = set(impls) | set(peers)
        copy_mib = opts.copy_mib or (32 if opts.tiny else ceilings.default_copy_mib())
        mm_n = 256 if opts.tiny else ceilings.default_matmul_size()
        ceiling = {"copy": ceilings.copy_bandwidth(copy_mib),
                   "matmul": ceilings.matmul_peak_flops(jnp.bfloat16, mm_n)}
        report.obj.update({"copy_mib": copy_mib, "copy_bytes_per_s": ceiling["copy"],
                           "matmul_n": mm_n, "matmul_bf16_flops_per_s": ceiling["matmul"],
                           "torch_version": torch_v, "bandwidth_convention": BANDWIDTH_CONVENTION,
                           "correctness": [], "timings": []})
        report.save()
        print(f"copy bandwidth {ceiling['copy'] / 1e9:.1f} GB/s ({copy_mib} MiB; read + written);"
              f" bf16 matmul peak {ceiling['matmul'] / 1e12:.3g} TFLOP/s ({mm_n}^3); torch "
              f"{torch_v or 'left out: no peers'}\n{BANDWIDTH_CONVENTION}", flush=True)
        late = set(peers) | set(UNTRIED)  # last: their failure, even a crash or a hang,
        # cannot cost the other rows
        if not opts.skip_correctness:
            print("-- correctness (vs the float32 reference)", flush=True)
            correctness(report, sizes, rng, impls, ok_impls - late)
            if any("error" in r for r in report.obj["correctness"] if r["impl"] == "jax_paged"):
                ok_impls.discard("jax_paged")  # it does not run here: not timed, not a failure
                print("jax_paged: not timed (it failed to run above)", flush=True)
        variants = [] if opts.skip_timings else [
            v for v in timing_variants(sizes, impls, interpret, peers) if v.impl in ok_impls]
        runs = {"timings": [v for v in variants if v.impl not in late]}
        runs.update(extra(interpret, impls["jax_paged"] if "jax_paged" in ok_impls else None))
        held = [v for v in runs.get("sweep", []) if untried(v.impl)]  # the sweep's ws=1 rows
        for key, todo in runs.items():
            todo = [v for v in todo if v not in held]
            if todo:
                report.obj[key] = []
                print(f"-- {HEADERS[key]}", flush=True)
                timed(report, key, todo, sizes, rng, ceiling, opts)
        if opts.grid:
            report.obj["routing"] = routing(report.obj["grid"], sizes.shape.kv_heads)
            if opts.write_tuning:
                report.obj["routing_row"] = write_routing(report.obj["routing"], sizes, dev,
                                                          interpret, Path(opts.write_tuning))

        def tuning_rows_now() -> None:  # the sweep's winners so far, as this device's rows
            if opts.write_tuning and opts.sweep:
                report.obj["tuning"] = write_tuning(report.obj.get("sweep", []), sizes, dev,
                                                    interpret, Path(opts.write_tuning))
                report.save()
        tuning_rows_now()  # before the untried rows: a hang of theirs costs no measured choice
        if late & ok_impls or held:
            print("-- torch's peers and our kernel untried on a GPU: correctness, then timings "
                  "(same columns)", flush=True)
            if not opts.skip_correctness:
                correctness(report, sizes, rng, impls, late & ok_impls)
            timed(report, "timings", [v for v in variants if v.impl in late], sizes, rng,
                  ceiling, opts)
            if held:
                report.obj.setdefault("sweep", [])
                timed(report, "sweep", held, sizes, rng, ceiling, opts)
                tuning_rows_now()
        report.obj["versus_peers"] = versus_peers(report.obj["timings"])
        failed = [r for r in report.obj["correctness"] + report.obj["timings"]
                  if r["required"] and ("error" in r or not r.get("ok", True))]
    report.obj["complete"] = True
    report.obj["elapsed_s"] = round(time.perf_counter() - T0, 1)
    report.save()

    print_summary(report.obj, opts.seed, {
        "our fastest kernel against torch's, same run":
            format_versus(report.obj.get("versus_peers", [])),
        "decode routing from the grid (our two kernels; JAX's for comparison)":
            format_routing(report.obj["routing"]) if "routing" in report.obj else []})
    print(f"{len(failed)} failed" if failed else "all ok",
          f"({time.perf_counter() - T0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
