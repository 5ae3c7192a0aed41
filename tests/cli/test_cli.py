"""The ``minijax-serve`` command: engine flags, the random dataset's length rule, and a tiny
in-process ``bench`` and ``generate`` run on a random Llama (no tokenizer)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from minijax_serve import EngineConfig, SamplingParams
from minijax_serve.bench.datasets import (DatasetContext, length_bounds, sample_lengths,
                                          sample_random)
from minijax_serve.cli import build_parser, main
from minijax_serve.config.flags import (ENGINE_HELP, SAMPLING_HELP, add_engine_args, cli_spelling,
                                        engine_config_from_args)
from tests.hf_reference import save_tiny_model

# Tiny buckets: context 32 (prompts <= 16 + outputs <= 8), one page-table width -> 6 step shapes.
TINY = ["--skip-tokenizer-init", "--max-total-tokens", "1024", "--max-running-requests", "4",
        "--max-prefill-tokens", "64", "--min-token-bucket", "16", "--min-kv-bucket", "32",
        "--context-length", "32"]
WORKLOAD = ["--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "8",
            "--peak-matmul-size", "512"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("cli") / "llama")


@pytest.mark.parametrize("length, ratio, bounds", [
    (256, 0.125, (32, 256)),
    (128, 0.125, (16, 128)),
    (8, 0.125, (1, 8)),  # int(1.0) = 1
    (7, 0.5, (3, 7)),  # int(3.5) = 3
    (5, 0.0, (1, 5)),  # never below 1
    (1, 0.125, (1, 1)),
    (10, 1.0, (10, 10)),
])
def test_length_bounds(length, ratio, bounds):
    assert length_bounds(length, ratio) == bounds


@pytest.mark.parametrize("length, ratio", [(0, 0.5), (8, -0.1), (8, 1.5)])
def test_length_bounds_rejects(length, ratio):
    with pytest.raises(ValueError):
        length_bounds(length, ratio)


def test_sample_lengths_uniform_over_inclusive_bounds():
    draws = sample_lengths(np.random.default_rng(0), 2000, 4, 0.5)
    assert set(draws) == {2, 3, 4}  # both ends reachable, nothing outside
    assert sample_lengths(np.random.default_rng(0), 5, 10, 1.0) == [10] * 5
    assert sample_lengths(np.random.default_rng(3), 9, 64, 0.25) == \
        sample_lengths(np.random.default_rng(3), 9, 64, 0.25)


def test_random_dataset_ids_in_vocab():
    args = argparse.Namespace(num_prompts=20, random_input_len=12, random_output_len=5,
                              random_range_ratio=0.125)
    reqs = sample_random(args, DatasetContext(7, None, 64, np.random.default_rng(1)))
    assert len(reqs) == 20
    for ids, out_len in reqs:
        assert 1 <= len(ids) <= 12 and 1 <= out_len <= 5
        assert all(isinstance(t, int) and 0 <= t < 7 for t in ids)


def test_every_engine_config_field_is_a_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()
    args = parser.parse_args(["--page-size", "8", "--max-total-tokens", "512", "--context-length",
                              "none", "--mem-fraction-static", "0.5", "--dtype", "bfloat16",
                              "--skip-tokenizer-init", "--seed", "3"])
    assert engine_config_from_args(args) == EngineConfig(
        page_size=8, max_total_tokens=512, context_length=None, mem_fraction_static=0.5,
        dtype="bfloat16", skip_tokenizer_init=True, seed=3)
    for name in ("bench", "generate"):
        sub = build_parser().parse_args([name, "x"] if name == "generate" else [name])
        assert {f.name for f in dataclasses.fields(EngineConfig)} <= set(vars(sub))
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-total-tokens", "lots"])


def test_bench_tiny_llama(llama_dir, tmp_path, capsys):
    out_json = tmp_path / "bench.jsonl"
    out_json.write_text('{"earlier": "run"}\n')  # runs are appended, one object per line
    rc = main(["bench", "--model", str(llama_dir), *TINY, *WORKLOAD, "--output-json", str(out_json)])
    assert rc == 0
    lines = out_json.read_text().splitlines()
    assert len(lines) == 2
    r = json.loads(lines[1])

    args = argparse.Namespace(num_prompts=6, random_input_len=16, random_output_len=8,
                              random_range_ratio=0.125)
    drawn = sample_random(args, DatasetContext(301, None, 32, np.random.default_rng(0)))
    assert r["completed"] == r["num_requests"] == 6
    assert r["total_input_tokens"] == sum(len(ids) for ids, _ in drawn)
    assert r["total_output_tokens"] == sum(n for _, n in drawn)
    assert r["num_compiled_shapes"] == 4  # tokens 16, 32, 64; seqs 4
    # + per number of sequences (4): 6 samplers (greedy, sampled with a sort or without;
    # penalised or not) and the logprobs program; + the row writers (token counts, logit bias)
    assert r["num_compiled_programs"] == r["num_compilations_before"] == 4 + 7 + 2
    assert r["num_compilations_after"] == r["num_compilations_before"]
    assert r["recompiled_during_run"] is False
    assert r["duration_s"] > 0 and r["compile_time_s"] >= 0
    assert r["total_throughput"] == pytest.approx(
        (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration_s"])
    for key in ("ttft", "e2e", "tpot"):
        assert 0 < r[f"median_{key}_ms"] <= r[f"p99_{key}_ms"]
    assert r["mean_ttft_ms"] <= r["mean_e2e_ms"] <= r["duration_s"] * 1e3
    assert r["model_flops"] > 0 and r["peak_flops_per_s"] > 0
    assert r["mfu"] == pytest.approx(r["achieved_flops_per_s"] / r["peak_flops_per_s"])
    assert r["engine_config"] == dataclasses.asdict(EngineConfig(
        max_total_tokens=1024, max_running_requests=4, max_prefill_tokens=64, min_token_bucket=16,
        min_kv_bucket=32, context_length=32, skip_tokenizer_init=True))
    assert r["workload"]["random_range_ratio"] == 0.125 and r["workload"]["num_prompts"] == 6

    printed = capsys.readouterr().out
    assert "Warm-up: compiled 4 step shapes" in printed and "WARNING" not in printed
    for name in ("Successful requests:", "Total token throughput (tok/s):", "P99 TTFT (ms):",
                 "Median E2E (ms):", "MFU (%):"):
        assert name in printed


def test_bench_warns_when_the_timed_run_compiles(llama_dir, monkeypatch, capsys):
    from minijax_serve import Engine

    monkeypatch.setattr(Engine, "warmup", lambda self, **_: 0)  # nothing compiled before the timing
    assert main(["bench", "--model", str(llama_dir), *TINY, *WORKLOAD]) == 0
    printed = capsys.readouterr().out
    assert "WARNING" in printed and "DURING the timed run" in printed


def test_bench_hf_baseline(llama_dir, tmp_path, capsys):
    out_json = tmp_path / "bench.jsonl"
    rc = main(["bench", "--model", str(llama_dir), *TINY, *WORKLOAD, "--output-json", str(out_json),
               "--baseline", "hf", "--baseline-batch-size", "4"])
    assert rc == 0
    r = json.loads(out_json.read_text())
    b = r["baseline"]
    assert b["completed"] == b["num_requests"] == r["num_requests"] == 6
    assert b["total_output_tokens"] == r["total_output_tokens"]
    assert b["total_input_tokens"] == r["total_input_tokens"]
    assert b["batch_size"] == 4 and b["num_batches"] == 2  # 6 requests: batches of 4 and 2
    assert b["generated_tokens_incl_padding"] >= b["total_output_tokens"]
    assert b["dtype"] == "float32" and b["duration_s"] > 0
    for key in ("output_throughput_ratio", "total_throughput_ratio"):
        assert b[key] > 0
    assert b["output_throughput_ratio"] == pytest.approx(
        r["output_throughput"] / b["output_throughput"])
    printed = capsys.readouterr().out
    assert "HF transformers Baseline" in printed and "Output token throughput ratio:" in printed


def test_bench_repeats_alternate_engines_and_baseline(llama_dir, tmp_path, capsys, monkeypatch):
    from minijax_serve.bench import engine_run, hf_baseline

    order = []
    real_hf, real_engine = hf_baseline.run_hf_baseline, engine_run.run_engine
    monkeypatch.setattr(hf_baseline, "run_hf_baseline",
                        lambda *a: order.append("hf") or real_hf(*a))
    monkeypatch.setattr(engine_run, "run_engine",
                        lambda *a: order.append(a[1].page_size) or real_engine(*a))
    out_json = tmp_path / "bench.jsonl"
    rc = main(["bench", "--model", str(llama_dir), *TINY, *WORKLOAD, "--output-json", str(out_json),
               "--compare", "page_size=16,8", "--baseline", "hf", "--baseline-batch-size", "4",
               "--repeats", "2"])
    assert rc == 0
    rows = [json.loads(line) for line in out_json.read_text().splitlines()]
    assert [(r["repeat"], r["engine_config"]["page_size"]) for r in rows] == [
        (0, 16), (0, 8), (1, 16), (1, 8)]
    assert order == [16, 8, "hf", 16, 8, "hf"] and all(r["repeats"] == 2 for r in rows)
    # each run's ratio is against the baseline of its own repeat
    for r in rows:
        b = r["baseline"]
        assert b["output_throughput_ratio"] == pytest.approx(
            r["output_throughput"] / b["output_throughput"])
    assert rows[0]["baseline"]["duration_s"] == rows[1]["baseline"]["duration_s"]
    assert rows[0]["baseline"]["duration_s"] != rows[2]["baseline"]["duration_s"]
    printed = capsys.readouterr().out
    assert printed.count("HF transformers Baseline") == 2
    summary = printed[printed.index(" Repeats (2): output tok/s "):]
    ratios = [r["baseline"]["output_throughput_ratio"] for r in rows[1::2]]
    assert (f"page_size=8 / hf: {ratios[0]:.3f}, {ratios[1]:.3f} -> median "
            f"{(ratios[0] + ratios[1]) / 2:.3f}") in summary


def test_generate_token_ids(llama_dir, capsys):
    rc = main(["generate", "--model", str(llama_dir), *TINY, "--max-new-tokens", "5", "1 2 3"])
    assert rc == 0
    ids = [int(t) for t in capsys.readouterr().out.split()]
    assert len(ids) == 5 and all(0 <= t < 301 for t in ids)
    rc = main(["generate", "--model", str(llama_dir), *TINY, "--max-new-tokens", "5",
               "--logit-bias", f"{ids[0]}=-100", "--logit-bias", "7=100", "1 2 3"])
    assert rc == 0 and capsys.readouterr().out.split() == ["7"] * 5


def test_bad_config_is_a_clean_error(llama_dir, capsys):
    assert main(["bench", "--model", str(llama_dir), "--page-size", "0"]) == 2
    assert "error: --page-size must be an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], r"--temperature must be 0 \(greedy\) or in \[1.175e-38, 3.403e\+38\]"),
    (["--logprobs", "21"], r"--logprobs must be an integer in \[0, 20\], got 21"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be finite and > 0"),
    (["--presence-penalty", "3"], r"--presence-penalty must be in \[-2, 2\]"),
    (["--n", "9", "--max-running-requests", "4"], "--n must be <= --max-running-requests 4, got 9"),
    (["--prompt-logprobs", "3", "--max-logprobs", "2"], "--prompt-logprobs must be <= --max-logprobs 2"),
    (["--min-new-tokens", "9", "--max-new-tokens", "4"], "--min-new-tokens must be an integer in"),
    (["--stop", ""], "--stop must be a non-empty string"),
    (["--logit-bias", "5=500"], r"--logit-bias: a bias must be in \[-100, 100\]"),
    (["--regex", "a+", "--ebnf", "root ::= \"a\""], "regex and ebnf: give at most one grammar"),
    (["--page-size", "3", "--attention-backend", "pallas"], "needs --page-size to be a power of two"),
])
def test_generate_checks_its_flags_before_loading_the_model(flags, message, tmp_path, capsys):
    missing = tmp_path / "no-model-here"  # loading it would fail: the flags are checked first
    assert main(["generate", "--model", str(missing), *flags, "hello"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_generate_help_describes_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("--min-p", "--stop", "--stop-token-id", "--ignore-eos", "--logprobs",
                 "--prompt-logprobs", "--repetition-penalty", "--frequency-penalty",
                 "--presence-penalty", "--n", "--seed", "--chat", "--max-logprobs",
                 "--logit-bias"):
        assert f"{name} " in text, name
    assert "(default: none = 512 here (cpu))" in text  # the effective chunk size
    assert "(default: auto = float32 here (cpu))" in text
    assert "in [-2, 2] (0: off) (default: 0.0)" in text
    assert set(ENGINE_HELP) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(SAMPLING_HELP) == {f.name for f in dataclasses.fields(SamplingParams)}


def test_cli_spelling_of_library_errors():
    assert cli_spelling("x.json missing; pass skip_tokenizer_init=True to use ids") == \
        "x.json missing; pass --skip-tokenizer-init to use ids"
    assert cli_spelling("n must be <= max_running_requests=4, got 5") == \
        "--n must be <= --max-running-requests 4, got 5"
    assert cli_spelling("enable_mixed_chunk=False here") == "--no-enable-mixed-chunk here"
    assert cli_spelling("prompts[0]: the max_position_embeddings=8") == \
        "prompts[0]: the max_position_embeddings=8"  # not a flag: unchanged


def test_generate_samples_with_logprobs(llama_dir, capsys):
    rc = main(["generate", "--model", str(llama_dir), *TINY, "--max-new-tokens", "4", "--n", "2",
               "--temperature", "1.0", "--logprobs", "2", "--prompt-logprobs", "1", "1 2 3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "--- sample 0 ---" in out and "--- sample 1 ---" in out
    assert out.count("logprobs (sample") == 2 and "prompt logprobs" in out
    rows = [line.split("\t") for line in out.splitlines() if line[:1].isdigit() and "\t" in line]
    assert len(rows) == 2 * 4 + 3  # 4 tokens per sample, 3 prompt tokens (the first has none)


def test_python_dash_m_help():
    res = subprocess.run([sys.executable, "-m", "minijax_serve", "bench", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    for flag in ("--random-range-ratio", "--max-running-requests", "--skip-tokenizer-init",
                 "--request-rate", "--max-concurrency", "--no-ignore-eos", "--compare", "--plot",
                 "--disable-tqdm", "--output-details", "--peak-copy-mib"):
        assert flag in res.stdout
