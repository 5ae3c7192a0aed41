"""The OpenAI-compatible server on the tiny Llama (tests/tiny_server.py) when things go wrong,
and its other endpoints: bad input gets OpenAI's error body, the queue limit a 503, an engine
fault fails its requests only; /health while loading, /metrics, /flush_cache, /v1/models,
/tokenize and /detokenize, and the bench's OpenAI backend against it. Every workload ends with the engine idle and clean."""

from __future__ import annotations

import asyncio
import json

import httpx

BAD = [  # (endpoint, body, status, param)
    ("completions", {"prompt": "x", "logit_bias": {"a": 2}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"07": 2}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"1": 200}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"301": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "echo": "yes"}, 400, "echo"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400,
     "echo"),
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
    ("completions", {"prompt": "x", "seed": 2**63}, 400, "seed"),
    ("completions", {"prompt": "x", "seed": "7"}, 400, "seed"),
    ("completions", {"prompt": "x", "user": 5}, 400, "user"),
    ("completions", {"prompt": "x", "include_stop_str_in_output": "yes"}, 400,
     "include_stop_str_in_output"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": "x", "model": "gpt-4", "frobnicate": 1}, 404, "model"),
    ("completions", {"prompt": "x", "stream": True,
                     "stream_options": {"include_usage": True, "continuous_usage_stats": 1}},
     400, "stream_options"),
    ("completions", [1, 2], 400, None),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400,
     "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 500}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "name": 3}]}, 400,
     "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 2, "max_tokens": "2"}, 400, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages"),
    ("chat/completions", {"messages": [
        {"role": "assistant", "content": "x", "tool_calls": [{"id": "call_1"}]}]}, 400,
     "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x " * 200}]}, 400,
     "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "xml"}}, 400, "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}}, 400,
     "response_format"),
    ("completions", {"prompt": "x", "regex": "[a-"}, 400, "regex"),
    ("completions", {"prompt": "x", "regex": "a+", "ebnf": "root ::= \"a\""}, 400, "regex"),
    ("completions", {"prompt": "x", "regex": "a+", "min_tokens": 2}, 400, "min_tokens"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 301]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens"),
    ("/detokenize", {"tokens": "ab"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
]


def test_bad_input_gets_the_openai_error_body(tiny_server, clean_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as http:
        for endpoint, body, status, param in BAD:
            res = http.post(endpoint if endpoint[0] == "/" else f"/v1/{endpoint}", json=body)
            assert res.status_code == status, (body, res.text)
            error = res.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert error["param"] == param, (body, error)
        res = http.post("/v1/completions", content=b"{not json",
                        headers={"content-type": "application/json"})
        assert res.status_code == 400 and "not valid JSON" in res.json()["error"]["message"]
        assert http.get("/v1/nothing").status_code == 404
        for body, code, field in (  # OpenAI's codes, and the field names the request used
                ({"prompt": [1] * 120, "max_tokens": 16}, "context_length_exceeded", "max_tokens"),
                ({"prompt": "x", "model": "gpt-4"}, "model_not_found", "gpt-4")):
            error = http.post("/v1/completions", json=body).json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", code), error
            assert field in error["message"]
        error = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 500}).json()
        assert error["error"]["code"] == "context_length_exceeded"
        assert "max_completion_tokens (500)" in error["error"]["message"], error
        error = http.post("/v1/chat/completions", json={  # no max_tokens asked: none named
            "messages": [{"role": "user", "content": "x " * 200}]}).json()["error"]
        assert error["code"] == "context_length_exceeded" and "max" not in error["message"]
        ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        ok = http.post("/v1/chat/completions", json={  # a no-op value is accepted
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "echo": False})
        assert ok.status_code == 200, ok.text
        ids = http.post("/tokenize", json={"prompt": "héllo"}).json()["tokens"]
        parts = [{"type": "text", "text": "the"}, {"type": "text", "text": "cat"}]
        assert (http.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]})
                .json()["tokens"] == http.post("/tokenize", json={
                    "messages": [{"role": "user", "content": "the\ncat"}]}).json()["tokens"])
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "héllo"}
        assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


async def _burst(base_url: str, count: int) -> list[tuple[int, int]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        async def one(i: int) -> tuple[int, int]:
            res = await http.post("/v1/completions", json={
                "prompt": [i + 1, 5], "max_tokens": 6, "ignore_eos": True, "temperature": 0})
            body = res.json()
            return res.status_code, body["usage"]["completion_tokens"] if res.status_code == 200 \
                else body["error"]["code"]

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_queue_limit_rejects_the_excess_with_503(tiny_server, clean_server):
    loop = tiny_server.app.state.engine_loop
    loop.max_queued_requests = 4
    try:
        results = asyncio.run(_burst(tiny_server.base_url, 50))
    finally:
        loop.max_queued_requests = None
    ok = [r for r in results if r[0] == 200]
    assert ok and all(n == 6 for _, n in ok)
    rejected = [r for r in results if r[0] != 200]
    assert rejected and all(r == (503, "queue_full") for r in rejected)
    assert len(ok) + len(rejected) == 50


def test_an_engine_fault_fails_its_requests_and_the_server_goes_on(tiny_server, clean_server):
    detok = tiny_server.engine._detok
    update_all = detok.update_all  # a step's requests detokenized together

    def faulty(reqs):
        if any(req.prompt_ids[0] == 299 for req in reqs):
            raise RuntimeError("injected fault")
        update_all(reqs)

    detok.update_all = faulty
    try:
        with httpx.Client(base_url=tiny_server.base_url, timeout=60) as http:
            res = http.post("/v1/completions", json={"prompt": [299, 3], "max_tokens": 4})
            assert res.status_code == 500
            assert "injected fault" in res.json()["error"]["message"]
            with http.stream("POST", "/v1/completions", json={"prompt": [299, 3], "max_tokens": 4,
                                                              "stream": True}) as res:
                lines = [ln for ln in res.iter_lines() if ln]
            assert "injected fault" in json.loads(lines[-2][6:])["error"]["message"]
            assert lines[-1] == "data: [DONE]"  # as vLLM's stream ends after an error
            detok.update_all = update_all
            ok = http.post("/v1/completions", json={"prompt": [298, 3], "max_tokens": 4,
                                                    "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    finally:
        detok.update_all = update_all


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


def test_metrics_flush_cache_models_and_health(tiny_server, clean_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 3,
                                                  "ignore_eos": True}).status_code == 200
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
        assert models["data"][0]["max_model_len"] == 128  # the context (the pool has 2048)
        assert http.post("/tokenize", json={"prompt": "x"}).json()["max_model_len"] == 128
        card = http.get("/v1/models/tiny").json()
        assert card["id"] == "tiny" and card["object"] == "model"
        missing = http.get("/v1/models/gpt-4")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
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
        assert tiny_server.on_engine(lambda e: e.prefix_cache.evictable_size) == 0

        body = {"prompt": [3, 4], "max_tokens": 100, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as res:
            lines = res.iter_lines()
            next(lines)  # running now
            busy = http.post("/flush_cache")
            assert busy.status_code == 400 and "running" in busy.json()["error"]["message"]
            assert [ln for ln in lines if ln][-1] == "data: [DONE]"


def test_bench_openai_backend_against_this_server(tiny_server, tiny_server_dir, tmp_path,
                                                  clean_server):
    from minijax_serve.cli import main

    out = tmp_path / "bench.jsonl"
    assert main(["bench", "--backend", "openai", "--base-url", tiny_server.base_url,
                 "--model", str(tiny_server_dir), "--dataset", "random", "--num-prompts", "12",
                 "--random-input-len", "8", "--random-output-len", "6", "--random-range-ratio",
                 "1", "--max-concurrency", "4", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["backend"] == "openai" and r["served_model_name"] == "tiny"
    assert r["completed"] == r["num_requests"] == 12 and r["failed"] == 0
    assert r["total_output_tokens"] == 12 * 6 and r["total_input_tokens"] == 12 * 8
    assert r["mean_ttft_ms"] > 0 and r["mean_itl_ms"] > 0


def test_a_message_s_name_reaches_the_chat_template():
    from minijax_serve.frontend.inputs import chat_prompt_ids
    from minijax_serve.server.messages import chat_messages
    from tests.frontend.test_detokenizer import byte_fallback_tokenizer

    tok = byte_fallback_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m.get('name', '-') }}:"
                         "{{ m['content'] }};{% endfor %}")
    messages = chat_messages([{"role": "user", "content": "hi", "name": "ann"},
                              {"role": "user", "content": [{"type": "text", "text": "yo"}]}])
    assert tok.decode(chat_prompt_ids(tok, messages)) == "ann:hi;-:yo;"
