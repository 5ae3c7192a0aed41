"""Requests under a grammar do not speculate: in the verify steps of the others they decode one
token per step under their mask (a row each among the verifying sequences' rows), and every
output is the reference's (HF's logits under llguidance's matcher)."""

from __future__ import annotations

from minijax_serve import Engine
from tests.engine.test_engine import assert_idle_and_clean
from tests.frontend.test_structured_output import GRAMMARS, tiny_refs  # noqa: F401


def test_grammars_ride_along_verify_steps(tiny_server_dir, tiny_refs):
    prompts, refs = tiny_refs
    engine = Engine(tiny_server_dir, max_total_tokens=512, max_running_requests=8,
                    max_prefill_tokens=64, min_token_bucket=16, min_seq_bucket=4,
                    min_kv_bucket=64, context_length=128, speculative_method="draft")
    outs = engine.generate(prompts, GRAMMARS)
    assert [o.token_ids for o in outs] == refs
    stats = engine.stats()  # the plain request verified drafts (the target drafts for itself)
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0
    assert_idle_and_clean(engine)
