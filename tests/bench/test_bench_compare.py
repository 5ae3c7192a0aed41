"""``minijax-serve bench --compare`` and ``--repeats`` without running anything: parsing the
values (JSON lists for values holding commas), zipping several fields, the side-by-side table
and the medians over repeats."""

from __future__ import annotations

import argparse

import pytest

from minijax_serve.bench.compare import compare_value, format_compare, parse_compare, zip_compare
from minijax_serve.bench.report import format_repeats


def test_parse_compare():
    assert parse_compare("page_size=16,32") == ("page_size", [16, 32])
    assert parse_compare("max-running-requests=4, 8") == ("max_running_requests", [4, 8])
    assert parse_compare("skip_tokenizer_init=True,false") == ("skip_tokenizer_init", [True, False])
    assert parse_compare("context_length=none,512") == ("context_length", [None, 512])
    assert parse_compare("mem_fraction_static=0.5,0.9") == ("mem_fraction_static", [0.5, 0.9])
    assert parse_compare('regex=[null, "[a-z]{1,3}"]') == ("regex", [None, "[a-z]{1,3}"])
    assert parse_compare("page_size=[16, 32]") == ("page_size", [16, 32])
    assert parse_compare("regex=[a-z]+,none") == ("regex", ["[a-z]+", None])  # not JSON
    for bad in ("page_size", "page_size=16", "nope=1,2", "page_size=a,b",
                "skip_tokenizer_init=maybe,True", 'regex=["a"]'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_compare(bad)


def test_zip_compare():
    specs = [("init_new_token_ratio", [0.7, 1.0]), ("min_new_token_ratio_factor", [0.14, 1.0])]
    field, runs = zip_compare(specs)
    assert field == "init_new_token_ratio,min_new_token_ratio_factor"
    assert runs == [{"init_new_token_ratio": 0.7, "min_new_token_ratio_factor": 0.14},
                    {"init_new_token_ratio": 1.0, "min_new_token_ratio_factor": 1.0}]
    assert [compare_value(r) for r in runs] == ["0.7,0.14", "1.0,1.0"]
    assert zip_compare([("page_size", [16, 32])]) == ("page_size", [{"page_size": 16}, {"page_size": 32}])
    assert compare_value({"page_size": 16}) == 16
    with pytest.raises(ValueError, match="same number of values"):
        zip_compare([("page_size", [16, 32]), ("seed", [1, 2, 3])])


def test_format_compare_ratios():
    runs = [{"compare": {"value": v}, "output_throughput": t, "completed": 4}
            for v, t in ((16, 10.0), (32, 15.0))]
    text = format_compare("page_size", runs)
    assert "page_size=16" in text and "page_size=32" in text
    assert "15.00 (1.50x)" in text


def test_format_compare_rows_follow_the_runs_percentiles_and_goodput():
    runs = [{"compare": {"value": v}, "workload": {"metric_percentiles": [50, 99.9]},
             "p50_ttft_ms": 10.0 * v, "p99.9_ttft_ms": 20.0 * v, "request_goodput": 1.5 * v}
            for v in (1, 2)]
    lines = format_compare("seed", runs).splitlines()
    row = {line[:34].strip(): line[34:].split() for line in lines}
    assert row["P50 TTFT (ms)"] == ["10.0", "20.0", "(2.00x)"]
    assert row["P99.9 TTFT (ms)"] == ["20.0", "40.0", "(2.00x)"]
    assert row["Request goodput (req/s)"] == ["1.500", "3.000", "(2.00x)"]
    assert "P99 TTFT (ms)" not in row and "P50 E2E (ms)" in row
    plain = format_compare("seed", [{"compare": {"value": 1}, "p99_ttft_ms": 3.0}])
    assert "P99 TTFT (ms)" in plain and "goodput" not in plain


def test_format_repeats_medians_per_configuration():
    def run(value, tok_s, base_tok_s=None):
        base = None if base_tok_s is None else {
            "output_throughput": base_tok_s, "output_throughput_ratio": tok_s / base_tok_s}
        return {"compare": value and {"field": "page_size", "value": value}, "repeats": 3,
                "output_throughput": tok_s, "baseline": base}

    # three repeats of two configurations, each repeat with its own baseline
    repeats = ((10.0, 30.0, 5.0), (20.0, 12.0, 4.0), (90.0, 15.0, 10.0))  # page 16, page 32, hf
    runs = [run(v, t, b) for t16, t32, b in repeats for v, t in ((16, t16), (32, t32))]
    lines = format_repeats(runs).splitlines()
    assert "page_size=16: 10.00, 20.00, 90.00 -> median 20.00" in lines
    assert "page_size=32: 30.00, 12.00, 15.00 -> median 15.00" in lines
    assert "hf transformers: 5.00, 4.00, 10.00 -> median 5.00" in lines
    assert "page_size=16 / hf: 2.000, 5.000, 9.000 -> median 5.000" in lines
    assert "page_size=32 / hf: 6.000, 3.000, 1.500 -> median 3.000" in lines
    alone = format_repeats([run(None, t) for t in (3.0, 1.0, 2.0)]).splitlines()
    assert "minijax: 3.00, 1.00, 2.00 -> median 2.00" in alone
    assert not any("hf" in line for line in alone)
