"""Issue 47's findings 5-7: the API key from a file or MINIJAX_SERVE_API_KEY (never
OPENAI_API_KEY, never in a repr); JSON endpoints refuse other content types and cross-origin
pages (CORS only for --allowed-origins); an unsatisfiable schema is a 400 before queueing, a
405 names what is allowed, /openapi.json describes every body, aborts of waiting sequences
are counted, and a model directory's bad config.json field or corrupt tokenizer.json is named
at startup."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from minijax_serve import Engine
from minijax_serve.cli import build_parser
from minijax_serve.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from minijax_serve.server.tokenize import DETOKENIZE_FIELDS, TOKENIZE_FIELDS
from tests.server.test_server_hardening import hardened_server  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak  # noqa: E402

SCHEMA_FREE = {"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}}


def test_the_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    """Finding 5."""
    from minijax_serve.server.launch import server_config
    from minijax_serve.server.server_config import API_KEY_ENV, resolve_api_key

    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key(None, None, {API_KEY_ENV: "from-env"}) == "from-env"
    assert resolve_api_key(None, None, {"OPENAI_API_KEY": "a client's"}) is None
    assert resolve_api_key(None, str(key_file), {API_KEY_ENV: "from-env"}) == "from-file"
    assert resolve_api_key("from-flag", None, {API_KEY_ENV: "from-env"}) == "from-flag"
    for flag, file, env, message in (("a", str(key_file), {}, "not both"),
                                     (None, str(tmp_path / "none"), {}, "cannot read"),
                                     (None, None, {API_KEY_ENV: ""}, "empty")):
        with pytest.raises(ValueError, match=message):
            resolve_api_key(flag, file, env)
    monkeypatch.setenv(API_KEY_ENV, "sesame-env")
    config = server_config(build_parser().parse_args(["serve", "--model", "m"]))
    assert config.api_key == "sesame-env" and "sesame" not in repr(config)
    config = server_config(build_parser().parse_args(
        ["serve", "--model", "m", "--api-key-file", str(key_file)]))
    assert config.api_key == "from-file"


def test_json_endpoints_refuse_other_content_types_and_foreign_origins(tiny_server,
                                                                       clean_server):
    """Finding 6: what a page of another origin can send without a preflight is refused."""
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            res = http.post(path, content=body, headers={"content-type": "text/plain"})
            assert res.status_code == 415 and res.json()["error"]["code"] == \
                "unsupported_media_type"
        evil = {"origin": "http://evil.example"}
        for path in ("/v1/completions", "/flush_cache", "/v1/models"):
            res = http.request("GET" if "models" in path else "POST", path, headers={
                **evil, "content-type": "application/json"}, content=body)
            assert res.status_code == 403 and "access-control-allow-origin" not in res.headers
        own = {"origin": tiny_server.base_url, "content-type": "application/json"}
        assert http.post("/v1/completions", content=body, headers=own).status_code == 200


def test_allowed_origins_turn_cors_on(hardened_server):
    good = {"origin": "http://good.example"}
    with httpx.Client(base_url=hardened_server.base_url, timeout=30) as http:
        res = http.get("/v1/models", headers=good)
        assert res.status_code == 200
        assert res.headers["access-control-allow-origin"] == "http://good.example"
        preflight = http.options("/v1/completions", headers={
            **good, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
        assert preflight.status_code == 200
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert http.get("/v1/models", headers={"origin": "http://evil.example"}).status_code \
            == 403


def test_an_unsatisfiable_schema_is_refused_before_queueing(tiny_server, clean_server):
    """Finding 7: {"$ref": "#"} admits no string (a schema llguidance cannot tell, one whose
    every string is infinite, ends at max_tokens: docs/server_hardening.md)."""
    submitted = tiny_server.on_engine(lambda e: e.stats()["prompt_tokens"])
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as http:
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "x"}]})):
            res = http.post(path, json={**body, **SCHEMA_FREE, "max_tokens": 4})
            error = res.json()["error"]
            assert res.status_code == 400 and error["param"] == "response_format", error
            assert "no output satisfies" in error["message"]
    assert tiny_server.on_engine(lambda e: e.stats()["prompt_tokens"]) == submitted  # none


def test_405_names_the_methods_allowed(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as http:
        for method, path, allowed in (("GET", "/flush_cache", "POST"),
                                      ("GET", "/v1/completions", "POST"),
                                      ("POST", "/health", "GET")):
            res = http.request(method, path)
            assert res.status_code == 405 and res.headers["allow"] == allowed
            assert res.json()["error"]["message"] == "Method Not Allowed"


def test_openapi_describes_every_request_body(tiny_server):
    spec = httpx.get(tiny_server.base_url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, fields in (("/v1/completions", COMPLETION_FIELDS),
                         ("/v1/chat/completions", CHAT_FIELDS),
                         ("/tokenize", TOKENIZE_FIELDS), ("/detokenize", DETOKENIZE_FIELDS)):
        body = spec["paths"][path]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
        kinds = [schemas[k["$ref"].split("/")[-1]] for k in schemas[ref].get("anyOf", [])]
        kinds = kinds or [schemas[ref]]  # /tokenize: a text or a conversation
        assert body["required"] and {f for k in kinds for f in k["properties"]} == fields, path
        assert all(kind["additionalProperties"] is False for kind in kinds)
        assert {"400", "413", "415"} <= set(spec["paths"][path]["post"]["responses"])


async def _streams(base_url: str, running: int, waiting: int, on_engine) -> None:
    """``running`` streams that fill every slot, then ``waiting`` more, closed while they wait."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        async def stream(i: int, close_early: bool) -> None:
            body = {"prompt": [i + 1, 9], "max_tokens": 60, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as res:
                assert res.status_code == 200
                if not close_early:
                    async for _ in res.aiter_lines():
                        pass

        tasks = [asyncio.ensure_future(stream(i, False)) for i in range(running)]
        while on_engine(lambda e: len(e.scheduler.holders())) < running:
            await asyncio.sleep(0.01)
        early = [asyncio.ensure_future(stream(running + i, True)) for i in range(waiting)]
        await asyncio.gather(*early, *tasks)


def test_aborts_of_waiting_sequences_are_counted(tiny_server, clean_server):
    """Finding 7: every sequence submitted ends in one finish reason of /metrics."""
    def counts() -> dict[str, float]:
        return soak.counters(httpx.get(tiny_server.base_url + "/metrics").text)

    before = counts()
    asyncio.run(_streams(tiny_server.base_url, 16, 3, tiny_server.on_engine))
    tiny_server.on_engine(lambda e: None)  # the loop has handed everything over
    after = counts()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta["submitted"] == 19 and delta["abort"] == 3 and delta["length"] == 16
    assert after["submitted"] == sum(v for k, v in after.items() if k != "submitted")


def test_startup_names_the_file_and_field(tiny_server_dir, tmp_path):
    """Finding 7: a bad config.json field, a corrupt tokenizer.json."""
    model = tmp_path / "model"
    shutil.copytree(tiny_server_dir, model)
    config = json.loads((model / "config.json").read_text())
    for field, value, message in (("hidden_size", "sixty-four", "must be an integer"),
                                  ("num_hidden_layers", None, "is missing"),
                                  ("rms_norm_eps", [1e-6], "must be a number"),
                                  ("num_attention_heads", 0, "must be an integer >= 1")):
        bad = {k: v for k, v in config.items() if k != field}
        if value is not None:
            bad[field] = value
        (model / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"config.json: field '{field}' {message}"):
            Engine(model)
    (model / "config.json").write_text(json.dumps(config))
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"tokenizer.json: cannot load the tokenizer: not valid "
                                         r"JSON: Expecting value: line 1"):
        Engine(model)
