"""Logit bias (OpenAI's ``logit_bias``): greedy tokens identical to HuggingFace's
``generate(sequence_bias=...)``, alone and before a repetition penalty; biased, penalised and
plain requests sharing batches, chunks, retracts and reused slots; bad biases refused before
anything is queued."""

from __future__ import annotations

from collections import Counter

import pytest

from minijax_serve import Engine, SamplingParams
from tests import hf_reference
from tests.scheduler.test_chunked_prefill import TINY, prompts_and_refs  # noqa: F401
from tests.engine.test_engine import assert_idle_and_clean

NEW = 12


def hf_biased_greedy(model, prompts: list[list[int]], n: int, bias: dict[int, float],
                     repetition: float = 1.0) -> list[list[int] | None]:
    """HF greedy with ``sequence_bias`` (one-token sequences) and its repetition penalty; None
    where a step's processed top two are close."""
    import torch

    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, repetition_penalty=repetition,
                                 sequence_bias=[[[t], b] for t, b in bias.items()],
                                 output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=0, eos_token_id=None)
        gaps = [float(g[0] - g[1]) for g in (torch.topk(s[0], 2).values for s in res.scores)]
        outs.append(res.sequences[0, len(p):].tolist() if min(gaps) > hf_reference.MIN_TOP2_GAP
                    else None)
    return outs


def bias_against(refs: list[list[int]]) -> dict[int, float]:
    """Biases that change greedy outputs: ban the first token of two references and a later
    token of a third, push up two tokens and the three the references repeat most (the tiny
    models' logits spread ~15: a bias of 20 before a repetition penalty of 1.3 ends ~4.6 away
    from one after it: swapping the two fails the 1.3 case)."""
    bias = {refs[0][0]: -100.0, refs[1][0]: -100.0, refs[2][3]: -50.0, 17: 4.0, 42: 2.5}
    common = Counter(t for r in refs for t in r[:NEW] if t not in bias).most_common(3)
    return bias | {t: 20.0 for t, _ in common}


@pytest.mark.parametrize("repetition", [1.0, 1.3])
def test_logit_bias_matches_hf_sequence_bias(repetition, tiny_dir, hf_llama, tiny_prompts,
                                             tiny_greedy_refs):
    plain = tiny_greedy_refs["llama"][:8]
    bias = bias_against(plain)
    refs = hf_biased_greedy(hf_llama, tiny_prompts[:8], NEW, bias, repetition)
    kept = [(p, r) for p, r in zip(tiny_prompts, refs) if r is not None]
    assert len(kept) >= 6
    engine = Engine(tiny_dir["llama"], page_size=16, **TINY)
    outs = engine.generate([p for p, _ in kept], SamplingParams(
        max_new_tokens=NEW, ignore_eos=True, logit_bias=bias, repetition_penalty=repetition))
    assert [o.token_ids for o in outs] == [r for _, r in kept]
    changed = sum(r != p[:NEW] for r, p in zip(refs, plain) if r is not None)
    assert changed >= 3  # the bias bites
    assert_idle_and_clean(engine)


def test_biased_penalised_and_plain_requests_share_batches(tiny_dir, prompts_and_refs):
    """Each request's tokens are those of its run alone: in one batch, chunked, mixed, with
    forced retracts, and after biased requests left their slots to plain ones."""
    short, long, refs = prompts_and_refs
    prompts = short + long
    bias = bias_against(refs)
    kinds = [dict(), dict(logit_bias=bias), dict(logit_bias={5: 3.0}, repetition_penalty=1.4),
             dict(logit_bias=bias, temperature=0.9, seed=3), dict(frequency_penalty=1.0)]
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, **kinds[i % len(kinds)])
              for i in range(len(prompts))]
    alone_engine = Engine(tiny_dir["llama"], page_size=16, **TINY)
    alone = [alone_engine.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert alone[0] == refs[0] and alone[1] != refs[1]
    engine = Engine(tiny_dir["llama"], page_size=16, chunked_prefill_size=32,
                    enable_mixed_chunk=True, force_retract_every=3, **TINY)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert engine.stats()["num_retracted"] >= 3
    # the biased requests' slots now hold plain requests, in penalised steps
    reuse = [params[4]] + [params[0]] * (len(prompts) - 1)
    outs = engine.generate(prompts, reuse)
    assert [o.token_ids for o in outs[1:]] == refs[1:]
    assert_idle_and_clean(engine)
    assert_idle_and_clean(alone_engine)


@pytest.mark.parametrize("bias,message", [
    ({-1: 1.0}, "logit_bias: a token id must be an integer >= 0"),
    ({3: 100.5}, "logit_bias: a bias must be in [-100, 100]"),
    ({3: float("inf")}, "logit_bias: a bias must be a finite number"),
    ({i: 1.0 for i in range(301)}, "logit_bias: at most 300 tokens"),
    ([(3, 1.0), (3, 2.0)], "logit_bias: token id 3 appears twice"),
    ("3", "logit_bias must map token ids to biases"),
])
def test_bad_logit_bias_is_a_clear_error(bias, message):
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_refused_before_queueing(tiny_dir, tiny_prompts,
                                                                      tiny_greedy_refs):
    engine = Engine(tiny_dir["llama"], page_size=16, **TINY)
    with pytest.raises(ValueError, match=r"logit_bias: token ids must be in \[0, 301\), got 301"):
        engine.add_request(tiny_prompts[0], SamplingParams(max_new_tokens=4,
                                                           logit_bias={301: 1.0}))
    assert not engine.has_unfinished() and engine.runner.logit_bias is None
    out = engine.generate(tiny_prompts[0], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert out[0].token_ids == tiny_greedy_refs["llama"][0][:NEW]
    assert SamplingParams(logit_bias={7: 2, 3: -1}).logit_bias == ((3, -1.0), (7, 2.0))
    assert_idle_and_clean(engine)
