"""The kernel benchmarks of benchmarks/kernels/, as a GPU session runs them: every kernel variant
of the sweeps lowers for CUDA, the routing read from the decode grid, the tiny timed sweep, the
sweep's winners written to the kernels' tuning tables."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from pallas_kernels import tuning

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "kernels"))  # the scripts import each other by name

import bench_kernels  # noqa: E402
import kernel_sweeps  # noqa: E402


def test_every_sweep_and_grid_variant_lowers_to_one_gpu_kernel(tmp_path):
    out = tmp_path / "lowered.json"
    assert bench_kernels.main(["--tiny", "--lower-only", "--sweep", "--grid",
                               "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["lowered"]
    sizes = bench_kernels.tiny_sizes()
    sweeps = kernel_sweeps.sweep_variants(sizes, interpret=False)
    grid = len(sizes.grid_batches) * len(sizes.grid_contexts) * 3
    sweep_rows = [(r["case"], r["impl"]) for r in rows if "[" in r["impl"]]  # labelled tiles
    assert sorted({impl for _, impl in sweep_rows}) == sorted({v.impl for v in sweeps})
    assert len(sweep_rows) == len({v.impl for v in sweeps})  # --tiny: each on one case
    assert sum(r["case"].startswith("grid_") for r in rows) == grid
    assert not any("error" in r for r in rows)
    assert all(r["kernel_calls"] == 1 for r in rows if r["impl"] != "xla")
    # the ragged sweep covers the tiles a Hopper kernel needs (128 x 128, 8 warps, 3 stages), and
    # the Mosaic GPU kernel (its default tiles, with and without its loading warpgroup) is lowered
    # on every batch holding prefill tokens
    impls = {v.impl for v in sweeps}
    assert {"pallas_ragged[q=128,kv=128,warps=8,stages=3]",
            "mgpu_ragged[kv=128,slots=2,wg=2]", "mgpu_ragged[kv=64,slots=2,wg=2,ws=1]"} <= impls
    mgpu = {(r["case"], r["impl"]) for r in rows if r["impl"].startswith("mgpu_ragged")}
    assert {(case, impl) for case in ("prefill", "mixed", "ragged_mixed")
            for impl in ("mgpu_ragged", "mgpu_ragged_ws")} <= mgpu


def _grid_row(batch: int, ctx: int, impl: str, ms: float) -> dict:
    return {"case": f"grid_b{batch}_{ctx}", "impl": impl, "median_s": ms / 1e3}


def test_routing_finds_where_the_ragged_kernel_wins_at_every_context():
    rows = []
    for b, ctx, decode, ragged, jax in [(8, 512, 1.0, 2.0, 3.0), (8, 2048, 1.0, 1.5, 3.0),
                                        (64, 512, 1.0, 0.9, 3.0), (64, 2048, 1.0, 1.1, 3.0),
                                        (128, 512, 1.0, 0.9, 3.0), (128, 2048, 1.0, 0.8, 3.0),
                                        (256, 512, 1.0, 0.7, 3.0), (256, 2048, 1.0, 0.6, 0.5)]:
        rows += [_grid_row(b, ctx, "pallas_decode", decode),
                 _grid_row(b, ctx, "pallas_ragged", ragged), _grid_row(b, ctx, "jax_paged", jax)]
    rows.append({"case": "grid_b8_4096", "impl": "pallas_ragged", "error": "too big"})
    route = kernel_sweeps.routing(rows, kv_heads=8)
    # batch 64 has a context where the decode kernel wins; from 128 on the ragged one always
    assert route["ragged_wins_from_programs"] == 128 * 8
    assert route["ours_beat_jax_paged_everywhere"] is False  # 256 x 2048: JAX's 0.5 ms
    assert len(route["points"]) == 8
    assert [p["faster"] for p in route["points"][:2]] == ["pallas_decode"] * 2
    never = kernel_sweeps.routing(rows[:6], 8)
    assert never["ragged_wins_from_programs"] is None
    assert any("from 1024 programs" in line for line in kernel_sweeps.format_routing(route))
    assert "decode batches stay on it" in kernel_sweeps.format_routing(never)[-1]


def test_a_tiny_timed_sweep_keeps_a_few_variants_of_each_kernel():
    sweeps = kernel_sweeps.first_case_only(
        kernel_sweeps.sweep_variants(bench_kernels.tiny_sizes(), interpret=True))
    few = kernel_sweeps.a_few_of_each(sweeps)
    kernels = lambda vs: sorted({v.impl.split("[")[0] for v in vs})  # noqa: E731
    assert kernels(few) == kernels(sweeps) == ["mgpu_ragged", "pallas_decode", "pallas_ragged"]
    assert len(few) == 9 and all(v in sweeps for v in few)


def test_the_sweeps_winners_become_tuning_rows(tmp_path):
    rows = [{"case": "decode_2048", "impl": "pallas_decode[kv=32,splits=None]", "median_s": 3e-4},
            {"case": "decode_2048", "impl": "pallas_decode[kv=128,splits=4]", "median_s": 2e-4},
            {"case": "prefill", "impl": "pallas_ragged[q=64,kv=64,warps=4,stages=2]",
             "median_s": 1e-3},
            {"case": "mixed", "impl": "pallas_ragged[q=64,kv=64,warps=4,stages=2]",
             "median_s": 1e-3},
            {"case": "prefill", "impl": "pallas_ragged[q=128,kv=64,warps=8,stages=3]",
             "median_s": 5e-4},  # fastest on prefill, but it failed on the mixed case
            {"case": "mixed", "impl": "pallas_ragged[q=128,kv=64,warps=8,stages=3]",
             "error": "out of shared memory"},
            {"case": "decode_2048", "impl": "mgpu_ragged[kv=64,slots=2,wg=1]", "median_s": 1e-5},
            {"case": "prefill", "impl": "pallas_ragged", "median_s": 1e-6}]  # not a sweep row
    for impl, t in (("mgpu_ragged[kv=64,slots=2,wg=2]", 4e-4),
                    ("mgpu_ragged[kv=64,slots=2,wg=2,ws=1]", 3e-4)):
        rows += [{"case": case, "impl": impl, "median_s": t} for case in ("prefill", "mixed")]
    winners = kernel_sweeps.tuning_rows(rows)
    assert winners == {
        "paged_decode_attention": ({"block_kv": 128, "num_splits": 4}, 2e-4),
        "ragged_paged_attention": ({"block_q": 64, "block_kv": 64, "num_warps": 4,
                                    "num_stages": 2}, 2e-3),
        # the loading warpgroup's variant won: a bool in the table, as the kernel takes it
        "ragged_paged_attention_mgpu": ({"block_kv": 64, "num_slots": 2, "warpgroups": 2,
                                         "warp_specialized": True}, 6e-4)}
    assert kernel_sweeps.label("mgpu_ragged", winners["ragged_paged_attention_mgpu"][0]) == \
        "mgpu_ragged[kv=64,slots=2,wg=2,ws=1]"
    for name in tuning.KERNELS:  # a copy of the tables to write into
        (tmp_path / f"{name}.json").write_text(tuning.table_path(name).read_text())
    shape = bench_kernels.tiny_sizes().shape
    device = type("Device", (), {"device_kind": "NVIDIA H200"})()
    kernel_sweeps.write_tuning(rows, bench_kernels.tiny_sizes(), device, False, tmp_path)
    key = dict(device_kind="NVIDIA H200", dtype="bfloat16", num_heads=shape.num_heads,
               kv_heads=shape.kv_heads, head_dim=shape.head_dim, page_size=shape.page_size)
    table = json.loads((tmp_path / "paged_decode_attention.json").read_text())["rows"]
    assert tuning.match(table, key) == {"block_kv": 128, "num_splits": 4}
    assert tuning.match(table, {**key, "device_kind": "NVIDIA H100"}) == tuning.match(
        tuning._rows("paged_decode_attention"), {**key, "device_kind": "NVIDIA H100"})
    mgpu = json.loads((tmp_path / "ragged_paged_attention_mgpu.json").read_text())["rows"]
    assert tuning.match(mgpu, key)["warp_specialized"] is True
    with pytest.raises(SystemExit, match="interpreter"):
        kernel_sweeps.write_tuning(rows, bench_kernels.tiny_sizes(), device, True, tmp_path)


def test_the_grids_decode_routing_is_data_the_engine_reads(tmp_path, monkeypatch):
    """--grid --write-tuning writes whether the Triton backend's decode-only steps take its
    ragged kernel (the geometric mean of the ragged/decode time ratios over the grid), keeping
    the other backends' choices; an engine for that device and shape reads it when it builds
    its step programs (decode programs of their own, or none)."""
    from minijax_serve import Engine

    rows = []
    for b, ctx, ragged in [(8, 512, 1.3), (8, 2048, 1.2), (64, 512, 1.1), (64, 2048, 0.95)]:
        rows += [_grid_row(b, ctx, "pallas_decode", 1.0),
                 _grid_row(b, ctx, "pallas_ragged", ragged)]
    route = kernel_sweeps.routing(rows, kv_heads=8)
    assert route["ragged_decodes"] is False  # slower over the grid, faster at one point
    (tmp_path / "decode_routing.json").write_text(tuning.table_path("decode_routing").read_text())
    sizes = bench_kernels.tiny_sizes()
    device = type("Device", (), {"device_kind": "NVIDIA H200"})()
    assert kernel_sweeps.write_routing(route, sizes, device, False, tmp_path) == {
        "pallas": False, "pallas_mgpu": False}
    with pytest.raises(SystemExit, match="interpreter"):
        kernel_sweeps.write_routing(route, sizes, device, True, tmp_path)

    # the engine: llama-3-8b's shape on a simulated H200 (the table's default: ragged decodes)
    def engine(backend: str) -> Engine:
        return Engine("llama-3-8b", simulate="h200", skip_tokenizer_init=True,
                      context_length=256, attention_backend=backend, max_running_requests=8)
    assert not engine("pallas").buckets.split_decode
    assert engine("pallas_mgpu").buckets.split_decode
    # the grid swept at llama-3-8b's attention shape (the engine's key) chose decode programs
    wide = dataclasses.replace(sizes, shape=dataclasses.replace(
        sizes.shape, num_heads=32, kv_heads=8, head_dim=128, page_size=16))
    kernel_sweeps.write_routing(route, wide, device, False, tmp_path)
    key = dict(device_kind="NVIDIA H200", dtype="bfloat16", num_heads=32, kv_heads=8,
               head_dim=128, page_size=16)
    table = json.loads((tmp_path / "decode_routing.json").read_text())["rows"]
    assert tuning.match(table, key) == {"pallas": False, "pallas_mgpu": False}
    monkeypatch.setattr(tuning, "_rows", lambda kernel: tuple(table))
    assert engine("pallas").buckets.split_decode  # decode programs of their own now


def test_only_untried_kernels_are_timed_with_ptxas_s_report(monkeypatch):
    import kernel_runs

    sweeps = kernel_sweeps.sweep_variants(bench_kernels.tiny_sizes(), interpret=False)
    ws = {v.impl for v in sweeps if "ws=1" in v.impl}
    assert ws and all(kernel_sweeps.untried(i) for i in ws | {"mgpu_ragged_ws"})
    assert not any(kernel_sweeps.untried(v.impl) for v in sweeps if v.impl not in ws)
    assert not any(map(kernel_sweeps.untried, ("mgpu_ragged", "pallas_ragged", "torch_sdpa")))
    monkeypatch.delenv("MOSAIC_GPU_DUMP_PTXAS", raising=False)
    for on in (True, False):  # set for the untried kernel's compile only, then as it was
        with kernel_runs.ptxas_report(on):
            assert kernel_runs.os.environ.get("MOSAIC_GPU_DUMP_PTXAS") == ("1" if on else None)
        assert "MOSAIC_GPU_DUMP_PTXAS" not in kernel_runs.os.environ
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "0")
    with kernel_runs.ptxas_report(True):
        assert kernel_runs.os.environ["MOSAIC_GPU_DUMP_PTXAS"] == "1"
    assert kernel_runs.os.environ["MOSAIC_GPU_DUMP_PTXAS"] == "0"


def test_the_sweeps_tuning_rows_are_written_before_the_untried_kernels_run(tmp_path, monkeypatch):
    def variant(impl):
        return bench_kernels.Variant("prefill", [(4, 8)], impl, None)

    tried, ws = variant("mgpu_ragged[kv=64,slots=2,wg=2]"), variant(
        "mgpu_ragged[kv=64,slots=2,wg=2,ws=1]")
    events = []

    def fake_timed(report, key, variants, *_):
        events.append(("timed", key, [v.impl for v in variants]))
        report.obj[key] += [{"case": v.case, "impl": v.impl, "error": "not run in this test"}
                            for v in variants]

    def fake_write(rows, *_):
        events.append(("tuning", [r["impl"] for r in rows]))
        return {}

    monkeypatch.setattr(bench_kernels, "sweep_variants", lambda *_: [tried, ws])
    monkeypatch.setattr(bench_kernels, "a_few_of_each", lambda vs: vs)
    monkeypatch.setattr(bench_kernels, "timed", fake_timed)
    monkeypatch.setattr(bench_kernels, "write_tuning", fake_write)
    assert bench_kernels.main(["--tiny", "--sweep", "--skip-correctness", "--skip-timings",
                               "--no-peers", "--write-tuning", str(tmp_path)]) == 0
    sweeps = [e for e in events if e[:2] == ("timed", "sweep")]
    assert [e[2] for e in sweeps] == [[tried.impl], [ws.impl]]  # the untried variant last
    # the measured choices are written before the untried kernel runs (then a hang of it
    # costs none of them), and again with its rows
    assert events.index(("tuning", [tried.impl])) < events.index(sweeps[1])
    assert events[-1] == ("tuning", [tried.impl, ws.impl])
