"""What a GPU session runs for issue 26, checked on the CPU: every kernel variant of the sweeps
lowers for CUDA, the routing read from the decode grid, and the whole-step roofline script."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))  # the scripts import each other by name

import bench_kernels  # noqa: E402
import kernel_sweeps  # noqa: E402
import step_roofline  # noqa: E402
from minijax_serve.executor.buckets import StepShape  # noqa: E402
from minijax_serve.memory.page_allocator import SCRATCH_PAGE  # noqa: E402


def test_every_sweep_and_grid_variant_lowers_to_one_triton_kernel(tmp_path):
    out = tmp_path / "lowered.json"
    assert bench_kernels.main(["--tiny", "--lower-only", "--sweep", "--grid",
                               "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["lowered"]
    sizes = bench_kernels.tiny_sizes()
    sweeps = kernel_sweeps.sweep_variants(sizes, interpret=False)
    grid = len(sizes.grid_batches) * len(sizes.grid_contexts) * 3
    assert {r["impl"] for r in rows} >= {v.impl for v in sweeps}
    assert sum(r["case"].startswith("grid_") for r in rows) == grid
    assert not any("error" in r for r in rows)
    assert all(r["triton_calls"] == 1 for r in rows if r["impl"] != "xla")
    # the ragged sweep covers the tiles a Hopper kernel needs (128 x 128, 8 warps, 3 stages)
    assert "pallas_ragged[q=128,kv=128,warps=8,stages=3]" in {v.impl for v in sweeps}


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
    assert kernel_sweeps.routing(rows[:6], 8)["ragged_wins_from_programs"] is None
    assert any("from 1024 programs" in line for line in kernel_sweeps.format_routing(route))


def test_step_roofline_batch_gives_every_sequence_its_own_pages():
    shape = StepShape(num_tokens=40, num_seqs=4, num_pages=8)
    q, kv = [1, 20, 7], [33, 20, 50]
    fb = step_roofline.synthetic_batch(shape, q, kv, 8, 100, np.random.default_rng(0))
    assert fb.cu_q_lens.tolist() == [0, 1, 21, 28, 28]
    assert fb.kv_lens.tolist() == [33, 20, 50, 0]
    pages = [set(fb.page_table[i, :-(-k // 8)].tolist()) for i, k in enumerate(kv)]
    assert all(SCRATCH_PAGE not in p for p in pages)
    assert sum(map(len, pages)) == len(set().union(*pages)) == 5 + 3 + 7
    for i, (n, k) in enumerate(zip(q, kv)):
        rows = slice(fb.cu_q_lens[i], fb.cu_q_lens[i + 1])
        assert fb.positions[rows].tolist() == list(range(k - n, k))
        slots = fb.slot_mapping[rows]
        assert {int(s) // 8 for s in slots} <= pages[i]
        assert (slots % 8 == fb.positions[rows] % 8).all()
    assert (fb.slot_mapping[28:] == 0).all() and (fb.buf_index == -1).all()


def test_step_roofline_times_decode_and_prefill_steps(tiny_dir, tmp_path):
    out = tmp_path / "steps.jsonl"
    step_roofline.main(["--model", str(tiny_dir["llama"]), "--dtype", "float32",
                        "--num-seqs", "2", "4", "--context", "40", "--prefill-tokens", "48",
                        "--prompt-len", "32", "--inner", "1", "--repeats", "2",
                        "--matmul-size", "128", "--copy-mib", "4", "--output-json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["num_seqs"], r["new_tokens"], r["kv_tokens"]) for r in rows] == [
        ("decode", 2, 2, 80), ("decode", 4, 4, 160), ("prefill", 2, 48, 48)]
    assert all(r["step_s"] > 0 and 0 < r["bandwidth_share"] and 0 < r["mfu"] for r in rows)
    assert rows[1]["bytes"] > rows[0]["bytes"]  # the KV read grows with the batch
