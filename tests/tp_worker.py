"""Tensor-parallel cases on forced CPU devices, run in a subprocess by test_tensor_parallel.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/tp_worker.py CASES.json

CASES.json: {"prompts": [[ids]], "new": N, "cases": [{"name", "model", "tp", "config"}]}.
Prints one JSON object: case name -> greedy token ids (or, for a case with "seeded", its seeded
samples; with "features", each request's tokens, logprobs and prompt logprobs under
``FEATURES``: penalties, logit bias, min_new_tokens, logprobs, seeded samples; with "params",
a list of SamplingParams fields taken in turn, e.g. grammars, on the model's own tokenizer;
with "update", a model directory of the same architecture: [the tokens, the tokens after
``update_weights_from_disk`` of it, nothing recompiled]).
Checks on the way (an AssertionError fails the run): the pools and the split weights
(the vocabulary's included) hold 1/tp per device, donation deletes the old pools, no leak after
each workload.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

# the repository first, not tests/ (run as a script, its folders would shadow modules of the
# same name that libraries import, e.g. transformers' `kernels`)
sys.path[0] = str(Path(__file__).resolve().parents[1])

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from minijax_serve import Engine, SamplingParams  # noqa: E402
from minijax_serve.engine.simulated import weight_bytes_per_device  # noqa: E402
from minijax_serve.executor.weight_update import named_leaves  # noqa: E402
from minijax_serve.models.loader import load_model  # noqa: E402


def check_shards(engine: Engine, tp: int) -> None:
    """KV heads and weights split 1/tp, the vocabulary too (padded to a multiple of tp), and a
    device's weights as many bytes as the simulator counts."""
    pool = engine.runner.k_pool
    heads = pool.shape[1]
    assert all(s.data.shape[1] == heads // tp for s in pool.addressable_shards), pool.sharding
    split = [p for p in engine.runner.params if p.sharding.spec and "tp" in p.sharding.spec]
    for p in split:
        dim = list(p.sharding.spec).index("tp")
        assert all(s.data.shape[dim] == p.shape[dim] // tp for s in p.addressable_shards)
    cfg = engine.model_config
    padded = cfg.vocab_size + -cfg.vocab_size % tp
    vocab_split = [p for p in split if padded in p.shape]
    assert len(vocab_split) == (1 if cfg.tie_word_embeddings else 2), [p.shape for p in split]
    device = jax.devices()[0]
    held = sum(s.data.nbytes for p in engine.runner.params for s in p.addressable_shards
               if s.device == device)
    itemsize = engine.runner.params[0].dtype.itemsize
    quantized = engine.config.quantization is not None
    assert held == weight_bytes_per_device(cfg, itemsize, tp, engine.tp.kv_replicas,
                                           quantized), held


def gathers(program) -> list[str]:
    return re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", program.as_text())


def check_gathers(engine: Engine, tp: int) -> None:
    """Where tp divides the vocabulary, a step gathers nothing (a step scoring its prompt: every
    token's logits, [tokens, vocabulary] float32) and its greedy sampler only each device's
    argmax ([sequences, tp] values and ids); else the step gathers its logits, [sequences,
    padded vocabulary] float32, and nothing else. A head whose weight were gathered instead
    would move the whole vocabulary's table."""
    vocab = engine.model_config.vocab_size
    for shape in engine.runner.step_shapes:
        step = gathers(engine.runner.compiled(shape))
        n = shape.num_tokens if shape.verify else shape.num_seqs  # a verify: every token's
        if vocab % tp:
            assert step == [f"f32[{n},{vocab + -vocab % tp}]"], (shape, step)
        else:
            assert step == ([f"f32[{shape.num_tokens},{vocab}]"] if shape.prompt_logprobs
                            else []), (shape, step)
            greedy = gathers(engine.runner.sampler(n, True, False))
            assert sorted(greedy) == [f"f32[{n},{tp}]", f"s32[{n},{tp}]"], (shape, greedy)


FEATURES = [dict(repetition_penalty=1.5, logit_bias={7: 5.0}, min_new_tokens=3),
            dict(logprobs=3, prompt_logprobs=2),
            dict(temperature=0.9, top_k=20, seed=5, frequency_penalty=0.5),
            dict(temperature=0.8, seed=3, logprobs=2),
            dict()]


def check_constrained_gathers(engine: Engine, tp: int) -> None:
    """Under grammars' token masks a greedy sampler still gathers only each device's argmax."""
    for n in sorted({shape.num_seqs for shape in engine.runner.step_shapes}):
        constrained = gathers(engine.runner.sampler(n, True, False, constrained=True))
        assert sorted(constrained) == [f"f32[{n},{tp}]", f"s32[{n},{tp}]"], (n, constrained)


def run(case: dict, prompts: list, new: int) -> list:
    engine = Engine(case["model"], tensor_parallel_size=case["tp"],
                    skip_tokenizer_init="params" not in case, **case["config"])
    if case["tp"] > 1:
        check_shards(engine, case["tp"])
    old_pool = engine.runner.k_pool
    if case.get("seeded"):
        params = [SamplingParams(max_new_tokens=new, temperature=0.9, top_k=20, seed=i,
                                 ignore_eos=True) for i in range(len(prompts))]
    elif case.get("features"):  # every sampler variant, the logprobs programs, the row writers
        params = [SamplingParams(max_new_tokens=new, ignore_eos=True, **FEATURES[i % len(FEATURES)])
                  for i in range(len(prompts))]
    elif case.get("params"):  # each request's SamplingParams fields, in turn
        params = [SamplingParams(**case["params"][i % len(case["params"])])
                  for i in range(len(prompts))]
    else:
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    outs = [[o.token_ids, o.logprobs, o.prompt_logprobs] if case.get("features") else o.token_ids
            for o in outputs]
    assert old_pool.is_deleted(), "the pools were not donated"
    if case["tp"] > 1:
        check_gathers(engine, case["tp"])
        if case.get("params"):
            check_constrained_gathers(engine, case["tp"])
    if case.get("check_memory"):  # no copy of a device's pool inside the step
        local_pool = engine.runner.k_pool.addressable_shards[0].data.nbytes
        for shape in engine.runner.step_shapes:
            temp = engine.runner.compiled(shape).memory_analysis().temp_size_in_bytes
            assert temp < local_pool / 4, (shape, temp, local_pool)
    engine.check_invariants()
    stats = engine.stats()
    assert stats["tensor_parallel_size"] == stats["num_devices"] == case["tp"]
    if case.get("update"):
        return [outs, updated(engine, case["update"], prompts, params)]
    return outs


def updated(engine: Engine, model_dir: str, prompts: list, params) -> list:
    """The greedy tokens after updating ``engine`` to ``model_dir``'s weights, whose served
    form (``engine.model``: the KV heads and the vocabulary as the checkpoint has them) is
    the checkpoint's exactly; nothing recompiles."""
    compiled = engine.stats()["num_compilations"]
    engine.update_weights_from_disk(model_dir, in_flight="recompute")
    served = named_leaves(engine.model)
    expected = named_leaves(nnx.state(load_model(model_dir, use_cache=False).model))
    assert served.keys() == expected.keys()
    assert all(np.array_equal(served[k], expected[k]) for k in expected)
    outs = [o.token_ids for o in engine.generate(prompts, params)]
    assert engine.stats()["num_compilations"] == compiled
    engine.check_invariants()
    return outs


def check_errors() -> None:
    """A model of one's own that states no partition specs runs at tp = 1 only."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from flax import nnx
    from parallel_decoder import ParallelConfig, ParallelDecoder

    model = ParallelDecoder(ParallelConfig(), rngs=nnx.Rngs(0))
    expect_error(lambda: Engine(model, model_config=model.spec(), tensor_parallel_size=2,
                                max_total_tokens=256), "states no partition specs")
    odd = Path(tempfile.mkdtemp()) / "config.json"  # an intermediate size 2 does not divide
    odd.write_text(json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                               "intermediate_size": 33, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "max_position_embeddings": 64}))
    expect_error(lambda: Engine(odd.parent, load_format="dummy", skip_tokenizer_init=True,
                                tensor_parallel_size=2,
                                max_total_tokens=256),
                 "(33) of weight layers.0.w_")  # w_down, w_gate or w_up: the intermediate size


def expect_error(make, message: str) -> None:
    try:
        make()
    except ValueError as err:
        assert message in str(err), err
    else:
        raise AssertionError(f"no ValueError: {message}")


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    check_errors()
    assert len(jax.devices()) >= max(c["tp"] for c in spec["cases"]), jax.devices()
    results = {c["name"]: run(c, spec["prompts"], spec["new"]) for c in spec["cases"]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
