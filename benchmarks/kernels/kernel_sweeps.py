"""The sweeps of ``bench_kernels.py``, for a GPU session choosing the kernels' defaults.

``--sweep``: the Pallas kernels' tile sizes and Triton settings. The decode kernel on the first
decode case: ``block_kv`` x ``num_splits``, then ``num_warps`` x ``num_stages`` at the default
tiles; the ragged kernel on the prefill case (issue 26's prefill target) and on the mixed case:
(``block_q``, ``block_kv``) x (``num_warps``, ``num_stages``); on the same two cases, and on the
decode case when not interpreted, the Mosaic GPU kernel's ``block_kv`` x ``num_slots`` x
``warpgroups`` (shared memory in bfloat16: 32 KiB per warpgroup + 4 x block_kv x num_slots x
head_dim bytes, within Hopper's 227 KiB); last, on the prefill and mixed cases, four of them
with a warpgroup that only loads (``warp_specialized``, label ``ws=1``).

``--grid``: the decode batches x contexts of ``Sizes.grid_*`` (full sizes: batch 8-256, context
512-8192), our decode kernel, our ragged kernel and JAX's ``paged_attention`` at each point.
:func:`routing` reads which of our two kernels wins where, and the rule it implies for the
engine's decode steps (the decode kernel below some number of programs, the ragged one above).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from kernel_cases import UNTRIED, Shape, Sizes, Variant, timed_cases
from kernel_impls import decode_kernel, mgpu_fits, mgpu_kernel, ragged_kernel

from pallas_kernels import tuning

DECODE_TILES = [dict(block_kv=kv, num_splits=sp)
                for kv in (32, 64, 128) for sp in (None, 1, 4, 16)]
DECODE_TRITON = [dict(num_warps=w, num_stages=st) for w in (2, 4, 8) for st in (1, 2, 3, 4)]
RAGGED_TILES = [(32, 32), (64, 32), (64, 64), (128, 64), (64, 128), (128, 128), (256, 64),
                (256, 128)]  # (block_q, block_kv); block_q counts query rows (tokens x group)
RAGGED_TRITON = [(4, 2), (4, 3), (8, 2), (8, 3)]  # (num_warps, num_stages)
MGPU_TILES = [dict(block_kv=kv, num_slots=n, warpgroups=wg)
              for kv, n in ((64, 2), (64, 3), (64, 4), (128, 2)) for wg in (1, 2)]
# with a warpgroup that only loads: untried on a GPU, so swept last (a hang costs nothing else)
MGPU_WS_TILES = [dict(block_kv=kv, num_slots=n, warpgroups=wg, warp_specialized=True)
                 for kv, n, wg in ((64, 2, 1), (64, 2, 2), (64, 3, 2), (128, 2, 2))]


LONG_NAMES = {"q": "block_q", "kv": "block_kv", "splits": "num_splits", "warps": "num_warps",
              "stages": "num_stages", "slots": "num_slots", "wg": "warpgroups",
              "ws": "warp_specialized"}  # a sweep label's short names; ws: a bool, as 1


def label(kind: str, tiles: dict[str, Any]) -> str:
    short = {long: name for name, long in LONG_NAMES.items()}
    items = (f"{short[k]}={int(v) if v is True else v}" for k, v in tiles.items())
    return f"{kind}[{','.join(items)}]"


def sweep_variants(sizes: Sizes, interpret: bool) -> list[Variant]:
    """Every variant of ``--sweep`` (information only: a tile that does not compile is a row
    with its error)."""
    shape: Shape = sizes.shape
    cases = timed_cases(sizes)
    decode_case = next(iter(cases))
    decode = DECODE_TILES + [t for t in DECODE_TRITON
                             if (t["num_warps"], t["num_stages"]) != (4, 2)]
    variants = [Variant(decode_case, cases[decode_case], label("pallas_decode", t),
                        decode_kernel(shape, interpret, **t)) for t in decode]
    if mgpu_fits(shape) and not interpret:  # a decode candidate too (see timing_variants)
        variants += [Variant(decode_case, cases[decode_case], label("mgpu_ragged", t),
                             mgpu_kernel(shape, interpret, **t)) for t in MGPU_TILES]
    ragged = [dict(block_q=bq, block_kv=kv, num_warps=w, num_stages=st)
              for bq, kv in RAGGED_TILES for w, st in RAGGED_TRITON]
    for case in ("prefill", "mixed"):  # the Mosaic GPU tiles first: fewer, and newer
        if mgpu_fits(shape):
            variants += [Variant(case, cases[case], label("mgpu_ragged", t),
                                 mgpu_kernel(shape, interpret, **t)) for t in MGPU_TILES]
        variants += [Variant(case, cases[case], label("pallas_ragged", t),
                             ragged_kernel(shape, interpret, **t)) for t in ragged]
    if mgpu_fits(shape):
        variants += [Variant(case, cases[case], label("mgpu_ragged", t),
                             mgpu_kernel(shape, interpret, **t))
                     for case in ("prefill", "mixed") for t in MGPU_WS_TILES]
    return variants


def first_case_only(variants: list[Variant]) -> list[Variant]:
    """Each variant (by label) on the first case it comes with."""
    seen: set[str] = set()
    return [v for v in variants if not (v.impl in seen or seen.add(v.impl))]


def a_few_of_each(variants: list[Variant], per_kernel: int = 3) -> list[Variant]:
    """The first ``per_kernel`` variants of each kernel (``pallas_ragged[...]``, ...): what a
    ``--tiny`` run times on a CPU, where each interpreted call takes up to seconds."""
    counts: dict[str, int] = {}
    kept = []
    for v in variants:
        kernel = v.impl.split("[")[0]
        counts[kernel] = counts.get(kernel, 0) + 1
        if counts[kernel] <= per_kernel:
            kept.append(v)
    return kept


def grid_variants(sizes: Sizes, interpret: bool, jax_paged: Any) -> list[Variant]:
    """``--grid``: at each decode batch x context, our two kernels and JAX's."""
    return [Variant(f"grid_b{b}_{ctx}", [(1, ctx)] * b, name, fn)
            for b in sizes.grid_batches for ctx in sizes.grid_contexts
            for name, fn in (("pallas_decode", decode_kernel(sizes.shape, interpret)),
                             ("pallas_ragged", ragged_kernel(sizes.shape, interpret)),
                             ("jax_paged", jax_paged))]


def routing(rows: list[dict[str, Any]], kv_heads: int) -> dict[str, Any]:
    """From the grid's timed rows: the faster of our kernels at each point, whether ours beat
    JAX's there, and the smallest number of programs of the decode kernel's grid without splits
    (batch x KV heads) from which the ragged kernel wins at every context (None: never)."""
    times: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        if "median_s" in r:
            b, ctx = (int(x) for x in r["case"].removeprefix("grid_b").split("_"))
            times.setdefault((b, ctx), {})[r["impl"]] = r["median_s"]
    points = []
    for (b, ctx), t in sorted(times.items()):
        ours = {k: t[k] for k in ("pallas_decode", "pallas_ragged") if k in t}
        if not ours:
            continue
        best = min(ours, key=ours.get)
        points.append({"batch": b, "context": ctx, "faster": best,
                       "ratio_ragged_over_decode": (t["pallas_ragged"] / t["pallas_decode"]
                                                    if len(ours) == 2 else None),
                       "beats_jax_paged": (ours[best] < t["jax_paged"]
                                           if "jax_paged" in t else None)})
    batches = sorted({p["batch"] for p in points})
    ragged_from = None
    for b in reversed(batches):  # the smallest batch from which ragged wins everywhere above
        if all(p["faster"] == "pallas_ragged" for p in points if p["batch"] >= b):
            ragged_from = b
        else:
            break
    ratios = [p["ratio_ragged_over_decode"] for p in points if p["ratio_ragged_over_decode"]]
    geomean = float(np.exp(np.mean(np.log(ratios)))) if ratios else None
    return {"points": points,
            "ragged_wins_from_programs": None if ragged_from is None else ragged_from * kv_heads,
            # the engine's choice for decode-only steps (one for every batch): the ragged kernel
            # where it is at least as fast over the grid (geometric mean of its time ratios)
            "ragged_over_decode_geomean": geomean, "compared_points": len(ratios),
            "ragged_decodes": None if geomean is None else geomean <= 1.0,
            "ours_beat_jax_paged_everywhere": all(p["beats_jax_paged"] for p in points)
            if points else None}


def format_routing(r: dict[str, Any]) -> list[str]:
    lines = [f"  batch {p['batch']:>4} context {p['context']:>5}: {p['faster']:<13} "
             f"ragged/decode {p['ratio_ragged_over_decode'] or float('nan'):5.2f}, "
             f"beats jax_paged: {p['beats_jax_paged']}" for p in r["points"]]
    lines.append(f"  {ragged_wins(r)}; ours beat jax_paged everywhere: "
                 f"{r['ours_beat_jax_paged_everywhere']}")
    return lines


def ragged_wins(r: dict[str, Any]) -> str:
    """Where the routing sends decode batches to the ragged kernel, in words."""
    programs = r["ragged_wins_from_programs"]
    if programs is None:
        return "the decode kernel wins at the largest batch: decode batches stay on it"
    return f"the ragged kernel wins at every context from {programs} programs (batch x KV heads)"


KERNEL_OF = {"pallas_decode": "paged_decode_attention", "pallas_ragged": "ragged_paged_attention",
             "mgpu_ragged": "ragged_paged_attention_mgpu"}  # sweep label -> tuning table


def parse_label(impl: str) -> tuple[str, dict[str, int]]:
    """(kind, the kernel keywords) of a sweep label: ``pallas_decode[kv=64,splits=None]`` ->
    ``("pallas_decode", {"block_kv": 64})`` (None: the kernel's own choice, left out)."""
    kind, _, inner = impl.partition("[")
    params = {}
    for item in filter(None, inner.rstrip("]").split(",")):
        name, _, value = item.partition("=")
        if value != "None":
            params[LONG_NAMES[name]] = bool(int(value)) if name == "ws" else int(value)
    return kind, params


def untried(impl: str) -> bool:
    """Whether ``impl`` (a name, or a sweep label) is a kernel no GPU has run yet (``UNTRIED``,
    or a sweep variant with a loading warpgroup): its rows come last and log ptxas's report."""
    return impl in UNTRIED or bool(parse_label(impl)[1].get("warp_specialized"))


def tuning_rows(rows: list[dict[str, Any]]) -> dict[str, tuple[dict[str, int], float]]:
    """The sweep's winner of each kernel: {tuning table: (its keywords, summed median seconds)},
    the variant with the least time summed over the cases it was timed on (the decode kernel on
    the decode case; the ragged kernels on the prefill and mixed cases). A variant that failed
    on one of its cases does not win."""
    totals: dict[str, dict[str, float]] = {}
    failed: set[str] = set()
    for r in rows:
        kind = r["impl"].split("[")[0]
        if kind not in KERNEL_OF or "[" not in r["impl"]:
            continue
        if kind != "pallas_decode" and r["case"] not in ("prefill", "mixed"):
            continue  # the Mosaic GPU kernel's decode-case rows: information only
        if "median_s" not in r:
            failed.add(r["impl"])
            continue
        totals.setdefault(kind, {})
        totals[kind][r["impl"]] = totals[kind].get(r["impl"], 0.0) + r["median_s"]
    winners = {}
    for kind, times in totals.items():
        ok = {impl: t for impl, t in times.items() if impl not in failed}
        if ok:
            best = min(ok, key=ok.get)
            winners[KERNEL_OF[kind]] = (parse_label(best)[1], ok[best])
    return winners


def _tuning_key(sizes: Sizes, dev: Any, interpret: bool) -> dict[str, Any]:
    if interpret:
        raise SystemExit("--write-tuning: the kernels ran in the interpreter here; its times do "
                         "not choose GPU tiles or routes")
    s = sizes.shape
    return dict(device_kind=dev.device_kind, dtype="bfloat16", num_heads=s.num_heads,
                kv_heads=s.kv_heads, head_dim=s.head_dim, page_size=s.page_size)


def write_routing(route: dict[str, Any], sizes: Sizes, dev: Any, interpret: bool,
                  directory: Path) -> dict[str, Any]:
    """Write the grid's choice for the Triton backend's decode-only steps (``routing``'s
    ``ragged_decodes``) as the ``decode_routing`` row of this device and shape; the other
    backends keep the choice the table had for them."""
    key = _tuning_key(sizes, dev, interpret)
    if route["ragged_decodes"] is None:
        return {}
    rows = json.loads(tuning.table_path("decode_routing", directory).read_text())["rows"]
    params = {**tuning.match(rows, key), "pallas": route["ragged_decodes"]}
    source = (f"bench_kernels.py --grid --write-tuning, {time.strftime('%Y-%m-%d')}, jax "
              f"{jax.__version__}: the ragged kernel's time over the decode kernel's, geometric "
              f"mean over {route['compared_points']} points of the grid, "
              f"{route['ragged_over_decode_geomean']:.3f}")
    tuning.write_row("decode_routing", key, params, source, directory)
    print(f"tuning: decode_routing {params} written for {key}", flush=True)
    return params


def write_tuning(rows: list[dict[str, Any]], sizes: Sizes, dev: Any, interpret: bool,
                 directory: Path) -> dict[str, Any]:
    """Write the sweep's winners (:func:`kernel_sweeps.tuning_rows`) to the tuning tables in
    ``directory``, keyed by this device and the swept shape (timed in bfloat16)."""
    key = _tuning_key(sizes, dev, interpret)
    written = {}
    for kernel, (params, seconds) in tuning_rows(rows).items():
        source = (f"bench_kernels.py --sweep --write-tuning, {time.strftime('%Y-%m-%d')}, jax "
                  f"{jax.__version__}: fastest variant, {seconds * 1e3:.3f} ms summed over its "
                  "cases")
        tuning.write_row(kernel, key, params, source, directory)
        written[kernel] = params
        print(f"tuning: {kernel} {params} written for {key}", flush=True)
    return written
