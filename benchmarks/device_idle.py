"""Device idle between steps at a steady decode batch: the engine's tick against the step alone.

Fills an engine (dummy weights, no tokenizer) with ``--batch`` requests that decode for long
(``ignore_eos``), lets them all reach decoding, then times at that steady batch:

* tick: wall time per ``Engine.step()`` over ``--steps`` ticks, everything included
  (scheduling, lowering, dispatch, result processing; overlap as the engine is configured);
* device: the last tick's step (its model and sampler programs, same batch) dispatched
  ``--steps`` times back to back with no host work between them, blocked once at the end:
  the device's own time per step, kernel launches included.

The device's idle share of a tick is then about ``1 - device / tick`` (0 when the host keeps up
and the device never waits). Host time and time blocked per tick come from ``Engine.stats()``.
The replay rewrites the batch's KV slots and token-buffer rows, so the engine is discarded after.

    PYTHONPATH=. python benchmarks/device_idle.py --model qwen3-0.6b --dtype bfloat16 --batch 64
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64, help="running requests (default 64)")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200, help="timed ticks, and replayed steps")
    ap.add_argument("--warm", type=int, default=20, help="decode ticks before timing")
    ap.add_argument("--no-overlap", action="store_true", help="enable_overlap=False")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--output-json", metavar="FILE", help="append one JSON object")
    args = ap.parse_args()

    from minijax_serve import Engine, SamplingParams

    max_new = args.warm + 2 * args.steps + 16
    context = args.input_len + max_new
    engine = Engine(args.model, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
                    max_running_requests=args.batch, min_seq_bucket=args.batch,
                    max_prefill_tokens=args.batch * args.input_len,
                    min_token_bucket=args.batch * args.input_len, chunked_prefill_size=-1,
                    context_length=context, max_total_tokens=args.batch * (context + 16),
                    enable_overlap=not args.no_overlap, attention_backend=args.attention_backend)
    start = time.perf_counter()
    engine.warmup()
    compiled = len(engine.buckets.all_shapes())
    compile_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    for _ in range(args.batch):
        engine.add_request(rng.integers(0, vocab, args.input_len).tolist(),
                           SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    last = {}
    run = engine.runner.run
    engine.runner.run = lambda fb, shape, *rest: (last.update(fb=fb, shape=shape), run(fb, shape))[1]

    def decoding() -> int:
        return engine.stats()["decode_steps"]

    while decoding() < args.warm:
        engine.step()
    assert not engine.scheduler.waiting, "every request must be running"
    before, t0 = engine.stats(), time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    tick_s = (time.perf_counter() - t0) / args.steps
    after = engine.stats()
    assert after["prefill_steps"] == before["prefill_steps"], "a prefill ran in the timed ticks"

    engine.step()  # the last dispatched step's tokens
    fb, shape = last["fb"], last["shape"]
    jax.block_until_ready(run(fb, shape))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        tokens = run(fb, shape)
    jax.block_until_ready(tokens)
    device_s = (time.perf_counter() - t0) / args.steps

    host_ms = 1e3 * (after["host_time_s"] - before["host_time_s"]) / args.steps
    blocked_ms = 1e3 * (after["blocked_time_s"] - before["blocked_time_s"]) / args.steps
    result = {
        "kind": "device_idle", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": args.model, "dtype": args.dtype, "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
        "batch": args.batch, "seq_bucket": shape.num_seqs, "page_width": shape.num_pages,
        "enable_overlap": not args.no_overlap, "steps": args.steps,
        "attention_backend": engine.attention_backend,
        "layer_loop": engine.runner.layer_loop, "compiled_shapes": compiled,
        "compile_time_s": compile_s, "tick_ms": 1e3 * tick_s, "device_step_ms": 1e3 * device_s,
        "host_ms_per_tick": host_ms, "blocked_ms_per_tick": blocked_ms,
        "device_idle_fraction": max(0.0, 1.0 - device_s / tick_s),
    }
    print(json.dumps(result, indent=1))
    if args.output_json:
        with open(args.output_json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
