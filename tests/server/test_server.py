"""The OpenAI-compatible server on the tiny Llama (tests/tiny_server.py), through the real
``openai`` client: HF-identical greedy tokens, streamed = whole, the chat template, n samples
and logprobs, 200 concurrent streams, disconnects. Every workload ends with the engine idle and
clean."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai

from tests import hf_reference
from tests.frontend.test_detokenizer import byte_fallback_tokenizer
from tests.executor.test_logit_bias import hf_biased_greedy
from tests.tiny_server import GREEDY, NEW, TEMPLATE, token_ids


def test_completions_match_hf_greedy(tiny_client, tiny_prompts, tiny_greedy_refs,
                                     clean_server):
    prompts = tiny_prompts[:8]
    res = tiny_client.completions.create(model="tiny", prompt=prompts, max_tokens=NEW,
                                         logprobs=0, **GREEDY)
    assert res.object == "text_completion" and res.model == "tiny" and res.id.startswith("cmpl-")
    assert [c.index for c in res.choices] == list(range(8))
    for choice, ref in zip(res.choices, tiny_greedy_refs["llama"]):
        assert token_ids(choice.logprobs.tokens) == ref
        assert choice.finish_reason == "length"
        lp = choice.logprobs  # logprobs 0: the chosen token alone (OpenAI's "up to k + 1")
        assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    assert res.usage.prompt_tokens == sum(map(len, prompts))
    assert res.usage.completion_tokens == 8 * NEW


def test_streamed_chunks_concatenate_to_the_whole_answer(tiny_client, clean_server):
    kwargs = dict(model="tiny", prompt="the cat", max_tokens=NEW, logprobs=2, **GREEDY)
    whole = tiny_client.completions.create(**kwargs).choices[0]
    chunks = list(tiny_client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.text
    streamed = [t for c in chunks[:-1] if c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.logprobs.tokens
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_chat_matches_hf_over_the_template(tiny_client, tiny_server_dir, clean_server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    tok = byte_fallback_tokenizer()
    prompt = tok.encode(tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                                add_generation_prompt=True),
                        add_special_tokens=False)
    ref = hf_reference.greedy(tiny_server_dir, [prompt], NEW)[0]
    res = tiny_client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW,
                                              logprobs=True, top_logprobs=3, **GREEDY)
    choice = res.choices[0]
    assert res.object == "chat.completion" and choice.message.role == "assistant"
    assert token_ids([e.token for e in choice.logprobs.content]) == ref
    assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
    assert res.usage.prompt_tokens == len(prompt)

    chunks = list(tiny_client.chat.completions.create(model="tiny", messages=messages,
                                                      max_tokens=NEW, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"

    # the next turn sends back the answer's message as the SDK returns it (null refusal, ...)
    turn = [*messages, choice.message.model_dump(), {"role": "user", "content": "and?"}]
    assert {"refusal", "tool_calls", "annotations"} <= set(turn[2])
    res = tiny_client.chat.completions.create(model="tiny", messages=turn, max_tokens=2, **GREEDY)
    plain = [*messages, {"role": "assistant", "content": choice.message.content}, turn[3]]
    assert res.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(
        plain, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False))


def test_n_samples_and_seeded_sampling(tiny_client, clean_server):
    kwargs = dict(model="tiny", prompt=[[5, 6, 7], [9, 10]], max_tokens=8, n=2, temperature=1.0,
                  seed=7, extra_body={"ignore_eos": True})
    res = tiny_client.completions.create(**kwargs)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]  # prompt i's samples at 2i, 2i + 1
    again = tiny_client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in res.choices]  # seeded
    assert res.usage.completion_tokens == 32 and res.usage.prompt_tokens == 5
    wide = tiny_client.completions.create(**{**kwargs, "seed": -1}, logprobs=1)
    seeded = tiny_client.completions.create(**{**kwargs, "seed": 2**32 - 1}, logprobs=1)
    assert [c.text for c in wide.choices] == [c.text for c in seeded.choices]  # mod 2**32
    tops = [(t, v, top) for c in wide.choices for t, v, top in
            zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs)]
    assert all(top[t] == v and len(top) in (1, 2) for t, v, top in tops)  # the chosen is in
    assert {len(top) for _, _, top in tops} == {1, 2}  # and the top 1 besides, when not it


def test_logit_bias_matches_hf_and_steers_chat(tiny_client, hf_llama, tiny_prompts,
                                               tiny_greedy_refs, clean_server):
    prompt, first = tiny_prompts[3], tiny_greedy_refs["llama"][3][0]
    ref = hf_biased_greedy(hf_llama, [prompt], 8, {first: -100.0})[0]
    assert ref is not None and ref[0] != first
    res = tiny_client.completions.create(model="tiny", prompt=prompt, max_tokens=8, logprobs=0,
                                         logit_bias={str(first): -100}, **GREEDY)
    assert token_ids(res.choices[0].logprobs.tokens) == ref
    chat = tiny_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the cat"}], max_tokens=5,
        logprobs=True, logit_bias={"5": 100}, **GREEDY)
    assert token_ids([e.token for e in chat.choices[0].logprobs.content]) == [5] * 5


def test_echo_scores_the_prompt_as_hf(tiny_client, hf_llama, tiny_prompts, tiny_greedy_refs,
                                      clean_server):
    prompt = tiny_prompts[5]
    res = tiny_client.completions.create(model="tiny", prompt=prompt, max_tokens=3, logprobs=2,
                                         echo=True, **GREEDY)
    lp = res.choices[0].logprobs
    assert token_ids(lp.tokens) == prompt + tiny_greedy_refs["llama"][5][:3]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ours = [{t: v, **{int(k.removeprefix("token_id:")): x for k, x in top.items()}}
            for t, v, top in zip(prompt[1:], lp.token_logprobs[1:], lp.top_logprobs[1:])]
    ref = hf_reference.log_softmax_rows(hf_llama, prompt, 1)
    hf_reference.assert_logprobs_match(ours, prompt[1:], ref, 2)
    assert res.usage.prompt_tokens == len(prompt) and res.usage.completion_tokens == 3

    kwargs = dict(model="tiny", prompt="the cat", max_tokens=4, **GREEDY)
    plain = tiny_client.completions.create(**kwargs).choices[0].text
    echoed = tiny_client.completions.create(echo=True, **kwargs).choices[0].text
    assert echoed == "the cat" + plain
    chunks = list(tiny_client.completions.create(echo=True, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == echoed
    kwargs.update(prompt=prompt, max_tokens=3, logprobs=2, echo=True)
    chunks = list(tiny_client.completions.create(stream=True, **kwargs))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs

    kwargs.update(max_tokens=0)  # the prompt alone, scored (a token is generated and dropped)
    scored = tiny_client.completions.create(**kwargs)
    assert token_ids(scored.choices[0].logprobs.tokens) == prompt
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(prompt)]
    assert scored.choices[0].finish_reason == "length" and scored.usage.completion_tokens == 0
    chunks = list(tiny_client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == scored.choices[0].text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == scored.choices[0].logprobs.tokens


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


def test_200_concurrent_streams(tiny_server, clean_server):
    lengths = [1 + i % 9 for i in range(200)]
    results = asyncio.run(_stream_all(tiny_server.base_url, lengths))
    assert [n for _, n in results] == lengths

    def all_free(engine):
        engine.check_invariants()
        engine.flush_cache()
        return engine.allocator.num_free == engine.allocator.total_pages

    assert tiny_server.on_engine(all_free)


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


def test_disconnected_clients_are_aborted(tiny_server, tiny_client, clean_server):
    before = tiny_server.on_engine(lambda e: e.stats()["num_aborted"])
    done = asyncio.run(_disconnect_some(tiny_server.base_url))
    assert [n for n, _ in done] == [100, -1, 100, -1, 100, -1]
    for i in (0, 2, 4):  # the others finished as if alone
        alone = tiny_client.completions.create(model="tiny", prompt=[i + 3, 4], max_tokens=100,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert done[i][1] == alone.choices[0].text
    for _ in range(500):  # the aborts reach the engine loop within a tick or so
        if tiny_server.on_engine(lambda e: e.stats()["num_aborted"]) - before == 3:
            break
    assert tiny_server.on_engine(lambda e: e.stats()["num_aborted"]) - before == 3


def test_a_client_gone_before_its_stream_starts_is_aborted(tiny_server, clean_server):
    """The client hangs up while the request's grammar compiles (on a worker thread), before
    its stream's first event: the request is aborted all the same."""
    engine, port = tiny_server.engine, int(tiny_server.base_url.rsplit(":", 1)[1])

    def aborted() -> int:
        return tiny_server.on_engine(lambda e: e.stats()["num_aborted"])

    before, compile_grammar = aborted(), engine.check_grammar
    client = socket.create_connection(("127.0.0.1", port))

    def hang_up_first(params):
        client.close()
        time.sleep(0.5)  # the server's event loop sees the disconnect meanwhile
        return compile_grammar(params)

    body = json.dumps({"prompt": [5, 6], "max_tokens": 100, "stream": True,
                       "regex": "[a-z]{99}"}).encode()
    engine.check_grammar = hang_up_first
    try:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                       % (len(body), body))
        for _ in range(1000):  # submitted after the grammar, then aborted within a tick or so
            if aborted() > before:
                break
            time.sleep(0.01)
    finally:
        engine.check_grammar = compile_grammar
    assert aborted() == before + 1


def test_usage_counts_cached_prompt_tokens_and_streams_running_usage(tiny_client, clean_server):
    prompt = list(range(200, 240))  # no other test's prefix
    first, again = (tiny_client.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                                   **GREEDY) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < len(prompt)
    assert again.choices[0].text == first.choices[0].text
    chunks = list(tiny_client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, stream=True, logprobs=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    tokens = 0
    for chunk in chunks[:-1]:  # every chunk: the usage so far
        tokens += len(chunk.choices[0].logprobs.tokens)
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (len(prompt), tokens)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == tokens == 6
    assert tiny_client.models.retrieve("tiny").id == "tiny"
