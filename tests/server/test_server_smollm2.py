"""The server on the real SmolLM2 through the ``openai`` client: completions and chat,
greedy, token-identical to HuggingFace; the chat answer knows Paris and stops at the template's
end of turn; /tokenize and /detokenize are HF's tokenizer and template, and ids from /tokenize
answer as the chat does; response_format and regex give the library's structured output (the
session's shared engine, idle and clean afterwards)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from minijax_serve import SamplingParams
from minijax_serve.frontend.inputs import chat_prompt_ids
from tests import hf_reference
from tests.server_util import running_server
from tests.engine.test_engine import assert_idle_and_clean
from tests.models.test_smollm2 import TEXTS
from tests.tiny_server import GREEDY, token_ids

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


def test_tokenize_is_hf_tokenizer_and_template(server, client, smollm2_dir):
    hf_tok = AutoTokenizer.from_pretrained(smollm2_dir)  # its own copy, not the engine's
    text = TEXTS[0]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        res = http.post("/tokenize", json={"model": "smollm2", "prompt": text,
                                           "return_token_strs": True}).json()
        assert res["tokens"] == hf_tok.encode(text) and res["count"] == len(res["tokens"])
        assert res["token_strs"] == hf_tok.convert_ids_to_tokens(res["tokens"])
        assert res["max_model_len"] == 256
        back = http.post("/detokenize", json={"tokens": res["tokens"]}).json()
        assert back == {"prompt": text}
        chat = http.post("/tokenize", json={"messages": messages}).json()
        ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert chat["tokens"] == ref["input_ids"] and chat["token_strs"] is None
        bare = http.post("/tokenize", json={"messages": messages,
                                            "add_generation_prompt": False}).json()["tokens"]
        assert len(bare) < len(chat["tokens"]) and chat["tokens"][:len(bare)] == bare
    # a client that builds the chat prompt from /tokenize gets the chat's answer
    by_ids = client.completions.create(model="smollm2", prompt=chat["tokens"], max_tokens=NEW,
                                       temperature=0)
    by_chat = client.chat.completions.create(model="smollm2", messages=messages,
                                             max_tokens=NEW, temperature=0)
    assert by_ids.choices[0].text == by_chat.choices[0].message.content


def test_response_format_and_regex_are_the_library_s_structured_output(server, client,
                                                                      smollm2_engine):
    messages = [{"role": "user", "content": "Describe a person named Alice, aged 30, as JSON."}]
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = chat_prompt_ids(smollm2_engine.tokenizer, messages)
    params = SamplingParams(max_new_tokens=40, json_schema=schema)
    # on the loop's thread: it alone may touch the engine while the server runs
    want = server.on_engine(lambda engine: engine.generate([prompt], params))[0]
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    res = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40,
                                         temperature=0, response_format=person)
    assert res.choices[0].message.content == want.text and res.choices[0].finish_reason == "stop"
    assert set(json.loads(want.text)) == {"name", "age"}
    city = [{"role": "user", "content": "Give the capital of France as a JSON object with the "
                                        "key city."}]
    anything = client.chat.completions.create(model="smollm2", messages=city, max_tokens=40,
                                              temperature=0,
                                              response_format={"type": "json_object"})
    assert json.loads(anything.choices[0].message.content) == {"city": "Paris"}
    year = "The year after 1999 is"
    digits = client.completions.create(model="smollm2", prompt=year, max_tokens=8,
                                       temperature=0, extra_body={"regex": " [0-9]{4}"})
    regex = SamplingParams(max_new_tokens=8, regex=" [0-9]{4}")
    want = server.on_engine(lambda engine: engine.generate(year, regex))[0]
    assert digits.choices[0].text == want.text and re.fullmatch(" [0-9]{4}", want.text)
