"""What quantization costs in quality: an engine against the same engine unquantized, on real
conversations (``benchmarks/quant_quality.py``; the tests' bounds: tests/bench/test_fp8_quality.py).

* **Teacher-forced NLL**: each ShareGPT conversation's first reply scored after its first turn
  (the chat template's user turn with the generation prompt, then the reply's tokens), by the
  engine's prompt logprobs; the mean negative log-likelihood per reply token over every reply.
* **Greedy agreement**: 32 greedy tokens after each user turn (EOS ignored); the share of
  positions whose token equals the reference engine's, and the mean length of the common
  prefix (after the first difference the two texts go their own ways).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from minijax_serve.bench.sharegpt_file import read_sharegpt
from minijax_serve.core.sampling_params import SamplingParams


class Conversation(NamedTuple):
    prompt_ids: list[int]  # the user turn in the chat template, generation prompt added
    reply_ids: list[int]  # the reply's tokens (truncated to max_reply)


def sharegpt_conversations(tokenizer: Any, n: int, max_prompt: int, max_reply: int,
                           seed: int = 0, dataset_path: str | None = None,
                           min_reply: int = 16) -> list[Conversation]:
    """``n`` conversations drawn as ``bench --dataset sharegpt`` draws them (the file's
    exchanges shuffled by ``seed``): the first whose templated prompt has at most ``max_prompt``
    tokens and whose reply at least ``min_reply``, replies cut to ``max_reply`` tokens."""
    data = read_sharegpt(dataset_path)
    chosen = []
    for i in np.random.default_rng(seed).permutation(len(data.exchanges)):
        prompt, reply = data.exchanges[i]
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        reply_ids = tokenizer.encode(reply, add_special_tokens=False)[:max_reply]
        if len(ids) <= max_prompt and len(reply_ids) >= min_reply:
            chosen.append(Conversation(ids, reply_ids))
            if len(chosen) == n:
                return chosen
    raise ValueError(f"only {len(chosen)} ShareGPT conversations fit (prompt <= {max_prompt} "
                     f"tokens, reply >= {min_reply})")


def reply_logprobs(engine: Any, conversations: Sequence[Conversation]) -> list[np.ndarray]:
    """Each reply token's log-probability after its prompt and the reply before it."""
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    outs = engine.generate([c.prompt_ids + c.reply_ids for c in conversations], params)
    lps = []
    for conv, out in zip(conversations, outs):
        tokens = conv.prompt_ids + conv.reply_ids
        rows = out.prompt_logprobs[len(conv.prompt_ids):]
        lps.append(np.array([row[t] for row, t in zip(rows, tokens[len(conv.prompt_ids):])]))
    return lps


def mean_nll(logprobs: Sequence[np.ndarray]) -> float:
    """The mean negative log-likelihood per token over every reply."""
    return float(-np.concatenate(logprobs).mean())


def greedy_tokens(engine: Any, conversations: Sequence[Conversation],
                  n: int = 32) -> list[list[int]]:
    """``n`` greedy tokens after each conversation's prompt (EOS ignored)."""
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate([c.prompt_ids for c in conversations], params)]


class Agreement(NamedTuple):
    token_share: float  # positions whose token equals the reference's
    mean_prefix: float  # mean length of the common prefix, in tokens


def agreement(tokens: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> Agreement:
    """How far ``tokens`` follow ``reference``, sequence by sequence."""
    same = [np.asarray(a) == np.asarray(b) for a, b in zip(tokens, reference)]
    prefix = [int(np.argmin(s)) if not s.all() else len(s) for s in same]
    return Agreement(float(np.concatenate(same).mean()), float(np.mean(prefix)))
