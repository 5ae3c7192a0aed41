"""``--plot FILE.png``: output tokens/s over time, TTFT and E2E latency CDFs, and per engine run
its batch composition and KV usage over time.

One figure. Its first row, three panels, has every run of the invocation (one per ``--compare``
value) and the baseline when there is one. The engine's throughput is its output tokens binned
over time (each token at the time it reached the host). HF's static batches deliver their tokens
all at once, so its throughput is drawn per batch (the batch's own output tokens over its
duration) and its E2E latencies are the completion times of the batches (every request arrives
at the start); it has no TTFT curve.

Then one row per run with a step trace (the in-process engine; ``bench`` records its steps when
plotting): the prefill and decode tokens of each step, stacked, under the padded new tokens of
the bucket it ran in, and the KV tokens held by requests against the pool. Each step spans from
the start of the tick that dispatched it to the next one's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NUM_BINS = 40


def _cdf(ax: Any, values: Sequence[float], label: str, **style: Any) -> None:
    if not len(values):
        return
    x = np.sort(np.asarray(values, dtype=np.float64))
    y = np.arange(1, len(x) + 1) / len(x)
    ax.step(np.concatenate([[0.0], x]), np.concatenate([[0.0], y]), where="post", label=label,
            **style)


def _steps_row(ax_batch: Any, ax_kv: Any, steps: dict[str, np.ndarray], end: float,
               label: str) -> None:
    """Batch composition and KV usage of one run's steps (``trace.to_columns``, ``start_s`` in
    seconds since the run's start) until ``end``."""
    start = steps["start_s"]
    edges = np.append(start, max(end, start[-1]))
    prefill, decode = steps["prefill_tokens"], steps["decode_tokens"]
    ax_batch.stairs(prefill, edges, fill=True, alpha=0.8, label="prefill tokens")
    ax_batch.stairs(prefill + decode, edges, baseline=prefill, fill=True, alpha=0.8,
                    label="decode tokens")
    ax_batch.stairs(steps["bucket_tokens"], edges, color="black", linewidth=0.8,
                    label="bucket (padded) tokens")
    ax_batch.set(title=f"{label}: batch composition per step", xlabel="time since start (s)",
                 ylabel="new tokens per step")
    ax_kv.stairs(steps["kv_tokens_used"], edges, fill=True, alpha=0.6, label="KV tokens used")
    ax_kv.axhline(steps["kv_pool_tokens"][0], color="black", linestyle="--", label="KV pool")
    ax_kv.set(title=f"{label}: KV usage", xlabel="time since start (s)", ylabel="tokens")


def figure(traces: Sequence[dict[str, Any]], baseline: dict[str, Any] | None,
           title: str = "minijax_serve bench") -> Figure:
    """The matplotlib figure of every trace (``label``, ``token_times``, ``ttft``, ``e2e``,
    ``duration``; seconds; optionally ``steps``, its step trace's columns) and the baseline."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure

    stepped = [t for t in traces if "steps" in t]
    fig = Figure(figsize=(16, 4.5 + 3.5 * len(stepped)))
    grid = fig.add_gridspec(1 + len(stepped), 3)
    ax_tp, ax_ttft, ax_e2e = (fig.add_subplot(grid[0, i]) for i in range(3))
    horizon = max([t["duration"] for t in traces] +
                  ([baseline["duration_s"]] if baseline else []) + [1e-6])
    width = horizon / NUM_BINS
    edges = np.arange(NUM_BINS + 1) * width
    for trace in traces:
        counts, _ = np.histogram(trace["token_times"], bins=edges)
        end = max(trace["duration"], width)
        keep = edges[:-1] < end
        ax_tp.step(edges[:-1][keep], (counts / width)[keep], where="post", label=trace["label"])
        _cdf(ax_ttft, trace["ttft"], trace["label"])
        _cdf(ax_e2e, trace["e2e"], trace["label"])
    if baseline:
        label = f"hf transformers (batch {baseline['batch_size']})"
        xs, ys = [], []
        for (start, end), tokens in zip(baseline["batch_times_s"], baseline["batch_output_tokens"]):
            xs += [start, end]
            ys += [tokens / max(end - start, 1e-9)] * 2
        ax_tp.plot(xs, ys, color="black", linestyle="--", label=label + ", per batch")
        _cdf(ax_e2e, baseline["request_finish_s"], label, color="black", linestyle="--")
    ax_tp.set(title="Output throughput over time", xlabel="time since start (s)",
              ylabel="output tokens/s")
    ax_ttft.set(title="Time to first token, CDF", xlabel="TTFT (s)", ylabel="fraction of requests")
    ax_e2e.set(title="End-to-end latency, CDF", xlabel="E2E latency (s)",
               ylabel="fraction of requests")
    step_axes = []
    for row, trace in enumerate(stepped, start=1):
        ax_batch, ax_kv = fig.add_subplot(grid[row, :2]), fig.add_subplot(grid[row, 2])
        _steps_row(ax_batch, ax_kv, trace["steps"], trace["duration"], trace["label"])
        ax_batch.set_xlim(right=horizon)
        ax_kv.set_xlim(right=horizon)
        step_axes += [ax_batch, ax_kv]
    for ax in (ax_tp, ax_ttft, ax_e2e, *step_axes):
        ax.grid(alpha=0.3)
        ax.set_xlim(left=0)
        ax.legend(fontsize=8)
    for ax in (ax_tp, *step_axes):
        ax.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_runs(path: str, traces: Sequence[dict[str, Any]], baseline: dict[str, Any] | None,
              title: str = "minijax_serve bench") -> None:
    """Draw :func:`figure` of the traces and the baseline into ``path``."""
    figure(traces, baseline, title).savefig(path, dpi=110)
