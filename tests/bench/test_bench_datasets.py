"""Benchmark datasets beyond ``random``: the ShareGPT reader (truncated files included) and
sampler, and the generated-shared-prefix groups. A word-counting fake stands in for the
tokenizer: no model and no JAX computation."""

from __future__ import annotations

import argparse
import io
import json
from collections import Counter

import numpy as np
import pytest

from minijax_serve.bench.datasets import (DATASETS, DatasetContext, random_id_bound,
                                          sample_generated_shared_prefix, sample_sharegpt)
from minijax_serve.bench.sharegpt_file import iter_json_array, read_sharegpt
from minijax_serve.cli import build_parser


class WordTokenizer:
    """One token per whitespace-separated word (its length as the id); counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [len(word) for word in text.split()]


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def record(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": who, "value": text} for who, text in turns]}


def exchange(rid: str, prompt_words: int, reply_words: int) -> dict:
    return record(rid, ("human", words(prompt_words, rid)), ("gpt", words(reply_words, "r")))


def json_array(records: list[dict]) -> tuple[str, list[int]]:
    """ShareGPT-style text of ``records`` (indented, one per line group) and where each ends."""
    text, ends = "[\n", []
    for i, rec in enumerate(records):
        text += ("" if i == 0 else ",\n") + json.dumps(rec, indent=2, ensure_ascii=False)
        ends.append(len(text))
    return text + "\n]\n", ends


def drain(gen) -> tuple[list, bool]:
    """Every element of an :func:`iter_json_array` generator and its return value."""
    out = []
    while True:
        try:
            out.append(next(gen))
        except StopIteration as stop:
            return out, stop.value


def sharegpt_args(path, num_prompts: int, output_len: int | None = None,
                  max_prompt_len: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(num_prompts=num_prompts, dataset_path=str(path),
                              sharegpt_output_len=output_len,
                              sharegpt_max_prompt_len=max_prompt_len)


def write(tmp_path, records: list[dict], name: str = "sharegpt.json"):
    path = tmp_path / name
    path.write_text(json_array(records)[0], encoding="utf-8")
    return path


# -- reading --------------------------------------------------------------------------------

SAMPLE = [
    record("a", ("human", "Hello there, how are you?"), ("gpt", "Fine, thanks.")),
    record("one-turn", ("human", "Anyone?")),
    record("gpt-first", ("gpt", "...continued."), ("human", "And then? \"quoted\" \\ é"),
           ("gpt", "Then the end.")),
    record("empty"),
    record("two-humans", ("human", "First"), ("human", "Second"), ("gpt", "Reply")),
    record("b", ("system", "Be brief."), ("human", "Why?"), ("gpt", "Because."),
           ("human", "Ok"), ("gpt", "Bye")),
    record("cut", ("human", "This record is cut in its reply"), ("gpt", "It never " * 40)),
]


def test_truncated_file_keeps_complete_records(tmp_path):
    text, ends = json_array(SAMPLE)
    path = tmp_path / "cut.json"
    path.write_text(text[:ends[-1] - 100], encoding="utf-8")  # inside the last reply
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))
    data = read_sharegpt(path)
    assert data.truncated and data.num_records == len(SAMPLE) - 1
    assert data.exchanges == [  # the first two turns, whatever their roles (vLLM's, SGLang's);
        ("Hello there, how are you?", "Fine, thanks."),  # < 2 turns and the cut record: dropped
        ("...continued.", "And then? \"quoted\" \\ é"),
        ("First", "Second"),
        ("Be brief.", "Why?"),
    ]
    whole = read_sharegpt(write(tmp_path, SAMPLE))
    assert not whole.truncated and whole.num_records == len(SAMPLE)
    assert whole.exchanges == data.exchanges + [(SAMPLE[-1]["conversations"][0]["value"],
                                                 SAMPLE[-1]["conversations"][1]["value"])]


@pytest.mark.parametrize("chunk_chars", [1, 5, 64, 1 << 20])
def test_every_cut_keeps_exactly_the_records_before_it(chunk_chars):
    text, ends = json_array(SAMPLE[:4])
    for cut in range(1, len(text), 3 if chunk_chars < 64 else 1):
        out, truncated = drain(iter_json_array(io.StringIO(text[:cut]), chunk_chars))
        assert out == SAMPLE[:sum(end <= cut for end in ends)], cut
        assert truncated == (cut <= text.rindex("]")), cut
    assert drain(iter_json_array(io.StringIO(text), chunk_chars)) == (SAMPLE[:4], False)


@pytest.mark.parametrize("text", ['{"not": "an array"}', "", "[1,]", "[1 2]",
                                  '[{"a": }, {"b": 1}]'])
def test_malformed_json_is_an_error(text):
    with pytest.raises(ValueError):
        drain(iter_json_array(io.StringIO(text), 2))


def test_malformed_file_names_the_file(tmp_path):
    text, ends = json_array(SAMPLE[:2])
    path = tmp_path / "bad.json"
    path.write_text(text[:ends[0] - 5] + "}}" + text[ends[0]:], encoding="utf-8")
    with pytest.raises(ValueError, match="bad.json: malformed JSON array element 0"):
        read_sharegpt(path)


def test_installed_wheel_file():
    data = read_sharegpt()
    assert data.truncated  # the wheel's file is cut inside its last record
    assert data.num_records > 17_000 and len(data.exchanges) > 17_000


# -- sampling -------------------------------------------------------------------------------

# (prompt words, reply words) with a context of 20 tokens: which ones a sample may keep.
FILTER_CASES = {
    "short-prompt": (3, 10), "short-reply": (4, 3), "smallest": (4, 4), "fills-context": (10, 10),
    "over-context": (10, 11), "long-prompt": (17, 4),
}


def filter_file(tmp_path):
    return write(tmp_path, [exchange(rid, p, r) for rid, (p, r) in FILTER_CASES.items()])


def ctx(tokenizer=None, context_length: int = 20, seed: int = 0, vocab_size: int = 100):
    return DatasetContext(vocab_size, tokenizer or WordTokenizer(), context_length,
                          np.random.default_rng(seed))


def test_sharegpt_filters(tmp_path):
    reqs = sample_sharegpt(sharegpt_args(filter_file(tmp_path), 2), ctx())
    assert sorted((len(ids), out) for ids, out in reqs) == [(4, 4), (10, 10)]
    assert [len(w) for w in words(4, "smallest").split()] in [ids for ids, _ in reqs]
    with pytest.raises(ValueError, match="--num-prompts 3: only 2 of the 6"):
        sample_sharegpt(sharegpt_args(filter_file(tmp_path), 3), ctx())


def test_sharegpt_fixed_output_len(tmp_path):
    # The >= 4 rule is for measured replies only; the context still bounds prompt + output.
    reqs = sample_sharegpt(sharegpt_args(filter_file(tmp_path), 5, output_len=2), ctx())
    assert sorted(len(ids) for ids, _ in reqs) == [4, 4, 10, 10, 17]
    assert {out for _, out in reqs} == {2}
    reqs = sample_sharegpt(sharegpt_args(filter_file(tmp_path), 4, output_len=10), ctx())
    assert sorted(len(ids) for ids, _ in reqs) == [4, 4, 10, 10]
    with pytest.raises(ValueError, match="only 4 of the 6"):
        sample_sharegpt(sharegpt_args(filter_file(tmp_path), 5, output_len=10), ctx())
    with pytest.raises(ValueError, match="--sharegpt-output-len"):
        sample_sharegpt(sharegpt_args(filter_file(tmp_path), 1, output_len=0), ctx())


def test_sharegpt_max_prompt_len(tmp_path):
    # vLLM's rule (prompt <= 1024, prompt + output <= 2048), here prompt <= 10 in a context of 20:
    # the 17-token prompt fits the context with 2 output tokens, but not the limit.
    path = filter_file(tmp_path)
    reqs = sample_sharegpt(sharegpt_args(path, 4, output_len=2, max_prompt_len=10), ctx())
    assert sorted(len(ids) for ids, _ in reqs) == [4, 4, 10, 10]
    reqs = sample_sharegpt(sharegpt_args(path, 2, output_len=2, max_prompt_len=9), ctx())
    assert sorted(len(ids) for ids, _ in reqs) == [4, 4]
    with pytest.raises(ValueError, match=r"only 2 of the 6 .* \(prompt 4-9 tokens"):
        sample_sharegpt(sharegpt_args(path, 3, output_len=2, max_prompt_len=9), ctx())
    with pytest.raises(ValueError, match="--sharegpt-max-prompt-len must be >= 4"):
        sample_sharegpt(sharegpt_args(path, 1, max_prompt_len=3), ctx())


def test_sharegpt_deterministic_and_lazy(tmp_path):
    path = write(tmp_path, [exchange(f"c{i}-", 4 + i % 5, 4 + i % 7) for i in range(200)])
    tok = WordTokenizer()
    first = sample_sharegpt(sharegpt_args(path, 8), ctx(tok, context_length=64, seed=3))
    assert tok.calls == 16  # one prompt and one reply per request: nothing else is tokenized
    again = sample_sharegpt(sharegpt_args(path, 8), ctx(context_length=64, seed=3))
    more = sample_sharegpt(sharegpt_args(path, 12), ctx(context_length=64, seed=3))
    other = sample_sharegpt(sharegpt_args(path, 8), ctx(context_length=64, seed=4))
    assert first == again and more[:8] == first and other != first
    tok = WordTokenizer()
    sample_sharegpt(sharegpt_args(path, 8, output_len=5), ctx(tok, context_length=64))
    assert tok.calls == 8  # replies are not tokenized under --sharegpt-output-len


def test_sharegpt_needs_a_tokenizer(tmp_path):
    no_tokenizer = DatasetContext(100, None, 20, np.random.default_rng(0))
    with pytest.raises(ValueError, match="tokenizer"):
        sample_sharegpt(sharegpt_args(filter_file(tmp_path), 1), no_tokenizer)


# -- generated-shared-prefix ----------------------------------------------------------------

def gsp_args(groups=3, per_group=5, system=12, question=4, output=6) -> argparse.Namespace:
    return argparse.Namespace(gsp_num_groups=groups, gsp_prompts_per_group=per_group,
                              gsp_system_prompt_len=system, gsp_question_len=question,
                              gsp_output_len=output, num_prompts=64)


def test_random_ids_stay_inside_the_tokenizer():
    class Tokenizer:
        def __len__(self):
            return 10

    assert random_id_bound(16, None) == 16  # no tokenizer: the model's vocabulary
    assert random_id_bound(16, Tokenizer()) == 10  # a padded embedding: the tokenizer's
    assert random_id_bound(8, Tokenizer()) == 8


def test_gsp_groups_share_their_system_prompt():
    reqs = sample_generated_shared_prefix(gsp_args(), ctx(context_length=22, vocab_size=1000))
    assert len(reqs) == 15
    assert all(len(ids) == 16 and out == 6 for ids, out in reqs)
    assert all(isinstance(t, int) and 0 <= t < 1000 for ids, _ in reqs for t in ids)
    groups = Counter(tuple(ids[:12]) for ids, _ in reqs)
    assert sorted(groups.values()) == [5, 5, 5]  # 3 distinct system prompts, 5 requests each
    assert len({tuple(ids[12:]) for ids, _ in reqs}) == 15  # every question its own
    order = [tuple(ids[:12]) for ids, _ in reqs]
    assert any(order[i] != order[i + 1] for i in range(4))  # shuffled, not group by group
    same = sample_generated_shared_prefix(gsp_args(), ctx(context_length=22, vocab_size=1000))
    other = sample_generated_shared_prefix(gsp_args(), ctx(context_length=22, vocab_size=1000,
                                                            seed=1))
    assert same == reqs and other != reqs


def test_gsp_must_fit_the_context():
    sample_generated_shared_prefix(gsp_args(), ctx(context_length=22))  # exactly fits
    with pytest.raises(ValueError, match="exceed the context length 21"):
        sample_generated_shared_prefix(gsp_args(), ctx(context_length=21))
    with pytest.raises(ValueError, match="--gsp-question-len"):
        sample_generated_shared_prefix(gsp_args(question=0), ctx())


# -- flags ----------------------------------------------------------------------------------

def test_bench_flags():
    parser = build_parser()
    args = parser.parse_args(["bench"])
    assert args.dataset_name == "random" and args.dataset_path is None
    assert args.sharegpt_output_len is None
    assert (args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
            args.gsp_question_len, args.gsp_output_len) == (8, 16, 512, 64, 32)
    assert parser.parse_args(["bench", "--dataset", "sharegpt"]).dataset_name == "sharegpt"
    old = parser.parse_args(["bench", "--dataset-name", "generated-shared-prefix"])
    assert old.dataset_name == "generated-shared-prefix"
    assert {"random", "sharegpt", "generated-shared-prefix"} <= set(DATASETS)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--dataset", "nope"])
    slos = parser.parse_args(["bench", "--metric-percentiles", "50,99.9", "--goodput", "ttft:500",
                              "e2el:2000"])
    assert slos.metric_percentiles == (50.0, 99.9)
    assert slos.goodput == [("ttft", 500.0), ("e2e", 2000.0)]  # vLLM's e2el is our e2e
    for bad in (["--metric-percentiles", "100"], ["--goodput", "ttft"], ["--goodput", "x:5"],
                ["--goodput", "tpot:-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", *bad])
