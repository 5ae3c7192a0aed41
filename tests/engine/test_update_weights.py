"""Weights in place (Engine.update_weights): after an update the greedy tokens are HF's (and a
fresh engine's) on the new weights, with nothing recompiled; requests in flight finish on the
old weights or are recomputed on the new ones, as documented, each output naming its weights'
version; bad weights are refused before anything changes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minijax_serve import Engine, SamplingParams
from minijax_serve.executor.weight_update import named_leaves
from minijax_serve.models.loader import load_model
from tests import hf_reference
from tests.engine.test_engine import TINY, assert_idle_and_clean

NEW = 12
CONFIG = dict(TINY, page_size=16)  # test_engine's programs: 4 requests at a time
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_b(tmp_path_factory):
    """The tiny Llama's architecture with other weights."""
    return hf_reference.save_tiny_model("llama", tmp_path_factory.mktemp("llama_b") / "b", seed=1)


@pytest.fixture(scope="module")
def weights(tiny_dir, llama_b):
    """name -> the NNX state of the tiny Llama "a" and of "b"."""
    return {name: nnx.state(load_model(path, use_cache=False).model)
            for name, path in (("a", tiny_dir["llama"]), ("b", llama_b))}


@pytest.fixture(scope="module")
def shared(tiny_dir):
    return Engine(tiny_dir["llama"], **CONFIG)


@pytest.fixture
def engine(shared, weights):
    """The shared engine on weights "a", handed back idle, clean and on "a" again."""
    shared.update_weights(weights["a"])
    yield shared
    while shared.has_unfinished():
        shared.step()
    assert_idle_and_clean(shared)
    shared.update_weights(weights["a"])


@pytest.fixture(scope="module")
def refs(tiny_dir, llama_b, tiny_prompts):
    prompts = tiny_prompts[2::3]
    return prompts, {"a": hf_reference.greedy(tiny_dir["llama"], prompts, NEW),
                     "b": hf_reference.greedy(llama_b, prompts, NEW)}


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def test_update_serves_the_new_weights(engine, weights, refs, llama_b):
    prompts, ref = refs
    assert tokens(engine.generate(prompts, GREEDY)) == ref["a"]  # their pages are cached now
    compiled = engine.stats()["num_compilations"]
    version = engine.weights_version
    assert engine.update_weights(weights["b"]) == version + 1
    outs = engine.generate(prompts, GREEDY)
    assert tokens(outs) == ref["b"]
    assert all(o.weights_version == version + 1 and o.cached_tokens == 0 for o in outs)
    assert engine.stats()["num_compilations"] == compiled  # the same programs, new values
    assert engine.stats()["weights_version"] == version + 1
    fresh = Engine(llama_b, **CONFIG)
    assert tokens(fresh.generate(prompts, GREEDY)) == ref["b"]
    assert_idle_and_clean(fresh)


def test_weights_as_a_flat_dict_of_checkpoint_names_or_from_disk(engine, weights, refs, llama_b):
    prompts, ref = refs
    flat = {name: np.asarray(x) for name, x in named_leaves(weights["b"]).items()}
    assert "layers.1.wq" in flat and "embed_tokens" in flat
    engine.update_weights(flat)  # host arrays: placed on the engine's mesh
    assert tokens(engine.generate(prompts, GREEDY)) == ref["b"]
    assert_idle_and_clean(engine)
    engine.update_weights_from_disk(engine_dir := llama_b)
    assert tokens(engine.generate(prompts, GREEDY)) == ref["b"], engine_dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.update_weights_from_disk(llama_b / "nowhere")


def test_arrays_on_the_device_are_not_copied(engine):
    """A trainer's outputs (here a jitted step's) become the engine's weights as they are, and
    ``engine.model`` is over those very buffers."""
    state = jax.jit(lambda s: jax.tree.map(lambda x: x * 2, s))(nnx.state(engine.model))
    given = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
    engine.update_weights(state)
    assert [p.unsafe_buffer_pointer() for p in engine.runner.params] == given
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.state(engine.model))] == given


def started_and_waiting(engine, prompts, steps: int) -> tuple[list[str], int]:
    """Add every prompt and step until the first ones have tokens while the last waits (four
    run at a time); the ids and how many started."""
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    outs: dict[str, int] = {}
    for _ in range(steps):
        for out in engine.step():
            outs[out.request_id] = out.num_tokens
    assert 0 < outs[rids[0]] < NEW and rids[-1] not in outs
    started = len(engine.scheduler.holders())
    assert [r.rid for r in engine.scheduler.holders()] == rids[:started] and started > 1
    return rids, started


def run_out(engine, rids: list[str]) -> dict:
    """Step until idle; each request's last output."""
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            final[out.request_id] = out
    engine.check_invariants()
    return {rid: final[rid] for rid in rids}


@pytest.mark.parametrize("wait", [True, False])
def test_in_flight_finish_on_the_old_weights(engine, weights, refs, wait):
    prompts, ref = refs
    rids, started = started_and_waiting(engine, prompts, steps=4)
    version = engine.weights_version + 1
    assert engine.update_weights(weights["b"], in_flight="finish", wait=wait) == version
    if wait:
        assert not engine.scheduler.holders()  # the started ones ran to their end first
    else:  # pending: swapped in by a later step, when the started ones are done
        assert engine.weights_update_pending and engine.weights_version == version - 1
        with pytest.raises(RuntimeError, match="an update is pending"):
            engine.update_weights(weights["a"])
        rids.append(engine.add_request(prompts[0], GREEDY))  # waits for the new weights
        prompts, ref = prompts + prompts[:1], {k: v + v[:1] for k, v in ref.items()}
    engine.check_invariants()
    final = run_out(engine, rids)
    assert engine.weights_version == version and not engine.weights_update_pending
    for i, rid in enumerate(rids):
        out = final[rid]
        old = i < started
        assert out.token_ids == ref["a" if old else "b"][i], i
        assert out.weights_version == version - old
        assert set(out.token_weights_versions) == {out.weights_version}


def test_in_flight_recomputed_on_the_new_weights(engine, weights, refs, llama_b):
    prompts, ref = refs
    rids, started = started_and_waiting(engine, prompts, steps=4)
    seen = {rid: engine.get_output(rid).num_tokens for rid in rids[:started]}
    version = engine.update_weights(weights["b"], in_flight="recompute")
    final = run_out(engine, rids)
    for i, rid in enumerate(rids):
        out = final[rid]
        if i >= started:
            assert out.token_ids == ref["b"][i] and out.weights_version == version
            continue
        kept = out.token_weights_versions.count(version - 1)  # the step in flight's too
        old = out.token_ids[:kept]
        assert 0 < seen[rid] <= kept < NEW and old == ref["a"][i][:kept]
        # the rest: greedy on the new weights, from the prompt and the tokens kept
        assert out.token_ids[kept:] == hf_reference.greedy(llama_b, [prompts[i] + old],
                                                           NEW - kept)[0]
        assert out.token_weights_versions == [version - 1] * kept + [version] * (NEW - kept)
        assert out.weights_version == version


def test_bad_weights_are_refused_and_the_old_ones_served(engine, weights, refs):
    prompts, ref = refs
    compiled, version = engine.stats()["num_compilations"], engine.weights_version
    flat = dict(named_leaves(weights["b"]))
    missing = {k: v for k, v in flat.items() if k != "layers.1.w_up"}
    bad = {
        "'layers.1.w_up' is missing": missing,
        "unexpected weight 'layers.2.wq'": {**flat, "layers.2.wq": flat["layers.1.wq"]},
        "'layers.0.wk' has shape (64, 32)": {**flat, "layers.0.wk": flat["layers.0.wk"][:, :32]},
        "'final_norm' has dtype bfloat16": {**flat, "final_norm":
                                            flat["final_norm"].astype(jnp.bfloat16)},
        "must be the model's weights": [1, 2],
    }
    for message, params in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.update_weights(params)
    with pytest.raises(ValueError, match="in_flight must be one of finish, recompute"):
        engine.update_weights(weights["b"], in_flight="later")
    rids, _ = started_and_waiting(engine, prompts, steps=4)
    with pytest.raises(ValueError, match="has dtype int32"):  # refused with requests in flight
        engine.update_weights({**flat, "final_norm": flat["final_norm"].astype(jnp.int32)})
    final = run_out(engine, rids)
    assert [final[rid].token_ids for rid in rids] == ref["a"]
    assert {final[rid].weights_version for rid in rids} == {version}
    assert engine.weights_version == version
    assert engine.stats()["num_compilations"] == compiled


def test_a_simulated_engine_has_no_weights(tiny_dir):
    sim = Engine(tiny_dir["llama"], simulate="h200", **CONFIG)
    with pytest.raises(ValueError, match="simulated engine runs no model"):
        sim.update_weights({})


def test_an_fp8_engine_updates_from_disk(tiny_dir, refs, llama_b):
    """The new checkpoint quantized as the served one was (its FP8 weights and scales)."""
    prompts, _ = refs
    engine = Engine(tiny_dir["llama"], **CONFIG, quantization="fp8")
    engine.update_weights_from_disk(llama_b)
    fresh = Engine(llama_b, **CONFIG, quantization="fp8")
    assert tokens(engine.generate(prompts, GREEDY)) == tokens(fresh.generate(prompts, GREEDY))
    assert_idle_and_clean(engine)
    assert_idle_and_clean(fresh)


def test_a_draft_model_engine_refuses_updates_and_sleep(tiny_dir, weights):
    engine = Engine(tiny_dir["llama"], **CONFIG, speculative_method="draft",
                    speculative_draft_layers=1)
    for call in (lambda: engine.update_weights(weights["b"]), engine.sleep):
        with pytest.raises(ValueError, match="speculative_method='draft' is not supported"):
            call()
    assert_idle_and_clean(engine)
