"""Whole engine steps against the roofline: a decode step's bytes/s, a prefill step's MFU.

The engine's own step programs (model and sampler, as ``Engine.step`` dispatches them: the mesh,
the attention backend, the layer loop), for any model shape with dummy weights (a step's time
does not depend on their values), on synthetic batches written straight into a ForwardBatch:

* ``decode``: ``--num-seqs`` sequences of one new token, each the last of its ``--context``
  tokens (the KV read is real: every sequence has pages of its own);
* ``prefill``: ``--prefill-tokens`` new tokens, fresh prompts of ``--prompt-len`` tokens each
  (the last one shorter), one step.

Each step is dispatched ``--inner`` times back to back and blocked once (the device's own time,
launches included, as ``device_idle.py`` measures it); the median of ``--repeats`` such samples.
Against the ceilings measured in the same process (``minijax_serve.executor.ceilings``):

* decode: bytes = weights read (every parameter but an untied embedding table) + the K and V of
  every key read, each of every layer; bandwidth share = bytes / step time / the copy bandwidth
  (bytes read + written per second, the convention of every figure here);
* prefill: FLOPs = what the step computes, counted as the bench's MFU counts it
  (``minijax_serve.bench.metrics``): 2 x the layers' parameters x new tokens, 2 x the LM head's
  x sequences (only each one's last token gets logits; the embedding is a gather), and 4 x
  heads x head_dim x layers per visible (query, key) pair; MFU = FLOPs / step time / the
  matmul peak of the dtype.

``--profile``: then each step traced (``op_profile.py``), its kernels' self time per step: where
the time goes, for a step short of its roofline.

    python benchmarks/step_roofline.py --model qwen3-0.6b --dtype bfloat16
    python benchmarks/step_roofline.py --model qwen3-0.6b llama-3-8b --num-seqs 64 128
    python benchmarks/step_roofline.py --mode decode --quantization none fp8 \
        --kv-cache-dtype auto fp8_e4m3            # bf16 beside FP8 weights and KV
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from op_profile import print_op_times, trace_events  # noqa: E402

from minijax_serve.bench.metrics import dense_params, weight_bytes  # noqa: E402
from minijax_serve.executor import ceilings  # noqa: E402
from minijax_serve.executor.buckets import StepShape  # noqa: E402
from minijax_serve.executor.forward_batch import ForwardBatch, empty_forward_batch  # noqa: E402


def synthetic_batch(shape: StepShape, q_lens: list[int], kv_lens: list[int], page_size: int,
                    vocab: int, rng: np.random.Generator) -> ForwardBatch:
    """Sequence i computes its last ``q_lens[i]`` of ``kv_lens[i]`` tokens, on pages of its own
    (from page 1; page 0 is the scratch page the padding writes to)."""
    fb = empty_forward_batch(shape)
    s = len(q_lens)
    q, kv = np.array(q_lens, np.int32), np.array(kv_lens, np.int32)
    pages = -(-kv // page_size)
    first = 1 + np.cumsum(pages) - pages
    for i in range(s):
        fb.page_table[i, :pages[i]] = np.arange(first[i], first[i] + pages[i])
    cu = np.zeros(shape.num_seqs + 1, np.int32)
    cu[1:s + 1] = np.cumsum(q)
    cu[s + 1:] = cu[s]
    t = int(cu[s])
    seq = np.repeat(np.arange(s), q)
    pos = np.concatenate([np.arange(k - n, k) for n, k in zip(q, kv)]).astype(np.int32)
    fb.cu_q_lens[:] = cu
    fb.kv_lens[:s] = kv
    fb.positions[:t] = pos
    fb.slot_mapping[:t] = fb.page_table[seq, pos // page_size] * page_size + pos % page_size
    fb.input_ids[:t] = rng.integers(0, vocab, t)
    fb.sample_slots[:s] = np.arange(s)
    return fb


def time_step(runner, fb: ForwardBatch, shape: StepShape, inner: int, repeats: int) -> dict:
    start = time.perf_counter()
    runner.compile_all([shape])
    compile_s = time.perf_counter() - start
    jax.block_until_ready(runner.run(fb, shape).tokens)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = runner.run(fb, shape)
        jax.block_until_ready(out.tokens)
        samples.append((time.perf_counter() - start) / inner)
    return {"step_s": float(np.median(samples)), "min_s": min(samples),
            "spread": (max(samples) - min(samples)) / float(np.median(samples)),
            "compile_s": compile_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen3-0.6b"], help="one or more, in turn")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--quantization", nargs="+", default=["none"],
                   choices=("none", "fp8", "fp8_w8a8"),
                   help="weights, one run per value (paired with --kv-cache-dtype's)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=("auto", "fp8_e4m3"),
                   help="KV cache, one per --quantization value (one value: for every run)")
    p.add_argument("--mode", nargs="+", choices=("decode", "prefill"),
                   default=["decode", "prefill"])
    p.add_argument("--num-seqs", type=int, nargs="+", default=[64], help="decode batches")
    p.add_argument("--context", type=int, default=2048, help="KV tokens per decode sequence")
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=1024, help="tokens per prefill prompt")
    p.add_argument("--inner", type=int, default=10, help="steps per sample (back to back)")
    p.add_argument("--repeats", type=int, default=5, help="samples; the median is reported")
    p.add_argument("--matmul-size", type=int, default=None, help="default: ceilings'")
    p.add_argument("--copy-mib", type=int, default=None, help="default: ceilings'")
    p.add_argument("--output-json", default=None, help="append one JSON line per step")
    p.add_argument("--profile", action="store_true",
                   help="then trace each step: its ops' self time (op_profile.py)")
    args = p.parse_args(argv)

    kv = args.kv_cache_dtype * (len(args.quantization) if len(args.kv_cache_dtype) == 1 else 1)
    if len(kv) != len(args.quantization):
        p.error("give one --kv-cache-dtype, or one per --quantization value")
    copy_bw = ceilings.copy_bandwidth(args.copy_mib or ceilings.default_copy_mib())
    peaks: dict[str, float] = {}
    for model in args.model:
        for quantization, kv_cache_dtype in zip(args.quantization, kv):
            run_model(model, args, copy_bw, peaks,
                      None if quantization == "none" else quantization, kv_cache_dtype)
            gc.collect()  # the engine, its weights and pools, before the next one's


def run_model(model: str, args: argparse.Namespace, copy_bw: float, peaks: dict[str, float],
              quantization: str | None = None, kv_cache_dtype: str = "auto") -> None:
    """Time the steps of ``args`` on ``model`` (its weights ``quantization``, its KV cache in
    ``kv_cache_dtype``); ``peaks``: the matmul peak by dtype, measured once."""
    from minijax_serve import Engine

    prompts = -(-args.prefill_tokens // args.prompt_len) if "prefill" in args.mode else 0
    decode_seqs = max(args.num_seqs) if "decode" in args.mode else 0
    context = max(args.context if decode_seqs else 0, args.prompt_len if prompts else 0)
    page = 16
    pool = (decode_seqs * -(-args.context // page) + prompts * -(-args.prompt_len // page)
            + 2) * page
    engine = Engine(model, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
                    attention_backend=args.attention_backend, page_size=page,
                    context_length=1 << (context - 1).bit_length(), max_total_tokens=pool,
                    max_running_requests=max(decode_seqs, prompts, 1), enable_overlap=False,
                    quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    runner, cfg, itemsize = engine.runner, engine.model_config, np.dtype(engine.dtype).itemsize
    weights = weight_bytes(cfg, itemsize, quantization is not None)  # FP8: a byte a weight
    dtype = engine.dtype
    name = np.dtype(dtype).name
    if name not in peaks:
        peaks[name] = ceilings.matmul_peak_flops(
            dtype, args.matmul_size or ceilings.default_matmul_size())
    peak = peaks[name]
    width = engine.context_length // page
    rng = np.random.default_rng(0)
    kv_per_token = cfg.kv_bytes_per_token(runner.k_pool.dtype.itemsize)
    attn_per_pair = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    dense, head_params = dense_params(cfg), cfg.hidden_size * cfg.vocab_size
    variant = f" weights {quantization or 'as dtype'}, KV {kv_cache_dtype}"
    print(f"{model} {np.dtype(dtype).name}{variant} on {jax.devices()[0].device_kind} "
          f"({engine.attention_backend} attention): copy {copy_bw / 1e9:.1f} GB/s "
          f"(read + written), matmul peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    steps = [("decode", n, [1] * n, [args.context] * n) for n in args.num_seqs
             if "decode" in args.mode]
    if prompts:
        q = [args.prompt_len] * (prompts - 1)
        q.append(args.prefill_tokens - sum(q))
        steps.append(("prefill", prompts, q, q))
    for mode, n, q, kv in steps:
        shape = StepShape(sum(q), n, width, mode == "decode" and engine.buckets.split_decode)
        fb = synthetic_batch(shape, q, kv, page, cfg.vocab_size, rng)
        r = time_step(runner, fb, shape, args.inner, args.repeats)
        nbytes = weights + sum(kv) * kv_per_token
        pairs = sum(a * b - a * (a - 1) // 2 for a, b in zip(q, kv))
        flops = 2.0 * dense * sum(q) + 2.0 * head_params * n + attn_per_pair * pairs
        row = {"model": model, "dtype": np.dtype(dtype).name, "quantization": quantization,
               "kv_cache_dtype": kv_cache_dtype, "mode": mode, "num_seqs": n,
               "new_tokens": sum(q), "kv_tokens": sum(kv), "bytes": nbytes, "flops": flops,
               **r, "bandwidth_share": nbytes / r["step_s"] / copy_bw,
               "mfu": flops / r["step_s"] / peak, "copy_bytes_per_s": copy_bw,
               "matmul_peak_flops": peak, "device": jax.devices()[0].device_kind,
               "attention_backend": engine.attention_backend}
        print(f"{mode:<8} {n:>4} seqs, {sum(q):>6} new / {sum(kv):>7} KV tokens: "
              f"{r['step_s'] * 1e3:8.3f} ms (spread {r['spread'] * 100:.0f} %), "
              f"{nbytes / r['step_s'] / 1e9:8.1f} GB/s = {row['bandwidth_share'] * 100:5.1f} % "
              f"of copy, {flops / r['step_s'] / 1e12:7.2f} TFLOP/s = MFU {row['mfu'] * 100:5.1f} %"
              f"; compile {r['compile_s']:.1f} s", flush=True)
        if args.output_json:
            with open(args.output_json, "a") as f:
                f.write(json.dumps(row) + "\n")
        if args.profile:
            print_op_times(trace_events(lambda: runner.run(fb, shape).tokens))


if __name__ == "__main__":
    main()
