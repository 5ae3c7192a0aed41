"""``minijax-serve bench`` beyond the datasets: metric formulas on hand-made timestamps,
``--compare`` end to end, the JSON schema, ``--request-rate``, ``--plot`` (the parsing and
tables of ``--compare`` and ``--repeats``: test_bench_compare.py; the driver's arrival and
concurrency rules: test_bench_driver.py; the scripts in benchmarks/: test_benchmark_scripts.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from minijax_serve.bench import metrics, plot
from minijax_serve.bench.driver import StepRecord, TimedRun, arrival_offsets
from minijax_serve.bench.figures import figures
from minijax_serve.cli import main
from minijax_serve.models.config import load_model_config
from tests.cli.test_cli import TINY, WORKLOAD

REPO = Path(__file__).resolve().parents[2]
DUMMY = [*TINY, "--load-format", "dummy", "--peak-copy-mib", "8"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A config-only Llama of tests.hf_reference's tiny shape (random weights: load_format
    dummy), so no torch is needed and the compiled steps are those of tests/cli/test_cli.py."""
    path = tmp_path_factory.mktemp("bench") / "llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 301,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}))
    return path


def _out(prompt_len, times, arrival=0.0, rid="0"):
    """A finished request's output with tokens at ``times``."""
    return SimpleNamespace(request_id=rid, prompt_token_ids=[1] * prompt_len, cached_tokens=0,
                           token_ids=list(range(len(times))), num_tokens=len(times),
                           token_times=list(times),
                           first_token_time=times[0], finish_time=times[-1],
                           arrival_time=arrival, finished=True)


# -- metric formulas ------------------------------------------------------------------------

def test_latency_formulas_on_hand_computed_timestamps():
    a = _out(4, [1.0, 1.5, 2.5, 3.0])  # sent at 0.5 (below), engine-queued at 0.0
    b = _out(2, [2.0], arrival=1.0)  # a single output token: no TPOT, no ITL
    lat = metrics.request_latencies([a, b], arrivals=[0.5, 1.0])
    assert lat["ttft"] == pytest.approx([0.5, 1.0])
    assert lat["e2e"] == pytest.approx([2.5, 1.0])
    assert lat["tpot"] == pytest.approx([(2.5 - 0.5) / 3])  # (e2e - ttft) / (output_len - 1)
    assert lat["itl"] == pytest.approx([0.5, 1.0, 0.5])  # pooled gaps between tokens
    # without explicit arrivals, each output's own arrival_time
    assert metrics.request_latencies([a])["ttft"] == pytest.approx([1.0])


def test_host_cpu_names_model_count_and_vector_extension(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    core = "processor\t: {}\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma {}\n\n"
    cpuinfo.write_text(core.format(0, "") + core.format(1, ""))
    assert metrics.host_cpu(str(cpuinfo)) == "AMD EPYC, 2 logical CPUs, avx2"
    cpuinfo.write_text(core.format(0, "avx512f avx512bw"))
    assert metrics.host_cpu(str(cpuinfo)) == "AMD EPYC, 1 logical CPU, avx512f"
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")  # Arm: no model name
    assert metrics.host_cpu(str(cpuinfo)) == "unknown, 1 logical CPU, sve"
    assert metrics.host_cpu(str(tmp_path / "missing")) == "unknown"


def test_summarize_percentiles():
    s = metrics.summarize(list(range(1, 102)))  # 1..101
    assert s["mean"] == 51 and s["median"] == 51 and s["p99"] == pytest.approx(100.0)
    s = metrics.summarize([1.0, 2.0, 3.0, 10.0], scale=1e3)
    assert s["median"] == 2500.0 and s["mean"] == 4000.0
    assert s["p99"] == pytest.approx(1e3 * (3.0 + 0.97 * 7.0))  # linear between 3 and 10
    assert s["std"] == pytest.approx(1e3 * np.std([1, 2, 3, 10]))
    s = metrics.summarize(list(range(1, 102)), percentiles=(50, 90, 99.9))  # vLLM's key names
    assert set(s) == {"mean", "median", "std", "p50", "p90", "p99.9"}
    assert (s["p50"], s["p90"], s["p99.9"]) == pytest.approx((51.0, 91.0, 100.9))


def test_goodput_counts_requests_meeting_every_slo():
    a = _out(4, [1.0, 1.5, 2.5, 3.0])  # sent at 0.5: TTFT 500 ms, TPOT 667 ms, E2E 2500 ms
    b = _out(2, [2.0], arrival=1.0)  # one token: TTFT = E2E = 1000 ms, TPOT 0 (vLLM's rule)
    met = functools.partial(metrics.meets_slos, [a, b], [0.5, 1.0], [4, 1])
    assert met({"ttft": 1000}) == 2 and met({"ttft": 999}) == 1
    assert met({"tpot": 700}) == 2 and met({"tpot": 600}) == 1
    assert met({"ttft": 600, "e2e": 2000}) == 0 and met({"e2e": 2500}) == 2
    assert metrics.summarize([]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_figures_throughput_and_decode_bandwidth(llama_dir):
    cfg = load_model_config(llama_dir)
    outs = [_out(4, [1.0, 1.5, 2.5, 3.0], rid="a"), _out(2, [2.0, 4.0], rid="b")]
    steps = [StepRecord(0.5, 1.0, "prefill", 1, 0), StepRecord(1.0, 1.5, "decode", 1, 4),
             StepRecord(1.5, 2.0, "prefill", 1, 0), StepRecord(2.0, 2.5, "decode", 2, 5 + 2),
             StepRecord(2.5, 3.0, "decode", 1, 6)]
    timed = TimedRun(start=0.0, duration=4.0, sent=[0.5, 1.0, None], outputs=outs + [None],
                     errors=[None, None, "too long"], steps=steps)
    before = {"prompt_tokens": 10, "prefill_tokens_computed": 10, "num_compilations": 3}
    after = {"prompt_tokens": 16, "prefill_tokens_computed": 14, "cached_tokens": 2,
             "peak_kv_tokens_used": 48, "kv_pool_tokens": 96, "num_compilations": 3}
    r = figures(cfg, 4, timed, before, after, peak_flops=1e9, peak_bw=1e9)
    assert (r["completed"], r["failed"], r["num_requests"]) == (2, 1, 3)
    assert r["first_error"] == "too long"
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (6, 6)
    assert r["output_throughput"] == 6 / 4 and r["request_throughput"] == 2 / 4
    assert r["concurrency"] == pytest.approx((2.5 + 3.0) / 4)  # sum of E2E / duration
    assert r["mean_ttft_ms"] == pytest.approx(1e3 * (0.5 + 1.0) / 2)
    assert r["median_itl_ms"] == pytest.approx(1e3 * 0.75)  # gaps 0.5, 1.0, 0.5, 2.0
    assert r["max_itl_ms"] == pytest.approx(2e3)
    assert r["prefill_tokens_computed"] == 4 and r["prompt_tokens"] == 6
    assert r["prefill_saved_fraction"] == pytest.approx(1 - 4 / 6)
    assert r["peak_kv_usage"] == 0.5
    assert (r["prefill_steps"], r["decode_steps"]) == (2, 3)
    w = (cfg.num_params() - cfg.vocab_size * cfg.hidden_size) * 4  # untied: table not read
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert r["weight_bytes"] == w
    assert r["decode_bytes_read"] == 3 * w + (4 + 7 + 6) * kv
    assert r["decode_bandwidth_bytes_per_s"] == pytest.approx(r["decode_bytes_read"] / 1.5)
    assert r["decode_bandwidth_utilisation"] == pytest.approx(r["decode_bytes_read"] / 1.5 / 1e9)
    assert r["mean_decode_step_ms"] == pytest.approx(500.0)
    assert r["mfu"] == pytest.approx(r["model_flops"] / 4 / 1e9)


def test_model_flops_skip_cached_prefix(llama_dir):
    cfg = load_model_config(llama_dir)
    assert not cfg.tie_word_embeddings  # an embedding table and an LM head, both V x h
    dense = cfg.num_params() - 2 * cfg.vocab_size * cfg.hidden_size
    per_token, head = 2.0 * dense, 2.0 * cfg.vocab_size * cfg.hidden_size
    per_key = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    full = metrics.model_flops(cfg, [10], [3])  # 12 tokens through the model, positions 0..11
    # logits for 3 of them: the last prompt token and the 2 outputs fed back
    assert full == pytest.approx(per_token * 12 + head * 3 + per_key * 12 * 13 / 2)
    cached = metrics.model_flops(cfg, [10], [3], [8])  # positions 8..11 computed
    assert cached == pytest.approx(per_token * 4 + head * 3 + per_key * (9 + 10 + 11 + 12))


# -- end to end on the tiny model -----------------------------------------------------------

JSON_SCHEMA = {  # key -> type of every run's JSON object
    "completed": int, "failed": int, "num_requests": int, "duration_s": float,
    "total_input_tokens": int, "total_output_tokens": int, "request_throughput": float,
    "input_throughput": float, "output_throughput": float, "total_throughput": float,
    "concurrency": float, "prompt_tokens": int, "prefill_tokens_computed": int,
    "cached_tokens": int, "peak_kv_tokens_used": int, "kv_pool_tokens": int,
    "peak_kv_usage": float, "mean_token_usage": float, "mean_token_usage_queued": float, "chunked_steps": int, "num_retracted": int,
    "padding_fraction": float,
    "mean_host_ms_per_step": float, "mean_blocked_ms_per_step": float,
    "device_idle_fraction": float, "num_compiled_shapes": int, "num_compiled_programs": int,
    "compile_time_s": float, "num_compilations_before": int, "num_compilations_after": int,
    "recompiled_during_run": bool, "model_flops": float, "mfu": float,
    "peak_flops_per_s": float, "decode_bandwidth_bytes_per_s": float,
    "peak_copy_bytes_per_s": float, "decode_bandwidth_utilisation": float,
    "mean_decode_step_ms": float, "mode": str, "ignore_eos": bool, "dtype": str,
    "backend": str, "device": str, "host_cpu": str, "engine_config": dict, "workload": dict,
    "engine_stats": dict, "timestamp": float, "repeat": int, "repeats": int,
    **{f"{s}_{k}_ms": float for s in ("mean", "median", "std", "p99")
       for k in ("ttft", "tpot", "itl", "e2e")},
}


def _strict_json_lines(path):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_compare_two_values_with_plot(llama_dir, tmp_path, capsys, monkeypatch):
    out_json, png = tmp_path / "runs.jsonl", tmp_path / "bench.png"
    drawn, figure = [], plot.figure

    def spy(traces, *args):  # keeps what plot_runs drew
        drawn.append((traces, figure(traces, *args)))
        return drawn[-1][1]

    monkeypatch.setattr(plot, "figure", spy)
    rc = main(["bench", "--model", str(llama_dir), *DUMMY, *WORKLOAD,
               "--compare", "max_running_requests=4,2", "--output-json", str(out_json),
               "--plot", str(png)])
    assert rc == 0
    runs = _strict_json_lines(out_json)
    assert len(runs) == 2
    for i, r in enumerate(runs):
        for key, typ in JSON_SCHEMA.items():
            assert isinstance(r[key], typ) or (typ is float and isinstance(r[key], int)), key
        assert r["compare"] == {"field": "max_running_requests", "value": [4, 2][i], "index": i,
                                "values": [4, 2]}
        assert r["engine_config"]["max_running_requests"] == [4, 2][i]
        assert r["completed"] == 6 and r["failed"] == 0 and r["mode"] == "offline"
        assert r["request_rate"] == "inf" and r["baseline"] is None
        assert r["repeat"] == 0 and r["repeats"] == 1
        assert r["prefill_tokens_computed"] == r["prompt_tokens"] == r["total_input_tokens"]
        assert 0 < r["peak_kv_tokens_used"] <= r["kv_pool_tokens"]
        assert r["decode_steps"] > 0 and r["decode_bandwidth_utilisation"] > 0
        assert r["recompiled_during_run"] is False
    assert runs[0]["total_output_tokens"] == runs[1]["total_output_tokens"]  # same workload
    printed = capsys.readouterr().out
    assert "Compare: max_running_requests" in printed
    assert "max_running_requests=2" in printed and "x)" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    (traces, fig), = drawn  # a row of batch composition and KV usage per run, from its steps
    assert len(fig.axes) == 3 + 2 * len(runs)
    axes = {ax.get_title(): {t.get_text() for t in ax.get_legend().get_texts()} for ax in fig.axes}
    for r, t in zip(runs, traces):
        steps = t["steps"]
        assert len(steps["index"]) == r["prefill_steps"] + r["decode_steps"] + r["mixed_steps"]
        assert steps["prefill_tokens"].sum() == r["prefill_tokens_computed"]
        assert 0 <= steps["start_s"].min() <= steps["start_s"].max() <= r["duration_s"]
        assert axes[f"{t['label']}: batch composition per step"] == {
            "prefill tokens", "decode tokens", "bucket (padded) tokens"}
        assert axes[f"{t['label']}: KV usage"] == {"KV tokens used", "KV pool"}


def test_request_rate_and_concurrency(llama_dir, tmp_path, capsys):
    out_json = tmp_path / "online.jsonl"
    rate = 40.0
    rc = main(["bench", "--model", str(llama_dir), *DUMMY, *WORKLOAD,
               "--request-rate", str(rate), "--max-concurrency", "3", "--output-details",
               "--output-json", str(out_json), "--no-ignore-eos", "--disable-tqdm"])
    assert rc == 0
    (r,) = _strict_json_lines(out_json)
    assert r["mode"] == "online" and r["request_rate"] == rate and r["max_concurrency"] == 3
    assert r["ignore_eos"] is False and r["completed"] == 6
    d = r["details"]
    offsets = sorted(arrival_offsets(6, rate, seed=0))
    sent = sorted(d["sent_s"])
    # sent at the scheduled arrival, or later when three requests were in flight
    assert all(s >= o - 1e-9 for s, o in zip(sent, offsets))
    assert sent[:3] == pytest.approx(offsets[:3])
    assert all(t > 0 for t in d["ttft_s"])  # first token after the (scheduled) send time
    ends = [s + e for s, e in zip(d["sent_s"], d["e2e_s"])]
    for t in d["sent_s"]:  # never more than 3 requests in flight
        assert sum(s <= t < end for s, end in zip(d["sent_s"], ends)) <= 3
    assert r["duration_s"] >= offsets[-1]
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_zipped_compare_end_to_end(llama_dir, tmp_path):
    out_json = tmp_path / "runs.jsonl"
    assert main(["bench", "--model", str(llama_dir), *DUMMY, *WORKLOAD,
                 "--compare", "init_new_token_ratio=0.7,1.0",
                 "--compare", "min_new_token_ratio_factor=0.14,1.0",
                 "--output-json", str(out_json)]) == 0
    runs = _strict_json_lines(out_json)
    field = "init_new_token_ratio,min_new_token_ratio_factor"
    assert [r["compare"]["field"] for r in runs] == [field, field]
    assert [r["compare"]["value"] for r in runs] == ["0.7,0.14", "1.0,1.0"]
    assert [(r["engine_config"]["init_new_token_ratio"], r["engine_config"]["min_new_token_ratio_factor"])
            for r in runs] == [(0.7, 0.14), (1.0, 1.0)]
    assert all(0 < r["mean_token_usage"] <= r["peak_kv_usage"] <= 1 for r in runs)
