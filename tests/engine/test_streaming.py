"""Streaming: deltas that concatenate exactly to the final text and ids in every scheduler mode,
text held back before a possible stop string or inside an incomplete UTF-8 character
(multi-byte and byte-fallback tokens), and one loop shared by step / generate / stream. The
detokenizer's own rules are tested in test_detokenizer.py."""

from __future__ import annotations

import shutil

import pytest

from minijax_serve import Engine, SamplingParams
from tests.scheduler.test_chunked_prefill import TINY, prompts_and_refs  # noqa: F401
from tests.frontend.test_detokenizer import byte_fallback_tokenizer
from tests.engine.test_engine import assert_idle_and_clean


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
