"""The server on the real SmolLM2 through the ``openai`` client: completions and chat,
greedy, token-identical to HuggingFace; the chat answer knows Paris and stops at the template's
end of turn (the session's shared engine, idle and clean afterwards)."""

from __future__ import annotations

import openai
import pytest

from minijax_serve.inputs import chat_prompt_ids
from tests import hf_reference
from tests.server_util import running_server
from tests.test_engine import assert_idle_and_clean
from tests.tiny_server import GREEDY, token_ids
from tests.test_smollm2 import TEXTS

NEW = 16


@pytest.fixture(scope="module")
def server(smollm2_engine):
    with running_server(smollm2_engine, served_model_name="smollm2") as running:
        yield running
    assert_idle_and_clean(smollm2_engine)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_completions_match_hf(client, smollm2_engine, smollm2_dir, hf_smollm2):
    prompts = TEXTS[:3]
    tok = smollm2_engine.tokenizer
    refs = hf_reference.greedy(smollm2_dir, [tok.encode(p) for p in prompts], NEW,
                               model=hf_smollm2)
    res = client.completions.create(model="smollm2", prompt=prompts, max_tokens=NEW, logprobs=1,
                                    **GREEDY)
    for choice, ref in zip(res.choices, refs):
        assert token_ids(choice.logprobs.tokens) == ref
        assert choice.text == tok.decode(ref, skip_special_tokens=True)


def test_chat_matches_hf_and_ends_its_turn(client, smollm2_engine, smollm2_dir, hf_smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = chat_prompt_ids(smollm2_engine.tokenizer, messages)
    ref = hf_reference.greedy(smollm2_dir, [ids], NEW, model=hf_smollm2)[0]
    res = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=NEW,
                                         logprobs=True, temperature=0,
                                         extra_body={"return_tokens_as_token_ids": True})
    got = token_ids([e.token for e in res.choices[0].logprobs.content])
    assert got == ref[:len(got)]  # HF ignores EOS; the server stops at the end of turn
    answer = res.choices[0].message.content
    assert "Paris" in answer and "<|im_end|>" not in answer
    streamed = client.chat.completions.create(model="smollm2", messages=messages,
                                              max_tokens=NEW, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer
