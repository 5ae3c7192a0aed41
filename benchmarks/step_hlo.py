"""Copies of the KV pool or of the weights in a compiled decode step, read from its HLO on this
CPU (benchmarks/RESULTS.md, "Where a decode step's time goes").

    python benchmarks/step_hlo.py

A tiny model of llama-3-8b's structure (GQA 4:1, SiLU MLP, untied LM head, no biases; 4 layers,
hidden 384) with a KV pool of 65,536 tokens; its decode step at 256 sequences (page table of
2,048 tokens), compiled by XLA on this CPU:

* ``xla/scan``: the CPU's defaults (the jnp attention, the layers in one scan);
* ``pallas/unroll``: a GPU's structure (the Pallas decode kernel, interpreted here; the layers
  written out), in float32 and bfloat16.

For each: the instructions of the optimized HLO whose result is as large as a quarter of a pool
or larger, by name (XLA names a fusion after what it does: ``wrapped_convert``,
``wrapped_scatter``, ...), the copies, transposes and converts of a weight matrix's shape, and
``memory_analysis()``'s temporary and aliased (donated) bytes. Then the same of the bfloat16
``pallas/unroll`` step lowered for CUDA (the HLO a GPU's compiler gets, before its passes: it
cannot be compiled without a GPU).
"""

from __future__ import annotations

import collections
import functools
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 3072,
              "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4,
              "num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 32,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "max_position_embeddings": 8192, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2}
SEQS, CONTEXT, POOL = 256, 2048, 65536
_LINE = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]")
_NUMBER = re.compile(r"[.]\d+$")
_MOVES = re.compile(r"(wrapped_)?(copy|transpose|convert)")


def engine(model_dir: Path, dtype: str, backend: str, loop: str):
    from minijax_serve import Engine

    return Engine(str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
                  attention_backend=backend, layer_loop=loop, page_size=16,
                  context_length=CONTEXT, max_total_tokens=POOL, max_running_requests=SEQS,
                  min_seq_bucket=64)


def results(hlo: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name without its number, result dims, element type) of each instruction."""
    out = []
    for line in hlo.splitlines():
        m = _LINE.match(line)
        if m:
            dims = tuple(int(d) for d in m.group(3).split(",") if d)
            out.append((_NUMBER.sub("", m.group(1)), dims, m.group(2)))
    return out


def report(hlo: str, runner) -> dict:
    """Pool-sized results by name; weight-shaped copies, transposes and converts."""
    pool = int(np.prod(runner.k_pool.shape))
    weights = {tuple(p.shape) for p in runner.params if p.ndim == 2}
    weights |= {w[::-1] for w in weights}
    found = results(hlo)
    pool_sized = collections.Counter(f"{name} ({dtype})" for name, dims, dtype in found
                                     if dims and np.prod(dims) >= pool // 4)
    moved = collections.Counter(f"{name} {'x'.join(map(str, dims))}" for name, dims, _ in found
                                if dims in weights and _MOVES.match(name))
    return {"pool_sized": dict(pool_sized), "weight_copies": dict(moved)}


def compiled_report(model_dir: Path, dtype: str, backend: str, loop: str) -> dict:
    e = engine(model_dir, dtype, backend, loop)
    runner = e.runner
    compiled = runner.compiled(e.buckets.decode_shape(SEQS, CONTEXT // 16))
    stats = compiled.memory_analysis()
    return {"variant": f"{backend}/{loop} {dtype}", "pool_bytes": 2 * runner.k_pool.nbytes,
            "temp_bytes": stats.temp_size_in_bytes, "alias_bytes": stats.alias_size_in_bytes,
            **report(compiled.as_text(), runner)}


def cuda_lowering(model_dir: Path) -> dict:
    """The bfloat16 pallas/unroll decode step lowered for CUDA, before XLA's passes."""
    import jax

    from minijax_serve.executor.forward_batch import empty_forward_batch, pack
    from minijax_serve.executor.step_functions import forward_step

    e = engine(model_dir, "bfloat16", "pallas", "unroll")
    r = e.runner
    shape = e.buckets.decode_shape(SEQS, CONTEXT // 16)
    f = functools.partial(forward_step, r.graphdef, r.param_tree, r.attention_backend, "unroll",
                          r.mesh, shape, r.max_logprobs)
    real = jax.default_backend
    jax.default_backend = lambda: "gpu"  # the attention takes the Triton kernels, not interpret
    try:
        lowered = jax.jit(f, donate_argnums=(1, 2)).trace(
            r.params, r.k_pool, r.v_pool, r.token_buf, pack(empty_forward_batch(shape))).lower(
            lowering_platforms=("cuda",))
    finally:
        jax.default_backend = real
    return {"variant": "pallas/unroll bfloat16 lowered for CUDA",
            "layers": TINY_LLAMA["num_hidden_layers"], **report(lowered.as_text(dialect="hlo"), r)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
        for dtype, backend, loop in (("float32", "xla", "scan"), ("bfloat16", "xla", "scan"),
                                     ("float32", "pallas", "unroll"),
                                     ("bfloat16", "pallas", "unroll")):
            print(json.dumps(compiled_report(model_dir, dtype, backend, loop)), flush=True)
        print(json.dumps(cuda_lowering(model_dir)))


if __name__ == "__main__":
    main()
