"""Prefix sharing inside one step: requests admitted together borrow the pages one of them
computes in that step (the radix cache takes them before the step runs), so a random prefix tree
submitted at once computes each of its tokens about once. Outputs against HuggingFace greedy
with overlap on and off, chunked + mixed with eviction and forced retracts; n samples in one
step."""

from __future__ import annotations

import numpy as np
import pytest

from minijax_serve import Engine, SamplingParams
from minijax_serve.bench.tree_dataset import ideal_prefill_tokens
from tests import hf_reference
from tests.engine.test_engine import assert_idle_and_clean

NEW = 4
TINY = dict(skip_tokenizer_init=True, max_running_requests=32, max_prefill_tokens=512,
            min_token_bucket=64, min_seq_bucket=8, min_kv_bucket=128, context_length=128)


def prefix_tree(seed: int, num_prompts: int = 80, max_len: int = 120) -> list[list[int]]:
    """Root-to-node paths of a random tree whose edges are 1-40 random tokens, shuffled."""
    rng = np.random.default_rng(seed)
    paths: list[list[int]] = []
    while len(paths) < num_prompts:
        parent = int(rng.integers(-1, len(paths)))
        base = paths[parent] if parent >= 0 else []
        segment = rng.integers(0, 250, size=int(rng.integers(1, 41))).tolist()
        if len(base) + len(segment) <= max_len:
            paths.append(base + segment)
    return [paths[i] for i in rng.permutation(num_prompts)]


@pytest.fixture(scope="module")
def tree(hf_llama):
    prompts = prefix_tree(seed=3)
    return prompts, hf_reference.greedy(None, prompts, NEW, model=hf_llama)


@pytest.mark.parametrize("page_size,overlap", [(1, True), (16, False)])
def test_a_prefix_tree_at_once_computes_each_token_once(page_size, overlap, tiny_dir, tree):
    prompts, refs = tree
    engine = Engine(tiny_dir["llama"], page_size=page_size, enable_overlap=overlap,
                    max_total_tokens=16384, **TINY)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    stats = engine.stats()
    ideal = ideal_prefill_tokens(prompts)  # trie nodes + one token per prompt
    assert ideal == len({tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)}) + 80
    computed = stats["prefill_tokens_computed"]
    # each prompt recomputes at most the part of its last shared page it cannot borrow
    assert computed <= (1.02 * ideal if page_size == 1 else ideal + len(prompts) * (page_size - 1))
    assert stats["evicted_tokens"] == 0 and stats["num_retracted"] == 0
    assert_idle_and_clean(engine)


def test_chunked_mixed_under_eviction_and_retracts_match_hf(tiny_dir, tree):
    prompts, refs = tree
    engine = Engine(tiny_dir["llama"], page_size=4, chunked_prefill_size=64,
                    enable_mixed_chunk=True, max_total_tokens=768, force_retract_every=3,
                    **TINY)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    stats = engine.stats()
    assert stats["evicted_tokens"] > 0 and stats["num_retracted"] > 0
    assert stats["chunked_steps"] > 0 and stats["mixed_steps"] > 0
    assert_idle_and_clean(engine)


def test_n_samples_are_admitted_together_and_compute_the_prompt_once(tiny_dir, tiny_prompts):
    engine = Engine(tiny_dir["llama"], page_size=1, max_total_tokens=4096, **TINY)
    prompt = tiny_prompts[12]  # 31 tokens
    outs = engine.generate(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True, n=5))
    ref = hf_reference.greedy(tiny_dir["llama"], [prompt], NEW)[0]
    assert [o.token_ids for o in outs] == [ref] * 5
    stats = engine.stats()
    assert stats["prefill_steps"] == 1  # no sample waits for another
    assert stats["prefill_tokens_computed"] == len(prompt) + 4  # the others: their last token
    assert_idle_and_clean(engine)
