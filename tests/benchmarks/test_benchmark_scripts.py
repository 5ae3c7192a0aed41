"""The scripts in benchmarks/, in their quick or tiny modes: the scheduler overhead table, the
long-prompt ITL run, the GPU check on the CPU, the step trace, step times and variants; and what
a GPU session runs for issue 26: every kernel variant of the sweeps lowers for CUDA, the routing
read from the decode grid, the whole-step roofline script."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minijax_serve.executor.buckets import StepShape
from minijax_serve.memory.page_allocator import SCRATCH_PAGE
from tests.bench.test_bench import llama_dir  # noqa: F401  (a config-only Llama)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # the scripts import each other by name

import bench_kernels  # noqa: E402
import kernel_sweeps  # noqa: E402
import step_roofline  # noqa: E402


def test_bench_scheduler_quick(tmp_path, monkeypatch, capsys):
    for var in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "JAX_PLATFORMS"):
        monkeypatch.delenv(var, raising=False)  # main() sets its defaults; restored after
    out = tmp_path / "sched.json"
    # the detokenizer column needs the SmolLM2 tokenizer (seconds to load): tested on its own
    assert _bench_scheduler_module().main(["--quick", "--no-detok", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "µs/tick" in printed and "sched+lower" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["running"], r["waiting"]) for r in rows] == [
        (kind, running, waiting) for kind in ("decode", "prefill") for running in (16, 64)
        for waiting in (0, 100)]
    for r in rows:
        assert 0 < r["sched_lower_us"] <= r["tick_us"] and 0 < r["min_tick_us"] <= r["tick_us"]
        assert r["seqs_per_tick"] == (r["running"] if r["kind"] == "decode" else 16)


class WordTokenizer:
    """Token = a word's length; decoding joins them (enough for the incremental detokenizer)."""

    def encode(self, text):
        return [len(w) % 50 for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_bench_long_prompt_script(llama_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_long_prompt",
                                                  REPO / "benchmarks" / "bench_long_prompt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "long.json"
    assert module.main(["--model", str(llama_dir), "--load-format", "dummy", "--decoders", "3",
                        "--decoder-prompt-len", "8", "--decoder-output-len", "8",
                        "--long-prompt-len", "80", "--chunk", "32", "--context-length", "128",
                        "--max-total-tokens", "1024", "--steps-before", "2",
                        "--output-json", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["off"]["chunked_prefill_size"] is None and rows["off"]["chunked_steps"] == 0
    assert rows["chunked"]["chunked_steps"] >= 80 // 32 and rows["chunked"]["mixed_steps"] == 0
    assert rows["chunked+mixed"]["mixed_steps"] > 0
    for r in rows.values():
        assert 0 < r["itl_median_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"]


def _bench_scheduler_module():
    spec = importlib.util.spec_from_file_location("bench_scheduler",
                                                  REPO / "benchmarks" / "bench_scheduler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_scheduler_detok_column():
    assert _bench_scheduler_module().bench_detok(WordTokenizer(), 8, warm=1, ticks=3) > 0


def test_gpu_check_tiny_on_cpu(tmp_path):
    out = tmp_path / "gpu_out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, JAX_PLATFORMS="cpu",
               GPU_CHECK_SECTIONS="device kernels bench overlap layers idle pallas features "
                                  "peer_qwen peer_llama")
    res = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--tiny"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
    assert res.returncode == 0, res.stdout + res.stderr
    table = res.stdout[res.stdout.index("gpu_check summary"):]
    for row in ("device", "matmul peak", "copy bandwidth", "output / total tokens/s", "MFU",
                "decode bandwidth utilisation",
                "device: ok; kernels: ok; bench: ok; overlap: ok; layers: ok; idle: ok; pallas: ok; "
                "features: ok; peer_qwen: ok; peer_llama: ok",
                "logprobs,repetition_penalty=5,1.0", "(peer: vLLM 0.19.0", "(peer: SGLang 0.3.2"):
        assert row in table, row
    kernels = json.loads((out / "kernels.json").read_text().splitlines()[-1])
    assert kernels["complete"] and kernels["interpret"]
    checked = {(c["impl"], c["dtype"]) for c in kernels["correctness"] if c["required"]}
    assert {("pallas_ragged", "float32"), ("pallas_decode", "bfloat16")} <= checked
    assert all(c["ok"] for c in kernels["correctness"] if c["required"])
    backends = [json.loads(line) for line in (out / "pallas.jsonl").read_text().splitlines()]
    assert [r["compare"]["value"] for r in backends] == ["pallas", "pallas_mgpu"]
    assert all(r["completed"] == r["num_requests"] for r in backends)
    loops = [json.loads(line) for line in (out / "layers.jsonl").read_text().splitlines()]
    assert [r["compare"]["value"] for r in loops] == ["unroll", "scan"]
    assert all(r["completed"] == r["num_requests"] for r in loops)
    features = [json.loads(line) for line in (out / "features.jsonl").read_text().splitlines()]
    assert [r["request_fields"] for r in features] == [
        dict(logprobs=None, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
             regex=None),
        dict(logprobs=5, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
             regex=None),
        dict(logprobs=None, repetition_penalty=1.1, frequency_penalty=0.0, presence_penalty=0.0,
             regex=None)]
    assert all(r["completed"] == r["num_requests"] and not r["recompiled_during_run"]
               for r in features)
    idle = [json.loads(line) for line in (out / "idle.jsonl").read_text().splitlines()]
    assert [r["enable_overlap"] for r in idle] == [True, False]
    assert all(r["tick_ms"] > 0 and r["device_step_ms"] > 0 for r in idle)
    (run,) = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert run["completed"] == 8 and run["dtype"] == "bfloat16"
    assert run["decode_bandwidth_utilisation"] > 0 and run["mfu"] > 0
    for name, count in (("peer_qwen", 16), ("peer_llama", 8)):  # the peers' workloads, small
        (peer,) = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert peer["completed"] == count and not peer["recompiled_during_run"], name
    assert (out / "assets" / "smollm2" / "tokenizer.json").is_file()  # ShareGPT's tokenizer
    device = json.loads((out / "device.json").read_text())
    assert device["copy_bytes_per_s"] > 0 and device["matmul_peak_flops_bfloat16"] > 0
    for name in ("device.log", "bench.log", "summary.txt", "bench.png"):
        assert (out / name).is_file(), name


def test_step_trace_times_every_step_by_shape(tiny_dir, capsys):
    spec = importlib.util.spec_from_file_location("step_trace", REPO / "benchmarks" / "step_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--model", str(tiny_dir["llama"]), "--num-prompts", "4", "--context-length", "64",
                 "--input-len", "16", "--output-len", "8", "--max-running-requests", "4",
                 "--chunked-prefill-size", "64"])
    lines = capsys.readouterr().out.splitlines()
    total = next(line for line in lines if line.startswith("total"))
    num_steps = int(total.split(", ")[-1].split()[0])
    by_shape = [line for line in lines if line.startswith("tokens")]
    assert num_steps >= 2 and len(by_shape) >= 2  # a prefill shape and a decode shape at least
    assert sum(int(line.split(": ")[1].split()[0]) for line in by_shape) == num_steps


def test_step_variants_times_variants_interleaved(tiny_dir, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("step_variants",
                                                  REPO / "benchmarks" / "step_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_variant("default") == ({}, {}, "scan", True)
    assert module.parse_variant("xla:xla_cpu_foo=,q_tile=8,layer_loop=unroll,attention=off") == (
        {"xla_cpu_foo": ""}, {"q_tile": 8}, "unroll", False)
    for bad in ("q_tiles=8", "layer_loop=loop", "q_tile", "attention=on"):
        with pytest.raises(ValueError, match="variant setting"):
            module.parse_variant(bad)
    variants = ["default", "q_tile=8", "layer_loop=unroll", "attention=off"]
    results = module.main(["--model", str(tiny_dir["llama"]), "--mode", "prefill",
                           "--prefill-tokens", "64", "--num-seqs", "8", "--rounds", "2",
                           "--calls", "1", *variants])
    assert list(results) == variants
    assert all(seconds > 0 for seconds, _ in results.values())
    assert results["default"][1] == 0 and results["q_tile=8"][1] < 1e-3
    assert results["attention=off"][1] > 1e-3  # without attention the logits change
    out = capsys.readouterr().out
    assert "prefill step, 64 new tokens" in out and all(v in out for v in variants)


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
    # the Mosaic GPU kernel (its default tiles) is lowered on every batch holding prefill tokens
    impls = {v.impl for v in sweeps}
    assert {"pallas_ragged[q=128,kv=128,warps=8,stages=3]",
            "mgpu_ragged[kv=128,slots=2,wg=2]"} <= impls
    mgpu = {(r["case"], r["impl"]) for r in rows if r["impl"].startswith("mgpu_ragged")}
    assert {("prefill", "mgpu_ragged"), ("mixed", "mgpu_ragged"),
            ("ragged_mixed", "mgpu_ragged")} <= mgpu


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


def test_step_roofline_times_decode_and_prefill_steps(tiny_dir, tmp_path, capsys):
    out = tmp_path / "steps.jsonl"
    step_roofline.main(["--model", str(tiny_dir["llama"]), str(tiny_dir["qwen3"]),
                        "--dtype", "float32",
                        "--num-seqs", "2", "4", "--context", "40", "--prefill-tokens", "48",
                        "--prompt-len", "32", "--inner", "1", "--repeats", "2",
                        "--matmul-size", "128", "--copy-mib", "4", "--output-json", str(out),
                        "--profile"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(Path(r["model"]).name, r["mode"], r["num_seqs"], r["new_tokens"], r["kv_tokens"])
            for r in rows] == [(m, *step) for m in ("llama", "qwen3") for step in (
                ("decode", 2, 2, 80), ("decode", 4, 4, 160), ("prefill", 2, 48, 48))]
    assert all(r["step_s"] > 0 and 0 < r["bandwidth_share"] and 0 < r["mfu"] for r in rows)
    assert rows[1]["bytes"] > rows[0]["bytes"]  # the KV read grows with the batch
    # each step traced and its ops summed (the CPU runtime of jax 0.10 reports them)
    assert capsys.readouterr().out.count("all ops: ") == len(rows)


def test_compile_cache_child_warms_up_with_the_given_workers(tiny_dir, capsys):
    import compile_cache

    compile_cache.child(str(tiny_dir["llama"]), dict(compile_cache.TINY_ENGINE), 1, workers=1)
    compile_cache.child(str(tiny_dir["llama"]), dict(compile_cache.TINY_ENGINE), 1, workers=0)
    one, default = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert one["workers"] == 1 and default["workers"] == 1  # on CPU, one at a time
    assert one["programs"] == default["programs"] > 0
