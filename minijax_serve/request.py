"""Requests: the user's SamplingParams, the scheduler's Req, and the RequestOutput it returns."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from minijax_serve.memory.radix_cache import TreeNode


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request (SGLang / vLLM names and defaults)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 0.0  # 0 = greedy
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError naming the field and its limit."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed < 2**32):
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens


class RequestOutput:
    """A request's tokens so far; ``finished`` once ``finish_reason`` is set.

    Made for every request at every step, so it copies nothing when made: it keeps the request
    and how far its outputs went (with the text and finish state of that moment); ``token_ids``
    and ``token_times`` are cut from the engine's own append-only lists at that length when read
    (each read is a fresh list). ``prompt_token_ids`` is the engine's own list: do not modify it.
    The other fields never change once a request has a token."""

    __slots__ = ("_req", "_num_tokens", "text", "finish_reason", "finish_time")

    def __init__(self, req: Req):
        self._req, self._num_tokens, self.text = req, len(req.output_ids), req.text
        self.finish_reason = req.finish_reason.value if req.finish_reason else None
        self.finish_time = req.finish_time

    @property
    def request_id(self) -> str:
        return self._req.rid

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._req.prompt_ids

    @property
    def token_ids(self) -> list[int]:
        return self._req.output_ids[:self._num_tokens]

    @property
    def token_times(self) -> list[float]:
        """When each output token reached the host (``time.perf_counter()`` seconds)."""
        return self._req.token_times[:self._num_tokens]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache at the request's first admission."""
        return self._req.cached_tokens

    @property
    def arrival_time(self) -> float:
        return self._req.arrival_time

    @property
    def first_token_time(self) -> float | None:
        return self._req.first_token_time

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple:
        return (self.request_id, self.prompt_token_ids, self.token_ids, self.text,
                self.finish_reason, self.cached_tokens, self.arrival_time, self.first_token_time,
                self.finish_time, self.token_times)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestOutput) and self._fields() == other._fields()

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids}, "
                f"text={self.text!r}, finish_reason={self.finish_reason!r}, "
                f"cached_tokens={self.cached_tokens})")


class Req:
    """The scheduler's view of one request: its tokens, its KV ledger and its timestamps."""

    def __init__(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, seed: int,
                 arrival_time: float):
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = seed
        self.output_ids: list[int] = []  # tokens that reached the host
        self.num_pending = 0  # tokens sampled by dispatched steps, not on the host yet (overlap)
        self.epoch = 0  # bumped by a retract: results of steps dispatched before it are dropped
        self.slot: int | None = None  # request slot (row of the device token buffer)
        self.pages: list[int] = []  # KV pages in order: borrowed from the prefix cache, then its own
        self.prefix_len = 0  # leading tokens whose pages the prefix cache owns (a multiple of page_size)
        self.prefix_node: TreeNode | None = None  # the prefix cache node it locks to keep them
        self.kv_len = 0  # tokens whose KV is written
        self.token_in_buffer = False  # the last output token sits in the device token buffer
        self.detok_offsets = (0, 0)  # incremental detokenization window over output_ids
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache (first admission)
        self.num_retracted = 0  # times sent back to the waiting queue to free KV
        self.finish_reason: FinishReason | None = None
        self.text = ""
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.token_times: list[float] = []

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
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self) -> RequestOutput:
        return RequestOutput(self)
