"""Requests: the scheduler's Req, the RequestOutput a caller is handed, and the seeds of a
request's samples."""

from __future__ import annotations

import enum
from typing import Any, Sequence

import numpy as np

from minijax_serve.core.sampling_params import SamplingParams

Logprobs = dict[int, float]  # token id -> log-probability: the chosen token first, then the top K
DETOK_PROMPT_CONTEXT = 5  # prompt tokens the first detokenization window starts on


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``: the seed itself for sample
    0, so it repeats the n = 1 run; one derived from (seed, index) for the others, so that sample 1
    of seed s is not sample 0 of seed s + 1 (vLLM's seed + index would make it so)."""
    return seed if index == 0 else int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens
    ABORT = "abort"  # Engine.abort


class RequestOutput:
    """A request's output so far, and what it adds since the previous output handed over for
    the same request (``new_token_ids``, ``new_text``, ``new_logprobs``): the deltas of a
    request concatenate exactly to its final ``token_ids``, ``text`` and ``logprobs``.
    ``finished`` once ``finish_reason`` is set ("stop", "length" or "abort").

    Made when handed to a caller (by ``step``, ``stream``, ``generate`` or ``get_output``),
    for every request at every step, so it copies nothing: it keeps the request and how far
    its outputs went at that moment; the lists and strings are cut from the engine's own
    append-only ones when read (each read is a fresh list). ``text`` is always a prefix of the
    final text: text that may still turn out to start a stop string, or an incomplete UTF-8
    character, is held back until it cannot. ``prompt_token_ids`` is the engine's own list: do
    not modify it.

    Times (``arrival_time``, ``first_token_time``, ``token_times``, ``finish_time``: when it
    finished, None before) are seconds on the engine's clock: ``time.perf_counter()``, or a
    virtual clock when the engine is simulated (``minijax_serve.core.clock``)."""

    __slots__ = ("_req", "_num_tokens", "_text_len", "_from_tokens", "_from_text",
                 "finish_reason", "finish_time", "weights_version")

    def __init__(self, req: Req):
        self._req = req
        self._num_tokens, self._text_len = len(req.output_ids), req.visible_len
        self._from_tokens, self._from_text = req.handed
        req.handed = (self._num_tokens, self._text_len)
        self.finish_reason = req.finish_reason.value if req.finish_reason else None
        self.finish_time = req.finish_time
        # the weights version (Engine.update_weights) its newest token came from
        self.weights_version = req.weights_version_at(self._num_tokens - 1)

    @property
    def request_id(self) -> str:
        """The id ``add_request`` returned (with n > 1, ``f"{parent}-{index}"``)."""
        return self._req.rid

    @property
    def index(self) -> int:
        """Which of the prompt's ``n`` samples this is (0 when n = 1)."""
        return self._req.index

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids (the engine's own list)."""
        return self._req.prompt_ids

    @property
    def token_ids(self) -> list[int]:
        """Every output token so far."""
        return self._req.output_ids[:self._num_tokens]

    @property
    def num_tokens(self) -> int:
        """``len(token_ids)``, without cutting the list."""
        return self._num_tokens

    @property
    def new_token_ids(self) -> list[int]:
        """The output tokens added since the previous output handed over."""
        return self._req.output_ids[self._from_tokens:self._num_tokens]

    @property
    def text(self) -> str:
        """The output text so far (empty without a tokenizer); a prefix of the final text."""
        return self._req.text[:self._text_len]

    @property
    def new_text(self) -> str:
        """The text added since the previous output handed over."""
        return self._req.text[self._from_text:self._text_len]

    @property
    def logprobs(self) -> list[Logprobs] | None:
        """Per output token: the sampled token's and the top ``logprobs`` tokens'
        log-probabilities (None unless ``SamplingParams.logprobs`` is set)."""
        lps = self._req.logprobs
        return None if lps is None else lps[:self._num_tokens]

    @property
    def new_logprobs(self) -> list[Logprobs] | None:
        """``logprobs`` of ``new_token_ids``."""
        lps = self._req.logprobs
        return None if lps is None else lps[self._from_tokens:self._num_tokens]

    @property
    def prompt_logprobs(self) -> list[Logprobs | None] | None:
        """Per prompt token: None for the first, then the token's and the top
        ``prompt_logprobs`` tokens' log-probabilities; None until the prompt is computed (or
        unless ``SamplingParams.prompt_logprobs`` is set)."""
        req = self._req
        lps = req.prompt_logprobs
        if lps is None or len(lps) < len(req.prompt_ids) - 1:
            return None
        return [None, *lps]

    @property
    def token_weights_versions(self) -> list[int]:
        """The weights version each output token came from: one version, but for a request
        that an update with ``in_flight="recompute"`` carried over to new weights."""
        return [self._req.weights_version_at(i) for i in range(self._num_tokens)]

    @property
    def token_times(self) -> list[float]:
        """When each output token reached the host (the engine's clock)."""
        return self._req.token_times[:self._num_tokens]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache at the request's first admission."""
        return self._req.cached_tokens

    @property
    def arrival_time(self) -> float:
        """When the request was added (the engine's clock)."""
        return self._req.arrival_time

    @property
    def first_token_time(self) -> float | None:
        """When its first output token reached the host (the engine's clock); None before."""
        return self._req.first_token_time

    @property
    def finished(self) -> bool:
        """``finish_reason`` is set: the request is over."""
        return self.finish_reason is not None

    def _fields(self) -> tuple:
        return (self.request_id, self.prompt_token_ids, self.token_ids, self.new_token_ids,
                self.text, self.new_text, self.finish_reason, self.logprobs, self.cached_tokens,
                self.arrival_time, self.first_token_time, self.finish_time, self.token_times,
                self.weights_version)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestOutput) and self._fields() == other._fields()

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids}, "
                f"text={self.text!r}, new_text={self.new_text!r}, "
                f"finish_reason={self.finish_reason!r}, cached_tokens={self.cached_tokens})")


class Req:
    """The scheduler's view of one request (one sample of a prompt): its tokens, its KV ledger,
    its text and its timestamps."""

    def __init__(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, seed: int,
                 arrival_time: float, index: int = 0, weights_version: int = 0):
        self.rid = rid
        self.index = index  # sample index among the prompt's n
        self.siblings: tuple[Req, ...] = ()  # every sample of the same prompt when n > 1
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = seed
        self.output_ids: list[int] = []  # tokens that reached the host
        self.num_pending = 0  # tokens sampled by dispatched steps, not on the host yet (overlap)
        self.epoch = 0  # bumped by a retract: results of steps dispatched before it are dropped
        self.slot: int | None = None  # request slot (row of the device token buffer)
        self.pages: list[int] = []  # KV pages in order: borrowed from the prefix cache, then its own
        self.prefix_len = 0  # leading tokens whose pages the prefix cache owns (a multiple of page_size)
        # the prefix cache's node (memory.prefix_cache.TreeNode) it locks to keep them
        self.prefix_node: Any = None
        self.kv_len = 0  # tokens whose KV is written
        self.token_in_buffer = False  # the last output token sits in the device token buffer
        # incremental detokenization window over output positions; it starts on the prompt's
        # last tokens (negative positions), as vLLM's and SGLang's, so that a decoder that strips
        # a leading space (SentencePiece) keeps the first output token's
        self.detok_offsets = (-min(DETOK_PROMPT_CONTEXT, len(self.prompt_ids)), 0)
        self.text = ""  # decoded output; past visible_len it may still be cut at a stop string
        self.visible_len = 0  # leading characters of text that are final
        self.handed = (0, 0)  # tokens and characters handed to a caller in RequestOutputs
        self.logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[Logprobs] | None = (
            [] if params.prompt_logprobs is not None else None)
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache (first admission)
        self.num_retracted = 0  # times sent back to the waiting queue to free KV
        self.outputs_at_retract = -1  # output tokens on the host when last retracted
        self.grammar: Any = None  # the llguidance matcher of params.grammar (set by the engine)
        self.finish_reason: FinishReason | None = None
        self.stopped_on_token = False  # ended by EOS or a stop token id (its text left out)
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.token_times: list[float] = []
        # (first output index, weights version) from which output tokens come from that version
        self.weights_marks = [(0, weights_version)]

    def weights_version_at(self, index: int) -> int:
        """The weights version output token ``index`` came (or comes) from; for -1 (no token
        yet), that of the first."""
        marks = self.weights_marks
        if len(marks) == 1:
            return marks[0][1]
        return next(v for start, v in reversed(marks) if start <= max(index, 0))

    def weights_changed(self, version: int) -> None:
        """Weights of ``version`` make this unfinished request's next output tokens."""
        n = len(self.output_ids)
        self.weights_marks = [m for m in self.weights_marks if m[0] < n] + [(n, version)]

    @property
    def num_outputs(self) -> int:
        """Output tokens generated so far, counting those still on their way to the host."""
        return len(self.output_ids) + self.num_pending

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence so far: the prompt and every output token (pending ones too)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of the sequence (prompt then output), without copying it all;
        pending tokens are not known here (a step reads them from the device token buffer)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n):end - n]

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - self.num_outputs

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are asked for and not all computed yet: its prefill
        takes nothing from the prefix cache."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < len(self.prompt_ids) - 1

    def append_token(self, token: int, now: float, eos_ids: frozenset[int]) -> None:
        """Append an output token that reached the host at ``now`` (the grammar's matcher
        consumes it) and set ``finish_reason`` if it ends the request."""
        self.output_ids.append(token)
        if self.grammar is not None and not self.grammar.consume_token(token):
            raise RuntimeError(f"request {self.rid}: token {token} is outside its grammar (the "
                               f"mask let it through): {self.grammar.get_error()}")
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
        self.check_finished(token, eos_ids)

    def check_finished(self, token: int, eos_ids: frozenset[int]) -> None:
        """Set ``finish_reason`` if the request ends with ``token``, just appended to its
        outputs."""
        p = self.params
        if self.reached_min_new_tokens and (
            (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        ):
            self.finish_reason, self.stopped_on_token = FinishReason.STOP, True
        elif self.grammar is not None and self.grammar.is_stopped():  # the grammar is complete
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= p.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH

    @property
    def reached_min_new_tokens(self) -> bool:
        """Enough output tokens on the host that EOS, a stop token or a stop string may end it."""
        return len(self.output_ids) >= self.params.min_new_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
