"""Benchmark figures: latency summaries, model FLOPs of a run, and the host CPU's name (the
device's ceilings are measured by :mod:`minijax_serve.executor.ceilings`).

Model FLOPs (useful work only; padding, retract re-prefills and the sampler are not counted).
A request with ``P`` prompt tokens and ``O`` output tokens runs ``T = P + O - 1`` tokens through
the model (its last output token is sampled but never fed back). Each forwarded token costs

* ``2 · N`` FLOPs in the layers' weight matmuls, ``N`` = :func:`dense_params` (every parameter
  but the embedding table and the LM head: the lookup is no matmul);
* ``2 · vocab · hidden`` FLOPs in the LM head, for the tokens whose logits are computed: each
  request's last prompt token and every output token fed back (``O`` per request; a prefill
  computes no logits for the rest of its prompt);
* ``4 · layers · heads · head_dim · c`` FLOPs in attention, ``c`` the keys it attends to
  (``Q·Kᵀ`` and ``P·V``, 2 FLOPs per multiply-add each). The token at position ``k`` attends to
  ``k + 1`` keys, so a request's attention sums ``c`` over ``1..T``: ``T · (T + 1) / 2``.

MFU = (model FLOPs / duration) / peak, where the peak is the best time of a square ``jnp``
matmul in the engine's dtype on the same device, in the same process.

Latencies (SGLang's ``bench_serving`` definitions), from each request's arrival time (when the
client sends it: its scheduled arrival, or later if ``--max-concurrency`` held it back):

* TTFT = first token time - arrival;  E2E = finish time - arrival;
* TPOT = (E2E - TTFT) / (output tokens - 1), per request with at least 2 output tokens;
* ITL = the gaps between a request's consecutive token times, pooled over every request (over
  HTTP: between consecutive streamed chunks that carried output, as SGLang's client measures it).

Decode memory bandwidth: a decode step reads every weight once (the embedding table only as the
tied LM head; an untied table is only gathered from) and the K and V of every key each sequence
attends to. Bytes read per step over the step's wall time, against a timed device-to-device copy
(bytes read + written per second, as ``bandwidthTest`` counts them).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from minijax_serve.models.config import ModelConfig

SLO_METRICS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e", "e2e": "e2e"}  # vLLM's e2el too


def percentile_name(p: float) -> str:
    """``p99``, ``p99.9``: the key of a percentile, as vLLM names them."""
    return f"p{int(p) if float(p).is_integer() else p}"


def summarize(values: Sequence[float], scale: float = 1.0,
              percentiles: Sequence[float] = (99.0,)) -> dict[str, float]:
    """Mean, median, standard deviation and the ``percentiles`` (linear interpolation, numpy's
    default, as SGLang's and vLLM's ``np.percentile``) of ``values`` times ``scale``; zeros when
    empty."""
    names = [percentile_name(p) for p in percentiles]
    if not len(values):
        return dict.fromkeys(["mean", "median", "std", *names], 0.0)
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            **{n: float(np.percentile(a, p)) for n, p in zip(names, percentiles)}}


def meets_slos(outputs: Sequence[Any], arrivals: Sequence[float], output_lens: Sequence[int],
               slos: dict[str, float]) -> int:
    """How many finished requests met every SLO of ``slos`` (``"ttft"``, ``"tpot"``, ``"e2e"``
    -> milliseconds), vLLM's goodput rule: a request of one output token has a TPOT of 0."""
    met = 0
    for out, arrival, n_out in zip(outputs, arrivals, output_lens):
        if out.first_token_time is None or out.finish_time is None:
            continue
        ms = {"ttft": out.first_token_time - arrival, "e2e": out.finish_time - arrival,
              "tpot": (out.finish_time - out.first_token_time) / (n_out - 1) if n_out > 1 else 0.0}
        met += all(1e3 * ms[name] <= limit for name, limit in slos.items())
    return met


def request_latencies(outputs: Sequence[Any], arrivals: Sequence[float] | None = None,
                      output_lens: Sequence[int] | None = None) -> dict[str, list[float]]:
    """TTFT, E2E and TPOT per request and the pooled ITLs, in seconds (module docstring).

    ``arrivals[i]`` is when request ``i`` was sent (default: each output's own
    ``arrival_time``, when the engine queued it). ``output_lens[i]`` is its output token count
    for TPOT (default: ``len(token_ids)``; over HTTP, the server's usage count, since a streamed
    chunk may carry several tokens).
    """
    if arrivals is None:
        arrivals = [out.arrival_time for out in outputs]
    if output_lens is None:
        output_lens = [len(out.token_ids) for out in outputs]
    ttft, e2e, tpot, itl = [], [], [], []
    for out, arrival, n_out in zip(outputs, arrivals, output_lens):
        if out.first_token_time is not None:
            ttft.append(out.first_token_time - arrival)
        if out.finish_time is not None:
            e2e.append(out.finish_time - arrival)
            if out.first_token_time is not None and n_out > 1:
                tpot.append((out.finish_time - out.first_token_time) / (n_out - 1))
        times = out.token_times
        itl += [b - a for a, b in zip(times, times[1:])]
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e}


def model_flops(cfg: ModelConfig, prompt_lens: Sequence[int], output_lens: Sequence[int],
                cached_lens: Sequence[int] | None = None) -> float:
    """FLOPs of serving the requests once each (see the module docstring for the formula).

    The first ``cached_lens[i]`` prompt tokens of request i came from the prefix cache: they
    cost nothing, and its computed tokens attend to them as to any other key.
    """
    per_token = 2.0 * dense_params(cfg)
    per_logits = 2.0 * cfg.vocab_size * cfg.hidden_size
    attn_per_key = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    total = 0.0
    for p, o, c in zip(prompt_lens, output_lens, cached_lens or [0] * len(prompt_lens)):
        t = p + max(o, 1) - 1
        total += (per_token * (t - c) + per_logits * max(o, 1)
                  + attn_per_key * (t * (t + 1) - c * (c + 1)) / 2)
    return total


def dense_params(cfg: ModelConfig) -> int:
    """Parameters every forwarded token multiplies: all but the embedding table and the LM head
    (the norms and biases, counted too, are a rounding error)."""
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_params() - embeddings


def weight_bytes(cfg: ModelConfig, itemsize: int, quantized: bool = False) -> int:
    """Bytes of weights one decode step reads: every parameter, less an untied embedding table
    (only gathered from; a tied one is read whole as the LM head); ``quantized``: the layers'
    matrices in FP8, a byte each and a float32 scale per output column."""
    params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    if not quantized:
        return params * itemsize
    h, i = cfg.hidden_size, cfg.intermediate_size
    matrices = cfg.num_layers * cfg.layer_matrix_params()
    scales = cfg.num_layers * (cfg.q_size + 2 * cfg.kv_size + 2 * h + 2 * i)
    return (params - matrices) * itemsize + matrices + 4 * scales


def host_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The host CPU as ``/proc/cpuinfo`` names it, with its logical CPU count and widest vector
    extension (``avx512f``, ``avx2``, ... from x86's ``flags``; ``sve``, ``asimd`` from Arm's
    ``Features``), so that runs on different machines are told apart; ``"unknown"`` where the
    file is missing."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return "unknown"
    fields = [line.partition(":") for line in text.splitlines()]
    model = next((v.strip() for k, _, v in fields if k.strip() == "model name"), "unknown")
    count = sum(k.strip() == "processor" for k, _, _ in fields)
    flags = set(next((v.split() for k, _, v in fields if k.strip() in ("flags", "Features")), []))
    vector = next((f for f in ("avx512f", "avx2", "avx", "sve", "asimd") if f in flags), "none")
    return f"{model}, {count} logical CPU{'s' * (count != 1)}, {vector}"
