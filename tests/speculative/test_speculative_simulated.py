"""Speculative decoding on the simulated accelerator (its proposals accepted with a given
probability), in the bench's report and JSON, and in the server's /metrics."""

from __future__ import annotations

import json

import numpy as np

from minijax_serve import Engine, SamplingParams
from minijax_serve.cli import main
from minijax_serve.server.engine_loop import LoadSnapshot
from minijax_serve.server.metrics import ServerMetrics
from tests.cli.test_cli import TINY as CLI_TINY, WORKLOAD
from tests.engine.test_engine import assert_idle_and_clean


def test_simulated_acceptance():
    """Each proposed token is accepted with the configured probability a until the first miss:
    a verify of k drafts takes about 1 + a + ... + a^k tokens (its accepted drafts and the next
    token); with a = 0 nothing is accepted."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, size=12).tolist() for _ in range(16)]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    for acceptance in (0.0, 0.6):
        engine = Engine("qwen3-0.6b", simulate="h200", skip_tokenizer_init=True,
                        max_running_requests=8, speculative_method="ngram",
                        num_speculative_tokens=4, speculative_simulated_acceptance=acceptance)
        outs = engine.generate(prompts, params)
        assert all(len(o.token_ids) == 64 for o in outs)
        stats = engine.stats()
        expected = sum(acceptance ** j for j in range(5))
        assert abs(stats["spec_accept_length"] - expected) < 0.2, stats
        assert (stats["spec_accepted_tokens"] > 0) == (acceptance > 0)
        assert_idle_and_clean(engine)


def test_bench_reports_speculation(tmp_path, capsys):
    out = tmp_path / "sim.jsonl"
    assert main(["bench", "--model", "qwen3-0.6b", *CLI_TINY, *WORKLOAD, "--simulate", "h200",
                 "--speculative-method", "ngram", "--speculative-simulated-acceptance", "0.5",
                 "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Speculative decoding:" in printed and "ngram, 4 tokens" in printed
    r = json.loads(out.read_text())
    assert r["spec_proposed_tokens"] > r["spec_accepted_tokens"] > 0
    assert r["spec_accept_length"] > 1 and r["tokens_per_step"] > 1
    assert 0 < r["spec_acceptance_rate"] < 1


def test_metrics_count_drafts():
    snapshot = LoadSnapshot(spec_proposed_tokens=40, spec_accepted_tokens=25, spec_verified_seqs=10)
    text = ServerMetrics(lambda: snapshot).text().decode()
    for name, value in (("spec_proposed_tokens", 40), ("spec_accepted_tokens", 25),
                        ("spec_verifies", 10)):
        assert f"minijax_{name}_total {value:.1f}" in text


def test_a_verify_step_costs_more_than_a_decode_step_and_less_than_its_tokens():
    """8 sequences at 1024 keys: a verify of 5 tokens each (logits of all 40) on qwen3-0.6b
    bf16 costs more than the decode of one token each, less than 5 of them (the weights are
    read once)."""
    import jax.numpy as jnp

    from minijax_serve.models.config import load_model_config
    from minijax_serve.models.registry import resolve_model
    from minijax_serve.simulate.cost_model import CostModel
    from minijax_serve.simulate.profiles import H200

    cost = CostModel(H200, load_model_config(resolve_model("qwen3-0.6b").path), jnp.bfloat16)
    kv = np.full(8, 1024)
    decode = cost.step(8, np.ones(8), kv, 8, greedy=True).total_s
    verify = cost.step(40, np.full(8, 5), kv + 4, 40, greedy=True)
    assert decode < verify.total_s < 5 * decode
    assert verify.head_s > cost.step(40, np.full(8, 5), kv + 4, 8, greedy=True).head_s
