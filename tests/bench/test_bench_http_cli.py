"""``bench --backend openai`` on the command line: the flag errors, and whole runs through
``main`` with tests/bench/test_bench_http.py's canned server swapped in for the transport."""

from __future__ import annotations

import functools
import json
import re

import httpx
import pytest

from minijax_serve.bench import openai_backend
from minijax_serve.bench.http_client import run_http, served_model_name
from minijax_serve.cli import main
from tests.bench.test_bench import llama_dir  # noqa: F401  (a config-only Llama)
from tests.bench.test_bench_http import text_chunk, usage_chunk


@pytest.mark.parametrize("flags, message", [
    (["--backend", "openai"], "--backend openai needs --base-url"),
    (["--backend", "openai", "--base-url", "localhost:30000"], "must start with http://"),
    (["--backend", "openai", "--base-url", "http://h:1", "--compare", "page_size=16,32"],
     "--compare .* not with --backend openai"),
    (["--base-url", "http://h:1"], "--base-url is for a server: it needs --backend openai"),
    (["--endpoint", "chat"], "--endpoint is for a server"),
    (["--goodput", "ttft:100", "ttft:200"], "--goodput names a metric twice"),
])
def test_flag_errors(flags, message, capsys):
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err), err


def fake_server(request):
    """A server in a function: every output token one chunk, then usage and [DONE]."""
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
    body = json.loads(request.content)
    assert body["model"] == "fake-model" and body["stream"] is True
    assert request.headers["authorization"] == "Bearer secret"  # $OPENAI_API_KEY
    events = [text_chunk(f" t{i}") for i in range(body["max_tokens"])]
    events += [usage_chunk(len(body["prompt"]), body["max_tokens"]), "[DONE]"]
    return httpx.Response(200, content="".join(f"data: {json.dumps(e) if isinstance(e, dict) else e}"
                                               "\n\n" for e in events).encode())


WORKLOAD = ["--skip-tokenizer-init", "--num-prompts", "5", "--random-input-len", "16",
            "--random-output-len", "8", "--disable-tqdm"]


def test_openai_run_through_main(llama_dir, tmp_path, capsys, monkeypatch):
    transport = httpx.MockTransport(fake_server)
    monkeypatch.setattr(openai_backend, "run_http", functools.partial(run_http,
                                                                      transport=transport))
    monkeypatch.setattr(openai_backend, "served_model_name",
                        functools.partial(served_model_name, transport=transport))
    monkeypatch.setenv("OPENAI_API_KEY", "secret")
    out_json = tmp_path / "runs.jsonl"
    rc = main(["bench", "--model", str(llama_dir), *WORKLOAD, "--backend", "openai",
               "--base-url", "http://fake:30000/", "--max-concurrency", "2", "--repeats", "2",
               "--output-json", str(out_json), "--output-details"])
    assert rc == 0
    rows = [json.loads(line) for line in out_json.read_text().splitlines()]
    assert [r["repeat"] for r in rows] == [0, 1]
    r = rows[0]
    assert (r["backend"], r["base_url"], r["endpoint"]) == ("openai", "http://fake:30000",
                                                           "completions")
    assert r["served_model_name"] == "fake-model" and r["mode"] == "online"
    assert r["completed"] == 5 and r["failed"] == 0
    assert r["total_output_tokens"] == sum(r["details"]["output_lens"])
    assert r["total_input_tokens"] == sum(r["details"]["input_lens"])
    assert r["compare"] is None and r["baseline"] is None
    for engine_only in ("mfu", "kv_pool_tokens", "decode_steps", "engine_config"):
        assert engine_only not in r
    assert "api_key" not in r["workload"] and "secret" not in out_json.read_text()
    printed = capsys.readouterr().out
    assert "Backend: " in printed and "openai (http://fake:30000, completions)" in printed
    assert "Served model:" in printed and "MFU" not in printed and "Engine" not in printed
    assert "openai: " in printed[printed.index(" Repeats (2)"):]


def test_chat_endpoint_needs_a_tokenizer(llama_dir, capsys):
    rc = main(["bench", "--model", str(llama_dir), *WORKLOAD, "--backend", "openai",
               "--base-url", "http://fake:30000", "--endpoint", "chat",
               "--served-model-name", "m"])
    assert rc == 2 and "--endpoint chat" in capsys.readouterr().err
