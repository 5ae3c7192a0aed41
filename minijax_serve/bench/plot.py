"""``--plot FILE.png``: output tokens/s over time, and TTFT and E2E latency CDFs.

One figure, three panels, every run of the invocation (one per ``--compare`` value) and the
baseline when there is one. The engine's throughput is its output tokens binned over time (each
token at the time it reached the host). HF's static batches deliver their tokens all at once, so
its throughput is drawn per batch (the batch's own output tokens over its duration) and its E2E
latencies are the completion times of the batches (every request arrives at the start); it has
no TTFT curve.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

NUM_BINS = 40


def _cdf(ax: Any, values: Sequence[float], label: str, **style: Any) -> None:
    if not len(values):
        return
    x = np.sort(np.asarray(values, dtype=np.float64))
    y = np.arange(1, len(x) + 1) / len(x)
    ax.step(np.concatenate([[0.0], x]), np.concatenate([[0.0], y]), where="post", label=label,
            **style)


def plot_runs(path: str, traces: Sequence[dict[str, Any]], baseline: dict[str, Any] | None,
              title: str = "minijax_serve bench") -> None:
    """Draw every trace (``label``, ``token_times``, ``ttft``, ``e2e``, ``duration``; seconds)
    and the baseline's batches into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_ttft, ax_e2e) = plt.subplots(1, 3, figsize=(16, 4.5))
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
    for ax in (ax_tp, ax_ttft, ax_e2e):
        ax.grid(alpha=0.3)
        ax.set_xlim(left=0)
        ax.legend(fontsize=8)
    ax_tp.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
