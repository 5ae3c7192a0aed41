"""Scheduler overhead: host time per engine tick, with a null model runner.

A real :class:`~minijax_serve.Engine` (its scheduler, KV ledgers, batch lowering and output
handling) is built on a tiny Llama with dummy weights, and ``engine.runner.run`` is replaced by a
function that returns a fixed token for every sequence of the lowered batch at once: no device
work, so the time of ``Engine.step`` is the host's time per tick. Reported in microseconds per
tick versus the number of running requests and of waiting requests:

* decode ticks: ``running`` requests decode; ``waiting`` more are queued behind them and cannot
  be admitted (every request slot is taken), so each tick also tries, and fails, to admit them.
* prefill ticks: ``running`` requests hold their KV; each tick admits ``--prefill-batch`` new
  requests of ``--prompt-len`` tokens (they need one output token, so they finish within the
  tick and the state stays the same for the next one), with ``waiting`` more queued behind.

Columns: "batch" is the requests that got a token per tick (a check: ``running`` for decode,
``--prefill-batch`` for prefill); "µs/tick" the median host time of a tick and "(min)" its
fastest (less disturbed by other processes on a shared machine); the median is split at the
runner call into "sched+lower" (scheduling and lowering the batch to numpy) and "process"
(appending tokens, stop checks, freeing, building the outputs).

Detokenization is measured on its own (``detok`` column, same for every ``waiting``): a request
without stop strings need not be detokenized every step, so it is a separate cost. It is the
engine's incremental :class:`~minijax_serve.frontend.detokenizer.Detokenizer` over ``running`` requests,
each receiving one token per tick, with the SmolLM2 tokenizer (text of this repository's
README as the token stream); ``n/a`` when that tokenizer cannot be loaded.

    python benchmarks/bench_scheduler.py            # the full table
    python benchmarks/bench_scheduler.py --quick    # a small one (seconds)
    python benchmarks/bench_scheduler.py --record-steps   # with the step trace on
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from anywhere: the package of this working tree
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from compile_cache import write_tiny_llama  # noqa: E402
from detok_ticks import bench_detok, load_detok_tokenizer  # noqa: E402,F401

# one layer, one KV head: the smallest model the engine's host work sees in full
TINY_OVERRIDES = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      tie_word_embeddings=True)

FIXED_TOKEN = 7  # what the null runner "samples" (never an EOS of the tiny model)
TARGET_US = 2000  # issue 4: decode tick at 256 running <= 2 ms, excluding detokenization


class NullRunner:
    """Stands in for ``ModelRunner.run``: fixed tokens for the batch's sequences, at once; records
    when it was called (the split between scheduling/lowering and processing)."""

    def __init__(self) -> None:
        self.called_at = 0

    def __call__(self, fb: Any, shape: Any, prompt_targets: Any = None,
                 token_mask: Any = None) -> Any:
        from minijax_serve.executor.model_runner import StepOutput

        self.called_at = time.perf_counter_ns()
        return StepOutput(np.full(len(fb.kv_lens), FIXED_TOKEN, np.int32), None, None)


def pool_tokens(args: argparse.Namespace) -> int:
    """One KV pool size for every cell (the largest any needs; one pool shape, so JAX builds its
    zeros once): every running request's prompt and reserved outputs, plus a prefill batch."""
    max_new = max(args.warm + args.ticks + 8, 16)
    per_req = -(-(args.prompt_len + max_new) // args.page_size) * args.page_size
    return (max(args.running) + 2 * args.prefill_batch) * per_req + 64 * args.page_size


def make_engine(model_dir: Path, args: argparse.Namespace, max_running: int, pool_tokens: int,
                max_prefill_tokens: int | None = None):
    from minijax_serve import Engine

    # chunked prefill off: a prefill tick admits --prefill-batch whole prompts (the CPU default
    # chunk, 512 tokens, would split them over several ticks)
    engine = Engine(model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
                    page_size=args.page_size, context_length=args.context_length,
                    max_running_requests=max_running, max_total_tokens=pool_tokens,
                    max_prefill_tokens=max_prefill_tokens or args.max_prefill_tokens,
                    chunked_prefill_size=-1, record_steps=args.record_steps,
                    schedule_policy=args.policy)
    null = NullRunner()
    engine.runner.run = null
    return engine, null


def add_requests(engine: Any, rng: np.random.Generator, n: int, prompt_len: int,
                 max_new_tokens: int, vocab: int) -> None:
    from minijax_serve import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    prompts = rng.integers(3, vocab, size=(n, prompt_len)).tolist()  # distinct, no EOS
    for prompt in prompts:
        engine.add_request(prompt, params)


def admit_all(engine: Any, n: int) -> None:
    """Step until ``n`` requests produced their first token (all admitted and running)."""
    seen: set[str] = set()
    for _ in range(10 * n + 10):
        seen.update(o.request_id for o in engine.step())
        if len(seen) >= n:
            return
    raise RuntimeError(f"only {len(seen)} of {n} requests were admitted")


def time_ticks(engine: Any, null: NullRunner, warm: int, ticks: int,
               expect: str) -> dict[str, Any]:
    """Median host time of ``ticks`` engine steps (after ``warm``), split at the runner call."""
    from minijax_serve.bench.driver import step_counts, step_kind

    totals, before_run, kinds, seqs = [], [], set(), []
    for i in range(warm + ticks):
        counts = step_counts(engine)
        start = time.perf_counter_ns()
        outputs = engine.step()
        end = time.perf_counter_ns()
        seqs.append(len(outputs))
        kinds.add(step_kind(counts, step_counts(engine)))
        if i >= warm:
            totals.append(end - start)
            before_run.append(null.called_at - start if null.called_at >= start else end - start)
    tick = statistics.median(totals) / 1e3
    sched = statistics.median(before_run) / 1e3
    kind = kinds.pop() if len(kinds) == 1 else "+".join(sorted(kinds))
    if kind != expect:
        print(f"  note: expected {expect} ticks, got {kind}", file=sys.stderr)
    return {"kind": kind, "tick_us": tick, "sched_lower_us": sched,
            "process_us": tick - sched, "min_tick_us": min(totals) / 1e3,
            "mean_tick_us": statistics.fmean(totals) / 1e3,
            "seqs_per_tick": statistics.median(seqs[warm:])}


def bench_decode(model_dir: Path, args: argparse.Namespace, running: int, waiting: int,
                 vocab: int) -> dict[str, Any]:
    max_new = args.warm + args.ticks + 8
    engine, null = make_engine(model_dir, args, running, pool_tokens(args))
    rng = np.random.default_rng(running * 7 + waiting)
    add_requests(engine, rng, running, args.prompt_len, max_new, vocab)
    admit_all(engine, running)
    add_requests(engine, rng, waiting, args.prompt_len, max_new, vocab)  # no free slot: wait
    return _checked(time_ticks(engine, null, args.warm, args.ticks, "decode"), running)


def _checked(row: dict[str, Any], expected_seqs: int) -> dict[str, Any]:
    if row["seqs_per_tick"] != expected_seqs:
        print(f"  note: {row['seqs_per_tick']} requests per tick, expected {expected_seqs}",
              file=sys.stderr)
    return row


def bench_prefill(model_dir: Path, args: argparse.Namespace, running: int, waiting: int,
                  vocab: int) -> dict[str, Any]:
    k = args.prefill_batch
    ticks = args.warm + args.prefill_ticks
    max_new = 16
    # 2k slots: with overlap a tick's finished prefills hold their slots until the next tick
    # has been dispatched, so k more are needed to admit k new requests every tick; the token
    # budget of k prompts keeps it at k
    engine, null = make_engine(model_dir, args, running + 2 * k, pool_tokens(args),
                               max_prefill_tokens=k * args.prompt_len)
    rng = np.random.default_rng(running * 11 + waiting)
    add_requests(engine, rng, running, args.prompt_len, max_new, vocab)
    admit_all(engine, running)
    add_requests(engine, rng, ticks * k, args.prompt_len, 1, vocab)  # k per tick, done at once
    add_requests(engine, rng, waiting, args.prompt_len, max_new, vocab)
    return _checked(time_ticks(engine, null, args.warm, args.prefill_ticks, "prefill"), k)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def render(rows: list[dict[str, Any]]) -> str:
    head = ("tick", "running", "waiting", "batch", "µs/tick", "(min)", "sched+lower", "process",
            "µs/running req", "detok µs/tick")
    widths = (8, 8, 8, 7, 10, 9, 12, 10, 15, 14)
    lines = ["".join(h.rjust(w) for h, w in zip(head, widths))]
    for r in rows:
        cells = (r["kind"], str(r["running"]), str(r["waiting"]), f"{r['seqs_per_tick']:g}",
                 _fmt(r["tick_us"]), _fmt(r["min_tick_us"]), _fmt(r["sched_lower_us"]),
                 _fmt(r["process_us"]), f"{r['tick_us'] / r['running']:.2f}",
                 _fmt(r.get("detok_us")) if r["kind"] == "decode" else "")
        lines.append("".join(c.rjust(w) for c, w in zip(cells, widths)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a small table for a test: running 16, 64; waiting 0, 100; 3 ticks")
    p.add_argument("--running", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--waiting", type=int, nargs="+", default=[0, 1000, 10000])
    p.add_argument("--ticks", type=int, default=20, help="timed decode ticks per cell")
    p.add_argument("--prefill-ticks", type=int, default=10, help="timed prefill ticks per cell")
    p.add_argument("--warm", type=int, default=3, help="untimed ticks before them")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of every prompt")
    p.add_argument("--prefill-batch", type=int, default=16,
                   help="requests admitted by each prefill tick")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--policy", default="fcfs",
                   help="schedule_policy (dfs-weight, and lpm below lpm_max_queue, match "
                        "every waiting request on each prefill attempt)")
    p.add_argument("--context-length", type=int, default=4096,
                   help="sets the page-table width the lowering fills (default: 4096)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--no-detok", action="store_true", help="skip the detokenizer column")
    p.add_argument("--record-steps", action="store_true",
                   help="engines with record_steps=True (the step trace's cost per tick)")
    p.add_argument("--output-json", metavar="FILE", help="write the rows as JSON")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs on a device (before jax loads)
    if args.quick:
        args.running, args.waiting = [16, 64], [0, 100]
        args.ticks, args.prefill_ticks, args.warm = 3, 3, 1
    if args.prompt_len * args.prefill_batch > args.max_prefill_tokens:
        p.error("--prompt-len x --prefill-batch must fit in --max-prefill-tokens")

    import jax

    vocab = 512
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    tokenizer = None if args.no_detok else load_detok_tokenizer()
    detok: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_llama(Path(tmp) / "tiny-llama", **TINY_OVERRIDES, vocab_size=vocab,
                                     max_position_embeddings=args.context_length)
        for kind, fn in (("decode", bench_decode), ("prefill", bench_prefill)):
            for running in args.running:
                for waiting in args.waiting:
                    row = {"running": running, "waiting": waiting,
                           **fn(model_dir, args, running, waiting, vocab)}
                    if kind == "decode" and tokenizer is not None:
                        if running not in detok:
                            detok[running] = bench_detok(tokenizer, running, args.warm,
                                                         args.ticks)
                        row["detok_us"] = detok[running]
                    rows.append(row)
                    print(f"  {kind:7s} running={running:<5d} waiting={waiting:<6d} "
                          f"{row['tick_us']:,.0f} µs/tick", file=sys.stderr, flush=True)
    print(f"\nScheduler host time per tick (null model runner; median (and min) of "
          f"{args.ticks} decode / {args.prefill_ticks} prefill ticks; prompts {args.prompt_len} tokens, prefill ticks "
          f"admit {args.prefill_batch}; context {args.context_length}, page {args.page_size}; "
          f"jax {jax.__version__}, {os.cpu_count()} CPUs)")
    print(render(rows))
    at256 = [r["tick_us"] for r in rows if r["kind"] == "decode" and r["running"] == 256]
    if at256:
        worst = max(at256)
        verdict = "met" if worst <= TARGET_US else "NOT met"
        print(f"\nTarget: decode tick at 256 running <= {TARGET_US} µs excluding detokenization: "
              f"{worst:,.0f} µs (worst over waiting) -> {verdict}")
    print(f"({time.perf_counter() - start:.1f} s in all)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
