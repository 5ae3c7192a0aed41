"""The persistent compilation cache: what a second engine of the same shapes compiles.

    python benchmarks/compile_cache.py                          # the tiny Llama, dummy weights
    python benchmarks/compile_cache.py --model smollm2-135m     # SmolLM2 (its real weights)
    python benchmarks/compile_cache.py --off                    # the same with the cache off
    python benchmarks/compile_cache.py --workers 1,0            # cold warm-ups, 1 and all CPUs

Into an empty temporary ``$MINIJAX_SERVE_CACHE`` (so the compilation cache starts cold in
``$MINIJAX_SERVE_CACHE/jax``): process 1 creates an engine, warms it up (every program the
configuration can run), drops it and does it again; process 2, started after it, does it once.
Prints, per engine: its creation time (weights load), ``warmup()`` wall time, the runner's
``compile_time_s`` (lowering and compiling, or loading from the cache) and programs compiled.
``--off`` sets ``MINIJAX_SERVE_COMPILATION_CACHE=0`` in both processes.

``--workers 1,0``: instead, one process per value, each with an empty cache, warming up one
engine with ``warmup(workers=value)`` (0: the default, one compilation per CPU for an
accelerator, one on CPU; give the number, e.g. ``1,2``, to compare on CPU): what compiling the
programs side by side saves on a cold start. ``--engine JSON`` adds engine arguments (the
bench's shapes, say); ``--output-json`` appends one line per engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY_LLAMA = {  # tests/bench/test_bench.py's config-only Llama (weights: load_format="dummy")
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 301,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
TINY_ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, max_total_tokens=1024,
                   max_running_requests=4)


def write_tiny_llama(path: Path, **overrides) -> Path:
    """A config-only tiny Llama directory (run it with ``load_format="dummy"``): ``TINY_LLAMA``
    with ``overrides`` (config.json fields) on top."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return path


def child(model: str, engine_kwargs: dict, engines: int, workers: int = 0) -> None:
    """Create, warm up and drop ``engines`` engines; print one JSON line per engine."""
    import gc

    from minijax_serve import Engine
    from minijax_serve.engine.compilation_cache import enable_compilation_cache
    from minijax_serve.executor.model_runner import default_compile_workers

    cache_dir = enable_compilation_cache()  # what every Engine does; here to print the dir
    for i in range(engines):
        start = time.perf_counter()
        engine = Engine(model, **engine_kwargs)
        created = time.perf_counter()
        programs = engine.warmup(workers or None)
        warm = time.perf_counter()
        print(json.dumps(dict(engine=i + 1, create_s=created - start, warmup_s=warm - created,
                              compile_time_s=engine.runner.compile_time_s, programs=programs,
                              workers=workers or default_compile_workers(),
                              cache_dir=cache_dir)), flush=True)
        del engine
        gc.collect()


def run_child(spec: dict, env: dict) -> list[dict]:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (default) or a model alias / dir")
    parser.add_argument("--max-total-tokens", type=int, default=16384,
                        help="KV pool of a non-tiny model")
    parser.add_argument("--off", action="store_true", help="MINIJAX_SERVE_COMPILATION_CACHE=0")
    parser.add_argument("--workers", default=None,
                        help="comma-separated compile workers (0: one per CPU): cold warm-ups, "
                             "one process each, each with an empty cache")
    parser.add_argument("--engine", default="{}", help="JSON: more Engine arguments")
    parser.add_argument("--output-json", default=None, help="append one JSON line per engine")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON: model, engine kwargs, ...
    args = parser.parse_args()
    if args.child:
        child(**json.loads(args.child))
        return

    from minijax_serve.models.registry import resolve_model

    rows = []
    with tempfile.TemporaryDirectory() as cache:
        if args.model == "tiny":
            model, kwargs = str(write_tiny_llama(Path(cache) / "tiny-llama")), TINY_ENGINE
        else:  # resolved before the cache moves: converting SmolLM2 again is not timed
            model = str(resolve_model(args.model).path)
            kwargs = dict(max_total_tokens=args.max_total_tokens)
        kwargs = {**kwargs, **json.loads(args.engine)}
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        if args.off:
            env["MINIJAX_SERVE_COMPILATION_CACHE"] = "0"
        print(f"model {args.model}, compilation cache {'off' if args.off else 'on'}, "
              f"engine {json.dumps(kwargs)}")
        print(f"{'process':>7} {'engine':>6} {'workers':>7} {'create s':>9} {'warmup s':>9} "
              f"{'compile_time_s':>14} {'programs':>8}")
        if args.workers is None:
            runs = [(1, 2, 0, cache), (2, 1, 0, cache)]
        else:
            runs = [(i + 1, 1, int(w), tempfile.mkdtemp(dir=cache))
                    for i, w in enumerate(args.workers.split(","))]
        for process, engines, workers, cache_root in runs:
            spec = dict(model=model, engine_kwargs=kwargs, engines=engines, workers=workers)
            for r in run_child(spec, dict(env, MINIJAX_SERVE_CACHE=cache_root)):
                rows.append(dict(r, process=process, model=args.model, cache=not args.off))
                print(f"{process:>7} {r['engine']:>6} {r['workers']:>7} {r['create_s']:>9.2f} "
                      f"{r['warmup_s']:>9.2f} {r['compile_time_s']:>14.2f} {r['programs']:>8}")
    if args.output_json:
        with open(args.output_json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
