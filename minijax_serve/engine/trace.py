"""The step trace: one :class:`StepRecord` per dispatched step, with ``record_steps=True``.

``engine.step_records()`` returns them; :func:`to_columns` turns them into a dict of numpy
arrays, so ``pandas.DataFrame(to_columns(records))`` works without this project depending on
pandas. Recording costs nothing when off: no record is made.

Host and blocked time: a tick dispatches one step and takes the tokens of one (the same step
without overlap; the previous one with overlap). Its host and blocked milliseconds are charged
to the step it *dispatched*. The tick that only takes the last step's tokens (under overlap,
when nothing is left to dispatch) dispatches nothing and makes no record, so the records' sums
of ``host_ms`` and ``blocked_ms`` can fall short of ``stats()``' totals by those ticks.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

if TYPE_CHECKING:
    from minijax_serve.scheduler import ScheduleBatch


class StepRecord(NamedTuple):
    index: int  # 0, 1, ... in dispatch order
    kind: str  # "prefill", "decode" or "mixed"
    start_s: float  # the engine's clock (perf_counter; virtual when simulated) at its tick's start
    prefill_reqs: int  # requests computing prompt tokens (a whole prompt or a chunk)
    decode_reqs: int  # requests decoding (one token, or a verify of their drafts)
    prefill_tokens: int
    decode_tokens: int
    bucket_tokens: int  # the compiled step shape it ran in: padded new tokens,
    bucket_seqs: int  # padded sequences,
    bucket_kv_tokens: int  # and page-table width in tokens
    running: int  # requests running after its dispatch
    waiting: int  # requests waiting after its dispatch
    chunked: int  # 1 while a prompt is mid-prefill after its dispatch
    kv_tokens_used: int  # KV pool tokens held by requests after its dispatch
    kv_pool_tokens: int
    cached_tokens: int  # prompt tokens its admissions took from the prefix cache
    evicted_tokens: int  # prefix-cache tokens evicted to schedule it
    retracted: int  # requests retracted to schedule it
    new_token_ratio: float
    host_ms: float  # the dispatching tick's host time (module docstring)
    blocked_ms: float  # the dispatching tick's wait for the device
    draft_tokens: int = 0  # speculative decoding: drafts it verified
    accepted_tokens: int = 0  # and those it accepted

    @property
    def padding(self) -> float:
        """Share of the step's padded new tokens that are padding."""
        return 1.0 - (self.prefill_tokens + self.decode_tokens) / self.bucket_tokens


def to_columns(records: Sequence[StepRecord]) -> dict[str, np.ndarray]:
    """The records as one numpy array per field (``kind`` as strings), plus ``padding``."""
    columns = {name: np.array([getattr(r, name) for r in records]) for name in StepRecord._fields}
    columns["padding"] = np.array([r.padding for r in records], dtype=np.float64)
    return columns


def append_jsonl(path: str, records: Sequence[StepRecord], **labels: Any) -> None:
    """Append one JSON object per record (its fields, ``padding`` and ``labels``) to ``path``."""
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps({**labels, **r._asdict(), "padding": r.padding}) + "\n")


def step_fields(core: Any, batch: ScheduleBatch, shape: Any, kind: str,
                before: tuple[int, int, int]) -> dict[str, Any]:
    """A StepRecord's fields but the tick's times (and a verify's accepted drafts), right after
    ``core`` (an EngineCore) dispatched ``batch``; ``before``: the scheduler's cached, evicted
    and retracted counts before it was scheduled."""
    sched, ps, n = core.scheduler, core.allocator.page_size, batch.num_prefill
    return dict(
        kind=kind.removesuffix("_steps"), prefill_reqs=n, decode_reqs=len(batch.reqs) - n,
        prefill_tokens=sum(batch.new_tokens[:n]), decode_tokens=sum(batch.new_tokens[n:]),
        bucket_tokens=shape.num_tokens, bucket_seqs=shape.num_seqs,
        bucket_kv_tokens=shape.num_pages * ps, running=len(sched.running),
        waiting=len(sched.waiting), chunked=int(sched.chunked is not None),
        kv_tokens_used=core.kv_tokens_used, kv_pool_tokens=core.kv_pool_tokens,
        cached_tokens=sched.cached_tokens - before[0],
        evicted_tokens=(sched.evicted_pages - before[1]) * ps,
        retracted=sched.num_retracted - before[2], new_token_ratio=sched.ratio.value,
        draft_tokens=sum(map(len, batch.drafts or ())))
