"""A real run kept as data: its workload, engine flags, figures and step trace, replayable on
the simulated device.

One gzip'd JSON-lines file: a header object (``model``, ``engine`` flags, the run's ``figures``,
``requests`` and ``columns``), then one JSON array per step, in ``columns``' order. A request is
``[prompt_len, output_len, parent, shared]``: its prompt's first ``shared`` tokens are those of
request ``parent``'s (the earlier request it shares the longest prefix with; -1: none). Token ids
are not kept: the scheduler reads only lengths and shared prefixes, so
:func:`synthetic_prompts` gives a workload that the engine schedules step for step as the real
one. A step's ``seqs``, ``new_tokens``, ``keys``, ``pairs`` and ``logit_rows`` are its
:class:`~minijax_serve.simulate.cost_model.StepLoad`; the other columns are its
:class:`~minijax_serve.engine.trace.StepRecord` fields.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from minijax_serve.simulate.calibration import TimedSteps, overlapped_step_times, step_group
from minijax_serve.simulate.cost_model import StepLoad

LOAD_COLUMNS = StepLoad._fields[1:]  # num_tokens is the record's bucket_tokens
RECORD_COLUMNS = ("kind", "prefill_reqs", "decode_reqs", "prefill_tokens", "bucket_tokens",
                  "bucket_seqs", "bucket_kv_tokens", "kv_tokens_used", "cached_tokens",
                  "start_s", "host_ms", "blocked_ms")
SCHEDULE = RECORD_COLUMNS[:RECORD_COLUMNS.index("start_s")]  # what a replay must give back


class RecordedRun(NamedTuple):
    """A run read by :func:`read_recorded_run`."""

    model: str
    engine: dict[str, Any]  # the run's engine flags (EngineConfig fields)
    figures: dict[str, Any]  # what the run measured: duration_s, total_throughput, ...
    requests: np.ndarray  # [N, 4]: prompt_len, output_len, parent, shared
    steps: dict[str, np.ndarray]  # one column per field, one row per step


def prefix_parents(prompts: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """For each prompt, the earlier prompt it shares the longest prefix with and that prefix's
    length, ``(-1, 0)`` where it shares none (a trie of the prompts so far: each node keeps
    the first prompt that passed through it)."""
    root: dict = {}
    out = []
    for i, prompt in enumerate(prompts):
        node, parent, shared = root, -1, 0
        for token in prompt:
            child = node.get(token)
            if child is None:
                child = node[token] = ({}, i)
            elif child[1] != i:
                parent, shared = child[1], shared + 1
            node = child[0]
        out.append((parent, shared))
    return out


def synthetic_prompts(requests: np.ndarray, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of the requests' lengths and shared prefixes, other ids drawn at random."""
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    for prompt_len, _, parent, shared in requests.tolist():
        head = prompts[parent][:shared] if parent >= 0 else []
        prompts.append(head + rng.integers(0, vocab_size, prompt_len - len(head)).tolist())
    return prompts


def write_recorded_run(path: str | Path, model: str, engine: dict[str, Any],
                       figures: dict[str, Any], prompts: Sequence[Sequence[int]],
                       output_lens: Sequence[int], records: Sequence[dict[str, Any]],
                       loads: Sequence[StepLoad]) -> None:
    """Write a run: ``records`` are its trace's step records (dicts), ``loads`` each step's
    load (from the same steps on the simulated engine)."""
    if len(records) != len(loads):
        raise ValueError(f"records: {len(records)} steps, loads: {len(loads)}")
    requests = [[len(p), int(o), parent, shared]
                for p, o, (parent, shared) in zip(prompts, output_lens, prefix_parents(prompts))]
    columns = [*RECORD_COLUMNS, *LOAD_COLUMNS]
    header = {"model": model, "engine": engine, "figures": figures, "requests": requests,
              "columns": columns}
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(header) + "\n")
        for record, load in zip(records, loads):
            row = [record[c] for c in RECORD_COLUMNS] + [getattr(load, c) for c in LOAD_COLUMNS]
            f.write(json.dumps([round(x, 6) if isinstance(x, float) else x for x in row]) + "\n")


def read_recorded_run(path: str | Path) -> RecordedRun:
    """The run written by :func:`write_recorded_run`."""
    with gzip.open(path, "rt") as f:
        header = json.loads(f.readline())
        rows = [json.loads(line) for line in f]
    steps = {c: np.array([row[i] for row in rows]) for i, c in enumerate(header["columns"])}
    return RecordedRun(header["model"], header["engine"], header["figures"],
                       np.array(header["requests"], np.int64), steps)


def timed_steps(run: RecordedRun) -> TimedSteps:
    """The run's steps, each with its load, device time read from the trace
    (:func:`~minijax_serve.simulate.calibration.overlapped_step_times`) and group."""
    s = run.steps
    kinds = s["kind"].tolist()
    loads = [StepLoad(int(s["bucket_tokens"][i]), *(int(s[c][i]) for c in LOAD_COLUMNS))
             for i in range(len(kinds))]
    groups = [step_group(k, t, n) for k, t, n in zip(kinds, s["bucket_tokens"].tolist(),
                                                      s["bucket_seqs"].tolist())]
    return TimedSteps(loads, overlapped_step_times(s["start_s"], s["blocked_ms"], kinds), groups)
