"""EngineStats: the engine's counters, accumulated per step and per tick, read by ``stats()``."""

from __future__ import annotations

from typing import Any

import jax

from minijax_serve.speculative.speculator import spec_stats


class EngineStats:
    COUNTERS = ("prompt_tokens", "prefill_tokens_computed", "generated_tokens", "prefill_steps",
                "decode_steps", "mixed_steps", "chunked_steps", "peak_kv_tokens_used",
                "num_aborted", "step_tokens", "padded_step_tokens",
                "decode_seq_steps", "decode_output_tokens")

    def __init__(self):
        self.counts: dict[str, Any] = dict.fromkeys(self.COUNTERS, 0)
        self.counts.update(host_time_s=0.0, blocked_time_s=0.0)
        self._usage_sum = 0.0  # KV usage summed over steps, for its mean
        self._queued_steps, self._queued_usage_sum = 0, 0.0  # the same over steps with a queue
        self._wall_s = self._idle_bound_s = 0.0  # ticks' wall time, device-idle upper bound

    @property
    def steps(self) -> int:
        c = self.counts
        return c["prefill_steps"] + c["decode_steps"] + c["mixed_steps"]

    def on_launch(self, kind: str, used_tokens: int, pool_tokens: int, queued: bool,
                  prefill_tokens: int, chunked: bool, tokens: int, bucket_tokens: int) -> None:
        """A step of ``kind`` ("prefill_steps", "decode_steps" or "mixed_steps") was dispatched
        with ``used_tokens`` of the pool held (``queued``: requests left waiting); it computes
        ``tokens`` new tokens in a program of ``bucket_tokens``."""
        c = self.counts
        c["step_tokens"] += tokens
        c["padded_step_tokens"] += bucket_tokens
        c["peak_kv_tokens_used"] = max(c["peak_kv_tokens_used"], used_tokens)
        self._usage_sum += used_tokens / pool_tokens
        if queued:  # the pool is the limit
            self._queued_steps += 1
            self._queued_usage_sum += used_tokens / pool_tokens
        c[kind] += 1
        c["prefill_tokens_computed"] += prefill_tokens
        c["chunked_steps"] += chunked

    def on_tokens(self, num_tokens: int, decode_seqs: int, decode_tokens: int) -> None:
        """A step's requests took ``num_tokens``; ``decode_seqs`` of them decoding (not a
        prefill's first token) took ``decode_tokens`` (several each from a verify)."""
        c = self.counts
        c["generated_tokens"] += num_tokens
        c["decode_seq_steps"] += decode_seqs
        c["decode_output_tokens"] += decode_tokens

    def on_tick(self, wall: float, blocked: float, overlap: bool) -> None:
        """A tick that launched or processed a step took ``wall`` seconds, ``blocked`` of them
        waiting for the device."""
        self.counts["host_time_s"] += wall - blocked
        self.counts["blocked_time_s"] += blocked
        self._wall_s += wall
        # the device may have idled during the host's work when the host did not wait
        # for it (an upper bound); without overlap it idles through all of the host's work
        if not overlap or blocked < 1e-4:
            self._idle_bound_s += wall - blocked

    def means(self) -> dict[str, float]:
        steps, c = self.steps, self.counts
        per_step = (lambda x: x / steps) if steps else (lambda x: 0.0)
        return {
            "mean_token_usage": per_step(self._usage_sum),
            "mean_token_usage_queued": (self._queued_usage_sum / self._queued_steps
                                        if self._queued_steps else 0.0),
            "mean_host_ms_per_step": per_step(1e3 * c["host_time_s"]),
            "mean_blocked_ms_per_step": per_step(1e3 * c["blocked_time_s"]),
            "device_idle_fraction": self._idle_bound_s / self._wall_s if self._wall_s else 0.0,
            "padding_fraction": (1 - c["step_tokens"] / c["padded_step_tokens"]
                                 if c["padded_step_tokens"] else 0.0),
        }


def engine_stats(engine: Any) -> dict[str, float]:
    """An engine's counters since it started, and the current state of the pool and the ratio.

    ``cached_tokens``: tokens admissions took from the prefix cache instead of computing;
    ``prefill_tokens_computed``: tokens prefilled (re-prefills after a retract included);
    ``cache_hit_rate``: the cached share of both; ``evicted_tokens``: prefix-cache tokens
    evicted to make room. KV usage counts pages held by requests, not evictable cached ones:
    ``kv_tokens_used`` now, ``peak_kv_tokens_used``, ``token_usage`` (now, over the pool) and
    ``mean_token_usage`` (its mean over the steps run; ``mean_token_usage_queued`` over the
    steps that left requests waiting, when admission is what limits the batch).
    ``chunked_steps``: steps carrying a chunk of a prompt prefilled over several steps;
    ``mixed_steps``: prefill steps that also decoded; ``step_tokens``: new tokens the steps
    computed, ``padded_step_tokens`` their compiled shapes' (padding included),
    ``padding_fraction`` the padding's share of the latter; ``num_retracted``: requests sent back
    to the queue to free KV; ``num_aborted``: requests aborted; ``num_compilations``:
    programs compiled (step shapes, samplers, logprobs); ``weights_version``: updates of the
    weights served (``update_weights``). The mesh: ``tensor_parallel_size``
    (ways the model is split), ``num_devices`` (devices it runs on) and ``num_processes``
    (JAX processes). ``tokens_per_step``: output tokens a decoding request took per decode
    step (1 without speculative decoding); speculative decoding's ``spec_*`` counters and
    ratios: :func:`~minijax_serve.speculative.speculator.spec_stats`.

    Host and device: ``host_time_s`` (scheduling, lowering, dispatch, processing results),
    ``blocked_time_s`` (the host waiting for a step's tokens), their means per step, and
    ``device_idle_fraction``, an upper-bound estimate of the share of the ticks' wall time
    the device had nothing to do: without overlap all of the host's time; with overlap the
    host's time in the ticks where it never waited for the device."""
    c = engine._stats.counts
    cached, computed = engine.scheduler.cached_tokens, c["prefill_tokens_computed"]
    return {
        **engine._stats.counts,
        "cached_tokens": cached,
        "cache_hit_rate": cached / (cached + computed) if cached + computed else 0.0,
        "evicted_tokens": engine.scheduler.evicted_pages * engine.allocator.page_size,
        "num_compilations": engine.runner.num_compilations,
        "compile_time_s": engine.runner.compile_time_s,
        "weights_version": engine.weights_version,
        "kv_pool_tokens": engine.kv_pool_tokens,
        "kv_tokens_used": engine.kv_tokens_used,
        "token_usage": engine.kv_tokens_used / engine.kv_pool_tokens,
        "num_retracted": engine.scheduler.num_retracted,
        "new_token_ratio": engine.scheduler.ratio.value,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "num_devices": engine.num_devices,
        "num_processes": jax.process_count(),
        "tokens_per_step": (c["decode_output_tokens"] / c["decode_seq_steps"]
                            if c["decode_seq_steps"] else 0.0),
        **spec_stats(engine.speculator and engine.speculator.counts),
        **engine._stats.means(),
    }
