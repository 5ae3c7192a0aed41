"""A short soak (benchmarks/soak.py's mix, a few hundred requests) against the tiny server:
streams left in the middle, requests given up while they wait, n, logprobs and structured
output; no request fails, and afterwards the engine is idle and clean and every sequence
submitted has one finish reason in /metrics. The full soak and its figures:
benchmarks/RESULTS.md."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx

from minijax_serve.server.debug import engine_report

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak  # noqa: E402


def test_a_short_soak_leaves_nothing_behind(tiny_server, clean_server):
    base = tiny_server.base_url
    errors_before = soak.counters(httpx.get(base + "/metrics").text).get("error", 0)
    result = asyncio.run(soak.drive(base, 150, 24, seed=1))
    assert not result["problems"] and "failed" not in result["outcomes"], result
    assert result["outcomes"]["disconnected"] > 0 and result["outcomes"]["aborted"] > 0
    deadline = time.monotonic() + 60  # the last aborts reach the engine
    while tiny_server.on_engine(lambda e: e.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    report = tiny_server.on_engine(engine_report)
    assert soak.check(report, httpx.get(base + "/metrics").text, errors_before) == []
