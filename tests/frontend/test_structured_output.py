"""Structured output (``json_schema``, ``regex``, ``ebnf``): greedy tokens identical to a reference
built from HuggingFace's logits and llguidance's own matcher (mask, argmax, consume), on the
real SmolLM2 (JSON that parses and fits its schema, a regex, a choice, beside a plain request,
with overlap) and on the tiny Llama in every scheduler mode (overlap on and off, chunked and
mixed prefill, forced retracts, n samples, seeded sampling), constrained and plain requests
sharing batches and each getting its tokens of a run alone; bad grammars are errors before
anything is queued."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from minijax_serve import Engine, SamplingParams
from minijax_serve.frontend import grammar
from tests import hf_reference
from tests.engine.test_engine import assert_idle_and_clean

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
FORMATS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}


def reference(hf_model, tokenizer, vocab: int, eos: list[int], prompt: list[int],
              params: SamplingParams) -> list[int]:
    """Greedy decoding of HF's model under llguidance's mask of ``params``' grammar: stops at an
    EOS or once the grammar is complete, or after max_new_tokens."""
    field, text = params.grammar
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab,
                                         eos_token=eos[0] if len(eos) == 1 else eos)
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from(FORMATS[field], text))
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    out, cache, x = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            res = hf_model(input_ids=x, cache=cache, use_cache=True)
            cache = res.cache
            logits = res.logits[0, -1].float().numpy()[None].copy()
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            llguidance.numpy.apply_token_bitmask_inplace(logits, mask)
            token = int(np.argmax(logits[0]))
            out.append(token)
            assert matcher.consume_token(token), matcher.get_error()
            if token in eos or matcher.is_stopped():
                break
            x = torch.tensor([[token]])
    return out


def test_smollm2_json_regex_and_choice_match_the_reference(smollm2_engine, smollm2_dir,
                                                           hf_smollm2):
    engine = smollm2_engine
    chat = lambda q: engine.chat_prompt([{"role": "user", "content": q}])  # noqa: E731
    prompts = [chat("Describe a person named Alice, aged 30, as JSON."),
               chat("How many legs has a spider? Answer with the number only."),
               chat("Name a primary colour."),
               chat("What is the capital of France?")]
    params = [SamplingParams(max_new_tokens=40, json_schema=PERSON),
              SamplingParams(max_new_tokens=8, regex=r"[0-9]{1,2}"),
              SamplingParams(max_new_tokens=8, ebnf='root ::= "red" | "yellow" | "blue"'),
              SamplingParams(max_new_tokens=12)]
    outs = engine.generate(prompts, params)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    eos = sorted(engine.model_config.eos_token_ids)
    vocab = engine.model_config.vocab_size
    for prompt, p, out in zip(prompts[:3], params, outs):
        assert out.token_ids == reference(hf_smollm2, tokenizer, vocab, eos, prompt, p), p.grammar
        assert out.finish_reason == "stop", (out.text, p.grammar)
    person = json.loads(outs[0].text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), person
    assert re.fullmatch(r"[0-9]{1,2}", outs[1].text), outs[1].text
    assert outs[2].text in ("red", "yellow", "blue")
    plain = hf_reference.greedy(smollm2_dir, [prompts[3]], 12, model=hf_smollm2)[0]
    assert outs[3].token_ids == plain[:len(outs[3].token_ids)]
    assert_idle_and_clean(engine)


# SamplingParams fields (JSON, so test_tensor_parallel's worker takes them too)
GRAMMAR_FIELDS = [dict(max_new_tokens=16, regex=r"[a-z]{2,6}-[0-9]{1,3}"),
                  dict(max_new_tokens=20, json_schema={
                      "type": "object", "properties": {"k": {"type": "integer"}},
                      "required": ["k"]}),
                  dict(max_new_tokens=12, ebnf='root ::= "yes" | "no" | "maybe"'),
                  dict(max_new_tokens=16, ignore_eos=True)]  # plain, beside them
GRAMMARS = [SamplingParams(**fields) for fields in GRAMMAR_FIELDS]
MODES = [dict(enable_overlap=True), dict(enable_overlap=False),
         dict(enable_overlap=True, page_size=4, chunked_prefill_size=8, enable_mixed_chunk=True,
              force_retract_every=3),
         dict(enable_overlap=False, page_size=4, chunked_prefill_size=8, enable_mixed_chunk=True,
              force_retract_every=3)]


@pytest.fixture(scope="module")
def tiny_refs(tiny_server_dir, hf_llama, tiny_prompts):
    """The tiny Llama (byte-fallback tokenizer): each grammar's reference on prompts 8..11."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_server_dir)
    prompts = tiny_prompts[8:12]
    refs = [reference(hf_llama, tokenizer, 301, [2], prompt, p)
            for prompt, p in zip(prompts, GRAMMARS[:3])]
    refs.append(hf_reference.greedy(tiny_server_dir, prompts[3:], 16, model=hf_llama)[0])
    return prompts, refs


@pytest.mark.parametrize("mode", MODES, ids=["overlap", "sync", "chunked-overlap", "chunked-sync"])
def test_every_mode_gives_the_reference_tokens(mode, tiny_server_dir, tiny_refs):
    prompts, refs = tiny_refs
    engine = Engine(tiny_server_dir, max_total_tokens=512, max_running_requests=8,
                    max_prefill_tokens=64, min_token_bucket=16, min_seq_bucket=4,
                    min_kv_bucket=64, context_length=128, **mode)
    # every request twice, the second arriving while the first decodes
    ids = [engine.add_request(p, params) for p, params in zip(prompts, GRAMMARS)]
    outputs = {}
    for _ in range(3):
        outputs.update((o.request_id, o) for o in engine.step())
    ids += [engine.add_request(p, params) for p, params in zip(prompts, GRAMMARS)]
    for _ in range(500):
        if not engine.has_unfinished():
            break
        outputs.update((o.request_id, o) for o in engine.step())
    assert [outputs[i].token_ids for i in ids] == refs + refs
    if mode.get("force_retract_every"):
        assert engine.stats()["num_retracted"] > 0
    assert_idle_and_clean(engine)


def test_grammars_compile_once_and_overlap_the_model(tiny_server_dir, tiny_refs, monkeypatch):
    compiled = []

    def counting_matcher(*args, **kwargs):
        compiled.append(args[1])
        return real(*args, **kwargs)

    real = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", counting_matcher)
    engine = Engine(tiny_server_dir, max_total_tokens=512, max_running_requests=8,
                    min_token_bucket=16, min_seq_bucket=4, min_kv_bucket=64, context_length=128,
                    enable_overlap=True)
    overlapped = []  # per constrained step: the step before was taken after its model went out
    run = engine.runner.run

    def watched(fb, shape, targets=None, token_mask=None):
        if token_mask is None:
            return run(fb, shape, targets)
        waiting = engine._in_flight is not None and engine._in_flight[0].constrained

        def mask():
            out = token_mask()
            overlapped.append(waiting and engine._in_flight is None)
            return out
        return run(fb, shape, targets, mask)

    engine.runner.run = watched
    prompts, refs = tiny_refs
    engine.check_grammar(GRAMMARS[0])  # as the server does before it queues the request
    assert len(compiled) == 1
    outs = engine.generate([prompts[0], prompts[0], prompts[2]], [GRAMMARS[0], GRAMMARS[0],
                                                                  GRAMMARS[2]])
    assert [o.token_ids for o in outs] == [refs[0], refs[0], refs[2]]
    assert len(compiled) == 2  # the regex once for its check and both requests; the ebnf once
    assert len(overlapped) >= len(refs[0]) - 1 and sum(overlapped) >= len(refs[0]) - 2, overlapped
    monkeypatch.setattr(grammar, "CACHED_GRAMMARS", 1)
    engine.check_grammar(GRAMMARS[0])  # still kept
    engine.check_grammar(GRAMMARS[1])  # compiled; the two others dropped
    engine.check_grammar(GRAMMARS[0])
    assert len(compiled) == 4
    assert_idle_and_clean(engine)


def test_a_tokenizer_past_the_vocabulary_is_an_error(tiny_server_dir):
    compiler = grammar.GrammarCompiler(AutoTokenizer.from_pretrained(tiny_server_dir), 10, [2])
    for _ in range(2):  # the failed conversion is kept
        with pytest.raises(ValueError, match="regex: llguidance cannot take this tokenizer with "
                                             "the model's vocabulary of 10"):
            compiler.matcher(GRAMMARS[0])


def test_samples_and_seeds_follow_their_grammar(tiny_server_dir, tiny_prompts):
    engine = Engine(tiny_server_dir, max_total_tokens=512, max_running_requests=8,
                    min_token_bucket=16, min_seq_bucket=4, min_kv_bucket=64, context_length=128)
    params = SamplingParams(max_new_tokens=16, regex=r"[a-z]{2,6}-[0-9]{1,3}", n=3,
                            temperature=1.0, seed=11)
    together = engine.generate([tiny_prompts[9], tiny_prompts[3]],
                               [params, SamplingParams(max_new_tokens=8, ignore_eos=True)])
    alone = engine.generate(tiny_prompts[9], params)
    texts = [o.text for o in together[:3]]
    assert texts == [o.text for o in alone]
    assert all(re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}", t.removesuffix("\x01")) for t in texts), texts
    assert len(set(texts)) > 1  # three samples, not one
    assert_idle_and_clean(engine)


def test_bad_grammars_are_errors_before_anything_is_queued(tiny_server_dir, tiny_dir):
    engine = Engine(tiny_server_dir, max_total_tokens=256, max_running_requests=4,
                    min_token_bucket=16, min_seq_bucket=4, min_kv_bucket=64, context_length=128)
    with pytest.raises(ValueError, match="regex"):
        engine.generate([[5, 6], [7, 8]], [SamplingParams(max_new_tokens=8),
                                           SamplingParams(max_new_tokens=8, regex="[a-")])
    with pytest.raises(ValueError, match="json_schema"):
        engine.add_request([5], SamplingParams(max_new_tokens=8,
                                               json_schema={"type": "frobnicate"}))
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="json_schema and regex: give at most one grammar"):
        SamplingParams(json_schema={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="min_new_tokens cannot be combined with regex"):
        SamplingParams(regex="a+", min_new_tokens=2)
    with pytest.raises(ValueError, match="ebnf must be a non-empty string"):
        SamplingParams(ebnf="")
    with pytest.raises(ValueError, match="regex: structured output needs a tokenizer"):
        Engine(tiny_dir["llama"], skip_tokenizer_init=True, max_total_tokens=256).add_request(
            [5], SamplingParams(max_new_tokens=8, regex="a+"))
    with pytest.raises(ValueError, match="simulated engine samples dummy tokens"):
        Engine("llama-3-8b", simulate="h100", skip_tokenizer_init=True).add_request(
            [5], SamplingParams(max_new_tokens=8, regex="a+"))
    assert_idle_and_clean(engine)
