"""SamplingParams: how to generate for one request, checked when it is made (as vLLM's)."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

MAX_LOGPROBS = 20  # OpenAI's and vLLM's limit on top log-probabilities per token
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # a bias is in [-100, 100] (OpenAI's range)
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")  # structured output, at most one
MAX_TOP_K = 2**31 - 1  # the device's top_k rows are int32
MAX_SEED = 2**32 - 1  # seeds are uint32 on the device
# float32's normal range: a penalty outside it becomes 0 or inf on the device
PENALTY_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` as an int; ValueError naming ``name`` unless an integer in [low, high]."""
    if not _is_int(value) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")
    return int(value)


def _float(name: str, value: Any) -> float:
    """``value`` as a float; ValueError naming ``name`` unless a finite number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    try:
        pairs = [(token, bias) for token, bias in pairs]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to biases, got {value!r}") from None
    seen: set[int] = set()
    for token, bias in pairs:
        _int("logit_bias: a token id", token, 0)
        if not -LOGIT_BIAS_RANGE <= _float("logit_bias: a bias", bias) <= LOGIT_BIAS_RANGE:
            raise ValueError(f"logit_bias: a bias must be in [-{LOGIT_BIAS_RANGE:g}, "
                             f"{LOGIT_BIAS_RANGE:g}], got {bias!r} (token {token})")
        if token in seen:
            raise ValueError(f"logit_bias: token id {token} appears twice")
        seen.add(token)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    return tuple(sorted((int(t), float(b)) for t, b in pairs))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request (SGLang / vLLM names and defaults). Raises ValueError
    naming the field and its limit when made with a bad value. Integer fields take numpy
    integers too (stored as int).

    ``top_k``: -1 is off (0 is refused, not read as off); a value above the vocabulary size
    keeps the whole vocabulary, as in vLLM.
    ``repetition_penalty`` (HuggingFace / SGLang, over prompt and output tokens; 1 = off):
    logits of seen tokens are divided by it where positive, multiplied where negative.
    ``frequency_penalty`` / ``presence_penalty`` (OpenAI, over output tokens; 0 = off, in
    [-2, 2]): ``count × frequency + (count > 0) × presence`` is subtracted from a token's logit.
    ``logit_bias``: ``{token_id: bias}`` (or ``(token_id, bias)`` pairs), each bias in [-100,
    100] added to that token's logit before the penalties and sampling (OpenAI's, as in vLLM and
    HuggingFace's ``sequence_bias``); kept as a tuple of pairs sorted by token id, at most 300.
    ``include_stop_str_in_output`` (vLLM's): the text keeps the stop string that ended it,
    and the text of the EOS or stop token that did (by default neither is in the text; the
    token ids always have the token).
    ``n``: samples of the prompt (its prompt is computed once, shared through the prefix cache).
    ``logprobs``: None off; K in 0..20 returns, for every output token, the log-probabilities of
    the sampled token and of the top K, from the model's raw logits (before temperature,
    penalties or top-k/top-p). ``prompt_logprobs``: the same for every prompt token after the
    first (such a request computes its whole prompt: it takes nothing from the prefix cache).
    ``json_schema`` (a JSON schema, as a string or a mapping; ``{"type": "object"}`` for any
    object), ``regex`` (a regular expression the whole output matches) or ``ebnf`` (a grammar,
    GBNF or Lark): structured output, at most one of them (SGLang's names). Each step samples
    only tokens the grammar allows, and the request stops once the grammar is complete
    (``stop`` strings still apply); needs the ``structured`` extra (llguidance) and a tokenizer.
    ``speculate``: False keeps the request out of speculative decoding (one token per step);
    a request with a grammar, a penalty or a logit bias never speculates.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 0.0  # 0 = greedy
    top_k: int = -1  # -1 = off; above the vocabulary size: the whole vocabulary (as vLLM)
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: str | Mapping[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    speculate: bool = True

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), "
                             f"got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if isinstance(self.json_schema, Mapping):
            try:
                object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
            except (TypeError, ValueError) as e:
                raise ValueError(f"json_schema must be JSON: {e}") from None
        self._validate()

    def _validate(self) -> None:
        object.__setattr__(self, "max_new_tokens", _int("max_new_tokens", self.max_new_tokens, 1))
        object.__setattr__(self, "min_new_tokens", _int("min_new_tokens", self.min_new_tokens, 0,
                                                        self.max_new_tokens))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            object.__setattr__(self, name, _float(name, getattr(self, name)))
        low, high = PENALTY_RANGE  # float32's normal range: the device divides by it
        if self.temperature != 0 and not low <= self.temperature <= high:
            raise ValueError(f"temperature must be 0 (greedy) or in [{low:.4g}, {high:.4g}] "
                             f"(float32), got {self.temperature}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be -1 (off) or an integer in [1, {MAX_TOP_K}], got "
                             f"{self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be finite and > 0 (1 = off), in "
                             f"[{low:.4g}, {high:.4g}] (float32), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        object.__setattr__(self, "n", _int("n", self.n, 1))
        if self.seed is not None:
            object.__setattr__(self, "seed", _int("seed", self.seed, 0, MAX_SEED))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _int(name, getattr(self, name), 0, MAX_LOGPROBS))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        for name in given:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]}: give at most one grammar")
        if given and self.min_new_tokens:
            raise ValueError(f"min_new_tokens cannot be combined with {given[0]}: the grammar "
                             "decides where the output ends")

    @property
    def greedy(self) -> bool:
        """Every token is the argmax (temperature 0 or top_k 1): no sampling."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """A repetition, frequency or presence penalty is on."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field, text) of the request's grammar, if it has one."""
        for name in GRAMMAR_FIELDS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    @property
    def adjusts_logits(self) -> bool:
        """A penalty or a logit bias: the request's steps run the penalised sampler."""
        return self.penalized or bool(self.logit_bias)
