"""``--compare FIELD=V1,V2,...`` (or ``FIELD=[JSON list]``): one run per value of an
EngineConfig field (or of a request field the bench sets, :data:`REQUEST_FIELDS`), side by
side."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from typing import Any, Sequence

from minijax_serve.bench.metrics import percentile_name
from minijax_serve.config import EngineConfig
from minijax_serve.config.flags import converter, sampling_parser  # the CLI's own rules

# SamplingParams fields a bench run may set for every request (the others come from the dataset)
REQUEST_FIELDS = ("logprobs", "repetition_penalty", "frequency_penalty", "presence_penalty", "regex")

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}

# (label, key, format): the rows of the side-by-side table; "P*" rows stand for one row per
# percentile of the runs' --metric-percentiles (default 99)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("Successful requests", "completed", "d"),
    ("Benchmark duration (s)", "duration_s", ".2f"),
    ("Request throughput (req/s)", "request_throughput", ".3f"),
    ("Request goodput (req/s)", "request_goodput", ".3f"),
    ("Output token throughput (tok/s)", "output_throughput", ".2f"),
    ("Total token throughput (tok/s)", "total_throughput", ".2f"),
    ("Mean TTFT (ms)", "mean_ttft_ms", ".1f"),
    ("Median TTFT (ms)", "median_ttft_ms", ".1f"),
    ("P* TTFT (ms)", "p*_ttft_ms", ".1f"),
    ("Mean TPOT (ms)", "mean_tpot_ms", ".2f"),
    ("Mean ITL (ms)", "mean_itl_ms", ".2f"),
    ("Median ITL (ms)", "median_itl_ms", ".2f"),
    ("P* ITL (ms)", "p*_itl_ms", ".2f"),
    ("Mean E2E (ms)", "mean_e2e_ms", ".1f"),
    ("P* E2E (ms)", "p*_e2e_ms", ".1f"),
    ("Prefill tokens computed", "prefill_tokens_computed", "d"),
    ("  over the ideal", "prefill_over_ideal", ".3f"),
    ("Cached prompt tokens", "cached_tokens", "d"),
    ("Peak KV pool usage", "peak_kv_usage", ".3f"),
    ("Mean KV pool usage over steps", "mean_token_usage", ".3f"),
    ("  over steps with requests waiting", "mean_token_usage_queued", ".3f"),
    ("Retracted requests", "num_retracted", "d"),
    ("Speculative acceptance rate", "spec_acceptance_rate", ".3f"),
    ("  mean accepted length", "spec_accept_length", ".3f"),
    ("Output tokens per decode step", "tokens_per_step", ".3f"),
    ("Host time per step (ms)", "mean_host_ms_per_step", ".2f"),
    ("Host blocked per step (ms)", "mean_blocked_ms_per_step", ".2f"),
    ("Device idle, upper bound", "device_idle_fraction", ".3f"),
    ("Compiled step shapes", "num_compiled_shapes", "d"),
    ("Compile time (s)", "compile_time_s", ".2f"),
    ("MFU", "mfu", ".4f"),
    ("Decode bandwidth utilisation", "decode_bandwidth_utilisation", ".4f"),
)


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected True or False, got {text!r}")


def field_parser(name: str):
    """The parser of one EngineConfig or request field's values (its type; bools as
    True/False)."""
    if name in REQUEST_FIELDS:
        return sampling_parser(name)
    hints = typing.get_type_hints(EngineConfig)
    if name not in hints:
        fields = ", ".join([f.name for f in dataclasses.fields(EngineConfig)] + list(REQUEST_FIELDS))
        raise ValueError(f"{name!r} is not an EngineConfig or request field (one of: {fields})")
    convert, is_bool = converter(hints[name])
    return _bool if is_bool else convert


def _values(text: str) -> list[str]:
    """``V1,V2,...``, or a JSON list for values holding commas (``["[a-z]{1,3}", null]``; null
    is ``none``)."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError:
        values = None
    if not isinstance(values, list):
        return [v.strip() for v in text.split(",")]
    return ["none" if v is None else v if isinstance(v, str) else json.dumps(v) for v in values]


def parse_compare(spec: str) -> tuple[str, list[Any]]:
    """``FIELD=V1,V2,...`` (or ``FIELD=[JSON list]``) -> (field name, values parsed with the
    field's type). Dashes in the field name are read as underscores (``page-size`` =
    ``page_size``)."""
    field, sep, values = spec.partition("=")
    field = field.strip().replace("-", "_")
    if not sep or not field or not values.strip():
        raise argparse.ArgumentTypeError(f"expected FIELD=V1,V2,..., got {spec!r}")
    try:
        parse = field_parser(field)
        parsed = [parse(v) for v in _values(values)]
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(f"--compare {spec!r}: {err}") from None
    if len(parsed) < 2:
        raise argparse.ArgumentTypeError(f"--compare {spec!r}: give at least two values")
    return field, parsed


def zip_compare(specs: Sequence[tuple[str, list[Any]]]) -> tuple[str, list[dict[str, Any]]]:
    """Several ``--compare`` specs vary together (zipped): run i sets each field to its i-th
    value. Returns the label of the fields (``a`` or ``a,b``) and each run's overrides."""
    counts = {len(values) for _, values in specs}
    if len(counts) != 1:
        raise ValueError("--compare: every FIELD=V1,V2,... needs the same number of values, got "
                         + ", ".join(f"{field}: {len(values)}" for field, values in specs))
    runs = [{field: values[i] for field, values in specs} for i in range(counts.pop())]
    return ",".join(field for field, _ in specs), runs


def compare_value(overrides: dict[str, Any]) -> Any:
    """A run's value in the reports: the field's value, or the values joined by commas."""
    values = list(overrides.values())
    return values[0] if len(values) == 1 else ",".join(str(v) for v in values)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt) if fmt != "d" else str(int(value))


def _rows(results: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """:data:`ROWS` with a "P*" row per percentile of the runs, the goodput row only when the
    runs have one."""
    percentiles = results[0].get("workload", {}).get("metric_percentiles", (99,))
    rows = []
    for label, key, fmt in ROWS:
        if key == "request_goodput" and not any(key in r for r in results):
            continue
        if "*" not in key:
            rows.append((label, key, fmt))
            continue
        for p in percentiles:
            name = percentile_name(p)
            rows.append((label.replace("P*", name.upper()), key.replace("p*", name), fmt))
    return rows


def format_compare(field: str, results: Sequence[dict[str, Any]]) -> str:
    """The runs side by side: one column per value, with value / first-run ratios."""
    headers = [f"{field}={r['compare']['value']}" for r in results]
    label_w, col_w = 34, max(22, 2 + max(len(h) for h in headers))
    width = label_w + col_w * len(results)
    lines = [f" Compare: {field} ".center(width, "="),
             "".ljust(label_w) + "".join(h.rjust(col_w) for h in headers)]
    for label, key, fmt in _rows(results):
        first = results[0].get(key)
        cells = []
        for i, r in enumerate(results):
            value = r.get(key)
            text = _cell(value, fmt)
            if i and value is not None and first:
                text += f" ({value / first:.2f}x)"
            cells.append(text.rjust(col_w))
        lines.append(label.ljust(label_w) + "".join(cells))
    lines.append("=" * width)
    lines.append("(x): the run's figure over the first run's")
    return "\n".join(lines)
