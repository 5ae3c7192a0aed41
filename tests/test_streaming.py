"""Streaming: deltas that concatenate exactly to the final text and ids in every scheduler mode,
text held back before a possible stop string or inside an incomplete UTF-8 character
(multi-byte and byte-fallback tokens), and one loop shared by step / generate / stream."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest

from minijax_serve import Engine, SamplingParams
from minijax_serve.detokenizer import Detokenizer, _plain_fast_tokenizer, stop_prefix_len
from minijax_serve.request import FinishReason, Req
from tests.test_chunked_prefill import TINY, prompts_and_refs  # noqa: F401
from tests.test_engine import assert_idle_and_clean

PIECES = ["▁the", "▁a", "▁cat", "▁", "s", "t", ".", ",", "世", "界", "你", "好", "中文", "日本",
          "😀", "🎉", "é", "ñ", "ü", "▁über", "▁naïve", "語", "字", "▁and", "▁or", "!", "?",
          "e", "a", "o", "▁😀", "テ", "ス", "ト", "한", "국", "ß", "ø", "å", "▁x", "y", "z", "q",
          "▁π"]


def byte_fallback_tokenizer(vocab_size: int = 301):
    """A SentencePiece-style tokenizer: <unk>, the 256 byte-fallback tokens <0x00>..<0xFF>, then
    whole pieces (CJK, emoji, accented words) up to ``vocab_size`` ids."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in PIECES[:vocab_size - len(vocab)]:
        vocab[piece] = len(vocab)
    assert len(vocab) == vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def feed(tokenizer, ids: list[int], stop=(), prompt=(1,), **params) -> tuple[Req, list[str]]:
    """Detokenize ``ids`` one token at a time after ``prompt`` (as steps would); the visible text
    after each."""
    req = Req("r", prompt, SamplingParams(max_new_tokens=len(ids), stop=stop, **params), 0, 0.0)
    detok, seen = Detokenizer(tokenizer), []
    for t in ids:
        req.output_ids.append(t)
        req.check_finished(t, frozenset())
        detok.update(req)
        seen.append(req.text[:req.visible_len])
        if req.finished:
            break
    return req, seen


def assert_prefixes(seen: list[str], final: str) -> None:
    for text in seen:
        assert final.startswith(text), (text, final)
    assert seen[-1] == final


TEXT = "the cat 😀 saw 世界 and 中文 naïve über 🎉 π!"


def byte_ids(text: str) -> list[int]:
    return [1 + b for b in text.encode()]


def test_byte_fallback_characters_come_out_whole():
    tok = byte_fallback_tokenizer()
    ids = byte_ids(TEXT)
    req, seen = feed(tok, ids)
    assert req.text == tok.decode(ids) == TEXT
    assert_prefixes(seen, TEXT)
    assert not any(t.endswith("\ufffd") for t in seen)  # nothing incomplete is ever shown
    assert len(set(seen)) < len(seen)  # multi-byte characters were held back


def test_smollm2_tokens_split_emoji_and_cjk(smollm2_engine):
    tok = smollm2_engine.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # characters split across tokens
    req, seen = feed(tok, ids)
    assert req.text == tok.decode(ids) == TEXT
    assert_prefixes(seen, TEXT)
    assert not any(t.endswith("\ufffd") for t in seen)


def test_the_fast_decode_path_gives_the_tokenizers_text(smollm2_engine):
    """SmolLM2's tokenizer is decoded through its backend, skipping transformers' wrapper: the
    same text for any ids; a tokenizer class that rewrites ``_decode`` keeps its own."""
    tok = smollm2_engine.tokenizer
    assert _plain_fast_tokenizer(tok)
    decode = Detokenizer(tok)._decode
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, len(tok), int(rng.integers(1, 16))).tolist()
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)

    class Shouting(type(tok)):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    shouting = copy.copy(tok)
    shouting.__class__ = Shouting
    assert not _plain_fast_tokenizer(shouting)
    ids = tok.encode("the cat sat", add_special_tokens=False)
    assert feed(shouting, ids)[0].text == "THE CAT SAT"


@pytest.mark.parametrize("stop", ["界 and", "cat 😀", "π!", "an", "?"])
def test_stop_strings_straddling_tokens_are_never_shown(stop):
    tok = byte_fallback_tokenizer()
    req, seen = feed(tok, byte_ids(TEXT), stop=[stop, "no such stop"])
    final = TEXT[:TEXT.index(stop)] if stop in TEXT else TEXT
    assert req.text == final
    assert (req.finish_reason == FinishReason.STOP) == (stop in TEXT)
    assert_prefixes(seen, final)


def test_first_output_token_keeps_its_space_after_the_prompt():
    """A Llama-2-style decoder strips the leading space of what it decodes; the first window
    starts on the prompt's last tokens (as vLLM's and SGLang's), so the output's first space
    stays, and a stop string can start with it."""
    from tokenizers import decoders
    tok = byte_fallback_tokenizer()
    tok.backend_tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    piece = tok.convert_tokens_to_ids
    prompt = [piece(p) for p in ("▁the", "▁cat", "▁and", "▁a", "▁cat", "▁or", "▁the")]
    out = [piece(p) for p in ("▁cat", "s", "▁a", "t", "!")]
    assert tok.decode(out) == "cats at!"  # the decoder strips it
    req, seen = feed(tok, out, prompt=prompt)
    assert req.text == " cats at!"
    assert_prefixes(seen, " cats at!")
    req, _ = feed(tok, out, prompt=prompt, stop=[" cats"])
    assert req.text == "" and req.finish_reason == FinishReason.STOP


def test_a_prompt_ending_inside_a_character_gives_no_context():
    """Its last bytes would turn the window's first text into U+FFFD and cut the output's:
    the output is decoded alone then, as it was before the window started on the prompt."""
    tok = byte_fallback_tokenizer()
    prompt = [tok.convert_tokens_to_ids("▁a"), *byte_ids("中")[:2]]  # 中 is E4 B8 AD
    out = [*byte_ids("中")[2:], tok.convert_tokens_to_ids("▁cat")]
    req, seen = feed(tok, out, prompt=prompt)
    assert req.text == tok.decode(out) == "\ufffd cat"
    assert_prefixes(seen, "\ufffd cat")


def test_the_stop_token_is_not_in_the_text():
    tok = byte_fallback_tokenizer()
    req, seen = feed(tok, byte_ids("the cat. saw"), stop_token_ids=byte_ids("."))
    assert req.finish_reason == FinishReason.STOP and req.output_ids == byte_ids("the cat.")
    assert req.text == "the cat"  # the ids keep it, the text does not (vLLM's, SGLang's)
    assert_prefixes(seen, "the cat")
    req, seen = feed(tok, byte_ids("the cat. saw"), stop_token_ids=byte_ids("."),
                     include_stop_str_in_output=True)
    assert req.text == "the cat." and req.finish_reason == FinishReason.STOP
    assert_prefixes(seen, "the cat.")
    req, seen = feed(tok, byte_ids(TEXT), stop=["no such stop", "😀 saw"],
                     include_stop_str_in_output=True)
    assert req.text == "the cat 😀 saw" and req.finish_reason == FinishReason.STOP
    assert_prefixes(seen, "the cat 😀 saw")


def test_stop_strings_wait_for_min_new_tokens():
    """As EOS and stop tokens: a stop string completed before ``min_new_tokens`` output tokens
    does not end the request (vLLM's rule); one completed after it does."""
    tok = byte_fallback_tokenizer()
    ids = byte_ids("cat, a cat, the cat")
    assert feed(tok, ids, stop=["cat"])[0].text == ""
    req, seen = feed(tok, ids, stop=["cat"], min_new_tokens=4)
    assert req.text == "cat, a " and req.finish_reason == FinishReason.STOP
    assert_prefixes(seen, "cat, a ")
    req, _ = feed(tok, ids, stop=["cat"], min_new_tokens=3)  # its last token is the 3rd
    assert req.text == "" and req.finish_reason == FinishReason.STOP


def test_stop_prefix_len():
    assert stop_prefix_len("hello wor", ["world", "xyz"]) == 3
    assert stop_prefix_len("hello w", ["world", "lo wx"]) == 4
    assert stop_prefix_len("hello", ["world"]) == 0
    assert stop_prefix_len("ab", ["b"]) == 0  # a whole stop string is a finish, not a prefix


@pytest.fixture(scope="module")
def llama_bytes(tiny_dir, tmp_path_factory):
    """The tiny Llama with the byte-fallback tokenizer: its outputs mix bytes and pieces."""
    path = tmp_path_factory.mktemp("streaming") / "llama"
    shutil.copytree(tiny_dir["llama"], path)
    byte_fallback_tokenizer().save_pretrained(path)
    return path


MODES = {
    "overlap": {},
    "no-overlap": dict(enable_overlap=False),
    "chunked-mixed": dict(page_size=4, chunked_prefill_size=16, enable_mixed_chunk=True),
    "forced-retract": dict(force_retract_every=3, chunked_prefill_size=32),
}


def stream_all(engine: Engine, prompts, params) -> dict[str, list]:
    outs: dict[str, list] = {}
    for out in engine.stream(prompts, params):
        outs.setdefault(out.request_id, []).append(out)
    return outs


def check_deltas(outs: list) -> None:
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1])
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    assert "".join(o.new_text for o in outs) == final.text
    text = ""
    for o in outs:
        text += o.new_text
        assert o.text == text and final.text.startswith(o.text)


@pytest.fixture(scope="module")
def stopless(llama_bytes, prompts_and_refs):
    """Every prompt's greedy text without stop strings (overlap on), and stop strings that
    straddle two tokens of some of them."""
    short, long, refs = prompts_and_refs
    engine = Engine(llama_bytes, **{**TINY, "skip_tokenizer_init": False})
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    finals = [outs[-1] for outs in stream_all(engine, short + long, params).values()]
    assert [o.token_ids for o in finals] == refs
    assert_idle_and_clean(engine)
    tok, stops = engine.tokenizer, []
    for o in finals[::2]:
        for k in range(4, len(o.token_ids)):
            head = tok.decode(o.token_ids[:k])
            if o.text.startswith(head) and 0 < len(head) < len(o.text) and not head.endswith(" "):
                stops.append(o.text[len(head) - 1:len(head) + 1])  # across the token boundary
                break
    assert len(stops) >= 3
    return finals, stops


@pytest.mark.parametrize("mode", list(MODES))
def test_stream_deltas_in_every_mode(mode, llama_bytes, prompts_and_refs, stopless):
    short, long, _ = prompts_and_refs
    finals, stops = stopless
    engine = Engine(llama_bytes, **{**TINY, "skip_tokenizer_init": False, **MODES[mode]})
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, stop=stops)
    outs = stream_all(engine, short + long, params)
    assert len(outs) == len(finals)
    stopped = 0
    for per_request, ref in zip(outs.values(), finals):
        check_deltas(per_request)
        final = per_request[-1]
        cut = min((ref.text.index(s) for s in stops if s in ref.text), default=None)
        assert final.text == (ref.text if cut is None else ref.text[:cut])
        assert final.token_ids == ref.token_ids[:len(final.token_ids)]
        assert (final.finish_reason == "stop") == (cut is not None)
        stopped += cut is not None
    assert stopped >= len(stops)
    if mode == "forced-retract":
        assert engine.stats()["num_retracted"] > 0
    if mode == "chunked-mixed":
        assert engine.stats()["mixed_steps"] > 0
    assert_idle_and_clean(engine)


def test_one_loop_for_step_generate_and_stream(llama_bytes, prompts_and_refs):
    """Requests added for step() keep their outputs while generate / stream drive the loop:
    the next step() hands them back, with deltas since the last output it handed."""
    short, long, refs = prompts_and_refs
    engine = Engine(llama_bytes, **{**TINY, "skip_tokenizer_init": False})
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    a, b = engine.add_request(short[0], params), engine.add_request(long[0], params)
    seen = {a: [], b: []}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id].append(out)
    early = seen[a][-1]
    generated = engine.generate(short[1], params)
    assert len(generated) == 1 and generated[0].token_ids == refs[1]
    assert generated[0].new_token_ids == refs[1] and generated[0].new_text == generated[0].text
    assert not early.finished  # an output handed earlier is a snapshot
    streamed = list(engine.stream([short[2]], params))
    assert streamed[-1].token_ids == refs[2] and {o.request_id for o in streamed} == {streamed[0].request_id}
    latest = engine.get_output(b)  # a request still known: its output since the last one handed
    seen[b].append(latest)
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    for rid, ref in ((a, refs[0]), (b, refs[len(short)])):
        check_deltas(seen[rid])
        assert seen[rid][-1].token_ids == ref
    assert engine.get_output(a) is None  # read to the end: forgotten
    assert_idle_and_clean(engine)


def test_closing_a_stream_aborts_its_requests(llama_bytes, prompts_and_refs):
    short, long, _ = prompts_and_refs
    engine = Engine(llama_bytes, **{**TINY, "skip_tokenizer_init": False})
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.stream([short[0], []])  # checked when called, before anything is queued
    assert not engine.has_unfinished()
    stream = engine.stream(short + long, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert not engine.has_unfinished()  # queued when iteration starts
    got = [next(stream) for _ in range(5)]
    assert all(not o.finished for o in got)
    stream.close()
    assert engine.stats()["num_aborted"] == len(short + long)
    while engine.has_unfinished():
        assert engine.step() == []  # the aborted requests' outputs went with the stream
    assert_idle_and_clean(engine)


def test_a_request_aborted_inside_the_stream_still_comes_out(llama_bytes, prompts_and_refs):
    """The consumer aborts the other request when one finishes, in the same round of outputs:
    the aborted one's final output (finish_reason "abort") still comes out of the stream."""
    short, _, _ = prompts_and_refs
    engine = Engine(llama_bytes, **{**TINY, "skip_tokenizer_init": False})
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=3, ignore_eos=True)]
    outs: dict[str, list] = {}
    for out in engine.stream(short[:2], params):
        outs.setdefault(out.request_id, []).append(out)
        if out.finish_reason == "length":
            engine.abort(next(rid for rid in outs if rid != out.request_id))
    first, second = outs.values()
    assert second[-1].finish_reason == "length" and first[-1].finish_reason == "abort"
    for per_request in (first, second):
        check_deltas(per_request)
    assert_idle_and_clean(engine)
