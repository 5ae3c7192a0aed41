"""The scripts in benchmarks/, in their quick or tiny modes: the scheduler overhead table, the GPU
check on the CPU, the whole-step roofline script and the compile-cache child (the kernel
benchmarks: tests/benchmarks/test_kernel_scripts.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from minijax_serve.executor.buckets import StepShape
from minijax_serve.memory.page_allocator import SCRATCH_PAGE
from tests.bench.test_bench import llama_dir  # noqa: F401  (a config-only Llama)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # the scripts import each other by name

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
    # torch's peers (information rows, so checked here): right on their batches, timed beside
    # ours, and our fastest kernel set against each
    peers = {(c["case"], c["impl"]): c for c in kernels["correctness"]
             if c["impl"].startswith("torch_")}
    assert set(peers) == {("decode", "torch_flex"), ("prefill", "torch_sdpa")}
    assert all(c["ok"] for c in peers.values()), peers
    timed = {(t["case"], t["impl"]) for t in kernels["timings"] if "median_s" in t}
    assert {("decode_b8_128", "torch_flex"), ("decode_b8_128", "torch_sdpa"),
            ("prefill", "torch_sdpa")} <= timed
    assert {(v["case"], v["peer"]) for v in kernels["versus_peers"]} == {
        ("decode_b8_128", "torch_flex"), ("decode_b8_128", "torch_sdpa"), ("prefill", "torch_sdpa")}
    assert kernels["matmul_bf16_flops_per_s"] > 0 and kernels["torch_version"]
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
