"""The timed part of a benchmark run: a client that sends requests to the engine's step API.

Requests are sent at their arrival times (:func:`arrival_offsets`: all at once for an offline
run, Poisson or gamma-distributed gaps for ``--request-rate``), at most ``max_concurrency`` of
them unfinished at a time. The loop is single-threaded, like the engine: between two engine
steps it sends every request whose time has come, then runs one step; when the engine is idle it
sleeps until the next arrival. A request's latencies count from when the client sends it, which
is its scheduled arrival time, or, when ``max_concurrency`` held it back, the finish time of the
request that freed its place. Neither depends on when the loop got round to queueing it, so a
long engine step shows up in the latencies of the requests that arrived during it.

Every call of ``Engine.step`` (a tick) is timed, wall clock, for the decode bandwidth figures.
Without overlap a tick runs one step and returns its tokens. With overlap (the default) it
launches the next step and returns the previous one's tokens, so in a steady run a tick lasts one
step. A tick's kind comes from the engine's step counters (the step it launched); its sequence
and key counts come from the tokens it returned, so under overlap the one tick where the kind
changes mixes two steps.
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np


class StepRecord(NamedTuple):
    start: float  # the clock at the start of Engine.step
    end: float
    kind: str  # of the step launched: "prefill", "decode", "mixed" or "idle" (none)
    num_seqs: int  # requests whose token the tick returned
    kv_tokens: int  # keys those requests' step attended to (sum over them)


class TimedRun(NamedTuple):
    start: float  # the clock when the first request could be sent
    duration: float  # seconds from ``start`` until the last request finished
    sent: list[float | None]  # per request: when it was sent (the clock), None if never
    outputs: list[Any | None]  # per request: its final RequestOutput, None if rejected
    errors: list[str | None]  # per request: why add_request rejected it
    steps: list[StepRecord]

    def finished(self) -> list[tuple[Any, float]]:
        """(final output, time sent) of every request that finished."""
        return [(o, s) for o, s in zip(self.outputs, self.sent) if o is not None and o.finished]


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """Seconds after the start at which each of ``n`` requests arrives.

    ``request_rate`` = inf: all at 0 (offline). Otherwise the first arrives at 0 and the gaps are
    gamma-distributed with mean ``1 / request_rate`` and shape ``burstiness`` (1 = exponential
    gaps: a Poisson process, as SGLang's ``bench_serving``), drawn from their own generator,
    seeded with ``(seed, 1)``: the workload itself does not depend on the rate, and the gaps
    are not the dataset's draws (its generator is seeded with ``seed``) over again.
    """
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf = offline), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or n == 0:
        return np.zeros(n)
    rng = np.random.default_rng((seed, 1))
    gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def step_counts(engine: Any) -> tuple[int, int, int]:
    """The engine's prefill, decode and mixed step counters."""
    stats = engine.stats()
    return (stats.get("prefill_steps", 0), stats.get("decode_steps", 0),
            stats.get("mixed_steps", 0))


def step_kind(before: tuple[int, int, int], after: tuple[int, int, int]) -> str:
    """Which kind of step ran between two :func:`step_counts`: "idle" when none did."""
    if after == before:
        return "idle"
    return ("prefill", "decode", "mixed")[int(np.argmax(np.subtract(after, before)))]


def drive(engine: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any],
          offsets: Sequence[float], max_concurrency: int | None = None,
          on_finish: Callable[[int], None] | None = None,
          clock: Callable[[], float] = time.perf_counter,
          sleep: Callable[[float], None] = time.sleep) -> TimedRun:
    """Send request ``i`` (``prompts[i]``, ``params[i]``) at ``start + offsets[i]``, step the
    engine until every sent request finished (times from ``clock``, which must be the engine's:
    ``engine.clock.now`` and ``engine.clock.sleep`` for a simulated one); ``on_finish(n)`` after
    each step in which ``n`` requests finished (a progress bar)."""
    n = len(prompts)
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    order = sorted(range(n), key=lambda i: offsets[i])
    sent: list[float | None] = [None] * n
    outputs: list[Any | None] = [None] * n
    errors: list[str | None] = [None] * n
    steps: list[StepRecord] = []
    rid_index: dict[str, int] = {}
    # When each concurrency place frees (a min-heap): a request is sent at the later of its
    # arrival and the earliest free place.
    places = [-math.inf] * (max_concurrency or 0)
    next_req = 0
    start = clock()
    end = start
    while next_req < n or engine.has_unfinished():
        now = clock()
        while next_req < n and start + offsets[order[next_req]] <= now and (
                max_concurrency is None or places):
            i = order[next_req]
            next_req += 1
            when = start + offsets[i]
            if max_concurrency is not None:
                when = max(when, heapq.heappop(places))
            try:
                rid = engine.add_request(list(prompts[i]), params[i])
            except ValueError as err:
                errors[i] = str(err)
                if max_concurrency is not None:
                    heapq.heappush(places, when)
                if on_finish:
                    on_finish(1)
                continue
            sent[i] = when
            rid_index[rid] = i
        if not engine.has_unfinished():
            if next_req < n and (max_concurrency is None or places):
                sleep(max(0.0, start + offsets[order[next_req]] - clock()))
            continue
        before = step_counts(engine)
        t_step = clock()
        outs = engine.step()
        t_end = clock()
        kind = step_kind(before, step_counts(engine))
        kv = sum(len(o.prompt_token_ids) + o.num_tokens - 1 for o in outs) \
            if kind == "decode" else 0
        steps.append(StepRecord(t_step, t_end, kind, len(outs), kv))
        finished = 0
        for out in outs:
            if out.finished and out.request_id in rid_index:
                i = rid_index.pop(out.request_id)
                outputs[i] = out
                finished += 1
                end = max(end, out.finish_time if out.finish_time is not None else t_end)
                if max_concurrency is not None:
                    heapq.heappush(places, out.finish_time or t_end)
        if finished and on_finish:
            on_finish(finished)
    return TimedRun(start, end - start, sent, outputs, errors, steps)
