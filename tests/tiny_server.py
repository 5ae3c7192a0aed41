"""The tiny Llama (byte-fallback tokenizer, a chat template of its own) behind one in-process
OpenAI-compatible server for the whole session, shared by tests/server/test_server.py and
tests/server/test_server_errors.py (a plugin of conftest)."""

from __future__ import annotations

import shutil

import openai
import pytest

from minijax_serve import Engine
from tests.server_util import running_server
from tests.frontend.test_detokenizer import byte_fallback_tokenizer
from tests.engine.test_engine import assert_idle_and_clean

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
CONFIG = dict(max_total_tokens=2048, max_running_requests=16, max_prefill_tokens=128,
              min_token_bucket=16, min_seq_bucket=4, min_kv_bucket=128, context_length=128)
NEW = 24


@pytest.fixture(scope="session")
def tiny_server_dir(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("server") / "llama"
    shutil.copytree(tiny_dir["llama"], path)
    tok = byte_fallback_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_server(tiny_server_dir):
    engine = Engine(tiny_server_dir, **CONFIG)
    with running_server(engine) as running:
        yield running


@pytest.fixture(scope="session")
def tiny_client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture
def clean_server(tiny_server):
    """Each test's workload leaves the engine idle, with every page and slot back."""
    yield
    tiny_server.on_engine(assert_idle_and_clean)


def token_ids(logprobs_tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
