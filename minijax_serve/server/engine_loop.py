"""EngineLoop: one thread owns the Engine and runs its step loop; HTTP handlers never touch it.

Handlers hand commands to the loop through a thread-safe inbox (:meth:`EngineLoop.submit`,
:meth:`abort`, :meth:`call`) and get each request's outputs back on their own asyncio queue: after
every step the loop posts one callback to the event loop that puts each new :class:`Delta` on
its queue. With nothing to run, the thread sleeps on an event that every command sets (no
polling). The engine is built on the loop's thread too (``make_engine``), so the server can
listen while the model loads: :attr:`ready` is set once it is loaded (and warmed up).

A fault inside a step must not take the server down: the loop aborts every unfinished request,
hands each handler the error (an HTTP 500) and goes on serving. A step that never returns is the
watchdog's (:mod:`minijax_serve.server.watchdog`, reading :attr:`EngineLoop.busy_since`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import logging
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from minijax_serve.core.sampling_params import SamplingParams
from minijax_serve.server.deltas import Delta, EngineFault, LoadSnapshot, Observer, Route

log = logging.getLogger("minijax_serve.server")
SNAPSHOT_EVERY_S = 0.2  # how stale /metrics' load gauges may be while the engine is busy


class EngineLoop:
    """The engine's thread. ``observer`` hears of every sequence added, handed over or failed
    (metrics), ``on_load_error(err)`` if ``make_engine`` raises; ``max_queued_requests`` bounds
    the sequences submitted and not yet running."""

    def __init__(self, make_engine: Callable[[], Any], event_loop: asyncio.AbstractEventLoop,
                 max_queued_requests: int | None = None, observer: Observer | None = None,
                 on_load_error: Callable[[BaseException], None] | None = None):
        self._make_engine = make_engine
        self._event_loop = event_loop
        self.max_queued_requests = max_queued_requests
        self._observer = observer
        self._on_load_error = on_load_error
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._routes: dict[str, Route] = {}  # engine request id -> where its outputs go
        self._queued = 0  # submitted requests (samples) not yet seen running, inbox included
        self._lock = threading.Lock()  # guards _queued between handlers and the loop
        self.snapshot = LoadSnapshot()
        self._snapshot_time = 0.0
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.stopping = False
        self.busy_since: float | None = None  # monotonic start of the work in progress, if any
        self.hung: str | None = None  # why the watchdog gave the loop up (it is then dead)
        self.engine: Any = None  # set on the loop's thread; handlers read only its constants
        self.tokenizer: Any = None  # the handlers' own copy of the engine's tokenizer
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- handler side (any thread) ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def _put(self, command: str, payload: Any) -> None:
        self._inbox.append((command, payload))
        self._wake.set()

    def submit(self, request_id: str, prompts: Sequence[list[int]], params: SamplingParams,
               queue: asyncio.Queue, stream: bool = True) -> bool:
        """Queue one HTTP request's prompts (checked already), ``params.n`` samples each; their
        Deltas go to ``queue`` (with ``stream`` False, one per sample when it finishes). False
        (nothing queued) when the queue limit is reached or the server is stopping."""
        count = len(prompts) * params.n
        with self._lock:
            limit = self.max_queued_requests
            if self.stopping or (limit is not None and self._queued + count > limit):
                return False
            self._queued += count
            self._put("add", (request_id, list(prompts), params, queue, stream))  # see declare_hung
        return True

    def abort(self, request_id: str) -> None:
        """Abort every prompt of the HTTP request ``request_id`` (its client went away)."""
        self._put("abort", request_id)

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop's thread between two steps; a Future of its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.hung is not None:
                future.set_exception(RuntimeError(self.hung))
            else:
                self._put("call", (fn, future))
        return future

    def abort_all(self) -> None:
        """Stop accepting requests and abort every one in flight (their streams end with
        finish_reason "abort")."""
        with self._lock:
            self.stopping = True
        self._put("abort_all", None)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything, end the thread and wait for it (not for a hung one)."""
        self.abort_all()
        self._put("exit", None)
        if self._thread.is_alive() and self.hung is None:
            self._thread.join(timeout)

    def declare_hung(self, message: str) -> None:
        """The watchdog's verdict (from its thread, while the loop's is stuck in the engine):
        refuse new requests and fail every one in flight with ``message``, without touching
        the engine. Should the step ever return, the loop aborts what the engine holds and
        ends."""
        with self._lock:  # no request or call enters the inbox after this
            self.stopping = True
            self.hung = message
            waiting = list(self._inbox)
            self._inbox.clear()
        routes = list(self._routes.values())  # the loop's thread is stuck: nothing changes it
        if self._observer is not None:
            self._observer.failed(len(routes))
        queues = {id(r.queue): r.queue for r in routes}
        for command, payload in waiting:  # never reached the engine: not counted
            if command == "add":
                queues[id(payload[3])] = payload[3]
            elif command == "call":
                payload[1].set_exception(RuntimeError(message))
        self._deliver([(q, EngineFault(message)) for q in queues.values()])
        self._wake.set()

    # -- the loop's thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
            self.tokenizer = copy.deepcopy(self.engine.tokenizer)
        except BaseException as err:  # reported by the server, which then exits
            self.load_error = err
            log.error("the engine failed to load: %s: %s", type(err).__name__, err)
            self.ready.set()
            if self._on_load_error is not None:
                self._on_load_error(err)
            return
        self.ready.set()
        while self.hung is None:
            self._wake.clear()
            self.busy_since = time.monotonic()
            try:
                if not self._handle_inbox():
                    return
                if self.engine.has_unfinished():
                    self._publish(self.engine.step())
                elif not self._inbox:
                    self.busy_since = None
                    self._wake.wait()
            except Exception as err:
                log.error("engine fault; aborting the requests in flight:\n%s",
                          traceback.format_exc())
                self._fail(list(self._routes),
                           EngineFault(f"engine fault: {type(err).__name__}: {err}"))
        self._abandon()

    def _abandon(self) -> None:
        """After :meth:`declare_hung`, should the engine come back: abort everything it holds
        (the handlers were answered already) and run it until it is idle."""
        try:
            for rid in list(self._routes):
                self.engine.abort(rid)
                self.engine.get_output(rid)
            self._routes.clear()
            while self.engine.has_unfinished():
                self.engine.step()
        except Exception:
            log.error("abandoning the engine failed:\n%s", traceback.format_exc())

    def _handle_inbox(self) -> bool:
        """Run every command waiting; False on "exit"."""
        while self._inbox:
            command, payload = self._inbox.popleft()
            if command == "add":
                self._add(*payload)
            elif command == "abort":
                self._abort([rid for rid in self._routes if rid.startswith(payload + "-")])
            elif command == "abort_all":
                self._abort(list(self._routes))
            elif command == "call":
                fn, future = payload
                try:
                    future.set_result(fn(self.engine))
                except Exception as err:
                    future.set_exception(err)
            elif command == "exit":
                return False
        return True

    def _add(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
             queue: asyncio.Queue, stream: bool) -> None:
        n, added = params.n, []
        try:
            for p, ids in enumerate(prompts):
                parent = self.engine.add_request(ids, params, request_id=f"{request_id}-{p}")
                for i, rid in enumerate([parent] if n == 1 else [f"{parent}-{i}" for i in range(n)]):
                    self._routes[rid] = Route(queue, p * n + i, stream)
                    added.append(rid)
        except Exception as err:  # the handler checked the request: this is an engine fault
            log.error("adding request %s failed:\n%s", request_id, traceback.format_exc())
            self._dequeued(len(prompts) * n - len(added))
            self._fail(added, EngineFault(f"engine fault: {type(err).__name__}: {err}"), [queue])
            return
        finally:
            if self._observer is not None:
                self._observer.submitted(len(added))
        if self.stopping:
            self._abort(added)

    def _abort(self, rids: list[str]) -> None:
        if not rids:
            return
        for rid in rids:
            self.engine.abort(rid)
        self._publish([out for out in map(self.engine.get_output, rids) if out is not None])

    def _fail(self, rids: list[str], fault: EngineFault, queues: Sequence[asyncio.Queue] = ()) -> None:
        """Abort ``rids`` after an engine fault; each of their handlers (and ``queues``) gets
        ``fault`` once."""
        failed = {id(q): q for q in queues}
        if self._observer is not None:
            self._observer.failed(len(rids))
        for rid in rids:
            route = self._routes.pop(rid)
            failed[id(route.queue)] = route.queue
            self._dequeued(route.first)
            try:
                self.engine.abort(rid)
                self.engine.get_output(rid)  # its final output goes nowhere
            except Exception:
                log.error("abort of %s failed:\n%s", rid, traceback.format_exc())
        self._deliver([(q, fault) for q in failed.values()])

    def _publish(self, outs: list[Any]) -> None:
        """Turn the outputs of a step into Deltas for their handlers; update the snapshot."""
        if self.hung is not None:  # the handlers were failed: nothing more goes out
            return
        items = []
        for out in outs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            first = route.first and (out.new_token_ids or out.finished)
            if first:
                self._routes[out.request_id] = route._replace(first=False)
                self._dequeued(1)
            if route.stream:
                items.append((route.queue, Delta(
                    route.choice, out.new_token_ids, out.new_text, out.new_logprobs,
                    out.finish_reason, len(out.prompt_token_ids), len(out.token_ids),
                    out.prompt_logprobs if first else None, out.cached_tokens,
                    out.weights_version)))
            elif out.finished:
                items.append((route.queue, Delta(
                    route.choice, out.token_ids, out.text, out.logprobs, out.finish_reason,
                    len(out.prompt_token_ids), len(out.token_ids), out.prompt_logprobs,
                    out.cached_tokens, out.weights_version)))
            if out.finished:
                del self._routes[out.request_id]
            if self._observer is not None:
                self._observer.observe(out)
        self._deliver(items)
        now = time.monotonic()
        if now - self._snapshot_time > SNAPSHOT_EVERY_S or not self.engine.has_unfinished():
            self._snapshot_time = now
            self._snapshot()

    def _dequeued(self, count: int) -> None:
        with self._lock:
            self._queued -= count

    def _deliver(self, items: list[tuple[asyncio.Queue, Any]]) -> None:
        if items:
            self._event_loop.call_soon_threadsafe(_put_all, items)

    def _snapshot(self) -> None:
        engine, stats = self.engine, self.engine.stats()
        self.snapshot = LoadSnapshot(
            running=len(engine.scheduler.holders()), waiting=len(engine.scheduler.waiting),
            kv_usage=stats["token_usage"], cache_hit_rate=stats["cache_hit_rate"],
            prompt_tokens=stats["prompt_tokens"], generated_tokens=stats["generated_tokens"],
            **{k: stats[k] for k in ("spec_proposed_tokens", "spec_accepted_tokens",
                                     "spec_verified_seqs")})


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
