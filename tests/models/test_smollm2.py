"""The real default model, SmolLM2-135M-Instruct: token-identical to HF transformers on the
same converted weights, with its own tokenizer, chat template and stop handling."""

from __future__ import annotations

import pytest

from minijax_serve import Engine, SamplingParams
from tests import hf_reference
from tests.conftest import SMOLLM2_SMALL as SMALL
from tests.engine.test_engine import assert_idle_and_clean

CHAT = ["What is the capital of France?", "Name three primary colors.",
        "Write a haiku about the sea.", "How many legs does a spider have?"]
TEXTS = ["The quick brown fox", "Once upon a time, in a small village by the river,",
         "def fibonacci(n):", "The three laws of thermodynamics are",
         "In 1969, the first humans", "Water boils at", "My favourite recipe for pancakes",
         "The largest planet in the solar system is",
         "Here is a list of the ten most populous countries in the world, in order:",
         "To be or not to be", "JAX is a Python library for", "The mitochondria is"]


@pytest.fixture(scope="module")
def engine16(smollm2_engine):
    return smollm2_engine


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    return hf_smollm2


@pytest.fixture(scope="module")
def chat_prompts(engine16):
    tok = engine16.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                    tokenize=False) for c in CHAT]


def test_chat_prompts_match_hf_and_know_paris(engine16, hf_model, chat_prompts):
    tok = engine16.tokenizer
    ids = [tok.encode(p) for p in chat_prompts]
    refs = hf_reference.greedy(None, ids, 32, model=hf_model)
    outs = engine16.generate(chat_prompts, SamplingParams(max_new_tokens=32, ignore_eos=True,
                                                          skip_special_tokens=False))
    assert [o.token_ids for o in outs] == refs
    assert [o.prompt_token_ids for o in outs] == ids
    for o in outs:
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=False)
    # honouring EOS, the answer stops at <|im_end|> and names Paris
    answer = engine16.generate(chat_prompts[0], SamplingParams(max_new_tokens=32))[0]
    assert answer.finish_reason == "stop" and answer.token_ids[-1] in engine16.model_config.eos_token_ids
    assert "Paris" in answer.text and "<|im_end|>" not in answer.text
    engine16.check_invariants()


@pytest.mark.parametrize("page_size", [1, 16])
def test_sixteen_prompts_continuous_batching_match_hf(page_size, engine16, hf_model, chat_prompts):
    """Page size 1 with unified steps (the accelerators' default: admissions ride along with
    the decoders), 16 with prefill and decode steps apart (the CPU's)."""
    engine = engine16 if page_size == 16 else Engine(
        "smollm2-135m", page_size=page_size, enable_mixed_chunk=True,
        chunked_prefill_size=32, **SMALL)
    prompts = chat_prompts + TEXTS
    ids = [engine.tokenizer.encode(p) for p in prompts]
    refs = hf_reference.greedy(None, ids, 16, model=hf_model)
    outs = engine.generate(ids, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    stats = engine.stats()
    assert stats["prefill_steps"] + stats["mixed_steps"] > 1
    assert (stats["mixed_steps"] > 0) == (page_size == 1)
    assert_idle_and_clean(engine)  # every page free or in the prefix cache, unlocked


def test_stop_strings_and_incremental_text(engine16):
    tok = engine16.tokenizer
    full = engine16.generate(TEXTS[1], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = engine16.generate(TEXTS[1], SamplingParams(max_new_tokens=24, ignore_eos=True,
                                                     stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]
    assert stop not in cut.text
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    engine16.check_invariants()
