"""Chat: conversations through SmolLM2's own chat template, as generate, streamed, with stop
strings, from the CLI; malformed conversations rejected before anything is queued."""

from __future__ import annotations

import shutil

import pytest

from minijax_serve import Engine, SamplingParams
from minijax_serve.cli import main
from tests.frontend.test_detokenizer import byte_fallback_tokenizer
from tests.engine.test_engine import assert_idle_and_clean

HELLO = [{"role": "user", "content": "What is the capital of France?"}]
COLORS = [{"role": "system", "content": "You answer in one sentence."},
          {"role": "user", "content": "Name three primary colors."}]


def test_chat_is_generate_over_the_template(smollm2_engine):
    tok = smollm2_engine.tokenizer
    params = SamplingParams(max_new_tokens=24)
    ids = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False))
           for c in (HELLO, COLORS)]
    assert smollm2_engine.chat_prompt(HELLO) == ids[0]
    expected = smollm2_engine.generate(ids, params)
    both = smollm2_engine.chat([HELLO, COLORS], params)
    one = smollm2_engine.chat(HELLO, params)
    assert [o.token_ids for o in both] == [o.token_ids for o in expected]
    assert one[0].token_ids == expected[0].token_ids and "Paris" in one[0].text
    assert one[0].finish_reason == "stop" and "<|im_end|>" not in one[0].text
    streamed = list(smollm2_engine.stream(smollm2_engine.chat_prompt(HELLO), params))
    assert "".join(o.new_text for o in streamed) == one[0].text
    cut = smollm2_engine.chat(HELLO, SamplingParams(max_new_tokens=24, stop=["Paris"]))[0]
    assert cut.text == one[0].text[:one[0].text.index("Paris")] and cut.finish_reason == "stop"
    assert_idle_and_clean(smollm2_engine)


@pytest.mark.parametrize("messages,message", [
    ([], r"messages is an empty conversation"),
    ([[]], r"messages\[0\] is an empty conversation"),
    ("hello", r"messages must be a list of messages"),
    ([{"role": "user"}], r"messages\[0\]\['content'\] must be a string, got None"),
    ([{"role": 1, "content": "x"}], r"messages\[0\]\['role'\] must be a string, got 1"),
    (["hi"], r"messages\[0\] must be a mapping with 'role' and 'content', got str"),
    ([HELLO, [("user", "x")]], r"messages\[1\]\[0\] must be a mapping"),
])
def test_malformed_conversations_are_rejected(smollm2_engine, messages, message):
    with pytest.raises(ValueError, match=message):
        smollm2_engine.chat(messages, SamplingParams(max_new_tokens=4))
    assert not smollm2_engine.has_unfinished()
    assert smollm2_engine.chat(HELLO, SamplingParams(max_new_tokens=4))[0].token_ids
    assert_idle_and_clean(smollm2_engine)


def test_chat_needs_a_tokenizer(tiny_dir):
    engine = Engine(tiny_dir["llama"], skip_tokenizer_init=True, max_total_tokens=256)
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        engine.chat(HELLO)
    assert_idle_and_clean(engine)


def test_cli_generate_chat_is_engine_chat(tiny_dir, tmp_path, capsys):
    """The CLI's --chat goes through Engine.chat_prompt: the tiny Llama with a byte-fallback
    tokenizer and a chat template of its own."""
    path = tmp_path / "llama"
    shutil.copytree(tiny_dir["llama"], path)
    tok = byte_fallback_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save_pretrained(path)
    flags = dict(max_total_tokens=1024, max_running_requests=2, context_length=128,
                 min_token_bucket=64, min_kv_bucket=128)
    engine = Engine(path, **flags)
    expected = engine.chat([{"role": "user", "content": "hi there"}],
                           SamplingParams(max_new_tokens=8, ignore_eos=True))[0].text
    args = [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    assert main(["generate", "--model", str(path), "--chat", "--max-new-tokens", "8",
                 "--ignore-eos", *args, "hi there"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert_idle_and_clean(engine)
