"""The OpenAI-compatible server on the tiny Llama (byte-fallback tokenizer, a chat template of
its own), through the real ``openai`` client: HF-identical greedy tokens, streamed = whole,
n samples and logprobs, 200 concurrent streams, disconnects, bad input, the queue limit, engine
faults, /metrics and /flush_cache. One in-process server for the module; every workload ends
with the engine idle and clean."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import openai
import pytest

from minijax_serve import Engine
from tests import hf_reference
from tests.server_util import running_server
from tests.test_engine import assert_idle_and_clean
from tests.test_streaming import byte_fallback_tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
CONFIG = dict(max_total_tokens=2048, max_running_requests=16, max_prefill_tokens=128,
              min_token_bucket=16, min_seq_bucket=4, min_kv_bucket=128, context_length=128)
NEW = 24


@pytest.fixture(scope="module")
def model_dir(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("server") / "llama"
    shutil.copytree(tiny_dir["llama"], path)
    tok = byte_fallback_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    engine = Engine(model_dir, **CONFIG)
    with running_server(engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture
def clean(server):
    """Each test's workload leaves the engine idle, with every page and slot back."""
    yield
    server.on_engine(assert_idle_and_clean)


def token_ids(logprobs_tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})


def test_completions_match_hf_greedy(client, tiny_prompts, tiny_greedy_refs, clean):
    prompts = tiny_prompts[:8]
    res = client.completions.create(model="tiny", prompt=prompts, max_tokens=NEW, logprobs=0,
                                    **GREEDY)
    assert res.object == "text_completion" and res.model == "tiny" and res.id.startswith("cmpl-")
    assert [c.index for c in res.choices] == list(range(8))
    for choice, ref in zip(res.choices, tiny_greedy_refs["llama"]):
        assert token_ids(choice.logprobs.tokens) == ref
        assert choice.finish_reason == "length"
    assert res.usage.prompt_tokens == sum(map(len, prompts))
    assert res.usage.completion_tokens == 8 * NEW


def test_streamed_chunks_concatenate_to_the_whole_answer(client, tiny_prompts, clean):
    kwargs = dict(model="tiny", prompt="the cat", max_tokens=NEW, logprobs=2, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.text
    streamed = [t for c in chunks[:-1] if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.logprobs.tokens
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_chat_matches_hf_over_the_template(client, model_dir, clean):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    tok = byte_fallback_tokenizer()
    prompt = tok.encode(tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                                add_generation_prompt=True),
                        add_special_tokens=False)
    ref = hf_reference.greedy(model_dir, [prompt], NEW)[0]
    res = client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW,
                                         logprobs=True, top_logprobs=3, **GREEDY)
    choice = res.choices[0]
    assert res.object == "chat.completion" and choice.message.role == "assistant"
    assert token_ids([e.token for e in choice.logprobs.content]) == ref
    assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
    assert res.usage.prompt_tokens == len(prompt)

    chunks = list(client.chat.completions.create(model="tiny", messages=messages,
                                                 max_tokens=NEW, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_and_seeded_sampling(client, clean):
    kwargs = dict(model="tiny", prompt=[[5, 6, 7], [9, 10]], max_tokens=8, n=2, temperature=1.0,
                  seed=7, extra_body={"ignore_eos": True})
    res = client.completions.create(**kwargs)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]  # prompt i's samples at 2i, 2i + 1
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in res.choices]  # seeded
    assert res.usage.completion_tokens == 32 and res.usage.prompt_tokens == 5


async def _stream_all(base_url: str, lengths: list[int]) -> list[tuple[str, int]]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                timeout=300)

    async def one(i: int, n: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model="tiny", prompt=[i % 250 + 1, 7], max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    try:
        return await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)))
    finally:
        await client.close()


def test_200_concurrent_streams(server, clean):
    lengths = [1 + i % 9 for i in range(200)]
    results = asyncio.run(_stream_all(server.base_url, lengths))
    assert [n for _, n in results] == lengths

    def all_free(engine):
        engine.check_invariants()
        engine.flush_cache()
        return engine.allocator.num_free == engine.allocator.total_pages

    assert server.on_engine(all_free)


async def _disconnect_some(base_url: str) -> list[tuple[int, str]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        async def read(i: int, leave_after: int | None) -> int:
            body = {"prompt": [i + 3, 4], "max_tokens": 100, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            events, text = 0, ""
            async with http.stream("POST", "/v1/completions", json=body) as res:
                async for line in res.aiter_lines():
                    if line.startswith("data: {"):
                        events += 1
                        if leave_after is not None and events >= leave_after:
                            return -1, text  # closing the response drops the connection
                        chunk = json.loads(line[6:])
                        if chunk["usage"] is not None:
                            return chunk["usage"]["completion_tokens"], text
                        text += chunk["choices"][0]["text"]
            return 0, text

        return await asyncio.gather(*(read(i, 3 if i % 2 else None) for i in range(6)))


def test_disconnected_clients_are_aborted(server, client, clean):
    before = server.on_engine(lambda e: e.stats()["num_aborted"])
    done = asyncio.run(_disconnect_some(server.base_url))
    assert [n for n, _ in done] == [100, -1, 100, -1, 100, -1]
    for i in (0, 2, 4):  # the others finished as if alone
        alone = client.completions.create(model="tiny", prompt=[i + 3, 4], max_tokens=100,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert done[i][1] == alone.choices[0].text
    for _ in range(500):  # the aborts reach the engine loop within a tick or so
        if server.on_engine(lambda e: e.stats()["num_aborted"]) - before == 3:
            break
    assert server.on_engine(lambda e: e.stats()["num_aborted"]) - before == 3


BAD = [  # (endpoint, body, status, param)
    ("completions", {"prompt": "x", "logit_bias": {"1": 2}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completions", {"prompt": [1, 999]}, 400, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 500}, 400, "prompt"),
    ("completions", {"prompt": [1] * 120, "max_tokens": 16}, 400, "prompt"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("completions", [1, 2], 400, None),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400,
     "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "json_object"}}, 400, "response_format"),
]


def test_bad_input_gets_the_openai_error_body(server, clean):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for endpoint, body, status, param in BAD:
            res = http.post(f"/v1/{endpoint}", json=body)
            assert res.status_code == status, (body, res.text)
            error = res.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert error["param"] == param, (body, error)
        res = http.post("/v1/completions", content=b"{not json",
                        headers={"content-type": "application/json"})
        assert res.status_code == 400 and "not valid JSON" in res.json()["error"]["message"]
        assert http.get("/v1/nothing").status_code == 404
        ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


async def _burst(base_url: str, count: int) -> list[tuple[int, int]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        async def one(i: int) -> tuple[int, int]:
            res = await http.post("/v1/completions", json={
                "prompt": [i + 1, 5], "max_tokens": 6, "ignore_eos": True, "temperature": 0})
            body = res.json()
            return res.status_code, body["usage"]["completion_tokens"] if res.status_code == 200 \
                else body["error"]["code"]

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_queue_limit_rejects_the_excess_with_503(server, clean):
    loop = server.app.state.engine_loop
    loop.max_queued_requests = 4
    try:
        results = asyncio.run(_burst(server.base_url, 50))
    finally:
        loop.max_queued_requests = None
    ok = [r for r in results if r[0] == 200]
    assert ok and all(n == 6 for _, n in ok)
    rejected = [r for r in results if r[0] != 200]
    assert rejected and all(r == (503, "queue_full") for r in rejected)
    assert len(ok) + len(rejected) == 50


def test_an_engine_fault_fails_its_requests_and_the_server_goes_on(server, clean):
    detok = server.engine._detok
    update = detok.update

    def faulty(req):
        if req.prompt_ids[0] == 299:
            raise RuntimeError("injected fault")
        update(req)

    detok.update = faulty
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            res = http.post("/v1/completions", json={"prompt": [299, 3], "max_tokens": 4})
            assert res.status_code == 500
            assert "injected fault" in res.json()["error"]["message"]
            detok.update = update
            ok = http.post("/v1/completions", json={"prompt": [298, 3], "max_tokens": 4,
                                                    "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    finally:
        detok.update = update


class _Loading:
    """Stands in for an engine while the test holds its load back."""

    tokenizer = None

    def has_unfinished(self) -> bool:
        return False


def test_health_is_503_until_the_engine_is_loaded():
    import threading

    from minijax_serve.server.app import ServerConfig, build_app
    from tests.server_util import serve_app

    release, errors = threading.Event(), []

    def load():
        release.wait(30)
        if errors:
            raise RuntimeError("no weights")
        return _Loading()

    for fail in (False, True):
        errors[:] = [True] if fail else []
        release.clear()
        failures = []
        app = build_app(load, ServerConfig("tiny"), on_load_error=failures.append)
        with serve_app(app) as base, httpx.Client(base_url=base, timeout=30) as http:
            loading = http.get("/health")
            assert loading.status_code == 503 and "loading" in loading.json()["error"]["message"]
            assert http.get("/v1/models").status_code == 503
            release.set()
            assert app.state.engine_loop.ready.wait(30)
            health = http.get("/health")
            if fail:
                assert health.status_code == 503 and "no weights" in health.text
                assert [str(e) for e in failures] == ["no weights"]
            else:
                assert health.status_code == 200 and not failures


def test_metrics_flush_cache_models_and_health(server, clean):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 3,
                                                  "ignore_eos": True}).status_code == 200
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
        text = http.get("/metrics").text
        for name in ("minijax_num_requests_running", "minijax_num_requests_waiting",
                     "minijax_kv_cache_usage", "minijax_cache_hit_rate",
                     "minijax_prompt_tokens_total", "minijax_generation_tokens_total",
                     "minijax_time_to_first_token_seconds_count",
                     "minijax_inter_token_latency_seconds_count"):
            line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
            if name.endswith(("_total", "_count")):
                assert float(line.split()[1]) > 0, line
        assert http.post("/flush_cache").status_code == 200
        assert server.on_engine(lambda e: e.prefix_cache.evictable_size) == 0

        body = {"prompt": [3, 4], "max_tokens": 100, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as res:
            lines = res.iter_lines()
            next(lines)  # running now
            busy = http.post("/flush_cache")
            assert busy.status_code == 400 and "running" in busy.json()["error"]["message"]
            assert [ln for ln in lines if ln][-1] == "data: [DONE]"


def test_bench_openai_backend_against_this_server(server, model_dir, tmp_path, clean):
    from minijax_serve.cli import main

    out = tmp_path / "bench.jsonl"
    assert main(["bench", "--backend", "openai", "--base-url", server.base_url,
                 "--model", str(model_dir), "--dataset", "random", "--num-prompts", "12",
                 "--random-input-len", "8", "--random-output-len", "6", "--random-range-ratio",
                 "1", "--max-concurrency", "4", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["backend"] == "openai" and r["served_model_name"] == "tiny"
    assert r["completed"] == r["num_requests"] == 12 and r["failed"] == 0
    assert r["total_output_tokens"] == 12 * 6 and r["total_input_tokens"] == 12 * 8
    assert r["mean_ttft_ms"] > 0 and r["mean_itl_ms"] > 0
