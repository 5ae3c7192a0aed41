"""``bench --backend openai``: one timed run of the workload against an OpenAI-compatible server.

The server is asked for its model (``GET /v1/models``, unless ``--served-model-name``) before
the workload is drawn, so a server that is down fails at once. Each run first sends one untimed
request (the first prompt, at most :data:`WARMUP_TOKENS` output tokens), which also checks that
the endpoint answers, then times every request through :mod:`minijax_serve.bench.http_client`.
Only the client-side figures exist (:func:`~minijax_serve.bench.figures.http_figures`): the
engine's steps, KV pool, cache and FLOP figures are the server's own business.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any, NamedTuple, Sequence

from minijax_serve.bench import metrics
from minijax_serve.bench.args import workload
from minijax_serve.bench.compare import REQUEST_FIELDS
from minijax_serve.bench.datasets import BenchRequest
from minijax_serve.bench.figures import http_figures, trace
from minijax_serve.bench.http_client import run_http, served_model_name
from minijax_serve.bench.openai_api import ENDPOINTS, request_body
from minijax_serve.bench.report import progress

WARMUP_TOKENS = 16


class Server(NamedTuple):
    base_url: str  # without the trailing slash
    endpoint: str  # "completions" or "chat"
    model: str  # the served model name sent in every request
    api_key: str | None


def connect(args: argparse.Namespace) -> Server:
    """The server of ``--base-url``, its model (``--served-model-name``, else asked) and key
    (``--api-key``, else ``$OPENAI_API_KEY``)."""
    base = args.base_url.rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    model = args.served_model_name or served_model_name(base, api_key)
    return Server(base, args.endpoint, model, api_key)


def request_bodies(args: argparse.Namespace, server: Server, requests: Sequence[BenchRequest],
                   tokenizer: Any) -> list[dict[str, Any]]:
    """Every request's JSON body, with the bench's request fields (made before the timing, so
    that decoding chat prompts costs the run nothing)."""
    fields = {name: getattr(args, name) for name in REQUEST_FIELDS}
    return [request_body(server.endpoint, server.model, r.prompt_ids, r.output_len,
                         args.ignore_eos, fields, tokenizer) for r in requests]


def run_server(args: argparse.Namespace, server: Server, bodies: Sequence[dict[str, Any]],
               offsets: Sequence[float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Warm up, then time ``bodies`` sent at ``offsets``; returns (figures, plot trace)."""
    url = server.base_url + ENDPOINTS[server.endpoint]
    first = dict(bodies[0], max_tokens=min(bodies[0]["max_tokens"], WARMUP_TOKENS))
    warm = run_http(server.base_url, server.endpoint, [first], [0.0], api_key=server.api_key)
    if warm.outputs[0].error is not None:
        raise ValueError(f"--base-url: the warm-up request to {url} failed: "
                         f"{warm.outputs[0].error}")
    print(f"Warm-up: one request to {url} ({server.model}) in {warm.duration:.2f} s")

    bar = progress(len(bodies), "openai", args.disable_tqdm)
    try:
        run = run_http(server.base_url, server.endpoint, bodies, offsets, args.max_concurrency,
                       server.api_key, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    result = http_figures(run, args.output_details, args.metric_percentiles,
                          dict(args.goodput or {}))
    result.update(
        mode="offline" if math.isinf(args.request_rate) and args.max_concurrency is None
        else "online",
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        backend="openai", base_url=server.base_url, endpoint=server.endpoint,
        served_model_name=server.model, model=str(args.model), warmup_s=warm.duration,
        host_cpu=metrics.host_cpu(), timestamp=time.time(),
        request_fields={name: getattr(args, name) for name in REQUEST_FIELDS},
        workload=workload(args),
    )
    return result, trace(run)
