"""The step trace: ``record_steps=True`` changes no output and no compiled program, its records
agree with ``stats()``, and they turn into columns and JSON lines (``bench --trace``)."""

from __future__ import annotations

import json

from minijax_serve import Engine, SamplingParams
from minijax_serve.cli import main
from minijax_serve.engine.trace import StepRecord, to_columns
from tests.scheduler.test_chunked_prefill import TINY
from tests.cli.test_cli import TINY as CLI_TINY, WORKLOAD
from tests.engine.test_engine import assert_idle_and_clean

# chunked + mixed on a small pool with forced retracts: every kind of step and event
BUSY = dict(TINY, page_size=16, chunked_prefill_size=32, enable_mixed_chunk=True,
            max_total_tokens=256, force_retract_every=4)


def test_records_change_nothing_and_agree_with_stats(tiny_dir, tiny_prompts):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    runs = {}
    for record in (False, True):
        engine = Engine(tiny_dir["llama"], record_steps=record, **BUSY)
        outs = engine.generate(tiny_prompts + tiny_prompts[:4], params)
        runs[record] = ([o.token_ids for o in outs], engine.stats(), engine.step_records())
        assert_idle_and_clean(engine)
    (plain, plain_stats, none), (traced, stats, records) = runs[False], runs[True]
    assert traced == plain and none == []
    assert stats["num_compilations"] == plain_stats["num_compilations"]
    assert [r.index for r in records] == list(range(len(records)))
    for kind in ("prefill", "decode", "mixed"):
        assert sum(r.kind == kind for r in records) == stats[f"{kind}_steps"] > 0
    assert sum(r.prefill_tokens for r in records) == stats["prefill_tokens_computed"]
    assert sum(r.cached_tokens for r in records) == stats["cached_tokens"]
    assert sum(r.retracted for r in records) == stats["num_retracted"] > 0
    assert sum(r.evicted_tokens for r in records) == stats["evicted_tokens"]
    assert all(r.prefill_tokens + r.decode_tokens <= r.bucket_tokens for r in records)
    assert all(r.kv_tokens_used <= r.kv_pool_tokens == stats["kv_pool_tokens"] for r in records)
    assert sum(r.host_ms + r.blocked_ms for r in records) <= 1e3 * (
        stats["host_time_s"] + stats["blocked_time_s"]) + 1e-6
    cols = to_columns(records)
    assert set(cols) == set(StepRecord._fields) | {"padding"}
    assert all(len(v) == len(records) for v in cols.values())
    assert cols["padding"].min() >= 0 and cols["padding"].max() < 1


def test_bench_trace_writes_every_timed_step(tiny_dir, tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    out = tmp_path / "bench.jsonl"
    assert main(["bench", "--model", str(tiny_dir["llama"]), *CLI_TINY, *WORKLOAD,
                 "--trace", str(path), "--output-json", str(out)]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    result = json.loads(out.read_text())
    steps = result["prefill_steps"] + result["decode_steps"] + result["mixed_steps"]
    assert len(rows) == steps and {r["run"] for r in rows} == {"minijax"}
    assert sum(r["prefill_tokens"] for r in rows) == result["prefill_tokens_computed"]
    assert main(["bench", "--backend", "openai", "--base-url", "http://127.0.0.1:9",
                 "--trace", str(path)]) == 2
    assert "--trace records the in-process engine" in capsys.readouterr().err
