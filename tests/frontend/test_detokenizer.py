"""The detokenizer alone, token by token: multi-byte and byte-fallback characters come out
whole, the window starts on the prompt's last tokens, stop strings and stop tokens (held back,
cut, kept with include_stop_str_in_output, waiting for min_new_tokens)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from minijax_serve import SamplingParams
from minijax_serve.core.request import FinishReason, Req
from minijax_serve.frontend.detokenizer import Detokenizer, _plain_fast_tokenizer, stop_prefix_len

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
