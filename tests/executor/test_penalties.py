"""Repetition, frequency and presence penalties: greedy tokens identical to HuggingFace's
``generate(repetition_penalty=...)`` and to a numpy reference over HF's logits; batch-invariant
under chunking, mixing and forced retracts; untouched device state for requests without them."""

from __future__ import annotations

import numpy as np
import pytest

from minijax_serve import Engine, SamplingParams
from tests import hf_reference
from tests.scheduler.test_chunked_prefill import TINY, prompts_and_refs  # noqa: F401
from tests.engine.test_engine import assert_idle_and_clean
from tests.models.test_smollm2 import TEXTS


def hf_repetition_greedy(model, prompts: list[list[int]], n: int, penalty: float):
    """HF greedy with its repetition penalty; None where a step's penalised top two are close."""
    import torch

    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, repetition_penalty=penalty, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        gaps = [float(g[0] - g[1]) for g in (torch.topk(s[0], 2).values for s in res.scores)]
        outs.append(res.sequences[0, len(p):].tolist() if min(gaps) > hf_reference.MIN_TOP2_GAP
                    else None)
    return outs


def numpy_penalized_greedy(model, prompt: list[int], n: int, frequency: float, presence: float,
                           repetition: float = 1.0) -> list[int] | None:
    """Greedy over HF's logits, the penalties applied step by step in numpy (float32)."""
    import torch

    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].numpy().astype(np.float32)
        seen = np.zeros(logits.shape, bool)
        seen[prompt + out] = True
        if repetition != 1.0:
            logits = np.where(seen, np.where(logits > 0, logits / np.float32(repetition),
                                             logits * np.float32(repetition)), logits)
        counts = np.bincount(out, minlength=logits.shape[0]).astype(np.float32)
        logits = logits - np.float32(frequency) * counts - np.float32(presence) * (counts > 0)
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] <= hf_reference.MIN_TOP2_GAP:
            return None
        out.append(int(np.argmax(logits)))
    return out


def test_smollm2_repetition_penalty_matches_hf(smollm2_engine, hf_smollm2):
    tok = smollm2_engine.tokenizer
    ids = [tok.encode(t) for t in TEXTS[:6]]
    refs = hf_repetition_greedy(hf_smollm2, ids, 20, 1.3)
    kept = [(i, r) for i, r in zip(ids, refs) if r is not None]
    assert len(kept) >= 4
    outs, plain = (smollm2_engine.generate([i for i, _ in kept], SamplingParams(
        max_new_tokens=20, ignore_eos=True, repetition_penalty=penalty)) for penalty in (1.3, 1.0))
    assert [o.token_ids for o in outs] == [r for _, r in kept]
    assert sum(o.token_ids != p.token_ids for o, p in zip(outs, plain)) >= 2  # the penalty bites
    assert_idle_and_clean(smollm2_engine)


@pytest.mark.parametrize("frequency,presence,repetition", [(0.8, 0.0, 1.0), (0.0, 1.5, 1.0),
                                                           (-0.5, 0.5, 1.2)])
def test_frequency_and_presence_match_numpy_over_hf(frequency, presence, repetition, tiny_dir,
                                                     hf_llama, tiny_prompts):
    engine = Engine(tiny_dir["llama"], page_size=16, **TINY)
    prompts = tiny_prompts[4:10]
    refs = [numpy_penalized_greedy(hf_llama, p, 16, frequency, presence, repetition) for p in prompts]
    kept = [(p, r) for p, r in zip(prompts, refs) if r is not None]
    assert len(kept) >= 4
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, frequency_penalty=frequency,
                            presence_penalty=presence, repetition_penalty=repetition)
    outs = engine.generate([p for p, _ in kept], params)
    assert [o.token_ids for o in outs] == [r for _, r in kept]
    assert_idle_and_clean(engine)


def test_penalised_and_plain_requests_share_batches_and_retracts(tiny_dir, prompts_and_refs):
    """Penalised (greedy and seeded) and plain requests in one batch, chunked, mixed and with
    forced retracts, give each request's tokens of a run alone."""
    short, long, refs = prompts_and_refs
    prompts = short + long
    kinds = [dict(), dict(repetition_penalty=1.4), dict(frequency_penalty=1.0),
             dict(presence_penalty=-1.0, temperature=0.9, seed=3), dict(temperature=0.9, seed=4)]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, **kinds[i % len(kinds)])
              for i in range(len(prompts))]
    alone_engine = Engine(tiny_dir["llama"], page_size=16, **TINY)
    assert alone_engine.runner.token_counts is None
    alone_engine.generate(prompts[0], params[0])
    assert alone_engine.runner.token_counts is None  # no penalty: the counts do not exist
    alone = [alone_engine.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert alone[0] == refs[0] and alone[1] != refs[1]  # the penalties change the output
    engine = Engine(tiny_dir["llama"], page_size=16, chunked_prefill_size=32,
                    enable_mixed_chunk=True, force_retract_every=3, **TINY)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert engine.stats()["num_retracted"] >= 3
    counts = engine.runner.token_counts
    assert engine.generate(prompts[1], params[1])[0].token_ids == alone[1]
    assert counts.is_deleted()  # donated into the writer and the penalised sampler, not copied
    assert_idle_and_clean(engine)
    assert_idle_and_clean(alone_engine)


def test_requests_without_features_run_the_plain_programs(tiny_dir, tiny_prompts, tiny_greedy_refs):
    """Plain greedy requests lower to the same shapes and the greedy, unpenalised sampler with
    no logprobs program; a step dispatches a feature's program only while a request of it uses
    the feature."""
    engine = Engine(tiny_dir["llama"], page_size=16, **TINY)
    steps = []
    run = engine.runner.run
    engine.runner.run = lambda fb, shape, *rest: steps.append((fb, shape, rest)) or run(fb, shape, *rest)
    plain = engine.generate(tiny_prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in plain] == tiny_greedy_refs["llama"]
    assert all(fb.all_greedy and not fb.penalized and not fb.logprobs and not shape.prompt_logprobs
               and all(x is None for x in rest) for fb, shape, rest in steps)  # no targets, mask
    shapes = {shape for _, shape, _ in steps}
    assert engine.runner.token_counts is None
    steps.clear()
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True)] * 15 + [
        SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=1, repetition_penalty=1.2)]
    mixed = engine.generate(tiny_prompts, params)
    assert [o.token_ids for o in mixed[:15]] == tiny_greedy_refs["llama"][:15]
    featured = [fb.logprobs and fb.penalized for fb, _, _ in steps]
    assert 0 < sum(featured) <= 4 < len(steps)  # only the steps carrying the last request
    assert {shape for _, shape, _ in steps} <= shapes
    assert_idle_and_clean(engine)
