"""``bench --backend openai`` without a server: the request bodies, the SSE parsing, and the
client's accounting and traffic rules against canned streams (``httpx.MockTransport``) on a fake
clock that advances as each event arrives (the command line: test_bench_http_cli.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from minijax_serve.bench.figures import http_figures
from minijax_serve.bench.http_client import send_all, served_model_name
from minijax_serve.bench.openai_api import parse_chunk, request_body, sse_data

FIELDS = {"logprobs": None, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
          "presence_penalty": 0.0}


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    async def sleep(self, seconds):
        self.now += seconds
        await asyncio.sleep(0)


def text_chunk(text):
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def usage_chunk(prompt_tokens, completion_tokens):
    return {"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                     "completion_tokens": completion_tokens}}


class Events(httpx.AsyncByteStream):
    """An event stream whose events arrive ``step`` seconds apart on ``clock``; raises a read
    error after them if ``broken``; ``on_close`` when the client closes it."""

    def __init__(self, events, clock, step=0.25, broken=False, on_close=None):
        self.events, self.clock, self.step = events, clock, step
        self.broken, self.on_close = broken, on_close

    async def __aiter__(self):
        for event in self.events:
            self.clock.now += self.step
            await asyncio.sleep(0)  # let the other streams run
            data = event if isinstance(event, str) else json.dumps(event)
            yield f"data: {data}\n\n".encode()
        if self.broken:
            raise httpx.ReadError("connection reset by peer")

    async def aclose(self):
        if self.on_close is not None:
            self.on_close()


def _send(handler, n, offsets=None, concurrency=None, clock=None):
    clock = clock or FakeClock()
    bodies = [{"prompt": [i], "max_tokens": 4} for i in range(n)]

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://test") as client:
            return await send_all(client, "/v1/completions", bodies, offsets or [0.0] * n,
                                  concurrency, clock=clock, sleep=clock.sleep)

    return asyncio.run(go())


# -- the wire format ------------------------------------------------------------------------

def test_request_bodies_completions_and_chat():
    body = request_body("completions", "m", [5, 6, 7], 9, True, FIELDS)
    assert body == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    featured = dict(FIELDS, logprobs=3, repetition_penalty=1.1, presence_penalty=0.5)
    body = request_body("completions", "m", [5], 2, False, featured)
    assert body["logprobs"] == 3 and body["ignore_eos"] is False
    assert body["repetition_penalty"] == 1.1 and body["presence_penalty"] == 0.5
    assert "frequency_penalty" not in body  # only the fields that are set

    class Tokenizer:
        def decode(self, ids):
            return "-".join(map(str, ids))

    chat = request_body("chat", "m", [5, 6], 4, True, dict(FIELDS, logprobs=2), Tokenizer())
    assert chat["messages"] == [{"role": "user", "content": "5-6"}] and "prompt" not in chat
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    with pytest.raises(ValueError, match="--endpoint chat .* tokenizer"):
        request_body("chat", "m", [5], 4, True, FIELDS, None)


def test_sse_lines_and_chunks():
    assert sse_data('data: {"a": 1}') == '{"a": 1}'
    assert sse_data("data:[DONE]") == "[DONE]"
    for other in ("", ": keep-alive", "event: message", "id: 3"):
        assert sse_data(other) is None
    assert parse_chunk(json.dumps(text_chunk("hi"))) == (True, None, None)
    assert parse_chunk(json.dumps(text_chunk(""))).has_output is False  # no text: no output
    chat = {"choices": [{"delta": {"role": "assistant", "content": "x"}}]}
    assert parse_chunk(json.dumps(chat)).has_output is True
    assert parse_chunk(json.dumps({"choices": [{"delta": {"role": "assistant"}}]})).has_output \
        is False
    usage = parse_chunk(json.dumps(usage_chunk(3, 7)))
    assert usage.usage == {"prompt_tokens": 3, "completion_tokens": 7} and not usage.has_output
    assert "boom" in parse_chunk('{"error": {"message": "boom"}}').error
    assert "bad" in parse_chunk('{"object": "error", "message": "bad"}').error
    assert "malformed" in parse_chunk("{not json").error


# -- the client: accounting, failures, timing ------------------------------------------------

def test_tokens_from_usage_and_latencies_from_chunk_times():
    clock = FakeClock()
    events = [text_chunk("a"), text_chunk(""), text_chunk("b"), text_chunk("c"),
              usage_chunk(11, 5), "[DONE]"]  # 0.25 s apart: at 0.25, 0.5, ..., 1.5
    run = _send(lambda request: httpx.Response(200, stream=Events(events, clock)), 1,
                clock=clock)
    (out,) = run.outputs
    assert out.error is None and out.token_times == [0.25, 0.75, 1.0]  # chunks with text only
    assert (out.prompt_tokens, out.output_tokens) == (11, 5)  # usage, not 3 chunks
    assert out.finish_time == 1.5 and run.duration == 1.5
    r = http_figures(run, details=True)
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (1, 0, 5)
    assert r["total_input_tokens"] == 11 and r["output_throughput"] == 5 / 1.5
    assert r["mean_ttft_ms"] == pytest.approx(250.0)
    assert r["median_itl_ms"] == pytest.approx(375.0)  # gaps 0.5 and 0.25
    assert r["mean_e2e_ms"] == pytest.approx(1500.0)
    assert r["mean_tpot_ms"] == pytest.approx(1e3 * (1.5 - 0.25) / (5 - 1))  # usage count
    assert r["details"]["itl_s"] == [pytest.approx([0.5, 0.25])]
    assert r["first_error"] is None


def test_a_request_ends_at_done_and_its_stream_is_read_to_the_end():
    clock = FakeClock()
    events = [text_chunk("a"), usage_chunk(1, 1), "[DONE]", ": a comment"]
    (out,) = _send(lambda request: httpx.Response(200, stream=Events(events, clock)), 1,
                   clock=clock).outputs
    assert out.error is None and out.token_times == [0.25] and out.finish_time == 0.75
    assert clock.now == 1.0  # the event after [DONE] was read: the connection can be reused
    dropped = Events([text_chunk("a"), usage_chunk(1, 1), "[DONE]"], FakeClock(), broken=True)
    (out,) = _send(lambda request: httpx.Response(200, stream=dropped), 1).outputs
    assert out.error is None  # the connection broke after [DONE]: the request had finished


def test_chosen_percentiles_and_goodput():
    clock = FakeClock()
    events = [text_chunk("a"), text_chunk("b"), usage_chunk(1, 2), "[DONE]"]  # at 0.25 .. 1.0
    run = _send(lambda request: httpx.Response(200, stream=Events(events, clock)), 1,
                clock=clock)
    r = http_figures(run, percentiles=(50, 99.9), slos={"ttft": 300, "e2e": 1000})
    assert (r["p50_ttft_ms"], r["p99.9_e2e_ms"]) == pytest.approx((250.0, 1000.0))
    assert "p99_ttft_ms" not in r and r["p50_tpot_ms"] == pytest.approx(750.0)
    assert r["request_goodput"] == 1.0 and r["slos_ms"] == {"ttft": 300, "e2e": 1000}
    assert http_figures(run, slos={"tpot": 700})["request_goodput"] == 0.0
    assert "request_goodput" not in http_figures(run)


def test_failures_are_counted_not_raised():
    clock = FakeClock()
    ok = [text_chunk("a"), usage_chunk(1, 1), "[DONE]"]
    cases = {
        0: lambda: httpx.Response(200, stream=Events(ok, clock)),
        1: lambda: httpx.Response(400, json={"error": {"message": "max_tokens is too large"}}),
        2: lambda: httpx.Response(200, stream=Events([text_chunk("a")], clock, broken=True)),
        3: lambda: httpx.Response(200, stream=Events([text_chunk("a"), usage_chunk(1, 1)],
                                                     clock)),
        4: lambda: httpx.Response(200, stream=Events([text_chunk("a"), "[DONE]"], clock)),
        5: lambda: httpx.Response(200, stream=Events([{"error": {"message": "oom"}}], clock)),
    }
    run = _send(lambda request: cases[json.loads(request.content)["prompt"][0]](), len(cases),
                clock=clock)
    errors = run.errors
    assert errors[0] is None
    assert errors[1] == "HTTP 400: max_tokens is too large"
    assert errors[2].startswith("ReadError")
    assert "before data: [DONE]" in errors[3]
    assert "usage" in errors[4]
    assert "oom" in errors[5]
    r = http_figures(run)
    assert (r["completed"], r["failed"], r["num_requests"]) == (1, 5, 6)
    assert r["total_output_tokens"] == 1 and r["first_error"] == errors[1]


def test_max_concurrency_holds_requests_until_a_place_frees():
    clock = FakeClock()
    inflight, peak = [0], [0]

    def handler(request):
        inflight[0] += 1
        peak[0] = max(peak[0], inflight[0])
        events = [text_chunk("a"), text_chunk("b"), usage_chunk(1, 2), "[DONE]"]
        return httpx.Response(200, stream=Events(
            events, clock, on_close=lambda: inflight.__setitem__(0, inflight[0] - 1)))

    run = _send(handler, 5, concurrency=2, clock=clock)
    assert peak[0] == 2 and all(o.error is None for o in run.outputs)
    assert run.sent[:2] == [0.0, 0.0]
    # each later request is sent when a place frees: at the earliest unused finish time
    finishes = sorted(o.finish_time for o in run.outputs)
    assert run.sent[2:] == finishes[:3]
    assert all(o.first_token_time > s for o, s in zip(run.outputs, run.sent))


def test_latencies_count_from_the_scheduled_arrival():
    clock = FakeClock()
    events = [text_chunk("a"), usage_chunk(1, 1), "[DONE]"]
    run = _send(lambda request: httpx.Response(200, stream=Events(events, clock)), 3,
                offsets=[0.0, 2.0, 2.0], clock=clock)
    assert run.sent == [0.0, 2.0, 2.0]
    assert all(o.first_token_time >= s for o, s in zip(run.outputs, run.sent))
    assert run.duration == max(o.finish_time for o in run.outputs)


def test_served_model_name_and_api_key():
    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        if request.url.path != "/v1/models":
            return httpx.Response(404)
        return httpx.Response(200, json={"object": "list", "data": [{"id": "first"},
                                                                     {"id": "second"}]})

    assert served_model_name("http://s", "k", httpx.MockTransport(handler)) == "first"
    assert served_model_name("http://s", None, httpx.MockTransport(handler)) == "first"
    assert seen == ["Bearer k", None]
    with pytest.raises(ValueError, match="HTTP 500: down.*--served-model-name"):
        served_model_name("http://s", None, httpx.MockTransport(
            lambda request: httpx.Response(500, json={"object": "error", "message": "down"})))
    with pytest.raises(ValueError, match="listed no model"):
        served_model_name("http://s", None, httpx.MockTransport(
            lambda request: httpx.Response(200, json={"data": []})))
